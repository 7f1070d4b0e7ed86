// smoe/smoe.h -- the public C++ API of the smoe library (Hopper MoE training kernels).
//
// Contract for every entry point:
//   * all tensors live in caller-provided device memory; the library never allocates (no
//     cudaMalloc, no caching allocator) and never synchronises the host with the device;
//   * temporaries come from a caller-provided workspace whose size is given by the matching
//     *_workspace_size() query; the workspace must be 256-byte aligned and may be reused freely
//     once the work enqueued on the stream has finished;
//   * all work is enqueued on the caller's stream, in order;
//   * arguments are validated on the host BEFORE anything is enqueued: a bad argument returns a
//     Status whose message names the argument and the rule, and nothing runs;
//   * results are deterministic: the same inputs give bitwise-identical outputs (no float atomics).
//
// Shapes and notation: T tokens, d hidden size, n expert intermediate size, E experts,
// K experts per token (top-K). TK = T*K routed rows.
//
// Layouts (row-major everywhere; the same as the float64 reference in smoe/reference.h):
//   x          [T][d]        bf16
//   w_router   [E][d]        bf16    logits = x w_router^T (fp32 accumulate, fp32 logits)
//   w1         [E][2n][d]    bf16    gate/up INTERLEAVED by row: row 2j = gate unit j,
//                                    row 2j+1 = up unit j. From torchtitan's w1 (gate) and
//                                    w3 (up), each [E][n][d]: w1[e][2j] = w1_tt[e][j],
//                                    w1[e][2j+1] = w3_tt[e][j]. Interleaving puts the gate and up
//                                    value of one unit in the same accumulator fragment of the
//                                    up-projection GEMM, which is what lets SwiGLU and dSwiGLU run
//                                    in the GEMM epilogue.
//   w2         [E][d][n]     bf16    Y = A w2_e^T (torchtitan's w2 layout)
//   out / dout [T][d]        bf16
//   scores     [T][K]        fp32    softmax over the K chosen logits
//   topk_expert[T][K]        int32   chosen experts, descending logit, ties -> lower index
//   Gradients have the layout and dtype of what they differentiate.
//
// Routing metadata (int32; row counts are limited to TK <= 2^31-1, element offsets inside the
// kernels are 64-bit so T*K*d may exceed 2^31):
//   expert_frequency   [E]    rows routed to each expert
//   expert_offset      [E+1]  exclusive prefix sum; rows of expert e are [off[e], off[e+1])
//   scatter_idx        [TK]   grouped row -> flat entry t*K+k (stable: by expert, then entry)
//   reverse_scatter_idx[TK]   flat entry t*K+k -> grouped row (the inverse permutation)
//   gather_idx         [TK]   grouped row -> token (scatter_idx / K)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace smoe {

using bf16 = __nv_bfloat16;

// ------------------------------------------------------------------------------------------------
// Errors
// ------------------------------------------------------------------------------------------------
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,    // a shape, count or pointer breaks a documented rule
  kMisalignedPointer,  // a pointer is not aligned as documented
  kWorkspaceTooSmall,  // workspace_bytes < the matching *_workspace_size()
  kNotImplemented,     // declared entry point of a later milestone
  kCudaError,          // a CUDA launch or call failed (message has cudaGetErrorString)
};

struct Status {
  StatusCode code = StatusCode::kOk;
  std::string message;  // empty when ok; otherwise names the argument and the rule
  bool ok() const { return code == StatusCode::kOk; }
};

const char* status_code_name(StatusCode code);

// Limits of this version.
constexpr int kMaxExperts = 512;
constexpr int kMaxTopK = 16;
constexpr size_t kWorkspaceAlignment = 256;

// ------------------------------------------------------------------------------------------------
// Device-side status: numerical problems found by kernels, recorded without a host sync.
// The record is STICKY: kernels only ever add to it, so a caller can check it once per step (or
// once per N steps) with an asynchronous copy instead of synchronising after every layer.
// ------------------------------------------------------------------------------------------------
enum DeviceStatusFlag : uint32_t {
  kStatusNonFiniteLogits = 1u << 0,    // a token had a NaN or +-Inf router logit
  kStatusInvalidExpertId = 1u << 1,    // provided routing: an id outside [-1, E) (slot dropped)
  kStatusDuplicateExpert = 1u << 2,    // provided routing: a token listed an expert twice (later
                                       // slot dropped)
  kStatusNonFiniteScores = 1u << 3,    // provided routing: a NaN or +-Inf score
  kStatusBadSavedState = 1u << 4,      // backward: `saved` was not written by moe_forward for this
                                       // shape (every gradient is NaN, no saved index was read)
};

struct DeviceStatus {
  uint32_t flags;                  // OR of DeviceStatusFlag
  uint32_t nonfinite_tokens;       // tokens with at least one non-finite logit (mod 2^32)
  int64_t first_nonfinite_token;   // smallest such token index, INT64_MAX when none
};

// Enqueue the reset of a DeviceStatus (flags 0, count 0, first = INT64_MAX).
Status reset_device_status(DeviceStatus* status, cudaStream_t stream);

// ------------------------------------------------------------------------------------------------
// Routing: top-K softmax and routing metadata (implemented).
// ------------------------------------------------------------------------------------------------
enum class DType : int { kFloat32, kBFloat16 };

struct RoutingProblem {
  int64_t num_tokens = 0;  // T >= 0 (T = 0 is valid and writes only the per-expert arrays)
  int num_experts = 0;     // 1 <= E <= kMaxExperts
  int top_k = 0;           // 1 <= K <= min(E, kMaxTopK); T*K <= 2^31-1
  DType logits_dtype = DType::kFloat32;
};

// Outputs, all device pointers, 4-byte aligned (status: 8-byte aligned).
struct RoutingOutputs {
  float* scores = nullptr;                // [T*K]
  int32_t* topk_expert = nullptr;         // [T*K]
  int32_t* expert_frequency = nullptr;    // [E]
  int32_t* expert_offset = nullptr;       // [E+1]
  int32_t* scatter_idx = nullptr;         // [T*K]
  int32_t* reverse_scatter_idx = nullptr; // [T*K]
  int32_t* gather_idx = nullptr;          // [T*K]
  DeviceStatus* status = nullptr;         // sticky numerical status (see above)
  int32_t* token_offset = nullptr;        // optional [T+1]: entries of token t are
                                          // [token_offset[t], token_offset[t+1]) = [tK, tK+K)
};

// Host-side validation only (no CUDA calls). Returns ok or the first broken rule.
Status routing_can_implement(const RoutingProblem& problem);
// Workspace bytes of topk_routing (and provided_routing); 0 for an invalid problem (T*K = 0 also
// needs 0 bytes): the overload below tells the two apart. Host arithmetic only, no CUDA call.
size_t routing_workspace_size(const RoutingProblem& problem);
// The same with the reason: routing_can_implement's error. *bytes is set only on ok.
Status routing_workspace_size(const RoutingProblem& problem, size_t* bytes);

// logits: [T][E] device array of problem.logits_dtype (fp32: 4-byte aligned, bf16: 2-byte).
// Top-K over logits (ties go to the lower expert index), softmax over the K chosen, then the
// metadata. A token with a NaN or Inf logit is recorded in outputs.status; NaN ranks below every
// number. Enqueues a handful of kernels on `stream`; no host sync, no allocation.
Status topk_routing(const RoutingProblem& problem, const void* logits,
                    const RoutingOutputs& outputs, void* workspace, size_t workspace_bytes,
                    cudaStream_t stream);

// Caller-provided routing: the caller chose the experts and their scores with any router (sigmoid
// with a selection bias, group-limited top-K, expert choice, ...). expert [T][K] int32 holds up to K
// experts per token, -1 for an empty slot (so the number of experts per token may vary); scores
// [T][K] fp32 (ignored for empty slots). Entries are the slots: entry t*K+k. Outputs as for
// topk_routing, with: scores = the given scores (0 in empty slots), topk_expert = the ids actually
// used (-1 for empty or rejected slots), expert_offset[E] = the number of non-empty slots (nnz),
// grouped rows >= nnz are unused (their scatter_idx points at the empty slots, gather_idx 0) and
// reverse_scatter_idx of an empty slot is -1. Ids are data on the device, so they are checked there
// without a host sync: an id outside [-1, E) or a repeated id within a token drops that slot and sets
// kStatusInvalidExpertId / kStatusDuplicateExpert in outputs.status (a non-finite score sets
// kStatusNonFiniteScores and is kept). problem.logits_dtype is ignored.
Status provided_routing(const RoutingProblem& problem, const int32_t* expert, const float* scores,
                        const RoutingOutputs& outputs, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream);
// The same workspace as topk_routing: routing_workspace_size(problem).

// ------------------------------------------------------------------------------------------------
// Token rounding (SonicMoE's TR) on the GPU: top-K softmax, then each expert's token count rounded
// to a multiple of m_tile (the GEMM engine's M tile: moe_token_rounding_tile()), padding an expert
// with the best non-chosen tokens by softmax score or dropping its worst chosen ones. Exactly the
// float64 reference ref::token_rounding_ref (smoe/reference.h), with fp32 scores.
// ------------------------------------------------------------------------------------------------
enum class TokenRoundingMode : int {
  kNearest = 0,  // NR-f: nearest multiple, exactly half a tile rounds down
  kUp,           // ceil
  kDown,         // floor (never adds a row)
  kStochastic,   // SR-f: up with probability (f mod m) / m, counter-based draw from (seed, expert)
};

struct TokenRoundingProblem {
  int64_t num_tokens = 0;  // T >= 0
  int num_experts = 0;     // 1 <= E <= kMaxExperts
  int top_k = 0;           // 1 <= K <= min(E, kMaxTopK)
  int m_tile = 128;        // >= 1
  TokenRoundingMode mode = TokenRoundingMode::kNearest;
  uint64_t seed = 0;       // kStochastic only
  DType logits_dtype = DType::kFloat32;
};

// Entries are token-major (entries of token t: [token_offset[t], token_offset[t+1]), ascending
// expert); their number nnz = token_offset[T] = expert_offset[E] is known only on the device and is
// at most token_rounding_capacity(problem) = min(T*E, T*K + E*(m_tile-1)) (T*K for kDown). Arrays
// marked [cap] are written up to nnz and the rest set to the "unused" values below.
struct TokenRoundingOutputs {
  float* scores = nullptr;               // [cap] by entry: the top-K score of a chosen token, the
                                         // softmax-over-E score of a padded one
  int32_t* entry_expert = nullptr;       // [cap] by entry (-1 past nnz)
  int32_t* token_offset = nullptr;       // [T+1]
  int32_t* topk_expert = nullptr;        // [T*K] the plain top-K choice (the router backward needs it)
  float* topk_score = nullptr;           // [T*K] its softmax over the K chosen
  int32_t* expert_frequency = nullptr;   // [E]   rounded counts
  int32_t* expert_offset = nullptr;      // [E+1]
  int32_t* scatter_idx = nullptr;        // [cap] grouped row -> entry (-1 past nnz)
  int32_t* reverse_scatter_idx = nullptr;// [cap] entry -> grouped row (-1 past nnz)
  int32_t* gather_idx = nullptr;         // [cap] grouped row -> token (0 past nnz)
  DeviceStatus* status = nullptr;        // NaN/Inf logits as for topk_routing
};

Status token_rounding_can_implement(const TokenRoundingProblem& problem);
int64_t token_rounding_capacity(const TokenRoundingProblem& problem);  // 0 for an invalid problem
Status token_rounding_workspace_size(const TokenRoundingProblem& problem, size_t* bytes);
// No host sync, no allocation, deterministic (kStochastic included, for a given seed).
Status token_rounding_routing(const TokenRoundingProblem& problem, const void* logits,
                              const TokenRoundingOutputs& outputs, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream);

// ------------------------------------------------------------------------------------------------
// The MoE layer: router (fp32 logits through cuBLAS), top-K routing, SwiGLU experts, aggregation;
// backward by SonicMoE's rewrite (no Y, no dY). A cuBLAS handle per device and host thread is
// created by moe_init() or on first use (one-time); its workspace is carved from the caller's
// workspace. Inside CUDA-graph capture no handle can be created: call moe_init() on the capturing
// thread and device first (a call during capture without it fails with a message saying so).
// Requirements (moe_can_implement): d and n multiples of 64; E, K, T as for routing; x, weights,
// out, dout, gradients 16-byte aligned; workspace 256-byte aligned.
// ------------------------------------------------------------------------------------------------
// How the layer routes. The choice changes the saved-state and workspace sizes (token rounding can
// add rows), so it is part of the shape.
enum class MoERouter : int {
  kTopKSoftmax = 0,  // logits = x W_r^T (fp32), top-K, softmax over the K chosen (Mixtral, Qwen3)
  kTokenRounding,    // the same top-K, then token rounding (SonicMoE TR) with the engine's M tile
                     // (moe_token_rounding_tile); padded tokens get their softmax-over-E score and
                     // their gradient flows to the logits through that softmax
  kProvided,         // the caller routes (any router, in any framework): MoEForwardArgs.routed_expert
                     // [T][K] (-1 = empty slot) and routed_scores [T][K]; backward returns dL/dscores
                     // in MoEBackwardArgs.dscores and no router gradient (w_router is not used)
};

struct MoEShape {
  int64_t T = 0;
  int d = 0;  // multiple of the GEMM alignment (see moe_can_implement)
  int n = 0;
  int E = 0;
  int K = 0;  // top-K; for kProvided the slots per token (the most experts one token may use)
  MoERouter router = MoERouter::kTopKSoftmax;
  TokenRoundingMode rounding = TokenRoundingMode::kNearest;  // kTokenRounding only
};

// The M tile token rounding rounds to: the grouped GEMM engine's row tile (128 on Hopper).
int moe_token_rounding_tile(const MoEShape& shape);
// Grouped rows the layer's buffers are sized for: T*K, or for kTokenRounding the worst case
// token_rounding_capacity (the actual count is known only on the device). 0 for an invalid shape.
int64_t moe_row_capacity(const MoEShape& shape);

// The first projection either interleaved (w1 [E][2n][d], row 2j gate j, row 2j+1 up j; w3 null)
// or, as torchtitan stores it, as two tensors: w1 = gate [E][n][d], w3 = up [E][n][d]. The saved
// state records which (a backward with the other layout is a bad saved state), and with w3 the
// backward writes dw1 (gate) and dw3 (up) [E][n][d] each.
struct MoEWeights {
  const bf16* w_router = nullptr;  // [E][d]
  const bf16* w1 = nullptr;        // [E][2n][d] interleaved gate/up, or gate [E][n][d] with w3
  const bf16* w2 = nullptr;        // [E][d][n]
  const bf16* w3 = nullptr;        // optional: up [E][n][d] (gate/up as two tensors)
};

// What forward keeps for backward lives in one caller buffer of saved_state_size(shape) bytes. It
// starts with a 256-byte stamp (magic, shape, size) that forward clears first and writes last;
// backward checks it on the device before it reads any saved index: a buffer forward did not
// complete for this shape makes every gradient NaN and sets kStatusBadSavedState (in
// MoEBackwardArgs::status, when given), never an out-of-range read. The rest of the buffer:
// H [TK][2n] bf16 (pre-activation), scores, topk experts and the routing metadata: about
// 4*T*K*n + O(T*K) bytes. Nothing of size O(T*K*d) is kept; x is the caller's own tensor.
// The size queries are host arithmetic on the shape alone: no device is queried, so they give the
// same bytes on any machine, with or without a GPU; they return 0 only for a shape
// moe_can_implement rejects. With R = moe_row_capacity(shape), each region rounded up to 256 bytes,
// the backward workspace is: 32 MiB cuBLAS workspace (not for kProvided), dH [R][2n] bf16 (not with
// consume_saved: it is written over H), A' [R][n] bf16 and the dS partials [R][ceil(n/128)] fp32
// sharing their bytes with dX~ [R][d] bf16 (dead before it is written); dS [R] fp32, dlogits [T][E] bf16
// and dW_r [E][d] fp32 unless kProvided; dl [T*K] fp32 for kTopKSoftmax; the recomputed logits
// [T][E] and dx_router [T][d] fp32 for kTokenRounding; a 4-byte flag and expert_offset [E+1].
// Prepares the current device for layer calls from this host thread (the cuBLAS handle) and checks
// that it is a Hopper (sm_90) GPU. Optional, except before the first call inside graph capture.
Status moe_init();

size_t moe_saved_state_size(const MoEShape& shape);
size_t moe_forward_workspace_size(const MoEShape& shape);
// consume_saved: the size for MoEBackwardArgs::consume_saved (R*2n*2 bytes less, rounded as above).
size_t moe_backward_workspace_size(const MoEShape& shape, bool consume_saved = false);
Status moe_can_implement(const MoEShape& shape);

// Where each part of the saved state lives inside the caller's buffer (for inspection, tests and
// custom kernels; the layout is private to this library version).
// R = moe_row_capacity(shape) (T*K unless token rounding). Entries are token-major: entries of token
// t are [token_offset[t], token_offset[t+1]) (= [tK, tK+K) for top-K and provided routing).
struct MoESavedView {
  bf16* h = nullptr;                    // [R][2n] pre-activation, grouped-row order
  float* scores = nullptr;              // [R] by entry
  int32_t* entry_expert = nullptr;      // [R] by entry (-1: empty); == topk_expert unless TR
  int32_t* topk_expert = nullptr;       // [T*K] the top-K choice (provided: the ids used)
  float* topk_score = nullptr;          // [T*K] kTokenRounding only (else null)
  int32_t* token_offset = nullptr;      // [T+1]
  int32_t* expert_frequency = nullptr;  // [E]
  int32_t* expert_offset = nullptr;     // [E+1]
  int32_t* scatter_idx = nullptr;       // [R]
  int32_t* reverse_scatter_idx = nullptr;  // [R]
  int32_t* gather_idx = nullptr;        // [R]
};
MoESavedView moe_saved_state_view(const MoEShape& shape, void* saved);

// Buffers of one call must not alias: every output (forward: out, saved, workspace, status;
// backward: dx, dw_router, dw1, dw2, workspace) is disjoint from every input and from the other
// outputs over the byte ranges the shape (and saved_bytes / workspace_bytes) give them, or the call
// fails with kInvalidArgument naming both, before anything runs.
struct MoEForwardArgs {
  MoEShape shape;
  const bf16* x = nullptr;  // [T][d], must stay unchanged until backward
  MoEWeights weights;
  bf16* out = nullptr;      // [T][d]
  void* saved = nullptr;    // moe_saved_state_size(shape) bytes, kept until backward
  size_t saved_bytes = 0;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  DeviceStatus* status = nullptr;  // sticky numerical status (NaN/Inf router logits), required
  // kProvided only: the caller's routing (read during forward only; the layer keeps a copy).
  const int32_t* routed_expert = nullptr;  // [T][K] int32, -1 = empty slot
  const float* routed_scores = nullptr;    // [T][K] fp32
  uint64_t rounding_seed = 0;              // kTokenRounding with TokenRoundingMode::kStochastic
};

struct MoEBackwardArgs {
  MoEShape shape;
  const bf16* x = nullptr;     // the same x as forward
  MoEWeights weights;
  const bf16* dout = nullptr;  // [T][d]
  const void* saved = nullptr; // written by moe_forward (and by this call with consume_saved)
  size_t saved_bytes = 0;
  // Gradients are OVERWRITTEN, never accumulated: a caller summing micro-batches adds them
  // itself (or passes scratch buffers and adds). An expert that received no token gets zeros.
  bf16* dx = nullptr;          // [T][d]
  bf16* dw_router = nullptr;   // [E][d]
  bf16* dw1 = nullptr;         // [E][2n][d]; gate [E][n][d] when weights.w3 is set
  bf16* dw3 = nullptr;         // up [E][n][d]: required exactly when weights.w3 is set
  bf16* dw2 = nullptr;         // [E][d][n]
  float* dscores = nullptr;    // kProvided only (then required): [T][K] dL/dscore, 0 in empty slots.
                               // With kProvided dw_router is not written and may be null, and dx
                               // holds the expert path only (the caller's router adds its part).
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  DeviceStatus* status = nullptr;  // optional: where a bad saved state is reported (kStatusBadSavedState)
  // true: the call may write the saved buffer (dH [R][2n] over H, which only dA' reads) and clears
  // its stamp right before dA' launches: the saved state is spent, and a later backward on it finds
  // no stamp (NaN gradients and kStatusBadSavedState), never gradients of a clobbered H. A call
  // refused before that (a rule, no instantiation for dA', its launch setup: shared-memory attribute,
  // no cluster fits) leaves the state as it was; one whose dA' launch itself fails (a CUDA error)
  // may leave it spent with H whole. The
  // gradients are bitwise those of consume_saved = false; the workspace is
  // moe_backward_workspace_size(shape, true), H's bytes less: what a caller that runs backward once
  // per forward (PyTorch without retain_graph) saves at the backward's peak. With SMOE_ENGINE_TUNE=1
  // the dA' GEMM is not measured (its output overlaps its input): tune ahead with smoe_tune.
  bool consume_saved = false;
  // Optional: x may still be in flight when the call is enqueued (expert parallelism sends it on
  // another stream). The layer's stream waits for this event before the first kernel that reads x
  // (the router's weight gradient, then dW1); dA' and dW2 run before it.
  cudaEvent_t x_ready = nullptr;
};

Status moe_forward(const MoEForwardArgs& args, cudaStream_t stream);
Status moe_backward(const MoEBackwardArgs& args, cudaStream_t stream);

}  // namespace smoe
