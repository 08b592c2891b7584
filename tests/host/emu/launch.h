// Runs a kernel call over a grid on the host emulator: blocks one after another, each with one
// std::thread per CUDA thread and fresh block/warp barriers.
#pragma once
#include <thread>

template <typename F>
void run_grid(dim3 grid, int threads, F&& call) {
  gridDim = grid;
  blockDim = {unsigned(threads), 1, 1};
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        std::barrier<> block_barrier(threads);
        std::vector<WarpExchange> warps((threads + 31) / 32);
        g_block_barrier = &block_barrier;
        g_warps = &warps;
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t)
          pool.emplace_back([&, t] {
            threadIdx = {unsigned(t), 0, 0};
            blockIdx = {x, y, z};
            call();
          });
        for (auto& th : pool) th.join();
      }
}
