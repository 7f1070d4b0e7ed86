// Producer warpgroup of the varlen-K kernels (weight gradients: the reduction runs over the rows
// (tokens) of one expert, a different length per expert).
//
//   D_e(m, n) = sum over rows r of expert e:  P[src_P(r)][m0 + m] * Q[src_Q(r)][n0 + n]
//
// P is gathered (src(r) = gather_idx[r]: dO for dW2, x for dW1 computed transposed), Q is the
// grouped rows themselves (A' for dW2, dH for dW1). Both are MN-major in shared memory (64
// contiguous m or n values per k = row).
//   * contiguous operand: TMA, one tensor map over all grouped rows; in an expert's last, partial
//     K-tile the box runs into the next expert's rows, which the consumers overwrite with zeros
//     before the MMA (ZeroTail), so no other expert's values enter (not even 0 * Inf).
//   * gathered operand: 16-byte cp.async by all 128 producer threads; rows past the expert's end
//     and columns past the width are zero-filled. The row offsets (gather_idx[r] * ld) of up to
//     kChunkRows rows (32 K-tiles) are staged in shared memory at once, all loads in flight
//     together, and each stage's addresses are then a shared-memory read and an add: per K-tile the
//     producer issues only its copies. (Loading 8 indices per thread per K-tile from global, one
//     K-tile ahead, left the producer busy ~80% of the time under ncu at 07571c4: waiting on the
//     index loads, 64-bit multiplies and a branch per row, while the consumers waited ~47% of
//     theirs on the full barrier; the up-proj, whose rows are fixed per tile, has no such cost.)
// One mbarrier per stage: the TMA thread's arrive_expect_tx + 128 cp.async noinc arrivals.
#pragma once

#include "engine/sm90_primitives.cuh"
#include "engine/tile_config.cuh"
#include "engine/tile_scheduler.cuh"

namespace smoe {
namespace engine {

// The gathered operand: a tile of BX columns (m or n) by BK rows per stage. Thread t copies chunk
// t % (BX/8) of rows t / (BX/8) + R i (R = 128 / (BX/8) rows per pass). Rows 8 apart are one
// swizzle atom (BK-direction) apart, so a thread keeps only its first (8 / R) passes' addresses.
template <int BX, int BK>
struct GatherRowLoader {
  static constexpr int kChunksPerRow = BX / 8;
  static constexpr int kRowsPerPass = kProducerThreads / kChunksPerRow;
  static constexpr int kPasses = BK / kRowsPerPass;
  static constexpr int kPhases = kRowsPerPass < 8 ? 8 / kRowsPerPass : 1;
  static constexpr int kAtomsPerStep = kRowsPerPass < 8 ? 1 : kRowsPerPass / 8;
  static_assert(kChunksPerRow <= kProducerThreads && BK % kRowsPerPass == 0, "tile too wide");
  static_assert(8 % kRowsPerPass == 0 || kRowsPerPass % 8 == 0, "rows per pass vs swizzle period");
  // Row offsets staged per refill: 32 K-tiles (16 KB of shared memory). An expert with more rows
  // refills every kChunkTiles K-tiles.
  static constexpr int kChunkRows = 2048;
  static constexpr int kChunkTiles = kChunkRows / BK;
  static constexpr int kStageLoads = kChunkRows / kProducerThreads;
  static_assert(kChunkRows % BK == 0 && kChunkRows % kProducerThreads == 0, "chunk: whole K-tiles");
  static constexpr uint32_t kProducerBar = 4;  // named barrier of the 128 producer threads

  int tid;
  int chunk;
  int row_in_tile0;
  uint32_t saddr0[kPhases];
  uint32_t atom_bytes;
  const Bf16* src[kPasses];
  uint32_t valid;  // bit i: pass i's row lies inside the expert and its column inside the width

  template <class STensor>
  __device__ void init(const STensor& s, int t) {
    tid = t;
    chunk = t % kChunksPerRow;
    row_in_tile0 = t / kChunksPerRow;
#pragma unroll
    for (int i = 0; i < kPhases; ++i)
      saddr0[i] = smem_u32(&s(chunk * 8, row_in_tile0 + i * kRowsPerPass, 0));
    atom_bytes = smem_u32(&s(chunk * 8, row_in_tile0 + 8, 0)) - smem_u32(&s(chunk * 8, row_in_tile0, 0));
  }

  // off[j] = gather[row0 + r0 + j] * ld for the chunk's rows j < min(kChunkRows, rows - r0), by all
  // 128 producer threads, every index load in flight before the first store. The barrier before:
  // no thread still reads the previous chunk; after: every offset is written.
  __device__ void stage_offsets(int64_t* off, const int32_t* __restrict__ gather, int64_t ld, int row0, int rows,
                                int r0) const {
    cutlass::arch::NamedBarrier::sync(kProducerThreads, kProducerBar);
    const int n = rows - r0 < kChunkRows ? rows - r0 : kChunkRows;
    int32_t v[kStageLoads];
#pragma unroll
    for (int j = 0; j < kStageLoads; ++j) {
      const int r = tid + j * kProducerThreads;
      v[j] = r < n ? __ldg(gather + row0 + r0 + r) : 0;
    }
#pragma unroll
    for (int j = 0; j < kStageLoads; ++j) off[tid + j * kProducerThreads] = static_cast<int64_t>(v[j]) * ld;
    cutlass::arch::NamedBarrier::sync(kProducerThreads, kProducerBar);
  }

  // Addresses of K-tile k (its offsets staged: k's chunk is the current one), columns col0 + chunk.
  // Branch-free: a row past the end or a column past the width reads offset 0 of base (a valid
  // address, not read: the copy zero-fills).
  __device__ void make_src(const int64_t* off, const Bf16* base, int rows, int k, int col0, int cols) {
    const int c = col0 + chunk * 8;
    const bool col_ok = c < cols;
    const int j0 = (k % kChunkTiles) * BK + row_in_tile0;
    valid = 0;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r = k * BK + row_in_tile0 + i * kRowsPerPass;
      const bool ok = r < rows && col_ok;
      const int64_t o = off[j0 + i * kRowsPerPass];
      src[i] = base + (ok ? o + c : 0);
      valid |= static_cast<uint32_t>(ok) << i;
    }
  }

  __device__ void issue(uint32_t stage_off) const {
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const uint32_t sa = saddr0[i % kPhases] + (i / kPhases) * kAtomsPerStep * atom_bytes + stage_off;
      cp_async_16_zfill(sa, src[i], (valid >> i) & 1u);
    }
  }
};

// P (operand A, the 128-wide side) gathered by cp.async (kGatherP) or contiguous by TMA, Q
// (operand B) contiguous by TMA. A call with Q gathered runs as its transpose (engine.cu), so these
// are the only arrangements needed. Without a gather both boxes come from one thread and the
// stage's barrier has that one arrival (no cp.async ones).
// In a cluster of 2 along M (Cfg::kClusterM) both CTAs of a pair take adjacent M-tiles of one
// (expert, N-tile): each loads half of the Q tile and multicasts it into both, so every Q byte
// leaves L2 once per pair (Q is re-read for every M-tile: for dW1 on engine_tma, x rows 2n/128
// times); the stage's expected bytes stay the whole tile.
template <class Cfg, bool kGatherP = true>
struct ProducerVarlenK {
  static constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, kStages = Cfg::kStages;
  static constexpr int kCluster = Cfg::kClusterM;
  static constexpr uint32_t kFullArrivals = kGatherP ? 1 + kProducerThreads : 1;
  using Loader = GatherRowLoader<BM, BK>;
  static constexpr int kGatherRows = kGatherP ? Loader::kChunkRows : 0;  // SharedStorage
  static_assert(Cfg::kMajorA == GMMA::Major::MN && Cfg::kMajorB == GMMA::Major::MN, "varlen-K: MN-major");

  template <class Params, class Storage, class Sched>
  __device__ static void run(const Params& p, Storage& s, const Sched& sched) {
    const int tid = threadIdx.x;
    Tensor sA = make_tensor(make_smem_ptr(s.A.data()), typename Cfg::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(s.B.data()), typename Cfg::SmemLayoutB{});
    Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.N, p.q_rows));
    Tensor mP = p.tma_p.get_tma_tensor(make_shape(p.M, p.q_rows));  // !kGatherP: the same rows as Q
    Loader lg;
    int64_t* off = nullptr;
    if constexpr (kGatherP) {
      lg.init(sA, tid);
      off = s.gather.off;
    } else if (tid != 0) {
      return;  // one thread issues both boxes
    }

    PipeState ps;
    const int total = sched.total_tiles();
    for (int t = sched.first(); t < total; t += sched.stride()) {
      const WorkTile w = sched.get(t);
      const int k_tiles = (w.rows + BK - 1) / BK;
      const int m0 = w.m_tile * BM, n0 = w.n_tile * BN;
      if constexpr (kGatherP) {
        if (k_tiles > 0) {  // the first chunk's offsets (k_tiles is the same in all 128 threads)
          lg.stage_offsets(off, p.gather_p, p.ld_p, w.row0, w.rows, 0);
          lg.make_src(off, p.P, w.rows, 0, m0, p.M);
        }
      }
      for (int k = 0; k < k_tiles; ++k) {
        cutlass::arch::ClusterBarrier::wait(&s.empty[ps.stage], ps.phase ^ 1u);
        if (tid == 0) {
          cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(
              &s.full[ps.stage], kGatherP ? Cfg::kBytesB : Cfg::kBytesA + Cfg::kBytesB);
          Tensor gQ = local_tile(domain_offset(make_coord(n0, w.row0), mQ),
                                 make_shape(Int<BN>{}, Int<BK>{}), make_coord(0, _));
          if constexpr (kCluster == 1) {
            auto [tQg, tQs] = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB),
                                            group_modes<0, 2>(gQ));
            copy(p.tma_q.with(s.full[ps.stage]), tQg(_, k), tQs(_, ps.stage));
          } else {  // this CTA's 1/C slice of Q, into the same stage of every CTA of the pair
            auto [tQg, tQs] = tma_partition(p.tma_q, sched.rank, Layout<Int<kCluster>>{}, group_modes<0, 2>(sB),
                                            group_modes<0, 2>(gQ));
            copy(p.tma_q.with(s.full[ps.stage], static_cast<uint16_t>((1u << kCluster) - 1)), tQg(_, k),
                 tQs(_, ps.stage));
          }
          if constexpr (!kGatherP) {
            Tensor gP = local_tile(domain_offset(make_coord(m0, w.row0), mP),
                                   make_shape(Int<BM>{}, Int<BK>{}), make_coord(0, _));
            auto [tPg, tPs] = tma_partition(p.tma_p, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA),
                                            group_modes<0, 2>(gP));
            copy(p.tma_p.with(s.full[ps.stage]), tPg(_, k), tPs(_, ps.stage));
          }
        }
        if constexpr (kGatherP) {
          lg.issue(ps.stage * Cfg::kBytesA);
          cp_async_arrive_noinc(&s.full[ps.stage]);
          if (k + 1 < k_tiles) {  // the next K-tile's addresses, past a chunk: its offsets first
            if ((k + 1) % Loader::kChunkTiles == 0)
              lg.stage_offsets(off, p.gather_p, p.ld_p, w.row0, w.rows, (k + 1) * BK);
            lg.make_src(off, p.P, w.rows, k + 1, m0, p.M);
          }
        }
        ps.template advance<kStages>();
      }
    }
    // Cluster: wait until the partner released every stage (tile_config.cuh).
    if constexpr (kCluster > 1)
      if (tid == 0) wait_stages_released<kStages>(s.empty, ps);
  }
};

// Consumer side of the tail: in an expert's last K-tile with valid < BK rows, rows [valid, BK) of
// the TMA-loaded operands (Q, operand B; and P, operand A, when it is not gathered) hold the next
// expert's values; the 256 consumer threads zero them, fence them for the async proxy and meet at a
// named barrier before the MMA reads them. (A gathered P's rows past the end are zero-filled.)
template <class Cfg, bool kZeroA = false>
struct ZeroTail {
  template <class Storage>
  __device__ static void apply(Storage& s, int stage, int valid, int ctid) {
    zero_rows<Cfg::BN>(make_tensor(make_smem_ptr(s.B.data()), typename Cfg::SmemLayoutB{}), stage, valid, ctid);
    if constexpr (kZeroA)
      zero_rows<Cfg::BM>(make_tensor(make_smem_ptr(s.A.data()), typename Cfg::SmemLayoutA{}), stage, valid, ctid);
    fence_generic_to_async_smem();
    cutlass::arch::NamedBarrier::sync(kConsumerThreads, 1);
  }

  template <int kCols, class STensor>
  __device__ static void zero_rows(const STensor& sX, int stage, int valid, int ctid) {
    constexpr int kChunks = kCols / 8;
    const int n = (Cfg::BK - valid) * kChunks;
    for (int i = ctid; i < n; i += kConsumerThreads) {
      const int row = valid + i / kChunks, chunk = i % kChunks;
      *reinterpret_cast<uint4*>(&sX(chunk * 8, row, stage)) = make_uint4(0, 0, 0, 0);
    }
  }
};

struct NoTail {
  template <class Storage>
  __device__ static void apply(Storage&, int, int, int) {}
};

}  // namespace engine
}  // namespace smoe
