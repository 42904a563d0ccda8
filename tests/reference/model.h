// CPU reference of the record-#25 GPT (SPEC Part 1): forward and backward of one packed
// micro-sequence, in double precision. It is the oracle for every GPU kernel and for the sharded
// optimizers. Parameters arrive as double views (the caller keeps fp32 or fp64 masters); gradients
// are SUMMED into double buffers, so micro-sequences accumulate by repeated calls (SPEC 4.2).
#pragma once
#include "reference/attention_mask.h"
#include "reference/fp8.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

struct ModelConfig {
  int num_layers = 12;
  int model_dim = 768;
  int num_heads = 6;
  int head_dim = 128;
  int vocab_size = 50304;  // 50257 padded to a multiple of 128; the pad takes part in the softmax
  int block_size = 128;    // attention block granularity
  int bos_token = 50256;
  double attn_scale = 0.12;
  // F.rms_norm's default eps on bf16 activations is finfo(float32).eps, the type it computes in.
  double rms_eps = 1.1920928955078125e-07;
  double softcap = 30.0;        // logits = softcap * sigmoid(logits / softcap_divisor)
  double softcap_divisor = 7.5 * std::sqrt(768.0);
  bool fp8_head = false;        // training forward rounds lm_head operands to FP8 (SPEC 1.5)
  std::vector<bool> has_attention;  // [num_layers]
  std::vector<int> value_embed;     // [num_layers]: value-embedding table of the layer, or -1
  std::vector<bool> long_window;    // [num_layers]: long (W) or short (W/2) window
  int num_value_embeds = 3;

  int inner_dim() const { return num_heads * head_dim; }
  int mlp_dim() const { return 4 * model_dim; }
  int num_skips() const { return num_layers / 2; }
  // scalars: [0:L) skip weights, [L:3L) block lambdas, [3L:5L) SA lambdas, ones to a multiple of 8.
  int num_scalars() const { return (5 * num_layers + 7) / 8 * 8; }
  int skip_weight_index(int i) const { return i; }
  int block_lambda_index(int layer, int k) const { return num_layers + 2 * layer + k; }
  int sa_lambda_index(int layer, int k) const { return 3 * num_layers + 2 * layer + k; }

  // The record's layer pattern for 12 layers: layer 7 without attention, value embeddings
  // 0,1,2 ... 0,1,2 on the first and last three layers, long/short windows L S S S L S S L S S S L.
  static ModelConfig with_record_pattern(ModelConfig c) {
    if (c.num_layers != 12) throw std::invalid_argument("the record pattern needs 12 layers");
    c.has_attention.assign(12, true);
    c.has_attention[7] = false;
    c.value_embed = {0, 1, 2, -1, -1, -1, -1, -1, -1, 0, 1, 2};
    c.long_window = {true, false, false, false, true, false, false, true, false, false, false, true};
    c.softcap_divisor = 7.5 * std::sqrt(double(c.model_dim));
    return c;
  }
  static ModelConfig record() { return with_record_pattern(ModelConfig{}); }
  // Same structure, tiny shapes: 12 layers, dim 32, 2 heads of 16, vocab 96, blocks of 8 tokens.
  static ModelConfig tiny() {
    ModelConfig c;
    c.model_dim = 32;
    c.num_heads = 2;
    c.head_dim = 16;
    c.vocab_size = 96;
    c.block_size = 8;
    c.bos_token = 95;
    return with_record_pattern(c);
  }
};

enum class ParamRole { embed, value_embed, qkv, attn_proj, mlp_fc, mlp_proj, lm_head, scalars };

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  ParamRole role;
  int layer;  // -1 for parameters outside the blocks
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

// The parameters in module order (embed, value embeds, blocks, lm_head, scalars), as the reference.
inline std::vector<ParamSpec> param_specs(const ModelConfig& c) {
  const int64_t V = c.vocab_size, d = c.model_dim, I = c.inner_dim(), F = c.mlp_dim();
  std::vector<ParamSpec> specs{{"embed.weight", {V, d}, ParamRole::embed, -1}};
  for (int k = 0; k < c.num_value_embeds; ++k)
    specs.push_back({"value_embeds." + std::to_string(k) + ".weight", {V, d}, ParamRole::value_embed, k});
  for (int i = 0; i < c.num_layers; ++i) {
    std::string b = "blocks." + std::to_string(i) + ".";
    if (c.has_attention[i]) {
      specs.push_back({b + "attn.qkv_w", {3, I, d}, ParamRole::qkv, i});
      specs.push_back({b + "attn.c_proj.weight", {d, I}, ParamRole::attn_proj, i});
    }
    specs.push_back({b + "mlp.c_fc.weight", {F, d}, ParamRole::mlp_fc, i});
    specs.push_back({b + "mlp.c_proj.weight", {d, F}, ParamRole::mlp_proj, i});
  }
  specs.push_back({"lm_head.weight", {V, d}, ParamRole::lm_head, -1});
  specs.push_back({"scalars", {c.num_scalars()}, ParamRole::scalars, -1});
  return specs;
}

// Where each parameter sits in the param_specs() list.
struct ParamIndex {
  int embed = -1, lm_head = -1, scalars = -1;
  std::vector<int> value_embed, qkv, attn_proj, mlp_fc, mlp_proj;  // -1 where a layer has none

  explicit ParamIndex(const ModelConfig& c)
      : value_embed(c.num_value_embeds, -1), qkv(c.num_layers, -1), attn_proj(c.num_layers, -1),
        mlp_fc(c.num_layers, -1), mlp_proj(c.num_layers, -1) {
    std::vector<ParamSpec> specs = param_specs(c);
    for (int p = 0; p < int(specs.size()); ++p) {
      const ParamSpec& s = specs[p];
      switch (s.role) {
        case ParamRole::embed: embed = p; break;
        case ParamRole::value_embed: value_embed[s.layer] = p; break;
        case ParamRole::qkv: qkv[s.layer] = p; break;
        case ParamRole::attn_proj: attn_proj[s.layer] = p; break;
        case ParamRole::mlp_fc: mlp_fc[s.layer] = p; break;
        case ParamRole::mlp_proj: mlp_proj[s.layer] = p; break;
        case ParamRole::lm_head: lm_head = p; break;
        case ParamRole::scalars: scalars = p; break;
      }
    }
  }
};

using Tensors = std::vector<std::vector<double>>;  // one flat row-major buffer per parameter

inline Tensors zeros_like_params(const ModelConfig& c) {
  Tensors t;
  for (const ParamSpec& s : param_specs(c)) t.emplace_back(s.numel(), 0.0);
  return t;
}

// SPEC 1.6: linear weights U(+-sqrt(3) * 0.5 / sqrt(fan_in)), projections and lm_head zero,
// embeddings N(0, 1), scalars ones / (1, 0) / (0.5, 0.5). With random_everything, the zero-initialised
// weights are drawn like c_fc and the scalars are perturbed, so that every gradient is non-trivial
// (gradient checks, the oracle).
inline Tensors init_params(const ModelConfig& c, uint64_t seed, bool random_everything = false) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  double bound = std::sqrt(3.0) * 0.5 / std::sqrt(double(c.model_dim));
  std::uniform_real_distribution<double> linear(-bound, bound);
  std::uniform_real_distribution<double> jitter(-0.2, 0.2);
  std::vector<ParamSpec> specs = param_specs(c);
  Tensors params = zeros_like_params(c);
  for (size_t p = 0; p < specs.size(); ++p) {
    std::vector<double>& w = params[p];
    switch (specs[p].role) {
      case ParamRole::embed:
      case ParamRole::value_embed:
        for (double& v : w) v = normal(rng);
        break;
      case ParamRole::qkv:
      case ParamRole::mlp_fc:
        for (double& v : w) v = linear(rng);
        break;
      case ParamRole::attn_proj:
      case ParamRole::mlp_proj:
      case ParamRole::lm_head:
        if (random_everything) {
          double b = std::sqrt(3.0) * 0.5 / std::sqrt(double(specs[p].shape[1]));
          std::uniform_real_distribution<double> proj(-b, b);
          for (double& v : w) v = proj(rng);
        }
        break;
      case ParamRole::scalars:
        for (double& v : w) v = 1.0;
        for (int i = 0; i < c.num_layers; ++i) {
          w[c.block_lambda_index(i, 1)] = 0.0;
          w[c.sa_lambda_index(i, 0)] = 0.5;
          w[c.sa_lambda_index(i, 1)] = 0.5;
        }
        if (random_everything)
          for (double& v : w) v += jitter(rng);
        break;
    }
  }
  return params;
}

namespace ref {

// out[t, n] = sum_k a[t, k] * b[k, n], each sum in k order from 0. Written as row updates
// (out[t, :] += a[t, k] b[k, :]) so that the compiler vectorises across n without reordering any
// sum: the results are those of the plain dot-product loops, several times faster. Four rows at a
// time share each load of b's row, and where the CPU has AVX2 a clone of the loops runs 4 doubles a
// vector (no FMA: each product rounded before its add, as before, so the sums are bitwise the same):
// about 1.45x over SSE2 rows one at a time on the development machine, where the CPU reference
// (Newton-Schulz, the model's products) is most of the emulated training tests' time.
__attribute__((target_clones("avx2", "default"))) inline void matmul_nn(const double* a, const double* b, double* out,
                                                                       int T, int K, int N) {
  int t = 0;
  for (; t + 4 <= T; t += 4) {
    double* __restrict__ r0 = out + size_t(t) * N;
    double* __restrict__ r1 = r0 + N;
    double* __restrict__ r2 = r1 + N;
    double* __restrict__ r3 = r2 + N;
    std::fill(r0, r0 + 4 * size_t(N), 0.0);
    const double *a0 = a + size_t(t) * K, *a1 = a0 + K, *a2 = a1 + K, *a3 = a2 + K;
    for (int k = 0; k < K; ++k) {
      const double s0 = a0[k], s1 = a1[k], s2 = a2[k], s3 = a3[k];
      const double* __restrict__ b_row = b + size_t(k) * N;
      for (int n = 0; n < N; ++n) {
        const double x = b_row[n];
        r0[n] += s0 * x;
        r1[n] += s1 * x;
        r2[n] += s2 * x;
        r3[n] += s3 * x;
      }
    }
  }
  for (; t < T; ++t) {
    double* row = out + size_t(t) * N;
    std::fill(row, row + N, 0.0);
    for (int k = 0; k < K; ++k) {
      const double s = a[size_t(t) * K + k];
      const double* b_row = b + size_t(k) * N;
      for (int n = 0; n < N; ++n) row[n] += s * b_row[n];
    }
  }
}

// x [rows, cols] -> [cols, rows]
inline std::vector<double> transposed(const double* x, int rows, int cols) {
  std::vector<double> t(size_t(rows) * cols);
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) t[size_t(j) * rows + i] = x[size_t(i) * cols + j];
  return t;
}

// out[t, n] = sum_k a[t, k] * w[n, k]   (y = x W^T, as nn.Linear)
inline void matmul_nt(const double* a, const double* w, double* out, int T, int K, int N) {
  matmul_nn(a, transposed(w, N, K).data(), out, T, K, N);
}

// Backward of y = a W^T: da[t, k] = sum_n dy[t, n] w[n, k] (overwrites), dw[n, k] += sum_t dy[t, n] a[t, k].
inline void matmul_nt_backward(const double* a, const double* w, const double* dy, double* da,
                               double* dw, int T, int K, int N) {
  matmul_nn(dy, w, da, T, N, K);
  std::vector<double> dw_step(size_t(N) * K);
  matmul_nn(transposed(dy, T, N).data(), a, dw_step.data(), N, T, K);
  for (size_t i = 0; i < dw_step.size(); ++i) dw[i] += dw_step[i];
}

// y = x / sqrt(mean(x^2) + eps) over rows of length n (no weight).
inline void rmsnorm(const double* x, double* y, int rows, int n, double eps) {
  for (int r = 0; r < rows; ++r) {
    double ms = 0;
    for (int i = 0; i < n; ++i) ms += x[r * n + i] * x[r * n + i];
    double inv = 1.0 / std::sqrt(ms / n + eps);
    for (int i = 0; i < n; ++i) y[r * n + i] = x[r * n + i] * inv;
  }
}

// dx += d(rmsnorm)/dx applied to dy.
inline void rmsnorm_backward(const double* x, const double* dy, double* dx, int rows, int n, double eps) {
  for (int r = 0; r < rows; ++r) {
    double ms = 0, dot = 0;
    for (int i = 0; i < n; ++i) {
      ms += x[r * n + i] * x[r * n + i];
      dot += x[r * n + i] * dy[r * n + i];
    }
    double inv = 1.0 / std::sqrt(ms / n + eps);
    for (int i = 0; i < n; ++i)
      dx[r * n + i] += inv * dy[r * n + i] - inv * inv * inv * x[r * n + i] * dot / n;
  }
}

// Half-truncated RoPE (SPEC 1.3): head_dim/4 frequencies (1/1024)^linspace(0,1), then head_dim/4 zeros.
inline std::vector<double> rope_frequencies(int head_dim) {
  int n = head_dim / 4;
  std::vector<double> f(head_dim / 2, 0.0);
  for (int j = 0; j < n; ++j) f[j] = std::pow(1.0 / 1024, n > 1 ? double(j) / (n - 1) : 0.0);
  return f;
}

// In place on x [T, heads, head_dim]; position = token index. inverse=true applies the transpose
// (the backward of the rotation).
inline void rope(double* x, int T, int heads, int head_dim, bool inverse) {
  std::vector<double> freq = rope_frequencies(head_dim);
  int half = head_dim / 2;
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < heads; ++h) {
      double* v = x + (size_t(t) * heads + h) * head_dim;
      for (int j = 0; j < half; ++j) {
        double c = std::cos(t * freq[j]), s = std::sin(t * freq[j]);
        if (inverse) s = -s;
        double x1 = v[j], x2 = v[j + half];
        v[j] = x1 * c + x2 * s;
        v[j + half] = -x1 * s + x2 * c;
      }
    }
}

}  // namespace ref

// Per-layer activations kept for the backward pass.
struct LayerCache {
  std::vector<double> x_in;      // [T, d] after the skip, before the lambdas
  std::vector<double> x_mixed;   // [T, d] lambda0 * x_in + lambda1 * x0
  std::vector<double> h_attn;    // [T, d] rmsnorm(x_mixed)
  std::vector<double> qkv;       // [T, 3I] raw projections
  std::vector<double> q, k, v;   // [T, H, hd] q, k after norm and rope; v after value mixing
  std::vector<double> probs;     // [H, T, T] attention probabilities (0 outside the mask)
  std::vector<double> y_attn;    // [T, I]
  std::vector<double> x_mid;     // [T, d] after attention
  std::vector<double> h_mlp;     // [T, d]
  std::vector<double> u;         // [T, F] pre-activation
  std::vector<double> a;         // [T, F] relu(u)^2
};

struct MicroSequence {
  const uint16_t* inputs;   // [T]
  const uint16_t* targets;  // [T]
  int T;
  int window_blocks;        // long window in blocks; short layers use window_blocks / 2
};


namespace ref {

// SPEC 1.5 scales of the FP8 head: x in [-sqrt(d), sqrt(d)] maps onto e4m3's 448.
struct Fp8Scales {
  double x, w = 24.0 / 448, grad = 1.0 / 448;
  explicit Fp8Scales(int model_dim) : x(std::sqrt(double(model_dim)) / 448) {}
};

inline void add_scaled(std::vector<double>& y, const std::vector<double>& x, double a) {
  for (size_t i = 0; i < y.size(); ++i) y[i] += a * x[i];
}
inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

struct AttentionShape { int T, H, hd; double scale; };

// probs: [H, T, T]; q, k, v: [T, H, hd]; y: [T, H*hd].
inline void attention_forward(const AttentionShape& s, const std::vector<char>& allowed,
                              const std::vector<double>& q, const std::vector<double>& k,
                              const std::vector<double>& v, std::vector<double>& probs,
                              std::vector<double>& y) {
  const int T = s.T, H = s.H, hd = s.hd;
  probs.assign(size_t(H) * T * T, 0.0);
  y.assign(size_t(T) * H * hd, 0.0);
  for (int h = 0; h < H; ++h)
    for (int t = 0; t < T; ++t) {
      double* p = &probs[(size_t(h) * T + t) * T];
      double max_score = -1e300;
      for (int u = 0; u <= t; ++u) {
        if (!allowed[size_t(t) * T + u]) continue;
        double sc = 0;
        for (int j = 0; j < hd; ++j) sc += q[(size_t(t) * H + h) * hd + j] * k[(size_t(u) * H + h) * hd + j];
        p[u] = sc * s.scale;
        max_score = std::max(max_score, p[u]);
      }
      double sum = 0;
      for (int u = 0; u <= t; ++u)
        if (allowed[size_t(t) * T + u]) sum += p[u] = std::exp(p[u] - max_score);
      for (int u = 0; u <= t; ++u) {
        if (!allowed[size_t(t) * T + u]) continue;
        p[u] /= sum;
        for (int j = 0; j < hd; ++j) y[(size_t(t) * H + h) * hd + j] += p[u] * v[(size_t(u) * H + h) * hd + j];
      }
    }
}

// Gradients of q, k, v (overwritten) from dy [T, H*hd]. row_correction = false leaves out the
// softmax's row term (sum_u p_u dp_u), which cancels dq and dk almost to nothing where the softmax
// is peaked: the uncancelled gradients are the scale of their rounding errors there.
inline void attention_backward(const AttentionShape& s, const std::vector<double>& q,
                               const std::vector<double>& k, const std::vector<double>& v,
                               const std::vector<double>& probs, const std::vector<double>& dy,
                               std::vector<double>& dq, std::vector<double>& dk, std::vector<double>& dv,
                               bool row_correction = true) {
  const int T = s.T, H = s.H, hd = s.hd;
  dq.assign(q.size(), 0.0);
  dk.assign(k.size(), 0.0);
  dv.assign(v.size(), 0.0);
  std::vector<double> dp(T);
  for (int h = 0; h < H; ++h)
    for (int t = 0; t < T; ++t) {
      const double* p = &probs[(size_t(h) * T + t) * T];
      const double* g = &dy[(size_t(t) * H + h) * hd];
      double weighted = 0;
      for (int u = 0; u <= t; ++u) {
        if (p[u] == 0) continue;
        double d = 0;
        for (int j = 0; j < hd; ++j) d += g[j] * v[(size_t(u) * H + h) * hd + j];
        dp[u] = d;
        weighted += p[u] * d;
      }
      for (int u = 0; u <= t; ++u) {
        if (p[u] == 0) continue;
        double ds = p[u] * (dp[u] - (row_correction ? weighted : 0.0)) * s.scale;
        for (int j = 0; j < hd; ++j) {
          dq[(size_t(t) * H + h) * hd + j] += ds * k[(size_t(u) * H + h) * hd + j];
          dk[(size_t(u) * H + h) * hd + j] += ds * q[(size_t(t) * H + h) * hd + j];
          dv[(size_t(u) * H + h) * hd + j] += p[u] * g[j];
        }
      }
    }
}

// Splits qkv [T, 3I] into one of q/k/v as [T, H, hd] (which = 0, 1, 2).
inline std::vector<double> qkv_part(const std::vector<double>& qkv, int T, int I, int which) {
  std::vector<double> out(size_t(T) * I);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < I; ++j) out[size_t(t) * I + j] = qkv[size_t(t) * 3 * I + which * I + j];
  return out;
}

// Softcapped cross-entropy (SPEC 1.2.7) of logits [T, V]: token losses [T] returned through
// `losses`; if dlogits is given, the gradient of the summed loss [T, V].
inline void softcap_cross_entropy(const double* logits, const uint16_t* targets, int T, int V, double cap,
                                  double divisor, double* losses, double* dlogits) {
  std::vector<double> z(V);
  for (int t = 0; t < T; ++t) {
    const double* l = logits + size_t(t) * V;
    double zmax = -1e300, sum = 0;
    for (int v = 0; v < V; ++v) zmax = std::max(zmax, z[v] = cap / (1 + std::exp(-l[v] / divisor)));
    for (int v = 0; v < V; ++v) sum += std::exp(z[v] - zmax);
    losses[t] = zmax + std::log(sum) - z[targets[t]];
    if (!dlogits) continue;
    for (int v = 0; v < V; ++v) {
      double sig = 1 / (1 + std::exp(-l[v] / divisor));
      double dz = std::exp(z[v] - zmax) / sum - (v == targets[t]);
      dlogits[size_t(t) * V + v] = dz * cap * sig * (1 - sig) / divisor;
    }
  }
}

class Model {
 public:
  Model(const ModelConfig& c, const Tensors& w, const MicroSequence& seq)
      : c_(c), w_(w), seq_(seq), ix_(c), T_(seq.T), d_(c.model_dim), cache_(c.num_layers) {
    if (T_ % c.block_size != 0)
      throw std::invalid_argument("sequence length " + std::to_string(T_) + " is not a multiple of the block size");
    for (int t = 0; t < T_; ++t)
      if (seq.inputs[t] >= c.vocab_size || seq.targets[t] >= c.vocab_size)
        throw std::invalid_argument("token id at position " + std::to_string(t) + " >= vocab size");
    std::vector<int> docs = document_ids(seq.inputs, T_, c.bos_token);
    mask_long_ = attention_allowed(docs, c.block_size, seq.window_blocks);
    mask_short_ = attention_allowed(docs, c.block_size, seq.window_blocks / 2);
  }

  double forward(bool training, std::vector<double>* token_losses) {
    training_ = training;
    embed_forward();
    std::vector<double> x = x0_;
    skip_out_.assign(c_.num_skips(), {});
    for (int i = 0; i < c_.num_layers; ++i) {
      if (i >= c_.num_skips()) add_scaled(x, skip_out_[c_.num_layers - 1 - i], scalar(c_.skip_weight_index(i - c_.num_skips())));
      block_forward(i, x);
      if (i < c_.num_skips()) skip_out_[i] = x;
    }
    x_final_ = x;
    return head_forward(token_losses);
  }

  void backward(Tensors& g) {
    std::vector<double> dx = head_backward(g);
    std::vector<double> dx0(dx.size(), 0.0);
    std::vector<std::vector<double>> dskip(c_.num_skips());
    for (int i = c_.num_layers - 1; i >= 0; --i) {
      if (i < c_.num_skips()) add_scaled(dx, dskip[i], 1.0);
      block_backward(i, dx, dx0, g);
      if (i >= c_.num_skips()) {
        int from = c_.num_layers - 1 - i, wi = c_.skip_weight_index(i - c_.num_skips());
        g[ix_.scalars][wi] += dot(dx, skip_out_[from]);
        dskip[from] = dx;
        for (double& v : dskip[from]) v *= scalar(wi);
      }
    }
    add_scaled(dx0, dx, 1.0);
    std::vector<double> de(dx0.size(), 0.0);
    rmsnorm_backward(emb_.data(), dx0.data(), de.data(), T_, d_, c_.rms_eps);
    scatter_rows(g[ix_.embed], de, 1.0);
  }

 private:
  double scalar(int i) const { return w_[ix_.scalars][i]; }
  const std::vector<char>& mask(int layer) const { return c_.long_window[layer] ? mask_long_ : mask_short_; }

  std::vector<double> gather_rows(const std::vector<double>& table) const {  // table [V, d] -> [T, d]
    std::vector<double> out(size_t(T_) * d_);
    for (int t = 0; t < T_; ++t)
      std::copy_n(&table[size_t(seq_.inputs[t]) * d_], d_, &out[size_t(t) * d_]);
    return out;
  }
  void scatter_rows(std::vector<double>& table_grad, const std::vector<double>& rows, double a) const {
    for (int t = 0; t < T_; ++t)
      for (int j = 0; j < d_; ++j) table_grad[size_t(seq_.inputs[t]) * d_ + j] += a * rows[size_t(t) * d_ + j];
  }

  void embed_forward() {
    emb_ = gather_rows(w_[ix_.embed]);
    x0_.resize(emb_.size());
    rmsnorm(emb_.data(), x0_.data(), T_, d_, c_.rms_eps);
  }

  void block_forward(int i, std::vector<double>& x) {
    LayerCache& lc = cache_[i];
    lc.x_in = x;
    double lam0 = scalar(c_.block_lambda_index(i, 0)), lam1 = scalar(c_.block_lambda_index(i, 1));
    for (size_t j = 0; j < x.size(); ++j) x[j] = lam0 * lc.x_in[j] + lam1 * x0_[j];
    lc.x_mixed = x;
    if (c_.has_attention[i]) attention_block_forward(i, x);
    lc.x_mid = x;
    mlp_forward(i, x);
  }

  void attention_block_forward(int i, std::vector<double>& x) {
    LayerCache& lc = cache_[i];
    const int I = c_.inner_dim(), H = c_.num_heads, hd = c_.head_dim;
    lc.h_attn.resize(x.size());
    rmsnorm(x.data(), lc.h_attn.data(), T_, d_, c_.rms_eps);
    lc.qkv.resize(size_t(T_) * 3 * I);
    matmul_nt(lc.h_attn.data(), w_[ix_.qkv[i]].data(), lc.qkv.data(), T_, d_, 3 * I);
    std::vector<double> q_raw = qkv_part(lc.qkv, T_, I, 0), k_raw = qkv_part(lc.qkv, T_, I, 1);
    lc.q.resize(q_raw.size());
    lc.k.resize(k_raw.size());
    rmsnorm(q_raw.data(), lc.q.data(), T_ * H, hd, c_.rms_eps);
    rmsnorm(k_raw.data(), lc.k.data(), T_ * H, hd, c_.rms_eps);
    rope(lc.q.data(), T_, H, hd, false);
    rope(lc.k.data(), T_, H, hd, false);
    lc.v = qkv_part(lc.qkv, T_, I, 2);
    double sa0 = scalar(c_.sa_lambda_index(i, 0)), sa1 = scalar(c_.sa_lambda_index(i, 1));
    for (double& v : lc.v) v *= sa0;
    if (c_.value_embed[i] >= 0) add_scaled(lc.v, gather_rows(w_[ix_.value_embed[c_.value_embed[i]]]), sa1);
    attention_forward({T_, H, hd, c_.attn_scale}, mask(i), lc.q, lc.k, lc.v, lc.probs, lc.y_attn);
    std::vector<double> out(x.size());
    matmul_nt(lc.y_attn.data(), w_[ix_.attn_proj[i]].data(), out.data(), T_, I, d_);
    add_scaled(x, out, 1.0);
  }

  void mlp_forward(int i, std::vector<double>& x) {
    LayerCache& lc = cache_[i];
    const int F = c_.mlp_dim();
    lc.h_mlp.resize(x.size());
    rmsnorm(x.data(), lc.h_mlp.data(), T_, d_, c_.rms_eps);
    lc.u.resize(size_t(T_) * F);
    matmul_nt(lc.h_mlp.data(), w_[ix_.mlp_fc[i]].data(), lc.u.data(), T_, d_, F);
    lc.a.resize(lc.u.size());
    for (size_t j = 0; j < lc.u.size(); ++j) lc.a[j] = lc.u[j] > 0 ? lc.u[j] * lc.u[j] : 0.0;
    std::vector<double> out(x.size());
    matmul_nt(lc.a.data(), w_[ix_.mlp_proj[i]].data(), out.data(), T_, F, d_);
    add_scaled(x, out, 1.0);
  }

  // Logits [T, V] = rmsnorm(x) lm_head^T, through FP8 when training with fp8_head.
  double head_forward(std::vector<double>* token_losses) {
    const int V = c_.vocab_size;
    xf_.resize(x_final_.size());
    rmsnorm(x_final_.data(), xf_.data(), T_, d_, c_.rms_eps);
    use_fp8_ = training_ && c_.fp8_head;
    head_x_ = xf_;
    head_w_ = w_[ix_.lm_head];
    double out_scale = 1.0;
    if (use_fp8_) {
      Fp8Scales s(d_);
      for (double& v : head_x_) v = round_to_fp8(v / s.x, kE4M3);
      for (double& v : head_w_) v = round_to_fp8(v / s.w, kE4M3);
      out_scale = s.x * s.w;
    }
    logits_.resize(size_t(T_) * V);
    matmul_nt(head_x_.data(), head_w_.data(), logits_.data(), T_, d_, V);
    for (double& l : logits_) l *= out_scale;
    std::vector<double> losses(T_);
    dlogits_.resize(logits_.size());
    softcap_cross_entropy(logits_.data(), seq_.targets, T_, V, c_.softcap, c_.softcap_divisor, losses.data(),
                          dlogits_.data());
    double loss = 0;
    for (double l : losses) loss += l;
    if (token_losses) *token_losses = losses;
    return loss;
  }

  std::vector<double> head_backward(Tensors& g) {
    std::vector<double> dlogits = dlogits_;
    double dx_scale = 1.0, dw_scale = 1.0;
    if (use_fp8_) {
      Fp8Scales s(d_);
      for (double& v : dlogits) v = round_to_fp8(v / s.grad, kE5M2);
      dx_scale = s.grad * s.w;
      dw_scale = s.grad * s.x;
    }
    std::vector<double> dxf(xf_.size()), dw(head_w_.size(), 0.0);
    matmul_nt_backward(head_x_.data(), head_w_.data(), dlogits.data(), dxf.data(), dw.data(), T_, d_, c_.vocab_size);
    for (double& v : dxf) v *= dx_scale;
    add_scaled(g[ix_.lm_head], dw, dw_scale);
    std::vector<double> dx(x_final_.size(), 0.0);
    rmsnorm_backward(x_final_.data(), dxf.data(), dx.data(), T_, d_, c_.rms_eps);
    return dx;
  }

  // dx: gradient at the block's output in, at its input x_in out; dx0 collects the x0 path.
  void block_backward(int i, std::vector<double>& dx, std::vector<double>& dx0, Tensors& g) {
    LayerCache& lc = cache_[i];
    mlp_backward(i, dx, g);
    if (c_.has_attention[i]) attention_block_backward(i, dx, g);
    int l0 = c_.block_lambda_index(i, 0), l1 = c_.block_lambda_index(i, 1);
    g[ix_.scalars][l0] += dot(dx, lc.x_in);
    g[ix_.scalars][l1] += dot(dx, x0_);
    add_scaled(dx0, dx, scalar(l1));
    for (double& v : dx) v *= scalar(l0);
  }

  void mlp_backward(int i, std::vector<double>& dx, Tensors& g) {
    LayerCache& lc = cache_[i];
    const int F = c_.mlp_dim();
    std::vector<double> da(lc.a.size()), dh(dx.size());
    matmul_nt_backward(lc.a.data(), w_[ix_.mlp_proj[i]].data(), dx.data(), da.data(), g[ix_.mlp_proj[i]].data(), T_, F, d_);
    for (size_t j = 0; j < da.size(); ++j) da[j] *= lc.u[j] > 0 ? 2 * lc.u[j] : 0.0;
    matmul_nt_backward(lc.h_mlp.data(), w_[ix_.mlp_fc[i]].data(), da.data(), dh.data(), g[ix_.mlp_fc[i]].data(), T_, d_, F);
    rmsnorm_backward(lc.x_mid.data(), dh.data(), dx.data(), T_, d_, c_.rms_eps);
  }

  void attention_block_backward(int i, std::vector<double>& dx, Tensors& g) {
    LayerCache& lc = cache_[i];
    const int I = c_.inner_dim(), H = c_.num_heads, hd = c_.head_dim;
    std::vector<double> dy(lc.y_attn.size()), dq, dk, dv;
    matmul_nt_backward(lc.y_attn.data(), w_[ix_.attn_proj[i]].data(), dx.data(), dy.data(), g[ix_.attn_proj[i]].data(), T_, I, d_);
    attention_backward({T_, H, hd, c_.attn_scale}, lc.q, lc.k, lc.v, lc.probs, dy, dq, dk, dv);
    // v = sa0 * v_raw + sa1 * ve
    int s0 = c_.sa_lambda_index(i, 0), s1 = c_.sa_lambda_index(i, 1);
    std::vector<double> v_raw = qkv_part(lc.qkv, T_, I, 2);
    g[ix_.scalars][s0] += dot(dv, v_raw);
    if (c_.value_embed[i] >= 0) {
      int table = ix_.value_embed[c_.value_embed[i]];
      g[ix_.scalars][s1] += dot(dv, gather_rows(w_[table]));
      scatter_rows(g[table], dv, scalar(s1));
    }
    std::vector<double> dqkv(lc.qkv.size(), 0.0);
    for (int which = 0; which < 3; ++which) {
      std::vector<double> part = which == 2 ? dv : which == 0 ? dq : dk;
      if (which < 2) {
        rope(part.data(), T_, H, hd, true);
        std::vector<double> raw = qkv_part(lc.qkv, T_, I, which), d_raw(raw.size(), 0.0);
        rmsnorm_backward(raw.data(), part.data(), d_raw.data(), T_ * H, hd, c_.rms_eps);
        part = d_raw;
      } else {
        for (double& v : part) v *= scalar(s0);
      }
      for (int t = 0; t < T_; ++t)
        for (int j = 0; j < I; ++j) dqkv[size_t(t) * 3 * I + which * I + j] = part[size_t(t) * I + j];
    }
    std::vector<double> dh(dx.size());
    matmul_nt_backward(lc.h_attn.data(), w_[ix_.qkv[i]].data(), dqkv.data(), dh.data(), g[ix_.qkv[i]].data(), T_, d_, 3 * I);
    rmsnorm_backward(lc.x_mixed.data(), dh.data(), dx.data(), T_, d_, c_.rms_eps);
  }

  const ModelConfig& c_;
  const Tensors& w_;
  MicroSequence seq_;
  ParamIndex ix_;
  int T_, d_;
  bool training_ = true, use_fp8_ = false;
  std::vector<char> mask_long_, mask_short_;
  std::vector<double> emb_, x0_, x_final_, xf_, head_x_, head_w_, logits_, dlogits_;
  std::vector<std::vector<double>> skip_out_;
  std::vector<LayerCache> cache_;
};

}  // namespace ref

// Forward (and, with grads != nullptr, backward) of one micro-sequence. Returns the summed
// cross-entropy over its T tokens (SPEC 1.2.7). `training` selects the FP8 head when the config
// enables it; evaluation uses the plain head, as the reference does. Gradients are added to *grads.
inline double forward_backward(const ModelConfig& c, const Tensors& w, const MicroSequence& seq,
                               Tensors* grads, bool training = true,
                               std::vector<double>* token_losses = nullptr) {
  ref::Model model(c, w, seq);
  double loss = model.forward(training, token_losses);
  if (grads) model.backward(*grads);
  return loss;
}
