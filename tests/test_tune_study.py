"""The tuner's study loop on the simulated backend, in process: real worker subprocesses, real crashes
and timeouts, hand-made candidate lists (the constraints are tested in test_tune_space.py)."""
import json

import optuna
import pytest
from optuna.trial import TrialState

from autoflash.kernels.config import KernelConfig
from autoflash.tuning.problem import ProblemKey
from autoflash.tuning.space import Candidate, point_of
from autoflash.tuning.study import STALL_TRIALS, KeyStudy, Settings, is_measured
from autoflash.tuning.worker import WorkerPool

KEY = ProblemKey("h100", "fwd", "bf16", 128, True, "le4k")
DEFAULT = KernelConfig(head_dim=128, dtype="bf16", block_m=128, block_n=64, num_warps=8, num_stages=2, causal=True)


def _cfg(m, n, w, s=2):
    return KernelConfig(head_dim=128, dtype="bf16", block_m=m, block_n=n, num_warps=w, num_stages=s, causal=True)


FEASIBLE = [DEFAULT, _cfg(128, 32, 8), _cfg(128, 48, 8), _cfg(128, 96, 8), _cfg(64, 32, 4), _cfg(64, 48, 4),
            _cfg(64, 64, 4), _cfg(64, 96, 4)]
OVER_SMEM = _cfg(128, 128, 8, 3)  # 256 KiB > H100's 227
SPILLING = _cfg(128, 64, 4)


def _candidates():
    return ([Candidate(c, "ok", registers=200, spill_bytes=0) for c in FEASIBLE]
            + [Candidate(OVER_SMEM, "smem", "over shared memory"),
               Candidate(SPILLING, "spills", "ptxas spilled", registers=255, spill_bytes=64)])


def _events(log):
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture(autouse=True)
def _quiet_optuna():
    optuna.logging.set_verbosity(optuna.logging.ERROR)


def _study(tmp_path, faults=None, *, budget=len(FEASIBLE), sampler="bruteforce", workers=1, timeout=3.0,
           storage=None, seen=None):
    log = tmp_path / "measurements.jsonl"
    pool = WorkerPool({"backend": "simulated", "options": {"gpu": "h100", "faults": faults or {}, "log": str(log)}},
                      workers)
    pool.start()
    ks = KeyStudy(KEY, _candidates(), DEFAULT, storage=storage or f"sqlite:///{tmp_path / 's.db'}",
                  name=f"test/{KEY}", settings=Settings(budget=budget, sampler=sampler, timeout=timeout), pool=pool,
                  on_trial=(lambda t, ks: seen.append(t.number)) if seen is not None else None)
    return ks, pool, log


def test_default_first_and_constraints_respected(tmp_path):
    seen = []
    ks, pool, log = _study(tmp_path, sampler="tpe", budget=6, seen=seen)
    with pool:
        outcome = ks.run()
    starts = [e for e in _events(log) if e["event"] == "start"]
    assert starts[0]["config"] == DEFAULT.name  # the enqueued default is measured before anything else
    assert ks.trials()[0].user_attrs["config"] == DEFAULT.name
    feasible = {c.name for c in FEASIBLE}
    assert {e["config"] for e in starts} <= feasible  # nothing over budget or spilling is ever measured
    assert len(starts) == len({e["config"] for e in starts}) == outcome.evaluated == 6
    assert outcome.default is not None and outcome.ranked[0].value <= outcome.default.value
    pruned = [t for t in ks.trials() if t.state == TrialState.PRUNED]
    assert all(t.user_attrs.get("pruned") for t in pruned)  # every pruned trial says why
    assert seen  # the progress callback ran


def test_faults_are_recorded_and_the_study_finishes(tmp_path):
    faults = {"crash": [_cfg(64, 32, 4).name], "hang": [_cfg(64, 48, 4).name], "wrong": [_cfg(64, 64, 4).name],
              "error": [_cfg(64, 96, 4).name]}
    ks, pool, log = _study(tmp_path, faults, timeout=2.0)
    with pool:
        outcome = ks.run()
        assert pool.workers[0].restarts >= 2  # a fresh worker after the crash and after the hang
    by_config = {t.user_attrs["config"]: t for t in ks.trials() if "config" in t.user_attrs}
    expect = {_cfg(64, 32, 4).name: ("crash", "SIGABRT"), _cfg(64, 48, 4).name: ("timeout", "no answer within 2 s"),
              _cfg(64, 64, 4).name: ("wrong", "max error 0.5 > bound"),
              _cfg(64, 96, 4).name: ("error", "simulated launch failure")}
    for name, (kind, text) in expect.items():
        t = by_config[name]
        assert t.state == TrialState.FAIL and t.user_attrs["failure"] == kind and text in t.user_attrs["reason"], name
    assert by_config[_cfg(64, 64, 4).name].user_attrs["err"] == 0.5
    # every feasible config was tried exactly once, the four faulty ones failed, the rest ranked
    assert outcome.evaluated == len(FEASIBLE) and len(outcome.failed) == 4
    assert {t.user_attrs["config"] for t in outcome.ranked} == {c.name for c in FEASIBLE} - set(expect)
    assert outcome.sdpa_flash_ms is not None and outcome.sdpa_flash_ms > 0


def test_two_workers_measure_each_config_once(tmp_path):
    ks, pool, log = _study(tmp_path, workers=2, sampler="random", budget=7)
    with pool:
        outcome = ks.run()
    starts = [e for e in _events(log) if e["event"] == "start"]
    assert len({e["pid"] for e in starts}) == 2  # both workers measured
    assert len(starts) == len({e["config"] for e in starts})  # and no config twice
    assert 7 <= outcome.evaluated <= 8  # the budget, plus at most one trial in flight on the other worker


def test_rerun_of_a_finished_study_measures_nothing(tmp_path):
    ks, pool, log = _study(tmp_path, budget=4)
    with pool:
        first = ks.run()
    n = len(_events(log))
    ks2, pool2, _ = _study(tmp_path, budget=4)
    with pool2:
        second = ks2.run()
    assert len(_events(log)) == n  # nothing measured again, the SDPA baseline kept in the study
    assert [t.number for t in second.ranked] == [t.number for t in first.ranked]


def test_interrupted_trial_is_failed_and_requeued(tmp_path):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name=f"test/{KEY}", storage=storage, direction="minimize")
    # a trial some other process on this host started on FEASIBLE[3], then died (SIGKILL)
    (tmp_path / "probe").mkdir()
    probe, probe_pool, _ = _study(tmp_path / "probe", budget=1)
    probe_pool.close()
    study.enqueue_trial(probe.params_of(FEASIBLE[3]))
    dead = study.ask()
    assert point_of(KEY, probe.suggest(dead)) == FEASIBLE[3]  # as a worker asks it, from the enqueued ranks
    dead.set_user_attr("host", __import__("socket").gethostname())
    dead.set_user_attr("pid", 2**22 + 12345)  # no such process
    dead.set_user_attr("config", FEASIBLE[3].name)
    ks, pool, log = _study(tmp_path, budget=3, storage=storage, sampler="tpe")
    with pool:
        ks.run()
    t0 = ks.trials()[0]
    assert t0.state == TrialState.FAIL and t0.user_attrs["failure"] == "interrupted" and not is_measured(t0)
    measured = [e["config"] for e in _events(log) if e["event"] == "end"]
    assert FEASIBLE[3].name in measured  # re-enqueued: not lost
    assert measured.count(FEASIBLE[3].name) == 1


class _StuckSampler(optuna.samplers.RandomSampler):
    """A sampler whose model never leaves one point (TPE with only the default measured can be)."""

    def __init__(self, params):
        super().__init__(seed=0)
        self.params = params

    def sample_independent(self, study, trial, name, distribution):
        return self.params[name]


def test_a_stuck_sampler_still_spends_the_budget(tmp_path):
    ks, pool, log = _study(tmp_path, sampler="tpe", budget=5)
    ks.study.sampler = _StuckSampler(ks.params_of(DEFAULT))
    with pool:
        outcome = ks.run()
    measured = [e["config"] for e in _events(log) if e["event"] == "end"]
    assert len(measured) == len(set(measured)) == 5 and outcome.evaluated == 5
    assert set(measured) <= {c.name for c in FEASIBLE}
    trials = ks.trials()
    unstuck = [t for t in trials if t.user_attrs.get("unstuck")]
    assert len(unstuck) == 4 and all(is_measured(t) for t in unstuck)
    # each came after STALL_TRIALS proposals of the default, all duplicates that measured nothing
    for t in unstuck:
        before = trials[t.number - STALL_TRIALS:t.number]
        assert all(b.user_attrs.get("duplicate_of") == 0 for b in before)
    assert len(trials) == 1 + 4 * (STALL_TRIALS + 1) < ks.max_trials(trials)


def test_settings_reject_bad_values():
    with pytest.raises(ValueError, match="sampler: got 'annealing'"):
        Settings(sampler="annealing")
    with pytest.raises(ValueError, match="budget: got 0"):
        Settings(budget=0)


def test_default_that_fails_the_constraints_is_an_error(tmp_path):
    cands = [Candidate(DEFAULT, "spills", "ptxas spilled"), *[Candidate(c, "ok") for c in FEASIBLE[1:]]]
    with pytest.raises(ValueError, match="built-in default .* failed the constraints"):
        KeyStudy(KEY, cands, DEFAULT, storage=None, name="x", settings=Settings(), pool=None)


def test_cuda_backend_refuses_another_gpu(monkeypatch):
    import torch

    import autoflash.kernels.gpus
    from autoflash.kernels.gpus import get_profile
    from autoflash.tuning.cuda_backend import CudaBackend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(autoflash.kernels.gpus, "detect", lambda *a: get_profile("a100"))
    with pytest.raises(RuntimeError, match=r"--gpu h100 but the visible device is NVIDIA A100-SXM4-80GB "
                                           r"\(profile 'a100'\)"):
        CudaBackend("h100")
    assert CudaBackend("a100").profile.name == "a100"


def test_cuda_backend_without_a_gpu_says_so(monkeypatch):
    import torch

    from autoflash.tuning.cuda_backend import CudaBackend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA device visible.*--dry-run works without one"):
        CudaBackend("h100")


def test_resuming_with_another_space_is_refused(tmp_path):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    KeyStudy(KEY, _candidates(), DEFAULT, storage=storage, name="same", settings=Settings(), pool=None)
    narrower = [c for c in _candidates() if c.config.block_m == 128]
    with pytest.raises(ValueError, match="was created for knob values .* rerun with the same --space"):
        KeyStudy(KEY, narrower, DEFAULT, storage=storage, name="same", settings=Settings(), pool=None)


@pytest.mark.parametrize("sampler", ["bruteforce", "grid"])
def test_exhaustive_samplers_measure_the_whole_space_once(tmp_path, sampler):
    # Every point feasible: the tell of the last one is where grid and brute force stop the study,
    # and the enqueued default must not cost the grid one of its points.
    space = [_cfg(128, n, 8, s) for n in (32, 64) for s in (2, 3)]
    log = tmp_path / "measurements.jsonl"
    pool = WorkerPool({"backend": "simulated", "options": {"gpu": "h100", "log": str(log)}}, 1)
    pool.start()
    ks = KeyStudy(KEY, [Candidate(c, "ok", registers=200, spill_bytes=0) for c in space], DEFAULT,
                  storage=f"sqlite:///{tmp_path / 's.db'}", name=f"test/{KEY}",
                  settings=Settings(budget=100, sampler=sampler, timeout=3.0), pool=pool)
    with pool:
        outcome = ks.run()
    measured = [e["config"] for e in _events(log) if e["event"] == "end"]
    assert sorted(measured) == sorted(c.name for c in space)  # each config once, none left out
    assert outcome.evaluated == 4 and outcome.default is not None
    assert all(t.state != TrialState.RUNNING for t in ks.trials())
    assert ks.max_trials(ks.trials()) == 4 + 1  # the grid's points and the enqueued default on top


# ------------------------------------------------------------------ the CUDA backend's check, per variant
def _cuda_backend(target):
    """The CUDA backend on the GPU, or its helpers on CPU tensors under the emulator (conftest's
    `target`: autoflash.emulate is in force), where CudaBackend() itself refuses to start."""
    import torch

    from autoflash.tuning.cuda_backend import CudaBackend

    if target == "gpu":
        from autoflash.kernels.gpus import detect

        return CudaBackend(detect().name)
    backend = object.__new__(CudaBackend)
    backend.torch, backend._inputs, backend._cu_seqlens, backend._flush, backend.device = torch, {}, {}, None, "cpu"
    return backend


def _profile(target):
    from autoflash.emulation import active
    from autoflash.kernels.gpus import detect

    return active().profile if target == "emulated" else detect()


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("variant", ["plain", "window", "varlen"])
def test_cuda_backend_checks_each_variant_against_its_reference(target, variant, direction):
    from autoflash.tuning.space import default_for

    backend = _cuda_backend(target)
    profile = _profile(target)
    key = ProblemKey(profile.name, direction, "fp16", 64, True, "le1k", variant)
    assert backend._check(key, default_for(key, profile)) is None


def test_cuda_backend_check_sees_the_variant(target, monkeypatch):
    """Against the reference of the plain problem, the window kernel's output is wrong: the check
    ran the window (the launcher's keywords) and compares with the window's reference."""
    import dataclasses

    from autoflash.tuning.space import default_for

    backend = _cuda_backend(target)
    profile = _profile(target)
    key = ProblemKey(profile.name, "fwd", "fp16", 64, True, "le1k", "window")
    references = backend._references
    monkeypatch.setattr(backend, "_references", lambda key, w, tensors, args: references(
        key, dataclasses.replace(w, window=(-1, -1)), tensors, args))
    wrong = backend._check(key, default_for(key, profile))
    assert wrong["status"] == "wrong" and wrong["err"] > wrong["bound"] and "window (64, 0)" in wrong["reason"]
