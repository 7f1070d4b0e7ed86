// The standalone benches' output file (gather_sum_bench, router_gemm_bench): the whole text at once, or a
// message naming the path and false, so the caller exits non-zero without leaving a partial file unreported.
#pragma once

#include <cstdio>
#include <string>

namespace smoe_bench {

inline bool write_text(const char* path, const std::string& text) {
  FILE* f = std::fopen(path, "w");
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", path);
    return false;
  }
  const bool ok = std::fputs(text.c_str(), f) >= 0;
  if (std::fclose(f) != 0 || !ok) {
    std::fprintf(stderr, "cannot write %s\n", path);
    return false;
  }
  return true;
}

}  // namespace smoe_bench
