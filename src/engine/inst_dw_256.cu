// Engine instantiation: varlen-K weight gradient, both operands by cp.async (gathered or not), BN = 256 (one kernel configuration per file keeps compiles short).
#include "engine/gemm_launch.cuh"

namespace smoe {
namespace engine {
namespace inst {
template <>
Status dw<256>(const VarlenKArgs& a, int sms, cudaStream_t s) {
  return run_varlen_k<TileConfig<256, 4, GMMA::Major::MN, GMMA::Major::MN>>(a, sms, s, "engine dw<256>");
}
}  // namespace inst
}  // namespace engine
}  // namespace smoe
