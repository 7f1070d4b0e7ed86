// Tests of the float64 reference MoE layer: SwiGLU, layouts, forward, both backward methods,
// finite differences (experts with general routing; the whole layer with the router).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#include "smoe/reference.h"
#include "ref_weights.h"
#include "test_seed.h"

using namespace smoe::ref;

namespace {

using smoe_test::fresh_seed;
using smoe_test::Rng;

using smoe_test::random_weights;

// True when every token's K-th and (K+1)-th logits differ by more than `gap`.
bool topk_has_gap(const std::vector<double>& logits, int64_t T, int E, int K, double gap) {
  if (K >= E) return true;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> row(logits.begin() + t * E, logits.begin() + (t + 1) * E);
    std::sort(row.rbegin(), row.rend());
    if (row[K - 1] - row[K] <= gap) return false;
  }
  return true;
}

// Central finite differences of loss() over every element of p (restored afterwards).
std::vector<double> fd_grad(std::vector<double>& p, const std::function<double()>& loss,
                            double h = 1e-6) {
  std::vector<double> g(p.size());
  for (size_t i = 0; i < p.size(); ++i) {
    const double v = p[i];
    p[i] = v + h;
    const double lp = loss();
    p[i] = v - h;
    const double lm = loss();
    p[i] = v;
    g[i] = (lp - lm) / (2.0 * h);
  }
  return g;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double acc = 0.0;
  for (size_t i = 0; i < a.size(); ++i) acc += a[i] * b[i];
  return acc;
}

// Independent per-token forward: loop over tokens and their entries, no metadata, separate
// gate/up weights (deinterleaved), silu written out.
std::vector<double> direct_forward(const std::vector<double>& x, const MoEShape& s,
                                   const MoEWeights& w, const GeneralRouting& r) {
  std::vector<double> gate, up;
  deinterleave_gate_up(w.w1, s.E, s.n, s.d, &gate, &up);
  std::vector<double> o(static_cast<size_t>(s.T * s.d), 0.0);
  for (int64_t t = 0; t < s.T; ++t)
    for (int64_t j = r.token_offset[t]; j < r.token_offset[t + 1]; ++j) {
      const int64_t e = r.expert[j];
      std::vector<double> a(static_cast<size_t>(s.n));
      for (int64_t c = 0; c < s.n; ++c) {
        double g = 0.0, u = 0.0;
        for (int64_t i = 0; i < s.d; ++i) {
          g += gate[(e * s.n + c) * s.d + i] * x[t * s.d + i];
          u += up[(e * s.n + c) * s.d + i] * x[t * s.d + i];
        }
        a[c] = g / (1.0 + std::exp(-g)) * u;
      }
      for (int64_t i = 0; i < s.d; ++i) {
        double y = 0.0;
        for (int64_t c = 0; c < s.n; ++c) y += w.w2[(e * s.d + i) * s.n + c] * a[c];
        o[t * s.d + i] += r.score[j] * y;
      }
    }
  return o;
}

GeneralRouting tr_routing(Rng& rng, const MoEShape& s, int m_tile, RoundingMode mode) {
  const std::vector<double> logits = rng.normals(s.T * s.E, 2.0);
  return token_rounding_ref(logits, s.T, s.E, s.K, m_tile, mode, rng.gen());
}

void expect_grads_agree(const ExpertGrads& a, const ExpertGrads& b, double tol) {
  EXPECT_LT(rel_l2(a.dx, b.dx), tol) << "dx";
  EXPECT_LT(rel_l2(a.dw1, b.dw1), tol) << "dw1";
  EXPECT_LT(rel_l2(a.dw2, b.dw2), tol) << "dw2";
  EXPECT_LT(rel_l2(a.ds, b.ds), tol) << "ds";
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// SwiGLU and layouts
// ---------------------------------------------------------------------------------------------

TEST(SwiGLURef, ValueAndDerivativeMatchFiniteDifferences) {
  Rng rng;
  TRACE_SEED(rng);
  for (int i = 0; i < 200; ++i) {
    const double g = rng.normal(3.0), u = rng.normal(2.0), da = rng.normal();
    EXPECT_NEAR(swiglu_ref(g, u), g / (1.0 + std::exp(-g)) * u, 1e-14 * (1.0 + std::abs(g * u)));
    double dg = 0.0, du = 0.0;
    dswiglu_ref(g, u, da, &dg, &du);
    const double h = 1e-6;
    const double fdg = da * (swiglu_ref(g + h, u) - swiglu_ref(g - h, u)) / (2 * h);
    const double fdu = da * (swiglu_ref(g, u + h) - swiglu_ref(g, u - h)) / (2 * h);
    EXPECT_NEAR(dg, fdg, 1e-7 * (1.0 + std::abs(fdg))) << "g=" << g << " u=" << u;
    EXPECT_NEAR(du, fdu, 1e-7 * (1.0 + std::abs(fdu))) << "g=" << g << " u=" << u;
  }
}

TEST(LayoutRef, InterleaveDeinterleaveRoundTrip) {
  Rng rng;
  TRACE_SEED(rng);
  const int E = 3, n = 5, d = 4;
  const std::vector<double> gate = rng.normals(E * n * d), up = rng.normals(E * n * d);
  const std::vector<double> w1 = interleave_gate_up(gate, up, E, n, d);
  ASSERT_EQ(w1.size(), static_cast<size_t>(E * 2 * n * d));
  for (int e = 0; e < E; ++e)
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < d; ++i) {
        EXPECT_EQ(w1[(e * 2 * n + 2 * j) * d + i], gate[(e * n + j) * d + i]);
        EXPECT_EQ(w1[(e * 2 * n + 2 * j + 1) * d + i], up[(e * n + j) * d + i]);
      }
  std::vector<double> g2, u2;
  deinterleave_gate_up(w1, E, n, d, &g2, &u2);
  EXPECT_EQ(g2, gate);
  EXPECT_EQ(u2, up);
  EXPECT_EQ(interleave_gate_up(g2, u2, E, n, d), w1);
}

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------

TEST(ExpertsForwardRef, MatchesDirectPerTokenComputation) {
  Rng rng;
  TRACE_SEED(rng);
  const MoEShape s{48, 12, 8, 6, 2};
  const MoEWeights w = random_weights(rng, s);
  const std::vector<double> x = rng.normals(s.T * s.d);
  std::vector<GeneralRouting> routings;
  routings.push_back(to_general(topk_softmax_ref(rng.normals(s.T * s.E), s.T, s.E, s.K)));
  routings.push_back(tr_routing(rng, s, 4, RoundingMode::kNearest));
  routings.push_back(tr_routing(rng, s, 8, RoundingMode::kUp));
  routings.push_back(tr_routing(rng, s, 8, RoundingMode::kDown));
  for (size_t i = 0; i < routings.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "routing " << i);
    const GeneralRouting& r = routings[i];
    const RoutingMetadata m = routing_metadata_ref(r);
    const ExpertForward f = experts_forward_ref(x, s, w, r, m);
    const int64_t nnz = r.nnz();
    ASSERT_EQ(f.h.size(), static_cast<size_t>(nnz * 2 * s.n));
    ASSERT_EQ(f.a.size(), static_cast<size_t>(nnz * s.n));
    ASSERT_EQ(f.y.size(), static_cast<size_t>(nnz * s.d));
    const std::vector<double> want = direct_forward(x, s, w, r);
    EXPECT_LT(rel_l2(f.o, want), 1e-14);
    // h (grouped-row order, interleaved) and a = SwiGLU(h).
    for (int64_t j = 0; j < nnz; ++j) {
      const int64_t row = m.reverse_scatter_idx[j], e = r.expert[j];
      const int64_t t = m.gather_idx[row];
      for (int64_t c = 0; c < 2 * s.n; ++c) {
        double hc = 0.0;
        for (int64_t k = 0; k < s.d; ++k) hc += w.w1[(e * 2 * s.n + c) * s.d + k] * x[t * s.d + k];
        EXPECT_NEAR(f.h[row * 2 * s.n + c], hc, 1e-13);
      }
      for (int64_t c = 0; c < s.n; ++c)
        EXPECT_EQ(f.a[row * s.n + c], swiglu_ref(f.h[row * 2 * s.n + 2 * c], f.h[row * 2 * s.n + 2 * c + 1]));
    }
  }
}

TEST(LayerForwardRef, RouterTopKAndExperts) {
  Rng rng;
  TRACE_SEED(rng);
  const MoEShape s{40, 16, 8, 8, 3};
  const MoEWeights w = random_weights(rng, s);
  const std::vector<double> x = rng.normals(s.T * s.d);
  const LayerForward f = layer_forward_ref(x, s, w);
  ASSERT_EQ(f.logits.size(), static_cast<size_t>(s.T * s.E));
  for (int64_t t = 0; t < s.T; ++t)
    for (int64_t e = 0; e < s.E; ++e) {
      double l = 0.0;
      for (int64_t i = 0; i < s.d; ++i) l += x[t * s.d + i] * w.w_router[e * s.d + i];
      EXPECT_NEAR(f.logits[t * s.E + e], l, 1e-14);
    }
  const TopKRouting r = topk_softmax_ref(f.logits, s.T, s.E, s.K);
  EXPECT_EQ(f.routing.expert, r.expert);
  EXPECT_EQ(f.routing.score, r.score);
  EXPECT_EQ(f.general.expert, r.expert);
  EXPECT_EQ(f.meta.scatter_idx, routing_metadata_ref(to_general(r)).scatter_idx);
  EXPECT_LT(rel_l2(f.experts.o, direct_forward(x, s, w, to_general(r))), 1e-14);
}

// ---------------------------------------------------------------------------------------------
// Backward: the two methods agree
// ---------------------------------------------------------------------------------------------

TEST(ExpertsBackwardRef, ChainRuleAndSonicAgreeTopK) {
  Rng rng;
  TRACE_SEED(rng);
  for (const MoEShape& s : {MoEShape{64, 16, 8, 8, 2}, MoEShape{32, 8, 16, 4, 1},
                            MoEShape{20, 12, 6, 5, 5}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << s.T << " E=" << s.E << " K=" << s.K);
    const MoEWeights w = random_weights(rng, s);
    const std::vector<double> x = rng.normals(s.T * s.d), dO = rng.normals(s.T * s.d);
    const GeneralRouting r = to_general(topk_softmax_ref(rng.normals(s.T * s.E), s.T, s.E, s.K));
    const RoutingMetadata m = routing_metadata_ref(r);
    const ExpertForward f = experts_forward_ref(x, s, w, r, m);
    const ExpertGrads chain = experts_backward_chain_ref(x, dO, s, w, r, m, f);
    const ExpertGrads sonic = experts_backward_sonic_ref(x, dO, s, w, r, m, f.h);
    ASSERT_EQ(chain.ds.size(), static_cast<size_t>(r.nnz()));
    expect_grads_agree(sonic, chain, 1e-12);
  }
}

TEST(ExpertsBackwardRef, ChainRuleAndSonicAgreeTokenRounding) {
  Rng rng;
  TRACE_SEED(rng);
  const MoEShape s{64, 16, 8, 8, 2};
  for (RoundingMode mode : {RoundingMode::kNearest, RoundingMode::kUp, RoundingMode::kDown,
                            RoundingMode::kStochastic}) {
    const MoEWeights w = random_weights(rng, s);
    const std::vector<double> x = rng.normals(s.T * s.d), dO = rng.normals(s.T * s.d);
    const GeneralRouting r = tr_routing(rng, s, 8, mode);
    const RoutingMetadata m = routing_metadata_ref(r);
    const ExpertForward f = experts_forward_ref(x, s, w, r, m);
    const ExpertGrads chain = experts_backward_chain_ref(x, dO, s, w, r, m, f);
    const ExpertGrads sonic = experts_backward_sonic_ref(x, dO, s, w, r, m, f.h);
    expect_grads_agree(sonic, chain, 1e-12);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward: finite differences of L = <dO, O>
// ---------------------------------------------------------------------------------------------

// Experts only, general routing from token rounding (fixed routing, so L is smooth in x, w1, w2
// and in the scores).
TEST(ExpertsBackwardRef, MatchesFiniteDifferencesGeneralRouting) {
  Rng rng;
  TRACE_SEED(rng);
  const MoEShape s{10, 5, 3, 4, 2};
  for (RoundingMode mode : {RoundingMode::kNearest, RoundingMode::kUp}) {
    MoEWeights w = random_weights(rng, s);
    std::vector<double> x = rng.normals(s.T * s.d);
    const std::vector<double> dO = rng.normals(s.T * s.d);
    GeneralRouting r = tr_routing(rng, s, 4, mode);
    const RoutingMetadata m = routing_metadata_ref(r);
    ASSERT_GT(r.nnz(), 0);

    auto loss = [&]() { return dot(dO, experts_forward_ref(x, s, w, r, m).o); };
    const std::vector<double> fdx = fd_grad(x, loss);
    const std::vector<double> fdw1 = fd_grad(w.w1, loss);
    const std::vector<double> fdw2 = fd_grad(w.w2, loss);
    const std::vector<double> fds = fd_grad(r.score, loss);

    const ExpertForward f = experts_forward_ref(x, s, w, r, m);
    const ExpertGrads chain = experts_backward_chain_ref(x, dO, s, w, r, m, f);
    const ExpertGrads sonic = experts_backward_sonic_ref(x, dO, s, w, r, m, f.h);
    for (const ExpertGrads* g : {&chain, &sonic}) {
      SCOPED_TRACE(g == &chain ? "chain rule" : "sonic");
      EXPECT_LT(rel_l2(g->dx, fdx), 1e-7) << "dx";
      EXPECT_LT(rel_l2(g->dw1, fdw1), 1e-7) << "dw1";
      EXPECT_LT(rel_l2(g->dw2, fdw2), 1e-7) << "dw2";
      EXPECT_LT(rel_l2(g->ds, fds), 1e-7) << "ds";
    }
  }
}

// The whole layer with the router (top-K): dx, dw_router, dw1, dw2, both methods.
TEST(LayerBackwardRef, MatchesFiniteDifferencesTopK) {
  Rng rng;
  TRACE_SEED(rng);
  for (const MoEShape& s : {MoEShape{8, 5, 3, 4, 2}, MoEShape{6, 4, 3, 5, 1}, MoEShape{6, 4, 2, 3, 3}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << s.T << " E=" << s.E << " K=" << s.K);
    MoEWeights w;
    std::vector<double> x;
    LayerForward f0;
    for (;;) {  // redraw until no token is near a top-K tie (the selection must not flip)
      w = random_weights(rng, s);
      x = rng.normals(s.T * s.d);
      f0 = layer_forward_ref(x, s, w);
      if (topk_has_gap(f0.logits, s.T, s.E, s.K, 1e-3)) break;
    }
    const std::vector<double> dO = rng.normals(s.T * s.d);
    auto loss = [&]() {
      const LayerForward f = layer_forward_ref(x, s, w);
      EXPECT_EQ(f.routing.expert, f0.routing.expert) << "top-K selection flipped";
      return dot(dO, f.experts.o);
    };
    const std::vector<double> fdx = fd_grad(x, loss);
    const std::vector<double> fdwr = fd_grad(w.w_router, loss);
    const std::vector<double> fdw1 = fd_grad(w.w1, loss);
    const std::vector<double> fdw2 = fd_grad(w.w2, loss);

    for (BackwardMethod method : {BackwardMethod::kChainRule, BackwardMethod::kSonic}) {
      SCOPED_TRACE(method == BackwardMethod::kChainRule ? "chain rule" : "sonic");
      const LayerGrads g = layer_backward_ref(x, dO, s, w, f0, method);
      EXPECT_LT(rel_l2(g.dx, fdx), 1e-7) << "dx";
      EXPECT_LT(rel_l2(g.dw_router, fdwr), 1e-7) << "dw_router";
      EXPECT_LT(rel_l2(g.dw1, fdw1), 1e-7) << "dw1";
      EXPECT_LT(rel_l2(g.dw2, fdw2), 1e-7) << "dw2";
    }
  }
}

// The layer with token rounding: gradients of the kept chosen scores (through the top-K softmax) and
// of the padded ones (through the softmax over E) against finite differences of the whole layer.
TEST(LayerBackwardRef, MatchesFiniteDifferencesTokenRounding) {
  Rng rng;
  TRACE_SEED(rng);
  // m_tile 3 and 4 with these T, E, K make every mode pad some experts and drop from others.
  const MoEShape s{9, 4, 3, 4, 2};
  for (RoundingMode mode : {RoundingMode::kNearest, RoundingMode::kUp, RoundingMode::kDown}) {
    for (int m_tile : {3, 4}) {
      SCOPED_TRACE(::testing::Message() << "mode " << static_cast<int>(mode) << " m_tile " << m_tile);
      MoEWeights w;
      std::vector<double> x;
      LayerForward f0;
      for (;;) {
        w = random_weights(rng, s);
        x = rng.normals(s.T * s.d);
        f0 = layer_forward_tr_ref(x, s, w, m_tile, mode, 7);
        if (topk_has_gap(f0.logits, s.T, s.E, s.K, 1e-3)) break;
      }
      int64_t padded = 0;
      for (int64_t t = 0; t < s.T; ++t)
        for (int64_t j = f0.general.token_offset[t]; j < f0.general.token_offset[t + 1]; ++j) {
          bool chosen = false;
          for (int k = 0; k < s.K; ++k) chosen |= f0.routing.expert[t * s.K + k] == f0.general.expert[j];
          padded += !chosen;
        }
      const std::vector<double> dO = rng.normals(s.T * s.d);
      auto loss = [&]() {
        const LayerForward f = layer_forward_tr_ref(x, s, w, m_tile, mode, 7);
        EXPECT_EQ(f.general.expert, f0.general.expert) << "rounded routing flipped";
        EXPECT_EQ(f.general.token_offset, f0.general.token_offset) << "rounded routing flipped";
        return dot(dO, f.experts.o);
      };
      const std::vector<double> fdx = fd_grad(x, loss);
      const std::vector<double> fdwr = fd_grad(w.w_router, loss);
      const std::vector<double> fdw1 = fd_grad(w.w1, loss);
      const LayerGrads g = layer_backward_ref(x, dO, s, w, f0, BackwardMethod::kSonic);
      EXPECT_LT(rel_l2(g.dx, fdx), 1e-7) << "dx";
      EXPECT_LT(rel_l2(g.dw_router, fdwr), 1e-7) << "dw_router";
      EXPECT_LT(rel_l2(g.dw1, fdw1), 1e-7) << "dw1";
      // UP must pad whenever an expert's count is off the tile and below T (T*K = 18 is not a
      // multiple of 4, so with m_tile 4 that always holds; with 3 it depends on the draw).
      bool can_pad = false;
      std::vector<int> f(s.E, 0);
      for (int32_t e : f0.routing.expert) ++f[e];
      for (int c : f) can_pad |= c % m_tile != 0 && c < s.T;
      if (mode == RoundingMode::kUp && can_pad) EXPECT_GT(padded, 0) << "the UP case must pad some token";
      if (m_tile == 4 && mode == RoundingMode::kUp) EXPECT_TRUE(can_pad);
    }
  }
}

TEST(LayerBackwardRef, MethodsAgree) {
  Rng rng;
  TRACE_SEED(rng);
  const MoEShape s{64, 16, 8, 8, 2};
  const MoEWeights w = random_weights(rng, s);
  const std::vector<double> x = rng.normals(s.T * s.d), dO = rng.normals(s.T * s.d);
  const LayerForward f = layer_forward_ref(x, s, w);
  const LayerGrads a = layer_backward_ref(x, dO, s, w, f, BackwardMethod::kChainRule);
  const LayerGrads b = layer_backward_ref(x, dO, s, w, f, BackwardMethod::kSonic);
  ASSERT_EQ(a.ds.size(), static_cast<size_t>(s.T * s.K));
  ASSERT_EQ(a.dlogits.size(), static_cast<size_t>(s.T * s.E));
  EXPECT_LT(rel_l2(b.dx, a.dx), 1e-12);
  EXPECT_LT(rel_l2(b.dw_router, a.dw_router), 1e-12);
  EXPECT_LT(rel_l2(b.dw1, a.dw1), 1e-12);
  EXPECT_LT(rel_l2(b.dw2, a.dw2), 1e-12);
  EXPECT_LT(rel_l2(b.ds, a.ds), 1e-12);
  EXPECT_LT(rel_l2(b.dlogits, a.dlogits), 1e-12);
  // dlogits is the router backward of ds; the layer's dw_router = dlogits^T x.
  EXPECT_EQ(a.dlogits, router_backward_ref(f.routing, a.ds));
  for (int64_t e = 0; e < s.E; ++e)
    for (int64_t i = 0; i < s.d; ++i) {
      double acc = 0.0;
      for (int64_t t = 0; t < s.T; ++t) acc += a.dlogits[t * s.E + e] * x[t * s.d + i];
      EXPECT_NEAR(a.dw_router[e * s.d + i], acc, 1e-13);
    }
}
