// The command-line tools' CUDA check (benchmarks, digest): print the call, where, and the error, then
// exit(1). The library returns a Status instead (src/common/check.h); the tests assert (gpu_util.h).
#pragma once

#include <cstdio>
#include <cstdlib>

#include <cuda_runtime_api.h>

#define SMOE_CUDA_OR_EXIT(x)                                                                   \
  do {                                                                                         \
    const cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));  \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)
