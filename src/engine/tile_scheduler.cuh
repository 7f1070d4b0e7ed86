// Persistent static tile schedulers over (expert, tile), computed on the device from expert_offset
// (no host sync). Every role of a CTA (producer and consumers) walks the same sequence
// tile = first() + i * stride() and decodes it on its own: no communication is needed. In a
// cluster of C CTAs (varlen-M, B multicast along M) the unit of work is a C x BM-row block; the
// cluster walks the units and CTA rank r takes rows r * BM.. of each, so both CTAs of a pair
// always share the expert and N-tile (the B tile they multicast to each other).
#pragma once

#include <cstdint>

#include "engine/tile_order.h"

namespace smoe {
namespace engine {

struct WorkTile {
  int expert;
  int m_tile;   // varlen-M: M-tile inside the expert; varlen-K: M-tile of the weight gradient
  int n_tile;
  int row0;     // varlen-M: first grouped row of the tile; varlen-K: first grouped row of expert
  int rows;     // varlen-M: valid rows of the tile (<= BM); varlen-K: rows (tokens) of the expert
};

// varlen-M: expert e owns ceil(m_e / BM) M-tiles; tiles run expert-major, then in band_order: by
// default M-tiles next and the N-tiles innermost, so CTAs of one wave share the A rows of one M-tile
// and an expert's weight tiles stay in L2 across its M-tiles (while they fit). tile_start (shared
// memory, E+1 entries) is the exclusive prefix of the M-tile counts, built once per CTA by warp 0
// (E <= 512: 16 warp scans).
template <int BM, int C = 1>
struct VarlenMScheduler {
  // A unit is C x BM rows (adjacent M-tiles of one expert, a cluster's CTAs) of one N-tile.
  static constexpr int kUnitRows = BM * C;
  const int32_t* offset;    // [E+1] global
  const int* tile_start;    // [E+1] shared: prefix of the units (C x BM rows) per expert
  int num_experts;
  int n_tiles;
  int n_band;               // N-tiles per band (band_order; >= n_tiles: the default order)
  int rank;                 // this CTA's rank in its cluster (0 when C == 1)

  __device__ static int first() { return static_cast<int>(blockIdx.x) / C; }
  __device__ static int stride() { return static_cast<int>(gridDim.x) / C; }

  __device__ static void build(const int32_t* __restrict__ offset, int E, int* tile_start) {
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    int carry = 0;
    for (int base = 0; base < E; base += 32) {
      const int e = base + lane;
      int v = 0;
      if (e < E) v = (offset[e + 1] - offset[e] + kUnitRows - 1) / kUnitRows;
      int incl = v;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += y;
      }
      if (e < E) tile_start[e] = carry + incl - v;
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) tile_start[E] = carry;
  }

  __device__ int total_tiles() const { return tile_start[num_experts] * n_tiles; }

  __device__ WorkTile get(int t) const {
    // Expert e's tiles are [tile_start[e] * n_tiles, tile_start[e + 1] * n_tiles) in any band order.
    const int m_lin = t / n_tiles;
    WorkTile w;
    // Largest e with tile_start[e] <= m_lin: empty experts before it share its start.
    int lo = 0, hi = num_experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (tile_start[mid] <= m_lin) lo = mid; else hi = mid - 1;
    }
    w.expert = lo;
    const BandPos pos =
        band_order(t - tile_start[lo] * n_tiles, tile_start[lo + 1] - tile_start[lo], n_tiles, n_band);
    w.n_tile = pos.n_tile;
    w.m_tile = pos.unit * C + rank;
    const int begin = offset[lo], end = offset[lo + 1];
    w.row0 = begin + w.m_tile * BM;
    // A unit's rank-1 half may lie past the expert's end (odd M-tile count): rows = 0, the CTA
    // still loads and multiplies (its partner needs its half of the multicast operand) but stores
    // nothing.
    const int left = end - w.row0;
    w.rows = left < 0 ? 0 : left < BM ? left : BM;
    return w;
  }
};

// varlen-K (weight gradients): a fixed grid of (expert, m_tile, n_tile), experts outermost; each
// tile's reduction length is its expert's row count (0 for an empty expert: it stores zeros).
// In a cluster of C (Q multicast along M) the unit is C adjacent M-tiles of one (expert, N-tile):
// both CTAs of a pair reduce over the same rows and read the same Q tile, and rank r takes M-tile
// unit * C + r. With an odd M-tile count the last unit's rank-1 tile lies past M: that CTA still
// loads (its partner needs its half of Q) and multiplies, but stores nothing (TileCtx rows 0).
template <int C = 1>
struct VarlenKScheduler {
  const int32_t* offset;
  int num_experts;
  int m_tiles;
  int n_tiles;
  int rank;  // this CTA's rank in its cluster (0 when C == 1)

  __device__ static int first() { return static_cast<int>(blockIdx.x) / C; }
  __device__ static int stride() { return static_cast<int>(gridDim.x) / C; }
  __device__ int m_units() const { return (m_tiles + C - 1) / C; }
  __device__ int total_tiles() const { return num_experts * m_units() * n_tiles; }

  __device__ WorkTile get(int t) const {
    const int per_expert = m_units() * n_tiles;
    WorkTile w;
    w.expert = t / per_expert;
    const int r = t - w.expert * per_expert;
    const int m_unit = r / n_tiles;
    w.n_tile = r - m_unit * n_tiles;
    w.m_tile = m_unit * C + rank;
    w.row0 = offset[w.expert];
    w.rows = offset[w.expert + 1] - w.row0;
    return w;
  }
};

}  // namespace engine
}  // namespace smoe
