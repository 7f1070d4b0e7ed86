// The one sticky per-device status record of smoe_torch._C (common.h).
#include "common.h"

#include <ATen/cuda/CUDAContext.h>

#include <mutex>
#include <vector>

namespace smoe_torch {

smoe::DeviceStatus* device_status(const at::Tensor& like) {
  static std::mutex mu;
  static std::vector<at::Tensor> per_device(64);
  std::lock_guard<std::mutex> lock(mu);
  const int dev = like.get_device();
  TORCH_CHECK(dev >= 0 && dev < 64, "smoe: device index ", num(dev), " out of range [0, 64)");
  if (!per_device[dev].defined()) {
    per_device[dev] = at::empty({static_cast<int64_t>(sizeof(smoe::DeviceStatus))}, like.options().dtype(at::kByte));
    throw_if(smoe::reset_device_status(reinterpret_cast<smoe::DeviceStatus*>(per_device[dev].data_ptr()),
                                       at::cuda::getCurrentCUDAStream()));
  }
  return reinterpret_cast<smoe::DeviceStatus*>(per_device[dev].data_ptr());
}

}  // namespace smoe_torch
