// The EP context (one per rank) and the kernels of the EP data path (ep_kernels.cu).
#pragma once

#include <nccl.h>
#include <nccl_device.h>

#include "smoe/ep.h"

namespace smoe {

// Offsets of the regions of the symmetric window; identical on every rank (same EpConfig), so a
// peer's region is ncclGetLsaPointer(window, offset, peer).
struct EpWindowLayout {
  size_t counts = 0;      // [R][R] int32: row s = tokens source s sends to each rank
  size_t recv_x = 0;      // [C][d] bf16: received x (forward and backward), C = receive capacity
  size_t recv_dy = 0;     // [C][d] bf16: received dout (backward)
  size_t meta_ids = 0;    // [C][Kl] int32: local expert ids of a received token, -1 = none
  size_t meta_scores = 0; // [C][Kl] fp32
  size_t comb = 0;        // [R][Tmax][d] bf16: partial rows returned by rank q (row q)
  size_t comb_ds = 0;     // [R][Tmax][Kl] fp32: dL/dscores returned by rank q
  size_t bytes = 0;
};

struct EpContext {
  ncclComm_t comm = nullptr;
  ncclDevComm dev_comm{};
  ncclWindow_t window = nullptr;
  void* window_base = nullptr;  // this rank's window (ncclMemAlloc)
  EpConfig config;
  int rank = 0, world = 0;
  int experts_per_rank = 0, local_slots = 0;
  int64_t recv_capacity = 0;
  int device = 0;
  EpWindowLayout layout;
  MoEShape local_shape;
  uint64_t timeout_cycles = 0;  // EpConfig::barrier_timeout_ms at this device's SM clock
  // EpConfig::overlap: the backward's x pass runs on `side`, forked from the caller's stream after
  // the dout pass (`fork`) and joined through `x_ready`. Created once here: no per-call allocation.
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr, x_ready = nullptr;
};

namespace ep {

// Kernel arguments shared by the launches (device pointers into this rank's memory, plus the
// window for the peers' regions). No host pointer into the window: inside a kernel every access to
// this rank's own window goes through ncclGetLocalPointer (ep_kernels.cu, "One alias").
struct EpKernelArgs {
  ncclDevComm dev_comm;
  ncclWindow_t window;
  EpWindowLayout lay;
  int rank, world;
  int64_t T, Tmax;
  int64_t cap;          // receive slots per rank (slots at or past it are not sent)
  int d, K, E, El, Kl;  // El experts per rank, Kl slots per received token
  uint64_t timeout_cycles;  // barrier deadline in SM clock cycles, 0 = none
  uint32_t* flags;          // DeviceStatus::flags of the call (may be null)
};

// Layout: send_pos[q][t] = position of token t among the tokens this rank sends to q (-1: none),
// my_counts[q]; copies the ids into saved_ids; flags ids outside [-1, E).
cudaError_t launch_layout(const EpKernelArgs& a, const int32_t* expert, int32_t* send_pos,
                          int32_t* my_counts, int32_t* saved_ids, DeviceStatus* status,
                          cudaStream_t stream);
// Count exchange: barrier, my_counts -> row `rank` of every peer's counts region, barrier; then
// the full [R][R] matrix is copied to all_counts (caller memory, kept for backward).
cudaError_t launch_exchange(const EpKernelArgs& a, const int32_t* my_counts, int32_t* all_counts,
                            cudaStream_t stream);
// Dispatch: rows x (and dy, when not null) of every sent token to the peer's receive slots.
// write_meta (forward, dy null): also the local ids / scores of each sent slot, and -1 ids in this
// rank's own unused slots; scores may be null only when this rank sends nothing (T = 0).
// start_barrier: wait for the peers to have entered (backward; the forward's exchange did).
// x may be null (the backward's dout pass with EpConfig::overlap). report_capacity: set
// kStatusEpCapacityExceeded when a slot is past the receive capacity (the forward and the
// roundtrip; the backward's passes repeat the forward's layout and do not report it again).
cudaError_t launch_dispatch(const EpKernelArgs& a, const int32_t* all_counts,
                            const int32_t* send_pos, const bf16* x, const bf16* dy,
                            const int32_t* expert, const float* scores, bool write_meta,
                            bool start_barrier, bool report_capacity, int blocks, cudaStream_t stream);
// Combine push: rows of y (local layer output, [cap][d], slot order) received from source
// s != rank go back to s's comb region row `rank`; ds ([cap][Kl]) likewise when not null.
cudaError_t launch_combine(const EpKernelArgs& a, const int32_t* all_counts, const bf16* y,
                           const float* ds, int blocks, cudaStream_t stream);
// Combine reduce (local): out[t] = sum over ranks q ascending of q's partial row (this rank's
// own from y); dscores[t][k] from the owner's returned values (when not null).
cudaError_t launch_reduce(const EpKernelArgs& a, const int32_t* all_counts,
                          const int32_t* send_pos, const bf16* y, bf16* out, const float* ds,
                          const int32_t* ids, float* dscores, cudaStream_t stream);

}  // namespace ep
}  // namespace smoe
