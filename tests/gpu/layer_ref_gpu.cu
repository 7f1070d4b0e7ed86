// Naive fp32 GPU reference of the MoE layer (forward + plain-chain-rule backward) for the tests.
// See layer_ref_gpu.h for the math and the contract; the float64 CPU original is
// src/reference/moe_ref.cpp (experts_forward_ref, experts_backward_chain_ref, layer_*_ref),
// src/reference/routing_ref.cpp (topk softmax, swiglu/dswiglu) and router_backward_ref.cpp.
//
// Structure: the host builds the grouped rows (stable sort of the entries t*K+k by expert, the row
// order of the CPU reference) from topk_expert, then a handful of simple kernels run:
//   * "grouped rows" GEMMs (H, Y, dA, dX~): C[row][col] = sum_l A(row,l) W_e(l,col) for the rows
//     of expert e, one block per (row tile of one expert, column tile);
//   * "expert weight-gradient" GEMMs (dW1, dW2): C_e[m][c] = sum over the rows r of expert e, in
//     row order, of A(r,m) B(r,c), one block per (m tile, c tile, expert);
//   * small per-token / per-element kernels for the router, SwiGLU and the combines.
// All GEMMs use a 16-deep shared-memory slice and a 4x4 register micro-tile per thread; every
// output element is owned by one thread that accumulates its dot product sequentially, so the
// results are deterministic and independent of the tile shape. No atomics anywhere.
#include "gpu/layer_ref_gpu.h"

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace smoe_test {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;  // every kernel uses 256-thread blocks
constexpr int kBK = 16;        // reduction slice of the tiled GEMMs
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kGemmMinBlocks = 2;  // GEMM blocks per SM (caps registers at 128/thread)

// ------------------------------------------------------------------------------------------------
// Error handling: test code, so any failure aborts with a message.
// ------------------------------------------------------------------------------------------------
void check_cuda(cudaError_t e, const char* expr, const char* file, int line) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "layer_ref_gpu: CUDA call failed at %s:%d: %s: %s\n", file, line, expr,
                 cudaGetErrorString(e));
    std::fflush(stderr);
    std::abort();
  }
}

void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "layer_ref_gpu: %s\n", what);
    std::fflush(stderr);
    std::abort();
  }
}

#define LR_CUDA(expr) check_cuda((expr), #expr, __FILE__, __LINE__)
#define LR_LAUNCHED() check_cuda(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

// ------------------------------------------------------------------------------------------------
// Device helpers
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ float bf2f(bf16 v) { return __bfloat162float(v); }

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ float sigmoid_f(float g) { return 1.0f / (1.0f + expf(-g)); }

// Butterfly sum over the warp; the result of lane 0 is what callers use (fixed order).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t global_stride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// An operand indexed by grouped row: element (row, col) is
//   kGatherBf16: bf16 ptr[row_token[row] * ld + col] (times row_scale[row] when row_scale != null)
//   kDenseF32:   fp32 ptr[row * ld + col]
enum : int { kGatherBf16 = 0, kDenseF32 = 1 };

struct RowOperand {
  const void* ptr;
  int64_t ld;
  const int32_t* row_token;  // kGatherBf16 only
  const float* row_scale;    // kGatherBf16 only; may be null
};

template <int KIND>
__device__ __forceinline__ float load_row_op(const RowOperand& op, int64_t row, int64_t col) {
  if constexpr (KIND == kGatherBf16) {
    const bf16* p = static_cast<const bf16*>(op.ptr);
    const float v = bf2f(p[static_cast<int64_t>(op.row_token[row]) * op.ld + col]);
    return op.row_scale != nullptr ? op.row_scale[row] * v : v;
  } else {
    return static_cast<const float*>(op.ptr)[row * op.ld + col];
  }
}

// acc[i][j] += sum_kk As[kk][ty*4+i] * Bs[kk][tx*4+j], kk ascending (sequential per element).
template <int BM, int BN>
__device__ __forceinline__ void micro_tile(const float (*As)[BM + 4], const float (*Bs)[BN + 4],
                                           int ty, int tx, float (&acc)[4][4]) {
#pragma unroll
  for (int kk = 0; kk < kBK; ++kk) {
    const float4 a = *reinterpret_cast<const float4*>(&As[kk][ty * 4]);
    const float4 b = *reinterpret_cast<const float4*>(&Bs[kk][tx * 4]);
    const float av[4] = {a.x, a.y, a.z, a.w};
    const float bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
  }
}

// ------------------------------------------------------------------------------------------------
// Grouped-rows GEMM: for the rows [row0, row_end) of expert e (one tile of at most BM rows),
//   C[row][col] = sum_{l < L} A(row, l) * W_e(l, col),   col < N,
// with W_e(l, col) = W[e*w_expert_stride + col*w_ld + l]  (B_KMAJOR: "NT", W_e stored [N][L])
//                  = W[e*w_expert_stride + l*w_ld + col]  (!B_KMAJOR: "NN", W_e stored [L][N]).
// Grid: x = row tile (tile_expert/tile_row0), y = column tile of BN.
// ------------------------------------------------------------------------------------------------
template <int BM, int BN, int AKIND, bool B_KMAJOR>
__global__ void __launch_bounds__(kThreads, kGemmMinBlocks)
grouped_rows_gemm_kernel(const RowOperand A, const bf16* __restrict__ W,
                         const int64_t w_expert_stride, const int64_t w_ld,
                         const int32_t* __restrict__ tile_expert,
                         const int32_t* __restrict__ tile_row0,
                         const int64_t* __restrict__ expert_offset, const int64_t L,
                         const int64_t N, float* __restrict__ C, const int64_t ldc) {
  static_assert((BM / 4) * (BN / 4) == kThreads, "one 4x4 micro-tile per thread");
  static_assert((BM * kBK) % kThreads == 0 && (BN * kBK) % kThreads == 0, "whole tile loads");
  static_assert(kThreads % BN == 0, "the N-major B load keeps one column per thread");
  constexpr int kRowStep = kThreads / kBK;  // K-major loads: rows (or columns) per pass
  __shared__ __align__(16) float As[kBK][BM + 4];
  __shared__ __align__(16) float Bs[kBK][BN + 4];

  const int e = tile_expert[blockIdx.x];
  const int64_t row0 = tile_row0[blockIdx.x];
  const int64_t row_end = min64(row0 + BM, expert_offset[e + 1]);
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * BN;
  const bf16* We = W + static_cast<int64_t>(e) * w_expert_stride;
  const int tid = threadIdx.x;
  const int tx = tid % (BN / 4), ty = tid / (BN / 4);

  float acc[4][4] = {};
  for (int64_t l0 = 0; l0 < L; l0 += kBK) {
    // A tile, K-major source: consecutive threads walk l (coalesced), stored transposed.
    // Thread tid loads (m, kk) = (tid / kBK + it * kRowStep, tid % kBK).
    {
      const int kk = tid % kBK;
      const int64_t l = l0 + kk;
#pragma unroll
      for (int it = 0; it < BM * kBK / kThreads; ++it) {
        const int m = tid / kBK + it * kRowStep;
        const int64_t row = row0 + m;
        As[kk][m] = (row < row_end && l < L) ? load_row_op<AKIND>(A, row, l) : 0.0f;
      }
    }
    // B tile.
    if constexpr (B_KMAJOR) {
      // W_e stored [N][L]: thread tid loads (c, kk) = (tid / kBK + it * kRowStep, tid % kBK).
      const int kk = tid % kBK;
      const int64_t l = l0 + kk;
      const int c_first = tid / kBK;
#pragma unroll
      for (int it = 0; it < BN * kBK / kThreads; ++it) {
        const int c = c_first + it * kRowStep;
        const int64_t col = col0 + c;
        Bs[kk][c] = (col < N && l < L) ? bf2f(We[col * w_ld + l]) : 0.0f;
      }
    } else {
      // W_e stored [L][N]: thread tid loads (c, kk) = (tid % BN, tid / BN + it * kThreads / BN).
      const int c = tid % BN;
      const int64_t col = col0 + c;
      const int kk_first = tid / BN;
#pragma unroll
      for (int it = 0; it < BN * kBK / kThreads; ++it) {
        const int kk = kk_first + it * (kThreads / BN);
        const int64_t l = l0 + kk;
        Bs[kk][c] = (col < N && l < L) ? bf2f(We[l * w_ld + col]) : 0.0f;
      }
    }
    __syncthreads();
    micro_tile<BM, BN>(As, Bs, ty, tx, acc);
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t row = row0 + ty * 4 + i;
    if (row >= row_end) continue;
    float* crow = C + row * ldc;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t col = col0 + tx * 4 + j;
      if (col < N) crow[col] = acc[i][j];
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Expert weight-gradient GEMM: for expert e = blockIdx.z,
//   C[e][m][c] = sum over rows r in [expert_offset[e], expert_offset[e+1]) (ascending) of
//                A(r, m) * B(r, c),    m < M, c < N;   C is [E][M][N].
// An expert without rows gets zeros. Grid: x = column tile of BN, y = row tile of BM, z = expert.
// ------------------------------------------------------------------------------------------------
template <int BM, int BN, int AKIND, int BKIND>
__global__ void __launch_bounds__(kThreads, kGemmMinBlocks)
expert_weight_grad_kernel(const RowOperand A, const RowOperand B,
                          const int64_t* __restrict__ expert_offset, const int64_t M,
                          const int64_t N, float* __restrict__ C) {
  static_assert((BM / 4) * (BN / 4) == kThreads, "one 4x4 micro-tile per thread");
  static_assert((BM * kBK) % kThreads == 0 && (BN * kBK) % kThreads == 0, "whole tile loads");
  static_assert(kThreads % BM == 0 && kThreads % BN == 0, "one m (c) per thread in the loads");
  __shared__ __align__(16) float As[kBK][BM + 4];
  __shared__ __align__(16) float Bs[kBK][BN + 4];

  const int e = blockIdx.z;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * BM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * BN;
  const int64_t r_begin = expert_offset[e], r_end = expert_offset[e + 1];
  const int tid = threadIdx.x;
  const int tx = tid % (BN / 4), ty = tid / (BN / 4);

  float acc[4][4] = {};
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kBK) {
    // Both operands are contiguous along m / c: consecutive threads walk it (coalesced).
    // Thread tid loads (kk, m) = (tid / BM + it * kThreads / BM, tid % BM), same for B.
    {
      const int m = tid % BM;
      const int64_t mm = m0 + m;
#pragma unroll
      for (int it = 0; it < BM * kBK / kThreads; ++it) {
        const int kk = tid / BM + it * (kThreads / BM);
        const int64_t r = r0 + kk;
        As[kk][m] = (r < r_end && mm < M) ? load_row_op<AKIND>(A, r, mm) : 0.0f;
      }
    }
    {
      const int c = tid % BN;
      const int64_t cc = n0 + c;
#pragma unroll
      for (int it = 0; it < BN * kBK / kThreads; ++it) {
        const int kk = tid / BN + it * (kThreads / BN);
        const int64_t r = r0 + kk;
        Bs[kk][c] = (r < r_end && cc < N) ? load_row_op<BKIND>(B, r, cc) : 0.0f;
      }
    }
    __syncthreads();
    micro_tile<BM, BN>(As, Bs, ty, tx, acc);
    __syncthreads();
  }

  float* Ce = C + static_cast<int64_t>(e) * M * N;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t m = m0 + ty * 4 + i;
    if (m >= M) continue;
    float* crow = Ce + m * N;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t c = n0 + tx * 4 + j;
      if (c < N) crow[c] = acc[i][j];
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Router and element-wise kernels
// ------------------------------------------------------------------------------------------------

// logit_sel[j] = <x[t], w_router[topk[j]]> for entry j = t*K+k; one warp per entry.
__global__ void __launch_bounds__(kThreads)
selected_logits_kernel(const bf16* __restrict__ x, const bf16* __restrict__ w_router,
                       const int32_t* __restrict__ topk, int64_t TK, int K, int64_t d,
                       float* __restrict__ logit_sel) {
  const int lane = threadIdx.x & 31;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const bool valid = j < TK;
  float acc = 0.0f;
  if (valid) {
    const bf16* xr = x + (j / K) * d;
    const bf16* wr = w_router + static_cast<int64_t>(topk[j]) * d;
    for (int64_t c = lane; c < d; c += 32) acc = fmaf(bf2f(xr[c]), bf2f(wr[c]), acc);
  }
  acc = warp_sum(acc);  // every lane takes part
  if (valid && lane == 0) logit_sel[j] = acc;
}

// scores[t][k] = softmax over k of logit_sel[t][k] (max subtracted); one thread per token.
__global__ void __launch_bounds__(kThreads)
topk_softmax_kernel(const float* __restrict__ logit_sel, int64_t T, int K,
                    float* __restrict__ scores) {
  for (int64_t t = global_thread(); t < T; t += global_stride()) {
    const float* l = logit_sel + t * K;
    float mx = l[0];
    for (int k = 1; k < K; ++k) mx = fmaxf(mx, l[k]);
    float sum = 0.0f;
    for (int k = 0; k < K; ++k) sum += expf(l[k] - mx);
    for (int k = 0; k < K; ++k) scores[t * K + k] = expf(l[k] - mx) / sum;
  }
}

// row_scale[row] = scores[row_entry[row]] (the score of each grouped row).
__global__ void __launch_bounds__(kThreads)
gather_row_scale_kernel(const float* __restrict__ scores, const int32_t* __restrict__ row_entry,
                        int64_t TK, float* __restrict__ row_scale) {
  for (int64_t r = global_thread(); r < TK; r += global_stride()) row_scale[r] = scores[row_entry[r]];
}

// a[row][j] = silu(h[row][2j]) * h[row][2j+1]; total = TK*n.
__global__ void __launch_bounds__(kThreads)
swiglu_kernel(const float* __restrict__ H, int64_t total, float* __restrict__ Aout) {
  for (int64_t idx = global_thread(); idx < total; idx += global_stride()) {
    const float g = H[2 * idx], u = H[2 * idx + 1];
    Aout[idx] = g * sigmoid_f(g) * u;
  }
}

// out[t][i] = sum_k scores[t][k] * y[row(t,k)][i], k ascending.
__global__ void __launch_bounds__(kThreads)
combine_out_kernel(const float* __restrict__ Y, const float* __restrict__ scores,
                   const int32_t* __restrict__ entry_row, int64_t T, int K, int64_t d,
                   float* __restrict__ out) {
  for (int64_t idx = global_thread(); idx < T * d; idx += global_stride()) {
    const int64_t t = idx / d, i = idx - t * d;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) {
      const int64_t j = t * K + k;
      acc += scores[j] * Y[static_cast<int64_t>(entry_row[j]) * d + i];
    }
    out[idx] = acc;
  }
}

// ds[j] = <dout[t], y[row(j)]> for entry j = t*K+k; one warp per entry.
__global__ void __launch_bounds__(kThreads)
ds_kernel(const bf16* __restrict__ dout, const float* __restrict__ Y,
          const int32_t* __restrict__ entry_row, int64_t TK, int K, int64_t d,
          float* __restrict__ ds) {
  const int lane = threadIdx.x & 31;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const bool valid = j < TK;
  float acc = 0.0f;
  if (valid) {
    const bf16* dor = dout + (j / K) * d;
    const float* yr = Y + static_cast<int64_t>(entry_row[j]) * d;
    for (int64_t i = lane; i < d; i += 32) acc = fmaf(bf2f(dor[i]), yr[i], acc);
  }
  acc = warp_sum(acc);  // every lane takes part
  if (valid && lane == 0) ds[j] = acc;
}

// Top-K softmax backward: dl[j] = s_j (ds_j - sum_k ds_k s_k) over the entries of a token.
__global__ void __launch_bounds__(kThreads)
router_backward_kernel(const float* __restrict__ ds, const float* __restrict__ scores, int64_t T,
                       int K, float* __restrict__ dl) {
  for (int64_t t = global_thread(); t < T; t += global_stride()) {
    float dot = 0.0f;
    for (int k = 0; k < K; ++k) dot += ds[t * K + k] * scores[t * K + k];
    for (int k = 0; k < K; ++k) {
      const int64_t j = t * K + k;
      dl[j] = scores[j] * (ds[j] - dot);
    }
  }
}

// dSwiGLU: dh[row][2c] = da*u*(sig + silu*(1-sig)), dh[row][2c+1] = da*silu; total = TK*n.
__global__ void __launch_bounds__(kThreads)
dswiglu_kernel(const float* __restrict__ H, const float* __restrict__ dA, int64_t total,
               float* __restrict__ dH) {
  for (int64_t idx = global_thread(); idx < total; idx += global_stride()) {
    const float g = H[2 * idx], u = H[2 * idx + 1], da = dA[idx];
    const float sig = sigmoid_f(g);
    const float silu = g * sig;
    dH[2 * idx] = da * u * (sig + silu * (1.0f - sig));
    dH[2 * idx + 1] = da * silu;
  }
}

// dx[t][i] = sum_k dxt[row(t,k)][i] + sum_k dl[t*K+k] * w_router[e_k][i], k ascending.
__global__ void __launch_bounds__(kThreads)
dx_kernel(const float* __restrict__ dxt, const float* __restrict__ dl,
          const int32_t* __restrict__ topk, const bf16* __restrict__ w_router,
          const int32_t* __restrict__ entry_row, int64_t T, int K, int64_t d,
          float* __restrict__ dx) {
  for (int64_t idx = global_thread(); idx < T * d; idx += global_stride()) {
    const int64_t t = idx / d, i = idx - t * d;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) acc += dxt[static_cast<int64_t>(entry_row[t * K + k]) * d + i];
    for (int k = 0; k < K; ++k) {
      const int64_t j = t * K + k;
      acc += dl[j] * bf2f(w_router[static_cast<int64_t>(topk[j]) * d + i]);
    }
    dx[idx] = acc;
  }
}

// dw_router[e][i] = sum over the rows r of expert e (ascending = token order) of
// dl[row_entry[r]] * x[row_token[r]][i]. Grid: x = ceil(d / kThreads), y = E.
__global__ void __launch_bounds__(kThreads)
dw_router_kernel(const bf16* __restrict__ x, const float* __restrict__ dl,
                 const int32_t* __restrict__ row_entry, const int32_t* __restrict__ row_token,
                 const int64_t* __restrict__ expert_offset, int64_t d,
                 float* __restrict__ dw_router) {
  const int e = blockIdx.y;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= d) return;
  float acc = 0.0f;
  for (int64_t r = expert_offset[e]; r < expert_offset[e + 1]; ++r)
    acc += dl[row_entry[r]] * bf2f(x[static_cast<int64_t>(row_token[r]) * d + i]);
  dw_router[static_cast<int64_t>(e) * d + i] = acc;
}

// ------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------

// Owns the temporaries; frees them (checked) when it goes out of scope, after the final sync.
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    for (void* p : ptrs_) LR_CUDA(cudaFree(p));
  }
  template <typename T>
  T* alloc(int64_t count) {
    if (count <= 0) return nullptr;
    void* p = nullptr;
    LR_CUDA(cudaMalloc(&p, static_cast<size_t>(count) * sizeof(T)));
    ptrs_.push_back(p);
    return static_cast<T*>(p);
  }
  template <typename T>
  T* upload(const std::vector<T>& h, cudaStream_t stream) {
    T* p = alloc<T>(static_cast<int64_t>(h.size()));
    if (p != nullptr)
      LR_CUDA(cudaMemcpyAsync(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
    return p;
  }

 private:
  std::vector<void*> ptrs_;
};

unsigned elementwise_blocks(int64_t total) {
  const int64_t b = (total + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < (int64_t{1} << 20) ? (b > 0 ? b : 1) : (int64_t{1} << 20));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Row tiles of one tile height: (expert, first row) for every BM rows of every expert.
struct RowTiles {
  int64_t count = 0;
  const int32_t* expert = nullptr;
  const int32_t* row0 = nullptr;
};

RowTiles make_row_tiles(const std::vector<int64_t>& offset, int E, int bm, Scratch* scratch,
                        cudaStream_t stream, std::vector<int32_t>* keep_expert,
                        std::vector<int32_t>* keep_row0) {
  keep_expert->clear();
  keep_row0->clear();
  for (int e = 0; e < E; ++e)
    for (int64_t r = offset[e]; r < offset[e + 1]; r += bm) {
      keep_expert->push_back(e);
      keep_row0->push_back(static_cast<int32_t>(r));
    }
  RowTiles t;
  t.count = static_cast<int64_t>(keep_expert->size());
  t.expert = scratch->upload(*keep_expert, stream);
  t.row0 = scratch->upload(*keep_row0, stream);
  return t;
}

struct Grouping {
  const int64_t* expert_offset;  // [E+1]
  RowTiles small;                // 16-row tiles
  RowTiles large;                // 64-row tiles
};

// Grouped-rows GEMM with the tile shape that wastes the least work: 64x64 tiles when the experts
// have many rows, 16x256 tiles when they have few (decode-like / many-expert shapes).
template <int AKIND, bool B_KMAJOR>
void launch_grouped_rows_gemm(const Grouping& g, const RowOperand& A, const bf16* W,
                              int64_t w_expert_stride, int64_t w_ld, int64_t L, int64_t N,
                              float* C, int64_t ldc, cudaStream_t stream) {
  if (g.large.count == 0 || N == 0) return;
  const double work_large =
      static_cast<double>(g.large.count) * 64.0 * static_cast<double>(ceil_div(N, 64) * 64);
  const double work_small =
      1.25 * static_cast<double>(g.small.count) * 16.0 * static_cast<double>(ceil_div(N, 256) * 256);
  if (work_small < work_large) {
    require(ceil_div(N, 256) <= 65535, "GEMM N too large for gridDim.y");
    const dim3 grid(static_cast<unsigned>(g.small.count), static_cast<unsigned>(ceil_div(N, 256)));
    grouped_rows_gemm_kernel<16, 256, AKIND, B_KMAJOR><<<grid, kThreads, 0, stream>>>(
        A, W, w_expert_stride, w_ld, g.small.expert, g.small.row0, g.expert_offset, L, N, C, ldc);
  } else {
    require(ceil_div(N, 64) <= 65535, "GEMM N too large for gridDim.y");
    const dim3 grid(static_cast<unsigned>(g.large.count), static_cast<unsigned>(ceil_div(N, 64)));
    grouped_rows_gemm_kernel<64, 64, AKIND, B_KMAJOR><<<grid, kThreads, 0, stream>>>(
        A, W, w_expert_stride, w_ld, g.large.expert, g.large.row0, g.expert_offset, L, N, C, ldc);
  }
  LR_LAUNCHED();
}

template <int AKIND, int BKIND>
void launch_expert_weight_grad(const Grouping& g, int E, const RowOperand& A, const RowOperand& B,
                               int64_t M, int64_t N, float* C, cudaStream_t stream) {
  require(ceil_div(M, 64) <= 65535, "weight-gradient M too large for gridDim.y");
  const dim3 grid(static_cast<unsigned>(ceil_div(N, 64)), static_cast<unsigned>(ceil_div(M, 64)),
                  static_cast<unsigned>(E));
  expert_weight_grad_kernel<64, 64, AKIND, BKIND>
      <<<grid, kThreads, 0, stream>>>(A, B, g.expert_offset, M, N, C);
  LR_LAUNCHED();
}

}  // namespace

void layer_ref_gpu(int64_t T, int d, int n, int E, int K, const bf16* x, const bf16* w_router,
                   const bf16* w1, const bf16* w2, const bf16* dout, const int32_t* topk_expert,
                   const LayerRefOutputs& o, cudaStream_t stream) {
  require(T >= 0, "T must be >= 0");
  require(d >= 1 && n >= 1, "d and n must be >= 1");
  require(E >= 1 && E <= 65535, "E must be in [1, 65535]");
  require(K >= 1 && K <= E, "K must be in [1, E]");
  require(T <= INT32_MAX / K, "T*K must be <= 2^31-1");
  const int64_t TK = T * K;
  const int64_t D = d, N1 = 2 * static_cast<int64_t>(n), N2 = n;  // 64-bit copies
  const bool backward = dout != nullptr;

  if (T == 0) {
    if (o.dw_router) LR_CUDA(cudaMemsetAsync(o.dw_router, 0, sizeof(float) * E * D, stream));
    if (o.dw1) LR_CUDA(cudaMemsetAsync(o.dw1, 0, sizeof(float) * E * N1 * D, stream));
    if (o.dw2) LR_CUDA(cudaMemsetAsync(o.dw2, 0, sizeof(float) * E * D * N2, stream));
    LR_CUDA(cudaStreamSynchronize(stream));
    return;
  }
  require(x && w_router && w1 && w2 && topk_expert, "x, w_router, w1, w2, topk_expert must be non-null");
  require(o.out && o.scores, "outputs out and scores must be non-null");
  if (backward)
    require(o.dx && o.dw_router && o.dw1 && o.dw2 && o.ds,
            "with dout, outputs dx, dw_router, dw1, dw2, ds must be non-null");

  // ---- routing decisions -> grouped rows (host) ---------------------------------------------
  std::vector<int32_t> topk(static_cast<size_t>(TK));
  LR_CUDA(cudaMemcpyAsync(topk.data(), topk_expert, sizeof(int32_t) * TK, cudaMemcpyDeviceToHost,
                          stream));
  LR_CUDA(cudaStreamSynchronize(stream));
  std::vector<int64_t> offset(static_cast<size_t>(E) + 1, 0);
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      const int32_t e = topk[t * K + k];
      if (e < 0 || e >= E) {
        std::fprintf(stderr, "layer_ref_gpu: topk_expert[%lld] = %d is outside [0, %d)\n",
                     static_cast<long long>(t * K + k), e, E);
        require(false, "topk_expert out of range");
      }
      for (int k2 = 0; k2 < k; ++k2)
        if (topk[t * K + k2] == e) {
          std::fprintf(stderr, "layer_ref_gpu: token %lld lists expert %d twice\n",
                       static_cast<long long>(t), e);
          require(false, "topk_expert repeats an expert within a token");
        }
      offset[static_cast<size_t>(e) + 1] += 1;
    }
  for (int e = 0; e < E; ++e) offset[e + 1] += offset[e];
  // Stable counting sort of the entries by expert (the grouped-row order of the CPU reference).
  std::vector<int32_t> row_entry(static_cast<size_t>(TK)), row_token(static_cast<size_t>(TK)),
      entry_row(static_cast<size_t>(TK));
  {
    std::vector<int64_t> cursor(offset.begin(), offset.end() - 1);
    for (int64_t j = 0; j < TK; ++j) {
      const int64_t row = cursor[topk[j]]++;
      row_entry[row] = static_cast<int32_t>(j);
      row_token[row] = static_cast<int32_t>(j / K);
      entry_row[j] = static_cast<int32_t>(row);
    }
  }

  Scratch s;  // declared after the host vectors, so it is destroyed (freeing) before them
  std::vector<int32_t> t16_expert, t16_row0, t64_expert, t64_row0;
  Grouping g;
  g.expert_offset = s.upload(offset, stream);
  g.small = make_row_tiles(offset, E, 16, &s, stream, &t16_expert, &t16_row0);
  g.large = make_row_tiles(offset, E, 64, &s, stream, &t64_expert, &t64_row0);
  const int32_t* d_row_entry = s.upload(row_entry, stream);
  const int32_t* d_row_token = s.upload(row_token, stream);
  const int32_t* d_entry_row = s.upload(entry_row, stream);

  float* logit_sel = s.alloc<float>(TK);
  float* row_scale = s.alloc<float>(TK);
  float* H = s.alloc<float>(TK * N1);    // [TK][2n] grouped rows
  float* Abuf = s.alloc<float>(TK * N2); // [TK][n]
  float* Y = s.alloc<float>(TK * D);     // [TK][d]; reused for dX~ = dH W1 in backward

  // ---- forward ----------------------------------------------------------------------------------
  selected_logits_kernel<<<static_cast<unsigned>(ceil_div(TK, kWarpsPerBlock)), kThreads, 0,
                           stream>>>(x, w_router, topk_expert, TK, K, D, logit_sel);
  LR_LAUNCHED();
  topk_softmax_kernel<<<elementwise_blocks(T), kThreads, 0, stream>>>(logit_sel, T, K, o.scores);
  LR_LAUNCHED();
  gather_row_scale_kernel<<<elementwise_blocks(TK), kThreads, 0, stream>>>(o.scores, d_row_entry,
                                                                           TK, row_scale);
  LR_LAUNCHED();

  // H = x_t W1_e^T: A(row, l) = x[token][l], W_e(l, col) = w1[e][col][l].
  launch_grouped_rows_gemm<kGatherBf16, true>(g, RowOperand{x, D, d_row_token, nullptr}, w1,
                                              N1 * D, D, /*L=*/D, /*N=*/N1, H, N1, stream);
  swiglu_kernel<<<elementwise_blocks(TK * N2), kThreads, 0, stream>>>(H, TK * N2, Abuf);
  LR_LAUNCHED();
  // Y = A W2_e^T: A(row, l) = a[row][l], W_e(l, col) = w2[e][col][l].
  launch_grouped_rows_gemm<kDenseF32, true>(g, RowOperand{Abuf, N2, nullptr, nullptr}, w2, D * N2,
                                            N2, /*L=*/N2, /*N=*/D, Y, D, stream);
  combine_out_kernel<<<elementwise_blocks(T * D), kThreads, 0, stream>>>(Y, o.scores, d_entry_row,
                                                                         T, K, D, o.out);
  LR_LAUNCHED();

  if (backward) {
    float* dA = s.alloc<float>(TK * N2);  // [TK][n]
    float* dH = s.alloc<float>(TK * N1);  // [TK][2n]
    float* dl = s.alloc<float>(TK);       // dlogits of the chosen entries, entry order
    float* dxt = Y;                       // Y is dead once ds is computed

    ds_kernel<<<static_cast<unsigned>(ceil_div(TK, kWarpsPerBlock)), kThreads, 0, stream>>>(
        dout, Y, d_entry_row, TK, K, D, o.ds);
    LR_LAUNCHED();
    router_backward_kernel<<<elementwise_blocks(T), kThreads, 0, stream>>>(o.ds, o.scores, T, K,
                                                                           dl);
    LR_LAUNCHED();

    // dY = s * dout[t] (never stored: the operand scales on load).
    const RowOperand dY{dout, D, d_row_token, row_scale};
    // dA = dY W2_e: A(row, l) = dY[row][l], W_e(l, col) = w2[e][l][col].
    launch_grouped_rows_gemm<kGatherBf16, false>(g, dY, w2, D * N2, N2, /*L=*/D, /*N=*/N2, dA, N2,
                                                 stream);
    dswiglu_kernel<<<elementwise_blocks(TK * N2), kThreads, 0, stream>>>(H, dA, TK * N2, dH);
    LR_LAUNCHED();

    // dW2_e[i][c] = sum_r dY[r][i] a[r][c]   ([E][d][n]).
    launch_expert_weight_grad<kGatherBf16, kDenseF32>(
        g, E, dY, RowOperand{Abuf, N2, nullptr, nullptr}, /*M=*/D, /*N=*/N2, o.dw2, stream);
    // dW1_e[c][i] = sum_r dH[r][c] x[t_r][i]   ([E][2n][d]).
    launch_expert_weight_grad<kDenseF32, kGatherBf16>(
        g, E, RowOperand{dH, N1, nullptr, nullptr}, RowOperand{x, D, d_row_token, nullptr},
        /*M=*/N1, /*N=*/D, o.dw1, stream);
    // dX~[row] = dH[row] W1_e: A(row, l) = dH[row][l], W_e(l, col) = w1[e][l][col].
    launch_grouped_rows_gemm<kDenseF32, false>(g, RowOperand{dH, N1, nullptr, nullptr}, w1, N1 * D,
                                               D, /*L=*/N1, /*N=*/D, dxt, D, stream);
    dx_kernel<<<elementwise_blocks(T * D), kThreads, 0, stream>>>(dxt, dl, topk_expert, w_router,
                                                                  d_entry_row, T, K, D, o.dx);
    LR_LAUNCHED();
    dw_router_kernel<<<dim3(static_cast<unsigned>(ceil_div(D, kThreads)), static_cast<unsigned>(E)),
                       kThreads, 0, stream>>>(x, dl, d_row_entry, d_row_token, g.expert_offset, D,
                                              o.dw_router);
    LR_LAUNCHED();
  }

  LR_CUDA(cudaStreamSynchronize(stream));
}

#undef LR_CUDA
#undef LR_LAUNCHED

}  // namespace smoe_test
