// The engine heuristic's pick for GEMM keys read from stdin, with no GPU: what
// bench/reports/heuristic_fit.py scores against the tuner's measured candidates, so a rule of
// heuristic.cpp can be re-derived (and checked) on the CPU from smoe_tune logs of many shapes.
//
//   build/smoe_heuristic < keys.txt
// One key per line, the tune log's key text with exact rows in place of the bucket:
//   <kind> N=<N> K=<K> E=<E> rows=<rows> halves=<0|1> sm_count=<SMs> [hbm_gbps=<GB/s>]
// (varlen-K kinds: N and K as the tune key has them, K = the kernel's M after a Q-gathered call's
// transpose). Prints one line per key: the label (config.h to_string), or "none" where no built
// instantiation fits, or "error: ..." for a line it cannot read. The SMOE_ENGINE_* switches are not
// read: this is the unforced heuristic of this build.
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>

#include "engine/config.h"
#include "engine/heuristic.h"
#include "engine/overrides.h"

namespace eng = smoe::engine;

namespace {

bool parse_kind(const std::string& s, eng::Kind* k) {
  for (eng::Kind c : {eng::Kind::up_swiglu, eng::Kind::down_store, eng::Kind::dx_store, eng::Kind::da_dswiglu,
                      eng::Kind::dw_gather_p, eng::Kind::dw_gather_p_t, eng::Kind::dw_tma})
    if (s == eng::kind_name(c)) {
      *k = c;
      return true;
    }
  return false;
}

// "name=value" with the expected name; false otherwise.
bool field(std::istringstream& in, const char* name, int64_t* v) {
  std::string tok;
  if (!(in >> tok)) return false;
  const std::string prefix = std::string(name) + "=";
  if (tok.compare(0, prefix.size(), prefix) != 0) return false;
  try {
    size_t used = 0;
    *v = std::stoll(tok.substr(prefix.size()), &used);
    return used == tok.size() - prefix.size();
  } catch (...) {
    return false;
  }
}

// Pointers the heuristic only tests for null (which operand is gathered, whether B2 is set).
const int32_t kSomeIndex = 0;
const smoe::bf16* some_bf16() { return reinterpret_cast<const smoe::bf16*>(&kSomeIndex); }

std::string pick(const std::string& line) {
  std::istringstream in(line);
  std::string kind_s;
  int64_t N = 0, K = 0, E = 0, rows = 0, halves = 0, sms = 0;
  if (!(in >> kind_s)) return "error: empty line";
  eng::Kind kind;
  if (!parse_kind(kind_s, &kind)) return "error: unknown kind " + kind_s;
  if (!field(in, "N", &N) || !field(in, "K", &K) || !field(in, "E", &E) || !field(in, "rows", &rows) ||
      !field(in, "halves", &halves) || !field(in, "sm_count", &sms))
    return "error: expected '<kind> N= K= E= rows= halves= sm_count= [hbm_gbps=]'";
  int64_t hbm = 0;  // unknown unless given
  std::string rest;
  if (in >> std::ws && !in.eof()) {
    std::istringstream tail(line.substr(static_cast<size_t>(in.tellg())));
    if (!field(tail, "hbm_gbps", &hbm) || (tail >> rest)) return "error: after sm_count only hbm_gbps=<GB/s>";
  }
  constexpr int64_t kIntMax = 2147483647;
  if (N <= 0 || K <= 0 || E <= 0 || rows < 0 || sms <= 0 || hbm < 0)
    return "error: N, K, E, sm_count > 0 and rows, hbm_gbps >= 0";
  if (N > kIntMax || K > kIntMax || E > kIntMax || sms > kIntMax || hbm > kIntMax)
    return "error: N, K, E, sm_count, hbm_gbps must fit an int";
  const eng::DeviceFacts dev{static_cast<int>(sms), static_cast<int>(hbm)};
  const eng::Overrides none;
  std::optional<eng::EngineConfig> c;
  if (kind == eng::Kind::dw_gather_p || kind == eng::Kind::dw_gather_p_t || kind == eng::Kind::dw_tma) {
    eng::VarlenKArgs a;
    a.num_experts = static_cast<int>(E);
    a.rows = rows;
    if (kind == eng::Kind::dw_gather_p_t) {  // the key is the transpose's: M' = K, N' = N
      a.M = static_cast<int>(N);
      a.N = static_cast<int>(K);
      a.gather_q = &kSomeIndex;
    } else {
      a.M = static_cast<int>(K);
      a.N = static_cast<int>(N);
      if (kind == eng::Kind::dw_gather_p) a.gather_p = &kSomeIndex;
    }
    c = eng::choose_varlen_k(a, dev, none);
  } else {
    eng::VarlenMArgs a;
    a.num_experts = static_cast<int>(E);
    a.N = static_cast<int>(N);
    a.K = static_cast<int>(K);
    a.rows = rows;
    a.epilogue = kind == eng::Kind::up_swiglu    ? eng::Epilogue::kSwiGLU
                 : kind == eng::Kind::da_dswiglu ? eng::Epilogue::kDSwiGLU
                                                 : eng::Epilogue::kStore;
    a.b_major = kind == eng::Kind::dx_store || kind == eng::Kind::da_dswiglu ? eng::WeightMajor::kKN
                                                                             : eng::WeightMajor::kNK;
    if (halves) {  // the key's halves: H in halves (SwiGLU / dSwiGLU) or B2 set (dX~)
      a.halves = kind != eng::Kind::dx_store;
      a.B2 = some_bf16();
    }
    c = eng::choose_varlen_m(a, dev, none);
  }
  return c ? eng::to_string(*c) : "none";
}

}  // namespace

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    std::printf("%s\n", pick(line).c_str());
  }
  return 0;
}
