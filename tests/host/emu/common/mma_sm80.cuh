// Host emulation of ldmatrix and mma.sync.m16n8k16, written from the PTX ISA's fragment layouts:
// lane l, g = l / 4, q = l % 4. ldmatrix: lanes 8i..8i+7 give the row addresses of matrix i and
// register i of lane l receives row g, columns 2q, 2q+1 (transposed: rows 2q, 2q+1 of column g).
// mma A (16x16): reg 0 (g, 2q..), reg 1 (g+8, 2q..), reg 2 (g, 2q+8..), reg 3 (g+8, 2q+8..);
// B (16x8): b0 (k 2q.., n g), b1 (k 2q+8.., n g); C/D: d0,d1 (g, 2q..), d2,d3 (g+8, 2q..).
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

inline uint32_t pack_f16x2(float lo, float hi) { return float_to_f16(lo) | uint32_t(float_to_f16(hi)) << 16; }
inline uint32_t pack_bf16x2(float lo, float hi) { return float_to_bf16(lo) | uint32_t(float_to_bf16(hi)) << 16; }

inline uint16_t load_u16(uint32_t addr) { uint16_t v; std::memcpy(&v, shared_ptr(addr), 2); return v; }

inline void ldmatrix_x4_impl(uint32_t (&r)[4], uint32_t addr, bool trans) {
  WarpExchange& w = my_warp();
  const int lane = my_lane(), g = lane / 4, q = lane % 4;
  w.slot[lane][0] = addr;
  w.bar.arrive_and_wait();
  for (int i = 0; i < 4; ++i) {
    uint16_t lo, hi;
    if (!trans) {
      const uint32_t row = uint32_t(w.slot[8 * i + g][0]);
      lo = load_u16(row + 4 * q);
      hi = load_u16(row + 4 * q + 2);
    } else {
      lo = load_u16(uint32_t(w.slot[8 * i + 2 * q][0]) + 2 * g);
      hi = load_u16(uint32_t(w.slot[8 * i + 2 * q + 1][0]) + 2 * g);
    }
    r[i] = lo | uint32_t(hi) << 16;
  }
  w.bar.arrive_and_wait();
}
inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) { ldmatrix_x4_impl(r, addr, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) { ldmatrix_x4_impl(r, addr, true); }

template <float (*TO_FLOAT)(uint16_t)>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  WarpExchange& w = my_warp();
  const int lane = my_lane(), g = lane / 4, q = lane % 4;
  for (int i = 0; i < 4; ++i) w.slot[lane][i] = a[i];
  w.slot[lane][4] = b0;
  w.slot[lane][5] = b1;
  w.bar.arrive_and_wait();
  auto half = [](uint64_t reg, int k) { return uint16_t(k % 2 ? reg >> 16 : reg & 0xffff); };
  auto A = [&](int row, int k) {
    return TO_FLOAT(half(w.slot[(row % 8) * 4 + (k % 8) / 2][(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k));
  };
  auto B = [&](int k, int n) { return TO_FLOAT(half(w.slot[n * 4 + (k % 8) / 2][k >= 8 ? 5 : 4], k)); };
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * q + (i & 1);
    float acc = d[i];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    d[i] = acc;
  }
  w.bar.arrive_and_wait();
}
inline void mma_16816_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) { mma_16816<f16_to_float>(d, a, b0, b1); }
inline void mma_16816_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) { mma_16816<bf16_to_float>(d, a, b0, b1); }

inline float to_float(float x) { return x; }
inline float to_float(__half x) { return f16_to_float(x.bits); }
inline float to_float(__nv_bfloat16 x) { return bf16_to_float(x.bits); }
template <typename T> inline T from_float(float x);
template <> inline __half from_float<__half>(float x) { return {float_to_f16(x)}; }
template <> inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return {float_to_bf16(x)}; }
