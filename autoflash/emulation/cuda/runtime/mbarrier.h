// sm_90's synchronisation on the emulator (included once, by runtime.cpp): mbarriers as the PTX ISA's
// phase state machine (9.7.13.15), named barriers with a thread count (bar.sync / bar.arrive),
// elect.sync, setmaxnreg.
//
// An mbarrier lives in the runtime, keyed by its shared offset (8-aligned): init gives it `count`
// expected arrivals; a phase completes when every arrival has come and its transaction bytes
// (arrive.expect_tx, less what complete_tx, i.e. TMA, delivered) are 0, and the next begins.
// try_wait.parity p reports whether the phase of parity p has completed: on a fresh barrier parity 1
// passes at once (the "phase before"), parity 0 waits for the first completion. A thread whose wait
// fails yields; it runs again once some phase has completed.
//
// Findings (kind "mbarrier"): use before init; init of a live barrier; more arrivals, or more bytes
// completed, than the phase expects; a deadlock in which threads wait on phases that never complete
// (named with the barrier's pending arrivals and bytes); a block that ends with a phase part-way
// (arrivals or transaction bytes that do not balance). Named barriers: a thread count that is not
// whole warps or differs among the arrivals (kind "barrier"). setmaxnreg: a count outside 24..256
// or not a multiple of 8, or differing across the warpgroup; an .inc the block's register pool can
// never serve is a deadlock (runtime/wgmma.h set_registers).
//
// For the race check (sanitizing), arrivals release into the phase and a wait that passes acquires
// what the completed phase released; a named barrier's waiters acquire what that generation's
// arrivals released (runtime/order.h): only the threads a barrier connects are ordered. A named
// barrier id used with different thread counts in one block is a finding (kind "barrier"), even
// where the generations never overlap.
#pragma once

namespace emu {
namespace {

void warp_op(Op op, const void* pc);  // runtime.cpp

Mbar* find_mbar(Worker& w, uint32_t bar, const void* pc, const char* what) {
  if (bar % 8 || bar + 8 > w.launch->smem) {
    report(bar % 8 ? "misaligned" : "out-of-bounds", pc,
           fmt("%s on an mbarrier at shared offset %u (it takes 8 bytes, 8-aligned, inside the block's %zu)", what, bar,
               w.launch->smem));
    w.abandon = true;
    return nullptr;
  }
  auto it = w.mbars.find(bar);
  if (it == w.mbars.end()) {
    report("mbarrier", pc, fmt("%s on shared offset %u before any mbarrier.init there", what, bar));
    w.abandon = true;
    return nullptr;
  }
  return &it->second;
}

void complete_phase_if_done(Worker& w, Mbar& m, uint32_t bar) {
  if (m.pending == 0 && m.tx == 0) {
#if EMU_SANITIZE
    m.done[m.phase & 1] = m.vc;  // what a wait for this phase's parity acquires
    std::fill(m.vc.begin(), m.vc.end(), 0u);
#endif
    ++m.phase;
    m.pending = m.expected;
    ++w.phases;
    if (w.launch->sched == Sched::Wake || (w.launch->sched == Sched::Random && next_random(w) % 2)) {
      for (Fiber& f : w.fibers)  // its waiters look again at once
        if (f.st == St::Spin && f.spin_bar == bar) wake(w, f);
    }
  }
}

// complete_tx: `bytes` of the current phase's transactions have landed (a TMA load, runtime/tma.h).
void complete_tx(Worker& w, Mbar& m, uint32_t bar, uint32_t bytes, const void* pc, const Stack* at) {
  m.tx -= bytes;
  if (m.tx < 0) {
    report("mbarrier", pc, fmt("mbarrier at shared offset %u: %u bytes completed beyond the transaction bytes phase %u "
                               "expects", bar, bytes, m.phase), at);
    m.tx = 0;
  }
  complete_phase_if_done(w, m, bar);
}

// A block that ran to its end leaves every mbarrier between phases: arrivals and bytes balanced.
void check_mbarriers_balanced(Worker& w) {
  for (const auto& [bar, m] : w.mbars)
    if (m.pending != m.expected || m.tx != 0)
      report("mbarrier", nullptr, fmt("the block ended with the mbarrier at shared offset %u part-way through phase %u: "
                                      "%d of its %d arrivals and %lld transaction bytes still pending (arrivals or "
                                      "bytes that do not balance)", bar, m.phase, m.pending, m.expected, m.tx));
}

}  // namespace

void mbarrier_init(uint32_t bar, uint32_t count) {
  Worker& w = *tw;
  const void* pc = __builtin_return_address(0);
  if (bar % 8 || bar + 8 > w.launch->smem) {
    find_mbar(w, bar, pc, "mbarrier.init");
    return;
  }
  if (count < 1 || count >= (1u << 20)) {
    report("mbarrier", pc, fmt("mbarrier.init at shared offset %u with count %u (expected 1 .. 2^20 - 1)", bar, count));
    w.abandon = true;
    return;
  }
  if (w.mbars.count(bar)) {
    report("mbarrier", pc, fmt("mbarrier.init at shared offset %u: the mbarrier there is live (initialised before, "
                               "phase %u)", bar, w.mbars[bar].phase));
    return;
  }
  Mbar m;
  m.pending = m.expected = int(count);
#if EMU_SANITIZE
  m.vc.assign(size_t(w.agents), 0);
  m.done[0] = m.done[1] = m.vc;
#endif
  w.mbars[bar] = m;
}

void mbarrier_arrive(uint32_t bar, uint32_t expect_tx_bytes) {
  Worker& w = *tw;
  const void* pc = __builtin_return_address(0);
  Mbar* m = find_mbar(w, bar, pc, expect_tx_bytes ? "mbarrier.arrive.expect_tx" : "mbarrier.arrive");
  if (!m) { yield(w, *w.cur); return; }
  m->tx += expect_tx_bytes;
  if (m->pending == 0 || --m->pending < 0) {
    report("mbarrier", pc, fmt("mbarrier at shared offset %u: thread %d arrives beyond the %d arrivals of phase %u",
                               bar, w.cur->tid, m->expected, m->phase));
    m->pending = 0;
    return;
  }
#if EMU_SANITIZE
  vc_join(m->vc, w.cur->vc);
  tick(*w.cur);
#endif
  complete_phase_if_done(w, *m, bar);
}

bool mbarrier_try_wait(uint32_t bar, uint32_t parity) {
  Worker& w = *tw;
  Fiber& f = *w.cur;
  Mbar* m = find_mbar(w, bar, __builtin_return_address(0), "mbarrier.try_wait");
  if (!m) { yield(w, f); return false; }
  if ((m->phase & 1) != (parity & 1)) {
#if EMU_SANITIZE
    vc_join(f.vc, m->done[parity & 1]);
#endif
    return true;
  }
  f.st = St::Spin;
  f.spin_bar = bar;
  f.spin_parity = parity & 1;
  yield(w, f);
  return false;
}

void named_barrier(int id, int threads, bool wait) {
  Worker& w = *tw;
  Fiber& f = *w.cur;
  const void* pc = __builtin_return_address(0);
  if (id < 0 || id > 15 || threads <= 0 || threads % 32 || threads > w.launch->threads) {
    report("barrier", pc, fmt("%s %d, %d: expected a barrier 0..15 and a thread count of whole warps up to the block's %d",
                              wait ? "bar.sync" : "bar.arrive", id, threads, w.launch->threads));
    w.abandon = true;
    yield(w, f);
  }
  NamedBar& b = w.named[id];
  if (b.first_count == 0) { b.first_count = threads; b.first_pc = pc; }
  if (b.arrived == 0) { b.count = threads; b.pc = pc; }
  else if (b.count != threads)
    report("barrier", pc, fmt("named barrier %d: thread %d arrives for %d threads, the threads before it for %d", id,
                              f.tid, threads, b.count));
#if EMU_SANITIZE
  if (threads != b.first_count)
    report("barrier", pc, fmt("named barrier %d used for %d threads here and for %d at %s: every use of one id in a "
                              "block must give the same count", id, threads, b.first_count,
                              site(code_offset(b.first_pc)).c_str()));
  vc_join(b.vc, f.vc);  // this arrival releases into the generation
  tick(f);
#endif
  if (++b.arrived >= b.count) {
    for (Fiber& o : w.fibers)
      if (o.st == St::Named && o.named == id) {
        wake(w, o);
#if EMU_SANITIZE
        vc_join(o.vc, b.vc);
#endif
      }
#if EMU_SANITIZE
    if (wait) vc_join(f.vc, b.vc);
    std::fill(b.vc.begin(), b.vc.end(), 0u);
#endif
    b.arrived = 0;
    return;
  }
  if (wait) {
    f.st = St::Named;
    f.named = id;
    yield(w, f);
  }
}

bool elect_one() {
  Fiber& f = *tw->cur;
  warp_op(Op::Elect, __builtin_return_address(0));
  return f.ou[0] != 0;
}

void setmaxnreg(int regs, bool inc) {
  const void* pc = __builtin_return_address(0);
  if (regs < 24 || regs > 256 || regs % 8)
    report("wgmma", pc, fmt("setmaxnreg.%s %d: expected 24 .. 256, a multiple of 8", inc ? "inc" : "dec", regs));
  group_op(WgOp::Setmaxnreg, pc, inc ? regs : -regs);
}

}  // namespace emu
