// The engine's tile heuristic: a pure function of the call's arguments, the device and the
// overrides, returning the typed configuration to dispatch (config.h). No environment, no CUDA call:
// CPU-tested (tests/cpu/test_engine_api.cpp). heuristic.cpp gives each rule with the measurement
// behind it.
#pragma once

#include <cstdint>
#include <optional>

#include "engine/args.h"
#include "engine/config.h"
#include "engine/overrides.h"

namespace smoe {
namespace engine {

struct DeviceFacts {
  int sm_count = 0;  // the device's SMs (the persistent grid); the "waves" below count tiles per SM
  int hbm_gbps = 0;  // peak memory bandwidth, GB/s (0: unknown, the H200's rules)
};

// Below this HBM bandwidth (GB/s) the heuristic takes the H100's rules (heuristic.cpp, lean_hbm).
constexpr int kLeanHbmGbps = 4000;

// SwiGLU and store GEMMs with K up to this run ping-pong by default.
constexpr int kPingPongMaxK = 2048;
// 2-CTA clusters (B multicast) by default when one expert's weights exceed this (half the 50 MB
// L2 of the H100 / H200) and the experts average at least this many rows.
constexpr int64_t kClusterMinWeightBytes = int64_t{24} << 20;
constexpr int kClusterMinRowsPerExpert = 512;
// Ping-pong store GEMMs with K up to this stage their tile in shared memory for TMA stores
// (EpiStoreStagedT, _pps) ...
constexpr int kStagedStoreMaxK = 512;
// ... in two slabs per warpgroup (a 64-row buffer, EpiStoreStagedT<2>, _pps2) up to this K.
constexpr int kStagedStore2MaxK = 256;

// The facts of the current device (cudaGetDevice): sm_count as given, HBM bandwidth from its memory
// clock and bus width (device_facts.cpp; 0 where the query fails). Cached per device.
DeviceFacts device_facts(int sm_count);
// Peak bandwidth in GB/s of a double-data-rate bus (0 for non-positive inputs).
int hbm_gbps_of(int memory_clock_khz, int bus_width_bits);

// nullopt: no built instantiation fits (only possible with overrides that force one away).
std::optional<EngineConfig> choose_varlen_m(const VarlenMArgs& a, const DeviceFacts& dev, const Overrides& o);
std::optional<EngineConfig> choose_varlen_k(const VarlenKArgs& a, const DeviceFacts& dev, const Overrides& o);

// The instantiation family a call needs (its operands, epilogue and majors).
Kind kind_of(const VarlenMArgs& a);
Kind kind_of(const VarlenKArgs& a);  // of the call as given (dw_gather_p_t for a Q-gathered one)

// A gather_q call (Q gathered, P contiguous, D [E][M][N]) runs as its transpose: P' = Q gathered,
// Q' = P contiguous, D'[e] = D[e]^T stored transposed. The gathered operand is then always the
// kernel's A (the 128-wide tile side) and the contiguous one B (TMA, up to 256 wide).
VarlenKArgs as_gather_p(const VarlenKArgs& a);

}  // namespace engine
}  // namespace smoe
