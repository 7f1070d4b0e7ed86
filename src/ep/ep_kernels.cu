// The EP data path: layout, count exchange, dispatch, combine push and combine reduce.
//
// Synchronisation (NCCL LSA barriers; block b of every rank meets block b of the others):
//   * exchange starts with a barrier: every peer has entered this call, so it has finished
//     everything it enqueued before (its previous call's reads of the receive and combine
//     regions included); it ends with one so that all counts are visible;
//   * dispatch and combine end with a barrier per block (acq_rel): once the kernel has finished on
//     this rank, every peer block has finished its stores into this rank's window, and the next
//     kernel on the stream reads them;
//   * the backward's dispatch starts with a barrier (it has no exchange before it). With
//     EpConfig::overlap it is two passes: dout (start barrier) on the caller's stream, then x
//     (no start barrier: the dout pass's barriers already ordered it after the peers' previous
//     reads) on the context's side stream, never both at once, so their barriers do not mix.
// The grid of dispatch / combine is the same on every rank (EpConfig::comm_blocks), or block b
// would wait for a peer block that never runs.
//
// One alias: NCCL maps the window twice on this GPU, at ncclMemAlloc's address (window_base, what
// the host and the local layer use) and in the LSA flat range (ncclGetLsaPointer(w, o, rank) ==
// ncclGetLocalPointer(w, o)). Inside one kernel a store through one and a load through the other
// are two locations to the memory model: nothing orders them, and at world size 1 (no peer, so no
// barrier wait, no acquire) exchange read the counts it had just stored through the other alias
// stale. Dispatch then cleared the metadata of slots it was filling: wrong outputs and gradients
// on a fresh context (pkb_ep at R = 1, H200, 9eb6a22: relative error 0.98 on the first call). So
// every kernel here touches its own window only through ncclGetLocalPointer; between kernels
// (dispatch's stores, the local layer's loads through window_base) the kernel boundary orders them.
#include <cub/block/block_scan.cuh>
#include <cuda/atomic>

#include "ep/ep_context.h"

namespace smoe {
namespace ep {
namespace {

constexpr int kMaxRanks = 8;
constexpr int kCommThreads = 512;

using Barrier = ncclLsaBarrierSession<ncclCoopCta>;

// A barrier sync of the whole CTA that gives up after a.timeout_cycles (0: waits without limit).
// Returns true when every peer arrived; on a timeout one thread sets kStatusEpBarrierTimeout and the
// caller skips its remaining communication. NCCL >= 2.30 has the bounded wait; 2.28's LSA barrier
// has none, so there its wait loop (nccl_device/impl/lsa_barrier__funcs.h: each rank stores epoch + 1
// into its slot of every peer's inbox, then waits for every peer's store into its own) runs here with
// a clock check added.
__device__ bool ep_sync(Barrier& bar, cuda::memory_order order, const EpKernelArgs& a) {
  if (a.timeout_cycles == 0) {
    bar.sync(ncclCoopCta(), order);
    return true;
  }
  bool ok = true;
#if NCCL_VERSION_CODE >= 23000
  ok = bar.sync(ncclCoopCta(), order, a.timeout_cycles) == ncclSuccess;
#else
  bar.arrive(ncclCoopCta(), order);
  for (int i = threadIdx.x; i < bar.team.nRanks - 1; i += blockDim.x) {
    const int peer = i + (bar.team.rank <= i ? 1 : 0);
    cuda::atomic_ref<uint32_t> inbox(*bar.ucInbox(bar.team.rank, peer));
    const long long t0 = clock64();
    while (true) {
      const uint32_t got = inbox.load(nccl::utility::acquireOrderOf(order));
      if (got - (bar.epoch + 1) <= (uint32_t(-1) >> 1)) break;
      if (uint64_t(clock64() - t0) >= a.timeout_cycles) {
        ok = false;
        break;
      }
    }
  }
  bar.epoch += 1;
#endif
  ok = __syncthreads_and(ok) != 0;
  if (!ok && threadIdx.x == 0 && a.flags != nullptr) atomicOr(a.flags, kStatusEpBarrierTimeout);
  return ok;
}

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], uint4 v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}

__device__ __forceinline__ uint4 pack_bf16x8(const float (&acc)[8]) {
  uint4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  return v;
}

// One block per destination rank q: a block-wide scan over the tokens in order, so a token's
// position among those sent to q depends only on the routing. Block 0 also sanitises the ids
// (outside [-1, E) or repeated in the token: dropped, flagged), the copy every later kernel reads.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) layout_kernel(EpKernelArgs a, const int32_t* expert,
                                                          int32_t* send_pos, int32_t* my_counts,
                                                          int32_t* ids, DeviceStatus* status) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int carry;
  const int q = blockIdx.x;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  uint32_t bad = 0;
  for (int64_t t0 = 0; t0 < a.T; t0 += kThreads) {
    const int64_t t = t0 + threadIdx.x;
    int flag = 0;
    if (t < a.T) {
      const int32_t* row = expert + t * a.K;
      for (int k = 0; k < a.K; ++k) {
        int e = row[k];
        if (e < -1 || e >= a.E) {
          bad |= kStatusInvalidExpertId;
          e = -1;
        } else if (e >= 0) {
          for (int j = 0; j < k; ++j)
            if (row[j] == e) {
              bad |= kStatusDuplicateExpert;
              e = -1;
              break;
            }
        }
        if (e >= 0 && e / a.El == q) flag = 1;
        if (q == 0) ids[t * a.K + k] = e;
      }
    }
    int prefix, total;
    Scan(scan_tmp).ExclusiveSum(flag, prefix, total);
    if (t < a.T) send_pos[q * a.T + t] = flag ? carry + prefix : -1;
    __syncthreads();
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) my_counts[q] = carry;
  if (q == 0 && bad != 0 && status != nullptr) atomicOr(&status->flags, bad);
}

__global__ void exchange_kernel(EpKernelArgs a, const int32_t* my_counts, int32_t* all_counts) {
  Barrier bar(ncclCoopCta(), a.dev_comm, ncclTeamTagLsa(), 0);
  const int R = a.world;
  bool ok = ep_sync(bar, cuda::memory_order_relaxed, a);
  if (ok) {
    for (int i = threadIdx.x; i < R * R; i += blockDim.x) {
      const int p = i / R, q = i % R;
      int32_t* peer_counts = static_cast<int32_t*>(ncclGetLsaPointer(a.window, a.lay.counts, p));
      peer_counts[a.rank * R + q] = my_counts[q];
    }
    ok = ep_sync(bar, cuda::memory_order_acq_rel, a);
  }
  // After a timeout every count is 0: the later kernels of the call move nothing and index nothing
  // out of range (the call's results are invalid and flagged).
  const int32_t* mine = static_cast<const int32_t*>(ncclGetLocalPointer(a.window, a.lay.counts));
  for (int i = threadIdx.x; i < R * R; i += blockDim.x) all_counts[i] = ok ? mine[i] : 0;
}

// Warp per token: the token's row goes once to every rank that holds one of its experts.
__global__ void __launch_bounds__(kCommThreads) dispatch_kernel(
    EpKernelArgs a, const int32_t* all_counts, const int32_t* send_pos, const bf16* x,
    const bf16* dy, const int32_t* ids, const float* scores, bool write_meta, bool start_barrier,
    bool report_capacity) {
  Barrier bar(ncclCoopCta(), a.dev_comm, ncclTeamTagLsa(), blockIdx.x);
  if (start_barrier && !ep_sync(bar, cuda::memory_order_relaxed, a)) return;
  const int R = a.world;
  __shared__ int64_t base[kMaxRanks];
  __shared__ char* peer[kMaxRanks];
  __shared__ int64_t recv_total;
  if (threadIdx.x < R) {
    const int q = threadIdx.x;
    int64_t b = 0;
    for (int s = 0; s < a.rank; ++s) b += all_counts[s * R + q];
    base[q] = b;
    peer[q] = static_cast<char*>(ncclGetLsaPointer(a.window, 0, q));
  }
  if (threadIdx.x == 0) {
    int64_t total = 0;
    for (int s = 0; s < R; ++s) total += all_counts[s * R + a.rank];
    recv_total = total;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t nwarps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  const int vpr = a.d / 8;  // 16-byte vectors per row
  bool dropped = false;     // a slot past the receive capacity (EpConfig::recv_capacity)
  for (int64_t t = warp; t < a.T; t += nwarps) {
    const uint4* xs = x ? reinterpret_cast<const uint4*>(x) + t * vpr : nullptr;  // null: the dout pass
    const uint4* ys = dy ? reinterpret_cast<const uint4*>(dy) + t * vpr : nullptr;
    for (int q = 0; q < R; ++q) {
      const int pos = send_pos[q * a.T + t];
      if (pos < 0) continue;
      const int64_t slot = base[q] + pos;
      if (slot >= a.cap) {
        dropped = true;
        continue;
      }
      if (xs) {
        uint4* xd = reinterpret_cast<uint4*>(peer[q] + a.lay.recv_x) + slot * vpr;
        for (int v = lane; v < vpr; v += 32) xd[v] = xs[v];
      }
      if (ys) {
        uint4* yd = reinterpret_cast<uint4*>(peer[q] + a.lay.recv_dy) + slot * vpr;
        for (int v = lane; v < vpr; v += 32) yd[v] = ys[v];
      } else if (write_meta) {
        // Slot j of the received token = the j-th of its entries (in k order) on rank q.
        int32_t* id_d = reinterpret_cast<int32_t*>(peer[q] + a.lay.meta_ids) + slot * a.Kl;
        float* sc_d = reinterpret_cast<float*>(peer[q] + a.lay.meta_scores) + slot * a.Kl;
        for (int j = lane; j < a.Kl; j += 32) {
          int id = -1, cnt = 0;
          float sc = 0.f;
          for (int k = 0; k < a.K; ++k) {
            const int e = ids[t * a.K + k];
            if (e >= 0 && e / a.El == q) {
              if (cnt == j) {
                id = e % a.El;
                sc = scores[t * a.K + k];
              }
              ++cnt;
            }
          }
          id_d[j] = id;
          sc_d[j] = sc;
        }
      }
    }
  }
  // Forward: this rank's slots past the received tokens route nowhere. Keyed on write_meta, not on
  // this rank's scores pointer: a rank with T = 0 may pass null scores, and its receive slots still
  // need clearing (the window starts with whatever ncclMemAlloc left there).
  if (write_meta) {
    int32_t* my_ids = static_cast<int32_t*>(ncclGetLocalPointer(a.window, a.lay.meta_ids));
    float* my_sc = static_cast<float*>(ncclGetLocalPointer(a.window, a.lay.meta_scores));
    const int64_t end = a.cap * a.Kl;
    const int64_t used = recv_total < a.cap ? recv_total : a.cap;
    for (int64_t i = used * a.Kl + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < end;
         i += int64_t(gridDim.x) * blockDim.x) {
      my_ids[i] = -1;
      my_sc[i] = 0.f;
    }
  }
  if (__syncthreads_or(dropped) && report_capacity && threadIdx.x == 0 && a.flags != nullptr)
    atomicOr(a.flags, kStatusEpCapacityExceeded);
  ep_sync(bar, cuda::memory_order_acq_rel, a);
}

// Warp per returned row: the rows this rank received from source s (contiguous slots) go back to
// s's combine region, row block `rank`, in the order s sent them.
__global__ void __launch_bounds__(kCommThreads) combine_kernel(EpKernelArgs a,
                                                               const int32_t* all_counts,
                                                               const bf16* y, const float* ds) {
  Barrier bar(ncclCoopCta(), a.dev_comm, ncclTeamTagLsa(), blockIdx.x);
  const int R = a.world;
  const int lane = threadIdx.x & 31;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t nwarps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  const int vpr = a.d / 8;
  int64_t base = 0;
  for (int s = 0; s < R; ++s) {
    const int64_t got = all_counts[s * R + a.rank];
    // Rows of s that fit in the receive capacity (the rest were never sent).
    const int64_t cnt = base >= a.cap ? 0 : (got < a.cap - base ? got : a.cap - base);
    if (s != a.rank) {
      char* p = static_cast<char*>(ncclGetLsaPointer(a.window, 0, s));
      uint4* dst = reinterpret_cast<uint4*>(p + a.lay.comb) + int64_t(a.rank) * a.Tmax * vpr;
      const uint4* src = reinterpret_cast<const uint4*>(y) + base * vpr;
      for (int64_t i = warp; i < cnt; i += nwarps)
        for (int v = lane; v < vpr; v += 32) dst[i * vpr + v] = src[i * vpr + v];
      if (ds) {
        float* dd = reinterpret_cast<float*>(p + a.lay.comb_ds) + int64_t(a.rank) * a.Tmax * a.Kl;
        const float* sd = ds + base * a.Kl;
        for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < cnt * a.Kl;
             i += int64_t(gridDim.x) * blockDim.x)
          dd[i] = sd[i];
      }
    }
    base += got;
  }
  ep_sync(bar, cuda::memory_order_acq_rel, a);
}

// Warp per token: fp32 sum of the partial rows in ascending rank order (fixed, so deterministic).
__global__ void __launch_bounds__(256) reduce_kernel(EpKernelArgs a, const int32_t* all_counts,
                                                     const int32_t* send_pos, const bf16* y,
                                                     bf16* out, const float* ds,
                                                     const int32_t* ids, float* dscores) {
  const int R = a.world;
  // base_on[q]: where this rank's tokens start among q's receive slots; a slot at or past the
  // capacity was not sent (the token's entries on q contribute nothing).
  int64_t base_on[kMaxRanks];
#pragma unroll
  for (int q = 0; q < kMaxRanks; ++q) {
    base_on[q] = 0;
    if (q < R)
      for (int s = 0; s < a.rank; ++s) base_on[q] += all_counts[s * R + q];
  }
  const int64_t base_self = base_on[a.rank];  // rank < world <= kMaxRanks (ep_create)
  const int lane = threadIdx.x & 31;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t nwarps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  const int vpr = a.d / 8;
  const uint4* comb = static_cast<const uint4*>(ncclGetLocalPointer(a.window, a.lay.comb));
  const float* comb_ds = static_cast<const float*>(ncclGetLocalPointer(a.window, a.lay.comb_ds));
  for (int64_t t = warp; t < a.T; t += nwarps) {
    const uint4* src[kMaxRanks];
    int pos[kMaxRanks];
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q) {
      pos[q] = q < R ? send_pos[q * a.T + t] : -1;
      if (pos[q] >= 0 && base_on[q] + pos[q] >= a.cap) pos[q] = -1;
      src[q] = pos[q] < 0 ? nullptr
               : q == a.rank
                   ? reinterpret_cast<const uint4*>(y) + (base_self + pos[q]) * vpr
                   : comb + (int64_t(q) * a.Tmax + pos[q]) * vpr;
    }
    uint4* dst = reinterpret_cast<uint4*>(out) + t * vpr;
    for (int v = lane; v < vpr; v += 32) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int q = 0; q < kMaxRanks; ++q)
        if (src[q]) add_bf16x8(acc, src[q][v]);
      dst[v] = pack_bf16x8(acc);
    }
    if (dscores) {
      for (int k = lane; k < a.K; k += 32) {
        const int e = ids[t * a.K + k];
        float val = 0.f;
        if (e >= 0) {
          const int q = e / a.El;
          int j = 0;
          for (int kk = 0; kk < k; ++kk) {
            const int f = ids[t * a.K + kk];
            if (f >= 0 && f / a.El == q) ++j;
          }
          const int p = send_pos[q * a.T + t];
          if (base_on[q] + p < a.cap)
            val = q == a.rank ? ds[(base_self + p) * a.Kl + j]
                              : comb_ds[(int64_t(q) * a.Tmax + p) * a.Kl + j];
        }
        dscores[t * a.K + k] = val;
      }
    }
  }
}

int token_blocks(int64_t T, int warps_per_block) {
  const int64_t b = (T + warps_per_block - 1) / warps_per_block;
  return int(b < 1 ? 1 : (b > 1024 ? 1024 : b));
}

}  // namespace

cudaError_t launch_layout(const EpKernelArgs& a, const int32_t* expert, int32_t* send_pos,
                          int32_t* my_counts, int32_t* saved_ids, DeviceStatus* status,
                          cudaStream_t stream) {
  layout_kernel<512><<<a.world, 512, 0, stream>>>(a, expert, send_pos, my_counts, saved_ids,
                                                  status);
  return cudaGetLastError();
}

cudaError_t launch_exchange(const EpKernelArgs& a, const int32_t* my_counts, int32_t* all_counts,
                            cudaStream_t stream) {
  exchange_kernel<<<1, 64, 0, stream>>>(a, my_counts, all_counts);
  return cudaGetLastError();
}

cudaError_t launch_dispatch(const EpKernelArgs& a, const int32_t* all_counts,
                            const int32_t* send_pos, const bf16* x, const bf16* dy,
                            const int32_t* expert, const float* scores, bool write_meta,
                            bool start_barrier, bool report_capacity, int blocks, cudaStream_t stream) {
  dispatch_kernel<<<blocks, kCommThreads, 0, stream>>>(a, all_counts, send_pos, x, dy, expert,
                                                       scores, write_meta, start_barrier, report_capacity);
  return cudaGetLastError();
}

cudaError_t launch_combine(const EpKernelArgs& a, const int32_t* all_counts, const bf16* y,
                           const float* ds, int blocks, cudaStream_t stream) {
  combine_kernel<<<blocks, kCommThreads, 0, stream>>>(a, all_counts, y, ds);
  return cudaGetLastError();
}

cudaError_t launch_reduce(const EpKernelArgs& a, const int32_t* all_counts,
                          const int32_t* send_pos, const bf16* y, bf16* out, const float* ds,
                          const int32_t* ids, float* dscores, cudaStream_t stream) {
  reduce_kernel<<<token_blocks(a.T, 8), 256, 0, stream>>>(a, all_counts, send_pos, y, out, ds, ids,
                                                          dscores);
  return cudaGetLastError();
}

}  // namespace ep
}  // namespace smoe
