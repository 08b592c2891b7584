"""`python -m autoflash.selfcheck --kvcache`: flash_attn_with_kvcache once (the decode kernels, and
the combine kernel when split) against the references: out under FlashAttention-3's rule, the cache
after the append bit-equal to a reference append. Inputs carry guard bands when sanitizing. With
--key-padding a key bias masks a random run of each sequence's keys (autoflash.hf's padding masks,
through the same op)."""
from __future__ import annotations


def check_kvcache(args, shape, dtype, causal) -> list[tuple[str, bool, float, float]]:
    import random

    import torch

    from autoflash.dispatch.kvcache import flash_attn_with_kvcache, flash_kvcache
    from autoflash.emulation.guards import guarded_randn
    from autoflash.kernels.checks import TORCH_DTYPES
    from autoflash.reference.forward import within_tolerance
    from autoflash.reference.kvcache import append_ref, attention_kvcache_ref, rotary

    b, hq, hkv, lq, capacity, d = shape
    dt = TORCH_DTYPES[dtype]
    device = "cpu" if args.emulate else "cuda"
    g = torch.Generator().manual_seed(args.seed)
    rng = random.Random(args.seed)
    dv = args.head_dim_v

    def flash_layout(n, h, length, width=d):  # (n, length, h, width) with guard bands after rows and sequences
        return guarded_randn(n, h, length, width, dt, g, layout="bshd").transpose(1, 2).to(device)

    q = flash_layout(b, hq, lq)
    new = args.new
    block_table = batch_idx = leftpad = None
    rows = b + 2 if args.batch_idx else b  # cache rows, or block-table rows when paged
    if args.paged:
        per_seq = -(-capacity // args.paged)
        pages = rows * per_seq + 1
        k_cache, v_cache = flash_layout(pages, hkv, args.paged), flash_layout(pages, hkv, args.paged, dv)
        block_table = torch.randperm(pages, generator=g)[:rows * per_seq].reshape(rows, per_seq).to(torch.int32)
        capacity = per_seq * args.paged
    else:
        k_cache, v_cache = flash_layout(rows, hkv, capacity), flash_layout(rows, hkv, capacity, dv)
    if args.batch_idx:
        batch_idx = torch.randperm(rows, generator=g)[:b].to(torch.int32)
    if new > capacity:
        raise ValueError(f"--new: got {new}, expected at most the cache's {capacity} rows")
    seqlens = [rng.randint(0, capacity - new) for _ in range(b)]
    if b > 1:  # an empty cache among them
        seqlens[rng.randrange(b)] = 0
    if args.leftpad:
        leftpad = torch.tensor([rng.randint(0, n) for n in seqlens], dtype=torch.int32)
    k = v = cos = sin = None
    if new:
        k, v = flash_layout(b, hkv, new), flash_layout(b, hkv, new, dv)
    interleaved = args.rotary == "interleaved"
    if args.rotary != "none":
        cos, sin = (torch.randn(capacity, d // 32 * 8, generator=g).to(device, dt) for _ in range(2))
    kw = dict(causal=causal, window_size=args.window, softcap=args.softcap, attention_chunk=args.attention_chunk)
    if args.alibi:
        kw["alibi_slopes"] = (torch.rand(b, hq, generator=g) * 0.3).to(device)
    key_bias = None
    if args.key_padding:  # sequence i masks its keys [start, stop) (counted from its first key)
        key_bias = torch.zeros(b, capacity)
        for i in range(b):
            start = rng.randint(0, capacity)
            key_bias[i, start:rng.randint(start, capacity)] = float("-inf")

    # the reference: rotary, append, attention (fp32 and in the input dtype), on copies
    k_ref, v_ref = k_cache.detach().cpu().clone(), v_cache.detach().cpu().clone()
    starts = seqlens  # rotary positions are cache rows, left padding or not (flash-attn's rule)
    q_ref, k_new = q.cpu(), k.cpu() if k is not None else None
    if cos is not None:  # --rotary goes with --new (flash-attn's rule)
        moving = causal or tuple(args.window) != (-1, -1) or args.attention_chunk > 0
        q_ref = rotary(q_ref, cos.cpu(), sin.cpu(), [[s + i * moving for i in range(lq)] for s in starts], interleaved)
        k_new = rotary(k_new, cos.cpu(), sin.cpu(), [[s + i for i in range(new)] for s in starts], interleaved)
    if new:
        append_ref(k_ref, k_new, seqlens, block_table, batch_idx)
        append_ref(v_ref, v.cpu(), seqlens, block_table, batch_idx)
    used = [n + new for n in seqlens]
    ref_kw = dict(cache_leftpad=leftpad.tolist() if leftpad is not None else None, block_table=block_table,
                  cache_batch_idx=batch_idx, causal=causal, window=tuple(args.window), softcap=args.softcap,
                  alibi_slopes=kw["alibi_slopes"].cpu() if args.alibi else None, key_bias=key_bias,
                  attention_chunk=args.attention_chunk)
    ref_out, _ = attention_kvcache_ref(q_ref.float(), k_ref.float(), v_ref.float(), used, **ref_kw)
    torch_out, _ = attention_kvcache_ref(q_ref, k_ref, v_ref, used, upcast=False, **ref_kw)

    index = (torch.tensor(seqlens, dtype=torch.int32, device=device),
             None if batch_idx is None else batch_idx.to(device), None if leftpad is None else leftpad.to(device),
             None if block_table is None else block_table.to(device))
    if key_bias is None:
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, *index, rotary_interleaved=interleaved,
                                      num_splits=args.splits, **kw)
    else:  # the op under flash_attn_with_kvcache, which also takes a key bias
        out, _ = flash_kvcache(q, k_cache, v_cache, k, v, cos, sin, None, index[0], 0, *index[1:], None, None, None,
                               kw.get("alibi_slopes"), key_bias.to(device), None, causal, *args.window,
                               args.attention_chunk, args.softcap, interleaved, args.splits)
    if device == "cuda":
        torch.cuda.synchronize()
    same = torch.equal(k_cache.cpu(), k_ref) and torch.equal(v_cache.cpu(), v_ref)
    return [("out", *within_tolerance(out.cpu().transpose(1, 2), ref_out.transpose(1, 2), torch_out.transpose(1, 2),
                                      softcap=args.softcap)),
            ("kv", same, 0.0 if same else 1.0, 0.0)]
