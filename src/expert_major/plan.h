// Memory plan of the expert-major layer (smoe/expert_major.h): the saved state and the workspaces,
// carved from caller buffers by detail::Carver. Host arithmetic on the shape only.
//
// The layer runs the token-major layer's engine calls and memory-bound kernels with one entry per
// row (K = 1): entry r = row r, its score = p[r] (1 without probs, 0 on padding), and the valid rows
// in expert order are the "grouped rows" [0, nnz) of the engine (nnz = expert_offset[E]).
//   saved:     stamp, H [R][2n] bf16 (grouped-row order), expert_offset [E+1] (prefix of the counts),
//              row_of [R] (grouped row -> row for [0, nnz), then the padding rows in row order: the
//              gather index of the GEMMs and the scatter of the dS row sums, which zero padding
//              dprobs), slot_of [R] (row -> grouped row, -1 on padding), scores [R] fp32,
//              row_offset [R+1] (r: entries [r, r+1) of the aggregation and dx sum)
//   forward:   A = SwiGLU(H) [R][n], Y [R][d] bf16, the counts check flag, row begins [E]
//   backward:  dH [R][2n] bf16 (not with consume_saved: written over the saved H), A' [R][n] bf16 and
//              the dS partials [R][ds_partial_tiles(n)] fp32 sharing their bytes with dX~ [R][d] bf16
//              (dead before it is written), without probs the dS row sums [R] fp32 (computed, not
//              returned), the stamp check flag and its expert_offset copy [E+1]
// Held between forward and backward: 4Rn + 16R + O(E) bytes (+ the caller's x and probs).
#pragma once

#include <cstddef>
#include <cstdint>

#include "moe/memory_plan.h"  // SavedStamp
#include "smoe/expert_major.h"

namespace smoe {
namespace expert_major {

constexpr uint64_t kSavedMagic = 0x454d41536f656d73ull;  // "smoeSAME"

struct SavedLayout {
  plan::SavedStamp* stamp;
  bf16* h;                 // [R][2n]
  int32_t* expert_offset;  // [E+1]
  int32_t* row_of;         // [R]
  int32_t* slot_of;        // [R]
  float* scores;           // [R]
  int32_t* row_offset;     // [R+1]
  size_t bytes;
};
SavedLayout saved_layout(const ExpertMajorShape& s, void* base);

struct ForwardWs {
  bf16* act;          // [R][n]
  bf16* y;            // [R][d]
  int32_t* valid;     // 1 when counts / segment_offset passed the device check
  int32_t* row_begin; // [E]
  size_t total;
};
ForwardWs forward_ws(const ExpertMajorShape& s, void* base);

struct BackwardWs {
  bf16* a_prime;           // [R][n]
  bf16* dH;                // [R][2n]; null with consume_saved (written over the saved H)
  bf16* dXt;               // [R][d]
  float* ds_partial;       // [R][ds_partial_tiles(n)]
  float* dprobs;           // [R] without probs only (else the caller's dprobs)
  int32_t* valid;          // the stamp matched
  int32_t* expert_offset;  // [E+1] the saved one, or zeros
  size_t total;
};
BackwardWs backward_ws(const ExpertMajorShape& s, void* base, bool consume_saved = false);

uint64_t saved_shape_hash(const ExpertMajorShape& s);

}  // namespace expert_major
}  // namespace smoe
