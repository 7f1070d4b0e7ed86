// The engine's two kernels, each a thin composition of a producer (mainloop load), the consumer
// MMA loop, an epilogue and a tile scheduler; host Arguments become device Params in make_params.
//   VarlenMKernel<Cfg, ALoad, Epi>: rows grouped by expert (up-proj, down-proj, dA', dX~)
//   VarlenKKernel<Cfg, Epi>:       reduction over an expert's rows (dW1, dW2)
// Both persistent (grid <= SM count), 384 threads: warpgroup 0 produces with few registers,
// warpgroups 1-2 consume with many (setmaxnreg), cooperatively or ping-pong (tile_config.cuh).
#pragma once

#include <atomic>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"

#include "common/check.h"
#include "engine/consumer_mma.cuh"
#include "engine/epilogue/common.cuh"
#include "engine/producer_varlen_k.cuh"
#include "engine/producer_varlen_m.cuh"
#include "engine/tile_config.cuh"
#include "engine/tile_scheduler.cuh"

namespace smoe {
namespace engine {

// The widest BN at which a cooperative tile loads its epilogue's per-row inputs before the
// mainloop (Epi::prefetch); wider tiles stream them row by row after it (Epi::apply_tile, as
// ping-pong does). An epilogue sets kCoopPrefetchMaxBN where its inputs would not fit beside the
// accumulator (dSwiGLU at 128 x 256 spilled 520-650 bytes with the prefetch).
template <class Epi, class = void>
struct CoopPrefetchMaxBN {
  static constexpr int value = 256;
};
template <class Epi>
struct CoopPrefetchMaxBN<Epi, std::void_t<decltype(Epi::kCoopPrefetchMaxBN)>> {
  static constexpr int value = Epi::kCoopPrefetchMaxBN;
};

template <class Traits>
__global__ void __launch_bounds__(kThreads, 1) engine_kernel(const __grid_constant__ typename Traits::Params p) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Traits::run(p, *reinterpret_cast<typename Traits::Storage*>(smem_raw));
}

// Common body: barrier set-up, role split, consumer loop over the scheduler's tiles.
template <class Cfg, class Producer, class Consumer, class Epi, class Tail, int kProducerRegs, int kConsumerRegs>
struct KernelBody {
  static constexpr int kEpiBytes = EpiSmem<Epi, Cfg::BN>::kBytes;  // a staged epilogue's slabs
  static_assert(kEpiBytes == 0 || Cfg::kPingPong || kIsTmaStore<Epi>,
                "staged epilogues: ping-pong, or the cooperative varlen-K TMA store");
  using Storage = SharedStorage<Cfg, Producer::kGatherRows, kEpiBytes>;
  // setmaxnreg moves registers inside the CTA's launch allocation (168 per thread x 384, the
  // __launch_bounds__(384, 1) cap): asking for more than that total blocks the increase forever.
  static_assert(kProducerRegs * kProducerThreads + kConsumerRegs * kConsumerThreads <= 168 * kThreads,
                "register split exceeds the CTA's allocation");

  __device__ static void init_barriers(Storage& s) {
    if (threadIdx.x == 0) {
      for (int i = 0; i < Cfg::kStages; ++i) {
        cutlass::arch::ClusterTransactionBarrier::init(&s.full[i], Producer::kFullArrivals);
        cutlass::arch::ClusterBarrier::init(&s.empty[i], Consumer::kEmptyArrivals);
      }
      cutlass::arch::fence_barrier_init();
    }
  }

  // tile_ctx(WorkTile, k_tiles&, tail_valid&) -> TileCtx
  template <class Params, class Sched, class CtxFn>
  __device__ static void roles(const Params& p, Storage& s, const Sched& sched, CtxFn tile_ctx) {
    // One if/else on a warp-uniform role (the shuffle tells ptxas it is uniform), one branch per
    // role: what lets ptxas give each side its setmaxnreg budget.
    const int warp_group = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
    if (warp_group == 0) {
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
      Producer::run(p, s, sched);
    } else {
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
      consume(p, s, sched, tile_ctx);
    }
  }

  template <class Params, class Sched, class CtxFn>
  __device__ static void consume(const Params& p, Storage& s, const Sched& sched, CtxFn tile_ctx) {
    if constexpr (Cfg::kPingPong)
      consume_pingpong(p, s, sched, tile_ctx);
    else
      consume_cooperative(p, s, sched, tile_ctx);
  }

  template <class Params, class Sched, class CtxFn>
  __device__ static void consume_cooperative(const Params& p, Storage& s, const Sched& sched, CtxFn tile_ctx) {
    const int ctid = threadIdx.x - kProducerThreads;
    typename Cfg::TiledMma tiled_mma;
    auto thr = tiled_mma.get_thread_slice(ctid);
    Tensor sA = make_tensor(make_smem_ptr(s.A.data()), typename Cfg::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(s.B.data()), typename Cfg::SmemLayoutB{});
    Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));
    Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
    Tensor accum = partition_fragment_C(tiled_mma, Shape<Int<Cfg::BM>, Int<Cfg::BN>>{});
    Tensor cd = thr.partition_C(make_identity_tensor(Shape<Int<Cfg::BM>, Int<Cfg::BN>>{}));
    PipeState ps;
    const int total = sched.total_tiles();
    for (int t = sched.first(); t < total; t += sched.stride()) {
      int k_tiles = 0, tail_valid = 0;
      const TileCtx ctx = tile_ctx(sched.get(t), k_tiles, tail_valid);
      if constexpr (kEpiBytes > 0) {
        Consumer::template run<Tail>(tiled_mma, tCrA, tCrB, accum, k_tiles, tail_valid, ps, s);
        Epi::apply_coop(p.epi, p.tma_d, p.d_rows, accum, cd, ctx, s.epi.bytes);
      } else if constexpr (Cfg::BN > CoopPrefetchMaxBN<Epi>::value) {
        Consumer::template run<Tail>(tiled_mma, tCrA, tCrB, accum, k_tiles, tail_valid, ps, s);
        Epi::apply_tile(p.epi, accum, cd, ctx);  // per-row inputs streamed (registers)
      } else {
        const auto pre = Epi::prefetch(p.epi, accum, cd, ctx);  // per-row epilogue inputs, early
        Consumer::template run<Tail>(tiled_mma, tCrA, tCrB, accum, k_tiles, tail_valid, ps, s);
        Epi::apply(p.epi, accum, cd, ctx, pre);
      }
    }
    if constexpr (kEpiBytes > 0) Epi::finish();
  }

  // Ping-pong: the CTA's tiles t = first + j * stride in order; warpgroup w takes the j
  // with j % 2 == w. The producer fills the stages in tile order, so before tile j a warpgroup
  // skips the stages of tile j - 1 (the other's; its K-tile count comes from the same scheduler).
  // Order barrier (named barriers kOrderBar + w, 256 threads: 128 arrive, 128 wait): warpgroup w
  // waits for its turn before its mainloop and hands the turn over after it, so the MMAs of the
  // two never interleave and each epilogue runs under the other's mainloop. Every wait has exactly
  // one matching arrival: a hand-over happens only when the other warpgroup has a next tile.
  static constexpr uint32_t kOrderBar = 2;  // 1: ZeroTail (varlen-K)

  template <class Params, class Sched, class CtxFn>
  __device__ static void consume_pingpong(const Params& p, Storage& s, const Sched& sched, CtxFn tile_ctx) {
    const int ctid = threadIdx.x - kProducerThreads;
    const int wg = __shfl_sync(0xffffffffu, ctid / 128, 0);
    typename Cfg::TiledMma tiled_mma;
    auto thr = tiled_mma.get_thread_slice(ctid % 128);
    Tensor sA = make_tensor(make_smem_ptr(s.A.data()), typename Cfg::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(s.B.data()), typename Cfg::SmemLayoutB{});
    Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));
    Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
    Tensor accum = partition_fragment_C(tiled_mma, Shape<Int<Cfg::BM>, Int<Cfg::BN>>{});  // (MMA, 2, 1)
    Tensor cd = thr.partition_C(make_identity_tensor(Shape<Int<Cfg::BM>, Int<Cfg::BN>>{}));
    PipeState ps;
    const int total = sched.total_tiles();
    const int stride = sched.stride();
    for (int t = sched.first() + wg * stride, j = wg; t < total; t += 2 * stride, j += 2) {
      if (j > 0) {
        int other_k = 0, other_tail = 0;
        tile_ctx(sched.get(t - stride), other_k, other_tail);
        ps.template skip<Cfg::kStages>(other_k);
      }
      int k_tiles = 0, tail_valid = 0;
      const TileCtx ctx = tile_ctx(sched.get(t), k_tiles, tail_valid);
      if (j > 0) cutlass::arch::NamedBarrier::sync(kConsumerThreads, kOrderBar + wg);
      Consumer::template run<Tail>(tiled_mma, tCrA, tCrB, accum, k_tiles, tail_valid, ps, s);
      if (t + stride < total) cutlass::arch::NamedBarrier::arrive(kConsumerThreads, kOrderBar + (wg ^ 1));
      // The whole 128-row tile (two 64-row halves; the epilogues address two rows per thread,
      // AccPos); per-row inputs streamed, not prefetched before the mainloop: their registers would
      // sit next to a 128 x BN accumulator.
      if constexpr (kEpiBytes > 0)
        Epi::apply_tile(p.epi, p.tma_d, p.d_rows, accum, cd, ctx, s.epi.bytes, wg);
      else
        Epi::apply_tile(p.epi, accum, cd, ctx);
    }
    if constexpr (kEpiBytes > 0) Epi::finish();
  }
};

// ---- varlen-M --------------------------------------------------------------------------------
template <class Cfg, bool kKMajor = Cfg::kMajorB == GMMA::Major::K>
struct HalfB {
  using Layout = typename Cfg::SmemLayoutB;
};
template <class Cfg>
struct HalfB<Cfg, true> {
  using Layout = typename SmemOperand<GMMA::Major::K, Cfg::BN / 2, Cfg::BK, Cfg::kStages>::Layout;
};

template <class Cfg, ALoad kALoad, class Epi>
struct VarlenMKernel {
  static constexpr bool kGather = kALoad == ALoad::kGather;
  using Producer = ProducerVarlenM<Cfg, kALoad>;
  using Consumer = ConsumerMma<Cfg, kGather>;
  using Body = KernelBody<Cfg, Producer, Consumer, Epi, NoTail, kGather ? 56 : 40, kGather ? 224 : 232>;
  using Storage = typename Body::Storage;

  using GmemK = Layout<Shape<int, int>, Stride<int64_t, _1>>;   // (rows, K), K contiguous
  using GmemMN = Layout<Shape<int, int>, Stride<_1, int64_t>>;  // (N, rows), N contiguous
  using GmemB = std::conditional_t<Cfg::kMajorB == GMMA::Major::K, GmemK, GmemMN>;
  static constexpr int kCluster = Cfg::kClusterM;
  template <class GL, class SL>
  static auto tma_for(const Bf16* ptr, GL gl, SL sl) {
    return make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(ptr), gl), sl(_, _, Int<0>{}));
  }
  template <class GL, class SL>
  static auto tma_for_a(const Bf16* ptr, GL gl, SL sl) {
    return tma_for(ptr, gl, sl);
  }
  // B: multicast over a cluster along M (each CTA issues 1/C of the tile).
  template <class GL, class SL>
  static auto tma_for_b(const Bf16* ptr, GL gl, SL sl) {
    if constexpr (kCluster == 1)
      return tma_for(ptr, gl, sl);
    else
      return make_tma_copy(SM90_TMA_LOAD_MULTICAST{}, make_tensor(make_gmem_ptr(ptr), gl), sl(_, _, Int<0>{}),
                           Int<kCluster>{});
  }
  using TmaA = decltype(tma_for_a(nullptr, GmemK{}, typename Cfg::SmemLayoutA{}));
  using TmaB = decltype(tma_for_b(nullptr, GmemB{}, typename Cfg::SmemLayoutB{}));
  // Gate/up as two K-major tensors (up-proj): half-height boxes, BN/2 rows from each, multicast
  // like B over a cluster along M (each CTA issues 1/C of each half). MN-major B never loads
  // halves (its two tensors split K instead): the full layout stands in.
  using SmemLayoutBHalf = typename HalfB<Cfg>::Layout;
  using TmaBHalf = decltype(tma_for_b(nullptr, GmemB{}, SmemLayoutBHalf{}));
  // A staged store epilogue's TMA store over D [rows][N] (EpiStoreStagedT; unused otherwise).
  static constexpr bool kStagedEpi = kIsStagedStore<Epi>;
  static_assert(!kStagedEpi || !kGather, "staged stores: D has the A tensor's rows (TMA A)");
  using SmemLayoutD = EpiStoreStagedT<1>::SmemLayout<Cfg::BN>;  // one 32-row slab, either kSlabs
  static auto tma_for_d(Bf16* ptr, GmemK gl) { return make_tma_copy(SM90_TMA_STORE{}, make_tensor(make_gmem_ptr(ptr), gl), SmemLayoutD{}); }
  using TmaD = decltype(tma_for_d(nullptr, GmemK{}));

  struct Params {
    int E, N, K;
    int a_rows;           // rows of the A tensor map (TMA A) or of the gather source
    int b_rows, b_cols;   // extents of the B tensor map(s): K-major (E*N, K), MN-major (N, E*K);
                          // two tensors: K-major ((E-1)*stride + N/2, K), MN-major (N, (E-1)*stride + K/2)
    int b_stride;         // along the expert-indexed extent, from one expert to the next
    int n_tiles;
    int n_band;           // N-tiles per band of the tile order (band_order, tile_order.h)
    bool b_halves;        // K-major gate/up in two tensors: tma_bh[0] (gate), tma_bh[1] (up)
    int k_split_tiles;    // MN-major: K-tiles from tma_b, the rest from tma_b2 (0: one tensor)
    const int32_t* expert_offset;
    const Bf16* a_gather;
    const int32_t* gather_idx;
    bool store_streaming;  // outputs by st.global.cs (epilogue/common.cuh, store_out_if)
    TmaA tma_a;
    TmaB tma_b;
    TmaB tma_b2;
    TmaBHalf tma_bh[2];
    TmaD tma_d;  // kStagedEpi only
    int d_rows;  // rows of D (kStagedEpi)
    typename Epi::Params epi;
  };

  // A: [a_rows][K] (gathered through gather_idx, or the grouped rows themselves);
  // B: K-major [E][N][K] or MN-major [E][K][N]; with B2 (gate/up as two tensors, engine.h):
  // K-major B, B2 [E][N/2][K] each, MN-major B, B2 [E][K/2][N] each, or those halves `stride` rows
  // apart per expert (stride 0: packed).
  static Params make_params(int E, int N, int K, const bf16* A, int a_rows, const int32_t* gather,
                            const bf16* B, const bf16* B2, int64_t stride, const int32_t* offset,
                            const typename Epi::Params& epi) {
    Params p;
    p.E = E;
    p.N = N;
    p.K = K;
    p.a_rows = a_rows;
    p.n_tiles = (N + Cfg::BN - 1) / Cfg::BN;
    p.n_band = varlen_m_n_band(N, K, Cfg::BN);
    p.expert_offset = offset;
    p.a_gather = reinterpret_cast<const Bf16*>(A);
    p.gather_idx = gather;
    p.store_streaming = store_streaming();
    p.tma_a = tma_for_a(reinterpret_cast<const Bf16*>(A),
                      make_layout(make_shape(a_rows, K), make_stride(int64_t{K}, _1{})),
                      typename Cfg::SmemLayoutA{});
    // Only the maps a call uses are encoded (make_params runs on every launch): tma_b always, plus
    // the two half-height maps (K-major) or the second K map (MN-major) with two tensors.
    const bool two = B2 != nullptr;
    const Bf16* b1 = reinterpret_cast<const Bf16*>(B);
    const Bf16* b2 = reinterpret_cast<const Bf16*>(B2);
    p.b_halves = false;
    p.k_split_tiles = 0;
    // Rows of one expert's (half of the) weights, then the extent that ends at the last expert's.
    const int per_expert = Cfg::kMajorB == GMMA::Major::K ? (two ? N / 2 : N) : (two ? K / 2 : K);
    p.b_stride = two && stride != 0 ? static_cast<int>(stride) : per_expert;
    const int extent = (E - 1) * p.b_stride + per_expert;
    if constexpr (Cfg::kMajorB == GMMA::Major::K) {
      p.b_rows = extent;
      p.b_cols = K;
      const auto gl = make_layout(make_shape(p.b_rows, p.b_cols), make_stride(int64_t{K}, _1{}));
      p.tma_b = tma_for_b(b1, gl, typename Cfg::SmemLayoutB{});
      if (two) {
        p.tma_bh[0] = tma_for_b(b1, gl, SmemLayoutBHalf{});
        p.tma_bh[1] = tma_for_b(b2, gl, SmemLayoutBHalf{});
        p.b_halves = true;
      }
    } else {
      p.b_rows = N;
      p.b_cols = extent;
      const auto gl = make_layout(make_shape(p.b_rows, p.b_cols), make_stride(_1{}, int64_t{N}));
      p.tma_b = tma_for_b(b1, gl, typename Cfg::SmemLayoutB{});
      if (two) {
        p.tma_b2 = tma_for_b(b2, gl, typename Cfg::SmemLayoutB{});
        p.k_split_tiles = K / 2 / Cfg::BK;
      }
    }
    p.epi = epi;
    p.d_rows = a_rows;
    if constexpr (kStagedEpi)  // D [a_rows][N]: the store GEMMs read A by TMA, so a_rows = rows
      p.tma_d = tma_for_d(reinterpret_cast<Bf16*>(epi.D), make_layout(make_shape(a_rows, N), make_stride(int64_t{N}, _1{})));
    return p;
  }

  __device__ static void run(const Params& p, Storage& s) {
    Body::init_barriers(s);
    if (threadIdx.x == 0) {
      cute::prefetch_tma_descriptor(p.tma_b.get_tma_descriptor());
      if (p.k_split_tiles > 0) cute::prefetch_tma_descriptor(p.tma_b2.get_tma_descriptor());
      if (p.b_halves) {
        cute::prefetch_tma_descriptor(p.tma_bh[0].get_tma_descriptor());
        cute::prefetch_tma_descriptor(p.tma_bh[1].get_tma_descriptor());
      }
      if constexpr (!kGather) cute::prefetch_tma_descriptor(p.tma_a.get_tma_descriptor());
      if constexpr (kStagedEpi) cute::prefetch_tma_descriptor(p.tma_d.get_tma_descriptor());
    }
    using Sched = VarlenMScheduler<Cfg::BM, kCluster>;
    Sched::build(p.expert_offset, p.E, s.tile_start);
    __syncthreads();
    int rank = 0;
    if constexpr (kCluster > 1) {
      // Both CTAs' barriers are initialised (fence_barrier_init) before either multicasts into
      // the other or arrives on its barriers.
      cute::cluster_arrive_relaxed();
      cute::cluster_wait();
      rank = static_cast<int>(cute::block_rank_in_cluster());
    }
    const Sched sched{p.expert_offset, s.tile_start, p.E, p.n_tiles, p.n_band, rank};
    const int k_tiles = p.K / Cfg::BK;
    Body::roles(p, s, sched, [&](const WorkTile& w, int& kt, int&) {
      kt = k_tiles;
      const int col0 = w.n_tile * Cfg::BN;
      return TileCtx{w.row0, w.rows, col0, p.N - col0, w.n_tile, false, p.store_streaming};
    });
  }
};

// ---- varlen-K --------------------------------------------------------------------------------
// P gathered (cp.async; kGatherP) or contiguous (TMA), Q contiguous (TMA); Epi = EpiStoreTma<false>
// (D [E][M][N]) or EpiStoreTma<true> (D [E][N][M]). The cp.async -> wgmma proxy fence only with a gather.
// Cfg::kClusterM == 2: a pair along M, Q multicast (producer_varlen_k.cuh).
template <class Cfg, class Epi_, bool kGatherP = true>
struct VarlenKKernel {
  static constexpr int kCluster = Cfg::kClusterM;
  static_assert(!Cfg::kPingPong, "varlen-K: cooperative only (ZeroTail meets all 256 consumers)");
  using Producer = ProducerVarlenK<Cfg, kGatherP>;
  using Consumer = ConsumerMma<Cfg, kGatherP>;
  using Epi = Epi_;
  using Body = KernelBody<Cfg, Producer, Consumer, Epi, ZeroTail<Cfg, !kGatherP>, 72, 216>;
  using Storage = typename Body::Storage;

  using GmemMN = Layout<Shape<int, int>, Stride<_1, int64_t>>;  // (columns, rows), columns contiguous
  static auto tma_for(const Bf16* ptr, GmemMN gl) {
    if constexpr (kCluster == 1)
      return make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(ptr), gl),
                           typename Cfg::SmemLayoutB{}(_, _, Int<0>{}));
    else
      return make_tma_copy(SM90_TMA_LOAD_MULTICAST{}, make_tensor(make_gmem_ptr(ptr), gl),
                           typename Cfg::SmemLayoutB{}(_, _, Int<0>{}), Int<kCluster>{});
  }
  using TmaQ = decltype(tma_for(nullptr, GmemMN{}));
  static auto tma_for_a(const Bf16* ptr, GmemMN gl) {
    return make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(ptr), gl),
                         typename Cfg::SmemLayoutA{}(_, _, Int<0>{}));
  }
  using TmaP = decltype(tma_for_a(nullptr, GmemMN{}));
  // The TMA-store epilogue's map over D viewed as [E * N][M] or [E * M][N] (EpiStoreTma; unused
  // otherwise).
  static constexpr bool kTmaStoreEpi = kIsTmaStore<Epi>;
  static_assert(kTmaStoreEpi, "varlen-K stores through EpiStoreTma (epilogue/store_tma.cuh)");
  using GmemK = Layout<Shape<int, int>, Stride<int64_t, _1>>;  // (rows, columns), columns contiguous
  static auto tma_for_d(Bf16* ptr, GmemK gl) {
    return make_tma_copy(SM90_TMA_STORE{}, make_tensor(make_gmem_ptr(ptr), gl), EpiStoreTma<true>::SmemLayout{});
  }
  using TmaD = decltype(tma_for_d(nullptr, GmemK{}));

  struct Params {
    int E, M, N;
    int m_tiles, n_tiles;
    const int32_t* expert_offset;
    const Bf16* P;  // gathered through gather_p
    int64_t ld_p;
    const int32_t* gather_p;
    bool store_streaming;  // outputs by st.global.cs (epilogue/common.cuh, store_out_if)
    int q_rows;     // rows of Q's tensor map (N columns, the grouped rows); P's too without a gather
    TmaQ tma_q;
    TmaP tma_p;     // !kGatherP: P by TMA (M columns, the grouped rows)
    TmaD tma_d;     // kTmaStoreEpi only
    int d_rows;     // rows of D's map (kTmaStoreEpi)
    typename Epi::Params epi;
  };

  static void make_tma(Params& p, const Bf16* Q, int64_t ld_q, int64_t rows) {
    p.q_rows = static_cast<int>(rows > 0 ? rows : 1);  // no tile loads when there are no rows
    p.tma_q = tma_for(Q, make_layout(make_shape(p.N, p.q_rows), make_stride(_1{}, ld_q)));
    if constexpr (!kGatherP)
      p.tma_p = tma_for_a(p.P, make_layout(make_shape(p.M, p.q_rows), make_stride(_1{}, p.ld_p)));
    p.d_rows = 0;
    if constexpr (kTmaStoreEpi) {  // p.epi is set (run_varlen_k)
      p.d_rows = static_cast<int>(Epi::d_rows(p.epi, p.E));
      const int cols = static_cast<int>(Epi::d_cols(p.epi));
      p.tma_d = tma_for_d(reinterpret_cast<Bf16*>(p.epi.D),
                          make_layout(make_shape(p.d_rows, cols), make_stride(int64_t{cols}, _1{})));
    }
  }

  __device__ static void run(const Params& p, Storage& s) {
    Body::init_barriers(s);
    if (threadIdx.x == 0) {
      cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
      if constexpr (!kGatherP) cute::prefetch_tma_descriptor(p.tma_p.get_tma_descriptor());
      if constexpr (kTmaStoreEpi) cute::prefetch_tma_descriptor(p.tma_d.get_tma_descriptor());
    }
    __syncthreads();
    int rank = 0;
    if constexpr (kCluster > 1) {  // both CTAs' barriers exist before either multicasts or arrives
      cute::cluster_arrive_relaxed();
      cute::cluster_wait();
      rank = static_cast<int>(cute::block_rank_in_cluster());
    }
    const VarlenKScheduler<kCluster> sched{p.expert_offset, p.E, p.m_tiles, p.n_tiles, rank};
    Body::roles(p, s, sched, [&](const WorkTile& w, int& kt, int& tail) {
      kt = (w.rows + Cfg::BK - 1) / Cfg::BK;
      tail = w.rows % Cfg::BK;
      const int m0 = w.m_tile * Cfg::BM, col0 = w.n_tile * Cfg::BN;
      // Past M (a pair's rank-1 tile with an odd M-tile count): no rows to store.
      const int rows = p.M - m0 < 0 ? 0 : p.M - m0 < Cfg::BM ? p.M - m0 : Cfg::BM;
      return TileCtx{static_cast<int64_t>(w.expert) * p.M + m0, rows, col0, p.N - col0, w.n_tile,
                     kt == 0, p.store_streaming};
    });
  }
};

// ---- launch ------------------------------------------------------------------------------------
constexpr int kMaxDevices = 64;

template <class Traits>
constexpr int smem_bytes() {
  constexpr int smem = static_cast<int>(sizeof(typename Traits::Storage));
  static_assert(smem <= kSmemLimit, "shared storage exceeds the sm_90 limit");
  return smem;
}

template <class Traits>
Status set_smem_attribute(const char* name) {
  // Set on every call, not once per process: the attribute belongs to the kernel in the CURRENT
  // device's context, and a caller may run on several GPUs. A host-side call of about a microsecond.
  return ::smoe::detail::cuda_status(
      cudaFuncSetAttribute(engine_kernel<Traits>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<Traits>()),
      name);
}

inline cudaLaunchConfig_t launch_config(int grid, int smem, cudaStream_t stream, cudaLaunchAttribute* attr,
                                        int cluster) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid), 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = static_cast<unsigned>(cluster);
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// Clusters of C that fit on the device at once (one CTA per SM; GPCs of uneven size can hold fewer
// than SMs / C): the persistent grid of a clustered kernel. Cached per device for each kernel.
template <class Traits>
Status max_active_clusters(int cluster, int sm_count, int* out, const char* name) {
  static std::atomic<int> cache[kMaxDevices];  // zero-initialised (static storage)
  int dev = 0;
  SMOE_RETURN_IF_ERROR(::smoe::detail::cuda_status(cudaGetDevice(&dev), name));
  if (dev >= 0 && dev < kMaxDevices && cache[dev].load(std::memory_order_relaxed) > 0) {
    *out = cache[dev].load(std::memory_order_relaxed);
    return Status{};
  }
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t cfg = launch_config(sm_count / cluster * cluster, smem_bytes<Traits>(), nullptr, &attr, cluster);
  int n = 0;
  SMOE_RETURN_IF_ERROR(
      ::smoe::detail::cuda_status(cudaOccupancyMaxActiveClusters(&n, engine_kernel<Traits>, &cfg), name));
  if (n <= 0)
    return ::smoe::detail::make_status(StatusCode::kNotImplemented,
                                       ::smoe::detail::concat(name, ": no cluster of ", cluster, " fits on this device"));
  if (dev >= 0 && dev < kMaxDevices) cache[dev].store(n, std::memory_order_relaxed);
  *out = n;
  return Status{};
}

// The host work of a launch before the launch itself (dispatch.h, LaunchStep::kSetup): the shared-memory
// attribute, and for clusters the co-resident cluster slots within the caller's SM budget (into
// *cluster_slots when given). launch runs it again: it is idempotent, a microsecond, and cached per
// device for the cluster query, so a prepared call and a plain one launch the same grid.
template <class Traits>
Status launch_setup(int sm_count, const char* name, int* cluster_slots) {
  constexpr int C = Traits::kCluster;
  SMOE_RETURN_IF_ERROR(set_smem_attribute<Traits>(name));
  if constexpr (C > 1) {
    int slots = 0;
    SMOE_RETURN_IF_ERROR(max_active_clusters<Traits>(C, sm_count, &slots, name));
    if (slots > sm_count / C) slots = sm_count / C;  // the caller's SM budget
    if (slots < 1) slots = 1;
    if (cluster_slots != nullptr) *cluster_slots = slots;
  }
  return Status{};
}

// units: work units (tiles, or cluster-wide units of C tiles); the grid is persistent: at most one
// CTA (cluster) per SM (per co-resident cluster slot).
template <class Traits>
Status launch(const typename Traits::Params& p, int64_t units, int sm_count, cudaStream_t stream, const char* name) {
  constexpr int C = Traits::kCluster;
  int slots = 1;
  SMOE_RETURN_IF_ERROR(launch_setup<Traits>(sm_count, name, &slots));
  if (units <= 0) return Status{};
  if constexpr (C == 1) {
    const int grid = static_cast<int>(units < sm_count ? units : sm_count);
    engine_kernel<Traits><<<grid, kThreads, smem_bytes<Traits>(), stream>>>(p);
  } else {
    const int clusters = static_cast<int>(units < slots ? units : slots);
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = launch_config(clusters * C, smem_bytes<Traits>(), stream, &attr, C);
    SMOE_RETURN_IF_ERROR(::smoe::detail::cuda_status(cudaLaunchKernelEx(&cfg, engine_kernel<Traits>, p), name));
  }
  return ::smoe::detail::cuda_status(cudaGetLastError(), name);
}

}  // namespace engine
}  // namespace smoe
