"""Random CUDA inputs for the GPU tier, in (B, H, S, D) or as a (B, S, H, D) storage viewed as
(B, H, S, D) (the no-copy layout)."""
import torch


def make_qkv(b, hq, hkv, lq, lk, d, dtype, layout="bhsd", seed=0, requires_grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def one(h, length):
        if layout == "bshd":
            t = torch.randn(b, length, h, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
        else:
            t = torch.randn(b, h, length, d, device="cuda", dtype=dtype, generator=g)
        return t.requires_grad_(requires_grad)

    return one(hq, lq), one(hkv, lk), one(hkv, lk)
