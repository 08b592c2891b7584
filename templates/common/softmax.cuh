// Pieces of the online softmax shared by both paths: base-2 exponent and row reductions across the
// threads that hold one row.
#pragma once

#ifndef INFINITY  // NVRTC has no <math.h> macros
#define INFINITY __int_as_float(0x7f800000)
#endif

// 2^x with the hardware's approximate exp2 (MUFU.EX2); ex2.approx(-inf) is +0, which masked scores
// rely on. The softmax runs in base 2 with log2(e) folded into the scale: exp(x) = 2^(x * log2 e).
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef AUTOFLASH_HOST_EMULATION  // tests/host/emu runs the kernels on the CPU
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#endif
}

// Max / sum over the LANES consecutive lanes that share a row (LANES a power of two <= 32).
template <int LANES>
__device__ __forceinline__ float group_max(float x) {
  #pragma unroll
  for (int off = LANES / 2; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

template <int LANES>
__device__ __forceinline__ float group_sum(float x) {
  #pragma unroll
  for (int off = LANES / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Running-max bookkeeping: while a row has seen only masked scores its max is -inf; subtracting 0
// instead keeps exp2(-inf - -inf) from turning into NaN.
__device__ __forceinline__ float safe_max(float m) { return m == -INFINITY ? 0.f : m; }

// Final normalisation: a row that saw no key gets O = 0 and LSE = +inf, so a backward pass that
// recomputes P = exp(S - LSE) gets 0 there, never NaN. m is in log2 units (already scaled).
__device__ __forceinline__ float row_inv_sum(float l) { return l > 0.f ? 1.f / l : 0.f; }
__device__ __forceinline__ float row_lse(float m_log2, float l) {
  return l > 0.f ? (m_log2 + log2f(l)) * 0.69314718055994531f /* ln 2 */ : INFINITY;
}
