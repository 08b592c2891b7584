"""The host emulator as a product: autoflash.emulate() / AUTOFLASH_EMULATE, what CPU calls give back,
selection as on the emulated GPU, the missing-compiler error, and the sanitizer: a template with an
injected bug of each kind is caught (with its kind, kernel, template line, block and thread), and every
built-in default of every GPU profile runs clean under it."""
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import autoflash
import sampling
from autoflash import emulation
from autoflash.kernels.defaults import default_backward_config, default_config
from autoflash.emulation import build, context, module
from autoflash.emulation.guards import guarded_randn
from autoflash.kernels.gpus import PROFILES, get_profile
from autoflash.reference.forward import attention_ref, within_tolerance
from autoflash.reference.backward import attention_backward_ref
from autoflash.kernels.resources import templates_dir
from autoflash.selfcheck import main as selfcheck

FA_HEAD_DIMS = (32, 40, 64, 96, 128, 160, 192, 224, 256)


def _qkv(b, hq, hkv, lq, lk, d, dtype=torch.bfloat16, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g).to(dtype).requires_grad_(grad)
                 for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))


# ------------------------------------------------------------------ emulate() and the environment
def test_emulate_nests_and_restores():
    assert emulation.active() is None
    with autoflash.emulate("l4") as outer:
        assert emulation.active() is outer and outer.gpu == "l4" and not outer.sanitize
        with autoflash.emulate("h100", sanitize=True) as inner:
            assert emulation.active() is inner and inner.sanitize
        assert emulation.active() is outer
    assert emulation.active() is None


def test_environment_variable(monkeypatch):
    monkeypatch.setenv(emulation.ENV, "a100")
    assert emulation.active().gpu == "a100" and not emulation.active().sanitize
    monkeypatch.setenv(emulation.ENV, "h100:sanitize")
    assert emulation.active().gpu == "h100" and emulation.active().sanitize
    monkeypatch.setenv(emulation.ENV, "h100:fast")
    with pytest.raises(ValueError, match=r"AUTOFLASH_EMULATE: got 'h100:fast', expected a GPU profile name \[.*\], "
                                         r"optionally followed by ':sanitize'"):
        emulation.active()
    monkeypatch.setenv(emulation.ENV, "0")
    assert emulation.active() is None
    # A value that is no profile names the variable and the profiles, also from deep in a call.
    for value in ("1", "a10"):
        monkeypatch.setenv(emulation.ENV, value)
        with pytest.raises(ValueError, match=rf"AUTOFLASH_EMULATE: got '{value}', expected a GPU profile name "
                                             rf"\[.*'a100'.*'h100'.*\]"):
            autoflash.attention(*(torch.randn(1, 1, 16, 64) for _ in range(3)))
    assert "context manager" in autoflash.emulate.__doc__ and "AUTOFLASH_EMULATE" in autoflash.emulate.__doc__


def test_bad_arguments_say_what_is_accepted():
    with pytest.raises(ValueError, match="h100"):
        with autoflash.emulate("h1000"):
            pass
    with pytest.raises(TypeError, match="sanitize: got 'yes', expected a bool"):
        with autoflash.emulate("h100", sanitize="yes"):
            pass


def test_cpu_tensors_without_emulation_are_refused_with_the_way_out():
    q, k, v = _qkv(1, 2, 2, 16, 16, 64)
    with pytest.raises(ValueError, match=r"flash_forward runs on CUDA tensors; got tensors on cpu .*autoflash.emulate"):
        autoflash.flash_forward(q, k, v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_outputs_and_gradients_come_back_like_the_gpu_path(dtype):
    """Dtypes and strides as on the GPU (out like q via empty_like, lse contiguous fp32, gradients with
    their inputs' strides, here a (B, S, H, D) storage seen as (B, H, S, D)), and the values within
    FlashAttention's rule."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, n, h, 64, generator=g).to(dtype).transpose(1, 2).requires_grad_()
               for h, n in ((4, 37), (2, 50), (2, 50)))
    with autoflash.emulate("a100"):
        out, lse = autoflash.flash_forward(q.detach(), k.detach(), v.detach(), causal=True)
        assert out.dtype == dtype and out.stride() == torch.empty_like(q).stride()
        assert lse.dtype == torch.float32 and lse.shape == (1, 4, 37) and lse.is_contiguous()
        o = autoflash.flash_attn(q, k, v, causal=True)
        dout = torch.randn_like(o)
        grads = torch.autograd.grad(o, (q, k, v), dout)
    for x, dx in zip((q, k, v), grads):
        assert dx.dtype == dtype and dx.shape == x.shape and dx.stride() == x.stride()
    up = torch.float64 if dtype == torch.float32 else torch.float32
    x = [t.detach() for t in (q, k, v)]
    ok, err, bound = within_tolerance(out, attention_ref(*(t.to(up) for t in x), causal=True)[0],
                                      attention_ref(*x, causal=True, upcast=False)[0])
    assert ok, f"out: {err:.3e} > {bound:.3e}"
    refs = attention_backward_ref(*(t.to(up) for t in x), dout.to(up), causal=True)
    yards = attention_backward_ref(*x, dout, causal=True, upcast=False)
    for name, got, ref, yard in zip("qkv", grads, refs, yards):
        ok, err, bound = within_tolerance(got, ref, yard, backward=True)
        assert ok, f"d{name}: {err:.3e} > {bound:.3e}"


def test_selection_is_the_emulated_gpus(monkeypatch):
    """The config that runs is the one that GPU would pick: the L4's 99 KB defaults differ from the
    H100's, and each emulated call builds exactly its GPU's config."""
    built = []
    real = module.load_functions

    def spy(config, sanitize=False):
        built.append(config)
        return real(config, sanitize)

    monkeypatch.setattr(module, "load_functions", spy)
    q, k, v = _qkv(1, 2, 2, 70, 70, 128)
    for gpu in ("l4", "h100"):
        with autoflash.emulate(gpu):
            autoflash.flash_forward(q, k, v, causal=True)
            ex = autoflash.explain(q, k, v, is_causal=True)
        assert built[-1] == default_config(128, "bf16", True, get_profile(gpu)) == ex.forward.config
        assert ex.path == "autoflash kernels (emulated on the CPU)" and ex.gpu == gpu
    assert built[0] != built[1]


def test_strict_attention_runs_the_kernels_not_sdpa(monkeypatch):
    from autoflash.dispatch import sdpa as dispatch

    def no_sdpa(*args, **kwargs):
        raise AssertionError("fell back to torch SDPA")

    monkeypatch.setattr(dispatch, "_torch_sdpa", no_sdpa)
    q, k, v = _qkv(2, 4, 2, 33, 41, 64)
    with autoflash.emulate("h100"):
        out = autoflash.attention(q, k, v, is_causal=True, enable_gqa=True, strict=True)
    ref, _ = attention_ref(q, k, v, causal=True)
    assert within_tolerance(out, ref, attention_ref(q, k, v, causal=True, upcast=False)[0])[0]


def test_a_missing_compiler_is_named(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    build.compiler.cache_clear()
    try:
        with pytest.raises(emulation.EmulationError, match=r"C\+\+20 compiler.*/nonexistent/g\+\+: not found.*\$CXX"):
            build.compiler()
    finally:
        build.compiler.cache_clear()


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "sanitize"])
def test_kernels_build_on_the_precompiled_prelude(sanitize):
    """GCC takes prelude.h.gch only when it was built with the kernel's own flags; a mismatch is
    silent without -Winvalid-pch and costs a third of every build. -H marks a used PCH with '!'."""
    if not build._is_gcc():
        pytest.skip("the precompiled prelude is GCC's")
    header = build.prelude(sanitize)
    assert header.read_bytes() == (build.HEADERS / "prelude.h").read_bytes()
    command = build.kernel_command(sanitize)
    assert str(header) in command
    r = subprocess.run([*command, "-H", "-fsyntax-only", "-"], input="int x;\n", capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"! {header}.gch" in r.stderr.splitlines()[0], r.stderr[:2000]


# ------------------------------------------------------------------ the sanitizer
def _template_line(template: str, text: str) -> int:
    lines = (templates_dir() / template).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


# name: (kind, direction, old, new, selfcheck flags, template text whose line the finding names or None,
#        whether the results still meet the accuracy rule or None)
MUTATIONS = {
    # K and V rows up to seqlen_k inclusive: the mask hides K's extra row, but V's (a guard band, NaN)
    # reaches O through 0 * NaN
    "out-of-bounds": ("out-of-bounds", "fwd", "copier.copy_any(tile, n, seqlen_k);",
                      "copier.copy_any(tile, n, seqlen_k + 1);", [], "copier.copy_any(tile, n, seqlen_k)", False),
    # a paged cache's rows counted from the page table's first page instead of each tile's own
    "out-of-bounds-paged": ("out-of-bounds", "fwd", "(n % page_size) * copier.stride", "n * copier.stride",
                            ["--kvcache", "--paged", "32"], "copier.copy_any_at(tile, shift", False),
    "race": ("race", "fwd", "  __syncthreads();\n\n  // -- coalesced store", "\n\n  // -- coalesced store", [],
             None, False),
    "misaligned": ("misaligned", "fwd", "ldmatrix_x4(a[mt], q_lane.at(2 * s, mt * 16));",
                   "ldmatrix_x4(a[mt], q_lane.at(2 * s, mt * 16) + 4);", [], "ldmatrix_x4(a[mt], q_lane", False),
    # the steady-state loop reads its tile's V before the copy landed (133 keys: a masked tile, then one)
    "uninitialized": ("uninitialized", "fwd", "cp_async_wait<IN_FLIGHT>();\n        __syncthreads();  // this tile's V",
                      "cp_async_wait<IN_FLIGHT + 2>();\n        __syncthreads();  // this tile's V", [], None, False),
    "barrier": ("barrier", "fwd", "  __syncthreads();\n\n  // -- coalesced store",
                "  if (tid >= 32) __syncthreads();\n\n  // -- coalesced store", ["--causal"], None, None),
    # an overflowing product that decides nothing: only the UBSan checks see it
    "undefined": ("undefined", "fwd", "  const int m_start = m_block * BLOCK_M;",
                  "  const int m_start = m_block * BLOCK_M;\n"
                  "  if (max_seqlen_q * max_seqlen_k * max_seqlen_k * max_seqlen_k * max_seqlen_q == 7) return;", [], None, True),
    "race-bwd": ("race", "bwd", "__syncthreads();  // P and dS complete", "// (barrier removed)", ["--causal"],
                 None, None),
    "out-of-bounds-bwd": ("out-of-bounds", "bwd", "q_copy.template copy<true>(smem.q[slot], m0, seqlen_q);",
                          "q_copy.template copy<true>(smem.q[slot], m0, seqlen_q + 1);", [],
                          "q_copy.template copy<true>(smem.q[slot]", None),
    # one past the end of smem.lse[slot]: the memory is the block's own (smem.delta), the index is not
    "array-bounds-bwd": ("out-of-bounds", "bwd", "const float lse_log2 = smem.lse[slot][row] * 1.4426950408889634f;",
                         "const float lse_log2 = smem.lse[slot][row + 1] * 1.4426950408889634f;", [],
                         "const float lse_log2 = smem.lse[slot][row]", None),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_sanitizer_catches_an_injected_bug(mutate, capsys, name):
    kind, direction, old, new, flags, line_text, accurate = MUTATIONS[name]
    mutate(direction, old, new)
    shape = ["--shape", "1,2,1,77,133,64"] + (["--backward"] if direction == "bwd" else [])
    gpu = "a100"  # the H100's plain forward and backward (d = 64) are the sm90 family's templates
    status = selfcheck(["--emulate", gpu, "--sanitize", *shape, *flags])
    out = capsys.readouterr().out
    assert status == 1, out
    found = [f for f in emulation.findings() if f.kind == kind]
    assert found, out
    f = found[0]
    template = "flash_fwd.cu.j2" if direction == "fwd" else "flash_bwd.cu.j2"
    assert f.kernel.startswith(direction) and f.location.startswith(f"templates/{template}:"), str(f)
    assert len(f.block) == 3 and 0 <= f.thread < 1024
    if line_text is not None:
        where = f"templates/{template}:{_template_line(template, line_text)}"
        assert f.location == where or where in " ".join(f.frames), str(f)
    assert f"{kind}: {f.kernel} at templates/{template}:" in out  # what the CLI prints
    if accurate is not None:
        assert (" OUTSIDE THE RULE" not in out) == accurate, out


# The A100's d = 128 backward default (two stages, 64 query rows a step): a last query block past
# seqlen_q runs first with the masked steps and the steady-state loop has no bounds logic, so these
# lengths put a ragged block before the diagonal (causal), alone (not), and at a window's edge.
@pytest.mark.parametrize("flags", [[], ["--causal"], ["--window", "40,8"], ["--causal", "--align", "bottom_right"]],
                         ids=["plain", "causal", "window", "causal-bottom-right"])
def test_a100_d128_backward_ring_is_clean_with_ragged_query_blocks(capsys, flags):
    status = selfcheck(["--emulate", "a100", "--sanitize", "--backward", "--dtype", "bf16",
                             "--shape", "1,2,1,157,300,128", *flags])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "sanitizer: 0 findings" in out and out.count(" ok") == 4, out
    from autoflash.kernels.gpus import get_profile

    cfg = default_backward_config(128, "bf16", "--causal" in flags, get_profile("a100"))
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == (64, 128, 8, 2)


def test_unmutated_kernels_are_clean_and_the_cli_says_so(capsys):
    status = selfcheck(["--emulate", "a100", "--sanitize", "--backward", "--causal", "--shape", "1,4,2,77,133,96"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "sanitizer: 0 findings" in out and out.count(" ok") == 4


# selfcheck's variant flags: each switch at least once, forward and backward, under the sanitizer
VARIANT_FLAGS = {
    "causal-br": ["--causal", "--align", "bottom_right"],
    "window-softcap-alibi": ["--window", "16,0", "--align", "bottom_right", "--softcap", "30", "--alibi"],
    "window-two-sided": ["--window", "7,5"],
    "key-padding": ["--key-padding"],
    "varlen": ["--varlen", "--causal", "--align", "bottom_right", "--window", "9,3"],
    "chunk": ["--attention-chunk", "37", "--causal", "--align", "bottom_right"],
    "varlen-seqused-chunk": ["--varlen", "--seqused", "--attention-chunk", "20", "--window", "30,-1", "--align",
                             "bottom_right", "--seed", "2"],
}


# selfcheck's KV-cache flags (flash_attn_with_kvcache): paging, splits and the combine kernel, the
# append with rotary, left padding, cache_batch_idx, variants
KVCACHE_FLAGS = {
    "paged-split-rotary": ["--shape", "3,6,2,4,300,64", "--causal", "--new", "4", "--paged", "64", "--splits", "3",
                           "--rotary", "neox"],
    "leftpad-window-softcap": ["--shape", "3,4,2,2,150,64", "--window", "20,0", "--softcap", "10", "--new", "2",
                               "--leftpad", "--splits", "2"],
    "batch-idx-alibi": ["--shape", "2,4,4,1,200,128", "--causal", "--alibi", "--batch-idx", "--new", "1",
                        "--rotary", "interleaved"],
    "key-padding": ["--shape", "3,8,2,1,260,64", "--causal", "--key-padding", "--splits", "2"],
    "chunk-paged-split": ["--shape", "3,4,2,2,300,64", "--causal", "--attention-chunk", "48", "--paged", "64",
                          "--splits", "3", "--new", "2"],
}


@pytest.mark.parametrize("name", sorted(KVCACHE_FLAGS))
def test_kvcache_kernels_are_clean(capsys, name):
    status = selfcheck(["--emulate", "h100", "--sanitize", "--kvcache", *KVCACHE_FLAGS[name]])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "sanitizer: 0 findings" in out and out.count(" ok") == 2, out


@pytest.mark.parametrize("name", sorted(VARIANT_FLAGS))
def test_variant_kernels_are_clean(capsys, name):
    status = selfcheck(["--emulate", "h100", "--sanitize", "--backward", "--shape", "3,4,2,77,133,64",
                        *VARIANT_FLAGS[name]])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "sanitizer: 0 findings" in out and out.count(" ok") == 4, out


def _unique_defaults():
    configs = {}
    for gpu, profile in PROFILES.items():
        for d in FA_HEAD_DIMS:
            for dtype in ("fp16", "bf16", "fp32"):
                for causal in (False, True):
                    for cfg in (default_config(d, dtype, causal, profile),
                                default_backward_config(d, dtype, causal, profile)):
                        configs.setdefault(cfg, gpu)
    return sorted(configs.items(), key=lambda item: item[0].name)


DEFAULTS = _unique_defaults()


def sanitized_defaults(direction: str) -> list:
    """This run's share of DEFAULTS in one direction: one default per (family, dtype, causal, head-dim
    bucket), drawn from the run's seed; every one under AUTOFLASH_SWEEP=full (all of them took 12
    minutes of the suite's 42 on 2 cores)."""
    todo = [(cfg, gpu) for cfg, gpu in DEFAULTS if cfg.direction == direction]
    return sampling.sample(todo, lambda item: (item[0].family, item[0].dtype, item[0].causal,
                                               min(item[0].head_dim, 129) // 65), salt=f"sanitizer {direction}")


def _sanitized_run(cfg, gpu):
    """Runs one config at an odd GQA shape on guard-banded inputs; (problems, findings)."""
    from autoflash.kernels.checks import TORCH_DTYPES

    dt = TORCH_DTYPES[cfg.dtype]
    b, hq, hkv, lq, lk, d = 1, 2, 1, 77, 133, cfg.head_dim
    g = torch.Generator().manual_seed(7)
    layout = "bshd" if cfg.direction == "bwd" else "bhsd"
    q, k, v = (guarded_randn(b, h, n, d, dt, g, layout) for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
    up = torch.float64 if dt == torch.float32 else torch.float32
    problems = []
    lib = module.load_module(cfg, True)
    if cfg.direction == "fwd":
        out, _ = autoflash.flash_forward(q, k, v, causal=cfg.causal, config=cfg)
        ok, err, bound = within_tolerance(out, attention_ref(q.to(up), k.to(up), v.to(up), causal=cfg.causal)[0],
                                          attention_ref(q, k, v, causal=cfg.causal, upcast=False)[0])
        problems += [] if ok else [f"out {err:.3e} > {bound:.3e}"]
    else:
        out, lse = attention_ref(q, k, v, causal=cfg.causal)
        out = out.to(dt)
        dout = guarded_randn(b, hq, lq, d, dt, g, layout)
        grads = autoflash.flash_backward(dout, q, k, v, out, lse.float(), causal=cfg.causal, config=cfg)
        refs = attention_backward_ref(q.to(up), k.to(up), v.to(up), dout.to(up), causal=cfg.causal)
        yards = attention_backward_ref(q, k, v, dout, causal=cfg.causal, upcast=False)
        for name, got, ref, yard in zip(("dq", "dk", "dv"), grads, refs, yards):
            ok, err, bound = within_tolerance(got, ref, yard, backward=True)
            problems += [] if ok else [f"{name} {err:.3e} > {bound:.3e}"]
    return problems, lib.findings()


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_every_default_of_every_gpu_is_clean_under_the_sanitizer(direction):
    """Every built-in default (FlashAttention's head dims, three dtypes, causal or not) of every GPU
    profile, forward or backward, at an odd GQA shape (Lq 77, Lk 133) on guard-banded inputs: no
    finding, and results within FlashAttention's rule (per run: a default of each family, dtype,
    causal and head-dim bucket, sanitized_defaults). Configs run two at a time (one per core), all as on the H100
    (the largest shared memory: every profile's configs fit; the code does not depend on the GPU)."""
    todo = sanitized_defaults(direction)

    def one(item):
        return item[0].name, *_sanitized_run(*item)

    with autoflash.emulate("h100", sanitize=True), ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        results = list(pool.map(one, todo))
    bad = [f"{name}: {problems} {[str(f) for f in findings]}" for name, problems, findings in results
           if problems or findings]
    every = [cfg for cfg, _ in DEFAULTS if cfg.direction == direction]
    print(f"{len(results)} of {len(every)} {direction} default configs sanitized (seed {sampling.SEED})")
    assert not bad, "\n".join(bad)
    assert len(results) == len(todo) > 15 and {c.family for c, _ in todo} == {c.family for c in every}


# The thread orders the sm90 defaults run under besides the default: the two fixed ones and the run's
# random one, plus AUTOFLASH_SCHEDULES=N more random orders (seeds after the run's).
SCHEDULES = ("wake", "released-first", *(f"random:{sampling.SEED + i}"
                                         for i in range(1 + int(os.environ.get("AUTOFLASH_SCHEDULES") or 0))))


@pytest.mark.slow
def test_sm90_defaults_are_clean_under_the_other_schedules():
    """The sm90 family's defaults under the emulator's other thread orders (the default order runs in
    the sweep above): waiters woken at once, released threads first, and a random order from the
    run's seed. Per run one default per (direction, causal, head-dim bucket); all of them under
    AUTOFLASH_SWEEP=full."""
    todo = sampling.sample([(cfg, gpu) for cfg, gpu in DEFAULTS if cfg.family == "sm90"],
                           lambda item: (item[0].direction, item[0].causal, min(item[0].head_dim, 129) // 65),
                           salt="sanitizer schedules")
    bad = []
    for schedule in SCHEDULES:
        with autoflash.emulate("h100", sanitize=True, schedule=schedule), \
                ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            for (cfg, _), (problems, findings) in zip(todo, pool.map(lambda item: _sanitized_run(*item), todo)):
                bad += [f"{cfg.name} [{schedule}]: {problems} {[str(f) for f in findings]}"] if problems or findings else []
    assert not bad, "\n".join(bad)
    assert {(c.direction, c.causal) for c, _ in todo} == {(d, c) for d in ("fwd", "bwd") for c in (False, True)}


def test_sanitizer_guard_bands_are_not_elements():
    g = torch.Generator().manual_seed(0)
    t = guarded_randn(2, 3, 5, 40, torch.bfloat16, g, "bshd")
    assert t.shape == (2, 3, 5, 40) and not t.is_contiguous() and t.stride(-1) == 1
    storage = t.untyped_storage().nbytes() // t.element_size()
    assert storage > t.numel() and not torch.isnan(t).any()


def test_findings_format():
    f = module.Finding("race", "fwd_x", "templates/flash_fwd.cu.j2:270", (1, 0, 2), 5, "load reads ...",
                       ("templates/common/tile_io.cuh:28 store_tile", "templates/flash_fwd.cu.j2:270 fwd_x"))
    assert re.fullmatch(r"race: fwd_x at templates/flash_fwd.cu.j2:270 \(in templates/common/tile_io.cuh:28\), "
                        r"block \(1, 0, 2\), thread 5: load reads \.\.\.", str(f))
