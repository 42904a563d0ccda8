// Matmuls through cuBLASLt: bf16 operands (or FP8, or fp32 for REKLS's state, see MatmulOptions),
// fp32 accumulation, bf16 or fp32 output (fp32 for fp32 operands), row-major interface. One plan
// (descriptors + heuristic algorithm) is cached per shape, options and buffer alignment; the
// workspace is shared. The three products of a linear
// layer y = x W^T (x [tokens, in], W [out, in]):
//   forward      y[t, out]  = x W^T        matmul(x, N, W, T, y, tokens, out, in)
//   input grad  dx[t, in]   = dy W         matmul(dy, N, W, N, dx, tokens, in, out)
//   weight grad dW[out, in] = dy^T x       matmul(dy, T, x, N, dW, out, in, tokens), beta 1 accumulates
#pragma once
#include "kernels/host/cuda_check.cuh"

#include <array>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <tuple>
#include <utility>

enum class Transpose { N, T };

// What a product may change from the bf16 default: fp32 operands (both, with an fp32 output: full
// fp32 products, no TF32), or FP8 operand types (e4m3 or e5m2, not both
// e5m2), each with its dequantisation scale (a device float, read when the product runs; null
// means 1), and Hopper's fast FP8 accumulation (no periodic promotion to fp32: faster, less exact).
// cuBLASLt's FP8 kernels want both operands K-contiguous: A stored [M, K] (N), B stored [N, K] (T),
// and M, N, K multiples of 16.
// `addend`: the matrix beta scales when it is not the output, D = alpha op(A) op(B) + beta addend
// (laid out as the output), so a residual add needs no copy of the residual first.
// `candidate`: which of cuBLASLt's heuristic answers for the product runs (0: its first, as before);
// `bench_kernels fp8` times each, since the heuristic's first is not always the fastest (the FP8
// head's logits: 3.74 ms against 3.40 for torch's on an H100). Fixed per run by a flag, not timed at
// start, so that a run and its resume with the same flags take the same algorithm (and the same
// bits), as they take the same kernels.
// A strided batch: `count` products, the i-th at A + i stride_a, B + i stride_b, C + i stride_c
// (elements).
struct MatmulBatch {
  int count = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
};

struct MatmulOptions {
  cudaDataType_t a_type = CUDA_R_16BF, b_type = CUDA_R_16BF;
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
  bool fast_accum = false;
  MatmulBatch batch;
  const void* addend = nullptr;  // null: beta scales the output itself
  int candidate = 0;
};

inline bool is_fp8(cudaDataType_t t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }

class Matmul {
 public:
  explicit Matmul(size_t workspace_bytes = size_t(32) << 20) : workspace_bytes_(workspace_bytes) {
    CUBLAS_CHECK(cublasLtCreate(&handle_));
    CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
  }
  ~Matmul() {
    for (auto& [key, plan] : plans_) destroy(plan);
    cudaFree(workspace_);
    cublasLtDestroy(handle_);
  }
  Matmul(const Matmul&) = delete;
  Matmul& operator=(const Matmul&) = delete;

  static constexpr int kMaxCandidates = 16;  // the heuristic answers a product may choose from (MatmulOptions)

  // Row-major C[M, N] = alpha * op(A)[M, K] op(B)[K, N] + beta * C. A is stored [M, K] (N) or
  // [K, M] (T); B is stored [K, N] (N) or [N, K] (T). A and B are bf16; C is bf16 or fp32.
  void operator()(const void* A, Transpose ta, const void* B, Transpose tb, void* C, int M, int N, int K,
                  cudaDataType_t c_type, cudaStream_t stream, float alpha = 1.0f, float beta = 0.0f) {
    (*this)(A, ta, B, tb, C, M, N, K, c_type, MatmulOptions{}, stream, alpha, beta);
  }

  // The same with operand types, scales, accumulation and addend from `o`:
  // C = alpha * (a_scale * op(A)) (b_scale * op(B)) + beta * (o.addend or C).
  void operator()(const void* A, Transpose ta, const void* B, Transpose tb, void* C, int M, int N, int K,
                  cudaDataType_t c_type, const MatmulOptions& o, cudaStream_t stream, float alpha = 1.0f,
                  float beta = 0.0f) {
    const Plan& plan = prepare(A, ta, B, tb, C, M, N, K, c_type, o);
    const void* addend = o.addend ? o.addend : C;
    if (is_fp8(o.a_type)) set_scales(plan, o);  // the plan may have been made with other scale buffers
    // cuBLASLt is column-major: compute C^T[N, M] = op(B)^T op(A)^T, i.e. B first.
    CUBLAS_CHECK(cublasLtMatmul(handle_, plan.desc, &alpha, B, plan.b, A, plan.a, &beta, addend, plan.c, C, plan.c,
                                &plan.algo, workspace_, workspace_bytes_, stream));
  }

  // The plan of that product, made now (and kept) but not run: what the product would refuse (a
  // layout, a candidate cuBLASLt does not offer) is refused here, before a run depends on it.
  void plan_only(const void* A, Transpose ta, const void* B, Transpose tb, const void* C, int M, int N, int K,
                 cudaDataType_t c_type, const MatmulOptions& o) {
    prepare(A, ta, B, tb, C, M, N, K, c_type, o);
  }

 private:
  struct Plan;
  const Plan& prepare(const void* A, Transpose ta, const void* B, Transpose tb, const void* C, int M, int N, int K,
                      cudaDataType_t c_type, const MatmulOptions& o) {
    if (!is_fp8(o.a_type) && (o.a_scale || o.b_scale)) throw std::invalid_argument("scales are for FP8 operands");
    check_scale_alignment(o);
    const void* addend = o.addend ? o.addend : C;
    const MatmulBatch& b = o.batch;
    const Alignments alignments{alignment(A, b, b.stride_a, o.a_type), alignment(B, b, b.stride_b, o.b_type),
                                alignment(addend, b, b.stride_c, c_type), alignment(C, b, b.stride_c, c_type)};
    if (o.candidate < 0 || o.candidate >= kMaxCandidates)
      throw std::invalid_argument("matmul: candidate " + std::to_string(o.candidate) + " is not in [0, " +
                                  std::to_string(kMaxCandidates) + ")");
    return plan_for({M, N, K, ta == Transpose::T, tb == Transpose::T, c_type, o.a_type, o.b_type, o.fast_accum,
                     b.count, b.stride_a, b.stride_b, b.stride_c, alignments, o.candidate},
                    o);
  }

  // Bytes to which every batch of A, B, the addend and C is aligned, at most 256: cuBLASLt's heuristic
  // assumes 256 unless told less, and may pick an algorithm that fails on a less aligned slice.
  using Alignments = std::array<uint32_t, 4>;
  // M, N, K, transA, transB, C type, A type, B type, fast accumulation, batch count and strides,
  // alignments, candidate
  using Key = std::tuple<int, int, int, bool, bool, cudaDataType_t, cudaDataType_t, cudaDataType_t, bool, int, int64_t,
                         int64_t, int64_t, Alignments, int>;
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };

  const Plan& plan_for(const Key& key, const MatmulOptions& o) {
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
    auto [M, N, K, trans_a, trans_b, c_type, a_type, b_type, fast_accum, batch, stride_a, stride_b, stride_c,
          alignments, candidate] = key;
    check_types(M, N, K, trans_a, trans_b, c_type, a_type, b_type, fast_accum);
    Plan p;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    if (fast_accum) {
      int8_t on = 1;
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &on, sizeof(on)));
    }
    if (is_fp8(a_type)) set_scales(p, o);  // before the heuristic, which sees the whole description
    cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    // The column-major call's first operand is B, its second A.
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_b, sizeof(op_b)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_a, sizeof(op_a)));
    // Column-major views of the row-major buffers: stored [r, c] row-major is [c, r] column-major.
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, b_type, trans_b ? K : N, trans_b ? N : K, trans_b ? K : N));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, a_type, trans_a ? M : K, trans_a ? K : M, trans_a ? M : K));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, c_type, N, M, N));
    if (batch > 1) {
      set_batch(p.a, batch, stride_a);
      set_batch(p.b, batch, stride_b);
      set_batch(p.c, batch, stride_c);
    }
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &workspace_bytes_, sizeof(workspace_bytes_)));
    // The column-major call's A is our B and its B our A; its C is the addend, its D our C.
    const auto [a_bytes, b_bytes, addend_bytes, c_bytes] = alignments;
    for (auto [attribute, bytes] : {std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, b_bytes},
                                    std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, a_bytes},
                                    std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, addend_bytes},
                                    std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, c_bytes}})
      CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attribute, &bytes, sizeof(bytes)));
    std::array<cublasLtMatmulHeuristicResult_t, kMaxCandidates> results{};
    int found = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.b, p.a, p.c, p.c, pref, candidate + 1,
                                                results.data(), &found));
    cublasLtMatmulPreferenceDestroy(pref);
    const std::string product = std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K) + " matmul";
    if (found <= candidate) {
      destroy(p);
      if (found == 0) throw std::runtime_error("cuBLASLt has no algorithm for a " + product);
      throw std::invalid_argument("cuBLASLt offers " + std::to_string(found) + " algorithm" + (found > 1 ? "s" : "") +
                                  " for a " + product + ": candidate " + std::to_string(candidate) +
                                  " is not one (they count from 0)");
    }
    p.algo = results[candidate].algo;
    return plans_.emplace(key, p).first->second;
  }

  // Refuses, naming the reason, what cuBLASLt would answer only with "not supported".
  static void check_types(int M, int N, int K, bool trans_a, bool trans_b, cudaDataType_t c_type,
                          cudaDataType_t a_type, cudaDataType_t b_type, bool fast_accum) {
    const bool fp8 = is_fp8(a_type), fp32 = a_type == CUDA_R_32F && b_type == CUDA_R_32F;
    if (fp32) {
      if (c_type != CUDA_R_32F) throw std::invalid_argument("fp32 matmul operands need an fp32 output");
      if (fast_accum) throw std::invalid_argument("fast accumulation is an FP8 option");
      return;
    }
    if (fp8 != is_fp8(b_type) || (!fp8 && (a_type != CUDA_R_16BF || b_type != CUDA_R_16BF)))
      throw std::invalid_argument("matmul operands must be both bf16, both fp32 or both FP8");
    if (!fp8) {
      if (fast_accum) throw std::invalid_argument("fast accumulation is an FP8 option");
      return;
    }
    if (a_type == CUDA_R_8F_E5M2 && b_type == CUDA_R_8F_E5M2)
      throw std::invalid_argument("cuBLASLt has no e5m2 x e5m2 matmul");
    if (trans_a || !trans_b)
      throw std::invalid_argument("FP8 matmuls need A stored [M, K] (N) and B stored [N, K] (T)");
    if (M % 16 || N % 16 || K % 16)
      throw std::invalid_argument("FP8 matmul " + std::to_string(M) + "x" + std::to_string(N) + "x" +
                                  std::to_string(K) + ": every dimension must be a multiple of 16");
  }

  // cuBLASLt 13.1 on an H200 answered "not supported" to every FP8 product whose scale pointers were
  // 4 or 8 bytes past a 16-byte boundary, after its heuristic had offered an algorithm for them
  // (docs/PERF.md, 2026-11-26): refused here, naming the cause.
  static void check_scale_alignment(const MatmulOptions& o) {
    for (auto [name, p] : {std::pair{"a_scale", o.a_scale}, std::pair{"b_scale", o.b_scale}})
      if (reinterpret_cast<uintptr_t>(p) % kScaleAlignment)
        throw std::invalid_argument(std::string("FP8 matmul: ") + name + " is not " +
                                    std::to_string(kScaleAlignment) + "-byte aligned (cuBLASLt refuses it)");
  }
  static constexpr uintptr_t kScaleAlignment = 16;

  // The largest power of two, up to 256, dividing the buffer's address and (batched) its stride in bytes.
  static uint32_t alignment(const void* p, const MatmulBatch& batch, int64_t stride, cudaDataType_t type) {
    const size_t element_bytes = type == CUDA_R_32F ? 4 : type == CUDA_R_16BF ? 2 : 1;
    uint64_t bits = reinterpret_cast<uintptr_t>(p) | 256;
    if (batch.count > 1) bits |= uint64_t(stride) * element_bytes;
    return uint32_t(bits & ~(bits - 1));  // the lowest set bit
  }

  static void set_batch(cublasLtMatrixLayout_t layout, int count, int64_t stride) {
    CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                  sizeof(stride)));
  }

  // The column-major call's A is our B and its B our A, so the scales swap too.
  static void set_scales(const Plan& p, const MatmulOptions& o) {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &o.b_scale,
                                                sizeof(o.b_scale)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &o.a_scale,
                                                sizeof(o.a_scale)));
  }

  static void destroy(Plan& p) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.desc);
  }

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_;
  std::map<Key, Plan> plans_;
};
