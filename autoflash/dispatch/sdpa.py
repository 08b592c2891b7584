"""The model-facing entry point: `autoflash.attention`, a drop-in for
torch.nn.functional.scaled_dot_product_attention.

Every call is first validated as SDPA validates it (so bad input fails here, with what was received
and what is accepted, whichever path runs), then planned: either the autoflash kernels (the custom
ops of autoflash/dispatch/ops.py, config picked by autoflash/dispatch/selection.py) or, for what the kernels do not
support yet, torch's own SDPA with one warning per reason (`strict=True` or AUTOFLASH_STRICT=1
raises instead). The planning reads tensor metadata only: no synchronisation, no allocation. It
is plain Python that torch.compile traces, so a compiled model keeps the path (and the warning,
given once at trace time) with no graph break.

An `attn_mask` that is a key-padding mask (the same for every query and head: it only hides keys)
runs on the kernels as their additive per-key bias (autoflash.dispatch.flash_api.attention_variant,
key_bias). A mask whose shape broadcasts over queries and heads, e.g. (B, 1, 1, Lk), is recognised
from its metadata alone; a (B, 1, Lq, Lk) or (B, H, Lq, Lk) one costs one comparison of its values
per mask tensor (a synchronisation on CUDA, once for all the layers that share it) to confirm that
every query row repeats the first. Any other mask falls back to torch SDPA, as does such a mask
while a CUDA graph captures (nothing may be read back then).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import torch

from autoflash.dispatch.policy import fall_back
from autoflash.dispatch.policy import (  # noqa: F401  (the policy's names, importable from here as before)
    STRICT_ENV, FallbackWarning, UnsupportedCallError, _warned)
from autoflash.dispatch.tensor_memo import MISSING, TensorMemo
from autoflash.kernels.checks import GRID_YZ_MAX, device_index, host_reads_possible
from autoflash.kernels.config import HEAD_DIM_MAX, HEAD_DIM_MIN, HEAD_DIM_STEP, HEAD_DIM_V_MAX

# torch's SDPA itself (torch.nn.functional re-exports it), kept here so patch_sdpa() cannot
# route the fallback back into autoflash.
_torch_sdpa = torch._C._nn.scaled_dot_product_attention

# fp16/bf16 on tensor cores, fp32 on the SIMT path (plain calls only: see _decide)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# Plan.mask: how an attn_mask reaches the kernels
NO_MASK = ""  # no attn_mask
KEY_PADDING = "key padding"  # its shape broadcasts over queries and heads: a key-padding mask by metadata
KEY_PADDING_IF_CONSTANT = "key padding if constant"  # (.., Lq, Lk)-shaped: its values are checked per call


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call runs: `reason` is None for the kernels, else why it goes to torch SDPA. `mask`
    says how its attn_mask runs on the kernels (NO_MASK, KEY_PADDING, KEY_PADDING_IF_CONSTANT: the
    kernels only after mask_reason() finds its values the same for every query and head)."""

    reason: str | None  # the first reason: the one the fallback warns about (once per reason)
    scale: float
    batch_shape: tuple[int, ...] = ()  # the dims before (heads, seqlen, head_dim), flattened for the kernels
    mask: str = NO_MASK
    others: tuple[str, ...] = ()  # every further reason (explain() lists them all)

    @property
    def reasons(self) -> str | None:
        """Every reason the call cannot run on the kernels, joined by "; " (None: it can)."""
        return None if self.reason is None else "; ".join((self.reason, *self.others))


# ------------------------------------------------------------------ validation (SDPA's error cases)
def _validate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
        if t.dim() < 2:
            raise ValueError(f"{name}: got shape {tuple(t.shape)}, expected (..., seqlen, head_dim)")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key, value dtypes: got {query.dtype}, {key.dtype}, {value.dtype}; expected one dtype")
    if not query.is_floating_point():
        raise TypeError(f"dtype: got {query.dtype}, expected a floating-point dtype")
    if not (query.device == key.device == value.device):
        raise ValueError(f"query, key, value devices: got {query.device}, {key.device}, {value.device}; "
                         "expected one device")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"head_dim: got query {tuple(query.shape)} and key {tuple(key.shape)}; expected the same "
                         "last dim (E)")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)}: expected the same sequence "
                         "length (dim -2)")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal: got {is_causal!r}, expected a bool")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa: got {enable_gqa!r}, expected a bool")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p: got {type(dropout_p).__name__}, expected a float")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: got {dropout_p}, expected a probability in [0, 1)")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise TypeError(f"scale: got {scale!r}, expected a finite float or None (1/sqrt(E))")
    heads_dim = 3 if enable_gqa else 2  # dims that must broadcast: batch (and heads unless GQA)
    qb, kb, vb = (t.shape[:-heads_dim] if t.dim() >= heads_dim else () for t in (query, key, value))
    try:
        if not qb == kb == vb:  # the common case needs no broadcasting (and skips its cost)
            torch.broadcast_shapes(qb, kb, vb)
    except RuntimeError:
        what = "batch dims" if enable_gqa else "batch and head dims"
        raise ValueError(f"{what}: got query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                         f"{tuple(value.shape)}; expected them broadcastable") from None
    if enable_gqa and query.dim() >= 3 and key.dim() >= 3:
        hq, hkv = query.shape[-3], key.shape[-3]
        if hkv == 0 or hq % hkv or value.shape[-3] != hkv:
            raise ValueError(f"enable_gqa: got {hq} query heads and key/value heads {hkv}/{value.shape[-3]}; "
                             "expected key and value heads equal and dividing the query heads")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask: got {type(attn_mask).__name__}, expected a torch.Tensor or None")
        if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
            raise TypeError(f"attn_mask: got {attn_mask.dtype}, expected torch.bool, torch.float32 or the query's "
                            f"{query.dtype}")
        if is_causal:
            raise ValueError("attn_mask and is_causal=True: got both, expected one (is_causal is the "
                             "top-left causal mask)")
        heads = (query.shape[-3],) if enable_gqa and query.dim() >= 3 else ()  # else inside qb already
        weights = (*(qb if qb == kb else torch.broadcast_shapes(qb, kb)), *heads, query.shape[-2], key.shape[-2])
        try:
            ok = torch.broadcast_shapes(attn_mask.shape, weights) == torch.Size(weights)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"attn_mask: got shape {tuple(attn_mask.shape)}, expected broadcastable to the "
                             f"attention weights {tuple(weights)}")


# ------------------------------------------------------------------ planning
@torch.compiler.assume_constant_result
def _device_reason(device_index: int) -> str:
    """Why CUDA device `device_index` cannot run the kernels ("" if it can); probed once per device.
    A constant for torch.compile: the probe runs at trace time, not in the graph."""
    return _probe_device(device_index)


_device_reasons: dict[int, str] = {}


@torch.compiler.assume_constant_result
def _emulated_gpu() -> str:
    """The GPU that CPU tensors are emulated as (autoflash.emulate / AUTOFLASH_EMULATE), or ""."""
    from autoflash.emulation import active

    emulation = active()
    return emulation.gpu if emulation is not None else ""


def _probe_device(device_index: int) -> str:
    if device_index not in _device_reasons:
        try:
            import cupy  # noqa: F401  (loads and launches the kernels)
        except ImportError as e:
            from autoflash.kernels.compiler import install_hint

            _device_reasons[device_index] = (f"CuPy is not importable ({e}); install autoflash's CUDA stack, "
                                             f"the one that matches the driver: {install_hint()}")
            return _device_reasons[device_index]
        try:
            from autoflash.kernels.launch import device_profile

            device_profile(device_index)
            reason = ""
        except (ImportError, ValueError, RuntimeError) as e:
            # an older GPU, a driver older than the CUDA stack (the install line that fixes it), no
            # NVRTC, or limits autoflash cannot read
            reason = str(e)
        _device_reasons[device_index] = reason
    return _device_reasons[device_index]


def plan(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
         device_check: bool = True) -> Plan:
    """Validates a call as SDPA would and decides its path (see Plan). `device_check=False` skips
    the CUDA-device requirement (explain(..., gpu=NAME) plans for a GPU that is not here).

    A model calls with a handful of signatures over and over, so a valid call's Plan is remembered
    per _plan_key (its metadata and the global state the decision reads); bad input is never
    remembered and raises afresh, with the same message, on every call."""
    # Under torch.compile the shapes may be symbolic: nothing to key on, and the trace runs once.
    cache_key = None if torch.compiler.is_compiling() else \
        _plan_key(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, device_check)
    if cache_key is not None:
        try:
            cached = _plans.get(cache_key)
        except TypeError:  # symbolic sizes outside a dynamo trace (a fake-tensor pass) do not hash
            cache_key = cached = None
        if cached is not None:
            return cached
    decided = _decide(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, device_check)
    if cache_key is not None:
        _remember(cache_key, decided)
    return decided


# ------------------------------------------------------------------ the plan cache
PLAN_CACHE_MAX = 1024  # signatures remembered; a model uses a few, decoding one per key length
_plans: dict[tuple, Plan] = {}


def _plan_key(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, device_check) -> tuple | None:
    """Everything _decide reads, as a hashable key; None for a call that is not cached.

    Uncached: non-tensors, flags that are not bools, a scale or dropout_p that is a bool or no
    number, a scale that is not positive. Validation refuses these or they take a fallback anyway;
    they pay the full planning, and cannot be answered by a valid call's entry (1 == True and
    0.0 == -0.0 as dict keys, with different outcomes)."""
    if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)):
        return None
    if not ((is_causal is True or is_causal is False) and (enable_gqa is True or enable_gqa is False)
            and (device_check is True or device_check is False)):
        return None
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (float, int)):
        return None
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (float, int)) or not scale > 0):
        return None
    if attn_mask is None:
        mask = None
    elif isinstance(attn_mask, torch.Tensor):
        mask = (attn_mask.shape, attn_mask.stride(), attn_mask.dtype, attn_mask.device, attn_mask.requires_grad)
    else:
        return None
    # The emulated GPU matters only where plan() consults it: CPU tensors, devices checked.
    emulated = _emulated_gpu() if device_check and query.is_cpu else ""
    # Strides: no rule reads them today; keyed so that a layout rule added to _decide is never served stale.
    return (query.shape, key.shape, value.shape, query.stride(), key.stride(), value.stride(),
            query.dtype, key.dtype, value.dtype, query.device, key.device, value.device,
            mask, dropout_p, is_causal, scale, enable_gqa, device_check, emulated)


def _remember(cache_key: tuple, decided: Plan) -> None:
    if len(_plans) >= PLAN_CACHE_MAX:
        _plans.clear()  # all at once: a dict has no cheap thread-safe LRU, and a refill is what a miss costs
    _plans[cache_key] = decided


def clear_plan_cache() -> None:
    """Forget remembered plans (tests; nothing else needs it: the key covers what a plan reads)."""
    _plans.clear()


def _decide(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, device_check) -> Plan:
    """plan() without the cache: validation, then every reason the kernels cannot run the call (the
    first is the one a fallback warns about; explain() lists them all)."""
    _validate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    e, ev = query.shape[-1], value.shape[-1]
    sc = 1.0 / math.sqrt(e) if scale is None else float(scale)
    emulated = device_check and query.device.type == "cpu" and bool(_emulated_gpu())
    reasons = []
    if device_check and query.device.type != "cuda" and not emulated:
        reasons.append(f"{query.device.type} tensors: the kernels run on CUDA GPUs (or on the CPU inside "
                       "autoflash.emulate())")
    if query.dtype not in KERNEL_DTYPES:
        reasons.append(f"dtype {query.dtype}: the kernels run float16, bfloat16 and float32")
    mask = _mask_kind(attn_mask, query)
    if attn_mask is not None and attn_mask.requires_grad:
        reasons.append("attn_mask requires grad: the kernels give no gradient for a mask")
    if mask == KEY_PADDING_IF_CONSTANT and torch.compiler.is_compiling():
        reasons.append("attn_mask shaped (..., Lq, Lk) under torch.compile: telling a key-padding mask from "
                       "another reads its values (only masks that broadcast over queries and heads run on the "
                       "kernels here)")
    if dropout_p > 0.0:
        reasons.append("dropout_p > 0: the kernels have no dropout yet")
    if e > HEAD_DIM_MAX or ev > HEAD_DIM_V_MAX or (e != ev and query.dtype not in (torch.float16, torch.bfloat16)):
        reasons.append(f"head_dim {e} (value {ev}): the kernels run query head dims up to {HEAD_DIM_MAX} and value "
                       f"head dims up to {HEAD_DIM_V_MAX}, the value's its own in float16 and bfloat16")
    if not sc > 0.0:
        reasons.append(f"scale {sc}: the kernels take a positive scale")
    if query.dtype == torch.float32 and (attn_mask is not None or not native_head_dim(e)):
        what = "an attn_mask" if attn_mask is not None else f"head_dim {e}"
        reasons.append(f"float32 with {what}: the float32 (SIMT) kernels run plain and causal calls at head dims "
                       f"{HEAD_DIM_MIN}..{HEAD_DIM_MAX} in steps of {HEAD_DIM_STEP}; their variant switches are "
                       "built and tested for float16/bfloat16 only")
    if query.dim() < 3 or not (query.dim() == key.dim() == value.dim()) \
            or query.shape[:-3] != key.shape[:-3] or key.shape[:-3] != value.shape[:-3] \
            or (not enable_gqa and not (query.shape[-3] == key.shape[-3] == value.shape[-3])):
        reasons.append(f"shapes query {tuple(query.shape)}, key {tuple(key.shape)}: the kernels take (..., heads, "
                       "seqlen, head_dim) inputs with the same leading dims (no broadcasting)")
    elif math.prod(query.shape[:-3]) > GRID_YZ_MAX or query.shape[-3] > GRID_YZ_MAX:
        reasons.append(f"batch {math.prod(query.shape[:-3])} x heads {query.shape[-3]}: the kernels launch at most "
                       f"{GRID_YZ_MAX} of each")
    if device_check and not emulated and query.device.type == "cuda":
        index = device_index(query)
        reason = _device_reason(index)
        if reason:
            reasons.append(f"cuda:{index}: {reason}")
    if reasons:
        return Plan(reasons[0], sc, others=tuple(reasons[1:]))
    return Plan(None, sc, tuple(query.shape[:-3]), mask)


# ------------------------------------------------------------------ key-padding masks
def _mask_kind(attn_mask, query) -> str:
    """NO_MASK, KEY_PADDING when the mask's shape broadcasts over queries and heads (read from the
    shape alone), else KEY_PADDING_IF_CONSTANT (its values decide: mask_reason)."""
    if attn_mask is None:
        return NO_MASK
    heads = attn_mask.shape[-3] if attn_mask.dim() >= 3 else 1
    rows = attn_mask.shape[-2] if attn_mask.dim() >= 2 else 1
    if rows == 1 and heads == 1:  # a lone query row also has rows == 1 (the mask broadcasts to Lq)
        return KEY_PADDING
    return KEY_PADDING_IF_CONSTANT


def _with_heads_dim(attn_mask: torch.Tensor) -> torch.Tensor:
    """The mask as (..., heads, Lq, Lk), size-1 dims put in front where it has fewer (a view)."""
    return attn_mask.reshape((1,) * max(0, 3 - attn_mask.dim()) + tuple(attn_mask.shape))


def _first_row(attn_mask: torch.Tensor) -> torch.Tensor:
    """The mask's first query row of its first head, as (..., 1, 1, Lk) (a view)."""
    return _with_heads_dim(attn_mask).narrow(-2, 0, 1).narrow(-3, 0, 1)


VARYING_MASK = ("attn_mask varies over queries or heads: not a key-padding mask (a transformers model on "
                "attn_implementation=\"sdpa\" hands over such a 4D mask for a padded batch: "
                "autoflash.hf.register() and attn_implementation=\"autofa\" run it on the kernels)")
CAPTURED_MASK = ("attn_mask shaped (..., Lq, Lk) under CUDA graph capture: telling a key-padding mask from "
                 "another reads its values, which capture forbids (masks that broadcast over queries and "
                 "heads, e.g. (B, 1, 1, Lk), run on the kernels)")
_MASK_VERDICTS = TensorMemo()  # mask -> mask_reason's verdict


def mask_reason(attn_mask: torch.Tensor | None, p: Plan) -> str | None:
    """Why this call's mask cannot run on the kernels (None if it can). For a KEY_PADDING_IF_CONSTANT
    plan this compares the mask with its first row: a data check (a synchronisation on CUDA), needed
    because a (B, 1, Lq, Lk) mask may be a padding mask expanded over queries, or not. Once per mask
    tensor and version: a model hands every layer of a forward the same mask, so a forward pays one
    comparison, not one per layer. Where nothing may be read back (CUDA graph capture) the call
    falls back."""
    if p.reason is not None or p.mask != KEY_PADDING_IF_CONSTANT:
        return p.reason
    if attn_mask.device.type == "meta":  # metadata only (planning a call, nothing to compare)
        return None
    verdict = _MASK_VERDICTS.get(attn_mask)
    if verdict is not MISSING:
        return verdict
    if not host_reads_possible(attn_mask.device):
        return CAPTURED_MASK
    full = _with_heads_dim(attn_mask)
    verdict = None if torch.equal(full, _first_row(attn_mask).expand(full.shape)) else VARYING_MASK
    _MASK_VERDICTS.put(attn_mask, verdict)
    return verdict


def key_bias(attn_mask: torch.Tensor, batch_shape: tuple[int, ...], seqlen_k: int) -> torch.Tensor:
    """The kernels' additive per-key bias, fp32 (prod(batch_shape), seqlen_k), from a key-padding
    mask (one that mask_reason accepted): bool True (attend) -> 0, False -> -inf; a float mask as
    it is. Its first query row and head stand for all of them."""
    row = _first_row(attn_mask)
    row = row.expand(*batch_shape, 1, 1, seqlen_k).reshape(-1, seqlen_k)
    if row.dtype == torch.bool:
        return torch.zeros(row.shape, dtype=torch.float32, device=row.device).masked_fill_(~row, float("-inf"))
    return row.to(torch.float32, copy=True)


# ------------------------------------------------------------------ the entry point
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
              *, strict: bool | None = None) -> torch.Tensor:
    """scaled_dot_product_attention on autoflash's kernels: same arguments, shapes and semantics.

    query (..., Hq, L, E), key (..., H, S, E), value (..., H, S, Ev) -> (..., Hq, L, Ev); is_causal
    is the top-left causal mask; scale defaults to 1/sqrt(E); enable_gqa lets H divide Hq.
    Differentiable. Inside autoflash.emulate() CPU tensors run the kernels on the host emulator.

    attn_mask (bool, True = attend, or additive float) runs on the kernels when it is a
    key-padding mask: the same for every query and head, e.g. (B, 1, 1, S) or a (B, 1, L, S) one
    whose rows are all equal (checked at call time: one comparison). A query whose keys are all
    masked gets output 0 from the kernels; torch SDPA gives 0 or NaN there, by backend and version.
    Head dims up to 256 that the kernels have no tiles for (not multiples of 8, or below 32) run
    zero-padded, as flash-attn's wrapper does. A value head dim other than the query's (up to 512,
    float16/bfloat16) runs the forward kernel's head_dim_v switch (the backward up to 256, padded).
    float32 runs the SIMT kernels (no tensor cores) for calls without a mask at the kernels' own head
    dims. What the kernels do not run (CPU tensors outside autoflash.emulate(), float64, float32
    with a mask, a padded head dim or a value head dim of its own, other masks, a mask that requires
    grad, dropout, head dims over 256 (values' over 512), broadcast batch dims) runs torch SDPA with one
    FallbackWarning per reason; strict=True (or AUTOFLASH_STRICT=1) raises UnsupportedCallError
    instead (autoflash.dispatch.policy).
    """
    p = plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    reason = mask_reason(attn_mask, p)
    if reason is not None:
        fall_back("autoflash.attention", reason, strict)
        return _torch_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                           scale=scale, enable_gqa=enable_gqa)
    q, k, v = (t if t.dim() == 4 else t.reshape(-1, *t.shape[-3:]) for t in (query, key, value))
    if attn_mask is not None:
        out = masked_kernels(q, k, v, key_bias(attn_mask, p.batch_shape, k.shape[-2]), p.scale)
    elif not native_head_dim(q.shape[-1]) or v.shape[-1] != q.shape[-1]:  # zero-padded, or V's own head dim
        out = masked_kernels(q, k, v, None, p.scale, causal=is_causal)
    elif not torch.compiler.is_compiling():  # a CUDA tensor, or a CPU one inside autoflash.emulate()
        out = _eager(q, k, v, is_causal, p.scale)
    else:  # traced by torch.compile: the custom op, one node with fake shapes and an autograd formula
        from autoflash.dispatch import ops  # noqa: F401  (registers torch.ops.autoflash)

        out, _ = torch.ops.autoflash.attention_fwd(q, k, v, is_causal, p.scale)
    return out if query.dim() == 4 else out.reshape(*p.batch_shape, *out.shape[1:])


def native_head_dim(e: int) -> bool:
    """Whether the kernels have tiles for head dim `e` as it is (else attention_variant pads it)."""
    return HEAD_DIM_MIN <= e <= HEAD_DIM_MAX and e % HEAD_DIM_STEP == 0


def masked_kernels(q, k, v, bias: torch.Tensor | None, scale: float, causal: bool = False) -> torch.Tensor:
    """The kernels through attention_variant, q/k/v (B, H, L, D): with an additive per-key bias
    (B, Lk) fp32 (the key-padding path), and for head dims the kernels run zero-padded (1..256 that
    are not multiples of 8 in 32..256; top-left causal as SDPA's). On CPU tensors outside
    autoflash.emulate() attention_variant runs its PyTorch reference (autoflash.attention never
    sends them here; tests do)."""
    from autoflash.dispatch.flash_api import attention_variant

    out, _ = attention_variant(q, k, v, scale=scale, causal=causal, key_bias=bias,
                               deterministic=torch.are_deterministic_algorithms_enabled())
    return out


def _eager(q, k, v, is_causal: bool, scale: float) -> torch.Tensor:
    """The same kernels and configs as the custom op, through an autograd.Function: eagerly it costs
    a few microseconds less per call than the op's dispatch (python -m autoflash.bench dispatch)."""
    FlashAttentionFunction, chunked, selected_config = _kernel_entry()
    q, k, v = chunked(q), chunked(k), chunked(v)
    fwd = selected_config(q, "fwd", is_causal, k.shape[2])
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    bwd = selected_config(q, "bwd", is_causal, k.shape[2]) if needs_grad else None
    return FlashAttentionFunction.apply(q, k, v, is_causal, scale, fwd, bwd,
                                        torch.are_deterministic_algorithms_enabled())


@functools.lru_cache(maxsize=1)
def _kernel_entry():
    """What _eager calls, imported on the first kernel call (a fallback-only program never loads the
    kernels' modules) and then held: an import statement costs ~0.5 us a call even when loaded."""
    from autoflash.dispatch.ops import selected_config
    from autoflash.kernels.checks import chunked
    from autoflash.kernels.function import FlashAttentionFunction

    return FlashAttentionFunction, chunked, selected_config


@contextlib.contextmanager
def patch_sdpa(*, strict: bool | None = None):
    """Within the block, torch.nn.functional.scaled_dot_product_attention is autoflash.attention
    (code that looks it up through torch.nn.functional at call time, as transformers' "sdpa"
    attention does). A reference taken before the block (`from torch.nn.functional import
    scaled_dot_product_attention`) keeps torch's own."""
    import torch.nn.functional as F

    previous = F.scaled_dot_product_attention

    def patched(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, strict=strict)

    patched.__doc__ = attention.__doc__
    F.scaled_dot_product_attention = patched
    try:
        yield patched
    finally:
        F.scaled_dot_product_attention = previous
