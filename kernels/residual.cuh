// The learned scalar mixes of the residual stream (SPEC 1.2): block lambdas x = l0 x + l1 x0, the
// U-net skips x += w skip, the value mix v = sa0 v + sa1 ve. All are out = a x + b y with fp32
// scalars read from device memory (the masters the optimizer updates, so no host sync), bf16
// tensors, fp32 math. x may be a strided view (v is the last third of each qkv row). The scalar
// gradients are sums over T x d products: per-block partial sums in a grid fixed by the shape, then
// one block adds them in order, so they are deterministic.
#pragma once
#include "kernels/host/cuda_check.cuh"
#include "kernels/device_utils.cuh"
#include "kernels/matmul.cuh"

#include <algorithm>
#include <stdexcept>
#include <string>

constexpr int kScalarReductionBlocks = 264;  // 2 per SM; the scratch holds 2 x this many floats

// The scalar reductions' grid: 2 blocks per SM at the record's shapes, fewer where T x d is small
// (a block per 2048 vectors of 8 at least), so that small problems do not launch idle blocks.
inline int scalar_reduction_blocks(int T, int d) {
  const size_t vectors = size_t(T) * d / 8, per_block = 256 * 8;
  return int(std::min<size_t>(kScalarReductionBlocks, std::max<size_t>(1, (vectors + per_block - 1) / per_block)));
}

inline void check_residual_width(int d, int x_stride) {
  if (d % 8 != 0 || x_stride % 8 != 0)
    throw std::invalid_argument("residual mix: width " + std::to_string(d) + " and row stride " +
                                std::to_string(x_stride) + " must be multiples of 8");
}

// out[T, d] = a x[T, d; row stride x_stride] + b y[T, d]; a or b null means 1, y null means no y term
__global__ void weighted_sum_forward_kernel(const bf16* x, int x_stride, const float* a, const bf16* y, const float* b,
                                            bf16* out, int T, int d) {
  const int vectors_per_row = d / 8;
  const float alpha = a ? *a : 1.0f, beta = !y ? 0.0f : b ? *b : 1.0f;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(T) * vectors_per_row;
       i += size_t(gridDim.x) * blockDim.x) {
    size_t t = i / vectors_per_row, c = (i % vectors_per_row) * 8;
    float xv[8], yv[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    load8(x + t * x_stride + c, xv);
    if (y) load8(y + t * d + c, yv);
#pragma unroll
    for (int k = 0; k < 8; ++k) xv[k] = alpha * xv[k] + beta * yv[k];
    store8(out + t * d + c, xv);
  }
}

inline void weighted_sum_forward(const bf16* x, const float* a, const bf16* y, const float* b, bf16* out, int T, int d,
                                 int x_stride, cudaStream_t stream) {
  check_residual_width(d, x_stride);
  weighted_sum_forward_kernel<<<elementwise_grid(size_t(T) * d / 8), 256, 0, stream>>>(x, x_stride, a, y, b, out, T, d);
  CUDA_CHECK_LAUNCH();
}

// The backward of out = a x + b y for one dout[T, d]:
//   dx[T, d; stride x_stride] = a dout        (skipped when dx is null)
//   dy[T, d] (+)= b dout                      (skipped when dy is null; accumulate_dy adds)
//   partial[block], partial[blocks + block]  = this block's share of sum(dout x), sum(dout y)
//                                             (x, y null: not needed, 0)
// dx may alias dout (same element read, then written by the same thread).
__global__ void weighted_sum_backward_kernel(const bf16* dout, const bf16* x, int x_stride, const float* a,
                                             const bf16* y, const float* b, bf16* dx, bf16* dy, bool accumulate_dy,
                                             float* partial, int T, int d) {
  const int vectors_per_row = d / 8;
  const float alpha = a ? *a : 1.0f, beta = !dy ? 0.0f : b ? *b : 1.0f;
  float dot_x = 0, dot_y = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(T) * vectors_per_row;
       i += size_t(gridDim.x) * blockDim.x) {
    size_t t = i / vectors_per_row, c = (i % vectors_per_row) * 8;
    float g[8], v[8];
    load8(dout + t * d + c, g);
    if (x) {
      load8(x + t * x_stride + c, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) dot_x += g[k] * v[k];
    }
    if (y) {
      load8(y + t * d + c, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) dot_y += g[k] * v[k];
    }
    if (dy) {
      float prev[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (accumulate_dy) load8(dy + t * d + c, prev);
#pragma unroll
      for (int k = 0; k < 8; ++k) prev[k] += beta * g[k];
      store8(dy + t * d + c, prev);
    }
    if (dx) {
#pragma unroll
      for (int k = 0; k < 8; ++k) g[k] *= alpha;
      store8(dx + t * x_stride + c, g);
    }
  }
  dot_x = block_sum(dot_x);
  dot_y = block_sum(dot_y);
  if (threadIdx.x == 0) {
    partial[blockIdx.x] = dot_x;
    partial[gridDim.x + blockIdx.x] = dot_y;
  }
}

// da += sum(partial[0, blocks)), db += sum(partial[blocks, 2 blocks)), each in block order
__global__ void add_scalar_gradients_kernel(const float* partial, int blocks, float* da, float* db) {
  float sum_x = 0, sum_y = 0;
  for (int i = threadIdx.x; i < blocks; i += blockDim.x) sum_x += partial[i], sum_y += partial[blocks + i];
  sum_x = block_sum(sum_x);
  sum_y = block_sum(sum_y);
  if (threadIdx.x == 0) {
    if (da) *da += sum_x;
    if (db) *db += sum_y;
  }
}

// Gradients of out = a x + b y (a or b null: 1): dx (stride x_stride, may alias dout) = a dout, dy (+)= b dout, and
// the scalar gradients da += sum(dout x), db += sum(dout y) (each skipped when null). scratch holds
// 2 x kScalarReductionBlocks floats.
inline void weighted_sum_backward(const bf16* dout, const bf16* x, const float* a, float* da, const bf16* y,
                                  const float* b, float* db, bf16* dx, bf16* dy, bool accumulate_dy, int T, int d,
                                  int x_stride, float* scratch, cudaStream_t stream) {
  check_residual_width(d, x_stride);
  if (dx == dout && !a) dx = nullptr;  // dx = 1 * dout in place: nothing to write
  const int blocks = scalar_reduction_blocks(T, d);
  weighted_sum_backward_kernel<<<blocks, 256, 0, stream>>>(dout, da ? x : nullptr, x_stride, a, db ? y : nullptr, b,
                                                           dx, dy, accumulate_dy, scratch, T, d);
  CUDA_CHECK_LAUNCH();
  if (!da && !db) return;
  add_scalar_gradients_kernel<<<1, 256, 0, stream>>>(scratch, blocks, da, db);
  CUDA_CHECK_LAUNCH();
}

// dst[n] += src[n], bf16, n a multiple of 8
__global__ void add_into_kernel(const bf16* src, bf16* dst, size_t vectors) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < vectors; i += size_t(gridDim.x) * blockDim.x) {
    float s[8], t[8];
    load8(src + i * 8, s);
    load8(dst + i * 8, t);
#pragma unroll
    for (int k = 0; k < 8; ++k) t[k] += s[k];
    store8(dst + i * 8, t);
  }
}

inline void add_into(const bf16* src, bf16* dst, size_t n, cudaStream_t stream) {
  if (n % 8) throw std::invalid_argument("add_into: size must be a multiple of 8");
  add_into_kernel<<<elementwise_grid(n / 8), 256, 0, stream>>>(src, dst, n / 8);
  CUDA_CHECK_LAUNCH();
}

// y[T, n] = x[T, k] W[n, k]^T + residual[T, n] (bf16): with `fused`, the residual is cuBLASLt's C
// (D elsewhere: one pass); otherwise the product and then an add (the self-check's reference, and
// the run's path with --residual-add separate).
inline void linear_with_residual(Matmul& matmul, const bf16* x, const bf16* w, bf16* y, int T, int n, int k,
                                 const bf16* residual, bool fused, cudaStream_t stream) {
  if (fused) {
    MatmulOptions o;
    o.addend = residual;
    matmul(x, Transpose::N, w, Transpose::T, y, T, n, k, CUDA_R_16BF, o, stream, 1.0f, 1.0f);
    return;
  }
  matmul(x, Transpose::N, w, Transpose::T, y, T, n, k, CUDA_R_16BF, stream);
  add_into(residual, y, size_t(T) * n, stream);
}
