// Maps the host argument structs (engine.h) to one kernel instantiation: epilogue parameters,
// device Params, persistent grid. Included only by the src/engine/inst_*.cu files.
#pragma once

#include "engine/engine.h"
#include "engine/gemm_kernel.cuh"

namespace smoe {
namespace engine {

constexpr int kDSwiGLUTileN = 128;

inline EpiStore::Params epi_params(EpiStore*, const VarlenMArgs& a, int) { return {a.D, a.N}; }
inline EpiSwiGLU::Params epi_params(EpiSwiGLU*, const VarlenMArgs& a, int) { return {a.D, a.D2, a.N}; }
inline EpiDSwiGLU::Params epi_params(EpiDSwiGLU*, const VarlenMArgs& a, int n_tiles) {
  return {a.H, a.dH, a.D2, a.scores, a.scatter, a.ds_partial, a.N, n_tiles};
}

template <int BN, GMMA::Major kMajorB>
using VarlenMConfig = TileConfig<BN, BN == 256 ? 4 : 6, GMMA::Major::K, kMajorB>;

template <class Cfg, ALoad kALoad, class Epi>
Status run_varlen_m(const VarlenMArgs& a, int sm_count, cudaStream_t stream, const char* name) {
  using K = VarlenMKernel<Cfg, kALoad, Epi>;
  if (a.rows == 0) return launch<K>(typename K::Params{}, 0, stream, name);
  const int n_tiles = (a.N + Cfg::BN - 1) / Cfg::BN;
  const auto p = K::make_params(a.num_experts, a.N, a.K, a.A, static_cast<int>(a.a_rows), a.gather_idx,
                                a.B, a.expert_offset, epi_params(static_cast<Epi*>(nullptr), a, n_tiles));
  // Tiles: sum_e ceil(m_e / BM) <= rows / BM + E, times the column tiles.
  const int64_t tiles = (a.rows / Cfg::BM + a.num_experts) * static_cast<int64_t>(n_tiles);
  const int grid = static_cast<int>(tiles < sm_count ? tiles : sm_count);
  return launch<K>(p, grid, stream, name);
}

inline EpiStore::Params epi_params_k(EpiStore*, const VarlenKArgs& a) { return {a.D, a.N}; }
inline EpiStoreT::Params epi_params_k(EpiStoreT*, const VarlenKArgs& a) { return {a.D, a.M, a.N}; }

// a: P gathered, Q contiguous (engine.cu swaps a gather_q call into this form).
template <class Cfg, class Epi>
Status run_varlen_k(const VarlenKArgs& a, int sm_count, cudaStream_t stream, const char* name) {
  using K = VarlenKKernel<Cfg, Epi>;
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
  p.Q = reinterpret_cast<const Bf16*>(a.Q);
  p.ld_q = a.ld_q;
  p.gather_q = a.gather_q;
  p.epi = epi_params_k(static_cast<Epi*>(nullptr), a);
  K::make_tma(p, a.rows);
  const int64_t tiles = static_cast<int64_t>(a.num_experts) * p.m_tiles * p.n_tiles;
  const int grid = static_cast<int>(tiles < sm_count ? tiles : sm_count);
  return launch<K>(p, grid, stream, name);
}

}  // namespace engine
}  // namespace smoe
