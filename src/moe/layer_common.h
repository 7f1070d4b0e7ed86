// Helpers shared by the layer's forward and backward: buffer checks and the SM count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "common/check.h"
#include "smoe/smoe.h"

namespace smoe {
namespace layer {

inline Status check_buffer(const void* p, size_t have, size_t need, const char* fn, const char* name,
                           const char* bytes_name, const char* query) {
  if (need == 0 && p == nullptr) return Status{};  // nothing to hold (e.g. T = 0 with provided routing)
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
  if (s.T > 0) SMOE_RETURN_IF_ERROR(detail::check_ptr(x, fn, "x", 16));  // T = 0: token tensors may be null
  if (s.router != MoERouter::kProvided)  // provided routing never reads the router weights
    SMOE_RETURN_IF_ERROR(detail::check_ptr(w.w_router, fn, "weights.w_router", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(w.w1, fn, "weights.w1", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(w.w2, fn, "weights.w2", 16));
  if (w.w3 != nullptr) SMOE_RETURN_IF_ERROR(detail::check_ptr(w.w3, fn, "weights.w3", 16));
  return check_buffer(saved, saved_bytes, moe_saved_state_size(s), fn, "saved", "saved_bytes",
                      "moe_saved_state_size");
}

// A caller buffer as a byte range, for the aliasing rule below.
struct Span {
  const void* p;
  size_t bytes;
  const char* name;
};

// Outputs must not overlap an input or each other: an alias would silently change results (dw1 ==
// w1 overwrites weights the same backward still reads; out == x, saved inside the workspace, ...).
// Spans of 0 bytes (T = 0) cannot overlap anything. Host arithmetic only: runs before any CUDA call.
inline Status check_disjoint(const char* fn, std::initializer_list<Span> outputs, std::initializer_list<Span> inputs) {
  auto overlap = [](const Span& a, const Span& b) {
    if (a.bytes == 0 || b.bytes == 0) return false;
    const uintptr_t a0 = reinterpret_cast<uintptr_t>(a.p), b0 = reinterpret_cast<uintptr_t>(b.p);
    return a0 - b0 < b.bytes || b0 - a0 < a.bytes;  // unsigned: a0 in [b0, b0 + b) or b0 in [a0, a0 + a)
  };
  auto fail = [&](const Span& o, const Span& other) {
    return detail::make_status(StatusCode::kInvalidArgument,
                               detail::concat(fn, ": ", o.name, " (", o.bytes, " bytes) overlaps ", other.name, " (",
                                              other.bytes, " bytes): outputs must not alias inputs or each other"));
  };
  for (auto o = outputs.begin(); o != outputs.end(); ++o) {
    for (auto o2 = o + 1; o2 != outputs.end(); ++o2)
      if (overlap(*o, *o2)) return fail(*o, *o2);
    for (const Span& in : inputs)
      if (overlap(*o, in)) return fail(*o, in);
  }
  return Status{};
}

// Bytes of the layer's tensors (the shape passed moe_can_implement, so no product overflows).
struct TensorBytes {
  size_t tokens;    // x, out, dout, dx: [T][d]
  size_t router;    // [E][d]
  size_t w1;        // [E][2n][d]
  size_t w2;        // [E][d][n]
  size_t slots;     // provided routing's [T][K] ids / scores / dscores (4 bytes each)
  explicit TensorBytes(const MoEShape& s)
      : tokens(static_cast<size_t>(s.T) * s.d * 2),
        router(s.router == MoERouter::kProvided ? 0 : static_cast<size_t>(s.E) * s.d * 2),
        w1(static_cast<size_t>(s.E) * 2 * s.n * s.d * 2),
        w2(static_cast<size_t>(s.E) * s.d * s.n * 2),
        slots(s.router == MoERouter::kProvided ? static_cast<size_t>(s.T) * s.K * 4 : 0) {}
};

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
