"""`python -m autoflash.selfcheck`: run the kernels once on one problem and hold the outputs (and,
with --backward, the gradients) to FlashAttention's accuracy rule. Small enough to run under
compute-sanitizer; needs a CUDA GPU."""
from __future__ import annotations

import argparse
import sys

EPILOG = """The rule: max|x - ref| <= F * max|x_torch - ref| + 1e-5, ref = attention in fp32 (fp64 for
fp32 inputs), x_torch = PyTorch in the input dtype, F = 2 for out and 3 for dq, dk, dv.

  python -m autoflash.selfcheck --shape 2,6,2,113,203,96 --dtype bf16 --causal --backward
  compute-sanitizer --tool memcheck python -m autoflash.selfcheck --backward
Exit status: 0 all within the rule, 1 a result outside it, 2 no GPU or bad arguments."""


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(t) for t in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 6 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected six positive integers b,hq,hkv,lq,lk,d")
    return dims


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m autoflash.selfcheck", description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=_shape, default=(2, 6, 2, 113, 203, 96),
                   help="b,hq,hkv,lq,lk,d (default 2,6,2,113,203,96: odd lengths, GQA)")
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="bf16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--backward", action="store_true", help="also check dq, dk, dv")
    p.add_argument("--deterministic", action="store_true", help="the bit-reproducible backward")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("autoflash.selfcheck needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    from autoflash.checks import TORCH_DTYPES
    from autoflash.function import flash_attn
    from autoflash.reference import attention_ref, within_tolerance
    from autoflash.reference_bwd import attention_backward_ref

    b, hq, hkv, lq, lk, d = args.shape
    dt = TORCH_DTYPES[args.dtype]
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dt, generator=g).requires_grad_(args.backward)
               for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
    up = torch.float64 if dt == torch.float32 else torch.float32
    out = flash_attn(q, k, v, causal=args.causal, deterministic=args.deterministic)
    results = [("out", out, attention_ref(*(t.detach().to(up) for t in (q, k, v)), causal=args.causal)[0],
                attention_ref(q.detach(), k.detach(), v.detach(), causal=args.causal, upcast=False)[0], 2.0)]
    if args.backward:
        dout = torch.randn(out.shape, device="cuda", dtype=dt, generator=g)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        x = [t.detach() for t in (q, k, v)]
        ref = attention_backward_ref(*(t.to(up) for t in x), dout.to(up), causal=args.causal)
        yard = attention_backward_ref(*x, dout, causal=args.causal, upcast=False)
        results += [(n, gr, r, y, 3.0) for n, gr, r, y in zip(("dq", "dk", "dv"), grads, ref, yard)]
    torch.cuda.synchronize()
    failed = False
    print(f"{torch.cuda.get_device_name()}  shape b,hq,hkv,lq,lk,d = {args.shape}  {args.dtype}"
          f"{'  causal' if args.causal else ''}")
    for name, got, ref, yard, factor in results:
        ok, err, bound = within_tolerance(got.detach(), ref, yard, factor=factor)
        failed |= not ok
        print(f"  {name:3s}  err {err:.3e}  bound {bound:.3e}  {'ok' if ok else 'OUTSIDE THE RULE'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
