"""Tests for the references' flash-attn variants (bottom-right alignment, sliding windows and
FlashAttention-3's attention chunks, softcap, ALiBi, key bias, packed sequences), CPU only: the plain reference against a per-element loop
written from the definitions, the tiled forward and backward against it, and the argument checks."""
from __future__ import annotations

import math

import pytest
import torch

from autoflash.kernels.config import KernelConfig
from autoflash.reference.backward import (
    TiledAttention,
    attention_backward_ref,
    attention_backward_tiled,
    tiled_attention,
)
from autoflash.reference.forward import attention_ref, attention_tiled, attention_varlen_ref
from autoflash.reference.variants import Band, band_mask


pytestmark = pytest.mark.usefixtures("one_thread")


# name: attention_ref's variant keywords; "alibi" ("heads" or "batch") and "bias" ask for tensors
VARIANTS = {
    "plain": {},
    "causal-tl": dict(causal=True),
    "causal-br": dict(causal=True, align="bottom_right"),
    "window-left-inf-tl": dict(window=(-1, 0)),
    "window-left-inf-br": dict(window=(-1, 0), align="bottom_right"),
    "window-2-inf-br": dict(window=(2, -1), align="bottom_right"),
    "window-0-3-tl": dict(window=(0, 3)),
    "window-3-3-br": dict(window=(3, 3), align="bottom_right"),
    "window-20-9-tl": dict(window=(20, 9)),
    "window-causal-br": dict(window=(3, 3), causal=True, align="bottom_right"),  # causal makes right 0
    "softcap": dict(softcap=0.8),
    "alibi-heads": dict(alibi="heads"),
    "alibi-batch-br": dict(alibi="batch", align="bottom_right"),
    "key-bias": dict(bias=True),
    "gemma": dict(softcap=1.5, window=(4, 0), alibi="batch", align="bottom_right"),
    "all": dict(causal=True, window=(3, 2), softcap=2.0, alibi="heads", bias=True, align="bottom_right"),
}
# FlashAttention-3's attention_chunk, alone and under the other limits (the plain reference only: the
# tiled ones follow kernels without the chunk switch)
CHUNKS = {
    "chunk-3-causal-br": dict(attention_chunk=3, causal=True, align="bottom_right"),
    "chunk-4-tl": dict(attention_chunk=4),
    "chunk-2-window-br": dict(attention_chunk=2, window=(1, 3), align="bottom_right"),
    "chunk-5-alibi-bias-br": dict(attention_chunk=5, alibi="batch", bias=True, align="bottom_right"),
    "chunk-1-br": dict(attention_chunk=1, align="bottom_right"),  # the diagonal key only
}


def _qkv(b, hq, hkv, lq, lk, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(b, hq, lq, d, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    return q, k, v, do


def _ref_kwargs(spec: dict, b: int, hq: int, lk: int, seed: int = 0) -> dict:
    """attention_ref's keywords for a VARIANTS entry. The key bias is random, -inf on about a third
    of batch 0's keys and on all of batch 1's (rows that see no key)."""
    g = torch.Generator().manual_seed(seed)
    kw = {n: spec[n] for n in ("causal", "align", "window", "softcap", "attention_chunk") if n in spec}
    if "alibi" in spec:
        kw["alibi_slopes"] = torch.rand((hq,) if spec["alibi"] == "heads" else (b, hq), generator=g) * 0.5 + 0.1
    if spec.get("bias"):
        bias = torch.randn(b, lk, generator=g)
        bias[torch.rand(b, lk, generator=g) < 0.3] = -math.inf
        bias[1:] = -math.inf
        kw["key_bias"] = bias
    return kw


def _tiled_kwargs(kw: dict) -> tuple[dict, dict]:
    """(KernelConfig switches, attention_tiled keywords) for attention_ref keywords ``kw``: a causal
    window is a window with right = 0, as the configs take it."""
    window = kw.get("window", (-1, -1))
    causal = kw.get("causal", False)
    if causal and window != (-1, -1):
        window, causal = (window[0], 0), False
    switches = dict(causal=causal, align=kw.get("align", "top_left"), window=window != (-1, -1),
                    softcap=kw.get("softcap", 0) > 0, alibi="alibi_slopes" in kw, key_bias="key_bias" in kw)
    runtime = dict(window=window, softcap=kw.get("softcap", 0.0), alibi_slopes=kw.get("alibi_slopes"),
                   key_bias=kw.get("key_bias"))
    return switches, runtime


def _cfg(bm, bn, d=32, **switches):
    return KernelConfig(head_dim=d, dtype="bf16", block_m=bm, block_n=bn, num_warps=1, **switches)


def _brute(q, k, v, *, causal=False, scale=None, align="top_left", window=(-1, -1), softcap=0.0,
           alibi_slopes=None, key_bias=None, attention_chunk=0):
    """The definitions, one (batch, head, query, key) at a time, in Python floats. A chunk: key j
    and the diagonal key i + diag in the same run of attention_chunk keys (counted from key 0)."""
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    diag = lk - lq if align == "bottom_right" else 0
    left, right = window
    qs, ks, vs = q.tolist(), k.tolist(), v.tolist()
    out = torch.zeros(b, hq, lq, d, dtype=torch.float64)
    lse = torch.full((b, hq, lq), math.inf, dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            kvh = h // (hq // hkv)
            slope = None
            if alibi_slopes is not None:
                slope = float(alibi_slopes[h] if alibi_slopes.dim() == 1 else alibi_slopes[bi, h])
            for i in range(lq):
                logits = {}
                for j in range(lk):
                    if causal and j > i + diag:
                        continue
                    if left >= 0 and j < i + diag - left:
                        continue
                    if right >= 0 and j > i + diag + right:
                        continue
                    if attention_chunk and j // attention_chunk != (i + diag) // attention_chunk:
                        continue
                    x = scale * sum(a * c for a, c in zip(qs[bi][h][i], ks[bi][kvh][j]))
                    if softcap > 0:
                        x = softcap * math.tanh(x / softcap)
                    if slope is not None:
                        x -= slope * abs(i + diag - j)
                    if key_bias is not None:
                        x += float(key_bias[bi, j])
                    if x > -math.inf:
                        logits[j] = x
                if not logits:
                    continue
                top = max(logits.values())
                weights = {j: math.exp(x - top) for j, x in logits.items()}
                total = sum(weights.values())
                lse[bi, h, i] = top + math.log(total)
                for c in range(d):
                    out[bi, h, i, c] = sum(w * vs[bi][kvh][j][c] for j, w in weights.items()) / total
    return out, lse


# ---------------------------------------------------------------- the plain reference, from the definitions
SMALL = [(5, 9, 4, 2), (9, 5, 3, 1), (7, 7, 2, 2), (1, 6, 2, 1)]  # (lq, lk, hq, hkv): Lq < Lk, >, =; GQA, MQA


@pytest.mark.parametrize("lq,lk,hq,hkv", SMALL, ids=lambda x: str(x))
@pytest.mark.parametrize("variant", sorted(VARIANTS) + sorted(CHUNKS))
def test_plain_matches_brute_force(variant, lq, lk, hq, hkv):
    q, k, v, _ = _qkv(2, hq, hkv, lq, lk, 8, seed=lq * 31 + lk)
    kw = _ref_kwargs({**VARIANTS, **CHUNKS}[variant], 2, hq, lk, seed=lq + lk)
    out, lse = attention_ref(q, k, v, **kw)
    want_out, want_lse = _brute(q, k, v, **kw)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (2, -1), (0, 3), (3, 3), (0, 0)])
@pytest.mark.parametrize("lq,lk", [(4, 9), (9, 4), (6, 6)])
def test_band_mask_matches_definition(lq, lk, window, align, causal):
    got = band_mask(lq, lk, causal=causal, align=align, window=window)
    diag = lk - lq if align == "bottom_right" else 0
    left, right = window[0], 0 if causal else window[1]
    want = torch.tensor([[(left < 0 or j >= i + diag - left) and (right < 0 or j <= i + diag + right)
                          for j in range(lk)] for i in range(lq)])
    assert got.dtype == torch.bool and torch.equal(got, want)


@pytest.mark.parametrize("chunk", [1, 3, 8, 20])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (2, 5)])
@pytest.mark.parametrize("lq,lk", [(4, 9), (9, 4), (6, 6), (17, 30)])
def test_chunk_mask_is_flashattention3s(lq, lk, window, chunk):
    """band_mask with a chunk against FlashAttention-3's own masks (hopper/test_util.py,
    construct_local_mask and construct_chunk_mask, bottom-right as FA3 aligns them): a key is masked
    where either mask masks it."""
    got = band_mask(lq, lk, align="bottom_right", window=window, attention_chunk=chunk)
    row = torch.arange(lq).unsqueeze(1)
    col = torch.arange(lk)
    sk, sq = lk, lq
    masked = torch.zeros(lq, lk, dtype=torch.bool)
    if window != (-1, -1):
        if window[0] < 0:
            masked = col > row + sk - sq + window[1]
        else:
            right = sk if window[1] < 0 else window[1]
            masked = (col > torch.minimum(row + sk - sq + right, torch.tensor(sk))) | (col < row + sk - sq - window[0])
    col_limit_left_chunk = row + sk - sq - (row + sk - sq) % chunk
    masked = masked | (col < col_limit_left_chunk) | (col >= col_limit_left_chunk + chunk)
    assert torch.equal(got, ~masked)


def test_upcast_false_keeps_the_input_dtype_with_variants():
    q, k, v, _ = _qkv(2, 4, 2, 40, 60, 32, dtype=torch.bfloat16, seed=1)
    kw = _ref_kwargs(VARIANTS["all"], 2, 4, 60)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    low, low_lse = attention_ref(q, k, v, upcast=False, **kw)
    assert ref.dtype == torch.float32 and low.dtype == torch.bfloat16 and low_lse.dtype == torch.float32
    assert 0 < (low.float() - ref).abs().max() < 5e-2
    assert torch.equal(torch.isinf(low_lse), torch.isinf(ref_lse))


# ---------------------------------------------------------------- the tiled loops
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (5, -1), (0, 7), (6, 6), (20, 3)])
@pytest.mark.parametrize("lq,lk", [(45, 70), (70, 45), (33, 33)])
@pytest.mark.parametrize("chunk", [0, 5, 23])
def test_block_ranges_are_the_tiles_the_band_touches(lq, lk, window, align, causal, chunk):
    """key_blocks and query_blocks (the backward's first_row / last_row) are contiguous and visit every
    tile where a query row sees a key, attention chunks or not. Other tiles they visit lie on a ragged
    edge, the last query or key block (the kernel's limits count whole blocks: a last query block's
    padding rows, a window starting past the last key): there P is all 0. A narrow band, or chunks
    narrower than the tiles, skip tiles on both sides, in both loops."""
    band = Band.of(lq, lk, causal=causal, align=align, window=window, attention_chunk=chunk)
    for br, bc in ((16, 16), (32, 16), (16, 32)):
        n_m, n_n = -(-lq // br), -(-lk // bc)
        real = band.mask(torch.arange(lq), torch.arange(lk))
        seen = {(m, n) for m in range(n_m) for n in range(n_n)
                if real[m * br:(m + 1) * br, n * bc:(n + 1) * bc].any()}
        by_rows = {(m, n) for m in range(n_m) for n in band.key_blocks(m * br, br, bc)}
        by_cols = {(m, n) for n in range(n_n) for m in band.query_blocks(n * bc, bc, lq, br)}
        for visited in (by_rows, by_cols):
            assert seen <= visited, sorted(seen - visited)
            assert all(m == n_m - 1 or n == n_n - 1 for m, n in visited - seen), sorted(visited - seen)
        for m in range(n_m):
            blocks = list(band.key_blocks(m * br, br, bc))
            assert blocks == list(range(blocks[0], blocks[-1] + 1)) if blocks else True
        for n in range(n_n):
            blocks = list(band.query_blocks(n * bc, bc, lq, br))
            assert blocks == list(range(blocks[0], blocks[-1] + 1)) if blocks else True
        if (window == (6, 6) or chunk == 5) and br == bc == 16:
            ranges = [band.key_blocks(m * br, br, bc) for m in range(n_m)]
            assert any(r and r[0] > 0 for r in ranges) and any(r and r[-1] < n_n - 1 for r in ranges)
            assert by_cols == by_rows or chunk  # chunks: the ragged last blocks may differ


TILED = [(45, 70, 4, 2, 16, 16), (70, 45, 3, 1, 32, 16), (33, 33, 2, 2, 16, 32), (50, 61, 2, 1, 32, 32)]


@pytest.mark.parametrize("lq,lk,hq,hkv,bm,bn", TILED, ids=lambda x: str(x))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiled_matches_plain_fp64(variant, lq, lk, hq, hkv, bm, bn):
    q, k, v, _ = _qkv(2, hq, hkv, lq, lk, 32, seed=lq + 3 * lk)
    kw = _ref_kwargs(VARIANTS[variant], 2, hq, lk, seed=lq)
    switches, runtime = _tiled_kwargs(kw)
    out, lse = attention_tiled(q, k, v, _cfg(bm, bn, **switches), **runtime)
    want_out, want_lse = attention_ref(q, k, v, **kw)
    assert out.dtype == lse.dtype == torch.float64
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-10)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiled_matches_plain_fp32(variant):
    q, k, v, _ = _qkv(2, 4, 2, 70, 45, 32, dtype=torch.float32, seed=5)
    kw = _ref_kwargs(VARIANTS[variant], 2, 4, 45, seed=6)
    switches, runtime = _tiled_kwargs(kw)
    out, lse = attention_tiled(q, k, v, _cfg(16, 32, **switches), scale=0.2, **runtime)
    want_out, want_lse = attention_ref(q, k, v, scale=0.2, **kw)
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lq,lk,hq,hkv,bm,bn", TILED, ids=lambda x: str(x))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiled_backward_matches_autograd(variant, lq, lk, hq, hkv, bm, bn):
    q, k, v, do = _qkv(2, hq, hkv, lq, lk, 32, seed=lq + 5 * lk)
    kw = _ref_kwargs(VARIANTS[variant], 2, hq, lk, seed=lk)
    switches, runtime = _tiled_kwargs(kw)
    cfg = _cfg(bm, bn, **switches)
    out, lse = attention_tiled(q, k, v, cfg, **runtime)
    got = attention_backward_tiled(q, k, v, out, lse, do, cfg, **runtime)
    want = attention_backward_ref(q, k, v, do, **kw)
    for name, g, w, like in zip("qkv", got, want, (q, k, v)):
        assert g.dtype == torch.float64 and g.shape == like.shape, name
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, w, rtol=0, atol=1e-9, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize(
    "variant,lq,lk,empty_rows",
    [
        ("window-0-3-tl", 40, 25, (slice(None), slice(25, 40))),  # top-left: rows >= Lk see no key >= i
        ("causal-br", 40, 25, (slice(None), slice(0, 15))),       # bottom-right: rows i < Lq - Lk see none
        ("window-3-3-br", 20, 50, (slice(None), slice(0, 0))),    # every row sees keys: nothing empty
        ("key-bias", 30, 40, (1, slice(None))),                   # batch 1's keys are all -inf
    ],
)
def test_rows_that_see_no_key(variant, lq, lk, empty_rows):
    """out 0, lse +inf, dq 0 on exactly the rows that see no key; the rest matches autograd."""
    q, k, v, do = _qkv(2, 2, 1, lq, lk, 32, seed=3)
    kw = _ref_kwargs(VARIANTS[variant], 2, 2, lk, seed=4)
    switches, runtime = _tiled_kwargs(kw)
    cfg = _cfg(16, 16, **switches)
    out, lse = attention_tiled(q, k, v, cfg, **runtime)
    batch, rows = empty_rows
    expected = torch.zeros(2, 2, lq, dtype=torch.bool)
    expected[batch, :, rows] = True
    assert torch.equal(torch.isinf(lse), expected) and (lse[expected] > 0).all()
    assert (out[expected] == 0).all()
    dq, dk, dv = attention_backward_tiled(q, k, v, out, lse, do, cfg, **runtime)
    assert (dq[expected] == 0).all()
    for g, w in zip((dq, dk, dv), attention_backward_ref(q, k, v, do, **kw)):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-9)


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
def test_rows_that_see_no_key_leave_no_nan_in_autograd():
    """attention_ref keeps NaN out of autograd's intermediates (anomaly mode checks each backward
    op's output), with rows emptied by the band, by the key bias and by a mask."""
    q, k, v, do = _qkv(2, 2, 1, 12, 8, 32, seed=6)
    kw = _ref_kwargs(VARIANTS["all"], 2, 2, 8)
    mask = torch.ones(12, 8, dtype=torch.bool)
    mask[-1] = False
    with torch.autograd.detect_anomaly():
        grads = attention_backward_ref(q, k, v, do, mask=mask, **kw)
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][1] == 0).all() and (grads[0][:, :, -1] == 0).all()


def test_softcap_derivative_is_applied():
    """Dropping softcap's 1 - tanh² from the tiled backward would change dq by far more than 1e-9:
    with a small cap most scores sit where tanh is flat."""
    q, k, v, do = _qkv(1, 2, 2, 20, 30, 32, seed=8)
    cfg = _cfg(16, 16, softcap=True)
    out, lse = attention_tiled(q, k, v, cfg, scale=1.0, softcap=0.5)
    dq = attention_backward_tiled(q, k, v, out, lse, do, cfg, scale=1.0, softcap=0.5)[0]
    dq_ref = attention_backward_ref(q, k, v, do, scale=1.0, softcap=0.5)[0]
    capped = 1 - torch.tanh(q @ k.transpose(-2, -1) / 0.5) ** 2
    assert capped.mean() < 0.5
    torch.testing.assert_close(dq, dq_ref, rtol=0, atol=1e-9)


_FAST = dict(atol=1e-8, rtol=1e-6)


def _gradcheck_inputs(lq, lk, seed):
    q, k, v, _ = _qkv(2, 2, 1, lq, lk, 32, seed=seed)
    return tuple(t.requires_grad_(True) for t in (q, k, v))


def test_gradcheck_softcap_alibi_window_full_jacobian():
    q, k, v = _gradcheck_inputs(6, 9, seed=12)
    cfg = _cfg(16, 16, align="bottom_right", window=True, softcap=True, alibi=True)
    slopes = torch.tensor([[0.3, 0.7], [0.1, 0.5]])

    def fn(a, b_, c):
        return tiled_attention(a, b_, c, cfg, 0.5, window=(2, 1), softcap=0.6, alibi_slopes=slopes)

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_gradcheck_all_variants_multi_block():
    q, k, v = _gradcheck_inputs(35, 41, seed=13)
    cfg = _cfg(16, 16, align="bottom_right", window=True, softcap=True, alibi=True, key_bias=True)
    slopes = torch.tensor([0.2, 0.4])
    bias = torch.randn(2, 41, generator=torch.Generator().manual_seed(2))
    bias[0, ::5] = -math.inf

    def fn(a, b_, c):
        return TiledAttention.apply(a, b_, c, cfg, None, (7, 0), 1.5, slopes, bias)

    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True, **_FAST)


# ---------------------------------------------------------------- packed sequences
def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("variant", ["plain", "causal-br", "window-3-3-br", "window-0-3-tl", "gemma", "alibi-heads"])
def test_varlen_is_each_sequence_alone(variant):
    """Each packed sequence against the per-element loop on its own lengths (so its own bottom-right
    diagonal and alibi slope row), including sequences of 0 and 1 queries or keys; gradients match
    the dense reference's, sequence by sequence."""
    lens_q, lens_k = [3, 0, 1, 7, 4, 6], [5, 4, 1, 7, 0, 2]
    hq, hkv, d = 4, 2, 8
    g = torch.Generator().manual_seed(len(variant))
    q, do = (torch.randn(sum(lens_q), hq, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(sum(lens_k), hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    kw = _ref_kwargs(VARIANTS[variant], len(lens_q), hq, 1)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = attention_varlen_ref(*leaves, _cu(lens_q), _cu(lens_k), **kw)
    assert out.shape == q.shape and lse.shape == (hq, sum(lens_q))
    grads = torch.autograd.grad(out, leaves, do)
    cq, ck = _cu(lens_q).tolist(), _cu(lens_k).tolist()
    for b in range(len(lens_q)):
        qs, dos = (t[cq[b]:cq[b + 1]].transpose(0, 1)[None] for t in (q, do))
        ks, vs = (t[ck[b]:ck[b + 1]].transpose(0, 1)[None] for t in (k, v))
        got_out, got_lse = out[cq[b]:cq[b + 1]].transpose(0, 1)[None], lse[:, cq[b]:cq[b + 1]][None]
        kb = dict(kw)
        if kw.get("alibi_slopes") is not None and kw["alibi_slopes"].dim() == 2:
            kb["alibi_slopes"] = kw["alibi_slopes"][b]
        if lens_k[b] == 0:
            assert (got_out == 0).all() and torch.isinf(got_lse).all() and (got_lse > 0).all()
            assert (grads[0][cq[b]:cq[b + 1]] == 0).all()
            continue
        if lens_q[b] == 0:
            assert (grads[1][ck[b]:ck[b + 1]] == 0).all() and (grads[2][ck[b]:ck[b + 1]] == 0).all()
            continue
        want_out, want_lse = _brute(qs, ks, vs, **kb)
        torch.testing.assert_close(got_out.detach(), want_out, rtol=0, atol=1e-12)
        torch.testing.assert_close(got_lse.detach(), want_lse, rtol=0, atol=1e-12)
        dense = attention_backward_ref(qs, ks, vs, dos, **kb)
        for got, want, (t, c) in zip(grads, dense, ((q, cq), (k, ck), (v, ck))):
            torch.testing.assert_close(got[c[b]:c[b + 1]].transpose(0, 1)[None], want, rtol=0, atol=1e-12)


def test_varlen_low_precision_and_no_queries():
    q = torch.randn(5, 2, 8).bfloat16()
    k = v = torch.randn(6, 1, 8).bfloat16()
    out, lse = attention_varlen_ref(q, k, v, _cu([0, 5]), _cu([2, 4]), causal=True, align="bottom_right")
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and lse.shape == (2, 5)
    out, lse = attention_varlen_ref(q[:0], k, v, _cu([0, 0]), _cu([2, 4]))
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)


# ---------------------------------------------------------------- argument checks
def _small():
    q, k, v, _ = _qkv(2, 4, 2, 6, 8, 32)
    return q, k, v


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(align="diagonal"), ValueError, r"align: got 'diagonal', expected one of \('top_left', 'bottom_right'\)"),
        (dict(window=(3,)), TypeError, r"window: got \(3,\), expected a pair of ints"),
        (dict(window=(1.5, 2)), TypeError, r"window: got \(1.5, 2\), expected a pair of ints"),
        (dict(window=(True, 2)), TypeError, r"window: got \(True, 2\), expected a pair of ints"),
        (dict(window=3), TypeError, r"window: got 3, expected a pair of ints"),
        (dict(window=(-2, 0)), ValueError, r"window: got \(-2, 0\), expected sizes >= 0, or -1"),
        (dict(softcap=-1.0), ValueError, r"softcap: got -1.0, expected a finite number >= 0"),
        (dict(softcap=math.inf), ValueError, r"softcap: got inf, expected a finite number >= 0"),
        (dict(softcap="2"), TypeError, r"softcap: got '2', expected a number"),
        (dict(softcap=True), TypeError, r"softcap: got True, expected a number"),
        (dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), TypeError,
         r"alibi_slopes: got dtype torch.float64, expected torch.float32"),
        (dict(alibi_slopes=torch.ones(5)), ValueError, r"alibi_slopes: got shape \(5,\), expected \(4,\) or \(2, 4\)"),
        (dict(alibi_slopes=torch.ones(2, 2)), ValueError, r"alibi_slopes: got shape \(2, 2\), expected \(4,\) or"),
        (dict(alibi_slopes=[0.5] * 4), TypeError, r"alibi_slopes: got list, expected a torch.Tensor"),
        (dict(key_bias=torch.zeros(2, 8).half()), TypeError,
         r"key_bias: got dtype torch.float16, expected torch.float32"),
        (dict(key_bias=torch.zeros(2, 6)), ValueError, r"key_bias: got shape \(2, 6\), expected \(2, 8\)"),
        (dict(key_bias=torch.zeros(1, 2, 8)), ValueError, r"key_bias: got shape \(1, 2, 8\), expected \(2, 8\)"),
    ],
)
def test_variant_argument_checks(kw, exc, match):
    q, k, v = _small()
    with pytest.raises(exc, match=match):
        attention_ref(q, k, v, **kw)
    with pytest.raises(exc, match=match):
        attention_backward_ref(q, k, v, q, **kw)


@pytest.mark.parametrize(
    "switches,runtime,match",
    [
        (dict(softcap=True), dict(), r"softcap: got none with config.softcap on; expected one"),
        (dict(), dict(softcap=1.0), r"softcap: got a value with config.softcap off; expected none"),
        (dict(window=True), dict(), r"window: got none with config.window on; expected one"),
        (dict(causal=True), dict(window=(4, 0)), r"window: got a value with config.window off; expected none"),
        (dict(alibi=True), dict(), r"alibi_slopes: got none with config.alibi on; expected one"),
        (dict(), dict(alibi_slopes=torch.ones(4)), r"alibi_slopes: got a value with config.alibi off"),
        (dict(key_bias=True), dict(), r"key_bias: got none with config.key_bias on; expected one"),
        (dict(), dict(key_bias=torch.zeros(2, 8)), r"key_bias: got a value with config.key_bias off"),
        (dict(varlen=True), dict(), r"config.varlen: got True, expected False"),
    ],
)
def test_tiled_switches_and_arguments_must_agree(switches, runtime, match):
    q, k, v = _small()
    cfg = _cfg(16, 16, **switches)
    with pytest.raises(ValueError, match=match):
        attention_tiled(q, k, v, cfg, **runtime)
    out, lse = attention_ref(q, k, v)
    with pytest.raises(ValueError, match=match):
        attention_backward_tiled(q, k, v, out, lse, q, cfg, **runtime)


def test_tiled_checks_the_run_time_values():
    q, k, v = _small()
    with pytest.raises(ValueError, match=r"window: got \(-3, 1\), expected sizes >= 0"):
        attention_tiled(q, k, v, _cfg(16, 16, window=True), window=(-3, 1))
    with pytest.raises(ValueError, match=r"alibi_slopes: got shape \(3,\), expected \(4,\) or \(2, 4\)"):
        attention_tiled(q, k, v, _cfg(16, 16, alibi=True), alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match=r"key_bias: got shape \(2, 7\), expected \(2, 8\)"):
        tiled_attention(q, k, v, _cfg(16, 16, key_bias=True), key_bias=torch.zeros(2, 7))


def _packed():
    return torch.zeros(7, 4, 8), torch.zeros(9, 2, 8), torch.zeros(9, 2, 8)


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (dict(cu_seqlens_q=torch.tensor([0, 3, 7])), TypeError,
         r"cu_seqlens_q: got torch.int64, expected a torch.int32"),
        (dict(cu_seqlens_k=[0, 4, 9]), TypeError, r"cu_seqlens_k: got list, expected a torch.int32 tensor"),
        (dict(cu_seqlens_q=torch.tensor([[0, 3, 7]], dtype=torch.int32)), ValueError,
         r"cu_seqlens_q: got shape \(1, 3\), expected \(batch \+ 1,\)"),
        (dict(cu_seqlens_q=torch.tensor([7], dtype=torch.int32)), ValueError, r"cu_seqlens_q: got shape \(1,\)"),
        (dict(cu_seqlens_q=torch.tensor([1, 3, 7], dtype=torch.int32)), ValueError,
         r"cu_seqlens_q: got \[1, 3, 7\], expected non-decreasing from 0 to the packed length 7"),
        (dict(cu_seqlens_q=torch.tensor([0, 3, 6], dtype=torch.int32)), ValueError, r"packed length 7"),
        (dict(cu_seqlens_k=torch.tensor([0, 5, 4, 9], dtype=torch.int32)), ValueError,
         r"cu_seqlens_k: got \[0, 5, 4, 9\], expected non-decreasing"),
        (dict(cu_seqlens_k=torch.tensor([0, 2, 4, 9], dtype=torch.int32)), ValueError,
         r"cu_seqlens: got 3 and 4 entries, expected equal"),
        (dict(q=torch.zeros(1, 7, 4, 8)), ValueError, r"q: got shape \(1, 7, 4, 8\), expected 3 dims"),
        (dict(k=torch.zeros(9, 3, 8), v=torch.zeros(9, 3, 8)), ValueError, r"kv heads dividing query heads"),
        (dict(v=torch.zeros(9, 2, 8).double()), TypeError, r"dtypes: got torch.float32, torch.float32, torch.float64"),
        (dict(alibi_slopes=torch.ones(3, 4)), ValueError,
         r"alibi_slopes: got shape \(3, 4\), expected \(4,\) or \(2, 4\)"),
        (dict(align="br"), ValueError, r"align: got 'br', expected one of"),
        (dict(window=(0, -5)), ValueError, r"window: got \(0, -5\), expected sizes >= 0"),
        (dict(softcap=-0.5), ValueError, r"softcap: got -0.5, expected a finite number >= 0"),
    ],
)
def test_varlen_argument_checks(change, exc, match):
    q, k, v = _packed()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=_cu([3, 4]), cu_seqlens_k=_cu([4, 5]))
    args.update(change)
    with pytest.raises(exc, match=match):
        attention_varlen_ref(**args)
