"""Tests for autoflash.kernels.gpus: profile table consistency, lookup, device mapping and arch strings."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from autoflash.kernels import gpus
from autoflash.kernels.gpus import PROFILES, GpuProfile, arch_for, detect, get_profile, profile_from_properties

KB = 1024
REQUIRED = ("a100", "a10g", "l4", "l40s", "rtx3090", "rtx4090", "h100", "h200")
# Programming-guide limits per compute capability: smem/SM, smem/block opt-in, threads/SM.
CC_LIMITS = {
    (8, 0): (167936, 166912, 2048),
    (8, 6): (102400, 101376, 1536),
    (8, 9): (102400, 101376, 1536),
    (9, 0): (233472, 232448, 2048),
}


def props(name, major, minor, sms, **extra):
    return SimpleNamespace(name=name, major=major, minor=minor, multi_processor_count=sms, **extra)


def full_props(name, major, minor, sms):
    smem_sm, smem_block, threads = CC_LIMITS[(major, minor)]
    return props(name, major, minor, sms, shared_memory_per_multiprocessor=smem_sm,
                 shared_memory_per_block_optin=smem_block, regs_per_multiprocessor=65536,
                 max_threads_per_multi_processor=threads)


# ---- the table ----------------------------------------------------------------------------------

def test_required_profiles_present():
    assert set(REQUIRED) <= set(PROFILES)


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
    ],
)
def test_datasheet_numbers(key, sms, bandwidth, fp16):
    p = PROFILES[key]
    assert (p.sm_count, p.mem_bandwidth_gbs, p.peak_tflops_fp16) == (sms, bandwidth, fp16)


def test_geforce_uses_fp32_accumulate_rate():
    # The FP16-accumulate headline would be twice these: 142 and 330.3 TFLOPS.
    assert PROFILES["rtx3090"].peak_tflops_fp16 < 100
    assert PROFILES["rtx4090"].peak_tflops_fp16 < 200


# ---- get_profile --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["h100", "H100", " h100 "])
def test_get_profile_case_insensitive(name):
    assert get_profile(name) is PROFILES["h100"]


def test_get_profile_unknown_lists_names():
    with pytest.raises(ValueError) as info:
        get_profile("v100")
    msg = str(info.value)
    assert "'v100'" in msg
    for key in REQUIRED:
        assert key in msg


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
    p = profile_from_properties(props("NVIDIA B200", 10, 0, 148))
    assert p.arch == "sm_100" and not p.known


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
