"""ProblemKey: what a caller asks for (GPU, direction, dtype, head dim, causal, sequence-length
bucket and, where it can change the best tiles, a variant), kept apart from what is chosen for it (a
KernelConfig). Tuned tables hold one winner per key; the tuner times each key on its representative
shapes, each run as a Workload (the run-time side of the variant: window sizes, packed lengths).
Decode keys (variant "decode": flash_attn_with_kvcache's kernels) bucket queries per step, cache
length, batch and paging instead; their buckets and timed calls are tuning/decode.py's."""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

from autoflash.kernels.config import DIRECTIONS, DTYPES, HEAD_DIM_MAX, HEAD_DIM_MIN, HEAD_DIM_STEP, VARIANTS
from autoflash.tuning import decode as dk

# Sequence-length buckets: (label, largest seqlen_k in the bucket or None, representative lengths).
# Tile choices shift with length (short sequences want small tiles to fill the SMs); three buckets
# keep the table small. Each bucket is timed at two lengths so a winner is not tuned to one size.
SEQLEN_BUCKETS: tuple[tuple[str, int | None, tuple[int, ...]], ...] = (
    ("le1k", 1024, (512, 1024)),
    ("le4k", 4096, (2048, 4096)),
    ("gt4k", None, (8192, 16384)),
)
BUCKET_LABELS = tuple(label for label, _, _ in SEQLEN_BUCKETS)
# Representative shapes hold batch * seqlen = TOKENS and heads * head_dim = HIDDEN fixed, as
# FlashAttention's benchmark_flash_attention.py does (16k tokens, hidden 2048).
TOKENS, HIDDEN = 16384, 2048

# The variants a key may name: those whose kernels visit other tiles than plain attention's, so that
# another tile shape may win. "window": a sliding window, fewer key tiles per query block; "varlen":
# packed sequences, one grid z per sequence with partial last tiles and idle blocks past each
# sequence's end. Softcap, ALiBi and a key bias change the logits, not which tiles are visited:
# they take their key's plain winner (the launcher turns their switches on). A variant's name is
# the KernelConfig switch it turns on (config.VARIANTS).
KEY_VARIANTS = ("plain", "window", "varlen")
assert all(v in VARIANTS for v in KEY_VARIANTS[1:])
# Window keys are timed with the window (min(WINDOW_LEFT_MAX, seqlen // WINDOW_FRACTION), 0): a band
# well inside every timed length (windows in use run from Gemma 3's 1024 to Mistral's and Gemma 2's
# 4096, a half or less of their contexts), so the key's tiles are tuned for a band, not a triangle.
WINDOW_LEFT_MAX, WINDOW_FRACTION = 1024, 4
VARLEN_SEED = 0  # packed keys: lengths drawn by random.Random seeded from this, the tokens and max_seqlen
# A decode key (flash_attn_with_kvcache's kernels; buckets and workloads in tuning/decode.py) is a
# ProblemKey with this variant and its own fields: it is not one of KEY_VARIANTS (--variants), the
# tuner's --decode makes them.
DECODE = "decode"
_DECODE_FIELDS = ("q_bucket", "batch_bucket", "paged")
# Why a variant key has no SDPA-flash baseline (its time in the table is then null).
SDPA_UNSUPPORTED = {
    "window": "SDPA-flash has no sliding window (its flash backend takes no mask)",
    "varlen": "SDPA-flash takes packed sequences only as nested tensors, which the tuner does not time",
}


def seqlen_bucket(seqlen_k: int) -> str:
    """The bucket label of a key length: "le1k" (<= 1024), "le4k" (<= 4096) or "gt4k"."""
    if not isinstance(seqlen_k, int) or isinstance(seqlen_k, bool) or seqlen_k < 1:
        raise ValueError(f"seqlen_bucket: got {seqlen_k!r}, expected a positive int")
    for label, upper, _ in SEQLEN_BUCKETS:
        if upper is None or seqlen_k <= upper:
            return label
    raise AssertionError("unreachable: the last bucket is open-ended")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One timed problem: (batch, heads, seqlen, head_dim), seqlen_q == seqlen_k. For a packed
    (varlen) key, batch is the number of sequences and seqlen the longest one may have (max_seqlen);
    the lengths themselves are its Workload's."""

    batch: int
    heads: int
    seqlen: int
    head_dim: int


def window_for(seqlen: int) -> tuple[int, int]:
    """The sliding window a window key is timed with at this length: (left, 0), left =
    min(WINDOW_LEFT_MAX, seqlen // WINDOW_FRACTION)."""
    return min(WINDOW_LEFT_MAX, seqlen // WINDOW_FRACTION), 0


def packed_lengths(tokens: int, max_seqlen: int, seed: int = VARLEN_SEED) -> tuple[int, ...]:
    """Sequence lengths drawn uniformly from 1..max_seqlen until they hold `tokens` tokens (the last
    one cut to fit): the same lengths for the same arguments on every machine."""
    for name, value in (("tokens", tokens), ("max_seqlen", max_seqlen)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"packed_lengths: {name} got {value!r}, expected a positive int")
    rng = random.Random(f"autoflash-varlen/{seed}/{tokens}/{max_seqlen}")
    lengths: list[int] = []
    left = tokens
    while left:
        n = min(left, rng.randint(1, max_seqlen))
        lengths.append(n)
        left -= n
    return tuple(lengths)


@dataclasses.dataclass(frozen=True)
class Workload:
    """One timed call of a key as the launcher takes it, beyond the tensors' shapes: every
    sequence's length (queries = keys), whether they are packed (cu_seqlens, max_seqlen), and the
    causal / align / window keywords. Plain and window calls are dense (batch, heads, seqlen, d)."""

    heads: int
    head_dim: int
    lengths: tuple[int, ...]
    max_seqlen: int
    packed: bool
    causal: bool
    align: str = "top_left"
    window: tuple[int, int] = (-1, -1)

    @classmethod
    def dense(cls, shape: Shape, causal: bool) -> "Workload":
        """A plain call on `shape`: what every key was before variants."""
        return cls(shape.heads, shape.head_dim, (shape.seqlen,) * shape.batch, shape.seqlen, False, causal)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def launch_options(self) -> dict[str, Any]:
        """The launcher's causal, align and window keywords (cu_seqlens are tensors: the caller's)."""
        return {"causal": self.causal, "align": self.align, "window": self.window}

    def pairs(self, length: int) -> float:
        """(query, key) pairs one sequence of `length` attends, as FlashAttention's FLOP count has it:
        length^2, half that when causal; with a window (left, 0) the band's exact count."""
        left = self.window[0]
        if left >= 0:
            w = min(left, length - 1)
            return length * (w + 1) - w * (w + 1) / 2
        return length * length / (2 if self.causal else 1)

    def total_pairs(self) -> float:
        return math.fsum(self.pairs(n) for n in self.lengths)


def _check_variant(variant: Any, dtype: str, causal: bool) -> None:
    """A key's variant: one of KEY_VARIANTS; a window key is causal, and only 16-bit dtypes have
    variant kernels (KernelConfig refuses variant switches on fp32)."""
    if variant == DECODE:
        if dtype == "fp32":
            raise ValueError("ProblemKey: got variant 'decode' with dtype fp32; expected fp16 or bf16 (the KV-cache "
                             "kernels run on tensor cores)")
        return
    if variant not in KEY_VARIANTS:
        raise ValueError(f"ProblemKey.variant: got {variant!r}, expected one of {KEY_VARIANTS}")
    if variant == "window" and not causal:
        raise ValueError("ProblemKey: got variant 'window' with causal False; expected causal True (a window key is "
                         "a causal sliding window (left, 0), as Mistral, Gemma 2/3 and Qwen use)")
    if variant != "plain" and dtype == "fp32":
        raise ValueError(f"ProblemKey: got variant {variant!r} with dtype fp32; expected fp16 or bf16 (the variant "
                         f"kernels run on tensor cores)")


def variant_applies(variant: str, dtype: str, causal: bool) -> bool:
    """Whether (variant, dtype, causal) can be a key: the combinations build_keys takes from a
    product of options (window keys are causal; fp32 has plain keys only)."""
    try:
        _check_variant(variant, dtype, causal)
    except ValueError:
        return False
    return True


def causal_label(causal: bool) -> str:
    """A key's causal as printed for people: "causal" or "non-causal" (a slug says "full", as the
    tuned tables and caches store it)."""
    return "causal" if causal else "non-causal"


def slug_label(slug: str) -> str:
    """A slug as printed for people: its parts spaced, "non-causal" for the slug's "full", e.g.
    "fwd bf16 d128 non-causal le4k window"."""
    parts = slug.split("/")
    if len(parts) > 3 and parts[0] != DECODE and parts[3] == "full":
        parts[3] = causal_label(False)
    return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class ProblemKey:
    """What a call asks for. `variant` (default "plain") is one of KEY_VARIANTS, the variants that
    can change the best tiles:

    - "plain": causal is SDPA's is_causal (top-left; queries and keys are equally long when timed).
    - "window": a causal sliding window (left, 0), bottom-right aligned, as every model with one
      runs it (Mistral, Gemma 2/3, Qwen 2): `causal` must be True and means exactly that the window
      is causal on the right. The kernel is the window kernel (KernelConfig window=True, causal
      False: the launcher folds causal into the window's right side of 0). A symmetric window
      (w, w) has no key of its own.
    - "varlen": packed sequences (cu_seqlens); `causal` is flash-attn's varlen causal, aligned
      bottom-right per sequence.

    Softcap, ALiBi and key-bias calls use their plain key's config (they change the logits, not
    the tiles visited). The slug keeps its five parts for plain keys (tables written before
    variants read as they were) and gains the variant as a sixth otherwise.

    A decode key (variant "decode", made by ProblemKey.decode) is a flash_attn_with_kvcache call's:
    direction "fwd", seqlen_bucket the cache-length bucket (decode.CACHE_LABELS), and q_bucket,
    batch_bucket and paged set (None, None and False on every other key); causal is whether its
    queries are (q2-16 keys are timed causal, q1 keys not). Its slug is
    "decode/bf16/d128/q1/le32k/b1-4/dense" (or ".../paged")."""

    gpu: str  # a GpuProfile name, e.g. "h100"
    direction: str  # "fwd" or "bwd"
    dtype: str  # "fp16", "bf16" or "fp32"
    head_dim: int
    causal: bool
    seqlen_bucket: str  # one of BUCKET_LABELS
    variant: str = "plain"  # one of KEY_VARIANTS, or DECODE
    q_bucket: str | None = None  # decode keys: decode.Q_LABELS
    batch_bucket: str | None = None  # decode keys: decode.BATCH_LABELS
    paged: bool = False  # decode keys: a paged cache (pages of decode.PAGE_SIZE rows when timed)

    @classmethod
    def decode(cls, gpu: str, dtype: str, head_dim: int, q_bucket: str, cache_bucket: str, batch_bucket: str,
               paged: bool) -> "ProblemKey":
        """A decode key; causal follows the query bucket (q2-16 keys are causal)."""
        return cls(gpu, "fwd", dtype, head_dim, q_bucket != "q1", cache_bucket, DECODE, q_bucket, batch_bucket,
                   paged)

    @property
    def is_decode(self) -> bool:
        return self.variant == DECODE

    def __post_init__(self) -> None:
        if not isinstance(self.gpu, str) or not self.gpu:
            raise TypeError(f"ProblemKey.gpu: got {self.gpu!r}, expected a GPU profile name such as 'h100'")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"ProblemKey.direction: got {self.direction!r}, expected one of {DIRECTIONS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"ProblemKey.dtype: got {self.dtype!r}, expected one of {DTYPES}")
        d = self.head_dim
        if not isinstance(d, int) or isinstance(d, bool) or not (
                HEAD_DIM_MIN <= d <= HEAD_DIM_MAX and d % HEAD_DIM_STEP == 0):
            raise ValueError(f"ProblemKey.head_dim: got {d!r}, expected a multiple of {HEAD_DIM_STEP} "
                             f"in [{HEAD_DIM_MIN}, {HEAD_DIM_MAX}]")
        if not isinstance(self.causal, bool):
            raise TypeError(f"ProblemKey.causal: got {self.causal!r}, expected a bool")
        _check_variant(self.variant, self.dtype, self.causal)
        if self.is_decode:
            self._check_decode()
            return
        if self.seqlen_bucket not in BUCKET_LABELS:
            raise ValueError(f"ProblemKey.seqlen_bucket: got {self.seqlen_bucket!r}, expected one of {BUCKET_LABELS}")
        given = {f: getattr(self, f) for f in _DECODE_FIELDS if getattr(self, f) not in (None, False)}
        if given:
            raise ValueError(f"ProblemKey: got {given} on a {self.variant} key; expected them on decode keys only")

    def _check_decode(self) -> None:
        if self.direction != "fwd":
            raise ValueError(f"ProblemKey.direction: got {self.direction!r} on a decode key, expected 'fwd'")
        for field, labels in (("seqlen_bucket", dk.CACHE_LABELS), ("q_bucket", dk.Q_LABELS),
                              ("batch_bucket", dk.BATCH_LABELS)):
            if getattr(self, field) not in labels:
                raise ValueError(f"ProblemKey.{field}: got {getattr(self, field)!r} on a decode key, expected one "
                                 f"of {labels}")
        if not isinstance(self.paged, bool):
            raise TypeError(f"ProblemKey.paged: got {self.paged!r}, expected a bool")
        if self.causal != (self.q_bucket != "q1"):
            raise ValueError(f"ProblemKey.causal: got {self.causal} for query bucket {self.q_bucket!r}; expected "
                             f"{self.q_bucket != 'q1'} (q1 keys are timed non-causal, q2-16 keys causal)")

    @property
    def slug(self) -> str:
        """The key inside one GPU's table, e.g. "fwd/bf16/d128/causal/le4k", and with a variant
        "fwd/bf16/d128/causal/le4k/window"."""
        if self.is_decode:
            return "/".join((DECODE, self.dtype, f"d{self.head_dim}", self.q_bucket, self.seqlen_bucket,
                             self.batch_bucket, "paged" if self.paged else "dense"))
        parts = [self.direction, self.dtype, f"d{self.head_dim}", "causal" if self.causal else "full",
                 self.seqlen_bucket]
        return "/".join(parts if self.variant == "plain" else [*parts, self.variant])

    @property
    def label(self) -> str:
        """The key as printed for people (slug_label of its slug)."""
        return slug_label(self.slug)

    @classmethod
    def from_slug(cls, gpu: str, slug: str) -> "ProblemKey":
        """The key of a slug: five parts (plain) or six (the variant last); seven for a decode key."""
        parts = slug.split("/") if isinstance(slug, str) else []
        if len(parts) == 7 and parts[0] == DECODE and parts[2][:1] == "d" and parts[2][1:].isdigit() \
                and parts[6] in ("dense", "paged"):
            return cls.decode(gpu, parts[1], int(parts[2][1:]), parts[3], parts[4], parts[5], parts[6] == "paged")
        if (len(parts) not in (5, 6) or not parts[2].startswith("d") or not parts[2][1:].isdigit()
                or parts[3] not in ("causal", "full") or (len(parts) == 6 and parts[5] not in KEY_VARIANTS[1:])):
            raise ValueError(f"problem key {slug!r} not understood; expected e.g. 'fwd/bf16/d128/causal/le4k' or, "
                             f"with a variant ({', '.join(KEY_VARIANTS[1:])}), 'fwd/bf16/d128/causal/le4k/window', "
                             f"or a decode key 'decode/bf16/d128/q1/le32k/b1-4/dense'")
        return cls(gpu, parts[0], parts[1], int(parts[2][1:]), parts[3] == "causal", parts[4], *parts[5:])

    def __str__(self) -> str:
        return f"{self.gpu}/{self.slug}"

    def to_dict(self) -> dict[str, Any]:
        """The key's fields; a plain key leaves `variant` out, as keys were written before variants
        (ProblemKey(**d) reads both)."""
        d = dataclasses.asdict(self)
        if self.variant == "plain":
            del d["variant"]
        if not self.is_decode:  # the decode fields are written for decode keys only
            for f in _DECODE_FIELDS:
                del d[f]
        return d

    def config_fields(self) -> dict[str, Any]:
        """The KernelConfig fields a key fixes: direction, dtype, head dim, causal, alignment and
        every variant switch (the key's own on, the others off). A window key's kernel has causal
        False (the window's right side of 0 carries it); window and causal varlen keys are
        bottom-right aligned. A decode key's kernel is the KV-cache one (kvcache on, paged as the key,
        unsplit: flash_decode turns split on for num_splits > 1), causal bottom-right where causal."""
        if self.is_decode:
            return {"direction": "fwd", "dtype": self.dtype, "head_dim": self.head_dim, "causal": self.causal,
                    "align": "bottom_right" if self.causal else "top_left", **dict.fromkeys(VARIANTS, False),
                    "kvcache": True, "paged": self.paged, "split": False}
        placed = self.causal and self.variant != "plain"  # flash-attn's alignment: bottom right
        fields = {"direction": self.direction, "dtype": self.dtype, "head_dim": self.head_dim,
                  "causal": self.causal and self.variant != "window",
                  "align": "bottom_right" if placed else "top_left"}
        fields.update({switch: switch == self.variant for switch in VARIANTS})
        return fields

    def matches(self, config) -> bool:
        """Whether a KernelConfig was made for this key (config_fields: same direction, dtype, head
        dim, causal, alignment and variant switches)."""
        return all(getattr(config, f) == v for f, v in self.config_fields().items())

    def shapes(self) -> tuple[Shape, ...]:
        """The shapes a config of this key is timed on: the bucket's lengths at TOKENS tokens (for a
        packed key, batch = the number of sequences packed into TOKENS tokens). A decode key's are
        (batch, query heads, cache length, head_dim), decode.decode_shapes."""
        if self.is_decode:
            return tuple(Shape(*s) for s in dk.decode_shapes(self.q_bucket, self.seqlen_bucket, self.batch_bucket,
                                                              self.head_dim))
        lengths = next(lens for label, _, lens in SEQLEN_BUCKETS if label == self.seqlen_bucket)
        heads = max(1, HIDDEN // self.head_dim)
        if self.variant == "varlen":
            return tuple(Shape(len(packed_lengths(TOKENS, s)), heads, s, self.head_dim) for s in lengths)
        return tuple(Shape(max(1, TOKENS // s), heads, s, self.head_dim) for s in lengths)

    def decode_workload(self, shape: Shape) -> "dk.DecodeWorkload":
        """The flash_decode call a shape of a decode key is timed with (decode.DecodeWorkload)."""
        if not self.is_decode:
            raise ValueError(f"ProblemKey.decode_workload: got {self.variant} key {self.slug!r}, expected a decode key")
        return dk.decode_workload(self.q_bucket, self.paged, shape.batch, shape.seqlen, self.head_dim)

    def workload(self, shape: Shape, tokens: int = TOKENS) -> Workload:
        """The call a shape of this key is timed with. plain: dense, causal top-left; window: dense,
        window_for(seqlen), bottom-right; varlen: `tokens` tokens packed as packed_lengths(tokens,
        shape.seqlen), max_seqlen = shape.seqlen, causal bottom-right (shape.batch is not read)."""
        fields = self.config_fields()
        if self.variant == "varlen":
            return Workload(shape.heads, shape.head_dim, packed_lengths(tokens, shape.seqlen), shape.seqlen, True,
                            self.causal, fields["align"])
        plain = Workload.dense(shape, self.causal)
        if self.variant == "window":
            return dataclasses.replace(plain, align=fields["align"], window=window_for(shape.seqlen))
        return plain
