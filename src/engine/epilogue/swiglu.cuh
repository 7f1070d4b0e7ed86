#pragma once

#include "engine/epilogue/common.cuh"
#include "engine/epilogue/swiglu.h"

namespace smoe {
namespace engine {

// kHalves (gate/up as two tensors: tile columns [0, BN/2) gate, [BN/2, BN) up; H in halves) is a
// template parameter: a runtime switch between the two store sequences made ptxas spill (4 bytes)
// in the 128 x 128 ping-pong and 128 x 256 cooperative kernels.
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
        store_out_if(row_ok && AccPos::col_ok(t, 8 * b + 2 * q + 1), reinterpret_cast<uint4*>(arow + 32 * b + 8 * q),
                     make_uint4(__byte_perm(w[0], w[1], 0x5410), __byte_perm(w[2], w[3], 0x5410),
                                __byte_perm(w[0], w[1], 0x7632), __byte_perm(w[2], w[3], 0x7632)),
                     t.stream_out);
      }
    }
  }
};

using EpiSwiGLU = EpiSwiGLUT<false>;

}  // namespace engine
}  // namespace smoe
