"""The search space of one problem key: a comprehension over the template's knobs plus a filter, then
the hard constraints that cost no GPU time — the profile's shared memory per block, and, from an
NVRTC compile for the profile's arch, no register spills. The built-in default is always included."""
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
# Query rows of the forward's tile each warp owns. FA2 gives a warp 16 or 32 rows (128 x 8 warps,
# 128 x 4); 48 trades registers for fewer warps. (The backward's warp tiles come from
# KernelConfig.backward_layout.)
ROWS_PER_WARP = (16, 32, 48)
# ptxas allots at most 255 registers a thread; tiles whose fp32 accumulators alone take more than
# this many are certain to spill and are dropped before compiling.
ACCUMULATOR_REGISTER_LIMIT = 192


def knobs(key: ProblemKey) -> dict[str, tuple[int, ...]]:
    return BACKWARD_KNOBS if key.direction == "bwd" else FORWARD_KNOBS


def accumulator_registers(config: KernelConfig) -> int | None:
    """fp32 accumulator registers per thread of a tensor-core tile (None for the SIMT path).

    Forward: a warp's O (rows x d) and S (rows x block_n). Backward: a warp's tiles of dK and dV
    (keys x head dim) and of S and dP (queries x keys), from KernelConfig.backward_layout. 32
    threads share a warp's accumulators."""
    if not config.tensor_cores:
        return None
    if config.direction == "fwd":
        rows = config.block_m // config.num_warps
        return rows * (config.head_dim_padded + config.block_n) // 32
    lay = config.backward_layout
    return 2 * (lay.kv_elements + lay.s_elements) // 32


def _plausible(config: KernelConfig) -> bool:
    """The filter of the comprehension: a sensible warp layout and accumulators that can fit."""
    if not config.tensor_cores:
        return True
    if config.direction == "bwd":  # the layout already keeps accumulators within 192 registers
        return True
    rows = config.block_m // config.num_warps
    return rows in ROWS_PER_WARP and accumulator_registers(config) <= ACCUMULATOR_REGISTER_LIMIT


def enumerate_space(key: ProblemKey, default: KernelConfig | None = None) -> list[KernelConfig]:
    """Every valid, plausible KernelConfig for `key` (the default first when given), no duplicates.
    Each carries the key's fixed fields, the variant's switches included (ProblemKey.config_fields),
    so the compile check and spill pruning see the kernels that will run."""
    names = list(knobs(key))
    out: dict[str, KernelConfig] = {}
    if default is not None:
        out[default.name] = default
    for values in itertools.product(*knobs(key).values()):
        try:
            cfg = KernelConfig(**key.config_fields(), **dict(zip(names, values)))
        except ValueError:  # a combination the template does not accept
            continue
        if _plausible(cfg):
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
        return "compile", e.log.strip().splitlines()[-1] if e.log.strip() else str(e), None, None
    if res.spills:
        return ("spills", f"{res.spill_stores} bytes spill stores, {res.spill_loads} bytes spill loads",
                res.registers, res.spill_stores + res.spill_loads)
    return "ok", "", res.registers, 0


def constrain(configs: Iterable[KernelConfig], profile: GpuProfile, *, jobs: int | None = None,
              progress: Callable[[int, int], None] | None = None) -> list[Candidate]:
    """Applies the hard constraints: shared memory from the config's own model, then an NVRTC compile
    for the profile's arch (in `jobs` processes; compiles are cached on disk) rejecting spills.
    Returns one Candidate per config, in the order given. `progress(done, total)` after each."""
    configs = list(configs)
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


def default_for(key: ProblemKey, profile: GpuProfile) -> KernelConfig:
    """The built-in config for a key: what the dispatcher runs without a tuned table. A variant key
    takes the built-in tiles for kernels carrying variant switches (those the launcher picks when
    given no config: the plain first choices spill with the band's registers at some head dims,
    kernels.defaults) with the key's switches on (ProblemKey.config_fields). A window key picks its
    tiles as a causal one does, as the launcher does (a window skips key blocks too)."""
    from autoflash.kernels.defaults import default_backward_config, default_config

    pick = default_backward_config if key.direction == "bwd" else default_config
    base = pick(key.head_dim, key.dtype, key.causal, profile, variant=key.variant != "plain")
    return base.replace(**key.config_fields())


def param_values(candidates: Iterable[Candidate], key: ProblemKey) -> dict[str, tuple[int, ...]]:
    """The values each knob takes among the feasible candidates: the sampler's categorical choices."""
    feasible = [c.config for c in candidates if c.ok]
    return {k: tuple(sorted({getattr(c, k) for c in feasible})) for k in knobs(key)}
