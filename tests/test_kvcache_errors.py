"""flash_attn_with_kvcache refuses bad input with an error that says what it got and what it takes,
before the cache is touched (nothing appended, nothing launched)."""
import pytest
import torch

from autoflash import flash_attn_with_kvcache

B, L, H, HK, D = 2, 64, 4, 2, 32


def _inputs(paged: bool = False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, 1, H, D, generator=g).to(torch.bfloat16)
    shape = (6, 32, HK, D) if paged else (B, L, HK, D)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, 1, HK, D, generator=g).to(torch.bfloat16) for _ in range(2))
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32) if paged else None
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, block_table=table,
                cache_seqlens=torch.tensor([3, 5], dtype=torch.int32))


CASES = {
    "block_table int64": (True, dict(block_table=torch.tensor([[0, 1], [2, 3]])), "block_table: got (2, 2) torch.int64"),
    "block_table 1-D": (True, dict(block_table=torch.tensor([0, 1], dtype=torch.int32)), "block_table: got (2,)"),
    "block_table batch": (True, dict(block_table=torch.zeros(3, 2, dtype=torch.int32)), "expected int32 of shape (2,"),
    "block_table page past the cache": (True, dict(block_table=torch.tensor([[0, 9], [2, 3]], dtype=torch.int32),
                                                  cache_seqlens=torch.tensor([40, 5], dtype=torch.int32)),
                                        "outside [0, 6)"),
    "cache_seqlens past the cache": (False, dict(cache_seqlens=torch.tensor([3, 64], dtype=torch.int32)),
                                     "cache_seqlens + seqlen_new <= 64"),
    "cache_seqlens int past the cache": (False, dict(cache_seqlens=64), "cache_seqlens + seqlen_new <= 64"),
    "cache_seqlens negative": (False, dict(cache_seqlens=torch.tensor([-1, 2], dtype=torch.int32)),
                               "0 <= cache_seqlens"),
    "cache_seqlens int64": (False, dict(cache_seqlens=torch.tensor([1, 2])), "cache_seqlens: got (2,) torch.int64"),
    "cache_seqlens missing": (False, dict(cache_seqlens=None), "cache_seqlens: got None"),
    "paged past the table": (True, dict(cache_seqlens=torch.tensor([64, 0], dtype=torch.int32)),
                             "cache_seqlens + seqlen_new <= 64"),
    "rotary dims odd": (False, dict(rotary_cos=torch.zeros(L, 3, dtype=torch.bfloat16),
                                    rotary_sin=torch.zeros(L, 3, dtype=torch.bfloat16)), "rotary_dim 6"),
    "rotary dims past head_dim": (False, dict(rotary_cos=torch.zeros(L, 24, dtype=torch.bfloat16),
                                              rotary_sin=torch.zeros(L, 24, dtype=torch.bfloat16)), "<= head_dim 32"),
    "rotary too short": (False, dict(rotary_cos=torch.zeros(10, 8, dtype=torch.bfloat16),
                                     rotary_sin=torch.zeros(10, 8, dtype=torch.bfloat16)), "got 10 positions"),
    "rotary without k": (False, dict(k=None, v=None, rotary_cos=torch.zeros(L, 8, dtype=torch.bfloat16),
                                     rotary_sin=torch.zeros(L, 8, dtype=torch.bfloat16)), "expected k and v too"),
    "rotary cos only": (False, dict(rotary_cos=torch.zeros(L, 8, dtype=torch.bfloat16)), "both or neither"),
    "k without v": (False, dict(v=None), "expected both"),
    "k heads": (False, dict(k=torch.zeros(B, 1, H, D, dtype=torch.bfloat16), v=torch.zeros(B, 1, H, D,
                                                                                        dtype=torch.bfloat16)),
                "k: got (2, 1, 4, 32)"),
    "leftpad past seqlens": (False, dict(cache_leftpad=torch.tensor([4, 0], dtype=torch.int32)),
                             "0 <= cache_leftpad <= cache_seqlens"),
    "leftpad paged past the keys": (True, dict(cache_leftpad=torch.tensor([4, 0], dtype=torch.int32)),
                                    "cache_leftpad: got [4, 0]"),
    "batch_idx paged int64": (True, dict(cache_batch_idx=torch.zeros(B, dtype=torch.int64)),
                              "cache_batch_idx: got (2,) torch.int64"),
    "batch_idx past the block table": (True, dict(cache_batch_idx=torch.tensor([1, 2], dtype=torch.int32)),
                                       "indices into the block table's 2 rows"),
    "packed q without max_seqlen_q": (False, dict(q=torch.zeros(3, H, D, dtype=torch.bfloat16),
                                                  cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32)),
                                      "max_seqlen_q: got None with cu_seqlens_q"),
    "packed q lengths": (False, dict(q=torch.zeros(3, H, D, dtype=torch.bfloat16), max_seqlen_q=2,
                                     cu_seqlens_q=torch.tensor([0, 1, 5], dtype=torch.int32)),
                         "cu_seqlens_q: got last value 5, expected 3, the rows of q"),
    "packed q past max_seqlen_q": (False, dict(q=torch.zeros(3, H, D, dtype=torch.bfloat16), max_seqlen_q=1,
                                               cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32)),
                                   "max_seqlen_q: got 1, expected >= 2, the longest sequence in cu_seqlens_q"),
    "packed new keys 4-D": (False, dict(cu_seqlens_k_new=torch.tensor([0, 1, 2], dtype=torch.int32)),
                            "k: got (2, 1, 2, 32)"),
    "batch_idx past the cache": (False, dict(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)),
                                 "indices into the cache's 2 rows"),
    "head_dim": (False, dict(q=torch.zeros(B, 1, H, 264, dtype=torch.bfloat16),  # off-grid ones run padded
                             k_cache=torch.zeros(B, L, HK, 264, dtype=torch.bfloat16),
                             v_cache=torch.zeros(B, L, HK, 264, dtype=torch.bfloat16), k=None, v=None),
                 "head_dim: got 264"),
    "dtype": (False, dict(q=torch.zeros(B, 1, H, D)), "expected one of float16, bfloat16"),
    "heads": (False, dict(q=torch.zeros(B, 1, 3, D, dtype=torch.bfloat16)), "kv heads dividing"),
    # caches laid out (batch, heads, seqlen, head_dim): the message names the layout it takes
    "cache layout": (False, dict(k_cache=torch.zeros(B, H, L, D, dtype=torch.bfloat16),
                                 v_cache=torch.zeros(B, H, L, D, dtype=torch.bfloat16), k=None, v=None),
                     "reads as (batch, heads, seqlen, head_dim): pass k_cache.transpose(1, 2)"),
    "num_splits": (False, dict(num_splits=-1), "num_splits: got -1"),
    "window": (False, dict(window_size=5), "window_size: got 5"),
    "softcap": (False, dict(softcap=-1.0), "softcap: got -1.0"),
    "alibi shape": (False, dict(alibi_slopes=torch.zeros(3)), "alibi_slopes: got (3,)"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_refused_before_the_cache_is_touched(name):
    paged, changes, message = CASES[name]
    kw = _inputs(paged)
    kw.update(changes)
    before = (kw["k_cache"].clone(), kw["v_cache"].clone())
    with pytest.raises((ValueError, TypeError)) as info:
        flash_attn_with_kvcache(**kw)
    assert message in str(info.value), str(info.value)
    assert torch.equal(kw["k_cache"], before[0]) and torch.equal(kw["v_cache"], before[1])


def test_good_input_runs_and_appends():
    """The cases above start from inputs that work: the refusals are the changes' doing; and what used
    to be refused runs: pages of any size with left padding and block-table rows picked, packed
    queries and new keys."""
    for paged in (False, True):
        kw = _inputs(paged)
        before = kw["k_cache"].clone()
        out = flash_attn_with_kvcache(**kw)
        assert out.shape == kw["q"].shape and not torch.equal(kw["k_cache"], before)
    kw = _inputs(True)
    kw.update(k_cache=torch.zeros(9, 24, HK, D, dtype=torch.bfloat16), v_cache=torch.zeros(9, 24, HK, D,
              dtype=torch.bfloat16), block_table=torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32),
              cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32), cache_leftpad=torch.tensor([1, 0],
              dtype=torch.int32), q=kw["q"][:, 0], cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
              max_seqlen_q=1, k=kw["k"][:, 0], v=kw["v"][:, 0], cu_seqlens_k_new=torch.tensor([0, 1, 2],
              dtype=torch.int32))
    out = flash_attn_with_kvcache(**kw)
    assert out.shape == kw["q"].shape and kw["k_cache"][4, 3].any() and kw["k_cache"][0, 5].any()


def test_backward_says_it_is_forward_only():
    """flash-attn's flash_attn_with_kvcache has no backward either; the error names the call and what
    to use instead, not an internal op."""
    kw = _inputs()
    kw["q"] = kw["q"].float().to(torch.bfloat16).requires_grad_()
    out = flash_attn_with_kvcache(**kw)
    with pytest.raises(RuntimeError, match="flash_attn_with_kvcache is forward only.*flash_attn_func"):
        out.float().sum().backward()
    with torch.no_grad():  # inference: nothing is wrapped, nothing to differentiate
        assert flash_attn_with_kvcache(**_inputs()).grad_fn is None
