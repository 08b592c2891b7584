// Host-side check of templates/common/smem_tile.cuh: the real header, compiled by g++ with the
// CUDA qualifiers defined away. For a tile shape given on the command line it checks that
//   1. for_each_chunk visits every (row, chunk) exactly once and its offsets are a bijection onto
//      [0, ROWS * CHUNKS) that agrees with tile_offset;
//   2. TileLane::at(chunk, row_add) (+ the lane's sub-chunk) is tile_offset of the same element;
//   3. every ldmatrix phase (8 rows at one chunk) and every cp.async phase (8 consecutive threads)
//      touches 8 distinct 16-byte bank groups: no shared-memory bank conflicts.
// Usage: swizzle_check ROWS CHUNKS THREADS   (prints "ok" or the first failure; exit status 0/1)
#include <cstdio>
#include <cstdlib>
#include <vector>
#define __device__
#define __forceinline__ inline
#include "common/smem_tile.cuh"

template <int ROWS, int CHUNKS, int THREADS>
int check() {
  std::vector<int> seen(ROWS * CHUNKS, 0);
  std::vector<int> owner(ROWS * CHUNKS, -1);  // offset -> thread, for the cp.async phases
  for (int tid = 0; tid < THREADS; ++tid) {
    for_each_chunk<ROWS, CHUNKS, THREADS>(tid, [&](int r, int c, int off) {
      if (r < 0 || r >= ROWS || c < 0 || c >= CHUNKS || off < 0 || off >= ROWS * CHUNKS) {
        std::printf("out of range: tid %d row %d chunk %d offset %d\n", tid, r, c, off); std::exit(1);
      }
      if (off != tile_offset<ROWS, CHUNKS>(r, c)) {
        std::printf("visitor offset %d != tile_offset %d at (%d, %d)\n", off, tile_offset<ROWS, CHUNKS>(r, c), r, c);
        std::exit(1);
      }
      seen[off] += 1;
    });
  }
  for (int i = 0; i < ROWS * CHUNKS; ++i)
    if (seen[i] != 1) { std::printf("offset %d written %d times\n", i, seen[i]); return 1; }
  // 2 + 3 (ldmatrix): a base address that is 128-byte aligned, as the kernels' tiles are
  const unsigned base = 1u << 16;
  for (int row0 = 0; row0 + 8 <= ROWS; row0 += 8)
    for (int c = 0; c + 1 < CHUNKS; c += 2)
      for (int sub = 0; sub < 2; ++sub) {
        int banks = 0;
        for (int r = row0; r < row0 + 8; ++r) {
          // TileLane built for row r % 16 (and sub), reached with a row_add that is a multiple of 8
          const int lane_row = r % 16, row_add = r - lane_row;
          TileLane<ROWS, CHUNKS> lane(base, lane_row, sub);
          const unsigned addr = lane.at(c, row_add);
          const unsigned want = base + 16u * tile_offset<ROWS, CHUNKS>(r, c + sub);
          if (addr != want) {
            std::printf("TileLane (%d, %d+%d) -> %u, tile_offset -> %u\n", r, c, sub, addr, want); return 1;
          }
          banks |= 1 << ((addr / 16) % 8);
        }
        if (banks != 0xff) { std::printf("ldmatrix rows %d..%d chunk %d: bank conflict\n", row0, row0 + 7, c + sub); return 1; }
      }
  // 3 (cp.async): each group of 8 consecutive threads writes 8 distinct bank groups per step
  for (int group = 0; group < THREADS / 8; ++group) {
    std::vector<std::vector<int>> per_thread(8);
    for (int t = 0; t < 8; ++t)
      for_each_chunk<ROWS, CHUNKS, THREADS>(group * 8 + t, [&](int, int, int off) { per_thread[t].push_back(off); });
    for (size_t step = 0; step < per_thread[0].size(); ++step) {
      int banks = 0, n = 0;
      for (int t = 0; t < 8; ++t)
        if (step < per_thread[t].size()) { banks |= 1 << (per_thread[t][step] % 8); ++n; }
      if (__builtin_popcount(banks) != n) { std::printf("cp.async threads %d..%d step %zu: bank conflict\n", group * 8, group * 8 + 7, step); return 1; }
    }
  }
  std::printf("ok\n");
  return 0;
}

#define SHAPE(R, C, T) if (rows == R && chunks == C && threads == T) return check<R, C, T>();
int main(int argc, char** argv) {
  if (argc != 4) { std::printf("usage: swizzle_check ROWS CHUNKS THREADS\n"); return 2; }
  const int rows = std::atoi(argv[1]), chunks = std::atoi(argv[2]), threads = std::atoi(argv[3]);
#include "shapes.inc"
  std::printf("shape %d x %d x %d not compiled in\n", rows, chunks, threads);
  return 2;
}
