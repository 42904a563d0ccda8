// The warp-specialised kernels' Hopper pieces alone, each with an exact answer: TMA copies into
// the 128-byte swizzle, fed through an mbarrier ring to two consumer warpgroups in turns (named
// barriers, setmaxnreg); a TMA box read by a wgmma; TMA stores of staged boxes. The emulator's own
// tests (tests/emulator/test_checks.cu) inject into them the bugs each invites; gpu_device runs
// their bug-free forms on a GPU, so that what the emulator teaches these instructions to do is
// checked against what the hardware does (a wrong swizzle, phase or box there fails here, apart
// from the flash and GEMM kernels built on them).
#pragma once
#include "kernels/check_arrays.cuh"
#include "kernels/host/cuda_check.cuh"
#include "kernels/ptx.cuh"
#include "kernels/tensor_map.cuh"
#include "kernels/wgmma_tiles.cuh"

#include <cmath>
#include <cstdio>
#include <vector>

namespace tma_probes {

// A warp-specialised ring as the flash forward runs one: warpgroup 0's first thread copies box t
// (rows 64 t .. 64 t + 63 of the matrix, its columns 64..127) by TMA into stage t % 2; warpgroups 1
// and 2, taking turns through two named barriers, each write their 32 rows of it unswizzled to
// `out` ([tiles x 64, 64]), log their turn, and release the stage (one arrival a warp). `mistake`
// injects one bug of the kind the pattern invites.
enum class RingMistake {
  none,
  missed_release,
  wrong_parity,
  no_wait,
  no_decrease,
  short_announce,
  unpublished_init,
  turn_left,
  small_decrease
};
constexpr int kRingStages = 2, kRingTiles = 6, kRingRows = 64, kRingCols = 64;
constexpr uint32_t kRingBoxBytes = kRingRows * kRingCols * sizeof(bf16);
constexpr size_t kRingSharedBytes = kRingStages * kRingBoxBytes + wgmma_tiles::kSwizzleAtomBytes;

__global__ void __launch_bounds__(384, 1) ring_kernel(const __grid_constant__ CUtensorMap map, bf16* out, int* turns,
                                                      RingMistake mistake) {
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* stages = wgmma_tiles::align_to_swizzle_atom(shared_tiles);
  __shared__ __align__(8) uint64_t full[kRingStages], empty[kRingStages];
  __shared__ int turn;
  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kRingStages; ++s) {
      ptx::mbarrier_init(&full[s], 1);
      ptx::mbarrier_init(&empty[s], 8);  // the consumers' warps
    }
    if (mistake != RingMistake::unpublished_init) ptx::fence_mbarrier_init();
    turn = 0;
  }
  __syncthreads();
  if (warpgroup == 0) {
    if (mistake == RingMistake::small_decrease)
      ptx::setmaxnreg_dec<32>();  // 1 K registers short of the consumers' 240
    else if (mistake != RingMistake::no_decrease)
      ptx::setmaxnreg_dec<24>();
    if (threadIdx.x == 0)
      for (int t = 0; t < kRingTiles; ++t) {
        const int s = t % kRingStages;
        wgmma_tiles::mbarrier_wait(&empty[s], (t / kRingStages % 2) ^ 1,
                                   "the TMA ring: the producer's wait for a free stage");
        ptx::mbarrier_arrive_expect_tx(&full[s], mistake == RingMistake::short_announce ? kRingBoxBytes / 2
                                                                                        : kRingBoxBytes);
        ptx::tma_load_2d(stages + s * kRingRows * kRingCols, &map, kRingCols, t * kRingRows, &full[s]);
      }
    return;
  }
  ptx::setmaxnreg_inc<240>();
  const int consumer = warpgroup - 1, thread = threadIdx.x % 128;
  if (consumer == 1) ptx::named_barrier_arrive(1, 256);  // consumer 0 goes first
  for (int t = 0; t < kRingTiles; ++t) {
    const int s = t % kRingStages;
    const uint32_t parity = t / kRingStages % 2;
    if (mistake != RingMistake::no_wait)
      wgmma_tiles::mbarrier_wait(&full[s], mistake == RingMistake::wrong_parity ? parity ^ 1 : parity,
                                 "the TMA ring: a consumer's wait for a stage's copy");
    ptx::named_barrier_sync(1 + consumer, 256);
    for (int i = thread; i < 32 * kRingCols; i += 128) {
      const int row = consumer * 32 + i / kRingCols, col = i % kRingCols;
      out[(t * kRingRows + row) * kRingCols + col] =
          stages[s * kRingRows * kRingCols + wgmma_tiles::swizzled<kRingRows>(row, col)];
    }
    if (thread == 0) turns[turn++] = consumer;
    ptx::named_barrier_arrive(2 - consumer, 256);  // the other's turn
    __syncwarp();
    if (threadIdx.x % 32 == 0 && !(mistake == RingMistake::missed_release && consumer == 1))
      ptx::mbarrier_arrive(&empty[s]);
  }
  if (consumer == 0 && mistake != RingMistake::turn_left) ptx::named_barrier_sync(1, 256);  // the last hand-over
}

// S = B B^T over the first 16 columns of the swizzled [64 x 64] box (m64n64k16, both operands the
// box), issued and waited for by the calling warpgroup: the thread's first accumulator element.
__device__ inline float box_product(const bf16* box) {
  const uint64_t desc = wgmma_tiles::swizzled_128b_descriptor(box, 16, wgmma_tiles::kSwizzleAtomBytes);
  float s[8][4];
  ptx::wgmma_fence();
  ptx::wgmma_m64n64k16_ss</*trans_b=*/0>(s, desc, desc, /*accumulate=*/false);
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();
  return s[0][0];
}

// One TMA box read by a wgmma: warpgroup 0's first thread copies the ring's first box, warpgroup
// 1 waits for it (all of it, or all but warp `skip_warp`) and issues S = B B^T over its first 16
// columns (m64n64k16, both operands the box).
__global__ void __launch_bounds__(256, 1) tma_wgmma_kernel(const __grid_constant__ CUtensorMap map, float* out,
                                                           int skip_warp) {
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* box = wgmma_tiles::align_to_swizzle_atom(shared_tiles);
  __shared__ __align__(8) uint64_t full;
  if (threadIdx.x == 0) {
    ptx::mbarrier_init(&full, 1);
    ptx::fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    if (threadIdx.x == 0) {
      ptx::mbarrier_arrive_expect_tx(&full, kRingBoxBytes);
      ptx::tma_load_2d(box, &map, 0, 0, &full);
    }
    return;
  }
  if (int(threadIdx.x / 32) != skip_warp)
    wgmma_tiles::mbarrier_wait(&full, 0, "the TMA box for wgmma: the wait for its copy");
  out[threadIdx.x - 128] = box_product(box);
}

// An epilogue's TMA stores as our GEMM issues them: one warpgroup stages tile t ([64 rows][64
// columns] of value 1000 t + 64 r + c ... as bf16, in the 128-byte swizzle) in one shared box, and
// its first thread stores it to columns 64 t.. of out [64, 64 tiles], the box reused tile after
// tile. `mistake` injects one bug of the kind the pattern invites.
enum class StoreMistake { none, no_read_wait, no_barrier, no_final_wait, no_fence };
constexpr int kStoreRows = 64, kStoreCols = 64, kStoreTiles = 3;
constexpr size_t kStoreSharedBytes = kStoreRows * kStoreCols * sizeof(bf16) + wgmma_tiles::kSwizzleAtomBytes;

__global__ void __launch_bounds__(128, 1) tma_store_kernel(const __grid_constant__ CUtensorMap map, StoreMistake mistake) {
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* box = wgmma_tiles::align_to_swizzle_atom(shared_tiles);
  const bool leader = threadIdx.x == 0;
  for (int t = 0; t < kStoreTiles; ++t) {
    if (leader && mistake != StoreMistake::no_read_wait) ptx::bulk_wait_group_read<0>();
    ptx::named_barrier_sync(1, 128);
    for (int i = threadIdx.x; i < kStoreRows * kStoreCols; i += 128) {
      const int r = i / kStoreCols, c = i % kStoreCols;
      box[wgmma_tiles::swizzled<kStoreRows>(r, c)] = __float2bfloat16(float(1000 * t + 64 * r + c) / 1024);
    }
    if (mistake != StoreMistake::no_fence) ptx::fence_proxy_async_shared();
    if (mistake != StoreMistake::no_barrier) ptx::named_barrier_sync(1, 128);
    if (leader) {
      ptx::tma_store_2d(&map, t * kStoreCols, 0, box);
      ptx::bulk_commit_group();
    }
  }
  if (leader && mistake != StoreMistake::no_final_wait) ptx::bulk_wait_group<0>();
}
// The ring's matrix [tiles x 64, 128] of distinct finite values, on the device, and its map.
struct Ring {
  Ring() : matrix(kRingTiles * kRingRows * 2 * kRingCols), out(matrix.size() / 2), turns(kRingTiles * 2) {
    matrix.upload(to_bf16(random_normal(matrix.size(), 29)));
    map = bf16_tile_map("the ring's matrix", matrix.get(), kRingTiles * kRingRows, 2 * kRingCols, 2 * kRingCols,
                        kRingRows, kRingCols);
    CUDA_CHECK(cudaFuncSetAttribute(ring_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kRingSharedBytes)));
  }
  void run(RingMistake mistake) {
    ring_kernel<<<1, 384, kRingSharedBytes>>>(map, out.get(), turns.get(), mistake);
    CUDA_CHECK_LAUNCH();
  }
  DeviceBuffer<bf16> matrix, out;
  DeviceBuffer<int> turns;
  CUtensorMap map;
};

// How many elements of the ring's output differ from the boxes it copied (0: TMA's swizzle is the
// one wgmma_tiles::swizzled reads), and whether the consumers took their turns 0, 1, 0, 1, ...
inline size_t ring_wrong_elements(Ring& ring, bool* alternated) {
  const std::vector<double> matrix = to_double(ring.matrix.download()), out = to_double(ring.out.download());
  size_t wrong = 0;
  for (int r = 0; r < kRingTiles * kRingRows; ++r)
    for (int c = 0; c < kRingCols; ++c) wrong += out[r * kRingCols + c] != matrix[r * 2 * kRingCols + kRingCols + c];
  const std::vector<int> turns = ring.turns.download();
  *alternated = true;
  for (size_t i = 0; i < turns.size(); ++i) *alternated = *alternated && turns[i] == int(i % 2);
  return wrong;
}

// Runs tma_wgmma_kernel on the ring's matrix (warp `skip_warp` not waiting; -1: all wait) and
// returns how many of the 128 consumer threads' first accumulators differ from B B^T's element
// (row 16 warp + lane / 4, column 2 (lane % 4)) over the box's first 16 columns, in fp64, by more
// than fp32 accumulation can explain.
inline int tma_wgmma_wrong_threads(Ring& ring, int skip_warp) {
  DeviceBuffer<float> out(128);
  out.poison();
  CUDA_CHECK(cudaFuncSetAttribute(tma_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kRingSharedBytes)));
  tma_wgmma_kernel<<<1, 256, kRingSharedBytes>>>(ring.map, out.get(), skip_warp);
  CUDA_CHECK_LAUNCH();
  const std::vector<double> matrix = to_double(ring.matrix.download()), got = to_double(out.download());
  int wrong = 0;
  for (int t = 0; t < 128; ++t) {
    const int row = t / 32 * 16 + t % 32 / 4, col = t % 4 * 2;
    double want = 0, magnitude = 0;
    for (int k = 0; k < 16; ++k) {
      const double term = matrix[row * 2 * kRingCols + k] * matrix[col * 2 * kRingCols + k];
      want += term;
      magnitude += std::fabs(term);
    }
    if (!(std::fabs(got[t] - want) <= 1e-5 * magnitude) && wrong++ < 5)
      std::printf("  TMA then wgmma: thread %d's S(%d, %d) = %g, want %g\n", t, row, col, got[t], want);
  }
  return wrong;
}

// Runs tma_store_kernel into a poisoned [64, 64 x tiles] and returns how many elements differ from
// the staged values (0: the boxes landed unswizzled in place).
inline size_t tma_store_wrong_elements(StoreMistake mistake) {
  DeviceBuffer<bf16> out(size_t(kStoreRows) * kStoreCols * kStoreTiles);
  out.poison();
  const CUtensorMap map =
      bf16_tile_map("out", out.get(), kStoreRows, kStoreCols * kStoreTiles, kStoreCols * kStoreTiles, kStoreRows, kStoreCols);
  CUDA_CHECK(cudaFuncSetAttribute(tma_store_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kStoreSharedBytes)));
  tma_store_kernel<<<1, 128, kStoreSharedBytes>>>(map, mistake);
  CUDA_CHECK_LAUNCH();
  const std::vector<double> got = to_double(out.download());
  size_t wrong = 0;
  for (int r = 0; r < kStoreRows; ++r)
    for (int t = 0; t < kStoreTiles; ++t)
      for (int c = 0; c < kStoreCols; ++c)
        wrong += got[size_t(r) * kStoreCols * kStoreTiles + t * kStoreCols + c] !=
                 double(__bfloat162float(__float2bfloat16(float(1000 * t + 64 * r + c) / 1024)));
  return wrong;
}

}  // namespace tma_probes
