// The host emulator's runtime: runs a kernel built from the very source NVRTC compiles over its real
// grid, on the CPU.
//
// - Blocks are spread over worker threads (one block at a time per worker; one worker when
//   sanitizing, so findings come in a fixed order). A worker's `smem_raw` is its block's shared
//   memory, poisoned (0xff: NaN in every float type) before each block.
// - Each CUDA thread of a block is a fiber on its worker (a hand-written stack switch on x86-64, no
//   system call; ucontext elsewhere). A fiber runs until it reaches a
//   __syncthreads or a warp-synchronous operation (shuffle, ldmatrix, mma.sync, __syncwarp). The last
//   lane to reach a warp operation carries it out for the whole warp from every lane's operands; the
//   last thread to reach a barrier releases the block. A block in which no fiber can run any more
//   (some wait where others never arrive) is a barrier error.
// - cp.async copies are queued per thread in commit groups and land only at cp.async.wait_group.
// - wgmma (sm_90a) runs per warpgroup of 128 threads, its results landing at the covering
//   wgmma.wait_group (runtime/wgmma.h, which lists its own checks: kinds "async" and "wgmma").
//
// Built with EMU_SANITIZE=1 it also checks every access (kinds as compute-sanitizer names them):
//   race           shared-memory bytes touched by two agents (threads, a warpgroup's wgmma, a TMA
//                  load), one of them writing, that no synchronisation orders (vector clocks,
//                  runtime/order.h); a write while a wgmma or bulk store reads the byte is "async";
//   out-of-bounds  shared memory past the launch's dynamic size; global memory of a registered tensor
//                  (emu_add_region) that is not one of its elements (a row past seqlen, a column
//                  past head_dim: guard bands, autoflash/emulation/guards.py), whether or not memory
//                  exists there; in the launcher's own buffers, rows of another (batch, head) or packed
//                  sequence than the block's (emu_region_rows); global memory in no tensor of the launch
//                  (a null or wild pointer, past the end of every tensor): then the block stops before
//                  the access. Not tensors, and not checked: the threads' stacks, the shared window,
//                  the launch's parameter copies, the runtime's own state (threadIdx and the like) and
//                  the library's image (constant tables);
//   misaligned     an access of N bytes at an address that is not a multiple of N (cp.async,
//                  ldmatrix rows: 16 bytes);
//   uninitialized  shared memory read before any write in this block, or before its cp.async landed;
//   barrier        a __syncthreads or warp operation not reached by every thread, or reached at
//                  different places;
//   undefined      signed overflow, a bad shift or a division by zero (UBSan's checks; its array
//                  bounds check reports an index past a fixed-size array as out-of-bounds);
//   launch         a launch no GPU runs (an empty grid or block, more than 1,024 threads); the
//                  emulated GPU's own limits are checked before, in module.py.
// Plain loads and stores of the kernel are seen through the compiler's ThreadSanitizer
// instrumentation (-fsanitize=thread), undefined behaviour through UBSan's (-fsanitize=bounds,...):
// runtime/sanitizer.h defines the __tsan_* and __ubsan_handle_* hooks in place of their runtimes. Without EMU_SANITIZE only the checks that keep the emulator itself safe run
// (shared addresses inside the window, barrier errors); they fail the launch.
// The parts: runtime/fiber.h (stack switching), runtime/state.h (fibers, warps, blocks, findings),
// runtime/sanitizer.h (the checks and the ThreadSanitizer hooks), runtime/order.h (happens-before),
// runtime/wgmma.h (warpgroup operations, setmaxnreg's register pool); this file runs warps, blocks and
// launches, and holds what the kernel calls and the library's C interface.
#include "runtime.h"

#include <algorithm>
#include <cinttypes>
#include <cstring>
#include <thread>
#include <tuple>

#ifndef EMU_SANITIZE
#define EMU_SANITIZE 0
#endif
#define EMU_EXPORT extern "C" __attribute__((visibility("default")))

constexpr size_t kWindow = 256 * 1024;  // above every GPU's opt-in maximum (227 KB on sm_90)
alignas(128) thread_local unsigned char smem_raw[kWindow];

#include "runtime/fiber.h"
#include "runtime/state.h"
#include "runtime/sanitizer.h"
#include "runtime/wgmma.h"
#include "runtime/mbarrier.h"
#include "runtime/tma.h"

namespace emu {
namespace {

// Shared window offset of a pointer into this block's shared memory.
size_t window_offset(const void* p, size_t size, const void* pc, const char* what) {
  Worker& w = *tw;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), win = reinterpret_cast<uintptr_t>(w.window);
  if (a < win || a + size > win + w.launch->smem) {
    report("out-of-bounds", pc, fmt("%s of %zu bytes at shared offset %lld: outside the block's %zu bytes of shared memory",
                                    what, size, (long long)(a - win), w.launch->smem));
    return SIZE_MAX;
  }
  return a - win;
}

// ------------------------------------------------------------------ warp operations
// The lanes' row addresses of an ldmatrix / stmatrix: 16 bytes each, 16-aligned, inside the block's
// shared memory (else a finding, and the block stops); sanitizing, each row is its lane's own access.
bool matrix_rows(Worker& w, const Warp& wp, Fiber* lanes, int n, bool write, const char* what) {
  for (int l = 0; l < n; ++l) {
    const uint32_t row = lanes[l].u[0];
    if (row % 16 || row + 16 > w.launch->smem) {
      report(row % 16 ? "misaligned" : "out-of-bounds", wp.pc,
             row % 16 ? fmt("%s row address of lane %d at shared offset %u (not a multiple of 16)", what, l, row)
                      : fmt("%s row address of lane %d at shared offset %u: past the block's %zu bytes", what, l, row,
                            w.launch->smem));
      w.abandon = true;
      return false;
    }
#if EMU_SANITIZE
    Fiber* saved = w.cur;
    w.cur = &lanes[l];
    shared_access(row, 16, write, wp.pc, what);
    w.cur = saved;
#endif
  }
  return true;
}

void run_warp_op(Worker& w, Warp& wp) {
  Fiber* lanes = &w.fibers[wp.first];
  const int n = wp.lanes;
  switch (wp.op) {
    case Op::Shfl:
      for (int l = 0; l < n; ++l) {
        const int src = l ^ int(lanes[l].u[0]);
        lanes[l].of[0] = src < n && lanes[src].st != St::Done ? lanes[src].f[0] : lanes[l].f[0];
      }
      break;
    case Op::Ldmatrix:
    case Op::LdmatrixT: {
      // Lanes 8i..8i+7 give the row addresses of matrix i; register i of lane l gets row g, columns
      // 2q, 2q+1 (transposed: rows 2q, 2q+1 of column g), g = l / 4, q = l % 4.
      const bool trans = wp.op == Op::LdmatrixT;
      if (!matrix_rows(w, wp, lanes, n, false, trans ? "ldmatrix.trans" : "ldmatrix")) return;
      auto u16 = [&](uint32_t addr) { uint16_t v; std::memcpy(&v, w.window + addr, 2); return v; };
      for (int l = 0; l < 32 && l < n; ++l) {
        const int g = l / 4, q = l % 4;
        for (int i = 0; i < 4; ++i) {
          uint16_t lo, hi;
          if (!trans) {
            const uint32_t row = lanes[8 * i + g].u[0];
            lo = u16(row + 4 * q);
            hi = u16(row + 4 * q + 2);
          } else {
            lo = u16(lanes[8 * i + 2 * q].u[0] + 2 * g);
            hi = u16(lanes[8 * i + 2 * q + 1].u[0] + 2 * g);
          }
          lanes[l].ou[i] = lo | uint32_t(hi) << 16;
        }
      }
      break;
    }
    case Op::Stmatrix:
    case Op::StmatrixT: {
      // The inverse of ldmatrix: lane l's register i holds row g, columns 2q, 2q+1 of matrix i, whose
      // rows lanes 8i..8i+7 address (transposed: rows 2q, 2q+1 of column g).
      const bool trans = wp.op == Op::StmatrixT;
      if (!matrix_rows(w, wp, lanes, n, true, trans ? "stmatrix.trans" : "stmatrix")) return;
      auto put = [&](uint32_t addr, uint16_t v) { std::memcpy(w.window + addr, &v, 2); };
      for (int l = 0; l < 32 && l < n; ++l) {
        const int g = l / 4, q = l % 4;
        for (int i = 0; i < 4; ++i) {
          const uint16_t lo = uint16_t(lanes[l].u[1 + i]), hi = uint16_t(lanes[l].u[1 + i] >> 16);
          if (!trans) {
            put(lanes[8 * i + g].u[0] + 4 * q, lo);
            put(lanes[8 * i + g].u[0] + 4 * q + 2, hi);
          } else {
            put(lanes[8 * i + 2 * q].u[0] + 2 * g, lo);
            put(lanes[8 * i + 2 * q + 1].u[0] + 2 * g, hi);
          }
        }
      }
      break;
    }
    case Op::MmaF16:
    case Op::MmaBF16: {
      // A (16x16, row): lane l = 4g + q holds a0 (g, 2q..2q+1), a1 (g+8, ..), a2 (g, 2q+8..), a3 (g+8, 2q+8..);
      // B (16x8, col): b0 (k 2q.., n g), b1 (k 2q+8.., n g); D: d0,d1 (g, 2q..), d2,d3 (g+8, 2q..).
      auto cvt = [&](uint16_t h) { return half_to_float(h, wp.op == Op::MmaBF16); };
      float A[16][16], Bm[16][8];
      for (int l = 0; l < 32; ++l) {
        const int g = l / 4, q = l % 4;
        for (int r = 0; r < 4; ++r) {
          const uint32_t v = lanes[l].u[r];
          const int row = g + (r & 1) * 8, k = 2 * q + (r >> 1) * 8;
          A[row][k] = cvt(uint16_t(v & 0xffff));
          A[row][k + 1] = cvt(uint16_t(v >> 16));
        }
        for (int r = 0; r < 2; ++r) {
          const uint32_t v = lanes[l].u[4 + r];
          const int k = 2 * q + r * 8;
          Bm[k][g] = cvt(uint16_t(v & 0xffff));
          Bm[k + 1][g] = cvt(uint16_t(v >> 16));
        }
      }
      for (int l = 0; l < 32; ++l) {
        const int g = l / 4, q = l % 4;
        for (int i = 0; i < 4; ++i) {
          const int row = g + (i >= 2 ? 8 : 0), col = 2 * q + (i & 1);
          float acc = lanes[l].f[i];
          for (int k = 0; k < 16; ++k) acc += A[row][k] * Bm[k][col];
          lanes[l].of[i] = acc;
        }
      }
      break;
    }
    case Op::Syncwarp: {
#if EMU_SANITIZE
      std::vector<Fiber*> live;
      for (int l = 0; l < n; ++l)
        if (lanes[l].st != St::Done) live.push_back(&lanes[l]);
      order_all(live);
#endif
      break;
    }
    case Op::Elect: {  // the lowest live lane
      int chosen = -1;
      for (int l = 0; l < n; ++l) {
        lanes[l].ou[0] = 0;
        if (chosen < 0 && lanes[l].st != St::Done) chosen = l;
      }
      if (chosen >= 0) lanes[chosen].ou[0] = 1;
      break;
    }
    case Op::None:
      break;
  }
}

// Every lane of the warp posts its operands; the last to arrive runs the operation for all.
void warp_op(Op op, const void* pc) {
  Worker& w = *tw;
  Fiber& f = *w.cur;
  Warp& wp = w.warps[f.warp];
  if (wp.arrived == 0) { wp.op = op; wp.pc = pc; }
  else if (wp.op != op || (EMU_SANITIZE && wp.pc != pc)) {
    report("barrier", pc, fmt("warp %d: lane %d reached %s while lanes wait in %s elsewhere (warp-synchronous "
                              "operations must be reached by every lane at the same place)",
                              f.warp, f.lane, op_name(op), op_name(wp.op)));
    if (wp.op != op) { w.abandon = true; yield(w, f); }
  }
  if (op != Op::Shfl && op != Op::Syncwarp && wp.live < 32) {
    report("barrier", pc, fmt("warp %d: %s with %d live lanes (needs all 32)", f.warp, op_name(op), wp.live));
    w.abandon = true;
    yield(w, f);
  }
  if (++wp.arrived == wp.live) {
    run_warp_op(w, wp);
    wp.arrived = 0;
    for (int l = 0; l < wp.lanes; ++l)
      if (w.fibers[wp.first + l].st == St::Warp) wake(w, w.fibers[wp.first + l]);
    if (w.abandon) yield(w, f);
    return;
  }
  f.st = St::Warp;
  yield(w, f);
}

// ------------------------------------------------------------------ blocks
// Releases a __syncthreads: `last` (the thread that completed it, if any) and every waiting thread go on.
void release_barrier(Worker& w, Fiber* last) {
#if EMU_SANITIZE
  std::vector<Fiber*> all;
  for (Fiber& f : w.fibers)
    if (f.st == St::Bar || &f == last) all.push_back(&f);
  order_all(all);
#else
  (void)last;
#endif
  for (Fiber& f : w.fibers)
    if (f.st == St::Bar) wake(w, f);
  w.bar_arrived = 0;
}

void land(Worker& w, Fiber& f, std::vector<Copy>& group) {
  for (const Copy& c : group) {
    if (c.valid) std::memcpy(c.dst, c.src, c.bytes);
    else std::memset(c.dst, 0, c.bytes);
#if EMU_SANITIZE
    mark_landed(size_t(c.dst - w.window), c.bytes, f, c.pc);
#else
    (void)w; (void)f;
#endif
  }
}

void fiber_main() {
  Worker& w = *tw;
  w.launch->entry(w.launch->args);
  Fiber& f = *w.cur;
  f.st = St::Done;
  --w.live;
  Warp& wp = w.warps[f.warp];
  --wp.live;
  group_exit(w, f);
  stores_at_exit(w, f);
  if (!f.groups.empty() || !f.open.empty()) {  // copies still in flight at exit land anyway
    for (auto& g : f.groups) land(w, f, g);
    land(w, f, f.open);
  }
  if (w.bar_arrived > 0) {  // the hardware lets such a barrier go; the sanitizer reports it
    if (EMU_SANITIZE) report("barrier", w.bar_pc, fmt("thread %d exited while %d threads wait at this __syncthreads", f.tid, w.bar_arrived));
    if (w.bar_arrived == w.live) release_barrier(w, nullptr);
  }
  if (wp.arrived > 0) {
    report("barrier", wp.pc, fmt("warp %d: lane %d exited while %d lanes wait in %s", f.warp, f.lane, wp.arrived, op_name(wp.op)));
    w.abandon = true;
  }
}

void fiber_entry() {
  fiber_main();
  Worker& w = *tw;
  ctx_switch(w.cur->ctx, w.sched);  // never resumed
  __builtin_unreachable();
}

// The next thread to run under the launch's schedule (Sched), or null when none can.
Fiber* next_fiber(Worker& w, size_t& cursor) {
  const size_t n = w.fibers.size();
  if (w.launch->sched == Sched::ReleasedFirst)
    while (!w.released.empty()) {
      Fiber& f = w.fibers[size_t(w.released.front())];
      w.released.pop_front();
      if (f.st == St::Run) return &f;
    }
  if (w.launch->sched == Sched::Random) cursor = size_t(next_random(w) % n);
  for (size_t k = 0; k < n; ++k) {
    Fiber& f = w.fibers[(cursor + k) % n];
    if (f.st == St::Run) {
      cursor = (cursor + k + 1) % n;
      return &f;
    }
  }
  return nullptr;
}

void run_block(Worker& w, dim3 block) {
  Launch& L = *w.launch;
  w.block = block;
  w.live = L.threads;
  w.bar_arrived = 0;
  w.abandon = false;
  const int nwarps = (L.threads + 31) / 32;
  w.warps.assign(nwarps, Warp{});
  for (int i = 0; i < nwarps; ++i) {
    w.warps[i].first = 32 * i;
    w.warps[i].lanes = w.warps[i].live = std::min(32, L.threads - 32 * i);
  }
  w.mbars.clear();
  w.tma_loads.clear();
  for (NamedBar& b : w.named) b = NamedBar{};
  w.phases = w.phases_seen = 0;
  w.reg_pool = 0;
  w.wgroups.assign((L.threads + 127) / 128, Group{});
  for (size_t i = 0; i < w.wgroups.size(); ++i) {
    w.wgroups[i].first = 128 * int(i);
    w.wgroups[i].threads = w.wgroups[i].live = std::min(128, L.threads - 128 * int(i));
  }
  std::memset(w.window, 0xff, L.smem);
#if EMU_SANITIZE
  std::fill(w.shadow.begin(), w.shadow.begin() + std::ptrdiff_t(L.smem), Shadow{});
#endif
  for (int t = 0; t < L.threads; ++t) {
    Fiber& f = w.fibers[t];
    f.idx = {unsigned(t) % L.block.x, unsigned(t) / L.block.x % L.block.y, unsigned(t) / (L.block.x * L.block.y)};
    f.tid = t;
    f.warp = t / 32;
    f.lane = t % 32;
    f.st = St::Run;
    f.open.clear();
    f.groups.clear();
    f.stores_open.clear();
    f.store_groups.clear();
    f.stores_read.clear();
    f.named = -1;
    f.proxy_fences = 0;
    ctx_init(f.ctx, w.stacks + size_t(t) * kStack, kStack, fiber_entry);
  }
#if EMU_SANITIZE
  order_block_start(w);
#endif
  w.released.clear();
  w.rng = L.seed ^ (uint64_t(block.x) << 40 | uint64_t(block.y) << 20 | block.z);
  size_t cursor = 0;
  while (w.live > 0 && !w.abandon) {
    if (Fiber* f = next_fiber(w, cursor)) {
      w.cur = f;
      ctx_switch(w.sched, f->ctx);
      w.cur = nullptr;
      if (!w.abandon && !w.tma_loads.empty() &&
          (L.sched == Sched::Wake || (L.sched == Sched::Random && next_random(w) % 4 == 0)))
        land_tma_loads(w, true);  // as soon as the hardware could
      continue;
    }
    if (!w.abandon && w.phases != w.phases_seen) {  // a phase completed: its spinners look again
      w.phases_seen = w.phases;
      for (Fiber& f : w.fibers)
        if (f.st == St::Spin) wake(w, f);
      continue;
    }
    if (!w.abandon && land_tma_loads(w, false)) continue;  // none can go on without its TMA loads: they land
    if (!w.abandon) {  // every live thread waits for one that will never come
      std::string where;
      int at_bar = 0;
      for (const Fiber& f : w.fibers) at_bar += f.st == St::Bar;
      for (const Warp& wp : w.warps)
        if (wp.arrived) where += fmt("; warp %d: %d of %d lanes in %s", int(&wp - w.warps.data()), wp.arrived, wp.live, op_name(wp.op));
      for (const Group& g : w.wgroups)
        if (g.arrived) where += fmt("; warpgroup %d: %d of %d threads in %s", g.first / 128, g.arrived, g.live, wg_name(g.op));
      for (int id = 0; id < 16; ++id)
        if (w.named[id].arrived) where += fmt("; named barrier %d: %d of %d threads", id, w.named[id].arrived, w.named[id].count);
      for (const Group& g : w.wgroups)
        if (g.want)
          where += fmt("; warpgroup %d waits in setmaxnreg.inc %d holding %d registers per thread: it needs %d from the "
                       "block's register pool, which holds %d (ptxas gives each thread %d at entry; only "
                       "setmaxnreg.dec fills the pool)", g.first / 128, g.want, held_registers(w, g),
                       (g.want - held_registers(w, g)) * g.threads, w.reg_pool, w.launch->registers);
      std::map<std::pair<uint32_t, uint32_t>, int> spins;  // (mbarrier, parity) -> threads spinning on it
      for (const Fiber& f : w.fibers)
        if (f.st == St::Spin) ++spins[{f.spin_bar, f.spin_parity}];
      for (const auto& [key, count] : spins) {
        const Mbar& m = w.mbars[key.first];
        where += fmt("; %d threads wait on the mbarrier at shared offset %u for the phase of parity %u, which never "
                     "completes (phase %u: %d of %d arrivals pending, %lld transaction bytes)", count, key.first,
                     key.second, m.phase, m.pending, m.expected, m.tx);
      }
      const void* pc = at_bar ? w.bar_pc : nullptr;
      for (const Group& g : w.wgroups) if (!pc && g.want) pc = g.pc;
      for (const Warp& wp : w.warps) if (!pc && wp.arrived) pc = wp.pc;
      for (const Group& g : w.wgroups) if (!pc && g.arrived) pc = g.pc;
      for (int id = 0; id < 16; ++id) if (!pc && w.named[id].arrived) pc = w.named[id].pc;
      report(spins.empty() ? "barrier" : "mbarrier", pc,
             fmt("deadlock: %d threads wait at __syncthreads%s", at_bar, where.c_str()));
      return;
    }
  }
  if (!w.abandon) {
    loads_at_block_end(w);
    check_mbarriers_balanced(w);
  }
}

void worker_main(Launch* L) {
  Worker w;
  w.launch = L;
  w.window = smem_raw;
  w.fibers.resize(L->threads);
  w.stacks = take_stacks(size_t(L->threads) * kStack);
  if (w.stacks == nullptr) {
    report("emulator", nullptr, fmt("could not map %d fiber stacks", L->threads));
    return;
  }
#if EMU_SANITIZE
  w.shadow.resize(L->smem ? L->smem : 1);
  auto span = [](const void* p, size_t n) {
    return std::pair<uintptr_t, uintptr_t>{reinterpret_cast<uintptr_t>(p), reinterpret_cast<uintptr_t>(p) + n};
  };
  w.owned = {span(&w, sizeof w), span(w.fibers.data(), w.fibers.size() * sizeof(Fiber)), span(L, sizeof *L),
             span(L->params.data(), L->params.size()), span(L->param_ptrs.data(), L->param_ptrs.size() * sizeof(void*))};
#endif
  tw = &w;
  const long total = long(L->grid.x) * L->grid.y * L->grid.z;
  for (long i; (i = L->next.fetch_add(1)) < total;) {
    if (!EMU_SANITIZE && L->failed.load()) break;
    run_block(w, {unsigned(i % L->grid.x), unsigned(i / L->grid.x % L->grid.y), unsigned(i / (long(L->grid.x) * L->grid.y))});
  }
  tw = nullptr;
  give_stacks(size_t(L->threads) * kStack, w.stacks);
}

}  // namespace

// ------------------------------------------------------------------ what the kernel calls
const dim3& thread_idx() { return tw->cur->idx; }
const dim3& block_idx() { return tw->block; }
const dim3& grid_dim() { return tw->launch->grid; }
const dim3& block_dim() { return tw->launch->block; }

void syncthreads() {
  Worker& w = *tw;
  Fiber& f = *w.cur;
  const void* pc = __builtin_return_address(0);
  if (w.bar_arrived == 0) w.bar_pc = pc;
  else if (EMU_SANITIZE && pc != w.bar_pc)
    report("barrier", pc, fmt("thread %d reached a different __syncthreads than the threads waiting", f.tid));
  if (++w.bar_arrived == w.live) {
    release_barrier(w, &f);
    return;
  }
  f.st = St::Bar;
  yield(w, f);
}

void syncwarp(unsigned) { warp_op(Op::Syncwarp, __builtin_return_address(0)); }

float shfl_xor(float x, int offset, unsigned) {
  Fiber& f = *tw->cur;
  f.f[0] = x;
  f.u[0] = uint32_t(offset);
  warp_op(Op::Shfl, __builtin_return_address(0));
  return f.of[0];
}

void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr, bool trans) {
  Fiber& f = *tw->cur;
  f.u[0] = addr;
  warp_op(trans ? Op::LdmatrixT : Op::Ldmatrix, __builtin_return_address(0));
  for (int i = 0; i < 4; ++i) r[i] = f.ou[i];
}

void stmatrix_x4(const uint32_t (&r)[4], uint32_t addr, bool trans) {
  Fiber& f = *tw->cur;
  f.u[0] = addr;
  for (int i = 0; i < 4; ++i) f.u[1 + i] = r[i];
  warp_op(trans ? Op::StmatrixT : Op::Stmatrix, __builtin_return_address(0));
}

void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16) {
  Fiber& f = *tw->cur;
  for (int i = 0; i < 4; ++i) { f.u[i] = a[i]; f.f[i] = d[i]; }
  f.u[4] = b0;
  f.u[5] = b1;
  warp_op(bf16 ? Op::MmaBF16 : Op::MmaF16, __builtin_return_address(0));
  for (int i = 0; i < 4; ++i) d[i] = f.of[i];
}

void cp_async(void* dst, const void* src, int bytes, bool valid) {
  Worker& w = *tw;
  const void* pc = __builtin_return_address(0);
  const size_t off = window_offset(dst, bytes, pc, "cp.async destination");
  if (off == SIZE_MAX) return;
#if EMU_SANITIZE
  if (off % bytes) report("misaligned", pc, fmt("cp.async destination at shared offset %zu (not a multiple of %d)", off, bytes));
  if (valid) {
    if (reinterpret_cast<uintptr_t>(src) % bytes) report("misaligned", pc, fmt("cp.async source address not a multiple of %d", bytes));
    else global_access(src, bytes, false, pc);
  }
  shared_access(off, bytes, true, pc, "cp.async");
  mark_pending(off, bytes);
#endif
  w.cur->open.push_back({w.window + off, static_cast<const unsigned char*>(src), valid, static_cast<unsigned char>(bytes), pc});
}

void cp_async_commit() {
  Fiber& f = *tw->cur;
  f.groups.push_back(std::move(f.open));
  f.open.clear();
}

void cp_async_wait(int pending) {
  Worker& w = *tw;
  Fiber& f = *w.cur;
  while (f.groups.size() > size_t(pending)) {
    land(w, f, f.groups.front());
    f.groups.erase(f.groups.begin());
  }
}

float atomic_add(float* address, float value) {
#if EMU_SANITIZE
  const void* pc = __builtin_return_address(0);
  if (reinterpret_cast<uintptr_t>(address) % 4) { report("misaligned", pc, "atomicAdd on a float address not a multiple of 4"); return 0.f; }
  global_access(address, 4, true, pc);
#endif
  return std::atomic_ref<float>(*address).fetch_add(value);
}

uint32_t cvta_shared(const void* p) {
  const size_t off = window_offset(p, 0, __builtin_return_address(0), "shared address");
  return off == SIZE_MAX ? 0u : uint32_t(off);
}

}  // namespace emu

// ------------------------------------------------------------------ the library's C interface
// Runs `entry` over the grid; returns the number of findings (sanitizing) or 0 / 1 (ok / failed).
// args[i] points at the i-th argument's sizes[i] bytes; they are copied first, as cuLaunchKernel copies
// kernelParams, so the kernel reads its arguments from the launch's own memory. The launch limits of the
// emulated GPU (grid, block, shared memory, registers) are checked by the caller (module.py), which passes
// ptxas's registers per thread (0: unknown), the start of setmaxnreg's pool (runtime/wgmma.h).
EMU_EXPORT int emu_launch(emu_entry_t entry, const char* kernel, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                          unsigned by, unsigned bz, unsigned long smem, void** args, const unsigned* sizes, int nargs,
                          int workers, int registers, int schedule, unsigned long long seed, const char* schedule_name) {
  using namespace emu;
  if (smem > kWindow) {
    report("launch", nullptr, fmt("%lu bytes of dynamic shared memory requested; the emulator holds %zu", smem, kWindow));
    return 1;
  }
  if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || size_t(bx) * by * bz > 1024) {
    report("launch", nullptr, fmt("grid (%u, %u, %u), block (%u, %u, %u): not a launch a GPU runs", gx, gy, gz, bx, by, bz));
    return 1;
  }
  Launch L;
  L.entry = entry;
  // Each argument 16-aligned, and 64-aligned from 64 bytes up (a tensor map, alignas(64), by value).
  std::vector<size_t> offsets;
  size_t end = 0;
  for (int i = 0; i < nargs; ++i) {
    const size_t align = sizes[i] >= 64 ? 64 : 16;
    offsets.push_back((end + align - 1) & ~(align - 1));
    end = offsets.back() + sizes[i];
  }
  L.params.resize(end + 64);
  unsigned char* base = L.params.data() + (64 - reinterpret_cast<uintptr_t>(L.params.data()) % 64) % 64;
  for (int i = 0; i < nargs; ++i) {
    std::memcpy(base + offsets[i], args[i], sizes[i]);
    L.param_ptrs.push_back(base + offsets[i]);
  }
  L.args = L.param_ptrs.data();
  L.kernel = kernel;
  L.grid = {gx, gy, gz};
  L.block = {bx, by, bz};
  L.smem = smem;
  L.threads = int(bx * by * bz);
  L.registers = registers;
  L.sched = Sched(std::clamp(schedule, 0, 3));
  L.seed = seed;
  L.schedule = schedule_name ? schedule_name : "default";
  const long blocks = long(gx) * gy * gz;
  int n = EMU_SANITIZE ? 1 : std::max(1, std::min<int>(workers, int(std::min<long>(blocks, 1 << 20))));
  if (n == 1) {
    worker_main(&L);
  } else {
    std::vector<std::thread> pool;
    for (int i = 0; i < n; ++i) pool.emplace_back(worker_main, &L);
    for (auto& t : pool) t.join();
  }
  return L.failed.load() ? 1 : 0;
}

// Registers a tensor of this launch for the out-of-bounds check: its elements are exactly
// origin + sum(i_d * stride_d) * elem for 0 <= i_d < shape_d; every other byte of its storage
// [storage, storage + storage_bytes) is not (a guard band, another view's data). A null origin is an
// argument passed as a null pointer (named in the finding of an access through it).
EMU_EXPORT void emu_add_region(const char* name, const void* origin, const void* storage, unsigned long storage_bytes,
                               int elem, int ndim, const long long* shape, const long long* stride) {
#if EMU_SANITIZE
  using namespace emu;
  Region r;
  r.name = name;
  r.elem = elem;
  r.rank = std::min(ndim, 8);
  // Dims of one element decompose to index 0 whatever their stride (which may equal another dim's).
  std::vector<std::tuple<long long, long long, int>> dims;
  long long span = 1;
  for (int d = 0; d < r.rank; ++d) {
    r.full_shape[d] = shape[d];
    if (shape[d] == 0) r.empty = true;
    if (shape[d] > 1) dims.emplace_back(stride[d], shape[d], d);
    span += (shape[d] - 1) * stride[d];
  }
  std::stable_sort(dims.begin(), dims.end(), [](const auto& a, const auto& b) { return std::get<0>(a) > std::get<0>(b); });
  r.ndim = int(dims.size());
  for (int d = 0; d < r.ndim; ++d) {
    std::tie(r.stride[d], r.shape[d], r.dim[d]) = dims[d];
    const long long inner = d + 1 < r.ndim ? std::get<0>(dims[d + 1]) * std::get<1>(dims[d + 1]) : 1;
    if (r.stride[d] <= 0 || r.stride[d] < inner) r.nested = false;
  }
  r.origin = reinterpret_cast<uintptr_t>(origin);
  if (r.origin) {
    r.base = std::min(r.origin, reinterpret_cast<uintptr_t>(storage));
    r.end = std::max(r.origin + uintptr_t(r.empty ? 0 : span) * elem, reinterpret_cast<uintptr_t>(storage) + storage_bytes);
  }
  std::lock_guard<std::mutex> lock(g_mu);
  g_regions.push_back(r);
#else
  (void)name; (void)origin; (void)storage; (void)storage_bytes; (void)elem; (void)ndim; (void)shape; (void)stride;
#endif
}

// Whose rows the blocks may touch in the last registered tensor (the launcher's own buffers, whose
// layout it knows): along dim z_dim only index blockIdx.z, along y_dim only blockIdx.y, along row_dim
// (packed sequences) only rows [bounds[z], bounds[z + 1]) of sequence z = blockIdx.z, `bounds` being
// the launch's cu_seqlens (named bounds_name). -1: no rule for that dim.
// The last region is a paged KV cache: along its own dim `dim`, block z may reach only pages
// flat[offsets[z] .. offsets[z + 1]) (the block table's row z, as far as sequence z's length reaches).
EMU_EXPORT void emu_region_pages(int dim, const long long* flat, const long long* offsets, int n_z, const char* name) {
#if EMU_SANITIZE
  using namespace emu;
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_regions.empty()) return;
  Region& r = g_regions.back();
  for (int d = 0; d < r.ndim; ++d)
    if (r.dim[d] == dim) r.page_dim = d;
  r.pages.assign(size_t(n_z), {});
  for (int z = 0; z < n_z; ++z) r.pages[size_t(z)].assign(flat + offsets[z], flat + offsets[z + 1]);
  r.pages_name = name;
#else
  (void)dim; (void)flat; (void)offsets; (void)n_z; (void)name;
#endif
}

EMU_EXPORT void emu_region_rows(int z_dim, int y_dim, int row_dim, const long long* bounds, int n_bounds,
                                const char* bounds_name) {
#if EMU_SANITIZE
  using namespace emu;
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_regions.empty()) return;
  Region& r = g_regions.back();
  for (int d = 0; d < r.ndim; ++d) {  // dims of one element are always index 0: nothing to check there
    if (r.dim[d] == z_dim) r.own_z = d;
    if (r.dim[d] == y_dim) r.own_y = d;
    if (r.dim[d] == row_dim && n_bounds > 1) {
      r.seg_dim = d;
      r.seg.assign(bounds, bounds + n_bounds);
      r.seg_name = bounds_name;
    }
  }
#else
  (void)z_dim; (void)y_dim; (void)row_dim; (void)bounds; (void)n_bounds; (void)bounds_name;
#endif
}

EMU_EXPORT void emu_clear_regions() {
#if EMU_SANITIZE
  std::lock_guard<std::mutex> lock(emu::g_mu);
  emu::g_regions.clear();
#endif
}

EMU_EXPORT int emu_finding_count() { return int(emu::g_findings.size()); }

// Finding i as one line: kind \t kernel \t block x,y,z \t thread \t detail \t schedule \t pc offsets (hex, comma-separated).
EMU_EXPORT int emu_finding(int i, char* out, int size) {
  using namespace emu;
  std::lock_guard<std::mutex> lock(g_mu);
  if (i < 0 || i >= int(g_findings.size())) return -1;
  const Finding& f = g_findings[i];
  std::string s = f.kind + "\t" + f.kernel + "\t" + fmt("%u,%u,%u", f.block.x, f.block.y, f.block.z) + "\t" + std::to_string(f.thread) +
                  "\t" + f.detail + "\t" + f.schedule + "\t";
  for (size_t k = 0; k < f.pcs.size(); ++k) s += fmt("%s%" PRIxPTR, k ? "," : "", f.pcs[k]);
  std::snprintf(out, size_t(size), "%s", s.c_str());
  return int(s.size());
}

EMU_EXPORT void emu_clear_findings() {
  std::lock_guard<std::mutex> lock(emu::g_mu);
  emu::g_findings.clear();
  emu::g_seen.clear();
}
