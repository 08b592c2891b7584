"""The decode kernels' memory traffic, statically (a proxy from SASS, not a measurement): the main
loop of the KV-cache kernel loads, per block and iteration, exactly one K and one V tile (nothing
read twice; a paged kernel adds its two block-table entries), and the launcher's grid has one block
per (batch, kv-head, split) when a K/V head's query heads fold into the rows, so with GQA one K/V
read serves every query head of its group. Together: each K/V byte is loaded once per (batch,
kv-head) (and split: the splits' key ranges are disjoint). These are the mma.sync family's KV-cache
kernel (cp.async copies, on an H100 the one that gathers pages), A100 tiles compiled for sm_80 and
sm_90; the sm90 family's (TMA, tests/test_sm90_kvcache.py) loads a K and a V tile an iteration by
construction: the emulator refuses an mbarrier phase whose expected bytes and TMA's deliveries differ."""
import pytest
import torch

import autoflash
from autoflash.kernels import launch, sass
from autoflash.kernels.compiler import compile_config
from autoflash.kernels.decode import flash_decode
from autoflash.kernels.defaults import default_decode_config
from autoflash.kernels.gpus import get_profile
from autoflash.render import kv_traffic

SWITCHES = {"dense": {}, "paged": dict(paged=True, causal=True, align="bottom_right"), "split": dict(split=True)}


@pytest.mark.parametrize("kind", sorted(SWITCHES))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("arch, gpu", [("sm_80", "a100"), ("sm_90", "a100")])
def test_the_main_loop_reads_one_k_and_one_v_tile(arch, gpu, d, kind):
    config = default_decode_config(d, "bf16", get_profile(gpu), 256 if kind == "paged" else None)
    config = config.replace(**SWITCHES[kind])
    loop = sass.main_loop(sass.hmma_loops(sass.disassemble(compile_config(config, arch).cubin_path, config.name)))
    n, per_thread = loop.global_loads["LDGSTS"]
    assert per_thread * config.threads == 2 * config.block_n * d * 2, (config.name, loop.global_loads)
    assert per_thread == 16 * n  # 16-byte cp.async chunks, none narrower
    assert loop.global_loads.get("LDG", (0, 0)) == ((2, 8) if kind == "paged" else (0, 0))  # block-table entries
    assert "each K/V byte of the block's key range read once" in kv_traffic(config, loop)


def test_load_widths_come_from_the_opcode():
    assert sass.load_bytes("LDGSTS.E.BYPASS.LTC128B.128") == 16
    assert sass.load_bytes("LDG.E.64.CONSTANT") == 8 and sass.load_bytes("LDG.E") == 4
    assert sass.load_bytes("LDG.E.U8") == 1


@pytest.mark.parametrize("heads, alibi, grid_heads", [((8, 2), False, 2), ((8, 8), False, 8), ((8, 2), True, 8)])
def test_one_block_per_batch_kv_head_and_split(monkeypatch, heads, alibi, grid_heads):
    """The launches of a decode step: grid y is the K/V heads when the query heads fold (no ALiBi,
    whose slopes are per query head), and one query block covers seqlen_q x group rows."""
    grids = []
    real = launch._call

    def spy(fn, grid, *args, **kw):
        grids.append(grid)
        return real(fn, grid, *args, **kw)

    monkeypatch.setattr(launch, "_call", spy)
    (hq, hkv), b, lq = heads, 3, 2
    q = torch.randn(b, lq, hq, 64).to(torch.bfloat16)
    k_cache = torch.randn(b, 600, hkv, 64).to(torch.bfloat16)  # 3 key tiles at most
    slopes = torch.rand(hq) * 0.3 if alibi else None
    with autoflash.emulate("h100"):
        flash_decode(q, k_cache, k_cache.clone(), 600, num_splits=3, causal=True, alibi_slopes=slopes)
    main, combine = grids
    assert main == (3, grid_heads, b)  # x: 1 query block x 3 splits
    assert combine[1:] == (1, 1)


@pytest.mark.parametrize("kind", sorted(SWITCHES))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("arch, gpu", [("sm_80", "a100"), ("sm_90", "a100")])
def test_every_loop_and_the_prologue_load_each_tile_once(arch, gpu, d, kind):
    """Outside the main loop too: the masked-tile loop loads one K and one V tile per iteration, and
    the code before the loops (its heaviest path) the Q tile and the first `stages` K/V tiles."""
    config = default_decode_config(d, "bf16", get_profile(gpu), 256 if kind == "paged" else None)
    config = config.replace(**SWITCHES[kind])
    text = sass.disassemble(compile_config(config, arch).cubin_path, config.name)
    tiles = 2 * config.block_n * d * 2
    for loop in sass.hmma_loops(text):
        assert loop.global_loads["LDGSTS"][1] * config.threads == tiles, (config.name, hex(loop.header_addr))
    prologue = sass.straight_line_loads(text)
    assert prologue["LDGSTS"][1] * config.threads == config.block_m * d * 2 + config.num_stages * tiles
    # cache_seqlens, cache_leftpad, cache_batch_idx (a cache row, or paged a block-table row), and paged
    # the first K and V tiles' page
    assert prologue["LDG"] == ((5, 20) if kind == "paged" else (3, 12))
    assert "<-" not in kv_traffic(config, sass.main_loop(sass.hmma_loops(text)), prologue)


LISTING = """
        /*0000*/  @P0 BRA `(.L_x_1) ;
        /*0010*/  LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64] ;
        /*0020*/  LDGSTS.E.BYPASS.128 [R1+0x10], desc[UR4][R2.64+0x10] ;
        /*0030*/  BRA `(.L_x_2) ;
.L_x_1:
        /*0040*/  LDGSTS.E.BYPASS.LTC128B.128.ZFILL [R1], desc[UR4][R2.64] ;
        /*0050*/  LDG.E R3, desc[UR4][R4.64] ;
.L_x_2:
        /*0060*/  LDG.E.64 R6, desc[UR4][R8.64] ;
.L_x_3:
        /*0070*/  LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64] ;
        /*0080*/  @!PT LDG.E R3, desc[UR4][R4.64] ;
        /*0090*/  @P1 BRA `(.L_x_3) ;
        /*00a0*/  EXIT ;
"""


def test_straight_line_loads_take_one_branch_and_skip_loops():
    """Of a whole-tile / ragged-tile pair only one branch runs: the heavier path counts, not the sum;
    loads in loops and never-executed @!PT placeholders do not count."""
    assert sass.straight_line_loads(LISTING) == {"LDGSTS": (2, 32), "LDG": (1, 8)}


def test_a_loop_that_loads_more_than_its_tiles_is_flagged():
    config = default_decode_config(128, "bf16", get_profile("a100"))
    twice = sass.Loop(0, {"HMMA": 1}, None, False, {"LDGSTS": (48, 768)})  # K read twice: 3 tiles' worth
    text = kv_traffic(config, twice, {"LDGSTS": (40, 640)})
    assert "NOT one K + V tile" in text and "read once" not in text.splitlines()[0]
    assert "MISMATCH" not in text
