"""The reading of FlashAttention-3's compiled backward kernels (autoflash/bench/sass_fa3_bwd.py), offline:
the template arguments of real FlashAttnBwdSm90 symbols (from the dew-flash-attn-cu13==0.3.6 wheel's
sm_90a cubins), and the HGMMAs one warp issues per query tile worked out from them, against the counts
read off those kernels' SASS (../shared/docs/hopper.md 4.4: d128 80 x 128, 24 x 64x80x16 + 10 x
64x128x16)."""
import shutil
import subprocess

import pytest

from autoflash.bench.sass_fa3_bwd import Fa3BwdKernel, parse_bwd_name, query_tile_hgmma

D64 = ("_ZN7cutlass13device_kernelIN5flash20enable_sm90_or_laterINS1_16FlashAttnBwdSm90INS1_25CollectiveMainloopBwdSm90"
       "ILi2ELi2ELi2EN4cute5tupleIJNS5_1CILi1EEES8_S8_EEENS6_IJNS7_ILi128EEESA_NS7_ILi64EEEEEENS_10bfloat16_tEfNS_4arch4"
       "Sm90ELb0ELb0ELb0ELb0ELb0ELb1ELb0ELb0ELi2ELi1ELi2ELi2ELb0EEENS1_21CollectiveEpilogueBwdISC_SD_SF_Li256ELb0ELb0ELi1E"
       "EENS1_19SingleTileSchedulerILb0ELb0ELb0ELi128EEEEEEEEEvNT_6ParamsE")
D128 = ("_ZN7cutlass13device_kernelIN5flash20enable_sm90_or_laterINS1_16FlashAttnBwdSm90INS1_25CollectiveMainloopBwdSm90"
        "ILi2ELi2ELi2EN4cute5tupleIJNS5_1CILi1EEES8_S8_EEENS6_IJNS7_ILi80EEENS7_ILi128EEESB_EEENS_10bfloat16_tEfNS_4arch4"
        "Sm90ELb0ELb0ELb0ELb0ELb0ELb1ELb0ELb1ELi2ELi1ELi2ELi1ELb0EEENS1_21CollectiveEpilogueBwdISC_SD_SF_Li256ELb0ELb0ELi1E"
        "EENS1_19SingleTileSchedulerILb0ELb0ELb0ELi128EEEEEEEEEvNT_6ParamsE")


def _demangle(symbol: str) -> str:
    if shutil.which("c++filt") is None:
        pytest.skip("needs c++filt (binutils)")
    return subprocess.run(["c++filt", symbol], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("symbol, tile, swaps, shapes", [
    (D64, (64, 128, 128), ("sdp_swapab",), {"64x64x16": 24, "64x128x16": 8}),
    (D128, (128, 80, 128), ("sdp_swapab", "dq_swapab"), {"64x80x16": 24, "64x128x16": 10}),
], ids=["d64", "d128"])
def test_real_symbols_give_their_tiles_and_hgmmas(symbol, tile, swaps, shapes):
    args = parse_bwd_name(_demangle(symbol))
    assert (args["head_dim"], args["block_m"], args["block_n"]) == tile
    assert args["dtype"] == "bf16" and args["warpgroups"] == 2 and not args["flags"]["causal"]
    assert not any(args["flags"][f] for f in ("local", "softcap", "varlen", "deterministic", "gqa"))
    assert {f for f in ("sdp_swapab", "dkv_swapab", "dq_swapab") if args["flags"][f]} == set(swaps)
    assert query_tile_hgmma(Fa3BwdKernel("x.cubin", symbol, **args)) == shapes


def test_a_forward_symbol_is_not_a_backward_one():
    assert parse_bwd_name("flash::CollectiveMainloopFwdSm90<2, cute::tuple<...>>") is None


def test_a_tiling_that_does_not_fit_hgmma_is_refused():
    args = parse_bwd_name(_demangle(D128))
    wrong = Fa3BwdKernel("x.cubin", D128, **{**args, "warpgroups": 3})  # 128 keys over 3 warpgroups
    with pytest.raises((ValueError, RuntimeError)):
        query_tile_hgmma(wrong)


def test_our_rows_count_the_loop_in_line_too():
    """Our side of the side-by-side is counted both ways, as FA3's is: with the out-of-line mbarrier
    retry paths (hgmma_loops) and without them (the listing from the loop's head to its back branch),
    so a row cannot meet the target on the first count alone."""
    from autoflash.bench.sass_fa3_bwd import ours_row
    from autoflash.kernels import sass
    from autoflash.kernels.compiler import compile_config
    from autoflash.kernels.config import KernelConfig

    cfg = KernelConfig(head_dim=64, dtype="bf16", block_m=64, block_n=64, num_warps=8, causal=True, direction="bwd",
                       family="sm90")
    compiled = compile_config(cfg, "sm_90a")
    row = ours_row(cfg, sass.disassemble(compiled.cubin_path, cfg.name), compiled.resources.registers, 0)
    assert 0 < row["in-line insns/tile"] < row["insns/tile"]
    assert row["in-line insns/eq"] == round(row["in-line insns/tile"] / row["m16n8k16-eq/warp"], 3)
    assert row["tile"] == "64x64 2WG dKV split"
