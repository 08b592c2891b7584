"""sm_90's synchronisation on the host emulator (autoflash/emulation/cuda/runtime/mbarrier.h): a
warp-specialized producer/consumer pipeline in the shape of FlashAttention-3's forward
(tests/host/pipeline_probe.cu.j2: full/empty mbarrier pairs, a named barrier among the consumers,
setmaxnreg, elect.sync) computes what it should, clean under the sanitizer, and compiles for sm_90a;
each planted misuse is a finding of its kind."""
import numpy as np
import pytest
import torch

import host_probes
from autoflash.emulation import build


def source(stages: int, case: str = "") -> str:
    return host_probes.render("pipeline_probe.cu.j2", stages=stages, case=case)


def run(stages: int, steps: int, case: str = "", sanitize: bool = False):
    module = host_probes.load(source(stages, case), "pipeline_probe", ("pipeline_probe",), sanitize)
    src = torch.randn(steps * 256, generator=torch.Generator().manual_seed(steps))
    out = torch.full((256,), float("nan"))
    module.get_function("pipeline_probe")((1, 1, 1), (384, 1, 1), (src, out, np.int32(steps)),
                                          shared_mem=128 + stages * 1024, names=("src", "out", "steps"))
    return module, src, out


@pytest.mark.parametrize("stages, steps", [(2, 7), (3, 1), (1, 4)])
@pytest.mark.parametrize("sanitize", [False, True])
def test_the_pipeline_computes_its_sums(stages, steps, sanitize):
    module, src, out = run(stages, steps, sanitize=sanitize)
    want = torch.zeros(256)
    for i in range(steps):  # the consumers' order
        want += src[i * 256:(i + 1) * 256]
    assert torch.equal(out, want)
    assert module.findings() == []


MISUSES = {
    "no init": ("mbarrier", "before any mbarrier.init there"),
    "never completes": ("mbarrier", "which never completes (phase 0: 1 of 257 arrivals pending"),
    "extra arrival": ("mbarrier", "arrivals or bytes that do not balance"),
    "named count": ("barrier", "named barrier 1: thread"),
}


@pytest.mark.parametrize("case", sorted(MISUSES))
def test_each_misuse_is_a_finding(case):
    module, _, _ = run(2, 5, case, sanitize=True)
    kind, text = MISUSES[case]
    found = [(f.kind, f.detail) for f in module.findings()]
    assert any(k == kind and text in d for k, d in found), found


def test_the_pipeline_compiles_for_sm_90a():
    from autoflash.kernels.compiler import compile_source

    compiled = compile_source(source(2), "pipeline_probe", "sm_90a")
    assert not compiled.resources.spills


@pytest.mark.parametrize("old, new", [
    ("  if ((m->phase & 1) != (parity & 1)) {", "  if ((m->phase & 1) == (parity & 1)) {"),
    ("  if (m.pending == 0 && m.tx == 0) {", "  if (m.pending <= 1 && m.tx == 0) {"),
])
def test_the_pipeline_check_fails_when_the_emulator_is_broken(old, new, broken_runtime):
    broken_runtime("runtime/mbarrier.h", old, new)
    with pytest.raises((AssertionError, build.EmulationError)):
        test_the_pipeline_computes_its_sums(2, 7, False)
