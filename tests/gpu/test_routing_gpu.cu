// GPU routing against the float64 reference: indices exact, scores to fp32 rounding, every output
// element written (outputs poisoned first), deterministic, NaN/Inf recorded in the device status.
// The grouping (a counting sort over warp ranges, routing.cu) is also driven through
// provided_routing with chosen id patterns: empty slots, one hot key spanning many blocks, ids
// outside [-1, E), enough entries to hit the cap on the grouping's blocks (1024).
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <numeric>
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

// kHotExpert: every token picks expert E/3 first (K = 1: one key for all entries); kHotSet: every
// token picks the same K experts (in a random order), so E - K experts stay empty.
enum class Pattern { kNormal, kTies, kHotExpert, kHotSet };

struct Case {
  int64_t T;
  int E;
  int K;
  smoe::DType dtype;
  Pattern pattern;
  bool token_offset = true;  // also ask for outputs.token_offset
};

const char* pattern_name(Pattern p) {
  switch (p) {
    case Pattern::kNormal: return "normal";
    case Pattern::kTies: return "ties";
    case Pattern::kHotExpert: return "hot";
    default: return "hotset";
  }
}

// The K experts kHotSet boosts: distinct (j * stride < K * (E / K) <= E), spread over [0, E).
int hot_set_expert(int j, int E, int K) { return (E / 5 + j * std::max(1, E / K)) % E; }

std::string name_of(const Case& c) {
  const char* p = pattern_name(c.pattern);
  return "T" + std::to_string(c.T) + "_E" + std::to_string(c.E) + "_K" + std::to_string(c.K) +
         (c.dtype == smoe::DType::kFloat32 ? "_f32_" : "_bf16_") + p;
}

using smoe_test::fresh_seed;

// Logits as doubles holding exactly the values the GPU sees (fp32 or bf16-rounded).
std::vector<double> make_logits(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 2.0);
  // Ties: a few values, signed zeros among them (-0 and +0 are equal logits: the lower expert first).
  static const double kTieValues[] = {-1.0, -0.0, 0.0, 1.0, 2.0};
  std::uniform_int_distribution<int> small(0, 4);
  std::vector<double> x(static_cast<size_t>(c.T) * c.E);
  for (int64_t t = 0; t < c.T; ++t) {
    for (int e = 0; e < c.E; ++e) {
      double v = c.pattern == Pattern::kTies ? kTieValues[small(rng)] : normal(rng);
      if (c.pattern == Pattern::kHotExpert && e == c.E / 3) v += 100.0;  // every token picks it first
      x[t * c.E + e] = v;
    }
    if (c.pattern == Pattern::kHotSet) {
      for (int j = 0; j < c.K; ++j) x[t * c.E + hot_set_expert(j, c.E, c.K)] += 100.0;
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
  DeviceBuffer<int32_t> token_offset;  // empty: outputs.token_offset stays null
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
    o.token_offset = token_offset.get();
    return o;
  }
};

void allocate(GpuRouting* g, const smoe::RoutingProblem& p, bool token_offset = false) {
  const size_t tk = static_cast<size_t>(p.num_tokens) * p.top_k;
  g->scores.reset(tk);
  g->topk.reset(tk);
  g->scatter.reset(tk);
  g->reverse.reset(tk);
  g->gather.reset(tk);
  g->freq.reset(p.num_experts);
  g->offset.reset(p.num_experts + 1);
  g->status.reset(1);
  g->token_offset.reset(token_offset ? static_cast<size_t>(p.num_tokens) + 1 : 0);
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
                        g->scatter.poison(), g->reverse.poison(), g->gather.poison(), g->token_offset.poison()})
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
  allocate(&g, p, c.token_offset);
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
  if (c.token_offset) {
    std::vector<int64_t> want(static_cast<size_t>(c.T) + 1);
    for (int64_t t = 0; t <= c.T; ++t) want[t] = t * c.K;
    EXPECT_EQ(count_mismatch(g.token_offset.download(), want, &first), 0) << "token_offset at " << first;
  }

  const smoe::DeviceStatus st = g.status.download()[0];
  EXPECT_EQ(st.flags, 0u);
  EXPECT_EQ(st.nonfinite_tokens, 0u);
  EXPECT_EQ(st.first_nonfinite_token, INT64_MAX);

  if (c.pattern == Pattern::kHotExpert) {
    EXPECT_EQ(m.expert_frequency[c.E / 3], c.T) << "hot expert must receive every token";
  }
  if (c.pattern == Pattern::kHotSet) {
    for (int j = 0; j < c.K; ++j) EXPECT_EQ(m.expert_frequency[hot_set_expert(j, c.E, c.K)], c.T) << "hot set " << j;
  }
}

// ---- provided routing: the grouping driven by chosen expert ids ---------------------------------

// kRandom: ids in [0, E), 1 in 5 slots empty (repeats within a token are dropped and flagged);
// kMostlyEmpty: 19 in 20 slots empty; kAllEmpty: every slot; kHotExpert: every token lists the same
// K experts E/3, E/3+1, ... (K = 1: one key for all entries, a run over many blocks); kFewExperts:
// ids from {0, E/2, E-1} or empty, the other experts never used; kInvalid: ids in [-3, E+2] and a
// non-finite score (flagged if its slot is kept).
enum class Slots { kRandom, kMostlyEmpty, kAllEmpty, kHotExpert, kFewExperts, kInvalid };

struct ProvidedCase {
  int64_t T;
  int E;
  int K;
  Slots slots;
};

std::string name_of(const ProvidedCase& c) {
  static const char* names[] = {"random", "mostly_empty", "all_empty", "hot", "few_experts", "invalid"};
  return "T" + std::to_string(c.T) + "_E" + std::to_string(c.E) + "_K" + std::to_string(c.K) + "_" +
         names[static_cast<int>(c.slots)];
}

struct ProvidedInput {
  std::vector<int32_t> expert;  // [T*K]
  std::vector<float> score;     // [T*K]
};

ProvidedInput make_provided(const ProvidedCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> expert(0, c.E - 1), invalid(-3, c.E + 2), percent(0, 99), pick(0, 3);
  std::normal_distribution<float> normal(0.f, 1.f);
  const size_t tk = static_cast<size_t>(c.T) * c.K;
  ProvidedInput in{std::vector<int32_t>(tk), std::vector<float>(tk)};
  const int few[] = {0, c.E / 2, c.E - 1, -1};
  for (size_t f = 0; f < tk; ++f) {
    const int k = static_cast<int>(f % c.K);
    int32_t id = -1;
    switch (c.slots) {
      case Slots::kRandom: id = percent(rng) < 20 ? -1 : expert(rng); break;
      case Slots::kMostlyEmpty: id = percent(rng) < 95 ? -1 : expert(rng); break;
      case Slots::kAllEmpty: break;
      case Slots::kHotExpert: id = (c.E / 3 + k) % c.E; break;
      case Slots::kFewExperts: id = few[pick(rng)]; break;
      case Slots::kInvalid: id = invalid(rng); break;
    }
    in.expert[f] = id;
    in.score[f] = normal(rng);
  }
  if (c.slots == Slots::kInvalid && tk > 0) in.score[tk / 2] = INFINITY;
  return in;
}

// provided_routing's contract (smoe.h) on the CPU. Slots: an id outside [-1, E) or a repeat of an
// id the token kept already becomes -1 (flagged); kept slots keep their score, empty ones get 0.
// Grouping: rows by expert ascending, the empty slots after every expert, entry order within each;
// rows >= nnz are the empty slots (reverse -1, gather 0).
struct ProvidedRef {
  std::vector<int32_t> expert;
  std::vector<float> score;
  uint32_t flags = 0;
  std::vector<int32_t> frequency, offset, scatter, reverse, gather, token_offset;
};

ProvidedRef provided_ref(const ProvidedInput& in, int64_t T, int E, int K) {
  const int64_t tk = T * K;
  ProvidedRef r;
  r.expert.assign(tk, -1);
  r.score.assign(tk, 0.f);
  for (int64_t t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      const int64_t f = t * K + k;
      int32_t id = in.expert[f];
      if (id < -1 || id >= E) {
        r.flags |= smoe::kStatusInvalidExpertId;
        id = -1;
      }
      for (int j = 0; j < k && id >= 0; ++j)
        if (r.expert[t * K + j] == id) {
          r.flags |= smoe::kStatusDuplicateExpert;
          id = -1;
        }
      r.expert[f] = id;
      if (id >= 0) {
        r.score[f] = in.score[f];
        if (!std::isfinite(in.score[f])) r.flags |= smoe::kStatusNonFiniteScores;
      }
    }
  }
  auto key = [&](int64_t f) { return r.expert[f] < 0 ? E : r.expert[f]; };
  r.scatter.resize(tk);
  std::iota(r.scatter.begin(), r.scatter.end(), 0);
  std::stable_sort(r.scatter.begin(), r.scatter.end(), [&](int32_t a, int32_t b) { return key(a) < key(b); });
  r.frequency.assign(E, 0);
  for (int64_t f = 0; f < tk; ++f)
    if (r.expert[f] >= 0) ++r.frequency[r.expert[f]];
  r.offset.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) r.offset[e + 1] = r.offset[e] + r.frequency[e];
  const int64_t nnz = r.offset[E];
  r.reverse.assign(tk, -1);
  r.gather.assign(tk, 0);
  for (int64_t row = 0; row < nnz; ++row) {
    r.reverse[r.scatter[row]] = static_cast<int32_t>(row);
    r.gather[row] = r.scatter[row] / K;
  }
  r.token_offset.resize(T + 1);
  for (int64_t t = 0; t <= T; ++t) r.token_offset[t] = static_cast<int32_t>(t * K);
  return r;
}

void check_provided(const ProvidedCase& c) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(name_of(c) + " seed=" + std::to_string(seed));
  const ProvidedInput in = make_provided(c, seed);
  const smoe::RoutingProblem p{c.T, c.E, c.K, smoe::DType::kFloat32};
  GpuRouting g;
  allocate(&g, p, /*token_offset=*/true);
  DeviceBuffer<int32_t> expert(in.expert.size());
  DeviceBuffer<float> score(in.score.size());
  CUDA_OK(expert.upload(in.expert));
  CUDA_OK(score.upload(in.score));
  poison_all(&g);
  ASSERT_TRUE(smoe::reset_device_status(g.status.get(), 0).ok());
  const smoe::Status s = smoe::provided_routing(p, expert.get(), score.get(), g.outputs(), g.workspace.get(),
                                                g.workspace.bytes(), 0);
  ASSERT_TRUE(s.ok()) << s.message;
  CUDA_OK(cudaDeviceSynchronize());

  const ProvidedRef r = provided_ref(in, c.T, c.E, c.K);
  int64_t first = -1;
  EXPECT_EQ(count_mismatch(g.topk.download(), r.expert, &first), 0) << "topk_expert at " << first;
  const std::vector<float> sc = g.scores.download();
  EXPECT_EQ(std::memcmp(sc.data(), r.score.data(), sc.size() * sizeof(float)), 0) << "scores (bitwise)";
  EXPECT_EQ(count_mismatch(g.freq.download(), r.frequency, &first), 0) << "expert_frequency at " << first;
  EXPECT_EQ(count_mismatch(g.offset.download(), r.offset, &first), 0) << "expert_offset at " << first;
  EXPECT_EQ(count_mismatch(g.scatter.download(), r.scatter, &first), 0) << "scatter_idx at " << first;
  EXPECT_EQ(count_mismatch(g.reverse.download(), r.reverse, &first), 0) << "reverse_scatter_idx at " << first;
  EXPECT_EQ(count_mismatch(g.gather.download(), r.gather, &first), 0) << "gather_idx at " << first;
  EXPECT_EQ(count_mismatch(g.token_offset.download(), r.token_offset, &first), 0) << "token_offset at " << first;
  EXPECT_EQ(g.status.download()[0].flags, r.flags);
}

}  // namespace

TEST(GpuRouting, SmallShapesAllPatterns) {
  // E on both sides of every per-lane instance boundary (warp_topk.cuh: 1, 2, 4, 8, 16 logits a
  // lane for E <= 32, 64, 128, 256, 512): 32 | 33, 64 | 65, 128 | 129, 256 | 257.
  for (int64_t T : {1, 7, 129, 1000}) {
    for (int E : {8, 32, 33, 64, 65, 128, 129, 256, 257, 512}) {
      for (int K : {1, 2, 8, 16}) {
        if (K > E) continue;
        for (Pattern pat : {Pattern::kNormal, Pattern::kTies, Pattern::kHotExpert, Pattern::kHotSet}) {
          for (smoe::DType dt : {smoe::DType::kFloat32, smoe::DType::kBFloat16}) {
            check_case({T, E, K, dt, pat, /*token_offset=*/T != 1000});
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

// Shapes where the grouping's blocks and warp ranges meet awkward data: E not a power of two, T
// not a multiple of anything, one key for every entry (K = 1, hot expert) or K hot keys with the
// other experts empty, and T*K = 560000 entries over many blocks (~550).
TEST(GpuRouting, GroupingShapes) {
  using smoe::DType;
  check_case({4097, 3, 1, DType::kFloat32, Pattern::kNormal});
  check_case({4097, 100, 6, DType::kBFloat16, Pattern::kTies});
  check_case({4097, 1, 1, DType::kFloat32, Pattern::kNormal});
  check_case({70000, 512, 8, DType::kFloat32, Pattern::kNormal});
  check_case({70000, 200, 8, DType::kBFloat16, Pattern::kNormal, /*token_offset=*/false});
  check_case({70000, 8, 1, DType::kFloat32, Pattern::kHotExpert});
  check_case({70000, 511, 1, DType::kFloat32, Pattern::kHotExpert});
  check_case({70000, 512, 8, DType::kFloat32, Pattern::kHotSet});
  check_case({70000, 100, 16, DType::kBFloat16, Pattern::kHotSet});
}

TEST(GpuRouting, ProvidedGrouping) {
  const ProvidedCase cases[] = {
      {1, 1, 1, Slots::kRandom},         {1, 512, 16, Slots::kAllEmpty},
      {4097, 3, 1, Slots::kRandom},      {4097, 7, 2, Slots::kMostlyEmpty},
      {4097, 33, 3, Slots::kInvalid},    {1000, 257, 5, Slots::kInvalid},
      {129, 512, 16, Slots::kRandom},    {70000, 512, 8, Slots::kRandom},
      {70000, 512, 8, Slots::kMostlyEmpty}, {70000, 512, 8, Slots::kAllEmpty},
      {70000, 512, 8, Slots::kFewExperts},  {70000, 8, 1, Slots::kHotExpert},
      {70000, 100, 8, Slots::kHotExpert},   {100000, 512, 1, Slots::kHotExpert},
      {70000, 1, 1, Slots::kMostlyEmpty},
      // 4.8M entries: more than the grouping's 1024 blocks of 4 steps a warp hold, so ranges grow.
      {600000, 16, 8, Slots::kRandom},
  };
  for (const ProvidedCase& c : cases) check_provided(c);
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
  const auto g1 = g.gather.download();
  const auto o1 = g.offset.download();
  poison_all(&g);
  ASSERT_TRUE(run_routing(&g, p).ok());
  EXPECT_EQ(std::memcmp(s1.data(), g.scores.download().data(), s1.size() * 4), 0);
  EXPECT_EQ(t1, g.topk.download());
  EXPECT_EQ(sc1, g.scatter.download());
  EXPECT_EQ(r1, g.reverse.download());
  EXPECT_EQ(g1, g.gather.download());
  EXPECT_EQ(o1, g.offset.download());
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
  allocate(&g, p, /*token_offset=*/true);
  g.logits.reset(4);
  poison_all(&g);
  ASSERT_TRUE(run_routing(&g, p).ok());
  for (int32_t v : g.freq.download()) EXPECT_EQ(v, 0);
  for (int32_t v : g.offset.download()) EXPECT_EQ(v, 0);
  EXPECT_EQ(g.token_offset.download(), std::vector<int32_t>{0});
  // Provided routing takes the same path.
  poison_all(&g);
  ASSERT_TRUE(smoe::provided_routing(p, nullptr, nullptr, g.outputs(), g.workspace.get(), g.workspace.bytes(), 0).ok());
  for (int32_t v : g.freq.download()) EXPECT_EQ(v, 0);
  for (int32_t v : g.offset.download()) EXPECT_EQ(v, 0);
  EXPECT_EQ(g.token_offset.download(), std::vector<int32_t>{0});
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
