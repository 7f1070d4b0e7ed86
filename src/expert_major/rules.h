// The argument rules of the expert-major layer's forward and backward (api.cpp): host arithmetic,
// no CUDA call, so the CPU tests check them on valid arguments too. expert_major_forward /
// _backward (forward.cu, backward.cu) run them first; nothing is enqueued on a rejected call.
#pragma once

#include "smoe/expert_major.h"

namespace smoe {
namespace expert_major {

Status check_forward(const ExpertMajorForwardArgs& a);
Status check_backward(const ExpertMajorBackwardArgs& a);

}  // namespace expert_major
}  // namespace smoe
