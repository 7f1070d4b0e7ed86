// smoe_main: the project's main job.
//  * Always: runs the float64 CPU reference of the whole MoE layer on a small built-in config and
//    verifies it (the two backward derivations agree, routing metadata is consistent, token
//    rounding lands on tile multiples).
//  * On a Hopper GPU: runs the GPU routing against the reference and times it (CUDA events,
//    median of many runs after warm-up), then the MoE layer benchmark on one default config.
// Usage: smoe_main [--cpu-only]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "layer_bench.h"
#include "smoe/reference.h"
#include "smoe/smoe.h"

namespace {

int g_failures = 0;

void report(const char* what, bool ok, const std::string& detail) {
  std::printf("  [%s] %-58s %s\n", ok ? " ok " : "FAIL", what, detail.c_str());
  if (!ok) ++g_failures;
}

std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

std::vector<double> randn(size_t n, double scale, std::mt19937_64& rng) {
  std::normal_distribution<double> d(0.0, scale);
  std::vector<double> v(n);
  for (double& x : v) x = d(rng);
  return v;
}

void run_cpu_reference() {
  namespace R = smoe::ref;
  const R::MoEShape s{256, 64, 32, 16, 4};
  std::printf("CPU float64 reference, built-in config T=%lld d=%d n=%d E=%d K=%d:\n",
              static_cast<long long>(s.T), s.d, s.n, s.E, s.K);
  std::mt19937_64 rng(std::random_device{}());
  const std::vector<double> x = randn(s.T * s.d, 1.0, rng);
  R::MoEWeights w;
  w.w_router = randn(static_cast<size_t>(s.E) * s.d, 0.2, rng);
  w.w1 = randn(static_cast<size_t>(s.E) * 2 * s.n * s.d, 0.1, rng);
  w.w2 = randn(static_cast<size_t>(s.E) * s.d * s.n, 0.1, rng);
  const std::vector<double> dO = randn(s.T * s.d, 1.0, rng);

  const auto t0 = std::chrono::steady_clock::now();
  const R::LayerForward f = R::layer_forward_ref(x, s, w);
  const R::LayerGrads chain = R::layer_backward_ref(x, dO, s, w, f, R::BackwardMethod::kChainRule);
  const R::LayerGrads sonic = R::layer_backward_ref(x, dO, s, w, f, R::BackwardMethod::kSonic);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

  // Routing metadata consistency.
  bool meta_ok = f.meta.expert_offset.front() == 0 && f.meta.expert_offset.back() == s.T * s.K;
  for (int e = 0; e < s.E; ++e)
    meta_ok &= f.meta.expert_offset[e + 1] - f.meta.expert_offset[e] == f.meta.expert_frequency[e];
  for (size_t r = 0; r < f.meta.scatter_idx.size(); ++r) {
    meta_ok &= f.meta.reverse_scatter_idx[f.meta.scatter_idx[r]] == static_cast<int32_t>(r);
    meta_ok &= f.meta.gather_idx[r] == f.meta.scatter_idx[r] / s.K;
  }
  report("routing metadata (offsets, scatter, inverse, gather)", meta_ok, "");

  const double e_dx = R::rel_l2(sonic.dx, chain.dx), e_w1 = R::rel_l2(sonic.dw1, chain.dw1),
               e_w2 = R::rel_l2(sonic.dw2, chain.dw2), e_ds = R::rel_l2(sonic.ds, chain.ds),
               e_wr = R::rel_l2(sonic.dw_router, chain.dw_router);
  const double worst = std::max({e_dx, e_w1, e_w2, e_ds, e_wr});
  report("SonicMoE backward rewrite == plain chain rule", worst < 1e-12,
         fmt("worst rel L2 %.2e over dX dW1 dW2 dS dWr", worst));

  // Output: O[t] = sum_k s[t,k] Y[row(t,k)] recomputed token by token.
  std::vector<double> o2(s.T * s.d, 0.0);
  for (int64_t t = 0; t < s.T; ++t)
    for (int k = 0; k < s.K; ++k) {
      const int64_t row = f.meta.reverse_scatter_idx[t * s.K + k];
      for (int c = 0; c < s.d; ++c) o2[t * s.d + c] += f.routing.score[t * s.K + k] * f.experts.y[row * s.d + c];
    }
  report("aggregation O = sum_k s Y (token-by-token recompute)", R::rel_l2(f.experts.o, o2) < 1e-14,
         fmt("rel L2 %.2e", R::rel_l2(f.experts.o, o2)));

  // Token rounding on router logits of a larger token count.
  const int64_t Ttr = 2048;
  const int m_tile = 128;
  const std::vector<double> logits = randn(Ttr * s.E, 1.0, rng);
  bool tr_ok = true;
  for (R::RoundingMode mode : {R::RoundingMode::kNearest, R::RoundingMode::kUp, R::RoundingMode::kDown,
                               R::RoundingMode::kStochastic}) {
    const R::GeneralRouting g = R::token_rounding_ref(logits, Ttr, s.E, s.K, m_tile, mode, 1234);
    const R::RoutingMetadata m = R::routing_metadata_ref(g);
    for (int e = 0; e < s.E; ++e) tr_ok &= (m.expert_frequency[e] % m_tile == 0) || m.expert_frequency[e] == Ttr;
  }
  report("token rounding NR/UP/DOWN/SR counts are tile multiples", tr_ok, "M_tile=128, T=2048");
  std::printf("  reference forward + two backward passes: %.1f ms\n", ms);
}

#define CHECK_CUDA(expr)                                                                   \
  do {                                                                                     \
    cudaError_t _e = (expr);                                                               \
    if (_e != cudaSuccess) {                                                               \
      std::printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorName(_e), __FILE__, __LINE__, \
                  cudaGetErrorString(_e));                                                 \
      std::exit(2);                                                                        \
    }                                                                                      \
  } while (0)

#define CHECK_SMOE(expr)                                             \
  do {                                                               \
    smoe::Status _s = (expr);                                        \
    if (!_s.ok()) {                                                  \
      std::printf("smoe error at %s:%d: %s\n", __FILE__, __LINE__, _s.message.c_str()); \
      std::exit(2);                                                  \
    }                                                                \
  } while (0)

// GPU routing: check against the reference, then time. Returns the median time in ms.
void run_gpu_routing(int64_t T, int E, int K, bool check) {
  std::mt19937_64 rng(std::random_device{}());
  std::vector<double> xd = randn(static_cast<size_t>(T) * E, 2.0, rng);
  std::vector<float> xf(xd.size());
  for (size_t i = 0; i < xd.size(); ++i) {
    xf[i] = static_cast<float>(xd[i]);
    xd[i] = xf[i];
  }
  smoe::RoutingProblem p{T, E, K, smoe::DType::kFloat32};
  const size_t tk = static_cast<size_t>(T) * K;
  const size_t ws_bytes = smoe::routing_workspace_size(p);
  void *logits, *ws;
  float* scores;
  int32_t *topk, *freq, *off, *sc, *rev, *ga;
  smoe::DeviceStatus* st;
  CHECK_CUDA(cudaMalloc(&logits, xf.size() * 4));
  CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  CHECK_CUDA(cudaMalloc(&scores, tk * 4));
  CHECK_CUDA(cudaMalloc(&topk, tk * 4));
  CHECK_CUDA(cudaMalloc(&sc, tk * 4));
  CHECK_CUDA(cudaMalloc(&rev, tk * 4));
  CHECK_CUDA(cudaMalloc(&ga, tk * 4));
  CHECK_CUDA(cudaMalloc(&freq, E * 4));
  CHECK_CUDA(cudaMalloc(&off, (E + 1) * 4));
  CHECK_CUDA(cudaMalloc(&st, sizeof(smoe::DeviceStatus)));
  CHECK_CUDA(cudaMemcpy(logits, xf.data(), xf.size() * 4, cudaMemcpyHostToDevice));
  smoe::RoutingOutputs o{scores, topk, freq, off, sc, rev, ga, st};
  CHECK_SMOE(smoe::reset_device_status(st, 0));

  std::string verdict = "not checked";
  if (check) {
    CHECK_CUDA(cudaMemset(sc, 0xFF, tk * 4));
    CHECK_CUDA(cudaMemset(topk, 0xFF, tk * 4));
    CHECK_SMOE(smoe::topk_routing(p, logits, o, ws, ws_bytes, 0));
    CHECK_CUDA(cudaDeviceSynchronize());
    const smoe::ref::TopKRouting r = smoe::ref::topk_softmax_ref(xd, T, E, K);
    const smoe::ref::RoutingMetadata m = smoe::ref::routing_metadata_ref(smoe::ref::to_general(r));
    std::vector<int32_t> h_topk(tk), h_sc(tk);
    std::vector<float> h_s(tk);
    CHECK_CUDA(cudaMemcpy(h_topk.data(), topk, tk * 4, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(h_sc.data(), sc, tk * 4, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(h_s.data(), scores, tk * 4, cudaMemcpyDeviceToHost));
    bool ok = h_topk == r.expert && h_sc == m.scatter_idx;
    double max_err = 0;
    for (size_t i = 0; i < tk; ++i) max_err = std::max(max_err, std::fabs(h_s[i] - r.score[i]));
    ok &= max_err < 2e-6;
    verdict = ok ? "matches reference" : "MISMATCH";
    if (!ok) ++g_failures;
  }

  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 10; ++i) CHECK_SMOE(smoe::topk_routing(p, logits, o, ws, ws_bytes, 0));
  std::vector<float> times;
  for (int i = 0; i < 50; ++i) {
    CHECK_CUDA(cudaEventRecord(a, 0));
    CHECK_SMOE(smoe::topk_routing(p, logits, o, ws, ws_bytes, 0));
    CHECK_CUDA(cudaEventRecord(b, 0));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  const double med = times[times.size() / 2];
  const double bytes = static_cast<double>(T) * E * 4 + tk * 4.0 * 7;  // logits + outputs, lower bound
  std::printf("  %7lld %4d %3d  %9.1f  %8.0f   %s\n", static_cast<long long>(T), E, K, med * 1e3,
              bytes / (med * 1e-3) / 1e9, verdict.c_str());
  smoe::DeviceStatus hs;
  CHECK_CUDA(cudaMemcpy(&hs, st, sizeof hs, cudaMemcpyDeviceToHost));
  if (hs.flags != 0) {
    std::printf("  unexpected non-finite status\n");
    ++g_failures;
  }
  for (void* ptr : {logits, ws, static_cast<void*>(scores), static_cast<void*>(topk), static_cast<void*>(sc),
                    static_cast<void*>(rev), static_cast<void*>(ga), static_cast<void*>(freq),
                    static_cast<void*>(off), static_cast<void*>(st)})
    CHECK_CUDA(cudaFree(ptr));
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
}

}  // namespace

int main(int argc, char** argv) {
  bool cpu_only = false;
  for (int i = 1; i < argc; ++i) cpu_only |= std::strcmp(argv[i], "--cpu-only") == 0;

  run_cpu_reference();

  int count = 0;
  const cudaError_t e = cpu_only ? cudaErrorNoDevice : cudaGetDeviceCount(&count);
  cudaDeviceProp prop{};
  if (e != cudaSuccess || count == 0) {
    std::printf("No CUDA GPU found (%s): ran the CPU reference only.\n",
                cpu_only ? "--cpu-only" : cudaGetErrorString(e));
  } else if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || prop.major != 9) {
    std::printf("GPU 0 (%s, sm_%d%d) is not Hopper; this build targets sm_90a: ran the CPU reference only.\n",
                prop.name, prop.major, prop.minor);
  } else {
    std::printf("\nGPU routing on %s (%d SMs): top-K softmax + metadata, fp32 logits\n", prop.name,
                prop.multiProcessorCount);
    std::printf("  %7s %4s %3s  %9s  %8s   %s\n", "T", "E", "K", "median us", "GB/s(lb)", "check");
    run_gpu_routing(4096, 64, 8, true);
    run_gpu_routing(32768, 128, 8, true);
    run_gpu_routing(32768, 256, 8, true);
    run_gpu_routing(32768, 512, 10, true);
    run_gpu_routing(65536, 512, 16, false);
    // The MoE layer benchmark on one default config (OLMoE-7B shape, full T); all configs:
    // bench_layer (docs/README.md).
    const smoe_bench::Config cfg{"OLMoE-7B", 32768, 2048, 1024, 64, 8};
    std::printf("\nMoE layer forward + backward, %s (T=%lld d=%d n=%d E=%d K=%d), bf16:\n", cfg.name.c_str(),
                static_cast<long long>(cfg.T), cfg.d, cfg.n, cfg.E, cfg.K);
    const smoe_bench::Result r = smoe_bench::run_layer(cfg, 3, 10);
    smoe_bench::print_table({cfg}, {r});
    if (!r.error.empty()) ++g_failures;
  }
  std::printf(g_failures ? "FAILED: %d check(s)\n" : "All checks passed.\n", g_failures);
  return g_failures ? 1 : 0;
}
