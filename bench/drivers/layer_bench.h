// MoE layer benchmark (used by bench_layer and by smoe_main on a GPU).
// Conventions (../shared/bench/README.md): CUDA events, warm-up first, median of many repetitions,
// random inputs; FLOPs 6TKdn forward and 12TKdn backward (router not counted); backward time =
// median(forward+backward) - median(forward); held bytes = what forward keeps for backward.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace smoe_bench {

struct Config {
  std::string name;
  int64_t T = 0;
  int d = 0, n = 0, E = 0, K = 0;
};

// Reads the configs.json format of ../shared/bench (a list of objects with name, T, d, n, E, K).
std::vector<Config> load_configs(const std::string& path);

struct Result {
  std::string error;  // empty on success
  double fwd_ms = 0, bwd_ms = 0, fwd_tflops = 0, bwd_tflops = 0, total_tflops = 0;
  int64_t held_bytes = 0, plan_bytes = 0, fwd_workspace_bytes = 0, bwd_workspace_bytes = 0;
  std::string router = "topk";  // topk | nr | up | down | sr (token rounding modes)
  int64_t rows = 0;             // grouped rows the GEMMs computed (T*K for top-K)
  int64_t tile_rows = 0;        // rows rounded up to the 128-row tile per expert: tile waste = 1 - rows/tile_rows
  std::vector<std::pair<std::string, double>> kernels_ms;  // median per stage, in order
  // Host time to enqueue (the calls return before the GPU finishes), median over the timed
  // fwd+bwd reps. When it comes near the GPU time, the GPU waits on the host between kernels. Queued
  // timing: a launch may also wait for room in the stream's queue, so these read high there.
  double host_fwd_enqueue_ms = 0, host_bwd_enqueue_ms = 0;
  // The fwd+bwd reps split by an event between the two calls (median of each part). bwd_ms is
  // median(fwd+bwd) - median(fwd alone); these tell whether a gap between bwd_ms and the stage sum
  // sits in the backward itself or in a forward that runs slower after a backward.
  double pair_fwd_ms = 0, pair_bwd_ms = 0;
  // How the reps were timed (SMOE_BENCH_TIMING): "synced", each rep on an idle GPU after the one before
  // finished; "queued", back to back as torch_baseline.time_ms times every system in side_by_side.py.
  // The stage pass (kernels_ms) follows the same mode.
  std::string timing = "synced";
};

// router: "topk" (default) or a token-rounding mode "nr", "up", "down", "sr".
Result run_layer(const Config& c, int warmup, int reps, const std::string& router = "topk");

void print_table(const std::vector<Config>& cs, const std::vector<Result>& rs);
// driver: the driver version string (nvidia-smi's driver_version), passed in by the caller.
std::string to_json(const std::vector<Config>& cs, const std::vector<Result>& rs,
                    const std::string& commit, const std::string& driver);

}  // namespace smoe_bench
