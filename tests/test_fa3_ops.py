"""torch.ops.flash_attn_3 (autoflash.dispatch.fa3_ops): FlashAttention-3's registered ops with FA3's
schemas, running autoflash. Each op's schema matches its implementation's signature, passes opcheck's
schema and fake-tensor checks, and gives what the FA3 Python API gives on the emulated H100: the
forward by its three paths (dense, packed, KV cache), the backward against autograd."""
import inspect
import warnings

import pytest
import torch

import autoflash
from autoflash import flash_attn_interface as fa3
from autoflash.dispatch import fa3_ops

OPS = {"fwd": fa3_ops.fwd, "bwd": fa3_ops.bwd, "fwd_combine": fa3_ops.fwd_combine,
       "get_scheduler_metadata": fa3_ops.get_scheduler_metadata}


def _bshd(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).bfloat16()


@pytest.mark.parametrize("name", sorted(OPS))
def test_each_schema_is_its_implementations_signature(name):
    schema = getattr(torch.ops.flash_attn_3, name).default._schema
    params = inspect.signature(OPS[name]).parameters
    assert [a.name for a in schema.arguments] == list(params)
    for arg in schema.arguments:  # FA3's defaults: None, False, -1, 0, 0.
        default = params[arg.name].default
        assert (arg.has_default_value(), arg.default_value if arg.has_default_value() else None) == \
            (default is not inspect.Parameter.empty, None if default is inspect.Parameter.empty else default), arg.name


def test_the_ops_pass_opchecks_schema_and_fake_tensor_tests():
    q, k = _bshd(2, 33, 4, 64), _bshd(2, 40, 2, 64, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU reference's FallbackWarning
        out, lse = torch.ops.flash_attn_3.fwd(q, k, k, is_causal=True)[:2]
        calls = {"fwd": ((q, k, k), dict(is_causal=True)),
                 "bwd": ((torch.randn_like(q), q, k, k, out, lse), dict(is_causal=True)),
                 "fwd_combine": ((torch.randn(3, 2, 5, 4, 64), torch.randn(3, 2, 5, 4)), {}),
                 "get_scheduler_metadata": ((2, 1, 128, 4, 2, 64, 64, torch.bfloat16,
                                             torch.tensor([3, 5], dtype=torch.int32)), {})}
        for name, (args, kw) in calls.items():
            torch.library.opcheck(getattr(torch.ops.flash_attn_3, name).default, args, kw,
                                  test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dv", [64, 128])  # V's head dim as Q's, and its own (FA3's headdim_v)
def test_fwd_and_bwd_give_what_the_fa3_api_gives_on_an_emulated_h100(dv):
    q, k, v = _bshd(2, 45, 4, 64), _bshd(2, 70, 2, 64, seed=1), _bshd(2, 70, 2, dv, seed=2)
    dout = _bshd(2, 45, 4, dv, seed=3)
    kw = dict(window_size=(30, 5))
    with autoflash.emulate("h100"):
        out, lse, *accum = torch.ops.flash_attn_3.fwd(q, k, v, window_size_left=30, window_size_right=5)
        want, want_lse = fa3.flash_attn_func(q, k, v, return_attn_probs=True, deterministic=True, **kw)
        dq, dk, dv, softmax_d, lse_log2, *_ = torch.ops.flash_attn_3.bwd(
            dout, q, k, v, out, lse, window_size_left=30, window_size_right=5, deterministic=True)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fa3.flash_attn_func(*leaves, deterministic=True, **kw).backward(dout)
    assert torch.equal(out, want) and torch.equal(lse, want_lse) and all(a.numel() == 0 for a in accum)
    for got, leaf in zip((dq, dk, dv), leaves):
        assert got.dtype == leaf.dtype and torch.equal(got, leaf.grad)
    assert torch.allclose(softmax_d, (dout.float() * out.float()).sum(-1).transpose(1, 2))
    assert torch.allclose(lse_log2, lse * 1.4426950408889634)


def test_fwd_takes_fa3s_packed_and_kv_cache_paths():
    q, k = _bshd(7, 4, 64), _bshd(9, 2, 64, seed=1)
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 5, 9], dtype=torch.int32)
    cache = _bshd(2, 30, 2, 64, seed=2)
    lens = torch.tensor([11, 24], dtype=torch.int32)
    qd = _bshd(2, 2, 4, 64, seed=3)
    with autoflash.emulate("h100"):
        packed = torch.ops.flash_attn_3.fwd(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4,
                                            max_seqlen_k=5, is_causal=True)
        want = fa3.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 4, 5, causal=True, return_attn_probs=True)
        cached = torch.ops.flash_attn_3.fwd(qd, cache, cache, seqused_k=lens, is_causal=True)
        want_cached = fa3.flash_attn_with_kvcache(qd, cache, cache, cache_seqlens=lens, causal=True,
                                                  return_softmax_lse=True)
    assert torch.equal(packed[0], want[0]) and torch.equal(packed[1], want[1])
    assert torch.equal(cached[0], want_cached[0]) and torch.equal(cached[1], want_cached[1])


def test_fwd_combine_and_the_plan_are_the_apis():
    parts, lses = torch.randn(3, 2, 5, 4, 64), torch.randn(3, 2, 5, 4)
    out, lse = torch.ops.flash_attn_3.fwd_combine(parts, lses, out_dtype=torch.bfloat16)
    want, want_lse = fa3.flash_attn_combine(parts, lses, out_dtype=torch.bfloat16)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    plan = torch.ops.flash_attn_3.get_scheduler_metadata(2, 1, 128, 4, 2, 64, 64, torch.bfloat16, lens, num_splits=3)
    assert torch.equal(plan, fa3.get_scheduler_metadata(2, 1, 128, 4, 2, 64, lens, num_splits=3))


def test_registration_leaves_fa3s_own_ops_alone(monkeypatch):
    assert fa3_ops.register()  # already ours: nothing defined twice
    assert fa3_ops._defined("flash_attn_3::fwd") and not fa3_ops._defined("flash_attn_3::no_such_op")
    # FA3's extension installed: its ops are its own, defined when it loads
    monkeypatch.setattr(fa3_ops, "_LIBRARY", None)
    monkeypatch.setattr(fa3_ops.importlib.util, "find_spec", lambda name: object() if name == "flash_attn_3" else None)
    assert not fa3_ops.register()
