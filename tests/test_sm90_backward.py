"""The sm90 backward family (templates/flash_bwd_sm90.cu.j2: a producer warpgroup loading Q, dO by TMA
and LSE, delta by bulk copies; one or two consumer warpgroups of 64 keys computing S^T, dP^T with
wgmma, dK, dV as RS wgmma from registers, or two sharing 64 keys with dV^T in one and dK^T in the
other (dkv_split, SS wgmma from P^T, dS^T in shared memory); dQ^T from dS^T in shared memory, added
into the fp32 dQ buffer by cp.reduce.async.bulk) on the host emulator as an H100: over a grid in the
shape of FlashAttention's tests (head dims 64, 96, 128, 192 and 256, causal in both alignments, GQA/MQA,
lengths that are not multiples of the tiles, Lq > Lk) under FlashAttention's gradient rule, and the
H100's default at every other head dim that is a multiple of 16; the variants (sliding windows and
attention chunks, softcap, ALiBi, a key bias, packed sequences with seqused) over FlashAttention-3's
head dims on the defaults and one other schedule each; clean under the sanitizer, which reports a
planted missing fence; bit-identical with deterministic=True; compiled for sm_90a through the ptxas
gate (no spills, no serialization). The emulated grid is sampled per run (tests/sampling.py);
AUTOFLASH_SWEEP=full runs all of it."""
import math

import pytest

import sampling
import torch

import autoflash
from autoflash import emulation
from autoflash.emulation.guards import guarded_randn
from autoflash.kernels.checks import TORCH_DTYPES
from autoflash.kernels.config import KernelConfig
from autoflash.kernels.launch import flash_backward, flash_forward
from autoflash.reference.backward import attention_backward_ref
from autoflash.reference.forward import attention_ref, attention_varlen_ref, within_tolerance

from gpu_inputs import device
from variant_inputs import SM90_VARIANT_PAIRS as VARIANT_PAIRS, VARIANTS, arguments

PAIRS = ((113, 203), (1, 239), (256, 128))  # flash-attn's (Lq, Lk) at emulator sizes; Lq > Lk too
HEADS = ((4, 2), (3, 1))  # GQA, MQA (MHA: the sanitizer test)
# (block_m, block_n, consumer warps, stages) by head dim: the H100's default first. d = 64, 96, 128: two
# warpgroups of 64 keys (at d = 64 they split dQ^T's query columns), one warpgroup, and two sharing 64
# keys (dkv_split: block_n 64 with 8 warps). d = 192, 256 (dkv_split only): other query steps and
# stage counts (at d = 192 every warpgroup takes every dQ^T row, half the columns). d = 96: K's tile
# (and with dkv_split Q's, dO's) padded to 128 columns of zeros for the head-dim rows of 64.
SCHEDULES = {
    64: ((128, 128, 8, 2), (64, 64, 4, 2), (64, 64, 8, 2)),
    96: ((96, 128, 8, 2), (64, 64, 4, 2), (64, 64, 8, 2)),
    128: ((80, 128, 8, 2), (64, 64, 4, 2), (128, 64, 8, 1)),
    192: ((64, 64, 8, 2), (32, 64, 8, 1), (96, 64, 8, 1)),
    256: ((64, 64, 8, 1), (32, 64, 8, 2), (32, 64, 8, 1)),
}


def sm90_config(d: int, dtype: str, causal: bool, align: str, block_m: int, block_n: int = 128, num_warps: int = 8,
                stages: int = 2) -> KernelConfig:
    return KernelConfig(head_dim=d, dtype=dtype, block_m=block_m, block_n=block_n, num_warps=num_warps,
                        num_stages=stages, causal=causal, align=align if causal else "top_left", direction="bwd",
                        family="sm90")


def gradients(cfg: KernelConfig, q, k, v, scale=None, deterministic=False, seed=0):
    """(dq, dk, dv) from the sm90 kernel for dout = randn, with the forward's out and LSE from the
    fp32 reference, and what check() needs."""
    g = torch.Generator().manual_seed(seed)
    up = [t.float() for t in (q, k, v)]
    out, lse = attention_ref(*up, causal=cfg.causal, align=cfg.align, scale=scale)
    dout = torch.randn(out.shape, generator=g).to(q.dtype)
    grads = flash_backward(dout, q, k, v, out.to(q.dtype), lse.float(), causal=cfg.causal, align=cfg.align,
                           scale=scale, config=cfg, deterministic=deterministic)
    return grads, dout


def check(grads, q, k, v, dout, causal, align, scale=None):
    refs = attention_backward_ref(*(t.float() for t in (q, k, v)), dout.float(), causal=causal, align=align,
                                  scale=scale)
    yards = attention_backward_ref(q, k, v, dout, causal=causal, align=align, scale=scale, upcast=False)
    for name, got, x, ref, yard in zip(("dq", "dk", "dv"), grads, (q, k, v), refs, yards):
        assert got.shape == x.shape and got.dtype == x.dtype
        assert not torch.isnan(got).any(), f"{name}: unwritten (poisoned) or NaN"
        ok, err, bound = within_tolerance(got, ref, yard, backward=True)
        assert ok, f"{name}: max err {err:.3e} > bound {bound:.3e}"


@pytest.mark.sweep
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}-{h[1]}")
@pytest.mark.parametrize("schedule", [0, 1, 2], ids=["default", "alt1", "alt2"])
@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("d", sorted(SCHEDULES))
def test_sm90_backward_meets_flashattention_rule(target, d, dtype, causal, schedule, heads, pair):
    (hq, hkv), (lq, lk) = heads, pair
    is_causal, align = causal != "none", "bottom_right" if causal == "bottom_right" else "top_left"
    if target == "gpu" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 family runs on sm_90 GPUs (H100, H200)")
    cfg = sm90_config(d, dtype, is_causal, align, *SCHEDULES[d][schedule])
    dev, dt = device(target), TORCH_DTYPES[dtype]
    g = torch.Generator().manual_seed(hash((d, dtype, causal, schedule, heads, pair)) % 2**31)
    # BSHD storage (flash-attn's layout) seen as BHSD: the TMA maps take any 16-byte strides
    q = torch.randn(1, lq, hq, d, generator=g).to(dev, dt).transpose(1, 2)
    k, v = (torch.randn(1, lk, hkv, d, generator=g).to(dev, dt).transpose(1, 2) for _ in range(2))
    scale = 0.9 / math.sqrt(d)
    grads, dout = gradients(cfg, q, k, v, scale=scale)
    check([x.cpu() for x in grads], q.cpu(), k.cpu(), v.cpu(), dout.cpu(), is_causal, align, scale)


# The variants on the family: the defaults (defaults.call_default: fewer queries a step than the plain
# tiles up to d = 128) and one other schedule per head dim: one warpgroup of 64 keys at d = 64 (its
# masked tiles in loops of their own) and d = 128 (behind a branch, 48 queries a step), two sharing 64
# keys at d = 96, 32 queries a step above. Dense batches of two: batch 1 of "padding" sees no key at all.
VARIANT_SCHEDULES = {64: (64, 64, 4, 2), 96: (64, 64, 8, 2), 128: (48, 64, 4, 2), 192: (32, 64, 8, 1),
                     256: (32, 64, 8, 2)}


def check_variant(grads, q, k, v, dout, kw, ref_of=attention_backward_ref):
    """Each gradient within FlashAttention-3's rule (softcap's wider bound) against the fp32 reference
    of the call's variant."""
    kw = {n: t.cpu() if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
    q, k, v, dout = (t.cpu() for t in (q, k, v, dout))
    refs = ref_of(*(t.float() for t in (q, k, v)), dout.float(), **kw)
    yards = ref_of(q, k, v, dout, upcast=False, **kw)
    for name, got, ref, yard in zip(("dq", "dk", "dv"), grads, refs, yards):
        assert not torch.isnan(got).any(), f"{name}: unwritten (poisoned) or NaN"
        ok, err, bound = within_tolerance(got.cpu(), ref, yard, softcap=kw.get("softcap", 0.0), backward=True)
        assert ok, f"{name}: max err {err:.3e} > bound {bound:.3e}"


def varlen_backward_ref(q, k, v, dout, upcast=True, **kw):
    """(dq, dk, dv) of packed sequences by autograd through attention_varlen_ref."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, _ = attention_varlen_ref(*leaves, upcast=upcast, **kw)
    return torch.autograd.grad(out, leaves, dout.to(out.dtype))


@pytest.mark.sweep
@pytest.mark.parametrize("pair", VARIANT_PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize("schedule", ["default", "alt"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("d", sorted(VARIANT_SCHEDULES))
@pytest.mark.parametrize("variant", sorted(v for v in VARIANTS if not v.startswith("causal")))  # causal: above
def test_sm90_variant_backward_meets_flashattention_rule(target, variant, d, dtype, schedule, pair, launched):
    (lq, lk), spec = pair, VARIANTS[variant]
    if target == "gpu" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 family runs on sm_90 GPUs (H100, H200)")
    dev, dt = device(target), TORCH_DTYPES[dtype]
    g = torch.Generator().manual_seed(hash((variant, d, dtype, schedule, pair)) % 2**31)
    q, dout = (torch.randn(2, lq, 4, d, generator=g).to(dev, dt).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(2, lk, 2, d, generator=g).to(dev, dt).transpose(1, 2) for _ in range(2))
    kw = arguments(spec, 2, 4, lk, dev, g)
    # an explicit schedule: the call sets its switches
    cfg = None if schedule == "default" else sm90_config(d, dtype, False, "top_left", *VARIANT_SCHEDULES[d])
    out, lse = flash_forward(q, k, v, **kw)
    grads = flash_backward(dout, q, k, v, out, lse, config=cfg, **kw)
    # one key: a window reaching past it is no window (kernels.variants.resolve drops the switch)
    assert launched[-1].family == "sm90" and (launched[-1].variants or lk == 1), launched[-1].name
    check_variant(grads, q, k, v, dout, kw)


@pytest.mark.sweep
@pytest.mark.parametrize("schedule", ["default", "alt"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("variant", ["plain", "causal-br", "causal-tl", "window-5-3", "gemma", "chunk-causal"])
@pytest.mark.parametrize("used", [False, True], ids=["spans", "seqused"])
def test_sm90_varlen_backward_meets_flashattention_rule(target, variant, d, schedule, used, launched):
    """Packed sequences of random lengths, 0 and 1 among them and one longer than a tile, each against
    the reference of its own: TMA boxes reach into the next sequence's rows (those queries' LSE is
    +inf, those keys are masked), and each sequence's LSE, delta and dQ tiles start on a tile of their
    own (q_pad). With seqused_q / seqused_k a random prefix of each span is in use; the rest gets no
    gradient."""
    if target == "gpu" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 family runs on sm_90 GPUs (H100, H200)")
    dev, dt, n = device(target), torch.bfloat16, 5
    g = torch.Generator().manual_seed(hash((variant, d, schedule, used)) % 2**31)
    lens_q = [0, 1, 150] + torch.randint(2, 90, (n - 3,), generator=g).tolist()
    lens_k = [int(x) for x in torch.randint(0, 200, (n,), generator=g)]
    perm = torch.randperm(n, generator=g).tolist()
    lens_q, lens_k = [lens_q[i] for i in perm], [lens_k[i] for i in perm]
    q, dout = (torch.randn(sum(lens_q), 4, d, generator=g).to(dev, dt) for _ in range(2))
    k, v = (torch.randn(sum(lens_k), 2, d, generator=g).to(dev, dt) for _ in range(2))
    kw = arguments({} if variant == "plain" else VARIANTS[variant], n, 4, 1, dev, g)
    kw.update({name: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
               for name, lens in (("cu_seqlens_q", lens_q), ("cu_seqlens_k", lens_k))})
    if used:
        for name, lens in (("seqused_q", lens_q), ("seqused_k", lens_k)):
            kw[name] = torch.tensor([int(torch.randint(0, x + 1, (1,), generator=g)) for x in lens], dtype=torch.int32,
                                    device=dev)
    cfg = None if schedule == "default" else sm90_config(d, "bf16", False, "top_left", *VARIANT_SCHEDULES[d])
    lengths = dict(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    out, lse = flash_forward(q, k, v, **lengths, **kw)
    grads = flash_backward(dout, q, k, v, out, lse, config=cfg, **lengths, **kw)
    assert launched[-1].family == "sm90" and launched[-1].varlen, launched[-1].name
    check_variant(grads, q, k, v, dout, kw, varlen_backward_ref)


@pytest.mark.parametrize("schedule", ["default", "released-first"])
def test_sm90_variant_backward_is_clean_under_the_sanitizer(schedule):
    """Guard-banded inputs at an odd GQA shape: window, softcap and ALiBi at once on the d = 64 default
    (masked tiles in loops of their own); a key bias that leaves batch 1 no key at d = 128 (behind a
    branch); packed sequences (0 and 1 among them) with seqused and attention chunks at d = 192 (two
    warpgroups sharing 64 keys). No finding under either schedule, and every gradient within the rule."""
    g = torch.Generator().manual_seed(5)
    lens_q, lens_k = [0, 1, 70, 33, 90], [5, 1, 0, 80, 64]
    packed = dict(cu_seqlens_q=torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32),
                  cu_seqlens_k=torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32),
                  seqused_q=torch.tensor([0, 1, 41, 33, 2], dtype=torch.int32),
                  seqused_k=torch.tensor([3, 0, 0, 80, 50], dtype=torch.int32),
                  causal=True, align="bottom_right", attention_chunk=24)
    calls = []
    for d, variant in ((64, "gemma"), (128, "padding")):
        q, dout = (guarded_randn(2, 4, 77, d, torch.bfloat16, g, "bshd") for _ in range(2))
        k, v = (guarded_randn(2, 2, 133, d, torch.bfloat16, g, "bshd") for _ in range(2))
        calls.append(((q, k, v, dout), arguments(VARIANTS[variant], 2, 4, 133, "cpu", g), attention_backward_ref))
    tensors = [torch.randn(sum(n), h, 192, generator=g).bfloat16() for n, h in ((lens_q, 4), (lens_k, 2), (lens_k, 2))]
    calls.append(((*tensors, torch.randn(sum(lens_q), 4, 192, generator=g).bfloat16()), packed, varlen_backward_ref))
    results = []
    emulation.clear_findings()
    with autoflash.emulate("h100", sanitize=True, schedule=schedule):
        for (q, k, v, dout), kw, _ in calls:
            lengths = dict(max_seqlen_q=90, max_seqlen_k=80) if "cu_seqlens_q" in kw else {}
            out, lse = flash_forward(q, k, v, **lengths, **kw)
            results.append(flash_backward(dout, q, k, v, out, lse, **lengths, **kw))
    assert [str(f) for f in emulation.findings()] == []
    for grads, (inputs, kw, ref_of) in zip(results, calls):
        check_variant(grads, *inputs, kw, ref_of)


def test_packed_runs_past_the_grid_limit_keep_their_padded_rows(monkeypatch, launched):
    """Packed batches past gridDim.z's limit run in runs of sequences (Variant.runs), each handed its
    cu_seqlens and q_pad from its first sequence on: with the limit made 2, five sequences run as three
    launches of each kernel, and every sequence's gradients are still its own."""
    from autoflash.kernels import launch, variants

    monkeypatch.setattr(variants, "GRID_YZ_MAX", 2)
    grids, call = [], launch._call
    monkeypatch.setattr(launch, "_call", lambda fn, grid, *a, **kw: grids.append(grid) or call(fn, grid, *a, **kw))
    g = torch.Generator().manual_seed(4)
    lens_q, lens_k = [70, 0, 33, 1, 90], [64, 5, 80, 1, 20]
    cu = {name: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
          for name, lens in (("cu_seqlens_q", lens_q), ("cu_seqlens_k", lens_k))}
    q, dout = (torch.randn(sum(lens_q), 2, 64, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(sum(lens_k), 1, 64, generator=g).bfloat16() for _ in range(2))
    kw = dict(causal=True, align="bottom_right", max_seqlen_q=90, max_seqlen_k=80, **cu)
    with autoflash.emulate("h100"):
        out, lse = flash_forward(q, k, v, **kw)
        grads = flash_backward(dout, q, k, v, out, lse, **kw)
    assert launched[-1].family == "sm90" and launched[-1].varlen
    assert sorted(z for _, _, z in grids) == [1] * 3 + [2] * 6  # the forward, delta and dK/dV kernels' runs
    check_variant(grads, q, k, v, dout, {n: x for n, x in kw.items() if not n.startswith("max_")},
                  varlen_backward_ref)


def test_a_missing_window_edge_fails_the_rule(mutate):
    """The window's lower edge masked only by the tiles' bounds (its per-element test planted away):
    rows far below a key reach it, and the gradients leave the rule."""
    mutate("bwd", "(LOWER && 8 * c > last[h])", "false")
    mutate("bwd", "(LOWER && 8 * c + 1 > last[h])", "false")
    g = torch.Generator().manual_seed(2)
    q, dout = (torch.randn(1, 2, 150, 64, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, 2, 150, 64, generator=g).bfloat16() for _ in range(2))
    kw = dict(window=(5, 3), align="bottom_right")
    with autoflash.emulate("h100"):
        out, lse = flash_forward(q, k, v, **kw)
        grads = flash_backward(dout, q, k, v, out, lse, **kw)
    with pytest.raises(AssertionError, match="max err"):
        check_variant(grads, q, k, v, dout, kw)


@pytest.mark.parametrize("variant", ["window-5-3", "gemma"])
def test_deterministic_variant_gradients_are_bit_identical(variant):
    g = torch.Generator().manual_seed(7)
    q, dout = (torch.randn(1, 2, 70, 128, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, 1, 190, 128, generator=g).bfloat16() for _ in range(2))
    kw = arguments(VARIANTS[variant], 1, 2, 190, "cpu", g)
    with autoflash.emulate("h100"):
        out, lse = flash_forward(q, k, v, **kw)
        first = flash_backward(dout, q, k, v, out, lse, deterministic=True, **kw)
        again = flash_backward(dout, q, k, v, out, lse, deterministic=True, **kw)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    check_variant(first, q, k, v, dout, kw)


# Head dims that are multiples of 16 beside the grid's: the H100's default at each (64 keys a warpgroup
# up to 128, dkv_split above; none is a multiple of 64, so each pads K's tile, and above 128 Q's and
# dO's, to whole head-dim rows of 64).
OTHER_HEAD_DIMS = (32, 48, 80, 112, 144, 160, 176, 208, 224, 240)


@pytest.mark.parametrize("d", OTHER_HEAD_DIMS)
def test_the_default_at_other_head_dims_meets_flashattention_rule(d):
    from autoflash.kernels.defaults import default_backward_config
    from autoflash.kernels.gpus import get_profile

    cfg = default_backward_config(d, "bf16", True, get_profile("h100")).replace(align="bottom_right")
    assert cfg.family == "sm90" and cfg.dkv_split == (d > 128)
    g = torch.Generator().manual_seed(d)
    q = torch.randn(1, 2, 90, d, generator=g).bfloat16()
    k, v = (torch.randn(1, 1, 150, d, generator=g).bfloat16() for _ in range(2))
    with autoflash.emulate("h100"):
        grads, dout = gradients(cfg, q, k, v)
    check(grads, q, k, v, dout, True, "bottom_right")


SANITIZED = [sm90_config(64, "bf16", False, "top_left", 64), sm90_config(128, "fp16", True, "top_left", 64),
             sm90_config(128, "bf16", True, "bottom_right", 64, 64, 4),
             sm90_config(256, "bf16", True, "bottom_right", 64, 64, 8, 1),
             sm90_config(192, "fp16", False, "top_left", 64, 64, 8, 2)]


@pytest.mark.parametrize("cfg", SANITIZED, ids=lambda c: c.name)
def test_the_kernels_are_clean_under_the_sanitizer(cfg):
    """An odd MHA shape (Lq 77, Lk 133: ragged query and key tiles) on guard-banded inputs."""
    dt = TORCH_DTYPES[cfg.dtype]
    g = torch.Generator().manual_seed(3)
    q, k, v = (guarded_randn(1, 2, n, cfg.head_dim, dt, g, "bshd") for n in (77, 133, 133))
    with autoflash.emulate("h100", sanitize=True):
        emulation.clear_findings()
        grads, dout = gradients(cfg, q, k, v)
        found = emulation.findings()
    assert found == [], [str(f) for f in found]
    check(grads, q, k, v, dout, cfg.causal, cfg.align)


# Planted hazards the sanitizer must report: (config, template text, its replacement, what it says).
# Without wgmma.fence the dQ GEMM may read accumulators still in flight; with dkv_split P^T and dS^T
# are written by stmatrix (generic proxy) and read by the other warpgroup's wgmma (async proxy), so
# without fence.proxy.async before that barrier the read is unordered.
HAZARDS = {
    "dq-gemm-fence": (SANITIZED[0], "      wgmma_fence();\n      #pragma unroll\n      for (int kk = 0; kk < BLOCK_N",
                      "      #pragma unroll\n      for (int kk = 0; kk < BLOCK_N", "no wgmma.fence"),
    "dkv-split-proxy-fence": (sm90_config(256, "bf16", False, "top_left", 64, 64, 8, 1),
                              "    fence_proxy_async();  // generic stores, read by the dK^T, dV^T and dQ^T wgmma "
                              "(async proxy)\n", "", "no fence.proxy.async"),
}


@pytest.mark.parametrize("hazard", sorted(HAZARDS))
def test_a_missing_fence_is_a_finding(mutate, hazard):
    cfg, old, new, text = HAZARDS[hazard]
    mutate("bwd", old, new)
    q, k, v = (torch.randn(1, 2, n, cfg.head_dim).bfloat16() for n in (64, 128, 128))
    with autoflash.emulate("h100", sanitize=True):
        emulation.clear_findings()
        gradients(cfg, q, k, v)
        found = emulation.findings()
    assert any(f.kind == "async" and text in f.detail for f in found), [str(f) for f in found]


@pytest.mark.parametrize("d, schedule", [(64, (64, 64, 4, 2)), (256, (64, 64, 8, 1))], ids=["d64", "d256-split"])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_gradients_are_bit_identical(causal, d, schedule):
    """One launch per key block: the bulk dQ reductions land in a fixed order."""
    cfg = sm90_config(d, "bf16", causal, "top_left", *schedule)
    q, k, v = (torch.randn(1, 2, n, d).bfloat16() for n in (150, 230, 230))
    with autoflash.emulate("h100"):
        first, dout = gradients(cfg, q, k, v, deterministic=True)
        again, _ = gradients(cfg, q, k, v, deterministic=True)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    check(first, q, k, v, dout, causal, "top_left")


_SCHEDULE_JOBS = [(d, x, c) for d, s in SCHEDULES.items() for x in s for c in (False, True)]


@pytest.mark.parametrize("d, schedule, causal",  # one schedule per head dim per run; all: AUTOFLASH_SWEEP=full
                         sampling.sample(_SCHEDULE_JOBS, lambda j: j[0], salt="sm90 bwd schedules"), ids=lambda x: str(x))
def test_the_schedules_compile_for_sm_90a_without_spills(d, schedule, causal):
    from autoflash.kernels.compiler import compile_config
    from autoflash.kernels.sass import disassemble

    cfg = sm90_config(d, "bf16", causal, "top_left", *schedule)
    compiled = compile_config(cfg, "sm_90a")  # the gate: no spills, no wgmma serialization notice
    sass = disassemble(compiled.cubin_path, cfg.name)
    assert "HGMMA" in sass and "UBLKRED.G.S.ADD.F32.RN" in sass and "UTMALDG.4D" in sass and "UBLKCP.S.G" in sass


def test_the_gate_refuses_a_spilling_schedule():
    """128 queries a step at d = 128: S^T, dP^T (64 registers each) beside dK, dV (64 each) cannot fit
    the 240 registers a consumer thread gets."""
    from autoflash.kernels.compiler import CompileError, compile_config

    with pytest.raises(CompileError, match="spill"):
        compile_config(sm90_config(128, "bf16", False, "top_left", 128), "sm_90a")


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("entry", ["attention", "flash_attn_func"])
def test_the_entry_points_run_the_sm90_backward(entry, d, monkeypatch):
    """loss.backward() through autoflash.attention and flash_attn_func inside emulate("h100") runs the
    family's backward (checked by name), gradients under FlashAttention's rule."""
    from autoflash import flash_attn_func
    from autoflash.kernels import launch

    names = []
    real = launch.kernel_functions
    monkeypatch.setattr(launch, "kernel_functions", lambda cfg, *a: names.append(cfg.name) or real(cfg, *a))
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, n, d, generator=g).bfloat16() for n in (70, 90, 90))
    dout = torch.randn(1, 2, 70, d, generator=g).bfloat16()
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with autoflash.emulate("h100"):
        if entry == "attention":
            out = autoflash.attention(*leaves, is_causal=True)
            align = "top_left"
        else:  # flash-attn's (batch, seqlen, heads, d) and its bottom-right causal
            out = flash_attn_func(*(t.transpose(1, 2) for t in leaves), causal=True).transpose(1, 2)
            align = "bottom_right"
        out.backward(dout)
    assert any(n.startswith(f"bwd_hd{d}_bf16_causal") and n.endswith("_sm90a") for n in names), names
    check([t.grad for t in leaves], q, k, v, dout, True, align)


@pytest.mark.parametrize("d, block_m, block_n, causal",
                         [(128, 80, 128, False), (64, 128, 128, False), (128, 80, 128, True), (256, 64, 64, False)])
def test_keys_past_seqlen_k_stay_out_of_dq_when_p_would_overflow(d, block_m, block_n, causal):
    """Every score of every row -200 (all keys alike, each query opposite them): LSE ~ -196, so P of a
    key past seqlen_k (a zero K row, score 0) is e^196, inf in fp32. Those keys must not reach dQ (inf *
    0 is NaN): masked, or their dS^T rows zeroed."""
    lq, lk = 40, 77  # 77 keys: a ragged key block
    g = torch.Generator().manual_seed(9)
    u = torch.randn(d, generator=g)
    u = u / u.norm()
    k = u.expand(1, 2, lk, d).clone().bfloat16()
    q = (-200 * math.sqrt(d) * u).expand(1, 2, lq, d).clone().bfloat16()
    v = torch.randn(1, 2, lk, d, generator=g).bfloat16()
    cfg = sm90_config(d, "bf16", causal, "bottom_right", block_m, block_n, 8, 1 if d == 256 else 2)
    with autoflash.emulate("h100"):
        grads, dout = gradients(cfg, q, k, v)
    for x in grads:
        assert torch.isfinite(x).all()
    check(grads, q, k, v, dout, causal, "bottom_right")
