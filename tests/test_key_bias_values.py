"""Key biases across the values models pass, not only 0 and -inf: large positive scores (+8..+40, past
fp16's exp overflow at ~11.09), large negative ones, ALiBi-sized ramps (slope x distance, up to
tens), mixtures with -inf, and ALiBi slopes of either sign. Forward and backward against the
references under FlashAttention's rule, with query lengths that leave padded rows in the last query
block: there Q and dO are zero, and before the fix the backward's P = 2^(bias - 0) overflowed fp16 to
inf and met the zero dO rows (inf x 0 = NaN in dV and dK). Each case runs on a GPU (`gpu` marker)
and on the emulator."""
import pytest
import torch

from autoflash.kernels.launch import flash_backward, flash_forward
from autoflash.reference.backward import attention_backward_ref
from autoflash.reference.forward import attention_ref, within_tolerance

from gpu_inputs import TORCH_DTYPES, device


def _bias(kind: str, b: int, lk: int, g: torch.Generator) -> torch.Tensor:
    """fp32 (b, lk) key bias of one kind of values."""
    u = torch.rand(b, lk, generator=g)
    if kind == "positive":  # a few keys lifted far above the rest
        return torch.where(u < 0.3, 8 + 32 * torch.rand(b, lk, generator=g), torch.zeros(b, lk))
    if kind == "negative":
        return -8 - 52 * u
    if kind == "alibi-ramp":  # -slope * distance from the last key, slopes as flash-attn draws them
        slope = torch.rand(b, 1, generator=g) * 0.3
        return -slope * torch.arange(lk - 1, -1, -1, dtype=torch.float32)
    if kind == "rising-ramp":  # the same magnitudes, rising: later keys scored up to +60
        return 60.0 * torch.arange(lk, dtype=torch.float32) / lk + torch.zeros(b, 1)
    if kind == "mixed":  # wide normal scores with masked keys among them
        bias = 20 * torch.randn(b, lk, generator=g)
        return bias.masked_fill(u < 0.2, float("-inf"))
    raise ValueError(kind)


KINDS = ("positive", "negative", "alibi-ramp", "rising-ramp", "mixed")
CASES = [(kind, dtype, 64) for kind in KINDS for dtype in ("fp16", "bf16")] + [("positive", "fp16", 128)]


def _check(out, lse, grads, q, k, v, dout, kw):
    up = [t.float() for t in (q, k, v)]
    ref_out, ref_lse = attention_ref(*up, **kw)
    torch_out, _ = attention_ref(q, k, v, upcast=False, **kw)
    ok, err, bound = within_tolerance(out, ref_out, torch_out)
    assert ok, f"out: err {err:.3e} > bound {bound:.3e}"
    ok, err, _ = within_tolerance(lse, ref_lse, ref_lse, atol=1e-3)
    assert ok, f"lse: err {err:.3e}"
    ref_grads = attention_backward_ref(*up, dout.float(), **kw)
    torch_grads = attention_backward_ref(q, k, v, dout, upcast=False, **kw)
    for name, got, ref, yard in zip(("dq", "dk", "dv"), grads, ref_grads, torch_grads):
        assert not got.isnan().any(), f"{name}: NaN"
        ok, err, bound = within_tolerance(got, ref, yard, backward=True)
        assert ok, f"{name}: err {err:.3e} > bound {bound:.3e}"


@pytest.mark.parametrize("kind, dtype, d", CASES, ids=lambda x: str(x))
def test_key_bias_values_meet_flashattention_rule(target, kind, dtype, d):
    dev, dt = device(target), TORCH_DTYPES[dtype]
    g = torch.Generator().manual_seed(hash((kind, dtype, d)) % 2**31)
    b, hq, hkv, lq, lk = 2, 4, 2, 37, 203  # 37 rows: the query block is mostly padding
    q, dout = (torch.randn(b, hq, lq, d, generator=g).to(dev, dt) for _ in range(2))
    k, v = (torch.randn(b, hkv, lk, d, generator=g).to(dev, dt) for _ in range(2))
    kw = dict(key_bias=_bias(kind, b, lk, g).to(dev))
    out, lse = flash_forward(q, k, v, **kw)
    grads = flash_backward(dout, q, k, v, out, lse, **kw)
    _check(out, lse, grads, q, k, v, dout, kw)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_alibi_slopes_of_either_sign_meet_flashattention_rule(target, dtype):
    """flash-attn takes any fp32 slopes; a negative one lifts far keys' scores (here up to ~+60)."""
    dev, dt = device(target), TORCH_DTYPES[dtype]
    g = torch.Generator().manual_seed(11)
    b, hq, hkv, lq, lk, d = 2, 4, 2, 37, 203, 64
    q, dout = (torch.randn(b, hq, lq, d, generator=g).to(dev, dt) for _ in range(2))
    k, v = (torch.randn(b, hkv, lk, d, generator=g).to(dev, dt) for _ in range(2))
    kw = dict(alibi_slopes=((torch.rand(b, hq, generator=g) - 0.5) * 0.6).to(dev), align="bottom_right")
    out, lse = flash_forward(q, k, v, **kw)
    grads = flash_backward(dout, q, k, v, out, lse, **kw)
    _check(out, lse, grads, q, k, v, dout, kw)
