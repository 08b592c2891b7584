"""The attention variants' arguments as the launcher takes them (flash-attn's features: alignment,
sliding window, softcap, ALiBi, a key bias, packed sequences): checked, normalised to the fewest
kernel switches that compute the same thing, and turned into the KernelConfig switches and the
kernels' run-time arguments (templates/common/variants.cuh); and the launcher's side of packed
sequences (their (1, heads, total, d) views, LSE strides, the calls with nothing to launch)."""
from __future__ import annotations

import dataclasses
import math

import torch

from autoflash.kernels.checks import GRID_YZ_MAX, check_scale, chunk_size, cu_seqlens_vector, empty_like_width, \
    int32_vector, window_pair
from autoflash.kernels.config import ALIGNS, KernelConfig

LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class Variant:
    """One call's variant: `switches` for KernelConfig.replace, the kernels' extra pointers
    (cu_seqlens_q, cu_seqlens_k, seq_end_q, seq_end_k, alibi_slopes, key_bias; None, a null pointer,
    where a switch is off: the kernels never read it; seq_end is one past each packed sequence's last
    row in use, cu_seqlens[1:] or cu_seqlens[:-1] + seqused), whether seqused cut any (`seqused`) and
    scalars (alibi and bias batch strides, window left, right and chunk, softcap's two factors)."""

    switches: dict
    pointers: tuple
    window: tuple[int, int, int]  # left, right, chunk (0: none)
    seqused: bool
    alibi_sb: int
    bias_sb: int
    softcap: float

    @property
    def needs_registers(self) -> bool:
        """Whether the kernel carries any switch (alignment included): the built-in defaults then
        take tiles with registers to spare (kernels.defaults)."""
        return self.switches["align"] != "top_left" or any(v for k, v in self.switches.items() if k != "align")

    @property
    def varlen(self) -> bool:
        return self.switches["varlen"]

    def scalars(self, lse: torch.Tensor) -> tuple:
        """lse_sb lse_sh alibi_sb bias_sb: LSE rows are (B, H, L) dense, (H, total) packed."""
        lse_sb, lse_sh = (0, lse.stride(0)) if self.varlen else lse.stride()[:2]
        return lse_sb, lse_sh, self.alibi_sb, self.bias_sb

    def runs(self, batch: int) -> tuple[tuple[int, tuple], ...]:
        """(sequences, pointers) of each launch over `batch` sequences: gridDim.z holds at most
        GRID_YZ_MAX, so packed batches of more go as runs of that many, each handed its cu_seqlens
        (and per-sequence ALiBi slopes) from the run's first sequence on. Nothing else moves: packed
        rows, their LSE and dQ are indexed by absolute row. Dense batches are checked <= GRID_YZ_MAX."""
        if batch <= GRID_YZ_MAX:
            return ((batch, self.pointers),)
        cu_q, cu_k, end_q, end_k, alibi, bias = self.pointers
        per_sequence = alibi is not None and alibi.dim() == 2
        return tuple((min(GRID_YZ_MAX, batch - start),
                      (cu_q[start:], cu_k[start:], end_q[start:], end_k[start:],
                       alibi[start:] if per_sequence else alibi, bias))
                     for start in range(0, batch, GRID_YZ_MAX))

    def softcap_factors(self, scale: float) -> tuple[float, float]:
        """(scale / cap, cap * log2 e): logits tanh(s * scale / cap) * cap in log2 units."""
        if not self.softcap:
            return 0.0, 0.0
        return scale / self.softcap, self.softcap * LOG2E


def _window(window, causal: bool, align: str, lq: int, lk: int) -> tuple[bool, bool, int, int]:
    """(causal, window on, left, right): -1 is unbounded, causal makes right 0 (flash-attn's rules);
    a side long enough to reach past every key of every row is unbounded too, (unbounded, 0) is
    causal and (unbounded, unbounded) no window. Unbounded sides become lq + lk (no overflow in the
    kernels). lq, lk: the longest sequences."""
    left, right = window_pair("window", window)
    # Row i's diagonal is key i + diag: the left side reaches key 0 from every row once it is at
    # least the last row's diagonal, the right side key lk - 1 from the first row's.
    bottom_right = align == "bottom_right"
    if left >= (lk - 1 if bottom_right else lq - 1):
        left = -1
    if right >= (lq - 1 if bottom_right else lk - 1):
        right = -1
    if causal:
        right = 0
    if left == -1 and right == 0:
        return True, False, 0, 0
    if left == -1 and right == -1:
        return False, False, 0, 0
    unbounded = lq + lk
    return False, True, unbounded if left == -1 else left, unbounded if right == -1 else right


def _check_fp32(name: str, t, shapes: tuple[tuple[int, ...], ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    if t.dtype != torch.float32 or tuple(t.shape) not in shapes or t.device != device or t.stride(-1) != 1:
        raise ValueError(f"{name}: got {tuple(t.shape)} {t.dtype} on {t.device} (last stride {t.stride(-1)}); "
                         f"expected float32 of shape {' or '.join(str(s) for s in shapes)} on {device} with a "
                         f"contiguous last dim")


def _check_used(name: str, t, batch: int, device: torch.device) -> None:
    """seqused_q / seqused_k metadata (dtype, shape, device, contiguous); the values (0 <= used <= the
    span) are the caller's to check, as cu_seqlens' are."""
    int32_vector(name, t, batch, device, ": the rows in use of each packed sequence")
    if t.stride(0) != 1:
        raise ValueError(f"{name}: got stride {t.stride(0)}; expected a contiguous tensor")


def resolve(q: torch.Tensor, k: torch.Tensor, causal: bool, *, align: str = "top_left", window=(-1, -1),
            softcap: float = 0.0, alibi_slopes=None, key_bias=None, cu_seqlens_q=None, cu_seqlens_k=None,
            max_seqlen_q=None, max_seqlen_k=None, cache_len: int | None = None,
            attention_chunk: int = 0, seqused_q=None, seqused_k=None) -> tuple[bool, Variant]:
    """(causal as the kernels run it, the Variant) of a call. q, k are (B, H, L, D) views (for packed
    sequences the (1, H, total, D) views of (total, H, D)). cache_len: a KV cache's capacity, its
    batches' key lengths being run-time values up to it (the alignment then always holds).
    attention_chunk > 0: chunked local attention (FlashAttention-3's), the chunk switch inside a
    window kernel: a causal call becomes the window (unbounded, 0), a call with no window the
    window (unbounded, unbounded). seqused_q / seqused_k (packed sequences only, FlashAttention-3's):
    int32 (batch,), the rows of each sequence's cu_seqlens span in use. With cache_len, cu_seqlens_q and
    max_seqlen_q (and seqused_q) alone pack a KV cache's queries (FlashAttention-3's flash_attn_with_kvcache)."""
    if align not in ALIGNS:
        raise ValueError(f"align: got {align!r}, expected one of {ALIGNS}")
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen and cache_len is not None:  # a KV cache's packed queries: its keys come from the cache
        if cu_seqlens_k is not None or seqused_k is not None or key_bias is not None:
            raise ValueError("cu_seqlens_k, seqused_k, key_bias: got one with a KV cache's packed queries; "
                             "expected None (the cache's lengths count its keys)")
        batch = cu_seqlens_vector("cu_seqlens_q", cu_seqlens_q, q.device)
        if seqused_q is not None:
            _check_used("seqused_q", seqused_q, batch, q.device)
        if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
            raise ValueError(f"max_seqlen_q: got {max_seqlen_q!r}, expected an int >= 0 (the longest sequence)")
        lq, lk = max_seqlen_q, cache_len
    elif varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("cu_seqlens_q, cu_seqlens_k: got one of them; expected both (packed sequences) or neither")
        batch = cu_seqlens_vector("cu_seqlens_q", cu_seqlens_q, q.device)
        if cu_seqlens_vector("cu_seqlens_k", cu_seqlens_k, q.device) != batch:
            raise ValueError(f"cu_seqlens_k: got {cu_seqlens_k.numel()} entries, expected cu_seqlens_q's {batch + 1}")
        for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if isinstance(m, bool) or not isinstance(m, int) or m < 0:
                raise ValueError(f"{name}: got {m!r}, expected an int >= 0 (the longest sequence)")
        lq, lk = max_seqlen_q, max_seqlen_k
        for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
            if t is not None:
                _check_used(name, t, batch, q.device)
        if key_bias is not None:
            raise ValueError("key_bias: got a tensor with packed sequences; expected None (packed sequences carry "
                             "no padding to mask)")
    else:
        if max_seqlen_q is not None or max_seqlen_k is not None:
            raise ValueError("max_seqlen_q / max_seqlen_k: got a value without cu_seqlens; expected None")
        batch, lq, lk = q.shape[0], q.shape[2], k.shape[2] if cache_len is None else cache_len
        if seqused_q is not None or seqused_k is not None:
            raise ValueError("seqused_q / seqused_k: got a tensor without cu_seqlens; expected None (they count the "
                             "rows of packed sequences in use)")
    hq = q.shape[1]
    causal, windowed, left, right = _window(window, causal, align, lq, lk)
    attention_chunk = chunk_size("attention_chunk", attention_chunk)
    if attention_chunk and not windowed:  # the chunk rides on a window kernel's band
        left, right = lq + lk, 0 if causal else lq + lk
        causal, windowed = False, True

    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap: got {softcap!r}, expected a finite number >= 0 (0 = no capping)")
    alibi_sb = bias_sb = 0
    if alibi_slopes is not None:
        _check_fp32("alibi_slopes", alibi_slopes, ((hq,), (batch, hq)), q.device)
        alibi_sb = alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0
    if key_bias is not None:
        _check_fp32("key_bias", key_bias, ((batch, lk),), q.device)
        bias_sb = key_bias.stride(0)
    alibi = alibi_slopes is not None
    if not (causal or windowed or alibi) or (not varlen and cache_len is None and lq == lk):
        align = "top_left"  # nothing to place, or both diagonals coincide: one kernel serves both
    switches = {"align": align, "window": windowed, "chunk": attention_chunk > 0, "softcap": softcap > 0, "alibi": alibi,
                "key_bias": key_bias is not None, "varlen": varlen}
    if varlen and cache_len is not None:  # the kernels read no key bounds there; valid pointers all the same
        end_q = _seq_end(cu_seqlens_q, seqused_q)
        pointers = (cu_seqlens_q, cu_seqlens_q, end_q, end_q, alibi_slopes, key_bias)
    else:
        ends = (_seq_end(cu_seqlens_q, seqused_q), _seq_end(cu_seqlens_k, seqused_k)) if varlen else (None, None)
        pointers = (cu_seqlens_q, cu_seqlens_k, *ends, alibi_slopes, key_bias)
    return causal, Variant(switches, pointers, (left, right, attention_chunk), seqused_q is not None
                           or seqused_k is not None, alibi_sb, bias_sb, float(softcap))


def _seq_end(cu: torch.Tensor, used: torch.Tensor | None) -> torch.Tensor:
    """One past each packed sequence's last row in use: cu[1:] (a view), or cu[:-1] + used (one small
    device op; nothing is read back)."""
    return cu[1:] if used is None else cu[:-1] + used


# ---- packed sequences and configs, as the launcher needs them
def heads_view(t: torch.Tensor) -> torch.Tensor:
    """(1, H, total, D) view of packed (total, H, D) rows."""
    return t.transpose(0, 1).unsqueeze(0)


def views(q, k, v, cu_seqlens_q, cu_seqlens_k) -> tuple[bool, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed?, q, k, v as the kernels index them): packed sequences' (total, heads, head_dim) rows
    as (1, heads, total, head_dim) views, dense (B, H, L, D) tensors as they are."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return False, q, k, v
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: got {got}; expected packed sequences (total, heads, head_dim) with cu_seqlens")
    return True, heads_view(q), heads_view(k), heads_view(v)




def with_variant(config: KernelConfig, causal: bool, variant: Variant) -> KernelConfig:
    """`config` with the call's variant switches (a default or tuned plain config takes them on)."""
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config: got {type(config).__name__}, expected a KernelConfig")
    return config.replace(causal=causal, **variant.switches)


def empty_forward(q, k, v, causal, scale, cu_q, cu_k, max_q, max_k, alibi_slopes, softcap, window, align,
                  attention_chunk=0, seqused_q=None, seqused_k=None):
    """Packed sequences with no query rows or no keys at all: out 0, lse +inf (no key seen), after
    the same argument checks as a launch."""
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q, k, v dtypes: got {q.dtype}, {k.dtype}, {v.dtype}; expected one of float16, bfloat16")
    resolve(heads_view(q), heads_view(k), causal, align=align, window=window, softcap=softcap,
            alibi_slopes=alibi_slopes, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
            attention_chunk=attention_chunk, seqused_q=seqused_q, seqused_k=seqused_k)
    check_scale(scale, q.shape[-1])
    lse = torch.full((q.shape[1], q.shape[0]), math.inf, dtype=torch.float32, device=q.device)
    return empty_like_width(q, v.shape[-1]).zero_(), lse
