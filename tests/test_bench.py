"""CPU tier for autoflash.bench: FLOP count, sweep, flags, no-GPU exit, record, table, plot, and the
whole measuring loop run end to end on CPU with CUDA faked (the only GPU test needs a real GPU)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import types

import pytest
import torch

from autoflash import bench


def test_flops_formula_and_causal_halving():
    assert bench.flops(2, 16, 1024, 1024, 128, False) == 4 * 2 * 16 * 1024 * 1024 * 128
    assert bench.flops(2, 16, 1024, 1024, 128, True) == 2 * 2 * 16 * 1024 * 1024 * 128
    assert bench.flops(1, 1, 3, 5, 8, False) == 4 * 3 * 5 * 8  # seqlen_q and seqlen_k are separate factors
    # 1e12 FLOPs in 1 ms is 1000 TFLOPs
    assert bench.tflops(1e12, 1.0) == pytest.approx(1000.0)
    assert "4 * batch * heads * seqlen_q * seqlen_k * head_dim" in bench.FLOPS_FORMULA
    assert "halved when causal" in bench.FLOPS_FORMULA


def test_default_sweep_is_flashattentions():
    args = bench.make_parser().parse_args([])
    assert (args.dtype, args.hidden, args.tokens, args.causal) == ("bf16", 2048, 16384, "both")
    assert args.head_dims == [64, 128] and args.seqlens == [512, 1024, 2048, 4096, 8192, 16384]
    assert args.backends == ["autoflash", "flash", "efficient", "cudnn"]
    shapes = bench.build_sweep(args.head_dims, args.seqlens, hidden=args.hidden, tokens=args.tokens)
    assert len(shapes) == 2 * 2 * 6
    for s in shapes:
        assert s.heads * s.head_dim == 2048 and s.batch * s.seqlen == 16384
    first = shapes[0]
    assert (first.batch, first.heads, first.seqlen, first.head_dim, first.causal) == (32, 32, 512, 64, False)
    assert {(s.head_dim, s.causal) for s in shapes} == {(64, False), (64, True), (128, False), (128, True)}
    assert shapes[0].flops == bench.flops(32, 32, 512, 512, 64, False)
    causal_8k = [s for s in shapes if s.seqlen == 8192 and s.head_dim == 128 and s.causal][0]
    assert (causal_8k.batch, causal_8k.heads) == (2, 16) and "causal" in causal_8k.label


def test_seqlen_k_suffix_and_causal_modes():
    args = bench.make_parser().parse_args(["--seqlens", "1k,2K,512", "--causal", "on", "--head-dims", "96"])
    assert args.seqlens == [1024, 2048, 512] and args.head_dims == [96]
    shapes = bench.build_sweep(args.head_dims, args.seqlens, hidden=3072, tokens=8192,
                               causal=bench.CAUSAL_MODES[args.causal])
    assert [(s.batch, s.heads, s.causal) for s in shapes] == [(8, 32, True), (4, 32, True), (16, 32, True)]


@pytest.mark.parametrize("kwargs, flag, got", [
    (dict(head_dims=[60], seqlens=[512], hidden=2040, tokens=1024), "--head-dims", "60"),
    (dict(head_dims=[16], seqlens=[512], hidden=2048, tokens=1024), "--head-dims", "16"),
    (dict(head_dims=[264], seqlens=[512], hidden=264, tokens=1024), "--head-dims", "264"),
    (dict(head_dims=[64, 96], seqlens=[512], hidden=2048, tokens=1024), "--hidden", "2048"),
    (dict(head_dims=[64], seqlens=[512, 3000], hidden=2048, tokens=16384), "--tokens", "16384"),
    (dict(head_dims=[64], seqlens=[0], hidden=2048, tokens=16384), "--seqlens", "0"),
])
def test_build_sweep_rejects_bad_values(kwargs, flag, got):
    with pytest.raises(ValueError) as e:
        bench.build_sweep(kwargs.pop("head_dims"), kwargs.pop("seqlens"), **kwargs)
    assert flag in str(e.value) and f"got {got}" in str(e.value) and "expected" in str(e.value)


@pytest.mark.parametrize("argv, words", [
    (["--head-dims", "60"], ["--head-dims", "got 60", "multiples of 8", "[32, 256]"]),
    (["--head-dims", "64,abc"], ["--head-dims", "'64,abc'", "comma-separated integers"]),
    (["--hidden", "2000"], ["--hidden", "got 2000", "multiple"]),
    (["--tokens", "1000"], ["--tokens", "got 1000", "multiple"]),
    (["--backends", "flash,triton"], ["--backends", "triton", "autoflash,flash,efficient,cudnn"]),
    (["--dtype", "fp8"], ["--dtype", "fp8", "bf16"]),
    (["--causal", "maybe"], ["--causal", "maybe", "both"]),
    (["--reps", "0"], ["--reps", "got 0"]),
])
def test_bad_flags_are_argparse_errors(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, (w, err)


def test_help_explains_measurement(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for w in ("4 * batch * heads * seqlen_q * seqlen_k * head_dim", "halved when causal", "CUDA events",
              "L2", "median", "FLASH", "cuDNN", "--backends", "--tokens", "fwd.json"):
        assert w.lower() in out.lower(), w


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_main_without_gpu_says_so_and_fails(capsys):
    assert bench.main(["--head-dims", "64", "--seqlens", "512"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "torch.cuda.is_available() is False" in err
    assert "python -m autoflash.render --default" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_cli_without_gpu_exits_2_before_importing_cupy():
    code = ("import sys; from autoflash import bench; rc = bench.main([]); "
            "print('cupy' in sys.modules); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout.split() == ["False"], (r.stdout, r.stderr)
    assert "needs a CUDA GPU" in r.stderr
    r = subprocess.run([sys.executable, "-m", "autoflash.bench", "--no-plot"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr


def _measurement(backend, seqlen, head_dim, causal, ms=None, status="ok", **extra):
    sh = bench.Shape(16384 // seqlen, 2048 // head_dim, seqlen, head_dim, causal)
    m = {"shape": sh.label, "batch": sh.batch, "heads": sh.heads, "seqlen": seqlen, "head_dim": head_dim,
         "causal": causal, "dtype": "bf16", "flops": sh.flops, "backend": backend, "status": status,
         "config": f"fwd_hd{head_dim}_bf16_m128n64w4s2" if backend == "autoflash" else None}
    if ms is not None:
        m.update(ms_median=ms, ms_min=ms * 0.9, ms_max=ms * 1.2, tflops=bench.tflops(sh.flops, ms))
    m.update(extra)
    return m


def _synthetic_measurements():
    ms = []
    for d in (64, 128):
        for c in (False, True):
            for s in (512, 1024, 2048):
                ms.append(_measurement("autoflash", s, d, c, ms=1.0 + s / 1024))
                ms.append(_measurement("flash", s, d, c, ms=0.8 + s / 1024))
                ms.append(_measurement("efficient", s, d, c, ms=1.5 + s / 1024))
                ms.append(_measurement("cudnn", s, d, c, status="unsupported", reason="No available kernel"))
    ms.append(_measurement("autoflash", 4096, 64, False, status="failed", err=0.5, bound=0.01))
    return ms


DEVICE = {"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "driver_version": "13.0"}
SOFTWARE = {"torch": "2.13.0", "cupy": "14.2.0", "nvrtc": "13.0", "autoflash": "0.1.0", "template_hash": "abc123"}


def _record(measurements):
    return bench.build_record(command="python -m autoflash.bench --head-dims 64", date="2025-01-02T03:04:05+00:00",
                              device=DEVICE, software=SOFTWARE, settings={"dtype": "bf16", "reps": 30},
                              measurements=measurements)


def test_build_record_has_provenance():
    ms = _synthetic_measurements()
    rec = _record(ms)
    prov = rec["provenance"]
    assert prov["command"] == "python -m autoflash.bench --head-dims 64"
    assert prov["date"] == "2025-01-02T03:04:05+00:00"
    for key in ("name", "compute_capability", "driver_version"):
        assert prov["device"][key] == DEVICE[key]
    for key in ("torch", "cupy", "nvrtc", "autoflash", "template_hash"):
        assert prov["software"][key] == SOFTWARE[key]
    configs = prov["kernel_configs"]
    assert configs[bench.Shape(32, 32, 512, 64, False).label] == "fwd_hd64_bf16_m128n64w4s2"
    assert len(configs) == 13 and all(v.startswith("fwd_hd") for v in configs.values())
    assert rec["flops_formula"] == bench.FLOPS_FORMULA and rec["measurements"] == ms
    assert json.loads(json.dumps(rec)) == rec  # plain JSON data
    with pytest.raises(ValueError, match="template_hash"):
        bench.build_record(command="", date="", device=DEVICE, software={"torch": "x"}, settings={}, measurements=[])


def test_format_table_ratio_and_statuses():
    ms = [_measurement("autoflash", 1024, 64, False, ms=1.0), _measurement("flash", 1024, 64, False, ms=2.0),
          _measurement("cudnn", 1024, 64, False, status="unsupported", reason="No available kernel"),
          _measurement("autoflash", 2048, 64, False, status="failed", err=0.25, bound=0.01),
          _measurement("efficient", 2048, 64, False, status="error", reason="RuntimeError: boom")]
    lines = bench.format_table(ms).splitlines()
    assert "TFLOPs" in lines[0] and "/flash" in lines[0]
    assert "2.00x" in lines[1] and "1.000" in lines[1] and "fwd_hd64" in lines[1]  # twice as fast as flash
    assert "1.00x" in lines[2]
    assert "unsupported" in lines[3] and "No available kernel" in lines[3]
    assert "failed" in lines[4] and "0.25" in lines[4] and "0.01" in lines[4]
    assert "error" in lines[5] and "boom" in lines[5]


def test_summarize():
    assert bench.summarize([3.0, 1.0, 2.0, 10.0, 2.5]) == {"ms_median": 2.5, "ms_min": 1.0, "ms_max": 10.0}


def test_plot_results_writes_png_from_json(tmp_path):
    rec = json.loads(json.dumps(_record(_synthetic_measurements())))
    path = tmp_path / "plot.png"
    bench.plot_results(rec, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


# ------------------------------------------------- the measuring loop on CPU, with CUDA faked


class _FakeEvent:
    clock = 0.0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self):
        _FakeEvent.clock += 0.5
        self.t = _FakeEvent.clock

    def elapsed_time(self, other):
        return other.t - self.t


@pytest.fixture
def fake_cuda(monkeypatch):
    """Runs bench.main on CPU: tensors on cpu, events and device queries faked, autoflash's GPU modules
    replaced by a PyTorch stand-in (``state['offset']`` makes its output wrong)."""
    from autoflash.reference import attention_ref

    state = {"offset": 0.0, "calls": 0}

    def flash_forward(q, k, v, *, causal=False, scale=None, config=None):
        assert config is not None and q.device.type == "cpu"
        state["calls"] += 1
        out, lse = attention_ref(q, k, v, causal=causal, scale=scale)
        return out.to(q.dtype) + state["offset"], lse

    def default_config(head_dim, dtype, causal, profile):
        return types.SimpleNamespace(name=f"fwd_hd{head_dim}_{dtype}{'_causal' if causal else ''}_m64n64w4s2")

    mods = {"autoflash.launch": dict(flash_forward=flash_forward),
            "autoflash.defaults": dict(default_config=default_config),
            "autoflash.gpus": dict(detect=lambda: types.SimpleNamespace(name="fake h100"))}
    for name, attrs in mods.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake H100")
    props = types.SimpleNamespace(multi_processor_count=132, total_memory=80 << 30, L2_cache_size=50 << 20)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: props)
    return state


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes CUDA on a machine without it")
def test_main_end_to_end_with_fake_cuda(fake_cuda, tmp_path, capsys):
    argv = ["--dtype", "fp32", "--head-dims", "32", "--seqlens", "64,128", "--hidden", "64", "--tokens", "256",
            "--reps", "3", "--warmup", "1", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert bench.FLOPS_FORMULA in out and "autoflash" in out and "unsupported" in out
    (js,) = tmp_path.glob("*-fwd.json")
    (png,) = tmp_path.glob("*-fwd.png")
    assert png.stat().st_size > 0 and js.name.replace("-fwd.json", "") == png.name.replace("-fwd.png", "")
    rec = json.loads(js.read_text())
    prov = rec["provenance"]
    assert prov["command"] == "python -m autoflash.bench " + " ".join(argv)
    assert prov["device"]["name"] == "Fake H100" and prov["device"]["compute_capability"] == "9.0"
    for key in ("driver_version",):
        assert key in prov["device"]
    for key in ("torch", "cupy", "nvrtc", "autoflash", "template_hash"):
        assert key in prov["software"]
    assert len(prov["kernel_configs"]) == 4 and all(v.startswith("fwd_hd32_fp32") for v in prov["kernel_configs"].values())
    ms = rec["measurements"]
    assert len(ms) == 4 * 4  # 4 shapes x 4 backends
    auto = [m for m in ms if m["backend"] == "autoflash"]
    assert all(m["status"] == "ok" for m in auto)
    for m in auto:
        assert m["ms_median"] == pytest.approx(0.5) and m["ms_min"] <= m["ms_median"] <= m["ms_max"]
        assert m["tflops"] == pytest.approx(bench.tflops(m["flops"], 0.5))
        assert m["err"] <= m["bound"] and m["heads"] * m["head_dim"] == 64 and m["batch"] * m["seqlen"] == 256
    assert fake_cuda["calls"] == 4 * (1 + 1 + 3)  # per shape: check, warm-up, reps
    # cuDNN / efficient refuse CPU tensors: recorded with torch's reason, not a crash
    for m in ms:
        if m["backend"] in ("efficient", "cudnn"):
            assert m["status"] == "unsupported" and m["reason"]
        assert m["status"] in ("ok", "unsupported", "failed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes CUDA on a machine without it")
def test_wrong_autoflash_result_is_failed_not_timed(fake_cuda, tmp_path):
    fake_cuda["offset"] = 0.1
    argv = ["--dtype", "fp32", "--head-dims", "32", "--seqlens", "64", "--hidden", "64", "--tokens", "128",
            "--causal", "off", "--backends", "autoflash", "--reps", "3", "--out", str(tmp_path), "--no-plot"]
    assert bench.main(argv) == 1
    assert not list(tmp_path.glob("*.png"))
    (m,) = json.loads(next(tmp_path.glob("*-fwd.json")).read_text())["measurements"]
    assert m["status"] == "failed" and m["err"] > m["bound"] and "ms_median" not in m
    assert math.isclose(m["err"], 0.1, rel_tol=1e-3)
    assert fake_cuda["calls"] == 1  # checked once, never timed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_main_on_gpu_small_sweep(tmp_path):
    argv = ["--head-dims", "64", "--seqlens", "512", "--causal", "both", "--reps", "3", "--warmup", "1",
            "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    rec = json.loads(next(tmp_path.glob("*-fwd.json")).read_text())
    auto = [m for m in rec["measurements"] if m["backend"] == "autoflash"]
    assert len(auto) == 2 and all(m["status"] == "ok" and m["tflops"] > 0 for m in auto)
    assert rec["provenance"]["device"]["name"] == torch.cuda.get_device_name()


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes CUDA on a machine without it")
def test_reference_failure_is_recorded_not_a_crash(fake_cuda, tmp_path, monkeypatch):
    import autoflash.reference

    def boom(*a, **kw):
        raise RuntimeError("CUDA out of memory (fake)")

    monkeypatch.setattr(autoflash.reference, "attention_ref", boom)
    argv = ["--dtype", "fp32", "--head-dims", "32", "--seqlens", "64", "--hidden", "64", "--tokens", "128",
            "--causal", "on", "--backends", "autoflash,flash", "--out", str(tmp_path), "--no-plot"]
    assert bench.main(argv) == 1
    ms = json.loads(next(tmp_path.glob("*-fwd.json")).read_text())["measurements"]
    assert [m["backend"] for m in ms] == ["autoflash", "flash"]
    assert all(m["status"] == "error" and "reference" in m["reason"] and "fake" in m["reason"] for m in ms)
    assert fake_cuda["calls"] == 0
