"""Shape, dtype and device checks shared by everything that takes attention inputs (the CUDA
launcher and the references): errors say what was received and what is accepted."""
from __future__ import annotations

import math
import operator
import os

import torch

from autoflash.kernels.config import HEAD_DIM_MAX, HEAD_DIM_MIN, HEAD_DIM_QV_MAX, HEAD_DIM_STEP, HEAD_DIM_V_MAX, \
    KernelConfig
from autoflash.kernels.gpus import GpuProfile

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
CHECK_VALUES_ENV = "AUTOFLASH_CHECK_VALUES"
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
GRID_YZ_MAX = 65535  # CUDA's limit on gridDim.y / gridDim.z (heads, batch)
_INT32_MAX = 2**31 - 1


def host_reads_possible(device: torch.device) -> bool:
    """Whether a tensor's values on `device` can be read back to the host at all: not while
    torch.compile traces (no values exist) nor while a CUDA graph captures (a read is illegal)."""
    if torch.compiler.is_compiling():
        return False
    return device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def checks_values(device: torch.device) -> bool:
    """Whether a call reads index tensors' values (cu_seqlens, cache_seqlens, block tables, left
    padding) back to check them. By default on CPU tensors only, where it costs nothing: on CUDA a
    read synchronises the host with the GPU on every call, so a CUDA call reads nothing back and
    trusts the values (max_seqlen included), as flash-attn's calls do. AUTOFLASH_CHECK_VALUES=1
    checks on CUDA too (a debug mode: one synchronisation per call); =0 never checks, on the CPU
    either (what a CUDA call does, shown on any machine). Never where host_reads_possible is False."""
    if not host_reads_possible(device):
        return False
    flag = os.environ.get(CHECK_VALUES_ENV, "").strip().lower()
    if flag in ("1", "true", "yes", "on"):
        return True
    if flag in ("0", "false", "no", "off"):
        return False
    if flag:
        raise ValueError(f"{CHECK_VALUES_ENV}: got {flag!r}, expected 1 (check index values on CUDA too), 0 (never), "
                         "or unset (on CPU tensors only)")
    return device.type != "cuda"


def device_index(t: torch.Tensor) -> int:
    """The CUDA device index of `t` ("cuda" without an index means the current device)."""
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def check_qkv_shapes(q, k, v, dtypes: tuple[torch.dtype, ...]) -> None:
    """q (batch, heads_q, seqlen_q, d); k (batch, heads_kv, seqlen_k, d), v the same but for its head
    dim (dv), heads_kv | heads_q, every size >= 1, one dtype out of `dtypes`, one device."""
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
    if k.shape[:-1] != v.shape[:-1] or v.shape[-1] == 0:
        raise ValueError(f"k and v shapes: got {tuple(k.shape)} and {tuple(v.shape)}; expected them equal but for the "
                         f"head dim")
    (b, hq, lq, d), (bk, hkv, lk, dk) = q.shape, k.shape
    if b != bk or d != dk:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)}: expected the same batch and head_dim")
    if min(b, hq, hkv, lq, lk, d) == 0:
        raise ValueError(
            f"empty input: got q {tuple(q.shape)}, k {tuple(k.shape)}; expected every size >= 1"
        )
    if hq % hkv:
        raise ValueError(f"heads: got {hq} query heads and {hkv} kv heads; expected kv heads dividing query heads")


def check_qkv(q, k, v) -> str:
    """Validates (batch, heads, seqlen, head_dim) inputs; returns the dtype name ("fp16", ...)."""
    check_qkv_shapes(q, k, v, tuple(DTYPE_NAMES))
    (b, hq, lq, d), lk, dv = q.shape, k.shape[2], v.shape[-1]
    most = HEAD_DIM_QV_MAX if dv != d and q.dtype in (torch.float16, torch.bfloat16) else HEAD_DIM_MAX
    if not (HEAD_DIM_MIN <= d <= most and d % HEAD_DIM_STEP == 0):
        raise ValueError(
            f"head_dim: got {d}, expected a multiple of {HEAD_DIM_STEP} in [{HEAD_DIM_MIN}, {HEAD_DIM_MAX}] "
            f"({HEAD_DIM_QV_MAX} in fp16/bf16 with v's head dim its own)"
        )
    if not (HEAD_DIM_MIN <= dv <= HEAD_DIM_V_MAX and dv % HEAD_DIM_STEP == 0):
        raise ValueError(f"v's head dim: got {dv}, expected a multiple of {HEAD_DIM_STEP} in [{HEAD_DIM_MIN}, "
                         f"{HEAD_DIM_V_MAX}]")
    if b > GRID_YZ_MAX or hq > GRID_YZ_MAX or max(lq, lk) > _INT32_MAX:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}: expected batch and heads <= {GRID_YZ_MAX} and "
            f"sequence lengths <= {_INT32_MAX}"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_chunked_layout(name, t)
    return DTYPE_NAMES[q.dtype]


def is_chunked_layout(t: torch.Tensor) -> bool:
    """The kernels move 16-byte chunks: a contiguous last dim, 16-byte aligned rows and start."""
    align = 16 // t.element_size()
    return t.stride(-1) == 1 and not any(s % align for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0


def chunked(t: torch.Tensor) -> torch.Tensor:
    """`t` laid out as the kernels read it (is_chunked_layout): itself, or a copy. `.contiguous()`
    alone is not enough: a contiguous view whose storage offset is not a multiple of 16 bytes (a
    slice of a flat buffer, a packed tensor's odd part) comes back as it is, so such a view is
    cloned into a fresh (aligned) allocation."""
    if is_chunked_layout(t):
        return t
    c = t.contiguous()
    return c if c.data_ptr() % 16 == 0 else c.clone()


def physical_order(t: torch.Tensor) -> tuple[int, ...]:
    """The dims of t from outermost to innermost as torch.empty_like lays them out."""
    like = torch.empty_like(t, device="meta")  # torch's own choice of strides, at no cost
    return tuple(sorted(range(t.dim()), key=lambda i: -like.stride(i)))


def empty_like_width(t: torch.Tensor, width: int | None) -> torch.Tensor:
    """torch.empty_like(t), its last dim `width` wide where given: the same physical order."""
    if width is None or width == t.shape[-1]:
        return torch.empty_like(t)
    return torch.empty_permuted((*t.shape[:-1], width), physical_order(t), dtype=t.dtype, device=t.device)


def check_qv_shape(qv, q: torch.Tensor, dv: int, v_name: str) -> None:
    """ValueError unless `qv` (FlashAttention-3's: scores q . k + qv . v) is a tensor of q's rows by V's
    head dim dv, in q's dtype on q's device; `v_name` names the tensor whose head dim that is."""
    want = (*q.shape[:-1], dv)
    if not isinstance(qv, torch.Tensor) or tuple(qv.shape) != want or qv.dtype != q.dtype or qv.device != q.device:
        got = f"{tuple(qv.shape)} {qv.dtype} on {qv.device}" if isinstance(qv, torch.Tensor) else repr(qv)
        raise ValueError(f"qv: got {got}, expected {want} {q.dtype} on {q.device} (q's rows, {v_name}'s head dim)")


def check_chunked_layout(name: str, t: torch.Tensor) -> None:
    """Raises with the offending strides when `t` is not is_chunked_layout."""
    if is_chunked_layout(t):
        return
    align = 16 // t.element_size()
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: got stride {t.stride(-1)} on the last dim, expected 1 (contiguous head_dim)")
    if any(s % align for s in t.stride()[:-1]) or t.data_ptr() % 16:
        raise ValueError(
            f"{name}: got strides {t.stride()} (data_ptr % 16 = {t.data_ptr() % 16}); expected the "
            f"strides but the last to be multiples of {align} elements and a 16-byte aligned start"
        )


def check_like(name: str, t, q: torch.Tensor, width: int | None = None) -> None:
    """`t` (out, dout) must match q's shape (its last dim `width` where given: V's head dim), dtype and
    device, and be laid out in 16-byte chunks."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    shape = q.shape if width is None else (*q.shape[:-1], width)
    if tuple(t.shape) != tuple(shape) or t.dtype != q.dtype or t.device != q.device:
        whose = "q's" if width is None else "q's with v's head dim,"
        raise ValueError(
            f"{name}: got {tuple(t.shape)} {t.dtype} on {t.device}; expected {whose} {tuple(shape)} {q.dtype} on "
            f"{q.device}"
        )
    if t.dim() == 4:  # packed (total, heads, d) rows are checked as their (1, heads, total, d) view
        check_chunked_layout(name, t)


def check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: got {type(scale).__name__}, expected a float or None")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: got {scale}, expected a finite number > 0")
    return float(scale)


def check_config(config: KernelConfig, head_dim: int, dtype: str, causal: bool, profile: GpuProfile,
                 direction: str = "fwd", head_dim_v: int | None = None) -> None:
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config: got {type(config).__name__}, expected a KernelConfig")
    want = (head_dim, dtype, causal, direction)
    got = (config.head_dim, config.dtype, config.causal, config.direction)
    if got != want:
        raise ValueError(
            f"config {config.name} is for (head_dim, dtype, causal, direction) = {got}; the call needs {want}"
        )
    if config.dv != (head_dim_v or head_dim):
        raise ValueError(f"config {config.name} is for V's head dim {config.dv}; the call's is "
                         f"{head_dim_v or head_dim} (KernelConfig.head_dim_v)")
    if config.family == "sm90" and profile.arch != "sm_90":
        raise ValueError(f"config {config.name} is of the sm90 family (wgmma, TMA), which runs on sm_90 GPUs (H100, "
                         f"H200); {profile.name} is {profile.arch}: use a config of family 'sm80'")
    config.check_fits(profile.smem_per_block_optin, profile.name)


def window_pair(name: str, window) -> tuple[int, int]:
    """A sliding window's (left, right) as ints, each >= 0 or -1 (unbounded on that side), from any
    pair of integers: a tuple or list, a 2-element integer tensor or array (flash-attn's own tests
    pass `torch.randint(0, seqlen_k, (2,))`), numpy integers. A CUDA tensor's values are read on the
    host. TypeError / ValueError name `name`, what came and what is taken."""
    expected = "expected a pair of ints (left, right), -1 for unbounded (a tuple, a list, a 2-element integer tensor)"
    try:
        sides = list(window) if not isinstance(window, (str, bytes)) else None
    except TypeError:
        sides = None
    if sides is None or len(sides) != 2 or any(
            isinstance(w, bool) or (isinstance(w, torch.Tensor) and w.dtype == torch.bool) for w in sides):
        raise TypeError(f"{name}: got {window!r}, {expected}")
    try:
        left, right = (operator.index(w) for w in sides)
    except TypeError:
        raise TypeError(f"{name}: got {window!r}, {expected}") from None
    if left < -1 or right < -1:
        raise ValueError(f"{name}: got {(left, right)}, expected sizes >= 0, or -1 for unbounded")
    return left, right


def int32_vector(name: str, t, batch: int, device: torch.device, what: str = "") -> torch.Tensor:
    """`t` checked as an int32 tensor of shape (batch,) on `device` (a per-sequence index or length:
    cache_seqlens, cache_batch_idx, cache_leftpad, seqused_q / seqused_k, rotary_seqlens); `what`
    says what it holds in the error."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    if t.dtype != torch.int32 or tuple(t.shape) != (batch,) or t.device != device:
        raise ValueError(f"{name}: got {tuple(t.shape)} {t.dtype} on {t.device}; expected int32 of shape ({batch},) "
                         f"on {device}{what}")
    return t


def cu_seqlens_vector(name: str, t, device: torch.device) -> int:
    """Metadata checks of cumulative lengths (dtype, shape, device, contiguous); returns the batch size.
    The values (0 first, non-decreasing, last = total) are the caller's to check: reading them would
    synchronise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: got {type(t).__name__}, expected an int32 tensor")
    if t.dtype != torch.int32 or t.dim() != 1 or t.numel() < 2 or t.device != device or t.stride(0) != 1:
        raise ValueError(f"{name}: got {tuple(t.shape)} {t.dtype} on {t.device}; expected a contiguous 1-D int32 "
                         f"tensor of batch + 1 >= 2 cumulative lengths on {device}")
    return t.numel() - 1


def chunk_size(name: str, chunk) -> int:
    """An attention chunk's size (FlashAttention-3's attention_chunk) as an int >= 0, 0 for no
    chunking, from an int or any integer scalar (numpy integers, a 0-d integer tensor)."""
    if isinstance(chunk, bool) or (isinstance(chunk, torch.Tensor) and chunk.dtype == torch.bool):
        raise TypeError(f"{name}: got {chunk!r}, expected an int >= 0 (0: no chunking)")
    try:
        value = operator.index(chunk)
    except TypeError:
        raise TypeError(f"{name}: got {chunk!r}, expected an int >= 0 (0: no chunking)") from None
    if value < 0:
        raise ValueError(f"{name}: got {value}, expected an int >= 0 (0: no chunking)")
    return value
