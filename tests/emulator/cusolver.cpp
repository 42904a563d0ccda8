// cuSOLVER's dense symmetric eigensolver (cusolverDnXsyevd, the 64-bit API) on the CPU, with the
// library's conventions: column-major A of which only the `uplo` triangle is read, eigenvalues
// ascending in W, the eigenvectors overwriting A column by column, the workspace sizes asked for
// first and held to, *info 0, or positive when the iteration does not converge (a non-finite A).
// The decomposition is the CPU reference's (tests/reference/eigen.h: Householder, then implicit QL)
// in the data type's own arithmetic, so that an fp32 solve rounds as the library's does. Other data
// types or modes are refused as the library refuses them (CUSOLVER_STATUS_INVALID_VALUE /
// NOT_SUPPORTED).
#include "emulator/cuda_emulator.h"
#include "reference/eigen.h"

#include <cusolverDn.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

struct cusolverDnContext {
  cudaStream_t stream = nullptr;
};
struct cusolverDnParams {};

namespace {

size_t type_bytes(cudaDataType t) { return t == CUDA_R_64F ? 8 : 4; }

// What the emulated syevd asks for: room for a copy of A on the device side, a row on the host.
void workspace_bytes(int64_t n, cudaDataType type, size_t* device, size_t* host) {
  *device = size_t(n) * size_t(n) * type_bytes(type) + 256;
  *host = size_t(n) * 8 + 64;
}

cusolverStatus_t check(cusolverDnHandle_t handle, cusolverEigMode_t jobz, cublasFillMode_t uplo, int64_t n,
                       cudaDataType a_type, int64_t lda, cudaDataType w_type, cudaDataType compute) {
  if (!handle) return CUSOLVER_STATUS_NOT_INITIALIZED;
  if (n < 0 || lda < std::max<int64_t>(1, n)) return CUSOLVER_STATUS_INVALID_VALUE;
  if (jobz != CUSOLVER_EIG_MODE_VECTOR && jobz != CUSOLVER_EIG_MODE_NOVECTOR) return CUSOLVER_STATUS_INVALID_VALUE;
  if (uplo != CUBLAS_FILL_MODE_LOWER && uplo != CUBLAS_FILL_MODE_UPPER) return CUSOLVER_STATUS_INVALID_VALUE;
  if (a_type != CUDA_R_32F && a_type != CUDA_R_64F) return CUSOLVER_STATUS_NOT_SUPPORTED;
  if (w_type != a_type || compute != a_type) return CUSOLVER_STATUS_NOT_SUPPORTED;
  return CUSOLVER_STATUS_SUCCESS;
}

// The decomposition of the `uplo` triangle of column-major A [k, k] in the arithmetic of Real: the
// eigenvalues into W, ascending, and the eigenvectors over A when asked for.
template <typename Real>
void decompose(cusolverEigMode_t jobz, cublasFillMode_t uplo, int k, Real* A, int64_t lda, Real* W) {
  std::vector<Real> a(size_t(k) * k);  // row-major, symmetric, from the `uplo` triangle only
  for (int col = 0; col < k; ++col)
    for (int row = 0; row < k; ++row) {
      const bool stored = uplo == CUBLAS_FILL_MODE_LOWER ? row >= col : row <= col;
      a[size_t(row) * k + col] = stored ? A[size_t(row) + size_t(col) * lda] : A[size_t(col) + size_t(row) * lda];
    }
  std::vector<Real> values, vectors;
  symmetric_eigen(a, k, values, vectors);
  for (int j = 0; j < k; ++j) {
    W[j] = values[j];
    if (jobz == CUSOLVER_EIG_MODE_VECTOR)
      for (int i = 0; i < k; ++i) A[size_t(i) + size_t(j) * lda] = vectors[size_t(i) * k + j];
  }
}

// The same in the data type's arithmetic; the info syevd reports: 0, or 1 when the QL iteration
// did not converge (a non-finite A; LAPACK's convention: positive, the call itself succeeds).
int decompose(cusolverEigMode_t jobz, cublasFillMode_t uplo, int64_t n, cudaDataType type, void* A, int64_t lda,
              void* W) {
  try {
    if (type == CUDA_R_64F)
      decompose(jobz, uplo, int(n), static_cast<double*>(A), lda, static_cast<double*>(W));
    else
      decompose(jobz, uplo, int(n), static_cast<float*>(A), lda, static_cast<float*>(W));
  } catch (const std::runtime_error&) {
    return 1;
  }
  return 0;
}

}  // namespace

cusolverStatus_t cusolverDnCreate(cusolverDnHandle_t* handle) {
  *handle = new cusolverDnContext{};
  return CUSOLVER_STATUS_SUCCESS;
}
cusolverStatus_t cusolverDnDestroy(cusolverDnHandle_t handle) {
  delete handle;
  return CUSOLVER_STATUS_SUCCESS;
}
cusolverStatus_t cusolverDnSetStream(cusolverDnHandle_t handle, cudaStream_t stream) {
  if (!handle) return CUSOLVER_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUSOLVER_STATUS_SUCCESS;
}
cusolverStatus_t cusolverDnCreateParams(cusolverDnParams_t* params) {
  *params = new cusolverDnParams{};
  return CUSOLVER_STATUS_SUCCESS;
}
cusolverStatus_t cusolverDnDestroyParams(cusolverDnParams_t params) {
  delete params;
  return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnXsyevd_bufferSize(cusolverDnHandle_t handle, cusolverDnParams_t, cusolverEigMode_t jobz,
                                             cublasFillMode_t uplo, int64_t n, cudaDataType a_type, const void*,
                                             int64_t lda, cudaDataType w_type, const void*, cudaDataType compute,
                                             size_t* device_bytes, size_t* host_bytes) {
  if (cusolverStatus_t s = check(handle, jobz, uplo, n, a_type, lda, w_type, compute); s != CUSOLVER_STATUS_SUCCESS)
    return s;
  workspace_bytes(n, a_type, device_bytes, host_bytes);
  return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnXsyevd(cusolverDnHandle_t handle, cusolverDnParams_t, cusolverEigMode_t jobz,
                                  cublasFillMode_t uplo, int64_t n, cudaDataType a_type, void* A, int64_t lda,
                                  cudaDataType w_type, void* W, cudaDataType compute, void* device_work,
                                  size_t device_bytes, void* host_work, size_t host_bytes, int* info) {
  if (cusolverStatus_t s = check(handle, jobz, uplo, n, a_type, lda, w_type, compute); s != CUSOLVER_STATUS_SUCCESS)
    return s;
  size_t need_device = 0, need_host = 0;
  workspace_bytes(n, a_type, &need_device, &need_host);
  if (device_bytes < need_device || host_bytes < need_host || !device_work || (!host_work && host_bytes) || !info)
    return CUSOLVER_STATUS_INVALID_VALUE;
  emu::enqueue(handle->stream, [=] { *info = decompose(jobz, uplo, n, a_type, A, lda, W); });
  return CUSOLVER_STATUS_SUCCESS;
}
