// Every parameter's analytic gradient of the CPU reference model against central finite
// differences in fp64: a random direction over each whole tensor, and single elements.
#include "check.h"
#include "reference/model.h"
#include "reference/synthetic.h"

#include <cstdio>

namespace {

struct Setup {
  ModelConfig config;
  Tensors params;
  std::vector<uint16_t> tokens;  // [T + 1]
  MicroSequence seq() const { return {tokens.data(), tokens.data() + 1, int(tokens.size()) - 1, window}; }
  int window;
};

Setup make_setup(int T, int window, uint64_t seed) {
  Setup s{ModelConfig::tiny(), {}, {}, window};
  s.params = init_params(s.config, seed, /*random_everything=*/true);
  s.tokens = synthetic_tokens(T + 1, s.config.vocab_size, s.config.bos_token, 0.05, seed + 1);
  return s;
}

double loss_at(const Setup& s, const Tensors& w) { return forward_backward(s.config, w, s.seq(), nullptr); }

double loss_along(const Setup& s, int p, const std::vector<double>& u, double step) {
  thread_local Tensors w;
  w = s.params;  // reuses the buffers: no allocation after the first call
  for (size_t i = 0; i < u.size(); ++i) w[p][i] += step * u[i];
  return loss_at(s, w);
}

// Fourth-order central difference of the loss along direction u of parameter p (error O(h^4)).
double directional_fd(const Setup& s, int p, const std::vector<double>& u, double h) {
  double near = loss_along(s, p, u, h) - loss_along(s, p, u, -h);
  double far = loss_along(s, p, u, 2 * h) - loss_along(s, p, u, -2 * h);
  return (8 * near - far) / (12 * h);
}

bool agrees(double analytic, double numeric, double tolerance) {
  return std::fabs(analytic - numeric) <= tolerance * std::fabs(numeric) + 1e-9;
}

// The finite difference closest to `analytic` over up to three steps: a large step suffers from
// ReLU kinks inside the stencil, a small one from the loss's rounding noise (~1e-12 on a loss of
// ~300); a wrong gradient misses at every step.
double closest_fd(const Setup& s, int p, const std::vector<double>& u, double analytic, double tolerance) {
  double best = directional_fd(s, p, u, 1e-3);
  for (double h : {3e-4, 1e-4}) {
    if (agrees(analytic, best, tolerance)) break;
    double fd = directional_fd(s, p, u, h);
    if (std::fabs(fd - analytic) < std::fabs(best - analytic)) best = fd;
  }
  return best;
}

void check_all_parameters(const Setup& s, double tolerance) {
  Tensors grads = zeros_like_params(s.config);
  forward_backward(s.config, s.params, s.seq(), &grads);
  std::vector<ParamSpec> specs = param_specs(s.config);
  std::mt19937_64 rng(7);
  std::normal_distribution<double> normal;
  double worst = 0;
  for (size_t p = 0; p < specs.size(); ++p) {
    std::vector<double> u(grads[p].size());
    double norm = 0;
    for (double& v : u) {
      v = normal(rng);
      norm += v * v;
    }
    for (double& v : u) v /= std::sqrt(norm);
    double analytic = 0;
    for (size_t i = 0; i < u.size(); ++i) analytic += grads[p][i] * u[i];
    double numeric = closest_fd(s, int(p), u, analytic, tolerance);
    double rel = std::fabs(analytic - numeric) / std::max(std::fabs(numeric), 1e-8);
    worst = std::max(worst, rel);
    if (!agrees(analytic, numeric, tolerance))
      check::fail(__FILE__, __LINE__, specs[p].name + ": analytic " + std::to_string(analytic) +
                                          " vs numeric " + std::to_string(numeric));
    CHECK(analytic != 0);  // every parameter receives gradient
    std::uniform_int_distribution<size_t> pick(0, u.size() - 1);
    for (int k = 0; k < 2; ++k) {  // single elements (embedding rows may be untouched: zero both ways)
      std::vector<double> e(u.size(), 0.0);
      size_t at = pick(rng);
      e[at] = 1;
      double num = closest_fd(s, int(p), e, grads[p][at], tolerance);
      if (!agrees(grads[p][at], num, tolerance))
        check::fail(__FILE__, __LINE__, specs[p].name + "[" + std::to_string(at) + "]: analytic " +
                                            std::to_string(grads[p][at]) + " vs numeric " + std::to_string(num));
    }
  }
  std::printf("  worst relative error of directional derivatives: %.3e\n", worst);
}

}  // namespace

TEST_CASE("gradients match finite differences, short window (diagonal blocks only)") {
  check_all_parameters(make_setup(32, 1, 11), 1e-6);
}

TEST_CASE("gradients match finite differences, long window over several documents") {
  check_all_parameters(make_setup(64, 5, 12), 1e-6);
}

TEST_CASE("gradients accumulate: two calls add up") {
  Setup s = make_setup(32, 3, 13);
  Tensors once = zeros_like_params(s.config), twice = zeros_like_params(s.config);
  forward_backward(s.config, s.params, s.seq(), &once);
  forward_backward(s.config, s.params, s.seq(), &twice);
  forward_backward(s.config, s.params, s.seq(), &twice);
  for (size_t p = 0; p < once.size(); ++p)
    for (size_t i = 0; i < once[p].size(); ++i) CHECK_NEAR(twice[p][i], 2 * once[p][i], 1e-12 * (1 + std::fabs(once[p][i])));
}

int main() { return check::run_checks(); }
