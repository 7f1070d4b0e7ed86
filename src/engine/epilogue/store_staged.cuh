#pragma once

#include "engine/epilogue/store.cuh"

namespace smoe {
namespace engine {

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
//      (labels _pps2). Measured on the H200 at f57e909: at
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
template <int kSlabs, int BN>
struct EpiSmem<EpiStoreStagedT<kSlabs>, BN> {
  static constexpr int kBytes = EpiStoreStagedT<kSlabs>::template smem_bytes<BN>();
};
template <int kSlabs>
constexpr bool kIsStagedStore<EpiStoreStagedT<kSlabs>> = true;

}  // namespace engine
}  // namespace smoe
