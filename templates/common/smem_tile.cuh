// Swizzled shared-memory tiles, addressed in 16-byte chunks.
//
// A tile of ROWS rows x CHUNKS chunks is stored as column blocks whose widths are the binary digits
// of CHUNKS: as many 8-chunk (128-byte) blocks as fit, then a 4-, 2- and 1-chunk block. Inside a
// block of width W, chunk c of row r lives at c ^ ((r / (8 / W)) % W). Eight consecutive rows at
// one logical chunk then land in eight different 16-byte bank groups, so ldmatrix (8 rows x 16 B
// per matrix) and the cp.async writes are free of bank conflicts, and no byte is padding: the tile
// takes exactly ROWS * CHUNKS * 16 bytes for every head dim (d = 40, 96, 160 ... included).
#pragma once
#include "types.cuh"

template <int W>
__device__ __forceinline__ int swizzle_chunk(int row, int chunk_in_block) {
  static_assert(W == 1 || W == 2 || W == 4 || W == 8, "block widths are 1, 2, 4 or 8 chunks");
  return chunk_in_block ^ ((row / (8 / W)) & (W - 1));
}

// Offset, in chunks, of (row, chunk) in a ROWS x CHUNKS tile. `chunk` is a compile-time constant at
// every call site (unrolled loops), so the block search below folds away.
template <int ROWS, int CHUNKS>
__device__ __forceinline__ int tile_offset(int row, int chunk) {
  constexpr int FULL = CHUNKS / 8 * 8;     // chunks covered by 8-wide blocks
  constexpr int C4 = FULL + (CHUNKS & 4);  // end of the 4-wide block
  constexpr int C2 = C4 + (CHUNKS & 2);    // end of the 2-wide block
  if (chunk < FULL) {
    const int col0 = chunk / 8 * 8;
    return ROWS * col0 + row * 8 + swizzle_chunk<8>(row, chunk - col0);
  } else if (chunk < C4) {
    return ROWS * FULL + row * 4 + swizzle_chunk<4>(row, chunk - FULL);
  } else if (chunk < C2) {
    return ROWS * C4 + row * 2 + swizzle_chunk<2>(row, chunk - C4);
  }
  return ROWS * C2 + row;
}

// One lane's view of a swizzled tile for ldmatrix: the byte address of its row in each block width,
// with the lane's sub-chunk (0 or 1) folded in. Tiles are 128-byte aligned and rows of a W-wide
// block are W * 16 bytes, so the swizzle only touches address bits 4..6 and a chunk is reached by
// one XOR with a constant: no per-chunk address registers stay live across the main loop.
template <int ROWS, int CHUNKS>
struct TileLane {
  static_assert(CHUNKS % 2 == 0, "tiles used with ldmatrix have an even number of chunks");
  uint32_t a8, a4, a2;
  TileLane() = default;
  __device__ __forceinline__ TileLane(uint32_t tile, int row, int sub)
      : a8(tile + row * 128 + (swizzle_chunk<8>(row, sub) << 4)),
        a4(tile + row * 64 + (swizzle_chunk<4>(row, sub) << 4)),
        a2(tile + row * 32 + (swizzle_chunk<2>(row, sub) << 4)) {}
  // The same lane's view of a tile `bytes` further on (a multiple of 128: another pipeline stage).
  // Applied before the XOR in at(), so the per-chunk addresses of a stage are formed from one
  // register instead of every one of them being kept live for each stage.
  __device__ __forceinline__ TileLane shifted(uint32_t bytes) const {
    TileLane t = *this;
    t.a8 += bytes; t.a4 += bytes; t.a2 += bytes;
    return t;
  }
  // The same lane's view with chunk `chunk0` (known only at run time: a warp's share of the
  // columns) as chunk 0. The tile must be all 8-wide blocks, and chunk0 a multiple of the chunks
  // read past it when those are fewer than 8 (a power of two), so the offset's low bits never meet
  // theirs: the swizzle XOR and the block offset then apply to the base once.
  __device__ __forceinline__ TileLane column(int chunk0) const {
    static_assert(CHUNKS % 8 == 0, "run-time column offsets need a tile of 8-chunk blocks");
    TileLane t = *this;
    t.a8 = (a8 ^ ((chunk0 & 7) << 4)) + ROWS * (chunk0 & ~7) * 16;
    return t;
  }
  // Address of even chunk `chunk` (plus the sub-chunk) of row `row + row_add`. Both arguments are
  // compile-time constants; row_add is a multiple of 8, which leaves the swizzle unchanged.
  __device__ __forceinline__ uint32_t at(int chunk, int row_add) const {
    constexpr int FULL = CHUNKS / 8 * 8;
    constexpr int C4 = FULL + (CHUNKS & 4);
    if (chunk < FULL) {
      const int col0 = chunk / 8 * 8;
      return (a8 ^ ((chunk - col0) << 4)) + (ROWS * col0 + row_add * 8) * 16;
    } else if (chunk < C4) {
      return (a4 ^ ((chunk - FULL) << 4)) + (ROWS * FULL + row_add * 4) * 16;
    }
    return (a2 ^ ((chunk - C4) << 4)) + (ROWS * C4 + row_add * 2) * 16;
  }
};

// Visits every (row, chunk) of one column block of width W starting at chunk COL0, spreading them
// over THREADS threads; f(row, chunk, offset) gets the swizzled offset.
template <int ROWS, int CHUNKS, int THREADS, int COL0, int W, typename F>
__device__ __forceinline__ void visit_block(int tid, F&& f) {
  constexpr int N = ROWS * W;
  #pragma unroll
  for (int i = 0; i < (N + THREADS - 1) / THREADS; ++i) {
    const int idx = tid + i * THREADS;
    if (N % THREADS == 0 || idx < N) {
      const int row = idx / W, c = idx % W;
      f(row, COL0 + c, ROWS * COL0 + row * W + swizzle_chunk<W>(row, c));
    }
  }
}

template <int ROWS, int CHUNKS, int THREADS, int BLOCK, typename F>
__device__ __forceinline__ void visit_full_blocks(int tid, F&& f) {
  if constexpr (BLOCK < CHUNKS / 8) {
    visit_block<ROWS, CHUNKS, THREADS, BLOCK * 8, 8>(tid, f);
    visit_full_blocks<ROWS, CHUNKS, THREADS, BLOCK + 1>(tid, f);
  }
}

// Visits every chunk of a ROWS x CHUNKS tile once, block by block, with compile-time block shapes:
// the cooperative loads and stores of Q, K, V and O all go through here.
template <int ROWS, int CHUNKS, int THREADS, typename F>
__device__ __forceinline__ void for_each_chunk(int tid, F&& f) {
  constexpr int FULL = CHUNKS / 8 * 8;
  visit_full_blocks<ROWS, CHUNKS, THREADS, 0>(tid, f);
  if constexpr (CHUNKS & 4) visit_block<ROWS, CHUNKS, THREADS, FULL, 4>(tid, f);
  if constexpr (CHUNKS & 2) visit_block<ROWS, CHUNKS, THREADS, FULL + (CHUNKS & 4), 2>(tid, f);
  if constexpr (CHUNKS & 1) visit_block<ROWS, CHUNKS, THREADS, CHUNKS - 1, 1>(tid, f);
}
