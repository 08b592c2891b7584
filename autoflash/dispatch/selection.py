"""Config selection: a pure, cached function from (GPU profile, direction, dtype, head_dim, causal,
seqlen bucket) to a KernelConfig and where it came from. It never reads tensor contents,
synchronizes or allocates on a GPU.

Lookup order, first hit wins:
1. the user's table: $AUTOFLASH_TUNED_DIR/<gpu>.json, else the per-user folder where
   `python -m autoflash.tune` writes outside a checkout (~/.local/share/autoflash/tuned);
2. the shipped table, tuned/<gpu>.json;
3. the built-in heuristics (autoflash/kernels/defaults.py: FlashAttention-2's published tile choices).
A table for another GPU, another template hash or with a bad schema is skipped with one warning
naming the file and the mismatch."""
from __future__ import annotations

import dataclasses
import functools
import os
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


def table_folders() -> tuple[tuple[str, Path], ...]:
    """(label, folder) in lookup order: the user's folder, then the shipped one."""
    return _folders(os.environ.get("AUTOFLASH_TUNED_DIR"))


@functools.lru_cache(maxsize=8)
def _folders(user: str | None) -> tuple[tuple[str, Path], ...]:
    from autoflash.kernels.resources import tuned_dir, user_tuned_dir

    folders = [("$AUTOFLASH_TUNED_DIR", Path(user)) if user else ("per-user", user_tuned_dir())]
    try:
        folders.append(("shipped", tuned_dir()))
    except FileNotFoundError:  # a stripped install without tuned/: heuristics only
        pass
    return tuple(folders)


@functools.lru_cache(maxsize=None)
def _tables(gpu: str, template_hash: str, folders: tuple[tuple[str, Path], ...]):
    """The valid tables for `gpu`, in lookup order; each bad one is warned about once (cached)."""
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


@functools.lru_cache(maxsize=4096)
def _select(profile: GpuProfile, direction: str, dtype: str, head_dim: int, causal: bool, bucket: str,
            template_hash: str, folders: tuple[tuple[str, Path], ...]) -> Selection:
    from autoflash.tuning.space import default_for

    key = ProblemKey(profile.name, direction, dtype, head_dim, causal, bucket)
    for path, table in _tables(profile.name, template_hash, folders):
        entry = table.get(key)
        # A table measured on the full part may name a tile a cut-down variant cannot hold.
        if entry is not None and entry.winner.config.smem_bytes <= profile.smem_per_block_optin:
            return Selection(key, entry.winner.config, f"tuned table {path}")
    return Selection(key, default_for(key, profile), HEURISTIC)


def select_config(profile: GpuProfile, direction: str, dtype: str, head_dim: int, causal: bool,
                  seqlen_k: int) -> Selection:
    """The config for one call; cached on its arguments (and on the folders and templates in use)."""
    from autoflash.kernels.codegen import template_hash

    return _select(profile, direction, dtype, head_dim, causal, seqlen_bucket(seqlen_k), template_hash(),
                   table_folders())


def clear_cache() -> None:
    """Forget loaded tables and selections (after a tune wrote a new table in this process)."""
    _folders.cache_clear()
    _tables.cache_clear()
    _select.cache_clear()
