"""The sm90 forward family (templates/flash_fwd_sm90.cu.j2: wgmma, TMA, mbarriers, a producer
warpgroup beside 1-3 consumer warpgroups, setmaxnreg, pingpong and intra-warpgroup overlap) on the
host emulator as an H100: over a grid in the shape of FlashAttention's tests (head dims 64-256,
causal in both alignments, MHA/GQA/MQA, lengths that are not multiples of the tiles, Lq > Lk), under
FlashAttention-3's rule; the entry points, explain and the config's refusals; the ptxas gate on
planted notices, and a planted missing wait under the sanitizer. Every sm90 default of the H100 and
H200 also runs under the sanitizer in tests/test_emulation.py (every default of every GPU) and
compiles through the gate in tests/test_compile.py (every default, no spills). The emulated grid is
sampled per run (tests/sampling.py); AUTOFLASH_SWEEP=full runs all of it."""
import math

import pytest
import torch

import autoflash
from autoflash import emulation
from autoflash.kernels.checks import TORCH_DTYPES
from autoflash.kernels.config import KernelConfig
from autoflash.kernels.defaults import default_config
from autoflash.kernels.gpus import get_profile
from autoflash.kernels.launch import flash_forward
from autoflash.reference.forward import attention_ref, within_tolerance

from gpu_inputs import device

# (Lq, Lk) from flash-attn's tests (tests/test_flash_attn.py), at sizes the emulator runs quickly;
# Lq > Lk too (bottom-right: rows that see no key)
PAIRS = ((113, 203), (1, 239), (256, 128))
HEADS = ((4, 2), (3, 1))  # GQA, MQA (MHA: the sanitizer test)
# Schedules beside the defaults: one to three consumer warpgroups, 1-3 stages, key tiles in steps
# of 16, pingpong and overlap on and off.
SCHEDULES = {
    "default": None,
    "wg1-n64-s1": dict(block_m=64, num_warps=4, block_n=64, num_stages=1, overlap=True),
    "wg2-n144-s3-pp": dict(block_m=128, num_warps=8, block_n=144, num_stages=3, pingpong=True),
    "wg3-n48-pp-ov": dict(block_m=192, num_warps=12, block_n=48, num_stages=2, pingpong=True, overlap=True),
}
H100 = get_profile("h100")


def sm90_config(d: int, dtype: str, causal: bool, schedule: str) -> KernelConfig:
    base = default_config(d, dtype, causal, H100)
    assert base.family == "sm90", base.name
    fields = SCHEDULES[schedule]
    if fields is None:
        return base
    fields = {"pingpong": False, "overlap": False, **fields}
    try:
        cfg = base.replace(**fields)
    except ValueError as e:  # three consumer warpgroups above d = 128
        pytest.skip(str(e))
    if cfg.smem_bytes > H100.smem_per_block_optin:
        pytest.skip(f"{cfg.name} needs {cfg.smem_bytes} bytes of shared memory")
    return cfg


def check(out, lse, q, k, v, causal, align, scale):
    up = [t.float() for t in (q, k, v)]
    ref, ref_lse = attention_ref(*up, causal=causal, align=align, scale=scale)
    torch_out, _ = attention_ref(q, k, v, causal=causal, align=align, scale=scale, upcast=False)
    assert not torch.isnan(out).any(), "unwritten (poisoned) or NaN output"
    ok, err, bound = within_tolerance(out, ref, torch_out)
    assert ok, f"out: err {err:.3e} > bound {bound:.3e}"
    ok, err, _ = within_tolerance(lse, ref_lse, ref_lse, atol=1e-3)  # fp32 LSE: a fixed bound
    assert ok, f"lse: err {err:.3e}"


@pytest.mark.sweep
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}-{h[1]}")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_sm90_forward_meets_flashattention_rule(target, d, dtype, causal, schedule, heads, pair):
    (hq, hkv), (lq, lk) = heads, pair
    is_causal, align = causal != "none", "bottom_right" if causal == "bottom_right" else "top_left"
    if target == "gpu" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 family runs on sm_90 GPUs (H100, H200)")
    cfg = sm90_config(d, dtype, is_causal, schedule)
    dev, dt = device(target), TORCH_DTYPES[dtype]
    g = torch.Generator().manual_seed(hash((d, dtype, causal, schedule, heads, pair)) % 2**31)
    # BSHD storage (flash-attn's layout) seen as BHSD: the TMA maps take any 16-byte strides
    q = torch.randn(1, lq, hq, d, generator=g).to(dev, dt).transpose(1, 2)
    k, v = (torch.randn(1, lk, hkv, d, generator=g).to(dev, dt).transpose(1, 2) for _ in range(2))
    scale = 0.9 / math.sqrt(d)
    out, lse = flash_forward(q, k, v, causal=is_causal, align=align, scale=scale, config=cfg)
    check(out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu(), is_causal, align, scale)


def _sm90_defaults():
    return sorted({default_config(d, dt, c, get_profile(gpu))
                   for gpu in ("h100", "h200") for d in (64, 96, 128, 192, 256) for dt in ("bf16",)
                   for c in (False, True)}, key=lambda c: c.name)


def test_the_entry_points_run_the_sm90_family_on_an_emulated_h100(launches):
    from autoflash import flash_attn_func

    q, kv = torch.randn(1, 2, 64, 128).bfloat16(), torch.randn(1, 2, 96, 128).bfloat16()
    fq, fkv = q.transpose(1, 2), kv.transpose(1, 2)  # flash-attn's (batch, seqlen, heads, d)
    with autoflash.emulate("h100"):
        for call in (lambda: autoflash.attention(q, kv, kv, is_causal=True),
                     lambda: flash_attn_func(fq, fkv, fkv, causal=True),
                     lambda: flash_attn_func(fq, fkv, fkv)):
            with pytest.raises(Exception, match="_sm90a"):
                call()
    assert [c.family for c in launches] == ["sm90"] * 3
    assert launches[1].align == "bottom_right"  # flash-attn's causal


def test_variants_and_other_gpus_run_the_sm80_family(launches):
    q = torch.randn(1, 2, 64, 128).bfloat16()
    with autoflash.emulate("h100"):
        with pytest.raises(Exception):
            flash_forward(q, q, q, window=(8, 0))
        with pytest.raises(Exception):
            flash_forward(q[..., :72].contiguous(), q[..., :72].contiguous(), q[..., :72].contiguous())
    with autoflash.emulate("a100"):
        with pytest.raises(Exception):
            flash_forward(q, q, q)
    assert [c.family for c in launches] == ["sm80"] * 3


def test_explain_names_the_family_and_why_not(launches):
    q = torch.randn(1, 2, 64, 128).bfloat16()
    plain = str(autoflash.explain(q, q, q, gpu="h100"))
    # both directions on the family (d = 128; the backward's since tests/test_sm90_backward.py)
    assert "family: sm90 (FlashAttention-3 design" in plain
    assert all("_sm90a" in line for line in plain.splitlines() if line.startswith(("forward:", "backward:")))
    q96 = torch.randn(1, 64, 2, 96).bfloat16()  # both directions on the family (padded head-dim rows)
    d96 = str(autoflash.explain(autoflash.flash_attn_func, q96, q96, q96, gpu="h100"))
    assert "backward: bwd_hd96_bf16_m96n128w8s2_sm90a" in d96 and "family sm80" not in d96
    q72 = torch.randn(1, 64, 2, 72).bfloat16()
    d72 = str(autoflash.explain(autoflash.flash_attn_func, q72, q72, q72, gpu="h100"))
    assert d72.count("family sm80 on this sm_90 GPU: head dim 72 is not a multiple of 16") == 2
    softcap = str(autoflash.explain(autoflash.flash_attn_func, q.transpose(1, 2), q.transpose(1, 2),
                                    q.transpose(1, 2), softcap=5.0, gpu="h100"))
    assert "family sm80 on this sm_90 GPU: softcap run on the sm80 family" in softcap


def test_an_sm90_config_is_refused_on_other_gpus():
    q = torch.randn(1, 2, 64, 128).bfloat16()
    cfg = default_config(128, "bf16", False, H100)
    with autoflash.emulate("a100"):
        with pytest.raises(ValueError, match="runs on sm_90 GPUs"):
            flash_forward(q, q, q, config=cfg)


@pytest.mark.parametrize("fields, text", [
    (dict(direction="bwd", head_dim=192), "head_dim=192 without dkv_split"),
    (dict(direction="bwd", block_n=96), "consumer warpgroups of 64 keys"),
    (dict(direction="bwd", pingpong=True), "the sm90 forward's schedule"),
    (dict(direction="bwd", head_dim=64, block_m=48), "block_m a multiple of 32"),
    (dict(dtype="fp32", block_m=128), "is fp16/bf16"),
    (dict(head_dim=72), "multiple of 16"),
    (dict(window=True), "window"),
    (dict(block_m=96, num_warps=6), "num_warps"),
    (dict(block_m=64, num_warps=4, pingpong=True), "pingpong takes turns"),
])
def test_the_family_refuses_what_it_does_not_run(fields, text):
    base = dict(head_dim=128, dtype="bf16", block_m=128, block_n=128, num_warps=8, family="sm90")
    with pytest.raises(ValueError, match=text):
        KernelConfig(**{**base, **fields})


def test_names_round_trip():
    for cfg in _sm90_defaults() + [default_config(128, "bf16", True, H100).replace(pingpong=False, overlap=False,
                                                                                   align="bottom_right")]:
        assert KernelConfig.from_name(cfg.name) == cfg
        assert KernelConfig.from_dict(cfg.to_dict()) == cfg


def test_the_gate_refuses_serialization_notices():
    from autoflash.kernels.compiler import CompileError, Compiled, Resources, sm90_gate

    cfg = default_config(128, "bf16", False, H100)
    clean = Resources(168, 0, 0, 0, 0)
    log = "ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized"
    with pytest.raises(CompileError, match="C7511"):
        sm90_gate(Compiled(cfg.name, "sm_90a", None, clean, log), cfg)
    with pytest.raises(CompileError, match="spill"):
        sm90_gate(Compiled(cfg.name, "sm_90a", None, Resources(255, 8, 8, 0, 0), ""), cfg)
    sm90_gate(Compiled(cfg.name, "sm_90a", None, clean, "ptxas info    : Used 168 registers"), cfg)


def test_a_planted_missing_wait_is_a_finding(mutate):
    """The sanitizer sees what the schedule relies on: without the wait for V, P V reads a stage the
    TMA load has not filled."""
    cfg = default_config(64, "bf16", False, H100)
    mutate("fwd", "mbarrier_wait(bar(&smem.full_v[last]), ((n_tiles - 1) / STAGES) & 1);", "")
    q = torch.randn(1, 1, 64, 64).bfloat16()
    emulation.clear_findings()
    with autoflash.emulate("h100", sanitize=True):
        flash_forward(q, q, q, config=cfg)
    found = [(f.kind, f.detail, f.location) for f in emulation.findings()]
    assert any(k in ("uninitialized", "async") and "flash_fwd_sm90.cu.j2" in loc for k, d, loc in found), found


def test_the_tuner_checks_sm90_candidates_on_the_emulator(target):
    """The tuner's CUDA backend runs each candidate on its check problem under FlashAttention-3's rule
    before timing it: on an emulated H100 it runs the sm90 family's kernels from the key's space."""
    from autoflash.tuning.cuda_backend import CudaBackend
    from autoflash.tuning.problem import ProblemKey
    from autoflash.tuning.space import default_for, enumerate_space

    if target == "gpu":
        from autoflash.kernels.gpus import detect

        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the sm90 family runs on sm_90 GPUs (H100, H200)")
        backend, profile = CudaBackend(detect().name), detect()
    else:
        from autoflash.emulation import active

        backend, profile = object.__new__(CudaBackend), active().profile
        backend.torch, backend._inputs, backend._cu_seqlens, backend._flush, backend.device = torch, {}, {}, None, "cpu"
    key = ProblemKey(profile.name, "fwd", "bf16", 64, True, "le1k")
    space = [c for c in enumerate_space(key, default_for(key, profile)) if c.family == "sm90"]
    picks = [space[0]] + [c for c in space if c.num_warps == 12 and c.pingpong][:1] + \
        [c for c in space if c.num_warps == 4 and not c.overlap][:1]
    assert len(picks) == 3 and all(c.family == "sm90" for c in picks)
    for cfg in picks:
        assert backend._check(key, cfg) is None, cfg.name
