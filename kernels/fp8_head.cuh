// The FP8 lm_head of SPEC 1.5 (training only), as the reference's custom op computes it:
//   forward   logits[rows, V] = (x_s w_s) e4m3(x / x_s) e4m3(w / w_s)^T      bf16, fast accumulation
//   loss      g[rows, V]      = d(summed softcapped cross-entropy)/d logits  bf16 (cross_entropy.cuh)
//   backward  dx[rows, d]     = (grad_s w_s) e5m2(g / grad_s) e4m3(w / w_s)  bf16
//             dW[V, d]       += (grad_s x_s) e5m2(g / grad_s)^T e4m3(x / x_s) fp32
// cuBLASLt's FP8 products want both operands K-contiguous, so every operand has a plain and a
// transposed copy: x_f8 [rows, d] and [d, rows], w_f8 [V, d] and [d, V], g_f8 [rows, V] and
// [V, rows]. x and w are quantised into both copies in one pass; the cross-entropy kernel writes
// g_f8 itself (the bf16 gradient is never stored: 3 bytes per logit less traffic than storing it
// and quantising it), and a byte transpose makes g_f8's copy. The casts are those of the
// reference's compiled custom op (its impl is under torch.compile): x / s becomes x times the
// reciprocal of s, taken in double and rounded to fp32 (inductor's division by a constant), the
// product stays fp32 (inductor does not round a fused intermediate to x's bf16), and Triton's cast
// to FP8 rounds to nearest even and saturates.
#pragma once
#include "kernels/cross_entropy.cuh"
#include "kernels/device_utils.cuh"
#include "kernels/matmul.cuh"

#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

using fp8 = __nv_fp8_storage_t;  // one FP8 byte: e4m3fn or e5m2, as the buffer says

enum class Fp8Kind { e4m3, e5m2 };

// SPEC 1.5's scales, as the fp32 values _scaled_mm receives, and the fp32 reciprocals the
// quantisations multiply by. x is RMS-normalised: |x| <= sqrt(d) maps onto e4m3's 448.
struct Fp8HeadScales {
  float x, w, grad;
  float x_inv, w_inv, grad_inv;  // float(1 / s) of the double s: grad_inv is 448 exactly
  explicit Fp8HeadScales(int model_dim) {
    const double sx = std::sqrt(double(model_dim)) / 448, sw = 24.0 / 448, sg = 1.0 / 448;
    x = float(sx), w = float(sw), grad = float(sg);
    x_inv = float(1 / sx), w_inv = float(1 / sw), grad_inv = float(1 / sg);
  }
};

// Triton's fp32 to FP8 cast on sm_90 (cvt.rn.satfinite): round to nearest even, subnormals kept,
// what lies beyond the largest finite value (448 for e4m3, 57344 for e5m2) saturates to it, NaN
// stays NaN.
template <Fp8Kind kind>
__host__ __device__ inline fp8 to_fp8(float v) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, kind == Fp8Kind::e4m3 ? __NV_E4M3 : __NV_E5M2);
}

// Eight values as eight FP8 bytes in two words, little end first; two values a conversion (one
// cvt.rn.satfinite of an fp32 pair, the same rounding as to_fp8).
template <Fp8Kind kind>
__device__ inline uint2 to_fp8_words(const float v[8], float inv_scale) {
  uint32_t word[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < 8; i += 2) {
    const __nv_fp8x2_storage_t pair =
        __nv_cvt_float2_to_fp8x2(make_float2(v[i] * inv_scale, v[i + 1] * inv_scale), __NV_SATFINITE,
                                 kind == Fp8Kind::e4m3 ? __NV_E4M3 : __NV_E5M2);
    word[i / 4] |= uint32_t(pair) << (8 * (i % 4));
  }
  return make_uint2(word[0], word[1]);
}

// The cross-entropy's gradient store for the FP8 head: each value rounded to bf16 first (the
// reference's autograd hands its custom op a bf16 gradient), then cast to e5m2 times inv_scale.
struct E5m2Gradient {
  fp8* out;  // [T, V]
  float inv_scale;
  __device__ void operator()(size_t element, const float g[8]) const {
    float rounded[8];
#pragma unroll
    for (int i = 0; i < 8; i += 2) {  // one conversion a pair
      const __nv_bfloat162 pair = __float22bfloat162_rn(make_float2(g[i], g[i + 1]));
      rounded[i] = __low2float(pair), rounded[i + 1] = __high2float(pair);
    }
    *reinterpret_cast<uint2*>(out + element) = to_fp8_words<Fp8Kind::e5m2>(rounded, inv_scale);
  }
};

constexpr int kFp8Tile = 64;  // elements per side of a quantisation tile

// The 4 x 4 byte transpose: word i of `rows` holds bytes (i, 0..3); word j of the result bytes (0..3, j).
__device__ inline void transpose_4x4_bytes(const uint32_t (&rows)[4], uint32_t (&columns)[4]) {
  const uint32_t low01 = __byte_perm(rows[0], rows[1], 0x5140), low23 = __byte_perm(rows[2], rows[3], 0x5140);
  const uint32_t high01 = __byte_perm(rows[0], rows[1], 0x7362), high23 = __byte_perm(rows[2], rows[3], 0x7362);
  columns[0] = __byte_perm(low01, low23, 0x5410);
  columns[1] = __byte_perm(low01, low23, 0x7632);
  columns[2] = __byte_perm(high01, high23, 0x5410);
  columns[3] = __byte_perm(high01, high23, 0x7632);
}

// out[r, c] = out_t[c, r] = to_fp8(in[r, c] * inv_scale) for in [rows, cols], rows and cols
// multiples of 8. A 256-thread block does one 64 x 64 tile, each thread 8 consecutive elements;
// the tile goes through shared memory so that the transposed copy is written row by row as well:
// each thread reads 4 words (4 bytes of 4 rows), transposes them in registers and writes 4 bytes
// of 4 columns (4 shared loads for 16 bytes, where a byte a load was LSU-bound).
// In = fp8: `in` is already FP8 (inv_scale unused) and only its transpose is written (out null).
template <Fp8Kind kind, typename In>
__global__ void __launch_bounds__(256)
    fp8_quantize_kernel(const In* in, fp8* out, fp8* out_t, int rows, int cols, float inv_scale) {
  await_previous_kernel();
  __shared__ uint32_t tile[kFp8Tile][kFp8Tile / 4 + 1];  // FP8 bytes [row][col]; +1 word staggers banks
  const int r0 = blockIdx.y * kFp8Tile, c0 = blockIdx.x * kFp8Tile;
  const int part = threadIdx.x % 8, line = threadIdx.x / 8;  // 8 threads per 64-element line, 32 lines
  for (int r = line; r < kFp8Tile; r += 32) {
    const int row = r0 + r, col = c0 + part * 8;
    if (row >= rows || col >= cols) continue;
    uint2 words;
    if constexpr (std::is_same_v<In, fp8>) {
      words = *reinterpret_cast<const uint2*>(in + size_t(row) * cols + col);
    } else {
      float v[8];
      load8(in + size_t(row) * cols + col, v);
      words = to_fp8_words<kind>(v, inv_scale);
      *reinterpret_cast<uint2*>(out + size_t(row) * cols + col) = words;
    }
    tile[r][part * 2] = words.x;
    tile[r][part * 2 + 1] = words.y;
  }
  __syncthreads();
  // 16 chunks of 4 rows by 16 groups of 4 columns; a warp's 16 chunks write 64 contiguous bytes of a column
  const int chunk = threadIdx.x % 16, group = threadIdx.x / 16, row = r0 + 4 * chunk, col = c0 + 4 * group;
  if (row >= rows || col >= cols) return;  // rows, cols multiples of 8: a chunk or group is in or out whole
  uint32_t in_rows[4], out_columns[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) in_rows[i] = tile[4 * chunk + i][group];
  transpose_4x4_bytes(in_rows, out_columns);
#pragma unroll
  for (int j = 0; j < 4; ++j) *reinterpret_cast<uint32_t*>(out_t + size_t(col + j) * rows + row) = out_columns[j];
}

// out [rows, cols] and out_t [cols, rows] = to_fp8(in * inv_scale) of in [rows, cols] (16-byte aligned).
template <Fp8Kind kind, typename In>
void fp8_quantize(const In* in, fp8* out, fp8* out_t, int rows, int cols, float inv_scale, cudaStream_t stream) {
  dim3 grid((cols + kFp8Tile - 1) / kFp8Tile, (rows + kFp8Tile - 1) / kFp8Tile);
  CUDA_CHECK(launch_kernel(fp8_quantize_kernel<kind, In>, grid, 256, 0, stream, in, out, out_t, rows, cols, inv_scale));
}

// out_t [cols, rows] = the transpose of the FP8 bytes in [rows, cols] (16-byte aligned).
inline void fp8_transpose(const fp8* in, fp8* out_t, int rows, int cols, cudaStream_t stream) {
  fp8_quantize<Fp8Kind::e5m2, fp8>(in, nullptr, out_t, rows, cols, 1.0f, stream);
}

// The FP8 operands the head keeps (device bytes), for the tests.
struct Fp8HeadOperands {
  const fp8 *x, *x_t;  // e4m3 [rows, d], [d, rows] of the last forward
  const fp8 *w, *w_t;  // e4m3 [V, d], [d, V] of the last quantize_weight
  const fp8 *g, *g_t;  // e5m2 [rows, V], [V, rows] of the last loss_and_gradient
};

class Fp8Head {
 public:
  // Every dimension a multiple of 16: cuBLASLt's FP8 products need 16-byte leading dimensions.
  Fp8Head(int max_rows, int vocab, int model_dim)
      : max_rows_(max_rows), V_(vocab), d_(model_dim), scales_(model_dim) {
    require_multiple_of_16("max_rows", max_rows);
    require_multiple_of_16("vocab", vocab);
    require_multiple_of_16("model_dim", model_dim);
    allocate();
    const float host_scales[3] = {scales_.x, scales_.w, scales_.grad};
    for (int i : {kX, kW, kGrad})
      CUDA_CHECK(cudaMemcpy(device_scale(i), &host_scales[i], sizeof(float), cudaMemcpyHostToDevice));
  }
  ~Fp8Head() { cudaFree(storage_); }
  Fp8Head(const Fp8Head&) = delete;
  Fp8Head& operator=(const Fp8Head&) = delete;

  const Fp8HeadScales& scales() const { return scales_; }
  Fp8HeadOperands operands() const { return {x_f8_, x_f8_t_, w_f8_, w_f8_t_, g_f8_, g_f8_t_}; }

  // Whenever the weights may have changed (the model does it before every training
  // micro-sequence's head): w_f8 [V, d] and its transpose from the fp32 master w [V, d].
  void quantize_weight(const float* w, cudaStream_t stream) {
    require_aligned("w", w);
    fp8_quantize<Fp8Kind::e4m3>(w, w_f8_, w_f8_t_, V_, d_, scales_.w_inv, stream);
    weight_ready_ = true;
  }

  // logits [rows, V] bf16 from x [rows, d] bf16; keeps x_f8 for the backward of the same rows.
  void forward(const bf16* x, bf16* logits, int rows, Matmul& matmul, cudaStream_t stream) {
    quantize_input(x, rows, stream);
    logits_product(logits, matmul, stream);
  }

  // From logits [rows, V] (rows as the last forward; the model passes the forward's own): the
  // token losses [rows] and g_f8 and its transpose, the e5m2 copies of the summed loss's gradient
  // times grad_scale (1 in training; the head has no losses-only use: evaluation is bf16). The
  // fused path leaves the logits as they are; the cast path overwrites them with the bf16 gradient.
  void loss_and_gradient(bf16* logits, const uint16_t* targets, float* losses, const Softcap& sc, cudaStream_t stream,
                         float grad_scale = 1.0f) {
    if (rows_ == 0) throw std::logic_error("Fp8Head: loss before any forward");
    if (!(grad_scale != 0.0f)) throw std::invalid_argument("Fp8Head: a loss gradient scaled by 0 is no gradient");
    require_aligned("logits", logits);
    if (fused_gradient_) {
      softcap_cross_entropy(logits, targets, losses, rows_, V_, grad_scale, E5m2Gradient{g_f8_, scales_.grad_inv},
                            stream, sc);
      fp8_transpose(g_f8_, g_f8_t_, rows_, V_, stream);
    } else {
      softcap_cross_entropy(logits, targets, losses, rows_, V_, grad_scale, stream, sc);
      fp8_quantize<Fp8Kind::e5m2>(logits, g_f8_, g_f8_t_, rows_, V_, scales_.grad_inv, stream);
    }
    gradient_ready_ = true;
  }

  // true (the default): the cross-entropy writes the e5m2 gradient itself; false: it writes the
  // bf16 gradient over the logits and a cast makes both e5m2 copies (the same bytes, one pass
  // more: the self-check's reference, and the run's path with --fp8-gradient cast).
  void set_fused_gradient(bool fused) { fused_gradient_ = fused; }

  // Which of cuBLASLt's heuristic answers the logits product takes (MatmulOptions::candidate; 0 its
  // first): `bench_kernels fp8` times each at the model's shape, --fp8-logits-algorithm picks one.
  void set_logits_candidate(int candidate) { logits_candidate_ = candidate; }

  // From the gradient of the last loss_and_gradient: dx [rows, d] bf16 (overwritten) and
  // dw [V, d] fp32 += the weight gradient (accumulates over chunks and micro-sequences).
  void backward(bf16* dx, float* dw, Matmul& matmul, cudaStream_t stream) {
    if (!gradient_ready_) throw std::logic_error("Fp8Head: backward without the loss of the last forward");
    grad_input_product(dx, matmul, stream);
    grad_weight_product(dw, matmul, stream);
  }

  // The steps of forward and backward, public so that the benchmark can time each product alone.
  void quantize_input(const bf16* x, int rows, cudaStream_t stream) {
    if (!weight_ready_) throw std::logic_error("Fp8Head: forward before quantize_weight");
    if (rows <= 0 || rows > max_rows_ || rows % 16)
      throw std::invalid_argument("Fp8Head: " + std::to_string(rows) + " rows; want a positive multiple of 16 up to " +
                                  std::to_string(max_rows_));
    require_aligned("x", x);
    fp8_quantize<Fp8Kind::e4m3>(x, x_f8_, x_f8_t_, rows, d_, scales_.x_inv, stream);
    rows_ = rows;
    gradient_ready_ = false;
  }
  void logits_product(bf16* logits, Matmul& matmul, cudaStream_t stream) {  // logits [rows, V]
    matmul(x_f8_, Transpose::N, w_f8_, Transpose::T, logits, rows_, V_, d_, CUDA_R_16BF, logits_options(), stream);
  }
  // The logits product's plan for `rows` rows into `logits`, made (in `matmul`) but not run: a
  // candidate cuBLASLt does not offer at that shape is refused before any product depends on it.
  void plan_logits_product(const bf16* logits, int rows, Matmul& matmul) const {
    matmul.plan_only(x_f8_, Transpose::N, w_f8_, Transpose::T, logits, rows, V_, d_, CUDA_R_16BF, logits_options());
  }
  void grad_input_product(bf16* dx, Matmul& matmul, cudaStream_t stream) {  // dx [rows, d] = g [rows, V] w [V, d]
    MatmulOptions o{CUDA_R_8F_E5M2, CUDA_R_8F_E4M3, device_scale(kGrad), device_scale(kW), false};
    matmul(g_f8_, Transpose::N, w_f8_t_, Transpose::T, dx, rows_, d_, V_, CUDA_R_16BF, o, stream);
  }
  void grad_weight_product(float* dw, Matmul& matmul, cudaStream_t stream) {  // dw [V, d] += g^T [V, rows] x [rows, d]
    MatmulOptions o{CUDA_R_8F_E5M2, CUDA_R_8F_E4M3, device_scale(kGrad), device_scale(kX), false};
    matmul(g_f8_t_, Transpose::N, x_f8_t_, Transpose::T, dw, V_, d_, rows_, CUDA_R_32F, o, stream, 1.0f, 1.0f);
  }

 private:
  MatmulOptions logits_options() const {
    MatmulOptions o{CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, device_scale(kX), device_scale(kW), /*fast_accum=*/true};
    o.candidate = logits_candidate_;
    return o;
  }
  enum { kX, kW, kGrad };  // the scales' slots
  // Each scale in a 256-byte slot of its own: cuBLASLt on an H200 refused (not supported) every FP8
  // product whose scale pointers were 4 or 8 bytes apart (docs/PERF.md, 2026-11-26).
  static constexpr size_t kScaleSlot = 256;
  const float* device_scale(int i) const { return reinterpret_cast<const float*>(storage_ + i * kScaleSlot); }
  float* device_scale(int i) { return reinterpret_cast<float*>(storage_ + i * kScaleSlot); }

  static void require_multiple_of_16(const char* what, int n) {
    if (n <= 0 || n % 16)
      throw std::invalid_argument(std::string("Fp8Head: ") + what + " = " + std::to_string(n) +
                                  " must be a positive multiple of 16 (cuBLASLt FP8 leading dimensions)");
  }
  static void require_aligned(const char* what, const void* p) {
    if (reinterpret_cast<uintptr_t>(p) % 16)
      throw std::invalid_argument(std::string("Fp8Head: ") + what + " is not 16-byte aligned");
  }

  // One allocation, carved at 256-byte boundaries: the scales' slots, then the six FP8 buffers.
  void allocate() {
    const size_t xd = size_t(max_rows_) * d_, vd = size_t(V_) * d_, xv = size_t(max_rows_) * V_;
    const size_t sizes[7] = {3 * kScaleSlot, xd, xd, vd, vd, xv, xv};
    size_t offsets[7], total = 0;
    for (int i = 0; i < 7; ++i) {
      offsets[i] = total;
      total += (sizes[i] + 255) / 256 * 256;
    }
    CUDA_CHECK(cudaMalloc(&storage_, total));
    fp8** buffers[6] = {&x_f8_, &x_f8_t_, &w_f8_, &w_f8_t_, &g_f8_, &g_f8_t_};
    for (int i = 0; i < 6; ++i) *buffers[i] = storage_ + offsets[i + 1];
  }

  int max_rows_, V_, d_, rows_ = 0;
  bool weight_ready_ = false, gradient_ready_ = false, fused_gradient_ = true;
  int logits_candidate_ = 0;
  Fp8HeadScales scales_;
  uint8_t* storage_ = nullptr;
  fp8 *x_f8_ = nullptr, *x_f8_t_ = nullptr, *w_f8_ = nullptr, *w_f8_t_ = nullptr, *g_f8_ = nullptr, *g_f8_t_ = nullptr;
};
