#pragma once

#include "engine/epilogue/common.cuh"
#include "engine/epilogue/dswiglu.h"

namespace smoe {
namespace engine {


// kHalves: H / dH in the halves layout (g at [r][c], u at [r][N + c]; two-tensor W1). A template
// parameter, not a runtime flag: the flag's branches in the load and store cost the interleaved
// dA' 9-14% (measured on the H200, docs/engine.md).
template <bool kHalves>
struct EpiDSwiGLUT {
  using Params = EpiDSwiGLUParams;
  // Cooperative 128 x 256 (64 x 256 per warpgroup) streams its rows through apply_tile: two rows
  // of prefetched H beside that accumulator spill (gemm_kernel.cuh, CoopPrefetchMaxBN).
  static constexpr int kCoopPrefetchMaxBN = 128;

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
      // A branch, not store_out_if: three predicated stores made ptxas spill 8 bytes in the
      // cooperative halves dA' (da_dswiglu<128>); one branch around all three costs one fence.
      if (row_ok && AccPos::col_ok(t, jq)) {
        store_out(reinterpret_cast<uint4*>(dgrow + 8 * jq), make_uint4(dg[0], dg[1], dg[2], dg[3]), t.stream_out);
        store_out(reinterpret_cast<uint4*>(dgrow + p.ld + 8 * jq), make_uint4(du[0], du[1], du[2], du[3]),
                  t.stream_out);
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
        store_out_if(row_ok && AccPos::col_ok(t, j), reinterpret_cast<uint2*>(dhrow + 16 * j), dh.u, t.stream_out);
        w[k] = pack_bf16x2(ap[0], ap[1]);
      }
      quad_transpose(w);
      const int jq = 4 * b + q;
      store_out_if(row_ok && AccPos::col_ok(t, jq), reinterpret_cast<uint4*>(aprow + 8 * jq),
                   make_uint4(w[0], w[1], w[2], w[3]), t.stream_out);
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
