// FNV-1a over the bytes of a few 64-bit fields: the saved-state stamps' shape hashes.
#pragma once

#include <cstddef>
#include <cstdint>

namespace smoe {
namespace detail {

inline uint64_t fnv1a_fields(const int64_t* f, size_t count) {
  uint64_t h = 1469598103934665603ull;
  for (size_t k = 0; k < count; ++k)
    for (int b = 0; b < 8; ++b) {
      h ^= (static_cast<uint64_t>(f[k]) >> (8 * b)) & 0xff;
      h *= 1099511628211ull;
    }
  return h;
}

}  // namespace detail
}  // namespace smoe
