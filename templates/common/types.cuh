// NVRTC ships no <stdint.h>; this is the one fixed-width type the kernels use. Flag<B> is a bool
// as a type: a loop body written once as a generic lambda is compiled per value (the masked and the
// steady-state loops), where std::integral_constant is not available either; Int<N> an int as one.
#pragma once
typedef unsigned int uint32_t;

template <bool B>
struct Flag { static constexpr bool value = B; };
template <int N>
struct Int { static constexpr int value = N; };

// x, as a value the compiler cannot trace to its definition: what is computed from it is computed
// again where it is used instead of being kept (in registers, or spilled) from where it first was.
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}
