// --matmul-algorithms: which of cuBLASLt's heuristic answers (MatmulOptions::candidate) each of the
// blocks' products takes, as "linear.product=N" items joined by commas, e.g. "mlp-fc.dw=2,qkv.dx=1";
// a product not named takes 0, the heuristic's first (as PyTorch does); "first" names none.
// `bench_kernels matmul` times every answer of each product as the trainer makes it (T = 49,152,
// the projections' residual as cuBLASLt's C, the weight gradients added into fp32) and prints the
// value that takes the fastest of each. Fixed per run, never timed at start-up: a run and its
// resume take the same algorithms, as they take the same kernels.
#pragma once

#include <array>
#include <stdexcept>
#include <string>

enum class BlockLinear { qkv, attn_proj, mlp_fc, mlp_proj };
enum class LinearProduct { fwd, dx, dw };  // y = x W^T, dx = dy W, dW += dy^T x

struct MatmulAlgorithms {
  static constexpr std::array<const char*, 4> kLinears{"qkv", "attn-proj", "mlp-fc", "mlp-proj"};
  static constexpr std::array<const char*, 3> kProducts{"fwd", "dx", "dw"};

  std::array<std::array<int, kProducts.size()>, kLinears.size()> candidate{};

  int of(BlockLinear l, LinearProduct p) const { return candidate[int(l)][int(p)]; }
  static std::string name_of(BlockLinear l, LinearProduct p) {
    return std::string(kLinears[int(l)]) + "." + kProducts[int(p)];
  }

  // The flag's value: the named products in table order, "first" when none is.
  std::string text() const {
    std::string items;
    for (size_t l = 0; l < kLinears.size(); ++l)
      for (size_t p = 0; p < kProducts.size(); ++p)
        if (candidate[l][p] != 0)
          items += (items.empty() ? "" : ",") + name_of(BlockLinear(l), LinearProduct(p)) + "=" +
                   std::to_string(candidate[l][p]);
    return items.empty() ? "first" : items;
  }

  // Reads the flag's value; std::invalid_argument names the item at fault and what it may be.
  static MatmulAlgorithms parse(const std::string& text, int max_candidates) {
    MatmulAlgorithms a;
    if (text == "first") return a;
    std::array<std::array<bool, kProducts.size()>, kLinears.size()> named{};
    for (size_t start = 0; start <= text.size();) {
      size_t end = text.find(',', start);
      if (end == std::string::npos) end = text.size();
      const std::string item = text.substr(start, end - start);
      start = end + 1;
      if (item == "first") throw std::invalid_argument("'first' is the whole value (no product named), not an item of a list");
      const size_t dot = item.find('.'), eq = item.find('=');
      if (dot == std::string::npos || eq == std::string::npos || eq < dot)
        throw std::invalid_argument("'" + item + "' is not linear.product=N (e.g. mlp-fc.dw=2), nor is the value \"first\"");
      const int l = index_of(kLinears, item.substr(0, dot)), p = index_of(kProducts, item.substr(dot + 1, eq - dot - 1));
      if (l < 0) throw std::invalid_argument("'" + item + "': the linear is one of " + list(kLinears));
      if (p < 0) throw std::invalid_argument("'" + item + "': the product is one of " + list(kProducts));
      const std::string number = item.substr(eq + 1);
      int value = -1;
      if (!number.empty() && number.size() <= 2 && number.find_first_not_of("0123456789") == std::string::npos)
        value = std::stoi(number);
      if (value < 0 || value >= max_candidates)
        throw std::invalid_argument("'" + item + "': the candidate is an integer in [0, " +
                                    std::to_string(max_candidates) + ")");
      if (named[l][p]) throw std::invalid_argument("'" + item + "': " + name_of(BlockLinear(l), LinearProduct(p)) +
                                                   " is named twice");
      named[l][p] = true;
      a.candidate[l][p] = value;
    }
    return a;
  }

 private:
  template <size_t N>
  static int index_of(const std::array<const char*, N>& names, const std::string& name) {
    for (size_t i = 0; i < N; ++i)
      if (name == names[i]) return int(i);
    return -1;
  }
  template <size_t N>
  static std::string list(const std::array<const char*, N>& names) {
    std::string text;
    for (size_t i = 0; i < N; ++i) text += (i ? (i + 1 == N ? " or " : ", ") : "") + std::string(names[i]);
    return text;
  }
};
