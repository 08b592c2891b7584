"""Tensor maps for TMA (sm_90): what `cuTensorMapEncodeTiled` takes, checked against every constraint
the driver documents for it (cuda.h, CUDA 13: rank, alignment, dims, strides, box, element strides,
swizzle span), then encoded two ways:

- on a GPU, by the CUDA driver (`cuda.bindings.driver.cuTensorMapEncodeTiled`): its opaque 128 bytes;
- for the host emulator, in the project's own 128-byte format, which the emulated `cp.async.bulk.tensor`
  decodes (autoflash/emulation/cuda/runtime/tma.h documents the words and checks the same rules again,
  so a map written by hand is caught too).

A kernel takes a map by value, `const __grid_constant__ TmaDesc map` (templates/common/tma_sm90.cuh).
Dims are given innermost first, as the driver takes them; `for_tensor` builds them from a torch tensor."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

# CUtensorMapDataType of the element types autoflash's kernels copy, and each one's size.
DATA_TYPES = {torch.uint8: 0, torch.int32: 3, torch.int64: 5, torch.float16: 6, torch.float32: 7,
              torch.float64: 8, torch.bfloat16: 9}
_SIZES = {0: 1, 1: 2, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 4, 11: 4, 12: 4}
# CUtensorMapSwizzle by span in bytes (0: none).
SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}
L2_PROMOTION_128B = 2  # CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CUTLASS's choice for TMA loads
MAGIC = 0x31304D5450414641  # the emulator's mark in word 0 (runtime/tma.h kTensorMapMagic)


@dataclass(frozen=True)
class TiledMap:
    """One tiled tensor map: `dims` and `box` in elements and `strides` in bytes (of dims 1..rank-1),
    innermost dim first; `swizzle` the span in bytes (0, 32, 64, 128). Construction checks the
    driver's rules and raises ValueError naming the one broken."""

    data_type: int
    address: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    element_strides: tuple[int, ...] = ()
    swizzle: int = 0
    l2_promotion: int = L2_PROMOTION_128B
    # The tensor it maps, where for_tensor made it: an emulated launch registers it for the sanitizer's
    # out-of-bounds check, as it does tensors passed as pointers.
    tensor: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not self.element_strides:
            object.__setattr__(self, "element_strides", (1,) * len(self.dims))
        check(self)

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def element_size(self) -> int:
        return _SIZES[self.data_type]

    @property
    def box_bytes(self) -> int:
        """What one load of the box completes on its mbarrier (elements outside the tensor included)."""
        n = self.box[0]
        for b, s in zip(self.box[1:], self.element_strides[1:]):
            n *= -(-b // s)
        return n * self.element_size

    def emulated(self) -> np.ndarray:
        """The 128 bytes the emulator's cp.async.bulk.tensor reads (runtime/tma.h's format)."""
        w = np.zeros(16, dtype=np.uint64)
        w[0] = MAGIC
        w[1] = self.address
        w[2] = self.data_type | self.rank << 8 | SWIZZLES[self.swizzle] << 24 | self.l2_promotion << 32
        w[3:3 + self.rank] = self.dims
        w[8:8 + self.rank - 1] = self.strides
        w[12] = sum(b << (12 * d) for d, b in enumerate(self.box))
        w[13] = sum(s << (4 * d) for d, s in enumerate(self.element_strides))
        return w.view(np.uint8)

    def encoded(self) -> bytes:
        """The driver's CUtensorMap for this map (needs the CUDA driver: a GPU machine). Encoded once
        per distinct map (address, dims, strides, box, swizzle, type: the dataclass's fields), as every
        launch on the same tensors asks for the same bytes: ~11 us of Python each, four per sm90
        forward and per key block of the deterministic backward. The cache holds the fields, never
        the tensor."""
        return _encode(self.data_type, self.address, self.dims, self.strides, self.box, self.element_strides,
                       self.swizzle, self.l2_promotion)


@functools.lru_cache(maxsize=4096)
def _encode(data_type: int, address: int, dims: tuple, strides: tuple, box: tuple, element_strides: tuple,
            swizzle: int, l2_promotion: int) -> bytes:
    from cuda.bindings import driver

    # The bindings take the lists as cuuint64_t (dims, strides) and cuuint32_t (box, element strides),
    # as cuda.h types them; plain ints are a TypeError before the driver is reached.
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    err, tmap = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType(data_type), len(dims), address, [u64(n) for n in dims], [u64(s) for s in strides],
        [u32(b) for b in box], [u32(s) for s in element_strides],
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle(SWIZZLES[swizzle]), driver.CUtensorMapL2promotion(l2_promotion),
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise ValueError(f"cuTensorMapEncodeTiled refused the map of {dims} elements (innermost first) at "
                         f"{address:#x}, strides {strides} bytes, box {box}, swizzle {swizzle}: {err!r}")
    return np.array([int(x) for x in tmap.opaque], dtype=np.uint64).tobytes()


def check(m: TiledMap) -> None:
    """Raises ValueError for what cuTensorMapEncodeTiled refuses (interleave none, as autoflash uses)."""
    rank = len(m.dims)
    if m.data_type not in _SIZES:
        raise ValueError(f"tensor map data type: got {m.data_type}, expected a CUtensorMapDataType 0..12")
    size = _SIZES[m.data_type]
    if not 1 <= rank <= 5:
        raise ValueError(f"tensor map rank: got {rank} dims, expected 1..5")
    if len(m.strides) != rank - 1 or len(m.box) != rank or len(m.element_strides) != rank:
        raise ValueError(f"tensor map of rank {rank}: got {len(m.strides)} strides, {len(m.box)} box dims and "
                         f"{len(m.element_strides)} element strides, expected {rank - 1}, {rank} and {rank}")
    if m.address % 16:
        raise ValueError(f"tensor map global address: got {m.address:#x}, expected a multiple of 16")
    for d, n in enumerate(m.dims):
        if not 1 <= n <= 2**32:
            raise ValueError(f"tensor map dim {d}: got {n} elements, expected 1..2^32")
    for d, s in enumerate(m.strides, start=1):
        if s % 16 or not 0 <= s < 2**40:
            raise ValueError(f"tensor map stride of dim {d}: got {s} bytes, expected a multiple of 16 below 2^40")
    for d, b in enumerate(m.box):
        if not 1 <= b <= 256:
            raise ValueError(f"tensor map box dim {d}: got {b}, expected 1..256")
    for d, s in enumerate(m.element_strides):
        if not 1 <= s <= 8:
            raise ValueError(f"tensor map element stride of dim {d}: got {s}, expected 1..8")
    inner = m.box[0] * size
    if inner % 16:
        raise ValueError(f"tensor map inner box: got {m.box[0]} elements = {inner} bytes, expected a multiple of 16")
    if m.swizzle not in SWIZZLES:
        raise ValueError(f"tensor map swizzle: got {m.swizzle}, expected a span of {sorted(SWIZZLES)} bytes")
    if m.swizzle and inner > m.swizzle:
        raise ValueError(f"tensor map inner box: got {inner} bytes, expected at most the {m.swizzle}-byte swizzle span")
    if m.l2_promotion not in range(4):
        raise ValueError(f"tensor map L2 promotion: got {m.l2_promotion}, expected 0..3")


def for_tensor(t: torch.Tensor, box: tuple[int, ...], swizzle: int = 0) -> TiledMap:
    """The map of tensor `t` (its last dim contiguous) copied in boxes of `box`, given in the tensor's
    own dim order (outermost first, as its shape). On a GPU the map is one of a cache keyed by what
    it encodes (address, shape, strides, dtype, box, swizzle): a launch on the same tensors as an
    earlier one pays a dict lookup, not the checks (~20 us for an sm90 forward's four maps); on the
    CPU it holds `t` for the emulator's sanitizer."""
    if t.is_cuda:
        return cached_map(t.dtype, t.data_ptr(), tuple(t.shape), t.stride(), tuple(box), swizzle)
    return _map(t.dtype, t.data_ptr(), tuple(t.shape), t.stride(), tuple(box), swizzle, t)


@functools.lru_cache(maxsize=4096)
def cached_map(dtype: torch.dtype, address: int, shape: tuple, strides: tuple, box: tuple, swizzle: int) -> TiledMap:
    """for_tensor's map of a CUDA tensor, by its fields (the cache holds no tensor)."""
    return _map(dtype, address, shape, strides, box, swizzle, None)


def _map(dtype: torch.dtype, address: int, shape: tuple, strides: tuple, box: tuple, swizzle: int,
         tensor: torch.Tensor | None) -> TiledMap:
    if dtype not in DATA_TYPES:
        raise TypeError(f"tensor map of a {dtype} tensor: expected one of {sorted(map(str, DATA_TYPES))}")
    if len(box) != len(shape):
        raise ValueError(f"tensor map box: got {len(box)} dims {box}, expected one per dim of shape {shape}")
    if shape and strides[-1] != 1 and shape[-1] > 1:
        raise ValueError(f"tensor map of a tensor with strides {strides}: expected its last dim contiguous")
    size = _SIZES[DATA_TYPES[dtype]]
    return TiledMap(DATA_TYPES[dtype], address, tuple(reversed(shape)), tuple(s * size for s in reversed(strides[:-1])),
                    tuple(reversed(box)), swizzle=swizzle, tensor=tensor)
