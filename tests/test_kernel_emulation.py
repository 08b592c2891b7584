"""Odd configs on the host emulator (autoflash.emulate): stages 1..4, one or two warps, block_n 48, d 40
and 72, head_split 2 and 4, MQA/GQA, the BSHD layout, Lq = Lk = 1, Lq > Lk under causal, plus every
built-in default of the H100 (bf16, fp32) and the L4 (fp16: its 99 KB tile table), each held to
FlashAttention-3's rule (autoflash.reference.forward.within_tolerance): out against the fp32
reference (fp64 for fp32), dq/dk/dv against autograd through it; the fp32 LSE, which FA3's rule does
not cover, within 2x PyTorch's error + 1e-5. The GPU tier (tests/test_gpu_*.py) runs the same
kernels on the default grid."""
import pytest
import torch

import autoflash
from autoflash.kernels.checks import TORCH_DTYPES
from autoflash.kernels.config import KernelConfig
from autoflash.kernels.defaults import default_backward_config, default_config
from autoflash.kernels.gpus import get_profile
from autoflash.reference.forward import attention_ref, within_tolerance

# (config, batch, heads_q, heads_kv, seqlen_q, seqlen_k, layout)
CASES = [
    (KernelConfig(64, "bf16", 64, 64, num_warps=4, num_stages=2, causal=True), 1, 2, 1, 100, 150, "bhsd"),
    (KernelConfig(64, "fp16", 64, 64, num_warps=2, num_stages=1), 1, 2, 2, 70, 129, "bshd"),
    (KernelConfig(40, "bf16", 32, 48, num_warps=2, num_stages=3, causal=True), 2, 3, 1, 81, 47, "bhsd"),
    (KernelConfig(96, "fp16", 64, 32, num_warps=4, num_stages=2), 1, 2, 1, 33, 200, "bshd"),
    (KernelConfig(128, "bf16", 32, 16, num_warps=2, num_stages=4, causal=True), 1, 1, 1, 50, 90, "bhsd"),
    (KernelConfig(72, "fp32", 32, 32, num_warps=2, num_stages=2, causal=True), 1, 2, 1, 45, 77, "bshd"),
    (KernelConfig(256, "fp32", 16, 16, num_warps=4, num_stages=1), 1, 1, 1, 20, 37, "bhsd"),
    # single query / single key rows; Lq > Lk under causal (rows past Lk see every key)
    (KernelConfig(32, "fp16", 32, 32, num_warps=2, num_stages=2, causal=True), 2, 2, 1, 1, 1, "bhsd"),
    (KernelConfig(32, "fp16", 32, 32, num_warps=2, num_stages=2, causal=True), 1, 4, 2, 67, 9, "bshd"),
]
# Every built-in default of the H100 (bf16, fp32) and the L4 (fp16: the 99 KB tile table), at
# lengths that are not multiples of their tiles.
_DEFAULTS = {(default_config(d, dt, c, get_profile(gpu)), gpu)
             for gpu, dtypes in (("h100", ("bf16", "fp32")), ("l4", ("fp16",)))
             for d in (32, 40, 64, 96, 128, 160, 192, 256) for dt in dtypes for c in (False, True)}
CASES += [(cfg, 1, 2, 1, 131, 203, "bshd") for cfg, _ in sorted(_DEFAULTS, key=lambda x: x[0].name)]

# Backward: (config, batch, heads_q, heads_kv, seqlen_q, seqlen_k, layout)
BWD_CASES = [
    (KernelConfig(64, "bf16", 32, 64, num_warps=4, num_stages=2, causal=True, direction="bwd"), 1, 2, 1, 70, 100, "bhsd"),
    (KernelConfig(64, "fp16", 64, 64, num_warps=4, num_stages=1, direction="bwd"), 1, 2, 2, 45, 77, "bshd"),
    (KernelConfig(40, "bf16", 16, 32, num_warps=2, num_stages=3, causal=True, direction="bwd"), 2, 3, 1, 50, 33, "bshd"),
    (KernelConfig(96, "fp16", 32, 64, num_warps=4, num_stages=3, causal=True, direction="bwd"), 1, 1, 1, 29, 140, "bhsd"),
    (KernelConfig(128, "bf16", 32, 64, num_warps=4, num_stages=2, causal=True, direction="bwd", head_split=2),
     1, 2, 1, 40, 70, "bshd"),
    (KernelConfig(128, "fp16", 32, 64, num_warps=4, num_stages=1, direction="bwd", head_split=4), 1, 2, 2, 33, 50, "bhsd"),
    (KernelConfig(40, "fp16", 48, 32, num_warps=2, num_stages=2, direction="bwd"), 1, 2, 1, 61, 95, "bshd"),
    # dQ by its own pass (no atomics): GQA, causal, a head dim of interleaved pairs
    (KernelConfig(96, "bf16", 64, 64, num_warps=4, num_stages=2, causal=True, direction="bwd", dq="pass"),
     1, 4, 2, 70, 91, "bshd"),
    (KernelConfig(128, "fp16", 128, 64, num_warps=8, num_stages=1, direction="bwd", dq="pass"), 1, 2, 1, 130, 77, "bhsd"),
    # V's fragments held in registers for dP
    (KernelConfig(64, "bf16", 64, 64, num_warps=4, num_stages=2, causal=True, direction="bwd", v_in_regs=True),
     1, 2, 1, 100, 130, "bshd"),
    (KernelConfig(72, "fp32", 32, 32, num_warps=2, num_stages=2, causal=True, direction="bwd"), 1, 2, 1, 50, 83, "bshd"),
    (KernelConfig(256, "fp32", 16, 16, num_warps=4, num_stages=1, direction="bwd"), 1, 1, 1, 21, 40, "bhsd"),
]
# The backward defaults of the H100 for every head dim of the GPU grid (bf16), at odd lengths.
BWD_CASES += [(default_backward_config(d, dt, c, get_profile("h100")), 1, 2, 1, 75, 139, "bshd")
              for d in (32, 40, 64, 96, 128, 160, 192, 256) for dt in ("bf16", "fp32") for c in (False, True)]




def _inputs(cfg, b, hq, hkv, lq, lk, layout, grad=False):
    g = torch.Generator().manual_seed(hash(cfg.name) % 2**31)
    dt = TORCH_DTYPES[cfg.dtype]

    def one(h, n):
        t = torch.randn(b, n, h, cfg.head_dim, generator=g).to(dt).transpose(1, 2) if layout == "bshd" \
            else torch.randn(b, h, n, cfg.head_dim, generator=g).to(dt)
        return t.requires_grad_(grad)

    return one(hq, lq), one(hkv, lk), one(hkv, lk)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}-L{c[4]}x{c[5]}-{c[6]}")
def test_emulated_kernel_matches_reference(case):
    cfg, b, hq, hkv, lq, lk, layout = case
    q, k, v = _inputs(cfg, b, hq, hkv, lq, lk, layout)
    scale = 0.9 / cfg.head_dim ** 0.5
    with autoflash.emulate("h100"):
        out, lse = autoflash.flash_forward(q, k, v, causal=cfg.causal, scale=scale, config=cfg)
    assert not torch.isnan(out).any(), "unwritten (poisoned) or NaN output"
    up = torch.float64 if cfg.dtype == "fp32" else torch.float32
    ref, ref_lse = attention_ref(q.to(up), k.to(up), v.to(up), causal=cfg.causal, scale=scale)
    pt, pt_lse = attention_ref(q, k, v, causal=cfg.causal, scale=scale, upcast=False)
    ok, err, bound = within_tolerance(out, ref, pt)
    assert ok, f"out: err {err:.3e} > bound {bound:.3e}"
    ok, err, bound = within_tolerance(lse, ref_lse, pt_lse, atol=1e-5)
    assert ok, f"lse: err {err:.3e} > bound {bound:.3e}"


@pytest.mark.parametrize("case", BWD_CASES, ids=lambda c: f"{c[0].name}-L{c[4]}x{c[5]}-{c[6]}")
def test_emulated_backward_matches_reference(case):
    """dq, dk, dv against autograd through the fp32 reference, with FlashAttention-3's gradient rule
    max|dX - dX_ref| <= 2 * max|dX_torch - dX_ref| + 2 * max|r + 0.3 - 0.3 - r| (dX_torch: autograd in
    the input dtype, r: dX_ref rounded to it)."""
    cfg, b, hq, hkv, lq, lk, layout = case
    q, k, v = _inputs(cfg, b, hq, hkv, lq, lk, layout)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(q.dtype)
    scale = 0.9 / cfg.head_dim ** 0.5
    up = torch.float64 if cfg.dtype == "fp32" else torch.float32

    def grads(upcast):
        x = [t.to(up).requires_grad_() if upcast else t.clone().requires_grad_() for t in (q, k, v)]
        o, _ = attention_ref(*x, causal=cfg.causal, scale=scale, upcast=upcast)
        return torch.autograd.grad(o, x, dout.to(up) if upcast else dout)

    out, lse = attention_ref(q, k, v, causal=cfg.causal, scale=scale)
    with autoflash.emulate("h100"):
        got = autoflash.flash_backward(dout, q, k, v, out.to(q.dtype), lse.float(), causal=cfg.causal,
                                       scale=scale, config=cfg)
    for name, g, want, yard in zip(("dq", "dk", "dv"), got, grads(True), grads(False)):
        assert not torch.isnan(g).any(), f"{name}: NaN (unwritten or poisoned)"
        ok, err, bound = within_tolerance(g, want, yard, backward=True)
        assert ok, f"{name}: err {err:.3e} > bound {bound:.3e}"
