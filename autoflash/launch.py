"""Runs generated kernels on torch tensors: checks every input before anything reaches the GPU, loads
cubins through CuPy and launches on torch's current stream into torch-allocated outputs."""
from __future__ import annotations

import functools
import math

import torch

from autoflash.checks import check_qkv_shapes
from autoflash.compiler import compile_config
from autoflash.config import HEAD_DIM_MAX, HEAD_DIM_MIN, HEAD_DIM_STEP, KernelConfig
from autoflash.defaults import default_config
from autoflash.gpus import GpuProfile, detect

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
LOG2E = 1.4426950408889634  # log2(e): the kernels run the softmax in base 2
_GRID_YZ_MAX = 65535  # CUDA's limit on gridDim.y / gridDim.z (heads, batch)
_INT32_MAX = 2**31 - 1


def check_qkv(q, k, v) -> str:
    """Validates (batch, heads, seqlen, head_dim) inputs; returns the dtype name ("fp16", ...)."""
    check_qkv_shapes(q, k, v, tuple(DTYPE_NAMES))
    (b, hq, lq, d), lk = q.shape, k.shape[2]
    if not (HEAD_DIM_MIN <= d <= HEAD_DIM_MAX and d % HEAD_DIM_STEP == 0):
        raise ValueError(
            f"head_dim: got {d}, expected a multiple of {HEAD_DIM_STEP} in [{HEAD_DIM_MIN}, {HEAD_DIM_MAX}]"
        )
    if b > _GRID_YZ_MAX or hq > _GRID_YZ_MAX or max(lq, lk) > _INT32_MAX:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}: expected batch and heads <= {_GRID_YZ_MAX} and "
            f"sequence lengths <= {_INT32_MAX}"
        )
    align = 16 // q.element_size()  # the kernels move 16-byte chunks
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: got stride {t.stride(-1)} on the last dim, expected 1 (contiguous head_dim)")
        if any(s % align for s in t.stride()[:3]) or t.data_ptr() % 16:
            raise ValueError(
                f"{name}: got strides {t.stride()} (data_ptr % 16 = {t.data_ptr() % 16}); expected the "
                f"first three strides to be multiples of {align} elements and a 16-byte aligned start"
            )
    return DTYPE_NAMES[q.dtype]


def check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: got {type(scale).__name__}, expected a float or None")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: got {scale}, expected a finite number > 0")
    return float(scale)


def check_config(config: KernelConfig, head_dim: int, dtype: str, causal: bool, profile: GpuProfile) -> None:
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config: got {type(config).__name__}, expected a KernelConfig")
    want = (head_dim, dtype, causal, "fwd")
    got = (config.head_dim, config.dtype, config.causal, config.direction)
    if got != want:
        raise ValueError(
            f"config {config.name} is for (head_dim, dtype, causal, direction) = {got}; the call needs {want}"
        )
    config.check_fits(profile.smem_per_block_optin, profile.name)


@functools.lru_cache(maxsize=None)
def _device_profile(index: int) -> GpuProfile:
    return detect(index)


@functools.lru_cache(maxsize=None)
def load_kernel(config: KernelConfig, arch: str, device_index: int):
    """Compiles (disk-cached) and loads the kernel once per device; returns a cupy Function with
    its dynamic shared-memory limit raised to what the config needs."""
    import cupy

    compiled = compile_config(config, arch)
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(path=str(compiled.cubin_path))
        fn = module.get_function(config.name)
        fn.max_dynamic_shared_size_bytes = config.smem_bytes
    fn._autoflash_module = module  # keep the module alive as long as the function
    return fn


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                  scale: float | None = None, config: KernelConfig | None = None):
    """FlashAttention forward on CUDA tensors.

    q: (batch, heads_q, seqlen_q, head_dim); k, v: (batch, heads_kv, seqlen_k, head_dim) with
    heads_kv dividing heads_q (GQA/MQA). Any strides on the first three dims (multiples of 16 bytes),
    contiguous last dim. `causal` is top-left aligned as SDPA's is_causal; scale defaults to
    1/sqrt(head_dim). Returns (out like q, lse (batch, heads_q, seqlen_q) fp32).
    """
    dtype = check_qkv(q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: got {causal!r}, expected a bool")
    if not q.is_cuda:
        raise ValueError(f"flash_forward runs on CUDA tensors; got tensors on {q.device}")
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    scale = check_scale(scale, d)
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    profile = _device_profile(index)
    if config is None:
        config = default_config(d, dtype, causal, profile)
    check_config(config, d, dtype, causal, profile)

    out = torch.empty_like(q)
    lse = torch.empty((b, hq, lq), dtype=torch.float32, device=q.device)
    fn = load_kernel(config, profile.arch, index)
    _launch(fn, config, q, k, v, out, lse, hq // hkv, scale)
    return out, lse


def _launch(fn, config: KernelConfig, q, k, v, out, lse, group: int, scale: float) -> None:
    import cupy
    import numpy as np

    b, hq, lq, _ = q.shape
    lk = k.shape[2]
    ptr = lambda t: np.uint64(t.data_ptr())  # noqa: E731
    strides = lambda t: [np.int64(s) for s in t.stride()[:3]]  # noqa: E731
    args = (ptr(q), ptr(k), ptr(v), ptr(out), ptr(lse), *strides(q), *strides(k), *strides(v), *strides(out),
            np.int32(lq), np.int32(lk), np.int32(group), np.float32(scale * LOG2E))
    grid = (math.ceil(lq / config.block_m), hq, b)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(q.device).cuda_stream, q.device.index)
    with cupy.cuda.Device(q.device.index):
        fn(grid, (config.threads, 1, 1), args, shared_mem=config.smem_bytes, stream=stream)
