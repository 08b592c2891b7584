"""The wheel carries templates/ and tuned/, and an installed wheel finds them (not the checkout)."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
                   check=True, capture_output=True, text=True)
    (whl,) = out.glob("autoflash-*.whl")
    return whl


def test_wheel_contains_templates_and_tuned(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (ROOT / "templates").rglob("*"):
        if path.is_file():
            assert f"autoflash/templates/{path.relative_to(ROOT / 'templates').as_posix()}" in names
    for path in (ROOT / "tuned").rglob("*"):
        if path.is_file():
            assert f"autoflash/tuned/{path.relative_to(ROOT / 'tuned').as_posix()}" in names
    assert "autoflash/templates/flash_fwd.cu.j2" in names
    assert not any(n.startswith("tests/") for n in names)


def test_installed_wheel_renders_from_its_own_templates(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "from autoflash.kernels.resources import templates_dir, tuned_dir\n"
        "from autoflash.kernels.codegen import render\n"
        "from autoflash.kernels.config import KernelConfig\n"
        "print(templates_dir()); print(tuned_dir())\n"
        "print(len(render(KernelConfig(64, 'bf16', 128, 64))))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    templates, tuned, size = r.stdout.split()
    assert Path(templates) == site / "autoflash" / "templates"
    assert Path(tuned) == site / "autoflash" / "tuned"
    assert int(size) > 5000


def test_installed_wheel_emulates_from_its_own_headers(wheel, tmp_path):
    """The emulator's C++ headers and runtime ship in the wheel, and an installed wheel builds and runs
    a kernel on the CPU from them (fresh build cache)."""
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (ROOT / "autoflash" / "emulation" / "cuda").rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:
            assert f"autoflash/emulation/cuda/{path.relative_to(ROOT / 'autoflash' / 'emulation' / 'cuda').as_posix()}" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import torch, autoflash\n"
        "from autoflash.emulation.build import HEADERS\n"
        "q = torch.randn(1, 2, 20, 64).bfloat16()\n"
        "with autoflash.emulate('l4'):\n"
        "    out, lse = autoflash.flash_forward(q, q, q, causal=True)\n"
        "ref = torch.nn.functional.scaled_dot_product_attention(q.float(), q.float(), q.float(), is_causal=True)\n"
        "print(HEADERS); print(float((out.float() - ref).abs().max()))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "AUTOFLASH_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    headers, err = r.stdout.split()
    assert Path(headers) == site / "autoflash" / "emulation" / "cuda"
    assert float(err) < 3e-2
