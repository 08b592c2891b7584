"""Bad input to the CUDA launcher: every case raises ValueError/TypeError naming what was received
and what is accepted, before anything touches a GPU (these run on the CPU)."""
import pytest
import torch

from autoflash.kernels.config import KernelConfig
from autoflash.kernels.gpus import get_profile
from autoflash.kernels.checks import check_config, check_qkv, check_scale
from autoflash.kernels.launch import flash_backward, flash_forward


def qkv(b=2, hq=4, hkv=2, lq=33, lk=47, d=64, dtype=torch.float16, device="cpu"):
    return (torch.randn(b, hq, lq, d, dtype=dtype, device=device),
            torch.randn(b, hkv, lk, d, dtype=dtype, device=device),
            torch.randn(b, hkv, lk, d, dtype=dtype, device=device))


def test_valid_inputs_pass_and_report_dtype():
    assert check_qkv(*qkv()) == "fp16"
    assert check_qkv(*qkv(dtype=torch.bfloat16, hkv=1)) == "bf16"
    assert check_qkv(*qkv(dtype=torch.float32, hkv=4)) == "fp32"


def test_bshd_view_needs_no_copy():
    b, s, h, d = 2, 37, 4, 64
    x = torch.randn(b, s, h, d, dtype=torch.bfloat16)
    view = x.transpose(1, 2)  # (B, H, S, D) with strides (S*H*D, D, H*D, 1)
    assert check_qkv(view, view, view) == "bf16"


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda q, k, v: (q[0], k, v), ValueError, r"q: got shape \(4, 33, 64\), expected 4 dims"),
    (lambda q, k, v: (q, k.half().float(), v), TypeError, "dtypes differ"),
    (lambda q, k, v: (q.double(), k.double(), v.double()), TypeError, "dtype: got torch.float64"),
    (lambda q, k, v: (q, k, v[:, :, :-1]), ValueError, "k and v shapes: got"),
    (lambda q, k, v: (q[:1], k, v), ValueError, "expected the same batch and head_dim"),
    (lambda q, k, v: (q[..., :32], k, v), ValueError, "expected the same batch and head_dim"),
    (lambda q, k, v: (q[:, :3], k, v), ValueError, "3 query heads and 2 kv heads"),
    (lambda q, k, v: (q[:, :, :0], k, v), ValueError, "empty input"),
    (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), ValueError, "empty input"),
    (lambda q, k, v: (q.numpy(), k, v), TypeError, "q: got ndarray, expected a torch.Tensor"),
    (lambda q, k, v: (q, k.to("meta"), v), ValueError, "devices differ"),
])
def test_bad_inputs(mutate, exc, match):
    with pytest.raises(exc, match=match):
        check_qkv(*mutate(*qkv()))


@pytest.mark.parametrize("d", [24, 100, 264])
def test_unsupported_head_dim(d):
    with pytest.raises(ValueError, match=f"head_dim: got {d}, expected a multiple of 8 in \\[32, 256\\]"):
        check_qkv(*qkv(d=d))


def test_non_unit_last_stride():
    q, k, v = qkv()
    strided = torch.randn(2, 4, 33, 128, dtype=torch.float16)[..., ::2]
    with pytest.raises(ValueError, match="got stride 2 on the last dim, expected 1"):
        check_qkv(strided, k, v)


def test_misaligned_strides_and_pointer():
    q, k, v = qkv()
    # rows 72 elements apart are fine (a multiple of 8); 65 apart are not
    padded = torch.randn(2, 4, 33, 72, dtype=torch.float16)[..., :64]
    odd = torch.randn(2, 4, 33, 65, dtype=torch.float16)[..., :64]
    with pytest.raises(ValueError, match="multiples of 8 elements"):
        check_qkv(odd, k, v)
    shifted = torch.randn(2 * 4 * 33 * 64 + 1, dtype=torch.float16)[1:].view(2, 4, 33, 64)
    with pytest.raises(ValueError, match="16-byte aligned start"):
        check_qkv(shifted, k, v)
    assert check_qkv(padded, k, v) == "fp16"


def test_cpu_tensors_are_refused_by_the_cuda_launcher():
    with pytest.raises(ValueError, match="runs on CUDA tensors; got tensors on cpu"):
        flash_forward(*qkv())


def test_causal_must_be_bool():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="causal: got 1, expected a bool"):
        flash_forward(q, k, v, causal=1)


@pytest.mark.parametrize("scale, exc", [(0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                        (float("inf"), ValueError), ("0.1", TypeError), (True, TypeError)])
def test_bad_scale(scale, exc):
    with pytest.raises(exc, match="scale: got"):
        check_scale(scale, 64)


def test_default_scale():
    assert check_scale(None, 64) == 0.125 and check_scale(2, 64) == 2.0


def test_config_must_match_the_call_and_fit_the_gpu():
    h100, a100 = get_profile("h100"), get_profile("a100")
    cfg = KernelConfig(128, "bf16", 128, 64, num_warps=8, causal=True)
    check_config(cfg, 128, "bf16", True, h100)
    with pytest.raises(ValueError, match=r"is for \(head_dim, dtype, causal, direction\) = \(128, 'bf16', True"):
        check_config(cfg, 128, "bf16", False, h100)
    with pytest.raises(ValueError, match="is for"):
        check_config(cfg, 64, "bf16", True, h100)
    big = KernelConfig(256, "bf16", 128, 64, num_warps=8, num_stages=2)
    with pytest.raises(ValueError, match="needs 196608 bytes of shared memory per block; a100 allows at most 166912"):
        check_config(big, 256, "bf16", False, a100)
    with pytest.raises(TypeError, match="expected a KernelConfig"):
        check_config("fwd_hd128_bf16_m128n64w8s2", 128, "bf16", False, h100)


# ---- backward and the differentiable entry point ----

def bwd_args(dtype=torch.bfloat16):
    q, k, v = qkv(dtype=dtype)
    out, dout = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(q.shape[:3], dtype=torch.float32)
    return dout, q, k, v, out, lse


def test_backward_refuses_cpu_tensors():
    with pytest.raises(ValueError, match="flash_backward runs on CUDA tensors; got tensors on cpu"):
        flash_backward(*bwd_args())


@pytest.mark.parametrize("which, bad, match", [
    ("dout", lambda t: t[:, :, :-1], "dout: got \\(2, 4, 32, 64\\)"),
    ("out", lambda t: t.half(), "out: got .*float16.*expected q's"),
    ("dout", lambda t: "grad", "dout: got str, expected a torch.Tensor"),
])
def test_backward_out_and_dout_must_match_q(which, bad, match, monkeypatch):
    args = dict(zip(("dout", "q", "k", "v", "out", "lse"), bwd_args()))
    args[which] = bad(args[which])
    monkeypatch.setenv("AUTOFLASH_EMULATE", "h100")  # CPU tensors reach the shape checks (no GPU here)
    with pytest.raises((ValueError, TypeError), match=match):
        flash_backward(args["dout"], args["q"], args["k"], args["v"], args["out"], args["lse"])


def test_backward_checks_lse_and_dtype(monkeypatch):
    monkeypatch.setenv("AUTOFLASH_EMULATE", "h100")
    dout, q, k, v, out, lse = bwd_args()
    with pytest.raises(ValueError, match=r"lse: got \(2, 4\) .*expected \(2, 4, 33\) float32"):
        flash_backward(dout, q, k, v, out, lse[..., 0])
    with pytest.raises(ValueError, match="lse: got .*float64"):
        flash_backward(dout, q, k, v, out, lse.double())


def test_flash_attn_checks_before_the_device():
    from autoflash import flash_attn
    q, k, v = (t.requires_grad_() for t in qkv(dtype=torch.float32))
    with pytest.raises(TypeError, match="deterministic: got 1"):
        flash_attn(q, k, v, deterministic=1)
    with pytest.raises(ValueError, match="CUDA tensors"):
        flash_attn(q, k, v)


def test_backward_config_must_be_a_backward_config():
    h100 = get_profile("h100")
    fwd = KernelConfig(64, "bf16", 128, 64)
    with pytest.raises(ValueError, match="direction\\) = \\(64, 'bf16', False, 'fwd'\\); the call needs \\(64, 'bf16', False, 'bwd'\\)"):
        check_config(fwd, 64, "bf16", False, h100, "bwd")
