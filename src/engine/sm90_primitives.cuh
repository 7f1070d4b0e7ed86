// Small sm_90a device primitives the engine's roles share: cp.async with zero fill, the cp.async
// arrival on an mbarrier, the generic->async proxy fence, TMA store groups. Everything else (mbarriers, TMA, wgmma)
// comes from CuTe / cutlass::arch.
#pragma once

#include <cstdint>

#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cute/arch/cluster_sm90.hpp"

namespace smoe {
namespace engine {

// 16 bytes global -> shared; src_bytes = 0 writes 16 zero bytes (the source is not read, but it
// must still be a valid address expression).
__device__ __forceinline__ void cp_async_16_zfill(uint32_t smem_addr, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}

// The mbarrier counts one arrival of this thread once all its earlier cp.async have landed
// (.noinc: the arrival is one of the barrier's expected arrivals).
__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t* bar) {
  cutlass::arch::cpasync_barrier_arrive_noinc(bar);
}

// cp.async writes shared memory through the generic proxy and wgmma reads it through the async
// proxy: the consumer orders the two after it acquired the stage's barrier.
__device__ __forceinline__ void fence_generic_to_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void st_shared_u32(uint32_t smem_addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(smem_addr), "r"(v) : "memory");
}

// ---- TMA stores: the bulk groups of the issuing thread ------------------------------------------
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Its stores have read shared memory (the buffer may be written again) / have completed.
__device__ __forceinline__ void bulk_wait_read_all() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

}  // namespace engine
}  // namespace smoe
