// EpiStore: D[r][c] = bf16(acc) from registers (16-byte stores after the quad transpose). The plain
// store GEMMs (down-proj, dX~) in the cooperative schedule, and an expert's last partial tile of the
// staged variant.
#pragma once

#include "engine/epilogue/common.cuh"
#include "engine/epilogue/store.h"

namespace smoe {
namespace engine {

struct EpiStore : WithoutPrefetch<EpiStore> {
  using WithoutPrefetch<EpiStore>::apply;
  using Params = StoreParams;
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


}  // namespace engine
}  // namespace smoe
