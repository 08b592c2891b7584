// Host-emulator stand-in for templates/common/wgmma_sm90.cuh: wgmma.fence, mma_async, commit_group and
// wait_group are warpgroup-collective operations of the runtime (runtime/wgmma.h), asynchronous as on
// the GPU: an mma_async's result lands in the accumulators at the wait_group that covers it.
#pragma once
#include <type_traits>

#include "common/mma_sm80.cuh"  // __half, __nv_bfloat16
#include "common/wgmma_desc.cuh"

__forceinline__ void wgmma_fence() { emu::wgmma_fence(); }
__forceinline__ void wgmma_commit() { emu::wgmma_commit(); }
template <int N>
__forceinline__ void wgmma_wait() { emu::wgmma_wait(N); }
template <int R>
inline void wgmma_fence_operand(float (&)[R]) {}
template <int R>
inline void wgmma_fence_operand(uint32_t (&)[R]) {}

__forceinline__ void stmatrix_x4(uint32_t smem_addr, const uint32_t (&r)[4]) { emu::stmatrix_x4(r, smem_addr, false); }
__forceinline__ void stmatrix_x4_trans(uint32_t smem_addr, const uint32_t (&r)[4]) { emu::stmatrix_x4(r, smem_addr, true); }

template <typename T, int N, int TransA, int TransB>
__forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  emu::wgmma(d, N, nullptr, desc_a, desc_b, scale_d != 0, TransA, TransB, std::is_same_v<T, __nv_bfloat16>);
}
template <typename T, int N, int TransB>
__forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  emu::wgmma(d, N, a, 0, desc_b, scale_d != 0, 0, TransB, std::is_same_v<T, __nv_bfloat16>);
}
