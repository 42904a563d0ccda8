// Causal, document-masked, block-sparse sliding-window attention (SPEC 1.4), head_dim 128,
// scale 0.12, bf16 in and out, fp32 softmax statistics. Blocks outside the window or document
// are skipped, not masked: each query block walks only its own list of kv blocks.
//
// This is the correct baseline (one warp per query or key row, CUDA cores); the tensor-core
// version replaces the kernels, not the interface. The backward is deterministic: dq per query,
// dk and dv per key (over the inverse block lists), no atomics.
#pragma once
#include "kernels/host/cuda_check.cuh"
#include "kernels/device_utils.cuh"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

constexpr int kAttentionHeadDim = 128;
constexpr int kAttentionBlock = 128;
constexpr float kAttentionScale = 0.12f;

// The block lists of one micro-sequence for one window size, built as the reference builds its
// BlockMask: "any" (partial) and "all" (full) blocks, nearest first, partial count clamped to
// max(window - full, 1) and full count to window - 1.
struct AttentionBlockLists {
  int num_blocks = 0, max_kv = 0, max_q = 0;
  std::vector<int> kv_count, kv_index;  // [num_blocks], [num_blocks, max_kv]: kv blocks of each q block
  std::vector<int> q_count, q_index;    // [num_blocks], [num_blocks, max_q]: q blocks that attend each kv block
  // [num_blocks, max_q]: kv block kb's turn among the kv blocks of its j-th q block, counted in
  // descending kv-block order (the fused backward adds their dq contributions in that order).
  std::vector<int> q_turn;
  // [num_blocks]: the query blocks by descending kv count (ties in sequence order): the flash
  // forward starts the longest first, so that the last wave is of short ones.
  std::vector<int> longest_first;
};

// docs[t] = number of BOS tokens in tokens[0..t] (each document begins with its BOS).
// Document ids only grow along the sequence, so key s is in query t's document and not after it
// exactly when document_starts(docs)[t] <= s <= t: the flash kernels' mask is two compares a row.
inline std::vector<int32_t> attention_document_ids(const uint16_t* tokens, int T, uint16_t bos) {
  std::vector<int32_t> docs(T);
  int32_t d = 0;
  for (int t = 0; t < T; ++t) docs[t] = d += tokens[t] == bos;
  return docs;
}

// The first token of each token's document.
inline std::vector<int32_t> document_starts(const std::vector<int32_t>& docs) {
  std::vector<int32_t> starts(docs.size());
  for (size_t t = 0; t < docs.size(); ++t) starts[t] = t > 0 && docs[t] == docs[t - 1] ? starts[t - 1] : int32_t(t);
  return starts;
}

inline AttentionBlockLists build_attention_blocks(const std::vector<int32_t>& docs, int window_blocks,
                                                  int block = kAttentionBlock) {
  if (docs.size() % block != 0)
    throw std::invalid_argument("attention mask: " + std::to_string(docs.size()) + " tokens are not whole blocks of " +
                                std::to_string(block));
  AttentionBlockLists b;
  b.num_blocks = int(docs.size()) / block;
  std::vector<std::vector<int>> kv(b.num_blocks), q(b.num_blocks);
  for (int qb = 0; qb < b.num_blocks; ++qb) {
    int q_low = docs[qb * block], q_high = docs[qb * block + block - 1];
    std::vector<int> partial, full;
    for (int kb = qb; kb >= 0; --kb) {
      int kv_low = docs[kb * block], kv_high = docs[kb * block + block - 1];
      if (kb < qb && q_low == kv_high && q_high == kv_low) full.push_back(kb);
      else if (q_low <= kv_high && q_high >= kv_low) partial.push_back(kb);
    }
    int full_keep = std::max(0, std::min(int(full.size()), window_blocks - 1));
    int partial_keep = std::min(int(partial.size()), std::max(window_blocks - int(full.size()), 1));
    kv[qb].assign(partial.begin(), partial.begin() + partial_keep);
    kv[qb].insert(kv[qb].end(), full.begin(), full.begin() + full_keep);
    for (int kb : kv[qb]) q[kb].push_back(qb);
  }
  auto flatten = [&](const std::vector<std::vector<int>>& lists, std::vector<int>& count, std::vector<int>& index, int& width) {
    width = 1;
    for (const auto& l : lists) width = std::max(width, int(l.size()));
    count.assign(b.num_blocks, 0);
    index.assign(size_t(b.num_blocks) * width, -1);
    for (int i = 0; i < b.num_blocks; ++i) {
      count[i] = int(lists[i].size());
      std::copy(lists[i].begin(), lists[i].end(), index.begin() + size_t(i) * width);
    }
  };
  flatten(kv, b.kv_count, b.kv_index, b.max_kv);
  flatten(q, b.q_count, b.q_index, b.max_q);
  b.longest_first.resize(b.num_blocks);
  for (int qb = 0; qb < b.num_blocks; ++qb) b.longest_first[qb] = qb;
  std::stable_sort(b.longest_first.begin(), b.longest_first.end(),
                   [&](int x, int y) { return b.kv_count[x] > b.kv_count[y]; });
  b.q_turn.assign(b.q_index.size(), -1);
  for (int kb = 0; kb < b.num_blocks; ++kb)
    for (int j = 0; j < b.q_count[kb]; ++j) {
      const std::vector<int>& contributors = kv[q[kb][j]];
      b.q_turn[size_t(kb) * b.max_q + j] =
          int(std::count_if(contributors.begin(), contributors.end(), [&](int other) { return other > kb; }));
    }
  return b;
}

// The block lists and document ids on the device.
struct DeviceAttentionMask {
  int num_blocks = 0, max_kv = 0, max_q = 0;
  int *kv_count = nullptr, *kv_index = nullptr, *q_count = nullptr, *q_index = nullptr, *q_turn = nullptr;
  int* longest_first = nullptr;
  int32_t* docs = nullptr;       // [T]
  int32_t* doc_start = nullptr;  // [T]: the first token of each token's document
};

// Each row (query or key) of q, k, v, y, dy, dq, dk, dv is [H, 128] at a stride of row_stride
// elements between tokens (q, k, v may live inside the fused qkv buffer); lse, delta are [H, T].
struct AttentionTensors {
  int T, H;
  int64_t q_stride, k_stride, v_stride;  // elements between consecutive tokens
};

__device__ inline bool attends(const DeviceAttentionMask& m, int t, int s) {
  return s <= t && m.docs[s] == m.docs[t];
}

// One warp per (query t, head h): y[t, h] and lse[h, t] by online softmax over the listed blocks.
__global__ void attention_forward_kernel(const bf16* q, const bf16* k, const bf16* v, bf16* y, float* lse,
                                         AttentionTensors a, DeviceAttentionMask m) {
  await_previous_kernel();
  int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= a.T * a.H) return;
  int t = warp / a.H, h = warp % a.H, qb = t / kAttentionBlock;
  float qv[4], acc[4] = {0, 0, 0, 0}, row_max = -INFINITY, row_sum = 0;
  const bf16* qrow = q + t * a.q_stride + h * kAttentionHeadDim + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) qv[i] = __bfloat162float(qrow[i]) * kAttentionScale;
  for (int j = 0; j < m.kv_count[qb]; ++j) {
    int kb = m.kv_index[qb * m.max_kv + j];
    for (int s = kb * kAttentionBlock; s < (kb + 1) * kAttentionBlock; ++s) {
      if (!attends(m, t, s)) continue;
      const bf16* krow = k + s * a.k_stride + h * kAttentionHeadDim + lane * 4;
      float score = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) score += qv[i] * __bfloat162float(krow[i]);
      score = warp_sum(score);
      float new_max = fmaxf(row_max, score), correction = __expf(row_max - new_max), p = __expf(score - new_max);
      const bf16* vrow = v + s * a.v_stride + h * kAttentionHeadDim + lane * 4;
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] = acc[i] * correction + p * __bfloat162float(vrow[i]);
      row_sum = row_sum * correction + p;
      row_max = new_max;
    }
  }
  bf16* yrow = y + (size_t(t) * a.H + h) * kAttentionHeadDim + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) yrow[i] = __float2bfloat16(acc[i] / row_sum);
  if (lane == 0) lse[size_t(h) * a.T + t] = row_max + logf(row_sum);
}

// delta[h, t] = dot(dy[t, h], y[t, h]): the softmax backward's row term. A lane reads its four
// elements of each as one 8-byte load (y and dy 8-byte aligned): four 2-byte loads each made the
// pass load-unit bound, as QK norm + RoPE's were (docs/PERF.md, 2026-11-27). Also sets
// zeroed[0, zeroed_count) to 0 on the way (the fused flash backward's counters, which a memset
// between the two kernels zeroed before: one operation less, and no break in a chain of
// programmatic dependent launches).
__global__ void attention_delta_kernel(const bf16* y, const bf16* dy, float* delta, int T, int H, int* zeroed,
                                       int zeroed_count) {
  await_previous_kernel();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < zeroed_count; i += gridDim.x * blockDim.x) zeroed[i] = 0;
  int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= T * H) return;
  int t = warp / H, h = warp % H;
  size_t at = (size_t(t) * H + h) * kAttentionHeadDim + lane * 4;
  float yv[4], gv[4], d = 0;
  load4(y + at, yv);
  load4(dy + at, gv);
#pragma unroll
  for (int i = 0; i < 4; ++i) d += yv[i] * gv[i];
  d = warp_sum(d);
  if (lane == 0) delta[size_t(h) * T + t] = d;
}

// One warp per (query t, head h): dq[t, h] = scale * sum_s P_ts (dy_t . v_s - delta_t) k_s.
__global__ void attention_backward_dq_kernel(const bf16* q, const bf16* k, const bf16* v, const bf16* dy,
                                             const float* lse, const float* delta, bf16* dq,
                                             AttentionTensors a, DeviceAttentionMask m) {
  await_previous_kernel();
  int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= a.T * a.H) return;
  int t = warp / a.H, h = warp % a.H, qb = t / kAttentionBlock;
  float qv[4], g[4], acc[4] = {0, 0, 0, 0};
  const bf16* qrow = q + t * a.q_stride + h * kAttentionHeadDim + lane * 4;
  const bf16* grow = dy + (size_t(t) * a.H + h) * kAttentionHeadDim + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) qv[i] = __bfloat162float(qrow[i]) * kAttentionScale, g[i] = __bfloat162float(grow[i]);
  float row_lse = lse[size_t(h) * a.T + t], row_delta = delta[size_t(h) * a.T + t];
  for (int j = 0; j < m.kv_count[qb]; ++j) {
    int kb = m.kv_index[qb * m.max_kv + j];
    for (int s = kb * kAttentionBlock; s < (kb + 1) * kAttentionBlock; ++s) {
      if (!attends(m, t, s)) continue;
      const bf16* krow = k + s * a.k_stride + h * kAttentionHeadDim + lane * 4;
      const bf16* vrow = v + s * a.v_stride + h * kAttentionHeadDim + lane * 4;
      float kv[4], score = 0, dp = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        kv[i] = __bfloat162float(krow[i]);
        score += qv[i] * kv[i];
        dp += g[i] * __bfloat162float(vrow[i]);
      }
      score = warp_sum(score);
      dp = warp_sum(dp);
      float ds = __expf(score - row_lse) * (dp - row_delta) * kAttentionScale;
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] += ds * kv[i];
    }
  }
  bf16* out = dq + (size_t(t) * a.H + h) * kAttentionHeadDim + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = __float2bfloat16(acc[i]);
}

// One warp per (key s, head h): dk[s, h] = scale * sum_t P_ts (dy_t . v_s - delta_t) q_t and
// dv[s, h] = sum_t P_ts dy_t, over the query blocks that list s's block.
__global__ void attention_backward_dkv_kernel(const bf16* q, const bf16* k, const bf16* v, const bf16* dy,
                                              const float* lse, const float* delta, bf16* dk, bf16* dv,
                                              AttentionTensors a, DeviceAttentionMask m) {
  await_previous_kernel();
  int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= a.T * a.H) return;
  int s = warp / a.H, h = warp % a.H, kb = s / kAttentionBlock;
  float kv[4], vv[4], dk_acc[4] = {0, 0, 0, 0}, dv_acc[4] = {0, 0, 0, 0};
  const bf16* krow = k + s * a.k_stride + h * kAttentionHeadDim + lane * 4;
  const bf16* vrow = v + s * a.v_stride + h * kAttentionHeadDim + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) kv[i] = __bfloat162float(krow[i]), vv[i] = __bfloat162float(vrow[i]);
  for (int j = 0; j < m.q_count[kb]; ++j) {
    int qb = m.q_index[kb * m.max_q + j];
    for (int t = qb * kAttentionBlock; t < (qb + 1) * kAttentionBlock; ++t) {
      if (!attends(m, t, s)) continue;
      const bf16* qrow = q + t * a.q_stride + h * kAttentionHeadDim + lane * 4;
      const bf16* grow = dy + (size_t(t) * a.H + h) * kAttentionHeadDim + lane * 4;
      float qv[4], g[4], score = 0, dp = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        qv[i] = __bfloat162float(qrow[i]);
        g[i] = __bfloat162float(grow[i]);
        score += qv[i] * kv[i];
        dp += g[i] * vv[i];
      }
      score = warp_sum(score) * kAttentionScale;
      dp = warp_sum(dp);
      float p = __expf(score - lse[size_t(h) * a.T + t]);
      float ds = p * (dp - delta[size_t(h) * a.T + t]) * kAttentionScale;
#pragma unroll
      for (int i = 0; i < 4; ++i) dk_acc[i] += ds * qv[i], dv_acc[i] += p * g[i];
    }
  }
  size_t at = (size_t(s) * a.H + h) * kAttentionHeadDim + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) dk[at + i] = __float2bfloat16(dk_acc[i]), dv[at + i] = __float2bfloat16(dv_acc[i]);
}

// One micro-sequence's document ids and block lists for one window, on the device (in memory of
// the StagedUploads, valid until its next reset).
class AttentionMask {
 public:
  AttentionMask(const std::vector<int32_t>& docs, const AttentionBlockLists& lists, StagedUploads& uploads,
                cudaStream_t stream) {
    m_.num_blocks = lists.num_blocks;
    m_.max_kv = lists.max_kv;
    m_.max_q = lists.max_q;
    m_.docs = uploads.upload(docs, stream);
    m_.doc_start = uploads.upload(document_starts(docs), stream);
    m_.kv_count = uploads.upload(lists.kv_count, stream);
    m_.kv_index = uploads.upload(lists.kv_index, stream);
    m_.q_count = uploads.upload(lists.q_count, stream);
    m_.q_index = uploads.upload(lists.q_index, stream);
    m_.q_turn = uploads.upload(lists.q_turn, stream);
    m_.longest_first = uploads.upload(lists.longest_first, stream);
  }
  // What the constructor stages, for StagedUploads::reset.
  static size_t upload_bytes(const std::vector<int32_t>& docs, const AttentionBlockLists& lists) {
    return 2 * StagedUploads::bytes_for(docs) + StagedUploads::bytes_for(lists.kv_count) +
           StagedUploads::bytes_for(lists.kv_index) + StagedUploads::bytes_for(lists.q_count) +
           StagedUploads::bytes_for(lists.q_index) + StagedUploads::bytes_for(lists.q_turn) +
           StagedUploads::bytes_for(lists.longest_first);
  }
  const DeviceAttentionMask& device() const { return m_; }

 private:
  DeviceAttentionMask m_;
};

// T a whole number of 128-token blocks, as many as the mask has.
inline void check_attention_shape(const AttentionTensors& a, const AttentionMask& mask) {
  if (a.T % kAttentionBlock != 0 || mask.device().num_blocks != a.T / kAttentionBlock)
    throw std::invalid_argument("attention: T = " + std::to_string(a.T) + " must be a multiple of " +
                                std::to_string(kAttentionBlock) + " matching the mask");
}

inline int attention_grid(const AttentionTensors& a, int warps_per_block) {
  return (a.T * a.H + warps_per_block - 1) / warps_per_block;
}

// y, lse: [T, H, 128], [H, T]
inline void attention_forward(const bf16* q, const bf16* k, const bf16* v, bf16* y, float* lse, const AttentionTensors& a,
                              const AttentionMask& mask, cudaStream_t stream) {
  check_attention_shape(a, mask);
  CUDA_CHECK(
      launch_kernel(attention_forward_kernel, attention_grid(a, 8), 256, 0, stream, q, k, v, y, lse, a, mask.device()));
}

// Every attention backward takes scratch of this many floats: delta [H, T] first; the fused flash
// backward then keeps dq's fp32 partial sums [H, T, 128] and its counters as ints (a ticket, then
// a turn per head and 64 queries), and last (--qkv-backward fused) the value mix's partial sums,
// 2 per (head, 128 keys).
inline size_t attention_backward_scratch_floats(int T, int H) {
  return size_t(H) * T * (1 + kAttentionHeadDim) + 1 + size_t(H) * (T / 64) + 2 * size_t(H) * (T / 128);
}

// scratch: attention_backward_scratch_floats(T, H); dq, dk, dv: [T, H, 128]
inline void attention_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* y, const bf16* dy,
                               const float* lse, float* scratch, bf16* dq, bf16* dk, bf16* dv,
                               const AttentionTensors& a, const AttentionMask& mask, cudaStream_t stream) {
  check_attention_shape(a, mask);
  for (auto [name, p] : {std::pair{"y", y}, std::pair{"dy", dy}})
    if (reinterpret_cast<uintptr_t>(p) % 8)
      throw std::invalid_argument(std::string("attention backward: ") + name +
                                  " must start 8-byte aligned (attention_delta_kernel reads 4 elements at a time)");
  float* delta = scratch;  // [H, T]
  CUDA_CHECK(launch_kernel(attention_delta_kernel, attention_grid(a, 8), 256, 0, stream, y, dy, delta, a.T, a.H,
                           nullptr, 0));
  CUDA_CHECK(launch_kernel(attention_backward_dq_kernel, attention_grid(a, 8), 256, 0, stream, q, k, v, dy, lse, delta,
                           dq, a, mask.device()));
  CUDA_CHECK(launch_kernel(attention_backward_dkv_kernel, attention_grid(a, 8), 256, 0, stream, q, k, v, dy, lse, delta,
                           dk, dv, a, mask.device()));
}
