"""flash_attn_with_kvcache on the decode kernels against the references, flash-attn's
test_flash_attn_kvcache grid at emulator sizes: seqlen_q 1..128, new k/v appended or not, dense and
paged caches (page sizes 1, 5 and 16..256), cache_seqlens including 0, cache_batch_idx and left
padding on both, rotary (GPT-J and GPT-NeoX, part or all of the head dim), MHA/GQA/MQA, causal,
windows, softcap, ALiBi and FlashAttention-3's attention chunks, unsplit and split. Each case checks:
- out within FlashAttention-3's rule (2x PyTorch's own error in the input dtype, 3x with a softcap,
  both against the fp32 reference, plus twice the reference's rounding in the input dtype:
  autoflash.reference.forward.within_tolerance), the LSE within 1e-3;
- the cache after the call bit-equal to a reference append (rotary included);
- split and unsplit runs of the kernel agreeing within fp32 rounding (LSE 1e-5 relative, out within
  one rounding of the output dtype).
Cases run on a GPU (`gpu` marker) and on the emulator; the emulated draws are sampled per run
(conftest.py: one per (variant, dtype, d), plus a share of the rest; AUTOFLASH_SWEEP=full runs all)."""
import random

import pytest
import torch

from autoflash import flash_attn_with_kvcache
from autoflash.kernels.decode import flash_decode
from autoflash.reference.forward import within_tolerance
from autoflash.reference.kvcache import append_ref, attention_kvcache_ref, rotary

from autoflash.kernels.launch import recording
from gpu_inputs import EMULATED_GPU, TORCH_DTYPES, device

VARIANTS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(7, 2)),
    "window-causal": dict(window_size=(19, -1), causal=True),
    "softcap": dict(softcap=4.0, causal=True),
    "alibi": dict(alibi=True, causal=True),
    "chunk": dict(attention_chunk=37, causal=True),  # FlashAttention-3's chunked local attention (Llama 4)
}
# flash-attn's (seqlen_q, seqlen_k) pairs scaled to the emulator: seqlen_k is the cache's capacity
PAIRS = ((1, 128), (1, 339), (3, 299), (16, 200), (64, 256), (128, 128), (5, 17))
# paged-P: pages of P rows; sizes that no key tile divides (1, 5: FA3 tests 1 and 4) and left padding
# make the kernel gather each row from its page; +batch_idx picks block-table rows (FA3's).
LAYOUTS = ("dense", "batch_idx", "leftpad", "paged-16", "paged-64", "paged-256", "paged-1", "paged-5+batch_idx",
           "paged-16+leftpad", "paged-64+batch_idx")
HEADS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (3, 1)}
ROTARY = (None, ("interleaved", 0.5), ("interleaved", 1.0), ("neox", 0.5), ("neox", 1.0))


def _case(draw: int) -> dict:
    """One draw of the grid beyond (variant, dtype, d): every option of each axis comes up within a
    few draws (draw i takes option i mod n of each, shuffled per axis), the lengths are random."""
    rng = random.Random(draw)
    pick = lambda options, salt: options[(draw + salt) % len(options)]  # noqa: E731
    return dict(pair=pick(PAIRS, 0), layout=pick(LAYOUTS, 3), heads=pick(list(HEADS), 1), rotary=pick(ROTARY, 2),
                new_kv=pick((True, False, True), 5), splits=pick((0, 1, 3), 4), rng=rng)


def _inputs(case: dict, d: int, dt, dev: str, g: torch.Generator, dv: int | None = None):
    """One draw's q, caches and new rows (v's head dim dv where given), and the index tensors."""
    (lq, capacity), (hq, hkv) = case["pair"], HEADS[case["heads"]]
    dv = dv or d
    rng, layout = case["rng"], case["layout"]
    b = 3
    new = 0 if not case["new_kv"] else min(lq, capacity)
    seqlens = [rng.randint(0, capacity - new) for _ in range(b)]
    seqlens[rng.randrange(b)] = 0  # an empty cache among them
    t = {"q": torch.randn(b, lq, hq, d, generator=g).to(dev, dt)}
    block_table = batch_idx = leftpad = None
    rows = b + 2 if "batch_idx" in layout else b  # cache rows, or block-table rows when paged
    if layout.startswith("paged"):
        page = int(layout.split("+")[0].split("-")[1])
        per_seq = -(-capacity // page)
        pages = rows * per_seq + 2
        t["k_cache"], t["v_cache"] = (torch.randn(pages, page, hkv, w, generator=g).to(dev, dt) for w in (d, dv))
        block_table = torch.randperm(pages, generator=g)[:rows * per_seq].reshape(rows, per_seq).to(torch.int32)
        capacity = per_seq * page
    else:
        t["k_cache"], t["v_cache"] = (torch.randn(rows, capacity, hkv, w, generator=g).to(dev, dt) for w in (d, dv))
    if "batch_idx" in layout:
        batch_idx = torch.randperm(rows, generator=g)[:b].to(torch.int32)
    if "leftpad" in layout:
        leftpad = torch.tensor([rng.randint(0, s) for s in seqlens], dtype=torch.int32)
    if new:
        t["k"], t["v"] = (torch.randn(b, new, hkv, w, generator=g).to(dev, dt) for w in (d, dv))
    if case["rotary"] and new:  # rotary goes with an append (flash-attn's rule)
        style, fraction = case["rotary"]
        half = int(d * fraction) // 16 * 8  # rotary_dim a multiple of 16
        t["rotary_cos"], t["rotary_sin"] = (torch.randn(capacity, half, generator=g).to(dev, dt) for _ in range(2))
    index = dict(cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=dev),
                 block_table=None if block_table is None else block_table.to(dev),
                 cache_batch_idx=None if batch_idx is None else batch_idx.to(dev),
                 cache_leftpad=None if leftpad is None else leftpad.to(dev))
    return t, index, seqlens


def _variant_kw(spec: dict, b: int, hq: int, dev: str, g) -> dict:
    kw = {k: v for k, v in spec.items() if k != "alibi"}
    if spec.get("alibi"):  # flash-attn's tests draw slopes as rand * 0.3
        kw["alibi_slopes"] = (torch.rand(b, hq, generator=g) * 0.3).to(dev)
    return kw


def _reference(t: dict, index: dict, seqlens: list[int], kw: dict, interleaved: bool):
    """(k_cache, v_cache after the reference append, fp32 reference out/lse, out in the input dtype)."""
    cpu = {k: v.cpu() for k, v in t.items()}
    idx = {k: (v.cpu() if v is not None else None) for k, v in index.items()}
    q, k_cache, v_cache = cpu["q"], cpu["k_cache"].clone(), cpu["v_cache"].clone()
    leftpad = idx["cache_leftpad"].tolist() if idx["cache_leftpad"] is not None else [0] * len(seqlens)
    k = cpu.get("k")
    if "rotary_cos" in cpu:  # with an append only (flash-attn's rule); positions are cache rows, leftpad or not
        local = kw.get("window_size", (-1, -1)) != (-1, -1) or kw.get("attention_chunk", 0) > 0
        moving = kw.get("causal", False) or local
        start = seqlens
        pos_q = [[s + (i if moving else 0) for i in range(q.shape[1])] for s in start]
        q = rotary(q, cpu["rotary_cos"], cpu["rotary_sin"], pos_q, interleaved)
        k = rotary(k, cpu["rotary_cos"], cpu["rotary_sin"], [[s + i for i in range(k.shape[1])] for s in start],
                   interleaved)
    new = 0
    if k is not None:
        new = k.shape[1]
        append_ref(k_cache, k, seqlens, idx["block_table"], idx["cache_batch_idx"])
        append_ref(v_cache, cpu["v"], seqlens, idx["block_table"], idx["cache_batch_idx"])
    used = [s + new for s in seqlens]
    args = dict(cache_leftpad=leftpad if idx["cache_leftpad"] is not None else None, block_table=idx["block_table"],
                cache_batch_idx=idx["cache_batch_idx"], causal=kw.get("causal", False),
                window=tuple(kw.get("window_size", (-1, -1))), softcap=kw.get("softcap", 0.0),
                alibi_slopes=kw["alibi_slopes"].cpu() if "alibi_slopes" in kw else None,
                attention_chunk=kw.get("attention_chunk", 0))
    ref_out, ref_lse = attention_kvcache_ref(q.float(), k_cache.float(), v_cache.float(), used, **args)
    torch_out, _ = attention_kvcache_ref(q, k_cache, v_cache, used, upcast=False, **args)
    return k_cache, v_cache, ref_out, ref_lse, torch_out


def _split_agrees(t: dict, index: dict, used: torch.Tensor, kw: dict, dt) -> None:
    """The kernel unsplit and split three ways over the cache as it now is. The LSE agrees within
    fp32 rounding. O differs by more: each split rounds its probabilities P to the input dtype
    relative to its own running max, so the two runs round P differently (flash-attn's split-KV
    does the same); the difference is bounded by that rounding, eps * max |v|, plus the output's
    own rounding. (test_splits_agree_within_fp32_rounding removes the P rounding and holds O to fp32.)"""
    launch = dict(cache_batch_idx=index["cache_batch_idx"], cache_leftpad=index["cache_leftpad"],
                  block_table=index["block_table"], causal=kw.get("causal", False),
                  window=tuple(kw.get("window_size", (-1, -1))), softcap=kw.get("softcap", 0.0),
                  alibi_slopes=kw.get("alibi_slopes"), attention_chunk=kw.get("attention_chunk", 0))
    q = t["q"]  # rotary left out here: both runs see the same queries either way
    one, lse_one = flash_decode(q, t["k_cache"], t["v_cache"], used, num_splits=1, **launch)
    three, lse_three = flash_decode(q, t["k_cache"], t["v_cache"], used, num_splits=3, **launch)
    finite = torch.isfinite(lse_one)
    assert torch.equal(finite, torch.isfinite(lse_three)) and torch.equal(lse_one[~finite], lse_three[~finite])
    assert torch.allclose(lse_one[finite], lse_three[finite], rtol=1e-5, atol=1e-5), \
        f"lse split vs unsplit: {(lse_one - lse_three)[finite].abs().max():.3e}"
    diff = (one.float() - three.float()).abs()
    eps = torch.finfo(dt).eps
    bound = eps * (t["v_cache"].float().abs().max() + one.float().abs())
    assert bool((diff <= bound).all()), f"out split vs unsplit: {diff.max():.3e}"


@pytest.mark.sweep
@pytest.mark.parametrize("draw", range(30))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kvcache_meets_flashattention_rule(target, variant, dtype, d, draw):
    _meets_flashattention_rule(target, variant, dtype, d, draw)


@pytest.mark.sweep
@pytest.mark.parametrize("draw", range(12))
@pytest.mark.parametrize("d", [(192, 128), (64, 256), (64, 512)], ids=lambda p: f"d{p[0]}-dv{p[1]}")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kvcache_head_dim_v_meets_flashattention_rule(target, variant, d, draw):
    """FlashAttention-3's KV-cache test's V head dims (its d = 192 with dv = 128, d = 64 with 256 and
    512): v_cache and v of their own width, over the same layouts, appends, rotary and splits."""
    _meets_flashattention_rule(target, variant, "bf16", d[0], draw, d[1])


def _meets_flashattention_rule(target, variant, dtype, d, draw, dv=None):
    case = _case(draw)
    dev, dt = device(target), TORCH_DTYPES[dtype]
    g = torch.Generator().manual_seed(hash((variant, dtype, d, dv, draw)) % 2**31)
    t, index, seqlens = _inputs(case, d, dt, dev, g, dv)
    kw = _variant_kw(VARIANTS[variant], t["q"].shape[0], t["q"].shape[2], dev, g)
    interleaved = bool(case["rotary"]) and case["rotary"][0] == "interleaved"
    k_ref, v_ref, ref_out, ref_lse, torch_out = _reference(t, index, seqlens, kw, interleaved)
    before = (t["k_cache"].clone(), t["v_cache"].clone())

    with recording() as ran:
        out, lse = flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"], t.get("k"), t.get("v"),
                                           t.get("rotary_cos"), t.get("rotary_sin"), rotary_interleaved=interleaved,
                                           num_splits=case["splits"], return_softmax_lse=True, **index, **kw)
    what = f"{case['layout']} {case['heads']} pair {case['pair']} seqlens {seqlens} rotary {case['rotary']}"
    _check_family(target, case["layout"], ran)
    assert torch.equal(t["k_cache"].cpu(), k_ref) and torch.equal(t["v_cache"].cpu(), v_ref), f"cache ({what})"
    if "k" not in t:
        assert torch.equal(t["k_cache"], before[0]) and torch.equal(t["v_cache"], before[1])
    ok, err, bound = within_tolerance(out.cpu().transpose(1, 2), ref_out.transpose(1, 2),
                                      torch_out.transpose(1, 2), softcap=kw.get("softcap", 0.0))
    assert ok, f"out: err {err:.3e} > bound {bound:.3e} ({what})"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite), f"rows that see no key ({what})"
    assert (lse.cpu()[finite] - ref_lse[finite]).abs().max().item() <= 1e-3 if finite.any() else True
    assert not out.cpu()[~finite.transpose(1, 2)].any(), f"rows that see no key must be 0 ({what})"
    used = index["cache_seqlens"] + (t["k"].shape[1] if "k" in t else 0)
    _split_agrees(t, index, used.to(torch.int32), kw, dt)


def _check_family(target: str, layout: str, ran) -> None:
    """On the emulated H100 the KV-cache kernel is the sm90 family's, TMA tiles or (pages not of whole key
    tiles, left padding beside pages) rows gathered by the producer warpgroup."""
    if target != "emulated" or EMULATED_GPU != "h100":
        return
    gathered = layout in ("paged-1", "paged-5+batch_idx", "paged-16+leftpad")
    assert {(c.family, c.gather) for c in ran if c.kvcache} == {("sm90", gathered)}, [c.name for c in ran]


def _packed_case(draw: int, variant: str, d: int, dev: str, dt):
    """FlashAttention-3's varlen KV-cache call (its test_flash_attn_kvcache with varlen_q): queries
    and new keys packed by cu_seqlens_q / cu_seqlens_k_new, each sequence its own lengths (0 among
    them), over one draw's layout, heads, rotary and splits."""
    case = _case(draw)
    rng, (hq, hkv) = case["rng"], HEADS[case["heads"]]
    g = torch.Generator().manual_seed(1000 + draw)
    b, capacity = 3, 150
    lens_q = [rng.randint(1, 40) for _ in range(b)]
    lens_q[rng.randrange(b)] = rng.choice((0, 1))
    lens_new = [rng.randint(0, 9) for _ in range(b)] if case["new_kv"] else [0] * b
    seqlens = [rng.randint(0, capacity - max(n, q)) for n, q in zip(lens_new, lens_q)]  # rotary rows within cos
    t, index, _ = _inputs(dict(case, pair=(1, capacity), new_kv=False), d, dt, dev, g)
    t["q"] = torch.randn(sum(lens_q), hq, d, generator=g).to(dev, dt)
    if case["new_kv"]:
        t["k"], t["v"] = (torch.randn(sum(lens_new), hkv, d, generator=g).to(dev, dt) for _ in range(2))
        if case["rotary"]:
            style, fraction = case["rotary"]
            cap = t["k_cache"].shape[1] * (index["block_table"].shape[1] if index["block_table"] is not None else 1)
            half = int(d * fraction) // 16 * 8
            t["rotary_cos"], t["rotary_sin"] = (torch.randn(cap, half, generator=g).to(dev, dt) for _ in range(2))
    if index["cache_leftpad"] is not None:
        index["cache_leftpad"] = torch.tensor([rng.randint(0, s) for s in seqlens], dtype=torch.int32, device=dev)
    index["cache_seqlens"] = torch.tensor(seqlens, dtype=torch.int32, device=dev)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)  # noqa
    packed = dict(cu_seqlens_q=cu(lens_q), max_seqlen_q=max(lens_q) or 1,
                  cu_seqlens_k_new=cu(lens_new) if case["new_kv"] else None)
    kw = _variant_kw(VARIANTS[variant], b, hq, dev, g)
    return case, t, index, packed, kw, seqlens, lens_q, lens_new


@pytest.mark.parametrize("gpu", ["a100", "h100"])
def test_packed_queries_with_seqused_q(gpu):
    """seqused_q with the KV cache's packed queries (FlashAttention-3's varlen semantics, as its
    flash_attn_varlen_func takes them): only the first seqused_q[b] rows of each span are queries,
    aligned bottom-right as such, the rest out 0 and lse +inf; split and unsplit, on both families."""
    import autoflash

    g = torch.Generator().manual_seed(21)
    used_q, lens_k = [2, 9, 0], [40, 70, 33]
    cu_q = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    q = torch.randn(17, 4, 64, generator=g).bfloat16()
    k_cache, v_cache = (torch.randn(3, 80, 2, 64, generator=g).bfloat16() for _ in range(2))
    seqlens, used = torch.tensor(lens_k, dtype=torch.int32), torch.tensor(used_q, dtype=torch.int32)
    ref, ref_lse = attention_kvcache_ref(q, k_cache, v_cache, lens_k, causal=True, cu_seqlens_q=cu_q.tolist(),
                                         seqused_q=used_q)
    same, _ = attention_kvcache_ref(q, k_cache, v_cache, lens_k, causal=True, cu_seqlens_q=cu_q.tolist(),
                                    seqused_q=used_q, upcast=False)
    unused = torch.tensor([r >= cu_q[b] + used_q[b] for b in range(3) for r in range(cu_q[b], cu_q[b + 1])])
    for splits in (1, 3):
        with autoflash.emulate(gpu):
            out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                               cu_seqlens_q=cu_q, max_seqlen_q=9, seqused_q=used,
                                               num_splits=splits, return_softmax_lse=True)
        ok, err, bound = within_tolerance(out, ref, same)
        assert ok, f"{gpu}, {splits} splits: err {err:.3e} > bound {bound:.3e}"
        assert torch.equal(out[unused], torch.zeros_like(out[unused]))
        assert torch.isinf(lse[:, unused]).all() and torch.isinf(ref_lse[:, unused]).all()
        assert torch.allclose(lse[:, ~unused], ref_lse[:, ~unused], atol=1e-3)
    with pytest.raises(ValueError, match="seqused_q"):
        flash_attn_with_kvcache(q[:3].reshape(3, 1, 4, 64), k_cache, v_cache, cache_seqlens=seqlens, seqused_q=used)


@pytest.mark.sweep
@pytest.mark.parametrize("draw", range(12))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_packed_queries_and_new_keys_meet_flashattention_rule(target, variant, draw):
    """Each packed sequence against the dense reference of that sequence alone (batch 1, its own
    cache row or pages): the same out and LSE rows, and the cache after the call bit-equal."""
    dev, dt, d = device(target), TORCH_DTYPES["bf16" if draw % 2 else "fp16"], 64 if draw % 3 else 128
    case, t, index, packed, kw, seqlens, lens_q, lens_new = _packed_case(draw, variant, d, dev, dt)
    interleaved = bool(case["rotary"]) and case["rotary"][0] == "interleaved"
    k_cache, v_cache = t["k_cache"].cpu(), t["v_cache"].cpu()
    outs, lses, torch_outs = [], [], []
    q_at, new_at = 0, 0
    for b in range(len(seqlens)):  # sequence by sequence, each a dense batch of one
        one = {"q": t["q"][q_at:q_at + lens_q[b]].unsqueeze(0), "k_cache": k_cache, "v_cache": v_cache}
        if "k" in t:
            one["k"], one["v"] = (t[n][new_at:new_at + lens_new[b]].unsqueeze(0) for n in ("k", "v"))
            one.update({n: t[n] for n in ("rotary_cos", "rotary_sin") if n in t})
        row = index["cache_batch_idx"][b:b + 1] if index["cache_batch_idx"] is not None else torch.tensor([b])
        idx = dict(cache_seqlens=None, block_table=None, cache_batch_idx=None, cache_leftpad=None)
        if index["block_table"] is not None:  # the block-table row the sequence's cache_batch_idx picks
            idx["block_table"] = index["block_table"][row.long()]
        else:
            idx["cache_batch_idx"] = row.to(torch.int32)
        if index["cache_leftpad"] is not None:
            idx["cache_leftpad"] = index["cache_leftpad"][b:b + 1]
        one_kw = dict(kw, alibi_slopes=kw["alibi_slopes"][b:b + 1]) if "alibi_slopes" in kw else kw
        k_cache, v_cache, ref_out, ref_lse, torch_out = _reference(one, idx, [seqlens[b]], one_kw, interleaved)
        outs.append(ref_out[0]), lses.append(ref_lse[0]), torch_outs.append(torch_out[0])
        q_at, new_at = q_at + lens_q[b], new_at + lens_new[b]
    ref_out, ref_lse, torch_out = torch.cat(outs), torch.cat(lses, dim=1), torch.cat(torch_outs)

    with recording() as ran:
        out, lse = flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"], t.get("k"), t.get("v"),
                                           t.get("rotary_cos"), t.get("rotary_sin"), rotary_interleaved=interleaved,
                                           num_splits=case["splits"], return_softmax_lse=True, **index, **kw, **packed)
    what = f"{case['layout']} {case['heads']} q {lens_q} new {lens_new} seqlens {seqlens} rotary {case['rotary']}"
    _check_family(target, case["layout"], ran)
    assert out.shape == t["q"].shape and lse.shape == (t["q"].shape[1], t["q"].shape[0])
    assert torch.equal(t["k_cache"].cpu(), k_cache) and torch.equal(t["v_cache"].cpu(), v_cache), f"cache ({what})"
    ok, err, bound = within_tolerance(out.cpu()[None].transpose(1, 2), ref_out[None].transpose(1, 2),
                                      torch_out[None].transpose(1, 2), softcap=kw.get("softcap", 0.0))
    assert ok, f"out: err {err:.3e} > bound {bound:.3e} ({what})"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite), f"rows that see no key ({what})"
    assert (lse.cpu()[finite] - ref_lse[finite]).abs().max().item() <= 1e-3 if finite.any() else True


@pytest.mark.parametrize("page, kw", [(16, dict(causal=True)), (5, dict(window_size=(9, 3))), (32, dict())])
def test_paged_prefill_matches_the_unpaged_call(target, page, kw):
    """flash-attn's flash_attn_varlen_func with a block_table (a paged prefill: FA2's
    test_flash_attn_varlen_causal): the same out and LSE as the call on the keys laid out packed, up
    to the fp32 summation order of different key tiles; forward only."""
    from autoflash import flash_attn_varlen_func

    dev, dt = device(target), torch.bfloat16
    g = torch.Generator().manual_seed(page)
    lens_q, lens_k, hq, hkv, d = [7, 0, 19], [30, 11, 45], 6, 2, 64
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    q = torch.randn(sum(lens_q), hq, d, generator=g).to(dt)
    k, v = (torch.randn(sum(lens_k), hkv, d, generator=g).to(dt) for _ in range(2))
    per_seq = -(-max(lens_k) // page)
    table = torch.randperm(3 * per_seq + 1, generator=g)[:3 * per_seq].reshape(3, per_seq).to(torch.int32)
    k_pages, v_pages = (torch.randn(3 * per_seq + 1, page, hkv, d, generator=g).to(dt) for _ in range(2))
    for b, (start, n) in enumerate(zip(cu(lens_k)[:-1].tolist(), lens_k)):  # sequence b's keys into its pages
        for j in range(n):
            k_pages[table[b, j // page], j % page] = k[start + j]
            v_pages[table[b, j // page], j % page] = v[start + j]
    args = (cu(lens_q).to(dev), cu(lens_k).to(dev), max(lens_q), max(lens_k))
    want, want_lse, _ = flash_attn_varlen_func(q.to(dev), k.to(dev), v.to(dev), *args, return_attn_probs=True, **kw)
    q_grad = q.to(dev).requires_grad_()
    out, lse, _ = flash_attn_varlen_func(q_grad, k_pages.to(dev), v_pages.to(dev), *args, return_attn_probs=True,
                                         block_table=table.to(dev), **kw)
    assert out.shape == q.shape and lse.shape == (hq, sum(lens_q))
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse[finite], want_lse[finite], rtol=1e-5, atol=1e-5)
    assert (out.float() - want.float()).abs().max().item() <= 2 * torch.finfo(dt).eps * want.float().abs().max()
    with pytest.raises(RuntimeError, match="flash_attn_varlen_func with a block_table is forward only"):
        out.float().sum().backward()


def test_int_cache_seqlens_and_no_new_keys(target):
    """An int cache_seqlens is every sequence's length; without k, v the cache is only read."""
    dev = device(target)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 4, 64, generator=g).to(dev, torch.bfloat16)
    k_cache, v_cache = (torch.randn(2, 90, 2, 64, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=57)
    ref, _ = attention_kvcache_ref(q.cpu().float(), k_cache.cpu().float(), v_cache.cpu().float(), [57, 57])
    low, _ = attention_kvcache_ref(q.cpu(), k_cache.cpu(), v_cache.cpu(), [57, 57], upcast=False)
    ok, err, bound = within_tolerance(out.cpu(), ref, low)
    assert ok, f"out: err {err:.3e} > bound {bound:.3e}"


def test_a_split_that_sees_no_key_leaves_the_others_exact(target):
    """Window (3, 0) over a long cache: most splits hold no visible key (LSE -inf in the partials);
    the combine gives the unsplit result."""
    dev = device(target)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 2, 64, generator=g).to(dev, torch.float16)
    k_cache, v_cache = (torch.randn(1, 400, 2, 64, generator=g).to(dev, torch.float16) for _ in range(2))
    kw = dict(window=(3, 0), causal=True)
    one, lse_one = flash_decode(q, k_cache, v_cache, 333, num_splits=1, **kw)
    many, lse_many = flash_decode(q, k_cache, v_cache, 333, num_splits=7, **kw)
    assert torch.allclose(lse_one, lse_many, rtol=1e-5, atol=1e-5)
    assert (one.float() - many.float()).abs().max().item() <= torch.finfo(torch.float16).eps * 2


@pytest.mark.parametrize("splits", [1, 4])
def test_empty_caches_give_zero_rows(target, splits):
    dev = device(target)
    q = torch.randn(2, 3, 4, 32).to(dev, torch.bfloat16)
    k_cache = torch.randn(2, 64, 2, 32).to(dev, torch.bfloat16)
    out, lse = flash_decode(q, k_cache, k_cache.clone(), 0, num_splits=splits, causal=True)
    assert not out.any() and bool(torch.isinf(lse).all()) and bool((lse > 0).all())


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_splits_agree_within_fp32_rounding(target, dtype):
    """Every key tile holds a copy of the key that scores highest, so every split's running max is
    the row's max from its first tile on and both runs round the same P: split and unsplit then
    differ only by fp32 summation order and the combine's arithmetic, one output rounding at most."""
    dev, dt = device(target), TORCH_DTYPES[dtype]
    g = torch.Generator().manual_seed(11)
    b, h, d, length = 2, 3, 64, 300
    q = torch.randn(b, 1, h, d, generator=g)
    k_cache = torch.randn(b, length, h, d, generator=g) * 0.1
    top = 3 * q[:, 0] / q[:, 0].norm(dim=-1, keepdim=True)  # (b, h, d)
    for j in range(0, length, 16):  # every tile of every key-tile width the kernels take
        k_cache[:, j] = top
    v_cache = torch.randn(b, length, h, d, generator=g)
    q, k_cache, v_cache = (x.to(dev, dt) for x in (q, k_cache, v_cache))
    one, lse_one = flash_decode(q, k_cache, v_cache, length, num_splits=1)
    for splits in (2, 3):
        many, lse_many = flash_decode(q, k_cache, v_cache, length, num_splits=splits)
        assert torch.allclose(lse_one, lse_many, rtol=1e-6, atol=1e-6)
        diff = (one.float() - many.float()).abs()
        assert bool((diff <= torch.finfo(dt).eps * one.float().abs() + 1e-6).all()), f"{splits} splits: {diff.max():.3e}"


def _op_inputs(g):
    q = torch.randn(2, 2, 4, 32, generator=g).to(torch.bfloat16)
    k_cache, v_cache = (torch.randn(2, 40, 2, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 2, 2, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    cos, sin = (torch.randn(40, 8, generator=g).to(torch.bfloat16) for _ in range(2))
    return q, k_cache, v_cache, k, v, cos, sin, torch.tensor([3, 17], dtype=torch.int32)


def test_the_op_passes_opcheck():
    """autoflash::flash_kvcache (CPU reference path): schema with its mutated caches, fake tensors."""
    q, k_cache, v_cache, k, v, cos, sin, seqlens = _op_inputs(torch.Generator().manual_seed(1))
    torch.library.opcheck(torch.ops.autoflash.flash_kvcache.default,
                          (q, k_cache, v_cache, k, v, cos, sin, None, seqlens, 0, None, None, None, None, None, None,
                           None, None, None, True, -1, -1, 0, 0.0, True, 0))


def test_torch_compile_fullgraph_matches_eager():
    """One graph (no break), the same output and the same cache contents as the eager call."""
    def step(q, k_cache, v_cache, k, v, cos, sin, seqlens):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, seqlens, causal=True,
                                       return_softmax_lse=True)

    eager_in = _op_inputs(torch.Generator().manual_seed(2))
    compiled_in = [t.clone() for t in eager_in]
    out, lse = step(*eager_in)
    torch._dynamo.reset()
    out_c, lse_c = torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled_in)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    assert torch.equal(eager_in[1], compiled_in[1]) and torch.equal(eager_in[2], compiled_in[2])
    assert not torch.equal(eager_in[1], _op_inputs(torch.Generator().manual_seed(2))[1])  # it did append


@pytest.mark.parametrize("blocks, sms, tiles", [(8, 108, 64), (1, 132, 1024), (32, 132, 16), (4, 170, 3),
                                                (200, 108, 64), (64, 108, 7)])
def test_num_splits_heuristic_follows_flash_attention(blocks, sms, tiles):
    """FlashAttention-2's rule: no split once the blocks fill 80% of 2 x SMs; else the fewest splits
    whose wave efficiency is within 85% of the best, among split counts that change tiles per split."""
    import math

    from autoflash.kernels.decode import choose_num_splits

    s = choose_num_splits(blocks, sms, tiles)
    slots = 2 * sms
    if blocks >= 0.8 * slots or tiles == 1:
        assert s == 1
        return
    cap = min(128, slots, tiles)
    eligible = [n for n in range(1, cap + 1) if n == 1 or math.ceil(tiles / n) != math.ceil(tiles / (n - 1))]
    eff = {n: blocks * n / slots / math.ceil(blocks * n / slots) for n in eligible}
    best = max(eff.values())
    assert 1 <= s <= cap and s in eligible
    assert eff[s] >= 0.85 * best and all(eff[n] < 0.85 * best for n in eligible if n < s)


@pytest.mark.parametrize("lq", [1, 4])
def test_a_key_bias_masks_keys_on_the_cache_path(target, lq):
    """autoflash.hf's decode step: a padding mask as an fp32 key bias (-inf) over keys already in a
    cache, GQA heads folded, within the rule against the reference with the same bias."""
    from autoflash.dispatch.kvcache import attention_over_cache

    dev = device(target)
    g = torch.Generator().manual_seed(9)
    b, hq, hkv, d, length = 2, 4, 2, 64, 150
    q = torch.randn(b, lq, hq, d, generator=g).to(dev, torch.bfloat16)
    k_cache, v_cache = (torch.randn(b, length + 10, hkv, d, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    bias = torch.zeros(b, length + 10)  # one entry per cache row; rows past `length` are never read
    bias[1, :37] = float("-inf")  # left padding
    bias[0, 90:95] = float("-inf")  # and a hole
    out = attention_over_cache(q, k_cache, v_cache, length, key_bias=bias.to(dev), causal=True, window=(-1, -1),
                               softcap=0.0, scale=None)
    args = dict(causal=True, key_bias=bias)
    ref, _ = attention_kvcache_ref(q.cpu().float(), k_cache.cpu().float(), v_cache.cpu().float(), [length] * b, **args)
    low, _ = attention_kvcache_ref(q.cpu(), k_cache.cpu(), v_cache.cpu(), [length] * b, upcast=False, **args)
    ok, err, bound = within_tolerance(out.cpu(), ref, low)
    assert ok, f"out: err {err:.3e} > bound {bound:.3e}"
    unmasked, _ = attention_kvcache_ref(q.cpu().float(), k_cache.cpu().float(), v_cache.cpu().float(), [length] * b,
                                        causal=True)
    assert (unmasked - ref).abs().max() > 10 * bound  # the bias mattered


@pytest.mark.parametrize("d, paged", [(59, False), (111, True), (20, False)])
def test_head_dims_off_the_grid_run_zero_padded(target, d, paged):
    """Head dims flash-attn accepts and the kernels have no tiles for run zero-padded: the result is
    the padded call's, bit for bit, cut back; the appended rows land in the caller's caches, which
    keep their head dim; and the output is within FlashAttention's rule of the reference."""
    dev = device(target)
    g = torch.Generator().manual_seed(d)
    width = max(32, -(-d // 8) * 8)
    q = torch.randn(2, 2, 4, d, generator=g).to(dev, torch.bfloat16)
    k, v = (torch.randn(2, 2, 2, d, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    shape = (8, 16, 2, d) if paged else (2, 64, 2, d)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    index = dict(cache_seqlens=torch.tensor([5, 30], dtype=torch.int32, device=dev))
    if paged:
        index["block_table"] = torch.tensor([[3, 0, 5, 1], [7, 2, 6, 4]], dtype=torch.int32, device=dev)

    def pad(t):
        return torch.nn.functional.pad(t, (0, width - d))

    kp, vp = pad(k_cache), pad(v_cache)
    want, want_lse = flash_attn_with_kvcache(pad(q), kp, vp, pad(k), pad(v), causal=True, softmax_scale=d ** -0.5,
                                             return_softmax_lse=True, **index)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, causal=True, return_softmax_lse=True, **index)
    assert out.shape == q.shape and k_cache.shape == shape
    assert torch.equal(out, want[..., :d]) and torch.equal(lse, want_lse)
    assert torch.equal(k_cache, kp[..., :d]) and torch.equal(v_cache, vp[..., :d])
    seqused = [7, 32]
    cpu = dict(block_table=index["block_table"].cpu()) if paged else {}
    ref, _ = attention_kvcache_ref(q.cpu().float(), k_cache.cpu().float(), v_cache.cpu().float(), seqused, causal=True,
                                   **cpu)
    low, _ = attention_kvcache_ref(q.cpu(), k_cache.cpu(), v_cache.cpu(), seqused, causal=True, upcast=False, **cpu)
    ok, err, bound = within_tolerance(out.cpu(), ref, low)
    assert ok, f"out: err {err:.3e} > bound {bound:.3e}"
