// Engine instantiation: varlen-K weight gradient, P gathered, Q contiguous, D stored transposed: dW1 (as dH^T x[gather] transposed), BN = 128 (one kernel configuration per file keeps compiles short).
#include "engine/gemm_launch.cuh"

namespace smoe {
namespace engine {
namespace inst {
template <>
Status dw_gather_p_t<128>(const VarlenKArgs& a, int sms, cudaStream_t s) {
  return run_varlen_k<TileConfig<128, 6, GMMA::Major::MN, GMMA::Major::MN>, EpiStoreT>(a, sms, s, "engine dw_gather_p_t<128>");
}
}  // namespace inst
}  // namespace engine
}  // namespace smoe
