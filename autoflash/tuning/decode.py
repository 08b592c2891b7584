"""Decode (KV-cache) problem keys' buckets and workloads: what flash_attn_with_kvcache calls are
grouped under one tuned entry, and the calls the tuner times for each. A decode key is a ProblemKey
with variant "decode" (problem.py); its knobs and space are space.py's DECODE_KNOBS.

Buckets, each with the lengths or batches a key is timed at:
- queries per step (seqlen_q): "q1" (one token: plain decoding, run non-causal) and "q2-16" (a few:
  speculative verification or chunked appends, run causal bottom-right), timed at 1 and 8;
- cache length (keys a sequence holds, the call's capacity): "le4k", "le32k", "gt32k", each timed
  at two lengths so that a winner is not tuned to one size (128k: Llama 3.1's context);
- batch: "b1-4" (too few (batch, kv-head) blocks to fill the SMs: splitting the keys pays most),
  "b5-32", "gt32" (the SMs full without splits);
- dense or paged: paged keys are timed with pages of PAGE_SIZE = 256 rows (FlashAttention-2's
  mha_fwd_kvcache requires page sizes divisible by 256, csrc/flash_attn/flash_api.cpp), so a paged
  key's key tiles divide 256; a call with other pages takes the tuned config only where they do.

Heads follow Llama 3 8B (32 query heads, 8 K/V heads at d = 128): DECODE_HIDDEN / head_dim query
heads in groups of DECODE_GROUP per K/V head, so every head dim reads the same K/V bytes a token."""
from __future__ import annotations

import dataclasses
import math

# (label, largest value in the bucket or None, values timed)
Q_BUCKETS: tuple[tuple[str, int | None, tuple[int, ...]], ...] = (
    ("q1", 1, (1,)),
    ("q2-16", 16, (8,)),
)
CACHE_BUCKETS: tuple[tuple[str, int | None, tuple[int, ...]], ...] = (
    ("le4k", 4096, (1024, 4096)),
    ("le32k", 32768, (8192, 32768)),
    ("gt32k", None, (65536, 131072)),
)
BATCH_BUCKETS: tuple[tuple[str, int | None, tuple[int, ...]], ...] = (
    ("b1-4", 4, (1, 4)),
    ("b5-32", 32, (16,)),
    ("gt32", None, (64,)),
)
Q_LABELS = tuple(label for label, _, _ in Q_BUCKETS)
CACHE_LABELS = tuple(label for label, _, _ in CACHE_BUCKETS)
BATCH_LABELS = tuple(label for label, _, _ in BATCH_BUCKETS)
Q_MAX = Q_BUCKETS[-1][1]  # longer query chunks are prefill: they have no decode key
PAGE_SIZE = 256
DECODE_HIDDEN, DECODE_GROUP = 4096, 4  # Llama 3 8B: 32 x 128 query heads, 8 K/V heads
# Shapes whose K + V exceed this are not timed (64 sequences of 128k keys would be 32 GiB); a key
# keeps at least its smallest shape. 16 GiB leaves room on an 80 GB part for the rest of the run.
KV_BYTES_MAX = 16 * 2**30
DECODE_SEED = 0  # page order of paged workloads: a permutation seeded from this


def _bucket(name: str, buckets, value) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: got {value!r}, expected a positive int")
    for label, upper, _ in buckets:
        if upper is None or value <= upper:
            return label
    return None


def q_bucket(seqlen_q: int) -> str | None:
    """"q1" or "q2-16"; None above Q_MAX queries (no decode key: the prefill kernels' regime)."""
    return _bucket("q_bucket", Q_BUCKETS, seqlen_q)


def cache_bucket(cache_len: int) -> str:
    """"le4k" (<= 4096), "le32k" (<= 32768) or "gt32k"."""
    return _bucket("cache_bucket", CACHE_BUCKETS, cache_len)


def batch_bucket(batch: int) -> str:
    """"b1-4", "b5-32" or "gt32"."""
    return _bucket("batch_bucket", BATCH_BUCKETS, batch)


def _values(buckets, label: str) -> tuple[int, ...]:
    return next(values for name, _, values in buckets if name == label)


def heads_for(head_dim: int) -> tuple[int, int]:
    """(query heads, K/V heads) of the timed calls at this head dim."""
    heads_kv = max(1, DECODE_HIDDEN // head_dim // DECODE_GROUP)
    return heads_kv * DECODE_GROUP, heads_kv


@dataclasses.dataclass(frozen=True)
class DecodeWorkload:
    """One timed flash_decode call: q (batch, seqlen_q, heads, d) over full caches of cache_len keys
    a sequence (cache_seqlens = cache_len), dense or in pages of page_size rows; causal bottom-right."""

    batch: int
    seqlen_q: int
    heads: int
    heads_kv: int
    head_dim: int
    cache_len: int
    page_size: int | None
    causal: bool

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V the call must read (16-bit elements): the figure of merit's numerator."""
        return 2 * self.batch * self.cache_len * self.heads_kv * self.head_dim * 2

    @property
    def pages_per_seq(self) -> int:
        return math.ceil(self.cache_len / self.page_size) if self.page_size else 0

    def flops(self) -> float:
        """FlashAttention's count, 4 * batch * heads * Lq * Lk * d (the causal triangle of a few
        queries over many keys masks next to nothing, so it is not halved)."""
        return 4.0 * self.batch * self.heads * self.seqlen_q * self.cache_len * self.head_dim


def decode_shapes(q_label: str, cache_label: str, batch_label: str, head_dim: int) -> tuple[tuple[int, int, int, int], ...]:
    """(batch, heads, cache_len, head_dim) of each timed call, batches x cache lengths of the buckets,
    leaving out those over KV_BYTES_MAX (keeping the smallest)."""
    heads, heads_kv = heads_for(head_dim)
    shapes = [(b, heads, n, head_dim) for n in _values(CACHE_BUCKETS, cache_label)
              for b in _values(BATCH_BUCKETS, batch_label)]
    fits = [s for s in shapes if 2 * s[0] * s[2] * heads_kv * head_dim * 2 <= KV_BYTES_MAX]
    return tuple(fits or shapes[:1])


def decode_workload(q_label: str, paged: bool, batch: int, cache_len: int, head_dim: int) -> DecodeWorkload:
    heads, heads_kv = heads_for(head_dim)
    seqlen_q = _values(Q_BUCKETS, q_label)[0]
    return DecodeWorkload(batch, seqlen_q, heads, heads_kv, head_dim, cache_len, PAGE_SIZE if paged else None,
                          seqlen_q > 1)
