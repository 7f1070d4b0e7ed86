// The reference's one argument check: a broken rule throws std::invalid_argument naming it.
#pragma once

#include <stdexcept>
#include <string>

namespace smoe {
namespace ref {
namespace detail {

inline void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("smoe::ref: ") + what);
}

}  // namespace detail
}  // namespace ref
}  // namespace smoe
