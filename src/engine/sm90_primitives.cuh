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

// Eight 16-byte copies, row i from src[i] to dst + i * kDstStep, zero-filled where i * kRowStep >=
// lim (the row lies past the end), in one asm statement: the eight sources are distinct operands,
// so ptxas keeps them in eight register pairs. Issued one by one (cp_async_16_zfill in a loop), it
// formed every address in the same pair, and each copy's address waited until the previous copy had
// read its operands (twelfth session, daa3d48; bench/results/h200/HISTORY.md).
template <uint32_t kDstStep, int kRowStep>
__device__ __forceinline__ void cp_async_16_zfill_rows8(uint32_t dst, const int64_t (&src)[8], int lim) {
  asm volatile(
      "{\n .reg .pred p;\n"
      " setp.le.s32 p, %1, 0;\n cp.async.cg.shared.global [%0], [%2], 16, p;\n"
      " setp.le.s32 p, %1, %17;\n cp.async.cg.shared.global [%0+%10], [%3], 16, p;\n"
      " setp.le.s32 p, %1, %18;\n cp.async.cg.shared.global [%0+%11], [%4], 16, p;\n"
      " setp.le.s32 p, %1, %19;\n cp.async.cg.shared.global [%0+%12], [%5], 16, p;\n"
      " setp.le.s32 p, %1, %20;\n cp.async.cg.shared.global [%0+%13], [%6], 16, p;\n"
      " setp.le.s32 p, %1, %21;\n cp.async.cg.shared.global [%0+%14], [%7], 16, p;\n"
      " setp.le.s32 p, %1, %22;\n cp.async.cg.shared.global [%0+%15], [%8], 16, p;\n"
      " setp.le.s32 p, %1, %23;\n cp.async.cg.shared.global [%0+%16], [%9], 16, p;\n"
      "}\n" ::"r"(dst),
      "r"(lim), "l"(src[0]), "l"(src[1]), "l"(src[2]), "l"(src[3]), "l"(src[4]), "l"(src[5]), "l"(src[6]),
      "l"(src[7]), "n"(kDstStep), "n"(2 * kDstStep), "n"(3 * kDstStep), "n"(4 * kDstStep), "n"(5 * kDstStep),
      "n"(6 * kDstStep), "n"(7 * kDstStep), "n"(kRowStep), "n"(2 * kRowStep), "n"(3 * kRowStep),
      "n"(4 * kRowStep), "n"(5 * kRowStep), "n"(6 * kRowStep), "n"(7 * kRowStep)
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

// Four 8 x 8 bf16 matrices held in the MMA fragment layout (lane l: row l / 4, columns 2 (l % 4)
// and + 1; register i: matrix i) into shared memory: lane 8 i + r gives the address of row r of
// matrix i (16 contiguous bytes), or with kTrans of row r of its transpose, i.e. of column r.
template <bool kTrans>
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  if constexpr (kTrans)
    asm volatile("stmatrix.sync.aligned.x4.trans.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr),
                 "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
  else
    asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr), "r"(r0),
                 "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}

// ---- TMA stores: the bulk groups of the issuing thread ------------------------------------------
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Its stores have read shared memory (the buffer may be written again) / have completed.
__device__ __forceinline__ void bulk_wait_read_all() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

}  // namespace engine
}  // namespace smoe
