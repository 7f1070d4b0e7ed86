// smoe/expert_major.h -- the expert-major MoE layer: rows already grouped by expert.
//
// What the dispatchers of the training stacks hand their experts (torchtitan's GroupedExperts under
// its local / all-to-all / DeepEP dispatchers, Megatron-Core's grouped MLP, DeepEP's low-latency
// [local_E][capacity][d] buffers): R rows x [R][d] grouped by expert, per-expert counts on the
// device, optionally per-row probabilities. The layer runs SwiGLU experts on them and returns one
// output row per input row, in the same order. Routing, dispatch and combine are the caller's.
//
// The contract of smoe/smoe.h holds (caller memory, workspace queries, one stream, no allocation, no
// host sync, host validation before anything runs, bitwise-deterministic results), and:
//   * rows of expert e: [row_begin(e), row_begin(e) + counts[e]) where row_begin(e) is
//       contiguous (segment_offset == null): counts[0] + ... + counts[e-1], or
//       segmented (segment_offset given, [E+1]): segment_offset[e]; expert e's segment is
//       [segment_offset[e], segment_offset[e+1]) and counts[e] <= its size.
//     Every other row of [0, R) is PADDING (per-expert alignment, capacity below its limit, trailing
//     rows past the last expert): it costs no GEMM work, its output row and its dx row are zeros,
//     its dprobs entry is 0, it adds nothing to any weight gradient, and x / probs / dout are not read
//     there (they may hold anything, NaN included).
//   * counts and segment_offset are data on the device (no host sync): they are checked there. A
//     negative count, a count past its segment or past R, or a decreasing segment_offset sets
//     kStatusInvalidCounts in the status record and makes every output NaN (never a silent wrong
//     result, never an out-of-range access).
//   * probs (optional, [R] fp32, ExpertMajorShape::probs): out[r] = p[r] * (SwiGLU(x[r] W1_e^T) W2_e^T),
//     with p applied to the activations before the down projection (Megatron-Core's order; the same
//     value as scaling the output), and backward returns dprobs[r] = dL/dp[r] = <dout[r], y[r]>
//     computed from dA' = dout W2_e and A = SwiGLU(H) as SonicMoE does (no y kept).
//   * saved between forward and backward: H [R][2n] and the row maps (4Rn + 16R + O(E) bytes); x (and
//     probs) are the caller's and must stay unchanged until backward, as counts / segment_offset need not (the
//     saved state keeps what it needs of them).
//
// Implementation: the token-major layer's engine calls and memory-bound kernels with one entry per
// row (x gathered through the valid rows, so padding costs no GEMM work); the float64 twin is
// smoe/reference.h, ref::expert_major_forward_ref / _backward_ref (docs/expert_major.md).
#pragma once

#include <cstddef>
#include <cstdint>

#include "smoe/smoe.h"

namespace smoe {

// DeviceStatus flag (smoe/smoe.h, DeviceStatusFlag) of this layer: a count or segment offset out of
// range; every output of that call is NaN.
constexpr uint32_t kStatusInvalidCounts = 1u << 5;

// The first projection's weights, as each stack stores them (no copy per step in any of them).
enum class GateUpLayout : int {
  kInterleaved = 0,  // w1 [E][2n][d]: row 2j = gate unit j, row 2j+1 = up unit j (this library's)
  kSeparate,         // w1 = gate [E][n][d], w3 = up [E][n][d] (torchtitan GroupedExperts w1 / w3)
  kConcatenated,     // w1 [E][2n][d]: rows [0, n) gate, [n, 2n) up (Megatron-Core fc1 per expert,
                     // transformers' stacked gate_up_proj in nn.Linear orientation)
};

struct ExpertMajorShape {
  int64_t rows = 0;  // R: rows of x, out, dout, dx (valid and padding); 0 <= R <= 2^31 - 1
  int d = 0;         // hidden size, multiple of 64
  int n = 0;         // expert intermediate size, multiple of 64
  int E = 0;         // experts (local experts under expert parallelism), 1 <= E <= kMaxExperts
  GateUpLayout gate_up = GateUpLayout::kSeparate;
  bool probs = false;     // per-row probabilities are given (forward) and their gradient returned
  bool segmented = false; // segment_offset is given (capacity / alignment layouts)
};

struct ExpertMajorWeights {
  const bf16* w1 = nullptr;  // [E][2n][d] (kInterleaved, kConcatenated) or gate [E][n][d] (kSeparate)
  const bf16* w3 = nullptr;  // kSeparate only: up [E][n][d]
  const bf16* w2 = nullptr;  // [E][d][n]
};

struct ExpertMajorForwardArgs {
  ExpertMajorShape shape;
  const bf16* x = nullptr;                // [R][d], unchanged until backward
  const int32_t* counts = nullptr;        // [E] valid rows per expert (device)
  const int32_t* segment_offset = nullptr;// [E+1] shape.segmented only (device), else null
  const float* probs = nullptr;           // [R] shape.probs only, else null; unchanged until backward
  ExpertMajorWeights weights;
  bf16* out = nullptr;                    // [R][d]
  void* saved = nullptr;                  // expert_major_saved_state_size(shape) bytes
  size_t saved_bytes = 0;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  DeviceStatus* status = nullptr;         // required: where invalid counts are reported
};

struct ExpertMajorBackwardArgs {
  ExpertMajorShape shape;
  const bf16* x = nullptr;        // the same x as forward
  const float* probs = nullptr;   // the same probs as forward (shape.probs only)
  ExpertMajorWeights weights;
  const bf16* dout = nullptr;     // [R][d]
  const void* saved = nullptr;    // written by expert_major_forward for this shape
  size_t saved_bytes = 0;
  // Gradients are overwritten, never accumulated; an expert without rows gets zeros.
  bf16* dx = nullptr;             // [R][d] (padding rows: zeros)
  bf16* dw1 = nullptr;            // as weights.w1
  bf16* dw3 = nullptr;            // kSeparate only: as weights.w3
  bf16* dw2 = nullptr;            // [E][d][n]
  float* dprobs = nullptr;        // [R] shape.probs only (padding rows: 0)
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  DeviceStatus* status = nullptr; // optional: a bad saved state is reported here
  // true: dH is written over the saved H and the stamp cleared right before dA'; the state is spent (a later
  // backward on it: NaN gradients, kStatusBadSavedState). Bitwise the same gradients, in
  // expert_major_backward_workspace_size(shape, true) bytes: R x 2n bf16 fewer (MoEBackwardArgs::consume_saved).
  bool consume_saved = false;
};

// Host arithmetic only (no CUDA call, no device needed). 0 for a shape can_implement rejects.
Status expert_major_can_implement(const ExpertMajorShape& shape);
size_t expert_major_saved_state_size(const ExpertMajorShape& shape);
size_t expert_major_forward_workspace_size(const ExpertMajorShape& shape);
size_t expert_major_backward_workspace_size(const ExpertMajorShape& shape, bool consume_saved = false);

Status expert_major_forward(const ExpertMajorForwardArgs& args, cudaStream_t stream);
Status expert_major_backward(const ExpertMajorBackwardArgs& args, cudaStream_t stream);

}  // namespace smoe
