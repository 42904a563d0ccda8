// Arrays for comparing a GPU path with a reference, shared by the start-up self-check
// (kernels/self_check.cuh) and the GPU tests: a device buffer, random inputs, bf16 conversions,
// and the relative error ||out - ref|| / ||ref||.
#pragma once
#include "kernels/host/cuda_check.cuh"
#include "kernels/device_utils.cuh"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

// n device elements of T (one at least), freed with the buffer; download waits for the device.
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

// ||out - ref|| / ||ref||; infinity when any output is NaN or infinite (an unwritten poisoned
// element) or when ref is zero and out is not; 0 when both are zero.
inline double relative_error(const std::vector<double>& out, const std::vector<double>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(out[i])) return std::numeric_limits<double>::infinity();
    diff += (out[i] - ref[i]) * (out[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  if (norm == 0) return diff == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(diff) / std::sqrt(norm);
}

// The root sum of squares of the terms of sum over [rows, d] of g x (g's rows d apart, x's x_stride
// apart): the scale of the noise that a bf16 rounding of g puts into the sum, which itself may
// cancel far below it. A scalar gradient's error is measured on this scale.
inline double product_terms_scale(const double* g, const double* x, int rows, int d, int x_stride) {
  double ss = 0;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < d; ++c) {
      const double term = g[size_t(r) * d + c] * x[size_t(r) * x_stride + c];
      ss += term * term;
    }
  return std::sqrt(ss);
}

// |out - ref| / scale; infinity when out is not finite.
inline double error_on_scale(double out, double ref, double scale) {
  return std::isfinite(out) ? std::fabs(out - ref) / scale : std::numeric_limits<double>::infinity();
}

inline bool all_finite(const std::vector<double>& v) {
  for (double x : v)
    if (!std::isfinite(x)) return false;
  return true;
}
