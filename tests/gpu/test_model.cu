// The whole model assembled from the kernels (train_gpt.cu's GPT) against the CPU reference
// model: one forward+backward of a 12-layer model with the record's structure at a small width
// (d = 256, two heads of 128, vocabulary 1024, 4 blocks of 128 tokens, documents and windows).
// Both start from the same weights as the GPU sees them (bf16 embeddings and weight copies, fp32
// scalars); the loss and every parameter's gradient must agree within bf16 tolerance.
#include "gpu/model_fixture.h"

namespace {

using namespace fixture;

// bf16 activations through 12 layers: each op's output carries ~2e-3 relative rounding
// (METHOD.md: bf16 operands 1e-3..1e-2); gradients pass through twice as many ops as the loss.
constexpr double kLossBound = 5e-3, kGradBound = 2e-2;
// The FP8 head: the GPU rounds x and dlogits to bf16 before FP8 (as PyTorch does), the reference
// rounds the exact values, so ~2-3% of the FP8 operands differ by one FP8 step (6% for e4m3,
// 12% for e5m2): looser bounds, to calibrate on the first GPU run.
constexpr double kFp8LossBound = 1e-2, kFp8GradBound = 5e-2;
constexpr int kT = 512, kWindowBlocks = 3;

// The summed loss of one micro-sequence; with backward, the gradients of it alone.
double gpu_loss(GPT& model, Activations& acts, const std::vector<uint16_t>& tokens, bool fp8_head = false) {
  upload_micro_sequence(acts, tokens.data(), kT, 0);
  MicroSequencePlan plan(tokens.data(), kT, model.config(), kWindowBlocks, acts.uploads, 0);
  model.params.zero_grads(0);
  model.step(acts, kT, plan, acts.for_backward, fp8_head, 0);
  return take_loss_total(acts, 0);
}

// The loss and every gradient of one training micro-sequence against the reference model's.
void check_against_reference(bool fp8_head, double loss_bound, double grad_bound) {
  ModelConfig rc = reference_config();
  rc.fp8_head = fp8_head;
  DeviceMemory memory;
  GPT model(gpu_config(), memory);
  Activations acts(model.config(), kT, /*backward=*/true, memory, fp8_head);
  Tensors w = load_weights(rc, model, 7);
  std::vector<uint16_t> tokens = synthetic_tokens(kT + 1, rc.vocab_size, rc.bos_token, 1.0 / 150, 8);
  tokens[0] = rc.bos_token;

  Tensors ref_grads = zeros_like_params(rc);
  double ref_loss = forward_backward(rc, w, {tokens.data(), tokens.data() + 1, kT, kWindowBlocks}, &ref_grads,
                                     /*training=*/true);
  double loss = gpu_loss(model, acts, tokens, fp8_head);
  std::printf("  loss: gpu %.6f reference %.6f\n", loss, ref_loss);
  CHECK(std::fabs(loss - ref_loss) <= loss_bound * std::fabs(ref_loss));
  for (size_t p = 0; p < model.params.list.size(); ++p) {
    const Param& param = model.params.list[p];
    std::vector<double> grad = download_grad(model.params, param);
    double error = relative_error(grad, ref_grads[p]);
    std::printf("  %-28s grad rel. error %.2e\n", param.name.c_str(), error);
    CHECK(error <= grad_bound_of(param, grad_bound));
  }
}

}  // namespace

TEST_CASE("one forward+backward of the assembled model equals the CPU reference model") {
  check_against_reference(/*fp8_head=*/false, kLossBound, kGradBound);
}

TEST_CASE("with the FP8 head (SPEC 1.5), one forward+backward equals the reference's FP8 model") {
  check_against_reference(/*fp8_head=*/true, kFp8LossBound, kFp8GradBound);
}

TEST_CASE("the backward is deterministic; evaluation (layers sharing buffers) gives the training loss") {
  ModelConfig rc = reference_config();
  DeviceMemory memory;
  GPT model(gpu_config(), memory);
  Activations train(model.config(), kT, /*backward=*/true, memory), eval(model.config(), 2 * kT, false, memory);
  load_weights(rc, model, 9);
  std::vector<uint16_t> tokens = synthetic_tokens(kT + 1, rc.vocab_size, rc.bos_token, 1.0 / 100, 10);
  double loss = gpu_loss(model, train, tokens);
  std::vector<std::vector<double>> first;
  for (const Param& p : model.params.list) first.push_back(download_grad(model.params, p));
  CHECK(gpu_loss(model, train, tokens) == loss);
  for (size_t p = 0; p < model.params.list.size(); ++p) CHECK(download_grad(model.params, model.params.list[p]) == first[p]);
  double eval_loss = gpu_loss(model, eval, tokens);
  std::printf("  loss: training %.6f evaluation %.6f\n", loss, eval_loss);
  CHECK(eval_loss == loss);
}

#ifdef SPEEDRUN_EMULATED
// The emulated cuBLASLt tells which of its heuristic answers each product ran (every one computes
// the same here: which one runs is all there is to check).
TEST_CASE("the cuBLASLt candidates of --matmul-algorithms: each named product of every block takes its own in training") {
  DeviceMemory memory;
  GPT model(gpu_config(), memory);
  const GPTConfig& c = model.config();
  const int d = c.model_dim, F = c.mlp_dim();
  Activations train(c, kT, /*backward=*/true, memory), eval(c, kT, false, memory);
  load_weights(reference_config(), model, 11);
  KernelPaths paths;
  paths.matmul_algorithms = MatmulAlgorithms::parse("qkv.dw=1,attn-proj.fwd=2,mlp-proj.dx=3,mlp-proj.dw=1",
                                                    Matmul::kMaxCandidates);
  KernelPaths beyond = paths;  // the emulated heuristic offers 4 answers, the flag allows 16
  beyond.matmul_algorithms.candidate[int(BlockLinear::mlp_fc)][int(LinearProduct::dw)] = 5;
  model.set_paths(beyond);
  CHECK_THROWS_WITH(model.plan_block_matmuls(train, kT), "--matmul-algorithms mlp-fc.dw=5: cuBLASLt offers 4 algorithms");
  model.set_paths(paths);
  model.plan_block_matmuls(train, kT);
  const std::vector<uint16_t> tokens = synthetic_tokens(kT + 1, c.vocab_size, c.bos_token, 1.0 / 100, 12);
  // (M, N, K, A transposed, B transposed) of each named product, as GPT::linear* make them; no other
  // product has these (the MLP fc's have the bf16 head's shapes here, F = V = 1024: not named)
  struct Named { uint64_t M, N, K; bool ta, tb; int candidate; int calls; };
  const int attention_layers = int(std::count(c.has_attention.begin(), c.has_attention.end(), true));
  const uint64_t T = kT, D = d, FF = F;
  const Named named[] = {{3 * D, D, T, true, false, 1, attention_layers},  // qkv: dW += dqkv^T h
                         {T, D, D, false, true, 2, attention_layers},      // attn proj: y W^T (+ x_mixed)
                         {T, FF, D, false, false, 3, c.num_layers},        // mlp proj: dx W
                         {D, FF, T, true, false, 1, c.num_layers}};        // mlp proj: dW += dx^T a
  auto named_as = [&](const emu::MatmulCall& call) -> const Named* {
    for (const Named& n : named)
      if (call.M == n.M && call.N == n.N && call.K == n.K && call.a_transposed == n.ta && call.b_transposed == n.tb)
        return &n;
    return nullptr;
  };
  {
    emu::MatmulCalls recorded;
    gpu_loss(model, train, tokens);
    std::vector<int> calls(std::size(named), 0);
    int others = 0;
    for (const emu::MatmulCall& call : recorded.calls()) {
      const Named* n = named_as(call);
      if (n) ++calls[n - named];
      else ++others;
      CHECK(call.candidate == (n ? n->candidate : 0));
    }
    std::printf("  training: %d calls of the named products, %d of the others (the heuristic's first)\n",
                std::accumulate(calls.begin(), calls.end(), 0), others);
    for (size_t i = 0; i < std::size(named); ++i) CHECK(calls[i] == named[i].calls);
  }
  emu::MatmulCalls recorded;
  gpu_loss(model, eval, tokens);
  CHECK(!recorded.calls().empty());
  for (const emu::MatmulCall& call : recorded.calls()) CHECK(call.candidate == 0);  // evaluation: the first
}
#endif

int main(int argc, char** argv) { return run_gpu_checks(argc, argv); }
