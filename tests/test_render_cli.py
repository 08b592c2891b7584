"""`python -m autoflash.render`: sources by name or flags, the resource report, clear CLI errors; the
header's build note (-I to the templates, or --standalone's inlined headers, each compiled as the note
says), the switch flags, --list."""
import dataclasses
import re
import shlex
import shutil
import subprocess

import pytest

from autoflash.kernels.config import KernelConfig
from autoflash.kernels.defaults import default_backward_config, default_config, default_decode_config
from autoflash.render import SWITCHES, _parser, inline_includes, main


def test_by_name_to_stdout(capsys):
    assert main(["fwd_hd64_bf16_causal_m128n64w4s2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("// fwd_hd64_bf16_causal_m128n64w4s2 ")
    assert "fwd_hd64_bf16_causal_m128n64w4s2(" in out


def test_flags_to_file_with_report(tmp_path, capsys):
    path = tmp_path / "k.cu"
    assert main(["--head-dim", "96", "--dtype", "fp16", "--block-m", "128", "--block-n", "80", "--warps", "8",
                 "-o", str(path), "--gpu", "a100"]) == 0
    cfg = KernelConfig(96, "fp16", 128, 80, num_warps=8)
    assert path.read_text().startswith(f"// {cfg.name} ")
    report = capsys.readouterr().out
    assert f"{cfg.name} for a100 (sm_80):" in report
    assert "registers/thread" in report and "spills             0 B stored, 0 B loaded" in report
    assert f"shared memory      {cfg.smem_bytes} B dynamic" in report and "-> fits" in report


def test_default_backward_for_a_gpu(capsys):
    assert main(["--default", "--backward", "--head-dim", "128", "--dtype", "bf16", "--gpu", "h100",
                 "--no-line-directives"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("// bwd_hd128_bf16_") and "#line" not in captured.out
    assert "for h100 (sm_90):" in captured.err and "h100 limit" in captured.err


# ---- the header note, --standalone ----
def _note_command(source: str) -> list[str]:
    """The nvcc command the header comment prints (the line that starts with `//   nvcc `)."""
    lines = [line for line in source.split("\n") if line.startswith("//   nvcc ")]
    assert len(lines) == 1, f"expected one nvcc command in the header, got {lines}"
    return shlex.split(lines[0][len("//   "):])


def _run_printed_nvcc(source_path, name: str) -> bytes:
    """Runs the header's nvcc command in the source's folder; the cubin it wrote."""
    argv = _note_command(source_path.read_text())
    done = subprocess.run(argv, cwd=source_path.parent, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stderr}"
    cubin = (source_path.parent / argv[argv.index("-o") + 1]).read_bytes()
    assert name.encode() in cubin  # the kernel's extern "C" symbol
    return cubin


def test_plain_header_names_the_include_folder_and_keeps_the_line_mapping(capsys):
    from autoflash.kernels.codegen import render
    from autoflash.kernels.resources import templates_dir

    cfg = KernelConfig(64, "bf16", 128, 64, causal=True)
    assert main([cfg.name]) == 0
    lines = capsys.readouterr().out.split("\n")
    resume = lines.index('#line 2 "templates/flash_fwd.cu.j2"')
    note = lines[1:resume]
    assert any(f"-I {templates_dir()}" in line for line in note)
    assert "-I" in _note_command("\n".join(note))
    # Without the note the source is codegen's, line for line; the directive resumes at template line 2.
    assert "\n".join([lines[0], *lines[resume + 1:]]) == render(cfg)
    assert lines[resume + 1] == (templates_dir() / "flash_fwd.cu.j2").read_text().split("\n")[1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_plain_output_compiles_with_the_printed_nvcc_command(tmp_path):
    path = tmp_path / "plain.cu"
    assert main(["fwd_hd64_fp16_m64n64w4s2", "-o", str(path)]) == 0
    _run_printed_nvcc(path, "fwd_hd64_fp16_m64n64w4s2")


def _included(source: str) -> set[str]:
    return set(re.findall(r'^\s*#\s*include\s+"([^"]+)"', source, re.M))


@pytest.mark.parametrize("argv", [
    ["--head-dim", "96", "--dtype", "fp16", "--block-m", "64", "--block-n", "64", "--causal", "--bottom-right",
     "--softcap", "--key-bias"],
    ["--head-dim", "64", "--dtype", "bf16", "--block-m", "64", "--block-n", "64", "--stages", "1", "--backward",
     "--dq-pass", "--alibi", "--causal", "--bottom-right"],
])
def test_standalone_inlines_every_header_once_and_compiles_with_nvrtc(argv, tmp_path, capsys, monkeypatch):
    from autoflash.kernels import compiler

    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main(argv + ["--standalone"]) == 0
    source = capsys.readouterr().out
    name = source.split()[1]
    cfg = KernelConfig.from_name(name)
    assert not _included(source) and _included(plain)
    assert not re.search(r"^\s*#\s*(line|pragma once)\b", source, re.M)
    begins = re.findall(r"^// ---- begin (\S+) ----$", source, re.M)
    assert len(begins) == len(set(begins)) and _included(plain) <= set(begins)
    assert sorted(re.findall(r"^// ---- end (\S+) ----$", source, re.M)) == sorted(begins)
    # NVRTC with an include path that holds nothing: the source needs none of the templates' headers.
    monkeypatch.setattr(compiler, "templates_dir", lambda: tmp_path)
    monkeypatch.setenv("AUTOFLASH_CACHE_DIR", str(tmp_path / "cache"))
    alone = compiler.compile_source(source, name, "sm_80", use_cache=False)
    monkeypatch.undo()
    assert alone.resources == compiler.compile_config(cfg, "sm_80").resources  # the same code


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("gpu, arch", [(None, "sm_80"), ("h100", None), ("sm_90a", "sm_90a")])
def test_standalone_compiles_with_the_nvcc_command_in_its_header(gpu, arch, tmp_path, capsys):
    from autoflash.kernels.gpus import get_profile

    arch = arch or get_profile(gpu).arch
    cfg = KernelConfig(128, "bf16", 64, 64, kvcache=True, paged=True, split=True, causal=True, align="bottom_right")
    path = tmp_path / "alone.cu"
    assert main([cfg.name, "--standalone", "-o", str(path)] + (["--gpu", gpu] if gpu else [])) == 0
    argv = _note_command(path.read_text())
    assert argv[:3] == ["nvcc", f"-arch={arch}", "-cubin"] and not any(a.startswith("-I") for a in argv)
    cubin = _run_printed_nvcc(path, f"{cfg.name}_combine")
    if gpu is None:  # the bare command, no -I (nor anything else)
        subprocess.run(["nvcc", "-arch=sm_80", "-cubin", "-o", "bare.cubin", path.name], cwd=tmp_path, check=True)
    assert cfg.name.encode() + b"\0" in cubin
    if arch.endswith("a"):
        assert "architecture-specific" in path.read_text()
    try:
        from autoflash.kernels.sass import nvdisasm

        tool = nvdisasm()
    except RuntimeError:
        return
    (tmp_path / "k.cubin").write_bytes(cubin)
    target = subprocess.run([tool, str(tmp_path / "k.cubin")], capture_output=True, text=True, check=True).stdout
    assert re.search(rf"\.target\s+{arch}\b", target)


def test_inline_includes_resolves_as_the_compiler_does(tmp_path):
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "a.cuh").write_text('#pragma once\n#include "b.cuh"\n#include "common/c.cuh"\nint a;\n')
    (tmp_path / "common" / "b.cuh").write_text('#pragma once\n#include "common/c.cuh"\nint b;\n')
    (tmp_path / "common" / "c.cuh").write_text("#pragma once\n#include <cuda_fp16.h>\nint c;\n")
    text = inline_includes('#include "common/a.cuh"\n#include "common/c.cuh"\nint main_;', tmp_path)
    code = [line for line in text.split("\n") if not line.startswith("//")]
    assert code == ["#include <cuda_fp16.h>", "int c;", "int b;", "int a;", "int main_;"]
    assert text.count("// ---- begin common/c.cuh ----") == 1 and "// ---- common/c.cuh: inlined above ----" in text
    with pytest.raises(ValueError, match='#include "common/d.cuh": not found'):
        inline_includes('#include "common/d.cuh"', tmp_path)


# ---- switch flags ----
TILES = ["--block-m", "64", "--block-n", "64"]


@pytest.mark.parametrize("flags, fields", [
    (["--causal", "--bottom-right"], dict(causal=True, align="bottom_right")),
    (["--window", "--softcap", "--alibi", "--varlen", "--bottom-right"],
     dict(window=True, softcap=True, alibi=True, varlen=True, align="bottom_right")),
    (["--key-bias", "--causal"], dict(key_bias=True, causal=True)),
    (["--kvcache", "--paged", "--split", "--causal"], dict(kvcache=True, paged=True, split=True, causal=True)),
    (["--backward", "--stages", "1", "--dq-pass", "--v-in-regs", "--window"],
     dict(direction="bwd", num_stages=1, dq="pass", v_in_regs=True, window=True)),
    (["--head-dim-v", "128", "--causal"], dict(head_dim_v=128, causal=True)),
])
def test_switch_flags_give_the_configs_name(flags, fields, capsys):
    assert main(["--head-dim", "64", "--dtype", "bf16", *TILES, *flags]) == 0
    expected = KernelConfig(64, "bf16", 64, 64, **fields)
    first = capsys.readouterr().out.split("\n", 1)[0]
    assert first.startswith(f"// {expected.name} ")
    assert KernelConfig.from_name(expected.name) == expected


def test_every_field_a_name_shows_has_a_flag():
    shape = {"head_dim", "dtype", "block_m", "block_n", "num_warps", "num_stages", "direction", "head_split",
             "head_dim_v"}
    switches = {f.name for f in dataclasses.fields(KernelConfig)} - shape
    assert {field for _, field, _, _ in SWITCHES} == switches
    help_text = _parser().format_help()
    assert all(flag in help_text for flag, _, _, _ in SWITCHES)


@pytest.mark.parametrize("argv, expected", [
    (["--head-dim", "128", "--dtype", "bf16", "--causal", "--bottom-right", "--softcap"],
     lambda p: default_config(128, "bf16", True, p, True).replace(causal=True, align="bottom_right", softcap=True)),
    (["--head-dim", "64", "--dtype", "fp16", "--backward", "--window"],
     lambda p: default_backward_config(64, "fp16", True, p, True).replace(causal=False, window=True)),
    (["--head-dim", "128", "--dtype", "bf16", "--kvcache", "--paged", "--split", "--page-size", "32"],
     lambda p: default_decode_config(128, "bf16", p, 32).replace(paged=True, split=True)),
    (["--head-dim", "64", "--dtype", "bf16", "--kvcache", "--paged", "--page-size", "4"],  # FA3's small pages
     lambda p: default_decode_config(64, "bf16", p, None, False, True).replace(paged=True, gather=True)),
    (["--head-dim", "64", "--head-dim-v", "512", "--dtype", "bf16", "--causal"],  # two blocks share O's columns
     lambda p: default_config(64, "bf16", True, p, head_dim_v=512)),
])
def test_switch_flags_combine_with_default(argv, expected, capsys):
    from autoflash.kernels.gpus import get_profile

    assert main(["--default", "--gpu", "a10g", "--no-line-directives", *argv]) == 0
    cfg = expected(get_profile("a10g"))
    assert capsys.readouterr().out.startswith(f"// {cfg.name} ")
    if cfg.paged and not cfg.gather:  # whole tiles per page; gathered pages take any tile
        assert 32 % cfg.block_n == 0


# ---- --list ----
def test_list_shows_the_gpus_default_names(capsys):
    from autoflash.kernels.config import DTYPES
    from autoflash.kernels.gpus import get_profile

    assert main(["--list", "--gpu", "a10g"]) == 0
    out = capsys.readouterr().out
    profile = get_profile("a10g")
    for d in (32, 64, 128, 256):
        for dtype in DTYPES:
            for causal in (False, True):
                assert f" {default_config(d, dtype, causal, profile).name}\n" in out
                assert f" {default_backward_config(d, dtype, causal, profile).name}\n" in out
            if dtype != "fp32":
                decode = default_decode_config(d, dtype, profile)
                assert f" {decode.name}\n" in out
                assert f" {decode.replace(causal=True, align='bottom_right').name}\n" in out


def test_list_narrows_to_a_head_dim_and_dtype(capsys):
    from autoflash.kernels.gpus import get_profile

    assert main(["--list", "--gpu", "h100", "--head-dim", "80", "--dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    assert default_config(80, "fp16", True, get_profile("h100")).name in out
    names = re.findall(r"\b(?:fwd|bwd)_hd\d+_\w+", out)
    assert names and all(n.startswith(("fwd_hd80_fp16", "bwd_hd80_fp16")) for n in names)


@pytest.mark.parametrize("argv, message", [
    (["fwd_hd64_bf16_m128"], "not understood"),
    (["--head-dim", "64", "--dtype", "bf16"], "give --block-m and --block-n"),
    (["--default", "--head-dim", "64", "--dtype", "bf16"], "--default needs --gpu"),
    (["--head-dim", "40", "--dtype", "bf16", "--block-m", "64", "--block-n", "64", "--head-split", "2"],
     "equal whole 16-column slices"),  # the forward shares O's 48 columns in whole 16-column slices only
    (["fwd_hd64_bf16_m128n64w4s2", "--gpu", "a200"], "a200"),
    (["--head-dim", "64", "--dtype", "bf16", *TILES, "--causal", "--window"],
     "with --causal --window: KernelConfig: got causal and window"),
    (["--head-dim", "64", "--dtype", "bf16", *TILES, "--bottom-right"],
     "with --bottom-right: KernelConfig.align: got 'bottom_right'"),
    (["--head-dim", "64", "--dtype", "fp32", *TILES, "--softcap"], "expected dtype fp16 or bf16"),
    (["--head-dim", "64", "--dtype", "bf16", *TILES, "--paged"], "got paged without kvcache"),
    (["--head-dim", "64", "--dtype", "bf16", *TILES, "--kvcache", "--backward"], "got kvcache for bwd"),
    (["--default", "--gpu", "h100", "--head-dim", "64", "--dtype", "bf16", "--block-m", "64"],
     "--default picks the tiles; got --block-m"),
    (["--default", "--gpu", "h100", "--head-dim", "64", "--dtype", "fp32", "--kvcache"], "got --dtype fp32"),
    (["--default", "--gpu", "h100", "--head-dim", "64", "--dtype", "bf16", "--kvcache", "--page-size", "64"],
     "--page-size: got 64 without --default --kvcache --paged"),
    (["--default", "--gpu", "h100", "--head-dim", "64", "--dtype", "bf16", "--kvcache", "--paged", "--page-size",
      "0"], "--page-size: got 0, expected a positive number of rows"),
    (["fwd_hd64_bf16_m128n64w4s2", "--softcap"], "and --softcap; a name fixes every field"),
    (["--list"], "--list needs --gpu"),
    (["--list", "--gpu", "h100", "--softcap", "--standalone"], "got --softcap, --standalone as well"),
    (["--list", "--gpu", "h100", "--head-dim", "33"], "--head-dim: got 33, expected a multiple of 8"),
    (["fwd_hd64_bf16_m128n64w4s2", "--sass"], "--sass needs --gpu"),
])
def test_errors_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    captured = capsys.readouterr()
    assert info.value.code == 2 and message in captured.err
    assert captured.out == ""  # nothing half-written before the error


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("standalone", [False, True])
def test_an_sm90_kernel_compiles_with_its_printed_sm_90a_command(standalone, tmp_path, capsys):
    """The sm90 family's header prints nvcc -arch=sm_90a (wgmma exists only there), with or without
    --gpu, and that command builds the kernel."""
    path = tmp_path / "k.cu"
    argv = ["--head-dim", "64", "--dtype", "bf16", "--block-m", "128", "--block-n", "64", "--warps", "8",
            "--sm90", "--pingpong", "--overlap", "-o", str(path)] + (["--standalone"] if standalone else [])
    assert main(argv) == 0
    name = "fwd_hd64_bf16_m128n64w8s2_sm90a_pp_ov"
    assert name in capsys.readouterr().out
    assert _note_command(path.read_text())[:2] == ["nvcc", "-arch=sm_90a"]
    _run_printed_nvcc(path, name)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_h100s_sm90_backward_default_compiles_with_its_printed_command(tmp_path, capsys):
    """--backward --default on an H100 renders the sm90 backward (its two kernels: delta and the main
    one), and the printed nvcc -arch=sm_90a command builds it."""
    path = tmp_path / "k.cu"
    assert main(["--backward", "--default", "--gpu", "h100", "--head-dim", "64", "--dtype", "bf16", "--causal",
                 "-o", str(path)]) == 0
    name = "bwd_hd64_bf16_causal_m128n128w8s2_sm90a"
    assert name in capsys.readouterr().out
    assert _note_command(path.read_text())[:2] == ["nvcc", "-arch=sm_90a"]
    _run_printed_nvcc(path, name)


@pytest.mark.parametrize("backward", [False, True])
def test_sass_counts_the_sm90_familys_wgmma_loops(backward, tmp_path, capsys):
    """render --sass on an sm90 default: its HGMMA loops, per m16n8k16-equivalent (the unit of
    bench sass --fa3), the steady loop the shortest."""
    from autoflash.kernels.sass import nvdisasm

    try:
        nvdisasm()
    except RuntimeError as e:
        pytest.skip(str(e))
    argv = ["--default", "--head-dim", "64", "--dtype", "bf16", "--gpu", "h100", "--sass", "-o", str(tmp_path / "k.cu")]
    assert main(argv + (["--backward"] if backward else [])) == 0
    out = capsys.readouterr().out
    loops = re.findall(r"(steady loop|masked or other loop) @0x[0-9a-f]+: (\d+) instructions, HGMMA ([^:]+): "
                       r"(\d+) m16n8k16-equivalents, ([\d.]+) instructions each", out)
    assert loops and sum(role == "steady loop" for role, *_ in loops) == 1, out
    for role, total, shapes, equivalents, each in loops:
        # 64xNx16 is N / 8 m16n8k16s of one warp's share
        assert int(equivalents) == sum(int(n) * (int(s.split("x")[1]) // 8)
                                       for n, s in re.findall(r"(\d+) x (\d+x\d+x\d+)", shapes))
        assert abs(float(each) - int(total) / int(equivalents)) < 0.01
    steady = [int(t) for role, t, *_ in loops if role == "steady loop"][0]
    assert steady == min(int(t) for _, t, *_ in loops)
