// Dispatch and validation of the CUTLASS varlen-K grouped GEMM (see grouped_gemm.h).
#include "common/check.h"
#include "gemm/grouped_gemm.h"

namespace smoe {
namespace gemm {

namespace impl {
__global__ void zero_empty_experts(int E, int64_t per_expert, const int32_t* __restrict__ off,
                                   bf16* D) {
  const int e = blockIdx.y;
  if (off[e + 1] != off[e]) return;
  uint4* p = reinterpret_cast<uint4*>(D + static_cast<int64_t>(e) * per_expert);
  const int64_t n16 = per_expert / 8;  // per_expert is a multiple of 8 (16-byte rows)
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n16;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = make_uint4(0, 0, 0, 0);
}
}  // namespace impl

namespace {
Status check_dims(const char* fn, const char* name, int v) {
  if (v <= 0 || v % 8 != 0)
    return ::smoe::detail::make_status(StatusCode::kInvalidArgument,
                               ::smoe::detail::concat(fn, ": ", name, " = ", v,
                                              " must be a positive multiple of 8 (16-byte bf16 rows)"));
  return Status{};
}
}  // namespace

size_t varlen_k_workspace_size(int E, int sm_count) { return inst::tt_workspace_size(E, sm_count); }

Status varlen_k_gemm(const VarlenKArgs& a, void* ws, size_t ws_bytes, int sm_count,
                     cudaStream_t stream) {
  const char* fn = "varlen_k_gemm";
  SMOE_RETURN_IF_ERROR(check_dims(fn, "M", a.M));
  SMOE_RETURN_IF_ERROR(check_dims(fn, "N", a.N));
  if (a.ld_p != 0 && (a.ld_p < a.M || a.ld_p % 8 != 0))
    return ::smoe::detail::make_status(StatusCode::kInvalidArgument,
                                       ::smoe::detail::concat(fn, ": ld_p = ", a.ld_p, " must be 0 or >= M and a multiple of 8"));
  if (a.num_experts < 1)
    return ::smoe::detail::make_status(StatusCode::kInvalidArgument, "varlen_k_gemm: num_experts must be >= 1");
  SMOE_RETURN_IF_ERROR(::smoe::detail::check_ptr(a.expert_offset, fn, "expert_offset", 4));
  SMOE_RETURN_IF_ERROR(::smoe::detail::check_ptr(a.P, fn, "P", 16));
  SMOE_RETURN_IF_ERROR(::smoe::detail::check_ptr(a.Q, fn, "Q", 16));
  SMOE_RETURN_IF_ERROR(::smoe::detail::check_ptr(a.D, fn, "D", 16));
  SMOE_RETURN_IF_ERROR(::smoe::detail::check_ptr(ws, fn, "workspace", kWorkspaceAlignment));
  return inst::tt_run(a, ws, ws_bytes, sm_count, stream);
}

}  // namespace gemm
}  // namespace smoe
