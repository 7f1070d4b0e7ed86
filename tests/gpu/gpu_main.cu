// main() of the GPU test binary: skips (exit code 77, CTest "Skipped") with a printed reason when
// there is no CUDA GPU or it is not a Hopper GPU (the library is built for sm_90a only).
#include <cstdio>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    std::printf("[  SKIPPED ] no CUDA GPU found (%s): every GPU test skipped\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return 77;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || prop.major != 9) {
    std::printf("[  SKIPPED ] GPU 0 (%s, sm_%d%d) is not Hopper; this build targets sm_90a: "
                "every GPU test skipped\n", prop.name, prop.major, prop.minor);
    return 77;
  }
  std::printf("GPU: %s, %d SMs, %.1f GiB\n", prop.name, prop.multiProcessorCount,
              prop.totalGlobalMem / 1073741824.0);
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
