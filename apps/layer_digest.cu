// layer_digest: a bitwise fingerprint of the MoE layer's forward output and every gradient, for
// checking that a refactor changed no result (diff the output of two builds; any bit differs, the
// hash differs). Fixed-seed inputs on purpose: the same inputs in both builds. Public API only
// (smoe/smoe.h), so the same file builds against older trees.
//   layer_digest [seed]   ->  one line per shape and tensor: "<shape> <tensor> <bytes> <fnv1a64>"
// Shapes cover the three routers, interleaved and two-tensor gate/up, token rounding's padded
// rows, empty slots, a clustered (weights > half the L2) shape and counts off the 128-row tile.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "cuda_or_exit.h"
#include "smoe/smoe.h"

namespace {

#define DIGEST_OK(x)                                                                            \
  do {                                                                                          \
    const smoe::Status s_ = (x);                                                                \
    if (!s_.ok()) {                                                                             \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_.message.c_str());       \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

struct Buf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Buf(size_t b) : bytes(b) {
    if (b) SMOE_CUDA_OR_EXIT(cudaMalloc(&p, b));
  }
  ~Buf() { cudaFree(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(p); }
};

uint64_t fnv1a(const std::vector<unsigned char>& v) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : v) h = (h ^ c) * 1099511628211ull;
  return h;
}

void digest(const std::string& shape, const char* name, const Buf& b) {
  std::vector<unsigned char> h(b.bytes);
  if (b.bytes) SMOE_CUDA_OR_EXIT(cudaMemcpy(h.data(), b.p, b.bytes, cudaMemcpyDeviceToHost));
  std::printf("%s %s %zu %016llx\n", shape.c_str(), name, b.bytes, static_cast<unsigned long long>(fnv1a(h)));
}

void fill_bf16(const Buf& b, double scale, std::mt19937_64& g) {
  std::normal_distribution<float> d(0.f, static_cast<float>(scale));
  std::vector<smoe::bf16> h(b.bytes / sizeof(smoe::bf16));
  for (auto& x : h) x = __float2bfloat16(d(g));
  SMOE_CUDA_OR_EXIT(cudaMemcpy(b.p, h.data(), b.bytes, cudaMemcpyHostToDevice));
}

struct Case {
  const char* name;
  smoe::MoEShape s;
  bool two_tensor;  // gate/up as w1 (gate) + w3 (up)
};

void run(const Case& c, uint64_t seed) {
  const smoe::MoEShape& s = c.s;
  DIGEST_OK(smoe::moe_can_implement(s));
  std::mt19937_64 g(seed);
  const int64_t T = s.T;
  const size_t E = s.E, d = s.d, n = s.n, K = s.K;
  const size_t bf = sizeof(smoe::bf16);
  Buf x(T * d * bf), wr(E * d * bf), w1(E * 2 * n * d * bf), w2(E * d * n * bf), dout(T * d * bf);
  fill_bf16(x, 1.0, g);
  fill_bf16(wr, 0.05, g);
  fill_bf16(w1, 0.03, g);
  fill_bf16(w2, 0.03, g);
  fill_bf16(dout, 1.0, g);
  smoe::MoEWeights w;
  w.w_router = wr.as<smoe::bf16>();
  w.w1 = w1.as<smoe::bf16>();
  w.w2 = w2.as<smoe::bf16>();
  if (c.two_tensor) w.w3 = w1.as<smoe::bf16>() + E * n * d;  // second half of the same buffer: up
  Buf routed_e(s.router == smoe::MoERouter::kProvided ? T * K * 4 : 0);
  Buf routed_s(s.router == smoe::MoERouter::kProvided ? T * K * 4 : 0);
  if (s.router == smoe::MoERouter::kProvided) {
    // Distinct experts per token, every fifth slot empty (-1), positive scores.
    std::vector<int32_t> ids(T * K);
    std::vector<float> sc(T * K);
    std::uniform_real_distribution<float> u(0.05f, 1.f);
    for (int64_t t = 0; t < T; ++t) {
      const int start = static_cast<int>(g() % E);
      for (size_t k = 0; k < K; ++k) {
        ids[t * K + k] = (t * K + k) % 5 == 4 ? -1 : static_cast<int32_t>((start + 7 * k) % E);
        sc[t * K + k] = u(g);
      }
    }
    SMOE_CUDA_OR_EXIT(cudaMemcpy(routed_e.p, ids.data(), routed_e.bytes, cudaMemcpyHostToDevice));
    SMOE_CUDA_OR_EXIT(cudaMemcpy(routed_s.p, sc.data(), routed_s.bytes, cudaMemcpyHostToDevice));
  }
  Buf out(T * d * bf), saved(smoe::moe_saved_state_size(s));
  const size_t ws_bytes = std::max(smoe::moe_forward_workspace_size(s), smoe::moe_backward_workspace_size(s));
  Buf ws(ws_bytes), status(sizeof(smoe::DeviceStatus));
  cudaStream_t st;
  SMOE_CUDA_OR_EXIT(cudaStreamCreate(&st));
  DIGEST_OK(smoe::reset_device_status(status.as<smoe::DeviceStatus>(), st));
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
  DIGEST_OK(smoe::moe_forward(f, st));
  Buf dx(T * d * bf), dwr(E * d * bf), dw1(E * 2 * n * d * bf), dw2(E * d * n * bf),
      dscores(s.router == smoe::MoERouter::kProvided ? T * K * 4 : 0);
  smoe::MoEBackwardArgs b;
  b.shape = s;
  b.x = f.x;
  b.weights = w;
  b.dout = dout.as<smoe::bf16>();
  b.saved = saved.p;
  b.saved_bytes = saved.bytes;
  b.dx = dx.as<smoe::bf16>();
  b.dw_router = s.router == smoe::MoERouter::kProvided ? nullptr : dwr.as<smoe::bf16>();
  b.dw1 = dw1.as<smoe::bf16>();
  if (c.two_tensor) b.dw3 = dw1.as<smoe::bf16>() + E * n * d;
  b.dw2 = dw2.as<smoe::bf16>();
  b.dscores = dscores.as<float>();
  b.workspace = ws.p;
  b.workspace_bytes = ws.bytes;
  b.status = status.as<smoe::DeviceStatus>();
  DIGEST_OK(smoe::moe_backward(b, st));
  SMOE_CUDA_OR_EXIT(cudaStreamSynchronize(st));
  SMOE_CUDA_OR_EXIT(cudaStreamDestroy(st));
  smoe::DeviceStatus ds;
  SMOE_CUDA_OR_EXIT(cudaMemcpy(&ds, status.p, sizeof ds, cudaMemcpyDeviceToHost));
  const std::string tag = c.name;
  std::printf("%s status %u\n", tag.c_str(), ds.flags);
  digest(tag, "out", out);
  digest(tag, "dx", dx);
  if (s.router != smoe::MoERouter::kProvided) digest(tag, "dw_router", dwr);
  digest(tag, c.two_tensor ? "dw1+dw3" : "dw1", dw1);
  digest(tag, "dw2", dw2);
  if (s.router == smoe::MoERouter::kProvided) digest(tag, "dscores", dscores);
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("layer_digest: no GPU\n");
    return 77;
  }
  const uint64_t seed = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 20261202;
  DIGEST_OK(smoe::moe_init());
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  using R = smoe::MoERouter;
  const Case cases[] = {
      // 1.4B-like: top-K, interleaved W1, narrow experts (ping-pong, staged stores, dA' 128 x 128).
      {"topk_T4099_d768_n256_E128_K8", {4099, 768, 256, 128, 8, R::kTopKSoftmax}, false},
      // Token rounding (NR) with two-tensor gate/up: padded rows, halves layout, 64 x 256 pairs.
      {"tr_T8192_d2048_n768_E64_K4_w3", {8192, 2048, 768, 64, 4, R::kTokenRounding}, true},
      // Provided routing with empty slots, few wide experts: weights > half the L2 -> 2-CTA clusters.
      {"provided_T8192_d4096_n1536_E16_K2", {8192, 4096, 1536, 16, 2, R::kProvided}, false},
  };
  for (const Case& c : cases) run(c, seed);
  return 0;
}
