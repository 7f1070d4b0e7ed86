// Layouts of the saved state and the workspaces (see memory_plan.h).
#include "moe/memory_plan.h"

#include "common/workspace.h"
#include "engine/engine.h"
#include "gemm/grouped_gemm.h"

namespace smoe {
namespace plan {

SavedLayout saved_layout(const MoEShape& s, void* base) {
  const size_t tk = static_cast<size_t>(s.T) * s.K;
  detail::Carver c(base);
  SavedLayout l;
  l.v.h = c.take<bf16>(tk * 2 * s.n);
  l.v.scores = c.take<float>(tk);
  l.v.topk_expert = c.take<int32_t>(tk);
  l.v.scatter_idx = c.take<int32_t>(tk);
  l.v.reverse_scatter_idx = c.take<int32_t>(tk);
  l.v.gather_idx = c.take<int32_t>(tk);
  l.v.expert_frequency = c.take<int32_t>(s.E);
  l.v.expert_offset = c.take<int32_t>(s.E + 1);
  l.bytes = c.used();
  return l;
}

ForwardWs forward_ws(const MoEShape& s, void* base) {
  const size_t tk = static_cast<size_t>(s.T) * s.K;
  detail::Carver c(base);
  ForwardWs w;
  w.cublas = c.take<char>(kCublasWorkspace);
  w.logits = c.take<float>(static_cast<size_t>(s.T) * s.E);
  RoutingProblem rp{s.T, s.E, s.K, DType::kFloat32};
  w.routing_bytes = routing_workspace_size(rp);
  w.routing = c.take<char>(w.routing_bytes);
  w.act = c.take<bf16>(tk * s.n);
  w.y = c.take<bf16>(tk * s.d);
  w.total = c.used();
  return w;
}

BackwardWs backward_ws(const MoEShape& s, void* base, int sm_count) {
  const size_t tk = static_cast<size_t>(s.T) * s.K;
  detail::Carver c(base);
  BackwardWs w;
  w.cublas = c.take<char>(kCublasWorkspace);
  w.a_prime = c.take<bf16>(tk * s.n);
  w.dH = c.take<bf16>(tk * 2 * s.n);
  w.dXt = c.take<bf16>(tk * s.d);
  w.ds_partial = c.take<float>(tk * engine::ds_partial_tiles(s.n));
  w.dS = c.take<float>(tk);
  w.dl = c.take<float>(tk);
  w.dlogits = c.take<bf16>(static_cast<size_t>(s.T) * s.E);
  w.dwr32 = c.take<float>(static_cast<size_t>(s.E) * s.d);
  w.cutlass_bytes = gemm::varlen_k_workspace_size(s.E, sm_count);
  w.cutlass = c.take<char>(w.cutlass_bytes);
  w.total = c.used();
  return w;
}

}  // namespace plan
}  // namespace smoe
