"""Tests for autoflash.kernels.gpus: profile table consistency, lookup, device mapping and arch strings."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import sampling

from autoflash.kernels import gpus
from autoflash.kernels.gpus import PROFILES, GpuProfile, arch_for, detect, get_profile, profile_from_properties

KB = 1024
REQUIRED = ("a100", "a10g", "l4", "l40s", "rtx3090", "rtx4090", "h100", "h200")
NEW = ("a6000", "rtx6000-ada", "rtx5090", "b200")
# Programming-guide limits per compute capability: smem/SM, smem/block opt-in, threads/SM.
CC_LIMITS = {
    (8, 0): (167936, 166912, 2048),
    (8, 6): (102400, 101376, 1536),
    (8, 9): (102400, 101376, 1536),
    (9, 0): (233472, 232448, 2048),
    (10, 0): (233472, 232448, 2048),  # 228 / 227 KB, 64 warps
    (12, 0): (102400, 101376, 1536),  # 100 / 99 KB, 48 warps (the RTX 5090 reports 102400)
}
REPO = Path(__file__).resolve().parents[1]


def props(name, major, minor, sms, **extra):
    return SimpleNamespace(name=name, major=major, minor=minor, multi_processor_count=sms, **extra)


def full_props(name, major, minor, sms):
    smem_sm, smem_block, threads = CC_LIMITS[(major, minor)]
    return props(name, major, minor, sms, shared_memory_per_multiprocessor=smem_sm,
                 shared_memory_per_block_optin=smem_block, regs_per_multiprocessor=65536,
                 max_threads_per_multi_processor=threads)


# ---- the table ----------------------------------------------------------------------------------

def test_required_profiles_present():
    assert set(REQUIRED) | set(NEW) <= set(PROFILES)


@pytest.mark.parametrize("key, cc, arch", [
    ("a6000", (8, 6), "sm_86"), ("rtx6000-ada", (8, 9), "sm_89"), ("rtx5090", (12, 0), "sm_120"),
    ("b200", (10, 0), "sm_100"),
])
def test_new_profiles_are_sane(key, cc, arch):
    p = PROFILES[key]
    assert p.compute_capability == cc and p.arch == arch and arch_for(key) == arch
    for field in ("sm_count", "smem_per_sm", "smem_per_block_optin", "regs_per_sm", "max_threads_per_sm",
                  "peak_tflops_fp16", "peak_tflops_bf16", "mem_bandwidth_gbs"):
        assert getattr(p, field) > 0, field
    assert p.smem_per_block_optin <= p.smem_per_sm
    assert p.smem_per_block_optin + gpus.SMEM_RESERVED_PER_BLOCK == p.smem_per_sm
    assert p.peak_tflops_fp16 == p.peak_tflops_bf16
    # the d128 bf16 forward default fits at least one block per SM
    from autoflash.kernels.defaults import default_config

    cfg = default_config(128, "bf16", False, p)
    assert p.blocks_per_sm(cfg.smem_bytes, cfg.threads) >= 1


@pytest.mark.parametrize("key", sorted(PROFILES))
def test_profile_fields_consistent(key):
    p = PROFILES[key]
    assert isinstance(p, GpuProfile)
    assert p.name == key and p.known
    major, minor = p.compute_capability
    assert p.arch == f"sm_{major}{minor}"
    assert p.arch in gpus.NVRTC_ARCHS
    assert (major, minor) >= (8, 0)
    assert (p.smem_per_sm, p.smem_per_block_optin, p.max_threads_per_sm) == CC_LIMITS[(major, minor)]
    assert 0 < p.smem_per_block_optin <= p.smem_per_sm
    assert p.regs_per_sm == 65536
    assert p.sm_count > 0
    assert p.peak_tflops_fp16 > 0 and p.peak_tflops_bf16 > 0 and p.mem_bandwidth_gbs > 0
    assert p.description


def test_profiles_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PROFILES["h100"].sm_count = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "key, sms, bandwidth, fp16",
    [
        ("a100", 108, 2039.0, 312.0),
        ("h100", 132, 3350.0, 989.4),
        ("h200", 132, 4800.0, 989.4),
        ("l4", 58, 300.0, 121.0),
        ("l40s", 142, 864.0, 362.05),
        ("a10g", 80, 600.0, 70.0),
        ("rtx3090", 82, 936.0, 71.0),
        ("rtx4090", 128, 1008.0, 165.2),
        ("a6000", 84, 768.0, 154.8),
        ("rtx6000-ada", 142, 960.0, 364.2),
        ("rtx5090", 170, 1792.0, 209.5),
        ("b200", 148, 7700.0, 2250.0),
    ],
)
def test_datasheet_numbers(key, sms, bandwidth, fp16):
    p = PROFILES[key]
    assert (p.sm_count, p.mem_bandwidth_gbs, p.peak_tflops_fp16) == (sms, bandwidth, fp16)


def test_geforce_uses_fp32_accumulate_rate():
    # The FP16-accumulate headline would be twice these: 142, 330.3 and 419 TFLOPS.
    assert PROFILES["rtx3090"].peak_tflops_fp16 < 100
    assert PROFILES["rtx4090"].peak_tflops_fp16 < 200
    assert PROFILES["rtx5090"].peak_tflops_fp16 < 300


def test_workstation_parts_run_fp32_accumulate_at_full_rate():
    # Same silicon as the GeForce part, per SM: the A6000 (GA102) twice the RTX 3090's rate per SM,
    # the RTX 6000 Ada (AD102) about the L40S's, not half of it.
    per_sm = {k: PROFILES[k].peak_tflops_fp16 / PROFILES[k].sm_count
              for k in ("a6000", "rtx3090", "rtx6000-ada", "l40s")}
    assert per_sm["a6000"] > 1.5 * per_sm["rtx3090"]
    assert abs(per_sm["rtx6000-ada"] / per_sm["l40s"] - 1) < 0.05


# ---- get_profile --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["h100", "H100", " h100 "])
def test_get_profile_case_insensitive(name):
    assert get_profile(name) is PROFILES["h100"]


@pytest.mark.parametrize("name", ["v100", "NVIDIA GeForce RTX 5090 D", "Tesla V100-SXM2-16GB", "", "sm_90"])
def test_get_profile_unknown_lists_names(name):
    with pytest.raises(ValueError) as info:
        get_profile(name)
    msg = str(info.value)
    assert repr(name) in msg
    listed = re.search(r"\[(.*?)\]", msg).group(1)
    assert sorted(k.strip(" '") for k in listed.split(",")) == sorted(PROFILES)


# What torch.cuda.get_device_name() reports on each part -> (profile, compute capability).
DEVICE_NAMES = [
    ("NVIDIA H100 80GB HBM3", "h100", (9, 0)),
    ("NVIDIA H100 PCIe", "h100-pcie", (9, 0)),
    ("NVIDIA H200", "h200", (9, 0)),
    ("NVIDIA A100-SXM4-80GB", "a100", (8, 0)),
    ("NVIDIA A100-SXM4-40GB", "a100", (8, 0)),
    ("NVIDIA A100-PCIE-40GB", "a100", (8, 0)),
    ("NVIDIA A100 80GB PCIe", "a100", (8, 0)),
    ("NVIDIA GeForce RTX 3090", "rtx3090", (8, 6)),
    ("NVIDIA GeForce RTX 4090", "rtx4090", (8, 9)),
    ("NVIDIA GeForce RTX 5090", "rtx5090", (12, 0)),
    ("NVIDIA RTX 6000 Ada Generation", "rtx6000-ada", (8, 9)),
    ("NVIDIA RTX A6000", "a6000", (8, 6)),
    ("NVIDIA B200", "b200", (10, 0)),
    ("NVIDIA L4", "l4", (8, 9)),
    ("NVIDIA L40S", "l40s", (8, 9)),
    ("NVIDIA A10G", "a10g", (8, 6)),
]


@pytest.mark.parametrize("name, key, cc", DEVICE_NAMES)
def test_device_names_map_to_profiles(name, key, cc):
    # one mapping for names given by hand and for the running device
    assert get_profile(name).name == key
    assert get_profile(name.upper()).name == get_profile(f"  {name.lower()} ").name == key
    assert arch_for(name) == PROFILES[key].arch
    running = profile_from_properties(props(name, *cc, PROFILES[key].sm_count))
    assert running.known and running == get_profile(name)


def test_device_name_variants_keep_their_overrides():
    assert get_profile("NVIDIA A100-SXM4-80GB") is PROFILES["a100"]
    assert get_profile("NVIDIA A100-SXM4-40GB").mem_bandwidth_gbs == 1555.0
    assert get_profile("NVIDIA A100 80GB PCIe").mem_bandwidth_gbs == 1935.0
    assert get_profile("NVIDIA H100 PCIe") is PROFILES["h100-pcie"]


@pytest.mark.parametrize("name, cc", [
    ("NVIDIA GeForce RTX 5090 D", (12, 0)), ("NVIDIA GeForce RTX 5090 D v2", (12, 0)),
    ("NVIDIA GeForce RTX 5090 Laptop GPU", (12, 0)), ("NVIDIA GB200", (10, 0)),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", (12, 0)), ("Quadro RTX 6000", (8, 9)),
    ("NVIDIA RTX 5000 Ada Generation", (8, 9)), ("NVIDIA RTX A5000", (8, 6)), ("NVIDIA H100 NVL", (9, 0)),
    ("NVIDIA H200 NVL", (9, 0)), ("NVIDIA L40", (8, 9)), ("NVIDIA A10", (8, 6)),
    ("NVIDIA GeForce RTX 4090 D", (8, 9)),
])
def test_similar_device_names_are_not_profiles(name, cc):
    with pytest.raises(ValueError, match="expected a profile name"):
        get_profile(name)
    with pytest.raises(ValueError):
        arch_for(name)
    assert not profile_from_properties(full_props(name, *cc, 100)).known


def test_get_profile_rejects_non_str():
    with pytest.raises(TypeError, match="expected a str"):
        get_profile(100)  # type: ignore[arg-type]


# ---- profile_from_properties --------------------------------------------------------------------

@pytest.mark.parametrize(
    "name, cc, sms, key",
    [
        ("NVIDIA H100 80GB HBM3", (9, 0), 132, "h100"),
        ("NVIDIA H100 PCIe", (9, 0), 114, "h100-pcie"),
        ("NVIDIA H200", (9, 0), 132, "h200"),
        ("NVIDIA A100-SXM4-80GB", (8, 0), 108, "a100"),
        ("NVIDIA A100-SXM4-40GB", (8, 0), 108, "a100"),
        ("NVIDIA A100 80GB PCIe", (8, 0), 108, "a100"),
        ("NVIDIA A10G", (8, 6), 80, "a10g"),
        ("NVIDIA L4", (8, 9), 58, "l4"),
        ("NVIDIA L40S", (8, 9), 142, "l40s"),
        ("NVIDIA GeForce RTX 3090", (8, 6), 82, "rtx3090"),
        ("NVIDIA GeForce RTX 4090", (8, 9), 128, "rtx4090"),
    ],
)
def test_known_devices_map_to_profiles(name, cc, sms, key):
    p = profile_from_properties(full_props(name, *cc, sms))
    assert p.name == key and p.known
    assert p.sm_count == sms
    assert p.peak_tflops_fp16 == PROFILES[key].peak_tflops_fp16
    assert p.arch == PROFILES[key].arch


def test_exact_match_returns_table_entry():
    assert profile_from_properties(full_props("NVIDIA H100 80GB HBM3", 9, 0, 132)) == PROFILES["h100"]
    # Only the name and capability are needed for a known part.
    assert profile_from_properties(props("NVIDIA L4", 8, 9, 58)) == PROFILES["l4"]


def test_a100_variants_keep_key_but_not_bandwidth():
    p40 = profile_from_properties(props("NVIDIA A100-SXM4-40GB", 8, 0, 108))
    pcie = profile_from_properties(props("NVIDIA A100 80GB PCIe", 8, 0, 108))
    assert p40.name == pcie.name == "a100"
    assert p40.mem_bandwidth_gbs == 1555.0 and pcie.mem_bandwidth_gbs == 1935.0
    assert p40.peak_tflops_bf16 == pcie.peak_tflops_bf16 == 312.0


def test_h100_pcie_is_not_the_sxm_profile():
    p = profile_from_properties(props("NVIDIA H100 PCIe", 9, 0, 114))
    assert p.name == "h100-pcie"
    assert p.mem_bandwidth_gbs < PROFILES["h100"].mem_bandwidth_gbs
    assert p.peak_tflops_fp16 < PROFILES["h100"].peak_tflops_fp16


def test_sm_count_comes_from_device():
    p = profile_from_properties(props("NVIDIA H100 80GB HBM3", 9, 0, 114))
    assert p.name == "h100" and p.sm_count == 114
    assert PROFILES["h100"].sm_count == 132  # the table is untouched


def test_name_match_with_wrong_capability_is_unknown():
    p = profile_from_properties(full_props("NVIDIA H100 80GB HBM3", 8, 9, 132))
    assert not p.known and p.name == "nvidia-h100-80gb-hbm3" and p.arch == "sm_89"


@pytest.mark.parametrize(
    "name", ["NVIDIA L40", "NVIDIA GeForce RTX 3090 Ti", "NVIDIA GeForce RTX 4090 Laptop GPU",
             "NVIDIA H100 NVL", "NVIDIA A1000"],
)
def test_similar_names_do_not_match(name):
    major, minor = (9, 0) if "H100" in name else (8, 6) if "3090" in name else (8, 9)
    p = profile_from_properties(full_props(name, major, minor, 100))
    assert not p.known


def test_unknown_sm89_card_is_synthesised_from_properties():
    p = profile_from_properties(
        props("NVIDIA GeForce RTX 4070 Ti SUPER", 8, 9, 66, shared_memory_per_multiprocessor=102400,
              shared_memory_per_block_optin=101376, regs_per_multiprocessor=65536,
              max_threads_per_multi_processor=1536)
    )
    assert p.name == "nvidia-geforce-rtx-4070-ti-super"
    assert p.description == "NVIDIA GeForce RTX 4070 Ti SUPER"
    assert p.known is False
    assert p.compute_capability == (8, 9) and p.arch == "sm_89"
    assert p.sm_count == 66
    assert (p.smem_per_sm, p.smem_per_block_optin, p.regs_per_sm, p.max_threads_per_sm) == (
        102400, 101376, 65536, 1536)
    assert (p.peak_tflops_fp16, p.peak_tflops_bf16, p.mem_bandwidth_gbs) == (0.0, 0.0, 0.0)


def test_unknown_card_properties_win_over_table():
    p = profile_from_properties(
        props("Some Future Part", 9, 0, 10, shared_memory_per_multiprocessor=4 * KB,
              shared_memory_per_block_optin=2 * KB, regs_per_multiprocessor=1234,
              max_threads_per_multi_processor=512)
    )
    assert (p.smem_per_sm, p.smem_per_block_optin, p.regs_per_sm, p.max_threads_per_sm) == (
        4 * KB, 2 * KB, 1234, 512)


def test_unknown_card_missing_attributes_fall_back_to_capability_table():
    p = profile_from_properties(props("Mystery Ampere", 8, 0, 7))
    assert (p.smem_per_sm, p.smem_per_block_optin, p.regs_per_sm, p.max_threads_per_sm) == (
        167936, 166912, 65536, 2048)
    assert p.name == "mystery-ampere" and p.arch == "sm_80"


def test_unknown_capability_without_attributes_errors():
    with pytest.raises(ValueError, match="shared_memory_per_multiprocessor"):
        profile_from_properties(props("Mystery", 11, 5, 7))


def test_blackwell_arch_string():
    assert profile_from_properties(props("NVIDIA B200", 10, 0, 148)) == PROFILES["b200"]
    p = profile_from_properties(full_props("NVIDIA RTX PRO 6000 Blackwell Server Edition", 12, 0, 188))
    assert p.arch == "sm_120" and not p.known and p.smem_per_block_optin == 101376


def test_cc75_rejected():
    with pytest.raises(ValueError) as info:
        profile_from_properties(props("Tesla T4", 7, 5, 40))
    msg = str(info.value)
    assert "compute capability 8.0 or newer" in msg and "7.5" in msg and "Tesla T4" in msg


def test_properties_without_required_attributes():
    with pytest.raises(TypeError, match="multi_processor_count"):
        profile_from_properties(SimpleNamespace(name="x", major=9, minor=0))


# ---- detect -------------------------------------------------------------------------------------

def test_detect_without_cuda_raises(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="^no CUDA device: "):
        detect()


def test_detect_reads_device_properties(monkeypatch):
    torch = pytest.importorskip("torch")
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)

    def fake_props(index):
        seen.append(index)
        return full_props("NVIDIA H200", 9, 0, 132)

    monkeypatch.setattr(torch.cuda, "get_device_properties", fake_props)
    assert detect() == PROFILES["h200"]
    assert detect(0).name == "h200"  # device 0 is not "no device": it must not fall to current
    assert seen == [3, 0]


# ---- arch_for -----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "value, arch",
    [
        ("a100", "sm_80"), ("A10G", "sm_86"), ("l4", "sm_89"), ("h100", "sm_90"),
        ("h100-pcie", "sm_90"), ("h200", "sm_90"), ("rtx3090", "sm_86"), ("rtx4090", "sm_89"),
        ("sm_80", "sm_80"), ("sm_86", "sm_86"), ("sm_89", "sm_89"), ("sm_90a", "sm_90a"),
        ("SM_90A", "sm_90a"), ("sm_100", "sm_100"), ("sm_120", "sm_120"),
    ],
)
def test_arch_for(value, arch):
    assert arch_for(value) == arch


@pytest.mark.parametrize("value", ["sm_75", "sm_70", "compute_90", "90", "v100", "", "sm_101"])
def test_arch_for_rejects(value):
    with pytest.raises(ValueError) as info:
        arch_for(value)
    msg = str(info.value)
    assert repr(value) in msg and "h100" in msg and "sm_90a" in msg


def test_arch_for_rejects_non_str():
    with pytest.raises(TypeError):
        arch_for(90)  # type: ignore[arg-type]


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_head_dim_has_forward_and_backward_defaults(profile):
    """Every head dim the kernels take (32..256 in steps of 8, 224 of FlashAttention's grid included)
    gets a built-in forward and backward config that fits the profile, in every dtype."""
    from autoflash.kernels.config import HEAD_DIM_MAX, HEAD_DIM_MIN, HEAD_DIM_STEP
    from autoflash.kernels.defaults import default_backward_config, default_config

    p = PROFILES[profile]
    for d in range(HEAD_DIM_MIN, HEAD_DIM_MAX + 1, HEAD_DIM_STEP):
        for dtype in ("fp16", "bf16", "fp32"):
            for causal in (False, True):
                for cfg in (default_config(d, dtype, causal, p), default_backward_config(d, dtype, causal, p)):
                    assert (cfg.head_dim, cfg.dtype, cfg.causal) == (d, dtype, causal)
                    assert cfg.smem_bytes <= p.smem_per_block_optin, cfg.name


# ---- the new profiles compile, and the lists of names stay complete ----------------------------

@pytest.mark.parametrize("key", NEW)
def test_new_profile_defaults_compile_for_its_arch(key):
    """NVRTC builds the d64 bf16 forward and backward defaults for the profile's arch (no cache: a
    real compile); on sm_86 and sm_89, as on sm_80 and sm_90 (tests/test_compile.py), without spills."""
    from autoflash.kernels.compiler import compile_config
    from autoflash.kernels.defaults import default_backward_config, default_config

    p = PROFILES[key]
    for cfg in (default_config(64, "bf16", False, p), default_backward_config(64, "bf16", False, p)):
        assert cfg.smem_bytes <= p.smem_per_block_optin
        compiled = compile_config(cfg, p.arch, use_cache=False)
        assert compiled.cubin and 0 < compiled.resources.registers <= 255
        if p.arch in ("sm_86", "sm_89"):
            assert not compiled.resources.spills, (cfg.name, compiled.resources)


@pytest.mark.parametrize("key", ["b200", "rtx5090"])
def test_blackwell_d64_and_d128_forward_defaults_have_no_spills(key):
    # ptxas for sm_100 and sm_120 spills the 128 x 128 tile at d = 64 (and 128 x 64 causal at d = 128
    # on sm_100) that sm_80/sm_90 take: defaults.py gives Blackwell the next shape
    from autoflash.kernels.compiler import compile_config
    from autoflash.kernels.defaults import default_config

    p = PROFILES[key]
    for d, causal in ((64, False), (64, True), (128, True)):
        cfg = default_config(d, "bf16", causal, p)
        assert not compile_config(cfg, p.arch).resources.spills, cfg.name


_ROW = re.compile(r"^  (\w+)\s+(\d+)\s+([\d.]+)$")


# Two of the four per run (each compiles its narrowed space for its own arch, ~10-15 s), drawn from
# the seed; all four under AUTOFLASH_SWEEP=full.
DRY_RUN = sampling.sample(NEW, lambda k: k, 2, salt="new profiles")


@pytest.mark.parametrize("key", DRY_RUN)
def test_new_profile_tune_dry_run(key, capsys):
    """`python -m autoflash.tune --gpu KEY --dry-run` over a narrowed d64 bf16 forward space: every
    candidate is compiled for the profile's arch and the survivors fit its shared memory."""
    from autoflash.kernels.defaults import default_config
    from autoflash.tune import main

    assert main(["--gpu", key, "--dry-run", "--head-dims", "64", "--dtypes", "bf16", "--directions", "fwd",
                 "--causal", "off", "--space", "num_stages=2", "--space", "num_warps=4", "--space", "block_m=64",
                 "--no-progress", "--show-rejected", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    default = default_config(64, "bf16", False, PROFILES[key]).name
    assert f"{key} fwd bf16 d64 non-causal (default {default})" in out
    m = re.search(r"(\d+) of (\d+) candidates survive", out)
    rows = [_ROW.match(line).groups() for line in out.splitlines() if _ROW.match(line)]
    assert m and int(m.group(1)) == len(rows) > 0
    for name, regs, kib in rows:
        assert (name.startswith("fwd_hd64_bf16_m64") or name == default) and 0 < int(regs) <= 255
        assert float(kib) * 1024 <= PROFILES[key].smem_per_block_optin
    assert "needs the GPU" in out


def test_readme_lists_every_profile():
    text = " ".join((REPO / "README.md").read_text().split())
    m = re.search(r"GPU profiles \(`autoflash/kernels/gpus.py`\): (.*?), each with its sources", text)
    assert m, "README's GPU profile list not found"
    assert sorted(t.strip() for t in m.group(1).split(",")) == sorted(PROFILES)


def test_render_help_lists_every_profile():
    from autoflash.render import EPILOG

    m = re.search(r"GPU names: (.*?) \(or an arch", " ".join(EPILOG.split()))
    assert m and sorted(t.strip() for t in m.group(1).split(",")) == sorted(PROFILES)
