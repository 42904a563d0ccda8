// Test-only fault switch: known distributed bugs that the oracle (tests/test_oracle.cpp) must catch.
// Production code never sets it; the communication and optimizer layers read it.
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
};

inline Fault& injected_fault() {
  static Fault fault = Fault::none;
  return fault;
}

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
  }
  return "?";
}
