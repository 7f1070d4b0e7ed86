// The standalone benches' timer (gather_sum_bench, router_gemm_bench): the median of single runs, each
// between two CUDA events on the default stream, after `warmup` untimed runs. before_each (outside the
// timed region) runs ahead of every timed rep, e.g. a scrub that pushes the operands out of the L2.
#pragma once

#include <algorithm>
#include <vector>

#include <cuda_runtime_api.h>

#include "cuda_or_exit.h"

namespace smoe_bench {

inline float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename F, typename Before>
float time_ms(F&& f, int warmup, int reps, Before&& before_each) {
  cudaEvent_t a, b;
  SMOE_CUDA_OR_EXIT(cudaEventCreate(&a));
  SMOE_CUDA_OR_EXIT(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) f();
  SMOE_CUDA_OR_EXIT(cudaDeviceSynchronize());
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    before_each(i);
    SMOE_CUDA_OR_EXIT(cudaEventRecord(a));
    f();
    SMOE_CUDA_OR_EXIT(cudaEventRecord(b));
    SMOE_CUDA_OR_EXIT(cudaEventSynchronize(b));
    float t = 0;
    SMOE_CUDA_OR_EXIT(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  SMOE_CUDA_OR_EXIT(cudaEventDestroy(a));
  SMOE_CUDA_OR_EXIT(cudaEventDestroy(b));
  return median(ms);
}

template <typename F>
float time_ms(F&& f, int warmup, int reps) {
  return time_ms(f, warmup, reps, [](int) {});
}

}  // namespace smoe_bench
