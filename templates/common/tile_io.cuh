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

// One thread's share of copying ROWS-row tiles of one (seqlen, head_dim) matrix into swizzled
// shared memory, for the tiles a main loop streams. The thread's first source chunk (row 0) is
// computed once, here; a tile copy is then that pointer moved to the tile, advanced by a constant
// number of rows between the thread's chunks, and cp.async with compile-time shared-memory offsets.
// Full tiles (`copy<false>`) carry no bounds logic at all. Only one 64-bit pointer stays live: the
// row stride is a kernel argument (constant bank), so steps derived from it cost no registers.
template <int ROWS, int CHUNKS, int VALID_CHUNKS, int THREADS, typename T>
struct TileCopy {
  static constexpr int CHUNK_ELEMS = 16 / sizeof(T);
  static constexpr int FULL = CHUNKS / 8 * 8;     // chunks in 8-wide blocks, then 4, 2, 1
  static constexpr int C4 = FULL + (CHUNKS & 4);
  static constexpr int C2 = C4 + (CHUNKS & 2);
  // The block width whose thread mapping `src` follows: 8 when the tile has an 8-wide block.
  static constexpr int W0 = FULL ? 8 : (CHUNKS & 4) ? 4 : (CHUNKS & 2) ? 2 : 1;
  const T* base;       // row 0 of the matrix
  const T* src;        // this thread's first chunk in row 0, in W0-wide blocks
  long long stride;    // elements between rows
  int tid;

  __device__ __forceinline__ TileCopy(const T* base_, long long stride_, int tid_)
      : base(base_), src(base_ + (tid_ / W0) * stride_ + (tid_ % W0) * CHUNK_ELEMS), stride(stride_), tid(tid_) {}

  // Starts the copy of rows [row0, row0 + ROWS). CHECK: rows at or past `rows` are zero-filled
  // (the ragged last tile); without it every row must exist.
  template <bool CHECK>
  __device__ __forceinline__ void copy(uint4* tile, int row0, int rows) const {
    copy_at<CHECK>(tile, row0 * stride, rows - row0);
  }

  // The same from a tile whose first row sits `shift` elements past row 0 (a page of a paged
  // cache), `rows_left` of its rows existing.
  template <bool CHECK>
  __device__ __forceinline__ void copy_at(uint4* tile, long long shift, int rows_left) const {
    copy_full_blocks<CHECK, 0>(tile, shift, rows_left);
    if constexpr (CHUNKS & 4) copy_block<CHECK, 4, FULL>(tile, shift, rows_left);
    if constexpr (CHUNKS & 2) copy_block<CHECK, 2, C4>(tile, shift, rows_left);
    if constexpr (CHUNKS & 1) copy_block<CHECK, 1, C2>(tile, shift, rows_left);
  }

  // A tile that may be ragged: one uniform branch, then the copy without per-chunk row checks
  // when the whole tile exists.
  __device__ __forceinline__ void copy_any(uint4* tile, int row0, int rows) const {
    if (row0 + ROWS <= rows) copy<false>(tile, row0, rows);
    else copy<true>(tile, row0, rows);
  }
  __device__ __forceinline__ void copy_any_at(uint4* tile, long long shift, int rows_left) const {
    if (ROWS <= rows_left) copy_at<false>(tile, shift, rows_left);
    else copy_at<true>(tile, shift, rows_left);
  }

  // The same gathered row by row: tile row r starts row_shift(r) elements past row 0 (a paged
  // cache's rows, each in its own page, as FlashAttention-3's cp.async gathers); rows at or past
  // rows_left are zero-filled. A thread copies the same rows in every 8-chunk block, so it looks
  // their places up once, before the copies (the cp.async between would keep the compiler from
  // reusing them); the narrower blocks past them look up each chunk's row.
  template <typename RowShift>
  __device__ __forceinline__ void gather(uint4* tile, const RowShift& row_shift, int rows_left) const {
    constexpr int ROW_STEP = THREADS / 8, N_ROWS = (ROWS * 8 + THREADS - 1) / THREADS;
    static_assert(THREADS % 8 == 0, "threads in whole 8-chunk rows");
    const int r0 = tid / 8, c0 = tid % 8;
    if constexpr (FULL > 0) {
      long long shift[N_ROWS];
      #pragma unroll
      for (int i = 0; i < N_ROWS; ++i) {
        const int row = r0 + i * ROW_STEP;
        shift[i] = row < ROWS && row < rows_left ? row_shift(row) : 0;
      }
      #pragma unroll
      for (int b = 0; b < FULL / 8; ++b)
        #pragma unroll
        for (int i = 0; i < N_ROWS; ++i) {
          const int row = r0 + i * ROW_STEP, c = b * 8 + c0;
          if (ROWS * 8 % THREADS == 0 || row < ROWS) {
            const bool valid = row < rows_left && c < VALID_CHUNKS;
            cp_async_16(tile + ROWS * b * 8 + row * 8 + swizzle_chunk<8>(row, c0),
                        valid ? base + shift[i] + c * CHUNK_ELEMS : base, valid);
          }
        }
    }
    auto narrow = [&](int r, int c, int off) {
      const bool valid = r < rows_left && c < VALID_CHUNKS;
      cp_async_16(tile + off, valid ? base + row_shift(r) + c * CHUNK_ELEMS : base, valid);
    };
    if constexpr (CHUNKS & 4) visit_block<ROWS, CHUNKS, THREADS, FULL, 4>(tid, narrow);
    if constexpr (CHUNKS & 2) visit_block<ROWS, CHUNKS, THREADS, C4, 2>(tid, narrow);
    if constexpr (CHUNKS & 1) visit_block<ROWS, CHUNKS, THREADS, C2, 1>(tid, narrow);
  }

 private:
  template <bool CHECK, int BLOCK>
  __device__ __forceinline__ void copy_full_blocks(uint4* tile, long long shift, int rows_left) const {
    if constexpr (BLOCK < CHUNKS / 8) {
      copy_block<CHECK, 8, BLOCK * 8>(tile, shift, rows_left);
      copy_full_blocks<CHECK, BLOCK + 1>(tile, shift, rows_left);
    }
  }

  // The column block of width W starting at chunk COL0: thread t copies chunk COL0 + t % W of rows
  // t / W, t / W + THREADS / W, ...
  template <bool CHECK, int W, int COL0>
  __device__ __forceinline__ void copy_block(uint4* tile, long long shift, int rows_left) const {
    constexpr int N = ROWS * W;                 // chunks in the block
    constexpr int ROW_STEP = THREADS / W;
    // The swizzle repeats every 8 rows: with a row step that is a multiple of 8 it is the same for
    // all of this thread's chunks, and their shared-memory offsets differ by constants.
    constexpr bool SAME_SWIZZLE = ROW_STEP % 8 == 0;
    const int r0 = tid / W, c = tid % W;
    const bool col_ok = VALID_CHUNKS == CHUNKS || COL0 + c < VALID_CHUNKS;
    const T* p = (W == W0 ? src : base + r0 * stride + c * CHUNK_ELEMS) + shift + COL0 * CHUNK_ELEMS;
    #pragma unroll
    for (int i = 0; i < (N + THREADS - 1) / THREADS; ++i) {
      if (N % THREADS == 0 || tid + i * THREADS < N) {
        const int row = r0 + i * ROW_STEP;
        const int off = ROWS * COL0 + row * W + swizzle_chunk<W>(SAME_SWIZZLE ? r0 : row, c);
        const bool valid = col_ok && (!CHECK || row < rows_left);
        if (CHECK || VALID_CHUNKS != CHUNKS) cp_async_16(tile + off, valid ? p : base, valid);
        else cp_async_16_full(tile + off, p);
      }
      p += ROW_STEP * stride;
    }
  }
};

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

// Zeroes rows [row0, min(row0 + ROWS, rows)) and chunks [0, c_hi) of a (seqlen, d) matrix: the
// output of rows that see no key, written without staging.
template <int ROWS, int CHUNKS, int THREADS, typename T>
__device__ __forceinline__ void zero_rows(T* __restrict__ base, long long row_stride, int row0, int rows, int tid,
                                          int c_hi) {
  constexpr int CHUNK_ELEMS = 16 / sizeof(T);
  for (int i = tid; i < ROWS * CHUNKS; i += THREADS) {
    const int r = i / CHUNKS, c = i % CHUNKS;
    if (row0 + r < rows && c < c_hi)
      *reinterpret_cast<uint4*>(base + (row0 + r) * row_stride + c * CHUNK_ELEMS) = uint4{0u, 0u, 0u, 0u};
  }
}

// Writes one lane's pair of fp32 accumulators (columns 2q, 2q+1 of an n8 tile, already packed into
// two 16-bit values) into row `row`, chunk `chunk` of a staged tile.
template <int ROWS, int CHUNKS>
__device__ __forceinline__ void stage_pair(uint4* tile, int row, int chunk, int lane, uint32_t packed) {
  reinterpret_cast<uint32_t*>(&tile[tile_offset<ROWS, CHUNKS>(row, chunk)])[lane & 3] = packed;
}
