"""Runs generated kernels on torch tensors: checks every input before anything reaches the GPU, loads
cubins through CuPy and launches on torch's current stream into torch-allocated outputs; CPU tensors
inside autoflash.emulate() take the same path to the host emulator."""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import math
import struct
import threading

import torch

from autoflash.kernels import backend
from autoflash.kernels.checks import DTYPE_NAMES, check_config, check_like, check_qkv, check_scale, device_index, \
    empty_like_width
from autoflash.kernels.compiler import compile_config
from autoflash.kernels.config import HEAD_DIM_MAX, KernelConfig
from autoflash.kernels.defaults import call_default
from autoflash.kernels.driver import check_driver
from autoflash.kernels.gpus import GpuProfile, detect
from autoflash.kernels.tensor_map import for_tensor
from autoflash.kernels.variants import LOG2E, empty_forward, heads_view, resolve, views, with_variant


__all__ = ["DTYPE_NAMES", "device_profile", "flash_backward", "flash_forward", "kernel_functions", "load_functions",
           "profile_for", "variant_config"]


@functools.lru_cache(maxsize=None)
def device_profile(index: int) -> GpuProfile:
    """The GpuProfile of CUDA device `index`, probed once per process; first, DriverMismatchError when
    the machine's driver is older than the CUDA stack the kernels are built and launched with."""
    check_driver()
    return detect(index)


@functools.lru_cache(maxsize=None)
def load_functions(config: KernelConfig, profile: GpuProfile, device_index: int) -> dict:
    """Compiles (disk-cached) and loads a config's kernels once per device: {symbol: cupy Function},
    the main kernel's dynamic shared-memory limit raised to what the config needs."""
    import cupy

    compiled = compile_config(config, profile.arch)
    check_params(config, compiled.cubin)  # what the driver will read is what _call packs
    check_shared_memory(config, compiled.resources.static_smem_bytes, profile)
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(path=str(compiled.cubin_path))
        fns = {n: module.get_function(n) for n in config.symbols}
        for name in config.symbols:  # the dQ pass runs in the dK/dV kernel's shared memory too
            if not name.endswith("_delta"):
                fns[name].max_dynamic_shared_size_bytes = config.smem_bytes
    fns["_module"] = module  # keeps the module alive as long as its functions
    return fns


def check_shared_memory(config: KernelConfig, static_bytes: int, profile: GpuProfile) -> None:
    """cuFuncSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) refuses a size that, with the
    kernel's static shared memory, exceeds the device's opt-in limit per block (CUDA Driver API
    reference): a ValueError naming the three before the driver is asked."""
    if config.smem_bytes + static_bytes > profile.smem_per_block_optin:
        raise ValueError(f"{config.name}: got {config.smem_bytes} bytes of dynamic and {static_bytes} of static shared "
                         f"memory, expected at most {profile.smem_per_block_optin} bytes in all on {profile.name} "
                         f"(its opt-in limit per block)")


def profile_for(t: torch.Tensor, what: str) -> GpuProfile:
    """The GPU whose kernels a call on `t` runs: its CUDA device, or on the CPU the one the host
    backend runs as (the emulator: autoflash.emulate / AUTOFLASH_EMULATE). Anything else is refused
    with what would work."""
    if t.is_cuda:
        return device_profile(device_index(t))
    host = backend.host() if t.device.type == "cpu" else None
    profile = host.profile() if host is not None else None
    if profile is None:
        hint = f" ({host.hint})" if host is not None else ""
        raise ValueError(f"{what} runs on CUDA tensors; got tensors on {t.device}{hint}")
    return profile


_RAN: contextvars.ContextVar[list | None] = contextvars.ContextVar("autoflash_ran", default=None)


@contextlib.contextmanager
def recording():
    """with recording() as ran: `ran` lists the KernelConfig of every kernel the launchers load inside
    the block, in order (what a call ran; autoflash.selfcheck prints it)."""
    ran: list[KernelConfig] = []
    token = _RAN.set(ran)
    try:
        yield ran
    finally:
        _RAN.reset(token)


def kernel_functions(config: KernelConfig, profile: GpuProfile, t: torch.Tensor) -> dict:
    """{symbol: callable} of a config's kernels for tensors like `t`: cupy functions on a GPU, the
    host backend's on the CPU (the emulator's; its sanitizing build inside emulate(sanitize=True))."""
    ran = _RAN.get()
    if ran is not None:
        ran.append(config)
    if t.is_cuda:
        return load_functions(config, profile, device_index(t))
    return backend.host().functions(config)


# The launchers' buffers: torch's on a GPU (one device check), the host backend's on the CPU (the
# emulator surrounds them with guard bands when sanitizing: emulation/guards.py).
def empty(shape, dtype: torch.dtype, device: torch.device, dims: str, *, name: str = "", rows: str | None = None,
          contiguous: bool = False) -> torch.Tensor:
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    return backend.host().empty(shape, dtype, device, dims, name=name, rows=rows, contiguous=contiguous)


def zeros(shape, dtype: torch.dtype, device: torch.device, dims: str, *, name: str = "", rows: str | None = None,
          contiguous: bool = False) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return backend.host().zeros(shape, dtype, device, dims, name=name, rows=rows, contiguous=contiguous)


def empty_like(t: torch.Tensor, dims: str, *, name: str = "", rows: str | None = None,
               width: int | None = None) -> torch.Tensor:
    if t.device.type != "cpu":
        return empty_like_width(t, width)
    return backend.host().empty_like(t, dims, name=name, rows=rows, width=width)


def _prepare(q, k, v, causal, scale, what: str):
    """Common checks of both directions; returns (dtype name, scale, profile)."""
    dtype = check_qkv(q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: got {causal!r}, expected a bool")
    profile = profile_for(q, what)
    return dtype, check_scale(scale, q.shape[-1]), profile


class KernelParams:
    """A kernel's parameter list: `maps` TMA tensor maps first (128 bytes each by value; the sm90
    family's, at offsets that keep their 64-byte alignment), then `pointers` tensors (their device
    addresses; None is a null pointer, what a kernel gets for an argument the call does not have),
    then scalars in struct codes ("q" long long, "i" int, "f" float), packed by one struct call into a
    buffer with native alignment, the C ABI's: every parameter's bytes sit at the offset the kernel
    reads them from. Per launch that is ~1 us, where numpy scalars cost ~0.2 us each (27 per backward
    launch).

    Each thread packs into a buffer of its own, kept: a launch copies the parameters when it is
    issued (cuLaunchKernel; the emulator before it runs), so the next launch may overwrite them,
    and the pointers cupy is handed into the buffer are made once."""

    def __init__(self, pointers: int, scalars: str, maps: int = 0):
        if set(scalars) - set("qif"):
            raise ValueError(f"kernel scalars: got {scalars!r}, expected struct codes from 'qif', one a parameter")
        codes = ["128s"] * maps + ["P"] * pointers + list(scalars)
        self.maps, self.pointers = maps, pointers
        self.struct = struct.Struct("@" + "".join(codes))
        # (offset, size) of each parameter: where the prefix ending with it ends, less its size
        self.spans = tuple((struct.calcsize("@" + "".join(codes[:i + 1])) - struct.calcsize(c), struct.calcsize(c))
                           for i, c in enumerate(codes))
        self._local = threading.local()

    def pack(self, tensors: tuple, scalars: tuple, maps: tuple = ()) -> ctypes.Array:
        """This thread's buffer, holding the maps' bytes, the tensors' pointers and the scalars."""
        if len(tensors) != self.pointers:
            raise ValueError(f"kernel tensors: got {len(tensors)}, expected {self.pointers}")
        if len(maps) != self.maps:
            raise ValueError(f"kernel tensor maps: got {len(maps)}, expected {self.maps}")
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = ctypes.create_string_buffer(self.struct.size)
        try:
            self.struct.pack_into(buf, 0, *maps, *[0 if t is None else t.data_ptr() for t in tensors], *scalars)
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

    def emulator_args(self, tensors: tuple, buf: ctypes.Array, maps: tuple = ()) -> tuple:
        """The maps and tensors themselves (the sanitizer registers the tensors) and each scalar's
        packed bytes: the very bytes a GPU launch passes."""
        raw = memoryview(buf).cast("B")
        return (*maps, *tensors, *(raw[offset:offset + size] for offset, size in self.spans[self.maps + self.pointers:]))


# The templates' signatures (templates/flash_fwd.cu.j2, flash_bwd.cu.j2), in order. Every kernel but
# delta also takes the variants' arguments: pointers cu_seqlens_q cu_seqlens_k seq_end_q seq_end_k
# alibi_slopes key_bias;
# scalars lse_sb lse_sh alibi_sb bias_sb (after the strides), window_left window_right chunk (after the
# ints), softcap_in softcap_out (after the floats).
# The forward also takes the decode switches' (kernels/decode.py): pointers cache_seqlens
# cache_batch_idx cache_leftpad block_table o_accum lse_accum; block_table_sb (after bias_sb);
# page_size num_splits qpack (after chunk).
_VARIANT_POINTERS = ("cu_seqlens_q", "cu_seqlens_k", "seq_end_q", "seq_end_k", "alibi_slopes", "key_bias")
DECODE_POINTERS = ("cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table", "o_accum", "lse_accum")
FWD_NAMES = ("q", "k", "v", "out", "lse", *_VARIANT_POINTERS, *DECODE_POINTERS)
FWD_PARAMS = KernelParams(17, "q" * 17 + "i" * 9 + "fff")  # q k v o lse +6 +6; 4 x 3 strides +4 +1;
#                                                  seqlen_q seqlen_k group +3 +3; scale_log2 +2
COMBINE_PARAMS = KernelParams(6, "q" * 5 + "iiii")  # o_accum lse_accum o lse q_starts q_ends; o and lse
#                                    strides; batch heads rows num_splits (templates/flash_combine.cu.j2)
DELTA_PARAMS = KernelParams(3, "q" * 6 + "i")  # o dout delta; 2 x 3 strides; seqlen_q
BWD_PARAMS = KernelParams(15, "q" * 22 + "iiiiii" + "ffff" + "i")  # q k v dout lse delta dq_accum dk dv +6;
#                                       6 x 3 strides +4; seqlen_q seqlen_k group +3; scale scale_log2 +2; n_block0
# The sm90 family's forward (templates/flash_fwd_sm90.cu.j2): q k v o qv maps (qv's: q's where the kernel
# has no qv); o (packed sequences' plain stores) lse +6 variant pointers +6 decode pointers, k_cache v_cache
# (gathered pages' rows); o_sm o_sh lse_sb lse_sh alibi_sb bias_sb block_table_sb, k and v (page, head, row)
# strides; seqlen_q seqlen_k group window_left window_right chunk page_size num_splits qpack; scale_log2
# softcap_in softcap_out.
SM90_FWD_NAMES = ("q", "k", "v", "out", "qv", "out", "lse", *_VARIANT_POINTERS, *DECODE_POINTERS, "k_cache",
                  "v_cache")
SM90_FWD_PARAMS = KernelParams(16, "q" * 13 + "i" * 9 + "fff", maps=5)
# The sm90 family's backward (templates/flash_bwd_sm90.cu.j2): its delta kernel, o dout lse delta lse2
# cu_seqlens_q seq_end_q q_pad; o and dout strides, lse's two; seqlen_q padded_q. The main kernel: q k v
# dout maps; lse2 delta dq_accum dk dv +6 variant pointers, q_pad; dk and dv strides, alibi_sb bias_sb;
# seqlen_q seqlen_k padded_q group window_left window_right chunk; scale scale_log2 softcap_in
# softcap_out; n_block0. q_pad (packed sequences): each sequence's first row in the padded buffers.
SM90_DELTA_NAMES = ("out", "dout", "lse", "delta", "lse2", "cu_seqlens_q", "seq_end_q", "q_pad")
SM90_DELTA_PARAMS = KernelParams(8, "q" * 8 + "ii")
SM90_BWD_NAMES = ("q", "k", "v", "dout", "lse2", "delta", "dq_accum", "dk", "dv", *_VARIANT_POINTERS, "q_pad")
SM90_BWD_PARAMS = KernelParams(12, "q" * 8 + "i" * 7 + "ffff" + "i", maps=4)
DQ_PARAMS = KernelParams(13, "q" * 19 + "iiiiii" + "ffff")  # q k v dout lse delta dq +6; 5 x 3 strides +4;
#                                       seqlen_q seqlen_k group +3; scale scale_log2 +2 (the dQ pass)


def params_for(config: KernelConfig) -> dict[str, KernelParams]:
    """{symbol: the parameter list its launches pack} for every kernel a config's source defines."""
    if config.family == "sm90":
        if config.direction == "fwd":
            combine = {f"{config.name}_combine": COMBINE_PARAMS} if config.split else {}
            return {config.name: SM90_FWD_PARAMS, **combine}
        return {config.name: SM90_BWD_PARAMS, f"{config.name}_delta": SM90_DELTA_PARAMS}
    if config.direction == "fwd":
        return {config.name: FWD_PARAMS, **({f"{config.name}_combine": COMBINE_PARAMS} if config.split else {})}
    return {config.name: BWD_PARAMS, f"{config.name}_delta": DELTA_PARAMS,
            **({f"{config.name}_dq": DQ_PARAMS} if config.dq == "pass" else {})}


def check_params(config: KernelConfig, cubin: bytes) -> None:
    """ValueError unless every kernel's parameter table in the cubin (what the driver copies at
    launch: count, size and C offset of each parameter) is the list the launcher packs for it."""
    from autoflash.kernels.cubin import param_table

    for symbol, params in params_for(config).items():
        table = param_table(cubin, symbol)
        if table.relative != params.spans:
            raise ValueError(f"{symbol}: the cubin's parameters (offset, size) are {table.relative}; the launcher "
                             f"packs {params.spans} ({params.struct.format})")


def _call(fn, grid, threads: int, smem: int, device: torch.device, params: KernelParams, tensors: tuple,
          scalars: tuple, names: tuple[str, ...] = (), maps: tuple = ()) -> None:
    """One launch: on a GPU on torch's current stream of `device`, no synchronisation; on the CPU on
    the emulator, synchronously. `maps` (TiledMap) are passed by value, encoded by the driver on a GPU
    and in the emulator's format on the CPU; `tensors` as their device pointers (`names` label maps
    and tensors in sanitizer findings); `scalars` as `params` types them."""
    if device.type == "cpu":
        buf = params.pack(tensors, scalars, tuple(m.emulated().tobytes() for m in maps))
        fn(grid, (threads, 1, 1), params.emulator_args(tensors, buf, maps), shared_mem=smem, names=names)
        return
    buf = params.pack(tensors, scalars, tuple(m.encoded() for m in maps))
    cupy = _cupy()[0]
    handle = torch.cuda.current_stream(device).cuda_stream
    with cupy.cuda.Device(device.index):
        fn(grid, (threads, 1, 1), params.cupy_args(), shared_mem=smem, stream=_stream(handle, device.index))


@functools.lru_cache(maxsize=1)
def _cupy():
    """cupy, and its CPointer: an argument cupy passes to the kernel as is, a pointer to the
    parameter's bytes. Looked up once: an import statement costs ~0.5 us a call even when loaded."""
    import cupy
    from cupy.cuda.function import CPointer

    return cupy, CPointer


class _StreamHandle:
    """A torch stream's handle in the CUDA stream protocol (`__cuda_stream__`: version 0, the
    cudaStream_t), which cupy.cuda.Stream.from_external takes; torch's own Stream objects have the
    method only in recent releases, this works with any."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


@functools.lru_cache(maxsize=None)
def _stream(handle: int, device_index: int):
    """A cupy Stream over torch's stream `handle` on `device_index` (call it with that device
    current: from_external records the current device). CuPy 14 deprecates ExternalStream for
    Stream.from_external (cupy/cupy#9567), whose Stream never destroys a foreign handle; these are
    also kept for the process's life (torch draws stream handles from a small fixed pool per
    device), so none is ever collected."""
    return _cupy()[0].cuda.Stream.from_external(_StreamHandle(handle))


def _strides(t: torch.Tensor, varlen: bool = False) -> tuple[int, ...]:
    """(batch, head, row) strides of a (B, H, L, D) view; packed sequences have no batch stride (a
    sequence's rows start at its cu_seqlens entry)."""
    sb, sh, sm = t.stride()[:3]
    return (0 if varlen else sb), sh, sm


def variant_config(config: KernelConfig | None, direction: str, d: int, dtype: str, causal: bool, variant,
                   profile: GpuProfile, head_dim_v: int | None = None) -> KernelConfig:
    """The kernel a call launches: `config` (tuned or explicit) with the call's variant switches
    (kernels.variants.resolve) turned on, or the built-in one (defaults.call_default; `head_dim_v`:
    V's head dim where it differs)."""
    if config is not None and not isinstance(config, KernelConfig):
        return with_variant(config, causal, variant)  # its TypeError
    return _variant_config(config, direction, d, dtype, causal, tuple(variant.switches.items()), profile, head_dim_v)


# Decided once per signature: the default's lookup and the variant's replace (with KernelConfig's
# validation) were ~15% of autoflash.attention's host time per call on the first H200 run.
@functools.lru_cache(maxsize=4096)
def _variant_config(config: KernelConfig | None, direction: str, d: int, dtype: str, causal: bool, switches: tuple,
                    profile: GpuProfile, head_dim_v: int | None) -> KernelConfig:
    if config is None:
        return call_default(direction, d, dtype, causal, dict(switches), profile, head_dim_v)
    return config.replace(causal=causal, **dict(switches))


def family_reason(config: KernelConfig, profile: GpuProfile) -> str | None:
    """Why a forward or backward on an sm_90 GPU runs on the sm80 family (None where it runs on sm90,
    or the GPU has no sm90 family): what explain() says."""
    if profile.arch != "sm_90" or config.family == "sm90":
        return None
    if config.head_dim_v is not None and config.direction == "fwd" and config.head_dim > HEAD_DIM_MAX:
        return (f"Q and K's head dim {config.head_dim} (qv's columns appended) is above the sm90 family's "
                f"{HEAD_DIM_MAX}")
    if config.head_dim_v is not None and config.head_dim_v % 16:
        return f"V's head dim {config.head_dim_v} is not a multiple of 16 (wgmma's N step)"
    if config.dtype == "fp32":
        return "fp32 runs on the SIMT kernels"
    if config.head_dim % 16:
        return f"head dim {config.head_dim} is not a multiple of 16 (wgmma's k step)"
    from autoflash.kernels.defaults import stack_note

    return stack_note(config, profile) or "the tuned table picked it for this GPU"


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                  scale: float | None = None, config: KernelConfig | None = None, align: str = "top_left",
                  window=(-1, -1), softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                  key_bias: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
                  cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                  max_seqlen_k: int | None = None, attention_chunk: int = 0, seqused_q: torch.Tensor | None = None,
                  seqused_k: torch.Tensor | None = None):
    """FlashAttention forward on CUDA tensors (CPU tensors inside autoflash.emulate(): the emulated GPU's
    kernel on the host emulator).

    q: (batch, heads_q, seqlen_q, head_dim); k, v: (batch, heads_kv, seqlen_k, head_dim) with
    heads_kv dividing heads_q (GQA/MQA); v's head dim (and out's) may differ, up to 512
    (FlashAttention-3's headdim_v; fp16/bf16). Any strides on the first three dims (multiples of 16
    bytes), contiguous last dim. `causal` is aligned by `align`: top_left as SDPA's is_causal (query i sees
    keys j <= i), bottom_right as flash-attn's (j <= i + seqlen_k - seqlen_q); scale defaults to
    1/sqrt(head_dim). Returns (out like q, lse (batch, heads_q, seqlen_q) fp32).

    Variants (fp16/bf16; each turns on its KernelConfig switch, on `config` too):
    window=(left, right), -1 unbounded: keys i + diag - left .. i + diag + right (with causal, right is
    0); attention_chunk > 0 (FlashAttention-3's chunked local attention): as well, only the keys of the
    chunk of attention_chunk keys that holds key i + diag; softcap > 0: scores cap * tanh(scale * s /
    cap); alibi_slopes fp32 (heads_q,) or (batch, heads_q): scores - slope * |i + diag - j|; key_bias
    fp32 (batch, seqlen_k): added to every row's scores (-inf masks the key); cu_seqlens_q /
    cu_seqlens_k (int32, batch + 1) with max_seqlen_q / max_seqlen_k: packed sequences, q (total_q,
    heads_q, d), k, v (total_k, heads_kv, d), lse (heads_q, total_q). The cu_seqlens values are trusted
    (flash_attn_varlen_func checks them). seqused_q / seqused_k (int32 (batch,), FlashAttention-3's) use
    only the first seqused[b] rows of sequence b's span: the rows past seqused_q get out 0 and lse +inf,
    the keys past seqused_k are not seen.
    """
    varlen, q4, k4, v4 = views(q, k, v, cu_seqlens_q, cu_seqlens_k)
    if varlen and 0 in (q.shape[0], k.shape[0]):  # no rows, or no keys for any row: nothing to launch
        return empty_forward(q, k, v, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              alibi_slopes, softcap, window, align, attention_chunk, seqused_q, seqused_k)
    dtype, scale, profile = _prepare(q4, k4, v4, causal, scale, "flash_forward")
    causal, variant = resolve(q4, k4, causal, align=align, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                              key_bias=key_bias, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, attention_chunk=attention_chunk,
                              seqused_q=seqused_q, seqused_k=seqused_k)
    b, hq, lq, d = q4.shape
    hkv, lk, dv = k4.shape[1], k4.shape[2], v4.shape[3]
    if varlen:
        b, lq, lk = cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k
    config = variant_config(config, "fwd", d, dtype, causal, variant, profile, dv)
    check_config(config, d, dtype, causal, profile, "fwd", dv)

    out = empty_like(q, "lhd" if varlen else "bhld", name="out", rows="q", width=dv)
    lse = empty((hq, q.shape[0]) if varlen else (b, hq, lq), torch.float32, q.device, "hl" if varlen else "bhl",
                       name="lse", rows="q")
    if variant.seqused:  # rows past seqused_q are never written: no key seen
        out.zero_()
        lse.fill_(math.inf)
    out4 = heads_view(out) if varlen else out
    if lq == 0:
        return out, lse
    fn = kernel_functions(config, profile, q)[config.name]
    if config.family == "sm90":
        maps = sm90_maps(config, q4, k4, v4, out4)
        maps += maps[:1]  # no qv here: q's map in its place, never read
        o_rows = (out, out.stride(0), out.stride(1)) if varlen else (None, 0, 0)  # packed: plain stores
        # no KV cache: block_table_sb and the caches' strides 0, page_size num_splits qpack 1
        scalars = (*o_rows[1:], *variant.scalars(lse), *(0,) * 7, lq, lk, hq // hkv, *variant.window, 1, 1, 1,
                   scale * LOG2E, *variant.softcap_factors(scale))
        for sequences, pointers in variant.runs(b):
            _call(fn, (math.ceil(lq / config.block_m) * config.head_split, hq, sequences), config.threads,
                  config.smem_bytes, q.device, SM90_FWD_PARAMS,
                  (o_rows[0], lse, *pointers, *(None,) * (len(DECODE_POINTERS) + 2)), scalars, SM90_FWD_NAMES, maps)
        return out, lse
    scalars = (*_strides(q4, varlen), *_strides(k4, varlen), *_strides(v4, varlen), *_strides(out4, varlen),
               *variant.scalars(lse), 0, lq, lk, hq // hkv, *variant.window, 1, 1, 1,
               scale * LOG2E, *variant.softcap_factors(scale))
    for sequences, pointers in variant.runs(b):
        _call(fn, (math.ceil(lq / config.block_m) * config.head_split, hq, sequences), config.threads,
              config.smem_bytes, q.device, FWD_PARAMS, (q, k, v, out, lse, *pointers, *(None,) * len(DECODE_POINTERS)),
              scalars, FWD_NAMES)
    return out, lse


def tile_maps(config: KernelConfig, *tiles: tuple[torch.Tensor, int]) -> tuple:
    """The sm90 family's TMA maps of (batch, heads, seqlen, d) views, one per (tensor, rows): boxes of
    that many rows by one column block of the tiles (swizzle-span bytes)."""
    span = config.swizzle_span
    return tuple(for_tensor(t, (1, 1, rows, span // 2), span) for t, rows in tiles)


def sm90_maps(config: KernelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> tuple:
    """The sm90 forward's maps: 64 query rows (one consumer warpgroup's) or block_n keys a box."""
    return tile_maps(config, (q, 64), (k, config.block_n), (v, config.block_n), (out, 64))


def kv_grad_buffers(k: torch.Tensor, v: torch.Tensor, heads_q: int, varlen: bool, zero: bool) -> tuple:
    """The dK, dV buffers a backward kernel writes, for k, v of (batch, heads_kv, seqlen_k, d) or,
    packed, (total_k, heads_kv, d): like k and v, or per query head (heads_q in place of heads_kv)
    where query heads share a K/V head (GQA/MQA), for summed_kv_heads to sum. `zero`: filled with 0
    first, where the kernels leave rows unwritten (the key rows past seqused_k: no gradient)."""
    dims = "lhd" if varlen else "bhld"
    if heads_q == k.shape[1]:
        bufs = (empty_like(k, dims, name="dk", rows="k"), empty_like(v, dims, name="dv", rows="k"))
    else:
        bufs = tuple(empty((t.shape[0], heads_q, *t.shape[2:]), t.dtype, t.device, dims, name=n, rows="k")
                     for t, n in ((k, "dk"), (v, "dv")))
    return tuple(b.zero_() for b in bufs) if zero else bufs


def summed_kv_heads(dk_x: torch.Tensor, dv_x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """(dK, dV) like k and v from kv_grad_buffers' buffers: per-query-head ones summed, in fp32, over the
    query heads that share each K/V head."""
    if dk_x.shape[1] == k.shape[1]:
        return dk_x, dv_x
    group = dk_x.shape[1] // k.shape[1]

    def summed(x, like):  # the heads dim split (kv head, group)
        return torch.empty_like(like).copy_(x.view(*like.shape[:2], group, *like.shape[2:]).sum(2, dtype=torch.float32))

    return summed(dk_x, k), summed(dv_x, v)


def sm90_backward(config: KernelConfig, fns: dict, variant, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float, deterministic: bool, b: int,
                  lq: int, lk: int):
    """flash_backward on the sm90 family, tensors as the call gave them ((batch, heads, seqlen, d), or
    packed (total, heads, d) rows; v, out and dout V's head dim wide where config.head_dim_v says so; b,
    lq, lk the batch and its longest lengths): the delta kernel writes
    delta and the LSE in base 2 for query rows padded to whole tiles (packed sequences each from its
    own tile: q_pad), the main kernel adds dQ^T tile by tile into an fp32 buffer of those rows by bulk
    reductions (one launch per key block when deterministic, so the adds come in a fixed order) and
    writes dK, dV per query head (GQA: summed here); dQ is that buffer's tiles turned back into rows and
    scaled."""
    varlen, m = variant.varlen, config.block_m
    if dout.stride(-1) != 1 or any(s % 8 for s in dout.stride()[:-1]) or 0 in dout.stride():
        dout = dout.contiguous()  # TMA reads rows 16-byte aligned and apart (autograd may pass expanded zeros)
    q4, k4, v4, out4, dout4 = (heads_view(t) if varlen else t for t in (q, k, v, out, dout))
    hq, d, hkv = q4.shape[1], q4.shape[3], k4.shape[1]
    if varlen:  # FlashAttention-3's padded offsets: sequence s's tiles from (cu_seqlens_q[s] + s m) // m * m on
        cu_q = variant.pointers[0]
        q_pad = (cu_q[:-1] + torch.arange(b, dtype=torch.int32, device=q.device) * m) // m * m
        padded, rows_shape = (q.shape[0] + b * m) // m * m, (hq,)
    else:
        q_pad, padded, rows_shape = None, -(-lq // m) * m, (b, hq)
    dims = "hl" if varlen else "bhl"
    delta = empty((*rows_shape, padded), torch.float32, q.device, dims, name="delta", contiguous=True)
    lse2 = empty((*rows_shape, padded), torch.float32, q.device, dims, name="lse2", contiguous=True)
    rows = config.head_rows  # the head dim rounded up to 64: the kernel's dQ^T tiles have that many rows
    dq_accum = zeros((*rows_shape, padded, rows), torch.float32, q.device, dims + "d", name="dq_accum",
                     contiguous=True)
    dk_x, dv_x = kv_grad_buffers(k, v, hq, varlen, zero=variant.seqused)
    dk4, dv4 = (heads_view(dk_x), heads_view(dv_x)) if varlen else (dk_x, dv_x)
    runs, start = [], 0
    for sequences, pointers in variant.runs(b):  # with each run's q_pad from its first sequence on
        runs.append((sequences, pointers, q_pad[start:] if varlen else None))
        start += sequences
    lse_sb, lse_sh, alibi_sb, bias_sb = variant.scalars(lse)
    longest = -(-lq // m) * m  # the longest sequence's rows padded to whole query tiles: a thread each
    for sequences, (cu_seqlens_q, _, seq_end_q, *_), pad in runs:
        _call(fns[f"{config.name}_delta"], (-(-longest // 128), hq, sequences), 128, 0, q.device,
              SM90_DELTA_PARAMS, (out4, dout4, lse, delta, lse2, cu_seqlens_q, seq_end_q, pad),
              (*_strides(out4, varlen), *_strides(dout4, varlen), lse_sb, lse_sh, lq, padded), SM90_DELTA_NAMES)
    maps = tile_maps(config, (q4, m), (k4, config.block_n), (v4, config.block_n), (dout4, m))
    n_blocks = -(-lk // config.block_n)
    scalars = (*_strides(dk4, varlen), *_strides(dv4, varlen), alibi_sb, bias_sb, lq, lk, padded, hq // hkv,
               *variant.window, scale, scale * LOG2E, *variant.softcap_factors(scale))
    for n_block0, blocks in ([(j, 1) for j in range(n_blocks)] if deterministic else [(0, n_blocks)]):
        for sequences, pointers, pad in runs if blocks else ():
            _call(fns[config.name], (blocks, hq, sequences), config.threads, config.smem_bytes, q.device,
                  SM90_BWD_PARAMS, (lse2, delta, dq_accum, dk_x, dv_x, *pointers, pad), (*scalars, n_block0),
                  SM90_BWD_NAMES, maps)
    # Each query tile of dq_accum holds dQ^T as the kernel's tile keeps it (its DQ_AT: head-dim row
    # blocks of 64, query column groups of 8, warps, lanes' row lane / 4 and column pair lane % 4, then
    # row half and column): back to rows, scaled (the kernel adds unscaled dS K, as FA3's postprocess).
    tiles = dq_accum.view(-1, hq, padded // m, rows // 64, m // 8, 4, 8, 4, 2, 2)
    back = tiles.permute(0, 1, 2, 4, 7, 9, 3, 5, 8, 6)  # (query: group, pair, column), (d: block, warp, half, row)
    by_row = torch.mul(back, scale).reshape(-1, hq, padded, rows)
    if varlen:  # packed row i of sequence s: padded row q_pad[s] + i - cu_seqlens_q[s]
        i = torch.arange(q.shape[0], device=q.device)
        s = torch.searchsorted(cu_q.long(), i, right=True) - 1
        dq = torch.empty_like(q).copy_(by_row[0][:, q_pad.long()[s] + i - cu_q.long()[s], :d].transpose(0, 1))
    else:
        dq = torch.empty_like(q).copy_(by_row[:, :, :lq, :d])
    return (dq, *summed_kv_heads(dk_x, dv_x, k, v))


def _backward_head_dims(q, v) -> int | None:
    """V's head dim where a backward call's differs from Q's (None where equal, or where the tensors are
    not tensors of one rank: the checks that follow say what is wrong), each at most HEAD_DIM_MAX."""
    if not all(isinstance(t, torch.Tensor) for t in (q, v)) or q.dim() != v.dim() or q.shape[-1] == v.shape[-1]:
        return None
    d, dv = q.shape[-1], v.shape[-1]
    if max(d, dv) > HEAD_DIM_MAX:
        raise ValueError(f"flash_backward: got head dims {d} (q, k) and {dv} (v); the backward runs V head dims up "
                         f"to {HEAD_DIM_MAX} (FlashAttention-3's too), expected v.shape[-1] <= {HEAD_DIM_MAX}")
    return dv


def flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, *, causal: bool = False, scale: float | None = None,
                   config: KernelConfig | None = None, deterministic: bool = False, align: str = "top_left",
                   window=(-1, -1), softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                   key_bias: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
                   cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                   max_seqlen_k: int | None = None, attention_chunk: int = 0, seqused_q: torch.Tensor | None = None,
                   seqused_k: torch.Tensor | None = None):
    """FlashAttention backward: (dq, dk, dv) like (q, k, v), from the forward's out and lse
    (fp16/bf16 on tensor cores, fp32 on the SIMT path). The variant arguments are flash_forward's,
    as the forward got them.

    dQ is added into an fp32 buffer with atomics (config.dq "atomic"); with `deterministic=True` the
    key blocks run one launch at a time, so the additions happen in a fixed order and the gradients
    are bit-identical run to run (slower: each launch has only batch x heads blocks). With config.dq
    "pass" a second kernel computes dQ per query block (no atomics, deterministic as it is). With GQA
    each block writes its query head's dK, dV and the heads that share a K/V head are summed in fp32
    afterwards.

    A V head dim apart from Q and K's (the forward's head_dim_v, each at most HEAD_DIM_MAX) runs on the
    sm90 family's kernel with both head dims where it takes the call (_backward_head_dims); else with
    the narrower side zero-padded to the wider: zero columns add nothing to Q K^T or dO V^T, so each
    gradient is the unpadded call's, cut back to its width.
    """
    dv, asked_causal = _backward_head_dims(q, v), causal
    varlen, q4, k4, v4 = views(q, k, v, cu_seqlens_q, cu_seqlens_k)
    if varlen and 0 in (q.shape[0], k.shape[0]):  # no rows or no keys: every gradient is 0
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dtype, scale, profile = _prepare(q4, k4, v4, causal, scale, "flash_backward")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: got {deterministic!r}, expected a bool")
    causal, variant = resolve(q4, k4, causal, align=align, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                              key_bias=key_bias, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, attention_chunk=attention_chunk,
                              seqused_q=seqused_q, seqused_k=seqused_k)
    d = q4.shape[3]
    config = variant_config(config, "bwd", d, dtype, causal, variant, profile, dv)
    if dv is not None and (config.head_dim, config.dv) != (d, dv):  # a kernel of one head dim: the narrower padded
        width = max(d, dv)

        def pad(t):
            return torch.nn.functional.pad(t, (0, width - t.shape[-1])) if isinstance(t, torch.Tensor) else t

        dq, dk, dv_ = flash_backward(  # the call's own arguments (resolve's causal may be a chunked window's)
            pad(dout), pad(q), pad(k), pad(v), pad(out), lse, causal=asked_causal, scale=scale, config=config,
            deterministic=deterministic, align=align, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
            key_bias=key_bias, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, attention_chunk=attention_chunk, seqused_q=seqused_q, seqused_k=seqused_k)
        return tuple(torch.empty_like(like).copy_(g[..., :like.shape[-1]]) for g, like in ((dq, q), (dk, k), (dv_, v)))
    for name, t in (("out", out), ("dout", dout)):
        check_like(name, t, q, dv)
        if varlen:
            check_like(name, heads_view(t), q4, dv)
    b, hq, lq, d = q4.shape
    hkv, lk = k4.shape[1], k4.shape[2]
    total_q = lq
    if varlen:
        b, lq, lk = cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k
    group = hq // hkv
    lse_shape = (hq, total_q) if varlen else (b, hq, lq)
    if not isinstance(lse, torch.Tensor) or lse.shape != lse_shape or lse.dtype != torch.float32 \
            or lse.device != q.device:
        got = f"{tuple(lse.shape)} {lse.dtype} on {lse.device}" if isinstance(lse, torch.Tensor) else type(lse).__name__
        raise ValueError(f"lse: got {got}; expected {lse_shape} float32 on {q.device} (the forward's LSE)")
    lse = lse.contiguous()
    check_config(config, d, dtype, causal, profile, "bwd", dv)
    fns = kernel_functions(config, profile, q)
    if config.family == "sm90":
        return sm90_backward(config, fns, variant, dout, q, k, v, out, lse, scale, deterministic, b, lq, lk)
    out4, dout4 = (heads_view(out), heads_view(dout)) if varlen else (out, dout)

    # delta per query row; packed rows are one long sequence to it, (H, total_q) like the LSE
    delta = empty(lse_shape, torch.float32, q.device, "hl" if varlen else "bhl", name="delta", rows="q",
                         contiguous=True)
    _call(fns[f"{config.name}_delta"], (math.ceil(total_q / config.delta_rows), hq, 1 if varlen else b),
          config.delta_rows * config.delta_lanes, 0, q.device, DELTA_PARAMS, (out4, dout4, delta),
          (*_strides(out4), *_strides(dout4), total_q), ("out", "dout", "delta"))

    dq_pass = config.dq == "pass"
    # With the dQ pass the dK/dV kernel never touches dq_accum: a null pointer takes its place.
    # dq_accum's rows are the LSE's, (B, H, L) or (H, total_q), each of d floats.
    dq_accum = None if dq_pass else zeros((*lse_shape, d), torch.float32, q.device, "hld" if varlen else "bhld",
                                                 name="dq_accum", rows="q", contiguous=True)
    dk_x, dv_x = kv_grad_buffers(k, v, hq, varlen, zero=variant.seqused)
    dk4, dv4 = (heads_view(dk_x), heads_view(dv_x)) if varlen else (dk_x, dv_x)
    n_blocks, split = math.ceil(lk / config.block_n), config.head_split
    extra_scalars = variant.scalars(lse)
    window_scalars = (lq, lk, group, *variant.window)
    float_scalars = (scale, scale * LOG2E, *variant.softcap_factors(scale))
    common = (*_strides(q4, varlen), *_strides(k4, varlen), *_strides(v4, varlen), *_strides(dout4, varlen),
              *_strides(dk4, varlen), *_strides(dv4, varlen), *extra_scalars, *window_scalars, *float_scalars)
    serial = deterministic and not dq_pass  # only the atomics need the fixed order
    for n_block0, blocks in ([(j, 1) for j in range(n_blocks)] if serial else [(0, n_blocks)]):
        for sequences, pointers in variant.runs(b) if blocks else ():
            _call(fns[config.name], (blocks * split, hq, sequences), config.threads, config.smem_bytes, q.device,
                  BWD_PARAMS, (q, k, v, dout, lse, delta, dq_accum, dk_x, dv_x, *pointers), (*common, n_block0),
                  ("q", "k", "v", "dout", "lse", "delta", "dq_accum", "dk", "dv", *_VARIANT_POINTERS))

    if dq_pass:
        dq = empty_like(q, "lhd" if varlen else "bhld", name="dq", rows="q")
        if variant.seqused:
            dq.zero_()
        dq4 = heads_view(dq) if varlen else dq
        for sequences, pointers in variant.runs(b) if lq else ():
            _call(fns[f"{config.name}_dq"], (math.ceil(lq / config.block_m), hq, sequences), config.threads,
                  config.smem_bytes, q.device, DQ_PARAMS, (q, k, v, dout, lse, delta, dq, *pointers),
                  (*_strides(q4, varlen), *_strides(k4, varlen), *_strides(v4, varlen), *_strides(dout4, varlen),
                   *_strides(dq4, varlen), *extra_scalars, *window_scalars, *float_scalars),
                  ("q", "k", "v", "dout", "lse", "delta", "dq", *_VARIANT_POINTERS))
    else:
        dq = torch.empty_like(q).copy_(dq_accum.transpose(0, 1) if varlen else dq_accum)
    return (dq, *summed_kv_heads(dk_x, dv_x, k, v))
