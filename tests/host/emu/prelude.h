// Host emulation of the CUDA execution model, just enough to run autoflash's generated kernels on
// the CPU: one std::thread per CUDA thread, std::barrier for __syncthreads and for the exchanges
// of warp-synchronous operations (shuffles, ldmatrix, mma). Blocks run one after another, so
// `__shared__` storage can be a function-local static. Force-included before a rendered kernel.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ alignas(128) static

using std::max;
using std::min;

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 gridDim, blockDim;

// One warp's rendezvous: every lane posts up to 8 words, all wait, each reads what it needs, all wait.
struct WarpExchange {
  std::barrier<> bar{32};
  uint64_t slot[32][8];
};
inline std::barrier<>* g_block_barrier = nullptr;
inline std::vector<WarpExchange>* g_warps = nullptr;

inline WarpExchange& my_warp() { return (*g_warps)[threadIdx.x / 32]; }
inline int my_lane() { return threadIdx.x % 32; }

inline void __syncthreads() { g_block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { my_warp().bar.arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float x, int offset) {
  WarpExchange& w = my_warp();
  const int lane = my_lane();
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  w.slot[lane][0] = bits;
  w.bar.arrive_and_wait();
  bits = uint32_t(w.slot[lane ^ offset][0]);
  w.bar.arrive_and_wait();
  float y;
  std::memcpy(&y, &bits, 4);
  return y;
}

// The emulator is built -no-pie, so static shared storage sits below 4 GiB and a 32-bit "shared
// address" is simply the host address.
inline uint32_t __cvta_generic_to_shared(const void* p) { return uint32_t(uintptr_t(p)); }
inline unsigned char* shared_ptr(uint32_t addr) { return reinterpret_cast<unsigned char*>(uintptr_t(addr)); }

#include <atomic>
inline float atomicAdd(float* address, float value) { return std::atomic_ref<float>(*address).fetch_add(value); }
