"""The reading of FlashAttention-3's compiled backward kernels (autoflash/bench/sass_fa3_bwd.py), offline:
the template arguments of real FlashAttnBwdSm90 symbols (from the dew-flash-attn-cu13==0.3.6 wheel's
sm_90a cubins), and the HGMMAs one warp issues per query tile worked out from them, against the counts
read off those kernels' SASS (../shared/docs/hopper.md 4.4: d128 80 x 128, 24 x 64x80x16 + 10 x
64x128x16); and which FA3 kernel and which of our configs each row of the side-by-side pairs (plain, causal,
and the variant rows: local against our window, varlen causal off and on)."""
import itertools
import shutil
import subprocess

import pytest

from autoflash.bench.sass_fa3_bwd import COMPARED_HEAD_DIMS, VARIANT_ROWS, Fa3BwdKernel, compared_pairs, \
    parse_bwd_name, pick_fa3_bwd, query_tile_hgmma

D64 = ("_ZN7cutlass13device_kernelIN5flash20enable_sm90_or_laterINS1_16FlashAttnBwdSm90INS1_25CollectiveMainloopBwdS"
       "m90ILi2ELi2ELi2EN4cute5tupleIJNS5_1CILi1EEES8_S8_EEENS6_IJNS7_ILi128EEESA_NS7_ILi64EEEEEENS_10bfloat16_tEfNS"
       "_4arch4Sm90ELb0ELb0ELb0ELb0ELb0ELb1ELb0ELb0ELi2ELi1ELi2ELi2ELb0EEENS1_21CollectiveEpilogueBwdISC_SD_SF_Li256"
       "ELb0ELb0ELi1EEENS1_19SingleTileSchedulerILb0ELb0ELb0ELi128EEEEEEEEEvNT_6ParamsE")
D128 = ("_ZN7cutlass13device_kernelIN5flash20enable_sm90_or_laterINS1_16FlashAttnBwdSm90INS1_25CollectiveMainloopBwdS"
        "m90ILi2ELi2ELi2EN4cute5tupleIJNS5_1CILi1EEES8_S8_EEENS6_IJNS7_ILi80EEENS7_ILi128EEESB_EEENS_10bfloat16_tEfNS"
        "_4arch4Sm90ELb0ELb0ELb0ELb0ELb0ELb1ELb0ELb1ELi2ELi1ELi2ELi1ELb0EEENS1_21CollectiveEpilogueBwdISC_SD_SF_Li256"
        "ELb0ELb0ELi1EEENS1_19SingleTileSchedulerILb0ELb0ELb0ELi128EEEEEEEEEvNT_6ParamsE")
# The variant rows' FA3 kernels at d128: local (64 x 128), and causal varlen (64 x 128, VarlenBlockScheduler).
D128_LOCAL = ("_ZN7cutlass13device_kernelIN5flash20enable_sm90_or_laterINS1_16FlashAttnBwdSm90INS1_25CollectiveMainloop"
              "BwdSm90ILi2ELi2ELi2EN4cute5tupleIJNS5_1CILi1EEES8_S8_EEENS6_IJNS7_ILi64EEENS7_ILi128EEESB_EEENS_10bfloat"
              "16_tEfNS_4arch4Sm90ELb0ELb1ELb0ELb0ELb0ELb1ELb0ELb0ELi2ELi1ELi2ELi1ELb0EEENS1_21CollectiveEpilogueBwdISC"
              "_SD_SF_Li256ELb0ELb0ELi1EEENS1_19SingleTileSchedulerILb0ELb0ELb0ELi128EEEEEEEEEvNT_6ParamsE")
D128_VARLEN_CAUSAL = ("_ZN7cutlass13device_kernelIN5flash20enable_sm90_or_laterINS1_16FlashAttnBwdSm90INS1_25Collective"
                      "MainloopBwdSm90ILi2ELi2ELi2EN4cute5tupleIJNS5_1CILi1EEES8_S8_EEENS6_IJNS7_ILi64EEENS7_ILi128EEES"
                      "B_EEENS_10bfloat16_tEfNS_4arch4Sm90ELb1ELb0ELb0ELb1ELb0ELb1ELb0ELb0ELi2ELi1ELi2ELi1ELb0EEENS1_21"
                      "CollectiveEpilogueBwdISC_SD_SF_Li256ELb1ELb0ELi1EEENS1_20VarlenBlockSchedulerILi128ELb1EEEEEEEEE"
                      "vNT_6ParamsE")
_VARIANT_FLAGS = ("causal", "local", "softcap", "varlen", "deterministic", "gqa")


def _demangle(symbol: str) -> str:
    if shutil.which("c++filt") is None:
        pytest.skip("needs c++filt (binutils)")
    return subprocess.run(["c++filt", symbol], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("symbol, tile, on, swaps, shapes", [
    (D64, (64, 128, 128), (), ("sdp_swapab",), {"64x64x16": 24, "64x128x16": 8}),
    (D128, (128, 80, 128), (), ("sdp_swapab", "dq_swapab"), {"64x80x16": 24, "64x128x16": 10}),
    (D128_LOCAL, (128, 64, 128), ("local",), ("sdp_swapab",), {"64x64x16": 24, "64x128x16": 8}),
    (D128_VARLEN_CAUSAL, (128, 64, 128), ("causal", "varlen"), ("sdp_swapab",), {"64x64x16": 24, "64x128x16": 8}),
], ids=["d64", "d128", "d128-local", "d128-varlen-causal"])
def test_real_symbols_give_their_tiles_and_hgmmas(symbol, tile, on, swaps, shapes):
    args = parse_bwd_name(_demangle(symbol))
    assert (args["head_dim"], args["block_m"], args["block_n"]) == tile
    assert args["dtype"] == "bf16" and args["warpgroups"] == 2
    assert {f for f in _VARIANT_FLAGS if args["flags"][f]} == set(on)
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


def _decoy_index() -> list[Fa3BwdKernel]:
    """An index as the library's, for the pick alone: at each compared head dim a kernel for every combination
    of causal, local, softcap, varlen, deterministic and GQA (softcap and causal with local among them, which
    the wheel lacks), each tiled alike, so only the flags tell them apart."""
    index = []
    for d in COMPARED_HEAD_DIMS:
        for bits in itertools.product((False, True), repeat=len(_VARIANT_FLAGS)):
            flags = dict(zip(_VARIANT_FLAGS, bits))
            name = "_".join(f for f in _VARIANT_FLAGS if flags[f]) or "plain"
            index.append(Fa3BwdKernel(f"d{d}.cubin", f"d{d}_{name}", d, 64, 128, "bf16", (2, 2, 2), 2, (2, 1, 2),
                                      {**flags, "sdp_swapab": True, "dkv_swapab": False, "dq_swapab": False}))
    return index


def test_each_row_pairs_the_flagged_fa3_kernel_with_our_matching_switch():
    """The side-by-side's rows (compared_pairs), at every compared head dim: plain and causal, then FA3's local
    kernel against our window kernel and its varlen kernels, causal off and on, against our varlen ones. FA3's
    pick carries that row's flag and no other (never deterministic, never GQA), and our config, the built-in
    kernel such a call launches on the H100, the matching switch and no other."""
    from autoflash.kernels.gpus import get_profile

    pairs = compared_pairs(_decoy_index(), get_profile("h100"))
    expected = [(d, on) for d in COMPARED_HEAD_DIMS
                for on in [(), ("causal",), ("local",), ("varlen",), ("causal", "varlen")]]
    assert [(k.head_dim, k.symbol) for k, _ in pairs] == [(d, f"d{d}_{'_'.join(on) or 'plain'}") for d, on in expected]
    assert len(VARIANT_ROWS) == 3
    for (k, cfg), (d, on) in zip(pairs, expected):
        assert {f for f in _VARIANT_FLAGS if k.flags[f]} == set(on), k.symbol
        assert cfg.direction == "bwd" and cfg.head_dim == d and cfg.dtype == "bf16" and cfg.family == "sm90"
        assert cfg.causal == ("causal" in on), cfg.name
        assert cfg.window == ("local" in on) and cfg.varlen == ("varlen" in on), cfg.name
        assert not (cfg.softcap or cfg.alibi or cfg.key_bias or cfg.chunk), cfg.name
        # FA3's window and a varlen causal mask sit at the bottom right; the plain rows keep the default's top left
        assert cfg.align == ("bottom_right" if on in (("local",), ("causal", "varlen")) else "top_left"), cfg.name


def test_a_pick_refuses_a_switch_it_does_not_know_and_a_missing_kernel():
    index = [k for k in _decoy_index() if not (k.flags["local"] and not k.flags["deterministic"])]
    with pytest.raises(ValueError):
        pick_fa3_bwd(index, 128, False, on=("window",))
    with pytest.raises(RuntimeError):  # only deterministic local kernels left: none FA3 would run by default
        pick_fa3_bwd(index, 128, False, on=("local",))
