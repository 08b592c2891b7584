"""autoflash: FlashAttention kernels rendered from Jinja2 CUDA templates, compiled with NVRTC at
runtime and launched on torch tensors.

The public names load on first use, so that tools which need no torch (the tuner's workers on the
simulated backend, `--help`) start quickly."""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Explanation": "autoflash.explain",
    "FallbackWarning": "autoflash.dispatch",
    "UnsupportedCallError": "autoflash.dispatch",
    "attention": "autoflash.dispatch",
    "explain": "autoflash.explain",
    "patch_sdpa": "autoflash.dispatch",
    "KernelConfig": "autoflash.config",
    "default_backward_config": "autoflash.defaults",
    "default_config": "autoflash.defaults",
    "detect": "autoflash.gpus",
    "EmulationError": "autoflash.emulation",
    "emulate": "autoflash.emulation",
    "flash_attn": "autoflash.function",
    "flash_backward": "autoflash.launch",
    "flash_forward": "autoflash.launch",
    "get_profile": "autoflash.gpus",
}
__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autoflash' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
