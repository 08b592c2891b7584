"""Tensors with guard bands for the sanitizer: each (batch, head) matrix of `rows x cols` sits in a
storage of `(rows + GUARD_ROWS) x (cols + guard columns)`, and the tensor is a view of the real part.
The guard bytes exist but are no element of the tensor, so a kernel that reads row `seqlen` (or a
column past head_dim) is reported as out-of-bounds even though the read itself would not fault."""
from __future__ import annotations

import torch

GUARD_ROWS = 256  # the largest tile: a ragged last tile overruns by less
GUARD_BYTES = 32  # per row: two 16-byte chunks past the last column


def guarded_randn(b: int, h: int, rows: int, cols: int, dtype: torch.dtype, generator: torch.Generator,
                  layout: str = "bhsd") -> torch.Tensor:
    """Random (b, h, rows, cols) values as a view into a guarded storage; "bshd" puts heads inside rows
    (the (B, S, H, D) storage of a transposed view), with guard rows after each batch's sequence."""
    pad_cols = GUARD_BYTES // torch.empty((), dtype=dtype).element_size()
    values = torch.randn(b, h, rows, cols, generator=generator, dtype=torch.float32).to(dtype)
    if layout == "bshd":
        storage = torch.full((b, rows + GUARD_ROWS, h, cols + pad_cols), float("nan"), dtype=dtype)
        view = storage[:, :rows, :, :cols].transpose(1, 2)
    else:
        storage = torch.full((b, h, rows + GUARD_ROWS, cols + pad_cols), float("nan"), dtype=dtype)
        view = storage[:, :, :rows, :cols]
    view.copy_(values)
    return view
