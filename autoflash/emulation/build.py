"""Builds rendered kernels for the host emulator with the host C++ compiler: the runtime (cuda/runtime.cpp)
once per mode, then one shared library per kernel source and mode, both cached on disk by content
hash beside the cubins (~/.cache/autoflash/emu, or $AUTOFLASH_CACHE_DIR/emu)."""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from autoflash.kernels.compiler import cache_dir
from autoflash.kernels.resources import templates_dir

HEADERS = Path(__file__).resolve().parent / "cuda"
COMMON_FLAGS = ("-std=c++20", "-fPIC", "-fvisibility=hidden", "-pthread", "-g")
# Plain builds are optimised for speed; sanitizing builds keep every call a real frame (-O0) so a
# finding's stack names the template line, and let the compiler's ThreadSanitizer instrumentation
# report every load and store, and its UndefinedBehaviorSanitizer checks (fixed-size array bounds,
# signed overflow, shifts, division by zero) report to the runtime, which defines both sets of hooks
# in place of the sanitizers' runtimes.
MODE_FLAGS = {
    False: ("-O1",),
    True: ("-O0", "-fno-omit-frame-pointer", "-fsanitize=thread",
           "-fsanitize=bounds,signed-integer-overflow,shift,integer-divide-by-zero"),
}
LINK_FLAGS = ("-shared", "-pthread", "-Wl,-Bsymbolic")
_KERNEL_FLAGS = ("-DAUTOFLASH_HOST_EMULATION", "-Winvalid-pch")
_GCC_ONLY = ("--param=tsan-instrument-func-entry-exit=0",)
_PROBE = """#include <atomic>
#include <cstdint>
int main() { float f = 0; std::atomic_ref<float>(f).fetch_add(1.f); _Float16 h = _Float16(f); return int(float(h)) - 1; }
"""


class EmulationError(RuntimeError):
    """The emulator could not build or run a kernel (no C++20 compiler, a build error, a launch that
    failed a check); the message says what and where."""


@functools.lru_cache(maxsize=1)
def compiler() -> tuple[str, str]:
    """(path, version line) of a C++20 compiler with std::atomic_ref and _Float16: $CXX, else g++,
    else clang++. Raises EmulationError naming what is missing."""
    wanted = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "clang++", "c++"]
    tried = []
    for name in wanted:
        path = shutil.which(name)
        if path is None:
            tried.append(f"{name}: not found on PATH")
            continue
        lines = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.splitlines()
        version = lines[0] if lines else name
        # A compiler that passed the probe once is remembered on disk: the probe's build costs ~0.5 s,
        # which every process using the emulator would otherwise pay before its first (cached) kernel.
        key = hashlib.sha256("\0".join([path, version, _PROBE]).encode()).hexdigest()[:16]
        passed = emu_cache_dir() / f"compiler-{key}.ok"
        if passed.exists():
            return path, version
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "probe.cpp"
            src.write_text(_PROBE)
            r = subprocess.run([path, "-std=c++20", "-pthread", str(src), "-o", str(Path(tmp) / "probe")],
                               capture_output=True, text=True)
        if r.returncode == 0:
            passed.parent.mkdir(parents=True, exist_ok=True)
            passed.touch()
            return path, version
        tried.append(f"{name} ({path}): cannot build C++20 with std::atomic_ref and _Float16: "
                     f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
    raise EmulationError(
        "autoflash's emulator builds the kernels with a host C++20 compiler (g++ >= 12 or clang++ >= 16, "
        "with std::atomic_ref and _Float16); none is usable: " + "; ".join(tried)
        + ". Install one (e.g. `apt-get install g++`) or point $CXX at it.")


def _is_gcc() -> bool:
    return "clang" not in compiler()[1].lower()


@functools.lru_cache(maxsize=1)
def headers_hash() -> str:
    h = hashlib.sha256()
    for path in sorted(HEADERS.rglob("*")):
        if path.is_file() and path.suffix in (".h", ".cuh", ".cpp"):
            h.update(path.relative_to(HEADERS).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def emu_cache_dir() -> Path:
    return cache_dir() / "emu"


def _run(cmd: list[str], what: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise EmulationError(f"building {what} for the emulator failed:\n$ {' '.join(cmd)}\n{r.stderr[-6000:]}")


def _build_atomically(target: Path, build) -> Path:
    """Runs build(tmp_path) and moves the result to `target` (parallel builders each finish safely)."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    os.close(fd)
    try:
        build(Path(tmp))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _mode_flags(sanitize: bool) -> list[str]:
    return [*COMMON_FLAGS, *MODE_FLAGS[sanitize], *(_GCC_ONLY if sanitize and _is_gcc() else ())]


def runtime_object(sanitize: bool) -> Path:
    """The runtime, compiled once per mode and compiler."""
    cxx, version = compiler()
    flags = [*COMMON_FLAGS, "-O2", f"-DEMU_SANITIZE={int(sanitize)}"]
    key = hashlib.sha256("\0".join([version, headers_hash(), *flags]).encode()).hexdigest()[:16]
    target = emu_cache_dir() / f"runtime-{'sanitize' if sanitize else 'plain'}-{key}.o"
    return _build_atomically(target, lambda out: _run(
        [cxx, *flags, "-I", str(HEADERS), "-c", str(HEADERS / "runtime.cpp"), "-o", str(out)], "the runtime"))


def prelude(sanitize: bool) -> Path:
    """The header force-included before every kernel. With GCC, a copy of prelude.h beside its
    precompiled form (prelude.h.gch, built once per mode, compiler and header set from the original,
    so debug information still names emulation/cuda/prelude.h): GCC reads it in place of parsing
    the C++ library and runtime headers again, about a third of each kernel's build. Until the .gch
    is in place, or if GCC finds it invalid, the copy is parsed as text."""
    if not _is_gcc():
        return HEADERS / "prelude.h"
    cxx, version = compiler()
    flags = [*_mode_flags(sanitize), *_KERNEL_FLAGS]
    key = hashlib.sha256("\0".join([version, headers_hash(), *flags]).encode()).hexdigest()[:16]
    header = emu_cache_dir() / f"pch-{'sanitize' if sanitize else 'plain'}-{key}" / "prelude.h"
    source = HEADERS / "prelude.h"
    _build_atomically(header, lambda out: out.write_bytes(source.read_bytes()))
    _build_atomically(header.with_name("prelude.h.gch"), lambda out: _run(
        [cxx, *flags, "-x", "c++-header", "-I", str(HEADERS), str(source), "-o", str(out)], "the prelude"))
    return header


def kernel_command(sanitize: bool) -> list[str]:
    """The compiler command a kernel source is built with, up to its `-c SRC -o OBJ`: the mode's
    flags, the prelude force-included (precompiled with GCC), the emulator's and the templates' headers."""
    return [compiler()[0], *_mode_flags(sanitize), *_KERNEL_FLAGS, "-x", "c++", "-include", str(prelude(sanitize)),
            "-I", str(HEADERS), "-I", str(templates_dir())]


def build_library(source: str, name: str, entries: tuple[str, ...], sanitize: bool) -> Path:
    """A shared library running `source` (a rendered kernel) on the emulator, exporting
    emu_entry_<e> for each kernel symbol e in `entries`. Cached by everything that changes it."""
    from autoflash.kernels.codegen import template_hash

    cxx, version = compiler()
    flags = _mode_flags(sanitize)
    text = source + '\n#line 1 "autoflash-emulator-entries"\n#include "register.h"\n' + "".join(
        f"EMU_KERNEL({e})\n" for e in entries)
    parts = [text, version, headers_hash(), template_hash(), *flags, *LINK_FLAGS]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    mode = "sanitize" if sanitize else "plain"
    target = emu_cache_dir() / f"{name}-{mode}-{key}.so"
    if target.exists():
        return target
    runtime, command = runtime_object(sanitize), kernel_command(sanitize)

    def build(out: Path) -> None:
        src, obj = out.with_suffix(".cu"), out.with_suffix(".o")
        src.write_text(text)
        try:
            _run([*command, "-c", str(src), "-o", str(obj)], f"kernel {name}")
            # Linked without -fsanitize: the runtime object stands in for the ThreadSanitizer runtime.
            _run([cxx, *LINK_FLAGS, str(obj), str(runtime), "-o", str(out)],
                 f"kernel {name}")
        finally:
            src.unlink(missing_ok=True)
            obj.unlink(missing_ok=True)

    return _build_atomically(target, build)
