// Which kernel computes each weight gradient (dW1, dW2): the engine's varlen-K with the gather
// fused into its loads (kEngine), the engine's varlen-K on rows gathered first into the then free
// dX~ buffer, both operands by TMA (kEngineTma), or CUTLASS's ptr-array varlen-K on rows gathered
// first (kCutlass, v1's path, kept behind the switch as a reference).
// SMOE_DW_PATH=engine, =cutlass or =engine_tma forces one path for both (comparisons, tests).
//
// The fused gather saves the row gather's copy (2 T K d bytes each way) but gathers each row again
// for every N-tile of the varlen-K (the gathered side is the 128-wide M side; the other operand's
// width / BN tiles re-read it), through cp.async instead of TMA. Measured on the H200 (ms, fused /
// engine_tma; bench/results/h200/varlen_k_c2/ and loader_smem_9f37981/, with the varlen-K pairs and
// the shared-memory row offsets of 9f37981):
//   dW2 (re-gathered n / BN times): n 128 (1 N-tile) 0.139 / 0.245; n 256 (1) 1.4B 0.228 / ~0.45,
//   narrow E384 0.736 / 1.474; 7B n512 (2) 0.256 / 0.391; T20000 n768 (3) 1.057 / 1.342; OLMoE
//   n1024 (4) 1.899 / 2.173; Qwen3-235B n1536 (6) 5.857 / 6.393; DeepSeek-V3.2 n2048 (8) 16.48 /
//   17.64; but T12345 n1408 (BN 128: 11) 1.941 / 1.459, wide E8 n4096 (16) 1.938 / 1.839, wide E4
//   n8192 (32) 0.511 / 0.474.
//   dW1 (x re-gathered 2n / 256 times): n 256: 1.4B 0.452 (fused, 9f37981) / ~0.62, narrow E384
//   (1024 rows per expert) 1.922 / 2.169, narrow E512 (256 rows) 0.302 / 0.304; 7B n512 (1536 rows)
//   0.542 / 0.603, but Qwen3-Next n512 (640 rows) 4.230 / 3.408; T20000 n768 2.524 / 2.292; OLMoE
//   n1024 3.919 / 3.807; Qwen3-235B n1536 13.68 / 11.76; DeepSeek n2048 37.5 / 30.8.
// So dW2 took the fused gather up to 8 N-tiles, dW1 at n <= 512 with >= 1024 rows per expert on
// average (short reductions leave the gathered loads' start-up latency unhidden in every tile).
// Since the copies of a K-tile are issued back to back from staged absolute addresses (15796e9,
// bench/results/h200/varlen_k_issue/; fused dW2 2-9% and dW1 2-4% faster on the public configs):
//   dW2 fused wins past 8 N-tiles too (ms engine_tma / fused at 9766ecd, two runs each): T12345
//   n1408 (11) 1.51-1.54 / 1.40, wide E8 n4096 (16) 1.85-1.89 / 1.77-1.78, wide E4 n8192 (32)
//   0.47-0.48 / 0.45-0.47: dW2 always takes it.
//   dW1 fused also wins at 512 < n <= 1536 with >= 3072 rows per expert (ms engine_tma / fused at
//   15796e9, two runs each): 4096 rows: n1024 d2048 1.92-1.98 / 1.86-1.87, n768 d3072 1.16-1.17 /
//   1.06, n1024 d4096 7.74 / 7.52-7.59, OLMoE n1024 3.86 / 3.70 (a tie in another call); 6144 rows
//   n1536 7.60-7.65 / 7.46; 3072 rows n768 d3072 5.18-5.33 / 4.95-5.01; but with 2048 rows it
//   loses: n1024 d2048 2.02-2.07 / 2.16, n768 d2048 3.18-3.20 / 3.26-3.28, 120B n1024 8.18 / 8.67,
//   Qwen3-235B n1536 11.84 / 13.12, K1 E16 n1024 0.48-0.52 / 0.53; and at n 4096-8192 (wide E8 /
//   E4: 3.48-3.56 / 3.80-3.83, 0.90-0.92 / 1.05-1.09).
// Since every varlen-K kernel stores through stmatrix (.trans for dW1) and TMA (71543c7; the
// register transpose of the dW1 epilogue held ~45% of its consumers' samples), the fused dW1 wins on
// all 32 shapes measured (public configs, sweep, 13 more; ms fused / engine_tma, two runs each,
// bench/results/h200/varlen_k_issue/call8_tma_store/b0_dwpaths.md): Qwen3-Next (640 rows) 2.84-2.97 /
// 3.41-3.51, narrow E512 (256 rows) 0.205 / 0.32, 120B (2048 rows) 7.34-7.45 / 8.15-8.25, Qwen3-235B
// 11.67-11.69 / 11.99-12.43, DeepSeek n2048 28.97-29.05 / 29.48-29.81, wide E8 n4096 3.43 / 3.50-3.54,
// wide E4 n8192 0.885-0.922 / 0.906-0.942 (the closest), T20000 n768 2.02 / 2.35. Both gradients take
// the fused gather; the other paths stay behind SMOE_DW_PATH.

#pragma once

#include <cstdint>
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

inline DwPath dw2_path(const MoEShape&) {
  bool forced = false;
  const DwPath f = forced_dw_path(&forced);
  return forced ? f : DwPath::kEngine;
}

inline DwPath dw1_path(const MoEShape&) {
  bool forced = false;
  const DwPath f = forced_dw_path(&forced);
  return forced ? f : DwPath::kEngine;
}

}  // namespace layer
}  // namespace smoe
