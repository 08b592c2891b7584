// The synchronisation of sm_90's warp-specialized kernels (PTX ISA 9.7.13.15 mbarrier, 9.7.13.4
// fence.proxy.async, 9.7.13.1 bar.sync / bar.arrive with a thread count, 9.7.19.5 setmaxnreg,
// 9.7.13.8 elect.sync). Addresses are shared-state-space addresses (__cvta_generic_to_shared). The
// host emulator defines the same functions (autoflash/emulation/cuda/common/async_sm90.cuh).
#pragma once
#include "types.cuh"

// An mbarrier (8 bytes, 8-aligned): `count` arrivals complete a phase, once the transaction bytes
// expected of it have also landed.
__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialisation visible to the async proxy (TMA) before the barrier that follows.
__device__ __forceinline__ void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Expects `bytes` more transaction bytes of the current phase (what the TMA copies signalling this
// barrier will complete), and arrives.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Whether the phase of parity `parity` has completed (the current phase: not yet; the one before: yes).
__device__ __forceinline__ bool mbarrier_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  while (!mbarrier_try_wait(bar, parity)) {
  }
}

// Orders this thread's generic-proxy shared-memory writes before async-proxy reads (wgmma, TMA stores).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Named barrier `id` (1..15; 0 is __syncthreads) among `threads` threads (whole warps).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// True in one lane of the warp (all 32 lanes call it).
__device__ __forceinline__ bool elect_one() {
  uint32_t elected;
  asm volatile("{\n.reg .pred p;\nelect.sync _|p, 0xffffffff;\nselp.u32 %0, 1, 0, p;\n}\n" : "=r"(elected));
  return elected != 0;
}

// The warpgroup's registers per thread become N (24..256, a multiple of 8): producers give theirs up,
// consumers take them.
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }

// x, which every lane of the warp holds alike, as the compiler can see it is (lane 0's, by shuffle;
// CUTLASS's canonical_warp_group_idx): what is computed from it stays in uniform registers (the wgmma
// descriptors of a warpgroup) instead of being moved there for every instruction that takes it.
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }
