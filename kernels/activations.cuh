// ReLU^2 of the MLP (SPEC 1.2.6): a = relu(u)^2 and du = da * 2 relu(u), bf16, 16-byte vectors.
#pragma once
#include "kernels/host/cuda_check.cuh"
#include "kernels/device_utils.cuh"

#include <stdexcept>

// a[n] = relu(u[n])^2, n a multiple of 8
__global__ void relu_squared_forward_kernel(const bf16* u, bf16* a, size_t vectors) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < vectors; i += size_t(gridDim.x) * blockDim.x) {
    float v[8];
    load8(u + i * 8, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = v[j] > 0 ? v[j] * v[j] : 0.0f;
    store8(a + i * 8, v);
  }
}

// du[n] = da[n] * 2 relu(u[n])
__global__ void relu_squared_backward_kernel(const bf16* u, const bf16* da, bf16* du, size_t vectors) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < vectors; i += size_t(gridDim.x) * blockDim.x) {
    float v[8], g[8];
    load8(u + i * 8, v);
    load8(da + i * 8, g);
#pragma unroll
    for (int j = 0; j < 8; ++j) g[j] *= v[j] > 0 ? 2 * v[j] : 0.0f;
    store8(du + i * 8, g);
  }
}

inline void relu_squared_forward(const bf16* u, bf16* a, size_t n, cudaStream_t stream) {
  if (n % 8) throw std::invalid_argument("relu_squared: size must be a multiple of 8");
  relu_squared_forward_kernel<<<elementwise_grid(n / 8), 256, 0, stream>>>(u, a, n / 8);
  CUDA_CHECK_LAUNCH();
}

inline void relu_squared_backward(const bf16* u, const bf16* da, bf16* du, size_t n, cudaStream_t stream) {
  if (n % 8) throw std::invalid_argument("relu_squared: size must be a multiple of 8");
  relu_squared_backward_kernel<<<elementwise_grid(n / 8), 256, 0, stream>>>(u, da, du, n / 8);
  CUDA_CHECK_LAUNCH();
}
