// Host-emulator stand-in for templates/common/async_sm90.cuh: mbarriers and named barriers are the
// runtime's (runtime/mbarrier.h), elect.sync a warp operation, setmaxnreg a warpgroup operation.
#pragma once
#include "common/types.cuh"

__forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) { emu::mbarrier_init(bar, count); }
__forceinline__ void fence_mbarrier_init() {}
__forceinline__ void mbarrier_arrive(uint32_t bar) { emu::mbarrier_arrive(bar, 0); }
__forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) { emu::mbarrier_arrive(bar, bytes); }
__forceinline__ bool mbarrier_try_wait(uint32_t bar, uint32_t parity) { return emu::mbarrier_try_wait(bar, parity); }
__forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  while (!emu::mbarrier_try_wait(bar, parity)) {
  }
}
__forceinline__ void fence_proxy_async() { emu::fence_proxy_async(); }
__forceinline__ void named_barrier_sync(int id, int threads) { emu::named_barrier(id, threads, true); }
__forceinline__ void named_barrier_arrive(int id, int threads) { emu::named_barrier(id, threads, false); }
__forceinline__ bool elect_one() { return emu::elect_one(); }
template <int N>
__forceinline__ void setmaxnreg_inc() { emu::setmaxnreg(N, true); }
template <int N>
__forceinline__ void setmaxnreg_dec() { emu::setmaxnreg(N, false); }
// The emulator holds a value per thread anyway: nothing to make uniform.
__forceinline__ int warp_uniform(int x) { return x; }
