// CPU reference optimizers of the recipe: Adam (SPEC 1.10) and Muon with the quintic Newton-Schulz
// iteration (SPEC 1.9), on plain arrays so that the same update serves a whole tensor or one rank's
// shard. Parameters and states are `Real` (float: the fp32 path; double: fp64); the arithmetic is
// double. Gradients arrive already normalised (summed, then divided by the global count once).
#pragma once
#include "kernels/host/schedules.h"
#include "reference/model.h"

#include <cmath>
#include <cstdint>
#include <vector>

struct AdamConfig {
  double lr = 0.008, beta1 = 0.8, beta2 = 0.95, eps = 1e-10;
};

struct MuonConfig {
  double lr = 0.05;
  int ns_steps = 5;
  double a = 3.4445, b = -4.7750, c = 2.0315;  // quintic coefficients
};

// Adam's per-parameter multipliers (SPEC 1.8): embeddings x75, lm_head x27.5, scalars x5.
inline double adam_lr_multiplier(ParamRole role) {
  switch (role) {
    case ParamRole::embed:
    case ParamRole::value_embed: return 75.0;
    case ParamRole::lm_head: return 27.5;
    case ParamRole::scalars: return 5.0;
    default: return 1.0;
  }
}

inline bool uses_muon(ParamRole role) {
  return role == ParamRole::qkv || role == ParamRole::attn_proj || role == ParamRole::mlp_fc ||
         role == ParamRole::mlp_proj;
}

// PyTorch-Adam on n elements at step t (t counts from 1).
template <typename Real>
void adam_update(Real* p, const double* g, Real* m, Real* v, int64_t n, double lr, int64_t t,
                 const AdamConfig& cfg) {
  double bias1 = 1 - std::pow(cfg.beta1, double(t)), bias2 = 1 - std::pow(cfg.beta2, double(t));
  double step_size = lr * std::sqrt(bias2) / bias1;
  for (int64_t i = 0; i < n; ++i) {
    m[i] = Real(cfg.beta1 * m[i] + (1 - cfg.beta1) * g[i]);
    v[i] = Real(cfg.beta2 * v[i] + (1 - cfg.beta2) * g[i] * g[i]);
    p[i] = Real(p[i] - step_size * m[i] / (std::sqrt(double(v[i])) + cfg.eps));
  }
}

// X [rows, cols] <- NS5(X): Frobenius-normalise, then `steps` of X = aX + (bA + cA^2)X, A = XX^T,
// on the transpose when rows > cols (SPEC 1.9).
inline void newton_schulz5(std::vector<double>& X, int rows, int cols, const MuonConfig& cfg) {
  bool transpose = rows > cols;
  int r = transpose ? cols : rows, k = transpose ? rows : cols;  // work on a wide [r, k] matrix
  std::vector<double> x(size_t(r) * k);
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) (transpose ? x[size_t(j) * k + i] : x[size_t(i) * k + j]) = X[size_t(i) * cols + j];
  double norm = 0;
  for (double e : x) norm += e * e;
  norm = std::sqrt(norm) + 1e-7;
  for (double& e : x) e /= norm;
  std::vector<double> A(size_t(r) * r), B(size_t(r) * r), next(x.size());
  for (int s = 0; s < cfg.ns_steps; ++s) {
    ref::matmul_nt(x.data(), x.data(), A.data(), r, k, r);          // A = X X^T (symmetric)
    ref::matmul_nt(A.data(), A.data(), B.data(), r, r, r);          // A A^T = A^2
    for (size_t i = 0; i < B.size(); ++i) B[i] = cfg.b * A[i] + cfg.c * B[i];
    ref::matmul_nn(B.data(), x.data(), next.data(), r, r, k);       // (bA + cA^2) X
    for (size_t i = 0; i < next.size(); ++i) next[i] = cfg.a * x[i] + next[i];
    x.swap(next);
  }
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) X[size_t(i) * cols + j] = transpose ? x[size_t(j) * k + i] : x[size_t(i) * k + j];
}

// Muon on one parameter of shape [..., rows, cols] (leading dims batch separate matrices):
// buf = m buf + (1-m) g; g' = (1-m) g + m buf (Nesterov); p -= lr * max(1, rows/cols)^0.5 * NS5(g').
template <typename Real>
void muon_update(Real* p, const double* g, Real* momentum_buffer, const std::vector<int64_t>& shape,
                 double lr, double momentum, const MuonConfig& cfg) {
  int rows = int(shape[shape.size() - 2]), cols = int(shape.back());
  int64_t matrix = int64_t(rows) * cols, n = 1;
  for (int64_t d : shape) n *= d;
  double effective_lr = lr * std::sqrt(std::max(1.0, double(rows) / cols));
  std::vector<double> update(matrix);
  for (int64_t base = 0; base < n; base += matrix) {
    for (int64_t i = 0; i < matrix; ++i) {
      double buf = momentum * momentum_buffer[base + i] + (1 - momentum) * g[base + i];
      momentum_buffer[base + i] = Real(buf);
      update[i] = (1 - momentum) * g[base + i] + momentum * double(momentum_buffer[base + i]);
    }
    newton_schulz5(update, rows, cols, cfg);
    for (int64_t i = 0; i < matrix; ++i) p[base + i] = Real(p[base + i] - effective_lr * update[i]);
  }
}

// The learning rates and momentum of one step.
struct StepHyper {
  double adam_lr_factor, muon_lr, muon_momentum;
  StepHyper(const Schedule& s, int step, const MuonConfig& muon)
      : adam_lr_factor(s.lr_factor(step)), muon_lr(muon.lr * s.lr_factor(step)),
        muon_momentum(s.muon_momentum(step)) {}
  double adam_lr(const AdamConfig& adam, ParamRole role) const {
    return adam.lr * adam_lr_multiplier(role) * adam_lr_factor;
  }
};
