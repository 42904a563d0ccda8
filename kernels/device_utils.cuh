// Small device helpers shared by the kernel headers: warp/block reductions, 16-byte vectors,
// the grid of elementwise kernels, fp32 <-> bf16 conversion, asynchronous uploads of host arrays,
// and every kernel's first statement (await_previous_kernel).
#pragma once
#include "kernels/host/cuda_check.cuh"
#include "kernels/host/launch.cuh"
#include "kernels/ptx.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

using bf16 = __nv_bfloat16;

// The first statement of every kernel in kernels/ (tests/test_kernel_entry.py checks it): under
// programmatic dependent launch (kernels/host/launch.cuh) it waits until the kernel before it in
// the stream has completed and its writes are visible, then lets the next kernel launch (its
// blocks take SMs as this kernel's last ones leave them, and wait there in turn). Launched without
// PDL, both instructions do nothing.
__device__ inline void await_previous_kernel() {
  ptx::griddepcontrol_wait();
  ptx::griddepcontrol_launch_dependents();
}

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ inline float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
constexpr size_t kBlockSumSharedBytes = 33 * sizeof(float);  // block_sum's static shared memory
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

// 2^x for x in [-126, 127] on the FMA pipe instead of the special-function unit (MUFU), for kernels
// that the MUFU pipe bounds: x = j + f with j = round(x), a degree-5 minimax polynomial of 2^f on
// [-1/2, 1/2] (relative error 2.1e-7, about 4 ulp, where ex2.approx has 2), times 2^j. Adding
// 1.5 * 2^23 + 127 rounds x and leaves j + 127 in the sum's low bits, so 2^j's bits are one shift
// of them. About 10 issue slots against MUFU.EX2's one, but the MUFU pipe takes 8 cycles a warp:
// a kernel that evaluates some of its exponentials here and the rest on MUFU balances the two pipes.
// Outside [-126, 127] the result is wrong (the caller bounds x); NaN stays NaN.
__device__ inline float exp2_fma(float x) {
  constexpr float kRoundAndBias = 12582912.0f + 127.0f;
  const float rounded = __fadd_rn(x, kRoundAndBias);
  const float f = x - __fadd_rn(rounded, -kRoundAndBias);
  float p = 1.327647129e-3f;
  p = fmaf(p, f, 9.675540961e-3f);
  p = fmaf(p, f, 5.550713092e-2f);
  p = fmaf(p, f, 2.402212024e-1f);
  p = fmaf(p, f, 6.931469440e-1f);
  p = fmaf(p, f, 1.000000119e+0f);
  return p * __int_as_float(int(uint32_t(__float_as_int(rounded)) << 23));
}

// x rounded to bf16 (to nearest, as store8 rounds), as a float.
__device__ inline float round_to_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// Eight bf16 in one 16-byte load/store.
struct alignas(16) Bf16x8 {
  bf16 v[8];
};

__device__ inline void load8(const bf16* p, float out[8]) {
  Bf16x8 x = *reinterpret_cast<const Bf16x8*>(p);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = __bfloat162float(x.v[i]);
}

// Eight fp32 in two 16-byte loads (p 16-byte aligned).
__device__ inline void load8(const float* p, float out[8]) {
  float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
  out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

// Eight fp32 in two 16-byte stores (p 16-byte aligned).
__device__ inline void store8(float* p, const float in[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(in[0], in[1], in[2], in[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(in[4], in[5], in[6], in[7]);
}

// Rounded to nearest even two at a time (cvt.rn.bf16x2.f32: the same bits as one at a time, half
// the conversions).
__device__ inline void store8(bf16* p, const float in[8]) {
  Bf16x8 x;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    reinterpret_cast<__nv_bfloat162*>(x.v)[i] = __float22bfloat162_rn(make_float2(in[2 * i], in[2 * i + 1]));
  *reinterpret_cast<Bf16x8*>(p) = x;
}

// Four bf16 in one 8-byte load/store (p 8-byte aligned).
struct alignas(8) Bf16x4 {
  bf16 v[4];
};

__device__ inline void load4(const bf16* p, float out[4]) {
  Bf16x4 x = *reinterpret_cast<const Bf16x4*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = __bfloat162float(x.v[i]);
}

__device__ inline void store4(bf16* p, const float in[4]) {
  Bf16x4 x;
#pragma unroll
  for (int i = 0; i < 4; ++i) x.v[i] = __float2bfloat16(in[i]);
  *reinterpret_cast<Bf16x4*>(p) = x;
}

// norms[i] = ||x[i n .. (i + 1) n)||_F for a batch of matrices x [batch, n]. Each block sums the
// squares of one chunk of kFrobeniusChunk elements of one matrix (8 elements a load where n and x
// allow), then a warp per matrix adds its chunks' partial sums in chunk order: deterministic, and a
// matrix's norm is the same whatever batch it is in (the self-check compares the batched Muon with
// one matrix at a time). One block per matrix, as before, left most SMs idle and read about 8 GB/s
// a block: 0.55 ms a call for the MLP's shape group on an H200 (docs/PERF.md, 2026-11-27).
constexpr int kFrobeniusThreads = 256;
constexpr size_t kFrobeniusChunk = 16384;
inline size_t frobenius_chunks(size_t n) { return std::max<size_t>((n + kFrobeniusChunk - 1) / kFrobeniusChunk, 1); }

// partials[m * gridDim.x + c] = the sum of squares of chunk c of matrix m
template <typename T>
__global__ void __launch_bounds__(kFrobeniusThreads)
    frobenius_partials_kernel(const T* x, size_t n, bool vectors, float* partials) {
  await_previous_kernel();
  const size_t first = blockIdx.x * kFrobeniusChunk, end = first + kFrobeniusChunk < n ? first + kFrobeniusChunk : n;
  const T* matrix = x + blockIdx.y * n;
  float ss = 0;
  if (vectors) {
    for (size_t i = first + threadIdx.x * 8; i < end; i += kFrobeniusThreads * 8) {
      float v[8];
      load8(matrix + i, v);
#pragma unroll
      for (int j = 0; j < 8; ++j) ss += v[j] * v[j];
    }
  } else {
    for (size_t i = first + threadIdx.x; i < end; i += kFrobeniusThreads) {
      const float v = float(matrix[i]);
      ss += v * v;
    }
  }
  ss = block_sum(ss);
  if (threadIdx.x == 0) partials[blockIdx.y * gridDim.x + blockIdx.x] = ss;
}

// norms[m] = sqrt(partials[m * chunks] + ... + partials[m * chunks + chunks - 1]), a warp per matrix
__global__ void frobenius_finish_kernel(const float* partials, int chunks, float* norms) {
  await_previous_kernel();
  const float* mine = partials + size_t(blockIdx.x) * chunks;
  float ss = 0;
  for (int c = threadIdx.x; c < chunks; c += 32) ss += mine[c];
  ss = warp_sum(ss);
  if (threadIdx.x == 0) norms[blockIdx.x] = sqrtf(ss);
}

// norms [batch] of x [batch, n]; partials: room for batch * frobenius_chunks(n) floats.
template <typename T>
void frobenius_norms(const T* x, int batch, size_t n, float* partials, float* norms, cudaStream_t stream) {
  const size_t chunks = frobenius_chunks(n);
  const bool vectors = n % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  CUDA_CHECK(launch_kernel(frobenius_partials_kernel<T>, dim3(unsigned(chunks), unsigned(batch)), kFrobeniusThreads, 0,
                           stream, x, n, vectors, partials));
  CUDA_CHECK(launch_kernel(frobenius_finish_kernel, batch, 32, 0, stream, partials, int(chunks), norms));
}

// The current device's SMs (asked once: a process drives one device).
inline int multiprocessor_count() {
  static const int count = [] {
    int device = 0, sms = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return sms;
  }();
  return count;
}

// 256-thread blocks over `items`, grid-stride past 16 blocks per SM (132 SMs on an H100); at least
// one block, so that an empty launch is not an invalid configuration.
inline int elementwise_grid(size_t items) {
  size_t blocks = (items + 255) / 256;
  return int(blocks < 1 ? 1 : blocks < 132 * 16 ? blocks : 132 * 16);
}

template <typename From, typename To>
__global__ void convert_kernel(const From* in, To* out, size_t n) {
  await_previous_kernel();
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = To(float(in[i]));
}

// out[n] = in[n] converted (fp32 -> bf16 rounds to nearest even)
template <typename From, typename To>
void convert(const From* in, To* out, size_t n, cudaStream_t stream) {
  CUDA_CHECK(launch_kernel(convert_kernel<From, To>, elementwise_grid(n), 256, 0, stream, in, out, n));
}

// *sum += the 32-bit words of data[words] added as integers: independent of the order of the
// additions, so equal buffers give equal sums on every GPU (a checksum, not a hash).
__global__ void word_sum_kernel(const uint32_t* data, size_t words, unsigned long long* sum) {
  await_previous_kernel();
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < words; i += size_t(gridDim.x) * blockDim.x)
    local += data[i];
  atomicAdd(sum, local);
}

// The word sum of `bytes` (a multiple of 4) at data; synchronous (the caller compares it on the host).
inline uint64_t device_word_sum(const void* data, size_t bytes, unsigned long long* scratch, cudaStream_t stream) {
  CUDA_CHECK(cudaMemsetAsync(scratch, 0, sizeof *scratch, stream));
  CUDA_CHECK(launch_kernel(word_sum_kernel, elementwise_grid(bytes / 4), 256, 0, stream,
                           static_cast<const uint32_t*>(data), bytes / 4, scratch));
  unsigned long long sum = 0;
  CUDA_CHECK(cudaMemcpyAsync(&sum, scratch, sizeof sum, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return sum;
}

// Device copies of a micro-sequence's small host-built arrays (attention block lists, embedding
// row order) without a device sync: staged in pinned memory, copied asynchronously on the stream
// that reads them. One set is reused for every micro-sequence; stream order keeps the previous
// readers ahead of the next copies, and reset() waits only until the previous copies have left the
// staging memory, so the host prepares micro-sequence j + 1 while the GPU runs j.
class StagedUploads {
 public:
  static constexpr size_t kAlignment = 256;
  static size_t bytes_for(size_t count, size_t element_bytes) {
    return (std::max<size_t>(count, 1) * element_bytes + kAlignment - 1) / kAlignment * kAlignment;
  }
  template <typename X>
  static size_t bytes_for(const std::vector<X>& host) {
    return bytes_for(host.size(), sizeof(X));
  }

  StagedUploads() { CUDA_CHECK(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming)); }
  ~StagedUploads() {
    release();
    cudaEventDestroy(copied_);
  }
  StagedUploads(const StagedUploads&) = delete;
  StagedUploads& operator=(const StagedUploads&) = delete;

  // Starts a new set of `bytes` (the sum of bytes_for of what follows); the previous set's device
  // memory may be overwritten by the next copies once the stream reaches them.
  void reset(size_t bytes) {
    CUDA_CHECK(cudaEventSynchronize(copied_));
    if (bytes > capacity_) {  // rare: doubling, so a few times per run at most
      const size_t grown = std::max(bytes, 2 * capacity_);
      CUDA_CHECK(cudaDeviceSynchronize());  // the old device memory may still be read
      release();
      CUDA_CHECK(cudaMallocHost(&staging_, grown));
      CUDA_CHECK(cudaMalloc(&device_, grown));
      capacity_ = grown;
    }
    used_ = 0;
  }

  template <typename X>
  X* upload(const std::vector<X>& host, cudaStream_t stream) {
    const size_t bytes = host.size() * sizeof(X), slot = bytes_for(host);
    if (used_ + slot > capacity_)
      throw std::logic_error("StagedUploads: " + std::to_string(used_ + slot) + " bytes staged, reset() reserved " +
                             std::to_string(capacity_));
    char *staged = static_cast<char*>(staging_) + used_, *on_device = static_cast<char*>(device_) + used_;
    std::memcpy(staged, host.data(), bytes);
    CUDA_CHECK(cudaMemcpyAsync(on_device, staged, bytes, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaEventRecord(copied_, stream));
    used_ += slot;
    return reinterpret_cast<X*>(on_device);
  }

 private:
  void release() {
    cudaFreeHost(staging_);
    cudaFree(device_);
    staging_ = device_ = nullptr;
    capacity_ = 0;
  }
  void *staging_ = nullptr, *device_ = nullptr;
  size_t capacity_ = 0, used_ = 0;
  cudaEvent_t copied_ = nullptr;
};
