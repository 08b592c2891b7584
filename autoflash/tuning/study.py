"""One Optuna study per problem key. The sampler proposes knob values; a trial turns them into a
KernelConfig and, if it passed the constraints, has a worker measure it. Trials are data:

- COMPLETE: measured; value = milliseconds summed over the key's shapes (or, for a config already
  measured by an earlier trial, that trial's value, marked duplicate_of: nothing is measured twice);
- FAIL: the measurement failed (crash, timeout, wrong result, launch error), with its reason;
- PRUNED: never measured (invalid knob combination, over shared memory, spills, duplicate of a
  failed or running trial): costs nothing and tells the sampler to look elsewhere.

The built-in default is enqueued first, so a tune never ends worse than the default. A trial left
RUNNING by a process that died (SIGKILL, power loss) is failed as "interrupted" and its config
enqueued again, so rerunning the command resumes with nothing lost or repeated."""
from __future__ import annotations

import dataclasses
import datetime
import os
import random
import socket
import threading
import time
import warnings
from typing import Callable

import optuna
from optuna.trial import TrialState

from autoflash.kernels.config import KernelConfig
from autoflash.tuning.problem import ProblemKey
from autoflash.tuning.space import Candidate, DecodePoint, param_values, point_of

# Optuna's UserWarning from Study.ask() when the storage has a heartbeat (optuna/study/study.py).
HEARTBEAT_WARNING = r"Heartbeat of storage is supposed to be used with Study\.optimize"
SAMPLERS = ("tpe", "random", "grid", "bruteforce")
HOST = socket.gethostname()
ORPHAN_AGE_S = 300  # a RUNNING trial with no owner recorded after this long is taken as abandoned
# Finished trials in a row that measured nothing (pruned, duplicates) before the study measures an
# untried feasible config of its own choosing: a sampler whose model has only the default to go on
# can keep proposing it (TPE in two processes did, 200 trials for one measurement), and the budget
# is a promise of measurements.
STALL_TRIALS = 12


class TrialFailed(Exception):
    """A measurement failed; the trial is recorded as FAIL with the reason in its user attrs."""


@dataclasses.dataclass(frozen=True)
class Settings:
    budget: int = 40  # measurements per key (the enqueued default included)
    sampler: str = "tpe"
    seed: int | None = 0
    reps: int = 20
    warmup: int = 3
    timeout: float = 120.0  # seconds one measurement may take before its worker is killed
    runner_ups: int = 5

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler: got {self.sampler!r}, expected one of {SAMPLERS}")
        for name in ("budget", "reps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: got {getattr(self, name)}, expected >= 1")
        if self.warmup < 0 or self.timeout <= 0:
            raise ValueError(f"warmup/timeout: got {self.warmup}/{self.timeout}, expected >= 0 and > 0")


def make_storage(url: str):
    """An Optuna storage from a URL: "journal:PATH" (or a path ending in .journal / .log) is a
    JournalStorage file for many processes on one machine; anything else an RDB URL (sqlite:///...,
    postgresql://...) with heartbeats, so trials of a process that died are failed and retried."""
    if url.startswith("journal:") or url.endswith((".journal", ".log")):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(url.removeprefix("journal:")))
    import sqlalchemy.exc

    for attempt in range(5):
        try:
            # Heartbeats and the retry callback are marked experimental; they are what resuming
            # after a crash rests on, so they are used on purpose and their notices not shown.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(
                    url, heartbeat_interval=60, grace_period=240,
                    heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1))
        except sqlalchemy.exc.IntegrityError:
            # Two processes creating the tables of a fresh database at once: one loses the race
            # (optuna/optuna#1092); the tables exist by now, so connect again.
            if attempt == 4:
                raise
            time.sleep(0.5 * (attempt + 1))


def rank_name(knob: str, family: str | None = None) -> str:
    """The Optuna parameter of a knob: its rank among the knob's sorted feasible values. Tile sizes
    are ordinal (96 lies between 64 and 128), and TPE models an int range as ordered where it
    treats categories as unrelated; on the cost model this cut the evaluations needed to come
    within 3% of the best (python -m autoflash.tuning.efficiency). Where a key's space holds two
    kernel families, each family's knobs are parameters of their own ("sm90.block_n_rank"), asked
    only once "family_rank" chose that family: a define-by-run conditional space."""
    return f"{family}.{knob}_rank" if family else f"{knob}_rank"


def grid_space(space: dict[str, dict[str, tuple]]) -> dict[str, list[int]]:
    """Every parameter the study may ask, with its ranks (the grid sampler's search space)."""
    multi = len(space) > 1
    out = {rank_name("family"): list(range(len(space)))} if multi else {}
    for family, values in space.items():
        out.update({rank_name(k, family if multi else None): list(range(len(v))) for k, v in values.items()})
    return out


def make_sampler(name: str, space: dict[str, dict[str, tuple]], seed: int | None):
    with warnings.catch_warnings():  # multivariate TPE and brute force are marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if name == "tpe":
            # multivariate: the knobs interact (a tile fits only with so many warps and stages).
            # n_startup_trials counts pruned trials (infeasible points) and the enqueued default too,
            # so the random start costs fewer than 8 measurements before TPE models the landscape.
            # group: a two-family space is conditional (each family's knobs are asked only with it),
            # and grouped multivariate TPE models each family's knobs jointly instead of falling
            # back to independent sampling.
            return optuna.samplers.TPESampler(seed=seed, n_startup_trials=8, multivariate=True, group=True,
                                              constant_liar=True)
        if name == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if name == "grid":
            # a two-family grid crosses both families' knobs: a point of one family repeats for each
            # of the other's values, which costs no measurement (duplicate_of) but a trial
            return optuna.samplers.GridSampler(grid_space(space), seed=seed)
        return optuna.samplers.BruteForceSampler(seed=seed)


def is_measured(t) -> bool:
    """A trial that cost a measurement: COMPLETE and no duplicate, or FAIL from a measurement."""
    if t.state == TrialState.COMPLETE:
        return "duplicate_of" not in t.user_attrs
    return t.state == TrialState.FAIL and t.user_attrs.get("failure") not in (None, "interrupted")


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@dataclasses.dataclass
class Outcome:
    """What one key's study found, from its trials (those of every run and every worker)."""

    key: ProblemKey
    ranked: list  # COMPLETE, non-duplicate FrozenTrials, fastest first, one per config
    default: object | None  # the default config's trial, if it completed
    sdpa_flash_ms: float | None
    evaluated: int
    failed: list  # FAIL trials from measurements
    trials: int


class KeyStudy:
    def __init__(self, key: ProblemKey, candidates: list[Candidate], default: KernelConfig, *, storage, name: str,
                 settings: Settings, pool, on_trial: Callable[[object, "KeyStudy"], None] | None = None):
        self.key, self.default, self.settings, self.pool, self.on_trial = key, default, settings, pool, on_trial
        self.by_name = {c.config.name: c for c in candidates}
        self.feasible = {c.config.name for c in candidates if c.ok}
        if default.name not in self.feasible:
            why = self.by_name[default.name].reason if default.name in self.by_name else "not in the space"
            raise ValueError(f"{key.gpu} {key.label}: the built-in default {default.name} failed the constraints "
                             f"({why})")
        self.space = param_values(candidates, key)  # family -> knob -> the values its feasible configs take
        self.families = tuple(self.space)
        self.study = optuna.create_study(study_name=name, storage=storage, direction="minimize", load_if_exists=True,
                                         sampler=make_sampler(settings.sampler, self.space, settings.seed))
        self.study.set_user_attr("key", key.to_dict())
        stored = self.study.user_attrs.get("knob_values")
        current = {f: {k: list(v) for k, v in values.items()} for f, values in self.space.items()}
        if stored is None:
            self.study.set_user_attr("knob_values", current)
        elif stored != current:  # ranks would mean other values: the trials could not be read
            raise ValueError(f"study {name!r} was created for knob values {stored}; this run's space gives "
                             f"{current}; rerun with the same --space, or give another --study-name")
        self._lock = threading.Lock()

    # ------------------------------------------------------------ bookkeeping
    def trials(self):
        return self.study.get_trials(deepcopy=False)

    def evaluated(self) -> int:
        return sum(is_measured(t) for t in self.trials())

    def exhausted(self, trials=None) -> bool:
        """Every feasible config measured (`trials`: the study's, as the caller just read them)."""
        done = {t.user_attrs.get("config") for t in (self.trials() if trials is None else trials) if is_measured(t)}
        return self.feasible <= done

    def recover_interrupted(self) -> list[int]:
        """Fails the RUNNING trials whose process is gone and enqueues their params again."""
        now = datetime.datetime.now()
        recovered = []
        for t in self.trials():
            if t.state != TrialState.RUNNING:
                continue
            host, pid = t.user_attrs.get("host"), t.user_attrs.get("pid")
            orphan = pid is None and t.datetime_start and (now - t.datetime_start).total_seconds() > ORPHAN_AGE_S
            if not (orphan or (host == HOST and isinstance(pid, int) and _process_gone(pid))):
                continue
            optuna.trial.Trial(self.study, t._trial_id).set_user_attr("failure", "interrupted")
            optuna.trial.Trial(self.study, t._trial_id).set_user_attr(
                "reason", f"process {pid} on {host} ended while this trial ran; re-enqueued")
            self.study.tell(t.number, state=TrialState.FAIL)
            if t.params:
                self.study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
            recovered.append(t.number)
        return recovered

    def _param(self, knob: str, family: str) -> str:
        return rank_name(knob, family if len(self.families) > 1 else None)

    def params_of(self, config: KernelConfig) -> dict[str, int]:
        """The Optuna params that propose `config`: its family's rank where the space holds two, and
        one rank per knob of that family."""
        family = config.family
        out = {rank_name("family"): self.families.index(family)} if len(self.families) > 1 else {}
        out.update({self._param(k, family): v.index(getattr(config, k)) for k, v in self.space[family].items()})
        return out

    def suggest(self, trial) -> dict:
        """Knob values for a trial: the family first (where there are two), then that family's knobs."""
        family = self.families[trial.suggest_int(rank_name("family"), 0, len(self.families) - 1)] \
            if len(self.families) > 1 else self.families[0]
        values = {k: v[trial.suggest_int(self._param(k, family), 0, len(v) - 1)] for k, v in self.space[family].items()}
        return {**values, "family": family}

    def enqueue_default(self) -> None:
        self.study.enqueue_trial(self.params_of(self.default), user_attrs={"default": True}, skip_if_exists=True)

    def unstick(self, trials) -> int | None:
        """After STALL_TRIALS finished trials in a row that measured nothing, enqueues an untried
        feasible config (drawn with the study's seed) and returns its trial-to-be's position; None
        when the sampler is making progress, a trial is already queued, or nothing is left."""
        if any(t.state == TrialState.WAITING for t in trials):
            return None
        idle = 0
        for t in reversed(trials):
            if t.state == TrialState.RUNNING:
                continue
            if is_measured(t) or t.user_attrs.get("unstuck"):
                break
            idle += 1
        if idle < STALL_TRIALS:
            return None
        taken = {t.user_attrs.get("config") for t in trials if is_measured(t) or t.state == TrialState.RUNNING}
        untried = sorted(self.feasible - taken)
        if not untried:
            return None
        pick = random.Random(f"{self.settings.seed}/{len(trials)}").choice(untried)
        self.study.enqueue_trial(self.params_of(self.by_name[pick].config), user_attrs={"unstuck": True})
        return len(trials)

    # ------------------------------------------------------------ the objective
    def _prune(self, trial, status: str, reason: str):
        trial.set_user_attr("pruned", status)
        trial.set_user_attr("reason", reason)
        raise optuna.TrialPruned(reason)

    def _message(self, op: str, config: KernelConfig | None = None, trial: int | None = None) -> dict:
        msg = {"op": op, "key": self.key.to_dict(), "reps": self.settings.reps, "warmup": self.settings.warmup,
               "shapes": [[s.batch, s.heads, s.seqlen, s.head_dim] for s in self.key.shapes()]}
        if config is not None:
            msg.update(config=config.config.to_dict() if isinstance(config, DecodePoint) else config.to_dict(),
                       registers=self.by_name[config.name].registers, trial=trial)
            if isinstance(config, DecodePoint):
                msg["num_splits"] = config.num_splits
        return msg

    def objective(self, trial) -> float:
        params = self.suggest(trial)
        trial.set_user_attr("host", HOST)
        trial.set_user_attr("pid", os.getpid())
        try:
            cfg = point_of(self.key, params)  # a KernelConfig, or a decode key's DecodePoint
        except ValueError as e:
            self._prune(trial, "invalid", str(e))
        trial.set_user_attr("config", cfg.name)
        cand = self.by_name.get(cfg.name)
        if cand is None or not cand.ok:
            self._prune(trial, cand.status if cand else "outside", cand.reason if cand else "not in the search space")
        for t in self.trials():
            if t.number == trial.number or t.user_attrs.get("config") != cfg.name:
                continue
            if t.state == TrialState.COMPLETE:
                trial.set_user_attr("duplicate_of", t.user_attrs.get("duplicate_of", t.number))
                return t.value
            if is_measured(t):
                self._prune(trial, "duplicate", f"{cfg.name} already failed in trial {t.number}")
            if t.state == TrialState.RUNNING and "duplicate_of" not in t.user_attrs:
                self._prune(trial, "duplicate", f"{cfg.name} is being measured by trial {t.number}")
        trial.set_user_attr("registers", cand.registers)
        trial.set_user_attr("smem_bytes", cfg.smem_bytes)
        with self.pool.worker() as w:
            answer = w.request(self._message("measure", cfg, trial.number), self.settings.timeout)
        if answer.get("status") == "ok":
            trial.set_user_attr("ms", answer["ms"])
            return float(sum(answer["ms"]))
        trial.set_user_attr("failure", answer.get("status", "error"))
        trial.set_user_attr("reason", str(answer.get("reason", ""))[:2000])
        for f in ("err", "bound"):
            if answer.get(f) is not None:
                trial.set_user_attr(f, answer[f])
        raise TrialFailed(f"{cfg.name}: {answer.get('status')}: {answer.get('reason')}")

    def _done(self, trials) -> bool:
        return (sum(is_measured(t) for t in trials) >= self.settings.budget or self.exhausted(trials)
                or len(trials) >= self.max_trials(trials))

    def max_trials(self, trials) -> int:
        """A ceiling on all trials (pruned ones included), in case a sampler keeps proposing
        infeasible or duplicate points; grid and brute force stop on their own when exhausted.
        `trials`: the study's trials, as the caller just read them."""
        if self.settings.sampler not in ("grid", "bruteforce"):
            return max(20 * self.settings.budget, 200)
        grid = 1
        for ranks in grid_space(self.space).values():
            grid *= len(ranks)
        # enqueued trials (the default, retries) come on top: the grid still visits their points
        return grid + sum("fixed_params" in t.system_attrs for t in trials)

    # ------------------------------------------------------------ running
    def baseline(self) -> float | None:
        """SDPA-flash on the key's shapes, measured once per study (kept in the study's attrs)."""
        attrs = self.study.user_attrs
        if "sdpa_flash" not in attrs:
            with self.pool.worker() as w:
                answer = w.request(self._message("baseline"), self.settings.timeout)
            record = {"ms": answer.get("ms")} if answer.get("status") == "ok" else \
                {"ms": None, "reason": f"{answer.get('status')}: {answer.get('reason')}"}
            self.study.set_user_attr("sdpa_flash", record)
            attrs = self.study.user_attrs
        ms = attrs["sdpa_flash"].get("ms")
        return float(sum(ms)) if ms else None

    def _loop(self) -> None:
        """One measuring thread: ask, evaluate, tell, until the budget or the space is used up.
        ask() is serialised within the process, so two threads never claim the same enqueued trial."""
        from optuna.storages._heartbeat import fail_stale_trials, get_heartbeat_thread

        while not self._stop.is_set():
            with self._lock, warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                # ask/tell with a heartbeat storage is what this loop does on purpose: it runs the
                # heartbeat thread itself (below) and fails stale trials itself (here), which is all
                # Study.optimize would add. Optuna warns on every ask() regardless; that one
                # warning, and only it, is silenced.
                warnings.filterwarnings("ignore", message=HEARTBEAT_WARNING, category=UserWarning)
                fail_stale_trials(self.study)  # other processes' dead trials (RDB heartbeats)
                trials = self.trials()  # read once: the stop test and the stall guard both look at them
                if self._done(trials):
                    self._stop.set()
                    return
                self.unstick(trials)
                trial = self.study.ask()
            told = {}
            try:
                with get_heartbeat_thread(trial._trial_id, self.study._storage):
                    told["values"] = self.objective(trial)
            except optuna.TrialPruned:
                told["state"] = TrialState.PRUNED
            except TrialFailed:
                told["state"] = TrialState.FAIL
            except BaseException:  # Ctrl-C or a bug: this trial is failed and its config queued again
                self._stop.set()
                trial.set_user_attr("failure", "interrupted")
                self._tell(trial, state=TrialState.FAIL)
                if trial.params:
                    self.study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
                raise
            frozen = self._tell(trial, **told)
            if self.on_trial is not None:
                with self._lock:
                    self.on_trial(frozen, self)

    def _tell(self, trial, values=None, state=None):
        """study.tell, where a sampler's "space used up" ends this study's loop. Grid and brute force
        call study.stop() from tell once every point is done, which Optuna allows only inside
        study.optimize() (a RuntimeError here, raised after the trial's state is stored)."""
        try:
            return self.study.tell(trial, values, state=state)
        except RuntimeError as e:
            if "Study.stop" not in str(e):
                raise
            self._stop.set()
            return self.study.get_trials(deepcopy=False)[trial.number]

    def run(self) -> Outcome:
        self.recover_interrupted()
        self.enqueue_default()
        self._stop = threading.Event()
        n = len(self.pool)
        if n == 1:
            self._loop()
        else:
            errors = []

            def guarded():
                try:
                    self._loop()
                except BaseException as e:  # re-raised in the caller's thread below
                    errors.append(e)

            threads = [threading.Thread(target=guarded, name=f"autoflash-tune-{i}") for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
        sdpa = self.baseline()
        return self.outcome(sdpa)

    def outcome(self, sdpa_flash_ms: float | None = None) -> Outcome:
        trials = self.trials()
        done = [t for t in trials if t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs]
        ranked, seen = [], set()
        for t in sorted(done, key=lambda t: (t.value, t.number)):
            if t.user_attrs.get("config") not in seen:
                seen.add(t.user_attrs.get("config"))
                ranked.append(t)
        default = next((t for t in ranked if t.user_attrs.get("config") == self.default.name), None)
        failed = [t for t in trials if t.state == TrialState.FAIL and is_measured(t)]
        return Outcome(self.key, ranked, default, sdpa_flash_ms, sum(is_measured(t) for t in trials), failed,
                       len(trials))
