// Random float64 layer weights for the reference tests (scaled 1/sqrt(fan-in)).
#pragma once

#include <cmath>
#include <cstdint>

#include "smoe/reference.h"
#include "test_seed.h"

namespace smoe_test {

inline smoe::ref::MoEWeights random_weights(Rng& rng, const smoe::ref::MoEShape& s) {
  smoe::ref::MoEWeights w;
  w.w_router = rng.normals(static_cast<int64_t>(s.E) * s.d, 1.0 / std::sqrt(s.d));
  w.w1 = rng.normals(static_cast<int64_t>(s.E) * 2 * s.n * s.d, 1.0 / std::sqrt(s.d));
  w.w2 = rng.normals(static_cast<int64_t>(s.E) * s.d * s.n, 1.0 / std::sqrt(s.n));
  return w;
}

}  // namespace smoe_test
