// Every CUDA, cuBLAS(Lt), cuSOLVER and NCCL return code is checked; a failure names the call's file:line.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

[[noreturn]] inline void cuda_fail(const char* what, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + call + " failed: " + what);
}

#define CUDA_CHECK(call)                                                              \
  do {                                                                                \
    cudaError_t cuda_check_err_ = (call);                                             \
    if (cuda_check_err_ != cudaSuccess)                                               \
      cuda_fail(cudaGetErrorString(cuda_check_err_), #call, __FILE__, __LINE__);      \
  } while (0)

// After a kernel launch: the launch configuration error, if any.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

#define CUBLAS_CHECK(call)                                                            \
  do {                                                                                \
    cublasStatus_t cublas_check_status_ = (call);                                     \
    if (cublas_check_status_ != CUBLAS_STATUS_SUCCESS)                                \
      cuda_fail(cublasGetStatusString(cublas_check_status_), #call, __FILE__, __LINE__); \
  } while (0)

// cuSOLVER has no status string of its own.
inline const char* cusolver_status_name(cusolverStatus_t s) {
  switch (s) {
    case CUSOLVER_STATUS_SUCCESS: return "CUSOLVER_STATUS_SUCCESS";
    case CUSOLVER_STATUS_NOT_INITIALIZED: return "CUSOLVER_STATUS_NOT_INITIALIZED";
    case CUSOLVER_STATUS_ALLOC_FAILED: return "CUSOLVER_STATUS_ALLOC_FAILED";
    case CUSOLVER_STATUS_INVALID_VALUE: return "CUSOLVER_STATUS_INVALID_VALUE";
    case CUSOLVER_STATUS_ARCH_MISMATCH: return "CUSOLVER_STATUS_ARCH_MISMATCH";
    case CUSOLVER_STATUS_EXECUTION_FAILED: return "CUSOLVER_STATUS_EXECUTION_FAILED";
    case CUSOLVER_STATUS_INTERNAL_ERROR: return "CUSOLVER_STATUS_INTERNAL_ERROR";
    case CUSOLVER_STATUS_NOT_SUPPORTED: return "CUSOLVER_STATUS_NOT_SUPPORTED";
    default: return "cuSOLVER status (see cusolver_common.h)";
  }
}

#define CUSOLVER_CHECK(call)                                                          \
  do {                                                                                \
    cusolverStatus_t cusolver_check_status_ = (call);                                 \
    if (cusolver_check_status_ != CUSOLVER_STATUS_SUCCESS)                            \
      cuda_fail(cusolver_status_name(cusolver_check_status_), #call, __FILE__, __LINE__); \
  } while (0)

#define NCCL_CHECK(call)                                                              \
  do {                                                                                \
    ncclResult_t nccl_check_result_ = (call);                                         \
    if (nccl_check_result_ != ncclSuccess)                                            \
      cuda_fail(ncclGetErrorString(nccl_check_result_), #call, __FILE__, __LINE__);  \
  } while (0)

// No GPU this process can train on: the trainer exits with a status of its own (kExitNoUsableGpu).
struct NoUsableGpu : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Why cudaGetDeviceCount found no GPU, in plain words, with CUDA's own text after (but where no
// driver is installed, for which CUDA says "CUDA driver version is insufficient for CUDA runtime
// version").
inline std::string no_gpu_reason(cudaError_t err) {
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);  // 0 when no driver is installed
  cudaRuntimeGetVersion(&runtime);
  auto version = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
  const std::string cuda_says = err == cudaSuccess ? "" : std::string(" (CUDA: ") + cudaGetErrorString(err) + ")";
  if (driver == 0)
    return "no NVIDIA driver found, so no GPU can be used here: the trainer needs an NVIDIA GPU (H100 or H200) and "
           "its driver; without one, `ctest --test-dir build -L emulated` runs the kernels' tests on the CPU "
           "emulator (README: the GPU tests without a GPU)";
  if (err == cudaErrorInsufficientDriver)
    return "the NVIDIA driver (CUDA " + version(driver) + ") is older than this build's CUDA runtime (" +
           version(runtime) + "): update the driver" + cuda_says;
  if (err == cudaSuccess || err == cudaErrorNoDevice) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    return "no NVIDIA GPU found: the driver (CUDA " + version(driver) + ") sees none" +
           (visible ? std::string(" with CUDA_VISIBLE_DEVICES='") + visible + "'" : std::string()) + cuda_says;
  }
  return "no CUDA GPU is usable here" + cuda_says;
}

// Makes this process's GPU current and returns it: GPU `local_rank`, or the only GPU the process
// sees where the launcher gives each process one (Slurm's --gpus-per-task=1, a per-rank
// CUDA_VISIBLE_DEVICES).
inline int select_gpu(int local_rank) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) throw NoUsableGpu(no_gpu_reason(err));
  const int device = count == 1 ? 0 : local_rank;
  if (device < 0 || device >= count)
    throw NoUsableGpu("local rank " + std::to_string(local_rank) + " needs GPU " + std::to_string(device) +
                      ", but this process sees " + std::to_string(count) + " GPUs (LOCAL_RANK too high?)");
  CUDA_CHECK(cudaSetDevice(device));
  return device;
}

// The trainer's kernels are built for Hopper (sm_90a); any other GPU is refused at start.
inline void require_hopper_gpu(int device) {
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  if (prop.major != 9 || prop.minor != 0)
    throw NoUsableGpu("unsupported GPU '" + std::string(prop.name) + "' (compute capability " +
                      std::to_string(prop.major) + "." + std::to_string(prop.minor) +
                      "): this build targets sm_90a (H100/H200); rebuild with -DSPEEDRUN_CUDA_GENCODE for another GPU");
}
