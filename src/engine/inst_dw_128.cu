// Engine instantiation: varlen-K weight gradient, both operands by cp.async (gathered or not), BN = 128 (one kernel configuration per file keeps compiles short).
#include "engine/gemm_launch.cuh"

namespace smoe {
namespace engine {
namespace inst {
template <>
Status dw<128>(const VarlenKArgs& a, int sms, cudaStream_t s) {
  return run_varlen_k<TileConfig<128, 6, GMMA::Major::MN, GMMA::Major::MN>>(a, sms, s, "engine dw<128>");
}
}  // namespace inst
}  // namespace engine
}  // namespace smoe
