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

from autoflash.codegen import render
from autoflash.config import KernelConfig
from autoflash.defaults import default_config
from autoflash.gpus import get_profile
from autoflash.reference import LOG2E, attention_ref, within_tolerance
from autoflash.resources import templates_dir

HERE = Path(__file__).resolve().parent / "host"
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

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
    cmd = ["g++", "-std=c++20", "-O1", "-no-pie", "-pthread", "-include", str(HERE / "emu" / "prelude.h"),
           "-I", str(HERE / "emu"), "-I", str(templates_dir()), "-DAUTOFLASH_STATIC_SMEM",
           "-DAUTOFLASH_HOST_EMULATION", f'-DKERNEL_SOURCE="{src}"', f"-DKERNEL_NAME={cfg.name}",
           str(HERE / "run_kernel.cpp"), "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return exe


@pytest.fixture(scope="module")
def binaries(tmp_path_factory):
    out = tmp_path_factory.mktemp("emu")
    cfgs = sorted({c[0] for c in CASES}, key=lambda c: c.name)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return dict(zip(cfgs, pool.map(lambda c: build(c, out), cfgs)))


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
