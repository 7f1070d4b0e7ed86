// Memory plan of the MoE layer: the saved state (held between forward and backward) and the
// forward / backward workspaces, all carved from caller buffers by detail::Carver.
//
// R = moe_row_capacity(shape) grouped rows (T*K; with token rounding the worst case of its rounded
// counts). Held: H [R][2n] bf16 + scores, scatter / reverse-scatter / gather indices (R each), the
// top-K ids (TK), token offsets (T+1), expert frequency / offsets (E, E+1); token rounding adds the
// entry experts (R) and top-K scores (TK): 4Rn + 16R + 4TK (+8TK) + O(T + E) bytes. x is the caller's.
#pragma once

#include <cstddef>
#include <cstdint>

#include "smoe/smoe.h"

namespace smoe {
namespace plan {

constexpr size_t kCublasWorkspace = size_t{32} << 20;  // cuBLAS' recommendation for Hopper

// The stamp at the start of the saved state (memory_plan.cpp): forward clears it first and writes it
// last, backward checks it before reading any saved index.
struct SavedStamp {
  uint64_t magic;       // kSavedMagic
  uint64_t shape_hash;  // saved_shape_hash(shape)
  uint64_t bytes;       // moe_saved_state_size(shape)
  uint64_t reserved;
};
constexpr uint64_t kSavedMagic = 0x45564153656f6d73ull;  // "smoeSAVE"
// two_tensor: gate/up as two tensors (MoEWeights::w3), whose H is stored in the halves layout.
uint64_t saved_shape_hash(const MoEShape& s, bool two_tensor);

struct SavedLayout {
  SavedStamp* stamp;
  MoESavedView v;
  size_t bytes;
};
SavedLayout saved_layout(const MoEShape& s, void* base);

// The token-rounding problem of a kTokenRounding shape (the engine's row tile, the shape's mode).
TokenRoundingProblem rounding_problem(const MoEShape& s, uint64_t seed);
bool uses_router(const MoEShape& s);  // false for kProvided: no router GEMM, no router gradient

struct ForwardWs {
  void* cublas;     // null without a router
  float* logits;    // [T][E]; null without a router
  void* routing;
  size_t routing_bytes;
  bf16* act;        // A = SwiGLU(H) [R][n]
  bf16* y;          // Y [R][d]
  size_t total;
};
ForwardWs forward_ws(const MoEShape& s, void* base);

struct BackwardWs {
  void* cublas;       // null without a router
  bf16* a_prime;      // A' = s * A [R][n]
  bf16* dH;           // [R][2n]; null with consume_saved
  bf16* dXt;          // dX~ [R][d]
  float* ds_partial;  // [R][engine::ds_partial_tiles(n)]
  float* dS;          // [R] by entry; null for kProvided (the caller's dscores takes it)
  float* dl;          // [TK] top-K router only
  bf16* dlogits;      // [T][E] (null without a router)
  float* dwr32;       // [E][d] (null without a router)
  float* logits;      // [T][E] token rounding: the logits recomputed for the softmax over E
  float* dx_router;   // [T][d] token rounding: dlogits W_r (dense: padded scores touch every logit)
  int32_t* valid;          // 1 when the saved stamp matched (check_saved), else 0
  int32_t* expert_offset;  // [E+1] the saved expert_offset, or zeros when the stamp did not match
  size_t total;
};
// Host arithmetic on the shape only (no device query): moe_backward_workspace_size is w.total.
// consume_saved: no dH (the backward writes it over the saved H), dH = nullptr.
BackwardWs backward_ws(const MoEShape& s, void* base, bool consume_saved = false);

}  // namespace plan
}  // namespace smoe
