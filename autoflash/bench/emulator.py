"""Speed of the host emulator: the generated kernels run on the CPU (autoflash.emulate).

    python -m autoflash.bench emulator                       # the default case: (1, 2, 128, 128) bf16
    python -m autoflash.bench emulator --shape 1,4,2,256,256,64 --causal --sanitize --json out.json

Times, on this machine's CPU, the first call (building the kernels with the host compiler, or loading
them from the disk cache), then the median of --reps warm calls of the forward, the backward (on a saved
forward) and forward + backward (flash_attn then torch.autograd.grad). The target
is forward + backward of (b=1, h=2, L=128, d=128) bf16 in <= 10 s warm on 2 cores. These are CPU
timings of an emulator; they say nothing about the speed of the kernels on a GPU."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def make_parser() -> argparse.ArgumentParser:
    from autoflash.kernels.gpus import PROFILES, profile_arg
    from autoflash.selfcheck import shape_arg

    p = argparse.ArgumentParser(prog="python -m autoflash.bench emulator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", default="a100", type=profile_arg,
                   help=f"the GPU emulated: a profile {sorted(PROFILES)} or a device name torch reports (default a100)")
    p.add_argument("--shape", type=shape_arg, default=(1, 2, 2, 128, 128, 128), help="b,hq,hkv,lq,lk,d")
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="bf16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--sanitize", action="store_true", help="time the sanitizing build instead")
    p.add_argument("--reps", type=int, default=5, help="warm repetitions; the median is reported (default 5)")
    p.add_argument("--target-s", type=float, default=10.0, help="fwd+bwd target in seconds (default 10)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures and settings here")
    return p


def measure(gpu: str, shape, dtype: str, causal: bool, sanitize: bool, reps: int) -> dict:
    import torch

    import autoflash
    from autoflash.kernels.checks import TORCH_DTYPES

    b, hq, hkv, lq, lk, d = shape
    dt = TORCH_DTYPES[dtype]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(dt).requires_grad_() for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
    dout = torch.randn(b, hq, lq, d, generator=g).to(dt)

    def fwd():
        return autoflash.flash_forward(q.detach(), k.detach(), v.detach(), causal=causal)

    def fwdbwd():
        out = autoflash.flash_attn(q, k, v, causal=causal)
        torch.autograd.grad(out, (q, k, v), dout)

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    with autoflash.emulate(gpu, sanitize=sanitize):
        first = timed(fwdbwd)
        out, lse = fwd()
        bwd = lambda: autoflash.flash_backward(dout, q.detach(), k.detach(), v.detach(), out, lse,  # noqa: E731
                                               causal=causal)
        rows = {name: statistics.median(timed(fn) for _ in range(reps))
                for name, fn in (("fwd", fwd), ("bwd", bwd), ("fwdbwd", fwdbwd))}
    return {"first_call_s": first, **{f"{k}_s": v for k, v in rows.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps: got {args.reps}, expected >= 1")
    from autoflash.emulation import EmulationError

    try:
        figures = measure(args.gpu, args.shape, args.dtype, args.causal, args.sanitize, args.reps)
    except (ValueError, EmulationError) as e:
        parser.error(str(e))
    cores = os.cpu_count() or 1
    what = (f"emulated {args.gpu}{' (sanitizer on)' if args.sanitize else ''}, shape {args.shape} {args.dtype}"
            f"{' causal' if args.causal else ''}, {cores} CPU cores")
    print(what)
    print(f"  first call (build or disk cache) {figures['first_call_s']:8.2f} s")
    for name in ("fwd", "bwd", "fwdbwd"):
        print(f"  {name:<7} warm, median of {args.reps:<3}    {figures[name + '_s']:8.3f} s")
    ok = figures["fwdbwd_s"] <= args.target_s
    print(f"fwd+bwd warm {figures['fwdbwd_s']:.3f} s: {'meets' if ok else 'MISSES'} the {args.target_s:g} s target "
          "(CPU emulation speed, not a GPU figure)")
    if args.json:
        import platform

        import torch

        from autoflash import __version__
        from autoflash.kernels.codegen import template_hash
        from autoflash.emulation.build import compiler

        args.json.write_text(json.dumps({
            "command": " ".join(["python", "-m", "autoflash.bench", "emulator", *(argv or [])]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "what": what, "cpu": platform.processor() or platform.machine(),
            "cores": cores, "compiler": compiler()[1], "torch": torch.__version__, "autoflash": __version__,
            "template_hash": template_hash(), "figures": figures, "target_s": args.target_s}, indent=1) + "\n")
    return 0 if ok else 1
