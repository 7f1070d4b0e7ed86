// The engine's host side without a GPU: every argument rule is checked before any CUDA call (so
// these run on CI's CPU machine), the tile heuristic, and the layer's weight-gradient path choice.
#include <cstdint>
#include <cstdlib>
#include <string>

#include <gtest/gtest.h>

#include "engine/engine.h"
#include "moe/dw_path.h"

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

void expect_rejected(const smoe::Status& s, const std::string& needle) {
  EXPECT_EQ(s.code, smoe::StatusCode::kInvalidArgument) << s.message;
  EXPECT_NE(s.message.find(needle), std::string::npos) << "message: " << s.message;
}

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
}

TEST(EngineApi, TileHeuristic) {
  unsetenv("SMOE_ENGINE_SCHED");
  unsetenv("SMOE_ENGINE_BN_M");
  unsetenv("SMOE_ENGINE_STAGED_STORE");
  auto a = good_m();
  // Long-K store: cooperative, wide tiles when they fill the machine.
  a.K = 4096;
  a.N = 512;
  a.rows = 200000;  // 1562 x 2 wide tiles: > 2 waves of 132 SMs
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "down_store<256>");
  EXPECT_FALSE(eng::choose_varlen_m(a, 132).pingpong);
  a.rows = 4000;  // 31 x 2 wide tiles: too few, narrow tiles balance better
  EXPECT_EQ(eng::choose_varlen_m(a, 132).bn, 128);
  a.rows = 200000;
  a.N = 640;  // not a multiple of 256
  EXPECT_EQ(eng::choose_varlen_m(a, 132).bn, 128);
  // Short-K store (down-proj over n, dX~ over 2n): ping-pong, 128 x 192 per warpgroup unless
  // the last column tile is mostly padding.
  a.N = 4096;  // 21 1/3 tiles of 192: 3% padding
  a.K = eng::kPingPongMaxK;
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "down_store_pp<192>");
  a.b_major = eng::WeightMajor::kKN;
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "dx_store_pp<192>");
  a.N = 448;  // 2 1/3 tiles of 192: 29% padding
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "dx_store_pp<128>");
  // Up to kStagedStoreMaxK, the ping-pong stores stage their tile for TMA stores (_pps).
  a.K = eng::kStagedStoreMaxK;
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "dx_store_pps<128>");
  a.N = 4096;
  a.b_major = eng::WeightMajor::kNK;
  a.K = eng::kStagedStore2MaxK + 64;
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "down_store_pps<192>");
  // Up to kStagedStore2MaxK, in a 64-row buffer per warpgroup (_pps2).
  a.K = eng::kStagedStore2MaxK;
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "down_store_pps2<192>");
  a.b_major = eng::WeightMajor::kKN;
  a.N = 448;
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "dx_store_pps2<128>");
  a.b_major = eng::WeightMajor::kNK;
  a.N = 4096;
  setenv("SMOE_ENGINE_STAGED_STORE", "0", 1);
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "down_store_pp<192>");
  setenv("SMOE_ENGINE_STAGED_STORE", "1", 1);
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "down_store_pps<192>");
  setenv("SMOE_ENGINE_STAGED_STORE", "2", 1);
  a.K = eng::kPingPongMaxK;
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "down_store_pps2<192>");
  setenv("SMOE_ENGINE_STAGED_STORE", "1", 1);
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "down_store_pps<192>");
  unsetenv("SMOE_ENGINE_STAGED_STORE");
  a.K = eng::kStagedStoreMaxK + 64;
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "down_store_pp<192>");
  a.b_major = eng::WeightMajor::kKN;
  // dSwiGLU: ping-pong at any K; SwiGLU like the stores.
  a.N = 512;
  a.K = 4096;
  a.epilogue = eng::Epilogue::kDSwiGLU;
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "da_dswiglu_pp64_c2<256>");  // N % 256 == 0, N >= 512, K >= 2048
  a.N = 256;
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "da_dswiglu_pp<128>");
  a.N = 512;
  a.K = 1536;  // dA' at d < 2048: 128 x 128
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "da_dswiglu_pp<128>");
  a.K = 4096;
  a.b_major = eng::WeightMajor::kNK;
  a.epilogue = eng::Epilogue::kSwiGLU;
  // SwiGLU with N % 256 == 0, N >= 512 and weights inside half the L2: ping-pong 64 x 256 pairs
  // at any K.
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "up_swiglu_pp64_c2<256>");
  EXPECT_EQ(eng::choose_varlen_m(a, 132).bm, 64);
  EXPECT_EQ(eng::choose_varlen_m(a, 132).cluster, 2);
  a.K = 2048;
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "up_swiglu_pp64_c2<256>");
  a.N = 256;  // one column tile: the 128-row rule (ping-pong 128 x 128 up to kPingPongMaxK)
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "up_swiglu_pp<128>");
  EXPECT_EQ(eng::choose_varlen_m(a, 132).bm, 128);
  a.N = 512;
  a.K = 4096;
  setenv("SMOE_ENGINE_CLUSTER", "1", 1);  // no unpaired 64 x 256 twin: the 128-row rule
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "up_swiglu<256>");
  unsetenv("SMOE_ENGINE_CLUSTER");
  setenv("SMOE_ENGINE_SCHED", "pingpong", 1);  // a forced schedule overrides the 64 x 256 rule
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "up_swiglu_pp<128>");
  unsetenv("SMOE_ENGINE_SCHED");
  a.K = 2048;
  // Cluster of 2 (B multicast) for experts whose weights outgrow half the L2, given enough rows.
  a.num_experts = 256;
  a.rows = 262144;  // 1024 rows per expert
  a.N = 4096;
  a.K = 7168;       // 56 MiB of weights per expert
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "up_swiglu_c2<256>");
  a.epilogue = eng::Epilogue::kStore;
  a.N = 7168;
  a.K = 2048;       // 28 MiB
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "down_store_pp_c2<192>");
  a.K = 1536;       // 21 MiB: no cluster
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "down_store_pp<192>");
  a.K = 2048;
  a.rows = 256 * 300;  // 300 rows per expert: pairs of M-tiles would be half idle
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "down_store_pp<192>");
  a.num_experts = 8;
  a.rows = 200000;
  a.N = 512;
  a.K = 4096;
  a.epilogue = eng::Epilogue::kSwiGLU;
  // The switches force an instantiation that exists, and are ignored where none does.
  setenv("SMOE_ENGINE_SCHED", "coop", 1);
  setenv("SMOE_ENGINE_BN_M", "256", 1);
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "up_swiglu<256>");
  setenv("SMOE_ENGINE_SCHED", "pingpong", 1);
  setenv("SMOE_ENGINE_BN_M", "192", 1);
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "up_swiglu_pp<128>");  // no SwiGLU 192
  a.epilogue = eng::Epilogue::kStore;
  EXPECT_STREQ(eng::choose_varlen_m(a, 132).name, "down_store_pp<192>");
  unsetenv("SMOE_ENGINE_SCHED");
  unsetenv("SMOE_ENGINE_BN_M");
  // Q-gathered varlen-K runs transposed: the choice is made on the transposed shape.
  eng::VarlenKArgs k;
  k.num_experts = 64;
  k.M = 2048;
  k.N = 2048;
  k.gather_q = fake<const int32_t>(0x60000);
  EXPECT_STREQ(eng::choose_varlen_k(k, 132).name, "dw_gather_p_t_c2<256>");  // 16 M-tiles: pairs
  k.gather_q = nullptr;
  k.gather_p = fake<const int32_t>(0x60000);
  EXPECT_STREQ(eng::choose_varlen_k(k, 132).name, "dw_gather_p_c2<256>");
  k.gather_p = nullptr;
  EXPECT_STREQ(eng::choose_varlen_k(k, 132).name, "dw_tma_c2<256>");
  k.M = 1920;  // 15 M-tiles: no pairs
  EXPECT_STREQ(eng::choose_varlen_k(k, 132).name, "dw_tma<256>");
  k.M = 2048;
  setenv("SMOE_ENGINE_CLUSTER_K", "1", 1);
  EXPECT_STREQ(eng::choose_varlen_k(k, 132).name, "dw_tma<256>");
  setenv("SMOE_ENGINE_CLUSTER_K", "2", 1);
  setenv("SMOE_ENGINE_BN_K", "128", 1);  // pairs are built at BN = 256 only: the switch is ignored
  EXPECT_STREQ(eng::choose_varlen_k(k, 132).name, "dw_tma<128>");
  unsetenv("SMOE_ENGINE_BN_K");
  unsetenv("SMOE_ENGINE_CLUSTER_K");
}

TEST(EngineApi, WeightGradientPath) {
  unsetenv("SMOE_DW_PATH");
  using smoe::layer::DwPath;
  smoe::MoEShape small{40960, 768, 256, 128, 8}, wide{16384, 4096, 4096, 8, 2};
  // Both gradients always take the fused gather (dW2 since daa3d48, dW1 since the TMA-store epilogue; dw_path.h).
  using smoe::layer::dw1_path;
  using smoe::layer::dw2_path;
  for (const smoe::MoEShape& s : {small, wide, smoe::MoEShape{32768, 7168, 2048, 256, 8},
                                  smoe::MoEShape{12345, 2560, 1408, 64, 8}, smoe::MoEShape{32768, 2048, 512, 512, 10},
                                  smoe::MoEShape{16384, 1024, 128, 512, 8}, smoe::MoEShape{32768, 4096, 1536, 128, 8},
                                  smoe::MoEShape{8192, 2048, 8192, 4, 1}}) {
    EXPECT_EQ(dw2_path(s), DwPath::kEngine);
    EXPECT_EQ(dw1_path(s), DwPath::kEngine);
  }
  setenv("SMOE_DW_PATH", "engine", 1);
  EXPECT_EQ(smoe::layer::dw1_path(wide), DwPath::kEngine);
  setenv("SMOE_DW_PATH", "cutlass", 1);
  EXPECT_EQ(smoe::layer::dw2_path(small), DwPath::kCutlass);
  setenv("SMOE_DW_PATH", "engine_tma", 1);
  EXPECT_EQ(smoe::layer::dw1_path(small), DwPath::kEngineTma);
  EXPECT_EQ(smoe::layer::dw2_path(wide), DwPath::kEngineTma);
  setenv("SMOE_DW_PATH", "bogus", 1);  // not a path: the rule decides
  EXPECT_EQ(smoe::layer::dw2_path(small), DwPath::kEngine);
  unsetenv("SMOE_DW_PATH");
}
