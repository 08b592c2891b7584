"""Attention backward references: a tiled FlashAttention-2 backward that follows the kernel's loops,
PyTorch autograd gradients of attention_ref, the gradients' shift from FlashAttention's delta over
the rounded output (delta_rounding_shift), and an autograd.Function tying the tiled forward and
backward together so torch.autograd.gradcheck can check the tiled backward in fp64."""
from __future__ import annotations

import torch

from autoflash.kernels.checks import check_qkv_shapes
from autoflash.kernels.config import KernelConfig
from autoflash.reference.forward import LOG2E, _FLOAT_DTYPES, _scale, _upcast_dtype, attention_ref, attention_tiled
from autoflash.reference.variants import NO_WINDOW, config_score_mod


def _check_like_q(name: str, t, q: torch.Tensor) -> None:
    """``t`` must have q's shape and device, and q's dtype or its compute dtype (the references
    return out in fp32 for fp16/bf16 inputs, the kernel writes it in q's dtype)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    if t.shape != q.shape:
        raise ValueError(f"{name}: got shape {tuple(t.shape)}, expected q's shape {tuple(q.shape)}")
    allowed = {q.dtype, _upcast_dtype(q.dtype)}
    if t.dtype not in allowed:
        raise TypeError(f"{name}: got dtype {t.dtype}, expected {' or '.join(sorted(str(d) for d in allowed))}")
    if t.device != q.device:
        raise ValueError(f"{name}: got device {t.device}, expected q's device {q.device}")


def _check_lse(lse, q: torch.Tensor) -> None:
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse: got {type(lse).__name__}, expected a torch.Tensor")
    b, hq, lq, _ = q.shape
    if lse.shape != (b, hq, lq):
        raise ValueError(f"lse: got shape {tuple(lse.shape)}, expected (B, Hq, Lq) = {(b, hq, lq)}")
    if not lse.dtype.is_floating_point:
        raise TypeError(f"lse: got dtype {lse.dtype}, expected a floating-point dtype")
    if lse.device != q.device:
        raise ValueError(f"lse: got device {lse.device}, expected q's device {q.device}")


def attention_backward_tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    config: KernelConfig,
    *,
    scale: float | None = None,
    window=NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention-2 backward following the kernel's loops for ``config``; returns (dq, dk, dv).

    q, out, dout: (B, Hq, Lq, D); k, v: (B, Hkv, Lk, D), Hq % Hkv == 0; lse: (B, Hq, Lq), the
    natural-log logsumexp from attention_ref / attention_tiled (+inf for a row that sees no key:
    its P, and so its dq, is exactly 0). causal and align come from ``config``; the variant
    arguments are attention_tiled's (given exactly when config's switch is on).

    Preprocess Dvec = rowsum(dout * out). The outer loop runs over key blocks of block_n keys (one
    CTA); the inner loop over only the query blocks whose rows see one of the block's keys
    (Band.query_blocks: both band edges). Per tile, in the log2 domain: P = exp2(S * log2e -
    lse * log2e) with S the masked logits, dV += Pᵀ dO, dP = dO Vᵀ, dS = P (dP - Dvec) times
    softcap's derivative 1 - tanh²(scale q.k / softcap) when capped, dK += scale dSᵀ Q,
    dQ += scale dS K. dK/dV of a kv head sum over the query heads sharing it.

    Computes in fp32 (fp64 for fp64 inputs); gradients come back in that dtype with the shapes of
    q, k and v.
    """
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config: got {type(config).__name__}, expected a KernelConfig")
    check_qkv_shapes(q, k, v, _FLOAT_DTYPES)
    _check_like_q("out", out, q)
    _check_like_q("dout", dout, q)
    _check_lse(lse, q)
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if d != config.head_dim:
        raise ValueError(f"head_dim: got {d}, expected config.head_dim = {config.head_dim}")
    sc = _scale(scale, d)
    mod = config_score_mod(config, q, k, sc, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                           key_bias=key_bias)
    dtype = _upcast_dtype(q.dtype)
    group = hq // hkv
    br, bc = config.block_m, config.block_n
    dev = q.device

    # Query-side tensors grouped under their kv head: (B, Hkv, group, Lq, ...); K, V broadcast.
    qg = q.to(dtype).reshape(b, hkv, group, lq, d)
    dog = dout.to(dtype).reshape(b, hkv, group, lq, d)
    og = out.to(dtype).reshape(b, hkv, group, lq, d)
    lse2 = (lse.to(dtype) * LOG2E).reshape(b, hkv, group, lq, 1)  # +inf stays +inf
    dvec = (dog * og).sum(dim=-1, keepdim=True)  # preprocess kernel: rowsum(dO ∘ O)
    kg = k.to(dtype).unsqueeze(2)
    vg = v.to(dtype).unsqueeze(2)

    dq = torch.zeros(b, hkv, group, lq, d, dtype=dtype, device=dev)
    dk = torch.zeros(b, hkv, lk, d, dtype=dtype, device=dev)
    dv = torch.zeros(b, hkv, lk, d, dtype=dtype, device=dev)

    for n_block in range((lk + bc - 1) // bc):
        # Slicing to Lk drops the padded keys >= Lk that the kernel masks to P = 0.
        c0, c1 = n_block * bc, min((n_block + 1) * bc, lk)
        k_j, v_j = kg[..., c0:c1, :], vg[..., c0:c1, :]
        dk_j = torch.zeros(b, hkv, group, c1 - c0, d, dtype=dtype, device=dev)
        dv_j = torch.zeros_like(dk_j)
        cols = torch.arange(c0, c1, device=dev)
        for m_block in mod.band.query_blocks(c0, bc, lq, br):
            r0, r1 = m_block * br, min((m_block + 1) * br, lq)
            q_i, do_i = qg[..., r0:r1, :], dog[..., r0:r1, :]
            qk = torch.matmul(q_i, k_j.transpose(-2, -1))
            s2 = mod.logits(qk, torch.arange(r0, r1, device=dev), cols) * LOG2E
            # Masked logits are -inf and lse is never -inf, so P is 0 there, never NaN.
            p = torch.exp2(s2 - lse2[..., r0:r1, :])
            dv_j += torch.matmul(p.transpose(-2, -1), do_i)
            dp = torch.matmul(do_i, v_j.transpose(-2, -1))
            ds = p * (dp - dvec[..., r0:r1, :]) * mod.cap_grad(qk)
            dk_j += torch.matmul(ds.transpose(-2, -1), q_i) * sc
            dq[..., r0:r1, :] += torch.matmul(ds, k_j) * sc
        # GQA: the kv head's gradient is the sum over the query heads that read it.
        dk[..., c0:c1, :] = dk_j.sum(dim=2)
        dv[..., c0:c1, :] = dv_j.sum(dim=2)

    return dq.reshape(b, hq, lq, d), dk, dv


def attention_backward_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    upcast: bool = True,
    mask: torch.Tensor | None = None,
    align: str = "top_left",
    window=NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
    attention_chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of attention_ref's out for upstream gradient ``dout``, by autograd;
    the keywords are attention_ref's (mask and the variants: align, window, softcap, alibi_slopes,
    key_bias, attention_chunk).

    upcast=True differentiates in fp32 (fp64 for fp64 inputs) and returns gradients in that dtype:
    the accuracy reference. upcast=False differentiates in the input dtype and returns gradients
    in it: "PyTorch in the same dtype", the yardstick of FlashAttention-3's gradient rule
    (err(dX) <= 2 * err(dX_torch) + 2 * rounding of dX_ref in the input dtype, see
    within_tolerance(backward=True)).
    """
    check_qkv_shapes(q, k, v, _FLOAT_DTYPES)
    if not isinstance(dout, torch.Tensor):
        raise TypeError(f"dout: got {type(dout).__name__}, expected a torch.Tensor")
    if dout.shape != (*q.shape[:-1], v.shape[-1]):
        raise ValueError(f"dout: got shape {tuple(dout.shape)}, expected out's shape {(*q.shape[:-1], v.shape[-1])} "
                         f"(q's, as wide as v)")
    if not dout.dtype.is_floating_point:
        raise TypeError(f"dout: got dtype {dout.dtype}, expected a floating-point dtype")
    if dout.device != q.device:
        raise ValueError(f"dout: got device {dout.device}, expected q's device {q.device}")
    dtype = _upcast_dtype(q.dtype) if upcast else q.dtype
    # Leaves in the compute dtype, so the gradients are not rounded back to the input dtype.
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        out, _ = attention_ref(*leaves, causal=causal, scale=scale, upcast=upcast, mask=mask, align=align,
                               window=window, softcap=softcap, alibi_slopes=alibi_slopes, key_bias=key_bias,
                               attention_chunk=attention_chunk)
        dq, dk, dv = torch.autograd.grad(out, leaves, grad_outputs=dout.detach().to(out.dtype))
    return dq, dk, dv


def delta_rounding_shift(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    **kw,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How much FlashAttention's backward moves (dq, dk, dv) off the exact gradients by taking
    delta = rowsum(dO * O) from ``out``, the output as the backward receives it (in the input dtype),
    instead of the exact O. FlashAttention-2 and -3 do this (their bwd preprocess kernels read O in
    the input dtype), and so do the kernels (templates/flash_bwd.cu.j2, the _delta kernel).

    With delta off by e_i = dO_i . (out_i - O_i), dS = P (dP - delta) is off by -P_ij e_i, the
    gradient with respect to the scores of -sum_i e_i lse_i, so the shift is that gradient through
    attention_ref (fp32, the keywords are attention_ref's): dv's is 0. The rows' errors e_i do not
    shrink where a softmax row is nearly one-hot, where the exact dS (and PyTorch's rounding of it)
    does, so on problems with a few query rows per key (causal Lq = 2) the shift can exceed
    FlashAttention-3's rule by itself. Returns fp32 (fp64 for fp64 inputs) tensors shaped as q, k, v.
    """
    check_qkv_shapes(q, k, v, _FLOAT_DTYPES)
    _check_like_q("out", out, q)
    _check_like_q("dout", dout, q)
    dtype = _upcast_dtype(q.dtype)
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        exact, lse = attention_ref(*leaves, upcast=True, **kw)
        e = (dout.detach().to(dtype) * (out.detach().to(dtype) - exact.detach())).sum(-1)
        # rows that see no key: lse = +inf, out = O = 0, e = 0; they add nothing
        term = torch.where(torch.isfinite(lse), -e * lse, torch.zeros_like(lse)).sum()
        grads = torch.autograd.grad(term, leaves, allow_unused=True)
    return tuple(g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves))


class TiledAttention(torch.autograd.Function):
    """Forward attention_tiled (returns out), backward attention_backward_tiled; lse is saved.
    apply(q, k, v, config, scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None,
    key_bias=None): the variant arguments are attention_tiled's, and get no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, config, scale=None, window=NO_WINDOW, softcap=0.0, alibi_slopes=None,
                key_bias=None):
        variant = dict(window=window, softcap=softcap, alibi_slopes=alibi_slopes, key_bias=key_bias)
        out, lse = attention_tiled(q, k, v, config, scale=scale, **variant)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config, ctx.scale, ctx.variant = config, scale, variant
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward_tiled(
            q, k, v, out, lse, dout.to(out.dtype), ctx.config, scale=ctx.scale, **ctx.variant
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: KernelConfig,
    scale: float | None = None,
    *,
    window=NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable tiled attention: out of attention_tiled, gradients of attention_backward_tiled
    (w.r.t. q, k and v; the variant arguments are attention_tiled's)."""
    return TiledAttention.apply(q, k, v, config, scale, window, softcap, alibi_slopes, key_bias)
