// Host-emulator stand-in for templates/common/cp_async.cuh (found first on the include path): the
// same functions, carried out by the runtime. Copies are queued per thread in commit groups and land
// only when cp.async.wait_group lets them, so a kernel that reads a tile too early reads stale data.
#pragma once
#include "common/types.cuh"

__forceinline__ uint32_t smem_u32(const void* p) { return __cvta_generic_to_shared(p); }
__forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) { emu::cp_async(smem_dst, gmem_src, 16, valid); }
__forceinline__ void cp_async_16_full(void* smem_dst, const void* gmem_src) { emu::cp_async(smem_dst, gmem_src, 16, true); }
__forceinline__ void cp_async_4(void* smem_dst, const void* gmem_src, bool valid) { emu::cp_async(smem_dst, gmem_src, 4, valid); }
__forceinline__ void cp_async_commit() { emu::cp_async_commit(); }
template <int N>
__forceinline__ void cp_async_wait() { emu::cp_async_wait(N); }
