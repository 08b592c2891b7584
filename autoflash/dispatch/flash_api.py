"""flash-attn 2.x's Python API on autoflash's kernels: `from autoflash import flash_attn_func` in place
of `from flash_attn import flash_attn_func`, with the same argument names, order, defaults, layouts
and semantics (flash_attn_func, flash_attn_varlen_func and their qkv/kv-packed forms).

Also `attention_variant`, the differentiable entry the rest of autoflash calls (SDPA's key-padding
path, the transformers integration) in SDPA's (batch, heads, seqlen, head_dim) layout.

Everything here checks its arguments (raising ValueError/TypeError that say what was received and
what is accepted) before anything is launched, zero-pads head dims the kernels have no tiles for,
and calls the custom ops of autoflash/dispatch/variant_ops.py, which run the kernels on CUDA (or on
the CPU inside autoflash.emulate()) and are differentiable and torch.compile-able. On CPU tensors
outside autoflash.emulate() they compute the PyTorch reference instead (in fp32: slow, for tests
and for code that must run anywhere), after one FallbackWarning per reason; strict=True (or
AUTOFLASH_STRICT=1) raises UnsupportedCallError there instead (autoflash.dispatch.policy).
`strict` is the one keyword flash-attn's functions do not have.

What flash-attn has and this does not: attention dropout (dropout_p must be 0.0), the returned
attention probabilities (return_attn_probs gives None in their place, as flash-attn does without
dropout). KV caches, paged ones included, are flash_attn_with_kvcache's (dispatch/kvcache.py).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import operator

import torch
import torch.nn.functional as F

from autoflash.dispatch import variant_ops  # registers torch.ops.autoflash.flash_fwd / flash_bwd
from autoflash.dispatch.policy import REFERENCE, cpu_fallback, fall_back, is_strict
from autoflash.kernels.checks import checks_values, chunk_size, int32_vector, window_pair
from autoflash.kernels.config import ALIGNS, HEAD_DIM_MAX, HEAD_DIM_MIN, HEAD_DIM_QV_MAX, HEAD_DIM_STEP, HEAD_DIM_V_MAX

__all__ = ["attention_variant", "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "padded_head_dim"]

DTYPES = (torch.float16, torch.bfloat16)
# dims of each layout, by name: flash-attn's dense and packed ones, SDPA's
_LAYOUTS = {
    "bshd": ("batch", "seqlen", "heads", "head_dim"),
    "bhsd": ("batch", "heads", "seqlen", "head_dim"),
    "thd": ("total", "heads", "head_dim"),
}


# ------------------------------------------------------------------ argument checks
@dataclasses.dataclass(frozen=True)
class Dims:
    """Sizes of one call; for packed sequences seqlen_q / seqlen_k are the totals and batch is None."""

    batch: int | None
    heads: int
    heads_k: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int  # V's (and the output's): FlashAttention-3's headdim_v, head_dim where they agree


def _check_qkv(q, k, v, layout: str) -> Dims:
    """q, k, v tensors of `layout` (see _LAYOUTS), one dtype out of DTYPES, one device, k and v of one
    shape but for v's head dim (1..HEAD_DIM_V_MAX), heads_k dividing heads, head_dim in 1..HEAD_DIM_MAX,
    the same batch, no empty dense dim."""
    names = _LAYOUTS[layout]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
        if t.dim() != len(names):
            raise ValueError(f"{name}: got shape {tuple(t.shape)}, expected {len(names)} dims ({', '.join(names)})")
    if q.dtype not in DTYPES or not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes: got {q.dtype}, {k.dtype}, {v.dtype}; expected all torch.float16 or all "
                        "torch.bfloat16")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices: got {q.device}, {k.device}, {v.device}; expected one device")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"device: got {q.device}, expected CUDA tensors (or CPU tensors: the kernels emulated inside "
                         "autoflash.emulate(), else the PyTorch reference)")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v shapes: got {tuple(k.shape)} and {tuple(v.shape)}; expected them equal but for the "
                         f"head dim (V's may differ: FlashAttention-3's headdim_v)")
    dv = v.shape[-1]
    if not 1 <= dv <= HEAD_DIM_V_MAX:
        raise ValueError(f"v's head dim: got {dv}, expected 1..{HEAD_DIM_V_MAX}")
    shape = dict(zip(names, q.shape))
    shape_k = dict(zip(names, k.shape))
    d = shape["head_dim"]
    if shape_k["head_dim"] != d:
        raise ValueError(f"head_dim: got q {tuple(q.shape)} and k {tuple(k.shape)}; expected the same head_dim")
    most = HEAD_DIM_QV_MAX if dv != d else HEAD_DIM_MAX  # the forward beside V's own (its backward: 256)
    if not 1 <= d <= most:
        raise ValueError(f"head_dim: got {d}, expected 1..{HEAD_DIM_MAX} ({HEAD_DIM_QV_MAX} beside v's head dim of "
                         f"its own, forward only above {HEAD_DIM_MAX})")
    hq, hk = shape["heads"], shape_k["heads"]
    if hq == 0 or hk == 0 or hq % hk:
        raise ValueError(f"heads: got {hq} query heads and {hk} key/value heads; expected key/value heads dividing "
                         "query heads (MQA/GQA), both >= 1")
    if layout == "thd":
        return Dims(None, hq, hk, shape["total"], shape_k["total"], d, dv)
    if shape["batch"] != shape_k["batch"]:
        raise ValueError(f"batch: got q {tuple(q.shape)} and k {tuple(k.shape)}; expected the same batch size")
    if 0 in (shape["batch"], shape["seqlen"], shape_k["seqlen"]):
        raise ValueError(f"empty input: got q {tuple(q.shape)}, k {tuple(k.shape)}; expected batch and seqlens >= 1")
    return Dims(shape["batch"], hq, hk, shape["seqlen"], shape_k["seqlen"], d, dv)


def _check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: got {value!r}, expected a bool")
    return value


def _check_dropout(dropout_p) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p: got {dropout_p!r}, expected a float")
    if dropout_p != 0:
        raise ValueError(f"dropout_p: got {dropout_p}; autoflash has no attention dropout, expected dropout_p=0.0 "
                         "(pass 0.0, also in training)")


def _check_scale(name: str, scale, head_dim: int) -> float:
    """The softmax scale: given, or 1/sqrt(head_dim) of the unpadded head dim."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name}: got {scale!r}, expected a float or None (1/sqrt(head_dim))")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name}: got {scale}, expected a finite number > 0 or None (1/sqrt(head_dim))")
    return float(scale)


def _check_window(name: str, window, causal: bool) -> tuple[int, int]:
    """(left, right), -1 unbounded; causal makes right 0 (flash-attn's rule)."""
    left, right = window_pair(name, window)
    return (left, 0) if causal else (left, right)


def _check_softcap(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap: got {softcap!r}, expected a float (0.0 = no capping)")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap: got {softcap}, expected a finite number >= 0 (0.0 = no capping)")
    return float(softcap)


def _check_align(align) -> str:
    if align not in ALIGNS:
        raise ValueError(f"align: got {align!r}, expected one of {ALIGNS}")
    return align


def _check_fp32(name: str, t, shapes: tuple[tuple[int, ...], ...], device: torch.device, what: str):
    """An fp32 tensor of one of `shapes` on `device` (None passes); returned with a contiguous last
    dim, as the kernels read it."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.float32 tensor or None")
    if t.dtype != torch.float32:
        raise TypeError(f"{name}: got dtype {t.dtype}, expected torch.float32")
    expected = " or ".join(str(s) for s in shapes)
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{name}: got shape {tuple(t.shape)}, expected {expected} ({what})")
    if t.device != device:
        raise ValueError(f"{name}: got device {t.device}, expected q's device {device}")
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_alibi(alibi_slopes, batch: int, heads: int, device: torch.device):
    return _check_fp32("alibi_slopes", alibi_slopes, ((heads,), (batch, heads)), device, "(heads,) or (batch, heads)")


# ------------------------------------------------------------------ packed sequences
def _check_cu_seqlens(name: str, cu, device: torch.device) -> int:
    """Metadata of cumulative lengths (int32, 1-D, batch + 1 >= 2 entries, q's device); returns batch."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name}: got {type(cu).__name__}, expected a torch.int32 tensor")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name}: got dtype {cu.dtype}, expected torch.int32")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name}: got shape {tuple(cu.shape)}, expected 1-D (batch + 1,) with batch >= 1")
    if cu.device != device:
        raise ValueError(f"{name}: got device {cu.device}, expected q's device {device}")
    return cu.numel() - 1


def _shown(values: list[int], limit: int = 12) -> str:
    return str(values) if len(values) <= limit else f"[{', '.join(map(str, values[:limit]))}, ...]"


def _sequence_lengths(name: str, cu: torch.Tensor, total: int, rows: str) -> list[int]:
    """The lengths in `cu` (read on the host): 0 first, non-decreasing, `total` (rows' count) last."""
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name}: got first value {values[0]}, expected 0 (cumulative lengths start at 0)")
    drops = [i for i in range(1, len(values)) if values[i] < values[i - 1]]
    if drops:
        i = drops[0]
        raise ValueError(f"{name}: got {_shown(values)}, decreasing at index {i} ({values[i - 1]} -> {values[i]}); "
                         "expected non-decreasing cumulative lengths")
    if values[-1] != total:
        raise ValueError(f"{name}: got last value {values[-1]}, expected {total}, the rows of {rows} (its dim 0)")
    return [b - a for a, b in zip(values, values[1:])]


def _check_max_seqlen(name: str, value, lengths: list[int] | None, cu_name: str) -> int:
    """A host int >= 0, at least the longest sequence (when the lengths could be read)."""
    if isinstance(value, (bool, torch.Tensor)):
        raise TypeError(f"{name}: got {type(value).__name__}, expected a Python int (host data, as in flash-attn)")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: got {type(value).__name__}, expected a Python int") from None
    if value < 0:
        raise ValueError(f"{name}: got {value}, expected an int >= 0")
    longest = max(lengths, default=0) if lengths is not None else 0
    if value < longest:
        raise ValueError(f"{name}: got {value}, expected >= {longest}, the longest sequence in {cu_name}")
    return value


def _check_used(name: str, used, batch: int, lengths: list[int] | None, device: torch.device):
    """seqused_q / seqused_k (FlashAttention-3's): None, or int32 (batch,) on q's device whose values
    (read where checks_values allows) lie within each sequence's span."""
    if used is None:
        return None
    int32_vector(name, used, batch, device, ": the rows in use of each sequence")
    if lengths is not None:
        values = used.tolist()
        if any(not 0 <= u <= n for u, n in zip(values, lengths)):
            raise ValueError(f"{name}: got {_shown(values)}; expected 0 <= {name}[b] <= the length of sequence b in "
                             f"its cu_seqlens ({_shown(lengths)})")
    return used.contiguous()


def _check_packed(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dims: Dims, seqused=(None, None)):
    """(batch, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k), checked.
    Their metadata always; the cu_seqlens' values (0 first, non-decreasing, the rows last, max_seqlen at least the
    longest) where checks_values allows: on CPU tensors, and on CUDA only with
    AUTOFLASH_CHECK_VALUES=1. By default a CUDA call reads nothing back (no synchronisation, CUDA
    graphs can capture it) and trusts the values and max_seqlen, as flash-attn does."""
    batch = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    if _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device) != batch:
        raise ValueError(f"cu_seqlens_k: got {cu_seqlens_k.numel()} entries, expected cu_seqlens_q's {batch + 1} "
                         "(one batch)")
    lengths_q = lengths_k = None
    if checks_values(q.device):
        lengths_q = _sequence_lengths("cu_seqlens_q", cu_seqlens_q, dims.seqlen_q, "q")
        lengths_k = _sequence_lengths("cu_seqlens_k", cu_seqlens_k, dims.seqlen_k, "k and v")
    max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q, lengths_q, "cu_seqlens_q")
    max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k, lengths_k, "cu_seqlens_k")
    used_q = _check_used("seqused_q", seqused[0], batch, lengths_q, q.device)
    used_k = _check_used("seqused_k", seqused[1], batch, lengths_k, q.device)
    return batch, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_q, max_k, used_q, used_k


# ------------------------------------------------------------------ running
def padded_head_dim(head_dim: int) -> int:
    """The head dim the kernels run for `head_dim`: the next multiple of HEAD_DIM_STEP, at least
    HEAD_DIM_MIN (extra columns are zeros: they add nothing to q·k, and give output columns that
    are cut off)."""
    return max(HEAD_DIM_MIN, -(-head_dim // HEAD_DIM_STEP) * HEAD_DIM_STEP)


def padded_head_dim_v(head_dim_v: int) -> int:
    """V's head dim as the kernels run it: as padded_head_dim up to HEAD_DIM_MAX; above, the next
    multiple of 32 (two blocks share O's columns, each a whole number of 16-column steps)."""
    return padded_head_dim(head_dim_v) if head_dim_v <= HEAD_DIM_MAX else -(-head_dim_v // 32) * 32


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


@dataclasses.dataclass(frozen=True)
class CheckedCall:
    """A call of the flash-attn API after its checks, as it would reach the kernels (explain mode):
    q, k, v zero-padded to the kernels' head dim (stand-ins on the call's device: metadata only), the
    ops' variant keywords, and why it would not run on the kernels (None if it would)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    variant: dict
    fallback: str | None
    head_dim: int  # the caller's, before padding
    head_dim_v: int | None = None  # V's, the caller's, where it differs from head_dim
    notes: tuple[str, ...] = ()  # what the entry did to the call before it reached here (explain prints them)


class Captured(Exception):
    """Raised instead of running, inside explaining(): carries the CheckedCall."""

    def __init__(self, call):
        super().__init__(type(call).__name__)
        self.call = call


_EXPLAINING = contextvars.ContextVar("autoflash_explaining", default=False)
_EXPLAIN_GPU = contextvars.ContextVar("autoflash_explain_gpu", default=None)


@contextlib.contextmanager
def explaining(gpu: str | None = None):
    """A context in which the entry points check their arguments and raise Captured instead of running
    (`gpu`: explain's gpu=, the profile the call is planned for instead of its tensors' device)."""
    token, gpu_token = _EXPLAINING.set(True), _EXPLAIN_GPU.set(gpu)
    try:
        yield
    finally:
        _EXPLAINING.reset(token)
        _EXPLAIN_GPU.reset(gpu_token)


def planned_profile(t: torch.Tensor):
    """The GPU profile a call on `t` runs its kernels for: explain's gpu= while explaining, else its
    CUDA device or the emulated GPU; None where it runs no kernel (CPU tensors outside emulate())."""
    from autoflash.kernels.gpus import get_profile
    from autoflash.kernels.launch import profile_for

    if explaining_now() and _EXPLAIN_GPU.get() is not None:
        return get_profile(_EXPLAIN_GPU.get())
    return None if cpu_fallback(t) is not None else profile_for(t, "autoflash")


def stand_in(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `shape`, `dtype` on `device` holding one row (expanded over the other dims, the
    last one contiguous): what explain hands the config choice, which reads metadata only."""
    return torch.empty(shape[-1], dtype=dtype, device=device).expand(shape)


def explaining_now() -> bool:
    """Inside explaining() (never while torch.compile traces: explain runs eagerly)."""
    return not torch.compiler.is_compiling() and _EXPLAINING.get()


def _run(q, k, v, *, scale: float, causal: bool, align: str, window: tuple[int, int], softcap: float, alibi_slopes,
         key_bias, packed, deterministic: bool, entry: str, strict: bool | None, attention_chunk: int = 0):
    """(out, lse) from the forward op on checked arguments; q, k, v zero-padded to the kernels' head
    dim and out cut back (autograd sees the original width). `packed`: (cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, seqused_q, seqused_k) or None. On CPU tensors outside autoflash.emulate() the op computes
    the PyTorch reference: the fallback policy's warning first (autoflash.dispatch.policy)."""
    d, dv, device = q.shape[-1], v.shape[-1], q.device
    width = padded_head_dim(d)
    width_v = width if dv == d else padded_head_dim_v(dv)
    cu_q, cu_k, max_q, max_k, used_q, used_k = packed if packed is not None else (None, None, 0, 0, None, None)
    reason = cpu_fallback(q)
    if explaining_now():  # stand-ins of the padded tensors: their metadata, no copy
        q, k, v = (stand_in((*t.shape[:-1], w), t.dtype, device) for t, w in ((q, width), (k, width), (v, width_v)))
        kw = variant_ops._variant(causal, align, window[0], window[1], attention_chunk, softcap, alibi_slopes,
                                  key_bias, cu_q, cu_k, max_q, max_k, used_q, used_k)
        raise Captured(CheckedCall(q, k, v, scale, kw, reason, d, dv if dv != d else None))
    q, k, v = _pad(q, width), _pad(k, width), _pad(v, width_v)
    if reason is not None:
        fall_back(entry, reason, strict, REFERENCE, explain=f"autoflash.explain(autoflash.{entry}, ...)")
    out, lse = variant_ops.flash_forward_call(q, k, v, alibi_slopes, key_bias, cu_q, cu_k, used_q, used_k, scale,
                                              causal, align, window[0], window[1], attention_chunk, softcap, max_q,
                                              max_k, deterministic)
    return (out if width_v == dv else out[..., :dv]), lse


def attention_variant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                      causal: bool = False, align: str = "top_left", window=(-1, -1), softcap: float = 0.0,
                      alibi_slopes: torch.Tensor | None = None, key_bias: torch.Tensor | None = None,
                      deterministic: bool = False, strict: bool | None = None,
                      attention_chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable attention with flash-attn's variants, in SDPA's layout: (out like q, lse
    (B, Hq, Lq) fp32); gradients for q, k, v.

    q (B, Hq, Lq, D), k and v (B, Hkv, Lk, D), any strides, Hkv dividing Hq, float16/bfloat16, D up
    to 256 (zero-padded to the kernels' sizes; scale defaults to 1/sqrt(D)). causal is aligned by
    `align` ("top_left": SDPA's is_causal; "bottom_right": flash-attn's). window=(left, right), -1
    unbounded (causal makes right 0). attention_chunk > 0: each query sees only the keys of the chunk
    of attention_chunk keys holding its diagonal key (FlashAttention-3's chunked local attention,
    Llama 4's). softcap > 0 caps the scores at cap * tanh(s / cap).
    alibi_slopes fp32 (Hq,) or (B, Hq). key_bias fp32 (B, Lk) is added to every row's scores
    (-inf masks the key; a row with no key left gets out 0, lse +inf). deterministic=True makes the
    backward bit-reproducible.
    """
    dims = _check_qkv(q, k, v, "bhsd")
    causal = _check_flag("causal", causal)
    out, lse = _run(q, k, v, scale=_check_scale("scale", scale, dims.head_dim), causal=causal,
                    align=_check_align(align), window=_check_window("window", window, causal),
                    softcap=_check_softcap(softcap), alibi_slopes=_check_alibi(alibi_slopes, dims.batch, dims.heads,
                                                                               q.device),
                    key_bias=_check_fp32("key_bias", key_bias, ((dims.batch, dims.seqlen_k),), q.device,
                                         "(batch, seqlen_k): one additive bias per key"),
                    packed=None, deterministic=_check_flag("deterministic", deterministic),
                    entry="dispatch.flash_api.attention_variant", strict=strict,
                    attention_chunk=chunk_size("attention_chunk", attention_chunk))
    return out, lse


# Query rows of one K/V head (seqlen_q x its query heads) that the KV-cache kernel's tile holds at once.
PACKED_ROWS = 64


def packs_query_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: Dims, alibi_slopes) -> bool:
    """Whether flash_attn_func runs on the KV-cache kernel with the query heads of each K/V head folded
    into one tile's rows (FlashAttention-3's pack_gqa, which its own heuristic takes where packing fills
    the tiles better): GQA or MQA, all of a K/V head's query rows (seqlen_q x group) in one 64-row tile,
    no ALiBi (each row then needs its own head's slope) and no gradient asked for (the KV-cache kernel
    is forward only). Such a call reads each K/V tile once for the group instead of once per query
    head, and fills its tile where the dense kernel's 128-row tile holds seqlen_q rows."""
    group = dims.heads // dims.heads_k
    if group == 1 or alibi_slopes is not None or dims.seqlen_q * group > PACKED_ROWS or torch.compiler.is_compiling():
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    return planned_profile(q) is not None


def _check_common(dropout_p, causal, deterministic, return_attn_probs, strict) -> None:
    _check_dropout(dropout_p)
    is_strict(strict)  # a bool or None
    for name, flag in (("causal", causal), ("deterministic", deterministic), ("return_attn_probs", return_attn_probs)):
        _check_flag(name, flag)


def _result(out: torch.Tensor, lse: torch.Tensor, return_attn_probs: bool):
    """flash-attn's return: out, or (out, softmax_lse, None) (no attention probabilities without dropout)."""
    return (out, lse, None) if return_attn_probs else out


# ------------------------------------------------------------------ flash-attn's API
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, attention_chunk=0, strict=None):
    """flash-attn's flash_attn_func: q (batch, seqlen_q, heads, head_dim), k and v (batch, seqlen_k,
    heads_k, head_dim) with heads_k dividing heads (MQA/GQA), float16/bfloat16, head_dim 1..256.

    softmax_scale defaults to 1/sqrt(head_dim). causal is aligned to the bottom right corner (query
    i sees keys j <= i + seqlen_k - seqlen_q). window_size (left, right), -1 unbounded: query i sees
    keys i + seqlen_k - seqlen_q - left .. + right (causal makes right 0). softcap > 0 caps the
    scores. alibi_slopes fp32 (heads,) or (batch, heads) adds -slope * |i + seqlen_k - seqlen_q - j|.
    deterministic=True makes the backward bit-reproducible. dropout_p must be 0.0 (no dropout).
    attention_chunk (keyword only, FlashAttention-3's): > 0 limits query i to the keys of the chunk of
    attention_chunk keys that holds key i + seqlen_k - seqlen_q.

    Returns out (batch, seqlen_q, heads, head_dim); with return_attn_probs=True (out, softmax_lse
    (batch, heads, seqlen_q) fp32, None). Differentiable in q, k, v.
    """
    _check_common(dropout_p, causal, deterministic, return_attn_probs, strict)
    dims = _check_qkv(q, k, v, "bshd")
    if packs_query_heads(q, k, v, dims, alibi_slopes):
        from autoflash.dispatch.kvcache import flash_attn_with_kvcache

        try:
            out, lse = flash_attn_with_kvcache(q, k, v, cache_seqlens=dims.seqlen_k, softmax_scale=softmax_scale,
                                               causal=causal, window_size=window_size, softcap=softcap,
                                               return_softmax_lse=True, attention_chunk=attention_chunk, strict=strict)
        except Captured as captured:
            note = (f"pack_gqa: the {dims.heads // dims.heads_k} query heads of each K/V head in one tile of the "
                    f"KV-cache kernel, k and v read as the cache (seqlen_q x group <= {PACKED_ROWS}, no gradient "
                    "asked for)",)
            captured.call = dataclasses.replace(captured.call, notes=note + captured.call.notes)
            raise
        return _result(out, lse, return_attn_probs)
    out, lse = _run(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                    scale=_check_scale("softmax_scale", softmax_scale, dims.head_dim), causal=causal,
                    align="bottom_right", window=_check_window("window_size", window_size, causal),
                    softcap=_check_softcap(softcap),
                    alibi_slopes=_check_alibi(alibi_slopes, dims.batch, dims.heads, q.device),
                    key_bias=None, packed=None, deterministic=deterministic, entry="flash_attn_func", strict=strict,
                    attention_chunk=chunk_size("attention_chunk", attention_chunk))
    return _result(out.transpose(1, 2), lse, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, attention_chunk=0,
                           seqused_q=None, seqused_k=None, strict=None):
    """flash-attn's flash_attn_varlen_func: packed sequences. q (total_q, heads, head_dim), k and v
    (total_k, heads_k, head_dim); cu_seqlens_q / cu_seqlens_k int32 (batch + 1,), the cumulative
    lengths (sequence b is rows cu[b]:cu[b + 1]; zero-length sequences are allowed); max_seqlen_q /
    max_seqlen_k host ints, at least the longest sequence. The rest as flash_attn_func, per sequence
    (alibi_slopes (heads,) or (batch, heads); attention_chunk's chunks counted from each sequence's
    first key). seqused_q / seqused_k (keyword only, FlashAttention-3's): int32 (batch,), only the
    first seqused[b] rows of sequence b's span are used; the query rows past them get out 0 and lse
    +inf, and gradient 0.

    Returns out (total_q, heads, head_dim); with return_attn_probs=True (out, softmax_lse (heads,
    total_q) fp32, None).

    block_table (int32 (batch, pages_per_sequence)): a paged prefill, as flash-attn runs it: k and v
    are a paged cache (num_pages, page_size, heads_k, head_dim), sequence b's keys the first
    cu_seqlens_k[b + 1] - cu_seqlens_k[b] (or seqused_k[b]) rows of the pages its row lists. It runs
    on the KV-cache kernel (flash_attn_with_kvcache with packed queries), forward only as in
    flash-attn: a gradient through it is an error that says so.
    """
    _check_common(dropout_p, causal, deterministic, return_attn_probs, strict)
    if block_table is not None:
        return _paged_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                              window_size, softcap, alibi_slopes, return_attn_probs, block_table, attention_chunk,
                              seqused_q, seqused_k, strict)
    dims = _check_qkv(q, k, v, "thd")
    batch, cu_q, cu_k, max_q, max_k, used_q, used_k = _check_packed(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                                    max_seqlen_k, dims, (seqused_q, seqused_k))
    out, lse = _run(q, k, v, scale=_check_scale("softmax_scale", softmax_scale, dims.head_dim), causal=causal,
                    align="bottom_right", window=_check_window("window_size", window_size, causal),
                    softcap=_check_softcap(softcap), alibi_slopes=_check_alibi(alibi_slopes, batch, dims.heads, q.device),
                    key_bias=None, packed=(cu_q, cu_k, max_q, max_k, used_q, used_k), deterministic=deterministic,
                    entry="flash_attn_varlen_func", strict=strict,
                    attention_chunk=chunk_size("attention_chunk", attention_chunk))
    return _result(out, lse, return_attn_probs)


def _paged_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size,
                   softcap, alibi_slopes, return_attn_probs, block_table, attention_chunk, seqused_q, seqused_k,
                   strict):
    """flash_attn_varlen_func with a block_table: packed queries over a paged cache, each sequence's
    keys counted by cu_seqlens_k (or seqused_k), on the KV-cache kernel (dispatch/kvcache.py)."""
    from autoflash.dispatch.kvcache import flash_attn_with_kvcache, forward_only

    if seqused_q is not None:
        raise ValueError("seqused_q: got a tensor with a block_table; expected None (a paged prefill's queries are "
                         "counted by cu_seqlens_q)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name}: got shape {tuple(t.shape)} with a block_table, expected a paged cache "
                             f"(num_pages, page_size, heads_k, head_dim)")
    batch = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    if _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device) != batch:
        raise ValueError(f"cu_seqlens_k: got {cu_seqlens_k.numel()} entries, expected cu_seqlens_q's {batch + 1}")
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, None, "cu_seqlens_k")
    lengths = seqused_k if seqused_k is not None else cu_seqlens_k.diff().to(torch.int32)
    out, lse = flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, block_table=block_table,
                                       softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                       softcap=softcap, alibi_slopes=alibi_slopes, return_softmax_lse=True,
                                       attention_chunk=attention_chunk, cu_seqlens_q=cu_seqlens_q,
                                       max_seqlen_q=max_seqlen_q, strict=strict)
    out, lse = forward_only(out, lse, "flash_attn_varlen_func with a block_table", q, k, v)
    return _result(out, lse, return_attn_probs)


def _unpack(name: str, t, parts: int, layout: str, axis: int) -> tuple[torch.Tensor, ...]:
    """Views of the `parts` tensors packed in `t` along `axis` (no copy; gradients flow back into t)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    if t.dim() != axis + 3 or t.shape[axis] != parts:
        raise ValueError(f"{name}: got shape {tuple(t.shape)}, expected {layout}")
    return t.unbind(axis)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              strict=None):
    """flash_attn_func on qkv (batch, seqlen, 3, heads, head_dim); the gradient comes back packed."""
    q, k, v = _unpack("qkv", qkv, 3, "(batch, seqlen, 3, heads, head_dim)", 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, strict=strict)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             strict=None):
    """flash_attn_func on q (batch, seqlen_q, heads, head_dim) and kv (batch, seqlen_k, 2, heads_k, head_dim)."""
    k, v = _unpack("kv", kv, 2, "(batch, seqlen_k, 2, heads_k, head_dim)", 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, strict=strict)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, strict=None):
    """flash_attn_varlen_func on qkv (total, 3, heads, head_dim): queries and keys share cu_seqlens."""
    q, k, v = _unpack("qkv", qkv, 3, "(total, 3, heads, head_dim)", 1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  strict=strict)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                    strict=None):
    """flash_attn_varlen_func on q (total_q, heads, head_dim) and kv (total_k, 2, heads_k, head_dim)."""
    k, v = _unpack("kv", kv, 2, "(total_k, 2, heads_k, head_dim)", 1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, strict=strict)
