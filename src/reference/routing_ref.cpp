// float64 CPU reference: routing (top-K softmax, metadata), SwiGLU, helpers.
// Written for clarity, not speed. See include/smoe/reference.h for the spec.
#include "smoe/reference.h"
#include "ref_require.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

namespace smoe {
namespace ref {

namespace {

using detail::require;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Routing
// ---------------------------------------------------------------------------------------------

TopKRouting topk_softmax_ref(const std::vector<double>& logits, int64_t T, int E, int K) {
  require(T >= 0, "topk_softmax_ref: T < 0");
  require(E >= 1, "topk_softmax_ref: E < 1");
  require(K >= 1 && K <= E, "topk_softmax_ref: K must be in [1, E]");
  require(static_cast<int64_t>(logits.size()) == T * E, "topk_softmax_ref: logits size != T*E");

  TopKRouting r;
  r.T = T;
  r.E = E;
  r.K = K;
  r.expert.assign(static_cast<size_t>(T * K), 0);
  r.score.assign(static_cast<size_t>(T * K), 0.0);

  std::vector<int> order(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    const double* row = logits.data() + t * E;
    std::iota(order.begin(), order.end(), 0);
    // Descending logit; the stable sort keeps equal logits in ascending expert order.
    std::stable_sort(order.begin(), order.end(),
                     [row](int a, int b) { return row[a] > row[b]; });
    // Softmax over the K chosen logits, max subtracted (the first chosen is the max).
    const double mx = row[order[0]];
    double sum = 0.0;
    for (int k = 0; k < K; ++k) sum += std::exp(row[order[k]] - mx);
    for (int k = 0; k < K; ++k) {
      r.expert[t * K + k] = order[k];
      r.score[t * K + k] = std::exp(row[order[k]] - mx) / sum;
    }
  }
  return r;
}

GeneralRouting to_general(const TopKRouting& r) {
  require(static_cast<int64_t>(r.expert.size()) == r.T * r.K &&
              static_cast<int64_t>(r.score.size()) == r.T * r.K,
          "to_general: expert/score size != T*K");
  GeneralRouting g;
  g.T = r.T;
  g.E = r.E;
  g.token_offset.resize(static_cast<size_t>(r.T + 1));
  for (int64_t t = 0; t <= r.T; ++t) g.token_offset[t] = t * r.K;
  g.expert = r.expert;
  g.score = r.score;
  return g;
}

RoutingMetadata routing_metadata_ref(const GeneralRouting& r) {
  require(r.E >= 1, "routing_metadata_ref: E < 1");
  require(static_cast<int64_t>(r.token_offset.size()) == r.T + 1,
          "routing_metadata_ref: token_offset size != T+1");
  const int64_t nnz = r.nnz();
  require(static_cast<int64_t>(r.expert.size()) == nnz, "routing_metadata_ref: expert size != nnz");
  require(r.token_offset[0] == 0, "routing_metadata_ref: token_offset[0] != 0");

  RoutingMetadata m;
  m.expert_frequency.assign(static_cast<size_t>(r.E), 0);
  for (int64_t j = 0; j < nnz; ++j) {
    const int32_t e = r.expert[j];
    require(e >= 0 && e < r.E, "routing_metadata_ref: expert index out of range");
    m.expert_frequency[e] += 1;
  }
  m.expert_offset.assign(static_cast<size_t>(r.E + 1), 0);
  for (int e = 0; e < r.E; ++e) m.expert_offset[e + 1] = m.expert_offset[e] + m.expert_frequency[e];

  // Token of each entry.
  std::vector<int32_t> entry_token(static_cast<size_t>(nnz));
  for (int64_t t = 0; t < r.T; ++t) {
    require(r.token_offset[t + 1] >= r.token_offset[t], "routing_metadata_ref: token_offset decreasing");
    for (int64_t j = r.token_offset[t]; j < r.token_offset[t + 1]; ++j)
      entry_token[j] = static_cast<int32_t>(t);
  }

  // Stable counting sort: by expert, then by entry index.
  m.scatter_idx.assign(static_cast<size_t>(nnz), 0);
  m.reverse_scatter_idx.assign(static_cast<size_t>(nnz), 0);
  m.gather_idx.assign(static_cast<size_t>(nnz), 0);
  std::vector<int64_t> cursor(m.expert_offset.begin(), m.expert_offset.end() - 1);
  for (int64_t j = 0; j < nnz; ++j) {
    const int64_t row = cursor[r.expert[j]]++;
    m.scatter_idx[row] = static_cast<int32_t>(j);
    m.reverse_scatter_idx[j] = static_cast<int32_t>(row);
    m.gather_idx[row] = entry_token[j];
  }
  return m;
}

// ---------------------------------------------------------------------------------------------
// SwiGLU
// ---------------------------------------------------------------------------------------------

namespace {
double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }
}  // namespace

double swiglu_ref(double g, double u) { return g * sigmoid(g) * u; }

void dswiglu_ref(double g, double u, double da, double* dg, double* du) {
  const double sig = sigmoid(g);
  const double silu = g * sig;
  *dg = da * u * (sig + silu * (1.0 - sig));
  *du = da * silu;
}

// ---------------------------------------------------------------------------------------------
// Layout conversion and comparison
// ---------------------------------------------------------------------------------------------

std::vector<double> interleave_gate_up(const std::vector<double>& gate,
                                       const std::vector<double>& up, int E, int n, int d) {
  const int64_t sz = static_cast<int64_t>(E) * n * d;
  require(static_cast<int64_t>(gate.size()) == sz && static_cast<int64_t>(up.size()) == sz,
          "interleave_gate_up: gate/up size != E*n*d");
  std::vector<double> w1(static_cast<size_t>(2 * sz));
  for (int64_t e = 0; e < E; ++e)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < d; ++i) {
        w1[(e * 2 * n + 2 * j) * d + i] = gate[(e * n + j) * d + i];
        w1[(e * 2 * n + 2 * j + 1) * d + i] = up[(e * n + j) * d + i];
      }
  return w1;
}

void deinterleave_gate_up(const std::vector<double>& w1, int E, int n, int d,
                          std::vector<double>* gate, std::vector<double>* up) {
  const int64_t sz = static_cast<int64_t>(E) * n * d;
  require(static_cast<int64_t>(w1.size()) == 2 * sz, "deinterleave_gate_up: w1 size != E*2n*d");
  if (gate) gate->assign(static_cast<size_t>(sz), 0.0);
  if (up) up->assign(static_cast<size_t>(sz), 0.0);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < d; ++i) {
        if (gate) (*gate)[(e * n + j) * d + i] = w1[(e * 2 * n + 2 * j) * d + i];
        if (up) (*up)[(e * n + j) * d + i] = w1[(e * 2 * n + 2 * j + 1) * d + i];
      }
}

double rel_l2(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::quiet_NaN();
  double num = 0.0, den = 0.0, na = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double diff = a[i] - b[i];
    num += diff * diff;
    den += b[i] * b[i];
    na += a[i] * a[i];
  }
  if (std::isnan(num) || std::isnan(den)) return std::numeric_limits<double>::quiet_NaN();
  if (den == 0.0) return std::sqrt(na);
  return std::sqrt(num) / std::sqrt(den);
}

}  // namespace ref
}  // namespace smoe
