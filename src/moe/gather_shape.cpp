// The gather-sums' override switch (gather_shape.h).
#include "moe/gather_shape.h"

#include <cstdio>
#include <cstdlib>

namespace smoe {
namespace kernels {

std::optional<GatherShape> parse_gather_shape(const char* text) {
  if (text == nullptr) return std::nullopt;
  GatherShape g{};
  int used = 0;
  if (std::sscanf(text, "%dx%dx%d%n", &g.tokens, &g.entries, &g.chunks, &used) != 3 || text[used] != '\0')
    return std::nullopt;
  for (const GatherShape& b : kGatherShapes)
    if (b.tokens == g.tokens && b.entries == g.entries && b.chunks == g.chunks) return g;
  return std::nullopt;
}

std::optional<GatherShape> gather_shape_override() {
  static const std::optional<GatherShape> forced = parse_gather_shape(std::getenv("SMOE_GATHER_SHAPE"));
  return forced;
}

}  // namespace kernels
}  // namespace smoe
