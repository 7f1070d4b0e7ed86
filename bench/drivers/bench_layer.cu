// bench_layer: the MoE layer benchmark over bench/configs/configs.json (a copy of ../shared/bench).
// Usage: bench_layer [--configs PATH] [--only NAME[,NAME]] [--warmup N] [--reps N]
//                    [--out ours.json] [--commit SHA] [--driver VERSION]
//                    [--router topk|nr|up|down|sr]   (token rounding modes: SonicMoE TR)
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "layer_bench.h"

int main(int argc, char** argv) {
  std::string configs = "bench/configs/configs.json", only, out, commit = "unknown", driver = "unknown";
  std::string router = "topk";
  int warmup = 3, reps = 10;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--configs") configs = v;
    else if (k == "--only") only = v;
    else if (k == "--warmup") warmup = std::stoi(v);
    else if (k == "--reps") reps = std::stoi(v);
    else if (k == "--out") out = v;
    else if (k == "--commit") commit = v;
    else if (k == "--driver") driver = v;
    else if (k == "--router") router = v;
    else { std::fprintf(stderr, "unknown option %s\n", k.c_str()); return 2; }
  }
  std::vector<smoe_bench::Config> all = smoe_bench::load_configs(configs), cs;
  if (all.empty()) { std::fprintf(stderr, "no configs read from %s\n", configs.c_str()); return 2; }
  for (const auto& c : all)
    if (only.empty() || ("," + only + ",").find("," + c.name + ",") != std::string::npos) cs.push_back(c);
  std::vector<smoe_bench::Result> rs;
  for (size_t i = 0; i < cs.size(); ++i) {
    std::printf("[%zu/%zu] %s ...\n", i + 1, cs.size(), cs[i].name.c_str());
    std::fflush(stdout);
    rs.push_back(smoe_bench::run_layer(cs[i], warmup, reps, router));
    if (!out.empty()) std::ofstream(out) << smoe_bench::to_json(cs, rs, commit, driver);  // partial results survive
  }
  smoe_bench::print_table(cs, rs);
  if (!out.empty()) std::ofstream(out) << smoe_bench::to_json(cs, rs, commit, driver);
  int errors = 0;
  for (const auto& r : rs) errors += !r.error.empty();
  return errors ? 1 : 0;
}
