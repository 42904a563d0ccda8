// CPU reference of REKLS in fp64 on one matrix P [m, n]: two Kronecker factors L [m, m] and
// R [n, n] updated by the KL-Shampoo rule, their eigenbases Q_L, Q_R (refreshed by an exact
// eigendecomposition), and Adam's moments kept in the rotated basis.
//
// Read from NVIDIA-NeMo/Emerging-Optimizers at fd77292: REKLS (emerging_optimizers/legacy_soap/
// rekls.py:27-58) is SOAP with use_eigh=True and use_kl_shampoo=True, so the step is SOAP.step
// (legacy_soap/soap.py:170-294) with those branches. At 1-based step t, gradient G [m, n]:
//   soap.py:226-228   b = 1 - (1 - shampoo_beta) / (1 - shampoo_beta^t)          (bias-corrected)
//   soap.py:372-387   with the previous step's Q_L, Q_R and eigenvalues lam_L, lam_R:
//                       C_L = Q_L diag(max(lam_L, eps)^-1) Q_L^T / m
//                       C_R = Q_R diag(max(lam_R, eps)^-1) Q_R^T / n
//                       L <- b L + (1 - b) G C_R G^T,   R <- b R + (1 - b) G^T C_L G
//   soap.py:440-458   M <- Q_L M Q_R^T (out of the old basis); (lam_L, Q_L) = eigh(L),
//                     (lam_R, Q_R) = eigh(R), eigenvalues descending (utils/eig.py:29-70,
//                     soap_utils.py:33-53); M <- Q_L^T M Q_R (into the new one). V is not rotated.
//   soap.py:258-263   P <- P - lr wd P (decoupled weight decay, mixin.py:47-48)
//   soap.py:267       G' = Q_L^T G Q_R (project_in, soap.py:462-480, with the new bases)
//   adam.py:66-88     M <- b1 M + (1 - b1) G',  V <- b2 V + (1 - b2) G'^2,
//                     U = (M / (1 - b1^t)) / (sqrt(V / (1 - b2^t)) + eps)
//   soap.py:283-286   P <- P - lr Q_L U Q_R^T (project_out, soap.py:484-500)
// Initial state (soap.py:148-160): L, R, M, V and the eigenvalues zero, Q_L, Q_R identity.
// The reference refreshes the eigenbases every step (the "realtime" of REKLS);
// eigenbasis_every = N > 1 refreshes them at steps 1, N + 1, 2N + 1, ... only (our option, as SOAP's
// precondition_frequency): between refreshes Q stays and M is not rotated, and the KL rule's
// eigenvalues are those of the current factors in the kept bases, lam = diag(Q^T L Q) (NVIDIA's
// soap/soap.py with a refresh frequency: update_kronecker_factors_kl_shampoo takes
// conjugate(L, Q, diag=True) of the factor it is about to update); at a refresh, eigh's.
#pragma once
#include "reference/eigen.h"
#include "reference/model.h"

#include <cmath>
#include <cstdint>
#include <vector>

struct ReklsConfig {
  double lr = 0.005, beta1 = 0.9, beta2 = 0.95, shampoo_beta = 0.95, eps = 1e-8, weight_decay = 0.01;
  int eigenbasis_every = 1;
};

// Whether step t (1-based) refreshes the eigenbases.
inline bool rekls_refreshes_eigenbasis(int64_t t, int eigenbasis_every) { return (t - 1) % eigenbasis_every == 0; }

// The state of one matrix [rows, cols], row-major; Q's columns are the eigenvectors.
struct ReklsState {
  int rows, cols;
  std::vector<double> L, R, QL, QR, lam_L, lam_R, M, V;
  ReklsState(int m, int n)
      : rows(m), cols(n), L(size_t(m) * m), R(size_t(n) * n), QL(size_t(m) * m), QR(size_t(n) * n), lam_L(m),
        lam_R(n), M(size_t(m) * n), V(size_t(m) * n) {
    for (int i = 0; i < m; ++i) QL[size_t(i) * m + i] = 1;
    for (int i = 0; i < n; ++i) QR[size_t(i) * n + i] = 1;
  }
};

namespace rekls_ref {

inline std::vector<double> product(const std::vector<double>& a, const std::vector<double>& b, int T, int K, int N) {
  std::vector<double> out(size_t(T) * N);
  ref::matmul_nn(a.data(), b.data(), out.data(), T, K, N);
  return out;
}
inline std::vector<double> transpose(const std::vector<double>& x, int rows, int cols) {
  return ref::transposed(x.data(), rows, cols);
}

// Q diag(max(lam, eps)^-1) Q^T / dim  [k, k]
inline std::vector<double> kl_correction(const std::vector<double>& Q, const std::vector<double>& lam, int k, int dim,
                                         double eps) {
  std::vector<double> scaled(Q);
  for (int i = 0; i < k; ++i)
    for (int j = 0; j < k; ++j) scaled[size_t(i) * k + j] /= dim * std::max(lam[j], eps);
  return product(scaled, transpose(Q, k, k), k, k, k);
}

// (lam, Q) of a symmetric matrix, eigenvalues descending (torch.linalg.eigh, flipped).
inline void descending_eigen(const std::vector<double>& a, int k, std::vector<double>& lam, std::vector<double>& Q) {
  std::vector<double> values, vectors;
  symmetric_eigen(a, k, values, vectors);
  for (int j = 0; j < k; ++j) {
    lam[j] = values[k - 1 - j];
    for (int i = 0; i < k; ++i) Q[size_t(i) * k + j] = vectors[size_t(i) * k + k - 1 - j];
  }
}

}  // namespace rekls_ref

// Q_L^T X Q_R and its inverse Q_L X Q_R^T, X [m, n].
inline std::vector<double> rekls_rotate_in(const std::vector<double>& X, const ReklsState& s) {
  using namespace rekls_ref;
  return product(product(transpose(s.QL, s.rows, s.rows), X, s.rows, s.rows, s.cols), s.QR, s.rows, s.cols, s.cols);
}
inline std::vector<double> rekls_rotate_out(const std::vector<double>& X, const ReklsState& s) {
  using namespace rekls_ref;
  return product(product(s.QL, X, s.rows, s.rows, s.cols), transpose(s.QR, s.cols, s.cols), s.rows, s.cols, s.cols);
}

// The KL-Shampoo update of L and R with gradient G [m, n] (soap.py:372-387).
inline void rekls_update_factors(ReklsState& s, const std::vector<double>& G, double b, double eps) {
  using namespace rekls_ref;
  const int m = s.rows, n = s.cols;
  const std::vector<double> Gt = transpose(G, m, n);
  const std::vector<double> to_L = product(product(G, kl_correction(s.QR, s.lam_R, n, n, eps), m, n, n), Gt, m, n, m);
  const std::vector<double> to_R = product(product(Gt, kl_correction(s.QL, s.lam_L, m, m, eps), n, m, m), G, n, m, n);
  for (size_t i = 0; i < s.L.size(); ++i) s.L[i] = b * s.L[i] + (1 - b) * to_L[i];
  for (size_t i = 0; i < s.R.size(); ++i) s.R[i] = b * s.R[i] + (1 - b) * to_R[i];
}

// New eigenbases of L and R, the first moment carried from the old basis into the new one.
inline void rekls_refresh_eigenbasis(ReklsState& s) {
  s.M = rekls_rotate_out(s.M, s);
  rekls_ref::descending_eigen(s.L, s.rows, s.lam_L, s.QL);
  rekls_ref::descending_eigen(s.R, s.cols, s.lam_R, s.QR);
  s.M = rekls_rotate_in(s.M, s);
}

// Between refreshes: lam_L = diag(Q_L^T L Q_L), lam_R = diag(Q_R^T R Q_R) of the updated factors,
// the eigenvalues the next step's KL rule uses (a refresh sets them to eigh's, the same quantity
// in the new bases).
inline void rekls_eigenvalues_in_basis(ReklsState& s) {
  auto diagonal = [](const std::vector<double>& A, const std::vector<double>& Q, int k, std::vector<double>& lam) {
    const std::vector<double> AQ = rekls_ref::product(A, Q, k, k, k);
    for (int j = 0; j < k; ++j) {
      lam[j] = 0;
      for (int i = 0; i < k; ++i) lam[j] += Q[size_t(i) * k + j] * AQ[size_t(i) * k + j];
    }
  };
  diagonal(s.L, s.QL, s.rows, s.lam_L);
  diagonal(s.R, s.QR, s.cols, s.lam_R);
}

// One REKLS step t (1-based) of P [m, n] with gradient g (already normalised) at learning rate lr.
inline void rekls_update(double* p, const double* g, ReklsState& s, double lr, int64_t t, const ReklsConfig& cfg) {
  const int m = s.rows, n = s.cols;
  const std::vector<double> G(g, g + size_t(m) * n);
  const double b = 1 - (1 - cfg.shampoo_beta) / (1 - std::pow(cfg.shampoo_beta, double(t)));
  rekls_update_factors(s, G, b, cfg.eps);
  if (rekls_refreshes_eigenbasis(t, cfg.eigenbasis_every)) rekls_refresh_eigenbasis(s);
  else rekls_eigenvalues_in_basis(s);
  const std::vector<double> rotated = rekls_rotate_in(G, s);
  const double bias1 = 1 - std::pow(cfg.beta1, double(t)), bias2 = 1 - std::pow(cfg.beta2, double(t));
  std::vector<double> U(rotated.size());
  for (size_t i = 0; i < U.size(); ++i) {
    s.M[i] = cfg.beta1 * s.M[i] + (1 - cfg.beta1) * rotated[i];
    s.V[i] = cfg.beta2 * s.V[i] + (1 - cfg.beta2) * rotated[i] * rotated[i];
    U[i] = (s.M[i] / bias1) / (std::sqrt(s.V[i] / bias2) + cfg.eps);
  }
  const std::vector<double> update = rekls_rotate_out(U, s);
  for (size_t i = 0; i < update.size(); ++i) p[i] = p[i] - lr * cfg.weight_decay * p[i] - lr * update[i];
}
