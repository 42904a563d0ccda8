// ReLU^2 of the MLP (SPEC 1.2.6): a = relu(u)^2 and du = da * 2 relu(u), bf16, 16-byte vectors. The
// backward takes relu(u) from u, or, where the forward kept only a (the fc product with ReLU² in
// its epilogue: kernels/gemm_epilogue.cuh), as sqrt(a): a = bf16(relu(u)^2) is within 2^-8 of
// relu(u)^2 (relative), so sqrt(a) within about 2^-9 of relu(u), closer than bf16(u) itself.
#pragma once
#include "kernels/host/cuda_check.cuh"
#include "kernels/device_utils.cuh"

#include <stdexcept>

// a[n] = relu(u[n])^2, n a multiple of 8
__global__ void relu_squared_forward_kernel(const bf16* u, bf16* a, size_t vectors) {
  await_previous_kernel();
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < vectors; i += size_t(gridDim.x) * blockDim.x) {
    float v[8];
    load8(u + i * 8, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = v[j] > 0 ? v[j] * v[j] : 0.0f;
    store8(a + i * 8, v);
  }
}

// du[n] = da[n] * 2 relu(u[n]), relu(u) read from u or (from_square) as sqrt(a)
template <bool from_square>
__global__ void relu_squared_backward_kernel(const bf16* u_or_a, const bf16* da, bf16* du, size_t vectors) {
  await_previous_kernel();
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < vectors; i += size_t(gridDim.x) * blockDim.x) {
    float v[8], g[8];
    load8(u_or_a + i * 8, v);
    load8(da + i * 8, g);
#pragma unroll
    for (int j = 0; j < 8; ++j) g[j] *= 2 * (from_square ? sqrtf(v[j]) : fmaxf(v[j], 0.0f));
    store8(du + i * 8, g);
  }
}

inline void relu_squared_forward(const bf16* u, bf16* a, size_t n, cudaStream_t stream) {
  if (n % 8) throw std::invalid_argument("relu_squared: size must be a multiple of 8");
  CUDA_CHECK(launch_kernel(relu_squared_forward_kernel, elementwise_grid(n / 8), 256, 0, stream, u, a, n / 8));
}

template <bool from_square>
void relu_squared_backward_of(const bf16* u_or_a, const bf16* da, bf16* du, size_t n, cudaStream_t stream) {
  if (n % 8) throw std::invalid_argument("relu_squared: size must be a multiple of 8");
  CUDA_CHECK(launch_kernel(relu_squared_backward_kernel<from_square>, elementwise_grid(n / 8), 256, 0, stream, u_or_a,
                           da, du, n / 8));
}

inline void relu_squared_backward(const bf16* u, const bf16* da, bf16* du, size_t n, cudaStream_t stream) {
  relu_squared_backward_of<false>(u, da, du, n, stream);
}

// The same from a = relu(u)^2 (du may be da: in place)
inline void relu_squared_backward_from_square(const bf16* a, const bf16* da, bf16* du, size_t n, cudaStream_t stream) {
  relu_squared_backward_of<true>(a, da, du, n, stream);
}
