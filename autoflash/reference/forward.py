"""Plain and tiled (online-softmax) PyTorch attention references, and FlashAttention-3's accuracy
rule (within_tolerance), used by the tests, selfcheck, the tuner and the benchmark to judge
generated kernels."""
from __future__ import annotations

import math

import torch

from autoflash.kernels.checks import check_qkv_shapes, int32_vector
from autoflash.kernels.config import KernelConfig
from autoflash.reference.variants import (
    NO_WINDOW,
    check_alibi_slopes,
    check_align,
    check_chunk,
    check_softcap,
    check_window,
    config_score_mod,
    score_mod,
)

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


def _check_mask(mask, q: torch.Tensor, lk: int) -> torch.Tensor | None:
    """attention_ref's ``mask`` expanded to (B, Hq, Lq, Lk), or None."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"mask: got {got}, expected a torch.bool tensor")
    if mask.device != q.device:
        raise ValueError(f"mask: got device {mask.device}, expected {q.device}")
    b, hq, lq, _ = q.shape
    try:
        return mask.expand(b, hq, lq, lk)
    except RuntimeError:
        raise ValueError(f"mask: got shape {tuple(mask.shape)}, expected broadcastable to {(b, hq, lq, lk)}") from None


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
    window=NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
    attention_chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention softmax(scale * q kᵀ) v in plain PyTorch; returns (out, lse).

    q: (B, Hq, Lq, D); k, v: (B, Hkv, Lk, D) with Hq % Hkv == 0 (query head h reads kv head
    h // (Hq // Hkv)). ``causal`` is top-left aligned like SDPA's ``is_causal`` by default: query i
    sees keys j <= i, also when Lq != Lk. ``mask`` is a boolean tensor broadcastable to
    (B, Hq, Lq, Lk), True = keep. Default scale is 1/sqrt(D).

    The variants (flash-attn's; the kernels' KernelConfig switches, see reference.variants):
    ``align`` puts query i's diagonal at key i ("top_left") or i + Lk - Lq ("bottom_right") for
    ``causal``, ``window`` (left, right; -1 unbounded; causal makes right 0) and ALiBi's distance;
    ``attention_chunk`` > 0 keeps only the keys of the chunk holding key i + diag (FlashAttention-3's);
    ``softcap`` > 0 caps the scaled scores as softcap * tanh(s / softcap); ``alibi_slopes`` fp32
    (Hq,) or (B, Hq) subtracts slope * |i + diag - j|; ``key_bias`` fp32 (B, Lk) is added to every
    row (-inf masks the key: an SDPA key-padding mask).

    upcast=True computes in fp32 (fp64 for fp64 inputs): the accuracy reference. upcast=False
    computes scores, softmax and output in the input dtype: "PyTorch in the same dtype".

    Returns out (B, Hq, Lq, D) in the compute dtype and lse (B, Hq, Lq) fp32 (fp64 for fp64 inputs),
    the natural-log logsumexp of the final logits. Differentiable in q, k, v.

    A row that sees no key (all masked) gets out = 0 and lse = +inf, so a backward pass that
    recomputes P = exp(S - lse) gets exactly 0 there instead of NaN.
    """
    check_qkv_shapes(q, k, v, _FLOAT_DTYPES)
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    mod = score_mod(q, k, _scale(scale, d), causal=causal, align=align, window=window, softcap=softcap,
                    alibi_slopes=alibi_slopes, key_bias=key_bias, attention_chunk=attention_chunk)
    user_keep = _check_mask(mask, q, lk)
    dtype = _upcast_dtype(q.dtype) if upcast else q.dtype
    group = hq // hkv
    qc, kc, vc = q.to(dtype), k.to(dtype), v.to(dtype)
    if group > 1:
        kc, vc = kc.repeat_interleave(group, dim=1), vc.repeat_interleave(group, dim=1)

    rows, cols = torch.arange(lq, device=q.device), torch.arange(lk, device=q.device)
    # Scale applied to q kᵀ (not to q) as FlashAttention's reference does.
    s = mod.logits(torch.matmul(qc, kc.transpose(-2, -1)), rows, cols)
    keep = mod.keep(rows, cols, s)
    if user_keep is not None:
        s = s.masked_fill(~user_keep, float("-inf"))
        keep = keep & user_keep
    # softmax of an all -inf row is NaN: such rows get finite stand-in logits here (no NaN in
    # autograd either), then the documented convention P = 0, lse = +inf.
    empty = ~keep.any(dim=-1).expand(b, hq, lq)
    s = s.masked_fill(empty.unsqueeze(-1), 0.0)
    p = torch.softmax(s, dim=-1).masked_fill(empty.unsqueeze(-1), 0.0)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.logsumexp(s.to(lse_dtype), dim=-1).masked_fill(empty, float("inf"))
    out = torch.matmul(p, vc)
    return out, lse


def _check_cu_seqlens(name: str, cu, total: int) -> list[int]:
    """int32 (B + 1,) cumulative lengths from 0 to ``total``, non-decreasing; returned as a list."""
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32:
        got = cu.dtype if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise TypeError(f"{name}: got {got}, expected a torch.int32 tensor")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name}: got shape {tuple(cu.shape)}, expected (batch + 1,) cumulative lengths, batch >= 1")
    c = cu.tolist()
    if c[0] != 0 or c[-1] != total or any(x > y for x, y in zip(c, c[1:])):
        raise ValueError(f"{name}: got {c}, expected non-decreasing from 0 to the packed length {total}")
    return c


def _check_packed(q, k, v) -> None:
    """q (total_q, Hq, D); k (total_k, Hkv, D), v the same but for its head dim; Hkv dividing Hq; one
    float dtype, one device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
        if t.dim() != 3:
            raise ValueError(f"{name}: got shape {tuple(t.shape)}, expected 3 dims (total, heads, head_dim)")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtypes: got {q.dtype}, {k.dtype}, {v.dtype}; "
                        f"expected one of {[str(d) for d in _FLOAT_DTYPES]}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: got {q.device}, {k.device}, {v.device}; expected one device")
    if k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2] or min(q.shape[1:] + v.shape[1:]) == 0 \
            or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected k and v alike but "
                         f"for v's head dim, q's head dim k's, and kv heads dividing query heads")


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
    window=NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    attention_chunk: int = 0,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_ref over packed sequences (flash-attn's varlen layout).

    q: (total_q, Hq, D); k, v: (total_k, Hkv, D); sequence b is q rows cu_seqlens_q[b] ..
    cu_seqlens_q[b + 1] against k, v rows cu_seqlens_k[b] .. cu_seqlens_k[b + 1] (int32, B + 1
    entries from 0), with its own lengths, so its own bottom-right diagonal; ``alibi_slopes`` (Hq,)
    or (B, Hq), row b for sequence b. Returns out (total_q, Hq, D) and lse (Hq, total_q), the layout
    flash-attn 2 returns; a sequence with queries and no keys gets out 0 and lse +inf. Differentiable
    in q, k, v (through the sequences that have keys). seqused_q / seqused_k (int32 (B,),
    FlashAttention-3's): sequence b uses only the first seqused[b] rows of its span; the query rows
    past them get out 0 and lse +inf.
    """
    _check_packed(q, k, v)
    cq = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    ck = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens: got {len(cq)} and {len(ck)} entries, expected equal (batch + 1 each)")
    check_align(align)
    check_window(window)
    check_softcap(softcap)
    check_chunk(attention_chunk)
    hq, d = q.shape[1], v.shape[2]  # out is as wide as v
    slopes = None if alibi_slopes is None else check_alibi_slopes(alibi_slopes, len(cq) - 1, hq, q.device)
    dtype = _upcast_dtype(q.dtype) if upcast else q.dtype
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    used_q = _check_used("seqused_q", seqused_q, cq, q.device)
    used_k = _check_used("seqused_k", seqused_k, ck, q.device)
    outs = [torch.zeros(0, hq, d, dtype=dtype, device=q.device)]
    lses = [torch.zeros(hq, 0, dtype=lse_dtype, device=q.device)]
    for b in range(len(cq) - 1):
        span, nq, nk = cq[b + 1] - cq[b], used_q[b], used_k[b]
        unused = (torch.zeros(span - nq, hq, d, dtype=dtype, device=q.device),
                  torch.full((hq, span - nq), float("inf"), dtype=lse_dtype, device=q.device))
        if nq == 0 or nk == 0:
            outs.append(torch.zeros(nq, hq, d, dtype=dtype, device=q.device))
            lses.append(torch.full((hq, nq), float("inf"), dtype=lse_dtype, device=q.device))
            outs.append(unused[0])
            lses.append(unused[1])
            continue
        qs = q[cq[b]:cq[b] + nq].transpose(0, 1).unsqueeze(0)
        ks, vs = (t[ck[b]:ck[b] + nk].transpose(0, 1).unsqueeze(0) for t in (k, v))
        o, lse = attention_ref(qs, ks, vs, causal=causal, scale=scale, upcast=upcast, align=align, window=window,
                               softcap=softcap, alibi_slopes=None if slopes is None else slopes[b],
                               attention_chunk=attention_chunk)
        outs += [o[0].transpose(0, 1), unused[0]]
        lses += [lse[0], unused[1]]
    return torch.cat(outs), torch.cat(lses, dim=1)


def _check_used(name: str, used, cu: list[int], device: torch.device) -> list[int]:
    """The rows in use of each sequence: seqused's values (each within its span), or the spans."""
    spans = [b - a for a, b in zip(cu, cu[1:])]
    if used is None:
        return spans
    int32_vector(name, used, len(spans), device)
    values = used.tolist()
    if any(not 0 <= u <= s for u, s in zip(values, spans)):
        raise ValueError(f"{name}: got {values[:16]}, expected 0 <= {name}[b] <= the span of sequence b {spans[:16]}")
    return values


def attention_tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: KernelConfig,
    *,
    scale: float | None = None,
    window=NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled online-softmax attention that follows the kernel's loops for ``config``; (out, lse).

    Computes in fp32 (fp64 for fp64 inputs) with logits in the log2 domain. causal and align come
    from ``config``; ``window``, ``softcap``, ``alibi_slopes`` and ``key_bias`` are the run-time
    values of its window, softcap, alibi and key_bias switches, given exactly when the switch is on
    (ValueError otherwise; config.varlen is not tiled here). Each query block visits only the key
    blocks its band reaches (Band.key_blocks: both edges of a window, the causal diagonal), as the
    kernel does. Same shapes, semantics, GQA rule and empty-row convention as attention_ref.
    """
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config: got {type(config).__name__}, expected a KernelConfig")
    check_qkv_shapes(q, k, v, _FLOAT_DTYPES)
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if d != config.head_dim:
        raise ValueError(f"head_dim: got {d}, expected config.head_dim = {config.head_dim}")
    mod = config_score_mod(config, q, k, _scale(scale, d), window=window, softcap=softcap,
                           alibi_slopes=alibi_slopes, key_bias=key_bias)
    dtype = _upcast_dtype(q.dtype)
    group = hq // hkv
    br, bc = config.block_m, config.block_n
    # Grouping query heads under their kv head lets matmul broadcast instead of copying K and V.
    qg = q.to(dtype).reshape(b, hkv, group, lq, d)
    kg = k.to(dtype).unsqueeze(2)
    vg = v.to(dtype).unsqueeze(2)
    out = torch.empty(b, hkv, group, lq, d, dtype=dtype, device=q.device)
    lse = torch.empty(b, hkv, group, lq, dtype=dtype, device=q.device)

    for m_block in range((lq + br - 1) // br):
        r0, r1 = m_block * br, min((m_block + 1) * br, lq)
        q_blk = qg[..., r0:r1, :]
        rows = torch.arange(r0, r1, device=q.device)
        m = torch.full((b, hkv, group, r1 - r0, 1), float("-inf"), dtype=dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(b, hkv, group, r1 - r0, d, dtype=dtype, device=q.device)
        for n_block in mod.band.key_blocks(r0, br, bc):
            # Slicing to Lk drops the padded keys >= Lk the kernel masks to -inf; both add nothing.
            c0, c1 = n_block * bc, min((n_block + 1) * bc, lk)
            cols = torch.arange(c0, c1, device=q.device)
            # The kernel works in base 2: logits times log2(e), then exp2 throughout.
            s2 = mod.logits(torch.matmul(q_blk, kg[..., c0:c1, :].transpose(-2, -1)), rows, cols) * LOG2E
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


# FlashAttention-3's accuracy rule, as its tests apply it (Dao-AILab/flash-attention,
# hopper/test_flash_attn.py, test_flash_attn_output and test_flash_attn_varlen_output, read at commit
# 0251105a2fb19d2957484b7f023cd8c115286ced, where the file last changed in 14c37795;
# tests/cute/test_flash_attn.py applies the same):
#     fwd_atol = 2 * (out_ref + 0.3 - 0.3 - out_ref).abs().max().item()
#     rtol = 2 if softcap == 0.0 else 3
#     assert (out - out_ref).abs().max() <= rtol * (out_pt - out_ref).abs().max() + fwd_atol
#     dq_atol = 2 * (dq_ref + 0.3 - 0.3 - dq_ref).abs().max().item() + (0 if softcap == 0 else 3e-4)
#     assert (dq - dq_ref).abs().max() <= rtol * (dq_pt - dq_ref).abs().max() + dq_atol   (dk, dv alike)
# There out_ref and dq_ref are in the input dtype (fp16/bf16): q_ref, k_ref, v_ref are made in it
# (dtype_ref = dtype), hopper/test_util.py's attention_ref computes in fp32 and returns
# output.to(dtype_og), and autograd gives dq_ref in q_ref's dtype.
# FlashAttention-2's rule (tests/test_flash_attn.py) was the bare ratio: out within 2x, dq/dk/dv 3x
# (2x + 1e-5 in its causal and kvcache tests).
FA3_RTOL = 2.0
FA3_SOFTCAP_RTOL = 3.0
FA3_SOFTCAP_GRAD_ATOL = 3e-4
# FA3 tests no fp32 inputs (fp8 ones measure the rounding in bf16, their dtype_ref). In fp32 the
# rounding term is ~1e-7, below the scatter of a max over a few elements between two correct fp32
# implementations, so fp32 (and fp64) inputs keep this project's earlier floor, the 1e-5 that
# FA2's causal and kvcache tests add.
FP32_ATOL = 1e-5


def rounding_error(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """FlashAttention-3's rounding term ``(ref + 0.3 - 0.3 - ref).abs().max()`` with ``ref`` cast to
    ``dtype``: the rounding of ``dtype`` at the reference's magnitude (plus 0.3).

    Each step is evaluated as PyTorch does it on CUDA, where FA3's tests run: in fp32 for fp16/bf16
    tensors (the scalar 0.3 read as fp32, the opmath type) and rounded to ``dtype`` after each op.
    (PyTorch on the CPU casts the scalar to ``dtype`` first, so a zero reference would give 0 there;
    on CUDA it gives the rounding of 0.3 itself: 7.8e-4 in bf16, 4.9e-5 in fp16.) Non-finite
    reference elements (an empty row's LSE, +inf) are left out; an empty reference gives 0.
    """
    r = ref.detach().to("cpu")
    r = r[torch.isfinite(r)].to(dtype)
    if not r.numel():
        return 0.0
    opmath = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype).to(opmath)

    x = r.to(opmath)
    a = rounded(x + 0.3)
    b = rounded(a - 0.3)
    return float(rounded(b - x).abs().max())


def within_tolerance(
    out: torch.Tensor,
    ref: torch.Tensor,
    out_torch: torch.Tensor,
    *,
    factor: float | None = None,
    atol: float | None = None,
    dtype: torch.dtype | None = None,
    softcap: float = 0.0,
    backward: bool = False,
) -> tuple[bool, float, float]:
    """FlashAttention-3's accuracy rule (hopper/test_flash_attn.py; see FA3_RTOL above):

        max|out - ref| <= rtol * max|out_torch - ref| + 2 * rounding_error(ref, dtype)
                          + (3e-4 if backward and softcap else 0) + atol

    with rtol = ``factor`` if given, else 2 (3 with a softcap). ``ref`` is the upcast reference,
    ``out_torch`` PyTorch in the kernel's input dtype; ``dtype`` is that input dtype (default
    ``out_torch.dtype``), in which the reference's rounding is measured, as FA3 measures it on its
    reference cast back to the input dtype. ``backward=True`` for gradients (dq, dk, dv): FA3's
    backward rule, the forward's plus 3e-4 with a softcap. ``atol`` is an absolute floor: by default
    0 for fp16/bf16 (FA3's rule has none) and FP32_ATOL = 1e-5 for fp32/fp64 inputs, which FA3 does
    not test; given, it replaces that default (e.g. a fixed bound for fp32 LSEs). The errors
    themselves are measured against the upcast ``ref`` (FA3 measures them against its reference in
    the input dtype).

    Returns (ok, err, bound), computed in fp64. NaN in ``out`` is never ok. Equal infinities (lse
    of empty rows) count as zero error.
    """
    for name, t in (("out", out), ("ref", ref), ("out_torch", out_torch)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    if out.shape != ref.shape or out_torch.shape != ref.shape:
        raise ValueError(
            f"shapes: got out {tuple(out.shape)}, ref {tuple(ref.shape)}, out_torch {tuple(out_torch.shape)}, "
            f"expected all equal"
        )
    if dtype is None:
        dtype = out_torch.dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: got {dtype!r}, expected a floating-point torch.dtype")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap < 0:
        raise ValueError(f"softcap: got {softcap!r}, expected a float >= 0")
    rtol = factor if factor is not None else (FA3_RTOL if softcap == 0 else FA3_SOFTCAP_RTOL)
    if atol is None:
        atol = FP32_ATOL if dtype in (torch.float32, torch.float64) else 0.0
    o, r, t = (x.detach().to(device="cpu", dtype=torch.float64) for x in (out, ref, out_torch))

    def max_err(x: torch.Tensor) -> float:
        # x == r first, so matching infinities give 0 rather than inf - inf = NaN.
        diff = torch.where(x == r, torch.zeros_like(x), (x - r).abs())
        return float(diff.max()) if diff.numel() else 0.0

    if torch.isnan(o).any():
        err = math.nan
    else:
        err = max_err(o)
    grad_atol = FA3_SOFTCAP_GRAD_ATOL if backward and softcap != 0 else 0.0
    bound = rtol * max_err(t) + 2 * rounding_error(ref, dtype) + grad_atol + atol
    ok = not math.isnan(err) and not math.isnan(bound) and err <= bound
    return ok, err, bound
