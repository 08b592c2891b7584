"""Search efficiency: how many measurements the tuner's Optuna study needs to come within 3% of the
best config that an exhaustive search finds.

    python -m autoflash.tuning.efficiency --directions fwd --dtypes bf16 --head-dims 128 --seqlen-buckets le4k

For each problem key, the feasible space is built exactly as the tuner builds it (enumerated, narrowed
by --space, configs over shared memory or spilling registers dropped after an NVRTC compile for the
GPU's arch, cached on disk). Every feasible config is then evaluated (N of them): the exhaustive best.
Then, for each sampler and seed, a tuner study (in memory, measuring in process, budget N, the built-in
default first as in a real tune) runs, and n is the first measurement count at which the best so far
is within --within (3%) of the exhaustive best (the study stops there: the rest cannot change n).
Reported per key and sampler: N, K (configs within 3%), the median and worst n over the seeds ("never":
not reached within the study's budget or trial ceiling) and median n / N. Random search is the
baseline. Exit status 0 when every key's TPE median n / N is <= --fraction (0.30), else 1.

Times come from the simulated backend: its cost model by default, which is a plausibility model with
the features of a GPU's landscape (smooth regions, occupancy cliffs), NOT a GPU measurement; or, with
--timings, GPU timings recorded by `autoflash.tune --record-timings` (the exhaustive set is then the
configs recorded for the key, intersected with the feasible ones). No GPU is used either way."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
from pathlib import Path

from autoflash.kernels.config import DIRECTIONS
from autoflash.kernels.gpus import PROFILES, profile_arg
from autoflash.tuning.problem import BUCKET_LABELS, KEY_VARIANTS, slug_label
from autoflash.tune import CAUSAL_MODES, _head_dims, _list, _restriction
from autoflash.tuning.study import SAMPLERS, KeyStudy, Settings, is_measured
from autoflash.tuning.worker import _handle


class InProcessPool:
    """A one-worker pool whose worker is this process: request() calls the backend directly."""

    def __init__(self, backend):
        self.backend, self.measures = backend, 0

    def __len__(self) -> int:
        return 1

    @contextlib.contextmanager
    def worker(self):
        yield self

    def request(self, msg: dict, timeout: float) -> dict:
        self.measures += msg["op"] == "measure"
        try:
            return _handle(self.backend, msg)
        except Exception as e:  # as a worker process answers a Python-level failure
            return {"status": "error", "reason": f"{type(e).__name__}: {e}"}


def first_within(values, best: float, within: float = 0.03) -> int | None:
    """The 1-based count of measurements after which the best so far is <= (1 + within) * best, or
    None when it never is. `values` are ms in measurement order (inf or None for a failed one)."""
    target = (1 + within) * best
    for n, v in enumerate(values, 1):
        if v is not None and v <= target:
            return n
    return None


def feasible_for(key, candidates, timings: dict | None):
    """The candidates the tuner would measure; with recorded timings, only those recorded for the key."""
    ok = [c for c in candidates if c.ok]
    if timings is None:
        return ok
    rec, n = timings.get("timings", {}).get(key.slug, {}), len(key.shapes())
    return [c for c in ok if len(rec.get(c.config.name, ())) == n]


def exhaustive(key, feasible, backend) -> list[tuple[str, float]]:
    """(config name, ms summed over the key's shapes) of every feasible config, fastest first."""
    shapes = list(key.shapes())
    ranked = [(c.config.name, float(sum(backend.measure(key, c.config, shapes, c.registers)["ms"]))) for c in feasible]
    return sorted(ranked, key=lambda r: (r[1], r[0]))


class _Reached(Exception):
    """Ends a study once the target is met (from its trial callback): what follows cannot change n."""


def search(key, default, feasible, backend, sampler: str, seed: int, *, stop_at: float | None = None,
           pool=None) -> list[float]:
    """ms of each measurement of one in-memory tuner study (budget: every feasible config), in
    measurement order, inf for a failed one; it ends early once a measurement is <= stop_at."""
    import optuna

    def on_trial(frozen, _ks) -> None:
        if stop_at is not None and is_measured(frozen) and frozen.value is not None and frozen.value <= stop_at:
            raise _Reached

    ks = KeyStudy(key, feasible, default, storage=optuna.storages.InMemoryStorage(), name=f"efficiency/{key}",
                  settings=Settings(budget=len(feasible), sampler=sampler, seed=seed),
                  pool=pool or InProcessPool(backend), on_trial=on_trial)
    with contextlib.suppress(_Reached):
        ks.run()
    measured = sorted((t for t in ks.trials() if is_measured(t)), key=lambda t: t.number)
    return [float(t.value) if t.value is not None else math.inf for t in measured]


def summarise(ns: list[int | None], total: int, fraction: float) -> dict:
    """Median and worst n over seeds (None = never reached, counted as infinite) and the gate."""
    as_num = [math.inf if n is None else n for n in ns]
    median, worst = statistics.median(as_num), max(as_num)
    finite = lambda x: None if math.isinf(x) else x  # noqa: E731 (JSON has no infinity)
    return {"n": ns, "median_n": finite(median), "worst_n": finite(worst),
            "median_fraction": finite(median / total), "pass": median / total <= fraction}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m autoflash.tuning.efficiency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    directions = lambda t: list(DIRECTIONS) if t == "all" else _list(str, DIRECTIONS)(t)  # noqa: E731
    p.add_argument("--gpu", type=profile_arg, default="h100", metavar="NAME",
                   help=f"GPU profile: {', '.join(sorted(PROFILES))}, or a device name torch reports (default h100)")
    p.add_argument("--directions", type=directions, default=list(DIRECTIONS), help="fwd,bwd (default) or a subset")
    p.add_argument("--dtypes", type=_list(str, ("fp16", "bf16", "fp32")), default=["fp16", "bf16"])
    p.add_argument("--head-dims", type=_head_dims, default=[64, 128])
    p.add_argument("--causal", choices=tuple(CAUSAL_MODES), default="both")
    p.add_argument("--seqlen-buckets", type=_list(str, BUCKET_LABELS), default=list(BUCKET_LABELS))
    p.add_argument("--variants", type=_list(str, KEY_VARIANTS), default=["plain"],
                   help=f"comma-separated subset of {','.join(KEY_VARIANTS)}, as autoflash.tune takes it (default "
                        f"plain); the cost model runs each key's workload (a window's band, packed lengths)")
    p.add_argument("--space", type=_restriction, action="append", default=[], metavar="KNOB=V1,V2",
                   help="narrow one knob, as autoflash.tune does (repeatable; the default is always kept)")
    p.add_argument("--jobs", type=int, default=None, help="compile processes (default: all CPUs)")
    p.add_argument("--samplers", type=_list(str, SAMPLERS), default=["tpe", "random"], help="default tpe,random")
    p.add_argument("--seeds", type=int, default=10, help="seeds 0..SEEDS-1 per sampler (default 10)")
    p.add_argument("--within", type=float, default=0.03, help="tolerance on the exhaustive best (default 0.03)")
    p.add_argument("--fraction", type=float, default=0.30, help="the TPE gate on median n / N (default 0.30)")
    p.add_argument("--timings", default=None, help="recorded GPU timings to replay (default: the cost model)")
    p.add_argument("--out", type=Path, default=None, help="also write the results to this JSON file")
    p.add_argument("--no-progress", action="store_true")
    return p


def run(args) -> dict:
    import optuna

    from autoflash.kernels.gpus import get_profile
    from autoflash.tuning.runner import build_keys, prepare_spaces, spaces_for
    from autoflash.tuning.simulated import SimulatedBackend

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    profile = get_profile(args.gpu)
    backend = SimulatedBackend(profile.name, timings=args.timings)
    if backend.timings is not None and backend.timings.get("gpu") != profile.name:
        raise ValueError(f"recorded timings {args.timings}: got gpu {backend.timings.get('gpu')!r}, "
                         f"expected {profile.name!r} (--gpu)")
    keys = build_keys(profile.name, directions=args.directions, dtypes=args.dtypes, head_dims=args.head_dims,
                      causal=CAUSAL_MODES[args.causal], buckets=args.seqlen_buckets, variants=args.variants)
    spaces = prepare_spaces(keys, profile, restrict=dict(args.space), jobs=args.jobs, progress=not args.no_progress)
    rows = []
    for key in keys:
        default, candidates = spaces_for(spaces, key)
        feasible = feasible_for(key, candidates, backend.timings)
        if default.name not in {c.config.name for c in feasible}:
            why = "not recorded in the timings file" if backend.timings is not None else "not feasible"
            print(f"skipping {key.gpu} {key.label}: the built-in default {default.name} is {why}", file=sys.stderr)
            continue
        ranked = exhaustive(key, feasible, backend)
        best = ranked[0][1]
        row = {"key": key.slug, "feasible": len(feasible), "best_config": ranked[0][0], "best_ms": best,
               "within_tolerance": sum(ms <= (1 + args.within) * best for _, ms in ranked),
               "default_ms": dict(ranked)[default.name], "top": ranked[:5], "samplers": {}}
        for sampler in args.samplers:
            ns = [first_within(search(key, default, feasible, backend, sampler, seed,
                                      stop_at=(1 + args.within) * best), best, args.within)
                  for seed in range(args.seeds)]
            row["samplers"][sampler] = summarise(ns, len(feasible), args.fraction)
        rows.append(row)
        if not args.no_progress:
            print(f"done {key.gpu} {key.label}", file=sys.stderr)
    if not rows:
        raise ValueError(f"no key to measure: got {len(keys)} key(s), expected at least one with its default feasible"
                         + (f" and recorded in {args.timings}" if args.timings else ""))
    gate = "tpe" if "tpe" in args.samplers else args.samplers[0]
    return {"backend": f"recorded timings {args.timings}" if args.timings else "simulated cost model",
            "gpu": profile.name, "settings": {k: v for k, v in vars(args).items() if k not in ("out", "no_progress")},
            "gate": {"sampler": gate, "within": args.within, "fraction": args.fraction, "seeds": args.seeds,
                     "pass": all(r["samplers"][gate]["pass"] for r in rows)}, "keys": rows}


def format_table(report: dict) -> str:
    g = report["gate"]
    lines = [f"{report['gpu']}, {report['backend']}: n = measurements until the best so far is <= "
             f"{1 + g['within']:g} x the exhaustive best of N feasible configs ({g['seeds']} seeds; K = configs "
             f"that close; default = default / best)",
             f"{'key':<34} {'N':>4} {'K':>3} {'default':>7} {'sampler':<10} {'median n':>8} {'worst n':>7} "
             f"{'n/N':>5}  ok"]
    fmt = lambda x, f: "never" if x is None else format(x, f)  # noqa: E731
    for r in report["keys"]:
        for name, s in r["samplers"].items():
            lines.append(f"{slug_label(r['key']):<34} {r['feasible']:>4} {r['within_tolerance']:>3} "
                         f"{r['default_ms'] / r['best_ms']:>6.2f}x {name:<10} {fmt(s['median_n'], 'g'):>8} "
                         f"{fmt(s['worst_n'], 'g'):>7} {fmt(s['median_fraction'], '.2f'):>5}  "
                         f"{'yes' if s['pass'] else 'NO'}")
    lines.append(f"gate ({g['sampler']} median n/N <= {g['fraction']:g} on every key): "
                 f"{'PASS' if g['pass'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    jobs = 1 if args.jobs is None else args.jobs
    if args.seeds < 1 or not 0 <= args.within < 1 or not 0 < args.fraction <= 1 or jobs < 1:
        parser.error(f"--seeds/--within/--fraction/--jobs: got {args.seeds}/{args.within}/{args.fraction}/"
                     f"{args.jobs}, expected >= 1, in [0, 1), in (0, 1] and >= 1")
    try:
        report = run(args)
    except ValueError as e:
        parser.error(str(e))
    print(format_table(report))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")
    return 0 if report["gate"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
