"""flash-attn's attention variants for the references: argument checks, the band of keys each query
sees (causal limit and sliding window, either diagonal alignment), and the score modifiers
(softcap, ALiBi, key bias). The plain, packed and tiled references all build their masks, block
ranges and logits from here, so they cannot disagree about what a variant means.

Per (batch b, query head h), query row i in [0, Lq) and key j in [0, Lk):
  diag = 0 (align "top_left", SDPA's is_causal) or Lk - Lq ("bottom_right", flash-attn's);
  causal keeps j <= i + diag; window (left, right), -1 unbounded on that side, keeps
  i + diag - left <= j <= i + diag + right; causal with a window makes right 0;
  attention_chunk C > 0 (FlashAttention-3's chunked local attention) keeps, as well, only the keys
  of the chunk holding key i + diag: c <= j < c + C with c = (i + diag) - (i + diag) mod C;
  logits = scale * q.k, or softcap * tanh(scale * q.k / softcap) when softcap > 0,
  minus slope[b, h] * |i + diag - j| (ALiBi), plus key_bias[b, j] (-inf masks the key).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from autoflash.kernels.checks import chunk_size, window_pair
from autoflash.kernels.config import ALIGNS, KernelConfig

NO_WINDOW = (-1, -1)


def check_align(align) -> str:
    if align not in ALIGNS:
        raise ValueError(f"align: got {align!r}, expected one of {ALIGNS}")
    return align


def check_window(window) -> tuple[int, int]:
    """(left, right) as a tuple of ints, each >= 0 or -1 (unbounded on that side)."""
    return window_pair("window", window)


def check_chunk(attention_chunk) -> int:
    """The chunk size as an int; 0 means no chunking."""
    return chunk_size("attention_chunk", attention_chunk)


def check_softcap(softcap) -> float:
    """The cap as a float; 0 means no capping."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap: got {softcap!r}, expected a number")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap: got {softcap!r}, expected a finite number >= 0 (0 = no capping)")
    return float(softcap)


def _check_fp32(name: str, t, shapes: tuple[tuple[int, ...], ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    if t.dtype != torch.float32:
        raise TypeError(f"{name}: got dtype {t.dtype}, expected torch.float32")
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{name}: got shape {tuple(t.shape)}, expected {' or '.join(str(s) for s in shapes)}")
    if t.device != device:
        raise ValueError(f"{name}: got device {t.device}, expected q's device {device}")


def check_alibi_slopes(slopes, b: int, hq: int, device: torch.device) -> torch.Tensor:
    """fp32 slopes of shape (Hq,) or (B, Hq); returns them as (B, Hq)."""
    _check_fp32("alibi_slopes", slopes, ((hq,), (b, hq)), device)
    return slopes.expand(b, hq)


def check_key_bias(key_bias, b: int, lk: int, device: torch.device) -> torch.Tensor:
    """An fp32 (B, Lk) additive bias per key (-inf masks the key)."""
    _check_fp32("key_bias", key_bias, ((b, lk),), device)
    return key_bias


@dataclass(frozen=True)
class Band:
    """The keys query row i sees: [lo(i), hi(i)) intersected with [0, lk). ``left``/``right`` are
    the window's sizes below and above the diagonal key i + diag, None when unbounded (causal is
    right = 0); ``chunk`` the attention chunk's size, None without one. lo and hi take an int or an
    index tensor; they are not clipped to [0, lk)."""

    diag: int
    lk: int
    left: int | None = None
    right: int | None = None
    chunk: int | None = None

    @classmethod
    def of(cls, lq: int, lk: int, *, causal: bool = False, align: str = "top_left", window=NO_WINDOW,
           attention_chunk: int = 0) -> "Band":
        """The band of (lq, lk) attention with these variant arguments, checked."""
        check_align(align)
        left, right = check_window(window)
        chunk = check_chunk(attention_chunk) or None
        if causal:
            right = 0
        diag = lk - lq if align == "bottom_right" else 0
        return cls(diag, lk, left if left >= 0 else None, right if right >= 0 else None, chunk)

    def _chunk_start(self, i):
        """The first key of the chunk holding row i's diagonal key (FlashAttention-3's test_util:
        x - x mod C, the remainder taking the divisor's sign)."""
        x = i + self.diag
        return x - x % self.chunk

    def lo(self, i):
        """The first key row i sees (0 when unbounded below)."""
        lo = 0 if self.left is None else i + self.diag - self.left
        if self.chunk is None:
            return lo
        start = self._chunk_start(i)
        return torch.maximum(start, torch.as_tensor(lo)) if isinstance(start, torch.Tensor) else max(start, lo)

    def hi(self, i):
        """One past the last key row i sees (lk when unbounded above)."""
        hi = self.lk if self.right is None else i + self.diag + self.right + 1
        if self.chunk is None:
            return hi
        end = self._chunk_start(i) + self.chunk
        return torch.minimum(end, torch.as_tensor(hi)) if isinstance(end, torch.Tensor) else min(end, hi)

    def mask(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """(len(rows), len(cols)) bool: True where query rows[r] sees key cols[c]."""
        i, j = rows.unsqueeze(1), cols.unsqueeze(0)
        keep = (j >= self.lo(i)) & (j < self.hi(i))
        return keep.expand(rows.numel(), cols.numel())

    def key_blocks(self, m_start: int, block_m: int, block_n: int) -> range:
        """Key blocks the query block starting at row m_start visits, as the kernel counts them:
        from the block holding its first row's first key lo(m_start) to the one holding its last
        row's last key, the last row being m_start + block_m - 1 even past Lq. Blocks outside are
        skipped; a block inside that no row sees (padding rows, or a window starting past Lk) is
        visited with every logit masked."""
        first = max(0, self.lo(m_start)) // block_n
        end = -(-min(self.lk, self.hi(m_start + block_m - 1)) // block_n)
        return range(first, max(first, end))

    def query_blocks(self, n_start: int, block_n: int, lq: int, block_m: int) -> range:
        """Query blocks the key block starting at n_start visits (the backward's inner loop), as
        the kernel counts them: from the block holding the first row i with hi(i) > n_start (even
        when that row is padding past Lq) to the one holding the last row, below Lq, with lo(i)
        below the key block's end."""
        first = 0 if self.right is None else n_start - self.diag - self.right
        n_end = min(n_start + block_n, self.lk)
        rows_end = lq if self.left is None else min(lq, n_end - self.diag + self.left)
        if self.chunk is not None:  # rows whose diagonal key lies in the chunks of keys n_start .. n_end - 1
            first = max(first, n_start - n_start % self.chunk - self.diag)
            rows_end = min(rows_end, (n_end - 1) - (n_end - 1) % self.chunk + self.chunk - self.diag)
        first = max(0, first) // block_m
        return range(first, max(first, -(-rows_end // block_m)))


def band_mask(lq: int, lk: int, *, causal: bool = False, align: str = "top_left", window=NO_WINDOW,
              attention_chunk: int = 0, device=None) -> torch.Tensor:
    """The (lq, lk) bool keep-mask of the causal limit, sliding window and attention chunk (all
    True without them)."""
    band = Band.of(lq, lk, causal=causal, align=align, window=window, attention_chunk=attention_chunk)
    return band.mask(torch.arange(lq, device=device), torch.arange(lk, device=device))


@dataclass(frozen=True)
class ScoreMod:
    """Raw scores q.k to logits for a batch of B with Hq query heads: scale, softcap, ALiBi and key
    bias, and the keep-mask (band, and keys the bias sets to -inf). ``slopes`` (B, Hq) and
    ``key_bias`` (B, Lk) are None when off. Score tiles are (B, heads..., rows, cols), the heads
    either (Hq,) or (Hkv, group): query head h = kv_head * group + g, so (B, Hq) reshapes to both."""

    scale: float
    band: Band
    softcap: float = 0.0
    slopes: torch.Tensor | None = None
    key_bias: torch.Tensor | None = None

    def logits(self, qk: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Logits of the raw scores ``qk`` for query rows ``rows`` and keys ``cols`` (1-D index
        tensors), -inf where keep() is False. Plain torch ops: autograd differentiates them, and
        masked entries get zero gradient."""
        s = qk * self.scale
        if self.softcap > 0:
            s = self.softcap * torch.tanh(s / self.softcap)
        if self.slopes is not None:
            dist = (rows.unsqueeze(1) + self.band.diag - cols.unsqueeze(0)).abs().to(s.dtype)
            s = s - self.slopes.to(s.dtype).reshape(*s.shape[:-2], 1, 1) * dist
        if self.key_bias is not None:
            s = s + self._per_batch(self.key_bias[:, cols].to(s.dtype), s)
        return s.masked_fill(~self.keep(rows, cols, s), float("-inf"))

    def keep(self, rows: torch.Tensor, cols: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Bool mask broadcastable to ``like`` (a score tile): the band, and keys with a finite bias."""
        keep = self.band.mask(rows, cols)
        if self.key_bias is not None:
            keep = keep & self._per_batch(torch.isfinite(self.key_bias[:, cols]), like)
        return keep

    def cap_grad(self, qk: torch.Tensor) -> torch.Tensor | float:
        """d logit / d (scale * qk): softcap's 1 - tanh², else 1 (ALiBi and the bias are constants)."""
        if self.softcap == 0:
            return 1.0
        return 1 - torch.tanh(qk * self.scale / self.softcap) ** 2

    @staticmethod
    def _per_batch(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A (B, cols) tensor viewed as (B, 1.., 1, cols) against score tile ``like``."""
        return t.reshape(t.shape[0], *(1,) * (like.dim() - 2), t.shape[1])


def score_mod(q: torch.Tensor, k: torch.Tensor, scale: float, *, causal: bool, align: str, window, softcap,
              alibi_slopes, key_bias, attention_chunk: int = 0) -> ScoreMod:
    """The ScoreMod of (B, Hq, Lq, D) q and (B, Hkv, Lk, D) k with these variant arguments, checked."""
    b, hq, lq = q.shape[:3]
    lk = k.shape[2]
    band = Band.of(lq, lk, causal=causal, align=align, window=window, attention_chunk=attention_chunk)
    slopes = None if alibi_slopes is None else check_alibi_slopes(alibi_slopes, b, hq, q.device)
    bias = None if key_bias is None else check_key_bias(key_bias, b, lk, q.device)
    return ScoreMod(scale, band, check_softcap(softcap), slopes, bias)


def config_score_mod(config: KernelConfig, q: torch.Tensor, k: torch.Tensor, scale: float, *, window, softcap,
                     alibi_slopes, key_bias) -> ScoreMod:
    """score_mod for the tiled references: causal and align come from ``config``, and each run-time
    argument must be given exactly when its switch is on (as the kernel for ``config`` takes it)."""
    for switch, reference in (("varlen", "attention_varlen_ref"), ("chunk", "attention_ref")):
        if getattr(config, switch):
            raise ValueError(f"config.{switch}: got True, expected False; not tiled here ({reference} is its reference)")
    given = {
        "window": check_window(window) != NO_WINDOW,
        "softcap": check_softcap(softcap) > 0,
        "alibi": alibi_slopes is not None,
        "key_bias": key_bias is not None,
    }
    arguments = {"window": "window", "softcap": "softcap", "alibi": "alibi_slopes", "key_bias": "key_bias"}
    for switch, has in given.items():
        if has != getattr(config, switch):
            state = "on" if getattr(config, switch) else "off"
            raise ValueError(f"{arguments[switch]}: got {'a value' if has else 'none'} with config.{switch} {state}; "
                             f"expected {'one' if getattr(config, switch) else 'none'} ({config.name})")
    return score_mod(q, k, scale, causal=config.causal, align=config.align, window=window, softcap=softcap,
                     alibi_slopes=alibi_slopes, key_bias=key_bias)
