#pragma once

#include "engine/epilogue/common.cuh"
#include "engine/epilogue/store.h"

namespace smoe {
namespace engine {

// Store through shared memory (cooperative varlen-K: dW1 transposed, dW2 and the ungathered dw_tma
// plain): each consumer warpgroup writes its 64 rows (m) x 64 columns (n) of the tile at a time
// with stmatrix into a 128-byte-swizzled buffer of 8 KB, and one of its threads hands the buffer
// to the TMA unit (a tensor store of one 64 x 64 box), BN / 64 rounds per tile, while the
// warpgroup goes on.
//   kTrans: D[e][n][m], viewed as [E * N][M]; stmatrix.trans, buffer rows n.
//   plain:  D[e][m][n], viewed as [E * M][N]; stmatrix, buffer rows m.
// Why: under ncu at daa3d48 (Qwen3-Next, fused dW, 10 K-tiles per tile) the register path it
// replaced (an 8 x 8 octet transpose in registers for the transposed store: shuffles, byte
// permutes, selects, short-scoreboard stalls) held ~30% of all warp samples in dW1, ~45% of the
// consumers'; EpiStore's quad transposes 18% in dW2 (fused dW1 -15..-32% with this epilogue,
// 71543c7). M and N are multiples of 64 (rules.cpp) and tiles start at multiples of 64, so every box lies inside its expert's block
// (a warpgroup whose 64 rows lie past M stores nothing; pieces at or past N are skipped).
// A round: the issuing thread waits until the previous round's store has read the buffer, named
// barrier kBar + warpgroup (128 threads), stmatrix (4 per thread), fence to the async proxy,
// barrier, tensor store. Buffer row x holds 64 elements (128 bytes), 16-byte chunk c at c XOR x % 8
// (the K-major 128-byte swizzle atom, SmemLayout).
template <bool kTrans>
struct EpiStoreTma : WithoutPrefetch<EpiStoreTma<kTrans>> {
  using Params = StoreKParams;         // D, M, N
  static constexpr uint32_t kBar = 5;  // 5, 6 (0: __syncthreads, 1: ZeroTail, 4: gather)
  static constexpr int kPiece = 64;    // n columns per round (x a warpgroup's 64 rows)
  static constexpr int kPieceBytes = kPiece * 64 * 2;
  static constexpr int kSmemBytes = 2 * kPieceBytes;  // one buffer per consumer warpgroup
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
template <bool kTrans, int BN>
struct EpiSmem<EpiStoreTma<kTrans>, BN> {
  static constexpr int kBytes = EpiStoreTma<kTrans>::kSmemBytes;
};
template <bool kTrans>
constexpr bool kIsTmaStore<EpiStoreTma<kTrans>> = true;

}  // namespace engine
}  // namespace smoe
