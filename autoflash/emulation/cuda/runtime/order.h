// Happens-before for the sanitizer's race rule (included once, by runtime.cpp, built with
// EMU_SANITIZE=1): a vector clock per agent, joined at every synchronisation as the hardware orders
// the participants, so two shared-memory accesses race exactly when no chain of synchronisation
// connects them, whatever order the emulator happened to run the threads in.
//
// Agents: the block's threads (0 .. threads-1); one asynchronous unit per warpgroup, whose clock
// ticks as the warpgroup's wgmma.mma_async finish reading their shared operands; and one per
// mbarrier that TMA loads complete on (kUnits, shared round-robin past that), whose clock ticks as
// such a load lands. Each agent's own entry counts its releases; an access is kept as the agent's
// Epoch (agent, clock) and is ordered before an agent whose clock vector holds at least that clock.
//
//   __syncthreads          the block's live threads: each leaves with the join of all.
//   bar.sync / bar.arrive  a named barrier's generation: each arrival releases into it; the threads
//                          that wait (bar.sync) leave with the join of that generation's arrivals,
//                          groups formed in arrival order, as the hardware forms them.
//   __syncwarp             the warp's live lanes, as __syncthreads for the block.
//   mbarrier               arrive (and arrive.expect_tx) releases into the current phase; a landed
//                          TMA load releases its issuer's clocks at issue and its unit's write; a
//                          try_wait that passes acquires what the completed phase of its parity released.
//   wgmma                  operands are read from issue (checked against the join of the 128 issuers'
//                          clocks) until the wait_group that covers them, when the read is kept as the
//                          warpgroup's unit's and every thread of the warpgroup acquires it.
//   cp.async               a copy's shared write is checked at issue and kept at the thread's
//                          wait_group that lands it; a bulk store or reduction's source read is
//                          checked at issue and kept at the wait_group (.read or not) that covers it.
//   TMA load               checked at issue against the issuer's clocks (the stage must be free then),
//                          kept as its mbarrier unit's write when it lands.
// Reads in flight (wgmma operands, bulk sources) are counted per byte: a write meanwhile is a finding.
#pragma once

#include <algorithm>

#include "runtime/state.h"

#if EMU_SANITIZE
namespace emu {
namespace {

constexpr int kUnits = 32;  // TMA units (one per mbarrier up to this many)

int group_unit(const Worker& w, int group) { return w.launch->threads + group; }

// The TMA unit of the mbarrier at `bar`, handed out in order of first use.
int mbar_unit(Worker& w, Mbar& m) {
  if (m.unit < 0) m.unit = w.launch->threads + int(w.wgroups.size()) + (w.units_used++ % kUnits);
  return m.unit;
}

void vc_join(std::vector<uint32_t>& into, const std::vector<uint32_t>& from) {
  for (size_t i = 0; i < into.size() && i < from.size(); ++i) into[i] = std::max(into[i], from[i]);
}

// After a release, the agent's later accesses are not covered by what it released.
void tick(Fiber& f) { ++f.vc[size_t(f.tid)]; }

bool ordered(const Epoch& e, const std::vector<uint32_t>& vc) { return e.agent < 0 || e.clock <= vc[size_t(e.agent)]; }

uint32_t code_offset(const void* pc) { return uint32_t(reinterpret_cast<uintptr_t>(pc) - lib_base() - 1); }

void order_block_start(Worker& w) {
  w.agents = w.launch->threads + int(w.wgroups.size()) + kUnits;
  w.unit_clock.assign(size_t(w.agents), 0);
  w.units_used = 0;
  w.many.clear();
  w.many_pc.clear();
  w.many_gen.clear();
  w.many_free.clear();
  w.bar_gen = 0;
  for (Fiber& f : w.fibers) {
    f.vc.assign(size_t(w.agents), 0);
    f.vc[size_t(f.tid)] = 1;
  }
  for (NamedBar& b : w.named) b.vc.assign(size_t(w.agents), 0);
}

// __syncthreads (or __syncwarp over a warp's lanes): every participant leaves with the join of all.
template <class Range>
void order_all(Range&& fibers) {
  if (!fibers.empty() && size_t(tw->launch->threads) == fibers.size()) ++tw->bar_gen;  // the whole block
  std::vector<uint32_t> j;
  for (Fiber* f : fibers) {
    if (j.empty()) j = f->vc;
    else vc_join(j, f->vc);
  }
  for (Fiber* f : fibers) {
    f->vc = j;
    tick(*f);
  }
}

// The names of an agent and of a code offset in a finding's text: "thread 37", "warpgroup 1's
// wgmma.mma_async", "a TMA load", and {pc:HEX}, which the Python side replaces with the template line.
std::string agent_name(const Worker& w, int agent) {
  const int threads = w.launch->threads, groups = int(w.wgroups.size());
  if (agent < threads) return fmt("thread %d", agent);
  if (agent < threads + groups) return fmt("warpgroup %d's wgmma.mma_async (an operand read)", agent - threads);
  return "a TMA load";
}
std::string site(uint32_t pc) { return fmt("{pc:%x}", pc); }

// A byte's reads are forgotten (a write ordered after them all replaces them).
void clear_reads(Worker& w, Shadow& s) {
  for (Epoch& e : s.r) e.agent = -1;
  if (s.many) {
    w.many_free.push_back(s.many - 1);
    s.many = 0;
  }
}

// A row of `agents` clocks for a byte that more agents read at once than kReads holds: FastTrack's
// read vector clock, kept only for such bytes.
int32_t many_row(Worker& w) {
  const size_t a = size_t(w.agents);
  int32_t row;
  if (!w.many_free.empty()) {
    row = w.many_free.back();
    w.many_free.pop_back();
    std::fill(w.many.begin() + std::ptrdiff_t(size_t(row) * a), w.many.begin() + std::ptrdiff_t(size_t(row + 1) * a), 0u);
  } else {
    row = int32_t(w.many_pc.size());
    w.many.resize(size_t(row + 1) * a, 0u);
    w.many_pc.push_back(0);
    w.many_gen.push_back(0);
  }
  return row;
}

// An access of shared byte `i` by `agent` with clocks `vc`: a finding if an earlier access it
// conflicts with is not ordered before it; then kept (a write replaces everything, a read joins the
// reads it is not ordered after). `keep`: false to check only (an access whose effect comes later).
bool order_access(Worker& w, size_t i, bool write, int agent, const std::vector<uint32_t>& vc, const void* pc,
                  const char* what, bool keep = true) {
  Shadow& s = w.shadow[i];
  if (!ordered(s.w, vc)) {
    report("race", pc, fmt("%s %s shared offset %zu, which %s wrote at %s with no synchronisation ordering the two "
                           "(__syncthreads, a named barrier, an mbarrier phase, __syncwarp)", what,
                           write ? "writes" : "reads", i, agent_name(w, s.w.agent).c_str(), site(s.w.pc).c_str()));
    return false;
  }
  if (write) {
    if (s.async_reads) {
      report("async", pc, fmt("%s writes shared offset %zu while an asynchronous read of it (a wgmma.mma_async operand "
                              "or a bulk store's source) is in flight", what, i));
      return false;
    }
    auto check_read = [&](const Epoch& e) {
      if (ordered(e, vc)) return true;
      report("race", pc, fmt("%s writes shared offset %zu, which %s read at %s with no synchronisation ordering the "
                             "two (__syncthreads, a named barrier, an mbarrier phase, __syncwarp)", what, i,
                             agent_name(w, e.agent).c_str(), site(e.pc).c_str()));
      return false;
    };
    for (const Epoch& e : s.r)
      if (!check_read(e)) return false;
    // Reads before a __syncthreads of the whole block (every thread still live) are ordered before
    // everything after it: the row need not be read.
    if (s.many && !(w.many_gen[size_t(s.many - 1)] < w.bar_gen && w.live == w.launch->threads)) {
      const uint32_t* row = &w.many[size_t(s.many - 1) * size_t(w.agents)];
      for (int a = 0; a < w.agents; ++a)
        if (row[a] && !check_read(Epoch{row[a], int16_t(a), w.many_pc[size_t(s.many - 1)]})) return false;
    }
    if (!keep) return true;
    s.w = Epoch{vc[size_t(agent)], int16_t(agent), code_offset(pc)};
    clear_reads(w, s);
    return true;
  }
  if (!keep) return true;
  const Epoch me{vc[size_t(agent)], int16_t(agent), code_offset(pc)};
  if (s.many) {
    uint32_t& c = w.many[size_t(s.many - 1) * size_t(w.agents) + size_t(agent)];
    c = std::max(c, me.clock);
    w.many_pc[size_t(s.many - 1)] = me.pc;
    w.many_gen[size_t(s.many - 1)] = w.bar_gen;
    return true;
  }
  Epoch* free = nullptr;
  for (Epoch& e : s.r) {
    if (e.agent >= 0 && ordered(e, vc)) e.agent = -1;  // ordered before this read: this one stands for it
    if (e.agent < 0 && !free) free = &e;
  }
  if (free) {
    *free = me;
    return true;
  }
  const int32_t row = many_row(w);  // every slot holds a concurrent read: the byte's reads become a row
  uint32_t* clocks = &w.many[size_t(row) * size_t(w.agents)];
  for (Epoch& e : s.r) {
    clocks[e.agent] = std::max(clocks[e.agent], e.clock);
    e.agent = -1;
  }
  clocks[agent] = std::max(clocks[agent], me.clock);
  w.many_pc[size_t(row)] = me.pc;
  w.many_gen[size_t(row)] = w.bar_gen;
  s.many = row + 1;
  return true;
}

}  // namespace
}  // namespace emu
#endif
