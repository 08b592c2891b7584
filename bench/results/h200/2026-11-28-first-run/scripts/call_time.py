"""Where a launch-bound call's time goes on the GPU machine: wall time per call (N calls back to back,
one sync), the GPU's kernel time per call (torch.profiler), and cProfile of the host side.

Run as .gpurun/profile.py on 2026-11-28 (run2.sh): that name shadowed the standard library's
`profile` module, so the cProfile half below failed with a circular import after the timings were
printed (call-time-26aceb3.log); the host profile was taken by hostprof.py in run3.sh instead."""
import cProfile, io, pstats, time
import torch
import torch.nn.functional as F
import autoflash

dev, bf = "cuda", torch.bfloat16
N = 300


def wall_us(fn):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(N):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / N * 1e6


def kernel_us(fn):
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in evs) if evs and hasattr(evs[0], "device_time") else sum(e.cuda_time for e in evs)
    names = sorted({e.name[:60] for e in evs})
    return total / 50, len(evs) / 50, names


q1 = torch.randn(1, 1, 32, 128, device=dev, dtype=bf)
kc = torch.randn(1, 2048, 8, 128, device=dev, dtype=bf)
vc = torch.randn(1, 2048, 8, 128, device=dev, dtype=bf)
pk = kc.reshape(8, 256, 8, 128)
bt = torch.arange(8, device=dev, dtype=torch.int32).reshape(1, 8)
lens = torch.full((1,), 2048, device=dev, dtype=torch.int32)
q, k, v = (torch.randn(1, 128, 16, 128, device=dev, dtype=bf) for _ in range(3))
qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))
kcs, vcs, q1s = kc.transpose(1, 2), vc.transpose(1, 2), q1.transpose(1, 2)
cases = {
    "decode dense split auto": lambda: autoflash.flash_attn_with_kvcache(q1, kc, vc, cache_seqlens=lens),
    "decode dense unsplit": lambda: autoflash.flash_attn_with_kvcache(q1, kc, vc, cache_seqlens=lens, num_splits=1),
    "decode int seqlens": lambda: autoflash.flash_attn_with_kvcache(q1, kc, vc, cache_seqlens=2048, num_splits=1),
    "decode paged 256": lambda: autoflash.flash_attn_with_kvcache(q1, pk, pk, cache_seqlens=lens, block_table=bt),
    "sdpa decode": lambda: F.scaled_dot_product_attention(q1s, kcs, vcs, enable_gqa=True),
    "flash_attn_func s128": lambda: autoflash.flash_attn_func(q, k, v, causal=True),
    "attention s128": lambda: autoflash.attention(qs, ks, vs, is_causal=True),
    "sdpa s128": lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True),
}
for name, fn in cases.items():
    try:
        w = wall_us(fn)
        kt, nk, names = kernel_us(fn)
        print(f"{name:28s} wall {w:8.1f} us/call   kernels {kt:7.1f} us/call ({nk:.1f} launches: {names})", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"{name:28s} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)

for name in ("decode dense split auto", "flash_attn_func s128"):
    fn = cases[name]
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(N):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(30)
        print(f"--- cProfile {name}, {N} calls, by {key}\n" + s.getvalue()[:9000], flush=True)
