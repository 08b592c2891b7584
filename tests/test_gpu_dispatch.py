"""GPU tier of autoflash.attention: the kernels run (strict: a fallback is an error), eagerly and
under torch.compile(fullgraph=True), with FlashAttention-3's accuracy rule against an fp32 reference;
the eager path (autograd.Function) and the compiled path (custom op) agree bit for bit; transformers
runs on the kernels. Each test runs on a CUDA GPU (skipped without one) and on the CPU emulator
(`target`, conftest.py); FlashAttention's head dims 59 and 111 run zero-padded."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import autoflash
from autoflash.dispatch import sdpa as dispatch
from autoflash.reference.forward import attention_ref, within_tolerance
from autoflash.reference.backward import attention_backward_ref
from gpu_inputs import HEAD_DIMS, PADDED_HEAD_DIMS, batch, device, make_qkv


@pytest.fixture(autouse=True)
def _strict(monkeypatch):
    monkeypatch.setenv(dispatch.STRICT_ENV, "1")  # any fallback raises


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_runs_the_kernels_accurately(target, dtype, causal, layout):
    lq, lk = (300, 517) if target == "gpu" else (130, 217)
    q, k, v = make_qkv(batch(target, 2), 8 if target == "gpu" else 4, 2, lq, lk, 128, dtype, layout=layout,
                       requires_grad=True, target=target)
    out = autoflash.attention(q, k, v, is_causal=causal, enable_gqa=True)
    ref, _ = attention_ref(q.detach(), k.detach(), v.detach(), causal=causal)
    same, _ = attention_ref(q.detach(), k.detach(), v.detach(), causal=causal, upcast=False)
    ok, err, bound = within_tolerance(out.detach(), ref, same)
    assert ok, f"out: max err {err:.3e} > bound {bound:.3e}"
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    refs = attention_backward_ref(q.detach(), k.detach(), v.detach(), dout, causal=causal)
    sames = attention_backward_ref(q.detach(), k.detach(), v.detach(), dout, causal=causal, upcast=False)
    for name, g, r, s in zip("qkv", grads, refs, sames):
        ok, err, bound = within_tolerance(g, r, s, backward=True)
        assert ok, f"d{name}: max err {err:.3e} > bound {bound:.3e}"


def test_extra_batch_dims_and_explain_on_the_device(target):
    shape = (2, 3, 4, 257, 64) if target == "gpu" else (2, 2, 2, 129, 64)
    q, k, v = (torch.randn(shape, device=device(target), dtype=torch.bfloat16) for _ in range(3))
    out = autoflash.attention(q, k, v, is_causal=True)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    ex = autoflash.explain(q, k, v, is_causal=True)
    gpu = autoflash.detect().name if target == "gpu" else autoflash.emulation.active().gpu
    assert ex.uses_kernels and ex.gpu == gpu
    assert ("emulated" in ex.path) == (target == "emulated")


@pytest.mark.parametrize("d", HEAD_DIMS + PADDED_HEAD_DIMS)
def test_strict_head_dims(target, d):
    """FlashAttention's head dims run on the kernels in strict mode (no fallback): every one of ours
    as it is, 59 and 111 (not multiples of 8) zero-padded to the next."""
    q, k, v = make_qkv(1, 2, 1, 33, 47, d, torch.bfloat16, target=target)
    out = autoflash.attention(q, k, v, enable_gqa=True, is_causal=True, strict=True)
    ref, _ = attention_ref(q, k, v, causal=True)
    same, _ = attention_ref(q, k, v, causal=True, upcast=False)
    ok, err, bound = within_tolerance(out, ref, same)
    assert ok, f"out: max err {err:.3e} > bound {bound:.3e}"


def test_eager_and_custom_op_paths_agree_bitwise(target):
    n = 1000 if target == "gpu" else 200
    q, k, v = make_qkv(batch(target, 2), 8 if target == "gpu" else 2, 8 if target == "gpu" else 2, n, n, 128,
                       torch.bfloat16, target=target)
    eager = autoflash.attention(q, k, v, is_causal=True)
    op, _ = torch.ops.autoflash.attention_fwd(q, k, v, True, 128 ** -0.5)
    assert torch.equal(eager, op)


def test_compile_fullgraph_runs_the_kernels_and_matches_eager(target):
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(128, 128, device=device(target), dtype=torch.bfloat16)

        def forward(self, q, k, v):
            return self.proj(autoflash.attention(q, k, v, is_causal=True, enable_gqa=True))

    torch._dynamo.reset()
    model = Attn()
    n = 1024 if target == "gpu" else 160
    q, k, v = make_qkv(batch(target, 2), 8 if target == "gpu" else 4, 2, n, n, 128, torch.bfloat16,
                       requires_grad=True, target=target)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.FallbackWarning)
        compiled = torch.compile(model, fullgraph=True)(q, k, v)
    eager = model(q, k, v)
    torch.testing.assert_close(compiled, eager, atol=1e-2, rtol=1e-2)
    dout = torch.randn_like(eager)
    for g, e in zip(torch.autograd.grad(compiled, (q, k, v), dout), torch.autograd.grad(eager, (q, k, v), dout)):
        torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)


def test_transformers_model_runs_on_the_kernels(target, monkeypatch):
    transformers = pytest.importorskip("transformers")  # the device machine may lack the test extra
    import autoflash.hf

    LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM

    autoflash.hf.register()
    cfg = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    ours = LlamaForCausalLM._from_config(LlamaConfig(**cfg), attn_implementation=autoflash.hf.NAME,
                                         dtype=torch.bfloat16).to(device(target)).eval()
    theirs = LlamaForCausalLM._from_config(LlamaConfig(**cfg), attn_implementation="sdpa",
                                           dtype=torch.bfloat16).to(device(target)).eval()
    theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 256, (2, 200 if target == "gpu" else 70), device=device(target))
    with torch.no_grad():
        got, want = ours(ids).logits.float(), theirs(ids).logits.float()
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)
    monkeypatch.delenv(dispatch.STRICT_ENV)  # generation may hand over a mask (then SDPA, with a warning)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dispatch.FallbackWarning)
        assert ours.generate(ids[:1, :20], max_new_tokens=8, do_sample=False).shape == (1, 28)
