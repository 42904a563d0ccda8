// The PTX instructions of the kernels, one wrapper each (cp.async, ex2, rcp, stmatrix, griddepcontrol, and
// sm_90a's wgmma, mbarriers, TMA copies, named barriers and register reallocation).
// Kept apart so that the CPU emulator of the tests (tests/emulator/ptx.cuh) can give each one its
// documented meaning while the kernels around them run unchanged.
#pragma once
#include <cstdint>

namespace ptx {

// Fails the launch: for a wait that can never end (a protocol bug), instead of hanging the GPU.
// `what` names the wait for the reader and the emulator, which prints it; the GPU traps without a
// message (CUDA's assertion, which would print it, is a call whose saved registers spill in the
// kernels that wait), and compute-sanitizer names the trap's source line (tools/acceptance.sh
// sanitize).
__device__ inline void fail_launch(const char* /*what*/) { __trap(); }

// The GPU's clock (%globaltimer, nanoseconds of about a microsecond's resolution) in units of
// 1,024 ns, modulo 2^32 (73 minutes: differences of unsigned values are right across a wrap): for
// bounding waits in one register.
__device__ inline uint32_t global_timer_us() {
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(ns));
  return uint32_t(ns >> 10);
}

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

// 1/x on the special-function unit, subnormals flushed to zero: one MUFU.RCP (1.0f / x and
// __fdividef add range checks and a Newton step or a multiply).
__device__ inline float rcp_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Programmatic dependent launch (kernels/host/launch.cuh). In a kernel launched with it,
// griddepcontrol.wait returns once the kernel launched before it in its stream has completed and
// its memory writes are visible (in a kernel launched without it, at once);
// griddepcontrol.launch_dependents lets the kernel launched after this one start once every block
// of this one has issued it or exited (the next kernel then waits inside for this one's completion).
__device__ inline void griddepcontrol_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ inline void griddepcontrol_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

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

// The fp32 accumulator registers of the m64n64, m64n128 and m64n256 products: the operand lists and
// the asm text naming them as %0, %1, ... (each list is the previous one and as many tiles more).
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
#define PTX_M64N256_ACCUMULATOR(d)                                                                          \
  PTX_M64N128_ACCUMULATOR(d), PTX_ACCUMULATOR_TILE(d, 16), PTX_ACCUMULATOR_TILE(d, 17), PTX_ACCUMULATOR_TILE(d, 18), \
      PTX_ACCUMULATOR_TILE(d, 19), PTX_ACCUMULATOR_TILE(d, 20), PTX_ACCUMULATOR_TILE(d, 21),                       \
      PTX_ACCUMULATOR_TILE(d, 22), PTX_ACCUMULATOR_TILE(d, 23), PTX_ACCUMULATOR_TILE(d, 24),                       \
      PTX_ACCUMULATOR_TILE(d, 25), PTX_ACCUMULATOR_TILE(d, 26), PTX_ACCUMULATOR_TILE(d, 27),                       \
      PTX_ACCUMULATOR_TILE(d, 28), PTX_ACCUMULATOR_TILE(d, 29), PTX_ACCUMULATOR_TILE(d, 30),                       \
      PTX_ACCUMULATOR_TILE(d, 31)
#define PTX_M64N64_ACCUMULATOR_TEXT "{" PTX_ACCUMULATOR_NAMES_0_TO_31 "}, "
#define PTX_M64N128_ACCUMULATOR_TEXT                                                                    \
  "{" PTX_ACCUMULATOR_NAMES_0_TO_31 ", "                                                              \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                   \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
#define PTX_M64N256_ACCUMULATOR_TEXT                                                                    \
  "{" PTX_ACCUMULATOR_NAMES_0_TO_31 ", "                                                              \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                   \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                   \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "   \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "   \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "   \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" "}, "

// d[64 x N] = A[64 x 16] B[16 x N] (+ d when accumulate), bf16 operands, fp32 accumulation, A and B
// from shared memory (A K-major; B K-major, or N-major with trans_b). Thread l of warp w of the
// warpgroup holds d[n][e] at row 16 w + l / 4 + (e >= 2 ? 8 : 0), column 8 n + 2 (l % 4) + (e & 1):
// mma.sync's m16n8 layout, repeated. One definition for N = 64, 128 and 256: the accumulator's
// operands and text, then the numbers of the operands after it (desc_a, desc_b, the predicate's
// source, trans_b).
#define PTX_DEFINE_WGMMA_SS(N, TILES, ACCUMULATOR, ACCUMULATOR_TEXT, A, B, SCALE, TRANS)                        \
  template <int trans_b>                                                                                       \
  __device__ inline void wgmma_m64n##N##k16_ss(float(&d)[TILES][4], uint64_t desc_a, uint64_t desc_b,          \
                                                bool accumulate) {                                             \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #SCALE ", 0;\n"                                          \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 " ACCUMULATOR_TEXT                   \
                 "%" #A ", %" #B ", p, 1, 1, 0, %" #TRANS ";\n}\n"                                             \
                 : ACCUMULATOR(d)                                                                              \
                 : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(trans_b));                              \
  }
PTX_DEFINE_WGMMA_SS(64, 8, PTX_M64N64_ACCUMULATOR, PTX_M64N64_ACCUMULATOR_TEXT, 32, 33, 34, 35)
PTX_DEFINE_WGMMA_SS(128, 16, PTX_M64N128_ACCUMULATOR, PTX_M64N128_ACCUMULATOR_TEXT, 64, 65, 66, 67)
PTX_DEFINE_WGMMA_SS(256, 32, PTX_M64N256_ACCUMULATOR, PTX_M64N256_ACCUMULATOR_TEXT, 128, 129, 130, 131)

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

// ---- stmatrix (sm_90): a warp's 8 x 8 matrices of 16-bit values from registers to shared memory ----

// Four 8 x 8 matrices held as mma fragments (register m of lane 4 r + c / 2 holds elements (r, c)
// and (r, c + 1) of matrix m, c even, the lower column in the low half) into 16-byte rows of
// shared memory (16-byte aligned): row i of matrix m at the address lane 8 m + i gives. Without
// `trans` row i holds the matrix's row i; with it, its column i (the matrix stored transposed). One
// instruction for the warp's 256 values, where 4-byte stores take 4 a lane and 2-byte ones 8.
template <bool trans>
__device__ inline void stmatrix_x4(void* row, uint32_t m0, uint32_t m1, uint32_t m2, uint32_t m3) {
  if constexpr (trans)
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(shared_address(row)),
                 "r"(m0), "r"(m1), "r"(m2), "r"(m3)
                 : "memory");
  else
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(shared_address(row)),
                 "r"(m0), "r"(m1), "r"(m2), "r"(m3)
                 : "memory");
}

// ---- The warp-specialised kernels (sm_90a): mbarriers, TMA copies, named barriers, registers ----

// An mbarrier (8 bytes of shared memory, 8-byte aligned) counts a phase's arrivals and its
// transaction bytes: the phase completes once `count` threads have arrived and every byte that
// arrivals announced (expect_tx) has landed; then the next phase begins. Waits name a phase by its
// parity.
__device__ inline void mbarrier_init(uint64_t* barrier, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(barrier)), "r"(count) : "memory");
}

// Makes the initialising thread's mbarrier.init visible to the async proxy (the TMA copies that
// complete on the barriers); a block barrier after it makes them visible to the other threads.
__device__ inline void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// One arrival on the barrier's current phase (release: this thread's reads before it are done).
__device__ inline void mbarrier_arrive(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(barrier)) : "memory");
}

// One arrival that also announces `bytes` of TMA copies completing on the current phase.
__device__ inline void mbarrier_arrive_expect_tx(uint64_t* barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(barrier)), "r"(bytes)
               : "memory");
}

// Whether the phase of parity `parity` has completed (acquire: what landed in it is visible). A
// fresh barrier is in phase 0, so parity 1 names the phase "before" it: done at once.
__device__ inline bool mbarrier_try_wait(uint64_t* barrier, uint32_t parity) {
  uint32_t done;
  asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done)
               : "r"(shared_address(barrier)), "r"(parity)
               : "memory");
  return done != 0;
}

// A 2-D box of a tensor map (made on the host: kernels/tensor_map.cuh) from global to shared
// memory through the TMA unit, laid out and swizzled as the map says; its bytes complete on
// `barrier`'s current phase. x counts elements of the contiguous dimension, y rows. `map` is the
// kernel's __grid_constant__ parameter (its generic address); `shared` 128-byte aligned.
__device__ inline void tma_load_2d(void* shared, const void* map, int x, int y, uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::
          "r"(shared_address(shared)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(shared_address(barrier))
      : "memory");
}

// Asks L2 for the 128-byte line at `global` (a hint: nothing waits for it, no register holds it);
// generic addressing, as the pointer is.
__device__ inline void prefetch_l2(const void* global) { asm volatile("prefetch.L2 [%0];\n" ::"l"(global)); }

// TMA store: the box at (x, y) of the map's matrix from shared memory laid out as the map says (its
// swizzle), as a bulk async-group operation (rows outside the matrix are not written). The threads
// that wrote the box fence their writes for the async proxy (fence_proxy_async_shared) and meet at
// a barrier before one thread issues it.
__device__ inline void tma_store_2d(const void* map, int x, int y, const void* shared) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(x), "r"(y), "r"(shared_address(shared))
               : "memory");
}
__device__ inline void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// The issuing thread waits until all but its newest `pending_groups_left` bulk groups have read their
// shared memory (which may then be rewritten) ...
template <int pending_groups_left>
__device__ inline void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(pending_groups_left) : "memory");
}
// ... or have completed (their writes done).
template <int pending_groups_left>
__device__ inline void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(pending_groups_left) : "memory");
}

// Named barriers 1-15 (0 is __syncthreads'): `threads` (a multiple of 32) arrive, by whole warps;
// sync waits for the rest, arrive does not.
__device__ inline void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ inline void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// A warpgroup (all of its 128 threads) gives registers back to the CTA's pool, or takes more
// from it (waiting until another warpgroup's decrease has freed them): `registers` per thread, a
// multiple of 8 in [24, 256].
template <int registers>
__device__ inline void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(registers));
}
template <int registers>
__device__ inline void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(registers));
}

}  // namespace ptx
