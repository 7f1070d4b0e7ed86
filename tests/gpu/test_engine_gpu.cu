// The engine's kernels (src/engine) against their reference twins (engine_ref_gpu.h) at fresh
// random inputs: every epilogue (store, SwiGLU, dSwiGLU + dS), both weight majors, gathered and
// contiguous A, varlen-K with either operand gathered; empty experts, one hot expert, counts not
// multiples of the 128-row tile, column extents that leave a partial column tile, E = 512, and
// rows = 0. Every output is poisoned (bf16 / fp32 NaN) before the call, followed by a guard region
// that must stay poisoned (no write past the end); every call runs twice and must be bitwise
// identical.
#include <algorithm>
#include <cmath>
#include <memory>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <numeric>
#include <random>
#include <vector>

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include "engine/config.h"
#include "engine/engine.h"
#include "engine/heuristic.h"
#include "engine/overrides.h"
#include "gpu/engine_ref_gpu.h"
#include "gpu/gpu_util.h"
#include "test_seed.h"

using smoe_test::DeviceBuffer;
using bf16 = __nv_bfloat16;
namespace eng = smoe::engine;

namespace {

constexpr double kTol = 1e-2;   // relative L2 against the fp32 twin (bf16 outputs)
constexpr size_t kGuard = 4096; // poisoned elements after every output

int sms() {
  int dev = 0, n = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  return n;
}

double rel_l2(const std::vector<double>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1.0));  // NaN (unwritten) never passes
}

template <typename T>
std::vector<double> to_double(const std::vector<T>& v, size_t n) {
  std::vector<double> r(n);
  for (size_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, bf16>) r[i] = __bfloat162float(v[i]);
    else r[i] = v[i];
  }
  return r;
}

// An output buffer of n elements plus a poisoned guard.
template <typename T>
struct Out {
  DeviceBuffer<T> buf;
  size_t n;
  explicit Out(size_t count) : buf(count + kGuard), n(count) { EXPECT_EQ(buf.poison(), cudaSuccess); }
  T* get() { return buf.get(); }
  std::vector<T> all() const { return buf.download(); }
  void expect_guard(const std::vector<T>& h, const char* name) const {
    for (size_t i = n; i < n + kGuard; ++i) {
      uint8_t bytes[sizeof(T)];
      std::memcpy(bytes, &h[i], sizeof(T));
      for (uint8_t b : bytes)
        if (b != 0xFF) {
          ADD_FAILURE() << name << ": guard element " << i - n << " past the end was written";
          return;
        }
    }
  }
};

struct Groups {
  std::vector<int32_t> off;
  int64_t rows = 0;
  DeviceBuffer<int32_t> d_off;
  explicit Groups(const std::vector<int>& counts) : off(counts.size() + 1, 0) {
    for (size_t e = 0; e < counts.size(); ++e) off[e + 1] = off[e] + counts[e];
    rows = off.back();
    d_off.reset(off.size());
    EXPECT_EQ(d_off.upload(off), cudaSuccess);
  }
  int E() const { return static_cast<int>(off.size()) - 1; }
};

std::vector<bf16> random_bf16(size_t n, double sd, std::mt19937_64& g) {
  std::normal_distribution<double> nd(0.0, sd);
  std::vector<bf16> v(n);
  for (auto& x : v) x = __float2bfloat16(static_cast<float>(nd(g)));
  return v;
}

template <typename T>
DeviceBuffer<T>* upload(const std::vector<T>& h) {
  auto* b = new DeviceBuffer<T>(h.size());
  EXPECT_EQ(b->upload(h), cudaSuccess);
  return b;
}

std::vector<int> random_counts(int E, int64_t rows, std::mt19937_64& g, double empty_frac) {
  std::vector<double> w(E);
  std::uniform_real_distribution<double> u(0.2, 1.0), pick(0.0, 1.0);
  for (auto& x : w) x = pick(g) < empty_frac ? 0.0 : u(g);
  const double sum = std::accumulate(w.begin(), w.end(), 0.0);
  std::vector<int> c(E);
  int64_t used = 0;
  for (int e = 0; e < E; ++e) used += (c[e] = sum > 0 ? static_cast<int>(rows * w[e] / sum) : 0);
  for (int e = 0; used < rows; e = (e + 1) % E)
    if (w[e] > 0 || sum == 0) { ++c[e]; ++used; }
  return c;
}

float silu(float g) { return g / (1.f + std::exp(-g)); }

// ---- varlen-M ------------------------------------------------------------------------------
struct MCase {
  std::vector<int> counts;
  int N, K;
  eng::WeightMajor major;
  eng::Epilogue epi;
  bool gather;
  int expect_bn = 0;  // 0: whatever the heuristic picks
};

// dH written over H (dH == H: the layer's MoEBackwardArgs::consume_saved): the epilogue reads each
// H element before the tile that owns it writes the same element, so the result must be bitwise the
// out-of-place one (dH, A', the dS partials), and the bytes past H's end untouched. A read of H after
// another thread's write (a reload, a prefetch across rows, another tile's columns) shows here.
void expect_in_place_dswiglu(const eng::VarlenMArgs& out_of_place, const std::vector<bf16>& Hin,
                             const std::vector<bf16>& want_dH, const std::vector<bf16>& want_ap,
                             const std::vector<float>& want_ds) {
  const size_t nh = static_cast<size_t>(out_of_place.rows) * 2 * out_of_place.N;
  std::unique_ptr<DeviceBuffer<bf16>> HdH(upload(Hin));
  Out<bf16> ap(static_cast<size_t>(out_of_place.rows) * out_of_place.N);
  Out<float> ds(static_cast<size_t>(out_of_place.rows) * eng::ds_partial_tiles(out_of_place.N));
  eng::VarlenMArgs a = out_of_place;
  a.H = HdH->get();
  a.dH = HdH->get();
  a.D2 = ap.get();
  a.ds_partial = ds.get();
  const smoe::Status st = eng::varlen_m(a, sms(), 0);
  ASSERT_TRUE(st.ok()) << st.message;
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<bf16> got = HdH->download();
  EXPECT_EQ(0, std::memcmp(got.data(), want_dH.data(), nh * sizeof(bf16))) << "dH in place over H differs";
  EXPECT_EQ(0, std::memcmp(got.data() + nh, Hin.data() + nh, (Hin.size() - nh) * sizeof(bf16)))
      << "in place: bytes past H's end written";
  EXPECT_EQ(0, std::memcmp(ap.all().data(), want_ap.data(), ap.n * sizeof(bf16))) << "A' (dH in place) differs";
  EXPECT_EQ(0, std::memcmp(ds.all().data(), want_ds.data(), ds.n * sizeof(float))) << "dS (dH in place) differs";
}

void run_m_once(const MCase& c, const char* variant) {
  smoe_test::Rng rng;
  SCOPED_TRACE(testing::Message() << "variant " << variant << " seed " << rng.seed << " N " << c.N << " K " << c.K << " epi "
                                  << static_cast<int>(c.epi) << " major " << static_cast<int>(c.major)
                                  << " gather " << c.gather);
  auto& g = rng.gen;
  Groups gr(c.counts);
  const int E = gr.E();
  const int64_t rows = gr.rows;
  const int64_t a_rows = c.gather ? std::max<int64_t>(1, rows / 3 + 7) : rows;
  std::unique_ptr<DeviceBuffer<bf16>> A(upload(random_bf16(std::max<int64_t>(a_rows, 1) * c.K, 1.0, g)));
  std::unique_ptr<DeviceBuffer<bf16>> B(upload(random_bf16(static_cast<size_t>(E) * c.N * c.K, 1.0 / std::sqrt(c.K), g)));
  std::vector<int32_t> gidx(rows), scatter(rows);
  std::uniform_int_distribution<int64_t> pick(0, a_rows - 1);
  for (auto& x : gidx) x = static_cast<int32_t>(pick(g));
  std::iota(scatter.begin(), scatter.end(), 0);
  std::shuffle(scatter.begin(), scatter.end(), g);
  std::vector<float> scores(rows);
  std::uniform_real_distribution<float> us(0.05f, 1.f);
  for (auto& s : scores) s = us(g);
  std::unique_ptr<DeviceBuffer<int32_t>> d_g(upload(gidx.empty() ? std::vector<int32_t>{0} : gidx));
  std::unique_ptr<DeviceBuffer<int32_t>> d_sc(upload(scatter.empty() ? std::vector<int32_t>{0} : scatter));
  std::unique_ptr<DeviceBuffer<float>> d_s(upload(scores.empty() ? std::vector<float>{0.f} : scores));
  const int n = c.N;  // dSwiGLU: N is n, H/dH have 2n columns
  std::vector<bf16> Hin = random_bf16(static_cast<size_t>(rows) * 2 * n + 8, 1.5, g);
  std::unique_ptr<DeviceBuffer<bf16>> d_H(upload(Hin));

  const int tiles = eng::ds_partial_tiles(c.N);
  Out<bf16> D(static_cast<size_t>(rows) * c.N), D2(static_cast<size_t>(rows) * c.N), dH(static_cast<size_t>(rows) * 2 * c.N);
  Out<float> dsp(static_cast<size_t>(rows) * tiles);

  eng::VarlenMArgs a;
  a.num_experts = E;
  a.N = c.N;
  a.K = c.K;
  a.rows = rows;
  a.expert_offset = gr.d_off.get();
  a.A = A->get();
  a.a_rows = a_rows;
  a.gather_idx = c.gather ? d_g->get() : nullptr;
  a.B = B->get();
  a.b_major = c.major;
  a.epilogue = c.epi;
  a.D = D.get();
  a.D2 = D2.get();
  a.H = d_H->get();
  a.dH = dH.get();
  a.scores = d_s->get();
  a.scatter = d_sc->get();
  a.ds_partial = dsp.get();
  const auto ch = eng::choose_varlen_m(a, eng::device_facts(sms()), eng::overrides());
  if (c.expect_bn && eng::overrides().sched == eng::ForcedSched::kNone && ch) EXPECT_EQ(ch->bn, c.expect_bn);
  ASSERT_EQ(ch ? eng::to_string(*ch) : std::string("(none)"), variant) << "the forced instantiation was not chosen";

  smoe::Status st = eng::varlen_m(a, sms(), 0);
  ASSERT_TRUE(st.ok()) << st.message;
  CUDA_OK(cudaDeviceSynchronize());
  auto hD = D.all(), hD2 = D2.all(), hdH = dH.all();
  auto hds = dsp.all();
  // Bitwise determinism: a second run over the same outputs.
  ASSERT_TRUE(eng::varlen_m(a, sms(), 0).ok());
  CUDA_OK(cudaDeviceSynchronize());
  if (c.epi != eng::Epilogue::kDSwiGLU) EXPECT_EQ(0, std::memcmp(hD.data(), D.all().data(), D.n * 2)) << "D not deterministic";
  if (c.epi != eng::Epilogue::kStore) EXPECT_EQ(0, std::memcmp(hD2.data(), D2.all().data(), D2.n * 2)) << "D2 not deterministic";
  if (c.epi == eng::Epilogue::kDSwiGLU) {
    EXPECT_EQ(0, std::memcmp(hdH.data(), dH.all().data(), dH.n * 2)) << "dH not deterministic";
    EXPECT_EQ(0, std::memcmp(hds.data(), dsp.all().data(), dsp.n * 4)) << "dS not deterministic";
    expect_in_place_dswiglu(a, Hin, hdH, hD2, hds);
  }
  if (rows == 0) {
    D.expect_guard(hD, "D");  // nothing at all may be written: the guard starts at element 0
    return;
  }

  DeviceBuffer<float> ref(static_cast<size_t>(rows) * c.N);
  smoe_test::varlen_m_ref(a, ref.get(), 0);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> R = ref.download();

  if (c.epi == eng::Epilogue::kStore) {
    EXPECT_LT(rel_l2(to_double(hD, D.n), to_double(R, R.size())), kTol);
    D.expect_guard(hD, "D");
  } else if (c.epi == eng::Epilogue::kSwiGLU) {
    EXPECT_LT(rel_l2(to_double(hD, D.n), to_double(R, R.size())), kTol) << "H";
    const size_t na = static_cast<size_t>(rows) * c.N / 2;
    std::vector<double> want(na);
    for (int64_t r = 0; r < rows; ++r)
      for (int j = 0; j < c.N / 2; ++j) {
        const float gg = R[r * c.N + 2 * j], uu = R[r * c.N + 2 * j + 1];
        want[r * (c.N / 2) + j] = silu(gg) * uu;
      }
    EXPECT_LT(rel_l2(to_double(hD2, na), want), kTol) << "A";
    D.expect_guard(hD, "H");
    for (size_t i = na; i < D2.n + kGuard; ++i)
      if (reinterpret_cast<const uint16_t&>(hD2[i]) != 0xFFFF) {
        ADD_FAILURE() << "A written past its end at " << i - na;
        break;
      }
  } else {
    std::vector<double> w_dh(dH.n), w_ap(D2.n), w_ds(rows), got_ds(rows);
    for (int64_t r = 0; r < rows; ++r) {
      const double s = scores[scatter[r]];
      double ds = 0;
      for (int j = 0; j < n; ++j) {
        const double gg = __bfloat162float(Hin[r * 2 * n + 2 * j]), uu = __bfloat162float(Hin[r * 2 * n + 2 * j + 1]);
        const double sig = 1 / (1 + std::exp(-gg)), sl = gg * sig, av = sl * uu;
        const double dap = R[r * n + j];
        ds += dap * av;
        w_dh[r * 2 * n + 2 * j] = s * dap * uu * (sig + sl * (1 - sig));
        w_dh[r * 2 * n + 2 * j + 1] = s * dap * sl;
        w_ap[r * n + j] = s * av;
      }
      w_ds[scatter[r]] = ds;
      double sum = 0;
      for (int t = 0; t < tiles; ++t) sum += hds[r * tiles + t];
      got_ds[scatter[r]] = sum;
    }
    EXPECT_LT(rel_l2(to_double(hdH, dH.n), w_dh), kTol) << "dH";
    EXPECT_LT(rel_l2(to_double(hD2, D2.n), w_ap), kTol) << "A'";
    EXPECT_LT(rel_l2(got_ds, w_ds), 1e-3) << "dS (fp32 from the fp32 accumulator)";
    dH.expect_guard(hdH, "dH");
    D2.expect_guard(hD2, "A'");
    dsp.expect_guard(hds, "ds_partial");
  }
}

// Every instantiation that can run the case's epilogue and weight layout, forced through the
// engine's SMOE_ENGINE_SCHED / _BN_M / _CLUSTER switches (what the heuristic picks is one of them).
void run_m(const MCase& c) {
  const bool store = c.epi == eng::Epilogue::kStore, dswiglu = c.epi == eng::Epilogue::kDSwiGLU;
  const std::string kind = c.epi == eng::Epilogue::kSwiGLU       ? "up_swiglu"
                           : dswiglu                             ? "da_dswiglu"
                           : c.major == eng::WeightMajor::kNK    ? "down_store"
                                                                 : "dx_store";
  struct Run {
    const char* sched;
    const char* bn;
    const char* cluster;
    std::string label;
    const char* staged = "1";  // SMOE_ENGINE_STAGED_STORE: ping-pong stores staged (_pps, _pps2) or not (_pp)
  };
  std::vector<Run> runs = {{"coop", "128", "1", kind + "<128>"}, {"pingpong", "128", "1", kind + "_pp<128>", "0"}};
  if (c.N % 256 == 0) {  // dA' too: cooperative 128 x 256 streams its rows (apply_tile)
    runs.push_back({"coop", "256", "1", kind + "<256>"});
    runs.push_back({"coop", "256", "2", kind + "_c2<256>"});
  }
  if (store) {
    runs.push_back({"pingpong", "128", "1", kind + "_pps<128>"});
    runs.push_back({"pingpong", "192", "1", kind + "_pp<192>", "0"});
    runs.push_back({"pingpong", "192", "1", kind + "_pps<192>"});
    runs.push_back({"pingpong", "128", "1", kind + "_pps2<128>", "2"});
    runs.push_back({"pingpong", "192", "1", kind + "_pps2<192>", "2"});
    runs.push_back({"pingpong", "192", "2", kind + "_pp_c2<192>"});
  } else {
    runs.push_back({"pingpong", "128", "2", kind + "_pp_c2<128>"});
    if (c.N % 256 == 0)  // ping-pong 64 x 256 tiles in pairs (up-proj, dA')
      runs.push_back({"pingpong64", "256", "2", kind + "_pp64_c2<256>"});
  }
  for (const Run& r : runs) {
    setenv("SMOE_ENGINE_SCHED", r.sched, 1);
    setenv("SMOE_ENGINE_BN_M", r.bn, 1);
    setenv("SMOE_ENGINE_CLUSTER", r.cluster, 1);
    setenv("SMOE_ENGINE_STAGED_STORE", r.staged, 1);
    eng::reload_overrides_from_env();
    run_m_once(c, r.label.c_str());
  }
  unsetenv("SMOE_ENGINE_SCHED");
  unsetenv("SMOE_ENGINE_BN_M");
  unsetenv("SMOE_ENGINE_CLUSTER");
  unsetenv("SMOE_ENGINE_STAGED_STORE");
  eng::reload_overrides_from_env();
  // The heuristic's own pick (checks expect_bn), as the layer will run it.
  // Every field the heuristic reads, as run_m_once sets them (without num_experts the lean rules'
  // rows-per-expert limits read E = 0 and the pick differed from the run's on the H100).
  static const int32_t some_index = 0;
  const auto pick = eng::choose_varlen_m([&] {
    eng::VarlenMArgs a;
    a.num_experts = static_cast<int>(c.counts.size());
    a.gather_idx = c.gather ? &some_index : nullptr;
    a.N = c.N;
    a.K = c.K;
    a.rows = std::accumulate(c.counts.begin(), c.counts.end(), int64_t{0});
    a.b_major = c.major;
    a.epilogue = c.epi;
    return a;
  }(), eng::device_facts(sms()), eng::overrides());
  ASSERT_TRUE(pick.has_value());
  run_m_once(c, eng::to_string(*pick).c_str());
}

// ---- varlen-K ------------------------------------------------------------------------------
struct KCase {
  std::vector<int> counts;
  int M, N;
  bool gather_p, gather_q;
  int expect_bn = 0;
  int expect_cluster = 0;  // 0: not checked
};

void run_k(const KCase& c) {
  smoe_test::Rng rng;
  SCOPED_TRACE(testing::Message() << "seed " << rng.seed << " M " << c.M << " N " << c.N << " gather "
                                  << c.gather_p << c.gather_q);
  auto& g = rng.gen;
  Groups gr(c.counts);
  const int E = gr.E();
  const int64_t rows = gr.rows;
  const int64_t src_rows = std::max<int64_t>(1, rows / 2 + 5);
  const int64_t ld_p = c.M + 64, ld_q = c.N;  // a padded P row: ld > M is allowed
  const int64_t p_rows = c.gather_p ? src_rows : std::max<int64_t>(rows, 1);
  const int64_t q_rows = c.gather_q ? src_rows : std::max<int64_t>(rows, 1);
  std::unique_ptr<DeviceBuffer<bf16>> P(upload(random_bf16(p_rows * ld_p, 1.0, g)));
  std::unique_ptr<DeviceBuffer<bf16>> Q(upload(random_bf16(q_rows * ld_q, 1.0, g)));
  std::vector<int32_t> gp(std::max<int64_t>(rows, 1)), gq(std::max<int64_t>(rows, 1));
  std::uniform_int_distribution<int64_t> pick(0, src_rows - 1);
  for (auto& x : gp) x = static_cast<int32_t>(pick(g));
  for (auto& x : gq) x = static_cast<int32_t>(pick(g));
  std::unique_ptr<DeviceBuffer<int32_t>> d_gp(upload(gp)), d_gq(upload(gq));
  Out<bf16> D(static_cast<size_t>(E) * c.M * c.N);

  eng::VarlenKArgs a;
  a.num_experts = E;
  a.M = c.M;
  a.N = c.N;
  a.rows = rows;
  a.expert_offset = gr.d_off.get();
  a.P = P->get();
  a.ld_p = ld_p;
  a.gather_p = c.gather_p ? d_gp->get() : nullptr;
  a.Q = Q->get();
  a.ld_q = ld_q;
  a.gather_q = c.gather_q ? d_gq->get() : nullptr;
  a.D = D.get();
  const auto ck = eng::choose_varlen_k(a, eng::device_facts(sms()), eng::overrides());
  ASSERT_TRUE(ck.has_value());
  if (c.expect_bn) EXPECT_EQ(ck->bn, c.expect_bn);
  if (c.expect_cluster) EXPECT_EQ(ck->cluster, c.expect_cluster);
  smoe::Status st = eng::varlen_k(a, sms(), 0);
  ASSERT_TRUE(st.ok()) << st.message;
  CUDA_OK(cudaDeviceSynchronize());
  auto hD = D.all();
  ASSERT_TRUE(eng::varlen_k(a, sms(), 0).ok());
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(0, std::memcmp(hD.data(), D.all().data(), D.n * 2)) << "dW not deterministic";

  DeviceBuffer<float> ref(D.n);
  smoe_test::varlen_k_ref(a, ref.get(), 0);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> R = ref.download();
  EXPECT_LT(rel_l2(to_double(hD, D.n), to_double(R, R.size())), kTol);
  for (int e = 0; e < E; ++e)
    if (gr.off[e + 1] == gr.off[e])
      for (size_t i = static_cast<size_t>(e) * c.M * c.N; i < static_cast<size_t>(e + 1) * c.M * c.N; ++i)
        if (reinterpret_cast<const uint16_t&>(hD[i]) != 0) {
          ADD_FAILURE() << "empty expert " << e << " has a non-zero gradient element";
          break;
        }
  D.expect_guard(hD, "dW");
}

const std::vector<int> kEdgeCounts = {0, 1, 127, 128, 129, 300, 0, 555, 64, 0};

// ---- gate / up as two tensors (VarlenMArgs::B2, halves) -------------------------------------
// Interleaved column 2c (gate c) is halves column c, 2c + 1 (up c) is n + c.
std::vector<bf16> to_halves(const std::vector<bf16>& inter, int64_t rows, int n) {
  std::vector<bf16> h(inter.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < n; ++c) {
      h[r * 2 * n + c] = inter[r * 2 * n + 2 * c];
      h[r * 2 * n + n + c] = inter[r * 2 * n + 2 * c + 1];
    }
  return h;
}

bool same_bits(const std::vector<bf16>& a, const std::vector<bf16>& b, size_t n) {
  return std::memcmp(a.data(), b.data(), n * sizeof(bf16)) == 0;
}

// Expected bitwise (the same dot product, same K order, in another accumulator column); asserted
// to 1e-6 so that a hardware summation that depends on the column shows as a note, not a failure.
void expect_same(const std::vector<bf16>& got, const std::vector<bf16>& want, size_t n, const char* what) {
  size_t diff = 0;
  for (size_t i = 0; i < n; ++i) diff += std::memcmp(&got[i], &want[i], sizeof(bf16)) != 0;
  if (diff) std::printf("[ note ] %s: %zu of %zu elements differ in their bits from the interleaved run\n", what, diff, n);
  EXPECT_LT(rel_l2(to_double(got, n), to_double(want, n)), 1e-6) << what;
}

// The up-proj, dA' and dX~ with gate/up as two tensors against the interleaved layout (itself
// checked against the fp32 twin above) on the same numbers: H, A, dH and A' bitwise the same after
// the column permutation (each element is the same dot product in the same K order); dS within 1e-6
// (the halves epilogue sums a row's terms in another order); dX~ sums K in another order (gate
// block, then up block), so within the bf16 bound. The two-tensor runs repeat bitwise. Under the forced
// instantiation `sched` / `bn` / `cluster` (cluster 2: the gate and up halves are multicast).
void run_gate_up_once(const std::vector<int>& counts, int n, int d, const char* sched, const char* bn,
                      const char* cluster) {
  smoe_test::Rng rng;
  SCOPED_TRACE(testing::Message() << "gate/up two tensors, seed " << rng.seed << " n " << n << " d " << d << " sched "
                                  << sched << " bn " << bn << " cluster " << cluster);
  setenv("SMOE_ENGINE_SCHED", sched, 1);
  setenv("SMOE_ENGINE_BN_M", bn, 1);
  setenv("SMOE_ENGINE_CLUSTER", cluster, 1);
  eng::reload_overrides_from_env();
  auto& g = rng.gen;
  Groups gr(counts);
  const int E = gr.E();
  const int64_t rows = gr.rows, x_rows = std::max<int64_t>(1, rows / 2 + 3);
  const auto hx = random_bf16(x_rows * d, 1.0, g);
  const auto w1 = random_bf16(static_cast<size_t>(E) * n * d, 1.0 / std::sqrt(d), g);
  const auto w3 = random_bf16(static_cast<size_t>(E) * n * d, 1.0 / std::sqrt(d), g);
  std::vector<bf16> wi(static_cast<size_t>(E) * 2 * n * d);  // interleaved [E][2n][d]
  for (int64_t er = 0; er < static_cast<int64_t>(E) * n; ++er)
    for (int k = 0; k < d; ++k) {
      wi[(2 * er) * d + k] = w1[er * d + k];
      wi[(2 * er + 1) * d + k] = w3[er * d + k];
    }
  std::vector<int32_t> gidx(std::max<int64_t>(rows, 1), 0), scatter(std::max<int64_t>(rows, 1), 0);
  std::uniform_int_distribution<int64_t> pick(0, x_rows - 1);
  for (int64_t r = 0; r < rows; ++r) gidx[r] = static_cast<int32_t>(pick(g));
  std::iota(scatter.begin(), scatter.begin() + rows, 0);
  std::shuffle(scatter.begin(), scatter.begin() + rows, g);
  std::vector<float> scores(std::max<int64_t>(rows, 1));
  std::uniform_real_distribution<float> us(0.05f, 1.f);
  for (auto& v : scores) v = us(g);
  std::unique_ptr<DeviceBuffer<bf16>> X(upload(hx)), W1(upload(w1)), W3(upload(w3)), Wi(upload(wi));
  std::unique_ptr<DeviceBuffer<int32_t>> G(upload(gidx)), SC(upload(scatter));
  std::unique_ptr<DeviceBuffer<float>> S(upload(scores));
  const size_t nh = static_cast<size_t>(rows) * 2 * n, na = static_cast<size_t>(rows) * n;

  // Up-proj: interleaved, then halves.
  Out<bf16> Hi(nh), Ai(na), Hh(nh), Ah(na);
  eng::VarlenMArgs up;
  up.num_experts = E;
  up.N = 2 * n;
  up.K = d;
  up.rows = rows;
  up.expert_offset = gr.d_off.get();
  up.A = X->get();
  up.a_rows = x_rows;
  up.gather_idx = G->get();
  up.b_major = eng::WeightMajor::kNK;
  up.epilogue = eng::Epilogue::kSwiGLU;
  up.B = Wi->get();
  up.D = Hi.get();
  up.D2 = Ai.get();
  smoe::Status st = eng::varlen_m(up, sms(), 0);
  ASSERT_TRUE(st.ok()) << st.message;
  eng::VarlenMArgs uph = up;
  uph.B = W1->get();
  uph.B2 = W3->get();
  uph.halves = true;
  uph.D = Hh.get();
  uph.D2 = Ah.get();
  // The same instantiation as the interleaved run: with a cluster, the halves multicast too.
  const eng::EngineConfig ch = *eng::choose_varlen_m(uph, eng::device_facts(sms()), eng::overrides()),
                          chi = *eng::choose_varlen_m(up, eng::device_facts(sms()), eng::overrides());
  EXPECT_EQ(ch.cluster, chi.cluster) << eng::to_string(ch) << " vs " << eng::to_string(chi);
  EXPECT_EQ(ch.bn, chi.bn) << eng::to_string(ch) << " vs " << eng::to_string(chi);
  st = eng::varlen_m(uph, sms(), 0);
  ASSERT_TRUE(st.ok()) << st.message;
  CUDA_OK(cudaDeviceSynchronize());
  const auto hHi = Hi.all(), hAi = Ai.all(), hHh = Hh.all(), hAh = Ah.all();
  expect_same(hHh, to_halves(hHi, rows, n), nh, "H (halves) vs permuted H (interleaved)");
  expect_same(hAh, hAi, na, "A");
  Hh.expect_guard(hHh, "H (halves)");
  Ah.expect_guard(hAh, "A (halves)");

  // dA': dO gathered (x stands in), B = W2^T: a [E][d][n] weight read MN-major; H from the up-proj.
  const auto w2 = random_bf16(static_cast<size_t>(E) * d * n, 1.0 / std::sqrt(n), g);
  std::unique_ptr<DeviceBuffer<bf16>> W2(upload(w2));
  Out<bf16> dHi(nh), APi(na), dHh(nh), APh(na);
  Out<float> dsi(static_cast<size_t>(rows) * eng::ds_partial_tiles(n)), dsh(static_cast<size_t>(rows) * eng::ds_partial_tiles(n));
  eng::VarlenMArgs da;
  da.num_experts = E;
  da.N = n;
  da.K = d;
  da.rows = rows;
  da.expert_offset = gr.d_off.get();
  da.A = X->get();
  da.a_rows = x_rows;
  da.gather_idx = G->get();
  da.B = W2->get();
  da.b_major = eng::WeightMajor::kKN;
  da.epilogue = eng::Epilogue::kDSwiGLU;
  da.H = Hi.get();
  da.dH = dHi.get();
  da.D2 = APi.get();
  da.scores = S->get();
  da.scatter = SC->get();
  da.ds_partial = dsi.get();
  st = eng::varlen_m(da, sms(), 0);
  ASSERT_TRUE(st.ok()) << st.message;
  eng::VarlenMArgs dah = da;
  dah.halves = true;
  dah.H = Hh.get();
  dah.dH = dHh.get();
  dah.D2 = APh.get();
  dah.ds_partial = dsh.get();
  st = eng::varlen_m(dah, sms(), 0);
  ASSERT_TRUE(st.ok()) << st.message;
  CUDA_OK(cudaDeviceSynchronize());
  const auto hdHi = dHi.all(), hdHh = dHh.all(), hAPi = APi.all(), hAPh = APh.all();
  const auto hdsi = dsi.all(), hdsh = dsh.all();
  expect_same(hdHh, to_halves(hdHi, rows, n), nh, "dH (halves) vs permuted dH");
  expect_same(hAPh, hAPi, na, "A'");
  EXPECT_LT(rel_l2(to_double(hdsh, dsi.n), to_double(hdsi, dsi.n)), 1e-6) << "dS partials";
  dHh.expect_guard(hdHh, "dH (halves)");
  expect_in_place_dswiglu(dah, hHh, hdHh, hAPh, hdsh);  // the halves' 16-byte runs, dH over H

  // dX~ = dH [W1 gate; W3 up]: A = dH by TMA (K = 2n), B MN-major; two tensors split K.
  Out<bf16> Xi(static_cast<size_t>(rows) * d), Xh(static_cast<size_t>(rows) * d);
  eng::VarlenMArgs dx;
  dx.num_experts = E;
  dx.N = d;
  dx.K = 2 * n;
  dx.rows = rows;
  dx.expert_offset = gr.d_off.get();
  dx.A = dHi.get();
  dx.a_rows = rows;
  dx.B = Wi->get();
  dx.b_major = eng::WeightMajor::kKN;
  dx.epilogue = eng::Epilogue::kStore;
  dx.D = Xi.get();
  st = eng::varlen_m(dx, sms(), 0);
  ASSERT_TRUE(st.ok()) << st.message;
  eng::VarlenMArgs dxh = dx;
  dxh.A = dHh.get();
  dxh.B = W1->get();
  dxh.B2 = W3->get();
  dxh.D = Xh.get();
  st = eng::varlen_m(dxh, sms(), 0);
  ASSERT_TRUE(st.ok()) << st.message;
  CUDA_OK(cudaDeviceSynchronize());
  const auto hXi = Xi.all(), hXh = Xh.all();
  EXPECT_LT(rel_l2(to_double(hXh, Xh.n), to_double(hXi, Xi.n)), kTol) << "dX~ (two tensors) vs interleaved";
  Xh.expect_guard(hXh, "dX~ (two tensors)");
  // Bitwise determinism of the two-tensor runs.
  ASSERT_TRUE(eng::varlen_m(uph, sms(), 0).ok());
  ASSERT_TRUE(eng::varlen_m(dah, sms(), 0).ok());
  ASSERT_TRUE(eng::varlen_m(dxh, sms(), 0).ok());
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(same_bits(Hh.all(), hHh, nh)) << "H (halves) not deterministic";
  EXPECT_TRUE(same_bits(dHh.all(), hdHh, nh)) << "dH (halves) not deterministic";
  EXPECT_TRUE(same_bits(APh.all(), hAPh, na)) << "A' (halves) not deterministic";
  EXPECT_EQ(0, std::memcmp(dsh.all().data(), hdsh.data(), dsh.n * sizeof(float))) << "dS (halves) not deterministic";
  EXPECT_TRUE(same_bits(Xh.all(), hXh, Xh.n)) << "dX~ (two tensors) not deterministic";
}

void run_gate_up(const std::vector<int>& counts, int n, int d) {
  const char* runs[][3] = {{"coop", "128", "1"},       {"pingpong", "128", "1"},   {"coop", "256", "1"},
                           {"pingpong", "192", "1"},   {"pingpong", "128", "2"},   {"coop", "256", "2"},
                           {"pingpong64", "256", "2"}};
  for (const auto& r : runs) run_gate_up_once(counts, n, d, r[0], r[1], r[2]);
  unsetenv("SMOE_ENGINE_SCHED");
  unsetenv("SMOE_ENGINE_BN_M");
  unsetenv("SMOE_ENGINE_CLUSTER");
  eng::reload_overrides_from_env();
  run_gate_up_once(counts, n, d, "", "", "");  // the heuristic's picks (empty values: not forced)
  unsetenv("SMOE_ENGINE_SCHED");
  unsetenv("SMOE_ENGINE_BN_M");
  unsetenv("SMOE_ENGINE_CLUSTER");
  eng::reload_overrides_from_env();
}

}  // namespace

TEST(GpuEngine, GateUpTwoTensors) {
  run_gate_up(kEdgeCounts, 128, 192);  // 2n = 256: the 256-wide up-proj tiles too
  run_gate_up(kEdgeCounts, 64, 128);   // the smallest n: one 128-wide tile of pairs, half of it valid at 256
  run_gate_up(kEdgeCounts, 256, 128);  // n = 256: dA' (halves) in 64 x 256 pairs too
  run_gate_up({0, 0, 2000, 0}, 192, 256);  // one hot expert; 2n = 384: a partial 256-wide tile
}

TEST(GpuEngine, GateUpTwoTensorsBadArguments) {
  eng::VarlenMArgs a;
  a.num_experts = 2;
  a.N = 128;
  a.K = 64;
  a.rows = 10;
  a.epilogue = eng::Epilogue::kStore;
  a.b_major = eng::WeightMajor::kNK;  // the down-proj: W2 is one tensor
  a.B2 = reinterpret_cast<const bf16*>(uintptr_t{256});
  smoe::Status s = eng::varlen_m(a, sms(), 0);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message.find("B2 (gate/up as two tensors)"), std::string::npos) << s.message;
  a.epilogue = eng::Epilogue::kSwiGLU;  // B2 without halves
  s = eng::varlen_m(a, sms(), 0);
  EXPECT_NE(s.message.find("set halves"), std::string::npos) << s.message;
  a.B2 = nullptr;
  a.halves = true;  // halves H from an interleaved W1
  s = eng::varlen_m(a, sms(), 0);
  EXPECT_NE(s.message.find("needs B2"), std::string::npos) << s.message;
}

TEST(GpuEngine, StoreWeightsNK) {
  run_m({kEdgeCounts, 192, 128, eng::WeightMajor::kNK, eng::Epilogue::kStore, false});
  run_m({kEdgeCounts, 64, 64, eng::WeightMajor::kNK, eng::Epilogue::kStore, false});
}
TEST(GpuEngine, StoreWeightsKN) {
  run_m({kEdgeCounts, 320, 192, eng::WeightMajor::kKN, eng::Epilogue::kStore, false});
}
TEST(GpuEngine, SwiGLUGathered) {
  run_m({kEdgeCounts, 256, 192, eng::WeightMajor::kNK, eng::Epilogue::kSwiGLU, true});
  run_m({kEdgeCounts, 128, 64, eng::WeightMajor::kNK, eng::Epilogue::kSwiGLU, true});
}
TEST(GpuEngine, DSwiGLUGathered) {
  run_m({kEdgeCounts, 192, 256, eng::WeightMajor::kKN, eng::Epilogue::kDSwiGLU, true});
  run_m({kEdgeCounts, 512, 128, eng::WeightMajor::kKN, eng::Epilogue::kDSwiGLU, true});  // 64 x 256 pairs
  run_m({kEdgeCounts, 64, 64, eng::WeightMajor::kKN, eng::Epilogue::kDSwiGLU, true});
}
TEST(GpuEngine, OneHotExpertAndK1) {
  // One expert takes every row; a single expert (E = 1, like K = 1 with one expert).
  run_m({{0, 0, 3000, 0}, 256, 128, eng::WeightMajor::kNK, eng::Epilogue::kSwiGLU, true});
  run_m({{777}, 128, 128, eng::WeightMajor::kKN, eng::Epilogue::kDSwiGLU, true});
  run_k({{0, 0, 3000, 0}, 128, 256, true, false});
}
TEST(GpuEngine, WideTilesLargeShapes) {
  std::mt19937_64 g(smoe_test::fresh_seed());
  const auto counts = random_counts(16, 20000, g, 0.1);
  run_m({counts, 512, 256, eng::WeightMajor::kNK, eng::Epilogue::kStore, false});
  run_m({counts, 512, 128, eng::WeightMajor::kKN, eng::Epilogue::kStore, false});
  run_m({counts, 512, 1088, eng::WeightMajor::kKN, eng::Epilogue::kStore, false});  // long K: cooperative
  run_m({counts, 1024, 128, eng::WeightMajor::kNK, eng::Epilogue::kSwiGLU, true});
  run_k({random_counts(66, 8000, g, 0.1), 512, 512, false, true, 256});
}
// Tile orders (SMOE_ENGINE_N_BAND, tile_order.h): M-tiles innermost (band 1), bands of 3 N-tiles,
// whose last band is narrower at 5 N-tiles (N 640 at BN 128), and one band (0), under every
// instantiation run_m forces; then the rule's bands (unset) on experts of 48 MiB of weights. The
// variable as it was (an A/B variant may set it) is restored at the end.
TEST(GpuEngine, BandOrders) {
  const char* before = std::getenv("SMOE_ENGINE_N_BAND");
  const std::string saved = before ? before : "";
  for (const char* band : {"1", "3", "0"}) {
    SCOPED_TRACE(testing::Message() << "SMOE_ENGINE_N_BAND=" << band);
    setenv("SMOE_ENGINE_N_BAND", band, 1);
    eng::reload_overrides_from_env();
    run_m({kEdgeCounts, 640, 192, eng::WeightMajor::kNK, eng::Epilogue::kStore, false});
    run_m({kEdgeCounts, 640, 128, eng::WeightMajor::kNK, eng::Epilogue::kSwiGLU, true});
    run_m({kEdgeCounts, 640, 256, eng::WeightMajor::kKN, eng::Epilogue::kDSwiGLU, true});
    run_m({kEdgeCounts, 640, 192, eng::WeightMajor::kKN, eng::Epilogue::kStore, false});  // dX~: MN-major B
  }
  unsetenv("SMOE_ENGINE_N_BAND");
  eng::reload_overrides_from_env();
  ASSERT_EQ(int64_t{8192} * 3072 * 2, eng::kBandMinWeightBytes) << "the cases below sit on the rule's edge";
  ASSERT_LT(eng::kAutoNBand, 8192 / 256) << "the rule's band must split the N-tiles";
  // Two experts each (the weights' host draw is E x 25M values per forced instance).
  run_m({{300, 129}, 8192, 3072, eng::WeightMajor::kNK, eng::Epilogue::kStore, false});
  run_m({{257, 640}, 8192, 3072, eng::WeightMajor::kNK, eng::Epilogue::kSwiGLU, true});
  if (!saved.empty()) setenv("SMOE_ENGINE_N_BAND", saved.c_str(), 1);
  eng::reload_overrides_from_env();
}
TEST(GpuEngine, VarlenK) {
  run_k({kEdgeCounts, 192, 320, true, false});
  run_k({kEdgeCounts, 256, 128, false, true});
  run_k({kEdgeCounts, 64, 64, false, true});
  run_k({kEdgeCounts, 64, 128, true, false});
  // Q gathered runs transposed (EpiStoreTma<true>, stmatrix.trans + TMA): partial tiles both ways.
  run_k({kEdgeCounts, 192, 320, false, true});
  run_k({kEdgeCounts, 320, 192, false, true});
  // Neither gathered: both operands by TMA (dw_tma), the tail rows of both zeroed; both tiles.
  run_k({kEdgeCounts, 192, 320, false, false});
  run_k({kEdgeCounts, 64, 128, false, false});
  // Experts longer than the staged row offsets (2048 rows per refill): exactly one chunk, one row
  // past it, two and a half chunks; gathered P and gathered Q (transposed).
  run_k({{2048, 0, 2049, 5000, 1}, 128, 256, true, false});
  run_k({{2049, 4096, 0, 4500}, 256, 128, false, true});
  setenv("SMOE_ENGINE_BN_K", "256", 1);
  eng::reload_overrides_from_env();
  run_k({kEdgeCounts, 320, 512, false, false, 256});
  run_k({kEdgeCounts, 128, 256, true, false, 256});
  unsetenv("SMOE_ENGINE_BN_K");
  eng::reload_overrides_from_env();
}
// Pairs along M (Q multicast): every kind, an odd M-tile count (the last pair's rank-1 tile lies
// past M: it loads its half of Q for its partner and stores nothing), empty experts, tails.
TEST(GpuEngine, VarlenKCluster) {
  setenv("SMOE_ENGINE_BN_K", "256", 1);
  setenv("SMOE_ENGINE_CLUSTER_K", "2", 1);
  eng::reload_overrides_from_env();
  run_k({kEdgeCounts, 256, 512, false, false, 256, 2});
  run_k({kEdgeCounts, 384, 256, false, false, 256, 2});  // 3 M-tiles
  run_k({kEdgeCounts, 256, 256, true, false, 256, 2});
  run_k({kEdgeCounts, 640, 256, true, false, 256, 2});   // 5 M-tiles, gathered P
  run_k({kEdgeCounts, 512, 256, false, true, 256, 2});   // gathered Q: runs transposed (M 256, N 512)
  std::mt19937_64 g(smoe_test::fresh_seed());
  run_k({random_counts(300, 9000, g, 0.5), 256, 512, false, false, 256, 2});
  run_k({random_counts(300, 9000, g, 0.5), 512, 256, true, false, 256, 2});
  unsetenv("SMOE_ENGINE_CLUSTER_K");
  eng::reload_overrides_from_env();
  // The heuristic's pick without the switch: a pair at an even M-tile count, none at an odd one.
  run_k({kEdgeCounts, 512, 256, false, false, 256, 2});
  run_k({kEdgeCounts, 384, 256, false, false, 256, 1});
  unsetenv("SMOE_ENGINE_BN_K");
  eng::reload_overrides_from_env();
}
TEST(GpuEngine, ManyExpertsMostlyEmpty) {
  std::mt19937_64 g(smoe_test::fresh_seed());
  const auto counts = random_counts(512, 5000, g, 0.6);
  run_m({counts, 256, 128, eng::WeightMajor::kNK, eng::Epilogue::kSwiGLU, true});
  run_m({counts, 192, 128, eng::WeightMajor::kNK, eng::Epilogue::kStore, false});  // staged stores, E = 512
  run_m({counts, 128, 128, eng::WeightMajor::kKN, eng::Epilogue::kDSwiGLU, true});
  run_k({counts, 128, 128, true, false});
  run_k({counts, 128, 128, false, false});
}
TEST(GpuEngine, ZeroRows) {
  run_m({{0, 0, 0}, 128, 64, eng::WeightMajor::kNK, eng::Epilogue::kStore, false});
  run_k({{0, 0, 0}, 128, 64, false, true});  // every expert empty: all-zero gradients
  run_k({{0, 0, 0}, 128, 64, false, false});
}
TEST(GpuEngine, BadArgumentsRejected) {
  eng::VarlenMArgs a;
  a.num_experts = 4;
  a.N = 100;  // not a multiple of 64
  a.K = 64;
  smoe::Status s = eng::varlen_m(a, sms(), 0);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message.find("N = 100"), std::string::npos) << s.message;
  eng::VarlenKArgs k;
  k.num_experts = 600;
  k.M = 64;
  k.N = 64;
  s = eng::varlen_k(k, sms(), 0);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message.find("num_experts"), std::string::npos) << s.message;
  k.num_experts = 4;
  k.ld_p = 64;
  k.ld_q = 64;
  k.gather_p = k.gather_q = reinterpret_cast<const int32_t*>(0x1000);
  s = eng::varlen_k(k, sms(), 0);  // both operands gathered
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message.find("at most one of gather_p / gather_q"), std::string::npos) << s.message;
}

// The reference twins themselves, against float64 on the host: every element of a small gathered
// varlen-M (both weight majors) and a small varlen-K with each operand gathered.
TEST(GpuEngine, TwinAgainstHost) {
  smoe_test::Rng rng;
  SCOPED_TRACE(testing::Message() << "seed " << rng.seed);
  auto& g = rng.gen;
  Groups gr({3, 0, 70, 1, 33});
  const int E = gr.E(), N = 64, K = 128;
  const int64_t rows = gr.rows, a_rows = 40;
  const auto hA = random_bf16(a_rows * K, 1.0, g), hB = random_bf16(static_cast<size_t>(E) * N * K, 1.0, g);
  std::vector<int32_t> gidx(rows);
  std::uniform_int_distribution<int> pick(0, static_cast<int>(a_rows) - 1);
  for (auto& x : gidx) x = pick(g);
  std::unique_ptr<DeviceBuffer<bf16>> A(upload(hA)), B(upload(hB));
  std::unique_ptr<DeviceBuffer<int32_t>> G(upload(gidx));
  auto f = [](bf16 v) { return static_cast<double>(__bfloat162float(v)); };
  for (eng::WeightMajor major : {eng::WeightMajor::kNK, eng::WeightMajor::kKN}) {
    eng::VarlenMArgs a;
    a.num_experts = E;
    a.N = N;
    a.K = K;
    a.rows = rows;
    a.expert_offset = gr.d_off.get();
    a.A = A->get();
    a.a_rows = a_rows;
    a.gather_idx = G->get();
    a.B = B->get();
    a.b_major = major;
    DeviceBuffer<float> D(static_cast<size_t>(rows) * N);
    smoe_test::varlen_m_ref(a, D.get(), 0);
    CUDA_OK(cudaDeviceSynchronize());
    const auto got = D.download();
    double worst = 0;
    for (int e = 0; e < E; ++e)
      for (int64_t r = gr.off[e]; r < gr.off[e + 1]; ++r)
        for (int c = 0; c < N; ++c) {
          double want = 0, mag = 0;
          for (int k = 0; k < K; ++k) {
            const double b = major == eng::WeightMajor::kNK ? f(hB[(static_cast<size_t>(e) * N + c) * K + k])
                                                            : f(hB[(static_cast<size_t>(e) * K + k) * N + c]);
            want += f(hA[static_cast<size_t>(gidx[r]) * K + k]) * b;
            mag += std::fabs(f(hA[static_cast<size_t>(gidx[r]) * K + k]) * b);
          }
          worst = std::max(worst, std::fabs(got[r * N + c] - want) / (mag + 1e-30));
        }
    EXPECT_LT(worst, 1e-5) << "varlen_m_ref, major " << static_cast<int>(major);
  }
  for (bool gather_p : {true, false}) {
    const int M = 64, NN = 64;
    const auto hP = random_bf16(static_cast<size_t>(std::max<int64_t>(rows, a_rows)) * M, 1.0, g);
    const auto hQ = random_bf16(static_cast<size_t>(std::max<int64_t>(rows, a_rows)) * NN, 1.0, g);
    std::unique_ptr<DeviceBuffer<bf16>> P(upload(hP)), Q(upload(hQ));
    eng::VarlenKArgs k;
    k.num_experts = E;
    k.M = M;
    k.N = NN;
    k.rows = rows;
    k.expert_offset = gr.d_off.get();
    k.P = P->get();
    k.ld_p = M;
    k.gather_p = gather_p ? G->get() : nullptr;
    k.Q = Q->get();
    k.ld_q = NN;
    k.gather_q = gather_p ? nullptr : G->get();
    DeviceBuffer<float> D(static_cast<size_t>(E) * M * NN);
    smoe_test::varlen_k_ref(k, D.get(), 0);
    CUDA_OK(cudaDeviceSynchronize());
    const auto got = D.download();
    double worst = 0;
    for (int e = 0; e < E; ++e)
      for (int m = 0; m < M; ++m)
        for (int c = 0; c < NN; ++c) {
          double want = 0, mag = 0;
          for (int64_t r = gr.off[e]; r < gr.off[e + 1]; ++r) {
            const int64_t sp = gather_p ? gidx[r] : r, sq = gather_p ? r : gidx[r];
            const double v = f(hP[sp * M + m]) * f(hQ[sq * NN + c]);
            want += v;
            mag += std::fabs(v);
          }
          const double err = std::fabs(got[(static_cast<size_t>(e) * M + m) * NN + c] - want);
          worst = std::max(worst, mag > 0 ? err / mag : err);
        }
    EXPECT_LT(worst, 1e-5) << "varlen_k_ref, gather_p " << gather_p;
  }
}
