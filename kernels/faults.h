// Test-only fault switch: known distributed bugs that the oracle (tests/test_oracle.cpp) must catch,
// wrong results of the fast paths that the start-up self-check (self_check.cuh) must catch, and
// DiLoCo's outer-loop bugs that its oracle (tests/gpu/test_diloco.cu) must catch.
// Production code never sets it; the communication and optimizer layers and the self-check read it.
#pragma once

enum class Fault {
  none,
  avg_instead_of_sum,          // reduce-scatter divides its sum by the world size
  local_count_normalization,   // gradients normalised by the rank's own micro-sequence count
  prescale_by_world,           // each rank divides its gradient by W before the SUM
  drop_rank_contribution,      // the last rank's contribution is left out of every reduce-scatter
  wrong_shard_offset,          // DistAdam updates the parameter slice of the next rank
  skip_all_gather,             // Muon's all-gather is skipped: other ranks keep stale matrices
  replicated_count_per_rank,   // every rank contributes the (replicated) global count to its sum
  wrong_flash_attention,       // the self-check sees the flash kernels' outputs 25% off
  wrong_fp8_head,              // ... the FP8 head's products
  wrong_fused_e5m2_gradient,   // ... the cross-entropy's fused e5m2 gradient
  wrong_batched_muon,          // ... the batched Muon update
  wrong_fused_residual_add,    // ... the matmul with the residual as cuBLASLt's C
  diloco_flipped_sign,         // DiLoCo's pseudo-gradient is local - global (torchft#233's bug)
  diloco_mix_to_copy,          // the mix of local and global is written to a copy, not in place
  diloco_average_by_world,     // the pseudo-gradients' sum is divided by W instead of G
  diloco_wrong_fragment,       // each sync exchanges the next fragment instead of its own
  diloco_momentum_reset,       // the outer momentum starts from zero at every sync
  diloco_delay_wrong_step,     // an exchange is applied one step after its delay
  local_matrix_gradient,       // a hidden matrix's owner updates it (REKLS factors, moments) from its own partial sum
  rekls_rotation_untransposed, // REKLS rotates the update back by Q_L U Q_R instead of Q_L U Q_R^T
  rekls_stale_eigenvalues,     // REKLS keeps the last refresh's eigenvalues between refreshes
};

inline Fault& injected_fault() {
  static Fault fault = Fault::none;
  return fault;
}

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
    case Fault::diloco_flipped_sign: return "diloco_flipped_sign";
    case Fault::diloco_mix_to_copy: return "diloco_mix_to_copy";
    case Fault::diloco_average_by_world: return "diloco_average_by_world";
    case Fault::diloco_wrong_fragment: return "diloco_wrong_fragment";
    case Fault::diloco_momentum_reset: return "diloco_momentum_reset";
    case Fault::diloco_delay_wrong_step: return "diloco_delay_wrong_step";
    case Fault::local_matrix_gradient: return "local_matrix_gradient";
    case Fault::rekls_rotation_untransposed: return "rekls_rotation_untransposed";
    case Fault::rekls_stale_eigenvalues: return "rekls_stale_eigenvalues";
  }
  return "?";
}
