"""The kernels as torch.library custom ops: `autoflash::attention_fwd` and `autoflash::attention_bwd`.

As custom ops with fake (meta) implementations and a registered autograd formula, torch.compile
traces a model through them as single nodes, with no graph break, and autograd reaches the backward
kernel. On CUDA the op picks its KernelConfig at run time (autoflash.dispatch.selection: tuned table, else
heuristic), from the tensors' metadata only. On the CPU inside autoflash.emulate() the ops run the
same kernels on the host emulator; outside it their CPU implementations are the plain PyTorch
references, so the registration (schema, fake, autograd) stays checkable anywhere
(autoflash.attention sends CPU tensors here only under emulation).

No `from __future__ import annotations` here: torch.library reads the signature's annotations as
types to build each op's schema.
"""
import torch

from autoflash.dispatch.policy import emulating
from autoflash.dispatch.selection import select_config
from autoflash.kernels.checks import DTYPE_NAMES, chunked
from autoflash.kernels.launch import flash_backward, flash_forward, profile_for
from autoflash.reference.forward import attention_ref


def selected_config(q: torch.Tensor, direction: str, is_causal: bool, seqlen_k: int):
    """The KernelConfig for a call on q's CUDA device, or the emulated GPU (tuned table, else heuristic)."""
    profile = profile_for(q, "autoflash.attention")
    return select_config(profile, direction, DTYPE_NAMES[q.dtype], q.shape[-1], is_causal, seqlen_k).config


def _forward_kernels(q, k, v, is_causal, scale):
    q, k, v = chunked(q), chunked(k), chunked(v)
    return flash_forward(q, k, v, causal=is_causal, scale=scale, config=selected_config(q, "fwd", is_causal, k.shape[2]))


def _backward_kernels(dout, q, k, v, out, lse, is_causal, scale):
    q, k, v, out, dout = (chunked(t) for t in (q, k, v, out, dout))
    return flash_backward(dout, q, k, v, out, lse, causal=is_causal, scale=scale,
                          config=selected_config(q, "bwd", is_causal, k.shape[2]),
                          deterministic=torch.are_deterministic_algorithms_enabled())


@torch.library.custom_op("autoflash::attention_fwd", mutates_args=(), device_types="cuda")
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) for q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D); lse (B, Hq, Lq) fp32 carries no gradient."""
    return _forward_kernels(q, k, v, is_causal, scale)


@attention_fwd.register_kernel("cpu")
def _attention_fwd_cpu(q, k, v, is_causal, scale):
    if emulating():
        return _forward_kernels(q, k, v, is_causal, scale)
    out, lse = attention_ref(q, k, v, causal=is_causal, scale=scale)
    return out.to(q.dtype), lse.to(torch.float32)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, is_causal, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("autoflash::attention_bwd", mutates_args=(), device_types="cuda")
def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, is_causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) like (q, k, v). Bit-reproducible under torch.use_deterministic_algorithms(True)."""
    return _backward_kernels(dout, q, k, v, out, lse, is_causal, scale)


@attention_bwd.register_kernel("cpu")
def _attention_bwd_cpu(dout, q, k, v, out, lse, is_causal, scale):
    if emulating():
        return _backward_kernels(dout, q, k, v, out, lse, is_causal, scale)
    # Closed form (an op runs below autograd, so no autograd inside): P = exp(scale q kᵀ - lse),
    # dV = Pᵀ dO, dS = P (dO Vᵀ - rowsum(dO * O)), dQ = scale dS K, dK = scale dSᵀ Q.
    f = torch.float64 if q.dtype == torch.float64 else torch.float32
    (b, hq, lq, d), (hkv, lk) = q.shape, k.shape[1:3]
    group = hq // hkv
    qf, of, dof = q.to(f), out.to(f), dout.to(f)
    kf, vf = k.to(f).repeat_interleave(group, 1), v.to(f).repeat_interleave(group, 1)
    s = scale * qf @ kf.transpose(-1, -2)
    if is_causal:  # top-left: query i sees keys j <= i
        s = s.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), float("-inf"))
    p = torch.exp(s - lse.to(f)[..., None])
    ds = p * (dof @ vf.transpose(-1, -2) - (dof * of).sum(-1, keepdim=True))
    dq, dk, dv = scale * ds @ kf, scale * ds.transpose(-1, -2) @ qf, p.transpose(-1, -2) @ dof
    if group > 1:
        dk, dv = dk.view(b, hkv, group, lk, d).sum(2), dv.view(b, hkv, group, lk, d).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, is_causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, is_causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_bwd(dout, q, k, v, out, lse, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)
