// Matmuls through cuBLASLt: bf16 operands, fp32 accumulation, bf16 or fp32 output, row-major
// interface. One plan (descriptors + heuristic algorithm) is cached per shape; the workspace is
// shared. The three products of a linear layer y = x W^T (x [tokens, in], W [out, in]):
//   forward      y[t, out]  = x W^T        matmul(x, N, W, T, y, tokens, out, in)
//   input grad  dx[t, in]   = dy W         matmul(dy, N, W, N, dx, tokens, in, out)
//   weight grad dW[out, in] = dy^T x       matmul(dy, T, x, N, dW, out, in, tokens), beta 1 accumulates
#pragma once
#include "kernels/cuda_check.cuh"

#include <map>
#include <stdexcept>
#include <tuple>

enum class Transpose { N, T };

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

  // Row-major C[M, N] = alpha * op(A)[M, K] op(B)[K, N] + beta * C. A is stored [M, K] (N) or
  // [K, M] (T); B is stored [K, N] (N) or [N, K] (T). A and B are bf16; C is bf16 or fp32.
  void operator()(const void* A, Transpose ta, const void* B, Transpose tb, void* C, int M, int N, int K,
                  cudaDataType_t c_type, cudaStream_t stream, float alpha = 1.0f, float beta = 0.0f) {
    const Plan& plan = plan_for({M, N, K, ta == Transpose::T, tb == Transpose::T, c_type});
    // cuBLASLt is column-major: compute C^T[N, M] = op(B)^T op(A)^T, i.e. B first.
    CUBLAS_CHECK(cublasLtMatmul(handle_, plan.desc, &alpha, B, plan.b, A, plan.a, &beta, C, plan.c, C, plan.c,
                                &plan.algo, workspace_, workspace_bytes_, stream));
  }

 private:
  using Key = std::tuple<int, int, int, bool, bool, cudaDataType_t>;  // M, N, K, transA, transB, C type
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };

  const Plan& plan_for(const Key& key) {
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
    auto [M, N, K, trans_a, trans_b, c_type] = key;
    Plan p;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    // The column-major call's first operand is B, its second A.
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_b, sizeof(op_b)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_a, sizeof(op_a)));
    // Column-major views of the row-major buffers: stored [r, c] row-major is [c, r] column-major.
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, trans_b ? K : N, trans_b ? N : K, trans_b ? K : N));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, trans_a ? M : K, trans_a ? K : M, trans_a ? M : K));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, c_type, N, M, N));
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &workspace_bytes_, sizeof(workspace_bytes_)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.b, p.a, p.c, p.c, pref, 1, &result, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    if (found == 0)
      throw std::runtime_error("cuBLASLt has no algorithm for a " + std::to_string(M) + "x" + std::to_string(N) +
                               "x" + std::to_string(K) + " matmul");
    p.algo = result.algo;
    return plans_.emplace(key, p).first->second;
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
