// The pointwise, normalisation, loss, matmul and optimizer kernels against the CPU reference
// (tests/reference/) on fresh random inputs, at small and record shapes, outputs poisoned first.
// Bounds (../.library/device/METHOD.md): bf16 outputs 5e-3 (one bf16 rounding is ~2e-3), fp32
// outputs from bf16 operands 1e-4, pure fp32 arithmetic 1e-5.
#include "gpu/gpu_test.h"
#include "kernels/activations.cuh"
#include "kernels/cross_entropy.cuh"
#include "kernels/gemm_epilogue.cuh"
#include "kernels/matmul.cuh"
#include "kernels/norms.cuh"
#include "kernels/optimizers.cuh"
#include "kernels/qkv_epilogue.cuh"
#include "kernels/rope.cuh"
#include "reference/optim.h"

namespace {

constexpr double kBf16Bound = 5e-3, kFp32FromBf16Bound = 1e-4, kFp32Bound = 1e-5;

// Rows [first, first + count) of a row-major [rows, cols] matrix.
std::vector<double> rows_of(const std::vector<double>& m, int cols, int first, int count) {
  return std::vector<double>(m.begin() + size_t(first) * cols, m.begin() + size_t(first + count) * cols);
}

// The three products of a linear layer at tokens x in -> out; the CPU checks `check_rows` rows.
void check_linear_layer(int tokens, int in, int out, int check_rows, uint64_t seed) {
  std::printf("  linear %d x %d -> %d\n", tokens, in, out);
  std::vector<double> x = rounded_to_bf16(random_normal(size_t(tokens) * in, seed));
  std::vector<double> w = rounded_to_bf16(random_normal(size_t(out) * in, seed + 1, 0.02));
  std::vector<double> dy = rounded_to_bf16(random_normal(size_t(tokens) * out, seed + 2));
  DeviceBuffer<bf16> dx_in(to_bf16(x)), dw_in(to_bf16(w)), ddy(to_bf16(dy));
  DeviceBuffer<bf16> y(size_t(tokens) * out), dx(size_t(tokens) * in);
  DeviceBuffer<float> dw(size_t(out) * in);
  y.poison();
  dx.poison();
  std::vector<double> dw_prior = random_normal(size_t(out) * in, seed + 3);  // beta = 1 accumulates onto it
  std::vector<float> dw_prior_f(dw_prior.begin(), dw_prior.end());
  dw.upload(dw_prior_f);
  Matmul matmul;
  matmul(dx_in.get(), Transpose::N, dw_in.get(), Transpose::T, y.get(), tokens, out, in, CUDA_R_16BF, 0);
  matmul(ddy.get(), Transpose::N, dw_in.get(), Transpose::N, dx.get(), tokens, in, out, CUDA_R_16BF, 0);
  matmul(ddy.get(), Transpose::T, dx_in.get(), Transpose::N, dw.get(), out, in, tokens, CUDA_R_32F, 0, 1.0f, 1.0f);
  std::vector<double> y_gpu = to_double(y.download()), dx_gpu = to_double(dx.download()), dw_gpu = to_double(dw.download());
  // The forward with a residual read from its own buffer (MatmulOptions::addend): r + x W^T.
  std::vector<double> residual = rounded_to_bf16(random_normal(size_t(tokens) * out, seed + 4));
  DeviceBuffer<bf16> d_residual(to_bf16(residual)), y_plus(size_t(tokens) * out);
  y_plus.poison();
  MatmulOptions plus_residual;
  plus_residual.addend = d_residual.get();
  matmul(dx_in.get(), Transpose::N, dw_in.get(), Transpose::T, y_plus.get(), tokens, out, in, CUDA_R_16BF,
         plus_residual, 0, 1.0f, 1.0f);
  std::vector<double> y_plus_gpu = to_double(y_plus.download());
  CHECK(to_double(d_residual.download()) == residual);  // read, not written

  int first = (tokens - check_rows) / 2;  // rows in the middle: not only the first tile
  std::vector<double> x_rows = rows_of(x, in, first, check_rows), dy_rows = rows_of(dy, out, first, check_rows);
  std::vector<double> y_ref(size_t(check_rows) * out), dx_ref(size_t(check_rows) * in), dw_scratch(w.size(), 0.0);
  ref::matmul_nt(x_rows.data(), w.data(), y_ref.data(), check_rows, in, out);
  ref::matmul_nt_backward(x_rows.data(), w.data(), dy_rows.data(), dx_ref.data(), dw_scratch.data(), check_rows, in, out);
  std::vector<double> y_rows = rows_of(y_gpu, out, first, check_rows), dx_rows = rows_of(dx_gpu, in, first, check_rows);
  CHECK_REL_ERROR(y_rows, y_ref, kBf16Bound);
  CHECK_REL_ERROR(dx_rows, dx_ref, kBf16Bound);
  std::vector<double> y_plus_ref = rows_of(residual, out, first, check_rows);
  for (size_t i = 0; i < y_plus_ref.size(); ++i) y_plus_ref[i] += y_ref[i];
  std::vector<double> y_plus_rows = rows_of(y_plus_gpu, out, first, check_rows);
  CHECK_REL_ERROR(y_plus_rows, y_plus_ref, kBf16Bound);
  // dW needs every token: check `check_rows` output rows of it over the whole batch.
  int wrows = std::min(check_rows, out);
  std::vector<double> dw_ref = rows_of(dw_prior, in, 0, wrows);
  for (int o = 0; o < wrows; ++o)
    for (int t = 0; t < tokens; ++t)
      for (int k = 0; k < in; ++k) dw_ref[size_t(o) * in + k] += dy[size_t(t) * out + o] * x[size_t(t) * in + k];
  std::vector<double> dw_rows = rows_of(dw_gpu, in, 0, wrows);
  CHECK_REL_ERROR(dw_rows, dw_ref, kFp32FromBf16Bound);
  CHECK(all_finite(y_gpu) && all_finite(dx_gpu) && all_finite(dw_gpu) && all_finite(y_plus_gpu));  // all written
}

// C = A B^T for `batches` products whose operands start 16 bytes into their buffers and lie 16 bytes
// more than a whole matrix apart: slices cuBLASLt's default alignment (256 bytes) does not cover.
void check_sliced_matmul(int batches, uint64_t seed) {
  constexpr int M = 64, N = 48, K = 96;
  constexpr int64_t bf16_pad = 8, fp32_pad = 4;  // 16 bytes each
  const int64_t stride_a = int64_t(M) * K + bf16_pad, stride_b = int64_t(N) * K + bf16_pad,
                stride_c = int64_t(M) * N + fp32_pad;
  std::printf("  %d product(s) %d x %d x %d, operands 16-byte aligned\n", batches, M, N, K);
  std::vector<double> a = rounded_to_bf16(random_normal(bf16_pad + batches * stride_a, seed));
  std::vector<double> b = rounded_to_bf16(random_normal(bf16_pad + batches * stride_b, seed + 1));
  DeviceBuffer<bf16> d_a(to_bf16(a)), d_b(to_bf16(b));
  DeviceBuffer<float> d_c(fp32_pad + batches * stride_c);
  d_c.poison();
  MatmulOptions sliced;
  sliced.batch = MatmulBatch{batches, stride_a, stride_b, stride_c};
  Matmul matmul;
  matmul(d_a.get() + bf16_pad, Transpose::N, d_b.get() + bf16_pad, Transpose::T, d_c.get() + fp32_pad, M, N, K,
         CUDA_R_32F, sliced, 0);
  std::vector<float> c = d_c.download();
  for (int i = 0; i < batches; ++i) {
    std::vector<double> a_i(a.begin() + bf16_pad + i * stride_a, a.begin() + bf16_pad + i * stride_a + M * K);
    std::vector<double> b_i(b.begin() + bf16_pad + i * stride_b, b.begin() + bf16_pad + i * stride_b + N * K);
    std::vector<double> c_ref(size_t(M) * N);
    ref::matmul_nt(a_i.data(), b_i.data(), c_ref.data(), M, K, N);
    std::vector<double> c_i(c.begin() + fp32_pad + i * stride_c, c.begin() + fp32_pad + i * stride_c + M * N);
    CHECK_REL_ERROR(c_i, c_ref, kFp32FromBf16Bound);
    CHECK(all_finite(c_i));  // all written
  }
  CHECK(std::isnan(c[0]));  // nothing written before the slice
}

__global__ void exp2_fma_kernel(const float* x, float* y, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = exp2_fma(x[i]);
}

}  // namespace

TEST_CASE("exp2 on the FMA pipe: within 4 ulp of 2^x over [-126, 127], NaN kept") {
  std::vector<float> x;
  for (int j = -126; j <= 127; ++j)  // the ends, integers and half-way points of every binade
    for (float f : {0.0f, 0.5f, -0.5f, 0.25f, 1e-7f, 0.4999999f, -0.4999999f}) x.push_back(float(j) + f);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> anywhere(-126.0f, 127.0f), unit(-1.0f, 1.0f);
  for (int i = 0; i < 200000; ++i) x.push_back(i % 2 ? anywhere(rng) : unit(rng));
  x.erase(std::remove_if(x.begin(), x.end(), [](float v) { return v < -126.0f || v > 127.0f; }), x.end());
  x.push_back(std::numeric_limits<float>::quiet_NaN());
  DeviceBuffer<float> dx(x), dy(x.size());
  dy.poison();
  exp2_fma_kernel<<<64, 256>>>(dx.get(), dy.get(), int(x.size()));
  CUDA_CHECK_LAUNCH();
  const std::vector<float> y = dy.download();
  double worst = 0, worst_at = 0;
  for (size_t i = 0; i + 1 < x.size(); ++i) {
    const double rel = std::fabs(double(y[i]) / std::exp2(double(x[i])) - 1);
    if (!(rel <= worst)) worst = rel, worst_at = x[i];
  }
  std::printf("  largest relative error %.3e (%.2f ulp) at x = %.7g over %zu points\n", worst, worst / 0x1p-24,
              worst_at, x.size() - 1);
  CHECK(worst <= 4 * 0x1p-24);
  CHECK(std::isnan(y.back()));
}

TEST_CASE("matmul on slices aligned to 16 bytes, not 256: one product and a strided batch") {
  check_sliced_matmul(1, 11);
  check_sliced_matmul(3, 12);
}

TEST_CASE("matmul: forward (plain and onto a residual), input and weight gradients of a linear layer") {
  check_linear_layer(256, 768, 3072, 256, 1);
  check_linear_layer(96, 3072, 768, 96, 2);
  if (at_record_shapes("the record's qkv projection")) check_linear_layer(49152, 768, 2304, 48, 3);
}

TEST_CASE("rmsnorm forward and backward (accumulating), rows of 768, 128, 1024 and 392 (3, 1, 4, 2 vectors a lane)") {
  for (auto [rows, n] : std::vector<std::pair<int, int>>{{4096, 768}, {3000, 128}, {1000, 1024}, {1000, 392}}) {
    std::printf("  %d rows of %d\n", rows, n);
    std::vector<double> x = rounded_to_bf16(random_normal(size_t(rows) * n, 10 + n, 3.0));
    std::vector<double> dy = rounded_to_bf16(random_normal(x.size(), 11 + n));
    std::vector<double> prior = rounded_to_bf16(random_normal(x.size(), 12 + n));
    DeviceBuffer<bf16> dx_(to_bf16(x)), ddy(to_bf16(dy)), y(x.size()), dx(to_bf16(prior));
    y.poison();
    rmsnorm_forward(dx_.get(), y.get(), rows, n, 0);
    rmsnorm_backward(dx_.get(), ddy.get(), dx.get(), rows, n, /*accumulate=*/true, 0);
    std::vector<double> y_ref(x.size()), dx_ref = prior;
    ref::rmsnorm(x.data(), y_ref.data(), rows, n, kRmsEps);
    ref::rmsnorm_backward(x.data(), dy.data(), dx_ref.data(), rows, n, kRmsEps);
    std::vector<double> y_gpu = to_double(y.download()), dx_gpu = to_double(dx.download());
    CHECK_REL_ERROR(y_gpu, y_ref, kBf16Bound);
    CHECK_REL_ERROR(dx_gpu, dx_ref, kBf16Bound);
  }
}

TEST_CASE("relu^2 forward and backward (relu(u) from u, and from a = relu(u)^2 in place)") {
  const size_t n = size_t(4096) * 3072;
  std::vector<double> u = rounded_to_bf16(random_normal(n, 20)), da = rounded_to_bf16(random_normal(n, 21));
  DeviceBuffer<bf16> du_(to_bf16(u)), dda(to_bf16(da)), a(n), du(n), du_from_a(to_bf16(da));
  a.poison();
  du.poison();
  relu_squared_forward(du_.get(), a.get(), n, 0);
  relu_squared_backward(du_.get(), dda.get(), du.get(), n, 0);
  relu_squared_backward_from_square(a.get(), du_from_a.get(), du_from_a.get(), n, 0);  // the fused epilogue's reference
  std::vector<double> a_ref(n), du_ref(n);
  for (size_t i = 0; i < n; ++i) {
    a_ref[i] = u[i] > 0 ? u[i] * u[i] : 0.0;
    du_ref[i] = u[i] > 0 ? 2 * u[i] * da[i] : 0.0;
  }
  std::vector<double> a_gpu = to_double(a.download()), du_gpu = to_double(du.download());
  CHECK_REL_ERROR(a_gpu, a_ref, kBf16Bound);
  CHECK_REL_ERROR(du_gpu, du_ref, kBf16Bound);
  CHECK_REL_ERROR(to_double(du_from_a.download()), du_ref, kBf16Bound);
}

// Our GEMM (TMA, warp-specialised wgmma) against double loops, B K-major (C = A B^T) and N-major
// (C = A B), plain and with the MLP's ReLU² epilogues (forward: relu(A B^T)^2; backward: (A B) 2
// sqrt(a), in place over a as it may run): 12 output tiles of 128 x 256 (more than the emulator's 8
// SMs: CTAs walk several, their TMA stores from one staging tile each) and 5 k blocks (more than the
// 3 stages: the ring wraps), outputs poisoned; shapes off the tiles and misaligned starts refused.
namespace {

// Our GEMM's epilogue staging alone: one consumer warpgroup's accumulators, set to small integers
// (exact in bf16) by their fragment position, staged by the Identity epilogue (stmatrix, not
// transposed) and read back element by element: each must land where swizzled<64>(row, col) says,
// where the TMA stores read it. On a GPU this checks the emulator's reading of stmatrix's layout.
__host__ __device__ float staged_test_value(int row, int col) { return float((row * 131 + col * 7) % 255 - 127); }

__global__ void stage_output_tile_kernel(float* out) {
  using namespace gemm_epilogue;
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* staging = align_to_swizzle_atom(shared_tiles);
  float acc[kTileCols / 8][4];
  for (int n = 0; n < kTileCols / 8; ++n)
    for (int e = 0; e < 4; ++e) acc[n][e] = staged_test_value(warpgroup_fragment_row(e), fragment_col(n, e));
  Identity{}.store(acc, TileOutput{staging, 0, 0, kTileCols});
  __syncthreads();
  for (int i = threadIdx.x; i < kOutputRows * kTileCols; i += blockDim.x)
    out[i] = __bfloat162float(staging[swizzled<kOutputRows>(i / kTileCols, i % kTileCols)]);
}

}  // namespace

TEST_CASE("gemm's epilogue staging: stmatrix's stores put every accumulator where the output tile's layout says") {
  using namespace gemm_epilogue;
  DeviceBuffer<float> out(size_t(kOutputRows) * kTileCols);
  out.poison();
  const size_t smem = size_t(kOutputRows) * kTileCols * sizeof(bf16) + kSwizzleAtomBytes;
  CUDA_CHECK(cudaFuncSetAttribute(stage_output_tile_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  stage_output_tile_kernel<<<1, 128, smem>>>(out.get());
  CUDA_CHECK_LAUNCH();
  const std::vector<float> got = out.download();
  int wrong = 0;
  for (int r = 0; r < kOutputRows; ++r)
    for (int c = 0; c < kTileCols; ++c)
      if (got[r * kTileCols + c] != staged_test_value(r, c) && wrong++ < 5)
        std::printf("staged (row %d, column %d): %g, want %g\n", r, c, got[r * kTileCols + c], staged_test_value(r, c));
  CHECK(wrong == 0);
}

TEST_CASE("gemm with an epilogue: A B^T, relu(A B^T)^2, A B, (A B) 2 sqrt(a) (12 tiles, 5 k blocks)") {
  using namespace gemm_epilogue;
  const int M = 512, N = 768, K = 320;
  const std::vector<double> a = rounded_to_bf16(random_normal(size_t(M) * K, 30)),
                            b = rounded_to_bf16(random_normal(size_t(N) * K, 31, 1.0 / std::sqrt(double(K))));
  std::vector<double> b_t(b.size()), square(size_t(M) * N);  // B as [K, N]; a ReLU² output
  for (int j = 0; j < N; ++j)
    for (int k = 0; k < K; ++k) b_t[size_t(k) * N + j] = b[size_t(j) * K + k];
  const std::vector<double> r = random_normal(square.size(), 32);
  for (size_t i = 0; i < square.size(); ++i) square[i] = r[i] > 0 ? r[i] * r[i] : 0.0;
  square = rounded_to_bf16(square);
  DeviceBuffer<bf16> a_dev(to_bf16(a)), b_dev(to_bf16(b)), b_t_dev(to_bf16(b_t)), c(square.size()),
      c_relu(square.size()), c_nn(square.size()), du(to_bf16(square));
  for (auto* out : {&c, &c_relu, &c_nn}) out->poison();
  gemm<BLayout::k_major>(a_dev.get(), b_dev.get(), c.get(), M, N, K, Identity{}, 0);
  matmul_relu_squared(a_dev.get(), b_dev.get(), c_relu.get(), M, N, K, 0);
  gemm<BLayout::n_major>(a_dev.get(), b_t_dev.get(), c_nn.get(), M, N, K, Identity{}, 0);
  matmul_relu_squared_backward(a_dev.get(), b_t_dev.get(), du.get(), du.get(), M, N, K, 0);
  std::vector<double> c_ref(square.size()), relu_ref(square.size()), du_ref(square.size());
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      double sum = 0;
      for (int k = 0; k < K; ++k) sum += a[size_t(i) * K + k] * b[size_t(j) * K + k];
      const size_t at = size_t(i) * N + j;
      c_ref[at] = sum;
      relu_ref[at] = sum > 0 ? sum * sum : 0.0;
      du_ref[at] = sum * 2 * std::sqrt(square[at]);
    }
  CHECK_REL_ERROR(to_double(c.download()), c_ref, kBf16Bound);
  CHECK_REL_ERROR(to_double(c_relu.download()), relu_ref, kBf16Bound);
  CHECK_REL_ERROR(to_double(c_nn.download()), c_ref, kBf16Bound);
  CHECK_REL_ERROR(to_double(du.download()), du_ref, kBf16Bound);
  CHECK_THROWS_WITH(matmul_relu_squared(a_dev.get(), b_dev.get(), c_relu.get(), M, N, 96, 0),
                    "gemm with epilogue: 512x768x96 (M x N x K) must be multiples of 128 x 256 x 64");
  CHECK_THROWS_WITH(matmul_relu_squared(a_dev.get() + 1, b_dev.get(), c_relu.get(), M, N, K, 0),
                    "gemm with epilogue: A, B and C must start 16-byte aligned");
  CHECK_THROWS_WITH(matmul_relu_squared(a_dev.get(), b_dev.get(), c_relu.get() + 4, M, N, K, 0),
                    "gemm with epilogue: A, B and C must start 16-byte aligned");
  CHECK_THROWS_WITH(matmul_relu_squared_backward(a_dev.get(), b_t_dev.get(), du.get() + 1, du.get(), M, N, K, 0),
                    "ReLU²'s backward reads a, which must start 4-byte aligned");
}

// The qkv product with QK norm, RoPE and the value mix in its epilogue (--qkv fused) against the
// passes it replaces, run on our plain product's raw qkv: the raw qkv bitwise the plain product's,
// q, k and v within bf16 rounding (the norm's sum of squares runs in another order); with the value
// embedding and without. d = 256 (a tile each of q, k and v: 9 tiles, more than the emulator's 8
// SMs) and the record's 768 (tiles that start 256 and 512 columns into q, k or v), every output
// poisoned.
void check_qkv_epilogue(int T, int d) {
  using namespace gemm_epilogue;
  std::printf("  T = %d, d = %d\n", T, d);
  const int H = d / kRopeHeadDim;
  const std::vector<double> h = rounded_to_bf16(random_normal(size_t(T) * d, 60)),
                            w = rounded_to_bf16(random_normal(size_t(3) * d * d, 61, 1.0 / std::sqrt(double(d)))),
                            ve = rounded_to_bf16(random_normal(size_t(T) * d, 62));
  std::vector<float> cos_sin;
  rope_table_host(T, cos_sin);
  DeviceBuffer<bf16> h_dev(to_bf16(h)), w_dev(to_bf16(w)), ve_dev(to_bf16(ve)), plain(size_t(T) * 3 * d),
      qkv(size_t(T) * 3 * d), q(size_t(T) * d), k(size_t(T) * d), v(size_t(T) * d), q_ref(size_t(T) * d),
      k_ref(size_t(T) * d), v_ref(size_t(T) * d);
  DeviceBuffer<float> table(cos_sin), sa0(std::vector<float>{0.75f}), sa1(std::vector<float>{-0.375f});
  gemm<BLayout::k_major>(h_dev.get(), w_dev.get(), plain.get(), T, 3 * d, d, Identity{}, 0);
  qk_norm_rope_forward(plain.get(), table.get(), q_ref.get(), k_ref.get(), T, H, 0);
  for (const bf16* value_embedding : {(const bf16*)ve_dev.get(), (const bf16*)nullptr}) {
    std::printf("  %s\n", value_embedding ? "with the value embedding" : "without");
    for (auto* out : {&qkv, &q, &k, &v, &v_ref}) out->poison();
    weighted_sum_forward(plain.get() + 2 * d, sa0.get(), value_embedding, sa1.get(), v_ref.get(), T, d, 3 * d, 0);
    matmul_qkv_norm_rope(h_dev.get(), w_dev.get(), qkv.get(), q.get(), k.get(), v.get(), table.get(), sa0.get(),
                         value_embedding, sa1.get(), T, d, 0);
    CHECK(to_double(qkv.download()) == to_double(plain.download()));
    CHECK_REL_ERROR(to_double(q.download()), to_double(q_ref.download()), 1e-3);
    CHECK_REL_ERROR(to_double(k.download()), to_double(k_ref.download()), 1e-3);
    CHECK_REL_ERROR(to_double(v.download()), to_double(v_ref.download()), 1e-3);
  }
}

TEST_CASE("qkv with its epilogue: the raw qkv, q and k normalised and rotated, v mixed, as the passes make them") {
  check_qkv_epilogue(384, 256);
  check_qkv_epilogue(128, 768);
  const int T = 256, d = 256;
  DeviceBuffer<bf16> h(size_t(T) * d), w(size_t(3) * d * d), qkv(size_t(T) * 3 * d), q(size_t(T) * d),
      k(size_t(T) * d), v(size_t(T) * d);
  DeviceBuffer<float> table(size_t(T) * kRopeHeadDim), sa0(1), sa1(1);
  CHECK_THROWS_WITH(matmul_qkv_norm_rope(h.get(), w.get(), qkv.get(), q.get(), k.get(), v.get(), table.get(), sa0.get(),
                                         nullptr, sa1.get(), 2 * T, d / 2, 0),
                    "qkv with its epilogue: d = 128 must be a multiple of 256");
}

TEST_CASE("softcapped cross-entropy: token losses and the in-place gradient, vocab 50304 and 96") {
  for (auto [T, V] : std::vector<std::pair<int, int>>{{128, 50304}, {512, 96}}) {
    std::vector<double> logits = rounded_to_bf16(random_normal(size_t(T) * V, 30 + V, 150.0));
    std::vector<uint16_t> targets(T);
    std::mt19937 rng(31);
    for (uint16_t& t : targets) t = uint16_t(rng() % V);
    DeviceBuffer<bf16> dlogits(to_bf16(logits)), eval_logits(to_bf16(logits));
    DeviceBuffer<uint16_t> dtargets(targets);
    DeviceBuffer<float> losses(T), eval_losses(T);
    losses.poison();
    eval_losses.poison();
    softcap_cross_entropy(dlogits.get(), dtargets.get(), losses.get(), T, V, 1.0f, 0);
    softcap_cross_entropy(eval_logits.get(), dtargets.get(), eval_losses.get(), T, V, 0.0f, 0);
    std::vector<double> loss_ref(T), grad_ref(logits.size());
    Softcap sc;
    ref::softcap_cross_entropy(logits.data(), targets.data(), T, V, sc.cap, 7.5 * std::sqrt(768.0), loss_ref.data(),
                               grad_ref.data());
    std::vector<double> loss_gpu = to_double(losses.download()), grad_gpu = to_double(dlogits.download());
    std::vector<double> eval_gpu = to_double(eval_losses.download()), untouched = to_double(eval_logits.download());
    CHECK_REL_ERROR(loss_gpu, loss_ref, kFp32Bound);
    CHECK_REL_ERROR(grad_gpu, grad_ref, kBf16Bound);
    CHECK(eval_gpu == loss_gpu);
    CHECK(untouched == logits);  // evaluation leaves the logits alone
  }
}

TEST_CASE("qk-norm + half-truncated rope forward and backward, 6 heads of 128") {
  const int T = 1024, H = 6, I = H * kRopeHeadDim;
  std::vector<double> qkv = rounded_to_bf16(random_normal(size_t(T) * 3 * I, 40, 2.0));
  std::vector<double> dq = rounded_to_bf16(random_normal(size_t(T) * I, 41)), dk = rounded_to_bf16(random_normal(size_t(T) * I, 42));
  std::vector<float> cos_sin;
  rope_table_host(T, cos_sin);
  DeviceBuffer<bf16> dqkv_in(to_bf16(qkv)), ddq(to_bf16(dq)), ddk(to_bf16(dk)), q(size_t(T) * I), k(size_t(T) * I);
  DeviceBuffer<bf16> dqkv(qkv.size());
  DeviceBuffer<float> dcos(cos_sin);
  q.poison();
  k.poison();
  dqkv.poison();
  qk_norm_rope_forward(dqkv_in.get(), dcos.get(), q.get(), k.get(), T, H, 0);
  qk_norm_rope_backward(dqkv_in.get(), ddq.get(), ddk.get(), dcos.get(), dqkv.get(), T, H, 0);
  std::vector<double> q_gpu = to_double(q.download()), k_gpu = to_double(k.download()), dqkv_gpu = to_double(dqkv.download());
  for (int which = 0; which < 2; ++which) {
    std::vector<double> raw = ref::qkv_part(qkv, T, I, which), normed(raw.size()), d_raw(raw.size(), 0.0);
    ref::rmsnorm(raw.data(), normed.data(), T * H, kRopeHeadDim, kRmsEps);
    ref::rope(normed.data(), T, H, kRopeHeadDim, false);
    std::vector<double> g = which == 0 ? dq : dk;
    ref::rope(g.data(), T, H, kRopeHeadDim, true);
    ref::rmsnorm_backward(raw.data(), g.data(), d_raw.data(), T * H, kRopeHeadDim, kRmsEps);
    std::vector<double> fwd_gpu = which == 0 ? q_gpu : k_gpu, bwd_gpu = ref::qkv_part(dqkv_gpu, T, I, which);
    CHECK_REL_ERROR(fwd_gpu, normed, kBf16Bound);
    CHECK_REL_ERROR(bwd_gpu, d_raw, kBf16Bound);
  }
}

TEST_CASE("adam on a flat slice: fp32 and bf16 (embedding) states, grad scale 1/M fused") {
  const int64_t n = 6288 * 768;
  std::vector<double> p0 = random_normal(n, 50), m0 = random_normal(n, 51, 0.01), v0 = random_normal(n, 52, 1e-4);
  for (double& v : v0) v = std::fabs(v);
  std::vector<double> g = random_normal(n, 53, 8.0);
  AdamStep step{0.6f};
  step.t = 3;
  step.grad_scale = 1.0f / 8;
  // fp32 parameter, gradient and states.
  std::vector<float> pf(p0.begin(), p0.end()), mf(m0.begin(), m0.end()), vf(v0.begin(), v0.end()), gf(g.begin(), g.end());
  DeviceBuffer<float> dp(pf), dm(mf), dv(vf), dg(gf);
  adam_update(dp.get(), dg.get(), dm.get(), dv.get(), n, step, 0);
  std::vector<double> p_ref(pf.begin(), pf.end()), m_ref(mf.begin(), mf.end()), v_ref(vf.begin(), vf.end()), g_ref(n);
  for (int64_t i = 0; i < n; ++i) g_ref[i] = double(gf[i]) / 8;
  AdamConfig cfg;
  adam_update(p_ref.data(), g_ref.data(), m_ref.data(), v_ref.data(), n, step.lr, step.t, cfg);
  std::vector<double> p_gpu = to_double(dp.download()), m_gpu = to_double(dm.download()), v_gpu = to_double(dv.download());
  CHECK_REL_ERROR(p_gpu, p_ref, kFp32Bound);
  CHECK_REL_ERROR(m_gpu, m_ref, kFp32Bound);
  CHECK_REL_ERROR(v_gpu, v_ref, kFp32Bound);
  // bf16 parameter, gradient and states, as the reference's embeddings.
  DeviceBuffer<bf16> bp(to_bf16(p0)), bm(to_bf16(m0)), bv(to_bf16(v0)), bg(to_bf16(g));
  adam_update(bp.get(), bg.get(), bm.get(), bv.get(), n, step, 0);
  std::vector<double> pb = rounded_to_bf16(p0), mb = rounded_to_bf16(m0), vb = rounded_to_bf16(v0), gb = rounded_to_bf16(g);
  for (double& x : gb) x /= 8;
  adam_update(pb.data(), gb.data(), mb.data(), vb.data(), n, step.lr, step.t, cfg);
  std::vector<double> pb_gpu = to_double(bp.download()), mb_gpu = to_double(bm.download());
  CHECK_REL_ERROR(pb_gpu, pb, kBf16Bound);
  CHECK_REL_ERROR(mb_gpu, mb, kBf16Bound);
  // Slices as a rank's share may be: from an element off 16 bytes (one element a thread), and from
  // an aligned one with a tail of 5 past the last 8 (eight a thread, then the tail); the elements
  // outside the slice untouched.
  for (int64_t first : {int64_t(3), int64_t(8)}) {
    const int64_t count = n - first - 5;
    DeviceBuffer<float> sp(pf), sm(mf), sv(vf), sg(gf);
    adam_update(sp.get() + first, sg.get() + first, sm.get() + first, sv.get() + first, count, step, 0);
    std::vector<double> sp_ref(pf.begin(), pf.end()), sm_ref(mf.begin(), mf.end()), sv_ref(vf.begin(), vf.end());
    adam_update(sp_ref.data() + first, g_ref.data() + first, sm_ref.data() + first, sv_ref.data() + first, count,
                step.lr, step.t, cfg);
    const std::vector<float> sp_gpu = sp.download();
    std::printf("  slice from element %lld, %lld elements\n", (long long)first, (long long)count);
    CHECK_REL_ERROR(to_double(sp_gpu), sp_ref, kFp32Bound);
    CHECK_REL_ERROR(to_double(sm.download()), sm_ref, kFp32Bound);
    bool outside_untouched = true;
    for (int64_t i = 0; i < n; ++i)
      if ((i < first || i >= first + count) && sp_gpu[i] != pf[i]) outside_untouched = false;
    CHECK(outside_untouched);
  }
}

int main(int argc, char** argv) { return run_gpu_checks(argc, argv); }
