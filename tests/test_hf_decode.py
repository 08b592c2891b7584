"""transformers' generate() on attn_implementation="autofa" decodes on the KV-cache kernel: tiny
random Llama (GQA) and Mistral (a sliding window shorter than the sequence) models, a left-padded
batch of two, greedy, in bf16 on the emulated kernels (an H100's), with transformers' DynamicCache
and StaticCache: the same tokens as the same weights on "sdpa", and every decode step's attention
went through the KV-cache kernel (counted), the prompt's through the prefill kernels."""
import copy
import warnings

import pytest
import torch

import autoflash
import autoflash.hf
from autoflash.dispatch import kvcache
from autoflash.dispatch.sdpa import FallbackWarning

from test_hf import CONFIGS, _batch

NEW_TOKENS = 4


@pytest.fixture(scope="module")
def bf16_pairs():
    autoflash.hf.register()
    made = {}
    for name in ("llama", "mistral"):
        cls, config, reference = CONFIGS[name]
        torch.manual_seed(0)
        ours = cls._from_config(copy.deepcopy(config), attn_implementation=autoflash.hf.NAME).eval()
        theirs = cls._from_config(copy.deepcopy(config), attn_implementation=reference).eval()
        theirs.load_state_dict(ours.state_dict())
        made[name] = ours.to(torch.bfloat16), theirs.to(torch.bfloat16)
    return made


@pytest.fixture
def decode_calls(monkeypatch):
    """(q_len, kv_len) of every attention call the KV-cache kernel ran."""
    seen = []
    real = kvcache.attention_over_cache

    def spy(q, k_cache, v_cache, seqlen, **kw):
        seen.append((q.shape[1], seqlen))
        return real(q, k_cache, v_cache, seqlen, **kw)

    monkeypatch.setattr(kvcache, "attention_over_cache", spy)
    return seen


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_greedy_generate_decodes_on_the_kvcache_kernel(bf16_pairs, decode_calls, name, cache):
    ours, theirs = bf16_pairs[name]
    ids, mask = _batch("left", length=8)
    kw = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with warnings.catch_warnings(), torch.no_grad(), autoflash.emulate("h100"):
        warnings.simplefilter("error", FallbackWarning)  # every call on the kernels
        got = ours.generate(ids, **kw)
    want = theirs.generate(ids, **kw)
    assert torch.equal(got, want), (got, want)
    layers = ours.config.num_hidden_layers
    # the prompt ran on the prefill kernels; each later token, one decode step per layer here
    assert len(decode_calls) == (NEW_TOKENS - 1) * layers, decode_calls
    assert all(q_len == 1 for q_len, _ in decode_calls)
    lengths = sorted({kv for _, kv in decode_calls})
    window = getattr(ours.config, "sliding_window", None)
    if window is None:  # every token so far: the prompt's 8, then one more a step
        assert lengths == list(range(ids.shape[1] + 1, ids.shape[1] + NEW_TOKENS))
    else:  # a sliding-window layer's cache keeps the last keys only
        assert max(lengths) <= ids.shape[1] + NEW_TOKENS - 1 and min(lengths) >= window, lengths


def test_training_and_long_chunks_keep_the_prefill_kernels(bf16_pairs, decode_calls):
    """A forward that needs gradients, and more than DECODE_MAX_QUERIES new queries, do not decode."""
    ours, _ = bf16_pairs["llama"]
    ids, mask = _batch("left", length=20)
    with warnings.catch_warnings(), autoflash.emulate("h100"):
        warnings.simplefilter("error", FallbackWarning)
        with torch.no_grad():
            first = ours(ids[:, :2], attention_mask=mask[:, :2], use_cache=True)
            ours(ids[:, 2:], attention_mask=mask, past_key_values=first.past_key_values)  # 18 new queries
        assert not decode_calls
        with torch.no_grad():
            first = ours(ids[:, :19], attention_mask=mask[:, :19], use_cache=True)
            ours(ids[:, 19:], attention_mask=mask, past_key_values=first.past_key_values)
        assert len(decode_calls) == ours.config.num_hidden_layers  # the control: one new query decodes
