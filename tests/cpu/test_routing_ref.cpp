// Tests of the float64 reference routing: top-K softmax, routing metadata, router backward, rel_l2.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "smoe/reference.h"
#include "test_seed.h"

using namespace smoe::ref;

namespace {

using smoe_test::fresh_seed;
using smoe_test::Rng;

std::vector<double> full_softmax(const std::vector<double>& logits, int64_t t, int E) {
  std::vector<double> p(static_cast<size_t>(E));
  double mx = -std::numeric_limits<double>::infinity();
  for (int e = 0; e < E; ++e) mx = std::max(mx, logits[t * E + e]);
  double sum = 0.0;
  for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(logits[t * E + e] - mx));
  for (auto& v : p) v /= sum;
  return p;
}

// Checks the top-K ordering rule for every token: chosen experts by descending logit, equal logits
// by ascending index, and every non-chosen expert ranks after the last chosen one.
void expect_topk_order(const std::vector<double>& logits, const TopKRouting& r) {
  const int E = r.E, K = r.K;
  auto before = [&](int64_t t, int a, int b) {  // does a rank strictly before b?
    const double la = logits[t * E + a], lb = logits[t * E + b];
    return la > lb || (la == lb && a < b);
  };
  for (int64_t t = 0; t < r.T; ++t) {
    std::set<int> chosen;
    for (int k = 0; k < K; ++k) {
      const int e = r.expert[t * K + k];
      ASSERT_GE(e, 0);
      ASSERT_LT(e, E);
      EXPECT_TRUE(chosen.insert(e).second) << "token " << t << " lists expert " << e << " twice";
      if (k > 0) { EXPECT_TRUE(before(t, r.expert[t * K + k - 1], e)) << "token " << t << " k " << k; }
    }
    const int last = r.expert[t * K + K - 1];
    for (int e = 0; e < E; ++e)
      if (!chosen.count(e)) { EXPECT_TRUE(before(t, last, e)) << "token " << t << " expert " << e; }
  }
}

void expect_metadata_valid(const GeneralRouting& r, const RoutingMetadata& m) {
  const int64_t nnz = r.nnz();
  ASSERT_EQ(m.expert_frequency.size(), static_cast<size_t>(r.E));
  ASSERT_EQ(m.expert_offset.size(), static_cast<size_t>(r.E + 1));
  ASSERT_EQ(m.scatter_idx.size(), static_cast<size_t>(nnz));
  ASSERT_EQ(m.reverse_scatter_idx.size(), static_cast<size_t>(nnz));
  ASSERT_EQ(m.gather_idx.size(), static_cast<size_t>(nnz));

  // Frequencies are the histogram of the entries' experts.
  std::vector<int32_t> hist(static_cast<size_t>(r.E), 0);
  for (int64_t j = 0; j < nnz; ++j) hist[r.expert[j]] += 1;
  EXPECT_EQ(m.expert_frequency, hist);

  // Offsets: exclusive prefix sum.
  EXPECT_EQ(m.expert_offset[0], 0);
  for (int e = 0; e < r.E; ++e)
    EXPECT_EQ(m.expert_offset[e + 1], m.expert_offset[e] + m.expert_frequency[e]);
  EXPECT_EQ(m.expert_offset[r.E], nnz);

  // scatter is a permutation of [0, nnz); reverse is its inverse.
  std::vector<int32_t> sorted = m.scatter_idx;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < nnz; ++i) ASSERT_EQ(sorted[i], i) << "scatter_idx is not a permutation";
  for (int64_t row = 0; row < nnz; ++row) EXPECT_EQ(m.reverse_scatter_idx[m.scatter_idx[row]], row);
  for (int64_t j = 0; j < nnz; ++j) EXPECT_EQ(m.scatter_idx[m.reverse_scatter_idx[j]], j);

  // Grouped rows: expert segments, entry index strictly ascending within a segment (stable).
  for (int e = 0; e < r.E; ++e)
    for (int64_t row = m.expert_offset[e]; row < m.expert_offset[e + 1]; ++row) {
      EXPECT_EQ(r.expert[m.scatter_idx[row]], e) << "row " << row;
      if (row > m.expert_offset[e]) { EXPECT_LT(m.scatter_idx[row - 1], m.scatter_idx[row]); }
    }

  // gather: token of the entry.
  for (int64_t t = 0; t < r.T; ++t)
    for (int64_t j = r.token_offset[t]; j < r.token_offset[t + 1]; ++j)
      EXPECT_EQ(m.gather_idx[m.reverse_scatter_idx[j]], t);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Top-K softmax
// ---------------------------------------------------------------------------------------------

TEST(TopKSoftmaxRef, HandComputedSmallCase) {
  // token 0: logits (1, 3, 2, -1) -> experts 1, 2; scores softmax(3, 2).
  // token 1: logits (0.5, 0.5, 2, 0.5) -> expert 2, then the tie among 0, 1, 3 goes to 0.
  const std::vector<double> logits = {1.0, 3.0, 2.0, -1.0, 0.5, 0.5, 2.0, 0.5};
  const TopKRouting r = topk_softmax_ref(logits, 2, 4, 2);
  EXPECT_EQ(r.T, 2);
  EXPECT_EQ(r.E, 4);
  EXPECT_EQ(r.K, 2);
  EXPECT_EQ(r.expert, (std::vector<int32_t>{1, 2, 2, 0}));
  const double a = 1.0 / (1.0 + std::exp(-1.0));  // e^3 / (e^3 + e^2)
  const double b = 1.0 / (1.0 + std::exp(-1.5));  // e^2 / (e^2 + e^0.5)
  ASSERT_EQ(r.score.size(), 4u);
  EXPECT_NEAR(r.score[0], a, 1e-15);
  EXPECT_NEAR(r.score[1], 1.0 - a, 1e-15);
  EXPECT_NEAR(r.score[2], b, 1e-15);
  EXPECT_NEAR(r.score[3], 1.0 - b, 1e-15);
}

TEST(TopKSoftmaxRef, TiesGoToLowerExpertIndex) {
  Rng rng;
  TRACE_SEED(rng);
  // All logits equal: experts 0..K-1, scores 1/K.
  {
    const int E = 6, K = 3;
    const double v = rng.normal();
    const std::vector<double> logits(static_cast<size_t>(E), v);
    const TopKRouting r = topk_softmax_ref(logits, 1, E, K);
    EXPECT_EQ(r.expert, (std::vector<int32_t>{0, 1, 2}));
    for (double s : r.score) EXPECT_NEAR(s, 1.0 / 3.0, 1e-15);
  }
  // Random logits drawn from a few values, so that ties are everywhere.
  const int64_t T = 64;
  const int E = 8;
  const std::vector<double> values = {rng.normal(), rng.normal(), rng.normal()};
  std::vector<double> logits(static_cast<size_t>(T * E));
  for (auto& l : logits) l = values[rng.uniform_int(0, 2)];
  for (int K : {1, 2, 3, 5, 8}) {
    SCOPED_TRACE(::testing::Message() << "K=" << K);
    const TopKRouting r = topk_softmax_ref(logits, T, E, K);
    expect_topk_order(logits, r);
    // Equal logits within the chosen get equal scores.
    for (int64_t t = 0; t < T; ++t)
      for (int k = 1; k < K; ++k)
        if (logits[t * E + r.expert[t * K + k]] == logits[t * E + r.expert[t * K + k - 1]]) {
          EXPECT_EQ(r.score[t * K + k], r.score[t * K + k - 1]);
        }
  }
}

TEST(TopKSoftmaxRef, ScoresSumToOneAndEqualRenormalisedSoftmax) {
  Rng rng;
  TRACE_SEED(rng);
  const int64_t T = 48;
  const int E = 8;
  const std::vector<double> logits = rng.normals(T * E, 3.0);
  for (int K : {1, 2, 4, 7, 8}) {
    SCOPED_TRACE(::testing::Message() << "K=" << K);
    const TopKRouting r = topk_softmax_ref(logits, T, E, K);
    ASSERT_EQ(r.expert.size(), static_cast<size_t>(T * K));
    ASSERT_EQ(r.score.size(), static_cast<size_t>(T * K));
    expect_topk_order(logits, r);
    for (int64_t t = 0; t < T; ++t) {
      const std::vector<double> p = full_softmax(logits, t, E);
      double psum = 0.0, ssum = 0.0;
      for (int k = 0; k < K; ++k) {
        psum += p[r.expert[t * K + k]];
        ssum += r.score[t * K + k];
      }
      EXPECT_NEAR(ssum, 1.0, 1e-14);
      for (int k = 0; k < K; ++k) {
        EXPECT_GT(r.score[t * K + k], 0.0);
        EXPECT_NEAR(r.score[t * K + k], p[r.expert[t * K + k]] / psum, 1e-14);
        if (k > 0) { EXPECT_GE(r.score[t * K + k - 1], r.score[t * K + k]); }
      }
    }
  }
}

TEST(TopKSoftmaxRef, NumericallyStableForLargeLogits) {
  Rng rng;
  TRACE_SEED(rng);
  const int64_t T = 16;
  const int E = 6, K = 3;
  std::vector<double> logits = rng.normals(T * E);
  const TopKRouting base = topk_softmax_ref(logits, T, E, K);
  for (auto& l : logits) l += 1000.0;  // exp(1000) overflows without the max subtraction
  const TopKRouting shifted = topk_softmax_ref(logits, T, E, K);
  EXPECT_EQ(shifted.expert, base.expert);
  EXPECT_LT(rel_l2(shifted.score, base.score), 1e-12);
}

TEST(TopKSoftmaxRef, KOneGivesScoreExactlyOne) {
  Rng rng;
  TRACE_SEED(rng);
  const int64_t T = 64;
  const int E = 8;
  const std::vector<double> logits = rng.normals(T * E, 2.0);
  const TopKRouting r = topk_softmax_ref(logits, T, E, 1);
  for (int64_t t = 0; t < T; ++t) {
    const int argmax = static_cast<int>(
        std::max_element(logits.begin() + t * E, logits.begin() + (t + 1) * E) - (logits.begin() + t * E));
    EXPECT_EQ(r.expert[t], argmax);
    EXPECT_EQ(r.score[t], 1.0);
  }
}

TEST(TopKSoftmaxRef, KEqualsEIsFullSoftmaxInDescendingOrder) {
  Rng rng;
  TRACE_SEED(rng);
  const int64_t T = 32;
  const int E = 5;
  const std::vector<double> logits = rng.normals(T * E, 2.0);
  const TopKRouting r = topk_softmax_ref(logits, T, E, E);
  expect_topk_order(logits, r);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> ex(r.expert.begin() + t * E, r.expert.begin() + (t + 1) * E);
    std::sort(ex.begin(), ex.end());
    for (int e = 0; e < E; ++e) EXPECT_EQ(ex[e], e);
    const std::vector<double> p = full_softmax(logits, t, E);
    for (int k = 0; k < E; ++k) EXPECT_NEAR(r.score[t * E + k], p[r.expert[t * E + k]], 1e-14);
  }
}

TEST(TopKSoftmaxRef, RejectsBadShapes) {
  const std::vector<double> logits(8, 0.5);
  EXPECT_THROW(topk_softmax_ref(logits, 2, 4, 0), std::invalid_argument);
  EXPECT_THROW(topk_softmax_ref(logits, 2, 4, 5), std::invalid_argument);
  EXPECT_THROW(topk_softmax_ref(logits, 3, 4, 2), std::invalid_argument);
}

TEST(ToGeneralRef, SameEntriesWithOffsets) {
  Rng rng;
  TRACE_SEED(rng);
  const int64_t T = 20;
  const int E = 6, K = 3;
  const TopKRouting r = topk_softmax_ref(rng.normals(T * E), T, E, K);
  const GeneralRouting g = to_general(r);
  EXPECT_EQ(g.T, T);
  EXPECT_EQ(g.E, E);
  ASSERT_EQ(g.token_offset.size(), static_cast<size_t>(T + 1));
  for (int64_t t = 0; t <= T; ++t) EXPECT_EQ(g.token_offset[t], t * K);
  EXPECT_EQ(g.nnz(), T * K);
  EXPECT_EQ(g.expert, r.expert);
  EXPECT_EQ(g.score, r.score);
}

// ---------------------------------------------------------------------------------------------
// Routing metadata
// ---------------------------------------------------------------------------------------------

TEST(RoutingMetadataRef, TopKInvariants) {
  Rng rng;
  TRACE_SEED(rng);
  const int64_t T = 64;
  const int E = 8;
  for (int K : {1, 2, 3, 8}) {
    SCOPED_TRACE(::testing::Message() << "K=" << K);
    const TopKRouting r = topk_softmax_ref(rng.normals(T * E), T, E, K);
    const GeneralRouting g = to_general(r);
    const RoutingMetadata m = routing_metadata_ref(g);
    expect_metadata_valid(g, m);
    for (int64_t row = 0; row < T * K; ++row) EXPECT_EQ(m.gather_idx[row], m.scatter_idx[row] / K);
  }
}

TEST(RoutingMetadataRef, HandComputedSmallCase) {
  // T=3, K=2: entries (t*K+k) -> experts {2,0, 0,1, 2,1}.
  TopKRouting r;
  r.T = 3;
  r.E = 4;
  r.K = 2;
  r.expert = {2, 0, 0, 1, 2, 1};
  r.score = {0.6, 0.4, 0.7, 0.3, 0.9, 0.1};
  const RoutingMetadata m = routing_metadata_ref(to_general(r));
  EXPECT_EQ(m.expert_frequency, (std::vector<int32_t>{2, 2, 2, 0}));
  EXPECT_EQ(m.expert_offset, (std::vector<int64_t>{0, 2, 4, 6, 6}));
  EXPECT_EQ(m.scatter_idx, (std::vector<int32_t>{1, 2, 3, 5, 0, 4}));
  EXPECT_EQ(m.reverse_scatter_idx, (std::vector<int32_t>{4, 0, 1, 2, 5, 3}));
  EXPECT_EQ(m.gather_idx, (std::vector<int32_t>{0, 1, 1, 2, 0, 2}));
}

TEST(RoutingMetadataRef, GeneralRoutingWithVariableCounts) {
  Rng rng;
  TRACE_SEED(rng);
  const int64_t T = 40;
  const int E = 7;
  GeneralRouting g;
  g.T = T;
  g.E = E;
  g.token_offset.push_back(0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> ex(E);
    std::iota(ex.begin(), ex.end(), 0);
    std::shuffle(ex.begin(), ex.end(), rng.gen);
    const int cnt = rng.uniform_int(0, E);  // some tokens have no entry at all
    ex.resize(cnt);
    std::sort(ex.begin(), ex.end());
    for (int32_t e : ex) {
      g.expert.push_back(e);
      g.score.push_back(std::abs(rng.normal()));
    }
    g.token_offset.push_back(static_cast<int64_t>(g.expert.size()));
  }
  const RoutingMetadata m = routing_metadata_ref(g);
  expect_metadata_valid(g, m);
}

TEST(RoutingMetadataRef, EmptyExperts) {
  Rng rng;
  TRACE_SEED(rng);
  // Only experts 1 and 4 (of 6) can win: the others get a large negative logit.
  const int64_t T = 30;
  const int E = 6, K = 2;
  std::vector<double> logits = rng.normals(T * E);
  for (int64_t t = 0; t < T; ++t)
    for (int e : {0, 2, 3, 5}) logits[t * E + e] -= 100.0;
  const GeneralRouting g = to_general(topk_softmax_ref(logits, T, E, K));
  const RoutingMetadata m = routing_metadata_ref(g);
  expect_metadata_valid(g, m);
  EXPECT_EQ(m.expert_frequency, (std::vector<int32_t>{0, 30, 0, 0, 30, 0}));
  EXPECT_EQ(m.expert_offset, (std::vector<int64_t>{0, 0, 30, 30, 30, 60, 60}));
  for (int64_t row = 0; row < 60; ++row) EXPECT_EQ(m.gather_idx[row], m.scatter_idx[row] / K);

  // No entries at all (T = 0).
  const GeneralRouting empty = to_general(topk_softmax_ref({}, 0, E, K));
  const RoutingMetadata me = routing_metadata_ref(empty);
  EXPECT_EQ(me.expert_offset, std::vector<int64_t>(E + 1, 0));
  EXPECT_TRUE(me.scatter_idx.empty());
}

TEST(RoutingMetadataRef, OneExpertReceivesEveryToken) {
  Rng rng;
  TRACE_SEED(rng);
  const int64_t T = 50;
  const int E = 5, K = 1;
  std::vector<double> logits = rng.normals(T * E);
  for (int64_t t = 0; t < T; ++t) logits[t * E + 3] += 100.0;
  const GeneralRouting g = to_general(topk_softmax_ref(logits, T, E, K));
  const RoutingMetadata m = routing_metadata_ref(g);
  expect_metadata_valid(g, m);
  EXPECT_EQ(m.expert_frequency, (std::vector<int32_t>{0, 0, 0, 50, 0}));
  EXPECT_EQ(m.expert_offset, (std::vector<int64_t>{0, 0, 0, 0, 50, 50}));
  for (int64_t row = 0; row < T; ++row) {
    EXPECT_EQ(m.scatter_idx[row], row);
    EXPECT_EQ(m.gather_idx[row], row);
  }
}

// ---------------------------------------------------------------------------------------------
// Router backward
// ---------------------------------------------------------------------------------------------

// Central differences of L(logits) = sum_j g_j * score_j (top-K selection must not flip: the K-th
// and (K+1)-th logits are kept more than 1e-3 apart).
TEST(RouterBackwardRef, MatchesFiniteDifferences) {
  Rng rng;
  TRACE_SEED(rng);
  const int64_t T = 12;
  const int E = 6;
  for (int K : {1, 2, 3, 6}) {
    SCOPED_TRACE(::testing::Message() << "K=" << K);
    std::vector<double> logits;
    for (;;) {
      logits = rng.normals(T * E, 1.5);
      bool ok = true;
      for (int64_t t = 0; t < T && K < E; ++t) {
        std::vector<double> row(logits.begin() + t * E, logits.begin() + (t + 1) * E);
        std::sort(row.rbegin(), row.rend());
        ok = ok && (row[K - 1] - row[K] > 1e-3);
      }
      if (ok) break;
    }
    const std::vector<double> g = rng.normals(T * K);
    const TopKRouting r = topk_softmax_ref(logits, T, E, K);
    const std::vector<double> dlogits = router_backward_ref(r, g);
    ASSERT_EQ(dlogits.size(), static_cast<size_t>(T * E));

    auto loss = [&](const std::vector<double>& l) {
      const TopKRouting rr = topk_softmax_ref(l, T, E, K);
      EXPECT_EQ(rr.expert, r.expert);
      double acc = 0.0;
      for (int64_t j = 0; j < T * K; ++j) acc += g[j] * rr.score[j];
      return acc;
    };
    const double h = 1e-6;
    std::vector<double> fd(static_cast<size_t>(T * E));
    std::vector<double> p = logits;
    for (size_t i = 0; i < p.size(); ++i) {
      const double v = p[i];
      p[i] = v + h;
      const double lp = loss(p);
      p[i] = v - h;
      const double lm = loss(p);
      p[i] = v;
      fd[i] = (lp - lm) / (2.0 * h);
    }
    EXPECT_LT(rel_l2(dlogits, fd), 1e-7);

    // Zero for the non-chosen; the chosen dlogits of a token sum to zero (shift invariance).
    for (int64_t t = 0; t < T; ++t) {
      std::set<int> chosen(r.expert.begin() + t * K, r.expert.begin() + (t + 1) * K);
      double sum = 0.0;
      for (int e = 0; e < E; ++e) {
        if (!chosen.count(e)) { EXPECT_EQ(dlogits[t * E + e], 0.0); }
        sum += dlogits[t * E + e];
      }
      EXPECT_NEAR(sum, 0.0, 1e-14);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// rel_l2
// ---------------------------------------------------------------------------------------------

TEST(RelL2Ref, Definition) {
  EXPECT_DOUBLE_EQ(rel_l2({3.0, 4.0}, {0.0, 0.0}), 5.0);
  EXPECT_DOUBLE_EQ(rel_l2({1.0, 2.0}, {1.0, 2.0}), 0.0);
  EXPECT_DOUBLE_EQ(rel_l2({4.0, 4.0}, {3.0, 0.0}), std::sqrt(17.0) / 3.0);
  EXPECT_TRUE(std::isnan(rel_l2({std::nan(""), 1.0}, {1.0, 1.0})));
  EXPECT_TRUE(std::isnan(rel_l2({1.0, 1.0}, {std::nan(""), 1.0})));
}
