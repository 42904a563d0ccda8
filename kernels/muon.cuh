// Muon on the GPU (SPEC 1.9) for `batch` matrices [rows, cols] stored back to back (qkv_w
// [3, 768, 768] is three): momentum with the Nesterov form, the quintic Newton-Schulz iteration in
// bf16 with fp32 accumulation (cuBLASLt), and the update scaled by max(1, rows/cols)^0.5. A wide
// matrix is iterated as it is, a tall one as its transpose (the small Gram matrix X X^T).
#pragma once
#include "kernels/cuda_check.cuh"
#include "kernels/device_utils.cuh"
#include "kernels/matmul.cuh"

#include <cmath>
#include <string>

struct MuonStep {
  float lr;          // learning rate of this step (schedule applied)
  float momentum;    // of this step (warmup applied)
  float grad_scale;  // 1 / M: the one normalisation of the summed gradient (SPEC 4.2)
};

constexpr float kNewtonSchulzA = 3.4445f, kNewtonSchulzB = -4.7750f, kNewtonSchulzC = 2.0315f;
constexpr int kNewtonSchulzSteps = 5;

// bf16 scratch of one matrix's iteration: X and the next X [r, k], A and B [r, r], r <= k.
class MuonWorkspace {
 public:
  explicit MuonWorkspace(size_t max_matrix_elems) {
    for (bf16** b : {&x_, &next_, &a_, &b_}) CUDA_CHECK(cudaMalloc(b, std::max<size_t>(max_matrix_elems, 1) * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&norm_, sizeof(float)));
    capacity_ = max_matrix_elems;
  }
  ~MuonWorkspace() {
    for (void* p : {(void*)x_, (void*)next_, (void*)a_, (void*)b_, (void*)norm_}) cudaFree(p);
  }
  MuonWorkspace(const MuonWorkspace&) = delete;
  MuonWorkspace& operator=(const MuonWorkspace&) = delete;

  bf16 *x_ = nullptr, *next_ = nullptr, *a_ = nullptr, *b_ = nullptr;
  float* norm_ = nullptr;  // ||X||_F of the matrix in progress
  size_t capacity_ = 0;
};

// buf = m buf + (1 - m) g s; x = (1 - m) g s + m buf in bf16, transposed into [cols, rows] when
// `transpose`. One matrix [rows, cols].
__global__ void muon_momentum_kernel(const float* g, float* buf, bf16* x, int rows, int cols, bool transpose,
                                     float momentum, float grad_scale) {
  const size_t n = size_t(rows) * cols;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    float grad = g[i] * grad_scale;
    float b = momentum * buf[i] + (1 - momentum) * grad;
    buf[i] = b;
    size_t row = i / cols, col = i % cols;
    x[transpose ? col * rows + row : i] = __float2bfloat16((1 - momentum) * grad + momentum * b);
  }
}

// *norm = ||x[n]||_F in one block: a fixed reduction order, deterministic.
__global__ void frobenius_norm_kernel(const bf16* x, size_t n, float* norm) {
  float ss = 0;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
    float v = __bfloat162float(x[i]);
    ss += v * v;
  }
  ss = block_sum(ss);
  if (threadIdx.x == 0) *norm = sqrtf(ss);
}

__global__ void scale_by_inverse_norm_kernel(bf16* x, size_t n, const float* norm) {
  const float inv = 1.0f / (*norm + 1e-7f);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] = __float2bfloat16(__bfloat162float(x[i]) * inv);
}

// p[rows, cols] -= lr * x, x stored [cols, rows] when `transpose`
__global__ void muon_apply_kernel(float* p, const bf16* x, int rows, int cols, bool transpose, float lr) {
  const size_t n = size_t(rows) * cols;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    size_t row = i / cols, col = i % cols;
    p[i] -= lr * __bfloat162float(x[transpose ? col * rows + row : i]);
  }
}

// x [r, k] <- NS5(x / (||x||_F + 1e-7)): A = X X^T, B = b A + c A A, X = a X + B X, in bf16.
inline void newton_schulz5(MuonWorkspace& ws, int r, int k, Matmul& matmul, cudaStream_t stream) {
  const size_t n = size_t(r) * k;
  frobenius_norm_kernel<<<1, 1024, 0, stream>>>(ws.x_, n, ws.norm_);
  CUDA_CHECK_LAUNCH();
  scale_by_inverse_norm_kernel<<<elementwise_grid(n), 256, 0, stream>>>(ws.x_, n, ws.norm_);
  CUDA_CHECK_LAUNCH();
  for (int step = 0; step < kNewtonSchulzSteps; ++step) {
    matmul(ws.x_, Transpose::N, ws.x_, Transpose::T, ws.a_, r, r, k, CUDA_R_16BF, stream);  // A = X X^T
    CUDA_CHECK(cudaMemcpyAsync(ws.b_, ws.a_, size_t(r) * r * sizeof(bf16), cudaMemcpyDeviceToDevice, stream));
    matmul(ws.a_, Transpose::N, ws.a_, Transpose::N, ws.b_, r, r, r, CUDA_R_16BF, stream, kNewtonSchulzC,
           kNewtonSchulzB);  // B = c A A + b A
    CUDA_CHECK(cudaMemcpyAsync(ws.next_, ws.x_, n * sizeof(bf16), cudaMemcpyDeviceToDevice, stream));
    matmul(ws.b_, Transpose::N, ws.x_, Transpose::N, ws.next_, r, k, r, CUDA_R_16BF, stream, 1.0f,
           kNewtonSchulzA);  // X' = B X + a X
    std::swap(ws.x_, ws.next_);
  }
}

// p, g, momentum_buffer: [batch, rows, cols] fp32 (g the summed gradient; grad_scale normalises it).
inline void muon_update(float* p, const float* g, float* momentum_buffer, int batch, int rows, int cols,
                        const MuonStep& s, MuonWorkspace& ws, Matmul& matmul, cudaStream_t stream) {
  const size_t n = size_t(rows) * cols;
  if (n > ws.capacity_)
    throw std::invalid_argument("muon: a " + std::to_string(rows) + "x" + std::to_string(cols) +
                                " matrix exceeds the workspace of " + std::to_string(ws.capacity_) + " elements");
  const bool transpose = rows > cols;
  const int r = transpose ? cols : rows, k = transpose ? rows : cols;
  const float lr = s.lr * std::sqrt(std::max(1.0f, float(rows) / float(cols)));
  for (int i = 0; i < batch; ++i) {
    muon_momentum_kernel<<<elementwise_grid(n), 256, 0, stream>>>(g + i * n, momentum_buffer + i * n, ws.x_, rows,
                                                                  cols, transpose, s.momentum, s.grad_scale);
    CUDA_CHECK_LAUNCH();
    newton_schulz5(ws, r, k, matmul, stream);
    muon_apply_kernel<<<elementwise_grid(n), 256, 0, stream>>>(p + i * n, ws.x_, rows, cols, transpose, lr);
    CUDA_CHECK_LAUNCH();
  }
}
