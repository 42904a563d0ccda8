// The recipe's schedules (SPEC 1.4 and 1.8), host-side: learning-rate factor, Muon momentum warmup
// and the sliding-window size in 128-token blocks. Shared by the trainer and the CPU reference.
#pragma once
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

struct Schedule {
  int num_iterations = 1770;
  double cooldown_frac = 0.4;
  double min_lr_factor = 0.1;
  int momentum_warmup_steps = 300;
  double momentum_start = 0.85, momentum_end = 0.95;
  double max_window_tokens = 1728;  // grows to next_multiple_of_128(1728) = 1792 tokens = 14 blocks
  int window_granularity = 128;

  double progress(int step) const {
    if (step < 0 || step > num_iterations)
      throw std::out_of_range("step " + std::to_string(step) + " outside [0, " +
                              std::to_string(num_iterations) + "]");
    return double(step) / num_iterations;
  }

  // Flat 1.0, then linear down to min_lr_factor over the last cooldown_frac of training.
  double lr_factor(int step) const {
    double x = progress(step);
    if (x < 1 - cooldown_frac) return 1.0;
    double w = (1 - x) / cooldown_frac;
    return w * 1.0 + (1 - w) * min_lr_factor;
  }

  double muon_momentum(int step) const {
    double frac = std::min(double(step) / momentum_warmup_steps, 1.0);
    return (1 - frac) * momentum_start + frac * momentum_end;
  }

  // Long window in blocks; the short window is half of it (rounded down).
  int window_blocks(int step) const {
    double target = max_window_tokens * progress(step);
    // The reference's next_multiple_of_n(v, 128): the smallest multiple >= v, at least 128.
    int tokens = std::max(window_granularity,
                          int(std::ceil(target / window_granularity)) * window_granularity);
    return tokens / window_granularity;
  }
};
