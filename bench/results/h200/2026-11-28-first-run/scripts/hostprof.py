"""cProfile of the host side of launch-bound calls on the GPU machine."""
import cProfile, io, pstats
import torch
import autoflash

dev, bf, N = "cuda", torch.bfloat16, 300
q1 = torch.randn(1, 1, 32, 128, device=dev, dtype=bf)
kc, vc = (torch.randn(1, 2048, 8, 128, device=dev, dtype=bf) for _ in range(2))
lens = torch.full((1,), 2048, device=dev, dtype=torch.int32)
qs, ks, vs = (torch.randn(1, 16, 128, 128, device=dev, dtype=bf) for _ in range(3))
cases = {"decode": lambda: autoflash.flash_attn_with_kvcache(q1, kc, vc, cache_seqlens=lens),
         "attention": lambda: autoflash.attention(qs, ks, vs, is_causal=True)}
for name, fn in cases.items():
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(N):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(28)
        print(f"--- {name}, {N} calls, by {key}\n" + s.getvalue()[-7000:], flush=True)
