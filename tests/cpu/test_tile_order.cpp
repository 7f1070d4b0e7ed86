// The varlen-M tile order inside one expert (src/engine/tile_order.h, run by the kernels'
// VarlenMScheduler): every band width visits each (unit, N-tile) exactly once, one band is the order
// the kernels always ran, and narrower bands keep a wave of tiles to the band's N-tiles.
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "engine/engine.h"
#include "engine/heuristic.h"
#include "engine/overrides.h"
#include "engine/tile_order.h"

namespace eng = smoe::engine;

TEST(TileOrder, EveryBandIsAPermutation) {
  for (int units : {1, 2, 3, 7, 16, 33})
    for (int n_tiles : {1, 2, 5, 8, 30, 128})
      for (int band : {0, 1, 2, 3, 4, 7, 8, 16, 29, 30, 31, 200}) {
        std::set<std::pair<int, int>> seen;
        for (int l = 0; l < units * n_tiles; ++l) {
          const eng::BandPos p = eng::band_order(l, units, n_tiles, band);
          ASSERT_GE(p.unit, 0);
          ASSERT_LT(p.unit, units);
          ASSERT_GE(p.n_tile, 0);
          ASSERT_LT(p.n_tile, n_tiles);
          ASSERT_TRUE(seen.insert({p.unit, p.n_tile}).second)
              << "units " << units << " n_tiles " << n_tiles << " band " << band << " l " << l << " repeats ("
              << p.unit << ", " << p.n_tile << ")";
        }
        EXPECT_EQ(static_cast<int>(seen.size()), units * n_tiles);
      }
}

TEST(TileOrder, OneBandIsTheDefaultOrder) {
  for (int band : {0, 30, 31, 1000})
    for (int l = 0; l < 7 * 30; ++l) {
      const eng::BandPos p = eng::band_order(l, 7, 30, band);
      EXPECT_EQ(p.unit, l / 30);
      EXPECT_EQ(p.n_tile, l % 30);
    }
}

TEST(TileOrder, BandsRunOneAfterAnotherUnitsInside) {
  // 8 M-tiles x 128 N-tiles (E = 16 at K = 1, n = 8192: up-proj's 2n / 128), bands of 16: the first
  // 132 tiles (one wave of an H100) are all 8 M-tiles of N-tiles 0..15 and 4 tiles of the next band.
  std::set<int> units, cols;
  for (int l = 0; l < 128; ++l) {
    const eng::BandPos p = eng::band_order(l, 8, 128, 16);
    units.insert(p.unit);
    cols.insert(p.n_tile);
    EXPECT_EQ(p.unit, l / 16);
    EXPECT_EQ(p.n_tile, l % 16);
  }
  EXPECT_EQ(units.size(), 8u);
  EXPECT_EQ(cols.size(), 16u);
  EXPECT_EQ(eng::band_order(128, 8, 128, 16).n_tile, 16);
  EXPECT_EQ(eng::band_order(128, 8, 128, 16).unit, 0);
  // A last band narrower than the others (30 = 3 x 8 + 6): its 6 N-tiles per unit, units in order.
  for (int l = 3 * 8 * 5; l < 5 * 30; ++l) {
    const eng::BandPos p = eng::band_order(l, 5, 30, 8);
    const int r = l - 3 * 8 * 5;
    EXPECT_EQ(p.unit, r / 6);
    EXPECT_EQ(p.n_tile, 24 + r % 6);
  }
  // Band 1: M-tiles innermost, one N-tile at a time.
  for (int l = 0; l < 4 * 3; ++l) {
    const eng::BandPos p = eng::band_order(l, 4, 3, 1);
    EXPECT_EQ(p.unit, l % 4);
    EXPECT_EQ(p.n_tile, l / 4);
  }
}

TEST(TileOrder, SwitchSetsTheBandClampedToTheTiles) {
  static const char* value = nullptr;
  auto parse = [](const char* v) {
    value = v;
    return eng::parse_overrides(
        [](const char* k) -> const char* { return std::string(k) == "SMOE_ENGINE_N_BAND" ? value : nullptr; });
  };
  EXPECT_EQ(parse(nullptr).n_band, -1) << "unset: the rule";
  EXPECT_EQ(parse("").n_band, -1);
  EXPECT_EQ(parse("0").n_band, 0);
  EXPECT_EQ(parse("off").n_band, 0);
  EXPECT_EQ(parse("16").n_band, 16);
  EXPECT_EQ(parse("-3").n_band, -1) << "not a band: the rule";
  EXPECT_EQ(parse("x").n_band, -1);
  EXPECT_EQ(parse("8x").n_band, -1);
  EXPECT_FALSE(parse("16").forces()) << "a band orders the tiles; it does not choose an instance";
  const eng::Overrides saved = eng::overrides();
  eng::Overrides o;
  o.n_band = 0;
  eng::set_overrides(o);
  EXPECT_EQ(eng::varlen_m_n_band(30, int64_t{1} << 40), 30) << "0: one band whatever the weights";
  o.n_band = 16;
  eng::set_overrides(o);
  EXPECT_EQ(eng::varlen_m_n_band(128, 0), 16);
  EXPECT_EQ(eng::varlen_m_n_band(30, 0), 16);
  EXPECT_EQ(eng::varlen_m_n_band(8, 0), 8) << "wider than the tiles: one band";
  eng::set_overrides(saved);
}

// The rule (SMOE_ENGINE_N_BAND unset): bands of kAutoNBand where one expert's weights for the GEMM
// reach kBandMinWeightBytes (~L2), the default order below.
TEST(TileOrder, RuleBandsExpertsWiderThanL2) {
  const eng::Overrides saved = eng::overrides();
  eng::set_overrides(eng::Overrides{});
  ASSERT_EQ(eng::overrides().n_band, -1);
  const int64_t bf16 = 2;
  // E16 K1 n8192 d4096's up-proj (N 2n = 16384, K 4096: 128 MB) at BN 128: 128 N-tiles.
  EXPECT_EQ(eng::varlen_m_n_band(128, int64_t{16384} * 4096 * bf16), eng::kAutoNBand);
  EXPECT_EQ(eng::varlen_m_n_band(128, eng::kBandMinWeightBytes), eng::kAutoNBand);
  EXPECT_EQ(eng::varlen_m_n_band(128, eng::kBandMinWeightBytes - 1), 128) << "below: one band";
  // 30B n256 (d 2048): dX's 2 MiB of weights per expert keeps the order that shares A rows.
  EXPECT_EQ(eng::varlen_m_n_band(16, int64_t{2048} * 512 * bf16), 16);
  // Fewer N-tiles than a band: one band.
  EXPECT_EQ(eng::varlen_m_n_band(eng::kAutoNBand, int64_t{1} << 40), eng::kAutoNBand);
  EXPECT_EQ(eng::varlen_m_n_band(3, int64_t{1} << 40), 3);
  // By extents, as make_params and SMOE_ENGINE_PRINT take it: N-tiles of bn, N x K bf16 weights.
  EXPECT_EQ(eng::varlen_m_n_band(16384, 4096, 128), eng::kAutoNBand);  // 128 MiB, 128 tiles
  EXPECT_EQ(eng::varlen_m_n_band(2048, 512, 128), 16) << "2 MiB: one band of all 16 tiles";
  EXPECT_EQ(eng::varlen_m_n_band(2880, 8192, 192), 15) << "45 MiB: below the rule, all 15 tiles in one band";
  EXPECT_EQ(eng::varlen_m_n_band(3072, 8192, 192), eng::kAutoNBand) << "48 MiB: bands";
  EXPECT_EQ(eng::varlen_m_n_band(2881, 8192, 192), 16) << "a partial last N-tile counts as a tile";
  eng::set_overrides(saved);
}
