// Our own bf16 GEMM with an elementwise epilogue, for the products whose next pass cuBLASLt cannot
// fuse (it has no square epilogue): the MLP's a = relu(h W_fc^T)^2 in one pass instead of the
// product's write of u and ReLU²'s read of u and write of a, and in the backward du = (dy W_proj)
// 2 sqrt(a) in one pass instead of the product's write of da and ReLU²'s read of it (issue 29,
// item 4).
//
// C [M, N] = epilogue(A [M, K] B): A row-major (K-major), B either [N, K] row-major (K-major: C = A
// B^T, "TN") or [K, N] row-major (N-major: C = A B, "NN"), fp32 accumulation, C bf16. Warp-specialised on Hopper as the flash forward is: 384 threads, warpgroup 0
// a producer (24 registers) whose first thread copies A's 128 x 64 and B's 256 x 64 tiles by TMA into a ring
// of stages (mbarriers `full` and `empty` each), warpgroups 1 and 2 (240 registers) the two 64-row
// halves of a 128 x 256 output tile (128 accumulators a thread), four m64n256k16 products a stage
// (N = 256: the most columns a wgmma takes, the fewest shared-memory bytes a flop), the stage
// released as soon as the next stage's products are issued and the previous ones done. The grid is persistent
// (one CTA per SM); tiles go N fastest, so the CTAs at work at once share A's 128-row block in L2
// (B, a weight, stays in L2 whole), and the producer fills the next tile's stages while the
// consumers run the epilogue. The epilogue stages C's tile in shared memory (stmatrix: 16 stores a
// thread where 4-byte ones take 64) and TMA stores write it out (as CUTLASS's Hopper epilogues do):
// the stores drain while the consumers go on to the next tile's products, where 4-byte stores
// straight from the accumulators to global memory would hold them. What an epilogue reads besides
// (ReLU²'s backward its a, the qkv epilogue ve or the rope table) is asked of L2 at the tile's start.
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
constexpr int kStages = 3;  // of 48 KB, beside the output tile's 64 KB in 227 KB
constexpr uint32_t kATileBytes = kTileRows * kBlockK * sizeof(bf16), kBTileBytes = kTileCols * kBlockK * sizeof(bf16);
// The output tile: per consumer warpgroup its 64 rows as four [64 rows][64 columns] boxes (a TMA
// store each) in the 128-byte swizzle.
constexpr int kOutputRows = kTileRows / 2, kOutputBoxCols = 64;
constexpr uint32_t kOutputBytes = kTileRows * kTileCols * sizeof(bf16);
constexpr size_t kSharedBytes = kStages * size_t(kATileBytes + kBTileBytes) + kOutputBytes + kSwizzleAtomBytes;
constexpr int kNGroup = 64;  // an N-major B tile's columns a box (a 128-byte swizzle span)
constexpr uint32_t kNGroupBytes = kNGroup * kBlockK * sizeof(bf16);

// How B is stored: [N, K] row-major (C = A B^T) or [K, N] row-major (C = A B).
enum class BLayout { k_major, n_major };

// Where an epilogue puts C: its consumer warpgroup's 64 x 256 part of the output tile, staged in
// shared memory as the TMA stores read it. (row0, col0): the part's first element in C [M, N].
struct TileOutput {
  bf16* staging;
  int row0, col0, N;
  __device__ size_t index(int row, int col) const { return size_t(row0 + row) * N + col0 + col; }
};

// Asks L2 for the warpgroup's part of a [M, N] bf16 matrix that an epilogue reads (64 rows of 512
// bytes, 2 lines of 128 bytes a thread), at the tile's start: by the epilogue, a mainloop later, it
// is there instead of a DRAM round trip away with the tensor cores idle.
__device__ inline void prefetch_part(const bf16* matrix, const TileOutput& out) {
  const int row = threadIdx.x % 128 / 2, first_col = threadIdx.x % 2 * 128;
  for (int col = first_col; col < first_col + 128; col += 64) ptx::prefetch_l2(matrix + out.index(row, col));
}

// Epilogues: `store` puts a consumer thread's part of the output tile from its accumulators:
// acc[n][e] holds element (warpgroup_fragment_row(e), fragment_col(n, e)) of its warpgroup's part.
// `prefetch` (at the tile's start) asks L2 for what `store` will read. check(): the host's refusals
// of what an epilogue's own operands would fault on.
//
// The elementwise ones (Derived maps x0, x1 to the bf16 pair C[index], C[index + 1]), staged by
// stmatrix: n-tiles n and n + 1 of the warp's 16 rows are four 8 x 8 matrices (rows 0-7 and 8-15 of
// each), so lane 8 m + i gives the staged row 8 (m % 2) + i from column 8 (n + m / 2).
template <typename Derived>
struct Elementwise {
  void check() const {}
  __device__ void prefetch(const TileOutput&) const {}
  __device__ void store(const float (&acc)[kTileCols / 8][4], const TileOutput& out) const {
    const Derived& pair_of = static_cast<const Derived&>(*this);
    const int m = threadIdx.x % 32 / 8, staged_row = threadIdx.x / 32 % 4 * 16 + 8 * (m % 2) + threadIdx.x % 8;
#pragma unroll
    for (int n = 0; n < kTileCols / 8; n += 2) {
      uint32_t pairs[4];  // matrices (n, rows 0-7), (n, rows 8-15), (n + 1, rows 0-7), (n + 1, rows 8-15)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int tile_n = n + j / 2, half = j % 2;
        const int row = warpgroup_fragment_row(2 * half), col = fragment_col(tile_n, 0);
        pairs[j] = pair_of(acc[tile_n][2 * half], acc[tile_n][2 * half + 1], out.index(row, col));
      }
      ptx::stmatrix_x4</*trans=*/false>(out.staging + swizzled<kOutputRows>(staged_row, 8 * (n + m / 2)), pairs[0],
                                        pairs[1], pairs[2], pairs[3]);
    }
  }
};
struct Identity : Elementwise<Identity> {
  __device__ uint32_t operator()(float x0, float x1, size_t) const { return pack_bf16(x0, x1); }
};
struct ReluSquared : Elementwise<ReluSquared> {  // a = relu(u)^2
  __device__ uint32_t operator()(float x0, float x1, size_t) const {
    const float r0 = fmaxf(x0, 0.0f), r1 = fmaxf(x1, 0.0f);
    return pack_bf16(r0 * r0, r1 * r1);
  }
};
struct ReluSquaredBackward : Elementwise<ReluSquaredBackward> {  // du = da 2 relu(u), relu(u) = sqrt(a) (a as C)
  const bf16* a;
  explicit ReluSquaredBackward(const bf16* forward_a) : a(forward_a) {}
  void check() const {  // a bf16 pair is read at a time
    if (reinterpret_cast<uintptr_t>(a) % 4)
      throw std::invalid_argument("gemm with epilogue: ReLU²'s backward reads a, which must start 4-byte aligned");
  }
  __device__ void prefetch(const TileOutput& out) const { prefetch_part(a, out); }
  __device__ uint32_t operator()(float da0, float da1, size_t index) const {
    const __nv_bfloat162 pair = *reinterpret_cast<const __nv_bfloat162*>(a + index);
    return pack_bf16(da0 * 2 * sqrtf(__low2float(pair)), da1 * 2 * sqrtf(__high2float(pair)));
  }
};

template <BLayout b_layout, typename Epilogue>
__global__ void __launch_bounds__(kWsThreads, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                const __grid_constant__ CUtensorMap c_map, const Epilogue epilogue, int M, int N, int K) {
  await_previous_kernel();
  extern __shared__ __align__(128) bf16 shared_tiles[];
  // stage s: A tile [128 rows][64 k], then B tile: [256 rows][64 k] (K-major) or four [64 k][64 n]
  // boxes (N-major), each in the 128-byte swizzle; after the stages, the output tile
  bf16* tiles = align_to_swizzle_atom(shared_tiles);
  auto a_tile = [&](int stage) { return tiles + stage * (kTileRows + kTileCols) * kBlockK; };
  auto b_tile = [&](int stage) { return a_tile(stage) + kTileRows * kBlockK; };
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  if (threadIdx.x == 0) {
    init_ring(full, empty, kStages);
    ptx::fence_mbarrier_init();
  }
  __syncthreads();
  const int tiles_n = N / kTileCols, tile_count = M / kTileRows * tiles_n, k_blocks = K / kBlockK;

  if (take_producer_role()) {
    if (threadIdx.x != 0) return;
    uint32_t use = 0;
    for (int tile = blockIdx.x; tile < tile_count; tile += gridDim.x)
      for (int kb = 0; kb < k_blocks; ++kb, ++use) {
        const StageUse u = stage_use<kStages>(use);
        mbarrier_wait(empty + u.stage, u.parity ^ 1, "our GEMM: the producer's wait for a free stage");
        ptx::mbarrier_arrive_expect_tx(full + u.stage, kATileBytes + kBTileBytes);
        ptx::tma_load_2d(a_tile(u.stage), &a_map, kb * kBlockK, tile / tiles_n * kTileRows, full + u.stage);
        if constexpr (b_layout == BLayout::k_major) {
          ptx::tma_load_2d(b_tile(u.stage), &b_map, kb * kBlockK, tile % tiles_n * kTileCols, full + u.stage);
        } else {
          for (int group = 0; group < kTileCols / kNGroup; ++group)
            ptx::tma_load_2d(b_tile(u.stage) + group * kNGroup * kBlockK, &b_map,
                             tile % tiles_n * kTileCols + group * kNGroup, kb * kBlockK, full + u.stage);
        }
      }
    return;
  }

  const int consumer = threadIdx.x / 128 - 1;  // rows 64 consumer .. of each tile
  const bool leader = threadIdx.x % 128 == 0;  // issues the consumer warpgroup's TMA stores
  bf16* staging = a_tile(kStages) + consumer * kOutputRows * kTileCols;
  uint32_t use = 0;
  for (int tile = blockIdx.x; tile < tile_count; tile += gridDim.x) {
    const TileOutput out{staging, tile / tiles_n * kTileRows + consumer * kOutputRows, tile % tiles_n * kTileCols, N};
    epilogue.prefetch(out);
    float acc[kTileCols / 8][4];
    for (int kb = 0; kb < k_blocks; ++kb, ++use) {
      const StageUse u = stage_use<kStages>(use);
      mbarrier_wait(full + u.stage, u.parity, "our GEMM: a consumer's wait for a stage's copies");
      fence_registers(acc);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        const uint64_t a_desc =
            swizzled_128b_descriptor(a_tile(u.stage) + swizzled(consumer * 64, kk * 16), 16, kSwizzleAtomBytes);
        if constexpr (b_layout == BLayout::k_major) {
          const uint64_t b_desc =
              swizzled_128b_descriptor(b_tile(u.stage) + swizzled(0, kk * 16), 16, kSwizzleAtomBytes);
          ptx::wgmma_m64n256k16_ss</*trans_b=*/0>(acc, a_desc, b_desc, /*accumulate=*/kb > 0 || kk > 0);
        } else {  // k rows kk * 16 on, 64-column groups kNGroupBytes apart
          const uint64_t b_desc =
              swizzled_128b_descriptor(b_tile(u.stage) + swizzled<kBlockK>(kk * 16, 0), kNGroupBytes, kSwizzleAtomBytes);
          ptx::wgmma_m64n256k16_ss</*trans_b=*/1>(acc, a_desc, b_desc, /*accumulate=*/kb > 0 || kk > 0);
        }
      }
      ptx::wgmma_commit();
      if (kb > 0) {
        ptx::wgmma_wait<1>();  // the previous stage's products are done: it may be refilled
        release_stage(empty + stage_use<kStages>(use - 1).stage);
      }
    }
    wgmma_wait_all(acc);
    release_stage(empty + stage_use<kStages>(use - 1).stage);
    // the warpgroup's part of the tile into its staging, once the previous tile's stores have read it
    if (leader) ptx::bulk_wait_group_read<0>();
    ptx::named_barrier_sync(1 + consumer, 128);
    epilogue.store(acc, out);
    ptx::fence_proxy_async_shared();  // the staged tile visible to the TMA stores
    ptx::named_barrier_sync(1 + consumer, 128);
    if (leader) {
      for (int box = 0; box < kTileCols / kOutputBoxCols; ++box)
        ptx::tma_store_2d(&c_map, out.col0 + box * kOutputBoxCols, out.row0,
                          staging + box * kOutputRows * kOutputBoxCols);
      ptx::bulk_commit_group();
    }
  }
  if (leader) ptx::bulk_wait_group<0>();  // the stores done before the block (and its shared memory) ends
}

// C [M, N] = epilogue(A [M, K] B) on the stream, B as b_layout says; refuses, naming the operand,
// shapes off the tiles and starts the copies or stores would fault on.
template <BLayout b_layout, typename Epilogue>
void gemm(const bf16* a, const bf16* b, bf16* c, int M, int N, int K, Epilogue epilogue, cudaStream_t stream) {
  epilogue.check();
  const std::string shape = std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K);
  if (M <= 0 || N <= 0 || K <= 0 || M % kTileRows || N % kTileCols || K % kBlockK)
    throw std::invalid_argument("gemm with epilogue: " + shape + " (M x N x K) must be multiples of 128 x 256 x 64");
  if (reinterpret_cast<uintptr_t>(a) % 16 || reinterpret_cast<uintptr_t>(b) % 16 || reinterpret_cast<uintptr_t>(c) % 16)
    throw std::invalid_argument("gemm with epilogue: A, B and C must start 16-byte aligned");
  const CUtensorMap a_map = bf16_tile_map("the product's A", a, M, K, K, kTileRows, kBlockK),
                    b_map = b_layout == BLayout::k_major ? bf16_tile_map("the product's B", b, N, K, K, kTileCols, kBlockK)
                                                         : bf16_tile_map("the product's B", b, K, N, N, kBlockK, kNGroup),
                    c_map = bf16_tile_map("the product's C", c, M, N, N, kOutputRows, kOutputBoxCols);
  CUDA_CHECK(cudaFuncSetAttribute(gemm_kernel<b_layout, Epilogue>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  int(kSharedBytes)));
  const int tile_count = M / kTileRows * (N / kTileCols);
  CUDA_CHECK(launch_kernel(gemm_kernel<b_layout, Epilogue>, std::min(tile_count, multiprocessor_count()), kWsThreads,
                           kSharedBytes, stream, a_map, b_map, c_map, epilogue, M, N, K));
}

}  // namespace gemm_epilogue

// a [M, N] = relu(h [M, K] w [N, K]^T)^2: the MLP's first product and its activation in one pass.
inline void matmul_relu_squared(const bf16* h, const bf16* w, bf16* a, int M, int N, int K, cudaStream_t stream) {
  using namespace gemm_epilogue;
  gemm<BLayout::k_major>(h, w, a, M, N, K, ReluSquared{}, stream);
}

// du [M, N] = (dy [M, K] w [K, N]) 2 sqrt(a [M, N]): the MLP's second product's input gradient and
// ReLU²'s backward in one pass, from the forward's a = relu(u)^2 (each element of a is read by the
// thread that writes that element of du: du may be a).
inline void matmul_relu_squared_backward(const bf16* dy, const bf16* w, const bf16* a, bf16* du, int M, int N, int K,
                                         cudaStream_t stream) {
  using namespace gemm_epilogue;
  gemm<BLayout::n_major>(dy, w, du, M, N, K, ReluSquaredBackward(a), stream);
}
