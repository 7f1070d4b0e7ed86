// The expert-major layer on the GPU (smoe/expert_major.h) against its float64 twin
// (ref::expert_major_forward_ref / _backward_ref) at fresh random inputs: every gate/up layout,
// probs on and off, contiguous and segmented rows with padding (NaN in x, probs and dout there),
// empty experts, one hot expert, counts that are not multiples of the tile, E = 1 and 512, R = 0;
// outputs poisoned before each call (every element must be written), bitwise repeats, and bad
// counts (NaN outputs and kStatusInvalidCounts; the backward of that forward NaN-fills too).
#include <cuda_bf16.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "gpu/gpu_util.h"
#include "smoe/expert_major.h"
#include "smoe/reference.h"
#include "support/test_seed.h"

namespace {

using smoe::bf16;
using smoe::ExpertMajorShape;
using smoe::GateUpLayout;
using smoe_test::DeviceBuffer;
namespace ref = smoe::ref;

constexpr double kTol = 1e-2;  // relative L2, bf16 data

double rel_l2(const std::vector<float>& a, const std::vector<double>& b, const std::vector<char>& keep) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!keep.empty() && !keep[i]) continue;
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += b[i] * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);  // NaN in a fails every comparison
}

std::vector<float> to_float(const std::vector<bf16>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = __bfloat162float(v[i]);
  return r;
}

// bf16 values and the same values as double.
void fill(std::vector<bf16>* b, std::vector<double>* d, size_t n, double scale, std::mt19937_64& rng) {
  std::normal_distribution<double> nd(0.0, scale);
  b->resize(n);
  d->resize(n);
  for (size_t i = 0; i < n; ++i) {
    (*b)[i] = __float2bfloat16(static_cast<float>(nd(rng)));
    (*d)[i] = __bfloat162float((*b)[i]);
  }
}

struct Case {
  int64_t R;
  int d, n, E;
  GateUpLayout gu;
  bool probs, segmented;
  std::vector<int32_t> counts, seg;  // seg: [E+1] when segmented
  std::string name() const {
    return "R" + std::to_string(R) + " d" + std::to_string(d) + " n" + std::to_string(n) + " E" + std::to_string(E) +
           " gu" + std::to_string(static_cast<int>(gu)) + (probs ? " probs" : "") + (segmented ? " seg" : "");
  }
};

// Counts summing to `valid` rows with a pattern: 0 uniform-ish, 1 one hot expert, 2 half empty.
std::vector<int32_t> make_counts(int E, int64_t valid, int pattern, std::mt19937_64& rng) {
  std::vector<int32_t> c(E, 0);
  if (pattern == 1) {
    c[E / 2] = static_cast<int32_t>(valid);
    return c;
  }
  std::vector<double> wgt(E);
  std::uniform_real_distribution<double> u(0.2, 1.0);
  for (int e = 0; e < E; ++e) wgt[e] = (pattern == 2 && e % 2 == 0) ? 0.0 : u(rng);
  double sum = 0;
  for (double w : wgt) sum += w;
  int64_t left = valid;
  for (int e = 0; e < E; ++e) {
    c[e] = static_cast<int32_t>(std::floor(valid * wgt[e] / sum));
    left -= c[e];
  }
  for (int e = E - 1; left > 0; e = (e + E - 1) % E)
    if (wgt[e] > 0) { ++c[e]; --left; }
  return c;
}

// Segments: each expert's count plus a random padding tail (capacity / alignment), rows past the
// last segment are padding too; returns R.
int64_t make_segments(const std::vector<int32_t>& counts, int lead, std::mt19937_64& rng, std::vector<int32_t>* seg) {
  std::uniform_int_distribution<int> pad(0, 40);
  seg->assign(counts.size() + 1, 0);
  int64_t r = lead;
  for (size_t e = 0; e < counts.size(); ++e) {
    (*seg)[e] = static_cast<int32_t>(r);
    r += counts[e] + pad(rng);
  }
  seg->back() = static_cast<int32_t>(r);
  return r + 17;
}

struct Result {
  std::vector<bf16> out, dx, dw1, dw3, dw2;
  std::vector<float> dprobs;
  smoe::DeviceStatus status{};
  smoe::Status fwd, bwd;
};

struct Layer {
  Case c;
  uint64_t seed;
  // host
  std::vector<bf16> x, w1, w3, w2, dout;
  std::vector<double> xd, w1d, w3d, w2d, doutd;  // w1d / w3d as stored (layout of c.gu)
  std::vector<float> probs;
  // device
  DeviceBuffer<bf16> dx_, dw1_, dw3_, dw2_, x_, w1_, w3_, w2_, dout_, out_;
  DeviceBuffer<float> probs_, dprobs_;
  DeviceBuffer<int32_t> counts_, seg_;
  DeviceBuffer<uint8_t> saved_, wsf_, wsb_, wsb_consume_;
  DeviceBuffer<smoe::DeviceStatus> status_;

  ExpertMajorShape shape() const {
    ExpertMajorShape s;
    s.rows = c.R;
    s.d = c.d;
    s.n = c.n;
    s.E = c.E;
    s.gate_up = c.gu;
    s.probs = c.probs;
    s.segmented = c.segmented;
    return s;
  }

  explicit Layer(const Case& cs, uint64_t sd) : c(cs), seed(sd) {
    std::mt19937_64 rng(seed);
    const size_t R = c.R, d = c.d, n = c.n, E = c.E;
    const bool sep = c.gu == GateUpLayout::kSeparate;
    fill(&x, &xd, R * d, 1.0, rng);
    fill(&w1, &w1d, E * (sep ? 1 : 2) * n * d, 1.0 / std::sqrt(double(d)), rng);
    if (sep) fill(&w3, &w3d, E * n * d, 1.0 / std::sqrt(double(d)), rng);
    fill(&w2, &w2d, E * d * n, 1.0 / std::sqrt(double(n)), rng);
    fill(&dout, &doutd, R * d, 1.0, rng);
    if (c.probs) {
      std::uniform_real_distribution<float> u(0.05f, 1.0f);
      probs.resize(R);
      for (auto& p : probs) p = u(rng);
    }
    // Padding rows hold NaN in x, dout and probs: the layer must not read them.
    std::vector<int32_t> row_expert;
    std::vector<int64_t> begin;
    if (ref::expert_major_rows_ref(c.counts, c.segmented ? c.seg : std::vector<int32_t>{}, c.R, &begin, &row_expert)) {
      const bf16 nan = __float2bfloat16(NAN);
      for (size_t r = 0; r < R; ++r)
        if (row_expert[r] < 0) {
          for (size_t j = 0; j < d; ++j) x[r * d + j] = dout[r * d + j] = nan;
          if (c.probs) probs[r] = NAN;
        }
    }
    x_.reset(R * d); x_.upload(x);
    dout_.reset(R * d); dout_.upload(dout);
    w1_.reset(w1.size()); w1_.upload(w1);
    w2_.reset(w2.size()); w2_.upload(w2);
    if (sep) { w3_.reset(w3.size()); w3_.upload(w3); }
    if (c.probs) { probs_.reset(R); probs_.upload(probs); dprobs_.reset(R); }
    counts_.reset(E); counts_.upload(c.counts);
    if (c.segmented) { seg_.reset(E + 1); seg_.upload(c.seg); }
    out_.reset(R * d); dx_.reset(R * d);
    dw1_.reset(w1.size()); dw2_.reset(w2.size());
    if (sep) dw3_.reset(w3.size());
    const ExpertMajorShape s = shape();
    saved_.reset(smoe::expert_major_saved_state_size(s));
    wsf_.reset(smoe::expert_major_forward_workspace_size(s));
    wsb_.reset(smoe::expert_major_backward_workspace_size(s));
    wsb_consume_.reset(smoe::expert_major_backward_workspace_size(s, true));
    status_.reset(1);
  }

  smoe::ExpertMajorWeights weights() const { return {w1_.get(), w3_.get(), w2_.get()}; }

  // consume: the backward writes dH over the saved H (ExpertMajorBackwardArgs::consume_saved), in its
  // smaller workspace. Both workspaces are poisoned: a read of bytes no kernel of the call wrote (dX~
  // is carved over A') meets NaN, not stale values of the run before.
  smoe::ExpertMajorBackwardArgs backward_args(bool consume) {
    smoe::ExpertMajorBackwardArgs b;
    b.shape = shape();
    b.x = x_.get();
    b.probs = probs_.get();
    b.weights = weights();
    b.dout = dout_.get();
    b.saved = saved_.get();
    b.saved_bytes = saved_.bytes();
    b.dx = dx_.get();
    b.dw1 = dw1_.get();
    b.dw3 = dw3_.get();
    b.dw2 = dw2_.get();
    b.dprobs = dprobs_.get();
    b.workspace = consume ? wsb_consume_.get() : wsb_.get();
    b.workspace_bytes = consume ? wsb_consume_.bytes() : wsb_.bytes();
    b.status = status_.get();
    b.consume_saved = consume;
    return b;
  }

  Result run(bool consume = false) {
    Result o;
    EXPECT_EQ(wsf_.poison(), cudaSuccess);
    EXPECT_EQ(wsb_.poison(), cudaSuccess);
    EXPECT_EQ(wsb_consume_.poison(), cudaSuccess);
    EXPECT_EQ(out_.poison(), cudaSuccess);
    EXPECT_EQ(dx_.poison(), cudaSuccess);
    EXPECT_EQ(dw1_.poison(), cudaSuccess);
    EXPECT_EQ(dw2_.poison(), cudaSuccess);
    EXPECT_EQ(dw3_.poison(), cudaSuccess);
    EXPECT_EQ(dprobs_.poison(), cudaSuccess);
    EXPECT_EQ(saved_.poison(), cudaSuccess);
    EXPECT_TRUE(smoe::reset_device_status(status_.get(), nullptr).ok());
    smoe::ExpertMajorForwardArgs f;
    f.shape = shape();
    f.x = x_.get();
    f.counts = counts_.get();
    f.segment_offset = seg_.get();
    f.probs = probs_.get();
    f.weights = weights();
    f.out = out_.get();
    f.saved = saved_.get();
    f.saved_bytes = saved_.bytes();
    f.workspace = wsf_.get();
    f.workspace_bytes = wsf_.bytes();
    f.status = status_.get();
    o.fwd = smoe::expert_major_forward(f, nullptr);
    o.bwd = smoe::expert_major_backward(backward_args(consume), nullptr);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    o.out = out_.download();
    o.dx = dx_.download();
    o.dw1 = dw1_.download();
    o.dw3 = dw3_.download();
    o.dw2 = dw2_.download();
    o.dprobs = dprobs_.download();
    o.status = status_.download()[0];
    return o;
  }
};

bool bitwise_equal(const Result& a, const Result& b) {
  auto eq = [](const auto& u, const auto& v) {
    return u.size() == v.size() && (u.empty() || std::memcmp(u.data(), v.data(), u.size() * sizeof(u[0])) == 0);
  };
  return eq(a.out, b.out) && eq(a.dx, b.dx) && eq(a.dw1, b.dw1) && eq(a.dw3, b.dw3) && eq(a.dw2, b.dw2) &&
         eq(a.dprobs, b.dprobs);
}

void check_case(const Case& c) {
  smoe_test::Rng seeder;
  SCOPED_TRACE(c.name() + " seed=" + std::to_string(seeder.seed));
  Layer L(c, seeder.seed);
  const Result o = L.run();
  ASSERT_TRUE(o.fwd.ok()) << o.fwd.message;
  ASSERT_TRUE(o.bwd.ok()) << o.bwd.message;
  EXPECT_EQ(o.status.flags, 0u);
  // The twin on interleaved weights.
  ref::MoEShape rs{0, c.d, c.n, c.E, 1};
  ref::MoEWeights rw;
  rw.w2 = L.w2d;
  if (c.gu == GateUpLayout::kSeparate) rw.w1 = ref::interleave_gate_up(L.w1d, L.w3d, c.E, c.n, c.d);
  else if (c.gu == GateUpLayout::kConcatenated) rw.w1 = ref::concatenated_to_interleaved(L.w1d, c.E, c.n, c.d);
  else rw.w1 = L.w1d;
  std::vector<int32_t> row_expert;
  std::vector<int64_t> begin;
  ASSERT_TRUE(ref::expert_major_rows_ref(c.counts, c.segmented ? c.seg : std::vector<int32_t>{}, c.R, &begin,
                                         &row_expert));
  // The twin reads every row: give it zeros where the GPU saw NaN (padding rows are never read).
  std::vector<double> xr = L.xd, dr = L.doutd, pr;
  for (int64_t r = 0; r < c.R; ++r)
    if (row_expert[r] < 0)
      for (int j = 0; j < c.d; ++j) xr[r * c.d + j] = dr[r * c.d + j] = 0.0;
  if (c.probs) {
    pr.assign(L.probs.begin(), L.probs.end());
    for (int64_t r = 0; r < c.R; ++r)
      if (row_expert[r] < 0) pr[r] = 0.0;
  }
  const ref::ExpertMajorForward f = ref::expert_major_forward_ref(xr, c.R, rs, rw, row_expert, pr);
  const ref::ExpertMajorGrads g = ref::expert_major_backward_ref(xr, dr, c.R, rs, rw, row_expert, pr, f);
  const std::vector<char> all;
  EXPECT_LE(rel_l2(to_float(o.out), f.out, all), kTol) << "out";
  EXPECT_LE(rel_l2(to_float(o.dx), g.dx, all), kTol) << "dx";
  EXPECT_LE(rel_l2(to_float(o.dw2), g.dw2, all), kTol) << "dw2";
  // dw1 in the stored layout.
  if (c.gu == GateUpLayout::kSeparate) {
    std::vector<double> dg, du;
    ref::deinterleave_gate_up(g.dw1, c.E, c.n, c.d, &dg, &du);
    EXPECT_LE(rel_l2(to_float(o.dw1), dg, all), kTol) << "dw1 (gate)";
    EXPECT_LE(rel_l2(to_float(o.dw3), du, all), kTol) << "dw3 (up)";
  } else if (c.gu == GateUpLayout::kConcatenated) {
    EXPECT_LE(rel_l2(to_float(o.dw1), ref::interleaved_to_concatenated(g.dw1, c.E, c.n, c.d), all), kTol) << "dw1";
  } else {
    EXPECT_LE(rel_l2(to_float(o.dw1), g.dw1, all), kTol) << "dw1";
  }
  if (c.probs) {
    std::vector<float> dp(o.dprobs.begin(), o.dprobs.end());
    EXPECT_LE(rel_l2(dp, g.dprobs, all), kTol) << "dprobs";
  }
  // Padding rows: exact zeros (out, dx, dprobs).
  int bad = 0;
  for (int64_t r = 0; r < c.R; ++r) {
    if (row_expert[r] >= 0) continue;
    for (int j = 0; j < c.d; ++j)
      bad += __bfloat162float(o.out[r * c.d + j]) != 0.f || __bfloat162float(o.dx[r * c.d + j]) != 0.f;
    if (c.probs) bad += o.dprobs[r] != 0.f;
  }
  EXPECT_EQ(bad, 0) << "padding rows must be exact zeros";
  // Bitwise: a second call gives the same bytes.
  const Result o2 = L.run();
  EXPECT_TRUE(bitwise_equal(o, o2)) << "two runs differ";
  // consume_saved (dH over the saved H): the same bytes, then the state is spent: the backward again
  // flags it and NaN-fills every gradient, never gradients of the overwritten H.
  const Result o3 = L.run(true);
  ASSERT_TRUE(o3.bwd.ok()) << o3.bwd.message;
  EXPECT_EQ(o3.status.flags, 0u);
  EXPECT_TRUE(bitwise_equal(o, o3)) << "consume_saved differs from the ordinary backward";
  ASSERT_EQ(cudaMemset(L.dw2_.get(), 0, L.dw2_.bytes()), cudaSuccess);  // NaN must come from the call
  ASSERT_TRUE(smoe::expert_major_backward(L.backward_args(true), nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_NE(L.status_.download()[0].flags & smoe::kStatusBadSavedState, 0u) << "a spent state must be flagged";
  for (float v : to_float(L.dw2_.download())) ASSERT_TRUE(std::isnan(v)) << "dw2 after the state was spent";
}

Case make_case(int64_t valid, int d, int n, int E, GateUpLayout gu, bool probs, bool seg, int pattern,
               std::mt19937_64& rng) {
  Case c{0, d, n, E, gu, probs, seg, make_counts(E, valid, pattern, rng), {}};
  if (seg) c.R = make_segments(c.counts, 5, rng, &c.seg);
  else c.R = valid + (pattern == 2 ? 37 : 0);  // trailing padding rows past the last expert
  return c;
}

TEST(GpuExpertMajor, LayoutsProbsSegmentsAgainstFloat64Twin) {
  std::mt19937_64 rng(smoe_test::fresh_seed());
  for (GateUpLayout gu : {GateUpLayout::kInterleaved, GateUpLayout::kSeparate, GateUpLayout::kConcatenated})
    for (bool probs : {false, true})
      for (bool seg : {false, true}) check_case(make_case(1000, 256, 192, 8, gu, probs, seg, 2, rng));
}

TEST(GpuExpertMajor, EdgeShapes) {
  std::mt19937_64 rng(smoe_test::fresh_seed());
  check_case(make_case(777, 128, 128, 1, GateUpLayout::kConcatenated, true, false, 0, rng));   // E = 1
  check_case(make_case(1500, 256, 128, 16, GateUpLayout::kSeparate, true, true, 1, rng));     // one hot expert
  check_case(make_case(3000, 128, 64, 512, GateUpLayout::kConcatenated, true, true, 0, rng)); // E = 512
  check_case(make_case(2048, 512, 384, 32, GateUpLayout::kConcatenated, false, false, 0, rng));
  Case none = make_case(0, 128, 128, 4, GateUpLayout::kSeparate, true, true, 0, rng);  // only padding rows
  check_case(none);
}

TEST(GpuExpertMajor, ZeroRows) {
  Case c{0, 128, 64, 4, GateUpLayout::kSeparate, true, false, {0, 0, 0, 0}, {}};
  Layer L(c, 1);
  const Result o = L.run();
  ASSERT_TRUE(o.fwd.ok()) << o.fwd.message;
  ASSERT_TRUE(o.bwd.ok()) << o.bwd.message;
  EXPECT_EQ(o.status.flags, 0u);
  for (const auto& v : {o.dw1, o.dw3, o.dw2})
    for (bf16 b : v) ASSERT_EQ(__bfloat162float(b), 0.f) << "a weight gradient without rows is zero";
}

// A bad count: every output NaN, the flag set, and the backward of that forward NaN-fills.
TEST(GpuExpertMajor, InvalidCountsGiveNaNAndTheFlag) {
  std::mt19937_64 rng(smoe_test::fresh_seed());
  std::vector<Case> bad;
  Case c = make_case(500, 128, 64, 4, GateUpLayout::kSeparate, true, false, 0, rng);
  c.counts[1] = -3;  // negative
  bad.push_back(c);
  c = make_case(500, 128, 64, 4, GateUpLayout::kSeparate, true, false, 0, rng);
  c.counts[3] += 1;  // past R
  bad.push_back(c);
  c = make_case(500, 128, 64, 4, GateUpLayout::kConcatenated, false, true, 0, rng);
  c.counts[0] = c.seg[1] - c.seg[0] + 1;  // past its segment
  bad.push_back(c);
  c = make_case(500, 128, 64, 4, GateUpLayout::kInterleaved, false, true, 0, rng);
  std::swap(c.seg[1], c.seg[2]);  // decreasing offsets
  bad.push_back(c);
  for (const Case& b : bad) {
    SCOPED_TRACE(b.name());
    Layer L(b, 7);
    const Result o = L.run();
    ASSERT_TRUE(o.fwd.ok()) << o.fwd.message;  // counts are device data: reported there
    ASSERT_TRUE(o.bwd.ok()) << o.bwd.message;
    EXPECT_NE(o.status.flags & smoe::kStatusInvalidCounts, 0u);
    auto all_nan = [](const std::vector<bf16>& v) {
      for (bf16 x : v)
        if (!std::isnan(__bfloat162float(x))) return false;
      return true;
    };
    EXPECT_TRUE(all_nan(o.out)) << "out";
    EXPECT_TRUE(all_nan(o.dx)) << "dx";
    EXPECT_TRUE(all_nan(o.dw1)) << "dw1";
    EXPECT_TRUE(all_nan(o.dw2)) << "dw2";
  }
}

}  // namespace
