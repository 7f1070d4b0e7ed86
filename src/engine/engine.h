// The fused MoE GEMM engine (sm_90a): our own warp-specialised, persistent grouped GEMMs with the
// gather fused into the operand load and the SwiGLU / dSwiGLU + dS math fused into the epilogue.
// Replaces v1's CUTLASS ptr-array GEMMs plus the separate gather, SwiGLU and dH kernels.
//
// All matrices row-major bf16, fp32 accumulate, element offsets 64-bit. Rows are grouped by expert:
// expert e owns grouped rows [expert_offset[e], expert_offset[e+1]) (device array; no host sync).
//
// varlen-M   D[r][c] = sum_k A[src(r)][k] * B_e(c, k)      (r a row of expert e)
//   src(r) = gather_idx[r] (gathered rows of A, by cp.async) or r (contiguous, by TMA);
//   B_e stored K-major [E][N][K] (kNK, nn.Linear) or MN-major [E][K][N] (kKN).
//   up-proj   A = x gathered,  B = W1 [E][2n][d] kNK, epilogue SwiGLU  -> H, A
//   down-proj A = A,           B = W2 [E][d][n]  kNK, epilogue Store   -> Y
//   dA'       A = dO gathered, B = W2 [E][d][n]  kKN, epilogue DSwiGLU -> dH, A', ds_partial
//   dX~       A = dH,          B = W1 [E][2n][d] kKN, epilogue Store   -> dX~
// Gate/up as two tensors (B2 non-null; docs/engine.md "Two-tensor gate/up weights"):
//   up-proj   B = w1 (gate) [E][n][d], B2 = w3 (up) [E][n][d]: an N-tile of BN columns takes BN/2
//             gate rows and the same BN/2 up rows (two TMA boxes); H is stored in halves
//             ([rows][2n]: gate in columns [0, n), up in [n, 2n)); in a cluster each CTA
//             loads and multicasts its part of both boxes.
//   dA'       halves = true: H and dH in that halves layout.
//   dX~       B = w1 [E][n][d], B2 = w3 [E][n][d] kKN: K = 2n, K-tiles below n from B, the rest
//             from B2 (dH in halves layout).
// varlen-K   D_e[m][c] = sum over rows r of e: P[srcP(r)][m] * Q[srcQ(r)][c]   (D: [E][M][N])
//   dW2: P = dO gathered (M = d), Q = A' (N = n);  dW1: P = dH (M = 2n), Q = x gathered (N = d).
//   Exactly one operand is gathered (cp.async); the other is loaded by TMA. A Q-gathered call runs
//   as its transpose (the gathered operand on the kernel's 128-wide side, D stored transposed).
//   An expert without rows gets D_e = 0. (The layer uses CUTLASS instead for wide experts:
//   src/moe/dw_path.h.)
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
  bf16* D = nullptr;                  // [E][M][N]
};

// Column tiles of the dSwiGLU GEMM (the second extent of ds_partial).
int ds_partial_tiles(int N);
// The row (M) tile of every varlen-M instantiation (TileConfig::BM): a partial tile of an expert
// wastes MMA rows, which token rounding avoids by rounding counts to this.
constexpr int kRowTile = 128;

// Checks the rules (extents multiples of 64, pointers 16-byte aligned, rows < 2^31) first; nothing
// runs on a rejected call.
Status varlen_m(const VarlenMArgs& a, int sm_count, cudaStream_t stream);
Status varlen_k(const VarlenKArgs& a, int sm_count, cudaStream_t stream);

// The tile chosen for a call (heuristic in engine.cu). SMOE_ENGINE_PRINT=1 prints it per call.
struct Choice {
  int bn;
  bool pingpong;     // schedule (tile_config.cuh): ping-pong or cooperative
  int cluster;       // 1, 2 (a pair along M, B multicast) or -2 (a pair along N, A multicast)
  const char* name;  // the instantiation, e.g. "down_store_pp_c2<192>"; nullptr: none fits
  int bm = 128;      // rows of a tile: 128, or 64 (ping-pong 64 x 256, "_pp64")
};
// SwiGLU and store GEMMs with K up to this run ping-pong by default (engine.cu).
constexpr int kPingPongMaxK = 2048;
// 2-CTA clusters (B multicast) by default when one expert's weights exceed this (half the 50 MB
// L2 of the H100 / H200) and the experts average at least this many rows (engine.cu).
constexpr int64_t kClusterMinWeightBytes = int64_t{24} << 20;
constexpr int kClusterMinRowsPerExpert = 512;
// Ping-pong store GEMMs with K up to this stage their tile in shared memory for TMA stores
// (EpiStoreStagedT) by default (engine.cu).
constexpr int kStagedStoreMaxK = 512;
// ... in two slabs per warpgroup (a 64-row buffer, EpiStoreStagedT<2>, labels _pps2) up to this K.
constexpr int kStagedStore2MaxK = 256;
Choice choose_varlen_m(const VarlenMArgs& a, int sm_count);
Choice choose_varlen_k(const VarlenKArgs& a, int sm_count);
// The epilogues store their outputs with L2 evict-first (st.global.cs) unless
// SMOE_ENGINE_STORE_CS=0 (epilogue.cuh, store_out).
bool store_streaming();


}  // namespace engine
}  // namespace smoe
