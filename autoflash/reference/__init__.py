"""PyTorch references the kernels are held to: the plain, packed and tiled forward with
FlashAttention-3's accuracy rule (forward.py: within_tolerance, rounding_error), the tiled backward
with autograd gradients (backward.py), and flash-attn's variants they share (variants.py). The
forward's names are re-exported here, as `autoflash.reference` offered them before it was a package."""
from autoflash.reference.forward import (
    LOG2E,
    attention_ref,
    attention_tiled,
    attention_varlen_ref,
    rounding_error,
    within_tolerance,
)
from autoflash.reference.variants import band_mask

__all__ = ["LOG2E", "attention_ref", "attention_tiled", "attention_varlen_ref", "band_mask", "rounding_error",
           "within_tolerance"]
