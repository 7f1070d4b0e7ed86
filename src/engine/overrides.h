// The engine's switches (SMOE_ENGINE_*), parsed once from the environment into a typed struct that
// the heuristic takes as an argument. For tuning sweeps and for the tests that run every
// instantiation; unset, the heuristic decides. A forced choice applies where that instantiation is
// built and is ignored where none is (the heuristic falls back as documented in heuristic.cpp).
//   SMOE_ENGINE_SCHED=coop|pingpong|pingpong64   varlen-M schedule (pingpong64: the 64 x 256
//                                                pairs of the gathered GEMMs, up-proj and dA')
//   SMOE_ENGINE_BN_M=128|192|256                 varlen-M column tile
//   SMOE_ENGINE_BN_K=128|256                     varlen-K column tile
//   SMOE_ENGINE_CLUSTER=1|2                      varlen-M cluster along M (B multicast)
//   SMOE_ENGINE_CLUSTER_K=1|2                    varlen-K cluster along M (Q multicast)
//   SMOE_ENGINE_PP_MAX_K=<K>                     SwiGLU / store GEMMs run ping-pong up to this K
//   SMOE_ENGINE_STAGED_STORE=0|1|2               ping-pong store GEMMs: not staged, one or two slabs
//   SMOE_ENGINE_STORE_CS=0                       plain output stores instead of evict-first st.global.cs
//   SMOE_ENGINE_N_BAND=<W>                       varlen-M tiles in bands of W N-tiles, M-tiles inside a
//                                                band (band_order, tile_order.h); 0 or off: one band
//                                                (every N-tile of an M-tile in turn); unset or not a
//                                                number >= 0: the rule (heuristic.h, kBandMinWeightBytes)
//   SMOE_ENGINE_PRINT=1                          print every choice to stderr (and where it came from)
//   SMOE_ENGINE_TUNE=0                           ignore the measured choices (tune_cache.h)
//   SMOE_ENGINE_TUNE=1                           also measure: the first eager call of a key the cache
//                                                lacks times every candidate and stores the winner
//                                                (tuner.h); unset, the cache is read, nothing measured
#pragma once

namespace smoe {
namespace engine {

enum class ForcedSched { kNone, kCoop, kPingPong, kPingPong64 };

struct Overrides {
  ForcedSched sched = ForcedSched::kNone;
  int bn_m = 0;           // 0: the heuristic's
  int bn_k = 0;
  int cluster_m = 0;      // 0, 1 or 2
  int cluster_k = 0;
  int pingpong_max_k = -1;  // -1: kPingPongMaxK (heuristic.h)
  int staged_store = -1;  // -1: by K (heuristic.h); 0, 1 or 2 forced
  bool store_streaming = true;
  int n_band = -1;  // -1: the rule (varlen_m_n_band); 0: one band (M-tile-major order); > 0: N-tiles per band
  bool print = false;
  bool tune = true;  // use the measured choices of the tune cache where it has the call's key
  bool measure = false;  // measure an unseen key on its first eager call (opt-in: costs <= ~2 s per key)
  // Whether any field forces a choice (then the cache is not consulted: the override decides).
  bool forces() const {
    return sched != ForcedSched::kNone || bn_m || bn_k || cluster_m || cluster_k || pingpong_max_k >= 0 ||
           staged_store >= 0;
  }
};

// Parse from a getenv-like lookup (null: unset). Unknown values leave that field at its default.
Overrides parse_overrides(const char* (*lookup)(const char*));
// The overrides every call uses: the environment's, parsed on first use.
const Overrides& overrides();
// Replace them (tests and tuners; not thread-safe against concurrent engine calls).
void set_overrides(const Overrides& o);
// set_overrides(parse_overrides(getenv)): after a test changed the environment.
void reload_overrides_from_env();

}  // namespace engine
}  // namespace smoe
