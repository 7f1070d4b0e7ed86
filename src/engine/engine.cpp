// The engine's entry points: rules, then the typed choice (measured, tune_store.h / tuner.h, or the
// heuristic's), then the instantiation the dispatch table (dispatch.h) maps it to. The table is
// generated from the one instance list in CMakeLists.txt (engine_instances/instances.inc), the same
// list the instance files and config.cpp come from.
#include <cstdio>
#include <optional>
#include <string>
#include <type_traits>

#include "common/check.h"
#include "engine/candidates.h"
#include "engine/dispatch.h"
#include "engine/engine.h"
#include "engine/heuristic.h"
#include "engine/rules.h"
#include "engine/tune_cache.h"
#include "engine/tune_policy.h"
#include "engine/tune_store.h"
#include "engine/tuner.h"

namespace smoe {
namespace engine {

bool store_streaming() { return overrides().store_streaming; }
int varlen_m_n_band(int n_tiles, int64_t expert_weight_bytes) {
  int b = overrides().n_band;
  if (b < 0) b = expert_weight_bytes >= kBandMinWeightBytes ? kAutoNBand : 0;
  return b > 0 && b < n_tiles ? b : n_tiles;
}
int varlen_m_n_band(int N, int K, int bn) {
  return varlen_m_n_band((N + bn - 1) / bn, int64_t{N} * K * static_cast<int64_t>(sizeof(uint16_t)));  // bf16 B
}

namespace {

// The band the chosen instance's params will take (make_params): "all" for one band.
std::string n_band_text(int N, int K, int bn) {
  const int b = varlen_m_n_band(N, K, bn);
  return b >= (N + bn - 1) / bn ? std::string("all") : std::to_string(b);
}

// choose_config (engine.h): a measured choice where the cache has the call's key (and nothing
// forces another), measured now where SMOE_ENGINE_TUNE=1 asks for it and the call may be measured
// (tune_policy.h, decide_measure), else the heuristic's. Without SMOE_ENGINE_TUNE=1 the only CUDA call
// made here is device_facts' cudaGetDevice (its attributes are queried once per device), so the
// default path is the cache lookup and the heuristic alone, with no synchronisation.
template <class Args>
Status choose(const Args& a, int sm_count, cudaStream_t stream, const Overrides& o, std::optional<EngineConfig>* c,
              std::string* from) {
  const DeviceFacts dev = device_facts(sm_count);
  if (o.tune && !o.forces()) {
    const TuneKey key = tune_key(a, dev);
    const std::optional<EngineConfig> cached = tuned_choice(key);
    // A cached choice runs only where this call's rules allow it (a stale or hand-edited file, or
    // rules changed since it was written): one of the call's candidates, the set the GPU tests force.
    if (cached && is_candidate(a, dev, *cached)) {
      *from = "tuned";
      *c = cached;
      return Status{};
    }
    if (cached) *from = "heuristic; the cached " + to_string(*cached) + " does not fit this call";
    if (o.measure && !cached) {
      const MeasureDecision d =
          decide_measure(o, false, a.rows, capture_state(stream), outputs_overlap_inputs(a));
      if (d == MeasureDecision::kMeasure) {
        EngineConfig chosen;
        if constexpr (std::is_same_v<Args, VarlenMArgs>)
          SMOE_RETURN_IF_ERROR(tune_varlen_m(a, sm_count, stream, &chosen));
        else
          SMOE_RETURN_IF_ERROR(tune_varlen_k(a, sm_count, stream, &chosen));
        *from = "measured";
        *c = chosen;
        return Status{};
      }
      *from = std::string("heuristic; ") + to_string(d);
    }
  }
  if (from->empty()) *from = o.forces() ? "override" : "heuristic";
  if constexpr (std::is_same_v<Args, VarlenMArgs>)
    *c = choose_varlen_m(a, dev, o);
  else
    *c = choose_varlen_k(a, dev, o);
  return Status{};
}

// kNotImplemented (saying which) where a choice has no instantiation.
Status no_instance(const std::optional<EngineConfig>& c, const char* fn) {
  return detail::make_status(StatusCode::kNotImplemented,
                             detail::concat(fn, ": no instantiation ", c ? to_string(*c) : "(none)",
                                            " for this shape and the SMOE_ENGINE_* switches"));
}

}  // namespace

// The rules first (the entry points check them too): measuring launches every candidate on `a`.
Status choose_config(const VarlenMArgs& a, int sm_count, cudaStream_t stream, Choice* out) {
  SMOE_RETURN_IF_ERROR(check_varlen_m(a));
  return choose(a, sm_count, stream, overrides(), &out->config, &out->from);
}
Status choose_config(const VarlenKArgs& a, int sm_count, cudaStream_t stream, Choice* out) {
  SMOE_RETURN_IF_ERROR(check_varlen_k(a));
  return choose(a, sm_count, stream, overrides(), &out->config, &out->from);
}

namespace {
// setup: do the launch's host setup now (prepare_varlen_m, whose caller may change state before the
// launch). varlen_m launches right after, and the launch does that setup itself: not twice there.
Status prepare_m(const VarlenMArgs& a, int sm_count, cudaStream_t stream, bool setup, PreparedVarlenM* out) {
  *out = PreparedVarlenM{};
  SMOE_RETURN_IF_ERROR(check_varlen_m(a));
  if (a.rows == 0) return Status{};
  Choice ch;
  SMOE_RETURN_IF_ERROR(choose_config(a, sm_count, stream, &ch));
  const std::optional<EngineConfig>& c = ch.config;
  if (overrides().print)
    std::fprintf(stderr,
                 "[smoe engine] varlen_m %s (%s) rows=%lld N=%d K=%d E=%d gather=%d grid<=%d hbm_gbps=%d n_band=%s\n",
                 c ? to_string(*c).c_str() : "(none)", ch.from.c_str(), static_cast<long long>(a.rows), a.N, a.K,
                 a.num_experts, a.gather_idx != nullptr, sm_count, device_facts(sm_count).hbm_gbps,
                 c ? n_band_text(a.N, a.K, c->bn).c_str() : "-");
  const RunVarlenM run = c ? find_varlen_m(*c) : nullptr;
  if (run == nullptr) return no_instance(c, "engine::varlen_m");
  // The launch's host setup now, not at launch: a failure here (attribute, no cluster fits) is a
  // refusal that leaves the caller's state as it was.
  if (setup) SMOE_RETURN_IF_ERROR(run(a, sm_count, stream, LaunchStep::kSetup));
  out->run = run;
  return Status{};
}
}  // namespace

Status prepare_varlen_m(const VarlenMArgs& a, int sm_count, cudaStream_t stream, PreparedVarlenM* out) {
  return prepare_m(a, sm_count, stream, /*setup=*/true, out);
}

Status PreparedVarlenM::launch(const VarlenMArgs& a, int sm_count, cudaStream_t stream) const {
  if (run != nullptr) return run(a, sm_count, stream, LaunchStep::kLaunch);
  // Nothing prepared: right only for a call with no row. Otherwise (a refused or skipped prepare) the
  // outputs would stay as they are, so this is an error, never a silent no-op.
  if (a.rows == 0) return Status{};
  return detail::make_status(StatusCode::kInvalidArgument,
                             "engine::PreparedVarlenM::launch: nothing prepared (prepare_varlen_m failed or was not called)");
}

Status varlen_m(const VarlenMArgs& a, int sm_count, cudaStream_t stream) {
  PreparedVarlenM p;
  SMOE_RETURN_IF_ERROR(prepare_m(a, sm_count, stream, /*setup=*/false, &p));
  return p.launch(a, sm_count, stream);
}

Status varlen_k(const VarlenKArgs& a, int sm_count, cudaStream_t stream) {
  SMOE_RETURN_IF_ERROR(check_varlen_k(a));
  Choice ch;
  SMOE_RETURN_IF_ERROR(choose_config(a, sm_count, stream, &ch));
  const std::optional<EngineConfig>& c = ch.config;
  if (overrides().print)
    std::fprintf(stderr, "[smoe engine] varlen_k %s (%s) rows=%lld M=%d N=%d E=%d gather=(%d,%d) grid<=%d hbm_gbps=%d\n",
                 c ? to_string(*c).c_str() : "(none)", ch.from.c_str(), static_cast<long long>(a.rows), a.M, a.N,
                 a.num_experts, a.gather_p != nullptr, a.gather_q != nullptr, sm_count, device_facts(sm_count).hbm_gbps);
  const RunVarlenK run = c ? find_varlen_k(*c) : nullptr;
  if (run == nullptr) return no_instance(c, "engine::varlen_k");
  return run(as_gather_p(a), sm_count, stream, LaunchStep::kLaunch);
}

}  // namespace engine
}  // namespace smoe
