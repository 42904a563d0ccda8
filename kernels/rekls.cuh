// REKLS on the GPU for the matrices P [m, n] of one shape: the KL-Shampoo Kronecker factors
// L [m, m] and R [n, n], their eigenbases Q_L, Q_R and eigenvalues from cuSOLVER's syevd in fp32,
// a factor at a time (between refreshes the eigenvalues are diag(Q^T L Q) in the kept bases), and
// Adam's moments M, V [m, n] in the rotated basis. The equations, with the lines of NVIDIA's
// implementation they come from, are in the CPU reference (tests/reference/rekls.h), which the
// GPU test compares against. Every product is an fp32 cuBLASLt matmul (no TF32): the factors
// span ~1e8 after the first step's clamped eigenvalues, and the eigenbasis needs their low bits.
#pragma once
#include "kernels/host/cuda_check.cuh"
#include "kernels/device_utils.cuh"
#include "kernels/host/faults.h"
#include "kernels/matmul.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

// Defaults of NVIDIA's REKLS (legacy_soap/rekls.py:41-44) but the learning rate, which it leaves
// to the caller; eigenbasis_every 1 is REKLS's every-step refresh.
struct ReklsSettings {
  float beta1 = 0.9f, beta2 = 0.95f, shampoo_beta = 0.95f, eps = 1e-8f, weight_decay = 0.01f;
  int eigenbasis_every = 1;
};

// One step: learning rate (schedule applied), 1-based step count, and 1 / M for the summed gradient.
struct ReklsStep {
  float lr;
  int64_t t;
  float grad_scale;
};

// The state of one matrix [m, n] in one fp32 buffer (so that a checkpoint lists one per matrix),
// in this order: L [m, m], R [n, n], Q_L [m, m], Q_R [n, n] (columns the eigenvectors, by
// descending eigenvalue), lam_L [m], lam_R [n], M [m, n], V [m, n].
struct ReklsBuffers {
  float *L, *R, *QL, *QR, *lam_L, *lam_R, *M, *V;
  static size_t elems(int m, int n) {
    return 2 * (size_t(m) * m + size_t(n) * n) + size_t(m) + n + 2 * size_t(m) * n;
  }
  static ReklsBuffers at(float* base, int m, int n) {
    ReklsBuffers s;
    const size_t mm = size_t(m) * m, nn = size_t(n) * n, mn = size_t(m) * n;
    s.L = base;
    s.R = s.L + mm;
    s.QL = s.R + nn;
    s.QR = s.QL + mm;
    s.lam_L = s.QR + nn;
    s.lam_R = s.lam_L + m;
    s.M = s.lam_R + n;
    s.V = s.M + mn;
    return s;
  }
};

// One matrix of an update: its fp32 parameter, summed gradient and state buffer (ReklsBuffers).
struct ReklsMatrix {
  float* p;
  const float* g;
  float* state;
};

__global__ void rekls_identity_kernel(float* q, int k) {
  await_previous_kernel();
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(k) * k; i += size_t(gridDim.x) * blockDim.x)
    q[i] = i / k == i % k ? 1.0f : 0.0f;
}

// The initial state (soap.py:148-160): everything zero but Q_L, Q_R, the identity.
inline void rekls_reset_state(float* state, int m, int n, cudaStream_t stream) {
  CUDA_CHECK(cudaMemsetAsync(state, 0, ReklsBuffers::elems(m, n) * sizeof(float), stream));
  const ReklsBuffers s = ReklsBuffers::at(state, m, n);
  CUDA_CHECK(launch_kernel(rekls_identity_kernel, elementwise_grid(size_t(m) * m), 256, 0, stream, s.QL, m));
  CUDA_CHECK(launch_kernel(rekls_identity_kernel, elementwise_grid(size_t(n) * n), 256, 0, stream, s.QR, n));
}

__global__ void rekls_scale_kernel(const float* in, float* out, size_t n, float scale) {
  await_previous_kernel();
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = in[i] * scale;
}

// out[i, j] = x[i, j] / (dim * max(lam[by_row ? i : j], eps)), x [rows, cols]: one side of the
// KL correction Q diag(max(lam, eps)^-1) Q^T / dim applied to the gradient in that basis.
__global__ void rekls_kl_scale_kernel(const float* x, float* out, int rows, int cols, const float* lam, bool by_row,
                                      float dim, float eps) {
  await_previous_kernel();
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(rows) * cols;
       i += size_t(gridDim.x) * blockDim.x) {
    const float l = lam[by_row ? i / cols : i % cols];
    out[i] = x[i] / (dim * fmaxf(l, eps));
  }
}

// lam[j] = (Q^T A Q)[j, j] = sum_i Q[i, j] (A Q)[i, j], AQ = A Q [k, k]: a factor's eigenvalues
// in a kept basis. A thread per column, the rows in order.
__global__ void rekls_diagonal_in_basis_kernel(const float* Q, const float* AQ, float* lam, int k) {
  await_previous_kernel();
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < k; j += gridDim.x * blockDim.x) {
    float sum = 0;
    for (int i = 0; i < k; ++i) sum += Q[size_t(i) * k + j] * AQ[size_t(i) * k + j];
    lam[j] = sum;
  }
}

// syevd's ascending eigenvalues w and eigenvectors (column-major, i.e. row j of `vectors` is the
// j-th) into Q [k, k] (columns, descending: torch.linalg.eigh flipped, utils/eig.py:67-69) and lam.
__global__ void rekls_descending_basis_kernel(const float* vectors, const float* w, float* Q, float* lam, int k) {
  await_previous_kernel();
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(k) * k; i += size_t(gridDim.x) * blockDim.x) {
    const int row = int(i / k), col = int(i % k);
    Q[i] = vectors[size_t(k - 1 - col) * k + row];
    if (row == 0) lam[col] = w[k - 1 - col];
  }
}

// Adam in the rotated basis (adam.py:66-88): M, V updated, U = (M / bias1) / (sqrt(V / bias2) + eps).
__global__ void rekls_adam_kernel(const float* rotated, float* M, float* V, float* U, size_t n, float beta1, float beta2,
                                  float bias1, float bias2, float eps) {
  await_previous_kernel();
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float g = rotated[i];
    const float m = beta1 * M[i] + (1 - beta1) * g, v = beta2 * V[i] + (1 - beta2) * g * g;
    M[i] = m;
    V[i] = v;
    U[i] = (m / bias1) / (sqrtf(v / bias2) + eps);
  }
}

// p <- p - lr wd p - lr update (decoupled weight decay, soap.py:258-263 and 286)
__global__ void rekls_apply_kernel(float* p, const float* update, size_t n, float lr, float weight_decay) {
  await_previous_kernel();
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = p[i] - lr * weight_decay * p[i] - lr * update[i];
}

// The scratch and the cuSOLVER handle of REKLS updates of the given shapes [m, n].
class Rekls {
 public:
  explicit Rekls(const std::vector<std::pair<int, int>>& shapes) {
    CUSOLVER_CHECK(cusolverDnCreate(&solver_));
    CUSOLVER_CHECK(cusolverDnCreateParams(&params_));
    size_t largest_mn = 1, largest_k = 1;
    for (auto [m, n] : shapes) {
      largest_mn = std::max(largest_mn, size_t(m) * n);
      largest_k = std::max({largest_k, size_t(m), size_t(n)});
    }
    for (float** b : {&g_, &x_, &y_, &t_}) CUDA_CHECK(cudaMalloc(b, largest_mn * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&vectors_, largest_k * largest_k * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&values_, largest_k * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&info_, sizeof(int)));
    for (auto [m, n] : shapes)
      for (int k : {m, n}) {
        size_t device = 0, host = 0;
        CUSOLVER_CHECK(cusolverDnXsyevd_bufferSize(solver_, params_, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, k,
                                                   CUDA_R_32F, vectors_, k, CUDA_R_32F, values_, CUDA_R_32F, &device,
                                                   &host));
        solver_device_bytes_ = std::max(solver_device_bytes_, device);
        solver_host_bytes_ = std::max(solver_host_bytes_, host);
      }
    CUDA_CHECK(cudaMalloc(&solver_device_, std::max<size_t>(solver_device_bytes_, 1)));
    solver_host_.resize(std::max<size_t>(solver_host_bytes_, 1));
  }
  ~Rekls() {
    for (void* p : {(void*)g_, (void*)x_, (void*)y_, (void*)t_, (void*)vectors_, (void*)values_, (void*)info_,
                    solver_device_})
      cudaFree(p);
    cusolverDnDestroyParams(params_);
    cusolverDnDestroy(solver_);
  }
  Rekls(const Rekls&) = delete;
  Rekls& operator=(const Rekls&) = delete;

  // One REKLS step of each matrix [m, n] (see tests/reference/rekls.h for the equations), a matrix
  // at a time and each factor decomposed alone: a matrix's result does not depend on which others
  // its rank owns, so W ranks reproduce W = 1. (cuSOLVER's syevBatched over all the factors of a
  // size was 30% faster on an H200, but its result for a factor depends on the batch, and the GPU
  // oracle at W = 2 failed with it: docs/REKLS.md.)
  void update(const std::vector<ReklsMatrix>& matrices, int m, int n, const ReklsSettings& cfg, const ReklsStep& step,
              Matmul& matmul, cudaStream_t stream) {
    matmul_ = &matmul;
    stream_ = stream;
    const bool refresh = (step.t - 1) % cfg.eigenbasis_every == 0;  // soap.py:440-458
    for (const ReklsMatrix& x : matrices) {
      const ReklsBuffers s = ReklsBuffers::at(x.state, m, n);
      update_factors(x, m, n, cfg, step);
      if (refresh) {
        rotate_moment_out(s, m, n);
        eigenbasis({s.L, s.QL, s.lam_L}, m);
        eigenbasis({s.R, s.QR, s.lam_R}, n);
        rotate_moment_in(s, m, n);
      } else {
        eigenvalues_in_basis({s.L, s.QL, s.lam_L}, m);
        eigenvalues_in_basis({s.R, s.QR, s.lam_R}, n);
      }
      rotated_adam_step(x, m, n, cfg, step);
    }
  }

 private:
  // A symmetric factor [k, k] and where its eigenbasis and eigenvalues go.
  struct Factor {
    const float* factor;
    float* Q;
    float* lam;
  };

  // fp32 products: C[M, N] = alpha op(A) op(B) + beta C
  void product(const float* A, Transpose ta, const float* B, Transpose tb, float* C, int M, int N, int K,
               float alpha = 1.0f, float beta = 0.0f) {
    MatmulOptions o;
    o.a_type = o.b_type = CUDA_R_32F;
    (*matmul_)(A, ta, B, tb, C, M, N, K, CUDA_R_32F, o, stream_, alpha, beta);
  }

  // The factors, with the previous bases (soap.py:372-387): L <- b L + (1 - b) (G Q_R) S_R (G Q_R)^T,
  // R <- b R + (1 - b) (Q_L^T G)^T S_L (Q_L^T G), S = diag(max(lam, eps)^-1) / dim.
  // g_ = G, the summed gradient times grad_scale, kept until the matrix's Adam step.
  void update_factors(const ReklsMatrix& x, int m, int n, const ReklsSettings& cfg, const ReklsStep& step) {
    const size_t mn = size_t(m) * n;
    const ReklsBuffers s = ReklsBuffers::at(x.state, m, n);
    CUDA_CHECK(launch_kernel(rekls_scale_kernel, elementwise_grid(mn), 256, 0, stream_, x.g, g_, mn, step.grad_scale));
    const double t = double(step.t);
    const float b = float(1 - (1 - double(cfg.shampoo_beta)) / (1 - std::pow(double(cfg.shampoo_beta), t)));
    product(g_, Transpose::N, s.QR, Transpose::N, x_, m, n, n);  // X = G Q_R
    CUDA_CHECK(launch_kernel(rekls_kl_scale_kernel, elementwise_grid(mn), 256, 0, stream_, x_, y_, m, n, s.lam_R, false,
                             float(n), cfg.eps));
    product(y_, Transpose::N, x_, Transpose::T, s.L, m, m, n, 1 - b, b);
    product(s.QL, Transpose::T, g_, Transpose::N, x_, m, n, m);  // X = Q_L^T G
    CUDA_CHECK(launch_kernel(rekls_kl_scale_kernel, elementwise_grid(mn), 256, 0, stream_, x_, y_, m, n, s.lam_L, true,
                             float(m), cfg.eps));
    product(x_, Transpose::T, y_, Transpose::N, s.R, n, n, m, 1 - b, b);
  }

  // Between refreshes, the eigenvalues the next step's KL rule uses: diag(Q^T A Q) of the updated
  // factor in its kept basis (syevd's scratch holds A Q: no solver runs on such a step).
  void eigenvalues_in_basis(const Factor& f, int k) {
    if (injected_fault() == Fault::rekls_stale_eigenvalues) return;
    product(f.factor, Transpose::N, f.Q, Transpose::N, vectors_, k, k, k);
    CUDA_CHECK(
        launch_kernel(rekls_diagonal_in_basis_kernel, (k + 255) / 256, 256, 0, stream_, f.Q, vectors_, f.lam, k));
  }

  // On a refresh, M out of the old basis before the decompositions and into the new one after.
  void rotate_moment_out(const ReklsBuffers& s, int m, int n) {
    product(s.M, Transpose::N, s.QR, Transpose::T, t_, m, n, n);
    product(s.QL, Transpose::N, t_, Transpose::N, s.M, m, n, m);
  }
  void rotate_moment_in(const ReklsBuffers& s, int m, int n) {
    product(s.QL, Transpose::T, s.M, Transpose::N, t_, m, n, m);
    product(t_, Transpose::N, s.QR, Transpose::N, s.M, m, n, n);
  }

  // Adam in the rotated basis and the update rotated back: G' = Q_L^T G Q_R, U = Adam(G'),
  // p <- p - lr wd p - lr Q_L U Q_R^T (G in g_ from update_factors).
  void rotated_adam_step(const ReklsMatrix& x, int m, int n, const ReklsSettings& cfg, const ReklsStep& step) {
    const size_t mn = size_t(m) * n;
    const ReklsBuffers s = ReklsBuffers::at(x.state, m, n);
    product(s.QL, Transpose::T, g_, Transpose::N, t_, m, n, m);
    product(t_, Transpose::N, s.QR, Transpose::N, x_, m, n, n);
    const double t = double(step.t);
    const float bias1 = float(1 - std::pow(double(cfg.beta1), t)), bias2 = float(1 - std::pow(double(cfg.beta2), t));
    CUDA_CHECK(launch_kernel(rekls_adam_kernel, elementwise_grid(mn), 256, 0, stream_, x_, s.M, s.V, y_, mn, cfg.beta1,
                             cfg.beta2, bias1, bias2, cfg.eps));
    const Transpose back = injected_fault() == Fault::rekls_rotation_untransposed ? Transpose::N : Transpose::T;
    product(y_, Transpose::N, s.QR, back, t_, m, n, n);  // Q_L U Q_R^T
    product(s.QL, Transpose::N, t_, Transpose::N, x_, m, n, m);
    CUDA_CHECK(launch_kernel(rekls_apply_kernel, elementwise_grid(mn), 256, 0, stream_, x.p, x_, mn, step.lr,
                             cfg.weight_decay));
  }

  // A solver's nonzero info stops the run, naming the call and the factor's size.
  static void check_info(int info, const char* call, int k) {
    if (info != 0)
      throw std::runtime_error(std::string("rekls: ") + call + " of a " + std::to_string(k) + "x" + std::to_string(k) +
                               " Kronecker factor failed, info " + std::to_string(info) +
                               (info > 0 ? " (no convergence: a non-finite factor?)" : " (bad argument)"));
  }

  // (lam, Q) of the symmetric factor [k, k] by syevd in fp32, eigenvalues descending. syevd
  // reads the lower triangle of the column-major matrix: the upper one of our row-major factor.
  // Its *info (nonzero: no convergence, or a bad argument) is read back at once, a host
  // synchronisation per factor.
  void eigenbasis(const Factor& f, int k) {
    CUDA_CHECK(cudaMemcpyAsync(vectors_, f.factor, size_t(k) * k * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    CUSOLVER_CHECK(cusolverDnSetStream(solver_, stream_));
    CUSOLVER_CHECK(cusolverDnXsyevd(solver_, params_, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, k, CUDA_R_32F,
                                    vectors_, k, CUDA_R_32F, values_, CUDA_R_32F, solver_device_, solver_device_bytes_,
                                    solver_host_.data(), solver_host_bytes_, info_));
    int info = 0;
    CUDA_CHECK(cudaMemcpyAsync(&info, info_, sizeof(int), cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    check_info(info, "cusolverDnXsyevd", k);
    CUDA_CHECK(launch_kernel(rekls_descending_basis_kernel, elementwise_grid(size_t(k) * k), 256, 0, stream_, vectors_,
                             values_, f.Q, f.lam, k));
  }

  cusolverDnHandle_t solver_ = nullptr;
  cusolverDnParams_t params_ = nullptr;
  Matmul* matmul_ = nullptr;  // those of the update in progress
  cudaStream_t stream_ = nullptr;
  float *g_ = nullptr, *x_ = nullptr, *y_ = nullptr, *t_ = nullptr;  // [largest m n] each
  float *vectors_ = nullptr, *values_ = nullptr;                      // syevd's A [k, k] and W [k]
  int* info_ = nullptr;
  void* solver_device_ = nullptr;
  size_t solver_device_bytes_ = 0, solver_host_bytes_ = 0;
  std::vector<char> solver_host_;
};
