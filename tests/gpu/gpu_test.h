// Shared by the GPU tests: skip without a device (exit 77, CTest's skip code), device buffers
// poisoned before use, bf16 conversions, and the relative error ||out - ref|| / ||ref||.
#pragma once
#include "check.h"
#include "kernels/cuda_check.cuh"
#include "kernels/device_utils.cuh"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

constexpr int kSkipExitCode = 77;

// The arguments select test cases by name (check::run_checks).
inline int run_gpu_checks(int argc, char** argv) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("no CUDA device: skipped\n");
    return kSkipExitCode;
  }
  return check::run_checks(argc, argv);
}

// Built for the CPU emulator of the tests (tests/emulator) rather than for a GPU.
#ifdef SPEEDRUN_EMULATED
constexpr bool kEmulated = true;
#else
constexpr bool kEmulated = false;
#endif

// The emulator runs a subset of what the GPU runs, sized for CI, unless SPEEDRUN_EMULATE_FULL=1
// asks for everything (the `emulated-full` tests, hours on two cores: README).
inline bool emulating_a_subset() {
  static const bool full = [] {
    const char* v = std::getenv("SPEEDRUN_EMULATE_FULL");
    return v && std::string(v) == "1";
  }();
  return kEmulated && !full;
}

// Record-sized cases run on a GPU and in the full emulation; the CI-sized emulation leaves them
// out, and says so. Usage: if (at_record_shapes("the record's qkv projection")) check(...);
inline bool at_record_shapes(const char* what) {
  if (emulating_a_subset()) std::printf("  %s: left to the GPU (record shapes take the emulator too long)\n", what);
  return !emulating_a_subset();
}

template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) { CUDA_CHECK(cudaMalloc(&ptr_, std::max<size_t>(n, 1) * sizeof(T))); }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  void upload(const std::vector<T>& host) { CUDA_CHECK(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice)); }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  void poison() { CUDA_CHECK(cudaMemset(ptr_, 0xFF, n_ * sizeof(T))); }  // NaN for fp32 and bf16

 private:
  T* ptr_ = nullptr;
  size_t n_;
};

inline std::vector<double> random_normal(size_t n, uint64_t seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<double> v(n);
  for (double& x : v) x = normal(rng);
  return v;
}

inline std::vector<bf16> to_bf16(const std::vector<double>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16(float(v[i]));
  return out;
}

template <typename T>
std::vector<double> to_double(const std::vector<T>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = double(static_cast<float>(v[i]));
  return out;
}

// The values a bf16 round trip leaves: the reference computes from exactly what the GPU sees.
inline std::vector<double> rounded_to_bf16(const std::vector<double>& v) { return to_double(to_bf16(v)); }

// ||out - ref|| / ||ref||; infinity when any output is NaN or infinite (an unwritten poisoned element).
inline double relative_error(const std::vector<double>& out, const std::vector<double>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(out[i])) return std::numeric_limits<double>::infinity();
    diff += (out[i] - ref[i]) * (out[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  return std::sqrt(diff) / std::sqrt(norm);
}

inline bool all_finite(const std::vector<double>& v) {
  for (double x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

#define CHECK_REL_ERROR(out, ref, bound)                                                         \
  do {                                                                                           \
    double rel_error_ = relative_error(out, ref);                                                \
    std::printf("  %-40s rel. error %.2e (bound %.0e)\n", #out, rel_error_, double(bound));      \
    CHECK(rel_error_ <= (bound));                                                                \
  } while (0)
