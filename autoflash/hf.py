"""Hugging Face transformers integration: `attn_implementation="autofa"`.

    import autoflash.hf
    autoflash.hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="autofa")

The name is "autofa", not "autoflash": transformers takes any implementation whose name contains
"flash" for a flash-attn package or a Hub kernel and tries to import one (transformers 5.x,
utils/generic.py is_flash_attention_requested), which would fail before autoflash is ever called.

register() adds two things, as transformers' own flash-attention integration does:
- to its AttentionMaskInterface, `kernel_mask`: the model hands attention the 2D (batch, kv_len)
  padding mask, or None when nothing is padded, instead of a materialised 4D mask (causal order and
  sliding windows are the kernels' switches, not mask entries);
- to its AttentionInterface, `attention_forward`: causal attention bottom-right aligned (the last
  query sees the last key: decoding with a cache), the padding mask as the kernels' per-key bias
  (-inf on padded keys), and the `sliding_window` and `softcap` that models pass (Mistral, Gemma 2)
  as the kernels' window and softcap (autoflash.dispatch.flash_api.attention_variant).
  Decode steps (at most DECODE_MAX_QUERIES new queries over a longer cache, no gradient: generate()
  with a DynamicCache or a StaticCache) run flash_attn_with_kvcache (the KV-cache kernel: split
  across blocks when the batch leaves SMs idle, a K/V head's query heads sharing each K/V read) over
  the cache transformers has already appended to (k=None): cache_seqlens the keys in use (a static
  cache's filled slots, from the cache's query offset); a padding mask's leading padded keys as
  cache_leftpad (never read) and any other padded key as the kernel's per-key bias, both made on
  the device (a decode step reads no value back: no synchronisation, CUDA graphs can capture it).

What the kernels cannot run follows autoflash.attention's policy: a call the kernels cannot take
(CPU tensors outside autoflash.emulate(), float32, dropout in training, other head dims, an old
GPU) runs torch SDPA on the equivalent boolean mask, with one FallbackWarning per reason
(AUTOFLASH_STRICT=1 raises instead), except with softcap, which SDPA lacks: that raises. Masks the
2D form cannot express (custom mask functions, packed sequences, block masks) come as sdpa's 4D
mask and go through autoflash.attention (the kernels when it is a key-padding mask, else SDPA).
position_bias, attention sinks (s_aux) and paged caches (continuous batching) raise. Rows that see
no real key (under causal order, the padded query positions of left padding) get 0 from the
kernels; sdpa gives them 0 or NaN. transformers is not a dependency of autoflash: this module
imports it only in register() and kernel_mask().
"""
from __future__ import annotations

import torch

from autoflash.dispatch.policy import UnsupportedCallError, fall_back
from autoflash.dispatch.sdpa import _torch_sdpa, attention, plan
from autoflash.dispatch.tensor_memo import MISSING, TensorMemo
from autoflash.kernels.checks import host_reads_possible

NAME = "autofa"
DECODE_MAX_QUERIES = 16  # new queries per step that take the KV-cache kernel (its tuned keys' range)


# ------------------------------------------------------------------ the mask interface
def kernel_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                mask_function=None, attention_mask: torch.Tensor | None = None, allow_is_causal_skip: bool = True,
                allow_is_bidirectional_skip: bool = False, use_vmap: bool = False, **kwargs) -> torch.Tensor | None:
    """transformers' mask-interface signature -> the 2D bool padding mask (batch, used_kv_len) of the
    keys in use, or None when no key is padded.

    As transformers' flash_attention_mask: the mask's last kv_length columns (a sliding-window cache
    keeps the last keys), None when all of them are real tokens. A mask shorter than kv_length
    means a static cache's unused tail (attention_forward drops those keys). Where the 2D form
    would lose something (use_vmap: custom mask functions; a builder that refuses to skip the mask,
    as for packed sequences and block masks, with more than one query) this returns sdpa's 4D mask."""
    if use_vmap or not (allow_is_causal_skip or allow_is_bidirectional_skip or q_length == 1):
        from transformers.masking_utils import sdpa_mask

        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                         allow_is_causal_skip=allow_is_causal_skip,
                         allow_is_bidirectional_skip=allow_is_bidirectional_skip, use_vmap=use_vmap, **kwargs)
    # A causal query sees no key past its own position: in a static cache (kv_length its capacity)
    # the slots after the last query are unfilled. q_offset is a tensor for a static cache
    # (StaticLayer.cumulative_length: the cache_position of the first query).
    end = q_offset + q_length - kv_offset
    mask = None if attention_mask is None else attention_mask[:, -kv_length:]
    if isinstance(end, torch.Tensor) and not host_reads_possible(end.device):
        # Nothing may be read back (a CUDA graph captures, torch.compile traces): the filled slots as
        # a mask made on the device (the kernels' key bias hides the rest) instead of a shorter one.
        if (mask is not None and mask.shape[1] != kv_length) or not _causal(mask_function, kv_length - 1 + kv_offset):
            return mask
        filled = torch.arange(kv_length, device=end.device) < end
        return filled.expand(batch_size, kv_length) if mask is None else mask & filled.to(mask.device)
    end = int(end)
    if mask is None:
        if 0 < end < kv_length and _causal(mask_function, end - 1 + kv_offset):
            return torch.ones(batch_size, end, dtype=torch.bool, device=kwargs.get("device", "cpu"))
        return None
    if mask.shape[1] == kv_length:
        # A mask as long as a static cache's capacity also covers its unfilled slots: cut after the last query.
        if 0 < end < kv_length and _causal(mask_function, end - 1 + kv_offset):
            return mask[:, :end]
        if host_reads_possible(mask.device) and bool(mask.all()):
            return None
    return mask


def _causal(mask_function, last_query: int) -> bool:
    """Whether transformers' mask_function hides the key after the last query (causal, sliding
    window: keys past it are a static cache's unfilled slots), not bidirectional or cross attention.
    None (a direct call) counts as causal, as attention_forward's default."""
    if mask_function is None:
        return True
    i = torch.tensor(last_query)
    try:
        return not bool(mask_function(torch.tensor(0), torch.tensor(0), i, i + 1))
    except (TypeError, IndexError, RuntimeError):  # an overlay that cannot take scalar indices: keep every key
        return False


# ------------------------------------------------------------------ the attention interface
def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, sliding_window: int | None = None, softcap: float | None = None,
                      s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query (batch, heads, q_len, head_dim), key/value
    (batch, kv_heads, kv_len, head_dim), attention_mask from kernel_mask (2D padding mask or None;
    a 4D mask where kernel_mask or the caller made one) -> (attn_output (batch, q_len, heads,
    head_dim), None)."""
    _refuse_unsupported(s_aux, kwargs)
    gqa = key.shape[1] != query.shape[1]
    if attention_mask is not None and attention_mask.dim() != 2:
        out = _with_full_mask(query, key, value, attention_mask, dropout, scaling, softcap, gqa)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is not None:
        if attention_mask.shape[0] != query.shape[0] or attention_mask.shape[1] > key.shape[2]:
            raise ValueError(f"attention_mask: got shape {tuple(attention_mask.shape)}, expected (batch "
                             f"{query.shape[0]}, at most kv_len {key.shape[2]}): a 2D padding mask")
        used = attention_mask.shape[1]
        key, value = key[:, :, :used], value[:, :, :used]  # a static cache's unused tail
        attention_mask = attention_mask.bool()
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = window_size(sliding_window, causal, key.shape[2])
    cap = 0.0 if softcap is None else float(softcap)
    out = run(query, key, value, attention_mask, causal=causal, window=window, softcap=cap, dropout=dropout,
              scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def _refuse_unsupported(s_aux, kwargs) -> None:
    """What the kernels have no switch for, refused rather than silently dropped."""
    if kwargs.get("position_bias") is not None:
        raise ValueError("position_bias: got a tensor, expected None (use attn_implementation='sdpa' for models "
                         "with an additive position bias)")
    if s_aux is not None:
        raise ValueError("s_aux: got a tensor (attention sinks), expected None: the autoflash kernels have no "
                         "sink logits (use attn_implementation='eager')")
    if kwargs.get("cache") is not None:
        raise ValueError(f"cache: got a {type(kwargs['cache']).__name__} (continuous batching's paged cache), "
                         "expected None: autoflash attends over the key/value tensors it is given")


# autoflash.attention runs float32 on the SIMT kernels without switches; every call here carries some
FLOAT32_REASON = ("float32 through autoflash.hf: its calls run the kernels' switches (bottom-right causal, padding "
                  "bias, windows), built and tested for float16/bfloat16 only")


def window_size(sliding_window: int | None, causal: bool, kv_len: int) -> tuple[int, int]:
    """transformers' sliding_window (the number of keys a query sees, itself included) as the
    kernels' (left, right) window, -1 unbounded: flash-attn's (w - 1, w - 1), right 0 when causal;
    no window when it covers all kv_len keys (transformers' flash integration does the same). This
    is sdpa's mask: key j is visible from query position i when i - w < j (<= i when causal)."""
    if sliding_window is None or kv_len <= sliding_window:
        return (-1, -1)
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window: got {sliding_window!r}, expected a positive int or None")
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def run(query, key, value, key_mask: torch.Tensor | None, *, causal: bool, window: tuple[int, int], softcap: float,
        dropout: float, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """Attention with a 2D padding mask (bool (batch, kv_len), True = a real token, or None),
    bottom-right causal order, window and softcap: on the kernels when autoflash.attention would
    run the same call (without a mask) on them, else the fallback."""
    if key_mask is not None and key_mask.shape != (query.shape[0], key.shape[2]):
        raise ValueError(f"key_mask: got shape {tuple(key_mask.shape)}, expected (batch {query.shape[0]}, kv_len "
                         f"{key.shape[2]})")
    causal = causal and query.shape[2] > 1  # bottom-right: a lone query sees every key either way
    p = plan(query, key, value, None, dropout, False, scale, enable_gqa)
    reason = p.reason if p.reason is not None or query.dtype != torch.float32 else FLOAT32_REASON
    if reason is not None:
        return _fallback(reason, query, key, value, key_mask, causal, window, softcap, dropout, scale, enable_gqa)
    from autoflash.dispatch import flash_api

    if _decode_step(query, key, value, dropout):
        return _decode(query, key, value, key_mask, causal=causal, window=window, softcap=softcap, scale=p.scale)
    bias = None if key_mask is None else _key_bias(key_mask, query.device)
    out, _ = flash_api.attention_variant(query, key, value, scale=p.scale, causal=causal, align="bottom_right",
                                         window=window, softcap=softcap, key_bias=bias,
                                         deterministic=torch.are_deterministic_algorithms_enabled())
    return out


def _decode_step(query, key, value, dropout: float) -> bool:
    """Whether a call the kernels run is a decode step for the KV-cache kernel: a few new queries
    over a longer cache, nothing that needs a gradient, a head dim it takes as is (multiples of 8 in
    32..256, 16-byte aligned rows: transformers' caches are)."""
    from autoflash.kernels.checks import is_chunked_layout
    from autoflash.kernels.config import HEAD_DIM_MAX, HEAD_DIM_MIN, HEAD_DIM_STEP

    q_len, kv_len, d = query.shape[2], key.shape[2], query.shape[3]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return (q_len <= DECODE_MAX_QUERIES and q_len < kv_len and not grad and not dropout
            and HEAD_DIM_MIN <= d <= HEAD_DIM_MAX and d % HEAD_DIM_STEP == 0
            and (torch.compiler.is_compiling() or all(is_chunked_layout(t) for t in (query, key, value))))


def _decode(query, key, value, key_mask, *, causal: bool, window: tuple[int, int], softcap: float,
            scale: float) -> torch.Tensor:
    """A decode step on the KV-cache kernel (flash_attn_with_kvcache's op) over the keys transformers'
    cache already holds (nothing to append): all key.shape[2] of them (attention_forward has cut a
    static cache's unfilled slots). A padding mask goes in as padding_arguments makes it on the
    device, no value read back: its leading padded keys (generate()'s left padding) as cache_leftpad,
    never read, any other masked key as the kernel's per-key bias. (batch, heads, q_len, d) in and
    out, the kernel's layout being (batch, seqlen, heads, d)."""
    from autoflash.dispatch import kvcache

    q, k_cache, v_cache = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    leftpad, bias = (None, None) if key_mask is None else padding_arguments(key_mask, q.device)
    out = kvcache.attention_over_cache(q, k_cache, v_cache, key.shape[2], cache_leftpad=leftpad, key_bias=bias,
                                       causal=causal, window=window, softcap=softcap, scale=scale)
    return out.transpose(1, 2)


_PADDING = TensorMemo()  # key mask -> padding_arguments' tensors, per (device, stream)


def padding_arguments(key_mask: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The KV-cache kernel's arguments for a bool (batch, kv_len) padding mask (True = a real key),
    made on `device` without reading a value back (no synchronisation; CUDA graphs can capture it):
    int32 (batch,) cache_leftpad, the keys before each row's first real one (all of them for a row
    with none), which the kernel never reads; and fp32 (batch, kv_len) key_bias, -inf on every other
    padded key (right padding, holes), 0 elsewhere, indexed from the row's first kept key as the
    kernel indexes it. Remembered per mask tensor, device and stream (transformers hands every layer
    of a forward the same mask, so its few small launches run once per forward); not while a CUDA
    graph captures, where the tensors would be filled only when the graph replays."""
    device = torch.device(device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    found = MISSING if capturing else _PADDING.get(key_mask, (device, stream))
    if found is not MISSING:
        return found
    mask = key_mask.to(device=device, dtype=torch.bool)
    kv_len = mask.shape[1]
    leftpad = (mask.cumsum(1, dtype=torch.int32) == 0).sum(1, dtype=torch.int32)
    keys = torch.arange(kv_len, device=device)
    kept = mask.gather(1, (keys[None, :] + leftpad[:, None]).clamp_(max=kv_len - 1))  # past a row's keys: unread
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_fill_(~kept, float("-inf"))
    if not capturing:
        _PADDING.put(key_mask, (leftpad, bias), (device, stream))
    return leftpad, bias


def _key_bias(key_mask: torch.Tensor, device) -> torch.Tensor:
    """The padding mask as the kernels' fp32 per-key bias: 0 on real keys, -inf on padded ones."""
    bias = torch.zeros(key_mask.shape, dtype=torch.float32, device=device)
    return bias.masked_fill_(~key_mask.to(device), float("-inf"))


def _fallback(reason: str, query, key, value, key_mask, causal, window, softcap, dropout, scale, enable_gqa):
    """torch SDPA on the boolean mask equivalent to (padding, bottom-right causal, window), with the
    FallbackWarning; softcap has no SDPA equivalent and raises."""
    if softcap:
        raise UnsupportedCallError(f"autoflash.hf: softcap {softcap} with a call the kernels cannot run ({reason}); "
                                   "torch SDPA has no softcap: use attn_implementation='eager'")
    fall_back("autoflash.hf", reason, None)
    mask = sdpa_bool_mask(key_mask, query.shape[2], key.shape[2], causal, window, query.device)
    top_left_causal = mask is None and causal  # only when q_len == kv_len (else a mask is built)
    return _torch_sdpa(query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=top_left_causal, scale=scale,
                       enable_gqa=enable_gqa)


def sdpa_bool_mask(key_mask, q_len: int, kv_len: int, causal: bool, window: tuple[int, int],
                   device) -> torch.Tensor | None:
    """The SDPA mask (True = attend) of a call: (batch, 1, q_len, kv_len), (q_len, kv_len) without
    padding, or None where is_causal (q_len == kv_len) or nothing at all masks a key. Query i's
    diagonal is key i + kv_len - q_len (bottom-right)."""
    left, right = window
    if causal:
        right = 0
    structured = left >= 0 or right >= 0
    if key_mask is None and (not structured or (causal and left < 0 and q_len == kv_len)):
        return None
    mask = None
    if structured:
        diag = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
        j = torch.arange(kv_len, device=device)[None, :]
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
        if left >= 0:
            mask &= j >= diag - left
        if right >= 0:
            mask &= j <= diag + right
    if key_mask is None:
        return mask
    padded = key_mask.to(device)[:, None, None, :]
    return padded.expand(-1, 1, q_len, -1) if mask is None else padded & mask


def _with_full_mask(query, key, value, mask, dropout, scale, softcap, enable_gqa) -> torch.Tensor:
    """A 4D mask (transformers' sdpa form: it holds the causal order and any window) through
    autoflash.attention with SDPA semantics: the kernels when it is a key-padding mask, else SDPA."""
    if softcap:
        raise ValueError(f"softcap: got {softcap} with a 4D attention mask; expected a 2D padding mask or None "
                         "(autoflash runs softcap only on masks kernel_mask builds; use attn_implementation='eager')")
    mask = mask[:, :, :, : key.shape[2]]
    return attention(query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=False, scale=scale,
                     enable_gqa=enable_gqa)


def register() -> None:
    """Registers attn_implementation="autofa" with transformers (idempotent)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError(f"autoflash.hf.register needs transformers (pip install transformers): {e}") from e
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, kernel_mask)
