// Rounding to the FP8 formats of the lm_head (SPEC 1.5): round-to-nearest-even, subnormals kept,
// overflow as PyTorch's non-saturating cast gives it (NaN for e4m3fn, inf for e5m2).
#pragma once
#include <cmath>
#include <limits>

struct Fp8Format {
  int mantissa_bits;
  int min_normal_exponent;  // exponent of the smallest normal number
  double max_finite;
  bool overflow_is_nan;
};
constexpr Fp8Format kE4M3{3, -6, 448.0, true};
constexpr Fp8Format kE5M2{2, -14, 57344.0, false};

inline double round_to_fp8(double x, const Fp8Format& f) {
  if (x == 0 || std::isnan(x)) return x;
  double a = std::fabs(x);
  int exponent = std::max(int(std::floor(std::log2(a))), f.min_normal_exponent);
  double quantum = std::ldexp(1.0, exponent - f.mantissa_bits);
  double rounded = std::nearbyint(a / quantum) * quantum;  // default rounding mode: to nearest even
  if (rounded > f.max_finite)
    rounded = f.overflow_is_nan ? std::numeric_limits<double>::quiet_NaN()
                                : std::numeric_limits<double>::infinity();
  return std::copysign(rounded, x);
}
