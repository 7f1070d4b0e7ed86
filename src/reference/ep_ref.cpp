// float64 reference of the expert-parallel layout and forward (see smoe/reference.h, "Expert
// parallelism"): the spec the NCCL dispatch / combine kernels are checked against.
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "smoe/reference.h"
#include "ref_require.h"

namespace smoe {
namespace ref {

namespace {
using detail::require;
}  // namespace

EpLayout ep_layout_ref(const std::vector<GeneralRouting>& rt, int R) {
  require(R >= 1 && static_cast<int>(rt.size()) == R, "ep_layout_ref: one routing per rank");
  const int E = rt[0].E;
  require(E >= R && E % R == 0, "ep_layout_ref: E must be a multiple of R");
  const int El = E / R;
  EpLayout L;
  L.R = R;
  L.E = E;
  L.send_tokens.assign(static_cast<size_t>(R) * R, {});
  // Which ranks each token goes to: once per rank owning one of its experts, ascending token.
  for (int s = 0; s < R; ++s) {
    require(rt[s].E == E, "ep_layout_ref: every rank routes over the same E experts");
    for (int64_t t = 0; t < rt[s].T; ++t) {
      std::vector<char> to(static_cast<size_t>(R), 0);
      for (int64_t j = rt[s].token_offset[t]; j < rt[s].token_offset[t + 1]; ++j) to[rt[s].expert[j] / El] = 1;
      for (int r = 0; r < R; ++r)
        if (to[r]) L.send_tokens[s * R + r].push_back(t);
    }
  }
  L.rank.resize(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) {
    EpRankLayout& K = L.rank[r];
    // Receive slots: prefix sums over source ranks (each source needs only the counts: an R x R
    // exchange, then every slot is known without atomics).
    K.recv_offset.assign(static_cast<size_t>(R), 0);
    int64_t slots = 0;
    for (int s = 0; s < R; ++s) {
      K.recv_offset[s] = slots;
      for (int64_t t : L.send_tokens[s * R + r]) {
        K.recv_src_rank.push_back(s);
        K.recv_src_token.push_back(t);
      }
      slots += static_cast<int64_t>(L.send_tokens[s * R + r].size());
    }
    // Grouped rows: by local expert, then by receive slot.
    K.expert_offset.assign(static_cast<size_t>(El) + 1, 0);
    for (int l = 0; l < El; ++l) {
      const int e = r * El + l;
      for (int64_t slot = 0; slot < slots; ++slot) {
        const int s = K.recv_src_rank[slot];
        const int64_t t = K.recv_src_token[slot];
        for (int64_t j = rt[s].token_offset[t]; j < rt[s].token_offset[t + 1]; ++j)
          if (rt[s].expert[j] == e) {
            K.row_slot.push_back(slot);
            K.row_src_rank.push_back(s);
            K.row_src_entry.push_back(j);
          }
      }
      K.expert_offset[l + 1] = static_cast<int64_t>(K.row_slot.size());
    }
  }
  return L;
}

std::vector<std::vector<double>> ep_experts_forward_ref(const std::vector<std::vector<double>>& xs,
                                                        const MoEShape& sh, const MoEWeights& w,
                                                        const std::vector<GeneralRouting>& rt,
                                                        const EpLayout& L) {
  const int R = L.R, El = L.E / L.R;
  const int64_t d = sh.d, n = sh.n;
  require(static_cast<int>(xs.size()) == R, "ep_experts_forward_ref: one x per rank");
  std::vector<std::vector<double>> out(static_cast<size_t>(R));
  for (int s = 0; s < R; ++s) out[s].assign(static_cast<size_t>(rt[s].T * d), 0.0);
  for (int r = 0; r < R; ++r) {
    const EpRankLayout& K = L.rank[r];
    const int64_t slots = static_cast<int64_t>(K.recv_src_token.size());
    // Dispatch: the receive buffer.
    std::vector<double> recv(static_cast<size_t>(slots * d));
    for (int64_t slot = 0; slot < slots; ++slot)
      for (int64_t i = 0; i < d; ++i) recv[slot * d + i] = xs[K.recv_src_rank[slot]][K.recv_src_token[slot] * d + i];
    // Expert GEMMs on the grouped rows, gathering A from the receive buffer; score-weighted Y.
    const int64_t rows = static_cast<int64_t>(K.row_slot.size());
    std::vector<double> sy(static_cast<size_t>(rows * d), 0.0);
    std::vector<double> h(static_cast<size_t>(2 * n)), a(static_cast<size_t>(n));
    for (int l = 0; l < El; ++l) {
      const int64_t e = static_cast<int64_t>(r) * El + l;
      const double* w1e = w.w1.data() + e * 2 * n * d;
      const double* w2e = w.w2.data() + e * d * n;
      for (int64_t row = K.expert_offset[l]; row < K.expert_offset[l + 1]; ++row) {
        const double* xt = recv.data() + K.row_slot[row] * d;
        for (int64_t c = 0; c < 2 * n; ++c) {
          double acc = 0.0;
          for (int64_t i = 0; i < d; ++i) acc += xt[i] * w1e[c * d + i];
          h[c] = acc;
        }
        for (int64_t j = 0; j < n; ++j) a[j] = swiglu_ref(h[2 * j], h[2 * j + 1]);
        const double score = rt[K.row_src_rank[row]].score[K.row_src_entry[row]];
        for (int64_t i = 0; i < d; ++i) {
          double acc = 0.0;
          for (int64_t j = 0; j < n; ++j) acc += a[j] * w2e[i * n + j];
          sy[row * d + i] = score * acc;
        }
      }
    }
    // Combine on rank r: per receive slot, its rows in the token's entry order; one partial row per
    // (token, rank), added at the source (ranks ascending, as the loop over r runs).
    std::vector<std::vector<int64_t>> rows_of_slot(static_cast<size_t>(slots));
    for (int64_t row = 0; row < rows; ++row) rows_of_slot[K.row_slot[row]].push_back(row);
    for (int64_t slot = 0; slot < slots; ++slot) {
      auto& v = rows_of_slot[slot];
      // entry order: rows of one slot come from one token; sort by source entry index
      for (size_t i = 1; i < v.size(); ++i)
        for (size_t j = i; j > 0 && K.row_src_entry[v[j - 1]] > K.row_src_entry[v[j]]; --j) std::swap(v[j - 1], v[j]);
      const int s = K.recv_src_rank[slot];
      double* o = out[s].data() + K.recv_src_token[slot] * d;
      std::vector<double> partial(static_cast<size_t>(d), 0.0);
      for (int64_t row : v)
        for (int64_t i = 0; i < d; ++i) partial[i] += sy[row * d + i];
      for (int64_t i = 0; i < d; ++i) o[i] += partial[i];
    }
  }
  return out;
}

}  // namespace ref
}  // namespace smoe
