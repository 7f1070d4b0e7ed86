#include "engine/overrides.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

namespace smoe {
namespace engine {
namespace {

bool is(const char* v, const char* s) { return v != nullptr && std::strcmp(v, s) == 0; }

int one_of(const char* v, std::initializer_list<int> allowed) {
  if (v == nullptr) return 0;
  const int x = std::atoi(v);
  for (int a : allowed)
    if (x == a) return x;
  return 0;
}

const char* env(const char* name) { return std::getenv(name); }

Overrides& current() {
  static Overrides o = parse_overrides(env);
  return o;
}

}  // namespace

Overrides parse_overrides(const char* (*lookup)(const char*)) {
  Overrides o;
  const char* sched = lookup("SMOE_ENGINE_SCHED");
  o.sched = is(sched, "coop")         ? ForcedSched::kCoop
            : is(sched, "pingpong")   ? ForcedSched::kPingPong
            : is(sched, "pingpong64") ? ForcedSched::kPingPong64
                                      : ForcedSched::kNone;
  o.bn_m = one_of(lookup("SMOE_ENGINE_BN_M"), {128, 192, 256});
  o.bn_k = one_of(lookup("SMOE_ENGINE_BN_K"), {128, 256});
  o.cluster_m = one_of(lookup("SMOE_ENGINE_CLUSTER"), {1, 2});
  o.cluster_k = one_of(lookup("SMOE_ENGINE_CLUSTER_K"), {1, 2});
  if (const char* v = lookup("SMOE_ENGINE_PP_MAX_K")) o.pingpong_max_k = std::atoi(v);
  if (const char* v = lookup("SMOE_ENGINE_STAGED_STORE"); v != nullptr && v[0] != '\0')
    o.staged_store = is(v, "2") ? 2 : is(v, "0") ? 0 : 1;
  o.store_streaming = !is(lookup("SMOE_ENGINE_STORE_CS"), "0");
  if (const char* v = lookup("SMOE_ENGINE_N_BAND"); v != nullptr && v[0] != '\0') {
    char* end = nullptr;
    const long b = std::strtol(v, &end, 10);
    if (is(v, "off")) o.n_band = 0;
    else if (*end == '\0' && b >= 0) o.n_band = static_cast<int>(std::min<long>(b, 1 << 20));  // else the rule
  }
  const char* p = lookup("SMOE_ENGINE_PRINT");
  o.print = p != nullptr && p[0] != '\0' && p[0] != '0';
  o.tune = !is(lookup("SMOE_ENGINE_TUNE"), "0");
  o.measure = is(lookup("SMOE_ENGINE_TUNE"), "1");
  return o;
}

const Overrides& overrides() { return current(); }
void set_overrides(const Overrides& o) { current() = o; }
void reload_overrides_from_env() { current() = parse_overrides(env); }

}  // namespace engine
}  // namespace smoe
