// The typed configuration of one engine GEMM: which kernel instantiation runs a call. The
// heuristic (heuristic.h) returns one, the dispatch table (engine.cpp) is keyed by it, and the
// instantiations that exist are the one list in CMakeLists.txt (SMOE_ENGINE_SPECS), generated into
// engine_instances/instances.inc: SMOE_ENGINE_INSTANCE(fn, kind, sched, BN, cluster, args).
#pragma once

#include <string>

namespace smoe {
namespace engine {

// What a GEMM computes and how its operands arrive (gemm_launch.cuh, Instance<>).
enum class Kind : int {
  up_swiglu,      // varlen-M: gathered x, W1 K-major, SwiGLU epilogue -> H, A
  down_store,     // varlen-M: A by TMA, W2 K-major -> Y
  dx_store,       // varlen-M: dH by TMA, W1 MN-major -> dX~
  da_dswiglu,     // varlen-M: gathered dO, W2 MN-major, dSwiGLU + dS epilogue -> dH, A', dS partials
  dw_gather_p,    // varlen-K: P gathered, Q by TMA, D [E][M][N]
  dw_gather_p_t,  // varlen-K: a Q-gathered call run transposed, D stored [E][N][M]
  dw_tma,         // varlen-K: P and Q contiguous, both by TMA
};

// Schedule of a varlen-M instantiation (tile_config.cuh); varlen-K is always cooperative.
//   kPingPongStaged / kPingPongStaged2: ping-pong whose store epilogue stages its tile in shared
//     memory for TMA stores, one or two 32-row slabs per warpgroup (EpiStoreStagedT<1 / 2>);
//   kPingPong64: ping-pong with 64 x BN tiles (BN = 256: one m64n256 wgmma per K-step).
enum class Sched : int { kCoop, kPingPong, kPingPongStaged, kPingPongStaged2, kPingPong64 };

struct EngineConfig {
  Kind kind = Kind::down_store;
  Sched sched = Sched::kCoop;
  int bn = 128;     // columns of a tile: 128, 192 or 256
  int cluster = 1;  // CTAs per cluster along M (B multicast; varlen-K: Q multicast): 1 or 2

  constexpr int bm() const { return sched == Sched::kPingPong64 ? 64 : 128; }
  constexpr bool pingpong() const { return sched != Sched::kCoop; }
  constexpr bool operator==(const EngineConfig& o) const {
    return kind == o.kind && sched == o.sched && bn == o.bn && cluster == o.cluster;
  }
  constexpr bool operator!=(const EngineConfig& o) const { return !(*this == o); }
};

// Whether the build has this instantiation (the generated list).
bool is_built(const EngineConfig& c);
// Its position in that list, -1 where not built: the fixed order the tuner's candidates keep
// (candidates.h), so that equal timings always break the same way.
int built_index(const EngineConfig& c);
// The kind's name as the instance list spells it ("down_store").
const char* kind_name(Kind k);
// For messages, SMOE_ENGINE_PRINT and the tune cache file (never matched): "down_store_pps2_c2<192>".
std::string to_string(const EngineConfig& c);

}  // namespace engine
}  // namespace smoe
