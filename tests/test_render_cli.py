"""`python -m autoflash.render`: sources by name or flags, the resource report, clear CLI errors."""
import pytest

from autoflash.kernels.config import KernelConfig
from autoflash.render import main


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


@pytest.mark.parametrize("argv, message", [
    (["fwd_hd64_bf16_m128"], "not understood"),
    (["--head-dim", "64", "--dtype", "bf16"], "give --block-m and --block-n"),
    (["--default", "--head-dim", "64", "--dtype", "bf16"], "--default needs --gpu"),
    (["--head-dim", "64", "--dtype", "bf16", "--block-m", "64", "--block-n", "64", "--head-split", "2"],
     "only the backward splits"),
    (["fwd_hd64_bf16_m128n64w4s2", "--gpu", "a200"], "a200"),
])
def test_errors_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err
