"""Find, for one GPU, the fastest kernel config of each problem key and store it in tuned/<gpu>.json.

    python -m autoflash.tune --gpu h100 --dry-run      # any machine: compile and prune the space
    python -m autoflash.tune --gpu h100                # on an H100: tune, write tuned/h100.json
    python -m autoflash.tune --gpu h100 --head-dims 128 --dtypes bf16 --causal on --directions fwd
    python -m autoflash.tune --gpu h100 --variants plain,window,varlen --dry-run
    python -m autoflash.tune --gpu h100 --decode --head-dims 128 --dtypes bf16   # KV-cache (decode) keys

A problem key is (GPU, direction, dtype, head_dim, causal, seqlen bucket, variant). The variant
(--variants; plain only by default) names the kernels whose best tiles can differ from plain
attention's: "window", a causal sliding window (left, 0) bottom-right aligned, timed with left =
min(1024, seqlen / 4), and "varlen", packed sequences (cu_seqlens), timed as 16k tokens of random
lengths up to the bucket's length; its causal is flash-attn's (bottom-right). Window keys are
causal only, and fp32 has plain keys only: other combinations are skipped with a note. Softcap,
ALiBi and key-bias calls use the plain key's winner.

For each key the search space (block_m x block_n tiles, warps, pipeline stages, and head_split for
the backward, with the variant's switches on) is enumerated, then pruned with no GPU time spent:
configs over the GPU's shared memory per block are dropped, and every other one is compiled with
NVRTC for the GPU's arch; a config whose ptxas report shows register spills is dropped. --dry-run
stops there and prints the survivors with their registers and shared memory.

Then one Optuna study per key (TPE unless --sampler) proposes configs; the built-in default is
measured first, so a tune never ends worse than it. Each measurement runs in a worker subprocess:
the config is checked against the reference on a small problem (a wrong result fails the trial,
with its error size), then timed with CUDA events on the key's shapes (warm-up, L2 flushed, median
of --reps). A crash, a hang (--timeout) or a wrong result fails only that trial. The study is kept in
an SQLite file beside the table (or --storage), so Ctrl-C or a crash loses nothing: rerun the same
command to resume. Many processes or machines may work on one study through --storage.

Each key's winner, its time and TFLOPs, the default's and SDPA-flash's times on the same shapes and
the runner-ups are merged into <out>/<gpu>.json as soon as the key is done (atomically, under a file
lock; other keys in the table are kept). Without --out the table goes to $AUTOFLASH_TUNED_DIR, else
tuned/ of a source checkout, else ~/.local/share/autoflash/tuned, which the dispatcher reads.

--decode tunes flash_attn_with_kvcache's kernels instead: a decode key is (GPU, dtype, head_dim,
queries per step q1 | q2-16, cache length le4k | le32k | gt32k, batch b1-4 | b5-32 | gt32, dense or
paged), timed on full caches (Llama 3 8B's heads: 32 query heads per 8 K/V heads at d = 128; pages of
256 rows; q2-16 causal at 8 queries, q1 non-causal). Its knobs are the KV-cache kernel's tiles
(block_m 16/32/64, block_n, warps, stages; a paged key's block_n divides 256) and num_splits (0 = the
run-time heuristic, 1 = none, up to 32), stored with the winner. Its figure of merit is memory
bound: bytes of K + V read per second, and that as a share of the GPU's HBM bandwidth, printed
beside SDPA's on the same caches. --directions, --causal, --seqlen-buckets and --variants do not
apply to decode keys.

Measuring needs the named GPU: without a GPU, or on another one, the command says so and exits 2.
--backend simulated stands in for the GPU (a cost model or recorded timings, for tests and demos;
it requires --out and never claims a measurement).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from autoflash.kernels.config import DIRECTIONS, DTYPES, HEAD_DIM_MAX, HEAD_DIM_MIN, HEAD_DIM_STEP
from autoflash.kernels.gpus import PROFILES, profile_arg
from autoflash.tuning.problem import BUCKET_LABELS, KEY_VARIANTS, SEQLEN_BUCKETS, WINDOW_FRACTION, WINDOW_LEFT_MAX, \
    causal_label
from autoflash.tuning.decode import BATCH_BUCKETS, BATCH_LABELS, CACHE_BUCKETS, CACHE_LABELS, PAGE_SIZE, Q_LABELS
from autoflash.tuning.study import SAMPLERS, Settings

CAUSAL_MODES = {"off": (False,), "on": (True,), "both": (False, True)}
PAGED_MODES = {"off": (False,), "on": (True,), "both": (False, True)}
DIRECTION_MODES = {"fwd": ("fwd",), "bwd": ("bwd",), "all": DIRECTIONS}
EXIT_NO_DEVICE = 2


def _list(kind, choices=None):
    def parse(text: str):
        items = [t for t in text.replace(" ", "").split(",") if t]
        try:
            values = [kind(t) for t in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}, expected comma-separated {kind.__name__} values") from None
        bad = [v for v in values if choices is not None and v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"got {text!r}, expected a comma-separated subset of "
                                             f"{','.join(map(str, choices))}")
        return values
    return parse


def _head_dims(text: str) -> list[int]:
    dims = _list(int)(text)
    bad = [d for d in dims if not (HEAD_DIM_MIN <= d <= HEAD_DIM_MAX and d % HEAD_DIM_STEP == 0)]
    if bad:
        raise argparse.ArgumentTypeError(f"got {bad}, expected multiples of {HEAD_DIM_STEP} in "
                                         f"[{HEAD_DIM_MIN}, {HEAD_DIM_MAX}]")
    return dims


def _restriction(text: str) -> tuple[str, tuple]:
    from autoflash.tuning.space import BACKWARD_KNOBS, DECODE_KNOBS, SM90_FORWARD_KNOBS

    names = [*BACKWARD_KNOBS, *(k for k in [*DECODE_KNOBS, *SM90_FORWARD_KNOBS] if k not in BACKWARD_KNOBS)]
    name, sep, values = text.partition("=")
    if not sep or name not in names:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected KNOB=V1,V2 with KNOB one of {', '.join(names)}")
    if name == "family":  # a kernel family by name: sm80, sm90
        got = tuple(v.strip() for v in values.split(","))
        if not set(got) <= {"sm80", "sm90"}:
            raise argparse.ArgumentTypeError(f"got {text!r}, expected family=sm80, family=sm90 or both")
        return name, got
    if name in ("pingpong", "overlap", "v_in_regs"):  # switches: 0/1
        return name, tuple(bool(v) for v in _list(int)(values))
    return name, tuple(_list(int)(values))


def make_parser() -> argparse.ArgumentParser:
    cache = ", ".join(f"{label} timed at {'/'.join(f'{n // 1024}k' for n in lens)}" for label, _, lens in CACHE_BUCKETS)
    batch = ", ".join(f"{label} at {'/'.join(map(str, bs))}" for label, _, bs in BATCH_BUCKETS)
    buckets = "; ".join(f"{label}: seqlen {'<= ' + str(up) if up else '> 4096'}, timed at {','.join(map(str, lens))}"
                        for label, up, lens in SEQLEN_BUCKETS)
    p = argparse.ArgumentParser(prog="python -m autoflash.tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"Seqlen buckets ({buckets}); shapes keep batch*seqlen = 16k tokens and "
                                       "heads*head_dim = 2048.")
    p.add_argument("--gpu", required=True, type=profile_arg, metavar="NAME",
                   help=f"GPU profile to tune for: {', '.join(sorted(PROFILES))}, or the device name torch "
                   "reports for one (e.g. 'NVIDIA H100 80GB HBM3')")
    p.add_argument("--dry-run", action="store_true",
                   help="enumerate and prune the space (compiles for the GPU's arch; no GPU needed), print it, exit")
    g = p.add_argument_group("problem keys")
    g.add_argument("--directions", choices=tuple(DIRECTION_MODES), default="all", help="fwd, bwd or all (default)")
    g.add_argument("--dtypes", type=_list(str, ("fp16", "bf16", "fp32")), default=["fp16", "bf16"],
                   help=f"comma-separated subset of {','.join(DTYPES)} (default fp16,bf16)")
    g.add_argument("--head-dims", type=_head_dims, default=[64, 128], help="comma-separated (default 64,128)")
    g.add_argument("--causal", choices=tuple(CAUSAL_MODES), default="both", help="off, on or both (default)")
    g.add_argument("--seqlen-buckets", type=_list(str, BUCKET_LABELS), default=list(BUCKET_LABELS),
                   help=f"comma-separated subset of {','.join(BUCKET_LABELS)} (default all)")
    g.add_argument("--variants", type=_list(str, KEY_VARIANTS), default=["plain"],
                   help=f"comma-separated subset of {','.join(KEY_VARIANTS)} (default plain): window = causal "
                        f"sliding window (min({WINDOW_LEFT_MAX}, seqlen/{WINDOW_FRACTION}), 0), bottom-right; "
                        f"varlen = packed sequences of random lengths up to the bucket's length")
    g.add_argument("--space", type=_restriction, action="append", default=[], metavar="KNOB=V1,V2",
                   help="narrow one knob of the space, e.g. --space num_stages=2 --space block_m=64,128 "
                        "(repeatable; the built-in default is always kept; num_splits for decode keys)")
    d = p.add_argument_group("decode keys (flash_attn_with_kvcache)")
    d.add_argument("--decode", action="store_true",
                   help="tune the KV-cache (decode) keys instead of the prefill ones (--dtypes and --head-dims "
                        "apply; the options below pick the buckets)")
    d.add_argument("--q-buckets", type=_list(str, Q_LABELS), default=list(Q_LABELS),
                   help=f"queries per step: comma-separated subset of {','.join(Q_LABELS)} (default all)")
    d.add_argument("--cache-buckets", type=_list(str, CACHE_LABELS), default=list(CACHE_LABELS),
                   help=f"cache lengths: subset of {','.join(CACHE_LABELS)} (default all; {cache})")
    d.add_argument("--batch-buckets", type=_list(str, BATCH_LABELS), default=list(BATCH_LABELS),
                   help=f"batch sizes: subset of {','.join(BATCH_LABELS)} (default all; {batch})")
    d.add_argument("--paged", choices=tuple(PAGED_MODES), default="both",
                   help=f"off (dense caches), on (pages of {PAGE_SIZE} rows) or both (default)")
    g.add_argument("--show-rejected", action="store_true", help="with --dry-run, list each rejected config and why")
    s = p.add_argument_group("search")
    s.add_argument("--budget", type=int, default=40, help="measurements per key, the default's included (default 40)")
    s.add_argument("--sampler", choices=SAMPLERS, default="tpe",
                   help="tpe (default), random, grid or bruteforce (every feasible config)")
    s.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    s.add_argument("--storage", default=None,
                   help="Optuna storage URL (default sqlite:///<out>/<gpu>.optuna.db); postgresql://... for many "
                        "machines, journal:PATH for many processes on one machine")
    s.add_argument("--study-name", default=None,
                   help="study name prefix; each key's study is <prefix>/<gpu>/<key> (default "
                        "autoflash-<template hash>)")
    s.add_argument("--workers", type=int, default=1, help="measuring processes, one per visible GPU (default 1)")
    s.add_argument("--jobs", type=int, default=None, help="compile processes for the constraints (default: all CPUs)")
    m = p.add_argument_group("measurement")
    m.add_argument("--reps", type=int, default=20, help="timed repetitions per shape (median reported; default 20)")
    m.add_argument("--warmup", type=int, default=3, help="untimed calls per shape first (default 3)")
    m.add_argument("--timeout", type=float, default=120.0,
                   help="seconds one measurement may take before its worker is killed (default 120)")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, default=None, help="folder of <gpu>.json (see above for the default)")
    o.add_argument("--plot", action="store_true", help="also write <out>/<gpu>-search.png (best so far vs measurements)")
    o.add_argument("--record-timings", type=Path, default=None,
                   help="write every measurement to this JSON file (replayable by --backend simulated)")
    o.add_argument("--no-progress", action="store_true",
                   help="no progress: neither the bars (on a terminal) nor the per-key lines (in a file or pipe)")
    b = p.add_argument_group("simulated backend (tests, demos)")
    b.add_argument("--backend", choices=("cuda", "simulated"), default="cuda", help="default cuda (a real GPU)")
    b.add_argument("--simulate-timings", default=None, help="recorded timings file to replay (default: cost model)")
    b.add_argument("--simulate-faults", type=json.loads, default=None,
                   help='JSON {"crash"|"hang"|"wrong"|"error": [config-name globs]}')
    b.add_argument("--simulate-delay", type=float, default=0.0, help="seconds per simulated measurement")
    b.add_argument("--simulate-log", default=None, help="JSONL file receiving one line per simulated measurement")
    return p


def _check_args(p: argparse.ArgumentParser, args) -> None:
    for name in ("budget", "reps", "workers"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: got {getattr(args, name)}, expected >= 1")
    if args.warmup < 0 or args.timeout <= 0:
        p.error(f"--warmup/--timeout: got {args.warmup}/{args.timeout}, expected >= 0 and > 0")
    if args.backend == "simulated" and args.out is None and not args.dry_run:
        p.error("--backend simulated needs --out: simulated results never go to the tables the dispatcher reads")


def _space_title(key) -> str:
    """A search space's title in the dry-run listing: what its kernels are (the bucket only changes
    the shapes timed, so one space serves every bucket)."""
    if key.is_decode:
        return (f"{key.gpu} decode {key.dtype} d{key.head_dim} {key.q_bucket} "
                f"{'paged ' + str(PAGE_SIZE) if key.paged else 'dense'}")
    title = f"{key.gpu} {key.direction} {key.dtype} d{key.head_dim} {causal_label(key.causal)}"
    return title if key.variant == "plain" else f"{title} {key.variant}"


def _dry_run(args, keys, spaces) -> int:
    """Prints each space; exits 1 where a space has no survivor or its default was rejected (a user
    of that GPU could not run the built-in kernel), naming what rejected it."""
    from autoflash.tuning.report import dominant_reason, format_space
    from autoflash.tuning.runner import spaces_for

    seen, failures = set(), []
    for key in keys:
        default, cands = spaces_for(spaces, key)
        title = _space_title(key)
        if title in seen:
            continue
        seen.add(title)
        print(format_space(f"{title} (default {default.name})", cands, show_rejected=args.show_rejected))
        print()
        if not any(c.ok for c in cands):
            failures.append(f"{title}: no candidate survives; {dominant_reason(cands)}")
        elif bad := next((c for c in cands if c.config == default and not c.ok), None):
            failures.append(f"{title}: the built-in default {default.name} is rejected: {bad.status}: {bad.reason}")
    print("Measuring needs the GPU itself: run without --dry-run on a machine with that GPU.")
    if failures:
        print("\n".join(["", "Failed:", *failures]), file=sys.stderr)
        return 1
    return 0


def _record(path: Path, gpu: str, pool_device: dict, keys, storage, prefix: str) -> None:
    import optuna

    from autoflash.tuning.simulated import TIMINGS_FORMAT, TIMINGS_VERSION
    from autoflash.tuning.study import is_measured

    timings, sdpa = {}, {}
    for key in keys:
        study = optuna.load_study(study_name=f"{prefix}/{key}", storage=storage)
        per = timings.setdefault(key.slug, {})
        for t in study.get_trials(deepcopy=False):
            if is_measured(t) and t.user_attrs.get("ms"):
                per[t.user_attrs["config"]] = t.user_attrs["ms"]
        if (study.user_attrs.get("sdpa_flash") or {}).get("ms"):
            sdpa[key.slug] = study.user_attrs["sdpa_flash"]["ms"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": TIMINGS_FORMAT, "version": TIMINGS_VERSION, "gpu": gpu,
                                "device": pool_device, "timings": timings, "sdpa_flash": sdpa}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    from autoflash.kernels.codegen import template_hash
    from autoflash.kernels.gpus import get_profile
    from autoflash.tuning.runner import prepare_spaces

    profile = get_profile(args.gpu)
    keys = _keys(parser, args, profile.name)
    pool = None
    if not args.dry_run:  # the device check comes first: no compiling for a GPU that is not there
        pool = _start_pool(args, profile)
        if pool is None:
            return EXIT_NO_DEVICE
    try:
        spaces = prepare_spaces(keys, profile, restrict=dict(args.space), jobs=args.jobs,
                                progress=not args.no_progress)
    except ValueError as e:  # e.g. no built-in config fits this GPU for a key
        if pool is not None:
            pool.close()
        parser.error(str(e))
    if args.dry_run:
        return _dry_run(args, keys, spaces)
    with pool:
        return _tune(args, argv, profile, keys, spaces, template_hash(), pool)


def _keys(parser: argparse.ArgumentParser, args, gpu: str) -> list:
    """The problem keys of the options; a note on stderr for the combinations that make none, and a
    usage error when none is left."""
    from autoflash.tuning.runner import build_decode_keys, build_keys, skipped_combinations

    if args.decode:
        keys = build_decode_keys(gpu, dtypes=args.dtypes, head_dims=args.head_dims, q_buckets=args.q_buckets,
                                 cache_buckets=args.cache_buckets, batch_buckets=args.batch_buckets,
                                 paged=PAGED_MODES[args.paged])
        if not keys:
            parser.error(f"--decode --dtypes: got {','.join(args.dtypes)}; expected fp16 or bf16 (the KV-cache "
                         f"kernels' dtypes)")
        if "fp32" in args.dtypes:
            print("autoflash.tune: no decode keys for fp32 (the KV-cache kernels run fp16 and bf16)", file=sys.stderr)
        return keys
    causal = CAUSAL_MODES[args.causal]
    keys = build_keys(gpu, directions=DIRECTION_MODES[args.directions], dtypes=args.dtypes, head_dims=args.head_dims,
                      causal=causal, buckets=args.seqlen_buckets, variants=args.variants)
    skipped = skipped_combinations(dtypes=args.dtypes, causal=causal, variants=args.variants)
    if not keys:
        parser.error(f"--variants/--dtypes/--causal: got no problem key (every combination is one of "
                     f"{', '.join(skipped)}); expected window keys with --causal on or both, variant keys with "
                     f"fp16 or bf16")
    if skipped:
        print(f"autoflash.tune: no keys for {', '.join(skipped)} (window keys are causal; fp32 has plain keys only)",
              file=sys.stderr)
    return keys


def _start_pool(args, profile):
    """The measuring workers, started (the backend checks the device); None after saying why not."""
    from autoflash.tuning.worker import WorkerPool

    if args.backend == "simulated":
        options = {"gpu": profile.name, "timings": args.simulate_timings, "faults": args.simulate_faults,
                   "delay": args.simulate_delay, "log": args.simulate_log}
    else:
        options = {"gpu": profile.name}
    try:
        pool = WorkerPool({"backend": args.backend, "options": options}, args.workers)
    except ValueError as e:
        print(f"autoflash.tune: {e}", file=sys.stderr)
        return None
    try:
        pool.start()
    except RuntimeError as e:
        pool.close()
        print(f"autoflash.tune: {e}", file=sys.stderr)
        return None
    return pool


def _tune(args, argv, profile, keys, spaces, thash: str, pool) -> int:
    import optuna

    from autoflash.kernels.resources import default_tune_output
    from autoflash.tuning.report import format_results, plot_search
    from autoflash.tuning.runner import provenance, run_keys
    from autoflash.tuning.study import make_storage
    from autoflash.tuning.table import TableError

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # failures are reported by the progress line
    out = args.out or default_tune_output()
    out.mkdir(parents=True, exist_ok=True)
    url = args.storage or f"sqlite:///{(out / f'{profile.name}.optuna.db').resolve()}"
    prefix = args.study_name or f"autoflash-{thash[:12]}"
    settings = Settings(budget=args.budget, sampler=args.sampler, seed=args.seed, reps=args.reps,
                        warmup=args.warmup, timeout=args.timeout)
    command = shlex.join(["python", "-m", "autoflash.tune", *argv])
    device = pool.workers[0].device
    print(f"tuning {len(keys)} key(s) for {profile.name} on {device.get('device_name')} with {args.workers} "
          f"worker(s); study storage {url}; table {out / (profile.name + '.json')}", file=sys.stderr)
    storage = make_storage(url)
    try:
        rows, histories, defaults = run_keys(
            keys, spaces, pool=pool, storage=storage, study_prefix=prefix, settings=settings, out_dir=out,
            template_hash=thash, prov=provenance(device, args.backend, command),
            progress=not args.no_progress, log=lambda m: print(m, file=sys.stderr))
    except TableError as e:
        print(f"autoflash.tune: {e}\nEvery trial is kept in the study storage {url}: fix the table and rerun "
              f"the same command to write it.", file=sys.stderr)
        return 1
    print(format_results(rows))
    print(f"wrote {out / (profile.name + '.json')}")
    if args.plot:
        png = out / f"{profile.name}-search.png"
        plot_search(histories, defaults, png, f"autoflash.tune --gpu {profile.name} ({args.backend})")
        print(f"wrote {png}")
    if args.record_timings:
        _record(args.record_timings, profile.name, device, keys, storage, prefix)
        print(f"wrote {args.record_timings}")
    return 0 if all(r["winner"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
