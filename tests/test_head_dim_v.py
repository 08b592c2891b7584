"""V's head dim apart from Q and K's (FlashAttention-3's headdim_v; DeepSeek's MLA shapes): the forward
kernel with O and the V tiles of their own width (head_dim_v; above 256 columns shared among
head_split blocks that each compute S), the backward with both head dims up to 256 (the sm90 family; the
sm80 family's on Q, K or V zero-padded to the wider head dim).

FlashAttention-3's test file pairs d = 64 with dv = 256 and 512 and d = 192 with dv = 128 (its
test_flash_attn_output and the KV-cache test; gradients up to dv = 256); the issue adds (128, 256).
Each case runs under FlashAttention-3's rule (autoflash.reference.forward.within_tolerance: out and
the gradients within 2x, 3x with a softcap, of PyTorch's own error in the input dtype against the
fp32 reference), on a GPU (`gpu` marker) and on the emulator (an H100: the sm90 family's kernels, the
forward's V of 512 columns in two blocks of 256, the backward with both head dims; and the sm80
family's asked for, its backward on the narrower side zero-padded); the emulated grid is sampled per
run (conftest.py)."""
import pytest
import torch

import autoflash
from autoflash import flash_attn_func, flash_attn_varlen_func
from autoflash.flash_attn_interface import flash_attn_func as fa3_flash_attn_func
from autoflash.kernels.config import KernelConfig
from autoflash.kernels.defaults import default_backward_config, default_config
from autoflash.kernels.gpus import get_profile
from autoflash.kernels.launch import flash_backward, flash_forward
from autoflash.reference.backward import attention_backward_ref
from autoflash.reference.forward import attention_ref, attention_varlen_ref, within_tolerance

from gpu_inputs import EMULATED_GPU, TORCH_DTYPES, device
from variant_inputs import VARIANTS, arguments

DIMS = ((64, 256), (64, 512), (192, 128), (128, 256))  # (d, dv): FlashAttention-3's pairs and (128, 256)
PAIRS = ((113, 203), (128, 217), (1, 77), (77, 1), (203, 113))  # FlashAttention's (Lq, Lk), emulator-sized
HEADS = ((4, 2), (3, 3))
NAMES = ("plain", "causal-br", "window-5-3", "softcap-2", "chunk-causal", "gemma", "padding")


@pytest.mark.sweep
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}-{h[1]}")
@pytest.mark.parametrize("d", DIMS, ids=lambda p: f"d{p[0]}-dv{p[1]}")
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("variant", NAMES)
@pytest.mark.parametrize("family", ["default", "sm80"])
def test_head_dim_v_meets_flashattention_rule(target, family, variant, dtype, d, heads, pair, launched):
    """The built-in kernels (on an H100 the sm90 family's, the backward with both head dims) and the sm80
    family's asked for (its backward on the narrower side zero-padded)."""
    (d, dv), (hq, hkv), (lq, lk) = d, heads, pair
    b, dev, dt = 2, device(target), TORCH_DTYPES[dtype]
    g = torch.Generator().manual_seed(hash((variant, dtype, d, dv, heads, pair)) % 2**31)
    q = torch.randn(b, hq, lq, d, generator=g).to(dev, dt)
    k = torch.randn(b, hkv, lk, d, generator=g).to(dev, dt)
    v = torch.randn(b, hkv, lk, dv, generator=g).to(dev, dt)
    dout = torch.randn(b, hq, lq, dv, generator=g).to(dev, dt)
    kw = {} if variant == "plain" else arguments(VARIANTS[variant], b, hq, lk, dev, g)
    config = bwd_config = None
    if family == "sm80":
        profile = get_profile(EMULATED_GPU if target == "emulated" else "a100")
        config = default_config(d, dtype, False, profile, variant=True, family="sm80", head_dim_v=dv)
        if dv <= 256:
            bwd_config = default_backward_config(max(d, dv), dtype, False, profile, variant=True, family="sm80")

    out, lse = flash_forward(q, k, v, config=config, **kw)
    assert out.shape == (b, hq, lq, dv)
    if target == "emulated":
        assert launched[0].family == ("sm80" if family == "sm80" else "sm90"), launched[0].name
    up = [t.float() for t in (q, k, v)]
    ref_out, ref_lse = attention_ref(*up, **kw)
    torch_out, _ = attention_ref(q, k, v, upcast=False, **kw)
    ok, err, bound = within_tolerance(out, ref_out, torch_out, softcap=kw.get("softcap", 0.0))
    assert ok, f"out: err {err:.3e} > bound {bound:.3e}"
    ok, err, _ = within_tolerance(lse, ref_lse, ref_lse, atol=1e-3)
    assert ok, f"lse: err {err:.3e}"
    if dv > 256:  # no backward above 256 (FlashAttention-3 has none either)
        with pytest.raises(ValueError, match="expected v.shape\\[-1\\] <= 256"):
            flash_backward(dout, q, k, v, out, lse, **kw)
        return
    grads = flash_backward(dout, q, k, v, out, lse, config=bwd_config, **kw)
    if target == "emulated":
        assert (launched[-1].family, launched[-1].head_dim_v) == (("sm80", None) if family == "sm80" else
                                                                  ("sm90", dv)), launched[-1].name
    ref_grads = attention_backward_ref(*up, dout.float(), **kw)
    torch_grads = attention_backward_ref(q, k, v, dout, upcast=False, **kw)
    for name, got, like, ref, yard in zip(("dq", "dk", "dv"), grads, (q, k, v), ref_grads, torch_grads):
        assert got.shape == like.shape, name
        ok, err, bound = within_tolerance(got, ref, yard, softcap=kw.get("softcap", 0.0), backward=True)
        assert ok, f"{name}: err {err:.3e} > bound {bound:.3e}"


def _cu(lengths, dev):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)


@pytest.mark.sweep
@pytest.mark.parametrize("d", DIMS, ids=lambda p: f"d{p[0]}-dv{p[1]}")
@pytest.mark.parametrize("variant", ["plain", "causal", "local"])
def test_packed_sequences_meet_flashattention_rule(target, variant, d):
    """flash_attn_varlen_func with V's own head dim: sequences of random lengths, 0 and 1 among them,
    each against its own reference; out (total_q, heads, dv) and, up to dv = 256, the gradients."""
    (d, dv), dev, dt = d, device(target), torch.bfloat16
    g = torch.Generator().manual_seed(d * 1000 + dv + len(variant))
    lens_q, lens_k = [0, 1, 57, 90], [40, 1, 90, 33]
    q = torch.randn(sum(lens_q), 4, d, generator=g).to(dev, dt).requires_grad_()
    k = torch.randn(sum(lens_k), 2, d, generator=g).to(dev, dt).requires_grad_()
    v = torch.randn(sum(lens_k), 2, dv, generator=g).to(dev, dt).requires_grad_()
    kw = dict(causal=variant == "causal", window_size=(13, 4) if variant == "local" else (-1, -1))
    cu = dict(cu_seqlens_q=_cu(lens_q, dev), cu_seqlens_k=_cu(lens_k, dev))
    out = flash_attn_varlen_func(q, k, v, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), **cu, **kw)
    assert out.shape == (sum(lens_q), 4, dv)
    ref_kw = dict(causal=kw["causal"], window=kw["window_size"], align="bottom_right")
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out, _ = attention_varlen_ref(*leaves, **cu, **ref_kw)
    same = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch_out, _ = attention_varlen_ref(*same, **cu, upcast=False, **ref_kw)
    ok, err, bound = within_tolerance(out.detach(), ref_out.detach(), torch_out.detach())
    assert ok, f"out: err {err:.3e} > bound {bound:.3e}"
    if dv > 256:
        return
    dout = torch.randn(out.shape, generator=g).to(dev, dt)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.float())
    torch_grads = torch.autograd.grad(torch_out, same, dout)
    for name, got, ref, yard in zip(("dq", "dk", "dv"), grads, ref_grads, torch_grads):
        ok, err, bound = within_tolerance(got, ref, yard, backward=True)
        assert ok, f"{name}: err {err:.3e} > bound {bound:.3e}"


def test_output_width_is_vs_and_keeps_the_callers_layout():
    """flash_attn_func's out is (batch, seqlen, heads, dv) laid out as q is (its storage (B, S, H, dv)),
    on the PyTorch reference too (the fake implementation's promise), and an odd dv runs zero-padded."""
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 33, 2, 40, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(1, 33, 2, 72, generator=g).bfloat16()
    with autoflash.emulate("a100"):
        out = flash_attn_func(q, k, v, causal=True)
        odd = flash_attn_func(q, k, v[..., :70], causal=True)
    assert out.shape == (1, 33, 2, 72) and out.is_contiguous()
    ref, _ = attention_ref(*(t.float().transpose(1, 2) for t in (q, k, v)), causal=True, align="bottom_right")
    torch_out, _ = attention_ref(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, align="bottom_right",
                                 upcast=False)
    assert within_tolerance(out.transpose(1, 2), ref, torch_out)[0]
    ref_odd, _ = attention_ref(*(t.float().transpose(1, 2) for t in (q, k, v[..., :70])), causal=True,
                               align="bottom_right")
    assert odd.shape == (1, 33, 2, 70) and (odd.float().transpose(1, 2) - ref_odd).abs().max() < 2e-2


def test_fa3_api_runs_the_mla_shapes_and_explains_them():
    """FlashAttention-3's flash_attn_func with (d, dv) = (64, 512): out as wide as v, and explain() on an
    H100 names the sm90 forward with two O slices, and no backward."""
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, 20, 2, 64, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(1, 20, 2, 512, generator=g).bfloat16()
    with autoflash.emulate("h100"):
        out = fa3_flash_attn_func(q, k, v, causal=True)
    assert out.shape == (1, 20, 2, 512)
    ref, _ = attention_ref(*(t.float().transpose(1, 2) for t in (q, k, v)), causal=True, align="bottom_right")
    torch_out, _ = attention_ref(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, align="bottom_right",
                                 upcast=False)
    assert within_tolerance(out.transpose(1, 2), ref, torch_out)[0]
    plan = autoflash.explain(fa3_flash_attn_func, q, k, v, causal=True, gpu="h100")
    text = str(plan)
    assert plan.forward.config.head_dim_v == 512 and plan.forward.config.head_split == 2
    assert plan.forward.config.family == "sm90" and "sm90 (FlashAttention-3 design" in text
    assert "O's 512 columns in 2 blocks of 256 a query tile, each computing the scores" in text
    assert plan.backward is None and "no backward" in text


def test_explain_names_the_backward_with_both_head_dims():
    """DeepSeek's training shape (192, 128): on an H100 the sm90 backward takes both head dims (no padding
    note); on an A100 the sm80 backward runs at 192 with V zero-padded, and explain() says so."""
    q, k = torch.randn(1, 20, 2, 192).bfloat16(), torch.randn(1, 20, 2, 192).bfloat16()
    v = torch.randn(1, 20, 2, 128).bfloat16()
    h100 = autoflash.explain(fa3_flash_attn_func, q, k, v, causal=True, gpu="h100")
    assert (h100.backward.config.head_dim, h100.backward.config.head_dim_v) == (192, 128)
    assert h100.backward.config.family == "sm90" and "zero-padded" not in str(h100)
    a100 = autoflash.explain(fa3_flash_attn_func, q, k, v, causal=True, gpu="a100")
    assert (a100.backward.config.head_dim, a100.backward.config.head_dim_v) == (192, None)
    assert "the backward runs Q, K and V zero-padded to one head dim, 192 (the sm80 family's" in str(a100)


def test_config_names_validates_and_sizes_the_v_head_dim():
    cfg = KernelConfig(head_dim=64, head_dim_v=512, dtype="bf16", block_m=128, block_n=64, num_warps=8, head_split=2)
    assert cfg.name == "fwd_hd64_dv512_bf16_m128n64w8s2h2" and KernelConfig.from_name(cfg.name) == cfg
    assert cfg.o_columns == 256
    # Q's tile doubles as O's staging: as wide as the wider; K's as Q's, V's as O's slice
    assert cfg.smem_layout == {"q": 128 * 256 * 2, "k": 2 * 64 * 64 * 2, "v": 2 * 64 * 256 * 2}
    same = KernelConfig(head_dim=64, head_dim_v=64, dtype="bf16", block_m=128, block_n=64)
    assert same.head_dim_v is None and same == KernelConfig(head_dim=64, dtype="bf16", block_m=128, block_n=64)
    refusals = [
        (dict(head_dim_v=512), "expected head_split >= 2"),
        (dict(head_dim_v=300), "expected a multiple of 8"),
        (dict(head_dim_v=256, direction="bwd"), "zero-padded to the wider head dim"),
        (dict(head_dim_v=256, direction="bwd", family="sm90", block_n=128, num_warps=8),
         "up to 256 columns together"),
        (dict(head_dim_v=256, dtype="fp32", block_m=64), "fp16/bf16 forward"),
        (dict(head_dim_v=200, family="sm90", block_m=64, block_n=128, num_warps=4), "multiples of 16"),
        (dict(head_dim_v=272, family="sm90", block_m=64, block_n=128, num_warps=4, head_split=2), "wgmma"),
        (dict(head_dim_v=200, head_split=2), "equal whole 16-column slices"),
    ]
    for changes, message in refusals:
        fields = {**dict(head_dim=64, dtype="bf16", block_m=128, block_n=64, num_warps=8), **changes}
        with pytest.raises(ValueError, match=message):
            KernelConfig(**fields)


def test_refusals_name_the_v_head_dim():
    """What is not run says so with what it got: a config for another V head dim, V wider than 512 in
    the KV cache and the flash-attn API, and v's other dims unlike k's."""
    from autoflash import flash_attn_with_kvcache

    q, k = torch.randn(1, 2, 16, 64).bfloat16(), torch.randn(1, 2, 16, 64).bfloat16()
    v = torch.randn(1, 2, 16, 256).bfloat16()
    with autoflash.emulate("a100"):
        with pytest.raises(ValueError, match="is for V's head dim 64; the call's is 256"):
            flash_forward(q, k, v, config=KernelConfig(head_dim=64, dtype="bf16", block_m=64, block_n=64))
        with pytest.raises(ValueError, match="v_cache's head dim: got 520, expected 1..512"):
            flash_attn_with_kvcache(q.transpose(1, 2), k.transpose(1, 2), torch.randn(1, 16, 2, 520).bfloat16(),
                                    cache_seqlens=4)
        with pytest.raises(ValueError, match="v's head dim: got 520, expected 1..512"):
            flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), torch.randn(1, 16, 2, 520).bfloat16())
        with pytest.raises(ValueError, match="expected them equal but for the head dim"):
            flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), torch.randn(1, 15, 2, 256).bfloat16())


def _qv_reference(q, k, v, qv, causal, window, softcap, dtype):
    """FlashAttention-3's reference with qv (hopper/test_util.py attention_ref): scores (q . k + q_v . v)
    / sqrt(d + dv), softcapped, masked bottom-right (causal, window), in `dtype`; (batch, seqlen, heads,
    dim) tensors, K/V heads repeated for the query heads."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, 2).to(dtype) for t in (k, v))
    q, qv = q.to(dtype), qv.to(dtype)
    scale = (q.shape[-1] + v.shape[-1]) ** -0.5
    s = (torch.einsum("bthd,bshd->bhts", q, k) + torch.einsum("bthd,bshd->bhts", qv, v)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    lq, lk = q.shape[1], k.shape[1]
    rows, cols = torch.arange(lq)[:, None] + lk - lq, torch.arange(lk)[None]
    left, right = window if not causal else (window[0], 0)
    hidden = torch.zeros(lq, lk, dtype=torch.bool)
    if right >= 0:
        hidden |= cols > rows + right
    if left >= 0:
        hidden |= cols < rows - left
    s = s.masked_fill(hidden, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhts,bshd->bthd", p, v)


@pytest.mark.sweep
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize("d", [(64, 256), (64, 512)], ids=lambda p: f"d{p[0]}-dv{p[1]}")
@pytest.mark.parametrize("variant", ["plain", "causal", "local", "softcap"])
def test_qv_meets_flashattention_rule(target, variant, d, pair):
    """FlashAttention-3's qv (its test_flash_attn_output with has_qv: d = 64, dv = 256 and 512): the
    scores q . k + q_v . v, run as one product of [q, qv] with [k, v]; forward only, as in FA3."""
    (d, dv), (lq, lk), dev, dt = d, pair, device(target), torch.bfloat16
    g = torch.Generator().manual_seed(d + dv + lq + len(variant))
    q = torch.randn(2, lq, 4, d, generator=g).to(dev, dt).requires_grad_()
    k = torch.randn(2, lk, 2, d, generator=g).to(dev, dt)
    v = torch.randn(2, lk, 2, dv, generator=g).to(dev, dt)
    qv = torch.randn(2, lq, 4, dv, generator=g).to(dev, dt)
    kw = dict(causal=variant == "causal", window_size=(19, 3) if variant == "local" else (-1, -1),
              softcap=15.0 if variant == "softcap" else 0.0)
    out = fa3_flash_attn_func(q, k, v, qv=qv, **kw)
    assert out.shape == (2, lq, 4, dv)
    args = (q.detach().cpu(), k.cpu(), v.cpu(), qv.cpu(), kw["causal"], kw["window_size"], kw["softcap"])
    ref, torch_out = _qv_reference(*args, torch.float32), _qv_reference(*args, dt)
    ok, err, bound = within_tolerance(out.detach().cpu(), ref, torch_out, softcap=kw["softcap"])
    assert ok, f"out: err {err:.3e} > bound {bound:.3e}"
    with pytest.raises(RuntimeError, match="flash_attn_func with qv is forward only"):
        out.sum().backward()


def test_qv_packed_and_its_refusals():
    """qv in flash_attn_varlen_func (packed rows), and what it does not take: another shape than q's rows
    by v's head dim, and the KV cache (not run yet), each refused by name."""
    from autoflash.flash_attn_interface import flash_attn_varlen_func as fa3_varlen, flash_attn_with_kvcache

    g = torch.Generator().manual_seed(8)
    lens_q, lens_k = [3, 40], [50, 7]
    cu_q, cu_k = _cu(lens_q, "cpu"), _cu(lens_k, "cpu")
    q, qv = torch.randn(43, 4, 64, generator=g).bfloat16(), torch.randn(43, 4, 256, generator=g).bfloat16()
    k, v = torch.randn(57, 2, 64, generator=g).bfloat16(), torch.randn(57, 2, 256, generator=g).bfloat16()
    with autoflash.emulate("a100"):
        out = fa3_varlen(q, k, v, cu_q, cu_k, 40, 50, causal=True, qv=qv)
    for b in range(2):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        args = (q[rows][None], k[keys][None], v[keys][None], qv[rows][None], True, (-1, -1), 0.0)
        ok, err, bound = within_tolerance(out[rows][None], _qv_reference(*args, torch.float32),
                                          _qv_reference(*args, torch.bfloat16))
        assert ok, f"sequence {b}: err {err:.3e} > bound {bound:.3e}"
    dense = torch.randn(1, 8, 4, 64).bfloat16()
    with pytest.raises(ValueError, match=r"qv: got \(1, 8, 4, 64\) .* expected \(1, 8, 4, 256\)"):
        fa3_flash_attn_func(dense, dense[:, :, :2], torch.randn(1, 8, 2, 256).bfloat16(), qv=dense)
    cache = dense.clone()
    with autoflash.emulate("a100"), pytest.raises(ValueError, match="qv in the KV cache runs on the sm90 family"):
        flash_attn_with_kvcache(dense, cache, cache, k=dense[:, :1], v=dense[:, :1], qv=dense, cache_seqlens=4)
    assert torch.equal(cache, dense)  # refused before the append


def test_qv_runs_the_sm90_cache_kernel_on_an_h100(launched):
    """On an H100 (emulated), FA3's qv in flash_attn_func and flash_attn_varlen_func runs the sm90
    KV-cache kernel with its qv switch over k and v as the cache (no [q, qv] product, no copy), the
    kernel explain() names, within FA3's rule; packed sequences with seqused_q and seqused_k too. Still
    forward only."""
    from autoflash.flash_attn_interface import flash_attn_varlen_func as fa3_varlen

    g = torch.Generator().manual_seed(12)
    q, qv = torch.randn(1, 40, 4, 64, generator=g).bfloat16(), torch.randn(1, 40, 4, 256, generator=g).bfloat16()
    k, v = torch.randn(1, 60, 2, 64, generator=g).bfloat16(), torch.randn(1, 60, 2, 256, generator=g).bfloat16()
    kw = dict(causal=True, window_size=(30, 0), softcap=12.0)
    plan = autoflash.explain(fa3_flash_attn_func, q, k, v, qv=qv, gpu="h100", **kw)
    with autoflash.emulate("h100"):
        out, lse = fa3_flash_attn_func(q.requires_grad_(), k, v, qv=qv, return_attn_probs=True, **kw)
    assert [c.family for c in launched] == ["sm90"] and launched[0].qv and launched[0].kvcache
    assert plan.forward.config == launched[0] and "qv" in plan.forward.config.name
    assert out.shape == (1, 40, 4, 256) and lse.shape == (1, 4, 40)
    args = (q.detach(), k, v, qv, True, (30, 0), 12.0)
    ok, err, bound = within_tolerance(out.detach(), _qv_reference(*args, torch.float32),
                                      _qv_reference(*args, torch.bfloat16), softcap=12.0)
    assert ok, f"out: err {err:.3e} > bound {bound:.3e}"
    with pytest.raises(RuntimeError, match="flash_attn_func with qv is forward only"):
        out.sum().backward()

    lens_q, lens_k, used_q, used_k = [3, 37], [50, 10], [2, 37], [44, 10]
    cu_q, cu_k = _cu(lens_q, "cpu"), _cu(lens_k, "cpu")
    pq, pqv = torch.randn(40, 4, 64, generator=g).bfloat16(), torch.randn(40, 4, 256, generator=g).bfloat16()
    pk, pv = torch.randn(60, 2, 64, generator=g).bfloat16(), torch.randn(60, 2, 256, generator=g).bfloat16()
    launched.clear()
    with autoflash.emulate("h100"):
        out = fa3_varlen(pq, pk, pv, cu_q, cu_k, 37, 50, causal=True, qv=pqv,
                         seqused_q=torch.tensor(used_q, dtype=torch.int32),
                         seqused_k=torch.tensor(used_k, dtype=torch.int32))
    assert [c.family for c in launched] == ["sm90"] and launched[0].qv
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # sequence 0's third row is past seqused_q
    for b in range(2):
        rows, keys = slice(cu_q[b], cu_q[b] + used_q[b]), slice(cu_k[b], cu_k[b] + used_k[b])
        args = (pq[rows][None], pk[keys][None], pv[keys][None], pqv[rows][None], True, (-1, -1), 0.0)
        ok, err, bound = within_tolerance(out[rows][None], _qv_reference(*args, torch.float32),
                                          _qv_reference(*args, torch.bfloat16))
        assert ok, f"sequence {b}: err {err:.3e} > bound {bound:.3e}"


def test_explain_says_how_qv_runs():
    """explain() of a qv call names the appended product (its kernel shows Q and K d + dv wide) and that
    it has no backward."""
    q, k = torch.randn(1, 20, 2, 64).bfloat16(), torch.randn(1, 20, 2, 64).bfloat16()
    v, qv = torch.randn(1, 20, 2, 256).bfloat16(), torch.randn(1, 20, 2, 256).bfloat16()
    plan = autoflash.explain(fa3_flash_attn_func, q, k, v, causal=True, qv=qv, gpu="a100")
    text = str(plan)
    assert plan.forward.config.head_dim == 320 and plan.forward.config.head_dim_v == 256
    assert "one product of [q, qv] with [k, v], Q and K 64 + 256 columns wide" in text
    assert plan.backward is None and "no backward" in text


@pytest.mark.parametrize("schedule", ["default", "released-first"])
def test_sm90_wide_v_kernels_are_clean_under_the_sanitizer(schedule, launched):
    """The sm90 kernels with V's own head dim on guard-banded inputs at an odd GQA shape: (64, 512) in two
    O slices with a causal window and softcap, (192, 128) with ALiBi bottom-right, and packed sequences
    (0 and 1 among them) at (64, 256), the last two backward too (two warpgroups sharing 64 keys, the
    narrower side's tiles zero past its columns). No finding under either schedule, and each result
    within the rule."""
    from autoflash import emulation
    from autoflash.emulation.guards import guarded_randn

    g = torch.Generator().manual_seed(7)
    calls = []
    for (d, dv), kw in (((64, 512), dict(window=(30, 0), softcap=4.0, align="bottom_right")),
                        ((192, 128), dict(alibi_slopes=torch.rand(4, generator=g), causal=True, align="bottom_right"))):
        q = guarded_randn(2, 4, 77, d, torch.bfloat16, g, "bshd")
        k = guarded_randn(2, 2, 133, d, torch.bfloat16, g, "bshd")
        v = guarded_randn(2, 2, 133, dv, torch.bfloat16, g, "bshd")
        calls.append(((q, k, v), kw, attention_ref))
    lens_q, lens_k = [0, 1, 70, 33], [5, 1, 80, 64]
    cu = {name: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
          for name, lens in (("cu_seqlens_q", lens_q), ("cu_seqlens_k", lens_k))}
    packed = [torch.randn(sum(n), h, w, generator=g).bfloat16()
              for n, h, w in ((lens_q, 4, 64), (lens_k, 2, 64), (lens_k, 2, 256))]
    calls.append((packed, dict(causal=True, align="bottom_right", max_seqlen_q=70, max_seqlen_k=80, **cu),
                  attention_varlen_ref))
    emulation.clear_findings()
    with autoflash.emulate("h100", sanitize=True, schedule=schedule):
        results = [flash_forward(*inputs, **kw) for inputs, kw, _ in calls]
        douts = [torch.randn(out.shape, generator=g).bfloat16() for out, _ in results[1:]]
        grads = [flash_backward(dout, *inputs, out, lse, **kw)
                 for dout, (out, lse), (inputs, kw, _) in zip(douts, results[1:], calls[1:])]
    assert [str(f) for f in emulation.findings()] == []
    assert [(c.direction, c.family, c.head_split, c.head_dim_v) for c in launched] == [
        ("fwd", "sm90", 2, 512), ("fwd", "sm90", 1, 128), ("fwd", "sm90", 1, 256), ("bwd", "sm90", 1, 128),
        ("bwd", "sm90", 1, 256)], [c.name for c in launched]
    for i, ((out, lse), (inputs, kw, ref_of)) in enumerate(zip(results, calls)):
        kw = {n: a for n, a in kw.items() if not n.startswith("max_seqlen")}
        leaves = [t.float().requires_grad_() for t in inputs]
        low = [t.detach().clone().requires_grad_() for t in inputs]
        ref, ref_lse = ref_of(*leaves, **kw)
        torch_out, _ = ref_of(*low, upcast=False, **kw)
        ok, err, bound = within_tolerance(out, ref, torch_out, softcap=kw.get("softcap", 0.0))
        assert ok, f"out: err {err:.3e} > bound {bound:.3e} ({sorted(kw)})"
        assert within_tolerance(lse, ref_lse, ref_lse, atol=1e-3)[0]
        if i == 0:
            continue
        dout = douts[i - 1]
        for name, got, r, y in zip(("dq", "dk", "dv"), grads[i - 1], torch.autograd.grad(ref, leaves, dout.float()),
                                   torch.autograd.grad(torch_out, low, dout)):
            assert got.shape == r.shape, name
            ok, err, bound = within_tolerance(got, r, y, backward=True)
            assert ok, f"{name}: err {err:.3e} > bound {bound:.3e} ({sorted(kw)})"


def test_the_padded_backward_keeps_a_chunked_calls_causality():
    """The sm80 backward with two head dims runs the call again on zero-padded tensors with the call's own
    arguments: a causal call with attention chunks (which the kernels run as a window, causal off) stays
    causal there. Its gradients meet the rule on an A100, and differ from the non-causal call's."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 2, 70, 64, generator=g).bfloat16(), torch.randn(1, 2, 90, 64, generator=g).bfloat16()
    v, dout = torch.randn(1, 2, 90, 128, generator=g).bfloat16(), torch.randn(1, 2, 70, 128, generator=g).bfloat16()
    kw = dict(causal=True, align="bottom_right", attention_chunk=24)
    with autoflash.emulate("a100"):
        out, lse = flash_forward(q, k, v, **kw)
        grads = flash_backward(dout, q, k, v, out, lse, **kw)
    ref = attention_backward_ref(q.float(), k.float(), v.float(), dout.float(), **kw)
    low = attention_backward_ref(q, k, v, dout, upcast=False, **kw)
    for name, got, r, y in zip(("dq", "dk", "dv"), grads, ref, low):
        ok, err, bound = within_tolerance(got, r, y, backward=True)
        assert ok, f"{name}: err {err:.3e} > bound {bound:.3e}"
    unmasked = attention_backward_ref(q.float(), k.float(), v.float(), dout.float(), align="bottom_right",
                                      attention_chunk=24)
    assert (unmasked[0] - ref[0]).abs().max() > 0.1  # the test tells the two apart


# The sm90 forward's schedules beside the defaults, with V's own head dim: one to three consumer warpgroups,
# 1-3 stages, pingpong and overlap on and off (three warpgroups only where O and Q are at most 128 wide).
WIDE_V_SCHEDULES = {
    "wg1-n64-s1-ov": dict(block_m=64, num_warps=4, block_n=64, num_stages=1, pingpong=False, overlap=True),
    "wg2-n48-s3-pp": dict(block_m=128, num_warps=8, block_n=48, num_stages=3, pingpong=True, overlap=False),
    "wg3-n32-pp-ov": dict(block_m=192, num_warps=12, block_n=32, num_stages=2, pingpong=True, overlap=True),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal-br"])
@pytest.mark.parametrize("schedule", sorted(WIDE_V_SCHEDULES))
@pytest.mark.parametrize("d", [(64, 512), (64, 256), (192, 128), (128, 64), (64, 128)], ids=lambda p: f"d{p[0]}-dv{p[1]}")
def test_sm90_wide_v_forward_schedules_meet_flashattention_rule(d, schedule, causal, launched):
    """Each schedule of the sm90 forward with V's own head dim (Q's rows, O's slices and their stores per
    warpgroup) at an odd GQA shape with a ragged last tile, under FA3's rule on the emulated H100."""
    (d, dv), h100 = d, get_profile("h100")
    try:
        config = default_config(d, "bf16", causal, h100, head_dim_v=dv).replace(**WIDE_V_SCHEDULES[schedule])
    except ValueError as e:  # three consumer warpgroups past 128 columns
        pytest.skip(str(e))
    if config.smem_bytes > h100.smem_per_block_optin:
        pytest.skip(f"{config.name} needs {config.smem_bytes} bytes of shared memory")
    g = torch.Generator().manual_seed(d * 7 + dv)
    q = torch.randn(2, 4, 77, d, generator=g).bfloat16()
    k = torch.randn(2, 2, 133, d, generator=g).bfloat16()
    v = torch.randn(2, 2, 133, dv, generator=g).bfloat16()
    kw = dict(causal=True, align="bottom_right") if causal else {}
    with autoflash.emulate("h100"):
        out, lse = flash_forward(q, k, v, config=config, **kw)
    assert launched[0].name == config.replace(**({"align": "bottom_right"} if causal else {})).name
    ref, ref_lse = attention_ref(q.float(), k.float(), v.float(), **kw)
    torch_out, _ = attention_ref(q, k, v, upcast=False, **kw)
    ok, err, bound = within_tolerance(out, ref, torch_out)
    assert ok, f"out: err {err:.3e} > bound {bound:.3e}"
    assert within_tolerance(lse, ref_lse, ref_lse, atol=1e-3)[0]
