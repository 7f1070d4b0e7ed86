// The router GEMM alone (issue 37 item 4): logits [T][E] fp32 = x [T][d] bf16 . W_r [E][d]^T, as the
// layer runs it (blas::router_logits: cublasGemmEx, CUBLAS_GEMM_DEFAULT), against every algorithm
// cublasLt's heuristic offers for the same operation and a device-to-device copy of x, in one process.
//
//   build/router_gemm_bench [--reps N] [--warmup N] [--shapes T:d:E,...] [--algos N] [--out results.json]
//
// Why: in the layer on the H100 the router GEMM moves 10-58% of a copy's bandwidth
// (bench/results/h100/memory_stages.md) and is 5-9% of the forward on the small public configs, whose
// cuBLAS bound leaves the router out. Whether another cuBLAS algorithm reaches the bandwidth decides
// between picking one (a rule or a measured pick per shape) and writing a kernel.
// TB/s counts the least bytes: x and W_r read once, the logits written once. Each rep is timed alone
// (CUDA events) after a 256 MiB scrub, so x comes from HBM as in the layer. Every algorithm's logits
// are checked against a float64 host product on sampled rows (relative L2 over every column of
// those rows); an algorithm whose logits fail the check, or whose launch fails, is reported so and
// not timed further; the layer's call failing it makes the exit code 1. Outputs are poisoned (NaN)
// before each checked run.
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "cuda_or_exit.h"
#include "event_timing.h"
#include "write_text.h"
#include "moe/cublas_handles.h"
#include "moe/memory_plan.h"

namespace {

using smoe::bf16;
using smoe_bench::time_ms;

#define LT_OR_EXIT(x)                                                                      \
  do {                                                                                     \
    const cublasStatus_t s_ = (x);                                                         \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                     \
      std::fprintf(stderr, "%s:%d %s: cuBLAS status %d\n", __FILE__, __LINE__, #x, (int)s_); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

struct Shape {
  int64_t T;
  int d, E;
};

// The public configs' and the wide sweep's (T, d, E), then shapes in no configs file.
const std::vector<Shape> kDefaultShapes = {
    {40960, 768, 128},  {24576, 1536, 128}, {24576, 1536, 64},  {24576, 1536, 32},  {32768, 4096, 256},
    {32768, 4096, 128}, {32768, 2048, 64},  {32768, 2048, 512}, {32768, 7168, 256}, {16384, 4096, 16},
    {16384, 2048, 8},   {20000, 3072, 96},  {9999, 1536, 40},   {65536, 1024, 256}, {12345, 5120, 384},
};

std::vector<Shape> parse_shapes(const char* s) {
  std::vector<Shape> v;
  const std::string str(s);
  size_t pos = 0;
  while (pos < str.size()) {
    size_t end = str.find(',', pos);
    if (end == std::string::npos) end = str.size();
    Shape x{};
    if (std::sscanf(str.substr(pos, end - pos).c_str(), "%" SCNd64 ":%d:%d", &x.T, &x.d, &x.E) != 3 || x.T <= 0 ||
        x.d <= 0 || x.d % 8 != 0 || x.E < 1 || x.E > 512) {
      std::fprintf(stderr, "--shapes: T:d:E with T >= 1, d %% 8 == 0, 1 <= E <= 512, got '%s'\n",
                   str.substr(pos, end - pos).c_str());
      std::exit(2);
    }
    v.push_back(x);
    pos = end + 1;
  }
  return v;
}

// A JSON number: non-finite values (a failed check's relative L2) as null.
std::string json_num(double v) {
  if (!std::isfinite(v)) return "null";
  char b[32];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}

double bf16_to_double(bf16 v) { return static_cast<double>(__bfloat162float(v)); }

// Relative L2 of the device logits against a float64 product, over every column of `rows` sampled rows.
// NaN (the poison) anywhere in those rows fails it.
double check_logits(const float* d_logits, const std::vector<bf16>& x, const std::vector<bf16>& w, const Shape& s,
                    const std::vector<int64_t>& rows) {
  std::vector<float> got(static_cast<size_t>(s.E));
  double num = 0, den = 0;
  for (int64_t t : rows) {
    SMOE_CUDA_OR_EXIT(cudaMemcpy(got.data(), d_logits + t * s.E, sizeof(float) * s.E, cudaMemcpyDeviceToHost));
    for (int e = 0; e < s.E; ++e) {
      double ref = 0;
      for (int k = 0; k < s.d; ++k)
        ref += bf16_to_double(x[static_cast<size_t>(t) * s.d + k]) * bf16_to_double(w[static_cast<size_t>(e) * s.d + k]);
      if (std::isnan(got[e])) return INFINITY;
      num += (got[e] - ref) * (got[e] - ref);
      den += ref * ref;
    }
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// One cublasLt algorithm's identity, for the JSON: tile, stages, split-K, reduction scheme, CTA swizzle.
std::string algo_json(const cublasLtMatmulAlgo_t& algo) {
  int id = -1, tile = -1, stages = -1, splitk = -1, red = -1, swizzle = -1;
  size_t w = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk, &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red, sizeof red, &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof swizzle, &w);
  char buf[200];
  std::snprintf(buf, sizeof buf,
                "\"algo_id\": %d, \"tile_id\": %d, \"stages_id\": %d, \"split_k\": %d, \"reduction\": %d, "
                "\"swizzle\": %d",
                id, tile, stages, splitk, red, swizzle);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20, warmup = 3, max_algos = 16;
  const char* out_path = nullptr;
  std::vector<Shape> shapes = kDefaultShapes;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--warmup" && i + 1 < argc) warmup = std::max(0, std::atoi(argv[++i]));
    else if (a == "--algos" && i + 1 < argc) max_algos = std::clamp(std::atoi(argv[++i]), 1, 64);
    else if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    else if (a == "--shapes" && i + 1 < argc) shapes = parse_shapes(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--reps N] [--warmup N] [--shapes T:d:E,...] [--algos N] [--out file.json]\n",
                   argv[0]);
      return 2;
    }
  }
  int dev = 0;
  cudaDeviceProp prop{};
  SMOE_CUDA_OR_EXIT(cudaGetDevice(&dev));
  SMOE_CUDA_OR_EXIT(cudaGetDeviceProperties(&prop, dev));

  cublasHandle_t h = nullptr;
  LT_OR_EXIT(cublasCreate(&h));
  cublasLtHandle_t lt = nullptr;
  LT_OR_EXIT(cublasLtCreate(&lt));
  void* ws = nullptr;
  SMOE_CUDA_OR_EXIT(cudaMalloc(&ws, smoe::plan::kCublasWorkspace));
  LT_OR_EXIT(cublasSetWorkspace(h, ws, smoe::plan::kCublasWorkspace));
  const size_t scrub_bytes = size_t{256} << 20;
  void* scrub = nullptr;
  SMOE_CUDA_OR_EXIT(cudaMalloc(&scrub, scrub_bytes));

  std::string json = "{\"device\": \"" + std::string(prop.name) + "\", \"commit\": \"" +
                     (std::getenv("SMOE_COMMIT") ? std::getenv("SMOE_COMMIT") : "unknown") +
                     "\", \"reps\": " + std::to_string(reps) + ", \"warmup\": " + std::to_string(warmup) +
                     ", \"shapes\": [";
  std::printf("%-18s %-28s %9s %7s %6s %9s\n", "T:d:E", "variant", "ms", "TB/s", "%copy", "rel_l2");
  // fp32 sums of bf16 products measure ~1e-6 here; a wrong layout or a missed row is O(1).
  constexpr double kMaxRelL2 = 1e-3;
  bool layer_ok = true;  // the layer's call passed its check on every shape (else the exit code is 1)
  std::mt19937_64 rng(20261207);
  for (size_t si = 0; si < shapes.size(); ++si) {
    const Shape s = shapes[si];
    std::vector<bf16> x(static_cast<size_t>(s.T) * s.d), w(static_cast<size_t>(s.E) * s.d);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& v : x) v = __float2bfloat16(nd(rng));
    for (auto& v : w) v = __float2bfloat16(nd(rng) * 0.05f);
    bf16 *dx = nullptr, *dw = nullptr, *dcopy = nullptr;
    float* dl = nullptr;
    SMOE_CUDA_OR_EXIT(cudaMalloc(&dx, x.size() * 2));
    SMOE_CUDA_OR_EXIT(cudaMalloc(&dcopy, x.size() * 2));
    SMOE_CUDA_OR_EXIT(cudaMalloc(&dw, w.size() * 2));
    SMOE_CUDA_OR_EXIT(cudaMalloc(&dl, sizeof(float) * s.T * s.E));
    SMOE_CUDA_OR_EXIT(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
    SMOE_CUDA_OR_EXIT(cudaMemcpy(dw, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
    // Each timed rep reads x from HBM, as the layer does: 256 MiB written first push it out of the L2.
    auto scrub_each = [&](int i) { SMOE_CUDA_OR_EXIT(cudaMemsetAsync(scrub, i & 0xff, scrub_bytes)); };
    std::vector<int64_t> rows = {0, s.T - 1};
    for (int i = 0; i < 14; ++i) rows.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(s.T)));
    const double bytes = 2.0 * s.T * s.d + 2.0 * s.E * s.d + 4.0 * s.T * s.E;
    char tag[64];
    std::snprintf(tag, sizeof tag, "%" PRId64 ":%d:%d", s.T, s.d, s.E);

    // The copy: x's bytes read and written.
    const float copy_ms = time_ms([&] { SMOE_CUDA_OR_EXIT(cudaMemcpyAsync(dcopy, dx, x.size() * 2, cudaMemcpyDeviceToDevice)); },
                                  warmup, reps, scrub_each);
    const double copy_tbs = 2.0 * x.size() * 2 / (copy_ms * 1e-3) / 1e12;
    std::printf("%-18s %-28s %9.4f %7.2f %6s %9s\n", tag, "copy (x read + written)", copy_ms, copy_tbs, "", "");
    json += std::string(si ? "," : "") + "\n {\"T\": " + std::to_string(s.T) + ", \"d\": " + std::to_string(s.d) +
            ", \"E\": " + std::to_string(s.E) + ", \"bytes\": " + std::to_string(bytes) +
            ", \"copy_ms\": " + std::to_string(copy_ms) + ", \"copy_tbs\": " + std::to_string(copy_tbs) +
            ", \"variants\": [";

    bool first_variant = true;
    auto report = [&](const std::string& name, const std::string& extra, float ms, double err) {
      const double tbs = bytes / (ms * 1e-3) / 1e12;
      std::printf("%-18s %-28s %9.4f %7.2f %5.0f%% %9.2e\n", tag, name.c_str(), ms, tbs, 100.0 * tbs / copy_tbs, err);
      json += std::string(first_variant ? "" : ",") + "\n  {\"name\": \"" + name + "\", \"ms\": " + std::to_string(ms) +
              ", \"tbs\": " + std::to_string(tbs) + ", \"rel_l2\": " + json_num(err) +
              (extra.empty() ? "" : ", " + extra) + "}";
      first_variant = false;
    };

    // The layer's call.
    auto layer_call = [&] {
      const smoe::Status st = smoe::blas::router_logits(h, s.T, s.d, s.E, dw, dx, dl, "router_gemm_bench");
      if (!st.ok()) {
        std::fprintf(stderr, "router_logits: %s\n", st.message.c_str());
        std::exit(1);
      }
    };
    SMOE_CUDA_OR_EXIT(cudaMemset(dl, 0xff, sizeof(float) * s.T * s.E));  // NaN poison
    layer_call();
    SMOE_CUDA_OR_EXIT(cudaDeviceSynchronize());
    const double layer_err = check_logits(dl, x, w, s, rows);
    if (!(layer_err < kMaxRelL2)) layer_ok = false;
    report("gemmex (the layer's)", "", time_ms(layer_call, warmup, reps, scrub_each), layer_err);

    // cublasLt: the same operation, column-major C (E x T) = W_r^T (E x d) * x (d x T).
    cublasLtMatmulDesc_t op = nullptr;
    LT_OR_EXIT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    LT_OR_EXIT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LT_OR_EXIT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
    LT_OR_EXIT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, s.d, s.E, s.d));
    LT_OR_EXIT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, s.d, s.T, s.d));
    LT_OR_EXIT(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, s.E, s.T, s.E));
    cublasLtMatmulPreference_t pref = nullptr;
    LT_OR_EXIT(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws_bytes = smoe::plan::kCublasWorkspace;
    LT_OR_EXIT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                    sizeof ws_bytes));
    std::vector<cublasLtMatmulHeuristicResult_t> heur(static_cast<size_t>(max_algos));
    int found = 0;
    LT_OR_EXIT(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, max_algos, heur.data(), &found));
    const float one = 1.f, zero = 0.f;
    for (int i = 0; i < found; ++i) {
      if (heur[i].state != CUBLAS_STATUS_SUCCESS) continue;
      const cublasLtMatmulAlgo_t algo = heur[i].algo;
      bool launch_ok = true;
      auto lt_call = [&] {
        if (cublasLtMatmul(lt, op, &one, dw, la, dx, lb, &zero, dl, lc, dl, lc, &algo, ws, ws_bytes, nullptr) !=
            CUBLAS_STATUS_SUCCESS)
          launch_ok = false;
      };
      SMOE_CUDA_OR_EXIT(cudaMemset(dl, 0xff, sizeof(float) * s.T * s.E));
      lt_call();
      SMOE_CUDA_OR_EXIT(cudaDeviceSynchronize());
      const std::string name = "lt heuristic #" + std::to_string(i);
      const double err = launch_ok ? check_logits(dl, x, w, s, rows) : INFINITY;
      if (!launch_ok || !(err < kMaxRelL2)) {
        std::printf("%-18s %-28s %s\n", tag, name.c_str(), launch_ok ? "wrong logits: not timed" : "launch failed");
        continue;
      }
      report(name, algo_json(algo) + ", \"waves\": " + std::to_string(heur[i].wavesCount),
             time_ms(lt_call, warmup, reps, scrub_each), err);
    }
    json += "]}";
    LT_OR_EXIT(cublasLtMatmulPreferenceDestroy(pref));
    LT_OR_EXIT(cublasLtMatrixLayoutDestroy(la));
    LT_OR_EXIT(cublasLtMatrixLayoutDestroy(lb));
    LT_OR_EXIT(cublasLtMatrixLayoutDestroy(lc));
    LT_OR_EXIT(cublasLtMatmulDescDestroy(op));
    SMOE_CUDA_OR_EXIT(cudaFree(dx));
    SMOE_CUDA_OR_EXIT(cudaFree(dcopy));
    SMOE_CUDA_OR_EXIT(cudaFree(dw));
    SMOE_CUDA_OR_EXIT(cudaFree(dl));
  }
  json += "\n]}\n";
  if (out_path && !smoe_bench::write_text(out_path, json)) return 1;
  if (!layer_ok) std::printf("CHECK FAILED: the layer's call gave logits off the float64 product\n");
  return layer_ok ? 0 : 1;
}
