// The start-up self-check: every fast path of the step beside a simple GPU path of the same
// mathematics, on small problems of the run's shapes, compared with the bounds the GPU tests use.
// A first run on new hardware (or a new driver, CUDA or cuBLASLt) may find a fast path that the
// CPU emulator passed but the GPU does not compute as we read PTX and cuBLASLt; the trainer then
// replaces that path by its reference for the whole run (or stops, with --self-check strict)
// instead of training silently wrong. The references are the paths the flags select anyway:
//   flash attention (flash_attention.cuh)      --attention reference: the warp-per-row kernels (attention.cuh)
//   FP8 lm_head (fp8_head.cuh)                 --bf16-head: bf16 products
//   the cross-entropy's fused e5m2 gradient    --fp8-gradient cast: bf16 gradient, then a cast
//   batched Muon (strided cuBLASLt batches)    --muon per-matrix: Newton-Schulz one matrix at a time
//   the residual as cuBLASLt's C               --residual-add separate: the product, then an add
#pragma once
#include "kernels/attention.cuh"
#include "kernels/faults.h"
#include "kernels/flash_attention.cuh"
#include "kernels/fp8_head.cuh"
#include "kernels/muon.cuh"
#include "kernels/residual.cuh"

#include <chrono>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

// Which implementation of each replaceable part of the step a run uses (true: the fast one).
struct KernelPaths {
  bool flash_attention = true;
  bool fp8_head = true;
  bool fused_e5m2_gradient = true;
  bool batched_muon = true;
  bool fused_residual_add = true;
};

// A fast path: its KernelPaths member, its name in the log, the flag that selects its reference,
// and the test-only fault that gives it a wrong result (kernels/faults.h).
struct FastPath {
  bool KernelPaths::*member;
  const char* name;
  const char* reference_flag;
  Fault fault;
};

inline const std::vector<FastPath>& fast_paths() {
  static const std::vector<FastPath> paths = {
      {&KernelPaths::flash_attention, "flash attention", "--attention reference", Fault::wrong_flash_attention},
      {&KernelPaths::fp8_head, "FP8 head", "--bf16-head", Fault::wrong_fp8_head},
      {&KernelPaths::fused_e5m2_gradient, "fused e5m2 gradient", "--fp8-gradient cast",
       Fault::wrong_fused_e5m2_gradient},
      {&KernelPaths::batched_muon, "batched Muon", "--muon per-matrix", Fault::wrong_batched_muon},
      {&KernelPaths::fused_residual_add, "residual as cuBLASLt's C", "--residual-add separate",
       Fault::wrong_fused_residual_add},
  };
  return paths;
}

inline const FastPath& fast_path_of(bool KernelPaths::*member) {
  for (const FastPath& p : fast_paths())
    if (p.member == member) return p;
  throw std::logic_error("self-check: a KernelPaths member without its FastPath entry");
}

// One comparison: the worst relative error of the fast path's outputs against the reference's.
struct SelfCheckResult {
  std::string name;
  bool KernelPaths::*path;
  double error, bound;
  bool passed() const { return error <= bound; }  // NaN fails

  std::string line() const {
    char text[256];
    std::snprintf(text, sizeof text, "self-check %s: rel. error %.2e (bound %.0e) %s", name.c_str(), error, bound,
                  passed() ? "ok" : "FAILED");
    return text;
  }
};

// The problems' shapes: the model's width, heads and vocabulary; the attention problems' length
// (windows up to 14 blocks and documents across block edges need 16 blocks).
struct SelfCheckShape {
  int model_dim, num_heads, vocab_size;
  int attention_tokens = 16 * kAttentionBlock;
  int head_rows = 128;      // the FP8 head's rows (a multiple of 16)
  int residual_rows = 256;  // tokens of the residual products
};

namespace self_check {

// Bounds from the GPU tests'. Two bf16 paths that each stay within test_attention's and
// test_residual's 5e-3 of the exact result may differ by twice that (the emulator measured
// 2.8-3.0e-3 for attention, 1.7-2.2e-3 for the residual adds), where a wrong layout or operand
// gives errors of order 1. The FP8 products against bf16 products of the same FP8 values differ
// only by the tensor cores' accumulation and the output's rounding (test_fp8_head's bounds: bf16
// outputs 1e-2, the fp32 weight gradient 2e-3). The two Muon paths differ only in cuBLASLt's
// choice of algorithm for a batch or a single matrix.
constexpr double kBf16PathsBound = 1e-2, kFp8ProductBound = 1e-2, kFp8WeightGradBound = 2e-3, kMuonBound = 1e-2;
// The two gradient paths store the same fp32 value through the same two roundings: equal bytes
// (this bound leaves room for a compiler contracting one instantiation's arithmetic differently).
constexpr double kE5m2Bound = 1e-3;

template <typename T>
class Buffer {
 public:
  explicit Buffer(size_t n) : n_(n) { CUDA_CHECK(cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T))); }
  explicit Buffer(const std::vector<T>& host) : Buffer(host.size()) {
    CUDA_CHECK(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~Buffer() { cudaFree(p_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  T* get() const { return p_; }
  std::vector<T> download(cudaStream_t stream) const {
    std::vector<T> host(n_);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CUDA_CHECK(cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

inline std::vector<bf16> random_bf16(size_t n, double std, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, float(std));
  std::vector<bf16> v(n);
  for (bf16& x : v) x = __float2bfloat16(normal(rng));
  return v;
}

inline std::vector<float> random_f32(size_t n, double std, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, float(std));
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

template <typename T>
std::vector<double> as_double(const std::vector<T>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = double(static_cast<float>(v[i]));
  return out;
}

// ||fast - ref|| / ||ref||, infinite where the fast path gave a non-finite value. The path's
// injected fault (tests only) scales its outputs by 1.25 first: a wrong result.
inline double relative_error(std::vector<double> fast, const std::vector<double>& ref, Fault fault) {
  if (injected_fault() == fault)
    for (double& x : fast) x *= 1.25;
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(fast[i])) return std::numeric_limits<double>::infinity();
    diff += (fast[i] - ref[i]) * (fast[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : (diff > 0 ? std::numeric_limits<double>::infinity() : 0.0);
}

// Flash attention's forward and both backward kernels against the reference kernels on one layout
// (document ids from `tokens`) and window: the worst of y, dq, dk and dv.
inline double attention_error(const SelfCheckShape& s, const uint16_t* tokens, uint16_t bos, int window,
                              cudaStream_t stream) {
  const int T = s.attention_tokens, H = s.num_heads, d = s.model_dim;
  std::vector<int32_t> docs = attention_document_ids(tokens, T, bos);
  AttentionBlockLists lists = build_attention_blocks(docs, window);
  StagedUploads uploads;
  uploads.reset(AttentionMask::upload_bytes(docs, lists));
  AttentionMask mask(docs, lists, uploads, stream);
  const size_t n = size_t(T) * d;
  // Scores of std ~0.5 (q and k of std 0.6, scale 0.12 over 128 dimensions), as test_attention.
  Buffer<bf16> q(random_bf16(n, 0.6, 11 + window)), k(random_bf16(n, 0.6, 12 + window)),
      v(random_bf16(n, 1.0, 13 + window)), dy(random_bf16(n, 1.0, 14 + window));
  const AttentionTensors a{T, H, d, d, d};
  std::vector<double> outputs[2][4];  // [flash, reference][y, dq, dk, dv]
  for (int reference = 0; reference < 2; ++reference) {
    Buffer<bf16> y(n), dq(n), dk(n), dv(n);
    Buffer<float> lse(size_t(T) * H), delta(size_t(T) * H);
    auto forward = reference ? attention_forward : flash_attention_forward;
    auto backward = reference ? attention_backward : flash_attention_backward;
    forward(q.get(), k.get(), v.get(), y.get(), lse.get(), a, mask, stream);
    backward(q.get(), k.get(), v.get(), y.get(), dy.get(), lse.get(), delta.get(), dq.get(), dk.get(), dv.get(), a,
             mask, stream);
    const Buffer<bf16>* results[4] = {&y, &dq, &dk, &dv};
    for (int i = 0; i < 4; ++i) outputs[reference][i] = as_double(results[i]->download(stream));
  }
  double worst = 0;
  for (int i = 0; i < 4; ++i)
    worst = std::max(worst, relative_error(outputs[0][i], outputs[1][i], Fault::wrong_flash_attention));
  return worst;
}

// FP8 bytes as the bf16 values they encode (exact: bf16 holds every e4m3 and e5m2 value).
template <Fp8Kind kind>
__global__ void fp8_to_bf16_kernel(const fp8* in, bf16* out, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16(
        float(__half(__nv_cvt_fp8_to_halfraw(in[i], kind == Fp8Kind::e4m3 ? __NV_E4M3 : __NV_E5M2))));
}

template <Fp8Kind kind>
void fp8_to_bf16(const fp8* in, bf16* out, size_t n, cudaStream_t stream) {
  fp8_to_bf16_kernel<kind><<<elementwise_grid(n), 256, 0, stream>>>(in, out, n);
  CUDA_CHECK_LAUNCH();
}

// The FP8 head (a forward, the loss and its gradient, a backward on random rows) against bf16
// products of the same FP8 operands, scaled as the FP8 products are (logits, dx, dW); and its
// fused e5m2 gradient against the bf16 gradient cast afterwards.
inline std::vector<SelfCheckResult> fp8_head_checks(const SelfCheckShape& s, Matmul& matmul, cudaStream_t stream) {
  const int rows = s.head_rows, V = s.vocab_size, d = s.model_dim;
  Fp8Head head(rows, V, d);
  const Fp8HeadScales& sc = head.scales();
  Buffer<bf16> x(random_bf16(size_t(rows) * d, 1.0, 21)), logits(size_t(rows) * V), dx(size_t(rows) * d);
  Buffer<float> w(random_f32(size_t(V) * d, 0.05, 22)), dw(std::vector<float>(size_t(V) * d, 0.0f)),
      losses(rows);
  std::vector<uint16_t> host_targets(rows);
  std::mt19937_64 rng(23);
  for (uint16_t& t : host_targets) t = uint16_t(rng() % V);
  Buffer<uint16_t> targets(host_targets);
  const Softcap softcap = Softcap::for_model_dim(d);
  head.quantize_weight(w.get(), stream);
  head.forward(x.get(), logits.get(), rows, matmul, stream);
  Buffer<bf16> logits_copy(size_t(rows) * V);  // the cast path's gradient overwrites its logits
  CUDA_CHECK(cudaMemcpyAsync(logits_copy.get(), logits.get(), size_t(rows) * V * sizeof(bf16),
                             cudaMemcpyDeviceToDevice, stream));
  head.loss_and_gradient(logits.get(), targets.get(), losses.get(), softcap, stream);
  head.backward(dx.get(), dw.get(), matmul, stream);

  // The same products in bf16 over the FP8 operands' values.
  const Fp8HeadOperands op = head.operands();
  Buffer<bf16> xq(size_t(rows) * d), wq(size_t(V) * d), gq(size_t(rows) * V), gq_t(size_t(V) * rows),
      xq_t(size_t(d) * rows), logits_ref(size_t(rows) * V), dx_ref(size_t(rows) * d);
  Buffer<float> dw_ref(size_t(V) * d);
  fp8_to_bf16<Fp8Kind::e4m3>(op.x, xq.get(), size_t(rows) * d, stream);
  fp8_to_bf16<Fp8Kind::e4m3>(op.x_t, xq_t.get(), size_t(rows) * d, stream);
  fp8_to_bf16<Fp8Kind::e4m3>(op.w, wq.get(), size_t(V) * d, stream);
  fp8_to_bf16<Fp8Kind::e5m2>(op.g, gq.get(), size_t(rows) * V, stream);
  fp8_to_bf16<Fp8Kind::e5m2>(op.g_t, gq_t.get(), size_t(rows) * V, stream);
  matmul(xq.get(), Transpose::N, wq.get(), Transpose::T, logits_ref.get(), rows, V, d, CUDA_R_16BF, stream,
         sc.x * sc.w);
  matmul(gq.get(), Transpose::N, wq.get(), Transpose::N, dx_ref.get(), rows, d, V, CUDA_R_16BF, stream,
         sc.grad * sc.w);
  matmul(gq_t.get(), Transpose::N, xq_t.get(), Transpose::T, dw_ref.get(), V, d, rows, CUDA_R_32F, stream,
         sc.grad * sc.x);
  std::vector<SelfCheckResult> results;
  results.push_back({"FP8 head logits", &KernelPaths::fp8_head,
                     relative_error(as_double(logits.download(stream)), as_double(logits_ref.download(stream)),
                                    Fault::wrong_fp8_head),
                     kFp8ProductBound});
  results.push_back({"FP8 head dx", &KernelPaths::fp8_head,
                     relative_error(as_double(dx.download(stream)), as_double(dx_ref.download(stream)),
                                    Fault::wrong_fp8_head),
                     kFp8ProductBound});
  results.push_back({"FP8 head dW", &KernelPaths::fp8_head,
                     relative_error(as_double(dw.download(stream)), as_double(dw_ref.download(stream)),
                                    Fault::wrong_fp8_head),
                     kFp8WeightGradBound});

  // The cast path on the saved logits: both e5m2 copies against the fused path's.
  Buffer<bf16> fused(size_t(rows) * V), fused_t(size_t(rows) * V);
  CUDA_CHECK(cudaMemcpyAsync(fused.get(), gq.get(), size_t(rows) * V * sizeof(bf16), cudaMemcpyDeviceToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(fused_t.get(), gq_t.get(), size_t(rows) * V * sizeof(bf16), cudaMemcpyDeviceToDevice,
                             stream));
  head.set_fused_gradient(false);
  head.loss_and_gradient(logits_copy.get(), targets.get(), losses.get(), softcap, stream);
  fp8_to_bf16<Fp8Kind::e5m2>(op.g, gq.get(), size_t(rows) * V, stream);
  fp8_to_bf16<Fp8Kind::e5m2>(op.g_t, gq_t.get(), size_t(rows) * V, stream);
  results.push_back({"fused e5m2 gradient", &KernelPaths::fused_e5m2_gradient,
                     std::max(relative_error(as_double(fused.download(stream)), as_double(gq.download(stream)),
                                             Fault::wrong_fused_e5m2_gradient),
                              relative_error(as_double(fused_t.download(stream)), as_double(gq_t.download(stream)),
                                             Fault::wrong_fused_e5m2_gradient)),
                     kE5m2Bound});
  return results;
}

// One Muon step of a shape group, batched against one matrix at a time, from equal states: the
// worst error of the parameters' updates and of the momenta.
inline double muon_error(int rows, int cols, int count, Matmul& matmul, cudaStream_t stream) {
  const size_t n = size_t(rows) * cols;
  const std::vector<float> p0 = random_f32(count * n, 0.02, 31), g = random_f32(count * n, 1.0, 32),
                           m0 = random_f32(count * n, 0.5, 33);
  const MuonStep step{0.05f, 0.95f, 0.125f};
  MuonWorkspace workspace(count * n, count);
  std::vector<double> updates[2], momenta[2];  // [batched, per matrix]
  for (int per_matrix = 0; per_matrix < 2; ++per_matrix) {
    Buffer<float> p(p0), grad(g), momentum(m0);
    std::vector<MuonMatrix> matrices;
    for (int i = 0; i < count; ++i) matrices.push_back({p.get() + i * n, grad.get() + i * n, momentum.get() + i * n});
    if (per_matrix) muon_update_each(matrices, rows, cols, step, workspace, matmul, stream);
    else muon_update(matrices, rows, cols, step, workspace, matmul, stream);
    const std::vector<float> after = p.download(stream);
    for (size_t i = 0; i < after.size(); ++i) updates[per_matrix].push_back(double(after[i]) - double(p0[i]));
    momenta[per_matrix] = as_double(momentum.download(stream));
  }
  return std::max(relative_error(updates[0], updates[1], Fault::wrong_batched_muon),
                  relative_error(momenta[0], momenta[1], Fault::wrong_batched_muon));
}

// y = x W^T + residual with the residual as cuBLASLt's C, against the product and then the add.
inline double residual_error(int rows, int n, int k, Matmul& matmul, cudaStream_t stream) {
  Buffer<bf16> x(random_bf16(size_t(rows) * k, 1.0, 41)), w(random_bf16(size_t(n) * k, 0.03, 42)),
      residual(random_bf16(size_t(rows) * n, 1.0, 43));
  std::vector<double> outputs[2];
  for (int separate = 0; separate < 2; ++separate) {
    Buffer<bf16> y(size_t(rows) * n);
    linear_with_residual(matmul, x.get(), w.get(), y.get(), rows, n, k, residual.get(), !separate, stream);
    outputs[separate] = as_double(y.download(stream));
  }
  return relative_error(outputs[0], outputs[1], Fault::wrong_fused_residual_add);
}

}  // namespace self_check

// Every fast path against its reference; one result per problem. `tokens` ([attention_tokens])
// gives the attention problems their document layout (the run's own data where there is some).
inline std::vector<SelfCheckResult> run_self_check(const SelfCheckShape& s, const uint16_t* tokens, uint16_t bos,
                                                   Matmul& matmul, cudaStream_t stream) {
  using namespace self_check;
  std::vector<SelfCheckResult> results;
  for (int window : {1, 3, 14})
    results.push_back({"flash attention, window " + std::to_string(window), &KernelPaths::flash_attention,
                       attention_error(s, tokens, bos, window, stream), kBf16PathsBound});
  for (SelfCheckResult& r : fp8_head_checks(s, matmul, stream)) results.push_back(std::move(r));
  const int d = s.model_dim;
  results.push_back({"batched Muon " + std::to_string(d) + "x" + std::to_string(d), &KernelPaths::batched_muon,
                     muon_error(d, d, 3, matmul, stream), kMuonBound});
  results.push_back({"batched Muon " + std::to_string(4 * d) + "x" + std::to_string(d), &KernelPaths::batched_muon,
                     muon_error(4 * d, d, 2, matmul, stream), kMuonBound});
  results.push_back({"residual as cuBLASLt's C, k = " + std::to_string(d), &KernelPaths::fused_residual_add,
                     residual_error(s.residual_rows, d, d, matmul, stream), kBf16PathsBound});
  results.push_back({"residual as cuBLASLt's C, k = " + std::to_string(4 * d), &KernelPaths::fused_residual_add,
                     residual_error(s.residual_rows, d, 4 * d, matmul, stream), kBf16PathsBound});
  return results;
}

// `paths` with every path that a failed result vouches for replaced by its reference.
inline KernelPaths without_failed_paths(KernelPaths paths, const std::vector<SelfCheckResult>& results) {
  for (const SelfCheckResult& r : results)
    if (!r.passed()) paths.*r.path = false;
  return paths;
}
