"""ProblemKey: what a caller asks for (GPU, direction, dtype, head dim, causal, sequence-length
bucket), kept apart from what is chosen for it (a KernelConfig). Tuned tables hold one winner per
key; the tuner times each key on its representative shapes."""
from __future__ import annotations

import dataclasses
from typing import Any

from autoflash.kernels.config import DIRECTIONS, DTYPES, HEAD_DIM_MAX, HEAD_DIM_MIN, HEAD_DIM_STEP

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
    """One timed problem: (batch, heads, seqlen, head_dim), seqlen_q == seqlen_k."""

    batch: int
    heads: int
    seqlen: int
    head_dim: int


@dataclasses.dataclass(frozen=True)
class ProblemKey:
    gpu: str  # a GpuProfile name, e.g. "h100"
    direction: str  # "fwd" or "bwd"
    dtype: str  # "fp16", "bf16" or "fp32"
    head_dim: int
    causal: bool
    seqlen_bucket: str  # one of BUCKET_LABELS

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
        if self.seqlen_bucket not in BUCKET_LABELS:
            raise ValueError(f"ProblemKey.seqlen_bucket: got {self.seqlen_bucket!r}, expected one of {BUCKET_LABELS}")

    @property
    def slug(self) -> str:
        """The key inside one GPU's table, e.g. "fwd/bf16/d128/causal/le4k"."""
        return "/".join((self.direction, self.dtype, f"d{self.head_dim}", "causal" if self.causal else "full",
                         self.seqlen_bucket))

    @classmethod
    def from_slug(cls, gpu: str, slug: str) -> "ProblemKey":
        parts = slug.split("/") if isinstance(slug, str) else []
        if (len(parts) != 5 or not parts[2].startswith("d") or not parts[2][1:].isdigit()
                or parts[3] not in ("causal", "full")):
            raise ValueError(f"problem key {slug!r} not understood; expected e.g. 'fwd/bf16/d128/causal/le4k'")
        return cls(gpu, parts[0], parts[1], int(parts[2][1:]), parts[3] == "causal", parts[4])

    def __str__(self) -> str:
        return f"{self.gpu}/{self.slug}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def config_fields(self) -> dict[str, Any]:
        """The KernelConfig fields a key fixes."""
        return {"direction": self.direction, "dtype": self.dtype, "head_dim": self.head_dim, "causal": self.causal}

    def matches(self, config) -> bool:
        """Whether a KernelConfig was made for this key (same direction, dtype, head dim, causal)."""
        return all(getattr(config, f) == v for f, v in self.config_fields().items())

    def shapes(self) -> tuple[Shape, ...]:
        """The shapes a config of this key is timed on: the bucket's lengths at TOKENS tokens."""
        lengths = next(lens for label, _, lens in SEQLEN_BUCKETS if label == self.seqlen_bucket)
        heads = max(1, HIDDEN // self.head_dim)
        return tuple(Shape(max(1, TOKENS // s), heads, s, self.head_dim) for s in lengths)
