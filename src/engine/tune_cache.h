// Measured per-shape choices (issue 37's tuner), host side: the key a GEMM call is tuned under, an
// in-memory cache of the winning configuration per key, and its JSON file. The measuring itself (run
// each built candidate of a key on the device, keep the fastest) is tuner.h; the process-wide cache
// and its file are tune_store.h. This file is what makes the results deterministic and reusable:
// identical keys give identical choices, the file round-trips exactly, and a missing, corrupt or
// stale entry falls back to the heuristic.
//   SMOE_ENGINE_TUNE=0              ignore the cache (heuristic only)
//   SMOE_ENGINE_TUNE=1              also measure a key the cache lacks on its first eager call
//   SMOE_ENGINE_TUNE_CACHE=<path>   the JSON file (default: $XDG_CACHE_HOME/smoe/engine_tune.json,
//                                   else $HOME/.cache/smoe/engine_tune.json)
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>

#include "engine/args.h"
#include "engine/config.h"
#include "engine/heuristic.h"

namespace smoe {
namespace engine {

// What a choice depends on: the GEMM (kind: operands, epilogue, majors), its extents, the experts,
// the rows per expert (log2 bucket: the tile-count regime, not the exact count, so one key serves a
// training run whose counts move every step), the gate/up layout and the machine.
struct TuneKey {
  Kind kind = Kind::down_store;
  int N = 0;
  int K = 0;  // varlen-M: K; varlen-K: M (the kernel's, after a Q-gathered call's transpose)
  int E = 0;
  int rows_bucket = 0;  // floor(log2(max(1, rows / E)))
  bool halves = false;  // two-tensor gate/up: H in halves, or B2 set (dX~ takes K-tiles from w1 and w3)
  int sm_count = 0;
  // The device's HBM bandwidth (DeviceFacts): the H100 and the H200 both have 132 SMs and measured
  // other winners on the same shapes (up to 1.9x apart: bench/results/h100/heuristic_fit.md), so a
  // cache shared by both (one home directory on a mixed cluster) keeps their choices apart.
  int hbm_gbps = 0;
  bool operator<(const TuneKey& o) const {
    return std::tie(kind, N, K, E, rows_bucket, halves, sm_count, hbm_gbps) <
           std::tie(o.kind, o.N, o.K, o.E, o.rows_bucket, o.halves, o.sm_count, o.hbm_gbps);
  }
  bool operator==(const TuneKey& o) const { return !(*this < o) && !(o < *this); }
};

int rows_bucket(int64_t rows, int E);
// For messages: "up_swiglu N=1024 K=2048 E=8 rows_bucket=6 halves=0 sm_count=132 hbm_gbps=3352".
std::string to_string(const TuneKey& k);
TuneKey tune_key(const VarlenMArgs& a, const DeviceFacts& dev);
TuneKey tune_key(const VarlenKArgs& a, const DeviceFacts& dev);  // keyed on the transposed form of a Q-gathered call

// The inverse of to_string (config.h), for reading the cache file; nullopt for anything else.
std::optional<EngineConfig> parse_config(const std::string& label);

class TuneCache {
 public:
  // A configuration that does not fit the key's kind, or is not built, is not stored (false).
  bool put(const TuneKey& k, const EngineConfig& c);
  std::optional<EngineConfig> get(const TuneKey& k) const;
  size_t size() const { return map_.size(); }
  // {"version": 2, "entries": [one JSON object per entry, sorted by key]}: the same cache gives the
  // same text. merge_json also reads the first format (a bare array; its entries lack hbm_gbps).
  std::string to_json() const;
  // Entries of `json` (a to_json text) added; false (and nothing added) when the text does not parse
  // or an entry lacks a field. An entry this build cannot use (a kind or label it does not know, a
  // configuration it lacks or of another kind: a cache written by another build; or no hbm_gbps: a
  // file from before the device's bandwidth was part of the key, whose device is unknown) is not
  // looked up but kept, so to_json writes it back and a shared file loses no other build's choices.
  bool merge_json(const std::string& json);
  size_t foreign_size() const { return foreign_.size(); }

 private:
  std::map<TuneKey, EngineConfig> map_;
  // Entries another build wrote, as their JSON objects (canonical text), sorted and deduplicated.
  std::map<std::string, std::string> foreign_;
};

// Where the cache file lives (SMOE_ENGINE_TUNE_CACHE, else the user cache directory); empty when
// neither the variable nor a home directory is known.
std::string tune_cache_path(const char* (*lookup)(const char*));

}  // namespace engine
}  // namespace smoe
