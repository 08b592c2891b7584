// Runs one rendered autoflash forward kernel on the host emulator (tests/host/emu). Built per kernel with
//   g++ -std=c++20 -no-pie -pthread -include emu/prelude.h -I emu -I <templates>
//       -DAUTOFLASH_STATIC_SMEM -DAUTOFLASH_HOST_EMULATION -DKERNEL_SOURCE='"k.cu"' -DKERNEL_NAME=<name>
// Usage: run_kernel IN OUT. IN holds int32 b, hq, hkv, lq, lk, d, layout (0 = bhsd, 1 = bshd),
// float32 scale_log2, then q, k, v in that layout; OUT gets o (same layout as q) then lse
// (b, hq, lq) as float32.
#include <array>
#include <cstdio>
#include <fstream>
#include KERNEL_SOURCE
#include "launch.h"

int main(int argc, char** argv) {
  if (argc != 3) { std::fprintf(stderr, "usage: run_kernel IN OUT\n"); return 2; }
  std::ifstream in(argv[1], std::ios::binary);
  int32_t h[7];
  float scale_log2;
  in.read(reinterpret_cast<char*>(h), sizeof h);
  in.read(reinterpret_cast<char*>(&scale_log2), 4);
  const int b = h[0], hq = h[1], hkv = h[2], lq = h[3], lk = h[4], d = h[5], bshd = h[6];
  if (d != HEAD_DIM) { std::fprintf(stderr, "head_dim %d != kernel's %d\n", d, HEAD_DIM); return 2; }
  std::vector<elem_t> q(size_t(b) * hq * lq * d), k(size_t(b) * hkv * lk * d), v(k.size()), o(q.size());
  in.read(reinterpret_cast<char*>(q.data()), q.size() * sizeof(elem_t));
  in.read(reinterpret_cast<char*>(k.data()), k.size() * sizeof(elem_t));
  in.read(reinterpret_cast<char*>(v.data()), v.size() * sizeof(elem_t));
  if (!in) { std::fprintf(stderr, "short input\n"); return 2; }
  std::memset(o.data(), 0xff, o.size() * sizeof(elem_t));  // poison: every element must be written
  std::vector<float> lse(size_t(b) * hq * lq, -12345.f);
  // strides (batch, head, row) in elements
  auto strides = [&](int heads, int len) {
    return bshd ? std::array<long long, 3>{1LL * len * heads * d, d, 1LL * heads * d}
                : std::array<long long, 3>{1LL * heads * len * d, 1LL * len * d, d};
  };
  const auto sq = strides(hq, lq), sk = strides(hkv, lk);
  run_grid({unsigned((lq + BLOCK_M - 1) / BLOCK_M), unsigned(hq), unsigned(b)}, THREADS, [&] {
    KERNEL_NAME(q.data(), k.data(), v.data(), o.data(), lse.data(), sq[0], sq[1], sq[2], sk[0], sk[1], sk[2],
                sk[0], sk[1], sk[2], sq[0], sq[1], sq[2], lq, lk, hq / hkv, scale_log2);
  });
  std::ofstream out(argv[2], std::ios::binary);
  out.write(reinterpret_cast<const char*>(o.data()), o.size() * sizeof(elem_t));
  out.write(reinterpret_cast<const char*>(lse.data()), lse.size() * 4);
  return 0;
}
