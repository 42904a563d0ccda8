// The seam the tests inject known bugs through: distributed bugs that the oracle
// (tests/test_oracle.cpp) must catch, wrong results of the fast paths that the start-up self-check
// (kernels/self_check.cuh) must catch, DiLoCo's and REKLS's bugs that their oracles must catch.
// The communication and optimizer layers and the self-check read the switch where the bug would
// be; only the tests set it (tests/injected_faults.h), so in a run it is always Fault::none.
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
  wrong_newest_flash_kernels,  // ... only where the fused backward or the warp-specialised forward runs
  wrong_fp8_head,              // ... the FP8 head's products
  wrong_fused_e5m2_gradient,   // ... the cross-entropy's fused e5m2 gradient
  wrong_batched_muon,          // ... the batched Muon update
  wrong_fused_residual_add,    // ... the matmul with the residual as cuBLASLt's C
  wrong_fused_mlp_fc,          // ... the MLP's fc product with ReLU² in our GEMM's epilogue
  wrong_fused_qkv,             // ... the qkv product with QK norm, RoPE and the value mix in its epilogue
  wrong_qkv_backward,          // ... the fused attention backward into dqkv (QK norm, RoPE, value mix)
  diloco_flipped_sign,         // DiLoCo's pseudo-gradient is local - global (torchft#233's bug)
  diloco_mix_to_copy,          // the mix of local and global is written to a copy, not in place
  diloco_average_by_world,     // the pseudo-gradients' sum is divided by W instead of G
  diloco_wrong_fragment,       // each sync exchanges the next fragment instead of its own
  diloco_momentum_reset,       // the outer momentum starts from zero at every sync
  diloco_delay_wrong_step,     // an exchange is applied one step after its delay
  local_matrix_gradient,       // a hidden matrix's owner updates it (REKLS factors, moments) from its own partial sum
  rekls_rotation_untransposed, // REKLS rotates the update back by Q_L U Q_R instead of Q_L U Q_R^T
  rekls_stale_eigenvalues,     // REKLS keeps the last refresh's eigenvalues between refreshes
  no_wait_for_reductions,      // the updates do not wait for the communication stream's reductions
  no_wait_for_gathers,         // the next forward does not wait for the communication stream's gathers
  value_embed_reduced_early,   // a value-embedding table is reduced after its highest reader, not its lowest
};

inline Fault& injected_fault() {
  static Fault fault = Fault::none;
  return fault;
}
