"""The KV-cache (decode) launcher: flash_attn_with_kvcache's kernels. Queries (batch, seqlen_q, heads,
d) attend to a cache (batch_cache, seqlen_cache, heads_kv, d), or its pages (num_pages, page_size,
heads_kv, d) listed per batch by an int32 block table, each batch up to its own length. The forward
templates' kvcache switch runs it: the sm90 family's (templates/flash_fwd_sm90.cu.j2: K and V tiles by
TMA, or gathered by the producer warpgroup's cp.async where pages do not hold whole tiles; FA3's qv)
where it applies (an H100 or H200, 16-bit, head dims that are multiples of 16), else the sm80
family's (templates/flash_fwd.cu.j2); with split on, num_splits blocks share each query block's keys
and the config's _combine kernel merges their fp32 partials (templates/flash_combine.cu.j2).

The query heads that share a K/V head are folded into one block's rows (row r = query r / group of
head r % group), FlashAttention-2's seqlenq_ngroups_swapped generalised to any seqlen_q: each K/V
tile is then read once per (batch, kv-head, split) instead of once per query head."""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

from autoflash.kernels.checks import DTYPE_NAMES, GRID_YZ_MAX, check_chunked_layout, check_qv_shape, check_scale, \
    cu_seqlens_vector, int32_vector
from autoflash.kernels.config import HEAD_DIM_MAX, HEAD_DIM_MIN, HEAD_DIM_STEP, HEAD_DIM_V_MAX, KernelConfig
from autoflash.kernels.defaults import default_decode_config, sm90_applies
from autoflash.kernels.gpus import GpuProfile
from autoflash.kernels.variants import LOG2E, heads_view, resolve

MAX_SPLITS = 128  # FlashAttention-2's cap on num_splits (flash_api.cpp, set_params_splitkv)
PAGE_MULTIPLE = 16  # pages read tile by tile: multiples of the smallest key tile (others are gathered)
COMBINE_ROWS_PER_BLOCK = 4  # templates/flash_combine.cu.j2: one warp per row


@dataclasses.dataclass(frozen=True)
class CacheShape:
    """A checked KV-cache call's sizes: capacity is the keys one batch row may hold (seqlen_cache,
    or pages per sequence x page_size); page_size is None for a dense cache."""

    batch: int
    seqlen_q: int
    heads: int
    heads_kv: int
    head_dim: int
    capacity: int
    page_size: int | None
    seqlen_new: int  # rows of new k / v to append (0: none); packed_new: all sequences' together
    packed_q: bool = False  # q (total_q, heads, d) through cu_seqlens_q; seqlen_q is max_seqlen_q
    packed_new: bool = False  # k, v (total_new, heads_kv, d) through cu_seqlens_k_new
    leftpad: bool = False  # sequences start past their first row (cache_leftpad)
    head_dim_v: int | None = None  # V's (and out's) where it differs from head_dim (FlashAttention-3's headdim_v)

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def gathered(self) -> bool:
        """Whether a paged cache's key tiles can straddle pages (pages not of whole smallest key tiles,
        or tiles shifted by left padding): the kernel then gathers each row from its page."""
        return self.page_size is not None and (self.leftpad or self.page_size % PAGE_MULTIPLE != 0)

    @property
    def group(self) -> int:
        return self.heads // self.heads_kv


def _tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    return t


def check_kvcache(q, k_cache, v_cache, *, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                  cache_batch_idx=None, cache_leftpad=None, block_table=None, any_head_dim: bool = False,
                  rotary_seqlens=None, cu_seqlens_q=None, max_seqlen_q=None, cu_seqlens_k_new=None) -> CacheShape:
    """Metadata checks of a flash_attn_with_kvcache call (shapes, dtypes, devices, layouts: nothing
    that reads a value); raises ValueError / TypeError with what was got and what is accepted.
    The kernel's head dims only, unless `any_head_dim` (1..HEAD_DIM_MAX, V's 1..HEAD_DIM_V_MAX: the
    caller zero-pads). v_cache (and v) may have a head dim of their own (FlashAttention-3's
    headdim_v). cu_seqlens_q (with max_seqlen_q) packs q as (total_q, heads, head_dim),
    cu_seqlens_k_new packs the new k and v as (total_new, heads_kv, head_dim): FlashAttention-3's
    varlen KV-cache calls."""
    packed_q, packed_new = cu_seqlens_q is not None, cu_seqlens_k_new is not None
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _tensor(name, t)
        if name == "q" and packed_q:
            if t.dim() != 3:
                raise ValueError(f"q: got shape {tuple(t.shape)} with cu_seqlens_q, expected 3 dims (total_q, heads, "
                                 f"head_dim)")
        elif t.dim() != 4:
            raise ValueError(f"{name}: got shape {tuple(t.shape)}, expected 4 dims (batch, seqlen, heads, head_dim)"
                             + (" or, paged, (num_pages, page_size, heads_kv, head_dim)" if name != "q" else ""))
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q, k_cache, v_cache dtypes: got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}; expected one "
                        f"of float16, bfloat16 for all three")
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError(f"q, k_cache, v_cache devices: got {q.device}, {k_cache.device}, {v_cache.device}; "
                         f"expected one device")
    if packed_q:
        total_q, heads, d = q.shape
        batch = cu_seqlens_vector("cu_seqlens_q", cu_seqlens_q, q.device)
        if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 1:
            raise ValueError(f"max_seqlen_q: got {max_seqlen_q!r} with cu_seqlens_q, expected an int >= 1 (the longest "
                             f"sequence's queries)")
        seqlen_q = max_seqlen_q
    else:
        if max_seqlen_q is not None:
            raise ValueError(f"max_seqlen_q: got {max_seqlen_q!r} without cu_seqlens_q, expected None")
        batch, seqlen_q, heads, d = q.shape
        total_q = batch * seqlen_q
    if k_cache.shape[:-1] != v_cache.shape[:-1]:
        raise ValueError(f"k_cache and v_cache shapes: got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}; expected "
                         f"them equal but for the head dim (V's may differ: FlashAttention-3's headdim_v)")
    rows, length, heads_kv, dk = k_cache.shape
    dv = v_cache.shape[-1]
    if dk != d:
        raise ValueError(f"head_dim: got {d} in q and {dk} in k_cache; expected one head_dim")
    for name, width, most in (("head_dim", d, HEAD_DIM_MAX), ("v_cache's head dim", dv, HEAD_DIM_V_MAX)):
        if any_head_dim and not 1 <= width <= most:
            raise ValueError(f"{name}: got {width}, expected 1..{most}")
        if not any_head_dim and not (HEAD_DIM_MIN <= width <= most and width % HEAD_DIM_STEP == 0):
            raise ValueError(f"{name}: got {width}, expected a multiple of {HEAD_DIM_STEP} in [{HEAD_DIM_MIN}, {most}] "
                             f"(flash_attn_with_kvcache pads other head dims)")
    native = HEAD_DIM_MIN <= d and d % HEAD_DIM_STEP == 0 and HEAD_DIM_MIN <= dv and dv % HEAD_DIM_STEP == 0
    if min(batch, seqlen_q, total_q, heads, heads_kv, rows) == 0:
        raise ValueError(f"empty input: got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}; expected batch, "
                         f"seqlen_q, heads, heads_kv and cache rows >= 1")
    if heads % heads_kv:
        hint = (f"; k_cache {tuple(k_cache.shape)} reads as (batch, heads, seqlen, head_dim): pass "
                f"k_cache.transpose(1, 2) (and v_cache's)" if heads % length == 0 else "")
        raise ValueError(f"heads: got {heads} query heads (q {tuple(q.shape)}: batch, seqlen_q, heads, head_dim) and "
                         f"{heads_kv} kv heads (k_cache {tuple(k_cache.shape)}); expected kv heads dividing query "
                         f"heads, the caches laid out as flash-attn's: (batch, seqlen_cache, heads_kv, head_dim), "
                         f"or (num_blocks, page_size, heads_kv, head_dim) with a block_table{hint}")
    if batch > GRID_YZ_MAX or heads > GRID_YZ_MAX:
        raise ValueError(f"q {tuple(q.shape)}: expected batch and heads <= {GRID_YZ_MAX}")
    if native and not torch.compiler.is_compiling():  # data pointers exist at run time only: the op checks again
        # q is copied where needed (flash_attn_with_kvcache); the caches are written in place (a padded
        # head dim's are copied).
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_chunked_layout(name, t)

    page_size = None
    if block_table is not None:
        _tensor("block_table", block_table)
        # Its rows are the sequences', or with cache_batch_idx the ones it picks (FlashAttention-3's).
        table_rows = "table_rows" if cache_batch_idx is not None else str(batch)
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[1] == 0 \
                or (cache_batch_idx is None and block_table.shape[0] != batch) or block_table.shape[0] == 0 \
                or block_table.device != q.device or block_table.stride(1) != 1:
            raise ValueError(f"block_table: got {tuple(block_table.shape)} {block_table.dtype} on {block_table.device}; "
                             f"expected int32 of shape ({table_rows}, pages_per_sequence >= 1) on {q.device}, rows "
                             f"contiguous")
        if cache_batch_idx is not None:
            int32_vector("cache_batch_idx", cache_batch_idx, batch, q.device, ": the block-table row of each sequence")
        page_size, capacity = length, block_table.shape[1] * length
    else:
        capacity = length
        if cache_batch_idx is None and rows != batch:
            raise ValueError(f"k_cache: got {rows} cache rows for batch {batch}; expected {batch}, or "
                             f"cache_batch_idx to pick rows")
        if cache_batch_idx is not None:
            int32_vector("cache_batch_idx", cache_batch_idx, batch, q.device)
    if cache_leftpad is not None:
        int32_vector("cache_leftpad", cache_leftpad, batch, q.device)
    if rotary_seqlens is not None:  # FlashAttention-3's: it only moves the rotary positions (nothing without rotary_cos)
        int32_vector("rotary_seqlens", rotary_seqlens, batch, q.device, ": where each sequence's rotary starts")
    if cache_seqlens is None or isinstance(cache_seqlens, bool):
        raise TypeError(f"cache_seqlens: got {cache_seqlens!r}, expected an int or an int32 tensor ({batch},)")
    if isinstance(cache_seqlens, int):
        if cache_seqlens < 0:
            raise ValueError(f"cache_seqlens: got {cache_seqlens}, expected >= 0")
    else:
        int32_vector("cache_seqlens", cache_seqlens, batch, q.device)

    seqlen_new = 0
    if (k is None) != (v is None):
        raise ValueError("k, v: got one of them; expected both (new keys and values to append) or neither")
    if packed_new and k is None:
        raise ValueError("cu_seqlens_k_new: got a tensor without k, v; expected None (it packs the new keys)")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            _tensor(name, t)
            lead = t.shape[:1] if packed_new else t.shape[:2]
            width = d if name == "k" else dv
            if t.dim() != len(lead) + 2 or (not packed_new and t.shape[0] != batch) or t.shape[len(lead):] != \
                    (heads_kv, width) or t.dtype != q.dtype or t.device != q.device:
                want = "total_new" if packed_new else f"{batch}, seqlen_new"
                raise ValueError(f"{name}: got {tuple(t.shape)} {t.dtype} on {t.device}; expected ({want}, {heads_kv}, "
                                 f"{width}) {q.dtype} on {q.device}")
        if k.shape[:-1] != v.shape[:-1]:
            raise ValueError(f"k and v shapes: got {tuple(k.shape)} and {tuple(v.shape)}; expected them equal but for "
                             f"the head dim")
        if packed_new and cu_seqlens_vector("cu_seqlens_k_new", cu_seqlens_k_new, q.device) != batch:
            raise ValueError(f"cu_seqlens_k_new: got {cu_seqlens_k_new.numel()} entries, expected batch + 1 = "
                             f"{batch + 1}")
        seqlen_new = k.shape[0] if packed_new else k.shape[1]
        if isinstance(cache_seqlens, int) and not packed_new and cache_seqlens + seqlen_new > capacity:
            raise ValueError(f"cache_seqlens: got {cache_seqlens} with {seqlen_new} new keys; the cache holds "
                             f"{capacity} per sequence (expected cache_seqlens + seqlen_new <= {capacity})")
    elif isinstance(cache_seqlens, int) and cache_seqlens > capacity:
        raise ValueError(f"cache_seqlens: got {cache_seqlens}; the cache holds {capacity} per sequence (expected "
                         f"<= {capacity})")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos, rotary_sin: got one of them; expected both or neither")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos, rotary_sin: got them without k, v; rotary embeddings go onto the new keys "
                             "as they are appended (and onto q then), as in flash-attn: expected k and v too")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            _tensor(name, t)
            if t.dim() != 2 or t.dtype != q.dtype or t.device != q.device:
                raise ValueError(f"{name}: got {tuple(t.shape)} {t.dtype} on {t.device}; expected (seqlen_ro, "
                                 f"rotary_dim / 2) {q.dtype} on {q.device}")
        if rotary_cos.shape != rotary_sin.shape:
            raise ValueError(f"rotary_cos and rotary_sin shapes differ: got {tuple(rotary_cos.shape)} and "
                             f"{tuple(rotary_sin.shape)}")
        rotary_dim = 2 * rotary_cos.shape[1]
        if rotary_dim == 0 or rotary_dim > d or rotary_dim % 16:
            raise ValueError(f"rotary dims: got rotary_cos {tuple(rotary_cos.shape)}, rotary_dim {rotary_dim}; "
                             f"expected an even rotary_dim = 2 * rotary_cos.shape[1], a multiple of 16 (flash-attn's "
                             f"rule) and <= head_dim {d}")
        if rotary_cos.shape[0] < capacity:
            raise ValueError(f"rotary_cos: got {rotary_cos.shape[0]} positions; expected at least the cache's "
                             f"{capacity} (seqlen_ro >= seqlen_cache)")
    return CacheShape(batch, seqlen_q, heads, heads_kv, d, capacity, page_size, seqlen_new, packed_q, packed_new,
                      cache_leftpad is not None, dv if dv != d else None)


def choose_num_splits(blocks: int, sm_count: int, key_tiles: int, max_splits: int = MAX_SPLITS,
                      per_sm: int = 2) -> int:
    """Splits of the key range for `blocks` query blocks x (batch, head) pairs on `sm_count` SMs:
    FlashAttention-2's num_splits_heuristic (csrc/flash_attn/flash_api.cpp, set_params_splitkv),
    which counts two 128-thread blocks per SM (slots = per_sm x SMs, 2 since v2.5.7; the sm90
    family's blocks hold an SM each, 1 as FlashAttention-3 counts them). No split once the
    blocks fill 80% of the slots; otherwise the fewest splits whose wave efficiency (n_waves /
    ceil(n_waves), n_waves = blocks * splits / slots) is within 85% of the best, skipping split
    counts that give the same tiles per split as one fewer."""
    slots = per_sm * sm_count
    if blocks >= 0.8 * slots:
        return 1
    max_splits = max(1, min(max_splits, slots, key_tiles))
    efficiency = {}
    for s in range(1, max_splits + 1):
        if s == 1 or math.ceil(key_tiles / s) != math.ceil(key_tiles / (s - 1)):  # eligible
            waves = blocks * s / slots
            efficiency[s] = waves / math.ceil(waves)
    best = max(efficiency.values())
    return next(s for s, e in efficiency.items() if e >= 0.85 * best)


def decode_config(shape: CacheShape, dtype: str, profile: GpuProfile, causal: bool, switches: dict,
                  config: KernelConfig | None, qv: bool = False) -> KernelConfig:
    """The kernel a call runs, unsplit: `config` (a tuned or explicit one) or the built-in one, with
    the call's variant switches (Variant.switches) and paging switches and kvcache on (and qv:
    FlashAttention-3's, the sm90 family's switch)."""
    if qv:
        check_qv(shape, dtype, profile)
    if config is None:
        heavy = any(switches[k] for k in ("window", "chunk", "softcap", "alibi", "key_bias"))
        config = default_decode_config(shape.head_dim, dtype, profile, None if shape.gathered else shape.page_size,
                                       heavy, shape.gathered, shape.head_dim_v, qv)
    elif not isinstance(config, KernelConfig):
        raise TypeError(f"config: got {type(config).__name__}, expected a KernelConfig")
    paged = shape.page_size is not None
    # Tiles that would straddle pages are gathered row by row (the gather switch).
    gather = shape.gathered or (paged and shape.page_size % config.block_n != 0)
    config = config.replace(causal=causal, **switches, kvcache=True, paged=paged, gather=gather, split=False, qv=qv)
    if (config.head_dim, config.dv, config.dtype, config.direction) != (shape.head_dim, shape.dv, dtype, "fwd"):
        raise ValueError(f"config {config.name}: expected a forward config for head_dim {shape.head_dim}, head_dim_v "
                         f"{shape.dv} {dtype}")
    config.check_fits(profile.smem_per_block_optin, profile.name)
    return config


def qv_applies(head_dim: int, head_dim_v: int, dtype: str, profile: GpuProfile) -> bool:
    """Whether the KV-cache kernel on `profile` takes FlashAttention-3's qv: the sm90 family's (its qv
    switch), for 16-bit inputs and head dims that are multiples of 16."""
    return sm90_applies(head_dim, dtype, profile) and head_dim_v % 16 == 0


def check_qv(shape: CacheShape, dtype: str, profile: GpuProfile) -> None:
    """ValueError unless the KV-cache kernel on `profile` takes FlashAttention-3's qv (qv_applies)."""
    if not qv_applies(shape.head_dim, shape.dv, dtype, profile):
        raise ValueError(f"qv: got it in a KV-cache call on {profile.name} ({dtype}, head dims {shape.head_dim} and "
                         f"{shape.dv}); qv in the KV cache runs on the sm90 family's kernel: expected an H100 or "
                         f"H200, fp16/bf16, head dims that are multiples of 16")


def packed_heads(shape: CacheShape, alibi_slopes) -> int:
    """Query heads folded into one K/V head's rows: the group, unless ALiBi needs each row's own head."""
    return shape.group if shape.group > 1 and alibi_slopes is None else 1


def decode_launch(shape: CacheShape, dtype: str, profile: GpuProfile, causal: bool, variant,
                  config: KernelConfig | None, num_splits: int, qpack: int,
                  qv: bool = False) -> tuple[KernelConfig, int]:
    """(the kernel, the number of key splits) a call launches: decode_config's kernel, split
    num_splits ways (0: choose_num_splits from the blocks and the SMs: head_split blocks share each
    query block's O where V's head dim is its own), at most MAX_SPLITS and the key tiles."""
    return _decode_launch(shape, dtype, profile, causal, tuple(variant.switches.items()), config, num_splits, qpack,
                          qv)


# A call's kernel and splits follow from its sizes and switches alone, so they are decided once per
# signature: on the first H200 run the decision (defaults, replace and validation of three configs)
# was a good part of the ~300 us of host time a decode step took beside 13-20 us of kernels.
@functools.lru_cache(maxsize=4096)
def _decode_launch(shape: CacheShape, dtype: str, profile: GpuProfile, causal: bool, switches: tuple,
                   config: KernelConfig | None, num_splits: int, qpack: int, qv: bool) -> tuple[KernelConfig, int]:
    config = decode_config(shape, dtype, profile, causal, dict(switches), config, qv)
    m_blocks = math.ceil(shape.seqlen_q * qpack / config.block_m) * config.head_split
    key_tiles = math.ceil(shape.capacity / config.block_n)
    if num_splits == 0:
        num_splits = choose_num_splits(shape.batch * (shape.heads // qpack) * m_blocks, profile.sm_count, key_tiles,
                                       per_sm=1 if config.family == "sm90" else 2)
    num_splits = max(1, min(num_splits, MAX_SPLITS, key_tiles))
    return config.replace(split=num_splits > 1), num_splits


def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens, *,
                 cache_batch_idx: torch.Tensor | None = None, cache_leftpad: torch.Tensor | None = None,
                 block_table: torch.Tensor | None = None, causal: bool = False, scale: float | None = None,
                 window=(-1, -1), softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                 key_bias: torch.Tensor | None = None, num_splits: int = 0, config: KernelConfig | None = None,
                 attention_chunk: int = 0, cu_seqlens_q: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                 qv: torch.Tensor | None = None, seqused_q: torch.Tensor | None = None):
    """Attention of q (batch, seqlen_q, heads, d) over a KV cache on CUDA tensors (CPU tensors inside
    autoflash.emulate(): the emulated kernels), flash-attn's layout. cache_seqlens (int or int32
    (batch,)): each batch's keys, rows [cache_leftpad[b], cache_seqlens[b]) of cache row
    cache_batch_idx[b] (or of the pages block_table[b] lists); their values are trusted
    (flash_attn_with_kvcache checks them). causal, window, attention_chunk (FlashAttention-3's chunks,
    counted from each sequence's first key) and ALiBi are bottom-right aligned.
    num_splits: 0 chooses (choose_num_splits), 1 runs unsplit, n > 1 splits the keys n ways (at most
    MAX_SPLITS and the key tiles). key_bias: fp32 (batch, capacity), added to the scores of each
    sequence's key j (counted from its first, left padding excluded; -inf masks it): a padding mask
    without reading its values (autoflash.hf). cu_seqlens_q (int32 (batch + 1,)) with max_seqlen_q packs
    the queries as (total_q, heads, d), sequence b's rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1
    (FlashAttention-3's varlen KV-cache call; values trusted). qv (q's rows by v_cache's head dim,
    FlashAttention-3's): the scores q . k + qv . v, scale by default 1/sqrt(d + dv), on the sm90 family's
    kernel (its qv switch: each V tile read once for both products). seqused_q (int32 (batch,), with
    cu_seqlens_q; FlashAttention-3's): only the first seqused_q[b] rows of sequence b's span are
    queries, aligned as such; the rest get out 0 and lse +inf. Returns (out like q, lse (batch, heads,
    seqlen_q) fp32; packed: (heads, total_q))."""
    from autoflash.kernels.launch import COMBINE_PARAMS, FWD_NAMES, FWD_PARAMS, SM90_FWD_NAMES, SM90_FWD_PARAMS, \
        _call, empty, empty_like, kernel_functions, profile_for, tile_maps

    shape = check_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
                          cache_leftpad=cache_leftpad, block_table=block_table, cu_seqlens_q=cu_seqlens_q,
                          max_seqlen_q=max_seqlen_q)
    check_chunked_layout("q", q)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: got {causal!r}, expected a bool")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits: got {num_splits!r}, expected an int >= 0 (0 chooses)")
    profile = profile_for(q, "flash_attn_with_kvcache")
    if qv is not None:
        check_qv_shape(qv, q, shape.dv, "v_cache")
        check_chunked_layout("qv", qv)
    dtype = DTYPE_NAMES[q.dtype]
    scale = check_scale(scale, shape.head_dim + (shape.dv if qv is not None else 0))
    packed = shape.packed_q
    b, lq, hq, d, dv = shape.batch, shape.seqlen_q, shape.heads, shape.head_dim, shape.dv
    hkv, g = shape.heads_kv, shape.group
    causal, variant = resolve(heads_view(q) if packed else q.transpose(1, 2), k_cache.transpose(1, 2), causal,
                              align="bottom_right", window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                              key_bias=key_bias, cache_len=shape.capacity, attention_chunk=attention_chunk,
                              cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, seqused_q=seqused_q)
    qpack = packed_heads(shape, alibi_slopes)
    heads, rows = hq // qpack, lq * qpack
    config, num_splits = decode_launch(shape, dtype, profile, causal, variant, config, num_splits, qpack,
                                       qv is not None)
    m_blocks = math.ceil(rows / config.block_m)

    # Packed queries are one batch row (1, total, heads, d), launched with no batch stride: sequence
    # b's rows start at cu_seqlens_q[b] (in rows of qpack folded heads: the kernel's cu_seqlens scaled).
    qb = q.unsqueeze(0) if packed else q  # (B, L, Hq, d)
    bb, ll = qb.shape[:2]
    qvb = None if qv is None else qv.unsqueeze(0) if packed else qv
    if qpack > 1:  # (B, L, Hkv * g, d) -> (B, Hkv, L * g, d): row i * g + j is query i of head kv * g + j
        q4 = qb.reshape(bb, ll, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(bb, hkv, ll * g, d)
        qv4 = None if qvb is None else \
            qvb.reshape(bb, ll, hkv, g, dv).permute(0, 2, 1, 3, 4).reshape(bb, hkv, ll * g, dv)
        o_shape = (*q4.shape[:3], dv)
        out4 = empty(o_shape[1:], q.dtype, q.device, "hld", name="out", rows="q").unsqueeze(0) if packed else \
            empty(o_shape, q.dtype, q.device, "bhld", name="out")
        variant = dataclasses.replace(variant, pointers=tuple(
            t * qpack if i < 4 and t is not None else t for i, t in enumerate(variant.pointers)))
    else:
        q4 = qb.transpose(1, 2)
        qv4 = None if qvb is None else qvb.transpose(1, 2)
        out = empty_like(q, "lhd" if packed else "blhd", name="out", rows="q" if packed else None, width=dv)
        out4 = (out.unsqueeze(0) if packed else out).transpose(1, 2)
    k4, v4 = k_cache.transpose(1, 2), v_cache.transpose(1, 2)  # pages: (num_pages, Hkv, page_size, d)
    lse4 = empty((heads, q4.shape[2]), torch.float32, q.device, "hl", name="lse", rows="q").unsqueeze(0) if packed \
        else empty((b, heads, rows), torch.float32, q.device, "bhl", name="lse")
    batch_strides = lambda t, dims=3: (0 if packed else t.stride(0), *t.stride()[1:dims])  # noqa: E731
    if variant.seqused:  # the rows past seqused_q are never written: no query there
        out4.zero_()
        lse4.fill_(math.inf)

    device = q.device
    # Index tensors the call does not have go as null pointers (the template's defaults: every
    # sequence max_seqlen_k = cache_seqlens keys, cache row b, no left padding): no tensor is made
    # for them, so none can be read before it is filled on another stream or outside a CUDA graph.
    seqused = None if isinstance(cache_seqlens, int) else cache_seqlens
    split = num_splits > 1
    # the kernels index the partials as contiguous: guarded after the last split only (emulation/guards.py)
    o_accum = empty((num_splits, b, heads, rows, dv), torch.float32, device, "sbhld", name="o_accum",
                           contiguous=True) if split else None
    lse_accum = empty((num_splits, b, heads, rows), torch.float32, device, "sbhl", name="lse_accum",
                             contiguous=True) if split else None

    fns = kernel_functions(config, profile, q)
    strides = lambda t: t.stride()[:3]  # noqa: E731 -- (batch or page, head, row)
    decode_pointers = (seqused, cache_batch_idx, cache_leftpad, block_table, o_accum, lse_accum)
    tail = (rows, cache_seqlens if seqused is None else shape.capacity, 1 if qpack > 1 else g, *variant.window,
            shape.page_size or 1, num_splits, qpack, scale * LOG2E, *variant.softcap_factors(scale))
    grid = (m_blocks * num_splits * config.head_split, heads, b)
    table_sb = block_table.stride(0) if block_table is not None else 0
    if config.family == "sm90":  # TMA maps of the (batch or page, head, row, d) views; packed O by plain stores
        maps = tile_maps(config, (q4, 64), (k4, config.block_n), (v4, config.block_n), (out4, 64),
                         (q4 if qv4 is None else qv4, 64))
        o_rows = (out4, out4.stride(2), out4.stride(1)) if packed else (None, 0, 0)
        scalars = (*o_rows[1:], *batch_strides(lse4, 2), variant.alibi_sb, variant.bias_sb, table_sb,
                   *strides(k4), *strides(v4), *tail)  # gathered pages: the caches' own rows
        _call(fns[config.name], grid, config.threads, config.smem_bytes, device, SM90_FWD_PARAMS,
              (o_rows[0], lse4, *variant.pointers, *decode_pointers, k_cache, v_cache), scalars, SM90_FWD_NAMES, maps)
    else:
        scalars = (*batch_strides(q4), *strides(k4), *strides(v4), *batch_strides(out4), *batch_strides(lse4, 2),
                   variant.alibi_sb, variant.bias_sb, table_sb, *tail)
        _call(fns[config.name], grid, config.threads, config.smem_bytes, device, FWD_PARAMS,
              (q4, k_cache, v_cache, out4, lse4, *variant.pointers, *decode_pointers), scalars, FWD_NAMES)
    if split:
        n_rows = b * heads * rows
        _call(fns[f"{config.name}_combine"], (math.ceil(n_rows / COMBINE_ROWS_PER_BLOCK), 1, 1),
              32 * COMBINE_ROWS_PER_BLOCK, 0, device, COMBINE_PARAMS,
              (o_accum, lse_accum, out4, lse4, variant.pointers[0], variant.pointers[2]),
              (*batch_strides(out4), *batch_strides(lse4, 2), b, heads, rows, num_splits),
              ("o_accum", "lse_accum", "out", "lse", "q_starts", "q_ends"))
    lse = lse4
    if qpack > 1:  # back to (B, L, Hq, d) and (B, Hq, L)
        out = out4.reshape(bb, hkv, ll, g, dv).permute(0, 2, 1, 3, 4).reshape(bb, ll, hq, dv)
        lse = lse4.reshape(bb, hkv, ll, g).permute(0, 1, 3, 2).reshape(bb, hq, ll)
        out = out[0] if packed else out
    return out, lse[0] if packed else lse
