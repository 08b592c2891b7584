"""CUDA source -> cubin with NVRTC for an explicit arch (no GPU needed), the ptxas resource report
as data, and an on-disk cubin cache keyed by source, options and NVRTC version."""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import os
import re
import site
import sys
import tempfile
from pathlib import Path

from autoflash.kernels.codegen import render, template_hash
from autoflash.kernels.config import KernelConfig
from autoflash.kernels.cubin import usage as cubin_usage
from autoflash.kernels.resources import templates_dir

_ARCH_RE = re.compile(r"^sm_\d{2,3}[af]?$")
# -default-device: functions without an execution-space annotation (the kernels' lambdas) are
# device code. NVRTC 13.5 assumes it; 13.0, which a CUDA 13.0 build of torch pins, refuses them.
BASE_OPTIONS = ("-std=c++17", "-default-device", "--ptxas-options=-v", "-lineinfo")


# The first line of the log a refusal by sm90_gate carries; its findings follow, one a line.
GATE_REFUSED = "the sm90 family's ptxas gate refused it:"


class CompileError(RuntimeError):
    """NVRTC rejected a kernel; carries the kernel name, its config and the full compiler log."""

    def __init__(self, name: str, arch: str, log: str, config: KernelConfig | None = None):
        self.name, self.arch, self.log, self.config = name, arch, log, config
        cfg = f"\nconfig: {config}" if config is not None else ""
        super().__init__(f"NVRTC failed to compile {name} for {arch}{cfg}\n--- compiler log ---\n{log.strip()}")

    @property
    def reason(self) -> str:
        """The line that refused the kernel: the gate's first finding (a ptxas notice, the spill), else
        NVRTC's first error, else the log's last line (never ptxas's closing "Compile time")."""
        lines = [line.strip() for line in self.log.strip().splitlines() if line.strip()]
        if lines and lines[0] == GATE_REFUSED:
            return lines[1] if len(lines) > 1 else lines[0]
        errors = [line for line in lines if re.search(r"\berror\b|catastrophic|C75\d\d", line)]
        if errors:
            return errors[0]
        useful = [line for line in lines if "Compile time" not in line]
        return useful[-1] if useful else str(self).splitlines()[0]


@dataclasses.dataclass(frozen=True)
class Resources:
    """What ptxas reported for one kernel (or its cubin records: cubin_resources)."""

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


def has_ptxas_report(log: str, kernel: str) -> bool:
    return f"Compiling entry function '{kernel}'" in log


def cubin_resources(cubin: bytes, kernel: str, arch: str) -> Resources:
    """The resources of entry `kernel` as its cubin records them, for a log without ptxas's report.

    NVRTC 13.0.88 (the NVRTC of torch's CUDA 13.0 wheels) returned a good cubin with an empty log for
    73 of 96 first compiles when 16 processes compiled at once on the first H200 run (none when one
    process did; each of the 73 compiled twice more in its process was empty again). The cubin holds
    the registers, the stack frame and the static shared memory as ptxas reports them (the same for all
    13,710 kernels compiled here under NVRTC 12.1 to 13.5); it holds no spill counts, so the stack
    frame stands for both: every one of those kernels that had a stack frame had spills, and no other
    had any."""
    use = cubin_usage(cubin, kernel)
    reserved = 1024 if arch_number(arch) >= 90 else 0  # the driver's from sm_90 on, not the kernel's
    return Resources(registers=use.registers, spill_stores=use.frame_bytes, spill_loads=use.frame_bytes,
                     stack_bytes=use.frame_bytes, static_smem_bytes=max(0, use.shared_section_bytes - reserved))


def _resources(log: str, cubin: bytes, kernel: str, arch: str) -> Resources:
    return parse_ptxas_report(log, kernel) if has_ptxas_report(log, kernel) else cubin_resources(cubin, kernel, arch)


def entry_resources(compiled: Compiled, kernel: str) -> Resources:
    """The resources of one entry function of a compiled module (a kernel's helpers share its cubin)."""
    return _resources(compiled.log, compiled.cubin, kernel, compiled.arch)


@dataclasses.dataclass(frozen=True)
class CudaStack:
    """One CUDA major's install: pyproject.toml's extra, its wheels and where they put NVRTC and the
    headers in site-packages, and the driver its cubins need."""

    major: int
    extra: str  # pip install "autoflash[<extra>]"
    nvrtc_wheel: str
    runtime_wheel: str  # the CUDA headers (cuda_fp16.h, cuda_bf16.h) come in the runtime wheel
    nvrtc_lib: str  # relative to site-packages (Linux)
    include_dir: str  # relative to site-packages
    driver: str

    @property
    def install(self) -> str:
        return f'pip install "autoflash[{self.extra}]"'


# NVIDIA's wheel layouts, as cuda.pathfinder's catalogs list them: CUDA 13 wheels share nvidia/cu13/,
# CUDA 12 wheels each have a folder of their own. Drivers: CUDA's minor version compatibility
# ("CUDA Compatibility", Table 1) runs code built by any 12.x toolkit on a driver >= 525 and by any
# 13.x one on >= 580; a cubin built by a newer major does not load on an older major's driver. The
# driver's CUDA version is what `nvidia-smi` prints as "CUDA Version".
STACKS: dict[int, CudaStack] = {
    12: CudaStack(12, "cu12", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12",
                  "nvidia/cuda_nvrtc/lib/libnvrtc.so.12", "nvidia/cuda_runtime/include",
                  "a CUDA 12 driver, R525 to R575"),
    13: CudaStack(13, "cu13", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime",
                  "nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cu13/include",
                  "a CUDA 13 driver, R580 or newer"),
}

# The first NVRTC whose nvrtcGetSupportedArchs lists an arch autoflash targets (gpus.NVRTC_ARCHS),
# read from the nvidia-cuda-nvrtc(-cu12) wheels: 12.1 to 12.6 list 50..90; 12.8 adds 100, 101 and
# 120; 12.9 adds 103 and 121; 13.0 drops everything below 75 and renames 101 to 110. Only used to
# say which install gives an arch; whether an arch compiles is the installed NVRTC's own list.
FIRST_NVRTC: dict[int, tuple[int, int]] = {100: (12, 8), 120: (12, 8), 103: (12, 9), 121: (12, 9), 110: (13, 0)}
# CUDA 13.0 renamed sm_101 (Jetson Thor) to sm_110: NVRTC 12.8/12.9 list 101, 13.x lists 110 instead.
RENAMED: dict[int, int] = {101: 110}
# Family-specific targets (sm_100f, ...) came with CUDA 12.9: NVRTC 12.8 rejects --gpu-architecture=
# sm_100f ("invalid value"), 12.9 compiles it. The supported-arch list does not show suffixes.
FIRST_NVRTC_FAMILY = (12, 9)


def install_hint() -> str:
    """Which install goes with which driver, newest first (for messages)."""
    return "; ".join(f"`{s.install}` for {s.driver}" for s in sorted(STACKS.values(), key=lambda s: -s.major))


def _no_nvrtc_message(detail: str) -> str:
    return (f"NVRTC not found ({detail}): autoflash compiles its kernels with NVRTC from PyPI, installed with "
            f"the CUDA stack that matches your driver ({install_hint()}). `nvidia-smi` prints the driver's CUDA "
            f"version.")


def _site_file(relative: str) -> str | None:
    """The first `relative` path that exists under sys.path or a site-packages folder."""
    roots = [*sys.path, *getattr(site, "getsitepackages", list)()]
    if site.ENABLE_USER_SITE:
        roots.append(site.getusersitepackages())
    for root in roots:
        path = os.path.join(root or ".", relative)
        if os.path.exists(path):
            return os.path.abspath(path)
    return None


def nvrtc_builtins(lib: str) -> list[str]:
    """The builtins libraries that sit beside NVRTC `lib` in its wheel (libnvrtc-builtins.so.13.0 beside
    libnvrtc.so.13). NVRTC dlopens its builtins by soname at its first compile; the 13.5 wheel's
    libnvrtc carries RPATH $ORIGIN, the 13.0.88 one (pinned by CUDA torch 2.14.1) none, so there the
    builtins are found only if something loaded them first. Loaded before NVRTC, the soname is already
    in the process and NVRTC takes it, whichever wheel and whatever was imported before."""
    folder = Path(lib).parent
    return sorted(str(p) for p in folder.glob("libnvrtc-builtins.so.*") if ".alt." not in p.name)


@functools.lru_cache(maxsize=1)
def _nvrtc():
    """cuda.bindings.nvrtc, bound to the NVRTC of the installed stack.

    cuda-bindings resolves NVRTC's functions in the process first and loads a library only when they
    are not there, through cuda.pathfinder, which takes libnvrtc.so.13 before .so.12 whatever the
    bindings' own major. So with autoflash[cu12] and a CUDA 13 NVRTC wheel left beside it (torch's
    CUDA 13 builds, an earlier autoflash install) the bindings would pick NVRTC 13, whose cubins a
    CUDA 12 driver cannot load. The NVRTC wheel of cuda-bindings' major, where it is installed, is
    loaded first (global symbols) so the bindings use it; otherwise they find one as usual."""
    try:
        import cuda.bindings
        from cuda.bindings import nvrtc
    except ImportError as e:
        raise RuntimeError(_no_nvrtc_message(f"cuda-bindings is not importable: {e}")) from e
    stack = STACKS.get(_major(getattr(cuda.bindings, "__version__", "")))
    lib = _site_file(stack.nvrtc_lib) if stack is not None and sys.platform.startswith("linux") else None
    if lib is not None:
        for builtins in nvrtc_builtins(lib):
            ctypes.CDLL(builtins, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        ctypes.CDLL(lib, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    try:
        nvrtc.nvrtcVersion()
    except Exception as e:  # cuda.pathfinder's DynamicLibNotFoundError, or a library it cannot load
        raise RuntimeError(_no_nvrtc_message(f"{type(e).__name__}: {e}")) from e
    return nvrtc


def _major(version: str) -> int | None:
    head = version.split(".")[0]
    return int(head) if head.isdigit() else None


def _check(result, what: str):
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"NVRTC {what} failed: {err!r}")
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> str:
    """The NVRTC the kernels compile with, "major.minor" (e.g. "12.9", "13.0")."""
    major, minor = _check(_nvrtc().nvrtcVersion(), "nvrtcVersion")
    return f"{major}.{minor}"


def installed_nvrtc() -> tuple[int, int] | None:
    """(major, minor) of the NVRTC the kernels compile with; None where no CUDA stack is installed or
    its libraries do not load (the defaults then take the newest stack's choices; a compile says why)."""
    try:
        return tuple(int(x) for x in nvrtc_version().split("."))[:2]
    except (RuntimeError, OSError):
        return None


def upgrade_hint() -> str:
    """Which NVRTC compiles here and the install that brings its stack's newest (for refusals: ptxas
    releases differ in what they spill and serialize; the newest of each stack is CI's)."""
    try:
        stack = _nvrtc_stack()
    except RuntimeError as e:
        return str(e)
    return (f"NVRTC {nvrtc_version()} ({stack.nvrtc_wheel}) compiled it; a newer release of the stack may not "
            f"refuse it: `pip install -U \"{stack.nvrtc_wheel}<{stack.major + 1}\"`")


def _nvrtc_stack() -> CudaStack:
    major = _major(nvrtc_version())
    if major not in STACKS:
        raise RuntimeError(f"NVRTC {nvrtc_version()} is installed; autoflash supports NVRTC "
                           f"{', '.join(f'{m}.x' for m in sorted(STACKS))}: {' or '.join(s.install for s in STACKS.values())}")
    return STACKS[major]


@functools.lru_cache(maxsize=1)
def supported_archs() -> tuple[int, ...]:
    """The real architectures the installed NVRTC compiles for (nvrtcGetSupportedArchs: 80, 90, ...)."""
    return tuple(sorted(_check(_nvrtc().nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")))


def arch_number(arch: str) -> int:
    """90 for "sm_90" and "sm_90a", 100 for "sm_100f": what NVRTC's supported list holds."""
    return int(re.sub(r"\D", "", arch))


def check_arch(arch: str) -> None:
    """ValueError unless the installed NVRTC compiles for `arch` (before NVRTC says so in a log)."""
    number, suffix = arch_number(arch), arch[-1] if arch[-1] in "af" else ""
    version = tuple(int(x) for x in nvrtc_version().split("."))
    family_too_old = suffix == "f" and version < FIRST_NVRTC_FAMILY
    if number in supported_archs() and not family_too_old:
        return
    stack = _nvrtc_stack()
    first = FIRST_NVRTC_FAMILY if family_too_old else FIRST_NVRTC.get(number)
    if first is not None and first > version:
        newer = STACKS.get(first[0])
        how = (f"`pip install -U \"{stack.nvrtc_wheel}>={first[0]}.{first[1]}\"`" if first[0] == stack.major
               else f"`{newer.install}` (needs {newer.driver})" if newer is not None else "a newer NVRTC")
        fix = f"; {arch} needs NVRTC {first[0]}.{first[1]} or newer: {how}"
    elif number in RENAMED and RENAMED[number] in supported_archs():
        fix = f"; NVRTC {stack.major} calls it sm_{RENAMED[number]}{suffix}"
    else:
        older = [s for s in STACKS.values() if s.major < stack.major]
        fix = (f"; NVRTC {stack.major} dropped it, NVRTC {older[-1].major} has it: `{older[-1].install}`"
               if older and number < min(supported_archs()) else "")
    raise ValueError(f"arch: got {arch!r}, expected one that NVRTC {nvrtc_version()} ({stack.nvrtc_wheel}) "
                     f"compiles for: {', '.join(f'sm_{a}' for a in supported_archs())}{fix}")


def _cudart_major(include_dir: str) -> int | None:
    """The CUDA major of a header folder, from CUDART_VERSION in its cuda_runtime_api.h (12090: 12.9)."""
    try:
        text = Path(include_dir, "cuda_runtime_api.h").read_text(errors="replace")
    except OSError:
        return None
    found = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    return int(found.group(1)) // 1000 if found else None


@functools.lru_cache(maxsize=1)
def cuda_include_dir() -> str:
    """CUDA headers (cuda_fp16.h, cuda_bf16.h) of the installed NVRTC's major, from the pip-installed
    toolkit. cuda.pathfinder alone returns CUDA 13's headers whenever their wheel is installed, which
    NVRTC 12 is not built for; the folder of NVRTC's own stack is taken first and every candidate's
    CUDART_VERSION must be of NVRTC's major."""
    from cuda.pathfinder import find_nvidia_header_directory

    stack = _nvrtc_stack()
    candidates = [_site_file(stack.include_dir), find_nvidia_header_directory("cudart")]
    majors = {path: _cudart_major(path) for path in candidates if path}
    for path, major in majors.items():
        if major == stack.major:
            return path
    seen = "".join(f"; {path} holds CUDA {major} headers" for path, major in majors.items())
    raise RuntimeError(
        f"CUDA {stack.major} headers not found for NVRTC {nvrtc_version()}{seen}: install them with "
        f"`pip install \"{stack.runtime_wheel}>={stack.major}.0,<{stack.major + 1}\"` (or `{stack.install}`)"
    )


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
    check_arch(arch)
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
    resources = _resources(log, cubin, name, arch)
    _atomic_write(cubin_path, cubin)
    meta = {"name": name, "arch": arch, "nvrtc": nvrtc_version(), "resources": dataclasses.asdict(resources), "log": log}
    _atomic_write(meta_path, json.dumps(meta, indent=1).encode())
    return Compiled(name, arch, cubin_path, resources, log)


# ptxas notices that an sm_90a kernel would not run as written (hopper.md section 5, seen with
# nvcc and NVRTC 13): C7508 setmaxnreg ignored (no register count known at entry), C7511 wgmma
# serialized, C7517 / C7519 waits or arrives inserted around wgmma because registers were touched
# while it was in flight. Any other line naming wgmma and serialization counts too.
SM90_NOTICES = ("C7508", "C7511", "C7517", "C7519")


def sm90_gate(compiled: Compiled, config: KernelConfig) -> None:
    """Raises CompileError where ptxas serialized the sm90 kernel, injected waits, ignored
    setmaxnreg or spilled: what compiles then runs, but not as the kernel's schedule says."""
    bad = [line.strip() for line in compiled.log.splitlines()
           if any(code in line for code in SM90_NOTICES) or ("wgmma" in line and "serializ" in line)]
    if compiled.resources.spills:
        bad.append(f"{compiled.resources.spill_stores} bytes of spill stores, {compiled.resources.spill_loads} of "
                   f"spill loads")
    if bad:
        raise CompileError(compiled.name, compiled.arch, GATE_REFUSED + "\n" + "\n".join(bad)
                           + "\n--- full log ---\n" + compiled.log, config)


def compile_config(config: KernelConfig, arch: str, *, use_cache: bool = True) -> Compiled:
    """Renders and compiles the kernel of `config` for `arch`. The sm90 family compiles for sm_90a
    (wgmma and setmaxnreg exist only there) and passes sm90_gate."""
    if config.family == "sm90":
        if arch not in ("sm_90", "sm_90a"):
            raise ValueError(f"{config.name}: the sm90 family runs on sm_90 GPUs (H100, H200); got arch {arch!r}")
        compiled = compile_source(render(config), config.name, "sm_90a", config=config, use_cache=use_cache)
        sm90_gate(compiled, config)
        return compiled
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
