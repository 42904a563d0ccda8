// What the wgmma kernels (flash attention, the GEMM with epilogues) share: tiles in shared memory in
// the 128-byte swizzle of wgmma's operands, their descriptors, the accumulator fragment layout, the
// register fences around asynchronous products, and the mbarrier ring of the warp-specialised ones.
#pragma once
#include "kernels/device_utils.cuh"
#include "kernels/ptx.cuh"

#include <cstdint>

namespace wgmma_tiles {

constexpr uint32_t kSwizzleAtomBytes = 1024;  // 8 rows of 128 bytes

template <int kRows = 128>
__device__ inline int swizzled(int row, int col) {  // element (row, col) of a tile of kRows rows
  return col / 64 * (kRows * 64) + row * 64 + ((((col % 64) >> 3) ^ (row & 7)) << 3) + (col & 7);
}

// The descriptor of a matrix in shared memory laid out in 128-byte swizzle atoms (8 rows of 128
// bytes, 16-byte chunk c of row r at c ^ (r % 8); atoms 1024-byte aligned). `leading` and `stride`
// are PTX's leading- and stride-dimension byte offsets: for a K-major operand `stride` is the
// distance between 8-row groups (leading unused); for an MN-major one `leading` separates groups of
// 64 MN elements and `stride` groups of 8 k rows.
__device__ inline uint64_t swizzled_128b_descriptor(const void* start, uint32_t leading, uint32_t stride) {
  return uint64_t((ptx::shared_address(start) & 0x3FFFF) >> 4) | uint64_t(leading >> 4) << 16 |
         uint64_t(stride >> 4) << 32 | uint64_t(1) << 62;
}

// wgmma's swizzle acts on shared-window address bits: tiles must start on an atom boundary, which
// the dynamic shared memory itself need not (static shared variables come first).
__device__ inline bf16* align_to_swizzle_atom(bf16* p) {
  const uint32_t misalignment = ptx::shared_address(p) % kSwizzleAtomBytes;
  return p + (misalignment ? (kSwizzleAtomBytes - misalignment) / sizeof(bf16) : 0);
}

__device__ inline uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Pins an accumulator's (or A fragment's) register accesses to their side of a wgmma fence or
// wait: writes before the issue stay before it, reads after the wait stay after it.
template <typename T, int N>
__device__ inline void fence_registers(T (&r)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) ptx::fence_operand(r[n][e]);
}

// Waits for all of the warpgroup's wgmma groups; the accumulators named may be read from here on,
// and the tiles they read refilled (after a barrier).
template <typename... Accumulators>
__device__ inline void wgmma_wait_all(Accumulators&... acc) {
  ptx::wgmma_wait<0>();
  (fence_registers(acc), ...);
}

template <int N>
__device__ inline void zero(float (&acc)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
}

// The element of accumulator n-tile n, register e: its row and column inside the 16 x 8N tile.
__device__ inline int fragment_row(int e) { return threadIdx.x % 32 / 4 + (e >= 2 ? 8 : 0); }
__device__ inline int fragment_col(int n, int e) { return n * 8 + threadIdx.x % 4 * 2 + (e & 1); }
// Its row inside the warpgroup's 64-row accumulator (the thread's warp holds rows 16 (warp % 4) ..).
__device__ inline int warpgroup_fragment_row(int e) { return threadIdx.x / 32 % 4 * 16 + fragment_row(e); }

// The u-th use of a ring of `stages` buffers (the u-th tile a CTA walks through it): its stage and
// the parity of that stage's mbarrier phase.
struct StageUse {
  int stage;
  uint32_t parity;
};
template <int stages>
__device__ inline StageUse stage_use(uint32_t u) {
  return {int(u % stages), u / stages % 2};
}

// Waits for the phase of parity `parity`. One that has not completed 10 s after the wait began never
// will (a wrong byte count, a missed arrive, the wrong parity: what the emulator reports as a
// deadlock), and the launch fails (ptx::fail_launch, `what` naming the wait) instead of hanging the
// GPU. An honest wait takes microseconds; one slowed by compute-sanitizer or time-slicing,
// milliseconds (a debugger holding a thread for longer trips it). The difference is read signed, so
// that a step back of the clock (it follows the host's) does not read as 2^32 units.
constexpr uint32_t kMaxPhaseWaitUs = 10'000'000;
__device__ inline void mbarrier_wait(uint64_t* barrier, uint32_t parity, const char* what) {
  if (ptx::mbarrier_try_wait(barrier, parity)) return;
  const uint32_t start = ptx::global_timer_us();  // one register: the producers have 24
  while (!ptx::mbarrier_try_wait(barrier, parity))
    if (int32_t(ptx::global_timer_us() - start) > int32_t(kMaxPhaseWaitUs)) ptx::fail_launch(what);
}
// The same wait without the bound, for threads with no register to spare (the flash-ws consumers,
// whose producer's bounded waits at its end bound them instead: flash_attention.cuh).
__device__ inline void mbarrier_wait_unbounded(uint64_t* barrier, uint32_t parity) {
  while (!ptx::mbarrier_try_wait(barrier, parity)) {
  }
}

// The warp-specialised kernels' roles: 384 threads, warpgroup 0 the producer (its first thread
// issues the TMA copies), warpgroups 1 and 2 the consumers. The block holds the registers
// __launch_bounds__(384, 1) compiles it with (65536 / 384 rounded down to 8: 168 a thread) and no
// more; setmaxnreg moves them between warpgroups, and an increase that no decrease paid for waits
// for ever.
constexpr int kWsThreads = 3 * 128, kWsConsumerWarps = 8;
constexpr int kWsProducerRegisters = 24, kWsConsumerRegisters = 240;
constexpr int launch_registers(int threads) { return 64 * 1024 / threads / 8 * 8 < 255 ? 64 * 1024 / threads / 8 * 8 : 255; }
static_assert(128 * kWsProducerRegisters + 2 * 128 * kWsConsumerRegisters <= kWsThreads * launch_registers(kWsThreads),
              "the consumers' registers are the block's, less the producer's");

// The block's roles after its start: true for the producer warpgroup, which gives its registers
// back, false for the consumers, which take them (setmaxnreg, warpgroup by warpgroup).
__device__ inline bool take_producer_role() {
  if (threadIdx.x < 128) {
    ptx::setmaxnreg_dec<kWsProducerRegisters>();
    return true;
  }
  ptx::setmaxnreg_inc<kWsConsumerRegisters>();
  return false;
}

// A ring of `stages` buffers' mbarriers: `full` completes when a buffer's copies (one arrival with
// their bytes) have landed, `empty` when every consumer warp has released it. One thread inits;
// fence_mbarrier_init and a block barrier follow.
__device__ inline void init_ring(uint64_t* full, uint64_t* empty, int stages) {
  for (int stage = 0; stage < stages; ++stage) {
    ptx::mbarrier_init(full + stage, 1);
    ptx::mbarrier_init(empty + stage, kWsConsumerWarps);
  }
}

// A consumer warp's arrival on a stage's `empty` barrier (kWsConsumerWarps arrivals a phase), once
// all of its lanes are done reading the stage.
__device__ inline void release_stage(uint64_t* empty) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) ptx::mbarrier_arrive(empty);
}

}  // namespace wgmma_tiles
