// What every epilogue of the engine shares (epilogue/*.cuh, one file per variant; each variant's
// host side, its Params, make_params and argument rules, in the matching .h). Small variants on one
// store path. In the sm_90 wgmma accumulator
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
  bool stream_out;  // outputs by st.global.cs (store_out_if)
};

// One output store. stream_out: st.global.cs, L2 evict-first. The GEMM outputs (H, A, Y, dH, A',
// dX~: 0.3-4 GB each) are read by a later kernel, never by this one, and under the default policy
// they push out of L2 the weight tiles and gathered rows this kernel re-reads (ncu at 5639575:
// up-proj DRAM 56%, about 3x its compulsory traffic).
// Predicated in PTX rather than under an `if`: a branch around every store (BSSY / BRA / BSYNC)
// fences ptxas's scheduling, so the math of the next columns could not overlap a store's address
// and predicate work; epilogues that are longer than the other warpgroup's mainloop (dSwiGLU at
// d <= 2048, SwiGLU at d <= 1536) pay for every such fence. ok false: nothing is written.
// The same under a branch (the caller's), where predication costs registers (store_out_if).
template <class V>
__device__ __forceinline__ void store_out(V* p, const V& v, bool stream_out) {
  if (stream_out) __stcs(p, v);
  else *p = v;
}

template <class V>
__device__ __forceinline__ void store_out_if(bool ok, V* p, const V& v, bool stream_out) {
  static_assert(sizeof(V) == 16 || sizeof(V) == 8, "16- or 8-byte output stores");
  const uint32_t* w = reinterpret_cast<const uint32_t*>(&v);
  if constexpr (sizeof(V) == 16)
    asm volatile(
        "{\n\t.reg .pred o, s, n;\n\t"
        "setp.ne.b32 o, %1, 0;\n\t"
        "setp.ne.and.b32 s, %2, 0, o;\n\t"
        "setp.eq.and.b32 n, %2, 0, o;\n\t"
        "@s st.global.cs.v4.b32 [%0], {%3, %4, %5, %6};\n\t"
        "@n st.global.v4.b32 [%0], {%3, %4, %5, %6};\n\t}"
        :
        : "l"(p), "r"(static_cast<int>(ok)), "r"(static_cast<int>(stream_out)), "r"(w[0]), "r"(w[1]), "r"(w[2]),
          "r"(w[3])
        : "memory");
  else
    asm volatile(
        "{\n\t.reg .pred o, s, n;\n\t"
        "setp.ne.b32 o, %1, 0;\n\t"
        "setp.ne.and.b32 s, %2, 0, o;\n\t"
        "setp.eq.and.b32 n, %2, 0, o;\n\t"
        "@s st.global.cs.v2.b32 [%0], {%3, %4};\n\t"
        "@n st.global.v2.b32 [%0], {%3, %4};\n\t}"
        :
        : "l"(p), "r"(static_cast<int>(ok)), "r"(static_cast<int>(stream_out)), "r"(w[0]), "r"(w[1])
        : "memory");
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
    store_out_if(row_ok && 8 * kColScale * j < t.cols, reinterpret_cast<uint4*>(row + 8 * j),
                 make_uint4(w[0], w[1], w[2], w[3]), t.stream_out);
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


// Shared memory an epilogue stages its tile in (0: it stores from registers) and the two kinds of
// staged store the kernels treat apart; each staged epilogue specialises these beside its definition.
template <class Epi, int BN>
struct EpiSmem {
  static constexpr int kBytes = 0;
};
template <class Epi>
constexpr bool kIsTmaStore = false;
template <class Epi>
constexpr bool kIsStagedStore = false;

}  // namespace engine
}  // namespace smoe
