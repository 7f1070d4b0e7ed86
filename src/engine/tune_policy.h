// The tuner's decisions that need no GPU (tuner.h does the measuring): when a call is measured,
// how many repetitions fit the budget, and which candidate wins. Pure functions, CPU-tested
// (tests/cpu/test_engine_tune.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/args.h"
#include "engine/overrides.h"

namespace smoe {
namespace engine {

// Issue 37: at most ~2 s per new key, the warm-up round included.
constexpr double kTuneBudgetMs = 2000;
// Timed repetitions per candidate: at least 3 (a median of fewer is one outlier away from noise),
// at most 15 (more moves no decision that the 1-2% spread between runs could not move back).
constexpr int kTuneMinReps = 3;
constexpr int kTuneMaxReps = 15;

// The stream's capture state as cudaStreamIsCapturing reports it; kUnknown when the query failed
// (e.g. the legacy stream while another stream captures): treated as capturing.
enum class Capture { kNone, kActive, kUnknown };

// What a call with SMOE_ENGINE_TUNE=1 does about its key, in this order of precedence.
enum class MeasureDecision {
  kOff,        // not asked (the default), the cache ignored (TUNE=0), or a switch forces a choice
  kCached,     // the key has a measured choice: use it
  kEmpty,      // no rows: nothing to time (the heuristic; the key stays unseen)
  kCapturing,  // inside stream capture: never measure there (the heuristic; measured later, eagerly)
  kOverlap,    // an output overlaps an input: repeated runs would not see the call's inputs
  kContext,    // SMOE_ENGINE_N_BAND or SMOE_ENGINE_STORE_CS=0 set: the timings would be of another tile
               // order or store than a default run's, under a key that does not record either
  kMeasure,
};
MeasureDecision decide_measure(const Overrides& o, bool cached, int64_t rows, Capture capture, bool overlap);
// Whether a switch changes how every candidate runs without choosing among them (the varlen-M tile
// order, the stores' cache hint): the cache is still read (its choices run correctly under either),
// but nothing is measured into it, so the shared file only holds default-context timings.
bool changes_timing_context(const Overrides& o);
const char* to_string(MeasureDecision d);

// Whether any output of the call overlaps any of its inputs. The tuner runs every candidate on the
// call's own buffers, which is sound because no epilogue reads or accumulates into its outputs
// (every output element is written from the accumulator and the inputs alone: no beta, no
// in-place update; dSwiGLU reads H and writes dH, A', dS partials, which are other tensors). A call
// that aliases them (an in-place dH = f(H) say) would see its own writes on the second run, so it is
// not measured. The layer passes one only under consume_saved (dH written over the saved H: the
// dA' call, which therefore takes the heuristic's pick); its other calls never alias
// (moe/layer_common.h, check_disjoint, plus one carver for its workspace). Extents the engine does
// not know (the token count behind a gathered operand, the flat slot count behind scores) are taken
// as at least `rows` rows.
bool outputs_overlap_inputs(const VarlenMArgs& a);
bool outputs_overlap_inputs(const VarlenKArgs& a);

// Timed repetitions per candidate after the warm-up round and one timed round: round_ms is that
// round's total over all candidates, spent_ms the wall time the key has cost so far. As many as fit
// the rest of budget_ms, clamped to [kTuneMinReps, kTuneMaxReps] and made odd (an exact median).
int tune_reps(double budget_ms, double spent_ms, double round_ms);

// The lower median (sorted, element (n - 1) / 2): a measured value, no averaging. NaNs dropped;
// +inf when nothing is left.
float median_ms(std::vector<float> v);

// How much faster than the heuristic's pick a candidate must measure to replace it: 5%. Timed
// alone, a GEMM runs on L2-warm operands after a copy of itself; inside the layer it runs after
// other kernels. Measured at b984359 on the eleven public configs (H200, layer A/B): isolated gains
// of 7-14% carried into the layer (7B n1024 dA' 9.1% alone, 8.4% in the layer; DeepSeek-V3.2 dA'
// 14%, 7.9%), one of 3.8% turned into a 7% loss (1.4B up-projection), and the rest (<= 2.6%) were
// noise in the layer (whole-layer ratios 0.97-1.02). So small isolated wins keep the heuristic.
constexpr float kTuneMargin = 0.05f;

// The winner of a measured key: the candidate with the lowest median, if it beats candidate 0 (the
// heuristic's pick, candidates.h's fixed order) by more than `margin` of candidate 0's median; else
// candidate 0. Among equal medians the first, so identical timings give identical choices. NaN and
// inf never win (with candidate 0 not finite, the lowest finite median wins, no margin); -1 when no
// candidate has a finite median.
int pick_winner(const std::vector<float>& medians, float margin = kTuneMargin);

}  // namespace engine
}  // namespace smoe
