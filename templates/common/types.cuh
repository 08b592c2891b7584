// NVRTC ships no <stdint.h>; this is the one fixed-width type the kernels use. Flag<B> is a bool
// as a type: a loop body written once as a generic lambda is compiled per value (the masked and the
// steady-state loops), where std::integral_constant is not available either.
#pragma once
typedef unsigned int uint32_t;

template <bool B>
struct Flag { static constexpr bool value = B; };

// x, as a value the compiler cannot trace to its definition: what is computed from it is computed
// again where it is used instead of being kept (in registers, or spilled) from where it first was.
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// x, which every lane of the warp holds alike, as the compiler can see it is (lane 0's, by shuffle;
// CUTLASS's canonical_warp_group_idx): what is computed from it stays in uniform registers (the sm90
// family's wgmma descriptors) instead of being moved there for every instruction that takes it.
__device__ __forceinline__ int warp_uniform(int x) {
#ifdef AUTOFLASH_HOST_EMULATION  // a value the emulator holds per thread anyway
  return x;
#else
  return __shfl_sync(0xffffffffu, x, 0);
#endif
}
