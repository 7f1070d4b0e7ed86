// The tuner's device side (issue 37): time every candidate of a call (candidates.h) on the call's
// own arguments, keep the fastest in the tune cache (tune_store.h), which the next call with the key
// picks before the heuristic. Reached from the entry points with SMOE_ENGINE_TUNE=1 on the first
// eager call of an unseen key, or ahead of time through apps/smoe_tune.cu.
// Policy (tune_policy.h): one untimed warm-up round over all candidates, then R timed rounds
// (R from the first timed round, so that a key costs <= ~2 s; 3 <= R <= 15, odd), each candidate
// timed alone between two CUDA events; the rounds rotate the candidates' order so none always runs
// first. Winner: the lowest median, ties to the earlier candidate (the heuristic's pick first).
// The candidates overwrite the call's outputs; the entry point then runs the chosen configuration
// once more, as any call, so the outputs are that run's: no epilogue reads its outputs
// (tune_policy.h, outputs_overlap_inputs), and the result is what the next call with the cache gives.
#pragma once

#include <vector>

#include <cuda_runtime_api.h>

#include "engine/args.h"
#include "engine/config.h"
#include "engine/tune_cache.h"
#include "engine/tune_policy.h"

namespace smoe {
namespace engine {

struct TuneRecord {
  TuneKey key;
  std::vector<EngineConfig> candidates;  // in candidates.h's order: [0] is the heuristic's pick
  std::vector<float> median_ms;          // per candidate
  int reps = 0;                          // timed rounds
  int winner = -1;                       // index into candidates
  EngineConfig chosen;                   // what the key maps to now (the winner, or another thread's)
  double wall_ms = 0;                    // what measuring the key cost
};

// Where each record goes; null (the default): one line to stderr under SMOE_ENGINE_PRINT.
using TuneSink = void (*)(const TuneRecord&);
void set_tune_sink(TuneSink sink);

// The stream's capture state; a failed query (kUnknown) has its error cleared, so that the next
// launch check (cudaGetLastError) does not report it.
Capture capture_state(cudaStream_t stream);

// Measure the candidates of a call that passed the rules, store the winner, and set *chosen to the
// key's choice. The call's outputs are left as the last candidate wrote them (the caller runs
// *chosen next). A candidate's failure is returned as is and nothing is stored. The caller checks
// decide_measure first.
Status tune_varlen_m(const VarlenMArgs& a, int sm_count, cudaStream_t stream, EngineConfig* chosen);
Status tune_varlen_k(const VarlenKArgs& a, int sm_count, cudaStream_t stream, EngineConfig* chosen);

}  // namespace engine
}  // namespace smoe
