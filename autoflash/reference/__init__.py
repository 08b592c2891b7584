"""PyTorch references the kernels are held to: the plain and tiled forward with FlashAttention's
accuracy rule (forward.py), and the tiled backward with autograd gradients (backward.py)."""
