#include "engine/tune_policy.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>

#include "engine/epilogue/dswiglu.h"

namespace smoe {
namespace engine {
namespace {

// A byte range of one tensor; null or empty ranges overlap nothing.
struct Span {
  const void* p;
  uint64_t bytes;
};

// Saturating product: an extent too large to count overlaps everything (not measured).
uint64_t bytes_of(std::initializer_list<int64_t> factors) {
  uint64_t p = 1;
  for (int64_t f : factors) {
    if (f <= 0) return 0;
    if (__builtin_mul_overflow(p, static_cast<uint64_t>(f), &p)) return std::numeric_limits<uint64_t>::max();
  }
  return p;
}

bool overlap(const Span& a, const Span& b) {
  if (a.p == nullptr || b.p == nullptr || a.bytes == 0 || b.bytes == 0) return false;
  const uintptr_t a0 = reinterpret_cast<uintptr_t>(a.p), b0 = reinterpret_cast<uintptr_t>(b.p);
  return a0 - b0 < b.bytes || b0 - a0 < a.bytes;  // unsigned: a0 in [b0, b0 + b) or b0 in [a0, a0 + a)
}

bool any_overlap(std::initializer_list<Span> outputs, std::initializer_list<Span> inputs) {
  for (const Span& o : outputs)
    for (const Span& i : inputs)
      if (overlap(o, i)) return true;
  return false;
}

constexpr int64_t kBf16 = 2, kI32 = 4, kF32 = 4;

}  // namespace

MeasureDecision decide_measure(const Overrides& o, bool cached, int64_t rows, Capture capture, bool overlap) {
  if (!o.measure || !o.tune || o.forces()) return MeasureDecision::kOff;
  if (cached) return MeasureDecision::kCached;
  if (rows <= 0) return MeasureDecision::kEmpty;
  if (capture != Capture::kNone) return MeasureDecision::kCapturing;
  if (overlap) return MeasureDecision::kOverlap;
  if (changes_timing_context(o)) return MeasureDecision::kContext;
  return MeasureDecision::kMeasure;
}

bool changes_timing_context(const Overrides& o) { return o.n_band >= 0 || !o.store_streaming; }

const char* to_string(MeasureDecision d) {
  switch (d) {
    case MeasureDecision::kOff: return "off";
    case MeasureDecision::kCached: return "cached";
    case MeasureDecision::kEmpty: return "no rows: not measured";
    case MeasureDecision::kCapturing: return "capturing: not measured";
    case MeasureDecision::kOverlap: return "outputs overlap inputs: not measured";
    case MeasureDecision::kContext: return "SMOE_ENGINE_N_BAND / STORE_CS set: not measured";
    case MeasureDecision::kMeasure: return "measured";
  }
  return "?";
}

bool outputs_overlap_inputs(const VarlenMArgs& a) {
  // B: per expert `per` rows of `len` elements, experts `stride` rows apart (b_expert_stride with
  // two tensors, else packed). The last expert ends at (E - 1) * stride + per rows.
  const bool kn = a.b_major == WeightMajor::kNK;
  const int64_t len = kn ? a.K : a.N;
  const int64_t full = kn ? a.N : a.K;
  const int64_t per = a.B2 ? full / 2 : full;
  const int64_t stride = a.b_expert_stride ? a.b_expert_stride : per;
  const uint64_t b_bytes = bytes_of({(int64_t{a.num_experts} - 1) * stride + per, len, kBf16});
  const int64_t rows = a.rows;
  // Outputs by epilogue (args.h): D, D2, dH, ds_partial.
  const int64_t d_cols = a.N;
  const int64_t d2_cols = a.epilogue == Epilogue::kSwiGLU ? a.N / 2 : a.N;
  const bool dsw = a.epilogue == Epilogue::kDSwiGLU;
  return any_overlap(
      {{a.epilogue == Epilogue::kDSwiGLU ? nullptr : a.D, bytes_of({rows, d_cols, kBf16})},
       {a.epilogue == Epilogue::kStore ? nullptr : a.D2, bytes_of({rows, d2_cols, kBf16})},
       {dsw ? a.dH : nullptr, bytes_of({rows, 2 * int64_t{a.N}, kBf16})},
       {dsw ? a.ds_partial : nullptr, bytes_of({rows, ds_partial_tiles(a.N), kF32})}},
      // A holds a_rows rows (the rules: >= rows when A is the grouped rows; gathered, its indices are
      // below a_rows), e.g. the T tokens of x for the up-projection's T*K grouped rows.
      {{a.A, bytes_of({a.a_rows, a.K, kBf16})},
       {a.B, b_bytes},
       {a.B2, b_bytes},
       {a.expert_offset, bytes_of({int64_t{a.num_experts} + 1, kI32})},
       {a.gather_idx, bytes_of({rows, kI32})},
       {dsw ? a.H : nullptr, bytes_of({rows, 2 * int64_t{a.N}, kBf16})},
       {dsw ? a.scores : nullptr, bytes_of({rows, kF32})},
       {dsw ? a.scatter : nullptr, bytes_of({rows, kI32})}});
}

bool outputs_overlap_inputs(const VarlenKArgs& a) {
  const int64_t rows = a.rows;
  // A gathered operand spans gather_rows rows where the caller gave them, else (unknown) rows.
  const int64_t known = a.gather_rows > 0 ? a.gather_rows : rows;
  const int64_t p_rows = a.gather_p ? known : rows, q_rows = a.gather_q ? known : rows;
  return any_overlap({{a.D, bytes_of({a.num_experts, a.M, a.N, kBf16})}},
                     {{a.P, bytes_of({p_rows, a.ld_p, kBf16})},
                      {a.Q, bytes_of({q_rows, a.ld_q, kBf16})},
                      {a.expert_offset, bytes_of({int64_t{a.num_experts} + 1, kI32})},
                      {a.gather_p, bytes_of({rows, kI32})},
                      {a.gather_q, bytes_of({rows, kI32})}});
}

int tune_reps(double budget_ms, double spent_ms, double round_ms) {
  int reps = kTuneMaxReps;
  if (round_ms > 0) {
    // Round 1 is already timed: the rest of the budget buys floor(left / round) more rounds.
    const double more = std::floor((budget_ms - spent_ms) / round_ms);
    reps = more < kTuneMaxReps ? 1 + std::max(0, static_cast<int>(more)) : kTuneMaxReps;
  }
  reps = std::clamp(reps, kTuneMinReps, kTuneMaxReps);
  return reps % 2 == 1 ? reps : reps - 1;  // the bounds are odd, so this stays inside them
}

float median_ms(std::vector<float> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](float x) { return std::isnan(x); }), v.end());  // sortable
  if (v.empty()) return std::numeric_limits<float>::infinity();
  std::sort(v.begin(), v.end());
  return v[(v.size() - 1) / 2];
}

int pick_winner(const std::vector<float>& medians, float margin) {
  int best = -1;
  for (size_t i = 0; i < medians.size(); ++i) {
    const float m = medians[i];
    if (!std::isfinite(m)) continue;
    if (best < 0 || m < medians[best]) best = static_cast<int>(i);  // strict: a tie keeps the earlier
  }
  // The heuristic's pick stays unless the best is more than `margin` faster than it.
  if (best > 0 && std::isfinite(medians[0]) && medians[best] >= medians[0] * (1.0f - margin)) return 0;
  return best;
}

}  // namespace engine
}  // namespace smoe
