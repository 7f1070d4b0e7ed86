// One row through one SwiGLU expert in float64: the step every reference layer shares.
#pragma once

#include <cstdint>

#include "smoe/reference.h"

namespace smoe {
namespace ref {
namespace detail {

// H = x W1_e^T (2n, interleaved like w1), A = silu(gate) * up (n), Y = A W2_e^T (d).
inline void expert_row_forward(const double* x, const double* w1e, const double* w2e, int64_t d, int64_t n,
                               double* h, double* a, double* y) {
  for (int64_t c = 0; c < 2 * n; ++c) {
    double acc = 0.0;
    for (int64_t i = 0; i < d; ++i) acc += x[i] * w1e[c * d + i];
    h[c] = acc;
  }
  for (int64_t j = 0; j < n; ++j) a[j] = swiglu_ref(h[2 * j], h[2 * j + 1]);
  for (int64_t i = 0; i < d; ++i) {
    double acc = 0.0;
    for (int64_t j = 0; j < n; ++j) acc += a[j] * w2e[i * n + j];
    y[i] = acc;
  }
}

}  // namespace detail
}  // namespace ref
}  // namespace smoe
