// The runtime's state (included once, by runtime.cpp): fibers, warps, the running launch and block,
// and the findings every check reports into.
#pragma once
#include <dlfcn.h>
#include <execinfo.h>

#include <atomic>
#include <cstdarg>
#include <deque>
#include <map>
#include <cstdio>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "runtime/fiber.h"

namespace emu {
namespace {

constexpr size_t kStack = 256 * 1024;
constexpr int kMaxFindings = 200;

// Bar: __syncthreads; Warp / Group: a warp or warpgroup operation; Named: bar.sync; Spin: an mbarrier
// try_wait that found its phase incomplete (run again once some phase completes); Pool: a warpgroup's
// setmaxnreg.inc waiting for the block's register pool to hold what it asks.
enum class St : uint8_t { Run, Bar, Warp, Group, Named, Spin, Pool, Done };
enum class Op : uint8_t { None, Shfl, Ldmatrix, LdmatrixT, MmaF16, MmaBF16, Syncwarp, Elect, Stmatrix, StmatrixT };
const char* op_name(Op op) {
  switch (op) {
    case Op::Shfl: return "__shfl_xor_sync";
    case Op::Ldmatrix: return "ldmatrix";
    case Op::LdmatrixT: return "ldmatrix.trans";
    case Op::MmaF16: case Op::MmaBF16: return "mma.sync";
    case Op::Syncwarp: return "__syncwarp";
    case Op::Elect: return "elect.sync";
    case Op::Stmatrix: return "stmatrix";
    case Op::StmatrixT: return "stmatrix.trans";
    default: return "?";
  }
}

struct Copy { unsigned char* dst; const unsigned char* src; bool valid; unsigned char bytes; const void* pc; };

// wgmma (runtime/wgmma.h). A thread's operands of a warpgroup operation:
enum class WgOp : uint8_t { None, Fence, Mma, Commit, Wait, Setmaxnreg };
struct WgPost {
  float* d = nullptr;          // its accumulators (n / 2)
  const uint32_t* a = nullptr;  // its A registers (RS), else null
  uint64_t da = 0, db = 0;
  int n = 0, flags = 0, arg = 0;
};
// One wgmma.mma_async in flight: what it was issued with, per thread of the warpgroup.
struct WgMma {
  int n = 0, trans_a = 0, trans_b = 0;
  bool bf16 = false, scale_d = false, rs = false;
  uint64_t da = 0, db = 0;
  const void* pc = nullptr;
  float* d[128] = {};              // null once the thread has exited
  const uint32_t* a_ptr[128] = {};
  uint32_t a[128][4] = {};         // RS: the A registers as issued (the hardware reads them then)
  std::vector<float> expect;       // each thread's accumulators as this wgmma must find them at completion
  std::vector<float> a_issue, b_issue;  // sanitizing: the shared operands as they were at issue
  std::vector<uint32_t> vc;        // sanitizing: the join of the issuing threads' clocks (runtime/order.h)
};
// mbarrier state (runtime/mbarrier.h), by shared offset: the PTX ISA's phase state machine.
struct Mbar {
  uint32_t phase = 0;  // phases completed
  int pending = 0, expected = 0;
  long long tx = 0;    // transaction bytes still to land in the current phase
  // Sanitizing (runtime/order.h): what the current phase's arrivals and completed transactions
  // release, what each parity's last completed phase released (a wait that passes acquires it), and
  // the agent that the bytes of TMA loads completing on this barrier are written by.
  std::vector<uint32_t> vc, done[2];
  int unit = -1;
};
// A call stack, kept for a finding made later than its cause (report()).
struct Stack {
  void* frames[24];
  int n = 0;
  void capture() { n = backtrace(frames, 24); }
};

// TMA (runtime/tma.h): a decoded tensor map, a load in flight (the block's), a store in flight (its
// thread's, in bulk groups).
struct TensorMap {
  uint64_t addr = 0;
  int dtype = 0, rank = 0, esize = 0, interleave = 0, swizzle = 0, l2 = 0, fill = 0;
  uint64_t dim[5] = {1, 1, 1, 1, 1}, stride[5] = {};  // stride[0]: the element size
  uint32_t box[5] = {1, 1, 1, 1, 1}, estride[5] = {1, 1, 1, 1, 1};
  uint32_t span() const { return swizzle == 1 ? 32 : swizzle == 2 ? 64 : swizzle == 3 ? 128 : 0; }
  uint32_t count(int d) const { return d == 0 ? box[0] : (box[d] + estride[d] - 1) / estride[d]; }  // elements along d
  uint64_t elements() const {
    uint64_t n = 1;
    for (int d = 0; d < rank; ++d) n *= count(d);
    return n;
  }
};

struct TmaLoad {
  TensorMap map;
  int32_t c[5] = {};
  uint32_t dst = 0, bar = 0;
  int tid = 0;
  const void* pc = nullptr;
  Stack issued;  // where the kernel issued it: the place of findings made when it lands
  std::vector<uint32_t> vc;  // sanitizing: the issuing thread's clocks at issue (released when it lands)
};
struct TmaStore {
  TensorMap map;
  int32_t c[5] = {};
  uint32_t src = 0;
  bool add_f32 = false;  // cp.reduce.async.bulk .add.f32: adds the floats instead of writing them
  const void* pc = nullptr;
  Stack issued;
  std::vector<unsigned char> bytes;  // the box as read at issue
};
// A named barrier (bar.sync / bar.arrive id, count): this generation's arrivals, and (sanitizing) the
// join of their clocks, which the generation's waiters acquire; the count and place of the id's first
// use in the block (every use of one id must give the same count).
struct NamedBar {
  int arrived = 0, count = 0;
  const void* pc = nullptr;
  int first_count = 0;
  const void* first_pc = nullptr;
  std::vector<uint32_t> vc;
};
// A warpgroup: 4 consecutive warps, 128 threads from a multiple of 128.
struct Group {
  int arrived = 0, live = 0, first = 0, threads = 0;
  WgOp op = WgOp::None;
  int arg = 0;                      // wait_group's N, setmaxnreg's count (negative: .dec)
  int regs = 0;                     // registers per thread it holds after setmaxnreg (0: ptxas's count at entry)
  int want = 0;                     // a setmaxnreg.inc count the pool could not serve yet (0: none)
  const void* pc = nullptr;
  bool fenced = false;              // a wgmma.fence since the accumulators were last the threads' (a wait)
  std::vector<WgMma> open;          // issued since the last commit_group
  std::deque<std::vector<WgMma>> committed;  // oldest first
};

struct Fiber {
  Context ctx;
  dim3 idx;
  int tid = 0, warp = 0, lane = 0;
  St st = St::Run;
  std::vector<Copy> open;
  std::vector<std::vector<Copy>> groups;
  uint32_t u[6] = {};  // warp-operation operands and results
  float f[4] = {};
  uint32_t ou[4] = {};
  float of[4] = {};
  WgPost wg;
  int named = -1;        // the named barrier it waits at
  int32_t proxy_fences = 0;  // fence.proxy.async executed
  uint32_t spin_bar = 0;  // the mbarrier it spins on, and the parity
  uint32_t spin_parity = 0;
  std::vector<TmaStore> stores_open;               // TMA stores since its last cp.async.bulk.commit_group
  std::vector<std::vector<TmaStore>> store_groups;  // committed, oldest first
  // committed groups a cp.async.bulk.wait_group.read covered: their sources read, their writes still
  // pending (they land at a full wait_group or when the thread exits); all older than store_groups
  std::vector<std::vector<TmaStore>> stores_read;
  std::vector<uint32_t> vc;  // sanitizing: its vector clock (runtime/order.h)
};

struct Warp {
  int arrived = 0, live = 0, first = 0, lanes = 0;
  Op op = Op::None;
  const void* pc = nullptr;
};

struct Finding {
  std::string kind, kernel, detail, schedule;
  dim3 block;
  int thread;
  std::vector<uintptr_t> pcs;  // offsets into this library
};

struct Region {
  std::string name;
  uintptr_t base = 0, end = 0;  // the tensor's storage: any access inside it is checked
  uintptr_t origin = 0;         // its first element (0: an argument passed as a null pointer)
  int elem = 1;
  int ndim = 0;                   // dims of more than one element (an index past a 1-element dim is out anyway)
  long long shape[8], stride[8];  // of those dims, sorted by stride, largest first, in elements
  int dim[8];                     // which of the tensor's own dims each one is
  int rank = 0;                   // the tensor's own dims, for messages
  long long full_shape[8];        // the tensor's own shape
  bool nested = true;             // strides nest, so an offset decomposes into one index per dim
  bool empty = false;             // no elements at all
  // Whose rows a block may touch (emu_region_rows; -1: no rule): the index along own_z must be the
  // block's blockIdx.z, along own_y its blockIdx.y; along seg_dim it must lie in [seg[z], seg[z + 1])
  // (packed sequences: the rows of the block's sequence z). Positions into shape[] above.
  int own_z = -1, own_y = -1, seg_dim = -1;
  std::vector<long long> seg;
  std::string seg_name;
  // A paged KV cache (emu_region_pages): the index along page_dim must be one of the pages block z's
  // row of the block table names for its length, pages[z].
  int page_dim = -1;
  std::vector<std::vector<long long>> pages;
  std::string pages_name;
};

// The order the scheduler runs a block's threads in (selfcheck --schedules): Default, each runnable
// thread in turn in thread order, an mbarrier's waiters retrying only once no thread can run and TMA
// loads landing as late as they may; Wake, waiters woken as soon as their phase completes and loads
// landing as soon as they are issued; ReleasedFirst, threads a barrier, phase or warp(group) operation
// released run before the others; Random, the next thread, the waiters' wake and the loads' landing
// drawn from a seed (per block: reproducible).
enum class Sched : uint8_t { Default, Wake, ReleasedFirst, Random };

struct Launch {
  emu_entry_t entry;
  void** args;                       // into params: the launch's own copy of every argument's bytes
  std::vector<unsigned char> params;
  std::vector<void*> param_ptrs;
  const char* kernel;
  dim3 grid, block;
  size_t smem;
  int threads;
  int registers = 0;  // per thread, as ptxas gives them (0: not known; setmaxnreg's pool is then not tracked)
  Sched sched = Sched::Default;
  uint64_t seed = 0;
  std::string schedule = "default";  // its name, as findings give it
  std::atomic<long> next{0};
  std::atomic<bool> failed{false};
};

#if EMU_SANITIZE
// One shared-memory access as the race rule keeps it (runtime/order.h): the agent that made it (a
// thread, or an asynchronous unit), that agent's clock then, and the kernel's code address (an offset
// into the library) that made it.
struct Epoch {
  uint32_t clock = 0;
  int16_t agent = -1;  // -1: none
  uint32_t pc = 0;
};
constexpr int kReads = 4;  // reads kept in place per byte; a byte more agents read at once gets a row of Worker::many
struct Shadow {
  Epoch w;           // the last write
  Epoch r[kReads];   // the reads since, none ordered before another (agent -1: a free slot)
  uint8_t st = 0;    // 0 never written, 1 cp.async in flight, 2 written, 3 a TMA load in flight
  uint8_t async_reads = 0;  // asynchronous reads of the byte in flight (wgmma operands, bulk stores' sources)
  int32_t many = 0;  // its reads are row many - 1 of Worker::many instead (0: they are r[])
  int32_t wP = 0;    // the writer's fence.proxy.async count when it wrote (runtime/wgmma.h's proxy check); -1: the
                     // async proxy wrote it (a TMA load)
};
#endif

struct Worker {
  Context sched;
  Launch* launch = nullptr;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::vector<Group> wgroups;
  std::map<uint32_t, Mbar> mbars;
  std::vector<TmaLoad> tma_loads;  // issued, not yet landed
  NamedBar named[16];
  uint64_t phases = 0, phases_seen = 0;  // mbarrier phases completed; as many when spinners last woke
  int reg_pool = 0;  // registers setmaxnreg.dec gave back that no .inc has taken (tracked where Launch::registers is known)
  unsigned char* stacks = nullptr;
  Fiber* cur = nullptr;
  std::deque<int> released;  // Sched::ReleasedFirst: threads released, to run before the others
  uint64_t rng = 0;          // Sched::Random's state
  dim3 block;
  int live = 0, bar_arrived = 0;
  const void* bar_pc = nullptr;
  bool abandon = false;
  unsigned char* window = nullptr;
#if EMU_SANITIZE
  std::vector<Shadow> shadow;
  std::vector<uint32_t> many;    // rows of `agents` clocks: each agent's latest read of a byte read by more than kReads at once
  std::vector<uint32_t> many_pc; // per row: the code offset of its latest read
  std::vector<uint32_t> many_gen;  // per row: the __syncthreads completed before its latest read (bar_gen)
  uint32_t bar_gen = 0;          // __syncthreads completed in the block
  std::vector<int32_t> many_free;  // rows to reuse
  int agents = 0;                                       // threads, then warpgroups' wgmma units, then TMA units
  std::vector<uint32_t> unit_clock;                     // each asynchronous unit's clock
  int units_used = 0;                                   // TMA units handed to mbarriers
  // Memory the kernel reaches that is the runtime's, not a tensor's: the worker, its fibers (threadIdx),
  // the launch (gridDim, blockDim) and its parameter copies (the entry reads its arguments there).
  std::vector<std::pair<uintptr_t, uintptr_t>> owned;
#endif
};

thread_local Worker* tw = nullptr;

std::mutex g_mu;  // findings and regions
std::vector<Finding> g_findings;
std::set<std::pair<std::string, uintptr_t>> g_seen;
std::vector<Region> g_regions;
uintptr_t g_lib_base = 0;

uintptr_t lib_base() {
  if (!g_lib_base) {
    Dl_info info;
    if (dladdr(reinterpret_cast<void*>(&lib_base), &info)) g_lib_base = reinterpret_cast<uintptr_t>(info.dli_fbase);
  }
  return g_lib_base;
}

// Records a finding once per (kind, place); `pc` is the kernel's code address that made it, `frames`
// the stack it was made from (by default the caller's; a deferred check, such as a TMA load landing,
// passes the stack captured when the kernel issued it). Without EMU_SANITIZE every finding is an error
// that fails the launch.
void report(const char* kind, const void* pc, std::string detail, const Stack* at = nullptr) {
  Worker* w = tw;
  Stack here;
  if (!at) {
    here.capture();
    at = &here;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  if (w) w->launch->failed.store(true);
  if (!g_seen.insert({kind, reinterpret_cast<uintptr_t>(pc)}).second || int(g_findings.size()) >= kMaxFindings) return;
  Finding f;
  f.kind = kind;
  f.kernel = w ? w->launch->kernel : "";
  f.schedule = w ? w->launch->schedule : "default";
  f.detail = std::move(detail);
  f.block = w ? w->block : dim3{};
  f.thread = w && w->cur ? w->cur->tid : -1;
  const uintptr_t base = lib_base();
  f.pcs.push_back(reinterpret_cast<uintptr_t>(pc) - base - 1);  // the call, not the return address
  for (int i = 0; i < at->n; ++i) f.pcs.push_back(reinterpret_cast<uintptr_t>(at->frames[i]) - base - 1);
  g_findings.push_back(std::move(f));
}

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

// A 16-bit tensor-core operand (bf16 or fp16) as a float: what mma.sync and wgmma read.
float half_to_float(uint16_t h, bool bf16) {
  if (bf16) { uint32_t x = uint32_t(h) << 16; float f; std::memcpy(&f, &x, 4); return f; }
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return float(x);
}

// Back to the scheduler; a fiber of a block that was given up (w.abandon) is never resumed.
void yield(Worker& w, Fiber& f) { ctx_switch(f.ctx, w.sched); }

// A waiting thread may go on (released by a barrier, a phase, a warp or warpgroup operation).
void wake(Worker& w, Fiber& f) {
  f.st = St::Run;
  if (w.launch->sched == Sched::ReleasedFirst) w.released.push_back(f.tid);
}

uint64_t next_random(Worker& w) {  // splitmix64
  uint64_t z = (w.rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace
}  // namespace emu
