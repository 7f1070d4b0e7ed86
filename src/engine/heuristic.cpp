// Tile heuristic (BM = 128 unless the 64 x 256 pairs, BK = 64 throughout). The rules, and why:
//   * BN = 256 halves the B (weight) reloads per A row and gives 64x256x16 wgmma, the fastest
//     atom; it needs N % 256 == 0 (otherwise a quarter or more of the last column tile is padding)
//     and enough tiles to fill the machine: with T*K rows there are about T*K/128 * N/256 tiles;
//     below ~2 waves of the SM count, BN = 128 doubles the tile count and the balance wins.
//   * dA' (dSwiGLU epilogue) uses BN = 128 at 128 rows: its epilogue holds H, dH and A' values per
//     element and 64x128 keeps it inside the register budget next to the accumulator.
//   * varlen-K (dW): tiles are (E, M/128, N/BN) with a per-expert reduction; BN = 256 when
//     N % 256 == 0 and E * M/128 * N/256 still gives >= 2 waves, else 128. At BN = 256 with an
//     even M-tile count, pairs along M share the Q tile by multicast.
// Measurements behind each rule: bench/results/h200/README.md and HISTORY.md (H200).
#include "engine/heuristic.h"

namespace smoe {
namespace engine {
namespace {

bool wide_tiles_fill(int64_t tiles_at_256, const DeviceFacts& dev) { return tiles_at_256 >= 2 * dev.sm_count; }

// Staged stores (EpiStoreStagedT, _pps / _pps2) for a ping-pong store GEMM with this K: 0 (none),
// 1 (one 32-row slab per warpgroup) or 2 (two, a 64-row buffer). Measured on the H200 at 6682527:
// the short-K GEMMs gain 3-11% (K = n = 256: down-proj 30B n256 2.58 vs 2.86-2.95 ms; K = 2n = 512:
// dX~ 30B n256 3.63 vs 3.96-4.11; K = 128: narrow E512 n128 down-proj 0.157 vs 0.173), while from
// K = 1024 staging is even or 2-4% slower: there the stores still cost HBM bandwidth, which
// staging cannot buy back. Two slabs win at K = 256 (30B n256 down-proj 2.56-2.61 -> 2.16-2.20
// ms) and lose their pipeline stage's worth at K = 512 (f57e909).
int staged_store(int K, const Overrides& o) {
  if (o.staged_store >= 0) return o.staged_store;
  return K <= kStagedStore2MaxK ? 2 : K <= kStagedStoreMaxK ? 1 : 0;
}

// The built instantiation of (kind, schedule, BN, cluster) for a 128-row tile, a ping-pong store
// GEMM taking its staged twin where one is built and staged_store asks for it.
std::optional<EngineConfig> built_varlen_m(Kind kind, bool pp, int bn, int cluster, int K, const Overrides& o) {
  const bool store = kind == Kind::down_store || kind == Kind::dx_store;
  if (const int staged = pp && store ? staged_store(K, o) : 0) {
    const EngineConfig c{kind, staged == 2 ? Sched::kPingPongStaged2 : Sched::kPingPongStaged, bn, cluster};
    if (is_built(c)) return c;
  }
  const EngineConfig c{kind, pp ? Sched::kPingPong : Sched::kCoop, bn, cluster};
  if (is_built(c)) return c;
  return std::nullopt;
}

}  // namespace

std::optional<EngineConfig> choose_varlen_m(const VarlenMArgs& a, const DeviceFacts& dev, const Overrides& o) {
  const Kind kind = kind_of(a);
  const bool store = a.epilogue == Epilogue::kStore;
  const int64_t tiles256 = (a.rows / 128) * (a.N / 256);
  // Cluster of 2 along M (B multicast) when one expert's weight matrix is larger than half the
  // L2 (kClusterMinWeightBytes): its B panels then stream from HBM again for every wave of M-tiles,
  // and multicast halves that traffic (DeepSeek-V3.2: up-proj 33.6 -> 29.0 ms, down-proj 18.0 ->
  // 13.2, dX~ 34.2 -> 27.9). Not with few rows per expert: a pair's second M-tile is idle
  // padding when an expert's M-tile count is odd (narrow-expert shapes lost 4-8% with it).
  const int64_t weight_bytes = int64_t{a.N} * a.K * 2;
  const bool big_weights =
      weight_bytes > kClusterMinWeightBytes && a.rows >= int64_t{kClusterMinRowsPerExpert} * a.num_experts;
  ForcedSched fs = o.sched;
  const int forced = o.bn_m;
  const int fc = o.cluster_m;
  // The gathered GEMMs (up-proj: x, SwiGLU; dA': dO, dSwiGLU + dS): ping-pong 64 x 256 tiles in
  // 2-CTA pairs sharing B by multicast (up_swiglu_pp64_c2<256>). Per FLOP it gathers half the A
  // bytes of 128 x 128 (the gathered cp.async loads are what its mainloop waits for) and, with the
  // pair, reads no more B from L2; ping-pong still hides the epilogue. Against 128 x 128 ping-pong
  // (H200): OLMoE 4.41 -> 3.64 ms, Qwen3-235B 11.8 -> 10.4, 120B 7.8 -> 7.0, 30B n512 3.80 -> 3.31,
  // T20000 d3072 n768 2.10 -> 1.81; ties at d <= 1536 with N = 512. Not with one expert's weights
  // above half the L2 (a pair covers 128 rows, so B streams from HBM twice as often as with
  // 128 x 128 pairs; wide E4 K1 n8192 lost 11%) and not with a single column tile (N = 256:
  // narrow E512 K8 n128 lost 7%).
  const bool pp64_shape = !store && a.N % 256 == 0;
  if (fs == ForcedSched::kPingPong64 && !pp64_shape) fs = ForcedSched::kNone;  // gathered GEMMs only
  // dA' only from K = d = 2048: its 64 x 256 pairs gained 4-10% at d >= 2048 (Qwen3-235B 7.05 ->
  // 6.38 ms, 120B 4.49 -> 4.17, OLMoE 2.75 -> 2.64) and lost 1-2% at d = 1536 (7B n512 0.462 vs
  // 0.455): its epilogue is twice the up-proj's per element, and a short mainloop hides less.
  const bool pp64_rule =
      pp64_shape && a.N >= 512 && !big_weights && (a.epilogue == Epilogue::kSwiGLU || a.K >= 2048);
  const bool pp64 = fs == ForcedSched::kPingPong64 || (fs == ForcedSched::kNone && forced == 0 && pp64_rule);
  if (pp64) {
    const EngineConfig c{kind, Sched::kPingPong64, 256, fc ? fc : 2};
    if (is_built(c)) return c;
    fs = ForcedSched::kNone;  // no such twin (a forced cluster 1): the rule below
  }
  // Schedule (measured over 19 shapes): ping-pong hides one warpgroup's epilogue under the
  // other's mainloop, but its 128 x BN tile per warpgroup (BN <= 192, the accumulator's
  // registers) reloads more operand bytes per FLOP than cooperative 128 x 256. So ping-pong where
  // the epilogue is long next to the mainloop: every dA' (dSwiGLU: H loads, dH, A', dS per
  // element), and SwiGLU / store GEMMs with K <= kPingPongMaxK (K = n or 2n, or a short d);
  // cooperative 128 x 256 on long-K GEMMs, where the operand traffic is what limits.
  const int pp_max_k = o.pingpong_max_k >= 0 ? o.pingpong_max_k : kPingPongMaxK;
  bool pp = a.epilogue == Epilogue::kDSwiGLU || a.K <= pp_max_k;
  if (fs != ForcedSched::kNone) pp = fs == ForcedSched::kPingPong;
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
    const bool wide = a.N % 256 == 0 && (forced ? forced == 256 : wide_tiles_fill(tiles256, dev));
    bn = wide ? 256 : 128;
  }
  const int cluster = fc ? fc : big_weights ? 2 : 1;
  if (auto c = built_varlen_m(kind, pp, bn, cluster, a.K, o)) return c;
  if (cluster != 1) return built_varlen_m(kind, pp, bn, 1, a.K, o);  // no clustered twin
  return std::nullopt;
}

Kind kind_of(const VarlenMArgs& a) {
  return a.epilogue == Epilogue::kSwiGLU    ? Kind::up_swiglu
         : a.epilogue == Epilogue::kDSwiGLU ? Kind::da_dswiglu
         : a.b_major == WeightMajor::kNK    ? Kind::down_store
                                            : Kind::dx_store;
}
Kind kind_of(const VarlenKArgs& a) {
  return !a.gather_p && !a.gather_q ? Kind::dw_tma : a.gather_p ? Kind::dw_gather_p : Kind::dw_gather_p_t;
}

VarlenKArgs as_gather_p(const VarlenKArgs& a) {
  if (a.gather_p || !a.gather_q) return a;  // P gathered, or neither (both by TMA, as given)
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

std::optional<EngineConfig> choose_varlen_k(const VarlenKArgs& a_in, const DeviceFacts& dev, const Overrides& o) {
  const VarlenKArgs a = as_gather_p(a_in);
  const int m_tiles = (a.M + 127) / 128;
  const int64_t tiles256 = static_cast<int64_t>(a.num_experts) * m_tiles * (a.N / 256);
  const bool wide = a.N % 256 == 0 && (o.bn_k ? o.bn_k == 256 : wide_tiles_fill(tiles256, dev));
  // A pair along M halves the Q traffic from L2 (each Q tile is re-read for every M-tile); pairs
  // need an even M-tile count (otherwise a quarter or more of the last pair's work is padding) and
  // are built for BN = 256 only (a forced cluster of 2 is ignored at BN = 128).
  const bool c2 = wide && (o.cluster_k ? o.cluster_k == 2 : m_tiles % 2 == 0);
  const Kind kind = kind_of(a_in);
  const EngineConfig c{kind, Sched::kCoop, wide ? 256 : 128, c2 ? 2 : 1};
  if (is_built(c)) return c;
  return std::nullopt;
}

}  // namespace engine
}  // namespace smoe
