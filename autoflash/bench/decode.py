"""Decode benchmark (GPU): flash_attn_with_kvcache against torch SDPA on one decode step, the regime
where attention is bound by reading the KV cache.

    python -m autoflash.bench decode                               # batches 1..64, caches 1k..128k
    python -m autoflash.bench decode --head-dim 64 --heads 32 --kv-heads 32 --batches 1,16 --cache-lens 4k
    python -m autoflash.bench decode --page-size 256 --json decode.json

Per (batch, cache length): q (batch, seqlen_q, heads, d) over full caches of that length. Timed:
autoflash with the split heuristic (num_splits=0), autoflash unsplit (num_splits=1), and SDPA on
the same q and cache (its own backend choice, enable_gqa; the cache viewed as (batch, heads_kv,
length, d), no copy). The figure of merit is memory bound: bytes of K and V read (batch x length x
heads_kv x d x 2 tensors x element bytes) per second, and that as a share of the GPU profile's HBM
bandwidth. Every timed result is first held, on its first 4 sequences, to FlashAttention-3's rule
against fp32 attention (2 x SDPA-in-the-same-dtype's own error + 2 x the reference's rounding in the
input dtype). CUDA events around the call, L2 flushed before each repetition, median reported.
"""
from __future__ import annotations

import argparse
import json
import sys

from autoflash.bench.timing import flush_buffer, time_cuda

CHECKED = 4  # sequences of each batch held to the rule before timing
DEVICE = "cuda"  # tests run the loop on CPU tensors under autoflash.emulate with CUDA's timing faked
NO_GPU_MESSAGE = ("autoflash.bench decode needs a CUDA GPU; none is visible (torch.cuda.is_available() is False). "
                  "On the CPU, the decode kernels run on the emulator: python -m autoflash.selfcheck --emulate h100 "
                  "--kvcache --causal --new 1 --splits 3")


def _lengths(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            out.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}, expected comma-separated lengths like 1k,8k,512") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected positive lengths")
    return out


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m autoflash.bench decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=("fp16", "bf16"), default="bf16")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=32, help="query heads (default 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="K/V heads (default 8: GQA 4:1, Llama 3 8B)")
    p.add_argument("--seqlen-q", type=int, default=1, help="new queries per step (default 1; causal when > 1)")
    p.add_argument("--batches", type=_lengths, default=[1, 4, 16, 64], help="default 1,4,16,64")
    p.add_argument("--cache-lens", type=_lengths, default=[1024, 8192, 32768, 131072],
                   help="cache lengths, default 1k,8k,32k,128k")
    p.add_argument("--page-size", type=int, default=0, help="a paged cache of this page size (default dense)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    return p


def _bench_one(torch, F, args, batch: int, length: int, profile, flush) -> dict:
    from autoflash import flash_attn_with_kvcache
    from autoflash.kernels.checks import TORCH_DTYPES
    from autoflash.reference.forward import within_tolerance

    dt, d, lq = TORCH_DTYPES[args.dtype], args.head_dim, args.seqlen_q
    q = torch.randn(batch, lq, args.heads, d, device=DEVICE, dtype=dt)
    dense = torch.randn(2, batch, length, args.kv_heads, d, device=DEVICE, dtype=dt)
    k_dense, v_dense = dense[0], dense[1]
    kw = dict(cache_seqlens=length, causal=lq > 1)
    if args.page_size:
        pages = -(-length // args.page_size)
        pad = pages * args.page_size - length
        paged = torch.nn.functional.pad(dense, (0, 0, 0, 0, 0, pad)).reshape(2, batch * pages, args.page_size,
                                                                              args.kv_heads, d)
        caches = (paged[0], paged[1])
        kw["block_table"] = torch.arange(batch * pages, device=DEVICE, dtype=torch.int32).reshape(batch, pages)
    else:
        caches = (k_dense, v_dense)
    # SDPA: bottom-right causal for seqlen_q > 1 is a boolean mask (SDPA's is_causal is top-left)
    qs, ks, vs = q.transpose(1, 2), k_dense.transpose(1, 2), v_dense.transpose(1, 2)
    mask = None
    if lq > 1:
        mask = torch.ones(lq, length, device=DEVICE, dtype=torch.bool).tril(length - lq)

    def sdpa(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, attn_mask=mask, enable_gqa=True)

    calls = {"autoflash": lambda: flash_attn_with_kvcache(q, *caches, num_splits=0, **kw),
             "autoflash-unsplit": lambda: flash_attn_with_kvcache(q, *caches, num_splits=1, **kw),
             "sdpa": lambda: sdpa(qs, ks, vs)}
    # Checked on the first CHECKED sequences: the fp32 reference of a whole large batch would not fit
    # (64 caches of 64k keys are 64 GiB in fp32).
    n = min(batch, CHECKED)
    ref = sdpa(qs[:n].float(), ks[:n].float(), vs[:n].float()).transpose(1, 2)
    same = calls["sdpa"]().transpose(1, 2)[:n]
    bytes_read = 2 * batch * length * args.kv_heads * d * q.element_size()
    row = {"batch": batch, "cache_len": length, "kv_bytes": bytes_read}
    for name, fn in calls.items():
        out = fn()
        got = (out.transpose(1, 2) if name == "sdpa" else out)[:n]
        ok, err, bound = within_tolerance(got, ref, same)
        if not ok:
            row[name] = {"status": "failed", "err": err, "bound": bound}
            continue
        t = time_cuda(torch, fn, reps=args.reps, warmup=5, flush=flush)
        gbs = bytes_read / (t["ms_median"] * 1e-3) / 1e9
        row[name] = {"status": "ok", **t, "gb_per_s": gbs,
                     "hbm_share": gbs / profile.mem_bandwidth_gbs if profile.mem_bandwidth_gbs else None}
    return row


def _line(row: dict) -> str:
    cells = [f"b={row['batch']:<3d} L={row['cache_len']:<7d}"]
    for name in ("autoflash", "autoflash-unsplit", "sdpa"):
        r = row[name]
        if r["status"] != "ok":
            cells.append(f"{name} FAILED (err {r['err']:.2e} > {r['bound']:.2e})")
            continue
        share = f" {100 * r['hbm_share']:.0f}% HBM" if r["hbm_share"] else ""
        cells.append(f"{name} {r['ms_median']:.3f} ms {r['gb_per_s']:.0f} GB/s{share}")
    return "  ".join(cells)


def _profile(torch):
    from autoflash.kernels.launch import device_profile

    return device_profile(torch.cuda.current_device())


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return 2
    profile = _profile(torch)
    flush = flush_buffer(torch, DEVICE)
    print(f"{torch.cuda.get_device_name()}: {args.dtype} d={args.head_dim} heads {args.heads}/{args.kv_heads} "
          f"seqlen_q {args.seqlen_q}{f' pages of {args.page_size}' if args.page_size else ''}; HBM "
          f"{profile.mem_bandwidth_gbs:.0f} GB/s (profile {profile.name})")
    rows, failed = [], False
    for batch in args.batches:
        for length in args.cache_lens:
            row = _bench_one(torch, F, args, batch, length, profile, flush)
            failed |= any(row[n]["status"] != "ok" for n in ("autoflash", "autoflash-unsplit"))
            rows.append(row)
            print(_line(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python -m autoflash.bench decode " + " ".join(argv or sys.argv[2:]),
                       "device": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}, f, indent=1)
    return 1 if failed else 0
