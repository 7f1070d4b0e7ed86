// The engine tuner's host side without a GPU (issue 37): the candidates of a call, the measuring
// policy (repetitions, median, winner), when a call is measured (switches, cache, capture, aliasing),
// the tune store's file, and that a stored choice is what the next call picks. What only the GPU can
// show (the timing loop in tuner.cpp, apps/smoe_tune.cu) is not here.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/candidates.h"
#include "engine/config.h"
#include "engine/dispatch.h"
#include "engine/engine.h"
#include "engine/heuristic.h"
#include "engine/overrides.h"
#include "engine/tune_cache.h"
#include "engine/tune_policy.h"
#include "engine/tune_store.h"

namespace eng = smoe::engine;
using eng::Kind;

namespace {

constexpr int kSms = 132;

// Aligned, never dereferenced (nothing here launches).
template <typename T>
T* fake(uintptr_t a) {
  return reinterpret_cast<T*>(a);
}

// The layer's four varlen-M calls at one shape (T*K grouped rows over E experts, hidden d, expert
// width n), each buffer at its own fake address far from the others.
eng::VarlenMArgs m_call(Kind kind, int d, int n, int E, int64_t rows) {
  eng::VarlenMArgs a;
  a.num_experts = E;
  a.rows = rows;
  a.a_rows = rows;
  a.expert_offset = fake<const int32_t>(0x1000000);
  a.B = fake<const smoe::bf16>(0x100000000);
  const bool up = kind == Kind::up_swiglu, down = kind == Kind::down_store, da = kind == Kind::da_dswiglu;
  a.N = up ? 2 * n : da ? n : d;  // dx_store: N = d, K = 2n
  a.K = up || da ? d : down ? n : 2 * n;
  a.epilogue = up ? eng::Epilogue::kSwiGLU : da ? eng::Epilogue::kDSwiGLU : eng::Epilogue::kStore;
  a.b_major = up || down ? eng::WeightMajor::kNK : eng::WeightMajor::kKN;
  a.A = fake<const smoe::bf16>(0x200000000);
  if (a.epilogue != eng::Epilogue::kStore) a.gather_idx = fake<const int32_t>(0x2000000);
  a.D = fake<smoe::bf16>(0x300000000);
  a.D2 = fake<smoe::bf16>(0x400000000);
  if (a.epilogue == eng::Epilogue::kDSwiGLU) {
    a.D = nullptr;
    a.H = fake<const smoe::bf16>(0x500000000);
    a.dH = fake<smoe::bf16>(0x600000000);
    a.scores = fake<const float>(0x3000000);
    a.scatter = fake<const int32_t>(0x4000000);
    a.ds_partial = fake<float>(0x700000000);
  }
  return a;
}

// dW2 (P = dO gathered), dW1 (Q = x gathered, run transposed) or dw_tma (neither gathered).
eng::VarlenKArgs k_call(Kind kind, int M, int N, int E, int64_t rows) {
  eng::VarlenKArgs a;
  a.num_experts = E;
  a.M = M;
  a.N = N;
  a.rows = rows;
  a.expert_offset = fake<const int32_t>(0x1000000);
  a.P = fake<const smoe::bf16>(0x100000000);
  a.ld_p = M;
  a.Q = fake<const smoe::bf16>(0x200000000);
  a.ld_q = N;
  if (kind == Kind::dw_gather_p) a.gather_p = fake<const int32_t>(0x2000000);
  if (kind == Kind::dw_gather_p_t) a.gather_q = fake<const int32_t>(0x2000000);
  a.D = fake<smoe::bf16>(0x900000000);
  return a;
}

std::vector<std::string> labels(const std::vector<eng::EngineConfig>& cs) {
  std::vector<std::string> out;
  for (const auto& c : cs) out.push_back(eng::to_string(c));
  return out;
}

// What every candidate list must be: non-empty, the heuristic's pick first, then distinct built
// configurations of the call's kind in instance-list order, each with a dispatch-table entry. N is
// the kernel's (a Q-gathered varlen-K call's M).
void expect_well_formed(Kind kind, int N, const std::vector<eng::EngineConfig>& cs,
                        const std::optional<eng::EngineConfig>& pick, bool varlen_m) {
  SCOPED_TRACE(::testing::PrintToString(labels(cs)));
  ASSERT_FALSE(cs.empty());
  ASSERT_TRUE(pick.has_value());
  EXPECT_TRUE(cs[0] == *pick) << "the heuristic's pick first";
  for (size_t i = 0; i < cs.size(); ++i) {
    EXPECT_TRUE(eng::is_built(cs[i])) << eng::to_string(cs[i]);
    EXPECT_EQ(cs[i].kind, kind) << eng::to_string(cs[i]);
    EXPECT_TRUE(varlen_m ? eng::find_varlen_m(cs[i]) != nullptr : eng::find_varlen_k(cs[i]) != nullptr)
        << eng::to_string(cs[i]) << " has no dispatch entry";
    if (N % 256 != 0) EXPECT_NE(cs[i].bn, 256) << "BN 256 only at N % 256 == 0";
    for (size_t j = i + 1; j < cs.size(); ++j) EXPECT_FALSE(cs[i] == cs[j]) << "duplicate";
    if (i >= 2) EXPECT_LT(eng::built_index(cs[i - 1]), eng::built_index(cs[i])) << "instance-list order";
  }
}

}  // namespace

// Every built instantiation (the instance list), for the cached-choice check below.
static std::vector<eng::EngineConfig> all_built() {
  std::vector<eng::EngineConfig> out;
  for (Kind k : {Kind::up_swiglu, Kind::down_store, Kind::dx_store, Kind::da_dswiglu, Kind::dw_gather_p,
                 Kind::dw_gather_p_t, Kind::dw_tma})
    for (eng::Sched s : {eng::Sched::kCoop, eng::Sched::kPingPong, eng::Sched::kPingPongStaged,
                         eng::Sched::kPingPongStaged2, eng::Sched::kPingPong64})
      for (int bn : {128, 192, 256})
        for (int c : {1, 2})
          if (eng::is_built(eng::EngineConfig{k, s, bn, c})) out.push_back(eng::EngineConfig{k, s, bn, c});
  return out;
}

TEST(EngineTune, CandidatesForEveryKind) {
  const eng::DeviceFacts dev{kSms};
  // 30B n512 E128 K8 (T 32768), 7B n256 E128 K8 (n = 256: a 2n of 512 and a single dA' column tile
  // pair), a d that is not a multiple of 256 (1.4B: 768), and a clustered shape (weights > 24 MiB).
  struct Shape {
    int d, n, E;
    int64_t rows;
  };
  for (const Shape& s : {Shape{4096, 512, 128, 32768 * 8}, Shape{1536, 256, 128, 24576 * 8},
                         Shape{768, 256, 128, 40960 * 8}, Shape{4096, 1536, 16, 8192 * 2}, Shape{768, 192, 8, 1000}}) {
    SCOPED_TRACE(testing::Message() << "d " << s.d << " n " << s.n << " E " << s.E << " rows " << s.rows);
    for (Kind k : {Kind::up_swiglu, Kind::down_store, Kind::dx_store, Kind::da_dswiglu}) {
      const auto a = m_call(k, s.d, s.n, s.E, s.rows);
      const auto cs = eng::candidates_varlen_m(a, dev);
      expect_well_formed(k, a.N, cs, eng::choose_varlen_m(a, dev, eng::Overrides{}), true);
      EXPECT_EQ(labels(eng::candidates_varlen_m(a, dev)), labels(cs)) << "deterministic";
      for (const auto& c : all_built())  // the cached-choice check: exactly the candidate list
        EXPECT_EQ(eng::is_candidate(a, dev, c), std::find(cs.begin(), cs.end(), c) != cs.end()) << eng::to_string(c);
    }
    for (Kind k : {Kind::dw_gather_p, Kind::dw_gather_p_t, Kind::dw_tma}) {
      const auto a = k_call(k, s.d, s.n, s.E, s.rows);
      const auto cs = eng::candidates_varlen_k(a, dev);
      // BN applies to the kernel's N (the transposed call's M for dW1).
      expect_well_formed(k, eng::as_gather_p(a).N, cs, eng::choose_varlen_k(a, dev, eng::Overrides{}), false);
      EXPECT_EQ(labels(eng::candidates_varlen_k(a, dev)), labels(cs)) << "deterministic";
      for (const auto& c : all_built())
        EXPECT_EQ(eng::is_candidate(a, dev, c), std::find(cs.begin(), cs.end(), c) != cs.end()) << eng::to_string(c);
    }
  }
}

// Pinned on one shape each: the candidates are the instantiations the GPU tests force for the kind
// (tests/gpu/test_engine_gpu.cu, run_m / run_k), in instance-list order after the heuristic's pick.
TEST(EngineTune, CandidatesAreTheForcibleInstantiations) {
  const eng::DeviceFacts dev{kSms};
  const int64_t rows = 32768 * 8;
  EXPECT_EQ(labels(eng::candidates_varlen_m(m_call(Kind::down_store, 4096, 512, 128, rows), dev)),
            (std::vector<std::string>{"down_store_pps<192>", "down_store<128>", "down_store<256>", "down_store_pp<128>",
                                      "down_store_pp<192>", "down_store_c2<256>", "down_store_pp_c2<192>",
                                      "down_store_pps<128>", "down_store_pps2<128>", "down_store_pps2<192>"}));
  EXPECT_EQ(labels(eng::candidates_varlen_m(m_call(Kind::up_swiglu, 4096, 512, 128, rows), dev)),
            (std::vector<std::string>{"up_swiglu_pp64_c2<256>", "up_swiglu<128>", "up_swiglu<256>",
                                      "up_swiglu_pp<128>", "up_swiglu_c2<256>", "up_swiglu_pp_c2<128>"}));
  EXPECT_EQ(labels(eng::candidates_varlen_m(m_call(Kind::da_dswiglu, 4096, 512, 128, rows), dev)),
            (std::vector<std::string>{"da_dswiglu_pp64_c2<256>", "da_dswiglu<128>", "da_dswiglu<256>",
                                      "da_dswiglu_pp<128>", "da_dswiglu_c2<256>", "da_dswiglu_pp_c2<128>"}));
  // n = 192: N = 384 for the up-proj (no 256 tiles, no 64 x 256 pairs), 192 for dA'.
  EXPECT_EQ(labels(eng::candidates_varlen_m(m_call(Kind::up_swiglu, 768, 192, 8, 1000), dev)),
            (std::vector<std::string>{"up_swiglu_pp<128>", "up_swiglu<128>", "up_swiglu_pp_c2<128>"}));
  EXPECT_EQ(labels(eng::candidates_varlen_k(k_call(Kind::dw_gather_p, 4096, 512, 128, rows), dev)),
            (std::vector<std::string>{"dw_gather_p_c2<256>", "dw_gather_p<128>", "dw_gather_p<256>"}));
  // dW1 runs transposed: the kernel's N is the call's M (2n = 384 here): BN 128 only.
  EXPECT_EQ(labels(eng::candidates_varlen_k(k_call(Kind::dw_gather_p_t, 384, 768, 8, 1000), dev)),
            (std::vector<std::string>{"dw_gather_p_t<128>"}));
}

TEST(EngineTune, MedianAndWinner) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(eng::median_ms({3.f, 1.f, 2.f}), 2.f);
  EXPECT_EQ(eng::median_ms({4.f, 1.f, 3.f, 2.f}), 2.f);  // the lower middle: a measured value
  EXPECT_EQ(eng::median_ms({5.f, nan, 1.f, 9.f}), 5.f);  // NaN dropped
  EXPECT_EQ(eng::median_ms({}), inf);
  EXPECT_EQ(eng::median_ms({nan}), inf);
  EXPECT_EQ(eng::median_ms({1.f, 100.f, 1.1f}), 1.1f);  // one outlier moves nothing
  EXPECT_EQ(eng::pick_winner({1.2f, 1.0f, 1.1f}), 1);
  EXPECT_EQ(eng::pick_winner({1.0f, 1.0f, 1.0f}), 0);  // ties: the first (the heuristic's pick)
  EXPECT_EQ(eng::pick_winner({2.0f, 1.0f, 1.0f}), 1);
  EXPECT_EQ(eng::pick_winner({nan, inf, 3.0f}), 2);  // no finite heuristic time: no margin to beat
  EXPECT_EQ(eng::pick_winner({nan, inf}), -1);
  EXPECT_EQ(eng::pick_winner({}), -1);
  // The margin: the heuristic's pick (index 0) stays unless another is more than 5% faster.
  EXPECT_EQ(eng::kTuneMargin, 0.05f);
  EXPECT_EQ(eng::pick_winner({1.0f, 0.96f, 0.97f}), 0);   // 4% faster: noise in the layer
  EXPECT_EQ(eng::pick_winner({1.0f, 0.955f}), 0);         // 4.5%: inside the margin
  EXPECT_EQ(eng::pick_winner({1.0f, 0.97f, 0.94f}), 2);   // 6%: the fastest wins
  EXPECT_EQ(eng::pick_winner({1.0f, 0.97f}, 0.0f), 1);    // margin 0: the plain lowest median
  EXPECT_EQ(eng::pick_winner({inf, 1.0f, 0.99f}), 2);
  // Identical timings, identical choices: the same input gives the same index every time.
  const std::vector<float> t = {0.5f, 0.25f, 0.25f, 0.75f};
  for (int i = 0; i < 3; ++i) EXPECT_EQ(eng::pick_winner(t), 1);
}

TEST(EngineTune, RepsFitTheBudget) {
  EXPECT_EQ(eng::tune_reps(2000, 150, 100), 15);  // 18 more rounds fit: capped
  EXPECT_EQ(eng::tune_reps(2000, 300, 250), 7);   // 1 + 6 rounds
  EXPECT_EQ(eng::tune_reps(2000, 500, 400), 3);   // 1 + 3 = 4, made odd
  EXPECT_EQ(eng::tune_reps(2000, 3000, 1500), 3);  // over budget already: the minimum
  EXPECT_EQ(eng::tune_reps(2000, 1, 0), 15);       // a round too short to time
  for (double round : {0.01, 0.3, 7.0, 90.0, 333.0, 1999.0, 5000.0}) {
    const int r = eng::tune_reps(eng::kTuneBudgetMs, round * 2, round);
    EXPECT_GE(r, eng::kTuneMinReps);
    EXPECT_LE(r, eng::kTuneMaxReps);
    EXPECT_EQ(r % 2, 1);
    // Within budget whenever the minimum itself fits (warm-up ~ one round, then r rounds).
    if ((1 + eng::kTuneMinReps) * round <= eng::kTuneBudgetMs) EXPECT_LE((1 + r) * round, eng::kTuneBudgetMs + round);
  }
}

TEST(EngineTune, WhenACallIsMeasured) {
  using D = eng::MeasureDecision;
  using C = eng::Capture;
  eng::Overrides def;  // SMOE_ENGINE_TUNE unset: the cache is read, nothing is measured
  EXPECT_EQ(eng::decide_measure(def, false, 1000, C::kNone, false), D::kOff);
  eng::Overrides on;
  on.measure = true;
  EXPECT_EQ(eng::decide_measure(on, false, 1000, C::kNone, false), D::kMeasure);
  EXPECT_EQ(eng::decide_measure(on, true, 1000, C::kNone, false), D::kCached);
  EXPECT_EQ(eng::decide_measure(on, false, 0, C::kNone, false), D::kEmpty);
  EXPECT_EQ(eng::decide_measure(on, false, 1000, C::kActive, false), D::kCapturing);
  EXPECT_EQ(eng::decide_measure(on, false, 1000, C::kUnknown, false), D::kCapturing);  // a failed query
  EXPECT_EQ(eng::decide_measure(on, false, 1000, C::kNone, true), D::kOverlap);
  EXPECT_EQ(eng::decide_measure(on, true, 1000, C::kActive, true), D::kCached);  // a cached key needs no measuring
  eng::Overrides forced = on;
  forced.bn_m = 128;  // a switch forces the choice: neither cache nor measuring
  EXPECT_EQ(eng::decide_measure(forced, false, 1000, C::kNone, false), D::kOff);
  eng::Overrides off = on;
  off.tune = false;
  EXPECT_EQ(eng::decide_measure(off, false, 1000, C::kNone, false), D::kOff);
  // A switch that changes how every candidate runs (not which one): read the cache, measure nothing.
  for (const bool band : {true, false}) {
    eng::Overrides ctx = on;
    if (band) ctx.n_band = 0;  // 0 forces one band too: still not the rule's order
    else ctx.store_streaming = false;
    EXPECT_TRUE(eng::changes_timing_context(ctx));
    EXPECT_FALSE(ctx.forces());
    EXPECT_EQ(eng::decide_measure(ctx, false, 1000, C::kNone, false), D::kContext);
    EXPECT_EQ(eng::decide_measure(ctx, true, 1000, C::kNone, false), D::kCached);
  }
  EXPECT_FALSE(eng::changes_timing_context(on));
  // The switch: 1 measures (and reads the cache), 0 ignores the cache, unset reads it only.
  auto with_tune = [](const char* v) {
    static const char* value;
    value = v;
    return eng::parse_overrides([](const char* k) -> const char* {
      return std::string(k) == "SMOE_ENGINE_TUNE" ? value : nullptr;
    });
  };
  EXPECT_TRUE(with_tune("1").measure);
  EXPECT_TRUE(with_tune("1").tune);
  EXPECT_FALSE(with_tune("0").measure);
  EXPECT_FALSE(with_tune("0").tune);
  EXPECT_FALSE(with_tune(nullptr).measure);
  EXPECT_TRUE(with_tune(nullptr).tune);
  EXPECT_FALSE(with_tune("1").forces());
}

TEST(EngineTune, OutputsOverlappingInputsAreNotMeasured) {
  const int64_t rows = 1000;
  for (Kind k : {Kind::up_swiglu, Kind::down_store, Kind::dx_store, Kind::da_dswiglu})
    EXPECT_FALSE(eng::outputs_overlap_inputs(m_call(k, 1024, 512, 8, rows))) << eng::kind_name(k);
  auto down = m_call(Kind::down_store, 1024, 512, 8, rows);
  down.D = reinterpret_cast<smoe::bf16*>(const_cast<smoe::bf16*>(down.A)) + 64;  // D inside A
  EXPECT_TRUE(eng::outputs_overlap_inputs(down));
  down = m_call(Kind::down_store, 1024, 512, 8, rows);
  down.D2 = const_cast<smoe::bf16*>(down.A);  // not an output of the store epilogue
  EXPECT_FALSE(eng::outputs_overlap_inputs(down));
  auto da = m_call(Kind::da_dswiglu, 1024, 512, 8, rows);
  da.dH = const_cast<smoe::bf16*>(da.H);  // in place dH = f(H): the second run would read dH
  EXPECT_TRUE(eng::outputs_overlap_inputs(da));
  da = m_call(Kind::da_dswiglu, 1024, 512, 8, rows);
  da.ds_partial = const_cast<float*>(da.scores);
  EXPECT_TRUE(eng::outputs_overlap_inputs(da));
  // B ends where the last expert's rows end: an output right after it is disjoint, one inside not.
  auto up = m_call(Kind::up_swiglu, 1024, 512, 8, rows);  // B [8][1024][1024] bf16
  up.D = reinterpret_cast<smoe::bf16*>(0x100000000 + 8ull * 1024 * 1024 * 2);
  EXPECT_FALSE(eng::outputs_overlap_inputs(up));
  up.D = reinterpret_cast<smoe::bf16*>(0x100000000 + 8ull * 1024 * 1024 * 2 - 16);
  EXPECT_TRUE(eng::outputs_overlap_inputs(up));
  // A gathered A of a_rows rows (x: T tokens for T*K grouped rows): an output right after them is
  // disjoint, one inside them is not.
  for (Kind k : {Kind::up_swiglu, Kind::da_dswiglu}) {
    auto g = m_call(k, 1024, 512, 8, rows);
    g.a_rows = rows / 8;
    smoe::bf16*& out = k == Kind::up_swiglu ? g.D : g.dH;
    out = const_cast<smoe::bf16*>(g.A) + g.a_rows * g.K;
    EXPECT_FALSE(eng::outputs_overlap_inputs(g)) << eng::kind_name(k);
    out -= 8;
    EXPECT_TRUE(eng::outputs_overlap_inputs(g)) << eng::kind_name(k);
  }
  auto dw = k_call(Kind::dw_gather_p, 1024, 512, 8, rows);
  EXPECT_FALSE(eng::outputs_overlap_inputs(dw));
  dw.D = reinterpret_cast<smoe::bf16*>(const_cast<smoe::bf16*>(dw.Q));
  EXPECT_TRUE(eng::outputs_overlap_inputs(dw));
  // A gathered P of fewer rows than the grouped rows: D right after its gather_rows rows is
  // disjoint; without gather_rows, rows rows are assumed and the same D overlaps (not measured).
  for (Kind k : {Kind::dw_gather_p, Kind::dw_gather_p_t}) {
    dw = k_call(k, 1024, 512, 8, rows);
    const bool on_p = k == Kind::dw_gather_p;
    const auto* src = on_p ? dw.P : dw.Q;
    const int64_t ld = on_p ? dw.ld_p : dw.ld_q;
    dw.D = const_cast<smoe::bf16*>(src) + 300 * ld;  // just past a 300-row source
    EXPECT_TRUE(eng::outputs_overlap_inputs(dw)) << eng::kind_name(k);
    dw.gather_rows = 300;
    EXPECT_FALSE(eng::outputs_overlap_inputs(dw)) << eng::kind_name(k);
    dw.gather_rows = 301;
    EXPECT_TRUE(eng::outputs_overlap_inputs(dw)) << eng::kind_name(k);
  }
}

// The key of a two-tensor dX~ (B2 set, no halves flag: another kernel path) is not the interleaved one.
TEST(EngineTune, TwoTensorDxHasItsOwnKey) {
  auto dx = m_call(Kind::dx_store, 1024, 512, 8, 1000);
  const eng::TuneKey interleaved = eng::tune_key(dx, eng::device_facts(kSms));
  dx.B2 = fake<const smoe::bf16>(0x800000000);
  EXPECT_FALSE(eng::tune_key(dx, eng::device_facts(kSms)) == interleaved);
  EXPECT_TRUE(eng::tune_key(dx, eng::device_facts(kSms)).halves);
}

// A stored winner is what the next call picks (choose_config, the entry points' path), the file
// holds it for the next process, and a second winner for the same key does not replace the first.
TEST(EngineTune, AStoredChoiceIsWhatTheNextCallPicks) {
  const std::string dir = ::testing::TempDir() + "smoe_tune_test_" + std::to_string(getpid());
  const std::string path = dir + "/sub/engine_tune.json";  // the directory does not exist yet
  setenv("SMOE_ENGINE_TUNE_CACHE", path.c_str(), 1);
  unsetenv("SMOE_ENGINE_TUNE");
  eng::reload_overrides_from_env();
  eng::reload_tune_store_from_env();
  EXPECT_EQ(eng::tune_store_path(), path);

  const auto a = m_call(Kind::down_store, 4096, 512, 128, 32768 * 8);
  const auto cs = eng::candidates_varlen_m(a, eng::device_facts(kSms));
  ASSERT_GE(cs.size(), 3u);
  eng::Choice before;
  ASSERT_TRUE(eng::choose_config(a, kSms, nullptr, &before).ok());
  EXPECT_EQ(before.from, "heuristic");
  ASSERT_TRUE(before.config.has_value());
  EXPECT_TRUE(*before.config == cs[0]);

  const eng::TuneKey key = eng::tune_key(a, eng::device_facts(kSms));
  EXPECT_TRUE(eng::store_tuned(key, cs[2]) == cs[2]);
  EXPECT_TRUE(eng::store_tuned(key, cs[1]) == cs[2]) << "the first winner of a key stays";
  eng::Choice after;
  ASSERT_TRUE(eng::choose_config(a, kSms, nullptr, &after).ok());
  EXPECT_EQ(after.from, "tuned");
  EXPECT_TRUE(*after.config == cs[2]);
  // Another call with the same key (rows in the same power-of-two bucket) picks the same.
  auto b = a;
  b.rows = a.rows + 1000;
  b.a_rows = b.rows;
  ASSERT_TRUE(eng::tune_key(b, eng::device_facts(kSms)) == key);
  eng::Choice same;
  ASSERT_TRUE(eng::choose_config(b, kSms, nullptr, &same).ok());
  EXPECT_TRUE(*same.config == cs[2]);

  // The file: written, and read back by a fresh store (the next process).
  std::ifstream f(path);
  ASSERT_TRUE(f.good()) << path;
  std::stringstream text;
  text << f.rdbuf();
  eng::TuneCache file;
  ASSERT_TRUE(file.merge_json(text.str())) << text.str();
  EXPECT_TRUE(*file.get(key) == cs[2]);
  eng::reload_tune_store_from_env();
  ASSERT_TRUE(eng::tuned_choice(key).has_value());
  EXPECT_TRUE(*eng::tuned_choice(key) == cs[2]);

  // The switches still decide first: TUNE=0 ignores the cache, a forced choice overrides it.
  setenv("SMOE_ENGINE_TUNE", "0", 1);
  eng::reload_overrides_from_env();
  eng::Choice ignored;
  ASSERT_TRUE(eng::choose_config(a, kSms, nullptr, &ignored).ok());
  EXPECT_EQ(ignored.from, "heuristic");
  EXPECT_TRUE(*ignored.config == cs[0]);
  unsetenv("SMOE_ENGINE_TUNE");
  setenv("SMOE_ENGINE_BN_M", "128", 1);
  eng::reload_overrides_from_env();
  eng::Choice forced;
  ASSERT_TRUE(eng::choose_config(a, kSms, nullptr, &forced).ok());
  EXPECT_EQ(forced.from, "override");
  unsetenv("SMOE_ENGINE_BN_M");

  // SMOE_ENGINE_TUNE=1 on an unseen key where the capture query fails (no GPU here): never measured.
  int devices = 0;
  const bool gpu = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
  (void)cudaGetLastError();
  if (!gpu) {
    setenv("SMOE_ENGINE_TUNE", "1", 1);
    eng::reload_overrides_from_env();
    const auto unseen = m_call(Kind::up_swiglu, 4096, 512, 128, 32768 * 8);
    eng::Choice guarded;
    ASSERT_TRUE(eng::choose_config(unseen, kSms, nullptr, &guarded).ok());
    EXPECT_EQ(guarded.from, "heuristic; capturing: not measured");
    EXPECT_FALSE(eng::tuned_choice(eng::tune_key(unseen, eng::device_facts(kSms))).has_value());
    unsetenv("SMOE_ENGINE_TUNE");
  }
  eng::reload_overrides_from_env();
  std::filesystem::remove_all(dir);
  unsetenv("SMOE_ENGINE_TUNE_CACHE");
  eng::reload_tune_store_from_env();
}

// A cache file shared with other builds and other processes (issue 37 review): entries this build
// cannot use survive a rewrite, a file that does not parse is never replaced, and processes that
// store at the same time add to the file instead of replacing each other's entries.
TEST(EngineTune, TheCacheFileKeepsOtherBuildsAndOtherProcessesEntries) {
  const std::string dir = ::testing::TempDir() + "smoe_tune_share_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/engine_tune.json";
  auto slurp = [&] {
    std::ifstream f(path);
    std::stringstream t;
    t << f.rdbuf();
    return t.str();
  };
  const std::string foreign =
      "[\n  {\"kind\": \"down_store\", \"N\": 768, \"K\": 256, \"E\": 8, \"rows_bucket\": 6, \"halves\": false, "
      "\"sm_count\": 132, \"config\": \"down_store_pp_c4<192>\"},\n"  // a label no build here knows
      "  {\"kind\": \"gate_swiglu\", \"N\": 768, \"K\": 256, \"E\": 8, \"rows_bucket\": 6, \"halves\": false, "
      "\"sm_count\": 132, \"config\": \"gate_swiglu<128>\"},\n"  // a kind no build here knows
      "  {\"kind\": \"down_store\", \"N\": 768, \"K\": 256, \"E\": 8, \"rows_bucket\": 7, \"halves\": false, "
      "\"sm_count\": 132, \"config\": \"down_store_pps<256>\"}\n]\n";  // parses, not built here
  { std::ofstream(path) << foreign; }
  setenv("SMOE_ENGINE_TUNE_CACHE", path.c_str(), 1);
  unsetenv("SMOE_ENGINE_TUNE");
  eng::reload_overrides_from_env();
  eng::reload_tune_store_from_env();
  const auto a = m_call(Kind::down_store, 4096, 512, 128, 32768 * 8);
  const auto cs = eng::candidates_varlen_m(a, eng::device_facts(kSms));
  ASSERT_GE(cs.size(), 2u);
  const eng::TuneKey key = eng::tune_key(a, eng::device_facts(kSms));
  EXPECT_FALSE(eng::tuned_choice(key).has_value());
  EXPECT_TRUE(eng::store_tuned(key, cs[1]) == cs[1]);
  const std::string after = slurp();
  for (const char* label : {"down_store_pp_c4<192>", "gate_swiglu<128>", "down_store_pps<256>"})
    EXPECT_NE(after.find(label), std::string::npos) << label << " lost:\n" << after;
  EXPECT_NE(after.find(eng::to_string(cs[1])), std::string::npos) << after;
  eng::TuneCache back;
  ASSERT_TRUE(back.merge_json(after));
  EXPECT_EQ(back.size(), 1u);
  EXPECT_EQ(back.foreign_size(), 3u);
  EXPECT_EQ(back.to_json(), after);  // the same text again: one canonical form

  // A file that does not parse is not ours to replace: the choice stays in memory, the file as it was.
  const std::string junk = "[{\"kind\": \"down_store\", \"N\": 7";
  { std::ofstream(path, std::ios::trunc) << junk; }
  eng::reload_tune_store_from_env();
  EXPECT_TRUE(eng::store_tuned(key, cs[1]) == cs[1]);
  EXPECT_TRUE(*eng::tuned_choice(key) == cs[1]);
  EXPECT_EQ(slurp(), junk);

  // Four processes storing 25 keys each at once: all 100 end up in the file.
  std::filesystem::remove(path);
  constexpr int kProcs = 4, kKeys = 25;
  std::vector<pid_t> kids;
  for (int p = 0; p < kProcs; ++p) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      eng::reload_tune_store_from_env();
      bool ok = true;
      for (int i = 0; i < kKeys; ++i) {
        eng::TuneKey k = key;
        k.N = 64 * (1 + p * kKeys + i);
        ok = ok && eng::store_tuned(k, cs[0]) == cs[0];
      }
      _exit(ok ? 0 : 1);
    }
    kids.push_back(pid);
  }
  for (pid_t pid : kids) {
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  eng::TuneCache all;
  ASSERT_TRUE(all.merge_json(slurp()));
  EXPECT_EQ(all.size(), static_cast<size_t>(kProcs * kKeys));
  for (const auto& e : std::filesystem::directory_iterator(dir))  // no temporary file left behind
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();

  std::filesystem::remove_all(dir);
  unsetenv("SMOE_ENGINE_TUNE_CACHE");
  eng::reload_tune_store_from_env();
}

// A cached choice runs only where the call's rules allow it (a stale or hand-edited file); the
// rules themselves come first, before any cache lookup or measuring (issue 37 review).
TEST(EngineTune, ACachedChoiceThatDoesNotFitTheCallIsNotRun) {
  const std::string dir = ::testing::TempDir() + "smoe_tune_fit_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  setenv("SMOE_ENGINE_TUNE_CACHE", (dir + "/t.json").c_str(), 1);
  unsetenv("SMOE_ENGINE_TUNE");
  eng::reload_overrides_from_env();
  eng::reload_tune_store_from_env();
  const auto a = m_call(Kind::down_store, 640, 512, 128, 32768 * 8);  // N = 640: no BN 256 here
  const eng::EngineConfig wide{Kind::down_store, eng::Sched::kCoop, 256, 1};
  ASSERT_TRUE(eng::is_built(wide));
  for (const auto& c : eng::candidates_varlen_m(a, eng::device_facts(kSms))) ASSERT_FALSE(c == wide);
  EXPECT_TRUE(eng::store_tuned(eng::tune_key(a, eng::device_facts(kSms)), wide) == wide);  // as a stale file would hold
  eng::Choice ch;
  ASSERT_TRUE(eng::choose_config(a, kSms, nullptr, &ch).ok());
  ASSERT_TRUE(ch.config.has_value());
  EXPECT_FALSE(*ch.config == wide);
  EXPECT_TRUE(*ch.config == eng::candidates_varlen_m(a, eng::device_facts(kSms))[0]);  // the heuristic's
  EXPECT_EQ(ch.from, "heuristic; the cached down_store<256> does not fit this call");
  // A call that breaks the rules is refused by choose_config itself.
  auto bad = a;
  bad.N = 100;
  eng::Choice none;
  EXPECT_FALSE(eng::choose_config(bad, kSms, nullptr, &none).ok());
  std::filesystem::remove_all(dir);
  unsetenv("SMOE_ENGINE_TUNE_CACHE");
  eng::reload_tune_store_from_env();
}
