// Synthetic token streams for the CPU tests: random tokens with documents opened by BOS at random
// places, so that document masks and windows are exercised.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

inline std::vector<uint16_t> synthetic_tokens(size_t n, int vocab_size, int bos_token, double bos_rate,
                                              uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> token(0, vocab_size - 1);
  std::bernoulli_distribution bos(bos_rate);
  std::vector<uint16_t> tokens(n);
  for (uint16_t& t : tokens) {
    t = uint16_t(token(rng));
    if (t == bos_token || bos(rng)) t = uint16_t(bos_token);
  }
  return tokens;
}
