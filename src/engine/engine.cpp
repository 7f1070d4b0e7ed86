// The engine's entry points: rules, then the heuristic's typed choice, then the instantiation the
// dispatch table maps it to. The table is generated from the one instance list in CMakeLists.txt
// (engine_instances/instances.inc), the same list the instance files and config.cpp come from.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <type_traits>

#include "common/check.h"
#include "engine/engine.h"
#include "engine/heuristic.h"
#include "engine/rules.h"
#include "engine/tune_cache.h"

namespace smoe {
namespace engine {

#define SMOE_ENGINE_INSTANCE(fn, kind, sched, bn, cluster, args) Status fn(const args&, int, cudaStream_t);
namespace inst {
#include "instances.inc"
}  // namespace inst
#undef SMOE_ENGINE_INSTANCE

namespace {

template <class Args>
struct Entry {
  EngineConfig config;
  Status (*run)(const Args&, int, cudaStream_t);
};
// Each instantiation goes to the table of its argument struct (the other table gets an entry
// without a function, which find() skips).
template <class Args, class FnArgs>
constexpr Entry<Args> entry(EngineConfig c, Status (*run)(const FnArgs&, int, cudaStream_t)) {
  if constexpr (std::is_same_v<Args, FnArgs>)
    return {c, run};
  else
    return {c, nullptr};
}
#define SMOE_ENGINE_INSTANCE(fn, kind, sched, bn, cluster, args) \
  entry<ARGS_OF_TABLE>(EngineConfig{Kind::kind, Sched::sched, bn, cluster}, &inst::fn),
#define ARGS_OF_TABLE VarlenMArgs
const Entry<VarlenMArgs> kTableM[] = {
#include "instances.inc"
};
#undef ARGS_OF_TABLE
#define ARGS_OF_TABLE VarlenKArgs
const Entry<VarlenKArgs> kTableK[] = {
#include "instances.inc"
};
#undef ARGS_OF_TABLE
#undef SMOE_ENGINE_INSTANCE

template <class Args, size_t N>
const Entry<Args>* find(const Entry<Args> (&table)[N], const EngineConfig& c) {
  for (const auto& e : table)
    if (e.run != nullptr && e.config == c) return &e;
  return nullptr;
}

}  // namespace

bool store_streaming() { return overrides().store_streaming; }

namespace {

const char* env(const char* name) { return std::getenv(name); }

// The measured choices: read once from the cache file (tune_cache_path), empty when there is none.
const TuneCache& tune_cache() {
  static const TuneCache cache = [] {
    TuneCache c;
    const std::string path = tune_cache_path(env);
    if (path.empty()) return c;
    std::ifstream f(path);
    if (!f) return c;
    std::stringstream text;
    text << f.rdbuf();
    if (!c.merge_json(text.str()))
      std::fprintf(stderr, "[smoe engine] %s does not parse as a tune cache: ignored\n", path.c_str());
    return c;
  }();
  return cache;
}

// A measured choice for the call's key where the cache has one (and nothing forces another), else
// the heuristic's. `from` says which, for SMOE_ENGINE_PRINT.
template <class Args>
std::optional<EngineConfig> choose(const Args& a, int sm_count, const Overrides& o, const char** from) {
  if (o.tune && !o.forces()) {
    if (const std::optional<EngineConfig> c = tune_cache().get(tune_key(a, sm_count))) {
      *from = "tuned";
      return c;
    }
  }
  *from = o.forces() ? "override" : "heuristic";
  if constexpr (std::is_same_v<Args, VarlenMArgs>)
    return choose_varlen_m(a, DeviceFacts{sm_count}, o);
  else
    return choose_varlen_k(a, DeviceFacts{sm_count}, o);
}

// The instantiation of a choice, run; kNotImplemented (saying which) where none is built.
template <class Args, size_t N>
Status run_choice(const Entry<Args> (&table)[N], const std::optional<EngineConfig>& c, const Args& a, int sm_count,
                  cudaStream_t stream, const char* fn) {
  const Entry<Args>* e = c ? find(table, *c) : nullptr;
  if (e == nullptr)
    return detail::make_status(StatusCode::kNotImplemented,
                               detail::concat(fn, ": no instantiation ", c ? to_string(*c) : "(none)",
                                              " for this shape and the SMOE_ENGINE_* switches"));
  return e->run(a, sm_count, stream);
}

}  // namespace

Status varlen_m(const VarlenMArgs& a, int sm_count, cudaStream_t stream) {
  SMOE_RETURN_IF_ERROR(check_varlen_m(a));
  if (a.rows == 0) return Status{};
  const Overrides& o = overrides();
  const char* from = "";
  const std::optional<EngineConfig> c = choose(a, sm_count, o, &from);
  if (o.print)
    std::fprintf(stderr, "[smoe engine] varlen_m %s (%s) rows=%lld N=%d K=%d E=%d gather=%d grid<=%d\n",
                 c ? to_string(*c).c_str() : "(none)", from, static_cast<long long>(a.rows), a.N, a.K, a.num_experts,
                 a.gather_idx != nullptr, sm_count);
  return run_choice(kTableM, c, a, sm_count, stream, "engine::varlen_m");
}

Status varlen_k(const VarlenKArgs& a, int sm_count, cudaStream_t stream) {
  SMOE_RETURN_IF_ERROR(check_varlen_k(a));
  const Overrides& o = overrides();
  const char* from = "";
  const std::optional<EngineConfig> c = choose(a, sm_count, o, &from);
  if (o.print)
    std::fprintf(stderr, "[smoe engine] varlen_k %s (%s) rows=%lld M=%d N=%d E=%d gather=(%d,%d) grid<=%d\n",
                 c ? to_string(*c).c_str() : "(none)", from, static_cast<long long>(a.rows), a.M, a.N, a.num_experts,
                 a.gather_p != nullptr, a.gather_q != nullptr, sm_count);
  return run_choice(kTableK, c, as_gather_p(a), sm_count, stream, "engine::varlen_k");
}

}  // namespace engine
}  // namespace smoe
