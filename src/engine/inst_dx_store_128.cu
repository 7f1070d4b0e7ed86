// Engine instantiation: dX~, contiguous dH by TMA, W1 MN-major, store, BN = 128 (one kernel configuration per file keeps compiles short).
#include "engine/gemm_launch.cuh"

namespace smoe {
namespace engine {
namespace inst {
template <>
Status dx_store<128>(const VarlenMArgs& a, int sms, cudaStream_t s) {
  return run_varlen_m<VarlenMConfig<128, GMMA::Major::MN>, ALoad::kTma, EpiStore>(a, sms, s, "engine dx_store<128>");
}
}  // namespace inst
}  // namespace engine
}  // namespace smoe
