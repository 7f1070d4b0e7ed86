// Grouped GEMM instantiation "tt": varlen-K weight gradients: A = P^T (column-major), B = Q (row-major).
// One CUTLASS configuration per file keeps compile time and memory in check.
#include "gemm/grouped_gemm_impl.cuh"

namespace smoe {
namespace gemm {
namespace {
using G = impl::GroupedGemm<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor,
                            cute::Shape<cute::_128, cute::_128, cute::_64>,
                            cute::Shape<cute::_1, cute::_1, cute::_1>>;
}  // namespace

namespace inst {
size_t tt_workspace_size(int groups, int sm_count) { return G::workspace_size(groups, sm_count); }
Status tt_run(const VarlenKArgs& a, void* ws, size_t ws_bytes, int sm_count, cudaStream_t s) {
  return impl::run_varlen_k<G>(a, ws, ws_bytes, sm_count, s);
}
}  // namespace inst

}  // namespace gemm
}  // namespace smoe
