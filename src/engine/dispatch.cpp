#include "engine/dispatch.h"

#include <type_traits>

namespace smoe {
namespace engine {

#define SMOE_ENGINE_INSTANCE(fn, kind, sched, bn, cluster, args) Status fn(const args&, int, cudaStream_t, LaunchStep);
namespace inst {
#include "instances.inc"
}  // namespace inst
#undef SMOE_ENGINE_INSTANCE

namespace {

template <class Args>
struct Entry {
  EngineConfig config;
  Status (*run)(const Args&, int, cudaStream_t, LaunchStep);
};
// Each instantiation goes to the table of its argument struct (the other table gets an entry
// without a function, which find() skips).
template <class Args, class FnArgs>
constexpr Entry<Args> entry(EngineConfig c, Status (*run)(const FnArgs&, int, cudaStream_t, LaunchStep)) {
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
auto find(const Entry<Args> (&table)[N], const EngineConfig& c) -> decltype(table[0].run) {
  for (const auto& e : table)
    if (e.run != nullptr && e.config == c) return e.run;
  return nullptr;
}

}  // namespace

RunVarlenM find_varlen_m(const EngineConfig& c) { return find(kTableM, c); }
RunVarlenK find_varlen_k(const EngineConfig& c) { return find(kTableK, c); }

}  // namespace engine
}  // namespace smoe
