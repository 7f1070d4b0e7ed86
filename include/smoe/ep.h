// smoe/ep.h -- expert parallelism (EP) across the GPUs of one node, on NCCL's device API.
//
// The experts are split evenly over the R ranks of an NCCL communicator: global expert e lives on
// rank e / (E/R) as local expert e % (E/R). Each rank routes its own tokens with any router (the
// caller's, or smoe::topk_routing) and passes the choice as [T][K] global expert ids (-1 = empty
// slot) and fp32 scores, as for MoERouter::kProvided. One EP call then
//   forward : dispatch (each token pushed once to every rank that holds one of its experts, by
//             NVLink load/store into the peer's symmetric window), the local experts on the smoe
//             layer (caller-provided routing over the received tokens), combine (each rank returns
//             one partial row per received token; the source adds the partials in fp32 in
//             ascending rank order);
//   backward: x and dout dispatched again with the forward's layout (x is not held, so nothing of
//             size O(T d) is kept between the passes), the local layer's backward, dx and
//             dL/dscores combined back; dW1 / dW2 of the local experts stay on their rank.
// The router's own gradient is the caller's (dL/dscores is returned), exactly as for kProvided.
//
// Contract, in addition to smoe.h's:
//   * The receive slots of a rank are ordered by (source rank, source token) and computed from
//     exchanged counts by prefix sums: placement depends only on the routing, and every result is
//     bitwise deterministic run to run (no atomics).
//   * No host synchronisation on the forward/backward path: the windows are sized for the worst
//     case (every rank sending max_tokens tokens to one rank) and the counts stay on the device.
//   * Every rank of the communicator calls ep_forward / ep_backward in the same order (they are
//     collective); T may differ between ranks and between calls (0 <= T <= max_tokens).
//   * Calls on one context are ordered on one stream per rank; two contexts may share a
//     communicator.
//   * One node only (every rank reachable by NVLink load/store: NCCL's LSA team = the world);
//     NVLink multicast is never used.
#pragma once

#include <cstddef>
#include <cstdint>

#include <nccl.h>

#include "smoe/smoe.h"

namespace smoe {

struct EpConfig {
  int64_t max_tokens = 0;  // per rank, per call: sizes the symmetric windows
  int d = 0;
  int n = 0;
  int E = 0;               // global experts, a multiple of the world size
  int K = 0;               // slots per token (top-K)
  int comm_blocks = 32;    // thread blocks of the dispatch / combine kernels (each an LSA barrier)
  // > 0: a barrier that waits longer than this for a peer gives up, sets kStatusEpBarrierTimeout in
  // the call's DeviceStatus and the call's kernels skip their remaining communication (the results
  // of that call are invalid and the context must be destroyed). 0: wait without limit.
  int barrier_timeout_ms = 0;
  // Received tokens a rank's buffers hold (the local layer's T; its saved state is sized by it).
  // 0: world * max_tokens, the worst case, so nothing is ever dropped. Smaller (a capacity factor,
  // e.g. 1.25 * max_tokens for balanced routing) bounds memory: a token whose receive slot on rank q
  // is past the capacity is not sent to q (its entries on q's experts contribute nothing and get
  // dscores 0), the forward sets kStatusEpCapacityExceeded, and which tokens drop is deterministic
  // (slots are ordered by source rank, then token).
  int64_t recv_capacity = 0;
  // 1: the backward sends x on a stream of the context's own while the local layer's dA' and dW2
  // run on the caller's stream (dout goes first; the layer waits for x before its router and dW1
  // work, and the caller's stream joins it before the call returns). 0: x and dout in one pass
  // first (for comparisons). Every rank must pass the same; SMOE_EP_OVERLAP=0|1 in the environment
  // overrides it at ep_create.
  int overlap = 1;
};

// DeviceStatus flag of the EP calls (beside smoe.h's DeviceStatusFlag values).
constexpr uint32_t kStatusEpBarrierTimeout = 1u << 8;
constexpr uint32_t kStatusEpCapacityExceeded = 1u << 9;  // tokens were dropped (EpConfig::recv_capacity)

struct EpContext;  // opaque

// Collective over the communicator (every rank calls it, from its own thread or process, with its
// device current). Checks that all ranks pass the same EpConfig (one all-gather and one host
// synchronisation, at creation only), allocates and registers the symmetric windows (about
// (2 C + R max_tokens) d * 2 bytes per rank, C = the receive capacity) and creates the device
// communicator.
Status ep_create(ncclComm_t comm, const EpConfig& config, EpContext** out);
// Collective too. Null is allowed.
Status ep_destroy(EpContext* ctx);

struct EpInfo {
  int rank = 0, world = 0;
  int experts_per_rank = 0;  // E / R
  int local_slots = 0;       // min(K, E / R): slots of a received token
  int64_t recv_capacity = 0; // received tokens per rank (EpConfig::recv_capacity, or R * max_tokens)
  MoEShape local_shape;      // the local layer's shape (kProvided over recv_capacity tokens)
  size_t window_bytes = 0;   // symmetric memory per rank
};
EpInfo ep_info(const EpContext* ctx);

// Sizes for a call with T local tokens (0 for an invalid T).
size_t ep_saved_state_size(const EpContext* ctx, int64_t T);
size_t ep_forward_workspace_size(const EpContext* ctx, int64_t T);
size_t ep_backward_workspace_size(const EpContext* ctx, int64_t T);

struct EpForwardArgs {
  int64_t T = 0;
  const bf16* x = nullptr;          // [T][d] this rank's tokens
  const int32_t* expert = nullptr;  // [T][K] global expert ids, -1 = empty slot
  const float* scores = nullptr;    // [T][K]
  const bf16* w1 = nullptr;         // [E/R][2n][d] this rank's experts (interleaved gate/up)
  const bf16* w2 = nullptr;         // [E/R][d][n]
  bf16* out = nullptr;              // [T][d]
  void* saved = nullptr;            // ep_saved_state_size(ctx, T) bytes, kept until backward
  size_t saved_bytes = 0;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  DeviceStatus* status = nullptr;   // as for moe_forward; an id outside [-1, E) drops its slot
};

struct EpBackwardArgs {
  int64_t T = 0;                    // the forward's T
  const bf16* x = nullptr;          // the forward's x, unchanged
  const bf16* w1 = nullptr;
  const bf16* w2 = nullptr;
  const bf16* dout = nullptr;       // [T][d]
  const void* saved = nullptr;      // written by ep_forward
  size_t saved_bytes = 0;
  DeviceStatus* status = nullptr;   // optional: where a barrier timeout or a bad saved state is reported
  bf16* dx = nullptr;               // [T][d] the expert path (the router's part is the caller's)
  bf16* dw1 = nullptr;              // [E/R][2n][d] overwritten
  bf16* dw2 = nullptr;              // [E/R][d][n] overwritten
  float* dscores = nullptr;         // [T][K], 0 in empty or dropped slots
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Dispatch and combine alone, with identity experts (the communication of one forward, for tests
// and benchmarks): every token goes to each rank that holds one of its experts and comes straight
// back; out[t] = (number of such ranks) * x[t], summed in fp32 in ascending rank order.
struct EpRoundtripArgs {
  int64_t T = 0;
  const bf16* x = nullptr;          // [T][d]
  const int32_t* expert = nullptr;  // [T][K] global ids, -1 = empty
  bf16* out = nullptr;              // [T][d]
  void* workspace = nullptr;        // ep_roundtrip_workspace_size(ctx, T) bytes
  size_t workspace_bytes = 0;
  DeviceStatus* status = nullptr;
};
size_t ep_roundtrip_workspace_size(const EpContext* ctx, int64_t T);
Status ep_roundtrip(EpContext* ctx, const EpRoundtripArgs& args, cudaStream_t stream);

Status ep_forward(EpContext* ctx, const EpForwardArgs& args, cudaStream_t stream);
Status ep_backward(EpContext* ctx, const EpBackwardArgs& args, cudaStream_t stream);

}  // namespace smoe
