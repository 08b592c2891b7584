"""A pytest plugin that runs a peer's own test file (FlashAttention-3's hopper/test_flash_attn.py,
FlashAttention-2's tests/test_flash_attn.py) against autoflash on the host emulator: loaded by
`python -m autoflash.bench peer-tests` (autoflash.bench.peer_tests), never by autoflash's own tests.

What it changes, and nothing else:
- `flash_attn_interface` (FA3) and `flash_attn` (FA2) import autoflash's interfaces of the same names;
  `flash_attn`'s pure-PyTorch helpers (bert_padding) come from the checkout (AUTOFLASH_PEER_FA2_PACKAGE),
  `flash_attn.layers.rotary.apply_rotary_emb` (a Triton kernel there) is autoflash's PyTorch rotary, and
  `flash_attn.flash_attn_interface` holds what the tests read besides the API (USE_TRITON_ROCM False,
  _get_block_size_n for dropout masks, which autoflash does not have: it raises);
- tensors the tests put on "cuda" are made on the CPU, and every test runs inside
  autoflash.emulate(GPU), so each kernel call runs the emulated GPU's kernel;
- torch.cuda.get_device_capability and get_device_properties answer the emulated GPU's,
  torch.cuda.synchronize does nothing;
- the collection is cut to tests whose problem fits the emulator (AUTOFLASH_PEER_MAX_ELEMENTS, the
  product of the sequence lengths), less the test functions named in AUTOFLASH_PEER_EXCLUDE, and
  sampled (AUTOFLASH_PEER_SAMPLE cases, AUTOFLASH_PEER_SEED).
The tests' own assertions and tolerances decide pass or fail. Each test's kernel launches (their
families) and outcome go to AUTOFLASH_PEER_REPORT as JSON lines."""
from __future__ import annotations

import json
import os
import random
import sys
import types

import pytest
import torch

GPU = os.environ.get("AUTOFLASH_PEER_GPU", "h100")
_CAPABILITY = {"h100": (9, 0), "h200": (9, 0), "a100": (8, 0)}


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


class CudaOnCpu(torch.overrides.TorchFunctionMode):
    """Tensors asked for on "cuda" made on the CPU: factory functions' device=, .to("cuda"), .cuda()."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """flash_attn.layers.rotary.apply_rotary_emb for the tests' references, in PyTorch: x (batch, seqlen,
    heads, d) rotated on its first 2 * cos.shape[1] dims, row i of batch b at seqlen_offsets[b] + i."""
    from autoflash.dispatch.kvcache import apply_rotary

    if cu_seqlens is not None:
        raise NotImplementedError("apply_rotary_emb with cu_seqlens: not in the peer shim")
    b, n = x.shape[:2]
    offsets = seqlen_offsets.long() if isinstance(seqlen_offsets, torch.Tensor) else \
        torch.full((b,), int(seqlen_offsets), dtype=torch.long)
    out = apply_rotary(x, cos, sin, offsets[:, None] + torch.arange(n)[None, :], interleaved)
    return x.copy_(out) if inplace else out


def _block_size_n(*args, **kwargs):
    raise NotImplementedError("_get_block_size_n: the block size of FlashAttention-2's dropout mask; autoflash has no "
                              "attention dropout")


def _module(name: str, package: bool = False, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    if package:
        module.__path__ = []
    module.__dict__.update(attributes)
    sys.modules.setdefault(name, module)
    return module


def _alias_modules() -> None:
    import autoflash
    from autoflash import flash_attn_interface

    sys.modules["flash_attn_interface"] = flash_attn_interface
    api = {name: getattr(autoflash, name) for name in (
        "flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
        "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache")}
    fa2 = _module("flash_attn", True, __version__="2.8.3", **api)  # the API autoflash follows
    checkout = os.environ.get("AUTOFLASH_PEER_FA2_PACKAGE")  # its flash_attn/: bert_padding and the like
    if checkout:
        fa2.__path__ = [checkout]
    fa2.flash_attn_interface = _module("flash_attn.flash_attn_interface", USE_TRITON_ROCM=False,
                                       _get_block_size_n=_block_size_n, **api)
    fa2.layers = _module("flash_attn.layers", True)
    fa2.layers.rotary = _module("flash_attn.layers.rotary", apply_rotary_emb=apply_rotary_emb)


def pytest_configure(config):
    from autoflash.kernels.gpus import get_profile

    _alias_modules()
    capability = _CAPABILITY.get(GPU, (9, 0))
    profile = get_profile(GPU)
    properties = types.SimpleNamespace(name=f"{GPU} (emulated)", major=capability[0], minor=capability[1],
                                       total_memory=80 * 2**30, multi_processor_count=profile.sm_count)
    torch.cuda.get_device_capability = lambda *a, **k: capability
    torch.cuda.get_device_properties = lambda *a, **k: properties
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None


def _elements(params: dict) -> int:
    """The problem size a case asks of the emulator: seqlen_q x seqlen_k (each 1 when absent)."""
    q = params.get("seqlen_q", params.get("seqlen", 1))
    k = params.get("seqlen_k", params.get("seqlen", 1))
    return (q if isinstance(q, int) else 1) * (k if isinstance(k, int) else 1)


@pytest.hookimpl(trylast=True)  # after -k and the tests' own deselection
def pytest_collection_modifyitems(config, items):
    limit = int(os.environ.get("AUTOFLASH_PEER_MAX_ELEMENTS", "0") or 0)
    sample = int(os.environ.get("AUTOFLASH_PEER_SAMPLE", "0") or 0)
    excluded = set(filter(None, os.environ.get("AUTOFLASH_PEER_EXCLUDE", "").split(",")))
    keep = [i for i in items if i.originalname not in excluded
            and (not limit or _elements(getattr(i, "callspec", None) and i.callspec.params or {}) <= limit)]
    if sample and len(keep) > sample:
        keep = random.Random(int(os.environ.get("AUTOFLASH_PEER_SEED", "0"))).sample(keep, sample)
    chosen = set(map(id, keep))
    config.hook.pytest_deselected(items=[i for i in items if id(i) not in chosen])
    items[:] = [i for i in items if id(i) in chosen]


@pytest.fixture(autouse=True)
def _on_the_emulator(request, monkeypatch):
    import autoflash
    from autoflash.kernels import launch

    families, real = [], launch.kernel_functions

    def record(cfg, profile, t):
        families.append(cfg.family)
        return real(cfg, profile, t)

    monkeypatch.setattr(launch, "kernel_functions", record)
    request.node.autoflash_families = families
    with CudaOnCpu(), autoflash.emulate(GPU):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    path = os.environ.get("AUTOFLASH_PEER_REPORT")
    if not path or (report.when != "call" and report.outcome == "passed"):  # a call, or a failed setup/teardown
        return
    reason = ""
    if report.failed and call.excinfo is not None:
        text = str(call.excinfo.value)
        reason = f"{call.excinfo.typename}: {text.splitlines()[0] if text else ''}"
    elif report.skipped:
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    with open(path, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "function": item.originalname, "when": report.when,
                            "outcome": report.outcome, "reason": reason[:400],
                            "families": list(getattr(item, "autoflash_families", [])),
                            "seconds": round(report.duration, 1)}) + "\n")
