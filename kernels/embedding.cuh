// Token embedding and the value embeddings (SPEC 1.2): a row gather forward; a deterministic
// backward that sums each token's gradient rows in position order, one block per distinct token,
// so no float atomics and bitwise-equal gradients run to run. The order comes from the host, which
// holds every micro-sequence's tokens anyway (the attention masks are built from them too).
#pragma once
#include "kernels/cuda_check.cuh"
#include "kernels/device_utils.cuh"

#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

// out[T, d] = table[tokens[t], :], d a multiple of 8
__global__ void embedding_forward_kernel(const uint16_t* tokens, const bf16* table, bf16* out, int T, int d) {
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
  embedding_forward_kernel<<<elementwise_grid(size_t(T) * (d / 8)), 256, 0, stream>>>(tokens, table, out, T, d);
  CUDA_CHECK_LAUNCH();
}

// The positions of a micro-sequence grouped by token: positions[begin[u] .. begin[u + 1]) are
// where token tokens[u] occurs, in increasing order. Built on the host, uploaded once (into the
// StagedUploads, valid until its next reset), shared by the four tables' backward passes.
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
    std::vector<int32_t> positions(T), tokens, begin;
    for (int t = 0; t < T; ++t) positions[count[host_tokens[t]]++] = t;  // stable: increasing t per token
    for (int v = 0, slot = 0; v < vocab_size; ++v)
      if (count[v] > slot) {
        tokens.push_back(v);
        begin.push_back(slot);
        slot = count[v];
      }
    begin.push_back(T);
    distinct_ = int(tokens.size());
    positions_ = uploads.upload(positions, stream);
    tokens_ = uploads.upload(tokens, stream);
    begin_ = uploads.upload(begin, stream);
  }
  // At most what the constructor stages for T tokens, for StagedUploads::reset.
  static size_t upload_bytes(int T) {
    return 3 * StagedUploads::bytes_for(size_t(T) + 1, sizeof(int32_t));
  }

  int distinct_tokens() const { return distinct_; }
  const int32_t* positions() const { return positions_; }  // [T]
  const int32_t* tokens() const { return tokens_; }        // [distinct]
  const int32_t* begin() const { return begin_; }          // [distinct + 1]

 private:
  int distinct_ = 0;
  const int32_t *positions_ = nullptr, *tokens_ = nullptr, *begin_ = nullptr;
};

constexpr int kEmbeddingRowGroups = 4;  // rows of one token summed in parallel, combined in fixed order

// grad[tokens[u], :] += scale * sum over its positions p of dout[p, :]. Block u, threadIdx.y picks
// every kEmbeddingRowGroups-th position, threadIdx.x a 16-byte column vector; the partial sums of
// the row groups are added in threadIdx.y order, so the result does not depend on scheduling.
__global__ void embedding_backward_kernel(const int32_t* positions, const int32_t* tokens, const int32_t* begin,
                                          const bf16* dout, float* grad, const float* scale, int d) {
  extern __shared__ float partial[];  // [kEmbeddingRowGroups, d]
  const int u = blockIdx.x, first = begin[u], last = begin[u + 1];
  for (int c = threadIdx.x * 8; c < d; c += blockDim.x * 8) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = first + threadIdx.y; k < last; k += kEmbeddingRowGroups) {
      float v[8];
      load8(dout + size_t(positions[k]) * d + c, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += v[i];
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) partial[threadIdx.y * d + c + i] = acc[i];
  }
  __syncthreads();
  const float s = scale ? *scale : 1.0f;
  float* row = grad + size_t(tokens[u]) * d;
  for (int c = threadIdx.y * blockDim.x + threadIdx.x; c < d; c += blockDim.x * blockDim.y) {
    float sum = 0;
    for (int g = 0; g < kEmbeddingRowGroups; ++g) sum += partial[g * d + c];
    row[c] += s * sum;
  }
}

// dout [T, d] of one micro-sequence into the fp32 gradient table [V, d]; scale: a device scalar
// (the value embedding's lambda) or null for 1.
inline void embedding_backward(const EmbeddingBackwardPlan& plan, const bf16* dout, float* grad, const float* scale,
                               int d, cudaStream_t stream) {
  check_embedding_width(d);
  if (plan.distinct_tokens() == 0) return;
  dim3 block(std::min(((d / 8 + 31) / 32) * 32, 256), kEmbeddingRowGroups);
  size_t shared = size_t(kEmbeddingRowGroups) * d * sizeof(float);
  if (shared > 48 * 1024)  // the default dynamic shared memory limit, not raised for this kernel
    throw std::invalid_argument("embedding backward: width " + std::to_string(d) + " is above 3072");
  embedding_backward_kernel<<<plan.distinct_tokens(), block, shared, stream>>>(plan.positions(), plan.tokens(),
                                                                              plan.begin(), dout, grad, scale, d);
  CUDA_CHECK_LAUNCH();
}
