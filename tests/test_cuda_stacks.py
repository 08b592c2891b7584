"""The two CUDA stacks (autoflash[cu12], autoflash[cu13]): what pyproject.toml installs for each, the
README and CI agreeing on it, and the compiler using the NVRTC and headers that are installed, with
clear errors where an arch, NVRTC or the headers are missing. NVRTC 12 is faked where it is not
installed; where it is (the cu12 stack), the real one is checked too."""
import re
import sys
import tomllib
import types
from pathlib import Path

import pytest

import sampling
from packaging.requirements import Requirement

from autoflash.kernels import compiler
from autoflash.kernels.gpus import NVRTC_ARCHS

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# CUDA 12.9 and 13.5 as nvrtcGetSupportedArchs lists them (the nvidia-cuda-nvrtc(-cu12) wheels).
ARCHS_12_4 = (50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90)
ARCHS_12_9 = ARCHS_12_4 + (100, 101, 103, 120, 121)
ARCHS_13_5 = (75, 80, 86, 87, 88, 89, 90, 100, 103, 107, 110, 120, 121)
CUDA_WHEELS = re.compile(r"^(nvidia-|cuda-bindings|cupy-)")


def _reqs(specs):
    return {r.name: r for r in map(Requirement, specs)}


# ---- packaging -----------------------------------------------------------------------------------

def test_base_install_pins_no_cuda_major():
    # cuda-bindings 12 and 13 cannot be installed together, nor two CuPy builds: the stack is an extra
    pinned = [d for d in PROJECT["dependencies"] if CUDA_WHEELS.match(d)]
    assert not pinned, pinned


@pytest.mark.parametrize("extra, major, nvrtc, runtime, cupy", [
    ("cu12", 12, "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12", "cupy-cuda12x"),
    ("cu13", 13, "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "cupy-cuda13x"),
])
def test_each_extra_is_one_cuda_major(extra, major, nvrtc, runtime, cupy):
    reqs = _reqs(PROJECT["optional-dependencies"][extra])
    assert set(reqs) == {nvrtc, runtime, "nvidia-cuda-nvdisasm", "cuda-bindings", cupy}
    for name in (nvrtc, runtime, "cuda-bindings"):
        assert f"{major}.9.10" in reqs[name].specifier and f"{major + 1}.0" not in reqs[name].specifier, name
        assert f"{major - 1}.9" not in reqs[name].specifier, name
    # PyPI has no nvdisasm 12 wheel; nvdisasm 13 reads NVRTC 12's cubins
    assert "13.5.37" in reqs["nvidia-cuda-nvdisasm"].specifier and "14.0" not in reqs["nvidia-cuda-nvdisasm"].specifier
    # the launcher's cupy.cuda.Stream.from_external is CuPy 14's
    assert "14.0.0" in reqs[cupy].specifier and "13.6.0" not in reqs[cupy].specifier and "15.0" not in reqs[cupy].specifier
    assert compiler.STACKS[major].extra == extra
    assert (compiler.STACKS[major].nvrtc_wheel, compiler.STACKS[major].runtime_wheel) == (nvrtc, runtime)


def test_cu12_floors_admit_torch_cuda12_pins():
    # torch 2.4 pins NVRTC / runtime 12.1.105, 2.10 cuda-bindings 12.9.4 (their PyPI metadata)
    reqs = _reqs(PROJECT["optional-dependencies"]["cu12"])
    assert "12.1.105" in reqs["nvidia-cuda-nvrtc-cu12"].specifier
    assert "12.1.105" in reqs["nvidia-cuda-runtime-cu12"].specifier
    assert "12.9.4" in reqs["cuda-bindings"].specifier and "12.9.0" not in reqs["cuda-bindings"].specifier


def test_readme_ci_and_errors_agree_on_the_install_lines():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    setup = re.search(r'^pip install -e "\.\[([\w,]+)\]"', readme, re.M)
    assert setup, "README's set-up command"
    assert f'pip install -q -e ".[{setup.group(1)}]"' in ci  # CI installs as the README says
    extras = setup.group(1).split(",")
    assert set(extras) <= set(PROJECT["optional-dependencies"]) and {"cu12", "cu13"} & set(extras)
    for stack in compiler.STACKS.values():
        assert f"`{stack.install}`" in readme  # the line the errors name is the README's


# ---- which NVRTC and which headers ---------------------------------------------------------------

@pytest.fixture
def fresh_caches():
    """The compiler's per-process caches, cleared around a test that fakes what is installed."""
    cached = (compiler._nvrtc, compiler.nvrtc_version, compiler.supported_archs, compiler.cuda_include_dir)

    def clear():
        for fn in cached:
            fn.cache_clear()

    clear()
    yield
    clear()


def _fake_bindings(monkeypatch, version, nvrtc):
    bindings = types.ModuleType("cuda.bindings")
    bindings.__version__, bindings.nvrtc = version, nvrtc
    import cuda

    monkeypatch.setattr(cuda, "bindings", bindings, raising=False)  # `import cuda.bindings` reads this
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", nvrtc)


@pytest.mark.parametrize("bindings, lib", [("12.9.10", "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"),
                                           ("13.0.3", "nvidia/cu13/lib/libnvrtc.so.13")])
def test_the_nvrtc_of_the_bindings_major_is_loaded_first(monkeypatch, fresh_caches, tmp_path, bindings, lib):
    # cuda.pathfinder alone takes libnvrtc.so.13 before .so.12, whatever the bindings' major
    for rel in ("nvidia/cuda_nvrtc/lib/libnvrtc.so.12", "nvidia/cu13/lib/libnvrtc.so.13"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    loaded = []
    monkeypatch.setattr(compiler, "_site_file", lambda rel: str(tmp_path / rel) if (tmp_path / rel).exists() else None)
    monkeypatch.setattr(compiler.ctypes, "CDLL", lambda path, mode=0: loaded.append(path))
    nvrtc = types.SimpleNamespace(nvrtcVersion=lambda: (0, int(bindings[:2]), 9))
    _fake_bindings(monkeypatch, bindings, nvrtc)
    if not sys.platform.startswith("linux"):
        pytest.skip("the wheels' library paths are Linux ones")
    assert compiler._nvrtc() is nvrtc
    assert loaded == [str(tmp_path / lib)]
    assert compiler.nvrtc_version() == f"{bindings[:2]}.9"


def test_no_cuda_bindings_names_both_extras_and_drivers(monkeypatch, fresh_caches):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(RuntimeError) as err:
        compiler.compile_source("", "k", "sm_90")
    msg = str(err.value)
    assert 'pip install "autoflash[cu13]"' in msg and 'pip install "autoflash[cu12]"' in msg
    assert "R580" in msg and "R525" in msg and "nvidia-smi" in msg


def test_bindings_without_a_library_name_both_extras(monkeypatch, fresh_caches):
    def missing():
        raise RuntimeError("Failure finding libnvrtc.so: not in site-packages, conda or CUDA_HOME")

    monkeypatch.setattr(compiler, "_site_file", lambda rel: None)
    _fake_bindings(monkeypatch, "12.9.10", types.SimpleNamespace(nvrtcVersion=missing))
    with pytest.raises(RuntimeError, match=r"NVRTC not found \(RuntimeError: Failure finding libnvrtc"
                                           r".*autoflash\[cu13\].*autoflash\[cu12\]"):
        compiler.nvrtc_version()


def _headers(root: Path, rel: str, cudart: int) -> str:
    path = root / rel
    path.mkdir(parents=True)
    (path / "cuda_runtime_api.h").write_text(f"#pragma once\n#define CUDART_VERSION  {cudart}\n")
    return str(path)


@pytest.mark.parametrize("version, rel, cudart", [("12.9", "nvidia/cuda_runtime/include", 12090),
                                                  ("13.0", "nvidia/cu13/include", 13000)])
def test_headers_of_the_nvrtc_major_are_taken(monkeypatch, fresh_caches, tmp_path, version, rel, cudart):
    import cuda.pathfinder

    cu13 = _headers(tmp_path, "nvidia/cu13/include", 13050) if "cu13" not in rel else None
    own = _headers(tmp_path, rel, cudart)
    # what cuda.pathfinder returns whenever a CUDA 13 runtime wheel is installed
    monkeypatch.setattr(cuda.pathfinder, "find_nvidia_header_directory", lambda name: cu13 or own)
    monkeypatch.setattr(compiler, "_site_file", lambda r: str(tmp_path / r) if (tmp_path / r).exists() else None)
    monkeypatch.setattr(compiler, "nvrtc_version", lambda: version)
    assert compiler.cuda_include_dir() == own


@pytest.mark.parametrize("version, wheel, extra", [("12.4", "nvidia-cuda-runtime-cu12>=12.0,<13", "cu12"),
                                                   ("13.0", "nvidia-cuda-runtime>=13.0,<14", "cu13")])
def test_missing_headers_name_the_wheel_of_the_nvrtc_major(monkeypatch, fresh_caches, tmp_path, version, wheel, extra):
    import cuda.pathfinder

    other = _headers(tmp_path, "other/include", 13050 if version.startswith("12") else 12090)
    monkeypatch.setattr(cuda.pathfinder, "find_nvidia_header_directory", lambda name: other)
    monkeypatch.setattr(compiler, "_site_file", lambda r: None)
    monkeypatch.setattr(compiler, "nvrtc_version", lambda: version)
    with pytest.raises(RuntimeError) as err:
        compiler.cuda_include_dir()
    msg = str(err.value)
    assert f"CUDA {version[:2]} headers not found for NVRTC {version}" in msg
    assert f'`pip install "{wheel}"`' in msg and f'autoflash[{extra}]' in msg
    assert f"{other} holds CUDA {'13' if version.startswith('12') else '12'} headers" in msg


# ---- archs the installed NVRTC lacks -------------------------------------------------------------

def _fake_nvrtc(monkeypatch, version, archs):
    monkeypatch.setattr(compiler, "nvrtc_version", lambda: version)
    monkeypatch.setattr(compiler, "supported_archs", lambda: archs)

    def never(*args):
        raise AssertionError("NVRTC was asked to compile for an arch it does not list")

    monkeypatch.setattr(compiler, "_nvrtc_compile", never)
    monkeypatch.setattr(compiler, "cuda_include_dir", lambda: "/nonexistent")


@pytest.mark.parametrize("version, archs, arch, needs, install", [
    ("12.9", ARCHS_12_9, "sm_110", "NVRTC 13.0 or newer", 'pip install "autoflash[cu13]"'),
    ("12.9", ARCHS_12_9, "sm_110a", "NVRTC 13.0 or newer", 'pip install "autoflash[cu13]"'),
    ("12.4", ARCHS_12_4, "sm_100", "NVRTC 12.8 or newer", 'pip install -U "nvidia-cuda-nvrtc-cu12>=12.8"'),
    ("12.4", ARCHS_12_4, "sm_120a", "NVRTC 12.8 or newer", 'pip install -U "nvidia-cuda-nvrtc-cu12>=12.8"'),
    ("12.8", ARCHS_12_9[:-2] + (120,), "sm_121", "NVRTC 12.9 or newer", 'pip install -U "nvidia-cuda-nvrtc-cu12>=12.9"'),
    ("12.8", ARCHS_12_9, "sm_100f", "NVRTC 12.9 or newer", 'pip install -U "nvidia-cuda-nvrtc-cu12>=12.9"'),
])
def test_an_arch_the_nvrtc_lacks_is_a_value_error_naming_the_install(monkeypatch, version, archs, arch, needs, install):
    _fake_nvrtc(monkeypatch, version, archs)
    wheel = compiler.STACKS[int(version[:2])].nvrtc_wheel
    with pytest.raises(ValueError) as err:
        compiler.compile_source("", "k", arch)
    msg = str(err.value)
    assert msg.startswith(f"arch: got {arch!r}, expected one that NVRTC {version} ({wheel}) compiles for: sm_")
    assert f"{arch} needs {needs}: `{install}`" in msg


def test_nvrtc13_says_sm101_is_sm110_and_sends_dropped_archs_to_cu12(monkeypatch):
    _fake_nvrtc(monkeypatch, "13.5", ARCHS_13_5)
    with pytest.raises(ValueError, match=r"got 'sm_101a'.*NVRTC 13 calls it sm_110a"):
        compiler.compile_source("", "k", "sm_101a")
    with pytest.raises(ValueError, match=r'got \'sm_70\'.*NVRTC 13 dropped it.*`pip install "autoflash\[cu12\]"`'):
        compiler.compile_source("", "k", "sm_70")


def test_nvrtc_archs_for_12_9_leave_out_only_sm_110(monkeypatch):
    # gpus.NVRTC_ARCHS: every arch compiles with NVRTC 13.x, every one but sm_110(a) with 12.9
    _fake_nvrtc(monkeypatch, "12.9", ARCHS_12_9)
    rejected = []
    for arch in NVRTC_ARCHS:
        try:
            compiler.check_arch(arch)
        except ValueError:
            rejected.append(arch)
    assert rejected == ["sm_110", "sm_110a"]
    _fake_nvrtc(monkeypatch, "13.5", ARCHS_13_5)
    for arch in NVRTC_ARCHS:
        compiler.check_arch(arch)


# ---- the installed NVRTC, for real ---------------------------------------------------------------

def test_installed_nvrtc_and_headers_are_one_major():
    major = compiler.nvrtc_version().split(".")[0]
    import cuda.bindings

    assert cuda.bindings.__version__.split(".")[0] == major
    assert compiler._cudart_major(compiler.cuda_include_dir()) == int(major)


def _sampled_archs() -> list[str]:
    """One arch per generation (sm_8x, sm_90, sm_10x, sm_11x, sm_12x) per run, drawn from the seed;
    every one under AUTOFLASH_SWEEP=full."""
    generation = lambda arch: int(re.sub(r"\D", "", arch)) // 10  # noqa: E731
    return sampling.sample(NVRTC_ARCHS, generation, salt="archs")


@pytest.mark.slow
@pytest.mark.parametrize("arch", _sampled_archs())
def test_every_arch_compiles_or_names_the_install(arch):
    """The d=64 bf16 forward and backward defaults compile for every arch autoflash targets that the
    installed NVRTC lists; the others raise the ValueError (NVRTC 12.x: sm_110 and sm_110a). Per run
    one arch of each generation (_sampled_archs)."""
    from autoflash.kernels.defaults import default_backward_config, default_config
    from autoflash.kernels.gpus import get_profile

    number = int(re.sub(r"\D", "", arch))
    prof = get_profile("b200" if number >= 100 else "h100" if number == 90 else "a100")
    cfgs = (default_config(64, "bf16", False, prof), default_backward_config(64, "bf16", False, prof))
    if number not in compiler.supported_archs():
        with pytest.raises(ValueError, match=f"got '{arch}'"):
            compiler.compile_config(cfgs[0], arch)
        return
    for cfg in cfgs:
        assert compiler.compile_config(cfg, arch).resources.registers > 0


# ---- defaults per stack -----------------------------------------------------------------------------

@pytest.fixture
def nvrtc_release(monkeypatch):
    """nvrtc_release((13, 0)): the built-in defaults as under that NVRTC (caches cleared around)."""
    from autoflash.kernels import defaults

    def clear():
        for f in (defaults.default_config, defaults.default_backward_config, defaults.default_decode_config):
            f.cache_clear()

    def apply(version):
        monkeypatch.setattr(compiler, "installed_nvrtc", lambda: version)
        clear()

    yield apply
    clear()


def test_defaults_that_spill_under_an_older_nvrtc_take_the_next_choice(nvrtc_release):
    # NVRTC 12.9 and 13.0.88 (CUDA torch 2.14.1's pin) spill FA2's A100 d128 forward tile and the sm90
    # forward at d = 208, which 13.5 compiles clean (bench/results/compile/).
    from autoflash.kernels.defaults import default_backward_config, default_config, stack_note
    from autoflash.kernels.gpus import get_profile

    a100, h100 = get_profile("a100"), get_profile("h100")
    nvrtc_release((13, 5))
    newest = (default_config(128, "bf16", False, a100), default_config(208, "bf16", True, h100))
    assert [(c.block_m, c.block_n, c.num_warps) for c in newest[:1]] == [(128, 64, 4)]
    assert newest[1].family == "sm90"
    assert all(stack_note(c, p) is None for c, p in zip(newest, (a100, h100)))
    for version in ((13, 0), (12, 9)):
        nvrtc_release(version)
        older = (default_config(128, "bf16", False, a100), default_config(208, "bf16", True, h100))
        assert (older[0].block_m, older[0].block_n, older[0].num_warps) == (128, 64, 8)
        assert older[1].family == "sm80"
        for c, p in zip(older, (a100, h100)):
            note = stack_note(c, p)
            assert note.startswith(f"NVRTC {version[0]}.{version[1]} picked it") and "13.5" in note, note
        # what the newest stack runs is untouched elsewhere; the sm90 backward at d = 80, which these
        # releases spilled until its producer's box loops were no longer unrolled (1ca8254), is clean
        assert default_backward_config(80, "bf16", False, h100).family == "sm90"
        assert default_config(192, "bf16", True, h100).family == "sm90"


def test_a_variants_own_tiles_move_under_an_older_nvrtc(nvrtc_release):
    # The sm90 backward of packed sequences at d = 128 runs the plain tile's 80 queries a step (FA3's
    # varlen tile; bench sass --fa3 counts it at FA3's) where ptxas compiles it clean, 64 under NVRTC 12.1
    # and 12.8, which spill 80 (12.8 causal too); the plain kernel is untouched.
    from autoflash.kernels.defaults import call_default, stack_note
    from autoflash.kernels.gpus import get_profile

    h100 = get_profile("h100")
    for version, block_m in (((13, 5), 80), ((12, 9), 80), ((12, 8), 64), ((12, 1), 64)):
        nvrtc_release(version)
        cfg = call_default("bwd", 128, "bf16", False, dict(varlen=True), h100)
        assert (cfg.family, cfg.block_m, cfg.block_n, cfg.varlen) == ("sm90", block_m, 128, True), cfg.name
        note = stack_note(cfg, h100)
        assert (note is None) == (block_m == 80), note
        if note:
            assert note.startswith(f"NVRTC {version[0]}.{version[1]} picked it") and "12.9" in note, note
        assert call_default("bwd", 128, "bf16", True, dict(varlen=True), h100).block_m == block_m
        assert call_default("bwd", 128, "bf16", False, {}, h100).block_m == 80
        assert stack_note(call_default("bwd", 128, "bf16", False, {}, h100), h100) is None


def test_without_nvrtc_the_newest_defaults_stand(nvrtc_release):
    from autoflash.kernels.defaults import default_config
    from autoflash.kernels.gpus import get_profile

    nvrtc_release(None)
    assert default_config(208, "bf16", False, get_profile("h100")).family == "sm90"


def test_a_refusal_names_the_nvrtc_and_the_upgrade(monkeypatch):
    # The emulator's refusal of a kernel NVRTC refuses says which NVRTC did and what may fix it.
    from autoflash.emulation import limits
    from autoflash.kernels.defaults import default_config
    from autoflash.kernels.gpus import get_profile

    config = default_config(64, "bf16", True, get_profile("h100"))

    def refuse(cfg, arch):
        raise compiler.CompileError(cfg.name, arch, "the sm90 family's ptxas gate refused it:\nptxas info : (C7519) "
                                    "warpgroup.arrive is injected\n--- full log ---\n...", cfg)

    monkeypatch.setattr(compiler, "compile_config", refuse)
    limits.kernel_registers.cache_clear()
    try:
        with pytest.raises(limits.EmulationError) as e:
            limits.kernel_registers(config, "sm_90", config.name)
    finally:
        limits.kernel_registers.cache_clear()
    text = str(e.value)
    assert "(C7519) warpgroup.arrive is injected" in text.splitlines()[0]
    assert f"NVRTC {compiler.nvrtc_version()}" in text and "pip install -U" in text
