// Engine instantiation: dA', gathered dO, W2 MN-major, dSwiGLU + dS epilogue, BN = 128 (one kernel configuration per file keeps compiles short).
#include "engine/gemm_launch.cuh"

namespace smoe {
namespace engine {
namespace inst {
template <>
Status da_dswiglu<128>(const VarlenMArgs& a, int sms, cudaStream_t s) {
  return run_varlen_m<VarlenMConfig<128, GMMA::Major::MN>, ALoad::kGather, EpiDSwiGLU>(a, sms, s, "engine da_dswiglu<128>");
}
}  // namespace inst
}  // namespace engine
}  // namespace smoe
