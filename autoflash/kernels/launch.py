"""Runs generated kernels on torch tensors: checks every input before anything reaches the GPU, loads
cubins through CuPy and launches on torch's current stream into torch-allocated outputs; CPU tensors
inside autoflash.emulate() take the same path to the host emulator."""
from __future__ import annotations

import functools
import math

import torch

from autoflash.kernels.checks import DTYPE_NAMES, check_config, check_like, check_qkv, check_scale, device_index
from autoflash.kernels.compiler import compile_config
from autoflash.kernels.config import KernelConfig
from autoflash.kernels.defaults import default_backward_config, default_config
from autoflash.kernels.gpus import GpuProfile, detect
from autoflash.reference.forward import LOG2E  # the kernels run the softmax in base 2

DELTA_ROWS_PER_BLOCK = 4  # the backward's delta kernel: one warp per query row, 128 threads

__all__ = ["DTYPE_NAMES", "device_profile", "flash_backward", "flash_forward", "kernel_functions", "load_functions",
           "profile_for"]


@functools.lru_cache(maxsize=None)
def device_profile(index: int) -> GpuProfile:
    """The GpuProfile of CUDA device `index`, probed once per process."""
    return detect(index)


@functools.lru_cache(maxsize=None)
def load_functions(config: KernelConfig, arch: str, device_index: int) -> dict:
    """Compiles (disk-cached) and loads a config's kernels once per device: {symbol: cupy Function},
    the main kernel's dynamic shared-memory limit raised to what the config needs."""
    import cupy

    compiled = compile_config(config, arch)
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(path=str(compiled.cubin_path))
        fns = {n: module.get_function(n) for n in config.symbols}
        fns[config.name].max_dynamic_shared_size_bytes = config.smem_bytes
    fns["_module"] = module  # keeps the module alive as long as its functions
    return fns


def profile_for(t: torch.Tensor, what: str) -> GpuProfile:
    """The GPU whose kernels a call on `t` runs: its CUDA device, or on the CPU the emulated GPU
    (autoflash.emulate / AUTOFLASH_EMULATE). Anything else is refused with what would work."""
    if t.is_cuda:
        return device_profile(device_index(t))
    from autoflash.emulation import ENV, active

    emulation = active() if t.device.type == "cpu" else None
    if emulation is None:
        raise ValueError(f"{what} runs on CUDA tensors; got tensors on {t.device} (on the CPU, run it inside "
                         f"`with autoflash.emulate(gpu=...)` or with {ENV}=<gpu> to emulate a GPU)")
    return emulation.profile


def kernel_functions(config: KernelConfig, profile: GpuProfile, t: torch.Tensor) -> dict:
    """{symbol: callable} of a config's kernels for tensors like `t`: cupy functions on a GPU, the
    emulator's on the CPU (its sanitizing build inside emulate(sanitize=True))."""
    if t.is_cuda:
        return load_functions(config, profile.arch, device_index(t))
    from autoflash.emulation import active
    from autoflash.emulation.module import load_functions as load_emulated

    return load_emulated(config, active().sanitize)


def _prepare(q, k, v, causal, scale, what: str):
    """Common checks of both directions; returns (dtype name, scale, profile)."""
    dtype = check_qkv(q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: got {causal!r}, expected a bool")
    profile = profile_for(q, what)
    return dtype, check_scale(scale, q.shape[-1]), profile


def _call(fn, grid, threads: int, smem: int, device: torch.device, args, names: tuple[str, ...] = ()) -> None:
    """One launch: on a GPU on torch's current stream of `device`, no synchronisation; on the CPU on
    the emulator, synchronously. Tensors in `args` are passed as pointers (`names` label them in
    sanitizer findings)."""
    if device.type == "cpu":
        fn(grid, (threads, 1, 1), args, shared_mem=smem, names=names)
        return
    import cupy
    import numpy as np

    args = tuple(np.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in args)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream, device.index)
    with cupy.cuda.Device(device.index):
        fn(grid, (threads, 1, 1), args, shared_mem=smem, stream=stream)


def _strides(t: torch.Tensor) -> list:
    import numpy as np

    return [np.int64(s) for s in t.stride()[:3]]


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                  scale: float | None = None, config: KernelConfig | None = None):
    """FlashAttention forward on CUDA tensors (CPU tensors inside autoflash.emulate(): the emulated GPU's
    kernel on the host emulator).

    q: (batch, heads_q, seqlen_q, head_dim); k, v: (batch, heads_kv, seqlen_k, head_dim) with
    heads_kv dividing heads_q (GQA/MQA). Any strides on the first three dims (multiples of 16 bytes),
    contiguous last dim. `causal` is top-left aligned as SDPA's is_causal; scale defaults to
    1/sqrt(head_dim). Returns (out like q, lse (batch, heads_q, seqlen_q) fp32).
    """
    import numpy as np

    dtype, scale, profile = _prepare(q, k, v, causal, scale, "flash_forward")
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    config = config or default_config(d, dtype, causal, profile)
    check_config(config, d, dtype, causal, profile, "fwd")

    out = torch.empty_like(q)
    lse = torch.empty((b, hq, lq), dtype=torch.float32, device=q.device)
    fn = kernel_functions(config, profile, q)[config.name]
    args = (q, k, v, out, lse, *_strides(q), *_strides(k), *_strides(v),
            *_strides(out), np.int32(lq), np.int32(lk), np.int32(hq // hkv), np.float32(scale * LOG2E))
    _call(fn, (math.ceil(lq / config.block_m), hq, b), config.threads, config.smem_bytes, q.device, args,
          ("q", "k", "v", "out", "lse"))
    return out, lse


def flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, *, causal: bool = False, scale: float | None = None,
                   config: KernelConfig | None = None, deterministic: bool = False):
    """FlashAttention backward: (dq, dk, dv) like (q, k, v), from the forward's out and lse
    (fp16/bf16 on tensor cores, fp32 on the SIMT path).

    dQ is added into an fp32 buffer with atomics; with `deterministic=True` the key blocks run one
    launch at a time, so the additions happen in a fixed order and the gradients are bit-identical
    run to run (slower: each launch has only batch x heads blocks). With GQA each block writes its
    query head's dK, dV and the heads that share a K/V head are summed in fp32 afterwards.
    """
    import numpy as np

    dtype, scale, profile = _prepare(q, k, v, causal, scale, "flash_backward")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: got {deterministic!r}, expected a bool")
    check_like("out", out, q)
    check_like("dout", dout, q)
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    group = hq // hkv
    if not isinstance(lse, torch.Tensor) or lse.shape != (b, hq, lq) or lse.dtype != torch.float32 \
            or lse.device != q.device:
        got = f"{tuple(lse.shape)} {lse.dtype} on {lse.device}" if isinstance(lse, torch.Tensor) else type(lse).__name__
        raise ValueError(f"lse: got {got}; expected ({b}, {hq}, {lq}) float32 on {q.device} (the forward's LSE)")
    lse = lse.contiguous()
    config = config or default_backward_config(d, dtype, causal, profile)
    check_config(config, d, dtype, causal, profile, "bwd")
    fns = kernel_functions(config, profile, q)

    delta = torch.empty((b, hq, lq), dtype=torch.float32, device=q.device)
    _call(fns[f"{config.name}_delta"], (math.ceil(lq / DELTA_ROWS_PER_BLOCK), hq, b), 32 * DELTA_ROWS_PER_BLOCK, 0,
          q.device, (out, dout, delta, *_strides(out), *_strides(dout), np.int32(lq)), ("out", "dout", "delta"))

    dq_accum = torch.zeros((b, hq, lq, d), dtype=torch.float32, device=q.device)
    if group == 1:
        dk_x, dv_x = torch.empty_like(k), torch.empty_like(v)
    else:  # per query head, summed below
        dk_x = torch.empty((b, hq, lk, d), dtype=q.dtype, device=q.device)
        dv_x = torch.empty_like(dk_x)
    n_blocks, split = math.ceil(lk / config.block_n), config.head_split
    common = (q, k, v, dout, lse, delta, dq_accum, dk_x, dv_x,
              *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dk_x), *_strides(dv_x),
              np.int32(lq), np.int32(lk), np.int32(group), np.float32(scale), np.float32(scale * LOG2E))
    for n_block0, blocks in ([(j, 1) for j in range(n_blocks)] if deterministic else [(0, n_blocks)]):
        _call(fns[config.name], (blocks * split, hq, b), config.threads, config.smem_bytes, q.device,
              (*common, np.int32(n_block0)), ("q", "k", "v", "dout", "lse", "delta", "dq_accum", "dk", "dv"))

    dq = torch.empty_like(q).copy_(dq_accum)
    if group == 1:
        return dq, dk_x, dv_x
    dk = torch.empty_like(k).copy_(dk_x.view(b, hkv, group, lk, d).sum(2, dtype=torch.float32))
    dv = torch.empty_like(v).copy_(dv_x.view(b, hkv, group, lk, d).sum(2, dtype=torch.float32))
    return dq, dk, dv
