// Our own bf16 GEMM with an elementwise epilogue, for the products whose next pass cuBLASLt cannot
// fuse (it has no square epilogue): the MLP's a = relu(h W_fc^T)^2 in one pass instead of the
// product's write of u and ReLU²'s read of u and write of a (issue 29, item 4).
//
// C [M, N] = epilogue(A [M, K] B [N, K]^T): A and B row-major (both K-major, "TN"), fp32
// accumulation, C bf16. Warp-specialised on Hopper as the flash forward is: 384 threads, warpgroup 0
// a producer (24 registers) whose first thread copies A's 128 x 64 and B's 256 x 64 tiles by TMA into a ring
// of stages (mbarriers `full` and `empty` each), warpgroups 1 and 2 (240 registers) the two 64-row
// halves of a 128 x 256 output tile (128 accumulators a thread), four m64n256k16 products a stage
// (N = 256: the most columns a wgmma takes, the fewest shared-memory bytes a flop), the stage
// released as soon as the next stage's products are issued and the previous ones done. The grid is persistent
// (one CTA per SM); tiles go N fastest, so the CTAs at work at once share A's 128-row block in L2
// (B, a weight, stays in L2 whole), and the producer fills the next tile's stages while the
// consumers run the epilogue (straight from registers to global memory).
#pragma once
#include "kernels/device_utils.cuh"
#include "kernels/host/cuda_check.cuh"
#include "kernels/ptx.cuh"
#include "kernels/tensor_map.cuh"
#include "kernels/wgmma_tiles.cuh"

#include <stdexcept>
#include <string>

namespace gemm_epilogue {

using namespace wgmma_tiles;

constexpr int kTileRows = 128, kTileCols = 256, kBlockK = 64;  // kBlockK: one 128-byte swizzle span
constexpr int kStages = 4;
constexpr int kThreads = 3 * 128, kConsumerWarps = 8;
constexpr int kProducerRegisters = 24, kConsumerRegisters = 240;
constexpr uint32_t kATileBytes = kTileRows * kBlockK * sizeof(bf16), kBTileBytes = kTileCols * kBlockK * sizeof(bf16);
constexpr size_t kSharedBytes = kStages * size_t(kATileBytes + kBTileBytes) + kSwizzleAtomBytes;

struct Identity {
  __device__ float operator()(float x) const { return x; }
};
struct ReluSquared {
  __device__ float operator()(float x) const {
    const float r = fmaxf(x, 0.0f);
    return r * r;
  }
};

template <typename Epilogue>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_tn_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map, bf16* c,
                   int M, int N, int K) {
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* tiles = align_to_swizzle_atom(shared_tiles);  // stage s: A tile, then B tile
  auto a_tile = [&](int stage) { return tiles + stage * (kTileRows + kTileCols) * kBlockK; };
  auto b_tile = [&](int stage) { return a_tile(stage) + kTileRows * kBlockK; };
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  if (threadIdx.x == 0) {
    for (int stage = 0; stage < kStages; ++stage) {
      ptx::mbarrier_init(full + stage, 1);
      ptx::mbarrier_init(empty + stage, kConsumerWarps);
    }
    ptx::fence_mbarrier_init();
  }
  __syncthreads();
  const int tiles_n = N / kTileCols, tile_count = M / kTileRows * tiles_n, k_blocks = K / kBlockK;

  if (threadIdx.x < 128) {  // the producer
    ptx::setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x != 0) return;
    uint32_t use = 0;
    for (int tile = blockIdx.x; tile < tile_count; tile += gridDim.x)
      for (int kb = 0; kb < k_blocks; ++kb, ++use) {
        const StageUse u = stage_use<kStages>(use);
        mbarrier_wait(empty + u.stage, u.parity ^ 1);
        ptx::mbarrier_arrive_expect_tx(full + u.stage, kATileBytes + kBTileBytes);
        ptx::tma_load_2d(a_tile(u.stage), &a_map, kb * kBlockK, tile / tiles_n * kTileRows, full + u.stage);
        ptx::tma_load_2d(b_tile(u.stage), &b_map, kb * kBlockK, tile % tiles_n * kTileCols, full + u.stage);
      }
    return;
  }

  ptx::setmaxnreg_inc<kConsumerRegisters>();
  const int consumer = threadIdx.x / 128 - 1, warp = threadIdx.x / 32 - 4;  // warp: 16 rows of the tile
  auto release = [&](int stage) {  // one arrival a warp, once all of its lanes' products are done
    __syncwarp();
    if (threadIdx.x % 32 == 0) ptx::mbarrier_arrive(empty + stage);
  };
  const Epilogue epilogue;
  uint32_t use = 0;
  for (int tile = blockIdx.x; tile < tile_count; tile += gridDim.x) {
    float acc[kTileCols / 8][4];
    for (int kb = 0; kb < k_blocks; ++kb, ++use) {
      const StageUse u = stage_use<kStages>(use);
      mbarrier_wait(full + u.stage, u.parity);
      fence_registers(acc);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        const uint64_t a_desc =
            swizzled_128b_descriptor(a_tile(u.stage) + swizzled(consumer * 64, kk * 16), 16, kSwizzleAtomBytes);
        const uint64_t b_desc = swizzled_128b_descriptor(b_tile(u.stage) + swizzled(0, kk * 16), 16, kSwizzleAtomBytes);
        ptx::wgmma_m64n256k16_ss</*trans_b=*/0>(acc, a_desc, b_desc, /*accumulate=*/kb > 0 || kk > 0);
      }
      ptx::wgmma_commit();
      if (kb > 0) {
        ptx::wgmma_wait<1>();  // the previous stage's products are done: it may be refilled
        release(stage_use<kStages>(use - 1).stage);
      }
    }
    wgmma_wait_all(acc);
    release(stage_use<kStages>(use - 1).stage);
    const int row0 = tile / tiles_n * kTileRows + warp * 16, col0 = tile % tiles_n * kTileCols;
#pragma unroll
    for (int n = 0; n < kTileCols / 8; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = row0 + fragment_row(2 * half), col = col0 + fragment_col(n, 0);
        *reinterpret_cast<uint32_t*>(c + size_t(row) * N + col) =
            pack_bf16(epilogue(acc[n][2 * half]), epilogue(acc[n][2 * half + 1]));
      }
  }
}

// C [M, N] = epilogue(A [M, K] B [N, K]^T) on the stream; refuses, naming the operand, shapes off
// the tiles and starts the copies or stores would fault on.
template <typename Epilogue>
void gemm_tn(const bf16* a, const bf16* b, bf16* c, int M, int N, int K, cudaStream_t stream) {
  const std::string shape = std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K);
  if (M <= 0 || N <= 0 || K <= 0 || M % kTileRows || N % kTileCols || K % kBlockK)
    throw std::invalid_argument("gemm with epilogue: " + shape + " (M x N x K) must be multiples of 128 x 256 x 64");
  if (reinterpret_cast<uintptr_t>(a) % 16 || reinterpret_cast<uintptr_t>(b) % 16 || reinterpret_cast<uintptr_t>(c) % 4)
    throw std::invalid_argument("gemm with epilogue: A and B must start 16-byte aligned, C 4-byte aligned");
  const CUtensorMap a_map = bf16_tile_map("the product's A", a, M, K, K, kTileRows, kBlockK),
                    b_map = bf16_tile_map("the product's B", b, N, K, K, kTileCols, kBlockK);
  CUDA_CHECK(cudaFuncSetAttribute(gemm_tn_kernel<Epilogue>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  int(kSharedBytes)));
  const int tile_count = M / kTileRows * (N / kTileCols);
  gemm_tn_kernel<Epilogue><<<std::min(tile_count, multiprocessor_count()), kThreads, kSharedBytes, stream>>>(
      a_map, b_map, c, M, N, K);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gemm_epilogue

// a [M, N] = relu(h [M, K] w [N, K]^T)^2: the MLP's first product and its activation in one pass.
inline void matmul_relu_squared(const bf16* h, const bf16* w, bf16* a, int M, int N, int K, cudaStream_t stream) {
  gemm_epilogue::gemm_tn<gemm_epilogue::ReluSquared>(h, w, a, M, N, K, stream);
}
