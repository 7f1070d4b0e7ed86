// The engine tuner's device side (src/engine/tuner.h), with SMOE_ENGINE_TUNE=1 and a fresh cache
// file: the first call of a key measures every candidate within the budget and stores the winner;
// the next call reads it from the cache and gives the same bits; a call inside stream capture is
// never measured. (Each candidate's correctness is test_engine_gpu.cu's: it forces them all.)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include "engine/engine.h"
#include "engine/overrides.h"
#include "engine/tune_cache.h"
#include "engine/tune_store.h"
#include "engine/tuner.h"
#include "gpu/gpu_util.h"
#include "test_seed.h"

using smoe_test::DeviceBuffer;
using bf16 = __nv_bfloat16;
namespace eng = smoe::engine;

namespace {

std::vector<eng::TuneRecord> g_records;
void keep(const eng::TuneRecord& r) { g_records.push_back(r); }

int sm_count() {
  int dev = 0, n = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  return n;
}

template <typename T>
void upload_new(DeviceBuffer<T>* b, const std::vector<T>& h) {
  b->reset(h.size());
  ASSERT_EQ(b->upload(h), cudaSuccess);
}

std::vector<bf16> random_bf16(size_t n, std::mt19937_64& g) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<bf16> v(n);
  for (auto& x : v) x = __float2bfloat16(nd(g));
  return v;
}

std::vector<int32_t> offsets(const std::vector<int>& counts) {
  std::vector<int32_t> off(counts.size() + 1, 0);
  for (size_t e = 0; e < counts.size(); ++e) off[e + 1] = off[e] + counts[e];
  return off;
}

bool same_bits(const std::vector<bf16>& a, const std::vector<bf16>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(bf16)) == 0;
}

// Checks the record of one measured key.
void expect_record(const eng::TuneRecord& r) {
  SCOPED_TRACE(eng::to_string(r.key));
  ASSERT_FALSE(r.candidates.empty());
  ASSERT_EQ(r.median_ms.size(), r.candidates.size());
  ASSERT_GE(r.winner, 0);
  EXPECT_TRUE(r.chosen == r.candidates[r.winner]);
  EXPECT_GE(r.reps, eng::kTuneMinReps);
  EXPECT_LE(r.reps, eng::kTuneMaxReps);
  EXPECT_LT(r.wall_ms, eng::kTuneBudgetMs * 1.25) << "a key costs <= ~2 s";
  for (size_t i = 0; i < r.candidates.size(); ++i) {
    std::printf("[ tune ] %s %s %.4f ms%s\n", eng::to_string(r.key).c_str(), eng::to_string(r.candidates[i]).c_str(),
                r.median_ms[i], static_cast<int>(i) == r.winner ? " <- winner" : "");
    EXPECT_GT(r.median_ms[i], 0.f);
  }
}

}  // namespace

TEST(GpuTuner, MeasuresOnceThenTheCacheGivesTheSameBits) {
  const std::string dir = ::testing::TempDir() + "smoe_tuner_gpu_" + std::to_string(getpid());
  setenv("SMOE_ENGINE_TUNE_CACHE", (dir + "/engine_tune.json").c_str(), 1);
  setenv("SMOE_ENGINE_TUNE", "1", 1);
  eng::reload_overrides_from_env();
  eng::reload_tune_store_from_env();
  g_records.clear();
  eng::set_tune_sink(keep);
  const int sms = sm_count();
  smoe_test::Rng rng;
  SCOPED_TRACE(testing::Message() << "seed " << rng.seed);
  auto& g = rng.gen;
  cudaStream_t st;
  CUDA_OK(cudaStreamCreate(&st));

  // A down-proj-like varlen-M call (store epilogue: the most candidates), E 8, uneven counts.
  const std::vector<int> counts = {700, 0, 1300, 129, 2048, 64, 900, 1};
  const std::vector<int32_t> off = offsets(counts);
  const int E = static_cast<int>(counts.size()), N = 512, K = 256;
  const int64_t rows = off.back();
  DeviceBuffer<int32_t> d_off;
  DeviceBuffer<bf16> A, B, D;
  upload_new(&d_off, off);
  upload_new(&A, random_bf16(rows * K, g));
  upload_new(&B, random_bf16(static_cast<size_t>(E) * N * K, g));
  D.reset(rows * N);
  eng::VarlenMArgs m;
  m.num_experts = E;
  m.N = N;
  m.K = K;
  m.rows = rows;
  m.expert_offset = d_off.get();
  m.A = A.get();
  m.a_rows = rows;
  m.B = B.get();
  m.D = D.get();
  ASSERT_TRUE(eng::varlen_m(m, sms, st).ok());
  CUDA_OK(cudaStreamSynchronize(st));
  const std::vector<bf16> first = D.download();
  ASSERT_EQ(g_records.size(), 1u);
  expect_record(g_records[0]);
  eng::Choice c;
  ASSERT_TRUE(eng::choose_config(m, sms, st, &c).ok());
  EXPECT_EQ(c.from, "tuned");
  EXPECT_TRUE(*c.config == g_records[0].chosen);
  ASSERT_EQ(D.poison(), cudaSuccess);
  ASSERT_TRUE(eng::varlen_m(m, sms, st).ok());
  CUDA_OK(cudaStreamSynchronize(st));
  EXPECT_TRUE(same_bits(D.download(), first)) << "the measured call and the cached one differ";
  EXPECT_EQ(g_records.size(), 1u) << "a cached key is not measured again";

  // A dW2-like varlen-K call (P gathered from T rows, Q contiguous).
  const int M = 256, NK = 512;
  const int64_t T = rows / 2 + 3;
  std::vector<int32_t> gather(rows);
  for (auto& i : gather) i = static_cast<int32_t>(g() % T);
  DeviceBuffer<int32_t> d_gather;
  DeviceBuffer<bf16> P, Q, DW;
  upload_new(&d_gather, gather);
  upload_new(&P, random_bf16(T * M, g));
  upload_new(&Q, random_bf16(rows * NK, g));
  DW.reset(static_cast<size_t>(E) * M * NK);
  eng::VarlenKArgs k;
  k.num_experts = E;
  k.M = M;
  k.N = NK;
  k.rows = rows;
  k.expert_offset = d_off.get();
  k.P = P.get();
  k.ld_p = M;
  k.gather_p = d_gather.get();
  k.gather_rows = T;  // P holds T rows: without it an output placed just past P would look overlapping
  k.Q = Q.get();
  k.ld_q = NK;
  k.D = DW.get();
  ASSERT_TRUE(eng::varlen_k(k, sms, st).ok());
  CUDA_OK(cudaStreamSynchronize(st));
  const std::vector<bf16> dw_first = DW.download();
  ASSERT_EQ(g_records.size(), 2u);
  expect_record(g_records[1]);
  ASSERT_EQ(DW.poison(), cudaSuccess);
  ASSERT_TRUE(eng::varlen_k(k, sms, st).ok());
  CUDA_OK(cudaStreamSynchronize(st));
  EXPECT_TRUE(same_bits(DW.download(), dw_first)) << "the measured call and the cached one differ";

  // The file holds both keys for the next process.
  eng::reload_tune_store_from_env();
  EXPECT_TRUE(eng::tuned_choice(eng::tune_key(m, eng::device_facts(sms))).has_value());
  EXPECT_TRUE(eng::tuned_choice(eng::tune_key(k, eng::device_facts(sms))).has_value());

  // Inside capture an unseen key (fewer rows: another bucket) runs the heuristic, unmeasured.
  eng::VarlenMArgs small = m;
  small.rows = 64;
  const std::vector<int32_t> off_small = offsets({64, 0, 0, 0, 0, 0, 0, 0});
  DeviceBuffer<int32_t> d_off_small;
  upload_new(&d_off_small, off_small);
  small.expert_offset = d_off_small.get();
  ASSERT_FALSE(eng::tune_key(small, eng::device_facts(sms)) == eng::tune_key(m, eng::device_facts(sms)));
  cudaStream_t cap;
  CUDA_OK(cudaStreamCreate(&cap));
  CUDA_OK(cudaStreamBeginCapture(cap, cudaStreamCaptureModeThreadLocal));
  eng::Choice in_capture;
  const bool chose = eng::choose_config(small, sms, cap, &in_capture).ok();
  const bool ran = eng::varlen_m(small, sms, cap).ok();
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(cap, &graph));
  EXPECT_TRUE(chose);
  EXPECT_TRUE(ran);
  EXPECT_EQ(in_capture.from, "heuristic; capturing: not measured");
  EXPECT_EQ(g_records.size(), 2u);
  EXPECT_FALSE(eng::tuned_choice(eng::tune_key(small, eng::device_facts(sms))).has_value());
  if (graph) CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(cap));
  CUDA_OK(cudaStreamDestroy(st));

  eng::set_tune_sink(nullptr);
  unsetenv("SMOE_ENGINE_TUNE");
  unsetenv("SMOE_ENGINE_TUNE_CACHE");
  eng::reload_overrides_from_env();
  eng::reload_tune_store_from_env();
  std::filesystem::remove_all(dir);
}
