"""CPU tier of `python -m autoflash.bench dispatch` and `... train`: they run, report what they
measured, and judge only what this machine can judge."""
import json

import pytest
import torch

from autoflash import bench
from autoflash.bench import dispatch as bench_dispatch
from autoflash.bench import train as bench_train


def test_dispatch_benchmark_reports_its_rows(tmp_path, capsys):
    out = tmp_path / "dispatch.json"
    assert bench.main(["dispatch", "--calls", "50", "--rounds", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    record = json.loads(out.read_text())
    rows = {r["what"]: r["us"] for r in record["rows"]}
    assert {"sdpa (cpu)", "plan", "select_config", "custom op (meta)"} <= set(rows)
    assert all(us > 0 for us in rows.values())
    assert record["overhead_us"] == pytest.approx(rows["plan"] + rows["select_config"])
    assert "judged on a GPU run" in text  # no GPU: no verdict on the 20 us target
    assert record["command"] == f"python -m autoflash.bench dispatch --calls 50 --rounds 2 --json {out}"


def test_dispatch_verdict_comes_from_the_gpu_row():
    rows = [{"what": "plan", "us": 5.0}, {"what": "select_config", "us": 2.0}, {"what": "autoflash (cuda)", "us": 25.0}]
    total, how, full = bench_dispatch.overhead_us(rows)
    assert (total, full) == (25.0, True) and "GPU" in how


def test_dispatch_rejects_an_unknown_gpu(capsys):
    with pytest.raises(SystemExit):
        bench.main(["dispatch", "--gpu", "h900", "--calls", "5", "--rounds", "1"])
    assert "h900" in capsys.readouterr().err


def test_train_smoke_on_cpu(tmp_path, capsys):
    out = tmp_path / "train.json"
    code = bench.main(["train", "--device", "cpu", "--layers", "1", "--dim", "64", "--heads", "2", "--kv-heads", "1",
                       "--vocab", "64", "--batch", "2", "--seqlen", "32", "--steps", "8", "--warmup-steps", "2",
                       "--lr", "3e-3", "--no-compile", "--json", str(out)])
    record = json.loads(out.read_text())
    assert code == 0 and record["pass"], capsys.readouterr().out
    sdpa, ours = record["runs"]
    assert len(sdpa["losses"]) == len(ours["losses"]) == 8
    assert sdpa["losses"] == ours["losses"]  # on the CPU both runs are SDPA, from the same seed: identical
    assert sdpa["losses"][-1] < sdpa["losses"][0] and ours["tokens_per_s"] > 0


def test_train_without_gpu_exits_2(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert bench.main(["train", "--steps", "2", "--warmup-steps", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_train_rejects_bad_shapes(capsys):
    with pytest.raises(SystemExit):
        bench_train.main(["--dim", "100", "--heads", "3"])
    assert "expected heads dividing dim" in capsys.readouterr().err


def test_bench_emulator_reports_its_figures(tmp_path, capsys):
    from autoflash.bench import main

    out = tmp_path / "emu.json"
    assert main(["emulator", "--gpu", "l4", "--shape", "1,2,1,40,60,64", "--reps", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "emulated l4" in text and "meets the 10 s target" in text and "not a GPU figure" in text
    data = json.loads(out.read_text())
    assert set(data["figures"]) == {"first_call_s", "fwd_s", "bwd_s", "fwdbwd_s"}
    assert all(v > 0 for v in data["figures"].values()) and data["template_hash"] and data["cores"] >= 1
    # an impossible target is reported as missed, with status 1
    assert main(["emulator", "--gpu", "l4", "--shape", "1,1,1,16,16,64", "--reps", "1", "--target-s", "0"]) == 1
