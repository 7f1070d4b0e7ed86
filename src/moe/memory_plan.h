// Memory plan of the MoE layer: the saved state (held between forward and backward) and the
// forward / backward workspaces, all carved from caller buffers by detail::Carver.
//
// Held: H [TK][2n] bf16 + scores, top-K ids, scatter / reverse-scatter / gather indices (TK each)
// + expert frequency / offsets (E, E+1): 4TKn + 20TK + O(E) bytes. x is the caller's.
#pragma once

#include <cstddef>
#include <cstdint>

#include "smoe/smoe.h"

namespace smoe {
namespace plan {

constexpr size_t kCublasWorkspace = size_t{32} << 20;  // cuBLAS' recommendation for Hopper

struct SavedLayout {
  MoESavedView v;
  size_t bytes;
};
SavedLayout saved_layout(const MoEShape& s, void* base);

struct ForwardWs {
  void* cublas;
  float* logits;    // [T][E]
  void* routing;
  size_t routing_bytes;
  bf16* act;        // A = SwiGLU(H) [TK][n]
  bf16* y;          // Y [TK][d]
  size_t total;
};
ForwardWs forward_ws(const MoEShape& s, void* base);

struct BackwardWs {
  void* cublas;
  bf16* a_prime;    // A' = s * A [TK][n]
  bf16* dH;         // [TK][2n]
  bf16* dXt;        // dX~ [TK][d]; before dX~, the gathered dO / x of the CUTLASS dW path
  float* ds_partial;  // [TK][engine::ds_partial_tiles(n)]
  float* dS;        // [TK] by flat (token, k)
  float* dl;        // [TK]
  bf16* dlogits;    // [T][E]
  float* dwr32;     // [E][d]
  void* cutlass;    // the CUTLASS varlen-K workspace (dW path, see dw_path.h)
  size_t cutlass_bytes;
  size_t total;
};
BackwardWs backward_ws(const MoEShape& s, void* base, int sm_count);

}  // namespace plan
}  // namespace smoe
