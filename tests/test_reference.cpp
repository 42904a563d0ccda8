// The CPU reference's building blocks against values fixed by SPEC Part 1: parameter counts, the
// step-0 loss, FP8 rounding, the attention block mask, the optimizers and the schedules; REKLS's
// eigensolver and update against hand computations, and REKLS against Muon in the tiny recipe.
#include "check.h"
#include "reference/optim.h"
#include "reference/rekls.h"
#include "reference/training.h"
#include "reference/synthetic.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <random>

TEST_CASE("record config has 275,742,784 parameters in the SPEC's split") {
  int64_t embeddings = 0, hidden = 0, head = 0, scalars = 0;
  for (const ParamSpec& s : param_specs(ModelConfig::record())) {
    if (s.role == ParamRole::embed || s.role == ParamRole::value_embed) embeddings += s.numel();
    else if (uses_muon(s.role)) hidden += s.numel();
    else if (s.role == ParamRole::lm_head) head += s.numel();
    else scalars += s.numel();
  }
  CHECK(embeddings == 154533888);
  CHECK(hidden == 82575360);
  CHECK(head == 38633472);
  CHECK(scalars == 64);
  CHECK(embeddings + hidden + head + scalars == 275742784);
}

TEST_CASE("with the zero-initialised head every token's loss is ln(vocab)") {
  ModelConfig c = ModelConfig::tiny();
  Tensors w = init_params(c, 1);
  std::vector<uint16_t> tokens = synthetic_tokens(65, c.vocab_size, c.bos_token, 0.05, 2);
  double loss = forward_backward(c, w, {tokens.data(), tokens.data() + 1, 64, 3}, nullptr);
  CHECK_NEAR(loss / 64, std::log(double(c.vocab_size)), 1e-12);
}

TEST_CASE("fp8 rounding: e4m3fn and e5m2 grids, ties to even, subnormals, saturation") {
  CHECK(round_to_fp8(1.0, kE4M3) == 1.0);
  CHECK(round_to_fp8(1.0625, kE4M3) == 1.0);     // halfway between 1 and 1.125: to even
  CHECK(round_to_fp8(1.1875, kE4M3) == 1.25);    // halfway between 1.125 and 1.25: to even
  CHECK(round_to_fp8(-300.0, kE4M3) == -288.0);  // 256 + 32k grid
  CHECK(round_to_fp8(448.0, kE4M3) == 448.0);
  CHECK(round_to_fp8(470.0, kE4M3) == 448.0);  // rounds to 480, beyond the largest: saturates
  CHECK(round_to_fp8(-INFINITY, kE4M3) == -448.0);
  CHECK(round_to_fp8(std::ldexp(1.0, -9), kE4M3) == std::ldexp(1.0, -9));  // smallest subnormal
  CHECK(round_to_fp8(std::ldexp(1.0, -11), kE4M3) == 0.0);
  CHECK(round_to_fp8(1.125, kE5M2) == 1.0);      // e5m2 has 2 mantissa bits: 1, 1.25, ...
  CHECK(round_to_fp8(57344.0, kE5M2) == 57344.0);
  CHECK(round_to_fp8(62000.0, kE5M2) == 57344.0);
  CHECK(std::isnan(round_to_fp8(NAN, kE5M2)));
}

TEST_CASE("fp8 head: training loss close to the plain head, evaluation unchanged") {
  ModelConfig c = ModelConfig::tiny();
  Tensors w = init_params(c, 3, true);
  std::vector<uint16_t> tokens = synthetic_tokens(65, c.vocab_size, c.bos_token, 0.05, 4);
  MicroSequence seq{tokens.data(), tokens.data() + 1, 64, 3};
  double plain = forward_backward(c, w, seq, nullptr);
  c.fp8_head = true;
  double fp8 = forward_backward(c, w, seq, nullptr, true);
  double eval = forward_backward(c, w, seq, nullptr, false);
  CHECK(fp8 != plain);
  CHECK(std::fabs(fp8 - plain) < 0.02 * plain);
  CHECK(eval == plain);
}

// Blocks of 4 tokens; documents start (BOS) at tokens 0, 6 and 20 of a 32-token sequence.
static std::vector<int> three_documents() {
  std::vector<uint16_t> tokens(32, 1);
  tokens[0] = tokens[6] = tokens[20] = 9;
  return document_ids(tokens.data(), 32, 9);
}

TEST_CASE("block mask: window 1 (and the short window 0) attends the diagonal only") {
  for (int window : {0, 1}) {
    std::vector<std::vector<int>> blocks = attended_kv_blocks(three_documents(), 4, window);
    for (int q = 0; q < 8; ++q) CHECK(blocks[q] == std::vector<int>{q});
  }
}

TEST_CASE("block mask: partial and full blocks nearest first, clamped by the window") {
  // Docs per block (low..high): b0 1..1, b1 1..2, b2..b4 2..2, b5 3..3 (BOS at 20), b6, b7 3..3.
  std::vector<int> docs = three_documents();
  std::vector<std::vector<int>> wide = attended_kv_blocks(docs, 4, 14);
  CHECK((wide[1] == std::vector<int>{1, 0}));        // both partial (b1 spans docs 1 and 2)
  CHECK((wide[4] == std::vector<int>{4, 1, 3, 2}));  // partial 4, 1; full 3, 2
  CHECK((wide[7] == std::vector<int>{7, 6, 5}));     // partial 7; full 6, 5
  std::vector<std::vector<int>> narrow = attended_kv_blocks(docs, 4, 2);
  CHECK((narrow[4] == std::vector<int>{4, 3}));      // full clamped to W-1 = 1, partial to max(W-full, 1) = 1
  CHECK((narrow[1] == std::vector<int>{1, 0}));      // no full blocks: partial up to W = 2
  std::vector<char> allowed = attention_allowed(docs, 4, 14);
  CHECK(allowed[7 * 32 + 6] == 1);                   // same document, causal
  CHECK(allowed[7 * 32 + 5] == 0);                   // previous document
  CHECK(allowed[6 * 32 + 7] == 0);                   // future token
}

TEST_CASE("schedules: lr factor, momentum warmup and window blocks as the reference") {
  Schedule s;  // 1770 iterations
  CHECK(s.lr_factor(0) == 1.0);
  CHECK(s.lr_factor(1061) == 1.0);
  CHECK_NEAR(s.lr_factor(1062), 1.0, 1e-12);  // x = 0.6 exactly: w = 1
  CHECK_NEAR(s.lr_factor(1416), 0.55, 1e-12);
  CHECK_NEAR(s.lr_factor(1769), (1.0 / 1770 / 0.4) + (1 - 1.0 / 1770 / 0.4) * 0.1, 1e-12);
  CHECK(s.muon_momentum(0) == 0.85);
  CHECK_NEAR(s.muon_momentum(150), 0.90, 1e-12);
  CHECK_NEAR(s.muon_momentum(300), 0.95, 1e-12);
  CHECK_NEAR(s.muon_momentum(1000), 0.95, 1e-12);
  CHECK(s.window_blocks(0) == 1);
  CHECK(s.window_blocks(131) == 1);   // 1728 * 131 / 1770 = 127.9 tokens
  CHECK(s.window_blocks(132) == 2);
  CHECK(s.window_blocks(1770) == 14); // 1728 -> 1792 tokens
  CHECK_THROWS_WITH(s.lr_factor(1771), "step 1771");
}

TEST_CASE("adam: two steps of the PyTorch formula by hand") {
  AdamConfig cfg;
  double p = 1.0, m = 0, v = 0;
  double g1 = 0.5, g2 = -0.25, lr = 0.01;
  adam_update(&p, &g1, &m, &v, 1, lr, 1, cfg);
  double m1 = 0.2 * g1, v1 = 0.05 * g1 * g1;
  double p1 = 1.0 - lr * std::sqrt(0.05) / 0.2 * m1 / (std::sqrt(v1) + 1e-10);
  CHECK_NEAR(p, p1, 1e-15);
  CHECK_NEAR(p, 1.0 - lr, 1e-9);  // the first step moves by lr * sign(g), up to eps
  adam_update(&p, &g2, &m, &v, 1, lr, 2, cfg);
  double m2 = 0.8 * m1 + 0.2 * g2, v2 = 0.95 * v1 + 0.05 * g2 * g2;
  double step = lr * std::sqrt(1 - 0.95 * 0.95) / (1 - 0.8 * 0.8);
  CHECK_NEAR(m, m2, 1e-15);
  CHECK_NEAR(v, v2, 1e-15);
  CHECK_NEAR(p, p1 - step * m2 / (std::sqrt(v2) + 1e-10), 1e-15);
}

TEST_CASE("newton-schulz: acts on singular values by the quintic, transposes tall matrices") {
  MuonConfig cfg;
  // X = P diag(s) with P a signed permutation: NS5(X) = P diag(f(s / |s|)).
  std::vector<double> s = {3.0, 1.0, 0.5, 0.1};
  int perm[4] = {2, 0, 3, 1};
  double sign[4] = {1, -1, 1, -1};
  std::vector<double> X(4 * 6, 0.0);
  for (int i = 0; i < 4; ++i) X[perm[i] * 6 + i] = sign[i] * s[i];
  std::vector<double> out = X;
  newton_schulz5(out, 4, 6, cfg);
  double norm = std::sqrt(std::inner_product(s.begin(), s.end(), s.begin(), 0.0)) + 1e-7;
  for (int i = 0; i < 4; ++i) {
    double x = s[i] / norm;
    for (int k = 0; k < 5; ++k) x = cfg.a * x + cfg.b * x * x * x + cfg.c * x * x * x * x * x;
    CHECK_NEAR(out[perm[i] * 6 + i], sign[i] * x, 1e-12);
    CHECK(x > 0.5 && x < 1.5);  // the quintic's intended band (except tiny singular values)
  }
  std::vector<double> tall(6 * 4);
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 6; ++j) tall[j * 4 + i] = X[i * 6 + j];
  newton_schulz5(tall, 6, 4, cfg);
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 6; ++j) CHECK_NEAR(tall[j * 4 + i], out[i * 6 + j], 1e-12);
}

TEST_CASE("muon: momentum, nesterov form and the shape scale of tall matrices") {
  MuonConfig cfg;
  std::vector<int64_t> tall{4, 2};  // rows/cols = 2: lr x sqrt(2)
  std::vector<double> g = {0.3, -0.1, 0.2, 0.4, -0.5, 0.1, 0.05, 0.2};
  std::vector<double> p(8, 0.0), buf(8, 0.1);
  muon_update(p.data(), g.data(), buf.data(), tall, 0.05, 0.9, cfg);
  std::vector<double> expected_buf(8), nesterov(8);
  for (int i = 0; i < 8; ++i) {
    expected_buf[i] = 0.9 * 0.1 + 0.1 * g[i];
    nesterov[i] = 0.1 * g[i] + 0.9 * expected_buf[i];
    CHECK_NEAR(buf[i], expected_buf[i], 1e-15);
  }
  newton_schulz5(nesterov, 4, 2, cfg);
  for (int i = 0; i < 8; ++i) CHECK_NEAR(p[i], -0.05 * std::sqrt(2.0) * nesterov[i], 1e-14);
}

namespace {

std::vector<double> random_matrix(int rows, int cols, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<double> x(size_t(rows) * cols);
  for (double& e : x) e = normal(rng);
  return x;
}

double max_abs_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
  return worst;
}

// An orthogonal [n, n]: the eigenvectors of a random symmetric matrix.
std::vector<double> random_orthogonal(int n, unsigned seed) {
  std::vector<double> a = random_matrix(n, n, seed), s(size_t(n) * n), values, vectors;
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) s[size_t(i) * n + j] = a[size_t(i) * n + j] + a[size_t(j) * n + i];
  symmetric_eigen(s, n, values, vectors);
  return vectors;
}

// The inverse of a [n, n] by Gauss-Jordan with partial pivoting (independent of the eigensolver).
std::vector<double> inverse(std::vector<double> a, int n) {
  std::vector<double> inv(size_t(n) * n, 0.0);
  for (int i = 0; i < n; ++i) inv[size_t(i) * n + i] = 1;
  for (int c = 0; c < n; ++c) {
    int pivot = c;
    for (int r = c + 1; r < n; ++r)
      if (std::fabs(a[size_t(r) * n + c]) > std::fabs(a[size_t(pivot) * n + c])) pivot = r;
    for (int k = 0; k < n; ++k) {
      std::swap(a[size_t(c) * n + k], a[size_t(pivot) * n + k]);
      std::swap(inv[size_t(c) * n + k], inv[size_t(pivot) * n + k]);
    }
    const double d = a[size_t(c) * n + c];
    for (int k = 0; k < n; ++k) a[size_t(c) * n + k] /= d, inv[size_t(c) * n + k] /= d;
    for (int r = 0; r < n; ++r) {
      if (r == c) continue;
      const double f = a[size_t(r) * n + c];
      for (int k = 0; k < n; ++k) a[size_t(r) * n + k] -= f * a[size_t(c) * n + k], inv[size_t(r) * n + k] -= f * inv[size_t(c) * n + k];
    }
  }
  return inv;
}

}  // namespace

TEST_CASE("symmetric eigen: Q diag(values) Q^T, orthonormal, ascending, repeated eigenvalues") {
  const int n = 9;
  const std::vector<double> Q = random_orthogonal(n, 7);
  const std::vector<double> known = {-2, -0.5, 0, 0, 0, 1e-3, 1, 1, 4};  // a null space and a pair
  std::vector<double> a(size_t(n) * n, 0.0);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j)
      for (int k = 0; k < n; ++k) a[size_t(i) * n + j] += Q[size_t(i) * n + k] * known[k] * Q[size_t(j) * n + k];
  std::vector<double> values, vectors;
  symmetric_eigen(a, n, values, vectors);
  for (int k = 0; k < n; ++k) CHECK_NEAR(values[k], known[k], 1e-13);
  std::vector<double> rebuilt(size_t(n) * n, 0.0), gram(size_t(n) * n, 0.0);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j)
      for (int k = 0; k < n; ++k) {
        rebuilt[size_t(i) * n + j] += vectors[size_t(i) * n + k] * values[k] * vectors[size_t(j) * n + k];
        gram[size_t(i) * n + j] += vectors[size_t(k) * n + i] * vectors[size_t(k) * n + j];
      }
  CHECK(max_abs_difference(rebuilt, a) < 1e-13);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) CHECK_NEAR(gram[size_t(i) * n + j], i == j ? 1.0 : 0.0, 1e-14);
}

TEST_CASE("rekls: rotating into the eigenbases and out again is the identity") {
  ReklsState s(6, 4);
  const std::vector<double> A = random_matrix(6, 4, 11), X = random_matrix(6, 4, 12);
  rekls_update_factors(s, A, 0.0, 1e-8);
  rekls_refresh_eigenbasis(s);
  CHECK(max_abs_difference(rekls_rotate_out(rekls_rotate_in(X, s), s), X) < 1e-13);
  CHECK(max_abs_difference(rekls_rotate_in(rekls_rotate_out(X, s), s), X) < 1e-13);
  CHECK(max_abs_difference(rekls_rotate_in(X, s), X) > 0.1);  // the bases are not the identity
}

TEST_CASE("rekls: the first step moves P by lr times G's polar factor, plus weight decay") {
  // Step 1: L = G G^T / (n eps), R = G^T G / (m eps) (zero eigenvalues clamped to eps, b = 0), so
  // Q_L, Q_R are G's singular vectors, G' = diag(s) and U = sign(G') (up to eps / s): the update
  // is U_G V_G^T = G (G^T G)^(-1/2), Adam's sign step in the singular basis.
  const int m = 5, n = 3;
  ReklsConfig cfg;
  std::vector<double> g = random_matrix(m, n, 21), p = random_matrix(m, n, 22), p0 = p;
  ReklsState s(m, n);
  rekls_update(p.data(), g.data(), s, cfg.lr, 1, cfg);
  std::vector<double> gram(size_t(n) * n, 0.0), values, vectors;
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j)
      for (int k = 0; k < m; ++k) gram[size_t(i) * n + j] += g[size_t(k) * n + i] * g[size_t(k) * n + j];
  symmetric_eigen(gram, n, values, vectors);
  std::vector<double> inverse_root(size_t(n) * n, 0.0);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j)
      for (int k = 0; k < n; ++k)
        inverse_root[size_t(i) * n + j] += vectors[size_t(i) * n + k] * vectors[size_t(j) * n + k] / std::sqrt(values[k]);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double polar = 0;
      for (int k = 0; k < n; ++k) polar += g[size_t(i) * n + k] * inverse_root[size_t(k) * n + j];
      const size_t at = size_t(i) * n + j;
      CHECK_NEAR(p[at], p0[at] * (1 - cfg.lr * cfg.weight_decay) - cfg.lr * polar, 1e-9);
    }
  for (int j = 0; j < n; ++j) CHECK_NEAR(s.lam_R[j], values[n - 1 - j] / (m * cfg.eps), 1e-6 * values[n - 1]);
}

TEST_CASE("rekls: the second step's factors follow the KL rule with the first step's inverse factors") {
  // With exact eigenbases and eigenvalues above eps, Q diag(lam^-1) Q^T is the inverse factor:
  // L2 = b L1 + (1 - b) G2 R1^-1 G2^T / n, R2 = b R1 + (1 - b) G2^T L1^-1 G2 / m, b = 1 - 0.05 / (1 - 0.95^2).
  const int m = 4, n = 4;
  ReklsConfig cfg;
  std::vector<double> p = random_matrix(m, n, 31), g1 = random_matrix(m, n, 32), g2 = random_matrix(m, n, 33);
  ReklsState s(m, n);
  rekls_update(p.data(), g1.data(), s, cfg.lr, 1, cfg);
  const std::vector<double> L1 = s.L, R1 = s.R, L1_inv = inverse(L1, m), R1_inv = inverse(R1, n);
  rekls_update(p.data(), g2.data(), s, cfg.lr, 2, cfg);
  const double b = 1 - 0.05 / (1 - 0.95 * 0.95);
  // b F + (1 - b) A F_other^-1 A^T / dim for F [k, k], A [k, other] read through a(row, column).
  auto kl_rule = [b](const std::vector<double>& F, const std::vector<double>& other_inverse, int k, int other,
                     const std::function<double(int, int)>& a, double dim) {
    std::vector<double> out(size_t(k) * k);
    for (int i = 0; i < k; ++i)
      for (int j = 0; j < k; ++j) {
        double kl = 0;
        for (int x = 0; x < other; ++x)
          for (int y = 0; y < other; ++y) kl += a(i, x) * other_inverse[size_t(x) * other + y] * a(j, y);
        out[size_t(i) * k + j] = b * F[size_t(i) * k + j] + (1 - b) * kl / dim;
      }
    return out;
  };
  const auto G2 = [&](int i, int k) { return g2[size_t(i) * n + k]; };
  const auto G2t = [&](int i, int k) { return g2[size_t(k) * n + i]; };
  CHECK(max_abs_difference(s.L, kl_rule(L1, R1_inv, m, n, G2, n)) < 1e-9 * std::fabs(L1[0]));
  CHECK(max_abs_difference(s.R, kl_rule(R1, L1_inv, n, m, G2t, m)) < 1e-9 * std::fabs(R1[0]));
}

TEST_CASE("rekls: with eigenbasis_every 2 the bases stay between refreshes, the first moment unrotated") {
  ReklsConfig cfg;
  cfg.eigenbasis_every = 2;
  ReklsState s(4, 3);
  std::vector<double> p = random_matrix(4, 3, 41);
  for (int64_t t = 1; t <= 3; ++t) {
    const std::vector<double> g = random_matrix(4, 3, 42 + unsigned(t)), QL = s.QL, QR = s.QR, lam = s.lam_L;
    const std::vector<double> M = s.M;
    rekls_update(p.data(), g.data(), s, cfg.lr, t, cfg);
    CHECK(rekls_refreshes_eigenbasis(t, 2) == (t != 2));
    // C = Q_L^T L Q_L: on a refresh diagonal (the new factor's eigenbasis); lam_L its diagonal always
    double off_diagonal = 0;
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) {
        double c = 0;
        for (int k = 0; k < 4; ++k)
          for (int l = 0; l < 4; ++l) c += s.QL[size_t(k) * 4 + i] * s.L[size_t(k) * 4 + l] * s.QL[size_t(l) * 4 + j];
        if (i == j) CHECK_NEAR(c, s.lam_L[i], 1e-12 * s.lam_L[0]);
        else off_diagonal = std::max(off_diagonal, std::abs(c));
      }
    if (t == 2) {  // the bases kept, the eigenvalues those of the new factor in them
      CHECK(s.QL == QL && s.QR == QR && s.lam_L != lam);
      const std::vector<double> rotated = rekls_rotate_in(g, s);
      for (size_t i = 0; i < M.size(); ++i) CHECK_NEAR(s.M[i], 0.9 * M[i] + 0.1 * rotated[i], 1e-12);
    } else {
      CHECK(off_diagonal < 1e-12 * s.lam_L[0]);
    }
  }
}

// By hand, 2 x 2, shampoo_beta 1/2, eps 1/4, a refresh every second step (b_t = 1 - (1/2) / (1 - 2^-t):
// 0, 1/3, 3/7; C = Q diag(1 / (2 max(lam, 1/4))) Q^T):
//   t = 1, G = diag(1, 1/2): C = 2 I, L = R = 2 G G^T = diag(2, 1/2); refreshed: Q = I (up to sign),
//          lam = (2, 1/2).
//   t = 2, G = [[1, 1], [0, 1]]: C = diag(1/4, 1) both sides, L = 1/3 diag(2, 1/2) + 2/3 G C G^T =
//          [[3/2, 2/3], [2/3, 5/6]], R = 1/3 diag(2, 1/2) + 2/3 G^T C G = [[5/6, 1/6], [1/6, 1]];
//          kept bases: lam_L = diag(L) = (3/2, 5/6), lam_R = (5/6, 1) (the last refresh's (2, 1/2) no more).
//   t = 3, G = [[1, 0], [1, 1]]: C_R = diag(3/5, 1/2), L = 3/7 L + 4/7 G C_R G^T = [[69/70, 22/35], [22/35, 69/70]].
TEST_CASE("rekls: between refreshes the KL rule reads diag(Q^T L Q) of the current factors (2 x 2 by hand)") {
  ReklsConfig cfg;
  cfg.shampoo_beta = 0.5;
  cfg.eps = 0.25;
  cfg.eigenbasis_every = 2;
  ReklsState s(2, 2);
  std::vector<double> p = {0.1, 0.2, 0.3, 0.4};
  const std::vector<std::vector<double>> G = {{1, 0, 0, 0.5}, {1, 1, 0, 1}, {1, 0, 1, 1}};
  auto near = [](const std::vector<double>& a, const std::vector<double>& b) {
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
    return worst < 1e-12;
  };
  rekls_update(p.data(), G[0].data(), s, cfg.lr, 1, cfg);
  CHECK(near(s.L, {2, 0, 0, 0.5}) && near(s.lam_L, {2, 0.5}) && near(s.lam_R, {2, 0.5}));
  rekls_update(p.data(), G[1].data(), s, cfg.lr, 2, cfg);
  CHECK(near(s.L, {1.5, 2.0 / 3, 2.0 / 3, 5.0 / 6}));
  CHECK(near(s.R, {5.0 / 6, 1.0 / 6, 1.0 / 6, 1}));
  CHECK(near(s.lam_L, {1.5, 5.0 / 6}));
  CHECK(near(s.lam_R, {5.0 / 6, 1}));
  rekls_update(p.data(), G[2].data(), s, cfg.lr, 3, cfg);
  CHECK(near(s.L, {69.0 / 70, 22.0 / 35, 22.0 / 35, 69.0 / 70}));
}

// The CPU recipe at the tiny shape for `steps` steps from the same weights, on one batch over and
// over (the synthetic tokens are near uniform: only memorising them lowers the loss), its hidden
// matrices by Muon (reference_train_step) or by REKLS (qkv [3, d, d] as three matrices; Adam keeps
// the rest, as --matrix-optimizer rekls). Returns each step's mean loss per token.
std::vector<double> train_tiny(bool rekls, int steps) {
  RecipeConfig r;
  r.model = ModelConfig::tiny();
  r.schedule.num_iterations = steps;
  const int T = 64, M = 2;
  const std::vector<uint16_t> tokens =
      synthetic_tokens(size_t(M) * T + 1, r.model.vocab_size, r.model.bos_token, 0.03, 5);
  ReferenceState<double> st(r.model, init_params(r.model, 7, /*random_everything=*/true));
  const std::vector<ParamSpec> specs = param_specs(r.model);
  const ReklsConfig cfg;
  std::map<std::pair<size_t, int64_t>, ReklsState> rekls_states;  // (parameter, matrix) -> state
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    const GlobalBatch batch{tokens.data(), T, M};
    if (!rekls) {
      losses.push_back(reference_train_step(r, step, batch, st) / T);
      continue;
    }
    Tensors grads = zeros_like_params(r.model);
    int count = 0;
    losses.push_back(accumulate_micro_gradients(r, to_double(st.params), batch, step, 0, 1, grads, count) / M / T);
    const StepHyper hyper(r.schedule, step, r.muon);
    ++st.adam_steps;
    for (size_t p = 0; p < specs.size(); ++p) {
      for (double& g : grads[p]) g /= M;
      if (!uses_muon(specs[p].role)) {
        adam_update(st.params[p].data(), grads[p].data(), st.adam_m[p].data(), st.adam_v[p].data(), specs[p].numel(),
                    hyper.adam_lr(r.adam, specs[p].role), st.adam_steps, r.adam);
        continue;
      }
      const std::vector<int64_t>& shape = specs[p].shape;
      const int rows = int(shape[shape.size() - 2]), cols = int(shape.back());
      const int64_t n = int64_t(rows) * cols;
      for (int64_t k = 0; k < specs[p].numel() / n; ++k) {
        ReklsState& s = rekls_states.try_emplace({p, k}, rows, cols).first->second;
        rekls_update(st.params[p].data() + k * n, grads[p].data() + k * n, s, cfg.lr * r.schedule.lr_factor(step),
                     st.adam_steps, cfg);
      }
    }
  }
  return losses;
}

TEST_CASE("rekls against muon in the tiny CPU recipe: the loss of each after N steps (printed), both learn") {
  const int steps = 30;
  const std::vector<double> muon = train_tiny(false, steps), rekls = train_tiny(true, steps);
  for (int step : {0, 9, 19, 29})
    std::printf("  step %2d: loss per token muon %.4f, rekls %.4f\n", step, muon[step], rekls[step]);
  CHECK(muon[0] == rekls[0]);  // the same weights and batch before any update
  auto last_ten = [](const std::vector<double>& l) { return std::accumulate(l.end() - 10, l.end(), 0.0) / 10; };
  CHECK(last_ten(muon) < muon[0]);
  CHECK(last_ten(rekls) < rekls[0]);
}

int main() { return check::run_checks(); }
