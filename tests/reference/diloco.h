// CPU reference (fp64) of Streaming DiLoCo's outer loop over G replica groups, written from the
// mathematics (Douillard et al. 2025; torchft's local_sgd.py after PR #233), apart from the
// trainer's kernels/diloco.cuh so that the oracle compares two readings:
//   every H/F inner steps, fragment k = (n / (H/F) - 1) mod F (n: inner steps done) is exchanged:
//     Δ̄ = (1/G) Σ_g (global − local_g)                     over the fragment's parameters
//   and d inner steps later it is applied:
//     m ← μ m + Δ̄;   global ← global − lr (Δ̄ + μ m)       (SGD, nesterov=True, dampening 0)
//     local_g ← global + α (local_g − global)               for every group g (in place)
//   at the end of training the exchange in flight is dropped and every fragment takes the groups'
//   plain average:  global ← local_g ← (1/G) Σ_g local_g  (the outer momentum unchanged)
// The inner step is the caller's: the reference recipe (reference_group_step below) or any update.
#pragma once
#include "reference/training.h"

#include <algorithm>
#include <optional>

struct ReferenceDiLoCoConfig {
  int groups = 2, fragments = 1, sync_every = 2, delay = 0;
  double outer_lr = 0.7, outer_momentum = 0.9, alpha = 0;
  bool flipped_sign = false;  // torchft's bug before #233: Δ = local − global (the loss-level check)
};

// The model's fragments, balanced by element count: whole parameters, the largest first (ties in
// parameter order), each to the fragment with the fewest elements so far (ties to the lowest).
inline std::vector<int> reference_fragment_of(const ModelConfig& c, int fragments) {
  const std::vector<ParamSpec> specs = param_specs(c);
  std::vector<size_t> order(specs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return specs[a].numel() > specs[b].numel(); });
  std::vector<int> of(specs.size());
  std::vector<int64_t> load(size_t(fragments), 0);
  for (size_t i : order) {
    const int f = int(std::min_element(load.begin(), load.end()) - load.begin());
    of[i] = f;
    load[size_t(f)] += specs[i].numel();
  }
  return of;
}

class ReferenceOuterLoop {
 public:
  // fragment_of: each parameter's fragment; init: every group's starting parameters.
  ReferenceOuterLoop(const ReferenceDiLoCoConfig& c, std::vector<int> fragment_of, const Tensors& init)
      : c_(c), fragment_of_(std::move(fragment_of)), global_(init), momentum_(init) {
    for (auto& m : momentum_) std::fill(m.begin(), m.end(), 0.0);
  }

  // After inner step n (1, 2, ...) of every group.
  void after_step(int n, std::vector<Tensors*> groups) {
    if (pending_ && pending_->apply_at == n) apply(groups, c_.alpha);
    const int period = c_.sync_every / c_.fragments;
    if (n % period == 0) {
      start((n / period - 1) % c_.fragments, n + c_.delay, groups);
      if (c_.delay == 0) apply(groups, c_.alpha);
    }
  }

  // The end of training: the exchange in flight dropped, every parameter the groups' average.
  void finish(std::vector<Tensors*> groups) {
    pending_.reset();
    for (size_t i = 0; i < global_.size(); ++i)
      for (size_t k = 0; k < global_[i].size(); ++k) {
        double mean = 0;
        for (const Tensors* local : groups) mean += (*local)[i][k] / double(groups.size());
        global_[i][k] = mean;
        for (Tensors* local : groups) (*local)[i][k] = mean;
      }
  }

  const Tensors& global() const { return global_; }
  const Tensors& momentum() const { return momentum_; }

 private:
  struct Pending {
    int fragment, apply_at;
    Tensors average;  // Δ̄ per parameter of the fragment (others empty)
  };

  void start(int fragment, int apply_at, const std::vector<Tensors*>& groups) {
    Pending p{fragment, apply_at, Tensors(global_.size())};
    const double G = double(groups.size());
    for (size_t i = 0; i < global_.size(); ++i) {
      if (fragment_of_[i] != fragment) continue;
      p.average[i].assign(global_[i].size(), 0.0);
      for (const Tensors* local : groups)
        for (size_t k = 0; k < global_[i].size(); ++k) {
          const double delta = global_[i][k] - (*local)[i][k];
          p.average[i][k] += (c_.flipped_sign ? -delta : delta) / G;
        }
    }
    pending_ = std::move(p);
  }

  void apply(const std::vector<Tensors*>& groups, double alpha) {
    const Pending p = std::move(*pending_);
    pending_.reset();
    const double lr = c_.outer_lr, mu = c_.outer_momentum;
    for (size_t i = 0; i < global_.size(); ++i) {
      if (fragment_of_[i] != p.fragment) continue;
      for (size_t k = 0; k < global_[i].size(); ++k) {
        momentum_[i][k] = mu * momentum_[i][k] + p.average[i][k];
        global_[i][k] -= lr * (p.average[i][k] + mu * momentum_[i][k]);
        for (Tensors* local : groups) (*local)[i][k] = global_[i][k] + alpha * ((*local)[i][k] - global_[i][k]);
      }
    }
  }

  ReferenceDiLoCoConfig c_;
  std::vector<int> fragment_of_;
  Tensors global_, momentum_;
  std::optional<Pending> pending_;
};

// One inner step of group g of G, each of L = W / G ranks: the micro-sequences j whose rank
// j mod W lies in the group (ranks g L .. g L + L − 1, as the trainer's loader deals them out),
// normalised by their count. Returns the group's summed loss and sets `count`.
inline double reference_group_step(const RecipeConfig& r, int step, const GlobalBatch& batch, int group,
                                   int ranks_per_group, int groups, ReferenceState<double>& st, int& count) {
  const int W = groups * ranks_per_group;
  Tensors grads = zeros_like_params(r.model);
  double loss = 0;
  count = 0;
  for (int l = 0; l < ranks_per_group; ++l) {
    int rank_count = 0;
    loss += accumulate_micro_gradients(r, st.params, batch, step, group * ranks_per_group + l, W, grads, rank_count);
    count += rank_count;
  }
  reference_optimizer_step(r, step, grads, count, st);
  return loss;
}
