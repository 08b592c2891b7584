"""Plain and tiled (online-softmax) PyTorch attention references, and FlashAttention's accuracy
rule, used by the tests and the benchmark to judge generated kernels."""
from __future__ import annotations

import math

import torch

from autoflash.kernels.checks import check_qkv_shapes
from autoflash.kernels.config import KernelConfig

LOG2E = 1.4426950408889634  # log2(e): the kernel folds it into the softmax scale and uses exp2
LN2 = 0.6931471805599453  # ln(2): turns the kernel's log2-domain LSE back into natural log

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _scale(scale: float | None, d: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: got {scale!r}, expected a float or None")
    return float(scale)


def _upcast_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


ALIGNS = ("top_left", "bottom_right")


def band_mask(lq: int, lk: int, *, causal: bool = False, align: str = "top_left", window=(-1, -1),
              device=None, diag: int | None = None) -> torch.Tensor | None:
    """The (lq, lk) bool keep-mask of the causal band and sliding window, or None when every key is
    kept. Query i's diagonal is key i + diag: diag 0 top-left (SDPA's is_causal), lk - lq
    bottom-right (flash-attn's). causal keeps keys j <= i + diag; window (left, right), -1
    unbounded, keeps i + diag - left <= j <= i + diag + right; causal makes right 0."""
    if align not in ALIGNS:
        raise ValueError(f"align: got {align!r}, expected one of {ALIGNS}")
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or any(isinstance(w, bool) or not isinstance(w, int) or w < -1 for w in window)):
        raise ValueError(f"window: got {window!r}, expected (left, right): ints >= 0, or -1 for unbounded")
    left, right = window
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None
    if diag is None:
        diag = lk - lq if align == "bottom_right" else 0
    i = torch.arange(lq, device=device).unsqueeze(1) + diag
    j = torch.arange(lk, device=device).unsqueeze(0)
    keep = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if right >= 0:
        keep &= j <= i + right
    if left >= 0:
        keep &= j >= i - left
    return keep


def _check_fp32(name: str, t, shapes: tuple, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    if t.dtype != torch.float32 or tuple(t.shape) not in shapes or t.device != device:
        raise ValueError(f"{name}: got {tuple(t.shape)} {t.dtype} on {t.device}; expected float32 of shape "
                         f"{' or '.join(str(x) for x in shapes)} on {device}")


def _logits(s: torch.Tensor, *, softcap: float, alibi_slopes, key_bias, diag: int) -> torch.Tensor:
    """Scaled scores s (B, H, Lq, Lk) to logits: softcap * tanh(s / softcap), minus
    slope * |i + diag - j| (ALiBi), plus key_bias[b, j]."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap: got {softcap!r}, expected a finite number >= 0 (0 = no capping)")
    b, h, lq, lk = s.shape
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        _check_fp32("alibi_slopes", alibi_slopes, ((h,), (b, h)), s.device)
        slopes = alibi_slopes.to(s.dtype).expand(b, h) if alibi_slopes.dim() == 1 else alibi_slopes.to(s.dtype)
        dist = (torch.arange(lq, device=s.device).unsqueeze(1) + diag - torch.arange(lk, device=s.device)).abs()
        s = s - slopes[:, :, None, None] * dist.to(s.dtype)
    if key_bias is not None:
        _check_fp32("key_bias", key_bias, ((b, lk),), s.device)
        s = s + key_bias.to(s.dtype)[:, None, None, :]
    return s


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    upcast: bool = True,
    mask: torch.Tensor | None = None,
    align: str = "top_left",
    window=(-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention softmax(scale * q kᵀ) v in plain PyTorch; returns (out, lse).

    q: (B, Hq, Lq, D); k, v: (B, Hkv, Lk, D) with Hq % Hkv == 0 (query head h reads kv head
    h // (Hq // Hkv)). ``causal`` is top-left aligned like SDPA's ``is_causal``: query i sees keys
    j <= i, also when Lq != Lk. ``mask`` is a boolean tensor broadcastable to (B, Hq, Lq, Lk),
    True = keep. Default scale is 1/sqrt(D).

    upcast=True computes in fp32 (fp64 for fp64 inputs): the accuracy reference. upcast=False
    computes scores, softmax and output in the input dtype: "PyTorch in the same dtype".

    Returns out (B, Hq, Lq, D) in the compute dtype and lse (B, Hq, Lq) fp32 (fp64 for fp64 inputs),
    the natural-log logsumexp of the scaled, masked scores.

    A row that sees no key (all masked) gets out = 0 and lse = +inf, so a backward pass that
    recomputes P = exp(S - lse) gets exactly 0 there instead of NaN.

    The variants (flash-attn's; the kernels' KernelConfig switches): ``align`` places query i's
    diagonal at key i ("top_left") or i + Lk - Lq ("bottom_right"), for ``causal``, ``window``
    (band_mask) and ALiBi's distance; ``softcap`` > 0 caps the scaled scores as
    softcap * tanh(s / softcap); ``alibi_slopes`` fp32 (Hq,) or (B, Hq) subtracts
    slope * |i + diag - j|; ``key_bias`` fp32 (B, Lk) is added to every row (-inf masks a key).
    The lse is that of the final logits. Differentiable in q, k, v.
    """
    check_qkv_shapes(q, k, v, _FLOAT_DTYPES)
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    sc = _scale(scale, d)
    dtype = _upcast_dtype(q.dtype) if upcast else q.dtype
    group = hq // hkv
    qc, kc, vc = q.to(dtype), k.to(dtype), v.to(dtype)
    if group > 1:
        kc, vc = kc.repeat_interleave(group, dim=1), vc.repeat_interleave(group, dim=1)

    keep = None
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise TypeError(f"mask: got {got}, expected a torch.bool tensor")
        if mask.device != q.device:
            raise ValueError(f"mask: got device {mask.device}, expected {q.device}")
        try:
            keep = mask.expand(b, hq, lq, lk)
        except RuntimeError:
            raise ValueError(
                f"mask: got shape {tuple(mask.shape)}, expected broadcastable to {(b, hq, lq, lk)}"
            ) from None
    band = band_mask(lq, lk, causal=causal, align=align, window=window, device=q.device)
    if band is not None:
        keep = band if keep is None else keep & band

    # Scale applied to q kᵀ (not to q) as FlashAttention's reference does.
    s = torch.matmul(qc, kc.transpose(-2, -1)) * sc
    diag = lk - lq if align == "bottom_right" else 0
    s = _logits(s, softcap=softcap, alibi_slopes=alibi_slopes, key_bias=key_bias, diag=diag)
    if key_bias is not None:  # keys the bias masks count as masked: rows left with none get the convention
        unmasked = torch.isfinite(key_bias)[:, None, None, :]
        keep = unmasked if keep is None else keep & unmasked
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.logsumexp(s.to(lse_dtype), dim=-1)
    if keep is not None:
        # softmax of an all -inf row is NaN; the documented convention is P = 0, lse = +inf.
        empty = ~keep.expand(b, hq, lq, lk).any(dim=-1)
        p = p.masked_fill(empty.unsqueeze(-1), 0.0)
        lse = lse.masked_fill(empty, float("inf"))
    out = torch.matmul(p, vc)
    return out, lse


def attention_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    upcast: bool = True,
    align: str = "top_left",
    window=(-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_ref over packed sequences: q (total_q, Hq, D), k, v (total_k, Hkv, D), sequence b
    being rows cu_seqlens[b] .. cu_seqlens[b + 1] (int32, starting at 0) with its own lengths (so
    its own bottom-right diagonal). Returns out (total_q, Hq, D) and lse (Hq, total_q), flash-attn's
    varlen layout; a sequence with queries and no keys gets out 0, lse +inf. Differentiable."""
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or t.numel() < 2:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: got {got}, expected a 1-D int32 tensor of batch + 1 cumulative lengths")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens: got {cu_seqlens_q.numel()} and {cu_seqlens_k.numel()} entries, expected equal")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name}: got {getattr(t, 'shape', type(t).__name__)}, expected (total, heads, head_dim)")
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    hq, d = q.shape[1], q.shape[2]
    dtype = _upcast_dtype(q.dtype) if upcast else q.dtype
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs, lses = [], []
    for b in range(len(cq) - 1):
        nq, nk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if nq == 0:
            continue
        if nk == 0:
            outs.append(torch.zeros(nq, hq, d, dtype=dtype, device=q.device))
            lses.append(torch.full((hq, nq), float("inf"), dtype=lse_dtype, device=q.device))
            continue
        qs = q[cq[b]:cq[b + 1]].transpose(0, 1).unsqueeze(0)
        ks, vs = (t[ck[b]:ck[b + 1]].transpose(0, 1).unsqueeze(0) for t in (k, v))
        slopes = None if alibi_slopes is None else (alibi_slopes[b:b + 1] if alibi_slopes.dim() == 2
                                                    else alibi_slopes)
        o, l = attention_ref(qs, ks, vs, causal=causal, scale=scale, upcast=upcast, align=align, window=window,
                             softcap=softcap, alibi_slopes=slopes)
        outs.append(o[0].transpose(0, 1))
        lses.append(l[0])
    if not outs:
        return (torch.zeros(0, hq, d, dtype=dtype, device=q.device),
                torch.zeros(hq, 0, dtype=lse_dtype, device=q.device))
    return torch.cat(outs), torch.cat(lses, dim=1)


def attention_tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: KernelConfig,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled online-softmax attention that follows the kernel's loops for ``config``; (out, lse).

    Computes in fp32 (fp64 for fp64 inputs) with scores in the log2 domain; causal comes from
    config.causal (top-left aligned, as in attention_ref). Key blocks entirely above the diagonal
    are skipped, as the kernel skips them. Same shapes, GQA rule and empty-row convention as
    attention_ref.
    """
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config: got {type(config).__name__}, expected a KernelConfig")
    check_qkv_shapes(q, k, v, _FLOAT_DTYPES)
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if d != config.head_dim:
        raise ValueError(f"head_dim: got {d}, expected config.head_dim = {config.head_dim}")
    dtype = _upcast_dtype(q.dtype)
    group = hq // hkv
    br, bc = config.block_m, config.block_n
    # The kernel multiplies once by scale * log2(e) and then uses exp2 throughout.
    scale_log2 = _scale(scale, d) * LOG2E
    # Grouping query heads under their kv head lets matmul broadcast instead of copying K and V.
    qg = q.to(dtype).reshape(b, hkv, group, lq, d)
    kg = k.to(dtype).unsqueeze(2)
    vg = v.to(dtype).unsqueeze(2)
    out = torch.empty(b, hkv, group, lq, d, dtype=dtype, device=q.device)
    lse = torch.empty(b, hkv, group, lq, dtype=dtype, device=q.device)
    neg_inf = torch.tensor(float("-inf"), dtype=dtype, device=q.device)

    for m_block in range((lq + br - 1) // br):
        r0, r1 = m_block * br, min((m_block + 1) * br, lq)
        q_blk = qg[..., r0:r1, :]
        rows = torch.arange(r0, r1, device=q.device).unsqueeze(1)
        m = torch.full((b, hkv, group, r1 - r0, 1), float("-inf"), dtype=dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(b, hkv, group, r1 - r0, d, dtype=dtype, device=q.device)
        n_keys = min(lk, (m_block + 1) * br) if config.causal else lk
        for n_block in range((n_keys + bc - 1) // bc):
            # Slicing to Lk drops the padded keys >= Lk the kernel masks to -inf; both add nothing.
            c0, c1 = n_block * bc, min((n_block + 1) * bc, lk)
            s2 = torch.matmul(q_blk, kg[..., c0:c1, :].transpose(-2, -1)) * scale_log2
            if config.causal:
                cols = torch.arange(c0, c1, device=q.device).unsqueeze(0)
                s2 = torch.where(cols > rows, neg_inf, s2)
            m_new = torch.maximum(m, s2.amax(dim=-1, keepdim=True))
            # A row with no visible key yet has m_new = -inf; 0 avoids (-inf) - (-inf) = NaN.
            m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            p = torch.exp2(s2 - m_safe)
            alpha = torch.exp2(m - m_safe)
            l = l * alpha + p.sum(dim=-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p, vg[..., c0:c1, :])
            m = m_new
        empty = l == 0
        out[..., r0:r1, :] = torch.where(empty, torch.zeros_like(acc), acc / torch.where(empty, 1.0, l))
        row_lse = torch.where(empty, float("inf"), (m + torch.log2(torch.where(empty, 1.0, l))) * LN2)
        lse[..., r0:r1] = row_lse.squeeze(-1)

    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out.reshape(b, hq, lq, d), lse.reshape(b, hq, lq).to(lse_dtype)


def within_tolerance(
    out: torch.Tensor,
    ref: torch.Tensor,
    out_torch: torch.Tensor,
    *,
    factor: float = 2.0,
    atol: float = 1e-5,
) -> tuple[bool, float, float]:
    """FlashAttention's accuracy rule: max|out - ref| <= factor * max|out_torch - ref| + atol.

    ``ref`` is the upcast reference, ``out_torch`` PyTorch in the kernel's dtype. Returns
    (ok, err, bound), computed in fp64. NaN in ``out`` is never ok. Equal infinities (lse of
    empty rows) count as zero error.
    """
    for name, t in (("out", out), ("ref", ref), ("out_torch", out_torch)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    if out.shape != ref.shape or out_torch.shape != ref.shape:
        raise ValueError(
            f"shapes: got out {tuple(out.shape)}, ref {tuple(ref.shape)}, out_torch {tuple(out_torch.shape)}, "
            f"expected all equal"
        )
    o, r, t = (x.detach().to(device="cpu", dtype=torch.float64) for x in (out, ref, out_torch))

    def max_err(x: torch.Tensor) -> float:
        # x == r first, so matching infinities give 0 rather than inf - inf = NaN.
        diff = torch.where(x == r, torch.zeros_like(x), (x - r).abs())
        return float(diff.max()) if diff.numel() else 0.0

    if torch.isnan(o).any():
        err = math.nan
    else:
        err = max_err(o)
    bound = factor * max_err(t) + atol
    ok = not math.isnan(err) and not math.isnan(bound) and err <= bound
    return ok, err, bound
