// Internal helpers: building Status values, argument checks and CUDA error checks.
#pragma once

#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <type_traits>

#include <cuda_runtime_api.h>

#include "smoe/smoe.h"

namespace smoe {
namespace detail {

inline Status make_status(StatusCode code, const std::string& msg) { return Status{code, msg}; }

// Message building without iostreams: numbers through std::to_string, pointers through
// snprintf. Why: in the PyTorch extension, built on the GPU machine by a toolchain whose
// libstdc++ differs from the one the Python process loads, ostream number formatting (num_put
// facets of the process's locale) crashed; to_string and snprintf use no locale.
inline void append(std::string& s, const char* v) { s += v ? v : "(null)"; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, const void* p) {
  char b[32];
  std::snprintf(b, sizeof b, "%p", p);
  s += b;
}
template <typename T>
std::enable_if_t<std::is_arithmetic_v<T>> append(std::string& s, T v) {
  s += std::to_string(v);
}

template <typename... Args>
std::string concat(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}

// Checked arithmetic: the one helper every size rule and size query uses. Returns false (and
// leaves *out unspecified) when the product of the factors overflows int64 or exceeds `limit`.
inline bool checked_product(std::initializer_list<int64_t> factors, int64_t limit, int64_t* out) {
  int64_t p = 1;
  for (int64_t f : factors) {
    if (f < 0 || __builtin_mul_overflow(p, f, &p)) return false;
  }
  *out = p;
  return p <= limit;
}

// Workspace carving rounds every region up to kWorkspaceAlignment (256) bytes.
inline size_t align_workspace(size_t bytes) {
  return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

inline bool is_aligned(const void* p, size_t a) {
  return (reinterpret_cast<uintptr_t>(p) % a) == 0;
}

// Checks a device pointer argument: not null, aligned to `align` bytes.
inline Status check_ptr(const void* p, const char* fn, const char* name, size_t align) {
  if (p == nullptr)
    return make_status(StatusCode::kInvalidArgument,
                       concat(fn, ": ", name, " is null (a device pointer is required)"));
  if (!is_aligned(p, align))
    return make_status(StatusCode::kMisalignedPointer,
                       concat(fn, ": ", name, " = ", p, " must be ", align, "-byte aligned"));
  return Status{};
}

inline Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status{};
  return make_status(StatusCode::kCudaError,
                     concat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

}  // namespace detail
}  // namespace smoe

// Return early from a function returning Status.
#define SMOE_RETURN_IF_ERROR(expr)        \
  do {                                    \
    ::smoe::Status _s = (expr);           \
    if (!_s.ok()) return _s;              \
  } while (0)

#define SMOE_CUDA_RETURN(expr) SMOE_RETURN_IF_ERROR(::smoe::detail::cuda_status((expr), #expr))

// After a kernel launch: report launch-configuration errors without synchronising.
#define SMOE_CHECK_LAUNCH(name) \
  SMOE_RETURN_IF_ERROR(::smoe::detail::cuda_status(cudaGetLastError(), "launch of " name))
