// NVRTC ships no <stdint.h>; this is the one fixed-width type the kernels use. Flag<B> is a bool
// as a type: a loop body written once as a generic lambda is compiled per value (the masked and the
// steady-state loops), where std::integral_constant is not available either.
#pragma once
typedef unsigned int uint32_t;

template <bool B>
struct Flag { static constexpr bool value = B; };
