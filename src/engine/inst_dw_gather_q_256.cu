// Engine instantiation: varlen-K weight gradient, Q gathered (cp.async), P contiguous (TMA): dW1, BN = 256 (one kernel configuration per file keeps compiles short).
#include "engine/gemm_launch.cuh"

namespace smoe {
namespace engine {
namespace inst {
template <>
Status dw_gather_q<256>(const VarlenKArgs& a, int sms, cudaStream_t s) {
  return run_varlen_k<TileConfig<256, 4, GMMA::Major::MN, GMMA::Major::MN>, true>(a, sms, s, "engine dw_gather_q<256>");
}
}  // namespace inst
}  // namespace engine
}  // namespace smoe
