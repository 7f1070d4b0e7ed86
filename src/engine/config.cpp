// The instantiations this build has (the one list in CMakeLists.txt) and the configurations' names.
#include "engine/config.h"

#include <iterator>

namespace smoe {
namespace engine {
namespace {

#define SMOE_ENGINE_INSTANCE(fn, kind, sched, bn, cluster, args) EngineConfig{Kind::kind, Sched::sched, bn, cluster},
constexpr EngineConfig kBuilt[] = {
#include "instances.inc"
};
#undef SMOE_ENGINE_INSTANCE

const char* sched_suffix(Sched s) {
  switch (s) {
    case Sched::kCoop: return "";
    case Sched::kPingPong: return "_pp";
    case Sched::kPingPongStaged: return "_pps";
    case Sched::kPingPongStaged2: return "_pps2";
    case Sched::kPingPong64: return "_pp64";
  }
  return "?";
}

}  // namespace

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::up_swiglu: return "up_swiglu";
    case Kind::down_store: return "down_store";
    case Kind::dx_store: return "dx_store";
    case Kind::da_dswiglu: return "da_dswiglu";
    case Kind::dw_gather_p: return "dw_gather_p";
    case Kind::dw_gather_p_t: return "dw_gather_p_t";
    case Kind::dw_tma: return "dw_tma";
  }
  return "?";
}

int built_index(const EngineConfig& c) {
  for (size_t i = 0; i < std::size(kBuilt); ++i)
    if (kBuilt[i] == c) return static_cast<int>(i);
  return -1;
}

bool is_built(const EngineConfig& c) { return built_index(c) >= 0; }

std::string to_string(const EngineConfig& c) {
  std::string s = kind_name(c.kind);
  s += sched_suffix(c.sched);
  if (c.cluster != 1) s += "_c" + std::to_string(c.cluster);
  return s + "<" + std::to_string(c.bn) + ">";
}

}  // namespace engine
}  // namespace smoe
