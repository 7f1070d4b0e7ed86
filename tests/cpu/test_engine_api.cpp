// The engine's host side without a GPU: every argument rule is checked before any CUDA call (so
// these run on CI's CPU machine), the tile heuristic (a pure function of the arguments, the device
// and the overrides), the overrides' parsing and the built instance list.
#include <cstdint>
#include <cstdlib>
#include <string>

#include <gtest/gtest.h>

#include "engine/candidates.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/heuristic.h"
#include "engine/overrides.h"
#include "engine/rules.h"
#include "engine/tune_cache.h"
#include "moe/da_proj.h"
#include "moe/expert_gemms.h"

namespace eng = smoe::engine;

namespace {

// Aligned, never dereferenced: every case below is rejected before anything would read them.
template <typename T>
T* fake(uintptr_t a) {
  return reinterpret_cast<T*>(a);
}

eng::VarlenMArgs good_m() {
  eng::VarlenMArgs a;
  a.num_experts = 8;
  a.N = 256;
  a.K = 128;
  a.rows = 1000;
  a.expert_offset = fake<const int32_t>(0x10000);
  a.A = fake<const smoe::bf16>(0x20000);
  a.a_rows = 1000;
  a.B = fake<const smoe::bf16>(0x30000);
  a.D = fake<smoe::bf16>(0x40000);
  return a;
}

using eng::Kind;
using eng::Sched;

// A label as the instance files spell it ("down_store_pps2_c2<192>") parsed into the typed config
// the heuristic returns, so the expectations below read like the instance list.
eng::EngineConfig cfg(const std::string& label) {
  static const std::pair<const char*, Kind> kinds[] = {
      {"dw_gather_p_t", Kind::dw_gather_p_t}, {"dw_gather_p", Kind::dw_gather_p}, {"dw_tma", Kind::dw_tma},
      {"up_swiglu", Kind::up_swiglu},         {"down_store", Kind::down_store},   {"dx_store", Kind::dx_store},
      {"da_dswiglu", Kind::da_dswiglu}};
  eng::EngineConfig c;
  std::string rest;
  for (const auto& [name, kind] : kinds)
    if (label.rfind(name, 0) == 0) {
      c.kind = kind;
      rest = label.substr(std::string(name).size());
      break;
    }
  const auto lt = rest.find('<');
  c.bn = std::stoi(rest.substr(lt + 1));
  rest = rest.substr(0, lt);
  if (rest.size() >= 3 && rest.compare(rest.size() - 3, 3, "_c2") == 0) {
    c.cluster = 2;
    rest = rest.substr(0, rest.size() - 3);
  }
  c.sched = rest == "_pp"     ? Sched::kPingPong
            : rest == "_pps"  ? Sched::kPingPongStaged
            : rest == "_pps2" ? Sched::kPingPongStaged2
            : rest == "_pp64" ? Sched::kPingPong64
                              : Sched::kCoop;
  EXPECT_EQ(eng::to_string(c), label) << "the test's label does not parse";
  EXPECT_TRUE(eng::is_built(c)) << label << " is not in the instance list";
  return c;
}

eng::Overrides o;  // the overrides the heuristic is asked with (TileHeuristic sets its fields)

std::string chosen_m(const eng::VarlenMArgs& a) {
  const auto c = eng::choose_varlen_m(a, eng::DeviceFacts{132}, o);
  return c ? eng::to_string(*c) : "(none)";
}
std::string chosen_k(const eng::VarlenKArgs& a) {
  const auto c = eng::choose_varlen_k(a, eng::DeviceFacts{132}, o);
  return c ? eng::to_string(*c) : "(none)";
}
eng::EngineConfig choice_m(const eng::VarlenMArgs& a) { return eng::choose_varlen_m(a, eng::DeviceFacts{132}, o).value(); }
eng::EngineConfig choice_k(const eng::VarlenKArgs& a) { return eng::choose_varlen_k(a, eng::DeviceFacts{132}, o).value(); }

void expect_rejected(const smoe::Status& s, const std::string& needle) {
  EXPECT_EQ(s.code, smoe::StatusCode::kInvalidArgument) << s.message;
  EXPECT_NE(s.message.find(needle), std::string::npos) << "message: " << s.message;
}

// Where these host tests run: CI's CPU machine (every CUDA call fails), or the device's Hopper GPU.
enum class GpuKind { kNone, kHopper, kOther };
GpuKind gpu_kind() {
  int devices = 0;
  const bool any = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
  (void)cudaGetLastError();
  if (!any) return GpuKind::kNone;
  cudaDeviceProp prop{};
  return cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9 ? GpuKind::kHopper : GpuKind::kOther;
}

// The heuristic alone while in scope: no tune cache, nothing measured (SMOE_ENGINE_TUNE=1 in the
// environment would launch candidates, and the GPU branches below hold fake pointers).
struct HeuristicOnly {
  eng::Overrides saved = eng::overrides();
  HeuristicOnly() {
    eng::Overrides o;
    o.tune = false;
    o.measure = false;
    eng::set_overrides(o);
  }
  ~HeuristicOnly() { eng::set_overrides(saved); }
};

// A stale prepared function (never called): a refusal must clear it.
smoe::Status stale_run(const eng::VarlenMArgs&, int, cudaStream_t, eng::LaunchStep) { return {}; }

}  // namespace

TEST(EngineApi, VarlenMRules) {
  auto a = good_m();
  a.N = 100;
  expect_rejected(eng::varlen_m(a, 132, nullptr), "N = 100");
  a = good_m();
  a.K = 0;
  expect_rejected(eng::varlen_m(a, 132, nullptr), "K = 0");
  a = good_m();
  a.num_experts = 513;
  expect_rejected(eng::varlen_m(a, 132, nullptr), "num_experts = 513");
  a = good_m();
  a.rows = int64_t{1} << 31;
  expect_rejected(eng::varlen_m(a, 132, nullptr), "rows");
  a = good_m();
  a.epilogue = eng::Epilogue::kSwiGLU;
  a.N = 192;  // 2n with n = 96: not a multiple of 128
  expect_rejected(eng::varlen_m(a, 132, nullptr), "SwiGLU");
  a = good_m();
  a.a_rows = 10;  // contiguous A must cover every grouped row
  expect_rejected(eng::varlen_m(a, 132, nullptr), "a_rows");
  a = good_m();
  a.A = fake<const smoe::bf16>(0x20002);
  EXPECT_EQ(eng::varlen_m(a, 132, nullptr).code, smoe::StatusCode::kMisalignedPointer);
  a = good_m();
  a.epilogue = eng::Epilogue::kDSwiGLU;  // needs H, dH, scores, scatter, ds_partial
  a.gather_idx = fake<const int32_t>(0x60000);
  a.D2 = fake<smoe::bf16>(0x50000);
  expect_rejected(eng::varlen_m(a, 132, nullptr), "H is null");
  for (eng::Epilogue e : {eng::Epilogue::kSwiGLU, eng::Epilogue::kDSwiGLU}) {
    a = good_m();
    a.epilogue = e;  // the fused epilogues' kernels gather A: a null index list would be read
    expect_rejected(eng::varlen_m(a, 132, nullptr), "gather_idx must be non-null");
  }
  a = good_m();
  a.gather_idx = fake<const int32_t>(0x60000);  // gathered A only with the fused epilogues
  expect_rejected(eng::varlen_m(a, 132, nullptr), "gather_idx must be null");
}

TEST(EngineApi, ZeroRowsRunNothing) {
  auto a = good_m();
  a.rows = 0;
  a.A = nullptr;  // not even looked at: nothing to compute
  EXPECT_TRUE(eng::varlen_m(a, 132, nullptr).ok());
}

// prepare_varlen_m refuses what varlen_m refuses, before any launch, and leaves nothing to launch; a
// call with no row prepares nothing and its launch runs nothing (the layer's consuming backward spends
// the saved state only after a successful prepare).
TEST(EngineApi, PrepareRefusesBeforeAnyLaunch) {
  auto a = good_m();
  a.N = 100;
  eng::PreparedVarlenM p;
  p.run = &stale_run;
  expect_rejected(eng::prepare_varlen_m(a, 132, nullptr, &p), "N = 100");
  EXPECT_EQ(p.run, nullptr);
  // Launching what was refused is an error, not a silent no-op that would leave the outputs unwritten.
  expect_rejected(p.launch(good_m(), 132, nullptr), "nothing prepared");
  a = good_m();
  a.rows = 0;
  a.A = nullptr;
  p.run = &stale_run;
  EXPECT_TRUE(eng::prepare_varlen_m(a, 132, nullptr, &p).ok());
  EXPECT_EQ(p.run, nullptr);
  EXPECT_TRUE(p.launch(a, 132, nullptr).ok());
}

// The launch's host setup (the shared-memory attribute, the cluster slots: LaunchStep::kSetup) is
// part of the prepare step, so its failure is a refusal with nothing prepared: the consuming backward
// spends the saved state only after prepare succeeds. Without a GPU (CI) the attribute call fails,
// so prepare must fail, naming the instantiation, where it used to succeed and leave the failure to
// the launch; on a Hopper GPU it sets up and launches nothing (the pointers are fake).
TEST(EngineApi, PrepareDoesTheLaunchSetup) {
  const GpuKind kind = gpu_kind();
  if (kind == GpuKind::kOther) GTEST_SKIP() << "a GPU that is not sm_90: its setup fails for another reason";
  const bool gpu = kind == GpuKind::kHopper;
  const HeuristicOnly heuristic_only;
  eng::PreparedVarlenM p;
  p.run = &stale_run;
  const smoe::Status st = eng::prepare_varlen_m(good_m(), 132, nullptr, &p);
  if (gpu) {
    EXPECT_TRUE(st.ok()) << st.message;
    EXPECT_NE(p.run, nullptr);
  } else {
    EXPECT_EQ(st.code, smoe::StatusCode::kCudaError) << st.message;
    EXPECT_NE(st.message.find("engine "), std::string::npos) << "message: " << st.message;
    EXPECT_EQ(p.run, nullptr);
    expect_rejected(p.launch(good_m(), 132, nullptr), "nothing prepared");
  }
}

// The consuming backward's order (moe/da_proj.h): the saved state is spent only after every host step
// of dA' has passed, and dA' launches only after it is spent. A refused rule and (without a GPU) the
// launch setup both stop the call before `spend`; a failing spend stops it before the launch (which,
// with these fake pointers, must never run: the GPU branch relies on it).
TEST(EngineApi, ConsumingDaProjSpendsOnlyOncePrepared) {
  int spent = 0;
  auto spend = [&]() -> smoe::Status {
    ++spent;
    return smoe::Status{smoe::StatusCode::kInvalidArgument, "spend: stop here"};
  };
  auto a = good_m();
  a.N = 100;
  expect_rejected(smoe::layer::run_da_proj(a, 132, nullptr, spend), "N = 100");
  EXPECT_EQ(spent, 0);
  const GpuKind kind = gpu_kind();
  if (kind == GpuKind::kOther) GTEST_SKIP() << "a GPU that is not sm_90: its setup fails for another reason";
  const bool gpu = kind == GpuKind::kHopper;
  const HeuristicOnly heuristic_only;
  const smoe::Status st = smoe::layer::run_da_proj(good_m(), 132, nullptr, spend);
  if (gpu) {
    expect_rejected(st, "spend: stop here");  // prepared, spent, and stopped before the launch
    EXPECT_EQ(spent, 1);
    // A launch before the spend would have run on the fake pointers: a fault shows here.
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  } else {
    EXPECT_EQ(st.code, smoe::StatusCode::kCudaError) << st.message;  // the launch setup, in prepare
    EXPECT_EQ(spent, 0);
  }
}

TEST(EngineApi, VarlenKRules) {
  eng::VarlenKArgs k;
  k.num_experts = 4;
  k.M = 128;
  k.N = 64;
  k.rows = 100;
  k.ld_p = 128;
  k.ld_q = 64;
  k.expert_offset = fake<const int32_t>(0x10000);
  k.P = fake<const smoe::bf16>(0x20000);
  k.Q = fake<const smoe::bf16>(0x30000);
  k.D = fake<smoe::bf16>(0x40000);
  k.gather_p = fake<const int32_t>(0x50000);
  k.gather_q = fake<const int32_t>(0x60000);
  expect_rejected(eng::varlen_k(k, 132, nullptr), "at most one of gather_p / gather_q");
  k.gather_q = nullptr;
  k.ld_p = 64;  // < M
  expect_rejected(eng::varlen_k(k, 132, nullptr), "ld_p = 64");
  k.ld_p = 128;
  k.M = 96;
  expect_rejected(eng::varlen_k(k, 132, nullptr), "M = 96");
  k.M = 128;
  k.gather_rows = -1;
  expect_rejected(eng::varlen_k(k, 132, nullptr), "gather_rows = -1");
}

TEST(EngineApi, TileHeuristic) {
  o = eng::Overrides{};
  auto a = good_m();
  // Long-K store: cooperative, wide tiles when they fill the machine.
  a.K = 4096;
  a.N = 512;
  a.rows = 200000;  // 1562 x 2 wide tiles: > 2 waves of 132 SMs
  EXPECT_TRUE(choice_m(a) == cfg("down_store<256>")) << chosen_m(a);
  EXPECT_FALSE(choice_m(a).pingpong());
  a.rows = 4000;  // 31 x 2 wide tiles: too few, narrow tiles balance better
  EXPECT_EQ(choice_m(a).bn, 128);
  a.rows = 200000;
  a.N = 640;  // not a multiple of 256: ping-pong (128 x 192 would pad 1/6 of the columns)
  EXPECT_TRUE(choice_m(a) == cfg("down_store_pp<128>")) << chosen_m(a);
  a.N = 2880;  // 15 tiles of 192: ping-pong 128 x 192, not cooperative 128 x 128
  EXPECT_TRUE(choice_m(a) == cfg("down_store_pp<192>")) << chosen_m(a);
  a.b_major = eng::WeightMajor::kKN;  // (weights 23.6 MB: inside half the L2, no cluster)
  EXPECT_TRUE(choice_m(a) == cfg("dx_store_pp<192>")) << chosen_m(a);
  a.b_major = eng::WeightMajor::kNK;
  a.epilogue = eng::Epilogue::kSwiGLU;
  a.N = 5760;  // up-proj of n = 2880: no SwiGLU 192, ping-pong 128 x 128
  a.K = 2112;  // > kPingPongMaxK, weights 24.3 MB (< 24 MiB: no cluster)
  EXPECT_TRUE(choice_m(a) == cfg("up_swiglu_pp<128>")) << chosen_m(a);
  a.epilogue = eng::Epilogue::kStore;
  a.K = 4096;
  // Short-K store (down-proj over n, dX~ over 2n): ping-pong, 128 x 192 per warpgroup unless
  // the last column tile is mostly padding.
  a.N = 4096;  // 21 1/3 tiles of 192: 3% padding
  a.K = eng::kPingPongMaxK;
  EXPECT_TRUE(choice_m(a) == cfg("down_store_pp<192>")) << chosen_m(a);
  a.b_major = eng::WeightMajor::kKN;
  EXPECT_TRUE(choice_m(a) == cfg("dx_store_pp<192>")) << chosen_m(a);
  a.N = 448;  // 2 1/3 tiles of 192: 29% padding
  EXPECT_TRUE(choice_m(a) == cfg("dx_store_pp<128>")) << chosen_m(a);
  // Up to kStagedStoreMaxK, the ping-pong stores stage their tile for TMA stores (_pps).
  a.K = eng::kStagedStoreMaxK;
  EXPECT_TRUE(choice_m(a) == cfg("dx_store_pps<128>")) << chosen_m(a);
  a.N = 4096;
  a.b_major = eng::WeightMajor::kNK;
  a.K = eng::kStagedStore2MaxK + 64;
  EXPECT_TRUE(choice_m(a) == cfg("down_store_pps<192>")) << chosen_m(a);
  // Up to kStagedStore2MaxK, in a 64-row buffer per warpgroup (_pps2).
  a.K = eng::kStagedStore2MaxK;
  EXPECT_TRUE(choice_m(a) == cfg("down_store_pps2<192>")) << chosen_m(a);
  a.b_major = eng::WeightMajor::kKN;
  a.N = 448;
  EXPECT_TRUE(choice_m(a) == cfg("dx_store_pps2<128>")) << chosen_m(a);
  a.b_major = eng::WeightMajor::kNK;
  a.N = 4096;
  o.staged_store = 0;
  EXPECT_TRUE(choice_m(a) == cfg("down_store_pp<192>")) << chosen_m(a);
  o.staged_store = 1;
  EXPECT_TRUE(choice_m(a) == cfg("down_store_pps<192>")) << chosen_m(a);
  o.staged_store = 2;
  a.K = eng::kPingPongMaxK;
  EXPECT_TRUE(choice_m(a) == cfg("down_store_pps2<192>")) << chosen_m(a);
  o.staged_store = 1;
  EXPECT_TRUE(choice_m(a) == cfg("down_store_pps<192>")) << chosen_m(a);
  o.staged_store = -1;
  a.K = eng::kStagedStoreMaxK + 64;
  EXPECT_TRUE(choice_m(a) == cfg("down_store_pp<192>")) << chosen_m(a);
  a.b_major = eng::WeightMajor::kKN;
  // dSwiGLU: ping-pong at any K; SwiGLU like the stores.
  a.N = 512;
  a.K = 4096;
  a.epilogue = eng::Epilogue::kDSwiGLU;
  EXPECT_TRUE(choice_m(a) == cfg("da_dswiglu_pp64_c2<256>")) << chosen_m(a);  // N % 256 == 0, N >= 512, K >= 2048
  a.N = 256;
  EXPECT_TRUE(choice_m(a) == cfg("da_dswiglu_pp<128>")) << chosen_m(a);
  a.N = 512;
  a.K = 1536;  // dA' at d < 2048: the pairs too
  EXPECT_TRUE(choice_m(a) == cfg("da_dswiglu_pp64_c2<256>")) << chosen_m(a);
  a.K = 4096;
  a.b_major = eng::WeightMajor::kNK;
  a.epilogue = eng::Epilogue::kSwiGLU;
  // SwiGLU with N % 256 == 0, N >= 512 and weights inside half the L2: ping-pong 64 x 256 pairs
  // at any K.
  EXPECT_TRUE(choice_m(a) == cfg("up_swiglu_pp64_c2<256>")) << chosen_m(a);
  EXPECT_EQ(choice_m(a).bm(), 64);
  EXPECT_EQ(choice_m(a).cluster, 2);
  a.K = 2048;
  EXPECT_TRUE(choice_m(a) == cfg("up_swiglu_pp64_c2<256>")) << chosen_m(a);
  a.N = 256;  // one column tile: the 128-row rule (ping-pong 128 x 128 up to kPingPongMaxK)
  EXPECT_TRUE(choice_m(a) == cfg("up_swiglu_pp<128>")) << chosen_m(a);
  EXPECT_EQ(choice_m(a).bm(), 128);
  a.N = 512;
  a.K = 4096;
  o.cluster_m = 1;  // no unpaired 64 x 256 twin: the 128-row rule
  EXPECT_TRUE(choice_m(a) == cfg("up_swiglu<256>")) << chosen_m(a);
  o.cluster_m = 0;
  o.sched = eng::ForcedSched::kPingPong;  // a forced schedule overrides the 64 x 256 rule
  EXPECT_TRUE(choice_m(a) == cfg("up_swiglu_pp<128>")) << chosen_m(a);
  o.sched = eng::ForcedSched::kNone;
  a.K = 2048;
  // Cluster of 2 (B multicast) for experts whose weights outgrow half the L2, given enough rows.
  a.num_experts = 256;
  a.rows = 262144;  // 1024 rows per expert
  a.N = 4096;
  a.K = 7168;       // 56 MiB of weights per expert
  EXPECT_TRUE(choice_m(a) == cfg("up_swiglu_c2<256>")) << chosen_m(a);
  a.epilogue = eng::Epilogue::kDSwiGLU;
  a.N = 2048;  // DeepSeek-V3.2's dA' (28 MiB of weights per expert): the 64 x 256 pairs all the same
  EXPECT_TRUE(choice_m(a) == cfg("da_dswiglu_pp64_c2<256>")) << chosen_m(a);
  a.epilogue = eng::Epilogue::kStore;
  a.N = 7168;
  a.K = 2048;       // 28 MiB
  EXPECT_TRUE(choice_m(a) == cfg("down_store_pp_c2<192>")) << chosen_m(a);
  a.K = 1536;       // 21 MiB: no cluster
  EXPECT_TRUE(choice_m(a) == cfg("down_store_pp<192>")) << chosen_m(a);
  a.K = 2048;
  a.rows = 256 * 300;  // 300 rows per expert: pairs of M-tiles would be half idle
  EXPECT_TRUE(choice_m(a) == cfg("down_store_pp<192>")) << chosen_m(a);
  a.num_experts = 8;
  a.rows = 200000;
  a.N = 512;
  a.K = 4096;
  a.epilogue = eng::Epilogue::kSwiGLU;
  // The overrides force an instantiation that exists, and are ignored where none does.
  o.sched = eng::ForcedSched::kCoop;
  o.bn_m = 256;
  EXPECT_TRUE(choice_m(a) == cfg("up_swiglu<256>")) << chosen_m(a);
  o.sched = eng::ForcedSched::kPingPong;
  o.bn_m = 192;
  EXPECT_TRUE(choice_m(a) == cfg("up_swiglu_pp<128>")) << chosen_m(a);  // no SwiGLU 192
  a.epilogue = eng::Epilogue::kStore;
  EXPECT_TRUE(choice_m(a) == cfg("down_store_pp<192>")) << chosen_m(a);
  o.sched = eng::ForcedSched::kNone;
  o.bn_m = 0;
  // Q-gathered varlen-K runs transposed: the choice is made on the transposed shape.
  eng::VarlenKArgs k;
  k.num_experts = 64;
  k.M = 2048;
  k.N = 2048;
  k.gather_q = fake<const int32_t>(0x60000);
  EXPECT_TRUE(choice_k(k) == cfg("dw_gather_p_t_c2<256>")) << chosen_k(k);  // 16 M-tiles: pairs
  k.gather_q = nullptr;
  k.gather_p = fake<const int32_t>(0x60000);
  EXPECT_TRUE(choice_k(k) == cfg("dw_gather_p_c2<256>")) << chosen_k(k);
  k.gather_p = nullptr;
  EXPECT_TRUE(choice_k(k) == cfg("dw_tma_c2<256>")) << chosen_k(k);
  k.M = 1920;  // 15 M-tiles: no pairs
  EXPECT_TRUE(choice_k(k) == cfg("dw_tma<256>")) << chosen_k(k);
  k.M = 2048;
  o.cluster_k = 1;
  EXPECT_TRUE(choice_k(k) == cfg("dw_tma<256>")) << chosen_k(k);
  o.cluster_k = 2;
  o.bn_k = 128;  // pairs are built at BN = 256 only: the override is ignored
  EXPECT_TRUE(choice_k(k) == cfg("dw_tma<128>")) << chosen_k(k);
  o.bn_k = 0;
  o.cluster_k = 0;
}


// The switches are parsed once into a typed struct; unknown values leave the default.
TEST(EngineApi, OverridesParse) {
  const eng::Overrides none = eng::parse_overrides([](const char*) -> const char* { return nullptr; });
  EXPECT_EQ(none.sched, eng::ForcedSched::kNone);
  EXPECT_EQ(none.bn_m, 0);
  EXPECT_EQ(none.bn_k, 0);
  EXPECT_EQ(none.cluster_m, 0);
  EXPECT_EQ(none.cluster_k, 0);
  EXPECT_EQ(none.pingpong_max_k, -1);
  EXPECT_EQ(none.staged_store, -1);
  EXPECT_TRUE(none.store_streaming);
  EXPECT_FALSE(none.print);
  const eng::Overrides all = eng::parse_overrides([](const char* k) -> const char* {
    const std::string n = k;
    if (n == "SMOE_ENGINE_SCHED") return "pingpong64";
    if (n == "SMOE_ENGINE_BN_M") return "192";
    if (n == "SMOE_ENGINE_BN_K") return "256";
    if (n == "SMOE_ENGINE_CLUSTER") return "2";
    if (n == "SMOE_ENGINE_CLUSTER_K") return "1";
    if (n == "SMOE_ENGINE_PP_MAX_K") return "0";
    if (n == "SMOE_ENGINE_STAGED_STORE") return "2";
    if (n == "SMOE_ENGINE_STORE_CS") return "0";
    if (n == "SMOE_ENGINE_PRINT") return "1";
    return nullptr;
  });
  EXPECT_EQ(all.sched, eng::ForcedSched::kPingPong64);
  EXPECT_EQ(all.bn_m, 192);
  EXPECT_EQ(all.bn_k, 256);
  EXPECT_EQ(all.cluster_m, 2);
  EXPECT_EQ(all.cluster_k, 1);
  EXPECT_EQ(all.pingpong_max_k, 0);
  EXPECT_EQ(all.staged_store, 2);
  EXPECT_FALSE(all.store_streaming);
  EXPECT_TRUE(all.print);
  const eng::Overrides bad = eng::parse_overrides([](const char* k) -> const char* {
    const std::string n = k;
    if (n == "SMOE_ENGINE_SCHED") return "fast";
    if (n == "SMOE_ENGINE_BN_M") return "100";
    if (n == "SMOE_ENGINE_CLUSTER") return "n2";  // the pair along N was removed
    if (n == "SMOE_ENGINE_PRINT") return "0";
    return nullptr;
  });
  EXPECT_EQ(bad.sched, eng::ForcedSched::kNone);
  EXPECT_EQ(bad.bn_m, 0);
  EXPECT_EQ(bad.cluster_m, 0);
  EXPECT_FALSE(bad.print);
  // SMOE_ENGINE_PP_MAX_K = 0 (no ping-pong for SwiGLU / store GEMMs) is honoured, not the default.
  o = eng::Overrides{};
  o.pingpong_max_k = 0;
  auto a = good_m();
  a.K = 512;
  EXPECT_FALSE(choice_m(a).pingpong());
  o = eng::Overrides{};
  EXPECT_TRUE(choice_m(a).pingpong());
}

// Every configuration the heuristic can return for a wide sweep of shapes and every override is in
// the instance list (the dispatch table has it), and identical inputs give identical choices.
TEST(EngineApi, HeuristicReturnsBuiltConfigs) {
  int checked = 0;
  for (auto epi : {eng::Epilogue::kStore, eng::Epilogue::kSwiGLU, eng::Epilogue::kDSwiGLU})
    for (auto major : {eng::WeightMajor::kNK, eng::WeightMajor::kKN})
      for (int N : {128, 256, 384, 448, 512, 640, 1024, 2880 / 64 * 64, 4096, 7168})
        for (int K : {128, 256, 512, 1024, 2048, 4096, 7168})
          for (int64_t rows : {int64_t{0}, int64_t{1000}, int64_t{200000}})
            for (auto sched : {eng::ForcedSched::kNone, eng::ForcedSched::kCoop, eng::ForcedSched::kPingPong,
                               eng::ForcedSched::kPingPong64})
              for (int hbm : {0, 3352, 4917}) {  // unknown, H100 SXM (the lean rules), H200
                if (epi == eng::Epilogue::kSwiGLU && N % 128 != 0) continue;
                eng::VarlenMArgs a = good_m();
                a.epilogue = epi;
                a.b_major = major;
                a.N = N;
                a.K = K;
                a.rows = rows;
                o = eng::Overrides{};
                o.sched = sched;
                const eng::DeviceFacts dev{132, hbm};
                const auto c = eng::choose_varlen_m(a, dev, o);
                ASSERT_TRUE(c.has_value()) << N << " " << K;
                EXPECT_TRUE(eng::is_built(*c)) << eng::to_string(*c);
                EXPECT_TRUE(*c == *eng::choose_varlen_m(a, dev, o));
                // The unforced pick is one of the tuner's candidates (what a cached choice is checked against).
                if (sched == eng::ForcedSched::kNone && a.rows > 0)
                  EXPECT_TRUE(eng::is_candidate(a, dev, *c)) << eng::to_string(*c) << " hbm " << hbm;
                // Above the lean threshold the H200's rules: the same pick as an unknown device.
                if (hbm > eng::kLeanHbmGbps) EXPECT_TRUE(*c == *eng::choose_varlen_m(a, eng::DeviceFacts{132}, o));
                ++checked;
              }
  o = eng::Overrides{};
  EXPECT_GT(checked, 1000);
  EXPECT_EQ(eng::to_string(cfg("da_dswiglu_pp64_c2<256>")), "da_dswiglu_pp64_c2<256>");
  EXPECT_FALSE(eng::is_built(eng::EngineConfig{Kind::da_dswiglu, Sched::kPingPongStaged, 128, 1}));
}

// Lean HBM (H100): the rules heuristic.cpp derives from smoe_tune over 41 shapes on the H100
// (bench/results/h100/heuristic_fit.md), on shapes of those configs.
TEST(EngineApi, LeanHbmRules) {
  o = eng::Overrides{};
  EXPECT_EQ(eng::hbm_gbps_of(2619000, 5120), 3352);  // H100 SXM: 2619 MHz, 5120-bit HBM3
  EXPECT_EQ(eng::hbm_gbps_of(3201000, 6144), 4917);  // H200: 3201 MHz, 6144-bit HBM3e
  EXPECT_EQ(eng::hbm_gbps_of(0, 5120), 0);
  const eng::DeviceFacts h100{132, 3352};
  auto pick = [&](eng::Epilogue epi, eng::WeightMajor major, int N, int K, int E, int64_t rows) {
    eng::VarlenMArgs a = good_m();
    a.epilogue = epi;
    a.b_major = major;
    a.N = N;
    a.K = K;
    a.num_experts = E;
    a.rows = rows;
    const auto c = eng::choose_varlen_m(a, h100, o);
    return c ? eng::to_string(*c) : std::string("(none)");
  };
  using Ep = eng::Epilogue;
  using W = eng::WeightMajor;
  // 120B n1024 E128 K8 (262144 rows): the stores (8 / 16 MiB of weights, N 4096) in pairs, the
  // up-projection cooperative 128 x 256 in pairs (16 MiB), dA' (8 MiB, d 4096) cooperative 128 x 256.
  EXPECT_EQ(pick(Ep::kStore, W::kKN, 4096, 2048, 128, 262144), "dx_store_pp_c2<192>");
  EXPECT_EQ(pick(Ep::kStore, W::kNK, 4096, 1024, 128, 262144), "down_store_pp_c2<192>");
  EXPECT_EQ(pick(Ep::kSwiGLU, W::kNK, 2048, 4096, 128, 262144), "up_swiglu_c2<256>");
  EXPECT_EQ(pick(Ep::kDSwiGLU, W::kKN, 1024, 4096, 128, 262144), "da_dswiglu<256>");
  // 30B n512: the up-projection's 8 MiB of weights, no pair.
  EXPECT_EQ(pick(Ep::kSwiGLU, W::kNK, 1024, 4096, 128, 262144), "up_swiglu<256>");
  // OLMoE-7B: dA' at d = 2048 on the 64 x 256 pairs; dX~ (8 MiB, N 2048) cooperative, not ping-pong.
  EXPECT_EQ(pick(Ep::kDSwiGLU, W::kKN, 1024, 2048, 64, 262144), "da_dswiglu_pp64_c2<256>");
  EXPECT_EQ(pick(Ep::kStore, W::kKN, 2048, 2048, 64, 262144), "dx_store<256>");
  // DeepSeek-V3.2's dA' (28 MiB, d 7168): cooperative 128 x 256 in pairs.
  EXPECT_EQ(pick(Ep::kDSwiGLU, W::kKN, 2048, 7168, 256, 262144), "da_dswiglu_c2<256>");
  // The up-proj's 64 x 256 pairs only where experts average at most one 128-row tile, at any d and
  // weight size (few d4096 n1536 T2048: 64 rows per expert, 24 MiB); 7B n256 (1536 rows per expert)
  // cooperative 128 x 256.
  EXPECT_EQ(pick(Ep::kSwiGLU, W::kNK, 512, 1536, 128, 196608), "up_swiglu<256>");
  EXPECT_EQ(pick(Ep::kSwiGLU, W::kNK, 3072, 4096, 256, 16384), "up_swiglu_pp64_c2<256>");
  EXPECT_EQ(pick(Ep::kSwiGLU, W::kNK, 1024, 2048, 64, 128 * 64), "up_swiglu_pp64_c2<256>");
  EXPECT_EQ(pick(Ep::kSwiGLU, W::kNK, 1024, 2048, 64, 128 * 64 + 1).find("pp64"), std::string::npos);
  // dA' from d = kLeanCoopDSwiGLUMinK (3584): cooperative 128 x 256 (Qwen2-57B d3584 n2560, 17.5 MiB,
  // in pairs); below it the rules before (T20000 d3072 n768: 128 x 128 ping-pong), and never at
  // N % 256 != 0 (d6144 n2880: the 128 x 128 pairs).
  EXPECT_EQ(pick(Ep::kDSwiGLU, W::kKN, 2560, 3584, 64, 262144), "da_dswiglu_c2<256>");
  EXPECT_EQ(pick(Ep::kDSwiGLU, W::kKN, 768, 3072, 96, 120000), "da_dswiglu_pp<128>");
  EXPECT_EQ(pick(Ep::kDSwiGLU, W::kKN, 2880, 6144, 64, 196608), "da_dswiglu_pp_c2<128>");
  // gpt-oss-20b's dX~ (N 2880, 31.6 MiB) and down-proj (15.8 MiB) in pairs, and d2880 E128's down-proj
  // (512 rows per expert); below 8 MiB (N 2880, K 1408: 7.7 MiB) and at one M-tile per expert not.
  EXPECT_EQ(pick(Ep::kStore, W::kKN, 2880, 5760, 32, 65536), "dx_store_pp_c2<192>");
  EXPECT_EQ(pick(Ep::kStore, W::kNK, 2880, 2880, 32, 65536), "down_store_pp_c2<192>");
  EXPECT_EQ(pick(Ep::kStore, W::kNK, 2880, 2880, 128, 65536), "down_store_pp_c2<192>");
  EXPECT_EQ(pick(Ep::kStore, W::kNK, 2880, 1408, 32, 65536), "down_store_pp<192>");
  EXPECT_EQ(pick(Ep::kStore, W::kNK, 2880, 2880, 128, 16384), "down_store_pp<192>");
  // N % 256 == 0 below 3072 keeps its floor (E8 K1 n16384's down-proj, N 2048, 64 MiB: no pair).
  EXPECT_EQ(pick(Ep::kStore, W::kNK, 2048, 16384, 8, 65536).find("_c2"), std::string::npos);
  // One 64-row tile per expert: no pairs (the second M-tile would be padding).
  EXPECT_EQ(pick(Ep::kStore, W::kKN, 4096, 3072, 256, 16384), "dx_store<256>");
  // Short-K stores keep the staged ping-pong (30B n256's down-proj, K = 256).
  EXPECT_EQ(pick(Ep::kStore, W::kNK, 4096, 256, 256, 524288), "down_store_pps2<192>");
  // A cooperative 128 x 256 that would not fill 2 waves: the lean rules leave the schedule alone.
  EXPECT_EQ(pick(Ep::kSwiGLU, W::kNK, 512, 4096, 8, 8000), "up_swiglu<128>");  // K > 2048: cooperative anyway
  EXPECT_EQ(pick(Ep::kSwiGLU, W::kNK, 256, 1024, 8, 8000), "up_swiglu_pp<128>");
  // SMOE_ENGINE_PP_MAX_K, when set, is the whole rule: ping-pong up to it, on either device's rules,
  // at any N (the review found the lean and N % 256 exceptions overriding it).
  o.pingpong_max_k = 100000;
  EXPECT_EQ(pick(Ep::kSwiGLU, W::kNK, 1024, 4096, 128, 262144), "up_swiglu_pp<128>");
  EXPECT_EQ(pick(Ep::kStore, W::kKN, 2048, 2048, 64, 262144), "dx_store_pp<192>");
  o.pingpong_max_k = 0;
  EXPECT_EQ(pick(Ep::kStore, W::kNK, 640, 512, 64, 262144), "down_store<128>");
  auto a = good_m();
  a.N = 640;
  a.K = 512;
  a.num_experts = 64;
  a.rows = 262144;
  EXPECT_FALSE(eng::choose_varlen_m(a, eng::DeviceFacts{132}, o)->pingpong()) << "H200 rules, N % 256 != 0";
  o = eng::Overrides{};
  EXPECT_TRUE(eng::choose_varlen_m(a, eng::DeviceFacts{132}, o)->pingpong());
}

// The tuner's host side: keys, the configuration labels, the cache and its JSON file.
TEST(EngineTuneCache, KeysBucketRowsAndFollowTheKernelsView) {
  EXPECT_EQ(eng::rows_bucket(0, 8), 0);
  EXPECT_EQ(eng::rows_bucket(8 * 1, 8), 0);
  EXPECT_EQ(eng::rows_bucket(8 * 2, 8), 1);
  EXPECT_EQ(eng::rows_bucket(8 * 1023, 8), 9);
  EXPECT_EQ(eng::rows_bucket(8 * 1024, 8), 10);
  auto a = good_m();
  a.num_experts = 64;
  a.rows = 64 * 600;
  const eng::TuneKey k1 = eng::tune_key(a, eng::DeviceFacts{132, 4917});
  a.rows = 64 * 1000;  // the same power-of-two bucket: the same key
  EXPECT_TRUE(eng::tune_key(a, eng::DeviceFacts{132, 4917}) == k1);
  a.rows = 64 * 1100;
  EXPECT_FALSE(eng::tune_key(a, eng::DeviceFacts{132, 4917}) == k1);
  EXPECT_FALSE(eng::tune_key(a, eng::DeviceFacts{114}) == eng::tune_key(a, eng::DeviceFacts{132}));  // another machine
  // The H100 and the H200: 132 SMs each, other HBM bandwidth, other winners (heuristic_fit.md).
  EXPECT_FALSE(eng::tune_key(a, eng::DeviceFacts{132, 3352}) == eng::tune_key(a, eng::DeviceFacts{132, 4917}));
  a.halves = true;
  EXPECT_FALSE(eng::tune_key(a, eng::DeviceFacts{132, 4917}) == eng::tune_key(good_m(), eng::DeviceFacts{132, 4917}));
  // A Q-gathered varlen-K call is keyed as the kernel runs it (transposed).
  eng::VarlenKArgs k;
  k.num_experts = 16;
  k.M = 512;
  k.N = 2048;
  k.rows = 16 * 100;
  k.gather_q = fake<const int32_t>(0x60000);
  const eng::TuneKey kk = eng::tune_key(k, eng::DeviceFacts{132, 4917});
  EXPECT_EQ(kk.kind, Kind::dw_gather_p_t);
  EXPECT_EQ(kk.N, 512);
  EXPECT_EQ(kk.K, 2048);
}

TEST(EngineTuneCache, LabelsParseBackToTheirConfigs) {
  int built = 0;
  for (Kind k : {Kind::up_swiglu, Kind::down_store, Kind::dx_store, Kind::da_dswiglu, Kind::dw_gather_p,
                 Kind::dw_gather_p_t, Kind::dw_tma})
    for (Sched s : {Sched::kCoop, Sched::kPingPong, Sched::kPingPongStaged, Sched::kPingPongStaged2, Sched::kPingPong64})
      for (int bn : {128, 192, 256})
        for (int c : {1, 2}) {
          const eng::EngineConfig cfg{k, s, bn, c};
          const auto back = eng::parse_config(eng::to_string(cfg));
          ASSERT_TRUE(back.has_value()) << eng::to_string(cfg);
          EXPECT_TRUE(*back == cfg) << eng::to_string(cfg);
          built += eng::is_built(cfg);
        }
  EXPECT_EQ(built, 41);  // the instance list (SMOE_ENGINE_SPECS)
  EXPECT_FALSE(eng::parse_config("down_store<100>").has_value());
  EXPECT_FALSE(eng::parse_config("up_swiglu_n2<192>").has_value());
  EXPECT_FALSE(eng::parse_config("").has_value());
}

TEST(EngineTuneCache, StoresOnlyFittingBuiltConfigsAndRoundTrips) {
  eng::TuneCache c;
  auto a = good_m();
  a.epilogue = eng::Epilogue::kSwiGLU;
  a.gather_idx = fake<const int32_t>(0x70000);
  a.N = 1024;
  a.K = 2048;
  const eng::TuneKey up = eng::tune_key(a, eng::DeviceFacts{132, 4917});
  EXPECT_FALSE(c.put(up, cfg("down_store_pp<192>")));  // another kind
  EXPECT_FALSE(c.put(up, eng::EngineConfig{Kind::up_swiglu, Sched::kPingPongStaged, 128, 1}));  // not built
  EXPECT_TRUE(c.put(up, cfg("up_swiglu_pp64_c2<256>")));
  eng::VarlenKArgs k;
  k.num_experts = 8;
  k.M = 1024;
  k.N = 768;
  k.rows = 8000;
  k.gather_p = fake<const int32_t>(0x60000);
  const eng::TuneKey dw = eng::tune_key(k, eng::DeviceFacts{132, 4917});
  EXPECT_TRUE(c.put(dw, cfg("dw_gather_p<128>")));
  EXPECT_EQ(c.size(), 2u);
  EXPECT_TRUE(*c.get(up) == cfg("up_swiglu_pp64_c2<256>"));
  EXPECT_FALSE(c.get(eng::tune_key(good_m(), eng::DeviceFacts{132, 4917})).has_value());
  // The file: the same cache, the same text; read back, the same choices.
  const std::string json = c.to_json();
  eng::TuneCache d;
  ASSERT_TRUE(d.merge_json(json)) << json;
  EXPECT_EQ(d.to_json(), json);
  EXPECT_TRUE(*d.get(dw) == cfg("dw_gather_p<128>"));
  EXPECT_TRUE(d.merge_json("[]"));
  EXPECT_EQ(d.size(), 2u);
  // Corrupt text or an entry missing a field: nothing added. A label this build does not know, or a
  // configuration it lacks: not used, but kept for the file (another build's entry).
  eng::TuneCache e;
  EXPECT_FALSE(e.merge_json(json.substr(0, json.size() / 2)));
  EXPECT_FALSE(e.merge_json("{\"kind\": \"up_swiglu\"}"));
  EXPECT_FALSE(e.merge_json("[{\"kind\": \"up_swiglu\", \"N\": 1024, \"K\": 2048, \"E\": 8, \"rows_bucket\": 6, "
                            "\"sm_count\": 132, \"config\": \"up_swiglu<256>\"}]"));  // no halves
  EXPECT_FALSE(e.merge_json("[{\"kind\": \"up_swiglu\", \"N\": 4294968064, \"K\": 2048, \"E\": 8, \"rows_bucket\": 6, "
                            "\"halves\": false, \"sm_count\": 132, \"config\": \"up_swiglu<256>\"}]"));  // > int
  EXPECT_EQ(e.size(), 0u);
  EXPECT_EQ(e.foreign_size(), 0u);
  EXPECT_TRUE(e.merge_json("[{\"kind\": \"up_swiglu\", \"N\": 1024, \"K\": 2048, \"E\": 8, \"rows_bucket\": 6, "
                           "\"halves\": false, \"sm_count\": 132, \"config\": \"up_swiglu<999>\"}]"));
  EXPECT_TRUE(e.merge_json("[{\"kind\": \"up_swiglu\", \"N\": 1024, \"K\": 2048, \"E\": 8, \"rows_bucket\": 6, "
                           "\"halves\": false, \"sm_count\": 132, \"config\": \"up_swiglu_pps<128>\"}]"));
  EXPECT_EQ(e.size(), 0u);  // parsed, but no such instance here
  EXPECT_EQ(e.foreign_size(), 2u);
  // The file is a versioned object, not the first format's bare array: a build from before reads
  // only the array, so it leaves this file alone instead of merging the H100's and the H200's entries.
  EXPECT_EQ(json.rfind("{\"version\": 2, \"entries\": [", 0), 0u) << json;
  EXPECT_TRUE(eng::TuneCache().merge_json("{\"version\": 2, \"entries\": []}"));
  EXPECT_FALSE(eng::TuneCache().merge_json("{\"version\": 3, \"entries\": []}"));  // a later format: not ours
  EXPECT_FALSE(eng::TuneCache().merge_json("{\"entries\": [], \"version\": 2}"));
  EXPECT_FALSE(eng::TuneCache().merge_json("{\"version\": 2, \"entries\": []} []"));
  EXPECT_FALSE(e.merge_json("[{\"kind\": \"up_swiglu\", \"N\": 1024, \"K\": 2048, \"E\": 8, \"rows_bucket\": 6, "
                            "\"halves\": false, \"sm_count\": 132, \"hbm_gbps\": \"3352\", \"config\": \"up_swiglu<256>\"}]"));
  // A file from before the key had the device's bandwidth: its entries are kept (written back as they
  // were) but not used, since the device they were measured on is unknown.
  const std::string old_entry = "{\"kind\": \"up_swiglu\", \"N\": 1024, \"K\": 2048, \"E\": 8, \"rows_bucket\": 6, "
                                "\"halves\": false, \"sm_count\": 132, \"config\": \"up_swiglu<256>\"}";
  eng::TuneCache f;
  EXPECT_TRUE(f.merge_json("[" + old_entry + "]"));
  EXPECT_EQ(f.size(), 0u);
  EXPECT_EQ(f.foreign_size(), 1u);
  EXPECT_NE(f.to_json().find(old_entry), std::string::npos) << f.to_json();
  EXPECT_FALSE(f.merge_json("[{\"kind\": \"up_swiglu\", \"N\": 1024, \"K\": 2048, \"E\": 8, \"rows_bucket\": 6, "
                            "\"halves\": false, \"sm_count\": 132, \"hbm_gbps\": -1, \"config\": \"up_swiglu<256>\"}]"));
  // With it, the entry is used under exactly that device's key.
  EXPECT_TRUE(f.merge_json("[{\"kind\": \"up_swiglu\", \"N\": 1024, \"K\": 2048, \"E\": 8, \"rows_bucket\": 6, "
                           "\"halves\": false, \"sm_count\": 132, \"hbm_gbps\": 3352, \"config\": \"up_swiglu<256>\"}]"));
  EXPECT_EQ(f.size(), 1u);
  auto b = good_m();
  b.epilogue = eng::Epilogue::kSwiGLU;
  b.N = 1024;
  b.K = 2048;
  b.rows = 8 * 64;  // rows_bucket 6
  EXPECT_TRUE(f.get(eng::tune_key(b, eng::DeviceFacts{132, 3352})).has_value());
  EXPECT_FALSE(f.get(eng::tune_key(b, eng::DeviceFacts{132, 4917})).has_value());
}

TEST(EngineTuneCache, PathAndSwitches) {
  auto none = [](const char*) -> const char* { return nullptr; };
  EXPECT_EQ(eng::tune_cache_path(none), "");
  EXPECT_EQ(eng::tune_cache_path([](const char* k) -> const char* {
              return std::string(k) == "HOME" ? "/home/u" : nullptr;
            }),
            "/home/u/.cache/smoe/engine_tune.json");
  EXPECT_EQ(eng::tune_cache_path([](const char* k) -> const char* {
              const std::string n = k;
              return n == "HOME" ? "/home/u" : n == "XDG_CACHE_HOME" ? "/c" : nullptr;
            }),
            "/c/smoe/engine_tune.json");
  EXPECT_EQ(eng::tune_cache_path([](const char* k) -> const char* {
              const std::string n = k;
              return n == "SMOE_ENGINE_TUNE_CACHE" ? "/x/t.json" : n == "HOME" ? "/home/u" : nullptr;
            }),
            "/x/t.json");
  const eng::Overrides def = eng::parse_overrides(none);
  EXPECT_TRUE(def.tune);
  EXPECT_FALSE(def.forces());
  const eng::Overrides off = eng::parse_overrides([](const char* k) -> const char* {
    return std::string(k) == "SMOE_ENGINE_TUNE" ? "0" : nullptr;
  });
  EXPECT_FALSE(off.tune);
  eng::Overrides f;
  f.bn_k = 256;
  EXPECT_TRUE(f.forces());
}

// The layer's six GEMMs as the shared builders make them (moe/expert_gemms.h), for each gate/up form
// the layers hand over: every call passes the engine's rules, is the GEMM kind the tuner keys it by,
// and has the dimensions and operand offsets of its math (a builder that swapped N and K, or dropped
// the up half's offset, fails here before any GPU run).
TEST(ExpertGemms, BuildersMakeTheLayersSixCalls) {
  namespace layer = smoe::layer;
  using smoe::bf16;
  const int E = 8, d = 256, n = 192;
  const int64_t rows = 1000, T = 300;
  const layer::ExpertRows er{E, d, n, rows, fake<const int32_t>(0x10000), fake<const int32_t>(0x20000), T};
  const bf16* x = fake<const bf16>(0x100000);
  const bf16* dout = fake<const bf16>(0x200000);
  const bf16* w1 = fake<const bf16>(0x1000000);
  const bf16* w3 = fake<const bf16>(0x2000000);
  const bf16* w2 = fake<const bf16>(0x3000000);
  bf16* h = fake<bf16>(0x4000000);
  bf16* act = fake<bf16>(0x5000000);
  bf16* y = fake<bf16>(0x6000000);
  bf16* dh = fake<bf16>(0x7000000);
  bf16* ap = fake<bf16>(0x8000000);
  float* dsp = fake<float>(0x9000000);
  bf16* dw1 = fake<bf16>(0xa000000);
  bf16* dw3 = fake<bf16>(0xb000000);
  bf16* dw2 = fake<bf16>(0xc000000);
  bf16* dxt = fake<bf16>(0xd000000);
  const layer::GateUp forms[] = {layer::gate_up_of({nullptr, w1, w2, nullptr}),  // interleaved w1
                                 layer::gate_up_of({nullptr, w1, w2, w3}),       // two tensors
                                 {w1, w1 + int64_t{n} * d, 2 * n, true}};        // concatenated
  EXPECT_FALSE(forms[0].halves);
  EXPECT_TRUE(forms[1].halves && forms[1].b2 == w3 && forms[1].stride == 0);
  for (const layer::GateUp& gu : forms) {
    SCOPED_TRACE(gu.b2 == nullptr ? "interleaved" : gu.stride ? "concatenated" : "two tensors");
    const eng::VarlenMArgs up = layer::up_proj_args(er, x, gu, h, act);
    EXPECT_EQ(eng::check_varlen_m(up).message, "");  // ok: no rule broken
    EXPECT_EQ(eng::kind_of(up), Kind::up_swiglu);
    EXPECT_EQ(up.N, 2 * n);
    EXPECT_EQ(up.K, d);
    EXPECT_EQ(up.a_rows, T);
    EXPECT_EQ(up.halves, gu.halves);
    EXPECT_EQ(up.b_expert_stride, gu.stride);

    const eng::VarlenMArgs down = layer::down_proj_args(er, act, w2, y);
    EXPECT_EQ(eng::check_varlen_m(down).message, "");  // ok: no rule broken
    EXPECT_EQ(eng::kind_of(down), Kind::down_store);
    EXPECT_EQ(down.N, d);
    EXPECT_EQ(down.K, n);
    EXPECT_EQ(down.a_rows, rows);

    const layer::DSwiGLUIo io{h, fake<const float>(0xe000000), fake<const int32_t>(0xf000000), dh, ap, dsp};
    const eng::VarlenMArgs da = layer::da_proj_args(er, dout, w2, gu.halves, io);
    EXPECT_EQ(eng::check_varlen_m(da).message, "");  // ok: no rule broken
    EXPECT_EQ(eng::kind_of(da), Kind::da_dswiglu);
    EXPECT_EQ(da.N, n);
    EXPECT_EQ(da.K, d);
    EXPECT_EQ(da.b_major, eng::WeightMajor::kKN);

    const eng::VarlenKArgs k2 = layer::dw2_args(er, dout, ap, dw2);
    EXPECT_EQ(eng::check_varlen_k(k2).message, "");  // ok: no rule broken
    EXPECT_EQ(eng::kind_of(k2), Kind::dw_gather_p);
    EXPECT_EQ(k2.M, d);
    EXPECT_EQ(k2.N, n);
    EXPECT_EQ(k2.gather_rows, T);

    // Two outputs only for two tensors; the concatenated gradient is one call over 2n rows.
    const bool two_outputs = gu.halves && gu.stride == 0;
    for (int half = 0; half < (two_outputs ? 2 : 1); ++half) {
      const eng::VarlenKArgs k1 = layer::dw1_args(er, dh, x, two_outputs, half, half ? dw3 : dw1);
      EXPECT_EQ(eng::check_varlen_k(k1).message, "");  // ok: no rule broken
      EXPECT_EQ(eng::kind_of(k1), Kind::dw_gather_p_t);
      EXPECT_EQ(k1.M, two_outputs ? n : 2 * n);
      EXPECT_EQ(k1.N, d);
      EXPECT_EQ(k1.P, dh + int64_t{half} * n);
      EXPECT_EQ(k1.ld_p, 2 * n);
      EXPECT_EQ(k1.D, half ? dw3 : dw1);
    }

    const eng::VarlenMArgs dx = layer::dx_tilde_args(er, dh, gu, dxt);
    EXPECT_EQ(eng::check_varlen_m(dx).message, "");  // ok: no rule broken
    EXPECT_EQ(eng::kind_of(dx), Kind::dx_store);
    EXPECT_EQ(dx.N, d);
    EXPECT_EQ(dx.K, 2 * n);
    EXPECT_EQ(dx.B2, gu.b2);
    EXPECT_EQ(dx.b_expert_stride, gu.stride);
    EXPECT_FALSE(dx.halves);
  }
}
