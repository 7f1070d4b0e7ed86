// Per-stage timing hook for benchmarks (internal, not part of the public API).
// When a recorder is installed, the layer calls mark(stage) on its stream after each stage; a
// benchmark records a CUDA event there and takes differences. Not thread-safe: install it from
// the benchmark's single thread only. Zero cost when none is installed.
#pragma once

#include <cuda_runtime_api.h>

namespace smoe {
namespace profile {

class Recorder {
 public:
  virtual ~Recorder() = default;
  // Called with the stream the stage was enqueued on, after the stage (stage "begin" first).
  virtual void mark(const char* stage, cudaStream_t stream) = 0;
};

void set_recorder(Recorder* r);
Recorder* recorder();

inline void mark(const char* stage, cudaStream_t stream) {
  if (Recorder* r = recorder()) r->mark(stage, stream);
}

}  // namespace profile
}  // namespace smoe
