// The fused MoE GEMM engine (sm_90a): our own warp-specialised, persistent grouped GEMMs with the
// gather fused into the operand load and the SwiGLU / dSwiGLU + dS math fused into the epilogue.
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
//   An expert without rows gets D_e = 0.
//
// Host side, one job per file: rules.* (argument rules), heuristic.* (a pure choose(args, device,
// overrides) -> EngineConfig), overrides.* (the SMOE_ENGINE_* switches, parsed once), config.*
// (the typed configuration and the built instantiations), dispatch.* (the dispatch tables),
// engine.cpp (the entry points), and the tuner: tune_cache.* (keys, the JSON file), tune_store.* (the
// process's cache), candidates.*, tune_policy.* and tuner.* (measuring, SMOE_ENGINE_TUNE=1).
// Device side: gemm_kernel.cuh composes producer_varlen_{m,k}.cuh, consumer_mma.cuh,
// epilogue/*.cuh and tile_scheduler.cuh; gemm_launch.cuh maps a configuration to its instantiation.
#pragma once

#include <optional>
#include <string>

#include "engine/args.h"
#include "engine/config.h"
#include "engine/dispatch.h"  // RunVarlenM
#include "engine/epilogue/dswiglu.h"  // ds_partial_tiles: the layer sizes the dS partials by it

namespace smoe {
namespace engine {

// The row (M) tile of the 128-row instantiations (TileConfig::BM): a partial tile of an expert
// wastes MMA rows, which token rounding avoids by rounding counts to this.
constexpr int kRowTile = 128;

// Check the rules (rules.h) first; nothing runs on a rejected call. Then the heuristic's choice
// (heuristic.h, with the overrides of overrides.h) runs on `stream` over a grid of <= sm_count CTAs.
Status varlen_m(const VarlenMArgs& a, int sm_count, cudaStream_t stream);
Status varlen_k(const VarlenKArgs& a, int sm_count, cudaStream_t stream);

// varlen_m in two steps, for a caller that must know the call will launch before it changes any
// state: the layer's consuming backward (MoEBackwardArgs::consume_saved) spends the saved state only
// once its dA' GEMM is prepared, so a call refused here leaves that state as it was.
// prepare_varlen_m checks the rules, makes (and prints) the choice and does the launch's host setup
// (the kernel's shared-memory attribute, the cluster slots: dispatch.h's LaunchStep::kSetup), launching
// nothing but what SMOE_ENGINE_TUNE=1 measures; launch then runs it on the same arguments, and only a
// failure of the launch itself (cudaLaunchKernelEx, an earlier asynchronous error) can come after.
// varlen_m is the two in turn, without the separate setup (its launch does it, with nothing between).
struct PreparedVarlenM {
  RunVarlenM run = nullptr;  // null after a refusal, and for zero rows (nothing to launch)
  Status launch(const VarlenMArgs& a, int sm_count, cudaStream_t stream) const;
};
Status prepare_varlen_m(const VarlenMArgs& a, int sm_count, cudaStream_t stream, PreparedVarlenM* out);

// The configuration a (rule-abiding) call runs and where it came from, as SMOE_ENGINE_PRINT shows it:
// "tuned" (the tune cache), "measured" (measured now: SMOE_ENGINE_TUNE=1, tuner.h), "override" (a
// switch forces it), "heuristic", or "heuristic; <why not measured>". Launches nothing unless
// SMOE_ENGINE_TUNE=1 measures; the entry points run what it returns (tests call it directly).
struct Choice {
  std::optional<EngineConfig> config;  // nullopt: no built instantiation fits
  std::string from;
};
Status choose_config(const VarlenMArgs& a, int sm_count, cudaStream_t stream, Choice* out);
Status choose_config(const VarlenKArgs& a, int sm_count, cudaStream_t stream, Choice* out);

// Outputs stored with L2 evict-first (st.global.cs) unless SMOE_ENGINE_STORE_CS=0 (epilogue/common.cuh,
// store_out_if); read by the instantiations at launch.
bool store_streaming();
// N-tiles per band of the varlen-M tile order (band_order, tile_order.h) of a GEMM whose experts
// each hold expert_weight_bytes of B: SMOE_ENGINE_N_BAND where set (0: one band; clamped to
// n_tiles), else kAutoNBand where those weights reach kBandMinWeightBytes (heuristic.h) and one band
// (n_tiles: every N-tile of an M-tile in turn) below. Read at launch by the varlen-M kernels' params.
int varlen_m_n_band(int n_tiles, int64_t expert_weight_bytes);
// The same for a varlen-M GEMM of extents N x K (one expert's B: N x K bf16) in column tiles of bn:
// what its params take (make_params) and what SMOE_ENGINE_PRINT reports, from one expression.
int varlen_m_n_band(int N, int K, int bn);

}  // namespace engine
}  // namespace smoe
