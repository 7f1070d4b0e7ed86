// The gather-sums (src/moe/gather_sum.cuh): every built variant of every stage (aggregation, dx sum,
// dx sum with the router term and token rounding's fp32 dx_router) against a float64 host twin at
// fresh random inputs, poisoned outputs (every element written), the same bits from every variant,
// entry counts that vary per token (0 to K), empty slots (rev < 0), partial slabs (d / 8 not a
// multiple of the slab), E up to 512 (a router slab too large for shared memory is refused and
// writes nothing), T = 0 and the saved-state flag (valid = 0: nothing written).
#include <cmath>
#include <cstring>
#include <vector>

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include "gpu/gpu_util.h"
#include "moe/gather_sum.cuh"
#include "test_seed.h"

namespace k = smoe::kernels;
using smoe::bf16;
using smoe_test::DeviceBuffer;

namespace {

struct Case {
  int64_t T;
  int d, K, E;
  bool ragged;  // entry counts 0..K per token and empty slots, as provided routing / token rounding
};

float bf_to_f(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t f_to_bf(float f) {
  const __nv_bfloat16 h = __float2bfloat16(f);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

// out[t][c] in float64 (the twin of the kernel's sum; the kernel sums fp32 in entry order) and the
// sum of the terms' magnitudes (the bound on fp32 order effects).
void gather_sum_ref(k::GatherStage stage, const std::vector<uint16_t>& src, const std::vector<int32_t>& rev,
                    const std::vector<int32_t>& offs, const std::vector<float>& coef, const std::vector<int32_t>& expert,
                    const std::vector<uint16_t>& wr, const std::vector<float>& dxr, int d, int64_t T,
                    std::vector<double>* out, std::vector<double>* mag) {
  out->assign(static_cast<size_t>(T) * d, 0.0);
  mag->assign(static_cast<size_t>(T) * d, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int c = 0; c < d; ++c) {
      double s = 0, m = 0;
      for (int32_t j = offs[t]; j < offs[t + 1]; ++j) {
        if (rev[j] < 0) continue;
        const double v = bf_to_f(src[static_cast<size_t>(rev[j]) * d + c]);
        const double a = stage == k::GatherStage::kAggregate ? coef[j] * v : v;
        s += a;
        m += std::fabs(a);
        if (stage == k::GatherStage::kDxRouter) {
          const double r = coef[j] * static_cast<double>(bf_to_f(wr[static_cast<size_t>(expert[j]) * d + c]));
          s += r;
          m += std::fabs(r);
        }
      }
      if (!dxr.empty()) {
        s += dxr[static_cast<size_t>(t) * d + c];
        m += std::fabs(dxr[static_cast<size_t>(t) * d + c]);
      }
      (*out)[static_cast<size_t>(t) * d + c] = s;
      (*mag)[static_cast<size_t>(t) * d + c] = m;
    }
}

void run_case(const Case& cs) {
  smoe_test::Rng rng;
  SCOPED_TRACE(testing::Message() << "seed " << rng.seed << " T " << cs.T << " d " << cs.d << " K " << cs.K << " E "
                                  << cs.E << " ragged " << cs.ragged);
  // Routing: entries token-major; rows grouped by expert (a token's rows lie apart).
  std::vector<int32_t> offs(cs.T + 1, 0), expert;
  for (int64_t t = 0; t < cs.T; ++t) {
    const int n = cs.ragged ? rng.uniform_int(0, cs.K) : cs.K;
    for (int i = 0; i < n; ++i) expert.push_back(rng.uniform_int(0, cs.E - 1));
    offs[t + 1] = static_cast<int32_t>(expert.size());
  }
  const int64_t R = static_cast<int64_t>(expert.size());
  std::vector<int64_t> start(cs.E + 1, 0);
  for (int32_t e : expert) ++start[e + 1];
  for (int e = 0; e < cs.E; ++e) start[e + 1] += start[e];
  std::vector<int32_t> rev(R);
  for (int64_t j = 0; j < R; ++j) rev[j] = static_cast<int32_t>(start[expert[j]]++);
  if (cs.ragged)
    for (int64_t j = 0; j < R; ++j)
      if (rng.uniform_int(0, 9) == 0) rev[j] = -1;  // an empty slot: adds nothing
  std::vector<float> coef(R), dxr(static_cast<size_t>(cs.T) * cs.d);
  for (auto& x : coef) x = static_cast<float>(rng.normal());
  for (auto& x : dxr) x = static_cast<float>(rng.normal());
  std::vector<uint16_t> src(static_cast<size_t>(std::max<int64_t>(R, 1)) * cs.d), wr(static_cast<size_t>(cs.E) * cs.d);
  for (auto& x : src) x = f_to_bf(static_cast<float>(rng.normal()));
  for (auto& x : wr) x = f_to_bf(static_cast<float>(rng.normal(0.1)));

  // out has a guard band of kGuard elements past T * d: a write past the last token shows there.
  constexpr size_t kGuard = 4096;
  const size_t out_n = static_cast<size_t>(cs.T) * cs.d;
  DeviceBuffer<uint16_t> d_src(src.size()), d_wr(wr.size()), d_out(out_n + kGuard);
  DeviceBuffer<int32_t> d_rev(std::max<int64_t>(R, 1)), d_offs(offs.size()), d_exp(std::max<int64_t>(R, 1)),
      d_zero(1);
  DeviceBuffer<float> d_coef(std::max<int64_t>(R, 1)), d_dxr(std::max<size_t>(1, dxr.size()));
  CUDA_OK(d_src.upload(src));
  CUDA_OK(d_wr.upload(wr));
  CUDA_OK(d_offs.upload(offs));
  if (R) {
    CUDA_OK(d_rev.upload(rev));
    CUDA_OK(d_exp.upload(expert));
    CUDA_OK(d_coef.upload(coef));
  }
  if (!dxr.empty()) CUDA_OK(d_dxr.upload(dxr));
  CUDA_OK(cudaMemset(d_zero.get(), 0, 4));
  int device_sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, 0));

  struct StageRun {
    k::GatherStage stage;
    bool with_dx_router;
  };
  for (const StageRun sr : {StageRun{k::GatherStage::kAggregate, false}, StageRun{k::GatherStage::kDx, false},
                            StageRun{k::GatherStage::kDx, true}, StageRun{k::GatherStage::kDxRouter, false},
                            StageRun{k::GatherStage::kDxRouter, true}}) {
    SCOPED_TRACE(testing::Message() << "stage " << static_cast<int>(sr.stage) << " dx_router " << sr.with_dx_router);
    std::vector<double> ref, mag;
    gather_sum_ref(sr.stage, src, rev, offs, coef, expert, wr, sr.with_dx_router ? dxr : std::vector<float>{}, cs.d,
                   cs.T, &ref, &mag);
    k::GatherArgs a{reinterpret_cast<const bf16*>(d_src.get()),
                    d_rev.get(),
                    d_offs.get(),
                    sr.stage == k::GatherStage::kDx ? nullptr : d_coef.get(),
                    d_exp.get(),
                    reinterpret_cast<const bf16*>(d_wr.get()),
                    sr.with_dx_router ? d_dxr.get() : nullptr,
                    cs.d,
                    cs.T,
                    cs.E,
                    reinterpret_cast<bf16*>(d_out.get()),
                    nullptr};
    std::vector<uint16_t> first;
    // The device's SM count (about one token group per thread), and 1 SM (a grid of a few blocks:
    // every thread walks many groups of U tokens, t_step apart).
    for (const int sms : {device_sms, 1})
    for (const k::GatherShape gs : k::kGatherShapes) {
      SCOPED_TRACE(testing::Message() << "variant " << gs.tokens << "x" << gs.entries << "x" << gs.chunks << " sms "
                                      << sms);
      CUDA_OK(d_out.poison());
      const bool fits = sr.stage != k::GatherStage::kDxRouter ||
                        k::router_slab_bytes(cs.E, gs.chunks) <= k::kGatherMaxSlabBytes;
      const cudaError_t e = k::launch_gather_sum(sr.stage, gs, a, sms, 0);
      CUDA_OK(cudaDeviceSynchronize());
      std::vector<uint16_t> got = d_out.download();
      for (size_t i = out_n; i < got.size(); ++i) ASSERT_EQ(got[i], 0xFFFF) << "wrote past T * d, at " << i - out_n;
      got.resize(out_n);
      if (!fits || cs.T == 0) {
        EXPECT_EQ(e, cs.T == 0 ? cudaSuccess : cudaErrorInvalidConfiguration);
        for (size_t i = 0; i < got.size(); ++i)
          ASSERT_EQ(got[i], 0xFFFF) << "refused or empty launch wrote element " << i;
        continue;
      }
      ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
      double num = 0, den = 0;
      for (size_t i = 0; i < ref.size(); ++i) {
        ASSERT_NE(got[i], 0xFFFF) << "element " << i << " (token " << i / cs.d << ") not written";
        const double v = bf_to_f(got[i]), err = std::fabs(v - ref[i]);
        // bf16 rounding of the fp32 sum (half an ulp: at most 2^-8 relative) + fp32 order (<= 33 terms).
        ASSERT_LE(err, std::ldexp(std::fabs(ref[i]), -8) + 4e-6 * mag[i] + 1e-30)
            << "element " << i << " got " << v << " want " << ref[i];
        num += err * err;
        den += ref[i] * ref[i];
      }
      if (den > 0) EXPECT_LT(std::sqrt(num / den), 4e-3);
      if (first.empty()) first = got;
      else EXPECT_TRUE(got == first) << "not the same bits as the first variant";
    }
  }
  // The saved-state flag: valid = 0 writes nothing (dx stages read saved indices).
  if (cs.T > 0) {
    CUDA_OK(d_out.poison());
    k::GatherArgs a{reinterpret_cast<const bf16*>(d_src.get()), d_rev.get(), d_offs.get(), nullptr, d_exp.get(),
                    nullptr, nullptr, cs.d, cs.T, cs.E, reinterpret_cast<bf16*>(d_out.get()), d_zero.get()};
    CUDA_OK(k::launch_gather_sum(k::GatherStage::kDx, k::gather_shape(k::GatherStage::kDx, cs.K, cs.E), a,
                                 device_sms, 0));
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> got = d_out.download();
    for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], 0xFFFF) << "valid = 0 wrote element " << i;
  }
}

}  // namespace

TEST(GpuGatherSum, EveryVariantAgainstFloat64Twin) {
  run_case({37, 64, 1, 8, false});        // K = 1, one slab, a partial second token pass
  run_case({1000, 2880, 2, 32, true});    // d / 8 = 360: partial slabs at C = 2, 4, 8; ragged counts
  run_case({513, 1088, 3, 512, true});    // E = 512: router slabs of 128 KB (C = 2) fit, 256 KB (C >= 4) refused
  run_case({300, 256, 16, 64, true});     // K = 16: entry batches past the first, empty slots
  run_case({4097, 512, 8, 128, false});   // at 1 SM, ~4 blocks a slab: ~30 token groups per thread
  run_case({0, 512, 4, 16, false});       // T = 0: nothing launched, nothing written
}

TEST(GpuGatherSum, BadLaunchArgumentsRefusedBeforeAnyWrite) {
  DeviceBuffer<uint16_t> out(64 * 8);
  DeviceBuffer<int32_t> offs(2);
  CUDA_OK(offs.upload({0, 0}));
  CUDA_OK(out.poison());
  auto args = [&](int d, int64_t T, int E) {
    return k::GatherArgs{reinterpret_cast<const bf16*>(out.get()), offs.get(), offs.get(), nullptr, offs.get(),
                         reinterpret_cast<const bf16*>(out.get()), nullptr, d, T, E,
                         reinterpret_cast<bf16*>(out.get()), nullptr};
  };
  const k::GatherShape g{1, 4, 1};
  EXPECT_EQ(k::launch_gather_sum(k::GatherStage::kDx, g, args(60, 1, 8), 132, 0), cudaErrorInvalidValue);   // d % 8
  EXPECT_EQ(k::launch_gather_sum(k::GatherStage::kDx, g, args(0, 1, 8), 132, 0), cudaErrorInvalidValue);    // d = 0
  EXPECT_EQ(k::launch_gather_sum(k::GatherStage::kDx, g, args(64, -1, 8), 132, 0), cudaErrorInvalidValue);  // T < 0
  EXPECT_EQ(k::launch_gather_sum(k::GatherStage::kDx, g, args(64, 1, 8), 0, 0), cudaErrorInvalidValue);     // no SM
  EXPECT_EQ(k::launch_gather_sum(k::GatherStage::kDxRouter, g, args(64, 1, 0), 132, 0), cudaErrorInvalidValue);  // E
  EXPECT_EQ(k::launch_gather_sum(k::GatherStage::kDx, k::GatherShape{3, 3, 3}, args(64, 1, 8), 132, 0),
            cudaErrorInvalidValue);  // not a built variant
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // refusals leave no error behind
  const auto got = out.download();
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], 0xFFFF) << "a refused launch wrote element " << i;
}
