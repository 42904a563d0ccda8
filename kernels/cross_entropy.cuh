// Softcapped cross-entropy over the padded vocabulary (SPEC 1.2.7), forward and backward fused:
// z = cap * sigmoid(logit / divisor), loss_t = logsumexp(z_t) - z_t[target]. One block per token;
// its row of bf16 logits is read once, its sigmoids kept in shared memory, and the gradient of the
// SUMMED loss (times grad_scale) overwrites the logits in place or goes straight to the FP8 head's
// e5m2 operand: no probability tensor is ever stored.
#pragma once
#include "kernels/host/cuda_check.cuh"
#include "kernels/device_utils.cuh"
#include "kernels/ptx.cuh"

#include <cmath>
#include <stdexcept>
#include <string>

// The reference divides by 7.5 sqrt(d), which inductor turns into a product with the double's
// reciprocal rounded to fp32 (one ulp from the fp32 reciprocal of the fp32 divisor).
struct Softcap {
  static float reciprocal_divisor(int model_dim) { return float(1 / (7.5 * std::sqrt(double(model_dim)))); }
  static Softcap for_model_dim(int model_dim) {
    Softcap s;
    s.inv_divisor = reciprocal_divisor(model_dim);
    return s;
  }
  float cap = 30.0f;
  float inv_divisor = reciprocal_divisor(768);
};

constexpr int kCrossEntropyThreads = 1024;
constexpr size_t kCrossEntropyMaxSharedBytes = 227 << 10;  // a Hopper block's opt-in shared memory

// Where the loss gradient goes, 8 elements at a time (`element` indexes [T, V]): by default in
// place over the bf16 logits; the FP8 head (fp8_head.cuh) stores its e5m2 operand instead.
struct Bf16GradientInPlace {
  bf16* logits;
  __device__ void operator()(size_t element, const float g[8]) const { store8(logits + element, g); }
};

// The row's sigmoids in shared memory: fp32, as the first pass computes them, so that the second
// pass evaluates one exponential a logit instead of three special-function operations (the kernel
// is bound by the MUFU pipe: docs/PERF.md, 86% busy with six). Element 8i + j of the row is float
// j of float4 i for j < 4, float j - 4 of float4 V/8 + i otherwise: a warp's two float4 stores are
// each 512 contiguous bytes, free of bank conflicts.
__device__ inline float row_sigmoid(const float4* sig, int vectors, int element) {
  const int i = element / 8, j = element % 8;
  return reinterpret_cast<const float*>(sig + (j < 4 ? i : vectors + i))[j % 4];
}

// The first pass evaluates 3 MUFU operations a logit (2^, 1/x for the sigmoid, 2^ for the sum) and
// is bound by the MUFU pipe (8 cycles a warp instruction; 24 for 8 logits against about 80 issue
// slots), the second pass one (2^ for p) and is bound by its issue slots: so the first pass
// evaluates 6 of each 8 logits' exp(z - cap) on the FMA pipe (exp2_fma, about 8 issue slots each)
// and the second pass none (a model: docs/PERF.md, 2026-11-28 tenth session; bench_kernels times
// other splits of both passes: if the casts that end pass 2 share MUFU's rate, pass 2 wants some).
constexpr int kCrossEntropyFmaExps = 6, kCrossEntropySecondPassFmaExps = 0;

// logits [T, V] bf16, targets [T], losses [T] fp32; the gradient (when grad_scale > 0) to `store`.
// z = cap sig <= cap, so exp(z - cap) never overflows and logsumexp needs no running maximum. Every
// exponential is a power of 2 of one FFMA: sig = 1 / (1 + 2^(x c0)), exp(z - cap) = 2^(sig c1 - c1)
// and p s = exp(z - logsumexp) s = 2^(sig c1 - c1 - log2(sum) + log2(s)) with the gradient's
// scale s = grad_scale cap / divisor folded in, c0 = -log2(e) / divisor, c1 = cap log2(e); all MUFU
// operations flush subnormals (no sum here is near them; a gradient below 2^-126 becomes 0).
template <class GradientStore, int fma_exps, int second_fma_exps>
__global__ void __launch_bounds__(kCrossEntropyThreads)
softcap_cross_entropy_kernel(const bf16* logits, const uint16_t* targets, float* losses, int V, Softcap sc,
                             float grad_scale, GradientStore store) {
  await_previous_kernel();
  extern __shared__ float4 sig_smem[];  // [V / 4]: the row's sigmoids (row_sigmoid)
  const int t = blockIdx.x, vectors = V / 8;
  constexpr float kLog2e = 1.4426950408889634f;
  const float c0 = -kLog2e * sc.inv_divisor, c1 = kLog2e * sc.cap;
  const bf16* row = logits + size_t(t) * V;
  float sum = 0;
  for (int i = threadIdx.x; i < vectors; i += blockDim.x) {
    Bf16x8 x = reinterpret_cast<const Bf16x8*>(row)[i];
    float sig[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      sig[j] = ptx::rcp_ftz(1.0f + ptx::exp2_ftz(__bfloat162float(x.v[j]) * c0));
      const float exponent = fmaf(sig[j], c1, -c1);
      sum += j < fma_exps ? exp2_fma(exponent) : ptx::exp2_ftz(exponent);
    }
    sig_smem[i] = make_float4(sig[0], sig[1], sig[2], sig[3]);
    sig_smem[vectors + i] = make_float4(sig[4], sig[5], sig[6], sig[7]);
  }
  sum = block_sum(sum);  // its barriers also publish sig_smem
  const int target = targets[t];
  // z_target = cap * sig, rounded on its own (no FMA with the sum)
  if (threadIdx.x == 0) losses[t] = sc.cap + logf(sum) - __fmul_rn(sc.cap, row_sigmoid(sig_smem, vectors, target));
  if (grad_scale == 0.0f) return;
  // dloss/dlogit = (p - [target]) s sig (1 - sig), for the 8 logits of vector i; the target's -1
  // where target_j names one of them (a compare a logit, so only where the target is)
  const float scale = grad_scale * sc.cap * sc.inv_divisor, shift = c1 + log2f(sum) - log2f(scale);
  auto gradient = [&](int i, int target_j, float (&g)[8]) {
    const float4 low = sig_smem[i], high = sig_smem[vectors + i];
    const float sig[8] = {low.x, low.y, low.z, low.w, high.x, high.y, high.z, high.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float exponent = fmaf(sig[j], c1, -shift), dsig = fmaf(-sig[j], sig[j], sig[j]);
      const float p_scaled = j < second_fma_exps ? exp2_fma(exponent) : ptx::exp2_ftz(exponent);
      g[j] = j == target_j ? fmaf(p_scaled, dsig, -scale * dsig) : p_scaled * dsig;  // (p - 1) s, rounded once
    }
  };
  for (int i = threadIdx.x; i < vectors; i += blockDim.x) {
    float g[8];
    gradient(i, -1, g);
    store(size_t(t) * V + i * 8, g);
  }
  // The thread that stored the target's vector stores it again with the -1 (after its own first
  // store, so this one stays): no compare in the loop above, no array indexed by the target.
  if (threadIdx.x == target / 8 % blockDim.x) {
    float g[8];
    gradient(target / 8, target % 8, g);
    store(size_t(t) * V + target / 8 * 8, g);
  }
}

// Token losses of logits [T, V] and, unless grad_scale is 0, the gradient of their SUM (times
// grad_scale) handed to `store`. The row read ends before any store, so a store may overwrite it.
// fma_exps, second_fma_exps: of each 8 logits' exponentials, how many each pass evaluates on the FMA
// pipe (the benchmark times other splits).
template <int fma_exps = kCrossEntropyFmaExps, int second_fma_exps = kCrossEntropySecondPassFmaExps,
          class GradientStore>
void softcap_cross_entropy(const bf16* logits, const uint16_t* targets, float* losses, int T, int V, float grad_scale,
                           GradientStore store, cudaStream_t stream, Softcap sc) {
  if (V % 8) throw std::invalid_argument("cross entropy: vocab " + std::to_string(V) + " is not a multiple of 8");
  // exp2_fma's arguments lie in [-cap log2(e), 0]: 2^-126 is its least result
  if (!(sc.cap > 0 && sc.cap * 1.4426950408889634 <= 126))
    throw std::invalid_argument("cross entropy: softcap " + std::to_string(sc.cap) + " is outside (0, 126 / log2(e)]");
  if (!(grad_scale >= 0))  // its log2 is folded into the gradient's exponent
    throw std::invalid_argument("cross entropy: gradient scale " + std::to_string(grad_scale) + " is not >= 0");
  // pass 2's exponents lie in [log2(s) - cap log2(e) - log2(V), log2(s)], s = grad_scale cap / divisor
  const double log2_scale = std::log2(double(grad_scale) * sc.cap * sc.inv_divisor);
  if (second_fma_exps > 0 && grad_scale > 0 &&
      !(log2_scale <= 127 && log2_scale - sc.cap * 1.4426950408889634 - std::log2(double(V)) >= -126))
    throw std::invalid_argument("cross entropy: gradient scale " + std::to_string(grad_scale) +
                                " puts pass 2's exponents outside exp2_fma's [-126, 127]");
  const size_t smem = size_t(V) * sizeof(float);
  if (smem + kBlockSumSharedBytes > kCrossEntropyMaxSharedBytes)
    throw std::invalid_argument("cross entropy: a row of vocab " + std::to_string(V) + " needs " +
                                std::to_string(smem) + " bytes of shared memory for its fp32 sigmoids, more than " +
                                std::to_string(kCrossEntropyMaxSharedBytes - kBlockSumSharedBytes) +
                                " (Hopper's 227 KiB a block, less block_sum's)");
  static_assert(0 <= fma_exps && fma_exps <= 8 && 0 <= second_fma_exps && second_fma_exps <= 8, "of 8 exponentials");
  CUDA_CHECK(cudaFuncSetAttribute(softcap_cross_entropy_kernel<GradientStore, fma_exps, second_fma_exps>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  CUDA_CHECK(launch_kernel(softcap_cross_entropy_kernel<GradientStore, fma_exps, second_fma_exps>, T,
                           kCrossEntropyThreads, smem, stream, logits, targets, losses, V, sc, grad_scale, store));
}

// grad_scale = 1: the gradient of the summed loss (training) overwrites the logits; 0: losses only
// (evaluation).
inline void softcap_cross_entropy(bf16* logits, const uint16_t* targets, float* losses, int T, int V,
                                  float grad_scale, cudaStream_t stream, Softcap sc = {}) {
  softcap_cross_entropy(logits, targets, losses, T, V, grad_scale, Bf16GradientInPlace{logits}, stream, sc);
}

constexpr int kLossSumThreads = 1024;

// *total += losses[0] + ... + losses[T - 1] in double, in a fixed order (one block).
__global__ void __launch_bounds__(kLossSumThreads) accumulate_loss_kernel(const float* losses, int T, double* total) {
  await_previous_kernel();
  __shared__ double partial[kLossSumThreads];
  double sum = 0;
  for (int t = threadIdx.x; t < T; t += blockDim.x) sum += losses[t];
  partial[threadIdx.x] = sum;
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    __syncthreads();
    if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
  }
  if (threadIdx.x == 0) *total += partial[0];
}

// The step's losses summed on the device as micro-sequences finish: the host reads the total once
// per step (or validation) instead of waiting for every micro-sequence.
inline void accumulate_loss(const float* losses, int T, double* total, cudaStream_t stream) {
  CUDA_CHECK(launch_kernel(accumulate_loss_kernel, 1, kLossSumThreads, 0, stream, losses, T, total));
}
