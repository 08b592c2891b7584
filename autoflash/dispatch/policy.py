"""The fallback policy every entry point shares: a call the autoflash kernels do not run says so.

Where a call cannot run on the kernels, the entry point either runs something else (torch SDPA for
autoflash.attention, the PyTorch reference for the flash-attn API on CPU tensors outside
autoflash.emulate()) and gives one FallbackWarning per reason per process, or, in strict mode
(`strict=True`, or AUTOFLASH_STRICT=1 where the call takes no `strict`), raises
UnsupportedCallError with the same reason. The low-level launchers (flash_forward, flash_backward,
flash_attn) never substitute anything: they raise. The README's "What runs where" table is the
user-facing summary of this module.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

STRICT_ENV = "AUTOFLASH_STRICT"
SDPA = "torch SDPA"
REFERENCE = "the PyTorch reference (fp32 on the CPU: slow, no kernel)"
CPU_REASON = ("CPU tensors outside autoflash.emulate(): the kernels run on CUDA GPUs, or on the CPU inside "
              "`with autoflash.emulate(\"a100\"):` (or AUTOFLASH_EMULATE=a100)")


class UnsupportedCallError(ValueError):
    """Raised in strict mode for a call the kernels cannot run (instead of falling back)."""


class FallbackWarning(RuntimeWarning):
    """A call ran something other than the autoflash kernels; given once per reason per process."""


_warned: set[tuple[str, str]] = set()  # (what ran instead, reason) already warned about


def is_strict(strict: bool | None) -> bool:
    """`strict` as given, or AUTOFLASH_STRICT (1/true/yes/on) when it is None."""
    if strict is None:
        return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    if not isinstance(strict, bool):
        raise TypeError(f"strict: got {strict!r}, expected a bool or None ({STRICT_ENV})")
    return strict


@torch.compiler.assume_constant_result
def warn_once(reason: str, instead: str = SDPA, explain: str = "autoflash.explain(...)") -> bool:
    """One FallbackWarning per (what ran instead, reason) per process (under torch.compile: once, at
    trace time)."""
    if (instead, reason) not in _warned:
        _warned.add((instead, reason))
        warnings.warn(f"autoflash: running {instead} instead of the autoflash kernels: {reason} "
                      f"(strict=True or {STRICT_ENV}=1 raises instead; {explain} shows the path)",
                      FallbackWarning, stacklevel=_caller_level())
    return True


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _caller_level() -> int:
    """The stacklevel, for warn_once's warnings.warn, of the first frame outside the autoflash package:
    the line of the user's code that made the call, however deep the entry point runs."""
    frame, level = sys._getframe(1), 1  # warn_once's frame is level 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def fall_back(entry: str, reason: str, strict: bool | None, instead: str = SDPA,
              explain: str = "autoflash.explain(...)") -> None:
    """The policy for one call that will not run on the kernels: raise UnsupportedCallError in strict
    mode, else warn once per reason. `entry` names the function the user called."""
    if is_strict(strict):
        raise UnsupportedCallError(f"{entry} (strict): {reason}; without strict this call would run {instead}")
    warn_once(reason, instead, explain)


def cpu_fallback(t: torch.Tensor) -> str | None:
    """Why a call on `t` would not run the kernels (CPU tensors outside autoflash.emulate()), or None."""
    return CPU_REASON if t.device.type == "cpu" and not emulating() else None


@torch.compiler.assume_constant_result
def emulating() -> bool:
    """Whether CPU tensors run the kernels on the host emulator now (autoflash.emulate / AUTOFLASH_EMULATE);
    a constant for torch.compile (read at trace time)."""
    from autoflash.emulation import active

    return active() is not None
