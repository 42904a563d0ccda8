// The block-sparse, document-masked sliding-window attention mask of SPEC 1.4, built literally as
// the reference builds its FlexAttention BlockMask: "any"/"all" block masks, nearest-first
// ordering, and the window clamping of partial and full counts.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

// docs[t] = number of BOS tokens in tokens[0..t] (the BOS opens its own document).
inline std::vector<int> document_ids(const uint16_t* tokens, int T, int bos_token) {
  std::vector<int> docs(T);
  int d = 0;
  for (int t = 0; t < T; ++t) docs[t] = d += tokens[t] == bos_token;
  return docs;
}

// For each query block: the kv blocks it attends, nearest first (partial blocks, then full ones),
// as create_blockmasks computes them: dense [blocks, blocks] "any" and "all" masks, each row's
// indices by a stable ascending argsort of the mask, flipped (so the kept blocks come first, the
// highest index first), and the counts clamped to max(W - full, 1) partial and W - 1 full blocks.
// window_blocks may be 0 (the short window while the long one is 1): then only the diagonal.
inline std::vector<std::vector<int>> attended_kv_blocks(const std::vector<int>& docs, int block_size,
                                                        int window_blocks) {
  const int n = int(docs.size()) / block_size;
  auto low = [&](int b) { return docs[b * block_size]; };
  auto high = [&](int b) { return docs[b * block_size + block_size - 1]; };
  auto any = [&](int q, int kv) { return q >= kv && low(q) <= high(kv) && high(q) >= low(kv); };
  auto all = [&](int q, int kv) { return q > kv && low(q) == high(kv) && high(q) == low(kv); };
  // dense_to_ordered of one row: the count of set blocks and argsort(stable).flip order.
  auto ordered = [n](auto&& set, int q, int& count) {
    std::vector<int> row(n), order(n);
    count = 0;
    for (int kv = 0; kv < n; ++kv) count += row[kv] = set(q, kv);
    for (int kv = 0; kv < n; ++kv) order[kv] = kv;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return row[a] < row[b]; });
    std::reverse(order.begin(), order.end());
    return order;
  };
  std::vector<std::vector<int>> attended(n);
  for (int q = 0; q < n; ++q) {
    int partial_count, full_count;
    std::vector<int> partial = ordered([&](int a, int b) { return any(a, b) && !all(a, b); }, q, partial_count);
    std::vector<int> full = ordered(all, q, full_count);
    const int partial_keep = std::min(partial_count, std::max(window_blocks - full_count, 1));
    const int full_keep = std::max(0, std::min(full_count, window_blocks - 1));  // a count of -1 is none
    attended[q].assign(partial.begin(), partial.begin() + partial_keep);
    attended[q].insert(attended[q].end(), full.begin(), full.begin() + full_keep);
  }
  return attended;
}

// Token-level mask: allowed[t * T + s] for query t and key s (causal, same document, kv block kept).
inline std::vector<char> attention_allowed(const std::vector<int>& docs, int block_size, int window_blocks) {
  int T = int(docs.size());
  std::vector<char> allowed(size_t(T) * T, 0);
  std::vector<std::vector<int>> blocks = attended_kv_blocks(docs, block_size, window_blocks);
  for (int q = 0; q < int(blocks.size()); ++q)
    for (int kv : blocks[q])
      for (int t = q * block_size; t < (q + 1) * block_size; ++t)
        for (int s = kv * block_size; s < (kv + 1) * block_size; ++s)
          allowed[size_t(t) * T + s] = s <= t && docs[s] == docs[t];
  return allowed;
}
