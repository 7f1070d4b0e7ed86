#include "layer_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <map>
#include <sstream>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "device_random.cuh"
#include "moe/profile.h"
#include "smoe/smoe.h"

namespace smoe_bench {
namespace {

using bf16 = __nv_bfloat16;

// ---- tiny parser for configs.json ----------------------------------------------------------------
std::string field_string(const std::string& obj, const std::string& key) {
  const size_t k = obj.find("\"" + key + "\"");
  if (k == std::string::npos) return "";
  const size_t q1 = obj.find('"', obj.find(':', k) + 1);
  const size_t q2 = obj.find('"', q1 + 1);
  return obj.substr(q1 + 1, q2 - q1 - 1);
}
int64_t field_int(const std::string& obj, const std::string& key) {
  const size_t k = obj.find("\"" + key + "\"");
  if (k == std::string::npos) return -1;
  return std::stoll(obj.substr(obj.find(':', k) + 1));
}

#define BENCH_CUDA(expr)                                                           \
  do {                                                                             \
    cudaError_t _e = (expr);                                                       \
    if (_e != cudaSuccess) {                                                       \
      r.error = std::string(#expr) + ": " + cudaGetErrorString(_e);                \
      return r;                                                                    \
    }                                                                              \
  } while (0)
#define BENCH_SMOE(expr)                       \
  do {                                         \
    smoe::Status _s = (expr);                  \
    if (!_s.ok()) {                            \
      r.error = _s.message;                    \
      return r;                                \
    }                                          \
  } while (0)

class StageRecorder : public smoe::profile::Recorder {
 public:
  std::string phase;
  std::vector<std::pair<std::string, cudaEvent_t>> marks;
  void mark(const char* stage, cudaStream_t stream) override {
    cudaEvent_t e;
    cudaEventCreate(&e);
    cudaEventRecord(e, stream);
    marks.emplace_back(phase + "." + stage, e);
  }
  // Stage time = event after the stage - previous event (the "begin" marks open each phase).
  void collect(std::map<std::string, std::vector<float>>* out, std::vector<std::string>* order) {
    for (size_t i = 1; i < marks.size(); ++i) {
      if (marks[i].first.find(".begin") != std::string::npos) continue;
      float ms = 0;
      cudaEventElapsedTime(&ms, marks[i - 1].second, marks[i].second);
      if (!out->count(marks[i].first)) order->push_back(marks[i].first);
      (*out)[marks[i].first].push_back(ms);
    }
    for (auto& m : marks) cudaEventDestroy(m.second);
    marks.clear();
  }
};

// SMOE_BENCH_TIMING: "synced" (default) or "queued"; anything else is reported as an error by run_layer.
std::string timing_mode() {
  const char* t = std::getenv("SMOE_BENCH_TIMING");
  return t == nullptr || *t == '\0' ? "synced" : t;
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.f : v[v.size() / 2];
}

std::string json_safe(std::string s) {
  for (char& ch : s)
    if (ch == '"' || ch == '\\' || ch == '\n') ch = '\'';
  return s;
}

}  // namespace

std::vector<Config> load_configs(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string s = ss.str();
  std::vector<Config> out;
  size_t pos = 0;
  while ((pos = s.find('{', pos)) != std::string::npos) {
    const size_t end = s.find('}', pos);
    const std::string obj = s.substr(pos, end - pos + 1);
    Config c;
    c.name = field_string(obj, "name");
    c.T = field_int(obj, "T");
    c.d = static_cast<int>(field_int(obj, "d"));
    c.n = static_cast<int>(field_int(obj, "n"));
    c.E = static_cast<int>(field_int(obj, "E"));
    c.K = static_cast<int>(field_int(obj, "K"));
    if (!c.name.empty() && c.T > 0) out.push_back(c);
    pos = end + 1;
  }
  return out;
}

Result run_layer(const Config& c, int warmup, int reps, const std::string& router) {
  Result r;
  r.router = router;
  smoe::MoEShape s{c.T, c.d, c.n, c.E, c.K};
  if (router != "topk") {
    const char* modes[] = {"nr", "up", "down", "sr"};
    int m = 0;
    while (m < 4 && router != modes[m]) ++m;
    if (m == 4) {
      r.error = "unknown router " + router + " (topk, nr, up, down, sr)";
      return r;
    }
    s.router = smoe::MoERouter::kTokenRounding;
    s.rounding = static_cast<smoe::TokenRoundingMode>(m);
  }
  if (timing_mode() != "synced" && timing_mode() != "queued") {
    r.error = "SMOE_BENCH_TIMING=" + timing_mode() + ": must be synced or queued";
    return r;
  }
  smoe::Status ok = smoe::moe_can_implement(s);
  if (!ok.ok()) {
    r.error = ok.message;
    return r;
  }
  const size_t Td = static_cast<size_t>(c.T) * c.d;
  const size_t w1n = static_cast<size_t>(c.E) * 2 * c.n * c.d, w2n = static_cast<size_t>(c.E) * c.d * c.n;
  const size_t wrn = static_cast<size_t>(c.E) * c.d;
  const size_t saved_b = smoe::moe_saved_state_size(s), wsf_b = smoe::moe_forward_workspace_size(s),
               wsb_b = smoe::moe_backward_workspace_size(s);
  cudaError_t e = cudaSuccess;
  std::vector<void*> owned;
  auto take = [&](size_t bytes) {
    void* p = nullptr;
    if (e == cudaSuccess) e = cudaMalloc(&p, std::max<size_t>(bytes, 256));
    owned.push_back(p);
    return p;
  };
  bf16* x = static_cast<bf16*>(take(Td * 2));
  bf16* dout = static_cast<bf16*>(take(Td * 2));
  bf16* out = static_cast<bf16*>(take(Td * 2));
  bf16* dx = static_cast<bf16*>(take(Td * 2));
  bf16* wr = static_cast<bf16*>(take(wrn * 2));
  bf16* dwr = static_cast<bf16*>(take(wrn * 2));
  bf16* w1 = static_cast<bf16*>(take(w1n * 2));
  bf16* dw1 = static_cast<bf16*>(take(w1n * 2));
  bf16* w2 = static_cast<bf16*>(take(w2n * 2));
  bf16* dw2 = static_cast<bf16*>(take(w2n * 2));
  void* saved = take(saved_b);
  void* wsf = take(wsf_b);
  void* wsb = take(wsb_b);
  smoe::DeviceStatus* st = static_cast<smoe::DeviceStatus*>(take(sizeof(smoe::DeviceStatus)));
  auto cleanup = [&]() {
    for (void* p : owned)
      if (p) cudaFree(p);
  };
  if (e != cudaSuccess) {
    cleanup();
    r.error = std::string("allocation: ") + cudaGetErrorString(e);
    cudaGetLastError();
    return r;
  }
  const uint64_t seed = static_cast<uint64_t>(std::time(nullptr));
  smoe_test::fill_normal_kernel<<<4096, 256>>>(x, Td, seed + 1, 1.0f);
  smoe_test::fill_normal_kernel<<<4096, 256>>>(dout, Td, seed + 2, 1.0f);
  smoe_test::fill_normal_kernel<<<4096, 256>>>(wr, wrn, seed + 3, 1.0f / std::sqrt(static_cast<float>(c.d)));
  smoe_test::fill_normal_kernel<<<4096, 256>>>(w1, w1n, seed + 4, 1.0f / std::sqrt(static_cast<float>(c.d)));
  smoe_test::fill_normal_kernel<<<4096, 256>>>(w2, w2n, seed + 5, 1.0f / std::sqrt(static_cast<float>(c.n)));
  BENCH_CUDA(cudaGetLastError());
  BENCH_SMOE(smoe::reset_device_status(st, 0));

  smoe::MoEForwardArgs f;
  f.shape = s;
  f.x = x;
  f.weights = {wr, w1, w2};
  f.out = out;
  f.saved = saved;
  f.saved_bytes = saved_b;
  f.workspace = wsf;
  f.workspace_bytes = wsf_b;
  f.status = st;
  smoe::MoEBackwardArgs b;
  b.shape = s;
  b.x = x;
  b.weights = f.weights;
  b.dout = dout;
  b.saved = saved;
  b.saved_bytes = saved_b;
  b.dx = dx;
  b.dw_router = dwr;
  b.dw1 = dw1;
  b.dw2 = dw2;
  // SMOE_BENCH_GATE_UP=two: gate/up as two tensors (MoEWeights::w3), the halves of the same buffers.
  if (const char* gu = std::getenv("SMOE_BENCH_GATE_UP"); gu != nullptr && std::strcmp(gu, "two") == 0) {
    f.weights.w3 = w1 + w1n / 2;
    b.weights = f.weights;
    b.dw3 = dw1 + w1n / 2;
  }
  b.workspace = wsb;
  b.workspace_bytes = wsb_b;

  for (int i = 0; i < warmup; ++i) {
    BENCH_SMOE(smoe::moe_forward(f, 0));
    BENCH_SMOE(smoe::moe_backward(b, 0));
  }
  BENCH_CUDA(cudaDeviceSynchronize());
  // Three events per rep (start, between forward and backward, end). Synced (the default): each rep
  // waits for the one before, so it starts on an idle GPU and its time includes the host's enqueue of
  // the first kernels. Queued (SMOE_BENCH_TIMING=queued): the reps are enqueued back to back and read
  // after one synchronize, as torch_baseline.time_ms (side_by_side.py) times every system: the host
  // runs ahead and a rep's time is the GPU's alone, unless the host is the slower of the two.
  r.timing = timing_mode();
  const bool queued = r.timing == "queued";
  std::vector<cudaEvent_t> ev(3 * static_cast<size_t>(reps));
  struct EventsGuard {
    std::vector<cudaEvent_t>& v;
    ~EventsGuard() {
      for (cudaEvent_t e : v)
        if (e) cudaEventDestroy(e);
    }
  } ev_guard{ev};
  for (cudaEvent_t& e : ev) BENCH_CUDA(cudaEventCreate(&e));
  auto elapsed = [&](cudaEvent_t from, cudaEvent_t to, std::vector<float>* out) -> cudaError_t {
    float ms = 0;
    const cudaError_t e = cudaEventElapsedTime(&ms, from, to);
    out->push_back(ms);
    return e;
  };
  std::vector<float> tf, tfb;
  for (int i = 0; i < reps; ++i) {
    cudaEvent_t a = ev[3 * i], z = ev[3 * i + 2];
    BENCH_CUDA(cudaEventRecord(a, 0));
    BENCH_SMOE(smoe::moe_forward(f, 0));
    BENCH_CUDA(cudaEventRecord(z, 0));
    if (!queued) BENCH_CUDA(cudaEventSynchronize(z));
  }
  BENCH_CUDA(cudaDeviceSynchronize());
  for (int i = 0; i < reps; ++i) BENCH_CUDA(elapsed(ev[3 * i], ev[3 * i + 2], &tf));
  std::vector<double> host_fwd, host_bwd;
  std::vector<float> pair_f, pair_b;
  for (int i = 0; i < reps; ++i) {
    cudaEvent_t a = ev[3 * i], m = ev[3 * i + 1], z = ev[3 * i + 2];
    BENCH_CUDA(cudaEventRecord(a, 0));
    const auto h0 = std::chrono::steady_clock::now();
    BENCH_SMOE(smoe::moe_forward(f, 0));
    const auto h1 = std::chrono::steady_clock::now();
    BENCH_CUDA(cudaEventRecord(m, 0));
    BENCH_SMOE(smoe::moe_backward(b, 0));
    const auto h2 = std::chrono::steady_clock::now();
    host_fwd.push_back(std::chrono::duration<double, std::milli>(h1 - h0).count());
    host_bwd.push_back(std::chrono::duration<double, std::milli>(h2 - h1).count());
    BENCH_CUDA(cudaEventRecord(z, 0));
    if (!queued) BENCH_CUDA(cudaEventSynchronize(z));
  }
  BENCH_CUDA(cudaDeviceSynchronize());
  for (int i = 0; i < reps; ++i) {
    BENCH_CUDA(elapsed(ev[3 * i], ev[3 * i + 2], &tfb));
    BENCH_CUDA(elapsed(ev[3 * i], ev[3 * i + 1], &pair_f));
    BENCH_CUDA(elapsed(ev[3 * i + 1], ev[3 * i + 2], &pair_b));
  }
  // Per-stage times (a separate pass: the events between stages perturb the totals slightly). Synced,
  // each forward starts on an idle GPU, so its first stage (the router GEMM) also holds the host's work
  // between the "begin" mark and that launch; queued, the iterations run back to back and are read at the end.
  StageRecorder rec;
  smoe::profile::set_recorder(&rec);
  std::map<std::string, std::vector<float>> stages;
  std::vector<std::string> order;
  for (int i = 0; i < std::max(3, reps / 2); ++i) {
    rec.phase = "fwd";
    BENCH_SMOE(smoe::moe_forward(f, 0));
    rec.phase = "bwd";
    BENCH_SMOE(smoe::moe_backward(b, 0));
    if (queued) continue;
    BENCH_CUDA(cudaDeviceSynchronize());
    rec.collect(&stages, &order);
  }
  if (queued) {
    BENCH_CUDA(cudaDeviceSynchronize());
    rec.collect(&stages, &order);  // each phase's "begin" mark opens its stages, as per iteration
  }
  smoe::profile::set_recorder(nullptr);
  smoe::DeviceStatus hs;
  BENCH_CUDA(cudaMemcpy(&hs, st, sizeof hs, cudaMemcpyDeviceToHost));
  // Rows the GEMMs ran and their tile waste, from the last forward's routing.
  std::vector<int32_t> freq(static_cast<size_t>(c.E));
  BENCH_CUDA(cudaMemcpy(freq.data(), smoe::moe_saved_state_view(s, saved).expert_frequency, freq.size() * 4,
                        cudaMemcpyDeviceToHost));
  for (int32_t f : freq) {
    r.rows += f;
    r.tile_rows += (f + 127) / 128 * 128;
  }
  cleanup();
  if (hs.flags) r.error = "non-finite router logits reported";

  const double flops = static_cast<double>(c.T) * c.K * c.d * c.n;
  r.fwd_ms = median(tf);
  r.bwd_ms = median(tfb) - r.fwd_ms;
  r.pair_fwd_ms = median(pair_f);
  r.pair_bwd_ms = median(pair_b);
  r.fwd_tflops = 6 * flops / (r.fwd_ms * 1e-3) / 1e12;
  r.bwd_tflops = 12 * flops / (r.bwd_ms * 1e-3) / 1e12;
  r.total_tflops = 18 * flops / (median(tfb) * 1e-3) / 1e12;
  r.held_bytes = static_cast<int64_t>(saved_b);
  // The plan: H (4TKn bytes) + scores and four int32 index arrays (20 TK) + 2E+1 offsets/counts.
  r.plan_bytes = static_cast<int64_t>(4.0 * c.T * c.K * c.n + 20.0 * c.T * c.K + 4.0 * (2 * c.E + 1));
  r.fwd_workspace_bytes = static_cast<int64_t>(wsf_b);
  r.bwd_workspace_bytes = static_cast<int64_t>(wsb_b);
  for (const std::string& k : order) r.kernels_ms.emplace_back(k, median(stages[k]));
  std::sort(host_fwd.begin(), host_fwd.end());
  std::sort(host_bwd.begin(), host_bwd.end());
  r.host_fwd_enqueue_ms = host_fwd.empty() ? 0 : host_fwd[host_fwd.size() / 2];
  r.host_bwd_enqueue_ms = host_bwd.empty() ? 0 : host_bwd[host_bwd.size() / 2];
  return r;
}

void print_table(const std::vector<Config>& cs, const std::vector<Result>& rs) {
  if (rs.size() < cs.size()) return;
  std::printf("\n%-20s %8s %8s %7s %7s %7s %9s %9s %6s %10s %6s\n", "config", "fwd ms", "bwd ms", "fwd TF", "bwd TF",
              "tot TF", "held GB", "plan GB", "router", "rows", "waste");
  for (size_t i = 0; i < cs.size(); ++i) {
    const Result& r = rs[i];
    if (!r.error.empty()) {
      std::printf("%-20s error: %s\n", cs[i].name.c_str(), r.error.c_str());
      continue;
    }
    std::printf("%-20s %8.3f %8.3f %7.1f %7.1f %7.1f %9.3f %9.3f %6s %10lld %5.1f%%\n", cs[i].name.c_str(), r.fwd_ms,
                r.bwd_ms, r.fwd_tflops, r.bwd_tflops, r.total_tflops, r.held_bytes / 1e9, r.plan_bytes / 1e9,
                r.router.c_str(), static_cast<long long>(r.rows),
                r.tile_rows ? 100.0 * (1.0 - static_cast<double>(r.rows) / r.tile_rows) : 0.0);
  }
  std::printf("\nper-stage median ms:\n");
  for (size_t i = 0; i < cs.size(); ++i) {
    if (!rs[i].error.empty()) continue;
    std::printf("%-20s", cs[i].name.c_str());
    for (const auto& k : rs[i].kernels_ms) std::printf(" %s=%.3f", k.first.c_str(), k.second);
    std::printf("\n");
  }
  std::printf("\nhost enqueue median ms (near fwd + bwd ms, the GPU waits on the host between kernels);\n"
              "fwd+bwd reps split by an event (pair fwd / bwd median ms):\n");
  for (size_t i = 0; i < cs.size(); ++i)
    if (rs[i].error.empty())
      std::printf("%-20s fwd=%.3f bwd=%.3f   pair fwd=%.3f bwd=%.3f\n", cs[i].name.c_str(), rs[i].host_fwd_enqueue_ms,
                  rs[i].host_bwd_enqueue_ms, rs[i].pair_fwd_ms, rs[i].pair_bwd_ms);
}

std::string to_json(const std::vector<Config>& cs, const std::vector<Result>& rs, const std::string& commit,
                    const std::string& driver) {
  cudaDeviceProp prop{};
  int dev = 0, drv = 0;
  cudaGetDevice(&dev);
  cudaGetDeviceProperties(&prop, dev);
  cudaDriverGetVersion(&drv);
  char date[16];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  std::ostringstream o;
  o.precision(6);
  o << "{\n  \"commit\": \"" << commit << "\", \"gpu\": \"" << prop.name << "\", \"driver\": \"" << driver
    << "\", \"driver_cuda_api\": \"" << drv / 1000 << "." << (drv % 1000) / 10 << "\",\n  \"cuda\": \"" << CUDART_VERSION / 1000 << "." << (CUDART_VERSION % 1000) / 10
    << "\", \"date\": \"" << date << "\",\n  \"results\": [\n";
  const size_t count = std::min(cs.size(), rs.size());  // partial results while a run is under way
  for (size_t i = 0; i < count; ++i) {
    const Config& c = cs[i];
    const Result& r = rs[i];
    o << "    {\"config\": {\"name\": \"" << c.name << "\", \"T\": " << c.T << ", \"d\": " << c.d << ", \"n\": " << c.n
      << ", \"E\": " << c.E << ", \"K\": " << c.K << "},\n     \"systems\": {\"ours\": ";
    if (!r.error.empty()) {
      o << "{\"error\": \"" << json_safe(r.error) << "\"}}, \"kernels\": {}}";
    } else {
      o << "{\"fwd_ms\": " << r.fwd_ms << ", \"bwd_ms\": " << r.bwd_ms << ", \"fwd_tflops\": " << r.fwd_tflops
        << ", \"bwd_tflops\": " << r.bwd_tflops << ", \"total_tflops\": " << r.total_tflops
        << ", \"held_bytes\": " << r.held_bytes << ", \"plan_bytes\": " << r.plan_bytes
        << ", \"fwd_workspace_bytes\": " << r.fwd_workspace_bytes << ", \"bwd_workspace_bytes\": "
        << r.bwd_workspace_bytes << ", \"router\": \"" << r.router << "\", \"rows\": " << r.rows
        << ", \"tile_rows\": " << r.tile_rows << ", \"host_fwd_enqueue_ms\": " << r.host_fwd_enqueue_ms
        << ", \"host_bwd_enqueue_ms\": " << r.host_bwd_enqueue_ms << ", \"pair_fwd_ms\": " << r.pair_fwd_ms
        << ", \"pair_bwd_ms\": " << r.pair_bwd_ms << ", \"timing\": \"" << r.timing << "\"}},\n     \"kernels\": {";
      for (size_t k = 0; k < r.kernels_ms.size(); ++k)
        o << (k ? ", " : "") << "\"" << r.kernels_ms[k].first << "_ms\": " << r.kernels_ms[k].second;
      o << "}}";
    }
    o << (i + 1 < count ? ",\n" : "\n");
  }
  o << "  ]\n}\n";
  return o.str();
}

}  // namespace smoe_bench
