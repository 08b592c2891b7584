// NVRTC ships no <stdint.h>; this is the one fixed-width type the kernels use.
#pragma once
typedef unsigned int uint32_t;
