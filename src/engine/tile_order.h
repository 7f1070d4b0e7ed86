// The order of one expert's tiles in the varlen-M scheduler (tile_scheduler.cuh), apart so that the
// CPU tests check the mapping the kernels run.
#pragma once

#if defined(__CUDACC__)
#define SMOE_HOST_DEVICE __host__ __device__
#else
#define SMOE_HOST_DEVICE
#endif

namespace smoe {
namespace engine {

// One expert's units x n_tiles tiles in the order they run: local index l -> (unit, N-tile). The
// N-tiles go in bands of `band` (the last one narrower), one band after another; inside a band the
// units run in order, the band's N-tiles innermost. band >= n_tiles is one band: units outer, every
// N-tile inner (the default). A narrower band keeps the tiles in flight to fewer weight columns and
// more M-tiles: with S CTAs a wave touches ~S / band M-tiles of A and band N-tiles of B instead of
// ~S / n_tiles and n_tiles, which matters where an expert's weights outgrow L2 (experts wider than
// ~S tiles: every wave of the default order streams all of the expert's weights again).
struct BandPos {
  int unit;
  int n_tile;
};
SMOE_HOST_DEVICE inline BandPos band_order(int l, int units, int n_tiles, int band) {
  if (band >= n_tiles || band < 1) return {l / n_tiles, l % n_tiles};
  const int per_band = units * band;
  const int b = l / per_band;
  const int n0 = b * band;
  const int w = n_tiles - n0 < band ? n_tiles - n0 : band;  // the last band may be narrower
  const int r = l - b * per_band;                           // < units * w
  return {r / w, n0 + r % w};
}

}  // namespace engine
}  // namespace smoe
