// Engine instantiation: up-proj, gathered x, W1 K-major, SwiGLU epilogue, BN = 256 (one kernel configuration per file keeps compiles short).
#include "engine/gemm_launch.cuh"

namespace smoe {
namespace engine {
namespace inst {
template <>
Status up_swiglu<256>(const VarlenMArgs& a, int sms, cudaStream_t s) {
  return run_varlen_m<VarlenMConfig<256, GMMA::Major::K>, ALoad::kGather, EpiSwiGLU>(a, sms, s, "engine up_swiglu<256>");
}
}  // namespace inst
}  // namespace engine
}  // namespace smoe
