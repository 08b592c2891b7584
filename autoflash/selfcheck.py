"""`python -m autoflash.selfcheck`: run the kernels once on one problem and hold the outputs (and,
with --backward, the gradients) to FlashAttention-3's accuracy rule. On a CUDA GPU (small enough for
compute-sanitizer), or on the CPU with --emulate GPU, where --sanitize also checks every memory
access and barrier of the kernels (races, out-of-bounds, misaligned, uninitialized, barrier, and
undefined behaviour such as signed overflow)."""
from __future__ import annotations

import argparse
import sys

EPILOG = """The rule (FlashAttention-3's, hopper/test_flash_attn.py): max|x - ref| <= R * max|x_torch - ref|
+ 2 * max|ref' + 0.3 - 0.3 - ref'| (+ 3e-4 for dq, dk, dv with a softcap), ref = attention in fp32 (fp64
for fp32 inputs), ref' = ref rounded to the input dtype, x_torch = PyTorch in the input dtype, R = 2
(3 with a softcap) for out, dq, dk and dv; fp32 inputs, which FA3 does not test, also + 1e-5.

  python -m autoflash.selfcheck --shape 2,6,2,113,203,96 --dtype bf16 --causal --backward
  python -m autoflash.selfcheck --emulate a100 --sanitize --backward --shape 1,4,2,77,133,96 --causal
  python -m autoflash.selfcheck --emulate h100 --sanitize --config bwd_hd128_bf16_m64n128w8s2
  python -m autoflash.selfcheck --emulate h100 --sanitize --backward --schedules 4   # 3 fixed orders + 4 random
  python -m autoflash.selfcheck --emulate h100 --sanitize --backward --window 16,0 --softcap 30 --alibi --varlen
  python -m autoflash.selfcheck --emulate h100 --sanitize --kvcache --shape 3,6,2,4,300,128 --causal --new 4 \
      --paged 64 --splits 3 --rotary neox
  python -m autoflash.selfcheck --emulate a100 --sanitize --backward --shape 2,4,2,77,131,64 --head-dim-v 256 --causal
  compute-sanitizer --tool memcheck python -m autoflash.selfcheck --backward
With --sanitize every finding is printed with its kind, kernel, template file:line, block and thread.
Exit status: 0 all within the rule (and, sanitizing, no finding), 1 a result outside it or a
finding, 2 no GPU (without --emulate) or bad arguments."""


def shape_arg(text: str) -> tuple[int, ...]:
    """argparse type for b,hq,hkv,lq,lk,d (also used by `python -m autoflash.bench emulator`)."""
    try:
        dims = tuple(int(t) for t in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 6 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected six positive integers b,hq,hkv,lq,lk,d")
    return dims


def window_arg(text: str) -> tuple[int, int]:
    """argparse type for LEFT,RIGHT window sizes (-1 unbounded)."""
    try:
        left, right = (int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected LEFT,RIGHT: two ints >= -1") from None
    if min(left, right) < -1:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected sizes >= 0, or -1 for unbounded")
    return left, right


def _parser() -> argparse.ArgumentParser:
    from autoflash.kernels.gpus import PROFILES, profile_arg

    p = argparse.ArgumentParser(prog="python -m autoflash.selfcheck", description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=shape_arg, default=None,
                   help="b,hq,hkv,lq,lk,d (default 2,6,2,113,203,96: odd lengths, GQA; d from --config if given)")
    p.add_argument("--head-dim-v", type=int, default=None, metavar="DV",
                   help="V's (and the output's) head dim where it differs from d (FlashAttention-3's headdim_v; "
                        "default d, or --config's)")
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default=None, help="default bf16 (or --config's)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--backward", action="store_true", help="also check dq, dk, dv")
    p.add_argument("--deterministic", action="store_true", help="the bit-reproducible backward")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--emulate", metavar="GPU", type=profile_arg,
                   help=f"run on the CPU as this GPU would ({', '.join(sorted(PROFILES))}, or a device name torch "
                   "reports); no GPU needed")
    p.add_argument("--sanitize", action="store_true", help="with --emulate: check every access and barrier")
    p.add_argument("--schedules", type=int, default=0, metavar="N",
                   help="with --emulate, N >= 1: run the check under the emulator's default thread order, with "
                        "an mbarrier's waiters woken as soon as their phase completes (wake), with released threads "
                        "first (released-first), and under N random orders (random:S for S = --seed, --seed + 1, "
                        "...); a finding names the order that exposed it. Default 0: the default order only")
    v = p.add_argument_group("variants (flash-attn's features, fp16/bf16)")
    v.add_argument("--align", choices=("top_left", "bottom_right"), default="top_left",
                   help="where query i's diagonal sits: key i (SDPA) or key i + Lk - Lq (flash-attn)")
    v.add_argument("--window", type=window_arg, default=(-1, -1), metavar="LEFT,RIGHT",
                   help="sliding window, -1 unbounded (e.g. 16,0)")
    v.add_argument("--attention-chunk", type=int, default=0, metavar="C",
                   help="FlashAttention-3's chunked local attention: only the keys of the chunk of C keys holding "
                        "the query's diagonal key (0: none)")
    v.add_argument("--softcap", type=float, default=0.0, help="scores cap * tanh(s / cap)")
    v.add_argument("--alibi", action="store_true", help="ALiBi with random (batch, heads) slopes")
    v.add_argument("--key-padding", action="store_true",
                   help="a key bias masking a random suffix of each batch's keys (an SDPA key-padding mask)")
    v.add_argument("--seqused", action="store_true",
                   help="with --varlen: each sequence uses a random prefix of its rows and keys (FlashAttention-3's "
                        "seqused_q / seqused_k)")
    v.add_argument("--varlen", action="store_true",
                   help="pack the batch as sequences of random lengths <= Lq, Lk (cu_seqlens)")
    c = p.add_argument_group("KV cache (flash_attn_with_kvcache's decode kernels; Lk of --shape is the cache's "
                             "capacity, each sequence holding a random number of keys, one none)")
    c.add_argument("--kvcache", action="store_true", help="run flash_attn_with_kvcache instead of the prefill kernels")
    c.add_argument("--new", type=int, default=0, metavar="N", help="append N new keys and values first")
    c.add_argument("--paged", type=int, default=0, metavar="PAGE", help="a paged cache of PAGE-row pages (any size: "
                   "multiples of 16 read a key tile at a time, others gathered row by row)")
    c.add_argument("--splits", type=int, default=0, metavar="N", help="num_splits (0 chooses)")
    c.add_argument("--rotary", choices=("none", "interleaved", "neox"), default="none",
                   help="rotary embeddings on q and the new keys, over half the head dim")
    c.add_argument("--leftpad", action="store_true", help="random left padding per sequence")
    c.add_argument("--batch-idx", action="store_true", help="a cache (or block table) with more rows than the "
                   "batch, picked by cache_batch_idx")
    p.add_argument("--config", metavar="NAME", help="a kernel name, e.g. fwd_hd128_bf16_causal_m128n64w8s2 "
                   "(a bwd_... name checks the backward); dtype, head dim and causal follow from it")
    return p


def _resolve(args, parser):
    """(shape, dtype, causal, forward config or None, backward config or None, backward?); sets
    args.head_dim_v (d where not given)."""
    from autoflash.kernels.config import KernelConfig

    shape, dtype, causal = args.shape or (2, 6, 2, 113, 203, 96), args.dtype or "bf16", args.causal
    fwd = bwd = None
    given_v = args.head_dim_v
    if args.config:
        try:
            cfg = KernelConfig.from_name(args.config)
        except (ValueError, TypeError) as e:
            parser.error(f"--config: {e}")
        if args.shape and args.shape[5] != cfg.head_dim:
            parser.error(f"--config {cfg.name} has head_dim {cfg.head_dim}; --shape gives d = {args.shape[5]}")
        if args.dtype and args.dtype != cfg.dtype:
            parser.error(f"--config {cfg.name} is {cfg.dtype}; --dtype gives {args.dtype}")
        if given_v is not None and given_v != cfg.dv:
            parser.error(f"--config {cfg.name} has V head dim {cfg.dv}; --head-dim-v gives {given_v}")
        shape, dtype, causal = (*shape[:5], cfg.head_dim), cfg.dtype, cfg.causal
        fwd, bwd = (cfg, None) if cfg.direction == "fwd" else (None, cfg)
        given_v = cfg.dv
    args.head_dim_v = shape[5] if given_v is None else given_v
    return shape, dtype, causal, fwd, bwd, args.backward or bwd is not None


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.sanitize and not args.emulate:
        parser.error("--sanitize checks kernels on the emulator: add --emulate GPU (e.g. --emulate a100)")
    if args.schedules and not args.emulate:
        parser.error("--schedules orders the emulator's threads: add --emulate GPU (e.g. --emulate h100)")
    if args.schedules < 0:
        parser.error(f"--schedules: got {args.schedules}, expected 0 or more random orders")
    shape, dtype, causal, fwd_cfg, bwd_cfg, backward = _resolve(args, parser)
    if args.seqused and not args.varlen:
        parser.error("--seqused counts the rows in use of packed sequences: add --varlen")
    if args.attention_chunk < 0:
        parser.error(f"--attention-chunk: got {args.attention_chunk}, expected 0 (none) or a chunk size >= 1")
    variant = args.window != (-1, -1) or args.softcap or args.alibi or args.key_padding or args.varlen \
        or args.align != "top_left" or args.attention_chunk
    if variant and (fwd_cfg or bwd_cfg):
        parser.error("--config with variant flags: the variant switches come from the flags; drop --config")
    if variant and dtype == "fp32":
        parser.error("the variants run on the fp16/bf16 kernels; use --dtype fp16 or bf16")
    if args.kvcache and (fwd_cfg or bwd_cfg or backward or args.varlen or dtype == "fp32"):
        parser.error("--kvcache runs the fp16/bf16 decode kernels forward only: drop --config, --backward, --varlen "
                     "and --dtype fp32")
    if not args.kvcache and (args.new or args.paged or args.splits or args.rotary != "none" or args.leftpad
                             or args.batch_idx):
        parser.error("--new, --paged, --splits, --rotary, --leftpad and --batch-idx go with --kvcache")
    if args.rotary != "none" and not args.new:
        parser.error("--rotary goes onto the new keys as they are appended: add --new N (flash-attn's rule)")
    import contextlib

    import torch

    if not args.emulate and not torch.cuda.is_available():
        print("autoflash.selfcheck needs a CUDA GPU; none is visible (torch.cuda.is_available() is False). "
              "Add --emulate GPU to run the kernels on the CPU.", file=sys.stderr)
        return 2
    from autoflash import emulation

    from autoflash.emulation.context import SCHEDULES

    schedules = [*SCHEDULES, *(f"random:{args.seed + i}" for i in range(args.schedules))] if args.schedules \
        else ["default"]
    from autoflash.kernels.launch import recording

    results = []
    try:
        emulation.clear_findings()
        with recording() as ran:
            for schedule in schedules:
                context = emulation.emulate(args.emulate, sanitize=args.sanitize, schedule=schedule) \
                    if args.emulate else contextlib.nullcontext()
                with context:
                    if args.kvcache:
                        from autoflash.selfcheck_kvcache import check_kvcache

                        rows = check_kvcache(args, shape, dtype, causal)
                    elif variant:
                        rows = _check_variant(args, shape, dtype, causal, backward)
                    else:
                        rows = _check(args, shape, dtype, causal, fwd_cfg, bwd_cfg, backward)
                results += [(f"{name} [{schedule}]" if len(schedules) > 1 else name, *rest) for name, *rest in rows]
        findings = emulation.findings() if args.sanitize else []
    except (ValueError, TypeError, emulation.EmulationError) as e:  # e.g. a config that does not fit
        print(f"autoflash.selfcheck: {e}", file=sys.stderr)
        return 2
    where = (f"emulated {args.emulate} on the CPU{' (sanitizer on)' if args.sanitize else ''}" if args.emulate
             else torch.cuda.get_device_name())
    dv = f"  dv {args.head_dim_v}" if args.head_dim_v != shape[5] else ""
    print(f"{where}  shape b,hq,hkv,lq,lk,d = {shape}{dv}  {dtype}{'  causal' if causal else ''}"
          f"{'  ' + _describe(args) if variant or args.kvcache else ''}")
    print(f"  kernels: {', '.join(dict.fromkeys(c.name for c in ran))}")
    failed = False
    for name, ok, err, bound in results:
        failed |= not ok
        print(f"  {name:3s}  err {err:.3e}  bound {bound:.3e}  {'ok' if ok else 'OUTSIDE THE RULE'}")
    if args.sanitize:
        print(f"sanitizer: {len(findings)} finding{'s' * (len(findings) != 1)} (schedules: {', '.join(schedules)})")
        for f in findings:
            print(f"  {f}")
        failed |= bool(findings)
    return 1 if failed else 0


def _check(args, shape, dtype, causal, fwd_cfg, bwd_cfg, backward) -> list[tuple[str, bool, float, float]]:
    """Runs the kernels once; (name, within the rule, error, bound) for out and, with backward, dq, dk, dv."""
    import torch

    from autoflash.kernels.checks import TORCH_DTYPES
    from autoflash.kernels.function import flash_attn
    from autoflash.reference.forward import attention_ref, within_tolerance
    from autoflash.reference.backward import attention_backward_ref

    b, hq, hkv, lq, lk, d = shape
    dt = TORCH_DTYPES[dtype]
    device = "cpu" if args.emulate else "cuda"
    g = torch.Generator(device=device).manual_seed(args.seed)
    dv = args.head_dim_v
    if args.sanitize:  # guard bands after every row and sequence: reads past them are findings
        from autoflash.emulation.guards import guarded_randn

        def make(h, n, width=d):
            return guarded_randn(b, h, n, width, dt, g)
    else:
        def make(h, n, width=d):
            return torch.randn(b, h, n, width, device=device, dtype=dt, generator=g)

    up = torch.float64 if dt == torch.float32 else torch.float32
    q, k, v = (make(h, n, w).requires_grad_(backward) for h, n, w in ((hq, lq, d), (hkv, lk, d), (hkv, lk, dv)))
    out = flash_attn(q, k, v, causal=causal, deterministic=args.deterministic, config=fwd_cfg,
                     backward_config=bwd_cfg)
    x = [t.detach() for t in (q, k, v)]
    checks = [("out", out.detach(), attention_ref(*(t.to(up) for t in x), causal=causal)[0],
               attention_ref(*x, causal=causal, upcast=False)[0])]
    if backward:
        dout = make(hq, lq, dv)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        ref = attention_backward_ref(*(t.to(up) for t in x), dout.to(up), causal=causal)
        yard = attention_backward_ref(*x, dout, causal=causal, upcast=False)
        checks += [(n, gr, r, y) for n, gr, r, y in zip(("dq", "dk", "dv"), grads, ref, yard)]
    if device == "cuda":
        torch.cuda.synchronize()
    return [(name, *within_tolerance(got, ref, yard, backward=name != "out")) for name, got, ref, yard in checks]


def _describe(args) -> str:
    parts = [f"align {'bottom_right' if args.kvcache else args.align}"]
    parts += [f"window {args.window}"] if args.window != (-1, -1) else []
    parts += [f"attention chunk {args.attention_chunk}"] if args.attention_chunk else []
    parts += [f"softcap {args.softcap}"] if args.softcap else []
    parts += [name for name, on in (("alibi", args.alibi), ("key padding", args.key_padding), ("varlen", args.varlen),
                                    ("seqused", args.seqused)) if on]
    if args.kvcache:
        parts += [f"kv cache: new {args.new}, {f'pages of {args.paged}' if args.paged else 'dense'}, splits "
                  f"{args.splits or 'chosen'}, rotary {args.rotary}"
                  + ", leftpad" * args.leftpad + ", cache_batch_idx" * args.batch_idx]
    return ", ".join(parts)


def _check_variant(args, shape, dtype, causal, backward) -> list[tuple[str, bool, float, float]]:
    """The variant kernels (flash_forward / flash_backward) once, against the references; dense inputs
    carry guard bands when sanitizing, packed ones a guard after the last row."""
    import torch

    from autoflash.kernels.checks import TORCH_DTYPES
    from autoflash.kernels.launch import flash_backward, flash_forward
    from autoflash.reference.forward import attention_ref, attention_varlen_ref, within_tolerance

    b, hq, hkv, lq, lk, d = shape
    dv = args.head_dim_v
    dt = TORCH_DTYPES[dtype]
    device = "cpu" if args.emulate else "cuda"
    g = torch.Generator().manual_seed(args.seed)
    from autoflash.emulation.guards import guarded_randn

    kw = dict(causal=causal, align=args.align, window=args.window, softcap=args.softcap)
    if args.attention_chunk:
        kw["attention_chunk"] = args.attention_chunk
    if args.alibi:
        kw["alibi_slopes"] = (torch.rand(b, hq, generator=g) * 0.3).to(device)
    if args.varlen:  # b sequences of random lengths (0 and 1 allowed), packed with no padding
        lens_q = torch.randint(0, lq + 1, (b,), generator=g).tolist()
        lens_k = torch.randint(0, lk + 1, (b,), generator=g).tolist()
        cu = [torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32, device=device)
              for n in (lens_q, lens_k)]

        def make(h, lengths, width=d):
            t = guarded_randn(1, h, sum(lengths), width, dt, g, layout="bshd")[0].transpose(0, 1)
            return t.to(device)
        q, dout = make(hq, lens_q), make(hq, lens_q, dv)
        k, v = make(hkv, lens_k), make(hkv, lens_k, dv)
        kw.update(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1])
        if args.seqused:  # a random prefix of each sequence's rows and keys in use
            for name, lens in (("seqused_q", lens_q), ("seqused_k", lens_k)):
                kw[name] = torch.tensor([int(torch.randint(0, n + 1, (1,), generator=g)) for n in lens],
                                        dtype=torch.int32, device=device)
        launch_kw = dict(kw, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))

        def reference(*x, upcast=True):
            return attention_varlen_ref(*x, upcast=upcast, **kw)
    else:
        if args.key_padding:  # batch i keeps a random prefix of its keys (possibly none)
            bias = torch.zeros(b, lk)
            for i, n in enumerate(torch.randint(0, lk + 1, (b,), generator=g).tolist()):
                bias[i, n:] = float("-inf")
            kw["key_bias"] = bias.to(device)
        q, dout = (guarded_randn(b, hq, lq, w, dt, g).to(device) for w in (d, dv))
        k, v = (guarded_randn(b, hkv, lk, w, dt, g).to(device) for w in (d, dv))
        launch_kw = kw

        def reference(*x, upcast=True):
            return attention_ref(*x, upcast=upcast, **kw)

    out, lse = flash_forward(q, k, v, **launch_kw)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    same = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*leaves)
    torch_out, _ = reference(*same, upcast=False)
    checks = [("out", out, ref_out.detach(), torch_out.detach())]
    if backward:
        grads = flash_backward(dout, q, k, v, out, lse, deterministic=args.deterministic, **launch_kw)
        ref = torch.autograd.grad(ref_out, leaves, dout.float())
        yard = torch.autograd.grad(torch_out, same, dout)
        checks += [(n, gr, r, y) for n, gr, r, y in zip(("dq", "dk", "dv"), grads, ref, yard)]
    if device == "cuda":
        torch.cuda.synchronize()
    return [(name, *within_tolerance(got, ref, yard, softcap=args.softcap, backward=name != "out"))
            for name, got, ref, yard in checks]


if __name__ == "__main__":
    sys.exit(main())
