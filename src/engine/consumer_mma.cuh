// Consumer side of the mainloop: the warpgroup(s) of a tile (two cooperative, one ping-pong) issue wgmma on the stages the producer filled,
// one K-tile (4 wgmma of K = 16) per stage, one batch in flight while the next stage is awaited;
// a stage is handed back (one arrival per consumer warp) once the wgmma that read it retired.
#pragma once

#include "engine/sm90_primitives.cuh"
#include "engine/tile_config.cuh"

namespace smoe {
namespace engine {

template <class Cfg, bool kFenceProxy>
struct ConsumerMma {
  static constexpr int kStages = Cfg::kStages;
  // One arrival per warp that read the stage: both warpgroups (cooperative) or one (ping-pong).
  // In a cluster the stage is also written by the partner's multicast: its producer waits for our
  // warps too, so each warp arrives on the stage's empty barrier in every CTA of the cluster.
  static constexpr uint32_t kEmptyArrivals = Cfg::kMmaThreads / 32 * Cfg::kClusterM;

  template <class Storage>
  __device__ static void release(Storage& s, int stage) {
    const uint32_t lane = threadIdx.x % 32;
    if constexpr (Cfg::kClusterM == 1) {
      if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&s.empty[stage]);
    } else {
      // Lane c arrives on CTA c's barrier (the local one included, through its cluster address).
      cutlass::arch::ClusterBarrier::arrive(&s.empty[stage], lane, lane < Cfg::kClusterM);
    }
  }

  // accum = sum over k_tiles >= 1 K-tiles.
  // Tail: called (all consumer threads) on the last K-tile when tail_valid > 0, before the MMA
  // reads it (varlen-K: zero the rows past the expert's end).
  template <class Tail, class TiledMma, class FragA, class FragB, class Accum, class Storage>
  __device__ static void run(TiledMma& tiled_mma, const FragA& tCrA, const FragB& tCrB, Accum& accum,
                             int k_tiles, int tail_valid, PipeState& ps, Storage& s) {
    // k_tiles == 0 (an empty expert's weight gradient): accum is left as it is and the epilogue
    // stores zeros (TileCtx::zero). Clearing it here would give the accumulator two definitions
    // that meet at the wgmma pipeline, and ptxas then spills all of it.
    if (k_tiles == 0) return;
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    int release_stage = ps.stage;
    for (int k = 0; k < k_tiles; ++k) {
      cutlass::arch::ClusterBarrier::wait(&s.full[ps.stage], ps.phase);
      if (tail_valid > 0 && k == k_tiles - 1)
        Tail::apply(s, ps.stage, tail_valid, static_cast<int>(threadIdx.x) - kProducerThreads);
      if constexpr (kFenceProxy) fence_generic_to_async_smem();
      warpgroup_fence_operand(accum);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        cute::gemm(tiled_mma, tCrA(_, _, kb, ps.stage), tCrB(_, _, kb, ps.stage), accum);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_wait<1>();  // the previous K-tile's batch has retired: its stage is free
      warpgroup_fence_operand(accum);
      if (k > 0) {
        release(s, release_stage);
        release_stage = release_stage + 1 == kStages ? 0 : release_stage + 1;
      }
      ps.template advance<kStages>();
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(accum);
    release(s, release_stage);
  }
};

}  // namespace engine
}  // namespace smoe
