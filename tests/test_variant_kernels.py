"""The variant kernels (flash-attn's features: bottom-right causal, sliding windows and FlashAttention-3's
attention chunks, softcap, ALiBi, a key bias for padding masks, packed sequences) against the references under FlashAttention-3's rule
(hopper/test_flash_attn.py, autoflash.reference.forward.within_tolerance): out, dq, dk and dv within 2x
(3x with a softcap) of PyTorch's own error in the input dtype, both measured against the fp32
reference, plus twice the reference's rounding in the input dtype (and 3e-4 on gradients with a
softcap). Each case runs on a GPU (`gpu` marker) and on the emulator (an H100: the forward on the sm90
family, the backward on the sm80's; tests/test_sm90_forward.py runs the sm90 forward's variants over
more head dims and schedules); the emulated grid is sampled per run (one case per variant and dtype,
plus a share of the rest: conftest.py)."""
import pytest
import torch

from autoflash.kernels.launch import flash_backward, flash_forward
from autoflash.reference.backward import attention_backward_ref
from autoflash.reference.forward import attention_ref, attention_varlen_ref, within_tolerance

from gpu_inputs import TORCH_DTYPES, device
from variant_inputs import VARIANTS, arguments as _arguments

# Where every row sees one key (Lk = 1, the window (0, 0)) softmax rows are exactly 1 and the
# references' dQ and dK exactly 0; the kernels' delta and dP are two different fp32 sums whose residue
# reaches ~1e-5 there (see test_emulated_fuzz.py). FA2's rule left them 1e-5 and needed a floor of its
# own; FA3's rounding term of a zero reference (2 x 4.9e-5 in fp16, 2 x 7.8e-4 in bf16) covers it.


def _grad_ok(got, ref, yard, kw):
    return within_tolerance(got, ref, yard, softcap=kw.get("softcap", 0.0), backward=True)


# (Lq, Lk) pairs from FlashAttention's tests, at sizes the emulator runs quickly; Lq > Lk too
PAIRS = ((113, 203), (128, 217), (1, 77), (77, 1), (203, 113))
HEADS = ((4, 2), (3, 1))


@pytest.mark.sweep
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}-{h[1]}")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_meets_flashattention_rule(target, variant, dtype, d, heads, pair):
    (hq, hkv), (lq, lk) = heads, pair
    b = 2
    dev, dt = device(target), TORCH_DTYPES[dtype]
    g = torch.Generator().manual_seed(hash((variant, dtype, d, heads, pair)) % 2**31)
    q, dout = (torch.randn(b, hq, lq, d, generator=g).to(dev, dt) for _ in range(2))
    k, v = (torch.randn(b, hkv, lk, d, generator=g).to(dev, dt) for _ in range(2))
    kw = _arguments(VARIANTS[variant], b, hq, lk, dev, g)

    out, lse = flash_forward(q, k, v, **kw)
    dq, dk, dv = flash_backward(dout, q, k, v, out, lse, **kw)
    up = [t.float() for t in (q, k, v)]
    ref_out, ref_lse = attention_ref(*up, **kw)
    torch_out, _ = attention_ref(q, k, v, upcast=False, **kw)
    ok, err, bound = within_tolerance(out, ref_out, torch_out, softcap=kw.get("softcap", 0.0))
    assert ok, f"out: err {err:.3e} > bound {bound:.3e}"
    ok, err, _ = within_tolerance(lse, ref_lse, ref_lse, atol=1e-3)  # fp32 LSE: a fixed bound
    assert ok, f"lse: err {err:.3e}"
    ref_grads = attention_backward_ref(*up, dout.float(), **kw)
    torch_grads = attention_backward_ref(q, k, v, dout, upcast=False, **kw)
    for name, got, ref, yard in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, torch_grads):
        ok, err, bound = _grad_ok(got, ref, yard, kw)
        assert ok, f"{name}: err {err:.3e} > bound {bound:.3e}"


def _packed(lengths: list[int], h: int, d: int, dt, dev, g) -> torch.Tensor:
    return torch.randn(sum(lengths), h, d, generator=g).to(dev, dt)


def _cu(lengths: list[int], dev) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)


@pytest.mark.sweep
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("variant", ["plain", "causal-br", "window-5-3", "gemma", "chunk-causal"])
@pytest.mark.parametrize("draw", range(3))
@pytest.mark.parametrize("used", [False, True], ids=["spans", "seqused"])
def test_varlen_meets_flashattention_rule(target, variant, dtype, draw, used):
    """Packed sequences of random lengths, 0 and 1 among them, each against the reference of its own;
    with FlashAttention-3's seqused_q / seqused_k, a random prefix of each span in use (0 and all
    among them): the rows past it get out 0, lse +inf and no gradient."""
    dev, dt, d, hq, hkv = device(target), TORCH_DTYPES[dtype], 64, 4, 2
    g = torch.Generator().manual_seed(1000 * draw + len(variant))
    n = 5
    lens_q = [0, 1] + torch.randint(1, 90, (n - 2,), generator=g).tolist()
    lens_k = [int(x) for x in torch.randint(0, 90, (n,), generator=g)]
    lens_k[1] = 1
    perm = torch.randperm(n, generator=g).tolist()
    lens_q, lens_k = [lens_q[i] for i in perm], [lens_k[i] for i in perm]
    q, dout = (_packed(lens_q, hq, d, dt, dev, g) for _ in range(2))
    k, v = (_packed(lens_k, hkv, d, dt, dev, g) for _ in range(2))
    spec = {} if variant == "plain" else VARIANTS[variant]
    kw = _arguments(spec, n, hq, 1, dev, g)
    cu = dict(cu_seqlens_q=_cu(lens_q, dev), cu_seqlens_k=_cu(lens_k, dev))
    if used:
        prefix = lambda lens: [0 if i == 0 else length if i == 1 else  # noqa: E731
                               int(torch.randint(0, length + 1, (1,), generator=g)) for i, length in enumerate(lens)]
        cu.update(seqused_q=torch.tensor(prefix(lens_q), dtype=torch.int32, device=dev),
                  seqused_k=torch.tensor(prefix(lens_k), dtype=torch.int32, device=dev))
    out, lse = flash_forward(q, k, v, **cu, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), **kw)
    grads = flash_backward(dout, q, k, v, out, lse, **cu, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), **kw)

    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_varlen_ref(*leaves, **cu, **kw)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.float())
    same = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch_out, _ = attention_varlen_ref(*same, **cu, upcast=False, **kw)
    torch_grads = torch.autograd.grad(torch_out, same, dout)
    ok, err, bound = within_tolerance(out, ref_out.detach(), torch_out.detach(), softcap=kw.get("softcap", 0.0))
    assert ok, f"out: err {err:.3e} > bound {bound:.3e} (lengths q {lens_q}, k {lens_k})"
    ok, err, _ = within_tolerance(lse, ref_lse.detach(), ref_lse.detach(), atol=1e-3)
    assert ok, f"lse: err {err:.3e}"
    for name, got, ref, yard in zip(("dq", "dk", "dv"), grads, ref_grads, torch_grads):
        ok, err, bound = _grad_ok(got, ref, yard, kw)
        assert ok, f"{name}: err {err:.3e} > bound {bound:.3e} (lengths q {lens_q}, k {lens_k})"


@pytest.mark.parametrize("variant", ["window-5-3", "gemma"])
def test_deterministic_backward_is_bit_identical(target, variant):
    dev = device(target)
    g = torch.Generator().manual_seed(7)
    q, dout = (torch.randn(1, 2, 70, 64, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, 1, 90, 64, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    kw = _arguments(VARIANTS[variant], 1, 2, 90, dev, g)
    out, lse = flash_forward(q, k, v, **kw)
    first = flash_backward(dout, q, k, v, out, lse, deterministic=True, **kw)
    again = flash_backward(dout, q, k, v, out, lse, deterministic=True, **kw)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
