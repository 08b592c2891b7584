"""FlashAttention-3's own test file (hopper/test_flash_attn.py), or FlashAttention-2's
(tests/test_flash_attn.py), run against autoflash on the host emulator, as a flash-attn user would run
it: its tests, assertions and tolerances unchanged, the imports of `flash_attn_interface` (FA3) and
`flash_attn` (FA2) answered by autoflash's interfaces, "cuda" tensors on the CPU inside
autoflash.emulate(GPU) (autoflash.bench.peer_shim). What autoflash does not run fails the test that
asks for it, with the ValueError naming the feature: those failures are counted by feature.

    python -m autoflash.bench peer-tests --fa3 ~/flash-attention --sample 60 --seed 0
    python -m autoflash.bench peer-tests --fa2 ~/flash-attention --sample 60 --seed 0   # on an emulated A100

Needs a checkout of Dao-AILab/flash-attention (its test files and flash_attn/'s pure-PyTorch helpers;
nothing is built) and einops (the tests import it). fp8 is left out (FLASH_ATTENTION_DISABLE_FP8, a
separate issue); FA2's dropout cases fail on autoflash's named refusal (it has no dropout). Cases
whose seqlen_q x seqlen_k exceeds --max-elements are left out (the emulator runs a 1024 x 1024
backward in minutes); the rest are sampled with --seed. The report (--out) holds every case's
outcome, the first line of each failure, and the kernel families each case launched: the share of
launches on the sm90 family is the H100 coverage figure. Emulated, not timed: no GPU is involved."""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

DEFAULT_OUT = Path("bench/results/acceptance")
# Left out by default: a GPU stress test, not a feature test. It allocates a 70 GiB dummy tensor
# ("under memory load") and repeats its call 1000 times with batch 60 to catch races; on the emulator
# the sanitizer is the race check (python -m autoflash.selfcheck --sanitize --schedules N).
EXCLUDED = ("test_flash_attn_race_condition",)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m autoflash.bench peer-tests", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    peer = p.add_mutually_exclusive_group(required=True)
    peer.add_argument("--fa3", type=Path, metavar="CHECKOUT",
                      help="a flash-attention checkout: its hopper/test_flash_attn.py is run (FlashAttention-3)")
    peer.add_argument("--fa2", type=Path, metavar="CHECKOUT",
                      help="a flash-attention checkout: its tests/test_flash_attn.py is run (FlashAttention-2)")
    p.add_argument("--sample", type=int, default=60, help="cases drawn from those that fit (default 60; 0: all)")
    p.add_argument("--seed", type=int, default=0, help="the draw's seed (default 0)")
    p.add_argument("--max-elements", type=int, default=256 * 256, metavar="N",
                   help="leave out cases with seqlen_q x seqlen_k above N (default 65536)")
    p.add_argument("--gpu", default=None, choices=("a100", "h100", "h200"),
                   help="the emulated GPU (default h100 with --fa3, a100 with --fa2)")
    p.add_argument("-k", dest="keyword", default=None, help="pytest -k expression, applied before the draw")
    p.add_argument("--exclude", default=",".join(EXCLUDED), metavar="NAMES",
                   help=f"comma-separated test functions left out (default {','.join(EXCLUDED)}: a GPU stress test)")
    p.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (default 2; 0: in process)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"report folder (default {DEFAULT_OUT})")
    return p


PEERS = {"fa3": ("hopper/test_flash_attn.py", "FlashAttention-3's hopper/test_flash_attn.py", "h100"),
         "fa2": ("tests/test_flash_attn.py", "FlashAttention-2's tests/test_flash_attn.py", "a100")}


def _peer(args) -> tuple[str, Path]:
    """(fa3 or fa2, the checkout)."""
    return ("fa3", args.fa3) if args.fa3 is not None else ("fa2", args.fa2)


def _test_file(peer: str, checkout: Path) -> Path:
    test = checkout / PEERS[peer][0]
    if not test.is_file():
        raise SystemExit(f"--{peer}: got {checkout}; expected a flash-attention checkout holding {PEERS[peer][0]}")
    return test


def run(args) -> tuple[list[dict], str]:
    peer, checkout = _peer(args)
    test = _test_file(peer, checkout)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    args.out.mkdir(parents=True, exist_ok=True)
    import autoflash

    revision = _revision_of(Path(autoflash.__file__).parent)
    lines = args.out / f"{stamp}-{peer}-{args.gpu}-seed{args.seed}-{revision}.jsonl"
    lines.unlink(missing_ok=True)
    env = dict(os.environ, FLASH_ATTENTION_DISABLE_FP8="TRUE", AUTOFLASH_PEER_GPU=args.gpu,
               AUTOFLASH_PEER_FA2_PACKAGE=str((checkout / "flash_attn").resolve()),
               AUTOFLASH_PEER_SAMPLE=str(args.sample), AUTOFLASH_PEER_SEED=str(args.seed),
               AUTOFLASH_PEER_MAX_ELEMENTS=str(args.max_elements), AUTOFLASH_PEER_REPORT=str(lines.resolve()),
               AUTOFLASH_PEER_EXCLUDE=args.exclude,
               # the test file's folder (its test_util, padding) and the autoflash this command runs
               PYTHONPATH=os.pathsep.join([str(test.parent), str(Path(autoflash.__file__).resolve().parent.parent),
                                           *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, "-m", "pytest", "-p", "autoflash.bench.peer_shim", "-q", "-p", "no:cacheprovider",
           "--rootdir", str(test.parent), str(test), "-o", "addopts=", "-W", "ignore"]
    cmd += ["-k", args.keyword] if args.keyword else []
    cmd += ["-n", str(args.workers)] if args.workers else []
    print(" ".join(cmd), flush=True)
    code = subprocess.run(cmd, cwd=test.parent, env=env).returncode
    records = [json.loads(line) for line in lines.read_text().splitlines()] if lines.exists() else []
    if not records:
        print(f"peer-tests: no case ran (pytest exited {code}; its output above says why: a module the test file "
              f"imports missing, such as einops, or a -k that matches nothing)", file=sys.stderr)
    return records, str(lines)


def _feature(reason: str) -> str:
    """A failure's cause: the feature autoflash refused by name, else the exception's first line."""
    if "autoflash does not run" in reason:
        return reason.split("autoflash does not run", 1)[1].strip(" :")
    return reason


def summarize(records: list[dict]) -> dict:
    final = {}
    for r in records:  # a case's call report, or its setup/teardown failure
        if r["when"] == "call" or r["outcome"] != "passed":
            final.setdefault(r["test"], r)
    per_function = collections.defaultdict(collections.Counter)
    causes = collections.Counter()
    families = collections.Counter()
    for r in final.values():
        per_function[r["function"]][r["outcome"]] += 1
        if r["outcome"] == "failed":
            causes[_feature(r["reason"])] += 1
        families.update(r["families"])
    launches = sum(families.values())
    return {"cases": len(final), "outcomes": dict(collections.Counter(r["outcome"] for r in final.values())),
            "per_function": {k: dict(v) for k, v in sorted(per_function.items())}, "causes": dict(causes.most_common()),
            "launches": dict(families), "sm90_share": families["sm90"] / launches if launches else None}


def render(summary: dict, command: str, source: str) -> str:
    out = [f"# {PEERS[summary['peer']][1]} on autoflash (emulated {summary['gpu']})", "",
           f"command: `{command}`", f"date: {summary['date']}", f"autoflash: {summary['autoflash']}",
           f"flash-attention checkout: {summary['checkout']}", f"records: {Path(source).name}", "",
           "Emulated on the CPU (autoflash.emulate), not timed; " + (
               "fp8 left out (a separate issue)." if summary["peer"] == "fa3" else
               "dropout cases fail on autoflash's refusal (it has no attention dropout)."),
           "The tests' own assertions and tolerances decide. A failure that names a feature is autoflash refusing",
           "it by name.", "",
           f"cases run: {summary['cases']}  outcomes: {summary['outcomes']}", "",
           "| test | passed | failed | skipped |", "|---|---|---|---|"]
    for name, c in summary["per_function"].items():
        out.append(f"| {name} | {c.get('passed', 0)} | {c.get('failed', 0)} | {c.get('skipped', 0)} |")
    out += ["", "failures by cause:", ""]
    out += [f"- {n} x {cause}" for cause, n in summary["causes"].items()] or ["- none"]
    share = summary["sm90_share"]
    out += ["", f"kernel launches by family: {summary['launches']}; on the sm90 family: "
                f"{'n/a' if share is None else f'{100 * share:.0f}%'}", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    import autoflash

    args = make_parser().parse_args(argv)
    peer, checkout = _peer(args)
    args.gpu = args.gpu or PEERS[peer][2]
    records, source = run(args)
    summary = summarize(records)
    summary.update(peer=peer, gpu=args.gpu, date=datetime.date.today().isoformat(), autoflash=_revision(autoflash),
                   checkout=f"{checkout} git {_revision_of(checkout)}")
    command = "python -m autoflash.bench peer-tests " + " ".join(argv if argv is not None else sys.argv[1:])
    text = render(summary, command, source)
    Path(source).with_suffix(".md").write_text(text)
    print(text)
    return 0 if summary["cases"] else 1


def _revision(module) -> str:
    return f"{getattr(module, '__version__', '?')} git {_revision_of(Path(module.__file__).resolve().parent)}"


def _revision_of(path: Path) -> str:
    """The short commit of the git checkout holding `path` (+ "-dirty" with uncommitted changes), or
    "nogit"."""
    try:
        run = lambda *a: subprocess.run(["git", "-C", str(path), *a], capture_output=True, text=True,  # noqa: E731
                                        check=True).stdout.strip()
        return run("rev-parse", "--short", "HEAD") + ("-dirty" if run("status", "--porcelain", "--untracked-files=no")
                                                      else "")
    except (OSError, subprocess.CalledProcessError):
        return "nogit"
