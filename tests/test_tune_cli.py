"""`python -m autoflash.tune` end to end on the CPU: --dry-run, and full tunes on the simulated
backend with a SIGKILL and resume, two tuners on one table, bad tables, no GPU, and (where a
PostgreSQL server is given) two processes on one distributed study."""
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import optuna
import pytest
import torch

from autoflash.kernels.defaults import default_config
from autoflash.kernels.gpus import get_profile
from autoflash.tuning.problem import ProblemKey
from autoflash.tuning.space import default_for
from autoflash.tune import main
from autoflash.tuning.study import is_measured
from autoflash.tuning.table import load_table

# One small space: d64 fp16 forward, 4 warps, 2 stages (17 configs and the default, compiled once).
# Ten candidates a key (nine survive the compile), so that the CLI's own behaviour is what the tests spend on
# --jobs 1: compiles in the tuner's own process. Its pool spawns a process per core, each importing
# torch (~4 CPU-s), while pytest-xdist already keeps the cores busy; test_dry_run_prints_the_pruned_space
# runs the pool.
SMALL = ["--gpu", "h100", "--head-dims", "64", "--dtypes", "fp16", "--directions", "fwd", "--space", "num_stages=2",
         "--space", "num_warps=4", "--space", "block_n=64,128", "--seqlen-buckets", "le1k", "--no-progress", "--jobs", "1"]


def _tune(*args, check=True, **kw):
    proc = subprocess.run([sys.executable, "-m", "autoflash.tune", *args], capture_output=True, text=True,
                          timeout=600, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def _events(log):
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_help_explains_the_tuner(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for phrase in ("--dry-run", "--storage", "--sampler", "--workers", "--timeout", "register spills", "resume",
                   "simulated", "le1k", "--variants", "plain,window,varlen", "sliding window"):
        assert phrase in text, phrase


_ROW = re.compile(r"^  (\w+)\s+(\d+)\s+([\d.]+)$")


@pytest.mark.parametrize("gpu", ["a100", "h100"])
def test_dry_run_prints_the_pruned_space(gpu, capsys):
    args = ["--gpu", gpu, "--dry-run", "--head-dims", "128", "--dtypes", "bf16", "--directions", "fwd", "--causal",
            "off", "--space", "num_stages=3", "--space", "num_warps=8", "--no-progress", "--show-rejected"]
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = [_ROW.match(line).groups() for line in out.splitlines() if _ROW.match(line)]
    limit = get_profile(gpu).smem_per_block_optin
    assert rows
    for name, regs, kib in rows:
        assert name.startswith("fwd_hd128_bf16_m") and 0 < int(regs) <= 255 and float(kib) * 1024 <= limit
    m = re.search(r"(\d+) of (\d+) candidates survive", out)
    assert int(m.group(1)) == len(rows) < int(m.group(2))
    assert "smem" in out and f"per block on {gpu}" in out
    # the built-in default always stays in the space, whatever --space pins
    assert default_config(128, "bf16", False, get_profile(gpu)).name in out
    assert "needs the GPU" in out


def test_dry_run_a100_rejects_what_h100_allows(capsys):
    common = ["--dry-run", "--head-dims", "128", "--dtypes", "bf16", "--directions", "fwd", "--causal", "off",
              "--space", "num_stages=3", "--space", "num_warps=8", "--no-progress", "--jobs", "1"]
    survivors = {}
    for gpu in ("a100", "h100"):
        main(["--gpu", gpu, *common])
        survivors[gpu] = {m.group(1) for line in capsys.readouterr().out.splitlines() if (m := _ROW.match(line))}
    # 163 KiB vs 227 KiB of shared memory per block; each GPU's own default joins its space regardless
    defaults = {default_config(128, "bf16", False, get_profile(g)).name for g in ("a100", "h100")}
    assert survivors["a100"] - defaults < survivors["h100"] - defaults


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_a_gpu_measuring_fails_clearly(tmp_path):
    proc = _tune(*SMALL, "--out", str(tmp_path), check=False)
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "--dry-run" in proc.stderr
    assert not (tmp_path / "h100.json").exists()


def test_simulated_backend_needs_out():
    proc = _tune(*SMALL, "--backend", "simulated", check=False)
    assert proc.returncode == 2 and "--backend simulated needs --out" in proc.stderr


def test_bad_space_option_is_rejected():
    proc = _tune(*SMALL, "--space", "tile=64", "--dry-run", check=False)
    assert proc.returncode == 2 and "expected KNOB=V1,V2" in proc.stderr


def test_a_simulated_tune_prints_no_warnings(tmp_path):
    # Optuna warned on every ask() with a heartbeat storage, and at the storage's creation about its
    # experimental and deprecated arguments: the lines landed inside the progress bar.
    proc = _tune(*SMALL, "--causal", "off", "--backend", "simulated", "--out", str(tmp_path), "--budget", "6",
                 env={**os.environ, "PYTHONWARNINGS": "default"})
    output = proc.stdout + proc.stderr
    assert not re.search(r"Warning\b", output), output


def test_tune_writes_a_valid_table_and_plot(tmp_path):
    proc = _tune(*SMALL, "--causal", "off", "--backend", "simulated", "--out", str(tmp_path), "--budget", "6",
                 "--plot", "--record-timings", str(tmp_path / "timings.json"))
    table = load_table(tmp_path / "h100.json", gpu="h100")
    entry = table.get(ProblemKey("h100", "fwd", "fp16", 64, False, "le1k"))
    assert entry is not None and entry.evaluated == 6 and entry.default is not None
    assert entry.winner.ms <= entry.default.ms and entry.sdpa_flash_ms > 0
    assert table.provenance["backend"] == "simulated" and "autoflash.tune" in table.provenance["command"]
    assert [r.ms for r in entry.runner_ups] == sorted(r.ms for r in entry.runner_ups)
    assert entry.winner.name in proc.stdout and "x SDPA-flash" in proc.stdout
    assert (tmp_path / "h100-search.png").stat().st_size > 1000
    recorded = json.loads((tmp_path / "timings.json").read_text())
    assert len(recorded["timings"]["fwd/fp16/d64/full/le1k"]) == 6
    # the recorded timings replay: the same search on them finds the same winner
    again = tmp_path / "replay"
    _tune(*SMALL, "--causal", "off", "--backend", "simulated", "--out", str(again), "--budget", "6",
          "--simulate-timings", str(tmp_path / "timings.json"))
    assert load_table(again / "h100.json").get(entry.key).winner.name == entry.winner.name


def _measured_in_storage(out):
    """Configs whose trials the storage beside the table holds as COMPLETE."""
    storage = f"sqlite:///{out / 'h100.optuna.db'}"
    done = set()
    for summary in optuna.get_all_study_summaries(storage):
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        done |= {t.user_attrs["config"] for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
                 if "config" in t.user_attrs}
    return done


def test_sigkill_then_the_same_command_resumes(tmp_path):
    log = tmp_path / "log.jsonl"
    cmd = [*SMALL, "--causal", "off", "--backend", "simulated", "--out", str(tmp_path), "--budget", "8",
           "--simulate-delay", "0.4", "--simulate-log", str(log)]
    proc = subprocess.Popen([sys.executable, "-m", "autoflash.tune", *cmd], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300

    def mid_measurement(events):  # three measured, and a fourth started but not ended
        kinds = [e["event"] for e in events]
        return kinds.count("end") >= 3 and kinds.count("start") > kinds.count("end")

    while not mid_measurement(_events(log)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = _events(log)
    recorded = _measured_in_storage(tmp_path)
    assert len(recorded) >= 3  # one worker: a measurement starts only after the last was told
    _tune(*cmd)
    events = _events(log)
    ends = [e["config"] for e in events if e["event"] == "end"]
    assert len(set(ends)) == 8  # the budget met with distinct configs
    repeated = {c for c in ends if ends.count(c) > 1}
    assert not repeated & recorded  # nothing the storage held as measured was measured again
    started = {e["config"] for e in first if e["event"] == "start"}
    assert started <= set(ends)  # what the kill cut off was measured on resume: nothing lost
    entry = load_table(tmp_path / "h100.json").get(ProblemKey("h100", "fwd", "fp16", 64, False, "le1k"))
    assert entry.evaluated == 8


def test_two_tuners_write_one_table(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-m", "autoflash.tune", *SMALL, "--causal", c, "--backend",
                               "simulated", "--out", str(tmp_path), "--budget", "4", "--storage",
                               f"journal:{tmp_path / (c + '.journal')}"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for c in ("off", "on")]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err.decode()[-2000:]
    table = load_table(tmp_path / "h100.json")
    assert set(table.entries) == {"fwd/fp16/d64/full/le1k", "fwd/fp16/d64/causal/le1k"}


def test_a_bad_table_is_left_alone_and_nothing_is_lost(tmp_path):
    path = tmp_path / "h100.json"
    for text in ("{not json", json.dumps({"schema": "autoflash.tuned", "version": 1, "gpu": "a100",
                                          "template_hash": "x", "provenance": {}, "entries": {}})):
        path.write_text(text)
        proc = _tune(*SMALL, "--causal", "off", "--backend", "simulated", "--out", str(tmp_path), "--budget", "3",
                     check=False)
        assert proc.returncode == 1 and str(path) in proc.stderr and "rerun" in proc.stderr
        assert path.read_text() == text
    path.unlink()
    db = tmp_path / "h100.optuna.db"
    n_before = sum(len(s.trials) for s in _all_studies(db))
    _tune(*SMALL, "--causal", "off", "--backend", "simulated", "--out", str(tmp_path), "--budget", "3")
    assert sum(len(s.trials) for s in _all_studies(db)) == n_before  # the kept trials wrote the table
    assert load_table(path).get(ProblemKey("h100", "fwd", "fp16", 64, False, "le1k")).evaluated == 3


def _all_studies(db):
    storage = f"sqlite:///{db}"
    return [optuna.load_study(study_name=s.study_name, storage=storage) for s in optuna.get_all_study_summaries(storage)]


POSTGRES = os.environ.get("AUTOFLASH_TEST_POSTGRES_URL")


@pytest.mark.skipif(not POSTGRES, reason="AUTOFLASH_TEST_POSTGRES_URL not set (.ci/run starts a server)")
def test_two_processes_share_one_study_through_postgresql(tmp_path):
    log = tmp_path / "log.jsonl"
    name = f"ci-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "autoflash.tune", *SMALL, "--causal", "both", "--backend", "simulated", "--out",
           str(tmp_path), "--budget", "8", "--simulate-delay", "0.2", "--simulate-log", str(log), "--storage", POSTGRES,
           "--study-name", name]
    procs = []
    for _ in range(2):
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        time.sleep(1.0)
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err.decode()[-3000:]
    events = _events(log)
    assert len({e["pid"] for e in events}) == 2  # both processes measured
    starts = [(e["key"], e["trial"]) for e in events if e["event"] == "start"]
    assert len(starts) == len(set(starts))  # every trial evaluated exactly once
    table = load_table(tmp_path / "h100.json")
    assert set(table.entries) == {"fwd/fp16/d64/full/le1k", "fwd/fp16/d64/causal/le1k"}  # merged, complete
    for key in table.entries.values():
        study = optuna.load_study(study_name=f"{name}/{key.key}", storage=POSTGRES)
        measured = [t for t in study.get_trials() if is_measured(t)]
        assert sorted(t.number for t in measured) == sorted(n for k, n in starts if k == key.key.slug)
        assert 8 <= len(measured) <= 9 and key.evaluated >= 8  # the budget, plus at most one in flight


# ------------------------------------------------------------------ --variants
# A tiny space per variant: d64 fp16 forward, 4 warps, 2 stages, tiles of 64 or 128 (4 configs, the variant
# defaults among them, compiled once per variant kernel and cached on disk).
TINY = ["--head-dims", "64", "--dtypes", "fp16", "--directions", "fwd", "--space", "num_stages=2", "--space",
        "num_warps=4", "--space", "block_m=64,128", "--space", "block_n=64,128", "--seqlen-buckets", "le1k",
        "--no-progress", "--jobs", "1"]


def test_dry_run_compiles_and_prunes_the_window_kernels_offline(capsys):
    assert main(["--gpu", "a100", "--dry-run", "--variants", "window", "--causal", "both", *TINY]) == 0
    captured = capsys.readouterr()
    out = captured.out
    key = ProblemKey("a100", "fwd", "fp16", 64, True, "le1k", "window")
    default = default_for(key, get_profile("a100"))
    assert f"a100 fwd fp16 d64 causal window (default {default.name})" in out
    rows = [m.group(1) for line in out.splitlines() if (m := _ROW.match(line))]
    assert rows and all("_br_win_" in name for name in rows)  # the variant's kernels, not plain ones
    m = re.search(r"(\d+) of (\d+) candidates survive", out)
    assert int(m.group(1)) == len(rows) and int(m.group(2)) == 4  # 2 x 2 tiles, the default (128 x 64) among them
    assert "non-causal window" not in out and "needs the GPU" in out
    assert "no keys for window fp16 non-causal" in captured.err  # window keys are causal: said, not silently dropped


def test_dry_run_lists_one_space_per_variant(capsys):
    assert main(["--gpu", "h100", "--dry-run", "--variants", "plain,varlen", "--causal", "on", *TINY]) == 0
    out = capsys.readouterr().out
    assert "h100 fwd fp16 d64 causal (default fwd_hd64_fp16_causal_m" in out
    assert "h100 fwd fp16 d64 causal varlen (default fwd_hd64_fp16_causal_br_varlen_m" in out
    assert out.count("candidates survive") == 2


def test_variants_that_make_no_key_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--gpu", "h100", "--dry-run", "--variants", "window", "--causal", "off", *TINY])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "got no problem key" in err and "--causal on or both" in err
    with pytest.raises(SystemExit) as e:
        main(["--gpu", "h100", "--dry-run", "--variants", "window,softcap", *TINY])
    assert e.value.code == 2 and "plain,window,varlen" in capsys.readouterr().err


def test_a_simulated_tune_of_a_window_key_writes_its_entry(tmp_path):
    proc = _tune(*TINY, "--gpu", "h100", "--variants", "window", "--causal", "on", "--backend", "simulated",
                 "--out", str(tmp_path), "--budget", "3")
    key = ProblemKey("h100", "fwd", "fp16", 64, True, "le1k", "window")
    table = load_table(tmp_path / "h100.json")
    assert set(table.entries) == {key.slug}
    entry = table.get(key)
    assert entry.evaluated == 3 and entry.winner.config.window and key.matches(entry.winner.config)
    assert entry.default.name == default_for(key, get_profile("h100")).name
    assert entry.sdpa_flash_ms is None  # SDPA-flash has no sliding window: no baseline, not a made-up one
    assert key.label in proc.stdout


def test_a_dry_run_where_nothing_survives_fails_and_says_why(monkeypatch, capsys):
    # NVRTC that refuses every kernel (as 13.0.88 without its builtins did, or a ptxas notice through
    # the gate): the dry run said "0 of N candidates survive" and exited 0, the cause visible only as
    # ptxas's closing "Compile time" line under --show-rejected.
    from autoflash.kernels import compiler
    from autoflash.tuning import space

    log = ("ptxas info    : (C7519) warpgroup.arrive is injected in around line 412 by compiler to allow use of "
           "registers in GMMA in function 'x'\nptxas info    : Compile time = 879.000 ms")

    def refuse(config, arch):
        raise compiler.CompileError(config.name, arch, "the sm90 family's ptxas gate refused it:\n" + log.splitlines()[0]
                                    + "\n--- full log ---\n" + log if config.family == "sm90" else log, config)

    monkeypatch.setattr(compiler, "compile_config", refuse)
    assert main(["--gpu", "h100", "--dry-run", "--show-rejected", *TINY]) == 1
    captured = capsys.readouterr()
    assert "0 of" in captured.out and "Compile time" not in captured.out
    assert "(C7519) warpgroup.arrive is injected" in captured.out
    assert "no candidate survives" in captured.err and "compile: " in captured.err
    assert space._compile_one  # the candidates came through the tuner's own compile step


def test_a_dry_run_fails_when_the_default_is_rejected(monkeypatch, capsys):
    from autoflash.kernels import compiler

    default = default_config(64, "fp16", True, get_profile("h100"))
    real = compiler.compile_config

    def refuse_default(config, arch):
        if config == default:
            raise compiler.CompileError(config.name, arch, "ptxas info    : 80 bytes spill stores", config)
        return real(config, arch)

    monkeypatch.setattr(compiler, "compile_config", refuse_default)
    assert main(["--gpu", "h100", "--dry-run", "--causal", "on", *TINY]) == 1
    err = capsys.readouterr().err
    assert f"the built-in default {default.name} is rejected" in err
