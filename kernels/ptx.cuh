// The PTX instructions of the tensor-core kernels, one wrapper each (cp.async, ex2, and sm_90a's wgmma).
// Kept apart so that the CPU emulator of the tests (tests/emulator/ptx.cuh) can give each one its
// documented meaning while the kernels around them run unchanged.
#pragma once
#include <cstdint>

namespace ptx {

__device__ inline uint32_t shared_address(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// 16 bytes from global to shared memory without passing through registers; both 16-byte aligned.
__device__ inline void cp_async_16(void* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(shared)), "l"(global) : "memory");
}

// Closes this thread's group of the cp.async issued since the last commit.
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most the newest `pending_groups_left` committed groups of this thread are in
// flight (the caller then syncs the block before others read the copies).
template <int pending_groups_left>
__device__ inline void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending_groups_left) : "memory");
}

// 2^x on the special-function unit, subnormal inputs and results flushed to zero: one MUFU.EX2
// (exp2f adds the instructions that keep subnormal results).
__device__ inline float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- wgmma (sm_90a): a warpgroup's (4 warps, 128 threads) asynchronous matrix product ----------

// Shared memory written by the generic proxy (stores, cp.async) is visible to wgmma's reads, which
// go through the async proxy, only after this fence by the writing thread (then a barrier).
__device__ inline void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Orders this thread's earlier register and shared-memory accesses before the wgmma issued next.
__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

// Closes the group of the wgmma issued since the last commit.
__device__ inline void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// Waits until at most the newest `pending_groups_left` groups are in flight; only then may their
// accumulators be read and their shared operands refilled.
template <int pending_groups_left>
__device__ inline void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(pending_groups_left) : "memory");
}

// Keeps the compiler from moving an operand register's accesses across a wgmma fence or wait (it
// cannot see that the wgmma reads its operands and writes its accumulator late).
__device__ inline void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ inline void fence_operand(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }

// The fp32 accumulator registers of an m64n64 and an m64n128 product: the operand lists and the
// asm text naming them as %0, %1, ... (the m64n128 list is the m64n64 one and eight tiles more).
#define PTX_ACCUMULATOR_TILE(d, n) "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3])
#define PTX_M64N64_ACCUMULATOR(d)                                                                          \
  PTX_ACCUMULATOR_TILE(d, 0), PTX_ACCUMULATOR_TILE(d, 1), PTX_ACCUMULATOR_TILE(d, 2), PTX_ACCUMULATOR_TILE(d, 3), \
      PTX_ACCUMULATOR_TILE(d, 4), PTX_ACCUMULATOR_TILE(d, 5), PTX_ACCUMULATOR_TILE(d, 6), PTX_ACCUMULATOR_TILE(d, 7)
#define PTX_M64N128_ACCUMULATOR(d)                                                                            \
  PTX_M64N64_ACCUMULATOR(d), PTX_ACCUMULATOR_TILE(d, 8), PTX_ACCUMULATOR_TILE(d, 9), PTX_ACCUMULATOR_TILE(d, 10), \
      PTX_ACCUMULATOR_TILE(d, 11), PTX_ACCUMULATOR_TILE(d, 12), PTX_ACCUMULATOR_TILE(d, 13),                     \
      PTX_ACCUMULATOR_TILE(d, 14), PTX_ACCUMULATOR_TILE(d, 15)
#define PTX_ACCUMULATOR_NAMES_0_TO_31                                                                     \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                              \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define PTX_M64N64_ACCUMULATOR_TEXT "{" PTX_ACCUMULATOR_NAMES_0_TO_31 "}, "
#define PTX_M64N128_ACCUMULATOR_TEXT                                                                    \
  "{" PTX_ACCUMULATOR_NAMES_0_TO_31 ", "                                                              \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                   \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "

// d[64 x N] = A[64 x 16] B[16 x N] (+ d when accumulate), bf16 operands, fp32 accumulation, A and B
// from shared memory (A K-major; B K-major, or N-major with trans_b). Thread l of warp w of the
// warpgroup holds d[n][e] at row 16 w + l / 4 + (e >= 2 ? 8 : 0), column 8 n + 2 (l % 4) + (e & 1):
// mma.sync's m16n8 layout, repeated.
template <int trans_b>
__device__ inline void wgmma_m64n128k16_ss(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " PTX_M64N128_ACCUMULATOR_TEXT
               "%64, %65, p, 1, 1, 0, %67;\n}\n"
               : PTX_M64N128_ACCUMULATOR(d)
               : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(trans_b));
}

template <int trans_b>
__device__ inline void wgmma_m64n64k16_ss(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " PTX_M64N64_ACCUMULATOR_TEXT
               "%32, %33, p, 1, 1, 0, %35;\n}\n"
               : PTX_M64N64_ACCUMULATOR(d)
               : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(trans_b));
}

// d[64 x 128] (+)= A[64 x 16] B[16 x 128] with A from registers: thread l of warp w holds the
// warp's 16 rows as mma.sync's m16n8k16 A fragment (g = l / 4, t = l % 4): a = {(g, 2t..),
// (g + 8, 2t..), (g, 2t + 8..), (g + 8, 2t + 8..)}, pairs of bf16 (the lower column in the low half),
// rows counted from 16 w.
template <int trans_b>
__device__ inline void wgmma_m64n128k16_rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc_b,
                                          bool accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " PTX_M64N128_ACCUMULATOR_TEXT
               "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
               : PTX_M64N128_ACCUMULATOR(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)), "n"(trans_b));
}

}  // namespace ptx
