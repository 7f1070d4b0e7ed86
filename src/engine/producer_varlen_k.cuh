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

// One operand: a tile of BX columns (m or n) by BK rows per stage. Thread t copies chunk t % (BX/8)
// of rows t / (BX/8) + R i (R = 128 / (BX/8) rows per pass). Addresses are computed once per
// K-tile, when the row indices arrive (fetch_rows), so issuing a copy is an add and the cp.async:
// the copy loop is the producer's critical path (with the 64-bit row * ld products and constant
// reloads inside it, v0 of this loader issued a copy only every ~15 instructions and starved the
// tensor cores). Shared addresses: rows 8 apart are one swizzle atom (BK-direction) apart, so a
// thread needs only the addresses of its first (8 / R) passes.
template <int BX, int BK, class SmemLayout>
struct MNMajorRowLoader {
  static constexpr int kChunksPerRow = BX / 8;                       // 16-byte chunks
  static constexpr int kRowsPerPass = kProducerThreads / kChunksPerRow;
  static constexpr int kPasses = BK / kRowsPerPass;
  static constexpr int kPhases = kRowsPerPass < 8 ? 8 / kRowsPerPass : 1;
  static constexpr int kAtomsPerStep = kRowsPerPass < 8 ? 1 : kRowsPerPass / 8;
  static_assert(kChunksPerRow <= kProducerThreads && BK % kRowsPerPass == 0, "tile too wide");
  static_assert(8 % kRowsPerPass == 0 || kRowsPerPass % 8 == 0, "rows per pass vs swizzle period");

  int chunk;                  // this thread's chunk column
  int row_in_tile0;           // its first row inside the K-tile
  uint32_t saddr0[kPhases];   // stage-0 shared addresses of passes 0 .. kPhases-1
  uint32_t atom_bytes;        // shared-memory distance of rows 8 apart
  const Bf16* src[kPasses];   // global source of each pass (nullptr: zero fill)

  template <class STensor>
  __device__ void init(const STensor& s, int tid) {
    chunk = tid % kChunksPerRow;
    row_in_tile0 = tid / kChunksPerRow;
#pragma unroll
    for (int i = 0; i < kPhases; ++i)
      saddr0[i] = smem_u32(&s(chunk * 8, row_in_tile0 + i * kRowsPerPass, 0));
    atom_bytes = smem_u32(&s(chunk * 8, row_in_tile0 + 8, 0)) - smem_u32(&s(chunk * 8, row_in_tile0, 0));
  }

  // Sources of K-tile k for an expert whose rows are [row0, row0 + rows); columns col0 + chunk.
  __device__ void fetch_rows(const Bf16* base, int64_t ld, const int32_t* gather, int row0, int rows,
                             int k, int col0, int cols) {
    const int c = col0 + chunk * 8;
    const bool col_ok = c < cols;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r = k * BK + row_in_tile0 + i * kRowsPerPass;
      src[i] = nullptr;
      if (r < rows && col_ok) {
        const int64_t row = gather ? __ldg(gather + row0 + r) : row0 + r;
        src[i] = base + row * ld + c;
      }
    }
  }

  __device__ void issue(const Bf16* any_valid, uint32_t stage_off) const {
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const uint32_t sa = saddr0[i % kPhases] + (i / kPhases) * kAtomsPerStep * atom_bytes + stage_off;
      cp_async_16_zfill(sa, src[i] ? src[i] : any_valid, src[i] != nullptr);
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
      const int m0 = w.m_tile * BM, n0 = w.n_tile * BN;
      if (k_tiles > 0) {
        la.fetch_rows(p.P, p.ld_p, p.gather_p, w.row0, w.rows, 0, m0, p.M);
        lb.fetch_rows(p.Q, p.ld_q, p.gather_q, w.row0, w.rows, 0, n0, p.N);
      }
      for (int k = 0; k < k_tiles; ++k) {
        cutlass::arch::ClusterBarrier::wait(&s.empty[ps.stage], ps.phase ^ 1u);
        la.issue(p.P, ps.stage * Cfg::kBytesA);
        lb.issue(p.Q, ps.stage * Cfg::kBytesB);
        cp_async_arrive_noinc(&s.full[ps.stage]);
        if (k + 1 < k_tiles) {
          la.fetch_rows(p.P, p.ld_p, p.gather_p, w.row0, w.rows, k + 1, m0, p.M);
          lb.fetch_rows(p.Q, p.ld_q, p.gather_q, w.row0, w.rows, k + 1, n0, p.N);
        }
        ps.template advance<kStages>();
      }
    }
  }
};

}  // namespace engine
}  // namespace smoe
