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
//     and columns past the width are zero-filled. The source addresses of up to kChunkRows rows
//     (32 K-tiles) are staged in shared memory at once, all index loads in flight together, and per
//     K-tile the producer reads its rows' addresses and issues its copies (GatherRowLoader below).
//     (Loading 8 indices per thread per K-tile from global, one K-tile ahead, left the producer busy
//     ~80% of the time under ncu at 07571c4: waiting on the index loads, 64-bit multiplies and a
//     branch per row, while the consumers waited ~47% of theirs on the full barrier; the up-proj,
//     whose rows are fixed per tile, has no such cost.)
// One mbarrier per stage: the TMA thread's arrive_expect_tx + 128 cp.async noinc arrivals.
#pragma once

#include "engine/sm90_primitives.cuh"
#include "engine/tile_config.cuh"
#include "engine/tile_scheduler.cuh"

namespace smoe {
namespace engine {

// The gathered operand: a tile of BX columns (m or n) by BK rows per stage. Thread t copies chunk
// t % (BX/8) of rows t / (BX/8) + R i (R = 128 / (BX/8) rows per pass; BX = 128: R = 8, 8 passes).
//
// The source addresses of up to kChunkRows rows (32 K-tiles) are staged in shared memory at once
// (all index loads in flight together), as absolute byte addresses base + gather_idx[r] * ld, and in
// the order the threads read them: a thread's kPasses rows of one K-tile are adjacent, so per K-tile
// it reads them with kPasses / 2 16-byte loads into distinct registers, adds its column offset and
// issues its copies back to back. (At 2dc5ce4 the addresses were formed one K-tile ahead from
// staged element offsets, ~100 instructions per K-tile, and ptxas copied each 64-bit address into
// one register pair before its cp.async, so every copy waited until the previous one had read its
// operands: under ncu (30B n512 dW1, daa3d48) the producer spent 27% of
// its samples forming addresses and 23% in that serialised issue, the consumers ~1/3 of theirs
// waiting for data.)
template <int BX, int BK, class SmemLayout>
struct GatherRowLoader {
  static constexpr int kChunksPerRow = BX / 8;
  static constexpr int kRowsPerPass = kProducerThreads / kChunksPerRow;
  static constexpr int kPasses = BK / kRowsPerPass;
  static_assert(kChunksPerRow <= kProducerThreads && BK % kRowsPerPass == 0, "tile too wide");
  // One pass = 8 rows = one swizzle atom along BK: pass i's rows lie i * kAtomBytes after pass 0's.
  // The 128-byte swizzle XORs address bits [4, 7) with [7, 10); a step of whole KBs leaves those
  // bits alone, so the step is the same for every chunk and row (the unswizzled layout's).
  static_assert(kRowsPerPass == 8 && kPasses == 8, "varlen-K gather: BX = 128 (16 chunks, 8 rows per pass)");
  static constexpr uint32_t kAtomBytes = static_cast<uint32_t>(
      sizeof(Bf16) * (SmemLayout{}.layout_b()(0, kRowsPerPass, 0) - SmemLayout{}.layout_b()(0, 0, 0)));
  static_assert(kAtomBytes % 1024 == 0, "pass step: whole swizzle periods");
  // Row addresses staged per refill: 32 K-tiles (16 KB of shared memory). An expert with more rows
  // refills every kChunkTiles K-tiles.
  static constexpr int kChunkRows = 2048;
  static constexpr int kChunkTiles = kChunkRows / BK;
  static constexpr int kStageLoads = kChunkRows / kProducerThreads;
  static_assert(kChunkRows % BK == 0 && kChunkRows % kProducerThreads == 0 && kProducerThreads % BK == 0,
                "chunk: whole K-tiles");
  static constexpr uint32_t kProducerBar = 4;  // named barrier of the 128 producer threads

  int tid;
  uint32_t saddr0;     // this thread's first row and chunk in stage 0
  uint32_t col_bytes;  // this thread's column offset in bytes (0 when its columns lie past the width)
  bool col_ok;

  template <class STensor>
  __device__ void init(const STensor& s, int t) {
    tid = t;
    saddr0 = smem_u32(&s((t % kChunksPerRow) * 8, t / kChunksPerRow, 0));
  }

  // The tile's columns col0 + chunk * 8 .. + 8 of width cols.
  __device__ void set_cols(int col0, int cols) {
    const int c = col0 + (tid % kChunksPerRow) * 8;
    col_ok = c < cols;
    col_bytes = col_ok ? static_cast<uint32_t>(c) * static_cast<uint32_t>(sizeof(Bf16)) : 0u;
  }

  // Where row r of a chunk (K-tile r / BK, row r % BK = pass i * 8 + thread row) is staged: the
  // K-tile's BK slots, the thread row's kPasses adjacent.
  __device__ static int slot(int r) {
    const int rt = r % BK;
    return (r / BK) * BK + (rt % kRowsPerPass) * kPasses + rt / kRowsPerPass;
  }

  // addr[slot(j)] = base + gather[row0 + r0 + j] * ld (bytes) for the chunk's rows j < min(kChunkRows,
  // rows - r0), base for the rest (a valid address; those rows are zero-filled, not read), by all 128
  // producer threads, every index load in flight before the first store. The barrier before: no
  // thread still reads the previous chunk; after: every address is written.
  __device__ void stage_rows(int64_t* addr, const Bf16* base, const int32_t* __restrict__ gather, int64_t ld,
                             int row0, int rows, int r0) const {
    cutlass::arch::NamedBarrier::sync(kProducerThreads, kProducerBar);
    const int n = rows - r0 < kChunkRows ? rows - r0 : kChunkRows;
    const int32_t* g = gather + row0 + r0;
    int32_t v[kStageLoads];
#pragma unroll
    for (int j = 0; j < kStageLoads; ++j) {
      const int r = tid + j * kProducerThreads;
      v[j] = r < n ? __ldg(g + r) : 0;
    }
    int64_t* a = addr + slot(tid);  // slot(tid + j * 128) = slot(tid) + j * 128: 128 rows = whole K-tiles
#pragma unroll
    for (int j = 0; j < kStageLoads; ++j)
      a[j * kProducerThreads] = reinterpret_cast<int64_t>(base + static_cast<int64_t>(v[j]) * ld);
    cutlass::arch::NamedBarrier::sync(kProducerThreads, kProducerBar);
  }

  // K-tile k's copies (its addresses staged: k's chunk is the current one) into the stage at
  // stage_off. A row past the expert's end or a column past the width is zero-filled.
  __device__ void issue(const int64_t* addr, int k, int rows, uint32_t stage_off) const {
    const int row_in_tile0 = tid / kChunksPerRow;
    // pass i's row is inside iff i * 8 < lim; no column: no row
    const int lim = col_ok ? rows - k * BK - row_in_tile0 : 0;
    const int64_t* a = addr + (k % kChunkTiles) * BK + row_in_tile0 * kPasses;
    int64_t src[kPasses];
#pragma unroll
    for (int i = 0; i < kPasses; i += 2) {
      const longlong2 q = *reinterpret_cast<const longlong2*>(a + i);
      src[i] = q.x + col_bytes;
      src[i + 1] = q.y + col_bytes;
    }
    cp_async_16_zfill_rows8<kAtomBytes, kRowsPerPass>(saddr0 + stage_off, src, lim);
  }
};

// P (operand A, the 128-wide side) gathered by cp.async (kGatherP) or contiguous by TMA, Q
// (operand B) contiguous by TMA. A call with Q gathered runs as its transpose (engine.cpp, as_gather_p in heuristic.cpp), so these
// are the only arrangements needed. Without a gather both boxes come from one thread and the
// stage's barrier has that one arrival (no cp.async ones).
// In a cluster of 2 along M (Cfg::kClusterM) both CTAs of a pair take adjacent M-tiles of one
// (expert, N-tile): each loads half of the Q tile and multicasts it into both, so every Q byte
// leaves L2 once per pair (Q is re-read for every M-tile: for an ungathered dW1, x rows 2n/128
// times); the stage's expected bytes stay the whole tile.
template <class Cfg, bool kGatherP = true>
struct ProducerVarlenK {
  static constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, kStages = Cfg::kStages;
  static constexpr int kCluster = Cfg::kClusterM;
  static constexpr uint32_t kFullArrivals = kGatherP ? 1 + kProducerThreads : 1;
  using Loader = GatherRowLoader<BM, BK, typename Cfg::SmemLayoutA>;
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
    int64_t* addr = nullptr;
    if constexpr (kGatherP) {
      lg.init(sA, tid);
      addr = s.gather.addr;
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
        if (k_tiles > 0) {  // the first chunk's addresses (k_tiles is the same in all 128 threads)
          lg.stage_rows(addr, p.P, p.gather_p, p.ld_p, w.row0, w.rows, 0);
          lg.set_cols(m0, p.M);
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
          lg.issue(addr, k, w.rows, ps.stage * Cfg::kBytesA);
          cp_async_arrive_noinc(&s.full[ps.stage]);
          // past a chunk: the next one's addresses (every thread has read this one's: the barrier)
          if (k + 1 < k_tiles && (k + 1) % Loader::kChunkTiles == 0)
            lg.stage_rows(addr, p.P, p.gather_p, p.ld_p, w.row0, w.rows, (k + 1) * BK);
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
