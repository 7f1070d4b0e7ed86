// float64 CPU reference: MoE layer with SwiGLU experts (forward, two backward methods, router).
// See include/smoe/reference.h for the spec and the layouts.
#include "smoe/reference.h"
#include "expert_row.h"
#include "ref_require.h"

#include <stdexcept>
#include <string>
#include <utility>

namespace smoe {
namespace ref {

namespace {

using detail::require;

void check_expert_inputs(const std::vector<double>& x, const MoEShape& s, const MoEWeights& w,
                         const GeneralRouting& r, const RoutingMetadata& m) {
  const int64_t T = s.T, d = s.d, n = s.n, E = s.E;
  require(T >= 0 && d >= 1 && n >= 1 && E >= 1, "bad MoEShape");
  require(static_cast<int64_t>(x.size()) == T * d, "x size != T*d");
  require(static_cast<int64_t>(w.w1.size()) == E * 2 * n * d, "w1 size != E*2n*d");
  require(static_cast<int64_t>(w.w2.size()) == E * d * n, "w2 size != E*d*n");
  require(r.T == T && r.E == E, "routing T/E differ from the shape");
  require(static_cast<int64_t>(r.token_offset.size()) == T + 1, "token_offset size != T+1");
  const int64_t nnz = r.nnz();
  require(static_cast<int64_t>(r.expert.size()) == nnz && static_cast<int64_t>(r.score.size()) == nnz,
          "routing expert/score size != nnz");
  require(static_cast<int64_t>(m.expert_offset.size()) == E + 1 && m.expert_offset[E] == nnz,
          "metadata does not match the routing");
  require(static_cast<int64_t>(m.scatter_idx.size()) == nnz &&
              static_cast<int64_t>(m.reverse_scatter_idx.size()) == nnz &&
              static_cast<int64_t>(m.gather_idx.size()) == nnz,
          "metadata index size != nnz");
}

}  // namespace

ExpertForward experts_forward_ref(const std::vector<double>& x, const MoEShape& s,
                                  const MoEWeights& w, const GeneralRouting& r,
                                  const RoutingMetadata& m) {
  check_expert_inputs(x, s, w, r, m);
  const int64_t T = s.T, d = s.d, n = s.n, E = s.E;
  const int64_t nnz = r.nnz();

  ExpertForward f;
  f.h.assign(static_cast<size_t>(nnz * 2 * n), 0.0);
  f.a.assign(static_cast<size_t>(nnz * n), 0.0);
  f.y.assign(static_cast<size_t>(nnz * d), 0.0);
  f.o.assign(static_cast<size_t>(T * d), 0.0);

  for (int64_t e = 0; e < E; ++e) {
    const double* w1e = w.w1.data() + e * 2 * n * d;
    const double* w2e = w.w2.data() + e * d * n;
    for (int64_t row = m.expert_offset[e]; row < m.expert_offset[e + 1]; ++row) {
      const int64_t t = m.gather_idx[row];
      const double* xt = x.data() + t * d;
      double* h = f.h.data() + row * 2 * n;
      double* a = f.a.data() + row * n;
      double* y = f.y.data() + row * d;
      detail::expert_row_forward(xt, w1e, w2e, d, n, h, a, y);  // H = x W1_e^T, A = SwiGLU(H), Y = A W2_e^T
    }
  }

  // O[t] = sum over the entries of t of score * Y[row] (entry order within a token).
  for (int64_t t = 0; t < T; ++t) {
    double* ot = f.o.data() + t * d;
    for (int64_t j = r.token_offset[t]; j < r.token_offset[t + 1]; ++j) {
      const int64_t row = m.reverse_scatter_idx[j];
      const double sc = r.score[j];
      const double* y = f.y.data() + row * d;
      for (int64_t i = 0; i < d; ++i) ot[i] += sc * y[i];
    }
  }
  return f;
}

ExpertGrads experts_backward_chain_ref(const std::vector<double>& x, const std::vector<double>& dO,
                                       const MoEShape& s, const MoEWeights& w,
                                       const GeneralRouting& r, const RoutingMetadata& m,
                                       const ExpertForward& f) {
  check_expert_inputs(x, s, w, r, m);
  const int64_t T = s.T, d = s.d, n = s.n, E = s.E;
  const int64_t nnz = r.nnz();
  require(static_cast<int64_t>(dO.size()) == T * d, "dO size != T*d");
  require(static_cast<int64_t>(f.h.size()) == nnz * 2 * n &&
              static_cast<int64_t>(f.a.size()) == nnz * n &&
              static_cast<int64_t>(f.y.size()) == nnz * d,
          "forward tensors do not match the routing");

  ExpertGrads g;
  g.dx.assign(static_cast<size_t>(T * d), 0.0);
  g.dw1.assign(static_cast<size_t>(E * 2 * n * d), 0.0);
  g.dw2.assign(static_cast<size_t>(E * d * n), 0.0);
  g.ds.assign(static_cast<size_t>(nnz), 0.0);

  std::vector<double> dy(static_cast<size_t>(d)), da(static_cast<size_t>(n)),
      dh(static_cast<size_t>(2 * n));
  for (int64_t e = 0; e < E; ++e) {
    const double* w1e = w.w1.data() + e * 2 * n * d;
    const double* w2e = w.w2.data() + e * d * n;
    double* dw1e = g.dw1.data() + e * 2 * n * d;
    double* dw2e = g.dw2.data() + e * d * n;
    for (int64_t row = m.expert_offset[e]; row < m.expert_offset[e + 1]; ++row) {
      const int64_t j = m.scatter_idx[row];
      const int64_t t = m.gather_idx[row];
      const double sc = r.score[j];
      const double* xt = x.data() + t * d;
      const double* dot = dO.data() + t * d;
      const double* h = f.h.data() + row * 2 * n;
      const double* a = f.a.data() + row * n;
      const double* y = f.y.data() + row * d;
      // O[t] += s * Y_row: dY_row = s * dO[t], dS = <dO[t], Y_row>.
      double ds = 0.0;
      for (int64_t i = 0; i < d; ++i) {
        dy[i] = sc * dot[i];
        ds += dot[i] * y[i];
      }
      g.ds[j] = ds;
      // Y = A W2_e^T: dA = dY W2_e, dW2_e[i][c] += dY[i] A[c].
      for (int64_t c = 0; c < n; ++c) {
        double acc = 0.0;
        for (int64_t i = 0; i < d; ++i) acc += dy[i] * w2e[i * n + c];
        da[c] = acc;
      }
      for (int64_t i = 0; i < d; ++i)
        for (int64_t c = 0; c < n; ++c) dw2e[i * n + c] += dy[i] * a[c];
      // A = SwiGLU(H).
      for (int64_t c = 0; c < n; ++c) dswiglu_ref(h[2 * c], h[2 * c + 1], da[c], &dh[2 * c], &dh[2 * c + 1]);
      // H = x W1_e^T: dW1_e[c][i] += dH[c] x[i], dx[t][i] += dH[c] W1_e[c][i].
      for (int64_t c = 0; c < 2 * n; ++c)
        for (int64_t i = 0; i < d; ++i) {
          dw1e[c * d + i] += dh[c] * xt[i];
          g.dx[t * d + i] += dh[c] * w1e[c * d + i];
        }
    }
  }
  return g;
}

ExpertGrads experts_backward_sonic_ref(const std::vector<double>& x, const std::vector<double>& dO,
                                       const MoEShape& s, const MoEWeights& w,
                                       const GeneralRouting& r, const RoutingMetadata& m,
                                       const std::vector<double>& h) {
  check_expert_inputs(x, s, w, r, m);
  const int64_t T = s.T, d = s.d, n = s.n, E = s.E;
  const int64_t nnz = r.nnz();
  require(static_cast<int64_t>(dO.size()) == T * d, "dO size != T*d");
  require(static_cast<int64_t>(h.size()) == nnz * 2 * n, "h size != nnz*2n");

  ExpertGrads g;
  g.dx.assign(static_cast<size_t>(T * d), 0.0);
  g.dw1.assign(static_cast<size_t>(E * 2 * n * d), 0.0);
  g.dw2.assign(static_cast<size_t>(E * d * n), 0.0);
  g.ds.assign(static_cast<size_t>(nnz), 0.0);

  // Step 1 (dH kernel): per grouped row, dA' = dO[t] W2_e, A = SwiGLU(H),
  // dH = dSwiGLU(H) applied to s*dA', A' = s*A, dS = <dA', A>.
  std::vector<double> dH(static_cast<size_t>(nnz * 2 * n), 0.0);
  std::vector<double> Ap(static_cast<size_t>(nnz * n), 0.0);
  std::vector<double> dap(static_cast<size_t>(n)), a(static_cast<size_t>(n));
  for (int64_t e = 0; e < E; ++e) {
    const double* w2e = w.w2.data() + e * d * n;
    for (int64_t row = m.expert_offset[e]; row < m.expert_offset[e + 1]; ++row) {
      const int64_t j = m.scatter_idx[row];
      const int64_t t = m.gather_idx[row];
      const double sc = r.score[j];
      const double* dot = dO.data() + t * d;
      const double* hr = h.data() + row * 2 * n;
      for (int64_t c = 0; c < n; ++c) {
        double acc = 0.0;
        for (int64_t i = 0; i < d; ++i) acc += dot[i] * w2e[i * n + c];
        dap[c] = acc;
      }
      double ds = 0.0;
      for (int64_t c = 0; c < n; ++c) {
        a[c] = swiglu_ref(hr[2 * c], hr[2 * c + 1]);
        dswiglu_ref(hr[2 * c], hr[2 * c + 1], sc * dap[c], &dH[row * 2 * n + 2 * c],
                    &dH[row * 2 * n + 2 * c + 1]);
        Ap[row * n + c] = sc * a[c];
        ds += dap[c] * a[c];
      }
      g.ds[j] = ds;
    }
  }

  // Steps 2, 4, 5: dW2_e = A'_e^T dO_e (laid out [d][n]), dW1_e = dH_e^T X_e (laid out [2n][d]),
  // dX~ = dH W1^T per row, then dX[t] = sum over the entries of t (gather-sum, entry order).
  std::vector<double> dxt(static_cast<size_t>(nnz * d), 0.0);
  for (int64_t e = 0; e < E; ++e) {
    const double* w1e = w.w1.data() + e * 2 * n * d;
    double* dw1e = g.dw1.data() + e * 2 * n * d;
    double* dw2e = g.dw2.data() + e * d * n;
    for (int64_t row = m.expert_offset[e]; row < m.expert_offset[e + 1]; ++row) {
      const int64_t t = m.gather_idx[row];
      const double* xt = x.data() + t * d;
      const double* dot = dO.data() + t * d;
      const double* dh = dH.data() + row * 2 * n;
      const double* ap = Ap.data() + row * n;
      for (int64_t i = 0; i < d; ++i)
        for (int64_t c = 0; c < n; ++c) dw2e[i * n + c] += dot[i] * ap[c];
      for (int64_t c = 0; c < 2 * n; ++c)
        for (int64_t i = 0; i < d; ++i) dw1e[c * d + i] += dh[c] * xt[i];
      for (int64_t i = 0; i < d; ++i) {
        double acc = 0.0;
        for (int64_t c = 0; c < 2 * n; ++c) acc += dh[c] * w1e[c * d + i];
        dxt[row * d + i] = acc;
      }
    }
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = r.token_offset[t]; j < r.token_offset[t + 1]; ++j) {
      const int64_t row = m.reverse_scatter_idx[j];
      for (int64_t i = 0; i < d; ++i) g.dx[t * d + i] += dxt[row * d + i];
    }
  return g;
}

LayerForward layer_forward_ref(const std::vector<double>& x, const MoEShape& s,
                               const MoEWeights& w) {
  const int64_t T = s.T, d = s.d, E = s.E;
  require(T >= 0 && d >= 1 && E >= 1, "bad MoEShape");
  require(static_cast<int64_t>(x.size()) == T * d, "x size != T*d");
  require(static_cast<int64_t>(w.w_router.size()) == E * d, "w_router size != E*d");

  LayerForward f;
  f.logits.assign(static_cast<size_t>(T * E), 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      double acc = 0.0;
      for (int64_t i = 0; i < d; ++i) acc += x[t * d + i] * w.w_router[e * d + i];
      f.logits[t * E + e] = acc;
    }
  f.routing = topk_softmax_ref(f.logits, T, s.E, s.K);
  f.general = to_general(f.routing);
  f.meta = routing_metadata_ref(f.general);
  f.experts = experts_forward_ref(x, s, w, f.general, f.meta);
  return f;
}

LayerForward layer_forward_tr_ref(const std::vector<double>& x, const MoEShape& s, const MoEWeights& w,
                                  int m_tile, RoundingMode mode, uint64_t seed) {
  LayerForward f = layer_forward_ref(x, s, w);
  f.token_rounding = true;
  f.general = token_rounding_ref(f.logits, s.T, s.E, s.K, m_tile, mode, seed);
  f.meta = routing_metadata_ref(f.general);
  f.experts = experts_forward_ref(x, s, w, f.general, f.meta);
  return f;
}

LayerGrads layer_backward_ref(const std::vector<double>& x, const std::vector<double>& dO,
                              const MoEShape& s, const MoEWeights& w, const LayerForward& f,
                              BackwardMethod method) {
  const int64_t T = s.T, d = s.d, E = s.E;
  require(static_cast<int64_t>(w.w_router.size()) == E * d, "w_router size != E*d");
  ExpertGrads eg =
      method == BackwardMethod::kChainRule
          ? experts_backward_chain_ref(x, dO, s, w, f.general, f.meta, f.experts)
          : experts_backward_sonic_ref(x, dO, s, w, f.general, f.meta, f.experts.h);

  LayerGrads g;
  g.dlogits = f.token_rounding ? token_rounding_router_backward_ref(f.logits, f.routing, f.general, eg.ds)
                               : router_backward_ref(f.routing, eg.ds);
  g.dx = std::move(eg.dx);
  g.dw1 = std::move(eg.dw1);
  g.dw2 = std::move(eg.dw2);
  g.ds = std::move(eg.ds);
  g.dw_router.assign(static_cast<size_t>(E * d), 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      const double dl = g.dlogits[t * E + e];
      for (int64_t i = 0; i < d; ++i) {
        g.dx[t * d + i] += dl * w.w_router[e * d + i];   // dx += dlogits w_router
        g.dw_router[e * d + i] += dl * x[t * d + i];     // dw_router = dlogits^T x
      }
    }
  return g;
}

}  // namespace ref
}  // namespace smoe
