// The layer's gather-sums alone (issue 37 item 4): the aggregation and the dx sum (plain, and with
// the top-K router term) at every built (U tokens x B entries x C chunks) variant of
// src/moe/gather_sum.cuh and the kernels before them (gather_sum_legacy.cuh), against a
// device-to-device copy of the same bytes, in one process.
//
//   build/gather_sum_bench [--reps N] [--warmup N] [--shapes T:d:K:E,...] [--out results.json]
//
// Routing as the layer has it: each token picks K distinct experts at random, entry j = t * K + k,
// grouped rows sorted by expert (so a token's K rows lie far apart), token_offset[t] = t * K.
// TB/s counts the least bytes a stage must move (memory_stages.py): the R = T * K source rows read
// and the T output rows written, bf16; indices, scores and the router's W_r left out. "copy" is
// cudaMemcpyAsync of R rows (bytes read + written / time). Every variant's output must equal the
// legacy kernel's bit for bit (the same fp32 operations in the same order), and the legacy output a
// float64 host sum of sampled tokens (every column) within bf16 rounding; outputs are poisoned first.
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "cuda_or_exit.h"
#include "event_timing.h"
#include "write_text.h"
#include "gather_sum_legacy.cuh"
#include "moe/gather_sum.cuh"

namespace k = smoe::kernels;
using bf16 = smoe::bf16;


namespace {

struct Shape {
  int64_t T;
  int d, K, E;
};

// Seen (public-config-like) and unseen shapes; K from 1 to 16.
const std::vector<Shape> kDefaultShapes = {
    {32768, 2048, 8, 64},  {32768, 1536, 8, 128}, {32768, 2048, 16, 256}, {16384, 4096, 1, 16},
    {16384, 2048, 1, 8},   {32768, 2048, 2, 32},  {32768, 2048, 4, 64},   {20000, 3072, 2, 32},
    {8192, 5120, 4, 128},  {65536, 1024, 16, 256}, {6000, 7168, 8, 256},  {24576, 2880, 4, 128},
    {12345, 4096, 6, 64},  {40000, 1024, 1, 8},   {16384, 7168, 8, 384},
};

template <typename T>
T* dev_upload(const std::vector<T>& h) {
  T* p = nullptr;
  SMOE_CUDA_OR_EXIT(cudaMalloc(&p, std::max<size_t>(1, h.size()) * sizeof(T)));
  if (!h.empty()) SMOE_CUDA_OR_EXIT(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

using smoe_bench::time_ms;

std::vector<uint16_t> bits(const bf16* p, size_t n) {
  std::vector<uint16_t> h(n);
  SMOE_CUDA_OR_EXIT(cudaMemcpy(h.data(), p, n * 2, cudaMemcpyDeviceToHost));
  return h;
}

float bf(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::vector<Shape> parse_shapes(const char* s) {
  std::vector<Shape> v;
  std::string str(s);
  size_t pos = 0;
  while (pos < str.size()) {
    size_t end = str.find(',', pos);
    if (end == std::string::npos) end = str.size();
    Shape x{};
    if (std::sscanf(str.substr(pos, end - pos).c_str(), "%" SCNd64 ":%d:%d:%d", &x.T, &x.d, &x.K, &x.E) != 4 ||
        x.T <= 0 || x.d <= 0 || x.d % 64 != 0 || x.K <= 0 || x.E < x.K) {
      std::fprintf(stderr, "--shapes: T:d:K:E with d %% 64 == 0 and E >= K >= 1, got '%s'\n",
                   str.substr(pos, end - pos).c_str());
      std::exit(2);
    }
    v.push_back(x);
    pos = end + 1;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 30, warmup = 5;
  const char* out_path = nullptr;
  std::vector<Shape> shapes = kDefaultShapes;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (a == "--warmup" && i + 1 < argc) warmup = std::atoi(argv[++i]);
    else if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    else if (a == "--shapes" && i + 1 < argc) shapes = parse_shapes(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--reps N] [--warmup N] [--shapes T:d:K:E,...] [--out file.json]\n", argv[0]);
      return 2;
    }
  }
  int dev = 0, sms = 0;
  SMOE_CUDA_OR_EXIT(cudaGetDevice(&dev));
  SMOE_CUDA_OR_EXIT(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop{};
  SMOE_CUDA_OR_EXIT(cudaGetDeviceProperties(&prop, dev));
  const char* commit = std::getenv("SMOE_COMMIT");
  std::printf("gather_sum_bench on %s (%d SMs), warmup %d, reps %d, median ms; TB/s for the least bytes\n", prop.name,
              sms, warmup, reps);
  std::string json = std::string("{\"commit\": \"") + (commit ? commit : "unknown") + "\", \"device\": \"" +
                     prop.name + "\", \"reps\": " + std::to_string(reps) + ", \"results\": [";
  bool all_ok = true;
  std::mt19937_64 g(12345);
  for (size_t si = 0; si < shapes.size(); ++si) {
    const Shape s = shapes[si];
    const int64_t R = s.T * s.K;
    // Routing: K distinct experts per token, grouped rows sorted by expert (stable in entry order).
    std::vector<int32_t> expert(R);
    std::vector<int> perm(s.E);
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t t = 0; t < s.T; ++t) {
      for (int kk = 0; kk < s.K; ++kk) std::swap(perm[kk], perm[kk + g() % (s.E - kk)]);
      for (int kk = 0; kk < s.K; ++kk) expert[t * s.K + kk] = perm[kk];
    }
    std::vector<int64_t> count(s.E + 1, 0);
    for (int64_t j = 0; j < R; ++j) ++count[expert[j] + 1];
    for (int e = 0; e < s.E; ++e) count[e + 1] += count[e];
    std::vector<int32_t> rev(R), offs(s.T + 1);
    for (int64_t j = 0; j < R; ++j) rev[j] = static_cast<int32_t>(count[expert[j]]++);
    for (int64_t t = 0; t <= s.T; ++t) offs[t] = static_cast<int32_t>(t * s.K);
    std::uniform_real_distribution<float> u01(0.05f, 1.f), un(-1.f, 1.f);
    std::vector<float> scores(R), dl(R);
    for (auto& x : scores) x = u01(g);
    for (auto& x : dl) x = un(g);
    const size_t src_n = static_cast<size_t>(R) * s.d, out_n = static_cast<size_t>(s.T) * s.d;
    std::vector<uint16_t> src_h(src_n), wr_h(static_cast<size_t>(s.E) * s.d);
    // bf16 in [2^-7, 2), either sign, from a cheap generator (up to 10^9 elements a shape).
    uint64_t x64 = g() | 1;
    auto next = [&x64] {
      x64 ^= x64 << 13;
      x64 ^= x64 >> 7;
      x64 ^= x64 << 17;
      return x64;
    };
    for (auto& x : src_h) {
      const uint64_t r = next();
      x = static_cast<uint16_t>((0x3c00 + (r & 0x3ff)) | ((r >> 10 & 1) << 15));
    }
    for (auto& x : wr_h) x = static_cast<uint16_t>(0x3c00 + (next() & 0x3ff));

    int32_t* d_rev = dev_upload(rev);
    int32_t* d_offs = dev_upload(offs);
    int32_t* d_exp = dev_upload(expert);
    float* d_scores = dev_upload(scores);
    float* d_dl = dev_upload(dl);
    auto* d_src = reinterpret_cast<bf16*>(dev_upload(src_h));
    auto* d_wr = reinterpret_cast<bf16*>(dev_upload(wr_h));
    bf16 *d_out = nullptr, *d_copy = nullptr;
    SMOE_CUDA_OR_EXIT(cudaMalloc(&d_out, out_n * 2));
    SMOE_CUDA_OR_EXIT(cudaMalloc(&d_copy, src_n * 2));

    const double bytes = static_cast<double>(src_n + out_n) * 2;
    const float copy_ms = time_ms([&] { SMOE_CUDA_OR_EXIT(cudaMemcpyAsync(d_copy, d_src, src_n * 2, cudaMemcpyDeviceToDevice)); },
                                  warmup, reps);
    const double copy_tbs = 2.0 * src_n * 2 / (copy_ms * 1e9);
    std::printf("\nT %" PRId64 " d %d K %d E %d: copy %.3f ms %.2f TB/s; least bytes %.1f MB\n", s.T, s.d, s.K, s.E,
                copy_ms, copy_tbs, bytes / 1e6);
    std::printf("  %-10s %-7s %9s %7s %6s %6s  %s\n", "stage", "UxBxC", "ms", "TB/s", "%copy", "vs old", "check");
    json += std::string(si ? "," : "") + "\n  {\"T\": " + std::to_string(s.T) + ", \"d\": " + std::to_string(s.d) +
            ", \"K\": " + std::to_string(s.K) + ", \"E\": " + std::to_string(s.E) +
            ", \"copy_ms\": " + std::to_string(copy_ms) + ", \"copy_tbs\": " + std::to_string(copy_tbs) +
            ", \"variants\": [";
    bool first_json = true;
    for (int stage = 0; stage < 3; ++stage) {
      const char* name = stage == 0 ? "aggregate" : stage == 1 ? "dx_sum" : "dx_router";
      const k::GatherStage gst = stage == 0 ? k::GatherStage::kAggregate
                                 : stage == 1 ? k::GatherStage::kDx
                                              : k::GatherStage::kDxRouter;
      const k::GatherShape pick = k::gather_shape(gst, s.K, s.E);
      const k::GatherArgs ga{d_src, d_rev, d_offs, stage == 0 ? d_scores : stage == 2 ? d_dl : nullptr, d_exp, d_wr,
                             nullptr, s.d, s.T, s.E, d_out, nullptr};
      std::vector<uint16_t> base;
      float legacy_ms = 0;
      // Variant -1: the legacy kernel; then every built one.
      for (int vi = -1; vi < static_cast<int>(std::size(k::kGatherShapes)); ++vi) {
        const k::GatherShape gs = vi < 0 ? k::GatherShape{0, 0, 0} : k::kGatherShapes[vi];
        auto launch = [&] {
          cudaError_t e;
          if (vi < 0)
            e = stage == 0 ? legacy::aggregate(d_src, d_scores, d_rev, d_offs, s.d, s.T, d_out, 0)
                           : legacy::dx_sum(d_src, d_rev, d_offs, stage == 2 ? d_dl : nullptr, d_exp, d_wr, nullptr,
                                            s.d, s.T, s.E, sms, d_out, 0, nullptr);
          else
            e = k::launch_gather_sum(gst, gs, ga, sms, 0);
          SMOE_CUDA_OR_EXIT(e);
        };
        if (vi >= 0 && stage == 2 && k::router_slab_bytes(s.E, gs.chunks) > k::kGatherMaxSlabBytes) {
          std::printf("  %-10s %dx%dx%d   W_r slab of %zu KB: not launchable\n", name, gs.tokens, gs.entries, gs.chunks,
                      k::router_slab_bytes(s.E, gs.chunks) / 1024);
          continue;
        }
        SMOE_CUDA_OR_EXIT(cudaMemset(d_out, 0xff, out_n * 2));  // poison: every element must be written
        launch();
        SMOE_CUDA_OR_EXIT(cudaDeviceSynchronize());
        std::vector<uint16_t> got = bits(d_out, out_n);
        std::string check;
        if (vi < 0) {
          base = got;
          double worst = 0;
          for (int probe = 0; probe < 64; ++probe) {
            const int64_t t = probe == 0 ? 0 : probe == 1 ? s.T - 1 : static_cast<int64_t>(g() % s.T);
            for (int c = 0; c < s.d; ++c) {
              double ref = 0;
              for (int64_t j = offs[t]; j < offs[t + 1]; ++j) {
                const double v = bf(src_h[static_cast<size_t>(rev[j]) * s.d + c]);
                ref += stage == 0 ? scores[j] * v : v;
                if (stage == 2) ref += dl[j] * bf(wr_h[static_cast<size_t>(expert[j]) * s.d + c]);
              }
              const double err = std::fabs(bf(got[static_cast<size_t>(t) * s.d + c]) - ref) / (std::fabs(ref) + 1e-2);
              worst = std::max(worst, std::isnan(err) ? 1e9 : err);
            }
          }
          const bool ok = worst < 1.6e-2;  // bf16 output rounding (2^-7 relative) + fp32 sum order
          all_ok = all_ok && ok;
          char buf[64];
          std::snprintf(buf, sizeof buf, "%s (host rel %.1e)", ok ? "ok" : "WRONG", worst);
          check = buf;
        } else {
          const bool same = got == base;
          all_ok = all_ok && same;
          check = same ? "= legacy" : "DIFFERS from legacy";
        }
        const float ms = time_ms(launch, warmup, reps);
        if (vi < 0) legacy_ms = ms;
        const double tbs = bytes / (ms * 1e9);
        const bool chosen = vi >= 0 && gs.tokens == pick.tokens && gs.entries == pick.entries && gs.chunks == pick.chunks;
        char label[32];
        if (vi < 0) std::snprintf(label, sizeof label, "legacy");
        else std::snprintf(label, sizeof label, "%dx%dx%d", gs.tokens, gs.entries, gs.chunks);
        std::printf("  %-10s %-7s %9.4f %7.2f %5.0f%% %5.2fx  %s%s\n", name, label, ms, tbs, 100 * tbs / copy_tbs,
                    legacy_ms / ms, check.c_str(), chosen ? "  <- chosen" : "");
        json += std::string(first_json ? "" : ",") + "\n    {\"stage\": \"" + name + "\", \"variant\": \"" + label +
                "\", \"chosen\": " + (chosen ? "true" : "false") + ", \"ms\": " +
                std::to_string(ms) + ", \"tbs\": " + std::to_string(tbs) + ", \"ok\": " +
                (check[0] == 'o' || check[0] == '=' ? "true" : "false") + "}";
        first_json = false;
      }
    }
    json += "]}";
    for (void* p : {static_cast<void*>(d_rev), static_cast<void*>(d_offs), static_cast<void*>(d_exp),
                    static_cast<void*>(d_scores), static_cast<void*>(d_dl), static_cast<void*>(d_src),
                    static_cast<void*>(d_wr), static_cast<void*>(d_out), static_cast<void*>(d_copy)})
      SMOE_CUDA_OR_EXIT(cudaFree(p));
  }
  json += "\n]}\n";
  if (out_path && !smoe_bench::write_text(out_path, json)) return 1;
  std::printf("\n%s\n", all_ok ? "all variants checked: ok" : "CHECK FAILED");
  return all_ok ? 0 : 1;
}
