"""Benchmark of autoflash against torch SDPA's FlashAttention, memory-efficient and cuDNN backends
(and, on request, the unfused math backend), forward, backward and both, on the same random inputs.

    python -m autoflash.bench                      # FlashAttention's default sweep, all directions
    python -m autoflash.bench --head-dims 128 --seqlens 1k,4k --causal on --backends autoflash,flash
    python -m autoflash.bench --direction bwd --dtype fp16 --backends autoflash,flash,math
    python -m autoflash.bench dispatch --help      # per-call overhead of autoflash.attention vs SDPA
    python -m autoflash.bench train --help         # a 4-layer transformer trained on both (GPU)
    python -m autoflash.bench emulator --help      # the host emulator's speed on this CPU (no GPU)
    python -m autoflash.bench decode --help        # flash_attn_with_kvcache against SDPA: GB/s, HBM share
    python -m autoflash.bench sass --help          # static SASS beside FlashAttention-2's (no GPU)

Directions: fwd = the forward call; bwd = the backward only (autoflash: flash_backward on a saved
forward; SDPA: torch.autograd.grad through a saved graph, retain_graph=True, under the backend);
fwdbwd = forward then backward in one timed call (autoflash through its autograd flash_attn).

Everything timed is checked first, on a slice of batch x heads small enough for the plain
reference: out, dq, dk and dv must satisfy FlashAttention-3's rule (hopper/test_flash_attn.py)
max|x - ref| <= 2 * max|torch_same_dtype - ref| + 2 * max|ref' + 0.3 - 0.3 - ref'|, ref = fp32
attention (fp64 for fp32 inputs), ref' = ref rounded to the input dtype (the rounding at its magnitude).
A wrong result is recorded as "failed" and not timed; an SDPA backend that refuses a shape is
"unsupported".
Timing: CUDA events around the call only, after warm-up, with the L2 cache flushed before every
repetition; the median (and min/max) of the repetitions is reported. Peak memory: one extra
untimed call, max_memory_allocated after it minus memory_allocated before it (reset in between).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import shlex
import sys
import warnings
from pathlib import Path

from autoflash.bench.report import (  # noqa: F401  (re-exported: the report helpers are part of bench's API)
    DIRECTION_FLOPS_FORMULA, DIRECTIONS, FLOPS_FACTORS, FLOPS_FORMULA, build_record, flops, format_table,
    plot_results, summarize, tflops)
from autoflash.kernels.config import HEAD_DIM_MAX, HEAD_DIM_MIN, HEAD_DIM_STEP
from autoflash.bench.timing import flush_buffer, time_cuda

BACKENDS = ("autoflash", "flash", "efficient", "cudnn", "math")
DEFAULT_BACKENDS = ("autoflash", "flash", "efficient", "cudnn")
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "math": "MATH"}
DTYPES = ("fp16", "bf16", "fp32")
CAUSAL_MODES = {"off": (False,), "on": (True,), "both": (False, True)}
DIRECTION_MODES = {"fwd": ("fwd",), "bwd": ("bwd",), "fwdbwd": ("fwdbwd",), "all": DIRECTIONS}
NO_GPU_MESSAGE = (
    "autoflash.bench needs a CUDA GPU; none is visible (torch.cuda.is_available() is False). "
    "Without a GPU you can still render and compile kernels, e.g. "
    "python -m autoflash.render --default --head-dim 128 --dtype bf16 --gpu h100, or run them on the CPU "
    "through the emulator: python -m autoflash.selfcheck --emulate h100 --backward"
)
CHECK_SCORE_ELEMS = 1 << 26  # largest b * h * Lq * Lk the plain reference is run on
DEVICE = "cuda"


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool

    @property
    def label(self) -> str:
        return f"d{self.head_dim} s{self.seqlen} b{self.batch} h{self.heads}" + (" causal" if self.causal else "")

    @property
    def flops(self) -> float:
        """Forward FLOPs; flops(..., direction) for the backward's."""
        return flops(self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim, self.causal)


def build_sweep(head_dims, seqlens, *, hidden: int, tokens: int, causal=(False, True)) -> list[Shape]:
    """heads = hidden / head_dim, batch = tokens / seqlen, for every (head_dim, causal, seqlen).

    Raises ValueError naming the flag, the value received and what is accepted."""
    for d in head_dims:
        if not (HEAD_DIM_MIN <= d <= HEAD_DIM_MAX and d % HEAD_DIM_STEP == 0):
            raise ValueError(f"--head-dims: got {d}, expected multiples of {HEAD_DIM_STEP} "
                             f"in [{HEAD_DIM_MIN}, {HEAD_DIM_MAX}]")
        if hidden <= 0 or hidden % d:
            raise ValueError(f"--hidden: got {hidden}, expected a positive multiple of every head dim (not of {d})")
    for s in seqlens:
        if s <= 0:
            raise ValueError(f"--seqlens: got {s}, expected positive lengths")
        if tokens <= 0 or tokens % s:
            raise ValueError(f"--tokens: got {tokens}, expected a positive multiple of every seqlen (not of {s})")
    return [Shape(tokens // s, hidden // d, s, d, c) for d in head_dims for c in causal for s in seqlens]


def _int_list(text: str) -> list[int]:
    try:
        return [int(t[:-1]) * 1024 if t.lower().endswith("k") else int(t) for t in text.replace(" ", "").split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected comma-separated integers (1k = 1024)") from None


def _backend_list(text: str) -> list[str]:
    names = [t for t in text.replace(" ", "").split(",") if t]
    bad = [n for n in names if n not in BACKENDS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"got {text!r} (unknown: {','.join(bad) or 'empty'}), "
                                         f"expected a comma-separated subset of {','.join(BACKENDS)}")
    return names


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m autoflash.bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__ + "\n" + FLOPS_FORMULA + ";\n" + DIRECTION_FLOPS_FORMULA + ";\nTFLOPs = FLOPs / median"
        " time. Layout (batch, heads, seqlen, head_dim), heads = hidden / head_dim,\nbatch = tokens / seqlen."
        " Writes a table to stdout and, to --out, <date>-bench.json\n(provenance + all measurements, each with its"
        " direction and peak_mib) and one\n<date>-<direction>.png per direction (<date>-fwd.png, <date>-bwd.png,"
        " <date>-fwdbwd.png:\nTFLOPs vs seqlen). Exit status 1 if an autoflash result is wrong or errors, 2 without"
        " a GPU.")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="input dtype (default bf16)")
    p.add_argument("--direction", choices=tuple(DIRECTION_MODES), default="all",
                   help="fwd, bwd (backward only), fwdbwd (both in one call) or all of them (default all)")
    p.add_argument("--head-dims", type=_int_list, default=[64, 128], help=f"comma-separated, multiples of "
                   f"{HEAD_DIM_STEP} in [{HEAD_DIM_MIN}, {HEAD_DIM_MAX}] (default 64,128)")
    p.add_argument("--seqlens", type=_int_list, default=[512, 1024, 2048, 4096, 8192, 16384],
                   help="comma-separated, 1k = 1024 (default 512,1k,2k,4k,8k,16k)")
    p.add_argument("--hidden", type=int, default=2048, help="heads * head_dim (default 2048)")
    p.add_argument("--tokens", type=int, default=16384, help="batch * seqlen (default 16384)")
    p.add_argument("--causal", choices=tuple(CAUSAL_MODES), default="both", help="default both")
    p.add_argument("--backends", type=_backend_list, default=list(DEFAULT_BACKENDS),
                   help=f"subset of {','.join(BACKENDS)} (default {','.join(DEFAULT_BACKENDS)}); math is SDPA's "
                   "unfused reference, for the memory comparison (it materialises the L x L scores)")
    p.add_argument("--reps", type=int, default=30, help="timed repetitions (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up calls (default 5)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default bench/results/<gpu-name>/)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNGs")
    return p


# ---------------------------------------------------------------- GPU part (imports torch lazily)

def _peak_mib(torch, fn) -> float:
    """MiB one call allocates at its peak beyond what was allocated before it (its outputs included)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak / 2**20


def _references(torch, q, k, v, dout, causal: bool, directions) -> dict:
    """name -> (upcast reference, PyTorch in the input dtype) for out and/or dq, dk, dv of the slice.
    fp32 inputs get an fp64 reference, so that fp32 PyTorch has an error to compare against."""
    from autoflash.reference.forward import attention_ref
    from autoflash.reference.backward import attention_backward_ref

    hi = (lambda t: t.double()) if q.dtype == torch.float32 else (lambda t: t)
    refs = {}
    if {"fwd", "fwdbwd"} & set(directions):
        refs["out"] = (attention_ref(hi(q), hi(k), hi(v), causal=causal)[0],
                       attention_ref(q, k, v, causal=causal, upcast=False)[0])
    if {"bwd", "fwdbwd"} & set(directions):
        grads = attention_backward_ref(hi(q), hi(k), hi(v), hi(dout), causal=causal)
        grads_lp = attention_backward_ref(q, k, v, dout, causal=causal, upcast=False)
        refs.update(zip(("dq", "dk", "dv"), zip(grads, grads_lp)))
    return refs


def _check(result, refs: dict, sl, direction: str) -> tuple[bool, dict]:
    """FlashAttention-3's rule on each output of one call (within_tolerance; its backward rule for the
    gradients, without a softcap the forward's). Returns (ok, fields): errors {name: [err, bound]},
    and err, bound, err_of of the failing (else worst) one."""
    from autoflash.reference.forward import within_tolerance

    names = {"fwd": ("out",), "bwd": ("dq", "dk", "dv"), "fwdbwd": ("out", "dq", "dk", "dv")}[direction]
    outputs = (result,) if direction == "fwd" else tuple(result)
    if len(outputs) != len(names):
        raise ValueError(f"{direction}: got {len(outputs)} outputs, expected {', '.join(names)}")
    errors, failed = {}, []
    for name, t in zip(names, outputs):
        ok, err, bound = within_tolerance(t[sl], *refs[name], backward=name != "out")
        errors[name] = [err if math.isfinite(err) else str(err), bound if math.isfinite(bound) else str(bound)]
        if not ok:
            failed.append(name)
    ratio = {n: e / b if isinstance(e, float) and isinstance(b, float) and b > 0 else math.inf
             for n, (e, b) in errors.items()}
    worst = failed[0] if failed else max(names, key=lambda n: ratio[n])
    return not failed, {"errors": errors, "err": errors[worst][0], "bound": errors[worst][1], "err_of": worst}


def _make_call(torch, backend: str, direction: str, sh: Shape, dtype: str, tensors, m: dict, profile):
    """The callable timed for (backend, direction); it returns out, (dq, dk, dv) or (out, dq, dk, dv).
    For bwd this runs the forward once (not timed) and times the backward on its saved results."""
    q, k, v, dout = tensors
    c = sh.causal
    if backend == "autoflash":
        from autoflash.kernels.defaults import default_backward_config, default_config
        from autoflash.kernels.launch import flash_backward, flash_forward

        cfg = default_config(sh.head_dim, dtype, c, profile)
        m["config"] = cfg.name
        if direction == "fwd":
            return lambda: flash_forward(q, k, v, causal=c, config=cfg)[0]
        bcfg = default_backward_config(sh.head_dim, dtype, c, profile)
        m["backward_config"] = bcfg.name
        if direction == "bwd":
            out, lse = flash_forward(q, k, v, causal=c, config=cfg)
            return lambda: flash_backward(dout, q, k, v, out, lse, causal=c, config=bcfg)
        from autoflash.kernels.function import flash_attn

        def attn(*qkv):
            return flash_attn(*qkv, causal=c, config=cfg, backward_config=bcfg)
    else:
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        if direction == "fwd":
            return lambda: sdpa(q, k, v, is_causal=c)

        def attn(*qkv):
            return sdpa(*qkv, is_causal=c)
    leaves = tuple(t.detach().requires_grad_(True) for t in (q, k, v))
    if direction == "bwd":
        with torch.enable_grad():
            saved = attn(*leaves)
        # autograd.grad, not .backward(): no accumulation into .grad, nothing but the backward timed
        return lambda: torch.autograd.grad(saved, leaves, dout, retain_graph=True)

    def fwdbwd():
        with torch.enable_grad():
            out = attn(*leaves)
        return (out.detach(), *torch.autograd.grad(out, leaves, dout))
    return fwdbwd


def _bench_one(torch, m: dict, backend: str, direction: str, sh: Shape, tensors, sl, refs, args, profile,
               flush) -> dict:
    """Check, then measure peak memory, then time one (backend, direction) on one shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "autoflash":
        ctx = contextlib.nullcontext()
    elif (kind := getattr(SDPBackend, SDPA_BACKENDS[backend], None)) is None:
        return dict(m, status="unsupported", reason=f"SDPBackend.{SDPA_BACKENDS[backend]} not in this torch")
    else:
        ctx = sdpa_kernel(kind)
    with ctx, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            call = _make_call(torch, backend, direction, sh, args.dtype, tensors, m, profile)
            result = call()
        except RuntimeError as e:  # sdpa_kernel: "No available kernel"; the reasons come as warnings
            if backend == "autoflash" or isinstance(e, torch.cuda.OutOfMemoryError):
                raise
            why = "; ".join([str(w.message).strip() for w in caught] + [str(e).strip()])
            return dict(m, status="unsupported", reason=why)
        ok, fields = _check(result, refs, sl, direction)
        m.update(fields)
        del result
        if not ok:  # a wrong result is not timed
            return dict(m, status="failed")
        m["peak_mib"] = _peak_mib(torch, call)
        t = time_cuda(torch, call, reps=args.reps, warmup=args.warmup, flush=flush)
    return dict(m, status="ok", **t, tflops=tflops(m["flops"], t["ms_median"]),
                tflops_best=tflops(m["flops"], t["ms_min"]))


def _bench_shape(torch, sh: Shape, args, profile, flush) -> list[dict]:
    from autoflash.kernels.checks import TORCH_DTYPES

    dt = TORCH_DTYPES[args.dtype]
    directions = DIRECTION_MODES[args.direction]
    tensors = tuple(torch.randn(sh.batch, sh.heads, sh.seqlen, sh.head_dim, device=DEVICE, dtype=dt)
                    for _ in range(4))  # q, k, v and dout
    # The plain reference materialises (b, h, L, L) scores: check the (b, h) slice it can afford.
    n = max(1, CHECK_SCORE_ELEMS // (sh.seqlen * sh.seqlen))
    hs, bs = min(sh.heads, n), min(sh.batch, max(1, n // sh.heads))
    sl = (slice(0, bs), slice(0, hs))
    base = {"shape": sh.label, **dataclasses.asdict(sh), "dtype": args.dtype,
            "checked": f"batch[:{bs}] x heads[:{hs}] of {sh.batch} x {sh.heads}", "config": None,
            "backward_config": None}
    rows = []
    try:
        refs = _references(torch, *(t[sl] for t in tensors), sh.causal, directions)
    except Exception as e:  # without a reference nothing can be checked, so nothing is timed
        refs, why = None, f"reference: {type(e).__name__}: {e}"
    for b in args.backends:
        for d in directions:
            m = dict(base, backend=b, direction=d, flops=flops(sh.batch, sh.heads, sh.seqlen, sh.seqlen,
                                                               sh.head_dim, sh.causal, d))
            if refs is None:
                rows.append(dict(m, status="error", reason=why))
                continue
            try:
                rows.append(_bench_one(torch, m, b, d, sh, tensors, sl, refs, args, profile, flush))
            except Exception as e:  # one backend crashing is recorded; the sweep goes on
                rows.append(dict(m, status="error", reason=f"{type(e).__name__}: {e}"))
    del tensors, refs
    torch.cuda.empty_cache()
    return rows


def _environment(torch, profile) -> tuple[dict, dict]:
    """Device and software provenance; a field that cannot be read says why instead."""
    def attempt(f):
        try:
            return f()
        except Exception as e:
            return f"unavailable ({type(e).__name__}: {e})"

    def driver():
        from autoflash.kernels.driver import cuda_driver_version, driver_release
        major, minor = cuda_driver_version()
        return f"{major}.{minor}" + (f" ({driver_release()})" if driver_release() else "")

    def nvrtc():  # the one the kernels compile with (the stack's: compiler._nvrtc loads it)
        from autoflash.kernels.compiler import nvrtc_version
        return nvrtc_version()

    def template_hash():
        from autoflash.kernels.codegen import template_hash
        return template_hash()

    import autoflash

    cc = torch.cuda.get_device_capability()
    props = torch.cuda.get_device_properties(0)
    device = {"name": torch.cuda.get_device_name(), "compute_capability": f"{cc[0]}.{cc[1]}",
              "driver_version": attempt(driver), "profile": getattr(profile, "name", None),
              "sm_count": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1)}
    software = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                "cupy": attempt(lambda: __import__("cupy").__version__), "nvrtc": attempt(nvrtc),
                "autoflash": autoflash.__version__, "template_hash": attempt(template_hash),
                "python": sys.version.split()[0]}
    return device, software


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.reps < 1 or args.warmup < 0:
        parser.error(f"--reps/--warmup: got {args.reps}/{args.warmup}, expected reps >= 1 and warmup >= 0")
    try:
        shapes = build_sweep(args.head_dims, args.seqlens, hidden=args.hidden, tokens=args.tokens,
                             causal=CAUSAL_MODES[args.causal])
    except ValueError as e:
        parser.error(str(e))
    import torch

    if not torch.cuda.is_available():
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return 2
    from autoflash.kernels.gpus import detect

    try:
        profile = detect()
    except (RuntimeError, ValueError) as e:  # e.g. a GPU older than the kernels support
        print(f"autoflash.bench: {e}", file=sys.stderr)
        return 2
    device, software = _environment(torch, profile)
    out_dir = args.out or Path("bench/results") / profile.name  # profile names are slugs: "h100"
    flush = flush_buffer(torch, DEVICE)
    print(f"{device['name']} (sm {device['compute_capability']}), {args.dtype}, {args.direction}; {FLOPS_FORMULA}; "
          f"{DIRECTION_FLOPS_FORMULA}", flush=True)
    torch.manual_seed(0)
    measurements = []
    with torch.no_grad():
        for i, sh in enumerate(shapes):
            print(f"[{i + 1}/{len(shapes)}] {sh.label}", file=sys.stderr, flush=True)
            measurements += _bench_shape(torch, sh, args, profile, flush)
    print(format_table(measurements))
    now = datetime.datetime.now().astimezone()
    settings = {**vars(args), "out": str(out_dir), "l2_flush_bytes": flush.numel(), "timing": "CUDA events, median",
                "peak_memory": "max_memory_allocated after one untimed call minus memory_allocated before it"}
    record = build_record(command=shlex.join(["python", "-m", "autoflash.bench", *argv]),
                          date=now.isoformat(timespec="seconds"), device=device, software=software,
                          settings=settings, measurements=measurements)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = f"{now:%Y-%m-%d_%H%M%S}"
    json_path = out_dir / f"{stamp}-bench.json"
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {json_path}")
    if not args.no_plot:
        for d in record["directions"]:
            plot_results(record, out_dir / f"{stamp}-{d}.png", d)
            print(f"wrote {out_dir / f'{stamp}-{d}.png'}")
    return 1 if any(m["status"] in ("failed", "error") and m["backend"] == "autoflash" for m in measurements) else 0

