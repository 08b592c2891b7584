"""References for flash_attn_with_kvcache: rotary embeddings, the in-place append of new keys and
values into a dense or paged cache, and attention over each batch row's cached keys, written
sequence by sequence from flash-attn's definitions (no kernel, no batching tricks)."""
from __future__ import annotations

import torch

from autoflash.reference.forward import attention_ref


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions, interleaved: bool) -> torch.Tensor:
    """x (batch, seqlen, heads, d) with rotary embeddings on its first r = 2 * cos.shape[1] dims, row
    i of batch b at position positions[b][i], pair by pair: pair j is dims (2j, 2j + 1) interleaved
    (GPT-J), (j, j + r / 2) otherwise (GPT-NeoX), rotated by angle j of that position:
    (x0 cos - x1 sin, x0 sin + x1 cos), in fp32, rounded once to x's dtype."""
    out = x.clone()
    half = cos.shape[1]
    for b in range(x.shape[0]):
        for i in range(x.shape[1]):
            p = int(positions[b][i])
            for j in range(half):
                a, e = (2 * j, 2 * j + 1) if interleaved else (j, j + half)
                c, s = cos[p, j].float(), sin[p, j].float()
                x0, x1 = x[b, i, :, a].float(), x[b, i, :, e].float()
                out[b, i, :, a] = (x0 * c - x1 * s).to(x.dtype)
                out[b, i, :, e] = (x0 * s + x1 * c).to(x.dtype)
    return out


def cache_rows(cache: torch.Tensor, batch: int, start: int, stop: int, block_table=None,
               cache_batch_idx=None) -> torch.Tensor:
    """Rows [start, stop) of sequence `batch` as (stop - start, heads_kv, d): a dense cache's row or,
    paged, the pages of a block-table row in its order (cache_batch_idx picks either row)."""
    row = int(cache_batch_idx[batch]) if cache_batch_idx is not None else batch
    if block_table is None:
        return cache[row, start:stop]
    page = cache.shape[1]
    return torch.cat([cache[int(block_table[row, p // page]), p % page].unsqueeze(0)
                      for p in range(start, stop)]) if stop > start else cache[0, :0]


def append_ref(cache: torch.Tensor, new: torch.Tensor, cache_seqlens: list[int], block_table=None,
               cache_batch_idx=None) -> None:
    """Writes new[b, i] into sequence b's row cache_seqlens[b] + i, one row at a time."""
    page = cache.shape[1]
    for b in range(new.shape[0]):
        row = int(cache_batch_idx[b]) if cache_batch_idx is not None else b  # a cache or block-table row
        for i in range(new.shape[1]):
            p = cache_seqlens[b] + i
            if block_table is None:
                cache[row, p] = new[b, i]
            else:
                cache[int(block_table[row, p // page]), p % page] = new[b, i]


def attention_kvcache_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqused: list[int], *,
                          cache_leftpad: list[int] | None = None, block_table=None, cache_batch_idx=None,
                          causal: bool = False, scale: float | None = None, window=(-1, -1), softcap: float = 0.0,
                          alibi_slopes: torch.Tensor | None = None, key_bias: torch.Tensor | None = None,
                          upcast: bool = True, attention_chunk: int = 0, cu_seqlens_q: list[int] | None = None,
                          qv: torch.Tensor | None = None, seqused_q: list[int] | None = None):
    """Attention of q (batch, seqlen_q, heads, d) over sequence b's cache rows [leftpad[b],
    seqused[b]), bottom-right aligned (flash-attn's), batch row by batch row. Returns out (batch,
    seqlen_q, heads, d) in the compute dtype and lse (batch, heads, seqlen_q); a row that sees no key
    gets out 0 and lse +inf. key_bias (batch, >= max seqused) fp32 is added to sequence b's key j,
    counted from its first key; attention_chunk counts chunks from it too. v_cache's head dim (out's)
    may differ from q's and k_cache's. cu_seqlens_q: q packed as
    (total_q, heads, d), sequence b its rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1; out is then
    (total_q, heads, d) and lse (heads, total_q). qv (q's rows, v_cache's head dim; FlashAttention-3's):
    the scores q . k + qv . v, one product of [q, qv] with [k, v] here (scale by default 1/sqrt(d + dv)).
    seqused_q (with cu_seqlens_q; FlashAttention-3's): only the first seqused_q[b] rows of sequence b's
    span are queries, aligned as such; the rest get out 0 and lse +inf."""
    outs, lses = [], []
    for b in range(len(seqused)):
        start = cache_leftpad[b] if cache_leftpad is not None else 0
        k = cache_rows(k_cache, b, start, seqused[b], block_table, cache_batch_idx)
        v = cache_rows(v_cache, b, start, seqused[b], block_table, cache_batch_idx)
        end = None if cu_seqlens_q is None else \
            cu_seqlens_q[b + 1] if seqused_q is None else cu_seqlens_q[b] + seqused_q[b]
        rows = lambda x: x[cu_seqlens_q[b]:end].unsqueeze(0) if cu_seqlens_q is not None \
            else x[b:b + 1]  # noqa: E731
        qb = rows(q).transpose(1, 2)
        keys = k if qv is None else torch.cat([k, v], -1)  # qv: the scores over [k, v]
        if qv is not None:
            qb = torch.cat([qb, rows(qv).transpose(1, 2)], -1)
        if k.shape[0] == 0 or qb.shape[2] == 0:  # no key (or, packed, no query) in this sequence
            dtype = torch.float64 if q.dtype == torch.float64 else torch.float32 if upcast else q.dtype
            outs.append(torch.zeros((*qb.shape[:3], v_cache.shape[-1]), dtype=dtype))
            lses.append(torch.full(qb.shape[:3], float("inf"), dtype=torch.float32))
            continue
        slopes = alibi_slopes[b:b + 1] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        bias = key_bias[b:b + 1, :k.shape[0]] if key_bias is not None else None
        o, lse = attention_ref(qb, keys.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2), causal=causal,
                               scale=scale, upcast=upcast, align="bottom_right", window=window, softcap=softcap,
                               alibi_slopes=slopes, key_bias=bias, attention_chunk=attention_chunk)
        outs.append(o)
        lses.append(lse.float())
    if seqused_q is not None:  # the unused rows of each span: out 0, lse +inf
        for b in range(len(seqused)):
            unused = cu_seqlens_q[b + 1] - cu_seqlens_q[b] - seqused_q[b]
            o, lse = outs[b], lses[b]
            outs[b] = torch.cat([o, o.new_zeros((*o.shape[:2], unused, o.shape[3]))], 2)
            lses[b] = torch.cat([lse, lse.new_full((*lse.shape[:2], unused), float("inf"))], 2)
    if cu_seqlens_q is not None:
        return torch.cat(outs, dim=2)[0].transpose(0, 1), torch.cat(lses, dim=2)[0]
    return torch.cat(outs).transpose(1, 2), torch.cat(lses)
