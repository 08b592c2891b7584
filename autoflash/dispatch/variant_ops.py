"""The variant kernels as torch.library custom ops: `autoflash::flash_fwd` and `autoflash::flash_bwd`.

They carry every variant argument of the launcher (alignment, sliding window, softcap, ALiBi slopes,
a per-key bias, packed sequences), so flash_attn_func, flash_attn_varlen_func and the SDPA
key-padding path trace under torch.compile as single nodes (fake implementations give the shapes)
and autograd reaches the backward kernel (register_autograd). The arguments come here already
checked and normalised by autoflash.dispatch.flash_api; this module only runs them.

Where they run, as autoflash/dispatch/ops.py does it: on CUDA tensors the kernels, with the config
picked from the tensors' metadata; on CPU tensors inside autoflash.emulate() the same kernels on the
host emulator; on CPU tensors otherwise the PyTorch references (autoflash.reference.forward), so
the registration (schema, fake, autograd) is checkable on any machine.

No `from __future__ import annotations` here: torch.library reads the signature's annotations as
types to build each op's schema.
"""
from typing import Optional

import torch

from autoflash.dispatch.policy import emulating
from autoflash.dispatch.selection import HEURISTIC, Selection, select_config
from autoflash.kernels.checks import DTYPE_NAMES, chunked, empty_like_width
from autoflash.kernels.config import HEAD_DIM_MAX
from autoflash.kernels.launch import flash_backward, flash_forward, profile_for


def _variant(causal, align, window_left, window_right, attention_chunk, softcap, alibi_slopes, key_bias, cu_seqlens_q,
             cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None) -> dict:
    """The launcher's variant keywords from the ops' flat arguments (packed sequences only when
    cu_seqlens are given: the max_seqlens of a dense call are placeholders; the chunk and the rows
    in use only when there are any, as the references take them)."""
    kw = dict(causal=causal, align=align, window=(window_left, window_right), softcap=softcap,
              alibi_slopes=alibi_slopes, key_bias=key_bias)
    if attention_chunk:
        kw["attention_chunk"] = attention_chunk
    if cu_seqlens_q is not None:
        kw.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                  max_seqlen_k=max_seqlen_k)
        kw.update({n: t for n, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)) if t is not None})
    return kw


def _like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`t` with `ref`'s dtype and strides (what the fake implementations promise; an output as wide as
    V's head dim takes ref's dim order, empty_like_width): a copy only when it differs."""
    same = t.shape[-1] == ref.shape[-1]
    want = ref.stride() if same else empty_like_width(ref.to(device="meta"), t.shape[-1]).stride()
    if t.dtype == ref.dtype and t.stride() == want:
        return t
    return empty_like_width(ref, t.shape[-1]).copy_(t)


# ------------------------------------------------------------------ the kernels
def _config(q: torch.Tensor, v: torch.Tensor, direction: str, kw: dict, seqlen_k: int):
    """The tuned config for a call on q's GPU (tuned_selection), or None: the launcher's built-in tiles
    (always for a V head dim of its own: no table holds one)."""
    if v.shape[-1] != q.shape[-1]:
        return None
    selection = tuned_selection(profile_for(q, "autoflash.dispatch.variant_ops"), q, direction, kw, seqlen_k)
    return None if selection is None else selection.config


def tuned_selection(profile, q: torch.Tensor, direction: str, kw: dict, seqlen_k: int):
    """A tuned config for the call when a table has one for its key, else None (the launcher then
    takes its built-in tiles for kernels carrying variant switches). The key's variant: packed
    sequences are "varlen" (bucketed by max_seqlen_k), a causal sliding window (right side 0) is
    "window", anything else "plain". A plain key's tuned tiles are used only for a call with no
    switch at all: they were measured without the registers a switch needs (spills, see
    autoflash.kernels.defaults), so a softcap, ALiBi, key-bias, bottom-right or two-sided-window
    call takes the variant tiles instead."""
    left, right = kw["window"]
    windowed = (left, right) != (-1, -1)
    if kw.get("attention_chunk"):  # no tuner key holds chunks: the built-in tiles for the switch
        return None
    if "cu_seqlens_k" in kw:
        variant, causal = "varlen", kw["causal"]
    elif windowed and (kw["causal"] or right == 0):
        variant, causal = "window", True
    else:
        variant, causal = "plain", kw["causal"] or windowed
    if variant == "plain" and (windowed or kw["softcap"] or kw["alibi_slopes"] is not None
                               or kw["key_bias"] is not None or kw["align"] != "top_left"):
        return None
    try:
        selection = select_config(profile, direction, DTYPE_NAMES[q.dtype], q.shape[-1], causal, max(1, seqlen_k),
                                  variant=variant)
    except ValueError:  # a variant with no tuner key (e.g. fp32): the built-in tiles
        return None
    # The sm90 backward's tiles depend on the switches (defaults._sm90_variant_tiles): a config tuned for
    # a window or varlen key was compiled with that key's switches alone, so a call with more takes the
    # built-in tiles for them.
    more = kw["softcap"] or kw["alibi_slopes"] is not None or kw["key_bias"] is not None \
        or (variant == "varlen" and windowed)
    if more and direction == "bwd" and selection.config.family == "sm90":
        return None
    return None if selection.origin.startswith(HEURISTIC) else selection


def kernel_plan(profile, q, k, kw: dict, directions=("fwd", "bwd"), head_dim_v: int | None = None) -> tuple:
    """What the ops would launch for a checked call, per direction: Selection(tuner key or None,
    the KernelConfig with the call's switches, where its tiles came from). Metadata only: nothing is
    compiled or launched (autoflash.explain). `head_dim_v`: V's head dim where it differs (the kernels
    with both head dims; a backward on the sm80 family at the wider one, the narrower side padded)."""
    from autoflash.kernels.defaults import stack_note
    from autoflash.kernels.launch import family_reason, variant_config
    from autoflash.kernels.variants import resolve, views

    _, q4, k4, _ = views(q, k, k, kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k"))
    rest = {n: value for n, value in kw.items() if n != "causal"}
    causal, variant = resolve(q4, k4, kw["causal"], **rest)
    dtype, d = DTYPE_NAMES[q.dtype], q.shape[-1]
    wide_v = head_dim_v is not None and head_dim_v != d
    chosen = []
    for direction in directions:
        tuned = None if wide_v else tuned_selection(profile, q, direction, kw, max(1, _seqlen_k(k, kw)))
        if direction == "bwd" and max(d, head_dim_v or d) > HEAD_DIM_MAX:  # no backward (flash_backward refuses it)
            chosen.append(None)
            continue
        config = variant_config(tuned.config if tuned else None, direction, d, dtype, causal, variant, profile,
                                head_dim_v)
        origin = tuned.origin if tuned else HEURISTIC + (", the tiles for the call's variant switches"
                                                          if variant.needs_registers and config.family == "sm80" else "")
        why = family_reason(config, profile)
        origin += f"; family sm80 on this sm_90 GPU: {why}" if why else ""
        note = None if tuned else stack_note(config, profile)
        origin += f"; {note}" if note and note not in origin else ""
        chosen.append(Selection(tuned.key if tuned else None, config, origin))
    return tuple(chosen)


def _seqlen_k(k: torch.Tensor, kw: dict) -> int:
    return kw["max_seqlen_k"] if "cu_seqlens_k" in kw else k.shape[-2]


def _forward_kernels(q, k, v, scale, kw):
    q, k, v = chunked(q), chunked(k), chunked(v)
    out, lse = flash_forward(q, k, v, scale=scale, config=_config(q, v, "fwd", kw, _seqlen_k(k, kw)), **kw)
    return _like(out, q), lse


def _backward_kernels(dout, q, k, v, out, lse, scale, deterministic, kw):
    dq_like, dk_like, dv_like = q, k, v
    q, k, v, out, dout = (chunked(t) for t in (q, k, v, out, dout))
    dq, dk, dv = flash_backward(dout, q, k, v, out, lse, scale=scale, deterministic=deterministic,
                                config=_config(q, v, "bwd", kw, _seqlen_k(k, kw)), **kw)
    return _like(dq, dq_like), _like(dk, dk_like), _like(dv, dv_like)


# ------------------------------------------------------------------ the references (CPU, no emulation)
def _reference(q, k, v, scale, kw):
    """(out, lse) of the PyTorch reference, computed in fp32 (fp64 for fp64 inputs)."""
    from autoflash.reference.forward import attention_ref, attention_varlen_ref

    if "cu_seqlens_q" in kw:
        dense = {n: kw[n] for n in ("causal", "align", "window", "attention_chunk", "softcap", "alibi_slopes",
                                    "seqused_q", "seqused_k") if n in kw}
        return attention_varlen_ref(q, k, v, kw["cu_seqlens_q"], kw["cu_seqlens_k"], scale=scale, **dense)
    return attention_ref(q, k, v, scale=scale, **kw)


def _forward_reference(q, k, v, scale, kw):
    out, lse = _reference(q, k, v, scale, kw)
    return _like(out, q), lse.to(torch.float32)


def _autograd_below_the_op():
    """Autograd back on inside an op's kernel. The custom op machinery runs a kernel with the
    autograd dispatch keys excluded (the op's own formula is autograd's), so operations there record
    no graph even under torch.enable_grad(); this re-includes them for the block, as torch does
    itself where a graph must be built below an op (torch._higher_order_ops.invoke_leaf_function).
    torch.func.vjp would avoid the private guard but fails under dispatch modes (opcheck's)."""
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set()
    for key in (C.DispatchKey.AutogradFunctionality, C.DispatchKey.AutogradOther, C.DispatchKey.AutogradNestedTensor,
                C.DispatchKey.ADInplaceOrView):
        exclude = exclude.remove(key)
    return C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude)


def _backward_reference(dout, q, k, v, scale, kw):
    """The reference's gradients: autograd through it on detached leaves in fp32 (fp64 for fp64)."""
    upcast = torch.float64 if q.dtype == torch.float64 else torch.float32
    leaves = tuple(t.detach().to(upcast).requires_grad_() for t in (q, k, v))
    with _autograd_below_the_op(), torch.enable_grad():
        out = _reference(*leaves, scale, kw)[0]
        grads = torch.autograd.grad(out, leaves, dout.detach().to(out.dtype), allow_unused=True) \
            if out.requires_grad else (None,) * 3
    dq, dk, dv = (torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves))  # rows no output reads
    return _like(dq, q), _like(dk, k), _like(dv, v)


# ------------------------------------------------------------------ the ops
def _flash_fwd_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes: Optional[torch.Tensor],
              key_bias: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
              cu_seqlens_k: Optional[torch.Tensor], seqused_q: Optional[torch.Tensor],
              seqused_k: Optional[torch.Tensor], scale: float, causal: bool, align: str, window_left: int,
              window_right: int, attention_chunk: int, softcap: float, max_seqlen_q: int, max_seqlen_k: int,
              deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out like q, as wide as v, lse fp32): dense q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D), lse
    (B, Hq, Lq); packed (cu_seqlens given) q (total_q, Hq, D), k/v (total_k, Hkv, D), lse (Hq, total_q);
    v's head dim may differ from q's and k's (up to 512; the backward up to 256). `deterministic`
    is the backward's, kept for it. lse carries no gradient."""
    kw = _variant(causal, align, window_left, window_right, attention_chunk, softcap, alibi_slopes, key_bias,
                  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    return _forward_kernels(q, k, v, scale, kw)


flash_fwd = torch.library.custom_op("autoflash::flash_fwd", mutates_args=(), device_types="cuda")(_flash_fwd_cuda)


@flash_fwd.register_kernel("cpu")
def _flash_fwd_cpu(q, k, v, alibi_slopes, key_bias, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, scale, causal,
                   align, window_left, window_right, attention_chunk, softcap, max_seqlen_q, max_seqlen_k, deterministic):
    kw = _variant(causal, align, window_left, window_right, attention_chunk, softcap, alibi_slopes, key_bias,
                  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    if emulating():
        return _forward_kernels(q, k, v, scale, kw)
    return _forward_reference(q, k, v, scale, kw)


@flash_fwd.register_fake
def _flash_fwd_fake(q, k, v, alibi_slopes, key_bias, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, scale, causal,
                    align, window_left, window_right, attention_chunk, softcap, max_seqlen_q, max_seqlen_k,
                    deterministic):
    lse_shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else q.shape[:-1]
    return empty_like_width(q, v.shape[-1]), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("autoflash::flash_bwd", mutates_args=(), device_types="cuda")
def flash_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, alibi_slopes: Optional[torch.Tensor], key_bias: Optional[torch.Tensor],
              cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
              seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor], scale: float,
              causal: bool, align: str, window_left: int, window_right: int, attention_chunk: int, softcap: float,
              max_seqlen_q: int,
              max_seqlen_k: int, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) like (q, k, v) from the forward's out and lse; bit-reproducible with
    deterministic=True."""
    kw = _variant(causal, align, window_left, window_right, attention_chunk, softcap, alibi_slopes, key_bias,
                  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    return _backward_kernels(dout, q, k, v, out, lse, scale, deterministic, kw)


@flash_bwd.register_kernel("cpu")
def _flash_bwd_cpu(dout, q, k, v, out, lse, alibi_slopes, key_bias, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                   scale, causal, align, window_left, window_right, attention_chunk, softcap, max_seqlen_q,
                   max_seqlen_k, deterministic):
    kw = _variant(causal, align, window_left, window_right, attention_chunk, softcap, alibi_slopes, key_bias,
                  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    if emulating():
        return _backward_kernels(dout, q, k, v, out, lse, scale, deterministic, kw)
    return _backward_reference(dout, q, k, v, scale, kw)


@flash_bwd.register_fake
def _flash_bwd_fake(dout, q, k, v, out, lse, alibi_slopes, key_bias, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                    scale, causal, align, window_left, window_right, attention_chunk, softcap, max_seqlen_q,
                    max_seqlen_k, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_TENSOR_INPUTS = ("q", "k", "v", "alibi_slopes", "key_bias", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k")
_SCALAR_INPUTS = ("scale", "causal", "align", "window_left", "window_right", "attention_chunk", "softcap",
                  "max_seqlen_q", "max_seqlen_k", "deterministic")


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:len(_TENSOR_INPUTS)], *output)
    ctx.scalars = inputs[len(_TENSOR_INPUTS):]


def _backward(ctx, dout, _dlse):
    q, k, v, alibi_slopes, key_bias, cu_q, cu_k, used_q, used_k, out, lse = ctx.saved_tensors
    dq, dk, dv = flash_bwd(dout, q, k, v, out, lse, alibi_slopes, key_bias, cu_q, cu_k, used_q, used_k, *ctx.scalars)
    return (dq, dk, dv) + (None,) * (len(_TENSOR_INPUTS) - 3 + len(_SCALAR_INPUTS))


flash_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerForward(torch.autograd.Function):
    """flash_fwd's kernels and autograd formula without the op's dispatch, for eager calls: on the first
    H200 run flash_attn_func took 227 us of host time a call against autoflash.attention's 187 us,
    which already ran its kernels this way."""

    @staticmethod
    def forward(ctx, *args):  # ctx first: a separate setup_context makes apply() bind the signature per call
        output = (_flash_fwd_cuda if args[0].device.type == "cuda" else _flash_fwd_cpu)(*args)
        _setup_context(ctx, args, output)
        return output

    backward = staticmethod(_backward)


def flash_forward_call(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.ops.autoflash.flash_fwd(*args) under torch.compile (one node, its fake and autograd
    formula), the same kernels through _EagerForward otherwise (CUDA tensors, and CPU ones on the
    emulator or the reference as the op's CPU kernel runs them)."""
    if torch.compiler.is_compiling() or args[0].device.type not in ("cuda", "cpu"):
        return flash_fwd(*args)
    return _EagerForward.apply(*args)
