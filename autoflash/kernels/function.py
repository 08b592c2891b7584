"""Differentiable FlashAttention: a torch.autograd.Function over the generated forward and backward
kernels. It saves only q, k, v, out, lse and the configs; no L x L tensor exists at any point."""
from __future__ import annotations

import torch

from autoflash.kernels.checks import chunked
from autoflash.kernels.config import KernelConfig
from autoflash.kernels.launch import flash_backward, flash_forward


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, config, backward_config, deterministic):
        out, lse = flash_forward(q, k, v, causal=causal, scale=scale, config=config)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.backward_config, ctx.deterministic = backward_config, deterministic
        return out

    @staticmethod
    def backward(ctx, dout):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "autoflash: double backward (create_graph=True through flash_attn) is not supported"
            )
        q, k, v, out, lse = ctx.saved_tensors
        # Autograd may hand over a gradient with any layout (even stride-0 broadcasts); the kernels
        # need 16-byte chunks along a contiguous head dim.
        dq, dk, dv = flash_backward(chunked(dout), q, k, v, out, lse, causal=ctx.causal, scale=ctx.scale,
                                    config=ctx.backward_config, deterministic=ctx.deterministic)
        return dq, dk, dv, None, None, None, None, None


def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
               scale: float | None = None, deterministic: bool = False, config: KernelConfig | None = None,
               backward_config: KernelConfig | None = None) -> torch.Tensor:
    """Differentiable attention on CUDA tensors (or CPU tensors inside autoflash.emulate()): q (batch, heads_q, seqlen_q, head_dim), k and v
    (batch, heads_kv, seqlen_k, head_dim), heads_kv dividing heads_q. Returns out like q.

    `causal` is top-left aligned (SDPA's is_causal); scale defaults to 1/sqrt(head_dim);
    deterministic=True makes the backward bit-reproducible. Gradients come back with the inputs'
    dtypes and strides (fp16/bf16 on tensor cores, fp32 on the SIMT path)."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: got {deterministic!r}, expected a bool")
    return FlashAttentionFunction.apply(q, k, v, causal, scale, config, backward_config, deterministic)
