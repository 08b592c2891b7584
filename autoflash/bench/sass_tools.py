"""What the static SASS reports (bench/sass.py against FlashAttention-2, sass_fa3.py and
sass_fa3_bwd.py against FlashAttention-3) share: peers' wheels from PyPI and the tools that read their
cubins (cuobjdump, nvdisasm's version, c++filt), one function's registers, the row of an HGMMA loop
counted the same way for both sides, the text table and the report's provenance lines. Below the
three report modules, so none of them imports another for these."""
from __future__ import annotations

import re
import stat
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

from autoflash.kernels import sass


def _pip_download(requirement: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                    "--dest", str(dest), requirement], check=True)
    new = sorted(set(dest.glob("*.whl")) - before) or sorted(dest.glob("*.whl"))
    if not new:
        raise RuntimeError(f"pip download {requirement!r} left no wheel in {dest}")
    return new[-1]


def cuobjdump(workdir: Path) -> Path:
    """cuobjdump: the pip-installed toolkit's, else the one in workdir/bin, else from PyPI's
    nvidia-cuda-cuobjdump wheel (unpacked into workdir)."""
    from cuda.pathfinder import find_nvidia_binary_utility

    found = find_nvidia_binary_utility("cuobjdump")
    if found:
        return Path(found)
    exe = workdir / "bin" / "cuobjdump"
    if exe.exists():
        return exe
    wheel = _pip_download("nvidia-cuda-cuobjdump", workdir / "tools")
    with zipfile.ZipFile(wheel) as z:
        member = next((n for n in z.namelist() if n.endswith("/bin/cuobjdump")), None)
        if member is None:
            raise RuntimeError(f"{wheel.name} holds no bin/cuobjdump")
        exe.parent.mkdir(parents=True, exist_ok=True)
        exe.write_bytes(z.read(member))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return exe


def nvdisasm_version() -> str:
    out = subprocess.run([sass.nvdisasm(), "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"V(\d+\.\d+\.\d+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]


def _cell(v) -> str:
    if isinstance(v, float):
        return "-" if v != v else (f"{v:.0f}" if v == int(v) and abs(v) >= 10 else f"{v:.3g}" if v < 10 else f"{v:.1f}")
    return str(v)


def table(rows: list[dict], columns) -> str:
    """Rows as a text table: numbers right-aligned, words left-aligned."""
    cells = [[h for h, _ in columns]] + [[_cell(r.get(key, "")) for _, key in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    numeric = [all(isinstance(r.get(key), (int, float)) for r in rows) for _, key in columns]
    lines = [" | ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)).rstrip()
             for row in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def source() -> str:
    """autoflash's version, and the git commit of its checkout when it is one, with the tracked files
    that differ from it (the figures are of the files on disk)."""
    import autoflash

    here = Path(autoflash.__file__).resolve().parent.parent
    try:
        git = lambda *a: subprocess.run(["git", *a], cwd=here, capture_output=True, text=True,  # noqa: E731
                                        check=True).stdout
        commit, changed = git("rev-parse", "--short", "HEAD").strip(), git("diff", "--name-only", "HEAD").split()
    except (OSError, subprocess.CalledProcessError):  # an installed package: no checkout to name
        return autoflash.__version__
    if not changed:
        return f"{autoflash.__version__}, git {commit}"
    more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
    return f"{autoflash.__version__}, git {commit} with uncommitted changes to {', '.join(changed[:6])}{more}"


def provenance(command: str, date: str, peer: str, report: dict, caveat: str, legend: str) -> list[str]:
    """The lines a static report gives below its title: the command, the date, the peer's line and
    autoflash's versions, then the caveat and the legend."""
    return [f"command:    {command}", f"date:       {date}", peer,
            f"autoflash:  {report['autoflash']}    template hash: {report['template_hash']}",
            f"NVRTC:      {report['nvrtc']}    nvdisasm: {report['nvdisasm']}", "", textwrap.fill(caveat, 115), "",
            legend]


def _demangle(symbols: list[str]) -> list[str]:
    out = subprocess.run(["c++filt"], input="\n".join(symbols), capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def _registers(tool: Path, cubin: Path, symbol: str) -> tuple[int, int]:
    """(registers, local-memory bytes) of one function, from cuobjdump -res-usage."""
    out = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if [w.rstrip(":") for w in line.split()[-1:]] == [symbol] and i + 1 < len(lines):
            regs = re.search(r"REG:(\d+)", lines[i + 1])
            local = re.search(r"LOCAL:(\d+)", lines[i + 1])
            return int(regs.group(1)) if regs else -1, int(local.group(1)) if local else -1
    return -1, -1


def _row(side: str, kernel: str, tile: str, text: str, registers: int, spill: int) -> dict:
    loops = sass.hgmma_loops(text)
    if not loops:
        raise RuntimeError(f"{kernel}: no loop holding HGMMA")
    steady = min(loops, key=lambda loop: loop.total)
    masked = max(loops, key=lambda loop: loop.total) if len(loops) > 1 else None
    shapes = " + ".join(f"{n} x {s}" for s, n in sorted(steady.shapes.items()))
    return {"side": side, "kernel": kernel, "tile": tile, "registers": registers, "spill bytes": spill,
            "HGMMA/tile": sum(steady.shapes.values()), "shapes": shapes, "m16n8k16-eq/warp": steady.mma_equivalents,
            "insns/tile": steady.total, "insns/eq": round(steady.per_equivalent, 3),
            "masked insns/eq": round(masked.per_equivalent, 3) if masked else float("nan"),
            "MUFU": steady.counts.get("MUFU", 0), "FP": sum(steady.counts.get(k, 0) for k in sass._FP),
            "uniform": sum(v for k, v in steady.counts.items() if k.startswith("U") or k == "R2UR"),
            "SYNCS+BAR": steady.counts.get("SYNCS", 0) + steady.counts.get("BAR", 0)}
