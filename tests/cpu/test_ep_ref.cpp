// The expert-parallel layout reference: every placement a prefix sum of the routing, every token
// sent once per rank owning one of its experts, every entry computed exactly once on its expert's
// rank; and the EP forward through it equals the one-GPU forward of all ranks' tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "smoe/reference.h"
#include "test_seed.h"

using namespace smoe::ref;

namespace {

// Rank routings with 0..K distinct experts per token; `skew`: rank 0's experts only (the other
// ranks receive nothing); `hot`: every token lists expert `hot` first.
std::vector<GeneralRouting> random_routings(smoe_test::Rng& rng, int R, int E, int K, int64_t T, bool skew, int hot) {
  std::vector<GeneralRouting> rt(static_cast<size_t>(R));
  const int pool = skew ? E / R : E;
  for (int s = 0; s < R; ++s) {
    GeneralRouting& g = rt[s];
    g.T = T + s;  // ranks hold different token counts
    g.E = E;
    g.token_offset.assign(static_cast<size_t>(g.T) + 1, 0);
    for (int64_t t = 0; t < g.T; ++t) {
      std::vector<int> ex(pool);
      for (int e = 0; e < pool; ++e) ex[e] = e;
      std::shuffle(ex.begin(), ex.end(), rng.gen);
      if (hot >= 0) std::iter_swap(ex.begin(), std::find(ex.begin(), ex.end(), hot));
      const int m = hot >= 0 ? 1 + rng.uniform_int(0, K - 1) : rng.uniform_int(0, K);
      for (int i = 0; i < m; ++i) {
        g.expert.push_back(ex[i]);
        g.score.push_back(0.1 + 0.9 * std::uniform_real_distribution<double>()(rng.gen));
      }
      g.token_offset[t + 1] = static_cast<int64_t>(g.expert.size());
    }
  }
  return rt;
}

MoEWeights random_weights(smoe_test::Rng& rng, const MoEShape& s) {
  MoEWeights w;
  w.w_router = rng.normals(static_cast<int64_t>(s.E) * s.d);
  w.w1 = rng.normals(static_cast<int64_t>(s.E) * 2 * s.n * s.d, 0.3);
  w.w2 = rng.normals(static_cast<int64_t>(s.E) * s.d * s.n, 0.3);
  return w;
}

}  // namespace

TEST(EpLayoutRef, EveryTokenOncePerRankEveryEntryOnceAndPrefixSumOffsets) {
  smoe_test::Rng rng;
  TRACE_SEED(rng);
  struct C { int R, E, K; bool skew; int hot; };
  for (const C& c : {C{1, 8, 2, false, -1}, C{2, 8, 2, false, -1}, C{2, 16, 4, true, -1}, C{4, 16, 3, false, 5},
                     C{4, 64, 8, false, -1}}) {
    SCOPED_TRACE(::testing::Message() << "R=" << c.R << " E=" << c.E << " K=" << c.K << " skew=" << c.skew);
    const std::vector<GeneralRouting> rt = random_routings(rng, c.R, c.E, c.K, 37, c.skew, c.hot);
    const EpLayout L = ep_layout_ref(rt, c.R);
    const int El = c.E / c.R;
    std::vector<std::vector<int>> entry_seen(static_cast<size_t>(c.R));
    for (int s = 0; s < c.R; ++s) entry_seen[s].assign(static_cast<size_t>(rt[s].nnz()), 0);
    for (int r = 0; r < c.R; ++r) {
      const EpRankLayout& K = L.rank[r];
      int64_t slot = 0;
      for (int s = 0; s < c.R; ++s) {
        ASSERT_EQ(K.recv_offset[s], slot) << "receive offsets are the prefix sums of the send counts";
        for (int64_t t : L.send_tokens[s * c.R + r]) {
          ASSERT_EQ(K.recv_src_rank[slot], s);
          ASSERT_EQ(K.recv_src_token[slot], t);
          ++slot;
        }
        // s sends t to r iff one of t's experts lives on r, in ascending token order, once.
        std::vector<int64_t> expect;
        for (int64_t t = 0; t < rt[s].T; ++t) {
          bool on_r = false;
          for (int64_t j = rt[s].token_offset[t]; j < rt[s].token_offset[t + 1]; ++j) on_r |= rt[s].expert[j] / El == r;
          if (on_r) expect.push_back(t);
        }
        ASSERT_EQ(L.send_tokens[s * c.R + r], expect);
      }
      for (int l = 0; l < El; ++l)
        for (int64_t row = K.expert_offset[l]; row < K.expert_offset[l + 1]; ++row) {
          const int s = K.row_src_rank[row];
          const int64_t j = K.row_src_entry[row];
          ASSERT_EQ(rt[s].expert[j], r * El + l) << "a row computes its entry's expert";
          ASSERT_EQ(K.recv_src_rank[K.row_slot[row]], s);
          const int64_t t = K.recv_src_token[K.row_slot[row]];
          ASSERT_TRUE(j >= rt[s].token_offset[t] && j < rt[s].token_offset[t + 1]) << "the row gathers its token";
          if (row > K.expert_offset[l]) ASSERT_LT(K.row_slot[row - 1], K.row_slot[row]) << "rows by receive slot";
          ++entry_seen[s][j];
        }
    }
    for (int s = 0; s < c.R; ++s)
      for (int v : entry_seen[s]) ASSERT_EQ(v, 1) << "every entry is computed exactly once";
    if (c.skew)
      for (int r = 1; r < c.R; ++r) EXPECT_TRUE(L.rank[r].recv_src_token.empty()) << "rank " << r << " receives nothing";
  }
}

TEST(EpLayoutRef, EpForwardEqualsOneGpuForward) {
  smoe_test::Rng rng;
  TRACE_SEED(rng);
  for (int R : {2, 4}) {
    SCOPED_TRACE(::testing::Message() << "R=" << R);
    const int E = 8, K = 3;
    const int64_t T = 21;
    const std::vector<GeneralRouting> rt = random_routings(rng, R, E, K, T, false, -1);
    // All ranks' tokens on one GPU: concatenate tokens and routings.
    GeneralRouting all;
    all.E = E;
    all.token_offset.push_back(0);
    std::vector<std::vector<double>> xs(static_cast<size_t>(R));
    std::vector<double> xall;
    const int d = 6, n = 4;
    for (int s = 0; s < R; ++s) {
      xs[s] = rng.normals(rt[s].T * d);
      xall.insert(xall.end(), xs[s].begin(), xs[s].end());
      for (int64_t t = 0; t < rt[s].T; ++t) {
        for (int64_t j = rt[s].token_offset[t]; j < rt[s].token_offset[t + 1]; ++j) {
          all.expert.push_back(rt[s].expert[j]);
          all.score.push_back(rt[s].score[j]);
        }
        all.token_offset.push_back(static_cast<int64_t>(all.expert.size()));
      }
      all.T += rt[s].T;
    }
    const MoEShape sh{all.T, d, n, E, K};
    const MoEWeights w = random_weights(rng, sh);
    const ExpertForward one = experts_forward_ref(xall, sh, w, all, routing_metadata_ref(all));
    const std::vector<std::vector<double>> ep = ep_experts_forward_ref(xs, sh, w, rt, ep_layout_ref(rt, R));
    std::vector<double> epall;
    for (const auto& o : ep) epall.insert(epall.end(), o.begin(), o.end());
    EXPECT_LT(rel_l2(epall, one.o), 1e-13);
  }
}
