"""flash-attn's Python API (autoflash.flash_attn_func and friends) and attention_variant.

On the CPU outside autoflash.emulate() the custom ops behind them run the PyTorch references, so
everything above the launch (argument checks, layouts, head-dim padding, packing, the custom ops'
schemas, fake implementations and autograd, torch.compile) is checked here against the references
themselves. TestEmulatedKernels runs the same API on the H100's kernels on the host emulator and
holds them to FlashAttention-3's accuracy rule."""
import math

import pytest
import torch

import autoflash
import sampling
from autoflash import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                       flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)
from autoflash.dispatch import variant_ops
from autoflash.dispatch.flash_api import attention_variant, padded_head_dim
from autoflash.reference.forward import attention_ref, within_tolerance


def _randn(shape, dtype, g, grad=False):
    return torch.randn(shape, generator=g).to(dtype).requires_grad_(grad)


def _bshd(b, lq, lk, hq, hk, d, dtype=torch.float16, seed=0, grad=True):
    """q (b, lq, hq, d), k and v (b, lk, hk, d): flash-attn's layout."""
    g = torch.Generator().manual_seed(seed)
    return _randn((b, lq, hq, d), dtype, g, grad), _randn((b, lk, hk, d), dtype, g, grad), \
        _randn((b, lk, hk, d), dtype, g, grad)


def _ref_bshd(q, k, v, *, upcast=True, **kw):
    """attention_ref on flash-attn's layout, bottom-right aligned: (out (b, lq, h, d), lse (b, h, lq))."""
    out, lse = attention_ref(*(t.transpose(1, 2) for t in (q, k, v)), align="bottom_right", upcast=upcast, **kw)
    return out.transpose(1, 2), lse


def _leaves(*ts, dtype=torch.float32):
    return [t.detach().to(dtype).requires_grad_() for t in ts]


def _slopes(shape, seed=1):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 0.3


def _close(got, want, tol=2e-3):
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# ------------------------------------------------------------------ reference path: flash_attn_func
# name: ((b, lq, lk, hq, hk, d), flash_attn_func keywords; "alibi": the slopes' shape)
DENSE = {
    "plain": ((2, 7, 9, 2, 2, 64), {}),
    "causal_lq_lt_lk": ((2, 5, 9, 2, 2, 64), {"causal": True}),
    "causal_lq_gt_lk": ((2, 9, 5, 2, 2, 32), {"causal": True}),  # the first rows see no key: out 0
    "window": ((2, 12, 12, 2, 2, 64), {"window_size": (3, 2)}),
    "window_left_only": ((1, 10, 14, 2, 1, 32), {"window_size": (4, -1)}),
    "window_right_only": ((1, 14, 10, 2, 1, 32), {"window_size": (-1, 3)}),
    "window_causal": ((2, 11, 11, 2, 2, 64), {"window_size": (4, 7), "causal": True}),
    "softcap": ((2, 8, 10, 2, 2, 64), {"softcap": 5.0, "causal": True}),
    "alibi_heads": ((2, 8, 10, 4, 2, 64), {"alibi": (4,)}),
    "alibi_batch_causal": ((2, 10, 8, 2, 2, 64), {"alibi": (2, 2), "causal": True}),
    "gqa": ((2, 8, 10, 6, 2, 64), {"causal": True}),
    "scale": ((1, 6, 6, 2, 2, 64), {"softmax_scale": 0.3}),
    "head_dim_59": ((2, 7, 9, 2, 2, 59), {"causal": True}),
    "head_dim_111": ((1, 7, 9, 4, 2, 111), {"window_size": (2, 1)}),
    "head_dim_16": ((2, 7, 9, 2, 2, 16), {"softcap": 3.0, "alibi": (2,)}),
}


def _call_kwargs(spec: dict, b: int, hq: int):
    """(flash_attn_func keywords, attention_ref keywords) of a DENSE entry."""
    kw = {n: x for n, x in spec.items() if n != "alibi"}
    if "alibi" in spec:
        kw["alibi_slopes"] = _slopes(spec["alibi"])
    ref = {"causal": kw.get("causal", False), "scale": kw.get("softmax_scale"),
           "window": kw.get("window_size", (-1, -1)), "softcap": kw.get("softcap", 0.0),
           "alibi_slopes": kw.get("alibi_slopes")}
    return kw, ref


@pytest.mark.parametrize("case", sorted(DENSE))
def test_flash_attn_func_matches_the_reference(case):
    (b, lq, lk, hq, hk, d), spec = DENSE[case]
    q, k, v = _bshd(b, lq, lk, hq, hk, d)
    kw, ref_kw = _call_kwargs(spec, b, hq)
    out, lse, probs = flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype and probs is None
    assert lse.shape == (b, hq, lq) and lse.dtype == torch.float32
    leaves = _leaves(q, k, v)
    ref, ref_lse = _ref_bshd(*leaves, **ref_kw)
    _close(out, ref)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)  # +inf where a row sees no key, in both

    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, leaves, dout.float())
    for name, got, want, t in zip("qkv", grads, ref_grads, (q, k, v)):
        assert got.shape == t.shape and got.dtype == t.dtype, name  # the original width, not the padded one
        _close(got, want, 5e-3)


def test_flash_attn_func_returns_out_alone_by_default_in_flash_attn_layout():
    q, k, v = _bshd(2, 6, 6, 2, 2, 64, grad=False)
    out = flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 6, 2, 64)
    assert out.is_contiguous()  # the BHSD result, transposed back to BSHD: q's own layout


@pytest.mark.parametrize("d", [1, 16, 20, 59, 111, 200, 256])
def test_padded_head_dims(d):
    assert padded_head_dim(d) % 8 == 0 and 32 <= padded_head_dim(d) <= 256 and padded_head_dim(d) >= d
    assert padded_head_dim(d) == d or d < 32 or d % 8


def test_padding_keeps_the_default_scale_of_the_original_head_dim(monkeypatch):
    seen = []
    real = variant_ops._forward_reference
    monkeypatch.setattr(variant_ops, "_forward_reference",
                        lambda q, k, v, scale, kw: seen.append((q.shape[-1], scale)) or real(q, k, v, scale, kw))
    q, k, v = _bshd(1, 4, 4, 2, 2, 59, grad=False)
    flash_attn_func(q, k, v)
    assert seen == [(64, pytest.approx(1 / math.sqrt(59)))]


def test_causal_right_side_of_the_window_is_zero():
    q, k, v = _bshd(1, 9, 12, 2, 2, 32, grad=False)
    assert torch.equal(flash_attn_func(q, k, v, causal=True, window_size=(3, 5)),
                       flash_attn_func(q, k, v, causal=True, window_size=(3, 0)))
    assert torch.equal(flash_attn_func(q, k, v, causal=True), flash_attn_func(q, k, v, window_size=(-1, 0)))


# ------------------------------------------------------------------ reference path: packed sequences
def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# name: (lengths q, lengths k, hq, hk, d, keywords); zero-length and length-1 sequences included
VARLEN = {
    "plain": ((3, 0, 1, 7), (5, 2, 4, 9), 2, 2, 64, {}),
    "causal": ((3, 1, 7, 4), (5, 1, 9, 2), 4, 2, 64, {"causal": True}),
    "no_keys": ((3, 2, 5), (4, 0, 6), 2, 1, 32, {"causal": True}),  # a sequence whose rows see no key
    "window_alibi": ((6, 1, 8), (6, 3, 10), 2, 2, 64, {"window_size": (2, 1), "alibi": (3, 2)}),
    "softcap_padded": ((5, 0, 4), (7, 2, 4), 2, 2, 20, {"softcap": 4.0, "alibi": (2,)}),
}


def _varlen_case(name, dtype=torch.float16, grad=True):
    lq, lk, hq, hk, d, spec = VARLEN[name]
    g = torch.Generator().manual_seed(3)
    q = _randn((sum(lq), hq, d), dtype, g, grad)
    k, v = (_randn((sum(lk), hk, d), dtype, g, grad) for _ in range(2))
    kw, ref_kw = _call_kwargs(spec, len(lq), hq)
    return (q, k, v), (lq, lk), kw, ref_kw


def _varlen_reference(q, k, v, lengths_q, lengths_k, ref_kw):
    """(out (total_q, h, d), lse (h, total_q)): attention_ref per sequence, bottom-right aligned;
    a sequence with no keys gives out 0 and lse +inf (it cannot go through the dense reference)."""
    outs, lses = [], []
    q0 = k0 = 0
    for b, (n, m) in enumerate(zip(lengths_q, lengths_k)):
        qs, ks, vs = q[q0:q0 + n], k[k0:k0 + m], v[k0:k0 + m]
        q0, k0 = q0 + n, k0 + m
        if n == 0:
            continue
        if m == 0:
            outs.append(qs * 0)
            lses.append(torch.full((q.shape[1], n), math.inf))
            continue
        kw = dict(ref_kw)
        if kw["alibi_slopes"] is not None and kw["alibi_slopes"].dim() == 2:
            kw["alibi_slopes"] = kw["alibi_slopes"][b:b + 1]
        out, lse = _ref_bshd(qs[None], ks[None], vs[None], **kw)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("case", sorted(VARLEN))
def test_varlen_matches_the_reference_per_sequence(case):
    (q, k, v), (lq, lk), kw, ref_kw = _varlen_case(case)
    out, lse, probs = flash_attn_varlen_func(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), return_attn_probs=True,
                                             **kw)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0]) and probs is None
    leaves = _leaves(q, k, v)
    ref, ref_lse = _varlen_reference(*leaves, lq, lk, ref_kw)
    _close(out, ref)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
    for name, got, want in zip("qkv", torch.autograd.grad(out, (q, k, v), dout),
                               torch.autograd.grad(ref, leaves, dout.float(), allow_unused=True)):
        want = torch.zeros(got.shape) if want is None else want  # keys no query reads
        assert got.dtype == torch.float16, name
        _close(got, want, 5e-3)


def test_varlen_accepts_a_larger_max_seqlen_and_numpy_ints():
    import numpy as np

    (q, k, v), (lq, lk), kw, _ = _varlen_case("plain", grad=False)
    a = flash_attn_varlen_func(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk))
    b = flash_attn_varlen_func(q, k, v, _cu(lq), _cu(lk), np.int64(max(lq) + 5), max(lk) + 1)
    assert torch.equal(a, b)


# ------------------------------------------------------------------ the packed wrappers
def _grads(out, inputs, seed=11):
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return torch.autograd.grad(out, inputs, dout)


def test_qkvpacked_equals_the_unpacked_call():
    g = torch.Generator().manual_seed(0)
    qkv = _randn((2, 9, 3, 2, 40), torch.bfloat16, g, True)
    kw = dict(causal=True, window_size=(4, -1), softcap=2.0)
    out = flash_attn_qkvpacked_func(qkv, **kw)
    q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(2))
    ref = flash_attn_func(q, k, v, **kw)
    assert torch.equal(out, ref)
    (dqkv,) = _grads(out, (qkv,))
    assert torch.equal(dqkv, torch.stack(_grads(ref, (q, k, v)), dim=2))


def test_kvpacked_equals_the_unpacked_call():
    g = torch.Generator().manual_seed(0)
    q = _randn((2, 7, 4, 24), torch.float16, g, True)
    kv = _randn((2, 9, 2, 2, 24), torch.float16, g, True)
    kw = dict(causal=True, alibi_slopes=_slopes((2, 4)), return_attn_probs=True)
    out, lse, _ = flash_attn_kvpacked_func(q, kv, **kw)
    k, v = (t.detach().requires_grad_() for t in kv.unbind(2))
    q2 = q.detach().requires_grad_()
    ref, ref_lse, _ = flash_attn_func(q2, k, v, **kw)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    dq, dkv = _grads(out, (q, kv))
    dq2, dk, dv = _grads(ref, (q2, k, v))
    assert torch.equal(dq, dq2) and torch.equal(dkv, torch.stack((dk, dv), dim=2))


def test_varlen_qkvpacked_equals_the_unpacked_call():
    lengths = (4, 0, 1, 6)
    qkv = _randn((sum(lengths), 3, 2, 64), torch.float16, torch.Generator().manual_seed(2), True)
    cu = _cu(lengths)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, max(lengths), causal=True)
    q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(1))
    ref = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    assert torch.equal(out, ref)
    (dqkv,) = _grads(out, (qkv,))
    assert torch.equal(dqkv, torch.stack(_grads(ref, (q, k, v)), dim=1))


def test_varlen_kvpacked_equals_the_unpacked_call():
    (q, k, v), (lq, lk), kw, _ = _varlen_case("causal")
    kv = torch.stack((k.detach(), v.detach()), dim=1).requires_grad_()
    out = flash_attn_varlen_kvpacked_func(q, kv, _cu(lq), _cu(lk), max(lq), max(lk), **kw)
    ref = flash_attn_varlen_func(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), **kw)
    assert torch.equal(out, ref)
    (dkv,) = _grads(out, (kv,))
    assert torch.equal(dkv, torch.stack(_grads(ref, (k, v)), dim=1))


# ------------------------------------------------------------------ attention_variant (SDPA layout)
def test_attention_variant_with_a_key_bias_matches_the_reference():
    g = torch.Generator().manual_seed(4)
    q = _randn((2, 4, 6, 64), torch.bfloat16, g, True)
    k, v = (_randn((2, 2, 9, 64), torch.bfloat16, g, True) for _ in range(2))
    bias = torch.zeros(2, 9)
    bias[0, 5:] = -math.inf
    bias[1] = -math.inf  # batch 1 sees no key at all: out 0, lse +inf, no NaN in the gradients
    out, lse = attention_variant(q, k, v, key_bias=bias, causal=True, align="bottom_right")
    leaves = _leaves(q, k, v)
    ref, ref_lse = attention_ref(*leaves, key_bias=bias, causal=True, align="bottom_right")
    _close(out, ref, 1e-2)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isinf(lse[1]).all()
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, leaves, dout.float())):
        assert torch.isfinite(got.float()).all()
        _close(got, want, 2e-2)


def test_attention_variant_takes_any_strides_and_gives_q_strides_back():
    g = torch.Generator().manual_seed(0)
    base = _randn((2, 8, 3, 64), torch.float16, g)  # (B, L, H, D) storage seen as (B, H, L, D)
    q = base.transpose(1, 2)
    out, lse = attention_variant(q, q, q, causal=True)
    assert out.stride() == q.stride() and lse.shape == (2, 3, 8)
    ref, _ = attention_ref(q.float(), q.float(), q.float(), causal=True)
    _close(out, ref)


# ------------------------------------------------------------------ custom ops: registration, compile
def _fwd_args(q, k, v, *, alibi=None, bias=None, cu=(None, None), scale=0.125, causal=False, align="top_left",
              window=(-1, -1), chunk=0, softcap=0.0, max_seqlens=(0, 0), used=(None, None)):
    return (q, k, v, alibi, bias, *cu, *used, scale, causal, align, *window, chunk, softcap, *max_seqlens, False)


def test_custom_op_registration_dense():
    g = torch.Generator().manual_seed(0)
    q = _randn((2, 4, 9, 32), torch.float64, g, True)
    k, v = (_randn((2, 2, 11, 32), torch.float64, g, True) for _ in range(2))
    args = _fwd_args(q, k, v, alibi=_slopes((2, 4)).double().float(), causal=True, align="bottom_right",
                     window=(3, 0), chunk=4, softcap=4.0)
    torch.library.opcheck(torch.ops.autoflash.flash_fwd.default, args)
    out, lse = torch.ops.autoflash.flash_fwd(*args)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    torch.library.opcheck(torch.ops.autoflash.flash_bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), *args[3:]))


def test_custom_op_registration_varlen():
    g = torch.Generator().manual_seed(0)
    lq, lk = (3, 0, 5), (4, 2, 6)
    q = _randn((sum(lq), 2, 32), torch.float64, g, True)
    k, v = (_randn((sum(lk), 1, 32), torch.float64, g, True) for _ in range(2))
    args = _fwd_args(q, k, v, cu=(_cu(lq), _cu(lk)), causal=True, align="bottom_right", max_seqlens=(5, 6),
                     used=(torch.tensor([2, 0, 5], dtype=torch.int32), torch.tensor([4, 1, 3], dtype=torch.int32)))
    torch.library.opcheck(torch.ops.autoflash.flash_fwd.default, args)
    out, lse = torch.ops.autoflash.flash_fwd(*args)
    assert lse.shape == (2, sum(lq))


@pytest.mark.parametrize("gpu", ["a100", "h100"])
def test_small_gqa_calls_without_gradient_pack_the_query_heads(gpu, launched):
    """FA3's pack_gqa: flash_attn_func with GQA, seqlen_q x group <= 64 and no gradient asked for runs
    the KV-cache kernel with each K/V head's query heads in one tile (the kernel explain() names, with
    the note), within FA3's rule, window and softcap included. Asking for a gradient, a group too big for
    the tile, or ALiBi keeps the dense kernel."""
    q, k, v = _bshd(2, 5, 83, 8, 2, 64, torch.bfloat16, seed=4, grad=False)
    kw = dict(causal=True, window_size=(40, 0), softcap=20.0)
    plan = autoflash.explain(flash_attn_func, q, k, v, gpu=gpu, **kw)
    with autoflash.emulate(gpu):
        out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    assert len(launched) == 1 and launched[0].kvcache and launched[0] == plan.forward.config
    assert any(note.startswith("pack_gqa: the 4 query heads") for note in plan.notes) and plan.backward is None
    rkw = dict(causal=True, window=(40, 0), softcap=20.0)
    ref, ref_lse = _ref_bshd(q, k, v, **rkw)
    ok, err, bound = within_tolerance(out, ref, _ref_bshd(q, k, v, upcast=False, **rkw)[0], softcap=20.0)
    assert ok, f"err {err:.3e} > bound {bound:.3e}"
    assert torch.allclose(lse, ref_lse, atol=1e-3)
    dense = [(q.clone().requires_grad_(), k, v), (*_bshd(2, 17, 83, 8, 2, 64, torch.bfloat16, grad=False),)]
    for args in dense:
        launched.clear()
        with autoflash.emulate(gpu):
            flash_attn_func(*args, **kw)
        assert launched and not launched[0].kvcache
    launched.clear()
    with autoflash.emulate(gpu):
        flash_attn_func(q, k, v, alibi_slopes=_slopes((8,)), **kw)
    assert launched and not launched[0].kvcache


def test_the_eager_path_is_the_op_without_its_dispatch(monkeypatch):
    """flash_forward_call runs the op's kernels and autograd formula through an autograd.Function
    eagerly: the same out, lse and gradients as torch.ops.autoflash.flash_fwd, bit for bit (emulated
    kernels), and no op call on the way."""
    from autoflash.dispatch import variant_ops

    g = torch.Generator().manual_seed(3)
    with autoflash.emulate("h100"):
        q = _randn((1, 2, 70, 64), torch.bfloat16, g, True)
        k, v = (_randn((1, 1, 90, 64), torch.bfloat16, g, True) for _ in range(2))
        args = _fwd_args(q, k, v, causal=True, align="bottom_right", window=(40, 0))
        results = []
        for call in (variant_ops.flash_forward_call, torch.ops.autoflash.flash_fwd):
            out, lse = call(*args)
            dout = torch.ones_like(out)
            results.append((out, lse, *torch.autograd.grad(out, (q, k, v), dout)))
    for eager, op in zip(*results):
        assert torch.equal(eager, op)
    calls = []
    real = variant_ops.flash_fwd
    monkeypatch.setattr(variant_ops, "flash_fwd", lambda *a: calls.append(a) or real(*a))
    with autoflash.emulate("h100"):
        variant_ops.flash_forward_call(*args)
    assert not calls


def test_compile_fullgraph_forward_and_backward():
    def step(q, k, v):
        out = flash_attn_func(q, k, v, causal=True, window_size=(5, -1), softcap=3.0)
        return (out.float() * 2).sum()

    torch._dynamo.reset()
    q, k, v = _bshd(2, 9, 12, 4, 2, 59)
    loss = torch.compile(step, fullgraph=True)(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    eager = step(q2, k2, v2)
    torch.testing.assert_close(loss, eager)
    for got, want in zip(grads, torch.autograd.grad(eager, (q2, k2, v2))):
        torch.testing.assert_close(got, want)


def test_compile_fullgraph_varlen_and_key_bias_trace_the_ops():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    lengths = (3, 0, 5)
    cu = _cu(lengths)
    bias = torch.zeros(2, 7)
    bias[0, 4:] = -math.inf

    def fn(q, k, v, qd, kd, vd):
        a = flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
        b, _ = attention_variant(*(t.transpose(1, 2) for t in (qd, kd, vd)), key_bias=bias)
        return a.float().sum() + b.float().sum()

    torch._dynamo.reset()
    (q, k, v) = (_randn((8, 2, 32), torch.float16, torch.Generator().manual_seed(i), True) for i in range(3))
    dense = _bshd(2, 5, 7, 2, 2, 32)
    compiled = torch.compile(fn, fullgraph=True, backend=backend)(q, k, v, *dense)
    compiled.backward()
    assert len(graphs) == 1 and graphs[0].code.count("torch.ops.autoflash.flash_fwd") == 2
    torch.testing.assert_close(compiled, fn(q, k, v, *dense))


def test_deterministic_and_variants_reach_the_launcher(monkeypatch):
    """Under emulation the ops call the launcher: here stand-ins record what they get."""
    calls = []

    def forward(q, k, v, **kw):
        calls.append(("fwd", dict(kw)))
        return variant_ops._forward_reference(q, k, v, kw.pop("scale"), {n: x for n, x in kw.items() if n != "config"})

    def backward(dout, q, k, v, out, lse, **kw):
        calls.append(("bwd", dict(kw)))
        kw = {n: x for n, x in kw.items() if n not in ("config", "deterministic")}
        return variant_ops._backward_reference(dout, q, k, v, kw.pop("scale"), kw)

    monkeypatch.setattr(variant_ops, "flash_forward", forward)
    monkeypatch.setattr(variant_ops, "flash_backward", backward)
    (q, k, v), (lq, lk), kw, _ = _varlen_case("window_alibi", torch.bfloat16)
    with autoflash.emulate("h100"):
        out = flash_attn_varlen_func(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), deterministic=True, **kw)
        out.float().sum().backward()
    (f, fwd), (b, bwd) = calls
    assert (f, b) == ("fwd", "bwd") and bwd["deterministic"] is True
    for got in (fwd, bwd):
        assert got["align"] == "bottom_right" and got["window"] == (2, 1) and got["max_seqlen_k"] == max(lk)
        assert got["alibi_slopes"] is not None and torch.equal(got["cu_seqlens_q"], _cu(lq))
        assert got["scale"] == pytest.approx(1 / 8)


# ------------------------------------------------------------------ bad input
def _no_launch(*args, **kwargs):
    raise AssertionError("launched despite bad input")


@pytest.fixture
def refuse_launches(monkeypatch):
    for name in ("_forward_reference", "_forward_kernels"):
        monkeypatch.setattr(variant_ops, name, _no_launch)


def _q(*shape, dtype=torch.float16):
    return torch.zeros(shape, dtype=dtype)


Q, KV = (2, 5, 4, 64), (2, 6, 2, 64)
DENSE_BAD = {
    "float32": ((_q(*Q, dtype=torch.float32), _q(*KV, dtype=torch.float32)), {}, TypeError,
                r"dtypes: got torch.float32.*expected all torch.float16 or all torch.bfloat16"),
    "mixed_dtypes": ((_q(*Q), _q(*KV, dtype=torch.bfloat16)), {}, TypeError, "dtypes: got torch.float16, "),
    "head_dim_264": ((_q(2, 5, 4, 264), _q(2, 6, 2, 264)), {}, ValueError, r"head_dim: got 264, expected 1..256"),
    "heads": ((_q(2, 5, 3, 64), _q(*KV)), {}, ValueError, "heads: got 3 query heads and 2 key/value heads"),
    "batch": ((_q(3, 5, 4, 64), _q(*KV)), {}, ValueError, r"batch: got q \(3, 5, 4, 64\)"),
    "three_dims": ((_q(5, 4, 64), _q(6, 2, 64)), {}, ValueError,
                   r"q: got shape \(5, 4, 64\), expected 4 dims \(batch, seqlen, heads, head_dim\)"),
    "window_below_-1": ((_q(*Q), _q(*KV)), {"window_size": (-2, 0)}, ValueError,
                        r"window_size: got \(-2, 0\), expected sizes >= 0, or -1"),
    "window_not_a_pair": ((_q(*Q), _q(*KV)), {"window_size": 4}, TypeError, "window_size: got 4, expected a pair"),
    "softcap_negative": ((_q(*Q), _q(*KV)), {"softcap": -1.0}, ValueError, "softcap: got -1.0, expected"),
    "alibi_dtype": ((_q(*Q), _q(*KV)), {"alibi_slopes": torch.zeros(4, dtype=torch.float16)}, TypeError,
                    "alibi_slopes: got dtype torch.float16, expected torch.float32"),
    "alibi_shape": ((_q(*Q), _q(*KV)), {"alibi_slopes": torch.zeros(3)}, ValueError,
                    r"alibi_slopes: got shape \(3,\), expected \(4,\) or \(2, 4\)"),
    "dropout": ((_q(*Q), _q(*KV)), {"dropout_p": 0.1}, ValueError, r"dropout_p: got 0.1.*dropout_p=0.0"),
    "scale": ((_q(*Q), _q(*KV)), {"softmax_scale": -1.0}, ValueError, "softmax_scale: got -1.0"),
    "causal_int": ((_q(*Q), _q(*KV)), {"causal": 1}, TypeError, "causal: got 1, expected a bool"),
    "q_not_a_tensor": (([1.0], _q(*KV)), {}, TypeError, "q: got list, expected a torch.Tensor"),
}


@pytest.mark.parametrize("case", sorted(DENSE_BAD))
def test_flash_attn_func_refuses_bad_input(refuse_launches, case):
    (q, kv), kw, error, message = DENSE_BAD[case]
    with pytest.raises(error, match=message):
        flash_attn_func(q, kv, kv, **kw)


def test_flash_attn_func_refuses_k_and_v_of_different_shapes(refuse_launches):
    with pytest.raises(ValueError, match=r"k and v shapes: got \(2, 6, 2, 64\) and \(2, 7, 2, 64\)"):
        flash_attn_func(_q(*Q), _q(*KV), _q(2, 7, 2, 64))


CU = _cu((3, 2))  # q rows 5
VARLEN_BAD = {
    "cu_int64": (dict(cu_seqlens_q=CU.long()), TypeError, "cu_seqlens_q: got dtype torch.int64, expected torch.int32"),
    "cu_2d": (dict(cu_seqlens_q=CU[None]), ValueError, r"cu_seqlens_q: got shape \(1, 3\), expected 1-D"),
    "cu_not_from_0": (dict(cu_seqlens_q=torch.tensor([1, 3, 5], dtype=torch.int32)), ValueError,
                      "cu_seqlens_q: got first value 1, expected 0"),
    "cu_decreasing": (dict(cu_seqlens_k=torch.tensor([0, 4, 3], dtype=torch.int32)), ValueError,
                      r"cu_seqlens_k: got \[0, 4, 3\], decreasing at index 2"),
    "cu_wrong_total": (dict(cu_seqlens_q=torch.tensor([0, 3, 4], dtype=torch.int32)), ValueError,
                       "cu_seqlens_q: got last value 4, expected 5"),
    "cu_batches_differ": (dict(cu_seqlens_k=torch.tensor([0, 5], dtype=torch.int32)), ValueError,
                          "cu_seqlens_k: got 2 entries, expected cu_seqlens_q's 3"),
    "max_seqlen_too_small": (dict(max_seqlen_q=2), ValueError, "max_seqlen_q: got 2, expected >= 3"),
    "max_seqlen_tensor": (dict(max_seqlen_k=torch.tensor(3)), TypeError, "max_seqlen_k: got Tensor, expected a "
                                                                         "Python int"),
    "alibi_batch": (dict(alibi_slopes=torch.zeros(3, 4)), ValueError, r"expected \(4,\) or \(2, 4\)"),
    "head_dim": (dict(q=_q(5, 4, 300)), ValueError, "head_dim: got q"),
    "block_table_unpaged_k": (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), ValueError,
                              r"k: got shape \(5, 2, 64\) with a block_table, expected a paged cache"),
    "four_dims": (dict(q=_q(1, 5, 4, 64)), ValueError, r"expected 3 dims \(total, heads, head_dim\)"),
}


@pytest.mark.parametrize("case", sorted(VARLEN_BAD))
def test_flash_attn_varlen_func_refuses_bad_input(refuse_launches, case):
    overrides, error, message = VARLEN_BAD[case]
    args = dict(q=_q(5, 4, 64), k=_q(5, 2, 64), v=_q(5, 2, 64), cu_seqlens_q=CU, cu_seqlens_k=CU, max_seqlen_q=3,
                max_seqlen_k=3)
    args.update(overrides)
    with pytest.raises(error, match=message):
        flash_attn_varlen_func(**args)


def test_packed_wrappers_refuse_bad_packing(refuse_launches):
    with pytest.raises(ValueError, match=r"qkv: got shape \(2, 5, 2, 4, 64\), expected \(batch, seqlen, 3, heads"):
        flash_attn_qkvpacked_func(_q(2, 5, 2, 4, 64))
    with pytest.raises(ValueError, match=r"kv: got shape \(6, 3, 2, 64\), expected \(total_k, 2, heads_k"):
        flash_attn_varlen_kvpacked_func(_q(5, 4, 64), _q(6, 3, 2, 64), CU, CU, 3, 3)
    with pytest.raises(TypeError, match="qkv: got NoneType"):
        flash_attn_varlen_qkvpacked_func(None, CU, 3)


def test_attention_variant_refuses_bad_input(refuse_launches):
    q, k = _q(2, 4, 5, 64), _q(2, 2, 6, 64)
    with pytest.raises(ValueError, match=r"key_bias: got shape \(2, 5\), expected \(2, 6\)"):
        attention_variant(q, k, k, key_bias=torch.zeros(2, 5))
    with pytest.raises(TypeError, match="key_bias: got dtype torch.float16, expected torch.float32"):
        attention_variant(q, k, k, key_bias=torch.zeros(2, 6, dtype=torch.float16))
    with pytest.raises(ValueError, match="align: got 'center', expected one of"):
        attention_variant(q, k, k, align="center")
    with pytest.raises(TypeError, match="window: got"):
        attention_variant(q, k, k, window=(1.5, 2))


# ------------------------------------------------------------------ the kernels, emulated
def _rule_cases():
    """(name, flash_attn_func keywords, (b, lq, lk, hq, hk, d)) at sizes the emulator runs quickly."""
    return {
        "causal_br": ({"causal": True}, (2, 48, 80, 2, 2, 64)),
        "window": ({"window_size": (16, 8)}, (2, 64, 64, 2, 1, 64)),
        "softcap_alibi": ({"softcap": 5.0, "alibi": (2, 2), "causal": True}, (2, 40, 56, 2, 2, 64)),
        "head_dim_59": ({}, (2, 33, 47, 2, 2, 59)),
        "gqa_window_left": ({"window_size": (24, -1)}, (2, 64, 96, 2, 1, 64)),
    }


class TestEmulatedKernels:
    """The API on the H100's kernels, emulated on the CPU: out and gradients within 2x (3x with a
    softcap) of PyTorch's own error in the input dtype, both against the fp32 reference, plus twice
    the reference's rounding in the input dtype (FlashAttention-3's rule: within_tolerance)."""

    @staticmethod
    def _check(name, got, ref, same_dtype, softcap=0.0):
        ok, err, bound = within_tolerance(got, ref, same_dtype, softcap=softcap, backward=name != "out")
        assert ok, f"{name}: err {err:.3e} > bound {bound:.3e}"

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
    @pytest.mark.parametrize("case", sorted(_rule_cases()))
    def test_flash_attn_func_meets_the_rule(self, case, dtype):
        spec, (b, lq, lk, hq, hk, d) = _rule_cases()[case]
        q, k, v = _bshd(b, lq, lk, hq, hk, d, dtype=dtype)
        kw, ref_kw = _call_kwargs(spec, b, hq)
        with autoflash.emulate(gpu="h100"):
            out = flash_attn_func(q, k, v, **kw)
        up = _leaves(q, k, v)
        low = _leaves(q, k, v, dtype=dtype)
        ref, _ = _ref_bshd(*up, **ref_kw)
        same, _ = _ref_bshd(*low, upcast=False, **ref_kw)
        softcap = spec.get("softcap", 0.0)
        self._check("out", out, ref, same, softcap)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(dtype)
        with autoflash.emulate(gpu="h100"):
            grads = torch.autograd.grad(out, (q, k, v), dout)
        for name, got, want, want_same in zip("qkv", grads, torch.autograd.grad(ref, up, dout.float()),
                                              torch.autograd.grad(same, low, dout)):
            self._check(f"d{name}", got, want, want_same, softcap)

    @pytest.mark.parametrize("d", [96, 128, 256])
    @pytest.mark.parametrize("lq", [1, 2])
    @pytest.mark.parametrize("gpu", ["a100", "h100"])
    def test_a_query_that_sees_one_key_gets_no_gradient(self, gpu, lq, d):
        """FlashAttention-3's exact-cancellation case: each query sees one key (packed (Lq, Lk) = (1, 1)
        or (2, 1), causal, so with (2, 1) the first query sees none), so P = 1 and dS = P (dP - delta)
        is 0, as the softmax's own gradient (and with it FA3's tolerance) has it: dQ and dK exactly 0.
        delta and dP must come out of the same arithmetic (the mma.sync family computes delta by the
        mma chain dP takes); d = 128 every run, 96 and 256 under AUTOFLASH_SWEEP=full."""
        if d != 128 and not sampling.FULL:
            pytest.skip("d = 128 per run; AUTOFLASH_SWEEP=full for 96 and 256")
        g = torch.Generator().manual_seed(d + lq)
        n = 3
        q = _randn((n * lq, 2, d), torch.bfloat16, g, True)
        k, v = (_randn((n, 2, d), torch.bfloat16, g, True) for _ in range(2))
        with autoflash.emulate(gpu=gpu):
            out = flash_attn_varlen_func(q, k, v, _cu([lq] * n), _cu([1] * n), lq, 1, causal=True)
            dout = torch.randn(out.shape, generator=g).to(out.dtype)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        assert dq.abs().max().item() == 0 and dk.abs().max().item() == 0
        rows = torch.arange(n * lq) % lq == lq - 1  # the queries that see their key: O = V, dV = dO
        assert torch.equal(out[rows], v.detach()) and torch.equal(dv, dout[rows])

    def test_varlen_meets_the_rule(self):
        lq, lk = (17, 0, 1, 40), (23, 5, 3, 40)
        g = torch.Generator().manual_seed(0)
        q = _randn((sum(lq), 2, 64), torch.bfloat16, g, True)
        k, v = (_randn((sum(lk), 1, 64), torch.bfloat16, g, True) for _ in range(2))
        ref_kw = {"causal": True, "scale": None, "window": (-1, -1), "softcap": 0.0, "alibi_slopes": None}
        with autoflash.emulate(gpu="h100"):
            out = flash_attn_varlen_func(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal=True)
        up, low = _leaves(q, k, v), _leaves(q, k, v, dtype=torch.bfloat16)
        ref, _ = _varlen_reference(*up, lq, lk, ref_kw)
        same, _ = _varlen_reference(*low, lq, lk, dict(ref_kw, upcast=False))
        self._check("out", out, ref, same)
        dout = torch.randn(out.shape, generator=g).to(torch.bfloat16)
        with autoflash.emulate(gpu="h100"):
            grads = torch.autograd.grad(out, (q, k, v), dout)
        for name, got, want, want_same in zip("qkv", grads, torch.autograd.grad(ref, up, dout.float()),
                                              torch.autograd.grad(same, low, dout)):
            self._check(f"d{name}", got, want, want_same)

    def test_deterministic_backward_is_bit_identical(self):
        q, k, v = _bshd(2, 64, 64, 2, 2, 64, dtype=torch.bfloat16)
        runs = []
        with autoflash.emulate(gpu="h100"):
            for _ in range(2):
                out = flash_attn_func(q, k, v, causal=True, deterministic=True)
                runs.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
        assert all(torch.equal(a, b) for a, b in zip(*runs))

    def test_compiled_call_runs_the_kernels(self, monkeypatch):
        ran = []
        real = variant_ops._forward_kernels
        monkeypatch.setattr(variant_ops, "_forward_kernels", lambda *a: ran.append(1) or real(*a))
        q, k, v = _bshd(2, 40, 40, 2, 2, 64, dtype=torch.bfloat16)
        torch._dynamo.reset()
        fn = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True, softcap=4.0), fullgraph=True,
                           backend="aot_eager")
        with autoflash.emulate(gpu="h100"):
            out = fn(q, k, v)
            grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            eager = flash_attn_func(q, k, v, causal=True, softcap=4.0)
        assert ran and torch.equal(out, eager) and all(torch.isfinite(g.float()).all() for g in grads)

    def test_attention_variant_key_bias_meets_the_rule(self):
        g = torch.Generator().manual_seed(1)
        q = _randn((2, 2, 40, 64), torch.bfloat16, g, True)
        k, v = (_randn((2, 2, 56, 64), torch.bfloat16, g, True) for _ in range(2))
        bias = torch.zeros(2, 56)
        bias[0, 30:] = -math.inf
        with autoflash.emulate(gpu="h100"):
            out, lse = attention_variant(q, k, v, key_bias=bias)
        ref, ref_lse = attention_ref(*_leaves(q, k, v), key_bias=bias)
        same, _ = attention_ref(q, k, v, key_bias=bias, upcast=False)
        self._check("out", out, ref, same, 2.0)
        torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


def test_window_size_takes_any_pair_of_integers():
    """flash-attn's own tests pass window_size as torch.randint(0, seqlen_k, (2,)): a 2-element
    tensor (or numpy integers) means the same window as the tuple, at every entry point; floats and
    bools are still refused."""
    import numpy as np

    from autoflash import flash_attn_with_kvcache
    from autoflash.kernels.checks import window_pair

    for pair in (torch.tensor([3, 1]), torch.tensor([3, 1], dtype=torch.int32), [np.int64(3), np.int32(1)],
                 np.array([3, 1]), (3, 1)):
        assert window_pair("window_size", pair) == (3, 1)
    for bad in (torch.tensor([3.0, 1.0]), torch.tensor([True, False]), (True, 1), torch.tensor([1, 2, 3]), "31"):
        with pytest.raises(TypeError, match="window_size: got .*expected a pair of ints"):
            window_pair("window_size", bad)
    q, kv = _q(*Q), _q(*KV)
    want = flash_attn_func(q, kv, kv, window_size=(3, 1))
    assert torch.equal(flash_attn_func(q, kv, kv, window_size=torch.tensor([3, 1])), want)
    from autoflash.dispatch.flash_api import attention_variant

    t = (q.transpose(1, 2), kv.transpose(1, 2), kv.transpose(1, 2))
    assert all(torch.equal(a, b) for a, b in zip(attention_variant(*t, window=torch.tensor([3, 1])),
                                                 attention_variant(*t, window=(3, 1))))
    cache = torch.randn(2, 16, 2, 64).to(q.dtype)
    assert torch.equal(flash_attn_with_kvcache(q, cache, cache, cache_seqlens=6, window_size=torch.tensor([3, 1])),
                       flash_attn_with_kvcache(q, cache, cache, cache_seqlens=6, window_size=(3, 1)))
