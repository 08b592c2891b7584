"""The variant calls the emulated suites share (tests/test_variant_kernels.py, test_sm90_forward.py):
flash-attn's features as the launcher's keyword arguments, and the tensors each one needs."""
import math

import torch

# name: the launcher's variant arguments (tensors made per case: "alibi" slopes, "padding" key bias)
VARIANTS = {
    "causal-br": dict(causal=True, align="bottom_right"),
    "causal-tl": dict(causal=True),
    "window-5-3": dict(window=(5, 3), align="bottom_right"),
    "window-left": dict(window=(11, -1), align="bottom_right"),   # one-sided: keys up to 11 back, all ahead
    "window-right": dict(window=(-1, 7), align="bottom_right"),   # all behind, 7 ahead
    "window-0-0": dict(window=(0, 0), align="bottom_right"),      # the diagonal key only
    "window-causal": dict(window=(17, 4), causal=True, align="bottom_right"),  # causal makes right 0
    "window-tl": dict(window=(9, 2)),
    "softcap-50": dict(softcap=50.0),
    "softcap-2": dict(softcap=2.0, causal=True, align="bottom_right"),
    "alibi": dict(alibi="batch"),
    "alibi-causal": dict(alibi="heads", causal=True, align="bottom_right"),
    "padding": dict(padding=True),
    "gemma": dict(softcap=3.0, window=(31, 0), alibi="batch", align="bottom_right"),
    # FlashAttention-3's attention_chunk (chunked local attention, Llama 4's): chunks across the key
    # tiles, narrower than one, and under a window
    "chunk-causal": dict(attention_chunk=37, causal=True, align="bottom_right"),
    "chunk-16": dict(attention_chunk=16, align="bottom_right"),
    "chunk-window": dict(attention_chunk=50, window=(20, 5), align="bottom_right"),
}

# (Lq, Lk) of the sm90 family's variant sweeps (test_sm90_forward.py, test_sm90_backward.py): fewer
# queries than keys, one key, more queries than keys.
SM90_VARIANT_PAIRS = ((113, 203), (77, 1), (203, 113))


def arguments(spec: dict, b: int, hq: int, lk: int, dev: str, g: torch.Generator) -> dict:
    """The launcher's keyword arguments for a VARIANTS entry; padding: batch 0 keeps a random prefix
    of the keys, batch 1 (if any) none at all (rows that see no key)."""
    kw = {k: v for k, v in spec.items() if k not in ("alibi", "padding")}
    if spec.get("alibi"):  # flash-attn's tests draw slopes as rand * 0.3
        shape = (b, hq) if spec["alibi"] == "batch" else (hq,)
        kw["alibi_slopes"] = (torch.rand(shape, generator=g) * 0.3).to(dev)
    if spec.get("padding"):
        bias = torch.zeros(b, lk)
        bias[0, torch.randint(1, lk + 1, (1,), generator=g).item():] = -math.inf
        if b > 1:
            bias[1:] = -math.inf
        kw["key_bias"] = bias.to(dev)
    return kw
