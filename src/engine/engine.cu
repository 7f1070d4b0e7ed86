// Host side of the engine: argument rules, the tile heuristic, dispatch to the instantiations,
// and the SMOE_ENGINE_PRINT switch.
//
// Tile heuristic (BM = 128, BK = 64 throughout; schedule and BN in choose_varlen_m for varlen-M;
// for the cooperative schedule and varlen-K, BN = 256 or 128 as follows):
//   * BN = 256 halves the B (weight) reloads per A row and gives 64x256x16 wgmma, the fastest
//     atom; it needs N % 256 == 0 (otherwise a quarter or more of the last column tile is padding)
//     and enough tiles to fill the machine: with T*K rows there are about T*K/128 * N/256 tiles;
//     below ~2 waves of the SM count, BN = 128 doubles the tile count and the balance wins.
//   * dA' (dSwiGLU epilogue) uses BN = 128: its epilogue holds H, dH and A' values per element
//     and 64x128 keeps it inside the register budget next to the accumulator.
//   * varlen-K (dW): tiles are (E, M/128, N/BN) with a per-expert reduction; BN = 256 when
//     N % 256 == 0 and E * M/128 * N/256 still gives >= 2 waves, else 128.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/check.h"
#include "engine/engine.h"

namespace smoe {
namespace engine {

namespace {

bool print_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("SMOE_ENGINE_PRINT");
    return v != nullptr && v[0] != '\0' && v[0] != '0';
  }();
  return on;
}

Status rule(const char* fn, const char* name, int64_t v, const char* what) {
  return detail::make_status(StatusCode::kInvalidArgument, detail::concat(fn, ": ", name, " = ", v, " ", what));
}

Status check_extent(const char* fn, const char* name, int v) {
  if (v <= 0 || v % 64 != 0) return rule(fn, name, v, "must be a positive multiple of 64");
  return Status{};
}

constexpr int64_t kMaxRows = (int64_t{1} << 31) - 1;

bool wide_tiles_fill(int64_t tiles_at_256, int sm_count) { return tiles_at_256 >= 2 * sm_count; }

// SMOE_ENGINE_BN_M = 128 / 192 / 256, SMOE_ENGINE_BN_K = 128 / 256 and SMOE_ENGINE_SCHED = coop /
// pingpong force the tile and schedule (where that instantiation exists; otherwise ignored): for
// tuning sweeps and for tests that run every instantiation. Unset, the heuristic decides.
int forced_bn(const char* var) {
  const char* v = std::getenv(var);
  if (v == nullptr) return 0;
  const int bn = std::atoi(v);
  return bn == 128 || bn == 192 || bn == 256 ? bn : 0;
}
enum class ForcedSched { kNone, kCoop, kPingPong };
ForcedSched forced_sched() {
  const char* v = std::getenv("SMOE_ENGINE_SCHED");
  if (v == nullptr) return ForcedSched::kNone;
  const std::string s(v);
  if (s == "coop") return ForcedSched::kCoop;
  if (s == "pingpong") return ForcedSched::kPingPong;
  return ForcedSched::kNone;
}

// The instantiation's name, e.g. "down_store_pp<128>" (a static string per combination).
const char* instance_name(Epilogue epi, WeightMajor major, bool pp, int bn) {
  static const char* const names[4][2][3] = {
      {{"up_swiglu<128>", "", "up_swiglu<256>"}, {"up_swiglu_pp<128>", "", ""}},
      {{"da_dswiglu<128>", "", ""}, {"da_dswiglu_pp<128>", "", ""}},
      {{"down_store<128>", "", "down_store<256>"}, {"down_store_pp<128>", "down_store_pp<192>", ""}},
      {{"dx_store<128>", "", "dx_store<256>"}, {"dx_store_pp<128>", "dx_store_pp<192>", ""}}};
  const int kind = epi == Epilogue::kSwiGLU ? 0 : epi == Epilogue::kDSwiGLU ? 1 : major == WeightMajor::kNK ? 2 : 3;
  return names[kind][pp ? 1 : 0][bn == 128 ? 0 : bn == 192 ? 1 : 2];
}

}  // namespace

int ds_partial_tiles(int N) { return (N + 127) / 128; }

Choice choose_varlen_m(const VarlenMArgs& a, int sm_count) {
  const bool store = a.epilogue == Epilogue::kStore;
  const int64_t tiles256 = (a.rows / 128) * (a.N / 256);
  // Schedule (measured over 19 shapes, docs/engine.md): ping-pong hides one warpgroup's epilogue
  // under the other's mainloop, but its 128 x BN tile per warpgroup (BN <= 192, the accumulator's
  // registers) reloads more operand bytes per FLOP than cooperative 128 x 256. So ping-pong where
  // the epilogue is long next to the mainloop: every dA' (dSwiGLU: H loads, dH, A', dS per
  // element), and SwiGLU / store GEMMs with K <= kPingPongMaxK (K = n or 2n, or a short d);
  // cooperative 128 x 256 on long-K GEMMs, where the operand traffic is what limits.
  bool pp = a.epilogue == Epilogue::kDSwiGLU || a.K <= kPingPongMaxK;
  const ForcedSched fs = forced_sched();
  if (fs != ForcedSched::kNone) pp = fs == ForcedSched::kPingPong;
  const int forced = forced_bn("SMOE_ENGINE_BN_M");
  int bn;
  if (pp) {
    // Stores: 128 x 192 (more B reuse per A row than 128 x 128) unless the last column tile would
    // waste more than 1/8 of the columns; the fused epilogues hold more per element: 128 x 128.
    const int64_t pad192 = (a.N + 191) / 192 * 192 - a.N;
    const bool wide = store && (forced ? forced == 192 : pad192 * 8 <= a.N);
    bn = wide ? 192 : 128;
  } else if (a.epilogue == Epilogue::kDSwiGLU) {
    bn = 128;  // 64 x 128 per warpgroup keeps its epilogue inside the register budget
  } else {
    const bool wide = a.N % 256 == 0 && (forced ? forced == 256 : wide_tiles_fill(tiles256, sm_count));
    bn = wide ? 256 : 128;
  }
  return {bn, pp, instance_name(a.epilogue, a.b_major, pp, bn)};
}

// A gather_q call (Q gathered, P contiguous, D [E][M][N]) runs as its transpose: P' = Q gathered,
// Q' = P contiguous, D'[e] = D[e]^T stored transposed. The gathered operand is then always the
// kernel's A (the 128-wide tile side) and the contiguous one B (TMA, up to 256 wide).
VarlenKArgs as_gather_p(const VarlenKArgs& a) {
  if (a.gather_p) return a;
  VarlenKArgs t = a;
  t.M = a.N;
  t.N = a.M;
  t.P = a.Q;
  t.ld_p = a.ld_q;
  t.gather_p = a.gather_q;
  t.Q = a.P;
  t.ld_q = a.ld_p;
  t.gather_q = nullptr;
  return t;
}

Choice choose_varlen_k(const VarlenKArgs& a_in, int sm_count) {
  const VarlenKArgs a = as_gather_p(a_in);
  const int64_t tiles256 = static_cast<int64_t>(a.num_experts) * ((a.M + 127) / 128) * (a.N / 256);
  const int forced = forced_bn("SMOE_ENGINE_BN_K");
  const bool wide = a.N % 256 == 0 && (forced ? forced == 256 : wide_tiles_fill(tiles256, sm_count));
  if (a_in.gather_p) return wide ? Choice{256, false, "dw_gather_p<256>"} : Choice{128, false, "dw_gather_p<128>"};
  return wide ? Choice{256, false, "dw_gather_p_t<256>"} : Choice{128, false, "dw_gather_p_t<128>"};
}

Status varlen_m(const VarlenMArgs& a, int sm_count, cudaStream_t stream) {
  const char* fn = "engine::varlen_m";
  if (a.num_experts < 1 || a.num_experts > kMaxExperts)
    return rule(fn, "num_experts", a.num_experts, "must be in [1, 512]");
  SMOE_RETURN_IF_ERROR(check_extent(fn, "N", a.N));
  SMOE_RETURN_IF_ERROR(check_extent(fn, "K", a.K));
  if (a.rows < 0 || a.rows > kMaxRows) return rule(fn, "rows", a.rows, "must be in [0, 2^31)");
  if (a.a_rows < 0 || a.a_rows > kMaxRows) return rule(fn, "a_rows", a.a_rows, "must be in [0, 2^31)");
  const int64_t weight_rows = int64_t{a.num_experts} * (a.b_major == WeightMajor::kNK ? a.N : a.K);
  if (weight_rows > kMaxRows)
    return rule(fn, "num_experts * weight rows", weight_rows, "must be < 2^31 (TMA coordinates)");
  if (a.epilogue == Epilogue::kSwiGLU && a.N % 128 != 0)
    return rule(fn, "N", a.N, "must be a multiple of 128 for the SwiGLU epilogue (2n, n % 64 == 0)");
  // The instantiations: SwiGLU / dSwiGLU gather A (by cp.async), the plain store loads it by TMA.
  const bool gathered_epilogue = a.epilogue != Epilogue::kStore;
  if (gathered_epilogue != (a.gather_idx != nullptr))
    return detail::make_status(
        StatusCode::kInvalidArgument,
        detail::concat(fn, ": gather_idx must be ", gathered_epilogue ? "non-null" : "null",
                       " with the ", gathered_epilogue ? "SwiGLU / dSwiGLU" : "store",
                       " epilogue (gathered A is fused only into those)"));
  if (a.rows == 0) return Status{};
  if (a.gather_idx == nullptr && a.a_rows < a.rows)
    return rule(fn, "a_rows", a.a_rows, "must be >= rows when A is not gathered");
  if (a.gather_idx != nullptr && a.a_rows < 1) return rule(fn, "a_rows", a.a_rows, "must be >= 1 when A is gathered");
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.expert_offset, fn, "expert_offset", 4));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.A, fn, "A", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.B, fn, "B", 16));
  if (gathered_epilogue) SMOE_RETURN_IF_ERROR(detail::check_ptr(a.gather_idx, fn, "gather_idx", 4));
  switch (a.epilogue) {
    case Epilogue::kStore:
      SMOE_RETURN_IF_ERROR(detail::check_ptr(a.D, fn, "D", 16));
      break;
    case Epilogue::kSwiGLU:
      SMOE_RETURN_IF_ERROR(detail::check_ptr(a.D, fn, "D (H)", 16));
      SMOE_RETURN_IF_ERROR(detail::check_ptr(a.D2, fn, "D2 (A)", 16));
      break;
    case Epilogue::kDSwiGLU:
      SMOE_RETURN_IF_ERROR(detail::check_ptr(a.D2, fn, "D2 (A')", 16));
      SMOE_RETURN_IF_ERROR(detail::check_ptr(a.H, fn, "H", 16));
      SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dH, fn, "dH", 16));
      SMOE_RETURN_IF_ERROR(detail::check_ptr(a.scores, fn, "scores", 4));
      SMOE_RETURN_IF_ERROR(detail::check_ptr(a.scatter, fn, "scatter", 4));
      SMOE_RETURN_IF_ERROR(detail::check_ptr(a.ds_partial, fn, "ds_partial", 4));
      break;
  }
  const Choice c = choose_varlen_m(a, sm_count);
  if (print_enabled())
    std::fprintf(stderr, "[smoe engine] varlen_m %s rows=%lld N=%d K=%d E=%d gather=%d grid<=%d\n", c.name,
                 static_cast<long long>(a.rows), a.N, a.K, a.num_experts, a.gather_idx != nullptr, sm_count);
  if (a.epilogue == Epilogue::kDSwiGLU)
    return c.pingpong ? inst::da_dswiglu_pp<128>(a, sm_count, stream) : inst::da_dswiglu<128>(a, sm_count, stream);
  if (a.epilogue == Epilogue::kSwiGLU) {
    if (c.pingpong) return inst::up_swiglu_pp<128>(a, sm_count, stream);
    return c.bn == 256 ? inst::up_swiglu<256>(a, sm_count, stream) : inst::up_swiglu<128>(a, sm_count, stream);
  }
  if (a.b_major == WeightMajor::kNK) {
    if (c.pingpong)
      return c.bn == 192 ? inst::down_store_pp<192>(a, sm_count, stream) : inst::down_store_pp<128>(a, sm_count, stream);
    return c.bn == 256 ? inst::down_store<256>(a, sm_count, stream) : inst::down_store<128>(a, sm_count, stream);
  }
  if (c.pingpong)
    return c.bn == 192 ? inst::dx_store_pp<192>(a, sm_count, stream) : inst::dx_store_pp<128>(a, sm_count, stream);
  return c.bn == 256 ? inst::dx_store<256>(a, sm_count, stream) : inst::dx_store<128>(a, sm_count, stream);
}

Status varlen_k(const VarlenKArgs& a, int sm_count, cudaStream_t stream) {
  const char* fn = "engine::varlen_k";
  if (a.num_experts < 1 || a.num_experts > kMaxExperts)
    return rule(fn, "num_experts", a.num_experts, "must be in [1, 512]");
  SMOE_RETURN_IF_ERROR(check_extent(fn, "M", a.M));
  SMOE_RETURN_IF_ERROR(check_extent(fn, "N", a.N));
  if (a.rows < 0 || a.rows > kMaxRows) return rule(fn, "rows", a.rows, "must be in [0, 2^31)");
  if (a.ld_p < a.M || a.ld_p % 8 != 0) return rule(fn, "ld_p", a.ld_p, "must be >= M and a multiple of 8");
  if (a.ld_q < a.N || a.ld_q % 8 != 0) return rule(fn, "ld_q", a.ld_q, "must be >= N and a multiple of 8");
  if ((a.gather_p == nullptr) == (a.gather_q == nullptr))
    return detail::make_status(StatusCode::kInvalidArgument,
                               "engine::varlen_k: exactly one of gather_p / gather_q must be non-null "
                               "(one operand gathered by cp.async, the other contiguous by TMA)");
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.expert_offset, fn, "expert_offset", 4));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.P, fn, "P", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.Q, fn, "Q", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.D, fn, "D", 16));
  if (a.gather_p) SMOE_RETURN_IF_ERROR(detail::check_ptr(a.gather_p, fn, "gather_p", 4));
  if (a.gather_q) SMOE_RETURN_IF_ERROR(detail::check_ptr(a.gather_q, fn, "gather_q", 4));
  const Choice c = choose_varlen_k(a, sm_count);
  if (print_enabled())
    std::fprintf(stderr, "[smoe engine] varlen_k %s rows=%lld M=%d N=%d E=%d gather=(%d,%d) grid<=%d\n", c.name,
                 static_cast<long long>(a.rows), a.M, a.N, a.num_experts, a.gather_p != nullptr,
                 a.gather_q != nullptr, sm_count);
  const VarlenKArgs t = as_gather_p(a);
  if (a.gather_p)
    return c.bn == 256 ? inst::dw_gather_p<256>(t, sm_count, stream) : inst::dw_gather_p<128>(t, sm_count, stream);
  return c.bn == 256 ? inst::dw_gather_p_t<256>(t, sm_count, stream) : inst::dw_gather_p_t<128>(t, sm_count, stream);
}

}  // namespace engine
}  // namespace smoe
