"""One fallback policy across the entry points (autoflash/dispatch/policy.py, the README's "What runs
where"): a call that does not run the kernels says so once per reason with a FallbackWarning, and
raises UnsupportedCallError under strict=True or AUTOFLASH_STRICT=1; the low-level launchers raise.
Inside autoflash.emulate() nothing warns: the kernels run (stopped here at their launch, so no kernel
is compiled). float32 runs the SIMT kernels through autoflash.attention."""
import warnings

import pytest
import torch

import autoflash
from autoflash import hf
from autoflash.dispatch import policy
from autoflash.reference.forward import attention_ref, within_tolerance

from conftest import Launched

B, L, H, HK, D = 2, 24, 4, 2, 64


pytestmark = pytest.mark.usefixtures("fresh_fallback_policy")


def _bshd(d=D, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, L, H, d, generator=g).to(dtype)
    k, v = (torch.randn(B, L, HK, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def _varlen_args(d=D):
    q, k, v = _bshd(d)
    cu = torch.tensor([0, 10, B * L], dtype=torch.int32)
    return (q.reshape(-1, H, d), k.reshape(-1, HK, d), v.reshape(-1, HK, d), cu, cu, B * L - 10, B * L - 10)


def _kvcache_args(d=D):
    q, k, v = _bshd(d)
    return (q[:, :1], torch.zeros(B, 64, HK, d, dtype=q.dtype), torch.zeros(B, 64, HK, d, dtype=q.dtype), k[:, :3],
            v[:, :3]), dict(cache_seqlens=5)


def _sdpa_args():
    q, k, v = _bshd()
    return tuple(t.transpose(1, 2).repeat_interleave(H // t.shape[2], 1) for t in (q, k, v))


# entry point -> (args, kwargs) of one valid call on CPU tensors
CALLS = {
    "attention": lambda: (autoflash.attention, _sdpa_args(), {}),
    "flash_attn_func": lambda: (autoflash.flash_attn_func, _bshd(), dict(causal=True)),
    "flash_attn_qkvpacked_func": lambda: (autoflash.flash_attn_qkvpacked_func,
                                          (torch.stack(_sdpa_args(), 2).transpose(1, 3).contiguous(),), {}),
    "flash_attn_varlen_func": lambda: (autoflash.flash_attn_varlen_func, _varlen_args(), dict(causal=True)),
    "flash_attn_with_kvcache": lambda: (autoflash.flash_attn_with_kvcache, *_kvcache_args()),
}
INSTEAD = {"attention": "torch SDPA"}


def _fallbacks(caught):
    return [w for w in caught if issubclass(w.category, autoflash.FallbackWarning)]


@pytest.mark.parametrize("entry", sorted(CALLS))
def test_cpu_outside_emulate_warns_once_per_reason(entry):
    fn, args, kw = CALLS[entry]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn(*args, **kw)
        fn(*args, **kw)
    fallbacks = _fallbacks(caught)
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    message = str(fallbacks[0].message)
    assert INSTEAD.get(entry, "the PyTorch reference") in message and "emulate" in message
    assert fallbacks[0].filename == __file__  # the warning points at the caller's line, not into autoflash


@pytest.mark.parametrize("entry", sorted(CALLS))
def test_strict_raises_instead(entry, monkeypatch):
    fn, args, kw = CALLS[entry]()
    with pytest.raises(autoflash.UnsupportedCallError, match=r"\(strict\).*without strict this call would run"):
        fn(*args, **kw, strict=True)
    monkeypatch.setenv(policy.STRICT_ENV, "1")
    with pytest.raises(autoflash.UnsupportedCallError, match="CPU tensors|cpu tensors"):
        fn(*args, **kw)
    with pytest.raises(TypeError, match="strict: got 'yes'"):
        fn(*args, **kw, strict="yes")


@pytest.mark.parametrize("entry", sorted(CALLS))
def test_inside_emulate_the_kernels_run_without_a_warning(entry, launches):
    fn, args, kw = CALLS[entry]()
    with warnings.catch_warnings(record=True) as caught, autoflash.emulate("a100"):
        warnings.simplefilter("always")
        with pytest.raises(Launched):
            fn(*args, **kw, strict=True)
    assert not _fallbacks(caught) and len(launches) == 1


def test_the_launchers_raise_rather_than_substitute():
    q = torch.zeros(1, 2, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="autoflash.emulate"):
        autoflash.flash_forward(q, q, q)


def test_float32_runs_the_simt_kernels_through_attention(launches):
    q, k, v = (t.float() for t in _sdpa_args())
    with autoflash.emulate("a100"), warnings.catch_warnings():
        warnings.simplefilter("error", autoflash.FallbackWarning)
        with pytest.raises(Launched):
            autoflash.attention(q, k, v, is_causal=True)
    assert launches[0].dtype == "fp32" and launches[0].causal


def test_float32_where_the_simt_kernels_do_not_reach_falls_back():
    q, k, v = (t.float() for t in _sdpa_args())
    with autoflash.emulate("a100"):
        with pytest.warns(autoflash.FallbackWarning, match="float32 with an attn_mask"):
            autoflash.attention(q, k, v, attn_mask=torch.ones(B, 1, 1, L, dtype=torch.bool))
        with pytest.warns(autoflash.FallbackWarning, match="float32 through autoflash.hf"):
            hf.run(q, k, v, None, causal=True, window=(-1, -1), softcap=0.0, dropout=0.0, scale=None, enable_gqa=False)
        with pytest.raises(TypeError, match="float16 or all torch.bfloat16"):  # as flash-attn refuses it
            autoflash.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)))


def test_float32_attention_on_the_emulated_kernels_is_within_the_rule():
    """The SIMT kernels through autoflash.attention, forward and backward, against fp64 (the H100's
    fp32 default for d 64: the config tests/test_kernel_emulation.py compiles too)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 37, 64, generator=g).requires_grad_() for _ in range(3))
    with autoflash.emulate("h100"), warnings.catch_warnings():
        warnings.simplefilter("error", autoflash.FallbackWarning)
        out = autoflash.attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))
    refs, torch_fp32 = [], []
    for upcast, into in ((torch.float64, refs), (torch.float32, torch_fp32)):  # the reference, PyTorch's own
        leaves = [t.detach().to(upcast).requires_grad_() for t in (q, k, v)]
        o, _ = attention_ref(*leaves, causal=True)
        o.backward(torch.ones_like(o))
        into += [o.detach(), *(t.grad for t in leaves)]
    mine = [out.detach(), q.grad, k.grad, v.grad]
    for i, (x, ref, theirs) in enumerate(zip(mine, refs, torch_fp32)):
        ok, err, bound = within_tolerance(x.double(), ref, theirs.double(), backward=i > 0, dtype=torch.float32)
        assert ok, ("out dq dk dv".split()[i], err, bound)
