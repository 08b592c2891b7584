"""The simulated backend: stands in for a GPU so the whole tuning loop (workers, study, tables) runs
in CI. Times come from recorded GPU timings (a file the tuner writes with --record-timings) or from
a deterministic cost model; faults (crash, hang, wrong result, launch error) are injected by config
name, so fault isolation is tested with real process deaths and real timeouts.

The cost model is a plausibility model, not a prediction: FLOPs over the profile's peak, scaled by
tile reuse, occupancy (shared memory, registers, threads), wave quantisation and pipelining, with a
+-4% deterministic jitter per (config, shape). It gives the search a landscape with the features a
real GPU has (smooth regions, cliffs at occupancy steps) and is never written to tuned/. Variant keys
run their Workload: a window visits fewer key tiles per query block (and wastes more at its edges
with wide tiles), packed sequences pay for partial last tiles and idle blocks; both roughly.

SDPA-flash has no sliding window and takes packed sequences only as nested tensors, which the tuner
does not time: its baseline is "unsupported" for variant keys here as on a GPU. Decode keys (their
points: a KV-cache config and num_splits) take simulated_decode's memory-bound model, and SDPA's
time on the same caches."""
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
from autoflash.tuning.problem import SDPA_UNSUPPORTED, ProblemKey, Shape, Workload

TIMINGS_FORMAT, TIMINGS_VERSION = "autoflash.timings", 1
FAULT_KINDS = ("crash", "hang", "wrong", "error")
LAUNCH_US = 4.0  # fixed cost of one launch, microseconds
IDLE_WAVE_US = 2.0  # a wave of blocks past their sequence's end: read cu_seqlens, exit
VARIANT_REGISTERS = 8  # band limits, sequence offsets: what variant switches add a thread (a guess)


def _jitter(*parts: object) -> float:
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 * 2 - 1  # uniform in [-1, 1)


def _mask_efficiency(config: KernelConfig, workload: Workload, rows: int, streamed: int) -> float:
    """The useful share of the tiles visited, over a workload's sequences (weighted by their work).

    Causal: the half-masked diagonal tiles, 1 / (1 + rows / (2 L)). Window (left, 0): a band has two
    masked edges (its diagonal and its left end) around left + 1 useful keys a row, each edge
    charged as the causal diagonal is, and a wide tile of keys overshoots the band:
    (left + 1) / (left + 1 + (rows + streamed) / 2). Packed sequences also compute whole tiles
    past each sequence's end: L^2 over the rounded-up rows x keys. Rough on purpose: the ranking
    needs the direction of each effect, not its size."""
    left = workload.window[0]

    def one(length: int) -> float:
        if left >= 0:
            e = (min(left, length - 1) + 1) / (min(left, length - 1) + 1 + (rows + streamed) / 2)
        elif workload.causal:
            e = 1 / (1 + rows / (2 * length))
        else:
            e = 1.0
        if workload.packed:
            e *= length * length / (math.ceil(length / rows) * rows * math.ceil(length / streamed) * streamed)
        return e

    if not workload.packed:  # every sequence alike: one length
        return one(workload.max_seqlen)
    work = [workload.pairs(n) for n in workload.lengths]
    return math.fsum(work) / math.fsum(w / one(n) for w, n in zip(work, workload.lengths))


def estimated_registers(config: KernelConfig) -> int:
    """Registers a thread, when no compile says: the accumulators plus 64 for addresses, softmax
    state and fragments, plus VARIANT_REGISTERS for a kernel carrying variant switches."""
    from autoflash.tuning.space import accumulator_registers

    extra = VARIANT_REGISTERS if config.variants or config.align != "top_left" else 0
    return min(255, (accumulator_registers(config) or 64) + 64 + extra)


def model_ms(config: KernelConfig, shape: Shape, profile: GpuProfile, registers: int | None = None,
             workload: Workload | None = None) -> float:
    """Modelled milliseconds of one call of `config` on `shape` (seqlen_q == seqlen_k), run as
    `workload` (ProblemKey.workload; default: dense, causal as the config): FLOPs of the pairs
    attended, and for packed sequences the blocks each sequence needs, plus a short wave of idle
    blocks past the shorter sequences' ends."""
    w = workload or Workload.dense(shape, config.causal)
    work = flops(1, w.heads, 1, 1, w.head_dim, False, config.direction) * w.total_pairs()
    peak = (profile.peak_tflops_bf16 or 100.0) * 1e12
    if not config.tensor_cores:
        peak /= 16  # SIMT fp32 FMA against tensor cores
    regs = registers or estimated_registers(config)
    per_sm = max(1, min(profile.smem_per_sm // max(config.smem_bytes, 1),
                        profile.regs_per_sm // (regs * config.threads),
                        profile.max_threads_per_sm // config.threads, 32))
    rows, streamed = ((config.block_n, config.block_m) if config.direction == "bwd"
                      else (config.block_m, config.block_n))
    per_head = w.heads * config.head_split
    blocks = sum(math.ceil(n / rows) for n in w.lengths) * per_head
    idle = len(w.lengths) * math.ceil(w.max_seqlen / rows) * per_head - blocks
    slots = profile.sm_count * per_sm
    waves = math.ceil(blocks / slots)
    e_wave = blocks / (waves * slots)
    e_tile = rows * streamed / (rows * streamed + 24 * (rows + streamed))  # loads amortised over MMAs
    e_occ = min(1.0, per_sm * config.num_warps / 12) ** 0.35  # latency hiding by resident warps
    e_pipe = {1: 0.82, 2: 1.0, 3: 1.02 if per_sm > 1 else 0.96}.get(config.num_stages, 1.0)
    e_split = 1 / (1 + 0.08 * (config.head_split - 1))  # S and dP recomputed per head-dim slice
    e_mask = _mask_efficiency(config, w, rows, streamed)
    eff = 0.75 * e_tile * e_occ * e_wave * e_pipe * e_split * e_mask
    ms = work / (peak * eff) * 1e3 + math.ceil(idle / slots) * IDLE_WAVE_US * 1e-3
    return ms * (1 + 0.04 * _jitter(config.name, shape)) + LAUNCH_US * 1e-3


def sdpa_model_ms(key: ProblemKey, shape: Shape, profile: GpuProfile) -> float:
    """A stand-in for SDPA-flash: the built-in default's modelled time, 5% faster (plain keys)."""
    from autoflash.tuning.space import default_for

    return 0.95 * model_ms(default_for(key, profile), shape, profile, workload=key.workload(shape))


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
        elif key.is_decode and self.timings is None:
            from autoflash.tuning.simulated_decode import decode_model_ms

            result = {"status": "ok", "err": 0.0, "bound": 0.0,
                      "ms": [decode_model_ms(config.config, config.num_splits, key.decode_workload(s), self.profile,
                                             registers, _jitter(config.name, s)) for s in shapes]}
        elif self.timings is not None:
            ms = self.timings.get("timings", {}).get(key.slug, {}).get(config.name)
            if ms is None or len(ms) != len(shapes):
                raise RuntimeError(f"no recorded timing for {config.name} on {key.slug} "
                                   f"({len(shapes)} shapes) in the timings file")
            result = {"status": "ok", "ms": list(ms), "err": 0.0, "bound": 0.0}
        else:
            result = {"status": "ok", "err": 0.0, "bound": 0.0,
                      "ms": [model_ms(config, s, self.profile, registers, key.workload(s)) for s in shapes]}
        self._log(event="end", trial=trial, key=key.slug, config=config.name, status=result["status"])
        return result

    def baseline(self, key: ProblemKey, shapes: list[Shape], reps: int = 20, warmup: int = 3) -> dict:
        if key.is_decode and self.timings is None:
            from autoflash.tuning.simulated_decode import sdpa_decode_model_ms
            from autoflash.tuning.space import default_for

            default = default_for(key, self.profile).config
            return {"status": "ok", "ms": [sdpa_decode_model_ms(default, key.decode_workload(s), self.profile)
                                          for s in shapes]}
        if key.variant not in ("plain", "decode"):
            return {"status": "unsupported", "reason": SDPA_UNSUPPORTED[key.variant]}
        if self.timings is not None:
            ms = self.timings.get("sdpa_flash", {}).get(key.slug)
            if ms is None:
                return {"status": "unsupported", "reason": "no recorded SDPA-flash timing"}
            return {"status": "ok", "ms": list(ms)}
        return {"status": "ok", "ms": [sdpa_model_ms(key, s, self.profile) for s in shapes]}
