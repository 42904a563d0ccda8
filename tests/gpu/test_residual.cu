// Embeddings and the residual-stream scalar mixes against double-precision loops on the host, on
// fresh random inputs with outputs poisoned first. Bounds (../.library/device/METHOD.md): bf16
// outputs 5e-3, fp32 sums of bf16 products 1e-4; gathers are exact.
#include "gpu/gpu_test.h"
#include "kernels/embedding.cuh"
#include "kernels/residual.cuh"

namespace {

constexpr double kBf16Bound = 5e-3, kFp32FromBf16Bound = 1e-4;

// Zipf-like tokens with a BOS every ~300 positions: a few tokens repeat thousands of times, as in text.
std::vector<uint16_t> skewed_tokens(int T, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint16_t> tokens(T);
  for (int t = 0; t < T; ++t) {
    double u = std::uniform_real_distribution<double>(0, 1)(rng);
    tokens[t] = uint16_t(std::min<double>(vocab - 1, std::floor(std::pow(double(vocab), u * u))));
    if (rng() % 300 == 0) tokens[t] = uint16_t(vocab - 1);
  }
  return tokens;
}

void check_embedding(int T, int vocab, int d, uint64_t seed) {
  std::printf("  embedding T=%d vocab=%d d=%d\n", T, vocab, d);
  std::vector<uint16_t> tokens = skewed_tokens(T, vocab, seed);
  std::vector<double> table = rounded_to_bf16(random_normal(size_t(vocab) * d, seed + 1));
  std::vector<double> dout = rounded_to_bf16(random_normal(size_t(T) * d, seed + 2));
  std::vector<double> prior = random_normal(table.size(), seed + 3);  // the backward accumulates onto it
  const float scale = 0.37f;
  DeviceBuffer<uint16_t> dtokens(tokens);
  DeviceBuffer<bf16> dtable(to_bf16(table)), ddout(to_bf16(dout)), out(size_t(T) * d);
  DeviceBuffer<float> grad(std::vector<float>(prior.begin(), prior.end())), dscale(std::vector<float>{scale});
  out.poison();
  embedding_forward(dtokens.get(), dtable.get(), out.get(), T, d, 0);
  StagedUploads uploads;
  uploads.reset(EmbeddingBackwardPlan::upload_bytes(T));
  EmbeddingBackwardPlan plan(tokens.data(), T, vocab, uploads, 0);
  DeviceBuffer<float> scratch(EmbeddingBackwardPlan::scratch_rows(T) * d);
  scratch.poison();  // what the second pass reads, the first must have written
  std::printf("    %d segments of at most %d positions, %d tokens split (their sums added by a second pass)\n",
              plan.segments(), kEmbeddingSegment, plan.split_tokens());
  CHECK(plan.split_tokens() > 0);
  embedding_backward(plan, ddout.get(), grad.get(), dscale.get(), d, scratch.get(), 0);
  std::vector<double> out_ref(size_t(T) * d), grad_ref = prior;
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < d; ++c) {
      out_ref[size_t(t) * d + c] = table[size_t(tokens[t]) * d + c];
      grad_ref[size_t(tokens[t]) * d + c] += scale * dout[size_t(t) * d + c];
    }
  std::vector<double> out_gpu = to_double(out.download()), grad_gpu = to_double(grad.download());
  CHECK(out_gpu == out_ref);  // a gather is exact
  CHECK_REL_ERROR(grad_gpu, grad_ref, kFp32FromBf16Bound);

  // Bitwise the same gradient on a second run: the position order is fixed, no atomics.
  std::vector<float> first = grad.download();
  grad.upload(std::vector<float>(prior.begin(), prior.end()));
  embedding_backward(plan, ddout.get(), grad.get(), dscale.get(), d, scratch.get(), 0);
  CHECK(grad.download() == first);
}

struct MixInputs {
  std::vector<double> x, y, dout, dy_prior;
  float a, b;
};

// out = a x + b y with x a strided view; then its backward with dx in place of a strided buffer.
void check_weighted_sum(int T, int d, int x_stride, uint64_t seed) {
  std::printf("  weighted sum T=%d d=%d x stride %d\n", T, d, x_stride);
  MixInputs in{rounded_to_bf16(random_normal(size_t(T) * x_stride, seed)),
               rounded_to_bf16(random_normal(size_t(T) * d, seed + 1)),
               rounded_to_bf16(random_normal(size_t(T) * d, seed + 2)),
               rounded_to_bf16(random_normal(size_t(T) * d, seed + 3)), 0.8125f, -0.375f};
  DeviceBuffer<bf16> x(to_bf16(in.x)), y(to_bf16(in.y)), dout(to_bf16(in.dout)), out(size_t(T) * d);
  DeviceBuffer<bf16> dx(to_bf16(in.x)), dy(to_bf16(in.dy_prior));  // dx: the strided buffer, partly overwritten
  const float da_prior = 1.5f, db_prior = -2.25f;
  DeviceBuffer<float> scalars(std::vector<float>{in.a, in.b, da_prior, db_prior});
  DeviceBuffer<float> scratch(kScalarReductionScratchFloats);
  out.poison();
  const float *a = scalars.get(), *b = scalars.get() + 1;
  float *da = scalars.get() + 2, *db = scalars.get() + 3;
  weighted_sum_forward(x.get(), a, y.get(), b, out.get(), T, d, x_stride, 0);
  weighted_sum_backward(dout.get(), x.get(), a, da, y.get(), b, db, dx.get(), dy.get(), /*accumulate_dy=*/true, T, d,
                        x_stride, scratch.get(), 0);

  std::vector<double> out_ref(size_t(T) * d), dx_ref = in.x, dy_ref = in.dy_prior;
  double da_ref = da_prior, db_ref = db_prior;
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < d; ++c) {
      size_t i = size_t(t) * d + c, xi = size_t(t) * x_stride + c;
      out_ref[i] = in.a * in.x[xi] + in.b * in.y[i];
      dx_ref[xi] = in.a * in.dout[i];
      dy_ref[i] += in.b * in.dout[i];
      da_ref += in.dout[i] * in.x[xi];
      db_ref += in.dout[i] * in.y[i];
    }
  std::vector<float> s = scalars.download();
  std::vector<double> out_gpu = to_double(out.download()), dx_gpu = to_double(dx.download());
  std::vector<double> dy_gpu = to_double(dy.download());
  CHECK_REL_ERROR(out_gpu, out_ref, kBf16Bound);
  CHECK_REL_ERROR(dx_gpu, dx_ref, kBf16Bound);  // also: the other columns of the stride are untouched
  CHECK_REL_ERROR(dy_gpu, dy_ref, kBf16Bound);
  std::vector<double> scalar_grads{s[2], s[3]}, scalar_refs{da_ref, db_ref};
  CHECK_REL_ERROR(scalar_grads, scalar_refs, kFp32FromBf16Bound);
}

}  // namespace

TEST_CASE("embedding: gather forward, deterministic scaled backward accumulating into fp32") {
  check_embedding(1024, 512, 64, 1);
  check_embedding(1024, 512, 768, 3);  // the model's width: each lane sums three column vectors
  if (at_record_shapes("the record's micro-sequence and table")) check_embedding(49152, 50304, 768, 2);
}

TEST_CASE("weighted sum a x + b y: forward, backward with scalar gradients, strided x") {
  check_weighted_sum(512, 64, 64, 10);
  if (at_record_shapes("block lambdas at the record's shape")) check_weighted_sum(49152, 768, 768, 11);
  check_weighted_sum(4096, 768, 3 * 768, 12);   // the value mix on the v third of qkv
}

TEST_CASE("weighted sum without a or y; in-place unit dx; dy written, not accumulated") {
  const int T = 640, d = 128;
  std::vector<double> x = rounded_to_bf16(random_normal(size_t(T) * d, 20));
  std::vector<double> skip = rounded_to_bf16(random_normal(size_t(T) * d, 21));
  std::vector<double> dout = rounded_to_bf16(random_normal(size_t(T) * d, 22));
  DeviceBuffer<bf16> dx(to_bf16(x)), dskip(to_bf16(skip)), out(size_t(T) * d), dgrad(to_bf16(dout)), dy(size_t(T) * d);
  DeviceBuffer<float> w(std::vector<float>{0.625f, 0.0f}), scratch(kScalarReductionScratchFloats);
  out.poison();
  dy.poison();
  weighted_sum_forward(dx.get(), nullptr, dskip.get(), w.get(), out.get(), T, d, d, 0);
  // the skip: x_in = x + w skip; dx flows through unchanged (in place), dskip = w dout, dw += sum(dout skip)
  weighted_sum_backward(dgrad.get(), nullptr, nullptr, nullptr, dskip.get(), w.get(), w.get() + 1, dgrad.get(),
                        dy.get(), /*accumulate_dy=*/false, T, d, d, scratch.get(), 0);
  std::vector<double> out_ref(x.size()), dy_ref(x.size());
  double dw_ref = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    out_ref[i] = x[i] + 0.625 * skip[i];
    dy_ref[i] = 0.625 * dout[i];
    dw_ref += dout[i] * skip[i];
  }
  std::vector<double> out_gpu = to_double(out.download()), dy_gpu = to_double(dy.download());
  std::vector<double> dx_gpu = to_double(dgrad.download());
  CHECK_REL_ERROR(out_gpu, out_ref, kBf16Bound);
  CHECK_REL_ERROR(dy_gpu, dy_ref, kBf16Bound);
  CHECK(dx_gpu == dout);  // a unit in-place dx is left as it is
  CHECK_NEAR(w.download()[1], dw_ref, 1e-4 * std::fabs(dw_ref));
}

// The fused pass of a block's input against double loops that round to bf16 where the separate
// passes store: x_in = prev + w skip, x_mixed = l0 x_in + l1 x0, h = rmsnorm(x_mixed); with the
// skip and without (x_in read), at the model's width and a narrower one with unused lanes.
void check_mix_norm(int T, int d, bool with_skip, uint64_t seed) {
  std::printf("  mix + norm T=%d d=%d %s\n", T, d, with_skip ? "with the skip" : "without");
  const size_t n = size_t(T) * d;
  std::vector<double> prev = rounded_to_bf16(random_normal(n, seed)), skip = rounded_to_bf16(random_normal(n, seed + 1));
  std::vector<double> x0 = rounded_to_bf16(random_normal(n, seed + 2));
  const float w = 0.625f, l0 = 0.9f, l1 = 0.35f;
  DeviceBuffer<bf16> dprev(to_bf16(prev)), dskip(to_bf16(skip)), dx0(to_bf16(x0)), x_in(to_bf16(prev)), x_mixed(n),
      h(n);
  DeviceBuffer<float> scalars(std::vector<float>{w, l0, l1});
  x_mixed.poison();
  h.poison();
  std::vector<double> x_in_ref = prev;
  if (with_skip) {
    x_in.poison();
    for (size_t i = 0; i < n; ++i) x_in_ref[i] = prev[i] + double(w) * skip[i];
    x_in_ref = rounded_to_bf16(x_in_ref);
    mix_norm_forward(dprev.get(), dskip.get(), scalars.get(), x_in.get(), dx0.get(), scalars.get() + 1,
                     scalars.get() + 2, x_mixed.get(), h.get(), T, d, 0);
  } else {  // x_in is the input
    mix_norm_forward(nullptr, nullptr, nullptr, x_in.get(), dx0.get(), scalars.get() + 1, scalars.get() + 2,
                     x_mixed.get(), h.get(), T, d, 0);
  }
  std::vector<double> mixed_ref(n), h_ref(n);
  for (size_t i = 0; i < n; ++i) mixed_ref[i] = double(l0) * x_in_ref[i] + double(l1) * x0[i];
  mixed_ref = rounded_to_bf16(mixed_ref);
  for (int t = 0; t < T; ++t) {
    double ss = 0;
    for (int c = 0; c < d; ++c) ss += mixed_ref[size_t(t) * d + c] * mixed_ref[size_t(t) * d + c];
    const double inv = 1 / std::sqrt(ss / d + kRmsEps);
    for (int c = 0; c < d; ++c) h_ref[size_t(t) * d + c] = mixed_ref[size_t(t) * d + c] * inv;
  }
  std::vector<double> x_in_gpu = to_double(x_in.download()), mixed_gpu = to_double(x_mixed.download()),
                      h_gpu = to_double(h.download());
  CHECK_REL_ERROR(x_in_gpu, x_in_ref, kBf16Bound);
  CHECK_REL_ERROR(mixed_gpu, mixed_ref, kBf16Bound);
  CHECK_REL_ERROR(h_gpu, h_ref, kBf16Bound);
}

// Its backward against double loops that round where the separate passes store: g = bf16(dx +
// rmsnorm'(x_mixed) dh), dl0 += g . x_in, dl1 += g . x0, dx0 = bf16(dx0 + l1 g), dx = bf16(l0 g); with
// the skip dw += dx . skip, dskip = bf16(w dx). Scalar gradients accumulate onto prior values.
// plus: what is added to dx as it is written: nothing, another buffer's gradient, or (with the
// skip) the pass's own dskip; first_block: x_in is x0 itself (its gradient joins dx0's, dx is left).
enum class DxPlus { none, other, own_dskip, first_block };

void check_mix_norm_backward(int T, int d, bool with_skip, uint64_t seed, DxPlus plus = DxPlus::none) {
  std::printf("  mix + norm backward T=%d d=%d %s%s\n", T, d, with_skip ? "with the skip" : "without",
              plus == DxPlus::other       ? ", plus another gradient"
              : plus == DxPlus::own_dskip ? ", plus its own dskip"
              : plus == DxPlus::first_block ? ", the first block (x_in is x0)"
                                            : "");
  const bool first_block = plus == DxPlus::first_block;
  const size_t n = size_t(T) * d;
  auto random_bf16 = [&](uint64_t s) { return rounded_to_bf16(random_normal(n, seed + s)); };
  const std::vector<double> x_mixed = random_bf16(0), dh = random_bf16(1), x0 = random_bf16(3),
                            x_in = first_block ? x0 : random_bf16(2),
                            skip = random_bf16(4), dx_in = random_bf16(5), dx0_in = random_bf16(6),
                            other = random_bf16(7);
  const float l0 = 0.9f, l1 = 0.35f, w = 0.625f;
  DeviceBuffer<bf16> dx_mixed(to_bf16(x_mixed)), ddh(to_bf16(dh)), dx(to_bf16(dx_in)), dx_in_(to_bf16(x_in)),
      dx0_(to_bf16(x0)), dx0(to_bf16(dx0_in)), dskip_src(to_bf16(skip)), dskip(n), dother(to_bf16(other));
  dskip.poison();
  DeviceBuffer<float> scalars(std::vector<float>{l0, l1, w, 0.25f, -0.5f, 0.75f}), scratch(kScalarReductionScratchFloats);
  float* s = scalars.get();
  mix_norm_backward(dx_mixed.get(), ddh.get(), dx.get(), first_block ? dx0_.get() : dx_in_.get(), dx0_.get(), s, s + 3,
                    s + 1, s + 4, dx0.get(),
                    with_skip ? dskip_src.get() : nullptr, with_skip ? s + 2 : nullptr, with_skip ? s + 5 : nullptr,
                    with_skip ? dskip.get() : nullptr,
                    plus == DxPlus::other ? dother.get() : plus == DxPlus::own_dskip ? dskip.get() : nullptr, T, d,
                    scratch.get(), 0);
  std::vector<double> dx_ref(n), dx0_ref(n), dskip_ref(n), scalar_ref{0.25, -0.5, 0.75};
  for (int t = 0; t < T; ++t) {
    const size_t row = size_t(t) * d;
    double ss = 0, dot = 0;
    for (int c = 0; c < d; ++c) ss += x_mixed[row + c] * x_mixed[row + c], dot += x_mixed[row + c] * dh[row + c];
    const double inv = 1 / std::sqrt(ss / d + kRmsEps), mean_dot = dot / d;
    for (int c = 0; c < d; ++c) {
      const size_t i = row + c;
      const double g = rounded_to_bf16(std::vector<double>{dx_in[i] + inv * dh[i] - inv * inv * inv * x_mixed[i] * mean_dot})[0];
      scalar_ref[0] += g * x_in[i];
      scalar_ref[1] += g * x0[i];
      dx0_ref[i] = dx0_in[i] + double(l1) * g;
      dx_ref[i] = rounded_to_bf16(std::vector<double>{double(l0) * g})[0];
      scalar_ref[2] += with_skip ? dx_ref[i] * skip[i] : 0.0;
      dskip_ref[i] = double(w) * dx_ref[i];
      if (plus == DxPlus::other) dx_ref[i] += other[i];
      if (plus == DxPlus::own_dskip) dx_ref[i] += rounded_to_bf16(std::vector<double>{dskip_ref[i]})[0];
      if (first_block) {  // dx0 gets x_in's gradient as add_into added it; dx keeps what it held
        dx0_ref[i] = rounded_to_bf16(std::vector<double>{dx0_ref[i]})[0] + dx_ref[i];
        dx_ref[i] = dx_in[i];
      }
    }
  }
  std::vector<double> dx_gpu = to_double(dx.download()), dx0_gpu = to_double(dx0.download());
  CHECK_REL_ERROR(dx_gpu, dx_ref, kBf16Bound);
  CHECK_REL_ERROR(dx0_gpu, dx0_ref, kBf16Bound);
  if (with_skip) {
    std::vector<double> dskip_gpu = to_double(dskip.download());
    CHECK_REL_ERROR(dskip_gpu, dskip_ref, kBf16Bound);
  }
  std::vector<float> got = scalars.download();
  std::vector<double> scalar_gpu{got[3], got[4], got[5]};
  if (!with_skip) scalar_gpu.pop_back(), scalar_ref.pop_back();
  CHECK_REL_ERROR(scalar_gpu, scalar_ref, kFp32FromBf16Bound);
}

TEST_CASE("a block's input in one pass: skip, lambda mix and RMS norm") {
  check_mix_norm(1000, 768, true, 40);
  check_mix_norm(1000, 768, false, 50);
  check_mix_norm(37, 200, true, 60);
  check_mix_norm(300, 1024, true, 61);   // 4 vectors a lane
  check_mix_norm(300, 392, false, 62);   // 2
  DeviceBuffer<bf16> x(768), y(768);
  DeviceBuffer<float> s(std::vector<float>{1.0f, 1.0f});
  CHECK_THROWS_WITH(mix_norm_forward(x.get(), nullptr, nullptr, x.get(), x.get(), s.get(), s.get(), y.get(), y.get(), 1,
                                     768, 0),
                    "mix_norm_forward: prev, skip and w go together");
}

TEST_CASE("the backward of a block's input in one pass, scalar gradients in a fixed order") {
  check_mix_norm_backward(1000, 768, true, 70);
  check_mix_norm_backward(1000, 768, false, 80);
  check_mix_norm_backward(37, 200, true, 90);
  check_mix_norm_backward(300, 1024, true, 91);  // 4 vectors a lane
  check_mix_norm_backward(300, 392, false, 92);  // 2
  check_mix_norm_backward(5000, 768, true, 100);  // more rows than the grid's warps
  // the gradient through a skip added as dx is written (it was a separate add_into pass)
  check_mix_norm_backward(1000, 768, false, 110, DxPlus::other);
  check_mix_norm_backward(1000, 768, true, 120, DxPlus::other);
  check_mix_norm_backward(1000, 768, true, 130, DxPlus::own_dskip);
  check_mix_norm_backward(1000, 768, false, 140, DxPlus::first_block);
  DeviceBuffer<bf16> x(768);
  DeviceBuffer<float> s(std::vector<float>(8, 1.0f));
  CHECK_THROWS_WITH(mix_norm_backward(x.get(), x.get(), x.get(), x.get(), x.get(), s.get(), s.get() + 1, s.get(),
                                      s.get() + 2, x.get(), nullptr, nullptr, nullptr, nullptr, x.get(), 1, 768,
                                      s.get(), 0),
                    "mix_norm_backward: dx_plus may be dskip, not an output it would read as written");
}

TEST_CASE("add_into: dst += src") {
  const size_t n = 768 * 1000;
  std::vector<double> src = rounded_to_bf16(random_normal(n, 30)), dst = rounded_to_bf16(random_normal(n, 31));
  DeviceBuffer<bf16> dsrc(to_bf16(src)), ddst(to_bf16(dst));
  add_into(dsrc.get(), ddst.get(), n, 0);
  std::vector<double> ref(n);
  for (size_t i = 0; i < n; ++i) ref[i] = src[i] + dst[i];
  std::vector<double> out = to_double(ddst.download());
  CHECK_REL_ERROR(out, ref, kBf16Bound);
}

int main(int argc, char** argv) { return run_gpu_checks(argc, argv); }
