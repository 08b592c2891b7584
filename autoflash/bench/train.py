"""A small decoder-only transformer trained with autoflash.attention and with torch SDPA, from the same
seed on the same batches: the loss curves must agree within bf16 noise, and the tokens/s of both
are reported. Then, under torch.compile(fullgraph=True), the kernels must run (strict: no fallback)
and match eager.

    python -m autoflash.bench train                       # 4 layers, 50 steps, bf16, on the GPU
    python -m autoflash.bench train --json result.json

Model: pre-norm blocks (RMSNorm, causal self-attention with GQA, SiLU MLP), random tokens from a
fixed generator (the loss still falls: the model memorises a repeating batch set), AdamW. "Within
bf16 noise": the largest |loss_autoflash - loss_sdpa| over the steps must stay under --tolerance
(default 0.05, where the losses start near ln(vocab) ~ 8.3); each run's own loss must fall.
--device cpu runs the same script on the CPU (both runs then use SDPA: a smoke test of the script).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path


def build_model(torch, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, attn):
    nn = torch.nn
    head_dim = dim // heads

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
            self.q = nn.Linear(dim, dim, bias=False)
            self.kv = nn.Linear(dim, 2 * kv_heads * head_dim, bias=False)
            self.o = nn.Linear(dim, dim, bias=False)
            self.up, self.down = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False)

        def forward(self, x):
            b, n, _ = x.shape
            h = self.norm1(x)
            q = self.q(h).view(b, n, heads, head_dim).transpose(1, 2)
            k, v = self.kv(h).view(b, n, 2, kv_heads, head_dim).permute(2, 0, 3, 1, 4)
            a = attn(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
            x = x + self.o(a.transpose(1, 2).reshape(b, n, dim))
            return x + self.down(nn.functional.silu(self.up(self.norm2(x))))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

        def forward(self, tokens):
            x = self.embed(tokens)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.norm(x))

    return Model()


def train(torch, args, attn, label: str) -> dict:
    torch.manual_seed(args.seed)
    model = build_model(torch, args.vocab, args.dim, args.layers, args.heads, args.kv_heads, attn)
    model = model.to(device=args.device, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed + 1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seqlen + 1), generator=gen) for _ in range(4)]
    losses, timed_tokens, timed_s = [], 0, 0.0
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for step in range(args.steps):
        tokens = batches[step % len(batches)].to(args.device)
        sync()
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync()
        if step >= args.warmup_steps:  # the first steps compile and load kernels
            timed_s += time.perf_counter() - t0
            timed_tokens += tokens[:, :-1].numel()
        losses.append(loss.item())
    return {"run": label, "losses": losses, "tokens_per_s": timed_tokens / timed_s if timed_s else None}


def compiled_matches_eager(torch, args) -> dict:
    """The model's forward under torch.compile(fullgraph=True), strict (the kernels or an error)."""
    import autoflash

    def attn(q, k, v, **kw):
        return autoflash.attention(q, k, v, strict=args.device == "cuda", **kw)

    torch.manual_seed(args.seed)
    model = build_model(torch, args.vocab, args.dim, args.layers, args.heads, args.kv_heads, attn)
    model = model.to(device=args.device, dtype=torch.bfloat16)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seqlen), device=args.device)
    with torch.no_grad():
        eager = model(tokens).float()
        compiled = torch.compile(model, fullgraph=True)(tokens).float()
    diff = (eager - compiled).abs().max().item()
    return {"max_abs_diff": diff, "ok": diff <= args.tolerance * 10 and math.isfinite(diff)}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m autoflash.bench train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=1024, help="model width (default 1024: 8 heads of 128)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2, help="GQA: key/value heads (default 2)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup-steps", type=int, default=5, help="untimed first steps (default 5)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=0.05, help="max |loss difference| (default 0.05)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile check")
    p.add_argument("--json", type=Path, default=None, help="also write the curves and figures here")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.dim % args.heads or args.heads % args.kv_heads or min(args.steps, args.layers, args.batch) < 1:
        parser.error(f"--dim/--heads/--kv-heads/--steps: got {args.dim}/{args.heads}/{args.kv_heads}/{args.steps}; "
                     "expected heads dividing dim, kv-heads dividing heads, steps >= 1")
    if args.warmup_steps >= args.steps:
        parser.error(f"--warmup-steps: got {args.warmup_steps}, expected fewer than --steps ({args.steps})")
    import torch

    import autoflash

    if args.device == "cuda" and not torch.cuda.is_available():
        print("autoflash.bench train needs a CUDA GPU (torch.cuda.is_available() is False); "
              "--device cpu runs the script's smoke test", file=sys.stderr)
        return 2
    strict = args.device == "cuda"  # on a GPU the kernels must run: a fallback is an error

    def ours(q, k, v, **kw):
        return autoflash.attention(q, k, v, strict=strict, **kw)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autoflash.FallbackWarning)  # --device cpu: SDPA both times, by design
        runs = [train(torch, args, torch.nn.functional.scaled_dot_product_attention, "sdpa"),
                train(torch, args, ours, "autoflash")]
        compiled = None if args.no_compile else compiled_matches_eager(torch, args)
    a, b = runs[1]["losses"], runs[0]["losses"]
    gap = max(abs(x - y) for x, y in zip(a, b))
    falls = all(r["losses"][-1] < r["losses"][0] for r in runs)
    ok = gap <= args.tolerance and falls and (compiled is None or compiled["ok"])
    for r in runs:
        tps = f"{r['tokens_per_s']:,.0f} tokens/s" if r["tokens_per_s"] else "untimed"
        print(f"{r['run']:<10} loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}  {tps}")
    print(f"max |loss difference| over {args.steps} steps: {gap:.4g} (tolerance {args.tolerance:g}); "
          f"losses fall: {falls}")
    if compiled is not None:
        print(f"torch.compile(fullgraph=True) vs eager: max |diff| {compiled['max_abs_diff']:.4g}")
    print("PASS" if ok else "FAIL")
    if args.json:
        record = {"command": " ".join(["python", "-m", "autoflash.bench", "train", *(argv or [])]),
                  "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__,
                  "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                  "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  "runs": runs, "max_loss_gap": gap, "compiled": compiled, "pass": ok}
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if ok else 1
