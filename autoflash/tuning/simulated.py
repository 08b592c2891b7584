"""The simulated backend: stands in for a GPU so the whole tuning loop (workers, study, tables) runs
in CI. Times come from recorded GPU timings (a file the tuner writes with --record-timings) or from
a deterministic cost model; faults (crash, hang, wrong result, launch error) are injected by config
name, so fault isolation is tested with real process deaths and real timeouts.

The cost model is a plausibility model, not a prediction: FLOPs over the profile's peak, scaled by
tile reuse, occupancy (shared memory, registers, threads), wave quantisation and pipelining, with a
+-4% deterministic jitter per (config, shape). It gives the search a landscape with the features a
real GPU has (smooth regions, cliffs at occupancy steps) and is never written to tuned/."""
from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import os
import time
from pathlib import Path

from autoflash.bench.report import flops
from autoflash.kernels.config import KernelConfig
from autoflash.kernels.gpus import GpuProfile, get_profile
from autoflash.tuning.problem import ProblemKey, Shape

TIMINGS_FORMAT, TIMINGS_VERSION = "autoflash.timings", 1
FAULT_KINDS = ("crash", "hang", "wrong", "error")
LAUNCH_US = 4.0  # fixed cost of one launch, microseconds


def _jitter(*parts: object) -> float:
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 * 2 - 1  # uniform in [-1, 1)


def model_ms(config: KernelConfig, shape: Shape, profile: GpuProfile, registers: int | None = None) -> float:
    """Modelled milliseconds of one call of `config` on `shape` (seqlen_q == seqlen_k)."""
    from autoflash.tuning.space import accumulator_registers

    work = flops(shape.batch, shape.heads, shape.seqlen, shape.seqlen, shape.head_dim, config.causal,
                 config.direction)
    peak = (profile.peak_tflops_bf16 or 100.0) * 1e12
    if not config.tensor_cores:
        peak /= 16  # SIMT fp32 FMA against tensor cores
    regs = registers or min(255, (accumulator_registers(config) or 64) + 64)
    per_sm = max(1, min(profile.smem_per_sm // max(config.smem_bytes, 1),
                        profile.regs_per_sm // (regs * config.threads),
                        profile.max_threads_per_sm // config.threads, 32))
    rows, streamed = ((config.block_n, config.block_m) if config.direction == "bwd"
                      else (config.block_m, config.block_n))
    blocks = math.ceil(shape.seqlen / rows) * shape.batch * shape.heads * config.head_split
    slots = profile.sm_count * per_sm
    waves = math.ceil(blocks / slots)
    e_wave = blocks / (waves * slots)
    e_tile = rows * streamed / (rows * streamed + 24 * (rows + streamed))  # loads amortised over MMAs
    e_occ = min(1.0, per_sm * config.num_warps / 12) ** 0.35  # latency hiding by resident warps
    e_pipe = {1: 0.82, 2: 1.0, 3: 1.02 if per_sm > 1 else 0.96}.get(config.num_stages, 1.0)
    e_split = 1 / (1 + 0.08 * (config.head_split - 1))  # S and dP recomputed per head-dim slice
    e_causal = 1 / (1 + rows / (2 * shape.seqlen)) if config.causal else 1.0  # half-masked diagonal tiles
    eff = 0.75 * e_tile * e_occ * e_wave * e_pipe * e_split * e_causal
    ms = work / (peak * eff) * 1e3
    return ms * (1 + 0.04 * _jitter(config.name, shape)) + LAUNCH_US * 1e-3


def sdpa_model_ms(key: ProblemKey, shape: Shape, profile: GpuProfile) -> float:
    """A stand-in for SDPA-flash: the built-in default's modelled time, 5% faster."""
    from autoflash.tuning.space import default_for

    return 0.95 * model_ms(default_for(key, profile), shape, profile)


def load_timings(path: str | os.PathLike) -> dict:
    """A recorded-timings file: {"format", "version", "gpu", "timings": {slug: {config name: [ms per
    shape]}}, "sdpa_flash": {slug: [ms per shape]}}. Raises ValueError naming the file on a bad one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"recorded timings {path}: cannot read ({e})") from None
    if not isinstance(data, dict) or data.get("format") != TIMINGS_FORMAT or data.get("version") != TIMINGS_VERSION:
        raise ValueError(f"recorded timings {path}: got format {data.get('format') if isinstance(data, dict) else data!r}"
                         f" version {data.get('version') if isinstance(data, dict) else None!r}, "
                         f"expected {TIMINGS_FORMAT!r} version {TIMINGS_VERSION}")
    for slug, per in data.get("timings", {}).items():
        for name, ms in per.items():
            if not (isinstance(ms, list) and ms and all(isinstance(x, (int, float)) and x > 0 for x in ms)):
                raise ValueError(f"recorded timings {path}: timings[{slug!r}][{name!r}] got {ms!r}, "
                                 f"expected a list of positive milliseconds")
    return data


class SimulatedBackend:
    """What a worker process runs instead of the GPU. Options (all JSON-able, from the parent):
    gpu: profile name; timings: path of recorded timings (else the cost model); faults: {kind:
    [config-name globs]} with kinds crash (abort the process), hang (sleep forever), wrong (a result
    over the error bound), error (a launch failure); delay: seconds per measurement; log: a JSONL
    file receiving one line per measurement started and finished (tests count evaluations)."""

    def __init__(self, gpu: str, timings: str | None = None, faults: dict | None = None, delay: float = 0.0,
                 log: str | None = None):
        self.profile = get_profile(gpu)
        self.timings = load_timings(timings) if timings else None
        self.faults = {kind: list(pats) for kind, pats in (faults or {}).items()}
        unknown = sorted(set(self.faults) - set(FAULT_KINDS))
        if unknown:
            raise ValueError(f"faults: got kinds {unknown}, expected some of {FAULT_KINDS}")
        self.delay, self.log = float(delay), log

    def describe(self) -> dict:
        return {"device_name": f"simulated {self.profile.description}",
                "compute_capability": "{}.{}".format(*self.profile.compute_capability), "profile": self.profile.name,
                "driver": None, "cuda": None, "torch": None, "cupy": None}

    def _log(self, **fields) -> None:
        if self.log:
            with open(self.log, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "time": time.time(), **fields}) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def _fault(self, name: str) -> str | None:
        return next((k for k in FAULT_KINDS for pat in self.faults.get(k, ()) if fnmatch.fnmatchcase(name, pat)),
                    None)

    def measure(self, key: ProblemKey, config: KernelConfig, shapes: list[Shape], registers: int | None,
                trial: int | None = None, reps: int = 20, warmup: int = 3) -> dict:
        """The protocol's measure; reps and warmup only matter on a GPU."""
        self._log(event="start", trial=trial, key=key.slug, config=config.name)
        if self.delay:
            time.sleep(self.delay)
        fault = self._fault(config.name)
        if fault == "crash":
            os.abort()  # what an illegal address does to a CUDA process: the context is gone
        if fault == "hang":
            while True:
                time.sleep(3600)
        if fault == "error":
            raise RuntimeError(f"simulated launch failure of {config.name}")
        if fault == "wrong":
            result = {"status": "wrong", "reason": "out: max error 0.5 > bound 0.0123", "err": 0.5, "bound": 0.0123}
        elif self.timings is not None:
            ms = self.timings.get("timings", {}).get(key.slug, {}).get(config.name)
            if ms is None or len(ms) != len(shapes):
                raise RuntimeError(f"no recorded timing for {config.name} on {key.slug} "
                                   f"({len(shapes)} shapes) in the timings file")
            result = {"status": "ok", "ms": list(ms), "err": 0.0, "bound": 0.0}
        else:
            result = {"status": "ok", "ms": [model_ms(config, s, self.profile, registers) for s in shapes],
                      "err": 0.0, "bound": 0.0}
        self._log(event="end", trial=trial, key=key.slug, config=config.name, status=result["status"])
        return result

    def baseline(self, key: ProblemKey, shapes: list[Shape], reps: int = 20, warmup: int = 3) -> dict:
        if self.timings is not None:
            ms = self.timings.get("sdpa_flash", {}).get(key.slug)
            if ms is None:
                return {"status": "unsupported", "reason": "no recorded SDPA-flash timing"}
            return {"status": "ok", "ms": list(ms)}
        return {"status": "ok", "ms": [sdpa_model_ms(key, s, self.profile) for s in shapes]}
