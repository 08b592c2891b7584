"""FlashAttention-3's registered ops, torch.ops.flash_attn_3.fwd / bwd / fwd_combine /
get_scheduler_metadata, with FA3's own schemas (hopper/flash_api.cpp, the ones its
test_flash3_bw_compatibility holds), running autoflash: code and exported graphs that call FA3's
ops directly run here as they run on FA3's library. Registered by importing
autoflash.flash_attn_interface, unless FA3 is installed (its flash_attn_3 extension would then fail
to define them a second time when it loads) or a library already defines them: FA3's own ops stay.

fwd dispatches as FA3's mha_fwd does on its arguments: a KV cache (seqused_k without cu_seqlens_k,
or new keys, a page table, cache rows, left padding, rotary) goes to flash_attn_with_kvcache,
cu_seqlens to flash_attn_varlen_func, the rest to flash_attn_func (dispatch/fa3_api.py; what
autoflash does not run raises there, by name). It returns (out, softmax_lse, out_accum,
softmax_lse_accum), the last two empty: autoflash's split partials stay inside its kernels. bwd
runs autoflash's backward on the forward's out and softmax_lse and returns (dq, dk, dv, softmax_d,
softmax_lse_log2, dq_accum, dk_accum, dv_accum), the accumulators empty for the same reason."""
from __future__ import annotations

import importlib.util
import math

import torch

from autoflash.dispatch import fa3_api

NAMESPACE = "flash_attn_3"
SCHEMAS = {
    "fwd": "fwd(Tensor q, Tensor k, Tensor v, Tensor(k_new!)? k_new=None, Tensor(v_new!)? v_new=None, "
           "Tensor? q_v=None, Tensor(out!)? out=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
           "Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, Tensor? seqused_k=None, int? max_seqlen_q=None, "
           "int? max_seqlen_k=None, Tensor? page_table=None, Tensor? kv_batch_idx=None, Tensor? leftpad_k=None, "
           "Tensor? rotary_cos=None, Tensor? rotary_sin=None, Tensor? seqlens_rotary=None, Tensor? q_descale=None, "
           "Tensor? k_descale=None, Tensor? v_descale=None, float? softmax_scale=None, bool is_causal=False, "
           "int window_size_left=-1, int window_size_right=-1, int attention_chunk=0, float softcap=0., "
           "bool is_rotary_interleaved=False, Tensor? scheduler_metadata=None, int num_splits=0, "
           "bool? pack_gqa=None, int sm_margin=0) -> (Tensor(out!), Tensor, Tensor, Tensor)",
    "bwd": "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor(dq!)? dq=None, "
           "Tensor(dk!)? dk=None, Tensor(dv!)? dv=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
           "Tensor? seqused_q=None, Tensor? seqused_k=None, int? max_seqlen_q=None, int? max_seqlen_k=None, "
           "float? softmax_scale=None, bool is_causal=False, int window_size_left=-1, int window_size_right=-1, "
           "float softcap=0., bool deterministic=False, int sm_margin=0) "
           "-> (Tensor(dq!), Tensor(dk!), Tensor(dv!), Tensor, Tensor, Tensor, Tensor, Tensor)",
    "fwd_combine": "fwd_combine(Tensor out_partial, Tensor lse_partial, Tensor(out!)? out=None, "
                   "ScalarType? out_dtype=None) -> (Tensor(out!), Tensor)",
    "get_scheduler_metadata": "get_scheduler_metadata(int batch_size, int max_seqlen_q, int max_seqlen_k, "
                              "int num_heads, int num_heads_k, int headdim, int headdim_v, ScalarType qkv_dtype, "
                              "Tensor seqused_k, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
                              "Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, Tensor? leftpad_k=None, "
                              "int? page_size=None, int max_seqlen_k_new=0, bool is_causal=False, "
                              "int window_size_left=-1, int window_size_right=-1, int attention_chunk=0, "
                              "bool has_softcap=False, int num_splits=0, bool? pack_gqa=None, int sm_margin=0) "
                              "-> Tensor",
}


def _kvcache_call(seqused_k, cu_seqlens_k, *cache_args) -> bool:
    """FA3's mha_fwd reads a KV cache where the keys' lengths come without cu_seqlens_k, or where
    anything only a cache has is given."""
    return (seqused_k is not None and cu_seqlens_k is None) or any(t is not None for t in cache_args)


def fwd(q, k, v, k_new=None, v_new=None, q_v=None, out=None, cu_seqlens_q=None, cu_seqlens_k=None,
        cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, page_table=None,
        kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None, seqlens_rotary=None, q_descale=None,
        k_descale=None, v_descale=None, softmax_scale=None, is_causal=False, window_size_left=-1,
        window_size_right=-1, attention_chunk=0, softcap=0.0, is_rotary_interleaved=False, scheduler_metadata=None,
        num_splits=0, pack_gqa=None, sm_margin=0):
    window = (window_size_left, window_size_right)
    if _kvcache_call(seqused_k, cu_seqlens_k, k_new, page_table, kv_batch_idx, leftpad_k, rotary_cos):
        o, lse = fa3_api.flash_attn_with_kvcache(
            q, k, v, k_new, v_new, q_v, rotary_cos, rotary_sin, seqused_k, kv_batch_idx, leftpad_k, page_table,
            cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, seqlens_rotary, q_descale, k_descale, v_descale,
            softmax_scale, is_causal, window, attention_chunk, softcap, is_rotary_interleaved, scheduler_metadata,
            num_splits, pack_gqa, sm_margin, return_softmax_lse=True)
    elif cu_seqlens_q is not None or cu_seqlens_k is not None:
        o, lse = fa3_api.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, softmax_scale,
            is_causal, q_v, q_descale, k_descale, v_descale, window, attention_chunk, softcap, num_splits,
            pack_gqa, False, sm_margin, return_attn_probs=True)
    else:
        o, lse = fa3_api.flash_attn_func(q, k, v, softmax_scale, is_causal, q_v, q_descale, k_descale, v_descale,
                                         window, attention_chunk, softcap, num_splits, pack_gqa, False,
                                         sm_margin, return_attn_probs=True)
    if out is not None:
        out.copy_(o)
        o = out
    return o, lse, q.new_empty(0, dtype=torch.float32), q.new_empty(0, dtype=torch.float32)


def bwd(dout, q, k, v, out, softmax_lse, dq=None, dk=None, dv=None, cu_seqlens_q=None, cu_seqlens_k=None,
        seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None, is_causal=False,
        window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=False, sm_margin=0):
    from autoflash.dispatch import flash_api

    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    d = q.shape[-1]
    scale = flash_api._check_scale("softmax_scale", softmax_scale, d)
    window = flash_api._check_window("window_size", (window_size_left, window_size_right), is_causal)
    width = flash_api.padded_head_dim(d)
    width_v = width if v.shape[-1] == d else flash_api.padded_head_dim_v(v.shape[-1])
    # the kernels' layout: dense (B, H, L, D) views, packed (total, H, D) as they are; padded head dims
    views = [flash_api._pad(t, w) for t, w in ((dout, width_v), (q, width), (k, width), (v, width_v), (out, width_v))]
    if not packed:
        views = [t.transpose(1, 2) for t in views]
    grads = torch.ops.autoflash.flash_bwd(*views[:4], views[4], softmax_lse, None, None, cu_seqlens_q, cu_seqlens_k,
                                          seqused_q, seqused_k, scale, is_causal, "bottom_right", window[0], window[1],
                                          0, float(softcap), max_seqlen_q or 0, max_seqlen_k or 0, deterministic)
    results = []
    for given, grad, like in zip((dq, dk, dv), grads, (q, k, v)):
        grad = grad if packed else grad.transpose(1, 2)
        grad = grad[..., :like.shape[-1]]
        results.append(given.copy_(grad) if given is not None else grad.to(like.dtype).contiguous())
    softmax_d = (dout.float() * out.float()).sum(-1)  # rowsum(dO * O): (total, H) packed, (B, L, H) dense
    softmax_d = softmax_d.transpose(0, 1) if packed else softmax_d.transpose(1, 2)
    empty = q.new_empty(0, dtype=torch.float32)
    return (*results, softmax_d.contiguous(), softmax_lse * math.log2(math.e), empty, empty.clone(), empty.clone())


def fwd_combine(out_partial, lse_partial, out=None, out_dtype=None):
    return fa3_api.flash_attn_combine(out_partial, lse_partial, out, out_dtype)


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, headdim, headdim_v,
                           qkv_dtype, seqused_k, cu_seqlens_q=None, cu_seqlens_k=None, cu_seqlens_k_new=None,
                           seqused_q=None, leftpad_k=None, page_size=None, max_seqlen_k_new=0, is_causal=False,
                           window_size_left=-1, window_size_right=-1, attention_chunk=0, has_softcap=False,
                           num_splits=0, pack_gqa=None, sm_margin=0):
    return fa3_api.get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, headdim,
                                          seqused_k, qkv_dtype, headdim_v, cu_seqlens_q, cu_seqlens_k_new, leftpad_k,
                                          page_size, max_seqlen_k_new, is_causal,
                                          (window_size_left, window_size_right), attention_chunk, has_softcap,
                                          num_splits, pack_gqa, sm_margin)


# ---- fake (meta) implementations: shapes only, for torch.compile and export
def _fwd_fake(q, k, v, k_new=None, v_new=None, q_v=None, out=None, cu_seqlens_q=None, *args, **kwargs):
    packed = q.dim() == 3
    lse = q.new_empty((q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1]),
                      dtype=torch.float32)
    o = out if out is not None else q.new_empty((*q.shape[:-1], v.shape[-1]))
    return o, lse, q.new_empty(0, dtype=torch.float32), q.new_empty(0, dtype=torch.float32)


def _bwd_fake(dout, q, k, v, out, softmax_lse, dq=None, dk=None, dv=None, *args, **kwargs):
    grads = [g if g is not None else torch.empty_like(t) for g, t in ((dq, q), (dk, k), (dv, v))]
    empty = q.new_empty(0, dtype=torch.float32)
    return (*grads, torch.empty_like(softmax_lse), torch.empty_like(softmax_lse), empty, empty.clone(),
            empty.clone())


def _combine_fake(out_partial, lse_partial, out=None, out_dtype=None):
    dtype = out_dtype if out_dtype is not None else out_partial.dtype
    o = out if out is not None else out_partial.new_empty(out_partial.shape[1:], dtype=dtype)
    return o, lse_partial.new_empty(lse_partial.shape[1:])


def _metadata_fake(batch_size, *args, **kwargs):
    return torch.empty(2, dtype=torch.int32, device=args[7].device)


_LIBRARY = None


def register() -> bool:
    """Defines torch.ops.flash_attn_3's four ops on autoflash; False (and nothing defined) where FA3's
    extension is installed (the flash_attn_3 package) or another library already defines them."""
    global _LIBRARY
    if _LIBRARY is not None:
        return True
    if importlib.util.find_spec(NAMESPACE) is not None or _defined(f"{NAMESPACE}::fwd"):
        return False
    library = torch.library.Library(NAMESPACE, "FRAGMENT")
    impls = {"fwd": (fwd, _fwd_fake), "bwd": (bwd, _bwd_fake), "fwd_combine": (fwd_combine, _combine_fake),
             "get_scheduler_metadata": (get_scheduler_metadata, _metadata_fake)}
    for name, schema in SCHEMAS.items():
        library.define(schema)
        real, fake = impls[name]
        library.impl(name, real, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=library)
    _LIBRARY = library
    return True


def _defined(qualname: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(qualname, "")
        return True
    except RuntimeError:
        return False
