"""The pure half of autoflash.bench: FLOP counts, the JSON record, the text table and the plots.
Nothing here touches a GPU; everything works from plain measurement dicts (the JSON record alone)."""
from __future__ import annotations

import statistics

DIRECTIONS = ("fwd", "bwd", "fwdbwd")
FLOPS_FORMULA = "FLOPs = 4 * batch * heads * seqlen_q * seqlen_k * head_dim, halved when causal"
# FlashAttention's benchmarks/benchmark_flash_attention.py: the backward does 2.5x the forward's matmuls.
FLOPS_FACTORS = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
DIRECTION_FLOPS_FORMULA = ("bwd FLOPs = 2.5 * fwd FLOPs, fwdbwd FLOPs = 3.5 * fwd FLOPs "
                           "(FlashAttention's benchmark_flash_attention.py)")
DIRECTION_TITLES = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward + backward"}
PLOT_BACKENDS = ("autoflash", "flash", "efficient", "cudnn", "math")  # legend order; others follow


def flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool,
          direction: str = "fwd") -> float:
    """FLOPs as FlashAttention's benchmarks count them: the forward's two matmuls at 2 FLOPs per MAC
    (halved when causal), times 2.5 for the backward and 3.5 for forward + backward."""
    if direction not in FLOPS_FACTORS:
        raise ValueError(f"direction: got {direction!r}, expected one of {', '.join(FLOPS_FACTORS)}")
    f = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return (f / 2 if causal else f) * FLOPS_FACTORS[direction]


def tflops(n_flops: float, ms: float) -> float:
    return n_flops / (ms * 1e-3) / 1e12


def summarize(times_ms: list[float]) -> dict:
    return {"ms_median": statistics.median(times_ms), "ms_min": min(times_ms), "ms_max": max(times_ms)}


def build_record(*, command: str, date: str, device: dict, software: dict, settings: dict,
                 measurements: list[dict]) -> dict:
    """The JSON document: provenance, settings and every measurement (pure; no GPU needed).
    kernel_configs maps each shape to the autoflash kernels it ran: {"fwd": name, "bwd": name}."""
    for name, d, keys in (("device", device, ("name", "compute_capability", "driver_version")),
                          ("software", software, ("torch", "cupy", "nvrtc", "autoflash", "template_hash"))):
        missing = [k for k in keys if k not in d]
        if missing:
            raise ValueError(f"{name}: missing {missing}, expected keys {list(keys)}")
    configs: dict[str, dict] = {}
    for m in measurements:
        if m["backend"] == "autoflash":
            kernels = configs.setdefault(m["shape"], {})
            for kind, key in (("fwd", "config"), ("bwd", "backward_config")):
                if m.get(key):
                    kernels[kind] = m[key]
    directions = [d for d in DIRECTIONS if any(m.get("direction", "fwd") == d for m in measurements)]
    return {"benchmark": "autoflash.bench", "directions": directions, "flops_formula": FLOPS_FORMULA,
            "direction_flops_formula": DIRECTION_FLOPS_FORMULA, "flops_factors": dict(FLOPS_FACTORS),
            "provenance": {"command": command, "date": date, "device": device, "software": software,
                           "kernel_configs": configs},
            "settings": settings, "measurements": measurements}


def _num(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def _kernels(m: dict) -> str:
    d = m.get("direction", "fwd")
    names = [m.get("config")] if d == "fwd" else [m.get("backward_config")] if d == "bwd" else \
        [m.get("config"), m.get("backward_config")]
    return " + ".join(n for n in names if n)


def format_table(measurements: list[dict]) -> str:
    """One row per measurement; /flash compares TFLOPs with SDPA's flash backend on the same shape and
    direction; peak MiB is the memory one call allocates beyond what was allocated before it."""
    flash = {(m["shape"], m.get("direction", "fwd")): m.get("tflops") for m in measurements if m["backend"] == "flash"}
    rows = [("shape", "dir", "backend", "ms (min-max)", "TFLOPs", "/flash", "peak MiB", "note")]
    for m in measurements:
        d = m.get("direction", "fwd")
        if m["status"] == "ok":
            ms = f"{m['ms_median']:.3f} ({m['ms_min']:.3f}-{m['ms_max']:.3f})"
            ref = flash.get((m["shape"], d))
            ratio = f"{m['tflops'] / ref:.2f}x" if ref else "-"
            peak = f"{m['peak_mib']:.1f}" if isinstance(m.get("peak_mib"), (int, float)) else "-"
            rows.append((m["shape"], d, m["backend"], ms, f"{m['tflops']:.1f}", ratio, peak, _kernels(m)))
        else:
            note = m.get("reason") or (f"{m.get('err_of', 'out')}: err {_num(m.get('err'))} "
                                       f"> bound {_num(m.get('bound'))}")
            rows.append((m["shape"], d, m["backend"], m["status"], "-", "-", "-", note[:100]))
    n = len(rows[0]) - 1
    widths = [max(len(r[i]) for r in rows) for i in range(n)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:n], widths)) + "  " + r[n] for r in rows)


def plot_results(results: dict, path, direction: str = "fwd") -> None:
    """TFLOPs vs seqlen per backend for one direction, one panel per (head_dim, causal), from the JSON
    record alone."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ms = [m for m in results["measurements"] if m.get("direction", "fwd") == direction]
    if not ms:
        raise ValueError(f"direction: got {direction!r}, expected one measured in the record "
                         f"({', '.join(sorted({m.get('direction', 'fwd') for m in results['measurements']}))})")
    dims, modes = sorted({m["head_dim"] for m in ms}), sorted({m["causal"] for m in ms})
    backends = [b for b in PLOT_BACKENDS if any(m["backend"] == b for m in ms)]
    backends += sorted({m["backend"] for m in ms} - set(backends))
    fig = Figure(figsize=(6 * len(modes), 4.2 * len(dims)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(dims), len(modes), squeeze=False)
    seqlens = sorted({m["seqlen"] for m in ms})
    for (r, d), (c, causal) in ((rd, cc) for rd in enumerate(dims) for cc in enumerate(modes)):
        ax = axes[r][c]
        for b in backends:
            pts = sorted((m["seqlen"], m["tflops"]) for m in ms if m["backend"] == b and m["status"] == "ok"
                         and (m["head_dim"], m["causal"]) == (d, causal))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=b)
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqlens, [f"{s // 1024}k" if s % 1024 == 0 else str(s) for s in seqlens])
        ax.set_ylim(bottom=0)
        ax.set(title=f"head_dim {d}, causal {'on' if causal else 'off'}", xlabel="seqlen", ylabel="TFLOPs (median)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    dev = results.get("provenance", {}).get("device", {}).get("name", "")
    fig.suptitle(f"attention {DIRECTION_TITLES.get(direction, direction)}, "
                 f"{results.get('settings', {}).get('dtype', '')}, {dev}")
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
