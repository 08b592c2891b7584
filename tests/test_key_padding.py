"""autoflash.attention with a key-padding attn_mask: which masks run on the kernels (as their per-key
bias) and which fall back to torch SDPA, decided from metadata where the shape says it and with one
comparison of the values where it cannot; and the results against SDPA:
- on the CPU outside emulation (autoflash.attention falls back there: the result is SDPA's; the
  bias the kernels would get is checked through attention_variant's PyTorch reference);
- on the kernels, on the host emulator as on an H100 (bf16/fp16, bool and additive masks, left and
  right padding, forward and backward) under FlashAttention-3's accuracy rule against fp32
  (autoflash.reference.forward.within_tolerance)."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import autoflash
from autoflash.dispatch import sdpa as dispatch
from autoflash.dispatch.sdpa import (KEY_PADDING, KEY_PADDING_IF_CONSTANT, NO_MASK, FallbackWarning,
                                     UnsupportedCallError)
from autoflash.reference.forward import within_tolerance

B, H, L, D = 2, 2, 40, 64


@pytest.fixture(autouse=True)
def _fresh(fresh_fallback_policy):
    dispatch.clear_plan_cache()


def _qkv(dtype=torch.bfloat16, shape=(B, H, L, D), kv_shape=None, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape, generator=g).to(dtype)
    k, v = (torch.randn(kv_shape or shape, generator=g).to(dtype) for _ in range(2))
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _keep(padding: str, lk: int = L) -> torch.Tensor:
    """bool (B, Lk), True = a real key: batch 0 unpadded, batch 1 padded on the given side."""
    keep = torch.ones(B, lk, dtype=torch.bool)
    if padding == "left":
        keep[1, :7] = False
    else:
        keep[1, -11:] = False
    return keep


def _mask(keep: torch.Tensor, kind: str, dtype=torch.float32) -> torch.Tensor:
    """(B, 1, 1, Lk): bool (True attend), or additive float (a random bias on real keys, -inf on padding)."""
    if kind == "bool":
        return keep[:, None, None, :]
    bias = -torch.rand(keep.shape, generator=torch.Generator().manual_seed(3)) * 2
    return bias.masked_fill(~keep, float("-inf")).to(dtype)[:, None, None, :]


def _plan(q, k, v, mask, **kw):
    return dispatch.plan(q, k, v, mask, device_check=False, **kw)


# ------------------------------------------------------------------ which masks go to the kernels
@pytest.mark.parametrize("mask_shape", [(L,), (1, L), (1, 1, 1, L), (B, 1, 1, L), (1, 1, L)])
def test_masks_that_broadcast_over_queries_and_heads_plan_from_metadata(mask_shape):
    # meta tensors: shapes and dtypes, no data. Planning (and mask_reason) must not read any.
    q, k, v = (torch.empty(B, H, L, D, dtype=torch.bfloat16, device="meta") for _ in range(3))
    for dtype in (torch.bool, torch.float32, torch.bfloat16):
        mask = torch.empty(mask_shape, dtype=dtype, device="meta")
        p = _plan(q, k, v, mask)
        assert p.reason is None and p.mask == KEY_PADDING
        assert dispatch.mask_reason(mask, p) is None


def test_flattened_batch_dims_take_masks_broadcast_over_them():
    q, k, v = (torch.empty(3, B, H, L, D, dtype=torch.float16, device="meta") for _ in range(3))
    for shape in [(3, B, 1, 1, L), (B, 1, 1, L), (3, 1, 1, 1, L), (L,)]:
        p = _plan(q, k, v, torch.empty(shape, dtype=torch.bool, device="meta"))
        assert (p.reason, p.mask, p.batch_shape) == (None, KEY_PADDING, (3, B))


@pytest.mark.parametrize("mask_shape", [(B, 1, L, L), (B, H, L, L), (L, L), (B, H, 1, L)])
def test_masks_over_queries_or_heads_need_their_values_checked(mask_shape):
    q, k, v = _qkv()
    keep = _keep("left")
    constant = (keep[:, None, None, :] if len(mask_shape) == 4 else keep[0]).expand(mask_shape)
    p = _plan(q, k, v, constant)
    assert p.reason is None and p.mask == KEY_PADDING_IF_CONSTANT
    assert dispatch.mask_reason(constant, p) is None  # a padding mask expanded: one comparison says so
    varying = constant.clone()
    if mask_shape[-2] > 1:
        varying[..., -1, 0] = ~varying[..., -1, 0]  # the last query row differs
    else:
        varying[:, -1, :, 0] = ~varying[:, -1, :, 0]  # the last head differs
    assert dispatch.mask_reason(varying, p) == dispatch.VARYING_MASK
    assert 'attn_implementation="autofa"' in dispatch.VARYING_MASK  # where a transformers user goes from here


def test_a_causal_mask_is_not_key_padding():
    q, k, v = _qkv()
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    p = _plan(q, k, v, causal)
    assert dispatch.mask_reason(causal, p) == dispatch.VARYING_MASK
    heads = torch.ones(B, H, 1, L, dtype=torch.bool)
    heads[:, 1, :, :5] = False  # differs between heads
    assert "not a key-padding mask" in dispatch.mask_reason(heads, _plan(q, k, v, heads))


def test_no_mask_and_reasons_that_come_first():
    q, k, v = _qkv()
    assert _plan(q, k, v, None).mask == NO_MASK
    mask = _mask(_keep("left"), "float").requires_grad_()
    assert "attn_mask requires grad" in _plan(q, k, v, mask).reason
    with pytest.raises(ValueError, match="attn_mask and is_causal"):  # as SDPA: a mask or is_causal
        _plan(q, k, v, _keep("left")[:, None, None, :], is_causal=True)
    p = _plan(q.float(), k.float(), v.float(), _keep("left")[:, None, None, :])
    assert "float32 with an attn_mask" in p.reason  # the SIMT kernels run float32 without a mask only


def test_plans_are_cached_per_mask_metadata_but_checked_per_call():
    q, k, v = _qkv()
    padding = _keep("left")[:, None, None, :].expand(B, 1, L, L).contiguous()
    causal = torch.ones(B, 1, L, L, dtype=torch.bool).tril()
    p1, p2 = _plan(q, k, v, padding), _plan(q, k, v, causal)
    assert p1 is p2  # same metadata, one plan ...
    # ... but not one answer: the values are checked per call
    assert dispatch.mask_reason(padding, p1) is None and dispatch.mask_reason(causal, p2) is not None
    additive = _mask(_keep("left"), "float")
    assert _plan(q, k, v, additive).reason is None
    assert _plan(q, k, v, additive.clone().requires_grad_()).reason is not None  # requires_grad is in the key


def test_key_bias_from_bool_and_float_masks():
    keep = _keep("right")
    bias = dispatch.key_bias(keep[:, None, None, :], (B,), L)
    assert bias.dtype == torch.float32 and bias.shape == (B, L)
    assert torch.equal(bias == 0, keep) and torch.isinf(bias[~keep]).all() and (bias[~keep] < 0).all()
    additive = _mask(keep, "float", torch.bfloat16)
    assert torch.equal(dispatch.key_bias(additive, (B,), L), additive.float().reshape(B, L))
    # broadcast forms: one row for all batches; extra batch dims flattened; a (B, H, Lq, Lk) expansion
    assert torch.equal(dispatch.key_bias(keep[1], (3, B), L), dispatch.key_bias(keep[1:].expand(6, L), (6,), L))
    full = keep[:, None, None, :].expand(B, H, 5, L)
    assert torch.equal(dispatch.key_bias(full, (B,), L), bias)


# ------------------------------------------------------------------ policy: fallback, strict, explain
def test_other_masks_fall_back_and_strict_names_why():
    q, k, v = _qkv()
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    with autoflash.emulate("h100"):
        with pytest.warns(FallbackWarning, match="attn_mask varies over queries"):
            out = autoflash.attention(q, k, v, attn_mask=causal)
        assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=causal))
        with pytest.raises(UnsupportedCallError, match="attn_mask varies over queries or heads: not a key-padding"):
            autoflash.attention(q, k, v, attn_mask=causal, strict=True)
        explained = autoflash.explain(q, k, v, attn_mask=causal)
        assert not explained.uses_kernels and "varies over queries" in explained.reason


def test_a_mask_that_requires_grad_falls_back_and_gets_its_gradient():
    q, k, v = _qkv()
    mask = _mask(_keep("left"), "float").requires_grad_()
    with autoflash.emulate("h100"), pytest.warns(FallbackWarning, match="attn_mask requires grad"):
        out = autoflash.attention(q, k, v, attn_mask=mask)
    (grad,) = torch.autograd.grad(out.float().sum(), mask)
    assert grad.shape == mask.shape and grad.abs().sum() > 0


def test_explain_reports_the_masked_path():
    q, k, v = _qkv()
    padding = _keep("left")[:, None, None, :]
    for mask in (padding, padding.expand(B, 1, L, L)):  # by metadata, and after the values check
        e = autoflash.explain(q, k, v, attn_mask=mask, gpu="h100")
        assert e.uses_kernels and e.path == "autoflash kernels" and e.mask.startswith(KEY_PADDING)
        assert "mask: key padding" in str(e)
    with autoflash.emulate("h100"):
        e = autoflash.explain(q, k, v, attn_mask=padding)
    assert e.path == "autoflash kernels (emulated on the CPU)" and e.gpu == "h100"


# ------------------------------------------------------------------ the CPU outside emulation
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_cpu_tensors_fall_back_to_sdpa(kind):
    q, k, v = _qkv(grad=True)
    mask = _mask(_keep("left"), kind, torch.bfloat16)
    with pytest.warns(FallbackWarning, match="cpu tensors"):
        out = autoflash.attention(q, k, v, attn_mask=mask)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def _reference(q, k, v, mask, dtype=torch.float32):
    """SDPA's math path in `dtype` on the same inputs, with grads."""
    q2, k2, v2 = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    m = mask if mask.dtype == torch.bool else mask.to(dtype)
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q2, k2, v2, attn_mask=m), (q2, k2, v2)


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_the_kernels_bias_on_the_reference_path(kind, padding):
    """The bias autoflash.attention hands the kernels, through attention_variant's PyTorch reference
    (CPU, no emulation): SDPA's result for the same mask."""
    q, k, v = _qkv()
    mask = _mask(_keep(padding), kind)
    p = _plan(q, k, v, mask)
    out = dispatch.masked_kernels(q, k, v, dispatch.key_bias(mask, p.batch_shape, L), p.scale)
    ref, _ = _reference(q, k, v, mask)
    ours_torch, _ = _reference(q, k, v, mask, torch.bfloat16)
    ok, err, bound = within_tolerance(out, ref, ours_torch)
    assert ok, f"error {err:.3g} > bound {bound:.3g}"


# ------------------------------------------------------------------ the kernels (emulated H100)
def _check(out, grads, q, k, v, mask, dout):
    ref, leaves = _reference(q, k, v, mask)
    same, same_leaves = _reference(q, k, v, mask, q.dtype)
    ok, err, bound = within_tolerance(out, ref, same)
    assert ok, f"out: error {err:.3g} > bound {bound:.3g}"
    ref_grads = torch.autograd.grad(ref, leaves, dout.float())
    same_grads = torch.autograd.grad(same, same_leaves, dout)
    for name, g, r, t in zip("qkv", grads, ref_grads, same_grads):
        assert g.dtype == q.dtype and g.shape == r.shape
        ok, err, bound = within_tolerance(g, r, t, backward=True)
        assert ok, f"d{name}: error {err:.3g} > bound {bound:.3g}"


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_kernels_match_sdpa(dtype, kind, padding):
    q, k, v = _qkv(dtype, grad=True, seed=1)
    mask = _mask(_keep(padding), kind, dtype)
    with autoflash.emulate("h100"), warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # the kernels, never SDPA
        out = autoflash.attention(q, k, v, attn_mask=mask)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    _check(out, grads, q, k, v, mask, dout)


def test_emulated_kernels_take_an_expanded_mask_with_gqa_and_lq_ne_lk():
    """A (B, 1, Lq, Lk) padding mask (the values check), GQA, more keys than queries."""
    q, k, v = _qkv(torch.bfloat16, shape=(B, 4, 24, D), kv_shape=(B, 2, 56, D), grad=True, seed=4)
    mask = _keep("left", 56)[:, None, None, :].expand(B, 1, 24, 56)
    with autoflash.emulate("h100"):
        out = autoflash.attention(q, k, v, attn_mask=mask, enable_gqa=True, strict=True)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).bfloat16()
        grads = torch.autograd.grad(out, (q, k, v), dout)
    # the reference on repeated kv heads; its k/v grads summed back per kv head
    kk, vv = (t.detach().repeat_interleave(2, 1) for t in (k, v))
    ref, leaves = _reference(q, kk, vv, mask)
    same, same_leaves = _reference(q, kk, vv, mask, torch.bfloat16)
    assert within_tolerance(out, ref, same)[0]
    ref_grads = torch.autograd.grad(ref, leaves, dout.float())
    same_grads = torch.autograd.grad(same, same_leaves, dout)
    for name, g, r, t in zip("qkv", grads, ref_grads, same_grads):
        r, t = r.double(), t.double()
        if name != "q":
            r, t = (x.unflatten(1, (2, 2)).sum(2) for x in (r, t))
        # t is summed in fp64: the rounding term is measured in the input dtype, bf16
        ok, err, bound = within_tolerance(g, r, t, dtype=torch.bfloat16, backward=True)
        assert ok, f"d{name}: error {err:.3g} > bound {bound:.3g}"


def test_rows_with_no_visible_key_give_zero_on_the_kernels():
    """Documented difference: a batch whose keys are all masked gets 0 (SDPA: 0 or NaN by backend)."""
    q, k, v = _qkv(seed=6)
    keep = _keep("left")
    keep[1] = False
    with autoflash.emulate("h100"):
        out = autoflash.attention(q, k, v, attn_mask=keep[:, None, None, :], strict=True)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isfinite(out[0].float()).all()


def test_compile_traces_a_broadcast_padding_mask_and_falls_back_for_one_it_would_have_to_read():
    q, k, v = _qkv(seed=7)
    padding = _keep("left")[:, None, None, :]
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    with autoflash.emulate("h100"):
        fn = torch.compile(lambda q, k, v, m: autoflash.attention(q, k, v, attn_mask=m), fullgraph=True,
                           backend=backend)
        assert torch.equal(fn(q, k, v, padding), autoflash.attention(q, k, v, attn_mask=padding))
        assert len(graphs) == 1 and "torch.ops.autoflash" in graphs[0].code  # the kernels' op, no graph break
        with pytest.warns(FallbackWarning, match="under torch.compile"):  # no data check inside a graph
            out = fn(q, k, v, padding.expand(B, 1, L, L))
    torch._dynamo.reset()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=padding.expand(B, 1, L, L)))
