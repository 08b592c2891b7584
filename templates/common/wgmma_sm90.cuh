// Warpgroup-level tensor-core primitives of sm_90a (PTX ISA 9.7.15: wgmma.fence / commit_group /
// wait_group, the 64-bit shared-memory matrix descriptor). The wgmma.mma_async instruction itself names
// its N/2 accumulator registers one by one, so a kernel template spells it for the shapes it uses
// (templates/common/wgmma.j2) as specializations of the declarations below; the host emulator defines
// these functions instead (autoflash/emulation/cuda/common/wgmma_sm90.cuh).
#pragma once
#include "types.cuh"
typedef unsigned long long uint64_t;
#include "wgmma_desc.cuh"

// Orders this thread's register accesses before the warpgroup's next wgmma (required before the first,
// and after the accumulators or A fragments were touched).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
// Closes the wgmmas issued since the last commit into one group.
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N groups are in flight; their accumulators are then the thread's to read.
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Pins registers in place around a wgmma batch: the wait has no register operands, so without this
// the compiler may move accumulator accesses across it (CuTe's warpgroup_fence_operand).
template <int R>
__device__ __forceinline__ void wgmma_fence_operand(float (&r)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int R>
__device__ __forceinline__ void wgmma_fence_operand(uint32_t (&r)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// Four 8x8 16-bit matrices to shared memory (the inverse of ldmatrix_x4: lanes 8i..8i+7 give the row
// addresses of matrix i, register i holds it, lane l row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1);
// _trans stores each transposed. The epilogue's way from accumulators to a tile (PTX 9.7.9.x stmatrix).
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t smem_addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// D (64 x N, fp32, N/2 registers a thread) = A (64 x 16) * B (N x 16)^T + (scale_d ? D : 0), A and B
// of element type T (__half or __nv_bfloat16) in shared memory through descriptors (SS) or A in
// registers (RS: 4 registers a thread, K-major); TransA / TransB: 0 K-major, 1 MN-major. Fragments
// (thread t of the warpgroup, w = t / 32, g = t % 32 / 4, q = t % 4): d[i] is row 16w + g + 8 ((i / 2) % 2),
// column 8 (i / 4) + 2q + i % 2; a's halves i the same rows, k = 8 (i / 4) + 2q + i % 2.
template <typename T, int N, int TransA, int TransB>
__device__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d);
template <typename T, int N, int TransB>
__device__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, int scale_d);
