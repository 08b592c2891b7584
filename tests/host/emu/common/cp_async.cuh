// Host emulation of cp.async: copies are queued per thread in commit groups and performed only
// when cp.async.wait_group lets them complete, so a kernel that reads a tile before waiting for
// it sees stale shared memory, as it could on the GPU.
#pragma once
#include "common/types.cuh"

inline uint32_t smem_u32(const void* p) { return __cvta_generic_to_shared(p); }

struct PendingCopy { void* dst; const void* src; bool valid; };
inline thread_local std::vector<PendingCopy> t_open_group;
inline thread_local std::vector<std::vector<PendingCopy>> t_groups;

inline void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  t_open_group.push_back({smem_dst, gmem_src, valid});
}

inline void cp_async_commit() {
  t_groups.push_back(std::move(t_open_group));
  t_open_group.clear();
}

template <int N>
inline void cp_async_wait() {
  while (t_groups.size() > size_t(N)) {
    for (const PendingCopy& c : t_groups.front()) {
      if (c.valid) std::memcpy(c.dst, c.src, 16);
      else std::memset(c.dst, 0, 16);
    }
    t_groups.erase(t_groups.begin());
  }
}
