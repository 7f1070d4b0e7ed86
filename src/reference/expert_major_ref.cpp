// float64 CPU reference of the expert-major layer (include/smoe/reference.h; the GPU API in
// include/smoe/expert_major.h): rows grouped by expert with padding rows between or after them.
#include "expert_row.h"
#include "ref_require.h"
#include "smoe/reference.h"

namespace smoe {
namespace ref {

namespace {

using detail::require;

void check_inputs(const std::vector<double>& x, int64_t R, const MoEShape& s, const MoEWeights& w,
                  const std::vector<int32_t>& row_expert, const std::vector<double>& probs) {
  const int64_t d = s.d, n = s.n, E = s.E;
  require(R >= 0 && d >= 1 && n >= 1 && E >= 1, "bad expert-major shape");
  require(static_cast<int64_t>(x.size()) == R * d, "x size != R*d");
  require(static_cast<int64_t>(w.w1.size()) == E * 2 * n * d, "w1 size != E*2n*d");
  require(static_cast<int64_t>(w.w2.size()) == E * d * n, "w2 size != E*d*n");
  require(static_cast<int64_t>(row_expert.size()) == R, "row_expert size != R");
  require(probs.empty() || static_cast<int64_t>(probs.size()) == R, "probs size != R");
  for (int32_t e : row_expert) require(e >= -1 && e < E, "row_expert out of [-1, E)");
}

}  // namespace

bool expert_major_rows_ref(const std::vector<int32_t>& counts, const std::vector<int32_t>& segment_offset,
                           int64_t R, std::vector<int64_t>* begin, std::vector<int32_t>* row_expert) {
  const int64_t E = static_cast<int64_t>(counts.size());
  const bool segmented = !segment_offset.empty();
  require(!segmented || static_cast<int64_t>(segment_offset.size()) == E + 1, "segment_offset size != E+1");
  begin->clear();
  row_expert->clear();
  if (segmented) {  // 0 <= off[0] <= off[1] <= ... <= off[E] <= R
    if (segment_offset[0] < 0 || segment_offset[E] > R) return false;
    for (int64_t e = 0; e < E; ++e)
      if (segment_offset[e + 1] < segment_offset[e]) return false;
  }
  std::vector<int64_t> b(static_cast<size_t>(E));
  int64_t next = 0;  // contiguous: the prefix sum of the counts
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c = counts[e];
    b[e] = segmented ? segment_offset[e] : next;
    const int64_t end = segmented ? segment_offset[e + 1] : R;
    if (c < 0 || b[e] + c > end) return false;
    next = b[e] + c;
  }
  *begin = b;
  row_expert->assign(static_cast<size_t>(R), -1);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = b[e]; r < b[e] + counts[e]; ++r) (*row_expert)[r] = static_cast<int32_t>(e);
  return true;
}

ExpertMajorForward expert_major_forward_ref(const std::vector<double>& x, int64_t R, const MoEShape& s,
                                            const MoEWeights& w, const std::vector<int32_t>& row_expert,
                                            const std::vector<double>& probs) {
  check_inputs(x, R, s, w, row_expert, probs);
  const int64_t d = s.d, n = s.n;
  ExpertMajorForward f;
  f.h.assign(static_cast<size_t>(R * 2 * n), 0.0);
  f.a.assign(static_cast<size_t>(R * n), 0.0);
  f.y.assign(static_cast<size_t>(R * d), 0.0);
  f.out.assign(static_cast<size_t>(R * d), 0.0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t e = row_expert[r];
    if (e < 0) continue;  // padding: no work, zeros
    const double* xr = x.data() + r * d;
    const double* w1e = w.w1.data() + e * 2 * n * d;
    const double* w2e = w.w2.data() + e * d * n;
    double* y = f.y.data() + r * d;
    detail::expert_row_forward(xr, w1e, w2e, d, n, f.h.data() + r * 2 * n, f.a.data() + r * n, y);
    const double p = probs.empty() ? 1.0 : probs[r];
    for (int64_t i = 0; i < d; ++i) f.out[r * d + i] = p * y[i];
  }
  return f;
}

ExpertMajorGrads expert_major_backward_ref(const std::vector<double>& x, const std::vector<double>& dout,
                                           int64_t R, const MoEShape& s, const MoEWeights& w,
                                           const std::vector<int32_t>& row_expert,
                                           const std::vector<double>& probs, const ExpertMajorForward& f) {
  check_inputs(x, R, s, w, row_expert, probs);
  const int64_t d = s.d, n = s.n, E = s.E;
  require(static_cast<int64_t>(dout.size()) == R * d, "dout size != R*d");
  require(static_cast<int64_t>(f.h.size()) == R * 2 * n, "h size != R*2n");
  ExpertMajorGrads g;
  g.dx.assign(static_cast<size_t>(R * d), 0.0);
  g.dw1.assign(static_cast<size_t>(E * 2 * n * d), 0.0);
  g.dw2.assign(static_cast<size_t>(E * d * n), 0.0);
  if (!probs.empty()) g.dprobs.assign(static_cast<size_t>(R), 0.0);
  std::vector<double> dap(static_cast<size_t>(n)), dh(static_cast<size_t>(2 * n));
  for (int64_t r = 0; r < R; ++r) {
    const int64_t e = row_expert[r];
    if (e < 0) continue;
    const double p = probs.empty() ? 1.0 : probs[r];
    const double* xr = x.data() + r * d;
    const double* dor = dout.data() + r * d;
    const double* h = f.h.data() + r * 2 * n;
    const double* w1e = w.w1.data() + e * 2 * n * d;
    const double* w2e = w.w2.data() + e * d * n;
    double* dw1e = g.dw1.data() + e * 2 * n * d;
    double* dw2e = g.dw2.data() + e * d * n;
    double dp = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0.0;
      for (int64_t i = 0; i < d; ++i) acc += dor[i] * w2e[i * n + j];
      dap[j] = acc;  // dA' = dout W2_e
      const double a = swiglu_ref(h[2 * j], h[2 * j + 1]);
      dswiglu_ref(h[2 * j], h[2 * j + 1], p * acc, &dh[2 * j], &dh[2 * j + 1]);
      dp += acc * a;
      for (int64_t i = 0; i < d; ++i) dw2e[i * n + j] += dor[i] * p * a;  // dW2 = dout^T A'
    }
    if (!probs.empty()) g.dprobs[r] = dp;
    for (int64_t c = 0; c < 2 * n; ++c)
      for (int64_t i = 0; i < d; ++i) dw1e[c * d + i] += dh[c] * xr[i];
    for (int64_t i = 0; i < d; ++i) {
      double acc = 0.0;
      for (int64_t c = 0; c < 2 * n; ++c) acc += dh[c] * w1e[c * d + i];
      g.dx[r * d + i] = acc;
    }
  }
  return g;
}

namespace {
// Row c of the interleaved w1 of an expert is row concatenated_row(c) of the concatenated one.
int64_t concatenated_row(int64_t c, int64_t n) { return c % 2 == 0 ? c / 2 : n + c / 2; }
std::vector<double> permute_gate_up(const std::vector<double>& w, int E, int n, int d, bool to_interleaved) {
  require(static_cast<int64_t>(w.size()) == int64_t{E} * 2 * n * d, "w1 size != E*2n*d");
  std::vector<double> out(w.size());
  for (int64_t e = 0; e < E; ++e)
    for (int64_t c = 0; c < 2 * n; ++c) {
      const int64_t il = (e * 2 * n + c) * d, cat = (e * 2 * n + concatenated_row(c, n)) * d;
      for (int64_t i = 0; i < d; ++i) {
        if (to_interleaved) out[il + i] = w[cat + i];
        else out[cat + i] = w[il + i];
      }
    }
  return out;
}
}  // namespace

std::vector<double> concatenated_to_interleaved(const std::vector<double>& w1_cat, int E, int n, int d) {
  return permute_gate_up(w1_cat, E, n, d, true);
}
std::vector<double> interleaved_to_concatenated(const std::vector<double>& w1, int E, int n, int d) {
  return permute_gate_up(w1, E, n, d, false);
}

}  // namespace ref
}  // namespace smoe
