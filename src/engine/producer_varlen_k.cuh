// Producer warpgroup of the varlen-K kernels (weight gradients: the reduction runs over the rows
// (tokens) of one expert, a different length per expert).
//
//   D_e(m, n) = sum over rows r of expert e:  P[src_P(r)][m0 + m] * Q[src_Q(r)][n0 + n]
//
// Both operands are MN-major in shared memory (64 contiguous m or n values per k = row). Rows are
// copied with 16-byte cp.async by all 128 producer threads, each row either contiguous
// (src(r) = r) or gathered (src(r) = gather_idx[r]); rows past the expert's end and columns past
// the operand's width are zero-filled, so the tail K-tile adds exact zeros (no other expert's data
// enters, whatever its values). The row indices of K-tile k + 1 are fetched while K-tile k is
// issued, so index latency stays off the copy path.
#pragma once

#include "engine/sm90_primitives.cuh"
#include "engine/tile_config.cuh"
#include "engine/tile_scheduler.cuh"

namespace smoe {
namespace engine {

// One operand: a tile of BX columns (m or n) by BK rows per stage.
template <int BX, int BK, class SmemLayout>
struct MNMajorRowLoader {
  static constexpr int kChunksPerRow = BX / 8;                       // 16-byte chunks
  static constexpr int kRowsPerPass = kProducerThreads / kChunksPerRow;
  static constexpr int kPasses = BK / kRowsPerPass;
  static_assert(kChunksPerRow <= kProducerThreads && BK % kRowsPerPass == 0, "tile too wide");

  int chunk;                  // this thread's chunk column
  int row_in_tile0;           // its first row inside the K-tile
  uint32_t saddr[kPasses];    // stage-0 shared addresses
  int src_row[kPasses];       // source rows of the K-tile being issued (-1: zero fill)

  template <class STensor>
  __device__ void init(const STensor& s, int tid) {
    chunk = tid % kChunksPerRow;
    row_in_tile0 = tid / kChunksPerRow;
#pragma unroll
    for (int i = 0; i < kPasses; ++i)
      saddr[i] = smem_u32(&s(chunk * 8, row_in_tile0 + i * kRowsPerPass, 0));
  }

  // Source rows of K-tile k of an expert whose rows are [row0, row0 + rows).
  __device__ void fetch_rows(const int32_t* gather, int row0, int rows, int k) {
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r = k * BK + row_in_tile0 + i * kRowsPerPass;
      src_row[i] = r < rows ? (gather ? __ldg(gather + row0 + r) : row0 + r) : -1;
    }
  }

  __device__ void issue(const Bf16* base, int64_t ld, int col0, int cols, uint32_t stage_off) const {
    const int c = col0 + chunk * 8;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const bool ok = src_row[i] >= 0 && c < cols;
      const Bf16* g = ok ? base + static_cast<int64_t>(src_row[i]) * ld + c : base;
      cp_async_16_zfill(saddr[i] + stage_off, g, ok);
    }
  }
};

template <class Cfg>
struct ProducerVarlenK {
  static constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, kStages = Cfg::kStages;
  static constexpr uint32_t kFullArrivals = kProducerThreads;
  static_assert(Cfg::kMajorA == GMMA::Major::MN && Cfg::kMajorB == GMMA::Major::MN, "varlen-K: MN-major");

  template <class Params, class Storage, class Sched>
  __device__ static void run(const Params& p, Storage& s, const Sched& sched) {
    const int tid = threadIdx.x;
    Tensor sA = make_tensor(make_smem_ptr(s.A.data()), typename Cfg::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(s.B.data()), typename Cfg::SmemLayoutB{});
    MNMajorRowLoader<BM, BK, typename Cfg::SmemLayoutA> la;
    MNMajorRowLoader<BN, BK, typename Cfg::SmemLayoutB> lb;
    la.init(sA, tid);
    lb.init(sB, tid);

    PipeState ps;
    const int total = sched.total_tiles();
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
      const WorkTile w = sched.get(t);
      const int k_tiles = (w.rows + BK - 1) / BK;
      if (k_tiles > 0) {
        la.fetch_rows(p.gather_p, w.row0, w.rows, 0);
        lb.fetch_rows(p.gather_q, w.row0, w.rows, 0);
      }
      for (int k = 0; k < k_tiles; ++k) {
        cutlass::arch::ClusterBarrier::wait(&s.empty[ps.stage], ps.phase ^ 1u);
        la.issue(p.P, p.ld_p, w.m_tile * BM, p.M, ps.stage * Cfg::kBytesA);
        lb.issue(p.Q, p.ld_q, w.n_tile * BN, p.N, ps.stage * Cfg::kBytesB);
        cp_async_arrive_noinc(&s.full[ps.stage]);
        if (k + 1 < k_tiles) {
          la.fetch_rows(p.gather_p, w.row0, w.rows, k + 1);
          lb.fetch_rows(p.gather_q, w.row0, w.rows, k + 1);
        }
        ps.template advance<kStages>();
      }
    }
  }
};

}  // namespace engine
}  // namespace smoe
