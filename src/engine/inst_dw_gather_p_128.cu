// Engine instantiation: varlen-K weight gradient, P gathered (cp.async), Q contiguous (TMA): dW2, BN = 128 (one kernel configuration per file keeps compiles short).
#include "engine/gemm_launch.cuh"

namespace smoe {
namespace engine {
namespace inst {
template <>
Status dw_gather_p<128>(const VarlenKArgs& a, int sms, cudaStream_t s) {
  return run_varlen_k<TileConfig<128, 6, GMMA::Major::MN, GMMA::Major::MN>, EpiStore>(a, sms, s, "engine dw_gather_p<128>");
}
}  // namespace inst
}  // namespace engine
}  // namespace smoe
