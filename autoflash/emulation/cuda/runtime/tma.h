// TMA on the emulator (included once, by runtime.cpp): cp.async.bulk.tensor tile loads into shared
// memory that complete_tx on an mbarrier, and tile stores from shared memory in bulk groups
// (cp.async.bulk.commit_group / wait_group), on tensor maps (PTX ISA 9.7.9.27.1.2, 5.5).
//
// The tensor map. On a GPU it is the driver's opaque 128 bytes (cuTensorMapEncodeTiled); here it is
// the project's own encoding of the same fields, written by autoflash/kernels/tensor_map.py:
//   w[0] kTensorMapMagic          w[1] global address
//   w[2] data type | rank << 8 | interleave << 16 | swizzle << 24 | L2 promotion << 32 | OOB fill << 40
//        (the driver's enum values)
//   w[3..7] global dims (elements, innermost first)   w[8..11] global strides of dims 1..4 (bytes)
//   w[12] box dims, 12 bits each                      w[13] element strides, 4 bits each
// Every use decodes it and checks what cuTensorMapEncodeTiled documents it refuses (cuda.h, CUDA 13):
// rank 1..5; global address 16-aligned; dims 1..2^32; strides multiples of 16 below 2^40; box dims
// 1..256 with the inner box a multiple of 16 bytes and no wider than the swizzle span; element
// strides 1..8; the map itself 64-aligned. A map that breaks one is a finding of kind "tma", as are
// what the emulator does not model (interleaved layouts, the NaN fill, the 128B sub-modes, an inner
// box narrower than its swizzle span).
//
// A load is asynchronous: issuing it marks its destination in flight and poisons it (0xff); the
// bytes land, and complete_tx reaches the mbarrier, only when no thread of the block can go on and
// some thread waits on that mbarrier (the latest moment the hardware could deliver), so a thread that
// reads the tile without waiting on the barrier reads poison, and (sanitizing) is an "uninitialized"
// finding. The
// box is written densely, dim 0 innermost, each byte address swizzled as the hardware does (its bits
// [4, 4 + B) XORed with bits [7, 7 + B), B = 1, 2, 3 for the 32, 64 and 128-byte spans); elements
// outside the tensor are zero and count toward the transaction bytes (the full box).
// A store reads the box from shared memory at issue and writes the elements inside the tensor when a
// wait_group covers its bulk group (a wait_group.read only ends its reads: the writes land at a later
// full wait, or when the thread exits); elements outside are not written. Its start coordinates must not
// be negative.
//
// Non-tensor bulk copies (PTX ISA 9.7.9.25.4.1 cp.async.bulk, 9.7.9.25.4.2 cp.reduce.async.bulk) are the
// same machinery on a flat rank-1 "map" of the bytes: a load of `bytes` from global memory lands as a
// tensor load does; a reduction (.add.f32, FA3's dQ accumulation) reads its floats from shared memory
// at issue and adds each into global memory when a wait_group covers its bulk group, an exact fp32 add
// rounded to nearest (SASS UBLKRED.G.S.ADD.F32.RN) and atomic per element: blocks that run at once on
// the host's threads add in whatever order they reach the wait, as on the GPU. Both want a size that is
// a positive multiple of 16 and 16-byte aligned addresses on both sides (findings "tma" and
// "misaligned"); the reduction's global floats are checked as the issuing thread's writes.
//
// Sanitizing, also (kind "async"): a load's destination written or read by a thread while the load is
// in flight; a store's source written before the wait_group that covers it; generic-proxy writes a
// store reads with no fence.proxy.async since (the rule of runtime/wgmma.h); a block that ends with
// loads or stores in flight. Global elements a copy reads or writes are checked as the issuing
// thread's accesses (out-of-bounds, whose rows).
#pragma once

namespace emu {
namespace {

constexpr uint64_t kTensorMapMagic = 0x31304d5450414641ull;  // "AFAPTM01": written by tensor_map.py

int dtype_size(int dtype) {  // CUtensorMapDataType: UINT8, UINT16, UINT32, INT32, UINT64, INT64, FLOAT16, FLOAT32,
  static const int sizes[] = {1, 2, 4, 4, 8, 8, 2, 4, 8, 2, 4, 4, 4};  // FLOAT64, BFLOAT16, FLOAT32_FTZ, TFLOAT32(_FTZ)
  return dtype >= 0 && dtype < 13 ? sizes[dtype] : 0;
}

// Decodes the map at `p`; false (and a finding) where the driver would have refused it or the
// emulator does not model it.
bool decode_tensor_map(const void* p, TensorMap& m, const void* pc, const char* what) {
  auto bad = [&](std::string why) {
    report("tma", pc, fmt("%s on a tensor map that %s", what, why.c_str()));
    return false;
  };
  if (reinterpret_cast<uintptr_t>(p) % 64) return bad("is not 64-byte aligned (the driver writes maps at 64-byte alignment)");
  uint64_t w[16];
  std::memcpy(w, p, sizeof w);
  if (w[0] != kTensorMapMagic)
    return bad("autoflash/kernels/tensor_map.py did not encode (its first word is not the emulator's mark)");
  m.addr = w[1];
  m.dtype = int(w[2] & 0xff);
  m.rank = int((w[2] >> 8) & 0xff);
  m.interleave = int((w[2] >> 16) & 0xff);
  m.swizzle = int((w[2] >> 24) & 0xff);
  m.l2 = int((w[2] >> 32) & 0xff);
  m.fill = int((w[2] >> 40) & 0xff);
  m.esize = dtype_size(m.dtype);
  if (!m.esize) return bad(fmt("has data type %d (expected a CUtensorMapDataType, 0..12)", m.dtype));
  if (m.rank < 1 || m.rank > 5) return bad(fmt("has rank %d (expected 1..5)", m.rank));
  if (m.interleave) return bad(fmt("is interleaved (mode %d): not modelled (autoflash's kernels use none)", m.interleave));
  if (m.swizzle > 3) return bad(fmt("has swizzle mode %d: the 128B sub-modes (4..6) are not modelled", m.swizzle));
  if (m.l2 > 3) return bad(fmt("has L2 promotion %d (expected 0..3)", m.l2));
  if (m.fill == 1) return bad("fills out-of-bounds elements with NaN: not modelled (autoflash's kernels fill zero)");
  if (m.fill) return bad(fmt("has OOB fill %d (expected 0 or 1)", m.fill));
  if (m.addr % 16) return bad(fmt("starts at global address 0x%" PRIx64 " (expected 16-byte alignment)", m.addr));
  m.stride[0] = uint64_t(m.esize);
  for (int d = 0; d < m.rank; ++d) {
    m.dim[d] = w[3 + d];
    m.box[d] = uint32_t((w[12] >> (12 * d)) & 0xfff);
    m.estride[d] = uint32_t((w[13] >> (4 * d)) & 0xf);
    if (m.dim[d] < 1 || m.dim[d] > (uint64_t(1) << 32))
      return bad(fmt("has global dim %d of %" PRIu64 " elements (expected 1..2^32)", d, m.dim[d]));
    if (d > 0) {
      m.stride[d] = w[8 + d - 1];
      if (m.stride[d] % 16 || m.stride[d] >= (uint64_t(1) << 40))
        return bad(fmt("has a stride of %" PRIu64 " bytes for dim %d (expected a multiple of 16 below 2^40)",
                       m.stride[d], d));
    }
    if (m.box[d] < 1 || m.box[d] > 256) return bad(fmt("has box dim %d of %u (expected 1..256)", d, m.box[d]));
    if (m.estride[d] < 1 || m.estride[d] > 8)
      return bad(fmt("has element stride %u for dim %d (expected 1..8)", m.estride[d], d));
  }
  const uint32_t inner = m.box[0] * uint32_t(m.esize);
  if (inner % 16) return bad(fmt("has an inner box of %u bytes (expected a multiple of 16)", inner));
  if (m.span() && inner > m.span())
    return bad(fmt("has an inner box of %u bytes, wider than its %u-byte swizzle span", inner, m.span()));
  if (m.span() && inner != m.span())
    return bad(fmt("has an inner box of %u bytes, narrower than its %u-byte swizzle span: not modelled (make the "
                   "box's inner dim the span, as CUTLASS does)", inner, m.span()));
  return true;
}

// The shared byte address of box byte `b` (dense, dim 0 innermost) of a copy at `base`.
inline uint32_t box_byte(const TensorMap& m, uint32_t base, uint32_t b) {
  const uint32_t a = base + b;
  const uint32_t B = m.swizzle;  // 1, 2, 3 bits for 32, 64, 128 bytes
  return B ? a ^ (((a >> 7) & ((1u << B) - 1)) << 4) : a;
}

// Calls f(element index in the box, global address or 0 when outside the tensor) for every element of
// the box that starts at coordinates c, in shared-memory order.
template <typename F>
void for_box(const TensorMap& m, const int32_t* c, F&& f) {
  uint32_t n[5] = {1, 1, 1, 1, 1};
  for (int d = 0; d < m.rank; ++d) n[d] = m.count(d);
  uint64_t i = 0;
  for (uint32_t i4 = 0; i4 < n[4]; ++i4)
    for (uint32_t i3 = 0; i3 < n[3]; ++i3)
      for (uint32_t i2 = 0; i2 < n[2]; ++i2)
        for (uint32_t i1 = 0; i1 < n[1]; ++i1)
          for (uint32_t i0 = 0; i0 < n[0]; ++i0, ++i) {
            const uint32_t idx[5] = {i0, i1, i2, i3, i4};
            uint64_t addr = m.addr;
            bool inside = true;
            for (int d = 0; d < m.rank; ++d) {
              const long long g = (long long)c[d] + (long long)idx[d] * (d ? m.estride[d] : 1);
              if (g < 0 || uint64_t(g) >= m.dim[d]) { inside = false; break; }
              addr += uint64_t(g) * m.stride[d];
            }
            f(i, inside ? addr : 0);
          }
}

// The running thread's shared checks of a copy's shared side: the destination of a load (written),
// the source of a store (read through the async proxy).
bool box_in_smem(Worker& w, const TensorMap& m, uint32_t base, const void* pc, const char* what) {
  const uint64_t bytes = m.elements() * uint64_t(m.esize);
  if (base % 128 || base + bytes > w.launch->smem) {
    report(base % 128 ? "misaligned" : "out-of-bounds", pc,
           base % 128 ? fmt("%s at shared offset %u (expected 128-byte alignment)", what, base)
                      : fmt("%s of %" PRIu64 " bytes at shared offset %u: past the block's %zu bytes", what, bytes, base,
                            w.launch->smem));
    return false;
  }
  return true;
}

// A copy's tensor map decoded and its shared side checked (the checks both directions share): the
// map as the driver would have made it, the box inside the block's shared memory at `smem`
// (128-aligned), of the instruction's rank. `op`: "(load)" or "(store)"; `side`: the shared side's name.
bool copy_map(Worker& w, const void* tmap, int rank, TensorMap& m, uint32_t smem, const void* pc, const char* op,
              const char* side) {
  if (!decode_tensor_map(tmap, m, pc, fmt("cp.async.bulk.tensor %s", op).c_str()) ||
      !box_in_smem(w, m, smem, pc, fmt("cp.async.bulk.tensor %s", side).c_str()))
    return false;
  if (rank != m.rank) {
    report("tma", pc, fmt("cp.async.bulk.tensor.%dd on a tensor map of rank %d", rank, m.rank));
    return false;
  }
  return true;
}


// A flat copy of `bytes` at global address `addr` as a rank-1 map of `esize`-byte elements (no
// swizzle, nothing outside: the box is the tensor; no data type: only the element size is read).
TensorMap flat_map(uint64_t addr, uint32_t bytes, int esize) {
  TensorMap m;
  m.addr = addr;
  m.rank = 1;
  m.esize = esize;
  m.stride[0] = uint64_t(esize);
  m.dim[0] = bytes / uint32_t(esize);
  m.box[0] = bytes / uint32_t(esize);
  return m;
}

// The checks of a non-tensor bulk copy: a size that is a positive multiple of 16, both addresses
// 16-aligned, the shared side inside the block's shared memory.
bool flat_copy_ok(Worker& w, const char* op, uint64_t global, uint32_t smem, uint32_t bytes, const void* pc) {
  if (!bytes || bytes % 16) {
    report("tma", pc, fmt("%s of %u bytes (expected a positive multiple of 16)", op, bytes));
    return false;
  }
  if (global % 16 || smem % 16) {
    report("misaligned", pc, fmt("%s at %s (expected 16-byte alignment)", op,
                                 global % 16 ? fmt("global address 0x%" PRIx64, global).c_str()
                                             : fmt("shared offset %u", smem).c_str()));
    return false;
  }
  if (uint64_t(smem) + bytes > w.launch->smem) {
    report("out-of-bounds", pc, fmt("%s of %u bytes at shared offset %u: past the block's %zu bytes", op, bytes, smem,
                                    w.launch->smem));
    return false;
  }
  return true;
}

// Issues a checked load: (sanitizing) its global reads and shared writes as the thread's accesses,
// then its destination poisoned and marked in flight until it lands.
void issue_load(Worker& w, Fiber& f, TmaLoad& l, const void* pc, const char* what) {
  l.pc = pc;
  l.tid = f.tid;
  l.issued.capture();
#if EMU_SANITIZE
  for_box(l.map, l.c, [&](uint64_t i, uint64_t addr) {
    if (addr) global_access(reinterpret_cast<const void*>(addr), size_t(l.map.esize), false, pc);
    for (int b = 0; b < l.map.esize; ++b)
      shared_access(box_byte(l.map, l.dst, uint32_t(i) * l.map.esize + b), 1, true, pc, what);
  });
#else
  (void)what;
#endif
  for_box(l.map, l.c, [&](uint64_t i, uint64_t) {
    for (int b = 0; b < l.map.esize; ++b) {
      const uint32_t off = box_byte(l.map, l.dst, uint32_t(i) * l.map.esize + b);
      w.window[off] = 0xff;
#if EMU_SANITIZE
      w.shadow[off].st = 3;  // a TMA load in flight
#endif
    }
  });
#if EMU_SANITIZE
  l.vc = f.vc;  // what the load releases when it lands (runtime/order.h)
  tick(f);
#endif
  w.tma_loads.push_back(l);
}

}  // namespace

void tma_load(uint32_t dst, const void* tmap, int rank, const int32_t* coords, uint32_t bar) {
  Worker& w = *tw;
  Fiber& f = *w.cur;
  const void* pc = __builtin_return_address(0);
  TmaLoad l;
  if (!copy_map(w, tmap, rank, l.map, dst, pc, "(load)", "destination") ||
      !find_mbar(w, bar, pc, "cp.async.bulk.tensor's complete_tx")) {
    w.abandon = true;
    yield(w, f);
    return;
  }
  std::copy(coords, coords + rank, l.c);
  l.dst = dst;
  l.bar = bar;
  issue_load(w, f, l, pc, "cp.async.bulk.tensor (load)");
}

void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  Worker& w = *tw;
  Fiber& f = *w.cur;
  const void* pc = __builtin_return_address(0);
  if (!flat_copy_ok(w, "cp.async.bulk (load)", reinterpret_cast<uint64_t>(src), dst, bytes, pc) ||
      !find_mbar(w, bar, pc, "cp.async.bulk's complete_tx")) {
    w.abandon = true;
    yield(w, f);
    return;
  }
  TmaLoad l;
  l.map = flat_map(reinterpret_cast<uint64_t>(src), bytes, 16);  // 16-byte chunks: checked against any dtype
  l.dst = dst;
  l.bar = bar;
  issue_load(w, f, l, pc, "cp.async.bulk (load)");
}

namespace {

// Lands a load: its bytes, then its complete_tx (the full box) on its mbarrier.
void land_load(Worker& w, const TmaLoad& l) {
  const TensorMap& m = l.map;
  auto it = w.mbars.find(l.bar);
#if EMU_SANITIZE
  // the bytes are the mbarrier's TMA unit's write, at its new clock, which the phase releases
  const int unit = it == w.mbars.end() ? -1 : mbar_unit(w, it->second);
  const uint32_t clock = unit < 0 ? 0 : ++w.unit_clock[size_t(unit)];
#endif
  for_box(m, l.c, [&](uint64_t i, uint64_t addr) {
    for (int b = 0; b < m.esize; ++b) {
      const uint32_t off = box_byte(m, l.dst, uint32_t(i) * m.esize + b);
      w.window[off] = addr ? *reinterpret_cast<const unsigned char*>(addr + b) : 0;
#if EMU_SANITIZE
      Shadow& s = w.shadow[off];
      s.st = 2;
      if (unit >= 0) s.w = Epoch{clock, int16_t(unit), code_offset(l.pc)};
      clear_reads(w, s);
      s.wP = -1;  // written through the async proxy
#endif
    }
  });
  if (it == w.mbars.end()) return;  // checked at issue
#if EMU_SANITIZE
  vc_join(it->second.vc, l.vc);
  it->second.vc[size_t(unit)] = std::max(it->second.vc[size_t(unit)], clock);
#endif
  complete_tx(w, it->second, l.bar, uint32_t(m.elements() * uint64_t(m.esize)), l.pc, &l.issued);
}

// The scheduler, when no thread can run: lands the loads in flight whose mbarrier a thread waits on
// (the latest moment the hardware could have delivered them), or, if none is waited on or `all`
// (Sched::Wake and Random land them early), all of them; false if there was none.
bool land_tma_loads(Worker& w, bool all) {
  if (w.tma_loads.empty()) return false;
  std::set<uint32_t> waited;
  for (const Fiber& f : w.fibers)
    if (f.st == St::Spin) waited.insert(f.spin_bar);
  std::vector<TmaLoad> now, later;
  for (TmaLoad& l : w.tma_loads) (all || waited.count(l.bar) ? now : later).push_back(std::move(l));
  if (now.empty()) now.swap(later);
  w.tma_loads.swap(later);
  Fiber* saved = w.cur;
  for (const TmaLoad& l : now) {
    w.cur = &w.fibers[l.tid];  // findings name the issuing thread
    land_load(w, l);
  }
  w.cur = saved;
  return true;
}

}  // namespace

void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
  Worker& w = *tw;
  Fiber& f = *w.cur;
  const void* pc = __builtin_return_address(0);
  if (!flat_copy_ok(w, "cp.reduce.async.bulk .add.f32", reinterpret_cast<uint64_t>(dst), src, bytes, pc)) {
    w.abandon = true;
    yield(w, f);
    return;
  }
  TmaStore s;
  s.map = flat_map(reinterpret_cast<uint64_t>(dst), bytes, 4);
  s.src = src;
  s.add_f32 = true;
  s.pc = pc;
  s.issued.capture();
#if EMU_SANITIZE
  for (uint32_t o = 0; o < bytes; o += 16) async_proxy_read(w, src + o, 16, pc, "cp.reduce.async.bulk (source)");
  for (uint32_t o = 0; o < bytes; ++o) ++w.shadow[src + o].async_reads;  // until a wait_group covers it
#endif
  s.bytes.assign(w.window + src, w.window + src + bytes);
  f.stores_open.push_back(std::move(s));
}

void tma_store(const void* tmap, int rank, const int32_t* coords, uint32_t src) {
  Worker& w = *tw;
  Fiber& f = *w.cur;
  const void* pc = __builtin_return_address(0);
  TmaStore s;
  if (!copy_map(w, tmap, rank, s.map, src, pc, "(store)", "source")) {
    w.abandon = true;
    yield(w, f);
    return;
  }
  for (int d = 0; d < rank; ++d)
    if (coords[d] < 0) {
      report("tma", pc, fmt("cp.async.bulk.tensor store at coordinate %d along dim %d (a store's start coordinates "
                            "must not be negative)", coords[d], d));
      return;
    }
  std::copy(coords, coords + rank, s.c);
  s.src = src;
  s.pc = pc;
  s.issued.capture();
  const TensorMap& m = s.map;
  s.bytes.resize(m.elements() * uint64_t(m.esize));
  for_box(m, s.c, [&](uint64_t i, uint64_t) {
#if EMU_SANITIZE
    async_proxy_read(w, box_byte(m, src, uint32_t(i) * m.esize), m.esize, pc, "cp.async.bulk.tensor (store)");
#endif
    for (int b = 0; b < m.esize; ++b) {
      const uint32_t off = box_byte(m, src, uint32_t(i) * m.esize + b);
      s.bytes[i * m.esize + b] = w.window[off];
#if EMU_SANITIZE
      ++w.shadow[off].async_reads;  // until a wait_group covers it
#endif
    }
  });
  f.stores_open.push_back(std::move(s));
}

void bulk_commit() {
  Fiber& f = *tw->cur;
  f.store_groups.push_back(std::move(f.stores_open));
  f.stores_open.clear();
}

namespace {
// (sanitizing) A store's source unchanged since issue: the bytes it read then are what shared memory
// holds when a wait_group (.read or not) covers it.
void check_source(Worker& w, Fiber& f, const TmaStore& s) {
#if EMU_SANITIZE
  const TensorMap& m = s.map;
  bool changed = false;
  for_box(m, s.c, [&](uint64_t i, uint64_t) {
    for (int b = 0; b < m.esize; ++b) {
      const uint32_t off = box_byte(m, s.src, uint32_t(i) * m.esize + b);
      changed |= s.bytes[i * m.esize + b] != w.window[off];
      // the read ends here: kept as the thread's, at this wait (runtime/order.h)
      if (w.shadow[off].async_reads) --w.shadow[off].async_reads;
      order_access(w, off, false, f.tid, f.vc, s.pc, "a bulk store's source read");
    }
  });
  if (changed)
    report("async", s.pc, fmt("thread %d: shared memory that an in-flight %s reads was written before the "
                              "cp.async.bulk.wait_group that covers it", f.tid,
                              s.add_f32 ? "cp.reduce.async.bulk" : "cp.async.bulk.tensor store"), &s.issued);
#else
  (void)w; (void)f; (void)s;
#endif
}

// A store's writes: the elements inside the tensor, as read at issue.
void write_store(const TmaStore& s) {
  const TensorMap& m = s.map;
  for_box(m, s.c, [&](uint64_t i, uint64_t addr) {
    if (!addr) return;
#if EMU_SANITIZE
    global_access(reinterpret_cast<void*>(addr), size_t(m.esize), true, s.pc);
#endif
    if (s.add_f32) {
      float v;
      std::memcpy(&v, &s.bytes[i * 4], 4);
      std::atomic_ref<float>(*reinterpret_cast<float*>(addr)).fetch_add(v);
    } else {
      std::memcpy(reinterpret_cast<void*>(addr), &s.bytes[i * m.esize], size_t(m.esize));
    }
  });
}

// A store whose bulk group a full wait covers (or whose thread exits) that no .read wait covered:
// its source checked, then its writes.
void finish_store(Worker& w, Fiber& f, const TmaStore& s) {
  check_source(w, f, s);
  write_store(s);
}
}  // namespace

// cp.async.bulk.wait_group N: every group but the newest N done, writes included (oldest first: the
// groups a .read wait already covered, then the rest).
void bulk_wait(int pending) {
  Worker& w = *tw;
  Fiber& f = *w.cur;
  const size_t keep = size_t(std::max(pending, 0));
  while (f.stores_read.size() + f.store_groups.size() > keep) {
    if (!f.stores_read.empty()) {
      for (const TmaStore& s : f.stores_read.front()) write_store(s);
      f.stores_read.erase(f.stores_read.begin());
    } else {
      for (const TmaStore& s : f.store_groups.front()) finish_store(w, f, s);
      f.store_groups.erase(f.store_groups.begin());
    }
  }
}

// cp.async.bulk.wait_group.read N: every group but the newest N has read its source (shared memory
// may be written again); the writes stay pending, landing as late as the hardware may land them.
void bulk_wait_read(int pending) {
  Worker& w = *tw;
  Fiber& f = *w.cur;
  while (f.store_groups.size() > size_t(std::max(pending, 0))) {
    for (const TmaStore& s : f.store_groups.front()) check_source(w, f, s);
    f.stores_read.push_back(std::move(f.store_groups.front()));
    f.store_groups.erase(f.store_groups.begin());
  }
}

namespace {
// A thread leaving the kernel with stores in flight: they complete, but the block's shared memory
// they read is gone once the block ends (sanitizing, a finding).
void stores_at_exit(Worker& w, Fiber& f) {
  for (const auto& g : f.stores_read)  // sources read (a .read wait covered them): the writes complete
    for (const TmaStore& s : g) write_store(s);
  f.stores_read.clear();
  if (f.store_groups.empty() && f.stores_open.empty()) return;
  const TmaStore& first = f.store_groups.empty() ? f.stores_open.front() : f.store_groups.front().front();
  if (EMU_SANITIZE)
    report("async", first.pc, fmt("thread %d exited with bulk stores or reductions in flight (no "
                                   "cp.async.bulk.commit_group and wait_group after them)", f.tid), &first.issued);
  if (!f.stores_open.empty()) f.store_groups.push_back(std::move(f.stores_open));
  f.stores_open.clear();
  for (const auto& g : f.store_groups)
    for (const TmaStore& s : g) finish_store(w, f, s);
  f.store_groups.clear();
}

// A block that ends with loads in flight: they land (their shared memory would be another block's).
void loads_at_block_end(Worker& w) {
  if (w.tma_loads.empty()) return;
  if (EMU_SANITIZE)
    report("async", w.tma_loads.front().pc, fmt("the block ended with %zu bulk loads in flight (no "
                                                 "thread waited on their mbarrier)", w.tma_loads.size()),
           &w.tma_loads.front().issued);
  land_tma_loads(w, true);
}
}  // namespace

}  // namespace emu
