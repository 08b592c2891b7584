"""GPU profiles: the hardware numbers the tuner and code generator plan against, for known parts
by name and for the running device from its CUDA properties."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GpuProfile:
    name: str  # short key: "h100"
    description: str  # e.g. "NVIDIA H100 SXM5 80GB"
    compute_capability: tuple[int, int]
    arch: str  # NVRTC --gpu-architecture, e.g. "sm_90"
    sm_count: int
    smem_per_sm: int  # bytes
    smem_per_block_optin: int  # bytes, the opt-in maximum dynamic shared memory per block
    regs_per_sm: int  # 32-bit registers
    max_threads_per_sm: int
    peak_tflops_fp16: float  # dense tensor-core, FP32 accumulate (what attention uses)
    peak_tflops_bf16: float
    mem_bandwidth_gbs: float  # GB/s
    known: bool = True  # False for a profile synthesised from an unknown device

    def blocks_per_sm(self, smem_bytes: int, threads: int, registers: int | None = None) -> int:
        """Blocks of this shape resident on one SM, limited by shared memory (each block also takes
        the 1 KB the CUDA runtime reserves per block on sm_80 and newer: CUDA C++ Programming Guide,
        "Shared Memory", compute capability 8.x/9.x), threads, and registers when given (allocated
        per warp in units of 256)."""
        limits = [self.smem_per_sm // (smem_bytes + SMEM_RESERVED_PER_BLOCK), self.max_threads_per_sm // threads]
        if registers is not None:
            per_warp = -(-registers * 32 // 256) * 256
            limits.append(self.regs_per_sm // (per_warp * (threads // 32)))
        return max(0, min(limits))


SMEM_RESERVED_PER_BLOCK = 1024  # bytes the runtime keeps per resident block (sm_80+)
MIN_COMPUTE_CAPABILITY = (8, 0)  # the kernels use mma.sync bf16 and cp.async: Ampere and newer

# Per-compute-capability limits from the CUDA C++ Programming Guide, "Technical Specifications per
# Compute Capability": (smem per SM, max smem per block with opt-in, 32-bit regs per SM, threads
# per SM). Every profile below takes its limits from here. A profile synthesised for an unknown
# device uses the device's own properties and falls back to this table only for an attribute its
# torch build does not expose; the 8.7 row exists only for that fallback.
# 10.0 and 12.0: the guide's table (CUDA 13.x, "Memory Information per Compute Capability", as
# quoted; the page itself was not opened) gives 228 / 227 KB and 100 / 99 KB. The Blackwell Tuning
# Guide ("Occupancy") agrees on 228 / 227 KB and 99 KB per block, and gives 64 warps per SM on 10.0
# and 48 on 12.0. Its "shared memory capacity per SM is 128KB" for 12.0 is the unified L1/shared
# array (the RTX Blackwell whitepaper's "128 KB of L1/Shared Memory" per SM), not the shared-memory
# limit: an RTX 5090 reports 102,400 bytes of shared memory per multiprocessor (deviceQuery), as
# the table says, and CUTLASS's sm120_smem_capacity_bytes is 101,376 (99 KB).
_KB = 1024
_CC_LIMITS: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (8, 0): (164 * _KB, 163 * _KB, 65536, 2048),  # A100
    (8, 6): (100 * _KB, 99 * _KB, 65536, 1536),  # GA10x
    (8, 7): (164 * _KB, 163 * _KB, 65536, 1536),  # Jetson Orin
    (8, 9): (100 * _KB, 99 * _KB, 65536, 1536),  # Ada
    (9, 0): (228 * _KB, 227 * _KB, 65536, 2048),  # Hopper
    (10, 0): (228 * _KB, 227 * _KB, 65536, 2048),  # B200
    (12, 0): (100 * _KB, 99 * _KB, 65536, 1536),  # RTX 50xx
}


def _profile(name: str, description: str, cc: tuple[int, int], sm_count: int, fp16: float,
             bf16: float, bandwidth: float) -> GpuProfile:
    smem_sm, smem_block, regs, threads = _CC_LIMITS[cc]
    return GpuProfile(name, description, cc, f"sm_{cc[0]}{cc[1]}", sm_count, smem_sm, smem_block,
                      regs, threads, fp16, bf16, bandwidth)


# Peak TFLOPS are dense (vendor sheets headline the 2:4-sparse figure, twice these) with FP32
# accumulate. Datacenter parts run FP32 accumulate at the FP16-accumulate rate; GeForce parts at
# half of it, so their entries use the FP32-accumulate row of the whitepaper, not the headline.
PROFILES: dict[str, GpuProfile] = {p.name: p for p in (
    # NVIDIA A100 Tensor Core GPU datasheet, SXM4 80GB column: 312 TF FP16/BF16, 2,039 GB/s;
    # NVIDIA Ampere Architecture (GA100) whitepaper: 108 SMs.
    _profile("a100", "NVIDIA A100 SXM4 80GB", (8, 0), 108, 312.0, 312.0, 2039.0),
    # AWS-only GA102 part; NVIDIA publishes no datasheet. 80 SMs is what the device reports
    # (torch multi_processor_count on EC2 G5); 600 GB/s from the AWS G5 instance page. 70 TF is
    # the third-party spec-sheet figure (GA10x's 256 dense FP16 FMA/clk/SM with FP32 accumulate,
    # as on the RTX 3090, x 80 SMs x ~1.71 GHz); unconfirmed by NVIDIA.
    _profile("a10g", "NVIDIA A10G 24GB (AWS)", (8, 6), 80, 70.0, 70.0, 600.0),
    # NVIDIA L4 datasheet: 242 TF FP16/BF16 sparse -> 121 dense, 300 GB/s; 58 SMs (7,424 CUDA
    # cores at 128 per SM, NVIDIA Ada GPU architecture whitepaper).
    _profile("l4", "NVIDIA L4 24GB", (8, 9), 58, 121.0, 121.0, 300.0),
    # NVIDIA L40S datasheet: 362.05 TF FP16/BF16 dense (733 sparse), 864 GB/s; 142 SMs (18,176
    # CUDA cores at 128 per SM).
    _profile("l40s", "NVIDIA L40S 48GB", (8, 9), 142, 362.05, 362.05, 864.0),
    # NVIDIA Ampere GA102 GPU architecture whitepaper, Appendix A: 82 SMs, 936 GB/s; FP16 tensor
    # 142 TF with FP16 accumulate but 71 TF with FP32 accumulate; BF16 71 TF.
    _profile("rtx3090", "NVIDIA GeForce RTX 3090 24GB", (8, 6), 82, 71.0, 71.0, 936.0),
    # NVIDIA Ada GPU architecture whitepaper, Appendix A: 128 SMs, 1,008 GB/s; FP16 tensor 330.3 TF
    # with FP16 accumulate but 165.2 TF with FP32 accumulate; BF16 165.2 TF.
    _profile("rtx4090", "NVIDIA GeForce RTX 4090 24GB", (8, 9), 128, 165.2, 165.2, 1008.0),
    # NVIDIA H100 Tensor Core GPU architecture whitepaper and H100 datasheet, SXM5 column: 132 SMs,
    # 3,350 GB/s, 989.4 TF FP16/BF16 dense (the datasheet's 1,979 is with sparsity).
    _profile("h100", "NVIDIA H100 SXM5 80GB", (9, 0), 132, 989.4, 989.4, 3350.0),
    # Same sources, PCIe column: fewer SMs (114), HBM2e at 2,000 GB/s, 1,513 TF sparse -> 756 dense.
    # Its own entry: tiles tuned for 132 SMs and 3.35 TB/s are not the right ones here.
    _profile("h100-pcie", "NVIDIA H100 PCIe 80GB", (9, 0), 114, 756.0, 756.0, 2000.0),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM column: 4.8 TB/s, 1,979 TF FP16/BF16 sparse ->
    # 989.4 dense; the same GH100 configuration as H100 SXM5, so 132 SMs.
    _profile("h200", "NVIDIA H200 SXM 141GB", (9, 0), 132, 989.4, 989.4, 4800.0),
    # The four below were checked against the NVIDIA documents as they are quoted (tables copied
    # out by several independent readers) in stored public material; the PDFs themselves were not
    # opened. A figure NVIDIA does not publish says so.
    # NVIDIA Ampere GA102 GPU architecture whitepaper (v2), Table 3, RTX A6000 column: 84 SMs,
    # 768 GB/s; FP16 and BF16 tensor 154.8 TF dense with FP32 accumulate (309.6 sparse). The
    # professional part runs FP32 accumulate at the full rate, unlike the RTX 3090.
    _profile("a6000", "NVIDIA RTX A6000 48GB", (8, 6), 84, 154.8, 154.8, 768.0),
    # NVIDIA RTX 6000 Ada Generation datasheet: 18,176 CUDA cores and 568 Tensor Cores (142 SMs at
    # 128 and 4 per SM), 960 GB/s, "Tensor Performance" 1,457 TF, which is FP8 with sparsity. FP16
    # and BF16 dense with FP32 accumulate, at full rate on this professional part: NVIDIA's RTX
    # Blackwell PRO GPU architecture whitepaper, Table 4, is quoted as 364 dense / 728 sparse for
    # this card; the decimal, 364.2 (= 1,457 / 2 for sparsity / 2 for FP8 -> FP16, 364.25), is
    # the figure secondary sources give, not read in an NVIDIA table.
    _profile("rtx6000-ada", "NVIDIA RTX 6000 Ada Generation 48GB", (8, 9), 142, 364.2, 364.2, 960.0),
    # NVIDIA RTX Blackwell GPU architecture whitepaper (GB202), Table 3 / Appendix A, RTX 5090:
    # 170 SMs, 1,792 GB/s; FP16 and BF16 tensor 209.5 TF dense with FP32 accumulate (419 sparse;
    # FP16 with FP16 accumulate is 419 dense). The card reports 170 SMs (deviceQuery, torch).
    _profile("rtx5090", "NVIDIA GeForce RTX 5090 32GB", (12, 0), 170, 209.5, 209.5, 1792.0),
    # NVIDIA Blackwell datasheet, "Individual Blackwell GPU Specifications", HGX B200 column:
    # FP16/BF16 tensor 4.5 PF with sparsity (the sheet's footnote) -> 2,250 TF dense; 180 GB HBM3e
    # at 7.7 TB/s (the DGX B200 page's 64 TB/s for 8 GPUs would be 8 TB/s; this is the per-GPU row).
    # NVIDIA publishes no SM count for B200: 148 is what the device reports (torch
    # multi_processor_count at compute capability 10.0, as recorded in public Inductor-generated
    # kernels), not an NVIDIA figure. NVIDIA gives no rate for the warp-level mma.sync these kernels
    # issue on sm_100, so efficiencies measured against this Tensor Core peak may read low.
    _profile("b200", "NVIDIA B200 SXM 180GB", (10, 0), 148, 2250.0, 2250.0, 7700.0),
)}

# Device names (as torch.cuda.get_device_name() reports them, upper-cased) -> profile key, plus
# fields that differ for that variant. First match wins. The one mapping serves the running device
# (profile_from_properties, which also checks the compute capability) and names given by hand
# (get_profile, arch_for). NVL, Ti, "D" and laptop parts, GB200 (its own clocks and limits) and the
# RTX PRO 6000 Blackwell fall through on purpose: their SM counts and clocks differ enough that
# they should be measured, not assumed.
_NAME_RULES: tuple[tuple[re.Pattern[str], str, dict[str, Any]], ...] = tuple(
    (re.compile(pattern), key, overrides) for pattern, key, overrides in (
        (r"\bH100\b.*\bPCIE\b", "h100-pcie", {}),
        (r"\bH100\b(?!.*\bNVL\b)", "h100", {}),
        (r"\bH200\b(?!.*\bNVL\b)", "h200", {}),
        # A100 40GB (HBM2) and 80GB PCIe share the SXM4 80GB compute numbers but not its memory
        # bandwidth (A100 datasheet: 1,555 and 1,935 GB/s); the key stays "a100" for tuned tables.
        (r"\bA100\b.*\b40GB\b", "a100", {"description": "NVIDIA A100 40GB", "mem_bandwidth_gbs": 1555.0}),
        (r"\bA100\b.*\bPCIE\b", "a100",
         {"description": "NVIDIA A100 80GB PCIe", "mem_bandwidth_gbs": 1935.0}),
        (r"\bA100\b", "a100", {}),
        (r"\bA10G\b", "a10g", {}),
        (r"\bL4\b", "l4", {}),
        (r"\bL40S\b", "l40s", {}),
        (r"\bRTX 3090\b(?!\s*TI\b)", "rtx3090", {}),
        (r"\bRTX 4090\b(?!\s*(?:TI|D|LAPTOP)\b)", "rtx4090", {}),
        (r"\bA6000\b", "a6000", {}),  # "NVIDIA RTX A6000"
        (r"\bRTX 6000 ADA\b", "rtx6000-ada", {}),  # "NVIDIA RTX 6000 Ada Generation"; not Quadro RTX 6000
        (r"\bRTX 5090\b(?!\s*(?:D|LAPTOP)\b)", "rtx5090", {}),
        (r"\bB200\b", "b200", {}),  # "NVIDIA B200"; GB200 does not match
    )
)

# The --gpu-architecture values autoflash can target; each one compiles with NVRTC 13.x
# (nvrtcGetSupportedArchs lists 75..121; sm_75 is below MIN_COMPUTE_CAPABILITY, sm_101 is gone).
# NVRTC 12 (autoflash[cu12]) compiles a subset: 12.1 to 12.6 sm_80..sm_90a, 12.8 adds sm_100(a) and
# sm_120(a), 12.9 sm_103(a) and sm_121(a); no 12.x has sm_110(a) (Jetson Thor was sm_101 there).
# compiler.check_arch raises a ValueError naming the install for an arch the installed NVRTC lacks.
NVRTC_ARCHS: tuple[str, ...] = (
    "sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_100a", "sm_103",
    "sm_103a", "sm_110", "sm_110a", "sm_120", "sm_120a", "sm_121", "sm_121a",
)


def _match_name(device_name: str, cc: tuple[int, int] | None = None) -> GpuProfile | None:
    """The built-in profile for a device name as torch reports it (None when no rule matches, or
    when `cc` is given and differs from the profile's), with the variant's overrides applied."""
    upper = device_name.upper()
    for pattern, key, overrides in _NAME_RULES:
        if pattern.search(upper) and (cc is None or PROFILES[key].compute_capability == cc):
            return dataclasses.replace(PROFILES[key], **overrides) if overrides else PROFILES[key]
    return None


def _lookup(name: str) -> GpuProfile | None:
    key = name.strip().lower()
    return PROFILES[key] if key in PROFILES else _match_name(name.strip())


def get_profile(name: str) -> GpuProfile:
    """The built-in profile called `name`: a profile key (case-insensitive), e.g. "h100", or a device
    name as torch.cuda.get_device_name() reports it, e.g. "NVIDIA H100 80GB HBM3" (-> "h100") or
    "NVIDIA A100-SXM4-40GB" (-> "a100" with that variant's memory bandwidth)."""
    if not isinstance(name, str):
        raise TypeError(f"get_profile: got {name!r} ({type(name).__name__}), expected a str")
    profile = _lookup(name)
    if profile is None:
        raise ValueError(
            f"get_profile: got {name!r}, expected a profile name {sorted(PROFILES)} or the device name "
            f"torch reports for one of those parts (e.g. 'NVIDIA H100 80GB HBM3')"
        )
    return profile


def profile_arg(value: str) -> str:
    """argparse type for a --gpu option: `value` (a profile key or a device name as torch reports
    it, kept as given so a device variant keeps its numbers) once get_profile accepts it; argparse
    shows get_profile's error otherwise."""
    import argparse

    try:
        get_profile(value)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _slug(device_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "unknown-gpu"


def _limit(props: Any, attr: str, cc: tuple[int, int], column: int) -> int:
    # Older torch builds lack some of these attributes; the capability table fills the gap.
    value = getattr(props, attr, None)
    if value:
        return int(value)
    if cc not in _CC_LIMITS:
        raise ValueError(
            f"profile_from_properties: got no {attr} for compute capability {cc[0]}.{cc[1]}, "
            f"expected the properties to carry it (no table entry for that capability)"
        )
    return _CC_LIMITS[cc][column]


def profile_from_properties(props: Any) -> GpuProfile:
    """A profile for the device described by `props`, an object shaped like
    torch.cuda.get_device_properties(i). A recognised part (name and compute capability both match)
    gets its built-in profile with the device's own SM count; anything else gets a profile built
    from the properties, with known=False and peak throughput and bandwidth 0.0 (unknown)."""
    missing = [a for a in ("name", "major", "minor", "multi_processor_count") if not hasattr(props, a)]
    if missing:
        raise TypeError(
            f"profile_from_properties: got {type(props).__name__} without {missing}, expected an "
            f"object like torch.cuda.get_device_properties(i)"
        )
    device_name, cc = str(props.name), (int(props.major), int(props.minor))
    if cc < MIN_COMPUTE_CAPABILITY:
        raise ValueError(
            f"autoflash needs compute capability 8.0 or newer; got {cc[0]}.{cc[1]} for {device_name}"
        )
    sm_count = int(props.multi_processor_count)
    known = _match_name(device_name, cc)
    if known is not None:
        # Cut-down or binned parts report fewer SMs; the grid-size heuristics must see the truth.
        return dataclasses.replace(known, sm_count=sm_count)
    return GpuProfile(
        name=_slug(device_name),
        description=device_name,
        compute_capability=cc,
        arch=f"sm_{cc[0]}{cc[1]}",
        sm_count=sm_count,
        smem_per_sm=_limit(props, "shared_memory_per_multiprocessor", cc, 0),
        smem_per_block_optin=_limit(props, "shared_memory_per_block_optin", cc, 1),
        regs_per_sm=_limit(props, "regs_per_multiprocessor", cc, 2),
        max_threads_per_sm=_limit(props, "max_threads_per_multi_processor", cc, 3),
        peak_tflops_fp16=0.0,
        peak_tflops_bf16=0.0,
        mem_bandwidth_gbs=0.0,
        known=False,
    )


def detect(device: Any = None) -> GpuProfile:
    """The profile of a CUDA device (default: the current one), read through torch."""
    import torch  # deferred: listing or looking up profiles must not pay for importing torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, built "
            f"for CUDA {torch.version.cuda}); use get_profile(name) to plan for a GPU without one"
        )
    index = torch.cuda.current_device() if device is None else device
    return profile_from_properties(torch.cuda.get_device_properties(index))


def arch_for(name_or_arch: str) -> str:
    """The NVRTC --gpu-architecture for a profile name ("a100"), a device name as torch reports it
    ("NVIDIA B200") or an arch string ("sm_90a")."""
    if not isinstance(name_or_arch, str):
        raise TypeError(f"arch_for: got {name_or_arch!r} ({type(name_or_arch).__name__}), expected a str")
    key = name_or_arch.strip().lower()
    if key in NVRTC_ARCHS:
        return key
    profile = _lookup(name_or_arch)
    if profile is not None:
        return profile.arch
    raise ValueError(
        f"arch_for: got {name_or_arch!r}, expected a profile name {sorted(PROFILES)} (or the device name "
        f"torch reports for one) or an architecture {list(NVRTC_ARCHS)}"
    )
