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
  // Buffers whose lifetimes do not overlap share bytes. Carve the earlier ones after
  // overlay_begin(), call overlay_next() once they are carved, carve the later ones over them, and
  // close the group with overlay_end(). The group spans its larger side; later takes follow it.
  void overlay_begin() { overlay_at_ = used_; }
  void overlay_next() {
    high_ = used_ > high_ ? used_ : high_;
    used_ = overlay_at_;
  }
  void overlay_end() { used_ = used_ > high_ ? used_ : high_; }
  size_t used() const { return used_ > high_ ? used_ : high_; }

 private:
  char* base_;
  size_t used_ = 0;
  size_t overlay_at_ = 0;
  size_t high_ = 0;
};

}  // namespace detail
}  // namespace smoe
