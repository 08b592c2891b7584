// Host-emulator stand-in for templates/common/mma_sm80.cuh: ldmatrix and mma.sync.m16n8k16 are
// warp-collective operations of the runtime (written from the PTX ISA's fragment layouts); the 16-bit
// types and their round-to-nearest-even conversions are plain C++ here.
#pragma once
#include "common/types.cuh"

struct __half { uint16_t bits; };
struct __nv_bfloat16 { uint16_t bits; };

inline float bf16_to_float(uint16_t h) { uint32_t u = uint32_t(h) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline float f16_to_float(uint16_t h) { _Float16 x; std::memcpy(&x, &h, 2); return float(x); }
inline uint16_t float_to_bf16(float f) {  // round to nearest even, as __floats2bfloat162_rn
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline uint16_t float_to_f16(float f) { _Float16 x = _Float16(f); uint16_t h; std::memcpy(&h, &x, 2); return h; }

__forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) { emu::ldmatrix_x4(r, addr, false); }
__forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) { emu::ldmatrix_x4(r, addr, true); }
__forceinline__ void mma_16816_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) { emu::mma_16816(d, a, b0, b1, false); }
__forceinline__ void mma_16816_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) { emu::mma_16816(d, a, b0, b1, true); }

inline uint32_t pack_f16x2(float lo, float hi) { return float_to_f16(lo) | uint32_t(float_to_f16(hi)) << 16; }
inline uint32_t pack_bf16x2(float lo, float hi) { return float_to_bf16(lo) | uint32_t(float_to_bf16(hi)) << 16; }

// Two 16-bit values of one register -> fp32, lo from the low half (the inverse of pack_*x2).
template <typename T> inline void unpack_pair(uint32_t packed, float& lo, float& hi);
template <> inline void unpack_pair<__half>(uint32_t packed, float& lo, float& hi) {
  lo = f16_to_float(uint16_t(packed));
  hi = f16_to_float(uint16_t(packed >> 16));
}
template <> inline void unpack_pair<__nv_bfloat16>(uint32_t packed, float& lo, float& hi) {
  lo = bf16_to_float(uint16_t(packed));
  hi = bf16_to_float(uint16_t(packed >> 16));
}

inline float to_float(float x) { return x; }
inline float to_float(__half x) { return f16_to_float(x.bits); }
inline float to_float(__nv_bfloat16 x) { return bf16_to_float(x.bits); }
template <typename T> inline T from_float(float x);
template <> inline __half from_float<__half>(float x) { return {float_to_f16(x)}; }
template <> inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return {float_to_bf16(x)}; }
