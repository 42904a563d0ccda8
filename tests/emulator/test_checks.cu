// The CUDA emulator's own checks, where a GPU faults, fails or hands out garbage (no GPU
// counterpart: there these kernels fail or read garbage):
// - a vector access through kernels/device_utils.cuh's helpers (load8 of bf16 and of fp32,
//   store8, load4 and store4 of bf16) or a cp.async at an address that is not a multiple of its size stops the program with
//   "misaligned address" and what was accessed; at an aligned address it runs;
// - static __shared__ variables hold poison as each block starts, and together with the dynamic
//   shared memory they must fit the GPU's limits;
// - cuBLASLt answers "not supported" to an FP8 product whose scale pointer is off a 16-byte
//   boundary, as cuBLASLt 13.1 did on an H200 (its heuristic had offered an algorithm);
// - cuSOLVER's syevd reports a factor it cannot decompose by a positive info (LAPACK's convention;
//   what the library answers for a NaN factor is unverified), and REKLS then stops naming the
//   factor (docs/ERRORS.md).
// A launch that may be refused runs in a child process, since a refusal ends the program.
#include "check.h"
#include "kernels/check_arrays.cuh"
#include "kernels/host/cuda_check.cuh"
#include "kernels/device_utils.cuh"
#include "kernels/ptx.cuh"
#include "kernels/rekls.cuh"

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

__global__ void load8_kernel(const bf16* in, float* out) {
  float v[8];
  load8(in, v);
  for (int i = 0; i < 8; ++i) out[i] = v[i];
}

__global__ void load8_fp32_kernel(const float* in, float* out) {
  float v[8];
  load8(in, v);
  for (int i = 0; i < 8; ++i) out[i] = v[i];
}

__global__ void store8_kernel(bf16* out) {
  const float v[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  store8(out, v);
}

__global__ void load4_kernel(const bf16* in, float* out) {
  float v[4];
  load4(in, v);
  for (int i = 0; i < 4; ++i) out[i] = v[i];
}

__global__ void store4_kernel(bf16* out) {
  const float v[4] = {1, 2, 3, 4};
  store4(out, v);
}

__global__ void cp_async_kernel(const bf16* in, float* out) {
  extern __shared__ __align__(16) bf16 tile[];
  ptx::cp_async_16(tile, in);
  ptx::cp_async_commit();
  ptx::cp_async_wait_group<0>();
  out[0] = __bfloat162float(tile[0]);
}

// Reads a static __shared__ variable before writing it: garbage on the GPU, poison here, in every
// block (the previous block's value would hide a missing write).
__global__ void read_before_write_kernel(uint32_t* out) {
  __shared__ uint32_t value;
  out[blockIdx.x] = value;
  value = 1;
}

// 32 KiB of static shared memory beside the dynamic memory of the launch.
__global__ void static_and_dynamic_kernel(float* out) {
  __shared__ float big[8192];
  extern __shared__ float dynamic[];
  big[0] = 1.0f;
  dynamic[0] = big[0];
  out[0] = dynamic[0];
}

struct Outcome {
  bool aborted;         // by a signal: SIGABRT
  int exit_code;        // otherwise
  std::string errors;   // what it wrote to stderr
};

// Runs `body` and waits for the device in a child process, its stderr captured.
Outcome in_child(const std::function<void()>& body) {
  int pipe_ends[2];
  if (pipe(pipe_ends) != 0) throw std::runtime_error("pipe failed");
  const pid_t child = fork();
  if (child < 0) throw std::runtime_error("fork failed");
  if (child == 0) {
    dup2(pipe_ends[1], STDERR_FILENO);
    close(pipe_ends[0]);
    body();
    _exit(cudaDeviceSynchronize() == cudaSuccess && cudaGetLastError() == cudaSuccess ? 0 : 1);
  }
  close(pipe_ends[1]);
  std::string errors;
  char buffer[256];
  for (ssize_t n; (n = read(pipe_ends[0], buffer, sizeof buffer)) > 0;) errors.append(buffer, size_t(n));
  close(pipe_ends[0]);
  int status = 0;
  waitpid(child, &status, 0);
  return {WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT, WIFEXITED(status) ? WEXITSTATUS(status) : -1, errors};
}

// launch(refused_at) stops the program with a message containing `refusal`; launch(run_at) runs.
void check_refused(const char* refusal, const std::function<void(size_t)>& launch, size_t refused_at, size_t run_at) {
  const Outcome refused = in_child([&] { launch(refused_at); }), ran = in_child([&] { launch(run_at); });
  std::printf("  at %zu: %s", refused_at, refused.errors.c_str());
  CHECK(refused.aborted);
  CHECK(refused.errors.find(refusal) != std::string::npos);
  CHECK(!ran.aborted && ran.exit_code == 0 && ran.errors.empty());
}

// 256 device bytes to access (poisoned, as allocated) and room for eight floats out.
struct Buffers {
  Buffers() {
    if (cudaMalloc(&in, 256) != cudaSuccess || cudaMalloc(&out, 8 * sizeof(float)) != cudaSuccess)
      throw std::runtime_error("cudaMalloc failed");
  }
  ~Buffers() {
    cudaFree(in);
    cudaFree(out);
  }
  template <typename T>
  T* at(size_t offset) const {
    return reinterpret_cast<T*>(static_cast<char*>(in) + offset);
  }
  void* in = nullptr;
  float* out = nullptr;
};

}  // namespace

TEST_CASE("load8 of bf16 (one 16-byte load) 8 bytes off a 16-byte boundary stops: misaligned address") {
  Buffers b;
  check_refused("misaligned address: const Bf16x8*",
                  [&](size_t offset) { load8_kernel<<<1, 1>>>(b.at<bf16>(offset), b.out); }, 8, 16);
}

TEST_CASE("load8 of fp32 (two 16-byte loads) 4 bytes off stops: misaligned address") {
  Buffers b;
  check_refused("misaligned address: const float4*",
                  [&](size_t offset) { load8_fp32_kernel<<<1, 1>>>(b.at<float>(offset), b.out); }, 4, 32);
}

TEST_CASE("store8 of bf16 (one 16-byte store) 2 bytes off stops: misaligned address") {
  Buffers b;
  check_refused("misaligned address: Bf16x8*", [&](size_t offset) { store8_kernel<<<1, 1>>>(b.at<bf16>(offset)); },
                  2, 48);
}

TEST_CASE("load4 and store4 of bf16 (one 8-byte access) 2 bytes off stop: misaligned address") {
  Buffers b;
  check_refused("misaligned address: const Bf16x4*",
                  [&](size_t offset) { load4_kernel<<<1, 1>>>(b.at<bf16>(offset), b.out); }, 2, 8);
  check_refused("misaligned address: Bf16x4*", [&](size_t offset) { store4_kernel<<<1, 1>>>(b.at<bf16>(offset)); },
                  6, 16);
}

TEST_CASE("cp.async from a global address 8 bytes off stops: misaligned address") {
  Buffers b;
  check_refused("cp.async global source",
                  [&](size_t offset) { cp_async_kernel<<<1, 1, 16>>>(b.at<bf16>(offset), b.out); }, 8, 64);
}

TEST_CASE("a static __shared__ variable read before it is written holds poison in every block") {
  Buffers b;
  uint32_t* out = b.at<uint32_t>(0);
  read_before_write_kernel<<<2, 1>>>(out);
  uint32_t read[2];
  CHECK(cudaMemcpy(read, out, sizeof read, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(read[0] == 0xFFFFFFFFu && read[1] == 0xFFFFFFFFu);
}

TEST_CASE("32 KiB of static shared memory beside 20 KiB of dynamic (52 of the 48 allowed) stops") {
  Buffers b;
  check_refused("bytes of static __shared__ variables beside 20480 bytes of dynamic shared memory",
                [&](size_t dynamic_bytes) { static_and_dynamic_kernel<<<1, 1, dynamic_bytes>>>(b.out); }, 20 << 10,
                16 << 10);
}

TEST_CASE("an FP8 product with a scale pointer 4 or 8 bytes off a 16-byte boundary is not supported") {
  const int n = 16;  // C[n, n] = A^T B, both stored [k = n, n] column-major: FP8's "TN"
  Buffers b;
  void *operands = nullptr, *out = nullptr;
  CUDA_CHECK(cudaMalloc(&operands, 2 * n * n));
  CUDA_CHECK(cudaMemset(operands, 0x38, 2 * n * n));  // e4m3 1.0
  CUDA_CHECK(cudaMalloc(&out, n * n * sizeof(float)));
  const std::vector<float> ones(64, 1.0f);  // the scales, anywhere in the 256 bytes
  CUDA_CHECK(cudaMemcpy(b.in, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));
  cublasLtHandle_t handle;
  CUBLAS_CHECK(cublasLtCreate(&handle));
  auto product = [&](size_t scale_offset) {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, c;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t t = CUBLAS_OP_T, none = CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof none));
    const float *a_scale = b.at<float>(0), *b_scale = b.at<float>(scale_offset);
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof a_scale));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof b_scale));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a, CUDA_R_8F_E4M3, n, n, n));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c, CUDA_R_32F, n, n, n));
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, desc, a, a, c, c, pref, 1, &result, &found));
    CHECK(found == 1);
    const float alpha = 1.0f, beta = 0.0f;
    const char* first = static_cast<const char*>(operands);
    const cublasStatus_t status = cublasLtMatmul(handle, desc, &alpha, first, a, first + n * n, a, &beta, out, c, out,
                                                 c, &result.algo, nullptr, 0, nullptr);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatrixLayoutDestroy(c);
    cublasLtMatmulDescDestroy(desc);
    return status;
  };
  for (size_t offset : {4, 8}) {
    const cublasStatus_t status = product(offset);
    std::printf("  scale at +%zu bytes: %s\n", offset, cublasGetStatusString(status));
    CHECK(status == CUBLAS_STATUS_NOT_SUPPORTED);
  }
  CHECK(product(16) == CUBLAS_STATUS_SUCCESS);
  CHECK(product(64) == CUBLAS_STATUS_SUCCESS);
  float c00 = 0;
  CUDA_CHECK(cudaMemcpy(&c00, out, sizeof c00, cudaMemcpyDeviceToHost));
  CHECK(c00 == float(n));  // 16 products of 1 x 1
  cublasLtDestroy(handle);
  cudaFree(operands);
  cudaFree(out);
}

TEST_CASE("REKLS stops naming the factor when syevd cannot decompose it (a NaN gradient)") {
  const int m = 8, n = 8;
  const size_t mn = size_t(m) * n;
  DeviceBuffer<float> p(std::vector<float>(mn, 1.0f)), g(std::vector<float>(mn, std::nanf(""))),
      state(ReklsBuffers::elems(m, n));
  rekls_reset_state(state.get(), m, n, 0);
  Matmul matmul;
  Rekls rekls({{m, n}});
  std::string message;
  try {
    rekls.update({{p.get(), g.get(), state.get()}}, m, n, ReklsSettings{}, {1e-3f, 1, 1.0f}, matmul, 0);
  } catch (const std::runtime_error& e) {
    message = e.what();
  }
  std::printf("  %s\n", message.c_str());
  CHECK(message == "rekls: cusolverDnXsyevd of a 8x8 Kronecker factor failed, info 1 (no convergence: a non-finite "
                   "factor?)");
}

int main(int argc, char** argv) { return check::run_checks(argc, argv); }
