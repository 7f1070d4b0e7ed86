#include "engine/tuner.h"

#include <chrono>
#include <cstdio>
#include <string>

#include "common/check.h"
#include "engine/candidates.h"
#include "engine/dispatch.h"
#include "engine/heuristic.h"
#include "engine/overrides.h"
#include "engine/tune_store.h"

namespace smoe {
namespace engine {
namespace {

TuneSink g_sink = nullptr;

void print_record(const TuneRecord& r) {
  if (!overrides().print) return;
  std::string line = "[smoe engine] measured " + to_string(r.key) + ":";
  for (size_t i = 0; i < r.candidates.size(); ++i) {
    char ms[32];
    std::snprintf(ms, sizeof ms, " %.4f", r.median_ms[i]);
    line += (i ? ", " : " ") + to_string(r.candidates[i]) + ms + " ms";
  }
  char tail[64];
  std::snprintf(tail, sizeof tail, " (median of %d, %.0f ms) -> ", r.reps, r.wall_ms);
  std::fprintf(stderr, "%s%s%s\n", line.c_str(), tail, to_string(r.chosen).c_str());
}

// Two events per candidate, destroyed on every way out.
struct Events {
  std::vector<cudaEvent_t> ev;
  ~Events() {
    for (cudaEvent_t e : ev) cudaEventDestroy(e);
  }
  Status create(size_t n) {
    ev.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      cudaEvent_t e;
      SMOE_CUDA_RETURN(cudaEventCreate(&e));
      ev.push_back(e);
    }
    return Status{};
  }
};

// The measuring loop of tuner.h over `run(candidate index)`; fills r->median_ms and r->reps. A
// candidate whose launch fails in the warm-up round (an error returned before anything runs, e.g. a
// 2-CTA cluster that cannot be co-scheduled under MPS or a restricted SM budget) is dropped: its
// error is cleared, its median is +inf (pick_winner skips it), and the key is still decided among
// the rest, so one unrunnable candidate neither fails the caller's call nor every later one. An
// error the device reports afterwards (a fault, sticky) still fails the call.
template <class Run>
Status measure(const Run& run, cudaStream_t stream, TuneRecord* r) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const size_t n = r->candidates.size();
  Events e;
  SMOE_RETURN_IF_ERROR(e.create(2 * n));
  std::vector<std::vector<float>> times(n);
  std::vector<char> dropped(n, 0);
  Status first_failure;
  // One round: every live candidate once, starting at `first` (the order rotates with the round).
  auto round = [&](size_t first, bool timed, bool warm_up) -> Status {
    for (size_t j = 0; j < n; ++j) {
      const size_t c = (first + j) % n;
      if (dropped[c]) continue;
      SMOE_CUDA_RETURN(cudaEventRecord(e.ev[2 * c], stream));
      const Status st = run(c);
      if (!st.ok()) {
        if (!warm_up) return st;  // it launched before: not a launch-time refusal
        (void)cudaGetLastError();  // the refused launch's error, so the next check does not see it
        dropped[c] = 1;
        if (first_failure.ok()) first_failure = st;
        continue;
      }
      SMOE_CUDA_RETURN(cudaEventRecord(e.ev[2 * c + 1], stream));
    }
    SMOE_CUDA_RETURN(cudaStreamSynchronize(stream));
    if (!timed) return Status{};
    for (size_t c = 0; c < n; ++c) {
      if (dropped[c]) continue;
      float ms = 0;
      SMOE_CUDA_RETURN(cudaEventElapsedTime(&ms, e.ev[2 * c], e.ev[2 * c + 1]));
      times[c].push_back(ms);
    }
    return Status{};
  };
  auto since_ms = [&] { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); };
  SMOE_RETURN_IF_ERROR(round(0, false, true));  // warm-up: first launches, occupancy queries, TMA descriptors
  size_t live = 0;
  for (size_t c = 0; c < n; ++c) live += !dropped[c];
  if (live == 0) return first_failure;  // nothing runs this call: the first candidate's reason
  SMOE_RETURN_IF_ERROR(round(0, true, false));
  double round_ms = 0;
  for (size_t c = 0; c < n; ++c)
    if (!dropped[c]) round_ms += times[c][0];
  r->reps = tune_reps(kTuneBudgetMs, since_ms(), round_ms);
  for (int k = 1; k < r->reps; ++k) SMOE_RETURN_IF_ERROR(round(static_cast<size_t>(k) % n, true, false));
  r->median_ms.clear();
  for (size_t c = 0; c < n; ++c)  // a dropped candidate has no times: +inf
    r->median_ms.push_back(median_ms(times[c]));
  r->wall_ms = since_ms();
  return Status{};
}

// Winner, store, report.
Status finish(TuneRecord* r, EngineConfig* chosen) {
  r->winner = pick_winner(r->median_ms);
  if (r->winner < 0)
    return detail::make_status(StatusCode::kCudaError,
                               "engine tuner: no candidate of " + to_string(r->key) + " measured a finite time");
  r->chosen = store_tuned(r->key, r->candidates[r->winner]);
  *chosen = r->chosen;
  (g_sink ? g_sink : print_record)(*r);
  return Status{};
}

Status no_candidates(const TuneKey& k) {
  return detail::make_status(StatusCode::kNotImplemented, "engine tuner: no built candidate for " + to_string(k));
}

Status no_instance(const EngineConfig& c) {
  return detail::make_status(StatusCode::kNotImplemented, "engine tuner: candidate " + to_string(c) +
                                                              " has no instantiation in the dispatch table");
}

}  // namespace

void set_tune_sink(TuneSink sink) { g_sink = sink; }

Capture capture_state(cudaStream_t stream) {
  cudaStreamCaptureStatus s = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &s) != cudaSuccess) {
    (void)cudaGetLastError();  // the query's own error, not a launch's
    return Capture::kUnknown;
  }
  return s == cudaStreamCaptureStatusNone ? Capture::kNone : Capture::kActive;
}

Status tune_varlen_m(const VarlenMArgs& a, int sm_count, cudaStream_t stream, EngineConfig* chosen) {
  TuneRecord r;
  r.key = tune_key(a, device_facts(sm_count));
  r.candidates = candidates_varlen_m(a, device_facts(sm_count));
  std::vector<RunVarlenM> fns;
  for (const EngineConfig& c : r.candidates) {
    fns.push_back(find_varlen_m(c));
    if (fns.back() == nullptr) return no_instance(c);
  }
  if (r.candidates.empty()) return no_candidates(r.key);
  auto run_candidate = [&](size_t c) { return fns[c](a, sm_count, stream, LaunchStep::kLaunch); };
  SMOE_RETURN_IF_ERROR(measure(run_candidate, stream, &r));
  return finish(&r, chosen);
}

Status tune_varlen_k(const VarlenKArgs& a, int sm_count, cudaStream_t stream, EngineConfig* chosen) {
  TuneRecord r;
  r.key = tune_key(a, device_facts(sm_count));
  r.candidates = candidates_varlen_k(a, device_facts(sm_count));
  std::vector<RunVarlenK> fns;
  for (const EngineConfig& c : r.candidates) {
    fns.push_back(find_varlen_k(c));
    if (fns.back() == nullptr) return no_instance(c);
  }
  if (r.candidates.empty()) return no_candidates(r.key);
  const VarlenKArgs kernel_args = as_gather_p(a);  // the kernels' view, as the entry point runs them
  auto run_candidate = [&](size_t c) { return fns[c](kernel_args, sm_count, stream, LaunchStep::kLaunch); };
  SMOE_RETURN_IF_ERROR(measure(run_candidate, stream, &r));
  return finish(&r, chosen);
}

}  // namespace engine
}  // namespace smoe
