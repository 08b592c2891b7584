"""Tuned tables (CPU): round trip, every kind of corruption rejected with file + field in the message,
GPU / template-hash filters, merges (keep, overwrite, add, stale backup, refusals that leave the file
byte-identical), atomic writes, and two processes merging into one table losing nothing."""
import json
import multiprocessing
import os

import filelock
import pytest

from autoflash.kernels.config import KernelConfig
from autoflash.tuning.problem import ProblemKey
from autoflash.tuning import table as tt
from autoflash.tuning.table import (
    Entry, MergeReport, Result, Table, TableError, load_table, merge_into, table_path,
)

HASH, OTHER_HASH = "0123456789abcdef", "fedcba9876543210"
KEY = ProblemKey("h100", "fwd", "bf16", 128, True, "le4k")
SLUG = KEY.slug
AT = f"entries[{SLUG!r}]"
WINNER = KernelConfig(head_dim=128, dtype="bf16", block_m=128, block_n=64, num_warps=8, num_stages=2, causal=True)
PROV = {"device_name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "driver": "550.54", "cuda": "12.4",
        "nvrtc": "12.4", "torch": "2.4.0", "cupy": None, "autoflash": "0.1.0", "date": "2025-01-31T12:00:00+00:00",
        "backend": "simulated", "command": "autoflash-tune --gpu h100"}


def make_entry(key: ProblemKey = KEY, ms: float = 1.0, full: bool = True) -> Entry:
    """An entry whose configs are made for `key` (fwd, 16-bit dtypes; a variant key's switches on)."""
    win = KernelConfig(**key.config_fields(), block_m=128, block_n=64, num_warps=8, num_stages=2)
    runner_ups = (Result.of(win.replace(num_stages=3), ms * 1.1, 90.0, 128),
                  Result.of(win.replace(block_n=32), ms * 1.2, 80.0, None)) if full else ()
    return Entry(key, Result.of(win, ms, 100.0, 168), Result.of(win.replace(num_warps=4), ms * 1.5, 70.0, 96)
                 if full else None, 2.0 * ms if full else None, runner_ups,
                 ((8, 16, 2048, key.head_dim), (4, 16, 4096, key.head_dim)), 40, 3, 50, "2025-01-31T12:00:00+00:00")


def make_table(*entries: Entry, gpu: str = "h100", template_hash: str = HASH, prov=None) -> Table:
    return Table.empty(gpu, template_hash, prov or PROV).with_entries(*entries)


def key_for(head_dim: int, causal: bool = True, gpu: str = "h100") -> ProblemKey:
    return ProblemKey(gpu, "fwd", "bf16", head_dim, causal, "le4k")


def write(path, data) -> None:
    path.write_text(data if isinstance(data, str) else json.dumps(data, indent=1))


def test_round_trip(tmp_path):
    table = make_table(make_entry(), make_entry(key_for(64, causal=False), ms=0.5, full=False))
    path = table_path(tmp_path, "h100")
    assert path == tmp_path / "h100.json"
    write(path, table.to_json())
    loaded = load_table(path, gpu="h100", template_hash=HASH)
    assert loaded == table
    assert loaded.to_dict() == table.to_dict() == json.loads(path.read_text())
    assert isinstance(loaded.entries[SLUG].winner.config, KernelConfig)
    assert loaded.get(KEY).winner.config == WINNER and loaded.get("fwd/bf16/d64/full/le4k").default is None
    assert loaded.get(key_for(96)) is None
    assert loaded.provenance == PROV
    with pytest.raises(TypeError):
        loaded.entries["x"] = loaded.entries[SLUG]  # read-only view
    text = table.to_json()
    assert text.endswith("}\n") and text.index("fwd/bf16/d128") < text.index("fwd/bf16/d64")


def test_partial_provenance_is_filled_with_none():
    table = Table.empty("h100", HASH, {"backend": "cuda"})
    assert set(table.provenance) == set(tt.PROVENANCE_KEYS) and table.provenance["torch"] is None
    assert Table.from_dict(table.to_dict(), "<memory>") == table


def _entry(d):
    return d["entries"][SLUG]


def _move_entry(d):
    d["entries"]["fwd/bf16/d64/causal/le4k"] = d["entries"].pop(SLUG)


def _set(path_, value):
    """A mutation setting the field at `path_` (keys / indices from the entry; '/' first = top level)."""
    def mutate(d):
        node = d if path_[0] == "/" else _entry(d)
        parts = path_[1:] if path_[0] == "/" else path_
        for p in parts[:-1]:
            node = node[p]
        node[parts[-1]] = value
    return mutate


def _delete(*path_):
    def mutate(d):
        node = _entry(d)
        for p in path_[:-1]:
            node = node[p]
        del node[path_[-1]]
    return mutate


def _wrong_head_dim(d):  # a valid config, correctly named, for another head dim
    cfg = WINNER.replace(head_dim=64)
    _entry(d)["winner"].update(config=cfg.to_dict(), name=cfg.name)


CORRUPTIONS = {
    "schema name": (_set(("/", "schema"), "other.format"), "schema"),
    "version 2": (_set(("/", "version"), 2), "version"),
    "version true": (_set(("/", "version"), True), "version"),
    "missing top key": (lambda d: d.pop("template_hash"), "template_hash"),
    "unknown top key": (_set(("/", "extra"), 1), "extra"),
    "gpu empty": (_set(("/", "gpu"), ""), "gpu"),
    "provenance unknown key": (_set(("/", "provenance", "host"), "x"), "provenance"),
    "provenance value int": (_set(("/", "provenance", "cuda"), 12), "provenance.cuda"),
    "provenance backend": (_set(("/", "provenance", "backend"), "gpu"), "provenance.backend"),
    "entries not object": (_set(("/", "entries"), []), "entries"),
    "missing entry key": (_delete("evaluated"), f"{AT}: got keys"),
    "unknown result key": (_set(("winner", "foo"), 1), f"{AT}.winner"),
    "bool evaluated": (_set(("evaluated",), True), f"{AT}.evaluated"),
    "bool registers": (_set(("winner", "registers"), False), f"{AT}.winner.registers"),
    "bool smem": (_set(("winner", "smem_bytes"), True), f"{AT}.winner.smem_bytes"),
    "bool shape": (_set(("shapes", 0, 0), True), f"{AT}.shapes[0][0]"),
    "bool in config": (_set(("winner", "config", "num_warps"), True), f"{AT}.winner.config"),
    "int causal in key": (_set(("key", "causal"), 1), f"{AT}.key"),
    "negative ms": (_set(("winner", "ms"), -1.0), f"{AT}.winner.ms"),
    "zero ms": (_set(("winner", "ms"), 0), f"{AT}.winner.ms"),
    "nan ms": (_set(("winner", "ms"), float("nan")), f"{AT}.winner.ms"),
    "inf ms": (_set(("winner", "ms"), float("inf")), f"{AT}.winner.ms"),
    "string ms": (_set(("winner", "ms"), "1.0"), f"{AT}.winner.ms"),
    "negative tflops": (_set(("winner", "tflops"), -0.5), f"{AT}.winner.tflops"),
    "nan sdpa": (_set(("sdpa_flash_ms",), float("nan")), f"{AT}.sdpa_flash_ms"),
    "invalid config": (_set(("winner", "config", "block_m"), 100), f"{AT}.winner.config"),
    "config unknown field": (_set(("winner", "config", "swizzle"), 1), f"{AT}.winner.config"),
    "name not config name": (_set(("winner", "name"), "fwd_hd128_bf16_causal_m64n64w4s2"), f"{AT}.winner.name"),
    "config for another key": (_wrong_head_dim, f"{AT}.winner.config"),
    "default for another key": (_set(("default", "config", "causal"), False), f"{AT}.default"),
    "runner-up is winner": (lambda d: _entry(d)["runner_ups"].__setitem__(0, _entry(d)["winner"]),
                            f"{AT}.runner_ups[0].name"),
    "runner-ups descending": (_set(("runner_ups", 1, "ms"), 0.5), f"{AT}.runner_ups[1].ms"),
    "runner-ups not list": (_set(("runner_ups",), {}), f"{AT}.runner_ups"),
    "slug not key": (_move_entry, "'fwd/bf16/d64/causal/le4k'"),
    "key gpu not table gpu": (_set(("key", "gpu"), "a100"), f"{AT}.key.gpu"),
    "key invalid": (_set(("key", "seqlen_bucket"), "le2k"), f"{AT}.key"),
    "key variant unknown": (_set(("key", "variant"), "alibi"), f"{AT}.key"),
    "key variant not its slug's": (_set(("key", "variant"), "window"), "'fwd/bf16/d128/causal/le4k/window'"),
    "shape of three": (_set(("shapes", 0), [8, 16, 2048]), f"{AT}.shapes[0]"),
    "shape zero": (_set(("shapes", 1, 2), 0), f"{AT}.shapes[1][2]"),
    "shape head_dim": (_set(("shapes", 1, 3), 64), f"{AT}.shapes[1][3]"),
    "no shapes": (_set(("shapes",), []), f"{AT}.shapes"),
    "evaluated zero": (_set(("evaluated",), 0), f"{AT}.evaluated"),
    "failed negative": (_set(("failed",), -1), f"{AT}.failed"),
    "trials below evaluated": (_set(("trials",), 39), f"{AT}.trials"),
    "bad date": (_set(("date",), "yesterday"), f"{AT}.date"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corruption_is_rejected(tmp_path, case):
    mutate, field = CORRUPTIONS[case]
    data = make_table(make_entry()).to_dict()
    path = tmp_path / "h100.json"
    write(path, data)
    load_table(path)  # the uncorrupted table loads
    mutate(data)
    write(path, data)
    with pytest.raises(TableError) as err:
        load_table(path)
    msg = str(err.value)
    assert str(path) in msg and field in msg and "expected" in msg, msg


@pytest.mark.parametrize("text, detail", [
    ('{"schema": "autoflash.tuned",\n "version": 1,,}', "line 2 column"),
    ('{"schema": "autoflash.tuned", "schema": "autoflash.tuned"}', "duplicate key 'schema'"),
    ("", "line 1 column 1"),
    ("[]", "<top level>"),
])
def test_unparsable_files_are_rejected(tmp_path, text, detail):
    path = tmp_path / "h100.json"
    write(path, text)
    with pytest.raises(TableError) as err:
        load_table(path)
    assert str(path) in str(err.value) and detail in str(err.value), str(err.value)


def test_missing_file_is_a_table_error(tmp_path):
    with pytest.raises(TableError, match="cannot read"):
        load_table(tmp_path / "nope.json")


def test_gpu_and_template_hash_filters(tmp_path):
    path = tmp_path / "h100.json"
    write(path, make_table(make_entry()).to_json())
    with pytest.raises(TableError) as err:
        load_table(path, gpu="a100")
    assert "'h100'" in str(err.value) and "'a100'" in str(err.value) and str(path) in str(err.value)
    with pytest.raises(TableError) as err:
        load_table(path, template_hash=OTHER_HASH)
    assert HASH in str(err.value) and OTHER_HASH in str(err.value) and "re-run the tuner" in str(err.value)
    assert load_table(path, gpu="h100", template_hash=HASH).gpu == "h100"


def test_merge_keeps_overwrites_and_adds(tmp_path):
    path = tmp_path / "tuned" / "h100.json"  # the folder does not exist yet
    a, b, c = key_for(64), key_for(96), key_for(128)
    first = merge_into(path, make_table(make_entry(a, 1.0), make_entry(b, 2.0)))
    assert first == MergeReport(path, (a.slug, b.slug), (), (), None)
    prov = {**PROV, "command": "second run", "backend": "cuda"}
    report = merge_into(path, make_table(make_entry(b, 0.5, full=False), make_entry(c, 3.0), prov=prov))
    assert report == MergeReport(path, (c.slug,), (b.slug,), (a.slug,), None)
    merged = load_table(path)
    assert merged.entries[a.slug] == make_entry(a, 1.0)
    assert merged.entries[b.slug] == make_entry(b, 0.5, full=False)
    assert merged.entries[c.slug] == make_entry(c, 3.0)
    assert dict(merged.provenance) == prov
    assert path.read_text() == merged.to_json()


def test_merge_refuses_another_gpu_and_leaves_file(tmp_path):
    path = tmp_path / "h100.json"
    write(path, make_table(make_entry(key_for(64, gpu="a100")), gpu="a100").to_json())
    before = path.read_bytes()
    with pytest.raises(TableError) as err:
        merge_into(path, make_table(make_entry()))
    assert "'a100'" in str(err.value) and "'h100'" in str(err.value)
    assert path.read_bytes() == before


@pytest.mark.parametrize("text", ["{ this is not json", '{"schema": "autoflash.tuned", "version": 7}'])
def test_merge_refuses_a_corrupt_file_and_leaves_it(tmp_path, text):
    path = tmp_path / "h100.json"
    write(path, text)
    with pytest.raises(TableError) as err:
        merge_into(path, make_table(make_entry()))
    assert "move" in str(err.value) and str(path) in str(err.value)
    assert path.read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["h100.json"]


def test_merge_refuses_an_invalid_new_table_before_touching_anything(tmp_path):
    path = tmp_path / "h100.json"
    bad = make_table(make_entry(key_for(64, gpu="a100")))  # key for another GPU in an h100 table
    with pytest.raises(TableError, match=r"<table to merge>: entries\['fwd/bf16/d64/causal/le4k'\].key.gpu"):
        merge_into(path, bad)
    assert not path.exists()


def test_stale_template_hash_is_backed_up(tmp_path):
    path = tmp_path / "h100.json"
    old = make_table(make_entry(key_for(64)), template_hash=OTHER_HASH)
    write(path, old.to_json())
    before = path.read_bytes()
    report = merge_into(path, make_table(make_entry()))
    backup = tmp_path / f"h100.{OTHER_HASH[:12]}.json"
    assert report == MergeReport(path, (SLUG,), (), (), backup)
    assert backup.read_bytes() == before
    assert load_table(path, template_hash=HASH) == make_table(make_entry())
    write(path, old.to_json())  # stale again: an earlier backup is never overwritten
    assert merge_into(path, make_table(make_entry())).replaced_stale == tmp_path / f"h100.{OTHER_HASH[:12]}.2.json"
    assert backup.read_bytes() == before


def test_writes_leave_no_temporary_files(tmp_path):
    path = tmp_path / "h100.json"
    for d in (64, 96, 64):
        merge_into(path, make_table(make_entry(key_for(d))))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "h100.json.lock") == ["h100.json"]


def test_failed_write_keeps_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "h100.json"
    merge_into(path, make_table(make_entry()))
    before = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk on fire")
    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk on fire"):
        merge_into(path, make_table(make_entry(key_for(64))))
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "h100.json.lock") == ["h100.json"]


def test_lock_timeout_is_a_clear_error(tmp_path, monkeypatch):
    path = tmp_path / "h100.json"
    monkeypatch.setattr(tt, "LOCK_TIMEOUT_S", 0.2)
    with filelock.FileLock(str(path) + ".lock"):
        with pytest.raises(TableError, match="could not lock"):
            merge_into(path, make_table(make_entry()))
    assert not path.exists()


HEAD_DIMS = [d for d in range(32, 257, 8)][:15]


def _merge_worker(path: str, causal: bool, start) -> None:
    start.wait(60)  # both processes have imported everything: their merges overlap
    for d in HEAD_DIMS:
        merge_into(path, make_table(make_entry(key_for(d, causal=causal), ms=d / 100)))


def test_two_processes_merging_lose_nothing(tmp_path):
    path = tmp_path / "h100.json"
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(2)
    procs = [ctx.Process(target=_merge_worker, args=(str(path), causal, start)) for causal in (False, True)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    table = load_table(path)
    expected = {key_for(d, causal=c).slug for d in HEAD_DIMS for c in (False, True)}
    assert len(expected) == 30 and set(table.entries) == expected
    assert all(table.entries[key_for(d, c).slug].winner.ms == d / 100 for d in HEAD_DIMS for c in (False, True))


# ------------------------------------------------------------------ variant keys
WINDOW_KEY = ProblemKey("h100", "fwd", "bf16", 128, True, "le4k", "window")
VARLEN_KEY = ProblemKey("h100", "fwd", "bf16", 128, False, "le1k", "varlen")


def test_variant_entries_round_trip_beside_plain_ones(tmp_path):
    table = make_table(make_entry(), make_entry(WINDOW_KEY, ms=0.4), make_entry(VARLEN_KEY, ms=0.7, full=False))
    path = table_path(tmp_path, "h100")
    write(path, table.to_json())
    loaded = load_table(path, gpu="h100", template_hash=HASH)
    assert loaded == table
    assert set(loaded.entries) == {SLUG, "fwd/bf16/d128/causal/le4k/window", "fwd/bf16/d128/full/le1k/varlen"}
    assert loaded.get(WINDOW_KEY).winner.config.window and loaded.get(KEY).winner.config == WINNER
    keys = {slug: e["key"] for slug, e in json.loads(path.read_text())["entries"].items()}
    assert "variant" not in keys[SLUG]  # a plain entry is written as before variants
    assert keys["fwd/bf16/d128/causal/le4k/window"]["variant"] == "window"


def test_a_table_written_before_variants_loads_as_plain(tmp_path):
    data = make_table(make_entry()).to_dict()
    assert set(data["entries"][SLUG]["key"]) == {"gpu", "direction", "dtype", "head_dim", "causal", "seqlen_bucket"}
    path = tmp_path / "h100.json"
    write(path, data)
    assert load_table(path).get(SLUG).key.variant == "plain"
    data["entries"][SLUG]["key"]["variant"] = "plain"  # spelled out: the same key
    write(path, data)
    assert load_table(path).to_dict() == make_table(make_entry()).to_dict()


@pytest.mark.parametrize("key", [WINDOW_KEY, VARLEN_KEY], ids=str)
def test_a_variant_entry_needs_the_variants_kernel(tmp_path, key):
    data = make_table(make_entry(key)).to_dict()
    plain = KernelConfig(head_dim=128, dtype="bf16", block_m=128, block_n=64, num_warps=8, num_stages=2,
                         causal=key.causal)  # the plain kernel: no window / varlen switch
    data["entries"][key.slug]["winner"].update(config=plain.to_dict(), name=plain.name)
    path = tmp_path / "h100.json"
    write(path, data)
    with pytest.raises(TableError, match=r"winner\.config: got a config for .*expected one matching key"):
        load_table(path)
