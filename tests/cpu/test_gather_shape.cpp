// The gather-sums' launch shapes (src/moe/gather_shape.h): every pick is a built variant, the router's
// W_r slab stays within its budget, the measured picks per entry count, the override's parser.
#include <string>

#include <gtest/gtest.h>

#include "moe/gather_shape.h"

namespace k = smoe::kernels;

namespace {

bool built(const k::GatherShape& g) {
  for (const k::GatherShape& b : k::kGatherShapes)
    if (b.tokens == g.tokens && b.entries == g.entries && b.chunks == g.chunks) return true;
  return false;
}

}  // namespace

TEST(GatherShape, EveryPickIsBuiltAndItsSlabFits) {
  for (k::GatherStage st : {k::GatherStage::kAggregate, k::GatherStage::kDx, k::GatherStage::kDxRouter})
    for (int K = 0; K <= 16; ++K)
      for (int E = 1; E <= 512; ++E) {
        const k::GatherShape g = k::gather_shape(st, K, E);
        ASSERT_TRUE(built(g)) << "stage " << static_cast<int>(st) << " K " << K << " E " << E << ": " << g.tokens
                              << "x" << g.entries << "x" << g.chunks;
        if (st == k::GatherStage::kDxRouter)
          EXPECT_LE(k::router_slab_bytes(E, g.chunks), k::kGatherPickSlabBytes)
              << "K " << K << " E " << E;
        // Never one row load per index chain again (the schedule the variants replaced at K <= 2):
        // two chunks, or two tokens, or 4 entries.
        EXPECT_TRUE(g.chunks >= 2 || g.tokens >= 2 || g.entries >= 4) << "K " << K << " E " << E;
      }
}

TEST(GatherShape, MeasuredPicks) {
  auto is = [](k::GatherShape g, int u, int b, int c) { return g.tokens == u && g.entries == b && g.chunks == c; };
  for (k::GatherStage st : {k::GatherStage::kAggregate, k::GatherStage::kDx, k::GatherStage::kDxRouter}) {
    EXPECT_TRUE(is(k::gather_shape(st, 1, 16), 1, 1, 4));
    EXPECT_TRUE(is(k::gather_shape(st, 2, 32), 1, 2, 2));
    for (int K : {3, 4, 8, 16}) EXPECT_TRUE(is(k::gather_shape(st, K, 256), 1, 4, 1)) << K;
  }
  // The router's slab: 4 chunks up to E = 128, 2 up to 256, then one chunk of two tokens x two entries.
  EXPECT_TRUE(is(k::gather_shape(k::GatherStage::kDxRouter, 1, 128), 1, 1, 4));
  EXPECT_TRUE(is(k::gather_shape(k::GatherStage::kDxRouter, 1, 129), 1, 1, 2));
  EXPECT_TRUE(is(k::gather_shape(k::GatherStage::kDxRouter, 1, 257), 2, 2, 1));
  EXPECT_TRUE(is(k::gather_shape(k::GatherStage::kDxRouter, 2, 256), 1, 2, 2));
  EXPECT_TRUE(is(k::gather_shape(k::GatherStage::kDxRouter, 2, 257), 2, 2, 1));
  EXPECT_TRUE(is(k::gather_shape(k::GatherStage::kDx, 1, 512), 1, 1, 4));  // no slab without the router
}

TEST(GatherShape, OverrideParser) {
  const auto g = k::parse_gather_shape("1x2x2");
  ASSERT_TRUE(g.has_value());
  EXPECT_EQ(g->tokens, 1);
  EXPECT_EQ(g->entries, 2);
  EXPECT_EQ(g->chunks, 2);
  EXPECT_TRUE(k::parse_gather_shape("2x2x1").has_value());
  for (const k::GatherShape& b : k::kGatherShapes) {  // every built variant by its name
    const std::string name = std::to_string(b.tokens) + "x" + std::to_string(b.entries) + "x" + std::to_string(b.chunks);
    const auto p = k::parse_gather_shape(name.c_str());
    ASSERT_TRUE(p.has_value()) << name;
    EXPECT_TRUE(p->tokens == b.tokens && p->entries == b.entries && p->chunks == b.chunks) << name;
  }
  for (const char* bad : {"", "1x2", "1x2x3", "1x1x1", "1x2x2 ", " 1x2x2", "+1x2x2", "01x02x02", "1x2x2x", "a",
                          "-1x4x1", "0x0x0", "4x1x1", "1X2X2"})
    EXPECT_FALSE(k::parse_gather_shape(bad).has_value()) << "'" << bad << "'";
  EXPECT_FALSE(k::parse_gather_shape(nullptr).has_value());
}
