// Runs one rendered autoflash backward kernel pair (delta, then dK/dV/dQ) on the host emulator.
// Built like run_kernel.cpp. Usage: run_bwd IN OUT. IN holds int32 b, hq, hkv, lq, lk, d, layout
// (0 = bhsd, 1 = bshd), float32 scale, then q, k, v, out, dout in that layout and lse (b, hq, lq)
// float32; OUT gets dq_accum (b, hq, lq, d) float32, then dk and dv per query head (b, hq, lk, d),
// then delta (b, hq, lq) float32.
#include <array>
#include <cstdio>
#include <fstream>
#include KERNEL_SOURCE
#include "launch.h"

int main(int argc, char** argv) {
  if (argc != 3) { std::fprintf(stderr, "usage: run_bwd IN OUT\n"); return 2; }
  std::ifstream in(argv[1], std::ios::binary);
  int32_t h[7];
  float scale;
  in.read(reinterpret_cast<char*>(h), sizeof h);
  in.read(reinterpret_cast<char*>(&scale), 4);
  const int b = h[0], hq = h[1], hkv = h[2], lq = h[3], lk = h[4], d = h[5], bshd = h[6];
  if (d != HEAD_DIM) { std::fprintf(stderr, "head_dim %d != kernel's %d\n", d, HEAD_DIM); return 2; }
  const size_t nq = size_t(b) * hq * lq * d, nk = size_t(b) * hkv * lk * d;
  std::vector<elem_t> q(nq), k(nk), v(nk), o(nq), dout(nq);
  std::vector<float> lse(size_t(b) * hq * lq);
  in.read(reinterpret_cast<char*>(q.data()), nq * sizeof(elem_t));
  in.read(reinterpret_cast<char*>(k.data()), nk * sizeof(elem_t));
  in.read(reinterpret_cast<char*>(v.data()), nk * sizeof(elem_t));
  in.read(reinterpret_cast<char*>(o.data()), nq * sizeof(elem_t));
  in.read(reinterpret_cast<char*>(dout.data()), nq * sizeof(elem_t));
  in.read(reinterpret_cast<char*>(lse.data()), lse.size() * 4);
  if (!in) { std::fprintf(stderr, "short input\n"); return 2; }
  auto strides = [&](int heads, int len) {
    return bshd ? std::array<long long, 3>{1LL * len * heads * d, d, 1LL * heads * d}
                : std::array<long long, 3>{1LL * heads * len * d, 1LL * len * d, d};
  };
  const auto sq = strides(hq, lq), sk = strides(hkv, lk);
  const std::array<long long, 3> sx{1LL * hq * lk * d, 1LL * lk * d, d};  // dk, dv per query head
  std::vector<float> delta(lse.size(), -12345.f), dq(nq, 0.f);
  std::vector<elem_t> dk(size_t(b) * hq * lk * d), dv(dk.size());
  std::memset(dk.data(), 0xff, dk.size() * sizeof(elem_t));  // poison: every element must be written
  std::memset(dv.data(), 0xff, dv.size() * sizeof(elem_t));
  run_grid({unsigned((lq + 3) / 4), unsigned(hq), unsigned(b)}, 128, [&] {
    KERNEL_NAME_DELTA(o.data(), dout.data(), delta.data(), sq[0], sq[1], sq[2], sq[0], sq[1], sq[2], lq);
  });
  run_grid({unsigned((lk + BLOCK_N - 1) / BLOCK_N * HEAD_SPLIT), unsigned(hq), unsigned(b)}, THREADS, [&] {
    KERNEL_NAME(q.data(), k.data(), v.data(), dout.data(), lse.data(), delta.data(), dq.data(), dk.data(), dv.data(),
                sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sk[0], sk[1], sk[2], sq[0], sq[1], sq[2],
                sx[0], sx[1], sx[2], sx[0], sx[1], sx[2], lq, lk, hq / hkv, scale, scale * 1.4426950408889634f, 0);
  });
  std::ofstream out(argv[2], std::ios::binary);
  out.write(reinterpret_cast<const char*>(dq.data()), dq.size() * 4);
  out.write(reinterpret_cast<const char*>(dk.data()), dk.size() * sizeof(elem_t));
  out.write(reinterpret_cast<const char*>(dv.data()), dv.size() * sizeof(elem_t));
  out.write(reinterpret_cast<const char*>(delta.data()), delta.size() * 4);
  return 0;
}
