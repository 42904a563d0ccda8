// Small device helpers shared by the kernel headers: warp/block reductions and 16-byte bf16 vectors.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

using bf16 = __nv_bfloat16;

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ inline float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
__device__ inline float block_sum(float v) {
  __shared__ float partial[32];
  __shared__ float total;
  v = warp_sum(v);
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // partial[] may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < blockDim.x / 32 ? partial[lane] : 0.0f;
    s = warp_sum(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// Eight bf16 in one 16-byte load/store.
struct alignas(16) Bf16x8 {
  bf16 v[8];
};

__device__ inline void load8(const bf16* p, float out[8]) {
  Bf16x8 x = *reinterpret_cast<const Bf16x8*>(p);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = __bfloat162float(x.v[i]);
}

__device__ inline void store8(bf16* p, const float in[8]) {
  Bf16x8 x;
#pragma unroll
  for (int i = 0; i < 8; ++i) x.v[i] = __float2bfloat16(in[i]);
  *reinterpret_cast<Bf16x8*>(p) = x;
}
