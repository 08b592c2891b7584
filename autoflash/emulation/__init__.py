"""The host emulator: the generated kernels run on the CPU, from the very source NVRTC compiles, over
their real grid (cuda/runtime.cpp: a fiber per CUDA thread, warp-collective ldmatrix / mma.sync /
shuffles, cp.async that lands at wait_group), optionally with a sanitizer for races, out-of-bounds,
misaligned and uninitialized accesses and barrier errors (the launchers' own buffers carry guard bands
then: guards.py); a launch the emulated GPU would refuse raises LaunchRefused. Entry points:
`autoflash.emulate()`, AUTOFLASH_EMULATE, `python -m autoflash.selfcheck --emulate GPU [--sanitize]`."""
from __future__ import annotations

from autoflash.emulation.build import EmulationError
from autoflash.emulation.context import ENV, Emulation, active, emulate
from autoflash.emulation.limits import LaunchRefused

__all__ = ["ENV", "Emulation", "EmulationError", "Finding", "LaunchRefused", "active", "clear_findings", "emulate",
           "findings"]


def __getattr__(name: str):
    if name == "Finding":  # module.py loads numpy and ctypes: only when asked for
        from autoflash.emulation import module

        return getattr(module, name)
    raise AttributeError(f"module 'autoflash.emulation' has no attribute {name!r}")


def findings() -> list:
    """Every sanitizer finding of the kernels run so far in this process (autoflash.emulation.Finding)."""
    from autoflash.emulation.module import loaded_modules

    return [f for (_, sanitize), m in loaded_modules() if sanitize for f in m.findings()]


def clear_findings() -> None:
    from autoflash.emulation.module import loaded_modules

    for _, m in loaded_modules():
        m.clear_findings()
