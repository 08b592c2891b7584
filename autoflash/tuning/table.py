"""Tuned tables: `tuned/<gpu>.json`, the fastest KernelConfig found per ProblemKey on one GPU profile.

Everything read from a file is validated before any value is returned (`load_table`), and everything
written is validated first and replaced atomically under a file lock (`merge_into`), so two tuners
writing one table lose nothing and a crash never leaves a half-written table. Tables are immutable:
`Table.entries` and `Table.provenance` are read-only `types.MappingProxyType` views, keyed by
`ProblemKey.slug` and by provenance field. Schema: see SCHEMA_NAME / SCHEMA_VERSION and `Table.to_dict`.
An entry's key holds "variant" only for a variant key ("window", "varlen"; see ProblemKey): absent, it
is plain, so tables written before variants load unchanged. Every config of an entry must match its
key (ProblemKey.matches: the variant's switches included). A decode key (variant "decode") also holds
q_bucket, batch_bucket and paged, and each of its results a "num_splits" (0 = the heuristic) beside
the unsplit KV-cache config; other results have none, so older tables load unchanged.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import shutil
import tempfile
import types
from pathlib import Path
from typing import Any, Mapping

import filelock

from autoflash.kernels.config import KernelConfig
from autoflash.tuning.problem import ProblemKey

SCHEMA_NAME = "autoflash.tuned"
SCHEMA_VERSION = 1
PROVENANCE_KEYS = ("device_name", "compute_capability", "driver", "cuda", "nvrtc", "torch", "cupy",
                   "autoflash", "date", "backend", "command")
BACKENDS = ("cuda", "simulated")
LOCK_TIMEOUT_S = 60.0
_RESULT_KEYS = ("name", "config", "ms", "tflops", "registers", "smem_bytes")
_ENTRY_KEYS = ("key", "winner", "default", "sdpa_flash_ms", "runner_ups", "shapes", "evaluated", "failed",
               "trials", "date")
_TABLE_KEYS = ("schema", "version", "gpu", "template_hash", "provenance", "entries")
# An entry's key: ProblemKey's fields. "variant" is written for variant keys only (ProblemKey.to_dict),
# so a plain entry reads and writes as it did before variants, and a variant entry's slug has six parts.
_DECODE_KEY_KEYS = ("q_bucket", "batch_bucket", "paged")
_KEY_KEYS = tuple(f.name for f in dataclasses.fields(ProblemKey) if f.name not in ("variant", *_DECODE_KEY_KEYS))


class TableError(ValueError):
    """Anything wrong with a tuned table: the message names the file, the JSON path, what was got and
    what was expected."""


# ---- validation helpers: each takes the file (`where`) and the JSON path (`at`) for its message ----
def _show(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{text} ({type(value).__name__})" if not isinstance(value, str) else text


def _fail(where: str, at: str, got: Any, expected: str) -> TableError:
    return TableError(f"{where}: {at}: got {_show(got)}, expected {expected}")


def _object(where: str, at: str, value: Any, keys: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    """A JSON object with exactly `keys`, and any of `optional`."""
    if not isinstance(value, dict):
        raise _fail(where, at, value, f"a JSON object with keys {list(keys)}")
    missing = [k for k in keys if k not in value]
    unknown = sorted(k for k in value if k not in keys and k not in optional)
    if missing or unknown:
        also = f" (and optionally {list(optional)})" if optional else ""
        raise TableError(f"{where}: {at}: got keys {sorted(value)} (missing {missing}, unknown {unknown}), "
                         f"expected exactly {list(keys)}{also}")
    return value


def _int(where: str, at: str, value: Any, minimum: int) -> int:
    if type(value) is not int or value < minimum:  # type() so that JSON true/false are not ints
        raise _fail(where, at, value, f"an int >= {minimum}")
    return value


def _number(where: str, at: str, value: Any, *, positive: bool) -> float:
    ok = type(value) in (int, float) and math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not ok:
        raise _fail(where, at, value, f"a finite number {'> 0' if positive else '>= 0'}")
    return float(value)


def _str(where: str, at: str, value: Any, *, nullable: bool = False) -> str | None:
    if value is None and nullable:
        return None
    if not isinstance(value, str) or not value:
        raise _fail(where, at, value, "a non-empty string" + (" or null" if nullable else ""))
    return value


def _iso_date(where: str, at: str, value: Any) -> str:
    try:
        datetime.datetime.fromisoformat(value)
    except (TypeError, ValueError):
        raise _fail(where, at, value, "an ISO 8601 date string such as '2025-01-31T12:00:00+00:00'") from None
    return value


@dataclasses.dataclass(frozen=True)
class Result:
    """One measured config: the sum of median times over the key's shapes, and its resource use. A
    decode key's also has num_splits, the run-time splits of the key range it was timed with (0:
    kernels.decode.choose_num_splits per call); None on every other key's."""

    name: str
    config: KernelConfig
    ms: float
    tflops: float
    registers: int | None
    smem_bytes: int
    num_splits: int | None = None

    @classmethod
    def of(cls, config: KernelConfig, ms: float, tflops: float, registers: int | None = None,
           smem_bytes: int | None = None, num_splits: int | None = None) -> "Result":
        """A Result named after its config; smem_bytes defaults to the config's dynamic shared memory."""
        return cls(config.name, config, ms, tflops, registers, config.smem_bytes if smem_bytes is None else smem_bytes,
                   num_splits)

    @property
    def label(self) -> str:
        """The name, with ":splits<n>" for a decode result (the tuner's name of the point)."""
        return self.name if self.num_splits is None else f"{self.name}:splits{self.num_splits}"

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "config": self.config.to_dict(), "ms": self.ms, "tflops": self.tflops,
             "registers": self.registers, "smem_bytes": self.smem_bytes}
        if self.num_splits is not None:
            d["num_splits"] = self.num_splits
        return d

    @classmethod
    def from_dict(cls, data: Any, where: str, *, at: str = "result", key: ProblemKey | None = None) -> "Result":
        """Validate one Result object; with `key`, its config must also have been made for that key."""
        d = _object(where, at, data, _RESULT_KEYS, optional=("num_splits",))
        name = _str(where, f"{at}.name", d["name"])
        try:
            config = KernelConfig.from_dict(d["config"])
        except (TypeError, ValueError) as e:
            raise TableError(f"{where}: {at}.config: got {_show(d['config'])}, expected a valid KernelConfig "
                             f"({e})") from None
        if name != config.name:
            raise _fail(where, f"{at}.name", name, f"the config's name {config.name!r}")
        if key is not None and not key.matches(config):
            got = {f: getattr(config, f) for f in key.config_fields()}
            raise TableError(f"{where}: {at}.config: got a config for {got}, expected one matching key "
                             f"{key.slug!r} {key.config_fields()}")
        registers = d["registers"]
        if registers is not None:
            _int(where, f"{at}.registers", registers, 0)
        splits = d.get("num_splits")
        if key is not None and key.is_decode and splits is None:
            raise _fail(where, f"{at}.num_splits", splits, "an int >= 0 (a decode key's result names its splits)")
        if key is not None and not key.is_decode and splits is not None:
            raise _fail(where, f"{at}.num_splits", splits, f"no num_splits (key {key.slug!r} is not a decode key)")
        if splits is not None:
            _int(where, f"{at}.num_splits", splits, 0)
        return cls(name, config, _number(where, f"{at}.ms", d["ms"], positive=True),
                   _number(where, f"{at}.tflops", d["tflops"], positive=False), registers,
                   _int(where, f"{at}.smem_bytes", d["smem_bytes"], 0), splits)


@dataclasses.dataclass(frozen=True)
class Entry:
    """The outcome of tuning one ProblemKey: winner, built-in default and SDPA for comparison, runner-ups."""

    key: ProblemKey
    winner: Result
    default: Result | None
    sdpa_flash_ms: float | None
    runner_ups: tuple[Result, ...]
    shapes: tuple[tuple[int, int, int, int], ...]
    evaluated: int
    failed: int
    trials: int
    date: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "runner_ups", tuple(self.runner_ups))
        object.__setattr__(self, "shapes", tuple(tuple(s) for s in self.shapes))

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key.to_dict(), "winner": self.winner.to_dict(),
                "default": None if self.default is None else self.default.to_dict(),
                "sdpa_flash_ms": self.sdpa_flash_ms, "runner_ups": [r.to_dict() for r in self.runner_ups],
                "shapes": [list(s) for s in self.shapes], "evaluated": self.evaluated, "failed": self.failed,
                "trials": self.trials, "date": self.date}

    @classmethod
    def from_dict(cls, data: Any, where: str, *, at: str = "entry", slug: str | None = None,
                  gpu: str | None = None) -> "Entry":
        """Validate one entry; `slug` and `gpu` (when given) are what the enclosing table says it is."""
        d = _object(where, at, data, _ENTRY_KEYS)
        raw = _object(where, f"{at}.key", d["key"], _KEY_KEYS, optional=("variant", *_DECODE_KEY_KEYS))
        try:
            key = ProblemKey(**raw)
        except (TypeError, ValueError) as e:
            raise TableError(f"{where}: {at}.key: got {_show(raw)}, expected a valid ProblemKey ({e})") from None
        if gpu is not None and key.gpu != gpu:
            raise _fail(where, f"{at}.key.gpu", key.gpu, f"the table's gpu {gpu!r}")
        if slug is not None and key.slug != slug:
            raise TableError(f"{where}: {at}: entry stored under {slug!r} has key with slug {key.slug!r}; "
                             f"expected the two to be equal")
        winner = Result.from_dict(d["winner"], where, at=f"{at}.winner", key=key)
        default = None if d["default"] is None else Result.from_dict(d["default"], where, at=f"{at}.default", key=key)
        sdpa = None if d["sdpa_flash_ms"] is None else _number(where, f"{at}.sdpa_flash_ms", d["sdpa_flash_ms"],
                                                               positive=True)
        if not isinstance(d["runner_ups"], list):
            raise _fail(where, f"{at}.runner_ups", d["runner_ups"], "a list of results")
        runner_ups = tuple(Result.from_dict(r, where, at=f"{at}.runner_ups[{i}]", key=key)
                           for i, r in enumerate(d["runner_ups"]))
        for i, r in enumerate(runner_ups):
            if r.label == winner.label:
                raise _fail(where, f"{at}.runner_ups[{i}].name", r.label, "a config other than the winner")
            if i and r.ms < runner_ups[i - 1].ms:
                raise _fail(where, f"{at}.runner_ups[{i}].ms", r.ms,
                            f">= {runner_ups[i - 1].ms} (runner-ups in ascending ms)")
        shapes = d["shapes"]
        if not isinstance(shapes, list) or not shapes:
            raise _fail(where, f"{at}.shapes", shapes, "a non-empty list of [batch, heads, seqlen, head_dim]")
        for i, s in enumerate(shapes):
            if not isinstance(s, list) or len(s) != 4:
                raise _fail(where, f"{at}.shapes[{i}]", s, "[batch, heads, seqlen, head_dim]")
            for j, v in enumerate(s):
                _int(where, f"{at}.shapes[{i}][{j}]", v, 1)
            if s[3] != key.head_dim:
                raise _fail(where, f"{at}.shapes[{i}][3]", s[3], f"the key's head_dim {key.head_dim}")
        evaluated = _int(where, f"{at}.evaluated", d["evaluated"], 1)
        return cls(key, winner, default, sdpa, runner_ups, tuple(tuple(s) for s in shapes), evaluated,
                   _int(where, f"{at}.failed", d["failed"], 0), _int(where, f"{at}.trials", d["trials"], evaluated),
                   _iso_date(where, f"{at}.date", d["date"]))


@dataclasses.dataclass(frozen=True)
class Table:
    """One GPU profile's tuned table. `entries` maps ProblemKey.slug -> Entry and `provenance` maps each
    of PROVENANCE_KEYS -> str | None; both are read-only views (pass any mapping; it is copied, and missing
    provenance fields become None). Derive changed tables with `with_entries`."""

    gpu: str
    template_hash: str
    provenance: Mapping[str, str | None]
    entries: Mapping[str, Entry]

    def __post_init__(self) -> None:
        object.__setattr__(self, "provenance",
                           types.MappingProxyType({**dict.fromkeys(PROVENANCE_KEYS), **self.provenance}))
        object.__setattr__(self, "entries", types.MappingProxyType(dict(self.entries)))

    @classmethod
    def empty(cls, gpu: str, template_hash: str, provenance: Mapping[str, str | None]) -> "Table":
        return cls(gpu, template_hash, provenance, {})

    def with_entries(self, *entries: Entry) -> "Table":
        """A copy with these entries added (an entry for the same key replaces the old one)."""
        return dataclasses.replace(self, entries={**self.entries, **{e.key.slug: e for e in entries}})

    def get(self, key: ProblemKey | str) -> Entry | None:
        """The entry for a ProblemKey (or slug), or None when the key was not tuned."""
        return self.entries.get(key.slug if isinstance(key, ProblemKey) else key)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA_NAME, "version": SCHEMA_VERSION, "gpu": self.gpu, "template_hash": self.template_hash,
                "provenance": dict(self.provenance),
                "entries": {slug: self.entries[slug].to_dict() for slug in sorted(self.entries)}}

    def to_json(self) -> str:
        """The file text: indent=1, entries sorted by slug, trailing newline; NaN/inf are refused."""
        return json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "Table":
        if not isinstance(data, dict):
            raise _fail(where, "<top level>", data, "a JSON object (a tuned table)")
        if data.get("schema") != SCHEMA_NAME:
            raise _fail(where, "schema", data.get("schema"), f"{SCHEMA_NAME!r}; this is not a tuned table")
        if type(data.get("version")) is not int or data["version"] != SCHEMA_VERSION:
            raise _fail(where, "version", data.get("version"),
                        f"{SCHEMA_VERSION}, the only version this autoflash reads")
        d = _object(where, "<top level>", data, _TABLE_KEYS)
        gpu = _str(where, "gpu", d["gpu"])
        template_hash = _str(where, "template_hash", d["template_hash"])
        prov = _object(where, "provenance", d["provenance"], PROVENANCE_KEYS)
        for k in PROVENANCE_KEYS:
            _str(where, f"provenance.{k}", prov[k], nullable=True)
        if prov["backend"] not in BACKENDS:
            raise _fail(where, "provenance.backend", prov["backend"], f"one of {list(BACKENDS)}")
        if not isinstance(d["entries"], dict):
            raise _fail(where, "entries", d["entries"], "a JSON object mapping problem-key slugs to entries")
        entries = {slug: Entry.from_dict(e, where, at=f"entries[{slug!r}]", slug=slug, gpu=gpu)
                   for slug, e in d["entries"].items()}
        return cls(gpu, template_hash, prov, entries)


def table_path(directory: str | os.PathLike, gpu: str) -> Path:
    """Where a GPU profile's table lives: `<directory>/<gpu>.json`."""
    return Path(directory) / f"{gpu}.json"


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict[str, Any] = {}
    for k, v in pairs:
        if k in seen:
            raise ValueError(f"duplicate key {k!r} in one JSON object")
        seen[k] = v
    return seen


def load_table(path: str | os.PathLike, *, gpu: str | None = None, template_hash: str | None = None) -> Table:
    """Read and fully validate a table; with `gpu` / `template_hash`, also require those to match."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise TableError(f"{path}: got invalid JSON ({e.msg} at line {e.lineno} column {e.colno}), "
                         f"expected a tuned table written by the tuner") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TableError(f"{path}: cannot read it ({e}); expected a UTF-8 JSON tuned table") from None
    table = Table.from_dict(data, str(path))
    if gpu is not None and table.gpu != gpu:
        raise TableError(f"{path}: table for {table.gpu!r}, expected {gpu!r}")
    if template_hash is not None and table.template_hash != template_hash:
        raise TableError(f"{path}: measured with templates {table.template_hash}, the installed templates are "
                         f"{template_hash}; its timings no longer describe these kernels: re-run the tuner")
    return table


@dataclasses.dataclass(frozen=True)
class MergeReport:
    """What `merge_into` did: slugs added, updated (replaced) and kept, and the backup of a stale table."""

    path: Path
    added: tuple[str, ...]
    updated: tuple[str, ...]
    kept: tuple[str, ...]
    replaced_stale: Path | None


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _backup_path(path: Path, old_hash: str) -> Path:
    candidate, n = path.with_name(f"{path.stem}.{old_hash[:12]}.json"), 1
    while candidate.exists():  # never overwrite an earlier backup
        n += 1
        candidate = path.with_name(f"{path.stem}.{old_hash[:12]}.{n}.json")
    return candidate


def merge_into(path: str | os.PathLike, new: Table) -> MergeReport:
    """Merge `new` into the table at `path` under a file lock, writing atomically.

    Same slug: the new entry wins; other existing entries are kept; provenance becomes new's. An existing
    table measured with other templates is kept as `<stem>.<oldhash[:12]>.json` and `new` written alone.
    An existing file for another GPU, or one that does not validate, raises TableError and is left as is.
    """
    path = Path(path)
    text = Table.from_dict(new.to_dict(), "<table to merge>").to_json()  # validate before touching anything
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise TableError(f"{path}: could not lock {path}.lock within {LOCK_TIMEOUT_S:.0f} s; expected another "
                         f"tuner to release it (if none is running, delete the lock file)") from None
    try:
        if not path.exists():
            _write_atomic(path, text)
            return MergeReport(path, tuple(sorted(new.entries)), (), (), None)
        try:
            old = load_table(path)
        except TableError as e:
            raise TableError(f"{e}\n(left untouched; move {path} away, or fix it, and merge again)") from None
        if old.gpu != new.gpu:
            raise TableError(f"{path}: table for {old.gpu!r}, expected {new.gpu!r} (the table being merged); "
                             f"left untouched")
        if old.template_hash != new.template_hash:
            backup = _backup_path(path, old.template_hash)
            shutil.copy2(path, backup)
            _write_atomic(path, text)
            return MergeReport(path, tuple(sorted(new.entries)), (), (), backup)
        merged = dataclasses.replace(new, entries={**old.entries, **new.entries})
        _write_atomic(path, merged.to_json())
        return MergeReport(path, tuple(sorted(set(new.entries) - set(old.entries))),
                           tuple(sorted(set(new.entries) & set(old.entries))),
                           tuple(sorted(set(old.entries) - set(new.entries))), None)
    finally:
        lock.release()
