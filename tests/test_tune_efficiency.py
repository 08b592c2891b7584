"""The search-efficiency benchmark (autoflash.tuning.efficiency) on a small real space: one key whose
space is narrowed to num_stages=2 and num_warps=4, compiled with NVRTC once (cached on disk) and
measured in process by the simulated backend's cost model."""
import dataclasses
import json
import math

import optuna
import pytest

from autoflash.kernels.gpus import get_profile
from autoflash.tuning.problem import ProblemKey
from autoflash.tuning import efficiency
from autoflash.tuning.efficiency import InProcessPool, exhaustive, feasible_for, first_within, search, summarise
from autoflash.tuning.runner import prepare_spaces, spaces_for
from autoflash.tuning.simulated import TIMINGS_FORMAT, TIMINGS_VERSION, SimulatedBackend, model_ms

KEY = ProblemKey("a100", "fwd", "fp16", 64, False, "le4k")
CLI = ["--gpu", "a100", "--directions", "fwd", "--dtypes", "fp16", "--head-dims", "64", "--causal", "off",
       "--seqlen-buckets", "le4k", "--space", "num_stages=2", "--space", "num_warps=4", "--jobs", "1",
       "--no-progress"]
RESTRICT = {"num_stages": (2,), "num_warps": (4,)}  # ~20 NVRTC compiles on a cold cache (~1.3 s each)


@pytest.fixture(autouse=True)
def _quiet_optuna():
    optuna.logging.set_verbosity(optuna.logging.ERROR)


@pytest.fixture(scope="module")
def space():
    profile = get_profile("a100")
    spaces = prepare_spaces([KEY], profile, restrict=RESTRICT, jobs=1, progress=False)
    default, candidates = spaces_for(spaces, KEY)
    feasible = feasible_for(KEY, candidates, None)
    assert len(feasible) >= 5 and default.name in {c.config.name for c in feasible}
    assert len(feasible) < len(candidates) or all(c.ok for c in candidates)
    return profile, default, candidates, feasible


# ------------------------------------------------------------------ the pure parts
def test_first_within_counts_measurements_to_the_target():
    assert first_within([10.0, 8.0, 3.05, 2.9], best=3.0) == 3  # 3.05 <= 3.09
    assert first_within([10.0, 3.1, 3.0], best=3.0) == 3  # 3.1 > 3.09: not yet
    assert first_within([3.0], best=3.0) == 1
    assert first_within([math.inf, None, 5.0, 1.0], best=1.0) == 4  # failed measurements still count
    assert first_within([10.0, 3.1, 3.0], best=3.0, within=0.05) == 2
    assert first_within([10.0, 3.2, 3.1], best=3.0) is None  # never within 3%
    assert first_within([], best=3.0) is None


def test_summarise_median_worst_and_gate():
    s = summarise([1, 2, 3], total=10, fraction=0.30)
    assert (s["median_n"], s["worst_n"], s["median_fraction"], s["pass"]) == (2, 3, 0.2, True)
    s = summarise([2, 4, 9, 9], total=20, fraction=0.30)
    assert (s["median_n"], s["worst_n"], s["median_fraction"], s["pass"]) == (6.5, 9, 0.325, False)
    s = summarise([1, None, None], total=10, fraction=0.30)  # never reached counts as infinite
    assert (s["median_n"], s["worst_n"], s["median_fraction"], s["pass"]) == (None, None, None, False)
    assert s["n"] == [1, None, None]
    s = summarise([1, 1, None], total=10, fraction=0.30)
    assert (s["median_n"], s["worst_n"], s["pass"]) == (1, None, True)


# ------------------------------------------------------------------ against the real space
def test_exhaustive_best_is_the_minimum_of_the_cost_model(space):
    profile, _, candidates, feasible = space
    assert {c.config.name for c in feasible} == {c.config.name for c in candidates if c.ok}
    independent = {c.config.name: sum(model_ms(c.config, s, profile, c.registers) for s in KEY.shapes())
                   for c in candidates if c.ok}
    ranked = exhaustive(KEY, feasible, SimulatedBackend("a100"))
    assert [name for name, _ in ranked] == sorted(independent, key=lambda n: (independent[n], n))
    assert ranked[0][1] == pytest.approx(min(independent.values()), rel=1e-12)
    assert all(ms == pytest.approx(independent[name], rel=1e-12) for name, ms in ranked)


def test_in_process_pool_measures_every_feasible_config_once(space):
    _, default, _, feasible = space
    backend = SimulatedBackend("a100")
    pool = InProcessPool(backend)
    values = search(KEY, default, feasible, backend, "random", 0, pool=pool)  # seeded: it covers the space
    assert pool.measures == len(values) == len(feasible)  # the budget is the whole feasible space
    assert sorted(values) == pytest.approx(sorted(ms for _, ms in exhaustive(KEY, feasible, backend)))


def test_search_stops_at_the_target_and_counts_what_it_measured(space):
    _, default, _, feasible = space
    backend = SimulatedBackend("a100")
    ranked = exhaustive(KEY, feasible, backend)
    target = 1.03 * ranked[0][1]
    for sampler in ("tpe", "random"):
        pool = InProcessPool(backend)
        values = search(KEY, default, feasible, backend, sampler, 1, stop_at=target, pool=pool)
        assert pool.measures == len(values) >= 1
        assert values[-1] <= target and all(v > target for v in values[:-1])
        assert first_within(values, ranked[0][1]) == len(values)
        assert values[0] == pytest.approx(dict(ranked)[default.name])  # the default is measured first


# ------------------------------------------------------------------ the command
def test_cli_writes_json_and_exit_status_follows_the_gate(tmp_path, capsys):
    out = tmp_path / "eff.json"
    rc = efficiency.main([*CLI, "--seeds", "3", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["backend"] == "simulated cost model"
    assert report["settings"]["seeds"] == 3 and report["settings"]["samplers"] == ["tpe", "random"]
    (row,) = report["keys"]
    assert row["key"] == KEY.slug and row["feasible"] >= 5 and 1 <= row["within_tolerance"] <= row["feasible"]
    for name in ("tpe", "random"):
        s = row["samplers"][name]
        assert len(s["n"]) == 3 and all(1 <= n <= row["feasible"] for n in s["n"])
        assert s["worst_n"] == max(s["n"]) and s["median_fraction"] == pytest.approx(s["median_n"] / row["feasible"])
    assert report["gate"]["pass"] == row["samplers"]["tpe"]["pass"]
    assert rc == (0 if report["gate"]["pass"] else 1)
    printed = capsys.readouterr().out
    assert "simulated cost model" in printed and KEY.label in printed
    # No search reaches the target in 0.1% of the evaluations: the gate fails.
    assert efficiency.main([*CLI, "--seeds", "1", "--samplers", "tpe", "--fraction", "0.001"]) == 1


def test_cli_replays_recorded_timings_over_the_recorded_feasible_configs(tmp_path, space):
    profile, default, _, feasible = space
    recorded = [c for c in feasible if c.config.name != default.name][:4]
    timings = {c.config.name: [model_ms(c.config, s, profile, c.registers) for s in KEY.shapes()]
               for c in [*recorded, next(c for c in feasible if c.config.name == default.name)]}
    timings["fwd_hd64_fp16_m999n1w1s1"] = [0.001, 0.001]  # not a feasible config: never counted
    path = tmp_path / "timings.json"
    path.write_text(json.dumps({"format": TIMINGS_FORMAT, "version": TIMINGS_VERSION, "gpu": "a100",
                                "timings": {KEY.slug: timings}, "sdpa_flash": {}}))
    out = tmp_path / "eff.json"
    efficiency.main([*CLI, "--seeds", "2", "--timings", str(path), "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["backend"] == f"recorded timings {path}"
    (row,) = report["keys"]
    assert row["feasible"] == 5
    assert row["best_ms"] == pytest.approx(min(sum(ms) for name, ms in timings.items() if "m999" not in name))


def test_cli_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        efficiency.main(["--help"])
    assert e.value.code == 0
    assert "not a gpu measurement" in capsys.readouterr().out.replace("\n", " ").lower()
    with pytest.raises(SystemExit) as e:
        efficiency.main([*CLI, "--seeds", "0"])
    assert e.value.code == 2 and "got 0" in capsys.readouterr().err
    path = tmp_path / "timings.json"
    path.write_text(json.dumps({"format": TIMINGS_FORMAT, "version": TIMINGS_VERSION, "gpu": "h100", "timings": {}}))
    with pytest.raises(SystemExit) as e:
        efficiency.main([*CLI, "--timings", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "got gpu 'h100'" in err and "expected 'a100'" in err


# ------------------------------------------------------------------ variant keys
from autoflash.kernels.config import KernelConfig  # noqa: E402
from autoflash.tuning.space import Candidate  # noqa: E402

WINDOW = ProblemKey("a100", "fwd", "bf16", 128, True, "le1k", "window")
CAUSAL = ProblemKey("a100", "fwd", "bf16", 128, True, "le1k")
TILES = ((64, 32, 4), (64, 64, 4), (128, 64, 8), (128, 128, 8), (128, 192, 8))  # (block_m, block_n, warps)


def _candidates(key):
    return [Candidate(KernelConfig(**key.config_fields(), block_m=m, block_n=n, num_warps=w), "ok", registers=200)
            for m, n, w in TILES]


def test_the_simulated_backend_ranks_a_window_key_on_its_band():
    backend = SimulatedBackend("a100")
    window, causal = dict(exhaustive(WINDOW, _candidates(WINDOW), backend)), \
        dict(exhaustive(CAUSAL, _candidates(CAUSAL), backend))
    plain_name = lambda name: name.replace("_br_win", "_causal")  # noqa: E731  (the same tiles)
    assert set(map(plain_name, window)) == set(causal)
    # a band of min(1024, seqlen / 4) keys: fewer key tiles per query block than causal's triangle
    assert all(ms < causal[plain_name(name)] for name, ms in window.items())
    # and wide key tiles overshoot it: the window's best tiles are not the causal key's
    best = lambda ranked: min(ranked, key=ranked.get)  # noqa: E731
    assert plain_name(best(window)) != best(causal)
    assert best(causal).endswith("n192w8s2") and "n192" not in best(window)


def test_the_cost_model_runs_the_keys_workload():
    profile = get_profile("a100")
    cfg = _candidates(WINDOW)[1].config
    shape = WINDOW.shapes()[0]
    banded = model_ms(cfg, shape, profile, 200, WINDOW.workload(shape))
    assert banded < model_ms(cfg, shape, profile, 200)  # without its workload: the whole (non-causal) square
    varlen = ProblemKey("a100", "fwd", "bf16", 128, True, "le1k", "varlen")
    packed = varlen.workload(varlen.shapes()[0])
    vcfg = KernelConfig(**varlen.config_fields(), block_m=64, block_n=64, num_warps=4)
    assert 0 < model_ms(vcfg, varlen.shapes()[0], profile, 200, packed) < model_ms(
        vcfg, varlen.shapes()[0], profile, 200, dataclasses.replace(packed, lengths=(packed.max_seqlen,) * len(
            packed.lengths)))  # random lengths up to the bucket's: less work than every sequence at the longest


@pytest.mark.parametrize("key", [WINDOW, ProblemKey("a100", "bwd", "fp16", 64, False, "le4k", "varlen")], ids=str)
def test_sdpa_flash_has_no_baseline_for_a_variant_key(key):
    answer = SimulatedBackend("a100").baseline(key, list(key.shapes()))
    assert answer["status"] == "unsupported" and "SDPA-flash" in answer["reason"]
