// Grouped (per-expert) GEMMs for the MoE layer, on CUTLASS 4.2 ptr-array kernels for sm_90a.
//
// Every group is one expert. Problem sizes and operand pointers are built ON THE DEVICE from the
// routing's expert_offset by a tiny setup kernel, so no count ever travels to the host. The
// CUTLASS kernel gets no host problem shapes and sizes its persistent grid from the SM count.
//
// Two shapes of grouped GEMM cover the whole layer (all matrices row-major, bf16, fp32 accumulate):
//
//  varlen-M: rows are grouped by expert. For expert e with rows [o_e, o_e + m_e):
//     D[o_e + i][j] = sum_k A[o_e + i][k] * B_e(k, j)           (D: [rows][N], A: [rows][K])
//   with B_e stored per expert either as [N][K] (kWeightNK: nn.Linear layout, "TN" GEMM) or as
//   [K][N] (kWeightKN: the transpose is used, "NN" GEMM); B_e = B + e * N * K.
//     up-proj   H  = Xg  W1_e^T : N = 2n, K = d, W1 [E][2n][d]  kWeightNK
//     down-proj Y  = A   W2_e^T : N = d,  K = n, W2 [E][d][n]   kWeightNK
//     dA'          = dOg W2_e   : N = n,  K = d, W2 [E][d][n]   kWeightKN
//     dX~          = dH  W1_e   : N = d,  K = 2n, W1 [E][2n][d] kWeightKN
//
//  varlen-K: the token dimension is the reduction (weight gradients). For expert e:
//     D_e[i][j] = sum over rows r of e: P[r][i] * Q[r][j]       (D_e = D + e*M*N: [M][N])
//     dW2_e = dOg_e^T A'_e : P = dOg [rows][d], Q = A' [rows][n],  M = d,  N = n
//     dW1_e = dH_e^T  Xg_e : P = dH  [rows][2n], Q = Xg [rows][d], M = 2n, N = d
//   An expert with no rows gets an all-zero problem (CUTLASS 4.2 fails on K = 0) and its D_e is
//   zeroed by a separate kernel.
//
// Element offsets are 64-bit throughout (T*K*d may exceed 2^31).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "smoe/smoe.h"

namespace smoe {
namespace gemm {

enum class WeightLayout { kWeightNK, kWeightKN };

struct VarlenMArgs {
  int num_experts = 0;
  int N = 0;
  int K = 0;
  const int32_t* expert_offset = nullptr;  // [E+1] device
  const bf16* A = nullptr;                 // [rows][K]
  const bf16* B = nullptr;                 // [E][N][K] or [E][K][N]
  bf16* D = nullptr;                       // [rows][N]
  WeightLayout b_layout = WeightLayout::kWeightNK;
};

struct VarlenKArgs {
  int num_experts = 0;
  int M = 0;
  int N = 0;
  const int32_t* expert_offset = nullptr;  // [E+1] device
  const bf16* P = nullptr;                 // [rows][M]
  const bf16* Q = nullptr;                 // [rows][N]
  bf16* D = nullptr;                       // [E][M][N]
};

// Workspace of one call (problem/pointer/stride arrays + CUTLASS's own). Calls on one stream may
// share a workspace: each call is done with it when the next one starts.
size_t varlen_m_workspace_size(int num_experts, int sm_count, WeightLayout b_layout);
size_t varlen_k_workspace_size(int num_experts, int sm_count);

Status varlen_m_gemm(const VarlenMArgs& args, void* workspace, size_t workspace_bytes,
                     int sm_count, cudaStream_t stream);
Status varlen_k_gemm(const VarlenKArgs& args, void* workspace, size_t workspace_bytes,
                     int sm_count, cudaStream_t stream);

// Per-instantiation entry points (one CUTLASS configuration per .cu file).
namespace inst {
size_t tn_workspace_size(int groups, int sm_count);
size_t nn_workspace_size(int groups, int sm_count);
size_t tt_workspace_size(int groups, int sm_count);
Status tn_run(const VarlenMArgs& a, void* ws, size_t ws_bytes, int sm_count, cudaStream_t s);
Status nn_run(const VarlenMArgs& a, void* ws, size_t ws_bytes, int sm_count, cudaStream_t s);
Status tt_run(const VarlenKArgs& a, void* ws, size_t ws_bytes, int sm_count, cudaStream_t s);
}  // namespace inst

}  // namespace gemm
}  // namespace smoe
