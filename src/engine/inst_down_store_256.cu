// Engine instantiation: down-proj, contiguous A by TMA, W2 K-major, store, BN = 256 (one kernel configuration per file keeps compiles short).
#include "engine/gemm_launch.cuh"

namespace smoe {
namespace engine {
namespace inst {
template <>
Status down_store<256>(const VarlenMArgs& a, int sms, cudaStream_t s) {
  return run_varlen_m<VarlenMConfig<256, GMMA::Major::K>, ALoad::kTma, EpiStore>(a, sms, s, "engine down_store<256>");
}
}  // namespace inst
}  // namespace engine
}  // namespace smoe
