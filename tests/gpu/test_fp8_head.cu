// The FP8 lm_head (kernels/fp8_head.cuh) against the CPU, on fresh random inputs, outputs poisoned
// first:
// - the quantised operands byte for byte: the plain copy equals the compiled reference's cast
//   (the fp32 product with the reciprocal scale, then tests/reference/fp8.h), subnormals, ties and
//   saturation included; the transposed copy equals its transpose; the gradient, which the
//   cross-entropy kernel writes in e5m2 itself, equals the cast of the bf16 gradient that the
//   in-place cross-entropy writes (test_kernels checks that one against the CPU), losses unchanged;
// - the three products against fp64 sums over the same FP8 operands, at a small shape and the
//   record's chunk (8192 x 50304 x 768, rows and vocabulary entries sampled), the weight gradient
//   accumulating over two backward calls;
// - the accumulation alone (fp32 out, the record's K = 768), with and without fast accumulation;
// - the reference model's FP8 head (tests/reference/model.h), which divides in fp64: operands at
//   most one FP8 step apart, and almost never apart, on natural inputs; equal products on inputs
//   where both round alike.
// Bounds (../.library/device/METHOD.md): bf16 outputs 1e-2 (one bf16 rounding ~1e-3, plus the
// forward's fast accumulation); the fp32 weight gradient 2e-3, not fp32's 1e-4: FP8 products are
// exact, but Hopper's FP8 tensor cores keep only ~14 bits in the partial sums they hand to fp32
// (every 4 MMAs of 32 products without fast accumulation), ~5e-4 of each partial; fast
// accumulation 5e-3: over K = 768 the 14-bit accumulator is truncated 24 times, each by up to
// 2^-13 of itself, 3e-3 were every step to lose the most in one direction.
// The emulator models that accumulation (tests/emulator/cublaslt.cpp, docs/PERF.md 2026-11-25):
// there the logits' error is 1.68e-3 (1.65e-3 with fp32 accumulation), the weight gradient's
// 1.4e-4 (7.6e-8), the accumulation alone 1.2e-4 promoted and 5.0e-4 fast (2.5e-8); were
// negative products floored instead of truncated, 4.7e-3, 5.6e-4, 6.9e-4 and 1.0e-3.
#include "gpu/gpu_test.h"
#include "kernels/fp8_head.cuh"
#include "reference/fp8.h"
#include "reference/model.h"

#include <array>
#include <functional>

namespace {

constexpr double kBf16Bound = 1e-2, kFp32Bound = 2e-3, kFastAccumulationBound = 5e-3;
// The reference model quantises x / s computed in fp64, the GPU x times the fp32 reciprocal in
// fp32: the two round apart (by one FP8 step) only where the product's ~1e-7 relative error
// straddles an FP8 midpoint, a few values in a million (never for the gradient: 448 is exact).
// Eager PyTorch, which rounds x / s to bf16 first, would differ on ~2% of x and ~3% of the gradients.
constexpr double kMaxReroundedFraction = 1e-4;

// Cheap random values for the record shape's 412M gradients: uniform mantissa, an exponent spread
// over `octaves` binades below 2 * scale, random sign, so every FP8 binade (subnormals too) is hit.
class WideRandom {
 public:
  explicit WideRandom(uint64_t seed) : state_(seed) {}
  float operator()(float scale, int octaves) {
    uint64_t r = next();
    float mantissa = 1.0f + float(r >> 40) * 0x1p-24f;
    return (r & 1 ? -scale : scale) * std::ldexp(mantissa, -int((r >> 8) % octaves));
  }

 private:
  uint64_t next() {  // splitmix64
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint64_t state_;
};

std::vector<bf16> wide_bf16(size_t n, float scale, int octaves, uint64_t seed) {
  WideRandom rng(seed);
  std::vector<bf16> v(n);
  for (bf16& x : v) x = __float2bfloat16(rng(scale, octaves));
  return v;
}

std::vector<float> wide_fp32(size_t n, float scale, int octaves, uint64_t seed) {
  WideRandom rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = rng(scale, octaves);
  return v;
}

std::vector<fp8> download_bytes(const fp8* p, size_t n) {
  std::vector<fp8> host(n);
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(host.data(), p, n, cudaMemcpyDeviceToHost));
  return host;
}

// The head's FP8 buffers are its own; the test poisons them (0xFF: NaN in both formats) through
// the pointers it reads them by.
void poison_bytes(const fp8* p, size_t n) { CUDA_CHECK(cudaMemset(const_cast<fp8*>(p), 0xFF, n)); }

// The compiled reference's (v / scale).to(float8): v times the fp32 reciprocal inv_scale, in fp32,
// then the saturating cast.
double compiled_cast(float v, float inv_scale, const Fp8Format& f) { return round_to_fp8(v * inv_scale, f); }

float value(bf16 v) { return __bfloat162float(v); }
float value(float v) { return v; }

std::array<double, 256> decode_table(const Fp8Format& f) {
  std::array<double, 256> t;
  for (int b = 0; b < 256; ++b) t[b] = decode_fp8(uint8_t(b), f);
  return t;
}

// `count` indices spread over [0, n), first and last included.
std::vector<int> spread(int n, int count) {
  if (count >= n) count = n;
  std::vector<int> v;
  for (int i = 0; i < count; ++i) v.push_back(count == 1 ? 0 : int(int64_t(i) * (n - 1) / (count - 1)));
  return v;
}

// The FP8 copies of in [rows, cols] as the GPU wrote them: `transposed` [cols, rows] byte-equal to
// the transpose of `plain` everywhere, `plain` equal to the reference's cast on the rows `check_rows`.
template <typename In>
void check_quantized(const char* name, const std::vector<In>& in, float inv_scale, const Fp8Format& f,
                     const std::vector<fp8>& plain, const std::vector<fp8>& transposed, int rows, int cols,
                     const std::vector<int>& check_rows) {
  size_t transpose_bad = 0, cast_bad = 0, checked = 0, saturated = 0;
  for (int r0 = 0; r0 < rows; r0 += 64)  // 64 x 64 blocks: both copies stay in cache
    for (int c0 = 0; c0 < cols; c0 += 64)
      for (int r = r0; r < std::min(rows, r0 + 64); ++r)
        for (int c = c0; c < std::min(cols, c0 + 64); ++c)
          transpose_bad += plain[size_t(r) * cols + c] != transposed[size_t(c) * rows + r];
  const std::array<double, 256> decoded = decode_table(f);
  for (int r : check_rows)
    for (int c = 0; c < cols; ++c, ++checked) {
      const size_t i = size_t(r) * cols + c;
      double got = decoded[plain[i]], want = compiled_cast(value(in[i]), inv_scale, f);
      saturated += std::fabs(want) == f.max_finite && std::fabs(value(in[i]) * inv_scale) > f.max_finite;
      if (!same_fp8_value(got, want) && ++cast_bad <= 5)
        std::printf("    %s[%d, %d] = %.9g * %.9g: got %.9g, want %.9g\n", name, r, c, value(in[i]), inv_scale, got, want);
    }
  std::printf("  %-3s %d x %d: %zu of %zu values off the reference's cast (%zu saturated), %zu transposed bytes off\n",
              name, rows, cols, cast_bad, checked, saturated, transpose_bad);
  CHECK(cast_bad == 0);
  CHECK(transpose_bad == 0);
}

// Logits whose softmax is peaked in some rows and flat in others (softcapped z over its whole
// range), and random targets.
struct LossInputs {
  std::vector<bf16> logits;
  std::vector<uint16_t> targets;
  LossInputs(int rows, int V, uint64_t seed) : logits(wide_bf16(size_t(rows) * V, 600.0f, 12, seed)), targets(rows) {
    std::mt19937_64 rng(seed + 1);
    for (uint16_t& t : targets) t = uint16_t(rng() % V);
  }
};

// What the bf16 path of cross_entropy.cuh computes (the gradient in place over the logits): the
// gradient the FP8 head must quantise, and the losses.
std::vector<bf16> bf16_loss_gradient(const LossInputs& in, int V, float grad_scale, std::vector<float>* losses = nullptr) {
  const int rows = int(in.targets.size());
  DeviceBuffer<bf16> logits(in.logits);
  DeviceBuffer<uint16_t> targets(in.targets);
  DeviceBuffer<float> token_losses(rows);
  softcap_cross_entropy(logits.get(), targets.get(), token_losses.get(), rows, V, grad_scale, 0);
  if (losses) *losses = token_losses.download();
  return logits.download();
}

template <typename T>
double rms(const std::vector<T>& v) {
  double sum = 0;
  for (T x : v) sum += double(value(x)) * value(x);
  return std::sqrt(sum / v.size());
}

size_t count_nonfinite(const std::vector<bf16>& v) {
  size_t n = 0;
  for (bf16 x : v) n += !std::isfinite(value(x));
  return n;
}

// out[i, j] = scale * sum_k a[i, k] b[j, k] for a [I, K] and b [J, K], in fp64.
std::vector<double> products_nt(const std::vector<double>& a, const std::vector<double>& b, int K, double scale) {
  const size_t I = a.size() / K, J = b.size() / K;
  std::vector<double> out(I * J);
  for (size_t i = 0; i < I; ++i)
    for (size_t j = 0; j < J; ++j) {
      double sum = 0;
      for (int k = 0; k < K; ++k) sum += a[i * K + k] * b[j * K + k];
      out[i * J + j] = scale * sum;
    }
  return out;
}

// The rows `which` of the FP8 matrix m [rows, cols], decoded: [which.size(), cols].
std::vector<double> decode_rows(const std::vector<fp8>& m, int cols, const std::vector<int>& which, const Fp8Format& f) {
  const std::array<double, 256> decoded = decode_table(f);
  std::vector<double> out;
  out.reserve(which.size() * cols);
  for (int r : which)
    for (int c = 0; c < cols; ++c) out.push_back(decoded[m[size_t(r) * cols + c]]);
  return out;
}

// The columns `which` of the FP8 matrix m [rows, cols], decoded: [which.size(), rows].
std::vector<double> decode_columns(const std::vector<fp8>& m, int rows, int cols, const std::vector<int>& which,
                                   const Fp8Format& f) {
  const std::array<double, 256> decoded = decode_table(f);
  std::vector<double> out(which.size() * size_t(rows));
  for (int r = 0; r < rows; ++r)
    for (size_t j = 0; j < which.size(); ++j) out[j * rows + r] = decoded[m[size_t(r) * cols + which[j]]];
  return out;
}

template <typename T>
std::vector<double> rows_of(const std::vector<T>& m, int cols, const std::vector<int>& rows) {
  std::vector<double> out;
  for (int r : rows)
    for (int c = 0; c < cols; ++c) out.push_back(double(value(m[size_t(r) * cols + c])));
  return out;
}

// forward, backward twice (dW accumulating onto a random prior) at rows x V x d; the CPU checks
// `sample_rows` rows of logits and dx and `sample_vocab` rows of dW.
void check_products(int rows, int V, int d, int sample_rows, int sample_vocab, uint64_t seed) {
  std::printf("  head %d rows x %d vocab x %d dim\n", rows, V, d);
  Fp8Head head(rows, V, d);
  const Fp8HeadScales& s = head.scales();
  // x as RMS-normalised activations (|x| < sqrt(d)) and w within 24, spread over 16 binades; g the
  // loss gradient of peaked and flat rows (|g| / grad_s <= 16, into the subnormals).
  std::vector<bf16> x = wide_bf16(size_t(rows) * d, std::sqrt(float(d)) / 4, 16, seed);
  std::vector<float> w = wide_fp32(size_t(V) * d, 2.0f, 16, seed + 1);
  LossInputs loss_inputs(rows, V, seed + 2);
  std::vector<bf16> g = bf16_loss_gradient(loss_inputs, V, 1.0f);
  DeviceBuffer<bf16> d_x(x), loss_logits(loss_inputs.logits), logits(size_t(rows) * V), dx(size_t(rows) * d);
  DeviceBuffer<uint16_t> targets(loss_inputs.targets);
  DeviceBuffer<float> d_w(w), dw(size_t(V) * d), losses(rows);
  logits.poison();
  dx.poison();
  Fp8HeadOperands op = head.operands();
  for (auto [p, n] : {std::pair{op.x, size_t(rows) * d}, {op.x_t, size_t(rows) * d}, {op.w, size_t(V) * d},
                      {op.w_t, size_t(V) * d}, {op.g, size_t(rows) * V}, {op.g_t, size_t(rows) * V}})
    poison_bytes(p, n);
  // dW accumulates (beta 1) onto a prior of its own size: sqrt(rows) rms(g) rms(x).
  std::vector<double> prior_normal = random_normal(size_t(V) * d, seed + 3, std::sqrt(double(rows)) * rms(g) * rms(x));
  std::vector<float> prior(prior_normal.begin(), prior_normal.end());
  dw.upload(prior);

  Matmul matmul;
  head.quantize_weight(d_w.get(), 0);
  head.forward(d_x.get(), logits.get(), rows, matmul, 0);
  head.loss_and_gradient(loss_logits.get(), targets.get(), losses.get(), Softcap{}, 0);
  head.backward(dx.get(), dw.get(), matmul, 0);
  std::vector<float> dw_once = dw.download();
  head.backward(dx.get(), dw.get(), matmul, 0);
  std::vector<float> dw_twice = dw.download();
  std::vector<bf16> logits_gpu = logits.download(), dx_gpu = dx.download();
  CHECK(count_nonfinite(logits_gpu) == 0 && count_nonfinite(dx_gpu) == 0);  // every poisoned element written

  std::vector<fp8> x8 = download_bytes(op.x, x.size()), w8 = download_bytes(op.w, w.size()), g8 = download_bytes(op.g, g.size());
  std::vector<int> R = spread(rows, sample_rows), Vs = spread(V, sample_vocab);
  check_quantized("x", x, s.x_inv, kE4M3, x8, download_bytes(op.x_t, x.size()), rows, d, R);
  check_quantized("w", w, s.w_inv, kE4M3, w8, download_bytes(op.w_t, w.size()), V, d, spread(V, sample_rows));
  check_quantized("g", g, s.grad_inv, kE5M2, g8, download_bytes(op.g_t, g.size()), rows, V, R);

  std::vector<int> all_vocab = spread(V, V), all_dims = spread(d, d);
  std::vector<double> logits_ref =
      products_nt(decode_rows(x8, d, R, kE4M3), decode_rows(w8, d, all_vocab, kE4M3), d, double(s.x) * s.w);
  std::vector<double> dx_ref = products_nt(decode_rows(g8, V, R, kE5M2), decode_columns(w8, V, d, all_dims, kE4M3), V,
                                           double(s.grad) * s.w);
  std::vector<double> dw_ref = products_nt(decode_columns(g8, rows, V, Vs, kE5M2),
                                           decode_columns(x8, rows, d, all_dims, kE4M3), rows, double(s.grad) * s.x);
  std::vector<double> logits_rows = rows_of(logits_gpu, V, R), dx_rows = rows_of(dx_gpu, d, R);
  CHECK_REL_ERROR(logits_rows, logits_ref, kBf16Bound);
  CHECK_REL_ERROR(dx_rows, dx_ref, kBf16Bound);
  // The weight gradient of one backward, then of two: what each added to the prior.
  std::vector<double> dw_added = rows_of(dw_once, d, Vs), dw_added_twice = rows_of(dw_twice, d, Vs), twice_ref = dw_ref;
  std::vector<double> prior_rows = rows_of(prior, d, Vs);
  for (size_t i = 0; i < dw_added.size(); ++i) {
    dw_added[i] -= prior_rows[i];
    dw_added_twice[i] -= prior_rows[i];
    twice_ref[i] *= 2;
  }
  CHECK_REL_ERROR(dw_added, dw_ref, kFp32Bound);
  CHECK_REL_ERROR(dw_added_twice, twice_ref, kFp32Bound);
}

// a and b within one FP8 step of each other (NaN only with NaN).
bool within_one_step(double a, double b, const Fp8Format& f) {
  if (same_fp8_value(a, b)) return true;
  if (!std::isfinite(a) || !std::isfinite(b)) return false;
  int exponent = std::max(int(std::floor(std::log2(std::max(std::fabs(a), std::fabs(b))))), f.min_normal_exponent);
  return std::fabs(a - b) <= std::ldexp(1.0, exponent - f.mantissa_bits);
}

// The FP8 values the GPU used against the reference model's (fp64 division): none more than one
// step apart, at most kMaxReroundedFraction apart at all.
void check_operand_against_reference(const char* name, const std::vector<fp8>& gpu, const std::vector<double>& ref,
                                     const Fp8Format& f) {
  const std::array<double, 256> decoded = decode_table(f);
  size_t differ = 0, far = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    differ += !same_fp8_value(decoded[gpu[i]], ref[i]);
    far += !within_one_step(decoded[gpu[i]], ref[i], f);
  }
  double fraction = double(differ) / ref.size();
  std::printf("  %s: %.2f%% of the values one FP8 step from the reference model's, %zu further\n", name,
              100 * fraction, far);
  CHECK(far == 0);
  CHECK(fraction <= kMaxReroundedFraction);
}

}  // namespace

// Every dimension a multiple of 16 and not of 64 (partial tiles on both sides), fewer rows than
// the head was sized for.
constexpr int kOddRows = 208, kOddVocab = 1040, kOddDim = 144;

TEST_CASE("quantisation: the reference's casts byte for byte, plain and transposed, partial tiles, saturation") {
  const int rows = kOddRows, V = kOddVocab, d = kOddDim;
  Fp8Head head(256, V, d);
  const Fp8HeadScales& s = head.scales();
  // Down to 2^-24 below the largest value: through the subnormals into zero.
  std::vector<bf16> x = wide_bf16(size_t(rows) * d, std::sqrt(float(d)) / 2, 24, 11);
  std::vector<float> w = wide_fp32(size_t(V) * d, 12.0f, 24, 12);
  // Values past the largest FP8 value (saturated, both signs) and at the edge: x / s and w / s
  // next to 464 (rounds to 448 either way).
  const float x_edge[] = {470 * s.x, -470 * s.x, 464 * s.x, -464 * s.x}, w_edge[] = {25.0f, -25.0f, 464 * s.w, -448 * s.w};
  for (int i = 0; i < 4; ++i) {
    x[size_t(i) * 37] = __float2bfloat16(x_edge[i]);
    w[size_t(i) * 41] = w_edge[i];
  }
  DeviceBuffer<bf16> d_x(x);
  DeviceBuffer<float> d_w(w);
  Fp8HeadOperands op = head.operands();
  for (auto [p, n] : {std::pair{op.x, x.size()}, {op.x_t, x.size()}, {op.w, w.size()}, {op.w_t, w.size()}})
    poison_bytes(p, n);
  head.quantize_weight(d_w.get(), 0);
  head.quantize_input(d_x.get(), rows, 0);
  check_quantized("x", x, s.x_inv, kE4M3, download_bytes(op.x, x.size()), download_bytes(op.x_t, x.size()), rows, d,
                  spread(rows, rows));
  check_quantized("w", w, s.w_inv, kE4M3, download_bytes(op.w, w.size()), download_bytes(op.w_t, w.size()), V, d,
                  spread(V, V));
}

TEST_CASE("the loss's e5m2 gradient: the cast of the bf16 gradient byte for byte, plain and transposed; same losses") {
  const int rows = kOddRows, V = kOddVocab, d = kOddDim;
  Fp8Head head(256, V, d);
  DeviceBuffer<bf16> x(wide_bf16(size_t(rows) * d, 1.0f, 8, 51));
  DeviceBuffer<float> w(wide_fp32(size_t(V) * d, 1.0f, 8, 52));
  head.quantize_weight(w.get(), 0);
  head.quantize_input(x.get(), rows, 0);  // the loss takes the rows of the last forward
  LossInputs in(rows, V, 53);
  DeviceBuffer<bf16> logits(in.logits);
  DeviceBuffer<uint16_t> targets(in.targets);
  DeviceBuffer<float> losses(rows);
  Fp8HeadOperands op = head.operands();
  const size_t n = size_t(rows) * V;
  // 1: training's gradient (|g| / grad_s <= 16: subnormals to mid-range); 10^4: every target
  // near logit 0 past e5m2's largest value 57344 (saturated).
  for (float grad_scale : {1.0f, 1e4f}) {
    std::printf("  grad_scale %g\n", grad_scale);
    poison_bytes(op.g, n);
    poison_bytes(op.g_t, n);
    losses.poison();
    head.loss_and_gradient(logits.get(), targets.get(), losses.get(), Softcap{}, 0, grad_scale);
    std::vector<float> bf16_losses;
    std::vector<bf16> g = bf16_loss_gradient(in, V, grad_scale, &bf16_losses);
    check_quantized("g", g, head.scales().grad_inv, kE5M2, download_bytes(op.g, n), download_bytes(op.g_t, n), rows, V,
                    spread(rows, rows));
    CHECK(losses.download() == bf16_losses);
  }
}

TEST_CASE("forward, dx and accumulated dW against fp64 sums over the same FP8 operands") {
  check_products(256, 1024, 256, 256, 1024, 21);
  if (at_record_shapes("the record's chunk")) check_products(8192, 50304, 768, 24, 48, 22);
}

// Each of cuBLASLt's answers for the logits product (--fp8-logits-algorithm) against fp64 sums over
// the same FP8 operands, until the heuristic offers no more (refused, naming the count) or the
// Matmul's kMaxCandidates are all checked.
void check_logits_candidates(int rows, int V, int d, int sample_rows, uint64_t seed) {
  Fp8Head head(rows, V, d);
  const Fp8HeadScales& s = head.scales();
  DeviceBuffer<bf16> x(wide_bf16(size_t(rows) * d, std::sqrt(float(d)) / 4, 16, seed)), logits(size_t(rows) * V);
  DeviceBuffer<float> w(wide_fp32(size_t(V) * d, 2.0f, 16, seed + 1));
  head.quantize_weight(w.get(), 0);
  head.quantize_input(x.get(), rows, 0);
  const Fp8HeadOperands op = head.operands();
  const std::vector<int> R = spread(rows, sample_rows);
  const std::vector<double> want =
      products_nt(decode_rows(download_bytes(op.x, size_t(rows) * d), d, R, kE4M3),
                  decode_rows(download_bytes(op.w, size_t(V) * d), d, spread(V, V), kE4M3), d, double(s.x) * s.w);
  Matmul matmul;
  int candidate = 0;
  for (; candidate < Matmul::kMaxCandidates; ++candidate) {
    head.set_logits_candidate(candidate);
    logits.poison();
    try {
      head.logits_product(logits.get(), matmul, 0);
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()).find("cuBLASLt offers " + std::to_string(candidate) + " algorithm") == 0);
      break;
    }
    const std::vector<bf16> got = logits.download();
    CHECK(count_nonfinite(got) == 0);
    const double error = relative_error(rows_of(got, V, R), want);
    std::printf("  %d x %d x %d, candidate %d: rel. error %.2e\n", rows, V, d, candidate, error);
    CHECK(error <= kBf16Bound);
  }
  CHECK(candidate >= 1);
}

TEST_CASE("every cuBLASLt candidate of the logits product (--fp8-logits-algorithm) against fp64 sums") {
  check_logits_candidates(256, 1024, 256, 256, 31);
  if (at_record_shapes("the record's chunk")) check_logits_candidates(8192, 50304, 768, 24, 32);
}

// The accumulation alone, where the bf16 logits' own rounding (~1.7e-3 above) does not hide it: the
// logits' product (e4m3 x e4m3) with fp32 out at the record's K = d = 768, with and without fast
// accumulation, against fp64 sums of the same FP8 operands. Gaussian x (RMS-normalised) and w.
TEST_CASE("the FP8 product's accumulation alone (fp32 out) at the record's K = 768, fast and promoted") {
  const int rows = 256, V = 256, d = 768;
  Fp8Head head(rows, V, d);
  std::vector<double> w = random_normal(size_t(V) * d, 42, 0.5);
  DeviceBuffer<bf16> d_x(to_bf16(random_normal(size_t(rows) * d, 41)));
  DeviceBuffer<float> d_w(std::vector<float>(w.begin(), w.end()));
  head.quantize_weight(d_w.get(), 0);
  head.quantize_input(d_x.get(), rows, 0);
  Fp8HeadOperands op = head.operands();
  const std::vector<double> want =
      products_nt(decode_rows(download_bytes(op.x, size_t(rows) * d), d, spread(rows, rows), kE4M3),
                  decode_rows(download_bytes(op.w, size_t(V) * d), d, spread(V, V), kE4M3), d, 1.0);
  Matmul matmul;
  DeviceBuffer<float> out(size_t(rows) * V);
  auto product = [&](bool fast_accum) {
    out.poison();
    MatmulOptions o{CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, nullptr, nullptr, fast_accum};
    matmul(op.x, Transpose::N, op.w, Transpose::T, out.get(), rows, V, d, CUDA_R_32F, o, 0);
    return rows_of(out.download(), V, spread(rows, rows));
  };
  const std::vector<double> promoted = product(false), fast = product(true);
  CHECK_REL_ERROR(promoted, want, kFp32Bound);
  CHECK_REL_ERROR(fast, want, kFastAccumulationBound);
}

TEST_CASE("against the reference model's FP8 head (SPEC 1.5 in fp64)") {
  const int rows = 256, V = 1024, d = 256;
  Fp8Head head(rows, V, d);
  const Fp8HeadScales& fs = head.scales();
  ref::Fp8Scales s(d);
  // As in the model: x RMS-normalised, w small, g a softmax gradient.
  std::vector<double> x = rounded_to_bf16(random_normal(size_t(rows) * d, 31));
  std::vector<double> w = random_normal(size_t(V) * d, 32, 0.5);
  for (double& v : w) v = float(v);
  LossInputs loss_inputs(rows, V, 33);
  std::vector<double> g = to_double(bf16_loss_gradient(loss_inputs, V, 1.0f));
  auto reference_cast = [](std::vector<double> v, double scale, const Fp8Format& f) {
    for (double& e : v) e = round_to_fp8(e / scale, f);
    return v;
  };
  Matmul matmul;
  DeviceBuffer<bf16> d_x(to_bf16(x)), loss_logits(loss_inputs.logits), logits(size_t(rows) * V), dx(size_t(rows) * d);
  DeviceBuffer<uint16_t> targets(loss_inputs.targets);
  DeviceBuffer<float> d_w(std::vector<float>(w.begin(), w.end())), dw(size_t(V) * d), losses(rows);
  head.quantize_weight(d_w.get(), 0);
  head.quantize_input(d_x.get(), rows, 0);
  head.loss_and_gradient(loss_logits.get(), targets.get(), losses.get(), Softcap{}, 0);
  Fp8HeadOperands op = head.operands();
  check_operand_against_reference("x", download_bytes(op.x, x.size()), reference_cast(x, s.x, kE4M3), kE4M3);
  check_operand_against_reference("w", download_bytes(op.w, w.size()), reference_cast(w, s.w, kE4M3), kE4M3);
  check_operand_against_reference("g", download_bytes(op.g, g.size()), reference_cast(g, s.grad, kE5M2), kE5M2);

  // x moved off the values the two round apart (to the next bf16 towards zero until they agree;
  // the gradient never rounds apart: 448 is exact): then the products must match the reference
  // model's to the products' own precision.
  auto agree = [](std::vector<double>& v, float inv_scale, double scale, const Fp8Format& f) {
    for (double& e : v)
      while (!same_fp8_value(compiled_cast(float(e), inv_scale, f), round_to_fp8(e / scale, f)))
        e = double(__bfloat162float(__float2bfloat16_rz(float(e) * (1 - 1.0f / 256))));
  };
  agree(x, fs.x_inv, s.x, kE4M3);
  d_x.upload(to_bf16(x));
  logits.poison();
  dx.poison();
  std::vector<double> prior = random_normal(w.size(), 34, 1e-1);
  dw.upload(std::vector<float>(prior.begin(), prior.end()));
  head.forward(d_x.get(), logits.get(), rows, matmul, 0);
  head.loss_and_gradient(loss_logits.get(), targets.get(), losses.get(), Softcap{}, 0);
  head.backward(dx.get(), dw.get(), matmul, 0);

  // head_forward and head_backward of tests/reference/model.h.
  std::vector<double> hx = reference_cast(x, s.x, kE4M3), hw = reference_cast(w, s.w, kE4M3);
  std::vector<double> hg = reference_cast(g, s.grad, kE5M2);
  std::vector<double> logits_ref(size_t(rows) * V), dx_ref(x.size()), dw_ref(w.size(), 0.0);
  ref::matmul_nt(hx.data(), hw.data(), logits_ref.data(), rows, d, V);
  ref::matmul_nt_backward(hx.data(), hw.data(), hg.data(), dx_ref.data(), dw_ref.data(), rows, d, V);
  for (double& v : logits_ref) v *= s.x * s.w;
  for (double& v : dx_ref) v *= s.grad * s.w;
  for (double& v : dw_ref) v *= s.grad * s.x;
  std::vector<double> logits_gpu = to_double(logits.download()), dx_gpu = to_double(dx.download());
  std::vector<double> dw_added = to_double(dw.download());
  for (size_t i = 0; i < dw_added.size(); ++i) dw_added[i] -= prior[i];
  CHECK_REL_ERROR(logits_gpu, logits_ref, kBf16Bound);
  CHECK_REL_ERROR(dx_gpu, dx_ref, kBf16Bound);
  CHECK_REL_ERROR(dw_added, dw_ref, kFp32Bound);
}

TEST_CASE("refusals: rows the head cannot take, a loss or backward out of order, FP8 layouts cuBLASLt lacks") {
  const int V = 1024, d = 256;
  Fp8Head head(256, V, d);
  DeviceBuffer<bf16> x(size_t(512) * d), logits(size_t(512) * V), dx(size_t(256) * d);
  DeviceBuffer<float> w(size_t(V) * d), dw(size_t(V) * d), losses(512);
  DeviceBuffer<uint16_t> targets(512);
  Matmul matmul;
  auto throws = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      std::printf("  refused: %s\n", e.what());
      return true;
    }
    return false;
  };
  CHECK(throws([&] { head.forward(x.get(), logits.get(), 256, matmul, 0); }));  // before quantize_weight
  CHECK(throws([&] { head.loss_and_gradient(logits.get(), targets.get(), losses.get(), Softcap{}, 0); }));  // no forward
  head.quantize_weight(w.get(), 0);
  CHECK(throws([&] { head.forward(x.get(), logits.get(), 512, matmul, 0); }));  // more than max_rows
  CHECK(throws([&] { head.forward(x.get(), logits.get(), 200, matmul, 0); }));  // not a multiple of 16
  CHECK(throws([&] { head.forward(x.get() + 1, logits.get(), 256, matmul, 0); }));  // misaligned
  head.quantize_input(x.get(), 128, 0);
  CHECK(throws([&] { head.backward(dx.get(), dw.get(), matmul, 0); }));  // no loss since this forward
  CHECK(throws([&] { head.loss_and_gradient(logits.get(), targets.get(), losses.get(), Softcap{}, 0, 0.0f); }));
  MatmulOptions e5m2_both{CUDA_R_8F_E5M2, CUDA_R_8F_E5M2};
  CHECK(throws([&] { matmul(x.get(), Transpose::N, w.get(), Transpose::T, dx.get(), 256, 256, 256, CUDA_R_16BF, e5m2_both, 0); }));
  MatmulOptions e4m3_both{CUDA_R_8F_E4M3, CUDA_R_8F_E4M3};
  CHECK(throws([&] { matmul(x.get(), Transpose::N, w.get(), Transpose::N, dx.get(), 256, 256, 256, CUDA_R_16BF, e4m3_both, 0); }));
  DeviceBuffer<float> scales(8);
  MatmulOptions scale_off_16_bytes{CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, scales.get(), scales.get() + 1};
  CHECK(throws([&] { matmul(x.get(), Transpose::N, w.get(), Transpose::T, dx.get(), 256, 256, 256, CUDA_R_16BF, scale_off_16_bytes, 0); }));
  CUDA_CHECK(cudaDeviceSynchronize());
}

int main(int argc, char** argv) { return run_gpu_checks(argc, argv); }
