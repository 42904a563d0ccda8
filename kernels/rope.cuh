// QK-norm fused with half-truncated RoPE (SPEC 1.3), forward and backward, head_dim 128.
// One warp per (token, head, q or k): lane l holds elements [4l, 4l + 4), read and written as one
// 8-byte vector, with their 4 (cos, sin) pairs as two 16-byte loads (the kernels are memory-bound:
// scalar accesses made them LSU-bound, docs/PERF.md); rotation pairs j with j + 64, which sit in
// lanes l and l ^ 16. Angles are the reference's fp32 t * freq; the norm and rotation run in fp32
// without an intermediate bf16 rounding.
#pragma once
#include "kernels/host/cuda_check.cuh"
#include "kernels/device_utils.cuh"
#include "kernels/norms.cuh"

#include <cmath>
#include <vector>

constexpr int kRopeHeadDim = 128;

// cos_sin [T, 64, 2]: for pair j < 32 frequency (1/1024)^(j/31), for j >= 32 zero (no rotation).
inline void rope_table_host(int T, std::vector<float>& cos_sin) {
  const int pairs = kRopeHeadDim / 2, rotated = kRopeHeadDim / 4;
  cos_sin.resize(size_t(T) * pairs * 2);
  for (int j = 0; j < pairs; ++j) {
    float freq = j < rotated ? std::pow(1.0f / 1024, float(j) / (rotated - 1)) : 0.0f;
    for (int t = 0; t < T; ++t) {
      float theta = float(t) * freq;  // fp32 product, as the reference's einsum
      cos_sin[(size_t(t) * pairs + j) * 2] = float(std::cos(double(theta)));
      cos_sin[(size_t(t) * pairs + j) * 2 + 1] = float(std::sin(double(theta)));
    }
  }
}

// Rotation of this lane's 4 elements; inverse applies the transpose (used by the backward).
__device__ inline void rope_rotate(float v[4], const float* cos_sin_t, int lane, bool inverse) {
  float other[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) other[i] = __shfl_xor_sync(0xffffffffu, v[i], 16);
  bool first_half = lane < 16;
  float angles[8];  // (cos, sin) of pairs (lane % 16) * 4 + i
  load8(cos_sin_t + (lane % 16) * 8, angles);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float c = angles[2 * i], s = angles[2 * i + 1];
    if (inverse) s = -s;
    // y1 = x1 c + x2 s ; y2 = -x1 s + x2 c
    v[i] = first_half ? v[i] * c + other[i] * s : -other[i] * s + v[i] * c;
  }
}

// qkv [T, 3, H, 128] raw projections -> q, k [T, H, 128] normalised and rotated.
__global__ void qk_norm_rope_forward_kernel(const bf16* qkv, const float* cos_sin, bf16* q, bf16* k, int T,
                                            int H, float eps) {
  await_previous_kernel();
  int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= T * H * 2) return;
  int which = warp % 2, th = warp / 2, t = th / H, h = th % H;
  const bf16* src = qkv + (size_t(t) * 3 + which) * H * kRopeHeadDim + h * kRopeHeadDim + lane * 4;
  float v[4], ss = 0;
  load4(src, v);
#pragma unroll
  for (int i = 0; i < 4; ++i) ss += v[i] * v[i];
  float inv = rsqrtf(warp_sum(ss) / kRopeHeadDim + eps);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] *= inv;
  rope_rotate(v, cos_sin + size_t(t) * kRopeHeadDim, lane, false);
  store4((which == 0 ? q : k) + size_t(th) * kRopeHeadDim + lane * 4, v);
}

// dq, dk [T, H, 128] -> the q and k parts of dqkv [T, 3, H, 128] (the v part is left untouched).
__global__ void qk_norm_rope_backward_kernel(const bf16* qkv, const bf16* dq, const bf16* dk,
                                             const float* cos_sin, bf16* dqkv, int T, int H, float eps) {
  await_previous_kernel();
  int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= T * H * 2) return;
  int which = warp % 2, th = warp / 2, t = th / H, h = th % H;
  size_t raw_at = (size_t(t) * 3 + which) * H * kRopeHeadDim + h * kRopeHeadDim + lane * 4;
  const bf16* grad = (which == 0 ? dq : dk) + size_t(th) * kRopeHeadDim + lane * 4;
  float x[4], g[4], ss = 0, dot = 0;
  load4(qkv + raw_at, x);
  load4(grad, g);
  rope_rotate(g, cos_sin + size_t(t) * kRopeHeadDim, lane, true);
#pragma unroll
  for (int i = 0; i < 4; ++i) ss += x[i] * x[i], dot += x[i] * g[i];
  float inv = rsqrtf(warp_sum(ss) / kRopeHeadDim + eps), mean_dot = warp_sum(dot) / kRopeHeadDim;
  float d[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] = inv * g[i] - inv * inv * inv * x[i] * mean_dot;
  store4(dqkv + raw_at, d);
}

inline void qk_norm_rope_forward(const bf16* qkv, const float* cos_sin, bf16* q, bf16* k, int T, int H,
                                 cudaStream_t stream, float eps = kRmsEps) {
  const int warps = 8, items = T * H * 2;
  CUDA_CHECK(launch_kernel(qk_norm_rope_forward_kernel, (items + warps - 1) / warps, warps * 32, 0, stream, qkv,
                           cos_sin, q, k, T, H, eps));
}

inline void qk_norm_rope_backward(const bf16* qkv, const bf16* dq, const bf16* dk, const float* cos_sin, bf16* dqkv,
                                  int T, int H, cudaStream_t stream, float eps = kRmsEps) {
  const int warps = 8, items = T * H * 2;
  CUDA_CHECK(launch_kernel(qk_norm_rope_backward_kernel, (items + warps - 1) / warps, warps * 32, 0, stream, qkv, dq,
                           dk, cos_sin, dqkv, T, H, eps));
}
