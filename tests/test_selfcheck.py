"""`python -m autoflash.selfcheck`: argument errors and the no-GPU exit on the CPU; the real run on a GPU."""
import pytest
import torch

from autoflash.selfcheck import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_gpu_exits_2_with_a_message(capsys):
    assert main(["--backward"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("shape", ["1,2,3", "1,2,2,8,8,0", "a,b,c,d,e,f"])
def test_bad_shape(shape, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--shape", shape])
    assert info.value.code == 2 and "expected six positive integers b,hq,hkv,lq,lk,d" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("causal", [[], ["--causal"]])
def test_selfcheck_passes_on_gpu(dtype, causal, capsys):
    assert main(["--dtype", dtype, "--backward", *causal]) == 0, capsys.readouterr().out


def test_emulated_selfcheck_runs_without_a_gpu(capsys):
    assert main(["--emulate", "l4", "--backward", "--shape", "1,2,1,40,57,64", "--dtype", "fp16", "--causal"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("emulated l4 on the CPU") and out.count(" ok") == 4


def test_a_v_head_dim_of_its_own_is_checked_and_sanitized(capsys):
    """--head-dim-v: V and the output that wide, the gradients through the padded backward; sanitized."""
    assert main(["--emulate", "a100", "--sanitize", "--backward", "--shape", "1,2,1,40,57,64", "--head-dim-v", "128",
                 "--causal"]) == 0
    out = capsys.readouterr().out
    assert "dv 128" in out and out.count(" ok") == 4 and "sanitizer: 0 findings" in out
    # what ran, named: the forward with V's own head dim, the backward at the wider one (sm80: padded)
    assert "  kernels: fwd_hd64_dv128_bf16_" in out and ", bwd_hd128_bf16_" in out, out


@pytest.mark.parametrize("argv, message", [
    (["--sanitize"], "--sanitize checks kernels on the emulator: add --emulate GPU"),
    (["--emulate", "h100", "--config", "fwd_hd64_bf16_m64n64"], "--config: kernel name"),
    (["--emulate", "h100", "--config", "fwd_hd64_bf16_m64n64w4s2", "--shape", "1,1,1,8,8,128"], "has head_dim 64"),
    (["--emulate", "h100", "--config", "fwd_hd64_bf16_m64n64w4s2", "--dtype", "fp16"], "is bf16; --dtype gives fp16"),
    (["--emulate", "h100", "--config", "fwd_hd64_bf16_m64n64w4s2", "--head-dim-v", "128"],
     "has V head dim 64; --head-dim-v gives 128"),
    (["--emulate", "h1000"], "get_profile: got 'h1000', expected a profile name"),
])
def test_emulate_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_a_config_that_does_not_fit_exits_2_with_the_reason(capsys):
    assert main(["--emulate", "l4", "--config", "fwd_hd128_bf16_m128n128w8s2"]) == 2
    assert "allows at most 101376" in capsys.readouterr().err
