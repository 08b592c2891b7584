"""autoflash.bench decode: no-GPU exit, and the whole loop end to end on the CPU: the decode kernels
on the emulator, CUDA's events and device queries faked (timings are the fake clock's, not data)."""
import json
import types

import pytest
import torch

import autoflash
from autoflash.bench import decode
from autoflash.kernels.gpus import get_profile


def test_without_a_gpu_it_says_so_and_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert decode.main(["--batches", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bad_lengths_are_argparse_errors(capsys):
    with pytest.raises(SystemExit):
        decode.main(["--cache-lens", "4q"])
    assert "expected comma-separated lengths" in capsys.readouterr().err


class _Event:
    clock = 0.0

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        _Event.clock += 0.25
        self.t = _Event.clock

    def elapsed_time(self, other):
        return other.t - self.t


@pytest.fixture
def emulated_cuda(monkeypatch):
    monkeypatch.setattr(decode, "DEVICE", "cpu")
    monkeypatch.setattr(decode, "_profile", lambda torch: get_profile("h100"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Emulated H100")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(L2_cache_size=1 << 20))
    with autoflash.emulate("h100"):
        yield


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes CUDA on a machine without it")
@pytest.mark.parametrize("extra", [[], ["--page-size", "64", "--seqlen-q", "3"]])
def test_the_loop_runs_checks_and_reports(emulated_cuda, tmp_path, capsys, extra):
    out = tmp_path / "decode.json"
    argv = ["--head-dim", "64", "--heads", "4", "--kv-heads", "2", "--batches", "2", "--cache-lens", "200",
            "--reps", "2", "--json", str(out), *extra]
    assert decode.main(argv) == 0
    text = capsys.readouterr().out
    assert "autoflash " in text and "sdpa " in text and "GB/s" in text and "% HBM" in text
    rows = json.loads(out.read_text())["rows"]
    (row,) = rows
    assert row["kv_bytes"] == 2 * 2 * 200 * 2 * 64 * 2
    for name in ("autoflash", "autoflash-unsplit", "sdpa"):
        r = row[name]
        assert r["status"] == "ok", r
        assert r["gb_per_s"] == pytest.approx(row["kv_bytes"] / (r["ms_median"] * 1e-3) / 1e9)
        assert r["hbm_share"] == pytest.approx(r["gb_per_s"] / get_profile("h100").mem_bandwidth_gbs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes CUDA on a machine without it")
def test_a_wrong_result_is_failed_not_timed(emulated_cuda, monkeypatch, capsys):
    real = autoflash.flash_attn_with_kvcache
    monkeypatch.setattr(autoflash, "flash_attn_with_kvcache", lambda *a, **k: real(*a, **k) + 0.5)
    assert decode.main(["--head-dim", "64", "--heads", "2", "--kv-heads", "2", "--batches", "1",
                        "--cache-lens", "64", "--reps", "2"]) == 1
    assert "autoflash FAILED" in capsys.readouterr().out
