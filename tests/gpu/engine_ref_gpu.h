// Reference twins of the engine's GEMMs (src/engine/engine.h): same argument structs, same
// semantics, naive fp32 on the GPU (one thread per output element, k ascending), no rounding of
// the GEMM result to bf16. The tests derive every epilogue's expected output from these in
// float64 on the host. The twins are themselves checked against a float64 host product on
// sampled elements (test_engine_gpu.cu, TwinAgainstHost).
#pragma once

#include <cuda_runtime_api.h>

#include "engine/engine.h"

namespace smoe_test {

// D[r][c] = sum_k A[src(r)][k] * B_e(c, k) for every grouped row r: D is [rows][N] fp32.
// (Ignores a.epilogue and the output pointers of a.)
void varlen_m_ref(const smoe::engine::VarlenMArgs& a, float* D, cudaStream_t stream);
// D_e[m][c] = sum over rows r of e of P[srcP(r)][m] * Q[srcQ(r)][c]: D is [E][M][N] fp32.
void varlen_k_ref(const smoe::engine::VarlenKArgs& a, float* D, cudaStream_t stream);

}  // namespace smoe_test
