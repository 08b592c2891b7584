"""Randomized acceptance on the emulator: fresh problems every run (the seed is printed; set
AUTOFLASH_FUZZ_SEED to replay one), each run by autoflash.attention in strict mode (no fallback) as
a GPU drawn from every profile would run it, forward and backward, held to FlashAttention-3's rule
(Dao-AILab/flash-attention hopper/test_flash_attn.py; autoflash.reference.forward.within_tolerance):
    max|x - ref32| <= 2 * max|x_torch - ref32| + 2 * max|ref' + 0.3 - 0.3 - ref'|  for out, dq, dk, dv,
ref' the reference rounded to the input dtype: the rounding at the reference's magnitude.
The draw mirrors ../shared/acceptance/gpu_fuzz.py at sizes the CPU runs quickly.

Every length is drawn for queries and keys. Under FlashAttention-2's rule (2x/3x + 1e-5) tiny problems
failed on rounding-sized errors that the rounding term covers:
- single-key rows (Lk = 1, or causal with Lq = 1): every softmax row is exactly 1, so the references'
  dQ and dK are exactly 0 and so is PyTorch's, leaving that rule a bound of 1e-5; the kernels, like
  FlashAttention-2's, take delta = rowsum(dO * O) and dP = dO V^T as two different fp32 sums, and their
  residue, summed over up to 2 x 3 x 239 rows into dK, reached 1.007e-05 (Lq 127, GQA 3:1, d 72). FA3's
  term of a zero reference is 2 x 4.9e-5 (fp16) or 2 x 7.8e-4 (bf16).
- causal Lq = 2 (bf16 and fp16) and Lq 1 / Lk 2 problems exceeded 3x on dq or dk by 10-70%: with one or
  two query rows per key the max error is taken over a handful of elements, and PyTorch's can happen
  to be small. FIXED_BY_FA3 pins three such problems.

Open: some of those tiny problems exceed FA3's rule as well (on the emulator: 3 of 151 causal Lq 2
bf16 draws, 1 of 100 fp16, 3 of 12 fp16 Lq 1 / Lk 2 draws), up to 2.6x, on dq and dk. Not noise:
the kernels, like FlashAttention-2 and -3, take delta = rowsum(dO * O) from O rounded to the input
dtype, which moves dq and dk by delta_rounding_shift; the exact dS and PyTorch's rounding of it vanish
as a softmax row gets one-hot, that shift does not, and with one or two query rows per key nothing
averages it out. DELTA_BOUND pins such problems (strict xfail) and test_the_excess_is_flashattentions_delta
shows the shift is the whole excess. In the random draws (about 1 in 500-1000 exceeds the rule this
way: AUTOFLASH_FUZZ_SEED 2000-2029 and 3000-3019 gave one, 3016 case 5) a gradient past the rule must
therefore meet it against the exact gradient moved by that shift: the draw stays, and anything else
in the excess still fails. Taking delta from an fp32 O (an extra O-sized tensor saved for the
backward, which FlashAttention does not pay) would remove the shift; that is a memory trade-off to
measure on a GPU first.
"""
import os
import random
import time

import pytest
import torch

import autoflash
from autoflash.kernels.gpus import PROFILES
from autoflash.reference.backward import attention_backward_ref, delta_rounding_shift
from autoflash.reference.forward import attention_ref, within_tolerance

SEED = int(os.environ.get("AUTOFLASH_FUZZ_SEED") or time.time_ns() % 2**31)
CASES = 5  # random draws per run (each a fresh kernel build and run, ~12 s)
LENGTHS = (1, 2, 3, 7, 16, 31, 64, 65, 113, 127, 128, 129, 203, 239)
DIMS = (32, 40, 48, 64, 72, 80, 96, 104, 112, 128, 160, 192, 224, 256)


def _draw(rng: random.Random) -> dict:
    hkv = rng.choice([1, 2])
    return dict(gpu=rng.choice(sorted(PROFILES)), b=rng.choice([1, 2]), hkv=hkv, hq=hkv * rng.choice([1, 2, 3]),
                lq=rng.choice(LENGTHS), lk=rng.choice(LENGTHS), d=rng.choice(DIMS),
                dtype=rng.choice(["float16", "bfloat16"]), causal=rng.random() < 0.5,
                layout=rng.choice(["bhsd", "bshd"]))


def _solve(c: dict, g: torch.Generator):
    """Problem c through autoflash.attention on the emulated c["gpu"], forward and backward: the
    inputs (detached), out, the output gradient and (dq, dk, dv)."""
    dt = getattr(torch, c["dtype"])

    def make(h, n):
        if c["layout"] == "bshd":
            return torch.randn(c["b"], n, h, c["d"], generator=g).to(dt).transpose(1, 2).requires_grad_()
        return torch.randn(c["b"], h, n, c["d"], generator=g).to(dt).requires_grad_()

    q, k, v = make(c["hq"], c["lq"]), make(c["hkv"], c["lk"]), make(c["hkv"], c["lk"])
    with autoflash.emulate(c["gpu"]):
        out = autoflash.attention(q, k, v, is_causal=c["causal"], enable_gqa=True, strict=True)
        dout = torch.randn(out.shape, generator=g).to(dt)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    return [t.detach() for t in (q, k, v)], out, dout, grads


def _run(c: dict, g: torch.Generator, what: str, delta_shift: bool = False) -> None:
    """Problem c, forward and backward through autoflash.attention on the emulated c["gpu"], held to
    FlashAttention-3's rule (out: the forward rule, dq/dk/dv: the backward rule). delta_shift: a
    gradient past the rule must then meet it against the exact gradient moved by
    delta_rounding_shift, i.e. its whole excess must be FlashAttention's delta (module docstring)."""
    x, out, dout, grads = _solve(c, g)
    ok, err, bound = within_tolerance(out.detach(), attention_ref(*x, causal=c["causal"])[0],
                                      attention_ref(*x, causal=c["causal"], upcast=False)[0])
    assert ok, f"{what} {c}: out err {err:.3e} > {bound:.3e}"
    refs = attention_backward_ref(*x, dout, causal=c["causal"])
    yards = attention_backward_ref(*x, dout, causal=c["causal"], upcast=False)
    shifts = None
    for i, (name, got, ref, yard) in enumerate(zip(("dq", "dk", "dv"), grads, refs, yards)):
        ok, err, bound = within_tolerance(got, ref, yard, backward=True)
        if not ok and delta_shift:
            if shifts is None:
                shifts = delta_rounding_shift(*x, out.detach(), dout, causal=c["causal"])
            moved, moved_err, _ = within_tolerance(got, ref + shifts[i], yard, backward=True)
            assert moved, (f"{what} {c}: {name} err {err:.3e} > {bound:.3e}, and {moved_err:.3e} from the exact "
                           f"gradient moved by delta_rounding_shift: more than FlashAttention's delta")
            print(f"{what}: {name} err {err:.3e} > {bound:.3e}, all of it FlashAttention's delta "
                  f"({moved_err:.3e} from the moved gradient)")
            continue
        assert ok, f"{what} {c}: {name} err {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("index", range(CASES))
def test_random_problem_meets_flashattention_rule(index):
    rng = random.Random(SEED * 1000 + index)
    c = _draw(rng)
    print(f"fuzz seed {SEED} case {index}: {c}")
    _run(c, torch.Generator().manual_seed(rng.randrange(2**31)), f"seed {SEED} case {index}", delta_shift=True)


def test_draw_covers_every_length_for_queries_and_keys():
    """No length is left out of the draw (Lq = 2 was, under FlashAttention-2's rule)."""
    rng = random.Random(0)
    draws = [_draw(rng) for _ in range(2000)]
    assert {c["lq"] for c in draws} == {c["lk"] for c in draws} == set(LENGTHS)
    assert any(c["lq"] == 2 and c["causal"] and c["dtype"] == "bfloat16" for c in draws)


def _case(spec: dict) -> tuple[dict, torch.Generator]:
    """A pinned problem: a fuzz draw (seed, index) or a config with its generator seed (gen)."""
    if "seed" in spec:
        rng = random.Random(spec["seed"] * 1000 + spec["index"])
        c = _draw(rng)
        return c, torch.Generator().manual_seed(rng.randrange(2**31))
    return {k: v for k, v in spec.items() if k != "gen"}, torch.Generator().manual_seed(spec["gen"])


# Tiny problems FlashAttention-2's rule (2x / 3x + 1e-5) failed and FlashAttention-3's meets.
FIXED_BY_FA3 = [
    # dk 1.16x FA2's bound, 0.68x FA3's
    pytest.param(dict(gpu="a100", b=1, hkv=1, hq=1, lq=1, lk=2, d=160, dtype="float16", causal=False,
                      layout="bhsd", gen=5), id="lq1-lk2-d160-fp16"),
    # dq 1.13x, 0.79x
    pytest.param(dict(gpu="rtx3090", b=1, hkv=1, hq=2, lq=2, lk=203, d=72, dtype="bfloat16", causal=True,
                      layout="bshd", gen=194), id="causal-lq2-bf16"),
    # single key: dk's residue 1.04x FA2's 1e-5 (without the old 1e-4 floor), 0.11x FA3's
    pytest.param(dict(gpu="a100", b=2, hkv=1, hq=3, lq=127, lk=1, d=72, dtype="float16", causal=False,
                      layout="bhsd", gen=1), id="single-key-gqa"),
]


@pytest.mark.parametrize("spec", FIXED_BY_FA3)
def test_tiny_problems_meet_the_rule(spec):
    c, g = _case(spec)
    _run(c, g, f"pinned {spec}")


# Tiny problems that exceed FlashAttention-3's rule too, on dq and dk, because the kernels (like
# FlashAttention-2 and -3) take delta = rowsum(dO * O) from O rounded to the input dtype: see
# test_the_excess_is_flashattentions_delta and autoflash.reference.backward.delta_rounding_shift.
# strict: once the kernels take delta from an fp32 O they pass, and these must move to FIXED_BY_FA3.
DELTA_BOUND = [
    pytest.param(dict(seed=1030, index=3), id="fuzz-1030-3"),  # causal Lq 2 bf16: dk 1.07x
    pytest.param(dict(seed=3016, index=5), id="fuzz-3016-5"),  # causal Lq 2 fp16: dk 1.02x
    pytest.param(dict(gpu="rtx3090", b=1, hkv=2, hq=2, lq=2, lk=113, d=192, dtype="float16", causal=True,
                      layout="bhsd", gen=1058), id="causal-lq2-fp16"),  # dq 2.6x
    pytest.param(dict(gpu="rtx5090", b=1, hkv=2, hq=2, lq=1, lk=2, d=192, dtype="float16", causal=False,
                      layout="bhsd", gen=3013), id="lq1-lk2-fp16"),  # dk 1.76x
]
DELTA_REASON = ("delta = rowsum(dO * O) over O in the input dtype (FlashAttention's backward, "
                "templates/flash_bwd.cu.j2's _delta kernel): dq/dk off by delta_rounding_shift")


@pytest.mark.xfail(strict=True, reason=DELTA_REASON)
@pytest.mark.parametrize("spec", DELTA_BOUND)
def test_delta_bound_problems_meet_the_rule(spec):
    c, g = _case(spec)
    _run(c, g, f"pinned {spec}")


@pytest.mark.parametrize("spec", DELTA_BOUND)
def test_the_excess_is_flashattentions_delta(spec):
    """On the problems above, the kernels' dq and dk are the exact gradients moved by
    delta_rounding_shift (delta from the output rounded to the input dtype) to well within the rule:
    the excess is that shift, FlashAttention's formulation, and nothing else in the kernels."""
    c, g = _case(spec)
    x, out, dout, grads = _solve(c, g)
    refs = attention_backward_ref(*x, dout, causal=c["causal"])
    yards = attention_backward_ref(*x, dout, causal=c["causal"], upcast=False)
    shifts = delta_rounding_shift(*x, out.detach(), dout, causal=c["causal"])
    excess = False
    for name, got, ref, yard, shift in zip(("dq", "dk", "dv"), grads, refs, yards, shifts):
        ok, err, bound = within_tolerance(got, ref, yard, backward=True)
        excess |= not ok
        # measured from the shifted gradients, the error is under half the bound: the shift is the excess
        moved_err = within_tolerance(got, ref + shift, yard, backward=True)[1]
        assert moved_err < 0.5 * bound, f"{name}: err {err:.3e}, {moved_err:.3e} from ref + shift, bound {bound:.3e}"
    assert excess  # the problem does exceed the rule against the exact gradients
