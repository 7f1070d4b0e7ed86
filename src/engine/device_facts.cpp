// The device facts the heuristic reads (heuristic.h): SMs from the caller, HBM bandwidth from the
// device's attributes, queried once per device.
#include <atomic>

#include <cuda_runtime_api.h>

#include "engine/heuristic.h"

namespace smoe {
namespace engine {

int hbm_gbps_of(int memory_clock_khz, int bus_width_bits) {
  if (memory_clock_khz <= 0 || bus_width_bits <= 0) return 0;
  // Double data rate: 2 transfers per clock of bus_width / 8 bytes. H100 SXM: 2619 MHz x 5120 bits
  // = 3352 GB/s; H200: 3201 MHz x 6144 bits = 4917 GB/s (the datasheets' 3.35 and 4.8 TB/s).
  return static_cast<int>(2.0 * memory_clock_khz * 1e3 * (bus_width_bits / 8) / 1e9 + 0.5);
}

DeviceFacts device_facts(int sm_count) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];  // GB/s + 1 (0: not queried yet)
  DeviceFacts f{sm_count, 0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();  // unknown bandwidth: the default rules, as a CPU-only caller gets
    return f;
  }
  if (dev >= 0 && dev < kMaxDevices) {
    const int c = cache[dev].load(std::memory_order_relaxed);
    if (c > 0) {
      f.hbm_gbps = c - 1;
      return f;
    }
  }
  int clock = 0, width = 0;
  if (cudaDeviceGetAttribute(&clock, cudaDevAttrMemoryClockRate, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&width, cudaDevAttrGlobalMemoryBusWidth, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    clock = width = 0;
  }
  f.hbm_gbps = hbm_gbps_of(clock, width);
  // Only an answer is cached: a failed query is asked again on the next call.
  if (f.hbm_gbps > 0 && dev >= 0 && dev < kMaxDevices) cache[dev].store(f.hbm_gbps + 1, std::memory_order_relaxed);
  return f;
}

}  // namespace engine
}  // namespace smoe
