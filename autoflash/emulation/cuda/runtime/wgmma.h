// wgmma (PTX ISA 9.7.15) on the emulator (included once, by runtime.cpp): wgmma.fence, mma_async,
// commit_group and wait_group as operations of a warpgroup (4 consecutive warps, 128 threads from a
// multiple of 128), every thread of which must reach each at the same place.
//
// Asynchrony as the PTX ISA defines it: mma_async takes the A registers (RS) when issued and
// gathers shared-memory operands through its 64-bit descriptors; its result lands in the threads'
// accumulators only at the wait_group that covers its commit group, in issue order (wgmmas chained on
// the same accumulators see each other's results). Reading the accumulators before that wait reads
// what they held before.
//
// Sanitizing, the hazards the ISA calls undefined are findings (kind "async"): accumulators or A
// registers touched while their wgmma is in flight, shared memory an in-flight wgmma reads written
// before it completes, an mma_async with no wgmma.fence since the warpgroup last held its
// accumulators (its start, or a wait_group), operands a thread wrote through the generic proxy with
// no fence.proxy.async since. Its operand reads are also the shared-memory reads of the issuing
// thread for the uninitialized and race checks. Always, kind "wgmma": descriptors, shape or flags that
// differ across the warpgroup, a descriptor base offset (not modelled: tiles start on their swizzle
// pattern's boundary), operands outside the block's shared memory; kind "barrier": a warpgroup
// operation not reached by all 128 threads, or at different places.
#pragma once

namespace emu {
namespace {

const char* wg_name(WgOp op) {
  switch (op) {
    case WgOp::Fence: return "wgmma.fence";
    case WgOp::Mma: return "wgmma.mma_async";
    case WgOp::Commit: return "wgmma.commit_group";
    case WgOp::Wait: return "wgmma.wait_group";
    case WgOp::Setmaxnreg: return "setmaxnreg";
    default: return "?";
  }
}

// Shared-memory byte offset of element (r, kk) of a matrix read through descriptor `desc`: r along M
// (A) or N (B), kk along K (0..15), 2-byte elements. The canonical layouts of PTX 9.7.15.5.1.2 (T = 8
// elements = 16 bytes; W the swizzle span; the swizzle XORs address bits [4, 4 + log2(W / 16)) with
// bits [7, ...), Swizzle<B,4,3> in CuTe):
//   K-major   none: ((8,m),(T,2)):((1T,SBO),(1,LBO))    swizzled: ((8,m),(T,2)):((W/2,SBO),(1,T))
//   MN-major  none: ((T,1,m),(8,2)):((1,T,SBO),(1T,LBO)) swizzled: ((W/2,m),(8,2)):((1,LBO),(W/2,SBO))
uint32_t operand_offset(uint64_t desc, int r, int kk, int mn_major) {
  const uint32_t start = uint32_t(desc & 0x3FFF) << 4, lbo = uint32_t((desc >> 16) & 0x3FFF) << 4,
                 sbo = uint32_t((desc >> 32) & 0x3FFF) << 4;
  const int mode = int(desc >> 62);
  const uint32_t W = mode == 1 ? 128 : mode == 2 ? 64 : mode == 3 ? 32 : 16, e = 2, T = 8;
  if (W == 16) {
    if (!mn_major) return start + (r % 8) * 16 + (r / 8) * sbo + (kk / T) * lbo + (kk % T) * e;
    return start + (r % T) * e + (r / T) * sbo + (kk % 8) * 16 + (kk / 8) * lbo;
  }
  const uint32_t x = !mn_major ? start + (r % 8) * W + (r / 8) * sbo + kk * e
                               : start + (r % (W / e)) * e + (r / (W / e)) * lbo + (kk % 8) * W + (kk / 8) * sbo;
  return x ^ (((x >> 7) & (W / 16 - 1)) << 4);
}

#if EMU_SANITIZE
// The proxy rule: bytes a thread wrote through the generic proxy (st.shared, stmatrix, cp.async) reach
// the async proxy only after that thread's fence.proxy.async (PTX 9.7.13.4; then a barrier orders it
// before the reader, which the race rule sees). Bytes a TMA load wrote are the async proxy's already.
// True (and a finding) where shared byte i breaks it.
bool proxy_unfenced(Worker& w, uint32_t i, const void* pc, const char* which) {
  const Shadow& s = w.shadow[i];
  if (!(s.st == 2 && s.w.agent >= 0 && s.w.agent < w.launch->threads && s.wP >= 0 &&
        w.fibers[size_t(s.w.agent)].proxy_fences == s.wP))
    return false;
  report("async", pc, fmt("%s reads shared offset %u through the async proxy, which thread %d wrote through the "
                          "generic proxy with no fence.proxy.async since", which, i, s.w.agent));
  return true;
}

// Bytes [off, off + size) an async-proxy operation (a TMA store's or reduction's source) reads: the
// shared-memory checks of a read by the issuing thread (uninitialized, race) and the proxy rule.
void async_proxy_read(Worker& w, uint32_t off, int size, const void* pc, const char* which) {
  shared_access(off, size, false, pc, which);
  for (uint32_t i = off; i < off + uint32_t(size); ++i)
    if (proxy_unfenced(w, i, pc, which)) return;
}

// A wgmma operand byte read from issue to the wait_group that covers it: checked at issue against
// the join of the issuing threads' clocks (`vc`; uninitialized, ordered after its writes, the proxy
// rule) and counted in flight; kept as the warpgroup unit's read when the wgmma completes.
void wgmma_operand_read(Worker& w, uint32_t off, const WgMma& m, int unit, const char* which) {
  for (uint32_t i = off; i < off + 2; ++i) ++w.shadow[i].async_reads;
  for (uint32_t i = off; i < off + 2; ++i) {
    Shadow& s = w.shadow[i];
    if (s.st != 2) {
      report("uninitialized", m.pc, fmt("%s reads shared offset %u %s", which, i, unwritten(s)));
      return;
    }
    if (!order_access(w, i, false, unit, m.vc, m.pc, which, false) || proxy_unfenced(w, i, m.pc, which)) return;
  }
}

#endif

// Calls f(r, kk, shared offset) for each element (r, kk) of the rows x 16 operand behind `desc`, in
// order, until f returns false; false then.
template <class F>
bool for_operand(uint64_t desc, int rows, int mn_major, F&& f) {
  for (int r = 0; r < rows; ++r)
    for (int kk = 0; kk < 16; ++kk)
      if (!f(r, kk, operand_offset(desc, r, kk, mn_major))) return false;
  return true;
}

#if EMU_SANITIZE
// The wgmma `m` of warpgroup unit `unit` has read its operands: each byte leaves flight and is kept as
// the unit's read at the unit's new clock (which the warpgroup's threads then acquire).
void end_operand_reads(Worker& w, WgMma& m, int unit) {
  m.vc[size_t(unit)] = ++w.unit_clock[size_t(unit)];
  auto end = [&](int, int, uint32_t off) {
    for (uint32_t i = off; i < off + 2 && i < w.launch->smem; ++i) {
      if (w.shadow[i].async_reads) --w.shadow[i].async_reads;
      order_access(w, i, false, unit, m.vc, m.pc, "wgmma.mma_async");
    }
    return true;
  };
  if (!m.rs) for_operand(m.da, 64, m.trans_a, end);
  for_operand(m.db, m.n, m.trans_b, end);
}
#endif

// The rows x 16 operand behind `desc`, as floats (out[r * 16 + kk]); false (and a finding) when the
// descriptor cannot be read as the emulator models it, or reaches outside the block's shared memory.
// `issue`: read as the wgmma is issued (sanitizing: with the async-proxy read checks).
bool read_operand(Worker& w, uint64_t desc, int rows, int mn_major, bool bf16, std::vector<float>& out,
                  const void* pc, const char* which, const WgMma* issue = nullptr, int unit = -1) {
  const int mode = int(desc >> 62), base = int((desc >> 49) & 7);
  const uint32_t start = uint32_t(desc & 0x3FFF) << 4, W = mode == 1 ? 128 : mode == 2 ? 64 : mode == 3 ? 32 : 16;
  if (base != 0) {
    report("wgmma", pc, fmt("%s descriptor with base offset %d: not modelled (start swizzled tiles on their "
                            "pattern's boundary, base offset 0)", which, base));
    return false;
  }
  if (W > 16 && ((start >> 7) & (W / 16 - 1)) != 0) {
    report("wgmma", pc, fmt("%s descriptor start at shared offset %u is not on its %u-byte swizzle pattern's boundary "
                            "(bits 7.. of the start must be 0 with base offset 0)", which, start, W * 8));
    return false;
  }
  out.resize(size_t(rows) * 16);
  return for_operand(desc, rows, mn_major, [&](int r, int kk, uint32_t off) {
    if (off + 2 > w.launch->smem) {
      report("wgmma", pc, fmt("%s element (%d, %d) at shared offset %u: past the block's %zu bytes of shared memory",
                              which, r, kk, off, w.launch->smem));
      return false;
    }
#if EMU_SANITIZE
    if (issue) wgmma_operand_read(w, off, *issue, unit, which[0] == 'A' ? "wgmma.mma_async (A operand)" : "wgmma.mma_async (B operand)");
#else
    (void)issue;
    (void)unit;
#endif
    uint16_t h;
    std::memcpy(&h, w.window + off, 2);
    out[size_t(r) * 16 + kk] = half_to_float(h, bf16);
    return true;
  });
}

// Accumulator i of thread t: (row, column) of D (64 x n); A's half i of thread t: (row, k).
inline int frag_row(int t, int i) { return 16 * (t / 32) + (t % 32) / 4 + 8 * ((i / 2) % 2); }
inline int frag_col(int t, int i) { return 8 * (i / 4) + 2 * (t % 4) + i % 2; }

// Runs an mma_async that its wait_group covers: checks (sanitizing) that nothing touched what it
// reads, then writes D into every live thread's accumulators.
void complete(Worker& w, Group& g, WgMma& m) {
  const int half = m.n / 2;
  std::vector<float> A(64 * 16), B;
  if (m.rs) {
    for (int t = 0; t < 128; ++t)
      for (int h = 0; h < 8; ++h) {
        const uint32_t v = m.a[t][h / 2];
        A[frag_row(t, h) * 16 + frag_col(t, h)] = half_to_float(uint16_t(h % 2 ? v >> 16 : v), m.bf16);
      }
  } else if (!read_operand(w, m.da, 64, m.trans_a, m.bf16, A, m.pc, "A")) {
    w.abandon = true;
    return;
  }
  if (!read_operand(w, m.db, m.n, m.trans_b, m.bf16, B, m.pc, "B")) {
    w.abandon = true;
    return;
  }
#if EMU_SANITIZE
  for (int t = 0; t < 128; ++t) {
    if (!m.d[t]) continue;
    for (int i = 0; i < half; ++i)
      if (std::memcmp(&m.d[t][i], &m.expect[size_t(t) * half + i], 4)) {
        report("async", m.pc, fmt("thread %d: accumulator %d of a wgmma.mma_async was changed while the wgmma was in "
                                  "flight (before the wgmma.wait_group that covers it)", g.first + t, i));
        break;
      }
    if (m.rs && m.a_ptr[t] && std::memcmp(m.a_ptr[t], m.a[t], 16))
      report("async", m.pc, fmt("thread %d: an A register of a wgmma.mma_async (RS) was changed while the wgmma was "
                                "in flight", g.first + t));
  }
  const bool a_written = !m.rs && std::memcmp(A.data(), m.a_issue.data(), A.size() * 4);
  if (a_written || std::memcmp(B.data(), m.b_issue.data(), B.size() * 4))
    report("async", m.pc, fmt("shared memory that an in-flight wgmma.mma_async reads (its %s operand) was written "
                              "before the wgmma.wait_group that covers it", a_written ? "A" : "B"));
  const int unit = group_unit(w, g.first / 128);
  end_operand_reads(w, m, unit);
  for (int t = 0; t < g.threads; ++t) {  // each thread's wait acquires the read's end
    uint32_t& c = w.fibers[size_t(g.first + t)].vc[size_t(unit)];
    c = std::max(c, m.vc[size_t(unit)]);
  }
#endif
  for (int t = 0; t < 128; ++t) {
    if (!m.d[t]) continue;
    for (int i = 0; i < half; ++i) {
      const int row = frag_row(t, i), col = frag_col(t, i);
      float acc = m.scale_d ? m.d[t][i] : 0.f;
      for (int kk = 0; kk < 16; ++kk) acc += A[row * 16 + kk] * B[size_t(col) * 16 + kk];
      m.d[t][i] = acc;
    }
  }
  // wgmmas still in flight on the same accumulators chain onto this one's result
  auto chain = [&](WgMma& later) {
    if (later.n != m.n) return;
    for (int t = 0; t < 128; ++t)
      if (m.d[t] && later.d[t] == m.d[t]) std::memcpy(&later.expect[size_t(t) * half], m.d[t], size_t(half) * 4);
  };
  for (auto& batch : g.committed)
    for (WgMma& later : batch) if (&later != &m) chain(later);
  for (WgMma& later : g.open) chain(later);
}

// setmaxnreg against the block's register pool (PTX ISA 9.7.19.5): the block starts with ptxas's count
// per thread in every warp and an empty pool; .dec gives the difference back to the pool, .inc takes it
// from the pool and blocks until the pool holds it. Only .dec fills the pool (a warp that exits gives
// nothing back), so an .inc that asks more than the other warpgroups released waits for ever: the
// block's deadlock finding names the counts.
int held_registers(const Worker& w, const Group& g) { return g.regs ? g.regs : (w.launch->registers + 7) / 8 * 8; }

bool serve_registers(Worker& w, Group& g) {
  const int need = (g.want - held_registers(w, g)) * g.threads;
  if (need > w.reg_pool) return false;
  w.reg_pool -= need;
  g.regs = g.want;
  g.want = 0;
  return true;
}

void set_registers(Worker& w, Group& g) {
  const bool inc = g.arg > 0;
  const int count = inc ? g.arg : -g.arg, held = held_registers(w, g);
  if (w.launch->registers <= 0) {  // ptxas's count unknown: the pool is not tracked
    g.regs = count;
    return;
  }
  if (inc ? count < held : count > held) {
    report("wgmma", g.pc, fmt("warpgroup %d: setmaxnreg.%s %d while it holds %d registers per thread (.inc must raise "
                              "the count, .dec lower it)", g.first / 128, inc ? "inc" : "dec", count, held));
    g.regs = count;
    return;
  }
  if (!inc) {
    w.reg_pool += (held - count) * g.threads;
    g.regs = count;
    for (Group& o : w.wgroups)  // a release may serve a warpgroup waiting in .inc
      if (o.want && serve_registers(w, o))
        for (int t = 0; t < o.threads; ++t)
          if (w.fibers[size_t(o.first + t)].st == St::Pool) wake(w, w.fibers[size_t(o.first + t)]);
    return;
  }
  g.want = count;
  serve_registers(w, g);  // else the warpgroup waits (group_op)
}

// The last thread of the warpgroup to arrive carries the operation out for all 128.
void run_group_op(Worker& w, Group& g) {
  Fiber* th = &w.fibers[g.first];
  switch (g.op) {
    case WgOp::Fence:
      g.fenced = true;
      break;
    case WgOp::Mma: {
      const WgPost& p = th[0].wg;
      for (int t = 1; t < 128; ++t) {
        const WgPost& q = th[t].wg;
        if (q.n != p.n || q.flags != p.flags || q.da != p.da || q.db != p.db || (q.a == nullptr) != (p.a == nullptr)) {
          report("wgmma", g.pc, fmt("warpgroup %d: thread %d issued wgmma.mma_async with other descriptors or shape than "
                                    "thread %d (they must be the same across the warpgroup)", g.first / 128, g.first + t,
                                    g.first));
          w.abandon = true;
          return;
        }
      }
      if (EMU_SANITIZE && !g.fenced)
        report("async", g.pc, fmt("warpgroup %d: wgmma.mma_async with no wgmma.fence since the warpgroup's accumulators "
                                  "were last its threads' (its start, or a wgmma.wait_group)", g.first / 128));
      WgMma m;
      m.n = p.n;
      m.bf16 = p.flags & 1;
      m.scale_d = p.flags & 2;
      m.trans_a = (p.flags >> 2) & 1;
      m.trans_b = (p.flags >> 3) & 1;
      m.rs = p.a != nullptr;
      m.da = p.da;
      m.db = p.db;
      m.pc = g.pc;
      const int half = m.n / 2;
      m.expect.resize(size_t(128) * half);
      for (int t = 0; t < 128; ++t) {
        m.d[t] = th[t].wg.d;
        std::memcpy(&m.expect[size_t(t) * half], m.d[t], size_t(half) * 4);  // chained: complete() updates it
        if (m.rs) {
          m.a_ptr[t] = th[t].wg.a;
          std::memcpy(m.a[t], th[t].wg.a, 16);
        }
      }
#if EMU_SANITIZE
      m.vc = th[0].vc;  // the operands are read once all 128 threads have issued
      for (int t = 1; t < 128; ++t) vc_join(m.vc, th[t].vc);
      const int unit = group_unit(w, g.first / 128);
      if ((!m.rs && !read_operand(w, m.da, 64, m.trans_a, m.bf16, m.a_issue, m.pc, "A", &m, unit)) ||
          !read_operand(w, m.db, m.n, m.trans_b, m.bf16, m.b_issue, m.pc, "B", &m, unit)) {
        w.abandon = true;
        return;
      }
#endif
      g.open.push_back(std::move(m));
      break;
    }
    case WgOp::Commit:
      g.committed.push_back(std::move(g.open));
      g.open.clear();
      break;
    case WgOp::Wait:
      while (int(g.committed.size()) > g.arg && !w.abandon) {
        for (WgMma& m : g.committed.front()) {
          complete(w, g, m);
          if (w.abandon) return;
        }
        g.committed.pop_front();
      }
      g.fenced = false;
      break;
    case WgOp::Setmaxnreg:
      set_registers(w, g);
      break;
    case WgOp::None:
      break;
  }
}

// Every thread of the warpgroup posts its operands; the last to arrive runs the operation for all.
void group_op(WgOp op, const void* pc, int arg = 0) {
  Worker& w = *tw;
  Fiber& f = *w.cur;
  Group& g = w.wgroups[f.tid / 128];
  if (g.threads < 128 || g.live < 128) {
    report("barrier", pc, fmt("warpgroup %d: %s with %d live threads (needs all 128 of 4 whole warps)", f.tid / 128,
                              wg_name(op), g.threads < 128 ? g.threads : g.live));
    w.abandon = true;
    yield(w, f);
  }
  if (g.arrived == 0) { g.op = op; g.pc = pc; g.arg = arg; }
  else if (g.op != op || g.arg != arg || (EMU_SANITIZE && g.pc != pc)) {
    report("barrier", pc, fmt("warpgroup %d: thread %d reached %s while threads wait in %s elsewhere (warpgroup "
                              "operations must be reached by all 128 threads at the same place)",
                              f.tid / 128, f.tid, wg_name(op), wg_name(g.op)));
    if (g.op != op || g.arg != arg) { w.abandon = true; yield(w, f); }
  }
  if (++g.arrived == g.live) {
    run_group_op(w, g);
    g.arrived = 0;
    for (int t = 0; t < 128; ++t) {  // setmaxnreg.inc the pool cannot serve yet: all wait
      Fiber& o = w.fibers[size_t(g.first + t)];
      if (o.st != St::Group) continue;
      if (g.want) o.st = St::Pool;
      else wake(w, o);
    }
    if (g.want) {
      f.st = St::Pool;
      yield(w, f);
    }
    if (w.abandon) yield(w, f);
    return;
  }
  f.st = St::Group;
  yield(w, f);
}

// A thread leaving the kernel: what its warpgroup still has in flight no longer writes its registers.
void group_exit(Worker& w, Fiber& f) {
  if (f.tid / 128 >= int(w.wgroups.size())) return;
  Group& g = w.wgroups[f.tid / 128];
  --g.live;
  const int t = f.tid - g.first;
  for (auto& batch : g.committed)
    for (WgMma& m : batch) m.d[t] = nullptr;
  for (WgMma& m : g.open) m.d[t] = nullptr;
  if (g.arrived > 0) {
    report("barrier", g.pc, fmt("warpgroup %d: thread %d exited while %d threads wait in %s", f.tid / 128, f.tid,
                                g.arrived, wg_name(g.op)));
    w.abandon = true;
  }
}

}  // namespace

void wgmma_fence() { group_op(WgOp::Fence, __builtin_return_address(0)); }

void fence_proxy_async() { ++tw->cur->proxy_fences; }

void wgmma(float* d, int n, const uint32_t* a, uint64_t desc_a, uint64_t desc_b, bool scale_d, int trans_a, int trans_b,
           bool bf16) {
  Fiber& f = *tw->cur;
  f.wg = WgPost{d, a, a ? 0 : desc_a, desc_b, n, int(bf16) | int(scale_d) << 1 | (trans_a & 1) << 2 | (trans_b & 1) << 3, 0};
  group_op(WgOp::Mma, __builtin_return_address(0));
}

void wgmma_commit() { group_op(WgOp::Commit, __builtin_return_address(0)); }

void wgmma_wait(int pending) { group_op(WgOp::Wait, __builtin_return_address(0), pending); }

}  // namespace emu
