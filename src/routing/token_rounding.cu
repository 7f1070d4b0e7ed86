// Token rounding (SonicMoE "TR" routing) on the GPU: exactly ref::token_rounding_ref.
//
// What the reference does (float64): top-K softmax per token; S = softmax over all E; per expert
// e, f_e = tokens that chose e, keep_e = rounded_count(f_e); rank every token by S'[:, e] (the
// chosen score for a token that chose e, S - 1 otherwise, so every chosen token outranks every
// other) and keep the first keep_e, equal values -> lower token first. Then the routing metadata
// of the kept (token, expert) set, entries token-major.
//
// Equivalent split used here (chosen always outrank non-chosen):
//   keep_e == f_e : keep exactly the chosen tokens;
//   keep_e <  f_e : keep the keep_e best CHOSEN tokens by chosen score;
//   keep_e >  f_e : keep every chosen token plus the (keep_e - f_e) best NON-chosen by S - 1.
//
// Why the ranking keys are float64: the reference orders by float64 values; an fp32 key differs
// from them by ~1e-7 relative, which swaps two tokens whenever their scores are that close (with a
// few thousand tokens per expert that happens in a visible fraction of runs). The keys here are
// the reference's expressions evaluated in float64 from the same fp32 logits, so they differ from
// it only by the last bit of exp and the summation order of the softmax denominator (~1e-15):
//   chosen key     = exp(l - mx) / sum_{k<K} exp(l_k - mx)   (summed in choice order, as the ref)
//   non-chosen key = fl(S - 1) with S = exp(l - mx) / sum_e exp(l_e - mx)
// fl(S - 1) is NOT a strictly monotone function of S: for S < 2^-54 it is exactly -1 (ties,
// broken by the lower token), e.g. every non-hot expert of a token with a +100 "hot" logit. The
// key keeps that rounding: q = fl(fl(S - 1) + 1) is exact (see pad_keyf) and strictly increasing
// in fl(S - 1), so the selection ranks by q, a non-negative double whose bit pattern orders like
// its value. Identical logits rows give bit-identical keys (same code, same order), so exact ties
// of the reference between duplicated tokens are exact ties here too.
//
// Pipeline (all on `stream`; no host sync, no allocation, no device-wide CUB: every size below is
// a host-side formula, so token_rounding_workspace_size and the workspace check need no GPU):
//   1. topk_kernel, 32 tokens per block (one warp per token, as routing.cu): topk_expert and
//      topk_score (fp32, bit-identical to topk_routing), the chosen key (float64), the row max and
//      the float64 softmax denominator, and the chosen bitmap transposed: chosen_t[e][w] bit b =
//      token 32w+b chose e (one word per expert per block, built in shared memory, plain stores).
//   2. expert_count_kernel (block per expert): f_e = popcount of chosen_t[e][:].
//   3. rounding_offsets_kernel (one block): keep_e = rounded_count(f_e) -> expert_frequency, its
//      exclusive scan -> expert_offset (offset[E] = nnz).
//   3b. pad_key_kernel: the padding key of every (expert, token) into an [E][T] table (coalesced
//      both ways through a shared-memory tile), so the select passes read keys instead of
//      recomputing a float64 softmax from strided logits in each pass.
//   4. expert_select_kernel (block per expert): an MSB radix select (12-bit digits, histogram in
//      shared memory, integer atomics) finds the keep threshold over the chosen or non-chosen
//      tokens of e, then an ordered compaction over tokens writes the rows [off_e, off_e + keep_e)
//      in ascending token order: gather_idx, row scores, and bit e of the token-major kept bitmap
//      kept_m[t][E/32].
//   5. token_count_kernel / tile_scan_kernel / token_offset_kernel: n_t = popcount(kept_m[t]) and
//      its exclusive scan (a three-phase scan over tiles of 2048 tokens) -> token_offset.
//   6. finalize_kernel (flat over the capacity): grouped row r of expert e and token t is entry
//      j = token_offset[t] + #{kept experts of t below e}; writes scatter/reverse/entry_expert/
//      scores, and the unused values past nnz (every element of every [cap] array written once).
// Determinism: integer atomics only (shared-memory histograms, atomicOr into bitmaps, the status),
// each of which gives the same result in any order.
#include <climits>
#include <cmath>
#include <cstdint>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "common/check.h"
#include "common/grid_stride.h"
#include "common/workspace.h"
#include "routing/routing_rules.h"
#include "routing/warp_topk.cuh"
#include "smoe/smoe.h"

namespace smoe {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kTopkThreads = kWarpsPerBlock * 32;
constexpr int kTokensPerTopkBlock = 32;          // one chosen_t word per expert per block
constexpr int kSelectThreads = 512;
constexpr int kDigitBits = 12;
constexpr int kBins = 1 << kDigitBits;           // 16 KiB of shared histogram
constexpr int kBinsPerThread = kBins / kSelectThreads;
constexpr int kScanThreads = 512;
constexpr int kTokensPerScanThread = 4;
constexpr int kTokenTile = kScanThreads * kTokensPerScanThread;  // 2048 tokens per scan tile
constexpr int kThreads = 256;

static_assert(kBins % kSelectThreads == 0, "bins are split evenly over the select block");
static_assert(kMaxExperts <= kScanThreads, "rounding_offsets_kernel: one thread per expert");

using routing::load_logit;

// NaN ranks below every number (and is reported by topk_kernel); the same substitution everywhere a
// logit is read, so the row max, the denominator and the column reads agree.
template <typename TIn>
__device__ __forceinline__ float clean_logit(const TIn* p) {
  const float x = load_logit(p);
  return isnan(x) ? -INFINITY : x;
}


// ---- rounded_count: the reference's arithmetic, bit for bit ------------------------------------
__host__ __device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Stochastic rounding compares u < p in float64 exactly as ref::rounded_count: u = (z >> 11) *
// 2^-53 is exact (a 53-bit integer times a power of two) and p = fl(rem / m) is one IEEE division
// of two exact doubles (rem < m < 2^31), correctly rounded on host and device alike (CUDA's double
// '/' is IEEE round-to-nearest). The exact rational test (z>>11) * m < rem * 2^53 is NOT the same:
// when rem/m rounds down to a multiple of 2^-53 that equals u, the reference says "down" and the
// exact test "up"; so the double expression itself is evaluated, not an integer rewrite of it.
__host__ __device__ __forceinline__ int64_t rounded_count(int64_t f, int64_t T, int64_t m,
                                                          TokenRoundingMode mode, uint64_t seed,
                                                          int expert) {
  const int64_t rem = f % m;
  const int64_t lo = f - rem;
  int64_t out = f;
  if (rem != 0) {
    const int64_t hi = lo + m;
    switch (mode) {
      case TokenRoundingMode::kNearest: out = (2 * rem > m) ? hi : lo; break;  // half rounds down
      case TokenRoundingMode::kUp: out = hi; break;
      case TokenRoundingMode::kDown: out = lo; break;
      case TokenRoundingMode::kStochastic: {
        const uint64_t z = splitmix64(seed ^ splitmix64(static_cast<uint64_t>(expert)));
        const double u = static_cast<double>(z >> 11) * 0x1.0p-53;
        const double p = static_cast<double>(rem) / static_cast<double>(m);
        out = (u < p) ? hi : lo;
        break;
      }
    }
  }
  return out < 0 ? 0 : (out > T ? T : out);
}

// A non-negative double's bit pattern orders like its value. NaN (from +-Inf logits) ranks lowest.
__device__ __forceinline__ uint64_t order_key(double x) {
  if (!(x > 0.0)) return 0;  // NaN, +0 (and -0, which cannot occur)
  return static_cast<uint64_t>(__double_as_longlong(x));
}

// ---- 1. top-K, row statistics, chosen bitmap ----------------------------------------------------
template <typename TIn, int kPerLane>
__global__ void __launch_bounds__(kTopkThreads)
    topk_kernel(const TIn* __restrict__ logits, int64_t T, int E, int K, int64_t W,
                float* __restrict__ topk_score, int32_t* __restrict__ topk_expert,
                uint32_t* __restrict__ chosen_t, float* __restrict__ row_max,
                double* __restrict__ row_sum, double* __restrict__ chosen_key,
                DeviceStatus* status) {
  __shared__ uint32_t mask[kMaxExperts];  // bit i: token 32*blockIdx.x + i chose expert e
  for (int e = threadIdx.x; e < E; e += kTopkThreads) mask[e] = 0;
  __syncthreads();

  const int lane = threadIdx.x & 31;
  for (int i = threadIdx.x >> 5; i < kTokensPerTopkBlock; i += kWarpsPerBlock) {
    const int64_t t = static_cast<int64_t>(blockIdx.x) * kTokensPerTopkBlock + i;
    if (t >= T) break;  // warp-uniform
    const TIn* row = logits + t * E;

    // --- the top-K softmax of topk_routing (routing/warp_topk.cuh: bit-identical) ---
    routing::WarpTopK<kPerLane> r;
    routing::warp_topk_softmax(row, E, K, lane, &r);
    const float my_val = r.val;
    const float mx = __shfl_sync(0xffffffffu, my_val, 0);  // the first choice is the row maximum
    if (lane < K) {
      topk_score[t * K + lane] = r.score;
      topk_expert[t * K + lane] = r.idx;
      atomicOr(&mask[r.idx], 1u << i);  // K <= E: r.idx is a real expert
    }
    routing::record_nonfinite(r.nonfinite, lane, t, status);

    // --- float64 ranking data (see the file comment) ---
    // l - mx: the reference's own float64 operation on the same values (exact for fp32 operands
    // unless their exponents are far apart, and then rounded the same way).
    const double mxd = static_cast<double>(mx);
    // Chosen key: the reference's topk score, denominator summed in choice order k = 0..K-1.
    const double exd = (lane < K) ? exp(static_cast<double>(my_val) - mxd) : 0.0;
    double sumk = 0.0;
    for (int k = 0; k < K; ++k) sumk += __shfl_sync(0xffffffffu, exd, k);
    if (lane < K) chosen_key[t * K + lane] = exd / sumk;
    // Softmax denominator over all E: lane partial sums then a fixed butterfly (deterministic).
    double z = 0.0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (lane + 32 * j < E) z += exp(static_cast<double>(r.logit(j)) - mxd);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) z += __shfl_xor_sync(0xffffffffu, z, off);
    if (lane == 0) {
      row_max[t] = mx;
      row_sum[t] = z;
    }
  }
  __syncthreads();
  // Tokens past T leave their bits 0, so the last word needs no special case downstream.
  for (int e = threadIdx.x; e < E; e += kTopkThreads)
    chosen_t[static_cast<int64_t>(e) * W + blockIdx.x] = mask[e];
}

// ---- 2. f_e -------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kThreads)
    expert_count_kernel(const uint32_t* __restrict__ chosen_t, int64_t W,
                        int32_t* __restrict__ fcount) {
  using Reduce = cub::BlockReduce<int, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const uint32_t* row = chosen_t + static_cast<int64_t>(blockIdx.x) * W;
  int c = 0;  // total <= T <= 2^31-1
  for (int64_t w = threadIdx.x; w < W; w += kThreads) c += __popc(row[w]);
  const int total = Reduce(tmp).Sum(c);
  if (threadIdx.x == 0) fcount[blockIdx.x] = total;
}

// ---- 3. keep_e and expert_offset ---------------------------------------------------------------
__global__ void __launch_bounds__(kScanThreads)
    rounding_offsets_kernel(const int32_t* __restrict__ fcount, int64_t T, int E, int m_tile,
                            TokenRoundingMode mode, uint64_t seed, int32_t* __restrict__ frequency,
                            int32_t* __restrict__ offset) {
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const int e = threadIdx.x;
  // sum of keep_e <= capacity <= 2^31-1 (checked on the host), so int cannot overflow.
  const int keep = e < E ? static_cast<int>(rounded_count(fcount[e], T, m_tile, mode, seed, e)) : 0;
  int excl = 0;
  Scan(tmp).ExclusiveSum(keep, excl);
  if (e < E) {
    frequency[e] = keep;
    offset[e] = excl;
    if (e == E - 1) offset[E] = excl + keep;
  }
}

// ---- 4. per-expert selection and rows ----------------------------------------------------------
struct SelectState {
  uint64_t prefix;  // the top `bits` bits shared by the threshold items
  int bits;         // bits of the key resolved so far
  int r;            // items still to take among those whose top bits equal prefix
  int all_eq;       // every item with top bits == prefix is taken (no tie-break needed)
  int found_bin, found_above, found_count;
};

// Lowest n set bits of m (0 <= n).
__device__ __forceinline__ uint32_t lowest_bits(uint32_t m, int n) {
  if (n >= __popc(m)) return m;
  uint32_t out = 0;
  for (int i = 0; i < n; ++i) {
    const uint32_t lsb = m & (0u - m);
    out |= lsb;
    m ^= lsb;
  }
  return out;
}

// MSB radix select over the items of words [0, W): cand(w) gives the candidate bits of word w
// (item = token 32w+b), key(t) its 64-bit key. Finds the `need`-th largest key (1 <= need <=
// candidates): afterwards an item is taken iff its top st.bits bits are > st.prefix, or equal to
// st.prefix and (st.all_eq, or it is among the first st.r such items in token order). Each pass
// histograms the next 12-bit digit of the items that still match the prefix (shared-memory integer
// atomics: counts do not depend on the order), then the bin holding the r-th largest is located by
// a block scan over the bins in descending order. Stops as soon as all items of that bin are taken
// (count == r), at the latest after 64 bits (the keys of the bin are then equal: ties, broken by
// the lower token). Typical keys resolve in 2-3 passes; all-equal keys take 6.
template <class CandF, class KeyF>
__device__ void block_radix_select(int64_t W, int need, CandF cand, KeyF key, uint32_t* hist,
                                   typename cub::BlockScan<int, kSelectThreads>::TempStorage& tmp,
                                   SelectState& st) {
  using Scan = cub::BlockScan<int, kSelectThreads>;
  if (threadIdx.x == 0) {
    st.prefix = 0;
    st.bits = 0;
    st.r = need;
    st.all_eq = 0;
  }
  __syncthreads();
  for (;;) {
    const int bits = st.bits;
    const uint64_t prefix = st.prefix;
    const int r = st.r;
    const int d = min(kDigitBits, 64 - bits);
    const int shift = 64 - bits - d;
    const uint64_t digit_mask = (uint64_t{1} << d) - 1;
    for (int i = threadIdx.x; i < kBins; i += kSelectThreads) hist[i] = 0;
    __syncthreads();
    for (int64_t w = threadIdx.x; w < W; w += kSelectThreads) {
      uint32_t m = cand(w);
      while (m) {
        const int b = __ffs(m) - 1;
        m &= m - 1;
        const uint64_t u = key(w * 32 + b);
        if (bits == 0 || (u >> (64 - bits)) == prefix)
          atomicAdd(&hist[static_cast<int>((u >> shift) & digit_mask)], 1u);
      }
    }
    __syncthreads();
    // Thread i owns bins kBins-1-8i .. kBins-8-8i (descending), so an exclusive scan in thread
    // order counts the items in higher bins.
    const int top = kBins - 1 - kBinsPerThread * static_cast<int>(threadIdx.x);
    int local = 0;
#pragma unroll
    for (int j = 0; j < kBinsPerThread; ++j) local += static_cast<int>(hist[top - j]);
    int before = 0;
    Scan(tmp).ExclusiveSum(local, before);
#pragma unroll
    for (int j = 0; j < kBinsPerThread; ++j) {
      const int c = static_cast<int>(hist[top - j]);
      if (before < r && r <= before + c) {  // exactly one bin in the block satisfies this
        st.found_bin = top - j;
        st.found_above = before;
        st.found_count = c;
      }
      before += c;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      st.prefix = (prefix << d) | static_cast<uint64_t>(st.found_bin);
      st.bits = bits + d;
      st.r = r - st.found_above;
      st.all_eq = st.found_count == st.r;
    }
    __syncthreads();
    if (st.all_eq || st.bits == 64) break;  // block-uniform
  }
}

// The padding key of (t, e): q = fl(fl(S - 1) + 1) with S the reference's float64 softmax (see
// pad_keyf below for why q). One function for the key table and nothing else computes it.
__device__ __forceinline__ uint64_t pad_key_of(float l, float mx, double sum) {
  const double S = exp(static_cast<double>(l) - static_cast<double>(mx)) / sum;
  return order_key(__dadd_rn(__dadd_rn(S, -1.0), 1.0));
}

// ---- 3b. the padding keys of every (expert, token), transposed to [E][T] ------------------------
// The selection reads a column of them several times (radix passes, then the compaction): computing
// each key once here, with every thread busy and both the logits read and the table written
// coalesced (a 32 x 32 tile through shared memory), instead of per pass in one block per expert
// (strided logit reads and a float64 exp on a dependent chain) took the select from latency-bound
// to bandwidth-bound.
constexpr int kKeyTile = 32;
template <typename TIn>
__global__ void __launch_bounds__(kKeyTile * 8)
    pad_key_kernel(const TIn* __restrict__ logits, int64_t T, int E, const float* __restrict__ row_max,
                   const double* __restrict__ row_sum, uint64_t* __restrict__ pad_key) {
  __shared__ uint64_t tile[kKeyTile][kKeyTile + 1];
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kKeyTile;
  const int e0 = static_cast<int>(blockIdx.y) * kKeyTile;
#pragma unroll
  for (int i = 0; i < kKeyTile / 8; ++i) {  // read: consecutive threads, consecutive experts
    const int r = threadIdx.y + 8 * i;
    const int64_t t = t0 + r;
    const int e = e0 + threadIdx.x;
    if (t < T && e < E) tile[r][threadIdx.x] = pad_key_of(clean_logit(logits + t * E + e), row_max[t], row_sum[t]);
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kKeyTile / 8; ++i) {  // write: consecutive threads, consecutive tokens
    const int c = threadIdx.y + 8 * i;
    const int e = e0 + c;
    const int64_t t = t0 + threadIdx.x;
    if (t < T && e < E) pad_key[static_cast<int64_t>(e) * T + t] = tile[threadIdx.x][c];
  }
}

template <typename TIn>
__global__ void __launch_bounds__(kSelectThreads)
    expert_select_kernel(const TIn* __restrict__ logits, int64_t T, int E, int K, int64_t W, int EW,
                         const uint32_t* __restrict__ chosen_t, const int32_t* __restrict__ fcount,
                         const int32_t* __restrict__ frequency, const int32_t* __restrict__ offset,
                         const int32_t* __restrict__ topk_expert,
                         const float* __restrict__ topk_score,
                         const float* __restrict__ row_max, const double* __restrict__ row_sum,
                         const double* __restrict__ chosen_key, const uint64_t* __restrict__ pad_key,
                         int32_t* __restrict__ gather, float* __restrict__ row_score,
                         uint32_t* __restrict__ kept_m) {
  using Scan = cub::BlockScan<int, kSelectThreads>;
  __shared__ uint32_t hist[kBins];
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ SelectState st;

  const int e = blockIdx.x;
  const int f = fcount[e];
  const int keep = frequency[e];
  if (keep == 0) return;  // block-uniform: no rows
  const int row0 = offset[e];
  const uint32_t* cw = chosen_t + static_cast<int64_t>(e) * W;
  const int tail = static_cast<int>(T & 31);
  const uint32_t last_valid = tail ? (1u << tail) - 1 : ~0u;
  auto valid = [&](int64_t w) -> uint32_t { return w == W - 1 ? last_valid : ~0u; };

  // Which choice of token t is expert e (t chose e).
  auto choice_of = [&](int64_t t) -> int64_t {
    const int32_t* te = topk_expert + t * K;
    int k = 0;
    while (k < K - 1 && te[k] != e) ++k;
    return t * K + k;
  };
  // S[t][e] in float64, the reference's expression.
  auto softmax_e = [&](int64_t t) -> double {
    const float l = clean_logit(logits + t * E + e);
    return exp(static_cast<double>(l) - static_cast<double>(row_max[t])) / row_sum[t];
  };
  auto chosen_cand = [&](int64_t w) -> uint32_t { return cw[w]; };
  auto free_cand = [&](int64_t w) -> uint32_t { return ~cw[w] & valid(w); };
  auto chosen_keyf = [&](int64_t t) -> uint64_t { return order_key(chosen_key[choice_of(t)]); };
  // q = fl(fl(S - 1) + 1): for S < 0.5, fl(S - 1) = -1 + j 2^-53 lies in [-1, -0.5] where that
  // grid is representable, so adding 1 gives j 2^-53 exactly; for S >= 0.5, S - 1 is exact
  // (Sterbenz) and q = S. So q is an exact, strictly increasing function of the reference's key
  // fl(S - 1). The _rn intrinsics keep the compiler from fusing or reassociating the two adds.
  // (pad_key_of computes it; the table holds it for every token of this expert.)
  const uint64_t* pad_col = pad_key + static_cast<int64_t>(e) * T;
  auto pad_keyf = [&](int64_t t) -> uint64_t { return pad_col[t]; };

  // keep == f: the chosen tokens; keep == T (> f): every token; else a selection.
  const bool drop = keep < f;
  const bool pad = keep > f && keep < T;
  const bool every_token = keep > f && keep == T;
  if (drop) {
    block_radix_select(W, keep, chosen_cand, chosen_keyf, hist, scan_tmp, st);
  } else if (pad) {
    block_radix_select(W, keep - f, free_cand, pad_keyf, hist, scan_tmp, st);
  }
  // (st is only read when drop or pad; block_radix_select ends with a barrier.)
  const bool select = drop || pad;
  const int bits = select ? st.bits : 64;
  const uint64_t prefix = select ? st.prefix : 0;
  const bool all_eq = select ? st.all_eq != 0 : true;
  const int r = select ? st.r : 0;

  // Ordered compaction over tokens, NT words (32 NT tokens) per step: thread = word.
  int rows_done = 0;  // every thread keeps the running totals (block aggregates)
  int eq_done = 0;
  const uint32_t e_bit = 1u << (e & 31);
  for (int64_t w0 = 0; w0 < W; w0 += kSelectThreads) {
    const int64_t w = w0 + threadIdx.x;
    uint32_t chosen = 0, kept = 0, eq = 0;
    if (w < W) {
      chosen = cw[w];
      kept = drop ? 0u : (every_token ? valid(w) : chosen);
      if (select) {
        uint32_t m = drop ? chosen : (~chosen & valid(w));
        while (m) {
          const int b = __ffs(m) - 1;
          m &= m - 1;
          const uint64_t u = drop ? chosen_keyf(w * 32 + b) : pad_keyf(w * 32 + b);
          const uint64_t hi = u >> (64 - bits);  // bits >= 12
          if (hi > prefix) kept |= 1u << b;
          else if (hi == prefix) eq |= 1u << b;
        }
      }
    }
    if (select) {
      if (all_eq) {
        kept |= eq;
      } else {
        // Ties at the threshold: the first r of them in token order.
        int before = 0, total = 0;
        Scan(scan_tmp).ExclusiveSum(__popc(eq), before, total);
        __syncthreads();  // scan_tmp is reused below
        kept |= lowest_bits(eq, max(0, r - eq_done - before));
        eq_done += total;
      }
    }
    int before = 0, total = 0;
    Scan(scan_tmp).ExclusiveSum(__popc(kept), before, total);
    __syncthreads();  // scan_tmp is reused in the next step
    int row = row0 + rows_done + before;
    while (kept) {
      const int b = __ffs(kept) - 1;
      kept &= kept - 1;
      const int64_t t = w * 32 + b;
      gather[row] = static_cast<int32_t>(t);
      row_score[row] = ((chosen >> b) & 1u) ? topk_score[choice_of(t)]
                                            : static_cast<float>(softmax_e(t));
      atomicOr(&kept_m[t * EW + (e >> 5)], e_bit);  // other experts set other bits of this word
      ++row;
    }
    rows_done += total;
  }
}

// ---- 5. token_offset: exclusive scan of the kept experts per token ------------------------------
__global__ void __launch_bounds__(kScanThreads)
    token_count_kernel(const uint32_t* __restrict__ kept_m, int64_t T, int EW,
                       int32_t* __restrict__ count, int32_t* __restrict__ tile_sum) {
  using Reduce = cub::BlockReduce<int, kScanThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTokenTile +
                     static_cast<int64_t>(threadIdx.x) * kTokensPerScanThread;
  int c = 0;
  for (int i = 0; i < kTokensPerScanThread; ++i) {
    const int64_t t = t0 + i;
    if (t < T) {
      int n = 0;
      for (int w = 0; w < EW; ++w) n += __popc(kept_m[t * EW + w]);
      count[t] = n;
      c += n;
    }
  }
  const int total = Reduce(tmp).Sum(c);
  if (threadIdx.x == 0) tile_sum[blockIdx.x] = total;
}

__global__ void __launch_bounds__(kScanThreads)
    tile_scan_kernel(const int32_t* __restrict__ tile_sum, int64_t n_tiles,
                     int32_t* __restrict__ tile_base, int32_t* __restrict__ token_offset,
                     int64_t T) {
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  int run = 0;  // <= nnz <= capacity <= 2^31-1
  for (int64_t b0 = 0; b0 < n_tiles; b0 += kScanThreads) {
    const int64_t b = b0 + threadIdx.x;
    const int v = b < n_tiles ? tile_sum[b] : 0;
    int excl = 0, total = 0;
    Scan(tmp).ExclusiveSum(v, excl, total);
    __syncthreads();
    if (b < n_tiles) tile_base[b] = run + excl;
    run += total;
  }
  if (threadIdx.x == 0) token_offset[T] = run;
}

__global__ void __launch_bounds__(kScanThreads)
    token_offset_kernel(const int32_t* __restrict__ count, int64_t T,
                        const int32_t* __restrict__ tile_base, int32_t* __restrict__ token_offset) {
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTokenTile +
                     static_cast<int64_t>(threadIdx.x) * kTokensPerScanThread;
  int c[kTokensPerScanThread];
  int o[kTokensPerScanThread];
#pragma unroll
  for (int i = 0; i < kTokensPerScanThread; ++i) c[i] = (t0 + i < T) ? count[t0 + i] : 0;
  Scan(tmp).ExclusiveSum(c, o);  // blocked: thread i owns tokens 4i..4i+3 of the tile
  const int base = tile_base[blockIdx.x];
#pragma unroll
  for (int i = 0; i < kTokensPerScanThread; ++i)
    if (t0 + i < T) token_offset[t0 + i] = base + o[i];
}

// ---- 6. scatter / reverse / entries, and the unused tails ---------------------------------------
__global__ void __launch_bounds__(kThreads)
    finalize_kernel(const int32_t* __restrict__ expert_offset, int E, int64_t cap,
                    const int32_t* __restrict__ token_offset, const uint32_t* __restrict__ kept_m,
                    int EW, const float* __restrict__ row_score, int32_t* __restrict__ gather,
                    int32_t* __restrict__ scatter, int32_t* __restrict__ reverse,
                    int32_t* __restrict__ entry_expert, float* __restrict__ scores) {
  __shared__ int32_t off[kMaxExperts + 1];
  for (int i = threadIdx.x; i <= E; i += kThreads) off[i] = expert_offset[i];
  __syncthreads();
  const int64_t nnz = off[E];
  for (int64_t i = detail::grid_first(); i < cap; i += detail::grid_step()) {
    if (i < nnz) {
      // Expert of row i: the last e with off[e] <= i (upper_bound - 1; skips empty experts).
      int lo = 0, hi = E + 1;
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (off[mid] <= i) lo = mid + 1; else hi = mid;
      }
      const int e = lo - 1;
      const int64_t t = gather[i];
      // Entries of t are its kept experts in ascending order: j = start + #kept experts below e.
      const uint32_t* km = kept_m + t * EW;
      int j = token_offset[t];
      for (int w = 0; w < (e >> 5); ++w) j += __popc(km[w]);
      j += __popc(km[e >> 5] & ((1u << (e & 31)) - 1u));
      scatter[i] = j;
      reverse[j] = static_cast<int32_t>(i);
      entry_expert[j] = e;
      scores[j] = row_score[i];
    } else {
      // Rows and entries >= nnz are the same index range: the unused values.
      scatter[i] = -1;
      gather[i] = 0;
      reverse[i] = -1;
      entry_expert[i] = -1;
      scores[i] = 0.f;
    }
  }
}

// ---- host side ---------------------------------------------------------------------------------
struct Plan {
  int64_t W = 0;        // words of a token bitmap column: ceil(T/32)
  int EW = 0;           // words of an expert bitmap row: ceil(E/32)
  int64_t n_tiles = 0;  // token scan tiles
  int64_t cap = 0;
  uint32_t* chosen_t = nullptr;  // [E][W]
  uint32_t* kept_m = nullptr;    // [T][EW]
  float* row_max = nullptr;      // [T]
  double* row_sum = nullptr;     // [T]
  double* chosen_key = nullptr;  // [T*K]
  uint64_t* pad_key = nullptr;   // [E][T] padding keys (pad_key_kernel)
  int32_t* fcount = nullptr;     // [E]
  float* row_score = nullptr;    // [cap]
  int32_t* count = nullptr;      // [T]
  int32_t* tile_sum = nullptr;   // [n_tiles]
  int32_t* tile_base = nullptr;  // [n_tiles]
  size_t bytes = 0;
};

int64_t capacity_of(const TokenRoundingProblem& p) {
  // Valid problems only: T <= 2^31-1 and E <= 512, so no product below overflows int64.
  const int64_t tk = p.num_tokens * p.top_k;
  if (p.mode == TokenRoundingMode::kDown) return tk;  // keep_e <= f_e
  // keep_e <= min(T, f_e + m_tile - 1), summed over the experts.
  const int64_t te = p.num_tokens * p.num_experts;
  const int64_t padded = tk + static_cast<int64_t>(p.num_experts) * (p.m_tile - 1);
  return te < padded ? te : padded;
}

// The one layout function: sizes (base == nullptr) and carving. T = 0 needs no workspace.
Plan make_plan(const TokenRoundingProblem& p, void* base) {
  Plan pl;
  const int64_t T = p.num_tokens;
  if (T == 0) return pl;
  const size_t E = static_cast<size_t>(p.num_experts);
  pl.W = (T + 31) / 32;
  pl.EW = (p.num_experts + 31) / 32;
  pl.n_tiles = (T + kTokenTile - 1) / kTokenTile;
  pl.cap = capacity_of(p);
  const size_t t = static_cast<size_t>(T);
  detail::Carver c(base);
  pl.chosen_t = c.take<uint32_t>(E * static_cast<size_t>(pl.W));
  pl.kept_m = c.take<uint32_t>(t * static_cast<size_t>(pl.EW));
  pl.row_max = c.take<float>(t);
  pl.row_sum = c.take<double>(t);
  pl.chosen_key = c.take<double>(t * static_cast<size_t>(p.top_k));
  pl.pad_key = c.take<uint64_t>(t * E);
  pl.fcount = c.take<int32_t>(E);
  pl.row_score = c.take<float>(static_cast<size_t>(pl.cap));
  pl.count = c.take<int32_t>(t);
  pl.tile_sum = c.take<int32_t>(static_cast<size_t>(pl.n_tiles));
  pl.tile_base = c.take<int32_t>(static_cast<size_t>(pl.n_tiles));
  pl.bytes = c.used();
  return pl;
}

// Routing's kernels cap their grids at 4096 blocks (grid-stride loops cover the rest).
unsigned grid_for(int64_t n, int threads) { return detail::grid_blocks(n, threads, 4096); }

template <typename TIn>
Status launch(const TokenRoundingProblem& p, const TIn* logits, const TokenRoundingOutputs& o,
              const Plan& pl, cudaStream_t stream) {
  const int64_t T = p.num_tokens;
  const int E = p.num_experts, K = p.top_k;
  SMOE_CUDA_RETURN(cudaMemsetAsync(pl.kept_m, 0, sizeof(uint32_t) * static_cast<size_t>(T) * pl.EW,
                                   stream));
  routing::with_per_lane(E, [&](auto per_lane) {
    topk_kernel<TIn, decltype(per_lane)::value><<<static_cast<unsigned>(pl.W), kTopkThreads, 0, stream>>>(
        logits, T, E, K, pl.W, o.topk_score, o.topk_expert, pl.chosen_t, pl.row_max, pl.row_sum,
        pl.chosen_key, o.status);
  });
  SMOE_CHECK_LAUNCH("topk_kernel");
  expert_count_kernel<<<E, kThreads, 0, stream>>>(pl.chosen_t, pl.W, pl.fcount);
  SMOE_CHECK_LAUNCH("expert_count_kernel");
  rounding_offsets_kernel<<<1, kScanThreads, 0, stream>>>(pl.fcount, T, E, p.m_tile, p.mode, p.seed,
                                                         o.expert_frequency, o.expert_offset);
  SMOE_CHECK_LAUNCH("rounding_offsets_kernel");
  const dim3 key_grid(static_cast<unsigned>((T + kKeyTile - 1) / kKeyTile), (E + kKeyTile - 1) / kKeyTile);
  pad_key_kernel<TIn><<<key_grid, dim3(kKeyTile, 8), 0, stream>>>(logits, T, E, pl.row_max, pl.row_sum,
                                                                 pl.pad_key);
  SMOE_CHECK_LAUNCH("pad_key_kernel");
  expert_select_kernel<TIn><<<E, kSelectThreads, 0, stream>>>(
      logits, T, E, K, pl.W, pl.EW, pl.chosen_t, pl.fcount, o.expert_frequency, o.expert_offset,
      o.topk_expert, o.topk_score, pl.row_max, pl.row_sum, pl.chosen_key, pl.pad_key, o.gather_idx,
      pl.row_score, pl.kept_m);
  SMOE_CHECK_LAUNCH("expert_select_kernel");
  token_count_kernel<<<static_cast<unsigned>(pl.n_tiles), kScanThreads, 0, stream>>>(
      pl.kept_m, T, pl.EW, pl.count, pl.tile_sum);
  SMOE_CHECK_LAUNCH("token_count_kernel");
  tile_scan_kernel<<<1, kScanThreads, 0, stream>>>(pl.tile_sum, pl.n_tiles, pl.tile_base,
                                                  o.token_offset, T);
  SMOE_CHECK_LAUNCH("tile_scan_kernel");
  token_offset_kernel<<<static_cast<unsigned>(pl.n_tiles), kScanThreads, 0, stream>>>(
      pl.count, T, pl.tile_base, o.token_offset);
  SMOE_CHECK_LAUNCH("token_offset_kernel");
  finalize_kernel<<<grid_for(pl.cap, kThreads), kThreads, 0, stream>>>(
      o.expert_offset, E, pl.cap, o.token_offset, pl.kept_m, pl.EW, pl.row_score, o.gather_idx,
      o.scatter_idx, o.reverse_scatter_idx, o.entry_expert, o.scores);
  SMOE_CHECK_LAUNCH("finalize_kernel");
  return Status{};
}

}  // namespace

Status token_rounding_can_implement(const TokenRoundingProblem& p) {
  using detail::concat;
  using detail::make_status;
  const char* fn = "token_rounding_routing";
  SMOE_RETURN_IF_ERROR(routing::check_routing_shape(fn, p.num_tokens, p.num_experts, p.top_k, p.logits_dtype));
  if (p.m_tile < 1)
    return make_status(StatusCode::kInvalidArgument,
                       concat(fn, ": m_tile = ", p.m_tile, " must be >= 1"));
  if (p.mode != TokenRoundingMode::kNearest && p.mode != TokenRoundingMode::kUp &&
      p.mode != TokenRoundingMode::kDown && p.mode != TokenRoundingMode::kStochastic)
    return make_status(StatusCode::kInvalidArgument,
                       concat(fn, ": mode = ", static_cast<int>(p.mode),
                              " must be kNearest, kUp, kDown or kStochastic"));
  // Rows and entries are int32 indices too.
  const int64_t cap = capacity_of(p);
  if (cap > INT32_MAX)
    return make_status(StatusCode::kInvalidArgument,
                       concat(fn, ": capacity min(T*E, T*K + E*(m_tile-1)) = ", cap, " with T = ",
                              p.num_tokens, ", E = ", p.num_experts, ", K = ", p.top_k,
                              ", m_tile = ", p.m_tile,
                              " must be <= 2^31-1 (rows are int32 indices)"));
  return Status{};
}

int64_t token_rounding_capacity(const TokenRoundingProblem& p) {
  return token_rounding_can_implement(p).ok() ? capacity_of(p) : 0;
}

Status token_rounding_workspace_size(const TokenRoundingProblem& p, size_t* bytes) {
  SMOE_RETURN_IF_ERROR(detail::check_ptr(bytes, "token_rounding_workspace_size", "bytes", 1));
  SMOE_RETURN_IF_ERROR(token_rounding_can_implement(p));
  *bytes = make_plan(p, nullptr).bytes;
  return Status{};
}

Status token_rounding_routing(const TokenRoundingProblem& p, const void* logits,
                              const TokenRoundingOutputs& o, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream) {
  using detail::check_ptr;
  SMOE_RETURN_IF_ERROR(token_rounding_can_implement(p));
  const char* fn = "token_rounding_routing";
  const int64_t T = p.num_tokens;
  const int E = p.num_experts;
  if (T > 0) {
    SMOE_RETURN_IF_ERROR(
        check_ptr(logits, fn, "logits", p.logits_dtype == DType::kFloat32 ? 4 : 2));
    SMOE_RETURN_IF_ERROR(check_ptr(o.scores, fn, "outputs.scores", 4));
    SMOE_RETURN_IF_ERROR(check_ptr(o.entry_expert, fn, "outputs.entry_expert", 4));
    SMOE_RETURN_IF_ERROR(check_ptr(o.topk_expert, fn, "outputs.topk_expert", 4));
    SMOE_RETURN_IF_ERROR(check_ptr(o.topk_score, fn, "outputs.topk_score", 4));
    SMOE_RETURN_IF_ERROR(check_ptr(o.scatter_idx, fn, "outputs.scatter_idx", 4));
    SMOE_RETURN_IF_ERROR(check_ptr(o.reverse_scatter_idx, fn, "outputs.reverse_scatter_idx", 4));
    SMOE_RETURN_IF_ERROR(check_ptr(o.gather_idx, fn, "outputs.gather_idx", 4));
    SMOE_RETURN_IF_ERROR(check_ptr(workspace, fn, "workspace", kWorkspaceAlignment));
  }
  SMOE_RETURN_IF_ERROR(check_ptr(o.token_offset, fn, "outputs.token_offset", 4));
  SMOE_RETURN_IF_ERROR(check_ptr(o.expert_frequency, fn, "outputs.expert_frequency", 4));
  SMOE_RETURN_IF_ERROR(check_ptr(o.expert_offset, fn, "outputs.expert_offset", 4));
  SMOE_RETURN_IF_ERROR(check_ptr(o.status, fn, "outputs.status", 8));

  const Plan size = make_plan(p, nullptr);
  if (workspace_bytes < size.bytes)
    return detail::make_status(
        StatusCode::kWorkspaceTooSmall,
        detail::concat(fn, ": workspace_bytes = ", workspace_bytes,
                       " is smaller than token_rounding_workspace_size() = ", size.bytes));

  if (T == 0) {
    // No tokens: every expert is empty, token_offset = {0}; the [cap] arrays are empty.
    SMOE_CUDA_RETURN(cudaMemsetAsync(o.expert_frequency, 0, sizeof(int32_t) * E, stream));
    SMOE_CUDA_RETURN(cudaMemsetAsync(o.expert_offset, 0, sizeof(int32_t) * (E + 1), stream));
    SMOE_CUDA_RETURN(cudaMemsetAsync(o.token_offset, 0, sizeof(int32_t), stream));
    return Status{};
  }

  const Plan pl = make_plan(p, workspace);
  if (p.logits_dtype == DType::kFloat32)
    return launch(p, static_cast<const float*>(logits), o, pl, stream);
  return launch(p, static_cast<const bf16*>(logits), o, pl, stream);
}

}  // namespace smoe
