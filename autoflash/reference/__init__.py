"""PyTorch references the kernels are held to: the plain and tiled forward with FlashAttention's
accuracy rule (forward.py), and the tiled backward with autograd gradients (backward.py). The
forward's names are re-exported here, as `autoflash.reference` offered them before it was a package."""
from autoflash.reference.forward import LOG2E, attention_ref, attention_tiled, within_tolerance

__all__ = ["LOG2E", "attention_ref", "attention_tiled", "within_tolerance"]
