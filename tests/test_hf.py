"""transformers with attn_implementation="autofa": tiny, randomly initialised Llama (GQA), Mistral
(a sliding window shorter than the sequence) and Gemma 2 (softcap and a sliding window) models, no
download, give the logits of the same model on "sdpa" ("eager" for Gemma 2, the one transformers
implementation with softcap):
- on the CPU outside emulation, through the fallback (torch SDPA on the equivalent mask): equal;
- on the kernel path, run by the host emulator as on an H100 (autoflash.emulate), in bf16, on
  left- and right-padded batches: within bf16 noise at the non-padded positions.
The mask interface (kernel_mask) and the window convention are checked against transformers' own
sdpa masks, with no model."""
import copy
import warnings

import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM)
from transformers.masking_utils import (causal_mask_function, sdpa_mask, sliding_window_bidirectional_mask_function,
                                        sliding_window_causal_mask_function)

import autoflash
import autoflash.hf
from autoflash.dispatch import sdpa as dispatch
from autoflash.dispatch.sdpa import FallbackWarning, UnsupportedCallError

VOCAB, SEQ = 128, 12
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=64,  # two query heads per kv head
              initializer_range=0.1)  # sharper attention than the default 0.02: the masks, window and softcap matter
CONFIGS = {
    "llama": (LlamaForCausalLM, LlamaConfig(**COMMON), "sdpa"),
    "mistral": (MistralForCausalLM, MistralConfig(**COMMON, sliding_window=5), "sdpa"),
    # softcap small enough to bend the tiny model's scores; layer 0 slides (window 5), layer 1 is global
    "gemma2": (Gemma2ForCausalLM, Gemma2Config(**COMMON, sliding_window=5, attn_logit_softcapping=1.0,
                                               query_pre_attn_scalar=32, final_logit_softcapping=None,
                                               layer_types=["sliding_attention", "full_attention"]), "eager"),
}


@pytest.fixture(scope="module")
def pairs():
    """name -> (ours on "autofa", theirs on sdpa/eager), the same random weights."""
    autoflash.hf.register()
    made = {}
    for name, (cls, config, reference) in CONFIGS.items():
        torch.manual_seed(0)
        ours = cls._from_config(copy.deepcopy(config), attn_implementation=autoflash.hf.NAME).eval()
        theirs = cls._from_config(copy.deepcopy(config), attn_implementation=reference).eval()
        theirs.load_state_dict(ours.state_dict())
        made[name] = ours, theirs
    return made


@pytest.fixture
def calls(monkeypatch):
    """What each attention call hands the kernels' entry (autoflash.hf.run)."""
    seen = []
    real = autoflash.hf.run

    def spy(query, key, value, key_mask, **kw):
        seen.append(dict(q=tuple(query.shape), k=tuple(key.shape), padded=key_mask is not None, **kw))
        return real(query, key, value, key_mask, **kw)

    monkeypatch.setattr(autoflash.hf, "run", spy)
    dispatch._warned.clear()
    return seen


def _batch(padding: str = "left", length: int = SEQ):
    ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, length, dtype=torch.long)
    if padding == "left":
        mask[1, :3] = 0
    elif padding == "right":
        mask[1, -4:] = 0
    return ids, mask


def test_registered_name_is_accepted(pairs):
    ours, _ = pairs["llama"]
    assert ours.config._attn_implementation == "autofa"


# ------------------------------------------------------------------ the fallback (CPU, float32)
def test_fallback_on_cpu_gives_sdpa_logits(pairs, calls):
    ours, theirs = pairs["llama"]
    ids, padded = _batch()
    with torch.no_grad(), pytest.warns(FallbackWarning, match="cpu tensors"):
        plain = ours(ids).logits
        masked = ours(ids, attention_mask=padded).logits
    assert torch.equal(plain, theirs(ids).logits) and torch.equal(masked, theirs(ids, attention_mask=padded).logits)
    # no mask when unpadded, the 2D padding mask when padded; causal both times
    assert [(c["q"], c["k"], c["causal"], c["padded"]) for c in calls] == \
        [((2, 4, 12, 32), (2, 2, 12, 32), True, False)] * 2 + [((2, 4, 12, 32), (2, 2, 12, 32), True, True)] * 2


def test_fallback_with_a_sliding_window_gives_sdpa_logits(pairs, calls):
    """The window reaches the fallback as transformers' own sdpa mask has it: bit-equal logits."""
    ours, theirs = pairs["mistral"]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        for padding in ("none", "left", "right"):
            ids, mask = _batch(padding)
            assert torch.equal(ours(ids, attention_mask=mask).logits, theirs(ids, attention_mask=mask).logits)
    assert {c["window"] for c in calls} == {(4, 0)}


def test_generate_decodes_with_a_cache(pairs, calls):
    ours, theirs = pairs["llama"]
    ids, mask = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        out = ours.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, theirs.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False))
    decode = [c for c in calls if c["q"][2] == 1]  # one new token: every cached key, bottom-right
    assert decode and all(c["padded"] for c in decode) and decode[-1]["k"][2] == SEQ + 3


def test_softcap_cannot_fall_back_to_sdpa(pairs):
    ours, _ = pairs["gemma2"]
    ids, mask = _batch()
    with torch.no_grad(), pytest.raises(UnsupportedCallError, match="softcap 1.0 .*cpu tensors.*'eager'"):
        ours(ids, attention_mask=mask)


# ------------------------------------------------------------------ the kernels (emulated H100, bf16)
def _logits_on_the_kernels(model, ids, mask):
    """The model in bf16 with every attention call on the kernels (a fallback is an error)."""
    try:
        model.to(torch.bfloat16)
        with torch.no_grad(), warnings.catch_warnings(), autoflash.emulate("h100"):
            warnings.simplefilter("error", FallbackWarning)
            return model(ids, attention_mask=mask).logits.float()
    finally:
        model.to(torch.float32)


def _assert_within_bf16_noise(got, want, noise, real, what):
    """got no further from the fp32 logits `want` than the reference model's own bf16 logits
    `noise` (x3), at the real tokens; the argmax agreeing about as often (near-ties flip in bf16)."""
    err, bf16_err = (got - want)[real].abs().max().item(), (noise - want)[real].abs().max().item()
    assert err <= 3 * bf16_err + 1e-2, f"{what}: error {err:.3g} vs the reference's own bf16 {bf16_err:.3g}"
    agree = lambda x: (x.argmax(-1) == want.argmax(-1))[real].float().mean().item()  # noqa: E731
    assert agree(got) >= agree(noise) - 0.1


def _bf16_logits(model, ids, mask):
    try:
        model.to(torch.bfloat16)
        with torch.no_grad():
            return model(ids, attention_mask=mask).logits.float()
    finally:
        model.to(torch.float32)


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_kernel_path_in_bf16_matches_the_reference(pairs, calls, name, padding):
    """Ours in bf16 on the kernels against the fp32 reference model, at the real tokens: no further
    off than the reference implementation itself in bf16 (bf16 noise), and the same argmax about as
    often."""
    ours, theirs = pairs[name]
    ids, mask = _batch(padding)
    got = _logits_on_the_kernels(ours, ids, mask)
    with torch.no_grad():
        want = theirs(ids, attention_mask=mask).logits
    _assert_within_bf16_noise(got, want, _bf16_logits(theirs, ids, mask), mask.bool(), f"{name} {padding}")
    assert len(calls) == 2 and all(c["padded"] == (padding != "none") and c["causal"] for c in calls)
    if name != "llama":
        assert calls[0]["window"] == (4, 0)  # layer 0 slides over 5 keys (itself and 4 before)
    if name == "gemma2":
        assert calls[0]["softcap"] == calls[1]["softcap"] == 1.0 and calls[1]["window"] == (-1, -1)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_kernel_path_continues_a_cache(pairs, calls, name):
    """A second chunk of 4 tokens after 8 cached ones (left-padded batch): queries fewer than keys, so
    causal order and window are bottom-right aligned (the last query sees the last key); the logits
    are those of one forward over all 12 tokens."""
    ours, theirs = pairs[name]
    ids, mask = _batch("left")
    try:
        ours.to(torch.bfloat16)
        with torch.no_grad(), warnings.catch_warnings(), autoflash.emulate("h100"):
            warnings.simplefilter("error", FallbackWarning)
            first = ours(ids[:, :8], attention_mask=mask[:, :8], use_cache=True)
            got = ours(ids[:, 8:], attention_mask=mask, past_key_values=first.past_key_values).logits.float()
    finally:
        ours.to(torch.float32)
    with torch.no_grad():
        want = theirs(ids, attention_mask=mask).logits[:, 8:]
    noise = _bf16_logits(theirs, ids, mask)[:, 8:]
    _assert_within_bf16_noise(got, want, noise, mask[:, 8:].bool(), f"{name} second chunk")
    second = calls[2:]
    assert second[0]["q"][2] == 4 and second[0]["k"][2] > 4 and all(c["causal"] for c in second)


def test_softcap_and_window_change_the_result(pairs):
    """The checks above would hold vacuously if the tiny Gemma 2's softcap and window did nothing."""
    _, theirs = pairs["gemma2"]
    ids, mask = _batch("left")
    with torch.no_grad():
        base = theirs(ids, attention_mask=mask).logits
        for change in (dict(attn_logit_softcapping=None), dict(sliding_window=64)):
            config = copy.deepcopy(theirs.config)
            for attr, value in change.items():
                setattr(config, attr, value)
            other = Gemma2ForCausalLM._from_config(config, attn_implementation="eager").eval()
            other.load_state_dict(theirs.state_dict())
            assert (other(ids, attention_mask=mask).logits - base).abs().max() > 0.05, change


def test_greedy_generate_on_a_padded_batch_matches_sdpa(pairs):
    ours, theirs = pairs["mistral"]
    ids, mask = _batch("left", length=8)
    try:
        for m in (ours, theirs):
            m.to(torch.bfloat16)
        with warnings.catch_warnings(), autoflash.emulate("h100"):
            warnings.simplefilter("error", FallbackWarning)
            got = ours.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        want = theirs.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    finally:
        for m in (ours, theirs):
            m.to(torch.float32)
    assert torch.equal(got, want)


# ------------------------------------------------------------------ the mask interface, no model
def _padding(length=10):
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[0, :3] = False  # left padding
    mask[1, -2:] = False  # right padding
    return mask


def test_kernel_mask_hands_over_the_2d_padding_mask():
    padded = _padding()
    kw = dict(batch_size=2, q_length=10, kv_length=10, mask_function=causal_mask_function)
    assert torch.equal(autoflash.hf.kernel_mask(**kw, attention_mask=padded), padded)
    assert autoflash.hf.kernel_mask(**kw, attention_mask=torch.ones(2, 10, dtype=torch.bool)) is None
    assert autoflash.hf.kernel_mask(**kw, attention_mask=None) is None
    # a sliding-window cache holds the last kv_length keys: the mask's last columns
    assert torch.equal(autoflash.hf.kernel_mask(**{**kw, "kv_length": 6}, kv_offset=4, attention_mask=padded),
                       padded[:, 4:])
    # a static cache of 16 slots with 10 filled (q_offset a tensor, as StaticLayer gives it): the used keys only
    static = dict(kw, kv_length=16, q_length=1, q_offset=torch.tensor(9))
    assert autoflash.hf.kernel_mask(**static, attention_mask=None).shape == (2, 10)
    # custom mask functions and packed sequences need sdpa's 4D mask
    full = autoflash.hf.kernel_mask(**kw, attention_mask=padded, use_vmap=True, allow_is_causal_skip=False)
    assert full.shape == (2, 1, 10, 10)
    assert autoflash.hf.kernel_mask(**kw, attention_mask=None, allow_is_causal_skip=False).shape == (2, 1, 10, 10)


@pytest.mark.parametrize("q_len, kv_len, q_offset, kv_offset", [(10, 10, 0, 0), (1, 10, 9, 0), (3, 10, 7, 0),
                                                               (1, 4, 9, 6), (4, 7, 6, 3)])
@pytest.mark.parametrize("window", [None, 1, 3, 20])
def test_window_and_alignment_equal_transformers_sdpa_masks(q_len, kv_len, q_offset, kv_offset, window):
    """sdpa_bool_mask(padding, bottom-right causal, window_size(w)) is transformers' causal or
    sliding-window sdpa mask, entry for entry (decode, chunked prefill, a sliding cache's offset)."""
    padded = _padding(kv_offset + kv_len)
    function = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    want = sdpa_mask(batch_size=2, q_length=q_len, kv_length=kv_len, q_offset=q_offset, kv_offset=kv_offset,
                     mask_function=function, attention_mask=padded, allow_is_causal_skip=False)
    keys = autoflash.hf.kernel_mask(batch_size=2, q_length=q_len, kv_length=kv_len, q_offset=q_offset,
                                    kv_offset=kv_offset, attention_mask=padded)
    got = autoflash.hf.sdpa_bool_mask(keys, q_len, kv_len, q_len > 1, autoflash.hf.window_size(window, True, kv_len),
                                      "cpu")
    assert torch.equal(got.expand_as(want), want)


@pytest.mark.parametrize("window", [1, 3])
def test_bidirectional_window_equals_transformers_sdpa_mask(window):
    """Encoders (ModernBERT) pass sliding_window = w + 1 for |i - j| <= w: flash-attn's (w, w)."""
    want = sdpa_mask(batch_size=2, q_length=9, kv_length=9, mask_function=sliding_window_bidirectional_mask_function(
        window), attention_mask=_padding(9), allow_is_causal_skip=False)
    got = autoflash.hf.sdpa_bool_mask(_padding(9), 9, 9, False, autoflash.hf.window_size(window + 1, False, 9), "cpu")
    assert torch.equal(got, want)


def test_window_size_follows_flash_attn():
    assert autoflash.hf.window_size(None, True, 100) == (-1, -1)
    assert autoflash.hf.window_size(8, True, 8) == (-1, -1)  # covers every key
    assert autoflash.hf.window_size(8, True, 9) == (7, 0)
    assert autoflash.hf.window_size(8, False, 9) == (7, 7)
    with pytest.raises(ValueError, match="sliding_window: got 0"):
        autoflash.hf.window_size(0, True, 9)


def test_unsupported_features_are_refused_clearly():
    q = torch.randn(1, 2, 4, 32)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="s_aux: got a tensor"):
        autoflash.hf.attention_forward(module, q, q, q, None, s_aux=torch.zeros(2))
    with pytest.raises(ValueError, match="cache: got a object"):
        autoflash.hf.attention_forward(module, q, q, q, None, cache=object())
    with pytest.raises(ValueError, match="position_bias"):
        autoflash.hf.attention_forward(module, q, q, q, None, position_bias=torch.zeros(1, 2, 4, 4))
    with pytest.raises(ValueError, match="softcap: got 30.0 with a 4D attention mask"):
        autoflash.hf.attention_forward(module, q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool), softcap=30.0)
    with pytest.raises(ValueError, match=r"attention_mask: got shape \(3, 4\)"):
        autoflash.hf.attention_forward(module, q, q, q, torch.ones(3, 4, dtype=torch.bool))


def test_dropout_in_training_falls_back():
    q = torch.randn(1, 2, 4, 32, dtype=torch.bfloat16)
    dispatch._warned.clear()
    with autoflash.emulate("h100"), pytest.warns(FallbackWarning, match="dropout_p > 0"):
        out, _ = autoflash.hf.attention_forward(torch.nn.Module(), q, q, q, None, dropout=0.1)
    assert out.shape == (1, 4, 2, 32)
