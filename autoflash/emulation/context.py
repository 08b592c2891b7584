"""`autoflash.emulate(gpu=...)` and AUTOFLASH_EMULATE: which GPU, if any, CPU tensors are emulated as.

Inside `with autoflash.emulate("a100"):` every kernel entry point takes CPU tensors and runs the
kernels that GPU would run (same selection: user table, shipped table, built-in defaults) on the
host emulator. AUTOFLASH_EMULATE=a100 does the same for a whole program; AUTOFLASH_EMULATE=a100:sanitize
also turns the sanitizer on. Both are process-wide (threads see the same emulated GPU)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

from autoflash.kernels.gpus import GpuProfile, get_profile

ENV = "AUTOFLASH_EMULATE"


# The orders the emulator may run a block's threads in (cuda/runtime/state.h Sched): "default",
# "wake" (an mbarrier's waiters woken as soon as their phase completes, TMA loads landing as soon as
# issued), "released-first" (threads a barrier released run before the others), "random:SEED".
SCHEDULES = ("default", "wake", "released-first")


def schedule_code(schedule: str) -> tuple[int, int]:
    """(the runtime's Sched value, seed) of a schedule name; ValueError naming what is accepted."""
    if schedule in SCHEDULES:
        return SCHEDULES.index(schedule), 0
    kind, _, seed = schedule.partition(":")
    if kind == "random" and seed.isdigit():
        return 3, int(seed)
    raise ValueError(f"schedule: got {schedule!r}, expected one of {', '.join(SCHEDULES)} or 'random:SEED' "
                     f"(SEED a non-negative integer)")


@dataclasses.dataclass(frozen=True)
class Emulation:
    profile: GpuProfile
    sanitize: bool = False
    schedule: str = "default"

    @property
    def gpu(self) -> str:
        return self.profile.name


_stack: list[Emulation] = []


@contextlib.contextmanager
def emulate(gpu: str = "a100", *, sanitize: bool = False, schedule: str = "default"):
    """A context manager: inside `with autoflash.emulate("a100"):` every kernel entry point runs the
    kernels of `gpu` (a profile name: "a100", "h100", "l4", ...) on CPU tensors, on the host
    emulator. With sanitize=True kernels are built with the sanitizer (races, out-of-bounds,
    misaligned and uninitialized accesses, barrier errors; see autoflash.emulation.findings()).
    `schedule` is the order the emulator runs each block's threads in (SCHEDULES, or "random:SEED"):
    the sanitizer's order rules hold in any, but which named-barrier groups form, when a waiter sees
    its phase and when a TMA load lands differ between them.
    The environment variable AUTOFLASH_EMULATE=a100 (or a100:sanitize) does the same for a whole
    program; an emulate() block takes precedence over it."""
    if not isinstance(sanitize, bool):
        raise TypeError(f"sanitize: got {sanitize!r}, expected a bool")
    if not isinstance(schedule, str):
        raise TypeError(f"schedule: got {schedule!r}, expected a str such as 'default' or 'random:7'")
    schedule_code(schedule)
    state = Emulation(get_profile(gpu), sanitize, schedule)
    _stack.append(state)
    try:
        yield state
    finally:
        _stack.remove(state)


@functools.lru_cache(maxsize=8)
def _from_env(value: str) -> Emulation | None:
    from autoflash.kernels.gpus import PROFILES

    gpu, _, flag = value.partition(":")
    expected = f"expected a GPU profile name {sorted(PROFILES)}, optionally followed by ':sanitize' (or 0: off)"
    if flag not in ("", "sanitize"):
        raise ValueError(f"{ENV}: got {value!r}, {expected}")
    try:
        profile = get_profile(gpu)
    except ValueError:  # name the variable the value came from, not the lookup
        raise ValueError(f"{ENV}: got {value!r}, {expected}") from None
    return Emulation(profile, flag == "sanitize")


def active() -> Emulation | None:
    """The innermost emulate() in force, else AUTOFLASH_EMULATE's, else None."""
    if _stack:
        return _stack[-1]
    value = os.environ.get(ENV, "").strip()
    return _from_env(value) if value and value != "0" else None
