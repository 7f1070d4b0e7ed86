// The gather-sums' override switch (gather_shape.h).
#include "moe/gather_shape.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace smoe {
namespace kernels {

std::optional<GatherShape> parse_gather_shape(const char* text) {
  if (text == nullptr) return std::nullopt;
  // Exactly a built variant's "UxBxC" (no sign, space or leading zero: the text must print back as itself).
  for (const GatherShape& b : kGatherShapes) {
    char name[32];
    std::snprintf(name, sizeof name, "%dx%dx%d", b.tokens, b.entries, b.chunks);
    if (std::strcmp(name, text) == 0) return b;
  }
  return std::nullopt;
}

std::optional<GatherShape> gather_shape_override() {
  static const std::optional<GatherShape> forced = [] {
    const char* v = std::getenv("SMOE_GATHER_SHAPE");
    const std::optional<GatherShape> g = parse_gather_shape(v);
    if (v != nullptr && v[0] != '\0' && !g) {  // someone measuring would otherwise time the pick unawares
      std::fprintf(stderr, "smoe: SMOE_GATHER_SHAPE=%s is not a built variant (UxBxC of", v);
      for (const GatherShape& b : kGatherShapes) std::fprintf(stderr, " %dx%dx%d", b.tokens, b.entries, b.chunks);
      std::fprintf(stderr, "): ignored, the pick runs\n");
    }
    return g;
  }();
  return forced;
}

}  // namespace kernels
}  // namespace smoe
