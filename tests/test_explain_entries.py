"""autoflash.explain for every entry point: `explain(fn, *args, **kwargs)` with the call's own arguments
names the kernels the call launches, their family and where their tiles came from, or the fallback
and its reason. What it names is checked against what the launcher then asks for (a spy in place of
kernel_functions stops each call at its launch, so nothing is compiled)."""
import pytest
import torch

import autoflash
from autoflash.dispatch import variant_ops
from autoflash.dispatch.explain import EMULATED, KERNELS, REFERENCE_FALLBACK, SDPA_FALLBACK
from autoflash.dispatch.flash_api import Captured, explaining

from conftest import Launched

B, L, H, HK = 2, 40, 4, 2


def _t(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _cu():
    return torch.tensor([0, 15, B * L], dtype=torch.int32)


CASES = {
    "flash_attn_func": lambda d: (autoflash.flash_attn_func, (_t(B, L, H, d), _t(B, 56, HK, d, seed=1),
                                                              _t(B, 56, HK, d, seed=2)), dict(causal=True)),
    "flash_attn_func window softcap alibi": lambda d: (
        autoflash.flash_attn_func, (_t(B, L, H, d), _t(B, L, HK, d, seed=1), _t(B, L, HK, d, seed=2)),
        dict(window_size=(8, 4), softcap=20.0, alibi_slopes=torch.rand(H))),
    "flash_attn_qkvpacked_func": lambda d: (autoflash.flash_attn_qkvpacked_func, (_t(B, L, 3, H, d),), {}),
    "flash_attn_varlen_func": lambda d: (autoflash.flash_attn_varlen_func, (_t(B * L, H, d), _t(B * L, HK, d, seed=1),
                                                                            _t(B * L, HK, d, seed=2), _cu(), _cu(),
                                                                            B * L - 15, B * L - 15),
                                         dict(causal=True)),
    "attention key padding": lambda d: (autoflash.attention, (_t(B, H, L, d), _t(B, H, L, d, seed=1),
                                                              _t(B, H, L, d, seed=2)),
                                        dict(attn_mask=torch.arange(L)[None, None, None, :] < 30)),
    "attention": lambda d: (autoflash.attention, (_t(B, H, L, d), _t(B, HK, L, d, seed=1), _t(B, HK, L, d, seed=2)),
                            dict(is_causal=True, enable_gqa=True)),
}


def _launched(fn, args, kw, launches):
    with pytest.raises(Launched):
        fn(*args, **kw)
    return launches[-1]


@pytest.mark.parametrize("d", [64, 59])  # 59: zero-padded to 64
@pytest.mark.parametrize("case", sorted(CASES))
def test_explain_names_the_kernels_the_call_launches(case, d, launches):
    fn, args, kw = CASES[case](d)
    with autoflash.emulate("a100"):
        e = autoflash.explain(fn, *args, **kw)
        assert e.uses_kernels and e.path == EMULATED and e.gpu == "a100" and "mma.sync" in e.family
        assert _launched(fn, args, kw, launches) == e.forward.config
        if d != 64 and case != "attention key padding":
            assert any("zero-padded to 64" in n for n in e.notes)
        if fn is not autoflash.attention:  # the backward of the same call: from the call explain captured
            with explaining(), pytest.raises(Captured) as captured:
                fn(*args, **kw)
            c = captured.value.call
            real = [torch.zeros(t.shape, dtype=t.dtype) for t in (c.q, c.k, c.v)]
            lse = torch.zeros(real[0].shape[:-1] if "cu_seqlens_q" not in c.variant
                              else (real[0].shape[1], real[0].shape[0]))
            with pytest.raises(Launched):
                variant_ops._backward_kernels(real[0], *real, real[0], lse, c.scale, False, c.variant)
            assert launches[-1] == e.backward.config
    text = str(e)
    assert e.forward.config.name in text and e.backward.config.name in text and "from " in text


@pytest.mark.parametrize("d", [64, 59])
@pytest.mark.parametrize("variant", [{}, dict(softcap=5.0), dict(num_splits=1), dict(causal=True)])
def test_explain_names_the_kv_cache_kernel_and_its_splits(variant, d, launches):
    q, cache = _t(B, 1, H, d), torch.zeros(B, 512, HK, d, dtype=torch.bfloat16)
    args = (q, cache, cache.clone(), _t(B, 2, HK, d, seed=1), _t(B, 2, HK, d, seed=2))
    kw = dict(cache_seqlens=100, **variant)
    with autoflash.emulate("a100"):
        e = autoflash.explain(autoflash.flash_attn_with_kvcache, *args, **kw)
        assert e.backward is None and e.entry == "flash_attn_with_kvcache"
        splits = int(next(n for n in e.notes if n.startswith("key splits")).split()[2].rstrip(","))
        assert (splits > 1) == e.forward.config.split and (splits == 1 if "num_splits" in variant else True)
        assert _launched(autoflash.flash_attn_with_kvcache, args, kw, launches) == e.forward.config
    assert e.forward.config.kvcache and (d == 64 or any("zero-padded" in n for n in e.notes))


def test_explain_without_a_gpu_names_the_fallback_and_with_one_the_kernels():
    fn, args, kw = CASES["flash_attn_func"](64)
    e = autoflash.explain(fn, *args, **kw)
    assert not e.uses_kernels and e.path == REFERENCE_FALLBACK and "emulate" in e.reason and "reason:" in str(e)
    on_h100 = autoflash.explain(fn, *args, **kw, gpu="h100")
    assert on_h100.uses_kernels and on_h100.path == KERNELS and on_h100.gpu == "h100"
    assert on_h100.forward.config.causal and on_h100.forward.config.align == "bottom_right"
    fn, args, kw = CASES["attention"](64)
    sdpa = autoflash.explain(fn, *args, **kw)
    assert sdpa.path == SDPA_FALLBACK and "cpu tensors" in sdpa.reason


def test_explain_checks_the_call_as_the_call_does():
    q = _t(B, L, H, 64)
    with pytest.raises(ValueError, match="heads: got 4 query heads and 3"):
        autoflash.explain(autoflash.flash_attn_func, q, _t(B, L, 3, 64), _t(B, L, 3, 64))
    with pytest.raises(TypeError, match="explain: got len"):
        autoflash.explain(len, q)
