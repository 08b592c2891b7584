"""`python -m autoflash.render`: write the generated CUDA source of a kernel config, and with --gpu
compile it for that GPU and print the ptxas resource report. Needs no GPU.

The kernel comes from a name, from flags (head dim, dtype, tiles and the variant switches) or from
the built-in defaults for a GPU (--default, with the same switches); --list prints those defaults.
The source's header comment says how to compile it: with -I to this install's templates/ folder, or,
with --standalone, as one file with the common/*.cuh headers inlined."""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

from autoflash.kernels.config import DTYPES, HEAD_DIM_MAX, HEAD_DIM_MIN, HEAD_DIM_STEP, KernelConfig

EPILOG = """examples:
  python -m autoflash.render fwd_hd128_bf16_causal_m128n64w4s2 --gpu h100
  python -m autoflash.render --head-dim 96 --dtype fp16 --block-m 128 --block-n 64 --warps 8 -o k.cu
  python -m autoflash.render --default --head-dim 128 --dtype bf16 --gpu a100
  python -m autoflash.render --default --backward --head-dim 128 --dtype bf16 --causal --gpu h100
  python -m autoflash.render --default --head-dim 128 --dtype bf16 --causal --bottom-right --softcap --gpu h100
  python -m autoflash.render --head-dim 64 --dtype fp16 --block-m 64 --block-n 64 --window --alibi --varlen
  python -m autoflash.render --default --kvcache --paged --page-size 256 --split --head-dim 128 --dtype bf16 --gpu a100
  python -m autoflash.render --default --head-dim 64 --head-dim-v 512 --dtype bf16 --causal --gpu h100
  python -m autoflash.render --list --gpu h100              (or --list --gpu a10g --head-dim 128 --dtype bf16)
  python -m autoflash.render fwd_hd64_bf16_causal_m128n64w4s2 --standalone -o k.cu && nvcc -arch=sm_80 -cubin k.cu
  python -m autoflash.render fwd_hd128_bf16_m128n64w4s1 --gpu a100 --sass -o /dev/null

The source goes to stdout (or -o FILE); the resource report goes to stderr when the source is on
stdout. Its header comment gives the nvcc command that compiles it (for --gpu's arch, else sm_80):
plain output includes common/*.cuh and needs -I to this install's templates folder (the comment
names it); --standalone inlines them, so the one file compiles with no -I (and carries no #line
directives, which would point into templates the file travels without).

The switch flags (--causal, --bottom-right, --window, --chunk, --softcap, --alibi, --key-bias,
--varlen, --kvcache, --paged, --gather, --split, --qv, --dq-pass, --v-in-regs) add the name's suffixes
(_causal, _br, _win, _chunk, _cap, _alibi, _kbias, _varlen, _kvc, _paged, _gather, _split, _qv,
_dqpass, _vregs); they combine with --default (the GPU's built-in tiles for a kernel with those switches, as
the launcher picks them) or with --block-m/--block-n/--warps/--stages. Window sizes, the cap, slopes,
biases and lengths are kernel arguments at run time, so no flag takes them. A kernel name stands
alone: it already fixes every field.

--list needs --gpu: it prints the built-in forward, backward and decode (KV-cache) configs of that
GPU per head dim, dtype and causal, with their kernel names (--head-dim and --dtype narrow it).

--sass adds what the kernel compiles to: the instruction mix of its main loop per warp and
iteration (HMMA, LDSM, cp.async, integer/address work, spills, barriers), read statically from the
SASS with nvdisasm. A proxy for speed, not a measurement. GPU names: a100, a10g, a6000, l4, l40s,
rtx3090, rtx4090, rtx6000-ada, rtx5090, h100, h100-pcie, h200, b200 (or an arch like sm_90)."""

# Every switch a kernel name shows, as a flag: (flag, KernelConfig field, its value when the flag is
# given, help). The name's suffix is the config's own (KernelConfig.name); window sizes, the cap,
# slopes, biases and lengths are run-time kernel arguments, so the flags take no values.
SWITCHES: tuple[tuple[str, str, object, str], ...] = (
    ("--causal", "causal", True, "causal masking: query i sees keys j <= i + diag (_causal)"),
    ("--bottom-right", "align", "bottom_right",
     "put query i's diagonal at key i + seqlen_k - seqlen_q (flash-attn's) instead of key i (SDPA's is_causal); "
     "it places --causal, --window and --alibi, one of which it needs (_br)"),
    ("--window", "window", True,
     "sliding window: keys i + diag - left .. i + diag + right, left and right given at run time; "
     "not with --causal (right = 0 is causal) (_win)"),
    ("--chunk", "chunk", True,
     "FlashAttention-3's attention chunks: as well, only the keys of the chunk holding key i + diag, the chunk "
     "size given at run time; needs --window (_chunk)"),
    ("--softcap", "softcap", True, "soft-capped scores cap * tanh(scale * s / cap), the cap given at run time (_cap)"),
    ("--alibi", "alibi", True, "ALiBi: scores - slope * |i + diag - j|, slopes (per head or batch x head) at run time "
     "(_alibi)"),
    ("--key-bias", "key_bias", True,
     "an fp32 bias per (batch, key) added to the scores, -inf masking the key: SDPA's key-padding masks; "
     "not with --varlen (_kbias)"),
    ("--varlen", "varlen", True, "packed sequences: (total, heads, d) with int32 cu_seqlens (_varlen)"),
    ("--kvcache", "kvcache", True,
     "forward, fp16/bf16: keys from a KV cache (flash_attn_with_kvcache), query heads of a K/V head folded into "
     "one block's rows; --default then picks the decode tiles (_kvc)"),
    ("--paged", "paged", True, "with --kvcache: the cache in pages through an int32 block table (_paged)"),
    ("--gather", "gather", True,
     "with --paged: each key row gathered from its own page (pages of any size, left-padded sequences) (_gather)"),
    ("--split", "split", True,
     "with --kvcache: the key range split across blocks, fp32 partials merged by the source's <name>_combine "
     "kernel (_split)"),
    ("--qv", "qv", True,
     "forward, with --sm90 (or --default --kvcache on an sm_90 GPU): FlashAttention-3's qv, scores q . k + "
     "qv . v, each V tile read once for both products (_qv)"),
    ("--dq-pass", "dq", "pass",
     "backward, fp16/bf16: dQ by a separate kernel (<name>_dq) instead of fp32 atomics: deterministic (_dqpass)"),
    ("--v-in-regs", "v_in_regs", True,
     "backward, fp16/bf16: each warp keeps its keys' V fragments in registers for dP (_vregs)"),
    ("--sm90", "family", "sm90",
     "fp16/bf16, sm_90 GPUs: the sm90 family (wgmma, TMA, a producer warpgroup beside --warps / 4 consumer "
     "warpgroups of 64 query rows, or with --backward of 64 keys; templates/flash_fwd_sm90.cu.j2, "
     "flash_bwd_sm90.cu.j2) (_sm90a)"),
    ("--pingpong", "pingpong", True, "with --sm90: consumer warpgroups take turns issuing their GEMMs (_pp)"),
    ("--overlap", "overlap", True, "with --sm90: a warpgroup's softmax of tile j under its P V of tile j - 1 (_ov)"),
)
# The tile flags (argparse dests) --default picks itself and a kernel name fixes.
TILE_FLAGS = ("block_m", "block_n", "warps", "stages", "head_split")
# Head dims --list shows without --head-dim: FlashAttention-2's (any multiple of 8 in 32..256 works).
LIST_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
# Without --gpu the printed nvcc command targets sm_80, whose cubin runs on every 8.x part.
DEFAULT_ARCH = "sm_80"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m autoflash.render",
        description="Render a FlashAttention kernel from the Jinja2 templates; optionally compile it "
        "with NVRTC for a GPU (no GPU needed) and report registers, spills and shared memory.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", nargs="?", help="a kernel name such as fwd_hd128_bf16_causal_m128n64w4s2 (it fixes every "
                   "field, so no shape or switch flag goes with it)")
    shape = p.add_argument_group("shape")
    shape.add_argument("--head-dim", type=int, help="head dim, a multiple of 8 in 32..256")
    shape.add_argument("--dtype", choices=DTYPES, help="element type (fp32 uses the SIMT path, without switches)")
    shape.add_argument("--block-m", type=int, help="query rows per block (Br)")
    shape.add_argument("--block-n", type=int, help="keys per tile (Bc)")
    shape.add_argument("--warps", type=int, help="warps per block (default 4)")
    shape.add_argument("--stages", type=int, help="K/V (backward: Q/dO) pipeline stages (default 2)")
    shape.add_argument("--backward", action="store_true",
                       help="the backward kernels (dK, dV, dQ) instead of the forward")
    shape.add_argument("--head-split", type=int,
                       help="blocks sharing a key block (backward) or, with --head-dim-v above 256, a query block, "
                       "each with a slice of the head dim (default 1)")
    shape.add_argument("--head-dim-v", type=int,
                       help="forward only: V's (and the output's) head dim where it differs from --head-dim (a "
                       "multiple of 8 in 32..512; the kernel name shows _dv<N>)")
    switches = p.add_argument_group("switches (each adds its suffix to the kernel name)")
    for flag, field, value, text in SWITCHES:
        switches.add_argument(flag, dest=field, action="store_const", const=value, help=text)
    picks = p.add_argument_group("built-in defaults")
    picks.add_argument("--default", action="store_true",
                       help="the built-in tiles for --head-dim/--dtype/--backward and the switches on --gpu, as the "
                       "launcher picks them (not with --block-m, --block-n, --warps, --stages, --head-split)")
    picks.add_argument("--page-size", type=int,
                       help="with --default --kvcache --paged: the cache's page size in rows; the default's key "
                       "tile then divides it")
    picks.add_argument("--list", action="store_true",
                       help="print --gpu's built-in forward, backward and decode configs per head dim, dtype and "
                       "causal, with their kernel names (needs --gpu; --head-dim, --dtype narrow it)")
    out = p.add_argument_group("output")
    out.add_argument("--gpu", help="compile for this GPU profile or arch and print the resource report; the "
                     "header's nvcc command targets its arch (sm_80 without --gpu)")
    out.add_argument("--standalone", action="store_true",
                     help="inline the common/*.cuh headers: one file that nvcc or NVRTC compiles with no -I "
                     "(no #line directives: they would point into the templates)")
    out.add_argument("--sass", action="store_true",
                     help="with --gpu: also print the main loop's instruction mix per HMMA, from the SASS "
                     "(static analysis, not a timing)")
    out.add_argument("-o", "--output", type=Path, help="write the source here instead of stdout")
    out.add_argument("--no-line-directives", action="store_true",
                     help="omit the #line directives that map compiler messages to template lines")
    return p


def _flag(dest: str) -> str:
    """The command-line spelling of an argparse dest."""
    return next((flag for flag, field, _, _ in SWITCHES if field == dest), "--" + dest.replace("_", "-"))


def _given(args: argparse.Namespace, dests) -> list[str]:
    """The flags among `dests` that the command line gave."""
    return [_flag(d) for d in dests if getattr(args, d) not in (None, False)]


def _switches(args: argparse.Namespace) -> dict[str, object]:
    """The KernelConfig fields the switch flags set."""
    return {field: getattr(args, field) for _, field, _, _ in SWITCHES if getattr(args, field) is not None}


def _switched(make, switches: dict[str, object]) -> KernelConfig:
    """make(), its ValueError prefixed with the switch flags that were given (the config's message
    speaks of its fields)."""
    try:
        return make()
    except ValueError as e:
        if not switches:
            raise
        raise ValueError(f"with {' '.join(_flag(f) for f in switches)}: {e}") from None


def default_for(head_dim: int, dtype: str, direction: str, switches: dict[str, object], profile,
                page_size: int | None = None, head_dim_v: int | None = None) -> KernelConfig:
    """The built-in config of a problem with these switches (KernelConfig fields) on a GPU profile,
    as the launchers pick it (kernels.launch, kernels.decode): the KV-cache kernel's tiles with
    kvcache (for pages of `page_size` rows when given), else the forward's or backward's, those for
    kernels with variant switches where any is on (bottom-right alignment included) and a window's
    as a causal kernel's; then the switches set. `head_dim_v`: V's head dim where it differs."""
    from autoflash.kernels.config import VARIANTS
    from autoflash.kernels.defaults import call_default, default_decode_config

    if switches.get("kvcache"):
        if dtype == "fp32":
            raise ValueError("--kvcache: got --dtype fp32; the KV-cache kernel runs on tensor cores (expected fp16 "
                             "or bf16)")
        if page_size is not None and page_size <= 0:
            raise ValueError(f"--page-size: got {page_size}, expected a positive number of rows")
        if page_size is not None and page_size % 16:  # pages smaller than any key tile: gathered row by row
            switches = {**switches, "gather": True}
        heavy = any(switches.get(f) for f in ("window", "chunk", "softcap", "alibi", "key_bias"))
        gather = bool(switches.get("gather"))
        base = default_decode_config(head_dim, dtype, profile, None if gather else page_size, heavy, gather,
                                     head_dim_v, bool(switches.get("qv")))
    else:
        variant = {k: switches[k] for k in ("align", *VARIANTS) if k in switches}
        base = call_default(direction, head_dim, dtype, bool(switches.get("causal")), variant, profile, head_dim_v)
    # A window's base is a causal kernel's; the switches set causal (off unless --causal) as the launcher does.
    return _switched(lambda: base.replace(direction=direction, **{"causal": False, **switches}), switches)


def _config(args: argparse.Namespace) -> KernelConfig:
    switches = _switches(args)
    if args.name:
        extra = _given(args, ("head_dim", "head_dim_v", "dtype", *TILE_FLAGS, "backward", "default", "page_size",
                              *switches))
        if extra:
            raise ValueError(f"got the kernel name {args.name!r} and {', '.join(extra)}; a name fixes every field "
                             f"(expected the name alone, or --head-dim and --dtype with the other flags)")
        return KernelConfig.from_name(args.name)
    if args.head_dim is None or args.dtype is None:
        raise ValueError("give a kernel name, or at least --head-dim and --dtype")
    direction = "bwd" if args.backward else "fwd"
    if args.page_size is not None and not (args.default and switches.get("paged")):
        raise ValueError(f"--page-size: got {args.page_size} without --default --kvcache --paged; it only steers "
                         f"the default's key tile (expected those flags with it)")
    if args.default:
        tiles = _given(args, TILE_FLAGS)
        if tiles:
            raise ValueError(f"--default picks the tiles; got {', '.join(tiles)} as well (expected --default or "
                             f"tile flags, not both)")
        if not args.gpu:
            raise ValueError("--default needs --gpu (defaults depend on the GPU's shared memory)")
        from autoflash.kernels.gpus import get_profile

        return default_for(args.head_dim, args.dtype, direction, switches, get_profile(args.gpu), args.page_size,
                           args.head_dim_v)
    if args.block_m is None or args.block_n is None:
        raise ValueError("give --block-m and --block-n (or --default with --gpu)")
    fields = dict(head_dim=args.head_dim, dtype=args.dtype, block_m=args.block_m, block_n=args.block_n,
                  num_warps=4 if args.warps is None else args.warps,
                  num_stages=2 if args.stages is None else args.stages, direction=direction,
                  head_split=1 if args.head_split is None else args.head_split, head_dim_v=args.head_dim_v)
    return _switched(lambda: KernelConfig(**fields, **switches), switches)


# ---- --list: the built-in configs of one GPU ----
def _list_sections():
    """(title, the flags that give its kernels with --default, direction, switches, a causal row's
    switches) per kind. A decode row's causal kernel is bottom-right aligned, as flash_attn_with_kvcache
    aligns it (kernels.decode, tuning.problem's decode keys)."""
    causal = {"causal": True}
    return (("forward", "--default [--causal]", "fwd", {}, causal),
            ("backward", "--default --backward [--causal]", "bwd", {}, causal),
            ("decode (KV cache)", "--default --kvcache [--causal --bottom-right]", "fwd", {"kvcache": True},
             {**causal, "align": "bottom_right"}))


def _list_rows(profile, direction: str, switches: dict, causal_switches: dict, head_dims,
               dtypes) -> list[tuple[str, ...]]:
    """(head_dim, dtype, causal, smem bytes, kernel name) for each problem; a problem nothing fits
    says so in the name column."""
    rows = []
    for d in head_dims:
        for dtype in dtypes:
            if switches.get("kvcache") and dtype == "fp32":
                continue  # the KV-cache kernel is fp16/bf16 only
            for causal in (False, True):
                try:
                    cfg = default_for(d, dtype, direction, {**switches, **(causal_switches if causal else {})},
                                      profile)
                    smem, name = str(cfg.smem_bytes), cfg.name
                except ValueError:
                    smem, name = "-", "(no built-in config fits)"
                rows.append((str(d), dtype, "yes" if causal else "no", smem, name))
    return rows


def list_defaults(profile, head_dims=LIST_HEAD_DIMS, dtypes=DTYPES) -> str:
    """The built-in configs of a GPU profile as tables (forward, backward, decode), one row per head
    dim, dtype and causal, each with its kernel name."""
    header = ("head_dim", "dtype", "causal", "smem (B)", "kernel")
    lines = [f"Built-in configs for {profile.name}: {profile.description}, {profile.arch}, "
             f"{profile.smem_per_block_optin} B of shared memory per block.",
             "`python -m autoflash.render NAME` renders a kernel below; --default --gpu "
             f"{profile.name} with a section's flags,",
             "--head-dim and --dtype gives the same one. Switch flags (--softcap, ...) may pick other "
             "tiles:",
             "see --default with them."]
    for title, flags, direction, switches, causal in _list_sections():
        rows = [header] + _list_rows(profile, direction, switches, causal, head_dims, dtypes)
        if len(rows) == 1:
            continue
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines += ["", f"{title}: {flags}"]
        for row in rows:
            cells = [c.rjust(w) if i in (0, 3) else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
            lines.append("  " + "  ".join(cells).rstrip())
    return "\n".join(lines)


def _list(args: argparse.Namespace) -> str:
    extra = _given(args, ("name", *TILE_FLAGS, "backward", "default", "page_size", *(f for _, f, _, _ in SWITCHES),
                          "standalone", "sass", "output", "no_line_directives"))
    if extra:
        raise ValueError(f"--list prints the built-in configs; got {', '.join(extra)} as well (expected only --gpu, "
                         f"--head-dim, --dtype with it)")
    if not args.gpu:
        raise ValueError("--list needs --gpu (the defaults depend on the GPU's shared memory and arch)")
    from autoflash.kernels.gpus import get_profile

    if args.head_dim is not None and not (HEAD_DIM_MIN <= args.head_dim <= HEAD_DIM_MAX
                                          and args.head_dim % HEAD_DIM_STEP == 0):
        raise ValueError(f"--head-dim: got {args.head_dim}, expected a multiple of {HEAD_DIM_STEP} in "
                         f"[{HEAD_DIM_MIN}, {HEAD_DIM_MAX}]")
    head_dims = LIST_HEAD_DIMS if args.head_dim is None else (args.head_dim,)
    return list_defaults(get_profile(args.gpu), head_dims, DTYPES if args.dtype is None else (args.dtype,))


# ---- the source as written: a header note on compiling it, and --standalone's inlined headers ----
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
_PRAGMA_ONCE_RE = re.compile(r"^\s*#\s*pragma\s+once\b")


def _resolve_include(name: str, here: Path | None, root: Path) -> Path:
    """Where a compiler finds #include "name": beside the including file, then under -I root."""
    candidates = ([here / name] if here is not None else []) + [root / name]
    for path in candidates:
        if path.is_file():
            return path.resolve()
    raise ValueError(f'#include "{name}": not found, looked for {", ".join(str(c) for c in candidates)}')


def _inline(lines: list[str], here: Path | None, root: Path, seen: set[Path]) -> list[str]:
    out = []
    for line in lines:
        m = _INCLUDE_RE.match(line)
        if m is None:
            if here is None or not _PRAGMA_ONCE_RE.match(line):  # each header is inlined once: no guard needed
                out.append(line)
            continue
        path = _resolve_include(m.group(1), here, root)
        label = os.path.relpath(path, root.resolve())
        if path in seen:
            out.append(f"// ---- {label}: inlined above ----")
            continue
        seen.add(path)
        out.append(f"// ---- begin {label} ----")
        out += _inline(path.read_text().rstrip("\n").split("\n"), path.parent, root, seen)
        out.append(f"// ---- end {label} ----")
    return out


def inline_includes(source: str, root: Path) -> str:
    """`source` with each #include "..." replaced by the header's text, recursively, each header once
    (where #pragma once would keep it) between "// ---- begin common/x.cuh ----" and "end" lines,
    their #pragma once dropped. Quoted includes resolve as the compiler's do (beside the including
    header, then under `root`, the -I folder); <...> includes, the CUDA headers, stay. The templates
    include their headers outside any #if, so inlining at the first include is what the preprocessor
    does."""
    return "\n".join(_inline(source.split("\n"), None, root, set()))


def nvcc_command(arch: str, source_name: str, include_dir: Path | None = None) -> str:
    """The nvcc command line that compiles `source_name` (in the current folder) to a cubin for `arch`."""
    cubin = Path(source_name).with_suffix(".cubin").name
    include = f"-I {shlex.quote(str(include_dir))} " if include_dir is not None else ""
    return f"nvcc -arch={arch} -cubin -std=c++17 {include}-o {shlex.quote(cubin)} {shlex.quote(source_name)}"


def _arch_notes(arch: str, gpu_given: bool, family: str = "sm80") -> list[str]:
    """What to know about the nvcc target: the default's reach, an architecture-specific (sm_90a)
    target's, and the first CUDA release that knows a newer arch."""
    from autoflash.kernels.compiler import FIRST_NVRTC

    digits = re.sub(r"\D", "", arch)
    cc = f"{digits[:-1]}.{digits[-1]}"
    notes = [] if gpu_given else [f"{arch} as no --gpu was given: its cubin loads on compute capability "
                                  f"{digits[:-1]}.x; --gpu NAME targets that GPU's arch."]
    if arch.endswith("a") and family == "sm90":
        notes.append(f"{arch} is architecture-specific: its cubin loads only on compute capability {cc}; the sm90 "
                     f"family's wgmma and setmaxnreg exist only there (-arch={arch[:-1]} refuses them).")
    elif arch.endswith("a"):
        notes.append(f"{arch} is architecture-specific: its cubin loads only on compute capability {cc}; the "
                     f"kernels use no {arch}-only instructions, so -arch={arch[:-1]} compiles them too.")
    first = FIRST_NVRTC.get(int(digits))
    if first is not None:
        notes.append(f"nvcc knows {arch} from CUDA {first[0]}.{first[1]} on.")
    return notes


def _wrap(*paragraphs: str, width: int = 100) -> list[str]:
    """Each paragraph as // comment lines of at most `width` characters."""
    import textwrap

    return ["// " + line for text in paragraphs for line in textwrap.wrap(text, width - 3, break_on_hyphens=False)]


def _build_note(arch: str, gpu_given: bool, source_name: str, root: Path, standalone: bool, family: str = "sm80") -> list[str]:
    """The header comment lines that say how to compile the source."""
    from autoflash.kernels.compiler import BASE_OPTIONS

    nvrtc = f"--gpu-architecture={arch} {' '.join(BASE_OPTIONS)}"
    cuda = "-I to the CUDA headers (cuda_fp16.h, cuda_bf16.h)"
    if standalone:
        return ["//", *_wrap("Standalone: the common/*.cuh headers are inlined below, each once and between its "
                             f"begin and end marker lines, so this one file compiles with no -I. Saved as "
                             f"{source_name}, in its folder:"),
                "//   " + nvcc_command(arch, source_name),
                *_wrap(*_arch_notes(arch, gpu_given, family),
                       f"NVRTC compiles it too, as autoflash does: {nvrtc} and {cuda}.",
                       "No #line directives: they would name the templates/*.j2 files it was rendered from, which "
                       "need not be where it is compiled; compiler messages point at this file's own lines.")]
    return ["//", *_wrap(f"Includes common/*.cuh: compile it with -I to this install's templates folder, {root}. "
                         f"Saved as {source_name}, in its folder:"),
            "//   " + nvcc_command(arch, source_name, root),
            *_wrap(*_arch_notes(arch, gpu_given, family), f"NVRTC: {nvrtc} -I {root} and {cuda}.",
                   "--standalone writes one file with the headers inlined instead (no -I).")]


def source_for(config: KernelConfig, *, arch: str = DEFAULT_ARCH, gpu_given: bool = False,
               source_name: str | None = None, standalone: bool = False, line_directives: bool = True) -> str:
    """The source as the CLI writes it: codegen's, with a header note (after its title line) on how
    to compile it as `source_name` for `arch`; with `standalone` the common headers inlined."""
    from autoflash.kernels.codegen import TEMPLATES, render
    from autoflash.kernels.resources import templates_dir

    # A standalone file is meant to travel without the templates: #line directives would send compiler
    # messages to templates/*.j2 files its reader may not have (and the inlined headers would need
    # directives of their own), so it has none and every message points at a line of the file itself.
    text = render(config, line_directives=line_directives and not standalone)
    title, rest = text.split("\n", 1)
    root = templates_dir()
    note = _build_note(arch, gpu_given, source_name or f"{config.name}.cu", root, standalone, config.family)
    if standalone:
        rest = inline_includes(rest, root)
    elif line_directives:
        # The note shifts the lines below it: resume the mapping at the template's line 2, named as
        # codegen's own directives name it.
        note.append(f'#line 2 "templates/{TEMPLATES[config.direction, config.family]}"')
    return "\n".join([title, *note, rest])


def report(config: KernelConfig, gpu: str) -> str:
    """Compiles `config` for a GPU profile (or a bare arch) and describes the resources it uses."""
    from autoflash.kernels.compiler import compile_config
    from autoflash.kernels.gpus import arch_for, get_profile

    try:  # a profile key or a device name; a bare arch ("sm_90") has no profile
        profile = get_profile(gpu)
    except ValueError:
        profile = None
    arch = arch_for(gpu)
    res = compile_config(config, arch).resources
    lines = [
        f"{config.name} for {gpu} ({arch}):",
        f"  registers/thread   {res.registers} x {config.threads} threads",
        f"  spills             {res.spill_stores} B stored, {res.spill_loads} B loaded"
        + ("  <- spills" if res.spills else ""),
        f"  stack frame        {res.stack_bytes} B",
        f"  shared memory      {config.smem_bytes} B dynamic"
        + "".join(f", {k} {v}" for k, v in config.smem_layout.items()),
    ]
    if profile is not None:
        fits = config.smem_bytes <= profile.smem_per_block_optin
        blocks = profile.blocks_per_sm(config.smem_bytes, config.threads, res.registers)
        lines.append(f"  {profile.name + ' limit':18s} {profile.smem_per_block_optin} B per block -> "
                     + ("fits" if fits else "DOES NOT FIT"))
        lines.append(f"  blocks per SM      {blocks} (by shared memory, registers and threads)")
    return "\n".join(lines)


def sass_report(config: KernelConfig, gpu: str) -> str:
    """The instruction mix of the kernel's loops, from its SASS (autoflash.kernels.sass)."""
    from autoflash.kernels import sass
    from autoflash.kernels.compiler import compile_config
    from autoflash.kernels.gpus import arch_for

    compiled = compile_config(config, arch_for(gpu))
    text = sass.disassemble(compiled.cubin_path, config.name)
    out = sass.report(text)
    loops = sass.hmma_loops(text)
    if config.direction == "fwd" and loops:
        out += "\n" + kv_traffic(config, sass.main_loop(loops), sass.straight_line_loads(text))
    return out


def kv_traffic(config: KernelConfig, loop, prologue: dict | None = None) -> str:
    """The forward's global loads per block against the tiles it consumes: per main-loop iteration
    (one K and one V tile) and, given `prologue` (sass.straight_line_loads), outside the loops (the
    Q tile and the first `stages` K/V tiles). A static proxy from SASS, not a measurement. A KV-cache
    kernel's grid has one block per (batch, kv-head, split, query block)."""
    copied = loop.global_loads.get("LDGSTS", (0, 0))[1] * config.threads
    tiles = 2 * config.block_n * config.head_dim * config.elem_bytes
    other = loop.global_loads.get("LDG", (0, 0))
    lines = [f"global loads per block and main-loop iteration: {copied} B by cp.async; a K and a V tile of "
             f"{config.block_n} x {config.head_dim} are {tiles} B"
             + (" (each K/V byte of the block's key range read once)" if copied == tiles else "  <- NOT one K + V tile")
             + (f"; {other[0]} other loads per thread ({other[1]} B: "
                + ("block-table entries)" if config.paged else "not tiles)") if other[0] else "")]
    if prologue is not None:
        q_tile = config.block_m * config.head_dim * config.elem_bytes
        first = prologue.get("LDGSTS", (0, 0))[1] * config.threads
        scalars = prologue.get("LDG", (0, 0))
        lines.append(f"global loads per block outside the loops: {first} B by cp.async; the Q tile ({q_tile} B) and "
                     f"{config.num_stages} K and V tile(s) ({config.num_stages * tiles} B) are "
                     f"{q_tile + config.num_stages * tiles} B"
                     + ("" if first == q_tile + config.num_stages * tiles else "  <- MISMATCH")
                     + (f"; {scalars[0]} other loads per thread ({scalars[1]} B: lengths, indices, block-table entries)"
                        if scalars[0] else ""))
    if config.kvcache:
        lines.append("grid: one block per (batch, kv-head, split, query block), the query heads of a kv-head folded "
                     "into its rows: with seqlen_q x group <= block_m each K/V byte of a (batch, kv-head) is read once")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.list:
            print(_list(args))
            return 0
        if args.sass and not args.gpu:
            raise ValueError("--sass needs --gpu (the SASS is that of one architecture)")
        config = _config(args)
        from autoflash.kernels.gpus import arch_for

        arch = arch_for(args.gpu) if args.gpu else DEFAULT_ARCH
        if config.family == "sm90":  # wgmma and setmaxnreg: sm_90a only
            arch = "sm_90a"
        source = source_for(config, arch=arch, gpu_given=bool(args.gpu),
                            source_name=args.output.name if args.output else None, standalone=args.standalone,
                            line_directives=not args.no_line_directives)
        if args.output:
            args.output.write_text(source)
            print(f"wrote {args.output} ({config.name})")
        else:
            sys.stdout.write(source)
        if args.gpu:
            out = sys.stdout if args.output else sys.stderr
            print(report(config, args.gpu), file=out)
            if args.sass:
                print(sass_report(config, args.gpu), file=out)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
