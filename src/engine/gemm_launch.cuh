// Maps a typed configuration (config.h) to one kernel instantiation: epilogue parameters (each
// epilogue's own make function, epilogue/*.h), device Params, persistent grid. Included only by the
// generated instance files (instance.cu.in).
#pragma once

#include "engine/config.h"
#include "engine/engine.h"
#include "engine/epilogue/dswiglu.cuh"
#include "engine/epilogue/store.cuh"
#include "engine/epilogue/store_staged.cuh"
#include "engine/epilogue/store_tma.cuh"
#include "engine/epilogue/swiglu.cuh"
#include "engine/gemm_kernel.cuh"

namespace smoe {
namespace engine {

inline StoreParams epi_params(EpiStore*, const VarlenMArgs& a) { return store_params(a); }
template <int kSlabs>
inline StoreParams epi_params(EpiStoreStagedT<kSlabs>*, const VarlenMArgs& a) { return store_params(a); }
template <bool kHalves>
inline EpiSwiGLUParams epi_params(EpiSwiGLUT<kHalves>*, const VarlenMArgs& a) { return swiglu_params(a); }
template <bool kHalves>
inline EpiDSwiGLUParams epi_params(EpiDSwiGLUT<kHalves>*, const VarlenMArgs& a) { return dswiglu_params(a); }

// The store epilogue of a schedule.
template <Sched S>
using StoreEpi = std::conditional_t<S == Sched::kPingPongStaged, EpiStoreStagedT<1>,
                                    std::conditional_t<S == Sched::kPingPongStaged2, EpiStoreStagedT<2>, EpiStore>>;

// kCluster: 1 or 2 (a pair along M, B multicast).
template <int BN, GMMA::Major kMajorB, Sched kSched, int kCluster>
using VarlenMConfig =
    TileConfig<BN, stages_for(BN, EpiSmem<StoreEpi<kSched>, BN>::kBytes, kSched == Sched::kPingPong64 ? 64 : 128),
               GMMA::Major::K, kMajorB, kSched != Sched::kCoop, kCluster,
               kSched == Sched::kPingPong64 ? 64 : 128>;

template <class Cfg, ALoad kALoad, class Epi>
Status run_varlen_m(const VarlenMArgs& a, int sm_count, cudaStream_t stream, LaunchStep step, const char* name) {
  using K = VarlenMKernel<Cfg, kALoad, Epi>;  // varlen_m (engine.cpp) returned already if rows == 0
  if (step == LaunchStep::kSetup) return launch_setup<K>(sm_count, name, nullptr);
  const int n_tiles = (a.N + Cfg::BN - 1) / Cfg::BN;
  const auto p = K::make_params(a.num_experts, a.N, a.K, a.A, static_cast<int>(a.a_rows), a.gather_idx,
                                a.B, a.B2, a.b_expert_stride, a.expert_offset, epi_params(static_cast<Epi*>(nullptr), a));
  // Units: sum_e ceil(m_e / (C BM)) <= rows / (C BM) + E, times the column tiles.
  const int64_t units = (a.rows / (Cfg::BM * Cfg::kClusterM) + a.num_experts) * static_cast<int64_t>(n_tiles);
  return launch<K>(p, units, sm_count, stream, name);
}

// a: P gathered (kGatherP), Q contiguous (as_gather_p, heuristic.cpp, swaps a gather_q call into this form); or
// neither gathered (both by TMA).
template <class Cfg, class Epi, bool kGatherP = true>
Status run_varlen_k(const VarlenKArgs& a, int sm_count, cudaStream_t stream, LaunchStep step, const char* name) {
  using K = VarlenKKernel<Cfg, Epi, kGatherP>;
  if (step == LaunchStep::kSetup) return launch_setup<K>(sm_count, name, nullptr);
  typename K::Params p;
  p.E = a.num_experts;
  p.M = a.M;
  p.N = a.N;
  p.m_tiles = (a.M + Cfg::BM - 1) / Cfg::BM;
  p.n_tiles = (a.N + Cfg::BN - 1) / Cfg::BN;
  p.expert_offset = a.expert_offset;
  p.P = reinterpret_cast<const Bf16*>(a.P);
  p.ld_p = a.ld_p;
  p.gather_p = a.gather_p;
  p.store_streaming = store_streaming();
  p.epi = store_k_params(a);
  K::make_tma(p, reinterpret_cast<const Bf16*>(a.Q), a.ld_q, a.rows);
  // Units: C adjacent M-tiles of one (expert, N-tile) each (one tile without a cluster).
  const int64_t units = static_cast<int64_t>(a.num_experts) * ((p.m_tiles + Cfg::kClusterM - 1) / Cfg::kClusterM) *
                        p.n_tiles;
  return launch<K>(p, units, sm_count, stream, name);
}

// The engine's instantiations, one per (kind, BN, schedule, cluster): each file generated from
// src/engine/instance.cu.in (CMakeLists.txt) defines one inst:: function as Instance<...>::run.
template <Kind, int BN, Sched, int C>
struct Instance;
template <int BN, Sched S, int C>
struct Instance<Kind::up_swiglu, BN, S, C> {  // gathered x, W1 K-major, SwiGLU epilogue
  static Status run(const VarlenMArgs& a, int sms, cudaStream_t s, LaunchStep step, const char* name) {
    using Cfg = VarlenMConfig<BN, GMMA::Major::K, S, C>;
    if (a.halves) return run_varlen_m<Cfg, ALoad::kGather, EpiSwiGLUT<true>>(a, sms, s, step, name);  // two tensors
    return run_varlen_m<Cfg, ALoad::kGather, EpiSwiGLU>(a, sms, s, step, name);
  }
};
template <int BN, Sched S, int C>
struct Instance<Kind::down_store, BN, S, C> {  // A by TMA, W2 K-major
  static Status run(const VarlenMArgs& a, int sms, cudaStream_t s, LaunchStep step, const char* name) {
    return run_varlen_m<VarlenMConfig<BN, GMMA::Major::K, S, C>, ALoad::kTma, StoreEpi<S>>(a, sms, s, step, name);
  }
};
template <int BN, Sched S, int C>
struct Instance<Kind::dx_store, BN, S, C> {  // dH by TMA, W1 MN-major
  static Status run(const VarlenMArgs& a, int sms, cudaStream_t s, LaunchStep step, const char* name) {
    return run_varlen_m<VarlenMConfig<BN, GMMA::Major::MN, S, C>, ALoad::kTma, StoreEpi<S>>(a, sms, s, step, name);
  }
};
template <int BN, Sched S, int C>
struct Instance<Kind::da_dswiglu, BN, S, C> {  // gathered dO, W2 MN-major, dSwiGLU + dS epilogue
  static Status run(const VarlenMArgs& a, int sms, cudaStream_t s, LaunchStep step, const char* name) {
    using Cfg = VarlenMConfig<BN, GMMA::Major::MN, S, C>;
    if (a.halves) return run_varlen_m<Cfg, ALoad::kGather, EpiDSwiGLUT<true>>(a, sms, s, step, name);
    return run_varlen_m<Cfg, ALoad::kGather, EpiDSwiGLU>(a, sms, s, step, name);
  }
};
// The varlen-K epilogue stages 64 x 64 pieces in shared memory for TMA stores (EpiStoreTma): its
// 16 KB come out of the pipeline's budget (BN 256: 4 stages either way, BN 128: 6).
template <int BN, int C>
using VarlenKConfig =
    TileConfig<BN, stages_for(BN, EpiSmem<EpiStoreTma<true>, BN>::kBytes), GMMA::Major::MN, GMMA::Major::MN, false, C>;
template <int BN, Sched S, int C>
struct Instance<Kind::dw_gather_p, BN, S, C> {  // P gathered, Q by TMA, D [E][M][N]
  static_assert(S == Sched::kCoop && (C == 1 || C == 2), "varlen-K: cooperative, cluster 1 or 2 along M");
  static Status run(const VarlenKArgs& a, int sms, cudaStream_t s, LaunchStep step, const char* name) {
    return run_varlen_k<VarlenKConfig<BN, C>, EpiStoreTma<false>>(a, sms, s, step, name);
  }
};
template <int BN, Sched S, int C>
struct Instance<Kind::dw_gather_p_t, BN, S, C> {  // P gathered, Q by TMA, D stored transposed
  static_assert(S == Sched::kCoop && (C == 1 || C == 2), "varlen-K: cooperative, cluster 1 or 2 along M");
  static Status run(const VarlenKArgs& a, int sms, cudaStream_t s, LaunchStep step, const char* name) {
    return run_varlen_k<VarlenKConfig<BN, C>, EpiStoreTma<true>>(a, sms, s, step, name);
  }
};
template <int BN, Sched S, int C>
struct Instance<Kind::dw_tma, BN, S, C> {  // P and Q contiguous, both by TMA, D [E][M][N]
  static_assert(S == Sched::kCoop && (C == 1 || C == 2), "varlen-K: cooperative, cluster 1 or 2 along M");
  static Status run(const VarlenKArgs& a, int sms, cudaStream_t s, LaunchStep step, const char* name) {
    return run_varlen_k<VarlenKConfig<BN, C>, EpiStoreTma<false>, false>(a, sms, s, step, name);
  }
};

}  // namespace engine
}  // namespace smoe
