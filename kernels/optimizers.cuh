// Optimizer kernels. Adam (SPEC 1.10) on one flat slice of a parameter, with the gradient's one
// normalisation (grad_scale = 1/M, SPEC 4.2) fused in; parameter, gradient and states may be fp32
// or bf16 (the reference keeps the embeddings' states in bf16), the arithmetic is fp32.
#pragma once
#include "kernels/host/cuda_check.cuh"
#include "kernels/device_utils.cuh"

#include <cmath>

struct AdamStep {
  float lr, beta1 = 0.8f, beta2 = 0.95f, eps = 1e-10f;
  int64_t t;          // step count, from 1
  float grad_scale;   // 1 / global micro-sequence count
};

__device__ inline float to_float(float x) { return x; }
__device__ inline float to_float(bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ inline T from_float(float x);
template <> __device__ inline float from_float<float>(float x) { return x; }
template <> __device__ inline bf16 from_float<bf16>(float x) { return __float2bfloat16(x); }

// p, g, m, v: [n]
template <typename P, typename G, typename S>
__global__ void adam_kernel(P* p, const G* g, S* m, S* v, int64_t n, AdamStep s, float step_size) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float grad = to_float(g[i]) * s.grad_scale;
    float mi = s.beta1 * to_float(m[i]) + (1 - s.beta1) * grad;
    float vi = s.beta2 * to_float(v[i]) + (1 - s.beta2) * grad * grad;
    m[i] = from_float<S>(mi);
    v[i] = from_float<S>(vi);
    p[i] = from_float<P>(to_float(p[i]) - step_size * to_float(m[i]) / (sqrtf(to_float(v[i])) + s.eps));
  }
}

template <typename P, typename G, typename S>
void adam_update(P* p, const G* g, S* m, S* v, int64_t n, const AdamStep& s, cudaStream_t stream) {
  double bias1 = 1 - std::pow(double(s.beta1), double(s.t)), bias2 = 1 - std::pow(double(s.beta2), double(s.t));
  float step_size = float(s.lr * std::sqrt(bias2) / bias1);
  adam_kernel<<<elementwise_grid(size_t(n)), 256, 0, stream>>>(p, g, m, v, n, s, step_size);
  CUDA_CHECK_LAUNCH();
}
