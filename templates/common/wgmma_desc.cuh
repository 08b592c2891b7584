// The 64-bit shared-memory matrix descriptor of wgmma (PTX ISA 9.7.15.5.1.2.2; CuTe GmmaDescriptor):
// the same code on the GPU and under the host emulator.
#pragma once

// Swizzle modes of the descriptor's bits 62-63 (CuTe GMMA::LayoutType).
enum WgmmaSwizzle : int { WGMMA_INTERLEAVE = 0, WGMMA_SW128 = 1, WGMMA_SW64 = 2, WGMMA_SW32 = 3 };

// Start address, leading- and stride-dimension byte offsets (each >> 4, 14 bits), base offset 0 (a
// swizzled tile starts on its pattern's boundary: 1024, 512 or 256 bytes), swizzle mode.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes,
                                               int swizzle) {
  return uint64_t((smem_addr & 0x3FFFF) >> 4) | uint64_t((lbo_bytes >> 4) & 0x3FFF) << 16 |
         uint64_t((sbo_bytes >> 4) & 0x3FFF) << 32 | uint64_t(swizzle & 3) << 62;
}
