"""The launches a GPU would refuse, refused by the emulator too (grid and block sizes, dynamic shared
memory over the emulated GPU's opt-in limit, registers over its register file), so that CPU tests
catch them: a launch the hardware rejects fails with a clear LaunchRefused, as it would on a GPU."""
from __future__ import annotations

import functools
import math
import warnings

from autoflash.emulation.build import EmulationError
from autoflash.kernels.config import KernelConfig

# Launch limits every CUDA GPU the kernels run on (sm_80 and newer) enforces (CUDA C++ Programming Guide,
# "Technical Specifications per Compute Capability": grid x 2^31 - 1, grid y and z 65,535, block x and
# y 1,024, z 64, 1,024 threads per block); the per-GPU ones (dynamic shared memory per block with
# opt-in, registers per block) come from the emulated profile.
GRID_MAX = (2**31 - 1, 65535, 65535)
BLOCK_MAX = (1024, 1024, 64)
THREADS_MAX = 1024
# Registers are allocated per warp, in units of 256 (the CUDA Occupancy Calculator's "register allocation
# unit size" 256 and "allocation granularity" warp for compute capability 8.x, as every newer part; its
# sheet is now Nsight Compute's occupancy calculator): a block of W warps of a kernel using R registers
# per thread takes W * ceil(32 R / 256) * 256, and its launch fails when that exceeds the registers a
# block may have (64K on every sm_80+ part, GpuProfile.regs_per_sm).
REG_UNIT = 256


class LaunchRefused(EmulationError):
    """A launch the emulated GPU would refuse (too large a grid or block, too much shared memory or
    too many registers per block), as a failed GPU launch (cudaErrorInvalidConfiguration,
    CUDA_ERROR_INVALID_VALUE, too many resources requested) would be."""

    def __init__(self, kernel: str, limit: str, value: int, maximum: int, detail: str):
        self.kernel, self.limit, self.value, self.maximum = kernel, limit, value, maximum
        super().__init__(f"launch of {kernel} refused: {limit}: got {value:,}, the maximum is {maximum:,}{detail}")


@functools.lru_cache(maxsize=None)
def kernel_registers(config: KernelConfig, arch: str, name: str) -> int | None:
    """Registers per thread ptxas gives kernel `name` of `config` on `arch` (NVRTC, disk-cached); None
    where NVRTC or the CUDA headers are missing (the register limit is then not checked; a warning
    says so). A kernel NVRTC rejects is refused: no GPU could launch it."""
    from autoflash.kernels.compiler import CompileError, compile_config, entry_resources, upgrade_hint

    try:
        compiled = compile_config(config, arch)
    except CompileError as e:
        raise EmulationError(f"launch of {name} refused: NVRTC cannot compile {config.name} for {arch}, so no GPU "
                             f"could run it: {e.reason}\n{upgrade_hint()}\n--- compiler log ---\n"
                             f"{e.log.strip()[-2000:]}") from None
    except (ImportError, OSError, RuntimeError) as e:
        warnings.warn(f"the emulator does not check {name}'s registers against the register file: ptxas's count "
                      f"for {arch} needs NVRTC and the CUDA headers ({type(e).__name__}: {e})", stacklevel=2)
        return None
    if name == config.name:
        return compiled.resources.registers
    return entry_resources(compiled, name).registers


def check_launch(name: str, config: KernelConfig | None, grid: tuple, block: tuple, shared_mem: int,
                 profile) -> int | None:
    """Raises LaunchRefused for a launch the GPU of `profile` (a GpuProfile; None: only the limits
    every GPU shares) would refuse; returns the kernel's registers per thread as ptxas gives them
    (None where not known), which the emulator's setmaxnreg pool starts from."""
    for axis, n, most in zip("xyz", grid, GRID_MAX):
        if not 1 <= n <= most:
            raise LaunchRefused(name, f"gridDim.{axis}", n, most, " (and at least 1)" if n < 1 else "")
    for axis, n, most in zip("xyz", block, BLOCK_MAX):
        if not 1 <= n <= most:
            raise LaunchRefused(name, f"blockDim.{axis}", n, most, " (and at least 1)" if n < 1 else "")
    threads = math.prod(block)
    if threads > THREADS_MAX:
        raise LaunchRefused(name, "threads per block", threads, THREADS_MAX, f" (block {tuple(block)})")
    if profile is None:
        return None
    if shared_mem > profile.smem_per_block_optin:
        raise LaunchRefused(name, f"dynamic shared memory per block on the {profile.name} (its opt-in maximum)",
                            shared_mem, profile.smem_per_block_optin, " bytes")
    registers = kernel_registers(config, profile.arch, name) if config is not None else None
    if registers is not None:
        warps = -(-threads // 32)
        per_warp = -(-registers * 32 // REG_UNIT) * REG_UNIT
        if warps * per_warp > profile.regs_per_sm:
            raise LaunchRefused(name, f"registers per block on the {profile.name}", warps * per_warp,
                                profile.regs_per_sm,
                                f" ({registers} registers per thread as ptxas gives it for {profile.arch}, "
                                f"{per_warp} per warp in units of {REG_UNIT}, x {warps} warps)")
    return registers
