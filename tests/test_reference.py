"""Tests for the plain and tiled attention references and the accuracy rule (CPU only)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from autoflash.kernels.config import KernelConfig
from autoflash.reference.forward import attention_ref, attention_tiled, rounding_error, within_tolerance



def _sdpa_has_gqa() -> bool:
    # SDPA is a builtin (no inspectable signature); enable_gqa arrived in torch 2.5.
    try:
        F.scaled_dot_product_attention(*(torch.zeros(1, 1, 1, 8),) * 3, enable_gqa=False)
    except TypeError:
        return False
    return True


_SDPA_HAS_GQA = _sdpa_has_gqa()


def _qkv(b, hq, hkv, lq, lk, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def _sdpa(q, k, v, causal, scale=None):
    group = q.shape[1] // k.shape[1]
    if _SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=group > 1)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def _cfg(bm, bn, dtype="bf16", causal=False, d=32):
    warps = 1 if dtype != "fp32" else max(1, bm // 32)
    return KernelConfig(head_dim=d, dtype=dtype, block_m=bm, block_n=bn, num_warps=warps, causal=causal)


# (lq, lk, hq, hkv, block_m, block_n, config dtype)
TILED_CASES = [
    (113, 203, 2, 2, 64, 32, "bf16"),
    (1, 1, 1, 1, 16, 16, "bf16"),
    (7, 300, 2, 1, 16, 128, "fp32"),
    (300, 7, 2, 1, 128, 16, "bf16"),
    (203, 113, 6, 2, 32, 48, "fp32"),
    (97, 97, 6, 2, 48, 80, "bf16"),
    (130, 130, 4, 1, 128, 64, "fp32"),
    (1000, 1000, 2, 1, 128, 128, "bf16"),
    (64, 256, 3, 3, 16, 64, "fp32"),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk,hq,hkv,bm,bn,cdtype", TILED_CASES)
def test_tiled_matches_plain(lq, lk, hq, hkv, bm, bn, cdtype, causal):
    q, k, v = _qkv(2, hq, hkv, lq, lk, 32, seed=lq + lk)
    cfg = _cfg(bm, bn, cdtype, causal)
    out_t, lse_t = attention_tiled(q, k, v, cfg)
    out_r, lse_r = attention_ref(q, k, v, causal=causal)
    assert out_t.dtype == torch.float64 and out_t.shape == q.shape
    assert lse_t.shape == (2, hq, lq)
    torch.testing.assert_close(out_t, out_r, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse_t, lse_r.to(lse_t.dtype), rtol=0, atol=1e-10)


def test_tiled_low_precision_inputs_compute_fp32():
    q, k, v = _qkv(1, 2, 2, 77, 150, 64, dtype=torch.bfloat16)
    out_t, lse_t = attention_tiled(q, k, v, _cfg(64, 32, "bf16", True, d=64))
    out_r, lse_r = attention_ref(q, k, v, causal=True)
    assert out_t.dtype == torch.float32 and lse_t.dtype == torch.float32
    torch.testing.assert_close(out_t, out_r, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse_t, lse_r, rtol=0, atol=1e-5)


def test_tiled_scale_and_config_checks():
    q, k, v = _qkv(1, 2, 1, 40, 50, 32)
    out_t, lse_t = attention_tiled(q, k, v, _cfg(16, 32), scale=0.3)
    out_r, lse_r = attention_ref(q, k, v, scale=0.3)
    torch.testing.assert_close(out_t, out_r, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse_t, lse_r, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="head_dim"):
        attention_tiled(q, k, v, _cfg(16, 32, d=64))
    with pytest.raises(TypeError, match="KernelConfig"):
        attention_tiled(q, k, v, {"block_m": 16})


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "lq,lk,hq,hkv", [(113, 203, 2, 2), (203, 113, 6, 2), (1, 1, 4, 1), (7, 300, 3, 1), (300, 7, 2, 2)]
)
def test_plain_matches_sdpa(lq, lk, hq, hkv, causal):
    q, k, v = _qkv(2, hq, hkv, lq, lk, 40, seed=lq * lk)
    out, lse = attention_ref(q, k, v, causal=causal)
    torch.testing.assert_close(out, _sdpa(q, k, v, causal), rtol=0, atol=1e-10)
    # LSE against torch.logsumexp over explicitly built scores.
    kk = k.repeat_interleave(hq // hkv, 1)
    s = q @ kk.transpose(-2, -1) / math.sqrt(40)
    if causal:
        s = s.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=0, atol=1e-10)


def test_scale_honoured():
    q, k, v = _qkv(1, 2, 2, 33, 45, 32)
    out, lse = attention_ref(q, k, v, scale=0.05)
    torch.testing.assert_close(out, _sdpa(q, k, v, False, scale=0.05), rtol=0, atol=1e-10)
    torch.testing.assert_close(lse, torch.logsumexp(0.05 * q @ k.transpose(-2, -1), -1), rtol=0, atol=1e-10)
    default, _ = attention_ref(q, k, v)
    explicit, _ = attention_ref(q, k, v, scale=1 / math.sqrt(32))
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)
    assert (out - default).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fully_masked_rows(dtype):
    q, k, v = _qkv(2, 4, 2, 9, 12, 32, dtype=dtype)
    mask = torch.rand(2, 1, 9, 12, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[0, 0, 3] = False  # row 3 of batch 0 sees no key
    mask[1, 0, 0] = False
    for upcast in (True, False):
        out, lse = attention_ref(q, k, v, mask=mask, upcast=upcast, causal=upcast)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        assert (out[0, :, 3] == 0).all() and (out[1, :, 0] == 0).all()
        assert torch.isinf(lse[0, :, 3]).all() and (lse[0, :, 3] > 0).all()
        assert torch.isinf(lse[1, :, 0]).all()
        assert torch.isfinite(lse[0, :, 4]).all()
        # exp(S - lse) on an empty row must give 0, never NaN.
        assert (torch.exp(torch.tensor(float("-inf")) - lse[0, :, 3]) == 0).all()


def test_mask_matches_sdpa_and_checks():
    q, k, v = _qkv(1, 2, 2, 20, 30, 32)
    mask = torch.rand(20, 30, generator=torch.Generator().manual_seed(2)) > 0.5
    mask[:, 0] = True
    out, _ = attention_ref(q, k, v, mask=mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=0, atol=1e-10)
    with pytest.raises(TypeError, match="bool"):
        attention_ref(q, k, v, mask=mask.double())
    with pytest.raises(ValueError, match="broadcastable"):
        attention_ref(q, k, v, mask=mask[:, :7])


def test_upcast_false_bf16_differs_but_close():
    q, k, v = _qkv(2, 4, 2, 128, 160, 64, dtype=torch.bfloat16)
    ref, lse_ref = attention_ref(q, k, v, causal=True)
    low, lse_low = attention_ref(q, k, v, causal=True, upcast=False)
    assert ref.dtype == torch.float32 and low.dtype == torch.bfloat16 and lse_low.dtype == torch.float32
    err = (low.float() - ref).abs().max().item()
    assert 0 < err < 5e-2
    assert (lse_low - lse_ref).abs().max().item() < 5e-2
    hi64, _ = attention_ref(q.double(), k.double(), v.double(), causal=True)
    assert hi64.dtype == torch.float64 and (hi64 - ref.double()).abs().max() < 1e-5


def test_within_tolerance_cases():
    ref = torch.zeros(4, 8, dtype=torch.float64)
    torch_out = ref + 0.01
    # fp64 throughout: the rounding term is 0 at a zero reference, so the bound is 2x PyTorch's error
    # plus the fp32/fp64 floor (FA3 tests no fp32).
    ok, err, bound = within_tolerance(ref + 0.015, ref, torch_out)
    assert ok and err == pytest.approx(0.015) and bound == pytest.approx(0.02 + 1e-5)
    ok, err, _ = within_tolerance(ref + 0.03, ref, torch_out)
    assert not ok and err == pytest.approx(0.03)
    assert within_tolerance(ref + 0.03, ref, torch_out, factor=3.0)[0]
    # exact PyTorch in fp64 leaves the rounding term (0 here) and the floor, 1e-5 unless given
    assert within_tolerance(ref + 5e-6, ref, ref)[0]
    assert not within_tolerance(ref + 5e-6, ref, ref, atol=0.0)[0]
    # fp16 inputs: FA3's rule, no floor, but the rounding of 0.3 in fp16 at a zero reference, 2 x 4.9e-5
    assert within_tolerance(ref + 9e-5, ref, ref.half())[0] and not within_tolerance(ref + 1e-4, ref, ref.half())[0]
    bad = ref.clone()
    bad[1, 2] = float("nan")
    ok, err, _ = within_tolerance(bad, ref, torch_out)
    assert not ok and math.isnan(err)
    # Matching +inf (empty-row lse) is no error; inf where the reference is finite is.
    lse_ref = torch.tensor([1.0, float("inf")])
    assert within_tolerance(lse_ref.float(), lse_ref, lse_ref)[0]
    assert not within_tolerance(torch.tensor([float("inf"), float("inf")]), lse_ref, lse_ref)[0]
    # Mixed dtypes are compared in fp64.
    ok, _, _ = within_tolerance(torch.ones(3, dtype=torch.bfloat16), torch.ones(3), torch.ones(3, dtype=torch.half))
    assert ok
    with pytest.raises(ValueError, match="shapes"):
        within_tolerance(ref, ref[:2], ref)
    with pytest.raises(ValueError, match="softcap"):
        within_tolerance(ref, ref, ref, softcap=-1.0)
    with pytest.raises(TypeError, match="dtype"):
        within_tolerance(ref, ref, ref, dtype=torch.int32)


# FA3's rounding term (ref + 0.3 - 0.3 - ref).abs().max() by hand, each op in fp32 and rounded to the
# dtype as PyTorch on CUDA evaluates it (the scalar 0.3 read as fp32 0.30000001192092896):
# zero in bf16: bf16(0.3f) = 0.30078125; 0.30078125 - 0.3f = 7.8124e-4, in bf16 205 * 2**-18.
# zero in fp16: fp16(0.3f) = 1229 * 2**-12; minus 0.3f = 4.8816e-5, an fp16 subnormal, 819 * 2**-24.
# 1.0 in bf16: bf16(1.3) = 166/128; 166/128 - 0.3f = 0.996875 -> 255/256; 255/256 - 1 = -2**-8.
# 1.0 in fp16: fp16(1.3) = 1331/1024; 1331/1024 - 0.3f = 0.99980 -> 1.0; 1.0 - 1.0 = 0.
BF16_ZERO, FP16_ZERO = 205 * 2.0**-18, 819 * 2.0**-24


@pytest.mark.parametrize("value, dtype, expected", [
    (0.0, torch.bfloat16, BF16_ZERO), (0.0, torch.float16, FP16_ZERO), (1.0, torch.bfloat16, 2.0**-8),
    (1.0, torch.float16, 0.0), (0.0, torch.float32, 0.0), (0.0, torch.float64, 0.0)])
def test_rounding_error_is_fa3s_term_by_hand(value, dtype, expected):
    assert rounding_error(torch.full((3, 5), value), dtype) == expected
    # the reference's own dtype does not matter, only the one it is rounded to
    assert rounding_error(torch.full((3, 5), value, dtype=torch.float64), dtype) == expected


def test_rounding_error_takes_the_max_and_skips_non_finite():
    assert rounding_error(torch.tensor([0.0, 1.0, float("inf")]), torch.bfloat16) == 2.0**-8
    assert rounding_error(torch.tensor([float("inf"), float("-inf")]), torch.bfloat16) == 0.0
    assert rounding_error(torch.zeros(0), torch.float16) == 0.0
    # fp32 has no narrower opmath: the term is PyTorch's own expression, on any device
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    assert rounding_error(x, torch.float32) == (x + 0.3 - 0.3 - x).abs().max().item() > 0


def test_within_tolerance_is_fa3s_rule_by_hand():
    """hopper/test_flash_attn.py: err <= rtol * err_pt + 2 * rounding(ref in the input dtype), rtol 2
    (3 with a softcap), gradients + 3e-4 with a softcap. The input dtype defaults to out_torch's."""
    ref = torch.zeros(4, 8)
    torch_out = (ref + 0.01).to(torch.bfloat16)  # bf16(0.01) = 164 / 16384
    err_pt = 164 / 16384
    ok, err, bound = within_tolerance(ref + 0.021, ref, torch_out)
    # FA2's 2x + 1e-5 gave 0.02003 here and failed this case
    assert ok and bound == pytest.approx(2 * err_pt + 2 * BF16_ZERO, rel=1e-12) and err == pytest.approx(0.021)
    assert not within_tolerance(ref + 0.022, ref, torch_out)[0]
    assert within_tolerance(ref, ref, torch_out, backward=True)[2] == bound  # no softcap: the same rule
    # the rounding is measured in the dtype asked for, else in out_torch's
    assert within_tolerance(ref, ref, torch_out, dtype=torch.float16)[2] == pytest.approx(2 * err_pt + 2 * FP16_ZERO)
    fp16_pt = (ref + 0.01).half()  # fp16(0.01) = 1311 * 2**-17
    assert within_tolerance(ref, ref, fp16_pt)[2] == pytest.approx(2 * 1311 * 2.0**-17 + 2 * FP16_ZERO, rel=1e-12)
    # softcap: rtol 3; the gradients also + 3e-4
    ok, _, bound = within_tolerance(ref + 0.03, ref, torch_out, softcap=5.0)
    assert ok and bound == pytest.approx(3 * err_pt + 2 * BF16_ZERO, rel=1e-12)
    _, _, bound = within_tolerance(ref + 0.03, ref, torch_out, softcap=5.0, backward=True)
    assert bound == pytest.approx(3 * err_pt + 2 * BF16_ZERO + 3e-4, rel=1e-12)
    assert not within_tolerance(ref + 0.0321, ref, torch_out, softcap=5.0, backward=True)[0]
    # an explicit factor overrides rtol; atol adds on
    assert within_tolerance(ref, ref, torch_out, factor=1.0, atol=0.5)[2] == pytest.approx(
        err_pt + 2 * BF16_ZERO + 0.5, rel=1e-12)


def test_single_key_gradients_need_no_floor_of_their_own():
    """Every softmax row 1 (one key): the references' dQ and dK are exactly 0 and so is PyTorch's,
    which left FA2's rule a bound of 1e-5. The kernels' delta and dP are two different fp32 sums whose
    residue reached 1.007e-05 (test_emulated_fuzz.py); FA3's rounding term of a zero reference,
    2 * 4.9e-5 in fp16 and 2 * 7.8e-4 in bf16, covers it."""
    zero = torch.zeros(2, 3, 7, 64)
    residue = torch.full_like(zero, 1.007e-05)
    for dt in (torch.float16, torch.bfloat16):
        ok, _, bound = within_tolerance(residue, zero, zero.to(dt), backward=True)
        assert ok and bound >= 2 * FP16_ZERO


@pytest.mark.parametrize(
    "shapes,dtypes,exc,match",
    [
        (((2, 3, 8, 32), (2, 3, 8, 32), (2, 3, 8)), None, ValueError, "expected 4 dims"),
        (((2, 3, 8, 32), (1, 3, 8, 32), (1, 3, 8, 32)), None, ValueError, "batch"),
        (((2, 3, 8, 32), (2, 3, 8, 16), (2, 3, 8, 16)), None, ValueError, "head_dim"),
        (((2, 4, 8, 32), (2, 3, 8, 32), (2, 3, 8, 32)), None, ValueError, "kv heads dividing query heads"),
        (((2, 4, 8, 32), (2, 2, 8, 32), (2, 2, 9, 32)), None, ValueError, "k and v"),
        (((2, 4, 0, 32), (2, 2, 8, 32), (2, 2, 8, 32)), None, ValueError, "empty input"),
        (((2, 4, 8, 32), (2, 2, 0, 32), (2, 2, 0, 32)), None, ValueError, "empty input"),
        (((2, 4, 8, 32),) * 3, (torch.float32, torch.float16, torch.float32), TypeError, "dtypes"),
        (((2, 4, 8, 32),) * 3, (torch.int32,) * 3, TypeError, "dtype"),
    ],
)
def test_bad_inputs(shapes, dtypes, exc, match):
    dtypes = dtypes or (torch.float32,) * 3
    q, k, v = (torch.zeros(s, dtype=dt) for s, dt in zip(shapes, dtypes))
    with pytest.raises(exc, match=match):
        attention_ref(q, k, v)
    with pytest.raises(exc, match=match):
        attention_tiled(q, k, v, _cfg(16, 16))


def test_bad_non_tensor_and_scale():
    q = torch.zeros(1, 1, 4, 32)
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        attention_ref(q.numpy(), q, q)
    with pytest.raises(TypeError, match="scale"):
        attention_ref(q, q, q, scale="0.1")
