// The GPU toolchain end to end: device present and Hopper, a kernel runs and writes every element,
// cuBLASLt and NCCL load. Skips (exit 77) when no GPU is present.
#include "gpu/gpu_test.h"

__global__ void fill_index_squared(float* out, int n) {  // out: [n]
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = float(i) * float(i);
}

TEST_CASE("device is Hopper") { require_hopper_gpu(0); }

TEST_CASE("kernel writes every element of a poisoned buffer") {
  const int n = 1 << 20;
  float* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, n * sizeof(float)));
  CUDA_CHECK(cudaMemset(d, 0xFF, n * sizeof(float)));  // NaN poison
  fill_index_squared<<<(n + 255) / 256, 256>>>(d, n);
  CUDA_CHECK_LAUNCH();
  std::vector<float> h(n);
  CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaFree(d));
  int wrong = 0;
  for (int i = 0; i < n; ++i) wrong += h[i] != float(i) * float(i);
  CHECK(wrong == 0);
}

TEST_CASE("cuBLASLt and NCCL load") {
  cublasLtHandle_t lt;
  CUBLAS_CHECK(cublasLtCreate(&lt));
  CHECK(cublasLtGetVersion() >= 130000);
  CUBLAS_CHECK(cublasLtDestroy(lt));
  int nccl_version = 0;
  NCCL_CHECK(ncclGetVersion(&nccl_version));
  std::printf("  cuBLASLt %zu, NCCL %d\n", cublasLtGetVersion(), nccl_version);
  CHECK(nccl_version >= 22800);
}

int main(int argc, char** argv) { return run_gpu_checks(argc, argv); }
