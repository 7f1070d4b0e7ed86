// GPU token rounding (SonicMoE "TR") against the float64 reference ref::token_rounding_ref and
// ref::routing_metadata_ref: the kept (token, expert) set and every index exact, scores to fp32
// rounding, every output element written (outputs poisoned first, tails past nnz checked),
// deterministic, the stochastic mode reproducible per seed, NaN/Inf recorded in the device status.
//
// Why exact comparison is meaningful: the library ranks tokens by the reference's own float64
// expressions computed from the same fp32 logits, so it can disagree with the reference only on two
// distinct tokens whose keys are within ~1e-16 relative. Random logits with spread (normal, sd 2)
// make that practically impossible; the tie patterns build their ties so that they are exact on both
// sides (duplicated token rows, equal top-K patterns) and reject base rows whose softmax values are
// merely close (see make_tie_rows).
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include "gpu/gpu_util.h"
#include "smoe/reference.h"
#include "smoe/smoe.h"
#include "test_seed.h"

using smoe_test::DeviceBuffer;
using smoe_test::fresh_seed;

namespace {

namespace R = smoe::ref;
using Mode = smoe::TokenRoundingMode;

enum class Pattern {
  kNormal,        // N(0, 2) logits
  kTies,          // every token copies one of a few integer rows in {0..3}: exact ties everywhere
  kHotExpert,     // +100 on expert E/3: every token picks it first; other softmax values ~1e-44
  kEmptyExperts,  // -100 on every expert e with e % 3 == 1: nobody picks them (unless K forces it)
  kAligned,       // K <= 2 hot experts per block of m_tile tokens: counts are multiples of m_tile
};

struct Case {
  int64_t T;
  int E;
  int K;
  int m_tile;
  Mode mode;
  uint64_t sr_seed;  // kStochastic only
  Pattern pattern;
  smoe::DType dtype = smoe::DType::kFloat32;
};

const char* mode_name(Mode m) {
  switch (m) {
    case Mode::kNearest: return "NR";
    case Mode::kUp: return "UP";
    case Mode::kDown: return "DOWN";
    case Mode::kStochastic: return "SR";
  }
  return "?";
}

const char* pattern_name(Pattern p) {
  switch (p) {
    case Pattern::kNormal: return "normal";
    case Pattern::kTies: return "ties";
    case Pattern::kHotExpert: return "hot";
    case Pattern::kEmptyExperts: return "empty";
    case Pattern::kAligned: return "aligned";
  }
  return "?";
}

std::string name_of(const Case& c) {
  std::ostringstream s;
  s << "T" << c.T << "_E" << c.E << "_K" << c.K << "_m" << c.m_tile << "_" << mode_name(c.mode);
  if (c.mode == Mode::kStochastic) s << "(seed " << c.sr_seed << ")";
  s << "_" << pattern_name(c.pattern) << (c.dtype == smoe::DType::kFloat32 ? "_f32" : "_bf16");
  return s.str();
}

R::RoundingMode ref_mode(Mode m) {
  switch (m) {
    case Mode::kNearest: return R::RoundingMode::kNearest;
    case Mode::kUp: return R::RoundingMode::kUp;
    case Mode::kDown: return R::RoundingMode::kDown;
    case Mode::kStochastic: return R::RoundingMode::kStochastic;
  }
  return R::RoundingMode::kNearest;
}

smoe::TokenRoundingProblem problem_of(const Case& c) {
  smoe::TokenRoundingProblem p;
  p.num_tokens = c.T;
  p.num_experts = c.E;
  p.top_k = c.K;
  p.m_tile = c.m_tile;
  p.mode = c.mode;
  p.seed = c.sr_seed;
  p.logits_dtype = c.dtype;
  return p;
}

// Softmax over a row and the top-K softmax scores by expert (-1 where not chosen), in float64 as the
// reference computes them.
void row_scores(const std::vector<double>& row, int K, std::vector<double>* S,
                std::vector<double>* chosen) {
  const int E = static_cast<int>(row.size());
  const R::TopKRouting r = R::topk_softmax_ref(row, 1, E, K);
  const double mx = *std::max_element(row.begin(), row.end());
  double sum = 0.0;
  for (double v : row) sum += std::exp(v - mx);
  S->resize(E);
  chosen->assign(E, -1.0);
  for (int e = 0; e < E; ++e) (*S)[e] = std::exp(row[e] - mx) / sum;
  for (int k = 0; k < K; ++k) (*chosen)[r.expert[k]] = r.score[k];
}

bool near_but_not_equal(double a, double b) {
  return a != b && std::fabs(a - b) <= 1e-9 * std::max(std::fabs(a), std::fabs(b));
}

// A few integer rows in {0..3} whose cross-row comparisons are unambiguous: any two rows either
// give bit-identical keys on both sides (equal values computed by the same expression from the same
// inputs) or keys far apart. Two rows whose shifted value multisets coincide have equal softmax
// values in exact arithmetic but sum them in different orders (float64 results may differ in the
// last bit on one side only), so such pairs are rejected, and so is any pair of values closer than
// 1e-9 relative.
std::vector<std::vector<double>> make_tie_rows(int E, int K, int count, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> small(0, 3);
  for (int attempt = 0;; ++attempt) {
    std::vector<std::vector<double>> rows(count, std::vector<double>(E));
    for (auto& r : rows)
      for (double& v : r) v = small(rng);
    bool ok = true;
    std::vector<std::vector<double>> S(count), C(count), shape(count);
    for (int i = 0; i < count; ++i) {
      row_scores(rows[i], K, &S[i], &C[i]);
      shape[i] = rows[i];
      const double mx = *std::max_element(shape[i].begin(), shape[i].end());
      for (double& v : shape[i]) v -= mx;
      std::sort(shape[i].begin(), shape[i].end());
    }
    for (int i = 0; i < count && ok; ++i)
      for (int j = i + 1; j < count && ok; ++j) {
        if (shape[i] == shape[j]) ok = false;
        for (int e = 0; e < E && ok; ++e) {
          if (near_but_not_equal(S[i][e], S[j][e])) ok = false;
          if (C[i][e] >= 0 && C[j][e] >= 0 && near_but_not_equal(C[i][e], C[j][e])) ok = false;
        }
      }
    if (ok || attempt > 1000) return rows;  // E = 8 with 5 rows succeeds within a few attempts
  }
}

// Logits as doubles holding exactly the values the GPU sees (fp32 or bf16-rounded).
std::vector<double> make_logits(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 2.0);
  std::vector<double> x(static_cast<size_t>(c.T) * c.E);
  if (c.pattern == Pattern::kTies) {
    const auto rows = make_tie_rows(c.E, c.K, 5, rng);
    std::uniform_int_distribution<int> pick(0, 4);
    for (int64_t t = 0; t < c.T; ++t) {
      const std::vector<double>& row = rows[pick(rng)];
      std::copy(row.begin(), row.end(), x.begin() + t * c.E);
    }
  } else {
    for (int64_t t = 0; t < c.T; ++t) {
      for (int e = 0; e < c.E; ++e) {
        double v = normal(rng);
        if (c.pattern == Pattern::kHotExpert && e == c.E / 3) v += 100.0;
        if (c.pattern == Pattern::kEmptyExperts && e % 3 == 1) v -= 100.0;
        if (c.pattern == Pattern::kAligned) {
          const int64_t block = t / c.m_tile;
          if (e == block % c.E) v += 50.0;
          if (c.K == 2 && e == (block + 1) % c.E) v += 40.0;
        }
        x[t * c.E + e] = v;
      }
    }
  }
  for (double& v : x) {
    v = c.dtype == smoe::DType::kFloat32
            ? static_cast<double>(static_cast<float>(v))
            : static_cast<double>(__bfloat162float(__float2bfloat16(static_cast<float>(v))));
  }
  return x;
}

struct GpuTR {
  DeviceBuffer<float> scores, topk_score;
  DeviceBuffer<int32_t> entry_expert, token_offset, topk_expert, freq, offset, scatter, reverse,
      gather;
  DeviceBuffer<smoe::DeviceStatus> status;
  DeviceBuffer<uint8_t> workspace, logits;
  int64_t cap = 0;

  smoe::TokenRoundingOutputs outputs() const {
    smoe::TokenRoundingOutputs o;
    o.scores = scores.get();
    o.entry_expert = entry_expert.get();
    o.token_offset = token_offset.get();
    o.topk_expert = topk_expert.get();
    o.topk_score = topk_score.get();
    o.expert_frequency = freq.get();
    o.expert_offset = offset.get();
    o.scatter_idx = scatter.get();
    o.reverse_scatter_idx = reverse.get();
    o.gather_idx = gather.get();
    o.status = status.get();
    return o;
  }
};

void allocate(GpuTR* g, const smoe::TokenRoundingProblem& p) {
  g->cap = smoe::token_rounding_capacity(p);
  const size_t cap = static_cast<size_t>(g->cap);
  const size_t tk = static_cast<size_t>(p.num_tokens) * p.top_k;
  g->scores.reset(cap);
  g->entry_expert.reset(cap);
  g->scatter.reset(cap);
  g->reverse.reset(cap);
  g->gather.reset(cap);
  g->token_offset.reset(static_cast<size_t>(p.num_tokens) + 1);
  g->topk_expert.reset(tk);
  g->topk_score.reset(tk);
  g->freq.reset(p.num_experts);
  g->offset.reset(p.num_experts + 1);
  g->status.reset(1);
  size_t ws = 0;
  const smoe::Status s = smoe::token_rounding_workspace_size(p, &ws);
  ASSERT_TRUE(s.ok()) << s.message;
  g->workspace.reset(ws);  // 0 bytes (null) for T = 0
}

void upload_logits(GpuTR* g, const std::vector<double>& x, smoe::DType dt) {
  if (dt == smoe::DType::kFloat32) {
    std::vector<float> f(x.begin(), x.end());
    g->logits.reset(std::max<size_t>(f.size() * 4, 4));
    CUDA_OK(cudaMemcpy(g->logits.get(), f.data(), f.size() * 4, cudaMemcpyHostToDevice));
  } else {
    std::vector<__nv_bfloat16> b(x.size());
    for (size_t i = 0; i < x.size(); ++i) b[i] = __float2bfloat16(static_cast<float>(x[i]));
    g->logits.reset(std::max<size_t>(b.size() * 2, 4));
    CUDA_OK(cudaMemcpy(g->logits.get(), b.data(), b.size() * 2, cudaMemcpyHostToDevice));
  }
}

void poison_all(GpuTR* g) {
  for (cudaError_t e : {g->scores.poison(), g->topk_score.poison(), g->entry_expert.poison(),
                        g->token_offset.poison(), g->topk_expert.poison(), g->freq.poison(),
                        g->offset.poison(), g->scatter.poison(), g->reverse.poison(),
                        g->gather.poison()})
    ASSERT_EQ(e, cudaSuccess);
}

smoe::Status run_tr(GpuTR* g, const smoe::TokenRoundingProblem& p) {
  return smoe::token_rounding_routing(p, g->logits.get(), g->outputs(), g->workspace.get(),
                                      g->workspace.bytes(), 0);
}

struct Result {
  std::vector<float> scores, topk_score;
  std::vector<int32_t> entry_expert, token_offset, topk_expert, freq, offset, scatter, reverse,
      gather;
  smoe::DeviceStatus status;
};

Result download(const GpuTR& g) {
  Result r;
  r.scores = g.scores.download();
  r.topk_score = g.topk_score.download();
  r.entry_expert = g.entry_expert.download();
  r.token_offset = g.token_offset.download();
  r.topk_expert = g.topk_expert.download();
  r.freq = g.freq.download();
  r.offset = g.offset.download();
  r.scatter = g.scatter.download();
  r.reverse = g.reverse.download();
  r.gather = g.gather.download();
  r.status = g.status.download()[0];
  return r;
}

// Fresh buffers, poisoned outputs, one call, everything downloaded.
Result run_case(const Case& c, const std::vector<double>& x) {
  const smoe::TokenRoundingProblem p = problem_of(c);
  GpuTR g;
  allocate(&g, p);
  upload_logits(&g, x, c.dtype);
  poison_all(&g);
  EXPECT_TRUE(smoe::reset_device_status(g.status.get(), 0).ok());
  const smoe::Status s = run_tr(&g, p);
  EXPECT_TRUE(s.ok()) << s.message;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return download(g);
}

template <typename A, typename B>
int64_t count_mismatch(const A* a, const B* b, int64_t n, int64_t* first) {
  int64_t bad = 0;
  *first = -1;
  for (int64_t i = 0; i < n; ++i)
    if (static_cast<int64_t>(a[i]) != static_cast<int64_t>(b[i])) {
      if (bad == 0) *first = i;
      ++bad;
    }
  return bad;
}

std::string list_of(const int32_t* p, int64_t n) {
  std::string s = "{";
  for (int64_t i = 0; i < n; ++i) s += (i ? "," : "") + std::to_string(p[i]);
  return s + "}";
}

double max_abs_error(const float* got, const double* want, int64_t n) {
  double m = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    m = std::isnan(d) ? INFINITY : std::max(m, d);
  }
  return m;
}

// Every output against the reference; returns the reference routing for further checks.
R::GeneralRouting expect_matches_reference(const Case& c, const std::vector<double>& x,
                                           const Result& r) {
  const R::TopKRouting topk = R::topk_softmax_ref(x, c.T, c.E, c.K);
  const R::GeneralRouting g =
      R::token_rounding_ref(x, c.T, c.E, c.K, c.m_tile, ref_mode(c.mode), c.sr_seed);
  const R::RoutingMetadata m = R::routing_metadata_ref(g);
  const int64_t nnz = g.nnz();
  const int64_t cap = smoe::token_rounding_capacity(problem_of(c));
  int64_t first = -1;

  EXPECT_LE(nnz, cap) << "the reference exceeds the documented capacity";
  EXPECT_EQ(count_mismatch(r.topk_expert.data(), topk.expert.data(), c.T * c.K, &first), 0)
      << "topk_expert, first bad entry " << first;
  EXPECT_LE(max_abs_error(r.topk_score.data(), topk.score.data(), c.T * c.K), 2e-6) << "topk_score";

  // The kept set, token by token (the most readable report of a selection difference).
  EXPECT_EQ(count_mismatch(r.token_offset.data(), g.token_offset.data(), c.T + 1, &first), 0)
      << "token_offset at " << first;
  if (nnz <= cap && static_cast<int64_t>(r.token_offset.size()) == c.T + 1 &&
      r.token_offset[c.T] == nnz) {
    for (int64_t t = 0; t < c.T; ++t) {
      const int64_t a = g.token_offset[t], b = g.token_offset[t + 1];
      const int64_t ga = std::clamp<int64_t>(r.token_offset[t], 0, nnz);
      const int64_t gb = std::clamp<int64_t>(r.token_offset[t + 1], ga, nnz);
      if (gb - ga != b - a ||
          !std::equal(g.expert.begin() + a, g.expert.begin() + b, r.entry_expert.begin() + ga)) {
        ADD_FAILURE() << "token " << t << ": experts " << list_of(r.entry_expert.data() + ga, gb - ga)
                      << ", reference " << list_of(g.expert.data() + a, b - a);
        break;
      }
    }
  }
  if (nnz > cap) return g;

  EXPECT_EQ(count_mismatch(r.entry_expert.data(), g.expert.data(), nnz, &first), 0)
      << "entry_expert at " << first;
  EXPECT_LE(max_abs_error(r.scores.data(), g.score.data(), nnz), 2e-6) << "scores";
  EXPECT_EQ(count_mismatch(r.freq.data(), m.expert_frequency.data(), c.E, &first), 0)
      << "expert_frequency at " << first;
  EXPECT_EQ(count_mismatch(r.offset.data(), m.expert_offset.data(), c.E + 1, &first), 0)
      << "expert_offset at " << first;
  EXPECT_EQ(count_mismatch(r.scatter.data(), m.scatter_idx.data(), nnz, &first), 0)
      << "scatter_idx at " << first;
  EXPECT_EQ(count_mismatch(r.reverse.data(), m.reverse_scatter_idx.data(), nnz, &first), 0)
      << "reverse_scatter_idx at " << first;
  EXPECT_EQ(count_mismatch(r.gather.data(), m.gather_idx.data(), nnz, &first), 0)
      << "gather_idx at " << first;

  // Past nnz: the documented unused values (the buffers were poisoned with 0xFF).
  int64_t bad_tail = 0;
  for (int64_t i = nnz; i < cap; ++i) {
    uint32_t score_bits;
    std::memcpy(&score_bits, &r.scores[i], 4);
    if (r.entry_expert[i] != -1 || r.scatter[i] != -1 || r.reverse[i] != -1 || r.gather[i] != 0 ||
        score_bits != 0u) {
      if (bad_tail == 0)
        ADD_FAILURE() << "unused element " << i << " (nnz " << nnz << ", cap " << cap
                      << "): entry_expert " << r.entry_expert[i] << ", scatter " << r.scatter[i]
                      << ", reverse " << r.reverse[i] << ", gather " << r.gather[i] << ", score "
                      << r.scores[i];
      ++bad_tail;
    }
  }
  EXPECT_EQ(bad_tail, 0) << "unused elements past nnz";

  EXPECT_EQ(r.status.flags, 0u);
  EXPECT_EQ(r.status.nonfinite_tokens, 0u);
  EXPECT_EQ(r.status.first_nonfinite_token, INT64_MAX);
  return g;
}

void check_case(const Case& c) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(name_of(c) + " seed=" + std::to_string(seed));
  const std::vector<double> x = make_logits(c, seed);
  const Result r = run_case(c, x);
  expect_matches_reference(c, x, r);
}

// Every mode, with two stochastic seeds.
std::vector<std::pair<Mode, uint64_t>> all_modes() {
  std::mt19937_64 rng(fresh_seed());
  return {{Mode::kNearest, 0}, {Mode::kUp, 0}, {Mode::kDown, 0}, {Mode::kStochastic, rng()},
          {Mode::kStochastic, rng()}};
}

bool bitwise_equal(const Result& a, const Result& b) {
  auto same = [](const auto& x, const auto& y) {
    return x.size() == y.size() &&
           (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0);
  };
  return same(a.scores, b.scores) && same(a.topk_score, b.topk_score) &&
         same(a.entry_expert, b.entry_expert) && same(a.token_offset, b.token_offset) &&
         same(a.topk_expert, b.topk_expert) && same(a.freq, b.freq) && same(a.offset, b.offset) &&
         same(a.scatter, b.scatter) && same(a.reverse, b.reverse) && same(a.gather, b.gather);
}

}  // namespace

TEST(GpuTokenRounding, SmallShapesEveryModeAndPattern) {
  for (int64_t T : {1, 37, 300}) {
    // One E per top-K instance of warp_topk.cuh (1, 2, 4, 8, 16 logits a lane), 200 for the 8.
    for (int E : {8, 64, 128, 200, 512}) {
      for (int K : {1, 2, 8}) {
        for (int m : {1, 16, 128}) {
          for (Pattern pat :
               {Pattern::kNormal, Pattern::kTies, Pattern::kHotExpert, Pattern::kEmptyExperts}) {
            for (const auto& mode : all_modes()) {
              // m_tile = 1 rounds nothing: one mode is enough there.
              if (m == 1 && mode.first != Mode::kNearest) continue;
              check_case({T, E, K, m, mode.first, mode.second, pat});
            }
          }
        }
      }
    }
  }
}

TEST(GpuTokenRounding, ThousandsOfTokens) {
  const Pattern patterns[] = {Pattern::kNormal, Pattern::kTies, Pattern::kHotExpert,
                              Pattern::kEmptyExperts};
  int i = 0;
  for (int E : {8, 64, 128, 512}) {
    for (int m : {16, 128}) {
      for (const auto& mode : all_modes()) {
        const int K = (i % 3 == 0) ? 1 : (i % 3 == 1) ? 2 : 8;
        check_case({4096, E, K, m, mode.first, mode.second, Pattern::kNormal});
        check_case({4096, E, 8, m, mode.first, mode.second, patterns[1 + i % 3]});
        ++i;
      }
    }
  }
  // Larger: a transformer-sized router.
  check_case({16384, 512, 8, 128, Mode::kNearest, 0, Pattern::kNormal});
  check_case({16384, 128, 8, 128, Mode::kStochastic, fresh_seed(), Pattern::kNormal});
}

TEST(GpuTokenRounding, Bf16Logits) {
  // bf16 logits repeat values, so top-K score ties between different tokens are frequent and exact.
  for (const auto& mode : all_modes()) {
    check_case({300, 64, 2, 16, mode.first, mode.second, Pattern::kNormal, smoe::DType::kBFloat16});
    check_case({4096, 128, 8, 128, mode.first, mode.second, Pattern::kNormal, smoe::DType::kBFloat16});
  }
}

// Counts already multiples of the tile: every mode keeps exactly the top-K routing.
TEST(GpuTokenRounding, AlignedCountsKeepTheTopK) {
  for (int m : {16, 128}) {
    for (int E : {8, 64}) {
      for (int K : {1, 2}) {
        for (const auto& mode : all_modes()) {
          const Case c{static_cast<int64_t>(m) * 37, E, K, m, mode.first, mode.second,
                       Pattern::kAligned};
          const uint64_t seed = fresh_seed();
          SCOPED_TRACE(name_of(c) + " seed=" + std::to_string(seed));
          const std::vector<double> x = make_logits(c, seed);
          const Result r = run_case(c, x);
          const R::GeneralRouting g = expect_matches_reference(c, x, r);
          ASSERT_EQ(g.nnz(), c.T * c.K) << "test setup: counts must be multiples of m_tile";
          const R::TopKRouting topk = R::topk_softmax_ref(x, c.T, c.E, c.K);
          for (int64_t t = 0; t < c.T; ++t) {
            std::vector<int32_t> want(topk.expert.begin() + t * c.K, topk.expert.begin() + (t + 1) * c.K);
            std::sort(want.begin(), want.end());
            ASSERT_EQ(r.token_offset[t], t * c.K);
            const std::vector<int32_t> got(r.entry_expert.begin() + t * c.K,
                                           r.entry_expert.begin() + (t + 1) * c.K);
            ASSERT_EQ(got, want) << "token " << t;
          }
        }
      }
    }
  }
}

TEST(GpuTokenRounding, ZeroTokens) {
  for (Mode mode : {Mode::kNearest, Mode::kDown}) {
    const Case c{0, 32, 4, 128, mode, 0, Pattern::kNormal};
    const smoe::TokenRoundingProblem p = problem_of(c);
    EXPECT_EQ(smoe::token_rounding_capacity(p), 0);
    GpuTR g;
    allocate(&g, p);
    EXPECT_EQ(g.workspace.bytes(), 0u);
    g.logits.reset(4);
    poison_all(&g);
    ASSERT_TRUE(smoe::reset_device_status(g.status.get(), 0).ok());
    const smoe::Status s = run_tr(&g, p);  // null [cap] arrays and workspace are fine with T = 0
    ASSERT_TRUE(s.ok()) << s.message;
    CUDA_OK(cudaDeviceSynchronize());
    for (int32_t v : g.freq.download()) EXPECT_EQ(v, 0);
    for (int32_t v : g.offset.download()) EXPECT_EQ(v, 0);
    EXPECT_EQ(g.token_offset.download(), std::vector<int32_t>{0});
  }
}

TEST(GpuTokenRounding, Deterministic) {
  for (Pattern pat : {Pattern::kNormal, Pattern::kTies}) {
    const Case c{32768, 128, 8, 128, Mode::kStochastic, fresh_seed(), pat};
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(name_of(c) + " seed=" + std::to_string(seed));
    const std::vector<double> x = make_logits(c, seed);
    const smoe::TokenRoundingProblem p = problem_of(c);
    GpuTR g;
    allocate(&g, p);
    upload_logits(&g, x, c.dtype);
    poison_all(&g);
    ASSERT_TRUE(smoe::reset_device_status(g.status.get(), 0).ok());
    ASSERT_TRUE(run_tr(&g, p).ok());
    CUDA_OK(cudaDeviceSynchronize());
    const Result first = download(g);
    // The same workspace again, and a dirty one: the workspace holds no state between calls.
    poison_all(&g);
    CUDA_OK(cudaMemset(g.workspace.get(), 0x5A, g.workspace.bytes()));
    ASSERT_TRUE(run_tr(&g, p).ok());
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_TRUE(bitwise_equal(first, download(g))) << "two runs differ";
    expect_matches_reference(c, x, first);
  }
}

// SR draws per (seed, expert): a case with many partial tiles rounds differently for two seeds, and
// each seed's result is the reference's.
TEST(GpuTokenRounding, StochasticDependsOnSeed) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const uint64_t s1 = rng(), s2 = rng();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  // ~128 +- 11 tokens per expert and a tile of 16: f mod 16 is close to uniform, so an expert
  // rounds up with a probability p spread over (0, 1), and two independent seeds agree on it with
  // probability 1 - 2p(1-p) (2/3 on average): all 64 experts agree with probability ~(2/3)^64.
  const Case c1{4096, 64, 2, 16, Mode::kStochastic, s1, Pattern::kNormal};
  const Case c2{4096, 64, 2, 16, Mode::kStochastic, s2, Pattern::kNormal};
  const std::vector<double> x = make_logits(c1, seed);
  const Result r1 = run_case(c1, x);
  const Result r2 = run_case(c2, x);
  {
    SCOPED_TRACE("sr seed 1");
    expect_matches_reference(c1, x, r1);
  }
  {
    SCOPED_TRACE("sr seed 2");
    expect_matches_reference(c2, x, r2);
  }
  int partial = 0;
  const R::TopKRouting topk = R::topk_softmax_ref(x, c1.T, c1.E, c1.K);
  std::vector<int64_t> f(c1.E, 0);
  for (int32_t e : topk.expert) ++f[e];
  for (int64_t v : f) partial += (v % c1.m_tile) != 0;
  ASSERT_GE(partial, 32) << "test setup: expected many partial tiles";
  EXPECT_NE(r1.freq, r2.freq) << "two seeds rounded every expert the same way";
}

// The top-K outputs are those of topk_routing, bit for bit (same kernel code).
TEST(GpuTokenRounding, TopKMatchesTopKRouting) {
  const Case c{1000, 128, 8, 128, Mode::kNearest, 0, Pattern::kNormal};
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  const std::vector<double> x = make_logits(c, seed);
  const Result r = run_case(c, x);

  const smoe::RoutingProblem rp{c.T, c.E, c.K, c.dtype};
  DeviceBuffer<float> scores(c.T * c.K);
  DeviceBuffer<int32_t> topk(c.T * c.K), freq(c.E), offset(c.E + 1), scatter(c.T * c.K),
      reverse(c.T * c.K), gather(c.T * c.K);
  DeviceBuffer<smoe::DeviceStatus> status(1);
  DeviceBuffer<uint8_t> ws(std::max<size_t>(smoe::routing_workspace_size(rp), 1));
  GpuTR g;
  upload_logits(&g, x, c.dtype);
  smoe::RoutingOutputs o;
  o.scores = scores.get();
  o.topk_expert = topk.get();
  o.expert_frequency = freq.get();
  o.expert_offset = offset.get();
  o.scatter_idx = scatter.get();
  o.reverse_scatter_idx = reverse.get();
  o.gather_idx = gather.get();
  o.status = status.get();
  ASSERT_TRUE(smoe::reset_device_status(status.get(), 0).ok());
  const smoe::Status s = smoe::topk_routing(rp, g.logits.get(), o, ws.get(), ws.bytes(), 0);
  ASSERT_TRUE(s.ok()) << s.message;
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(r.topk_expert, topk.download());
  const std::vector<float> sc = scores.download();
  ASSERT_EQ(sc.size(), r.topk_score.size());
  EXPECT_EQ(std::memcmp(sc.data(), r.topk_score.data(), sc.size() * 4), 0);
}

TEST(GpuTokenRounding, NonFiniteLogitsAreRecorded) {
  const Case c{64, 64, 4, 16, Mode::kUp, 0, Pattern::kNormal};
  std::vector<double> x = make_logits(c, fresh_seed());
  x[5 * 64 + 3] = std::nan("");
  x[9 * 64 + 7] = INFINITY;
  x[20 * 64 + 1] = -INFINITY;
  const smoe::TokenRoundingProblem p = problem_of(c);
  GpuTR g;
  allocate(&g, p);
  upload_logits(&g, x, c.dtype);
  poison_all(&g);
  ASSERT_TRUE(smoe::reset_device_status(g.status.get(), 0).ok());
  ASSERT_TRUE(run_tr(&g, p).ok());
  CUDA_OK(cudaDeviceSynchronize());
  const Result r = download(g);
  EXPECT_EQ(r.status.flags & smoe::kStatusNonFiniteLogits, smoe::kStatusNonFiniteLogits);
  EXPECT_EQ(r.status.nonfinite_tokens, 3u);
  EXPECT_EQ(r.status.first_nonfinite_token, 5);
  for (int k = 0; k < c.K; ++k) EXPECT_NE(r.topk_expert[5 * c.K + k], 3) << "NaN ranks last";
  // Whatever the scores of the bad tokens, the output stays a well-formed routing.
  const int32_t nnz = r.offset[c.E];
  ASSERT_GE(nnz, 0);
  ASSERT_LE(nnz, g.cap);
  EXPECT_EQ(r.token_offset[0], 0);
  EXPECT_EQ(r.token_offset[c.T], nnz);
  int64_t sum = 0;
  for (int e = 0; e < c.E; ++e) {
    EXPECT_EQ(r.offset[e], sum);
    EXPECT_TRUE(r.freq[e] % c.m_tile == 0 || r.freq[e] == c.T) << "expert " << e;
    sum += r.freq[e];
  }
  for (int64_t t = 0; t < c.T; ++t)
    for (int32_t j = r.token_offset[t]; j < r.token_offset[t + 1]; ++j) {
      if (j > r.token_offset[t]) EXPECT_LT(r.entry_expert[j - 1], r.entry_expert[j]);
      EXPECT_EQ(r.scatter[r.reverse[j]], j);
      EXPECT_EQ(r.gather[r.reverse[j]], t);
    }
}

TEST(GpuTokenRounding, WorkspaceTooSmallWritesNothing) {
  const Case c{300, 64, 4, 16, Mode::kUp, 0, Pattern::kNormal};
  const smoe::TokenRoundingProblem p = problem_of(c);
  GpuTR g;
  allocate(&g, p);
  upload_logits(&g, make_logits(c, fresh_seed()), c.dtype);
  poison_all(&g);
  const size_t need = g.workspace.bytes();
  ASSERT_GT(need, 0u);
  const smoe::Status s = smoe::token_rounding_routing(p, g.logits.get(), g.outputs(),
                                                      g.workspace.get(), need - 1, 0);
  EXPECT_EQ(s.code, smoe::StatusCode::kWorkspaceTooSmall);
  EXPECT_NE(s.message.find("workspace_bytes"), std::string::npos) << s.message;
  CUDA_OK(cudaDeviceSynchronize());
  for (int32_t v : g.topk_expert.download()) ASSERT_EQ(v, -1) << "nothing may run after a rejected call";
  for (int32_t v : g.freq.download()) ASSERT_EQ(v, -1) << "nothing may run after a rejected call";
}
