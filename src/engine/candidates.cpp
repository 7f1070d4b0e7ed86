#include "engine/candidates.h"

#include <algorithm>
#include <optional>

namespace smoe {
namespace engine {
namespace {

// The heuristic's pick first, the rest (deduplicated) in instance-list order.
std::vector<EngineConfig> ordered(const std::optional<EngineConfig>& pick, std::vector<EngineConfig> forced) {
  std::sort(forced.begin(), forced.end(),
            [](const EngineConfig& x, const EngineConfig& y) { return built_index(x) < built_index(y); });
  std::vector<EngineConfig> out;
  if (pick) out.push_back(*pick);
  for (const EngineConfig& c : forced)
    if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
  return out;
}

}  // namespace

std::vector<EngineConfig> candidates_varlen_m(const VarlenMArgs& a, const DeviceFacts& dev) {
  std::vector<EngineConfig> forced;
  for (ForcedSched s : {ForcedSched::kNone, ForcedSched::kCoop, ForcedSched::kPingPong, ForcedSched::kPingPong64})
    for (int bn : {0, 128, 192, 256})
      for (int cluster : {0, 1, 2})
        for (int staged : {-1, 0, 1, 2}) {
          Overrides o;
          o.sched = s;
          o.bn_m = bn;
          o.cluster_m = cluster;
          o.staged_store = staged;
          if (const std::optional<EngineConfig> c = choose_varlen_m(a, dev, o)) forced.push_back(*c);
        }
  return ordered(choose_varlen_m(a, dev, Overrides{}), forced);
}

std::vector<EngineConfig> candidates_varlen_k(const VarlenKArgs& a, const DeviceFacts& dev) {
  std::vector<EngineConfig> forced;
  for (int bn : {0, 128, 256})
    for (int cluster : {0, 1, 2}) {
      Overrides o;
      o.bn_k = bn;
      o.cluster_k = cluster;
      if (const std::optional<EngineConfig> c = choose_varlen_k(a, dev, o)) forced.push_back(*c);
    }
  return ordered(choose_varlen_k(a, dev, Overrides{}), forced);
}

bool is_candidate(const VarlenMArgs& a, const DeviceFacts& dev, const EngineConfig& c) {
  Overrides o;
  o.sched = c.sched == Sched::kCoop ? ForcedSched::kCoop : c.sched == Sched::kPingPong64 ? ForcedSched::kPingPong64
                                                                                          : ForcedSched::kPingPong;
  o.staged_store = c.sched == Sched::kPingPongStaged ? 1 : c.sched == Sched::kPingPongStaged2 ? 2
                   : c.sched == Sched::kPingPong     ? 0
                                                     : -1;
  o.bn_m = c.bn;
  o.cluster_m = c.cluster;
  const std::optional<EngineConfig> got = choose_varlen_m(a, dev, o);
  return got && *got == c;
}

bool is_candidate(const VarlenKArgs& a, const DeviceFacts& dev, const EngineConfig& c) {
  Overrides o;
  o.bn_k = c.bn;
  o.cluster_k = c.cluster;
  const std::optional<EngineConfig> got = choose_varlen_k(a, dev, o);
  return got && *got == c;
}

}  // namespace engine
}  // namespace smoe
