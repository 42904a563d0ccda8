// RMS norm without weight (SPEC 1.1): y = x / sqrt(mean(x^2) + eps), bf16 in and out, fp32 math.
// One warp per row; rows are a multiple of 8 elements (16-byte vectors). The reference's eps is
// F.rms_norm's default, which for bf16 inputs is the eps of the fp32 type it computes in,
// finfo(float32).eps = 2^-23 (PyTorch since January 2025, eager and the compiled decomposition).
#pragma once
#include "kernels/host/cuda_check.cuh"
#include "kernels/device_utils.cuh"

#include <stdexcept>
#include <string>
#include <type_traits>

constexpr float kRmsEps = 1.1920928955078125e-07f;  // FLT_EPSILON
constexpr int kMaxNormVectorsPerLane = 4;  // rows up to 32 lanes x 4 x 8 = 1024 elements
constexpr int kNormThreads = 256;          // a block: 8 rows, a warp each

// A warp holds its row in registers, `vectors` vectors of 8 a lane: the kernels take that count as
// a template argument, so that a row of 768 holds 3 (with room for 4, rmsnorm_backward took 88
// registers a thread and fit 2 blocks an SM, 16 warps: too few loads in flight for its pass).
// Calls f(std::integral_constant<int, V>{}) with V the count a row of n takes.
template <class F>
void with_norm_vectors(int n, F&& f) {
  static_assert(kMaxNormVectorsPerLane == 4, "a case per count");
  switch ((n + 255) / 256) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// y[rows, n] = rmsnorm(x[rows, n])
template <int vectors>
__global__ void rmsnorm_forward_kernel(const bf16* x, bf16* y, int rows, int n, float eps) {
  await_previous_kernel();
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  const bf16* xr = x + size_t(row) * n;
  float v[vectors][8], ss = 0;
#pragma unroll
  for (int k = 0; k < vectors; ++k) {
    int col = (k * 32 + lane) * 8;
    if (col < n) {
      load8(xr + col, v[k]);
      for (int i = 0; i < 8; ++i) ss += v[k][i] * v[k][i];
    }
  }
  float inv = rsqrtf(warp_sum(ss) / n + eps);
#pragma unroll
  for (int k = 0; k < vectors; ++k) {
    int col = (k * 32 + lane) * 8;
    if (col < n) {
      for (int i = 0; i < 8; ++i) v[k][i] *= inv;
      store8(y + size_t(row) * n + col, v[k]);
    }
  }
}

// One element of the RMS-norm backward: prev + inv dy - inv^3 x mean(x dy)
__device__ inline float rmsnorm_backward_element(float prev, float inv, float dy, float x, float mean_dot) {
  return prev + inv * dy - inv * inv * inv * x * mean_dot;
}

// A warp's row of the RMS-norm backward: x and dy of the row (n wide) into the lane's registers
// (vector k holds columns (32 k + lane) * 8 ..; those past n are left unset), inv = 1 / rms(x) and
// mean(x dy).
template <int vectors>
__device__ inline void rmsnorm_backward_row(const bf16* x, const bf16* dy, int n, float eps, float (&xv)[vectors][8],
                                            float (&gv)[vectors][8], float& inv, float& mean_dot) {
  const int lane = threadIdx.x % 32;
  float ss = 0, dot = 0;
#pragma unroll
  for (int k = 0; k < vectors; ++k) {
    int col = (k * 32 + lane) * 8;
    if (col < n) {
      load8(x + col, xv[k]);
      load8(dy + col, gv[k]);
      for (int i = 0; i < 8; ++i) ss += xv[k][i] * xv[k][i], dot += xv[k][i] * gv[k][i];
    }
  }
  inv = rsqrtf(warp_sum(ss) / n + eps), mean_dot = warp_sum(dot) / n;
}

// dx[rows, n] (+)= d rmsnorm(x) / dx applied to dy: inv * dy - inv^3 * x * mean(x * dy)
// 4 blocks an SM (64 registers a thread) where the row takes at most 3 vectors: no spill then
template <int vectors>
__global__ void __launch_bounds__(kNormThreads, vectors <= 3 ? 4 : 2)
    rmsnorm_backward_kernel(const bf16* x, const bf16* dy, bf16* dx, int rows, int n, float eps, bool accumulate) {
  await_previous_kernel();
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  size_t base = size_t(row) * n;
  float xv[vectors][8], gv[vectors][8], inv, mean_dot;
  rmsnorm_backward_row(x + base, dy + base, n, eps, xv, gv, inv, mean_dot);
#pragma unroll
  for (int k = 0; k < vectors; ++k) {
    int col = (k * 32 + lane) * 8;
    if (col < n) {
      float out[8], prev[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (accumulate) load8(dx + base + col, prev);
      for (int i = 0; i < 8; ++i) out[i] = rmsnorm_backward_element(prev[i], inv, gv[k][i], xv[k][i], mean_dot);
      store8(dx + base + col, out);
    }
  }
}

inline void check_norm_width(int n) {
  if (n % 8 != 0 || n > 32 * 8 * kMaxNormVectorsPerLane)
    throw std::invalid_argument("rmsnorm: row width " + std::to_string(n) + " must be a multiple of 8 and <= 1024");
}

inline void rmsnorm_forward(const bf16* x, bf16* y, int rows, int n, cudaStream_t stream, float eps = kRmsEps) {
  check_norm_width(n);
  constexpr int warps = kNormThreads / 32;
  with_norm_vectors(n, [&](auto vectors) {
    constexpr int v = decltype(vectors)::value;
    CUDA_CHECK(launch_kernel(rmsnorm_forward_kernel<v>, (rows + warps - 1) / warps, warps * 32, 0, stream, x, y, rows,
                             n, eps));
  });
}

inline void rmsnorm_backward(const bf16* x, const bf16* dy, bf16* dx, int rows, int n, bool accumulate,
                             cudaStream_t stream, float eps = kRmsEps) {
  check_norm_width(n);
  constexpr int warps = kNormThreads / 32;
  with_norm_vectors(n, [&](auto vectors) {
    constexpr int v = decltype(vectors)::value;
    CUDA_CHECK(launch_kernel(rmsnorm_backward_kernel<v>, (rows + warps - 1) / warps, warps * 32, 0, stream, x, dy, dx,
                             rows, n, eps, accumulate));
  });
}
