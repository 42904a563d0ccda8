// Eigendecomposition of a real symmetric matrix: Householder reduction to tridiagonal form, then
// the QL iteration with implicit Wilkinson shifts (the classic tred2/tqli pair, as in Numerical
// Recipes 11.2-11.3), accumulating the eigenvectors, in the arithmetic of Real. In double, the CPU
// reference of REKLS's eigenbasis (reference/rekls.h); in the data type, the emulator's stand-in
// for cuSOLVER's syevd (tests/emulator/cusolver.cpp), whose fp32 solve rounds as the library's
// does (an fp32 factor solved in double and rounded was more exact than the H200's syevd, and hid
// REKLS's fp32 sensitivity). Accurate to Real's rounding, correct for repeated eigenvalues,
// O(n^3) (0.16 s at n = 512 on one core in double).
#pragma once
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <vector>

// a [n, n] symmetric, row-major. values: ascending (LAPACK's order); vectors [n, n] row-major,
// column j the unit eigenvector of values[j].
template <typename Real>
void symmetric_eigen(std::vector<Real> a, int n, std::vector<Real>& values, std::vector<Real>& vectors) {
  auto A = [&a, n](int i, int j) -> Real& { return a[size_t(i) * n + j]; };
  std::vector<Real> d(n), e(n);
  // Householder: A = Q T Q^T, T tridiagonal (diagonal d, off-diagonal e[1..n-1]); Q left in a.
  for (int i = n - 1; i > 0; --i) {
    const int l = i - 1;
    Real h = 0;
    if (l > 0) {
      Real scale = 0;
      for (int k = 0; k <= l; ++k) scale += std::fabs(A(i, k));
      if (scale == 0) {
        e[i] = A(i, l);
      } else {
        for (int k = 0; k <= l; ++k) {
          A(i, k) /= scale;
          h += A(i, k) * A(i, k);
        }
        Real f = A(i, l);
        Real g = f >= 0 ? -std::sqrt(h) : std::sqrt(h);
        e[i] = scale * g;
        h -= f * g;
        A(i, l) = f - g;
        f = 0;
        for (int j = 0; j <= l; ++j) {
          A(j, i) = A(i, j) / h;
          g = 0;
          for (int k = 0; k <= j; ++k) g += A(j, k) * A(i, k);
          for (int k = j + 1; k <= l; ++k) g += A(k, j) * A(i, k);
          e[j] = g / h;
          f += e[j] * A(i, j);
        }
        const Real hh = f / (h + h);
        for (int j = 0; j <= l; ++j) {
          f = A(i, j);
          e[j] = g = e[j] - hh * f;
          for (int k = 0; k <= j; ++k) A(j, k) -= f * e[k] + g * A(i, k);
        }
      }
    } else {
      e[i] = A(i, l);
    }
    d[i] = h;
  }
  d[0] = 0;
  e[0] = 0;
  std::vector<Real> g(n);
  for (int i = 0; i < n; ++i) {  // accumulate Q; columns j < i are independent, so row by row
    if (d[i] != 0) {
      std::fill(g.begin(), g.begin() + i, Real(0));
      for (int k = 0; k < i; ++k)
        for (int j = 0; j < i; ++j) g[j] += A(i, k) * A(k, j);
      for (int k = 0; k < i; ++k)
        for (int j = 0; j < i; ++j) A(k, j) -= g[j] * A(k, i);
    }
    d[i] = A(i, i);
    A(i, i) = 1;
    for (int j = 0; j < i; ++j) A(j, i) = A(i, j) = 0;
  }
  // QL with implicit shifts on T; the rotations go into z, kept transposed (row j = vector j) so
  // that each rotation runs along two contiguous rows.
  std::vector<Real> z(size_t(n) * n);
  for (int i = 0; i < n; ++i)
    for (int k = 0; k < n; ++k) z[size_t(k) * n + i] = A(i, k);
  auto Z = [&z, n](int vector, int k) -> Real& { return z[size_t(vector) * n + k]; };
  for (int i = 1; i < n; ++i) e[i - 1] = e[i];
  if (n > 0) e[n - 1] = 0;
  for (int l = 0; l < n; ++l) {
    int iterations = 0, m;
    do {
      for (m = l; m < n - 1; ++m) {
        const Real dd = std::fabs(d[m]) + std::fabs(d[m + 1]);
        if (std::fabs(e[m]) <= std::numeric_limits<Real>::epsilon() * dd) break;
      }
      if (m == l) break;
      if (++iterations > 60) throw std::runtime_error("symmetric_eigen: no convergence");
      Real g = (d[l + 1] - d[l]) / (2 * e[l]);
      Real r = std::hypot(g, Real(1));
      g = d[m] - d[l] + e[l] / (g + std::copysign(r, g));
      Real s = 1, c = 1, p = 0;
      int i = m - 1;
      bool underflow = false;
      for (; i >= l; --i) {
        Real f = s * e[i];
        const Real b = c * e[i];
        e[i + 1] = r = std::hypot(f, g);
        if (r == 0) {  // recover from underflow
          d[i + 1] -= p;
          e[m] = 0;
          underflow = true;
          break;
        }
        s = f / r;
        c = g / r;
        g = d[i + 1] - p;
        r = (d[i] - g) * s + 2 * c * b;
        p = s * r;
        d[i + 1] = g + p;
        g = c * r - b;
        for (int k = 0; k < n; ++k) {
          f = Z(i + 1, k);
          Z(i + 1, k) = s * Z(i, k) + c * f;
          Z(i, k) = c * Z(i, k) - s * f;
        }
      }
      if (underflow) continue;
      d[l] -= p;
      e[l] = g;
      e[m] = 0;
    } while (true);
  }
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return d[x] < d[y]; });
  values.resize(n);
  vectors.assign(size_t(n) * n, Real(0));
  for (int j = 0; j < n; ++j) {
    values[j] = d[order[j]];
    for (int i = 0; i < n; ++i) vectors[size_t(i) * n + j] = Z(order[j], i);
  }
}
