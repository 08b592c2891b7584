"""autoflash: FlashAttention kernels rendered from Jinja2 CUDA templates, compiled with NVRTC at
runtime and launched on torch tensors."""
__version__ = "0.1.0"

from autoflash.config import KernelConfig  # noqa: E402
from autoflash.defaults import default_config  # noqa: E402
from autoflash.gpus import detect, get_profile  # noqa: E402
from autoflash.launch import flash_forward  # noqa: E402

__all__ = ["KernelConfig", "default_config", "detect", "flash_forward", "get_profile", "__version__"]
