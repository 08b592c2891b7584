"""`autoflash.explain(...)`: which path a call would take and why, without running it: on the kernels,
which kernel family and which forward and backward configs (KV cache: the decode kernel and its
key splits), with the table (or heuristic) each came from; off them, every reason.

Two forms, the same arguments as the call:
- `explain(query, key, value, attn_mask=None, ...)`: autoflash.attention's call (SDPA's arguments);
- `explain(autoflash.flash_attn_func, q, k, v, causal=True)`: any entry point of flash-attn's API
  (flash_attn_func, flash_attn_varlen_func, their packed forms, flash_attn_with_kvcache) or
  autoflash.attention itself. The function runs its own checks (so a bad call raises here as it
  would there) and stops where it would launch.

A (..., Lq, Lk)-shaped attn_mask is checked as the call would check it (its values: one comparison),
so the path reported is the path taken."""
from __future__ import annotations

import dataclasses

import torch

from autoflash.dispatch.sdpa import NO_MASK, attention, mask_reason, native_head_dim, plan
from autoflash.dispatch.selection import Selection
from autoflash.kernels.checks import DTYPE_NAMES
from autoflash.kernels.config import HEAD_DIM_MAX

KERNELS = "autoflash kernels"
EMULATED = "autoflash kernels (emulated on the CPU)"
SDPA_FALLBACK = "torch SDPA (fallback)"
REFERENCE_FALLBACK = "the PyTorch reference (fallback)"


def family(config) -> str:
    """The kernel family a config belongs to, as explain prints it."""
    if config.dtype == "fp32":
        return "SIMT (fp32: CUDA cores, no tensor cores; the FlashAttention-2 tiling) for sm_80 and newer"
    if config.family == "sm90":
        return (f"sm90 (FlashAttention-3 design: wgmma.mma_async + TMA + mbarriers, a producer warpgroup beside "
                f"{config.num_warps // 4} consumer warpgroup{'s' if config.num_warps > 4 else ''}) for sm_90a (H100, "
                f"H200)")
    return "mma.sync (FlashAttention-2 design: ldmatrix + mma.sync.m16n8k16, cp.async) for sm_80 and newer"


@dataclasses.dataclass(frozen=True)
class Explanation:
    path: str  # KERNELS, EMULATED, SDPA_FALLBACK or REFERENCE_FALLBACK
    reason: str | None  # why the fallback; None on the kernels
    gpu: str | None  # the profile the configs were selected for
    forward: Selection | None  # the kernel (the KV cache's decode kernel); None on a fallback
    backward: Selection | None  # None on a fallback and for the KV cache (forward only)
    mask: str | None = None  # on the kernels, how the attn_mask runs (None: no mask)
    entry: str = "autoflash.attention"
    notes: tuple[str, ...] = ()  # further facts of the choice (padding, key splits)

    @property
    def uses_kernels(self) -> bool:
        return self.reason is None

    @property
    def family(self) -> str | None:
        """The forward's family, and the backward's where it differs."""
        if self.forward is None:
            return None
        fwd = family(self.forward.config)
        bwd = family(self.backward.config) if self.backward is not None else fwd
        return fwd if bwd == fwd else f"forward {fwd}; backward {bwd}"

    def __str__(self) -> str:
        if not self.uses_kernels:
            return f"entry: {self.entry}\npath: {self.path}\nreason: {self.reason}"
        lines = [f"entry: {self.entry}", f"path: {self.path} on {self.gpu}"]
        if self.family:
            lines.append(f"family: {self.family}")
        if self.mask is not None:
            lines.append(f"mask: {self.mask}")
        for what, sel in (("forward", self.forward), ("backward", self.backward)):
            if sel is None:
                continue
            c = sel.config
            key = f" for {sel.key}" if sel.key is not None else ""
            lines.append(f"{what}: {c.name} (block {c.block_m}x{c.block_n}, {c.num_warps} warps, {c.num_stages} "
                         f"stages, {c.smem_bytes} B shared memory){key}\n  from {sel.origin}")
            if what == "forward" and c.head_split > 1:
                lines.append(f"  O's {c.dv} columns in {c.head_split} blocks of {c.o_columns} a query tile, each "
                             f"computing the scores")
        lines += self.notes
        return "\n".join(lines)


def explain(query, *args, gpu: str | None = None, **kwargs) -> Explanation:
    """What a call would do, without running anything. `explain(q, k, v, ...)` explains
    autoflash.attention with SDPA's arguments; `explain(fn, *args, **kwargs)` explains a call of
    entry point `fn` (autoflash.attention, flash_attn_func, flash_attn_varlen_func, the packed forms,
    flash_attn_with_kvcache) with the call's own arguments.

    gpu=NAME (a profile: "h100", "a100", ...) explains the call as if the tensors were on that GPU,
    so configs can be inspected on any machine; by default the tensors' own device decides (CPU
    tensors inside autoflash.emulate(): the emulated GPU, path "autoflash kernels (emulated on the
    CPU)"; outside it, the fallback and its reason)."""
    if callable(query) and not isinstance(query, torch.Tensor):
        if query is attention or getattr(query, "__wrapped__", None) is attention:
            return _explain_attention(*args, gpu=gpu, **kwargs)
        return _explain_entry(query, args, kwargs, gpu)
    return _explain_attention(query, *args, gpu=gpu, **kwargs)


def _profile(gpu: str | None, t: torch.Tensor):
    from autoflash.kernels.gpus import get_profile
    from autoflash.kernels.launch import profile_for

    return get_profile(gpu) if gpu is not None else profile_for(t, "autoflash.explain")


def _path(gpu: str | None, t: torch.Tensor) -> str:
    return EMULATED if gpu is None and not t.is_cuda else KERNELS


def _explain_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                       scale: float | None = None, enable_gqa: bool = False, *, gpu: str | None = None,
                       strict: bool | None = None) -> Explanation:
    from autoflash.dispatch.flash_api import padded_head_dim, padded_head_dim_v, stand_in
    from autoflash.dispatch.selection import select_config

    p = plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, device_check=gpu is None)
    reason = p.reasons if p.reason is not None else mask_reason(attn_mask, p)
    if reason is not None:
        return Explanation(SDPA_FALLBACK, reason, gpu, None, None)
    profile = _profile(gpu, query)
    path = _path(gpu, query)
    e, ev = query.shape[-1], value.shape[-1]
    if p.mask != NO_MASK or not native_head_dim(e) or ev != e:  # attention_variant's path: the variant ops' choice
        d = padded_head_dim(e)
        dv = None if ev == e else padded_head_dim_v(ev)
        b = max(1, int(torch.Size(p.batch_shape).numel()))
        stand_ins = [stand_in((b, t.shape[-3], t.shape[-2], d), t.dtype, query.device) for t in (query, key)]
        kw = dict(causal=is_causal and p.mask == NO_MASK, align="top_left", window=(-1, -1), softcap=0.0,
                  alibi_slopes=None, key_bias=None)
        mask = None
        if p.mask != NO_MASK:
            kw["key_bias"] = stand_in((b, key.shape[-2]), torch.float32, query.device)
            mask = f"{p.mask}: the kernels' per-key bias (key_bias switch)"
        fwd, bwd = _variant_plan(profile, *stand_ins, kw, dv)
        notes = () if d == e else (f"head_dim {e} runs zero-padded to {d}",)
        if dv is not None:
            notes += _head_dim_v_notes(ev, d, dv, bwd)
        return Explanation(path, None, profile.name, fwd, bwd, mask=mask, notes=notes)
    fwd, bwd = (select_config(profile, direction, DTYPE_NAMES[query.dtype], e, is_causal, key.shape[-2])
                for direction in ("fwd", "bwd"))
    return Explanation(path, None, profile.name, fwd, bwd)


def _head_dim_v_notes(dv: int, width: int, width_v: int, bwd) -> tuple[str, ...]:
    """explain()'s notes on a V head dim `dv` of its own, run at `width_v` beside Q's `width`, and how the
    backward (its Selection, or None) runs it."""
    wider = max(width, width_v)
    notes = (f"V's head dim {dv} runs zero-padded to {width_v}",) if width_v != dv else ()
    if wider > HEAD_DIM_MAX:
        return notes + (f"no backward: its head dims, {width} and {width_v}, reach past {HEAD_DIM_MAX}",)
    if bwd is not None and bwd.config.head_dim_v is None:
        return notes + (f"the backward runs Q, K and V zero-padded to one head dim, {wider} (the {bwd.config.family} "
                        f"family's backward has one)",)
    return notes


def _variant_plan(profile, q, k, kw, head_dim_v: int | None = None):
    from autoflash.dispatch.variant_ops import kernel_plan

    return kernel_plan(profile, q, k, kw, head_dim_v=head_dim_v)


def _explain_entry(fn, args, kwargs, gpu: str | None) -> Explanation:
    from autoflash.dispatch import kvcache
    from autoflash.dispatch.flash_api import Captured, explaining

    name = getattr(fn, "__name__", repr(fn))
    try:
        with explaining(gpu):
            fn(*args, **kwargs)
    except Captured as captured:
        call = captured.call
    else:
        raise TypeError(f"explain: got {name}, expected autoflash.attention or a function of autoflash's flash-attn "
                        "API (flash_attn_func, flash_attn_varlen_func, their packed forms, flash_attn_with_kvcache)")
    entry = name
    if call.fallback is not None and gpu is None:
        return Explanation(REFERENCE_FALLBACK, call.fallback, None, None, None, entry=entry)
    profile = _profile(gpu, call.q)  # the call's own q, or its stand-in on the call's device
    path = _path(gpu, call.q)
    notes = () if call.head_dim == call.q.shape[-1] or isinstance(call, kvcache.KvCacheCall) else \
        (f"head_dim {call.head_dim} runs zero-padded to {call.q.shape[-1]}",)
    dv = getattr(call, "head_dim_v", None)
    notes = getattr(call, "notes", ()) + notes
    if isinstance(call, kvcache.KvCacheCall):
        selection, splits, how = kvcache.kernel_plan(profile, call)
        notes += (f"key splits: {splits} ({how})",)
        if call.qv:
            cfg = selection.config
            notes += ("qv: the scores q . k + qv . v, each V tile read once for both products"
                      + (f" (each of the {cfg.head_split} blocks sharing O reads all {cfg.dv} of V's columns)"
                         if cfg.head_split > 1 else ""),)
        if call.head_dim != call.shape.head_dim:
            notes += (f"head_dim {call.shape.head_dim} runs zero-padded to {call.head_dim} (the caches copied "
                      "padded for each call)",)
        if dv is not None and dv != call.shape.dv:
            notes += (f"V's head dim {call.shape.dv} runs zero-padded to {dv} (the caches copied padded for each "
                      "call)",)
        return Explanation(path, None, profile.name, selection, None, entry=entry, notes=notes)
    fwd, bwd = _variant_plan(profile, call.q, call.k, call.variant, call.v.shape[-1] if dv is not None else None)
    if dv is not None:
        notes += _head_dim_v_notes(dv, call.q.shape[-1], call.v.shape[-1], bwd)
    return Explanation(path, None, profile.name, fwd, bwd, entry=entry, notes=notes)
