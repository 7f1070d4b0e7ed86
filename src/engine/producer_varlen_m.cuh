// Producer warpgroup of the varlen-M kernels (rows grouped by expert, K = the hidden dimension).
//
// B (the expert's weights) by TMA from one 2-D tensor map over all experts (or two: gate/up as two
// tensors, see load_b):
//   K-major  [E*N rows][K]:   tile rows e*N + n0 .. + BN (rows past N belong to the next expert or
//                             are zero-filled at the end: they only feed columns that are not stored)
//   MN-major [E*K rows][N]:   tile (k, n) at row e*K + k, columns n0 .. (zero-filled past N).
// A (activations) either
//   by TMA (contiguous grouped rows, one tensor map [rows][K]; rows past the expert's end only feed
//   rows that are not stored), or
//   gathered: row r of the tile is A[gather_idx[row0 + r]], 16-byte cp.async by all 128 producer
//   threads (thread t: 16-byte chunk t % 8 of rows t / 8 + 16 i), zero-filled past the expert's end.
// One mbarrier per stage: the TMA thread's arrive_expect_tx (+ 128 cp.async noinc arrivals).
// In a cluster of 2 along M, B arrives half from this CTA's TMA and half from the partner's
// multicast; the stage's expected bytes are the same.
#pragma once

#include "engine/sm90_primitives.cuh"
#include "engine/tile_config.cuh"
#include "engine/tile_scheduler.cuh"

namespace smoe {
namespace engine {

enum class ALoad { kTma, kGather };

template <class Cfg, ALoad kALoad>
struct ProducerVarlenM {
  static constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, kStages = Cfg::kStages;
  static constexpr bool kGather = kALoad == ALoad::kGather;
  static constexpr int kRowsPerThread = BM * (BK / 8) / kProducerThreads;  // 8
  static constexpr uint32_t kTxBytes = Cfg::kBytesB + (kGather ? 0 : Cfg::kBytesA);
  static constexpr uint32_t kFullArrivals = 1 + (kGather ? kProducerThreads : 0);
  static constexpr int kGatherRows = 0;  // no staged row offsets (SharedStorage)
  static constexpr int kCluster = Cfg::kClusterM;
  static constexpr int kClusterB = kCluster;  // CTAs sharing a B tile (multicast along M)

  // B tile (n0.., k) of expert e (see the header comment for the two layouts).
  template <class Params, class SB, class MB>
  __device__ static void load_b(const Params& p, SB& sB, const MB& mB, const WorkTile& w, int k,
                                int stage, uint64_t& bar, int rank) {
    if constexpr (Cfg::kMajorB == GMMA::Major::K) {
      if (p.b_halves) {
        // Gate/up as two tensors [E][N/2][K]: the stage's rows [0, BN/2) are gate rows j0.. of w1,
        // rows [BN/2, BN) the same rows of w3, so accumulator column c (gate) pairs with c + BN/2
        // (up) in one thread. In a cluster along M each CTA loads its 1/C of each half and
        // multicasts it, so every CTA still receives BN x BK per stage (the barrier's bytes).
        constexpr int H = BN / 2;
        static_assert(H % (8 * kClusterB) == 0, "B halves: whole 8-row swizzle atoms per cluster rank");
        const int j0 = w.n_tile * H;
        const int b_rank = kClusterB == 1 ? 0 : rank;
        Tensor gB = local_tile(domain_offset(make_coord(w.expert * p.b_stride + j0, 0), mB),
                               make_shape(Int<H>{}, Int<BK>{}), make_coord(0, _));
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) {
          Tensor sBh = local_tile(sB, make_shape(Int<H>{}, Int<BK>{}, Int<kStages>{}), make_coord(h, 0, 0));
          auto [tBgB, tBsB] = tma_partition(p.tma_bh[h], b_rank, Layout<Int<kClusterB>>{}, group_modes<0, 2>(sBh),
                                            group_modes<0, 2>(gB));
          if constexpr (kClusterB == 1)
            copy(p.tma_bh[h].with(bar), tBgB(_, k), tBsB(_, stage));
          else
            copy(p.tma_bh[h].with(bar, static_cast<uint16_t>((1u << kCluster) - 1)), tBgB(_, k), tBsB(_, stage));
        }
        return;
      }
    }
    const int n0 = w.n_tile * BN;
    // MN-major with two tensors (dX~ over [w1; w3]): K-tiles below k_split_tiles from tma_b, the
    // rest from tma_b2, each tensor holding K/2 rows per expert (b_stride apart).
    const bool second = p.k_split_tiles > 0 && k >= p.k_split_tiles;
    const int kk = second ? k - p.k_split_tiles : k;
    Tensor gB = [&] {
      if constexpr (Cfg::kMajorB == GMMA::Major::K)
        return local_tile(domain_offset(make_coord(w.expert * p.b_stride + n0, 0), mB),
                          make_shape(Int<BN>{}, Int<BK>{}), make_coord(0, _));
      else
        return local_tile(domain_offset(make_coord(n0, w.expert * p.b_stride), mB),
                          make_shape(Int<BN>{}, Int<BK>{}), make_coord(0, _));
    }();
    const auto& tma = second ? p.tma_b2 : p.tma_b;
    // Cluster along M: this CTA loads its 1/C slice of the tile into the same place in every CTA.
    const int b_rank = kClusterB == 1 ? 0 : rank;
    auto [tBgB, tBsB] = tma_partition(tma, b_rank, Layout<Int<kClusterB>>{}, group_modes<0, 2>(sB),
                                      group_modes<0, 2>(gB));
    if constexpr (kClusterB == 1)
      copy(tma.with(bar), tBgB(_, kk), tBsB(_, stage));
    else
      copy(tma.with(bar, static_cast<uint16_t>((1u << kCluster) - 1)), tBgB(_, kk), tBsB(_, stage));
  }

  // Contiguous A rows row0.. of the tile (k-th K-tile).
  template <class Params, class SA, class MA>
  __device__ static void load_a_tma(const Params& p, SA& sA, const MA& mA, const WorkTile& w, int k,
                                    int stage, uint64_t& bar, int rank) {
    Tensor gA = local_tile(domain_offset(make_coord(w.row0, 0), mA),
                           make_shape(Int<BM>{}, Int<BK>{}), make_coord(0, _));
    (void)rank;
    auto [tAgA, tAsA] = tma_partition(p.tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA),
                                      group_modes<0, 2>(gA));
    copy(p.tma_a.with(bar), tAgA(_, k), tAsA(_, stage));
  }

  template <class Params, class Storage, class Sched>
  __device__ static void run(const Params& p, Storage& s, const Sched& sched) {
    const int tid = threadIdx.x;  // 0..127
    if (!kGather && tid != 0) return;

    Tensor sA = make_tensor(make_smem_ptr(s.A.data()), typename Cfg::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(s.B.data()), typename Cfg::SmemLayoutB{});
    Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.a_rows, p.K));
    Tensor mB = p.tma_b.get_tma_tensor(make_shape(p.b_rows, p.b_cols));

    // Gather: this thread's chunk column and shared-memory addresses (stage 0) for its rows.
    const int chunk = tid % 8;
    uint32_t sa_addr[kRowsPerThread];
    if constexpr (kGather) {
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i)
        sa_addr[i] = smem_u32(&sA(tid / 8 + 16 * i, chunk * 8, 0));
    }

    const int k_tiles = p.K / BK;
    PipeState ps;
    const int total = sched.total_tiles();
    for (int t = sched.first(); t < total; t += sched.stride()) {
      const WorkTile w = sched.get(t);
      const Bf16* src[kRowsPerThread];
      bool valid[kRowsPerThread];
      if constexpr (kGather) {
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
          const int r = tid / 8 + 16 * i;
          valid[i] = r < w.rows;
          const int64_t row = valid[i] ? p.gather_idx[w.row0 + r] : 0;
          src[i] = p.a_gather + row * p.K + chunk * 8;
        }
      }

      for (int k = 0; k < k_tiles; ++k) {
        cutlass::arch::ClusterBarrier::wait(&s.empty[ps.stage], ps.phase ^ 1u);
        if (tid == 0) {
          cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.full[ps.stage], kTxBytes);
          load_b(p, sB, mB, w, k, ps.stage, s.full[ps.stage], sched.rank);
          if constexpr (!kGather) load_a_tma(p, sA, mA, w, k, ps.stage, s.full[ps.stage], sched.rank);
        }
        if constexpr (kGather) {
          const uint32_t stage_off = ps.stage * Cfg::kBytesA;
#pragma unroll
          for (int i = 0; i < kRowsPerThread; ++i)
            cp_async_16_zfill(sa_addr[i] + stage_off, src[i] + k * BK, valid[i]);
          cp_async_arrive_noinc(&s.full[ps.stage]);
        }
        ps.template advance<kStages>();
      }
    }
    // Cluster: wait until the partner released every stage (tile_config.cuh).
    if constexpr (kCluster > 1)
      if (tid == 0) wait_stages_released<kStages>(s.empty, ps);
  }
};

}  // namespace engine
}  // namespace smoe
