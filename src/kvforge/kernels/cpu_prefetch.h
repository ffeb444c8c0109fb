// Software prefetch of a byte range, one 64-byte cache line at a time: the one form the CPU
// decode kernels use (cache/full/cpu_decode.cpp, cache/kivi/cpu_decode.cpp).
//
// always_inline: a separate function made only of prefetches is seen by GCC as free of side
// effects, and its calls are deleted (measured: the gain of the full kernel's jump prefetch
// on scattered pages was gone with noinline alone).
#pragma once

#include <cstdint>

namespace kvforge_prefetch {

// __builtin_prefetch's locality hint: 3 = into L1 (prefetcht0), 1 = into L2 (prefetcht2).
template <int Locality>
__attribute__((always_inline)) inline void lines(const void* base, int64_t bytes) {
  const char* p = static_cast<const char*>(base);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset, 0, Locality);
}

// Requests the `bytes` bytes at `base` into L1.
__attribute__((always_inline)) inline void to_l1(const void* base, int64_t bytes) { lines<3>(base, bytes); }

// Requests the `bytes` bytes at `base` into L2 (not L1: the L1 miss buffers are the scarce part).
__attribute__((always_inline)) inline void to_l2(const void* base, int64_t bytes) { lines<1>(base, bytes); }

}  // namespace kvforge_prefetch
