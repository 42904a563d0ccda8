// The start-up self-check: every fast path of the step beside a simple GPU path of the same
// mathematics, on small problems of the run's shapes, with bounds drawn from the GPU tests'.
// A first run on new hardware (or a new driver, CUDA or cuBLASLt) may find a fast path that the
// CPU emulator passed but the GPU does not compute as we read PTX and cuBLASLt; the trainer then
// replaces that path by its reference for the whole run (or stops, with --self-check strict)
// instead of training silently wrong. The trainer runs the checks in a process of their own
// (self_check_process.cuh), so that a kernel that hangs or stops the GPU fails its path too. The
// references are the paths the flags select anyway:
//   flash attention (flash_attention.cuh)      --attention reference: the warp-per-row kernels (attention.cuh)
//     (the forward and backward the run uses: the warp-specialised forward with --attention flash-ws,
//     the two-kernel backward with --attention flash-split)
//   FP8 lm_head (fp8_head.cuh)                 --bf16-head: bf16 products
//   the cross-entropy's fused e5m2 gradient    --fp8-gradient cast: bf16 gradient, then a cast
//   batched Muon (strided cuBLASLt batches)    --muon per-matrix: Newton-Schulz one matrix at a time
//   the residual as cuBLASLt's C               --residual-add separate: the product, then an add
//   the MLP fc with ReLU² in our GEMM          --mlp-fc cublaslt: cuBLASLt's product, then the pass
//     (gemm_epilogue.cuh; opt-in: checked only where --mlp-fc fused asks for it)
//   the qkv product with QK norm, RoPE and   --qkv cublaslt: cuBLASLt's product, then the two passes
//     the value mix in our GEMM's epilogue (qkv_epilogue.cuh; opt-in: --qkv fused)
//   the backward of the QK norm, RoPE and    --qkv-backward separate: the attention backward,
//     the value mix where the fused attention  then the passes over dq, dk and dv
//     backward stores dq, dk and dv (flash_attention.cuh; opt-in: --qkv-backward fused)
#pragma once
#include "kernels/activations.cuh"
#include "kernels/attention.cuh"
#include "kernels/check_arrays.cuh"
#include "kernels/host/faults.h"
#include "kernels/host/matmul_algorithms.h"
#include "kernels/flash_attention.cuh"
#include "kernels/gemm_epilogue.cuh"
#include "kernels/fp8_head.cuh"
#include "kernels/qkv_epilogue.cuh"
#include "kernels/muon.cuh"
#include "kernels/residual.cuh"

#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

// Which implementation of each replaceable part of the step a run uses (true: the fast one).
struct KernelPaths {
  bool flash_attention = true;
  bool fused_attention_backward = true;  // which flash backward (no path of its own: flash-split is a flag)
  bool warp_specialised_attention_forward = false;  // which flash forward (flash-ws, a flag too)
  bool fp8_head = true;
  bool fused_e5m2_gradient = true;
  bool batched_muon = true;
  bool fused_residual_add = true;
  bool fused_mlp_fc = false;  // opt-in (--mlp-fc fused) until measured on a GPU
  bool fused_qkv = false;     // opt-in (--qkv fused) until measured on a GPU
  // opt-in (--qkv-backward fused) until measured on a GPU; taken only with the fused flash backward
  bool qkv_backward_in_attention = false;
  // Not a fast path: which of cuBLASLt's algorithms the FP8 logits product takes (--fp8-logits-algorithm;
  // the self-check's small product has other candidates, so it checks the heuristic's first).
  int fp8_logits_candidate = 0;
  // Nor this: which of cuBLASLt's algorithms each of the blocks' products takes in training
  // (--matmul-algorithms); the self-check's products are of other shapes.
  MatmulAlgorithms matmul_algorithms;
};

// The attention forward that a run's paths select.
using AttentionForward = decltype(&attention_forward);
inline AttentionForward attention_forward_of(const KernelPaths& p) {
  if (!p.flash_attention) return attention_forward;
  return p.warp_specialised_attention_forward ? flash_attention_forward_ws : flash_attention_forward;
}

// The attention backward that a run's paths select.
using AttentionBackward = decltype(&attention_backward);
inline AttentionBackward attention_backward_of(const KernelPaths& p) {
  if (!p.flash_attention) return attention_backward;
  return p.fused_attention_backward ? flash_attention_backward : flash_attention_backward_split;
}

// Whether the attention backward a run's paths select also does the backward of the QK norm, RoPE
// and the value mix (flash_attention_backward_into_dqkv): asked for, and the fused flash backward in use.
inline bool attention_takes_qkv_backward(const KernelPaths& p) {
  return p.qkv_backward_in_attention && p.flash_attention && p.fused_attention_backward;
}

// A fast path: its KernelPaths member, its name in the log, the flag that selects its reference,
// the test-only fault that gives it a wrong result (kernels/host/faults.h), and whether a run takes
// it only when asked (opt-in: not yet measured faster on a GPU).
struct FastPath {
  bool KernelPaths::*member;
  const char* name;
  const char* reference_flag;
  Fault fault;
  bool opt_in = false;
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
      {&KernelPaths::fused_mlp_fc, "fused MLP fc", "--mlp-fc cublaslt", Fault::wrong_fused_mlp_fc, /*opt_in=*/true},
      {&KernelPaths::fused_qkv, "fused qkv", "--qkv cublaslt", Fault::wrong_fused_qkv, /*opt_in=*/true},
      {&KernelPaths::qkv_backward_in_attention, "qkv backward in attention", "--qkv-backward separate",
       Fault::wrong_qkv_backward, /*opt_in=*/true},
  };
  return paths;
}

// One comparison: the worst relative error of the fast path's outputs against the reference's, or
// the error that stopped it.
struct SelfCheckResult {
  std::string name;
  bool KernelPaths::*path;
  double error, bound;
  std::string failure;  // what stopped the check before it had an error ("" if nothing)
  bool passed() const { return error <= bound; }  // NaN fails

  std::string line() const {
    char text[512];
    if (failure.empty())
      std::snprintf(text, sizeof text, "self-check %s: rel. error %.2e (bound %.0e) %s", name.c_str(), error, bound,
                    passed() ? "ok" : "FAILED");
    else
      std::snprintf(text, sizeof text, "self-check %s: %s FAILED", name.c_str(), failure.c_str());
    return text;
  }
};

// The problems' shapes: the model's width, heads and vocabulary; the attention problems' length
// (windows up to 14 blocks and documents across block edges need 16 blocks).
struct SelfCheckShape {
  int model_dim, num_heads, vocab_size;
  int attention_tokens = 16 * kAttentionBlock;
  int head_rows = 128;      // the FP8 head's rows (a multiple of 16)
  int residual_rows = 256;  // tokens of the residual products and the MLP fc (a multiple of 128)
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

inline std::vector<bf16> random_bf16(size_t n, double std, uint64_t seed) { return to_bf16(random_normal(n, seed, std)); }

inline std::vector<float> random_f32(size_t n, double std, uint64_t seed) {
  const std::vector<double> v = random_normal(n, seed, std);
  return std::vector<float>(v.begin(), v.end());
}

// What a fast path's injected fault (tests only) multiplies its outputs by: a wrong result.
inline double injected_scale(Fault fault) { return injected_fault() == fault ? 1.25 : 1.0; }

// relative_error of a fast path's outputs, scaled by its injected fault first.
inline double fast_path_error(std::vector<double> fast, const std::vector<double>& ref, Fault fault) {
  for (double& x : fast) x *= injected_scale(fault);
  return relative_error(fast, ref);
}

// The attention mask of a layout (document ids from `tokens`, T of them) and window, with the
// staged uploads that hold its device copy.
struct CheckMask {
  StagedUploads uploads;
  std::unique_ptr<AttentionMask> mask;
  CheckMask(const uint16_t* tokens, int T, uint16_t bos, int window, cudaStream_t stream) {
    const std::vector<int32_t> docs = attention_document_ids(tokens, T, bos);
    const AttentionBlockLists lists = build_attention_blocks(docs, window);
    uploads.reset(AttentionMask::upload_bytes(docs, lists));
    mask = std::make_unique<AttentionMask>(docs, lists, uploads, stream);
  }
};

// Flash attention's forward and the backward `in_use` selects against the reference kernels on one
// layout (document ids from `tokens`) and window: the worst of y, dq, dk and dv.
inline double attention_error(const SelfCheckShape& s, const KernelPaths& in_use, const uint16_t* tokens, uint16_t bos,
                              int window, cudaStream_t stream) {
  const int T = s.attention_tokens, H = s.num_heads, d = s.model_dim;
  const CheckMask check_mask(tokens, T, bos, window, stream);
  const AttentionMask& mask = *check_mask.mask;
  const size_t n = size_t(T) * d;
  // Scores of std ~0.5 (q and k of std 0.6, scale 0.12 over 128 dimensions), as test_attention.
  DeviceBuffer<bf16> q(random_bf16(n, 0.6, 11 + window)), k(random_bf16(n, 0.6, 12 + window)),
      v(random_bf16(n, 1.0, 13 + window)), dy(random_bf16(n, 1.0, 14 + window));
  const AttentionTensors a{T, H, d, d, d};
  std::vector<double> outputs[2][4];  // [flash, reference][y, dq, dk, dv]
  for (int reference = 0; reference < 2; ++reference) {
    DeviceBuffer<bf16> y(n), dq(n), dk(n), dv(n);
    DeviceBuffer<float> lse(size_t(T) * H), scratch(attention_backward_scratch_floats(T, H));
    KernelPaths paths = in_use;
    paths.flash_attention = !reference;
    attention_forward_of(paths)(q.get(), k.get(), v.get(), y.get(), lse.get(), a, mask, stream);
    attention_backward_of(paths)(q.get(), k.get(), v.get(), y.get(), dy.get(), lse.get(), scratch.get(), dq.get(),
                                 dk.get(), dv.get(), a, mask, stream);
    const DeviceBuffer<bf16>* results[4] = {&y, &dq, &dk, &dv};
    for (int i = 0; i < 4; ++i) outputs[reference][i] = to_double(results[i]->download());
  }
  const bool newest = in_use.fused_attention_backward || in_use.warp_specialised_attention_forward;
  double worst = 0;
  for (int i = 0; i < 4; ++i) {
    worst = std::max(worst, fast_path_error(outputs[0][i], outputs[1][i], Fault::wrong_flash_attention));
    if (newest) worst = std::max(worst, fast_path_error(outputs[0][i], outputs[1][i], Fault::wrong_newest_flash_kernels));
  }
  return worst;
}

// The fused attention backward into dqkv (through the QK norm's, RoPE's and the value mix's
// backward) against the fused backward, then the passes, on one layout and window, q and k the norm
// and rotation of a random raw qkv and v its mix with a value embedding, as the model makes them: the
// worst error of dqkv, dv and the mix's scalar gradients (these on their terms' scale: they are sums
// of T d products that cancel, product_terms_scale).
inline double qkv_backward_error(const SelfCheckShape& s, const uint16_t* tokens, uint16_t bos, int window,
                                 cudaStream_t stream) {
  const int T = s.attention_tokens, H = s.num_heads, d = s.model_dim;
  const CheckMask check_mask(tokens, T, bos, window, stream);
  const AttentionMask& mask = *check_mask.mask;
  const size_t n = size_t(T) * d;
  std::vector<float> table;
  rope_table_host(T, table);
  DeviceBuffer<float> cos_sin(table), sa(std::vector<float>{0.75f, -0.375f}), lse(size_t(T) * H),
      scratch(attention_backward_scratch_floats(T, H)), reduction(kScalarReductionScratchFloats);
  DeviceBuffer<bf16> qkv(random_bf16(3 * n, 1.0, 51)), ve(random_bf16(n, 1.0, 52)), dy(random_bf16(n, 1.0, 53)), q(n),
      k(n), v(n), y(n);
  qk_norm_rope_forward(qkv.get(), cos_sin.get(), q.get(), k.get(), T, H, stream);
  weighted_sum_forward(qkv.get() + 2 * d, sa.get(), ve.get(), sa.get() + 1, v.get(), T, d, 3 * d, stream);
  const AttentionTensors a{T, H, d, d, d};
  flash_attention_forward(q.get(), k.get(), v.get(), y.get(), lse.get(), a, mask, stream);
  std::vector<double> outputs[2][3];  // [into dqkv, then the passes][dqkv, dv, (dsa0, dsa1)]
  for (int separate = 0; separate < 2; ++separate) {
    DeviceBuffer<bf16> dqkv(3 * n), dv(n);
    DeviceBuffer<float> dsa(std::vector<float>{0.0f, 0.0f});
    if (separate) {
      DeviceBuffer<bf16> dq(n), dk(n);
      flash_attention_backward(q.get(), k.get(), v.get(), y.get(), dy.get(), lse.get(), scratch.get(), dq.get(),
                               dk.get(), dv.get(), a, mask, stream);
      weighted_sum_backward(dv.get(), qkv.get() + 2 * d, sa.get(), dsa.get(), ve.get(), sa.get() + 1, dsa.get() + 1,
                            dqkv.get() + 2 * d, nullptr, false, T, d, 3 * d, reduction.get(), stream);
      qk_norm_rope_backward(qkv.get(), dq.get(), dk.get(), cos_sin.get(), dqkv.get(), T, H, stream);
    } else {
      flash_attention_backward_into_dqkv(q.get(), k.get(), v.get(), y.get(), dy.get(), lse.get(), scratch.get(),
                                         {qkv.get(), cos_sin.get(), sa.get(), ve.get(), dqkv.get(), dv.get()},
                                         dsa.get(), dsa.get() + 1, a, mask, stream);
    }
    outputs[separate][0] = to_double(dqkv.download()), outputs[separate][1] = to_double(dv.download());
    outputs[separate][2] = to_double(dsa.download());
  }
  double worst = 0;
  for (int i = 0; i < 2; ++i)
    worst = std::max(worst, fast_path_error(outputs[0][i], outputs[1][i], Fault::wrong_qkv_backward));
  const std::vector<double> raw = to_double(qkv.download()), embedding = to_double(ve.download());
  const double* dv = outputs[1][1].data();
  const double scales[2] = {product_terms_scale(dv, raw.data() + 2 * d, T, d, 3 * d),
                            product_terms_scale(dv, embedding.data(), T, d, d)};
  for (int i = 0; i < 2; ++i) {
    const double fast = outputs[0][2][i] * injected_scale(Fault::wrong_qkv_backward);
    worst = std::max(worst, error_on_scale(fast, outputs[1][2][i], scales[i]));
  }
  return worst;
}

// FP8 bytes as the bf16 values they encode (exact: bf16 holds every e4m3 and e5m2 value).
template <Fp8Kind kind>
__global__ void fp8_to_bf16_kernel(const fp8* in, bf16* out, size_t n) {
  await_previous_kernel();
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16(
        float(__half(__nv_cvt_fp8_to_halfraw(in[i], kind == Fp8Kind::e4m3 ? __NV_E4M3 : __NV_E5M2))));
}

template <Fp8Kind kind>
void fp8_to_bf16(const fp8* in, bf16* out, size_t n, cudaStream_t stream) {
  CUDA_CHECK(launch_kernel(fp8_to_bf16_kernel<kind>, elementwise_grid(n), 256, 0, stream, in, out, n));
}

// The FP8 head (a forward, the loss and its gradient, a backward on random rows) against bf16
// products of the same FP8 operands, scaled as the FP8 products are: the errors of the logits, dx
// and dW; with `gradient`, also its fused e5m2 gradient against the bf16 gradient cast afterwards
// (both copies).
inline std::vector<double> fp8_head_errors(const SelfCheckShape& s, bool gradient, Matmul& matmul,
                                           cudaStream_t stream) {
  const int rows = s.head_rows, V = s.vocab_size, d = s.model_dim;
  Fp8Head head(rows, V, d);
  const Fp8HeadScales& sc = head.scales();
  DeviceBuffer<bf16> x(random_bf16(size_t(rows) * d, 1.0, 21)), logits(size_t(rows) * V), dx(size_t(rows) * d);
  DeviceBuffer<float> w(random_f32(size_t(V) * d, 0.05, 22)), dw(std::vector<float>(size_t(V) * d, 0.0f)),
      losses(rows);
  std::vector<uint16_t> host_targets(rows);
  std::mt19937_64 rng(23);
  for (uint16_t& t : host_targets) t = uint16_t(rng() % V);
  DeviceBuffer<uint16_t> targets(host_targets);
  const Softcap softcap = Softcap::for_model_dim(d);
  head.quantize_weight(w.get(), stream);
  head.forward(x.get(), logits.get(), rows, matmul, stream);
  head.loss_and_gradient(logits.get(), targets.get(), losses.get(), softcap, stream);  // fused: logits kept
  head.backward(dx.get(), dw.get(), matmul, stream);

  // The same products in bf16 over the FP8 operands' values.
  const Fp8HeadOperands op = head.operands();
  DeviceBuffer<bf16> xq(size_t(rows) * d), wq(size_t(V) * d), gq(size_t(rows) * V), gq_t(size_t(V) * rows),
      xq_t(size_t(d) * rows), logits_ref(size_t(rows) * V), dx_ref(size_t(rows) * d);
  DeviceBuffer<float> dw_ref(size_t(V) * d);
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
  std::vector<double> errors = {
      fast_path_error(to_double(logits.download()), to_double(logits_ref.download()), Fault::wrong_fp8_head),
      fast_path_error(to_double(dx.download()), to_double(dx_ref.download()), Fault::wrong_fp8_head),
      fast_path_error(to_double(dw.download()), to_double(dw_ref.download()), Fault::wrong_fp8_head)};
  if (!gradient) return errors;

  // The cast path on the same logits (it overwrites them): both e5m2 copies against the fused path's.
  const std::vector<double> fused = to_double(gq.download()), fused_t = to_double(gq_t.download());
  head.set_fused_gradient(false);
  head.loss_and_gradient(logits.get(), targets.get(), losses.get(), softcap, stream);
  fp8_to_bf16<Fp8Kind::e5m2>(op.g, gq.get(), size_t(rows) * V, stream);
  fp8_to_bf16<Fp8Kind::e5m2>(op.g_t, gq_t.get(), size_t(rows) * V, stream);
  errors.push_back(std::max(fast_path_error(fused, to_double(gq.download()), Fault::wrong_fused_e5m2_gradient),
                            fast_path_error(fused_t, to_double(gq_t.download()), Fault::wrong_fused_e5m2_gradient)));
  return errors;
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
    DeviceBuffer<float> p(p0), grad(g), momentum(m0);
    std::vector<MuonMatrix> matrices;
    for (int i = 0; i < count; ++i) matrices.push_back({p.get() + i * n, grad.get() + i * n, momentum.get() + i * n});
    if (per_matrix) muon_update_each(matrices, rows, cols, step, workspace, matmul, stream);
    else muon_update(matrices, rows, cols, step, workspace, matmul, stream);
    const std::vector<float> after = p.download();
    for (size_t i = 0; i < after.size(); ++i) updates[per_matrix].push_back(double(after[i]) - double(p0[i]));
    momenta[per_matrix] = to_double(momentum.download());
  }
  return std::max(fast_path_error(updates[0], updates[1], Fault::wrong_batched_muon),
                  fast_path_error(momenta[0], momenta[1], Fault::wrong_batched_muon));
}

// y = x W^T + residual with the residual as cuBLASLt's C, against the product and then the add.
inline double residual_error(int rows, int n, int k, Matmul& matmul, cudaStream_t stream) {
  DeviceBuffer<bf16> x(random_bf16(size_t(rows) * k, 1.0, 41)), w(random_bf16(size_t(n) * k, 0.03, 42)),
      residual(random_bf16(size_t(rows) * n, 1.0, 43));
  std::vector<double> outputs[2];
  for (int separate = 0; separate < 2; ++separate) {
    DeviceBuffer<bf16> y(size_t(rows) * n);
    linear_with_residual(matmul, x.get(), w.get(), y.get(), rows, n, k, residual.get(), !separate, stream);
    outputs[separate] = to_double(y.download());
  }
  return fast_path_error(outputs[0], outputs[1], Fault::wrong_fused_residual_add);
}

// The MLP's products with ReLU² in our GEMM's epilogues against cuBLASLt's products and the
// separate passes: forward a = relu(x W^T)^2 ([rows, n] and [4n, n]), backward du = (dy W') 2
// sqrt(a) (W' [n, 4n]); the worse of the two.
inline double mlp_fc_error(int rows, int n, Matmul& matmul, cudaStream_t stream) {
  const int F = 4 * n;
  const size_t elements = size_t(rows) * F;
  DeviceBuffer<bf16> x(random_bf16(size_t(rows) * n, 1.0, 44)), w(random_bf16(size_t(F) * n, 0.03, 45)),
      dy(random_bf16(size_t(rows) * n, 1.0, 46)), w_proj(random_bf16(size_t(n) * F, 0.03, 47)), u(elements),
      fused(elements), separate(elements), du_fused(elements), du_separate(elements);
  matmul_relu_squared(x.get(), w.get(), fused.get(), rows, F, n, stream);
  matmul(x.get(), Transpose::N, w.get(), Transpose::T, u.get(), rows, F, n, CUDA_R_16BF, stream);
  relu_squared_forward(u.get(), separate.get(), elements, stream);
  matmul_relu_squared_backward(dy.get(), w_proj.get(), separate.get(), du_fused.get(), rows, F, n, stream);
  matmul(dy.get(), Transpose::N, w_proj.get(), Transpose::N, du_separate.get(), rows, F, n, CUDA_R_16BF, stream);
  relu_squared_backward_from_square(separate.get(), du_separate.get(), du_separate.get(), elements, stream);
  return std::max(
      fast_path_error(to_double(fused.download()), to_double(separate.download()), Fault::wrong_fused_mlp_fc),
      fast_path_error(to_double(du_fused.download()), to_double(du_separate.download()), Fault::wrong_fused_mlp_fc));
}

// The qkv product with QK norm, RoPE and the value mix in our GEMM's epilogue against cuBLASLt's
// product and the two passes ([rows, 3n] from x [rows, n], n / 128 heads, a value embedding): the
// worst error of the raw qkv, q, k and v.
inline double qkv_error(int rows, int n, const float* cos_sin, Matmul& matmul, cudaStream_t stream) {
  const size_t tn = size_t(rows) * n;
  DeviceBuffer<bf16> x(random_bf16(tn, 1.0, 48)), w(random_bf16(size_t(3) * n * n, 0.03, 49)),
      ve(random_bf16(tn, 1.0, 50));
  DeviceBuffer<float> sa(std::vector<float>{0.75f, -0.375f});
  std::vector<double> outputs[2][4];  // [fused, separate][qkv, q, k, v]
  for (int separate = 0; separate < 2; ++separate) {
    DeviceBuffer<bf16> qkv(3 * tn), q(tn), k(tn), v(tn);
    if (separate) {
      matmul(x.get(), Transpose::N, w.get(), Transpose::T, qkv.get(), rows, 3 * n, n, CUDA_R_16BF, stream);
      qk_norm_rope_forward(qkv.get(), cos_sin, q.get(), k.get(), rows, n / kRopeHeadDim, stream);
      weighted_sum_forward(qkv.get() + 2 * n, sa.get(), ve.get(), sa.get() + 1, v.get(), rows, n, 3 * n, stream);
    } else {
      matmul_qkv_norm_rope(x.get(), w.get(), qkv.get(), q.get(), k.get(), v.get(), cos_sin, sa.get(), ve.get(),
                           sa.get() + 1, rows, n, stream);
    }
    int i = 0;
    for (DeviceBuffer<bf16>* out : {&qkv, &q, &k, &v}) outputs[separate][i++] = to_double(out->download());
  }
  double worst = 0;
  for (int i = 0; i < 4; ++i)
    worst = std::max(worst, fast_path_error(outputs[0][i], outputs[1][i], Fault::wrong_fused_qkv));
  return worst;
}

// The results of checks that run together (one error each): an exception inside them (cuBLASLt
// refusing a layout on new hardware, say) fails them all with its message, instead of leaving
// this rank before the ranks' vote.
struct CheckSpec {
  std::string name;
  bool KernelPaths::*path;
  double bound;
};

// Told of each group of checks before it runs (and says whether it is to run) and of its results
// after: the self-check's own process reports them to the trainer as they come, and skips the groups
// an earlier process has run (kernels/self_check_process.cuh). Unset: every group runs, untold.
struct CheckListener {
  std::function<bool(const std::vector<CheckSpec>&)> starting;
  std::function<void(const SelfCheckResult* first, size_t count)> finished;
};
inline CheckListener& check_listener() {
  static CheckListener listener;
  return listener;
}

template <class Errors>
void add_results(std::vector<SelfCheckResult>& results, const std::vector<CheckSpec>& specs, Errors errors) {
  if (check_listener().starting && !check_listener().starting(specs)) return;
  std::vector<double> values;
  std::string failure;
  try {
    values = errors();
  } catch (const std::exception& e) {
    failure = e.what();
  }
  for (size_t i = 0; i < specs.size(); ++i)
    results.push_back({specs[i].name, specs[i].path,
                       failure.empty() ? values.at(i) : std::numeric_limits<double>::infinity(), specs[i].bound,
                       failure});
  if (check_listener().finished) check_listener().finished(results.data() + results.size() - specs.size(), specs.size());
}

}  // namespace self_check

// The flash kernels `in_use` selects against the reference attention at windows 1, 3 and 14.
inline std::vector<SelfCheckResult> flash_attention_results(const SelfCheckShape& s, const KernelPaths& in_use,
                                                            const uint16_t* tokens, uint16_t bos, cudaStream_t stream) {
  using namespace self_check;
  std::vector<SelfCheckResult> results;
  for (int window : {1, 3, 14})
    add_results(results, {{"flash attention, window " + std::to_string(window), &KernelPaths::flash_attention,
                           kBf16PathsBound}},
                [&] { return std::vector<double>{attention_error(s, in_use, tokens, bos, window, stream)}; });
  return results;
}

// The flash path a run falls back to before the reference attention, where the newest flash kernels
// (the fused backward, the warp-specialised forward) fail: the default forward and the two-kernel
// backward (--attention flash-split); the qkv backward, which rides on the fused one, goes with it.
inline KernelPaths earlier_flash_kernels(KernelPaths p) {
  p.fused_attention_backward = p.warp_specialised_attention_forward = p.qkv_backward_in_attention = false;
  return p;
}
inline bool has_earlier_flash_kernels(const KernelPaths& p) {
  return p.flash_attention && (p.fused_attention_backward || p.warp_specialised_attention_forward);
}

// Every fast path that `in_use` uses against its reference; one result per problem (a path the
// flags replaced already is not checked: its failure would change nothing). `tokens`
// ([attention_tokens]) gives the attention problems their document layout.
inline std::vector<SelfCheckResult> run_self_check(const SelfCheckShape& s, const KernelPaths& in_use,
                                                   const uint16_t* tokens, uint16_t bos, Matmul& matmul,
                                                   cudaStream_t stream) {
  using namespace self_check;
  std::vector<SelfCheckResult> results;
  if (in_use.flash_attention) results = flash_attention_results(s, in_use, tokens, bos, stream);
  if (in_use.fp8_head) {
    std::vector<CheckSpec> specs = {{"FP8 head logits", &KernelPaths::fp8_head, kFp8ProductBound},
                                    {"FP8 head dx", &KernelPaths::fp8_head, kFp8ProductBound},
                                    {"FP8 head dW", &KernelPaths::fp8_head, kFp8WeightGradBound}};
    if (in_use.fused_e5m2_gradient)
      specs.push_back({"fused e5m2 gradient", &KernelPaths::fused_e5m2_gradient, kE5m2Bound});
    add_results(results, specs, [&] { return fp8_head_errors(s, in_use.fused_e5m2_gradient, matmul, stream); });
  }
  const int d = s.model_dim;
  if (in_use.batched_muon)
    for (int rows : {d, 4 * d}) {
      const int count = rows == d ? 3 : 2;  // a qkv weight's three, an MLP's two
      add_results(results, {{"batched Muon " + std::to_string(rows) + "x" + std::to_string(d),
                             &KernelPaths::batched_muon, kMuonBound}},
                  [&] { return std::vector<double>{muon_error(rows, d, count, matmul, stream)}; });
    }
  if (in_use.fused_mlp_fc)
    add_results(results, {{"fused MLP fc + ReLU²", &KernelPaths::fused_mlp_fc, kBf16PathsBound}},
                [&] { return std::vector<double>{mlp_fc_error(s.residual_rows, d, matmul, stream)}; });
  if (in_use.fused_qkv)  // at the model's width (768) or, narrower (tests), the next whole tile's
    add_results(results, {{"fused qkv + QK norm + RoPE + value mix", &KernelPaths::fused_qkv, kBf16PathsBound}}, [&] {
      const int width = (d + gemm_epilogue::kTileCols - 1) / gemm_epilogue::kTileCols * gemm_epilogue::kTileCols;
      std::vector<float> table;
      rope_table_host(s.residual_rows, table);
      DeviceBuffer<float> cos_sin(table);
      return std::vector<double>{qkv_error(s.residual_rows, width, cos_sin.get(), matmul, stream)};
    });
  if (attention_takes_qkv_backward(in_use))  // the record's window: up to 14 dq contributors a block
    add_results(results, {{"qkv backward in attention, window 14", &KernelPaths::qkv_backward_in_attention,
                           kBf16PathsBound}},
                [&] { return std::vector<double>{qkv_backward_error(s, tokens, bos, 14, stream)}; });
  if (in_use.fused_residual_add)
    for (int k : {d, 4 * d})
      add_results(results, {{"residual as cuBLASLt's C, k = " + std::to_string(k), &KernelPaths::fused_residual_add,
                             kBf16PathsBound}},
                  [&] { return std::vector<double>{residual_error(s.residual_rows, d, k, matmul, stream)}; });
  return results;
}
