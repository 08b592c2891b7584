"""A decode key's measurement on the GPU, for cuda_backend.CudaBackend (`backend`: its torch, device,
L2 flush buffer and `_decode` input cache). A point (a KV-cache config and num_splits) runs through
kernels.decode.flash_decode on full random caches (tuning/decode.py's workloads; paged ones in pages
the block table lists in a seeded random order), after a check against attention_kvcache_ref on a
small cache of ragged lengths. The baseline is SDPA on the same queries over the same keys
(enable_gqa, SDPA's own backend choice: its flash backend takes no mask, and q2-16 keys need the
bottom-right causal one); the table's "sdpa_flash_ms" holds that time for decode keys."""
from __future__ import annotations

from autoflash.tuning.problem import ProblemKey, Shape

# The check: two sequences of a 512-key cache (two pages of 256 when paged) holding 300 and 417 keys
# (no multiple of a tile), four query heads per K/V head, the key's queries per step.
CHECK_DECODE_LENGTHS, CHECK_DECODE_CAPACITY, CHECK_DECODE_HEADS = (300, 417), 512, (8, 2)


def decode_tensors(backend, key: ProblemKey, w) -> dict:
    """q, the caches (dense, or pages with a block table in a seeded random page order) and the
    dense (batch, heads_kv, length, d) views SDPA reads, of one DecodeWorkload. Kept while they
    and the others kept stay within 1.5 x decode.KV_BYTES_MAX; else the others are dropped first."""
    from autoflash.kernels.checks import TORCH_DTYPES
    from autoflash.tuning.decode import DECODE_SEED, KV_BYTES_MAX

    torch = backend.torch
    cache_key = (key.dtype, w)
    if cache_key not in backend._decode:
        if sum(k[1].kv_bytes for k in backend._decode) + w.kv_bytes > 1.5 * KV_BYTES_MAX:
            backend._decode.clear()
            torch.cuda.empty_cache()
        dt = TORCH_DTYPES[key.dtype]
        gen = torch.Generator(device=backend.device).manual_seed(0)
        q = torch.randn(w.batch, w.seqlen_q, w.heads, w.head_dim, device=backend.device, dtype=dt, generator=gen)
        kv = torch.randn(2, w.batch, w.cache_len, w.heads_kv, w.head_dim, device=backend.device, dtype=dt,
                         generator=gen)
        t = {"q": q, "k_cache": kv[0], "v_cache": kv[1], "block_table": None,
             "k_dense": kv[0].transpose(1, 2), "v_dense": kv[1].transpose(1, 2)}
        if w.page_size:  # the same memory as pages; the table visits them out of order, as a real one does
            pages = w.batch * w.pages_per_seq
            shape = (pages, w.page_size, w.heads_kv, w.head_dim)
            t["k_cache"], t["v_cache"] = kv[0].reshape(shape), kv[1].reshape(shape)
            order = torch.randperm(pages, generator=torch.Generator().manual_seed(DECODE_SEED))
            t["block_table"] = order.to(torch.int32).reshape(w.batch, w.pages_per_seq).to(backend.device)
        backend._decode[cache_key] = t
    return backend._decode[cache_key]


def _call(point, w, t: dict):
    from autoflash.kernels.decode import flash_decode

    return lambda: flash_decode(t["q"], t["k_cache"], t["v_cache"], w.cache_len, block_table=t["block_table"],
                                causal=w.causal, num_splits=point.num_splits, config=point.config)


def check_decode(backend, key: ProblemKey, point) -> dict | None:
    """None when the point's out satisfies FlashAttention-3's rule against fp32
    attention_kvcache_ref on a small cache of ragged lengths, else a "wrong" result."""
    from autoflash.kernels.checks import TORCH_DTYPES
    from autoflash.kernels.decode import flash_decode
    from autoflash.reference.forward import within_tolerance
    from autoflash.reference.kvcache import attention_kvcache_ref
    from autoflash.tuning.decode import PAGE_SIZE, decode_workload

    torch, dt = backend.torch, TORCH_DTYPES[key.dtype]
    w = decode_workload(key.q_bucket, key.paged, len(CHECK_DECODE_LENGTHS), CHECK_DECODE_CAPACITY, key.head_dim)
    heads, heads_kv = CHECK_DECODE_HEADS
    gen = torch.Generator(device=backend.device).manual_seed(1)
    q = torch.randn(w.batch, w.seqlen_q, heads, w.head_dim, device=backend.device, dtype=dt, generator=gen)
    k, v = (torch.randn(w.batch, w.cache_len, heads_kv, w.head_dim, device=backend.device, dtype=dt, generator=gen)
            for _ in range(2))
    table = None
    if key.paged:
        per = w.cache_len // PAGE_SIZE
        k, v = (x.reshape(w.batch * per, PAGE_SIZE, heads_kv, w.head_dim) for x in (k, v))
        table = torch.arange(w.batch * per, dtype=torch.int32).flip(0).reshape(w.batch, per).to(backend.device)
    lengths = torch.tensor(CHECK_DECODE_LENGTHS, dtype=torch.int32, device=backend.device)
    got, _ = flash_decode(q, k, v, lengths, block_table=table, causal=w.causal, num_splits=point.num_splits,
                          config=point.config)
    kw = dict(block_table=None if table is None else table.cpu(), causal=w.causal)
    cpu = [x.cpu() for x in (q, k, v)]
    ref, _ = attention_kvcache_ref(*(x.float() for x in cpu), list(CHECK_DECODE_LENGTHS), **kw)
    low, _ = attention_kvcache_ref(*cpu, list(CHECK_DECODE_LENGTHS), upcast=False, **kw)
    ok, err, bound = within_tolerance(got.cpu(), ref, low)
    if ok:
        return None
    return {"status": "wrong", "err": err, "bound": bound,
            "reason": f"out: max error {err:.4g} > bound {bound:.4g} (FlashAttention-3's rule) on "
                      f"caches of {list(CHECK_DECODE_LENGTHS)} keys{' paged' if key.paged else ''}, "
                      f"seqlen_q {w.seqlen_q}, heads {heads}/{heads_kv}, num_splits {point.num_splits}"}


def measure_decode(backend, key: ProblemKey, point, shapes: list[Shape], reps: int, warmup: int) -> dict:
    from autoflash.bench.timing import time_cuda

    wrong = check_decode(backend, key, point)
    if wrong is not None:
        return wrong
    ms = []
    with backend.torch.no_grad():
        for s in shapes:
            w = key.decode_workload(s)
            ms.append(time_cuda(backend.torch, _call(point, w, decode_tensors(backend, key, w)), reps=reps,
                                warmup=warmup, flush=backend._flush)["ms_median"])
    return {"status": "ok", "ms": ms}


def baseline_decode(backend, key: ProblemKey, shapes: list[Shape], reps: int, warmup: int) -> dict:
    """SDPA on each workload's q over its full caches (bottom-right causal mask for q2-16)."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from autoflash.bench.timing import time_cuda

    torch, ms = backend.torch, []
    for s in shapes:
        w = key.decode_workload(s)
        t = decode_tensors(backend, key, w)
        qs = t["q"].transpose(1, 2)
        mask = None
        if w.causal:  # SDPA's is_causal is top-left; the queries are the cache's last positions
            mask = torch.ones(w.seqlen_q, w.cache_len, device=backend.device, dtype=torch.bool).tril(
                w.cache_len - w.seqlen_q)

        def fn(qs=qs, t=t, mask=mask):
            return sdpa(qs, t["k_dense"], t["v_dense"], attn_mask=mask, enable_gqa=True)
        try:
            with torch.no_grad():
                ms.append(time_cuda(torch, fn, reps=reps, warmup=warmup, flush=backend._flush)["ms_median"])
        except RuntimeError as e:  # e.g. out of memory for SDPA's workspace
            return {"status": "unsupported", "reason": str(e).strip().splitlines()[0]}
    return {"status": "ok", "ms": ms}
