// What the bindings of smoe_torch._C (ops.cpp, expert_major_ops.cpp) share: message formatting, the
// Status -> exception rule, byte buffers from the caching allocator, pointer casts, and the one
// sticky per-device status record every forward and backward of both layers reports into.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "smoe/smoe.h"

namespace smoe_torch {

// Numbers and shapes are formatted with std::to_string, never with iostreams: built on the GPU
// machine, this extension crashed formatting an integer through the process's locale (a libstdc++
// mismatch between the build toolchain and the one Python loads).
inline std::string num(int64_t v) { return std::to_string(v); }
inline std::string dims(at::IntArrayRef a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + "]";
}

inline void throw_if(const smoe::Status& s) {
  TORCH_CHECK(s.ok(), "smoe: ", s.message, " [", smoe::status_code_name(s.code), "]");
}

// n bytes (at least 1, so data_ptr is never null) on like's device.
inline at::Tensor bytes(int64_t n, const at::Tensor& like) {
  return at::empty({std::max<int64_t>(n, 1)}, like.options().dtype(at::kByte));
}

inline const smoe::bf16* bf16_ptr(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<const smoe::bf16*>(t.data_ptr()) : nullptr;
}
inline smoe::bf16* bf16_out(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<smoe::bf16*>(t.data_ptr()) : nullptr;
}

// The sticky status record of like's device (common.cpp): created and reset on first use (on the
// current stream), never read on the host by the ops; smoe_torch.nonfinite_status() reads it. One
// record for both layers, so raise_if_nonfinite sees every flag (bad logits, ids, scores, saved
// state, expert-major counts).
smoe::DeviceStatus* device_status(const at::Tensor& like);

}  // namespace smoe_torch
