// The interface between a kernel compiled for the host emulator and its runtime (runtime.cpp):
// what CUDA's execution model gives a kernel (thread and block indices, barriers, warp-synchronous
// operations, cp.async, atomics, the shared-memory window), as plain C++ calls. The kernel side is
// prelude.h and the common/*.cuh headers beside it; the runtime runs each block's threads as fibers.
#pragma once
#include <cstdint>

struct dim3 { unsigned x = 1, y = 1, z = 1; };

namespace emu {
const dim3& thread_idx();
const dim3& block_idx();
const dim3& grid_dim();
const dim3& block_dim();

void syncthreads();
void syncwarp(unsigned mask);
float shfl_xor(float x, int offset, unsigned mask);
void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr, bool trans);
void stmatrix_x4(const uint32_t (&r)[4], uint32_t smem_addr, bool trans);
void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16);
void cp_async(void* smem_dst, const void* gmem_src, int bytes, bool valid);  // bytes: 4, 8 or 16
void cp_async_commit();
void cp_async_wait(int pending);
float atomic_add(float* address, float value);
// wgmma (sm_90a), collective over the calling thread's warpgroup (runtime/wgmma.h). d: the thread's n/2
// accumulators; a: its 4 A registers (RS), or null with desc_a (SS); trans_*: 1 = MN-major.
void wgmma_fence();
void fence_proxy_async();  // fence.proxy.async: this thread's generic-proxy shared writes reach the async proxy
void wgmma(float* d, int n, const uint32_t* a, uint64_t desc_a, uint64_t desc_b, bool scale_d, int trans_a, int trans_b,
           bool bf16);
void wgmma_commit();
void wgmma_wait(int pending);
// sm_90 synchronisation (runtime/mbarrier.h): mbarriers by shared address; named barriers; elect.sync;
// setmaxnreg (collective over the warpgroup).
void mbarrier_init(uint32_t bar, uint32_t count);
void mbarrier_arrive(uint32_t bar, uint32_t expect_tx_bytes);
bool mbarrier_try_wait(uint32_t bar, uint32_t parity);
void named_barrier(int id, int threads, bool wait);
bool elect_one();
void setmaxnreg(int regs, bool inc);
uint32_t cvta_shared(const void* p);
// TMA (runtime/tma.h) on a tensor map's 128 bytes: a tile load into shared memory that completes
// transaction bytes on an mbarrier; a tile store from shared memory, in the thread's bulk groups.
void tma_load(uint32_t dst, const void* tmap, int rank, const int32_t* coords, uint32_t bar);
void tma_store(const void* tmap, int rank, const int32_t* coords, uint32_t src);
// Non-tensor bulk copies (runtime/tma.h): `bytes` from global memory into shared memory, completing
// on an mbarrier; fp32 adds from shared memory into global memory, in the thread's bulk groups.
void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar);
void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes);
void bulk_commit();
void bulk_wait(int pending);
void bulk_wait_read(int pending);
}  // namespace emu

// The launch ABI (one entry per kernel, generated at build time by EMU_KERNEL in register.h):
// entry(args) calls the kernel with args[i] pointing at the i-th argument's bytes.
extern "C" {
typedef void (*emu_entry_t)(void** args);
}
