// cuBLASLt's matmul on the CPU, for the descriptors the trainer builds: column-major
// D = alpha * scale_a * scale_b * op(A) op(B) + beta * C with bf16 or FP8 (e4m3, e5m2) operands,
// fp32 accumulation, bf16 or fp32 C = D, strided batches. It answers as the library does where the
// library refuses (mismatched shapes, a leading dimension below the rows, FP8 outside the "TN"
// layout or as e5m2 x e5m2, a buffer less aligned than the heuristic was told), and refuses every
// attribute it does not emulate rather than ignore it.
#include "emulator/cuda_emulator.h"

#include <cublasLt.h>

#include <cstring>
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

// fp32 sum of a[i] b[i] in eight interleaved partial sums (the compiler vectorises them); the
// order differs from the tensor cores', whose order is unspecified anyway.
float dot(const float* a, const float* b, size_t n) {
  float partial[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int u = 0; u < 8; ++u) partial[u] += a[i + u] * b[i + u];
  float sum = 0;
  for (; i < n; ++i) sum += a[i] * b[i];
  for (float p : partial) sum += p;
  return sum;
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
  results[0] = cublasLtMatmulHeuristicResult_t{};
  results[0].state = CUBLAS_STATUS_SUCCESS;
  state<cublasLtMatmulAlgo_t*, Alignments>(&results[0].algo) = state<cublasLtMatmulPreference_t, Alignments>(pref);
  *found = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t desc, const void* alpha, const void* A,
                              cublasLtMatrixLayout_t a_desc, const void* B, cublasLtMatrixLayout_t b_desc,
                              const void* beta, const void* C, cublasLtMatrixLayout_t c_desc, void* D,
                              cublasLtMatrixLayout_t d_desc, const cublasLtMatmulAlgo_t* algo, void*, size_t,
                              cudaStream_t) {
  const Desc& d = state<cublasLtMatmulDesc_t, Desc>(desc);
  const Layout &a = state<cublasLtMatrixLayout_t, Layout>(a_desc), &b = state<cublasLtMatrixLayout_t, Layout>(b_desc),
               &c = state<cublasLtMatrixLayout_t, Layout>(c_desc), &dl = state<cublasLtMatrixLayout_t, Layout>(d_desc);
  if (!algo) return CUBLAS_STATUS_INVALID_VALUE;
  if (cublasStatus_t s = check(d, a, b, c, dl); s != CUBLAS_STATUS_SUCCESS) return s;
  const Alignments& promised = state<const cublasLtMatmulAlgo_t*, const Alignments>(algo);
  if (!aligned(A, a, promised.bytes[0]) || !aligned(B, b, promised.bytes[1]) || !aligned(C, c, promised.bytes[2]) ||
      !aligned(D, dl, promised.bytes[3]))
    return CUBLAS_STATUS_INVALID_VALUE;
  const bool ta = d.trans_a == CUBLAS_OP_T, tb = d.trans_b == CUBLAS_OP_T;
  const size_t m = dl.rows, n = dl.cols, k = ta ? a.rows : a.cols;
  const float scale = *static_cast<const float*>(alpha) * (d.a_scale ? *d.a_scale : 1.0f) *
                      (d.b_scale ? *d.b_scale : 1.0f),
              beta_value = *static_cast<const float*>(beta);
  for (int batch = 0; batch < dl.batch; ++batch) {
    // op(A)(i, kk) is A[i + kk lda] (N) or A[kk + i lda] (T); op(B)(kk, j) is B[kk + j ldb] (N) or B[j + kk ldb] (T).
    const std::vector<float> op_a = gather(A, a, ta, m, k, batch), op_b = gather(B, b, !tb, n, k, batch);
    const size_t c_offset = size_t(batch) * c.stride, d_offset = size_t(batch) * dl.stride;
    for (size_t j = 0; j < n; ++j)
      for (size_t i = 0; i < m; ++i) {
        float value = scale * dot(&op_a[i * k], &op_b[j * k], k);
        if (beta_value != 0) value += beta_value * element(C, c.type, c_offset + i + j * c.ld);
        const size_t at = d_offset + i + j * dl.ld;
        if (dl.type == CUDA_R_32F)
          static_cast<float*>(D)[at] = value;
        else
          static_cast<__nv_bfloat16*>(D)[at] = __float2bfloat16(value);
      }
  }
  return CUBLAS_STATUS_SUCCESS;
}
