// The gather-sums' launch shapes, host side (no CUDA): which variants are built, the pick per
// stage and entry count, the override switch. Device code: gather_sum.cuh.
#pragma once

#include <cstddef>
#include <optional>

namespace smoe {
namespace kernels {

constexpr int kGatherThreads = 256;
// A block owns a slab of kSlabLanes * C chunks of the row (C chunks per lane, kSlabLanes apart:
// each 8-lane group reads 128 contiguous bytes per chunk) and walks the tokens kSlabTokens at a time.
constexpr int kSlabLanes = 8;
constexpr int kSlabTokens = kGatherThreads / kSlabLanes;
constexpr size_t kChunkBytes = 16;  // one chunk: 8 bf16, one 16-byte load

// A thread's group: U tokens x B entries per batch x C chunks. The built variants (the library picks
// five; gather_sum_bench measures all, so a device's picks can be re-derived), and the pick by the
// tokens' entry count. Measured and dropped: 1 x 8 x 1, 4 x 1 x 1, 2 x 1 x 2 (8 x 1 x 1 at 170
// registers a thread): slower than a variant here on every shape of the H100's 15.
struct GatherShape {
  int tokens;   // U
  int entries;  // B
  int chunks;   // C
};
#define SMOE_GATHER_SHAPES(X) \
  X(1, 4, 1) X(2, 2, 1) X(1, 1, 2) X(1, 1, 4) X(1, 1, 8) X(1, 2, 2) X(1, 2, 4) X(1, 4, 2)
constexpr GatherShape kGatherShapes[] = {
#define SMOE_GATHER_LIST(u, b, c) {u, b, c},
    SMOE_GATHER_SHAPES(SMOE_GATHER_LIST)
#undef SMOE_GATHER_LIST
};

enum class GatherStage { kAggregate, kDx, kDxRouter };

// The router's W_r slab, E * 128 * C bytes of shared memory per block: at most this much (227 KB
// less a reserve), and the pick keeps it within kGatherPickSlabBytes so that several blocks stay
// resident per SM (E = 512 at C = 1: 64 KB).
constexpr size_t kGatherMaxSlabBytes = 226 * 1024;
constexpr size_t kGatherPickSlabBytes = 64 * 1024;
// The slab's bytes: E rows of W_r, kSlabLanes * chunks 16-byte chunks each.
constexpr size_t router_slab_bytes(int E, int chunks) {
  return static_cast<size_t>(E) * kSlabLanes * chunks * kChunkBytes;
}

// Measured on the H100 (gather_sum_bench, 15 shapes, every variant against the kernel before them,
// bench/results/h100/gather_sum.md): K = 1 runs 4 chunks per thread (one index chain for 64 bytes:
// 65-79% -> 92-101% of a copy), K = 2 two entries x two chunks (80-88% -> 94-98%); from K = 3 every
// variant is within a few % of a copy and 4 entries x 1 chunk (the old schedule) stays.
inline GatherShape gather_shape(GatherStage stage, int entries_per_token, int E) {
  GatherShape g = entries_per_token <= 1 ? GatherShape{1, 1, 4}
                  : entries_per_token <= 2 ? GatherShape{1, 2, 2}
                                           : GatherShape{1, 4, 1};
  if (stage == GatherStage::kDxRouter) {
    while (g.chunks > 1 && router_slab_bytes(E, g.chunks) > kGatherPickSlabBytes)
      g.chunks /= 2;
    // Down to one chunk (K <= 2 with the router at E > 256), two tokens of two entries: 75-86% of a
    // copy at K <= 2 where 1 x 4 x 1 ran 71-85% (1 x 1 x 1 and 1 x 2 x 1 are not built). Two chunks
    // stay as they are: 1 x 1 x 2 ran 89-95%, chunks share one index chain.
    if (g.chunks == 1 && g.tokens * g.entries < 4) g = GatherShape{2, 2, 1};
  }
  return g;
}

// "UxBxC" (e.g. "1x2x2") as a built variant; nullopt for null, empty, malformed or not built.
std::optional<GatherShape> parse_gather_shape(const char* text);
// SMOE_GATHER_SHAPE=UxBxC forces that variant on every gather-sum (measuring; a router slab too large
// for E falls back to the pick); unset or not a built variant: the pick. Read once per process.
std::optional<GatherShape> gather_shape_override();

}  // namespace kernels
}  // namespace smoe
