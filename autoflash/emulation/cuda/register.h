// Appended (by autoflash/emulation/build.py) after a rendered kernel: EMU_KERNEL(name) exports
// `emu_entry_<name>(void** args)`, which calls the kernel with its arguments read from args, as
// cuLaunchKernel's kernelParams are.
#pragma once
#include <cstddef>
#include <type_traits>
#include <utility>

template <typename... A, std::size_t... I>
void emu_invoke(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

template <typename... A>
constexpr std::size_t emu_arity(void (*)(A...)) { return sizeof...(A); }

#define EMU_KERNEL(name)                                                                   \
  extern "C" __attribute__((visibility("default"))) void emu_entry_##name(void** args) {                                        \
    emu_invoke(&name, args, std::make_index_sequence<emu_arity(&name)>{});                 \
  }
