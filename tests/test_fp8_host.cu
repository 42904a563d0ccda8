// The host side of kernels/fp8_head.cuh, without a GPU. The FP8 casts: cuda_fp8.h's saturating
// cast must equal tests/reference/fp8.h (the compiled reference's cast) on every bf16 value and on
// fp32 values across all binades, ties, subnormals and the saturation edges (the device runs the
// hardware cast in the same function; tests/gpu/test_fp8_head.cu checks that one). The scales and
// their reciprocals, and the shapes the head refuses.
#include "check.h"
#include "kernels/fp8_head.cuh"
#include "reference/fp8.h"

#include <cstring>
#include <random>
#include <tuple>

namespace {

template <Fp8Kind kind>
const Fp8Format& format() {
  return kind == Fp8Kind::e4m3 ? kE4M3 : kE5M2;
}

// Mismatches of to_fp8 against round_to_fp8 over `values`; prints the first few.
template <Fp8Kind kind>
int mismatches(const std::vector<float>& values) {
  int bad = 0;
  for (float v : values) {
    double got = decode_fp8(to_fp8<kind>(v), format<kind>()), want = round_to_fp8(v, format<kind>());
    if (!same_fp8_value(got, want) && ++bad <= 5)
      std::printf("  %s(%.9g) = %.9g, want %.9g\n", kind == Fp8Kind::e4m3 ? "e4m3" : "e5m2", v, got, want);
  }
  return bad;
}

std::vector<float> every_bf16_value() {
  std::vector<float> v;
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    uint32_t word = bits << 16;
    float f;
    std::memcpy(&f, &word, 4);
    v.push_back(f);
  }
  return v;
}

// Random fp32 values spread over the binades from far below the smallest subnormal to past overflow.
std::vector<float> random_fp32_values(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> mantissa(1.0, 2.0);
  std::uniform_int_distribution<int> exponent(-26, 17);
  std::vector<float> v(n);
  for (float& x : v) x = float((rng() & 1 ? -1 : 1) * std::ldexp(mantissa(rng), exponent(rng)));
  return v;
}

// The edges: the overflow thresholds and their neighbours, infinities, the smallest subnormals and
// half of them (ties to zero), and the midpoints between neighbouring FP8 values.
template <Fp8Kind kind>
std::vector<float> edge_values() {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> v = {0.0f, -0.0f, inf, -inf, 448.0f, 464.0f, 465.0f, 480.0f, 57344.0f, 61440.0f, 61439.0f, 1e30f};
  for (float base : {464.0f, 61440.0f}) v.push_back(std::nextafter(base, inf)), v.push_back(std::nextafter(base, 0.0f));
  for (int b = 0; b < 256; ++b) {
    double a = decode_fp8(uint8_t(b), format<kind>()), next = decode_fp8(uint8_t(b + 1), format<kind>());
    if (std::isfinite(a) && std::isfinite(next) && (b & 0x7F) != 0x7F) v.push_back(float((a + next) / 2));
  }
  for (float x : std::vector<float>(v)) v.push_back(-x);
  return v;
}

}  // namespace

TEST_CASE("to_fp8 equals the reference's saturating cast on every bf16 value") {
  std::vector<float> all = every_bf16_value();
  CHECK(mismatches<Fp8Kind::e4m3>(all) == 0);
  CHECK(mismatches<Fp8Kind::e5m2>(all) == 0);
}

TEST_CASE("to_fp8 on random fp32 values over all binades, ties, subnormals and the saturation edges") {
  std::vector<float> values = random_fp32_values(2000000, 1);
  CHECK(mismatches<Fp8Kind::e4m3>(values) == 0);
  CHECK(mismatches<Fp8Kind::e5m2>(values) == 0);
  CHECK(mismatches<Fp8Kind::e4m3>(edge_values<Fp8Kind::e4m3>()) == 0);
  CHECK(mismatches<Fp8Kind::e5m2>(edge_values<Fp8Kind::e5m2>()) == 0);
  CHECK(decode_fp8(to_fp8<Fp8Kind::e4m3>(465.0f), kE4M3) == 448.0);
  CHECK(decode_fp8(to_fp8<Fp8Kind::e5m2>(-61440.0f), kE5M2) == -57344.0);
  CHECK(std::isnan(decode_fp8(to_fp8<Fp8Kind::e4m3>(std::nanf("")), kE4M3)));
}

TEST_CASE("the scales _scaled_mm receives, and the reciprocals inductor multiplies by") {
  Fp8HeadScales s(768);
  const double x_s = std::sqrt(768.0) / 448, w_s = 24.0 / 448, grad_s = 1.0 / 448;
  CHECK(s.x == float(x_s) && s.w == float(w_s) && s.grad == float(grad_s));
  CHECK(s.x_inv == float(1 / x_s) && s.w_inv == float(1 / w_s));
  // The reciprocal of the double, not of its fp32 rounding: 448 where fp32 arithmetic gives 447.99997.
  CHECK(s.grad_inv == 448.0f);
  CHECK(1.0f / s.grad != 448.0f);
}

TEST_CASE("Fp8Head refuses, before touching the GPU, dimensions cuBLASLt's FP8 products cannot take") {
  for (auto [rows, vocab, dim, name] : std::vector<std::tuple<int, int, int, std::string>>{
           {8192, 50257, 768, "vocab"}, {8200, 50304, 768, "max_rows"}, {8192, 50304, 100, "model_dim"},
           {0, 50304, 768, "max_rows"}}) {
    std::string message;
    try {
      Fp8Head head(rows, vocab, dim);
    } catch (const std::invalid_argument& e) {
      message = e.what();
    }
    std::printf("  %s\n", message.c_str());
    CHECK(message.find(name) != std::string::npos && message.find("multiple of 16") != std::string::npos);
  }
}

int main() { return check::run_checks(); }
