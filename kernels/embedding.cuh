// Token embedding and the value embeddings (SPEC 1.2): a row gather forward; a deterministic
// backward that sums each token's gradient rows in position order, a warp per segment of at most
// kEmbeddingSegment positions of a token and a second pass over the segments of tokens that have
// several, so no float atomics and bitwise-equal gradients run to run. The order comes from the host, which
// holds every micro-sequence's tokens anyway (the attention masks are built from them too).
#pragma once
#include "kernels/host/cuda_check.cuh"
#include "kernels/device_utils.cuh"

#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

// out[T, d] = table[tokens[t], :], d a multiple of 8
__global__ void embedding_forward_kernel(const uint16_t* tokens, const bf16* table, bf16* out, int T, int d) {
  await_previous_kernel();
  const int vectors_per_row = d / 8;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(T) * vectors_per_row;
       i += size_t(gridDim.x) * blockDim.x) {
    size_t t = i / vectors_per_row, c = i % vectors_per_row;
    reinterpret_cast<Bf16x8*>(out)[i] = reinterpret_cast<const Bf16x8*>(table + size_t(tokens[t]) * d)[c];
  }
}

inline void check_embedding_width(int d) {
  if (d % 8 != 0) throw std::invalid_argument("embedding: width " + std::to_string(d) + " must be a multiple of 8");
}

// tokens [T] (device), table [V, d], out [T, d]
inline void embedding_forward(const uint16_t* tokens, const bf16* table, bf16* out, int T, int d, cudaStream_t stream) {
  check_embedding_width(d);
  CUDA_CHECK(launch_kernel(embedding_forward_kernel, elementwise_grid(size_t(T) * (d / 8)), 256, 0, stream, tokens,
                           table, out, T, d));
}

// Positions a backward block sums at most. One block per distinct token let a frequent token
// serialise the kernel: token 198 ("\n") occurs ~3,500 times in 49,152 tokens of text, and its block
// alone took most of the 0.48 ms (docs/PERF.md, 2026-11-27). A token with more positions is split
// into segments whose sums a second pass adds in segment order.
constexpr int kEmbeddingSegment = 32;

// The positions of a micro-sequence grouped by token: positions[begin[u] .. begin[u + 1]) are
// where token tokens[u] occurs, in increasing order, cut into segments of at most
// kEmbeddingSegment positions. Segment s covers slots [segment_begin[s], segment_begin[s + 1]) of
// table row segment_row[s]; segment_partial[s] is -1 when it is its token's only segment (it adds
// to the gradient itself), else the scratch row its sum goes to. A split token j (table row
// split_row[j]) has its segments' sums in scratch rows [split_first[j], split_first[j + 1]).
// Built on the host, uploaded once (into the StagedUploads, valid until its next reset), shared
// by the four tables' backward passes.
class EmbeddingBackwardPlan {
 public:
  EmbeddingBackwardPlan(const uint16_t* host_tokens, int T, int vocab_size, StagedUploads& uploads,
                        cudaStream_t stream) {
    std::vector<int32_t> count(size_t(vocab_size) + 1, 0);
    for (int t = 0; t < T; ++t) {
      if (host_tokens[t] >= vocab_size)
        throw std::invalid_argument("embedding: token id " + std::to_string(host_tokens[t]) + " at position " +
                                    std::to_string(t) + " is >= the vocabulary size " + std::to_string(vocab_size));
      ++count[host_tokens[t] + 1];
    }
    std::partial_sum(count.begin(), count.end(), count.begin());  // count[v]: first slot of token v
    std::vector<int32_t> positions(T), segment_begin, segment_row, segment_partial, split_row, split_first;
    for (int t = 0; t < T; ++t) positions[count[host_tokens[t]]++] = t;  // stable: increasing t per token
    int scratch_rows_used = 0;
    for (int v = 0, slot = 0; v < vocab_size; ++v) {
      if (count[v] == slot) continue;
      const bool split = count[v] - slot > kEmbeddingSegment;
      if (split) {
        split_row.push_back(v);
        split_first.push_back(scratch_rows_used);
      }
      for (int first = slot; first < count[v]; first += kEmbeddingSegment) {
        segment_begin.push_back(first);
        segment_row.push_back(v);
        segment_partial.push_back(split ? scratch_rows_used++ : -1);
      }
      slot = count[v];
    }
    split_first.push_back(scratch_rows_used);
    segment_begin.push_back(T);
    segments_ = int(segment_row.size());
    splits_ = int(split_row.size());
    positions_ = uploads.upload(positions, stream);
    segment_begin_ = uploads.upload(segment_begin, stream);
    segment_row_ = uploads.upload(segment_row, stream);
    segment_partial_ = uploads.upload(segment_partial, stream);
    split_row_ = uploads.upload(split_row, stream);
    split_first_ = uploads.upload(split_first, stream);
  }
  // At most what the constructor stages for T tokens, for StagedUploads::reset.
  static size_t upload_bytes(int T) { return 6 * StagedUploads::bytes_for(size_t(T) + 1, sizeof(int32_t)); }
  // The scratch rows split tokens need at most: a token of k > S positions has ceil(k / S) <= 2k / S
  // segments (S = kEmbeddingSegment), and the k add up to at most T.
  static size_t scratch_rows(int T) { return size_t(2) * T / kEmbeddingSegment + 1; }

  int segments() const { return segments_; }
  int split_tokens() const { return splits_; }
  const int32_t* positions() const { return positions_; }            // [T]
  const int32_t* segment_begin() const { return segment_begin_; }    // [segments + 1]
  const int32_t* segment_row() const { return segment_row_; }        // [segments]
  const int32_t* segment_partial() const { return segment_partial_; }  // [segments]
  const int32_t* split_row() const { return split_row_; }            // [split tokens]
  const int32_t* split_first() const { return split_first_; }        // [split tokens + 1]

 private:
  int segments_ = 0, splits_ = 0;
  const int32_t *positions_ = nullptr, *segment_begin_ = nullptr, *segment_row_ = nullptr,
                *segment_partial_ = nullptr, *split_row_ = nullptr, *split_first_ = nullptr;
};

constexpr int kEmbeddingWarps = 8;  // segments per 256-thread block

// Warp w of block b sums segment s = 8 b + w over its positions, in position order: lane l holds
// the 16-byte column vectors l, l + 32, ... of the row (no shared memory, no barrier: most segments
// are a handful of rows, and a block per segment spent its time starting blocks). A token's only
// segment adds scale times its sum to the token's gradient row; a segment of a split token writes
// its sum to its scratch row. No float atomics: the result does not depend on scheduling.
__global__ void embedding_segment_kernel(const int32_t* positions, const int32_t* segment_begin,
                                         const int32_t* segment_row, const int32_t* segment_partial, const bf16* dout,
                                         float* grad, float* scratch, const float* scale, int d, int segments) {
  await_previous_kernel();
  const int s = blockIdx.x * kEmbeddingWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (s >= segments) return;
  const int first = segment_begin[s], last = segment_begin[s + 1], to_scratch = segment_partial[s];
  const float factor = scale ? *scale : 1.0f;
  float* row = to_scratch >= 0 ? scratch + size_t(to_scratch) * d : grad + size_t(segment_row[s]) * d;
  for (int c = lane * 8; c < d; c += 32 * 8) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll 4
    for (int k = first; k < last; ++k) {
      float v[8];
      load8(dout + size_t(positions[k]) * d + c, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += v[i];
    }
    if (to_scratch < 0) {  // the token's gradient row: += scale times the sum
      float prior[8];
      load8(row + c, prior);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = prior[i] + factor * acc[i];
    }
    reinterpret_cast<float4*>(row + c)[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    reinterpret_cast<float4*>(row + c)[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
}

// Block j adds scale times the sum of split token j's segment sums, in segment order, to its row.
__global__ void embedding_split_kernel(const int32_t* split_row, const int32_t* split_first, const float* scratch,
                                       float* grad, const float* scale, int d) {
  await_previous_kernel();
  const int j = blockIdx.x, first = split_first[j], last = split_first[j + 1];
  const float factor = scale ? *scale : 1.0f;
  float* row = grad + size_t(split_row[j]) * d;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    float sum = 0;
    for (int r = first; r < last; ++r) sum += scratch[size_t(r) * d + c];
    row[c] += factor * sum;
  }
}

// dout [T, d] of one micro-sequence into the fp32 gradient table [V, d]; scale: a device scalar
// (the value embedding's lambda) or null for 1; scratch: EmbeddingBackwardPlan::scratch_rows(T) x d
// floats.
inline void embedding_backward(const EmbeddingBackwardPlan& plan, const bf16* dout, float* grad, const float* scale,
                               int d, float* scratch, cudaStream_t stream) {
  check_embedding_width(d);
  if (plan.segments() == 0) return;
  const int blocks = (plan.segments() + kEmbeddingWarps - 1) / kEmbeddingWarps;
  CUDA_CHECK(launch_kernel(embedding_segment_kernel, blocks, 32 * kEmbeddingWarps, 0, stream, plan.positions(),
                           plan.segment_begin(), plan.segment_row(), plan.segment_partial(), dout, grad, scratch, scale,
                           d, plan.segments()));
  if (plan.split_tokens() == 0) return;
  CUDA_CHECK(launch_kernel(embedding_split_kernel, plan.split_tokens(), 256, 0, stream, plan.split_row(),
                           plan.split_first(), scratch, grad, scale, d));
}
