// The sanitizer's checks (included once, by runtime.cpp, built with EMU_SANITIZE=1): shadow state per
// byte of shared memory for races and uninitialized reads, element checks of registered tensors for
// out-of-bounds global accesses (with the rule of whose rows a block may touch in the launcher's own
// buffers, and nothing outside the launch's tensors but the runtime's own memory), alignment, and the
// ThreadSanitizer hooks the instrumented kernel calls for every plain load and store.
#pragma once
#include <link.h>

#include <algorithm>
#include <cinttypes>
#include <cstring>

#include "runtime/state.h"
#include "runtime/order.h"

#if EMU_SANITIZE
namespace emu {
namespace {


// The index along each of shape[] (largest stride first) of an element offset; false if the offset
// is no element (past a dim, or between them: a guard band, another view's data).
bool decompose(const Region& r, long long elem, long long* idx) {
  if (r.empty) return false;
  if (!r.nested) return true;
  for (int d = 0; d < r.ndim; ++d) {
    idx[d] = elem / r.stride[d];
    if (idx[d] >= r.shape[d]) return false;
    elem %= r.stride[d];
  }
  return elem == 0;
}

bool is_element(const Region& r, long long elem) {
  long long idx[8];
  return decompose(r, elem, idx);
}

// Where in the tensor an element offset falls, in the tensor's own dim order: "(0, 1, 77, 3) of shape (...)".
std::string coords(const Region& r, long long elem) {
  long long own[8] = {};
  if (!r.nested) return fmt("offset %lld (strides that do not nest)", elem);
  for (int d = 0; d < r.ndim; ++d) {
    own[r.dim[d]] = elem / r.stride[d];
    elem %= r.stride[d];
  }
  std::string s = "(";
  for (int d = 0; d < r.rank; ++d) s += fmt("%s%lld", d ? ", " : "", own[d]);
  s += ") of shape (";
  for (int d = 0; d < r.rank; ++d) s += fmt("%s%lld", d ? ", " : "", r.full_shape[d]);
  return s + ")";
}

// [first, last) of the loaded library's image (code, constants, static data): kernel code may read
// its own constant tables.
std::pair<uintptr_t, uintptr_t> lib_image() {
  struct Find { uintptr_t inside, lo, hi; };
  static const Find image = [] {
    Find f{lib_base(), 0, 0};
    dl_iterate_phdr([](dl_phdr_info* info, size_t, void* data) {
      Find& f = *static_cast<Find*>(data);
      uintptr_t lo = UINTPTR_MAX, hi = 0;
      for (int i = 0; i < info->dlpi_phnum; ++i)
        if (info->dlpi_phdr[i].p_type == PT_LOAD) {
          lo = std::min<uintptr_t>(lo, info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
          hi = std::max<uintptr_t>(hi, info->dlpi_addr + info->dlpi_phdr[i].p_vaddr + info->dlpi_phdr[i].p_memsz);
        }
      if (f.inside < lo || f.inside >= hi) return 0;  // another object
      f.lo = lo;
      f.hi = hi;
      return 1;
    }, &f);
    return f;
  }();
  return {image.lo, image.hi};
}

// Never resumed: the rest of the block is given up (the next block starts afresh). Used where going on
// would touch memory that is no tensor's (a wild or null pointer), which could crash or corrupt the host.
[[noreturn]] void abandon_block() {
  Worker& w = *tw;
  w.abandon = true;
  yield(w, *w.cur);
  __builtin_unreachable();
}

constexpr uintptr_t kNullPage = 64 * 1024;  // addresses below: a null pointer plus an offset

// A global access that is in no registered tensor: legitimate only in the runtime's own memory (the
// worker, fibers, launch, parameter copies) or the library's image; anything else is out-of-bounds,
// and the block stops before the access is made.
void unregistered_access(uintptr_t a, size_t size, bool write, const void* pc) {
  Worker& w = *tw;
  for (const auto& [lo, hi] : w.owned)
    if (a >= lo && a + size <= hi) return;
  const auto image = lib_image();
  if (a >= image.first && a + size <= image.second) return;
  std::string nulls;
  for (const Region& r : g_regions)
    if (r.origin == 0) nulls += (nulls.empty() ? "" : ", ") + r.name;
  if (a < kNullPage)
    report("out-of-bounds", pc, fmt("%zu-byte global %s at address 0x%" PRIxPTR ": a null pointer (+%" PRIuPTR
                                     " bytes)%s%s", size, write ? "write" : "read", a, a,
                                     nulls.empty() ? "" : "; passed as null: ", nulls.c_str()));
  else
    report("out-of-bounds", pc, fmt("%zu-byte global %s at address 0x%" PRIxPTR ": falls in no tensor of the "
                                    "launch (past the end of one, or a wild pointer)", size, write ? "write" : "read", a));
  abandon_block();
}

// The launcher's own buffers carry whose rows each block may touch (emu_region_rows).
void owner_check(const Region& r, const long long* idx, bool write, long long elem, const void* pc) {
  const dim3 b = tw->block;
  const char* what = write ? "write" : "read";
  if ((r.own_z >= 0 && idx[r.own_z] != b.z) || (r.own_y >= 0 && idx[r.own_y] != b.y)) {
    const std::string z = r.own_z >= 0 ? fmt("dim %d is its batch, blockIdx.z = %u", r.dim[r.own_z], b.z) : "";
    const std::string y = r.own_y >= 0 ? fmt("dim %d its head, blockIdx.y = %u", r.dim[r.own_y], b.y) : "";
    report("out-of-bounds", pc, fmt("global %s of %s at element %s by block (%u, %u, %u): not in the rows of the "
                                    "(batch, head) that block works on (%s%s%s), e.g. a row past its sequence length",
                                    what, r.name.c_str(), coords(r, elem).c_str(), b.x, b.y, b.z, z.c_str(),
                                    z.empty() || y.empty() ? "" : "; ", y.c_str()));
    return;
  }
  if (r.page_dim >= 0 && b.z < r.pages.size()) {
    const auto& own = r.pages[b.z];
    const long long page = idx[r.page_dim];
    if (std::find(own.begin(), own.end(), page) == own.end()) {
      std::string list;
      for (size_t i = 0; i < own.size() && i < 8; ++i) list += fmt("%s%lld", i ? ", " : "", own[i]);
      report("out-of-bounds", pc, fmt("global %s of %s at element %s by block (%u, %u, %u): page %lld is not one of "
                                      "the %zu pages %s names for sequence %u's length (%s%s)", what, r.name.c_str(),
                                      coords(r, elem).c_str(), b.x, b.y, b.z, page, own.size(), r.pages_name.c_str(),
                                      b.z, list.c_str(), own.size() > 8 ? ", ..." : ""));
      return;
    }
  }
  if (r.seg_dim >= 0 && b.z + 1 < r.seg.size()) {
    const long long row = idx[r.seg_dim], lo = r.seg[b.z], hi = r.seg[b.z + 1];
    if (row < lo || row >= hi)
      report("out-of-bounds", pc, fmt("global %s of %s at element %s by block (%u, %u, %u): row %lld is not one of "
                                      "its sequence %u's rows [%lld, %lld) (%s), e.g. a row past its sequence length",
                                      what, r.name.c_str(), coords(r, elem).c_str(), b.x, b.y, b.z, row, b.z, lo, hi,
                                      r.seg_name.c_str()));
  }
}

void global_access(const void* addr, size_t size, bool write, const void* pc) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(addr);
  const Region* hit = nullptr;
  for (const Region& r : g_regions)
    if (a < r.end && a + size > r.base) { hit = &r; break; }
  if (!hit) return unregistered_access(a, size, write, pc);
  const Region& r = *hit;
  if (a % size) {
    report("misaligned", pc, fmt("%zu-byte global %s of %s at byte offset %lld (not a multiple of %zu)", size,
                                 write ? "write" : "read", r.name.c_str(), (long long)(a - r.origin), size));
    return;
  }
  long long idx[8];
  for (uintptr_t p = a; p < a + size; p += r.elem) {
    const long long off = (long long)p - (long long)r.origin;
    if (p < r.origin || p >= r.end || off % r.elem || !decompose(r, off / r.elem, idx)) {
      report("out-of-bounds", pc, fmt("global %s of %s at element %s: not an element of the tensor",
                                      write ? "write" : "read", r.name.c_str(),
                                      coords(r, off / r.elem).c_str()));
      return;
    }
    if (r.nested) owner_check(r, idx, write, off / r.elem, pc);
  }
}

// Why a byte a read finds is not yet written (Shadow::st other than 2).
const char* unwritten(const Shadow& s) {
  return s.st == 0   ? "before any write in this block"
         : s.st == 1 ? "before its cp.async landed (no cp.async.wait_group yet)"
                     : "before its TMA load landed (no wait on the load's mbarrier)";
}

// A shared-memory access of `size` bytes at window offset `off` by the running thread: inside the
// block's shared memory, aligned, initialized (reads), not into a copy in flight (writes), and ordered
// after every access it conflicts with (runtime/order.h).
void shared_access(size_t off, size_t size, bool write, const void* pc, const char* what) {
  Worker& w = *tw;
  Fiber& f = *w.cur;
  if (off + size > w.launch->smem) {
    report("out-of-bounds", pc, fmt("%s of %zu bytes at shared offset %zu: past the block's %zu bytes of shared memory",
                                    what, size, off, w.launch->smem));
    return;
  }
  if (off % size) {
    report("misaligned", pc, fmt("%s of %zu bytes at shared offset %zu (not a multiple of %zu)", what, size, off, size));
    return;
  }
  for (size_t i = off; i < off + size; ++i) {
    Shadow& s = w.shadow[i];
    if (!write && s.st != 2) {
      report("uninitialized", pc, fmt("%s reads shared offset %zu %s", what, i, unwritten(s)));
      return;
    }
    if (write && (s.st == 1 || s.st == 3)) {
      report(s.st == 3 ? "async" : "race", pc, fmt("%s writes shared offset %zu while a %s into it is in flight", what,
                                                   i, s.st == 3 ? "TMA load" : "cp.async"));
      return;
    }
    if (!order_access(w, i, write, f.tid, f.vc, pc, what)) return;
    if (write) {
      s.st = 2;
      s.wP = f.proxy_fences;
    }
  }
}

// cp.async: the copy's shared write, checked at issue (shared_access), lands at the thread's wait.
void mark_pending(size_t off, size_t bytes) {  // a cp.async into [off, off + bytes) is in flight
  Worker& w = *tw;
  for (size_t i = off; i < off + bytes; ++i) w.shadow[i].st = 1;
}
void mark_landed(size_t off, size_t bytes, const Fiber& f, const void* pc) {
  Worker& w = *tw;
  for (size_t i = off; i < off + bytes; ++i) {
    Shadow& s = w.shadow[i];
    s.st = 2;
    s.w = Epoch{f.vc[size_t(f.tid)], int16_t(f.tid), code_offset(pc)};
    clear_reads(w, s);
    s.wP = f.proxy_fences;
  }
}

void any_access(const void* addr, size_t size, bool write, const void* pc) {
  Worker* w = tw;
  if (!w || !w->cur) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(addr), win = reinterpret_cast<uintptr_t>(w->window);
  const uintptr_t stacks = reinterpret_cast<uintptr_t>(w->stacks);
  if (a >= win && a < win + kWindow) shared_access(a - win, size, write, pc, write ? "store" : "load");
  else if (a >= stacks && a < stacks + size_t(w->launch->threads) * kStack) return;  // the threads' locals
  else global_access(addr, size, write, pc);
}

// A range (a struct copy, memcpy/memset that the compiler instruments as a whole): byte by byte, so
// no alignment is implied; a finding is reported once per place anyway.
void range_access(const void* addr, size_t n, bool write, const void* pc) {
  for (size_t i = 0; i < n; ++i) any_access(static_cast<const unsigned char*>(addr) + i, 1, write, pc);
}

}  // namespace
}  // namespace emu

#define EMU_TSAN_ACCESS(N)                                                                                       \
  EMU_EXPORT void __tsan_read##N(void* a) { emu::any_access(a, N, false, __builtin_return_address(0)); }       \
  EMU_EXPORT void __tsan_write##N(void* a) { emu::any_access(a, N, true, __builtin_return_address(0)); }       \
  EMU_EXPORT void __tsan_unaligned_read##N(void* a) { emu::any_access(a, N, false, __builtin_return_address(0)); } \
  EMU_EXPORT void __tsan_unaligned_write##N(void* a) { emu::any_access(a, N, true, __builtin_return_address(0)); }
EMU_TSAN_ACCESS(1)
EMU_TSAN_ACCESS(2)
EMU_TSAN_ACCESS(4)
EMU_TSAN_ACCESS(8)
EMU_TSAN_ACCESS(16)
EMU_EXPORT void __tsan_read_range(void* a, unsigned long n) { emu::range_access(a, n, false, __builtin_return_address(0)); }
EMU_EXPORT void __tsan_write_range(void* a, unsigned long n) { emu::range_access(a, n, true, __builtin_return_address(0)); }
// clang instruments memory intrinsics as calls (GCC leaves them to the TSan runtime's interceptors).
EMU_EXPORT void* __tsan_memcpy(void* d, const void* s, unsigned long n) {
  emu::range_access(s, n, false, __builtin_return_address(0));
  emu::range_access(d, n, true, __builtin_return_address(0));
  return std::memcpy(d, s, n);
}
EMU_EXPORT void* __tsan_memmove(void* d, const void* s, unsigned long n) {
  emu::range_access(s, n, false, __builtin_return_address(0));
  emu::range_access(d, n, true, __builtin_return_address(0));
  return std::memmove(d, s, n);
}
EMU_EXPORT void* __tsan_memset(void* d, int c, unsigned long n) {
  emu::range_access(d, n, true, __builtin_return_address(0));
  return std::memset(d, c, n);
}
EMU_EXPORT void __tsan_func_entry(void*) {}
EMU_EXPORT void __tsan_func_exit() {}
EMU_EXPORT void __tsan_init() {}

// ------------------------------------------------------------------ UndefinedBehaviorSanitizer's hooks
// The kernel is also built with -fsanitize=bounds,signed-integer-overflow,shift,integer-divide-by-zero;
// these handlers stand in for the UBSan runtime. An index past a fixed-size array (smem.k[slot] past
// the last stage, an accumulator tile) is out-of-bounds even where the memory belongs to the block;
// overflowing index arithmetic, a bad shift or a division by zero is "undefined".
namespace emu {
// The layouts the compiler's UBSan instrumentation passes (each handler's data starts with the location).
struct UbsanLocation { const char* file; uint32_t line, column; };
struct UbsanType { uint16_t kind, info; char name[1]; };
struct UbsanOverflow { UbsanLocation loc; const UbsanType* type; };
struct UbsanShift { UbsanLocation loc; const UbsanType* lhs_type; const UbsanType* rhs_type; };
struct UbsanBounds { UbsanLocation loc; const UbsanType* array_type; const UbsanType* index_type; };

namespace {

// A ValueHandle of an integer type of at most 64 bits holds the value itself.
long long ubsan_int(const UbsanType* type, uintptr_t handle) {
  const unsigned bits = 1u << (type->info >> 1);
  const bool is_signed = type->info & 1;
  if (bits >= 64) return (long long)handle;
  const uint64_t mask = (uint64_t(1) << bits) - 1, v = uint64_t(handle) & mask;
  return is_signed && (v >> (bits - 1)) ? (long long)(v | ~mask) : (long long)v;
}

void ubsan(const char* kind, const UbsanLocation* loc, const void* pc, std::string what) {
  (void)loc;  // the same file:line as the symbolized pc
  report(kind, pc, std::move(what));
}
}  // namespace
}  // namespace emu

#define EMU_UBSAN_ARITH(check, op)                                                                         \
  EMU_EXPORT void __ubsan_handle_##check(emu::UbsanOverflow* d, uintptr_t a, uintptr_t b) {                \
    emu::ubsan("undefined", &d->loc, __builtin_return_address(0),                                          \
               emu::fmt("signed overflow: %lld " op " %lld in %s", emu::ubsan_int(d->type, a),              \
                        emu::ubsan_int(d->type, b), d->type->name));                                        \
  }
EMU_UBSAN_ARITH(add_overflow, "+")
EMU_UBSAN_ARITH(sub_overflow, "-")
EMU_UBSAN_ARITH(mul_overflow, "*")
EMU_UBSAN_ARITH(divrem_overflow, "/ or %%")
EMU_EXPORT void __ubsan_handle_negate_overflow(emu::UbsanOverflow* d, uintptr_t a) {
  emu::ubsan("undefined", &d->loc, __builtin_return_address(0),
             emu::fmt("signed overflow: -(%lld) in %s", emu::ubsan_int(d->type, a), d->type->name));
}
EMU_EXPORT void __ubsan_handle_shift_out_of_bounds(emu::UbsanShift* d, uintptr_t a, uintptr_t b) {
  emu::ubsan("undefined", &d->loc, __builtin_return_address(0),
             emu::fmt("shift %lld << or >> %lld out of range for %s", emu::ubsan_int(d->lhs_type, a),
                      emu::ubsan_int(d->rhs_type, b), d->lhs_type->name));
}
EMU_EXPORT void __ubsan_handle_out_of_bounds(emu::UbsanBounds* d, uintptr_t index) {
  emu::ubsan("out-of-bounds", &d->loc, __builtin_return_address(0),
             emu::fmt("index %lld past the end of %s", emu::ubsan_int(d->index_type, index), d->array_type->name));
}
#endif
