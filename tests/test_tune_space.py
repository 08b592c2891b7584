"""The tuner's search space and its hard constraints (shared memory, ptxas spills), on the CPU."""
import pytest

from autoflash.kernels.config import KernelConfig
from autoflash.kernels.gpus import get_profile
from autoflash.tuning.problem import ProblemKey
from autoflash.tuning import space
from autoflash.tuning.space import (ACCUMULATOR_REGISTER_LIMIT, ROWS_PER_WARP, SM90_OVERHEAD_REGISTERS, Candidate,
                                    accumulator_registers,
                                    constrain, default_for, enumerate_space, param_values,
                                    point_of)

KEYS = [ProblemKey("h100", dr, dt, d, c, "le4k") for dr in ("fwd", "bwd") for dt in ("fp16", "bf16")
        for d in (64, 128, 256) for c in (False, True)]


@pytest.mark.parametrize("key", KEYS, ids=str)
def test_space_is_valid_plausible_and_starts_with_the_default(key):
    default = default_for(key, get_profile(key.gpu))
    configs = enumerate_space(key, default)
    assert configs[0] == default
    assert len({c.name for c in configs}) == len(configs)
    for c in configs[1:]:
        assert key.matches(c)
        if c.direction == "fwd":
            assert c.block_m // c.num_warps in ROWS_PER_WARP
        if c.family == "sm90" and c.direction == "bwd":  # within what setmaxnreg gives a consumer thread
            assert accumulator_registers(c) + SM90_OVERHEAD_REGISTERS <= c.consumer_registers
            continue
        # backward: KernelConfig.backward_layout keeps dK, dV, S, dP within 192 registers a thread
        assert accumulator_registers(c) <= (ACCUMULATOR_REGISTER_LIMIT if c.direction == "fwd" else 192)
    assert len(configs) > 20


def test_space_has_tiles_that_are_not_powers_of_two():
    key = ProblemKey("h100", "fwd", "bf16", 64, False, "le1k")
    tiles = {c.block_n for c in enumerate_space(key)} | {c.block_m for c in enumerate_space(key)}
    assert {48, 80, 96, 112} <= tiles


def test_backward_space_covers_head_split():
    key = ProblemKey("a100", "bwd", "fp16", 128, True, "gt4k")
    # d = 128: slices of 64 or 32 columns (whole 8-chunk blocks or a power-of-two number of chunks)
    assert {c.head_split for c in enumerate_space(key)} == {1, 2, 4}


def test_over_budget_configs_are_never_compiled(monkeypatch):
    compiled = []
    monkeypatch.setattr(space, "_compile_one", lambda cfg, arch: compiled.append(cfg.name) or ("ok", "", 100, 0))
    a100 = get_profile("a100")
    key = ProblemKey("a100", "fwd", "bf16", 128, False, "le4k")
    configs = enumerate_space(key)
    cands = constrain(configs, a100, jobs=1)
    over = [c for c in cands if c.config.smem_bytes > a100.smem_per_block_optin]
    assert over and all(c.status == "smem" and "per block on a100" in c.reason for c in over)
    assert not {c.config.name for c in over} & set(compiled)
    assert len(compiled) == len(configs) - len(over)
    assert [c.config for c in cands] == configs  # one candidate per config, in order


def test_spilling_config_is_rejected_by_the_ptxas_report():
    # 128 x 128 with 4 warps at d = 56: 32 query rows a warp, 14 head-dim chunks of three block
    # widths, spill registers on sm_80 (the defaults take 128 x 64 there)
    spills = KernelConfig(head_dim=56, dtype="bf16", block_m=128, block_n=128, num_warps=4, num_stages=2)
    fits = KernelConfig(head_dim=128, dtype="bf16", block_m=128, block_n=64, num_warps=8, num_stages=2)
    bad, good = constrain([spills, fits], get_profile("a100"), jobs=1)
    assert bad.status == "spills" and "spill stores" in bad.reason and bad.spill_bytes > 0 and not bad.ok
    assert good.ok and 0 < good.registers <= 255 and good.spill_bytes == 0


def test_param_values_come_from_feasible_candidates_only():
    key = ProblemKey("h100", "fwd", "bf16", 128, False, "le4k")
    mk = lambda m, n, w: KernelConfig(head_dim=128, dtype="bf16", block_m=m, block_n=n, num_warps=w)  # noqa: E731
    cands = [Candidate(mk(128, 64, 8), "ok"), Candidate(mk(64, 48, 4), "ok"), Candidate(mk(128, 256, 8), "smem")]
    assert param_values(cands, key) == {"sm80": {"block_m": (64, 128), "block_n": (48, 64), "num_warps": (4, 8),
                                                 "num_stages": (2,)}}
    # an sm90 candidate brings its family's own knobs (block_m follows num_warps there: no knob)
    sm90 = KernelConfig(head_dim=128, dtype="bf16", block_m=128, block_n=176, num_warps=8, family="sm90",
                        pingpong=True)
    values = param_values([*cands, Candidate(sm90, "ok"), Candidate(sm90.replace(block_n=256), "spills")], key)
    assert values["sm90"] == {"block_n": (176,), "num_warps": (8,), "num_stages": (2,), "pingpong": (True,),
                              "overlap": (False,)}
    assert list(values) == ["sm80", "sm90"] and point_of(key, {**{k: v[0] for k, v in values["sm90"].items()},
                                                               "family": "sm90"}) == sm90


def test_an_sm_90_forward_space_holds_both_families():
    """On an H100 a forward key's space, plain or variant, is the sm80 family's and the sm90 family's
    (key tiles in steps of 16, one to three consumer warpgroups, pingpong and overlap); an A100's only
    sm80's. An H100 variant backward's holds both too, its default the sm90 family's."""
    h100 = ProblemKey("h100", "fwd", "bf16", 128, True, "le1k")
    space = enumerate_space(h100, default_for(h100, get_profile("h100")))
    sm90 = [c for c in space if c.family == "sm90"]
    assert space[0].family == "sm90" and len(sm90) > 50 and len(space) > len(sm90) + 50
    assert {c.block_n for c in sm90} >= {64, 80, 176} and {c.num_warps for c in sm90} == {4, 8, 12}
    assert {(c.pingpong, c.overlap) for c in sm90} == {(a, b) for a in (False, True) for b in (False, True)}
    assert all(c.head_dim // 2 + 3 * c.block_n // 4 + 40 <= c.consumer_registers for c in sm90)
    window = ProblemKey("h100", "fwd", "bf16", 128, True, "le1k", variant="window")
    space = enumerate_space(window, default_for(window, get_profile("h100")))
    assert space[0].name == "fwd_hd128_bf16_br_win_m128n128w8s2_sm90a_pp_ov"  # the default, a window's causal tiles
    assert {c.family for c in space} == {"sm80", "sm90"} and all(c.window for c in space)
    assert {c.family for c in enumerate_space(ProblemKey("a100", "fwd", "bf16", 128, True, "le1k"))} == {"sm80"}
    backward = ProblemKey("h100", "bwd", "bf16", 128, True, "le1k", variant="window")
    space = enumerate_space(backward, default_for(backward, get_profile("h100")))
    assert space[0].name == "bwd_hd128_bf16_br_win_m64n128w8s2_sm90a"  # the default: 64 queries a step
    assert {c.family for c in space} == {"sm80", "sm90"} and all(c.window for c in space)


def test_an_sm_90_backward_space_holds_both_layouts():
    """The sm90 backward's space: warpgroups of 64 keys each and two sharing 64 keys (dkv_split) at
    d = 128; only the shared layout at d = 256 (dK and dV of 64 keys do not fit one warpgroup), whose
    default takes one Q/dO stage (two do not fit the H100's shared memory)."""
    d128 = [c for c in enumerate_space(ProblemKey("h100", "bwd", "bf16", 128, True, "le1k")) if c.family == "sm90"]
    assert {c.dkv_split for c in d128} == {False, True} and {c.num_warps for c in d128} == {4, 8}
    key = ProblemKey("h100", "bwd", "bf16", 256, False, "le1k")
    default = default_for(key, get_profile("h100"))
    d256 = [c for c in enumerate_space(key, default) if c.family == "sm90"]
    assert default.dkv_split and default.num_stages == 1 and d256[0] == default
    assert len(d256) > 3 and all(c.dkv_split and c.block_n == 64 for c in d256)


# ------------------------------------------------------------------ variant keys
from autoflash.kernels.defaults import default_backward_config, default_config  # noqa: E402
from autoflash.tuning.problem import (KEY_VARIANTS, TOKENS, Shape, packed_lengths, variant_applies,  # noqa: E402
                                      window_for)
from autoflash.tuning.runner import build_keys, skipped_combinations  # noqa: E402

VARIANT_KEYS = [ProblemKey("h100", dr, "bf16", 128, c, b, v) for v in KEY_VARIANTS for dr in ("fwd", "bwd")
                for c in (False, True) for b in ("le1k", "gt4k") if variant_applies(v, "bf16", c)]


@pytest.mark.parametrize("key", VARIANT_KEYS, ids=str)
def test_slug_round_trips_with_and_without_variant(key):
    parts = key.slug.split("/")
    assert len(parts) == (5 if key.variant == "plain" else 6)
    assert parts[5:] == ([] if key.variant == "plain" else [key.variant])
    assert ProblemKey.from_slug(key.gpu, key.slug) == key
    assert ProblemKey(**key.to_dict()) == key
    assert ("variant" in key.to_dict()) == (key.variant != "plain")  # plain keys write as before variants


def test_plain_slugs_are_unchanged():
    key = ProblemKey("h100", "fwd", "bf16", 128, True, "le4k")
    assert key.variant == "plain" and key.slug == "fwd/bf16/d128/causal/le4k"
    assert ProblemKey.from_slug("h100", "fwd/bf16/d128/causal/le4k") == key
    window = ProblemKey("h100", "fwd", "bf16", 128, True, "le4k", "window")
    assert window.slug == "fwd/bf16/d128/causal/le4k/window" and str(window) == "h100/fwd/bf16/d128/causal/le4k/window"


@pytest.mark.parametrize("slug", ["fwd/bf16/d128/causal/le4k/plain", "fwd/bf16/d128/causal/le4k/softcap",
                                  "fwd/bf16/d128/causal/le4k/window/x", "fwd/bf16/d128/causal"])
def test_from_slug_rejects_what_no_key_writes(slug):
    with pytest.raises(ValueError, match="not understood"):
        ProblemKey.from_slug("h100", slug)


@pytest.mark.parametrize("args, match", [
    (("bf16", False, "window"), "a window key is a causal sliding window"),
    (("fp32", True, "varlen"), "expected fp16 or bf16"),
    (("bf16", True, "alibi"), "expected one of"),
])
def test_keys_that_cannot_be_are_refused(args, match):
    dtype, causal, variant = args
    with pytest.raises(ValueError, match=match):
        ProblemKey("h100", "fwd", dtype, 128, causal, "le4k", variant)
    with pytest.raises(ValueError, match=f"not understood|{match}"):
        ProblemKey.from_slug("h100", f"fwd/{dtype}/d128/{'causal' if causal else 'full'}/le4k/{variant}")
    assert not variant_applies(variant, dtype, causal)


def _tile(key, **knobs):
    return KernelConfig(**key.config_fields(), block_m=64, block_n=64, num_warps=4, **knobs)


@pytest.mark.parametrize("variant, causal, switches", [
    ("plain", True, dict(causal=True, align="top_left", window=False, varlen=False)),
    ("window", True, dict(causal=False, align="bottom_right", window=True, varlen=False)),
    ("varlen", True, dict(causal=True, align="bottom_right", window=False, varlen=True)),
    ("varlen", False, dict(causal=False, align="top_left", window=False, varlen=True)),
])
def test_matches_requires_the_variants_switches(variant, causal, switches):
    key = ProblemKey("h100", "fwd", "bf16", 128, causal, "le4k", variant)
    cfg = _tile(key)
    assert {f: getattr(cfg, f) for f in switches} == switches
    assert key.matches(cfg) and not cfg.softcap and not cfg.alibi and not cfg.key_bias
    assert not key.matches(cfg.replace(softcap=True))  # another variant's switch: another kernel
    for other in KEY_VARIANTS:
        if other != variant and variant_applies(other, "bf16", causal):
            assert not ProblemKey("h100", "fwd", "bf16", 128, causal, "le4k", other).matches(cfg)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("variant", ["window", "varlen"])
@pytest.mark.parametrize("gpu", ["a100", "h100"])
def test_default_for_a_variant_key_is_the_launchers_variant_tiles_with_the_switches(gpu, variant, direction):
    profile = get_profile(gpu)
    key = ProblemKey(gpu, direction, "bf16", 64, True, "le4k", variant)
    cfg = default_for(key, profile)
    assert key.matches(cfg)
    assert cfg.variants == (variant,) and cfg.align == "bottom_right"
    assert cfg.causal == (variant != "window")  # the window folds causal into its right side of 0
    # the tiles the launcher takes without a config for a kernel carrying switches (causal or window)
    pick = default_backward_config if direction == "bwd" else default_config
    expected = pick(64, "bf16", True, profile, True).replace(**key.config_fields())
    if gpu == "h100" and direction == "bwd" and variant == "window":  # the sm90 backward: 96 queries a step
        expected = expected.replace(block_m=96)
    assert cfg == expected


@pytest.mark.parametrize("variant", ["window", "varlen"])
def test_variant_spaces_carry_the_switches(variant):
    key = ProblemKey("h100", "bwd", "fp16", 64, True, "le1k", variant)
    default = default_for(key, get_profile("h100"))
    configs = enumerate_space(key, default)
    assert configs[0] == default and len(configs) > 20
    assert all(key.matches(c) and c.variants == (variant,) for c in configs)
    plain = {c.name for c in enumerate_space(ProblemKey("h100", "bwd", "fp16", 64, True, "le1k"))}
    assert not plain & {c.name for c in configs}  # other kernels: compiled and pruned on their own


def test_window_workload_is_a_causal_bottom_right_band():
    key = ProblemKey("h100", "fwd", "bf16", 128, True, "le4k", "window")
    assert window_for(512) == (128, 0) and window_for(4096) == (1024, 0) and window_for(16384) == (1024, 0)
    for shape in key.shapes():
        w = key.workload(shape)
        assert not w.packed and w.lengths == (shape.seqlen,) * shape.batch
        assert w.launch_options() == {"causal": True, "align": "bottom_right", "window": window_for(shape.seqlen)}
        plain = ProblemKey("h100", "fwd", "bf16", 128, True, "le4k").workload(shape)
        assert w.total_pairs() < plain.total_pairs()  # fewer key tiles per query block


def test_varlen_workload_packs_random_lengths_up_to_the_bucket():
    key = ProblemKey("h100", "bwd", "fp16", 64, True, "le1k", "varlen")
    assert packed_lengths(TOKENS, 512) == packed_lengths(TOKENS, 512)  # seeded: the same on every run
    for shape in key.shapes():
        w = key.workload(shape)
        assert w.packed and w.max_seqlen == shape.seqlen and w.tokens == TOKENS
        assert len(w.lengths) == shape.batch > TOKENS // shape.seqlen  # random lengths: more sequences
        assert max(w.lengths) <= shape.seqlen and len(set(w.lengths)) > 1
        assert w.launch_options() == {"causal": True, "align": "bottom_right", "window": (-1, -1)}
    small = key.workload(Shape(1, 2, 257, 64), tokens=771)
    assert small.tokens == 771 and max(small.lengths) <= 257


def test_build_keys_skips_combinations_that_make_no_key():
    options = dict(dtypes=["bf16", "fp32"], causal=(False, True), variants=["plain", "window"])
    keys = build_keys("h100", directions=["fwd"], head_dims=[64], buckets=["le1k"], **options)
    assert [k.slug for k in keys] == ["fwd/bf16/d64/full/le1k", "fwd/bf16/d64/causal/le1k", "fwd/fp32/d64/full/le1k",
                                      "fwd/fp32/d64/causal/le1k", "fwd/bf16/d64/causal/le1k/window"]
    assert skipped_combinations(**options) == ["window bf16 non-causal", "window fp32 non-causal", "window fp32 causal"]
    assert build_keys("h100", directions=["fwd"], dtypes=["bf16"], head_dims=[64], causal=(True,),
                      buckets=["le1k"]) == [ProblemKey("h100", "fwd", "bf16", 64, True, "le1k")]  # plain by default
