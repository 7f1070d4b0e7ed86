// The configurations the tuner (tuner.h) measures for one call: every built instantiation of the
// call's kind that may run its extents. A pure function of the arguments and the device, so the CPU
// tests cover it (tests/cpu/test_engine_tune.cpp).
#pragma once

#include <vector>

#include "engine/args.h"
#include "engine/config.h"
#include "engine/heuristic.h"

namespace smoe {
namespace engine {

// What the heuristic returns for the call under some setting of the switches that force a choice
// (varlen-M: SMOE_ENGINE_SCHED, _BN_M, _CLUSTER, _STAGED_STORE; varlen-K: _BN_K, _CLUSTER_K), and
// its own unforced pick. Why through choose_*: it already holds which instantiation may run which
// extents (BN 256 only at N % 256 == 0, 64 x 256 pairs only for the gathered GEMMs, staged twins only
// for stores, clustered twins where built), so no second copy of those rules exists; and the forced
// runs are what the GPU tests check for correctness (tests/gpu/test_engine_gpu.cu, run_m / run_k).
// Order: the heuristic's pick first, so that a tie keeps the default; then the instance list's order
// (built_index). Never empty for a call that passes the rules (the heuristic's pick is built).
std::vector<EngineConfig> candidates_varlen_m(const VarlenMArgs& a, const DeviceFacts& dev);
std::vector<EngineConfig> candidates_varlen_k(const VarlenKArgs& a, const DeviceFacts& dev);

// Whether `c` is one of the call's candidates, by one forced choose (no list built): the heuristic
// under the switches that name c's schedule, BN and cluster returns c exactly. For the entry points'
// check of a cached choice (engine.cpp), which runs on every call of a tuned key.
bool is_candidate(const VarlenMArgs& a, const DeviceFacts& dev, const EngineConfig& c);
bool is_candidate(const VarlenKArgs& a, const DeviceFacts& dev, const EngineConfig& c);

}  // namespace engine
}  // namespace smoe
