"""The tuner's search space and its hard constraints (shared memory, ptxas spills), on the CPU."""
import pytest

from autoflash.kernels.config import KernelConfig
from autoflash.kernels.gpus import get_profile
from autoflash.tuning.problem import ProblemKey
from autoflash.tuning import space
from autoflash.tuning.space import (ACCUMULATOR_REGISTER_LIMIT, ROWS_PER_WARP, Candidate, accumulator_registers,
                                    constrain, default_for, enumerate_space, param_values)

KEYS = [ProblemKey("h100", dr, dt, d, c, "le4k") for dr in ("fwd", "bwd") for dt in ("fp16", "bf16")
        for d in (64, 128, 256) for c in (False, True)]


@pytest.mark.parametrize("key", KEYS, ids=str)
def test_space_is_valid_plausible_and_starts_with_the_default(key):
    default = default_for(key, get_profile(key.gpu))
    configs = enumerate_space(key, default)
    assert configs[0] == default
    assert len({c.name for c in configs}) == len(configs)
    for c in configs[1:]:
        assert key.matches(c)
        if c.direction == "fwd":
            assert c.block_m // c.num_warps in ROWS_PER_WARP
        # backward: KernelConfig.backward_layout keeps dK, dV, S, dP within 192 registers a thread
        assert accumulator_registers(c) <= (ACCUMULATOR_REGISTER_LIMIT if c.direction == "fwd" else 192)
    assert len(configs) > 20


def test_space_has_tiles_that_are_not_powers_of_two():
    key = ProblemKey("h100", "fwd", "bf16", 64, False, "le1k")
    tiles = {c.block_n for c in enumerate_space(key)} | {c.block_m for c in enumerate_space(key)}
    assert {48, 80, 96, 112} <= tiles


def test_backward_space_covers_head_split():
    key = ProblemKey("a100", "bwd", "fp16", 128, True, "gt4k")
    # d = 128: slices of 64 or 32 columns (whole 8-chunk blocks or a power-of-two number of chunks)
    assert {c.head_split for c in enumerate_space(key)} == {1, 2, 4}


def test_over_budget_configs_are_never_compiled(monkeypatch):
    compiled = []
    monkeypatch.setattr(space, "_compile_one", lambda cfg, arch: compiled.append(cfg.name) or ("ok", "", 100, 0))
    a100 = get_profile("a100")
    key = ProblemKey("a100", "fwd", "bf16", 128, False, "le4k")
    configs = enumerate_space(key)
    cands = constrain(configs, a100, jobs=1)
    over = [c for c in cands if c.config.smem_bytes > a100.smem_per_block_optin]
    assert over and all(c.status == "smem" and "per block on a100" in c.reason for c in over)
    assert not {c.config.name for c in over} & set(compiled)
    assert len(compiled) == len(configs) - len(over)
    assert [c.config for c in cands] == configs  # one candidate per config, in order


def test_spilling_config_is_rejected_by_the_ptxas_report():
    # 128 x 128 with 4 warps at d = 56: 32 query rows a warp, 14 head-dim chunks of three block
    # widths, spill registers on sm_80 (the defaults take 128 x 64 there)
    spills = KernelConfig(head_dim=56, dtype="bf16", block_m=128, block_n=128, num_warps=4, num_stages=2)
    fits = KernelConfig(head_dim=128, dtype="bf16", block_m=128, block_n=64, num_warps=8, num_stages=2)
    bad, good = constrain([spills, fits], get_profile("a100"), jobs=1)
    assert bad.status == "spills" and "spill stores" in bad.reason and bad.spill_bytes > 0 and not bad.ok
    assert good.ok and 0 < good.registers <= 255 and good.spill_bytes == 0


def test_param_values_come_from_feasible_candidates_only():
    key = ProblemKey("h100", "fwd", "bf16", 128, False, "le4k")
    mk = lambda m, n, w: KernelConfig(head_dim=128, dtype="bf16", block_m=m, block_n=n, num_warps=w)  # noqa: E731
    cands = [Candidate(mk(128, 64, 8), "ok"), Candidate(mk(64, 48, 4), "ok"), Candidate(mk(128, 256, 8), "smem")]
    assert param_values(cands, key) == {"block_m": (64, 128), "block_n": (48, 64), "num_warps": (4, 8),
                                        "num_stages": (2,)}
