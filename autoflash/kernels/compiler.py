"""CUDA source -> cubin with NVRTC for an explicit arch (no GPU needed), the ptxas resource report
as data, and an on-disk cubin cache keyed by source, options and NVRTC version."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

from autoflash.kernels.codegen import render, template_hash
from autoflash.kernels.config import KernelConfig
from autoflash.kernels.resources import templates_dir

_ARCH_RE = re.compile(r"^sm_\d{2,3}[af]?$")
# -default-device: functions without an execution-space annotation (the kernels' lambdas) are
# device code. NVRTC 13.5 assumes it; 13.0, which a CUDA 13.0 build of torch pins, refuses them.
BASE_OPTIONS = ("-std=c++17", "-default-device", "--ptxas-options=-v", "-lineinfo")


class CompileError(RuntimeError):
    """NVRTC rejected a kernel; carries the kernel name, its config and the full compiler log."""

    def __init__(self, name: str, arch: str, log: str, config: KernelConfig | None = None):
        self.name, self.arch, self.log, self.config = name, arch, log, config
        cfg = f"\nconfig: {config}" if config is not None else ""
        super().__init__(f"NVRTC failed to compile {name} for {arch}{cfg}\n--- compiler log ---\n{log.strip()}")


@dataclasses.dataclass(frozen=True)
class Resources:
    """What ptxas reported for one kernel."""

    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack_bytes: int
    static_smem_bytes: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


@dataclasses.dataclass(frozen=True)
class Compiled:
    name: str
    arch: str
    cubin_path: Path
    resources: Resources
    log: str

    @property
    def cubin(self) -> bytes:
        return self.cubin_path.read_bytes()


def parse_ptxas_report(log: str, kernel: str) -> Resources:
    """Reads the `ptxas -v` lines of one entry function out of an NVRTC log."""
    start = log.find(f"Compiling entry function '{kernel}'")
    if start < 0:
        raise ValueError(f"no ptxas report for entry function {kernel!r} in the compiler log:\n{log}")
    nxt = log.find("Compiling entry function", start + 1)
    block = log[start : nxt if nxt > 0 else len(log)]
    stack = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", block)
    regs = re.search(r"Used (\d+) registers", block)
    smem = re.search(r"(\d+) bytes smem", block)
    if stack is None or regs is None:
        raise ValueError(f"incomplete ptxas report for {kernel!r}:\n{block}")
    return Resources(
        registers=int(regs.group(1)),
        spill_stores=int(stack.group(2)),
        spill_loads=int(stack.group(3)),
        stack_bytes=int(stack.group(1)),
        static_smem_bytes=int(smem.group(1)) if smem else 0,
    )


def _nvrtc():
    from cuda.bindings import nvrtc

    return nvrtc


def _check(result, what: str):
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"NVRTC {what} failed: {err!r}")
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> str:
    major, minor = _check(_nvrtc().nvrtcVersion(), "nvrtcVersion")
    return f"{major}.{minor}"


@functools.lru_cache(maxsize=1)
def cuda_include_dir() -> str:
    """CUDA headers (cuda_fp16.h, cuda_bf16.h) from the pip-installed toolkit."""
    from cuda.pathfinder import find_nvidia_header_directory

    path = find_nvidia_header_directory("cudart")
    if not path:
        raise RuntimeError(
            "CUDA headers not found: install them with `pip install 'nvidia-cuda-runtime>=13.0,<14'`"
        )
    return path


def cache_dir() -> Path:
    """Cubin cache: $AUTOFLASH_CACHE_DIR, else $XDG_CACHE_HOME/autoflash, else ~/.cache/autoflash."""
    if os.environ.get("AUTOFLASH_CACHE_DIR"):
        return Path(os.environ["AUTOFLASH_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autoflash"


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _nvrtc_compile(source: str, name: str, arch: str, options: list[str]) -> tuple[bytes, str]:
    nvrtc = _nvrtc()
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []), "create")
    try:
        opts = [o.encode() for o in options]
        err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        log_text = log.rstrip(b"\0 ").decode(errors="replace")
        if int(err) != 0:
            return b"", log_text
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
        cubin = b" " * size
        nvrtc.nvrtcGetCUBIN(prog, cubin)
        return cubin, log_text
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_source(source: str, name: str, arch: str, *, defines: tuple[str, ...] = (),
                   config: KernelConfig | None = None, use_cache: bool = True) -> Compiled:
    """Compiles `source` (whose kernel symbol is `name`) to a cubin for `arch`, e.g. "sm_90"."""
    if not isinstance(arch, str) or not _ARCH_RE.match(arch):
        raise ValueError(f"arch: got {arch!r}, expected an NVRTC real architecture such as 'sm_80' or 'sm_90a'")
    options = [f"--gpu-architecture={arch}", *BASE_OPTIONS, *(f"-D{d}" for d in defines),
               f"-I{templates_dir()}", f"-I{cuda_include_dir()}"]
    # Include paths vary between machines; the headers' contents are what matter for the key.
    key_parts = [source, arch, *BASE_OPTIONS, *defines, nvrtc_version(), template_hash()]
    key = hashlib.sha256("\0".join(key_parts).encode()).hexdigest()[:20]
    stem = cache_dir() / "cubin" / f"{name}-{arch}-{key}"
    cubin_path, meta_path = stem.with_suffix(".cubin"), stem.with_suffix(".json")
    if use_cache and cubin_path.exists() and meta_path.exists():
        try:
            meta = json.loads(meta_path.read_text())
            return Compiled(name, arch, cubin_path, Resources(**meta["resources"]), meta["log"])
        except (ValueError, KeyError, TypeError):
            pass  # a damaged entry is rebuilt below
    cubin, log = _nvrtc_compile(source, name, arch, options)
    if not cubin:
        raise CompileError(name, arch, log, config)
    resources = parse_ptxas_report(log, name)
    _atomic_write(cubin_path, cubin)
    meta = {"name": name, "arch": arch, "nvrtc": nvrtc_version(), "resources": dataclasses.asdict(resources), "log": log}
    _atomic_write(meta_path, json.dumps(meta, indent=1).encode())
    return Compiled(name, arch, cubin_path, resources, log)


def compile_config(config: KernelConfig, arch: str, *, use_cache: bool = True) -> Compiled:
    """Renders and compiles the kernel of `config` for `arch`."""
    return compile_source(render(config), config.name, arch, config=config, use_cache=use_cache)


def static_smem_probe(config: KernelConfig, arch: str) -> Resources:
    """Compiles the kernel with its SharedStorage declared statically so ptxas reports its size.

    Only layouts up to 48 KiB can be declared statically; larger ones raise CompileError."""
    return compile_source(render(config), config.name, arch, defines=("AUTOFLASH_STATIC_SMEM",),
                          config=config).resources


def disassemble(compiled: Compiled) -> str:
    """SASS of a compiled kernel, by nvdisasm from the pip-installed toolkit (no GPU needed)."""
    import subprocess

    from autoflash.kernels.sass import nvdisasm

    return subprocess.run([nvdisasm(), str(compiled.cubin_path)], capture_output=True, text=True, check=True).stdout
