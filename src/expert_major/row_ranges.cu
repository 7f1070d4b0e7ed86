// Row ranges of the expert-major layer (row_ranges.h).
//
// Rows of expert e: [begin(e), begin(e) + counts[e]), begin(e) = counts[0] + ... + counts[e-1]
// (contiguous) or segment_offset[e] (segmented). The checks make the ranges ordered and disjoint:
// counts >= 0; contiguous: their sum <= R; segmented: 0 <= seg[0] <= ... <= seg[E] <= R and
// counts[e] <= seg[e+1] - seg[e]. Then for a row r, with e the LAST expert with begin(e) <= r (an
// expert tied on begin with a later one has no rows, by disjointness):
//   valid rows before r = off(e) + min(r - begin(e), counts[e])       (off = prefix of the counts)
// so r is valid iff r - begin(e) < counts[e], at grouped row off(e) + r - begin(e), and a padding
// row is the (r - valid rows before r)-th padding row, at grouped row nnz + that index. Both maps
// are bijections onto [0, R): row_of is filled everywhere, with no ordering between threads.
#include "common/check.h"
#include "common/grid_stride.h"
#include "expert_major/row_ranges.h"

namespace smoe {
namespace expert_major {
namespace {

constexpr int kThreads = 256;

// One block: checks and prefix sums (E <= kMaxExperts = 512, one thread walks them: E adds).
__global__ void check_counts_kernel(const int32_t* __restrict__ counts, const int32_t* __restrict__ seg, int E,
                                    int64_t R, int32_t* __restrict__ expert_offset, int32_t* __restrict__ row_begin,
                                    int32_t* __restrict__ valid, DeviceStatus* status) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    bool good = true;
    int64_t off = 0;
    int64_t prev_end = 0;  // segmented: where the previous segment ends
    for (int e = 0; e < E && good; ++e) {
      const int64_t c = counts[e];
      if (c < 0) good = false;
      if (seg != nullptr) {
        const int64_t b = seg[e], next = seg[e + 1];
        if (b < prev_end || next < b || c > next - b) good = false;
        prev_end = next;
      }
      off += c;
    }
    if (seg != nullptr && prev_end > R) good = false;
    if (off > R) good = false;
    ok = good;
    *valid = good;
    if (!good && status != nullptr) atomicOr(&status->flags, static_cast<uint32_t>(kStatusInvalidCounts));
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // E + 1 ints: one thread, in order (deterministic, and E is small)
    int32_t off = 0;
    for (int e = 0; e < E; ++e) {
      expert_offset[e] = ok ? off : 0;
      row_begin[e] = ok ? (seg != nullptr ? seg[e] : off) : 0;
      off += ok ? counts[e] : 0;
    }
    expert_offset[E] = ok ? off : 0;
  }
}

__global__ void map_rows_kernel(const int32_t* __restrict__ counts, const int32_t* __restrict__ row_begin,
                                const int32_t* __restrict__ expert_offset, const float* __restrict__ probs, int E,
                                int64_t R, const int32_t* __restrict__ valid, int32_t* __restrict__ row_of,
                                int32_t* __restrict__ slot_of, float* __restrict__ scores,
                                int32_t* __restrict__ row_offset) {
  extern __shared__ int32_t sm[];  // row_begin [E], expert_offset [E+1], counts [E]
  int32_t* sb = sm;
  int32_t* so = sm + E;
  int32_t* sc = sm + 2 * E + 1;
  const bool ok = *valid != 0;
  for (int e = threadIdx.x; e <= E; e += blockDim.x) {
    so[e] = expert_offset[e];
    if (e < E) {
      sb[e] = row_begin[e];
      sc[e] = ok ? counts[e] : 0;
    }
  }
  __syncthreads();
  const int64_t nnz = so[E];
  for (int64_t r = detail::grid_first(); r < R; r += detail::grid_step()) {
    row_offset[r] = static_cast<int32_t>(r);
    if (r == R - 1) row_offset[R] = static_cast<int32_t>(R);
    // The last expert with begin <= r (-1: r is before every range; invalid: no expert).
    int lo = 0, hi = ok ? E : 0;  // first e with begin > r is in [lo, hi]
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (sb[mid] <= r) lo = mid + 1; else hi = mid;
    }
    const int e = lo - 1;
    int64_t before = 0;  // valid rows before r
    bool in = false;
    if (e >= 0) {
      const int64_t i = r - sb[e];
      in = i < sc[e];
      before = so[e] + (in ? i : sc[e]);
    }
    if (in) {
      row_of[before] = static_cast<int32_t>(r);
      slot_of[r] = static_cast<int32_t>(before);
      scores[r] = probs != nullptr ? probs[r] : 1.f;
    } else {
      row_of[nnz + (r - before)] = static_cast<int32_t>(r);
      slot_of[r] = -1;
      scores[r] = 0.f;
    }
  }
}

__global__ void clear_stamp_kernel(uint64_t* stamp, const int32_t* valid) {
  if (*valid == 0) stamp[0] = 0;
}

}  // namespace

Status row_ranges(const RowRangesIn& in, const SavedLayout& saved, int32_t* row_begin, int32_t* valid,
                  DeviceStatus* status, cudaStream_t stream) {
  check_counts_kernel<<<1, 32, 0, stream>>>(in.counts, in.segment_offset, in.E, in.rows, saved.expert_offset,
                                            row_begin, valid, status);
  SMOE_CHECK_LAUNCH("expert_major check_counts_kernel");
  if (in.rows == 0) return Status{};
  const size_t smem = sizeof(int32_t) * (3 * static_cast<size_t>(in.E) + 1);
  map_rows_kernel<<<detail::grid_blocks(in.rows, kThreads, 2048), kThreads, smem, stream>>>(
      in.counts, row_begin, saved.expert_offset, in.probs, in.E, in.rows, valid, saved.row_of, saved.slot_of,
      saved.scores, saved.row_offset);
  SMOE_CHECK_LAUNCH("expert_major map_rows_kernel");
  return Status{};
}

Status clear_stamp_if_invalid(plan::SavedStamp* stamp, const int32_t* valid, cudaStream_t stream) {
  clear_stamp_kernel<<<1, 1, 0, stream>>>(reinterpret_cast<uint64_t*>(stamp), valid);
  SMOE_CHECK_LAUNCH("expert_major clear_stamp_kernel");
  return Status{};
}

}  // namespace expert_major
}  // namespace smoe
