// CPU reference of one training step, twice: unsharded on one rank (the plain mathematics of
// SPEC Part 1 with M micro-sequences accumulated), and sharded over W ranks exactly as SPEC 4.3
// describes (reduce-scatter with SUM into DistAdam dim-0 slices and owner-per-chunk Muon,
// all-gather back). The oracle (tests/test_oracle.cpp) proves the second equals the first.
#pragma once
#include "kernels/host/comm.h"
#include "kernels/host/faults.h"
#include "kernels/host/schedules.h"
#include "kernels/host/sharding.h"
#include "reference/optim.h"

#include <map>

struct RecipeConfig {
  ModelConfig model;
  Schedule schedule;
  AdamConfig adam;
  MuonConfig muon;
};

// One optimizer step's global batch: M micro-sequences of T tokens, micro j = tokens + j*T (T+1 tokens).
struct GlobalBatch {
  const uint16_t* tokens;  // [M*T + 1]
  int micro_len;           // T
  int micro_count;         // M
};

template <typename Real>
using RealTensors = std::vector<std::vector<Real>>;

template <typename Real>
RealTensors<Real> cast_tensors(const Tensors& t) {
  RealTensors<Real> out;
  for (const auto& v : t) out.emplace_back(v.begin(), v.end());
  return out;
}

template <typename Real>
Tensors to_double(const RealTensors<Real>& t) {
  Tensors out;
  for (const auto& v : t) out.emplace_back(v.begin(), v.end());
  return out;
}

// Summed loss and gradients of micro-sequences first, first + stride, ... < M (SPEC 4.2: sums only).
inline double accumulate_micro_gradients(const RecipeConfig& r, const Tensors& w, const GlobalBatch& batch,
                                         int step, int first, int stride, Tensors& grads, int& count) {
  double loss = 0;
  count = 0;
  for (int j = first; j < batch.micro_count; j += stride, ++count) {
    const uint16_t* micro = batch.tokens + size_t(j) * batch.micro_len;
    loss += forward_backward(r.model, w, {micro, micro + 1, batch.micro_len, r.schedule.window_blocks(step)}, &grads);
  }
  return loss;
}

inline std::vector<ParamInfo> sharding_params(const ModelConfig& c) {
  std::vector<ParamInfo> infos;
  for (const ParamSpec& s : param_specs(c))
    infos.push_back({s.name, s.shape, uses_muon(s.role) ? OptimizerKind::muon : OptimizerKind::adam});
  return infos;
}

// ---------------------------------------------------------------------------------------------
// Unsharded: every parameter and state whole, on one rank.
template <typename Real>
struct ReferenceState {
  RealTensors<Real> params;
  RealTensors<Real> adam_m, adam_v, muon_momentum;  // per parameter; empty for the other optimizer
  int64_t adam_steps = 0;

  ReferenceState(const ModelConfig& c, const Tensors& init) : params(cast_tensors<Real>(init)) {
    for (const ParamSpec& s : param_specs(c)) {
      bool muon = uses_muon(s.role);
      adam_m.emplace_back(muon ? 0 : s.numel(), Real(0));
      adam_v.emplace_back(muon ? 0 : s.numel(), Real(0));
      muon_momentum.emplace_back(muon ? s.numel() : 0, Real(0));
    }
  }
};

// Both optimizers on gradients summed over micro_count micro-sequences (normalised here, once).
template <typename Real>
void reference_optimizer_step(const RecipeConfig& r, int step, Tensors& grads, int micro_count,
                              ReferenceState<Real>& st) {
  StepHyper hyper(r.schedule, step, r.muon);
  ++st.adam_steps;
  std::vector<ParamSpec> specs = param_specs(r.model);
  for (size_t p = 0; p < specs.size(); ++p) {
    for (double& g : grads[p]) g /= micro_count;  // the one normalisation: by the global count M
    if (uses_muon(specs[p].role))
      muon_update(st.params[p].data(), grads[p].data(), st.muon_momentum[p].data(), specs[p].shape,
                  hyper.muon_lr, hyper.muon_momentum, r.muon);
    else
      adam_update(st.params[p].data(), grads[p].data(), st.adam_m[p].data(), st.adam_v[p].data(),
                  specs[p].numel(), hyper.adam_lr(r.adam, specs[p].role), st.adam_steps, r.adam);
  }
}

// Returns the step's mean micro-sequence loss (summed token losses / M).
template <typename Real>
double reference_train_step(const RecipeConfig& r, int step, const GlobalBatch& batch, ReferenceState<Real>& st) {
  Tensors grads = zeros_like_params(r.model);
  int count = 0;
  double loss = accumulate_micro_gradients(r, to_double(st.params), batch, step, 0, 1, grads, count);
  reference_optimizer_step(r, step, grads, batch.micro_count, st);
  return loss / batch.micro_count;
}

// ---------------------------------------------------------------------------------------------
// Sharded over W ranks: each rank holds every parameter whole, but Adam state only for its dim-0
// slices and Muon momentum only for the matrices it owns.
template <typename Real>
struct RankState {
  RealTensors<Real> params;
  RealTensors<Real> adam_m, adam_v;            // per plan.adam entry: [slice_elems], this rank's slice
  std::map<int, std::vector<Real>> muon_momentum;  // param index -> [numel], owned matrices only
  int64_t adam_steps = 0;

  RankState(const ShardPlan& plan, int rank, const Tensors& init) : params(cast_tensors<Real>(init)) {
    for (const AdamShard& sh : plan.adam) {
      adam_m.emplace_back(sh.slice_elems(), Real(0));
      adam_v.emplace_back(sh.slice_elems(), Real(0));
    }
    for (int p : plan.muon_params_owned_by(rank)) muon_momentum[p].assign(params[p].size(), Real(0));
  }
};

// The honest global count of micro-sequences: the SUM of every rank's own count.
inline double global_micro_count(Communicator& comm, int local_count, int micro_count) {
  Fault f = injected_fault();
  double contribution = f == Fault::replicated_count_per_rank ? micro_count : local_count;
  double global = comm.all_reduce_sum(contribution);
  return f == Fault::local_count_normalization ? local_count : global;
}

template <typename Real>
void dist_adam_step(Communicator& comm, const ShardPlan& plan, const std::vector<ParamSpec>& specs,
                    const RecipeConfig& r, const StepHyper& hyper, const Tensors& grads, double count,
                    RankState<Real>& st) {
  const int rank = comm.rank(), W = comm.world_size();
  ++st.adam_steps;
  for (size_t a = 0; a < plan.adam.size(); ++a) {
    const AdamShard& sh = plan.adam[a];
    std::vector<double> padded_grad(sh.padded_rows() * sh.row_elems, 0.0);  // [padded_rows, row_elems]
    std::copy(grads[sh.param].begin(), grads[sh.param].end(), padded_grad.begin());
    std::vector<double> grad_slice(sh.slice_elems());                       // [rows_per_rank, row_elems]
    reduce_scatter_sum(comm, padded_grad.data(), grad_slice.data(), sh.slice_elems());
    for (double& g : grad_slice) g /= count;

    int slice_rank = injected_fault() == Fault::wrong_shard_offset ? (rank + 1) % W : rank;
    int64_t valid = std::min(sh.valid_rows(rank), sh.valid_rows(slice_rank)) * sh.row_elems;
    Real* p = st.params[sh.param].data() + sh.first_row(slice_rank) * sh.row_elems;
    adam_update(p, grad_slice.data(), st.adam_m[a].data(), st.adam_v[a].data(), valid,
                hyper.adam_lr(r.adam, specs[sh.param].role), st.adam_steps, r.adam);

    std::vector<Real> slice(sh.slice_elems(), Real(0)), gathered(sh.padded_rows() * sh.row_elems);
    std::copy(p, p + valid, slice.begin());
    all_gather(comm, slice.data(), gathered.data(), sh.slice_elems());
    for (int q = 0; q < W; ++q) {
      const Real* src = gathered.data() + q * sh.slice_elems();
      std::copy(src, src + sh.valid_rows(q) * sh.row_elems,
                st.params[sh.param].begin() + sh.first_row(q) * sh.row_elems);
    }
  }
}

template <typename Real>
void muon_step(Communicator& comm, const ShardPlan& plan, const std::vector<ParamSpec>& specs,
               const RecipeConfig& r, const StepHyper& hyper, const Tensors& grads, double count,
               RankState<Real>& st) {
  const int rank = comm.rank(), W = comm.world_size();
  for (const MuonGroup& group : plan.muon) {
    const int64_t n = group.matrix_elems();
    std::vector<double> chunk_grads(W * n), grad(n);        // [W, n] in, [n] out (own or scratch)
    std::vector<Real> scratch_param(n, Real(0)), gathered(W * n);
    for (const MuonChunk& chunk : group.chunks) {
      for (int q = 0; q < W; ++q) {
        int owner_param = chunk.owner_param[q];
        double* slot = chunk_grads.data() + q * n;
        if (owner_param >= 0) std::copy(grads[owner_param].begin(), grads[owner_param].end(), slot);
        else std::fill(slot, slot + n, 0.0);
      }
      reduce_scatter_sum(comm, chunk_grads.data(), grad.data(), n);
      int mine = chunk.owner_param[rank];
      if (mine >= 0) {
        for (double& g : grad) g /= count;
        muon_update(st.params[mine].data(), grad.data(), st.muon_momentum.at(mine).data(),
                    specs[mine].shape, hyper.muon_lr, hyper.muon_momentum, r.muon);
      }
      if (injected_fault() == Fault::skip_all_gather) continue;
      all_gather(comm, mine >= 0 ? st.params[mine].data() : scratch_param.data(), gathered.data(), n);
      for (int q = 0; q < W; ++q)
        if (chunk.owner_param[q] >= 0)
          std::copy(gathered.begin() + q * n, gathered.begin() + (q + 1) * n, st.params[chunk.owner_param[q]].begin());
    }
  }
}

// One step on this rank: micro-sequences j = rank, rank + W, ... < M, then the sharded optimizers.
// Returns the step's mean micro-sequence loss over all ranks.
template <typename Real>
double sharded_train_step(Communicator& comm, const ShardPlan& plan, const RecipeConfig& r, int step,
                          const GlobalBatch& batch, RankState<Real>& st) {
  const int rank = comm.rank(), W = comm.world_size();
  Tensors grads = zeros_like_params(r.model);
  int local_count = 0;
  double local_loss = accumulate_micro_gradients(r, to_double(st.params), batch, step, rank, W, grads, local_count);
  if (injected_fault() == Fault::prescale_by_world)
    for (auto& g : grads)
      for (double& v : g) v /= W;
  double count = global_micro_count(comm, local_count, batch.micro_count);
  std::vector<ParamSpec> specs = param_specs(r.model);
  StepHyper hyper(r.schedule, step, r.muon);
  dist_adam_step(comm, plan, specs, r, hyper, grads, count, st);
  muon_step(comm, plan, specs, r, hyper, grads, count, st);
  return comm.all_reduce_sum(local_loss) / batch.micro_count;
}
