"""`python -m autoflash.bench sass`: a static SASS side-by-side of autoflash's default kernels and
the FlashAttention-2 kernels that torch's CUDA wheel ships (torch SDPA's flash backend), forward and
backward, bf16, head dims 64 and 128, causal off and on, for an A100 (sm_80) and an H100 (sm_80 and
sm_90). Needs no GPU.

    python -m autoflash.bench sass [--workdir DIR] [--out DIR] [--torch SPEC]

The first run downloads the torch CUDA wheel from PyPI once (about 1 GB; only libtorch_cuda.so is
kept, about 0.5 GB) and nvidia-cuda-cuobjdump (a few hundred KB), into --workdir (default
~/.cache/autoflash/sass-compare). cuobjdump finds FlashAttention-2's kernels in libtorch_cuda.so and
extracts their cubins; nvdisasm (from the pip-installed CUDA toolkit) disassembles both sides, and
autoflash.kernels.sass counts the main loop's instructions, per warp and iteration.

The counts are a static proxy, not timings: they cannot see latency hiding, stalls, bank conflicts
or memory bandwidth, and branches inside a loop count as if taken on every iteration. The table
goes to stdout and, with a JSON twin, to --out as <date>-sass-<template hash>.{txt,json}.

    python -m autoflash.bench sass --decode [--out DIR]
    python -m autoflash.bench sass --fa3 [--workdir DIR] [--out DIR]

--decode reports instead the global loads of the decode (KV-cache) kernels, dense, paged and split:
per block and main-loop iteration against one K and one V tile, outside the loops against the Q tile
and the first K/V tiles, and the grid flash_decode launches for a GQA call on the host emulator. It
downloads nothing; it writes <date>-decode-loads-<template hash>.{txt,json}.

--fa3 compares the sm90 family, forward and backward, with FlashAttention-3's own compiled kernels
instead (autoflash/bench/sass_fa3.py, sass_fa3_bwd.py)."""
from __future__ import annotations

import argparse
import dataclasses
import fractions
import json
import re
import shutil
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

from autoflash.bench.sass_tools import _pip_download, cuobjdump, nvdisasm_version, provenance, source, table
from autoflash.kernels import sass

TARGETS = (("a100", "sm_80"), ("h100", "sm_80"), ("h100", "sm_90"))  # (GPU profile, arch compiled for)
HEAD_DIMS = (64, 128)
DTYPE = "bf16"

CAVEAT = ("These are static SASS instruction counts, a proxy, not GPU time. They cannot tell latency hiding, "
          "warp stalls, shared-memory bank conflicts or memory bandwidth, and a loop's branches count as if "
          "taken on every iteration.")

# FlashAttention-2's tiles as torch's copy launches them (aten/src/ATen/native/transformers/cuda/
# flash_attn/flash_{fwd,bwd}_launch_template.h) for bf16 without dropout on compute capability 8.0
# and 9.0. Forward, Flash_fwd_kernel_traits<d, kBlockM, kBlockN, kNWarps, Is_Q_in_regs,
# Share_Q_K_smem>: d <= 64 128x128, d <= 128 128x64 (the 128x32 / 64x64 choice is for sm86/sm89).
FA2_FWD_TRAITS = {64: (64, 128, 128, 4, 0, 0), 128: (128, 128, 64, 4, 0, 0)}
# Backward, Flash_bwd_kernel_traits<d, kBlockM, kBlockN, kNWarps, AtomLayoutMSdP, AtomLayoutNdKV,
# AtomLayoutMdQ, Is_V_in_regs, No_double_buffer>: run_mha_bwd_hdim{64,128} take the first with at
# least 144 KB of opt-in shared memory per block (A100, H100), the second below.
FA2_BWD_TRAITS = {64: ((64, 128, 128, 8, 4, 4, 4, 0, 0), (64, 64, 128, 8, 2, 4, 4, 1, 0)),
                  128: ((128, 64, 128, 8, 2, 4, 2, 0, 0), (128, 64, 64, 8, 4, 2, 2, 1, 0))}
FA2_BWD_BIG_SMEM = 144 * 1024
# The kernels' bool template arguments, in order. The ones torch runs for SDPA without dropout,
# window, ALiBi or softcap at sequence lengths that are multiples of the tiles and d = kHeadDim.
FWD_FLAGS = ("Is_dropout", "Is_causal", "Is_local", "Has_alibi", "Is_even_MN", "Is_even_K", "Is_softcap",
             "Return_softmax")
BWD_FLAGS = ("Is_dropout", "Is_causal", "Is_local", "Has_alibi", "Is_even_MN", "Is_even_K", "Is_softcap")


def _flags(names: tuple[str, ...], causal: bool) -> tuple[int, ...]:
    on = {"Is_causal": int(causal), "Is_even_MN": 1, "Is_even_K": 1}
    return tuple(on.get(n, 0) for n in names)


# ---------------------------------------------------------------- FlashAttention-2's mangled names

@dataclasses.dataclass(frozen=True)
class FlashSymbol:
    """One pytorch_flash kernel instantiation, read from its Itanium-mangled name."""

    mangled: str
    kernel: str  # e.g. flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel
    lead: tuple[int, ...]  # bools before the traits (flash_bwd_dot_do_o_kernel's Clear_dQaccum)
    traits: tuple[int, ...]  # the traits' int and bool arguments, in order
    elem: str  # bfloat16_t, half_t
    flags: tuple[int, ...]  # the kernel's bools after the traits


_NAME = re.compile(r"_ZN13pytorch_flash(\d+)")
_ARGS = re.compile(r"I(?P<lead>(?:Lb[01]E)*)\d+Flash_(?:fwd|bwd)_kernel_traitsI(?P<traits>(?:L[ib]\d+E)+)"
                   r"N7cutlass\d+(?P<elem>\w+?)E\d+Flash_kernel_traitsI(?:Li\d+E)+S\d*_EE(?P<flags>(?:Lb[01]E)*)EEv")
_VALUE = re.compile(r"L[ib](\d+)E")


def parse_symbol(mangled: str) -> FlashSymbol | None:
    """The template arguments of a pytorch_flash kernel symbol; None for any other symbol."""
    m = _NAME.match(mangled)
    if not m:
        return None
    start = m.end()
    kernel = mangled[start:start + int(m.group(1))]
    a = _ARGS.match(mangled, start + len(kernel))
    if not a:
        return None
    ints = lambda s: tuple(int(v) for v in _VALUE.findall(s))  # noqa: E731
    return FlashSymbol(mangled, kernel, ints(a["lead"]), ints(a["traits"]), a["elem"], ints(a["flags"]))


@dataclasses.dataclass(frozen=True)
class Located:
    elf: str  # the embedded cubin's name as cuobjdump -lelf lists it
    arch: str
    symbol: FlashSymbol


def pick(index: list[Located], kernel: str, arch: str, traits: tuple[int, ...], flags: tuple[int, ...] | None = None,
         lead: tuple[int, ...] = ()) -> Located:
    """The bf16 instantiation of `kernel` with these template arguments for `arch` (the first copy:
    the same instantiation sits in several translation units' cubins)."""
    same = [x for x in index if x.arch == arch and x.symbol.kernel == kernel and x.symbol.elem == "bfloat16_t"]
    for x in same:
        if x.symbol.traits == traits and x.symbol.lead == lead and (flags is None or x.symbol.flags == flags):
            return x
    seen = sorted({(x.symbol.lead, x.symbol.traits, x.symbol.flags) for x in same if x.symbol.traits[0] == traits[0]})
    raise ValueError(f"no {kernel} for {arch} bf16 with lead {lead}, traits {traits}, flags {flags} in "
                     f"libtorch_cuda.so; got {seen or 'none at that head dim'}, expected the instantiations of "
                     f"torch's launch templates (see FA2_FWD_TRAITS, FA2_BWD_TRAITS)")


# ---------------------------------------------------------------- tools and the torch library

@dataclasses.dataclass(frozen=True)
class TorchLibrary:
    path: Path
    version: str  # torch.__version__ of the wheel, e.g. 2.14.1+cu130
    cuda: str  # torch.version.cuda of the wheel


def torch_library(workdir: Path, requirement: str = "torch") -> TorchLibrary:
    """libtorch_cuda.so of torch's CUDA wheel, downloaded once into workdir/lib (the wheel itself is
    deleted after the library and torch/version.py are taken out of it)."""
    lib, info = workdir / "lib" / "libtorch_cuda.so", workdir / "lib" / "torch_version.txt"
    if not (lib.exists() and info.exists()):
        wheel = _pip_download(requirement, workdir / "wheel")
        with zipfile.ZipFile(wheel) as z:
            names = set(z.namelist())
            if "torch/lib/libtorch_cuda.so" not in names:
                raise ValueError(f"--torch: got {wheel.name}, without torch/lib/libtorch_cuda.so; expected a CUDA "
                                 f"build of torch (PyPI's Linux x86-64 default)")
            lib.parent.mkdir(parents=True, exist_ok=True)
            with z.open("torch/lib/libtorch_cuda.so") as src, open(lib, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 24)
            info.write_bytes(z.read("torch/version.py"))
        wheel.unlink()
    text = info.read_text()
    version = re.search(r"__version__\s*=\s*'([^']+)'", text)
    cuda = re.search(r"^cuda\b[^=]*=\s*'([^']+)'", text, re.M)
    return TorchLibrary(lib, version.group(1) if version else "?", cuda.group(1) if cuda else "?")


def flash_index(tool: Path, lib: Path) -> list[Located]:
    """Every pytorch_flash kernel in the library with the embedded cubin that holds it. cuobjdump
    -symbols lists the cubins' symbol tables in the order -lelf lists their names; the index is
    cached beside the library (half a minute to build)."""
    cache = lib.with_name("flash_index.json")
    key = {"size": lib.stat().st_size, "mtime_ns": lib.stat().st_mtime_ns}
    if cache.exists():
        data = json.loads(cache.read_text())
        if data.get("key") == key:
            return [Located(e, a, parse_symbol(s)) for e, a, s in data["kernels"]]
    listing = subprocess.run([str(tool), "-lelf", str(lib)], capture_output=True, text=True, check=True).stdout
    names = [line.split(":", 1)[1].strip() for line in listing.splitlines() if line.startswith("ELF file")]
    found, elf, arch = [], -1, None
    with subprocess.Popen([str(tool), "-symbols", str(lib)], stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:
            if line.startswith("Fatbin elf code"):
                elf, arch = elf + 1, None
            elif line.startswith("Fatbin"):  # a PTX entry: no functions of a cubin
                arch = None
            elif line.startswith("arch = "):
                arch = line.split("=", 1)[1].strip()
            elif arch and line.startswith("FUNC") and "_ZN13pytorch_flash" in line:
                mangled = line.split()[-1]
                if parse_symbol(mangled) is not None:
                    found.append((names[elf], arch, mangled))
    if proc.returncode or elf + 1 != len(names):
        raise RuntimeError(f"cuobjdump -symbols listed {elf + 1} cubins where -lelf named {len(names)} "
                           f"(exit status {proc.returncode}); cannot tell which cubin holds which kernel")
    cache.write_text(json.dumps({"key": key, "kernels": found}))
    return [Located(e, a, parse_symbol(s)) for e, a, s in found]


class Fa2Cubins:
    """Embedded cubins taken out of libtorch_cuda.so (once, into workdir/fa2), their disassembly
    (workdir/sass) and ptxas resource usage."""

    def __init__(self, tool: Path, lib: Path, workdir: Path):
        self.tool, self.lib = tool, lib
        self.cubins, self.listings = workdir / "fa2", workdir / "sass"
        self._text: dict[str, dict[str, str]] = {}
        self._usage: dict[str, dict[str, dict[str, int]]] = {}

    def extract(self, elfs: set[str]) -> None:
        missing = sorted(e for e in elfs if not (self.cubins / e).exists())
        if missing:  # one pass over the 0.5 GB library for all of them
            self.cubins.mkdir(parents=True, exist_ok=True)
            subprocess.run([str(self.tool), "-xelf", ",".join(missing), str(self.lib.resolve())],
                           cwd=self.cubins, check=True, capture_output=True)

    def function(self, at: Located) -> str:
        if at.elf not in self._text:
            listing = self.listings / (at.elf + ".sass")
            if not listing.exists():
                self.listings.mkdir(parents=True, exist_ok=True)
                listing.write_text(sass.disassemble(self.cubins / at.elf))
            self._text[at.elf] = sass.functions(listing.read_text())
        return self._text[at.elf][at.symbol.mangled]

    def usage(self, at: Located) -> dict[str, int]:
        """cuobjdump -res-usage of one function: REG, STACK, SHARED, LOCAL, ..."""
        if at.elf not in self._usage:
            out = subprocess.run([str(self.tool), "-res-usage", str(self.cubins / at.elf)],
                                 capture_output=True, text=True, check=True).stdout
            table, name = {}, None
            for line in out.splitlines():
                m = re.match(r"\s*Function (\S+):", line)
                if m:
                    name = m.group(1)
                elif name:
                    table[name] = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}
                    name = None
            self._usage[at.elf] = table
        return self._usage[at.elf][at.symbol.mangled]


# ---------------------------------------------------------------- the kernels side by side

@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of a row: its tile (per block) and what ptxas gave it."""

    who: str  # "FA2" or "autoflash"
    name: str
    direction: str
    head_dim: int  # padded head dim the MMAs run over
    block_m: int  # forward: query rows per block; backward: query rows per step
    block_n: int  # forward: keys per step; backward: keys per block
    warps: int
    stages: int
    head_split: int
    smem: int  # bytes of dynamic shared memory per block
    registers: int
    text: str  # nvdisasm listing of the function

    @property
    def tile(self) -> str:
        split = f" h{self.head_split}" if self.head_split > 1 else ""
        return f"{self.block_m}x{self.block_n} w{self.warps} s{self.stages}{split}"


def mma_per_warp(k: Kernel) -> tuple[fractions.Fraction, fractions.Fraction]:
    """(executed, useful) mma.m16n8k16 per warp and main-loop iteration, from the tile.

    Each product of the loop (forward: S = Q K^T, O += P V; backward: S, dP = dO V^T, dV += P^T dO,
    dK += dS^T Q, dQ += dS K) costs B = block_m * block_n * d / (16 * 8 * 16) MMAs per block. With
    head_split h, S and dP are computed in full by each of the h blocks sharing a key block while
    dV, dK, dQ are split: (2 + 3/h) B executed, 5 B / h useful."""
    b = fractions.Fraction(k.block_m * k.block_n * k.head_dim, 16 * 8 * 16)
    if k.direction == "fwd":
        return 2 * b / k.warps, 2 * b / k.warps
    return (2 + fractions.Fraction(3, k.head_split)) * b / k.warps, 5 * b / (k.head_split * k.warps)


AMORTISE = (1024, 16384)  # sequence lengths (queries = keys) the per-block figures spread the prologue over


def steps_per_block(k: Kernel, seqlen: int, causal: bool) -> list[int]:
    """Main-loop steps of each block of one (batch, head) at seqlen queries and keys, causal
    top-left: the forward's query blocks walk key tiles, the backward's key blocks query tiles."""
    if k.direction == "fwd":
        return [-(-min(seqlen, (i + 1) * k.block_m) // k.block_n) if causal else -(-seqlen // k.block_n)
                for i in range(-(-seqlen // k.block_m))]
    return [-(-seqlen // k.block_m) - (j * k.block_n // k.block_m if causal else 0)
            for j in range(-(-seqlen // k.block_n))]


def measure(k: Kernel, profile, causal: bool = False) -> tuple[dict, list[str]]:
    """One table row for kernel `k` on GPU `profile`, and notes on how its loop was counted.

    The step loop on both sides is the innermost loop holding all the HMMAs of the loop it sits in
    (sass.hmma_loops), its steady-state copy (sass.main_loop), every instruction of its body once.
    The per-block figures add what runs once per block around the steps (sass.path_instructions:
    the heaviest path with every other loop run once) spread over the block's steps."""
    loop = sass.main_loop(sass.hmma_loops(k.text))
    executed, useful = mma_per_warp(k)
    static, notes, how = loop.counts.get("HMMA", 0), [], "loop"
    counts = loop.counts
    if static != executed:
        # HMMAs in branches picked at run time (head slice, warp): one iteration runs fewer of them.
        path = sass.iteration_counts(k.text, loop, int(executed)) if executed.denominator == 1 else None
        if path is None:
            notes.append(f"WARNING {k.name}: the main loop holds {static} HMMA, the tile implies {float(executed):g} "
                         f"per warp and iteration, and no path through the loop issues that many; the whole loop "
                         f"is counted")
        else:
            counts, how = path, f"path {int(executed)}/{static}"
            notes.append(f"warning {k.name}: the main loop holds {static} HMMA but one iteration of a warp issues "
                         f"{int(executed)} (tile: {k.tile}); the others sit in branches taken by other head slices "
                         f"or warps. Counted: the longest path through the loop that issues {int(executed)}.")
    row = sass.loop_row(sass.Loop(loop.header_addr, dict(counts), loop.lines, loop.nested))
    blocks = profile.blocks_per_sm(k.smem, 32 * k.warps, k.registers)
    total = sum(counts.values())
    per = float(useful)  # useful MMAs per warp and step (= executed without a head split)
    overhead = sass.path_instructions(k.text)
    lo, hi = loop.addr_range
    out = {"who": k.who, "kernel": k.name, "tile": k.tile, "block_m": k.block_m, "block_n": k.block_n,
           "warps": k.warps, "stages": k.stages, "head_split": k.head_split, "registers": k.registers,
           "smem_bytes": k.smem, "blocks_per_sm": blocks, "warps_per_sm": blocks * k.warps, **row,
           "static_HMMA": static, "counted": how, "counts": dict(counts),
           "loop": f"{lo:#06x}-{hi:#06x}", "loop_insns": total,
           "outer": f"{loop.outer[0]:#06x} ({loop.outer[1]})" if loop.outer else "-",
           "cond/HMMA": sum(loop.conditional.values()) / per, "block_insns": overhead}
    for seqlen in AMORTISE:
        steps = steps_per_block(k, seqlen, causal)
        out[f"block/HMMA {seqlen // 1024}k"] = (len(steps) * overhead + sum(steps) * total) / (sum(steps) * per)
    if k.direction == "bwd":
        out.update({"useful/iter": float(useful), "recomputed %": 100 * float(1 - useful / executed),
                    "insns/useful": total / per, "LDSM/useful": counts.get("LDSM", 0) / per})
    return out, notes


def fa2_kernels(index: list[Located], cubins: Fa2Cubins, arch: str, d: int, causal: bool, profile) -> dict[str, Kernel]:
    """FA2's forward and backward (with its two helper kernels) for one configuration."""
    fwd_traits = FA2_FWD_TRAITS[d]
    big, small = FA2_BWD_TRAITS[d]
    bwd_traits = big if profile.smem_per_block_optin >= FA2_BWD_BIG_SMEM else small
    found = {
        "fwd": pick(index, "flash_fwd_kernel", arch, fwd_traits, _flags(FWD_FLAGS, causal)),
        "bwd": pick(index, "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", arch, bwd_traits, _flags(BWD_FLAGS, causal)),
        # Clear_dQaccum = true: the non-deterministic default, which zeroes dQaccum in this kernel.
        "dot_do_o": pick(index, "flash_bwd_dot_do_o_kernel", arch, bwd_traits, (), lead=(1,)),
        "convert_dq": pick(index, "flash_bwd_convert_dq_kernel", arch, bwd_traits, ()),
    }
    cubins.extract({x.elf for x in found.values()})
    _, m, n, w, *_ = fwd_traits
    # kernel_traits.h: kSmemSize = Q (kBlockM x d) + K and V (kBlockN x d each), 2-byte elements.
    fwd = Kernel("FA2", "FA2 flash_fwd_kernel", "fwd", d, m, n, w, 1, 1, (m + 2 * n) * d * 2,
                 cubins.usage(found["fwd"])["REG"], cubins.function(found["fwd"]))
    _, m, n, w, _, _, _, v_in_regs, single = bwd_traits
    # kSmemSize1colblock: Q (double-buffered unless No_double_buffer) and dO, K and V, dS and P.
    qdo, kv, pds = m * d * 2 * (2 if single else 3), 2 * n * d * 2, m * n * 2
    smem = qdo + (kv + 2 * pds if not v_in_regs else max(kv, kv // 2 + 2 * pds))
    bwd = Kernel("FA2", "FA2 flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "bwd", d, m, n, w, 1 if single else 2, 1,
                 smem, cubins.usage(found["bwd"])["REG"], cubins.function(found["bwd"]))
    helpers = {key: Kernel("FA2", f"FA2 flash_bwd_{key}_kernel", "helper", d, m, n, w, 1, 1, 0,
                           cubins.usage(found[key])["REG"], cubins.function(found[key]))
               for key in ("dot_do_o", "convert_dq")}
    return {"fwd": fwd, "bwd": bwd, **helpers, "symbols": {k: v.symbol.mangled for k, v in found.items()}}


def our_kernels(arch: str, d: int, causal: bool, profile) -> dict[str, Kernel]:
    from autoflash.kernels.compiler import compile_config, entry_resources
    from autoflash.kernels.defaults import default_backward_config, default_config

    out = {}
    # FA2's sm80 kernels against ours of the same design: on an H100 the defaults are the sm90
    # family's (compared with FlashAttention-3 by --fa3): here the sm80 family's defaults for the GPU.
    fwd = default_config(d, DTYPE, causal, profile, family="sm80")
    for key, cfg in (("fwd", fwd), ("bwd", default_backward_config(d, DTYPE, causal, profile, family="sm80"))):
        compiled = compile_config(cfg, arch)
        functions = sass.functions(sass.disassemble(compiled.cubin_path))
        out[key] = Kernel("autoflash", cfg.name, cfg.direction, cfg.head_dim_padded, cfg.block_m, cfg.block_n,
                          cfg.num_warps, cfg.num_stages, cfg.head_split, cfg.smem_bytes,
                          compiled.resources.registers, functions[cfg.name])
        if cfg.direction == "bwd":
            delta = f"{cfg.name}_delta"
            out["delta"] = dataclasses.replace(out[key], name=delta, direction="helper", text=functions[delta],
                                               block_m=cfg.delta_rows, warps=4,  # 128 threads
                                               registers=entry_resources(compiled, delta).registers)
    return out


def instruction_total(text: str) -> int:
    """Static instructions of a whole function, without the NOP padding after its end."""
    return sum(1 for i in sass.parse(text) if i.op != "NOP" and sass.classify(i.op, i.pred) is not None)


# ---------------------------------------------------------------- tables

FWD_COLUMNS = (("config", "config"), ("kernel", "kernel"), ("tile (m x n, warps, stages)", "tile"),
               ("regs", "registers"), ("smem KB", "smem KB"), ("blocks(warps)/SM", "occupancy"),
               ("HMMA/iter", "HMMA/iter"), ("insns/HMMA", "insns/HMMA"), ("LDSM/HMMA", "LDSM/HMMA"),
               ("int/HMMA", "int/HMMA"), ("FP+MUFU/HMMA", "FP+MUFU/HMMA"), ("LDGSTS/HMMA", "LDGSTS/HMMA"),
               ("LDL+STL/iter", "spill/iter"), ("BAR/iter", "BAR/iter"), ("cond/HMMA", "cond/HMMA"),
               ("block/HMMA 1k", "block/HMMA 1k"), ("block/HMMA 16k", "block/HMMA 16k"),
               ("step loop", "loop"), ("outer loop (insns)", "outer"))
BWD_COLUMNS = FWD_COLUMNS[:6] + (
    ("HMMA/iter", "HMMA/iter"), ("useful/iter", "useful/iter"), ("recomputed %", "recomputed %"),
    ("insns/useful", "insns/useful"), ("LDSM/useful", "LDSM/useful")) + FWD_COLUMNS[7:] + (("counted", "counted"),)
HELPER_COLUMNS = (("config", "config"), ("kernel", "kernel"), ("regs", "registers"), ("insns", "insns"),
                  ("path", "path"), ("warps", "warps"), ("rows/block", "rows/block"),
                  ("warp-insns/row", "warp-insns/row"))


def collect(workdir: Path, requirement: str, log=print) -> dict:
    """Every row of the report, with the versions that made it."""
    from autoflash.kernels.compiler import nvrtc_version
    from autoflash.kernels.codegen import template_hash
    from autoflash.kernels.gpus import get_profile

    library = torch_library(workdir, requirement)
    tool = cuobjdump(workdir)
    log(f"torch {library.version} (CUDA {library.cuda}): {library.path}; indexing its FlashAttention kernels")
    index = flash_index(tool, library.path)
    cubins = Fa2Cubins(tool, library.path, workdir)
    report = {"torch": library.version, "torch_cuda": library.cuda, "autoflash": source(), "nvrtc": nvrtc_version(),
              "nvdisasm": nvdisasm_version(), "template_hash": template_hash(), "caveat": CAVEAT,
              "forward": [], "backward": [], "helpers": [], "notes": [], "fa2_symbols": {}}
    for gpu, arch in TARGETS:
        profile = get_profile(gpu)
        for d in HEAD_DIMS:
            for causal in (False, True):
                config = f"{gpu} {arch} d{d}{' causal' if causal else ''}"
                fa2, ours = fa2_kernels(index, cubins, arch, d, causal, profile), our_kernels(arch, d, causal, profile)
                report["fa2_symbols"][config] = fa2["symbols"]
                for direction, key in (("fwd", "forward"), ("bwd", "backward")):
                    for k in (fa2[direction], ours[direction]):
                        row, notes = measure(k, profile, causal)
                        row.update(config=config, gpu=gpu, arch=arch, head_dim=d, causal=causal,
                                   occupancy=f"{row['blocks_per_sm']}({row['warps_per_sm']})",
                                   **{"smem KB": round(k.smem / 1024, 1)})
                        report[key].append(row)
                        report["notes"] += [f"{config}: {n}" for n in notes]
                for k in (fa2["dot_do_o"], fa2["convert_dq"], ours["delta"]):
                    path = sass.path_instructions(k.text, contract=False)
                    report["helpers"].append({"config": config, "kernel": k.name, "registers": k.registers,
                                              "insns": instruction_total(k.text), "path": path,
                                              "rows/block": k.block_m, "warps": k.warps,
                                              "warp-insns/row": path * k.warps / k.block_m})
    return report


LEGEND = """\
FA2 kernels (bool template arguments: dropout, window, ALiBi, softcap off; Is_even_MN and Is_even_K on, as torch
runs them at sequence lengths that are multiples of the tiles): forward flash_fwd_kernel with
Flash_fwd_kernel_traits<64,128,128,4> and <128,128,64,4>; backward flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel
with Flash_bwd_kernel_traits<64,128,128,8,4,4,4,false,false> and <128,64,128,8,2,4,2,false,false>, torch's choice
with >= 144 KB of shared memory per block (A100, H100). FA2 smem from kernel_traits.h (kSmemSize,
kSmemSize1colblock); FA2's backward double-buffers Q (s2), not dO. h100 sm_80 rows: sm_80 code, H100 limits.
How a step is counted, the same on both sides: the step loop is the innermost loop that holds all the HMMAs of
the outermost loop around it (FA2's backward wraps its per-query-step loop in a loop over key blocks,
`for (n_block = blockIdx.x; ...; n_block += gridDim.x)`, which runs once per block by default: its prologue and
dK/dV epilogue are per-block work), and of a kernel's step loops the one without an inner loop, most HMMAs and
fewest instructions (the steady state; masked copies of a step add the mask). Every instruction of its body
counts once ('loop'); 'path E/S' = the longest path through one iteration that issues the E HMMAs the tile implies,
where the body holds S (branches picked by head slice or warp).
Columns: HMMA = mma.m16n8k16; int = integer/address + MOV + uniform; LDL+STL = spill traffic in the loop;
blocks(warps)/SM from shared memory, registers and threads on the row's GPU. Backward: useful = the MMAs of S, dP,
dV, dK, dQ once each (5 B / h per block, B = block_m * block_n * d / 2048); recomputed % = 1 - useful / executed
(autoflash's head_split h recomputes S and dP in each of its h blocks). cond/HMMA: instructions of the step's
blocks that some iteration skips (they do not dominate its back edge: a branch such as the last step's skipped
prefetch), already inside insns/HMMA, shown apart. block/HMMA 1k, 16k: per block, the heaviest path around the
steps (prologue, epilogue, FA2's outer loop body; every other loop once, peeled steps left out) plus the steps at
the steady-state count, per HMMA, for queries = keys = 1,024 and 16,384 (causal: each block's own step count).
step loop: its first and last instruction address; outer loop (insns): the loop it was found in, when another,
and that loop's instruction count."""
HELPERS = """\
BACKWARD helper kernels: insns = static instructions of the whole function; path = instructions along its heaviest
path (loops once); warp-insns/row = path x warps per block / query rows per block (FA2: dot(dO, O), which also
zeroes dQaccum, kBlockM rows per block of kNWarps warps; dQaccum -> dQ; autoflash: delta = rowsum(dO * O),
KernelConfig.delta_rows rows per 4-warp block; autoflash zeroes dq_accum and converts dQ with torch ops)
"""


def render(report: dict, command: str, date: str) -> str:
    head = [
        "Static SASS side-by-side: FlashAttention-2 in torch's CUDA wheel (torch SDPA's flash backend) vs autoflash's",
        f"default configs, {DTYPE}, per warp and step of the main loop, counted like for like on both sides",
        "(autoflash.kernels.sass.hmma_loops: the innermost loop holding all HMMAs; main_loop: its steady-state copy).",
        *provenance(command, date, f"torch:      {report['torch']} (CUDA {report['torch_cuda']}), libtorch_cuda.so "
                                   f"from the PyPI wheel", report, CAVEAT, LEGEND),
    ]
    parts = ["\n".join(head), "FORWARD\n" + table(report["forward"], FWD_COLUMNS),
             "BACKWARD (dK, dV, dQ kernel)\n" + table(report["backward"], BWD_COLUMNS),
             HELPERS + table(report["helpers"], HELPER_COLUMNS)]
    if report["notes"]:
        parts.append("NOTES\n" + "\n".join(textwrap.fill(n, 115, subsequent_indent="  ") for n in report["notes"]))
    return "\n\n".join(parts) + "\n"


DECODE_TARGETS = (("a100", "sm_80"), ("h100", "sm_90"))
DECODE_KINDS = {"dense": {}, "paged": dict(paged=True, causal=True, align="bottom_right"), "split": dict(split=True)}
DECODE_PAGE = 256
DECODE_COLUMNS = (("gpu", "gpu"), ("arch", "arch"), ("kernel", "kernel"), ("thr", "threads"),
                  ("loop LDGSTS/thr", "loop_ldgsts"), ("loop B/block", "loop_bytes"), ("K+V tile B", "kv_tile_bytes"),
                  ("loop LDG/thr", "loop_ldg"), ("masked loop B", "masked_bytes"), ("prologue B", "prologue_bytes"),
                  ("Q + stages*KV B", "prologue_expected"), ("prologue LDG/thr", "prologue_ldg"), ("once", "once"))
DECODE_CAVEAT = ("Static SASS counts, a proxy, not a GPU measurement: instructions that may issue, per thread, "
                 "times the block's threads; a loop's branches count as if taken. The loop's loads of tile "
                 "it + stages are predicated off past the last tile at run time (template: `if (it < n_tiles)`), "
                 "which SASS counts cannot show; with them a block of n tiles loads Q + n x (K + V).")
DECODE_COLUMNS_LEGEND = (
    "Columns, per block: loop = the main loop's body, one iteration (autoflash.kernels.sass.main_loop); LDGSTS/thr: "
    "cp.async instructions per thread x bytes each; B/block = bytes x threads; K+V tile B = 2 x block_n x d x 2; "
    "loop LDG/thr: other global loads in the loop (paged: the K and the V tile's block-table entry, 4 B, the same "
    "word in every thread); masked loop B: the masked-tile loop's cp.async bytes per iteration; prologue B: outside "
    "all loops, along the path that issues most (ptxas versions a whole-tile and a ragged-tile copy, one runs); "
    "prologue LDG/thr: lengths, left padding, cache batch index, block-table entries; once: every loop iteration "
    "loads exactly one K and one V tile, and the prologue the Q tile plus `stages` K/V tiles.")


def decode_grids(heads=(8, 2), batch=3, seqlen_q=2, splits=3, alibi=False) -> list[tuple]:
    """The grids flash_decode launches for a small GQA call on the host emulator (no GPU): main
    kernel, then the combine kernel. ALiBi's per-head slopes stop the folding."""
    import torch

    import autoflash
    from autoflash.kernels import launch
    from autoflash.kernels.decode import flash_decode

    grids, real = [], launch._call

    def spy(fn, grid, *args, **kw):
        grids.append(tuple(grid))
        return real(fn, grid, *args, **kw)

    (hq, hkv), d, length = heads, 64, 600
    q = torch.randn(batch, seqlen_q, hq, d).to(torch.bfloat16)
    k = torch.randn(batch, length, hkv, d).to(torch.bfloat16)
    launch._call = spy
    try:
        with autoflash.emulate("h100"):
            flash_decode(q, k, k.clone(), length, num_splits=splits, causal=True,
                         alibi_slopes=torch.rand(hq) * 0.3 if alibi else None)
    finally:
        launch._call = real
    return grids


def _n_width(loads) -> str:
    n, size = loads or (0, 0)
    return f"{n} x {size // n if n else 0} B"


def decode_rows(log=print) -> list[dict]:
    """One row per decode kernel: its global loads per thread and per block, against its tiles."""
    from autoflash.kernels.compiler import compile_config
    from autoflash.kernels.defaults import default_decode_config
    from autoflash.kernels.gpus import get_profile

    rows = []
    for gpu, arch in DECODE_TARGETS:
        for d in HEAD_DIMS:
            for kind, switches in DECODE_KINDS.items():
                base = default_decode_config(d, DTYPE, get_profile(gpu), DECODE_PAGE if kind == "paged" else None)
                c = base.replace(**switches)
                log(f"{gpu} {arch} {c.name}")
                text = sass.disassemble(compile_config(c, arch).cubin_path, c.name)
                loops = sass.hmma_loops(text)
                main, pro = sass.main_loop(loops), sass.straight_line_loads(text)
                tile = 2 * c.block_n * d * c.elem_bytes
                expected = c.block_m * d * c.elem_bytes + c.num_stages * tile
                per_block = lambda loads: loads.get("LDGSTS", (0, 0))[1] * c.threads  # noqa: E731
                row = {"gpu": gpu, "arch": arch, "head_dim": d, "kind": kind, "kernel": c.name, "threads": c.threads,
                       "block_m": c.block_m, "block_n": c.block_n, "stages": c.num_stages,
                       "loop_ldgsts": _n_width(main.global_loads.get("LDGSTS")),
                       "loop_bytes": per_block(main.global_loads), "kv_tile_bytes": tile,
                       "loop_ldg": _n_width(main.global_loads.get("LDG")),
                       "masked_bytes": ",".join(str(per_block(lp.global_loads)) for lp in loops if lp is not main)
                       or "-",
                       "prologue_bytes": per_block(pro), "prologue_expected": expected,
                       "prologue_ldg": _n_width(pro.get("LDG")),
                       "loops": [{"header": f"0x{lp.header_addr:04x}", "main": lp is main, "nested": lp.nested,
                                  "global_loads": lp.global_loads} for lp in loops],
                       "prologue_loads": pro}
                row["once"] = "yes" if (all(per_block(lp.global_loads) == tile for lp in loops)
                                        and row["prologue_bytes"] == expected) else "NO"
                rows.append(row)
    return rows


def decode_report(rows: list[dict], grids: list[tuple], meta: dict, command: str, date: str) -> str:
    (main, combine), (unfolded, _) = grids
    head = [
        "Static decode-kernel global loads: the KV-cache kernels (autoflash.kernels.defaults.default_decode_config,",
        f"{DTYPE}; paged: page size {DECODE_PAGE}, causal bottom-right as flash_attn_with_kvcache runs it), from SASS.",
        "A PROXY, NOT A GPU MEASUREMENT: no timing and no DRAM counter; what the code issues, not what the memory saw.",
        f"command:    {command}",
        f"date:       {date}",
        f"autoflash:  {meta['autoflash']}    template hash: {meta['template_hash']}",
        f"python:     {meta['python']}   torch: {meta['torch']}   NVRTC: {meta['nvrtc']}   "
        f"nvdisasm: {meta['nvdisasm']}",
        "Checked by tests/test_sass_decode.py.",
        "",
        textwrap.fill(DECODE_CAVEAT, 115),
        "",
        textwrap.fill(DECODE_COLUMNS_LEGEND, 115),
        "",
    ]
    grid = [
        "LAUNCH STRUCTURE (flash_decode on the host emulator, h100 profile: batch 3, seqlen_q 2, 8 query heads on 2",
        "kv heads (group 4), 600 cached keys, num_splits 3, d 64):",
        f"  main grid {main} = (m_blocks x splits, kv heads, batch): the 4 query heads of a kv head fold into",
        "  one block's rows (2 x 4 = 8 rows <= block_m: one m-block); the splits take disjoint runs of key tiles",
        "  (template: split * per_split ...), so each K/V tile of a (batch, kv-head) is loaded by exactly one block,",
        f"  once (the table above). combine grid {combine}.",
        "=> each K/V byte is loaded once per (batch, kv-head): one K/V read serves all query heads of its group.",
        f"   (The same call with ALiBi, whose slopes are per query head, is not folded: grid {unfolded}, y = the 8",
        "   query heads, so each K/V byte is read by the 4 blocks of its group.)",
    ]
    return "\n".join(head) + "\n" + table(rows, DECODE_COLUMNS) + "\n\n" + "\n".join(grid) + "\n"


def decode_main(out: Path, command: str) -> int:
    import platform

    import torch

    from autoflash.kernels.codegen import template_hash
    from autoflash.kernels.compiler import nvrtc_version

    rows = decode_rows(log=lambda s: print(s, file=sys.stderr))
    grids = decode_grids(), decode_grids(alibi=True)
    meta = {"autoflash": source(), "template_hash": template_hash(), "python": platform.python_version(),
            "torch": torch.__version__, "nvrtc": nvrtc_version(), "nvdisasm": nvdisasm_version()}
    date = time.strftime("%Y-%m-%d")
    text = decode_report(rows, grids, meta, command, time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    print(text, end="")
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{date}-decode-loads-{meta['template_hash'][:8]}"
    stem.with_suffix(".txt").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(
        {"command": command, "date": date, **meta, "caveat": DECODE_CAVEAT,
         "grids": {"main": grids[0][0], "combine": grids[0][1], "main_alibi_unfolded": grids[1][0],
                   "call": "batch 3, seqlen_q 2, heads 8, heads_kv 2, 600 keys, num_splits 3, d 64, h100 emulated"},
         "rows": rows}, indent=1) + "\n")
    print(f"wrote {stem}.txt and .json", file=sys.stderr)
    return 0


def make_parser() -> argparse.ArgumentParser:
    from autoflash.kernels.compiler import cache_dir

    p = argparse.ArgumentParser(prog="python -m autoflash.bench sass", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=cache_dir() / "sass-compare",
                   help="where the downloaded library, cuobjdump and extracted cubins are kept "
                   "(default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("bench/results/static"),
                   help="directory for <date>-sass-<template hash>.{txt,json} (default: %(default)s)")
    p.add_argument("--torch", default="torch", metavar="SPEC",
                   help="the pip requirement of the wheel to download on the first run (default: torch)")
    p.add_argument("--decode", action="store_true",
                   help="instead: the decode kernels' global loads against their K/V tiles, and their grid "
                   "(no download; <date>-decode-loads-<template hash>.{txt,json})")
    p.add_argument("--fa3", action="store_true",
                   help="instead: the sm90 family, forward and backward, against FlashAttention-3's own sm_90a "
                   "kernels (downloads the fa3-fwd wheel once, 28 MB, and dew-flash-attn-cu13's FA3 library, 78 MB "
                   "wheel, 18 MB kept; <date>-sass-fa3-<template hash>.{txt,json}); exit status 1 where a row misses "
                   "the target")
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    command = " ".join(["python -m autoflash.bench sass", *(sys.argv[2:] if argv is None else argv)])
    if args.decode:
        return decode_main(args.out, command)
    if args.fa3:
        from autoflash.bench import sass_fa3

        return sass_fa3.main(args.workdir, args.out, command, log=lambda s: print(s, file=sys.stderr))
    report = collect(args.workdir.expanduser(), args.torch, log=lambda s: print(s, file=sys.stderr))
    date = time.strftime("%Y-%m-%d")
    text = render(report, command, time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    print(text, end="")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{date}-sass-{report['template_hash'][:8]}"
    stem.with_suffix(".txt").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps({"command": command, "date": date, **report}, indent=1) + "\n")
    print(f"wrote {stem}.txt and .json", file=sys.stderr)
    return 0
