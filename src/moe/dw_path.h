// Which kernel computes each weight gradient (dW1, dW2): the engine's varlen-K with the gather
// fused into its loads, the engine's varlen-K on rows gathered first (engine_tma), or CUTLASS's
// ptr-array varlen-K on rows gathered first (v1's path).
//
// Measured on the H200 (bench_layer, every public config, engine at 3fdbba6 vs v1 at 96f0d1a,
// gather included; bench/results/h200/kernels_engine.md):
//   dW2 (reduction over rows, N = n): the engine wins for n <= 512 (1.4B 0.30 vs 0.48 ms, 30B n256
//     2.9 vs 4.4, Qwen3-Next 2.3 vs 2.4), ties at n = 1024 and loses above (Qwen3 8.2 vs 7.1,
//     DeepSeek 23.2 vs 17.3): its gather saves 2*T*K*d*2 bytes, which matters most when K*d/n
//     is large.
//   dW1 (M = 2n, N = d, stored transposed): with 16-byte transposed stores (octet transpose, f8f89c9
//     + docs/wip patches, bench/results/h200/wip_landing_f8f89c9.log) the engine wins at n = 256 for
//     every d measured (1.4B d 768: 0.617 vs 0.672 ms; 30B n256 d 4096: 5.73 vs 6.10) and loses at
//     n >= 1024 (OLMoE 5.18 vs 4.02, Qwen3-235B 18.1 vs 12.9, DeepSeek-V3.2 49.2 vs 31.4: its
//     128-row tiles over 2n re-read x per tile where CUTLASS's wider tiles do not). Before the
//     16-byte stores the d <= 1024 limit held (30B n256 then lost). At n = 512 it loses too
//     (c4638e4, bench/results/h200/halves_h16_c4638e4.log: 7B n512 0.778 vs 0.695, 30B n512 5.49
//     vs 4.72, Qwen3-Next 4.85 vs 4.26); 7B n256 (d 1536) 0.781 vs 0.825. All public configs: the
//     n <= 256 edge is not yet checked on shapes outside configs.json.
// kEngineTma: the CUTLASS path's row gather, then the engine's varlen-K with both operands by TMA
// (dw_tma). Measured at c9db77c + docs/wip (bench/results/h200/dw_paths_c9db77c.log, ms, engine /
// cutlass / engine_tma): dW1 30B n256 5.95 / 6.18 / 5.70, OLMoE 5.11 / 4.26 / 3.80, Qwen3-235B
// 17.9 / 13.2 / 12.1, DeepSeek-V3.2 50.4 / 32.6 / 30.8; dW2 30B n256 2.62 / 4.21 / 3.79, OLMoE
// 2.41 / 2.44 / 2.20, Qwen3 7.90 / 7.26 / 6.65, DeepSeek 19.2 / 17.6 / 16.5. So the gathered
// cp.async loads, not the rest of the varlen-K, starved the engine (ncu: SM 53-60%, L2 40%): the
// same kernel on pre-gathered rows beats CUTLASS everywhere. dW1 takes engine_tma at every n; dW2
// keeps the fused gather for n <= 512, where the gather copy (T*K*d*2 bytes each way) costs more
// than the GEMM saves. The CUTLASS path stays behind the switch (and as v1's reference).
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

inline DwPath dw1_path(const MoEShape& s) {
  bool forced = false;
  const DwPath f = forced_dw_path(&forced);
  if (forced) return f;
  (void)s;
  return DwPath::kEngineTma;
}

}  // namespace layer
}  // namespace smoe
