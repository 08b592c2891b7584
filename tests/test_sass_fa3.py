"""The reading of FlashAttention-3's compiled forward kernels (autoflash/bench/sass_fa3.py), offline: which
of the wheel's kernels a row compares against, V's head dim among its template arguments."""
import pytest

from autoflash.bench.sass_fa3 import _SWITCHES, WIDE_V_ROWS, Fa3Kernel, fa3_index, pick_fa3


def _kernel(d, dv, causal=False, **on):
    flags = {f: bool(on.get(f)) for f in ("causal", "pv_rs", "overlap", *_SWITCHES)} | {"causal": causal}
    return Fa3Kernel("c.cubin", f"k{d}_{dv}_{causal}_{sorted(on)}", d, 128, 96, "bf16", flags, dv)


def test_pick_fa3_reads_vs_head_dim():
    index = [_kernel(64, 64), _kernel(64, 256), _kernel(64, 256, True), _kernel(64, 256, qv=True),
             _kernel(64, 512), _kernel(192, 128)]
    assert pick_fa3(index, 64, False).head_dim_v == 64  # the plain row: V as wide as Q
    assert pick_fa3(index, 64, False, dv=256).symbol == index[1].symbol  # not the causal or the qv kernel
    assert pick_fa3(index, 64, True, dv=256).symbol == index[2].symbol
    assert pick_fa3(index, 64, False, ("qv",), dv=256).symbol == index[3].symbol
    with pytest.raises(RuntimeError, match="0 bf16 kernels for d=192 dv=256"):
        pick_fa3(index, 192, False, dv=256)
    assert all(d != dv for d, dv in WIDE_V_ROWS)


def test_an_index_cached_without_vs_head_dim_is_read_again(tmp_path):
    """An index.json written before V's head dim was read (no head_dim_v) is not trusted: fa3_index reads
    the cubins again (none here: an empty index, rewritten with the field)."""
    (tmp_path / "index.json").write_text('[{"cubin": "c", "symbol": "s", "head_dim": 64, "block_m": 128, '
                                         '"block_n": 96, "dtype": "bf16", "flags": {}}]')
    assert fa3_index(tmp_path) == []
    assert (tmp_path / "index.json").read_text() == "[]"
