"""Tests for the attention backward references: tiled FlashAttention-2 backward vs autograd (CPU only)."""
from __future__ import annotations

import pytest
import torch

from autoflash.kernels.config import KernelConfig
from autoflash.reference.forward import attention_ref, attention_tiled, within_tolerance
from autoflash.reference.backward import (
    TiledAttention,
    attention_backward_ref,
    attention_backward_tiled,
    delta_rounding_shift,
    tiled_attention,
)


pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(b, hq, hkv, lq, lk, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64).to(dtype)
    do = torch.randn(b, hq, lq, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, do


def _cfg(bm, bn, causal=False, d=32):
    return KernelConfig(head_dim=d, dtype="bf16", block_m=bm, block_n=bn, num_warps=1, causal=causal)


# (lq, lk, hq, hkv, block_m, block_n): odd lengths, Lq != Lk both ways, GQA and MQA, blocks
# that do not divide the lengths.
CASES = [
    (113, 203, 2, 2, 64, 32),
    (1, 1, 1, 1, 16, 16),
    (7, 300, 2, 1, 16, 128),
    (300, 7, 2, 1, 128, 16),
    (203, 113, 6, 2, 32, 48),
    (97, 61, 6, 1, 48, 80),
    (50, 130, 3, 3, 112, 16),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk,hq,hkv,bm,bn", CASES)
def test_tiled_backward_matches_autograd(lq, lk, hq, hkv, bm, bn, causal):
    q, k, v, do = _inputs(2, hq, hkv, lq, lk, 32, seed=lq * 7 + lk)
    cfg = _cfg(bm, bn, causal)
    out, lse = attention_tiled(q, k, v, cfg)
    dq, dk, dv = attention_backward_tiled(q, k, v, out, lse, do, cfg)
    rq, rk, rv = attention_backward_ref(q, k, v, do, causal=causal)
    for got, ref, like in ((dq, rq, q), (dk, rk, k), (dv, rv, v)):
        assert got.dtype == torch.float64 and got.shape == like.shape
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-9)


def test_tiled_backward_custom_scale_and_ref_lse():
    q, k, v, do = _inputs(1, 4, 2, 45, 70, 64, seed=3)
    cfg = _cfg(32, 16, True, d=64)
    out, lse = attention_ref(q, k, v, causal=True, scale=0.3)
    got = attention_backward_tiled(q, k, v, out, lse, do, cfg, scale=0.3)
    ref = attention_backward_ref(q, k, v, do, causal=True, scale=0.3)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-9)


def test_causal_keys_past_last_query_get_zero_grad():
    # Lk > Lq causal: keys >= Lq are never seen, so their dk, dv are exactly zero.
    q, k, v, do = _inputs(1, 2, 1, 20, 90, 32, seed=5)
    cfg = _cfg(16, 32, True)
    out, lse = attention_tiled(q, k, v, cfg)
    _, dk, dv = attention_backward_tiled(q, k, v, out, lse, do, cfg)
    assert torch.all(dk[..., 20:, :] == 0) and torch.all(dv[..., 20:, :] == 0)
    assert dk[..., :20, :].abs().sum() > 0


# fast_mode compares random projections of the Jacobian (the full one costs minutes at D = 32);
# fp64 finite differences are good to ~1e-9, so the tolerances can be far tighter than the defaults.
_FAST = dict(atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize(
    "causal,hq,hkv,lq,lk",
    [(False, 2, 1, 5, 7), (True, 2, 1, 5, 7), (True, 4, 2, 9, 6), (False, 3, 3, 6, 3)],
)
def test_gradcheck_tiled_attention(causal, hq, hkv, lq, lk):
    q, k, v, _ = _inputs(1, hq, hkv, lq, lk, 32, seed=lq + lk + hq)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    # block_m = block_n = 16 > the lengths; tiles are still exercised by the matching tests above.
    cfg = _cfg(16, 16, causal)
    assert torch.autograd.gradcheck(lambda a, b_, c: tiled_attention(a, b_, c, cfg), (q, k, v), fast_mode=True, **_FAST)


@pytest.mark.parametrize("causal,lq,lk", [(True, 4, 5), (False, 5, 3)])
def test_gradcheck_tiled_attention_full_jacobian(causal, lq, lk):
    # Tiny GQA cases with the full (slow-mode) Jacobian comparison, which sees every entry.
    q, k, v, _ = _inputs(1, 2, 1, lq, lk, 32, seed=1)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    cfg = _cfg(16, 16, causal)
    assert torch.autograd.gradcheck(lambda a, b_, c: tiled_attention(a, b_, c, cfg), (q, k, v))


def test_gradcheck_tiled_attention_multi_block():
    # Lengths over one block each, so the loops run several key and query blocks.
    q, k, v, _ = _inputs(1, 2, 1, 35, 20, 32, seed=11)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    cfg = _cfg(16, 16, True)
    fn = lambda a, b_, c: TiledAttention.apply(a, b_, c, cfg, 0.2)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True, **_FAST)


def test_bf16_same_dtype_gradients_differ_but_stay_close():
    q, k, v, do = _inputs(1, 4, 2, 77, 130, 64, dtype=torch.bfloat16, seed=2)
    ref = attention_backward_ref(q, k, v, do, causal=True)
    low = attention_backward_ref(q, k, v, do, causal=True, upcast=False)
    cfg = _cfg(64, 32, True, d=64)
    out, lse = attention_tiled(q, k, v, cfg)
    tiled = attention_backward_tiled(q, k, v, out, lse, do, cfg)
    for r, lo, t, like in zip(ref, low, tiled, (q, k, v)):
        assert r.dtype == torch.float32 and lo.dtype == torch.bfloat16 and t.dtype == torch.float32
        assert r.shape == lo.shape == t.shape == like.shape
        diff = (lo.float() - r).abs().max().item()
        assert 0 < diff < 0.05 * r.abs().max().item() + 1e-3
        # The fp32 tiled backward meets FlashAttention-3's gradient rule against bf16 PyTorch.
        ok, err, bound = within_tolerance(t, r, lo, backward=True)
        assert ok, (err, bound)


def test_out_and_dout_in_input_dtype_accepted():
    q, k, v, do = _inputs(1, 2, 2, 30, 40, 32, dtype=torch.float16, seed=4)
    cfg = _cfg(16, 16)
    out, lse = attention_tiled(q, k, v, cfg)
    got = attention_backward_tiled(q, k, v, out.half(), lse, do, cfg)
    ref = attention_backward_ref(q, k, v, do)
    for g, r in zip(got, ref):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=0, atol=2e-2)


def test_fully_masked_rows_give_zero_dq_and_no_nan():
    q, k, v, do = _inputs(2, 4, 2, 40, 50, 32, seed=9)
    cfg = _cfg(16, 32)
    out, lse = attention_tiled(q, k, v, cfg)
    # By construction: rows 3 and 17 of head 1 and all of head 2 in batch 0 see no key.
    lse, out = lse.clone(), out.clone()
    lse[0, 1, [3, 17]] = float("inf")
    out[0, 1, [3, 17]] = 0.0
    lse[0, 2] = float("inf")
    out[0, 2] = 0.0
    dq, dk, dv = attention_backward_tiled(q, k, v, out, lse, do, cfg)
    for t in (dq, dk, dv):
        assert torch.isfinite(t).all()
    assert torch.all(dq[0, 1, [3, 17]] == 0) and torch.all(dq[0, 2] == 0)
    assert dq[0, 1, 4].abs().sum() > 0
    # Untouched batch 1 still matches autograd exactly.
    rq, rk, rv = attention_backward_ref(q, k, v, do)
    torch.testing.assert_close(dq[1], rq[1], rtol=0, atol=1e-9)
    torch.testing.assert_close(dk[1], rk[1], rtol=0, atol=1e-9)
    # Head 3 shares kv head 1 with head 2, which is fully masked: dv of kv head 1 comes from head 3 only.
    p3 = torch.softmax(q[0, 3] @ k[0, 1].T / 32 ** 0.5, dim=-1)
    torch.testing.assert_close(dv[0, 1], p3.T @ do[0, 3], rtol=0, atol=1e-9)


def _base():
    q, k, v, do = _inputs(1, 2, 1, 10, 12, 32)
    cfg = _cfg(16, 16)
    out, lse = attention_tiled(q, k, v, cfg)
    return q, k, v, out, lse, do, cfg


@pytest.mark.parametrize(
    "which,bad,exc,match",
    [
        ("out", lambda t: t[..., :5, :], ValueError, r"out: got shape \(1, 2, 5, 32\), expected q's shape"),
        ("dout", lambda t: t.float(), TypeError, r"dout: got dtype torch.float32, expected torch.float64"),
        ("dout", lambda t: t.numpy(), TypeError, r"dout: got ndarray, expected a torch.Tensor"),
        ("lse", lambda t: t[..., None], ValueError, r"lse: got shape \(1, 2, 10, 1\), expected \(B, Hq, Lq\)"),
        ("lse", lambda t: t.long(), TypeError, r"lse: got dtype torch.int64"),
        ("k", lambda t: t[..., :16], ValueError, r"q \(1, 2, 10, 32\) and k \(1, 1, 12, 16\): expected the same batch "
         "and head_dim"),  # v's head dim alone may differ
        ("q", lambda t: t.repeat(1, 1, 1, 2), ValueError, r"q .* and k .*: expected the same batch and head_dim"),
        ("config", lambda c: "fwd_hd32", TypeError, r"config: got str, expected a KernelConfig"),
    ],
)
def test_backward_tiled_bad_inputs(which, bad, exc, match):
    q, k, v, out, lse, do, cfg = _base()
    args = dict(q=q, k=k, v=v, out=out, lse=lse, dout=do, config=cfg)
    args[which] = bad(args[which])
    with pytest.raises(exc, match=match):
        attention_backward_tiled(**args)


def test_backward_tiled_head_dim_mismatch_with_config():
    q, k, v, out, lse, do, _ = _base()
    with pytest.raises(ValueError, match=r"head_dim: got 32, expected config.head_dim = 64"):
        attention_backward_tiled(q, k, v, out, lse, do, _cfg(16, 16, d=64))


def test_backward_ref_bad_inputs():
    q, k, v, do = _inputs(1, 2, 1, 10, 12, 32)
    with pytest.raises(ValueError, match=r"dout: got shape \(1, 2, 9, 32\), expected out's shape"):
        attention_backward_ref(q, k, v, do[..., :9, :])
    with pytest.raises(TypeError, match=r"dout: got list, expected a torch.Tensor"):
        attention_backward_ref(q, k, v, [1.0])
    with pytest.raises(ValueError, match=r"heads: got 2 query heads and 3 kv heads"):
        attention_backward_ref(q, k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1), do)


@pytest.mark.parametrize("causal, softcap", [(True, 0.0), (False, 0.0), (True, 3.0)])
def test_delta_rounding_shift_is_the_tiled_backwards_change(causal, softcap):
    """The tiled backward takes delta = rowsum(dO * out) from the out it is given, as the kernels and
    FlashAttention do: giving it a perturbed out (a rounding) moves its gradients by exactly
    delta_rounding_shift, in fp64; with the exact out the shift is 0."""
    q, k, v, do = _inputs(2, 4, 2, 9, 13, 32, seed=6)
    kw = dict(causal=causal, softcap=softcap)
    out, lse = attention_ref(q, k, v, **kw)
    rounded = out.to(torch.bfloat16).double()  # the output as FlashAttention's backward receives it
    cfg = _cfg(16, 16, causal)
    if softcap:
        cfg = KernelConfig(head_dim=32, dtype="bf16", block_m=16, block_n=16, num_warps=1, causal=causal,
                           softcap=True)
    exact = attention_backward_tiled(q, k, v, out, lse, do, cfg, softcap=softcap)
    moved = attention_backward_tiled(q, k, v, rounded, lse, do, cfg, softcap=softcap)
    shift = delta_rounding_shift(q, k, v, rounded, do, **kw)
    for m, e, sh, like in zip(moved, exact, shift, (q, k, v)):
        assert sh.shape == like.shape and sh.dtype == torch.float64
        torch.testing.assert_close(m - e, sh, rtol=0, atol=1e-12)
    assert shift[0].abs().max() > 1e-4 and shift[1].abs().max() > 1e-4 and not shift[2].any()
    assert all(not t.any() for t in delta_rounding_shift(q, k, v, out, do, **kw))
