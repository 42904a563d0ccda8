// cuBLASLt's matmul on the CPU, for the descriptors the trainer builds: column-major
// D = alpha * scale_a * scale_b * op(A) op(B) + beta * C with bf16 or FP8 (e4m3, e5m2) operands,
// fp32 accumulation (FP8: as Hopper's tensor cores accumulate, with or without fast accumulation,
// see fp8_tensor_core_dot), bf16 or fp32 C = D, strided batches. It answers as the library does
// where the library refuses (mismatched shapes, a leading dimension below the rows, FP8 outside the
// "TN" layout or as e5m2 x e5m2, a buffer less aligned than the heuristic was told), and refuses
// every attribute it does not emulate rather than ignore it.
#include "emulator/cuda_emulator.h"

#include <cublasLt.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace {

struct Desc {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  cublasOperation_t trans_a = CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
  const float *a_scale = nullptr, *b_scale = nullptr;
  bool fast_accum = false;
};

struct Layout {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
  int batch = 1;
  int64_t stride = 0;
};

// The buffer alignments (bytes) a preference promises, A B C D; the library's default is 256 each.
// The heuristic may answer with an algorithm that needs all of it, so the emulated heuristic
// passes the promise on in the algorithm and the emulated matmul holds every call to it.
struct Alignments {
  uint32_t bytes[4] = {256, 256, 256, 256};
};
// An answer of the heuristic: the promise it was made under, and its place in the answers.
struct Algorithm {
  Alignments promised;
  int candidate = 0;
};

template <typename Handle, typename State>
State& state(Handle h) {
  static_assert(sizeof(State) <= sizeof(h->data), "emulator state must fit cuBLASLt's opaque descriptor");
  return *reinterpret_cast<State*>(h->data);
}

// A new opaque descriptor holding `initial`, and its release.
template <typename Opaque, typename State>
cublasStatus_t create(Opaque** handle, const State& initial) {
  *handle = new Opaque{};
  state<Opaque*, State>(*handle) = initial;
  return CUBLAS_STATUS_SUCCESS;
}

template <typename Opaque>
cublasStatus_t destroy(Opaque* handle) {
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

template <typename T>
cublasStatus_t read(T& to, const void* buf, size_t bytes) {
  if (bytes != sizeof(T)) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(&to, buf, sizeof(T));
  return CUBLAS_STATUS_SUCCESS;
}

bool is_fp8(cudaDataType_t t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }

float element(const void* base, cudaDataType_t type, size_t i) {
  switch (type) {
    case CUDA_R_32F: return static_cast<const float*>(base)[i];
    case CUDA_R_16BF: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case CUDA_R_8F_E4M3: {
      __nv_fp8_e4m3 v;
      v.__x = static_cast<const __nv_fp8_storage_t*>(base)[i];
      return float(v);
    }
    case CUDA_R_8F_E5M2: {
      __nv_fp8_e5m2 v;
      v.__x = static_cast<const __nv_fp8_storage_t*>(base)[i];
      return float(v);
    }
    default: return NAN;
  }
}

size_t type_bytes(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : t == CUDA_R_16BF ? 2 : 1; }

// op(X) as [outer][k] floats (k contiguous) for batch b: outer = m for A, n for B.
std::vector<float> gather(const void* base, const Layout& l, bool k_is_row, size_t outer, size_t k, int b) {
  std::vector<float> out(outer * k);
  const char* batch = static_cast<const char*>(base) + size_t(b) * l.stride * type_bytes(l.type);
  for (size_t o = 0; o < outer; ++o)
    for (size_t kk = 0; kk < k; ++kk) out[o * k + kk] = element(batch, l.type, k_is_row ? kk + o * l.ld : o + kk * l.ld);
  return out;
}

// fp32 sum of a[i] b[i] in eight interleaved partial sums (the compiler vectorises them; with
// AVX2, where the CPU has it, in one 8-float vector: the same sums bitwise, no FMA); the order
// differs from the tensor cores', whose order is unspecified anyway.
__attribute__((target_clones("avx2", "default"))) float dot(const float* a, const float* b, size_t n) {
  float partial[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int u = 0; u < 8; ++u) partial[u] += a[i + u] * b[i + u];
  float sum = 0;
  for (; i < n; ++i) sum += a[i] * b[i];
  for (float p : partial) sum += p;
  return sum;
}

// Four rows of op(A) (a, a + k, a + 2k, a + 3k) against two columns of op(B) (b, b + k): each of the
// eight sums exactly as dot() forms it (the same eight partial sums, then the tail, then the partials
// in order), bitwise. Its eight independent sums hide the adds' latency that bounds dot() alone, and
// each load serves two or four of them: 1.5-2x dot() at the models' k.
using Floats8 = float __attribute__((vector_size(32)));
__attribute__((target_clones("avx2", "default"))) void dot_4x2(const float* a, const float* b, size_t k,
                                                               float out[4][2]) {
  Floats8 partial[4][2] = {};
  size_t i = 0;
  for (; i + 8 <= k; i += 8) {
    Floats8 column[2], row;
    std::memcpy(&column[0], b + i, sizeof row);
    std::memcpy(&column[1], b + k + i, sizeof row);
    for (int r = 0; r < 4; ++r) {
      std::memcpy(&row, a + r * k + i, sizeof row);
      partial[r][0] += row * column[0];
      partial[r][1] += row * column[1];
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 2; ++c) {
      float sum = 0;
      for (size_t j = i; j < k; ++j) sum += a[r * k + j] * b[c * k + j];
      for (int u = 0; u < 8; ++u) sum += partial[r][c][u];
      out[r][c] = sum;
    }
}

// Hopper's FP8 tensor cores do not accumulate in fp32. What is known of them:
// - DeepSeek-V3 technical report (arXiv 2412.19437), sec. 3.3.2 and 3.5.2, in the wording quoted
//   in github.com/deepseek-ai/DeepSeek-V3/issues/847: "After aligning 32 mantissa products by
//   right-shifting based on the maximum exponent, the Tensor Core only uses the highest 14 bits of
//   each mantissa product for addition, and truncates bits exceeding this range. The accumulation
//   of addition results into registers also employs 14-bit precision." They promote the partial
//   sums to fp32 every 128 elements ("4 WGMMAs"). Their ISCA 2025 paper (arXiv 2505.09343) names
//   the register FP22: 1 sign, 8 exponent and 13 mantissa bits.
// - SageAttention2 (arXiv 2411.10958, quoted in github.com/thu-ml/SageAttention/issues/287): with
//   A = B = 0, mma(f32.e4m3.e4m3.f32) returns the accumulator D with all but 13 mantissa bits
//   zeroed, i.e. truncated to e8m13.
// - CUTLASS (include/cutlass/gemm/collective/fp8_accumulation.hpp, GmmaFP8Accumulation, used by
//   sm90_mma_tma_gmma_ss_warpspecialized_fp8.hpp): without "FastAccum" the wgmma accumulator is
//   added into an fp32 one (FADD) and zeroed every mma_promotion_interval = 4 wgmma k-blocks of
//   32 (128 elements); its FastAccum kernels keep the wgmma accumulator over the whole K.
// - cuBLASLt (CUBLASLT_MATMUL_DESC_FAST_ACCUM): "intermediate results will not periodically be
//   promoted to a higher precision"; the library does not document its interval (CUTLASS's 128
//   is assumed here; NVIDIA/cutlass#1329: "cublas doc is the best one").
// Modelled so: a k-step is 32 products (wgmma's k for 8-bit operands), each exact (FP8 times FP8
// fits fp32), truncated toward zero below the 13th bit under the largest product's leading bit;
// their exact sum is added to the running accumulator and the result truncated toward zero to
// e8m13. The "highest 14 bits" count from the top of a product field two integer bits wide, so
// they keep 13 or 14 bits of the largest product: 13, the fewer, is modelled. Without fast
// accumulation each 128 elements' accumulator is added into fp32 and restarts from zero. Not
// known, to be calibrated on an H100: whether the sign-filled shift truncates negative products
// toward minus infinity rather than zero (toward zero is modelled).
constexpr size_t kFp8MmaK = 32;
constexpr size_t kFp8PromotionInterval = 4 * kFp8MmaK;
constexpr int kFp8ProductBitsBelowLeading = 12;     // 13 bits of the largest product kept
constexpr int kFp8AccumulatorFractionBits = 13;     // e8m13

// x truncated toward zero to a multiple of 2^lsb_exponent.
double truncated(double x, int lsb_exponent) { return std::ldexp(std::trunc(std::ldexp(x, -lsb_exponent)), lsb_exponent); }

// The tensor core's accumulator after one k-step: acc + the n <= 32 products a[i] b[i].
float fp8_mma_step(float acc, const float* a, const float* b, size_t n) {
  float products[kFp8MmaK], largest = 0;
  for (size_t i = 0; i < n; ++i) {
    products[i] = a[i] * b[i];
    largest = std::max(largest, std::fabs(products[i]));
  }
  if (largest == 0) return acc;
  const int lsb = std::ilogb(largest) - kFp8ProductBitsBelowLeading;
  double sum = acc;  // exact while the accumulator is within 2^39 of the largest product
  for (size_t i = 0; i < n; ++i) sum += truncated(products[i], lsb);
  return sum == 0 ? 0.0f : float(truncated(sum, std::ilogb(sum) - kFp8AccumulatorFractionBits));
}

// sum of a[i] b[i] as Hopper's FP8 tensor cores and cuBLASLt's kernels form it (see above).
float fp8_tensor_core_dot(const float* a, const float* b, size_t k, bool fast_accum) {
  float promoted = 0, accumulator = 0;
  for (size_t k0 = 0; k0 < k; k0 += kFp8MmaK) {
    accumulator = fp8_mma_step(accumulator, a + k0, b + k0, std::min(kFp8MmaK, k - k0));
    const bool chunk_done = (k0 + kFp8MmaK) % kFp8PromotionInterval == 0 || k0 + kFp8MmaK >= k;
    if (!fast_accum && chunk_done) {
      promoted += accumulator;
      accumulator = 0;
    }
  }
  return fast_accum ? accumulator : promoted;
}

// Every batch's buffer at least `promised` bytes aligned, and its columns 16 (the tensor cores' loads).
bool aligned(const void* base, const Layout& l, uint32_t promised) {
  const uint64_t bytes = type_bytes(l.type), address = reinterpret_cast<uintptr_t>(base);
  const bool batches_aligned = l.batch == 1 || uint64_t(l.stride) * bytes % promised == 0;
  return address % promised == 0 && batches_aligned && uint64_t(l.ld) * bytes % 16 == 0;
}

cublasStatus_t check(const Desc& d, const Layout& a, const Layout& b, const Layout& c, const Layout& dl) {
  const bool ta = d.trans_a == CUBLAS_OP_T, tb = d.trans_b == CUBLAS_OP_T;
  const uint64_t m = dl.rows, n = dl.cols, k = ta ? a.rows : a.cols;
  if ((ta ? a.cols : a.rows) != m || (tb ? b.rows : b.cols) != n || (tb ? b.cols : b.rows) != k)
    return CUBLAS_STATUS_INVALID_VALUE;
  if (c.rows != m || c.cols != n || c.type != dl.type || c.ld != dl.ld) return CUBLAS_STATUS_INVALID_VALUE;
  for (const Layout* l : {&a, &b, &c, &dl})
    if (l->ld < int64_t(l->rows) || l->batch != dl.batch) return CUBLAS_STATUS_INVALID_VALUE;
  if (d.compute != CUBLAS_COMPUTE_32F || d.scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (dl.type != CUDA_R_16BF && dl.type != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (is_fp8(a.type) || is_fp8(b.type)) {
    if (!is_fp8(a.type) || !is_fp8(b.type) || (a.type == CUDA_R_8F_E5M2 && b.type == CUDA_R_8F_E5M2))
      return CUBLAS_STATUS_NOT_SUPPORTED;
    if (!ta || tb || a.ld % 16 || b.ld % 16) return CUBLAS_STATUS_NOT_SUPPORTED;  // FP8 is "TN" only
  } else if (a.type == CUDA_R_32F || b.type == CUDA_R_32F) {  // SGEMM: fp32 throughout
    if (a.type != b.type || dl.type != CUDA_R_32F || d.a_scale || d.b_scale || d.fast_accum)
      return CUBLAS_STATUS_NOT_SUPPORTED;
  } else if (a.type != CUDA_R_16BF || b.type != CUDA_R_16BF) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  } else if (d.a_scale || d.b_scale || d.fast_accum) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

size_t cublasLtGetVersion() { return CUBLAS_VERSION; }
const char* cublasGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS (emulated failure)";
  }
}

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  *handle = reinterpret_cast<cublasLtHandle_t>(new char);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  delete reinterpret_cast<char*>(handle);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute, cudaDataType_t scale) {
  return create(desc, Desc{compute, scale});
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) { return destroy(desc); }
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t bytes) {
  Desc& d = state<cublasLtMatmulDesc_t, Desc>(desc);
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA: return read(d.trans_a, buf, bytes);
    case CUBLASLT_MATMUL_DESC_TRANSB: return read(d.trans_b, buf, bytes);
    case CUBLASLT_MATMUL_DESC_A_SCALE_POINTER: return read(d.a_scale, buf, bytes);
    case CUBLASLT_MATMUL_DESC_B_SCALE_POINTER: return read(d.b_scale, buf, bytes);
    case CUBLASLT_MATMUL_DESC_FAST_ACCUM: {
      int8_t on = 0;
      cublasStatus_t s = read(on, buf, bytes);
      d.fast_accum = on != 0;
      return s;
    }
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
  return create(layout, Layout{type, rows, cols, ld});
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) { return destroy(layout); }
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr,
                                                const void* buf, size_t bytes) {
  Layout& l = state<cublasLtMatrixLayout_t, Layout>(layout);
  switch (attr) {
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT: return read(l.batch, buf, bytes);
    case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET: return read(l.stride, buf, bytes);
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) { return create(pref, Alignments{}); }
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) { return destroy(pref); }
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t bytes) {
  Alignments& promised = state<cublasLtMatmulPreference_t, Alignments>(pref);
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: return bytes == sizeof(size_t) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES: return read(promised.bytes[0], buf, bytes);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES: return read(promised.bytes[1], buf, bytes);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES: return read(promised.bytes[2], buf, bytes);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: return read(promised.bytes[3], buf, bytes);
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                              cublasLtMatrixLayout_t d, cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int* found) {
  *found = 0;
  if (requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
  cublasStatus_t s = check(state<cublasLtMatmulDesc_t, Desc>(desc), state<cublasLtMatrixLayout_t, Layout>(a),
                           state<cublasLtMatrixLayout_t, Layout>(b), state<cublasLtMatrixLayout_t, Layout>(c),
                           state<cublasLtMatrixLayout_t, Layout>(d));
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  // Several answers, as the library gives: all one emulated algorithm (the products are exact here),
  // so that choosing another candidate (MatmulOptions::candidate) runs and one past them is refused.
  constexpr int kCandidates = 4;
  *found = std::min(requested, kCandidates);
  for (int i = 0; i < *found; ++i) {
    results[i] = cublasLtMatmulHeuristicResult_t{};
    results[i].state = CUBLAS_STATUS_SUCCESS;
    state<cublasLtMatmulAlgo_t*, Algorithm>(&results[i].algo) = {state<cublasLtMatmulPreference_t, Alignments>(pref), i};
  }
  return CUBLAS_STATUS_SUCCESS;
}

namespace {

// D = alpha op(A) op(B) (+ beta C) as the library computes it, for descriptors already checked.
void multiply(const Desc& d, const Layout& a, const Layout& b, const Layout& c, const Layout& dl, const void* A,
              const void* B, const void* C, void* D, float alpha, float beta) {
  const bool ta = d.trans_a == CUBLAS_OP_T, tb = d.trans_b == CUBLAS_OP_T, fp8 = is_fp8(a.type);
  const size_t m = dl.rows, n = dl.cols, k = ta ? a.rows : a.cols;
  const float scale = alpha * (d.a_scale ? *d.a_scale : 1.0f) * (d.b_scale ? *d.b_scale : 1.0f);
  for (int batch = 0; batch < dl.batch; ++batch) {
    // op(A)(i, kk) is A[i + kk lda] (N) or A[kk + i lda] (T); op(B)(kk, j) is B[kk + j ldb] (N) or B[j + kk ldb] (T).
    const std::vector<float> op_a = gather(A, a, ta, m, k, batch), op_b = gather(B, b, !tb, n, k, batch);
    const size_t c_offset = size_t(batch) * c.stride, d_offset = size_t(batch) * dl.stride;
    // op(A)'s rows in blocks of 32 KB, which stay in cache while every column of op(B) passes them.
    const size_t rows_per_block = std::max<size_t>(1, (32 << 10) / (k * sizeof(float) + 1));
    // D(i, j) from the sum of row i and column j.
    auto store = [&](size_t i, size_t j, float sum) {
      float value = scale * sum;
      if (beta != 0) value += beta * element(C, c.type, c_offset + i + j * c.ld);
      const size_t at = d_offset + i + j * dl.ld;
      if (dl.type == CUDA_R_32F)
        static_cast<float*>(D)[at] = value;
      else
        static_cast<__nv_bfloat16*>(D)[at] = __float2bfloat16(value);
    };
    // The sum of row i and column j: the FP8 tensor cores' or dot()'s.
    auto sum_of = [&](size_t i, size_t j) {
      const float *row = &op_a[i * k], *column = &op_b[j * k];
      return fp8 ? fp8_tensor_core_dot(row, column, k, d.fast_accum) : dot(row, column, k);
    };
    for (size_t first_row = 0; first_row < m; first_row += rows_per_block) {
      const size_t end_row = std::min(m, first_row + rows_per_block);
      size_t j = 0;
      if (!fp8)  // tiles of 4 rows and 2 columns first, then the rows and columns left over one at a time
        for (; j + 2 <= n; j += 2) {
          size_t i = first_row;
          for (; i + 4 <= end_row; i += 4) {
            float tile[4][2];
            dot_4x2(&op_a[i * k], &op_b[j * k], k, tile);
            for (int r = 0; r < 4; ++r)
              for (int col = 0; col < 2; ++col) store(i + r, j + col, tile[r][col]);
          }
          for (; i < end_row; ++i)
            for (size_t col = j; col < j + 2; ++col) store(i, col, sum_of(i, col));
        }
      for (; j < n; ++j)
        for (size_t i = first_row; i < end_row; ++i) store(i, j, sum_of(i, j));
    }
  }
}

}  // namespace

cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t desc, const void* alpha, const void* A,
                              cublasLtMatrixLayout_t a_desc, const void* B, cublasLtMatrixLayout_t b_desc,
                              const void* beta, const void* C, cublasLtMatrixLayout_t c_desc, void* D,
                              cublasLtMatrixLayout_t d_desc, const cublasLtMatmulAlgo_t* algo, void*, size_t,
                              cudaStream_t stream) {
  // copies: the product may run after the descriptors change (lazy streams)
  const Desc d = state<cublasLtMatmulDesc_t, Desc>(desc);
  const Layout a = state<cublasLtMatrixLayout_t, Layout>(a_desc), b = state<cublasLtMatrixLayout_t, Layout>(b_desc),
               c = state<cublasLtMatrixLayout_t, Layout>(c_desc), dl = state<cublasLtMatrixLayout_t, Layout>(d_desc);
  if (!algo) return CUBLAS_STATUS_INVALID_VALUE;
  if (cublasStatus_t s = check(d, a, b, c, dl); s != CUBLAS_STATUS_SUCCESS) return s;
  const Algorithm& algorithm = state<const cublasLtMatmulAlgo_t*, const Algorithm>(algo);
  const Alignments& promised = algorithm.promised;
  if (!aligned(A, a, promised.bytes[0]) || !aligned(B, b, promised.bytes[1]) || !aligned(C, c, promised.bytes[2]) ||
      !aligned(D, dl, promised.bytes[3]))
    return CUBLAS_STATUS_INVALID_VALUE;
  // As cuBLASLt 13.1 on an H200: an FP8 scale pointer off a 16-byte boundary is "not supported" at
  // the product, though the heuristic offered an algorithm.
  if (reinterpret_cast<uintptr_t>(d.a_scale) % 16 || reinterpret_cast<uintptr_t>(d.b_scale) % 16)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  // alpha and beta in host memory, read at the call; the scales in device memory, as the product runs
  const float alpha_value = *static_cast<const float*>(alpha), beta_value = *static_cast<const float*>(beta);
  // the column-major call is C^T = op(B)^T op(A)^T: its A is the row-major B
  emu::record_matmul_call({dl.cols, dl.rows, d.trans_a == CUBLAS_OP_T ? a.rows : a.cols, d.trans_b == CUBLAS_OP_T,
                           d.trans_a == CUBLAS_OP_T, algorithm.candidate});
  emu::enqueue(stream, [=] { multiply(d, a, b, c, dl, A, B, C, D, alpha_value, beta_value); });
  return CUBLAS_STATUS_SUCCESS;
}

namespace emu {
namespace {
std::mutex matmul_calls_mutex;
std::vector<MatmulCall>* matmul_calls = nullptr;  // the live MatmulCalls' record, if any
}  // namespace

MatmulCalls::MatmulCalls() {
  std::lock_guard<std::mutex> lock(matmul_calls_mutex);
  if (matmul_calls) throw std::logic_error("MatmulCalls: one at a time");
  matmul_calls = new std::vector<MatmulCall>;
}
MatmulCalls::~MatmulCalls() {
  std::lock_guard<std::mutex> lock(matmul_calls_mutex);
  delete matmul_calls;
  matmul_calls = nullptr;
}
std::vector<MatmulCall> MatmulCalls::calls() const {
  std::lock_guard<std::mutex> lock(matmul_calls_mutex);
  return *matmul_calls;
}
void record_matmul_call(const MatmulCall& call) {
  std::lock_guard<std::mutex> lock(matmul_calls_mutex);
  if (matmul_calls) matmul_calls->push_back(call);
}
}  // namespace emu
