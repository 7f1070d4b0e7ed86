// Epilogues of the engine: small variants on one store path. In the sm_90 wgmma accumulator
// layout each consumer thread holds, for two rows (m0 and m0 + 8) and every column pair
// (n0 + 8 j, + 1) of the tile, one fp32 pair: accum(4 j + 2 h + q) is row m0 + 8 h, column
// n0 + 8 j + q (value bit 0 = column + 1, bit 1 = row + 8, the rest = column + 8 j). Each thread
// keeps two row pointers and addresses every store with a compile-time column offset from them
// (64 64-bit addresses would not fit next to 128 accumulators). Stores are predicated to the
// tile's valid rows and columns, so a tile never writes past its expert's last row. 2- and 4-byte
// outputs per lane are first transposed inside the quad so that each lane stores 16 bytes
// (store_row_16B: full 32-byte sectors); dH (8 bytes per lane, 32 per quad) is stored directly.
//
//   EpiStore   D[r][c] = bf16(acc)
//   EpiSwiGLU  (up-proj, W1 gate/up interleaved, so a column pair is one (g, u) unit j = c / 2):
//              H[r][c..c+1] = bf16(g, u)  (kept for backward)
//              A[r][j] = bf16(silu(g~) u~) from the rounded (g~, u~) = H, exactly what backward
//              recomputes
//   EpiDSwiGLU (dA' = gathered dO W2_e, columns j = units of n):
//              with (g, u) = H[r][2j..2j+1], a = silu(g) u, s = scores[scatter[r]], dA = s dA':
//              dH[r][2j..2j+1] = (dA u sig (1 + g (1 - sig)), dA silu(g)),  A'[r][j] = s a,
//              ds_partial[r][n_tile] = sum over the tile's columns of dA'[r][j] a[r][j]
//              (thread-sequential over its columns, then a fixed 4-lane butterfly: no atomics,
//              bitwise deterministic; the row sum over n-tiles happens in a later kernel).
#pragma once

#include <cuda_bf16.h>

#include "engine/sm90_primitives.cuh"
#include "engine/tile_config.cuh"

namespace smoe {
namespace engine {

// Where a tile's accumulator lands: global row of tile row 0 and the valid extents.
struct TileCtx {
  int64_t row0;
  int rows;
  int col0;
  int cols;
  int n_tile;
  bool zero;  // no K-tiles: store zeros, not the accumulator
  bool stream_out;  // outputs by st.global.cs (store_out)
};

// One output store. stream_out: st.global.cs, L2 evict-first. The GEMM outputs (H, A, Y, dH, A',
// dX~: 0.3-4 GB each) are read by a later kernel, never by this one, and under the default policy
// they push out of L2 the weight tiles and gathered rows this kernel re-reads (ncu at 5639575:
// up-proj DRAM 56%, about 3x its compulsory traffic).
template <class V>
__device__ __forceinline__ void store_out(V* p, const V& v, bool stream_out) {
  if (stream_out) __stcs(p, v);
  else *p = v;
}

// sigmoid(g) = 1 / (1 + 2^(-g log2 e)) in four instructions (FMUL, MUFU.EX2, FADD, MUFU.RCP), both
// approximations flushing denormals (<= 2 ulp of fp32 each, far below the bf16 rounding of every
// output they feed). An IEEE division adds a slow-path test and call per element (FSETP, BSSY,
// CALL, BSYNC) whose branches keep ptxas from interleaving a row's elements, and __expf without
// ftz a range test and two predicated multiplies: in the dSwiGLU epilogue that was a quarter of its
// instructions (ncu at bab8f11, OLMoE dA': the epilogue held ~40% of the kernel's warp samples, more
// than the other warpgroup's mainloop it should hide under). Limits: g > 87 flushes e to 0 (sig =
// 1); g -> -inf gives 1 + e = inf and rcp 0. Forward (silu_f) and backward (sigmoid_f, silu = g sig)
// share it, so the backward's recomputed a = silu(g~) u~ is the forward's A before rounding.
__device__ __forceinline__ float sigmoid_f(float g) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.f + e));
  return r;
}
__device__ __forceinline__ float silu_f(float g) { return g * sigmoid_f(g); }

// This thread's place in the accumulator tile (see the header comment).
struct AccPos {
  int m0;  // first of its two rows
  int n0;  // its column inside every 8-column group (even)
  template <class Coords>
  __device__ explicit AccPos(const Coords& cd) : m0(get<0>(cd(0))), n0(get<1>(cd(0))) {}
  __device__ bool row_ok(const TileCtx& t, int h) const { return m0 + 8 * h < t.rows; }
  __device__ static bool col_ok(const TileCtx& t, int j) { return 8 * j < t.cols; }  // cols % 8 == 0
};

template <class Accum>
constexpr int acc_col_groups() {
  return decltype(size(std::declval<const Accum&>()))::value / 4;
}

// ---- 16-byte stores from the accumulator layout -------------------------------------------------
// A quad (4 lanes) holds one row; lane q has columns 8 j + 2 q, + 1 of every group j: a direct
// store writes 4 bytes per lane, 16 contiguous bytes per quad, so every 32-byte sector a warp
// touches is half written (ncu: store sectors = 2x the bytes, and the store GEMMs are L2-bound).
// A 4 x 4 transpose of 32-bit words inside the quad (two xor-butterfly stages, 4 shuffles per 4
// words) gives lane q all 8 columns of group 4 b + q: one 16-byte store, full sectors.

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// w[k] of lane q = M[q][k] on entry, M[k][q] on exit (M: the quad's 4 x 4 words). Every lane of
// the warp must call it (full-mask shuffles): callers predicate the stores, not the call.
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4]) {
  const int q = static_cast<int>(threadIdx.x) & 3;
  // Bit 0 of (row, column): lanes q, q ^ 1 swap the words whose column bit 0 differs from q's.
  const bool b0 = q & 1;
  CUTE_UNROLL
  for (int k = 0; k < 4; k += 2) {
    const uint32_t recv = __shfl_xor_sync(0xffffffffu, b0 ? w[k] : w[k + 1], 1);
    if (b0) w[k] = recv; else w[k + 1] = recv;
  }
  // Bit 1, the same with lanes q, q ^ 2.
  const bool b1 = q & 2;
  CUTE_UNROLL
  for (int k = 0; k < 2; ++k) {
    const uint32_t recv = __shfl_xor_sync(0xffffffffu, b1 ? w[k] : w[k + 2], 2);
    if (b1) w[k] = recv; else w[k + 2] = recv;
  }
}

// Row h of this thread (columns packed as bf16 pairs by word(j) for every group j): after the
// quad transposes, one 16-byte store per 4 groups per lane; row/column predicates on the store.
// kColScale: the stored columns count 1/kColScale of the tile's (t.cols): 2 for the SwiGLU halves.
template <int kGroups, int kColScale = 1, class WordFn>
__device__ __forceinline__ void store_row_16B(bf16* row, bool row_ok, const TileCtx& t, WordFn word) {
  static_assert(kGroups % 4 == 0, "16-byte stores: the tile's column groups come in fours");
  const int q = static_cast<int>(threadIdx.x) & 3;
  CUTE_UNROLL
  for (int b = 0; b < kGroups / 4; ++b) {
    uint32_t w[4];
    CUTE_UNROLL
    for (int k = 0; k < 4; ++k) w[k] = word(4 * b + k);
    quad_transpose(w);
    const int j = 4 * b + q;
    if (row_ok && 8 * kColScale * j < t.cols)
      store_out(reinterpret_cast<uint4*>(row + 8 * j), make_uint4(w[0], w[1], w[2], w[3]), t.stream_out);
  }
}

// The kernel calls an epilogue in one of two ways: cooperative, pre = prefetch(...) before the
// mainloop and apply(..., pre) after it; ping-pong, apply_tile(...) on the warpgroup's whole
// 128-row accumulator (two 64-row halves, inputs loaded as they are used). Epilogues without
// per-row inputs derive from this (CRTP), which adapts their apply(p, acc, cd, t) to both.
struct NoPrefetch {};
template <class Derived>
struct WithoutPrefetch {
  template <class Params, class Accum, class Coords>
  __device__ static NoPrefetch prefetch(const Params&, const Accum&, const Coords&, const TileCtx&) {
    return {};
  }
  template <class Params, class Accum, class Coords>
  __device__ static void apply(const Params& p, const Accum& acc, const Coords& cd, const TileCtx& t,
                               NoPrefetch) {
    Derived::apply(p, acc, cd, t);
  }
  template <class Params, class Accum, class Coords>
  __device__ static void apply_tile(const Params& p, const Accum& acc, const Coords& cd, const TileCtx& t) {
    CUTE_UNROLL
    for (int mi = 0; mi < size<1>(acc); ++mi) Derived::apply(p, acc(_, mi, _), cd(_, mi, _), t);
  }
};

struct EpiStore : WithoutPrefetch<EpiStore> {
  using WithoutPrefetch<EpiStore>::apply;
  struct Params {
    bf16* D;
    int64_t ld;
  };
  template <class Accum, class Coords>
  __device__ static void apply(const Params& p, const Accum& acc, const Coords& cd, const TileCtx& t) {
    const AccPos pos(cd);
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      bf16* row = p.D + (t.row0 + pos.m0 + 8 * h) * p.ld + t.col0;
      store_row_16B<acc_col_groups<Accum>()>(row, pos.row_ok(t, h), t, [&](int j) {
        return t.zero ? 0u : pack_bf16x2(acc(4 * j + 2 * h), acc(4 * j + 2 * h + 1));
      });
    }
  }
};

// Staged store (ping-pong varlen-M: down-proj, dX~): D[r][c] = bf16(acc) as EpiStore, but the
// warpgroup writes its tile to shared memory in 32-row slabs and one thread hands each to
// the TMA unit (tma_d: a tensor store of 32-row x 64-column boxes, 128-byte swizzle), while the
// warpgroup goes on. Why: the store GEMMs lost 15-27% to their st.global (SMOE_DIAG at 6682527:
// 30B n256 down-proj 2.79 ms, 2.05 with the stores predicated off, 2.26 with every tile storing to
// one L2-resident block): the warps stalled on stores the memory system took slowly, so one
// warpgroup's epilogue outlasted the other's mainloop. (One bulk copy per row, 128 TMA operations
// per tile, was slower still: 3.88 ms; the tensor store issues BN / 64 per slab.)
// Each thread writes its accumulator pairs as 4-byte words: the 8 rows of a warp's store fall in 8
// different 16-byte chunks of the 128-byte bank row (the swizzle XORs the chunk index with
// row % 8), so no bank conflicts and no shuffles. The tensor map spans the whole output: a box is
// exact at N but not at an expert's last row, so a 64-row half with fewer valid rows (an expert's
// last tile) is stored from registers as EpiStore does, predicated per row.
// kSlabs 32-row slabs per warpgroup buffer (slab k holds the rows of warps 2 k, 2 k + 1):
//   1: half the warps write at a time, four round trips per tile (labels _pps);
//   2: the buffer holds a whole 64-row half, all four warps write at once, two round trips per
//      tile, but at BN = 192 the extra 12 KB per warpgroup costs a pipeline stage (5 -> 4)
//      (labels _pps2). Measured on the H200 (bench/results/h200/staged_stores_f57e909/): at
//      K = 256 (down-proj, n = 256) the round trips are what the epilogue waits for: 30B n256
//      2.56-2.61 -> 2.16-2.20 ms, narrow E384 0.97-1.01 -> 0.873-0.878, 7B n256 0.32-0.37 ->
//      0.285-0.30; at K = 512 (dX~ at n = 256, down-proj at n = 512) the lost stage weighs
//      more: 1.4B dX~ 0.374-0.389 -> 0.390-0.395, narrow E384 dX~ 1.36-1.43 -> 1.43-1.45.
// A round: named barrier kBar + warpgroup (128 threads) before the writes (the issuing thread saw
// the previous round's stores read the buffer) and after them (written and fenced to the async
// proxy), then one tensor store per slab.
template <int kSlabs>
struct EpiStoreStagedT {
  using Params = EpiStore::Params;
  static constexpr uint32_t kBar = 5;  // 5, 6 (0: __syncthreads, 1: ZeroTail, 2-3: order, 4: gather)
  static constexpr int kRows = 32;     // rows per slab (one TMA box)
  static_assert(kSlabs == 1 || kSlabs == 2, "a warpgroup buffer of 32 or 64 rows");
  template <int BN>
  using SmemLayout = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Bf16>{}, Shape<Int<kRows>, Int<BN>>{}));
  template <int BN>
  static constexpr int smem_bytes() { return 2 * kSlabs * kRows * BN * 2; }  // both consumer warpgroups

  template <class TmaD, class Accum, class Coords>
  __device__ static void apply_tile(const Params& p, const TmaD& tma_d, int d_rows, const Accum& acc,
                                    const Coords& cd, const TileCtx& t, unsigned char* smem, int wg) {
    constexpr int G = decltype(size(acc(_, 0, _)))::value / 4;  // 8-column groups: BN / 8
    constexpr int BN = 8 * G;
    constexpr int kSlabBytes = kRows * BN * 2;
    const int tid = static_cast<int>(threadIdx.x) & 127, warp = tid >> 5;
    unsigned char* buf = smem + wg * kSlabs * kSlabBytes;
    Tensor mD = tma_d.get_tma_tensor(make_shape(d_rows, static_cast<int>(p.ld)));
    CUTE_UNROLL
    for (int mi = 0; mi < 2; ++mi) {
      const auto a = acc(_, mi, _);
      const auto c = cd(_, mi, _);
      if (64 * mi + 64 > t.rows) {  // an expert's last tile: from registers, predicated per row
        EpiStore::apply(p, a, c, t);
        continue;
      }
      const AccPos pos(c);
      // SmemLayout<BN> in bytes: column block col / 64 of 32 x 128 B, row r at 128 r, 16-byte chunk
      // (col % 64) / 8 XOR r % 8, 2 (col % 8) inside. This thread: rows (m0 % 32) + 8 h of slab
      // warp / 2, so r % 8 = lane / 4 for both; columns n0 + 8 j, so the chunk is j % 8 and the
      // offset 2 n0.
      const uint32_t lane_row = (static_cast<uint32_t>(threadIdx.x) & 31) >> 2;
      const int slab = warp >> 1;  // this warp's slab of the half
      const uint32_t base = smem_u32(buf) + (slab % kSlabs) * kSlabBytes + (pos.m0 & 31) * 128 + 2 * pos.n0;
      CUTE_UNROLL
      for (int r = 0; r < 2 / kSlabs; ++r) {
        if (tid == 0) bulk_wait_read_all();
        cutlass::arch::NamedBarrier::sync(128, kBar + wg);
        if (slab / kSlabs == r) {
          CUTE_UNROLL
          for (int h = 0; h < 2; ++h) {
            CUTE_UNROLL
            for (int j = 0; j < G; ++j) {
              const uint32_t off = (j / 8) * (kRows * 128) + h * 8 * 128 + (((j % 8) ^ lane_row) << 4);
              st_shared_u32(base + off, pack_bf16x2(a(4 * j + 2 * h), a(4 * j + 2 * h + 1)));
            }
          }
          fence_generic_to_async_smem();  // the TMA store reads the slab through the async proxy
        }
        cutlass::arch::NamedBarrier::sync(128, kBar + wg);
        if (tid == 0) {
          CUTE_UNROLL
          for (int k = 0; k < kSlabs; ++k) {
            const int row = static_cast<int>(t.row0) + 64 * mi + kRows * (r * kSlabs + k);
            Tensor sD = make_tensor(make_smem_ptr(reinterpret_cast<Bf16*>(buf + k * kSlabBytes)), SmemLayout<BN>{});
            Tensor gD = local_tile(domain_offset(make_coord(row, t.col0), mD), Shape<Int<kRows>, Int<BN>>{},
                                   make_coord(0, 0));
            auto [tDgD, tDsD] =
                tma_partition(tma_d, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sD), group_modes<0, 2>(gD));
            copy(tma_d, tDsD, tDgD);
          }
          bulk_commit();
        }
      }
    }
  }

  // After the warpgroup's last tile: its stores have completed before the CTA (and its shared
  // memory) goes away.
  __device__ static void finish() {
    if ((threadIdx.x & 127) == 0) bulk_wait_all();
  }
};

// Shared memory an epilogue stages its tile in (0: it stores from registers).
template <class Epi, int BN>
struct EpiSmem {
  static constexpr int kBytes = 0;
};
template <int kSlabs, int BN>
struct EpiSmem<EpiStoreStagedT<kSlabs>, BN> {
  static constexpr int kBytes = EpiStoreStagedT<kSlabs>::template smem_bytes<BN>();
};
template <bool kTrans>
struct EpiStoreTma;
template <bool kTrans, int BN>
struct EpiSmem<EpiStoreTma<kTrans>, BN> {
  static constexpr int kBytes = 2 * 64 * 64 * 2;  // EpiStoreTma::kSmemBytes (defined below)
};
template <class Epi>
constexpr bool kIsTmaStore = false;
template <bool kTrans>
constexpr bool kIsTmaStore<EpiStoreTma<kTrans>> = true;
template <class Epi>
constexpr bool kIsStagedStore = false;
template <int kSlabs>
constexpr bool kIsStagedStore<EpiStoreStagedT<kSlabs>> = true;

// Transposed store (varlen-K only): the kernel's D'(m, n) of expert e goes to D[e][n][m], with D
// [E][N][M]; tile row0 = e * M + m0 (as for EpiStore). Used when the gathered operand is the
// output's column dimension (dW1 = dH^T x[gather]): computing its transpose keeps the gathered
// operand the narrow (128-row) one.
//
// Stored m runs are contiguous in D, but in the accumulator a column's 16 rows of a warp sit in 8
// lanes (m = m_w + lane / 4 + 8 h): 2-byte stores, 16 bytes per column and half-row, half of each
// 32-byte sector (the dW1 output is E * 2n * d elements, 15 GB at DeepSeek-V3.2's size). So the
// 8 lanes that share lane % 4 = c transpose an 8 x 8 block of bf16 first: lane a = lane / 4 holds
// e[k] = acc(8 J + k), k = 4 jj + 2 h + q, i.e. (m = m_w + a + 8 h, n = 8 (2 J + jj) + 2 c + q);
// three butterfly stages (lanes xor 4, 8, 16) swap bit s of k with bit s of a, after which lane a
// holds chunk k = a: column n = 8 (2 J + (a >> 2)) + 2 c + (a & 1), rows m_w + 8 ((a >> 1) & 1)
// + 0..7 in order. One 16-byte store per lane per 16 columns, full sectors (the two halves of a
// sector, h = 0 / 1, from lanes a and a ^ 2 of the same instruction).
// 6 shuffles per 8 values; every lane shuffles (full masks), only the stores are predicated.
__device__ __forceinline__ void octet_transpose_bf16(uint32_t (&w)[4]) {
  const int a = static_cast<int>(threadIdx.x & 31) >> 2;
  // Stage 0 (lane ^ 4): swap the 16-bit halves' bit (k bit 0) with a bit 0. Two words per shuffle.
  const bool a0 = a & 1;
  CUTE_UNROLL
  for (int i = 0; i < 4; i += 2) {
    // a0 = 0 keeps the low halves and sends the high ones; a0 = 1 the reverse.
    const uint32_t send = a0 ? __byte_perm(w[i], w[i + 1], 0x5410) : __byte_perm(w[i], w[i + 1], 0x7632);
    const uint32_t recv = __shfl_xor_sync(0xffffffffu, send, 4);
    if (a0) {
      w[i] = __byte_perm(recv, w[i], 0x7610);          // (partner's hi of w[i], my hi of w[i])
      w[i + 1] = __byte_perm(recv, w[i + 1], 0x7632);  // (partner's hi of w[i + 1], my hi)
    } else {
      w[i] = __byte_perm(w[i], recv, 0x5410);          // (my lo of w[i], partner's lo of w[i])
      w[i + 1] = __byte_perm(w[i + 1], recv, 0x7610);  // (my lo of w[i + 1], partner's lo of w[i + 1])
    }
  }
  // Stage 1 (lane ^ 8): word bit 0 (k bit 1) with a bit 1.
  const bool a1 = a & 2;
  CUTE_UNROLL
  for (int i = 0; i < 4; i += 2) {
    const uint32_t recv = __shfl_xor_sync(0xffffffffu, a1 ? w[i] : w[i + 1], 8);
    if (a1) w[i] = recv; else w[i + 1] = recv;
  }
  // Stage 2 (lane ^ 16): word bit 1 (k bit 2) with a bit 2.
  const bool a2 = a & 4;
  CUTE_UNROLL
  for (int i = 0; i < 2; ++i) {
    const uint32_t recv = __shfl_xor_sync(0xffffffffu, a2 ? w[i] : w[i + 2], 16);
    if (a2) w[i] = recv; else w[i + 2] = recv;
  }
}

struct EpiStoreT : WithoutPrefetch<EpiStoreT> {
  using WithoutPrefetch<EpiStoreT>::apply;
  struct Params {
    bf16* D;
    int64_t M;  // the kernel's M: the stored matrix's row length
    int64_t N;
  };
  template <class Accum, class Coords>
  __device__ static void apply(const Params& p, const Accum& acc, const Coords& cd, const TileCtx& t) {
    constexpr int G = acc_col_groups<Accum>();
    static_assert(G % 2 == 0, "transposed store: 16 columns (two groups) per octet transpose");
    const AccPos pos(cd);
    const int a = static_cast<int>(threadIdx.x & 31) >> 2;
    const int q = a & 1, h = (a >> 1) & 1, jj = a >> 2;  // this lane's chunk after the transpose
    const int m_w = pos.m0 - a;                          // the warp's first row in the tile
    const bool row_ok = m_w + 8 * h < t.rows;            // t.rows % 8 == 0 (M % 64 == 0)
    const int64_t e = t.row0 / p.M, m0 = t.row0 - e * p.M;
    // Column of J = 0: 8 jj + pos.n0 + q (pos.n0 = 2 (lane % 4)); + 16 J per step.
    bf16* out = p.D + e * p.M * p.N + static_cast<int64_t>(t.col0 + 8 * jj + pos.n0 + q) * p.M + m0 + m_w + 8 * h;
    CUTE_UNROLL
    for (int J = 0; J < G / 2; ++J) {
      uint32_t w[4];
      CUTE_UNROLL
      for (int i = 0; i < 4; ++i)
        w[i] = t.zero ? 0u : pack_bf16x2(acc(8 * J + 2 * i), acc(8 * J + 2 * i + 1));
      octet_transpose_bf16(w);
      if (row_ok && AccPos::col_ok(t, 2 * J + jj))
        store_out(reinterpret_cast<uint4*>(out + static_cast<int64_t>(16 * J) * p.M), make_uint4(w[0], w[1], w[2], w[3]),
                  t.stream_out);
    }
  }
};

// Store through shared memory (cooperative varlen-K: dW1 transposed, dW2 and engine_tma's dW
// plain): each consumer warpgroup writes its 64 rows (m) x 64 columns (n) of the tile at a time
// with stmatrix into a 128-byte-swizzled buffer of 8 KB, and one of its threads hands the buffer
// to the TMA unit (a tensor store of one 64 x 64 box), BN / 64 rounds per tile, while the
// warpgroup goes on.
//   kTrans (as EpiStoreT): D[e][n][m], viewed as [E * N][M]; stmatrix.trans, buffer rows n.
//   plain (as EpiStore):   D[e][m][n], viewed as [E * M][N]; stmatrix, buffer rows m.
// Why: under ncu at daa3d48 (Qwen3-Next, fused dW, 10 K-tiles per tile,
// bench/results/h200/varlen_k_issue/) the register transpose of EpiStoreT (shuffles, byte
// permutes, selects: short-scoreboard stalls) held ~30% of all warp samples in dW1, ~45% of the
// consumers'; EpiStore's quad transposes 18% in dW2. M and N are multiples of 64 (engine.cu,
// check_extent) and tiles start at multiples of 64, so every box lies inside its expert's block
// (a warpgroup whose 64 rows lie past M stores nothing; pieces at or past N are skipped).
// A round: the issuing thread waits until the previous round's store has read the buffer, named
// barrier kBar + warpgroup (128 threads), stmatrix (4 per thread), fence to the async proxy,
// barrier, tensor store. Buffer row x holds 64 elements (128 bytes), 16-byte chunk c at c XOR x % 8
// (the K-major 128-byte swizzle atom, SmemLayout).
template <bool kTrans>
struct EpiStoreTma : WithoutPrefetch<EpiStoreTma<kTrans>> {
  using Params = EpiStoreT::Params;    // D, M, N
  static constexpr uint32_t kBar = 5;  // 5, 6 (0: __syncthreads, 1: ZeroTail, 4: gather)
  static constexpr int kPiece = 64;    // n columns per round (x a warpgroup's 64 rows)
  static constexpr int kPieceBytes = kPiece * 64 * 2;
  static constexpr int kSmemBytes = 2 * kPieceBytes;  // one buffer per consumer warpgroup
  static_assert(EpiSmem<EpiStoreTma<kTrans>, 256>::kBytes == kSmemBytes, "EpiSmem's size is declared above");
  using SmemLayout = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Bf16>{}, Shape<_64, _64>{}));
  // D's rows and columns as the tensor map sees them.
  __host__ __device__ static int64_t d_rows(const Params& p, int E) { return int64_t{E} * (kTrans ? p.N : p.M); }
  __host__ __device__ static int64_t d_cols(const Params& p) { return kTrans ? p.M : p.N; }

  template <class TmaD, class Accum, class Coords>
  __device__ static void apply_coop(const Params& p, const TmaD& tma_d, int rows_d, const Accum& acc,
                                    const Coords& cd, const TileCtx& t, unsigned char* smem) {
    constexpr int G = acc_col_groups<Accum>();  // 8-column groups: BN / 8
    constexpr int BN = 8 * G;
    static_assert(BN % kPiece == 0, "whole 64-column pieces");
    const AccPos pos(cd);
    const int lane = static_cast<int>(threadIdx.x) & 31;
    const int m_w = pos.m0 - (lane >> 2);  // this warp's first row in the tile
    const int wg = m_w >> 6;               // consumer warpgroup: rows 64 wg ..
    if (64 * wg >= t.rows) return;         // past M (uniform per warpgroup): nothing to store
    const bool leader = ((static_cast<int>(threadIdx.x) - kProducerThreads) & 127) == 0;
    unsigned char* buf = smem + wg * kPieceBytes;
    // stmatrix.x4 of round u: matrices i = lane / 8 are (group 2 u + i / 2 of the piece, half
    // h = i % 2: rows m_w + 8 h ..); lane r = lane % 8 addresses row r of matrix i, or of its
    // transpose. Transposed: buffer row n = 8 (2 u + i / 2) + r, chunk 2 (warp % 4) + h (a step
    // of 2 KB per u). Plain: buffer row m = 16 (warp % 4) + 8 h + r, chunk 2 u + i / 2.
    const int i = lane >> 3, r = lane & 7;
    const uint32_t wq = static_cast<uint32_t>((m_w >> 4) & 3);
    const uint32_t base = smem_u32(buf);
    auto addr = [&](int u) -> uint32_t {
      if constexpr (kTrans) {
        const uint32_t chunk = 2 * wq + static_cast<uint32_t>(i & 1);
        return base + static_cast<uint32_t>(16 * u + 8 * (i >> 1) + r) * 128u + ((chunk ^ r) << 4);
      } else {
        const uint32_t chunk = static_cast<uint32_t>(2 * u + (i >> 1));
        return base + (16 * wq + 8 * static_cast<uint32_t>(i & 1) + r) * 128u + ((chunk ^ r) << 4);
      }
    };
    const int64_t e = t.row0 / p.M, m0 = t.row0 - e * p.M;
    Tensor mD = tma_d.get_tma_tensor(make_shape(rows_d, static_cast<int>(d_cols(p))));
    CUTE_UNROLL
    for (int piece = 0; piece < BN / kPiece; ++piece) {
      if (kPiece * piece >= t.cols) break;  // uniform
      if (leader) bulk_wait_read_all();
      cutlass::arch::NamedBarrier::sync(128, kBar + wg);
      CUTE_UNROLL
      for (int u = 0; u < kPiece / 16; ++u) {
        const int j = piece * (kPiece / 8) + 2 * u;  // groups j, j + 1
        auto word = [&](int g, int h) { return t.zero ? 0u : pack_bf16x2(acc(4 * g + 2 * h), acc(4 * g + 2 * h + 1)); };
        stmatrix_x4<kTrans>(addr(u), word(j, 0), word(j, 1), word(j + 1, 0), word(j + 1, 1));
      }
      fence_generic_to_async_smem();  // the TMA store reads the buffer through the async proxy
      cutlass::arch::NamedBarrier::sync(128, kBar + wg);
      if (leader) {
        const int n0 = t.col0 + kPiece * piece;
        const int row = kTrans ? static_cast<int>(e * p.N) + n0 : static_cast<int>(t.row0) + 64 * wg;
        const int col = kTrans ? static_cast<int>(m0) + 64 * wg : n0;
        Tensor sD = make_tensor(make_smem_ptr(reinterpret_cast<Bf16*>(buf)), SmemLayout{});
        Tensor gD = local_tile(domain_offset(make_coord(row, col), mD), Shape<_64, _64>{}, make_coord(0, 0));
        auto [tDgD, tDsD] = tma_partition(tma_d, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sD), group_modes<0, 2>(gD));
        copy(tma_d, tDsD, tDgD);
        bulk_commit();
      }
    }
  }

  // After the last tile: the stores have completed before the CTA (and its shared memory) goes away.
  __device__ static void finish() {
    if (((static_cast<int>(threadIdx.x) - kProducerThreads) & 127) == 0) bulk_wait_all();
  }
};

// kHalves (gate/up as two tensors: tile columns [0, BN/2) gate, [BN/2, BN) up; H in halves) is a
// template parameter: a runtime switch between the two store sequences made ptxas spill (4 bytes)
// in the 128 x 128 ping-pong and 128 x 256 cooperative kernels.
struct EpiSwiGLUParams {
  bf16* H;     // [rows][N]   N = 2n
  bf16* A;     // [rows][N/2]
  int64_t ld;  // N
};
template <bool kHalves>
struct EpiSwiGLUT : WithoutPrefetch<EpiSwiGLUT<kHalves>> {
  using WithoutPrefetch<EpiSwiGLUT<kHalves>>::apply;
  using Params = EpiSwiGLUParams;
  template <class Accum, class Coords>
  __device__ static void apply(const Params& p, const Accum& acc, const Coords& cd, const TileCtx& t) {
    if constexpr (kHalves)
      apply_halves(p, acc, cd, t);
    else
      apply_interleaved(p, acc, cd, t);
  }

  // Halves: accumulator group j (gate columns j0 + 8 j ..) pairs with group j + G/2 (the same up
  // columns) in this thread; tile col0 counts N = 2n columns, so the tile's pairs start at
  // j0 = col0 / 2 and t.cols / 2 of them are valid.
  //   H[r][j0 + c] = bf16(g), H[r][n + j0 + c] = bf16(u), A[r][j0 + c] = bf16(silu(g~) u~)
  template <class Accum, class Coords>
  __device__ static void apply_halves(const Params& p, const Accum& acc, const Coords& cd, const TileCtx& t) {
    constexpr int G = acc_col_groups<Accum>();
    constexpr int G2 = G / 2;
    static_assert(G % 8 == 0, "SwiGLU halves: 16-byte stores of G/2 groups per half");
    const AccPos pos(cd);
    const int n = static_cast<int>(p.ld / 2), j0 = t.col0 / 2;
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const bool row_ok = pos.row_ok(t, h);
      const int64_t r = t.row0 + pos.m0 + 8 * h;
      bf16* hrow = p.H + r * p.ld + j0;
      store_row_16B<G2, 2>(hrow, row_ok, t,
                           [&](int j) { return pack_bf16x2(acc(4 * j + 2 * h), acc(4 * j + 2 * h + 1)); });
      store_row_16B<G2, 2>(hrow + n, row_ok, t, [&](int j) {
        return pack_bf16x2(acc(4 * (j + G2) + 2 * h), acc(4 * (j + G2) + 2 * h + 1));
      });
      store_row_16B<G2, 2>(p.A + r * n + j0, row_ok, t, [&](int j) {
        float a2[2];
        CUTE_UNROLL
        for (int q = 0; q < 2; ++q) {
          const float g = __bfloat162float(__float2bfloat16_rn(acc(4 * j + 2 * h + q)));
          const float u = __bfloat162float(__float2bfloat16_rn(acc(4 * (j + G2) + 2 * h + q)));
          a2[q] = silu_f(g) * u;
        }
        return pack_bf16x2(a2[0], a2[1]);
      });
    }
  }

  template <class Accum, class Coords>
  __device__ static void apply_interleaved(const Params& p, const Accum& acc, const Coords& cd, const TileCtx& t) {
    constexpr int G = acc_col_groups<Accum>();
    static_assert(G % 8 == 0, "SwiGLU: A is stored 8 units (8 groups of H) per lane");
    const AccPos pos(cd);
    const int q = static_cast<int>(threadIdx.x) & 3;
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const bool row_ok = pos.row_ok(t, h);
      const int64_t r = t.row0 + pos.m0 + 8 * h;
      // H: the rounded pair of every group, 16-byte stores.
      store_row_16B<G>(p.H + r * p.ld + t.col0, row_ok, t,
                       [&](int j) { return pack_bf16x2(acc(4 * j + 2 * h), acc(4 * j + 2 * h + 1)); });
      // A: lane q's unit of group j is A column col0/2 + 4 j + q, computed from the rounded H
      // pair. Words P[k] = (unit of group 8 b + 2 k, of 8 b + 2 k + 1); after the quad transpose
      // lane q holds, from lane s, (column 8 q + s, 8 q + 4 + s) of block b: one byte permute
      // orders them into 8 consecutive columns.
      bf16* arow = p.A + r * (p.ld / 2) + t.col0 / 2;
      CUTE_UNROLL
      for (int b = 0; b < G / 8; ++b) {
        uint32_t w[4];
        CUTE_UNROLL
        for (int k = 0; k < 4; ++k) {
          float a2[2];
          CUTE_UNROLL
          for (int i = 0; i < 2; ++i) {
            const int j = 8 * b + 2 * k + i;
            const __nv_bfloat162 hv = __floats2bfloat162_rn(acc(4 * j + 2 * h), acc(4 * j + 2 * h + 1));
            const float2 gu = __bfloat1622float2(hv);
            a2[i] = silu_f(gu.x) * gu.y;
          }
          w[k] = pack_bf16x2(a2[0], a2[1]);
        }
        quad_transpose(w);
        if (row_ok && AccPos::col_ok(t, 8 * b + 2 * q + 1))
          store_out(reinterpret_cast<uint4*>(arow + 32 * b + 8 * q),
                    make_uint4(__byte_perm(w[0], w[1], 0x5410), __byte_perm(w[2], w[3], 0x5410),
                               __byte_perm(w[0], w[1], 0x7632), __byte_perm(w[2], w[3], 0x7632)),
                    t.stream_out);
      }
    }
  }
};

using EpiSwiGLU = EpiSwiGLUT<false>;

struct EpiDSwiGLUParams {
  const bf16* H;          // [rows][2N]
  bf16* dH;               // [rows][2N]
  bf16* A_prime;          // [rows][N]
  const float* scores;    // by flat (token, k) index
  const int32_t* scatter; // grouped row -> flat index
  float* ds_partial;      // [rows][n_tiles]
  int64_t ld;             // N
  int n_tiles;
};

// kHalves: H / dH in the halves layout (g at [r][c], u at [r][N + c]; two-tensor W1). A template
// parameter, not a runtime flag: the flag's branches in the load and store cost the interleaved
// dA' 9-14% (measured on the H200, docs/engine.md).
template <bool kHalves>
struct EpiDSwiGLUT {
  using Params = EpiDSwiGLUParams;

  // H values and score of one of this thread's two rows.
  template <int kGroups>
  struct RowInputs {
    uint2 h[kGroups];  // (g, u) of columns 8 j + n0, + 1: 8 bytes (halves: raw 16-byte loads, load_row)
    float s;
  };
  template <int kGroups>
  struct Prefetch {
    RowInputs<kGroups> row[2];
  };

  template <int G, class Coords>
  __device__ static RowInputs<G> load_row(const Params& p, const Coords& cd, const TileCtx& t, int h) {
    RowInputs<G> f;
    const AccPos pos(cd);
    f.s = 0.f;
    // Zeros where nothing is loaded (rows / columns past the tile's end): the epilogue computes on
    // every lane (quad shuffles), and H = 0 gives a = 0, so no garbage (or Inf / NaN) enters dS.
    CUTE_UNROLL
    for (int j = 0; j < G; ++j) f.h[j] = make_uint2(0u, 0u);
    if (!pos.row_ok(t, h)) return f;
    const int64_t r = t.row0 + pos.m0 + 8 * h;
    f.s = __ldg(p.scores + __ldg(p.scatter + r));
    if constexpr (kHalves) {
      // Gate at column c, up at N + c. Lane q loads 16 bytes of each (columns 8 j + 0..7 of group
      // j = 4 b + q: full sectors, one load per 4 groups, where 4 + 4 bytes per lane and group
      // half-filled them and took 2x the load instructions); h[4 b + k] keeps word k of both, raw
      // (columns 2 k, 2 k + 1 of group 4 b + q). apply_row_halves brings dA' to this layout instead
      // of H to the accumulator's.
      const int q = static_cast<int>(threadIdx.x) & 3;
      const bf16* grow = p.H + r * 2 * p.ld + t.col0;
      CUTE_UNROLL
      for (int b = 0; b < G / 4; ++b) {
        const int jq = 4 * b + q;
        if (!AccPos::col_ok(t, jq)) continue;
        const uint4 g = __ldg(reinterpret_cast<const uint4*>(grow + 8 * jq));
        const uint4 u = __ldg(reinterpret_cast<const uint4*>(grow + p.ld + 8 * jq));
        f.h[4 * b + 0] = make_uint2(g.x, u.x);
        f.h[4 * b + 1] = make_uint2(g.y, u.y);
        f.h[4 * b + 2] = make_uint2(g.z, u.z);
        f.h[4 * b + 3] = make_uint2(g.w, u.w);
      }
      return f;
    }
    const uint2* hrow = reinterpret_cast<const uint2*>(p.H + r * 2 * p.ld + 2 * (t.col0 + pos.n0));
    CUTE_UNROLL
    for (int j = 0; j < G; ++j)
      if (AccPos::col_ok(t, j)) f.h[j] = __ldg(hrow + 4 * j);
    return f;
  }

  // Cooperative schedule: both rows' inputs loaded before the tile's mainloop so their latency
  // hides under the MMA (the epilogue would otherwise wait on each load in turn).
  template <class Accum, class Coords>
  __device__ static auto prefetch(const Params& p, const Accum&, const Coords& cd, const TileCtx& t) {
    constexpr int G = acc_col_groups<Accum>();
    Prefetch<G> f;
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) f.row[h] = load_row<G>(p, cd, t, h);
    return f;
  }

  template <class Accum, class Coords, class Pre>
  __device__ static void apply(const Params& p, const Accum& acc, const Coords& cd, const TileCtx& t,
                               const Pre& f) {
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) apply_row(p, acc, cd, t, h, f.row[h]);
  }

  // Ping-pong, the warpgroup's whole 128-row tile: a thread's 4 rows (2 halves x 2) in turn, each
  // row's H and score loaded while the row before it computes. Loading every row's inputs up front
  // would sit 4 rows of H next to the 128 x BN accumulator (a spill); loading each just before its
  // use (as before) waited out one HBM round trip per row, 4 per tile, which at small d (few
  // K-tiles for the other warpgroup's mainloop to hide them under) made dA' latency-bound.
  //
  // A 64 x 256 tile (ping-pong 64-row tiles) runs as two 128-column halves per row, so the
  // registers match the 128 x 128 tile's (4 half-rows of 16 groups, two in flight) and each half
  // writes its own dS partial: the [rows][N / 128] layout the row sum reads stays one tile width.
  template <class Accum, class Coords>
  __device__ static void apply_tile(const Params& p, const Accum& acc, const Coords& cd, const TileCtx& t) {
    constexpr int GT = acc_col_groups<decltype(acc(_, 0, _))>();
    static_assert(GT == 16 || GT == 32, "dSwiGLU tiles: 128 or 256 columns");
    constexpr int kHalvesPerRow = GT / 16;  // 128-column parts of a row
    constexpr int G = 16;
    constexpr int kRows = 2 * decltype(size<1>(acc))::value * kHalvesPerRow;  // i = (2 mi + h) * parts + c
    // Part c of a row: the tile's columns 128 c.., its own dS slot.
    auto part_ctx = [&](int c) {
      TileCtx tc = t;
      tc.col0 = t.col0 + 128 * c;
      tc.cols = t.cols - 128 * c;
      tc.n_tile = t.n_tile * kHalvesPerRow + c;
      return tc;
    };
    auto part_acc = [&](int mi, int c) {
      auto a = acc(_, mi, _);
      if constexpr (kHalvesPerRow == 1)
        return a;
      else  // groups 16 c .. 16 c + 15: elements 64 c .. of the fragment (4 per group)
        return make_tensor(a.data() + 64 * c, make_layout(Int<64>{}));
    };
    RowInputs<G> buf[2];
    buf[0] = load_row<G>(p, cd(_, 0, _), part_ctx(0), 0);
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const int c = i % kHalvesPerRow, row = i / kHalvesPerRow;  // row = 2 mi + h
      auto next = [&] {
        if (i + 1 < kRows) {
          const int c1 = (i + 1) % kHalvesPerRow, row1 = (i + 1) / kHalvesPerRow;
          buf[(i + 1) & 1] = load_row<G>(p, cd(_, row1 / 2, _), part_ctx(c1), row1 % 2);
        }
      };
      const TileCtx tc = part_ctx(c);
      if (tc.cols > 0)  // a part wholly past N (N % 256 != 0) computes nothing and writes no dS slot
        apply_row(p, part_acc(row / 2, c), cd(_, row / 2, _), tc, row % 2, buf[i & 1], next);
      else
        next();
    }
  }

  // Halves, computed where the 16-byte runs live: the quad transpose moves dA' (two fp32 words per
  // lane and group) so that lane q holds all 8 columns of group 4 b + q, which is how load_row
  // loaded H (gate and up, 16 bytes each, raw) and how dH (gate, up) and A' are stored. 8 shuffles
  // per 4 groups, where transposing H in (gate, up) and dH out (gate, up) plus A' took 20. dS sums
  // this lane's columns in another order than the interleaved path (the same terms, fp32): equal
  // to it within rounding, not bitwise; run to run it is fixed.
  template <int G, class Accum, class Row, class Mid>
  __device__ static void apply_row_halves(const Params& p, const Accum& acc, const TileCtx& t, int h, const Row& f,
                                          const AccPos& pos, bool row_ok, int q, Mid& mid) {
    const int64_t r = t.row0 + pos.m0 + 8 * h;
    const float s = f.s;
    bf16* dgrow = p.dH + r * 2 * p.ld + t.col0;  // gate; up at + ld
    bf16* aprow = p.A_prime + r * p.ld + t.col0;
    float ds = 0.f;
    CUTE_UNROLL
    for (int b = 0; b < G / 4; ++b) {
      // lo[k] / hi[k]: dA' of column 2 k / 2 k + 1 of group 4 b + q after the transpose.
      uint32_t lo[4], hi[4];
      CUTE_UNROLL
      for (int k = 0; k < 4; ++k) {
        // A copy ptxas cannot fold into the accumulator register: the quad transpose's selects
        // would otherwise write into it, and ptxas then serialises every wgmma of the kernel (C7514).
        asm volatile("mov.b32 %0, %1;" : "=r"(lo[k]) : "f"(acc(4 * (4 * b + k) + 2 * h)));
        asm volatile("mov.b32 %0, %1;" : "=r"(hi[k]) : "f"(acc(4 * (4 * b + k) + 2 * h + 1)));
      }
      quad_transpose(lo);
      quad_transpose(hi);
      uint32_t dg[4], du[4], ap[4];
      CUTE_UNROLL
      for (int k = 0; k < 4; ++k) {
        union {
          uint32_t w;
          __nv_bfloat162 h2;
        } gw, uw;
        gw.w = f.h[4 * b + k].x;  // gate columns 2 k, 2 k + 1 of group 4 b + q
        uw.w = f.h[4 * b + k].y;  // up, the same columns
        const float2 g2 = __bfloat1622float2(gw.h2), u2 = __bfloat1622float2(uw.h2);
        float dgv[2], duv[2], apv[2];
        CUTE_UNROLL
        for (int qq = 0; qq < 2; ++qq) {
          const float g = qq ? g2.y : g2.x, u = qq ? u2.y : u2.x;
          const float sig = sigmoid_f(g);
          const float sl = g * sig;
          const float a = sl * u;
          const float da_prime = __uint_as_float(qq ? hi[k] : lo[k]);
          ds += da_prime * a;
          const float dA = s * da_prime;
          dgv[qq] = dA * u * (sig + sl * (1.f - sig));
          duv[qq] = dA * sl;
          apv[qq] = s * a;
        }
        dg[k] = pack_bf16x2(dgv[0], dgv[1]);
        du[k] = pack_bf16x2(duv[0], duv[1]);
        ap[k] = pack_bf16x2(apv[0], apv[1]);
      }
      const int jq = 4 * b + q;
      if (row_ok && AccPos::col_ok(t, jq)) {
        store_out(reinterpret_cast<uint4*>(dgrow + 8 * jq), make_uint4(dg[0], dg[1], dg[2], dg[3]), t.stream_out);
        store_out(reinterpret_cast<uint4*>(dgrow + p.ld + 8 * jq), make_uint4(du[0], du[1], du[2], du[3]), t.stream_out);
        store_out(reinterpret_cast<uint4*>(aprow + 8 * jq), make_uint4(ap[0], ap[1], ap[2], ap[3]), t.stream_out);
      }
      if (b == (G / 4 - 1) / 2) mid();  // reached for every G (apply_row's hook)
    }
    ds += __shfl_xor_sync(0xffffffffu, ds, 1);
    ds += __shfl_xor_sync(0xffffffffu, ds, 2);
    if (q == 0 && row_ok) p.ds_partial[r * p.n_tiles + t.n_tile] = ds;
  }

  struct NoMid {
    __device__ void operator()() const {}
  };

  // mid(): called once, after the first half of the row's column groups (their accumulator
  // registers are dead by then): where apply_tile issues the next row's loads.
  template <class Accum, class Coords, class Row, class Mid = NoMid>
  __device__ static void apply_row(const Params& p, const Accum& acc, const Coords& cd, const TileCtx& t, int h,
                                   const Row& f, Mid mid = Mid{}) {
    constexpr int G = acc_col_groups<Accum>();
    const AccPos pos(cd);
    const bool row_ok = pos.row_ok(t, h);
    const int q = static_cast<int>(threadIdx.x) & 3;
    if constexpr (kHalves) {
      apply_row_halves<G>(p, acc, t, h, f, pos, row_ok, q, mid);
      return;
    }
    // Every lane computes (the quad's shuffles need all of them); rows and columns past the tile's
    // end have H = 0 from load_row, so a = 0 there, and only the stores are predicated.
    const int64_t r = t.row0 + pos.m0 + 8 * h;
    const float s = f.s;
    const int64_t j0 = t.col0 + pos.n0;
    // dH interleaved: 8 bytes per lane and group, a quad's 32 bytes one full sector.
    bf16* dhrow = p.dH + r * 2 * p.ld + 2 * j0;
    bf16* aprow = p.A_prime + r * p.ld + t.col0;  // A': 16-byte stores after the quad transpose
    float ds = 0.f;
    CUTE_UNROLL
    for (int b = 0; b < G / 4; ++b) {
      uint32_t w[4];
      CUTE_UNROLL
      for (int k = 0; k < 4; ++k) {
        const int j = 4 * b + k;
        union {
          uint2 u;
          __nv_bfloat162 h2[2];
        } hv, dh;
        hv.u = f.h[j];
        float ap[2];
        CUTE_UNROLL
        for (int qq = 0; qq < 2; ++qq) {
          const float2 gu = __bfloat1622float2(hv.h2[qq]);
          const float sig = sigmoid_f(gu.x);
          const float sl = gu.x * sig;
          const float a = sl * gu.y;
          const float da_prime = acc(4 * j + 2 * h + qq);
          ds += da_prime * a;
          const float dA = s * da_prime;
          dh.h2[qq] = __floats2bfloat162_rn(dA * gu.y * (sig + sl * (1.f - sig)), dA * sl);
          ap[qq] = s * a;
        }
        if (row_ok && AccPos::col_ok(t, j)) store_out(reinterpret_cast<uint2*>(dhrow + 16 * j), dh.u, t.stream_out);
        w[k] = pack_bf16x2(ap[0], ap[1]);
      }
      quad_transpose(w);
      const int jq = 4 * b + q;
      if (row_ok && AccPos::col_ok(t, jq))
        store_out(reinterpret_cast<uint4*>(aprow + 8 * jq), make_uint4(w[0], w[1], w[2], w[3]), t.stream_out);
      if (b == (G / 4 - 1) / 2) mid();  // reached for every G
    }
    // The 4 lanes of a quad hold one row: fixed butterfly, lane 0 of the quad writes.
    ds += __shfl_xor_sync(0xffffffffu, ds, 1);
    ds += __shfl_xor_sync(0xffffffffu, ds, 2);
    if (q == 0 && row_ok) p.ds_partial[r * p.n_tiles + t.n_tile] = ds;
  }
};

using EpiDSwiGLU = EpiDSwiGLUT<false>;

}  // namespace engine
}  // namespace smoe
