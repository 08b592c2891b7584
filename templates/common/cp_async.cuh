// Asynchronous global -> shared copies (sm_80+): 16 bytes per thread, zero-filled when out of
// bounds, grouped with commit_group / wait_group so K/V tiles stream in while the tensor cores work.
#pragma once
#include "types.cuh"

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Copies 16 bytes, or writes 16 zero bytes when !valid (src-size 0): padded rows and head-dim
// columns must read as 0, never as stale shared memory (0 * NaN would poison the output).
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(smem_u32(smem_dst)), "l"(gmem_src), "r"(src_bytes));
}

// Copies 16 bytes that are known to exist: no source-size operand, no predicate.
__device__ __forceinline__ void cp_async_16_full(void* smem_dst, const void* gmem_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(smem_u32(smem_dst)), "l"(gmem_src));
}

// Copies 4 bytes (an fp32 row statistic), or writes 4 zero bytes when !valid. .ca: 4-byte copies
// go through L1 (.cg takes only 16).
__device__ __forceinline__ void cp_async_4(void* smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
               :: "r"(smem_u32(smem_dst)), "l"(gmem_src), "r"(src_bytes));
}

// Closes the current group of copies; an empty group is legal and keeps the group count uniform.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most N of the committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }
