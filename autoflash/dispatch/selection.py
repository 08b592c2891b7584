"""Config selection: a pure, cached function from (GPU profile, direction, dtype, head_dim, causal,
seqlen bucket, variant) to a KernelConfig and where it came from. It never reads tensor contents,
synchronizes or allocates on a GPU. The variant ("plain", "window" or "varlen": ProblemKey's) picks
the key tuned for it; a caller that names none gets the plain key, as before variants.

Lookup order, first hit wins:
1. the user's table: $AUTOFLASH_TUNED_DIR/<gpu>.json, else the per-user folder where
   `python -m autoflash.tune` writes outside a checkout (~/.local/share/autoflash/tuned);
2. the shipped table, tuned/<gpu>.json;
3. the built-in heuristics (autoflash/kernels/defaults.py: FlashAttention-2's published tile choices).
A table for another GPU, another template hash or with a bad schema is skipped with one warning
naming the file and the mismatch.

Selections are remembered per call signature and per state of the table files on disk (inode,
mtime, size): a table re-tuned by another process is picked up, at most TABLE_RECHECK_S seconds
later, with no clear_cache()."""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
import warnings
from pathlib import Path

from autoflash.kernels.config import KernelConfig
from autoflash.kernels.gpus import GpuProfile
from autoflash.tuning.problem import ProblemKey, seqlen_bucket

HEURISTIC = "built-in heuristic (autoflash/kernels/defaults.py)"


@dataclasses.dataclass(frozen=True)
class Selection:
    key: ProblemKey
    config: KernelConfig
    origin: str  # "tuned table <path>" or HEURISTIC


USER_DIR_ENV = "AUTOFLASH_TUNED_DIR"
# How stale a table on disk may be seen. A stat costs ~1 us a file (2-core host), as much as a
# cached selection: the files are looked at once per interval, not on every call.
TABLE_RECHECK_S = 1.0
SELECTION_CACHE_MAX = 4096


def table_folders() -> tuple[tuple[str, Path], ...]:
    """(label, folder) in lookup order: the user's folder, then the shipped one."""
    return _folders(os.environ.get(USER_DIR_ENV))


@functools.lru_cache(maxsize=8)
def _folders(user: str | None) -> tuple[tuple[str, Path], ...]:
    from autoflash.kernels.resources import tuned_dir, user_tuned_dir

    folders = [(f"${USER_DIR_ENV}", Path(user)) if user else ("per-user", user_tuned_dir())]
    try:
        folders.append(("shipped", tuned_dir()))
    except FileNotFoundError:  # a stripped install without tuned/: heuristics only
        pass
    return tuple(folders)


@functools.lru_cache(maxsize=16)
def _tables(gpu: str, template_hash: str, folders: tuple[tuple[str, Path], ...], files: tuple):
    """The valid tables for `gpu`, in lookup order; each bad one is warned about once per state of
    the files on disk (`files`, _files_state: part of the cache key, not read here)."""
    from autoflash.tuning.table import TableError, load_table, table_path

    found = []
    for _label, folder in folders:
        path = table_path(folder, gpu)
        if not path.is_file():
            continue
        try:
            found.append((path, load_table(path, gpu=gpu, template_hash=template_hash)))
        except TableError as e:
            warnings.warn(f"autoflash: skipping a tuned table: {e}", RuntimeWarning, stacklevel=4)
    return tuple(found)


def _select(profile: GpuProfile, direction: str, dtype: str, head_dim: int, causal: bool, bucket: str,
            variant: str, template_hash: str, folders: tuple[tuple[str, Path], ...], files: tuple) -> Selection:
    from autoflash.kernels.defaults import stack_note
    from autoflash.tuning.space import default_for

    key = ProblemKey(profile.name, direction, dtype, head_dim, causal, bucket, variant)
    for path, table in _tables(profile.name, template_hash, folders, files):
        entry = table.get(key)
        # A table measured on the full part may name a tile a cut-down variant cannot hold.
        if entry is not None and entry.winner.config.smem_bytes <= profile.smem_per_block_optin:
            return Selection(key, entry.winner.config, f"tuned table {path}")
    config = default_for(key, profile)
    note = stack_note(config, profile)  # where the installed NVRTC moved a built-in choice
    return Selection(key, config, HEURISTIC + (f"; {note}" if note else ""))


def select_config(profile: GpuProfile, direction: str, dtype: str, head_dim: int, causal: bool,
                  seqlen_k: int, variant: str = "plain") -> Selection:
    """The config for one call; cached on its arguments, the templates, the table folders in use and
    the state of their files (re-read at most every TABLE_RECHECK_S seconds).

    variant: "plain" (default), "window" or "varlen" (ProblemKey.variant): the key tuned for calls
    with a sliding window or packed sequences, its config carrying their switches (tuned table, else
    default_for's built-in tiles for variant kernels). A window key is causal: pass causal=True for
    any window call (its kernels skip key blocks as causal ones do); for packed sequences seqlen_k
    is max_seqlen_k. Other variants (softcap, ALiBi, a key bias) use the plain key."""
    bucket = seqlen_bucket(seqlen_k)  # before the cache: a bad seqlen_k raises on every call
    user = os.environ.get(USER_DIR_ENV)
    files = _files_state(profile.name, user)
    # The user folder's setting stands for the folders (they are a function of it until clear_cache()),
    # which spares hashing Paths on every call.
    templates = _template_hash()
    key = (profile, direction, dtype, head_dim, causal, bucket, variant, templates, user, files)
    selection = _selections.get(key)
    if selection is None:  # a miss, or arguments _select refuses: it raises, and nothing is remembered
        selection = _select(profile, direction, dtype, head_dim, causal, bucket, variant, templates, _folders(user),
                            files)
        if len(_selections) >= SELECTION_CACHE_MAX:
            _selections.clear()  # all at once: thread-safe, and a refill costs what a miss does
        _selections[key] = selection
    return selection


def _template_hash() -> str:
    """codegen.template_hash(), importing codegen (and jinja2) on first use only: an import statement
    in select_config would cost ~0.5 us a call even with the module loaded."""
    codegen = sys.modules.get("autoflash.kernels.codegen")
    if codegen is None:
        import autoflash.kernels.codegen as codegen
    return codegen.template_hash()


_clock = time.monotonic  # a name of its own, for tests to move
_selections: dict[tuple, Selection] = {}
_checked: dict[tuple[str, str | None], tuple[float, tuple]] = {}  # (gpu, user folder) -> (when, files)


def _files_state(gpu: str, user: str | None) -> tuple:
    """(inode, mtime, size) of `gpu`'s table in each folder (None where there is none), looked at
    again once TABLE_RECHECK_S has passed since the last look."""
    now = _clock()
    seen = _checked.get((gpu, user))
    if seen is not None and now - seen[0] < TABLE_RECHECK_S:
        return seen[1]
    from autoflash.tuning.table import table_path

    state = tuple(_file_state(table_path(folder, gpu)) for _label, folder in _folders(user))
    if len(_checked) >= 64:
        _checked.clear()
    _checked[(gpu, user)] = (now, state)
    return state


def _file_state(path: Path) -> tuple[int, int, int] | None:
    """A file's identity and version: a replaced file (new inode) or a rewritten one (mtime, size) differs."""
    try:
        st = os.stat(path)
    except OSError:  # missing (or unreadable: _tables reports what it can when it loads)
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def clear_cache() -> None:
    """Forget folders, loaded tables and selections, and look at the table files again on the next
    call (the folders' own settings, e.g. a replaced tuned_dir(), are otherwise read once)."""
    _folders.cache_clear()
    _tables.cache_clear()
    _selections.clear()
    _checked.clear()


def select_decode(profile: GpuProfile, q, shape) -> tuple[KernelConfig | None, int]:
    """The KV-cache kernel's tuned config and num_splits for a flash_attn_with_kvcache call (q and
    the checked kernels.decode.CacheShape): (None, 0) where no tuned decode key matches, meaning the
    built-in config (kernels.defaults.default_decode_config) and the split heuristic.

    The decode key (ProblemKey.decode) is q's dtype, the head dim, and the buckets of seqlen_q,
    the cache's capacity (keys a sequence may hold: the lengths themselves are tensor values, never
    read here), the batch, and paged or not; tables are looked up in select_config's order. A
    seqlen_q above 16 has no decode key; a paged call whose page size the tuned key tile does not
    divide (keys are tuned with pages of 256) falls back too, and so does a V head dim of its own (no
    key holds one). Reads q's dtype only: no tensor contents, no synchronisation. Cached as
    select_config is."""
    from autoflash.kernels.checks import DTYPE_NAMES
    from autoflash.tuning import decode as dk

    dtype = DTYPE_NAMES.get(q.dtype)
    q_bucket = dk.q_bucket(shape.seqlen_q)
    if dtype not in ("fp16", "bf16") or q_bucket is None or shape.head_dim_v is not None:
        return None, 0
    buckets = (q_bucket, dk.cache_bucket(max(1, shape.capacity)), dk.batch_bucket(shape.batch))
    user = os.environ.get(USER_DIR_ENV)
    files = _files_state(profile.name, user)
    templates = _template_hash()
    key = ("decode", profile, dtype, shape.head_dim, *buckets, shape.page_size, templates, user, files)
    chosen = _selections.get(key)
    if chosen is None:
        chosen = _select_decode(profile, dtype, shape.head_dim, buckets, shape.page_size, templates, _folders(user),
                                files)
        if len(_selections) >= SELECTION_CACHE_MAX:
            _selections.clear()
        _selections[key] = chosen
    return chosen


def _select_decode(profile: GpuProfile, dtype: str, head_dim: int, buckets: tuple[str, str, str],
                   page_size: int | None, template_hash: str, folders, files) -> tuple[KernelConfig | None, int]:
    key = ProblemKey.decode(profile.name, dtype, head_dim, *buckets, page_size is not None)
    for _path, table in _tables(profile.name, template_hash, folders, files):
        entry = table.get(key)
        if entry is None:
            continue
        config = entry.winner.config
        if config.smem_bytes > profile.smem_per_block_optin or (page_size is not None and page_size % config.block_n):
            continue  # a cut-down part, or pages the tuned key tile does not divide: the next table, or none
        return config, entry.winner.num_splits or 0
    return None, 0
