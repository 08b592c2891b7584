"""Non-tensor bulk copies on the host emulator (autoflash/emulation/cuda/runtime/tma.h): cp.async.bulk
loads that complete their bytes on an mbarrier, and cp.reduce.async.bulk .add.f32 reductions into
global memory, FA3's dQ accumulation: each is an exact fp32 add in some order, done at the wait that
covers its bulk group and not before; every planted misuse is a finding of its kind
(tests/host/bulk_probe.cu.j2)."""
import numpy as np
import pytest
import torch

import host_probes

N = 96  # floats a block adds: two halves of 48, 192 bytes each (multiples of 16)


def probe(case: str = "", sanitize: bool = False):
    module = host_probes.load(host_probes.render("bulk_probe.cu.j2", case=case), "bulk_probe", ("bulk_accumulate",),
                              sanitize)
    module.clear_findings()  # the library stays loaded: a test before this one may have left some
    return module


def accumulate(blocks: int, src: torch.Tensor, acc: torch.Tensor, case: str = "", sanitize: bool = False):
    module = probe(case, sanitize)
    seen = torch.full((blocks + 1,), float("nan"))
    module.get_function("bulk_accumulate")((blocks, 1, 1), (128, 1, 1), (src, acc, seen, np.int32(N)),
                                           shared_mem=128 + 2 * 4 * N)
    return module, seen


def scaled_sum(src: torch.Tensor, blocks: int) -> torch.Tensor:
    """What the blocks add into acc, in fp64: sum over b of (b + 1) * src's block b."""
    return sum((b + 1) * src[b * N:(b + 1) * N].double() for b in range(blocks))


@pytest.mark.parametrize("sanitize", [False, True])
def test_reductions_from_many_blocks_are_exact_adds(sanitize):
    """Small integers: every partial sum is exact in fp32, so any order of the adds gives the same
    floats; the result must be the exact sum (nothing lost, nothing added twice)."""
    blocks = 6
    g = torch.Generator().manual_seed(1)
    src = torch.randint(-50, 51, (blocks * N,), generator=g).float()
    acc = torch.randint(-9, 10, (N,), generator=g).float()
    want = acc.double() + scaled_sum(src, blocks)
    module, _ = accumulate(blocks, src, acc, sanitize=sanitize)
    assert torch.equal(acc.double(), want)
    assert module.findings() == []


def test_random_floats_add_within_fp32_rounding_of_some_order():
    blocks = 8
    g = torch.Generator().manual_seed(2)
    src = torch.randn(blocks * N, generator=g)
    acc = torch.randn(N, generator=g)
    want = acc.double() + scaled_sum(src, blocks)
    accumulate(blocks, src, acc)
    # blocks + 1 fp32 roundings of partial sums bounded by the sum of magnitudes
    bound = (blocks + 1) * 2.0 ** -24 * (acc.double().abs() + scaled_sum(src.abs(), blocks))
    assert ((acc.double() - want).abs() <= bound).all()


def test_the_adds_are_visible_at_the_wait_and_not_before():
    src = torch.arange(N, dtype=torch.float32) + 1
    acc = torch.full((N,), 100.0)
    _, seen = accumulate(1, src, acc)
    assert seen[0].item() == 100.0  # read between issue and wait: not yet added
    assert acc[0].item() == 101.0 and torch.equal(acc, 100.0 + src)


def test_a_single_block_is_bit_reproducible():
    g = torch.Generator().manual_seed(3)
    src = torch.randn(N, generator=g)
    runs = []
    for _ in range(2):
        acc = torch.randn(N, generator=torch.Generator().manual_seed(4))
        accumulate(1, src, acc)
        runs.append(acc)
    assert torch.equal(runs[0], runs[1])


MISUSES = {
    "source written": ("async", "an in-flight cp.reduce.async.bulk reads was written"),
    "no wait": ("async", "exited with bulk stores or reductions in flight"),
    "no fence": ("async", "through the async proxy, which thread"),
    "size": ("tma", "cp.reduce.async.bulk .add.f32 of 184 bytes (expected a positive multiple of 16)"),
    "misaligned add": ("misaligned", "cp.reduce.async.bulk .add.f32 at global address"),
    "misaligned load": ("misaligned", "cp.async.bulk (load) at global address"),
    "read in flight": ("uninitialized", "before its TMA load landed"),
}


@pytest.mark.parametrize("case", sorted(MISUSES))
def test_each_misuse_is_a_finding(case):
    src = torch.ones(2 * N + 4)
    acc = torch.zeros(N + 4)
    module, _ = accumulate(1, src, acc, case=case, sanitize=True)
    kind, text = MISUSES[case]
    found = [(f.kind, f.detail, f.thread) for f in module.findings()]
    assert any(k == kind and text in d and thread >= 0 for k, d, thread in found), found


@pytest.mark.parametrize("old, new, test", [
    # an add that overwrites: the other blocks' contributions are lost
    ("std::atomic_ref<float>(*reinterpret_cast<float*>(addr)).fetch_add(v);",
     "*reinterpret_cast<float*>(addr) = v;", "exact"),
    # reductions done at issue instead of at the wait
    ("  f.stores_open.push_back(std::move(s));\n}\n\nvoid tma_store(",
     "  for (uint32_t o = 0; o < bytes; o += 4) { float v; std::memcpy(&v, &s.bytes[o], 4); dst[o / 4] += v; }\n"
     "}\n\nvoid tma_store(", "visible"),
])
def test_the_bulk_checks_fail_when_the_emulator_is_broken(old, new, test, broken_runtime):
    broken_runtime("runtime/tma.h", old, new)
    with pytest.raises(AssertionError):
        (test_reductions_from_many_blocks_are_exact_adds if test == "exact"
         else test_the_adds_are_visible_at_the_wait_and_not_before)(*(() if test == "visible" else (False,)))


def test_the_probe_compiles_for_sm_90a_to_bulk_instructions():
    from autoflash.kernels.compiler import compile_source
    from autoflash.kernels.sass import disassemble

    compiled = compile_source(host_probes.render("bulk_probe.cu.j2", case=""), "bulk_accumulate", "sm_90a")
    assert not compiled.resources.spills
    sass = disassemble(compiled.cubin_path, "bulk_accumulate")
    assert "UBLKCP.S.G" in sass and "UBLKRED.G.S.ADD.F32.RN" in sass, sass
