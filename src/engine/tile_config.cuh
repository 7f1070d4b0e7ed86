// Tile configuration of the engine's kernels: tile shape, pipeline depth, operand majors, the
// shared-memory layouts (128-byte swizzle, what TMA writes and wgmma reads) and the tiled MMA.
//
// Every kernel is 384 threads, one CTA per SM: warpgroup 0 produces (TMA and/or cp.async),
// warpgroups 1 and 2 consume, in one of two schedules:
//   cooperative: both work on one 128 x BN tile, each owning 64 of its rows (accumulator 64 x BN
//                fp32 per warpgroup = BN/2 registers per thread); the epilogue runs while the
//                tensor cores idle (only the producer's next loads overlap it).
//   ping-pong:   each warpgroup owns a whole 128 x BN tile (two 64-row wgmma, BN registers per
//                thread), the two take alternate tiles and an order barrier lets only one issue
//                MMAs at a time, so one warpgroup's epilogue runs under the other's mainloop.
//                What short-K GEMMs (down-proj, dX~) and heavy epilogues (SwiGLU, dSwiGLU) need.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cute/atom/copy_atom.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/bfloat16.h"

#include "smoe/smoe.h"

namespace smoe {
namespace engine {

using namespace cute;
using Bf16 = cutlass::bfloat16_t;

constexpr int kThreads = 384;
constexpr int kProducerThreads = 128;
constexpr int kConsumerThreads = 256;
constexpr int kSmemLimit = 227 * 1024;  // sm_90 opt-in dynamic shared memory per block

template <GMMA::Major kMajor, int Rows, int BK, int Stages>
struct SmemOperand {
  // K-major: rows of BK contiguous elements (128 B = one swizzle row). MN-major: 64 contiguous
  // M/N elements per k; atoms tiled along K first, as the wgmma descriptor expects.
  using Atom = std::conditional_t<kMajor == GMMA::Major::K, GMMA::Layout_K_SW128_Atom<Bf16>,
                                  GMMA::Layout_MN_SW128_Atom<Bf16>>;
  using Order = std::conditional_t<kMajor == GMMA::Major::K, Step<_1, _2, _3>, Step<_2, _1, _3>>;
  using Layout = decltype(tile_to_shape(Atom{}, make_shape(Int<Rows>{}, Int<BK>{}, Int<Stages>{}),
                                        Order{}));
};

template <int BN_, int Stages_, GMMA::Major MajorA_, GMMA::Major MajorB_, bool PingPong_ = false,
          int ClusterM_ = 1, int BM_ = 128>
struct TileConfig {
  static constexpr bool kPingPong = PingPong_;
  // CTAs per cluster (1 or 2), along M: the pair takes adjacent M-tiles of one expert and one
  // N-tile; each CTA loads half of the B (weight) tile and multicasts it to both, so each weight
  // byte leaves L2 once per pair. (A pair along N multicasting A was measured for the short-K
  // store GEMMs at 6ab4848, never paid, and was removed.)
  static constexpr int kClusterM = ClusterM_;
  static_assert(kClusterM == 1 || kClusterM == 2, "cluster: 1 or 2 CTAs");
  static constexpr int kMmaThreads = kPingPong ? 128 : 256;  // threads that share one tile
  // BM: rows of a tile, 128; or 64 in ping-pong (64 x 256 per warpgroup: one m64n256 wgmma, half
  // the gathered A bytes per FLOP of 128 x 128, the accumulator's 128 registers per thread).
  static constexpr int BM = BM_;
  static_assert(BM == 128 || (BM == 64 && PingPong_), "BM: 128, or 64 in ping-pong");
  static constexpr int BN = BN_;
  static constexpr int BK = 64;
  static constexpr int kStages = Stages_;
  static constexpr GMMA::Major kMajorA = MajorA_;
  static constexpr GMMA::Major kMajorB = MajorB_;
  static constexpr int kBytesA = BM * BK * 2;  // one stage of A
  static constexpr int kBytesB = BN * BK * 2;
  static_assert(BN % 64 == 0 && BN <= 256, "BN: a multiple of 64 up to 256 (one wgmma N)");
  static_assert(!kPingPong || BM * BN / 128 <= 192, "ping-pong: BM x BN / 128 accumulator registers per thread, <= 192");

  using SmemLayoutA = typename SmemOperand<kMajorA, BM, BK, kStages>::Layout;
  using SmemLayoutB = typename SmemOperand<kMajorB, BN, BK, kStages>::Layout;
  using TiledMma = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Bf16, Bf16, float, Shape<_64, Int<BN>, Int<BK>>, kMajorA, kMajorB>(),
      Layout<Shape<Int<kPingPong ? 1 : 2>, _1, _1>>{}));
};

// Pipeline depth: as many A+B stages as fit next to the scheduler prefix and the barriers (4 KB
// kept for them), or next to an epilogue's staging buffer (epi_bytes), which follows the stages
// directly (SharedStorage): then only the prefix and barriers' exact size is kept back, since one
// more stage for 128 x 192 ping-pong (5, not 4) fits only that way.
constexpr int stages_for(int BN, int epi_bytes = 0, int BM = 128) {
  const int per_stage = (BM + BN) * 64 * 2;
  const int reserve = epi_bytes > 0 ? 4 * (kMaxExperts + 1) + 2 * 8 * 8 + 64 : 4096;
  const int n = (kSmemLimit - reserve - epi_bytes) / per_stage;
  return n > 8 ? 8 : n;
}

// The gathered varlen-K operand's row addresses (base + gather_idx[r] * ld), staged kRows at a time
// by the producer warpgroup (producer_varlen_k.cuh, GatherRowLoader); none for the other kernels.
template <int kRows>
struct GatherRowAddrs {
  int64_t addr[kRows];
};
template <>
struct GatherRowAddrs<0> {};

// An epilogue's staging buffer (epilogue/common.cuh, EpiSmem); none for the others.
template <int kBytes>
struct EpiBuffer {
  unsigned char bytes[kBytes];
};
template <>
struct EpiBuffer<0> {};

template <class Cfg, int kGatherRows = 0, int kEpiBytes = 0>
struct SharedStorage {
  alignas(1024) cute::array_aligned<Bf16, cute::cosize_v<typename Cfg::SmemLayoutA>> A;
  alignas(1024) cute::array_aligned<Bf16, cute::cosize_v<typename Cfg::SmemLayoutB>> B;
  // 128-byte swizzled TMA-store slabs: 1024-byte aligned, right after the stages (whole KBs).
  alignas(kEpiBytes > 0 ? 1024 : 1) EpiBuffer<kEpiBytes> epi;
  alignas(8) uint64_t full[Cfg::kStages];   // producer -> consumers: stage loaded
  alignas(8) uint64_t empty[Cfg::kStages];  // consumers -> producer: stage free
  int tile_start[kMaxExperts + 1];          // varlen-M scheduler prefix
  alignas(16) GatherRowAddrs<kGatherRows> gather;
};

// The pipeline position both sides advance through, across tiles.
struct PipeState {
  int stage = 0;
  uint32_t phase = 0;
  template <int Stages>
  __device__ void advance() {
    if (++stage == Stages) {
      stage = 0;
      phase ^= 1u;
    }
  }
  // Past n stages another consumer takes (ping-pong: the other warpgroup's tile).
  template <int Stages>
  __device__ void skip(int n) {
    const int s = stage + n;
    phase ^= static_cast<uint32_t>(s / Stages) & 1u;
    stage = s % Stages;
  }
};

// A producer of a 2-CTA cluster, after its last load: the partner's consumers arrive on this CTA's
// empty barriers and its multicasts land in this CTA's stages, so the CTA may exit only after every
// stage was released again, i.e. after the last of those arrivals (every multicast into a stage
// precedes its release). One thread waits.
template <int Stages>
__device__ void wait_stages_released(uint64_t* empty, PipeState ps) {
  for (int i = 0; i < Stages; ++i) {
    cutlass::arch::ClusterBarrier::wait(&empty[ps.stage], ps.phase ^ 1u);
    ps.template advance<Stages>();
  }
}

}  // namespace engine
}  // namespace smoe
