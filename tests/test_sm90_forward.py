"""The sm90 forward family (templates/flash_fwd_sm90.cu.j2: wgmma, TMA, mbarriers, a producer
warpgroup beside 1-3 consumer warpgroups, setmaxnreg, pingpong and intra-warpgroup overlap) on the
host emulator as an H100: over a grid in the shape of FlashAttention's tests (head dims 64-256,
causal in both alignments, MHA/GQA/MQA, lengths that are not multiples of the tiles, Lq > Lk), and
the variants (windows, softcap, ALiBi, a key bias, packed sequences) over the same head dims and
schedules, under FlashAttention-3's rule, and sanitized; the entry points, explain and the config's
refusals; the ptxas gate on
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
from autoflash.kernels.launch import flash_backward, flash_forward
from autoflash.reference.forward import attention_ref, attention_varlen_ref, within_tolerance

from gpu_inputs import device
from variant_inputs import SM90_VARIANT_PAIRS as VARIANT_PAIRS, VARIANTS, arguments

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


# The variants (tests/variant_inputs.py) on the family's schedules: every head dim FlashAttention-3
# tests, the defaults and the three schedules above, dense batches of two (batch 1 of "padding" sees no
# key at all) and packed sequences.
@pytest.mark.sweep
@pytest.mark.parametrize("pair", VARIANT_PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("variant", sorted(v for v in VARIANTS if not v.startswith("causal")))  # causal: above
def test_sm90_variant_forward_meets_flashattention_rule(target, variant, d, dtype, schedule, pair, launched):
    (lq, lk), spec = pair, VARIANTS[variant]
    if target == "gpu" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 family runs on sm_90 GPUs (H100, H200)")
    dev, dt = device(target), TORCH_DTYPES[dtype]
    g = torch.Generator().manual_seed(hash((variant, d, dtype, schedule, pair)) % 2**31)
    q = torch.randn(2, lq, 4, d, generator=g).to(dev, dt).transpose(1, 2)
    k, v = (torch.randn(2, lk, 2, d, generator=g).to(dev, dt).transpose(1, 2) for _ in range(2))
    kw = arguments(spec, 2, 4, lk, dev, g)
    cfg = sm90_config(d, dtype, bool(spec.get("causal") or spec.get("window")), schedule)  # the call sets the switches
    scale = 0.9 / math.sqrt(d)
    out, lse = flash_forward(q, k, v, scale=scale, config=cfg, **kw)
    # one key: a window reaching past it is no window (kernels.variants.resolve drops the switch)
    assert launched[-1].family == "sm90" and (launched[-1].variants or lk == 1), launched[-1].name
    up = [t.float().cpu() for t in (q, k, v)]
    kw_cpu = {n: t.cpu() if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
    ref, ref_lse = attention_ref(*up, scale=scale, **kw_cpu)
    torch_out, _ = attention_ref(q.cpu(), k.cpu(), v.cpu(), scale=scale, upcast=False, **kw_cpu)
    ok, err, bound = within_tolerance(out.cpu(), ref, torch_out, softcap=kw.get("softcap", 0.0))
    assert ok, f"out: err {err:.3e} > bound {bound:.3e}"
    ok, err, _ = within_tolerance(lse.cpu(), ref_lse, ref_lse, atol=1e-3)
    assert ok, f"lse: err {err:.3e}"


@pytest.mark.sweep
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("variant", ["plain", "causal-br", "causal-tl", "window-5-3", "gemma", "chunk-causal"])
@pytest.mark.parametrize("used", [False, True], ids=["spans", "seqused"])
def test_sm90_varlen_forward_meets_flashattention_rule(target, variant, d, schedule, used, launched):
    """Packed sequences of random lengths, 0 and 1 among them and one longer than a tile, each against
    the reference of its own; what a TMA box reads past a sequence is never stored or seen. With
    seqused_q / seqused_k (FlashAttention-3's) a random prefix of each span is in use."""
    if target == "gpu" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 family runs on sm_90 GPUs (H100, H200)")
    dev, dt, n = device(target), torch.bfloat16, 5
    g = torch.Generator().manual_seed(hash((variant, d, schedule)) % 2**31)
    lens_q = [0, 1, 150] + torch.randint(2, 90, (n - 3,), generator=g).tolist()
    lens_k = [int(x) for x in torch.randint(0, 200, (n,), generator=g)]
    perm = torch.randperm(n, generator=g).tolist()
    lens_q, lens_k = [lens_q[i] for i in perm], [lens_k[i] for i in perm]
    q = torch.randn(sum(lens_q), 4, d, generator=g).to(dev, dt)
    k, v = (torch.randn(sum(lens_k), 2, d, generator=g).to(dev, dt) for _ in range(2))
    spec = {} if variant == "plain" else VARIANTS[variant]
    kw = arguments(spec, n, 4, 1, dev, g)
    cu = {name: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
          for name, lens in (("cu_seqlens_q", lens_q), ("cu_seqlens_k", lens_k))}
    if used:
        for name, lens in (("seqused_q", lens_q), ("seqused_k", lens_k)):
            cu[name] = torch.tensor([int(torch.randint(0, n + 1, (1,), generator=g)) for n in lens], dtype=torch.int32,
                                    device=dev)
    cfg = sm90_config(d, "bf16", bool(spec.get("causal") or spec.get("window")), schedule)
    out, lse = flash_forward(q, k, v, config=cfg, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), **cu, **kw)
    assert launched[-1].family == "sm90" and launched[-1].varlen, launched[-1].name
    cpu = {name: t.cpu() if isinstance(t, torch.Tensor) else t for name, t in {**cu, **kw}.items()}
    ref, ref_lse = attention_varlen_ref(*(t.float().cpu() for t in (q, k, v)), **cpu)
    torch_out, _ = attention_varlen_ref(q.cpu(), k.cpu(), v.cpu(), upcast=False, **cpu)
    ok, err, bound = within_tolerance(out.cpu(), ref, torch_out, softcap=kw.get("softcap", 0.0))
    assert ok, f"out: err {err:.3e} > bound {bound:.3e} (lengths q {lens_q}, k {lens_k})"
    ok, err, _ = within_tolerance(lse.cpu(), ref_lse, ref_lse, atol=1e-3)
    assert ok, f"lse: err {err:.3e} (lengths q {lens_q}, k {lens_k})"


@pytest.mark.parametrize("schedule", ["default", "released-first"])
def test_sm90_variants_are_clean_under_the_sanitizer(schedule):
    """The variant kernels on guard-banded inputs at an odd GQA shape: window, softcap and ALiBi at once;
    a key bias that leaves batch 1 no key; packed sequences (0 and 1 among them) with a window and
    softcap; the same with seqused_q / seqused_k and attention chunks; attention chunks under a window. No finding under either schedule, and every result
    within the rule."""
    from autoflash.emulation.guards import guarded_randn

    g = torch.Generator().manual_seed(5)
    q = guarded_randn(2, 4, 77, 64, torch.bfloat16, g, "bshd")
    k, v = (guarded_randn(2, 2, 133, 64, torch.bfloat16, g, "bshd") for _ in range(2))
    lens_q, lens_k = [0, 1, 70, 33, 90], [5, 1, 0, 80, 64]
    cu = {name: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
          for name, lens in (("cu_seqlens_q", lens_q), ("cu_seqlens_k", lens_k))}
    packed = [torch.randn(sum(n), h, 64, generator=g).bfloat16() for n, h in ((lens_q, 4), (lens_k, 2), (lens_k, 2))]
    used = {"seqused_q": torch.tensor([0, 1, 41, 33, 2], dtype=torch.int32),
            "seqused_k": torch.tensor([3, 0, 0, 80, 50], dtype=torch.int32)}
    calls = [((q, k, v), arguments(VARIANTS["gemma"], 2, 4, 133, "cpu", g), attention_ref),
             ((q, k, v), arguments(VARIANTS["padding"], 2, 4, 133, "cpu", g), attention_ref),
             (packed, dict(window=(20, 3), softcap=5.0, align="bottom_right", **cu), attention_varlen_ref),
             (packed, dict(causal=True, align="bottom_right", attention_chunk=24, **cu, **used), attention_varlen_ref),
             ((q, k, v), arguments(VARIANTS["chunk-window"], 2, 4, 133, "cpu", g), attention_ref)]
    emulation.clear_findings()
    with autoflash.emulate("h100", sanitize=True, schedule=schedule):
        results = [flash_forward(*inputs, max_seqlen_q=90, max_seqlen_k=80, **kw) if "cu_seqlens_q" in kw
                   else flash_forward(*inputs, **kw) for inputs, kw, _ in calls]
    assert [str(f) for f in emulation.findings()] == []
    for (out, lse), (inputs, kw, ref_of) in zip(results, calls):
        ref, ref_lse = ref_of(*(t.float() for t in inputs), **kw)
        torch_out, _ = ref_of(*inputs, upcast=False, **kw)
        ok, err, bound = within_tolerance(out, ref, torch_out, softcap=kw.get("softcap", 0.0))
        assert ok, f"out: err {err:.3e} > bound {bound:.3e} ({sorted(kw)})"
        assert within_tolerance(lse, ref_lse, ref_lse, atol=1e-3)[0]


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


def test_variant_calls_run_the_sm90_family_both_ways(launches):
    q = torch.randn(1, 2, 64, 128).bfloat16()
    bias = torch.zeros(1, 64)
    with autoflash.emulate("h100"):
        for kw in (dict(window=(8, 0)), dict(softcap=5.0), dict(alibi_slopes=torch.rand(2)), dict(key_bias=bias)):
            with pytest.raises(Exception):
                flash_forward(q, q, q, **kw)
            with pytest.raises(Exception):
                flash_backward(q, q, q, q, q, torch.zeros(1, 2, 64), **kw)
        with pytest.raises(Exception):
            flash_forward(q[..., :72].contiguous(), q[..., :72].contiguous(), q[..., :72].contiguous())
    with autoflash.emulate("a100"):
        with pytest.raises(Exception):
            flash_forward(q, q, q, window=(8, 0))
    assert [c.family for c in launches] == ["sm90", "sm90"] * 4 + ["sm80"] * 2
    assert [c.variants for c in launches[:8:2]] == [("window",), ("softcap",), ("alibi",), ("key_bias",)]
    assert [c.variants for c in launches[1:8:2]] == [("window",), ("softcap",), ("alibi",), ("key_bias",)]
    assert launches[0].name == "fwd_hd128_bf16_win_m128n128w8s2_sm90a_pp_ov"  # a window: the causal tiles


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
    assert "forward: fwd_hd128_bf16_cap_m128n176w8s2_sm90a_pp_ov" in softcap
    assert "backward: bwd_hd128_bf16_cap_m64n128w8s2_sm90a" in softcap and "family sm80" not in softcap
    packed, cu = torch.randn(100, 2, 128).bfloat16(), torch.tensor([0, 40, 100], dtype=torch.int32)
    varlen = str(autoflash.explain(autoflash.flash_attn_varlen_func, packed, packed, packed, cu, cu, 60, 60,
                                   window_size=(16, 0), gpu="h100"))
    assert "forward: fwd_hd128_bf16_br_win_varlen_m128n128w8s2_sm90a_pp_ov" in varlen
    # a window beside packed sequences at d = 128: two warpgroups sharing 64 keys (defaults._sm90_variant_tiles)
    assert "backward: bwd_hd128_bf16_br_win_varlen_m64n64w8s2_sm90a" in varlen and "family sm80" not in varlen


def test_an_sm90_config_is_refused_on_other_gpus():
    q = torch.randn(1, 2, 64, 128).bfloat16()
    cfg = default_config(128, "bf16", False, H100)
    with autoflash.emulate("a100"):
        with pytest.raises(ValueError, match="runs on sm_90 GPUs"):
            flash_forward(q, q, q, config=cfg)


@pytest.mark.parametrize("fields, text", [
    (dict(direction="bwd", head_dim=192), "192 \\(V\\) without dkv_split"),
    (dict(direction="bwd", block_n=96), "consumer warpgroups of 64 keys"),
    (dict(direction="bwd", pingpong=True), "the sm90 forward's schedule"),
    (dict(direction="bwd", head_dim=64, block_m=48), "block_m a multiple of 32"),
    (dict(dtype="fp32", block_m=128), "is fp16/bf16"),
    (dict(head_dim=72), "multiple of 16"),
    (dict(direction="bwd", dq="pass"), "the dQ pass"),
    (dict(kvcache=True, paged=True, gather=True, num_stages=1), "one stage would wait on itself"),
    (dict(direction="bwd", kvcache=True), "the decode switches"),
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
