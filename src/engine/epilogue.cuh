// Epilogues of the engine: small variants on one store path. In the sm_90 wgmma accumulator
// layout each consumer thread holds, for two rows (m0 and m0 + 8) and every column pair
// (n0 + 8 j, + 1) of the tile, one fp32 pair: accum(4 j + 2 h + q) is row m0 + 8 h, column
// n0 + 8 j + q (value bit 0 = column + 1, bit 1 = row + 8, the rest = column + 8 j). Each thread
// keeps two row pointers and addresses every store with a compile-time column offset from them
// (64 64-bit addresses would not fit next to 128 accumulators). Stores are predicated to the
// tile's valid rows and columns, so a tile never writes past its expert's last row.
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
};

__device__ __forceinline__ float silu_f(float g) { return g / (1.f + __expf(-g)); }

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

// The kernel calls an epilogue in one of two ways: cooperative, pre = prefetch(...) before the
// mainloop and apply(..., pre) after it; ping-pong, apply_streamed(...) (per 64-row half, inputs
// loaded as they are used). Epilogues without per-row inputs derive from this (CRTP), which
// adapts their apply(p, acc, cd, t) to both.
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
  __device__ static void apply_streamed(const Params& p, const Accum& acc, const Coords& cd, const TileCtx& t) {
    Derived::apply(p, acc, cd, t);
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
      if (!pos.row_ok(t, h)) continue;
      bf16* row = p.D + (t.row0 + pos.m0 + 8 * h) * p.ld + t.col0 + pos.n0;
      CUTE_UNROLL
      for (int j = 0; j < acc_col_groups<Accum>(); ++j)
        if (AccPos::col_ok(t, j))
          *reinterpret_cast<__nv_bfloat162*>(row + 8 * j) =
              t.zero ? __floats2bfloat162_rn(0.f, 0.f)
                     : __floats2bfloat162_rn(acc(4 * j + 2 * h), acc(4 * j + 2 * h + 1));
    }
  }
};

// Transposed store (varlen-K only): the kernel's D'(m, n) of expert e goes to D[e][n][m], with D
// [E][N][M]; tile row0 = e * M + m0 (as for EpiStore). Used when the gathered operand is the
// output's column dimension (dW1 = dH^T x[gather]): computing its transpose keeps the gathered
// operand the narrow (128-row) one. 2-byte stores, once per tile after a full-length reduction.
struct EpiStoreT : WithoutPrefetch<EpiStoreT> {
  using WithoutPrefetch<EpiStoreT>::apply;
  struct Params {
    bf16* D;
    int64_t M;  // the kernel's M: the stored matrix's row length
    int64_t N;
  };
  template <class Accum, class Coords>
  __device__ static void apply(const Params& p, const Accum& acc, const Coords& cd, const TileCtx& t) {
    const AccPos pos(cd);
    const int64_t e = t.row0 / p.M, m0 = t.row0 - e * p.M;
    bf16* base = p.D + e * p.M * p.N + static_cast<int64_t>(t.col0 + pos.n0) * p.M + m0 + pos.m0;
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      if (!pos.row_ok(t, h)) continue;
      CUTE_UNROLL
      for (int j = 0; j < acc_col_groups<Accum>(); ++j) {
        if (!AccPos::col_ok(t, j)) continue;
        CUTE_UNROLL
        for (int q = 0; q < 2; ++q)
          base[(8 * j + q) * p.M + 8 * h] = t.zero ? __float2bfloat16_rn(0.f) : __float2bfloat16_rn(acc(4 * j + 2 * h + q));
      }
    }
  }
};

struct EpiSwiGLU : WithoutPrefetch<EpiSwiGLU> {
  using WithoutPrefetch<EpiSwiGLU>::apply;
  struct Params {
    bf16* H;     // [rows][N]   N = 2n
    bf16* A;     // [rows][N/2]
    int64_t ld;  // N
  };
  template <class Accum, class Coords>
  __device__ static void apply(const Params& p, const Accum& acc, const Coords& cd, const TileCtx& t) {
    const AccPos pos(cd);
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      if (!pos.row_ok(t, h)) continue;
      const int64_t r = t.row0 + pos.m0 + 8 * h;
      bf16* hrow = p.H + r * p.ld + t.col0 + pos.n0;
      bf16* arow = p.A + r * (p.ld / 2) + (t.col0 + pos.n0) / 2;
      CUTE_UNROLL
      for (int j = 0; j < acc_col_groups<Accum>(); ++j) {
        if (!AccPos::col_ok(t, j)) continue;
        const __nv_bfloat162 hv = __floats2bfloat162_rn(acc(4 * j + 2 * h), acc(4 * j + 2 * h + 1));
        *reinterpret_cast<__nv_bfloat162*>(hrow + 8 * j) = hv;
        const float2 gu = __bfloat1622float2(hv);
        arow[4 * j] = __float2bfloat16_rn(silu_f(gu.x) * gu.y);
      }
    }
  }
};

struct EpiDSwiGLU {
  struct Params {
    const bf16* H;          // [rows][2N]
    bf16* dH;               // [rows][2N]
    bf16* A_prime;          // [rows][N]
    const float* scores;    // by flat (token, k) index
    const int32_t* scatter; // grouped row -> flat index
    float* ds_partial;      // [rows][n_tiles]
    int64_t ld;             // N
    int n_tiles;
  };

  // H values and score of one of this thread's two rows.
  template <int kGroups>
  struct RowInputs {
    uint2 h[kGroups];  // (g, u) of columns 8 j + n0, + 1: 8 bytes
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
    if (!pos.row_ok(t, h)) return f;
    const int64_t r = t.row0 + pos.m0 + 8 * h;
    f.s = __ldg(p.scores + __ldg(p.scatter + r));
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

  // Ping-pong: a row's inputs loaded just before its use (the other warpgroup's mainloop hides
  // the latency; holding both rows' next to a 128 x BN accumulator would spill).
  template <class Accum, class Coords>
  __device__ static void apply_streamed(const Params& p, const Accum& acc, const Coords& cd, const TileCtx& t) {
    constexpr int G = acc_col_groups<Accum>();
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) apply_row(p, acc, cd, t, h, load_row<G>(p, cd, t, h));
  }

  template <class Accum, class Coords, class Row>
  __device__ static void apply_row(const Params& p, const Accum& acc, const Coords& cd, const TileCtx& t, int h,
                                   const Row& f) {
    const AccPos pos(cd);
    float ds = 0.f;
    if (pos.row_ok(t, h)) {
      const int64_t r = t.row0 + pos.m0 + 8 * h;
      const float s = f.s;
      const int64_t j0 = t.col0 + pos.n0;
      bf16* dhrow = p.dH + r * 2 * p.ld + 2 * j0;
      bf16* aprow = p.A_prime + r * p.ld + j0;
      CUTE_UNROLL
      for (int j = 0; j < acc_col_groups<Accum>(); ++j) {
        if (!AccPos::col_ok(t, j)) continue;
        union {
          uint2 u;
          __nv_bfloat162 h2[2];
        } hv, dh;
        hv.u = f.h[j];
        float ap[2];
        CUTE_UNROLL
        for (int q = 0; q < 2; ++q) {
          const float2 gu = __bfloat1622float2(hv.h2[q]);
          const float sig = 1.f / (1.f + __expf(-gu.x));
          const float sl = gu.x * sig;
          const float a = sl * gu.y;
          const float da_prime = acc(4 * j + 2 * h + q);
          ds += da_prime * a;
          const float dA = s * da_prime;
          dh.h2[q] = __floats2bfloat162_rn(dA * gu.y * (sig + sl * (1.f - sig)), dA * sl);
          ap[q] = s * a;
        }
        *reinterpret_cast<uint2*>(dhrow + 16 * j) = dh.u;
        *reinterpret_cast<__nv_bfloat162*>(aprow + 8 * j) = __floats2bfloat162_rn(ap[0], ap[1]);
      }
    }
    // The 4 lanes of a quad hold one row: fixed butterfly, lane 0 of the quad writes.
    ds += __shfl_xor_sync(0xffffffffu, ds, 1);
    ds += __shfl_xor_sync(0xffffffffu, ds, 2);
    if ((threadIdx.x % 4) == 0 && pos.row_ok(t, h))
      p.ds_partial[(t.row0 + pos.m0 + 8 * h) * p.n_tiles + t.n_tile] = ds;
  }
};

}  // namespace engine
}  // namespace smoe
