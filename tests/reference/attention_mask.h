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

// For each query block: the kv blocks it attends, nearest first (partial blocks, then full ones).
// window_blocks may be 0 (the short window while the long one is 1): then only the diagonal.
inline std::vector<std::vector<int>> attended_kv_blocks(const std::vector<int>& docs, int block_size,
                                                        int window_blocks) {
  int num_blocks = int(docs.size()) / block_size;
  std::vector<std::vector<int>> attended(num_blocks);
  for (int q = 0; q < num_blocks; ++q) {
    int q_low = docs[q * block_size], q_high = docs[q * block_size + block_size - 1];
    std::vector<int> partial, full;  // nearest first: descending kv block index
    for (int kv = q; kv >= 0; --kv) {
      int kv_low = docs[kv * block_size], kv_high = docs[kv * block_size + block_size - 1];
      bool any = q_low <= kv_high && q_high >= kv_low;
      bool all = kv < q && q_low == kv_high && q_high == kv_low;
      if (all) full.push_back(kv);
      else if (any) partial.push_back(kv);
    }
    int full_count = int(full.size());
    int partial_keep = std::min(int(partial.size()), std::max(window_blocks - full_count, 1));
    int full_keep = std::max(0, std::min(full_count, window_blocks - 1));
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
