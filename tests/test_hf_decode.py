"""transformers' generate() on attn_implementation="autofa" decodes on flash_attn_with_kvcache: tiny
random Llama (GQA) and Mistral (a sliding window shorter than the sequence) models, a left-padded
batch of two, greedy, in bf16 on the emulated kernels (an H100's), with transformers' DynamicCache
and StaticCache: the same tokens as the same weights on "sdpa"; every decode step's attention ran
the decode kernel (autoflash.kernels.decode.flash_decode, counted), the prompt's the prefill kernels;
left padding went in as cache_leftpad, made on the device; a static cache's unfilled slots are never
read."""
import contextlib
import copy
import warnings

import pytest
import torch
from transformers import DynamicCache, StaticCache

import autoflash
import autoflash.hf
from autoflash.dispatch.sdpa import FallbackWarning
from autoflash.kernels import decode
from autoflash.reference.forward import within_tolerance

from test_hf import CONFIGS, _batch

NEW_TOKENS, PROMPT = 4, 8


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
def spy(monkeypatch):
    """Every launch of the decode kernel, with the keys in use, the left padding, whether a key
    bias came with it (the padding after the left padding: none here), and the window."""
    seen = dict(kernel=[])
    real_kernel = decode.flash_decode

    def kernel(q, k_cache, v_cache, cache_seqlens, **kw):
        leftpad, bias = kw.get("cache_leftpad"), kw.get("key_bias")
        seen["kernel"].append(dict(q_len=q.shape[1], seqlens=cache_seqlens, window=kw.get("window"),
                                   leftpad=None if leftpad is None else leftpad.tolist(),
                                   masked=None if bias is None else torch.isinf(bias).sum().item()))
        return real_kernel(q, k_cache, v_cache, cache_seqlens, **kw)

    monkeypatch.setattr(decode, "flash_decode", kernel)
    return seen


@contextlib.contextmanager
def _on_the_kernels():
    """The emulated H100, a fallback to torch SDPA being an error."""
    with warnings.catch_warnings(), autoflash.emulate("h100"):
        warnings.simplefilter("error", FallbackWarning)
        yield


def _generate(model, ids, mask, cache: str):
    kw = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    if cache == "static":
        kw["cache_implementation"] = "static"
    elif cache == "unwindowed":  # a cache without the config's sliding layers keeps every key
        kw["past_key_values"] = DynamicCache()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # every call on the kernels
        return model.generate(ids, **kw)


@pytest.mark.parametrize("name, cache", [("llama", "dynamic"), ("llama", "static"), ("mistral", "dynamic"),
                                         ("mistral", "static"), ("mistral", "unwindowed")])
def test_greedy_generate_matches_sdpa_and_decodes_on_the_kvcache_kernel(bf16_pairs, spy, target, name, cache):
    ours, theirs = bf16_pairs[name]
    ids, mask = _batch("left", length=PROMPT)  # row 1: 3 pad tokens
    if target == "gpu":
        ours, theirs, ids, mask = (copy.deepcopy(x).cuda() for x in (ours, theirs, ids, mask))
    assert torch.equal(_generate(ours, ids, mask, cache), _generate(theirs, ids, mask, cache))
    layers = ours.config.num_hidden_layers
    # the prompt on the prefill kernels; each later token, one decode kernel launch per layer, with
    # no key masked beyond the left padding
    assert len(spy["kernel"]) == (NEW_TOKENS - 1) * layers, spy
    assert all(c["q_len"] == 1 and not c["masked"] for c in spy["kernel"])
    if name == "llama" or cache == "unwindowed":
        # every token so far (a static cache: its filled slots), the left padding as cache_leftpad
        assert [c["seqlens"] for c in spy["kernel"]] == [n for n in range(PROMPT + 1, PROMPT + NEW_TOKENS)
                                                         for _ in range(layers)]
        window = (-1, -1) if name == "llama" else (ours.config.sliding_window - 1, 0)  # Mistral's: 5 keys
        assert all(c["leftpad"] == [0, 3] and c["window"] == window for c in spy["kernel"])
    else:  # a sliding-window layer keeps the last keys only: past the padding, the window over them
        window = ours.config.sliding_window
        assert all(c["seqlens"] == window and c["leftpad"] is None for c in spy["kernel"]), spy["kernel"]


def test_the_decode_kernel_count_sees_the_prefill_kernels(bf16_pairs, spy, monkeypatch):
    """The control for the counts above: with decoding switched off, the same generate() launches no
    decode kernel (the decode steps take the prefill kernels) and still gives sdpa's tokens."""
    ours, theirs = bf16_pairs["llama"]
    monkeypatch.setattr(autoflash.hf, "DECODE_MAX_QUERIES", 0)
    ids, mask = _batch("left", length=PROMPT)
    with autoflash.emulate("h100"):
        got = _generate(ours, ids, mask, "dynamic")
    assert torch.equal(got, _generate(theirs, ids, mask, "dynamic"))
    assert not spy["kernel"]


def test_training_and_long_chunks_keep_the_prefill_kernels(bf16_pairs, spy):
    """A forward that needs gradients, and more than DECODE_MAX_QUERIES new queries, do not decode."""
    ours, _ = bf16_pairs["llama"]
    ids, mask = _batch("left", length=20)
    with _on_the_kernels():
        with torch.no_grad():
            first = ours(ids[:, :2], attention_mask=mask[:, :2], use_cache=True)
            ours(ids[:, 2:], attention_mask=mask, past_key_values=first.past_key_values)  # 18 new queries
        assert not spy["kernel"]
        ours.requires_grad_(True)
        try:
            first = ours(ids[:, :19], attention_mask=mask[:, :19], use_cache=True)
            ours(ids[:, 19:], attention_mask=mask, past_key_values=first.past_key_values)  # one query, gradients
        finally:
            ours.requires_grad_(False)
        assert not spy["kernel"]
        with torch.no_grad():
            first = ours(ids[:, :19], attention_mask=mask[:, :19], use_cache=True)
            ours(ids[:, 19:], attention_mask=mask, past_key_values=first.past_key_values)
        assert len(spy["kernel"]) == ours.config.num_hidden_layers  # the control: one new query decodes


@pytest.mark.parametrize("masks", ["none", "growing", "capacity"])
def test_a_static_cache_never_reads_its_unfilled_slots(bf16_pairs, spy, masks):
    """A StaticCache of 16 slots holding 8 prompt tokens, its unfilled slots poisoned: one decode
    step's logits are those over a DynamicCache. Masks: none (the cache's query offset alone says
    which slots are filled), generate()'s (as long as the tokens so far), or as long as the cache."""
    ours, _ = bf16_pairs["llama"]
    ids, mask = _batch("none" if masks == "none" else "left", length=PROMPT + 1)
    full = torch.cat((mask, mask.new_ones(2, 16 - mask.shape[1])), 1)

    def mask_for(kind, n):  # generate()'s mask holds the n tokens so far
        return None if masks == "none" else full if masks == "capacity" and kind == "static" else mask[:, :n]

    logits = {}
    with torch.no_grad(), _on_the_kernels():
        for kind in ("dynamic", "static"):
            cache = DynamicCache(config=ours.config) if kind == "dynamic" else StaticCache(ours.config, 16)
            ours(ids[:, :PROMPT], attention_mask=mask_for(kind, PROMPT), past_key_values=cache, use_cache=True)
            if kind == "static":  # values that would swamp the output were any weight to reach them
                for layer in cache.layers:
                    layer.keys[:, :, PROMPT:] = 30.0
                    layer.values[:, :, PROMPT:] = 1e3
            logits[kind] = ours(ids[:, PROMPT:], attention_mask=mask_for(kind, PROMPT + 1),
                                past_key_values=cache).logits
    assert [c["seqlens"] for c in spy["kernel"]] == [PROMPT + 1] * 4
    assert torch.allclose(logits["static"], logits["dynamic"], atol=1e-2)


def _sdpa(q, k, v, key_mask, window):
    """torch SDPA in q's dtype on autoflash.hf's boolean mask (padding, bottom-right window)."""
    mask = autoflash.hf.sdpa_bool_mask(key_mask, q.shape[2], k.shape[2], False, window, q.device)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("layout", ["left", "right", "holes"])
@pytest.mark.parametrize("window", [(-1, -1), (5, 0)])
def test_a_decode_step_takes_any_2d_mask(spy, layout, window):
    """Leading padded keys go in as cache_leftpad (never read), right padding and holes as the
    kernel's key bias: both on the decode kernel, both attention over the real keys only."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 1, 64, generator=g).bfloat16()
    k, v = (torch.randn(3, 2, 19, 64, generator=g).bfloat16() for _ in range(2))
    key_mask = torch.ones(3, 19, dtype=torch.bool)
    if layout == "left":
        key_mask[1, :4] = key_mask[2, :11] = False
    elif layout == "right":
        key_mask[1, -3:] = False
    else:
        key_mask[0, 2:5] = key_mask[2, 7] = False
    with _on_the_kernels():
        out = autoflash.hf.run(q, k, v, key_mask, causal=True, window=window, softcap=0.0, dropout=0.0, scale=None,
                               enable_gqa=True)
    ok, err, bound = within_tolerance(out, _sdpa(*(t.float() for t in (q, k, v)), key_mask, window),
                                      _sdpa(q, k, v, key_mask, window))
    assert ok, f"error {err:.3g} > bound {bound:.3g}"
    assert len(spy["kernel"]) == 1
    assert spy["kernel"][0]["leftpad"] == ([0, 4, 11] if layout == "left" else [0, 0, 0])
    assert spy["kernel"][0]["masked"] == {"left": 0, "right": 3, "holes": 4}[layout]


def test_padding_arguments_are_made_once_per_mask():
    """The left padding and the key bias of a mask, as the kernel indexes them (from each row's first
    kept key), remembered for every layer of a forward and remade after an in-place change."""
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, :2] = False  # left padding
    mask[2, [0, 2, 5]] = False  # left padding, a hole, right padding
    mask[3] = False  # no real key: every key padding
    leftpad, bias = autoflash.hf.padding_arguments(mask, "cpu")
    assert leftpad.dtype == torch.int32 and leftpad.tolist() == [0, 2, 1, 6]
    inf = float("-inf")
    assert bias.dtype == torch.float32 and bias[:3].tolist() == [[0.0] * 6, [0.0] * 6, [0.0, inf, 0.0, 0.0, inf, inf]]
    assert autoflash.hf.padding_arguments(mask, "cpu")[1] is bias  # remembered: made once per forward
    mask[0, 5] = False  # an in-place change is seen (its version counter moved)
    assert autoflash.hf.padding_arguments(mask, "cpu")[1][0].tolist() == [0.0] * 5 + [inf]
    with torch.inference_mode():
        assert autoflash.hf.padding_arguments(torch.tensor([[False, True], [True, True]]), "cpu")[0].tolist() == [1, 0]
