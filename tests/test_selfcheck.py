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
