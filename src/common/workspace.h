// The one workspace carver: sequential regions of a caller buffer, each rounded up to
// kWorkspaceAlignment (256) bytes. With base == nullptr it only counts, so the same code computes
// a buffer's size and its layout.
#pragma once

#include <cstddef>

#include "common/check.h"

namespace smoe {
namespace detail {

class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<char*>(base)) {}
  template <typename T>
  T* take(size_t count) {
    char* p = base_ ? base_ + used_ : nullptr;
    used_ += align_workspace(sizeof(T) * count);
    return reinterpret_cast<T*>(p);
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

}  // namespace detail
}  // namespace smoe
