#include "smoe/smoe.h"

namespace smoe {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kMisalignedPointer: return "misaligned pointer";
    case StatusCode::kWorkspaceTooSmall: return "workspace too small";
    case StatusCode::kNotImplemented: return "not implemented";
    case StatusCode::kCudaError: return "CUDA error";
  }
  return "unknown";
}

}  // namespace smoe
