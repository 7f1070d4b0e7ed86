// Test helpers for GPU tests: checked CUDA calls and an owning device buffer.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#define CUDA_OK(expr)                                                                   \
  do {                                                                                  \
    cudaError_t _e = (expr);                                                            \
    ASSERT_EQ(_e, cudaSuccess) << #expr << ": " << cudaGetErrorString(_e);              \
  } while (0)

namespace smoe_test {

// Owning device allocation (tests only; the library itself never allocates).
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) { reset(count); }
  ~DeviceBuffer() { if (ptr_) cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void reset(size_t count) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    count_ = count;
    if (count == 0) return;
    cudaError_t e = cudaMalloc(&ptr_, count * sizeof(T));
    if (e != cudaSuccess) {
      std::fprintf(stderr, "cudaMalloc(%zu bytes) failed: %s\n", count * sizeof(T), cudaGetErrorString(e));
      std::abort();
    }
  }
  T* get() const { return static_cast<T*>(ptr_); }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

  // Fill every byte with 0xFF: -1 for ints, NaN for floats. Catches unwritten outputs.
  cudaError_t poison() { return count_ ? cudaMemset(ptr_, 0xFF, bytes()) : cudaSuccess; }
  cudaError_t upload(const std::vector<T>& h) {
    return cudaMemcpy(ptr_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> download() const {
    std::vector<T> h(count_);
    if (count_) {
      cudaError_t e = cudaMemcpy(h.data(), ptr_, bytes(), cudaMemcpyDeviceToHost);
      if (e != cudaSuccess) {
        std::fprintf(stderr, "cudaMemcpy D2H failed: %s\n", cudaGetErrorString(e));
        std::abort();
      }
    }
    return h;
  }

 private:
  void* ptr_ = nullptr;
  size_t count_ = 0;
};

}  // namespace smoe_test
