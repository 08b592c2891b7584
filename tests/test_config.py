"""KernelConfig: validation, names, serialisation and the shared-memory model."""
import dataclasses

import pytest

from autoflash.kernels.config import KernelConfig


def test_name_is_deterministic_and_round_trips():
    cfg = KernelConfig(head_dim=128, dtype="bf16", block_m=128, block_n=64, num_warps=4, num_stages=2, causal=True)
    assert cfg.name == "fwd_hd128_bf16_causal_m128n64w4s2"
    assert KernelConfig.from_name(cfg.name) == cfg
    plain = cfg.replace(causal=False, dtype="fp16")
    assert plain.name == "fwd_hd128_fp16_m128n64w4s2"
    assert KernelConfig.from_name(plain.name) == plain


def test_dict_round_trip_and_unknown_keys():
    cfg = KernelConfig(64, "fp16", 128, 128)
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown keys \\['tile'\\]"):
        KernelConfig.from_dict({**cfg.to_dict(), "tile": 3})
    with pytest.raises(TypeError, match="expected a dict"):
        KernelConfig.from_dict([1, 2])


def test_frozen():
    cfg = KernelConfig(64, "fp16", 128, 128)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_m = 64  # type: ignore[misc]
    assert hash(cfg) == hash(KernelConfig(64, "fp16", 128, 128))


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(head_dim=100), ValueError, "head_dim: got 100, expected a multiple of 8 in \\[32, 256\\]"),
        (dict(head_dim=264), ValueError, "head_dim: got 264"),
        (dict(head_dim=24), ValueError, "head_dim: got 24"),
        (dict(head_dim=64.0), TypeError, "head_dim: got 64.0"),
        (dict(dtype="float16"), ValueError, "dtype: got 'float16', expected one of"),
        (dict(block_m=100), ValueError, "block_m: got 100, expected a multiple of 16"),
        (dict(block_n=8), ValueError, "block_n: got 8"),
        (dict(num_warps=3), ValueError, "num_warps: got 3"),
        (dict(num_stages=0), ValueError, "num_stages: got 0"),
        (dict(causal=1), TypeError, "causal: got 1, expected a bool"),
        (dict(direction="dq"), ValueError, "direction: got 'dq'"),
        (dict(direction="bwd", dtype="fp32", block_n=256), ValueError, "fp32 SIMT backward"),
        (dict(direction="bwd", dtype="fp32", block_n=16, head_split=2), ValueError, "the fp32 backward takes 1"),
        (dict(direction="bwd", block_m=16, block_n=16, num_warps=8), ValueError, "no warp layout of 8 warps for dK, dV"),
        (dict(direction="bwd", block_m=48, block_n=128, num_warps=2), ValueError, "no warp layout of 2 warps"),
        (dict(direction="bwd", head_dim=96, head_split=2), ValueError, "each slice must be a whole number of 64"),
        (dict(dq="pass"), ValueError, "only the tensor-core backward has a separate dQ pass"),
        (dict(direction="bwd", dtype="fp32", block_n=32, dq="pass"), ValueError, "only the tensor-core backward"),
        (dict(direction="bwd", block_m=32, dq="pass"), ValueError, "block_m divisible by 64"),
        (dict(direction="bwd", dq="atomics"), ValueError, "KernelConfig.dq: got 'atomics'"),
        (dict(v_in_regs=True), ValueError, "only the tensor-core backward keeps V in registers"),
        (dict(direction="bwd", v_in_regs=1), TypeError, "KernelConfig.v_in_regs: got 1"),
        # Br not divisible by the warps' rows: 8 warps x 16 rows = 128
        (dict(block_m=64, num_warps=8), ValueError, "block_m divisible by 16 \\* num_warps = 128"),
        # SIMT: 128 threads over 64 rows is fine, over 256 rows is not
        (dict(dtype="fp32", block_m=256, num_warps=4), ValueError, "fp32 SIMT path"),
        (dict(dtype="fp32", block_m=16, num_warps=8), ValueError, "fp32 SIMT path"),
        (dict(dtype="fp32", head_dim=40, block_m=16, num_warps=4), ValueError, "head_dim / 4 \\(10\\)"),
    ],
)
def test_invalid_configs_say_what_was_received(kwargs, exc, match):
    base = dict(head_dim=64, dtype="fp16", block_m=64, block_n=64, num_warps=4, num_stages=2)
    with pytest.raises(exc, match=match):
        KernelConfig(**{**base, **kwargs})


def test_from_name_rejects_garbage():
    with pytest.raises(ValueError, match="not understood"):
        KernelConfig.from_name("fwd_hd128_bf16_m128")


@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
def test_smem_model_one_stage_is_fa2_formula(d):
    # FA2: (Br + 2 Bc) * d * 2 bytes for fp16/bf16 when d is a multiple of 16
    cfg = KernelConfig(d, "bf16", 128, 64, num_stages=1)
    assert cfg.smem_bytes == (128 + 2 * 64) * d * 2


def test_smem_model_pads_head_dim_for_tensor_cores_and_adds_p_on_simt():
    assert KernelConfig(40, "fp16", 64, 64, num_stages=2).smem_bytes == (64 + 4 * 64) * 48 * 2
    simt = KernelConfig(40, "fp32", 64, 32, num_warps=4, num_stages=1)
    assert simt.smem_layout == {"q": 64 * 40 * 4, "k": 32 * 40 * 4, "v": 32 * 40 * 4, "p": 64 * 32 * 4}


def test_backward_names_and_smem():
    cfg = KernelConfig(128, "bf16", 64, 128, num_warps=8, num_stages=2, causal=True, direction="bwd")
    assert cfg.name == "bwd_hd128_bf16_causal_m64n128w8s2"
    assert KernelConfig.from_name(cfg.name) == cfg
    row = 128 * 2
    assert cfg.smem_layout == {"k": 128 * row, "v": 128 * row, "q": 2 * 64 * row, "dout": 2 * 64 * row,
                               "ds": 64 * 128 * 2, "p": 64 * 128 * 2, "lse": 2 * 64 * 4, "delta": 2 * 64 * 4}
    # FA2's 2D tiling, by counting: S/dP 2 x 4 warps (32 x 32 each), dK/dV 2 x 4 (64 keys x 32 columns),
    # dQ 2 x 4; each at the fewest ldmatrix per MMA its registers allow
    lay = cfg.backward_layout
    assert (lay.s, lay.kv, lay.q, lay.kv_offset, lay.q_offset) == ((2, 4), (2, 4), (2, 4), True, True)


def test_dq_pass_is_a_switch_in_the_name():
    cfg = KernelConfig(64, "bf16", 128, 128, num_warps=8, num_stages=2, direction="bwd", dq="pass")
    assert cfg.name == "bwd_hd64_bf16_m128n128w8s2_dqpass"
    assert KernelConfig.from_name(cfg.name) == cfg and KernelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.symbols == (cfg.name, f"{cfg.name}_delta", f"{cfg.name}_dq")
    both = cfg.replace(v_in_regs=True)
    assert both.name == "bwd_hd64_bf16_m128n128w8s2_dqpass_vregs" and KernelConfig.from_name(both.name) == both
    # its Q, dO and K/V stages live in the dK/dV kernel's shared memory: two stages fit here, one at d=128
    assert cfg.dq_pass_stages == 2
    assert KernelConfig(128, "bf16", 128, 64, num_warps=8, num_stages=1, direction="bwd", dq="pass").dq_pass_stages == 1


def test_check_fits():
    cfg = KernelConfig(256, "bf16", 128, 64, num_warps=8, num_stages=2)
    cfg.check_fits(232448, "h100")
    with pytest.raises(ValueError, match="needs 196608 bytes .* a100 allows at most 166912"):
        cfg.check_fits(166912, "a100")
