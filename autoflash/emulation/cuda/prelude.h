// Force-included before a rendered autoflash kernel when it is built for the host emulator: the CUDA
// keywords and built-ins the templates use, mapped onto runtime.h. The kernel source itself is the
// very text NVRTC compiles for the GPU; only these definitions differ.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "runtime.h"

#define __global__
#define __device__
#define __host__
#define __grid_constant__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Dynamic shared memory (`extern __shared__ unsigned char smem_raw[]`) is the running block's
// window, one per worker thread (runtime.cpp defines it); every block of a worker starts poisoned.
#define __shared__ thread_local

#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::block_idx())
#define gridDim (::emu::grid_dim())
#define blockDim (::emu::block_dim())

using std::max;
using std::min;

// The vector types copy member by member. GCC's ThreadSanitizer instrumentation, which the sanitizer's
// shared- and global-memory checks ride on, leaves a whole-struct copy (an 8- or 16-byte load or store
// through a float2* or uint4*) unreported; member by member, each 4-byte access is seen.
struct alignas(16) uint4 {
  unsigned x, y, z, w;
  uint4() = default;
  constexpr uint4(unsigned x_, unsigned y_, unsigned z_, unsigned w_) : x(x_), y(y_), z(z_), w(w_) {}
  uint4(const uint4& o) : x(o.x), y(o.y), z(o.z), w(o.w) {}
  uint4& operator=(const uint4& o) { x = o.x; y = o.y; z = o.z; w = o.w; return *this; }
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
struct alignas(16) float4 {
  float x, y, z, w;
  float4() = default;
  constexpr float4(float x_, float y_, float z_, float w_) : x(x_), y(y_), z(z_), w(w_) {}
  float4(const float4& o) : x(o.x), y(o.y), z(o.z), w(o.w) {}
  float4& operator=(const float4& o) { x = o.x; y = o.y; z = o.z; w = o.w; return *this; }
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct alignas(8) float2 {
  float x, y;
  float2() = default;
  constexpr float2(float x_, float y_) : x(x_), y(y_) {}
  float2(const float2& o) : x(o.x), y(o.y) {}
  float2& operator=(const float2& o) { x = o.x; y = o.y; return *this; }
};
inline float2 make_float2(float x, float y) { return {x, y}; }

__forceinline__ void __syncthreads() { emu::syncthreads(); }
__forceinline__ void __syncwarp(unsigned mask = 0xffffffffu) { emu::syncwarp(mask); }
__forceinline__ float __shfl_xor_sync(unsigned mask, float x, int offset) { return emu::shfl_xor(x, offset, mask); }
__forceinline__ uint32_t __cvta_generic_to_shared(const void* p) { return emu::cvta_shared(p); }
__forceinline__ float atomicAdd(float* address, float value) { return emu::atomic_add(address, value); }
