// The run-time side of the attention variants, for one (batch, head): which keys a query row sees
// (causal, sliding window, the sequence's end) and what its scores become (softcap, ALiBi, key
// bias). The switches are compile-time (KernelConfig); with all of them off every member folds to
// the plain kernel's arithmetic. Rows and keys are indices within the sequence. Logits are in log2
// units, as the softmax runs in base 2.
#pragma once

#ifndef AUTOFLASH_LOG2E
#define AUTOFLASH_LOG2E 1.4426950408889634f
#endif

// a / b rounded down and up (b > 0). Limits of a bottom-right diagonal or a window may be negative;
// the plain and top-left causal kernels' never are (NONNEG), and take a plain division: a sign
// branch there costs registers ptxas does not have to spare.
template <bool NONNEG>
__device__ __forceinline__ int floor_div(int a, int b) { return NONNEG || a >= 0 ? a / b : -((-a + b - 1) / b); }
template <bool NONNEG>
__device__ __forceinline__ int ceil_div(int a, int b) { return floor_div<NONNEG>(a + b - 1, b); }

// Keys [lo(i), hi(i)) are visible to query row i. Row i's diagonal is key i + diag (0 top-left,
// seqlen_k - seqlen_q bottom-right); causal is the window (unbounded, 0). Unbounded sides arrive
// as sizes >= seqlen_q + seqlen_k, so no sum here overflows. CHUNK (chunked local attention,
// FlashAttention-3's attention_chunk; always inside a window kernel) cuts the keys into chunks of
// `chunk`: row i sees only keys of the chunk holding its diagonal key i + diag, as well as the window.
template <bool CAUSAL, bool WINDOW, bool CHUNK = false>
struct Band {
  int diag, left, right, seqlen_k, chunk;

  static_assert(!CHUNK || WINDOW, "a chunk limits a window kernel's band");
  static constexpr bool UPPER = CAUSAL || WINDOW;  // a limit above the diagonal
  static constexpr bool LOWER = WINDOW;            // ... and below it

  // The first key of the chunk holding key x (x may be negative: a bottom-right diagonal).
  __device__ __forceinline__ int chunk_start(int x) const { return floor_div<false>(x, chunk) * chunk; }

  __device__ __forceinline__ int hi(int i) const {
    if constexpr (CHUNK) return min(seqlen_k, min(i + diag + right + 1, chunk_start(i + diag) + chunk));
    else if constexpr (UPPER) return min(seqlen_k, i + diag + right + 1);
    else return seqlen_k;
  }
  __device__ __forceinline__ int lo(int i) const {
    if constexpr (CHUNK) return max(0, max(i + diag - left, chunk_start(i + diag)));
    else if constexpr (LOWER) return max(0, i + diag - left);
    else return 0;
  }
  // The rows that see key j are [first_row(j), last_row(j)] (not clipped to the sequence's rows):
  // hi and lo never decrease with the row, so hi(i) > j exactly from first_row(j) (UPPER) and
  // lo(i) <= j exactly up to last_row(j) (LOWER). The backward walks a key block's rows by them.
  __device__ __forceinline__ int first_row(int j) const {
    if constexpr (CHUNK) return max(j - diag - right, chunk_start(j) - diag);
    else return j - diag - right;
  }
  __device__ __forceinline__ int last_row(int j) const {
    if constexpr (CHUNK) return min(j - diag + left, chunk_start(j) + chunk - 1 - diag);
    else return j - diag + left;
  }
};

// tanh(x) with the hardware's approximation (MUFU.TANH; relative error about 2^-11, PTX ISA "tanh"),
// as FlashAttention-3's softcap takes it (cutlass::fast_tanh: ScoreMod::capped<true>). The host emulator computes tanhf.
__device__ __forceinline__ float fast_tanh(float x) {
#ifdef AUTOFLASH_HOST_EMULATION
  return tanhf(x);
#else
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#endif
}

// Logits from raw scores s = q . k (fp32 accumulators):
//   plain    s * scale * log2(e)
//   softcap  tanh(s * scale / cap) * cap * log2(e)        (cap_in = scale / cap, cap_out = cap log2 e)
//   ALiBi    - slope * |i + diag - j| * log2(e)            added
//   bias     bias[j] * log2(e)                              added (-inf masks the key)
// With all three switches off (the kernels' SCORE_MOD false) the kernels fold scale * log2(e) into
// their exp2 argument as they always have, and never call logit().
template <bool SOFTCAP, bool ALIBI, bool KEY_BIAS>
struct ScoreMod {
  float scale_log2, cap_in, cap_out, slope_log2;
  const float* bias;  // this batch's row of the key bias (KEY_BIAS)
  int diag;

  // The tanh of a capped score, kept by the backward for the cap's derivative 1 - tanh^2. FAST: the
  // hardware's approximation (the sm90 forward's, as FlashAttention-3's).
  template <bool FAST = false>
  __device__ __forceinline__ float capped(float s) const { return FAST ? fast_tanh(s * cap_in) : tanhf(s * cap_in); }

  // Logit of key j for row i given t, the capped score's tanh (SOFTCAP) or the raw score.
  // CHECKED: j may lie past seqlen_k (masked afterwards), so the bias is not read there.
  template <bool CHECKED>
  __device__ __forceinline__ float logit(float t, int i, int j, int seqlen_k) const {
    float x = SOFTCAP ? t * cap_out : t * scale_log2;
    if constexpr (ALIBI) x -= slope_log2 * fabsf(static_cast<float>(i + diag - j));
    if constexpr (KEY_BIAS) {
      if (!CHECKED || j < seqlen_k) x += bias[j] * AUTOFLASH_LOG2E;
    }
    return x;
  }
};

// One sequence of a call: where its rows start and how many there are. Dense batches have
// offset 0 and the call's lengths; packed (varlen) batches start at cu_seqlens[b] and end at
// seq_end[b]: cu_seqlens[b + 1], or cu_seqlens[b] + seqused[b] where FlashAttention-3's seqused_q /
// seqused_k leave the rest of the span unused (the launcher passes whichever, so no branch here).
template <bool VARLEN>
struct Seq {
  int q_off, k_off, seqlen_q, seqlen_k;

  __device__ __forceinline__ Seq(const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                                 const int* __restrict__ end_q, const int* __restrict__ end_k, int batch,
                                 int max_q, int max_k) {
    if constexpr (VARLEN) {
      q_off = cu_q[batch];
      k_off = cu_k[batch];
      seqlen_q = end_q[batch] - q_off;
      seqlen_k = end_k[batch] - k_off;
    } else {
      q_off = k_off = 0;
      seqlen_q = max_q;
      seqlen_k = max_k;
    }
  }
};
