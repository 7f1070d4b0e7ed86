// The engine's entry points: rules, then the heuristic's typed choice, then the instantiation the
// dispatch table maps it to. The table is generated from the one instance list in CMakeLists.txt
// (engine_instances/instances.inc), the same list the instance files and config.cpp come from.
#include <cstdio>
#include <type_traits>

#include "common/check.h"
#include "engine/engine.h"
#include "engine/heuristic.h"
#include "engine/rules.h"

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

Status varlen_m(const VarlenMArgs& a, int sm_count, cudaStream_t stream) {
  SMOE_RETURN_IF_ERROR(check_varlen_m(a));
  if (a.rows == 0) return Status{};
  const Overrides& o = overrides();
  const std::optional<EngineConfig> c = choose_varlen_m(a, DeviceFacts{sm_count}, o);
  if (o.print)
    std::fprintf(stderr, "[smoe engine] varlen_m %s rows=%lld N=%d K=%d E=%d gather=%d grid<=%d\n",
                 c ? to_string(*c).c_str() : "(none)", static_cast<long long>(a.rows), a.N, a.K, a.num_experts,
                 a.gather_idx != nullptr, sm_count);
  const Entry<VarlenMArgs>* e = c ? find(kTableM, *c) : nullptr;
  if (e == nullptr)
    return detail::make_status(StatusCode::kNotImplemented,
                               "engine::varlen_m: no instantiation for this shape and the SMOE_ENGINE_* switches");
  return e->run(a, sm_count, stream);
}

Status varlen_k(const VarlenKArgs& a, int sm_count, cudaStream_t stream) {
  SMOE_RETURN_IF_ERROR(check_varlen_k(a));
  const Overrides& o = overrides();
  const std::optional<EngineConfig> c = choose_varlen_k(a, DeviceFacts{sm_count}, o);
  if (o.print)
    std::fprintf(stderr, "[smoe engine] varlen_k %s rows=%lld M=%d N=%d E=%d gather=(%d,%d) grid<=%d\n",
                 c ? to_string(*c).c_str() : "(none)", static_cast<long long>(a.rows), a.M, a.N, a.num_experts,
                 a.gather_p != nullptr, a.gather_q != nullptr, sm_count);
  const Entry<VarlenKArgs>* e = c ? find(kTableK, *c) : nullptr;
  if (e == nullptr)
    return detail::make_status(StatusCode::kNotImplemented,
                               detail::concat("engine::varlen_k: no instantiation ", c ? to_string(*c) : "(none)"));
  return e->run(as_gather_p(a), sm_count, stream);
}

}  // namespace engine
}  // namespace smoe
