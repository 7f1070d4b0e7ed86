// Engine instantiation: varlen-K weight gradient, P gathered (cp.async), Q contiguous (TMA): dW2, BN = 256 (one kernel configuration per file keeps compiles short).
#include "engine/gemm_launch.cuh"

namespace smoe {
namespace engine {
namespace inst {
template <>
Status dw_gather_p<256>(const VarlenKArgs& a, int sms, cudaStream_t s) {
  return run_varlen_k<TileConfig<256, 4, GMMA::Major::MN, GMMA::Major::MN>, EpiStore>(a, sms, s, "engine dw_gather_p<256>");
}
}  // namespace inst
}  // namespace engine
}  // namespace smoe
