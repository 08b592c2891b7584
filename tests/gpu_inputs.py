"""The GPU tier's grid (FlashAttention's tests: head dims, (Lq, Lk) pairs, MHA and GQA) and random
CUDA inputs in (B, H, S, D) or as a (B, S, H, D) storage viewed as (B, H, S, D) (no copy)."""
import torch

from autoflash.checks import TORCH_DTYPES  # noqa: F401  (re-exported for the GPU tests)

HEAD_DIMS = (32, 40, 64, 96, 128, 160, 192, 256)
SEQLENS = ((113, 203), (128, 217), (108, 256), (256, 512), (512, 256), (1023, 1024), (1024, 1023), (2048, 2048))
HEADS = {"mha": (6, 6), "gqa": (6, 2)}


def make_qkv(b, hq, hkv, lq, lk, d, dtype, layout="bhsd", seed=0, requires_grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def one(h, length):
        if layout == "bshd":
            t = torch.randn(b, length, h, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
        else:
            t = torch.randn(b, h, length, d, device="cuda", dtype=dtype, generator=g)
        return t.requires_grad_(requires_grad)

    return one(hq, lq), one(hkv, lk), one(hkv, lk)
