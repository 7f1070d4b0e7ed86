// Layouts of the saved state and the workspaces (see memory_plan.h).
#include "moe/memory_plan.h"

#include "common/hash.h"
#include "common/workspace.h"
#include "engine/engine.h"

namespace smoe {
namespace plan {

TokenRoundingProblem rounding_problem(const MoEShape& s, uint64_t seed) {
  TokenRoundingProblem p;
  p.num_tokens = s.T;
  p.num_experts = s.E;
  p.top_k = s.K;
  p.m_tile = engine::kRowTile;
  p.mode = s.rounding;
  p.seed = seed;
  p.logits_dtype = DType::kFloat32;
  return p;
}

bool uses_router(const MoEShape& s) { return s.router != MoERouter::kProvided; }

namespace {
size_t row_capacity(const MoEShape& s) {
  return s.router == MoERouter::kTokenRounding ? static_cast<size_t>(token_rounding_capacity(rounding_problem(s, 0)))
                                               : static_cast<size_t>(s.T) * s.K;
}
}  // namespace

uint64_t saved_shape_hash(const MoEShape& s, bool two_tensor) {
  // FNV-1a over the fields that change the saved layout or its meaning (H's column order included).
  const int64_t f[8] = {s.T, s.d, s.n, s.E, s.K, static_cast<int64_t>(s.router), static_cast<int64_t>(s.rounding),
                        two_tensor ? 1 : 0};
  return detail::fnv1a_fields(f, 8);
}

SavedLayout saved_layout(const MoEShape& s, void* base) {
  const size_t rows = row_capacity(s);
  const size_t tk = static_cast<size_t>(s.T) * s.K;
  const bool tr = s.router == MoERouter::kTokenRounding;
  detail::Carver c(base);
  SavedLayout l;
  l.stamp = c.take<SavedStamp>(1);
  l.v.h = c.take<bf16>(rows * 2 * s.n);
  l.v.scores = c.take<float>(rows);
  l.v.topk_expert = c.take<int32_t>(tk);
  l.v.entry_expert = tr ? c.take<int32_t>(rows) : l.v.topk_expert;
  l.v.topk_score = tr ? c.take<float>(tk) : nullptr;
  l.v.scatter_idx = c.take<int32_t>(rows);
  l.v.reverse_scatter_idx = c.take<int32_t>(rows);
  l.v.gather_idx = c.take<int32_t>(rows);
  l.v.token_offset = c.take<int32_t>(static_cast<size_t>(s.T) + 1);
  l.v.expert_frequency = c.take<int32_t>(s.E);
  l.v.expert_offset = c.take<int32_t>(s.E + 1);
  l.bytes = c.used();
  return l;
}

ForwardWs forward_ws(const MoEShape& s, void* base) {
  const size_t rows = row_capacity(s);
  detail::Carver c(base);
  ForwardWs w{};
  if (uses_router(s)) {
    w.cublas = c.take<char>(kCublasWorkspace);
    w.logits = c.take<float>(static_cast<size_t>(s.T) * s.E);
  }
  if (s.router == MoERouter::kTokenRounding) {
    if (!token_rounding_workspace_size(rounding_problem(s, 0), &w.routing_bytes).ok()) w.routing_bytes = 0;
  } else {
    w.routing_bytes = routing_workspace_size(RoutingProblem{s.T, s.E, s.K, DType::kFloat32});
  }
  w.routing = c.take<char>(w.routing_bytes);
  w.act = c.take<bf16>(rows * s.n);
  w.y = c.take<bf16>(rows * s.d);
  w.total = c.used();
  return w;
}

BackwardWs backward_ws(const MoEShape& s, void* base, bool consume_saved) {
  const size_t rows = row_capacity(s);
  const size_t tk = static_cast<size_t>(s.T) * s.K;
  const size_t te = static_cast<size_t>(s.T) * s.E;
  detail::Carver c(base);
  BackwardWs w{};
  if (uses_router(s)) w.cublas = c.take<char>(kCublasWorkspace);
  // consume_saved: dH goes over the saved H, whose one reader is the dA' epilogue that writes it
  // (each element read before the same tile writes it: backward.cu).
  w.dH = consume_saved ? nullptr : c.take<bf16>(rows * 2 * s.n);
  // A' and the dS partials die with dW2 and ds_rowsum; dX~ is written after them (backward.cu: one
  // stream, dA' -> ds_rowsum -> dW2 -> router -> dW1 -> dX~ -> dx_sum), so it takes their bytes:
  // min(2Rn + 4R*tiles, 2Rd) bytes less at the backward's peak (0.8 GB at Qwen3-235B), what a
  // torch allocator freeing A' before dX~ gets (SonicMoE).
  c.overlay_begin();
  w.a_prime = c.take<bf16>(rows * s.n);
  w.ds_partial = c.take<float>(rows * engine::ds_partial_tiles(s.n));
  c.overlay_next();
  w.dXt = c.take<bf16>(rows * s.d);
  c.overlay_end();
  if (uses_router(s)) {
    w.dS = c.take<float>(rows);
    w.dlogits = c.take<bf16>(te);
    w.dwr32 = c.take<float>(static_cast<size_t>(s.E) * s.d);
  }
  if (s.router == MoERouter::kTopKSoftmax) w.dl = c.take<float>(tk);
  if (s.router == MoERouter::kTokenRounding) {
    w.logits = c.take<float>(te);
    w.dx_router = c.take<float>(static_cast<size_t>(s.T) * s.d);
  }
  w.valid = c.take<int32_t>(1);
  w.expert_offset = c.take<int32_t>(static_cast<size_t>(s.E) + 1);
  w.total = c.used();
  return w;
}

}  // namespace plan
}  // namespace smoe
