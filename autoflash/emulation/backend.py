"""The emulator as the launchers' host backend (autoflash.kernels.backend): CPU tensors run as the GPU
of the innermost autoflash.emulate() (or AUTOFLASH_EMULATE), on kernels built for the host, into
buffers with guard bands when sanitizing."""
from __future__ import annotations

from autoflash.emulation import guards
from autoflash.emulation.context import ENV, active


class Emulator:
    hint = f"on the CPU, run it inside `with autoflash.emulate(gpu=...)` or with {ENV}=<gpu> to emulate a GPU"
    empty = staticmethod(guards.empty)
    zeros = staticmethod(guards.zeros)
    empty_like = staticmethod(guards.empty_like)

    @staticmethod
    def profile():
        emulation = active()
        return None if emulation is None else emulation.profile

    @staticmethod
    def functions(config) -> dict:
        from autoflash.emulation.module import load_functions  # numpy and ctypes: only when a kernel runs

        return load_functions(config, active().sanitize)


HOST_BACKEND = Emulator()
