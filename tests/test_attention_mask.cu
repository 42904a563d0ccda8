// The attention block lists of kernels/attention.cuh, without a GPU: for many document layouts
// (documents from a few tokens to longer than the sequence, first token a BOS or not, 1 to 40
// blocks) and every window from 0 to 16 blocks, the kv lists equal the reference's BlockMask
// construction (tests/reference/attention_mask.h, a literal port of create_blockmasks) and the q
// lists are their transpose, the query blocks ordered longest first, with each kv block's turn among a query block's kv blocks counting
// them from the last (the fused backward's order of dq sums); a sequence that is not whole blocks
// is refused.
#include "check.h"
#include "kernels/attention.cuh"
#include "reference/attention_mask.h"
#include "reference/synthetic.h"

#include <cmath>
#include <random>

namespace {

constexpr uint16_t kBos = 50256;

// Mismatching query blocks between the kernel's lists and the reference, plus q entries that are
// not in the kv list they claim, plus query blocks whose contributors' turns, read in descending
// kv-block order, are not 0, 1, 2, ..., plus a longest-first order that is no permutation of the
// query blocks by descending kv count.
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
  std::vector<std::vector<int>> turns(lists.num_blocks);  // per query block, in descending kv-block order
  for (int kb = lists.num_blocks - 1; kb >= 0; --kb)
    for (int j = 0; j < lists.q_count[kb]; ++j)
      turns[lists.q_index[size_t(kb) * lists.max_q + j]].push_back(lists.q_turn[size_t(kb) * lists.max_q + j]);
  for (int qb = 0; qb < lists.num_blocks; ++qb) {
    std::vector<int> in_order(lists.kv_count[qb]);
    for (int i = 0; i < lists.kv_count[qb]; ++i) in_order[i] = i;
    bad += turns[qb] != in_order;
  }
  std::vector<int> order = lists.longest_first;
  bad += order.size() != size_t(lists.num_blocks);
  for (size_t i = 1; i < order.size(); ++i) bad += lists.kv_count[order[i - 1]] < lists.kv_count[order[i]];
  std::sort(order.begin(), order.end());
  for (int qb = 0; qb < int(order.size()); ++qb) bad += order[qb] != qb;
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
