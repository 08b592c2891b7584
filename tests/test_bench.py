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

from autoflash.bench import kernels as bench


def test_flops_formula_and_causal_halving():
    assert bench.flops(2, 16, 1024, 1024, 128, False) == 4 * 2 * 16 * 1024 * 1024 * 128
    assert bench.flops(2, 16, 1024, 1024, 128, True) == 2 * 2 * 16 * 1024 * 1024 * 128
    assert bench.flops(1, 1, 3, 5, 8, False) == 4 * 3 * 5 * 8  # seqlen_q and seqlen_k are separate factors
    # 1e12 FLOPs in 1 ms is 1000 TFLOPs
    assert bench.tflops(1e12, 1.0) == pytest.approx(1000.0)
    assert "4 * batch * heads * seqlen_q * seqlen_k * head_dim" in bench.FLOPS_FORMULA
    assert "halved when causal" in bench.FLOPS_FORMULA


@pytest.mark.parametrize("direction, factor", [("fwd", 1.0), ("bwd", 2.5), ("fwdbwd", 3.5)])
@pytest.mark.parametrize("causal", [False, True])
def test_flops_per_direction_are_flashattentions(direction, factor, causal):
    fwd = 4 * 2 * 16 * 1024 * 1024 * 128 / (2 if causal else 1)
    assert bench.flops(2, 16, 1024, 1024, 128, causal, direction) == pytest.approx(factor * fwd)
    assert bench.FLOPS_FACTORS[direction] == factor
    assert bench.flops(2, 16, 1024, 1024, 128, causal) == fwd  # forward by default
    for words in ("2.5 * fwd FLOPs", "3.5 * fwd FLOPs", "benchmark_flash_attention.py"):
        assert words in bench.DIRECTION_FLOPS_FORMULA
    with pytest.raises(ValueError, match="sideways"):
        bench.flops(1, 1, 8, 8, 32, False, "sideways")


def test_default_sweep_is_flashattentions():
    args = bench.make_parser().parse_args([])
    assert (args.dtype, args.hidden, args.tokens, args.causal) == ("bf16", 2048, 16384, "both")
    assert args.head_dims == [64, 128] and args.seqlens == [512, 1024, 2048, 4096, 8192, 16384]
    assert args.backends == ["autoflash", "flash", "efficient", "cudnn"]  # math only on request
    assert args.direction == "all" and bench.DIRECTION_MODES[args.direction] == ("fwd", "bwd", "fwdbwd")
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
    (["--direction", "sideways"], ["--direction", "sideways", "fwd", "bwd", "fwdbwd", "all"]),
    (["--direction", "fwd,bwd"], ["--direction", "fwd,bwd"]),
    (["--backends", "math,naive"], ["--backends", "naive", "math"]),
])
def test_bad_flags_are_argparse_errors(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize("value", ["fwd", "bwd", "fwdbwd", "all"])
def test_direction_flag_accepts_each_direction(value):
    args = bench.make_parser().parse_args(["--direction", value, "--backends", "autoflash,math"])
    assert args.direction == value and args.backends == ["autoflash", "math"]
    assert set(bench.DIRECTION_MODES[value]) <= set(bench.DIRECTIONS)


def test_help_explains_measurement(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for w in ("4 * batch * heads * seqlen_q * seqlen_k * head_dim", "halved when causal", "CUDA events",
              "L2", "median", "FLASH", "cuDNN", "--backends", "--tokens", "<date>-bench.json", "<date>-fwd.png",
              "<date>-bwd.png", "<date>-fwdbwd.png", "--direction", "2.5 * fwd FLOPs", "3.5 * fwd FLOPs",
              "hopper/test_flash_attn.py", "peak memory", "max_memory_allocated", "math is SDPA's unfused reference",
              "for the memory comparison", "fp64 for fp32 inputs"):
        assert w.lower() in " ".join(out.split()).lower(), w  # argparse re-wraps the option help


def test_help_lists_every_subcommand_and_speaks_of_the_project(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = capsys.readouterr().out
    for sub in ("dispatch", "train", "emulator", "decode", "sass"):
        assert f"python -m autoflash.bench {sub} --help" in out, sub
    from autoflash.bench import emulator

    assert "issue" not in emulator.__doc__


def test_dir_shows_the_public_names_only():
    import autoflash

    public = [n for n in dir(autoflash) if not n.startswith("_")]
    assert public == sorted(autoflash._EXPORTS) and "__version__" in dir(autoflash)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_main_without_gpu_says_so_and_fails(capsys):
    assert bench.main(["--head-dims", "64", "--seqlens", "512"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "torch.cuda.is_available() is False" in err
    assert "python -m autoflash.render --default" in err
    assert bench.main(["--direction", "bwd", "--backends", "math"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_cli_without_gpu_exits_2_before_importing_cupy():
    code = ("import sys; from autoflash import bench; rc = bench.main([]); "
            "print('cupy' in sys.modules); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout.split() == ["False"], (r.stdout, r.stderr)
    assert "needs a CUDA GPU" in r.stderr
    r = subprocess.run([sys.executable, "-m", "autoflash.bench", "--no-plot"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr


def _measurement(backend, seqlen, head_dim, causal, ms=None, status="ok", direction="fwd", peak_mib=None, **extra):
    sh = bench.Shape(16384 // seqlen, 2048 // head_dim, seqlen, head_dim, causal)
    n_flops = bench.flops(sh.batch, sh.heads, seqlen, seqlen, head_dim, causal, direction)
    auto = backend == "autoflash"
    m = {"shape": sh.label, "batch": sh.batch, "heads": sh.heads, "seqlen": seqlen, "head_dim": head_dim,
         "causal": causal, "dtype": "bf16", "flops": n_flops, "backend": backend, "direction": direction,
         "status": status, "config": f"fwd_hd{head_dim}_bf16_m128n64w4s2" if auto else None,
         "backward_config": f"bwd_hd{head_dim}_bf16_m32n128w8s2" if auto and direction != "fwd" else None}
    if ms is not None:
        m.update(ms_median=ms, ms_min=ms * 0.9, ms_max=ms * 1.2, tflops=bench.tflops(n_flops, ms),
                 peak_mib=peak_mib if peak_mib is not None else 64.0 * bench.FLOPS_FACTORS[direction])
    m.update(extra)
    return m


def _synthetic_measurements(directions=("fwd",)):
    ms = []
    for direction in directions:
        k = bench.FLOPS_FACTORS[direction]
        for d in (64, 128):
            for c in (False, True):
                for s in (512, 1024, 2048):
                    ms.append(_measurement("autoflash", s, d, c, ms=k * (1.0 + s / 1024), direction=direction))
                    ms.append(_measurement("flash", s, d, c, ms=k * (0.8 + s / 1024), direction=direction))
                    ms.append(_measurement("efficient", s, d, c, ms=k * (1.5 + s / 1024), direction=direction))
                    ms.append(_measurement("math", s, d, c, ms=k * (4.0 + s / 256), direction=direction,
                                           peak_mib=s * s / 1024))
                    ms.append(_measurement("cudnn", s, d, c, status="unsupported", reason="No available kernel",
                                           direction=direction))
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
    assert configs[bench.Shape(32, 32, 512, 64, False).label] == {"fwd": "fwd_hd64_bf16_m128n64w4s2"}
    assert len(configs) == 13 and all(set(v) == {"fwd"} and v["fwd"].startswith("fwd_hd") for v in configs.values())
    assert rec["flops_formula"] == bench.FLOPS_FORMULA and rec["measurements"] == ms
    assert rec["direction_flops_formula"] == bench.DIRECTION_FLOPS_FORMULA and rec["directions"] == ["fwd"]
    assert json.loads(json.dumps(rec)) == rec  # plain JSON data
    with pytest.raises(ValueError, match="template_hash"):
        bench.build_record(command="", date="", device=DEVICE, software={"torch": "x"}, settings={}, measurements=[])


def test_format_table_ratio_and_statuses():
    ms = [_measurement("autoflash", 1024, 64, False, ms=1.0, peak_mib=12.5),
          _measurement("flash", 1024, 64, False, ms=2.0, peak_mib=4096.0),
          _measurement("cudnn", 1024, 64, False, status="unsupported", reason="No available kernel"),
          _measurement("autoflash", 2048, 64, False, status="failed", err=0.25, bound=0.01),
          _measurement("efficient", 2048, 64, False, status="error", reason="RuntimeError: boom")]
    lines = bench.format_table(ms).splitlines()
    header = lines[0].split()
    assert "TFLOPs" in header and "/flash" in header and "dir" in header and "peak MiB" in lines[0]
    assert "2.00x" in lines[1] and "1.000" in lines[1] and "fwd_hd64" in lines[1]  # twice as fast as flash
    assert " 12.5 " in lines[1] and " 4096.0 " in lines[2] and " fwd " in lines[1]
    assert "1.00x" in lines[2]
    assert "unsupported" in lines[3] and "No available kernel" in lines[3]
    assert "failed" in lines[4] and "0.25" in lines[4] and "0.01" in lines[4] and "out:" in lines[4]
    assert "error" in lines[5] and "boom" in lines[5]


def test_format_table_per_direction_ratio_kernels_and_memory():
    ms = [_measurement("autoflash", 1024, 64, True, ms=1.0, direction="bwd", peak_mib=3.0),
          _measurement("flash", 1024, 64, True, ms=4.0, direction="bwd", peak_mib=6.0),
          _measurement("flash", 1024, 64, True, ms=1.0, direction="fwd"),
          _measurement("autoflash", 1024, 64, True, ms=2.0, direction="fwdbwd", peak_mib=7.25),
          _measurement("math", 1024, 64, True, ms=3.0, direction="fwdbwd", peak_mib=1536.0),
          _measurement("autoflash", 2048, 64, True, status="failed", direction="bwd", err=0.5, bound=0.02,
                       err_of="dk")]
    lines = bench.format_table(ms).splitlines()
    # the ratio compares with flash in the same direction (4 ms bwd), not flash's 1 ms forward
    assert " bwd " in lines[1] and "4.00x" in lines[1] and " 3.0 " in lines[1]
    assert "bwd_hd64" in lines[1] and "fwd_hd64" not in lines[1]  # the backward kernel that was timed
    assert " fwdbwd " in lines[4] and " 7.25 " not in lines[4] and " 7.2 " in lines[4]
    assert "fwd_hd64" in lines[4] and "bwd_hd64" in lines[4]  # both kernels of fwd+bwd
    assert " -  " in lines[4]  # no flash fwdbwd measurement: no ratio
    assert " 1536.0 " in lines[5] and "math" in lines[5]
    assert "failed" in lines[6] and "dk: err 0.5 > bound 0.02" in lines[6]


def test_summarize():
    assert bench.summarize([3.0, 1.0, 2.0, 10.0, 2.5]) == {"ms_median": 2.5, "ms_min": 1.0, "ms_max": 10.0}


def test_plot_results_writes_png_from_json(tmp_path):
    rec = json.loads(json.dumps(_record(_synthetic_measurements())))
    path = tmp_path / "plot.png"
    bench.plot_results(rec, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_results_one_png_per_direction(tmp_path):
    rec = json.loads(json.dumps(_record(_synthetic_measurements(bench.DIRECTIONS))))
    assert rec["directions"] == ["fwd", "bwd", "fwdbwd"]
    pngs = []
    for d in rec["directions"]:
        bench.plot_results(rec, tmp_path / f"x-{d}.png", d)
        pngs.append((tmp_path / f"x-{d}.png").read_bytes())
    assert all(b[:8] == b"\x89PNG\r\n\x1a\n" and len(b) > 10_000 for b in pngs)
    assert len(set(pngs)) == 3  # different data and titles per direction
    with pytest.raises(ValueError, match="sideways"):
        bench.plot_results(rec, tmp_path / "x.png", "sideways")


def test_build_record_kernel_configs_and_directions():
    ms = _synthetic_measurements(("bwd", "fwdbwd"))
    rec = _record(ms)
    assert rec["directions"] == ["fwd", "bwd", "fwdbwd"]  # the failed forward row counts as measured
    label = bench.Shape(32, 32, 512, 64, True).label
    assert rec["provenance"]["kernel_configs"][label] == {"fwd": "fwd_hd64_bf16_m128n64w4s2",
                                                         "bwd": "bwd_hd64_bf16_m32n128w8s2"}
    assert all(m["direction"] in bench.DIRECTIONS and (m["status"] != "ok" or m["peak_mib"] > 0)
               for m in rec["measurements"])
    assert rec["flops_factors"] == {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}


def test_check_uses_flashattention3_rule_for_out_and_gradients():
    """FlashAttention-3's rule (hopper/test_flash_attn.py): out and dq/dk/dv within 2x PyTorch-in-the-
    same-dtype's error plus twice the reference's rounding in that dtype: here fp32 PyTorch and a zero
    reference, whose fp32 rounding term is 0, so the bounds are 2x plus the fp32 floor, 1e-5."""
    ref = torch.zeros(2, 3, 8, 4)
    refs = {n: (ref, ref + 0.1) for n in ("out", "dq", "dk", "dv")}  # PyTorch's error: 0.1
    sl = (slice(0, 1), slice(0, 2))  # only the checked slice counts
    off = torch.zeros_like(ref)
    off[1:] = 9.0
    sliced = {n: (r[sl], t[sl]) for n, (r, t) in refs.items()}
    ok, f = bench._check((off + 0.25, off, off, off), sliced, sl, "fwdbwd")
    assert not ok and f["err_of"] == "out" and f["err"] == pytest.approx(0.25)
    assert f["bound"] == pytest.approx(0.2 + 1e-5)
    ok, f = bench._check((off + 0.15, off, off), sliced, sl, "bwd")
    assert ok and set(f["errors"]) == {"dq", "dk", "dv"} and f["err_of"] == "dq"  # the worst err / bound
    assert f["errors"]["dq"] == [pytest.approx(0.15), pytest.approx(0.2 + 1e-5)] and f["errors"]["dk"][0] == 0.0
    ok, f = bench._check((off + 0.25, off, off), sliced, sl, "bwd")  # FA2's 3x would have let it pass
    assert not ok and f["err_of"] == "dq" and f["bound"] == pytest.approx(0.2 + 1e-5)
    ok, f = bench._check((off, off, off + float("nan")), sliced, sl, "bwd")
    assert not ok and f["err_of"] == "dv" and f["err"] == "nan"  # JSON has no NaN
    ok, f = bench._check(off + 0.15, {"out": (ref[sl], ref[sl] + 0.1)}, sl, "fwd")
    assert ok and set(f["errors"]) == {"out"}
    with pytest.raises(ValueError, match="got 2 outputs"):
        bench._check((off, off), refs, sl, "bwd")


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


ALLOCATED = 5 << 20  # what the fake allocator holds before each call


@pytest.fixture
def fake_cuda(monkeypatch):
    """Runs bench.main on CPU: tensors on cpu, events, device and memory queries faked, autoflash's GPU
    modules replaced by PyTorch stand-ins. ``state['offset']`` makes the forward's out wrong,
    ``state['dq_offset']`` the backward's dq. The stand-ins count their calls and add the bytes of what
    they return to the fake peak-memory counter (which only reset_peak_memory_stats lowers)."""
    from autoflash.reference.forward import attention_ref
    from autoflash.reference.backward import attention_backward_ref

    state = {"offset": 0.0, "dq_offset": 0.0, "calls": 0, "bwd_calls": 0, "flash_attn_calls": 0,
             "peak": 0, "resets": 0}

    def allocate(*tensors):
        state["peak"] += sum(t.numel() * t.element_size() for t in tensors)

    def flash_forward(q, k, v, *, causal=False, scale=None, config=None):
        assert config.name.startswith("fwd_") and q.device.type == "cpu"
        state["calls"] += 1
        out, lse = attention_ref(q, k, v, causal=causal, scale=scale)
        out = out.to(q.dtype) + state["offset"]
        allocate(out, lse)
        return out, lse

    def flash_backward(dout, q, k, v, out, lse, *, causal=False, scale=None, config=None, deterministic=False):
        assert config.name.startswith("bwd_") and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
        assert out.shape == dout.shape == q.shape and lse.shape == q.shape[:3] and not torch.is_grad_enabled()
        state["bwd_calls"] += 1
        dq, dk, dv = (g.to(q.dtype) for g in attention_backward_ref(q, k, v, dout, causal=causal, scale=scale))
        dq = dq + state["dq_offset"]
        allocate(dq, dk, dv)
        return dq, dk, dv

    class FlashAttn(torch.autograd.Function):  # autoflash.kernels.function's shape, over the stand-ins
        @staticmethod
        def forward(ctx, q, k, v, causal, config, backward_config):
            out, lse = flash_forward(q, k, v, causal=causal, config=config)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.causal, ctx.backward_config = causal, backward_config
            return out

        @staticmethod
        def backward(ctx, dout):
            grads = flash_backward(dout, *ctx.saved_tensors, causal=ctx.causal, config=ctx.backward_config)
            return (*grads, None, None, None)

    def flash_attn(q, k, v, *, causal=False, scale=None, deterministic=False, config=None, backward_config=None):
        state["flash_attn_calls"] += 1
        return FlashAttn.apply(q, k, v, causal, config, backward_config)

    def default_config(head_dim, dtype, causal, profile):
        return types.SimpleNamespace(name=f"fwd_hd{head_dim}_{dtype}{'_causal' if causal else ''}_m64n64w4s2")

    def default_backward_config(head_dim, dtype, causal, profile):
        return types.SimpleNamespace(name=f"bwd_hd{head_dim}_{dtype}{'_causal' if causal else ''}_m32n128w8s2")

    def reset_peak_memory_stats(*a):
        state["resets"] += 1
        state["peak"] = ALLOCATED

    mods = {"autoflash.kernels.launch": dict(flash_forward=flash_forward, flash_backward=flash_backward),
            "autoflash.kernels.function": dict(flash_attn=flash_attn),
            "autoflash.kernels.defaults": dict(default_config=default_config, default_backward_config=default_backward_config),
            "autoflash.kernels.gpus": dict(detect=lambda: types.SimpleNamespace(name="fake h100"))}
    for name, attrs in mods.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: ALLOCATED)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: state["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset_peak_memory_stats)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake H100")
    props = types.SimpleNamespace(multi_processor_count=132, total_memory=80 << 30, L2_cache_size=50 << 20)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: props)
    return state


def _outputs(tmp_path):
    (js,) = tmp_path.glob("*-bench.json")
    return js, json.loads(js.read_text())


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes CUDA on a machine without it")
def test_main_end_to_end_with_fake_cuda(fake_cuda, tmp_path, capsys):
    argv = ["--dtype", "fp32", "--head-dims", "32", "--seqlens", "64,128", "--hidden", "64", "--tokens", "256",
            "--reps", "3", "--warmup", "1", "--out", str(tmp_path)]
    assert bench.main(argv) == 0  # every autoflash result checks out; SDPA refusing CPU is not a failure
    out = capsys.readouterr().out
    assert bench.FLOPS_FORMULA in out and bench.DIRECTION_FLOPS_FORMULA in out
    assert "autoflash" in out and "unsupported" in out and "peak MiB" in out
    js, rec = _outputs(tmp_path)
    stamp = js.name.replace("-bench.json", "")
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [f"{stamp}-{d}.png" for d in ("bwd", "fwd", "fwdbwd")]
    assert all(p.stat().st_size > 0 for p in tmp_path.glob("*.png"))
    prov = rec["provenance"]
    assert prov["command"] == "python -m autoflash.bench " + " ".join(argv)
    assert prov["device"]["name"] == "Fake H100" and prov["device"]["compute_capability"] == "9.0"
    for key in ("driver_version",):
        assert key in prov["device"]
    for key in ("torch", "cupy", "nvrtc", "autoflash", "template_hash"):
        assert key in prov["software"]
    assert len(prov["kernel_configs"]) == 4  # fp32 has a backward: both kernels of every shape are recorded
    for label, v in prov["kernel_configs"].items():
        suffix = "_causal" if label.endswith(" causal") else ""
        assert v == {"fwd": f"fwd_hd32_fp32{suffix}_m64n64w4s2", "bwd": f"bwd_hd32_fp32{suffix}_m32n128w8s2"}
    assert rec["directions"] == ["fwd", "bwd", "fwdbwd"] and rec["settings"]["direction"] == "all"
    ms = rec["measurements"]
    assert len(ms) == 4 * 4 * 3  # 4 shapes x 4 backends x 3 directions
    auto = [m for m in ms if m["backend"] == "autoflash"]
    assert sorted(m["direction"] for m in auto) == sorted(4 * ["fwd", "bwd", "fwdbwd"])
    expected_checks = {"fwd": {"out"}, "bwd": {"dq", "dk", "dv"}, "fwdbwd": {"out", "dq", "dk", "dv"}}
    for m in auto:
        d = m["direction"]
        fwd_flops = bench.flops(m["batch"], m["heads"], m["seqlen"], m["seqlen"], m["head_dim"], m["causal"])
        assert m["flops"] == fwd_flops * bench.FLOPS_FACTORS[d]
        # fp32 backward is checked (against the fp64 reference) and timed like fp16/bf16
        assert m["status"] == "ok", m
        assert m["ms_median"] == pytest.approx(0.5) and m["ms_min"] <= m["ms_max"]
        assert m["tflops"] == pytest.approx(bench.tflops(m["flops"], 0.5))
        assert set(m["errors"]) == expected_checks[d] and all(e <= b for e, b in m["errors"].values())
        assert m["err"] <= m["bound"] and m["err_of"] in expected_checks[d] and m["heads"] * m["head_dim"] == 64
        assert m["config"].startswith("fwd_hd32_fp32") and (m["backward_config"] or "").startswith(
            "bwd_hd32_fp32") == (d != "fwd")
        b, h, s = m["batch"], m["heads"], m["seqlen"]
        q_bytes, lse_bytes = b * h * s * 32 * 4, b * h * s * 4  # fp32 (b, h, s, 32); lse (b, h, s) fp32
        # fwd: out + lse; bwd: dq + dk + dv; fwdbwd: out + lse + dq + dk + dv
        expected_peak = {"fwd": q_bytes + lse_bytes, "bwd": 3 * q_bytes, "fwdbwd": 4 * q_bytes + lse_bytes}[d]
        assert m["peak_mib"] == pytest.approx(expected_peak / 2**20)
    calls = 1 + 1 + 1 + 3  # check, memory, warm-up, reps
    assert fake_cuda["calls"] == 4 * (calls + 1 + calls)  # per shape: fwd; bwd's saved forward; fwdbwd
    assert fake_cuda["bwd_calls"] == 4 * (calls + calls)  # bwd; fwdbwd
    assert fake_cuda["flash_attn_calls"] == 4 * calls
    assert fake_cuda["resets"] == sum(m["status"] == "ok" for m in ms)  # one per measured call
    assert fake_cuda["resets"] == 2 * 4 * 3  # autoflash and (CPU) flash: 4 shapes x 3 directions each
    # cuDNN / efficient refuse CPU tensors: recorded with torch's reason, not a crash
    for m in ms:
        if m["backend"] in ("efficient", "cudnn"):
            assert m["status"] == "unsupported" and m["reason"]
        assert m["status"] in ("ok", "unsupported", "failed")
        assert ("peak_mib" in m) == (m["status"] == "ok")


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes CUDA on a machine without it")
def test_backward_end_to_end_with_fake_cuda(fake_cuda, tmp_path, capsys):
    argv = ["--dtype", "bf16", "--head-dims", "32", "--seqlens", "64", "--hidden", "64", "--tokens", "128",
            "--backends", "autoflash,flash,math", "--reps", "3", "--warmup", "2", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    table = capsys.readouterr().out
    _, rec = _outputs(tmp_path)
    ms = rec["measurements"]
    assert [(m["causal"], m["backend"], m["direction"]) for m in ms] == [
        (c, b, d) for c in (False, True) for b in ("autoflash", "flash", "math") for d in ("fwd", "bwd", "fwdbwd")]
    q_bytes, lse_bytes = 2 * 2 * 64 * 32 * 2, 2 * 2 * 64 * 4  # (2, 2, 64, 32) bf16; lse (2, 2, 64) fp32
    expected_peak = {"fwd": q_bytes + lse_bytes, "bwd": 3 * q_bytes, "fwdbwd": 4 * q_bytes + lse_bytes}
    expected_checks = {"fwd": {"out"}, "bwd": {"dq", "dk", "dv"}, "fwdbwd": {"out", "dq", "dk", "dv"}}
    for m in ms:
        d = m["direction"]
        assert m["status"] == "ok", m  # CPU flash and math run backward too
        assert set(m["errors"]) == expected_checks[d] and all(e <= b for e, b in m["errors"].values())
        assert m["tflops"] == pytest.approx(bench.tflops(m["flops"], 0.5)) and "peak_mib" in m
        if m["backend"] == "autoflash":
            assert m["peak_mib"] == pytest.approx(expected_peak[d] / 2**20)
            assert m["config"].startswith("fwd_hd32_bf16") and (m["backward_config"] or "").startswith(
                "bwd_hd32_bf16") == (d != "fwd")
            assert m["flops"] == pytest.approx(bench.FLOPS_FACTORS[d] * 4 * 2 * 2 * 64 * 64 * 32 / (1 + m["causal"]))
    calls = 1 + 1 + 2 + 3  # check, memory, warm-up, reps
    assert fake_cuda["calls"] == 2 * (calls + 1 + calls)  # per shape: fwd; bwd's saved forward; fwdbwd
    assert fake_cuda["bwd_calls"] == 2 * (calls + calls)  # bwd; fwdbwd
    assert fake_cuda["flash_attn_calls"] == 2 * calls
    label = bench.Shape(2, 2, 64, 32, True).label
    assert rec["provenance"]["kernel_configs"][label] == {"fwd": "fwd_hd32_bf16_causal_m64n64w4s2",
                                                         "bwd": "bwd_hd32_bf16_causal_m32n128w8s2"}
    rows = [ln.split("  ") for ln in table.splitlines()]
    for m in ms:  # one table row per measurement: shape, direction, backend, ..., peak MiB
        cells = [[c.strip() for c in r if c.strip()] for r in rows]
        assert [m["shape"], m["direction"], m["backend"]] in [c[:3] for c in cells]
        (row,) = [c for c in cells if c[:3] == [m["shape"], m["direction"], m["backend"]]]
        assert row[6] == f"{m['peak_mib']:.1f}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes CUDA on a machine without it")
@pytest.mark.parametrize("direction, wrong, statuses, calls, bwd_calls", [
    ("bwd", "dq_offset", {"bwd": "failed"}, 1, 1),  # the saved forward, then the check only
    ("fwdbwd", "dq_offset", {"fwdbwd": "failed"}, 1, 1),
    ("all", "dq_offset", {"fwd": "ok", "bwd": "failed", "fwdbwd": "failed"}, 6 + 1 + 1, 1 + 1),
    # a wrong out fails fwd and fwd+bwd (out is checked there too); the stand-in's gradients ignore it
    ("all", "offset", {"fwd": "failed", "bwd": "ok", "fwdbwd": "failed"}, 1 + 1 + 1, 6 + 1),
])
def test_wrong_backward_result_is_failed_not_timed(fake_cuda, tmp_path, direction, wrong, statuses, calls,
                                                   bwd_calls):
    fake_cuda[wrong] = 0.5
    argv = ["--dtype", "bf16", "--head-dims", "32", "--seqlens", "64", "--hidden", "64", "--tokens", "128",
            "--causal", "on", "--backends", "autoflash", "--direction", direction, "--reps", "3", "--warmup", "1",
            "--out", str(tmp_path), "--no-plot"]
    assert bench.main(argv) == 1
    assert not list(tmp_path.glob("*.png"))
    _, rec = _outputs(tmp_path)
    ms = rec["measurements"]
    assert {m["direction"]: m["status"] for m in ms} == statuses
    for m in ms:
        if m["status"] == "failed":
            assert "ms_median" not in m and "peak_mib" not in m and "tflops" not in m
            assert m["err_of"] == ("dq" if wrong == "dq_offset" else "out") and m["err"] > m["bound"]
            assert math.isclose(m["err"], 0.5, rel_tol=0.05)  # bf16 rounding of out + 0.5
            assert all(e <= b for n, (e, b) in m["errors"].items() if n != m["err_of"])  # the others pass
        else:
            assert "ms_median" in m and "peak_mib" in m
    assert (fake_cuda["calls"], fake_cuda["bwd_calls"]) == (calls, bwd_calls)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes CUDA on a machine without it")
def test_wrong_autoflash_result_is_failed_not_timed(fake_cuda, tmp_path):
    fake_cuda["offset"] = 0.1
    argv = ["--dtype", "fp32", "--head-dims", "32", "--seqlens", "64", "--hidden", "64", "--tokens", "128",
            "--causal", "off", "--backends", "autoflash", "--direction", "fwd", "--reps", "3", "--out", str(tmp_path),
            "--no-plot"]
    assert bench.main(argv) == 1
    assert not list(tmp_path.glob("*.png"))
    (m,) = _outputs(tmp_path)[1]["measurements"]
    assert m["status"] == "failed" and m["err"] > m["bound"] and "ms_median" not in m
    assert math.isclose(m["err"], 0.1, rel_tol=1e-3)
    assert fake_cuda["calls"] == 1  # checked once, never timed
    assert fake_cuda["resets"] == 0  # nor measured


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_main_on_gpu_small_sweep(tmp_path):
    argv = ["--head-dims", "64", "--seqlens", "512", "--causal", "both", "--reps", "3", "--warmup", "1",
            "--backends", "autoflash,flash,math", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    _, rec = _outputs(tmp_path)
    auto = [m for m in rec["measurements"] if m["backend"] == "autoflash"]
    assert len(auto) == 2 * 3 and all(m["status"] == "ok" and m["tflops"] > 0 and m["peak_mib"] > 0 for m in auto)
    assert {m["direction"] for m in auto} == {"fwd", "bwd", "fwdbwd"}
    assert rec["provenance"]["device"]["name"] == torch.cuda.get_device_name()
    assert len(list(tmp_path.glob("*.png"))) == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes CUDA on a machine without it")
def test_reference_failure_is_recorded_not_a_crash(fake_cuda, tmp_path, monkeypatch):
    import autoflash.reference.forward

    def boom(*a, **kw):
        raise RuntimeError("CUDA out of memory (fake)")

    monkeypatch.setattr(autoflash.reference.forward, "attention_ref", boom)
    argv = ["--dtype", "fp32", "--head-dims", "32", "--seqlens", "64", "--hidden", "64", "--tokens", "128",
            "--causal", "on", "--backends", "autoflash,flash", "--out", str(tmp_path), "--no-plot"]
    assert bench.main(argv) == 1
    ms = _outputs(tmp_path)[1]["measurements"]
    assert [(m["backend"], m["direction"]) for m in ms] == [(b, d) for b in ("autoflash", "flash")
                                                            for d in ("fwd", "bwd", "fwdbwd")]
    assert all(m["status"] == "error" and "reference" in m["reason"] and "fake" in m["reason"] for m in ms)
    assert fake_cuda["calls"] == 0
