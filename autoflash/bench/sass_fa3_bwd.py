"""A static SASS reading of FlashAttention-3's own compiled backward kernels (FlashAttnBwdSm90, sm_90a),
the reference side of a backward comparison, as autoflash.bench.sass_fa3 is for the forward. Needs no GPU.

The first run downloads the `dew-flash-attn-cu13` wheel from PyPI once (78 MB; only its FlashAttention-3
library, libdew_flash_attn3.so, 18 MB, is kept: the wheel's other library is FlashAttention-2, sm_80 and
sm_120 only) into <workdir>/fa3bwd. cuobjdump extracts its sm_90a cubins; their kernels are indexed by the
template arguments of their demangled `CollectiveMainloopBwdSm90<...>` (tile, dtype, causal, deterministic,
...). This module's own main disassembles with nvdisasm the kernel FA3 runs for a plain backward
(non-deterministic, no varlen, softcap, local window or GQA epilogue) at head dims 64, 128, 192 and 256, bf16,
causal off and on. The side-by-side with autoflash's sm90 backward (side_by_side, for `python -m autoflash.bench
sass --fa3`) takes those plain kernels at COMPARED_HEAD_DIMS and, at each of them, the variants the library holds
that autoflash's sm90 backward has a counterpart of (VARIANT_ROWS): FA3's local (sliding window) kernel against
our window kernel, its varlen kernel, causal off and on, against our varlen kernels; FA3's picks are
non-deterministic and non-GQA, as the plain ones are, and our side is the kernel a call with those switches
launches (kernels.defaults.call_default). The library holds no softcap backward kernel.

What is counted: FA3's backward main kernel gives each CTA one key/value block (n_block) and loops over the
query blocks (m_block); one trip of that loop runs the five GEMMs of one query tile (S = Q K^T, dP = dO V^T,
dV += P^T dO, dK += dS^T Q, dQ = dS K). autoflash.kernels.sass.hgmma_loops finds the innermost loops holding
HGMMA; this module keeps those whose HGMMA shapes are a whole multiple of one query tile's, worked out from
the template arguments (query_tile_hgmma), and reports per consumer warp and query tile: instructions, the
HGMMA shapes, and instructions per m16n8k16-equivalent of tensor-core work (an HGMMA.64xNx16 counts N / 8
per warp). With several such loops (head dim 64 causal: FA3 peels the masked diagonal query tiles into a
loop of their own), the one with the fewest instructions per query tile is the steady loop and the one with
the most the masked loop, as sass_fa3 does for the forward.

Two counts of the same loop are given. `insns/tile` is hgmma_loops' (the whole natural loop, the mbarrier
try_wait retry paths that ptxas places after the function's body counted once: 12 instructions, the same in
every kernel here), like sass_fa3's forward rows. `in-line` leaves those out-of-line retry paths out and
counts only the instructions between the loop's head and its back branch, as one reads a listing by hand
(head dim 128: 510 of 522).

The counts are a static proxy, not GPU time: they cannot see latency hiding, warp stalls, the overlap of
wgmma with the softmax, TMA, the dQ reduction by the producer warp, or memory bandwidth, and a loop's
branches count as if taken on every trip."""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

from autoflash.bench.sass_tools import _demangle, _pip_download, _registers, _row, cuobjdump, nvdisasm_version, \
    table
from autoflash.kernels import sass

FA3_BWD_WHEEL = "dew-flash-attn-cu13==0.3.6"  # FA3 hopper/ fwd+bwd, sm_90a, CUDA 13.0; ../shared/docs/hopper.md 6
FA3_BWD_LIBRARY = "libdew_flash_attn3.so"  # the wheel's FA3 library (libdew_flash_attn.so is FA2: sm_80, sm_120)
HEAD_DIMS = (64, 128, 192, 256)
CAVEAT = ("These are static SASS instruction counts, a proxy, not GPU timings: they cannot tell latency hiding, "
          "warp stalls, how wgmma overlaps the softmax, TMA, the producer warp's dQ reduction or memory bandwidth, "
          "and a loop's branches count as if taken on every trip. No GPU ran anything here.")

# CollectiveMainloopBwdSm90<Stages, Stages_dO, Stages_dS, ClusterShape, TileShape<kBlockM, kBlockN, hdim>,
# Element, ElementAccum, Arch, Is_causal, Is_local, Has_softcap, Varlen, Deterministic, SdP_swapAB, dKV_swapAB,
# dQ_swapAB, NumMmaWarpGroups, AtomLayoutMSdP, AtomLayoutNdKV, AtomLayoutMdQ, Mma_dP_is_RS[, UseShiftScheduler]>
# (hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp; the trailing UseShiftScheduler is newer than this wheel), then the
# epilogue: CollectiveEpilogueBwd (dK, dV written in Element) or CollectiveEpilogueBwdGQA (fp32 dK/dV
# accumulation for grouped-query attention).
_MAINLOOP = re.compile(
    r"CollectiveMainloopBwdSm90<(\d+), (\d+), (\d+), cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, "
    r"cute::tuple<cute::C<(\d+)>, cute::C<(\d+)>, cute::C<(\d+)> >, cutlass::(\w+), float, cutlass::arch::Sm90, "
    r"((?:(?:true|false), ){8})(\d+), (\d+), (\d+), (\d+), ((?:true|false)(?:, (?:true|false))*)>, "
    r"flash::(CollectiveEpilogueBwd(?:GQA)?)<")
_FLAGS = ("causal", "local", "softcap", "varlen", "deterministic", "sdp_swapab", "dkv_swapab", "dq_swapab")
_TRAILING = ("dp_rs", "shift_scheduler")
_DTYPES = {"bfloat16_t": "bf16", "half_t": "fp16"}


@dataclasses.dataclass(frozen=True)
class Fa3BwdKernel:
    """One FlashAttnBwdSm90 kernel of the library and its mainloop's template arguments."""

    cubin: str
    symbol: str
    head_dim: int
    block_m: int  # query rows per m_block (one trip of the main loop)
    block_n: int  # key rows per CTA (n_block)
    dtype: str
    stages: tuple[int, int, int]  # Stages (Q, LSE), Stages_dO, Stages_dS
    warpgroups: int  # consumer (MMA) warpgroups
    atom_layouts: tuple[int, int, int]  # AtomLayoutMSdP, AtomLayoutNdKV, AtomLayoutMdQ
    flags: dict  # _FLAGS + _TRAILING (as far as the build has them) + gqa

    @property
    def causal(self) -> bool:
        return self.flags["causal"]

    @property
    def deterministic(self) -> bool:
        return self.flags["deterministic"]


def fa3_bwd_cubins(workdir: Path) -> Path:
    """workdir/fa3bwd/cubins: the sm_90a cubins of the dew-flash-attn-cu13 wheel's FA3 library, downloaded and
    extracted once (the 78 MB wheel is deleted once its 18 MB library is out)."""
    root = Path(workdir).expanduser() / "fa3bwd"
    cubins = root / "cubins"
    if cubins.is_dir() and any(cubins.glob("*.sm_90a.cubin")):
        return cubins
    lib = root / FA3_BWD_LIBRARY
    if not lib.exists():
        wheel = _pip_download(FA3_BWD_WHEEL, root / "wheel")
        with zipfile.ZipFile(wheel) as z:
            member = next((n for n in z.namelist() if n.endswith("/" + FA3_BWD_LIBRARY)), None)
            if member is None:
                raise RuntimeError(f"{wheel.name} holds no {FA3_BWD_LIBRARY}; it holds "
                                   f"{sorted(n for n in z.namelist() if n.endswith('.so'))}")
            with z.open(member) as src, open(lib, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 24)
        wheel.unlink()
    cubins.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(cuobjdump(Path(workdir).expanduser())), "-xelf", "all", str(lib.resolve())], cwd=cubins,
                   check=True, capture_output=True)
    if not any(cubins.glob("*.sm_90a.cubin")):
        raise RuntimeError(f"cuobjdump -xelf all {lib} left no sm_90a cubin in {cubins}: "
                           f"got {sorted(p.name for p in cubins.iterdir())}")
    return cubins


def parse_bwd_name(demangled: str) -> dict | None:
    """The mainloop's template arguments of a demangled FlashAttnBwdSm90 kernel name, None for any other."""
    m = _MAINLOOP.search(demangled)
    if m is None:
        return None
    s, s_do, s_ds, bm, bn, d, element, flags, wg, a_sdp, a_dkv, a_dq, trailing, epilogue = m.groups()
    leading = [f == "true" for f in flags.rstrip(", ").split(", ")]
    rest = [f == "true" for f in trailing.split(", ")]
    if len(rest) > len(_TRAILING):
        raise ValueError(f"CollectiveMainloopBwdSm90 with {len(rest)} trailing bools, expected at most "
                         f"{len(_TRAILING)} ({', '.join(_TRAILING)}): {demangled[:200]}...")
    return {"head_dim": int(d), "block_m": int(bm), "block_n": int(bn), "dtype": _DTYPES.get(element, element),
            "stages": (int(s), int(s_do), int(s_ds)), "warpgroups": int(wg),
            "atom_layouts": (int(a_sdp), int(a_dkv), int(a_dq)),
            "flags": {**dict(zip(_FLAGS, leading)), **dict(zip(_TRAILING, rest)),
                      "gqa": epilogue == "CollectiveEpilogueBwdGQA"}}


def _listing(cubin: Path) -> str:
    return subprocess.run([sass.nvdisasm(), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout


def fa3_bwd_index(cubins: Path) -> list[Fa3BwdKernel]:
    """Every FlashAttnBwdSm90 kernel of the cubins with its template arguments (cached in index.json)."""
    cached = cubins / "index.json"
    if cached.exists():
        return [Fa3BwdKernel(**{**k, "stages": tuple(k["stages"]), "atom_layouts": tuple(k["atom_layouts"])})
                for k in json.loads(cached.read_text())]
    found = []
    for cubin in sorted(cubins.glob("*.sm_90a.cubin")):
        symbols = list(sass.functions(_listing(cubin)))
        for symbol, name in zip(symbols, _demangle(symbols)):
            args = parse_bwd_name(name) if "FlashAttnBwdSm90" in name else None
            if args is not None:
                found.append(Fa3BwdKernel(cubin.name, symbol, **args))
    if not found:
        raise RuntimeError(f"no FlashAttnBwdSm90 kernel with a CollectiveMainloopBwdSm90<...> the regex reads in "
                           f"{cubins}")
    cached.write_text(json.dumps([dataclasses.asdict(k) for k in found], indent=1))
    return found


_SWITCHES = ("local", "softcap", "varlen")  # the variant flags a pick names; deterministic and GQA are never picked


def pick_fa3_bwd(index: list[Fa3BwdKernel], d: int, causal: bool, dtype: str = "bf16",
                 on: tuple[str, ...] = ()) -> Fa3BwdKernel:
    """The kernel FA3 runs for a backward at head dim d with the switches `on` (of _SWITCHES) and no other:
    by default a plain (or causal) backward, no varlen, softcap or local window; always non-deterministic,
    with the plain (non-GQA) epilogue."""
    if set(on) - set(_SWITCHES):
        raise ValueError(f"unknown FA3 backward switches {sorted(set(on) - set(_SWITCHES))}, expected of {_SWITCHES}")
    found = [k for k in index if k.dtype == dtype and k.head_dim == d and k.causal == causal
             and all(k.flags[f] == (f in on) for f in _SWITCHES) and not k.deterministic and not k.flags["gqa"]]
    if len(found) != 1:
        have = sorted({(k.head_dim, k.dtype) for k in index})
        raise RuntimeError(f"FA3 backward index: {len(found)} {dtype} kernels for d={d} causal={causal} with "
                           f"{on or 'no switch'}, expected 1 (the index has head dim, dtype {have})")
    return found[0]


def _gemm_share(rows: int, cols: int, depth: int, atom_m: int, atom_n: int, what: str) -> tuple[str, int]:
    """(HGMMA shape, count) one warpgroup issues for a rows x cols x depth GEMM tiled over an atom_m x atom_n
    grid of warpgroups (CuTe's make_tiled_mma with a 64 x (cols / atom_n) op, repeated down the rows)."""
    n, per_wg = cols // atom_n, rows // atom_m
    if cols % atom_n or rows % atom_m or per_wg % 64 or depth % 16 or n % 8 or not 8 <= n <= 256:
        raise ValueError(f"{what}: a {rows}x{cols}x{depth} GEMM over {atom_m}x{atom_n} warpgroups does not tile "
                         f"into HGMMA.64xNx16 (expected rows / {atom_m} a multiple of 64, cols / {atom_n} in 8..256 "
                         f"and a multiple of 8, depth a multiple of 16)")
    return f"64x{n}x16", per_wg // 64 * depth // 16


def query_tile_hgmma(k: Fa3BwdKernel) -> dict[str, int]:
    """The HGMMAs one consumer warp issues per query tile (m_block), from the mainloop's template arguments
    (TiledMmaSdP, TiledMmadKV, TiledMmadQ in mainloop_bwd_sm90_tma_gmma_ws.hpp): S and dP (kBlockM x kBlockN
    over hdim, or transposed with SdP_swapAB), dV and dK (kBlockN x hdim over kBlockM, or transposed with
    dKV_swapAB), dQ (kBlockM x hdim over kBlockN, or transposed with dQ_swapAB). A warpgroup's 4 warps all
    issue each of its HGMMAs."""
    m, n, d, w = k.block_m, k.block_n, k.head_dim, k.warpgroups
    a_sdp, a_dkv, a_dq = k.atom_layouts
    f = k.flags
    gemms = [  # (rows, cols, depth, warpgroups along rows, along cols, how many such GEMMs)
        ((n, m, d, w // a_sdp, a_sdp) if f["sdp_swapab"] else (m, n, d, a_sdp, w // a_sdp)) + (2, "S, dP"),
        ((d, n, m, w // a_dkv, a_dkv) if f["dkv_swapab"] else (n, d, m, a_dkv, w // a_dkv)) + (2, "dV, dK"),
        ((d, m, n, w // a_dq, a_dq) if f["dq_swapab"] else (m, d, n, a_dq, w // a_dq)) + (1, "dQ"),
    ]
    shapes: collections.Counter = collections.Counter()
    for rows, cols, depth, am, an, times, what in gemms:
        shape, count = _gemm_share(rows, cols, depth, am, an, what)
        shapes[shape] += times * count
    # The five GEMMs' multiply-adds, 5 x kBlockM x kBlockN x hdim, are the warps' m16n8k16s (2048 each).
    if _equivalents(shapes) * 4 * w * 16 * 8 * 16 != 5 * m * n * d:
        raise RuntimeError(f"{k.symbol[:80]}...: HGMMA shapes {dict(shapes)} do not add up to the five GEMMs of a "
                           f"{m}x{n} tile at head dim {d} over {w} warpgroups")
    return dict(shapes)


def _equivalents(shapes: dict[str, int]) -> int:
    return sum(int(s.split("x")[1]) // 8 * c for s, c in shapes.items())


def tiles_per_trip(loop: sass.WgmmaLoop, tile: dict[str, int]) -> int:
    """How many query tiles one trip of `loop` runs: its HGMMA shapes as a whole multiple of one tile's; 0 when
    they are not one (a loop around part of a tile's GEMMs)."""
    if set(loop.shapes) != set(tile):
        return 0
    ratios = {loop.shapes[s] / c for s, c in tile.items()}
    r = ratios.pop()
    return int(r) if not ratios and r == int(r) and r >= 1 else 0


def choose_loops(loops: list[sass.WgmmaLoop], tile: dict[str, int]) -> tuple[sass.WgmmaLoop, sass.WgmmaLoop | None]:
    """(steady, masked): of the loops that run whole query tiles, the fewest instructions per tile, and the
    most when there are several (the masked diagonal tiles peeled into a loop of their own); RuntimeError
    saying what was found when no loop runs whole query tiles."""
    whole = [lp for lp in loops if tiles_per_trip(lp, tile)]
    if not whole:
        raise RuntimeError(f"no HGMMA loop runs whole query tiles: expected a multiple of {tile} per trip, found "
                           f"{[(hex(lp.header_addr), lp.shapes) for lp in loops]}")
    per_tile = lambda lp: lp.total / tiles_per_trip(lp, tile)  # noqa: E731
    steady = min(whole, key=per_tile)
    masked = max(whole, key=per_tile) if len(whole) > 1 else None
    return steady, masked


def inline_instructions(text: str, header_addr: int) -> int:
    """Instructions of the loop at header_addr that lie between its head and its last back branch: the loop as
    the listing shows it, without the out-of-line blocks (mbarrier try_wait retries) ptxas puts after it."""
    insns = sass.parse(text)
    blocks, succ = sass._blocks(insns)
    bodies, _ = sass._loop_bodies(len(blocks), succ)
    heads = [h for h in bodies if insns[blocks[h][0]].addr == header_addr]
    if len(heads) != 1:
        raise ValueError(f"got a loop head at 0x{header_addr:04x}, expected one of this listing's loop heads")
    head = heads[0]
    body = bodies[head]
    end = max(insns[blocks[b][1] - 1].addr for b in body if head in succ[b])
    return sum(1 for b in body for i in insns[slice(*blocks[b])]
               if i.addr <= end and sass.classify(i.op, i.pred) is not None)


def _shapes(shapes: dict[str, int]) -> str:
    return " + ".join(f"{n} x {s}" for s, n in sorted(shapes.items(), key=lambda kv: int(kv[0].split("x")[1])))


def measure(k: Fa3BwdKernel, text: str, registers: int, spill: int) -> dict:
    """One row: the steady loop of kernel k (its nvdisasm section `text`) per consumer warp and query tile."""
    tile = query_tile_hgmma(k)
    loops = sass.hgmma_loops(text)
    if not loops:
        raise RuntimeError(f"{k.symbol[:80]}...: no loop holding HGMMA")
    steady, masked = choose_loops(loops, tile)
    trips = tiles_per_trip(steady, tile)
    eq = _equivalents(tile)
    inline = inline_instructions(text, steady.header_addr) / trips
    c = steady.counts
    what = "".join(f" {f}" for f in _SWITCHES if k.flags[f]) + (" causal" if k.causal else "")
    row = {"kernel": f"FlashAttnBwdSm90 {k.dtype} d{k.head_dim}{what}",
           "symbol": k.symbol, "cubin": k.cubin,
           "tile": f"{k.block_m}x{k.block_n} {k.warpgroups}WG",
           "swapAB": "".join(n for n, f in (("SdP ", "sdp_swapab"), ("dKV ", "dkv_swapab"), ("dQ", "dq_swapab"))
                             if k.flags[f]).strip() or "-",
           "registers": registers, "spill bytes": spill,
           "HGMMA loops": len(loops), "loop at": f"0x{steady.header_addr:04x}", "tiles/trip": trips,
           "HGMMA/tile": sum(tile.values()), "shapes": _shapes(tile), "m16n8k16-eq/warp": eq,
           "insns/tile": steady.total / trips, "in-line insns/tile": inline,
           "insns/eq": round(steady.total / trips / eq, 3), "in-line insns/eq": round(inline / eq, 3),
           "masked insns/tile": masked.total / tiles_per_trip(masked, tile) if masked else float("nan"),
           "masked insns/eq": round(masked.total / tiles_per_trip(masked, tile) / eq, 3) if masked else float("nan"),
           "MUFU": c.get("MUFU", 0), "FP": sum(c.get(op, 0) for op in sass._FP),
           "uniform": sum(v for op, v in c.items() if op.startswith("U") or op == "R2UR"),
           "smem stores": c.get("STS", 0) + c.get("STSM", 0),
           "RED/ATOM": sum(c.get(op, 0) for op in ("RED", "REDG", "ATOM", "ATOMG", "UBLKRED")),
           "SYNCS+BAR": c.get("SYNCS", 0) + c.get("BAR", 0)}
    if masked is not None:
        row["masked loop at"] = f"0x{masked.header_addr:04x}"
    return row


def collect_fa3_bwd(workdir: Path, log=print, dtype: str = "bf16") -> list[dict]:
    """The rows for head dims 64, 128, 192, 256, causal off and on: FA3's plain backward kernel's steady
    loop per consumer warp and query tile (see measure)."""
    workdir = Path(workdir).expanduser()
    cubins = fa3_bwd_cubins(workdir)
    index = fa3_bwd_index(cubins)
    tool = cuobjdump(workdir)
    listings: dict[str, dict[str, str]] = {}
    rows = []
    for d in HEAD_DIMS:
        for causal in (False, True):
            k = pick_fa3_bwd(index, d, causal, dtype)
            log(f"FA3 bwd d{d}{' causal' if causal else ''}: {k.symbol[:70]}... ({k.cubin})")
            if k.cubin not in listings:
                listings[k.cubin] = sass.functions(_listing(cubins / k.cubin))
            regs, local = _registers(tool, cubins / k.cubin, k.symbol)
            rows.append(measure(k, listings[k.cubin][k.symbol], regs, local))
    return rows


# The side-by-side with autoflash's sm90 backward (python -m autoflash.bench sass --fa3): the head dims of the
# Hopper backward issue's target.
COMPARED_HEAD_DIMS = (64, 128, 256)
# The variants of FA3's backward library that autoflash's sm90 backward has a counterpart of, at each of
# COMPARED_HEAD_DIMS: (FA3's flags, causal, autoflash's switches), as sass_fa3.VARIANT_ROWS for the forward. FA3's
# local kernel (is_local, not is_causal) against our window, aligned bottom right as FA3's window is; FA3's varlen,
# causal off and on. Each side's tiles are its own default for the call (FA3: run_mha_bwd_hdim* in
# hopper/flash_bwd_launch_template.h with its flags; autoflash: kernels.defaults.call_default). The library holds no
# softcap backward kernel.
VARIANT_ROWS = ((("local",), False, dict(window=True, align="bottom_right")),
                (("varlen",), False, dict(varlen=True)),
                (("varlen",), True, dict(varlen=True, align="bottom_right")))


def compared_pairs(index: list[Fa3BwdKernel], profile) -> list[tuple[Fa3BwdKernel, object]]:
    """(FA3's kernel, autoflash's KernelConfig) for each row pair of the side-by-side: at COMPARED_HEAD_DIMS, the
    plain bf16 backward, causal off and on, then VARIANT_ROWS; our side is the built-in kernel a call with those
    switches launches (call_default; with none, default_backward_config's)."""
    from autoflash.kernels.defaults import call_default

    pairs = []
    for d in COMPARED_HEAD_DIMS:
        for on, causal, switches in [((), False, {}), ((), True, {})] + list(VARIANT_ROWS):
            pairs.append((pick_fa3_bwd(index, d, causal, on=on), call_default("bwd", d, "bf16", causal, switches,
                                                                              profile)))
    return pairs


def ours_row(cfg, text: str, registers: int, spill: int) -> dict:
    """autoflash's sm90 backward kernel as a row of the side-by-side, per consumer warp and query tile, counted
    as sass_fa3 counts the forward: its loop over query tiles, or with the masked tiles peeled into loops of
    their own (head dims up to 64: the first tiles, and with a window the last ones too, as FA3 peels them),
    the unmasked loop as the steady one and the costliest masked one beside it (in the one loop the mask sits
    behind a uniform branch, counted as taken). Also in-line, as FA3's rows are (inline_instructions: without
    the out-of-line mbarrier retry paths)."""
    loops = sass.hgmma_loops(text)
    if len(loops) not in (1, 2, 3) or any(lp.shapes != loops[0].shapes for lp in loops):
        raise RuntimeError(f"{cfg.name}: loops holding HGMMA {[lp.shapes for lp in loops]}, expected one to three "
                           f"over query tiles, each a tile's GEMMs")
    tile = f"{cfg.block_m}x{cfg.block_n} {cfg.consumer_groups}WG" + (" dKV split" if cfg.dkv_split else "")
    row = _row("autoflash", cfg.name, tile, text, registers, spill)
    steady = min(loops, key=lambda loop: loop.total)  # _row's steady loop
    inline = inline_instructions(text, steady.header_addr)
    return {**row, "in-line insns/tile": inline, "in-line insns/eq": round(inline / steady.mma_equivalents, 3)}


def side_by_side(workdir: Path, log=print) -> tuple[list[dict], bool]:
    """(rows, every autoflash row meets the target): FA3's bf16 backward and the kernel the H100's built-in
    backward launches for the same call, at COMPARED_HEAD_DIMS: plain, causal off and on, then VARIANT_ROWS
    (compared_pairs). A row meets the target where both its counts, with the out-of-line retry paths and in-line,
    are at or below FA3's and nothing spills. Where the built-in backward is not the sm90 family, autoflash's
    row says so and misses the target."""
    from autoflash.kernels.compiler import compile_config
    from autoflash.kernels.gpus import get_profile

    workdir = Path(workdir).expanduser()
    cubins = fa3_bwd_cubins(workdir)
    index = fa3_bwd_index(cubins)
    tool = cuobjdump(workdir)
    profile = get_profile("h100")
    listings: dict[str, dict[str, str]] = {}
    rows, verdicts = [], []
    for k, cfg in compared_pairs(index, profile):
        log(f"FA3 bwd {k.symbol[:60]}... ({k.cubin})")
        if k.cubin not in listings:
            listings[k.cubin] = sass.functions(_listing(cubins / k.cubin))
        regs, local = _registers(tool, cubins / k.cubin, k.symbol)
        theirs = measure(k, listings[k.cubin][k.symbol], regs, local)
        rows.append({"side": "FA3", **theirs})
        if cfg.family != "sm90":
            rows.append({"side": "autoflash",
                         "kernel": f"{cfg.name} (sm80 family: no sm90 backward at d{cfg.head_dim})",
                         "meets target": "NO"})
            verdicts.append(False)
            continue
        log(f"autoflash {cfg.name}")
        compiled = compile_config(cfg, profile.arch)  # the sm90 gate: no serialization notices, no spills
        res = compiled.resources
        ours = ours_row(cfg, sass.disassemble(compiled.cubin_path, cfg.name), res.registers,
                        res.spill_stores + res.spill_loads)
        meets = (ours["insns/eq"] <= theirs["insns/eq"] and ours["in-line insns/eq"] <= theirs["in-line insns/eq"]
                 and not ours["spill bytes"])
        ours["meets target"] = "yes" if meets else "NO"
        verdicts.append(meets)
        rows.append(ours)
    return rows, all(verdicts)


COLUMNS = (("kernel", "kernel"), ("tile", "tile"), ("swapAB", "swapAB"), ("regs", "registers"),
           ("spill B", "spill bytes"), ("HGMMA/tile", "HGMMA/tile"), ("shapes (per warp, query tile)", "shapes"),
           ("eq/warp", "m16n8k16-eq/warp"), ("insns/tile", "insns/tile"), ("in-line", "in-line insns/tile"),
           ("insns/eq", "insns/eq"), ("in-line/eq", "in-line insns/eq"), ("masked insns/eq", "masked insns/eq"),
           ("MUFU", "MUFU"), ("FP", "FP"), ("uniform", "uniform"), ("STS+STSM", "smem stores"),
           ("SYNCS+BAR", "SYNCS+BAR"))
LEGEND = """Per consumer warp and query tile (one trip of the main kernel's loop over m_block; every row's loop runs one
tile a trip). HGMMA/tile, shapes, eq/warp: what one warp issues for the five GEMMs of a tile, worked out from the
template arguments and checked against the loop (HGMMA.64xNx16 = N/8 m16n8k16-equivalents per warp).
insns/tile: the loop's instructions as autoflash.kernels.sass.hgmma_loops counts them (as the forward report does;
mbarrier try_wait retry paths, placed after the function's body, count once); in-line: without those out-of-line
retry paths (12 instructions in every kernel here), the listing from the loop's head to its back branch.
insns/eq, in-line/eq: the same per equivalent. masked insns/eq: the masked loop's, where the kernel peels the causal
diagonal tiles into a loop of its own (FA3 does at head dim <= 64; elsewhere the mask sits in the one loop and its
branches are counted as taken). regs: ptxas's count at entry (cuobjdump -res-usage; setmaxnreg gives consumers
more). swapAB: the GEMMs FA3 computes transposed. STS+STSM: shared-memory stores (P, dS; dQ accumulator)."""


def render(rows: list[dict], dtype: str = "bf16", wheel: str = FA3_BWD_WHEEL) -> str:
    head = [f"Static SASS of FlashAttention-3's compiled backward main kernel (FlashAttnBwdSm90, sm_90a), {dtype},",
            "plain (non-deterministic, no varlen/softcap/local/GQA) kernels.",
            f"FA3:        {wheel} from PyPI, {FA3_BWD_LIBRARY} (its sm_90a cubins, built by the wheel's authors)",
            f"nvdisasm:   {nvdisasm_version()}", "", textwrap.fill(CAVEAT, 115), "", LEGEND]
    masked = [f"{r['kernel']}: steady loop {r['loop at']}, masked loop {r['masked loop at']} "
              f"({r['masked insns/tile']:.0f} instructions per tile)" for r in rows if "masked loop at" in r]
    symbols = [f"{r['kernel']}: {r['cubin']} {r['symbol']}" for r in rows]
    return ("\n".join(head) + "\n\n" + table(rows, COLUMNS) + "\n\n" + "\n".join(masked)
            + "\n\nkernels:\n" + "\n".join(symbols) + "\n")


def main(argv: list[str] | None = None) -> int:
    from autoflash.kernels.compiler import cache_dir

    p = argparse.ArgumentParser(prog="python -m autoflash.bench.sass_fa3_bwd", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=cache_dir() / "sass-compare",
                   help="where the downloaded library and extracted cubins are kept, under fa3bwd/ "
                   "(default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(set(_DTYPES.values())), default="bf16")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    rows = collect_fa3_bwd(args.workdir, log=lambda s: print(s, file=sys.stderr), dtype=args.dtype)
    print(render(rows, args.dtype), end="")
    if args.json:
        clean = [{key: None if isinstance(v, float) and math.isnan(v) else v for key, v in r.items()} for r in rows]
        args.json.write_text(json.dumps({"wheel": FA3_BWD_WHEEL, "dtype": args.dtype, "nvdisasm": nvdisasm_version(),
                                         "rows": clean}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
