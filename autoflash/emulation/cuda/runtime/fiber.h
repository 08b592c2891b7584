// Fibers of the host emulator's runtime (included once, by runtime.cpp): a stack switch written by
// hand on x86-64 (no system call per switch), ucontext elsewhere, and fiber stacks pooled across
// launches so their pages are touched once.
#pragma once
#include <sys/mman.h>
#include <ucontext.h>

#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

namespace emu {
namespace {
#if defined(__x86_64__)
// Saves the callee-saved registers on the current stack, stores the stack pointer in *save, and
// continues on stack `to` (System V ABI: rbp, rbx, r12-r15 are all a switch must keep).
extern "C" void autoflash_emu_switch(void** save, void* to);
asm(R"(
  .text
  .p2align 4
  .hidden autoflash_emu_switch
  .type autoflash_emu_switch, @function
autoflash_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size autoflash_emu_switch, .-autoflash_emu_switch
)");
struct Context { void* sp = nullptr; };
void ctx_init(Context& c, unsigned char* stack, size_t size, void (*entry)()) {
  void** sp = reinterpret_cast<void**>((reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15));
  *--sp = nullptr;                           // entry's return address: none, which ends unwinding
  *--sp = reinterpret_cast<void*>(entry);    // where the first switch's `ret` goes
  for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp, rbx, r12-r15
  c.sp = sp;
}
void ctx_switch(Context& from, Context& to) { autoflash_emu_switch(&from.sp, to.sp); }
#else
struct Context { ucontext_t uc; };
void ctx_init(Context& c, unsigned char* stack, size_t size, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
void ctx_switch(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

// Fiber stacks outlive launches (their pages are touched once, not per launch).
std::mutex g_stack_mu;
std::vector<std::pair<size_t, unsigned char*>> g_stack_pool;
unsigned char* take_stacks(size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(g_stack_mu);
    for (auto it = g_stack_pool.begin(); it != g_stack_pool.end(); ++it)
      if (it->first == bytes) {
        unsigned char* p = it->second;
        g_stack_pool.erase(it);
        return p;
      }
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? nullptr : static_cast<unsigned char*>(p);
}
void give_stacks(size_t bytes, unsigned char* p) {
  std::lock_guard<std::mutex> lock(g_stack_mu);
  g_stack_pool.push_back({bytes, p});
}

}  // namespace
}  // namespace emu
