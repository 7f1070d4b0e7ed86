// Host side of the dSwiGLU + dS epilogue (dA'): device parameters, the mapping from a call's
// arguments, the dS partial-sum layout, and its rules.
#pragma once

#include "common/check.h"
#include "engine/args.h"

namespace smoe {
namespace engine {

struct EpiDSwiGLUParams {
  const bf16* H;          // [rows][2N]
  bf16* dH;               // [rows][2N]
  bf16* A_prime;          // [rows][N]
  const float* scores;    // by flat (token, k) index
  const int32_t* scatter; // grouped row -> flat index
  float* ds_partial;      // [rows][n_tiles]
  int64_t ld;             // N
  int n_tiles;
};

// dS partial sums: one per row and 128 columns whatever the tile width (a 256-wide tile writes
// two, dswiglu.cuh), so the layout does not depend on the instantiation the heuristic picks; the
// layer sums them per row afterwards in a fixed order (moe/layer_kernels.cu, ds_rowsum).
constexpr int ds_partial_tiles(int N) { return (N + 127) / 128; }

inline EpiDSwiGLUParams dswiglu_params(const VarlenMArgs& a) {
  return {a.H, a.dH, a.D2, a.scores, a.scatter, a.ds_partial, a.N, ds_partial_tiles(a.N)};
}

inline Status check_dswiglu_pointers(const VarlenMArgs& a, const char* fn) {
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.D2, fn, "D2 (A')", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.H, fn, "H", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dH, fn, "dH", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.scores, fn, "scores", 4));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.scatter, fn, "scatter", 4));
  return detail::check_ptr(a.ds_partial, fn, "ds_partial", 4);
}

}  // namespace engine
}  // namespace smoe
