"""KernelConfig: the one description of a generated kernel, shared by tuner, codegen, cache and
tuned tables. Everything that changes the generated code is a field; runtime scalars (lengths,
strides, scale) are kernel arguments and never appear here."""
from __future__ import annotations

import dataclasses
import re
from typing import Any

DTYPES = ("fp16", "bf16", "fp32")
DIRECTIONS = ("fwd", "bwd")
DQ_MODES = ("atomic", "pass")
# Kernel families: "sm80" runs Ampere's mma.sync (ldmatrix, cp.async) on every GPU from sm_80;
# "sm90" is FlashAttention-3's design on sm_90a (wgmma, TMA, mbarriers, a producer warpgroup beside
# the consumer warpgroups): the forward (block_m / 64 consumer warpgroups of query rows;
# templates/flash_fwd_sm90.cu.j2) and the backward (block_n / 64 consumer warpgroups of keys, or two
# sharing 64 keys and splitting dK/dV between them: KernelConfig.dkv_split; dQ added by bulk
# reductions; templates/flash_bwd_sm90.cu.j2).
FAMILIES = ("sm80", "sm90")
# setmaxnreg per thread (producer, consumer) by consumer warpgroups: FlashAttention-3's choice
# (hopper/flash_fwd_kernel_sm90.h; 64K registers a block: 128 * (24 + 2 * 240) fits).
SM90_REGISTERS = {1: (56, 256), 2: (24, 240), 3: (32, 160)}
ALIGNS = ("top_left", "bottom_right")
# The variant switches (flash-attn's features), in the order the kernel name shows them. Each is a
# compile-time switch; its run-time values (window sizes, the cap, slopes, bias, cu_seqlens) are
# kernel arguments.
VARIANTS = ("window", "chunk", "softcap", "alibi", "key_bias", "varlen")
_VARIANT_TAGS = {"window": "win", "chunk": "chunk", "softcap": "cap", "alibi": "alibi", "key_bias": "kbias", "varlen": "varlen"}
# The decode switches (flash_attn_with_kvcache), forward only, shown after the variants: keys from a
# KV cache, paged through a block table (gathered row by row from pages of any size), split across
# blocks (fp32 partials and a combine kernel).
DECODE_SWITCHES = ("kvcache", "paged", "gather", "split")
_DECODE_TAGS = {"kvcache": "kvc", "paged": "paged", "gather": "gather", "split": "split"}
ELEM_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
HEAD_DIM_MIN, HEAD_DIM_MAX, HEAD_DIM_STEP = 32, 256, 8
# V's head dim where it differs from Q and K's (FlashAttention-3's headdim_v; the forward): up to 512,
# O's columns beyond 256 shared among head_split blocks of at most 256 each.
HEAD_DIM_V_MAX, O_SLICE_MAX = 512, 256
# Q and K's head dim beside a V head dim of its own, in the forward: up to 576, FlashAttention-3's qv
# (q_v . v added to the scores) run as one product over Q's and qv's columns (64 + 512, DeepSeek's MLA).
HEAD_DIM_QV_MAX = 576
MAX_THREADS_PER_BLOCK = 1024
MMA_M = 16  # rows of one mma.sync.m16n8k16 tile: each warp owns a multiple of 16 query rows
MMA_K = 16  # its k extent: tensor-core head dims are padded up to a multiple of 16

_NAME_RE = re.compile(
    r"^(?P<direction>fwd|bwd)_hd(?P<head_dim>\d+)(?:_dv(?P<head_dim_v>\d+))?(?P<qv>_qv)?_(?P<dtype>fp16|bf16|fp32)(?P<causal>_causal)?(?P<br>_br)?"
    r"(?P<window>_win)?(?P<chunk>_chunk)?(?P<softcap>_cap)?(?P<alibi>_alibi)?(?P<key_bias>_kbias)?(?P<varlen>_varlen)?"
    r"(?P<kvcache>_kvc)?(?P<paged>_paged)?(?P<gather>_gather)?(?P<split>_split)?_m(?P<block_m>\d+)n(?P<block_n>\d+)w(?P<num_warps>\d+)s(?P<num_stages>\d+)(?:h(?P<head_split>\d+))?"
    r"(?P<dq_pass>_dqpass)?(?P<v_in_regs>_vregs)?(?P<sm90>_sm90a(?P<pingpong>_pp)?(?P<overlap>_ov)?)?$"
)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _require_int(field: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"KernelConfig.{field}: got {value!r} ({type(value).__name__}), expected an int")


def _offsettable(chunks: int) -> bool:
    """A runtime offset of this many 16-byte chunks keeps swizzled ldmatrix addresses one XOR and one
    add (TileLane.column): a power of two up to 8, or whole 8-chunk blocks."""
    return chunks > 0 and (chunks % 8 == 0 or 8 % chunks == 0)


def _ldsm_per_mma(rows: int, cols: int) -> float:
    """ldmatrix.x4 per mma.m16n8k16 for a warp tile rows x cols with both operands from shared
    memory: per k16 step rows/16 A loads and cols/16 B loads feed (rows/16) * (cols/8) MMAs."""
    a, b = rows // 16, cols // 16
    return (a + b) / (2 * a * b)


def _share(n: int, warps: int, offset: bool) -> int:
    """Columns of n each of `warps` warps holds: a contiguous n / warps, or whole 16-column pairs
    dealt round robin (the most any warp gets)."""
    return n // warps if offset else 16 * -(-(n // 16) // warps)


def _split(warps: int, m: int, n: int, limit: int, *, m_cols: bool | None = None,
           n_cols: bool | None = None) -> tuple[int, int, bool] | None:
    """(warps along m, warps along n, n by offset) for an m x n product, with the fewest ldmatrix
    per MMA among the splits whose fp32 accumulators per warp stay within `limit` elements.

    Where a dimension is the column dimension of a shared-memory tile (m_cols / n_cols not None),
    a warp's share starts at a run-time column: for whole-8-chunk tiles (the flag) with an
    offsettable chunk count per warp that is one XOR and one add (TileLane.column). Otherwise the m
    split is refused, and the n split interleaves: warp w takes the 16-column pairs p with
    p % warps_n == w, read at compile-time columns under a warp-uniform branch."""
    best = None
    for wm in (w for w in (1, 2, 4, 8, 16) if warps % w == 0):
        wn = warps // wm
        if m % (16 * wm) or n % 16:
            continue
        tm = m // wm
        if wm > 1 and m_cols is not None and not (m_cols and _offsettable(tm // 8)):
            continue
        offset = n % (16 * wn) == 0 and (wn == 1 or n_cols is None or (n_cols and _offsettable(n // wn // 8)))
        if not offset and (n_cols is None or (n // 16) < wn):
            continue  # interleaving is for head-dim columns, and every warp needs a pair
        tn = _share(n, wn, offset)
        if tm * tn > limit:
            continue
        key = (_ldsm_per_mma(tm, tn), not offset, -tm)
        if best is None or key < best[0]:
            best = (key, (wm, wn, offset))
    return None if best is None else best[1]


@dataclasses.dataclass(frozen=True)
class BackwardLayout:
    """Warp layouts of the tensor-core backward (FlashAttention-2's 2D tiling, chosen by counting).

    s:  (warps along queries, warps along keys) for S = Q K^T and dP = dO V^T
    kv: (warps along keys, warps along the head dim) for dV += P^T dO and dK += dS^T Q
    q:  (warps along queries, warps along the head dim) for dQ = dS K
    kv_offset, q_offset: whether the head-dim share of a warp is a contiguous run of columns
    (else interleaved 16-column pairs, see _split).
    Each is the split with the fewest ldmatrix per MMA whose fp32 accumulators fit: a warp's tiles
    of dK (= dV) and S (= dP) hold at most 3072 elements together (dK, dV, S, dP: 192 registers a
    thread), each at most 2048. FlashAttention-2's sm80 choices sit at that bound: d = 64 with
    128 x 128 tiles, d = 128 with 64 x 128 (csrc/flash_attn/src/flash_bwd_launch_template.h)."""

    s: tuple[int, int]
    kv: tuple[int, int]
    q: tuple[int, int]
    kv_offset: bool
    q_offset: bool
    kv_elements: int  # fp32 accumulator elements per warp of dK (and as many of dV)
    s_elements: int  # ... of S (and as many of dP)


_ACC_LIMIT, _ACC_TOTAL = 2048, 3072  # fp32 accumulator elements per warp (32 threads)


def _backward_layout(block_m: int, block_n: int, d_slice: int, warps: int) -> BackwardLayout:
    d_cols = d_slice % 64 == 0      # head-dim columns: whole 8-chunk blocks (16-bit elements)
    key_cols = block_n % 64 == 0    # keys are the columns of the P and dS tiles
    kv = _split(warps, block_n, d_slice, _ACC_LIMIT, m_cols=key_cols, n_cols=d_cols)
    if kv is None:
        raise ValueError(
            f"KernelConfig (backward): no warp layout of {warps} warps for dK, dV of {block_n} keys x {d_slice} "
            f"head-dim columns: expected warp tiles of whole 16 x 16 blocks with at most {_ACC_LIMIT} fp32 "
            f"accumulators each, the keys split among warps only when block_n is a multiple of 64 (they are "
            f"the P and dS tiles' columns); use more warps, fewer keys or block_n 64 / 128"
        )
    kv_elems = (block_n // kv[0]) * _share(d_slice, kv[1], kv[2])
    s = _split(warps, block_m, block_n, min(_ACC_LIMIT, _ACC_TOTAL - kv_elems))
    if s is None:
        raise ValueError(
            f"KernelConfig (backward): no warp layout of {warps} warps for S, dP of {block_m} queries x {block_n} "
            f"keys fits the registers left beside dK, dV; use a smaller block_m"
        )
    q = _split(warps, block_m, d_slice, _ACC_LIMIT, n_cols=d_cols)
    if q is None:
        raise ValueError(
            f"KernelConfig (backward): no warp layout of {warps} warps for dQ of {block_m} queries x {d_slice} "
            f"head-dim columns; use block_m a multiple of 16"
        )
    return BackwardLayout(s[:2], kv[:2], q[:2], kv[2], q[2], kv_elems, (block_m // s[0]) * (block_n // s[1]))


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """A fully resolved kernel: tile shape Br x Bc (block_m x block_n), warps, pipeline depth.

    Forward (direction "fwd"): a block owns block_m query rows and streams K/V in block_n tiles
    through num_stages buffers. fp16/bf16 run on tensor cores (mma.sync m16n8k16), each warp owning
    block_m / num_warps query rows (a multiple of 16); fp32 runs on the SIMT path, (32 * num_warps)
    / block_m threads sharing one query row.
    Backward (direction "bwd", fp16/bf16): a block owns block_n keys, each warp block_n / num_warps
    of them (a multiple of 16), and streams Q/dO in block_m-row tiles through num_stages buffers;
    with head_split > 1 that many blocks share a key block, each keeping dK, dV for a slice of the
    head dim (fewer registers; S and dP are recomputed per slice).
    V's head dim (head_dim_v, the tensor-core forward) may differ from Q and K's: O and the V tiles
    are that wide, and with head_split > 1 that many blocks share a query block, each computing S
    and writing a slice of O's columns (V's wider than 256).
    """

    head_dim: int
    dtype: str
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    causal: bool = False
    direction: str = "fwd"
    head_split: int = 1  # blocks sharing a key block (backward) or query block (forward), a head-dim slice each
    dq: str = "atomic"  # backward: dQ by fp32 atomics in the dK/dV kernel, or by a separate pass
    v_in_regs: bool = False  # backward: each warp keeps its keys' V fragments in registers for dP
    # ---- variants (tensor-core kernels, both directions); all off is plain attention ----
    # Where query i's diagonal sits: key i (top_left, SDPA's is_causal) or key i + seqlen_k - seqlen_q
    # (bottom_right, flash-attn's). It places the causal limit, the window and ALiBi's distances.
    align: str = "top_left"
    window: bool = False    # keys i + diag - left .. i + diag + right (run-time left, right)
    chunk: bool = False     # and only the chunk of keys holding key i + diag (run-time size; FA3's attention_chunk)
    softcap: bool = False   # scores cap * tanh(scale * s / cap) (run-time cap)
    alibi: bool = False     # scores - slope * |i + diag - j| (run-time slopes, per head or batch x head)
    key_bias: bool = False  # scores + bias[batch, j] (fp32, -inf masks the key): SDPA key-padding masks
    varlen: bool = False    # packed sequences: (total, heads, d) with int32 cu_seqlens, one grid z per sequence
    # ---- decode (forward, tensor cores): flash_attn_with_kvcache ----
    # kvcache: batch b's keys are cache rows [leftpad[b], cache_seqlens[b]) of cache batch
    # cache_batch_idx[b]; a run-time `qpack` folds the query heads sharing a K/V head into one
    # block's rows (row r is query r / qpack), so each K/V tile is read once per (batch, kv-head).
    # With varlen the queries are packed (cu_seqlens_q, FlashAttention-3's); the keys stay the cache's.
    kvcache: bool = False
    paged: bool = False     # the cache in pages of a multiple of block_n rows, through an int32 block table
    gather: bool = False    # paged: each key row from its own page (pages of any size, tiles offset by left padding)
    split: bool = False     # the key range split across blocks: fp32 partial O and LSE, merged by <name>_combine
    # ---- V's head dim where it is not head_dim (None: the same; a value equal to head_dim becomes None) ----
    head_dim_v: int | None = None
    # ---- FlashAttention-3's qv (the sm90 forward): scores q . k + q_v . v, q_v as wide as V; each V tile
    # is read once for both products (S's B operand K-major, then P V's MN-major) ----
    qv: bool = False
    # ---- kernel family (see FAMILIES) and the sm90 forward's schedule ----
    # sm90: num_warps counts the consumer warps (4 per warpgroup; 64 query rows each in the forward,
    # block_m = 16 * num_warps; in the backward 64 keys each, block_n = 16 * num_warps, or with
    # num_warps 8 and block_n 64 two sharing those keys, see dkv_split); a producer warpgroup comes
    # on top. Forward only: pingpong, the consumer warpgroups take turns issuing
    # their GEMMs (named barriers); overlap, a warpgroup's softmax of tile j runs under its P V of
    # tile j - 1.
    family: str = "sm80"
    pingpong: bool = False
    overlap: bool = False

    def __post_init__(self) -> None:
        for f in ("head_dim", "block_m", "block_n", "num_warps", "num_stages", "head_split"):
            _require_int(f, getattr(self, f))
        if not isinstance(self.causal, bool):
            raise TypeError(f"KernelConfig.causal: got {self.causal!r}, expected a bool")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"KernelConfig.direction: got {self.direction!r}, expected one of {DIRECTIONS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"KernelConfig.dtype: got {self.dtype!r}, expected one of {DTYPES}")
        d = self.head_dim
        wide = self.head_dim_v not in (None, d) and self.direction == "fwd" and self.tensor_cores
        most = HEAD_DIM_QV_MAX if wide else HEAD_DIM_MAX
        if not (HEAD_DIM_MIN <= d <= most and d % HEAD_DIM_STEP == 0):
            raise ValueError(
                f"KernelConfig.head_dim: got {d}, expected a multiple of {HEAD_DIM_STEP} "
                f"in [{HEAD_DIM_MIN}, {HEAD_DIM_MAX}] ({HEAD_DIM_QV_MAX} in the fp16/bf16 forward beside "
                f"a head_dim_v of its own)"
            )
        for f in ("block_m", "block_n"):
            v = getattr(self, f)
            if not (16 <= v <= 256 and v % 16 == 0):
                raise ValueError(f"KernelConfig.{f}: got {v}, expected a multiple of 16 in [16, 256]")
        if self.num_warps not in (1, 2, 4, 8, 16) and not (self.family == "sm90" and self.num_warps == 12):
            raise ValueError(f"KernelConfig.num_warps: got {self.num_warps}, expected 1, 2, 4, 8 or 16 (family sm90: "
                             f"4, 8 or 12 consumer warps)")
        if not 1 <= self.num_stages <= 4:
            raise ValueError(f"KernelConfig.num_stages: got {self.num_stages}, expected 1..4")
        if self.head_split not in (1, 2, 4, 8):
            raise ValueError(f"KernelConfig.head_split: got {self.head_split}, expected 1, 2, 4 or 8")
        if not isinstance(self.v_in_regs, bool):
            raise TypeError(f"KernelConfig.v_in_regs: got {self.v_in_regs!r}, expected a bool")
        if self.v_in_regs and (self.direction != "bwd" or not self.tensor_cores):
            raise ValueError(f"KernelConfig.v_in_regs: got True for {self.direction} {self.dtype}; only the "
                             f"tensor-core backward keeps V in registers (expected False)")
        if self.dq not in DQ_MODES:
            raise ValueError(f"KernelConfig.dq: got {self.dq!r}, expected one of {DQ_MODES}")
        if self.dq == "pass" and (self.direction != "bwd" or not self.tensor_cores):
            raise ValueError(f"KernelConfig.dq: got 'pass' for {self.direction} {self.dtype}; only the tensor-core "
                             f"backward has a separate dQ pass (expected 'atomic')")
        self._validate_head_dim_v()
        self._validate_variants()
        self._validate_family()
        if self.family == "sm90":
            return
        if self.direction == "bwd":
            self._validate_backward()
        elif self.head_split != 1 and (self.dv_padded % (16 * self.head_split) or not self.tensor_cores):
            raise ValueError(f"KernelConfig.head_split: got {self.head_split} for V's head dim {self.dv} "
                             f"({self.dtype}); the tensor-core forward shares O's columns among head_split blocks in "
                             f"equal whole 16-column slices (expected 1, or such a split)")
        elif self.tensor_cores:
            rows = MMA_M * self.num_warps
            if self.block_m % rows:
                raise ValueError(
                    f"KernelConfig.block_m: got {self.block_m} with {self.num_warps} warps; the tensor-core "
                    f"path needs block_m divisible by 16 * num_warps = {rows}"
                )
        else:
            tpr = self.threads // self.block_m if self.threads >= self.block_m else 0
            if tpr not in (1, 2, 4, 8) or tpr * self.block_m != self.threads:
                raise ValueError(
                    f"KernelConfig (fp32 SIMT path): got block_m={self.block_m} with {self.threads} threads; "
                    f"expected 32 * num_warps / block_m to be 1, 2, 4 or 8 (threads sharing a query row)"
                )
            if self.block_n % tpr or (d // 4) % tpr:
                raise ValueError(
                    f"KernelConfig (fp32 SIMT path): {tpr} threads share a row, so block_n ({self.block_n}) "
                    f"and head_dim / 4 ({d // 4}) must both be multiples of {tpr}"
                )

    def _validate_head_dim_v(self) -> None:
        dv = self.head_dim_v
        if dv is None:
            return
        _require_int("head_dim_v", dv)
        if dv == self.head_dim:
            object.__setattr__(self, "head_dim_v", None)  # one config, one name: equal head dims are the plain kernel
            return
        if not (HEAD_DIM_MIN <= dv <= HEAD_DIM_V_MAX and dv % HEAD_DIM_STEP == 0):
            raise ValueError(f"KernelConfig.head_dim_v: got {dv}, expected a multiple of {HEAD_DIM_STEP} in "
                             f"[{HEAD_DIM_MIN}, {HEAD_DIM_V_MAX}]")
        if not self.tensor_cores or (self.direction != "fwd" and self.family != "sm90"):
            raise ValueError(f"KernelConfig.head_dim_v: got {dv} (head_dim {self.head_dim}) for {self.direction} "
                             f"{self.dtype}; a V head dim of its own is the fp16/bf16 forward's and the sm90 family's "
                             f"backward (family sm80 runs such calls zero-padded to the wider head dim; expected "
                             f"None)")
        if self.o_columns > O_SLICE_MAX:
            raise ValueError(f"KernelConfig.head_dim_v: got {dv} with head_split {self.head_split}; a block's O holds "
                             f"at most {O_SLICE_MAX} columns, expected head_split >= "
                             f"{-(-self.dv_padded // O_SLICE_MAX)}")

    def _validate_variants(self) -> None:
        for f in VARIANTS:
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"KernelConfig.{f}: got {getattr(self, f)!r}, expected a bool")
        if self.align not in ALIGNS:
            raise ValueError(f"KernelConfig.align: got {self.align!r}, expected one of {ALIGNS}")
        on = [f for f in VARIANTS if getattr(self, f)] + (["align bottom_right"] if self.align != "top_left" else [])
        if on and not self.tensor_cores:
            raise ValueError(f"KernelConfig: got {', '.join(on)} for {self.dtype}; the variants run on the fp16/bf16 "
                             f"tensor-core kernels (expected dtype fp16 or bf16)")
        if self.align == "bottom_right" and not (self.causal or self.window or self.alibi):
            raise ValueError("KernelConfig.align: got 'bottom_right' with no causal, window or alibi to place; "
                             "expected 'top_left' (the kernels would be the same)")
        if self.chunk and not self.window:
            raise ValueError("KernelConfig: got chunk without window; a chunk limits a window kernel's band (expected "
                             "window=True, with unbounded run-time sides where the call has no window)")
        if self.window and self.causal:
            raise ValueError("KernelConfig: got causal and window; a window with right = 0 is causal, expected "
                             "window=True, causal=False (the run-time right size carries it)")
        if self.key_bias and self.varlen:
            raise ValueError("KernelConfig: got key_bias and varlen; the key bias is per (batch, key) of a padded "
                             "batch, packed sequences need none (expected one of them)")
        for f in DECODE_SWITCHES:
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"KernelConfig.{f}: got {getattr(self, f)!r}, expected a bool")
        decode = [f for f in DECODE_SWITCHES if getattr(self, f)]
        if decode and (self.direction != "fwd" or not self.tensor_cores):
            raise ValueError(f"KernelConfig: got {', '.join(decode)} for {self.direction} {self.dtype}; the decode "
                             f"switches are the fp16/bf16 forward's (expected direction 'fwd', dtype fp16 or bf16)")
        if (self.paged or self.gather or self.split) and not self.kvcache:
            raise ValueError(f"KernelConfig: got {', '.join(decode)} without kvcache; paging and splitting are "
                             f"switches of the KV-cache kernel (expected kvcache=True)")
        if self.gather and not self.paged:
            raise ValueError("KernelConfig: got gather without paged; it gathers a paged cache's rows (expected "
                             "paged=True)")

    def _validate_family(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"KernelConfig.family: got {self.family!r}, expected one of {FAMILIES}")
        if not isinstance(self.qv, bool):
            raise TypeError(f"KernelConfig.qv: got {self.qv!r}, expected a bool")
        if self.qv and (self.family != "sm90" or self.direction != "fwd"):
            raise ValueError(f"KernelConfig: got qv for family {self.family!r} {self.direction}; qv is a switch of the "
                             f"sm90 forward (expected family 'sm90', direction 'fwd'; elsewhere q and qv run as one "
                             f"product with k and v, their columns appended)")
        for f in ("pingpong", "overlap"):
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"KernelConfig.{f}: got {getattr(self, f)!r}, expected a bool")
        if self.family == "sm80":
            if self.pingpong or self.overlap:
                raise ValueError("KernelConfig: pingpong and overlap are the sm90 family's schedule; got them with "
                                 "family 'sm80' (expected False)")
            return
        what = f"KernelConfig (family sm90, {self.direction} {self.dtype} hd{self.head_dim})"
        if not self.tensor_cores:
            raise ValueError(f"{what}: the sm90 family is fp16/bf16 (expected dtype fp16 or bf16; fp32 runs on family "
                             f"'sm80')")
        if self.head_dim % 16:
            raise ValueError(f"{what}: expected a head dim that is a multiple of 16 (wgmma's k step); others run "
                             f"on family 'sm80', padded")
        # the forward runs a KV cache (dense, in pages of whole key tiles or gathered row by row, split or not)
        off = [f for f in DECODE_SWITCHES if getattr(self, f) and self.direction == "bwd"]
        if self.head_dim_v is not None and max(self.head_dim, self.head_dim_v if self.direction == "bwd" else 0) \
                > HEAD_DIM_MAX:
            raise ValueError(f"{what}: got head_dim_v={self.head_dim_v}; the sm90 family runs V's head dim of its own "
                             f"beside Q and K's of at most {HEAD_DIM_MAX}, in the backward both at most "
                             f"{HEAD_DIM_MAX} (expected None, or family 'sm80')")
        # the forward shares O's columns of a wide V alone
        split_o = self.head_split != 1 and (self.head_dim_v is None or self.direction == "bwd")
        if off or split_o or self.dq != "atomic" or self.v_in_regs:
            raise ValueError(f"{what}: got {', '.join(off) or 'head_split or backward switches'}; the sm90 family "
                             f"takes the variants ({', '.join(VARIANTS)}) forward and backward, a V head dim of its "
                             f"own forward (head_split sharing its columns) and the KV cache (kvcache, paged, gather, "
                             f"split); head_split otherwise, the dQ pass and V in registers run on family 'sm80'")
        if self.direction == "bwd":
            return self._validate_sm90_backward(what)
        if self.dv % 16 or self.o_columns % 16 or self.dv_padded % self.head_split \
                or self.o_columns % (self.swizzle_span // 2):
            raise ValueError(f"{what}: got head_dim_v={self.dv} with head_split {self.head_split}; each block's O "
                             f"columns are the N of a wgmma and whole TMA boxes, expected head_split dividing V's "
                             f"head dim into multiples of 16")
        if self.num_warps not in (4, 8, 12) or self.block_m != 16 * self.num_warps:
            raise ValueError(f"{what}: got block_m={self.block_m} with {self.num_warps} consumer warps; expected 1 to 3 "
                             f"consumer warpgroups of 64 query rows (num_warps 4, 8, 12 and block_m = 16 * num_warps)")
        if self.num_warps == 12 and max(self.head_dim, self.o_columns) > 128:
            raise ValueError(f"{what}: three consumer warpgroups leave 128 registers a thread at entry, too few for the "
                             f"wgmma of O (its columns / 2 accumulators; ptxas C7602); expected head_dim and O's "
                             f"columns <= 128 (FA3 takes three only up to 96)")
        if self.gather and self.num_stages < 2:
            raise ValueError(f"{what}: got gather with {self.num_stages} stage; the producer arrives on a tile's V "
                             f"after copying the next tile's K, so one stage would wait on itself (expected "
                             f"num_stages >= 2)")
        if self.pingpong and self.num_warps == 4:
            raise ValueError(f"{what}: pingpong takes turns between consumer warpgroups; got one (expected num_warps "
                             f"8 or 12, or pingpong False)")

    def _validate_sm90_backward(self, what: str) -> None:
        if self.pingpong or self.overlap:
            raise ValueError(f"{what}: pingpong and overlap are the sm90 forward's schedule (expected False)")
        if self.num_warps not in (4, 8) or self.block_n not in (16 * self.num_warps, 64):
            raise ValueError(f"{what}: got block_n={self.block_n} with {self.num_warps} consumer warps; expected 1 or "
                             f"2 consumer warpgroups of 64 keys (num_warps 4 or 8 and block_n = 16 * num_warps) or "
                             f"two sharing 64 keys (num_warps 8, block_n 64: dkv_split)")
        if not self.dkv_split and self.head_dim + self.dv > 256:
            raise ValueError(f"{what}: got head dims {self.head_dim} (Q, K) and {self.dv} (V) without dkv_split; dK "
                             f"and dV of 64 keys fit a warpgroup's registers up to 256 columns together (head dim "
                             f"128), above that the two warpgroups split them (expected num_warps 8 and block_n 64)")
        if self.dv % 16:
            raise ValueError(f"{what}: got head_dim_v={self.dv}; V's columns are whole wgmma k steps (expected a "
                             f"multiple of 16)")
        if self.dq_columns % 16 or self.block_m % (16 * self.consumer_groups if self.dkv_split else 16):
            raise ValueError(f"{what}: got block_m={self.block_m}; two warpgroups splitting dQ^T's or S^T's query "
                             f"columns take whole k steps of 16 each, expected block_m a multiple of 32")

    def _validate_backward(self) -> None:
        if not self.tensor_cores:
            tpr = self.threads // self.block_n if self.threads >= self.block_n else 0
            if tpr not in (1, 2, 4, 8) or tpr * self.block_n != self.threads or (self.head_dim // 4) % tpr:
                raise ValueError(
                    f"KernelConfig (fp32 SIMT backward): got block_n={self.block_n} with {self.threads} threads and "
                    f"head_dim {self.head_dim}; expected 32 * num_warps / block_n in 1, 2, 4, 8 (threads sharing a "
                    f"key row) and dividing head_dim / 4"
                )
            if self.head_split != 1:
                raise ValueError(f"KernelConfig.head_split: got {self.head_split}; the fp32 backward takes 1")
            return
        slice_cols = self.head_dim_padded // self.head_split
        if self.head_dim_padded % self.head_split or (self.head_split > 1 and not _offsettable(slice_cols // 8)):
            raise ValueError(
                f"KernelConfig.head_split: got {self.head_split} for head_dim {self.head_dim}; each slice must be "
                f"a whole number of 64-column blocks or a power-of-two number of 8-column chunks dividing 64 "
                f"(padded head dim {self.head_dim_padded})"
            )
        self.backward_layout  # raises ValueError when no warp layout fits these tiles
        if self.dq == "pass":
            rows = MMA_M * self.num_warps
            if self.block_m % rows or self.head_split != 1:
                raise ValueError(
                    f"KernelConfig (dQ pass): got block_m={self.block_m}, {self.num_warps} warps, head_split "
                    f"{self.head_split}; the pass gives each warp block_m / num_warps query rows, expected a multiple "
                    f"of 16 (block_m divisible by {rows}) and head_split 1"
                )
            if self.dq_pass_stages == 0:
                raise ValueError(
                    f"KernelConfig (dQ pass): Q, dO and one K, V stage of {self.name} need more shared memory than "
                    f"the dK/dV kernel's {self.smem_bytes} bytes; use block_n <= block_m"
                )

    # ---- derived facts (all pure functions of the fields) ----
    @property
    def backward_layout(self) -> "BackwardLayout":
        """Tensor-core backward: how the warps share each product (see BackwardLayout)."""
        if self.direction != "bwd" or not self.tensor_cores:
            raise ValueError(f"{self.name}: only the tensor-core backward has a warp layout")
        return _backward_layout(self.block_m, self.block_n, self.head_dim_padded // self.head_split, self.num_warps)

    @property
    def name(self) -> str:
        causal = "_causal" if self.causal else ""
        split = f"h{self.head_split}" if self.head_split > 1 else ""
        split += ("_dqpass" if self.dq == "pass" else "") + ("_vregs" if self.v_in_regs else "")
        causal += "_br" if self.align == "bottom_right" else ""
        causal += "".join(f"_{_VARIANT_TAGS[f]}" for f in VARIANTS if getattr(self, f))
        causal += "".join(f"_{_DECODE_TAGS[f]}" for f in DECODE_SWITCHES if getattr(self, f))
        if self.family == "sm90":
            split += "_sm90a" + ("_pp" if self.pingpong else "") + ("_ov" if self.overlap else "")
        dv = (f"_dv{self.head_dim_v}" if self.head_dim_v is not None else "") + ("_qv" if self.qv else "")
        return (
            f"{self.direction}_hd{self.head_dim}{dv}_{self.dtype}{causal}"
            f"_m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}{split}"
        )

    @property
    def symbols(self) -> tuple[str, ...]:
        """The kernels its source defines: the config's name, and for the backward its delta kernel
        (and its dQ pass when dq is "pass")."""
        if self.direction != "bwd":
            return (self.name,) + ((f"{self.name}_combine",) if self.split else ())
        return (self.name, f"{self.name}_delta") + ((f"{self.name}_dq",) if self.dq == "pass" else ())

    @property
    def dq_pass_stages(self) -> int:
        """dQ pass: K/V pipeline stages that fit beside its Q and dO tiles in the dK/dV kernel's
        shared memory (the launch gives both kernels that much): num_stages if they fit, else fewer;
        0 if not even one does."""
        row = self.head_dim_padded * self.elem_bytes
        for stages in range(self.num_stages, 0, -1):
            if 2 * self.block_m * row + 2 * stages * self.block_n * row <= self.smem_bytes:
                return stages
        return 0

    @property
    def variants(self) -> tuple[str, ...]:
        """The variant switches that are on, as VARIANTS names them."""
        return tuple(f for f in VARIANTS if getattr(self, f))

    @property
    def tensor_cores(self) -> bool:
        return self.dtype != "fp32"

    @property
    def threads(self) -> int:
        """Threads a block: its warps (sm90: the consumer warps and a producer warpgroup)."""
        return 32 * self.num_warps + (128 if self.family == "sm90" else 0)

    @property
    def swizzle_span(self) -> int:
        """sm90: bytes a shared-memory tile row is swizzled over: the largest of 128, 64, 32 that
        divides a row of head_dim 16-bit elements (a TMA box and a wgmma column block) and a row of V's
        (in the forward a block's O columns: V's and O's tiles are swizzled alike)."""
        widths = (self.head_dim, self.o_columns)  # the backward's V columns: all of them
        return next(s for s in (128, 64, 32) if all(w * 2 % s == 0 for w in widths))

    @property
    def consumer_groups(self) -> int:
        """sm90: consumer warpgroups (of query rows in the forward, of keys in the backward)."""
        return self.num_warps // 4

    @property
    def dkv_split(self) -> bool:
        """sm90 backward with two consumer warpgroups sharing block_n = 64 keys (num_warps 8): each
        computes S^T and dP^T for half the query tile, and warpgroup 0 accumulates dV^T, warpgroup 1
        dK^T, the head dim along M (FlashAttention-3's dKV_swapAB): half the registers a thread of
        keys-per-warpgroup needs for dK and dV, the way to head dims above 128."""
        return self.family == "sm90" and self.direction == "bwd" and self.num_warps == 8 and self.block_n == 64

    @property
    def head_rows(self) -> int:
        """sm90 backward: Q and K's head dim rounded up to whole rows of 64, the M extent of dQ^T: K's
        tile is that wide, zero past the head dim (with dkv_split dK^T and dV^T run by rows of 64 of the
        wider of Q's and V's head dims, Q's and dO's tiles that wide; see smem_layout)."""
        return _round_up(self.head_dim, 64)

    @property
    def dq_columns(self) -> int:
        """sm90 backward: query columns of a consumer warpgroup's dQ^T tile. dQ^T (head dim x block_m)
        is shared by head-dim rows of 64, and by query columns instead where those rows do not split
        evenly between the warpgroups (head dims 64 and 192, two warpgroups)."""
        rows = self.head_rows // 64
        return self.block_m if rows % self.consumer_groups == 0 else self.block_m // self.consumer_groups

    @property
    def ds_span(self) -> int:
        """sm90 backward: bytes dS^T's rows (queries) are swizzled over: the largest of 128, 64, 32
        that divides a warpgroup's dQ^T columns (and with dkv_split its S^T columns), so each
        warpgroup's operand starts a column block."""
        cols = self.block_m // self.consumer_groups if self.dkv_split else self.dq_columns
        return next(s for s in (128, 64, 32) if self.dq_columns * 2 % s == 0 and cols * 2 % s == 0)

    @property
    def producer_registers(self) -> int:
        """sm90: registers a producer thread keeps after setmaxnreg (SM90_REGISTERS)."""
        return SM90_REGISTERS[self.num_warps // 4][0]

    @property
    def consumer_registers(self) -> int:
        """sm90: registers a consumer thread gets after setmaxnreg (SM90_REGISTERS)."""
        return SM90_REGISTERS[self.num_warps // 4][1]

    @property
    def elem_bytes(self) -> int:
        return ELEM_BYTES[self.dtype]

    @property
    def head_dim_padded(self) -> int:
        """Columns each shared-memory row holds: the mma k extent needs multiples of 16."""
        return _round_up(self.head_dim, MMA_K) if self.tensor_cores else self.head_dim

    @property
    def dv(self) -> int:
        """V's head dim (and O's): head_dim_v, or head_dim."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def dv_padded(self) -> int:
        """V's columns in shared memory, padded as head_dim_padded."""
        return _round_up(self.dv, MMA_K) if self.tensor_cores else self.dv

    @property
    def o_columns(self) -> int:
        """Forward: O's columns one block computes (and of its V tiles): all of V's, or one of
        head_split equal slices."""
        return self.dv_padded // self.head_split if self.direction == "fwd" else self.dv_padded

    @property
    def delta_lanes(self) -> int:
        """The backward's delta kernel (rowsum(dO * O), 128 threads): lanes per query row. On the
        tensor cores 2: a warp computes 16 rows' dO O^T by mma.sync, as dP = dO V^T is computed (a
        query that sees one key then gets dS = 0 exactly). On the SIMT path, each lane takes 16-byte
        chunks of the row: 4 where a row has that many chunks, else the power of two that covers them
        (few lanes per row: the row's address arithmetic and its sum across lanes are shared by fewer
        rows' worth of loads)."""
        if self.tensor_cores:
            return 2
        chunks = self.head_dim * self.elem_bytes // 16
        return min(4, 1 << max(0, chunks - 1).bit_length())

    @property
    def delta_rows(self) -> int:
        """Query rows per block of the backward's delta kernel (128 threads)."""
        return 128 // self.delta_lanes

    @property
    def threads_per_row(self) -> int:
        """SIMT path only: threads cooperating on one query row."""
        return self.threads // self.block_m

    @property
    def smem_layout(self) -> dict[str, int]:
        """Bytes of each shared-memory buffer, in the order the template declares them."""
        row = self.head_dim_padded * self.elem_bytes
        if self.direction == "bwd" and self.family == "sm90":  # tiles 1024-aligned, LSE and delta rows, barriers
            # K's rows padded to head_rows (see head_rows); with dkv_split V's to whole rows of 64 of its own,
            # Q's and dO's to those of the wider head dim (dK^T and dV^T both run by its rows of 64)
            wide = 2 * self.head_rows
            v_row = 2 * _round_up(self.dv, 64) if self.dkv_split else 2 * self.dv
            widest = 2 * _round_up(max(self.head_dim, self.dv), 64)
            q_row, do_row = (widest, widest) if self.dkv_split else (row, 2 * self.dv)
            stages = self.num_stages * self.block_m
            tiles = {"k": self.block_n * wide, "v": self.block_n * v_row, "q": stages * q_row, "dout": stages * do_row,
                     "ds": self.block_m * self.block_n * 2,
                     **({"p": self.block_m * self.block_n * 2} if self.dkv_split else {}),
                     "dq": self.block_m * self.head_rows * 4}
            layout = {k: _round_up(v, 1024) for k, v in tiles.items()}
            rows = 2 * self.num_stages * self.block_m * 4
            layout["lse_delta_barriers"] = _round_up(_round_up(rows, 16) + 8 * (1 + 2 * self.num_stages), 1024)
            return layout
        if self.direction == "bwd":
            return {
                "k": self.block_n * row,
                "v": self.block_n * row,
                "q": self.num_stages * self.block_m * row,
                "dout": self.num_stages * self.block_m * row,
                "ds": self.block_m * self.block_n * self.elem_bytes,
                **({"p": self.block_m * self.block_n * self.elem_bytes} if self.tensor_cores else {}),
                "lse": self.num_stages * self.block_m * 4,
                "delta": self.num_stages * self.block_m * 4,
            }
        o_row = self.o_columns * self.elem_bytes
        v_row = self.dv_padded * self.elem_bytes if self.qv else o_row  # qv: S reads all of V's columns
        layout = {
            "q": self.block_m * max(row, o_row),  # Q's tile, then O's rows staged for the stores
            "k": self.num_stages * self.block_n * row,
            "v": self.num_stages * self.block_n * v_row,
            **({"qv": self.block_m * v_row} if self.qv else {}),
        }
        if self.family == "sm90":  # tiles 1024-aligned (whole periods of the swizzle), then the mbarriers
            layout = {k: _round_up(v, 1024) for k, v in layout.items()}
            layout["barriers"] = _round_up(8 * (1 + 4 * self.num_stages), 1024)
        if not self.tensor_cores:
            layout["p"] = self.block_m * self.block_n * 4
        return layout

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory per block: (Br + 2 * stages * Bc) * d_pad * bytes (+ P on SIMT).

        With one stage this is FlashAttention-2's (Br + 2 Bc) * d * 2 bytes."""
        return sum(self.smem_layout.values())

    # ---- names and serialisation ----
    @classmethod
    def from_name(cls, name: str) -> "KernelConfig":
        m = _NAME_RE.match(name)
        if m is None:
            raise ValueError(
                f"kernel name {name!r} not understood; expected e.g. 'fwd_hd128_bf16_causal_m128n64w4s2'"
            )
        g = m.groupdict()
        ints = {k: int(g[k]) for k in ("head_dim", "block_m", "block_n", "num_warps", "num_stages")}
        ints["head_split"] = int(g["head_split"] or 1)
        if g["head_dim_v"]:
            ints["head_dim_v"] = int(g["head_dim_v"])
        family = {"family": "sm90", "pingpong": bool(g["pingpong"]), "overlap": bool(g["overlap"])} if g["sm90"] else {}
        return cls(direction=g["direction"], dtype=g["dtype"], causal=bool(g["causal"]), **family, qv=bool(g["qv"]),
                   dq="pass" if g["dq_pass"] else "atomic", v_in_regs=bool(g["v_in_regs"]),
                   align="bottom_right" if g["br"] else "top_left", **{f: bool(g[f]) for f in VARIANTS + DECODE_SWITCHES},
                   **ints)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "KernelConfig":
        if not isinstance(data, dict):
            raise TypeError(f"KernelConfig.from_dict: got {type(data).__name__}, expected a dict")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"KernelConfig.from_dict: unknown keys {unknown}; accepted keys {sorted(known)}")
        return cls(**data)

    def replace(self, **changes: Any) -> "KernelConfig":
        return dataclasses.replace(self, **changes)

    def check_fits(self, smem_per_block: int, gpu_name: str = "the GPU") -> None:
        """Raise ValueError when this config needs more shared memory than one block may have."""
        if self.smem_bytes > smem_per_block:
            raise ValueError(
                f"{self.name} needs {self.smem_bytes} bytes of shared memory per block; "
                f"{gpu_name} allows at most {smem_per_block}"
            )
