// The attention block lists of kernels/attention.cuh, without a GPU: for many document layouts
// (documents from a few tokens to longer than the sequence, first token a BOS or not, 1 to 40
// blocks) and every window from 0 to 16 blocks, the kv lists equal the reference's BlockMask
// construction (tests/reference/attention_mask.h, a literal port of create_blockmasks) and the q
// lists are their transpose; a sequence that is not whole blocks is refused.
#include "check.h"
#include "kernels/attention.cuh"
#include "reference/attention_mask.h"
#include "reference/synthetic.h"

#include <cmath>
#include <random>

namespace {

constexpr uint16_t kBos = 50256;

// Mismatching query blocks between the kernel's lists and the reference, plus q entries that are
// not in the kv list they claim.
int mismatches(const std::vector<uint16_t>& tokens, int window) {
  std::vector<int32_t> docs = attention_document_ids(tokens.data(), int(tokens.size()), kBos);
  AttentionBlockLists lists = build_attention_blocks(docs, window);
  std::vector<std::vector<int>> expected =
      attended_kv_blocks(std::vector<int>(docs.begin(), docs.end()), kAttentionBlock, window);
  int bad = 0;
  for (int qb = 0; qb < lists.num_blocks; ++qb) {
    auto begin = lists.kv_index.begin() + size_t(qb) * lists.max_kv;
    bad += std::vector<int>(begin, begin + lists.kv_count[qb]) != expected[qb];
  }
  for (int kb = 0; kb < lists.num_blocks; ++kb)
    for (int j = 0; j < lists.q_count[kb]; ++j) {
      const int qb = lists.q_index[size_t(kb) * lists.max_q + j];
      auto begin = lists.kv_index.begin() + size_t(qb) * lists.max_kv;
      bad += std::find(begin, begin + lists.kv_count[qb], kb) == begin + lists.kv_count[qb];
    }
  return bad;
}

}  // namespace

TEST_CASE("block lists equal the reference BlockMask for many layouts and every window") {
  std::mt19937_64 rng(7);
  int bad = 0, cases = 0;
  for (int layout = 0; layout < 300; ++layout) {
    const int blocks = 1 + int(rng() % 40);
    const double mean_doc = std::pow(10.0, 0.5 + 4.0 * double(rng() % 1000) / 1000);  // 3 to 30,000 tokens
    std::vector<uint16_t> tokens = synthetic_tokens(size_t(blocks) * kAttentionBlock, 50257, kBos, 1 / mean_doc, layout);
    if (layout % 2) tokens[0] = kBos;
    for (int window = 0; window <= 16; ++window, ++cases) bad += mismatches(tokens, window);
  }
  std::printf("  %d layout x window cases, %d mismatches\n", cases, bad);
  CHECK(bad == 0);
}

TEST_CASE("a sequence that is not whole blocks is refused") {
  CHECK_THROWS_WITH(build_attention_blocks(std::vector<int32_t>(200, 1), 4), "200 tokens are not whole blocks of 128");
}

int main() { return check::run_checks(); }
