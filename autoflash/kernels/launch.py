"""Runs generated kernels on torch tensors: checks every input before anything reaches the GPU, loads
cubins through CuPy and launches on torch's current stream into torch-allocated outputs; CPU tensors
inside autoflash.emulate() take the same path to the host emulator."""
from __future__ import annotations

import ctypes
import functools
import math
import struct
import threading

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
        for name in config.symbols:  # the dQ pass runs in the dK/dV kernel's shared memory too
            if not name.endswith("_delta"):
                fns[name].max_dynamic_shared_size_bytes = config.smem_bytes
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


class KernelParams:
    """A kernel's parameter list: `pointers` tensors first (their device addresses), then scalars in
    struct codes ("q" long long, "i" int, "f" float), packed by one struct call into a buffer with
    native alignment, the C ABI's: every parameter's bytes sit at the offset the kernel reads them
    from. Per launch that is ~1 us, where numpy scalars cost ~0.2 us each (27 per backward launch).

    Each thread packs into a buffer of its own, kept: a launch copies the parameters when it is
    issued (cuLaunchKernel; the emulator before it runs), so the next launch may overwrite them,
    and the pointers cupy is handed into the buffer are made once."""

    def __init__(self, pointers: int, scalars: str):
        if set(scalars) - set("qif"):
            raise ValueError(f"kernel scalars: got {scalars!r}, expected struct codes from 'qif', one a parameter")
        codes = "P" * pointers + scalars
        self.pointers = pointers
        self.struct = struct.Struct("@" + codes)
        # (offset, size) of each parameter: where the prefix ending with it ends, less its size
        self.spans = tuple((struct.calcsize("@" + codes[:i + 1]) - struct.calcsize(c), struct.calcsize(c))
                           for i, c in enumerate(codes))
        self._local = threading.local()

    def pack(self, tensors: tuple, scalars: tuple) -> ctypes.Array:
        """This thread's buffer, holding the tensors' pointers and the scalars."""
        if len(tensors) != self.pointers:
            raise ValueError(f"kernel tensors: got {len(tensors)}, expected {self.pointers}")
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = ctypes.create_string_buffer(self.struct.size)
        try:
            self.struct.pack_into(buf, 0, *[t.data_ptr() for t in tensors], *scalars)
        except (struct.error, OverflowError) as e:  # a value the parameter's C type cannot hold
            raise ValueError(f"kernel scalars: got {scalars}, expected values their int64/int32/float32 "
                             f"parameters hold ({e})") from None
        return buf

    def cupy_args(self) -> tuple:
        """One cupy CPointer per parameter, into this thread's buffer (pack() first)."""
        args = getattr(self._local, "args", None)
        if args is None:
            c_pointer, base = _cupy()[1], ctypes.addressof(self._local.buf)
            args = self._local.args = tuple(c_pointer(base + offset) for offset, _ in self.spans)
        return args

    def emulator_args(self, tensors: tuple, buf: ctypes.Array) -> tuple:
        """The tensors themselves (the sanitizer maps their storage) and each scalar's packed bytes:
        the very bytes a GPU launch passes."""
        raw = memoryview(buf).cast("B")
        return (*tensors, *(raw[offset:offset + size] for offset, size in self.spans[self.pointers:]))


# The templates' signatures (templates/flash_fwd.cu.j2, flash_bwd.cu.j2), in order:
FWD_PARAMS = KernelParams(5, "q" * 12 + "iii" + "f")  # q k v o lse; 4 x 3 strides; seqlen_q seqlen_k group; scale_log2
DELTA_PARAMS = KernelParams(3, "q" * 6 + "i")  # o dout delta; 2 x 3 strides; seqlen_q
BWD_PARAMS = KernelParams(9, "q" * 18 + "iii" + "ff" + "i")  # q k v dout lse delta dq_accum dk dv; 6 x 3 strides;
#                                                            seqlen_q seqlen_k group; scale scale_log2; n_block0
DQ_PARAMS = KernelParams(7, "q" * 15 + "iii" + "ff")  # q k v dout lse delta dq; 5 x 3 strides;
#                                                    seqlen_q seqlen_k group; scale scale_log2 (the dQ pass)


def _call(fn, grid, threads: int, smem: int, device: torch.device, params: KernelParams, tensors: tuple,
          scalars: tuple, names: tuple[str, ...] = ()) -> None:
    """One launch: on a GPU on torch's current stream of `device`, no synchronisation; on the CPU on
    the emulator, synchronously. `tensors` are passed as their device pointers (`names` label them in
    sanitizer findings), `scalars` as `params` types them."""
    buf = params.pack(tensors, scalars)
    if device.type == "cpu":
        fn(grid, (threads, 1, 1), params.emulator_args(tensors, buf), shared_mem=smem, names=names)
        return
    cupy = _cupy()[0]
    stream = _stream(torch.cuda.current_stream(device).cuda_stream, device.index)
    with cupy.cuda.Device(device.index):
        fn(grid, (threads, 1, 1), params.cupy_args(), shared_mem=smem, stream=stream)


@functools.lru_cache(maxsize=1)
def _cupy():
    """cupy, and its CPointer: an argument cupy passes to the kernel as is, a pointer to the
    parameter's bytes. Looked up once: an import statement costs ~0.5 us a call even when loaded."""
    import cupy
    from cupy.cuda.function import CPointer

    return cupy, CPointer


@functools.lru_cache(maxsize=64)
def _stream(handle: int, device_index: int):
    """A cupy view of torch's stream `handle`; it holds the handle only, so one serves every launch."""
    return _cupy()[0].cuda.ExternalStream(handle, device_index)


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    return t.stride()[:3]


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                  scale: float | None = None, config: KernelConfig | None = None):
    """FlashAttention forward on CUDA tensors (CPU tensors inside autoflash.emulate(): the emulated GPU's
    kernel on the host emulator).

    q: (batch, heads_q, seqlen_q, head_dim); k, v: (batch, heads_kv, seqlen_k, head_dim) with
    heads_kv dividing heads_q (GQA/MQA). Any strides on the first three dims (multiples of 16 bytes),
    contiguous last dim. `causal` is top-left aligned as SDPA's is_causal; scale defaults to
    1/sqrt(head_dim). Returns (out like q, lse (batch, heads_q, seqlen_q) fp32).
    """
    dtype, scale, profile = _prepare(q, k, v, causal, scale, "flash_forward")
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    config = config or default_config(d, dtype, causal, profile)
    check_config(config, d, dtype, causal, profile, "fwd")

    out = torch.empty_like(q)
    lse = torch.empty((b, hq, lq), dtype=torch.float32, device=q.device)
    fn = kernel_functions(config, profile, q)[config.name]
    scalars = (*_strides(q), *_strides(k), *_strides(v), *_strides(out), lq, lk, hq // hkv, scale * LOG2E)
    _call(fn, (math.ceil(lq / config.block_m), hq, b), config.threads, config.smem_bytes, q.device, FWD_PARAMS,
          (q, k, v, out, lse), scalars, ("q", "k", "v", "out", "lse"))
    return out, lse


def flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, *, causal: bool = False, scale: float | None = None,
                   config: KernelConfig | None = None, deterministic: bool = False):
    """FlashAttention backward: (dq, dk, dv) like (q, k, v), from the forward's out and lse
    (fp16/bf16 on tensor cores, fp32 on the SIMT path).

    dQ is added into an fp32 buffer with atomics (config.dq "atomic"); with `deterministic=True` the
    key blocks run one launch at a time, so the additions happen in a fixed order and the gradients
    are bit-identical run to run (slower: each launch has only batch x heads blocks). With config.dq
    "pass" a second kernel computes dQ per query block (no atomics, deterministic as it is). With GQA
    each block writes its query head's dK, dV and the heads that share a K/V head are summed in fp32
    afterwards.
    """
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
          q.device, DELTA_PARAMS, (out, dout, delta), (*_strides(out), *_strides(dout), lq), ("out", "dout", "delta"))

    dq_pass = config.dq == "pass"
    # With the dQ pass the dK/dV kernel never touches dq_accum: a one-element stand-in takes its place.
    dq_accum = torch.zeros((1,) if dq_pass else (b, hq, lq, d), dtype=torch.float32, device=q.device)
    if group == 1:
        dk_x, dv_x = torch.empty_like(k), torch.empty_like(v)
    else:  # per query head, summed below
        dk_x = torch.empty((b, hq, lk, d), dtype=q.dtype, device=q.device)
        dv_x = torch.empty_like(dk_x)
    n_blocks, split = math.ceil(lk / config.block_n), config.head_split
    tensors = (q, k, v, dout, lse, delta, dq_accum, dk_x, dv_x)
    common = (*_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dk_x), *_strides(dv_x),
              lq, lk, group, scale, scale * LOG2E)
    serial = deterministic and not dq_pass  # only the atomics need the fixed order
    for n_block0, blocks in ([(j, 1) for j in range(n_blocks)] if serial else [(0, n_blocks)]):
        _call(fns[config.name], (blocks * split, hq, b), config.threads, config.smem_bytes, q.device, BWD_PARAMS,
              tensors, (*common, n_block0), ("q", "k", "v", "dout", "lse", "delta", "dq_accum", "dk", "dv"))

    if dq_pass:
        dq = torch.empty_like(q)
        _call(fns[f"{config.name}_dq"], (math.ceil(lq / config.block_m), hq, b), config.threads, config.smem_bytes,
              q.device, DQ_PARAMS, (q, k, v, dout, lse, delta, dq),
              (*_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dq), lq, lk, group, scale,
               scale * LOG2E), ("q", "k", "v", "dout", "lse", "delta", "dq"))
    else:
        dq = torch.empty_like(q).copy_(dq_accum)
    if group == 1:
        return dq, dk_x, dv_x
    dk = torch.empty_like(k).copy_(dk_x.view(b, hkv, group, lk, d).sum(2, dtype=torch.float32))
    dv = torch.empty_like(v).copy_(dv_x.view(b, hkv, group, lk, d).sum(2, dtype=torch.float32))
    return dq, dk, dv
