// CUTLASS 4.2 ptr-array varlen-K grouped GEMM (weight gradients with contiguous operands), kept
// beside the engine because on wide experts it still beats the engine's gathered varlen-K (the
// layer's dW path heuristic, src/moe/dw_path.h, picks per GEMM). Problem sizes and operand
// pointers are built ON THE DEVICE from expert_offset by a tiny setup kernel: no host sync.
//
//  varlen-K: the token dimension is the reduction. For expert e:
//     D_e[i][j] = sum over rows r of e: P[r][i] * Q[r][j]       (D_e = D + e*M*N: [M][N])
//   P and Q are contiguous grouped rows (gather them first). An expert with no rows gets an
//   all-zero problem (CUTLASS 4.2 fails on K = 0) and its D_e is zeroed by a separate kernel.
//
// Element offsets are 64-bit throughout (T*K*d may exceed 2^31).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "smoe/smoe.h"

namespace smoe {
namespace gemm {

struct VarlenKArgs {
  int num_experts = 0;
  int M = 0;
  int N = 0;
  const int32_t* expert_offset = nullptr;  // [E+1] device
  const bf16* P = nullptr;                 // [rows][ld_p]: its first M columns
  int64_t ld_p = 0;                        // 0: M (dW1 over one half of a halves dH: 2n)
  const bf16* Q = nullptr;                 // [rows][N]
  bf16* D = nullptr;                       // [E][M][N]
};

// Workspace of one call (problem/pointer/stride arrays + CUTLASS's own).
size_t varlen_k_workspace_size(int num_experts, int sm_count);
Status varlen_k_gemm(const VarlenKArgs& args, void* workspace, size_t workspace_bytes,
                     int sm_count, cudaStream_t stream);

namespace inst {
size_t tt_workspace_size(int groups, int sm_count);
Status tt_run(const VarlenKArgs& a, void* ws, size_t ws_bytes, int sm_count, cudaStream_t s);
}  // namespace inst

}  // namespace gemm
}  // namespace smoe
