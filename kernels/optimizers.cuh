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

// Adam on kVec consecutive elements from i (8: 16-byte accesses, every pointer aligned for them).
template <int kVec, typename P, typename G, typename S>
__device__ inline void adam_elements(P* p, const G* g, S* m, S* v, int64_t i, const AdamStep& s, float step_size) {
  float pf[kVec], gf[kVec], mf[kVec], vf[kVec];
  if constexpr (kVec == 8) {
    load8(p + i, pf), load8(g + i, gf), load8(m + i, mf), load8(v + i, vf);
  } else {
    pf[0] = to_float(p[i]), gf[0] = to_float(g[i]), mf[0] = to_float(m[i]), vf[0] = to_float(v[i]);
  }
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    const float grad = gf[e] * s.grad_scale;
    // the states as stored (bf16 rounds them), and the update from the stored ones
    mf[e] = to_float(from_float<S>(s.beta1 * mf[e] + (1 - s.beta1) * grad));
    vf[e] = to_float(from_float<S>(s.beta2 * vf[e] + (1 - s.beta2) * grad * grad));
    pf[e] = pf[e] - step_size * mf[e] / (sqrtf(vf[e]) + s.eps);
  }
  if constexpr (kVec == 8) {
    store8(m + i, mf), store8(v + i, vf), store8(p + i, pf);
  } else {
    m[i] = from_float<S>(mf[0]), v[i] = from_float<S>(vf[0]), p[i] = from_float<P>(pf[0]);
  }
}

// p, g, m, v: [n]. With `vectors`, eight elements a thread a turn over the first n / 8 * 8, then
// the rest one a thread; otherwise (a pointer off 16 bytes) one a thread throughout.
template <typename P, typename G, typename S>
__global__ void adam_kernel(P* p, const G* g, S* m, S* v, int64_t n, AdamStep s, float step_size, bool vectors) {
  await_previous_kernel();
  const int64_t stride = int64_t(gridDim.x) * blockDim.x, first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t vectorised = vectors ? n / 8 * 8 : 0;
  for (int64_t i = first * 8; i < vectorised; i += stride * 8) adam_elements<8>(p, g, m, v, i, s, step_size);
  for (int64_t i = vectorised + first; i < n; i += stride) adam_elements<1>(p, g, m, v, i, s, step_size);
}

template <typename P, typename G, typename S>
void adam_update(P* p, const G* g, S* m, S* v, int64_t n, const AdamStep& s, cudaStream_t stream) {
  double bias1 = 1 - std::pow(double(s.beta1), double(s.t)), bias2 = 1 - std::pow(double(s.beta2), double(s.t));
  float step_size = float(s.lr * std::sqrt(bias2) / bias1);
  const bool vectors = (reinterpret_cast<uintptr_t>(p) | reinterpret_cast<uintptr_t>(g) | reinterpret_cast<uintptr_t>(m) |
                        reinterpret_cast<uintptr_t>(v)) % 16 == 0;
  CUDA_CHECK(launch_kernel(adam_kernel<P, G, S>, elementwise_grid(size_t(vectors ? (n + 7) / 8 : n)), 256, 0, stream, p, g, m, v,
                           n, s, step_size, vectors));
}
