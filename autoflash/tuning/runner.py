"""The tuning run: problem keys -> pruned spaces (compiled, no GPU) -> one study per key measured by
the worker pool -> an Entry per key merged into the tuned table as soon as its study ends, so an
interrupted run keeps every key it finished (and the study storage keeps every trial)."""
from __future__ import annotations

import datetime
import itertools
from pathlib import Path

from autoflash.kernels.config import KernelConfig
from autoflash.kernels.gpus import PROFILES, GpuProfile
from autoflash.tuning.problem import ProblemKey, causal_label, variant_applies
from autoflash.tuning.progress import progress as progress_of
from autoflash.tuning.report import key_bandwidth, key_tflops
from autoflash.tuning.space import Candidate, DecodePoint, constrain, default_for, enumerate_space, knobs, \
    point_from_name
from autoflash.tuning.study import KeyStudy, Outcome, Settings
from autoflash.tuning.table import Entry, Result, Table, merge_into, table_path


def build_keys(gpu: str, *, directions, dtypes, head_dims, causal, buckets, variants=("plain",)) -> list[ProblemKey]:
    """Every key of the options' product that can be one (variant_applies: window keys are causal,
    fp32 has plain keys only); skipped_combinations says what was left out."""
    return [ProblemKey(gpu, dr, dt, d, c, b, v)
            for v, dr, dt, d, c, b in itertools.product(variants, directions, dtypes, head_dims, causal, buckets)
            if variant_applies(v, dt, c)]


def build_decode_keys(gpu: str, *, dtypes, head_dims, q_buckets, cache_buckets, batch_buckets,
                      paged=(False, True)) -> list[ProblemKey]:
    """Every decode key of the options' product (fp16 / bf16 only: the KV-cache kernels' dtypes)."""
    return [ProblemKey.decode(gpu, dt, d, q, c, b, p)
            for dt, d, q, p, c, b in itertools.product(dtypes, head_dims, q_buckets, paged, cache_buckets,
                                                         batch_buckets) if dt != "fp32"]


def skipped_combinations(*, dtypes, causal, variants) -> list[str]:
    """The (variant, dtype, causal) combinations of the options that make no key, described."""
    return [f"{v} {dt} {causal_label(c)}" for v, dt, c in itertools.product(variants, dtypes, causal)
            if not variant_applies(v, dt, c)]


def _group(key: ProblemKey) -> tuple:
    """Keys that share a search space (the buckets change the shapes timed, not the kernels; the
    variant and, for decode keys, paging change the kernels)."""
    return key.direction, key.dtype, key.head_dim, key.causal, key.variant, key.paged


def prepare_spaces(keys: list[ProblemKey], profile: GpuProfile, *, restrict: dict[str, tuple[int, ...]] | None = None,
                   jobs: int | None = None, progress: bool = True) -> dict[tuple, tuple[KernelConfig, list[Candidate]]]:
    """(default, candidates) per space group: the enumerated space, narrowed by `restrict` (knob ->
    allowed values; the default always stays), through the shared-memory and spill constraints."""
    groups: dict[tuple, tuple[KernelConfig, list[KernelConfig]]] = {}
    for key in keys:
        if _group(key) in groups:
            continue
        default = default_for(key, profile)
        own = knobs(key)  # a knob the key does not have (num_splits on a prefill key) restricts nothing
        configs = [c for c in enumerate_space(key, default)
                   if c == default or all(getattr(c, k) in v for k, v in (restrict or {}).items() if k in own)]
        groups[_group(key)] = default, configs
    total = sum(len(c) for _, c in groups.values())
    shown = progress_of(total, f"constraints for {profile.name} ({profile.arch})", unit="cfg", enabled=progress,
                        milestones=3)
    out, offset = {}, 0

    def step(done: int, _total: int) -> None:
        shown.update_to(offset + done)

    for group, (default, configs) in groups.items():
        out[group] = default, constrain(configs, profile, jobs=jobs, progress=step)
        offset += len(configs)
    survivors = sum(c.ok for _, candidates in out.values() for c in candidates)
    shown.close(f"{survivors} survive in {len(out)} space(s)")
    return out


def spaces_for(spaces: dict, key: ProblemKey) -> tuple[KernelConfig, list[Candidate]]:
    return spaces[_group(key)]


def _result(key: ProblemKey, trial) -> Result:
    point = point_from_name(trial.user_attrs["config"])
    splits = point.num_splits if isinstance(point, DecodePoint) else None
    return Result.of(point.config if splits is not None else point, float(trial.value),
                     key_tflops(key, float(trial.value)), trial.user_attrs.get("registers"), num_splits=splits)


def entry_from(outcome: Outcome, runner_ups: int) -> Entry | None:
    """The table entry of a finished study, or None when no config was measured successfully."""
    if not outcome.ranked:
        return None
    key = outcome.key
    return Entry(key=key, winner=_result(key, outcome.ranked[0]),
                 default=_result(key, outcome.default) if outcome.default is not None else None,
                 sdpa_flash_ms=outcome.sdpa_flash_ms,
                 runner_ups=tuple(_result(key, t) for t in outcome.ranked[1:1 + runner_ups]),
                 shapes=tuple((s.batch, s.heads, s.seqlen, s.head_dim) for s in key.shapes()),
                 evaluated=outcome.evaluated, failed=len(outcome.failed), trials=outcome.trials,
                 date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"))


def provenance(device: dict, backend: str, command: str) -> dict:
    import autoflash
    from autoflash.kernels.compiler import nvrtc_version

    return {"device_name": device.get("device_name"), "compute_capability": device.get("compute_capability"),
            "driver": device.get("driver"), "cuda": device.get("cuda"), "nvrtc": nvrtc_version(),
            "torch": device.get("torch"), "cupy": device.get("cupy"), "autoflash": autoflash.__version__,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "backend": backend,
            "command": command}


def summary_row(outcome: Outcome) -> dict:
    key, best = outcome.key, (outcome.ranked[0] if outcome.ranked else None)
    row = {"key": key.slug, "winner": None, "evaluated": outcome.evaluated, "failed": len(outcome.failed),
           "sdpa_flash_ms": outcome.sdpa_flash_ms,
           "default_ms": float(outcome.default.value) if outcome.default is not None else None}
    if best is not None:
        row.update(winner=best.user_attrs["config"], ms=float(best.value), tflops=key_tflops(key, float(best.value)))
        if key.is_decode:  # the memory-bound figure of merit, beside SDPA's
            profile = PROFILES.get(key.gpu)
            row.update(key_bandwidth(key, float(best.value), profile))
            if outcome.sdpa_flash_ms:
                row["sdpa_gb_per_s"] = key_bandwidth(key, outcome.sdpa_flash_ms, profile)["gb_per_s"]
    return row


def history(outcome_trials) -> list[tuple[int, float]]:
    """(measurement number, ms) of the measured trials, in the order they finished."""
    from autoflash.tuning.study import is_measured

    done = sorted((t for t in outcome_trials if is_measured(t)), key=lambda t: (t.datetime_complete, t.number))
    return [(i + 1, float(t.value)) for i, t in enumerate(done) if t.value is not None]


def run_keys(keys: list[ProblemKey], spaces: dict, *, pool, storage, study_prefix: str, settings: Settings,
             out_dir: Path, template_hash: str, prov: dict, progress: bool = True, log=print):
    """Tunes every key; returns (summary rows, {slug: history}, {slug: default ms})."""
    path = table_path(out_dir, keys[0].gpu)
    rows, histories, defaults = [], {}, {}
    for i, key in enumerate(keys):
        default, candidates = spaces_for(spaces, key)
        shown = progress_of(settings.budget, f"[{i + 1}/{len(keys)}] {key.label}", unit="eval", enabled=progress)

        def on_trial(frozen, ks: KeyStudy, shown=shown) -> None:
            shown.update_to(ks.evaluated())
            best = ks.outcome().ranked[:1]
            if best:
                shown.status(f"best {best[0].value:.4f} ms {best[0].user_attrs['config']}")
            if frozen.user_attrs.get("failure"):
                shown.write(f"  trial {frozen.number} {frozen.user_attrs.get('config')} failed "
                            f"({frozen.user_attrs['failure']}): {frozen.user_attrs.get('reason', '')[:300]}")

        ks = KeyStudy(key, candidates, default, storage=storage, name=f"{study_prefix}/{key}", settings=settings,
                      pool=pool, on_trial=on_trial)
        outcome = ks.run()
        rows.append(summary_row(outcome))
        shown.update_to(outcome.evaluated)
        shown.close(finished_line(rows[-1]))
        entry = entry_from(outcome, settings.runner_ups)
        if entry is not None:
            report = merge_into(path, Table(key.gpu, template_hash, prov, {}).with_entries(entry))
            if report.replaced_stale:
                log(f"note: {path} held tables for other templates; kept as {report.replaced_stale}")
        else:
            log(f"{key.gpu} {key.label}: no config was measured successfully; nothing written for this key")
        histories[key.slug] = history(ks.trials())
        defaults[key.slug] = rows[-1]["default_ms"]
    return rows, histories, defaults


def finished_line(row: dict) -> str:
    """How a key's progress ends (a summary_row): its best time and config against the default's,
    or that nothing was measured."""
    if row["winner"] is None:
        return f"no config measured successfully, {row['failed']} failed"
    versus = f" ({row['default_ms'] / row['ms']:.2f}x the default)" if row.get("default_ms") else ""
    return f"best {row['ms']:.4f} ms {row['winner']}{versus}, {row['failed']} failed"
