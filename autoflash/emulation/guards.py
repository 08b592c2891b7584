"""Tensors with guard bands for the sanitizer. Inputs for tests (guarded_randn) and every buffer the
launchers allocate (empty, empty_like, zeros), so that a kernel touching a row past a sequence's end
(or a column past head_dim) is reported as out-of-bounds even though the access itself would not fault.

Each (batch, head) matrix of `rows x cols` sits in a storage of `(rows + GUARD_ROWS) x (cols + guard
columns)`, in the physical order the tensor has ((B, H, L, D) or (B, L, H, D) strides alike), and the
tensor is a view of the real part; one more slice of the outermost dim follows the last. The guard
bytes exist but are no element of the view. A buffer a kernel indexes as contiguous whatever its
strides (the fp32 dQ accumulator, delta, the split-KV partials: `contiguous=True`) cannot have gaps
between its rows: its guard is that trailing slice only, and the rule the launcher's buffers carry
(`rows_rule`: a block may touch only its own (batch, head)'s rows, and of packed sequences only its
own sequence's) finds a row that runs into the next head.

The launcher's buffers are poisoned (every byte POISON) and checked after each sanitized launch
(check_guards). Outside a sanitizing emulation these functions are exactly torch.empty, empty_like
and zeros: a GPU launch pays one device check."""
from __future__ import annotations

import dataclasses
import math
import weakref

import torch

from autoflash.kernels.checks import empty_like_width, physical_order

GUARD_ROWS = 256  # the largest tile: a ragged last tile overruns by less
GUARD_BYTES = 32  # per row: two 16-byte chunks past the last column
POISON = 0xFF  # every guard byte of a launcher's buffer: NaN in fp32, fp16 and bf16, -1 in int32
_CPU = torch.device("cpu")


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


# ------------------------------------------------------------------ the launchers' buffers
@dataclasses.dataclass(frozen=True, eq=False)
class Guard:
    """What the sanitizer knows of one guarded buffer: its roles, where its guard bytes are."""

    name: str  # what the launcher calls it (messages only)
    dims: str  # the role of each dim of the view the launcher got
    rows: str | None  # "q" or "k": packed rows are counted by cu_seqlens_q / cu_seqlens_k
    sizes: tuple[int, ...]  # the view's
    strides: tuple[int, ...]
    physical: tuple[int, ...]  # the padded storage's shape (before the trailing slice), outermost first
    real: tuple[int, ...]  # the view's sizes in that order
    roles: str  # the roles in that order
    elem: int  # bytes per element
    guard: torch.Tensor  # bool per storage element: True on a guard element
    storage: torch.Tensor  # the whole storage as bytes


# storage data pointer -> its Guard, for as long as the view the launcher got lives (views made from it
# later, such as a transpose, are known while it lives; the entry holds the storage, so no other
# tensor can take its address meanwhile).
_GUARDED: dict[int, Guard] = {}


def _sanitizing() -> bool:
    from autoflash.emulation.context import active

    emulation = active()
    return emulation is not None and emulation.sanitize


def empty(shape, dtype: torch.dtype, device: torch.device, dims: str, *, name: str = "", rows: str | None = None,
          contiguous: bool = False) -> torch.Tensor:
    """torch.empty(shape, dtype, device); when sanitizing on the emulator, a guarded view (see the
    module's doc). dims: each dim's role, "b" batch, "h" head, "l" rows, "d" columns ("lhd" for packed
    (total, heads, d)); rows: "q" or "k", which cu_seqlens count packed rows; contiguous: the kernels
    index it as contiguous whatever its strides (no guard rows between its rows)."""
    if device != _CPU or not _sanitizing():  # the GPU path pays this comparison (~0.1 us) only
        return torch.empty(shape, dtype=dtype, device=device)
    shape = tuple(shape)
    return _guarded(shape, tuple(range(len(shape))), dtype, dims, name, rows, contiguous)


def zeros(shape, dtype: torch.dtype, device: torch.device, dims: str, *, name: str = "", rows: str | None = None,
          contiguous: bool = False) -> torch.Tensor:
    """torch.zeros, guarded as `empty` when sanitizing (the elements 0, the guards poisoned)."""
    if device != _CPU or not _sanitizing():  # the GPU path pays this comparison (~0.1 us) only
        return torch.zeros(shape, dtype=dtype, device=device)
    shape = tuple(shape)
    return _guarded(shape, tuple(range(len(shape))), dtype, dims, name, rows, contiguous).zero_()


def empty_like(t: torch.Tensor, dims: str, *, name: str = "", rows: str | None = None,
               width: int | None = None) -> torch.Tensor:
    """torch.empty_like(t) (with `width`, its last dim that wide: V's head dim for an output like q);
    when sanitizing, guarded as `empty`, in the physical order (the strides' order) empty_like would
    give it."""
    if t.is_cuda or not _sanitizing():
        return empty_like_width(t, width)
    return _guarded((*t.shape[:-1], width or t.shape[-1]), physical_order(t), t.dtype, dims, name, rows, False)


def _guarded(shape: tuple[int, ...], order: tuple[int, ...], dtype: torch.dtype, dims: str, name: str,
             rows: str | None, contiguous: bool) -> torch.Tensor:
    if len(dims) != len(shape):
        raise ValueError(f"dims: got {dims!r} for shape {shape}, expected one role letter per dim")
    if rows not in (None, "q", "k"):
        raise ValueError(f"rows: got {rows!r}, expected None, 'q' or 'k'")
    elem = torch.empty((), dtype=dtype).element_size()
    real = tuple(shape[i] for i in order)
    roles = "".join(dims[i] for i in order)
    physical = list(real)
    if not contiguous:
        if "l" in roles:
            physical[roles.index("l")] += GUARD_ROWS
        if roles and roles[-1] == "d":
            physical[-1] += max(1, GUARD_BYTES // elem)
    n = math.prod(physical)
    # One more slice of the outermost dim past the last (at least GUARD_ROWS rows): an index one past
    # along it (the next batch, a split past the last) lands in guard bytes, not in whatever follows.
    row = math.prod(physical[roles.index("l") + 1:]) if "l" in roles else 1
    tail = max(math.prod(physical[1:]) if physical else 1, GUARD_ROWS * row)
    root = torch.full(((n + tail) * elem,), POISON, dtype=torch.uint8)
    view = root.view(dtype)[:n].view(physical)[tuple(slice(0, s) for s in real)]
    view = view.permute(*[order.index(i) for i in range(len(order))])  # back to the launcher's dim order
    guard = torch.ones(n + tail, dtype=torch.bool)
    guard[:n].view(physical)[tuple(slice(0, s) for s in real)] = False
    key = root.untyped_storage().data_ptr()
    _GUARDED[key] = Guard(name, dims, rows, tuple(view.shape), tuple(view.stride()), tuple(physical), real, roles,
                          elem, guard, root)
    weakref.finalize(view, _GUARDED.pop, key, None)
    return view


def guard_of(t: torch.Tensor) -> Guard | None:
    """The Guard of a launcher's buffer `t` is a view of, else None."""
    return _GUARDED.get(t.untyped_storage().data_ptr()) if _GUARDED else None


def rows_rule(t: torch.Tensor, grid: tuple[int, int, int]) -> tuple[int, int, int, str | None]:
    """(z_dim, y_dim, row_dim, rows) for emu_region_rows: t's dims whose index must be the block's
    blockIdx.z (batch) and blockIdx.y (head), and its packed rows' dim with which cu_seqlens count
    them; -1 where no rule holds. A rule holds for a dim of a launcher's buffer whose role says so and
    whose size is the grid's (the launchers' kernels run one (batch, head) per blockIdx.z, .y; a
    kernel with another grid, such as the combine's, gets no rule)."""
    g = guard_of(t)
    if g is None:
        return -1, -1, -1, None
    role = []
    for size, stride in zip(t.shape, t.stride()):  # a view's dims are the buffer's: same size and stride
        match = [r for r, s, st in zip(g.dims, g.sizes, g.strides) if s == size and st == stride and size > 1]
        role.append(match[0] if len(set(match)) == 1 else "")
    z = next((i for i, r in enumerate(role) if r == "b" and t.shape[i] == grid[2]), -1)
    y = next((i for i, r in enumerate(role) if r == "h" and t.shape[i] == grid[1]), -1)
    packed_rows = next((i for i, r in enumerate(role) if r == "l"), -1) if "b" not in g.dims else -1
    return z, y, packed_rows, g.rows if packed_rows >= 0 else None


def check_guards(t: torch.Tensor) -> str | None:
    """None if every guard byte of the launcher's buffer `t` still holds POISON; else what changed
    (the first such element, where it is), and the guards are poisoned again."""
    g = guard_of(t)
    if g is None:
        return None
    raw = g.storage.view(-1, g.elem)
    changed = (raw[g.guard] != POISON).any(1)
    if not bool(changed.any()):
        return None
    bad = g.guard.nonzero()[changed.nonzero()[0, 0], 0].item()
    raw[g.guard] = POISON
    n = math.prod(g.physical)
    label = g.name or "a buffer"
    if bad >= n:
        return (f"guard bytes of {label} changed: element {bad - n} past its last, in the trailing guard (a write past "
                f"the end of the tensor that no checked access saw)")
    at, rest = [], bad
    for size in reversed(g.physical):
        at.append(rest % size)
        rest //= size
    at.reverse()
    names = {"b": "batch", "h": "head", "l": "row", "d": "column"}
    place = ", ".join(f"{names.get(r, 'index')} {i}" for i, r in zip(at, g.roles))
    past = "; ".join(f"{names.get(r, 'index')} {i} is past its {s}" for i, s, r in zip(at, g.real, g.roles) if i >= s)
    return (f"guard bytes of {label} changed at ({place}): {past} (a write past the tensor that no checked "
            f"access saw)")
