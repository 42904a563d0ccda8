// The oracle of SPEC 4.4 on the CPU reference: K steps of the sharded training step at W ranks
// (simulated, threads) against the unsharded reference step, from the same initial weights and
// global batches. Every parameter on every rank and every optimizer state must agree within 1e-6
// (relative, per tensor); each injected distributed bug must break that bound.
#include "check.h"
#include "injected_faults.h"
#include "reference/synthetic.h"
#include "reference/training.h"

#include <cstdio>

namespace {

constexpr int kSteps = 3, kMicro = 8, kMicroLen = 32;
constexpr double kTolerance = 1e-6;

struct Oracle {
  RecipeConfig recipe;
  Tensors init;
  std::vector<uint16_t> tokens;  // kSteps windows of kMicro * kMicroLen tokens, + 1

  Oracle() {
    recipe.model = ModelConfig::tiny();
    recipe.model.fp8_head = true;
    recipe.schedule.num_iterations = 4;  // windows of 1, 4, 7 blocks; the lr cools down from step 2
    recipe.schedule.cooldown_frac = 0.6;
    recipe.schedule.momentum_warmup_steps = 2;
    init = init_params(recipe.model, 2024, /*random_everything=*/true);
    tokens = synthetic_tokens(size_t(kSteps) * kMicro * kMicroLen + 1, recipe.model.vocab_size,
                              recipe.model.bos_token, 0.03, 99);
  }
  GlobalBatch batch(int step) const {
    return {tokens.data() + size_t(step) * kMicro * kMicroLen, kMicroLen, kMicro};
  }
};

struct Worst {
  double error = 0;
  std::string where = "-";
  void add(const std::string& name, const std::vector<float>& got, const std::vector<float>& want) {
    double diff = 0, norm = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
      norm += double(want[i]) * want[i];
    }
    double e = std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
    if (!(e <= error)) error = e, where = name;  // NaN counts as worst
  }
};

// Rank q's Adam slice rows, written into a whole tensor shaped like the parameter.
void place_slice(const AdamShard& sh, int q, const std::vector<float>& slice, std::vector<float>& whole) {
  std::copy(slice.begin(), slice.begin() + sh.valid_rows(q) * sh.row_elems, whole.begin() + sh.first_row(q) * sh.row_elems);
}

Worst compare(const Oracle& o, const ShardPlan& plan, const std::vector<RankState<float>>& ranks,
              const ReferenceState<float>& ref) {
  std::vector<ParamSpec> specs = param_specs(o.recipe.model);
  Worst worst;
  for (size_t q = 0; q < ranks.size(); ++q) {
    for (size_t p = 0; p < specs.size(); ++p)
      worst.add("rank " + std::to_string(q) + " " + specs[p].name, ranks[q].params[p], ref.params[p]);
    if (ranks[q].adam_steps != ref.adam_steps) worst.add("adam step count", {1.0f}, {0.0f});
  }
  for (size_t a = 0; a < plan.adam.size(); ++a) {
    const AdamShard& sh = plan.adam[a];
    std::vector<float> m(ref.adam_m[sh.param].size(), NAN), v(m.size(), NAN);
    for (size_t q = 0; q < ranks.size(); ++q) {
      place_slice(sh, int(q), ranks[q].adam_m[a], m);
      place_slice(sh, int(q), ranks[q].adam_v[a], v);
    }
    worst.add("adam m " + specs[sh.param].name, m, ref.adam_m[sh.param]);
    worst.add("adam v " + specs[sh.param].name, v, ref.adam_v[sh.param]);
  }
  for (size_t p = 0; p < specs.size(); ++p) {
    if (!uses_muon(specs[p].role)) continue;
    int owners = 0;
    for (const RankState<float>& r : ranks) {
      auto it = r.muon_momentum.find(int(p));
      if (it == r.muon_momentum.end()) continue;
      ++owners;
      worst.add("muon momentum " + specs[p].name, it->second, ref.muon_momentum[p]);
    }
    if (owners != 1) worst.add("muon owners of " + specs[p].name, {float(owners)}, {1.0f});
  }
  return worst;
}

const ReferenceState<float>& reference_run(const Oracle& o) {
  static ReferenceState<float> ref = [&] {
    ReferenceState<float> st(o.recipe.model, o.init);
    for (int k = 0; k < kSteps; ++k) reference_train_step(o.recipe, k, o.batch(k), st);
    return st;
  }();
  return ref;
}

Worst sharded_run(const Oracle& o, int world_size) {
  ShardPlan plan = plan_shards(sharding_params(o.recipe.model), world_size);
  std::vector<RankState<float>> ranks;
  for (int q = 0; q < world_size; ++q) ranks.emplace_back(plan, q, o.init);
  SimulatedWorld world(world_size);
  world.run([&](Communicator& comm) {
    for (int k = 0; k < kSteps; ++k) sharded_train_step(comm, plan, o.recipe, k, o.batch(k), ranks[comm.rank()]);
  });
  return compare(o, plan, ranks, reference_run(o));
}

const Oracle& oracle() {
  static Oracle o;
  return o;
}

}  // namespace

TEST_CASE("sharded steps at W = 1, 2, 3, 4, 5, 8 equal the unsharded reference (M = 8, K = 3)") {
  for (int world_size : {1, 2, 3, 4, 5, 8}) {
    Worst w = sharded_run(oracle(), world_size);
    std::printf("  W = %d: worst relative error %.3e (%s)\n", world_size, w.error, w.where.c_str());
    CHECK(w.error <= kTolerance);
  }
}

TEST_CASE("every injected distributed bug makes the oracle fail") {
  const Fault faults[] = {Fault::avg_instead_of_sum,     Fault::local_count_normalization,
                          Fault::prescale_by_world,      Fault::drop_rank_contribution,
                          Fault::wrong_shard_offset,     Fault::skip_all_gather,
                          Fault::replicated_count_per_rank};
  for (Fault f : faults) {
    for (int world_size : {3, 4}) {
      Worst w;
      {
        ScopedFault injected(f);
        w = sharded_run(oracle(), world_size);
      }
      std::printf("  %-26s W = %d: worst relative error %.3e (%s)\n", fault_name(f), world_size, w.error, w.where.c_str());
      CHECK(w.error > 1e3 * kTolerance);  // caught with a wide margin, not by rounding
    }
  }
}

int main() { return check::run_checks(); }
