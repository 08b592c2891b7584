"""Decode (KV-cache) tuning on the CPU: keys and buckets, the space (paged tiles divide the page),
num_splits in the tuned table, select_decode, the simulated cost model, the CUDA backend's check on
the emulator, and `python -m autoflash.tune --decode` dry-run and simulated end to end."""
import dataclasses
import json

import pytest
import torch

from autoflash.dispatch import selection
from autoflash.dispatch.selection import select_decode
from autoflash.kernels import resources
from autoflash.kernels.codegen import template_hash
from autoflash.kernels.config import KernelConfig
from autoflash.kernels.decode import CacheShape
from autoflash.kernels.gpus import get_profile
from autoflash.tune import main
from autoflash.tuning import decode as dk
from autoflash.tuning.problem import ProblemKey
from autoflash.tuning.report import key_bandwidth, key_kv_bytes
from autoflash.tuning.space import DecodePoint, constrain, default_for, enumerate_space, point_from_name
from autoflash.tuning.table import Entry, Result, Table, TableError, load_table, merge_into, table_path

H100 = get_profile("h100")
KEY = ProblemKey.decode("h100", "bf16", 128, "q1", "le32k", "b1-4", False)
PAGED = ProblemKey.decode("h100", "bf16", 128, "q2-16", "le32k", "b1-4", True)
# One small space: d64 fp16, 64 x n tiles, 4 warps, 2 stages, three split counts (compiled once, cached on disk).
SMALL = ["--gpu", "h100", "--decode", "--head-dims", "64", "--dtypes", "fp16", "--q-buckets", "q1", "--cache-buckets",
         "le4k", "--batch-buckets", "b1-4", "--space", "block_m=64", "--space", "num_warps=4", "--space",
         "num_stages=2", "--space", "num_splits=0,1,4", "--no-progress", "--jobs", "1"]


# ------------------------------------------------------------------ keys and buckets
# value -> (query bucket, cache bucket, batch bucket) of that value
@pytest.mark.parametrize("value, q, cache, batch", [(1, "q1", "le4k", "b1-4"), (4, "q2-16", "le4k", "b1-4"),
                                                    (5, "q2-16", "le4k", "b5-32"), (16, "q2-16", "le4k", "b5-32"),
                                                    (17, None, "le4k", "b5-32"), (32, None, "le4k", "b5-32"),
                                                    (33, None, "le4k", "gt32"), (4097, None, "le32k", "gt32"),
                                                    (32768, None, "le32k", "gt32"), (131073, None, "gt32k", "gt32")])
def test_buckets(value, q, cache, batch):
    assert dk.q_bucket(value) == q and dk.cache_bucket(value) == cache and dk.batch_bucket(value) == batch
    with pytest.raises(ValueError, match="got 0, expected a positive int"):
        dk.cache_bucket(0)


@pytest.mark.parametrize("key", [KEY, PAGED], ids=str)
def test_decode_slug_round_trips(key):
    assert ProblemKey.from_slug("h100", key.slug) == key and ProblemKey(**key.to_dict()) == key
    assert key.is_decode and key.direction == "fwd" and key.causal == (key.q_bucket != "q1")


def test_decode_slugs_and_plain_slugs():
    assert KEY.slug == "decode/bf16/d128/q1/le32k/b1-4/dense"
    assert PAGED.slug == "decode/bf16/d128/q2-16/le32k/b1-4/paged"
    plain = ProblemKey("h100", "fwd", "bf16", 128, True, "le4k")
    assert plain.slug == "fwd/bf16/d128/causal/le4k" and set(plain.to_dict()) == {
        "gpu", "direction", "dtype", "head_dim", "causal", "seqlen_bucket"}  # as written before decode keys


def test_bad_decode_keys_say_what_was_expected():
    with pytest.raises(ValueError, match="fp32"):
        ProblemKey.decode("h100", "fp32", 128, "q1", "le4k", "b1-4", False)
    with pytest.raises(ValueError, match="q_bucket: got 'q3'"):
        ProblemKey.decode("h100", "bf16", 128, "q3", "le4k", "b1-4", False)
    with pytest.raises(ValueError, match="seqlen_bucket: got 'le1k' on a decode key"):
        ProblemKey.decode("h100", "bf16", 128, "q1", "le1k", "b1-4", False)
    with pytest.raises(ValueError, match="causal: got True for query bucket 'q1'"):
        ProblemKey("h100", "fwd", "bf16", 128, True, "le4k", "decode", "q1", "b1-4", False)
    with pytest.raises(ValueError, match="on decode keys only"):
        ProblemKey("h100", "fwd", "bf16", 128, True, "le4k", "plain", "q1")


def test_decode_shapes_and_figure_of_merit():
    heads, heads_kv = dk.heads_for(128)
    assert (heads, heads_kv) == (32, 8)  # Llama 3 8B
    assert [dataclasses.astuple(s) for s in KEY.shapes()] == [(1, 32, 8192, 128), (4, 32, 8192, 128), (1, 32, 32768, 128),
                                                (4, 32, 32768, 128)]
    big = ProblemKey.decode("h100", "bf16", 128, "q1", "gt32k", "gt32", False)
    assert [dataclasses.astuple(s) for s in big.shapes()] == [(64, 32, 65536, 128)]  # 64 x 128k (32 GiB) left out
    w = PAGED.decode_workload(PAGED.shapes()[0])
    assert (w.seqlen_q, w.page_size, w.causal, w.pages_per_seq) == (8, 256, True, 32)
    expected = sum(2 * s.batch * s.seqlen * 8 * 128 * 2 for s in KEY.shapes())
    assert key_kv_bytes(KEY) == expected
    fom = key_bandwidth(KEY, 1.0, H100)
    assert fom["gb_per_s"] == pytest.approx(expected / 1e-3 / 1e9)
    assert fom["hbm_share"] == pytest.approx(fom["gb_per_s"] / 3350.0)


# ------------------------------------------------------------------ the space
def test_paged_space_keeps_tiles_dividing_the_page():
    dense, paged = (enumerate_space(k, default_for(k, H100)) for k in (KEY, PAGED))
    assert {p.block_n for p in dense} >= {96, 192}
    assert {p.block_n for p in paged} == {32, 64, 128, 256}  # 96 and 192 do not divide 256
    assert all(isinstance(p, DecodePoint) and p.config.kvcache and p.config.paged and not p.config.split
               and p.config.causal and p.config.align == "bottom_right" for p in paged)
    assert {p.num_splits for p in paged} == {0, 1, 2, 4, 8, 16, 32}
    default = default_for(PAGED, H100)
    assert default.num_splits == 0 and paged[0] == default and all(PAGED.matches(p.config) for p in paged)


def test_a_point_is_constrained_through_the_kernels_it_may_launch():
    base = KernelConfig(head_dim=64, dtype="fp16", block_m=64, block_n=128, num_warps=4, num_stages=2, kvcache=True)
    points = [DecodePoint(base, n) for n in (0, 1, 4)]
    assert [len(p.kernels) for p in points] == [2, 1, 1] and points[2].kernels[0].split
    assert point_from_name(points[2].name) == points[2] and points[2].name.endswith(":splits4")
    huge = DecodePoint(base.replace(block_n=256, num_stages=4), 1)  # (64 + 2 * 4 * 256) * 128 B > 227 KiB
    cands = constrain(points + [huge], H100, jobs=1)
    assert [c.status for c in cands] == ["ok", "ok", "ok", "smem"]
    assert cands[0].registers == max(cands[1].registers, cands[2].registers)  # both kernels of the heuristic


# ------------------------------------------------------------------ the table
def _entry(key, config, splits, runner_splits=None):
    runner = () if runner_splits is None else (Result.of(config, 1.5, 1.0, num_splits=runner_splits),)
    return Entry(key=key, winner=Result.of(config, 1.0, 1.0, 100, num_splits=splits),
                 default=Result.of(config, 1.2, 1.0, num_splits=0), sdpa_flash_ms=2.0, runner_ups=runner,
                 shapes=tuple(dataclasses.astuple(s) for s in key.shapes()), evaluated=3, failed=0, trials=3,
                 date="2026-11-22T00:00:00+00:00")


def _decode_config(key, m=64, n=128):
    return KernelConfig(block_m=m, block_n=n, num_warps=4, num_stages=2, **key.config_fields())


def test_table_round_trips_num_splits(tmp_path):
    entry = _entry(KEY, _decode_config(KEY), 4, runner_splits=8)  # same kernel, other splits: a runner-up
    plain = ProblemKey("h100", "fwd", "bf16", 128, True, "le4k")
    cfg = KernelConfig(head_dim=128, dtype="bf16", block_m=128, block_n=64, num_warps=8, causal=True)
    old = Entry(key=plain, winner=Result.of(cfg, 1.0, 1.0), default=None, sdpa_flash_ms=None, runner_ups=(),
                shapes=((4, 16, 4096, 128),), evaluated=1, failed=0, trials=1, date="2026-11-22T00:00:00+00:00")
    table = Table("h100", "abc", {"backend": "simulated"}, {}).with_entries(entry, old)
    merge_into(table_path(tmp_path, "h100"), table)
    loaded = load_table(table_path(tmp_path, "h100"))
    assert loaded.get(KEY) == entry and loaded.get(KEY).winner.num_splits == 4
    assert loaded.get(plain).winner.num_splits is None
    data = json.loads(table_path(tmp_path, "h100").read_text())
    assert "num_splits" not in data["entries"][plain.slug]["winner"]  # plain entries are written as before
    assert data["entries"][KEY.slug]["key"]["q_bucket"] == "q1"


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["entries"]["decode/bf16/d128/q1/le32k/b1-4/dense"]["winner"].pop("num_splits"), "num_splits"),
    (lambda d: d["entries"]["fwd/bf16/d128/causal/le4k"]["winner"].__setitem__("num_splits", 2), "not a decode key"),
    (lambda d: d["entries"]["decode/bf16/d128/q1/le32k/b1-4/dense"]["winner"].__setitem__("num_splits", -1),
     "an int >= 0"),
])
def test_bad_num_splits_are_refused(tmp_path, edit, message):
    plain = ProblemKey("h100", "fwd", "bf16", 128, True, "le4k")
    cfg = KernelConfig(head_dim=128, dtype="bf16", block_m=128, block_n=64, num_warps=8, causal=True)
    old = Entry(key=plain, winner=Result.of(cfg, 1.0, 1.0), default=None, sdpa_flash_ms=None, runner_ups=(),
                shapes=((4, 16, 4096, 128),), evaluated=1, failed=0, trials=1, date="2026-11-22T00:00:00+00:00")
    data = Table("h100", "abc", {"backend": "simulated"}, {}).with_entries(
        _entry(KEY, _decode_config(KEY), 4), old).to_dict()
    edit(data)
    with pytest.raises(TableError, match=message):
        Table.from_dict(data, "t.json")


# ------------------------------------------------------------------ select_decode
@pytest.fixture
def folders(tmp_path, monkeypatch):
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    user.mkdir()
    shipped.mkdir()
    monkeypatch.setenv("AUTOFLASH_TUNED_DIR", str(user))
    monkeypatch.setattr(resources, "tuned_dir", lambda: shipped)
    selection.clear_cache()
    yield user, shipped
    selection.clear_cache()


def _shape(batch=2, seqlen_q=1, capacity=16384, page_size=None):
    return CacheShape(batch, seqlen_q, 32, 8, 128, capacity, page_size, 0)


def test_select_decode_hits_the_tuned_key_and_misses_others(folders):
    user, _ = folders
    q = torch.empty(2, 1, 32, 128, dtype=torch.bfloat16)  # never read: only its dtype
    assert select_decode(H100, q, _shape()) == (None, 0)  # no table
    cfg, paged_cfg = _decode_config(KEY), _decode_config(PAGED, n=128)
    table = Table("h100", template_hash(), {"backend": "cuda"}, {}).with_entries(
        _entry(KEY, cfg, 8), _entry(PAGED, paged_cfg, 2))
    merge_into(table_path(user, "h100"), table)
    selection.clear_cache()
    assert select_decode(H100, q, _shape()) == (cfg, 8)
    assert select_decode(H100, q, _shape(batch=4, capacity=32768)) == (cfg, 8)  # same buckets
    assert select_decode(H100, q, _shape(batch=5)) == (None, 0)  # b5-32: not tuned
    assert select_decode(H100, q, _shape(capacity=4096)) == (None, 0)  # le4k: not tuned
    assert select_decode(H100, q.half(), _shape()) == (None, 0)  # fp16: not tuned
    assert select_decode(H100, q, _shape(seqlen_q=17)) == (None, 0)  # prefill, no decode key
    q8 = torch.empty(2, 8, 32, 128, dtype=torch.bfloat16)
    assert select_decode(H100, q8, _shape(seqlen_q=8, page_size=256)) == (paged_cfg, 2)
    assert select_decode(H100, q8, _shape(seqlen_q=8, page_size=64)) == (None, 0)  # 128-key tiles do not divide 64
    assert select_decode(H100, q8, _shape(seqlen_q=8, page_size=512)) == (paged_cfg, 2)


# ------------------------------------------------------------------ the simulated model
def test_the_model_splits_a_lone_long_sequence_and_not_a_full_batch():
    from autoflash.tuning.simulated_decode import decode_model_ms

    cfg = _decode_config(KEY)
    lone = dk.decode_workload("q1", False, 1, 131072, 128)
    full = dk.decode_workload("q1", False, 64, 8192, 128)
    assert decode_model_ms(cfg, 16, lone, H100) < 0.5 * decode_model_ms(cfg, 1, lone, H100)
    assert decode_model_ms(cfg, 1, full, H100) < decode_model_ms(cfg, 16, full, H100)
    seconds = decode_model_ms(cfg, 0, full, H100) * 1e-3
    assert full.kv_bytes / seconds < H100.mem_bandwidth_gbs * 1e9  # never above the datasheet's bandwidth


# ------------------------------------------------------------------ the CUDA backend's check (emulator or GPU)
def test_cuda_backend_checks_decode_points(target):
    from autoflash.tuning.cuda_backend import CudaBackend
    from autoflash.tuning.cuda_decode import check_decode

    if target == "gpu":
        from autoflash.kernels.gpus import detect

        backend, profile = CudaBackend(detect().name), detect()
    else:
        from autoflash.emulation import active

        backend, profile = object.__new__(CudaBackend), active().profile
        backend.torch, backend._decode, backend._flush, backend.device = torch, {}, None, "cpu"
    key = ProblemKey.decode(profile.name, "fp16", 64, "q2-16", "le4k", "b1-4", True)
    point = default_for(key, profile)
    assert check_decode(backend, key, DecodePoint(point.config, 3)) is None


# ------------------------------------------------------------------ the CLI
def test_dry_run_lists_decode_spaces(capsys):
    assert main([*SMALL, "--dry-run"]) == 0
    out = capsys.readouterr().out
    dense = default_for(ProblemKey.decode("h100", "fp16", 64, "q1", "le4k", "b1-4", False), H100)
    assert f"h100 decode fp16 d64 q1 dense (default {dense.name})" in out
    assert "h100 decode fp16 d64 q1 paged 256 (default" in out
    paged_part = out.split("paged 256")[1]
    assert "_kvc_m64n96w4s2:splits1" in out and "n96" not in paged_part and "n192" not in paged_part
    assert "_kvc_paged_m64n128w4s2:splits4" in paged_part


def test_help_explains_decode(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for phrase in ("--decode", "--q-buckets", "--cache-buckets", "--batch-buckets", "--paged", "num_splits", "HBM"):
        assert phrase in text, phrase


def test_a_simulated_decode_tune_writes_num_splits(tmp_path, capsys):
    assert main([*SMALL, "--paged", "off", "--backend", "simulated", "--out", str(tmp_path), "--budget", "4"]) == 0
    out = capsys.readouterr().out
    key = ProblemKey.decode("h100", "fp16", 64, "q1", "le4k", "b1-4", False)
    entry = load_table(tmp_path / "h100.json").get(key)
    assert entry.evaluated == 4 and entry.winner.num_splits in (0, 1, 4) and key.matches(entry.winner.config)
    assert entry.default.num_splits == 0 and entry.default.name == default_for(key, H100).config.name
    assert entry.sdpa_flash_ms is not None
    line = next(line for line in out.splitlines() if line.startswith(key.label))
    assert "GB/s" in line and "% of HBM" in line and "SDPA" in line
