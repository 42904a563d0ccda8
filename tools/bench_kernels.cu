// Kernel benchmark at the record's shapes (one micro-sequence: T = 49,152 tokens, d = 768,
// vocab 50,304). Measures the ceilings first in the same run (device-to-device copy bandwidth,
// large cuBLASLt bf16 and FP8 matmuls), then prints per kernel: median time, achieved TB/s or
// TFLOP/s, and the fraction of the measured ceiling (FP8 products: of the FP8 one). Usage:
// bench_kernels [repeats] [section...], from the repository root (attention reads the documents of
// data/sample/, as do the step's other kernels); sections: matmul, fp8, muon, rekls, memory, step,
// attention (none named: all, in this order; the matmul section's cuDNN rows come after all).
// Each row is printed as it is measured, so that a run stopped early keeps its rows. The step
// section ends with the cost of a kernel boundary without and with programmatic dependent launch.
#include "data/dataloader.h"
#include "kernels/activations.cuh"
#include "kernels/attention.cuh"
#include "kernels/check_arrays.cuh"
#include "kernels/cross_entropy.cuh"
#include "kernels/embedding.cuh"
#include "kernels/flash_attention.cuh"
#include "kernels/fp8_head.cuh"
#include "kernels/gemm_epilogue.cuh"
#include "kernels/host/matmul_algorithms.h"
#include "kernels/matmul.cuh"
#include "kernels/muon.cuh"
#include "kernels/norms.cuh"
#include "kernels/optimizers.cuh"
#include "kernels/qkv_epilogue.cuh"
#include "kernels/rekls.cuh"
#include "kernels/residual.cuh"
#include "kernels/rope.cuh"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>
#if __has_include(<cudnn_graph.h>)
#include "tools/cudnn_fusion.h"
#endif

namespace {

constexpr int T = 49152, D = 768, F = 3072, QKV = 2304, V = 50304, H = 6;
constexpr int kBlocks = 12, kAttentionBlocks = 11;  // the record's layer 7 has no attention

int g_repeats = 20;

// Median milliseconds of fn over g_repeats timed runs after 3 warm-up runs.
float median_ms(const std::function<void()>& fn) {
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) fn();
  std::vector<float> ms;
  for (int i = 0; i < g_repeats; ++i) {
    CUDA_CHECK(cudaEventRecord(start));
    fn();
    CUDA_CHECK(cudaEventRecord(stop));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  return ms[ms.size() / 2];
}

// N(0, scale^2) by Box-Muller from a counter hash (splitmix64) of (seed, i): on the device, since
// the record's logits alone are 2.5e9 values, a minute of host generation.
__global__ void fill_normal_kernel(bf16* out, size_t n, float scale, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t h = seed * 0x9E3779B97F4A7C15ull + i;
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
    h ^= h >> 31;
    const float u1 = float((h >> 40) + 1) * 0x1p-24f, u2 = float(h & 0xFFFFFF) * 0x1p-24f;  // (0, 1], [0, 1)
    out[i] = __float2bfloat16(scale * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
  }
}

// A device buffer of n bf16 values drawn from N(0, scale^2): never zeros.
bf16* random_bf16(size_t n, float scale, uint64_t seed) {
  bf16* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, n * sizeof(bf16)));
  fill_normal_kernel<<<1024, 256>>>(d, n, scale, seed);
  CUDA_CHECK_LAUNCH();
  return d;
}

template <typename X>
X* device_alloc(size_t n) {
  X* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, n * sizeof(X)));
  return d;
}

// A device buffer of n e4m3 values of N(0, 1): never zeros.
fp8* random_e4m3(size_t n, uint64_t seed) {
  std::vector<fp8> host(n);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (fp8& x : host) x = to_fp8<Fp8Kind::e4m3>(normal(rng));
  fp8* d = device_alloc<fp8>(n);
  CUDA_CHECK(cudaMemcpy(d, host.data(), n, cudaMemcpyHostToDevice));
  return d;
}

struct Peaks {
  double bandwidth_tbs, matmul_tflops, fp8_matmul_tflops;
};

// fp8: the row is an FP8 product, measured against the FP8 ceiling.
void row(const char* name, float ms, double bytes, double flops, const Peaks& peaks, bool fp8 = false) {
  if (flops > 0) {
    double tflops = flops / ms / 1e9, peak = fp8 ? peaks.fp8_matmul_tflops : peaks.matmul_tflops;
    std::printf("| %-38s | %8.3f | %7.1f TFLOP/s | %5.1f%% |\n", name, ms, tflops, 100 * tflops / peak);
  } else {
    double tbs = bytes / ms / 1e9;
    std::printf("| %-38s | %8.3f | %7.2f TB/s    | %5.1f%% |\n", name, ms, tbs, 100 * tbs / peaks.bandwidth_tbs);
  }
}

Peaks measure_peaks(Matmul& matmul) {
  const size_t copy_bytes = size_t(2) << 30;
  char *src = device_alloc<char>(copy_bytes), *dst = device_alloc<char>(copy_bytes);
  CUDA_CHECK(cudaMemset(src, 1, copy_bytes));
  float copy_ms = median_ms([&] { CUDA_CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice)); });
  cudaFree(src);
  cudaFree(dst);
  const int n = 8192;
  bf16 *a = random_bf16(size_t(n) * n, 1.0f, 1), *b = random_bf16(size_t(n) * n, 1.0f, 2), *c = device_alloc<bf16>(size_t(n) * n);
  float mm_ms = median_ms([&] { matmul(a, Transpose::N, b, Transpose::T, c, n, n, n, CUDA_R_16BF, 0); });
  // FP8 e4m3 x e4m3 -> bf16 with fast accumulation: the fastest FP8 product cuBLASLt offers.
  fp8 *a8 = random_e4m3(size_t(n) * n, 3), *b8 = random_e4m3(size_t(n) * n, 4);
  MatmulOptions fp8_fast{CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, nullptr, nullptr, /*fast_accum=*/true};
  float fp8_ms = median_ms([&] { matmul(a8, Transpose::N, b8, Transpose::T, c, n, n, n, CUDA_R_16BF, fp8_fast, 0); });
  for (void* p : {(void*)a, (void*)b, (void*)c, (void*)a8, (void*)b8}) cudaFree(p);
  const double flops = 2.0 * n * n * double(n);
  Peaks p{2.0 * copy_bytes / copy_ms / 1e9, flops / mm_ms / 1e9, flops / fp8_ms / 1e9};
  std::printf("| %-38s | %8.3f | %7.2f TB/s    | 100.0%% |\n", "ceiling: device copy 2 GiB (read+write)", copy_ms, p.bandwidth_tbs);
  std::printf("| %-38s | %8.3f | %7.1f TFLOP/s | 100.0%% |\n", "ceiling: cuBLASLt bf16 8192^3", mm_ms, p.matmul_tflops);
  std::printf("| %-38s | %8.3f | %7.1f TFLOP/s | 100.0%% |\n", "ceiling: cuBLASLt fp8 8192^3 fast acc", fp8_ms,
              p.fp8_matmul_tflops);
  return p;
}

// Times `run(c)` for each of cuBLASLt's other heuristic answers c = 1, 2, ... for a product
// (MatmulOptions' candidate) until the heuristic offers no more: timed(c, ms) for each, a line for
// one offered but refused at the product.
void time_candidates(const std::string& product, const std::function<void(int)>& run,
                     const std::function<void(int, float)>& timed) {
  for (int c = 1; c < Matmul::kMaxCandidates; ++c) {
    float ms;
    try {
      ms = median_ms([&] { run(c); });
    } catch (const std::invalid_argument&) {  // the heuristic offers no more
      return;
    } catch (const std::exception& e) {
      std::printf("| %-38s | %s\n", (product + ", candidate " + std::to_string(c)).c_str(), e.what());
      continue;
    }
    timed(c, ms);
  }
}

// Whether two runs of a product give the same bits (the trainer's resume is bitwise): `out`, of
// `bytes`, zeroed before each run where the product adds into it.
bool bitwise_reproducible(const std::function<void()>& run, void* out, size_t bytes, bool adds_into_out) {
  std::vector<uint8_t> first(bytes), second(bytes);
  for (std::vector<uint8_t>* copy : {&first, &second}) {
    if (adds_into_out) CUDA_CHECK(cudaMemset(out, 0, bytes));
    run();
    CUDA_CHECK(cudaMemcpy(copy->data(), out, bytes, cudaMemcpyDeviceToHost));
  }
  return first == second;
}

// Each of the blocks' products as the trainer makes it (the projections' forward with the residual
// as cuBLASLt's C, the weight gradients added to fp32 ones), with the heuristic's first answer and
// then the fastest of the others that gives the same bits on a second run ("its fastest: candidate
// N"): how much a choice of algorithm per product could save, and the --matmul-algorithms value
// that makes it (the trainer takes the first unless told, as PyTorch does). The rows' names are the
// ones tools/bench_torch.py pairs with torch.mm's (plain products: the residual's read is ours alone).
void bench_matmuls(Matmul& matmul, const Peaks& peaks) {
  // blocks: those that make it (none: the bf16 head's, --bf16-head, whose candidates are not timed)
  struct Linear { const char* name; BlockLinear linear; int in, out; bool residual; int blocks; };
  double saved_ms = 0;  // a micro-sequence's worth
  MatmulAlgorithms fastest;
  for (Linear l : {Linear{"qkv", BlockLinear::qkv, D, QKV, false, kAttentionBlocks},
                   Linear{"attn proj", BlockLinear::attn_proj, D, D, true, kAttentionBlocks},
                   Linear{"mlp fc", BlockLinear::mlp_fc, D, F, false, kBlocks},
                   Linear{"mlp proj", BlockLinear::mlp_proj, F, D, true, kBlocks},
                   Linear{"lm_head (bf16)", /*unused*/ BlockLinear::qkv, D, V, false, 0}}) {
    bf16 *x = random_bf16(size_t(T) * l.in, 1.0f, 3), *w = random_bf16(size_t(l.out) * l.in, 0.02f, 4);
    bf16 *y = device_alloc<bf16>(size_t(T) * l.out), *dx = device_alloc<bf16>(size_t(T) * l.in);
    bf16* residual = random_bf16(size_t(T) * l.out, 1.0f, 5);
    float* dw = device_alloc<float>(size_t(l.out) * l.in);
    CUDA_CHECK(cudaMemset(dw, 0, size_t(l.out) * l.in * sizeof(float)));
    const double flops = 2.0 * T * l.in * double(l.out);
    struct Product {
      LinearProduct product;
      std::string name;
      std::function<void(const MatmulOptions&)> run;
      void* out;
      size_t out_bytes;
    };
    const Product products[] = {
        {LinearProduct::fwd, "fwd " + std::to_string(T) + "x" + std::to_string(l.in) + "->" + std::to_string(l.out),
         [&](MatmulOptions o) {
           o.addend = l.residual ? residual : nullptr;
           matmul(x, Transpose::N, w, Transpose::T, y, T, l.out, l.in, CUDA_R_16BF, o, 0, 1.0f, l.residual ? 1.0f : 0.0f);
         },
         y, size_t(T) * l.out * sizeof(bf16)},
        {LinearProduct::dx, "dx",
         [&](const MatmulOptions& o) { matmul(y, Transpose::N, w, Transpose::N, dx, T, l.in, l.out, CUDA_R_16BF, o, 0); },
         dx, size_t(T) * l.in * sizeof(bf16)},
        {LinearProduct::dw, "dW (fp32 out)",
         [&](const MatmulOptions& o) { matmul(y, Transpose::T, x, Transpose::N, dw, l.out, l.in, T, CUDA_R_32F, o, 0, 1.0f, 1.0f); },
         dw, size_t(l.out) * l.in * sizeof(float)},
    };
    for (const Product& p : products) {
      const std::string name = "matmul " + std::string(l.name) + " " + p.name;
      auto with_candidate = [&](int c) {
        MatmulOptions o;
        o.candidate = c;
        p.run(o);
      };
      const float first = median_ms([&] { with_candidate(0); });
      row(name.c_str(), first, 0, flops, peaks);
      if (l.blocks == 0) continue;
      int best = 0;
      float best_ms = first;
      time_candidates(name, with_candidate, [&](int c, float ms) {
        if (ms >= best_ms || ms >= 0.99f * first) return;  // 1%: above the medians' noise
        if (!bitwise_reproducible([&] { with_candidate(c); }, p.out, p.out_bytes, p.product == LinearProduct::dw)) {
          std::printf("| %-38s | %8.3f | not bitwise reproducible: left out |\n",
                      ("  candidate " + std::to_string(c)).c_str(), ms);
          return;
        }
        best = c, best_ms = ms;
      });
      if (best == 0) continue;
      const std::string best_name = "  its fastest: candidate " + std::to_string(best);
      row(best_name.c_str(), best_ms, 0, flops, peaks);
      saved_ms += l.blocks * (first - best_ms);
      fastest.candidate[int(l.linear)][int(p.product)] = best;
    }
    for (void* p : {(void*)x, (void*)w, (void*)y, (void*)dx, (void*)residual, (void*)dw}) cudaFree(p);
  }
  std::printf("| %-38s | %8.3f | a micro-sequence; x8 a step at M = 8 |\n", "matmul: the fastest candidates save",
              saved_ms);
  std::printf("| %-38s | --matmul-algorithms %s |\n", "matmul: the fastest candidates' flag", fastest.text().c_str());
  // Issue 29, item 4: the MLP's fc product with ReLU² as cuBLASLt + the separate pass, against our
  // TMA / wgmma GEMM plain and with the ReLU² epilogue (kernels/gemm_epilogue.cuh). The fused row
  // wins if it beats the first row; the plain one says how far our GEMM is from cuBLASLt's.
  bf16 *h = random_bf16(size_t(T) * D, 1.0f, 5), *w_fc = random_bf16(size_t(F) * D, 0.02f, 6);
  bf16 *u = device_alloc<bf16>(size_t(T) * F), *a = device_alloc<bf16>(size_t(T) * F);
  const double fc_flops = 2.0 * T * D * double(F);
  row("mlp fc + relu^2: cuBLASLt, then the pass", median_ms([&] {
        matmul(h, Transpose::N, w_fc, Transpose::T, u, T, F, D, CUDA_R_16BF, 0);
        relu_squared_forward(u, a, size_t(T) * F, 0);
      }), 0, fc_flops, peaks);
  row("mlp fc: our gemm (TMA, wgmma), plain", median_ms([&] {
        using namespace gemm_epilogue;
        gemm<BLayout::k_major>(h, w_fc, u, T, F, D, Identity{}, 0);
      }), 0, fc_flops, peaks);
  row("mlp fc + relu^2: our gemm, fused epilogue", median_ms([&] { matmul_relu_squared(h, w_fc, a, T, F, D, 0); }), 0,
      fc_flops, peaks);
  // The backward's counterpart: the MLP proj's input gradient da = dy W_proj ([T, d] x [d, F]) and
  // ReLU²'s backward, du = da 2 relu(u).
  bf16 *dy = random_bf16(size_t(T) * D, 1.0f, 7), *w_proj = random_bf16(size_t(D) * F, 0.02f, 8);
  row("mlp proj dx + relu^2 bwd: cuBLASLt, then the pass", median_ms([&] {
        matmul(dy, Transpose::N, w_proj, Transpose::N, u, T, F, D, CUDA_R_16BF, 0);
        relu_squared_backward_from_square(a, u, u, size_t(T) * F, 0);
      }), 0, fc_flops, peaks);
  row("mlp proj dx: our gemm (N-major B), plain", median_ms([&] {
        using namespace gemm_epilogue;
        gemm<BLayout::n_major>(dy, w_proj, u, T, F, D, Identity{}, 0);
      }), 0, fc_flops, peaks);
  row("mlp proj dx + relu^2 bwd: our gemm, fused epilogue",
      median_ms([&] { matmul_relu_squared_backward(dy, w_proj, a, u, T, F, D, 0); }), 0, fc_flops, peaks);
  for (void* p : {(void*)h, (void*)w_fc, (void*)u, (void*)a, (void*)dy, (void*)w_proj}) cudaFree(p);

  // The attention's qkv product with QK norm, RoPE and the value mix (--qkv fused,
  // kernels/qkv_epilogue.cuh) against cuBLASLt + the two passes, and our GEMM plain at that shape.
  bf16 *h_attn = random_bf16(size_t(T) * D, 1.0f, 9), *w_qkv = random_bf16(size_t(3) * D * D, 0.02f, 10);
  bf16 *qkv = device_alloc<bf16>(size_t(T) * 3 * D), *ve = random_bf16(size_t(T) * D, 1.0f, 11);
  bf16 *q = device_alloc<bf16>(size_t(T) * D), *k = device_alloc<bf16>(size_t(T) * D), *v = device_alloc<bf16>(size_t(T) * D);
  float* lambdas = device_alloc<float>(2);
  CUDA_CHECK(cudaMemset(lambdas, 0, 2 * sizeof(float)));
  std::vector<float> table;
  rope_table_host(T, table);
  float* cos_sin = device_alloc<float>(table.size());
  CUDA_CHECK(cudaMemcpy(cos_sin, table.data(), table.size() * sizeof(float), cudaMemcpyHostToDevice));
  const double qkv_flops = 2.0 * T * D * 3.0 * D;
  row("qkv + qk norm + rope + v mix: cuBLASLt, passes", median_ms([&] {
        matmul(h_attn, Transpose::N, w_qkv, Transpose::T, qkv, T, 3 * D, D, CUDA_R_16BF, 0);
        qk_norm_rope_forward(qkv, cos_sin, q, k, T, D / kRopeHeadDim, 0);
        weighted_sum_forward(qkv + 2 * D, lambdas, ve, lambdas + 1, v, T, D, 3 * D, 0);
      }), 0, qkv_flops, peaks);
  row("qkv: our gemm, plain", median_ms([&] {
        using namespace gemm_epilogue;
        gemm<BLayout::k_major>(h_attn, w_qkv, qkv, T, 3 * D, D, Identity{}, 0);
      }), 0, qkv_flops, peaks);
  row("qkv + qk norm + rope + v mix: our gemm, fused", median_ms([&] {
        matmul_qkv_norm_rope(h_attn, w_qkv, qkv, q, k, v, cos_sin, lambdas, ve, lambdas + 1, T, D, 0);
      }), 0, qkv_flops, peaks);
  for (void* p : {(void*)h_attn, (void*)w_qkv, (void*)qkv, (void*)ve, (void*)q, (void*)k, (void*)v, (void*)lambdas,
                  (void*)cos_sin})
    cudaFree(p);
}

// Issue 29, item 4's other candidate: cuDNN's graph API fusing the same two epilogues (ReLU² after
// the fc product; 2 sqrt(a) times the proj's input gradient), the fastest of the heuristics' first
// plans (each timed), checked against cuBLASLt + the pass (relative error; bf16 rounding of the
// product before the pass puts it near 2e-3). A row saying "n/a" gives the reason instead of a time.
void bench_cudnn_fusions(Matmul& matmul, const Peaks& peaks) {
  const char* fc_name = "mlp fc + relu^2: cuDNN graph, fused";
  const char* proj_name = "mlp proj dx + relu^2 bwd: cuDNN graph";
  auto not_available = [&](const char* name, const std::string& why) {
    std::printf("| %-38s | n/a | %s |\n", name, why.c_str());
  };
#if __has_include(<cudnn_graph.h>)
  using namespace cudnn_fusion;
  std::string why_not;
  const Library* lib = Library::load(why_not);
  if (!lib) {
    for (const char* name : {fc_name, proj_name}) not_available(name, why_not);
    return;
  }
  const size_t n = size_t(T) * F;
  bf16 *x = random_bf16(size_t(T) * D, 1.0f, 5), *w_fc = random_bf16(size_t(F) * D, 0.02f, 6);
  bf16 *dy = random_bf16(size_t(T) * D, 1.0f, 7), *w_proj = random_bf16(size_t(D) * F, 0.02f, 8);
  DeviceBuffer<bf16> ref(n), square(n), out(n);
  float two = 2.0f;
  // The reference a = relu(x W_fc^T)^2 (also the backward's a), then the reference du.
  matmul(x, Transpose::N, w_fc, Transpose::T, ref.get(), T, F, D, CUDA_R_16BF, 0);
  relu_squared_forward(ref.get(), square.get(), n, 0);
  // Each row's failure (cuDNN's sub-libraries, a driver too old for them, no engine) prints its
  // reason and leaves the other sections to run.
  auto run = [&](const char* name, const std::function<Graph()>& build,
                 const std::vector<std::pair<int64_t, void*>>& tensors, const DeviceBuffer<bf16>& expected) {
    try {
      Handle handle(*lib, 0);
      const Graph graph = build();
      Descriptor op_graph = graph.operation_graph(handle.get());
      int refused = 0;
      std::string last_refusal;
      // cuDNN compiles a run-time fused engine's plan as it finalises it (seconds each): four plans
      // at most, and the time they took is printed.
      const auto planning_start = std::chrono::steady_clock::now();
      std::vector<Plan> candidates = plans(*lib, handle.get(), op_graph, 4, refused, last_refusal);
      const double planning_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - planning_start).count();
      size_t workspace_bytes = 0;
      for (const Plan& p : candidates) workspace_bytes = std::max(workspace_bytes, size_t(p.workspace_bytes));
      DeviceBuffer<char> workspace(workspace_bytes);
      const VariantPack pack(*lib, tensors, workspace.get());
      float best_ms = 0;
      const Plan* best = nullptr;
      int timed = 0;
      for (const Plan& p : candidates) {
        try {
          const float ms = median_ms([&] { execute(*lib, handle.get(), p, pack); });
          ++timed;
          if (!best || ms < best_ms) best_ms = ms, best = &p;
        } catch (const std::exception& e) {
          ++refused;
          last_refusal = e.what();
        }
      }
      if (!best) {
        not_available(name, "no plan ran (" + std::to_string(refused) + " refused; last: " + last_refusal + ")");
        return;
      }
      out.poison();
      execute(*lib, handle.get(), *best, pack);
      const double error = relative_error(to_double(out.download()), to_double(expected.download()));
      row(name, best_ms, 0, 2.0 * T * D * double(F), peaks);
      std::printf("| %-38s | %s, fastest of %d plans timed (%d refused; planning %.1f s), error %.1e against cuBLASLt + "
                  "the pass%s |\n",
                  "  (its plan and check)", best->engine.c_str(), timed, refused, planning_s, error,
                  error < 1e-2 ? "" : ": WRONG");
    } catch (const std::exception& e) {
      not_available(name, e.what());
    }
  };
  run(fc_name, [&] { return mlp_fc_relu_squared(*lib, T, F, D); }, {{kInput, x}, {kWeight, w_fc}, {kOutput, out.get()}},
      square);
  matmul(dy, Transpose::N, w_proj, Transpose::N, ref.get(), T, F, D, CUDA_R_16BF, 0);
  relu_squared_backward_from_square(square.get(), ref.get(), ref.get(), n, 0);
  run(proj_name, [&] { return mlp_proj_dx_relu_squared_backward(*lib, T, F, D); },
      {{kInput, dy}, {kWeight, w_proj}, {kSquare, square.get()}, {kTwo, &two}, {kOutput, out.get()}}, ref);
  for (void* p : {(void*)x, (void*)w_fc, (void*)dy, (void*)w_proj}) cudaFree(p);
#else
  (void)matmul, (void)peaks;
  for (const char* name : {fc_name, proj_name}) not_available(name, "built without cudnn_graph.h");
#endif
}

// The FP8 head of SPEC 1.5 over one micro-sequence: the T rows in chunks of 8192, as the model runs
// them (one chunk's gradient buffer, reused). The product rows time the cuBLASLt products alone,
// as bench_torch.py's _scaled_mm rows; the quantisations (plain + transposed copy) and the loss
// (cross-entropy writing the e5m2 gradient, then its transpose) are memory-bound rows; the last row
// is all the model runs per micro-sequence: the weight once, then forward, loss and backward of
// every chunk.
void bench_fp8_head(Matmul& matmul, const Peaks& peaks) {
  constexpr int kChunk = 8192, kChunks = T / kChunk;
  Fp8Head head(kChunk, V, D);
  bf16 *x = random_bf16(size_t(T) * D, 1.0f, 14), *loss_logits = random_bf16(size_t(kChunk) * V, 100.0f, 15);
  bf16 *w_bf16 = random_bf16(size_t(V) * D, 0.02f, 16), *dw_bf16 = random_bf16(size_t(V) * D, 1.0f, 17);
  bf16 *logits = device_alloc<bf16>(size_t(kChunk) * V), *dx = device_alloc<bf16>(size_t(T) * D);
  float *w = device_alloc<float>(size_t(V) * D), *dw = device_alloc<float>(size_t(V) * D);
  float* losses = device_alloc<float>(kChunk);
  uint16_t* targets = device_alloc<uint16_t>(kChunk);
  CUDA_CHECK(cudaMemset(targets, 1, kChunk * sizeof(uint16_t)));
  convert(w_bf16, w, size_t(V) * D, 0);
  convert(dw_bf16, dw, size_t(V) * D, 0);
  auto chunks = [&](const std::function<void(int)>& f) {
    for (int c = 0; c < kChunks; ++c) f(c);
  };
  auto x_chunk = [&](int c) { return x + size_t(c) * kChunk * D; };
  auto dx_chunk = [&](int c) { return dx + size_t(c) * kChunk * D; };
  head.quantize_weight(w, 0);
  // The products below reuse chunk 0's FP8 operands; the loss reads logits of a realistic spread.
  auto loss = [&] { head.loss_and_gradient(loss_logits, targets, losses, Softcap{}, 0); };
  head.forward(x, logits, kChunk, matmul, 0);
  loss();
  const double flops = 2.0 * T * D * double(V);  // one product over all chunks
  const float first_ms = median_ms([&] { chunks([&](int) { head.logits_product(logits, matmul, 0); }); });
  row("fp8 head fwd", first_ms, 0, flops, peaks, true);
  // cuBLASLt's other answers for the same product (--fp8-logits-algorithm N picks one for a run), and
  // the fastest that gives the same bits on a second run (1% below the first: the medians' noise)
  int best = 0;
  float best_ms = 0.99f * first_ms;
  time_candidates(
      "fp8 head fwd",
      [&](int c) {
        head.set_logits_candidate(c);
        chunks([&](int) { head.logits_product(logits, matmul, 0); });
      },
      [&](int c, float ms) {
        row(("fp8 head fwd, candidate " + std::to_string(c)).c_str(), ms, 0, flops, peaks, true);
        if (ms >= best_ms) return;
        if (bitwise_reproducible([&] { head.logits_product(logits, matmul, 0); }, logits,
                                 size_t(kChunk) * V * sizeof(bf16), /*adds_into_out=*/false))
          best = c, best_ms = ms;
        else
          std::printf("| %-38s | not bitwise reproducible: left out |\n", ("  candidate " + std::to_string(c)).c_str());
      });
  std::printf("| %-38s | --fp8-logits-algorithm %d |\n", "fp8 head fwd: the fastest candidate's flag", best);
  head.set_logits_candidate(0);
  row("fp8 head dx", median_ms([&] { chunks([&](int c) { head.grad_input_product(dx_chunk(c), matmul, 0); }); }), 0,
      flops, peaks, true);
  row("fp8 head dW (fp32 out)", median_ms([&] { chunks([&](int) { head.grad_weight_product(dw, matmul, 0); }); }), 0,
      flops, peaks, true);
  row("fp8 quantise x [8192, 768] x6 (+T)", median_ms([&] { chunks([&](int c) { head.quantize_input(x_chunk(c), kChunk, 0); }); }),
      4.0 * T * D, 0, peaks);
  // bytes: the logits read, the e5m2 gradient written, read and written transposed
  row("fp8 loss: cross-entropy -> e5m2 (+T) x6", median_ms([&] { chunks([&](int) { loss(); }); }), 5.0 * T * V, 0, peaks);
  row("fp8 quantise w [50304, 768] (+T)", median_ms([&] { head.quantize_weight(w, 0); }), 6.0 * V * D, 0, peaks);
  row("fp8 head + loss fwd+bwd (6 chunks, w once)", median_ms([&] {
        head.quantize_weight(w, 0);
        chunks([&](int c) {
          head.forward(x_chunk(c), logits, kChunk, matmul, 0);
          loss();
          head.backward(dx_chunk(c), dw, matmul, 0);
        });
      }), 0, 3 * flops, peaks, true);
  for (void* p : {(void*)x, (void*)loss_logits, (void*)w_bf16, (void*)dw_bf16, (void*)logits, (void*)dx, (void*)w,
                  (void*)dw, (void*)losses, (void*)targets})
    cudaFree(p);
}

// `count` matrices [m, n] for REKLS updates: random parameters and gradients, fresh state.
struct ReklsBenchGroup {
  ReklsBenchGroup(int count, int m, int n, uint64_t seed) {
    const size_t mn = size_t(m) * n, elems = ReklsBuffers::elems(m, n);
    init = random_bf16(2 * count * mn, 1.0f, seed);
    p = device_alloc<float>(count * mn);
    g = device_alloc<float>(count * mn);
    state = device_alloc<float>(count * elems);
    convert(init, p, count * mn, 0);
    convert(init + count * mn, g, count * mn, 0);
    for (int i = 0; i < count; ++i) {
      rekls_reset_state(state + i * elems, m, n, 0);
      matrices.push_back({p + i * mn, g + i * mn, state + i * elems});
    }
  }
  ~ReklsBenchGroup() {
    for (void* b : {(void*)init, (void*)p, (void*)g, (void*)state}) cudaFree(b);
  }
  ReklsBenchGroup(const ReklsBenchGroup&) = delete;
  ReklsBenchGroup& operator=(const ReklsBenchGroup&) = delete;
  bf16* init;
  float *p, *g, *state;
  std::vector<ReklsMatrix> matrices;
};

// One REKLS step of one matrix of each hidden shape [m, n] (kernels/rekls.cuh), with its eigenbases
// refreshed (REKLS's default, every step: 12 fp32 products and two syevd) and kept (8 products),
// beside the Muon rows; then the model's 68 hidden matrices on one rank (44 of [768, 768]: qkv as
// three and attn proj, 11 layers; 24 of [3072, 768] or its transpose: mlp fc and proj, 12 layers),
// summed from the rows. The FLOPs are the products' (each 2 m n times m or n; syevd's not
// counted), in fp32 without tensor cores: the "of peak" column, against bf16's, says little.
void bench_rekls(Matmul& matmul, const Peaks& peaks) {
  const std::vector<std::pair<int, int>> shapes = {{D, D}, {F, D}};
  Rekls rekls(shapes);
  double model_refreshed = 0, model_kept = 0;
  for (const auto& shape : shapes) {
    const int m = shape.first, n = shape.second;
    const size_t mn = size_t(m) * n;
    const ReklsBenchGroup matrix(1, m, n, 18);
    ReklsSettings refreshed, kept;
    kept.eigenbasis_every = 1 << 30;  // step t > 1: (t - 1) % every != 0, the basis kept
    rekls.update(matrix.matrices, m, n, refreshed, {1e-3f, 1, 1.0f}, matmul, 0);  // a first step fills the factors
    const double products = 2.0 * mn * (m + n);  // one product's FLOPs is 2 m n (m or n)
    char name[96];
    std::snprintf(name, sizeof name, "rekls step [%d, %d], bases refreshed", m, n);
    const float refreshed_ms =
        median_ms([&] { rekls.update(matrix.matrices, m, n, refreshed, {1e-3f, 2, 1.0f}, matmul, 0); });
    row(name, refreshed_ms, 0, 6 * products, peaks);
    std::snprintf(name, sizeof name, "rekls step [%d, %d], bases kept", m, n);
    const float kept_ms = median_ms([&] { rekls.update(matrix.matrices, m, n, kept, {1e-3f, 2, 1.0f}, matmul, 0); });
    row(name, kept_ms, 0, 4 * products, peaks);
    const int count = m == n ? 44 : 24;
    model_refreshed += count * refreshed_ms;
    model_kept += count * kept_ms;
  }
  std::printf("| %-38s | %8.3f | %-15s | %6s |\n", "rekls, 68 hidden matrices, refreshed", model_refreshed, "sum of rows", "");
  std::printf("| %-38s | %8.3f | %-15s | %6s |\n", "rekls, 68 hidden matrices, kept", model_kept, "sum of rows", "");
}

// Muon's update of a whole shape group on one rank (W = 1 owns all of it): momentum, the batched
// Newton-Schulz iteration, the apply. FLOPs are the iteration's matmuls.
void bench_muon(Matmul& matmul, const Peaks& peaks) {
  struct Group {
    const char* name;
    int count, rows, cols;
  };
  for (Group g : {Group{"muon group: 12 c_fc [3072, 768]", 12, F, D}, Group{"muon group: 33 qkv [768, 768]", 33, D, D}}) {
    const size_t n = size_t(g.rows) * g.cols;
    std::vector<float> host(size_t(g.count) * n);
    std::mt19937_64 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& x : host) x = normal(rng);
    float *p = device_alloc<float>(host.size()), *grad = device_alloc<float>(host.size()), *momentum = device_alloc<float>(host.size());
    for (float* b : {p, grad, momentum}) CUDA_CHECK(cudaMemcpy(b, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
    std::vector<MuonMatrix> matrices;
    for (int i = 0; i < g.count; ++i) matrices.push_back({p + i * n, grad + i * n, momentum + i * n});
    MuonWorkspace ws(g.count * n, g.count);
    const double r = std::min(g.rows, g.cols), k = std::max(g.rows, g.cols);
    const double flops = g.count * kNewtonSchulzSteps * (4 * r * r * k + 2 * r * r * r);
    row(g.name, median_ms([&] { muon_update(matrices, g.rows, g.cols, {0.05f, 0.95f, 1.0f}, ws, matmul, 0); }), 0, flops,
        peaks);
    for (float* b : {p, grad, momentum}) cudaFree(b);
  }
}

void bench_memory_bound(const Peaks& peaks) {
  bf16 *x = random_bf16(size_t(T) * D, 2.0f, 5), *y = device_alloc<bf16>(size_t(T) * D), *g = random_bf16(size_t(T) * D, 1.0f, 6);
  row("rmsnorm fwd [49152, 768]", median_ms([&] { rmsnorm_forward(x, y, T, D, 0); }), 2.0 * T * D * 2, 0, peaks);
  row("rmsnorm bwd [49152, 768] (accumulate)", median_ms([&] { rmsnorm_backward(x, g, y, T, D, true, 0); }), 4.0 * T * D * 2, 0, peaks);
  bf16 *u = random_bf16(size_t(T) * F, 1.0f, 7), *a = device_alloc<bf16>(size_t(T) * F);
  row("relu^2 fwd [49152, 3072]", median_ms([&] { relu_squared_forward(u, a, size_t(T) * F, 0); }), 2.0 * T * F * 2, 0, peaks);
  row("relu^2 bwd [49152, 3072]", median_ms([&] { relu_squared_backward(u, a, a, size_t(T) * F, 0); }), 3.0 * T * F * 2, 0, peaks);
  bf16 *qkv = random_bf16(size_t(T) * QKV, 1.0f, 8), *q = device_alloc<bf16>(size_t(T) * D), *k = device_alloc<bf16>(size_t(T) * D);
  std::vector<float> cs;
  rope_table_host(T, cs);
  float* cos_sin = device_alloc<float>(cs.size());
  CUDA_CHECK(cudaMemcpy(cos_sin, cs.data(), cs.size() * 4, cudaMemcpyHostToDevice));
  double rope_bytes = 4.0 * T * D * 2 + cs.size() * 4.0;  // read q, k parts; write q, k; table
  row("qk-norm+rope fwd [49152, 6, 128] x2", median_ms([&] { qk_norm_rope_forward(qkv, cos_sin, q, k, T, H, 0); }), rope_bytes, 0, peaks);
  row("qk-norm+rope bwd", median_ms([&] { qk_norm_rope_backward(qkv, q, k, cos_sin, qkv, T, H, 0); }), 6.0 * T * D * 2 + cs.size() * 4.0, 0, peaks);
  bf16* logits = random_bf16(size_t(T) * V, 100.0f, 9);
  uint16_t* targets = device_alloc<uint16_t>(T);
  CUDA_CHECK(cudaMemset(targets, 1, T * sizeof(uint16_t)));
  float* losses = device_alloc<float>(T);
  // Timed on the same buffer: after the first call it holds gradients, which are valid logits too.
  row("cross-entropy fwd+bwd [49152, 50304]", median_ms([&] { softcap_cross_entropy(logits, targets, losses, T, V, 1.0f, 0); }),
      2.0 * T * V * 2, 0, peaks);
  // The FP8 head's variant (e5m2 gradient out, as the trainer runs it) with each pass's share of
  // exponentials on the FMA pipe (kCrossEntropyFmaExps, kCrossEntropySecondPassFmaExps: 6 + 0)
  fp8* gradient_f8 = device_alloc<fp8>(size_t(T) * V);
  auto split = [&](auto first, auto second) {
    constexpr int k1 = decltype(first)::value, k2 = decltype(second)::value;
    char name[96];
    std::snprintf(name, sizeof name, "cross-entropy -> e5m2, %d + %d of 8 exp2 on FMA", k1, k2);
    row(name, median_ms([&] {
          softcap_cross_entropy<k1, k2>(logits, targets, losses, T, V, 1.0f, E5m2Gradient{gradient_f8, 448.0f}, 0,
                                        Softcap{});
        }),
        3.0 * T * V, 0, peaks);
  };
  using std::integral_constant;
  split(integral_constant<int, 0>{}, integral_constant<int, 0>{});
  split(integral_constant<int, 4>{}, integral_constant<int, 0>{});
  split(integral_constant<int, 5>{}, integral_constant<int, 0>{});
  split(integral_constant<int, 6>{}, integral_constant<int, 0>{});
  split(integral_constant<int, 7>{}, integral_constant<int, 0>{});
  split(integral_constant<int, 8>{}, integral_constant<int, 0>{});
  split(integral_constant<int, 6>{}, integral_constant<int, 2>{});
  split(integral_constant<int, 6>{}, integral_constant<int, 4>{});
  cudaFree(gradient_f8);
  const int64_t adam_n = int64_t(V) * D;
  float *p = device_alloc<float>(adam_n), *m = device_alloc<float>(adam_n), *v = device_alloc<float>(adam_n), *gr = device_alloc<float>(adam_n);
  for (float* b : {p, m, v, gr}) CUDA_CHECK(cudaMemset(b, 0x3c, adam_n * 4));  // ~0.01: positive, non-zero
  AdamStep step{0.22f};
  step.t = 1;
  step.grad_scale = 0.125f;
  row("adam fp32 [50304 x 768]", median_ms([&] { adam_update(p, gr, m, v, adam_n, step, 0); }), 7.0 * adam_n * 4, 0, peaks);
  for (void* b : {(void*)x, (void*)y, (void*)g, (void*)u, (void*)a, (void*)qkv, (void*)q, (void*)k, (void*)cos_sin,
                  (void*)logits, (void*)targets, (void*)losses, (void*)p, (void*)m, (void*)v, (void*)gr})
    cudaFree(b);
}

// The step's kernels that the sections above leave out, at the record's shapes: the embedding
// backward on real text's tokens (the first T of the bundled sample: a block per distinct token, so a
// frequent one, 198 "\n" above all, makes a long block), the residual and value mixes forward and
// backward (with both scalar gradients, dy accumulated, as the blocks' backward runs it), add_into,
// and the FP8 head's transpose of its e5m2 gradient apart from the cross-entropy.
void bench_step_rest(const Peaks& peaks) {
  std::vector<uint16_t> shard = read_shard("data/sample/sample_train_000001.bin", kTokenizerVocab);
  std::vector<int> count(V, 0);
  for (int t = 0; t < T; ++t) ++count[shard[t]];
  const int most = int(std::max_element(count.begin(), count.end()) - count.begin());
  StagedUploads uploads;
  uploads.reset(EmbeddingBackwardPlan::upload_bytes(T));
  EmbeddingBackwardPlan plan(shard.data(), T, V, uploads, 0);
  char name[96];
  const int distinct = int(std::count_if(count.begin(), count.end(), [](int c) { return c > 0; }));
  std::snprintf(name, sizeof name, "embedding: %d distinct tokens, %d x %d", distinct, count[most], most);
  std::printf("| %-38s | %8s | %-15s | %6s |\n", name, "", "", "");
  bf16 *dout = random_bf16(size_t(T) * D, 1.0f, 21), *x = random_bf16(size_t(T) * D, 1.0f, 22);
  bf16 *y = random_bf16(size_t(T) * D, 1.0f, 23), *out = device_alloc<bf16>(size_t(T) * D);
  bf16* dy = random_bf16(size_t(T) * D, 1.0f, 24);
  float *grad = device_alloc<float>(size_t(V) * D), *scratch = device_alloc<float>(EmbeddingBackwardPlan::scratch_rows(T) * D);
  CUDA_CHECK(cudaMemset(grad, 0, size_t(V) * D * sizeof(float)));  // accumulated into, as the step does
  // the op's own bytes: dout read, each distinct token's fp32 row read and written, the plan's
  // indices (not the split tokens' segment sums, which the second pass reads back)
  row("embedding bwd [49152 real tokens, 768]",
      median_ms([&] { embedding_backward(plan, dout, grad, nullptr, D, scratch, 0); }),
      2.0 * T * D + 8.0 * distinct * D + 4.0 * (T + 3 * plan.segments()), 0, peaks);
  std::vector<float> host_scalars = {0.7f, 0.3f, 0.0f, 0.0f};
  float* scalars = device_alloc<float>(host_scalars.size());
  float* mix_scratch = device_alloc<float>(kScalarReductionScratchFloats);
  CUDA_CHECK(cudaMemcpy(scalars, host_scalars.data(), host_scalars.size() * sizeof(float), cudaMemcpyHostToDevice));
  row("mix fwd a x + b y [49152, 768]",
      median_ms([&] { weighted_sum_forward(x, scalars, y, scalars + 1, out, T, D, D, 0); }), 3.0 * T * D * 2, 0, peaks);
  // read dout, x, y, dy; write dx, dy
  row("mix bwd (dx, dy +=, da, db) [49152, 768]", median_ms([&] {
        weighted_sum_backward(dout, x, scalars, scalars + 2, y, scalars + 1, scalars + 3, out, dy, true, T, D, D,
                              mix_scratch, 0);
      }), 6.0 * T * D * 2, 0, peaks);
  row("add_into [49152, 768]", median_ms([&] { add_into(x, out, size_t(T) * D, 0); }), 3.0 * T * D * 2, 0, peaks);
  constexpr int kChunk = 8192;
  // the bytes of random bf16 values: a transpose moves bytes, whatever they encode
  fp8 *g = reinterpret_cast<fp8*>(random_bf16(size_t(kChunk) * V / 2, 1.0f, 25)), *g_t = device_alloc<fp8>(size_t(kChunk) * V);
  row("fp8 transpose e5m2 grad [8192, 50304] x6", median_ms([&] {
        for (int c = 0; c < T / kChunk; ++c) fp8_transpose(g, g_t, kChunk, V, 0);
      }), 2.0 * T * V, 0, peaks);
  for (void* b : {(void*)dout, (void*)x, (void*)y, (void*)out, (void*)dy, (void*)grad, (void*)scratch, (void*)scalars,
                  (void*)mix_scratch, (void*)g, (void*)g_t})
    cudaFree(b);
}

// Programmatic dependent launch (--launch-overlap pdl): a chain of 200 add_into kernels of 8,192 x
// 768 (about 10 us each, so that the GPU, not the launching CPU, sets the pace) on the legacy
// default stream and on a created one, without and with PDL. A kernel boundary's cost is the
// difference per kernel; the trainer's step has about 2,500-3,300 boundaries that end in a kernel
// of ours (docs/PERF.md, 2026-11-29).
void bench_launch_overlap() {
  constexpr int kChain = 200;
  constexpr size_t n = size_t(8192) * D;
  bf16 *x = random_bf16(n, 1.0f, 26), *out = random_bf16(n, 1.0f, 27);
  cudaStream_t created = nullptr;
  CUDA_CHECK(cudaStreamCreate(&created));  // blocking: the legacy stream's timing events wait for it
  for (cudaStream_t stream : {cudaStream_t(nullptr), created})
    for (bool pdl : {false, true}) {
      programmatic_dependent_launch = pdl;
      const float ms = median_ms([&] {
        for (int i = 0; i < kChain; ++i) add_into(x, out, n, stream);
      });
      programmatic_dependent_launch = false;
      char name[64];
      std::snprintf(name, sizeof name, "200 x add_into [8192, 768], %s, %s", stream ? "created" : "legacy",
                    pdl ? "PDL" : "no PDL");
      std::printf("| %-38s | %8.3f | %6.2f us/kernel |        |\n", name, ms, 1000 * ms / kChain);
    }
  CUDA_CHECK(cudaStreamDestroy(created));
  cudaFree(x);
  cudaFree(out);
}

// Attention on the documents of real text (the first T tokens of the bundled sample shard), for
// several windows. FLOPs count the allowed (query, key) pairs only: 4 * 128 per pair and head
// forward (QK^T, PV), 2.5 times that backward (the usual convention, recomputation not counted).
void bench_attention(const Peaks& peaks) {
  std::vector<uint16_t> shard = read_shard("data/sample/sample_train_000001.bin", kTokenizerVocab);
  std::vector<int32_t> docs = attention_document_ids(shard.data(), T, 50256);
  std::printf("| %-38s | %8d | %-15s | %6s |\n", "attention: documents in the T tokens", docs.back(), "", "");
  bf16 *q = random_bf16(size_t(T) * D, 1.0f, 10), *k = random_bf16(size_t(T) * D, 1.0f, 11);
  bf16 *v = random_bf16(size_t(T) * D, 1.0f, 12), *dy = random_bf16(size_t(T) * D, 1.0f, 13);
  bf16 *y = device_alloc<bf16>(size_t(T) * D), *dq = device_alloc<bf16>(size_t(T) * D);
  bf16 *dk = device_alloc<bf16>(size_t(T) * D), *dv = device_alloc<bf16>(size_t(T) * D);
  float *lse = device_alloc<float>(size_t(T) * H), *scratch = device_alloc<float>(attention_backward_scratch_floats(T, H));
  // the backward of the QK norm, RoPE and the value mix (--qkv-backward: passes, or in the attention
  // backward): the raw qkv, a value embedding, the mix's scalars (sa0, sa1, then their gradients)
  bf16 *qkv = random_bf16(size_t(T) * 3 * D, 1.0f, 14), *dqkv = device_alloc<bf16>(size_t(T) * 3 * D);
  bf16* ve = random_bf16(size_t(T) * D, 1.0f, 15);
  const std::vector<float> host_scalars = {0.75f, -0.375f, 0.0f, 0.0f};
  float *scalars = device_alloc<float>(host_scalars.size()), *reduction = device_alloc<float>(kScalarReductionScratchFloats);
  CUDA_CHECK(cudaMemcpy(scalars, host_scalars.data(), host_scalars.size() * sizeof(float), cudaMemcpyHostToDevice));
  std::vector<float> table;
  rope_table_host(T, table);
  float* cos_sin = device_alloc<float>(table.size());
  CUDA_CHECK(cudaMemcpy(cos_sin, table.data(), table.size() * sizeof(float), cudaMemcpyHostToDevice));
  AttentionTensors a{T, H, D, D, D};
  StagedUploads uploads;
  for (int window : {1, 2, 4, 7, 10, 14}) {
    AttentionBlockLists lists = build_attention_blocks(docs, window);
    uploads.reset(AttentionMask::upload_bytes(docs, lists));
    AttentionMask mask(docs, lists, uploads, 0);
    double pairs = 0;  // allowed (query, key) pairs: same document, causal, in a listed block
    for (int qb = 0; qb < lists.num_blocks; ++qb)
      for (int j = 0; j < lists.kv_count[qb]; ++j)
        for (int t = qb * 128, kb = lists.kv_index[size_t(qb) * lists.max_kv + j]; t < qb * 128 + 128; ++t)
          for (int s = kb * 128; s < kb * 128 + 128; ++s) pairs += s <= t && docs[s] == docs[t];
    double fwd_flops = 4.0 * 128 * H * pairs;
    char name[64];
    std::snprintf(name, sizeof name, "flash attention fwd, window %2d blocks", window);
    row(name, median_ms([&] { flash_attention_forward(q, k, v, y, lse, a, mask, 0); }), 0, fwd_flops, peaks);
    std::snprintf(name, sizeof name, "flash attention fwd ws, window %2d", window);
    row(name, median_ms([&] { flash_attention_forward_ws(q, k, v, y, lse, a, mask, 0); }), 0, fwd_flops, peaks);
    std::snprintf(name, sizeof name, "flash attention bwd, window %2d blocks", window);
    row(name, median_ms([&] { flash_attention_backward(q, k, v, y, dy, lse, scratch, dq, dk, dv, a, mask, 0); }), 0,
        2.5 * fwd_flops, peaks);
    // with a value embedding, as 6 of the 11 attention layers: dv is written for its table either way
    std::snprintf(name, sizeof name, "flash bwd + qkv passes, window %2d", window);
    row(name, median_ms([&] {
          flash_attention_backward(q, k, v, y, dy, lse, scratch, dq, dk, dv, a, mask, 0);
          weighted_sum_backward(dv, qkv + 2 * D, scalars, scalars + 2, ve, scalars + 1, scalars + 3, dqkv + 2 * D,
                                nullptr, false, T, D, 3 * D, reduction, 0);
          qk_norm_rope_backward(qkv, dq, dk, cos_sin, dqkv, T, H, 0);
        }), 0, 2.5 * fwd_flops, peaks);
    std::snprintf(name, sizeof name, "flash bwd into dqkv, window %2d", window);
    row(name, median_ms([&] {
          flash_attention_backward_into_dqkv(q, k, v, y, dy, lse, scratch, {qkv, cos_sin, scalars, ve, dqkv, dv},
                                             scalars + 2, scalars + 3, a, mask, 0);
        }), 0, 2.5 * fwd_flops, peaks);
    std::snprintf(name, sizeof name, "flash attention bwd split, window %2d", window);
    row(name,
        median_ms([&] { flash_attention_backward_split(q, k, v, y, dy, lse, scratch, dq, dk, dv, a, mask, 0); }), 0,
        2.5 * fwd_flops, peaks);
    if (window == 14) {
      row("baseline attention fwd, window 14", median_ms([&] { attention_forward(q, k, v, y, lse, a, mask, 0); }), 0,
          fwd_flops, peaks);
      row("baseline attention bwd, window 14",
          median_ms([&] { attention_backward(q, k, v, y, dy, lse, scratch, dq, dk, dv, a, mask, 0); }), 0, 2.5 * fwd_flops,
          peaks);
    }
  }
  for (void* b : {(void*)q, (void*)k, (void*)v, (void*)dy, (void*)y, (void*)dq, (void*)dk, (void*)dv, (void*)lse,
                  (void*)scratch, (void*)qkv, (void*)dqkv, (void*)cos_sin, (void*)ve, (void*)scalars, (void*)reduction})
    cudaFree(b);
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (argc > 1) g_repeats = std::max(1, std::atoi(argv[1]));
  const std::vector<std::string> all = {"matmul", "fp8", "muon", "rekls", "memory", "step", "attention"};
  std::vector<std::string> sections(argv + std::min(argc, 2), argv + argc);
  for (const std::string& section : sections)
    if (std::find(all.begin(), all.end(), section) == all.end()) {
      std::string known;
      for (const std::string& name : all) known += (known.empty() ? "" : ", ") + name;
      std::fprintf(stderr, "error: unknown section '%s' (%s)\n", section.c_str(), known.c_str());
      return 2;
    }
  if (sections.empty()) sections = all;
  auto wanted = [&](const char* section) { return std::find(sections.begin(), sections.end(), section) != sections.end(); };
  try {
    require_hopper_gpu(0);
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("%s, %d SMs, median of %d runs\n\n", prop.name, prop.multiProcessorCount, g_repeats);
    std::printf("| %-38s | %8s | %-15s | %6s |\n|---|---|---|---|\n", "kernel", "ms", "achieved", "of peak");
    Matmul matmul;
    Peaks peaks = measure_peaks(matmul);
    if (wanted("matmul")) bench_matmuls(matmul, peaks);
    if (wanted("fp8")) bench_fp8_head(matmul, peaks);
    if (wanted("muon")) bench_muon(matmul, peaks);
    if (wanted("rekls")) bench_rekls(matmul, peaks);
    if (wanted("memory")) bench_memory_bound(peaks);
    if (wanted("step")) {
      bench_step_rest(peaks);
      bench_launch_overlap();
    }
    if (wanted("attention")) bench_attention(peaks);
    // Last: cuDNN's run-time compiled kernels have never run on our machines, and a fault of
    // theirs would end every row after them.
    if (wanted("matmul")) bench_cudnn_fusions(matmul, peaks);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
