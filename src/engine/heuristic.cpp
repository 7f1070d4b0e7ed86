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

// Devices with less HBM bandwidth than the H200 (H100 SXM 3.35 TB/s, PCIe 2.0, H800) against the
// same 132 SMs and 50 MB of L2: the H100 measured other winners than the H200 on the same shapes
// (smoe_tune over 41 shapes, bench/results/h100/heuristic_fit.md). Unknown bandwidth (0): the H200's rules.
bool lean_hbm(const DeviceFacts& dev) { return dev.hbm_gbps > 0 && dev.hbm_gbps < kLeanHbmGbps; }

// Lean HBM, 2-CTA clusters (B multicast): from 8 MiB of weights per expert for the store GEMMs when
// the output is at least 3072 wide or not a multiple of 256 (H100, 28 keys: 120B's dX~ 12.2 -> 6.5 ms,
// Qwen3-235B's down-proj x1.63, Kimi-K2 x1.8-1.95; at N = 2048 the pair lost: E8 K1 n16384's x0.90).
// N = 2880 (ping-pong 128 x 192 at any K): gpt-oss-20b's and d2880's dX~ (31.6 MiB) gained x1.2 / x1.7
// over the unpaired ping-pong; their down-proj (15.8 MiB) first measured a tie and x1.23 (21eb13d),
// re-measured x1.11 and x1.38 alone (f2489b8) and x1.14-1.19 in the layer (gpt-oss-20b, four rounds:
// bench/results/h100/layer_candidates.md), hence no 24 MiB floor there any more; held out (12 shapes with
// N % 256 != 0 below 3072, 16 stages it pairs, six interleaved rounds) x1.19 geomean, x1.18-1.23 per round
// (bench/results/h100/rule_patches_ab.md). From 16 MiB for the gathered GEMMs (up-proj: Qwen2-57B x1.54,
// DeepSeek-V3.2 x2.1; T12345 at 13.8 MiB and Qwen1.5 at 11 MiB lost 4-7%). Experts must average
// more than one 128-row tile (a pair of M-tiles shares each B tile; at 64 rows per expert the
// second is padding: few d4096 n1536 T2048's dX~ lost 8%); 170 rows already gained (E384 K8).
bool lean_cluster(const VarlenMArgs& a, int64_t weight_bytes) {
  if (a.rows <= int64_t{128} * a.num_experts) return false;
  if (a.epilogue == Epilogue::kStore)
    return weight_bytes >= (int64_t{8} << 20) && (a.N >= 3072 || a.N % 256 != 0);
  return weight_bytes >= (int64_t{16} << 20);
}

// Lean HBM, the 64 x 256 pairs of the gathered GEMMs (N % 256 == 0 checked by the caller).
// up-proj: only where experts average at most one 128-row tile. Alone they won 0-4% at d <= 2048
// (7B, K1 E16, d1024 n512 E256), but in the layer cooperative 128 x 256 beat them on all 11 such shapes
// (x1.02-1.12 in the lowest round, 7 of them in all four rounds: bench/results/h100/layer_candidates.md);
// at 64 rows per expert (few d4096 n1536 T2048, 24 MiB) the pairs won x1.04-1.06 in every round and 4%
// alone: a pair then covers the expert's rows once, so its weights stream once whatever their size.
// Held out (19 drawn shapes it changes, six rounds): x1.07 geomean, x1.06-1.10 per round. It loses where it
// takes the pairs away on d1024 with 1024-2048 rows per expert (x0.96-0.97) and T3001 d1536 (x0.93): no clean
// line separates those from the d768-2048 shapes that gain (bench/results/h100/rule_patches_ab.md).
// dA': from N = 768, at d <= 2048 or N >= 1536 (OLMoE x1.07, 7B n1024 x1.06, Qwen3-235B, DSV2;
// 120B's N = 1024 at d = 4096 lost 9%), below 16 MiB of weights (above, the 128 x 128 pairs won:
// DeepSeek-V3.2 x1.18, Qwen2-57B x1.21 over the 64 x 256 pairs).
bool lean_pp64(const VarlenMArgs& a, int64_t weight_bytes) {
  if (a.epilogue == Epilogue::kSwiGLU)
    return a.N >= 512 && a.rows <= int64_t{128} * a.num_experts;
  if (a.epilogue == Epilogue::kDSwiGLU) return a.N >= 768 && (a.K <= 2048 || a.N >= 1536) && weight_bytes < (int64_t{16} << 20);
  return false;
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
  const bool lean = lean_hbm(dev);
  const bool big_weights = lean ? lean_cluster(a, weight_bytes)
                                : weight_bytes > kClusterMinWeightBytes &&
                                      a.rows >= int64_t{kClusterMinRowsPerExpert} * a.num_experts;
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
  // dA': its 64 x 256 pairs gained 4-10% at d >= 2048 (Qwen3-235B 7.05 -> 6.38 ms, 120B 4.49 ->
  // 4.17, OLMoE 2.75 -> 2.64); at d = 1536 they once measured 1-2% slower (7B n512 0.462 vs 0.455,
  // before the predicated stores), and the rule then stopped at K = 2048.
  // Re-measured by the tuner at b984359 / 16e558c (H200, bench/results/h200/tuner.md): dA' gains
  // from the pairs at d = 1536 too (7B n512 / n1024: x1.07 / x1.09 alone, x1.08 in the layer) and
  // with weights above half the L2 (DeepSeek-V3.2 x1.14, wide d8192 n2048 x1.22, E16 K1 n8192
  // x1.08), so dA' takes them at any K and any weight size; the up-projection keeps both limits.
  const bool dsw = a.epilogue == Epilogue::kDSwiGLU;
  // Lean HBM, dA' at d >= kLeanCoopDSwiGLUMinK: cooperative 128 x 256 (64 x 256 per warpgroup; its
  // rows' H and scores streamed after the mainloop), paired as the lean cluster rule says. It reads
  // a third fewer operand bytes per FLOP than ping-pong 128 x 128, and at long K that outweighs the
  // epilogue the tensor cores wait for. smoe_tune on the H100 (0bb2259 + this tile, 41 shapes,
  // bench/results/h100/heuristic_fit.md): at d >= 3584 its pick beat the rule before on all 18 keys
  // (x1.01-1.50: DeepSeek-V3.2 19.7 -> 13.2 ms, DSV2 d5120 n1536 x1.40, Qwen3-235B x1.20, 120B
  // x1.14), dA' regret 1.135 -> 1.007; at d <= 3072 it lost 3-8% (7B, OLMoE, Qwen3-Next, T20000
  // d3072, K1 E16 d2048). In the layer DeepSeek-V3.2's dA' went 26.6-27.4 -> 15.4-15.5 ms (the
  // 128 x 128 pairs ran 1.7x their isolated time there; this tile 1.16x).
  if (lean && dsw && fs == ForcedSched::kNone && forced == 0 && a.N % 256 == 0 && a.K >= kLeanCoopDSwiGLUMinK) {
    const EngineConfig c{kind, Sched::kCoop, 256, fc ? fc : big_weights ? 2 : 1};
    if (is_built(c)) return c;
  }
  const bool pp64_rule = lean ? pp64_shape && lean_pp64(a, weight_bytes)
                              : pp64_shape && a.N >= 512 && (dsw || (!big_weights && a.epilogue == Epilogue::kSwiGLU));
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
  // That trade needs BN = 256: with N % 256 != 0 a long-K GEMM would run cooperative 128 x 128,
  // which reads as many operand bytes per FLOP as ping-pong 128 x 128 and more than 128 x 192, and
  // hides nothing. So ping-pong there too. Tuner at 16e558c (H200, bench/results/h200/tuner.md),
  // wide d2880 n2880 E128 K4: down-proj (N 2880, K 2880) x1.12 and dX~ (K 5760) x1.22 at 128 x 192,
  // up-proj (N 5760) x1.06 at 128 x 128; d6144 n2880's dA' (N 2880) is ping-pong already.
  // SMOE_ENGINE_PP_MAX_K, when set, is the whole rule for SwiGLU / store GEMMs: ping-pong up to it,
  // cooperative above (no N % 256 or lean-HBM exceptions), as the switch documents.
  const bool pp_k_forced = o.pingpong_max_k >= 0;
  const int pp_max_k = pp_k_forced ? o.pingpong_max_k : kPingPongMaxK;
  bool pp = a.epilogue == Epilogue::kDSwiGLU || a.K <= pp_max_k || (!pp_k_forced && a.N % 256 != 0);
  // The lean rules below trade ping-pong for cooperative 128 x 256, so they apply only where that is
  // what cooperative runs (N % 256 == 0 and enough wide tiles for 2 waves; else it would be 128 x 128).
  const bool coop_wide = a.N % 256 == 0 && wide_tiles_fill(tiles256, dev);
  // Lean HBM: the up-projection's ping-pong 128 x 128 lost to cooperative 128 x 256 at every
  // K (1.4B K = 768 x1.06, OLMoE K = 2048 x1.10, 30B n512 K = 4096 x1.16 on the H100); it keeps
  // ping-pong where BN = 256 cannot run (N % 256 != 0) or through the 64 x 256 pairs above.
  if (lean && !pp_k_forced && a.epilogue == Epilogue::kSwiGLU && coop_wide) pp = false;
  // Lean HBM, dX~ without a pair above the staged-store K: ping-pong 128 x 192 from registers ran
  // 1.2-1.7x the cooperative 128 x 256 at N = 2048 (Qwen3-Next 4.23 vs 2.45 ms, OLMoE 4.26 vs 3.45,
  // 120B's unpaired 12.2 vs 6.7), which stayed within 5% of the fastest candidate on every such key.
  if (lean && !pp_k_forced && kind == Kind::dx_store && !big_weights && coop_wide && a.N >= 2048 &&
      a.K > kStagedStoreMaxK)
    pp = false;
  if (fs != ForcedSched::kNone) pp = fs == ForcedSched::kPingPong;
  int bn;
  if (pp) {
    // Stores: 128 x 192 (more B reuse per A row than 128 x 128) unless the last column tile would
    // waste more than 1/8 of the columns; the fused epilogues hold more per element: 128 x 128.
    // Lean HBM: exactly 1/8 (N = 1024) already loses (H100: narrow E512 K8 n128's down-proj
    // x1.21, d1024 n512 E256's dX~ x1.12 at 128 x 128).
    const int64_t pad192 = (a.N + 191) / 192 * 192 - a.N;
    const bool wide = store && (forced ? forced == 192 : lean ? pad192 * 8 < a.N : pad192 * 8 <= a.N);
    bn = wide ? 192 : 128;
  } else if (a.epilogue == Epilogue::kDSwiGLU) {
    // 64 x 128 per warpgroup by default. Cooperative 128 x 256 (64 x 256 per warpgroup, the
    // registers of the 64 x 256 ping-pong) here only when forced (a tuner candidate); the lean rule
    // above returns it directly at d >= kLeanCoopDSwiGLUMinK.
    bn = forced == 256 && a.N % 256 == 0 ? 256 : 128;
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
