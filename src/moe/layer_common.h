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

// The rules forward and backward share: the shape, x, the weights and the saved state.
inline Status check_common(const char* fn, const MoEShape& s, const bf16* x, const MoEWeights& w,
                           const void* saved, size_t saved_bytes) {
  SMOE_RETURN_IF_ERROR(moe_can_implement(s));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(x, fn, "x", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(w.w_router, fn, "weights.w_router", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(w.w1, fn, "weights.w1", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(w.w2, fn, "weights.w2", 16));
  return check_buffer(saved, saved_bytes, moe_saved_state_size(s), fn, "saved", "saved_bytes",
                      "moe_saved_state_size");
}

// SMs of the current device (the persistent GEMMs' grid); fails unless it is a Hopper (sm_90)
// GPU, the only target the kernels are built for (a launch elsewhere would fail less clearly).
inline Status sm_count(int* out) {
  int dev = 0, major = 0, minor = 0;
  SMOE_CUDA_RETURN(cudaGetDevice(&dev));
  SMOE_CUDA_RETURN(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  SMOE_CUDA_RETURN(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major != 9)
    return detail::make_status(StatusCode::kNotImplemented,
                               detail::concat("moe: device ", dev, " is sm_", major, minor,
                                              "; this build targets Hopper (sm_90a) only"));
  SMOE_CUDA_RETURN(cudaDeviceGetAttribute(out, cudaDevAttrMultiProcessorCount, dev));
  return Status{};
}

}  // namespace layer
}  // namespace smoe
