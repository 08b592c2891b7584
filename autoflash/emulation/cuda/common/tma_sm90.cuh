// Host-emulator stand-in for templates/common/tma_sm90.cuh: TMA loads and stores, and the non-tensor
// bulk loads and reductions, are the runtime's (runtime/tma.h), asynchronous as on the GPU, on the
// tensor maps autoflash/kernels/tensor_map.py encodes for the emulator.
#pragma once
#include "common/types.cuh"

struct alignas(64) TmaDesc { unsigned long long w[16]; };

template <typename... C>
__forceinline__ void tma_load(uint32_t dst, const TmaDesc& map, uint32_t bar, C... coords) {
  static_assert(sizeof...(C) >= 2 && sizeof...(C) <= 5, "tma_load: 2 to 5 coordinates");
  const int32_t c[] = {int32_t(coords)...};
  emu::tma_load(dst, &map, int(sizeof...(C)), c, bar);
}
template <typename... C>
__forceinline__ void tma_store(const TmaDesc& map, uint32_t src, C... coords) {
  static_assert(sizeof...(C) >= 2 && sizeof...(C) <= 5, "tma_store: 2 to 5 coordinates");
  const int32_t c[] = {int32_t(coords)...};
  emu::tma_store(&map, int(sizeof...(C)), c, src);
}
__forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  emu::bulk_load(dst, src, bytes, bar);
}
constexpr unsigned long long L2_EVICT_LAST = 0x14F0000000000000ull;
// The L2 cache hint changes where lines live, not what is added: the emulator has no L2.
__forceinline__ void bulk_reduce_add(float* dst, uint32_t src, uint32_t bytes, unsigned long long cache_hint) {
  (void)cache_hint;
  emu::bulk_reduce_add_f32(dst, src, bytes);
}
__forceinline__ void tma_store_commit() { emu::bulk_commit(); }
template <int N>
__forceinline__ void tma_store_wait() { emu::bulk_wait(N); }
template <int N>
__forceinline__ void tma_store_wait_read() { emu::bulk_wait_read(N); }
