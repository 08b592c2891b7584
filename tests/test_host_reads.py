"""No entry point reads a value back to the host per call on CUDA (a synchronisation, and illegal under
CUDA graph capture), as flash-attn's calls do not: index tensors' values are checked on CPU tensors,
on CUDA only in the AUTOFLASH_CHECK_VALUES=1 debug mode; a (B, 1, Lq, Lk) mask is compared once per
mask tensor; autoflash.hf forms its decode arguments on the device.

On the CPU the spy runs the emulated kernels with AUTOFLASH_CHECK_VALUES=0 (what a CUDA call does)
and fails on any read of a tensor's values (tolist, item, bool, int, float, index, torch.equal). On
a GPU (`gpu` marker) torch's sync debug mode errors on any synchronising call, and every entry point
is captured into a CUDA graph and replayed against its eager result."""
import contextlib
import math

import pytest
import torch

import autoflash
import autoflash.hf
from autoflash.dispatch import sdpa
from autoflash.kernels import checks

READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture
def no_reads(monkeypatch):
    """A context manager inside which every read of a tensor's values raises (and is counted in
    its list), with AUTOFLASH_CHECK_VALUES=0: what a call on CUDA tensors does."""
    seen = []

    def forbid(name):
        def spy(self, *a, **kw):
            seen.append(name)
            raise AssertionError(f"a host read during the call: {name}")
        return spy

    @contextlib.contextmanager
    def calls():
        with pytest.MonkeyPatch.context() as m:
            for name in READS:
                m.setattr(torch.Tensor, name, forbid(f"Tensor.{name}"))
            m.setattr(torch, "equal", forbid("torch.equal"))
            m.setenv(checks.CHECK_VALUES_ENV, "0")
            yield seen

    return calls


def _packed(g, lengths, h, d):
    return torch.randn(sum(lengths), h, d, generator=g).bfloat16().requires_grad_()


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _varlen_call(g, dev="cpu"):
    lengths = [5, 0, 33, 17]
    cu = _cu(lengths).to(dev)
    q, k, v = (_packed(g, lengths, h, 64).detach().to(dev).requires_grad_() for h in (4, 2, 2))
    return (q, k, v, cu, cu, max(lengths), max(lengths)), dict(causal=True)


def _kvcache_call(g, dev="cpu"):
    q = torch.randn(2, 3, 4, 64, generator=g).bfloat16().to(dev)
    k_cache, v_cache = (torch.randn(6, 32, 2, 64, generator=g).bfloat16().to(dev) for _ in range(2))
    k, v = (torch.randn(2, 3, 2, 64, generator=g).bfloat16().to(dev) for _ in range(2))
    return (q, k_cache, v_cache, k, v), dict(cache_seqlens=torch.tensor([20, 9], dtype=torch.int32, device=dev),
                                             block_table=torch.tensor([[4, 1], [0, 5]], dtype=torch.int32, device=dev),
                                             causal=True, num_splits=2)


def test_checks_values_policy(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.delenv(checks.CHECK_VALUES_ENV, raising=False)
    assert checks.checks_values(cpu) and not checks.checks_values(cuda)  # the CPU costs nothing; CUDA trusts
    monkeypatch.setenv(checks.CHECK_VALUES_ENV, "1")
    assert checks.checks_values(cpu) and checks.checks_values(cuda)  # the debug mode
    capturing[0] = True
    assert not checks.checks_values(cuda) and not checks.host_reads_possible(cuda)  # capture forbids reads
    assert checks.host_reads_possible(cpu)
    monkeypatch.setenv(checks.CHECK_VALUES_ENV, "0")
    assert not checks.checks_values(cpu)
    monkeypatch.setenv(checks.CHECK_VALUES_ENV, "sometimes")
    with pytest.raises(ValueError, match="AUTOFLASH_CHECK_VALUES: got 'sometimes', expected 1"):
        checks.checks_values(cpu)


def test_flash_attn_varlen_func_reads_nothing_back(no_reads):
    args, kw = _varlen_call(torch.Generator().manual_seed(0))
    dout = torch.ones(args[0].shape, dtype=args[0].dtype)
    with autoflash.emulate("a100"), no_reads() as seen:
        out = autoflash.flash_attn_varlen_func(*args, **kw)
        out.backward(dout)
    assert not seen and out.shape == args[0].shape


def test_flash_attn_with_kvcache_reads_nothing_back(no_reads):
    args, kw = _kvcache_call(torch.Generator().manual_seed(0))
    with autoflash.emulate("a100"), no_reads() as seen:
        out = autoflash.flash_attn_with_kvcache(*args, **kw)
    assert not seen and out.shape == args[0].shape


@pytest.mark.parametrize("q_len", [1, 24], ids=["decode", "prefill"])
def test_hf_attention_reads_nothing_back(no_reads, q_len):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, q_len, 64, generator=g).bfloat16()
    k, v = (torch.randn(2, 2, 40, 64, generator=g).bfloat16() for _ in range(2))
    key_mask = torch.ones(2, 40, dtype=torch.bool)
    key_mask[1, :7] = False  # left padding
    key_mask[0, 30] = False  # a hole
    with autoflash.emulate("a100"), torch.no_grad(), no_reads() as seen:
        out = autoflash.hf.run(q, k, v, key_mask, causal=True, window=(-1, -1), softcap=0.0, dropout=0.0, scale=None,
                               enable_gqa=True)
    assert not seen and out.shape == q.shape


def test_attention_reads_a_padding_mask_once_per_tensor(monkeypatch):
    """A (B, 1, Lq, Lk) mask's values decide its path: one comparison per mask tensor, not per call
    (a model's layers share one), again after an in-place change."""
    compared = []
    real = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: compared.append(1) or real(a, b))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 64, generator=g).bfloat16() for _ in range(3))
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    mask[1, :, :, 12:] = False
    sdpa._MASK_VERDICTS.clear()
    with autoflash.emulate("a100"):
        for _ in range(3):
            autoflash.attention(q, k, v, attn_mask=mask, strict=True)
        assert len(compared) == 1
        mask[0, :, 3, 5] = False  # now it varies over queries: seen, and the call falls back
        with pytest.raises(sdpa.UnsupportedCallError, match="varies over queries"):
            autoflash.attention(q, k, v, attn_mask=mask, strict=True)
    assert len(compared) == 2


# ------------------------------------------------------------------ on a GPU
def _gpu_cases():
    """(name, function of a generator -> a call's result); each builds its own CUDA inputs."""
    def attention(g):
        q, k, v = (torch.randn(2, 4, 77, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
        mask = torch.ones(2, 1, 1, 77, dtype=torch.bool, device="cuda")
        mask[1, ..., 60:] = False
        return lambda: autoflash.attention(q, k, v, attn_mask=mask, strict=True)

    def flash_attn(g):
        q, k, v = (torch.randn(2, 77, 4, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
        return lambda: autoflash.flash_attn_func(q, k, v, causal=True)

    def varlen(g):
        args, kw = _varlen_call(g, "cuda")
        args = tuple(a.detach() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
        return lambda: autoflash.flash_attn_varlen_func(*args, **kw)

    def kvcache(g):
        (q, k_cache, v_cache, _, _), kw = _kvcache_call(g, "cuda")
        return lambda: autoflash.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)  # nothing appended: replayable

    def hf_decode(g):
        q = torch.randn(2, 4, 1, 64, generator=g).to("cuda", torch.bfloat16)
        k, v = (torch.randn(2, 2, 40, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
        key_mask = torch.ones(2, 40, dtype=torch.bool, device="cuda")
        key_mask[1, :7] = False
        return lambda: autoflash.hf.run(q, k, v, key_mask, causal=True, window=(-1, -1), softcap=0.0, dropout=0.0,
                                        scale=None, enable_gqa=True)

    return {"attention": attention, "flash_attn_func": flash_attn, "flash_attn_varlen_func": varlen,
            "flash_attn_with_kvcache": kvcache, "hf_decode": hf_decode}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(_gpu_cases()))
def test_a_cuda_call_does_not_synchronise(name):
    call = _gpu_cases()[name](torch.Generator().manual_seed(0))
    call()  # compile and load first: the module load is not what is measured
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(_gpu_cases()))
def test_every_entry_point_is_captured_by_a_cuda_graph(name):
    call = _gpu_cases()[name](torch.Generator().manual_seed(0))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():  # warm-up on a side stream, as torch's docs ask
        eager = call().clone()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        captured = call()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager) and not math.isnan(captured.float().sum().item())
