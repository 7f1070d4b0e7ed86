// float64 CPU reference: the router backward (dlogits from dS) of top-K softmax routing and of
// token rounding; the twin of src/routing/router_backward.cu. See include/smoe/reference.h for the spec.
#include "smoe/reference.h"
#include "ref_require.h"

#include <algorithm>
#include <cmath>

namespace smoe {
namespace ref {

namespace {

using detail::require;

}  // namespace

std::vector<double> router_backward_ref(const TopKRouting& r, const std::vector<double>& dS) {
  require(static_cast<int64_t>(dS.size()) == r.T * r.K, "router_backward_ref: dS size != T*K");
  std::vector<double> dlogits(static_cast<size_t>(r.T * r.E), 0.0);
  // dS_k - sum_j s_j dS_j = sum_{j != k} s_j (dS_k - dS_j)   (because sum_j s_j = 1).
  // The right-hand side has no cancellation when one score saturates at ~1 (a "hot" expert),
  // where the left-hand side loses every significant digit.
  for (int64_t t = 0; t < r.T; ++t) {
    for (int k = 0; k < r.K; ++k) {
      const int64_t i = t * r.K + k;
      double acc = 0.0;
      for (int j = 0; j < r.K; ++j)
        if (j != k) acc += r.score[t * r.K + j] * (dS[i] - dS[t * r.K + j]);
      dlogits[t * r.E + r.expert[i]] = r.score[i] * acc;
    }
  }
  return dlogits;
}

std::vector<double> token_rounding_router_backward_ref(const std::vector<double>& logits,
                                                       const TopKRouting& topk,
                                                       const GeneralRouting& tr,
                                                       const std::vector<double>& dS) {
  const int64_t T = topk.T;
  const int E = topk.E, K = topk.K;
  require(tr.T == T && tr.E == E, "token_rounding_router_backward_ref: routings disagree on T or E");
  require(static_cast<int64_t>(dS.size()) == tr.nnz(), "token_rounding_router_backward_ref: dS size != nnz");
  require(static_cast<int64_t>(logits.size()) == T * E, "token_rounding_router_backward_ref: logits size");
  std::vector<double> dlogits(static_cast<size_t>(T * E), 0.0);
  std::vector<double> S(static_cast<size_t>(E)), ds_top(static_cast<size_t>(K));
  for (int64_t t = 0; t < T; ++t) {
    const double* row = logits.data() + t * E;
    double mx = row[0], sum = 0.0;
    for (int e = 1; e < E; ++e) mx = std::max(mx, row[e]);
    for (int e = 0; e < E; ++e) sum += std::exp(row[e] - mx);
    for (int e = 0; e < E; ++e) S[e] = std::exp(row[e] - mx) / sum;
    std::fill(ds_top.begin(), ds_top.end(), 0.0);
    double* dl = dlogits.data() + t * E;
    for (int64_t j = tr.token_offset[t]; j < tr.token_offset[t + 1]; ++j) {
      const int e = tr.expert[j];
      int k = 0;
      while (k < K && topk.expert[t * K + k] != e) ++k;
      if (k < K) {
        ds_top[k] = dS[j];  // a kept chosen entry: through the top-K softmax below
      } else {
        const double g = dS[j] * S[e];  // a padded entry: d S_e / d l_j = S_e (delta_ej - S_j)
        dl[e] += g;
        for (int i = 0; i < E; ++i) dl[i] -= g * S[i];
      }
    }
    // The top-K softmax part, in the cancellation-free form of router_backward_ref.
    for (int k = 0; k < K; ++k) {
      double acc = 0.0;
      for (int j = 0; j < K; ++j)
        if (j != k) acc += topk.score[t * K + j] * (ds_top[k] - ds_top[j]);
      dl[topk.expert[t * K + k]] += topk.score[t * K + k] * acc;
    }
  }
  return dlogits;
}

}  // namespace ref
}  // namespace smoe
