// Muon on the GPU (SPEC 1.9) for a batch of matrices [rows, cols] of one shape group, each at its
// own addresses (qkv_w [3, 768, 768] is three): momentum with the Nesterov form, the quintic
// Newton-Schulz iteration in bf16 with fp32 accumulation, batched over the group through
// cuBLASLt's strided batches, and the update scaled by max(1, rows/cols)^0.5. A wide matrix is
// iterated as it is, a tall one as its transpose (the small Gram matrix X X^T).
#pragma once
#include "kernels/host/cuda_check.cuh"
#include "kernels/device_utils.cuh"
#include "kernels/matmul.cuh"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

struct MuonStep {
  float lr;          // learning rate of this step (schedule applied)
  float momentum;    // of this step (warmup applied)
  float grad_scale;  // 1 / M: the one normalisation of the summed gradient (SPEC 4.2)
};

constexpr float kNewtonSchulzA = 3.4445f, kNewtonSchulzB = -4.7750f, kNewtonSchulzC = 2.0315f;
constexpr int kNewtonSchulzSteps = 5;

// One matrix [rows, cols] of a Muon update: its fp32 parameter, summed gradient and momentum.
// A [3, d, d] parameter is three of them (qkv_w: Q, K and V are orthogonalised separately).
struct MuonMatrix {
  float* p;
  const float* g;
  float* momentum;
};

// bf16 scratch of a batch of iterations: X and the next X [batch, r, k], A and B [batch, r, r]
// (r <= k), and the batch's Frobenius norms.
class MuonWorkspace {
 public:
  // Room for batches of up to `max_batch` matrices and `max_batch_elems` elements in all.
  MuonWorkspace(size_t max_batch_elems, int max_batch = 1)
      : elem_capacity_(std::max<size_t>(max_batch_elems, 1)), batch_capacity_(std::max(max_batch, 1)) {
    for (bf16** b : {&x_, &next_, &a_, &b_}) CUDA_CHECK(cudaMalloc(b, elem_capacity_ * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&norms_, batch_capacity_ * sizeof(float)));
    // a batch's matrices hold at most elem_capacity_ elements: one partial chunk more each
    CUDA_CHECK(cudaMalloc(&norm_partials_, (elem_capacity_ / kFrobeniusChunk + batch_capacity_) * sizeof(float)));
  }
  ~MuonWorkspace() {
    for (void* p : {(void*)x_, (void*)next_, (void*)a_, (void*)b_, (void*)norms_, (void*)norm_partials_}) cudaFree(p);
  }
  MuonWorkspace(const MuonWorkspace&) = delete;
  MuonWorkspace& operator=(const MuonWorkspace&) = delete;

  void require_fits(int batch, int rows, int cols) const {
    if (batch > batch_capacity_ || size_t(batch) * rows * cols > elem_capacity_)
      throw std::invalid_argument("muon: " + std::to_string(batch) + " matrices of " + std::to_string(rows) + "x" +
                                  std::to_string(cols) + " exceed the workspace of " + std::to_string(batch_capacity_) +
                                  " matrices, " + std::to_string(elem_capacity_) + " elements");
  }

  bf16 *x_ = nullptr, *next_ = nullptr, *a_ = nullptr, *b_ = nullptr;
  float* norms_ = nullptr;          // [batch] ||X_i||_F
  float* norm_partials_ = nullptr;  // frobenius_norms' partial sums

 private:
  size_t elem_capacity_;
  int batch_capacity_;
};

// Up to kMaxMuonLaunch matrices of one shape group, passed by value to the elementwise passes: one
// launch a group instead of one a matrix (a 768 x 768 matrix's pass moves about 2 us of memory,
// about what a launch and its ramp cost).
constexpr int kMaxMuonLaunch = 64;
struct MuonLaunch {
  MuonMatrix matrices[kMaxMuonLaunch];
};

// Element i of a matrix's momentum pass: buf = m buf + (1 - m) g s; returns x = (1 - m) g s + m buf
// (the iteration's input, before its rounding to bf16).
__device__ inline float muon_momentum_step(const MuonMatrix& m, size_t i, float momentum, float grad_scale) {
  const float grad = m.g[i] * grad_scale;
  const float b = momentum * m.momentum[i] + (1 - momentum) * grad;
  m.momentum[i] = b;
  return (1 - momentum) * grad + momentum * b;
}

// Matrix blockIdx.y of the launch: its momentum pass, x in bf16; x: the launch's first matrix's
// [rows, cols] (a wide or square matrix, iterated as it is).
__global__ void muon_momentum_kernel(const __grid_constant__ MuonLaunch launch, bf16* x, size_t n, float momentum,
                                     float grad_scale) {
  await_previous_kernel();
  const MuonMatrix& m = launch.matrices[blockIdx.y];
  x += blockIdx.y * n;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] = __float2bfloat16(muon_momentum_step(m, i, momentum, grad_scale));
}

// A tall matrix is iterated as its transpose: its passes go through 32 x 32 tiles in shared memory
// (padded against bank conflicts), so that both the matrix's rows and x's are read and written
// whole, not one 2-byte element a 32-byte sector. Blocks of 32 x 8 threads, a tile a block a turn.
constexpr int kMuonTile = 32, kMuonTileThreads = kMuonTile * 8;
__host__ __device__ inline int muon_tiles(int rows, int cols) {
  return ((rows + kMuonTile - 1) / kMuonTile) * ((cols + kMuonTile - 1) / kMuonTile);
}

// The momentum pass of a tall matrix [rows, cols]: x stored [cols, rows].
__global__ void __launch_bounds__(kMuonTileThreads) muon_momentum_transposed_kernel(
    const __grid_constant__ MuonLaunch launch, bf16* x, int rows, int cols, float momentum, float grad_scale) {
  await_previous_kernel();
  __shared__ float tile[kMuonTile][kMuonTile + 1];  // [row][col] of the matrix, x's values
  const MuonMatrix& m = launch.matrices[blockIdx.y];
  x += blockIdx.y * size_t(rows) * cols;
  const int lane = threadIdx.x % kMuonTile, first = threadIdx.x / kMuonTile, tiles_c = (cols + kMuonTile - 1) / kMuonTile;
  for (int t = blockIdx.x; t < muon_tiles(rows, cols); t += gridDim.x) {
    const int r0 = t / tiles_c * kMuonTile, c0 = t % tiles_c * kMuonTile;
    for (int j = first; j < kMuonTile; j += kMuonTileThreads / kMuonTile)
      if (r0 + j < rows && c0 + lane < cols)
        tile[j][lane] = muon_momentum_step(m, size_t(r0 + j) * cols + c0 + lane, momentum, grad_scale);
    __syncthreads();
    for (int j = first; j < kMuonTile; j += kMuonTileThreads / kMuonTile)
      if (c0 + j < cols && r0 + lane < rows) x[size_t(c0 + j) * rows + r0 + lane] = __float2bfloat16(tile[lane][j]);
    __syncthreads();  // the tile is read before the next turn writes it
  }
}

// x[batch, n] row i divided by norms[i] + 1e-7, 8 elements a thread (n a multiple of 8; x is a Muon
// workspace buffer, 256-byte aligned)
__global__ void scale_by_inverse_norms_kernel(bf16* x, size_t n, size_t total, const float* norms) {
  await_previous_kernel();
  for (size_t v = blockIdx.x * size_t(blockDim.x) + threadIdx.x; v < total / 8; v += size_t(gridDim.x) * blockDim.x) {
    float values[8];
    load8(x + 8 * v, values);
    const float divisor = norms[8 * v / n] + 1e-7f;
#pragma unroll
    for (int j = 0; j < 8; ++j) values[j] /= divisor;
    store8(x + 8 * v, values);
  }
}

// Matrix blockIdx.y of the launch: p[n] -= lr * x; x: the launch's first matrix's.
__global__ void muon_apply_kernel(const __grid_constant__ MuonLaunch launch, const bf16* x, size_t n, float lr) {
  await_previous_kernel();
  float* p = launch.matrices[blockIdx.y].p;
  x += blockIdx.y * n;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] -= lr * __bfloat162float(x[i]);
}

// The apply pass of a tall matrix [rows, cols], x stored [cols, rows] (muon_momentum_transposed_kernel's tiles).
__global__ void __launch_bounds__(kMuonTileThreads) muon_apply_transposed_kernel(const __grid_constant__ MuonLaunch launch,
                                                                                 const bf16* x, int rows, int cols,
                                                                                 float lr) {
  await_previous_kernel();
  __shared__ float tile[kMuonTile][kMuonTile + 1];  // [row][col] of the matrix
  float* p = launch.matrices[blockIdx.y].p;
  x += blockIdx.y * size_t(rows) * cols;
  const int lane = threadIdx.x % kMuonTile, first = threadIdx.x / kMuonTile, tiles_c = (cols + kMuonTile - 1) / kMuonTile;
  for (int t = blockIdx.x; t < muon_tiles(rows, cols); t += gridDim.x) {
    const int r0 = t / tiles_c * kMuonTile, c0 = t % tiles_c * kMuonTile;
    for (int j = first; j < kMuonTile; j += kMuonTileThreads / kMuonTile)
      if (c0 + j < cols && r0 + lane < rows) tile[lane][j] = __bfloat162float(x[size_t(c0 + j) * rows + r0 + lane]);
    __syncthreads();
    for (int j = first; j < kMuonTile; j += kMuonTileThreads / kMuonTile)
      if (r0 + j < rows && c0 + lane < cols) p[size_t(r0 + j) * cols + c0 + lane] -= lr * tile[j][lane];
    __syncthreads();  // the tile is read before the next turn writes it
  }
}

// Runs pass(launch, first, count) for the batch's matrices in launches of at most kMaxMuonLaunch
// (first: the launch's first matrix; count: its matrices, a row of the grid's blocks each).
template <typename Pass>
void for_each_muon_launch(const std::vector<MuonMatrix>& matrices, Pass pass) {
  for (size_t first = 0; first < matrices.size(); first += kMaxMuonLaunch) {
    MuonLaunch launch{};
    const int count = int(std::min<size_t>(kMaxMuonLaunch, matrices.size() - first));
    std::copy(matrices.begin() + first, matrices.begin() + first + count, launch.matrices);
    pass(launch, first, count);
  }
}

// x [batch, r, k] <- NS5(x / (||x||_F + 1e-7)) per matrix: A = X X^T, B = b A + c A A,
// X = a X + B X, in bf16, each product one strided-batched cuBLASLt call over the batch.
inline void newton_schulz5(MuonWorkspace& ws, int batch, int r, int k, Matmul& matmul, cudaStream_t stream) {
  const size_t n = size_t(r) * k, rr = size_t(r) * r;
  frobenius_norms(ws.x_, batch, n, ws.norm_partials_, ws.norms_, stream);
  CUDA_CHECK(launch_kernel(scale_by_inverse_norms_kernel, elementwise_grid(batch * n / 8), 256, 0, stream, ws.x_, n,
                           batch * n, ws.norms_));
  auto batched = [batch](int64_t stride_a, int64_t stride_b, int64_t stride_c) {
    MatmulOptions o;
    o.batch = {batch, stride_a, stride_b, stride_c};
    return o;
  };
  // The b A and a X terms are cuBLASLt's addend C, read from where A and X are (C != D): no copy of
  // A or X is made.
  const MatmulOptions gram = batched(n, n, rr);
  for (int step = 0; step < kNewtonSchulzSteps; ++step) {
    matmul(ws.x_, Transpose::N, ws.x_, Transpose::T, ws.a_, r, r, k, CUDA_R_16BF, gram, stream);  // A = X X^T
    MatmulOptions square = batched(rr, rr, rr), apply = batched(rr, n, n);
    square.addend = ws.a_;
    apply.addend = ws.x_;
    matmul(ws.a_, Transpose::N, ws.a_, Transpose::N, ws.b_, r, r, r, CUDA_R_16BF, square, stream, kNewtonSchulzC,
           kNewtonSchulzB);  // B = c A A + b A
    matmul(ws.b_, Transpose::N, ws.x_, Transpose::N, ws.next_, r, k, r, CUDA_R_16BF, apply, stream, 1.0f,
           kNewtonSchulzA);  // X' = B X + a X
    std::swap(ws.x_, ws.next_);
  }
}

// One Muon update of matrices [rows, cols] of one shape group (g: the summed gradients;
// grad_scale normalises them), the Newton-Schulz iterations batched over all of them.
inline void muon_update(const std::vector<MuonMatrix>& matrices, int rows, int cols, const MuonStep& s,
                        MuonWorkspace& ws, Matmul& matmul, cudaStream_t stream) {
  const int batch = int(matrices.size());
  if (batch == 0) return;
  ws.require_fits(batch, rows, cols);
  if (size_t(rows) * cols % 8)  // the model's matrices have d = 128 heads: always
    throw std::invalid_argument("muon: " + std::to_string(rows) + "x" + std::to_string(cols) +
                                " matrices; the iteration takes a multiple of 8 elements");
  const size_t n = size_t(rows) * cols;
  const bool transpose = rows > cols;
  const int r = transpose ? cols : rows, k = transpose ? rows : cols;
  const float lr = s.lr * std::sqrt(std::max(1.0f, float(rows) / float(cols)));
  // a launch's grid: its matrices' elements (or tiles) over about as many blocks as one pass takes
  auto grid = [&](int count) {
    const size_t items = transpose ? size_t(muon_tiles(rows, cols)) * kMuonTileThreads : n;
    return dim3(std::max(1, elementwise_grid(count * items) / count), count);
  };
  for_each_muon_launch(matrices, [&](const MuonLaunch& launch, size_t first, int count) {
    if (transpose)
      CUDA_CHECK(launch_kernel(muon_momentum_transposed_kernel, grid(count), kMuonTileThreads, 0, stream, launch,
                               ws.x_ + first * n, rows, cols, s.momentum, s.grad_scale));
    else
      CUDA_CHECK(launch_kernel(muon_momentum_kernel, grid(count), 256, 0, stream, launch, ws.x_ + first * n, n,
                               s.momentum, s.grad_scale));
  });
  newton_schulz5(ws, batch, r, k, matmul, stream);
  for_each_muon_launch(matrices, [&](const MuonLaunch& launch, size_t first, int count) {
    if (transpose)
      CUDA_CHECK(launch_kernel(muon_apply_transposed_kernel, grid(count), kMuonTileThreads, 0, stream, launch,
                               ws.x_ + first * n, rows, cols, lr));
    else
      CUDA_CHECK(launch_kernel(muon_apply_kernel, grid(count), 256, 0, stream, launch, ws.x_ + first * n, n, lr));
  });
}

// The same update one matrix at a time (no strided batches): the batched path's reference in the
// start-up self-check, and the run's path with --muon per-matrix.
inline void muon_update_each(const std::vector<MuonMatrix>& matrices, int rows, int cols, const MuonStep& s,
                             MuonWorkspace& ws, Matmul& matmul, cudaStream_t stream) {
  for (const MuonMatrix& m : matrices) muon_update({m}, rows, cols, s, ws, matmul, stream);
}
