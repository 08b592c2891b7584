"""The sanitizer's guards on the launchers' own buffers (O, LSE, delta, the fp32 dQ accumulator, dK/dV,
dQ, the split-KV partials) and on memory that is no tensor of the launch, and the emulator's launch
limits. Mutation tests plant a bug one row too far into the rendered source (as tests/test_emulation.py
does) and expect an out-of-bounds finding at its template line; the unmutated kernels stay clean there
(test_emulation.py's clean tests run through the same guarded buffers)."""
import math

import pytest
import torch

import autoflash
from autoflash import emulation
from autoflash.emulation import guards, module
from autoflash.emulation.limits import LaunchRefused, kernel_registers
from autoflash.kernels.defaults import default_config
from autoflash.kernels.gpus import get_profile
from autoflash.selfcheck import main as selfcheck

from test_emulation import _template_line

SHAPE = ["--shape", "1,2,1,77,133,64"]
DQ_PASS = "bwd_hd64_bf16_m128n128w8s2_dqpass"


# name: (direction, old, new, selfcheck arguments, template, text of the line the finding names, text the
#        finding's detail holds)
MUTATIONS = {
    # the coalesced O store one row past seqlen_q: row 77 of head 0 is a guard row of O
    "o-store": ("fwd", "store_tile<BLOCK_M, O_CHUNKS, THREADS>(smem.q, o_base, o_sm, m_start, seqlen_q, tid,",
                "store_tile<BLOCK_M, O_CHUNKS, THREADS>(smem.q, o_base, o_sm, m_start, seqlen_q + 1, tid,",
                SHAPE, "flash_fwd.cu.j2", "store_tile<BLOCK_M, O_CHUNKS, THREADS>(smem.q, o_base", "write of out"),
    # packed sequences: one sequence's row past its end is the next one's first row
    "o-store-varlen": ("fwd", "store_tile<BLOCK_M, O_CHUNKS, THREADS>(smem.q, o_base, o_sm, m_start, seqlen_q, tid,",
                       "store_tile<BLOCK_M, O_CHUNKS, THREADS>(smem.q, o_base, o_sm, m_start, seqlen_q + 1, tid,",
                       ["--shape", "4,2,1,40,50,64", "--varlen", "--seed", "3"], "flash_fwd.cu.j2",
                       "store_tile<BLOCK_M, O_CHUNKS, THREADS>(smem.q, o_base", "cu_seqlens_q"),
    # the dQ atomics' row guard off by one: row seqlen_q of head 0 is head 1's row 0 in the contiguous
    # accumulator (the rule of whose rows a block may touch), of the last head the trailing guard
    "dq-atomic": ("bwd", "if ((!MASKED || row0 + dr < seqlen_q) && col_ok)",
                  "if ((!MASKED || row0 + dr <= seqlen_q) && col_ok)",
                  [*SHAPE, "--backward"], "flash_bwd.cu.j2", "atomicAdd(dq_lane + dr * HEAD_DIM + dc", "dq_accum"),
    # a ragged last query block left in the steady-state loop, whose dQ atomics are not guarded:
    # seqlen_q 77 of a 128-row block, its rows 77.. are written
    "dq-unmasked": ("bwd", "const int n_rag = n_q > n_masked", "const int n_rag = 0 * n_q > n_masked",
                    [*SHAPE, "--backward"], "flash_bwd.cu.j2", "atomicAdd(dq_lane + dr * HEAD_DIM + dc", "dq_accum"),
    # the dQ pass's store one row past seqlen_q
    "dq-pass-store": ("bwd", "seqlen_q, tid, 0, VALID_CHUNKS);", "seqlen_q + 1, tid, 0, VALID_CHUNKS);",
                      ["--shape", "1,2,1,77,133,64", "--config", DQ_PASS], "flash_bwd.cu.j2",
                      "store_tile<BLOCK_M, D_CHUNKS, THREADS>(smem.q, dq + batch", "write of dq"),
    # the split-KV combine reading one split past the last: the partials' trailing guard
    "combine-read": ("fwd", "for (int s = 0; s < num_splits; ++s) {", "for (int s = 0; s <= num_splits; ++s) {",
                     ["--kvcache", "--shape", "2,4,2,3,700,64", "--splits", "2"], "flash_combine.cu.j2",
                     "const float l = lse_accum[s * n_rows + row_id];", "read of lse_accum"),
    # an index tensor the call does not have is a null pointer: reading it unchecked is reported (and
    # the block stops there instead of crashing the process)
    "null-read": ("fwd", "(cache_leftpad ? cache_leftpad[batch] : 0)", "cache_leftpad[batch]",
                  ["--kvcache", "--shape", "2,4,2,3,200,64"], "flash_fwd.cu.j2", "const int k_off = KVCACHE ?",
                  "null pointer"),
    # the sm90 family's LSE rows one past seqlen_q (its O leaves by TMA stores, which skip such rows)
    "lse-sm90": ("fwd", "t % 4 == 0 && row < seqlen_q) lse[", "t % 4 == 0 && row <= seqlen_q) lse[", SHAPE,
                 "flash_fwd_sm90.cu.j2", "t % 4 == 0 && row < seqlen_q) lse[", "write of lse"),
    # the sm90 forward of packed sequences: O's plain stores one row past the sequence (its next one's)
    "o-store-varlen-sm90": ("fwd", "if (m_start + g * 64 + r < seqlen_q)", "if (m_start + g * 64 + r <= seqlen_q)",
                            ["--shape", "4,2,1,40,50,64", "--varlen", "--seed", "3"], "flash_fwd_sm90.cu.j2",
                            "*reinterpret_cast<const uint4*>(smem_raw + (Tile::element_at(q_tile, BLOCK_M, g * 64 + r",
                            "cu_seqlens_q"),
    # the sm90 backward's dQ reduction one query row longer than its tile: past the padded
    # accumulator's end at the last tile of the last head
    "dq-sm90": ("bwd", "dq_tile, BLOCK_M * D_ROWS * 4, L2_EVICT_LAST);", "dq_tile, (BLOCK_M + 1) * D_ROWS * 4, L2_EVICT_LAST);",
                [*SHAPE, "--backward"], "flash_bwd_sm90.cu.j2", "bulk_reduce_add(dq_next, dq_tile",
                "dq_accum"),
    # a store far past every tensor: memory of no tensor of the launch (the block stops before it)
    "wild-write": ("fwd", "lse_base[m_start + row] = row_lse(row_max[mt][h], l);",
                   "lse_base[m_start + row + (1 << 26)] = row_lse(row_max[mt][h], l);", SHAPE, "flash_fwd.cu.j2",
                   "lse_base[m_start + row] = row_lse(row_max[mt][h], l);", "no tensor of the launch"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_a_buffer_overrun_is_an_out_of_bounds_finding_at_its_line(mutate, capsys, name):
    direction, old, new, argv, template, line_text, detail = MUTATIONS[name]
    mutate(direction, old, new)
    gpu = "h100" if template.endswith("_sm90.cu.j2") else "a100"  # the H100's plain kernels are the sm90 family's
    status = selfcheck(["--emulate", gpu, "--sanitize", *argv])
    out = capsys.readouterr().out
    assert status == 1, out
    found = [f for f in emulation.findings() if f.kind == "out-of-bounds" and f.location != "?"]
    assert found, out
    f = found[0]
    where = f"templates/{template}:{_template_line(template, line_text)}"
    assert f.location == where or where in " ".join(f.frames), str(f)
    assert detail in f.detail, str(f)
    assert f.kernel.startswith(direction) and len(f.block) == 3 and 0 <= f.thread < 1024, str(f)
    assert f"out-of-bounds: {f.kernel} at {f.location}" in out


def test_the_dq_accumulators_next_head_is_not_its_own(mutate):
    """Row seqlen_q of head 0 in the contiguous dQ accumulator is head 1's row 0, an element of the
    tensor: the finding says whose rows the block works on."""
    mutate("bwd", "if ((!MASKED || row0 + dr < seqlen_q) && col_ok)",
                  "if ((!MASKED || row0 + dr <= seqlen_q) && col_ok)")
    assert selfcheck(["--emulate", "a100", "--sanitize", *SHAPE, "--backward"]) == 1
    details = [f.detail for f in emulation.findings() if f.kind == "out-of-bounds"]
    rule = "not in the rows of the (batch, head) that block works on"
    assert any("dq_accum at element (0, 1, 0, " in d and rule in d for d in details), details


# ------------------------------------------------------------------ the guarded buffers themselves
def test_outside_the_sanitizer_the_buffers_are_torchs():
    q = torch.randn(2, 9, 3, 64).transpose(1, 2)
    for ctx in (autoflash.emulate("h100"), autoflash.emulate("h100", sanitize=False)):
        with ctx:
            out = guards.empty_like(q, "bhld", name="out")
            lse = guards.empty((2, 3, 9), torch.float32, q.device, "bhl")
            acc = guards.zeros((2, 3, 9, 64), torch.float32, q.device, "bhld", contiguous=True)
        assert out.stride() == torch.empty_like(q).stride() and lse.is_contiguous() and acc.is_contiguous()
        assert not acc.any() and guards.guard_of(out) is None
    out = guards.empty_like(q, "bhld")  # no emulation at all
    assert out.stride() == torch.empty_like(q).stride() and guards.guard_of(out) is None


@pytest.mark.parametrize("physical", ["bhsd", "bshd"])
def test_guard_rows_follow_each_batch_and_heads_rows(physical):
    q = torch.randn(2, 3, 9, 64) if physical == "bhsd" else torch.randn(2, 9, 3, 64).transpose(1, 2)
    with autoflash.emulate("h100", sanitize=True):
        out = guards.empty_like(q, "bhld", name="out")
    assert out.shape == q.shape and out.dtype == q.dtype
    # the same physical order as torch.empty_like, rows and columns padded
    order = sorted(range(4), key=lambda i: -out.stride(i))
    assert order == sorted(range(4), key=lambda i: -torch.empty_like(q).stride(i))
    assert out.stride(3) == 1 and out.stride(2) >= 64 + guards.GUARD_BYTES // 4
    g = guards.guard_of(out)
    assert g is not None and g.name == "out" and g.physical[g.roles.index("l")] == 9 + guards.GUARD_ROWS
    # row 9 of (batch 0, head 1) is a guard element: poisoned, and a write there is seen after the launch
    row9 = out.as_strided((64,), (1,), out.storage_offset() + out.stride(1) + 9 * out.stride(2))
    assert torch.isnan(row9).all()
    assert guards.check_guards(out) is None
    row9[5] = 1.0
    changed = guards.check_guards(out)
    assert changed and "row 9 is past its 9" in changed and "head 1" in changed and "column 5" in changed
    assert guards.check_guards(out) is None  # poisoned again


def test_a_contiguously_indexed_buffer_is_guarded_after_its_end():
    with autoflash.emulate("h100", sanitize=True):
        acc = guards.zeros((2, 3, 9, 8), torch.float32, torch.device("cpu"), "bhld", name="dq_accum", contiguous=True)
        parts = guards.empty((3, 2, 4, 5), torch.float32, torch.device("cpu"), "sbhl", name="lse_accum", contiguous=True)
    assert acc.is_contiguous() and not acc.any() and parts.is_contiguous()
    # one more slice of the outermost dim: a split past the last lands in guard bytes
    past = parts.as_strided((parts[0].numel(),), (1,), parts.numel())
    assert torch.isnan(past).all()
    past[-1] = 0.0
    assert "past its last, in the trailing guard" in guards.check_guards(parts)


def test_rows_rules_of_a_launchers_buffers():
    with autoflash.emulate("h100", sanitize=True):
        out = guards.empty_like(torch.randn(2, 9, 3, 64).transpose(1, 2), "bhld", name="out")
        packed = guards.empty((50, 3, 64), torch.bfloat16, torch.device("cpu"), "lhd", rows="k")
    assert guards.rows_rule(out, (4, 3, 2)) == (0, 1, -1, None)
    assert guards.rows_rule(out.transpose(1, 2), (4, 3, 2)) == (0, 2, -1, None)  # a view: its own dims
    assert guards.rows_rule(out, (8, 1, 1)) == (-1, -1, -1, None)  # another grid (the combine's): no rule
    assert guards.rows_rule(packed, (1, 3, 5)) == (-1, 1, 0, "k")
    assert guards.rows_rule(torch.empty(2, 3, 9, 64), (1, 3, 2)) == (-1, -1, -1, None)  # not a launcher's buffer


# ------------------------------------------------------------------ launch limits
H100 = get_profile("h100")
FWD = default_config(64, "bf16", False, H100)


@pytest.mark.parametrize("sanitize", [False, True])
@pytest.mark.parametrize("grid, block, smem, limit, value, maximum", [
    ((1, 1, 65536), (128, 1, 1), 0, "gridDim.z", 65536, 65535),
    ((1, 65536, 1), (128, 1, 1), 0, "gridDim.y", 65536, 65535),
    ((2**31, 1, 1), (128, 1, 1), 0, "gridDim.x", 2**31, 2**31 - 1),
    ((0, 1, 1), (128, 1, 1), 0, "gridDim.x", 0, 2**31 - 1),
    ((1, 1, 1), (1025, 1, 1), 0, "blockDim.x", 1025, 1024),
    ((1, 1, 1), (64, 32, 1), 0, "threads per block", 2048, 1024),
    ((1, 1, 1), (128, 1, 1), H100.smem_per_block_optin + 1,
     r"dynamic shared memory per block on the h100 \(its opt-in maximum\)", H100.smem_per_block_optin + 1,
     H100.smem_per_block_optin),
])
def test_a_launch_the_gpu_refuses_is_refused(sanitize, grid, block, smem, limit, value, maximum):
    fn = module.load_functions(FWD, sanitize)[FWD.name]
    with autoflash.emulate("h100", sanitize=sanitize):
        emulation.clear_findings()
        try:
            with pytest.raises(LaunchRefused, match=rf"launch of {FWD.name} refused: {limit}: got {value:,}, the "
                                                    rf"maximum is {maximum:,}") as e:
                fn(grid, block, (), shared_mem=smem)
            found = [f for f in emulation.findings() if f.kind == "launch"]
        finally:  # later tests read this library's findings
            emulation.clear_findings()
    assert (e.value.kernel, e.value.value, e.value.maximum) == (FWD.name, value, maximum)
    assert len(found) == (1 if sanitize else 0) and (not found or f"got {value:,}" in found[0].detail)


def test_registers_past_the_register_file_are_refused():
    """ptxas's registers per thread for the emulated arch, allocated per warp in units of 256: the
    kernel (launch bounds 128 threads) at 512 threads needs more than the 64K registers of a block."""
    regs = kernel_registers(FWD, H100.arch, FWD.name)
    assert regs is not None and 0 < regs <= 255
    per_warp = math.ceil(regs * 32 / 256) * 256
    threads = next(t for t in range(32, 1025, 32) if t // 32 * per_warp > H100.regs_per_sm)
    fn = module.load_functions(FWD, False)[FWD.name]
    with autoflash.emulate("h100"), pytest.raises(
            LaunchRefused, match=rf"registers per block on the h100: got {threads // 32 * per_warp:,}, the maximum is "
                                 rf"65,536 \({regs} registers per thread as ptxas gives it for sm_90, {per_warp} per "
                                 rf"warp in units of 256, x {threads // 32} warps\)"):
        fn((1, 1, 1), (threads, 1, 1), ())
    assert FWD.threads // 32 * per_warp <= H100.regs_per_sm  # the launcher's own block size fits


def test_a_config_too_big_for_the_emulated_gpu_is_refused_at_launch():
    """The H100's forward tiles for head dim 192 need more shared memory than an L4 has."""
    big = default_config(192, "bf16", False, H100)
    assert big.smem_bytes > get_profile("l4").smem_per_block_optin
    fn = module.load_functions(big, False)[big.name]
    with autoflash.emulate("l4"), pytest.raises(LaunchRefused, match="opt-in maximum"):
        fn((1, 1, 1), (big.threads, 1, 1), (), shared_mem=big.smem_bytes)


def test_a_kernel_within_the_limits_runs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    with autoflash.emulate("h100"):
        out, lse = autoflash.flash_forward(q, k, v, config=FWD)
    ref = torch.softmax((q.float() @ k.float().transpose(-1, -2)) / 8, -1) @ v.float()
    assert (out.float() - ref).abs().max() < 2e-2 and torch.isfinite(lse).all()
