"""Shape, dtype and device checks shared by everything that takes attention inputs (the CUDA
launcher and the references): errors say what was received and what is accepted."""
from __future__ import annotations

import torch


def check_qkv_shapes(q, k, v, dtypes: tuple[torch.dtype, ...]) -> None:
    """q (batch, heads_q, seqlen_q, d); k, v (batch, heads_kv, seqlen_k, d), heads_kv | heads_q,
    every size >= 1, one dtype out of `dtypes`, one device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
        if t.dim() != 4:
            raise ValueError(f"{name}: got shape {tuple(t.shape)}, expected 4 dims (batch, heads, seqlen, head_dim)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes differ: got {q.dtype}, {k.dtype}, {v.dtype}; expected one dtype")
    if q.dtype not in dtypes:
        raise TypeError(f"dtype: got {q.dtype}, expected one of {[str(d) for d in dtypes]}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: got {q.device}, {k.device}, {v.device}; expected one device")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: got {tuple(k.shape)} and {tuple(v.shape)}")
    (b, hq, lq, d), (bk, hkv, lk, dk) = q.shape, k.shape
    if b != bk or d != dk:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)}: expected the same batch and head_dim")
    if min(b, hq, hkv, lq, lk, d) == 0:
        raise ValueError(
            f"empty input: got q {tuple(q.shape)}, k {tuple(k.shape)}; expected every size >= 1"
        )
    if hq % hkv:
        raise ValueError(f"heads: got {hq} query heads and {hkv} kv heads; expected kv heads dividing query heads")
