// EP context: configuration checks, the symmetric window and the device communicator.
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/check.h"
#include "common/workspace.h"
#include "ep/ep_context.h"

namespace smoe {
namespace {

using detail::concat;
using detail::make_status;

constexpr int kMaxWorld = 8;        // ep_kernels.cu's kMaxRanks
constexpr int kMaxCommBlocks = 132;

Status nccl_status(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return Status{};
  return make_status(StatusCode::kCudaError, concat(what, ": ", ncclGetErrorString(r)));
}
#define SMOE_NCCL_RETURN(expr) SMOE_RETURN_IF_ERROR(nccl_status((expr), #expr))

Status check_config(const EpConfig& c, int world) {
  auto bad = [](const std::string& m) {
    return make_status(StatusCode::kInvalidArgument, "ep_create: " + m);
  };
  if (world < 1 || world > kMaxWorld)
    return bad(concat("world size ", world, " must be in [1, ", kMaxWorld, "]"));
  if (c.max_tokens < 1) return bad(concat("config.max_tokens = ", c.max_tokens, " must be >= 1"));
  if (c.E < 1 || c.E % world != 0)
    return bad(concat("config.E = ", c.E, " must be a positive multiple of the world size ", world));
  if (c.K < 1 || c.K > c.E) return bad(concat("config.K = ", c.K, " must be in [1, E = ", c.E, "]"));
  if (c.barrier_timeout_ms < 0)
    return bad(concat("config.barrier_timeout_ms = ", c.barrier_timeout_ms, " must be >= 0"));
  if (c.overlap != 0 && c.overlap != 1) return bad(concat("config.overlap = ", c.overlap, " must be 0 or 1"));
  if (c.comm_blocks < 1 || c.comm_blocks > kMaxCommBlocks)
    return bad(concat("config.comm_blocks = ", c.comm_blocks, " must be in [1, ", kMaxCommBlocks, "]"));
  // The local layer runs over the receive capacity (default world * max_tokens): its shape rules apply.
  MoEShape s;
  s.T = 0;
  s.d = c.d;
  s.n = c.n;
  s.E = c.E / world;
  s.K = c.K < s.E ? c.K : s.E;
  s.router = MoERouter::kProvided;
  int64_t recv = 0;
  if (!detail::checked_product({c.max_tokens, world}, INT64_MAX, &recv))
    return bad(concat("config.max_tokens * world overflows"));
  if (c.recv_capacity < 0 || c.recv_capacity > recv)
    return bad(concat("config.recv_capacity = ", c.recv_capacity, " must be in [0, world * max_tokens = ",
                      recv, "] (0: world * max_tokens)"));
  s.T = c.recv_capacity > 0 ? c.recv_capacity : recv;
  Status st = moe_can_implement(s);
  if (!st.ok())
    return make_status(st.code, concat("ep_create: the local layer (T = the receive capacity = ", s.T,
                                       ", E = E / world) is not supported: ", st.message));
  return Status{};
}

EpWindowLayout window_layout(const EpConfig& c, int R, int Kl, int64_t cap) {
  detail::Carver w(nullptr);
  EpWindowLayout l;
  const size_t slots = size_t(cap);                            // receive side
  const size_t back = size_t(R) * size_t(c.max_tokens);        // combine side: [R][Tmax]
  l.counts = w.used(), w.take<int32_t>(size_t(R) * R);
  l.recv_x = w.used(), w.take<bf16>(slots * c.d);
  l.recv_dy = w.used(), w.take<bf16>(slots * c.d);
  l.meta_ids = w.used(), w.take<int32_t>(slots * Kl);
  l.meta_scores = w.used(), w.take<float>(slots * Kl);
  l.comb = w.used(), w.take<bf16>(back * c.d);
  l.comb_ds = w.used(), w.take<float>(back * Kl);
  l.bytes = w.used();
  return l;
}

}  // namespace

Status ep_create(ncclComm_t comm, const EpConfig& config_in, EpContext** out) {
  // SMOE_EP_OVERLAP overrides EpConfig::overlap (before the ranks compare configs, so ranks with
  // different environments get the mismatch error, not a hang).
  EpConfig config = config_in;
  if (const char* v = std::getenv("SMOE_EP_OVERLAP"); v != nullptr && (v[0] == '0' || v[0] == '1') && v[1] == 0)
    config.overlap = v[0] - '0';
  if (out == nullptr) return make_status(StatusCode::kInvalidArgument, "ep_create: out is null");
  *out = nullptr;
  if (comm == nullptr) return make_status(StatusCode::kInvalidArgument, "ep_create: comm is null");
  int world = 0, rank = 0, device = 0;
  SMOE_NCCL_RETURN(ncclCommCount(comm, &world));
  SMOE_NCCL_RETURN(ncclCommUserRank(comm, &rank));
  SMOE_NCCL_RETURN(ncclCommCuDevice(comm, &device));
  int current = -1;
  SMOE_CUDA_RETURN(cudaGetDevice(&current));
  if (current != device)
    return make_status(StatusCode::kInvalidArgument,
                       concat("ep_create: the current device (", current,
                              ") is not the communicator's (", device, ")"));
  // Every rank checks its own config first, then all ranks compare: a rank with a bad config
  // still joins the all-gather, so no peer hangs in it.
  Status local = check_config(config, world);
  constexpr int kFields = 9;  // the EpConfig fields every rank must agree on, then "config valid"
  const int64_t mine[kFields] = {config.max_tokens, config.d,           config.n,
                                 config.E,          config.K,           config.comm_blocks,
                                 config.recv_capacity, config.overlap, local.ok() ? 1 : 0};
  // (barrier_timeout_ms may differ between ranks: it only bounds this rank's own waits.)
  int64_t* dev = nullptr;
  SMOE_CUDA_RETURN(cudaMalloc(&dev, sizeof(mine) * (world + 1)));
  std::vector<int64_t> all(kFields * size_t(world));
  cudaStream_t s = nullptr;
  cudaError_t ce = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (ce == cudaSuccess) ce = cudaMemcpyAsync(dev, mine, sizeof(mine), cudaMemcpyHostToDevice, s);
  ncclResult_t nr = ncclSuccess;
  if (ce == cudaSuccess) nr = ncclAllGather(dev, dev + kFields, kFields, ncclInt64, comm, s);
  if (ce == cudaSuccess && nr == ncclSuccess)
    ce = cudaMemcpyAsync(all.data(), dev + kFields, sizeof(int64_t) * all.size(), cudaMemcpyDeviceToHost, s);
  if (ce == cudaSuccess) ce = cudaStreamSynchronize(s);
  if (s) cudaStreamDestroy(s);
  cudaFree(dev);
  SMOE_CUDA_RETURN(ce);
  SMOE_NCCL_RETURN(nr);
  SMOE_RETURN_IF_ERROR(local);
  for (int r = 0; r < world; ++r) {
    const int64_t* o = &all[kFields * size_t(r)];
    if (o[kFields - 1] == 0)
      return make_status(StatusCode::kInvalidArgument,
                         concat("ep_create: rank ", r, " passed an invalid EpConfig"));
    if (std::memcmp(o, mine, (kFields - 1) * sizeof(int64_t)) != 0)
      return make_status(StatusCode::kInvalidArgument,
                         concat("ep_create: rank ", r, "'s EpConfig (max_tokens ", o[0], ", d ", o[1],
                                ", n ", o[2], ", E ", o[3], ", K ", o[4], ", comm_blocks ", o[5],
                                ", recv_capacity ", o[6], ", overlap ", o[7], ") differs from rank ", rank,
                                "'s (", mine[0], ", ", mine[1], ", ", mine[2], ", ", mine[3], ", ", mine[4],
                                ", ", mine[5], ", ", mine[6], ", ", mine[7], "): every rank must pass the same"));
  }

  auto* c = new EpContext;
  c->comm = comm;
  c->config = config;
  c->rank = rank;
  c->world = world;
  c->device = device;
  c->experts_per_rank = config.E / world;
  c->local_slots = config.K < c->experts_per_rank ? config.K : c->experts_per_rank;
  c->recv_capacity = config.recv_capacity > 0 ? config.recv_capacity : int64_t(world) * config.max_tokens;
  c->layout = window_layout(config, world, c->local_slots, c->recv_capacity);
  c->local_shape.T = c->recv_capacity;
  c->local_shape.d = config.d;
  c->local_shape.n = config.n;
  c->local_shape.E = c->experts_per_rank;
  c->local_shape.K = c->local_slots;
  c->local_shape.router = MoERouter::kProvided;
  if (config.barrier_timeout_ms > 0) {
    int khz = 0;
    if (cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device) != cudaSuccess || khz <= 0) khz = 2000000;
    c->timeout_cycles = uint64_t(config.barrier_timeout_ms) * uint64_t(khz);
  }

  auto fail = [&](Status st) {
    ep_destroy(c);
    return st;
  };
  Status st = nccl_status(ncclMemAlloc(&c->window_base, c->layout.bytes), "ncclMemAlloc");
  if (!st.ok()) return fail(st);
  st = nccl_status(ncclCommWindowRegister(comm, c->window_base, c->layout.bytes, &c->window,
                                          NCCL_WIN_COLL_SYMMETRIC),
                   "ncclCommWindowRegister");
  if (!st.ok()) return fail(st);
  if (c->window == nullptr)  // NCCL returns success without a window when symmetric memory is off
    return fail(make_status(StatusCode::kNotImplemented,
                            "ep_create: NCCL gave no symmetric window (needs CUDA P2P between all "
                            "ranks and cuMem; multi-node EP is not implemented)"));
#if NCCL_VERSION_CODE >= 22900
  ncclDevCommRequirements reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
  ncclDevCommRequirements reqs;
  std::memset(&reqs, 0, sizeof(reqs));
#endif
  reqs.lsaMultimem = false;  // NVLink multicast stays off
  reqs.lsaBarrierCount = config.comm_blocks;
  st = nccl_status(ncclDevCommCreate(comm, &reqs, &c->dev_comm), "ncclDevCommCreate");
  if (!st.ok()) return fail(st);
  if (c->dev_comm.lsaSize != world || c->dev_comm.lsaRank != rank)
    return fail(make_status(StatusCode::kNotImplemented,
                            concat("ep_create: the NVLink (LSA) team has ", c->dev_comm.lsaSize,
                                   " of ", world, " ranks; multi-node EP is not implemented")));
  if (config.overlap) {
    st = detail::cuda_status(cudaStreamCreateWithFlags(&c->side, cudaStreamNonBlocking), "cudaStreamCreate(side)");
    if (st.ok()) st = detail::cuda_status(cudaEventCreateWithFlags(&c->fork, cudaEventDisableTiming), "cudaEventCreate(fork)");
    if (st.ok())
      st = detail::cuda_status(cudaEventCreateWithFlags(&c->x_ready, cudaEventDisableTiming), "cudaEventCreate(x_ready)");
    if (!st.ok()) return fail(st);
  }
  // Zeroed window: a peer's first read of the counts region never sees garbage.
  st = detail::cuda_status(cudaMemset(c->window_base, 0, c->layout.bytes), "cudaMemset(window)");
  if (st.ok()) st = detail::cuda_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  if (!st.ok()) return fail(st);
  *out = c;
  return Status{};
}

Status ep_destroy(EpContext* c) {
  if (c == nullptr) return Status{};
  Status first;
  // Deregistering a window that queued kernels still use is a CUDA error inside NCCL (seen on the
  // H200 when a process closed its group right after backward): finish the device's work first.
  first = detail::cuda_status(cudaDeviceSynchronize(), "ep_destroy: cudaDeviceSynchronize");
  auto keep = [&](Status s) {
    if (first.ok() && !s.ok()) first = s;
  };
  if (c->dev_comm.lsaSize != 0)
    keep(nccl_status(ncclDevCommDestroy(c->comm, &c->dev_comm), "ncclDevCommDestroy"));
  if (c->window != nullptr)
    keep(nccl_status(ncclCommWindowDeregister(c->comm, c->window), "ncclCommWindowDeregister"));
  if (c->window_base != nullptr) keep(nccl_status(ncclMemFree(c->window_base), "ncclMemFree"));
  if (c->x_ready != nullptr) keep(detail::cuda_status(cudaEventDestroy(c->x_ready), "cudaEventDestroy(x_ready)"));
  if (c->fork != nullptr) keep(detail::cuda_status(cudaEventDestroy(c->fork), "cudaEventDestroy(fork)"));
  if (c->side != nullptr) keep(detail::cuda_status(cudaStreamDestroy(c->side), "cudaStreamDestroy(side)"));
  delete c;
  return first;
}

EpInfo ep_info(const EpContext* c) {
  EpInfo i;
  if (c == nullptr) return i;
  i.rank = c->rank;
  i.world = c->world;
  i.experts_per_rank = c->experts_per_rank;
  i.local_slots = c->local_slots;
  i.recv_capacity = c->recv_capacity;
  i.local_shape = c->local_shape;
  i.window_bytes = c->layout.bytes;
  return i;
}

}  // namespace smoe
