"""flash-attn 2.x's `flash_attn_with_kvcache` on autoflash's decode kernels: the same arguments,
defaults, layouts and semantics. Inference only (no autograd, as in flash-attn).

One call: every argument is checked (metadata first, then the index tensors' values where they
can be read without a synchronisation: on CPU tensors, or on CUDA with AUTOFLASH_CHECK_VALUES=1;
a bad cache_seqlens or block table is then refused before the cache is touched); rotary
embeddings go onto q and the new k; the new k and v are written into the cache in place (dense
rows or pages); then the KV-cache kernel attends over each sequence's cached keys (split across
blocks when the batch alone would leave SMs idle). On CPU tensors outside autoflash.emulate() the
attention is the PyTorch reference instead (fp32, slow, for tests and code that must run anywhere).

The rotary embedding and the append run as PyTorch operations before the kernel, where flash-attn
fuses them into its kernel: the same results (the rotation in fp32, rounded once), a few more
launches per step.

No `from __future__ import annotations` here: torch.library reads the op's annotations as types.
"""
import dataclasses
from typing import Optional

import torch

from autoflash.dispatch.flash_api import Captured, _check_max_seqlen, _pad, _sequence_lengths, explaining_now, \
    padded_head_dim, padded_head_dim_v
from autoflash.dispatch.policy import REFERENCE, cpu_fallback, emulating, fall_back, is_strict
from autoflash.dispatch.variant_ops import _like
from autoflash.kernels.checks import check_qv_shape, check_scale, chunk_size, chunked, checks_values, \
    empty_like_width, window_pair
from autoflash.kernels.decode import CacheShape, check_kvcache
from autoflash.kernels.variants import heads_view, resolve

__all__ = ["flash_attn_with_kvcache"]


def _check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: got {value!r}, expected a bool")
    return value


def _check_values(shape: CacheShape, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, num_pages: int,
                  cache_rows: int, cu_seqlens_q=None, cu_seqlens_k_new=None, total_q: int = 0) -> None:
    """The index tensors' values, read once where checks_values allows (CPU tensors; on CUDA only
    with AUTOFLASH_CHECK_VALUES=1, a synchronisation per call; never under torch.compile or CUDA
    graph capture): lengths within the cache, the left padding within them, rows and pages that
    exist, packed rows' cumulative lengths. By default a CUDA call trusts them, as flash-attn does."""
    tensors = [t for t in (cache_seqlens, cache_batch_idx, cache_leftpad, block_table, cu_seqlens_q, cu_seqlens_k_new)
               if isinstance(t, torch.Tensor)]
    if not tensors or not checks_values(tensors[0].device):
        return
    device = tensors[0].device
    if cu_seqlens_q is not None:  # flash_attn_varlen_func's checks of the same arguments
        _check_max_seqlen("max_seqlen_q", shape.seqlen_q, _sequence_lengths("cu_seqlens_q", cu_seqlens_q, total_q, "q"),
                          "cu_seqlens_q")
    if cu_seqlens_k_new is not None:
        _sequence_lengths("cu_seqlens_k_new", cu_seqlens_k_new, shape.seqlen_new, "k and v")
    seqlens = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else \
        torch.full((shape.batch,), cache_seqlens, dtype=torch.int32, device=device)
    used = seqlens.long() + (cu_seqlens_k_new.diff().long() if cu_seqlens_k_new is not None else shape.seqlen_new)
    checks = {"seqlens": ((seqlens < 0) | (used > shape.capacity)).any()}
    if cache_leftpad is not None:
        checks["leftpad"] = ((cache_leftpad < 0) | (cache_leftpad > seqlens)).any()
    if block_table is not None:  # cache_batch_idx then picks block-table rows
        cache_rows = block_table.shape[0]
    if cache_batch_idx is not None:
        checks["batch_idx"] = ((cache_batch_idx < 0) | (cache_batch_idx >= cache_rows)).any()
    if block_table is not None:
        pages_used = (used + shape.page_size - 1) // shape.page_size
        table = block_table if cache_batch_idx is None else \
            block_table[cache_batch_idx.long().clamp(0, block_table.shape[0] - 1)]
        live = torch.arange(block_table.shape[1], device=device)[None, :] < pages_used[:, None]
        checks["block_table"] = (live & ((table < 0) | (table >= num_pages))).any()
    flags = dict(zip(checks, torch.stack(list(checks.values())).tolist()))
    if flags["seqlens"]:
        got = seqlens.tolist()
        new = "cu_seqlens_k_new's" if cu_seqlens_k_new is not None else shape.seqlen_new
        raise ValueError(f"cache_seqlens: got {got[:16]}{' ...' if len(got) > 16 else ''} with {new} new "
                         f"keys; expected 0 <= cache_seqlens and cache_seqlens + seqlen_new <= {shape.capacity} (the "
                         f"cache's rows per sequence)")
    if flags.get("leftpad"):
        raise ValueError(f"cache_leftpad: got {cache_leftpad.tolist()[:16]}; expected 0 <= cache_leftpad <= "
                         f"cache_seqlens ({seqlens.tolist()[:16]})")
    if flags.get("batch_idx"):
        rows = "block table's" if block_table is not None else "cache's"
        raise ValueError(f"cache_batch_idx: got {cache_batch_idx.tolist()[:16]}; expected indices into the {rows} "
                         f"{cache_rows} rows")
    if flags.get("block_table"):
        raise ValueError(f"block_table: got page indices outside [0, {num_pages}) among the pages the sequences use; "
                         f"expected indices of k_cache's {num_pages} pages")


def _check_rotary_values(rotary_seqlens: torch.Tensor, shape: CacheShape, positions: int) -> None:
    """Each sequence's rotary rows inside rotary_cos, where checks_values allows (as _check_values);
    packed new keys are counted as the longest sequence's at most (their total)."""
    if not checks_values(rotary_seqlens.device):
        return
    rows = max(shape.seqlen_q, 0 if shape.packed_new else shape.seqlen_new)
    if bool(((rotary_seqlens < 0) | (rotary_seqlens.long() + rows > positions)).any()):
        raise ValueError(f"rotary_seqlens: got {rotary_seqlens.tolist()[:16]}; expected 0 <= rotary_seqlens and "
                         f"rotary_seqlens + {rows} <= {positions} (rotary_cos's positions)")


def _rows(batch: int, n: int, cu: torch.Tensor | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, index in it) of each row, int64 (N,) each: the batch * n rows of a (batch, n, ...)
    layout in order, or the cu-packed rows (sequence b: rows cu[b] .. cu[b + 1] - 1, N = n)."""
    if cu is None:
        return (torch.arange(batch, device=device).repeat_interleave(n), torch.arange(n, device=device).repeat(batch))
    row = torch.arange(n, device=device)
    seq = torch.searchsorted(cu[1:].long(), row, right=True)
    return seq, row - cu.long()[seq]


def _positions(cache_seqlens, batch: int, n: int, device, same: bool, cu: torch.Tensor | None = None) -> torch.Tensor:
    """(1, N) int64 positions of the rows _rows lists: row i of sequence b at cache_seqlens[b] + i, its
    absolute cache row, left padding or not (flash-attn's rule; every row at cache_seqlens[b] when
    `same`). No value is read back: a device op per call."""
    start = cache_seqlens.long() if isinstance(cache_seqlens, torch.Tensor) else \
        torch.full((batch,), cache_seqlens, dtype=torch.long, device=device)
    seq, index = _rows(batch, n, cu, device)
    return (start[seq] if same else start[seq] + index).unsqueeze(0)


def _flat(x: torch.Tensor, packed: bool) -> torch.Tensor:
    """x's rows as (1, N, heads, d): a packed (N, heads, d) or a (batch, n, heads, d) layout."""
    return x.unsqueeze(0) if packed else x.reshape(1, -1, *x.shape[2:])


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """x (batch, seqlen, heads, d) rotated on its first 2 * cos.shape[1] dims at `positions` (batch,
    seqlen): GPT-J pairs (2j, 2j + 1) when interleaved, GPT-NeoX pairs (j, j + r / 2) otherwise. The
    rotation runs in fp32 and is rounded once."""
    r = 2 * cos.shape[1]
    c = cos[positions].float().unsqueeze(2)  # (batch, seqlen, 1, r / 2)
    s = sin[positions].float().unsqueeze(2)
    head = x[..., :r].float()
    if interleaved:
        pairs = head.unflatten(-1, (r // 2, 2))
        x0, x1 = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    else:
        x0, x1 = head[..., :r // 2], head[..., r // 2:]
        rotated = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    out = x.clone()
    out[..., :r] = rotated.to(x.dtype)
    return out


def _append(cache: torch.Tensor, new: torch.Tensor, cache_seqlens, cache_batch_idx, block_table,
            page_size: int | None, batch: int, cu_new: torch.Tensor | None) -> None:
    """New key i of sequence b into its row cache_seqlens[b] + i, in place (dense rows or pages): new
    (batch, n, heads_kv, d), or packed (total_new, heads_kv, d) with cu_new."""
    n = new.shape[0] if cu_new is not None else new.shape[1]
    seq, _ = _rows(batch, n, cu_new, new.device)
    positions = _positions(cache_seqlens, batch, n, new.device, False, cu_new)[0]
    rows = cache_batch_idx.long()[seq] if cache_batch_idx is not None else seq  # cache or block-table rows
    if block_table is not None:
        rows = block_table.long()[rows, positions // page_size]
        positions = positions % page_size
    cache.index_put_((rows, positions), _flat(new, cu_new is not None)[0])


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *, attention_chunk=0,
                            rotary_seqlens=None, cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None,
                            strict=None, qv=None, seqused_q=None):
    """Attention of q over a KV cache, appending new keys and values first (flash-attn 2.x).

    q: (batch, seqlen_q, heads, head_dim). k_cache, v_cache: (batch_cache, seqlen_cache, heads_kv,
    head_dim), or with block_table paged: (num_pages, page_size, heads_kv, head_dim), any page_size
    (multiples of 16 are read a key tile at a time, other sizes and left-padded sequences row by row
    from their pages). k, v: (batch, seqlen_new, heads_kv, head_dim) or None: written into the cache at
    rows cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1, in place, before attention.
    rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2): rotary embeddings on q and the new k (they
    need k and v, as in flash-attn; rotary_interleaved: GPT-J pairs, else GPT-NeoX halves); new key i
    at position cache_seqlens[b] + i (its cache row, left padding or not), query i there too when
    causal or windowed, every query at cache_seqlens[b] otherwise; rotary_seqlens (keyword only,
    FlashAttention-3's: int32 (batch,)) starts them at rotary_seqlens[b] instead. cache_seqlens: int or int32
    (batch,), the keys already cached. cache_batch_idx: int32 (batch,), the cache rows the batch uses
    (paged: the block-table rows, FlashAttention-3's). cache_leftpad: int32 (batch,), where each
    sequence's keys start. block_table: int32 (batch, or with cache_batch_idx any rows,
    max_pages_per_sequence). softmax_scale defaults to
    1/sqrt(head_dim); causal, window_size=(left, right) and alibi_slopes ((heads,) or (batch, heads)
    fp32) are bottom-right aligned, and so is attention_chunk > 0 (keyword only; FlashAttention-3's
    chunked local attention: only the keys of the chunk holding the query's diagonal key, chunks
    counted from the sequence's first key); softcap > 0 caps the scores. num_splits: 0 chooses from the GPU
    and the shape, 1 never splits, n > 1 splits the keys n ways. Returns out (batch, seqlen_q, heads,
    head_dim), and with return_softmax_lse also the natural-log LSE (batch, heads, seqlen_q) fp32
    (+inf for rows that see no key, whose out is 0).
    Keyword only, FlashAttention-3's varlen calls: cu_seqlens_q (int32 (batch + 1,)) with max_seqlen_q
    packs q as (total_q, heads, head_dim), sequence b its rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1,
    each bottom-right aligned on its own keys (out (total_q, heads, head_dim), LSE (heads, total_q));
    cu_seqlens_k_new packs k and v as (total_new, heads_kv, head_dim) the same way. seqused_q (int32
    (batch,), with cu_seqlens_q; FlashAttention-3's varlen semantics): only the first seqused_q[b] rows of
    sequence b's span are queries, aligned as such; the rest get out 0 and lse +inf.
    qv (keyword only, FlashAttention-3's; q's rows by v_cache's head dim): the scores q . k + qv . v
    (DeepSeek's MLA decode: k_cache the rope columns, v_cache the latent), softmax_scale by default
    1/sqrt(head_dim + head_dim_v); no rotary on qv. It runs on the sm90 family's kernel (each V tile read
    once for both products): an H100 or H200 (ValueError elsewhere, but on CPU tensors: the reference).

    Head dims 1..256 off the kernels' grid (not multiples of 8 in 32..256) run zero-padded, as
    flash_attn_func's do: the caches are copied padded for the call (and, when k and v are appended,
    written back into the caller's caches, which keep their head dim): a copy of the whole cache per
    call, so a model with such a head dim decodes far slower than at 64 or 128.
    On CPU tensors outside autoflash.emulate() the attention is the PyTorch reference, after one
    FallbackWarning; strict=True (or AUTOFLASH_STRICT=1) raises UnsupportedCallError there instead.

    One custom op, autoflash::flash_kvcache (mutating k_cache and v_cache), so torch.compile traces
    it as a single node (eagerly its body runs without the op's dispatch)."""
    shape = check_kvcache(q, k_cache, v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                          cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                          block_table=block_table, any_head_dim=True, rotary_seqlens=rotary_seqlens,
                          cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, cu_seqlens_k_new=cu_seqlens_k_new)
    _check_flag("causal", causal)
    _check_flag("rotary_interleaved", rotary_interleaved)
    _check_flag("return_softmax_lse", return_softmax_lse)
    is_strict(strict)
    window_size = window_pair("window_size", window_size)
    attention_chunk = chunk_size("attention_chunk", attention_chunk)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits: got {num_splits!r}, expected an int >= 0 (0 chooses)")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap: got {softcap!r}, expected a float >= 0 (0 = no capping)")
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))):
        raise TypeError(f"softmax_scale: got {softmax_scale!r}, expected a float or None")
    d, width, dv = shape.head_dim, padded_head_dim(shape.head_dim), shape.dv
    width_v = width if dv == d else padded_head_dim_v(dv)
    if qv is not None:
        check_qv_shape(qv, q, dv, "v_cache")
    scale = check_scale(softmax_scale, d + (dv if qv is not None else 0))  # of the caller's head dims
    seqlens_tensor = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    reason = cpu_fallback(q)
    if explaining_now():
        raise Captured(KvCacheCall(q, k_cache, shape, alibi_slopes, causal, window_size, float(softcap), num_splits,
                                   reason, width, attention_chunk, cu_seqlens_q, max_seqlen_q,
                                   width_v if dv != d else None, qv is not None))
    if reason is not None:
        fall_back("flash_attn_with_kvcache", reason, strict, REFERENCE,
                  explain="autoflash.explain(autoflash.flash_attn_with_kvcache, ...)")
    caches = (k_cache, v_cache)
    padded = (width, width_v) != (d, dv)
    if padded:  # zero-padded copies; the rows appended to them go back into the caller's caches below
        q, k, k_cache = (None if t is None else _pad(t, width) for t in (q, k, k_cache))
        v, v_cache, qv = (None if t is None else _pad(t, width_v) for t in (v, v_cache, qv))
    out, lse = _run_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, rotary_seqlens, seqlens_tensor,
                              cache_seqlens if seqlens_tensor is None else 0, cache_batch_idx, cache_leftpad,
                              block_table, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, alibi_slopes, None, scale,
                              causal, window_size[0], window_size[1], attention_chunk, float(softcap),
                              rotary_interleaved, num_splits, qv, seqused_q)
    if padded:
        if k is not None:
            for cache, wide in zip(caches, (k_cache, v_cache)):
                cache.copy_(wide[..., :cache.shape[-1]])
        out = out[..., :dv]
    out, lse = forward_only(out, lse, "flash_attn_with_kvcache", q, *caches, k, v, qv)
    return (out, lse) if return_softmax_lse else out


@dataclasses.dataclass(frozen=True)
class KvCacheCall:
    """A flash_attn_with_kvcache call after its checks (explain mode): what the kernel choice reads,
    and why it would not run on the kernels (None if it would). head_dim, head_dim_v: the kernels'
    (padded; head_dim_v None where V's is head_dim)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    shape: CacheShape
    alibi_slopes: Optional[torch.Tensor]
    causal: bool
    window: tuple
    softcap: float
    num_splits: int
    fallback: Optional[str]
    head_dim: int
    attention_chunk: int = 0
    cu_seqlens_q: Optional[torch.Tensor] = None
    max_seqlen_q: Optional[int] = None
    head_dim_v: Optional[int] = None
    qv: bool = False  # FlashAttention-3's qv (the sm90 family's switch)
    notes: tuple[str, ...] = ()  # what the entry that routed the call here did (explain prints them)


def kernel_plan(profile, call: KvCacheCall):
    """(Selection of the KV-cache kernel a call launches, its key splits, how they were chosen):
    metadata only, what flash_kvcache and kernels.decode.flash_decode pick (autoflash.explain)."""
    from autoflash.dispatch.selection import HEURISTIC, Selection, select_decode
    from autoflash.kernels.checks import DTYPE_NAMES
    from autoflash.kernels.decode import decode_launch, packed_heads
    from autoflash.kernels.launch import family_reason

    shape = dataclasses.replace(call.shape, head_dim=call.head_dim, head_dim_v=call.head_dim_v)
    q = heads_view(call.q) if shape.packed_q else call.q.transpose(1, 2)
    causal, variant = resolve(q, call.k_cache.transpose(1, 2), call.causal, align="bottom_right",
                              window=call.window, softcap=call.softcap, alibi_slopes=call.alibi_slopes,
                              cache_len=shape.capacity, attention_chunk=call.attention_chunk,
                              cu_seqlens_q=call.cu_seqlens_q, max_seqlen_q=call.max_seqlen_q)
    tuned, tuned_splits = select_decode(profile, call.q, shape)
    runs_tuned = tuned is not None and not _has_switches(call.window, call.softcap, call.alibi_slopes, None,
                                                         call.attention_chunk, shape.gathered, call.qv)
    config, splits = decode_launch(shape, DTYPE_NAMES[call.q.dtype], profile, causal, variant,
                                   tuned if runs_tuned else None, call.num_splits or tuned_splits,
                                   packed_heads(shape, call.alibi_slopes), call.qv)
    origin = "tuned decode table (autoflash.dispatch.selection.select_decode)" if runs_tuned else HEURISTIC
    why = family_reason(config, profile)
    origin += f"; family sm80 on this sm_90 GPU: {why}" if why else ""
    how = ("num_splits given" if call.num_splits else "tuned split count" if tuned_splits
           else "split heuristic, kernels.decode.choose_num_splits")
    return Selection(None, config, origin), splits, how


def _has_switches(window, softcap, alibi_slopes, key_bias, attention_chunk, gathered: bool, qv: bool) -> bool:
    """Whether a call carries a switch the tuned decode tiles were not measured with (their registers
    may spill with it, see kernels.defaults), pages gathered row by row and FlashAttention-3's qv (its
    tiles hold qv's rows and all of V's columns) among them: those calls take the built-in tiles."""
    return (tuple(window) != (-1, -1) or bool(softcap) or alibi_slopes is not None or key_bias is not None
            or bool(attention_chunk) or gathered or qv)


class _ForwardOnly(torch.autograd.Function):
    """The identity, whose gradient is an error that names the call (`entry`): flash_attn_with_kvcache
    has no backward (nor has flash-attn's, nor its paged flash_attn_varlen_func), and torch's own
    message would name an internal op."""

    @staticmethod
    def forward(ctx, x, entry: str = "flash_attn_with_kvcache", *inputs):
        # `inputs`: the call's tensors, so that the result asks for a gradient when they do (the kernels'
        # out, from an eager call that skips the custom op, records no graph of its own)
        ctx.entry = entry
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(f"{ctx.entry} is forward only, as flash-attn's is: no gradient flows through "
                           "it. For training use flash_attn_func / flash_attn_varlen_func without a block_table, or "
                           "autoflash.attention; for inference call it under torch.no_grad() or "
                           "torch.inference_mode()")


def forward_only(out: torch.Tensor, lse: torch.Tensor | None, entry: str, *inputs) -> tuple:
    """out and lse (None: none) whose gradient is _ForwardOnly's error where any of `inputs` wants one."""
    wanting = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if torch.is_grad_enabled() and wanting:
        return (_ForwardOnly.apply(out, entry, *wanting),
                None if lse is None else _ForwardOnly.apply(lse, entry, *wanting))
    return out, lse


def _kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Optional[torch.Tensor],
                  v: Optional[torch.Tensor], rotary_cos: Optional[torch.Tensor], rotary_sin: Optional[torch.Tensor],
                  rotary_seqlens: Optional[torch.Tensor], cache_seqlens: Optional[torch.Tensor], cache_seqlens_int: int,
                  cache_batch_idx: Optional[torch.Tensor], cache_leftpad: Optional[torch.Tensor],
                  block_table: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
                  cu_seqlens_k_new: Optional[torch.Tensor], max_seqlen_q: Optional[int],
                  alibi_slopes: Optional[torch.Tensor],
                  key_bias: Optional[torch.Tensor], softmax_scale: Optional[float], causal: bool, window_left: int,
                  window_right: int, attention_chunk: int, softcap: float, rotary_interleaved: bool,
                  num_splits: int, qv: Optional[torch.Tensor] = None,
                  seqused_q: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_with_kvcache's work: the checks that read values, rotary, the append into k_cache
    and v_cache, then attention: (out like q, lse (batch, heads, seqlen_q) fp32). cache_seqlens: the
    tensor, or None and cache_seqlens_int for every sequence. key_bias: fp32 (batch, capacity) added
    to each sequence's key scores, -inf masking a key (not flash-attn's: autoflash.hf's padding masks,
    see attention_over_cache). rotary_seqlens: FlashAttention-3's rotary positions (int32 (batch,)),
    where sequence b's rotary starts instead of at cache_seqlens[b]. cu_seqlens_q (with max_seqlen_q)
    and cu_seqlens_k_new: packed queries and new keys (FlashAttention-3's), LSE then (heads, total_q). qv:
    FlashAttention-3's (q's rows by V's head dim), the scores q . k + qv . v. seqused_q: the rows of each
    packed sequence in use (FlashAttention-3's)."""
    seqlens = cache_seqlens if cache_seqlens is not None else cache_seqlens_int
    window = (window_left, window_right)
    shape = check_kvcache(q, k_cache, v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                          cache_seqlens=seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                          block_table=block_table, rotary_seqlens=rotary_seqlens, cu_seqlens_q=cu_seqlens_q,
                          max_seqlen_q=max_seqlen_q, cu_seqlens_k_new=cu_seqlens_k_new)
    scale = check_scale(softmax_scale, shape.head_dim + (shape.dv if qv is not None else 0))
    # The variant arguments' own checks, before the cache is touched (the kernels' path runs them again).
    resolve(heads_view(q) if shape.packed_q else q.transpose(1, 2), k_cache.transpose(1, 2), causal,
            align="bottom_right", window=window, softcap=softcap, alibi_slopes=alibi_slopes, key_bias=key_bias,
            cache_len=shape.capacity, attention_chunk=attention_chunk, cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q, seqused_q=seqused_q)
    _check_values(shape, seqlens, cache_batch_idx, cache_leftpad, block_table, k_cache.shape[0], k_cache.shape[0],
                  cu_seqlens_q, cu_seqlens_k_new, q.shape[0])
    if rotary_cos is not None and rotary_seqlens is not None:
        _check_rotary_values(rotary_seqlens, shape, rotary_cos.shape[0])
    if qv is not None and not (q.device.type == "cpu" and not emulating()):  # before the cache is touched
        from autoflash.kernels.checks import DTYPE_NAMES
        from autoflash.kernels.decode import check_qv
        from autoflash.kernels.launch import profile_for

        check_qv(shape, DTYPE_NAMES[q.dtype], profile_for(q, "flash_attn_with_kvcache"))

    if rotary_cos is not None:  # with k, v (check_kvcache): flash-attn rotates as it appends
        local = window != (-1, -1) or attention_chunk > 0
        start = seqlens if rotary_seqlens is None else rotary_seqlens
        n_q = q.shape[0] if shape.packed_q else shape.seqlen_q
        q = apply_rotary(_flat(q, shape.packed_q), rotary_cos, rotary_sin,
                         _positions(start, shape.batch, n_q, q.device, not (causal or local), cu_seqlens_q),
                         rotary_interleaved).reshape(q.shape)
        k = apply_rotary(_flat(k, shape.packed_new), rotary_cos, rotary_sin,
                         _positions(start, shape.batch, shape.seqlen_new, q.device, False, cu_seqlens_k_new),
                         rotary_interleaved).reshape(k.shape)
    if k is not None:
        for cache, new in ((k_cache, k), (v_cache, v)):
            _append(cache, new, seqlens, cache_batch_idx, block_table, shape.page_size, shape.batch, cu_seqlens_k_new)
    seqused = seqlens
    if shape.seqlen_new:  # the keys in use after the append
        seqused = seqlens + (cu_seqlens_k_new.diff() if shape.packed_new else shape.seqlen_new)
        if isinstance(seqused, torch.Tensor):
            seqused = seqused.to(torch.int32)

    kw = dict(cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table, causal=causal,
              scale=scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes, key_bias=key_bias,
              attention_chunk=attention_chunk, cu_seqlens_q=cu_seqlens_q, qv=qv, seqused_q=seqused_q)
    if q.device.type == "cpu" and not emulating():
        out, lse = _reference(q, k_cache, v_cache, seqused, shape, kw)
    else:
        from autoflash.dispatch.selection import select_decode
        from autoflash.kernels.decode import flash_decode
        from autoflash.kernels.launch import profile_for

        config, tuned_splits = select_decode(profile_for(q, "flash_attn_with_kvcache"), q, shape)
        if _has_switches(window, softcap, alibi_slopes, key_bias, attention_chunk, shape.gathered, qv is not None):
            config = None  # the built-in tiles, the tuned split count
        kw["qv"] = None if qv is None else chunked(qv)
        out, lse = flash_decode(chunked(q), k_cache, v_cache, seqused, num_splits=num_splits or tuned_splits,
                                config=config, max_seqlen_q=max_seqlen_q, **kw)
    return _like(out, q), lse.contiguous()  # the strides the fake implementation promises


flash_kvcache = torch.library.custom_op("autoflash::flash_kvcache", mutates_args=("k_cache", "v_cache"))(_kvcache)


def _run_kvcache(*args):
    """flash_kvcache's work where a call site needs it. Under torch.compile it goes through the custom op,
    one node with its mutated caches. Eagerly it runs the op's body: the op's dispatch (filling in its
    defaults, the mutated caches' bookkeeping, in Python) was about a third of a decode step's host time
    (the append's own writes still bump the caches' version counters)."""
    return flash_kvcache(*args) if torch.compiler.is_compiling() else _kvcache(*args)


@flash_kvcache.register_fake
def _flash_kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, rotary_seqlens, cache_seqlens,
                        cache_seqlens_int, cache_batch_idx, cache_leftpad, block_table, cu_seqlens_q, cu_seqlens_k_new,
                        max_seqlen_q, alibi_slopes, key_bias, softmax_scale, causal, window_left, window_right,
                        attention_chunk, softcap, rotary_interleaved, num_splits, qv=None, seqused_q=None):
    out = empty_like_width(q, v_cache.shape[-1])
    if cu_seqlens_q is not None:  # packed (total_q, heads, d): LSE (heads, total_q)
        return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    b, lq, h, _ = q.shape
    return out, q.new_empty((b, h, lq), dtype=torch.float32)


def attention_over_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlen: int, *,
                         key_bias: Optional[torch.Tensor], causal: bool, window: tuple, softcap: float,
                         scale: Optional[float], cache_leftpad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A decode step over keys already in a cache (autoflash.hf: transformers' caches append
    themselves): q (batch, seqlen_q, heads, d) over rows [cache_leftpad[b], seqlen) of every
    sequence of k_cache, v_cache (batch, >= seqlen, heads_kv, d), bottom-right aligned; key_bias
    fp32 (batch, k_cache rows) or None: a padding mask as -inf, read by the kernel (no value is read
    here), indexed from each sequence's first key (after its left padding)."""
    out, _ = _run_kvcache(q, k_cache, v_cache, None, None, None, None, None, None, seqlen, None, cache_leftpad, None,
                          None, None, None, None, key_bias, scale, causal, window[0], window[1], 0, float(softcap),
                          False, 0)
    return out


def _reference(q, k_cache, v_cache, seqused, shape: CacheShape, kw: dict):
    """The PyTorch reference on CPU tensors (no kernel): fp32, cast to q's dtype."""
    from autoflash.reference.kvcache import attention_kvcache_ref

    lengths = seqused.tolist() if isinstance(seqused, torch.Tensor) else [seqused] * shape.batch
    leftpad = kw["cache_leftpad"].tolist() if kw["cache_leftpad"] is not None else None
    cu, used_q = kw["cu_seqlens_q"], kw["seqused_q"]
    out, lse = attention_kvcache_ref(q, k_cache, v_cache, lengths, cache_leftpad=leftpad,
                                     block_table=kw["block_table"], cache_batch_idx=kw["cache_batch_idx"],
                                     causal=kw["causal"], scale=kw["scale"], window=kw["window"],
                                     softcap=kw["softcap"], alibi_slopes=kw["alibi_slopes"], key_bias=kw["key_bias"],
                                     attention_chunk=kw["attention_chunk"],
                                     cu_seqlens_q=cu.tolist() if cu is not None else None,
                                     qv=kw["qv"], seqused_q=used_q.tolist() if used_q is not None else None)
    return out.to(q.dtype), lse
