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
#include "kernels/norms.cuh"

#include <algorithm>
#include <stdexcept>
#include <string>

// The scalar reductions' grids, one partial sum a block, sized for the 132 SMs of an H100 SXM or an
// H200: weighted_sum_backward's 256-thread blocks (at most 32 registers a thread: its launch bounds)
// fill an SM with 8, so that enough loads are in flight for a streaming pass (with 2 an SM, 16
// warps, it reached 57% of the copy rate on the H200: docs/PERF.md, 2026-11-27); mix_norm_backward's
// (128 registers a thread) fit 2 an SM.
constexpr int kScalarReductionBlocks = 8 * 132;
constexpr int kMixNormBackwardBlocks = 2 * 132;
static_assert(kMixNormBackwardBlocks <= kScalarReductionBlocks, "the partials' scratch holds both grids'");
// The scalar reductions' scratch: up to 3 sums' per-block partials.
constexpr size_t kScalarReductionScratchFloats = 3 * kScalarReductionBlocks;

// weighted_sum_backward's grid: 8 blocks per SM at the record's shapes, fewer where T x d is small
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

// a x + b y in fp32: one expression, so that the fused pass below rounds as the separate ones do
__device__ inline float weighted(float a, float x, float b, float y) { return a * x + b * y; }

// out[T, d] = a x[T, d; row stride x_stride] + b y[T, d]; a or b null means 1, y null means no y term
__global__ void weighted_sum_forward_kernel(const bf16* x, int x_stride, const float* a, const bf16* y, const float* b,
                                            bf16* out, int T, int d) {
  await_previous_kernel();
  const int vectors_per_row = d / 8;
  const float alpha = a ? *a : 1.0f, beta = !y ? 0.0f : b ? *b : 1.0f;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(T) * vectors_per_row;
       i += size_t(gridDim.x) * blockDim.x) {
    size_t t = i / vectors_per_row, c = (i % vectors_per_row) * 8;
    float xv[8], yv[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    load8(x + t * x_stride + c, xv);
    if (y) load8(y + t * d + c, yv);
#pragma unroll
    for (int k = 0; k < 8; ++k) xv[k] = weighted(alpha, xv[k], beta, yv[k]);
    store8(out + t * d + c, xv);
  }
}

inline void weighted_sum_forward(const bf16* x, const float* a, const bf16* y, const float* b, bf16* out, int T, int d,
                                 int x_stride, cudaStream_t stream) {
  check_residual_width(d, x_stride);
  CUDA_CHECK(launch_kernel(weighted_sum_forward_kernel, elementwise_grid(size_t(T) * d / 8), 256, 0, stream, x,
                           x_stride, a, y, b, out, T, d));
}

// A block's input in one pass over its rows, one warp a row: the three separate passes
// (weighted_sum_forward twice, rmsnorm_forward), their formulas and bf16 roundings, reading each
// input once (6 passes over [T, d] where they made 8 with the skip, 4 where 5 without):
//   x_in    = prev + w skip             (U-net skip: when skip is not null; else x_in is read)
//   x_mixed = l0 x_in + l1 x0           (the block lambdas)
//   h       = rmsnorm(x_mixed)          (the attention's or, without attention, the MLP's input)
template <int vectors>
__global__ void mix_norm_forward_kernel(const bf16* prev, const bf16* skip, const float* w, bf16* x_in, const bf16* x0,
                                        const float* l0, const float* l1, bf16* x_mixed, bf16* h, int T, int d,
                                        float eps) {
  await_previous_kernel();
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= T) return;
  const size_t base = size_t(row) * d;
  const float skip_weight = skip ? *w : 0.0f, lambda0 = *l0, lambda1 = *l1;
  float v[vectors][8], ss = 0;
#pragma unroll
  for (int k = 0; k < vectors; ++k) {
    const int col = (k * 32 + lane) * 8;
    if (col >= d) continue;
    float other[8];
    if (skip) {
      load8(prev + base + col, v[k]);
      load8(skip + base + col, other);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[k][i] = round_to_bf16(weighted(1.0f, v[k][i], skip_weight, other[i]));
      store8(x_in + base + col, v[k]);
    } else {
      load8(x_in + base + col, v[k]);
    }
    load8(x0 + base + col, other);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[k][i] = round_to_bf16(weighted(lambda0, v[k][i], lambda1, other[i]));
    store8(x_mixed + base + col, v[k]);
    for (int i = 0; i < 8; ++i) ss += v[k][i] * v[k][i];
  }
  const float inv = rsqrtf(warp_sum(ss) / d + eps);
#pragma unroll
  for (int k = 0; k < vectors; ++k) {
    const int col = (k * 32 + lane) * 8;
    if (col >= d) continue;
    for (int i = 0; i < 8; ++i) v[k][i] *= inv;
    store8(h + base + col, v[k]);
  }
}

// x_in, x_mixed, h [T, d] as above; prev, skip, w all null when the block has no skip (x_in read).
inline void mix_norm_forward(const bf16* prev, const bf16* skip, const float* w, bf16* x_in, const bf16* x0,
                             const float* l0, const float* l1, bf16* x_mixed, bf16* h, int T, int d,
                             cudaStream_t stream, float eps = kRmsEps) {
  check_norm_width(d);
  if (!skip != !prev || !skip != !w) throw std::invalid_argument("mix_norm_forward: prev, skip and w go together");
  const int warps = 8;
  with_norm_vectors(d, [&](auto vectors) {
    constexpr int v = decltype(vectors)::value;
    CUDA_CHECK(launch_kernel(mix_norm_forward_kernel<v>, (T + warps - 1) / warps, warps * 32, 0, stream, prev, skip, w,
                             x_in, x0, l0, l1, x_mixed, h, T, d, eps));
  });
}

// The backward of out = a x + b y for one dout[T, d]:
//   dx[T, d; stride x_stride] = a dout        (skipped when dx is null)
//   dy[T, d] (+)= b dout                      (skipped when dy is null; accumulate_dy adds)
//   partial[block], partial[blocks + block]  = this block's share of sum(dout x), sum(dout y)
//                                             (x, y null: not needed, 0)
// dx may alias dout (same element read, then written by the same thread).
__global__ void __launch_bounds__(256, 8)
    weighted_sum_backward_kernel(const bf16* dout, const bf16* x, int x_stride, const float* a, const bf16* y,
                                 const float* b, bf16* dx, bf16* dy, bool accumulate_dy, float* partial, int T, int d) {
  await_previous_kernel();
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

// da += sum(partial[0, blocks)), db += sum(partial[blocks, 2 blocks)) and, with dc,
// dc += sum(partial[2 blocks, 3 blocks)), each in block order
__global__ void add_scalar_gradients_kernel(const float* partial, int blocks, float* da, float* db,
                                            float* dc = nullptr) {
  await_previous_kernel();
  float sum_x = 0, sum_y = 0, sum_z = 0;
  for (int i = threadIdx.x; i < blocks; i += blockDim.x) {
    sum_x += partial[i], sum_y += partial[blocks + i];
    if (dc) sum_z += partial[2 * blocks + i];
  }
  sum_x = block_sum(sum_x);
  sum_y = block_sum(sum_y);
  sum_z = block_sum(sum_z);
  if (threadIdx.x == 0) {
    if (da) *da += sum_x;
    if (db) *db += sum_y;
    if (dc) *dc += sum_z;
  }
}

// The same on the stream (da, db or dc null: that sum is skipped).
inline void add_scalar_gradients(const float* partial, int blocks, float* da, float* db, float* dc,
                                 cudaStream_t stream) {
  CUDA_CHECK(launch_kernel(add_scalar_gradients_kernel, 1, 256, 0, stream, partial, blocks, da, db, dc));
}

// Gradients of out = a x + b y (a or b null: 1): dx (stride x_stride, may alias dout) = a dout, dy (+)= b dout, and
// the scalar gradients da += sum(dout x), db += sum(dout y) (each skipped when null). scratch holds
// kScalarReductionScratchFloats floats.
inline void weighted_sum_backward(const bf16* dout, const bf16* x, const float* a, float* da, const bf16* y,
                                  const float* b, float* db, bf16* dx, bf16* dy, bool accumulate_dy, int T, int d,
                                  int x_stride, float* scratch, cudaStream_t stream) {
  check_residual_width(d, x_stride);
  if (dx == dout && !a) dx = nullptr;  // dx = 1 * dout in place: nothing to write
  const int blocks = scalar_reduction_blocks(T, d);
  CUDA_CHECK(launch_kernel(weighted_sum_backward_kernel, blocks, 256, 0, stream, dout, da ? x : nullptr, x_stride, a,
                           db ? y : nullptr, b, dx, dy, accumulate_dy, scratch, T, d));
  if (!da && !db) return;
  add_scalar_gradients(scratch, blocks, da, db, nullptr, stream);
}

// The backward of a block's input (mix_norm_forward), once dh holds the gradient of its norm h, in
// one pass over the rows, one warp a row, with the separate passes' formulas and bf16 roundings
// (rmsnorm_backward accumulating into dx, then weighted_sum_backward of the lambda mix and, with
// the skip, of x_in = prev + w skip):
//   g    = dx + rmsnorm'(x_mixed) dh      (dx: x_mixed's gradient through the residual so far)
//   dl0 += sum(g x_in), dl1 += sum(g x0), dx0 += l1 g, dx = l0 g
//   with the skip: dw += sum(dx skip), dskip = w dx
// Scalar sums: per-block partials (rows to warps fixed by the grid), then added in block order.
template <int vectors>
__global__ void mix_norm_backward_kernel(const bf16* x_mixed, const bf16* dh, bf16* dx, const bf16* x_in,
                                         const bf16* x0, const float* l0, const float* l1, bf16* dx0,
                                         const bf16* skip, const float* w, bf16* dskip, const bf16* dx_plus,
                                         float* partial, int T, int d, float eps) {
  await_previous_kernel();
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const float lambda0 = *l0, lambda1 = *l1, skip_weight = skip ? *w : 0.0f;
  float dot_in = 0, dot_x0 = 0, dot_skip = 0;
  for (int row = blockIdx.x * warps + threadIdx.x / 32; row < T; row += gridDim.x * warps) {
    const size_t base = size_t(row) * d;
    float xv[vectors][8], hv[vectors][8], inv, mean_dot;
    rmsnorm_backward_row(x_mixed + base, dh + base, d, eps, xv, hv, inv, mean_dot);
#pragma unroll
    for (int k = 0; k < vectors; ++k) {
      const int col = (k * 32 + lane) * 8;
      if (col >= d) continue;
      float g[8], other[8];
      load8(dx + base + col, g);
#pragma unroll
      for (int i = 0; i < 8; ++i) g[i] = round_to_bf16(rmsnorm_backward_element(g[i], inv, hv[k][i], xv[k][i], mean_dot));
      load8(x_in + base + col, other);
#pragma unroll
      for (int i = 0; i < 8; ++i) dot_in += g[i] * other[i];
      load8(x0 + base + col, other);
#pragma unroll
      for (int i = 0; i < 8; ++i) dot_x0 += g[i] * other[i];
      float dx0_out[8];
      load8(dx0 + base + col, dx0_out);
#pragma unroll
      for (int i = 0; i < 8; ++i) dx0_out[i] += lambda1 * g[i];
#pragma unroll
      for (int i = 0; i < 8; ++i) g[i] = round_to_bf16(lambda0 * g[i]);
      float plus[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (skip) {
        load8(skip + base + col, other);
#pragma unroll
        for (int i = 0; i < 8; ++i) dot_skip += g[i] * other[i], other[i] = skip_weight * g[i];
        store8(dskip + base + col, other);
        if (dx_plus == dskip)  // the skip's gradient is this pass's own: as stored, in bf16
#pragma unroll
          for (int i = 0; i < 8; ++i) plus[i] = round_to_bf16(other[i]);
      }
      if (dx_plus && dx_plus != dskip) load8(dx_plus + base + col, plus);
#pragma unroll
      for (int i = 0; i < 8; ++i) g[i] += plus[i];
      if (x_in == x0) {  // the first block's input is x0: its gradient joins dx0's, each rounded as stored
#pragma unroll
        for (int i = 0; i < 8; ++i) dx0_out[i] = round_to_bf16(dx0_out[i]) + round_to_bf16(g[i]);
      } else {
        store8(dx + base + col, g);
      }
      store8(dx0 + base + col, dx0_out);
    }
  }
  dot_in = block_sum(dot_in);
  dot_x0 = block_sum(dot_x0);
  dot_skip = block_sum(dot_skip);
  if (threadIdx.x == 0) {
    partial[blockIdx.x] = dot_in;
    partial[gridDim.x + blockIdx.x] = dot_x0;
    partial[2 * gridDim.x + blockIdx.x] = dot_skip;
  }
}

// [T, d] each; skip, w, dw, dskip all null when the block has no skip. dx_plus (or null) is added to
// dx as it is written: the gradient the previous layer's output got through a skip (may be this
// pass's own dskip, as stored in bf16), so that no separate pass adds it. Where x_in is x0 (the
// first block), the gradient of x_in is x0's too: it is added into dx0 and dx is not written.
// scratch: kScalarReductionScratchFloats floats.
inline void mix_norm_backward(const bf16* x_mixed, const bf16* dh, bf16* dx, const bf16* x_in, const bf16* x0,
                              const float* l0, float* dl0, const float* l1, float* dl1, bf16* dx0, const bf16* skip,
                              const float* w, float* dw, bf16* dskip, const bf16* dx_plus, int T, int d, float* scratch,
                              cudaStream_t stream, float eps = kRmsEps) {
  check_norm_width(d);
  if (!skip != !w || !skip != !dw || !skip != !dskip)
    throw std::invalid_argument("mix_norm_backward: skip, w, dw and dskip go together");
  if (dx_plus && (dx_plus == dx || dx_plus == dx0))
    throw std::invalid_argument("mix_norm_backward: dx_plus may be dskip, not an output it would read as written");
  const int warps = 8, blocks = std::min(kMixNormBackwardBlocks, (T + warps - 1) / warps);
  with_norm_vectors(d, [&](auto vectors) {
    constexpr int v = decltype(vectors)::value;
    CUDA_CHECK(launch_kernel(mix_norm_backward_kernel<v>, blocks, warps * 32, 0, stream, x_mixed, dh, dx, x_in, x0, l0,
                             l1, dx0, skip, w, dskip, dx_plus, scratch, T, d, eps));
  });
  add_scalar_gradients(scratch, blocks, dl0, dl1, dw, stream);
}

// dst[n] += src[n], bf16, n a multiple of 8
__global__ void add_into_kernel(const bf16* src, bf16* dst, size_t vectors) {
  await_previous_kernel();
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
  CUDA_CHECK(launch_kernel(add_into_kernel, elementwise_grid(n / 8), 256, 0, stream, src, dst, n / 8));
}

// y[T, n] = x[T, k] W[n, k]^T + residual[T, n] (bf16): with `fused`, the residual is cuBLASLt's C
// (D elsewhere: one pass); otherwise the product and then an add (the self-check's reference, and
// the run's path with --residual-add separate). `o`: the product's options (its cuBLASLt candidate).
inline void linear_with_residual(Matmul& matmul, const bf16* x, const bf16* w, bf16* y, int T, int n, int k,
                                 const bf16* residual, bool fused, cudaStream_t stream, MatmulOptions o = {}) {
  if (fused) o.addend = residual;
  matmul(x, Transpose::N, w, Transpose::T, y, T, n, k, CUDA_R_16BF, o, stream, 1.0f, fused ? 1.0f : 0.0f);
  if (!fused) add_into(residual, y, size_t(T) * n, stream);
}
