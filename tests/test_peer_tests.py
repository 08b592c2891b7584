"""python -m autoflash.bench peer-tests: a peer's own test file run against autoflash on the emulator
(autoflash.bench.peer_shim). A stand-in for FlashAttention-3's hopper/ folder, written the way its
tests are (imports of flash_attn_interface and test_util, tensors on "cuda", torch.cuda calls),
goes through the real command: its passing case passes on the emulated H100's sm90 kernels, its
failing cases are reported with their cause, and the draw honours the size limit and the seed; and
a stand-in for FlashAttention-2's tests/ folder on the emulated A100."""
import json
import textwrap

import torch

from autoflash.bench import peer_shim, peer_tests

FA3_LIKE = '''
import pytest
import torch
from test_util import reference

from flash_attn_interface import flash_attn_func

SM90 = torch.cuda.get_device_capability("cuda")[0] == 9


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(40, 70), (4000, 4000)])
@pytest.mark.parametrize("causal", [False, True])
def test_output(seqlen_q, seqlen_k, causal):
    device = "cuda"
    g = torch.Generator().manual_seed(seqlen_q)
    q = torch.randn(1, seqlen_q, 2, 64, generator=g).to(device, torch.bfloat16)
    k, v = (torch.randn(1, seqlen_k, 2, 64, device=device, dtype=torch.bfloat16) for _ in range(2))
    torch.cuda.synchronize()
    assert SM90 and q.device.type == "cpu"
    out = flash_attn_func(q, k, v, causal=causal)
    assert (out.float() - reference(q, k, v, causal)).abs().max().item() < 2e-2


def test_refused():
    q = torch.randn(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    flash_attn_func(q, q, q, q_descale=torch.ones(1, 2))


def test_wrong():
    assert False, "a test's own assertion"
'''

TEST_UTIL = '''
import torch


def reference(q, k, v, causal):
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / 8
    if causal:
        lq, lk = s.shape[-2:]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(lk - lq + 1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.float())
'''


def test_the_command_runs_a_peer_test_file_on_the_emulator(tmp_path):
    hopper = tmp_path / "checkout" / "hopper"
    hopper.mkdir(parents=True)
    (hopper / "test_flash_attn.py").write_text(textwrap.dedent(FA3_LIKE))
    (hopper / "test_util.py").write_text(textwrap.dedent(TEST_UTIL))
    out = tmp_path / "out"
    assert peer_tests.main(["--fa3", str(tmp_path / "checkout"), "--sample", "0", "--max-elements", "10000",
                            "--workers", "0", "--out", str(out)]) == 0
    records = [json.loads(line) for path in out.glob("*.jsonl") for line in path.read_text().splitlines()]
    by_test = {r["test"].split("::")[1]: r for r in records}
    # the 4000 x 4000 cases are left out; the two that fit pass on the sm90 family
    assert sorted(by_test) == ["test_output[False-40-70]", "test_output[True-40-70]", "test_refused", "test_wrong"]
    for case in ("test_output[False-40-70]", "test_output[True-40-70]"):
        assert by_test[case]["outcome"] == "passed" and by_test[case]["families"] == ["sm90"], by_test[case]
    assert by_test["test_refused"]["outcome"] == "failed" and "q_descale" in by_test["test_refused"]["reason"]
    assert by_test["test_wrong"]["outcome"] == "failed"
    summary = peer_tests.summarize(records)
    assert summary["outcomes"] == {"passed": 2, "failed": 2} and summary["sm90_share"] == 1.0
    assert any(cause.startswith("fp8 inputs with descales") for cause in summary["causes"]), summary["causes"]
    report = next(out.glob("*.md")).read_text()
    assert "| test_output | 2 | 0 | 0 |" in report and "on the sm90 family: 100%" in report


FA2_LIKE = '''
import torch
from flash_attn import flash_attn_func
from flash_attn.bert_padding import pad_input
from flash_attn.flash_attn_interface import USE_TRITON_ROCM
from flash_attn.layers.rotary import apply_rotary_emb

SM80 = torch.cuda.get_device_capability("cuda") == (8, 0)


def test_output():
    assert SM80 and not USE_TRITON_ROCM and torch.cuda.get_device_properties("cuda").total_memory > 16 * 2**30
    q = torch.randn(2, 33, 2, 64, device="cuda", dtype=torch.float16)
    out = flash_attn_func(q, q, q, causal=True)
    assert pad_input(out, q.shape) is out


def test_rotary():
    x = torch.randn(2, 5, 3, 32, device="cuda")
    cos, sin = torch.ones(8, 8, device="cuda"), torch.zeros(8, 8, device="cuda")
    assert torch.equal(apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([0, 3])), x)


def test_dropout():
    q = torch.randn(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    flash_attn_func(q, q, q, 0.17)
'''


def test_the_command_runs_flashattention_2s_test_file_on_an_emulated_a100(tmp_path):
    """FA2's layout: tests/test_flash_attn.py importing flash_attn and the checkout's own pure-PyTorch
    flash_attn/bert_padding.py; the launches are the sm80 family's, dropout a named refusal."""
    checkout = tmp_path / "checkout"
    (checkout / "tests").mkdir(parents=True)
    (checkout / "flash_attn").mkdir()
    (checkout / "tests" / "test_flash_attn.py").write_text(textwrap.dedent(FA2_LIKE))
    (checkout / "flash_attn" / "bert_padding.py").write_text("def pad_input(x, shape):\n    return x\n")
    out = tmp_path / "out"
    assert peer_tests.main(["--fa2", str(checkout), "--sample", "0", "--workers", "0", "--out", str(out)]) == 0
    records = [json.loads(line) for path in out.glob("*.jsonl") for line in path.read_text().splitlines()]
    by_test = {r["test"].split("::")[1]: r for r in records}
    assert by_test["test_output"]["outcome"] == "passed" and by_test["test_output"]["families"] == ["sm80"]
    assert by_test["test_rotary"]["outcome"] == "passed"
    assert by_test["test_dropout"]["outcome"] == "failed" and "dropout_p: got 0.17" in by_test["test_dropout"]["reason"]
    assert next(out.glob("*-fa2-a100-*.md")).read_text().startswith("# FlashAttention-2's tests/test_flash_attn.py")


def test_the_draw_is_seeded_and_sized():
    assert peer_shim._elements({"seqlen_q": 113, "seqlen_k": 203}) == 113 * 203
    assert peer_shim._elements({"seqlen": 64}) == 64 * 64
    assert peer_shim._elements({"d": 128}) == 1


def test_cuda_tensors_are_made_on_the_cpu():
    with peer_shim.CudaOnCpu():
        a = torch.randn(2, 3, device="cuda")
        b = torch.zeros(2, device=torch.device("cuda", 0)).to("cuda")
        c = torch.ones(1).cuda()
        d = torch.arange(4, device="cuda:0").to(device="cuda", dtype=torch.float32)
    assert all(t.device.type == "cpu" for t in (a, b, c, d)) and d.dtype == torch.float32
