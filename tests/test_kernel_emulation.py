"""The generated kernels, run on the CPU: g++ builds a rendered kernel against a small emulation of
the CUDA execution model (tests/host/emu: a thread per CUDA thread, barriers, warp exchanges for
shuffles, ldmatrix and mma.sync written from the PTX ISA's fragment layouts, cp.async copies that
land only when wait_group lets them). The output and LSE are held to FlashAttention's accuracy
rule against the fp32 reference. This exercises the template's own index math, pipeline waits,
masking and epilogue; the GPU tier (tests/test_gpu_forward.py) is still the final word."""
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from autoflash.checks import TORCH_DTYPES
from autoflash.codegen import render
from autoflash.config import KernelConfig
from autoflash.defaults import default_backward_config, default_config
from autoflash.gpus import get_profile
from autoflash.reference import LOG2E, attention_ref, within_tolerance
from autoflash.resources import templates_dir

HERE = Path(__file__).resolve().parent / "host"

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

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")]


def build(cfg: KernelConfig, out: Path) -> Path:
    src = out / f"{cfg.name}.cu"
    src.write_text(render(cfg))
    exe = out / cfg.name
    driver = "run_kernel.cpp" if cfg.direction == "fwd" else "run_bwd.cpp"
    cmd = ["g++", "-std=c++20", "-O1", "-no-pie", "-pthread", "-include", str(HERE / "emu" / "prelude.h"),
           "-I", str(HERE / "emu"), "-I", str(templates_dir()), "-DAUTOFLASH_STATIC_SMEM",
           "-DAUTOFLASH_HOST_EMULATION", f'-DKERNEL_SOURCE="{src}"', f"-DKERNEL_NAME={cfg.name}",
           f"-DKERNEL_NAME_DELTA={cfg.name}_delta", str(HERE / driver), "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return exe


# Backward: (config, batch, heads_q, heads_kv, seqlen_q, seqlen_k, layout)
BWD_CASES = [
    (KernelConfig(64, "bf16", 32, 64, num_warps=4, num_stages=2, causal=True, direction="bwd"), 1, 2, 1, 70, 100, "bhsd"),
    (KernelConfig(64, "fp16", 64, 64, num_warps=4, num_stages=1, direction="bwd"), 1, 2, 2, 45, 77, "bshd"),
    (KernelConfig(40, "bf16", 16, 32, num_warps=2, num_stages=3, causal=True, direction="bwd"), 2, 3, 1, 50, 33, "bshd"),
    (KernelConfig(96, "fp16", 32, 64, num_warps=2, num_stages=2, causal=True, direction="bwd"), 1, 1, 1, 29, 140, "bhsd"),
    (KernelConfig(96, "bf16", 16, 32, num_warps=2, num_stages=2, causal=True, direction="bwd", head_split=2),
     1, 2, 1, 40, 70, "bshd"),
    (KernelConfig(128, "fp16", 32, 64, num_warps=4, num_stages=1, direction="bwd", head_split=4), 1, 2, 2, 33, 50, "bhsd"),
    (KernelConfig(40, "fp16", 48, 32, num_warps=1, num_stages=2, direction="bwd"), 1, 2, 1, 61, 95, "bshd"),
    (KernelConfig(72, "fp32", 32, 32, num_warps=2, num_stages=2, causal=True, direction="bwd"), 1, 2, 1, 50, 83, "bshd"),
    (KernelConfig(256, "fp32", 16, 16, num_warps=4, num_stages=1, direction="bwd"), 1, 1, 1, 21, 40, "bhsd"),
]
# The backward defaults of the H100 for every head dim of the GPU grid (bf16), at odd lengths.
BWD_CASES += [(default_backward_config(d, dt, c, get_profile("h100")), 1, 2, 1, 75, 139, "bshd")
              for d in (32, 40, 64, 96, 128, 160, 192, 256) for dt in ("bf16", "fp32") for c in (False, True)]


@pytest.fixture(scope="module")
def binaries(request, tmp_path_factory):
    """Builds, in parallel and once, the kernels of the selected tests of this module."""
    out = tmp_path_factory.mktemp("emu")
    wanted = sorted({item.callspec.params["case"][0] for item in request.session.items
                     if item.module is request.module and "case" in getattr(item, "callspec", None).params},
                    key=lambda c: c.name)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return dict(zip(wanted, pool.map(lambda c: build(c, out), wanted)))


def run_emulated(exe: Path, q, k, v, layout: str, scale: float, tmp: Path):
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    def raw(t):  # (B, H, L, D) -> bytes in the requested memory layout
        t = t.transpose(1, 2) if layout == "bshd" else t
        return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).numpy().tobytes()
    header = np.array([b, hq, hkv, lq, lk, d, int(layout == "bshd")], dtype=np.int32).tobytes()
    (tmp / "in.bin").write_bytes(header + np.float32(scale * LOG2E).tobytes() + raw(q) + raw(k) + raw(v))
    r = subprocess.run([str(exe), str(tmp / "in.bin"), str(tmp / "out.bin")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    data = (tmp / "out.bin").read_bytes()
    n = q.numel() * q.element_size()
    shape = (b, lq, hq, d) if layout == "bshd" else (b, hq, lq, d)
    out = torch.frombuffer(bytearray(data[:n]), dtype=q.dtype).view(shape)
    out = out.transpose(1, 2) if layout == "bshd" else out
    lse = torch.frombuffer(bytearray(data[n:]), dtype=torch.float32).view(b, hq, lq)
    return out, lse


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}-L{c[4]}x{c[5]}-{c[6]}")
def test_emulated_kernel_matches_reference(binaries, case, tmp_path):
    cfg, b, hq, hkv, lq, lk, layout = case
    g = torch.Generator().manual_seed(hash(cfg.name) % 2**31)
    dt = TORCH_DTYPES[cfg.dtype]
    q = torch.randn(b, hq, lq, cfg.head_dim, generator=g).to(dt)
    k = torch.randn(b, hkv, lk, cfg.head_dim, generator=g).to(dt)
    v = torch.randn(b, hkv, lk, cfg.head_dim, generator=g).to(dt)
    scale = 0.9 / cfg.head_dim ** 0.5
    out, lse = run_emulated(binaries[cfg], q, k, v, layout, scale, tmp_path)
    assert not torch.isnan(out).any(), "unwritten (poisoned) or NaN output"
    if dt == torch.float32:
        ref, ref_lse = attention_ref(q.double(), k.double(), v.double(), causal=cfg.causal, scale=scale)
    else:
        ref, ref_lse = attention_ref(q, k, v, causal=cfg.causal, scale=scale)
    pt, pt_lse = attention_ref(q, k, v, causal=cfg.causal, scale=scale, upcast=False)
    ok, err, bound = within_tolerance(out, ref, pt)
    assert ok, f"out: err {err:.3e} > bound {bound:.3e}"
    ok, err, bound = within_tolerance(lse, ref_lse, pt_lse)
    assert ok, f"lse: err {err:.3e} > bound {bound:.3e}"


def _raw(t, layout):
    t = t.transpose(1, 2) if layout == "bshd" else t
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).numpy().tobytes()


@pytest.mark.parametrize("case", BWD_CASES, ids=lambda c: f"{c[0].name}-L{c[4]}x{c[5]}-{c[6]}")
def test_emulated_backward_matches_reference(binaries, case, tmp_path):
    """dq, dk, dv against autograd through the fp32 reference, with FlashAttention's gradient rule
    max|dX - dX_ref| <= 3 * max|dX_torch - dX_ref| + 1e-5 (dX_torch: autograd in the input dtype)."""
    cfg, b, hq, hkv, lq, lk, layout = case
    g = torch.Generator().manual_seed(hash(cfg.name) % 2**31)
    dt = TORCH_DTYPES[cfg.dtype]
    d = cfg.head_dim
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(dt) for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
    dout = torch.randn(b, hq, lq, d, generator=g).to(dt)
    scale = 0.9 / d ** 0.5

    up = torch.float64 if dt == torch.float32 else torch.float32  # fp32 is judged against fp64

    def grads(upcast):
        x = [t.to(up).requires_grad_() if upcast else t.clone().requires_grad_() for t in (q, k, v)]
        o, _ = attention_ref(*x, causal=cfg.causal, scale=scale, upcast=upcast)
        return torch.autograd.grad(o, x, dout.to(up) if upcast else dout)

    ref, pt = grads(True), grads(False)
    out, lse = attention_ref(q, k, v, causal=cfg.causal, scale=scale)
    header = np.array([b, hq, hkv, lq, lk, d, int(layout == "bshd")], dtype=np.int32).tobytes()
    (tmp_path / "in.bin").write_bytes(header + np.float32(scale).tobytes() + _raw(q, layout) + _raw(k, layout)
                                      + _raw(v, layout) + _raw(out.to(dt), layout) + _raw(dout, layout)
                                      + lse.float().contiguous().numpy().tobytes())
    r = subprocess.run([str(binaries[cfg]), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    data = np.frombuffer((tmp_path / "out.bin").read_bytes(), dtype=np.uint8)
    es = q.element_size()
    sizes = [q.numel() * 4, b * hq * lk * d * es, b * hq * lk * d * es, b * hq * lq * 4]
    parts = np.split(data, np.cumsum(sizes)[:-1])
    dq = torch.from_numpy(parts[0].copy().view(np.float32)).view(b, hq, lq, d).to(dt)
    raw = np.int16 if es == 2 else np.int32
    dk_x, dv_x = (torch.from_numpy(p.copy().view(raw)).view(dt).view(b, hq, lk, d) for p in parts[1:3])
    delta = torch.from_numpy(parts[3].copy().view(np.float32)).view(b, hq, lq)
    torch.testing.assert_close(delta, (dout.float() * out.to(dt).float()).sum(-1), rtol=1e-4, atol=1e-4)
    group = hq // hkv  # GQA: sum the per-query-head dK, dV of the heads sharing a K/V head
    dk = dk_x.float().view(b, hkv, group, lk, d).sum(2).to(dt)
    dv = dv_x.float().view(b, hkv, group, lk, d).sum(2).to(dt)
    for name, got, want, yard in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, pt):
        assert not torch.isnan(got).any(), f"{name}: NaN (unwritten or poisoned)"
        ok, err, bound = within_tolerance(got, want, yard, factor=3.0)
        assert ok, f"{name}: err {err:.3e} > bound {bound:.3e}"
