"""Where a launch on CPU tensors runs: the host backend, one interface the launchers call.

On CUDA tensors the launchers load cubins through CuPy themselves (kernels/launch.py). On CPU tensors
they ask the host backend registered here: which GPU the call runs as, the config's kernels as
callables, and the buffers they write (which a sanitizing backend may surround with guard bands).
The package root registers the emulator (autoflash.emulation.backend) by name, so this package never
imports the layers below it, and the emulator loads only when a CPU tensor first asks for it."""
from __future__ import annotations

import importlib
from typing import Protocol


class HostBackend(Protocol):
    hint: str  # how a caller gets this backend for CPU tensors (error messages)

    def profile(self):
        """The GpuProfile CPU tensors run as now, or None when the backend is not in force."""

    def functions(self, config) -> dict:
        """{symbol: callable(grid, block, args, shared_mem=, names=)} of the config's kernels."""

    def empty(self, shape, dtype, device, dims: str, *, name: str = "", rows: str | None = None,
              contiguous: bool = False):
        """A launcher's buffer (dims: each dim's role, "b" batch, "h" head, "l" rows, "d" columns)."""

    def zeros(self, shape, dtype, device, dims: str, *, name: str = "", rows: str | None = None,
              contiguous: bool = False):
        """As empty, the elements 0."""

    def empty_like(self, t, dims: str, *, name: str = "", rows: str | None = None, width: int | None = None):
        """As empty, shaped and strided as torch.empty_like(t) (its last dim `width` wide where given)."""


_module: str | None = None
_backend: HostBackend | None = None


def register_host(module: str) -> None:
    """Names the module whose HOST_BACKEND serves CPU tensors (imported on first use)."""
    global _module, _backend
    if not isinstance(module, str) or not module:
        raise TypeError(f"register_host: got {module!r}, expected a module name")
    _module, _backend = module, None


def host() -> HostBackend | None:
    """The registered host backend, or None when no package registered one."""
    global _backend
    if _backend is None and _module is not None:
        _backend = importlib.import_module(_module).HOST_BACKEND
    return _backend

