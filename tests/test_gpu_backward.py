"""GPU tier of the backward kernels: with g = randn_like(out), FlashAttention-3's gradient rule
(hopper/test_flash_attn.py; autoflash.reference.forward.within_tolerance(backward=True))
    max|dX - dX_ref32| <= 2 * max|dX_torch_same_dtype - dX_ref32| + 2 * max|r + 0.3 - 0.3 - r|
for dq, dk, dv, r = dX_ref32 rounded to the input dtype, over FlashAttention's grid; bit-identical
gradients with deterministic=True; no L x L memory at 16k.
Each test runs on a CUDA GPU (skipped without one) and, where it is not about the GPU's memory, on
the CPU emulator (`target`, conftest.py)."""
import pytest
import torch

import gpu_inputs
from autoflash import KernelConfig, flash_attn
from autoflash.reference.forward import within_tolerance
from autoflash.reference.backward import attention_backward_ref
from gpu_inputs import HEAD_DIMS, TORCH_DTYPES, accuracy_grid, batch, heads, pair_lengths


def make_qkv(*args, **kwargs):
    return gpu_inputs.make_qkv(*args, requires_grad=True, **kwargs)


def assert_gradients_accurate(q, k, v, causal, scale=None, **kw):
    out = flash_attn(q, k, v, causal=causal, scale=scale, **kw)
    g = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    for x, dx in ((q, dq), (k, dk), (v, dv)):
        assert dx.dtype == x.dtype and dx.shape == x.shape and dx.stride() == x.stride()
    ref = attention_backward_ref(q.detach(), k.detach(), v.detach(), g, causal=causal, scale=scale)
    pt = attention_backward_ref(q.detach(), k.detach(), v.detach(), g, causal=causal, scale=scale, upcast=False)
    for name, got, want, yard in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, pt):
        ok, err, bound = within_tolerance(got, want, yard, backward=True)
        assert ok, f"{name}: max err {err:.3e} > bound {bound:.3e}"


@accuracy_grid
def test_backward_matches_reference(target, d, dtype, causal, head_kind, pair):
    lq, lk = pair_lengths(target, pair)
    hq, hkv = heads(target, head_kind)
    assert_gradients_accurate(*make_qkv(batch(target, 2), hq, hkv, lq, lk, d, TORCH_DTYPES[dtype], target=target),
                              causal)


@pytest.mark.parametrize("config", [
    KernelConfig(64, "bf16", 64, 64, num_warps=4, num_stages=1, direction="bwd"),
    KernelConfig(96, "fp16", 32, 64, num_warps=4, num_stages=3, causal=True, direction="bwd"),
    KernelConfig(128, "bf16", 64, 128, num_warps=8, num_stages=2, causal=True, direction="bwd", head_split=4),
    KernelConfig(40, "fp16", 48, 32, num_warps=2, num_stages=2, direction="bwd"),
    KernelConfig(64, "bf16", 128, 128, num_warps=8, num_stages=2, causal=True, direction="bwd", dq="pass"),
    KernelConfig(128, "fp16", 64, 64, num_warps=8, num_stages=1, direction="bwd", v_in_regs=True),
], ids=lambda c: c.name)
def test_explicit_backward_configs(target, config):
    lq, lk = (301, 517) if target == "gpu" else (131, 217)
    q, k, v = make_qkv(batch(target, 2), *heads(target, "gqa"), lq, lk, config.head_dim, TORCH_DTYPES[config.dtype],
                       layout="bshd", target=target)
    assert_gradients_accurate(q, k, v, config.causal, backward_config=config)


@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_gradients_are_bit_identical(target, causal):
    b, hq, lq, lk = (2, 8, 1000, 1500) if target == "gpu" else (1, 4, 150, 230)
    q, k, v = make_qkv(b, hq, 2, lq, lk, 128, torch.bfloat16, target=target)
    g = torch.randn(b, hq, lq, 128, device=q.device, dtype=torch.bfloat16)
    first = None
    for _ in range(20):
        out = flash_attn(q, k, v, causal=causal, deterministic=True)
        grads = torch.autograd.grad(out, (q, k, v), g)
        if first is None:
            first = grads
        for a, b in zip(first, grads):
            assert torch.equal(a, b)
    assert_gradients_accurate(q, k, v, causal, deterministic=True)


@pytest.mark.gpu
def test_backward_adds_no_LxL_memory_at_16k():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, s, d = 1, 16, 16384, 128
    q, k, v = make_qkv(b, h, h, s, s, d, torch.bfloat16)
    g = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    inputs = 4 * q.numel() * q.element_size()  # q, k, v, g
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = flash_attn(q, k, v, causal=True)
    torch.autograd.grad(out, (q, k, v), g)
    torch.cuda.synchronize()
    ours = torch.cuda.max_memory_allocated() - base
    lxl = b * h * s * s * 2  # one bf16 score matrix
    print(f"peak extra memory: autoflash {ours / 2**20:.0f} MiB; one L x L bf16 matrix {lxl / 2**20:.0f} MiB")
    assert ours < lxl / 4 and ours < 4 * inputs
    try:  # SDPA's unfused math backend, for the comparison the issue asks to show
        del out
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        with sdpa_kernel(SDPBackend.MATH):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), g)
        print(f"SDPA math peak extra memory: {(torch.cuda.max_memory_allocated() - base) / 2**20:.0f} MiB")
    except torch.cuda.OutOfMemoryError:
        print("SDPA math: out of memory at this size")


def test_double_backward_is_refused_clearly(target):
    q, k, v = make_qkv(1, 2, 2, 64, 64, 64, torch.float16, target=target)
    out = flash_attn(q, k, v)
    with pytest.raises(RuntimeError, match="double backward .* not supported"):
        torch.autograd.grad(out.sum(), (q, k, v), create_graph=True)


@pytest.mark.sweep
@pytest.mark.parametrize("lq, lk", [(113, 203), (256, 255)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_fp32_simt_backward_matches_fp64(target, d, causal, lq, lk):
    """fp32 gradients against autograd through an fp64 reference, PyTorch fp32 as the yardstick."""
    if target == "gpu" and (lq, lk) == (256, 255):
        lq, lk = 1024, 1023
    q, k, v = make_qkv(batch(target, 2), *heads(target, "gqa"), lq, lk, d, torch.float32, target=target)
    out = flash_attn(q, k, v, causal=causal)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref = attention_backward_ref(q.detach().double(), k.detach().double(), v.detach().double(), g.double(),
                                 causal=causal)
    pt = attention_backward_ref(q.detach(), k.detach(), v.detach(), g, causal=causal, upcast=False)
    for name, got, want, yard in zip(("dq", "dk", "dv"), grads, ref, pt):
        ok, err, bound = within_tolerance(got, want, yard, backward=True)
        assert ok, f"{name}: max err {err:.3e} > bound {bound:.3e}"
