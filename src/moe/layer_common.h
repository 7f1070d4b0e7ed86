// Helpers shared by the layer's forward and backward: buffer checks and the SM count.
#pragma once

#include <cstddef>

#include "common/check.h"
#include "smoe/smoe.h"

namespace smoe {
namespace layer {

inline Status check_buffer(const void* p, size_t have, size_t need, const char* fn, const char* name,
                           const char* bytes_name, const char* query) {
  SMOE_RETURN_IF_ERROR(detail::check_ptr(p, fn, name, kWorkspaceAlignment));
  if (have < need)
    return detail::make_status(StatusCode::kWorkspaceTooSmall,
                               detail::concat(fn, ": ", bytes_name, " = ", have, " is smaller than ",
                                              query, "() = ", need));
  return Status{};
}

// SMs of the current device: the persistent GEMMs' grid.
inline Status sm_count(int* out) {
  int dev = 0;
  SMOE_CUDA_RETURN(cudaGetDevice(&dev));
  SMOE_CUDA_RETURN(cudaDeviceGetAttribute(out, cudaDevAttrMultiProcessorCount, dev));
  return Status{};
}

}  // namespace layer
}  // namespace smoe
