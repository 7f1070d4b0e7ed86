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
// Lean HBM (H100): dA' with K (= d) at least this runs cooperative 128 x 256 (heuristic.cpp).
constexpr int kLeanCoopDSwiGLUMinK = 3584;

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
// varlen-M tile order (tile_order.h, band_order): bands of kAutoNBand N-tiles where one expert's
// weights for the GEMM (N x K bf16) reach ~the L2 (50 MB on the H100 / H200). Why: in the default
// order a wave of S CTAs covers every N-tile of ~S / n_tiles M-tiles, so an expert wider than L2
// streams all its weights again every wave (the L2 model, docs/wip/tile_order_model.md: E16 K1
// n8192's up-proj 18.0 GB -> 2.3 GB); below L2 the default order shares each M-tile's A rows
// across the wave and bands only cost (30B n256's dX x0.83 at band 8). Measured on the H100
// (bench/results/h100/n_band_ab.md): up-proj x1.14-1.15 and dA' x1.09-1.10 at 128 MB, x1.03-1.04
// at 64-98 MB, 0.98-1.01 at 50-56 MB; band 8 beat 16 on the K = 1 shapes. Held out on 40 other
// shapes (same file, last section): the banded up-proj x1.03-1.18 wherever it crosses the edge.
constexpr int64_t kBandMinWeightBytes = int64_t{48} << 20;
constexpr int kAutoNBand = 8;

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
