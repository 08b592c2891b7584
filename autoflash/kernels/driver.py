"""The machine's CUDA driver against the CUDA stack autoflash uses (NVRTC, which makes the cubins, and
CuPy, which loads and launches them): checked before a call is routed to the kernels, so a CUDA 12
driver beside autoflash's CUDA 13 stack gives one clear message (and autoflash.attention its SDPA
fallback) instead of an opaque error from inside CuPy at the first launch.

The rule: a cubin built by a CUDA X.y toolkit (NVRTC X.y) loads on a driver of CUDA X.0 or newer
(CUDA's minor version compatibility covers cubins; only PTX needs the newer minor driver), and never
on an older major: CUDA Compatibility guide, "Minor Version Compatibility" (the drivers each stack
needs, and its install line: autoflash.kernels.compiler.STACKS)."""
from __future__ import annotations

import ctypes
import functools
import sys

from autoflash.kernels.compiler import STACKS, install_hint


class DriverMismatchError(RuntimeError):
    """The CUDA driver is older than the CUDA stack autoflash compiles and launches with."""


@functools.lru_cache(maxsize=1)
def cuda_driver_version() -> tuple[int, int] | None:
    """(major, minor) of the CUDA version the installed driver supports (what nvidia-smi prints as
    "CUDA Version"), from the driver API's cuDriverGetVersion; None when no driver library loads."""
    try:
        lib = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return version.value // 1000, version.value % 1000 // 10


@functools.lru_cache(maxsize=1)
def driver_release() -> str | None:
    """The driver's release, e.g. "550.54.15", from NVML (shipped with the driver); None without it."""
    try:
        nvml = ctypes.CDLL("nvml.dll" if sys.platform == "win32" else "libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        buf = ctypes.create_string_buffer(96)
        ok = nvml.nvmlSystemGetDriverVersion(buf, len(buf)) == 0
        nvml.nvmlShutdown()
        return buf.value.decode() if ok else None
    except (OSError, AttributeError):
        return None


def cupy_cuda_major() -> int | None:
    """The CUDA major CuPy's runtime was built for (cupy-cuda12x: 12), None if CuPy cannot say."""
    try:
        import cupy

        return cupy.cuda.runtime.runtimeGetVersion() // 1000
    except Exception:  # no CuPy, or one that cannot even report its build: the launch will say why
        return None


def mismatch(driver: tuple[int, int] | None, nvrtc: str, cupy_major: int | None, release: str | None = None) -> str | None:
    """Why a driver supporting CUDA `driver` cannot run autoflash's kernels built by NVRTC `nvrtc`
    ("13.0") and launched by CuPy for CUDA `cupy_major`, with the install line that fixes it; None
    when it can (or the driver's version is unknown: the launch itself will tell)."""
    if driver is None:
        return None
    nvrtc_major = int(nvrtc.split(".")[0])
    late = [(f"NVRTC {nvrtc}", nvrtc_major)] if nvrtc_major > driver[0] else []
    if cupy_major is not None and cupy_major > driver[0]:
        late.append((f"CuPy for CUDA {cupy_major} (cupy-cuda{cupy_major}x)", cupy_major))
    if not late:
        return None
    needed = max(major for _, major in late)
    shown = f"CUDA {driver[0]}.{driver[1]}" + (f" (driver {release})" if release else "")
    stack, newer = STACKS.get(driver[0]), STACKS.get(needed)
    if stack is not None:
        fix = f"install autoflash's CUDA {driver[0]} stack with `{stack.install}`" + (
            f", or update the driver to {newer.driver}" if newer is not None else "")
    else:  # older than every stack autoflash has
        fix = f"update the driver and install the stack that matches it ({install_hint()})"
    return (f"the NVIDIA driver supports {shown}, older than the {' and '.join(w for w, _ in late)} autoflash "
            f"uses, whose kernels need a CUDA {needed} driver: {fix}")


def check_driver() -> None:
    """Raises DriverMismatchError (see mismatch) when this machine's driver cannot run the kernels."""
    from autoflash.kernels.compiler import nvrtc_version

    driver = cuda_driver_version()
    reason = mismatch(driver, nvrtc_version(), cupy_cuda_major(), driver_release() if driver else None)
    if reason:
        raise DriverMismatchError(reason)
