"""FlashAttention-3's Python API (autoflash.flash_attn_interface): FA3's names, argument order and
return values over autoflash's kernels, on an emulated H100 under FA3's own test rule (its
hopper/test_flash_attn.py: out and gradients within 2x PyTorch's own error in the input dtype plus
the reference's rounding, 3x with softcap; autoflash.reference.forward.within_tolerance), the
features it does not run refused by name, get_scheduler_metadata's plan taken by
flash_attn_with_kvcache, and flash_attn_combine against FA3's attention_combine_ref."""
import math

import pytest
import torch

import autoflash
from autoflash import flash_attn_interface as fa3
from autoflash.reference.forward import attention_ref, attention_varlen_ref, within_tolerance


def _bshd(b, lq, lk, hq, hk, d, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).bfloat16().requires_grad_(grad)
            for shape in ((b, lq, hq, d), (b, lk, hk, d), (b, lk, hk, d))]


def _ref(q, k, v, *, upcast=True, **kw):
    """attention_ref on FA3's layout and keywords, bottom-right aligned."""
    kw = {"window" if name == "window_size" else name: value for name, value in kw.items()}
    out, lse = attention_ref(*(t.transpose(1, 2) for t in (q, k, v)), align="bottom_right", upcast=upcast, **kw)
    return out.transpose(1, 2), lse


def test_the_module_has_fa3s_names_and_argument_order():
    import inspect

    assert fa3.__all__ == ["flash_attn_combine", "flash_attn_func", "flash_attn_qkvpacked_func",
                           "flash_attn_varlen_func", "flash_attn_with_kvcache", "get_scheduler_metadata"]
    params = list(inspect.signature(fa3.flash_attn_func).parameters)
    assert params == ["q", "k", "v", "softmax_scale", "causal", "qv", "q_descale", "k_descale", "v_descale",
                      "window_size", "attention_chunk", "softcap", "num_splits", "pack_gqa", "deterministic",
                      "sm_margin", "return_attn_probs"]
    params = list(inspect.signature(fa3.flash_attn_varlen_func).parameters)
    assert params[:9] == ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "seqused_q",
                          "seqused_k"]
    params = list(inspect.signature(fa3.flash_attn_with_kvcache).parameters)
    assert params[:12] == ["q", "k_cache", "v_cache", "k", "v", "qv", "rotary_cos", "rotary_sin", "cache_seqlens",
                           "cache_batch_idx", "cache_leftpad", "page_table"]


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(9, 0), softcap=4.0), dict(),
                                dict(causal=True, attention_chunk=40)],
                         ids=["causal", "window-softcap", "plain", "chunk"])
def test_flash_attn_func_on_an_emulated_h100_meets_fa3s_rule(kw, launched):
    q, k, v = _bshd(2, 77, 133, 4, 2, 64, seed=3, grad=True)
    with autoflash.emulate("h100"):
        out, lse = fa3.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
        plain = fa3.flash_attn_func(q, k, v, **kw)
        out.backward(torch.ones_like(out))
    assert [c.family for c in launched] == ["sm90"] * 3  # the backward of every variant too
    assert torch.equal(out, plain)  # out alone without return_attn_probs, as FA3 returns it
    up = [t.detach().float().requires_grad_() for t in (q, k, v)]
    same = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = _ref(*up, **kw)
    torch_out, _ = _ref(*same, upcast=False, **kw)
    cap = kw.get("softcap", 0.0)
    ok, err, bound = within_tolerance(out.detach(), ref.detach(), torch_out.detach(), softcap=cap)
    assert ok, f"out: err {err:.3e} > bound {bound:.3e}"
    assert within_tolerance(lse, ref_lse.detach(), ref_lse.detach(), atol=1e-3)[0]
    ref.backward(torch.ones_like(ref))
    torch_out.backward(torch.ones_like(torch_out))
    for name, got, want, yard in zip("qkv", (q.grad, k.grad, v.grad), (t.grad for t in up), (t.grad for t in same)):
        ok, err, bound = within_tolerance(got, want, yard, softcap=cap, backward=True)
        assert ok, f"d{name}: err {err:.3e} > bound {bound:.3e}"


def test_varlen_and_packed_qkv_with_gqa(launched):
    g = torch.Generator().manual_seed(4)
    lens = [0, 1, 70, 33]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v = (torch.randn(sum(lens), h, 64, generator=g).bfloat16() for h in (4, 2, 2))
    with autoflash.emulate("h100"):
        out = fa3.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, num_splits=3,
                                         pack_gqa=True, sm_margin=8)
    ref, _ = attention_varlen_ref(q.float(), k.float(), v.float(), cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
                                  align="bottom_right")
    torch_out, _ = attention_varlen_ref(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, align="bottom_right",
                                        upcast=False)
    assert within_tolerance(out, ref, torch_out)[0]
    assert launched[-1].family == "sm90" and launched[-1].varlen
    # FA3's packed GQA layout: q's heads, then k's, then v's
    qkv = torch.cat(_bshd(1, 40, 40, 4, 2, 64, seed=5), dim=2)
    with autoflash.emulate("h100"):
        packed = fa3.flash_attn_qkvpacked_func(qkv, causal=True, num_heads_q=4)
        split = fa3.flash_attn_func(qkv[:, :, :4], qkv[:, :, 4:6], qkv[:, :, 6:], causal=True)
    assert torch.equal(packed, split)


@pytest.mark.parametrize("call, name", [
    (lambda q: fa3.flash_attn_with_kvcache(q, q, q, qv=q[..., :16], cache_seqlens=4), "qv"),  # v_cache's width
    (lambda q: fa3.flash_attn_func(q, q, q, q_descale=torch.ones(1, 2)), "q_descale"),
    (lambda q: fa3.flash_attn_func(q, q, q, attention_chunk=-16), "attention_chunk"),
    (lambda q: fa3.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 8], dtype=torch.int32),
                                          torch.tensor([0, 8], dtype=torch.int32), 8, 8,
                                          seqused_k=torch.tensor([4])), "seqused_k"),  # int64
    (lambda q: fa3.flash_attn_with_kvcache(q[0], q, q, cache_seqlens=4,  # packed queries need max_seqlen_q
                                           cu_seqlens_q=torch.tensor([0, 8], dtype=torch.int32)), "max_seqlen_q"),
    (lambda q: fa3.flash_attn_with_kvcache(q, q, q, cache_seqlens=4, cu_seqlens_q=torch.tensor([0, 8]),
                                           max_seqlen_q=8), "q"),  # 4-D q: not packed
    (lambda q: fa3.flash_attn_func(q, q, q, num_splits=-1), "num_splits"),
    (lambda q: fa3.flash_attn_with_kvcache(q, q, q, cache_seqlens=4, rotary_seqlens=[1]), "rotary_seqlens"),
    (lambda q: fa3.flash_attn_func(q, q, torch.cat([q, q], 1)), "k and v shapes"),  # V's head dim alone may differ
    (lambda q: fa3.flash_attn_with_kvcache(q, q, q, cache_seqlens=4, scheduler_metadata=torch.zeros(7)),
     "scheduler_metadata"),
])
def test_what_autoflash_does_not_run_is_refused_by_name(call, name):
    q = torch.randn(1, 8, 2, 64).bfloat16()
    with pytest.raises((ValueError, TypeError), match=f"^{name}: got") as refused:
        call(q)
    assert name != "k and v shapes" or "but for the head dim" in str(refused.value)


def test_varlen_with_seqused_on_an_emulated_h100(launched):
    """FA3's seqused_q / seqused_k: only a prefix of each packed sequence is used (its test file passes
    them on every varlen call); the rows past it get out 0, lse +inf and no gradient."""
    g = torch.Generator().manual_seed(9)
    spans_q, spans_k = [5, 70, 0, 33], [9, 80, 4, 33]
    used = {"seqused_q": torch.tensor([3, 60, 0, 33], dtype=torch.int32),
            "seqused_k": torch.tensor([9, 41, 0, 20], dtype=torch.int32)}
    cu_q, cu_k = (torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32) for n in (spans_q, spans_k))
    q = torch.randn(sum(spans_q), 4, 64, generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(sum(spans_k), 2, 64, generator=g).bfloat16().requires_grad_() for _ in range(2))
    with autoflash.emulate("h100"):
        out, lse = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 70, 80, causal=True, return_attn_probs=True, **used)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert [c.family for c in launched] == ["sm90", "sm90"]
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    same = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attention_varlen_ref(*leaves, cu_q, cu_k, causal=True, align="bottom_right", **used)
    low, _ = attention_varlen_ref(*same, cu_q, cu_k, causal=True, align="bottom_right", upcast=False, **used)
    assert within_tolerance(out, ref.detach(), low.detach())[0]
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and bool(torch.isinf(lse[:, 3:5]).all())
    assert not out[3:5].any() and not grads[0][3:5].any() and not grads[1][9 + 41:9 + 80].any()
    for got, want, yard in zip(grads, torch.autograd.grad(ref, leaves, torch.ones_like(ref)),
                               torch.autograd.grad(low, same, torch.ones_like(low))):
        assert within_tolerance(got, want, yard, backward=True)[0]


def test_kvcache_with_attention_chunks(launched):
    """FA3's chunked local attention in the KV-cache kernel (Llama 4's decode): the queries of the last
    positions see only their chunk of the cache, split or not, paged or not."""
    from autoflash.reference.kvcache import attention_kvcache_ref

    g = torch.Generator().manual_seed(6)
    seqlens = [150, 37, 0]
    q = torch.randn(3, 2, 4, 64, generator=g).bfloat16()
    k_cache, v_cache = (torch.randn(3, 256, 2, 64, generator=g).bfloat16() for _ in range(2))
    ref, _ = attention_kvcache_ref(q.float(), k_cache.float(), v_cache.float(), seqlens, causal=True,
                                   attention_chunk=48)
    low, _ = attention_kvcache_ref(q, k_cache, v_cache, seqlens, causal=True, attention_chunk=48, upcast=False)
    cache_seqlens = torch.tensor(seqlens, dtype=torch.int32)
    pages = torch.arange(6, dtype=torch.int32).reshape(3, 2)
    with autoflash.emulate("h100"):
        for splits in (1, 3):
            out = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, causal=True,
                                              attention_chunk=48, num_splits=splits)
            assert within_tolerance(out, ref, low)[0], splits
        paged = fa3.flash_attn_with_kvcache(q, *(t.reshape(6, 128, 2, 64) for t in (k_cache, v_cache)),
                                           cache_seqlens=cache_seqlens, page_table=pages, causal=True,
                                           attention_chunk=48)
    assert within_tolerance(paged, ref, low)[0]
    assert all(c.kvcache and c.chunk for c in launched)


def test_kvcache_rotary_seqlens_moves_the_rotary_positions():
    """FA3's rotary_seqlens: q and the new keys rotated from rotary_seqlens[b], appended at
    cache_seqlens[b]; without rotary_cos it changes nothing (FA3's tests pass it on every call)."""
    from autoflash.reference.kvcache import append_ref, attention_kvcache_ref, rotary

    g = torch.Generator().manual_seed(8)
    seqlens, starts = [10, 20], [5, 0]
    q = torch.randn(2, 3, 4, 64, generator=g).bfloat16()
    k_new, v_new = (torch.randn(2, 3, 2, 64, generator=g).bfloat16() for _ in range(2))
    k_cache, v_cache = (torch.randn(2, 64, 2, 64, generator=g).bfloat16() for _ in range(2))
    cos, sin = (torch.randn(64, 16, generator=g).bfloat16() for _ in range(2))
    kc, vc = k_cache.clone(), v_cache.clone()
    positions = [[s + i for i in range(3)] for s in starts]
    append_ref(kc, rotary(k_new, cos, sin, positions, True), seqlens)
    append_ref(vc, v_new, seqlens)
    q_rot = rotary(q, cos, sin, positions, True)
    used = [s + 3 for s in seqlens]
    ref, _ = attention_kvcache_ref(q_rot.float(), kc.float(), vc.float(), used, causal=True)
    low, _ = attention_kvcache_ref(q_rot, kc, vc, used, causal=True, upcast=False)
    index = dict(cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
                 rotary_seqlens=torch.tensor(starts, dtype=torch.int32))
    with autoflash.emulate("h100"):
        out = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                          causal=True, **index)
        plain = fa3.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), causal=True, cache_seqlens=index["cache_seqlens"]
                                            + 3, rotary_seqlens=index["rotary_seqlens"])
    assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)
    assert within_tolerance(out, ref, low)[0]
    unrotated, _ = attention_kvcache_ref(q.float(), kc.float(), vc.float(), used, causal=True)
    assert within_tolerance(plain, unrotated, attention_kvcache_ref(q, kc, vc, used, causal=True, upcast=False)[0])[0]
    with pytest.raises(ValueError, match="^rotary_seqlens: got"), autoflash.emulate("h100"):
        fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                    cache_seqlens=index["cache_seqlens"], rotary_seqlens=torch.tensor([62, 0],
                                                                                                      dtype=torch.int32))


def test_the_scheduler_plan_is_the_split_flash_attn_with_kvcache_runs(monkeypatch):
    from autoflash.dispatch import kvcache

    seqlens = torch.tensor([900, 37], dtype=torch.int32)
    seen = []
    real = kvcache._kvcache  # the op's body, which an eager call runs
    monkeypatch.setattr(kvcache, "_kvcache", lambda *a: seen.append(a[25]) or real(*a))  # num_splits
    with autoflash.emulate("h100"):
        plan = fa3.get_scheduler_metadata(2, 1, 1024, 8, 2, 128, seqlens)
        forced = fa3.get_scheduler_metadata(2, 1, 1024, 8, 2, 128, seqlens, num_splits=3)
    assert plan.dtype == torch.int32 and int(plan[1]) > 1  # 2 x 2 blocks on 132 SMs: split
    assert int(forced[1]) == 3
    q = torch.randn(2, 1, 8, 128).bfloat16()
    cache = torch.randn(2, 1024, 2, 128).bfloat16()
    with autoflash.emulate("h100"):
        out, lse = fa3.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=seqlens, scheduler_metadata=plan,
                                               return_softmax_lse=True)
        again = fa3.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=seqlens, scheduler_metadata=forced)
    assert seen == [int(plan[1]), 3]
    ref = torch.stack([_ref(q[i:i + 1], cache[i:i + 1, :n], cache[i:i + 1, :n])[0][0]
                       for i, n in enumerate(seqlens.tolist())])
    assert (out.float() - ref).abs().max() < 2e-2 and (again.float() - ref).abs().max() < 2e-2


@pytest.mark.parametrize("call", [dict(window_size=(30, 0), softcap=5.0), dict(causal=True, attention_chunk=64),
                                  dict(causal=True, page_size=16, leftpad=True), dict(causal=True, headdim_v=512)],
                         ids=["window-softcap", "chunk", "pages", "headdim_v"])
def test_the_plan_is_the_split_count_num_splits_0_chooses(monkeypatch, call):
    """get_scheduler_metadata's count against the one flash_attn_with_kvcache(num_splits=0) picks for
    the same call: variants, chunks, pages gathered row by row (16-row pages, left padding), and V's
    own head dim (512: two blocks share each query block's O, so half the splits fill the GPU)."""
    from autoflash.kernels import decode

    chosen, real = [], decode.decode_launch
    monkeypatch.setattr(decode, "decode_launch", lambda *a: (lambda r: chosen.append(r[1]) or r)(real(*a)))
    call = dict(call)
    page, leftpad, dv = call.pop("page_size", None), call.pop("leftpad", False), call.pop("headdim_v", 128)
    seqlens = torch.tensor([700, 37], dtype=torch.int32)
    q = torch.randn(2, 1, 8, 128).bfloat16()
    cache = torch.randn(2 * 1024 // (page or 1024), page or 1024, 2, 128).bfloat16()
    v_cache = torch.randn(*cache.shape[:-1], dv).bfloat16()
    table = torch.arange(cache.shape[0], dtype=torch.int32).reshape(2, -1) if page else None
    pad = torch.tensor([5, 0], dtype=torch.int32) if leftpad else None
    with autoflash.emulate("h100"):
        plan = fa3.get_scheduler_metadata(2, 1, 1024, 8, 2, 128, seqlens, page_size=page, cache_leftpad=pad,
                                          causal=call.get("causal", False),
                                          window_size=call.get("window_size", (-1, -1)),
                                          attention_chunk=call.get("attention_chunk", 0), has_softcap="softcap" in call,
                                          headdim_v=dv)
        fa3.flash_attn_with_kvcache(q, cache, v_cache, cache_seqlens=seqlens, page_table=table, cache_leftpad=pad,
                                    **call)
    assert len(chosen) == 2 and chosen[0] == chosen[1] == int(plan[1]) and chosen[0] > 1


def test_flash_attn_combine_matches_fa3s_reference():
    """FA3's test_flash_attn_combine: non-contiguous partials, a third of the batch with no key in half
    the splits; its attention_combine_ref, written out."""
    g = torch.Generator().manual_seed(0)
    s, b, l, h, d = 5, 3, 17, 4, 64
    out_partial = torch.randn(2 * s, b, h, l, d, generator=g).transpose(2, 3)[:s]
    lse_partial = torch.randn(s, b, 2 * h, l, generator=g).transpose(-1, -2)[:, :, :, :h]
    lse_partial[s // 2:, :b // 3] = -math.inf
    lse_partial[:, 2, 5] = -math.inf  # a row no split saw a key of
    for dtype in (torch.float32, torch.bfloat16):
        out, lse = fa3.flash_attn_combine(out_partial, lse_partial, out_dtype=dtype)
        ref_lse = torch.logsumexp(lse_partial, dim=0)
        scale = torch.exp(lse_partial - ref_lse)
        scale = torch.where(torch.isinf(scale) | torch.isnan(scale), torch.zeros_like(scale), scale)
        ref = (scale.unsqueeze(-1) * out_partial).sum(0)
        assert out.dtype == dtype and out.shape == (b, l, h, d)
        torch.testing.assert_close(out.float(), ref, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-2)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
        assert (out[2, 5] == 0).all() and (lse[2, 5] == -math.inf).all()
    with pytest.raises(ValueError, match="lse_partial: got shape"):
        fa3.flash_attn_combine(out_partial, lse_partial[:, :, :, :2])
