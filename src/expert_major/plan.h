// Memory plan of the expert-major layer (smoe/expert_major.h): the saved state and the workspaces,
// carved from caller buffers by detail::Carver. Host arithmetic on the shape only.
//   saved:     stamp, H [R][2n] bf16, the checked row ranges (begin / count [E] int32 each)
//   forward:   A = p * SwiGLU(H) [R][n] bf16 (the down-projection's input), the counts check flag
//   backward:  A' [R][n], dH [R][2n] bf16, dS partials [R][ds_partial_tiles(n)] fp32, the identity
//              row -> entry map [R] int32 (the dSwiGLU epilogue reads probs through it), and
//              without probs the dS row sums [R] fp32 (computed, not returned) and ones [R] fp32
// Held between forward and backward: 4Rn + O(E) bytes (+ the caller's x and probs).
#pragma once

#include <cstddef>
#include <cstdint>

#include "moe/memory_plan.h"  // SavedStamp
#include "smoe/expert_major.h"

namespace smoe {
namespace expert_major {

struct SavedLayout {
  plan::SavedStamp* stamp;
  bf16* h;              // [R][2n]
  int32_t* row_begin;   // [E] first row of each expert (validated on the device)
  int32_t* row_count;   // [E]
  size_t bytes;
};
SavedLayout saved_layout(const ExpertMajorShape& s, void* base);

struct ForwardWs {
  bf16* act;       // [R][n]
  int32_t* valid;  // 1 when counts / segment_offset passed the device check
  size_t total;
};
ForwardWs forward_ws(const ExpertMajorShape& s, void* base);

struct BackwardWs {
  bf16* a_prime;      // [R][n]
  bf16* dH;           // [R][2n]
  float* ds_partial;  // [R][ds_partial_tiles(n)]
  int32_t* identity;  // [R] row r -> r
  float* dprobs;      // [R] without probs only (else the caller's dprobs)
  float* ones;        // [R] without probs only
  int32_t* valid;
  size_t total;
};
BackwardWs backward_ws(const ExpertMajorShape& s, void* base);

uint64_t saved_shape_hash(const ExpertMajorShape& s);

}  // namespace expert_major
}  // namespace smoe
