// The layer's six expert GEMMs as engine arguments, one builder per GEMM, shared by the token-major
// layer (moe/forward.cu, moe/backward.cu) and the expert-major layer (expert_major/forward.cu,
// backward.cu). The two layers differ only in where the grouped rows come from (a gather of the T
// tokens, or of the caller's R rows) and in the gate/up layout; what each GEMM reads and writes is
// the same, so it is written once here.
//
//   up-proj   H = x[gather] W1_e, A = SwiGLU(H)        varlen-M, gathered, SwiGLU epilogue
//   down-proj Y = A W2_e                                varlen-M, A by TMA
//   dA'       dO[gather] W2_e^T -> dH, A' = s A, dS     varlen-M, gathered, dSwiGLU + dS epilogue
//   dW2_e     = dO[gather]_e^T A'_e                     varlen-K, dO gathered
//   dW1_e     = dH_e^T x[gather]_e                      varlen-K, x gathered (one call per half
//                                                       when gate / up are two tensors)
//   dX~       = dH W1_e                                 varlen-M, dH by TMA
#pragma once

#include <cstdint>

#include "engine/args.h"
#include "smoe/smoe.h"

namespace smoe {
namespace layer {

// What every GEMM of one layer call shares: the grouped rows and where they come from.
struct ExpertRows {
  int E = 0;
  int d = 0;
  int n = 0;
  int64_t rows = 0;                       // grouped-row capacity (T*K, or R); the kernels read the
                                          // actual rows per expert from expert_offset on the device
  const int32_t* expert_offset = nullptr; // [E + 1], device
  const int32_t* gather = nullptr;        // grouped row -> row of x and of dout
  int64_t source_rows = 0;                // rows of x and of dout (T, or R)
};

// The gate/up weights as the engine takes them (engine::VarlenMArgs::B, B2, b_expert_stride,
// halves): interleaved in one tensor {w1, null, 0, false}; two tensors {w1, w3, 0, true}; one
// concatenated [E][2n][d] tensor {w1, w1 + n d, 2n, true} (no copy of the weights).
struct GateUp {
  const bf16* b = nullptr;   // gate rows (or interleaved gate/up)
  const bf16* b2 = nullptr;  // up rows, or null (interleaved)
  int64_t stride = 0;        // rows of b (and b2) from one expert to the next; 0 = packed
  bool halves = false;       // H / dH in halves: columns [0, n) gate, [n, 2n) up
};

// The token-major layer's weights: w3 set means two tensors (gate rows in w1, up rows in w3, H in
// halves); else w1 interleaves them. (The expert-major layouts: expert_major/weights.h.)
inline GateUp gate_up_of(const MoEWeights& w) { return {w.w1, w.w3, 0, w.w3 != nullptr}; }

// Fields every varlen-M GEMM of the layer sets alike.
inline engine::VarlenMArgs varlen_m_over(const ExpertRows& r, int N, int K) {
  engine::VarlenMArgs m;
  m.num_experts = r.E;
  m.N = N;
  m.K = K;
  m.rows = r.rows;
  m.expert_offset = r.expert_offset;
  return m;
}

inline engine::VarlenKArgs varlen_k_over(const ExpertRows& r, int M, int N) {
  engine::VarlenKArgs k;
  k.num_experts = r.E;
  k.M = M;
  k.N = N;
  k.rows = r.rows;
  k.expert_offset = r.expert_offset;
  return k;
}

// H [rows][2n] and A [rows][n] from x gathered; W1 [E][2n][d] (N-rows, K-major).
inline engine::VarlenMArgs up_proj_args(const ExpertRows& r, const bf16* x, const GateUp& w, bf16* h, bf16* act) {
  engine::VarlenMArgs m = varlen_m_over(r, 2 * r.n, r.d);
  m.A = x;
  m.a_rows = r.source_rows;
  m.gather_idx = r.gather;
  m.B = w.b;
  m.B2 = w.b2;
  m.b_expert_stride = w.stride;
  m.halves = w.halves;
  m.b_major = engine::WeightMajor::kNK;
  m.epilogue = engine::Epilogue::kSwiGLU;
  m.D = h;
  m.D2 = act;
  return m;
}

// Y [rows][d] = A W2_e; W2 [E][d][n] (N-rows, K-major); A is the grouped rows themselves.
inline engine::VarlenMArgs down_proj_args(const ExpertRows& r, const bf16* act, const bf16* w2, bf16* y) {
  engine::VarlenMArgs m = varlen_m_over(r, r.d, r.n);
  m.A = act;
  m.a_rows = r.rows;
  m.B = w2;
  m.b_major = engine::WeightMajor::kNK;
  m.epilogue = engine::Epilogue::kStore;
  m.D = y;
  return m;
}

// What the dSwiGLU + dS epilogue reads and writes besides the GEMM's operands.
struct DSwiGLUIo {
  const bf16* h = nullptr;            // saved H [rows][2n]
  const float* scores = nullptr;      // by entry (flat (token, k) index, or expert-major row)
  const int32_t* scatter = nullptr;   // grouped row -> entry
  bf16* dh = nullptr;                 // [rows][2n]
  bf16* a_prime = nullptr;            // A' = s A [rows][n]
  float* ds_partial = nullptr;        // [rows][engine::ds_partial_tiles(n)]
};

// dA' = dout[gather] W2_e^T through the dSwiGLU + dS epilogue; W2 [E][d][n] = [E][K][N].
inline engine::VarlenMArgs da_proj_args(const ExpertRows& r, const bf16* dout, const bf16* w2, bool halves,
                                        const DSwiGLUIo& io) {
  engine::VarlenMArgs m = varlen_m_over(r, r.n, r.d);
  m.A = dout;
  m.a_rows = r.source_rows;
  m.gather_idx = r.gather;
  m.B = w2;
  m.b_major = engine::WeightMajor::kKN;
  m.epilogue = engine::Epilogue::kDSwiGLU;
  m.halves = halves;
  m.H = io.h;
  m.dH = io.dh;
  m.D2 = io.a_prime;
  m.scores = io.scores;
  m.scatter = io.scatter;
  m.ds_partial = io.ds_partial;
  return m;
}

// dW2 [E][d][n] = dout[gather]^T A' per expert.
inline engine::VarlenKArgs dw2_args(const ExpertRows& r, const bf16* dout, const bf16* a_prime, bf16* dw2) {
  engine::VarlenKArgs k = varlen_k_over(r, r.d, r.n);
  k.P = dout;
  k.ld_p = r.d;
  k.gather_p = r.gather;
  k.gather_rows = r.source_rows;
  k.Q = a_prime;
  k.ld_q = r.n;
  k.D = dw2;
  return k;
}

// dW1 = dH^T x[gather] per expert. One output (interleaved dH, or a concatenated [E][2n][d] gradient,
// which is dH-in-halves' gate rows then up rows in order): one call over [E][2n][d]. Two outputs (gate
// and up as two tensors, dH in halves): a call per half, each [E][n][d] (P = dH + half * n, ld_p = 2n).
inline engine::VarlenKArgs dw1_args(const ExpertRows& r, const bf16* dh, const bf16* x, bool two_outputs,
                                    int half, bf16* dw) {
  engine::VarlenKArgs k = varlen_k_over(r, two_outputs ? r.n : 2 * r.n, r.d);
  k.P = dh + static_cast<int64_t>(half) * r.n;
  k.ld_p = 2 * r.n;
  k.Q = x;
  k.ld_q = r.d;
  k.gather_q = r.gather;
  k.gather_rows = r.source_rows;
  k.D = dw;
  return k;
}

// dX~ [rows][d] = dH W1_e; W1 [E][2n][d] = [E][K][N] (halves: K-tiles [0, n) from b, [n, 2n) from b2).
inline engine::VarlenMArgs dx_tilde_args(const ExpertRows& r, const bf16* dh, const GateUp& w, bf16* dxt) {
  engine::VarlenMArgs m = varlen_m_over(r, r.d, 2 * r.n);
  m.A = dh;
  m.a_rows = r.rows;
  m.B = w.b;
  m.B2 = w.b2;
  m.b_expert_stride = w.stride;
  m.b_major = engine::WeightMajor::kKN;
  m.epilogue = engine::Epilogue::kStore;
  m.D = dxt;
  return m;
}

}  // namespace layer
}  // namespace smoe
