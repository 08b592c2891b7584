"""Fault-isolated measurement: every measurement runs in a worker subprocess, spoken to in JSON lines
over its stdin/stdout. An illegal address, a launch failure or a hang (no answer within the timeout)
costs only that worker: the parent records why, kills it if needed and starts a fresh one.

    python -m autoflash.tuning.worker     # started by WorkerPool, not by hand

Protocol: the first line is {"op": "init", "backend": "cuda" | "simulated", "options": {...}}, answered
{"status": "ready", "device": {...}} or {"status": "error", "reason"}; then {"op": "measure", "key",
"config", "shapes", "registers", "trial", "reps", "warmup"} (and "num_splits" for a decode key) and {"op": "baseline", "key", "shapes",
"reps", "warmup"}, each answered with one line: {"status": "ok", "ms": [...]}, {"status": "wrong",
"reason", "err", "bound"}, {"status": "unsupported", "reason"} or {"status": "error", "reason"}."""
from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from autoflash.kernels.config import KernelConfig
from autoflash.tuning.problem import ProblemKey, Shape


# ------------------------------------------------------------------ the worker process
def _backend(init: dict):
    if init.get("backend") == "simulated":
        from autoflash.tuning.simulated import SimulatedBackend

        return SimulatedBackend(**init.get("options", {}))
    if init.get("backend") == "cuda":
        from autoflash.tuning.cuda_backend import CudaBackend

        return CudaBackend(**init.get("options", {}))
    raise ValueError(f"backend: got {init.get('backend')!r}, expected 'cuda' or 'simulated'")


def _handle(backend, msg: dict) -> dict:
    key = ProblemKey(**msg["key"])
    shapes = [Shape(*s) for s in msg["shapes"]]
    timing = {k: msg[k] for k in ("reps", "warmup") if k in msg}
    if msg["op"] == "measure":
        config = KernelConfig.from_dict(msg["config"])
        if msg.get("num_splits") is not None:  # a decode key's point: the kernel and its run-time splits
            from autoflash.tuning.space import DecodePoint

            config = DecodePoint(config, msg["num_splits"])
        return backend.measure(key, config, shapes, msg.get("registers"), msg.get("trial"), **timing)
    if msg["op"] == "baseline":
        return backend.baseline(key, shapes, **timing)
    raise ValueError(f"op: got {msg.get('op')!r}, expected 'measure' or 'baseline'")


def main() -> int:
    # The protocol owns the real stdout; anything else printed (warnings, CUDA messages) goes to stderr.
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def reply(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    backend = None
    for line in sys.stdin:
        try:
            msg = json.loads(line)
            if msg.get("op") == "init":
                backend = _backend(msg)
                reply({"status": "ready", "pid": os.getpid(), "device": backend.describe()})
                continue
            if backend is None:
                raise RuntimeError("the first message must be init")
            reply(_handle(backend, msg))
        except Exception as e:  # a Python-level failure is an answer; a dead process is the parent's business
            traceback.print_exc()
            reply({"status": "error", "reason": f"{type(e).__name__}: {e}"})
    return 0


# ------------------------------------------------------------------ the parent's side
def _death_reason(code: int | None) -> str:
    if code is None:
        return "worker still running"
    if code < 0:
        try:
            return f"worker killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"worker killed by signal {-code}"
    return f"worker exited with status {code}"


class Worker:
    """One worker process. request() never raises for what happens inside the worker: a crash, a
    hang or an error comes back as {"status": "crash" | "timeout" | "error", "reason": ...}."""

    def __init__(self, init: dict, *, env: dict | None = None, init_timeout: float = 300.0, label: str = "worker"):
        self.init, self.env, self.init_timeout, self.label = init, env or {}, init_timeout, label
        self.proc: subprocess.Popen | None = None
        self.device: dict | None = None
        self.restarts = -1
        self._buf = b""
        self._log = tempfile.TemporaryFile()

    def _stderr_tail(self, since: int, limit: int = 1200) -> str:
        self._log.seek(since)
        text = self._log.read().decode(errors="replace").strip()
        return text[-limit:]

    def _readline(self, deadline: float) -> bytes | None:
        """One line from the worker, b"" at EOF, None when the deadline passes first."""
        import select

        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return b""
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._release()

    def _release(self) -> None:
        """Closes our ends of a finished process's pipes (else each restart leaks two files)."""
        if self.proc is not None:
            for pipe in (self.proc.stdin, self.proc.stdout):
                with contextlib.suppress(OSError):
                    pipe.close()

    def start(self) -> dict:
        """Starts (or restarts) the process and returns its device description; raises RuntimeError
        when the backend cannot start (no GPU, the wrong GPU): that is the user's error, not a trial's."""
        self._kill()
        self._buf, self.restarts = b"", self.restarts + 1
        self._log.seek(0, os.SEEK_END)
        since = self._log.tell()
        self.proc = subprocess.Popen([sys.executable, "-m", "autoflash.tuning.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env={**os.environ, **self.env})
        answer = self._exchange({"op": "init", **self.init}, self.init_timeout, since)
        if answer.get("status") != "ready":
            self._kill()
            raise RuntimeError(f"{self.label} could not start: {answer.get('reason')}")
        self.device = answer["device"]
        return self.device

    def _exchange(self, msg: dict, timeout: float, since: int) -> dict:
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the process is gone; reading says how
        line = self._readline(time.monotonic() + timeout)
        if line is None:
            self._kill()
            return {"status": "timeout", "reason": f"no answer within {timeout:g} s; {self.label} killed"}
        if line == b"":
            code = self.proc.wait()
            tail = self._stderr_tail(since)
            return {"status": "crash", "reason": _death_reason(code) + (f"; stderr: {tail}" if tail else "")}
        try:
            return json.loads(line)
        except ValueError:
            return {"status": "error", "reason": f"unreadable answer from {self.label}: {line[:200]!r}"}

    def request(self, msg: dict, timeout: float) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self._log.seek(0, os.SEEK_END)
        return self._exchange(msg, timeout, self._log.tell())

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._kill()
        self._release()
        self._log.close()


class WorkerPool:
    """N workers, one per visible GPU (CUDA_VISIBLE_DEVICES narrowed to one device each when N > 1)."""

    def __init__(self, init: dict, n: int = 1, *, init_timeout: float = 300.0):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"workers: got {n!r}, expected a positive int")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = [d for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(n)]
        if init.get("backend") == "cuda" and n > len(devices):
            raise ValueError(f"workers: got {n}, but CUDA_VISIBLE_DEVICES={visible} names {len(devices)} GPU(s)")
        env = (lambda i: {"CUDA_VISIBLE_DEVICES": devices[i]}) if init.get("backend") == "cuda" and n > 1 else \
            (lambda i: {})
        self.workers = [Worker(init, env=env(i), init_timeout=init_timeout, label=f"worker {i}") for i in range(n)]
        self._idle: queue.Queue[Worker] = queue.Queue()
        for w in self.workers:
            self._idle.put(w)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.workers)

    def start(self) -> dict:
        """Starts every worker; returns the first one's device description."""
        return [w.start() for w in self.workers][0]

    @contextlib.contextmanager
    def worker(self):
        w = self._idle.get()
        try:
            yield w
        finally:
            self._idle.put(w)

    def close(self) -> None:
        for w in self.workers:
            w.close()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(main())
