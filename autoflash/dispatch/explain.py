"""`autoflash.explain(query, key, value, ...)`: which path a call would take and why, and on the
kernels which forward and backward configs, with the table (or heuristic) each came from.

A call with a key-padding attn_mask runs the key-bias variant of the kernels, whose configs
autoflash.dispatch.flash_api.attention_variant picks: explain names that path and leaves the
configs out. A (..., Lq, Lk)-shaped mask is checked as the call would check it (its values: one
comparison), so the path reported is the path taken."""
from __future__ import annotations

import dataclasses

import torch

from autoflash.kernels.checks import DTYPE_NAMES
from autoflash.dispatch.sdpa import NO_MASK, mask_reason, plan
from autoflash.dispatch.selection import Selection


@dataclasses.dataclass(frozen=True)
class Explanation:
    path: str  # "autoflash kernels", "autoflash kernels (emulated on the CPU)" or "torch SDPA (fallback)"
    reason: str | None  # why the fallback; None on the kernels
    gpu: str | None  # the profile the configs were selected for
    forward: Selection | None  # None on the fallback, and for a key-padding mask (the variant's own choice)
    backward: Selection | None
    mask: str | None = None  # on the kernels, how the attn_mask runs (None: no mask)

    @property
    def uses_kernels(self) -> bool:
        return self.reason is None

    def __str__(self) -> str:
        if not self.uses_kernels:
            return f"path: {self.path}\nreason: {self.reason}"
        lines = [f"path: {self.path} on {self.gpu}"]
        if self.mask is not None:
            lines.append(f"mask: {self.mask}")
        for what, sel in (("forward", self.forward), ("backward", self.backward)):
            if sel is None:
                continue
            c = sel.config
            lines.append(f"{what}: {c.name} (block {c.block_m}x{c.block_n}, {c.num_warps} warps, {c.num_stages} "
                         f"stages, {c.smem_bytes} B shared memory) for {sel.key}\n  from {sel.origin}")
        return "\n".join(lines)


def explain(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
            dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
            *, gpu: str | None = None) -> Explanation:
    """What autoflash.attention would do with these arguments, without running anything.

    gpu=NAME (a profile: "h100", "a100", ...) explains the call as if the tensors were on that GPU,
    so configs can be inspected on any machine; by default the tensors' own device decides (CPU tensors
inside autoflash.emulate(): the emulated GPU, path "autoflash kernels (emulated on the CPU)")."""
    from autoflash.kernels.gpus import get_profile
    from autoflash.kernels.launch import profile_for
    from autoflash.dispatch.flash_api import padded_head_dim
    from autoflash.dispatch.selection import select_config

    p = plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, device_check=gpu is None)
    reason = mask_reason(attn_mask, p)
    if reason is not None:
        return Explanation("torch SDPA (fallback)", reason, gpu, None, None)
    profile = get_profile(gpu) if gpu is not None else profile_for(query, "autoflash.dispatch.explain")
    emulated = gpu is None and not query.is_cuda
    path = "autoflash kernels (emulated on the CPU)" if emulated else "autoflash kernels"
    if p.mask != NO_MASK:
        return Explanation(path, None, profile.name, None, None,
                           mask=f"{p.mask}: the kernels' per-key bias (key_bias variant, configs picked by "
                                "attention_variant)")
    # a head dim the kernels have no tiles for runs zero-padded to the next one (attention_variant)
    d = padded_head_dim(query.shape[-1])
    fwd, bwd = (select_config(profile, direction, DTYPE_NAMES[query.dtype], d, is_causal, key.shape[-2])
                for direction in ("fwd", "bwd"))
    return Explanation(path, None, profile.name, fwd, bwd)
