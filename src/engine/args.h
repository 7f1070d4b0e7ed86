// The engine's call arguments: one struct per grouping kind (varlen-M: rows grouped by expert;
// varlen-K: a reduction over each expert's rows). The layouts are described in engine.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "smoe/smoe.h"

namespace smoe {
namespace engine {

enum class Epilogue { kStore, kSwiGLU, kDSwiGLU };
enum class WeightMajor { kNK, kKN };

struct VarlenMArgs {
  int num_experts = 0;
  int N = 0;
  int K = 0;
  int64_t rows = 0;                      // grouped rows (T*K)
  const int32_t* expert_offset = nullptr;
  const bf16* A = nullptr;               // [a_rows][K]
  int64_t a_rows = 0;
  const int32_t* gather_idx = nullptr;   // [rows]; null: A is the grouped rows themselves
  const bf16* B = nullptr;
  const bf16* B2 = nullptr;     // up-proj / dX~: the up weights w3 when gate/up are two tensors
  bool halves = false;          // kSwiGLU / kDSwiGLU: H (and dH) in halves layout; set with B2
  // With B2: rows of B (and of B2) from one expert to the next along the expert-indexed extent
  // (K-major: N-rows, MN-major: K-rows); 0 = packed (N/2, K/2). Gate/up concatenated in one
  // [E][2n][d] tensor (Megatron-Core fc1, transformers' gate_up_proj) is B = w1, B2 = w1 + n rows,
  // b_expert_stride = 2n: no copy of the weights.
  int64_t b_expert_stride = 0;
  WeightMajor b_major = WeightMajor::kNK;
  Epilogue epilogue = Epilogue::kStore;
  bf16* D = nullptr;            // kStore: [rows][N]; kSwiGLU: H [rows][N]
  bf16* D2 = nullptr;           // kSwiGLU: A [rows][N/2]; kDSwiGLU: A' [rows][N]
  const bf16* H = nullptr;      // kDSwiGLU: [rows][2N]
  bf16* dH = nullptr;           // kDSwiGLU: [rows][2N]
  const float* scores = nullptr;       // kDSwiGLU: by flat (token, k) index
  const int32_t* scatter = nullptr;    // kDSwiGLU: grouped row -> flat index
  float* ds_partial = nullptr;         // kDSwiGLU: [rows][ds_partial_tiles(N)]
};

struct VarlenKArgs {
  int num_experts = 0;
  int M = 0;
  int N = 0;
  int64_t rows = 0;
  const int32_t* expert_offset = nullptr;
  const bf16* P = nullptr;
  int64_t ld_p = 0;
  const int32_t* gather_p = nullptr;  // at most one of gather_p / gather_q is non-null; the other
                                      // operand's rows (both, if neither) are the grouped rows
  const bf16* Q = nullptr;
  int64_t ld_q = 0;
  const int32_t* gather_q = nullptr;
  // Rows of the gathered operand's tensor (P with gather_p, Q with gather_q; the indices are below
  // it), as a_rows of varlen-M. Optional: 0 = unknown, and the tuner's overlap check then takes
  // `rows` rows of it (a gather from fewer rows could make an output just past it look like an
  // overlap: that call is not measured). The kernels do not read it.
  int64_t gather_rows = 0;
  bf16* D = nullptr;                  // [E][M][N]
};

}  // namespace engine
}  // namespace smoe
