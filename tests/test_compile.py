"""CPU tier of the kernels themselves: a representative grid renders and compiles with NVRTC for
sm_80 and sm_90 (no GPU needed), the built-in defaults compile without register spills (the sm90
family's through its ptxas gate), and the shared-memory model agrees with ptxas. Every default
compiles in every run, and one of the switch sets it is held to (switched_defaults); the grid is
sampled as the emulated sweeps are (tests/sampling.py: one config
per direction, dtype, arch and head-dim range plus a share of the rest; AUTOFLASH_SWEEP=full compiles all)."""
import collections
import itertools
import os
import re
from concurrent.futures import ProcessPoolExecutor

import pytest

import sampling
from autoflash.kernels.compiler import Resources, compile_config, disassemble, static_smem_probe
from autoflash.kernels.config import KernelConfig
from autoflash.kernels.defaults import call_default, default_backward_config, default_config, default_decode_config
from autoflash.kernels.gpus import get_profile
from autoflash.kernels.launch import check_shared_memory

HEAD_DIMS = (32, 40, 64, 96, 128, 160, 192, 256)
DTYPES = ("fp16", "bf16", "fp32")
ARCH_PROFILES = {"sm_80": get_profile("a100"), "sm_90": get_profile("h100")}
# (block_m, block_n, num_warps, num_stages): several tile shapes per path, non-powers of two among them
TC_TILES = ((64, 64, 4, 1), (128, 64, 8, 2), (64, 80, 2, 3), (128, 32, 4, 2))
SIMT_TILES = ((32, 32, 4, 2), (16, 16, 4, 1), (64, 48, 4, 2))
# backward (block_m, block_n, num_warps, num_stages, head_split)
BWD_TILES = ((32, 64, 4, 2, 1), (64, 128, 8, 1, 2))
BWD_SIMT_TILES = ((32, 32, 4, 2, 1), (16, 64, 4, 1, 1))
STATIC_SMEM_LIMIT = 48 * 1024  # the most a kernel may declare statically


def _valid(**kw):
    try:
        return KernelConfig(**kw)
    except ValueError:
        return None


def grid():
    """The representative grid: a comprehension plus a filter (valid, fits the arch's smem)."""
    fwd = (
        _valid(head_dim=d, dtype=dt, block_m=m, block_n=n, num_warps=w, num_stages=s, causal=c)
        for d in HEAD_DIMS for dt in DTYPES for c in (False, True)
        for (m, n, w, s) in (SIMT_TILES if dt == "fp32" else TC_TILES)
    )
    bwd = (
        _valid(head_dim=d, dtype=dt, block_m=m, block_n=n, num_warps=w, num_stages=s, causal=c,
               direction="bwd", head_split=h)
        for d in HEAD_DIMS for dt in DTYPES for c in (False, True)
        for (m, n, w, s, h) in (BWD_SIMT_TILES if dt == "fp32" else BWD_TILES)
    )
    cfgs = itertools.chain(fwd, bwd)
    return [(cfg, arch) for cfg in cfgs if cfg is not None
            for arch, prof in ARCH_PROFILES.items() if cfg.smem_bytes <= prof.smem_per_block_optin]


# Variant switch sets the defaults are held to (bf16): the simplest (bottom-right causal), the
# heaviest (window, softcap, ALiBi, packed sequences at once), the key bias (padding masks), and the
# heaviest with FlashAttention-3's attention chunks.
HEAVIEST_CHUNKED = dict(window=True, chunk=True, softcap=True, alibi=True, varlen=True, align="bottom_right")
VARIANT_SETS = (dict(causal=True, align="bottom_right"),
                dict(window=True, softcap=True, alibi=True, varlen=True, align="bottom_right"),
                dict(key_bias=True), HEAVIEST_CHUNKED)


def _variant_default(direction: str, d: int, switches: dict, prof, head_dim_v: int | None = None) -> KernelConfig:
    """The kernel a call with these switches launches (defaults.call_default: on sm_90 the sm90 family's
    forward with its variants)."""
    return call_default(direction, d, "bf16", switches.get("causal", False),
                        {k: v for k, v in switches.items() if k != "causal"}, prof, head_dim_v)


# The sm90 family's sets, forward and backward, at every head dim it takes: the heaviest with a window,
# with causal and with attention chunks, and a key bias read beside softcap and ALiBi (kernels/defaults.py
# _sm90_biased_keys, _sm90_variant_tiles); ptxas leaves their producer and consumers little to spare
# at single head dims.
SM90_VARIANT_SETS = (dict(window=True, softcap=True, alibi=True, varlen=True, align="bottom_right"),
                     dict(causal=True, softcap=True, alibi=True, varlen=True, align="bottom_right"),
                     dict(softcap=True, alibi=True, key_bias=True), HEAVIEST_CHUNKED)


# Decode (KV-cache) switch sets the decode defaults are held to: the cache alone, bottom-right causal
# over pages split across blocks, window + softcap + ALiBi split, causal with a key bias
# (autoflash.hf's padding masks), attention chunks over pages split (Llama 4's decode), packed queries
# (FlashAttention-3's varlen KV-cache calls) causal over pages split and under the heaviest, and pages
# gathered row by row (any page size, left padding) causal split and with every switch at once.
DECODE_SETS = (dict(),
               dict(causal=True, align="bottom_right", paged=True, split=True),
               dict(window=True, softcap=True, alibi=True, align="bottom_right", split=True),
               dict(causal=True, align="bottom_right", key_bias=True, split=True),
               dict(window=True, chunk=True, align="bottom_right", paged=True, split=True),
               dict(causal=True, align="bottom_right", varlen=True, paged=True, split=True),
               dict(window=True, softcap=True, alibi=True, varlen=True, align="bottom_right", split=True),
               dict(causal=True, align="bottom_right", paged=True, gather=True, split=True),
               dict(window=True, chunk=True, softcap=True, alibi=True, varlen=True, align="bottom_right", paged=True,
                    gather=True, split=True))


# V head dims of their own (head_dim_v; FlashAttention-3's pairs and (128, 256)): the forward's and the
# KV-cache kernel's defaults, held to the variant and decode sets as the others are (on sm_90 the sm90
# family's forward and its backward with both head dims to its own sets).
HEAD_DIM_V_PAIRS = ((64, 256), (64, 512), (192, 128), (128, 256))
QV_PAIRS = ((320, 256), (576, 512))  # FlashAttention-3's qv: Q and K with its columns appended (forward only)
_NO_SWITCHES = dict(align="top_left", window=False, chunk=False, softcap=False, alibi=False, key_bias=False, varlen=False)


def defaults():
    """Every built-in default under its plain switches (forward, backward, decode, the sm90 family), and
    this run's draw of the switch sets they are held to (switched_defaults)."""
    fwd = {(default_config(d, dt, c, prof), arch)
           for d in HEAD_DIMS for dt in DTYPES for c in (False, True) for arch, prof in ARCH_PROFILES.items()}
    bwd = {(default_backward_config(d, dt, c, prof), arch)
           for d in HEAD_DIMS for dt in DTYPES for c in (False, True) for arch, prof in ARCH_PROFILES.items()}
    decode = {(default_decode_config(d, dt, prof, None, False), arch)
              for d in HEAD_DIMS for dt in ("fp16", "bf16") for arch, prof in ARCH_PROFILES.items()}
    # The sm90 family's defaults at every head dim it takes (multiples of 16): ptxas releases differ at
    # single head dims (12.9 and 13.0.88 spill d = 208's forward).
    h100 = ARCH_PROFILES["sm_90"]
    sm90 = {(make(d, "bf16", c, h100), "sm_90") for make in (default_config, default_backward_config)
            for d in range(32, 257, 16) for c in (False, True)}
    # packed sequences alone at d = 128: the backward's tiles depend on the release (STACK_SPILLS)
    sm90 |= {(call_default("bwd", 128, dt, c, dict(varlen=True), h100), "sm_90") for dt in ("fp16", "bf16")
             for c in (False, True)}
    wide_v = {(call_default("fwd", d, dt, c, _NO_SWITCHES, prof, dv), arch) for d, dv in HEAD_DIM_V_PAIRS + QV_PAIRS
              for dt in ("fp16", "bf16") for c in (False, True) for arch, prof in ARCH_PROFILES.items()}
    wide_v |= {(default_decode_config(d, dt, prof, None, False, head_dim_v=dv), arch) for d, dv in HEAD_DIM_V_PAIRS
               for dt in ("fp16", "bf16") for arch, prof in ARCH_PROFILES.items()}
    # FlashAttention-3's qv in the KV cache: the sm90 KV-cache kernel's qv switch at its (64, 256), (64, 512)
    wide_v |= {(default_decode_config(64, dt, h100, None, False, head_dim_v=dv, qv=True), "sm_90") for dv in (256, 512)
               for dt in ("fp16", "bf16")}
    wide_v |= {(call_default("bwd", d, dt, c, _NO_SWITCHES, h100, dv), "sm_90") for d, dv in HEAD_DIM_V_PAIRS
               if max(d, dv) <= 256 for dt in ("fp16", "bf16") for c in (False, True)}
    switched = set(sampling.sample(switched_defaults(), _switch_key, salt="compile switch sets"))
    return sorted(fwd | bwd | decode | sm90 | wide_v | switched, key=lambda x: (x[0].name, x[1]))


def switched_defaults():
    """The defaults under each variant set (forward and backward; the sm90 family's under its own
    sets at every head dim it takes) and each decode set besides the plain cache. A run compiles one
    set per (direction, head dim, dtype, arch), drawn from the seed (AUTOFLASH_SWEEP=full compiles
    them all)."""
    variants = [(_variant_default(direction, d, v, prof), arch) for direction in ("fwd", "bwd")
                for d in HEAD_DIMS for v in VARIANT_SETS for arch, prof in ARCH_PROFILES.items()
                if not (arch == "sm_90" and d % 16 == 0)]
    h100 = ARCH_PROFILES["sm_90"]
    variants += [(_variant_default(direction, d, v, h100), "sm_90") for direction in ("fwd", "bwd")
                 for d in range(32, 257, 16) for v in SM90_VARIANT_SETS]
    variants += [(_variant_default("fwd", d, v, prof, dv), arch) for d, dv in HEAD_DIM_V_PAIRS + QV_PAIRS
                 for arch, prof in ARCH_PROFILES.items()
                 for v in (SM90_VARIANT_SETS if arch == "sm_90" and d <= 256 else VARIANT_SETS)]
    variants += [(_variant_default("bwd", d, v, h100, dv), "sm_90") for d, dv in HEAD_DIM_V_PAIRS
                 if max(d, dv) <= 256 for v in SM90_VARIANT_SETS]  # the sm90 backward with both head dims
    decode = [(default_decode_config(d, dt, prof, 256 if v.get("paged") and not v.get("gather") else None,
                                     "window" in v or "key_bias" in v, bool(v.get("gather")), dv).replace(**v), arch)
              for d, dv in [(d, None) for d in HEAD_DIMS] + list(HEAD_DIM_V_PAIRS)
              for dt in ("fp16", "bf16") for v in DECODE_SETS[1:] for arch, prof in ARCH_PROFILES.items()
              if dv is None or dt == "bf16"]
    return variants + decode


def _switch_key(job) -> tuple:
    cfg, arch = job
    return cfg.direction, cfg.kvcache, cfg.head_dim, cfg.dv, cfg.dtype, arch


# Under an NVRTC besides the main one (.ci/nvrtc_stacks.sh sets AUTOFLASH_NVRTC_STACK), a run compiles
# one default per (family, arch, direction, decode) and the defaults whose choice depends on the
# release (kernels/defaults.py STACK_SPILLS: the fallbacks that stack picks, and what it picks
# instead elsewhere), drawn from the seed salted by the release: all 448 take ~10 minutes a release
# on 2 cores, five releases a run. AUTOFLASH_SWEEP=full compiles all of them (bench/results/compile/).
EXTRA_STACK = os.environ.get("AUTOFLASH_NVRTC_STACK")


def _stack_key(job) -> tuple:
    """What the sample under another NVRTC keeps one of: a STACK_SPILLS entry that a plain default
    falls under (what that release picks, or picks instead elsewhere), else (family, arch, direction,
    decode): the dtype and head dim drawn per release and run."""
    from autoflash.kernels.defaults import STACK_SPILLS

    cfg, arch = job
    on = cfg.variants
    if not cfg.kvcache:  # a plain default, or a variant's tiles an entry is about (StackSpill.switches)
        for i, s in enumerate(STACK_SPILLS):
            if (s.switches or not on) and s.covers(arch, cfg.direction, cfg.dtype, cfg.head_dim, cfg.causal, on):
                return ("STACK_SPILLS", i)
    return cfg.family, arch, cfg.direction, cfg.kvcache


def stack_defaults():
    jobs = defaults()
    if not EXTRA_STACK:
        return jobs
    return sampling.sample(jobs, _stack_key, salt=EXTRA_STACK)


def _compile(job):
    cfg, arch = job
    try:
        return compile_config(cfg, arch).resources
    except Exception as e:  # reported per config by the test below
        return f"{type(e).__name__}: {e}"


def sampled_grid():
    """This run's share of grid() (every config under AUTOFLASH_SWEEP=full)."""
    return sampling.sample(grid(), _grid_key, salt="compile grid")


def _grid_key(job) -> tuple:
    """What the per-run sample keeps one of: direction, dtype, arch and head-dim range (<= 64, <= 128,
    above); the defaults compile at every head dim in every run (test_default_configs_have_no_spills)."""
    cfg, arch = job
    return cfg.direction, cfg.dtype, arch, min(cfg.head_dim, 129) // 65


def _compile_all(jobs) -> dict:
    jobs = sorted(set(jobs), key=lambda x: (x[0].name, x[1]))
    with ProcessPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
        return dict(zip(jobs, pool.map(_compile, jobs)))


@pytest.fixture(scope="module")
def compiled():
    """Every default, compiled (under another NVRTC, stack_defaults: .ci/nvrtc_stacks.sh)."""
    return _compile_all(stack_defaults())


def test_grid_is_representative():
    g = grid()
    assert {c.head_dim for c, _ in g} == set(HEAD_DIMS)
    assert {c.dtype for c, _ in g} == set(DTYPES)
    assert {c.causal for c, _ in g} == {False, True}
    assert {c.direction for c, _ in g} == {"fwd", "bwd"}
    assert {c.head_dim for c, _ in g if c.direction == "bwd"} == set(HEAD_DIMS)
    assert {a for _, a in g} == set(ARCH_PROFILES)
    assert len({(c.block_m, c.block_n, c.num_warps, c.num_stages) for c, _ in g}) >= 6
    assert len(g) > 150


@pytest.mark.slow
def test_the_sampled_grid_compiles():
    assert {_grid_key(j) for j in sampled_grid()} == {_grid_key(j) for j in grid()}  # every key at least once
    failures = {f"{c.name}@{a}": r for (c, a), r in _compile_all(sampled_grid()).items() if not isinstance(r, Resources)}
    assert not failures, "\n".join(f"{k}: {v[:2000]}" for k, v in failures.items())


def test_every_default_is_held_to_one_of_its_switch_sets_each_run():
    drawn = {_switch_key(j) for j in defaults()}
    assert {_switch_key(j) for j in switched_defaults()} <= drawn
    per_key = collections.Counter(_switch_key(j) for j in switched_defaults())
    # four variant sets per forward/backward key (the sm90 forward's own four), the decode sets past the plain cache
    assert {n for key, n in per_key.items() if not key[1]} == {len(VARIANT_SETS)} == {len(SM90_VARIANT_SETS)}
    assert {n for key, n in per_key.items() if key[1]} == {len(DECODE_SETS) - 1}


@pytest.mark.slow
@pytest.mark.parametrize("cfg, arch", stack_defaults(), ids=lambda x: x.name if isinstance(x, KernelConfig) else x)
def test_default_configs_have_no_spills(compiled, cfg, arch):
    res = compiled[(cfg, arch)]
    assert isinstance(res, Resources), res
    assert not res.spills and res.stack_bytes == 0, f"{cfg.name} on {arch}: {res}"
    assert res.registers * cfg.threads <= ARCH_PROFILES[arch].regs_per_sm
    # what cuFuncSetAttribute accepts as the dynamic size: with the static, the opt-in limit per block
    check_shared_memory(cfg, res.static_smem_bytes, ARCH_PROFILES[arch])


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_tensor_core_path_compiles_to_hmma_ldsm_and_cp_async(dtype):
    cfg = default_config(128, dtype, True, get_profile("a100"))  # the sm80 family, compiled for sm_90
    sass = disassemble(compile_config(cfg, "sm_90"))
    counts = collections.Counter(re.findall(r"\b(HMMA|LDSM|LDGSTS|MUFU\.EX2|LDL|STL)\b", sass))
    assert counts["HMMA"] > 0 and counts["LDSM"] > 0 and counts["LDGSTS"] > 0 and counts["MUFU.EX2"] > 0, counts
    assert counts["LDL"] == counts["STL"] == 0, counts  # nothing went to local memory


def test_simt_path_uses_no_tensor_cores():
    cfg = default_config(64, "fp32", False, get_profile("a100"))
    sass = disassemble(compile_config(cfg, "sm_80"))
    assert "HMMA" not in sass and "FFMA" in sass and "LDGSTS" in sass


def _smem_jobs():
    """Configs whose layout fits a static declaration, so ptxas can report its size: one per direction,
    dtype and head dim that has one (25), of which a run probes one per direction, dtype and head-dim range, drawn
    from the seed (AUTOFLASH_SWEEP=full probes all)."""
    picks = {}
    for cfg, arch in grid():
        if cfg.smem_bytes <= STATIC_SMEM_LIMIT and arch == "sm_80":
            picks.setdefault((cfg.direction, cfg.dtype, cfg.head_dim), cfg)
    jobs = sorted(picks.values(), key=lambda c: c.name)
    return sampling.sample(jobs, lambda c: _grid_key((c, "sm_80")), salt="smem probe")


@pytest.mark.slow
@pytest.mark.parametrize("cfg", _smem_jobs(), ids=lambda c: c.name)
def test_smem_model_matches_ptxas(cfg):
    # The kernel static_asserts sizeof(SharedStorage) == KernelConfig.smem_bytes for every config;
    # here ptxas itself reports the bytes of the same layout declared statically.
    res = static_smem_probe(cfg, "sm_80")
    assert res.static_smem_bytes == cfg.smem_bytes, (cfg.name, res)



def _ptxas_options(arch, *extra):
    from autoflash.kernels import compiler

    return [f"--gpu-architecture={arch}", *compiler.BASE_OPTIONS, *extra, f"-I{compiler.templates_dir()}",
            f"-I{compiler.cuda_include_dir()}"]


@pytest.mark.parametrize("arch, direction, extra", [
    ("sm_80", "fwd", ()), ("sm_80", "bwd", ()), ("sm_90a", "fwd", ()), ("sm_90a", "bwd", ()),
    ("sm_80", "fwd", ("--maxrregcount=64",)),  # spills: a stack frame
    ("sm_80", "fwd", ("-DAUTOFLASH_STATIC_SMEM",)),  # static shared memory
])
def test_the_cubin_records_what_ptxas_reports(arch, direction, extra):
    """NVRTC 13.0.88 gave empty logs to most compiles of 16 processes at once (first H200 run): the
    resources are then read from the cubin, and they are ptxas's (every entry of the module)."""
    from autoflash.kernels import compiler
    from autoflash.kernels.codegen import render

    family = "sm90" if arch == "sm_90a" else "sm80"
    profile = get_profile("h100" if family == "sm90" else "a100")
    cfg = (default_config(64, "bf16", True, profile, family=family) if direction == "fwd"
           else default_backward_config(64, "bf16", True, profile, family=family))
    if "STATIC" in "".join(extra):  # a layout that can be declared statically (48 KB at most)
        cfg = KernelConfig(head_dim=64, dtype="bf16", causal=True, block_m=64, block_n=64, num_warps=4, num_stages=2)
    cubin, log = compiler._nvrtc_compile(render(cfg), cfg.name, arch, _ptxas_options(arch, *extra))
    if "Overriding global maxrregcount" in log:
        pytest.skip(f"NVRTC {compiler.nvrtc_version()} overrides --maxrregcount with the launch bounds' count")
    entries = re.findall(r"Compiling entry function '(\w+)'", log)
    assert cfg.name in entries
    for entry in entries:
        want, got = compiler.parse_ptxas_report(log, entry), compiler.cubin_resources(cubin, entry, arch)
        assert (got.registers, got.stack_bytes, got.static_smem_bytes) == \
            (want.registers, want.stack_bytes, want.static_smem_bytes), entry
        assert got.spills == want.spills, entry
    if extra and extra[0].startswith("--maxrregcount"):
        assert compiler.parse_ptxas_report(log, cfg.name).spills
    if extra and "STATIC" in extra[0]:
        assert compiler.parse_ptxas_report(log, cfg.name).static_smem_bytes > 0


def test_a_compile_without_ptxas_report_takes_the_cubins_resources(monkeypatch, tmp_path):
    from autoflash.kernels import compiler

    monkeypatch.setenv("AUTOFLASH_CACHE_DIR", str(tmp_path))
    cfg = default_backward_config(64, "fp16", False, get_profile("a100"), family="sm80")
    reported = compile_config(cfg, "sm_80", use_cache=False)
    real = compiler._nvrtc_compile
    monkeypatch.setattr(compiler, "_nvrtc_compile", lambda *args: (real(*args)[0], ""))
    blank = compile_config(cfg, "sm_80", use_cache=False)
    assert blank.log == "" and blank.resources == reported.resources
    delta = f"{cfg.name}_delta"
    assert compiler.entry_resources(blank, delta) == compiler.entry_resources(reported, delta)
    with pytest.raises(ValueError, match="no .text section"):
        compiler.entry_resources(blank, "no_such_kernel")
