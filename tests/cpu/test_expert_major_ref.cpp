// The float64 twin of the expert-major layer: the same numbers as the token-major layer for the
// same routing (rows = grouped rows, probs = scores), padding rows that cost nothing and return
// zeros, layouts that are the same weights, and the device's count rules.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "smoe/reference.h"
#include "ref_weights.h"
#include "test_seed.h"

using namespace smoe::ref;

namespace {

using smoe_test::Rng;

using smoe_test::random_weights;

// Rows of x (and of any [.][d] tensor) picked by an index.
std::vector<double> take_rows(const std::vector<double>& v, const std::vector<int32_t>& idx, int64_t d) {
  std::vector<double> out(idx.size() * d);
  for (size_t r = 0; r < idx.size(); ++r)
    for (int64_t i = 0; i < d; ++i) out[r * d + i] = v[idx[r] * d + i];
  return out;
}

// Expert-major rows of a token-major routing: the grouped rows, probs = each row's score.
struct Grouped {
  std::vector<int32_t> counts;
  std::vector<int32_t> row_expert;
  std::vector<double> probs;
};
Grouped grouped(const GeneralRouting& r, const RoutingMetadata& m, int E) {
  Grouped g;
  for (int e = 0; e < E; ++e) g.counts.push_back(m.expert_frequency[e]);
  std::vector<int64_t> begin;
  EXPECT_TRUE(expert_major_rows_ref(g.counts, {}, r.nnz(), &begin, &g.row_expert));
  for (int64_t row = 0; row < r.nnz(); ++row) g.probs.push_back(r.score[m.scatter_idx[row]]);
  return g;
}

}  // namespace

// Same routing, two layers: out summed back per token, dx summed per token, dW, and dprobs by entry
// agree with the token-major reference (SonicMoE's backward) to float64 rounding.
TEST(ExpertMajorRef, MatchesTokenMajorLayer) {
  Rng rng;
  TRACE_SEED(rng);
  for (const MoEShape& s : {MoEShape{37, 16, 8, 6, 2}, MoEShape{20, 8, 4, 5, 1}, MoEShape{64, 16, 8, 8, 8}}) {
    const MoEWeights w = random_weights(rng, s);
    const std::vector<double> x = rng.normals(s.T * s.d), dO = rng.normals(s.T * s.d);
    const std::vector<double> logits = rng.normals(s.T * s.E);
    const GeneralRouting r = to_general(topk_softmax_ref(logits, s.T, s.E, s.K));
    const RoutingMetadata m = routing_metadata_ref(r);
    const ExpertForward tf = experts_forward_ref(x, s, w, r, m);
    const ExpertGrads tg = experts_backward_sonic_ref(x, dO, s, w, r, m, tf.h);

    const Grouped g = grouped(r, m, s.E);
    const int64_t R = r.nnz();
    const std::vector<double> xr = take_rows(x, m.gather_idx, s.d), dr = take_rows(dO, m.gather_idx, s.d);
    const ExpertMajorForward f = expert_major_forward_ref(xr, R, s, w, g.row_expert, g.probs);
    const ExpertMajorGrads eg = expert_major_backward_ref(xr, dr, R, s, w, g.row_expert, g.probs, f);

    std::vector<double> o(tf.o.size(), 0.0), dx(tg.dx.size(), 0.0), ds(tg.ds.size(), 0.0);
    for (int64_t row = 0; row < R; ++row) {
      const int64_t t = m.gather_idx[row];
      for (int i = 0; i < s.d; ++i) {
        o[t * s.d + i] += f.out[row * s.d + i];
        dx[t * s.d + i] += eg.dx[row * s.d + i];
      }
      ds[m.scatter_idx[row]] = eg.dprobs[row];
    }
    EXPECT_LT(rel_l2(f.h, tf.h), 1e-13);  // H in grouped-row order either way
    EXPECT_LT(rel_l2(o, tf.o), 1e-13);
    EXPECT_LT(rel_l2(dx, tg.dx), 1e-13);
    EXPECT_LT(rel_l2(eg.dw1, tg.dw1), 1e-13);
    EXPECT_LT(rel_l2(eg.dw2, tg.dw2), 1e-13);
    EXPECT_LT(rel_l2(ds, tg.ds), 1e-13);
  }
}

// dprobs and every gradient are the derivatives of <dout, out> (finite differences).
TEST(ExpertMajorRef, GradientsAreDerivatives) {
  Rng rng;
  TRACE_SEED(rng);
  const MoEShape s{0, 8, 4, 3, 0};
  const int64_t R = 7;
  const std::vector<int32_t> row_expert = {0, 0, -1, 2, 2, 2, -1};  // expert 1 empty, two padding rows
  MoEWeights w = random_weights(rng, s);
  std::vector<double> x = rng.normals(R * s.d), probs = rng.normals(R), dout = rng.normals(R * s.d);
  auto loss = [&] {
    const ExpertMajorForward f = expert_major_forward_ref(x, R, s, w, row_expert, probs);
    double l = 0.0;
    for (size_t i = 0; i < f.out.size(); ++i) l += f.out[i] * dout[i];
    return l;
  };
  const ExpertMajorForward f = expert_major_forward_ref(x, R, s, w, row_expert, probs);
  const ExpertMajorGrads g = expert_major_backward_ref(x, dout, R, s, w, row_expert, probs, f);
  auto fd = [&](std::vector<double>& p) {
    std::vector<double> out(p.size());
    for (size_t i = 0; i < p.size(); ++i) {
      const double v = p[i];
      p[i] = v + 1e-6;
      const double lp = loss();
      p[i] = v - 1e-6;
      const double lm = loss();
      p[i] = v;
      out[i] = (lp - lm) / 2e-6;
    }
    return out;
  };
  EXPECT_LT(rel_l2(g.dx, fd(x)), 1e-7);
  EXPECT_LT(rel_l2(g.dprobs, fd(probs)), 1e-7);
  EXPECT_LT(rel_l2(g.dw1, fd(w.w1)), 1e-7);
  EXPECT_LT(rel_l2(g.dw2, fd(w.w2)), 1e-7);
  for (int64_t i = 0; i < s.d; ++i) EXPECT_EQ(g.dx[2 * s.d + i], 0.0);  // padding rows
  EXPECT_EQ(g.dprobs[6], 0.0);
  for (int64_t i = 0; i < 2 * s.n * s.d; ++i)  // expert 1 has no rows
    EXPECT_EQ(g.dw1[1 * 2 * s.n * s.d + i], 0.0);
}

// Capacity layout (DeepEP low-latency: [E][capacity] with counts) and alignment padding: the valid
// rows give exactly the compact layout's numbers, padding rows are zeros even where the inputs
// there are NaN, and nothing of them reaches a weight gradient.
TEST(ExpertMajorRef, PaddingRowsAreFreeAndZero) {
  Rng rng;
  TRACE_SEED(rng);
  const MoEShape s{0, 16, 8, 4, 0};
  const MoEWeights w = random_weights(rng, s);
  const std::vector<int32_t> counts = {3, 0, 5, 1};  // an empty expert, counts off any tile
  const int cap = 6;
  std::vector<int32_t> seg;
  for (int e = 0; e <= s.E; ++e) seg.push_back(e * cap);
  const int64_t R = int64_t{cap} * s.E + 2;  // two trailing rows past the last segment too
  std::vector<int64_t> begin, begin_c;
  std::vector<int32_t> row_expert, row_expert_c;
  ASSERT_TRUE(expert_major_rows_ref(counts, seg, R, &begin, &row_expert));
  const int64_t Rc = 9;
  ASSERT_TRUE(expert_major_rows_ref(counts, {}, Rc, &begin_c, &row_expert_c));
  EXPECT_EQ(begin, (std::vector<int64_t>{0, 6, 12, 18}));
  EXPECT_EQ(begin_c, (std::vector<int64_t>{0, 3, 3, 8}));

  const std::vector<double> xc = rng.normals(Rc * s.d), pc = rng.normals(Rc), dc = rng.normals(Rc * s.d);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> x(R * s.d, nan), p(R, nan), dout(R * s.d, nan);
  for (int e = 0; e < s.E; ++e)
    for (int k = 0; k < counts[e]; ++k) {
      const int64_t r = begin[e] + k, rc = begin_c[e] + k;
      for (int i = 0; i < s.d; ++i) {
        x[r * s.d + i] = xc[rc * s.d + i];
        dout[r * s.d + i] = dc[rc * s.d + i];
      }
      p[r] = pc[rc];
    }
  const ExpertMajorForward fc = expert_major_forward_ref(xc, Rc, s, w, row_expert_c, pc);
  const ExpertMajorGrads gc = expert_major_backward_ref(xc, dc, Rc, s, w, row_expert_c, pc, fc);
  const ExpertMajorForward f = expert_major_forward_ref(x, R, s, w, row_expert, p);
  const ExpertMajorGrads g = expert_major_backward_ref(x, dout, R, s, w, row_expert, p, f);
  EXPECT_EQ(g.dw1, gc.dw1);  // the same rows in the same order: bitwise
  EXPECT_EQ(g.dw2, gc.dw2);
  for (int64_t r = 0; r < R; ++r) {
    const int e = row_expert[r];
    for (int i = 0; i < s.d; ++i) {
      if (e < 0) {
        EXPECT_EQ(f.out[r * s.d + i], 0.0) << "padding row " << r;
        EXPECT_EQ(g.dx[r * s.d + i], 0.0) << "padding row " << r;
      } else {
        const int64_t rc = begin_c[e] + (r - begin[e]);
        EXPECT_EQ(f.out[r * s.d + i], fc.out[rc * s.d + i]);
        EXPECT_EQ(g.dx[r * s.d + i], gc.dx[rc * s.d + i]);
      }
    }
    if (e < 0) EXPECT_EQ(g.dprobs[r], 0.0);
  }
}

// Without probs the layer is the one with probs = 1 (and returns no dprobs).
TEST(ExpertMajorRef, NoProbsIsProbsOne) {
  Rng rng;
  TRACE_SEED(rng);
  const MoEShape s{0, 8, 4, 2, 0};
  const MoEWeights w = random_weights(rng, s);
  const std::vector<int32_t> row_expert = {1, 1, 0, -1, 0};
  const int64_t R = 5;
  const std::vector<double> x = rng.normals(R * s.d), dout = rng.normals(R * s.d), ones(R, 1.0);
  const ExpertMajorForward f1 = expert_major_forward_ref(x, R, s, w, row_expert, {});
  const ExpertMajorForward fp = expert_major_forward_ref(x, R, s, w, row_expert, ones);
  EXPECT_EQ(f1.out, fp.out);
  const ExpertMajorGrads g1 = expert_major_backward_ref(x, dout, R, s, w, row_expert, {}, f1);
  const ExpertMajorGrads gp = expert_major_backward_ref(x, dout, R, s, w, row_expert, ones, fp);
  EXPECT_TRUE(g1.dprobs.empty());
  EXPECT_EQ(g1.dx, gp.dx);
  EXPECT_EQ(g1.dw1, gp.dw1);
  EXPECT_EQ(g1.dw2, gp.dw2);
}

// The concatenated fc1 (Megatron-Core, transformers) is the same weights as the interleaved one.
TEST(ExpertMajorRef, ConcatenatedLayoutRoundTrips) {
  Rng rng;
  TRACE_SEED(rng);
  const int E = 3, n = 4, d = 5;
  const std::vector<double> cat = rng.normals(E * 2 * n * d);
  const std::vector<double> il = concatenated_to_interleaved(cat, E, n, d);
  EXPECT_EQ(interleaved_to_concatenated(il, E, n, d), cat);
  std::vector<double> gate, up;
  deinterleave_gate_up(il, E, n, d, &gate, &up);
  for (int e = 0; e < E; ++e)
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < d; ++i) {
        EXPECT_EQ(gate[(e * n + j) * d + i], cat[(e * 2 * n + j) * d + i]);
        EXPECT_EQ(up[(e * n + j) * d + i], cat[(e * 2 * n + n + j) * d + i]);
      }
}

// The rules the GPU checks on the device (kStatusInvalidCounts): every break is caught.
TEST(ExpertMajorRef, CountRules) {
  std::vector<int64_t> b;
  std::vector<int32_t> re;
  EXPECT_TRUE(expert_major_rows_ref({2, 0, 3}, {}, 5, &b, &re));
  EXPECT_TRUE(expert_major_rows_ref({2, 0, 3}, {}, 9, &b, &re));  // trailing padding
  EXPECT_EQ(re, (std::vector<int32_t>{0, 0, 2, 2, 2, -1, -1, -1, -1}));
  EXPECT_TRUE(expert_major_rows_ref({0, 0}, {}, 0, &b, &re));     // R = 0
  EXPECT_FALSE(expert_major_rows_ref({2, 0, 4}, {}, 5, &b, &re));  // past R
  EXPECT_TRUE(re.empty());
  EXPECT_FALSE(expert_major_rows_ref({2, -1, 3}, {}, 9, &b, &re));         // negative
  EXPECT_FALSE(expert_major_rows_ref({2, 3}, {0, 2, 4}, 4, &b, &re));      // past its segment
  EXPECT_FALSE(expert_major_rows_ref({1, 1}, {0, 3, 2}, 4, &b, &re));      // decreasing offsets
  EXPECT_FALSE(expert_major_rows_ref({1, 1}, {0, 2, 5}, 4, &b, &re));      // segments past R
  EXPECT_FALSE(expert_major_rows_ref({1, 1}, {-1, 2, 4}, 4, &b, &re));     // negative offset
  EXPECT_TRUE(expert_major_rows_ref({1, 2}, {1, 2, 4}, 4, &b, &re));       // leading padding row
  EXPECT_EQ(re, (std::vector<int32_t>{-1, 0, 1, 1}));
}
