// Eigendecomposition of a real symmetric matrix in double by cyclic Jacobi rotations: the CPU
// reference of REKLS's eigenbasis (reference/rekls.h) and the emulator's stand-in for cuSOLVER's
// syevd (tests/emulator/cusolver.cpp). Slow (O(n^3) per sweep) but accurate to rounding, and
// correct for repeated eigenvalues; for the small matrices of the tests.
#pragma once
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

// a [n, n] symmetric, row-major. values: ascending (LAPACK's order); vectors [n, n] row-major,
// column j the unit eigenvector of values[j].
inline void symmetric_eigen(std::vector<double> a, int n, std::vector<double>& values, std::vector<double>& vectors) {
  std::vector<double> v(size_t(n) * n, 0.0);
  for (int i = 0; i < n; ++i) v[size_t(i) * n + i] = 1;
  auto at = [n](std::vector<double>& m, int i, int j) -> double& { return m[size_t(i) * n + j]; };
  for (int sweep = 0; sweep < 60; ++sweep) {
    double off = 0, total = 0;
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) (i == j ? total : off) += at(a, i, j) * at(a, i, j);
    total += off;
    if (off <= 1e-30 * total) break;  // off-diagonal Frobenius norm below 1e-15 of the whole
    for (int p = 0; p < n - 1; ++p)
      for (int q = p + 1; q < n; ++q) {
        const double apq = at(a, p, q);
        if (apq == 0) continue;
        // The rotation J in the (p, q) plane that zeroes a[p][q] of J^T A J (the smaller angle).
        const double theta = (at(a, q, q) - at(a, p, p)) / (2 * apq);
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int k = 0; k < n; ++k) {  // A J
          const double kp = at(a, k, p), kq = at(a, k, q);
          at(a, k, p) = c * kp - s * kq;
          at(a, k, q) = s * kp + c * kq;
        }
        for (int k = 0; k < n; ++k) {  // J^T (A J)
          const double pk = at(a, p, k), qk = at(a, q, k);
          at(a, p, k) = c * pk - s * qk;
          at(a, q, k) = s * pk + c * qk;
        }
        for (int k = 0; k < n; ++k) {  // V J
          const double kp = at(v, k, p), kq = at(v, k, q);
          at(v, k, p) = c * kp - s * kq;
          at(v, k, q) = s * kp + c * kq;
        }
      }
  }
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return at(a, x, x) < at(a, y, y); });
  values.resize(n);
  vectors.assign(size_t(n) * n, 0.0);
  for (int j = 0; j < n; ++j) {
    values[j] = at(a, order[j], order[j]);
    for (int i = 0; i < n; ++i) vectors[size_t(i) * n + j] = at(v, i, order[j]);
  }
}
