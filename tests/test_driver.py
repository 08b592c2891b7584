"""A CUDA driver older than autoflash's CUDA stack (NVRTC 13 cubins, cupy-cuda13x on an R535-R570
driver of CUDA 12.x) is found before a call reaches the kernels: autoflash.attention falls back with
one FallbackWarning naming the driver's CUDA version, the NVRTC version and the install line that
fixes it (strict raises with the same text); the flash-attn API, which has no fallback, raises it.
The machine's own driver is faked here (CPU); on a GPU (`gpu` marker) the real probe passes."""
import pytest
import torch

import autoflash
from autoflash.dispatch import sdpa
from autoflash.kernels import compiler, driver, launch


@pytest.mark.parametrize("cuda, nvrtc, cupy_major, expected", [
    ((12, 4), "13.0", 13, ["CUDA 12.4 (driver 550.54.15)", "NVRTC 13.0 and CuPy for CUDA 13 (cupy-cuda13x)",
                           "need a CUDA 13 driver", 'pip install "autoflash[cu12]"', "R580 or newer"]),
    ((12, 2), "13.5", 12, ["NVRTC 13.5 autoflash uses", 'pip install "autoflash[cu12]"']),
    ((12, 8), "12.9", 12, None),  # minor version compatibility: a 12.9 cubin loads on a 12.8 driver
    ((13, 0), "12.9", 12, None),  # a newer driver runs older cubins
    ((13, 0), "13.5", 13, None),
    ((11, 8), "12.9", 12, ["CUDA 11.8", "need a CUDA 12 driver", "R525", 'pip install "autoflash[cu12]"',
                           'pip install "autoflash[cu13]"']),
    (None, "13.0", 13, None),  # no driver library: the launch itself reports
])
def test_mismatch_names_the_versions_and_the_fix(cuda, nvrtc, cupy_major, expected):
    reason = driver.mismatch(cuda, nvrtc, cupy_major, "550.54.15" if cuda == (12, 4) else None)
    if expected is None:
        assert reason is None
    else:
        assert reason is not None and all(part in reason for part in expected), reason


@pytest.fixture
def cuda12_driver(monkeypatch):
    """This machine as one with a CUDA 12.4 driver beside NVRTC 13.0 and cupy-cuda13x."""
    monkeypatch.setattr(driver, "cuda_driver_version", lambda: (12, 4))
    monkeypatch.setattr(driver, "driver_release", lambda: "550.54.15")
    monkeypatch.setattr(driver, "cupy_cuda_major", lambda: 13)
    monkeypatch.setattr(compiler, "nvrtc_version", lambda: "13.0")
    monkeypatch.setattr(launch, "detect", lambda index: pytest.fail("the device was probed past a driver mismatch"))
    launch.device_profile.cache_clear()
    monkeypatch.setattr(sdpa, "_device_reasons", {})
    yield
    launch.device_profile.cache_clear()


def test_the_probe_routes_a_call_away_before_any_launch(cuda12_driver):
    reason = sdpa._probe_device(0)
    assert "CUDA 12.4 (driver 550.54.15)" in reason and "NVRTC 13.0" in reason
    assert 'pip install "autoflash[cu12]"' in reason
    with pytest.raises(driver.DriverMismatchError, match=r"NVRTC 13\.0 .*autoflash\[cu12\]"):
        launch.device_profile(0)  # what flash_attn_func and the KV-cache call reach first


@pytest.mark.gpu
def test_the_real_driver_runs_the_kernels():
    assert sdpa._probe_device(torch.cuda.current_device()) == ""
    assert driver.cuda_driver_version() is not None


@pytest.mark.gpu
def test_a_mismatched_driver_falls_back_once_and_strict_raises(cuda12_driver):
    q, k, v = (torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    sdpa.clear_plan_cache()
    sdpa._warned.clear()
    with pytest.warns(sdpa.FallbackWarning, match=r"CUDA 12\.4.*NVRTC 13\.0.*autoflash\[cu12\]"):
        out = autoflash.attention(q, k, v)
    assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))
    with pytest.raises(sdpa.UnsupportedCallError, match=r"CUDA 12\.4.*autoflash\[cu12\]"):
        autoflash.attention(q, k, v, strict=True)
    with pytest.raises(driver.DriverMismatchError, match="autoflash\\[cu12\\]"):
        autoflash.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    sdpa.clear_plan_cache()
