"""autoflash: FlashAttention kernels rendered from Jinja2 CUDA templates, compiled with NVRTC at
runtime and launched on torch tensors."""
__version__ = "0.1.0"

from autoflash.config import KernelConfig  # noqa: E402
from autoflash.defaults import default_backward_config, default_config  # noqa: E402
from autoflash.function import flash_attn  # noqa: E402
from autoflash.gpus import detect, get_profile  # noqa: E402
from autoflash.launch import flash_backward, flash_forward  # noqa: E402

__all__ = ["KernelConfig", "default_backward_config", "default_config", "detect", "flash_attn",
           "flash_backward", "flash_forward", "get_profile", "__version__"]
