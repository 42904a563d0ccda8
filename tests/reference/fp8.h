// Rounding to the FP8 formats of the lm_head (SPEC 1.5) as the reference's compiled cast does it:
// round-to-nearest-even, subnormals kept, beyond the largest finite value (infinities included)
// saturated to it, NaN kept; and the value of an FP8 byte.
#pragma once
#include <algorithm>
#include <cmath>
#include <limits>

struct Fp8Format {
  int mantissa_bits;
  int min_normal_exponent;  // exponent of the smallest normal number
  double max_finite;
  bool no_infinity;  // e4m3fn: the all-ones exponent is a number, except with an all-ones mantissa (NaN)
};
constexpr Fp8Format kE4M3{3, -6, 448.0, true};
constexpr Fp8Format kE5M2{2, -14, 57344.0, false};

inline double round_to_fp8(double x, const Fp8Format& f) {
  if (x == 0 || std::isnan(x)) return x;
  if (std::isinf(x)) return std::copysign(f.max_finite, x);
  double a = std::fabs(x);
  int exponent = std::max(int(std::floor(std::log2(a))), f.min_normal_exponent);
  double quantum = std::ldexp(1.0, exponent - f.mantissa_bits);
  double rounded = std::nearbyint(a / quantum) * quantum;  // default rounding mode: to nearest even
  return std::copysign(std::min(rounded, f.max_finite), x);
}

// The value of an FP8 byte: sign, exponent (bias 1 - min_normal_exponent), mantissa; exponent 0
// is subnormal. The all-ones exponent is NaN with an all-ones mantissa in e4m3fn (its only
// special value) and inf (mantissa 0) or NaN in e5m2.
inline double decode_fp8(unsigned char byte, const Fp8Format& f) {
  const int exponent_bits = 7 - f.mantissa_bits, bias = 1 - f.min_normal_exponent;
  const int mantissa = byte & ((1 << f.mantissa_bits) - 1);
  const int exponent = (byte >> f.mantissa_bits) & ((1 << exponent_bits) - 1);
  const double sign = byte & 0x80 ? -1.0 : 1.0;
  const int all_ones = (1 << exponent_bits) - 1;
  if (f.no_infinity && exponent == all_ones && mantissa == (1 << f.mantissa_bits) - 1)
    return std::numeric_limits<double>::quiet_NaN();
  if (!f.no_infinity && exponent == all_ones)
    return mantissa == 0 ? sign * std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  if (exponent == 0) return sign * std::ldexp(double(mantissa), f.min_normal_exponent - f.mantissa_bits);
  return sign * std::ldexp(double((1 << f.mantissa_bits) + mantissa), exponent - bias - f.mantissa_bits);
}

// Equal FP8 values, NaN equal to NaN (PyTorch's casts give NaN of either sign).
inline bool same_fp8_value(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }
