"""Hugging Face transformers integration: `attn_implementation="autofa"`.

    import autoflash.hf
    autoflash.hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="autofa")

The name is "autofa", not "autoflash": transformers takes any implementation whose name contains
"flash" for a flash-attn package or a Hub kernel and tries to import one (transformers 5.x,
utils/generic.py is_flash_attention_requested), which would fail before autoflash is ever called.

register() adds autoflash to transformers' AttentionInterface (the attention call) and to its
AttentionMaskInterface with the "sdpa" mask builder, so the model hands over no mask where SDPA would
get none (causal, no padding: the kernels' is_causal path) and a mask where padding needs one (which
falls back to torch SDPA with a warning). transformers is not a dependency of autoflash: this module
imports it only in register().
"""
from __future__ import annotations

import torch

from autoflash.dispatch.sdpa import attention

NAME = "autofa"


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query (batch, heads, q_len, head_dim), key/value
    (batch, kv_heads, kv_len, head_dim) -> (attn_output (batch, q_len, heads, head_dim), None)."""
    if kwargs.get("softcap") is not None:
        raise ValueError(f"softcap: got {kwargs['softcap']}, expected None (autoflash has no logit soft-capping)")
    if kwargs.get("position_bias") is not None:
        raise ValueError("position_bias: got a tensor, expected None (use attn_implementation='sdpa' for models "
                         "with an additive position bias)")
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As transformers' SDPA path decides: causal only when prefilling (q_len > 1) with no explicit mask;
    # a single decoded token attends to every cached key.
    causal = bool(q_len > 1 and attention_mask is None and causal)
    gqa = key.shape[1] != query.shape[1]
    if causal and key.shape[2] > q_len:  # prefill into an empty static cache: keys past q_len are unused
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=causal, scale=scaling,
                    enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Registers attn_implementation="autofa" with transformers (idempotent)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:
        raise ImportError(f"autoflash.hf.register needs transformers (pip install transformers): {e}") from e
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
