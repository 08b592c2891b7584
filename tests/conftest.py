"""Test tiers: everything runs on the CPU except tests marked `gpu`, which skip cleanly without CUDA.

The GPU tier also runs on the host emulator: a test that takes the `target` fixture runs once with
target "gpu" (marked `gpu`) and once with "emulated" (CPU tensors inside autoflash.emulate). Tests
marked `sweep` are grids: on the emulator each run keeps sampling.CASES cases of each, one per key
((head dim, dtype, causal, variant)) for that many keys, and on a GPU one case of every key, drawn
from a seed printed in the summary with each emulated sweep's count (AUTOFLASH_SWEEP_SEED=N replays a
run, AUTOFLASH_SWEEP=full runs the whole grid on both, AUTOFLASH_SWEEP_CASES=N changes the emulated
budget)."""
import os
import time

import pytest
import torch

import sampling

# The fuzz's seed, fixed before pytest-xdist's workers start so that the run has one (printed per case).
os.environ.setdefault("AUTOFLASH_FUZZ_SEED", str(time.time_ns() % 2**31))


def pytest_report_header(config):
    mode = "full grids" if sampling.FULL else f"{sampling.CASES} cases per sweep, over its keys"
    return (f"autoflash emulated sweeps and compile grid: seed {sampling.SEED} ({mode}; "
            f"AUTOFLASH_SWEEP_SEED={sampling.SEED} replays it, AUTOFLASH_SWEEP=full runs them whole)")


def pytest_generate_tests(metafunc):
    if "target" in metafunc.fixturenames:
        metafunc.parametrize("target", [pytest.param("gpu", marks=pytest.mark.gpu), "emulated"], indirect=True)


@pytest.fixture
def target(request):
    if request.param == "emulated":
        import autoflash
        from gpu_inputs import EMULATED_GPU

        with autoflash.emulate(EMULATED_GPU):
            yield "emulated"
    else:
        yield "gpu"


@pytest.fixture
def mutate(monkeypatch):
    """mutate(direction, old, new): emulated kernels of that direction are built from the rendered
    source with `old` replaced by `new` (the #line directives keep pointing at the template): a
    planted bug the sanitizer must report."""
    from autoflash.emulation import module

    def clear():
        module._MODULES.clear()
        module.load_functions.cache_clear()

    def apply(direction, old, new):
        real = module.render

        def render(cfg, **kw):
            text = real(cfg, **kw)
            if cfg.direction == direction:
                assert old in text, f"mutation target not in {cfg.name}: {old!r}"
                text = text.replace(old, new, 1)
            return text

        monkeypatch.setattr(module, "render", render)
        clear()

    yield apply
    clear()


@pytest.fixture
def fresh_fallback_policy(monkeypatch):
    """No AUTOFLASH_STRICT, and every fallback reason unwarned: as in a new process (and again after)."""
    from autoflash.dispatch import policy

    monkeypatch.delenv(policy.STRICT_ENV, raising=False)
    policy._warned.clear()
    yield
    policy._warned.clear()


@pytest.fixture
def broken_runtime(tmp_path, monkeypatch):
    """broken_runtime(file, old, new): the emulator's runtime is built, for the rest of the test, from a
    copy of autoflash/emulation/cuda whose `file` has `old` replaced by `new`: an emulator broken on
    purpose, which the check under test must catch."""
    import shutil

    from autoflash.emulation import build

    def apply(file, old, new):
        headers = tmp_path / "cuda"
        shutil.copytree(build.HEADERS, headers)
        path = headers / file
        text = path.read_text()
        assert old in text, f"mutation target not in {file}: {old!r}"
        path.write_text(text.replace(old, new))
        monkeypatch.setattr(build, "HEADERS", headers)
        build.headers_hash.cache_clear()

    yield apply
    build.headers_hash.cache_clear()


@pytest.fixture
def launches(monkeypatch):
    """The configs the launcher asks kernels for; each ask raises Launched there, so a call stops at
    its launch (nothing is compiled)."""
    from autoflash.kernels import launch

    seen = []

    def spy(config, profile, t):
        seen.append(config)
        raise Launched(config.name)

    monkeypatch.setattr(launch, "kernel_functions", spy)
    return seen


@pytest.fixture
def launched(monkeypatch):
    """The configs the launcher runs, in order; each call goes on to its kernel (unlike launches)."""
    from autoflash.kernels import launch

    seen, real = [], launch.kernel_functions

    def record(config, profile, t):
        seen.append(config)
        return real(config, profile, t)

    monkeypatch.setattr(launch, "kernel_functions", record)
    return seen


class Launched(Exception):
    """Raised by the `launches` spy in place of a launch: the kernel that would run."""


@pytest.fixture
def one_thread():
    """One intra-op thread: on tiny tensors more only add overhead, and on a busy machine OpenMP
    spin-waiting makes the many small ops of gradcheck tens of times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _sweep_key(item) -> tuple:
    params = item.callspec.params
    return (item.originalname, params.get("d"), params.get("dtype"), params.get("causal"), params.get("variant"))


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    swept: dict[tuple[str, str], list] = {}
    for item in items:
        if "sweep" in item.keywords and getattr(item, "callspec", None) \
                and item.callspec.params.get("target") in ("emulated", "gpu"):
            swept.setdefault((item.callspec.params["target"], item.originalname), []).append(item)
    for (target, name), cases in swept.items():
        # On a GPU a sweep keeps one case of every key (all of them under AUTOFLASH_SWEEP=full): the
        # whole GPU tier (9,391 tests, ~0.5 s each with 16 workers, mostly compiling) did not fit the
        # first H200 run's minutes.
        budget = sampling.CASES if target == "emulated" else None
        kept = sampling.keep(cases, _sweep_key, budget, salt=name)
        skip = pytest.mark.skip(reason=f"not in this run's sample of the {target} sweep (seed {sampling.SEED}; "
                                       "AUTOFLASH_SWEEP=full)")
        for item, k in zip(cases, kept):
            if not k:
                item.add_marker(skip)
        if target == "emulated":
            _SAMPLED[name] = (sum(kept), len(cases), len({_sweep_key(i) for i in cases}))
    # Emulators broken on purpose (the broken_runtime fixture: each case rebuilds the runtime, ~15-35 s):
    # MUTATIONS of each such test per run, all under AUTOFLASH_SWEEP=full.
    broken: dict[str, list] = {}
    for item in items:
        if "broken_runtime" in getattr(item, "fixturenames", ()) and getattr(item, "callspec", None):
            broken.setdefault(item.originalname, []).append(item)
    skip = pytest.mark.skip(reason=f"not in this run's sample of planted emulator bugs (seed {sampling.SEED}; "
                                   "AUTOFLASH_SWEEP=full)")
    for name, cases in broken.items():
        kept = sampling.keep(cases, lambda item: item.callspec.id, MUTATIONS, salt=name)
        for item, k in zip(cases, kept):
            if not k:
                item.add_marker(skip)
        _SAMPLED[name] = (sum(kept), len(cases), len(cases))


_SAMPLED: dict[str, tuple[int, int, int]] = {}  # sweep -> (kept, cases, keys)
MUTATIONS = 1


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: the counts go to the controller
        session.config.workeroutput["autoflash_sampled"] = dict(_SAMPLED)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _SAMPLED.update(getattr(node, "workeroutput", {}).get("autoflash_sampled", {}))


def pytest_terminal_summary(terminalreporter):
    # Also under -q (which hides the header): the seeds replay this run's emulated sample and fuzz.
    terminalreporter.write_line(pytest_report_header(None))
    for name, (kept, cases, keys) in sorted(_SAMPLED.items()):
        terminalreporter.write_line(f"  {name}: {kept} of {cases} cases ({keys} keys)")
    fuzz = __import__("sys").modules.get("test_emulated_fuzz")
    if fuzz is not None:
        terminalreporter.write_line(f"autoflash emulated fuzz: seed {fuzz.SEED} "
                                    f"(AUTOFLASH_FUZZ_SEED={fuzz.SEED} replays it)")
