// REKLS on the GPU (kernels/rekls.cuh: fp32 cuBLASLt products, cuSOLVER's syevd) against the
// fp64 CPU reference (tests/reference/rekls.h) on fresh random parameters and gradients: K steps
// of a square matrix (both factors of full rank: distinct eigenvalues, so the bases are defined up
// to sign), one step of a tall and of a wide one, an eigenbasis refreshed every second step.
// Compared: the parameter's change, L, R, their eigenvalues, V, and the first moment rotated back
// (Q_L M Q_R^T): the eigenvectors' signs are the solver's choice, these do not depend on them.
// The gradients are of 1e-8: Adam's elementwise step U = M / (sqrt(V) + eps) divides each rotated
// entry by its own size, so entries that are zero in exact arithmetic (the first step's rotated
// gradient is diagonal, G's singular values) come out as rounding / (|rounding| + eps), fp32's and
// fp64's rounding differing, a difference proportional to the gradients while rounding << eps: at
// 1e-3 a 1e-2 difference of the first update (emulator), the algorithm's own sensitivity in fp32,
// not the kernels'. cuSOLVER's fp32 syevd rounds so that on an H200 at gradients of 1e-6 the
// change differed from the reference by 1.2e-3 (16 x 56), 1.8e-3 (24 x 24, 2 steps) and 0.11
// (768 x 768, 1 step), as the emulator's fp32 stand-in does (1.5e-3 at 48 x 48, 2.1e-3 at
// 16 x 56); at 1e-8 by at most 2.2e-4 on an H200 and an H100 (768 x 768, 2 steps; 1.7e-3 after
// its first step alone), the factors by 7e-7 (docs/PERF.md, 2026-11-26). Non-square matrices run
// one step: the larger factor then has a null space (rank min(m, n)) whose eigenvalues later steps
// fill at the factor's fp32 resolution, eigenvectors that no two solvers share (3e-3 at 4 steps).
#include "gpu/gpu_test.h"
#include "injected_faults.h"
#include "kernels/rekls.cuh"
#include "reference/rekls.h"

namespace {

// Q_L M Q_R^T from the downloaded state (fp64 products).
std::vector<double> moment_out_of_basis(const std::vector<double>& M, const std::vector<double>& QL,
                                        const std::vector<double>& QR, int m, int n) {
  ReklsState s(m, n);
  s.QL = QL;
  s.QR = QR;
  return rekls_rotate_out(M, s);
}

std::vector<double> slice(const std::vector<double>& v, const float* base, const float* from, size_t count) {
  const size_t at = size_t(from - base);
  return std::vector<double>(v.begin() + at, v.begin() + at + count);
}

constexpr double kGradStd = 1e-8;  // see above

// Relative errors after the steps against the reference, the worst over the matrices.
struct ReklsErrors {
  double change = 0, L = 0, R = 0, lam_L = 0, lam_R = 0, V = 0, M_out = 0;
};

// `count` matrices [m, n] updated together (one update call per step, as the trainer's groups),
// each with its own parameters, gradients, state and reference.
// grad_std, eps: the gradients' scale and REKLS's eps, 1e-8 both unless a case needs its eigenvalues
// above the eps floor.
ReklsErrors run_rekls(int m, int n, int steps, int eigenbasis_every, uint64_t seed, int count,
                      double grad_std = kGradStd, float eps = 1e-8f) {
  const size_t mn = size_t(m) * n, elems = ReklsBuffers::elems(m, n);
  const float lr = 0.01f, grad_scale = 0.5f;
  std::vector<float> pf(count * mn);
  for (int i = 0; i < count; ++i) {
    const std::vector<double> p0 = random_normal(mn, seed + 1000 * i, 0.02);
    std::copy(p0.begin(), p0.end(), pf.begin() + i * mn);
  }
  DeviceBuffer<float> dp(pf), dg(count * mn), dstate(count * elems);
  std::vector<ReklsMatrix> matrices;
  for (int i = 0; i < count; ++i) {
    rekls_reset_state(dstate.get() + i * elems, m, n, 0);
    matrices.push_back({dp.get() + i * mn, dg.get() + i * mn, dstate.get() + i * elems});
  }
  Matmul matmul;
  Rekls rekls({{m, n}});
  ReklsSettings settings;
  settings.eigenbasis_every = eigenbasis_every;
  settings.eps = eps;
  ReklsConfig cfg;
  cfg.eigenbasis_every = eigenbasis_every;
  cfg.eps = eps;
  std::vector<double> p_ref(pf.begin(), pf.end());
  std::vector<ReklsState> refs(count, ReklsState(m, n));
  for (int t = 1; t <= steps; ++t) {
    std::vector<float> gf(count * mn);
    for (int i = 0; i < count; ++i) {
      const std::vector<double> g = random_normal(mn, seed + 1000 * i + 100 + t, grad_std);
      std::copy(g.begin(), g.end(), gf.begin() + i * mn);
    }
    dg.upload(gf);
    rekls.update(matrices, m, n, settings, {lr, t, grad_scale}, matmul, 0);
    for (int i = 0; i < count; ++i) {
      std::vector<double> g_ref(mn);
      for (size_t j = 0; j < mn; ++j) g_ref[j] = double(gf[i * mn + j]) * grad_scale;
      rekls_update(p_ref.data() + i * mn, g_ref.data(), refs[i], lr, t, cfg);
    }
  }
  const std::vector<double> p = to_double(dp.download()), state = to_double(dstate.download());
  ReklsErrors worst;
  for (int i = 0; i < count; ++i) {
    std::vector<double> change(mn), change_ref(mn);
    for (size_t j = 0; j < mn; ++j) {
      const size_t at = i * mn + j;
      change[j] = p[at] - pf[at], change_ref[j] = p_ref[at] - pf[at];
    }
    const float* base = dstate.get();
    const ReklsBuffers b = ReklsBuffers::at(dstate.get() + i * elems, m, n);
    const ReklsState& ref = refs[i];
    const std::vector<double> M_out =
        moment_out_of_basis(slice(state, base, b.M, mn), slice(state, base, b.QL, size_t(m) * m),
                            slice(state, base, b.QR, size_t(n) * n), m, n);
    const ReklsErrors e{relative_error(change, change_ref),
                        relative_error(slice(state, base, b.L, size_t(m) * m), ref.L),
                        relative_error(slice(state, base, b.R, size_t(n) * n), ref.R),
                        relative_error(slice(state, base, b.lam_L, m), ref.lam_L),
                        relative_error(slice(state, base, b.lam_R, n), ref.lam_R),
                        relative_error(slice(state, base, b.V, mn), ref.V),
                        relative_error(M_out, rekls_rotate_out(ref.M, ref))};
    worst = {std::max(worst.change, e.change), std::max(worst.L, e.L),         std::max(worst.R, e.R),
             std::max(worst.lam_L, e.lam_L),   std::max(worst.lam_R, e.lam_R), std::max(worst.V, e.V),
             std::max(worst.M_out, e.M_out)};
  }
  return worst;
}

// The factors and their eigenvalues are fp32 sums of products (3e-5); the change, V and the
// moment go through fp32 eigenvectors and Adam's division (1e-3). docs/REKLS.md has what the
// emulator and the GPUs measured.
double check_rekls(int m, int n, int steps, int eigenbasis_every, uint64_t seed, int count = 1) {
  std::printf("  rekls [%d, %d], %d steps, eigenbasis every %d", m, n, steps, eigenbasis_every);
  if (count > 1) std::printf(", %d matrices in one update", count);
  std::printf("\n");
  const ReklsErrors e = run_rekls(m, n, steps, eigenbasis_every, seed, count);
  const double factor_bound = 3e-5, bound = 1e-3;
  for (auto [what, error, limit] : {std::tuple{"parameter change", e.change, bound}, {"L", e.L, factor_bound},
                                    {"R", e.R, factor_bound}, {"lam_L", e.lam_L, factor_bound},
                                    {"lam_R", e.lam_R, factor_bound}, {"V", e.V, bound},
                                    {"Q_L M Q_R^T", e.M_out, bound}}) {
    std::printf("    %-18s rel. error %.2e (bound %.0e)\n", what, error, limit);
    CHECK(error <= limit);
  }
  return e.change;
}

}  // namespace

TEST_CASE("rekls step: KL factors, syevd eigenbases, Adam in the rotated basis; square, tall, wide") {
  check_rekls(48, 48, 4, 1, 1);
  check_rekls(40, 24, 1, 1, 2);  // tall: L has a null space
  check_rekls(16, 56, 1, 1, 3);  // wide: R has one
  check_rekls(32, 32, 7, 2, 4);  // eigenbasis every second step: refreshes at 1, 3, 5, 7
  check_rekls(32, 32, 7, 3, 7);  // every third: at 1, 4, 7, two steps on the kept bases between
  // A GPU's case only. There the change is off by 2.2e-4 after 2 steps (cuSOLVER's fp32 syevd; by
  // 1.7e-3 after its first step alone); the full emulation's stand-in (fp32 Householder and QL) is
  // off by 1.7e-3 after 2 steps, over the bound: at this size it is not the library (docs/REKLS.md).
  if (kEmulated && !testing_a_subset())
    std::printf("  rekls at 768 x 768: a GPU's case (the emulator's syevd stand-in is not the library's at that size)\n");
  else if (at_record_shapes("rekls at 768 x 768"))
    check_rekls(768, 768, 2, 1, 5);
}

TEST_CASE("rekls: several matrices in one update, each as the reference (the scratch shared between them)") {
  check_rekls(48, 48, 4, 1, 1, 3);
  check_rekls(32, 32, 7, 2, 4, 2);  // the even steps keep the bases (no solver)
}

TEST_CASE("rekls: the update rotated back without the transpose of Q_R fails by 10x the rounding or more") {
  const double rounding = check_rekls(24, 24, 2, 1, 6);
  double error = 0;
  {
    ScopedFault injected(Fault::rekls_rotation_untransposed);
    error = run_rekls(24, 24, 2, 1, 6, 1).change;
  }
  std::printf("  rekls_rotation_untransposed: change rel. error %.2e, %.0fx the rounding %.2e\n", error, error / rounding,
              rounding);
  CHECK(error >= 10 * rounding);
  CHECK(error > 1e-3);
}

// The factors show it: their KL update reads the eigenvalues of the step before. With gradients and
// eps of 1e-8 the first step's factors are G G^T / (n eps), so large that the KL term of later steps
// is lost in them, stale eigenvalues or not; gradients of 1e-2 and eps 1e-3 keep that term a few
// percent of the factors (which are fp32 sums of products at any scale).
TEST_CASE("rekls: the last refresh's eigenvalues kept between refreshes fail by 10x the rounding or more") {
  const ReklsErrors rounding = run_rekls(32, 32, 4, 2, 8, 1, 1e-2, 1e-3f);
  ReklsErrors stale;
  {
    ScopedFault injected(Fault::rekls_stale_eigenvalues);
    stale = run_rekls(32, 32, 4, 2, 8, 1, 1e-2, 1e-3f);
  }
  const double worst = std::max(rounding.L, rounding.R), error = std::max(stale.L, stale.R);
  std::printf("  rekls_stale_eigenvalues: factors' rel. error %.2e, %.0fx the rounding %.2e\n", error, error / worst, worst);
  CHECK(error >= 10 * worst);
  CHECK(error > 3e-5);
}

int main(int argc, char** argv) { return run_gpu_checks(argc, argv); }
