"""Forward-pass benchmark: autoflash against torch SDPA's FlashAttention, memory-efficient and
cuDNN backends, on the same random inputs in one run.

    python -m autoflash.bench                      # FlashAttention's default sweep
    python -m autoflash.bench --head-dims 128 --seqlens 1k,4k --causal on --backends autoflash,flash

Every shape is checked before it is timed: each backend's output (on a slice of batch x heads small
enough for the plain reference) must satisfy FlashAttention's rule
max|out - ref| <= 2 * max|torch_same_dtype - ref| + 1e-5, ref = fp32 attention. A wrong result is
recorded as "failed" and not timed; an SDPA backend that refuses a shape is "unsupported".
Timing: CUDA events around the call only, after warm-up, with the L2 cache flushed before every
repetition; the median (and min/max) of the repetitions is reported.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import shlex
import statistics
import sys
import warnings
from pathlib import Path

from autoflash.config import HEAD_DIM_MAX, HEAD_DIM_MIN, HEAD_DIM_STEP

BACKENDS = ("autoflash", "flash", "efficient", "cudnn")
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
DTYPES = ("fp16", "bf16", "fp32")
CAUSAL_MODES = {"off": (False,), "on": (True,), "both": (False, True)}
FLOPS_FORMULA = "FLOPs = 4 * batch * heads * seqlen_q * seqlen_k * head_dim, halved when causal"
NO_GPU_MESSAGE = (
    "autoflash.bench needs a CUDA GPU; none is visible (torch.cuda.is_available() is False). "
    "Without a GPU you can still render and compile kernels, e.g. "
    "python -m autoflash.render --default --head-dim 128 --dtype bf16 --gpu h100"
)
CHECK_SCORE_ELEMS = 1 << 26  # largest b * h * Lq * Lk the plain reference is run on
FLUSH_BYTES = 256 << 20  # written before every timed call: larger than any L2 (x4 L2 if that is more)
DEVICE = "cuda"


def flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs as FlashAttention's benchmarks count them: two matmuls, 2 FLOPs per MAC."""
    f = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return f / 2 if causal else f


def tflops(n_flops: float, ms: float) -> float:
    return n_flops / (ms * 1e-3) / 1e12


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
        description=__doc__ + "\n" + FLOPS_FORMULA + ";\nTFLOPs = FLOPs / median time. Layout (batch, heads, seqlen,"
        " head_dim),\nheads = hidden / head_dim, batch = tokens / seqlen. Writes a table to stdout and\n"
        "<date>-fwd.json (provenance + all measurements) and <date>-fwd.png (TFLOPs vs seqlen)\n"
        "to --out. Exit status 1 if an autoflash result is wrong or errors, 2 without a GPU.")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="input dtype (default bf16)")
    p.add_argument("--head-dims", type=_int_list, default=[64, 128], help=f"comma-separated, multiples of "
                   f"{HEAD_DIM_STEP} in [{HEAD_DIM_MIN}, {HEAD_DIM_MAX}] (default 64,128)")
    p.add_argument("--seqlens", type=_int_list, default=[512, 1024, 2048, 4096, 8192, 16384],
                   help="comma-separated, 1k = 1024 (default 512,1k,2k,4k,8k,16k)")
    p.add_argument("--hidden", type=int, default=2048, help="heads * head_dim (default 2048)")
    p.add_argument("--tokens", type=int, default=16384, help="batch * seqlen (default 16384)")
    p.add_argument("--causal", choices=tuple(CAUSAL_MODES), default="both", help="default both")
    p.add_argument("--backends", type=_backend_list, default=list(BACKENDS), help=f"subset of {','.join(BACKENDS)}")
    p.add_argument("--reps", type=int, default=30, help="timed repetitions (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up calls (default 5)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default bench/results/<gpu-name>/)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return p


def summarize(times_ms: list[float]) -> dict:
    return {"ms_median": statistics.median(times_ms), "ms_min": min(times_ms), "ms_max": max(times_ms)}


def build_record(*, command: str, date: str, device: dict, software: dict, settings: dict,
                 measurements: list[dict]) -> dict:
    """The JSON document: provenance, settings and every measurement (pure; no GPU needed)."""
    for name, d, keys in (("device", device, ("name", "compute_capability", "driver_version")),
                          ("software", software, ("torch", "cupy", "nvrtc", "autoflash", "template_hash"))):
        missing = [k for k in keys if k not in d]
        if missing:
            raise ValueError(f"{name}: missing {missing}, expected keys {list(keys)}")
    configs = {m["shape"]: m.get("config") for m in measurements if m["backend"] == "autoflash"}
    return {"benchmark": "autoflash.bench fwd", "flops_formula": FLOPS_FORMULA,
            "provenance": {"command": command, "date": date, "device": device, "software": software,
                           "kernel_configs": configs},
            "settings": settings, "measurements": measurements}


def _num(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def format_table(measurements: list[dict]) -> str:
    flash = {m["shape"]: m.get("tflops") for m in measurements if m["backend"] == "flash"}
    rows = [("shape", "backend", "ms (min-max)", "TFLOPs", "/flash", "note")]
    for m in measurements:
        if m["status"] == "ok":
            ms = f"{m['ms_median']:.3f} ({m['ms_min']:.3f}-{m['ms_max']:.3f})"
            ref = flash.get(m["shape"])
            ratio = f"{m['tflops'] / ref:.2f}x" if ref else "-"
            rows.append((m["shape"], m["backend"], ms, f"{m['tflops']:.1f}", ratio, m.get("config") or ""))
        else:
            note = m.get("reason") or f"err {_num(m.get('err'))} > bound {_num(m.get('bound'))}"
            rows.append((m["shape"], m["backend"], m["status"], "-", "-", note[:100]))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5] for r in rows)


def plot_results(results: dict, path) -> None:
    """TFLOPs vs seqlen per backend, one panel per (head_dim, causal), from the JSON record alone."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ms = results["measurements"]
    dims, modes = sorted({m["head_dim"] for m in ms}), sorted({m["causal"] for m in ms})
    fig = Figure(figsize=(6 * len(modes), 4.2 * len(dims)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(dims), len(modes), squeeze=False)
    for (r, d), (c, causal) in ((rd, cc) for rd in enumerate(dims) for cc in enumerate(modes)):
        ax = axes[r][c]
        for b in BACKENDS:
            pts = sorted((m["seqlen"], m["tflops"]) for m in ms if m["backend"] == b and m["status"] == "ok"
                         and (m["head_dim"], m["causal"]) == (d, causal))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=b)
        seqlens = sorted({m["seqlen"] for m in ms})
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqlens, [f"{s // 1024}k" if s % 1024 == 0 else str(s) for s in seqlens])
        ax.set_ylim(bottom=0)
        ax.set(title=f"head_dim {d}, causal {'on' if causal else 'off'}", xlabel="seqlen", ylabel="TFLOPs (median)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    dev = results.get("provenance", {}).get("device", {}).get("name", "")
    fig.suptitle(f"attention forward, {results.get('settings', {}).get('dtype', '')}, {dev}")
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)


# ---------------------------------------------------------------- GPU part (imports torch lazily)

def _time_cuda(torch, fn, *, reps: int, warmup: int, flush) -> dict:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()  # evict q, k, v and the output from L2
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return summarize([s.elapsed_time(e) for s, e in events])


def _bench_shape(torch, sh: Shape, args, profile, flush) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from autoflash.defaults import default_config
    from autoflash.launch import flash_forward
    from autoflash.reference import attention_ref, within_tolerance

    dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    q, k, v = (torch.randn(sh.batch, sh.heads, sh.seqlen, sh.head_dim, device=DEVICE, dtype=dt) for _ in range(3))
    # The plain reference materialises (b, h, L, L) scores: check the (b, h) slice it can afford.
    n = max(1, CHECK_SCORE_ELEMS // (sh.seqlen * sh.seqlen))
    hs, bs = min(sh.heads, n), min(sh.batch, max(1, n // sh.heads))
    sl = (slice(0, bs), slice(0, hs))
    base = {"shape": sh.label, **dataclasses.asdict(sh), "dtype": args.dtype, "flops": sh.flops,
            "checked": f"batch[:{bs}] x heads[:{hs}] of {sh.batch} x {sh.heads}", "config": None}
    try:
        ref, _ = attention_ref(q[sl], k[sl], v[sl], causal=sh.causal)
        ref_lp, _ = attention_ref(q[sl], k[sl], v[sl], causal=sh.causal, upcast=False)
    except Exception as e:  # without a reference nothing can be checked, so nothing is timed
        return [dict(base, backend=b, status="error", reason=f"reference: {type(e).__name__}: {e}")
                for b in args.backends]
    rows = []
    for b in args.backends:
        m = dict(base, backend=b)
        try:
            if b == "autoflash":
                cfg = default_config(sh.head_dim, args.dtype, sh.causal, profile)
                m["config"] = cfg.name
                call, ctx = (lambda: flash_forward(q, k, v, causal=sh.causal, config=cfg)[0]), contextlib.nullcontext()
            elif (kind := getattr(SDPBackend, SDPA_BACKENDS[b], None)) is None:
                rows.append(dict(m, status="unsupported", reason=f"SDPBackend.{SDPA_BACKENDS[b]} not in this torch"))
                continue
            else:
                call, ctx = (lambda: sdpa(q, k, v, is_causal=sh.causal)), sdpa_kernel(kind)
            with ctx, warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    out = call()
                except RuntimeError as e:  # sdpa_kernel: "No available kernel"; the reasons come as warnings
                    if b == "autoflash" or isinstance(e, torch.cuda.OutOfMemoryError):
                        raise
                    why = "; ".join([str(w.message).strip() for w in caught] + [str(e).strip()])
                    rows.append(dict(m, status="unsupported", reason=why))
                    continue
                ok, err, bound = within_tolerance(out[sl], ref, ref_lp, factor=2.0)
                m.update(err=err if math.isfinite(err) else str(err), bound=bound)  # JSON has no NaN
                if not ok:  # a wrong result is not timed
                    rows.append(dict(m, status="failed"))
                    continue
                t = _time_cuda(torch, call, reps=args.reps, warmup=args.warmup, flush=flush)
            rows.append(dict(m, status="ok", **t, tflops=tflops(sh.flops, t["ms_median"]),
                             tflops_best=tflops(sh.flops, t["ms_min"])))
        except Exception as e:  # one backend crashing is recorded; the sweep goes on
            rows.append(dict(m, status="error", reason=f"{type(e).__name__}: {e}"))
    del q, k, v, ref, ref_lp
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
        import cupy
        v = cupy.cuda.runtime.driverGetVersion()
        return f"{v // 1000}.{v % 1000 // 10}"

    def nvrtc():
        from cuda.bindings import nvrtc as nv
        return "{1}.{2}".format(*nv.nvrtcVersion())

    def template_hash():
        from autoflash.codegen import template_hash
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
    from autoflash.gpus import detect

    try:
        profile = detect()
    except (RuntimeError, ValueError) as e:  # e.g. a GPU older than the kernels support
        print(f"autoflash.bench: {e}", file=sys.stderr)
        return 2
    device, software = _environment(torch, profile)
    out_dir = args.out or Path("bench/results") / profile.name  # profile names are slugs: "h100"
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0)
    flush = torch.empty(max(FLUSH_BYTES, 4 * l2), dtype=torch.int8, device=DEVICE)
    print(f"{device['name']} (sm {device['compute_capability']}), {args.dtype}; {FLOPS_FORMULA}", flush=True)
    torch.manual_seed(0)
    measurements = []
    with torch.no_grad():
        for i, sh in enumerate(shapes):
            print(f"[{i + 1}/{len(shapes)}] {sh.label}", file=sys.stderr, flush=True)
            measurements += _bench_shape(torch, sh, args, profile, flush)
    print(format_table(measurements))
    now = datetime.datetime.now().astimezone()
    settings = {**vars(args), "out": str(out_dir), "l2_flush_bytes": flush.numel(), "timing": "CUDA events, median"}
    record = build_record(command=shlex.join(["python", "-m", "autoflash.bench", *argv]),
                          date=now.isoformat(timespec="seconds"), device=device, software=software,
                          settings=settings, measurements=measurements)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{now:%Y-%m-%d_%H%M%S}-fwd"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {stem.with_suffix('.json')}")
    if not args.no_plot:
        plot_results(record, stem.with_suffix(".png"))
        print(f"wrote {stem.with_suffix('.png')}")
    return 1 if any(m["status"] in ("failed", "error") and m["backend"] == "autoflash" for m in measurements) else 0


if __name__ == "__main__":
    sys.exit(main())
