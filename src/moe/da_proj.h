// dA' in a backward that may consume the saved state (consume_saved of MoEBackwardArgs and of the
// expert-major backward): dH goes over H, so the saved state is spent (its stamp cleared) before dA'
// launches. The order below is the contract: prepare (the rules, the instance, the launch's host
// setup), then spend, then launch. A call the host refuses at any of those steps leaves the state
// whole; only a failed launch itself can leave it spent (with H whole: NaN later, never a wrong
// gradient). Both backwards run dA' through it; tests/cpu/test_engine_api.cpp checks the order.
#pragma once

#include <cuda_runtime_api.h>

#include "common/check.h"
#include "engine/engine.h"

namespace smoe {
namespace layer {

// spend: Status() -> the stamp clear of a consuming call, or nothing (Status{}) otherwise.
template <class Spend>
Status run_da_proj(const engine::VarlenMArgs& da, int sm_count, cudaStream_t stream, Spend&& spend) {
  engine::PreparedVarlenM gemm;
  SMOE_RETURN_IF_ERROR(engine::prepare_varlen_m(da, sm_count, stream, &gemm));
  SMOE_RETURN_IF_ERROR(spend());
  return gemm.launch(da, sm_count, stream);
}

}  // namespace layer
}  // namespace smoe
