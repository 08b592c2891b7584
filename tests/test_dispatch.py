"""autoflash.attention, the SDPA drop-in: validation, the fallback policy, the custom ops under
autograd and torch.compile, explain, patch_sdpa.

On the CPU every call takes the fallback (torch SDPA). The kernel path (reshaping, the custom ops,
their autograd and fake implementations, and the kernels themselves) runs on the CPU too with
`kernel_path`: inside autoflash.emulate("h100") CPU tensors run the H100's kernels on the host
emulator."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import autoflash
from autoflash.dispatch import ops, selection
from autoflash.dispatch import sdpa as dispatch
from autoflash.kernels import resources
from autoflash.kernels.codegen import template_hash
from autoflash.kernels.config import KernelConfig
from autoflash.dispatch.sdpa import FallbackWarning, UnsupportedCallError
from autoflash.tuning.problem import ProblemKey
from autoflash.dispatch.selection import HEURISTIC
from autoflash.tuning.table import Entry, Result, Table, merge_into, table_path


pytestmark = pytest.mark.usefixtures("fresh_fallback_policy")


@pytest.fixture
def kernel_path():
    """CPU tensors run the kernels, on the host emulator, as on an H100."""
    with autoflash.emulate("h100"):
        yield


def _qkv(q_shape, kv_shape, dtype=torch.float32, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(q_shape, generator=g, dtype=torch.float32).to(dtype)
    k, v = (torch.randn(kv_shape, generator=g, dtype=torch.float32).to(dtype) for _ in range(2))
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


# (query shape, key/value shape, kwargs): extra batch dims, Lq != Lk, GQA, scale, causal
CASES = {
    "4d": ((2, 4, 17, 64), (2, 4, 17, 64), {}),
    "causal_lq_lt_lk": ((2, 4, 9, 64), (2, 4, 23, 64), {"is_causal": True}),
    "causal_lq_gt_lk": ((1, 2, 23, 32), (1, 2, 9, 32), {"is_causal": True}),
    "extra_batch_dims": ((2, 3, 4, 11, 64), (2, 3, 4, 13, 64), {"is_causal": True}),
    "gqa": ((2, 8, 16, 128), (2, 2, 20, 128), {"enable_gqa": True, "is_causal": True}),
    "scale": ((1, 2, 10, 64), (1, 2, 12, 64), {"scale": 0.3}),
    "3d": ((4, 15, 64), (4, 15, 64), {"is_causal": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fallback_equals_sdpa_outputs_and_grads(case):
    q_shape, kv_shape, kw = CASES[case]
    q, k, v = _qkv(q_shape, kv_shape, grad=True)
    with pytest.warns(FallbackWarning, match="cpu tensors"):
        out = autoflash.attention(q, k, v, **kw)
    ref = F.scaled_dot_product_attention(q, k, v, **kw)
    assert torch.equal(out, ref)
    dout = torch.randn_like(out)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out, (q, k, v), dout),
                                                 torch.autograd.grad(ref, (q, k, v), dout)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_path_matches_sdpa(kernel_path, case):
    q_shape, kv_shape, kw = CASES[case]
    q, k, v = _qkv(q_shape, kv_shape, torch.bfloat16, grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # the kernel path must not fall back
        out = autoflash.attention(q, k, v, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q32, k32, v32, **kw)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    dout = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q32, k32, v32), dout.float())):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), r, atol=5e-2, rtol=5e-2)


def test_kernel_path_flattens_batch_dims_for_the_kernels(kernel_path, monkeypatch):
    calls = []
    real = dispatch._eager

    def spy(*args):
        calls.append(tuple(a.shape if isinstance(a, torch.Tensor) else a for a in args))
        return real(*args)

    monkeypatch.setattr(dispatch, "_eager", spy)
    q, k, v = _qkv((2, 3, 4, 11, 64), (2, 3, 2, 13, 64), torch.float16)
    out = autoflash.attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.shape == (2, 3, 4, 11, 64)
    # leading dims flattened into the batch, the default scale resolved to 1/sqrt(E)
    assert calls == [((6, 4, 11, 64), (6, 2, 13, 64), (6, 2, 13, 64), True, 0.125)]


@pytest.mark.parametrize("causal", [False, True])
def test_custom_op_registration(causal):
    q, k, v = _qkv((2, 4, 33, 64), (2, 2, 40, 64), torch.float64, grad=True)
    torch.library.opcheck(torch.ops.autoflash.attention_fwd.default, (q, k, v, causal, 0.125))
    dout = torch.randn(2, 4, 33, 64, dtype=torch.float64)
    out, lse = torch.ops.autoflash.attention_fwd(q, k, v, causal, 0.125)
    # the backward op has no autograd formula of its own (no double backward): checked on plain tensors
    torch.library.opcheck(torch.ops.autoflash.attention_bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), causal, 0.125))


def test_compile_fullgraph_on_the_fallback():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 64)

        def forward(self, q, k, v):
            return self.proj(autoflash.attention(q, k, v, is_causal=True))

    torch._dynamo.reset()
    model = Block()
    q, k, v = _qkv((2, 4, 16, 64), (2, 4, 16, 64))
    with pytest.warns(FallbackWarning):
        out = torch.compile(model, fullgraph=True)(q, k, v)
    torch.testing.assert_close(out, model.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


def _graph_recorder():
    """A torch.compile backend that keeps each graph it is given and runs it as is."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    return graphs, backend


def test_compile_fullgraph_traces_the_op_with_no_graph_break(kernel_path):
    graphs, backend = _graph_recorder()
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: autoflash.attention(q, k, v, is_causal=True, enable_gqa=True) * 2,
                       fullgraph=True, backend=backend)
    q, k, v = _qkv((2, 4, 16, 64), (2, 2, 16, 64), torch.bfloat16, grad=True)
    out = fn(q, k, v)
    out.float().sum().backward()
    assert len(graphs) == 1 and "torch.ops.autoflash.attention_fwd" in graphs[0].code
    eager = autoflash.attention(q, k, v, is_causal=True, enable_gqa=True) * 2
    torch.testing.assert_close(out, eager)
    assert q.grad is not None and torch.isfinite(q.grad.float()).all()
    torch._dynamo.reset()
    # aot_autograd: the fake implementations give the shapes, the backward op is traced too
    out2 = torch.compile(lambda q, k, v: autoflash.attention(q, k, v, is_causal=True, enable_gqa=True),
                         fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(out2 * 2, eager)


# ------------------------------------------------------------------ fallback policy
def test_one_warning_per_reason_pointing_at_the_caller():
    q, k, v = _qkv((1, 2, 8, 64), (1, 2, 8, 64))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            autoflash.attention(q, k, v)
        autoflash.attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool))  # cpu is still the reason
    fallbacks = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(fallbacks) == 1 and fallbacks[0].filename == __file__
    assert "cpu tensors" in str(fallbacks[0].message) and "strict=True" in str(fallbacks[0].message)


def test_each_reason_is_named(kernel_path):
    q, k, v = _qkv((1, 2, 8, 64), (1, 2, 8, 64), torch.bfloat16)
    reasons = {
        # a key-padding mask runs on the kernels (tests/test_key_padding.py); one that varies over queries does not
        "attn_mask varies over queries": dict(attn_mask=torch.ones(8, 8, dtype=torch.bool).tril()),
        "dropout_p": dict(dropout_p=0.1),
        "scale": dict(scale=-1.0),
    }
    for word, kw in reasons.items():
        with pytest.warns(FallbackWarning, match=word):
            autoflash.attention(q, k, v, **kw)
    with pytest.warns(FallbackWarning, match="dtype torch.float64"):
        autoflash.attention(q.double(), k.double(), v.double())
    with pytest.warns(FallbackWarning, match="float32 with an attn_mask"):  # plain float32 runs the SIMT kernels
        autoflash.attention(q.float(), k.float(), v.float(), attn_mask=torch.ones(1, 1, 1, 8, dtype=torch.bool))
    with pytest.warns(FallbackWarning, match="float32 with head_dim 60"):
        autoflash.attention(*_qkv((1, 2, 8, 60), (1, 2, 8, 60), torch.float32))
    with pytest.warns(FallbackWarning, match="head_dim 264"):
        autoflash.attention(*_qkv((1, 2, 8, 264), (1, 2, 8, 264), torch.bfloat16))
    with pytest.warns(FallbackWarning, match="value 520"):  # V's own head dim runs up to 512
        autoflash.attention(q, k, torch.randn(1, 2, 8, 520, dtype=torch.bfloat16))
    with pytest.warns(FallbackWarning, match="value 32"):  # and in float16 and bfloat16 only
        autoflash.attention(q.float(), k.float(), torch.randn(1, 2, 8, 32))
    with pytest.warns(FallbackWarning, match="no broadcasting"):
        autoflash.attention(q.expand(3, 2, 8, 64), k, v)


def test_strict_raises_instead_of_falling_back(monkeypatch):
    q, k, v = _qkv((1, 2, 8, 64), (1, 2, 8, 64))
    with pytest.raises(UnsupportedCallError, match="cpu tensors.*would run torch SDPA"):
        autoflash.attention(q, k, v, strict=True)
    monkeypatch.setenv(dispatch.STRICT_ENV, "1")
    with pytest.raises(UnsupportedCallError):
        autoflash.attention(q, k, v)
    with pytest.warns(FallbackWarning):  # an explicit strict=False wins over the environment
        autoflash.attention(q, k, v, strict=False)
    with pytest.raises(TypeError, match="strict: got 'yes'"):
        autoflash.attention(q, k, v, strict="yes")


# ------------------------------------------------------------------ bad input, as SDPA rejects it
Q = (2, 4, 8, 16)
BAD = {
    "batch": (Q, (3, 4, 10, 16), (3, 4, 10, 16), {}, ValueError, "broadcastable"),
    "head_dim": (Q, (2, 4, 10, 32), (2, 4, 10, 16), {}, ValueError, "head_dim"),
    "mask_shape": (Q, (2, 4, 10, 16), (2, 4, 10, 16), {"attn_mask": torch.ones(3, 10, dtype=torch.bool)},
                   ValueError, r"attn_mask: got shape \(3, 10\)"),
    "mask_dtype": (Q, (2, 4, 10, 16), (2, 4, 10, 16), {"attn_mask": torch.ones(8, 10, dtype=torch.float16)},
                   TypeError, "attn_mask: got torch.float16"),
    "dropout_negative": (Q, (2, 4, 10, 16), (2, 4, 10, 16), {"dropout_p": -0.1}, ValueError, r"\[0, 1\)"),
    "gqa_heads": ((2, 6, 8, 16), (2, 4, 10, 16), (2, 4, 10, 16), {"enable_gqa": True}, ValueError, "dividing"),
    "heads_without_gqa": (Q, (2, 2, 10, 16), (2, 2, 10, 16), {}, ValueError, "broadcastable"),
    "one_dim": ((16,), (16,), (16,), {}, ValueError, "expected \\(..., seqlen, head_dim\\)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_rejected_as_sdpa_rejects_it(case):
    q_shape, k_shape, v_shape, kw, error, message = BAD[case]
    q, k, v = torch.randn(q_shape), torch.randn(k_shape), torch.randn(v_shape)
    with pytest.raises(RuntimeError):  # SDPA rejects it too: autoflash refuses nothing SDPA accepts here
        F.scaled_dot_product_attention(q, k, v, **kw)
    with pytest.raises(error, match=message):
        autoflash.attention(q, k, v, **kw)
    with pytest.raises(error, match=message):  # the same check before explain, and before any kernel
        autoflash.explain(q, k, v, **kw, gpu="h100")


def test_bad_input_sdpa_documents_but_does_not_always_check():
    q, k, v = _qkv((2, 4, 8, 16), (2, 4, 10, 16))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        autoflash.attention(q, k, v, dropout_p=1.0)
    with pytest.raises(ValueError, match="attn_mask and is_causal"):  # "an error is thrown if both are set"
        autoflash.attention(q, k, v, attn_mask=torch.ones(8, 10, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match="same sequence length"):
        autoflash.attention(q, k, torch.randn(2, 4, 11, 16))
    with pytest.raises(TypeError, match="dtypes"):
        autoflash.attention(q, k.double(), v)
    with pytest.raises(TypeError, match="is_causal: got 1"):
        autoflash.attention(q, k, v, is_causal=1)
    with pytest.raises(TypeError, match="query: got list"):
        autoflash.attention([1.0], k, v)


def test_planning_reads_metadata_only():
    # meta tensors have shapes and dtypes but no data: planning and selection must not touch any
    q, k, v = (torch.empty(s, dtype=torch.bfloat16, device="meta") for s in ((2, 8, 4096, 128),) + ((2, 2, 4096, 128),) * 2)
    p = dispatch.plan(q, k, v, is_causal=True, enable_gqa=True, device_check=False)
    assert p.reason is None and p.scale == pytest.approx(128 ** -0.5)
    assert autoflash.explain(q, k, v, is_causal=True, enable_gqa=True, gpu="h100").uses_kernels


# ------------------------------------------------------------------ explain
@pytest.fixture
def tuned_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFLASH_TUNED_DIR", str(tmp_path))
    monkeypatch.setattr(resources, "tuned_dir", lambda: tmp_path / "none")
    selection.clear_cache()
    yield tmp_path
    selection.clear_cache()


def test_explain_reports_each_path(tuned_folder):
    q, k, v = _qkv((2, 8, 3000, 128), (2, 8, 3000, 128), torch.bfloat16)
    cpu = autoflash.explain(q, k, v, is_causal=True)
    assert not cpu.uses_kernels and "cpu tensors" in cpu.reason and "torch SDPA" in str(cpu)
    masked = autoflash.explain(q, k, v, attn_mask=torch.ones(3000, 3000, dtype=torch.bool).tril(), gpu="h100")
    assert not masked.uses_kernels and "attn_mask varies over queries" in masked.reason
    padding = autoflash.explain(q, k, v, attn_mask=torch.ones(2, 1, 1, 3000, dtype=torch.bool), gpu="h100")
    assert padding.uses_kernels and padding.mask.startswith("key padding") and "mask: key padding" in str(padding)

    heuristic = autoflash.explain(q, k, v, is_causal=True, gpu="h100")
    assert heuristic.uses_kernels and heuristic.forward.origin == heuristic.backward.origin == HEURISTIC
    assert heuristic.forward.key == ProblemKey("h100", "fwd", "bf16", 128, True, "le4k")
    assert heuristic.backward.config.direction == "bwd"

    winner = KernelConfig(head_dim=128, dtype="bf16", block_m=64, block_n=96, num_warps=4, num_stages=2, causal=True)
    entry = Entry(key=heuristic.forward.key, winner=Result.of(winner, 1.0, 100.0), default=None, sdpa_flash_ms=None,
                  runner_ups=(), shapes=((4, 16, 4096, 128),), evaluated=1, failed=0, trials=1,
                  date="2026-11-23T00:00:00+00:00")
    path = table_path(tuned_folder, "h100")
    merge_into(path, Table("h100", template_hash(), {"backend": "cuda"}, {}).with_entries(entry))
    selection.clear_cache()
    tuned = autoflash.explain(q, k, v, is_causal=True, gpu="h100")
    assert tuned.forward.config == winner and tuned.forward.origin == f"tuned table {path}"
    assert tuned.backward.origin == HEURISTIC  # only the forward was tuned
    text = str(tuned)
    assert winner.name in text and str(path) in text and "64x96" in text


def test_explain_names_an_unknown_gpu():
    q, k, v = _qkv((1, 2, 8, 64), (1, 2, 8, 64), torch.bfloat16)
    with pytest.raises(ValueError, match="h900"):
        autoflash.explain(q, k, v, gpu="h900")


# ------------------------------------------------------------------ patch_sdpa
def test_patch_sdpa_routes_and_restores():
    original = F.scaled_dot_product_attention
    q, k, v = _qkv((1, 2, 8, 64), (1, 2, 8, 64))
    with autoflash.patch_sdpa(strict=True):
        assert F.scaled_dot_product_attention is not original
        with pytest.raises(UnsupportedCallError):  # it is autoflash now (strict: no silent fallback)
            F.scaled_dot_product_attention(q, k, v)
    assert F.scaled_dot_product_attention is original
    with pytest.raises(KeyError):
        with autoflash.patch_sdpa():
            with pytest.warns(FallbackWarning):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            assert torch.equal(out, original(q, k, v, is_causal=True))  # the fallback is torch's own SDPA
            raise KeyError("restored on the way out of an exception too")
    assert F.scaled_dot_product_attention is original


def test_a_device_the_kernels_cannot_use_is_a_fallback_reason(monkeypatch):
    from autoflash.kernels import launch

    def too_old(index):
        raise ValueError(f"autoflash needs compute capability 8.0 or newer; got 7.5 for device {index}")

    monkeypatch.setattr(launch, "device_profile", too_old)
    monkeypatch.setattr(dispatch, "_device_reasons", {})
    assert "compute capability 8.0" in dispatch._probe_device(3)
    monkeypatch.setattr(launch, "device_profile", lambda index: None)
    assert dispatch._probe_device(3).startswith("autoflash needs")  # probed once per device, then cached
    assert dispatch._probe_device(4) == ""


@pytest.mark.parametrize("mask_shape", [(2, 1, 9, 12), (2, 8, 9, 12), (9, 12), (1, 12)])
def test_masks_that_broadcast_with_gqa_are_accepted(mask_shape):
    q, k, v = _qkv((2, 8, 9, 64), (2, 2, 12, 64))
    mask = torch.rand(mask_shape, generator=torch.Generator().manual_seed(0)) > 0.3
    mask[..., 0] = True  # every row sees a key
    with pytest.warns(FallbackWarning):
        out = autoflash.attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))


def test_compile_with_dynamic_shapes_needs_no_recompile(kernel_path):
    graphs, backend = _graph_recorder()
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: autoflash.attention(q, k, v, is_causal=True, enable_gqa=True),
                       fullgraph=True, dynamic=True, backend=backend)
    for length in (16, 24, 40):  # sequence lengths change; one graph serves them all
        q, k, v = _qkv((2, 4, length, 64), (2, 2, length + 3, 64), torch.bfloat16)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
        torch.testing.assert_close(fn(q, k, v).float(), ref, atol=2e-2, rtol=2e-2)
    assert len(graphs) == 1


def test_emulated_calls_run_the_user_tuned_config(tuned_folder, monkeypatch):
    """Inside autoflash.emulate("h100") selection is the H100's, table first: a tuned winner in the
    user's table is the kernel that runs (and gives SDPA's result within bf16 noise)."""
    from autoflash.emulation import module

    q, k, v = _qkv((1, 4, 70, 64), (1, 2, 90, 64), torch.bfloat16)
    winner = KernelConfig(head_dim=64, dtype="bf16", block_m=32, block_n=48, num_warps=2, num_stages=3, causal=True)
    key = ProblemKey("h100", "fwd", "bf16", 64, True, "le1k")
    entry = Entry(key=key, winner=Result.of(winner, 1.0, 100.0), default=None, sdpa_flash_ms=None, runner_ups=(),
                  shapes=((4, 16, 512, 64),), evaluated=1, failed=0, trials=1, date="2026-11-23T00:00:00+00:00")
    merge_into(table_path(tuned_folder, "h100"), Table("h100", template_hash(), {"backend": "cuda"}, {}).with_entries(entry))
    selection.clear_cache()
    ran = []
    real = module.load_functions
    monkeypatch.setattr(module, "load_functions", lambda cfg, sanitize=False: ran.append(cfg) or real(cfg, sanitize))
    with autoflash.emulate("h100"):
        out = autoflash.attention(q, k, v, is_causal=True, enable_gqa=True, strict=True)
        assert autoflash.explain(q, k, v, is_causal=True, enable_gqa=True).forward.config == winner
    assert ran == [winner]
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("d", [20, 59, 111])
def test_head_dims_without_tiles_run_zero_padded(d):
    """flash-attn's odd head dims (its tests use 59 and 111) run on the kernels, padded to the next
    head dim the kernels have and cut back: strict mode proves no fallback; FlashAttention-3's rule."""
    from autoflash.reference.backward import attention_backward_ref
    from autoflash.reference.forward import attention_ref, within_tolerance

    q, k, v = _qkv((2, 3, 37, d), (2, 3, 45, d), torch.bfloat16, grad=True)
    dout = torch.randn(2, 3, 37, d).to(torch.bfloat16)
    with autoflash.emulate("h100"):
        out = autoflash.attention(q, k, v, is_causal=True, strict=True)
        assert autoflash.explain(q, k, v, is_causal=True).forward.config.head_dim == max(32, -(-d // 8) * 8)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    x = [t.detach() for t in (q, k, v)]
    assert out.shape == q.shape and all(g.shape == t.shape for g, t in zip(grads, x))
    ok, err, bound = within_tolerance(out, attention_ref(*(t.float() for t in x), causal=True)[0],
                                      attention_ref(*x, causal=True, upcast=False)[0])
    assert ok, (err, bound)
    refs = attention_backward_ref(*(t.float() for t in x), dout.float(), causal=True)
    yards = attention_backward_ref(*x, dout, causal=True, upcast=False)
    for g, r, y in zip(grads, refs, yards):
        ok, err, bound = within_tolerance(g, r, y, backward=True)
        assert ok, (err, bound)


def test_explain_lists_every_fallback_reason():
    # A call that three things keep off the kernels: explain() names all three, not the first only;
    # the fallback still warns once, about the first.
    q = torch.randn(1, 2, 8, 64, dtype=torch.float64)
    k = torch.randn(1, 2, 8, 64, dtype=torch.float64)
    v = torch.randn(1, 2, 8, 32, dtype=torch.float64)
    text = str(autoflash.explain(q, k, v, dropout_p=0.5))
    for part in ("cpu tensors", "dtype torch.float64", "dropout_p > 0", "head_dim 64 (value 32)"):
        assert part in text, text
