"""GPU tier of the forward kernels: FlashAttention-3's accuracy rule against an fp32 reference
(hopper/test_flash_attn.py; autoflash.reference.forward.within_tolerance),
    max|out - ref32| <= 2 * max|out_torch_same_dtype - ref32| + 2 * max|ref' + 0.3 - 0.3 - ref'|,
ref' = ref32 rounded to the input dtype, and the LSE (fp32, which FA3's rule does not cover) within
2x PyTorch's + 1e-5, over FlashAttention's grid of head dims and (Lq, Lk) pairs; fp32 is held to an fp64 reference.
Each test runs on a CUDA GPU (skipped without one) and on the CPU emulator (`target`, conftest.py)."""
import pytest
import torch

from autoflash import KernelConfig, flash_forward
from autoflash.reference.forward import attention_ref, within_tolerance
from gpu_inputs import HEAD_DIMS, TORCH_DTYPES, accuracy_grid, batch, heads, make_qkv, pair_lengths


def assert_accurate(q, k, v, causal, config=None, scale=None):
    out, lse = flash_forward(q, k, v, causal=causal, config=config, scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    assert lse.shape == q.shape[:3] and out.device == q.device
    if q.dtype == torch.float32:  # fp32 is judged against fp64, with PyTorch's fp32 as the yardstick
        ref, ref_lse = attention_ref(q.double(), k.double(), v.double(), causal=causal, scale=scale)
        pt, pt_lse = attention_ref(q, k, v, causal=causal, scale=scale, upcast=False)
    else:
        ref, ref_lse = attention_ref(q, k, v, causal=causal, scale=scale)
        pt, pt_lse = attention_ref(q, k, v, causal=causal, scale=scale, upcast=False)
    ok, err, bound = within_tolerance(out, ref, pt)
    assert ok, f"out: max err {err:.3e} > bound {bound:.3e}"
    ok, err, bound = within_tolerance(lse, ref_lse, pt_lse, atol=1e-5)  # fp32: its rounding term + 1e-5
    assert ok, f"lse: max err {err:.3e} > bound {bound:.3e}"


@accuracy_grid
def test_forward_matches_reference(target, d, dtype, causal, head_kind, pair):
    lq, lk = pair_lengths(target, pair)
    hq, hkv = heads(target, head_kind)
    assert_accurate(*make_qkv(batch(target, 2), hq, hkv, lq, lk, d, TORCH_DTYPES[dtype], target=target), causal)


@pytest.mark.sweep
@pytest.mark.parametrize("lq, lk", [(113, 203), (256, 255)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_fp32_simt_path_matches_fp64(target, d, causal, lq, lk):
    if target == "gpu" and (lq, lk) == (256, 255):
        lq, lk = 1024, 1023
    assert_accurate(*make_qkv(batch(target, 2), *heads(target, "gqa"), lq, lk, d, torch.float32, target=target),
                    causal)


@pytest.mark.parametrize("config", [
    KernelConfig(64, "bf16", 64, 64, num_warps=4, num_stages=1),
    KernelConfig(64, "fp16", 64, 80, num_warps=2, num_stages=3),
    KernelConfig(96, "bf16", 128, 32, num_warps=4, num_stages=2),
    KernelConfig(40, "fp16", 128, 64, num_warps=8, num_stages=4),
    KernelConfig(128, "bf16", 64, 112, num_warps=4, num_stages=2, causal=True),
    KernelConfig(256, "fp16", 64, 64, num_warps=4, num_stages=1, causal=True),
    KernelConfig(72, "fp32", 64, 48, num_warps=4, num_stages=2, causal=True),
], ids=lambda c: c.name)
def test_explicit_configs(target, config):
    """Non-default tiles: stages 1..4, non-power-of-two block_n, head dims that pad to 16."""
    lq, lk = (301, 517) if target == "gpu" else (131, 217)
    q, k, v = make_qkv(batch(target, 2), *heads(target, "gqa"), lq, lk, config.head_dim,
                       TORCH_DTYPES[config.dtype], target=target)
    assert_accurate(q, k, v, config.causal, config=config)


@pytest.mark.parametrize("causal", [False, True])
def test_bshd_layout_scale_and_mqa(target, causal):
    lq, lk = (777, 333) if target == "gpu" else (177, 133)
    q, k, v = make_qkv(batch(target, 3), 8 if target == "gpu" else 3, 1, lq, lk, 128, torch.bfloat16,
                       layout="bshd", target=target)
    assert not q.is_contiguous()
    assert_accurate(q, k, v, causal, scale=0.3)


def test_single_key_and_single_query(target):
    assert_accurate(*make_qkv(1, 2, 2, 1, 1, 64, torch.float16, target=target), True)
    assert_accurate(*make_qkv(1, 2, 2, 5, 1, 64, torch.float16, target=target), True)  # every row sees key 0
    assert_accurate(*make_qkv(1, 2, 2, 1, 300, 64, torch.bfloat16, target=target), False)


@pytest.mark.gpu
def test_runs_on_the_current_stream_without_syncs():
    q, k, v = make_qkv(2, 4, 4, 1024, 1024, 64, torch.bfloat16)
    flash_forward(q, k, v)  # compile and load outside the measured region
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the side stream busy: a hidden sync would wait here
        done = torch.cuda.Event()
        out, _ = flash_forward(q, k, v)
        done.record()
        assert not done.query(), "flash_forward waited for the GPU (or ran on another stream)"
    torch.cuda.current_stream().wait_stream(side)
    ref, _ = attention_ref(q, k, v)
    pt, _ = attention_ref(q, k, v, upcast=False)
    assert within_tolerance(out, ref, pt)[0]


def test_bad_config_is_refused_before_launch(target):
    q, k, v = make_qkv(1, 2, 2, 64, 64, 64, torch.float16, target=target)
    with pytest.raises(ValueError, match="is for"):
        flash_forward(q, k, v, config=KernelConfig(128, "fp16", 64, 64))
    huge = KernelConfig(64, "fp16", 256, 256, num_warps=16, num_stages=4)
    if target == "gpu":
        props = torch.cuda.get_device_properties(0)
        limit = getattr(props, "shared_memory_per_block_optin", 0)
    else:
        from autoflash.kernels.gpus import get_profile
        from gpu_inputs import EMULATED_GPU

        limit = get_profile(EMULATED_GPU).smem_per_block_optin
    if limit and huge.smem_bytes > limit:
        with pytest.raises(ValueError, match="shared memory"):
            flash_forward(q, k, v, config=huge)
    assert_accurate(q, k, v, False)  # the CUDA context (or the emulator) is still healthy
