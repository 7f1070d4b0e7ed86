// Host side of the SwiGLU epilogue (up-proj): device parameters, the mapping from a call's
// arguments, and its rules.
#pragma once

#include "common/check.h"
#include "engine/args.h"

namespace smoe {
namespace engine {

struct EpiSwiGLUParams {
  bf16* H;     // [rows][N]   N = 2n
  bf16* A;     // [rows][N/2]
  int64_t ld;  // N
};
inline EpiSwiGLUParams swiglu_params(const VarlenMArgs& a) { return {a.D, a.D2, a.N}; }

// N = 2n holds (gate, up) pairs of n % 64 == 0 units; halves (H as [gate | up]) comes with the
// two-tensor weights B2, since an interleaved W1 gives interleaved H.
inline Status check_swiglu_shape(const VarlenMArgs& a, const char* fn) {
  if (a.N % 128 != 0)
    return detail::make_status(StatusCode::kInvalidArgument,
                               detail::concat(fn, ": N = ", a.N,
                                              " must be a multiple of 128 for the SwiGLU epilogue (2n, n % 64 == 0)"));
  if (a.B2 != nullptr && !a.halves)
    return detail::make_status(StatusCode::kInvalidArgument,
                               detail::concat(fn, ": B2 with the SwiGLU epilogue stores H in halves: set halves"));
  if (a.halves && a.B2 == nullptr)
    return detail::make_status(StatusCode::kInvalidArgument,
                               detail::concat(fn, ": halves with the SwiGLU epilogue needs B2 (an interleaved W1 "
                                                  "gives interleaved H)"));
  return Status{};
}
inline Status check_swiglu_pointers(const VarlenMArgs& a, const char* fn) {
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.D, fn, "D (H)", 16));
  return detail::check_ptr(a.D2, fn, "D2 (A)", 16);
}

}  // namespace engine
}  // namespace smoe
