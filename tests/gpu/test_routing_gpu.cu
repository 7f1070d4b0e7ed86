// GPU routing against the float64 reference: indices exact, scores to fp32 rounding, every output
// element written (outputs poisoned first), deterministic, NaN/Inf recorded in the device status.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include "gpu/gpu_util.h"
#include "smoe/reference.h"
#include "smoe/smoe.h"
#include "test_seed.h"

using smoe_test::DeviceBuffer;

namespace {

enum class Pattern { kNormal, kTies, kHotExpert };

struct Case {
  int64_t T;
  int E;
  int K;
  smoe::DType dtype;
  Pattern pattern;
};

std::string name_of(const Case& c) {
  const char* p = c.pattern == Pattern::kNormal ? "normal" : c.pattern == Pattern::kTies ? "ties" : "hot";
  return "T" + std::to_string(c.T) + "_E" + std::to_string(c.E) + "_K" + std::to_string(c.K) +
         (c.dtype == smoe::DType::kFloat32 ? "_f32_" : "_bf16_") + p;
}

using smoe_test::fresh_seed;

// Logits as doubles holding exactly the values the GPU sees (fp32 or bf16-rounded).
std::vector<double> make_logits(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 2.0);
  std::uniform_int_distribution<int> small(0, 3);
  std::vector<double> x(static_cast<size_t>(c.T) * c.E);
  for (int64_t t = 0; t < c.T; ++t) {
    for (int e = 0; e < c.E; ++e) {
      double v = c.pattern == Pattern::kTies ? static_cast<double>(small(rng)) : normal(rng);
      if (c.pattern == Pattern::kHotExpert && e == c.E / 3) v += 100.0;  // every token picks it first
      x[t * c.E + e] = v;
    }
  }
  for (double& v : x) {
    v = c.dtype == smoe::DType::kFloat32 ? static_cast<double>(static_cast<float>(v))
                                         : static_cast<double>(__bfloat162float(__float2bfloat16(static_cast<float>(v))));
  }
  return x;
}

struct GpuRouting {
  DeviceBuffer<float> scores;
  DeviceBuffer<int32_t> topk, freq, offset, scatter, reverse, gather;
  DeviceBuffer<smoe::DeviceStatus> status;
  DeviceBuffer<uint8_t> workspace;
  DeviceBuffer<uint8_t> logits;

  smoe::RoutingOutputs outputs() const {
    smoe::RoutingOutputs o;
    o.scores = scores.get();
    o.topk_expert = topk.get();
    o.expert_frequency = freq.get();
    o.expert_offset = offset.get();
    o.scatter_idx = scatter.get();
    o.reverse_scatter_idx = reverse.get();
    o.gather_idx = gather.get();
    o.status = status.get();
    return o;
  }
};

void allocate(GpuRouting* g, const smoe::RoutingProblem& p) {
  const size_t tk = static_cast<size_t>(p.num_tokens) * p.top_k;
  g->scores.reset(tk);
  g->topk.reset(tk);
  g->scatter.reset(tk);
  g->reverse.reset(tk);
  g->gather.reset(tk);
  g->freq.reset(p.num_experts);
  g->offset.reset(p.num_experts + 1);
  g->status.reset(1);
  g->workspace.reset(std::max<size_t>(smoe::routing_workspace_size(p), 1));
}

void upload_logits(GpuRouting* g, const std::vector<double>& x, smoe::DType dt) {
  if (dt == smoe::DType::kFloat32) {
    std::vector<float> f(x.begin(), x.end());
    g->logits.reset(f.size() * 4);
    ASSERT_EQ(cudaMemcpy(g->logits.get(), f.data(), f.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  } else {
    std::vector<__nv_bfloat16> b(x.size());
    for (size_t i = 0; i < x.size(); ++i) b[i] = __float2bfloat16(static_cast<float>(x[i]));
    g->logits.reset(b.size() * 2);
    ASSERT_EQ(cudaMemcpy(g->logits.get(), b.data(), b.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  }
}

void poison_all(GpuRouting* g) {
  for (cudaError_t e : {g->scores.poison(), g->topk.poison(), g->freq.poison(), g->offset.poison(),
                        g->scatter.poison(), g->reverse.poison(), g->gather.poison()})
    ASSERT_EQ(e, cudaSuccess);
}

smoe::Status run_routing(GpuRouting* g, const smoe::RoutingProblem& p) {
  smoe::Status s = smoe::topk_routing(p, g->logits.get(), g->outputs(), g->workspace.get(),
                                      g->workspace.bytes(), 0);
  return s;
}

template <typename A, typename B>
int64_t count_mismatch(const std::vector<A>& a, const std::vector<B>& b, int64_t* first) {
  int64_t bad = 0;
  *first = -1;
  for (size_t i = 0; i < a.size(); ++i)
    if (static_cast<int64_t>(a[i]) != static_cast<int64_t>(b[i])) {
      if (bad == 0) *first = static_cast<int64_t>(i);
      ++bad;
    }
  return bad;
}

void check_case(const Case& c) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(name_of(c) + " seed=" + std::to_string(seed));
  const std::vector<double> x = make_logits(c, seed);

  smoe::RoutingProblem p;
  p.num_tokens = c.T;
  p.num_experts = c.E;
  p.top_k = c.K;
  p.logits_dtype = c.dtype;
  GpuRouting g;
  allocate(&g, p);
  upload_logits(&g, x, c.dtype);
  poison_all(&g);
  ASSERT_TRUE(smoe::reset_device_status(g.status.get(), 0).ok());
  smoe::Status s = run_routing(&g, p);
  ASSERT_TRUE(s.ok()) << s.message;
  CUDA_OK(cudaDeviceSynchronize());

  const smoe::ref::TopKRouting r = smoe::ref::topk_softmax_ref(x, c.T, c.E, c.K);
  const smoe::ref::RoutingMetadata m = smoe::ref::routing_metadata_ref(smoe::ref::to_general(r));

  int64_t first = -1;
  EXPECT_EQ(count_mismatch(g.topk.download(), r.expert, &first), 0) << "topk_expert, first bad entry " << first;
  const std::vector<float> sc = g.scores.download();
  double max_abs = 0, num = 0, den = 0;
  for (size_t i = 0; i < sc.size(); ++i) {
    const double d = std::fabs(static_cast<double>(sc[i]) - r.score[i]);
    max_abs = std::isnan(d) ? INFINITY : std::max(max_abs, d);
    num += d * d;
    den += r.score[i] * r.score[i];
  }
  EXPECT_LE(max_abs, 2e-6) << "scores max abs error";
  EXPECT_LE(std::sqrt(num / std::max(den, 1e-300)), 1e-6) << "scores relative L2 error";
  EXPECT_EQ(count_mismatch(g.freq.download(), m.expert_frequency, &first), 0) << "expert_frequency at " << first;
  EXPECT_EQ(count_mismatch(g.offset.download(), m.expert_offset, &first), 0) << "expert_offset at " << first;
  EXPECT_EQ(count_mismatch(g.scatter.download(), m.scatter_idx, &first), 0) << "scatter_idx at " << first;
  EXPECT_EQ(count_mismatch(g.reverse.download(), m.reverse_scatter_idx, &first), 0) << "reverse_scatter_idx at " << first;
  EXPECT_EQ(count_mismatch(g.gather.download(), m.gather_idx, &first), 0) << "gather_idx at " << first;

  const smoe::DeviceStatus st = g.status.download()[0];
  EXPECT_EQ(st.flags, 0u);
  EXPECT_EQ(st.nonfinite_tokens, 0u);
  EXPECT_EQ(st.first_nonfinite_token, INT64_MAX);

  if (c.pattern == Pattern::kHotExpert) {
    EXPECT_EQ(m.expert_frequency[c.E / 3], c.T) << "hot expert must receive every token";
  }
}

}  // namespace

TEST(GpuRouting, SmallShapesAllPatterns) {
  // E on both sides of every per-lane instance boundary (warp_topk.cuh: 1, 2, 4, 8, 16 logits a
  // lane for E <= 32, 64, 128, 256, 512): 32 | 33, 64 | 65, 128 | 129, 256 | 257.
  for (int64_t T : {1, 7, 129, 1000}) {
    for (int E : {8, 32, 33, 64, 65, 128, 129, 256, 257, 512}) {
      for (int K : {1, 2, 8, 16}) {
        if (K > E) continue;
        for (Pattern pat : {Pattern::kNormal, Pattern::kTies, Pattern::kHotExpert}) {
          for (smoe::DType dt : {smoe::DType::kFloat32, smoe::DType::kBFloat16}) {
            check_case({T, E, K, dt, pat});
          }
        }
      }
    }
  }
}

TEST(GpuRouting, LargeT) {
  for (int E : {8, 64, 128, 256, 512}) {
    check_case({65536, E, std::min(E, 8), smoe::DType::kFloat32, Pattern::kNormal});
  }
  check_case({65536, 512, 16, smoe::DType::kFloat32, Pattern::kNormal});
  check_case({65536, 256, 8, smoe::DType::kBFloat16, Pattern::kTies});
  check_case({32768, 128, 8, smoe::DType::kBFloat16, Pattern::kHotExpert});
}

TEST(GpuRouting, Deterministic) {
  const Case c{40000, 256, 8, smoe::DType::kBFloat16, Pattern::kTies};
  const std::vector<double> x = make_logits(c, fresh_seed());
  smoe::RoutingProblem p{c.T, c.E, c.K, c.dtype};
  GpuRouting g;
  allocate(&g, p);
  upload_logits(&g, x, c.dtype);
  ASSERT_TRUE(smoe::reset_device_status(g.status.get(), 0).ok());
  ASSERT_TRUE(run_routing(&g, p).ok());
  const auto s1 = g.scores.download();
  const auto t1 = g.topk.download();
  const auto sc1 = g.scatter.download();
  const auto r1 = g.reverse.download();
  poison_all(&g);
  ASSERT_TRUE(run_routing(&g, p).ok());
  EXPECT_EQ(std::memcmp(s1.data(), g.scores.download().data(), s1.size() * 4), 0);
  EXPECT_EQ(t1, g.topk.download());
  EXPECT_EQ(sc1, g.scatter.download());
  EXPECT_EQ(r1, g.reverse.download());
}

TEST(GpuRouting, NonFiniteLogitsAreRecorded) {
  const Case c{64, 64, 4, smoe::DType::kFloat32, Pattern::kNormal};
  std::vector<double> x = make_logits(c, fresh_seed());
  x[5 * 64 + 3] = std::nan("");
  x[9 * 64 + 7] = INFINITY;
  x[20 * 64 + 1] = -INFINITY;
  smoe::RoutingProblem p{c.T, c.E, c.K, c.dtype};
  GpuRouting g;
  allocate(&g, p);
  upload_logits(&g, x, c.dtype);
  ASSERT_TRUE(smoe::reset_device_status(g.status.get(), 0).ok());
  ASSERT_TRUE(run_routing(&g, p).ok());
  smoe::DeviceStatus st = g.status.download()[0];
  EXPECT_EQ(st.flags & smoe::kStatusNonFiniteLogits, smoe::kStatusNonFiniteLogits);
  EXPECT_EQ(st.nonfinite_tokens, 3u);
  EXPECT_EQ(st.first_nonfinite_token, 5);
  // NaN ranks below every number: token 5 never picks expert 3.
  const auto topk = g.topk.download();
  for (int k = 0; k < c.K; ++k) EXPECT_NE(topk[5 * c.K + k], 3);
  // Clean tokens are routed exactly as the reference routes them.
  const smoe::ref::TopKRouting r = smoe::ref::topk_softmax_ref(x, c.T, c.E, c.K);
  for (int64_t t = 0; t < c.T; ++t) {
    if (t == 5 || t == 9 || t == 20) continue;
    for (int k = 0; k < c.K; ++k) EXPECT_EQ(topk[t * c.K + k], r.expert[t * c.K + k]) << "token " << t;
  }
  // Sticky: a second call adds to the record; reset clears it.
  ASSERT_TRUE(run_routing(&g, p).ok());
  EXPECT_EQ(g.status.download()[0].nonfinite_tokens, 6u);
  ASSERT_TRUE(smoe::reset_device_status(g.status.get(), 0).ok());
  st = g.status.download()[0];
  EXPECT_EQ(st.flags, 0u);
  EXPECT_EQ(st.first_nonfinite_token, INT64_MAX);
}

TEST(GpuRouting, ZeroTokens) {
  smoe::RoutingProblem p{0, 32, 4, smoe::DType::kFloat32};
  GpuRouting g;
  allocate(&g, p);
  g.logits.reset(4);
  poison_all(&g);
  ASSERT_TRUE(run_routing(&g, p).ok());
  for (int32_t v : g.freq.download()) EXPECT_EQ(v, 0);
  for (int32_t v : g.offset.download()) EXPECT_EQ(v, 0);
}

TEST(GpuRouting, WorkspaceTooSmallWritesNothing) {
  const Case c{300, 64, 4, smoe::DType::kFloat32, Pattern::kNormal};
  smoe::RoutingProblem p{c.T, c.E, c.K, c.dtype};
  GpuRouting g;
  allocate(&g, p);
  upload_logits(&g, make_logits(c, fresh_seed()), c.dtype);
  poison_all(&g);
  const size_t need = smoe::routing_workspace_size(p);
  ASSERT_GT(need, 0u);
  smoe::Status s = smoe::topk_routing(p, g.logits.get(), g.outputs(), g.workspace.get(), need - 1, 0);
  EXPECT_EQ(s.code, smoe::StatusCode::kWorkspaceTooSmall);
  EXPECT_NE(s.message.find("workspace_bytes"), std::string::npos) << s.message;
  CUDA_OK(cudaDeviceSynchronize());
  for (int32_t v : g.topk.download()) ASSERT_EQ(v, -1) << "nothing may run after a rejected call";
}
