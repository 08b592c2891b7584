"""The GPU tier's grid (FlashAttention's tests: head dims, (Lq, Lk) pairs, MHA/GQA/MQA) and random
inputs in (B, H, S, D) or as a (B, S, H, D) storage viewed as (B, H, S, D) (no copy).

Every GPU-tier test runs twice: on a CUDA GPU (`gpu` marker, skipped without one) and on the CPU
under autoflash.emulate (the `target` fixture of conftest.py), the latter at reduced sizes: lengths
<= 256, batch 1. The emulated sweep is sampled per run (see conftest.py)."""
import pytest
import torch

from autoflash.kernels.checks import TORCH_DTYPES  # noqa: F401  (re-exported for the GPU tests)

HEAD_DIMS = (32, 40, 64, 96, 128, 160, 192, 224, 256)
PADDED_HEAD_DIMS = (59, 111)  # in FlashAttention's grid; run zero-padded to the next multiple of 8
SEQLENS = ((113, 203), (128, 217), (108, 256), (256, 512), (512, 256), (1023, 1024), (1024, 1023), (2048, 2048))
# FlashAttention's (Lq, Lk) pairs scaled down to <= 256 for the emulator.
EMULATED_SEQLENS = ((113, 203), (128, 217), (113, 211), (108, 256), (128, 256), (256, 128), (256, 256), (255, 256),
                    (256, 255))
HEADS = {"mha": (6, 6), "gqa": (6, 2), "mqa": (6, 1)}
EMULATED_HEADS = {"mha": (2, 2), "gqa": (4, 2), "mqa": (3, 1)}
EMULATED_GPU = "h100"


def seqlens(target: str):
    return EMULATED_SEQLENS if target == "emulated" else SEQLENS


def accuracy_grid(test):
    """FlashAttention's grid as a sweep: head dim x dtype x causal x heads x (Lq, Lk) pair, the pair
    given as an index into seqlens(target) (see pair_lengths)."""
    pairs = range(max(len(SEQLENS), len(EMULATED_SEQLENS)))
    for mark in (pytest.mark.parametrize("pair", pairs, ids=lambda i: f"L{i}"),
                 pytest.mark.parametrize("head_kind", list(HEADS), ids=str),
                 pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"]),
                 pytest.mark.parametrize("dtype", ["fp16", "bf16"]),
                 pytest.mark.parametrize("d", HEAD_DIMS),
                 pytest.mark.sweep):
        test = mark(test)
    return test


def pair_lengths(target: str, pair: int) -> tuple[int, int]:
    """(Lq, Lk) of grid pair `pair` for this target; skips the pairs only the other target has."""
    pairs = seqlens(target)
    if pair >= len(pairs):
        pytest.skip(f"the {target} grid has {len(pairs)} (Lq, Lk) pairs")
    return pairs[pair]


def heads(target: str, name: str) -> tuple[int, int]:
    return (EMULATED_HEADS if target == "emulated" else HEADS)[name]


def batch(target: str, b: int) -> int:
    return 1 if target == "emulated" else b


def device(target: str) -> str:
    return "cpu" if target == "emulated" else "cuda"


def make_qkv(b, hq, hkv, lq, lk, d, dtype, layout="bhsd", seed=0, requires_grad=False, target="gpu"):
    dev = device(target)
    g = torch.Generator(device=dev).manual_seed(seed)

    def one(h, length):
        if layout == "bshd":
            t = torch.randn(b, length, h, d, device=dev, dtype=dtype, generator=g).transpose(1, 2)
        else:
            t = torch.randn(b, h, length, d, device=dev, dtype=dtype, generator=g)
        return t.requires_grad_(requires_grad)

    return one(hq, lq), one(hkv, lk), one(hkv, lk)
