// The PTX instructions of the tensor-core kernels, one wrapper each (sm_80+ forms, used on Hopper).
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

// Four 8 x 8 bf16 matrices from shared memory: lane l gives the address of row l % 8 of matrix
// l / 8 (16 bytes each) and receives in r[i] the elements (l / 4, 2 (l % 4) + {0, 1}) of matrix i.
__device__ inline void ldmatrix_x4(uint32_t r[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}

// The same, each matrix transposed: r[i] holds the elements (2 (l % 4) + {0, 1}, l / 4).
__device__ inline void ldmatrix_x4_trans(uint32_t r[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}

// c[16 x 8] += a[16 x 16] b[16 x 8], bf16 operands, fp32 accumulation, in the PTX fragment layouts
// (lane l, g = l / 4, t = l % 4): a = {(g, 2t..), (g + 8, 2t..), (g, 2t + 8..), (g + 8, 2t + 8..)},
// b = {(2t.., g), (2t + 8.., g)}, c = {(g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)}.
__device__ inline void mma_bf16_16x8x16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace ptx
