// Host side of the plain store epilogues (EpiStore, EpiStoreStagedT: varlen-M; EpiStoreTma:
// varlen-K): their device parameters, how a call's arguments map to them, and their rules.
#pragma once

#include "common/check.h"
#include "engine/args.h"

namespace smoe {
namespace engine {

// varlen-M: D [rows][N].
struct StoreParams {
  bf16* D;
  int64_t ld;  // N
};
inline StoreParams store_params(const VarlenMArgs& a) { return {a.D, a.N}; }

// varlen-K: D [E][M][N], or [E][N][M] for the transposed store (a Q-gathered call).
struct StoreKParams {
  bf16* D;
  int64_t M;  // the kernel's M: the stored matrix's row length when transposed
  int64_t N;
};
inline StoreKParams store_k_params(const VarlenKArgs& a) { return {a.D, a.M, a.N}; }

// A varlen-M call with the store epilogue: A by TMA (the grouped rows themselves), D written.
inline Status check_store_shape(const VarlenMArgs& a, const char* fn) {
  if (a.halves)
    return detail::make_status(StatusCode::kInvalidArgument,
                               detail::concat(fn, ": halves is a layout of H / dH (SwiGLU / dSwiGLU epilogues)"));
  return Status{};
}
inline Status check_store_pointers(const VarlenMArgs& a, const char* fn) { return detail::check_ptr(a.D, fn, "D", 16); }

}  // namespace engine
}  // namespace smoe
