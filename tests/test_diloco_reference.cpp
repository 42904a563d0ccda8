// Streaming DiLoCo on the CPU reference (tests/reference/diloco.h) at the tiny model's shape: the
// loss-level check of the pseudo-gradient's sign (torchft#233: with local − global the loss went
// up), and the outer loop's properties that hold whatever the inner step.
#include "check.h"
#include "reference/diloco.h"
#include "reference/synthetic.h"

#include <cstdio>

namespace {

constexpr int kMicro = 8, kMicroLen = 32;

RecipeConfig tiny_recipe(int steps) {
  RecipeConfig r;
  r.model = ModelConfig::tiny();
  r.schedule.num_iterations = steps;
  r.schedule.momentum_warmup_steps = 2;
  return r;
}

// A stream the model can learn (uniform tokens leave nothing below ln V): each token follows from
// the one before by a fixed rule, one in ten drawn at random.
std::vector<uint16_t> tokens_for(int steps, uint64_t seed) {
  const ModelConfig c = ModelConfig::tiny();
  std::vector<uint16_t> tokens = synthetic_tokens(size_t(steps + 1) * kMicro * kMicroLen + 1, c.vocab_size, c.bos_token, 0.03, seed);
  std::mt19937_64 rng(seed);
  for (size_t i = 1; i < tokens.size(); ++i)
    if (tokens[i] != c.bos_token && rng() % 10 != 0) tokens[i] = uint16_t((tokens[i - 1] * 5 + 3) % c.bos_token);
  return tokens;
}

// Mean token loss of parameters `w` over `batch` (the evaluation forward).
double mean_loss(const RecipeConfig& r, const Tensors& w, const GlobalBatch& batch) {
  double loss = 0;
  for (int j = 0; j < batch.micro_count; ++j) {
    const uint16_t* micro = batch.tokens + size_t(j) * batch.micro_len;
    loss += forward_backward(r.model, w, {micro, micro + 1, batch.micro_len, r.schedule.window_blocks(0)}, nullptr, false);
  }
  return loss / (double(batch.micro_count) * batch.micro_len);
}

// G groups of one rank train `steps` steps on their shares of each global batch, with the outer
// loop (none for G = 1), and the final sync; the loss of the result on the batch after the last.
double trained_loss(int groups, const ReferenceDiLoCoConfig& outer, int steps) {
  const RecipeConfig r = tiny_recipe(steps);
  const Tensors init = init_params(r.model, 7, /*random_everything=*/true);
  const std::vector<uint16_t> tokens = tokens_for(steps, 11);
  auto batch = [&](int step) { return GlobalBatch{tokens.data() + size_t(step) * kMicro * kMicroLen, kMicroLen, kMicro}; };
  std::vector<ReferenceState<double>> states(size_t(groups), ReferenceState<double>(r.model, init));
  ReferenceOuterLoop loop(outer, reference_fragment_of(r.model, outer.fragments), init);
  std::vector<Tensors*> locals;
  for (auto& st : states) locals.push_back(&st.params);
  for (int step = 0; step < steps; ++step) {
    for (int g = 0; g < groups; ++g) {
      int count = 0;
      reference_group_step(r, step, batch(step), g, 1, groups, states[size_t(g)], count);
    }
    if (groups > 1) loop.after_step(step + 1, locals);
  }
  if (groups > 1) loop.finish(locals);
  return mean_loss(r, states[0].params, batch(steps));
}

double worst_difference(const Tensors& a, const Tensors& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t k = 0; k < a[i].size(); ++k) worst = std::max(worst, std::abs(a[i][k] - b[i][k]));
  return worst;
}

}  // namespace

TEST_CASE("loss: G = 2 groups come close to G = 1; the flipped pseudo-gradient sign makes the loss go up") {
  constexpr int kSteps = 16;
  ReferenceDiLoCoConfig outer;
  outer.fragments = 2;
  outer.sync_every = 4;
  outer.delay = 1;
  const RecipeConfig r = tiny_recipe(kSteps);
  const std::vector<uint16_t> tokens = tokens_for(kSteps, 11);
  const double initial = mean_loss(r, init_params(r.model, 7, true), {tokens.data() + size_t(kSteps) * kMicro * kMicroLen, kMicroLen, kMicro});
  const double alone = trained_loss(1, outer, kSteps);
  const double right = trained_loss(2, outer, kSteps);
  outer.flipped_sign = true;
  const double flipped = trained_loss(2, outer, kSteps);
  std::printf("  loss after %d steps (initial %.4f): G = 1 %.4f, G = 2 %.4f, G = 2 with the flipped sign %.4f\n",
              kSteps, initial, alone, right, flipped);
  CHECK(right < initial);
  CHECK(right - alone < 0.25 * (initial - alone));  // DiLoCo keeps most of the progress
  CHECK(flipped > initial);                         // the seed's symptom
}

TEST_CASE("H = 1, F = 1, outer lr 1, momentum 0, alpha 0 averages the groups' parameters every step") {
  const RecipeConfig r = tiny_recipe(3);
  const Tensors init = init_params(r.model, 3, true);
  ReferenceDiLoCoConfig outer;
  outer.groups = 3;
  outer.sync_every = 1;
  outer.outer_lr = 1;
  outer.outer_momentum = 0;
  ReferenceOuterLoop loop(outer, reference_fragment_of(r.model, 1), init);
  std::mt19937_64 rng(5);
  std::normal_distribution<double> noise(0.0, 0.1);
  std::vector<Tensors> groups(3, init);
  std::vector<Tensors*> locals{&groups[0], &groups[1], &groups[2]};
  double worst = 0;
  for (int n = 1; n <= 3; ++n) {
    for (Tensors& g : groups)
      for (auto& t : g)
        for (double& v : t) v += noise(rng);
    Tensors mean = groups[0];
    for (size_t i = 0; i < mean.size(); ++i)
      for (size_t k = 0; k < mean[i].size(); ++k) mean[i][k] = (groups[0][i][k] + groups[1][i][k] + groups[2][i][k]) / 3;
    loop.after_step(n, locals);
    for (const Tensors& g : groups) worst = std::max(worst, worst_difference(g, mean));
  }
  std::printf("  worst difference from the mean of the groups: %.2e\n", worst);
  CHECK(worst < 1e-12);
}

TEST_CASE("groups fed identical data stay identical") {
  const int steps = 4;
  const RecipeConfig r = tiny_recipe(steps);
  const Tensors init = init_params(r.model, 9, true);
  const std::vector<uint16_t> tokens = tokens_for(steps, 13);
  ReferenceDiLoCoConfig outer;
  outer.fragments = 2;
  outer.sync_every = 2;
  std::vector<ReferenceState<double>> states(2, ReferenceState<double>(r.model, init));
  ReferenceOuterLoop loop(outer, reference_fragment_of(r.model, 2), init);
  for (int step = 0; step < steps; ++step) {
    const GlobalBatch batch{tokens.data() + size_t(step) * kMicro * kMicroLen, kMicroLen, kMicro};
    for (auto& st : states) {
      int count = 0;
      reference_group_step(r, step, batch, 0, 1, 1, st, count);  // both groups: the whole batch
    }
    loop.after_step(step + 1, {&states[0].params, &states[1].params});
  }
  const double apart = worst_difference(states[0].params, states[1].params);
  std::printf("  worst difference between the groups after %d steps: %.2e\n", steps, apart);
  CHECK(apart == 0);
}

int main() { return check::run_checks(); }
