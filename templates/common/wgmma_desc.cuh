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

// A tile in shared memory as TMA writes it and wgmma reads it: rows of SPAN bytes (BOX 16-bit
// elements) in column blocks, each row swizzled over SPAN (PTX ISA 9.7.15.5.1.2; 5.5.7).
template <int SPAN>
struct SwizzledTile {
  static_assert(SPAN == 128 || SPAN == 64 || SPAN == 32, "a wgmma swizzle span");
  static constexpr int BOX = SPAN / 2;
  static constexpr int SWIZZLE = SPAN == 128 ? WGMMA_SW128 : SPAN == 64 ? WGMMA_SW64 : WGMMA_SW32;
  // Column block c of a tile of `rows` rows starts rows * SPAN bytes after block c - 1.
  static __device__ __forceinline__ uint32_t block_at(uint32_t tile, int rows, int c) { return tile + c * rows * SPAN; }
  // The K-major operand descriptor of a tile's rows from `at` on: rows of SPAN bytes, 8-row groups
  // SBO = 8 SPAN apart. k step ks (16 elements, 32 bytes) starts k_step(rows, ks) bytes further.
  static __device__ __forceinline__ uint64_t k_major(uint32_t at) { return wgmma_desc(at, 16, 8 * SPAN, SWIZZLE); }
  static __device__ constexpr uint32_t k_step(int rows, int ks) {
    return (ks * 32 / SPAN) * rows * SPAN + ks * 32 % SPAN;
  }
  // A tile of `rows` rows read MN-major (its columns along M or N: column blocks LBO = rows SPAN
  // apart, 8-row groups SBO = 8 SPAN apart); k step kk (rows 16 kk ..) starts 16 kk SPAN further.
  static __device__ __forceinline__ uint64_t mn_major(uint32_t at, int rows) {
    return wgmma_desc(at, rows * SPAN, 8 * SPAN, SWIZZLE);
  }
  // The swizzled shared address of element (row, col) of a tile of `rows` rows.
  static __device__ __forceinline__ uint32_t element_at(uint32_t tile, int rows, int row, int col) {
    const uint32_t a = block_at(tile, rows, col / BOX) + row * SPAN + (col % BOX) * 2;
    return a ^ (((a >> 7) & (SPAN / 16 - 1)) << 4);
  }
};

// A descriptor moves with its start address: `bytes` further is desc + bytes / 16 (the address field,
// bits 0-13 in 16-byte units, does not carry within 256 KB of shared memory). Loops add compile-time
// steps to descriptors made once, as CUTLASS's descriptor iterators do.
__device__ constexpr uint64_t moved(uint32_t bytes) { return bytes >> 4; }
