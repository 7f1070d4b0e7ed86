// Naive fp32 GPU reference of the whole MoE layer (router + SwiGLU experts), forward and backward,
// for the GPU tests. It reproduces the math of the float64 CPU reference (smoe/reference.h,
// layer_forward_ref + layer_backward_ref with BackwardMethod::kChainRule: the PLAIN chain rule
// through Y, not the SonicMoE rewrite) in fp32 on the GPU, fast enough for production shapes
// (T=256, d=7168, n=2048, E=256, K=8 in well under a second on an H200).
//
// Layouts are those of smoe/smoe.h: x [T][d], w_router [E][d], w1 [E][2n][d] (gate/up interleaved
// by row: row 2j = gate unit j, row 2j+1 = up unit j), w2 [E][d][n], dout [T][d]; all bf16.
//
// The routing DECISIONS (which K experts each token uses, in that order) are an input, so the
// reference never disagrees with the library on near-ties. Everything else is recomputed in fp32
// from the bf16 inputs (fp32 accumulation, fp32 intermediates, nothing rounded to bf16):
//   logits[t][e]  = sum_c x[t][c] * w_router[e][c]          (only the K chosen e are needed)
//   scores[t][k]  = softmax over k of logits[t][topk_expert[t*K+k]]   (max subtracted)
//   h = x_t w1_e^T [2n], a_j = silu(h_2j) * h_2j+1 [n], y = a w2_e^T [d]
//   out[t] = sum_k scores[t][k] * y_(t,k)                     (k ascending)
// Backward (dout given):
//   dy = s * dout[t]; ds[t][k] = <dout[t], y_(t,k)>; da = dy w2_e [n];
//   dg = da*u*(sig + silu*(1-sig)), du = da*silu (dh, interleaved like h);
//   dw2_e = sum over the expert's rows of dy^T a  [d][n];  dw1_e = sum of dh^T x_t  [2n][d];
//   dx[t] = sum_k dh_(t,k) w1_e  +  sum_k dlogits[t][e_k] w_router[e_k];
//   dlogits for the chosen k = s_k (ds_k - sum_j ds_j s_j), 0 for the others;
//   dw_router[e] = sum over the tokens t that chose e (t ascending) of dlogits[t][e] x[t].
//
// Determinism: no float atomics. Every output element is owned by one thread that accumulates in
// a fixed order (weight gradients: over the expert's rows in grouped-row order = token order), so
// repeated calls give bitwise-identical results. The per-element accumulation order does not
// depend on the tiling either.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace smoe_test {

// All fp32, device memory, allocated by the caller. Sizes in elements.
struct LayerRefOutputs {
  float* out = nullptr;        // [T][d]        forward output
  float* dx = nullptr;         // [T][d]        experts + router contribution
  float* dw_router = nullptr;  // [E][d]
  float* dw1 = nullptr;        // [E][2n][d]    interleaved like w1
  float* dw2 = nullptr;        // [E][d][n]
  float* scores = nullptr;     // [T][K]        forward routing scores (fp32 softmax)
  float* ds = nullptr;         // [T][K]        dL/dscore
};

// Runs forward and (when dout != nullptr) backward of the MoE layer. All pointers are device
// pointers; topk_expert is [T*K] int32 (expert of entry t*K+k, each in [0, E), distinct within a
// token).
//   * dout == nullptr: forward only; out and scores are written, the other outputs are untouched
//     and may be null.
//   * dout != nullptr: every output is written (all must be non-null).
//   * T == 0: nothing but the weight gradients exists; each non-null one of dw_router, dw1, dw2
//     is set to zero.
// Requirements: 1 <= K <= E <= 65535, d >= 1, n >= 1, T >= 0, T*K <= 2^31-1.
//
// Error handling: the function returns nothing. A bad argument, an invalid topk_expert entry
// (out of range or repeated within a token) or any failing CUDA call prints a message naming it
// to stderr and calls std::abort(): it is test code and a half-done reference must not be
// compared against.
//
// Synchronisation: work is enqueued on `stream`, but the call is BLOCKING: it first copies
// topk_expert to the host (after the work already on `stream`), builds the expert -> rows lists
// there, allocates its temporaries with cudaMalloc, and synchronises `stream` before freeing them
// and returning. The outputs are therefore ready when it returns. Temporary device memory is
// about 4*T*K*(d + 6n) bytes.
void layer_ref_gpu(int64_t T, int d, int n, int E, int K, const __nv_bfloat16* x,
                   const __nv_bfloat16* w_router, const __nv_bfloat16* w1,
                   const __nv_bfloat16* w2, const __nv_bfloat16* dout,
                   const int32_t* topk_expert, const LayerRefOutputs& o, cudaStream_t stream);

}  // namespace smoe_test
