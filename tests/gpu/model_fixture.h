// The GPU model of train_gpt.cu beside the CPU reference model at one small shape with the
// record's structure (12 layers, d = 256, two heads of 128, vocabulary 1024), starting from the
// same weights as the GPU sees them (bf16 embeddings and weight copies, fp32 scalars).
#pragma once
#define TRAIN_GPT_NO_MAIN
#include "train_gpt.cu"

#include "gpu/gpu_test.h"
#include "reference/model.h"
#include "reference/synthetic.h"

namespace fixture {

// A gradient bound for the `scalars` parameter, looser than the matrices' bf16 bound: its entries
// are dot products over T x d of bf16 tensors (dot(dx, x_in) for the block lambdas) whose terms
// cancel 10-100x. The CPU emulator, rounding as the GPU does, gave 2.4e-2 on the vector, with the
// largest deviations (2-4e-3 absolute) on the x_in lambdas of layers 3-11.
constexpr double kScalarGradBound = 5e-2;

inline double grad_bound_of(const Param& p, double matrix_bound, double scalar_bound = kScalarGradBound) {
  return p.name == "scalars" ? std::max(matrix_bound, scalar_bound) : matrix_bound;
}

inline GPTConfig gpu_config() {
  GPTConfig c;
  c.model_dim = 256;
  c.num_heads = 2;
  c.vocab_size = 1024;
  c.bos_token = 1023;
  return c;
}

// The distributed oracle's model (test_distributed, and test_diloco's end-to-end oracle): d = 128,
// one head, a 512-token vocabulary, so that the runs of several simulated ranks a case stay small.
constexpr int kOracleVocab = 512;
inline GPTConfig oracle_config() {
  GPTConfig c = gpu_config();
  c.model_dim = 128;
  c.num_heads = 1;
  c.vocab_size = kOracleVocab;
  c.bos_token = kOracleVocab - 1;
  return c;
}

// The CPU reference's config of the record's structure at a GPU config's sizes.
inline ModelConfig reference_config_of(const GPTConfig& g) {
  ModelConfig c = ModelConfig::record();
  c.model_dim = g.model_dim;
  c.num_heads = g.num_heads;
  c.vocab_size = g.vocab_size;
  c.bos_token = g.bos_token;
  c.softcap_divisor = 7.5 * std::sqrt(double(g.model_dim));
  return c;
}

inline ModelConfig reference_config() { return reference_config_of(gpu_config()); }

// The reference's weights rounded to what the GPU computes with; uploaded to the GPU model.
inline Tensors load_weights(const ModelConfig& rc, const GPT& model, uint64_t seed) {
  Tensors w = init_params(rc, seed, /*random_everything=*/true);
  const ParameterStore& s = model.params;
  std::vector<bf16> embeddings(s.embedding_count);
  std::vector<float> master(s.master_count);
  for (size_t p = 0; p < s.list.size(); ++p) {
    const Param& param = s.list[p];
    for (int64_t i = 0; i < param.numel; ++i) {
      // Matrices start from bf16-representable masters, so the reference's initial weights are
      // the GPU's both in the matmuls (the bf16 copies) and in the optimizer (the fp32 masters).
      float f = float(w[p][i]);
      if (param.kind != ParamKind::scalars) f = __bfloat162float(__float2bfloat16(f));
      if (param.is_embedding()) embeddings[param.offset + i] = __float2bfloat16(f);
      else master[param.offset + i] = f;
      w[p][i] = double(f);
    }
  }
  CUDA_CHECK(cudaMemcpy(s.embeddings, embeddings.data(), embeddings.size() * sizeof(bf16), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(s.master, master.data(), master.size() * sizeof(float), cudaMemcpyHostToDevice));
  refresh_weight_copies(s, 0);
  return w;
}

inline std::vector<double> download_grad(const ParameterStore& s, const Param& p) {
  std::vector<float> g(p.numel);
  const float* at = (p.is_embedding() ? s.embedding_grads : s.grads) + p.offset;
  CUDA_CHECK(cudaMemcpy(g.data(), at, g.size() * sizeof(float), cudaMemcpyDeviceToHost));
  return std::vector<double>(g.begin(), g.end());
}

// A run of `steps` steps of M micro-sequences of T tokens; every schedule (lr cooldown, window
// growth) happens within those steps.
inline Hyperparameters test_hyperparameters(int steps, int micro_batches, int T) {
  Hyperparameters h;
  h.num_iterations = steps;
  h.micro_batches = micro_batches;
  h.seq_len = T;
  return h;
}

// The trainer's initialisation (SPEC 1.6), with the matrices it starts at zero (the projections
// and lm_head) drawn like qkv instead: otherwise qkv and c_fc get no gradient before step 2.
inline void initialize_nonzero(const GPTConfig& c, const ParameterStore& s, uint64_t seed) {
  initialize_parameters(c, s, seed);
  std::vector<float> master(s.master_count);
  CUDA_CHECK(cudaMemcpy(master.data(), s.master, master.size() * sizeof(float), cudaMemcpyDeviceToHost));
  std::mt19937_64 rng(seed + 1);
  const float bound = float(std::sqrt(3.0) * 0.5 / std::sqrt(double(c.model_dim)));
  std::uniform_real_distribution<float> linear(-bound, bound);
  for (const Param& p : s.list)
    if (p.kind == ParamKind::attn_proj || p.kind == ParamKind::mlp_proj || p.kind == ParamKind::lm_head)
      for (int64_t i = 0; i < p.numel; ++i) master[p.offset + i] = linear(rng);
  CUDA_CHECK(cudaMemcpy(s.master, master.data(), master.size() * sizeof(float), cudaMemcpyHostToDevice));
  refresh_weight_copies(s, 0);
}

// One rank of the trainer (at the fixture's shape unless told): the model, its optimizers over
// `comm`, and training activations for micro-sequences of h.seq_len tokens.
struct RankTrainer {
  DeviceMemory memory;
  GPT model;
  Optimizers optimizers;
  Activations acts;
  RankTrainer(const Hyperparameters& h, DeviceCommunicator& comm, const GPTConfig& config = gpu_config())
      : model(config, memory), optimizers(h, model.params, comm, memory),
        acts(model.config(), h.seq_len, /*backward=*/true, memory) {}
};

// One rank's share of a step's global window in the loader's layout: micro-sequences j = rank,
// rank + W, ... (SPEC 4.1), each T + 1 tokens, back to back.
struct HostBatch {
  std::vector<uint16_t> tokens;
  RankBatch batch;
  HostBatch(const uint16_t* window, int M, int T, int64_t step, int rank = 0, int world_size = 1) {
    int count = 0;
    for (int j = rank; j < M; j += world_size, ++count)
      tokens.insert(tokens.end(), window + size_t(j) * T, window + size_t(j) * T + T + 1);
    batch = {step, count, T, tokens.data()};
  }
  HostBatch(const HostBatch&) = delete;  // batch points into tokens
  HostBatch& operator=(const HostBatch&) = delete;
};

}  // namespace fixture
