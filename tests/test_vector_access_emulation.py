"""The sanitizer sees the kernels' vector loads and stores (uint4, float2 through reinterpret_cast):
the emulator's vector types copy member by member, since GCC's ThreadSanitizer instrumentation, which
the checks ride on, leaves whole-struct copies out (autoflash/emulation/cuda/prelude.h). A clean copy
computes what it should and is no finding; each planted misuse is one (tests/host/vector_probe.cu.j2)."""
import numpy as np
import pytest
import torch

import host_probes
from autoflash.emulation.guards import guarded_randn

CASES = {
    "read past": ("out-of-bounds", "global read"),
    "write past": ("out-of-bounds", "global write"),
    "uninitialized shared": ("uninitialized", "before any write"),
}


def run(case: str = ""):
    module = host_probes.load(host_probes.render("vector_probe.cu.j2", case=case), "vector_probe", ("vector_copy",),
                              True)
    module.clear_findings()
    g = torch.Generator().manual_seed(0)
    src = guarded_randn(1, 1, 32, 4, torch.float32, g).reshape(128)
    dst = guarded_randn(1, 1, 32, 4, torch.float32, g).reshape(128)
    pairs = guarded_randn(1, 1, 32, 2, torch.float32, g).reshape(64)
    module.get_function("vector_copy")((1, 1, 1), (32, 1, 1), (src, dst, pairs, np.int32(7)), shared_mem=512)
    return module, src, dst, pairs


def test_a_clean_copy_is_right_and_no_finding():
    module, src, dst, pairs = run()
    assert torch.equal(dst, src)
    assert torch.equal(pairs.view(32, 2), torch.stack((torch.arange(32.0), torch.full((32,), 7.0)), 1))
    assert module.findings() == []


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_vector_misuse_is_a_finding(case):
    module, *_ = run(case)
    kind, text = CASES[case]
    found = [(f.kind, f.detail) for f in module.findings()]
    assert any(k == kind and text in d for k, d in found), found


def test_whole_struct_copies_would_be_missed(broken_runtime):
    """The control: float2 as a plain aggregate (copied whole, as GCC's instrumentation leaves it), the
    store past the end goes unreported."""
    broken_runtime("prelude.h", "  float2(const float2& o) : x(o.x), y(o.y) {}\n"
                   "  float2& operator=(const float2& o) { x = o.x; y = o.y; return *this; }\n", "")
    module, *_ = run("write past")
    assert not any(f.kind == "out-of-bounds" and "global write" in f.detail for f in module.findings())
