// TMA (PTX ISA 9.7.9.27.1.2 cp.async.bulk.tensor, 9.7.9.27.1.4 commit_group / wait_group): tile copies
// between global and shared memory described by a tensor map, issued by one thread. A load completes
// its bytes on an mbarrier (async_sm90.cuh: arrive.expect_tx the box's bytes, then try_wait); a store
// joins the thread's bulk group, which tma_store_wait<N> waits for. Coordinates are elements, dim 0
// innermost; a load fills elements outside the tensor with zero, a store skips them. The host emulator
// defines the same functions (autoflash/emulation/cuda/common/tma_sm90.cuh).
#pragma once
#include "types.cuh"

// A tensor map as a kernel parameter, `const __grid_constant__ TmaDesc map`: the driver's CUtensorMap
// (128 opaque bytes, 64-aligned; cuTensorMapEncodeTiled fills it, autoflash/kernels/tensor_map.py).
struct alignas(64) TmaDesc { unsigned long long w[16]; };

// The box at `coords` into shared memory at `dst` (128-byte aligned; swizzled as the map says).
template <typename... C>
__device__ __forceinline__ void tma_load(uint32_t dst, const TmaDesc& map, uint32_t bar, C... coords) {
  static_assert(sizeof...(C) >= 2 && sizeof...(C) <= 5, "tma_load: 2 to 5 coordinates");
  const int c[] = {int(coords)...};
  const unsigned long long m = reinterpret_cast<unsigned long long>(&map);
  if constexpr (sizeof...(C) == 2)
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(dst), "l"(m), "r"(c[0]), "r"(c[1]), "r"(bar) : "memory");
  else if constexpr (sizeof...(C) == 3)
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
                 ::"r"(dst), "l"(m), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(bar) : "memory");
  else if constexpr (sizeof...(C) == 4)
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
                 ::"r"(dst), "l"(m), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]), "r"(bar) : "memory");
  else
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n"
                 ::"r"(dst), "l"(m), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]), "r"(c[4]), "r"(bar) : "memory");
}

// The box at `coords` from shared memory at `src` (written through the generic proxy: fence_proxy_async
// and a barrier first). Start coordinates must not be negative.
template <typename... C>
__device__ __forceinline__ void tma_store(const TmaDesc& map, uint32_t src, C... coords) {
  static_assert(sizeof...(C) >= 2 && sizeof...(C) <= 5, "tma_store: 2 to 5 coordinates");
  const int c[] = {int(coords)...};
  const unsigned long long m = reinterpret_cast<unsigned long long>(&map);
  if constexpr (sizeof...(C) == 2)
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%2, %3}], [%1];\n"
                 ::"l"(m), "r"(src), "r"(c[0]), "r"(c[1]) : "memory");
  else if constexpr (sizeof...(C) == 3)
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n"
                 ::"l"(m), "r"(src), "r"(c[0]), "r"(c[1]), "r"(c[2]) : "memory");
  else if constexpr (sizeof...(C) == 4)
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
                 ::"l"(m), "r"(src), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]) : "memory");
  else
    asm volatile("cp.async.bulk.tensor.5d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5, %6}], [%1];\n"
                 ::"l"(m), "r"(src), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]), "r"(c[4]) : "memory");
}

// Non-tensor bulk copies (PTX ISA 9.7.9.25.4): sizes are positive multiples of 16 bytes, addresses
// 16-byte aligned on both sides.
// `bytes` from global `src` into shared memory at `dst`, completing them on mbarrier `bar` (as tma_load).
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// L2 cache policies as a 64-bit cache-hint operand (CUTLASS's CacheHintSm90 encodings of createpolicy).
constexpr unsigned long long L2_EVICT_LAST = 0x14F0000000000000ull;  // keep the lines in L2 ahead of others

// Adds the bytes / 4 floats at shared `src` into global `dst`, element by element (fp32, rounded to
// nearest): FA3's dQ accumulation, with its L2 hint (EVICT_LAST: every key block adds into the same
// dQ rows, so they should stay in L2). Joins the thread's bulk group as a store does; the adds are done
// and visible once a tma_store_wait covers it, and `src` may not be written before a wait (.read or
// not) covers it.
__device__ __forceinline__ void bulk_reduce_add(float* dst, uint32_t src, uint32_t bytes, unsigned long long cache_hint) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.L2::cache_hint.add.f32 [%0], [%1], %2, %3;\n"
               ::"l"(dst), "r"(src), "r"(bytes), "l"(cache_hint) : "memory");
}

// Closes the thread's stores (and reductions) since the last commit into one bulk group.
__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until at most N of the thread's bulk groups are in flight (their writes done and visible).
template <int N>
__device__ __forceinline__ void tma_store_wait() { asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory"); }
// Waits until at most N of the thread's bulk groups still read their shared-memory sources (which may
// then be written again): their global writes may still be in flight. CUTLASS's tma_store_wait. Enough
// before reusing a source, and at exit (the grid's end completes the writes).
template <int N>
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
