"""FlashAttention-3's Python API (hopper/flash_attn_interface.py) on autoflash's kernels: the same
function names, argument names, order, defaults, layouts and return values, so that
`from autoflash.flash_attn_interface import flash_attn_func` replaces
`from flash_attn_interface import flash_attn_func`.

Each call checks its arguments and runs through flash-attn 2.x's API here (dispatch/flash_api.py,
dispatch/kvcache.py): the same custom ops, autograd and torch.compile support, the same emulation on
CPU tensors inside autoflash.emulate() and the same reference fallback outside it.

What FlashAttention-3 has and autoflash does not run raises ValueError naming the argument: fp8
inputs with descales (q_descale, k_descale, v_descale). qv in flash_attn_with_kvcache (DeepSeek's MLA
decode) runs on the sm90 family's KV-cache kernel, which reads each V tile once for both products (an
H100 or H200; elsewhere a ValueError that says so). qv in flash_attn_func and flash_attn_varlen_func
(scores q . k + q_v . v, forward only as in FA3) runs on that same kernel on an H100 or H200, k and
v taken as the cache (_qv_over_cache); elsewhere as one product of [q, qv] with [k, v], their columns
appended per call (a copy of k and v). attention_chunk, seqused_q / seqused_k,
rotary_seqlens and flash_attn_with_kvcache's packed queries and new keys (cu_seqlens_q,
cu_seqlens_k_new) run as FA3 runs them. num_splits, pack_gqa and sm_margin are scheduling choices that
do not change the result: they are checked and taken as FA3 takes them where autoflash has the same
choice (num_splits of the KV-cache kernel), and otherwise left to autoflash's own plan (the dense
forward never splits; query heads are folded into one tile by the KV-cache kernel, which
flash_attn_func also runs for small GQA calls without a gradient (flash_api.packs_query_heads);
it uses every SM)."""
from __future__ import annotations

import dataclasses

import torch

from autoflash.dispatch import flash_api, kvcache
from autoflash.kernels.checks import check_qv_shape, chunk_size, cu_seqlens_vector

__all__ = ["flash_attn_combine", "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_with_kvcache", "get_scheduler_metadata"]


def _refuse(name: str, value, missing: str) -> None:
    """ValueError where FA3's argument `name` asks for what autoflash does not run."""
    if value is None:
        return
    shown = f"a {type(value).__name__}" if isinstance(value, torch.Tensor) else repr(value)
    raise ValueError(f"{name}: got {shown}, expected None: autoflash does not run {missing}")


def _unsupported(q_descale=None, k_descale=None, v_descale=None) -> None:
    for name, value in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        _refuse(name, value, "fp8 inputs with descales yet")


def _with_qv(q, k, v, qv, softmax_scale):
    """(q, k, softmax_scale) of a call with FA3's qv (q's rows with dv columns more, v's width): the
    scores q . k + q_v . v as one product, [q, qv] . [k, v], and FA3's default scale for them,
    1/sqrt(d + dv). Without qv, the arguments as they are."""
    if qv is None:
        return q, k, softmax_scale
    for name, t in (("q", q), ("k", k), ("v", v), ("qv", qv)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    check_qv_shape(qv, q, v.shape[-1], "v")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v shapes: got {tuple(k.shape)} and {tuple(v.shape)}; expected them equal but for the "
                         f"head dim")
    if softmax_scale is None:
        softmax_scale = (q.shape[-1] + v.shape[-1]) ** -0.5
    return torch.cat([q, qv], -1), torch.cat([k, v], -1), softmax_scale


def _qv_over_cache(q, k, v, qv, softmax_scale, causal, window_size, attention_chunk, softcap, num_splits,
                   packed=None):
    """FA3's qv on an H100 or H200: k and v taken as a KV cache by flash_attn_with_kvcache, whose sm90
    kernel has the qv switch (each V tile read once for both products, k and v not copied), aligned
    bottom-right as flash_attn_func is. `packed` (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_q,
    seqused_k): all keys in one cache row, sequence b's at rows cu_seqlens_k[b] .. + its length
    (cache_batch_idx 0 for every sequence, cache_leftpad its first row); the queries packed by
    cu_seqlens_q with seqused_q as the KV cache takes them. Returns (out, lse), or None where that
    kernel does not take the call (another GPU, fp32, head dims off multiples of 16, no kernels at
    all): the product of [q, qv] with [k, v] runs then."""
    from autoflash.kernels.checks import DTYPE_NAMES
    from autoflash.kernels.decode import qv_applies

    if qv is None:
        return None
    flash_api._check_qkv(q, k, v, "bshd" if packed is None else "thd")  # the errors name q, k and v, not the cache
    profile = flash_api.planned_profile(q)
    if profile is None or not qv_applies(q.shape[-1], v.shape[-1], DTYPE_NAMES[q.dtype], profile):
        return None
    check_qv_shape(qv, q, v.shape[-1], "v")
    kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
              num_splits=num_splits, return_softmax_lse=True, attention_chunk=attention_chunk, qv=qv)
    if packed is None:
        return kvcache.flash_attn_with_kvcache(q, k, v, cache_seqlens=k.shape[1], **kw)
    cu_q, cu_k, max_q, used_q, used_k = packed
    starts = cu_k[:-1]
    ends = cu_k[1:] if used_k is None else starts + used_k
    rows = torch.zeros(starts.shape, dtype=torch.int32, device=cu_k.device)
    return kvcache.flash_attn_with_kvcache(q, k[None], v[None], cache_seqlens=ends.to(torch.int32),
                                           cache_batch_idx=rows, cache_leftpad=starts.to(torch.int32),
                                           cu_seqlens_q=cu_q, max_seqlen_q=max_q, seqused_q=used_q, **kw)


def _qv_run(run, qv, d: int):
    """run() with FA3's qv appended to q (d its own columns): under explain() the captured call notes
    it, since the kernel then shows Q and K as wide as both."""
    try:
        return run()
    except flash_api.Captured as captured:
        if qv is not None:
            note = (f"qv: the scores q . k + q_v . v run as one product of [q, qv] with [k, v], Q and K {d} + "
                    f"{qv.shape[-1]} columns wide (k and v copied for each call); forward only",)
            captured.call = dataclasses.replace(captured.call, notes=note + captured.call.notes)
        raise


def _qv_forward_only(out, qv, entry: str, *inputs):
    """flash_attn_func's result with qv: its gradient an error that names qv (FA3 has no backward
    with it either)."""
    if qv is None:
        return out
    if isinstance(out, tuple):
        o, lse = kvcache.forward_only(out[0], out[1], f"{entry} with qv", *inputs, qv)
        return (o, lse, *out[2:])
    return kvcache.forward_only(out, None, f"{entry} with qv", *inputs, qv)[0]


def _check_hints(num_splits, pack_gqa, sm_margin) -> None:
    """FA3's scheduling arguments: checked, never a reason for a different result."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits: got {num_splits!r}, expected an int >= 0 (0 chooses)")
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise TypeError(f"pack_gqa: got {pack_gqa!r}, expected None or a bool")
    if isinstance(sm_margin, bool) or not isinstance(sm_margin, int) or sm_margin < 0:
        raise ValueError(f"sm_margin: got {sm_margin!r}, expected an int >= 0")


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, sm_margin=0, return_attn_probs=False):
    """FlashAttention-3's flash_attn_func: q (batch, seqlen_q, heads, head_dim), k and v (batch, seqlen_k,
    heads_k, head_dim), heads_k dividing heads; causal, window_size and attention_chunk (> 0: only the
    keys of the chunk holding query i's diagonal key) bottom-right aligned; softcap > 0 caps the
    scores. Returns out (batch, seqlen_q, heads, head_dim), or with return_attn_probs (out,
    softmax_lse (batch, heads, seqlen_q) fp32). Differentiable in q, k, v. v may have a head dim of its
    own (FA3's headdim_v); qv (batch, seqlen_q, heads, v's head dim) adds q_v . v to the scores
    (forward only; _with_qv)."""
    _unsupported(q_descale, k_descale, v_descale)
    _check_hints(num_splits, pack_gqa, sm_margin)
    out = _qv_over_cache(q, k, v, qv, softmax_scale, causal, window_size, attention_chunk, softcap, num_splits)
    if out is None:
        qk, kk, scale = _with_qv(q, k, v, qv, softmax_scale)
        out = _qv_run(lambda: flash_api.flash_attn_func(qk, kk, v, 0.0, scale, causal, window_size, softcap, None,
                                                        deterministic, return_attn_probs,
                                                        attention_chunk=attention_chunk), qv, q.shape[-1])
    elif not return_attn_probs:
        out = out[0]
    out = _qv_forward_only(out, qv, "flash_attn_func", q, k, v)
    return out[:2] if return_attn_probs else out  # FA3: (out, softmax_lse), flash-attn 2: + None


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """FlashAttention-3's flash_attn_varlen_func: packed sequences q (total_q, heads, head_dim), k and v
    (total_k, heads_k, head_dim) with int32 cu_seqlens_q / cu_seqlens_k (batch + 1,) and host ints
    max_seqlen_q / max_seqlen_k. Returns out (total_q, heads, head_dim), or with return_attn_probs
    (out, softmax_lse (heads, total_q) fp32). seqused_q / seqused_k (int32 (batch,)): only the first
    seqused[b] rows of sequence b's span are used, as in FA3 (autoflash gives the rest out 0, lse +inf).
    qv (total_q, heads, v's head dim) as in flash_attn_func."""
    _unsupported(q_descale, k_descale, v_descale)
    _check_hints(num_splits, pack_gqa, sm_margin)
    out = None
    if isinstance(cu_seqlens_k, torch.Tensor):
        out = _qv_over_cache(q, k, v, qv, softmax_scale, causal, window_size, attention_chunk, softcap, num_splits,
                             (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_q, seqused_k))
    if out is None:
        qk, kk, scale = _with_qv(q, k, v, qv, softmax_scale)
        out = _qv_run(lambda: flash_api.flash_attn_varlen_func(
            qk, kk, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, scale, causal, window_size,
            softcap, None, deterministic, return_attn_probs, attention_chunk=attention_chunk, seqused_q=seqused_q,
            seqused_k=seqused_k), qv, q.shape[-1])
    elif not return_attn_probs:
        out = out[0]
    out = _qv_forward_only(out, qv, "flash_attn_varlen_func", q, k, v)
    return out[:2] if return_attn_probs else out  # FA3: (out, softmax_lse), flash-attn 2: + None


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None,
                              window_size=(-1, -1), attention_chunk=0, softcap=0.0, deterministic=False,
                              num_heads_q=None, sm_margin=0, return_attn_probs=False):
    """flash_attn_func on qkv (batch, seqlen, 3, heads, head_dim), or with num_heads_q (batch, seqlen,
    num_heads_q + 2 heads_k, head_dim): q's heads, then k's, then v's (FA3's packed GQA layout). The
    gradient comes back packed."""
    _unsupported(q_descale, k_descale, v_descale)  # before the layout's checks
    _check_hints(1, None, sm_margin)
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv: got {type(qkv).__name__}, expected a torch.Tensor")
    if num_heads_q is None:
        if qkv.dim() != 5 or qkv.shape[2] != 3:
            raise ValueError(f"qkv: got shape {tuple(qkv.shape)}, expected (batch, seqlen, 3, heads, head_dim)")
        q, k, v = qkv.unbind(2)
    else:
        heads = qkv.shape[2] if qkv.dim() == 4 else -1
        if isinstance(num_heads_q, bool) or not isinstance(num_heads_q, int) or qkv.dim() != 4 \
                or not 0 < num_heads_q < heads or (heads - num_heads_q) % 2:
            raise ValueError(f"qkv, num_heads_q: got shape {tuple(qkv.shape)} and {num_heads_q!r}, expected (batch, "
                             f"seqlen, num_heads_q + 2 * heads_k, head_dim) with 0 < num_heads_q")
        heads_k = (heads - num_heads_q) // 2
        q, k, v = qkv.split([num_heads_q, heads_k, heads_k], dim=2)
    return flash_attn_func(q, k, v, softmax_scale, causal, None, q_descale, k_descale, v_descale, window_size,
                           attention_chunk, softcap, deterministic=deterministic, sm_margin=sm_margin,
                           return_attn_probs=return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False):
    """FlashAttention-3's flash_attn_with_kvcache: flash-attn 2.x's (autoflash.flash_attn_with_kvcache)
    with page_table for block_table. scheduler_metadata is get_scheduler_metadata's plan (its split
    count); num_splits 0 chooses, as FA3's. Returns out, or with return_softmax_lse (out,
    softmax_lse). rotary_seqlens moves the rotary positions as FA3's does. cu_seqlens_q (with
    max_seqlen_q) packs q as (total_q, heads, head_dim) and cu_seqlens_k_new packs k and v, as in FA3;
    the LSE of packed queries is (heads, total_q). qv adds qv . v to the scores (FA3's; the sm90 family's
    kernel, softmax_scale by default 1/sqrt(headdim + headdim_v))."""
    _unsupported(q_descale, k_descale, v_descale)
    _check_hints(num_splits, pack_gqa, sm_margin)
    if scheduler_metadata is not None:
        num_splits = _planned_splits(scheduler_metadata, num_splits)
    return kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                           cache_batch_idx, cache_leftpad, page_table, softmax_scale, causal,
                                           window_size, softcap, rotary_interleaved, None, num_splits,
                                           return_softmax_lse, attention_chunk=attention_chunk,
                                           rotary_seqlens=rotary_seqlens, cu_seqlens_q=cu_seqlens_q,
                                           cu_seqlens_k_new=cu_seqlens_k_new, max_seqlen_q=max_seqlen_q, qv=qv)


# get_scheduler_metadata's plan: int32 [PLAN_TAG, num_splits] (FA3's own metadata is its scheduler's
# tile counters, which autoflash's kernels do not take).
PLAN_TAG = 0x61664C31  # "afL1"


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim, cache_seqlens,
                           qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None, cu_seqlens_k_new=None,
                           cache_leftpad=None, page_size=None, max_seqlen_k_new=0, causal=False, window_size=(-1, -1),
                           attention_chunk=0, has_softcap=False, num_splits=0, pack_gqa=None, sm_margin=0):
    """autoflash's split plan for flash_attn_with_kvcache calls of this shape on the current GPU (the
    emulated one inside autoflash.emulate()): an int32 tensor on cache_seqlens' device holding the
    number of key splits, which flash_attn_with_kvcache(scheduler_metadata=...) then runs. num_splits
    > 0 is taken as given, 0 chooses (kernels.decode.choose_num_splits, FlashAttention-2's heuristic
    over the SMs)."""
    from autoflash.kernels.decode import MAX_SPLITS

    attention_chunk = chunk_size("attention_chunk", attention_chunk)
    _check_hints(num_splits, pack_gqa, sm_margin)
    headdim_v = headdim if headdim_v is None else headdim_v
    for name, value in (("batch_size", batch_size), ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k),
                        ("num_heads_q", num_heads_q), ("num_heads_kv", num_heads_kv), ("headdim", headdim),
                        ("headdim_v", headdim_v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "max_seqlen_k" else 1):
            raise ValueError(f"{name}: got {value!r}, expected a positive int")
    if num_heads_q % num_heads_kv:
        raise ValueError(f"num_heads_q, num_heads_kv: got {num_heads_q}, {num_heads_kv}; expected num_heads_kv "
                         f"dividing num_heads_q")
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens: got {type(cache_seqlens).__name__}, expected an int32 torch.Tensor")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k_new", cu_seqlens_k_new)):
        if cu is not None and cu_seqlens_vector(name, cu, cache_seqlens.device) != batch_size:
            raise ValueError(f"{name}: got {cu.numel()} entries, expected batch_size + 1 = {batch_size + 1}")
    if num_splits == 0:
        num_splits = _choose_splits(batch_size, max_seqlen_q, max_seqlen_k + max_seqlen_k_new, num_heads_q,
                                    num_heads_kv, headdim, qkv_dtype, page_size, causal, window_size, has_softcap,
                                    cache_seqlens, attention_chunk, cache_leftpad is not None, headdim_v)
    num_splits = max(1, min(num_splits, MAX_SPLITS))
    return torch.tensor([PLAN_TAG, num_splits], dtype=torch.int32, device=cache_seqlens.device)


def _choose_splits(batch, seqlen_q, capacity, heads, heads_kv, head_dim, dtype, page_size, causal, window_size,
                   softcap: bool, like: torch.Tensor, attention_chunk: int, leftpad: bool, head_dim_v: int) -> int:
    """The split count flash_attn_with_kvcache(num_splits=0) would choose for such a call on the GPU of
    `like` (kernels.decode.decode_launch, its variant from kernels.variants.resolve on stand-ins of
    the call's q and cache); 1 on CPU tensors outside autoflash.emulate(), where the PyTorch
    reference runs unsplit."""
    from autoflash.kernels.checks import DTYPE_NAMES
    from autoflash.kernels.decode import CacheShape, decode_launch, packed_heads
    from autoflash.kernels.launch import profile_for
    from autoflash.kernels.variants import resolve

    try:
        profile = profile_for(like, "get_scheduler_metadata")
    except ValueError:
        return 1
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"qkv_dtype: got {dtype!r}, expected torch.float16 or torch.bfloat16")
    d = flash_api.padded_head_dim(head_dim)
    dv = None if head_dim_v == head_dim else flash_api.padded_head_dim_v(head_dim_v)
    shape = CacheShape(batch, seqlen_q, heads, heads_kv, d, max(1, capacity), page_size, 0, leftpad=leftpad,
                       head_dim_v=dv)
    q = flash_api.stand_in((batch, heads, seqlen_q, d), dtype, like.device)
    k = flash_api.stand_in((batch, heads_kv, shape.capacity, d), dtype, like.device)
    causal, variant = resolve(q, k, causal, align="bottom_right", window=window_size, softcap=1.0 if softcap else 0.0,
                              cache_len=shape.capacity, attention_chunk=attention_chunk)
    return decode_launch(shape, DTYPE_NAMES[dtype], profile, causal, variant, None, 0, packed_heads(shape, None))[1]


def _planned_splits(plan, num_splits: int) -> int:
    """The split count of get_scheduler_metadata's plan (num_splits > 0 overrides it, as in FA3)."""
    if not isinstance(plan, torch.Tensor) or plan.dtype != torch.int32 or plan.shape != (2,) \
            or int(plan[0]) != PLAN_TAG:
        got = f"{plan.dtype} {tuple(plan.shape)}" if isinstance(plan, torch.Tensor) else type(plan).__name__
        raise ValueError(f"scheduler_metadata: got {got}, expected autoflash's get_scheduler_metadata(...) result "
                         f"(FlashAttention-3's own metadata describes its scheduler, not autoflash's)")
    return num_splits or int(plan[1])


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """FlashAttention-3's flash_attn_combine: partial results of num_splits key ranges merged exactly.
    out_partial (num_splits, batch, seqlen, heads, head_dim) fp32, lse_partial (num_splits, batch, seqlen,
    heads) fp32 (natural log; -inf for a split that saw no key); out_dtype defaults to out_partial's.
    Returns (out (batch, seqlen, heads, head_dim), softmax_lse (batch, seqlen, heads) fp32: -inf and
    out 0 where no split saw a key), into `out` where given. Runs as torch operations (no kernel of its
    own), in fp32 as FA3's kernel does."""
    for name, t, dims in (("out_partial", out_partial, 5), ("lse_partial", lse_partial, 4)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
        if t.dtype != torch.float32 or t.dim() != dims:
            raise ValueError(f"{name}: got {t.dtype} of shape {tuple(t.shape)}, expected float32 with {dims} dims")
    shape = tuple(out_partial.shape)
    if tuple(lse_partial.shape) != shape[:4]:
        raise ValueError(f"lse_partial: got shape {tuple(lse_partial.shape)}, expected (num_splits, batch, seqlen, "
                         f"heads) = {shape[:4]} for out_partial {shape}")
    dtype = out_dtype if out_dtype is not None else out_partial.dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"out_dtype: got {dtype!r}, expected torch.float32, torch.float16 or torch.bfloat16")
    if out is not None and (not isinstance(out, torch.Tensor) or tuple(out.shape) != shape[1:] or out.dtype != dtype):
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out: got {got}, expected a {dtype} tensor of shape {shape[1:]}")
    lse = torch.logsumexp(lse_partial, dim=0)  # (batch, seqlen, heads); -inf where no split saw a key
    weights = torch.exp(lse_partial - lse).nan_to_num(0.0, posinf=0.0)  # 0 for those, not NaN
    merged = (weights.unsqueeze(-1) * out_partial).sum(0)
    if out is None:
        return merged.to(dtype), lse
    out.copy_(merged)
    return out, lse
