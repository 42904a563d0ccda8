// The tests' side of kernels/host/faults.h: a scoped switch that injects one known bug into the
// trainer's code, and the bug's name for the tests' reports.
#pragma once
#include "kernels/host/faults.h"

// Sets a fault for the lifetime of the guard and always restores Fault::none (an exception too).
struct ScopedFault {
  explicit ScopedFault(Fault f) { injected_fault() = f; }
  ~ScopedFault() { injected_fault() = Fault::none; }
  ScopedFault(const ScopedFault&) = delete;
  ScopedFault& operator=(const ScopedFault&) = delete;
};

inline const char* fault_name(Fault f) {
  switch (f) {
    case Fault::none: return "none";
    case Fault::avg_instead_of_sum: return "avg_instead_of_sum";
    case Fault::local_count_normalization: return "local_count_normalization";
    case Fault::prescale_by_world: return "prescale_by_world";
    case Fault::drop_rank_contribution: return "drop_rank_contribution";
    case Fault::wrong_shard_offset: return "wrong_shard_offset";
    case Fault::skip_all_gather: return "skip_all_gather";
    case Fault::replicated_count_per_rank: return "replicated_count_per_rank";
    case Fault::wrong_flash_attention: return "wrong_flash_attention";
    case Fault::wrong_fp8_head: return "wrong_fp8_head";
    case Fault::wrong_fused_e5m2_gradient: return "wrong_fused_e5m2_gradient";
    case Fault::wrong_batched_muon: return "wrong_batched_muon";
    case Fault::wrong_fused_residual_add: return "wrong_fused_residual_add";
    case Fault::wrong_fused_mlp_fc: return "wrong_fused_mlp_fc";
    case Fault::wrong_fused_qkv: return "wrong_fused_qkv";
    case Fault::wrong_qkv_backward: return "wrong_qkv_backward";
    case Fault::wrong_newest_flash_kernels: return "wrong_newest_flash_kernels";
    case Fault::diloco_flipped_sign: return "diloco_flipped_sign";
    case Fault::diloco_mix_to_copy: return "diloco_mix_to_copy";
    case Fault::diloco_average_by_world: return "diloco_average_by_world";
    case Fault::diloco_wrong_fragment: return "diloco_wrong_fragment";
    case Fault::diloco_momentum_reset: return "diloco_momentum_reset";
    case Fault::diloco_delay_wrong_step: return "diloco_delay_wrong_step";
    case Fault::local_matrix_gradient: return "local_matrix_gradient";
    case Fault::rekls_rotation_untransposed: return "rekls_rotation_untransposed";
    case Fault::rekls_stale_eigenvalues: return "rekls_stale_eigenvalues";
    case Fault::no_wait_for_reductions: return "no_wait_for_reductions";
    case Fault::no_wait_for_gathers: return "no_wait_for_gathers";
    case Fault::value_embed_reduced_early: return "value_embed_reduced_early";
  }
  return "?";
}
