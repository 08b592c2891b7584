"""transformers with attn_implementation="autofa": a tiny, randomly initialised Llama (GQA, no
download) gives the logits of the same model on "sdpa", through the fallback on the CPU and
through autoflash's own ops (their CPU references) on the kernel path."""
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autoflash.hf
from autoflash.dispatch import sdpa as dispatch
from autoflash.dispatch.sdpa import FallbackWarning

CONFIG = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)  # head_dim 32, two query heads per kv head


@pytest.fixture(scope="module")
def models():
    autoflash.hf.register()
    torch.manual_seed(0)
    ours = LlamaForCausalLM._from_config(LlamaConfig(**CONFIG), attn_implementation=autoflash.hf.NAME).eval()
    theirs = LlamaForCausalLM._from_config(LlamaConfig(**CONFIG), attn_implementation="sdpa").eval()
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


@pytest.fixture
def calls(monkeypatch):
    seen = []
    real = autoflash.hf.attention

    def spy(query, key, value, **kw):
        seen.append((tuple(query.shape), tuple(key.shape), kw["is_causal"], kw["enable_gqa"], kw["attn_mask"] is None))
        return real(query, key, value, **kw)

    monkeypatch.setattr(autoflash.hf, "attention", spy)
    dispatch._warned.clear()
    return seen


def _batch():
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    padded = torch.ones(2, 12, dtype=torch.long)
    padded[1, :3] = 0  # left padding: the model must pass a mask
    return ids, padded


def test_registered_name_is_accepted(models):
    ours, _ = models
    assert ours.config._attn_implementation == "autofa"


def test_fallback_on_cpu_gives_sdpa_logits(models, calls):
    ours, theirs = models
    ids, padded = _batch()
    with torch.no_grad(), pytest.warns(FallbackWarning, match="cpu tensors"):
        plain = ours(ids).logits
        masked = ours(ids, attention_mask=padded).logits
    assert torch.equal(plain, theirs(ids).logits) and torch.equal(masked, theirs(ids, attention_mask=padded).logits)
    # causal with no mask when unpadded (the kernels' path on a GPU), a mask with padding; GQA both times
    assert calls[0] == ((2, 4, 12, 32), (2, 2, 12, 32), True, True, True)
    assert calls[-1][2:] == (False, True, False)
    assert len(calls) == 4  # two layers, two forwards


def test_generate_decodes_with_a_cache(models, calls):
    ours, theirs = models
    ids, _ = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        out = ours.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert torch.equal(out, theirs.generate(ids[:1], max_new_tokens=4, do_sample=False))
    decode = [c for c in calls if c[0][2] == 1]  # one new token attends to every cached key, not causal
    assert decode and not any(c[2] for c in decode)


def test_kernel_path_in_bf16_matches_sdpa(models, calls):
    """The model on the kernels themselves, run by the host emulator as on an H100."""
    ours, theirs = models
    ids, _ = _batch()
    try:
        ours.to(torch.bfloat16)
        with torch.no_grad(), warnings.catch_warnings(), autoflash.emulate("h100"):
            warnings.simplefilter("error", FallbackWarning)  # every attention call runs the kernels
            got = ours(ids).logits.float()
        want = theirs(ids).logits
    finally:
        ours.to(torch.float32)
    assert len(calls) == 2
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_unsupported_features_are_refused_clearly():
    q = torch.randn(1, 2, 4, 32)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="softcap: got 30.0"):
        autoflash.hf.attention_forward(module, q, q, q, None, softcap=30.0)
