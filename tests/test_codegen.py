"""Rendering: the header records the config, #line directives point at the right template lines,
compile errors carry name, config and log."""
import re

import pytest

from autoflash.kernels.codegen import render, template_hash
from autoflash.kernels.compiler import CompileError, compile_source
from autoflash.kernels.config import KernelConfig
from autoflash.kernels.resources import templates_dir

CONFIGS = [
    KernelConfig(128, "bf16", 128, 64, num_warps=8, causal=True),
    KernelConfig(40, "fp16", 64, 64, num_stages=1),
    KernelConfig(256, "fp32", 16, 16, num_warps=4),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_header_records_the_config(cfg):
    src = render(cfg)
    first = src.splitlines()[:6]
    assert first[0].startswith(f"// {cfg.name} ")
    assert f"block_m={cfg.block_m} block_n={cfg.block_n} num_warps={cfg.num_warps}" in first[2]
    assert f"{cfg.smem_bytes} bytes dynamic" in first[4]
    assert f"__global__ void __launch_bounds__(THREADS, 1)\n{cfg.name}(" in src
    assert f"static_assert(sizeof(SharedStorage) == {cfg.smem_bytes}" in src
    assert "\x1e" not in src and "\x1f" not in src  # line markers are all resolved


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_line_directives_map_output_to_template_lines(cfg):
    template = (templates_dir() / "flash_fwd.cu.j2").read_text().split("\n")
    out = render(cfg).split("\n")
    checked, current = 0, None
    for line in out:
        m = re.fullmatch(r'#line (\d+) "templates/flash_fwd.cu.j2"', line)
        if m:
            current = int(m.group(1))
            continue
        if current is not None:
            t = template[current - 1]
            if "{{" not in t and "{%" not in t:
                assert line == t, f"output line claims template line {current}: {t!r} vs {line!r}"
                checked += 1
            current += 1
    assert checked > 150


def test_no_line_directives_option():
    src = render(CONFIGS[0], line_directives=False)
    assert "#line" not in src
    assert src.replace("\n", "") == "".join(
        line for line in render(CONFIGS[0]).split("\n") if not line.startswith("#line"))


def test_render_rejects_non_configs():
    with pytest.raises(TypeError, match="expected a KernelConfig"):
        render({"head_dim": 64})


def test_template_hash_is_stable_hex():
    h = template_hash()
    assert re.fullmatch(r"[0-9a-f]{16}", h) and h == template_hash()


def test_compile_error_carries_name_config_and_log(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFLASH_CACHE_DIR", str(tmp_path))
    cfg = CONFIGS[1]
    broken = render(cfg).replace("const int kv_head = head / group;", "const int kv_head = head / grup;")
    with pytest.raises(CompileError) as info:
        compile_source(broken, cfg.name, "sm_80", config=cfg)
    msg = str(info.value)
    assert cfg.name in msg and "sm_80" in msg and repr(cfg) in msg
    # the #line directives send the error to the template line that holds the typo
    line_no = next(i for i, t in enumerate((templates_dir() / "flash_fwd.cu.j2").read_text().split("\n"), 1)
                   if "const int kv_head = head / group;" in t)
    assert f"templates/flash_fwd.cu.j2({line_no}): error" in msg and '"grup" is undefined' in msg


def test_static_assert_catches_a_wrong_smem_model(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFLASH_CACHE_DIR", str(tmp_path))
    cfg = CONFIGS[1]
    src = render(cfg).replace(f"sizeof(SharedStorage) == {cfg.smem_bytes}", f"sizeof(SharedStorage) == {cfg.smem_bytes + 16}")
    with pytest.raises(CompileError, match="KernelConfig.smem_bytes disagrees with the kernel"):
        compile_source(src, cfg.name, "sm_80", config=cfg)


def test_bad_arch_is_rejected():
    with pytest.raises(ValueError, match="arch: got 'ampere'"):
        compile_source("", "k", "ampere")
