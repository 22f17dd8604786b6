// Scratch memory on 64-byte boundaries for the kernels. std::vector's own allocation is 16-byte aligned, so each
// 64-byte row a kernel loads from or stores to its scratch would straddle two cache lines: on a 2-core Zen 4, the
// paged decode dot path ran 1.3x slower on L2-resident blocks with its scratch in plain vectors. (Prefill attention's
// scratch in these made no difference there, 2,000-token prompts at 21-26 ms either way, so it keeps plain vectors.)
#pragma once

#include <cstddef>
#include <new>
#include <vector>

template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const { return true; }
};

template <typename T>
using AlignedVector = std::vector<T, Aligned64<T>>;
