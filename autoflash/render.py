"""`python -m autoflash.render`: write the generated CUDA source of a kernel config, and with --gpu
compile it for that GPU and print the ptxas resource report. Needs no GPU."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autoflash.kernels.config import DTYPES, KernelConfig

EPILOG = """examples:
  python -m autoflash.render fwd_hd128_bf16_causal_m128n64w4s2 --gpu h100
  python -m autoflash.render --head-dim 96 --dtype fp16 --block-m 128 --block-n 64 --warps 8 -o k.cu
  python -m autoflash.render --default --head-dim 128 --dtype bf16 --gpu a100
  python -m autoflash.render --default --backward --head-dim 128 --dtype bf16 --causal --gpu h100
  python -m autoflash.render fwd_hd128_bf16_m128n64w4s1 --gpu a100 --sass -o /dev/null

The source goes to stdout (or -o FILE); the resource report goes to stderr when the source is on
stdout. --sass adds what the kernel compiles to: the instruction mix of its main loop per warp and
iteration (HMMA, LDSM, cp.async, integer/address work, spills, barriers), read statically from the
SASS with nvdisasm. A proxy for speed, not a measurement. GPU names: a100, a10g, a6000, l4, l40s,
rtx3090, rtx4090, rtx6000-ada, rtx5090, h100, h100-pcie, h200, b200 (or an arch like sm_90)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m autoflash.render",
        description="Render a FlashAttention kernel from the Jinja2 templates; optionally compile it "
        "with NVRTC for a GPU (no GPU needed) and report registers, spills and shared memory.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", nargs="?", help="a kernel name such as fwd_hd128_bf16_causal_m128n64w4s2")
    p.add_argument("--head-dim", type=int, help="head dim, a multiple of 8 in 32..256")
    p.add_argument("--dtype", choices=DTYPES, help="element type (fp32 uses the SIMT path)")
    p.add_argument("--block-m", type=int, help="query rows per block (Br)")
    p.add_argument("--block-n", type=int, help="keys per tile (Bc)")
    p.add_argument("--warps", type=int, default=4, help="warps per block (default 4)")
    p.add_argument("--stages", type=int, default=2, help="K/V pipeline stages (default 2)")
    p.add_argument("--causal", action="store_true", help="causal masking (top-left aligned)")
    p.add_argument("--backward", action="store_true",
                   help="the backward kernels (dK, dV, dQ) instead of the forward")
    p.add_argument("--head-split", type=int, default=1,
                   help="backward only: blocks sharing a key block, each with a slice of the head dim")
    p.add_argument("--default", action="store_true",
                   help="use the built-in default config for --head-dim/--dtype/--causal on --gpu")
    p.add_argument("--gpu", help="compile for this GPU profile or arch and print the resource report")
    p.add_argument("--sass", action="store_true",
                   help="with --gpu: also print the main loop's instruction mix per HMMA, from the SASS "
                   "(static analysis, not a timing)")
    p.add_argument("-o", "--output", type=Path, help="write the source here instead of stdout")
    p.add_argument("--no-line-directives", action="store_true",
                   help="omit the #line directives that map compiler messages to template lines")
    return p


def _config(args, parser) -> KernelConfig:
    if args.name:
        return KernelConfig.from_name(args.name)
    if args.head_dim is None or args.dtype is None:
        parser.error("give a kernel name, or at least --head-dim and --dtype")
    if args.default:
        from autoflash.kernels.defaults import default_backward_config, default_config
        from autoflash.kernels.gpus import get_profile

        if not args.gpu:
            parser.error("--default needs --gpu (defaults depend on the GPU's shared memory)")
        pick = default_backward_config if args.backward else default_config
        return pick(args.head_dim, args.dtype, args.causal, get_profile(args.gpu))
    if args.block_m is None or args.block_n is None:
        parser.error("give --block-m and --block-n (or --default with --gpu)")
    return KernelConfig(head_dim=args.head_dim, dtype=args.dtype, block_m=args.block_m, block_n=args.block_n,
                        num_warps=args.warps, num_stages=args.stages, causal=args.causal,
                        direction="bwd" if args.backward else "fwd", head_split=args.head_split)


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
        config = _config(args, parser)
        from autoflash.kernels.codegen import render

        source = render(config, line_directives=not args.no_line_directives)
        if args.output:
            args.output.write_text(source)
            print(f"wrote {args.output} ({config.name})")
        else:
            sys.stdout.write(source)
        if args.sass and not args.gpu:
            parser.error("--sass needs --gpu (the SASS is that of one architecture)")
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
