"""The search space of one problem key: a comprehension over the template's knobs plus a filter, then
the hard constraints that cost no GPU time — the profile's shared memory per block, and, from an
NVRTC compile for the profile's arch, no register spills. The built-in default is always included.

A decode key's points are DecodePoints: a KV-cache KernelConfig and a run-time num_splits (not a
KernelConfig field), constrained through every kernel the point may launch (split and unsplit)."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import multiprocessing
import os
from typing import Callable, Iterable

from autoflash.kernels.config import KernelConfig
from autoflash.kernels.gpus import GpuProfile
from autoflash.tuning.problem import ProblemKey

# The values each knob may take. Tiles need not be powers of two (48, 80, 96, 112, 160, 192 are
# legal); the filter below keeps the combinations the template accepts.
FORWARD_KNOBS = {
    "block_m": (32, 64, 96, 128, 192, 256),
    "block_n": (32, 48, 64, 80, 96, 112, 128, 160, 192, 256),
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2, 3),
}
BACKWARD_KNOBS = {
    "block_m": (16, 32, 64, 128),
    "block_n": (32, 64, 128),
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2),
    "head_split": (1, 2, 4),
    "dq": ("atomic", "pass"),  # dQ by atomics in the dK/dV kernel, or a second kernel without them
    "v_in_regs": (False, True),  # V's fragments held in registers (spill-pruned where they do not fit)
}
# Decode (KV-cache) keys: few query rows (Lq x the GQA group: 4 to 32 when timed), so narrow query
# tiles and few warps are worth trying; key tiles up to FlashAttention-2's split-KV 256 (96 and 192
# do not divide a page of 256 and are pruned for paged keys); num_splits 0 is the run-time heuristic
# (kernels.decode.choose_num_splits, the built-in default's), 1 no split, up to 32 ways.
DECODE_KNOBS = {
    "block_m": (16, 32, 64),
    "block_n": (32, 64, 96, 128, 192, 256),
    "num_warps": (1, 2, 4),
    "num_stages": (1, 2, 3),
    "num_splits": (0, 1, 2, 4, 8, 16, 32),
}
# Query rows of the forward's tile each warp owns. FA2 gives a warp 16 or 32 rows (128 x 8 warps,
# 128 x 4); 48 trades registers for fewer warps. (The backward's warp tiles come from
# KernelConfig.backward_layout.)
ROWS_PER_WARP = (16, 32, 48)
# ptxas allots at most 255 registers a thread; tiles whose fp32 accumulators alone take more than
# this many are certain to spill and are dropped before compiling.
ACCUMULATOR_REGISTER_LIMIT = 192


# The sm90 family's forward on sm_90 GPUs (kernels/config.FAMILIES): 1-3 consumer warpgroups of 64
# query rows (block_m = 16 * num_warps, so block_m is no knob of its own: point_of derives it), key
# tiles in steps of 16 up to 256, two or three TMA stages (FA3 runs two; one would serialize the
# loads with the GEMMs), pingpong and overlap.
SM90_FORWARD_KNOBS = {
    "family": ("sm90",),
    "block_n": tuple(range(64, 257, 16)),
    "num_warps": (4, 8, 12),
    "num_stages": (2, 3),
    "pingpong": (False, True),
    "overlap": (False, True),
}
# The sm90 family's backward on sm_90 GPUs (defaults.sm90_backward_applies): 1-2 consumer warpgroups
# of 64 keys (block_n = 16 * num_warps), or two sharing 64 keys with dK and dV split between them
# (block_n 64 with 8 warps: KernelConfig.dkv_split, the one layout above d = 128); query steps of 32
# to 128 (multiples of 16: the RS k steps; of 32 where two warpgroups split dQ^T's or S^T's
# columns), one or two Q/dO stages (FA3 runs two; d = 256 fits one).
SM90_BACKWARD_KNOBS = {
    "family": ("sm90",),
    "block_m": (32, 48, 64, 80, 96, 112, 128),
    "block_n": (64, 128),
    "num_warps": (4, 8),
    "num_stages": (1, 2),
}
# The sm90 family's KV-cache kernel on sm_90 GPUs (defaults._sm90_decode_config): one or two consumer
# warpgroups of 64 rows (a decode step's rows are few: the built-in takes one), key tiles in steps of 16
# up to 176, two to four TMA stages (decoding streams the cache: depth keeps its loads in flight),
# overlap on or off, and the same split counts as the sm80 family's.
SM90_DECODE_KNOBS = {
    "family": ("sm90",),
    "block_n": tuple(range(32, 177, 16)),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4),
    "overlap": (False, True),
    "num_splits": DECODE_KNOBS["num_splits"],
}
# Registers a consumer thread keeps beside its accumulators (descriptors, softmax state, addresses).
SM90_OVERHEAD_REGISTERS = 40


def knob_sets(key: ProblemKey) -> list[dict[str, tuple]]:
    """The product spaces whose union is the key's space: one per kernel family it may run on (the
    sm90 family besides sm80, forward, backward and the KV cache, on an sm_90 GPU where sm90_applies)."""
    from autoflash.kernels.defaults import sm90_applies, sm90_backward_applies
    from autoflash.kernels.gpus import get_profile

    if key.is_decode:  # the sm90 KV-cache kernel beside the sm80 one where the sm90 forward applies
        return [DECODE_KNOBS, SM90_DECODE_KNOBS] if sm90_applies(key.head_dim, key.dtype, get_profile(key.gpu)) \
            else [DECODE_KNOBS]
    if key.direction == "bwd":
        if sm90_backward_applies(key.head_dim, key.dtype, get_profile(key.gpu)):  # it takes every variant too
            return [BACKWARD_KNOBS, SM90_BACKWARD_KNOBS]
        return [BACKWARD_KNOBS]
    if sm90_applies(key.head_dim, key.dtype, get_profile(key.gpu)):  # the sm90 forward takes every variant
        return [FORWARD_KNOBS, SM90_FORWARD_KNOBS]
    return [FORWARD_KNOBS]


def family_of(space: dict[str, tuple]) -> str:
    """The kernel family a knob set builds (KernelConfig's default, sm80, where it names none)."""
    return space.get("family", ("sm80",))[0]


def knobs(key: ProblemKey) -> dict[str, tuple]:
    """Each knob's values over the key's spaces (what --space may restrict)."""
    merged: dict[str, list] = {}
    for space in knob_sets(key):
        for k, values in space.items():
            merged.setdefault(k, [])
            merged[k] += [v for v in values if v not in merged[k]]
    return {k: tuple(v) for k, v in merged.items()}


SPLITS_TAG = ":splits"  # a DecodePoint's name: <kernel name>:splits<n>


@dataclasses.dataclass(frozen=True)
class DecodePoint:
    """One point of a decode key's space: the KV-cache kernel (split off: flash_decode turns it on
    for num_splits > 1) and num_splits (0 = the heuristic). Reads as its config for every other
    attribute (block_n, smem_bytes, ...), so the study handles it as it does a KernelConfig; its
    name tells the points of one kernel apart."""

    config: KernelConfig
    num_splits: int

    def __post_init__(self) -> None:
        if not isinstance(self.config, KernelConfig) or not self.config.kvcache or self.config.split:
            raise ValueError(f"DecodePoint.config: got {getattr(self.config, 'name', self.config)!r}, expected an "
                             f"unsplit KV-cache KernelConfig")
        if isinstance(self.num_splits, bool) or not isinstance(self.num_splits, int) or self.num_splits < 0:
            raise ValueError(f"DecodePoint.num_splits: got {self.num_splits!r}, expected an int >= 0 (0 chooses)")

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "config":  # copy/pickle probes, and no recursion before init
            raise AttributeError(name)
        return getattr(self.config, name)

    @property
    def name(self) -> str:
        return f"{self.config.name}{SPLITS_TAG}{self.num_splits}"

    @property
    def kernels(self) -> tuple[KernelConfig, ...]:
        """The kernels the point may launch: unsplit for 1 split, split for more, both for 0 (the
        heuristic picks per call)."""
        split = self.config.replace(split=True)
        return {0: (self.config, split), 1: (self.config,)}.get(self.num_splits, (split,))

    @classmethod
    def from_name(cls, name: str) -> "DecodePoint":
        kernel, sep, n = name.partition(SPLITS_TAG)
        if not sep or not n.isdigit():
            raise ValueError(f"decode point {name!r} not understood; expected '<kernel name>{SPLITS_TAG}<n>'")
        return cls(KernelConfig.from_name(kernel), int(n))


def point_of(key: ProblemKey, values: dict):
    """The KernelConfig (or, for a decode key, DecodePoint) of knob values for `key`; ValueError when
    the template does not take them."""
    values = dict(values)
    splits = values.pop("num_splits", None)
    if values.get("family") == "sm90" and "num_warps" in values:  # a warpgroup of 64 rows per 4 consumer warps:
        values.setdefault("block_m" if key.direction == "fwd" else "block_n", 16 * values["num_warps"])  # queries, keys
    cfg = KernelConfig(**key.config_fields(), **values)
    return DecodePoint(cfg, splits) if key.is_decode else cfg


def point_from_name(name: str):
    """A KernelConfig or DecodePoint from its name (what trials record)."""
    return DecodePoint.from_name(name) if SPLITS_TAG in name else KernelConfig.from_name(name)


def accumulator_registers(config: KernelConfig) -> int | None:
    """fp32 accumulator registers per thread of a tensor-core tile (None for the SIMT path).

    Forward: a warp's O (rows x d) and S (rows x block_n). Backward: a warp's tiles of dK and dV
    (keys x head dim) and of S and dP (queries x keys), from KernelConfig.backward_layout. 32
    threads share a warp's accumulators. The sm90 backward: a consumer warpgroup's dK, dV (64 keys x
    head dim) and S^T, dP^T (64 keys x block_m) over its 128 threads; with dkv_split half of that (one
    of dK^T, dV^T; S^T and dP^T for half the queries)."""
    if not config.tensor_cores:
        return None
    if config.family == "sm90" and config.direction == "bwd":  # block_n keys over the consumer warpgroups
        dim = config.head_rows if config.dkv_split else config.head_dim  # dK^T, dV^T by head-dim rows of 64
        return 2 * config.block_n * (dim + config.block_m) // (128 * config.consumer_groups)
    if config.direction == "fwd":
        rows = config.block_m // config.num_warps
        return rows * (config.head_dim_padded + config.block_n) // 32
    lay = config.backward_layout
    return 2 * (lay.kv_elements + lay.s_elements) // 32


def _plausible(config: KernelConfig) -> bool:
    """The filter of the comprehension: a sensible warp layout and accumulators that can fit (sm90:
    a consumer thread's accumulators within the registers setmaxnreg gives it)."""
    if not config.tensor_cores:
        return True
    if config.family == "sm90" and config.direction == "bwd":  # dK, dV; S^T, dP^T of a warpgroup
        return accumulator_registers(config) + SM90_OVERHEAD_REGISTERS <= config.consumer_registers
    if config.family == "sm90":  # O; S and P of 64 rows x block_n
        held = config.head_dim // 2 + config.block_n // 2 + config.block_n // 4
        return held + SM90_OVERHEAD_REGISTERS <= config.consumer_registers
    if config.direction == "bwd":  # the layout already keeps accumulators within 192 registers
        return True
    rows = config.block_m // config.num_warps
    return rows in ROWS_PER_WARP and accumulator_registers(config) <= ACCUMULATOR_REGISTER_LIMIT


def _page_fits(key: ProblemKey, cfg) -> bool:
    """A paged decode key's key tiles must divide the timed page size (kernels.decode.decode_config)."""
    from autoflash.tuning.decode import PAGE_SIZE

    return not (key.is_decode and key.paged and PAGE_SIZE % cfg.block_n)


def enumerate_space(key: ProblemKey, default: KernelConfig | None = None) -> list[KernelConfig]:
    """Every valid, plausible KernelConfig for `key` (the default first when given), no duplicates.
    Each carries the key's fixed fields, the variant's switches included (ProblemKey.config_fields),
    so the compile check and spill pruning see the kernels that will run. A decode key's are
    DecodePoints, a paged key's with key tiles dividing decode.PAGE_SIZE."""
    out: dict[str, KernelConfig] = {}
    if default is not None:
        out[default.name] = default
    for space in knob_sets(key):
        names = list(space)
        for values in itertools.product(*space.values()):
            try:
                cfg = point_of(key, dict(zip(names, values)))
            except ValueError:  # a combination the template does not accept
                continue
            if _plausible(cfg.config if key.is_decode else cfg) and _page_fits(key, cfg):
                out.setdefault(cfg.name, cfg)
    return list(out.values())


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One config after the constraints: status "ok" (compiled, no spills), "smem" (over the
    profile's shared memory per block), "spills" (ptxas spilled registers) or "compile" (NVRTC
    rejected it). registers and spill bytes are known once compiled."""

    config: KernelConfig
    status: str
    reason: str = ""
    registers: int | None = None
    spill_bytes: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def smem_bytes(self) -> int:
        return self.config.smem_bytes


def _compile_one(config: KernelConfig, arch: str) -> tuple[str, str, int | None, int | None]:
    from autoflash.kernels.compiler import CompileError, compile_config

    try:
        res = compile_config(config, arch).resources
    except CompileError as e:
        return "compile", e.reason, None, None
    if res.spills:
        return ("spills", f"{res.spill_stores} bytes spill stores, {res.spill_loads} bytes spill loads",
                res.registers, res.spill_stores + res.spill_loads)
    return "ok", "", res.registers, 0


def constrain(configs: Iterable[KernelConfig], profile: GpuProfile, *, jobs: int | None = None,
              progress: Callable[[int, int], None] | None = None) -> list[Candidate]:
    """Applies the hard constraints: shared memory from the config's own model, then an NVRTC compile
    for the profile's arch (in `jobs` processes; compiles are cached on disk) rejecting spills.
    Returns one Candidate per config, in the order given. `progress(done, total)` after each.
    DecodePoints pass when every kernel they may launch does (each kernel compiled once)."""
    configs = list(configs)
    points = [c for c in configs if isinstance(c, DecodePoint)]
    if points:
        return _constrain_points(configs, profile, jobs, progress)
    result: dict[str, Candidate] = {}
    to_compile = []
    for cfg in configs:
        if cfg.smem_bytes > profile.smem_per_block_optin:
            result[cfg.name] = Candidate(cfg, "smem", f"{cfg.smem_bytes} bytes of shared memory > "
                                         f"{profile.smem_per_block_optin} per block on {profile.name}")
        else:
            to_compile.append(cfg)
    total, done = len(configs), len(result)
    if progress:
        progress(done, total)
    jobs = max(1, jobs or os.cpu_count() or 1)
    if jobs == 1 or len(to_compile) <= 1:
        for cfg in to_compile:
            result[cfg.name] = Candidate(cfg, *_compile_one(cfg, profile.arch))
            done += 1
            if progress:
                progress(done, total)
    else:
        # spawn: the parent may hold a CUDA context, which a forked child must not inherit.
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_compile_one, cfg, profile.arch): cfg for cfg in to_compile}
            for fut in concurrent.futures.as_completed(futures):
                cfg = futures[fut]
                result[cfg.name] = Candidate(cfg, *fut.result())
                done += 1
                if progress:
                    progress(done, total)
    return [result[cfg.name] for cfg in configs]


def _constrain_points(configs: list, profile: GpuProfile, jobs: int | None, progress) -> list[Candidate]:
    kernels = {k.name: k for c in configs for k in (c.kernels if isinstance(c, DecodePoint) else (c,))}
    # progress in points, as the caller counts them
    scaled = (lambda done, total: progress(done * len(configs) // max(total, 1), len(configs))) if progress else None
    checked = {c.config.name: c for c in constrain(list(kernels.values()), profile, jobs=jobs, progress=scaled)}
    out = []
    for c in configs:
        cands = [checked[k.name] for k in (c.kernels if isinstance(c, DecodePoint) else (c,))]
        bad = next((k for k in cands if not k.ok), None)
        if bad is not None:
            out.append(Candidate(c, bad.status, f"{bad.config.name}: {bad.reason}", bad.registers, bad.spill_bytes))
        else:
            out.append(Candidate(c, "ok", "", max(k.registers for k in cands), 0))
    return out


def default_for(key: ProblemKey, profile: GpuProfile) -> KernelConfig:
    """The built-in config for a key: what the dispatcher runs without a tuned table, the kernel a
    call with the key's switches (ProblemKey.config_fields) gets from kernels.defaults.call_default,
    as the launcher asks it (a window key's tiles are a causal one's; a variant key on the sm80 family
    takes the tiles for kernels carrying variant switches). A decode key's is the KV-cache kernel
    flash_attn_with_kvcache runs untuned (kernels.defaults.default_decode_config, for pages of
    decode.PAGE_SIZE when paged) with num_splits 0 (the heuristic), a DecodePoint."""
    from autoflash.kernels.config import VARIANTS
    from autoflash.kernels.defaults import call_default, default_decode_config

    fields = key.config_fields()
    if key.is_decode:
        from autoflash.tuning.decode import PAGE_SIZE

        base = default_decode_config(key.head_dim, key.dtype, profile, PAGE_SIZE if key.paged else None)
        return DecodePoint(base.replace(**fields), 0)
    switches = {f: fields[f] for f in ("align", *VARIANTS)}
    return call_default(key.direction, key.head_dim, key.dtype, fields["causal"], switches, profile)


def param_values(candidates: Iterable[Candidate], key: ProblemKey) -> dict[str, dict[str, tuple]]:
    """The sampler's choices, per kernel family among the feasible candidates (sorted by name): each
    knob of that family's own set with the values its feasible candidates take. A knob of one family
    only (sm90's pingpong) is never offered with the other, so the sampler proposes no combination
    the template refuses for want of a family switch."""
    feasible = [c.config for c in candidates if c.ok]
    out = {}
    for space in knob_sets(key):
        family = family_of(space)
        mine = [c for c in feasible if c.family == family]
        if mine:
            out[family] = {k: tuple(sorted({getattr(c, k) for c in mine})) for k in space if k != "family"}
    return dict(sorted(out.items()))
