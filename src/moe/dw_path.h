// Which kernel computes each weight gradient (dW1, dW2): the engine's varlen-K with the gather
// fused into its loads, the engine's varlen-K on rows gathered first (engine_tma), or CUTLASS's
// ptr-array varlen-K on rows gathered first (v1's path).
//
// History: the fused-gather engine first won dW2 at n <= 512 and dW1 at n <= 256 against CUTLASS
// (3fdbba6 .. c4638e4, docs/engine.md "Heuristics"); engine_tma (below) replaced CUTLASS where it won.
// kEngineTma: the CUTLASS path's row gather, then the engine's varlen-K with both operands by TMA
// (dw_tma). Measured on the H200 (bench/results/h200/dw_paths_601b32e.log, every public config, ms, engine
// / cutlass / engine_tma), e.g.: dW1 30B n256 5.95 / 6.18 / 5.70, OLMoE 5.11 / 4.26 / 3.80, Qwen3-235B
// 17.9 / 13.2 / 12.1, DeepSeek-V3.2 50.4 / 32.6 / 30.8; dW2 30B n256 2.62 / 4.21 / 3.79, OLMoE
// 2.41 / 2.44 / 2.20, Qwen3 7.90 / 7.26 / 6.65, DeepSeek 19.2 / 17.6 / 16.5. So the gathered
// cp.async loads, not the rest of the varlen-K, starved the engine (ncu: SM 53-60%, L2 40%): the
// same kernel on pre-gathered rows beats CUTLASS everywhere. dW1 takes engine_tma at every n; dW2
// keeps the fused gather for n <= 512, where the gather copy (T*K*d*2 bytes each way) costs more
// than the GEMM saves; since the varlen-K pairs (Q multicast), dW1 takes it too at n <= 256 (below). The CUTLASS path stays behind the switch (and as v1's reference).
// SMOE_DW_PATH=engine, =cutlass or =engine_tma forces one path for both (comparisons, tests).
#pragma once

#include <cstdlib>
#include <cstring>

#include "smoe/smoe.h"

namespace smoe {
namespace layer {

enum class DwPath { kEngine, kCutlass, kEngineTma };

inline DwPath forced_dw_path(bool* forced) {
  const char* v = std::getenv("SMOE_DW_PATH");
  *forced = true;
  if (v != nullptr && std::strcmp(v, "engine") == 0) return DwPath::kEngine;
  if (v != nullptr && std::strcmp(v, "cutlass") == 0) return DwPath::kCutlass;
  if (v != nullptr && std::strcmp(v, "engine_tma") == 0) return DwPath::kEngineTma;
  *forced = false;
  return DwPath::kCutlass;
}

inline DwPath dw2_path(const MoEShape& s) {
  bool forced = false;
  const DwPath f = forced_dw_path(&forced);
  if (forced) return f;
  return s.n <= 512 ? DwPath::kEngine : DwPath::kEngineTma;
}

// dW1: the fused gather at n <= 256 when the experts average >= kDw1FusedMinRows rows, engine_tma
// otherwise. Measured on the H200 with the varlen-K pairs (Q multicast), ms, fused / engine_tma
// (bench/results/h200/varlen_k_c2/: wip_env_table.md, and dw1_rows.md, 20 reps):
//   rows/expert 2560 (1.4B n256) 0.576 / 0.625; 2048 (30B n256) 5.35 / 5.61; 1536 (7B n256) 0.736 /
//   0.783; 1024 (narrow E384 K12 n256) 2.246 / 2.205; 256 (narrow E512 K8 n128) 0.310 / 0.304;
//   n 512: 7B n512 0.635 / 0.592; n 1024-1536: OLMoE 4.68 / 3.78, Qwen3-235B 16.3 / 11.7.
// At small n the gather copy (2 T K d bytes each way) is a large share of a GEMM with only 2n
// columns per row; short reductions (few rows per expert) leave the gathered loads' latency
// unhidden at every tile's start, and at large n the cp.async gather starves the MMA.
constexpr int64_t kDw1FusedMinRows = 1280;  // between the measured 1024 (loses 2%) and 1536 (wins 6%)
inline DwPath dw1_path(const MoEShape& s) {
  bool forced = false;
  const DwPath f = forced_dw_path(&forced);
  if (forced) return f;
  const int64_t rows_per_expert = s.T * s.K / (s.E > 0 ? s.E : 1);
  return s.n <= 256 && rows_per_expert >= kDw1FusedMinRows ? DwPath::kEngine : DwPath::kEngineTma;
}

}  // namespace layer
}  // namespace smoe
