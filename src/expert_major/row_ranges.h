// The expert-major layer's row ranges (row_ranges.cu): the device-side check of counts /
// segment_offset and the one-entry-per-row routing the token-major kernels then run on.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "expert_major/plan.h"

namespace smoe {
namespace expert_major {

struct RowRangesIn {
  const int32_t* counts;          // [E]
  const int32_t* segment_offset;  // [E+1] or null (contiguous)
  const float* probs;             // [R] or null (scores 1)
  int64_t rows;
  int E;
};

// Checks the counts (and segment offsets) on the device and writes, into the saved state,
// expert_offset, row_of, slot_of, scores and row_offset (plan.h). A bad count or offset sets
// *valid = 0 and kStatusInvalidCounts, and then every row is padding (expert_offset all zero): no
// GEMM row exists, nothing reads x, and the caller NaN-fills the outputs.
Status row_ranges(const RowRangesIn& in, const SavedLayout& saved, int32_t* row_begin, int32_t* valid,
                  DeviceStatus* status, cudaStream_t stream);

// The stamp written at the end of a forward is cleared again when *valid == 0, so a backward on the
// saved state of a rejected forward NaN-fills its gradients and reports kStatusBadSavedState.
Status clear_stamp_if_invalid(plan::SavedStamp* stamp, const int32_t* valid, cudaStream_t stream);

}  // namespace expert_major
}  // namespace smoe
