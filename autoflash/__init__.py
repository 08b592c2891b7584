"""autoflash: FlashAttention kernels rendered from Jinja2 CUDA templates, compiled with NVRTC at
runtime and launched on torch tensors.

The public names load on first use, so that tools which need no torch (the tuner's workers on the
simulated backend, `--help`) start quickly."""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Explanation": "autoflash.dispatch.explain",
    "FallbackWarning": "autoflash.dispatch.policy",
    "UnsupportedCallError": "autoflash.dispatch.policy",
    "attention": "autoflash.dispatch.sdpa",
    "explain": "autoflash.dispatch.explain",
    "patch_sdpa": "autoflash.dispatch.sdpa",
    "KernelConfig": "autoflash.kernels.config",
    "default_backward_config": "autoflash.kernels.defaults",
    "default_config": "autoflash.kernels.defaults",
    "detect": "autoflash.kernels.gpus",
    "EmulationError": "autoflash.emulation",
    "emulate": "autoflash.emulation",
    "flash_attn": "autoflash.kernels.function",
    "flash_attn_func": "autoflash.dispatch.flash_api",
    "flash_attn_kvpacked_func": "autoflash.dispatch.flash_api",
    "flash_attn_qkvpacked_func": "autoflash.dispatch.flash_api",
    "flash_attn_varlen_func": "autoflash.dispatch.flash_api",
    "flash_attn_varlen_kvpacked_func": "autoflash.dispatch.flash_api",
    "flash_attn_varlen_qkvpacked_func": "autoflash.dispatch.flash_api",
    "flash_attn_with_kvcache": "autoflash.dispatch.kvcache",
    "flash_backward": "autoflash.kernels.launch",
    "flash_forward": "autoflash.kernels.launch",
    "get_profile": "autoflash.kernels.gpus",
}
__all__ = sorted(_EXPORTS) + ["__version__"]

# CPU tensors run on the emulator: the launchers ask autoflash.kernels.backend, which imports it on first use.
from autoflash.kernels.backend import register_host  # noqa: E402 -- nothing but the standard library

register_host("autoflash.emulation.backend")
del register_host

def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autoflash' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names and the module's dunders: not the helpers the package itself imports."""
    return sorted({n for n in globals() if n.startswith("__")} | set(_EXPORTS) | {"__version__"})
