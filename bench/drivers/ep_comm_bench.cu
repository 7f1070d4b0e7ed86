// Dispatch and combine bandwidth alone (issue 11), swept over tokens, d and K, on every GPU of the
// machine (one process, a thread per rank, ncclCommInitAll):
//
//   build/ep_comm_bench [--reps 20] [--out ep_comm.json]
//
// Per point: uniform random routing (K distinct experts of E = 64 per token), one layout + count
// exchange, then `reps` timed dispatches (x rows to every rank holding one of the token's experts,
// with the slot's ids and scores; starting with a barrier, as backward's does) and `reps` timed
// combines (push of the partial rows + the local fp32 reduce). Time = median over reps of the max
// over ranks (CUDA events); GB/s = bytes that cross to other ranks per rank (1e9 bytes) / time.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "cuda_or_exit.h"
#include "ep/ep_context.h"

namespace {


struct Point {
  int64_t T;
  int d, K, E;
};

struct RankResult {
  std::vector<float> dispatch_ms, combine_ms;
  double cross_bytes = 0;  // bytes of rows this rank sends to other ranks per dispatch
  std::string error;
};

void run_rank(ncclComm_t comm, int rank, int world, Point p, int reps, RankResult* out) {
  SMOE_CUDA_OR_EXIT(cudaSetDevice(rank));
  smoe::EpConfig cfg;
  cfg.max_tokens = p.T;
  cfg.d = p.d;
  cfg.n = 64;
  cfg.E = p.E;
  cfg.K = p.K;
  smoe::EpContext* ctx = nullptr;
  smoe::Status s = smoe::ep_create(comm, cfg, &ctx);
  if (!s.ok()) {
    out->error = s.message;
    return;
  }
  std::mt19937_64 g(1234 + rank);
  std::vector<int32_t> ids(p.T * p.K);
  std::vector<float> sc(p.T * p.K, 0.5f);
  for (int64_t t = 0; t < p.T; ++t) {
    std::vector<int> perm(p.E);
    for (int e = 0; e < p.E; ++e) perm[e] = e;
    for (int k = 0; k < p.K; ++k) {
      std::swap(perm[k], perm[k + g() % (p.E - k)]);
      ids[t * p.K + k] = perm[k];
    }
  }
  const int R = world;
  const size_t rows = size_t(p.T), slots = size_t(ctx->recv_capacity);
  int32_t *d_ids, *d_clean, *send_pos, *my_counts, *all_counts;
  float* d_sc;
  smoe::bf16 *x, *y, *o;
  smoe::DeviceStatus* st;
  SMOE_CUDA_OR_EXIT(cudaMalloc(&d_ids, rows * p.K * 4));
  SMOE_CUDA_OR_EXIT(cudaMalloc(&d_clean, rows * p.K * 4));
  SMOE_CUDA_OR_EXIT(cudaMalloc(&d_sc, rows * p.K * 4));
  SMOE_CUDA_OR_EXIT(cudaMalloc(&send_pos, size_t(R) * rows * 4));
  SMOE_CUDA_OR_EXIT(cudaMalloc(&my_counts, R * 4));
  SMOE_CUDA_OR_EXIT(cudaMalloc(&all_counts, R * R * 4));
  SMOE_CUDA_OR_EXIT(cudaMalloc(&x, rows * p.d * 2));
  SMOE_CUDA_OR_EXIT(cudaMalloc(&o, rows * p.d * 2));
  SMOE_CUDA_OR_EXIT(cudaMalloc(&y, slots * p.d * 2));
  SMOE_CUDA_OR_EXIT(cudaMalloc(&st, sizeof(smoe::DeviceStatus)));
  SMOE_CUDA_OR_EXIT(cudaMemset(st, 0, sizeof(smoe::DeviceStatus)));
  SMOE_CUDA_OR_EXIT(cudaMemset(x, 0x3c, rows * p.d * 2));
  SMOE_CUDA_OR_EXIT(cudaMemset(y, 0x3c, slots * p.d * 2));
  SMOE_CUDA_OR_EXIT(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  SMOE_CUDA_OR_EXIT(cudaMemcpy(d_sc, sc.data(), sc.size() * 4, cudaMemcpyHostToDevice));
  cudaStream_t stream;
  SMOE_CUDA_OR_EXIT(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  smoe::ep::EpKernelArgs a;
  a.dev_comm = ctx->dev_comm;
  a.window = ctx->window;
  a.lay = ctx->layout;
  a.rank = rank;
  a.world = R;
  a.T = p.T;
  a.Tmax = p.T;
  a.cap = ctx->recv_capacity;
  a.d = p.d;
  a.K = p.K;
  a.E = p.E;
  a.El = ctx->experts_per_rank;
  a.Kl = ctx->local_slots;
  a.timeout_cycles = 0;
  a.flags = nullptr;
  SMOE_CUDA_OR_EXIT(smoe::ep::launch_layout(a, d_ids, send_pos, my_counts, d_clean, st, stream));
  SMOE_CUDA_OR_EXIT(smoe::ep::launch_exchange(a, my_counts, all_counts, stream));
  std::vector<int32_t> counts(R * R);
  SMOE_CUDA_OR_EXIT(cudaMemcpyAsync(counts.data(), all_counts, R * R * 4, cudaMemcpyDeviceToHost, stream));
  SMOE_CUDA_OR_EXIT(cudaStreamSynchronize(stream));
  for (int q = 0; q < R; ++q)
    if (q != rank) out->cross_bytes += double(counts[rank * R + q]) * p.d * 2;
  cudaEvent_t e0, e1;
  SMOE_CUDA_OR_EXIT(cudaEventCreate(&e0));
  SMOE_CUDA_OR_EXIT(cudaEventCreate(&e1));
  const int blocks = cfg.comm_blocks;
  for (int rep = -3; rep < reps; ++rep) {
    SMOE_CUDA_OR_EXIT(cudaEventRecord(e0, stream));
    SMOE_CUDA_OR_EXIT(smoe::ep::launch_dispatch(a, all_counts, send_pos, x, nullptr, d_clean, d_sc, /*write_meta=*/true, /*start_barrier=*/true, /*report_capacity=*/true, blocks, stream));
    SMOE_CUDA_OR_EXIT(cudaEventRecord(e1, stream));
    SMOE_CUDA_OR_EXIT(cudaEventSynchronize(e1));
    float ms;
    SMOE_CUDA_OR_EXIT(cudaEventElapsedTime(&ms, e0, e1));
    if (rep >= 0) out->dispatch_ms.push_back(ms);
  }
  for (int rep = -3; rep < reps; ++rep) {
    SMOE_CUDA_OR_EXIT(cudaEventRecord(e0, stream));
    SMOE_CUDA_OR_EXIT(smoe::ep::launch_combine(a, all_counts, y, nullptr, blocks, stream));
    SMOE_CUDA_OR_EXIT(smoe::ep::launch_reduce(a, all_counts, send_pos, y, o, nullptr, nullptr, nullptr, stream));
    SMOE_CUDA_OR_EXIT(cudaEventRecord(e1, stream));
    SMOE_CUDA_OR_EXIT(cudaEventSynchronize(e1));
    float ms;
    SMOE_CUDA_OR_EXIT(cudaEventElapsedTime(&ms, e0, e1));
    if (rep >= 0) out->combine_ms.push_back(ms);
  }
  for (void* ptr : {(void*)d_ids, (void*)d_clean, (void*)d_sc, (void*)send_pos, (void*)my_counts,
                    (void*)all_counts, (void*)x, (void*)o, (void*)y, (void*)st})
    cudaFree(ptr);
  cudaStreamDestroy(stream);
  s = smoe::ep_destroy(ctx);
  if (!s.ok()) out->error = s.message;
}

float median_of_max(const std::vector<RankResult>& r, bool dispatch) {
  const size_t n = (dispatch ? r[0].dispatch_ms : r[0].combine_ms).size();
  std::vector<float> m(n, 0.f);
  for (const auto& x : r)
    for (size_t i = 0; i < n; ++i) m[i] = std::max(m[i], (dispatch ? x.dispatch_ms : x.combine_ms)[i]);
  std::sort(m.begin(), m.end());
  return m[n / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20;
  const char* out_path = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--out") && i + 1 < argc) out_path = argv[++i];
  }
  int world = 0;
  if (cudaGetDeviceCount(&world) != cudaSuccess || world < 2) {
    std::printf("ep_comm_bench needs 2 or more GPUs (found %d)\n", world);
    return 0;
  }
  std::vector<Point> pts;
  for (int64_t T : {4096, 16384})
    for (int d : {1024, 2048, 4096, 7168})
      for (int K : {2, 8}) pts.push_back({T, d, K, 64});
  FILE* f = out_path ? std::fopen(out_path, "w") : nullptr;
  if (f) std::fprintf(f, "{\"world\": %d, \"reps\": %d, \"points\": [\n", world, reps);
  std::printf("%8s %5s %3s %12s %10s %9s %10s %9s\n", "T/rank", "d", "K", "MB to peers", "dispatch", "GB/s",
              "combine", "GB/s");
  for (size_t i = 0; i < pts.size(); ++i) {
    const Point p = pts[i];
    std::vector<ncclComm_t> comms(world);
    std::vector<int> devs(world);
    for (int r = 0; r < world; ++r) devs[r] = r;
    if (ncclCommInitAll(comms.data(), world, devs.data()) != ncclSuccess) return 1;
    std::vector<RankResult> res(world);
    std::vector<std::thread> th;
    for (int r = 0; r < world; ++r) th.emplace_back(run_rank, comms[r], r, world, p, reps, &res[r]);
    for (auto& t : th) t.join();
    for (auto c : comms) ncclCommDestroy(c);
    for (auto& r : res)
      if (!r.error.empty()) {
        std::fprintf(stderr, "error: %s\n", r.error.c_str());
        return 1;
      }
    double bytes = 0;
    for (auto& r : res) bytes = std::max(bytes, r.cross_bytes);
    const float dm = median_of_max(res, true), cm = median_of_max(res, false);
    std::printf("%8lld %5d %3d %12.1f %8.3f ms %9.1f %8.3f ms %9.1f\n", (long long)p.T, p.d, p.K, bytes / 1e6, dm,
                bytes / (dm * 1e6), cm, bytes / (cm * 1e6));
    if (f)
      std::fprintf(f, " {\"T_per_rank\": %lld, \"d\": %d, \"K\": %d, \"E\": %d, \"bytes_to_peers\": %.0f, "
                      "\"dispatch_ms\": %.4f, \"dispatch_gbs\": %.1f, \"combine_ms\": %.4f, \"combine_gbs\": %.1f}%s\n",
                   (long long)p.T, p.d, p.K, p.E, bytes, dm, bytes / (dm * 1e6), cm, bytes / (cm * 1e6),
                   i + 1 < pts.size() ? "," : "");
  }
  if (f) {
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return 0;
}
