"""wgmma.mma_async on the host emulator, checked against CuTe's own definitions (tests/cute_layouts.py,
read from the nvidia-cutlass wheel) rather than against the formulas the emulator was written from:

- a probe kernel (tests/host/wgmma_probe.cu.j2, its instruction spelled by templates/common/wgmma.j2
  as a Hopper kernel will spell it) runs one warpgroup's SS or RS wgmma on operands placed in shared
  memory by CuTe's canonical layout for each major, swizzle and LBO/SBO arrangement; every thread's
  accumulators must be exactly what CuTe's CLayout_64xN assigns it (small integers: every sum is exact);
- the asynchrony: accumulators read before the covering wait_group hold their old values, a group
  still in flight after wait_group 1 has not landed;
- the sanitizer's findings for the misuses the PTX ISA calls undefined, one planted per probe;
- the check fails when the emulator is broken on purpose (its swizzle, its fragment layout);
- the probe's source compiles for sm_90a with NVRTC, ptxas reporting no serialized or repaired wgmma.
"""
import functools

import numpy as np
import pytest
import torch

import cute_layouts as cute
import host_probes
from autoflash.emulation import build
from autoflash.emulation.module import EmulatedModule

CTYPES = {"bf16": ("__nv_bfloat16", "bf16", torch.bfloat16), "fp16": ("__half", "f16", torch.float16)}
LAYOUTS = ("INTERLEAVE", "B32", "B64", "B128")
DESC_SWIZZLE = {"INTERLEAVE": 0, "B128": 1, "B64": 2, "B32": 3}  # the descriptor's bits 62-63


def probe_source(n: int, dtype: str, rs: bool, trans_a: int, trans_b: int, case: str = "", observe: bool = True) -> str:
    ctype, ptype, _ = CTYPES[dtype]
    return host_probes.render("wgmma_probe.cu.j2", n=n, ctype=ctype, ptype=ptype, rs=rs, trans_a=trans_a,
                              trans_b=trans_b, case=case, observe=observe)


def probe(n, dtype, rs, trans_a, trans_b, case="", sanitize=False):
    module = host_probes.load(probe_source(n, dtype, rs, trans_a, trans_b, case), "wgmma_probe", ("wgmma_probe",),
                              sanitize)
    return module, module.get_function("wgmma_probe")


def arrangements(major: str, layout: str, rows: int, elem: int = 2) -> list[tuple[int, int]]:
    """(LBO, SBO) in elements of two ways to lay a rows x 16 operand out in `layout` (the tile's atoms
    along M/N first, or along K first); [] where the layout cannot hold `rows`."""
    t, span = 16 // elem, 16 << cute.swizzle_bits(layout)  # span: the swizzle's bytes (16: none)
    if major == "K":
        if layout == "INTERLEAVE":  # core matrices of 8 rows x 16 bytes
            return [(128 // elem, 256 // elem), (rows // 8 * 128 // elem, 128 // elem)]
        return [(1, 8 * span // elem)]  # LBO unused when swizzled; SBO: 8 rows of `span` bytes
    if layout == "INTERLEAVE":  # core matrices of T elements x 8 K
        if rows % t:
            return []
        return [(rows // t * 128 // elem, 128 // elem), (128 // elem, 256 // elem)]
    atom_rows = span // elem  # elements along M/N of one atom, which holds 8 K
    if rows % atom_rows:
        return []
    atom = 8 * span // elem
    return [(atom, rows // atom_rows * atom), (2 * atom, atom)]


def _operand_bytes(major, layout, rows, lbo, sbo):
    return max(max(row) for row in cute.smem_bytes(major, layout, rows, lbo, sbo)) + 2


def run_probe(fn, n, dtype, rs, major_a, major_b, layout_a, layout_b, arr_a=0, arr_b=0, scale_d=1, seed=0):
    """Places random A (64 x 16) and B (n x 16) by CuTe's layouts, runs the probe and returns
    (out, early, out2, early2, A, B, init) with out & co. as (128, n / 2) float tensors."""
    g = torch.Generator().manual_seed(seed)
    torch_dtype = CTYPES[dtype][2]
    A = (torch.randint(-8, 9, (64, 16), generator=g) / 4).to(torch_dtype)  # exact products and sums
    B = (torch.randint(-8, 9, (n, 16), generator=g) / 4).to(torch_dtype)
    init = torch.randint(-16, 17, (128, n // 2), generator=g).float()
    lbo_a, sbo_a = arrangements(major_a, layout_a, 64)[arr_a] if not rs else (0, 0)
    lbo_b, sbo_b = arrangements(major_b, layout_b, n)[arr_b]
    a_bytes = 0 if rs else _operand_bytes(major_a, layout_a, 64, lbo_a, sbo_a)
    b_off = -(-a_bytes // 1024) * 1024
    size = b_off + -(-_operand_bytes(major_b, layout_b, n, lbo_b, sbo_b) // 1024) * 1024
    image = torch.zeros(size, dtype=torch.uint8)
    halves = image.view(torch_dtype)
    if not rs:
        halves[torch.tensor(cute.smem_bytes(major_a, layout_a, 64, lbo_a, sbo_a)) // 2] = A
    halves[(b_off + torch.tensor(cute.smem_bytes(major_b, layout_b, n, lbo_b, sbo_b))) // 2] = B
    owner = cute.register_a_owner()
    regs = torch.zeros(128, 8, dtype=torch_dtype)
    for (t, v), (m, k) in owner.items():
        regs[t, v] = A[m, k]
    out, early, out2, early2 = (torch.full((128, n // 2), float("nan")) for _ in range(4))
    u32, i32 = np.uint32, np.int32
    fn((1, 1, 1), (128, 1, 1),
       (image, i32(size // 16), init, regs.view(torch.int32), out, early, out2, early2,
        u32(0), u32(lbo_a * 2), u32(sbo_a * 2), i32(DESC_SWIZZLE[layout_a]),
        u32(b_off), u32(lbo_b * 2), u32(sbo_b * 2), i32(DESC_SWIZZLE[layout_b]), i32(scale_d)),
       shared_mem=size,
       names=("image", "chunks", "init", "a_regs", "out", "early", "out2", "early2"))
    return out, early, out2, early2, A.double(), B.double(), init.double()


def expected(A, B, init, n, scale_d):
    """Each thread's accumulators by CuTe's CLayout_64xN: init (if scale_d) + (A B^T)[m, n]."""
    rows, cols = _accumulator_index(n)
    return (A @ B.T)[rows, cols] + (init if scale_d else 0)


@functools.lru_cache(maxsize=None)
def _accumulator_index(n):
    """(m, n) index tensors (128, n / 2) of each thread's accumulators, by CuTe's CLayout_64xN."""
    rows, cols = torch.zeros(128, n // 2, dtype=torch.long), torch.zeros(128, n // 2, dtype=torch.long)
    for (t, v), (m, col) in cute.accumulator_owner(n).items():
        rows[t, v], cols[t, v] = m, col
    return rows, cols


def check(n, dtype, rs, major_a, major_b, layout_a, layout_b, arr_a=0, arr_b=0, scale_d=1, fn=None):
    if fn is None:
        _, fn = probe(n, dtype, rs, int(major_a == "MN"), int(major_b == "MN"))
    out, early, out2, early2, A, B, init = run_probe(fn, n, dtype, rs, major_a, major_b, layout_a, layout_b, arr_a,
                                                     arr_b, scale_d)
    assert torch.equal(out.double(), expected(A, B, init, n, scale_d))
    assert torch.equal(early, init.float())  # before the covering wait: what the accumulators held
    assert torch.equal(early2, torch.full_like(early2, 7.0))  # the second group is still in flight
    assert torch.equal(out2.double(), expected(A, B, init, n, 0))


# ------------------------------------------------------------------ SS and RS against CuTe
SS_CASES = [(n, major_a, major_b) for n in (64, 256) for major_a in ("K", "MN") for major_b in ("K", "MN")] + \
           [(24, "K", "K"), (8, "MN", "K")]


@pytest.mark.parametrize("n, major_a, major_b", SS_CASES)
def test_ss_wgmma_matches_cute_in_every_layout(n, major_a, major_b):
    _, fn = probe(n, "bf16", False, int(major_a == "MN"), int(major_b == "MN"))
    ran = 0
    for layout_a in LAYOUTS:
        for layout_b in LAYOUTS:
            arr_a, arr_b = arrangements(major_a, layout_a, 64), arrangements(major_b, layout_b, n)
            if not arr_a or not arr_b:
                continue
            for i, j in sorted({(0, 0), (len(arr_a) - 1, len(arr_b) - 1)}):
                check(n, "bf16", False, major_a, major_b, layout_a, layout_b, i, j, scale_d=ran % 2, fn=fn)
                ran += 1
    assert ran >= 4


@pytest.mark.parametrize("n, major_b, dtype", [(64, "K", "bf16"), (128, "MN", "bf16"), (96, "K", "fp16"),
                                               (256, "MN", "fp16")])
def test_rs_wgmma_matches_cute(n, major_b, dtype):
    _, fn = probe(n, dtype, True, 0, int(major_b == "MN"))
    for layout in LAYOUTS:
        for j in range(len(arrangements(major_b, layout, n))):
            check(n, dtype, True, "K", major_b, "B128", layout, 0, j, scale_d=1, fn=fn)


def test_fp16_ss():
    check(64, "fp16", False, "K", "MN", "B64", "B128")


# ------------------------------------------------------------------ the sanitizer
MISUSES = {
    "accumulator touched": ("async", "accumulator 1 of a wgmma.mma_async was changed while the wgmma was in flight"),
    "A register touched": ("async", "A register of a wgmma.mma_async (RS) was changed"),
    "shared memory written": ("async", "shared memory that an in-flight wgmma.mma_async reads (its B operand)"),
    "no fence": ("async", "wgmma.mma_async with no wgmma.fence"),
    "descriptors differ": ("wgmma", "issued wgmma.mma_async with other descriptors"),
    "divergent": ("barrier", "warpgroup 0"),
    "no proxy fence": ("async", "through the async proxy, which thread 0 wrote through the generic proxy with no "
                                "fence.proxy.async since"),
}


@pytest.mark.parametrize("case", sorted(MISUSES))
def test_each_misuse_is_a_finding(case):
    rs = case == "A register touched"
    module, fn = probe(64, "bf16", rs, 0, 0, case=case, sanitize=True)
    try:
        run_probe(fn, 64, "bf16", rs, "K", "K", "B128", "B128")
    except Exception:  # a misuse the block cannot get past (divergence) stops it; the finding says why
        pass
    kinds = {(f.kind, f.detail) for f in module.findings()}
    kind, text = MISUSES[case]
    assert any(k == kind and text in d for k, d in kinds), kinds
    module.clear_findings()


def test_a_correct_probe_is_clean_under_the_sanitizer():
    module, fn = probe(64, "bf16", False, 0, 1, sanitize=True)
    check(64, "bf16", False, "K", "MN", "B128", "B64", fn=fn)
    assert module.findings() == []


def test_chained_wgmmas_accumulate_in_issue_order_and_are_clean():
    """Two wgmmas on the same accumulators in one group (the k-steps of a tile): the second adds onto
    the first's result, which it must find even though neither has landed when it is issued."""
    module, fn = probe(64, "bf16", False, 0, 0, case="chained", sanitize=True)
    out, early, out2, _, A, B, init = run_probe(fn, 64, "bf16", False, "K", "K", "B128", "INTERLEAVE", 0, 1, scale_d=1)
    assert torch.equal(out.double(), expected(A, B, init, 64, 1) + expected(A, B, init, 64, 0))
    assert torch.equal(early, init.float()) and module.findings() == []


# ------------------------------------------------------------------ broken on purpose
@pytest.mark.parametrize("old, new", [
    ("return x ^ (((x >> 7) & (W / 16 - 1)) << 4);", "return x ^ (((x >> 6) & (W / 16 - 1)) << 4);"),  # swizzle
    ("inline int frag_col(int t, int i) { return 8 * (i / 4) + 2 * (t % 4) + i % 2; }",
     "inline int frag_col(int t, int i) { return 8 * (i / 4) + 2 * (t % 4) + (i + 1) % 2; }"),  # fragments
])
def test_the_check_fails_when_the_emulator_is_broken(old, new, broken_runtime):
    broken_runtime("runtime/wgmma.h", old, new)
    with pytest.raises(AssertionError):
        check(64, "bf16", False, "K", "K", "B128", "B128")


# ------------------------------------------------------------------ the GPU's compiler
@pytest.mark.parametrize("rs", [False, True])
def test_the_probe_compiles_for_sm_90a_without_serialization(rs):
    from autoflash.kernels.compiler import compile_source

    compiled = compile_source(probe_source(128, "bf16", rs, 0, 1, observe=False), "wgmma_probe", "sm_90a")
    assert not compiled.resources.spills
    for code in ("C7508", "C7511", "C7517", "C7519"):  # wgmma serialized, or a fence / wait injected
        assert code not in compiled.log, compiled.log


# ------------------------------------------------------------------ stmatrix
STMATRIX_PROBE = r"""
#include "common/mma_sm80.cuh"
#include "common/wgmma_sm90.cuh"
// One warp: a 16 x 16 tile into shared memory, ldmatrix_x4 (the emulator's cross-checked load), then
// stmatrix_x4 (must give the tile back) and stmatrix_x4_trans (each 8 x 8 block transposed in place).
extern "C" __global__ void stmatrix_probe(const uint4* tile, uint4* out, uint4* out_t) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int l = threadIdx.x, i = l / 8, r = l % 8;
  uint4* s = reinterpret_cast<uint4*>(smem_raw);
  s[l] = tile[l];  // 32 x 16 bytes: the tile, row-major, 32 bytes a row
  __syncwarp();
  const uint32_t base = __cvta_generic_to_shared(smem_raw), row = ((i % 2) * 8 + r) * 32 + (i / 2) * 16;
  uint32_t regs[4];
  ldmatrix_x4(regs, base + row);
  stmatrix_x4(base + 512 + row, regs);
  stmatrix_x4_trans(base + 1024 + row, regs);
  __syncwarp();
  out[l] = s[32 + l];
  out_t[l] = s[64 + l];
}
"""


@pytest.mark.parametrize("sanitize", [False, True])
def test_stmatrix_is_the_inverse_of_ldmatrix(sanitize):
    module = EmulatedModule(build.build_library(STMATRIX_PROBE, "stmatrix_probe", ("stmatrix_probe",), sanitize),
                            sanitize)
    tile = torch.randint(-30000, 30000, (16, 16), dtype=torch.int16)
    out, out_t = torch.zeros_like(tile), torch.zeros_like(tile)
    module.get_function("stmatrix_probe")((1, 1, 1), (32, 1, 1), (tile, out, out_t), shared_mem=1536,
                                          names=("tile", "out", "out_t"))
    assert torch.equal(out, tile)
    blocks = tile.view(2, 8, 2, 8).transpose(1, 3).reshape(16, 16)  # each 8 x 8 block transposed in place
    assert torch.equal(out_t, blocks)
    assert module.findings() == []


def test_stmatrix_compiles_for_sm_90a():
    from autoflash.kernels.compiler import compile_source

    assert not compile_source(STMATRIX_PROBE, "stmatrix_probe", "sm_90a").resources.spills
