// Cooperative tile transfers between global memory and the swizzled shared-memory tiles of
// smem_tile.cuh: rows of a (seqlen, head_dim) matrix with a runtime row stride, 16-byte chunks.
#pragma once
// Through the include path (not this folder), so tests/host/emu can stand in for cp_async.cuh.
#include "common/cp_async.cuh"
#include "common/smem_tile.cuh"

// Starts loading rows [row0, row0 + ROWS) into `tile` (cp.async; the caller commits and waits).
// Rows past `rows` and chunks past VALID_CHUNKS (head-dim padding) are zero-filled.
template <int ROWS, int CHUNKS, int VALID_CHUNKS, int THREADS, typename T>
__device__ __forceinline__ void load_tile(uint4* tile, const T* __restrict__ base, long long row_stride,
                                          int row0, int rows, int tid) {
  constexpr int CHUNK_ELEMS = 16 / sizeof(T);
  for_each_chunk<ROWS, CHUNKS, THREADS>(tid, [&](int r, int c, int off) {
    const bool valid = row0 + r < rows && c < VALID_CHUNKS;
    const T* src = valid ? base + (row0 + r) * row_stride + c * CHUNK_ELEMS : base;
    cp_async_16(tile + off, src, valid);
  });
}

// Stores rows [row0, min(row0 + ROWS, rows)) and chunks [c_lo, c_hi) of a staged tile.
template <int ROWS, int CHUNKS, int THREADS, typename T>
__device__ __forceinline__ void store_tile(const uint4* tile, T* __restrict__ base, long long row_stride,
                                           int row0, int rows, int tid, int c_lo, int c_hi) {
  constexpr int CHUNK_ELEMS = 16 / sizeof(T);
  for_each_chunk<ROWS, CHUNKS, THREADS>(tid, [&](int r, int c, int off) {
    if (row0 + r < rows && c >= c_lo && c < c_hi)
      *reinterpret_cast<uint4*>(base + (row0 + r) * row_stride + c * CHUNK_ELEMS) = tile[off];
  });
}

// Writes one lane's pair of fp32 accumulators (columns 2q, 2q+1 of an n8 tile, already packed into
// two 16-bit values) into row `row`, chunk `chunk` of a staged tile.
template <int ROWS, int CHUNKS>
__device__ __forceinline__ void stage_pair(uint4* tile, int row, int chunk, int lane, uint32_t packed) {
  reinterpret_cast<uint32_t*>(&tile[tile_offset<ROWS, CHUNKS>(row, chunk)])[lane & 3] = packed;
}
