"""What the tuner prints and draws: the dry-run listing of a pruned space, the final table (key,
winner, time, TFLOPs, x SDPA-flash, x default) and the --plot PNG of the search."""
from __future__ import annotations

import collections
import re
from pathlib import Path

from autoflash.bench.report import flops, tflops
from autoflash.kernels.gpus import GpuProfile
from autoflash.tuning.problem import ProblemKey, slug_label
from autoflash.tuning.space import Candidate


def key_flops(key: ProblemKey) -> float:
    """FLOPs of one pass over the key's shapes (FlashAttention's count; x2.5 for the backward), over
    the (query, key) pairs each shape's workload attends: a window's band, packed sequences' own
    lengths (for plain keys, flops(batch, heads, seqlen, seqlen, ...) as before); a decode key's
    4 * batch * heads * Lq * cache_len * d (decode.DecodeWorkload.flops)."""
    if key.is_decode:
        return sum(key.decode_workload(s).flops() for s in key.shapes())
    total = 0.0
    for s in key.shapes():
        w = key.workload(s)
        total += flops(1, w.heads, 1, 1, w.head_dim, False, key.direction) * w.total_pairs()
    return total


def key_tflops(key: ProblemKey, ms: float) -> float:
    return tflops(key_flops(key), ms)


def key_kv_bytes(key: ProblemKey) -> int:
    """Bytes of K and V a decode key's shapes read, one pass over each (decode.DecodeWorkload.kv_bytes)."""
    return sum(key.decode_workload(s).kv_bytes for s in key.shapes())


def key_bandwidth(key: ProblemKey, ms: float, profile: GpuProfile | None) -> dict:
    """A decode key's figure of merit for `ms` (summed over its shapes, as trials are): K + V bytes
    read per second, {"gb_per_s", "hbm_share"}; hbm_share is of the profile's HBM bandwidth (None
    when the profile has none)."""
    gbs = key_kv_bytes(key) / (ms * 1e-3) / 1e9
    hbm = profile.mem_bandwidth_gbs if profile is not None else 0.0
    return {"gb_per_s": gbs, "hbm_share": gbs / hbm if hbm else None}


def format_space(title: str, candidates: list[Candidate], *, show_rejected: bool = False) -> str:
    """A pruned space: the survivors with registers and shared memory, then counts of the rejected."""
    ok = [c for c in candidates if c.ok]
    width = max([40, *(len(c.config.name) for c in candidates)])  # variant kernels have longer names
    lines = [f"{title}: {len(ok)} of {len(candidates)} candidates survive"]
    if ok:
        lines.append(f"  {'config':<{width}} {'regs':>5} {'smem KiB':>9}")
        for c in sorted(ok, key=lambda c: c.config.name):
            lines.append(f"  {c.config.name:<{width}} {c.registers:>5} {c.smem_bytes / 1024:>9.1f}")
    rejected = collections.Counter(c.status for c in candidates if not c.ok)
    if rejected:
        lines.append("  rejected: " + ", ".join(f"{n} {why}" for why, n in sorted(rejected.items())))
    if show_rejected:
        for c in candidates:
            if not c.ok:
                lines.append(f"  x {c.config.name:<{width - 2}} {c.status}: {c.reason}")
    return "\n".join(lines)


def dominant_reason(candidates: list[Candidate]) -> str:
    """What rejected most of a space's candidates, as one line: the status and its most common reason
    (kernel names and figures stripped, so one ptxas notice counts once however many configs hit it)."""
    def plain(c: Candidate) -> str:
        if c.status == "smem":
            return "smem: over the GPU's shared memory per block"
        if c.status == "spills":
            return "spills: ptxas spilled registers"
        return f"{c.status}: " + re.sub(r"'[^']*'", "'...'", c.reason)

    counts = collections.Counter(plain(c) for c in candidates if not c.ok)
    if not counts:
        return "nothing was rejected"
    reason, n = counts.most_common(1)[0]
    return f"{n} of {len(candidates)}: {reason}"


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}x" if num and den else "-"


def format_results(rows: list[dict]) -> str:
    """rows: {"key" (a slug, printed as its slug_label), "winner", "ms", "tflops", "sdpa_flash_ms",
    "default_ms", "evaluated", "failed"}; x SDPA-flash and x default are speed-ups (their time over
    the winner's). Decode rows (with "gb_per_s", "hbm_share" and maybe "sdpa_gb_per_s") add the K + V
    bytes read per second, as a share of the GPU's HBM bandwidth, and SDPA's."""
    width = max([34, *(len(slug_label(r["key"])) for r in rows)])
    header = (f"{'key':<{width}} {'winner':<46} {'ms':>9} {'TFLOPs':>7} {'x SDPA-flash':>12} {'x default':>9} "
              f"{'evals':>5} {'failed':>6}")
    lines = [header, "-" * len(header)]
    for r in rows:
        key = slug_label(r["key"])
        if r.get("winner") is None:
            lines.append(f"{key:<{width}} {'(no config measured successfully)':<46}")
            continue
        lines.append(f"{key:<{width}} {r['winner']:<46} {r['ms']:>9.4f} {r['tflops']:>7.1f} "
                     f"{_ratio(r.get('sdpa_flash_ms'), r['ms']):>12} {_ratio(r.get('default_ms'), r['ms']):>9} "
                     f"{r['evaluated']:>5} {r['failed']:>6}" + _bandwidth_cell(r))
    return "\n".join(lines)


def _bandwidth_cell(row: dict) -> str:
    if row.get("gb_per_s") is None:
        return ""
    share = f" ({100 * row['hbm_share']:.0f}% of HBM)" if row.get("hbm_share") else ""
    sdpa = f", SDPA {row['sdpa_gb_per_s']:.0f} GB/s" if row.get("sdpa_gb_per_s") else ""
    return f"  K+V {row['gb_per_s']:.0f} GB/s{share}{sdpa}"


def plot_search(histories: dict[str, list[tuple[int, float]]], defaults: dict[str, float | None],
                path: Path, title: str) -> None:
    """One line per key: best time so far over the default's time, against measurements made."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for key, points in histories.items():
        base = defaults.get(key) or (points[0][1] if points else None)
        if not points or not base:
            continue
        xs, best, ys = [], float("inf"), []
        for n, ms in points:
            best = min(best, ms)
            xs.append(n)
            ys.append(best / base)
        ax.step(xs, ys, where="post", label=slug_label(key))
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("measurements")
    ax.set_ylabel("best time so far / default's time")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
