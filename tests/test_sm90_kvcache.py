"""flash_attn_with_kvcache on an emulated H100: the sm90 family's KV-cache kernel (the kvcache, paged,
gather and split switches of templates/flash_fwd_sm90.cu.j2: K and V tiles by TMA from a dense cache or
from pages of whole key tiles, or gathered row by row by the producer warpgroup's cp.async from pages of
any size; query heads folded into the rows, split-KV merged by the combine kernel). The
accuracy sweeps are test_kvcache.py's, whose emulated GPU is the H100 (each case there also checks the
family it ran); here: which calls run on it, the cache rows past a sequence (never written: NaN is
possible) kept out of O, the tiles the defaults take, and the sanitizer on the kernel's own ordering."""
import math

import pytest
import torch

import autoflash
from autoflash import emulation
from autoflash.kernels import launch
from autoflash.kernels.decode import choose_num_splits, decode_launch
from autoflash.kernels.defaults import default_decode_config
from autoflash.kernels.gpus import get_profile
from autoflash.kernels.variants import resolve
from autoflash.reference.kvcache import attention_kvcache_ref
from autoflash.selfcheck import main as selfcheck

H100 = get_profile("h100")


def _call(layout: str, d: int = 64, dv: int | None = None, seqlens=(150, 0, 61), capacity: int = 200,
          poison: bool = False, **kw):
    """One decode step of 3 sequences (GQA 6 / 2, 2 queries each) over a cache laid out as `layout`
    ("dense", "batch_idx", "leftpad", "packed", "paged-P", "paged-P+leftpad"), emulated on the H100:
    (the configs it ran, out, lse, the fp32 reference's out, lse). `poison`: the cache rows past each
    sequence hold NaN, as rows never written may."""
    g = torch.Generator().manual_seed(7)
    dv = dv or d
    b, hq, hkv, lq = 3, 6, 2, 2
    q = torch.randn(b, lq, hq, d, generator=g).bfloat16()
    index, ref_kw = {}, {}
    if layout.startswith("paged"):
        page = int(layout.split("+")[0].split("-")[1])
        per_seq = -(-capacity // page)
        k_cache, v_cache = (torch.randn(b * per_seq, page, hkv, w, generator=g).bfloat16() for w in (d, dv))
        table = torch.randperm(b * per_seq, generator=g).reshape(b, per_seq).to(torch.int32)
        index["block_table"] = ref_kw["block_table"] = table
    else:
        rows = b + 2 if layout == "batch_idx" else b
        k_cache, v_cache = (torch.randn(rows, capacity, hkv, w, generator=g).bfloat16() for w in (d, dv))
        if layout == "batch_idx":
            index["cache_batch_idx"] = ref_kw["cache_batch_idx"] = torch.tensor([4, 0, 2], dtype=torch.int32)
    if "leftpad" in layout:
        index["cache_leftpad"] = torch.tensor([5, 0, 17], dtype=torch.int32)
        ref_kw["cache_leftpad"] = [5, 0, 17]
    if poison:
        for cache in (k_cache, v_cache):
            _poison(cache, seqlens, index)
    if layout == "packed":  # FlashAttention-3's varlen queries: 2, 1 and 3 of them
        lens = (2, 1, 3)
        q = torch.randn(sum(lens), hq, d, generator=g).bfloat16()
        cu = torch.tensor([0, 2, 3, 6], dtype=torch.int32)
        index.update(cu_seqlens_q=cu, max_seqlen_q=3)
        ref_kw["cu_seqlens_q"] = cu.tolist()
    with autoflash.emulate("h100"), launch.recording() as ran:
        out, lse = autoflash.flash_attn_with_kvcache(q, k_cache, v_cache,
                                                     cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
                                                     return_softmax_lse=True, **index, **kw)
    ref_kw.update({k: v for k, v in kw.items() if k not in ("num_splits", "window_size")},
                  window=kw.get("window_size", (-1, -1)))
    ref_out, ref_lse = attention_kvcache_ref(q.float(), k_cache.float().nan_to_num(), v_cache.float().nan_to_num(),
                                             list(seqlens), **ref_kw)
    return ran, out, lse, ref_out, ref_lse


def _poison(cache: torch.Tensor, seqlens, index: dict) -> None:
    """NaN in every cache row no sequence holds (dense rows past cache_seqlens, unused page rows)."""
    used = torch.zeros(cache.shape[:2], dtype=torch.bool)
    for b, n in enumerate(seqlens):
        if "block_table" in index:
            page = cache.shape[1]
            for j in range(n):
                used[index["block_table"][b, j // page], j % page] = True
        else:
            row = index["cache_batch_idx"][b] if "cache_batch_idx" in index else b
            used[row, :n] = True
    cache[~used] = float("nan")


def _check(out, lse, ref_out, ref_lse) -> None:
    """Within FlashAttention's rule at these sizes (bf16 out, fp32 LSE), empty sequences 0 and +inf."""
    assert not out.isnan().any()
    assert (out.float() - ref_out).abs().max() <= 0.03
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite] - ref_lse[finite]).abs().max() <= 1e-3


@pytest.mark.parametrize("layout, kw", [
    ("dense", {}), ("batch_idx", dict(causal=True)), ("leftpad", dict(window_size=(40, 0))),
    ("packed", dict(causal=True)), ("paged-128", dict(softcap=5.0)), ("paged-16", dict(num_splits=3)),
    ("dense", dict(num_splits=4, causal=True)),
])
def test_the_h100_runs_the_cache_on_the_sm90_family(layout, kw):
    kw = {"num_splits": 1, **kw}
    ran, out, lse, ref_out, ref_lse = _call(layout, **kw)
    assert [c.family for c in ran] == ["sm90"] and all(c.kvcache for c in ran), [c.name for c in ran]
    assert ran[0].paged == layout.startswith("paged") and ran[0].split == (kw["num_splits"] > 1)
    _check(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("layout, kw", [
    ("paged-5", {}), ("paged-1", dict(num_splits=3, causal=True)), ("paged-16+leftpad", dict(softcap=5.0)),
    ("paged-4", dict(window_size=(30, 2)))])
def test_pages_of_any_size_are_gathered_on_the_sm90_family(layout, kw):
    """FA3's page sizes 1 and 4, and pages of 16 beside left padding (tiles straddling pages): the
    producer warpgroup gathers each key row from its page (FA3's PagedKVNonTMA)."""
    ran, out, lse, ref_out, ref_lse = _call(layout, poison=True, **kw)
    assert [c.family for c in ran if c.kvcache] == ["sm90"] and ran[0].gather, [c.name for c in ran]
    _check(out, lse, ref_out, ref_lse)
    q, cache = torch.randn(3, 2, 6, 64).bfloat16(), torch.randn(90, 5, 2, 64).bfloat16()
    with autoflash.emulate("h100"):
        text = str(autoflash.explain(autoflash.flash_attn_with_kvcache, q, cache, cache,
                                     cache_seqlens=torch.tensor([9, 0, 3], dtype=torch.int32),
                                     block_table=torch.arange(90, dtype=torch.int32).reshape(3, 30)))
    assert "family: sm90" in text and "_gather" in text and "family sm80" not in text, text


# A page one past the block table's entry: every read stays inside the cache, so only the sanitizer's rule
# of whose pages a block reads (the block table's row, as far as its sequence's length reaches) sees it.
@pytest.mark.parametrize("paged, old, new", [
    ("128", "kv_batch = PAGED ? pages[n0 / page_size] : k_batch",
     "kv_batch = PAGED ? pages[n0 / page_size] + 1 : k_batch"),
    ("5", "pages[pos / page_size] * page_stride", "(pages[pos / page_size] + 1) * page_stride")],
    ids=["tma", "gather"])
def test_a_page_the_block_table_does_not_name_is_out_of_bounds(mutate, capsys, paged, old, new):
    mutate("fwd", old, new)
    emulation.clear_findings()
    status = selfcheck(["--emulate", "h100", "--sanitize", "--kvcache", "--shape", "3,6,2,4,300,64", "--paged", paged])
    out = capsys.readouterr().out
    pages = [f for f in emulation.findings() if f.kind == "out-of-bounds" and "block_table names" in f.detail]
    assert status == 1 and pages and all("flash_fwd_sm90.cu.j2" in f.location for f in pages), out


@pytest.mark.parametrize("layout, kw", [("dense", {}), ("batch_idx", dict(num_splits=2)), ("paged-64", {}),
                                        ("leftpad", dict(causal=True))])
def test_cache_rows_never_written_stay_out_of_the_output(layout, kw):
    """The last key tile's TMA box reads rows past the sequence; NaN there would meet P's zeros in P V
    (0 x NaN): the consumers zero them in V first. seqlens 150 and 61 end inside a tile."""
    ran, out, lse, ref_out, ref_lse = _call(layout, poison=True, **kw)
    assert ran[0].family == "sm90"
    _check(out, lse, ref_out, ref_lse)


def test_without_the_zeroing_unwritten_rows_reach_the_output(mutate):
    """The control: the same call with the consumers' zeroing of V's rows past the sequence taken out."""
    mutate("fwd", "      if (valid < BLOCK_N) {", "      if (false) {")
    _, out, *_ = _call("dense", poison=True)
    assert out.isnan().any()


def test_a_zeroed_row_read_without_the_proxy_fence_is_reported(mutate, capsys):
    """The zeros are generic-proxy stores that wgmma reads through the async proxy: without
    fence.proxy.async between them the sanitizer reports the read (the results stay right here)."""
    mutate("fwd", "        fence_proxy_async();  // generic stores, read by wgmma (async proxy)\n", "")
    emulation.clear_findings()
    status = selfcheck(["--emulate", "h100", "--sanitize", "--kvcache", "--shape", "2,4,2,1,200,64"])
    out = capsys.readouterr().out
    found = [f for f in emulation.findings() if "flash_fwd_sm90.cu.j2" in f.location]
    assert status == 1 and found, out


@pytest.mark.parametrize("d, dv, page, heavy, gather, keys", [
    (128, None, None, False, False, 176), (128, None, 256, False, False, 128), (128, None, 16, False, False, 16),
    (128, None, 48, False, False, 48), (128, None, None, True, False, 128), (64, None, None, False, False, 176),
    (256, None, None, False, False, 96), (256, None, None, True, False, 96), (256, None, None, True, True, 80),
    (64, 512, None, True, True, 96), (64, 512, None, False, False, 96), (192, 128, None, False, False, 160),
    (128, None, None, False, True, 176)])
def test_the_sm90_cache_tiles(d, dv, page, heavy, gather, keys):
    """64 query rows, the most keys whose S, P and O fit 200 registers (176 at most, 128 beside a
    variant, 80 above d = 192 beside a variant where rows are gathered), dividing the pages; the deepest
    pipeline that fits the H100's shared memory."""
    cfg = default_decode_config(d, "bf16", H100, page, heavy, gather, dv)
    assert (cfg.family, cfg.block_m, cfg.block_n, cfg.kvcache) == ("sm90", 64, keys, True)
    assert cfg.smem_bytes <= H100.smem_per_block_optin
    if cfg.num_stages < 4:
        assert cfg.replace(num_stages=cfg.num_stages + 1).smem_bytes > H100.smem_per_block_optin


def test_sm90_splits_count_one_block_an_sm():
    """The split heuristic's slots are the SMs for the sm90 family's blocks (one an SM, as FlashAttention-3
    counts them), two an SM for the sm80 family's (FlashAttention-2's)."""
    from autoflash.kernels.decode import CacheShape

    q = torch.empty(4, 1, 32, 128, dtype=torch.bfloat16)
    k = torch.empty(4, 8192, 8, 128, dtype=torch.bfloat16).transpose(1, 2)
    causal, variant = resolve(q.transpose(1, 2), k, False, align="bottom_right", cache_len=8192)
    shape = CacheShape(4, 1, 32, 8, 128, 8192, None, 0)
    config, splits = decode_launch(shape, "bf16", H100, causal, variant, None, 0, 4)
    tiles = math.ceil(8192 / config.block_n)
    assert config.family == "sm90"
    assert splits == choose_num_splits(4 * 8, H100.sm_count, tiles, per_sm=1) != \
        choose_num_splits(4 * 8, H100.sm_count, tiles, per_sm=2)



def test_a_signature_is_decided_once_and_its_switches_still_count():
    """decode_launch is cached per signature (sizes, switches, config, splits): a repeated call gets the
    very same decision, and a call that differs in a switch or a size its own."""
    from autoflash.kernels.decode import CacheShape

    q = torch.empty(2, 1, 32, 128, dtype=torch.bfloat16)
    k = torch.empty(2, 4096, 8, 128, dtype=torch.bfloat16).transpose(1, 2)
    shape = CacheShape(2, 1, 32, 8, 128, 4096, None, 0)
    plain = resolve(q.transpose(1, 2), k, False, align="bottom_right", cache_len=4096)
    capped = resolve(q.transpose(1, 2), k, False, align="bottom_right", cache_len=4096, softcap=30.0)
    first = decode_launch(shape, "bf16", H100, *plain, None, 0, 4)
    assert decode_launch(shape, "bf16", H100, *plain, None, 0, 4) is first
    assert decode_launch(shape, "bf16", H100, *capped, None, 0, 4)[0].softcap and not first[0].softcap
    longer = decode_launch(CacheShape(2, 1, 32, 8, 128, 65536, None, 0), "bf16", H100, *plain, None, 0, 4)
    assert longer[0] == first[0] and longer[1] != first[1]


@pytest.mark.parametrize("dv", [256, 512])
@pytest.mark.parametrize("layout, kw", [
    ("dense", dict(num_splits=1)), ("paged-64", dict(num_splits=3, causal=True)), ("paged-5", dict(softcap=4.0)),
    ("packed", dict(causal=True)), ("leftpad", dict(window_size=(50, 0)))])
def test_qv_in_the_cache_meets_the_rule(dv, layout, kw):
    """FlashAttention-3's qv in flash_attn_with_kvcache (DeepSeek's MLA decode: d = 64 of rope, V the
    latent of 256 or 512): scores q . k + qv . v on the sm90 kernel's qv switch, which reads each V
    tile once for both products, against the reference's one product of [q, qv] with [k, v]."""
    from autoflash.flash_attn_interface import flash_attn_with_kvcache

    g = torch.Generator().manual_seed(dv)
    b, hq, hkv, lq, capacity, seqlens = 3, 8, 1, 2, 200, [150, 0, 61]
    q = torch.randn(b, lq, hq, 64, generator=g).bfloat16()
    qv = torch.randn(b, lq, hq, dv, generator=g).bfloat16()
    index, ref_kw = {}, {}
    if layout.startswith("paged"):
        page = int(layout.split("-")[1])
        per_seq = -(-capacity // page)
        k_cache, v_cache = (torch.randn(b * per_seq, page, hkv, w, generator=g).bfloat16() for w in (64, dv))
        index["page_table"] = ref_kw["block_table"] = torch.randperm(b * per_seq, generator=g).reshape(
            b, per_seq).to(torch.int32)
    else:
        k_cache, v_cache = (torch.randn(b, capacity, hkv, w, generator=g).bfloat16() for w in (64, dv))
    if layout == "leftpad":
        index["cache_leftpad"] = torch.tensor([3, 0, 20], dtype=torch.int32)
        ref_kw["cache_leftpad"] = [3, 0, 20]
    if layout == "packed":  # 2, 1 and 3 queries
        q, qv = q.reshape(-1, hq, 64)[:6], qv.reshape(-1, hq, dv)[:6]
        cu = torch.tensor([0, 2, 3, 6], dtype=torch.int32)
        index.update(cu_seqlens_q=cu, max_seqlen_q=3)
        ref_kw["cu_seqlens_q"] = cu.tolist()
    with autoflash.emulate("h100"), launch.recording() as ran:
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, qv=qv, return_softmax_lse=True,
                                           cache_seqlens=torch.tensor(seqlens, dtype=torch.int32), **index, **kw)
    assert [(c.family, c.qv) for c in ran if c.kvcache] == [("sm90", True)], [c.name for c in ran]
    ref_kw.update(causal=kw.get("causal", False), softcap=kw.get("softcap", 0.0),
                  window=kw.get("window_size", (-1, -1)))
    ref_out, ref_lse = attention_kvcache_ref(q.float(), k_cache.float(), v_cache.float(), seqlens, qv=qv.float(),
                                             **ref_kw)
    torch_out, _ = attention_kvcache_ref(q, k_cache, v_cache, seqlens, qv=qv, upcast=False, **ref_kw)
    err, ref_err = (out.float() - ref_out).abs().max(), (torch_out.float() - ref_out).abs().max()
    assert err <= 2 * ref_err + 1e-3, f"{err:.3e} vs PyTorch's own {ref_err:.3e}"  # FlashAttention's rule
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and (lse[finite] - ref_lse[finite]).abs().max() <= 1e-3


def test_qv_in_the_cache_is_refused_off_the_sm90_family_before_the_append():
    from autoflash.flash_attn_interface import flash_attn_with_kvcache

    q, cache = torch.randn(2, 1, 4, 64).bfloat16(), torch.zeros(2, 16, 1, 64).bfloat16()
    new = torch.randn(2, 1, 1, 64).bfloat16()
    with autoflash.emulate("a100"), pytest.raises(ValueError, match="qv in the KV cache runs on the sm90 family"):
        flash_attn_with_kvcache(q, cache, cache, new, new, qv=q, cache_seqlens=3)
    assert not cache.any()


@pytest.mark.parametrize("schedule", ["default", "released-first", "random:3"])
@pytest.mark.parametrize("layout", ["dense", "paged-5"])
def test_the_qv_kernel_is_sanitizer_clean(schedule, layout):
    """The qv switch's new orders: S waits for V too, P V reads this block's columns of a V tile that
    S read whole, and (dense) the consumers zero the rows past the sequence after S has read them."""
    from autoflash.flash_attn_interface import flash_attn_with_kvcache

    g = torch.Generator().manual_seed(1)
    q, qv = torch.randn(2, 1, 8, 64, generator=g).bfloat16(), torch.randn(2, 1, 8, 512, generator=g).bfloat16()
    index = {}
    if layout == "paged-5":
        k_cache, v_cache = (torch.randn(80, 5, 1, w, generator=g).bfloat16() for w in (64, 512))
        index["page_table"] = torch.randperm(80, generator=g)[:80].reshape(2, 40).to(torch.int32)
    else:
        k_cache, v_cache = (torch.randn(2, 200, 1, w, generator=g).bfloat16() for w in (64, 512))
    emulation.clear_findings()
    with autoflash.emulate("h100", sanitize=True, schedule=schedule):
        flash_attn_with_kvcache(q, k_cache, v_cache, qv=qv, cache_seqlens=torch.tensor([150, 61], dtype=torch.int32),
                                num_splits=2, **index)
    assert not emulation.findings(), [str(f) for f in emulation.findings()]


def test_s_issued_before_its_v_tile_lands_is_reported(mutate):
    """The control: without the wait on V's full barrier before S (qv reads V in S), the sanitizer
    reports the wgmma reading a tile TMA has not delivered."""
    mutate("fwd", "      if constexpr (QV) mbarrier_wait(bar(&smem.full_v[s]), phase);\n", "")
    from autoflash.flash_attn_interface import flash_attn_with_kvcache

    g = torch.Generator().manual_seed(1)
    q, qv = torch.randn(1, 1, 8, 64, generator=g).bfloat16(), torch.randn(1, 1, 8, 256, generator=g).bfloat16()
    k_cache, v_cache = (torch.randn(1, 700, 1, w, generator=g).bfloat16() for w in (64, 256))
    emulation.clear_findings()
    with autoflash.emulate("h100", sanitize=True):
        flash_attn_with_kvcache(q, k_cache, v_cache, qv=qv, cache_seqlens=650, num_splits=1)
    found = [f for f in emulation.findings() if "flash_fwd_sm90.cu.j2" in f.location]
    assert found, [str(f) for f in emulation.findings()]


def test_explain_names_the_qv_kernel():
    from autoflash.flash_attn_interface import flash_attn_with_kvcache

    q, qv = torch.randn(2, 1, 16, 64).bfloat16(), torch.randn(2, 1, 16, 512).bfloat16()
    k_cache, v_cache = torch.randn(2, 4096, 1, 64).bfloat16(), torch.randn(2, 4096, 1, 512).bfloat16()
    with autoflash.emulate("h100"):
        text = str(autoflash.explain(flash_attn_with_kvcache, q, k_cache, v_cache, qv=qv, cache_seqlens=4000))
    assert "family: sm90" in text and "_dv512_qv_" in text, text
    assert "qv: the scores q . k + qv . v, each V tile read once for both products (each of the 2 blocks" in text


@pytest.mark.parametrize("dv, heavy, keys, stages", [(256, False, 96, 2), (256, True, 80, 3), (512, False, 48, 2),
                                                     (512, True, 32, 3)])
def test_the_qv_cache_tiles(dv, heavy, keys, stages):
    """qv: Qv's rows and all of V's columns in shared memory (at (64, 512) 48 keys and two stages fit); beside
    a variant at most 80 keys, 32 where two blocks share O (96 and 48 spilled)."""
    cfg = default_decode_config(64, "bf16", H100, None, heavy, False, dv, True)
    assert (cfg.qv, cfg.block_n, cfg.num_stages, cfg.head_split) == (True, keys, stages, dv // 256)
    assert cfg.smem_layout["qv"] == 64 * dv * 2 and cfg.smem_layout["v"] == stages * keys * dv * 2
