"""Config selection from tuned tables: lookup order, the heuristic fallback, bad tables skipped
with one warning."""
import json
import re
import warnings

import pytest
import torch

from autoflash.dispatch import selection
from autoflash.kernels import resources
from autoflash.kernels.codegen import template_hash
from autoflash.kernels.config import KernelConfig
from autoflash.kernels.gpus import get_profile
from autoflash.tuning.problem import ProblemKey
from autoflash.dispatch.selection import HEURISTIC, select_config
from autoflash.tuning.table import Entry, Result, Table, merge_into, table_path

H100 = get_profile("h100")
KEY = ProblemKey("h100", "fwd", "bf16", 128, True, "le4k")


def _cfg(m, n, w):
    return KernelConfig(head_dim=128, dtype="bf16", block_m=m, block_n=n, num_warps=w, num_stages=2, causal=True)


def _write(folder, winner, *, gpu="h100", thash=None):
    entry = Entry(key=ProblemKey(gpu, *list(KEY.to_dict().values())[1:]), winner=Result.of(winner, 1.0, 100.0),
                  default=None, sdpa_flash_ms=None, runner_ups=(), shapes=((4, 16, 4096, 128),), evaluated=1, failed=0,
                  trials=1, date="2026-11-22T00:00:00+00:00")
    table = Table(gpu, thash or template_hash(), {"backend": "cuda"}, {}).with_entries(entry)
    merge_into(table_path(folder, gpu), table)
    return table_path(folder, gpu)


@pytest.fixture(autouse=True)
def _folders(tmp_path, monkeypatch):
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    user.mkdir()
    shipped.mkdir()
    monkeypatch.setenv("AUTOFLASH_TUNED_DIR", str(user))
    monkeypatch.setattr(resources, "tuned_dir", lambda: shipped)
    selection.clear_cache()
    yield user, shipped
    selection.clear_cache()


def test_heuristic_without_tables():
    from autoflash.kernels.defaults import default_config

    sel = select_config(H100, "fwd", "bf16", 128, True, 3000)
    assert sel.origin == HEURISTIC and sel.config == default_config(128, "bf16", True, H100)
    assert sel.key == KEY


def test_tuned_winner_is_picked_for_its_bucket(_folders):
    user, _ = _folders
    path = _write(user, _cfg(64, 96, 4))
    sel = select_config(H100, "fwd", "bf16", 128, True, 4096)
    assert sel.config == _cfg(64, 96, 4) and sel.origin == f"tuned table {path}"
    assert select_config(H100, "fwd", "bf16", 128, True, 8192).origin == HEURISTIC  # other bucket: not tuned
    assert select_config(H100, "fwd", "bf16", 128, False, 4096).origin == HEURISTIC  # other key


def test_user_table_comes_before_the_shipped_one(_folders):
    user, shipped = _folders
    _write(shipped, _cfg(128, 32, 8))
    assert select_config(H100, "fwd", "bf16", 128, True, 2048).config == _cfg(128, 32, 8)
    _write(user, _cfg(64, 96, 4))
    selection.clear_cache()
    assert select_config(H100, "fwd", "bf16", 128, True, 2048).config == _cfg(64, 96, 4)


@pytest.mark.parametrize("damage", ["corrupt", "other_gpu", "other_templates"])
def test_bad_tables_are_skipped_with_one_warning(_folders, damage):
    user, shipped = _folders
    _write(shipped, _cfg(128, 32, 8))
    path = table_path(user, "h100")
    if damage == "corrupt":
        path.write_text("{broken")
        expect = "invalid JSON"
    elif damage == "other_gpu":
        data = json.loads(_write(user, _cfg(64, 96, 4)).read_text())
        data["gpu"] = "a100"
        for e in data["entries"].values():
            e["key"]["gpu"] = "a100"
        path.write_text(json.dumps(data))
        expect = "a100"
    else:
        _write(user, _cfg(64, 96, 4), thash="0123456789abcdef")
        expect = "0123456789abcdef"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sel = select_config(H100, "fwd", "bf16", 128, True, 2048)
        select_config(H100, "fwd", "bf16", 128, True, 1024)
        select_config(H100, "bwd", "bf16", 128, True, 2048)
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1 and str(path) in msgs[0]
    assert re.search(expect, msgs[0]), msgs[0]
    assert sel.config == _cfg(128, 32, 8)  # the next table in the lookup order still serves


def test_selection_is_cached():
    a = select_config(H100, "fwd", "bf16", 128, True, 3000)
    b = select_config(H100, "fwd", "bf16", 128, True, 2100)  # same bucket
    assert a is b


# ------------------------------------------------------------------ variant keys
WINDOW = ProblemKey("h100", "fwd", "bf16", 128, True, "le4k", "window")


def _write_entry(folder, key, winner):
    entry = Entry(key=key, winner=Result.of(winner, 1.0, 100.0), default=None, sdpa_flash_ms=None, runner_ups=(),
                  shapes=((4, 16, 4096, 128),), evaluated=1, failed=0, trials=1, date="2026-11-22T00:00:00+00:00")
    table = Table(key.gpu, template_hash(), {"backend": "cuda"}, {}).with_entries(entry)
    merge_into(table_path(folder, key.gpu), table)
    return table_path(folder, key.gpu)


def test_a_tuned_window_entry_is_picked_for_window_calls(_folders):
    user, _ = _folders
    tuned = KernelConfig(block_m=64, block_n=48, num_warps=4, **WINDOW.config_fields())
    path = _write_entry(user, WINDOW, tuned)
    sel = select_config(H100, "fwd", "bf16", 128, True, 4096, variant="window")
    assert sel.key == WINDOW and sel.config == tuned and sel.origin == f"tuned table {path}"
    plain = select_config(H100, "fwd", "bf16", 128, True, 4096)  # callers without a variant: as before
    assert plain.key == KEY and plain.origin == HEURISTIC and not plain.config.window


def test_an_untuned_variant_falls_back_to_its_default(_folders):
    from autoflash.tuning.space import default_for

    user, _ = _folders
    _write(user, _cfg(64, 96, 4))  # the plain key is tuned: it does not serve window or packed calls
    for variant in ("window", "varlen"):
        sel = select_config(H100, "fwd", "bf16", 128, True, 4096, variant=variant)
        key = ProblemKey("h100", "fwd", "bf16", 128, True, "le4k", variant)
        assert sel.key == key and sel.origin == HEURISTIC and sel.config == default_for(key, H100)
        assert sel.config.variants == (variant,)
    assert select_config(H100, "fwd", "bf16", 128, True, 4096).config == _cfg(64, 96, 4)


def test_a_tuned_sm90_backward_takes_no_switch_its_key_lacks(_folders):
    """A varlen key's tuned sm90 backward serves packed calls; one with a window or softcap besides takes
    the built-in tiles for those switches (the sm90 backward's depend on them: the tuned tiles were
    compiled with the key's switches alone)."""
    from autoflash.dispatch.variant_ops import tuned_selection

    user, _ = _folders
    key = ProblemKey("h100", "bwd", "bf16", 128, True, "le4k", "varlen")
    tuned = KernelConfig(block_m=80, block_n=128, num_warps=8, family="sm90", **key.config_fields())
    path = _write_entry(user, key, tuned)
    q = torch.zeros(1, 4, 128, dtype=torch.bfloat16)
    call = dict(window=(-1, -1), softcap=0.0, alibi_slopes=None, key_bias=None, align="bottom_right", causal=True,
                cu_seqlens_k=torch.zeros(2, dtype=torch.int32))
    sel = tuned_selection(H100, q, "bwd", call, 4096)
    assert sel.config == tuned and sel.origin == f"tuned table {path}"
    for more in (dict(window=(64, 0)), dict(softcap=5.0), dict(key_bias=torch.zeros(1, 1))):
        assert tuned_selection(H100, q, "bwd", {**call, **more}, 4096) is None, more


def test_the_variant_is_part_of_the_cache_key():
    plain = select_config(H100, "bwd", "bf16", 64, True, 1000)
    window = select_config(H100, "bwd", "bf16", 64, True, 1000, variant="window")
    assert plain is select_config(H100, "bwd", "bf16", 64, True, 900, variant="plain")
    assert window is select_config(H100, "bwd", "bf16", 64, True, 900, variant="window")
    assert plain.config != window.config and window.config.window


@pytest.mark.parametrize("causal, variant, match", [(False, "window", "causal"), (True, "alibi", "variant")])
def test_a_variant_that_makes_no_key_raises(causal, variant, match):
    with pytest.raises(ValueError, match=match):
        select_config(H100, "fwd", "bf16", 128, causal, 4096, variant=variant)
    with pytest.raises(ValueError, match=match):  # nothing remembered: it raises again
        select_config(H100, "fwd", "bf16", 128, causal, 4096, variant=variant)
