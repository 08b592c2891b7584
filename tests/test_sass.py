"""Static SASS analysis (autoflash.kernels.sass) and `python -m autoflash.bench sass`: the loop
finder and class counts on a hand-written listing, the counts of a real default kernel against
their analytic values (NVRTC + nvdisasm, no GPU), and the commands' output. No network: the torch
wheel that the bench downloads is not needed here."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from autoflash.bench import sass as bench_sass
from autoflash.kernels import sass

# nvdisasm -c -g style: a prologue, a one-block loop (the masked tiles), then the main loop with an
# if/else (two HMMAs on each side) and the `@!P0 CALL.REL.NOINC` exit ptxas gives `#pragma unroll 1`
# loops, then the self-branch nvdisasm pads a function with (a loop without HMMA).
LISTING = """
	.section	.text.toy,"ax",@progbits
toy:
	//## File "/x/templates/flash_fwd.cu.j2", line 10
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ;
.L_x_0:
	//## File "/x/templates/flash_fwd.cu.j2", line 20
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0030*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0040*/                @P0 BRA `(.L_x_0) ;
.L_x_1:
	//## File "/x/templates/flash_fwd.cu.j2", line 30
        /*0050*/                   LDSM.16.M88.4 R8, [R2] ;
        /*0060*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0070*/                   HMMA.16816.F32.BF16 R16, R8, R14, R16 ;
        /*0080*/                @P1 BRA `(.L_x_2) ;
	//## File "/x/templates/common/mma_sm80.cuh", line 31
        /*0090*/                   HMMA.16816.F32.BF16 R20, R8, R12, R20 ;
        /*00a0*/                   HMMA.16816.F32.BF16 R24, R8, R14, R24 ;
        /*00b0*/                   FMUL R5, R5, 0.5 ;
        /*00c0*/                   BRA `(.L_x_3) ;
.L_x_2:
        /*00d0*/                   HMMA.16816.F32.BF16 R28, R8, R12, R28 ;
        /*00e0*/                   HMMA.16816.F32.BF16 R32, R8, R14, R32 ;
.L_x_3:
	//## File "/x/templates/flash_fwd.cu.j2", line 40
        /*00f0*/               @!PT LDS RZ, [RZ] ;
        /*0100*/                   LDGSTS.E.BYPASS.128 [R3], [R6.64] ;
        /*0110*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0120*/                   MUFU.EX2 R5, R5 ;
        /*0130*/                   FFMA R5, R5, R6, R7 ;
        /*0140*/                   IMAD.MOV.U32 R6, RZ, RZ, R7 ;
        /*0150*/              @!P0 CALL.REL.NOINC `(.L_x_4) ;
        /*0160*/                   BRA `(.L_x_1) ;
.L_x_4:
	//## File "/x/templates/flash_fwd.cu.j2", line 50
        /*0170*/                   EXIT ;
.L_x_5:
        /*0180*/                   BRA `(.L_x_5);
        /*0190*/                   NOP;
"""


def test_analyzer_finds_the_loops_and_counts_a_synthetic_listing():
    assert sass.classify("LDS", "@!PT") is None and sass.classify("IMAD.MOV.U32") == "MOV"
    assert sass.classify("CALL.REL.NOINC") == "control" and sass.classify("HMMA.16816.F32.BF16") == "HMMA"
    loops = sass.hmma_loops(LISTING)
    assert [hex(lp.header_addr) for lp in loops] == ["0x20", "0x50"]  # the NOP padding's self-branch holds no HMMA
    tiles, main = loops
    assert tiles.counts == {"HMMA": 1, "int/addr": 1, "control": 1} and not tiles.nested
    # Every instruction of the main loop once: both sides of the if/else, the @!PT placeholder left out.
    assert main.counts == {"HMMA": 6, "LDSM": 1, "LDGSTS": 1, "BAR": 1, "MUFU": 1, "FP": 2, "MOV": 1, "control": 4}
    assert main.total == 17 and main.lines == (30, 40) and not main.nested
    assert sass.main_loop(loops) is main
    row = sass.loop_row(main)
    assert row["HMMA/iter"] == 6 and row["LDSM/HMMA"] == pytest.approx(1 / 6)
    assert row["FP+MUFU/HMMA"] == pytest.approx(3 / 6) and row["spill/iter"] == 0 and row["BAR/iter"] == 1
    # One iteration runs one side of the if/else: 4 HMMAs, the longer side (with the FMUL).
    path = sass.iteration_counts(LISTING, main, 4)
    assert path == {"HMMA": 4, "LDSM": 1, "LDGSTS": 1, "BAR": 1, "MUFU": 1, "FP": 2, "MOV": 1, "control": 4}
    assert sass.iteration_counts(LISTING, main, 6) is None  # no iteration issues both sides
    assert sass.iteration_counts(LISTING, tiles, 1) == tiles.counts
    with pytest.raises(TypeError, match="expected a Loop"):
        sass.iteration_counts(LISTING, "0x50", 4)
    with pytest.raises(ValueError, match="no loop with tensor-core MMAs"):
        sass.main_loop([])


def test_main_loop_prefers_the_last_loop_without_an_inner_loop():
    # A loop that holds an inner loop (autoflash's masked tiles walk key slices) is not the main loop
    # even when it comes last.
    nested = LISTING.replace("        /*0170*/                   EXIT ;", """\
        /*0170*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
.L_x_6:
        /*0180*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0190*/                @P2 BRA `(.L_x_6) ;
        /*01a0*/                @P3 BRA `(.L_x_4) ;
        /*01b0*/                   EXIT ;""").replace("/*0180*/                   BRA `(.L_x_5);",
                                                       "/*01c0*/                   BRA `(.L_x_5);")
    loops = sass.hmma_loops(nested)
    assert [(hex(lp.header_addr), lp.nested) for lp in loops] == [("0x20", False), ("0x50", False), ("0x170", True)]
    assert sass.main_loop(loops).header_addr == 0x50


@pytest.fixture(scope="module")
def forward_d128_a100():
    from autoflash.kernels.compiler import compile_config
    from autoflash.kernels.defaults import default_config
    from autoflash.kernels.gpus import get_profile

    cfg = default_config(128, "bf16", False, get_profile("a100"))
    return cfg, sass.disassemble(compile_config(cfg, "sm_80").cubin_path, cfg.name)


def test_default_forward_main_loop_matches_its_tile(forward_d128_a100):
    cfg, text = forward_d128_a100
    loop = sass.main_loop(sass.hmma_loops(text))
    d_pad, block_n = cfg.head_dim_padded, cfg.block_n
    m_tiles = cfg.block_m // cfg.num_warps // 16  # a warp's m16 tiles of query rows
    # S = Q K^T: m_tiles x (block_n / 8) n8 tiles over d_pad / 16 k steps; O += P V: m_tiles x
    # (d_pad / 8) n8 tiles over block_n / 16 k steps.
    hmma = m_tiles * (block_n // 8) * (d_pad // 16) + m_tiles * (d_pad // 8) * (block_n // 16)
    # ldmatrix.x4: Q's A fragments and K's B fragments (two n8 tiles each) per k16 step, then V's.
    ldsm = (d_pad // 16) * (m_tiles + block_n // 16) + (block_n // 16) * (d_pad // 16)
    assert loop.counts.get("LDL/STL", 0) == 0, f"{cfg.name}: spills in the main loop ({loop.counts})"
    assert loop.counts["HMMA"] == hmma, cfg.name
    assert loop.counts["LDSM"] == ldsm, cfg.name
    assert bench_sass.mma_per_warp(bench_sass.Kernel(
        "autoflash", cfg.name, "fwd", d_pad, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, 1,
        cfg.smem_bytes, 0, text)) == (hmma, hmma)


def test_backward_mma_counts_charge_the_head_split():
    k = bench_sass.Kernel("autoflash", "x", "bwd", 128, 32, 128, 8, 2, 2, 0, 0, "")
    b = 32 * 128 * 128 // 2048  # MMAs per product and block
    executed, useful = bench_sass.mma_per_warp(k)
    assert (executed, useful) == ((2 + 3 / 2) * b / 8, 5 * b / 2 / 8) == (112, 80)
    assert bench_sass.mma_per_warp(bench_sass.Kernel("FA2", "y", "bwd", 128, 64, 128, 8, 2, 1, 0, 0, "")) == (320, 320)


def test_fa2_symbols_are_read_from_their_mangled_names():
    bwd = ("_ZN13pytorch_flash44flash_bwd_dq_dk_dv_loop_seqk_parallel_kernelI23Flash_bwd_kernel_traitsILi128ELi64ELi128"
           "ELi8ELi2ELi4ELi2ELb0ELb0EN7cutlass10bfloat16_tE19Flash_kernel_traitsILi128ELi64ELi128ELi8ES3_EELb0ELb1ELb0"
           "ELb0ELb1ELb1ELb0EEEvNS_16Flash_bwd_paramsE")
    s = bench_sass.parse_symbol(bwd)
    assert (s.kernel, s.traits, s.elem, s.flags) == ("flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel",
                                                     (128, 64, 128, 8, 2, 4, 2, 0, 0), "bfloat16_t",
                                                     bench_sass._flags(bench_sass.BWD_FLAGS, True))
    dot = ("_ZN13pytorch_flash25flash_bwd_dot_do_o_kernelILb1E23Flash_bwd_kernel_traitsILi64ELi128ELi128ELi8ELi4ELi4"
           "ELi4ELb0ELb0EN7cutlass10bfloat16_tE19Flash_kernel_traitsILi64ELi128ELi128ELi8ES3_EEEE"
           "vNS_16Flash_bwd_paramsE")
    s = bench_sass.parse_symbol(dot)
    assert (s.kernel, s.lead, s.traits, s.flags) == ("flash_bwd_dot_do_o_kernel", (1,),
                                                     (64, 128, 128, 8, 4, 4, 4, 0, 0), ())
    assert bench_sass.parse_symbol("_ZN5other6kernelEv") is None
    index = [bench_sass.Located("a.sm_80.cubin", "sm_80", s)]
    found = bench_sass.pick(index, "flash_bwd_dot_do_o_kernel", "sm_80", s.traits, (), lead=(1,))
    assert found.elf == "a.sm_80.cubin"
    with pytest.raises(ValueError, match="no flash_bwd_dot_do_o_kernel for sm_90"):
        bench_sass.pick(index, "flash_bwd_dot_do_o_kernel", "sm_90", s.traits, (), lead=(1,))


def test_render_sass_reports_the_main_loop():
    out = subprocess.run([sys.executable, "-m", "autoflash.render", "fwd_hd128_bf16_m128n64w4s1", "--gpu", "a100",
                          "--sass", "-o", "/dev/null"], capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    assert "main loop" in text and "static" in text and "HMMA/iter" in text


def test_bench_sass_help_explains_the_download():
    out = subprocess.run([sys.executable, "-m", "autoflash.bench", "sass", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for words in ("torch CUDA wheel", "1 GB", "libtorch_cuda.so", "nvidia-cuda-cuobjdump", "no GPU", "static proxy",
                  "not timings", "--workdir"):
        assert words in text, words


# FlashAttention-2's backward, shaped: an outer loop over key blocks (`n_block += gridDim.x`, one
# trip per block by default) around the per-query-step loop that holds every HMMA, with the key
# block's prologue (a load) and epilogue (dK/dV stores) in the outer loop's body.
FA2_SHAPED = """
	.section	.text.fa2,"ax",@progbits
fa2:
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ;
.L_x_0:
        /*0020*/                   LDGSTS.E.BYPASS.128 [R3], [R6.64] ;
        /*0030*/                   IMAD R2, R2, 0x2, RZ ;
.L_x_1:
        /*0040*/                   LDSM.16.M88.4 R8, [R2] ;
        /*0050*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0060*/                   HMMA.16816.F32.BF16 R16, R8, R14, R16 ;
        /*0070*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0080*/                @P1 BRA `(.L_x_1) ;
        /*0090*/                   STG.E [R6.64], R4 ;
        /*00a0*/                   STG.E [R6.64+0x10], R16 ;
        /*00b0*/                   IADD3 R5, R5, 0x1, RZ ;
        /*00c0*/                @P0 BRA `(.L_x_0) ;
        /*00d0*/                   EXIT ;
.L_x_2:
        /*00e0*/                   BRA `(.L_x_2);
        /*00f0*/                   NOP;
"""

# autoflash's backward, shaped: a masked loop, the steady-state loop (its prefetch skipped by the
# last step), a peeled step outside any loop, and a masked loop after (a window's last steps). The
# masked loops hold the same HMMAs plus the mask (FSEL).
OURS_SHAPED = """
	.section	.text.ours,"ax",@progbits
ours:
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   LDGSTS.E.BYPASS.128 [R3], [R6.64] ;
.L_x_0:
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0030*/                   HMMA.16816.F32.BF16 R16, R8, R14, R16 ;
        /*0040*/                   FSEL R4, R4, -INF , P2 ;
        /*0050*/                   FSEL R5, R5, -INF , P2 ;
        /*0060*/                   FSEL R6, R6, -INF , P2 ;
        /*0070*/                   FSEL R7, R7, -INF , P2 ;
        /*0080*/                @P0 BRA `(.L_x_0) ;
        /*0090*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*00a0*/                   FMUL R5, R5, 0.5 ;
.L_x_1:
        /*00b0*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*00c0*/                   HMMA.16816.F32.BF16 R16, R8, R14, R16 ;
        /*00d0*/                @P1 BRA `(.L_x_3) ;
        /*00e0*/                   LDGSTS.E.BYPASS.128 [R3], [R6.64] ;
.L_x_3:
        /*00f0*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0100*/                @P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0110*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0120*/                   HMMA.16816.F32.BF16 R16, R8, R14, R16 ;
        /*0130*/                   FSEL R4, R4, -INF , P2 ;
        /*0140*/                   FSEL R5, R5, -INF , P2 ;
        /*0150*/                   FSEL R6, R6, -INF , P2 ;
        /*0160*/                   FSEL R7, R7, -INF , P2 ;
        /*0170*/                @P3 BRA `(.L_x_2) ;
        /*0180*/                   STG.E [R6.64], R4 ;
        /*0190*/                   EXIT ;
"""


def test_the_step_loop_is_the_innermost_loop_holding_every_hmma():
    # FlashAttention-2's outer key-block loop is not the step: its prologue and epilogue are
    # per-block work. Before, the outermost HMMA loop was counted: 11 instructions per 2 HMMAs.
    (step,) = sass.hmma_loops(FA2_SHAPED)
    assert step.header_addr == 0x40 and step.addr_range == (0x40, 0x80)
    assert step.counts == {"LDSM": 1, "HMMA": 2, "int/addr": 1, "control": 1} and step.per_hmma() == 2.5
    assert step.outer == (0x20, 11) and not step.nested and step.conditional == {}
    assert sass.main_loop([step]) is step
    # Around the steps, once per block: entry (2), the outer body's prologue (2) and epilogue (4),
    # EXIT; not the unreachable padding loop, not the NOP.
    assert sass.path_instructions(FA2_SHAPED) == 9
    assert sass.path_instructions(FA2_SHAPED, contract=False) == 9 + 5  # the step loop once


def test_the_main_loop_is_the_cheapest_copy_of_the_step():
    masked, steady, tail = sass.hmma_loops(OURS_SHAPED)
    assert [lp.total for lp in (masked, steady, tail)] == [7, 6, 7]
    # Equal HMMAs: the steady state is the copy with the fewest instructions, wherever it sits (the
    # last loop is a masked one here); a loop with an inner loop never is.
    assert sass.main_loop([masked, steady, tail]) is steady
    assert sass.main_loop([masked, dataclasses.replace(steady, nested=True), tail]) is tail
    # The prefetch that the last step skips is conditional; everything else runs every iteration.
    assert steady.conditional == {"LDGSTS": 1} and masked.conditional == {} and steady.outer is None
    # The peeled step (a block with an HMMA outside every loop) is step work, not the block's:
    # entry (2) and the epilogue (2).
    assert sass.path_instructions(OURS_SHAPED) == 4


def test_steps_per_block_follow_the_tiles_and_the_causal_triangle():
    fwd = bench_sass.Kernel("FA2", "f", "fwd", 128, 128, 64, 4, 1, 1, 0, 0, "")
    bwd = bench_sass.Kernel("autoflash", "b", "bwd", 128, 64, 128, 8, 2, 1, 0, 0, "")
    assert bench_sass.steps_per_block(fwd, 1024, False) == [16] * 8
    assert bench_sass.steps_per_block(fwd, 1024, True) == [2, 4, 6, 8, 10, 12, 14, 16]
    assert bench_sass.steps_per_block(bwd, 1024, False) == [16] * 8
    # Key block j sees the query blocks from its first key on: 16 - 2 j of them.
    assert bench_sass.steps_per_block(bwd, 1024, True) == [16, 14, 12, 10, 8, 6, 4, 2]


@pytest.fixture(scope="module")
def backward_d128_a100():
    from autoflash.kernels.compiler import compile_config
    from autoflash.kernels.defaults import default_backward_config
    from autoflash.kernels.gpus import get_profile

    cfg = default_backward_config(128, "bf16", False, get_profile("a100"))
    return cfg, sass.disassemble(compile_config(cfg, "sm_80").cubin_path, cfg.name)


def test_default_backward_step_on_a100(backward_d128_a100):
    """The A100 d = 128 backward default: two stages, so the next step's Q, dO, LSE and delta are
    requested before this step's first MMA; the steady-state step holds the tile's MMAs at FA2's
    ldmatrix count (0.45 per MMA), spills nothing, and adds dQ with atomics no branch or predicate
    guards (unmasked steps hold whole query blocks)."""
    cfg, text = backward_d128_a100
    assert cfg.num_stages == 2 and (cfg.block_m, cfg.block_n, cfg.num_warps) == (64, 128, 8)
    loop = sass.main_loop(sass.hmma_loops(text))
    assert loop.counts["HMMA"] == 320 and loop.counts["LDSM"] == 144 and "LDL/STL" not in loop.counts
    assert loop.outer is None
    body = [i for i in sass.parse(text) if loop.addr_range[0] <= i.addr <= loop.addr_range[1]]
    first_hmma = min(i.addr for i in body if i.op.startswith("HMMA"))
    assert min(i.addr for i in body if i.op.startswith("LDGSTS")) < first_hmma
    atomics = [i for i in body if sass.classify(i.op, i.pred) == "ATOM/RED"]
    assert len(atomics) == loop.counts["ATOM/RED"] == 32 and all(i.pred is None for i in atomics)
    assert "ATOM/RED" not in loop.conditional


def test_a_loop_that_stores_nothing_around_its_inner_loop_stays_the_step():
    # autoflash's masked forward tiles: each trip loads a tile and walks its key slices in an inner
    # loop that holds every HMMA, but writes no output; the tile loop is the step, nested.
    tiles = FA2_SHAPED.replace("STG.E [R6.64], R4 ;", "FMUL R4, R4, 0.5 ;").replace(
        "STG.E [R6.64+0x10], R16 ;", "FMUL R16, R16, 0.5 ;")
    (step,) = sass.hmma_loops(tiles)
    assert step.header_addr == 0x20 and step.nested and step.outer is None and step.total == 11
