"""What the launchers hand the kernels, where a real GPU would break and the emulator alone would not:
- an argument the call does not have is a null pointer, never a tensor the launcher made and kept
  (a cached index tensor filled on one stream, or inside a CUDA graph capture, could be read unfilled
  by a launch on another stream or outside the graph: for cache_batch_idx that is out-of-bounds K/V);
- packed batches of more than 65,535 sequences are launched in runs that fit gridDim.z;
- a contiguous view whose storage offset is not 16-byte aligned is copied, not refused."""
import pytest
import torch

import autoflash
from autoflash.kernels import launch
from autoflash.kernels.checks import GRID_YZ_MAX
from autoflash.reference.backward import attention_backward_ref
from autoflash.reference.forward import attention_ref, attention_varlen_ref, within_tolerance
from autoflash.reference.kvcache import attention_kvcache_ref

from gpu_inputs import device


@pytest.fixture
def launches(monkeypatch):
    """Every launch as (grid, {parameter name: tensor or None})."""
    seen = []
    real = launch._call

    def spy(fn, grid, threads, smem, dev, params, tensors, scalars, names=(), maps=()):
        seen.append((grid, dict(zip(names[len(maps):], tensors))))  # names label the maps first
        return real(fn, grid, threads, smem, dev, params, tensors, scalars, names, maps)

    monkeypatch.setattr(launch, "_call", spy)
    return seen


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_makes_no_index_tensor(target, launches, splits):
    """cache_seqlens as an int, no batch index, no left padding, no block table: null pointers (the
    template's defaults), results as with the tensors spelled out; given tensors pass as they are."""
    dev = device(target)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, 64, generator=g).to(dev, torch.bfloat16)
    k_cache, v_cache = (torch.randn(2, 600, 2, 64, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    out = autoflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=500, num_splits=splits)
    (grid, args), *combine = launches
    assert all(args[n] is None for n in ("cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table"))
    assert (args["o_accum"] is None) == (splits == 1) and len(combine) == (splits > 1)
    assert all(args[n] is None for n in ("cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "key_bias"))
    ref, _ = attention_kvcache_ref(q.cpu(), k_cache.cpu(), v_cache.cpu(), [500, 500])
    assert (out.cpu().float() - ref.float()).abs().max() < 2e-2

    launches.clear()
    seqlens = torch.tensor([500, 500], dtype=torch.int32, device=dev)
    batch_idx = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    leftpad = torch.zeros(2, dtype=torch.int32, device=dev)
    spelled = autoflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, cache_batch_idx=batch_idx,
                                                cache_leftpad=leftpad, num_splits=splits)
    args = launches[0][1]
    assert args["cache_seqlens"] is seqlens and args["cache_batch_idx"] is batch_idx
    assert args["cache_leftpad"] is leftpad
    assert torch.equal(spelled, out)


def test_the_forward_and_backward_make_no_stand_in(target, launches):
    dev = device(target)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 64, generator=g).to(dev, torch.bfloat16).requires_grad_() for _ in range(3))
    out = autoflash.flash_attn(q, k, v)
    out.backward(torch.ones_like(out))
    variant = ("cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "key_bias")
    assert len(launches) >= 3 and all(args[n] is None for _, args in launches for n in variant if n in args)


@pytest.mark.slow
def test_packed_batches_past_the_grid_limit_run_in_runs(launches):
    """65,537 packed sequences (most empty, ALiBi per sequence): every launch's gridDim.y and z within
    65,535, and outputs and gradients as the reference's; the sequences past the first run's are
    the ones that would be lost or misplaced."""
    n = GRID_YZ_MAX + 2
    lengths = torch.zeros(n, dtype=torch.int64)
    lengths[[0, 5, n - 3, n - 2, n - 1]] = torch.tensor([3, 7, 5, 2, 6])
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    g = torch.Generator().manual_seed(0)
    total, h, d = int(cu[-1]), 2, 64
    q, k, v, dout = (torch.randn(total, h, d, generator=g).bfloat16() for _ in range(4))
    slopes = torch.rand(n, h, generator=g) * 0.3
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with autoflash.emulate("a100"):
        out = autoflash.flash_attn_varlen_func(*leaves, cu, cu, 7, 7, causal=True, alibi_slopes=slopes)
        grads = torch.autograd.grad(out, leaves, dout)
    assert launches and all(grid[1] <= GRID_YZ_MAX and grid[2] <= GRID_YZ_MAX for grid, _ in launches)
    assert sorted(grid[2] for grid, args in launches if "alibi_slopes" in args and "dq" not in args) \
        == sorted([GRID_YZ_MAX, 2] * 2)  # the forward's and the dK/dV kernel's runs
    kw = dict(causal=True, align="bottom_right")
    ref_leaves = [t.float().requires_grad_() for t in (q, k, v)]
    yard_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_varlen_ref(*ref_leaves, cu, cu, alibi_slopes=slopes, **kw)
    yard, _ = attention_varlen_ref(*yard_leaves, cu, cu, alibi_slopes=slopes, upcast=False, **kw)
    ok, err, bound = within_tolerance(out.detach(), ref.detach(), yard.detach())
    assert ok, f"out: err {err:.3e} > bound {bound:.3e}"
    refs = torch.autograd.grad(ref, ref_leaves, dout.float())
    yards = torch.autograd.grad(yard, yard_leaves, dout)
    for name, got, r, y in zip(("dq", "dk", "dv"), grads, refs, yards):
        ok, err, bound = within_tolerance(got, r, y, backward=True)
        assert ok, f"{name}: err {err:.3e} > bound {bound:.3e}"


def _misaligned(shape, dev, g):
    """A contiguous view of `shape` whose storage starts 2 bytes past a 16-byte boundary."""
    flat = torch.randn(1 + torch.Size(shape).numel(), generator=g).to(dev, torch.bfloat16)
    view = flat[1:].view(shape)
    assert view.is_contiguous() and view.data_ptr() % 16 == 2
    return view


def test_misaligned_contiguous_views_are_copied(target):
    dev = device(target)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (_misaligned((1, 2, 33, 64), dev, g) for _ in range(4))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = autoflash.attention(*leaves, is_causal=True, strict=True)
    grads = torch.autograd.grad(out, leaves, dout)
    x = [t.detach() for t in (q, k, v)]
    ok, err, bound = within_tolerance(out.detach(), attention_ref(*x, causal=True)[0],
                                      attention_ref(*x, causal=True, upcast=False)[0])
    assert ok, f"out: err {err:.3e} > bound {bound:.3e}"
    for name, got, r, y in zip(("dq", "dk", "dv"), grads, attention_backward_ref(*x, dout, causal=True),
                               attention_backward_ref(*x, dout, causal=True, upcast=False)):
        ok, err, bound = within_tolerance(got, r, y, backward=True)
        assert ok, f"{name}: err {err:.3e} > bound {bound:.3e}"
    flash = autoflash.flash_attn_func(*(t.transpose(1, 2) for t in x), causal=True)  # flash-attn's layout
    assert torch.allclose(flash.transpose(1, 2).float(), out.detach().float(), atol=2e-2)
    q1 = _misaligned((1, 1, 2, 64), dev, g)  # a decode step's queries
    k_cache, v_cache = (torch.randn(1, 40, 2, 64, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    ref, _ = attention_kvcache_ref(q1.cpu(), k_cache.cpu(), v_cache.cpu(), [40])
    got = autoflash.flash_attn_with_kvcache(q1, k_cache, v_cache, cache_seqlens=40)
    assert (got.cpu().float() - ref.float()).abs().max() < 2e-2
