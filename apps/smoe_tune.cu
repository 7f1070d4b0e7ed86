// smoe_tune: the engine's tuner ahead of time (issue 37). For each shape of a configs.json list
// (bench/configs format: name, T, d, n, E, K) it runs the MoE layer's forward and backward once,
// with caller-provided random routing (fixed seed) and SMOE_ENGINE_TUNE=1 in effect, so every GEMM
// of the layer is measured under the key the layer will look up (src/engine/tuner.h) and the winners
// are written to the tune cache file (SMOE_ENGINE_TUNE_CACHE, else the user cache directory).
// Keys the file already has are not measured again: point SMOE_ENGINE_TUNE_CACHE at a new file to
// re-tune.
//   smoe_tune <configs.json> [--two-tensor] [--only <name substring>] [--seed <n>]
// Prints each measured key, every candidate's median time (* = the heuristic's pick) and the winner.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "device_random.cuh"
#include "engine/heuristic.h"
#include "engine/overrides.h"
#include "engine/tune_policy.h"
#include "engine/tune_store.h"
#include "engine/tuner.h"
#include "layer_bench.h"
#include "smoe/smoe.h"

namespace {

namespace eng = smoe::engine;

// A failed CUDA or smoe call ends this config (the message says which); the next config still runs.
#define TUNE_CUDA(x)                                                                             \
  do {                                                                                           \
    const cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) return std::string(#x) + ": " + cudaGetErrorString(e_);               \
  } while (0)
#define TUNE_OK(x)                          \
  do {                                      \
    const smoe::Status s_ = (x);            \
    if (!s_.ok()) return s_.message;        \
  } while (0)

struct Buf {
  void* p = nullptr;
  size_t bytes = 0;
  cudaError_t alloc(size_t b) {
    bytes = b;
    return b ? cudaMalloc(&p, b) : cudaSuccess;
  }
  ~Buf() { cudaFree(p); }
  template <class T>
  T* as() const { return static_cast<T*>(p); }
};

void print_record(const eng::TuneRecord& r) {
  std::printf("  %s\n", eng::to_string(r.key).c_str());
  for (size_t i = 0; i < r.candidates.size(); ++i)
    std::printf("    %c %-28s %9.4f ms%s\n", i == 0 ? '*' : ' ', eng::to_string(r.candidates[i]).c_str(),
                r.median_ms[i], static_cast<int>(i) == r.winner ? "  <- winner" : "");
  std::printf("    -> %s (median of %d, %.0f ms)\n", eng::to_string(r.chosen).c_str(), r.reps, r.wall_ms);
  std::fflush(stdout);
}

cudaError_t fill(const Buf& b, uint64_t seed, float scale) {
  const int64_t n = static_cast<int64_t>(b.bytes / sizeof(__nv_bfloat16));
  if (n == 0) return cudaSuccess;
  smoe_test::fill_normal_kernel<<<1024, 256>>>(b.as<__nv_bfloat16>(), n, seed, scale);
  return cudaGetLastError();
}

// One forward and backward of the layer: each GEMM's first call measures its key.
std::string tune_config(const smoe_bench::Config& c, bool two_tensor, uint64_t seed) {
  smoe::MoEShape s{c.T, c.d, c.n, c.E, c.K, smoe::MoERouter::kProvided};
  TUNE_OK(smoe::moe_can_implement(s));
  const size_t T = static_cast<size_t>(c.T), d = c.d, n = c.n, E = c.E, K = c.K, bf = sizeof(smoe::bf16);
  Buf x, w1, w2, dout, out, saved, ws, status, routed_e, routed_s, dx, dw1, dw2, dscores;
  TUNE_CUDA(x.alloc(T * d * bf));
  TUNE_CUDA(w1.alloc(E * 2 * n * d * bf));
  TUNE_CUDA(w2.alloc(E * d * n * bf));
  TUNE_CUDA(dout.alloc(T * d * bf));
  TUNE_CUDA(fill(x, seed, 1.f));
  TUNE_CUDA(fill(w1, seed + 1, 1.f / std::sqrt(static_cast<float>(d))));
  TUNE_CUDA(fill(w2, seed + 2, 1.f / std::sqrt(static_cast<float>(n))));
  TUNE_CUDA(fill(dout, seed + 3, 1.f));
  // Random routing: K distinct experts per token, uniform, positive scores.
  std::mt19937_64 g(seed);
  std::vector<int32_t> ids(T * K), perm(E);
  std::vector<float> sc(T * K);
  std::uniform_real_distribution<float> u(0.05f, 1.f);
  std::iota(perm.begin(), perm.end(), 0);
  for (size_t t = 0; t < T; ++t) {
    for (size_t k = 0; k < K; ++k) {  // partial Fisher-Yates: the first K of a fresh permutation
      std::swap(perm[k], perm[k + g() % (E - k)]);
      ids[t * K + k] = perm[k];
      sc[t * K + k] = u(g);
    }
  }
  TUNE_CUDA(routed_e.alloc(T * K * 4));
  TUNE_CUDA(routed_s.alloc(T * K * 4));
  TUNE_CUDA(cudaMemcpy(routed_e.p, ids.data(), routed_e.bytes, cudaMemcpyHostToDevice));
  TUNE_CUDA(cudaMemcpy(routed_s.p, sc.data(), routed_s.bytes, cudaMemcpyHostToDevice));
  TUNE_CUDA(out.alloc(T * d * bf));
  TUNE_CUDA(saved.alloc(smoe::moe_saved_state_size(s)));
  TUNE_CUDA(ws.alloc(std::max(smoe::moe_forward_workspace_size(s), smoe::moe_backward_workspace_size(s))));
  TUNE_CUDA(status.alloc(sizeof(smoe::DeviceStatus)));
  TUNE_CUDA(dx.alloc(T * d * bf));
  TUNE_CUDA(dw1.alloc(E * 2 * n * d * bf));
  TUNE_CUDA(dw2.alloc(E * d * n * bf));
  TUNE_CUDA(dscores.alloc(T * K * 4));
  smoe::MoEWeights w;
  w.w1 = w1.as<smoe::bf16>();
  w.w2 = w2.as<smoe::bf16>();
  if (two_tensor) w.w3 = w1.as<smoe::bf16>() + E * n * d;  // the buffer's second half: up
  cudaStream_t st;
  TUNE_CUDA(cudaStreamCreate(&st));
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } guard{st};
  TUNE_OK(smoe::reset_device_status(status.as<smoe::DeviceStatus>(), st));
  smoe::MoEForwardArgs f;
  f.shape = s;
  f.x = x.as<smoe::bf16>();
  f.weights = w;
  f.out = out.as<smoe::bf16>();
  f.saved = saved.p;
  f.saved_bytes = saved.bytes;
  f.workspace = ws.p;
  f.workspace_bytes = ws.bytes;
  f.status = status.as<smoe::DeviceStatus>();
  f.routed_expert = routed_e.as<int32_t>();
  f.routed_scores = routed_s.as<float>();
  TUNE_OK(smoe::moe_forward(f, st));
  smoe::MoEBackwardArgs b;
  b.shape = s;
  b.x = f.x;
  b.weights = w;
  b.dout = dout.as<smoe::bf16>();
  b.saved = saved.p;
  b.saved_bytes = saved.bytes;
  b.dx = dx.as<smoe::bf16>();
  b.dw1 = dw1.as<smoe::bf16>();
  if (two_tensor) b.dw3 = dw1.as<smoe::bf16>() + E * n * d;
  b.dw2 = dw2.as<smoe::bf16>();
  b.dscores = dscores.as<float>();
  b.workspace = ws.p;
  b.workspace_bytes = ws.bytes;
  b.status = status.as<smoe::DeviceStatus>();
  TUNE_OK(smoe::moe_backward(b, st));
  TUNE_CUDA(cudaStreamSynchronize(st));
  smoe::DeviceStatus ds;
  TUNE_CUDA(cudaMemcpy(&ds, status.p, sizeof ds, cudaMemcpyDeviceToHost));
  if (ds.flags != 0) return "the layer's device status is " + std::to_string(ds.flags);
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s <configs.json> [--two-tensor] [--only <name substring>] [--seed <n>]\n", argv[0]);
    return 2;
  }
  bool two_tensor = false;
  std::string only;
  uint64_t seed = 20260137;
  for (int i = 2; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--two-tensor"))
      two_tensor = true;
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc)
      only = argv[++i];
    else if (!std::strcmp(argv[i], "--seed") && i + 1 < argc)
      seed = std::strtoull(argv[++i], nullptr, 10);
    else {
      std::fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("smoe_tune: no GPU\n");
    return 77;
  }
  eng::Overrides o = eng::overrides();  // the environment's (SMOE_ENGINE_PRINT etc.) ...
  if (o.forces()) {
    std::fprintf(stderr, "smoe_tune: an SMOE_ENGINE_* switch forces a choice, so nothing would be measured\n");
    return 2;
  }
  if (eng::changes_timing_context(o)) {
    std::fprintf(stderr,
                 "smoe_tune: SMOE_ENGINE_N_BAND or SMOE_ENGINE_STORE_CS=0 is set: its timings would be stored under keys "
                 "that default runs read; unset it to tune\n");
    return 2;
  }
  o.tune = true;  // ... with measuring on
  o.measure = true;
  eng::set_overrides(o);
  eng::set_tune_sink(print_record);
  const smoe::Status init = smoe::moe_init();
  if (!init.ok()) {
    std::fprintf(stderr, "smoe_tune: %s\n", init.message.c_str());
    return 1;
  }
  const std::vector<smoe_bench::Config> configs = smoe_bench::load_configs(argv[1]);
  if (configs.empty()) {
    std::fprintf(stderr, "smoe_tune: no configs in %s\n", argv[1]);
    return 2;
  }
  std::printf("tune cache: %s\n", eng::tune_store_path().empty() ? "(no path: memory only)"
                                                                  : eng::tune_store_path().c_str());
  {  // the facts the heuristic's rules read (bench/reports/heuristic_fit.py parses this line)
    int dev = 0, sms = 0;
    cudaDeviceProp prop{};
    if (cudaGetDevice(&dev) == cudaSuccess && cudaGetDeviceProperties(&prop, dev) == cudaSuccess) sms = prop.multiProcessorCount;
    std::printf("device: %s sm_count=%d hbm_gbps=%d\n", prop.name, sms, eng::device_facts(sms).hbm_gbps);
  }
  int failed = 0;
  for (const smoe_bench::Config& c : configs) {
    if (!only.empty() && c.name.find(only) == std::string::npos) continue;
    std::printf("%s: T=%lld d=%d n=%d E=%d K=%d%s\n", c.name.c_str(), static_cast<long long>(c.T), c.d, c.n, c.E,
                c.K, two_tensor ? " (two-tensor gate/up)" : "");
    std::fflush(stdout);
    const std::string err = tune_config(c, two_tensor, seed);
    if (!err.empty()) {
      std::printf("  FAILED: %s\n", err.c_str());
      ++failed;
    }
  }
  return failed ? 1 : 0;
}
