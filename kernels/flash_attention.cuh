// Tensor-core attention (FlashAttention-2 style) for the masks of attention.cuh: same interface
// and results as attention_forward / attention_backward there, on 128 x 128 bf16 tiles with
// Hopper's wgmma: each of a CTA's two warpgroups owns 64 rows (queries, or keys in the dk/dv
// kernel), its products read their tiles straight from shared memory and take P or dS from
// registers. One CTA per (128-token block, head); warp w holds rows 16 w .. 16 w + 15. A query
// block walks its kv-block list, a kv block its query-block list (attention.cuh builds both), so
// cost follows the window. Only the diagonal block and blocks that straddle a document boundary
// are masked element by element. The backward is deterministic: dq per query block, dk and dv per
// kv block, no atomics.
//
// Tiles live in shared memory in wgmma's 128-byte swizzle layout: two column halves of
// [128 rows][8 chunks of 8 bf16], chunk c of row r stored at c ^ (r & 7), atoms of 8 rows
// 1024-byte aligned. The tiles a CTA walks through are double-buffered: the next block's copies
// (cp.async) fly while the current block is computed, since the 188-250 registers per thread leave
// room for one CTA per SM and no other CTA would hide the loads. The forward also overlaps each
// block's softmax with the previous block's P V product (FlashAttention-3's intra-warpgroup
// pipelining).
#pragma once
#include "kernels/attention.cuh"
#include "kernels/ptx.cuh"

#include <initializer_list>

namespace flash {

constexpr int kTile = 128;                      // tokens per tile: the mask's block
constexpr int kWarps = kTile / 16;              // 16 rows per warp
constexpr int kThreads = kWarps * 32;
constexpr size_t kTileElements = size_t(kTile) * kAttentionHeadDim;
constexpr int kStages = 2;  // buffers of the walked tiles
constexpr uint32_t kSwizzleAtomBytes = 1024;  // 8 rows of 128 bytes
constexpr uint32_t kHalfTileBytes = kTile * 64 * sizeof(bf16);  // one column half: [128 rows][64]
// Shared tiles (and room to align them to an atom): forward Q + stages x (K, V); backward two
// fixed tiles + stages x two walked ones.
constexpr size_t kForwardSharedBytes = (1 + 2 * kStages) * kTileElements * sizeof(bf16) + kSwizzleAtomBytes;
constexpr size_t kBackwardSharedBytes = (2 + 2 * kStages) * kTileElements * sizeof(bf16) + kSwizzleAtomBytes;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kScaleLog2 = kAttentionScale * kLog2e;  // scores in base 2: exp2 on the fast path

__device__ inline int swizzled(int row, int col) {  // element (row, col) of a tile
  return col / 64 * (kTile * 64) + row * 64 + ((((col % 64) >> 3) ^ (row & 7)) << 3) + (col & 7);
}

// The descriptor of a matrix in shared memory laid out in 128-byte swizzle atoms (8 rows of 128
// bytes, 16-byte chunk c of row r at c ^ (r % 8); atoms 1024-byte aligned). `leading` and `stride`
// are PTX's leading- and stride-dimension byte offsets: for a K-major operand `stride` is the
// distance between 8-row groups (leading unused); for an MN-major one `leading` separates groups of
// 64 MN elements and `stride` groups of 8 k rows.
__device__ inline uint64_t swizzled_128b_descriptor(const void* start, uint32_t leading, uint32_t stride) {
  return uint64_t((ptx::shared_address(start) & 0x3FFFF) >> 4) | uint64_t(leading >> 4) << 16 |
         uint64_t(stride >> 4) << 32 | uint64_t(1) << 62;
}

// wgmma's swizzle acts on shared-window address bits: tiles must start on an atom boundary, which
// the dynamic shared memory itself need not (static shared variables come first).
__device__ inline bf16* align_to_swizzle_atom(bf16* p) {
  const uint32_t misalignment = ptx::shared_address(p) % kSwizzleAtomBytes;
  return p + (misalignment ? (kSwizzleAtomBytes - misalignment) / sizeof(bf16) : 0);
}

// rows [0, 128) of a [T, stride] matrix from `src` into a swizzled tile, 16 bytes per cp.async.
__device__ inline void load_tile_async(bf16* tile, const bf16* src, int64_t stride) {
  for (int i = threadIdx.x; i < kTile * 16; i += kThreads) {
    int row = i / 16, chunk = i % 16;
    ptx::cp_async_16(tile + swizzled(row, chunk * 8), src + row * stride + chunk * 8);
  }
}

// A tile's 128 four-byte values (document ids, softmax statistics) from `from` into shared memory
// by the 32 threads from first_thread, 16 bytes each as cp.async: no thread waits for them before
// the tiles' wait. Both addresses 16-byte aligned.
template <typename T>
__device__ inline void load_values_async(T* to, const T* from, int first_thread) {
  static_assert(sizeof(T) == 4, "four-byte values");
  const int i = int(threadIdx.x) - first_thread;
  if (i >= 0 && i < kTile / 4) ptx::cp_async_16(to + 4 * i, from + 4 * i);
}

// Starts the copies of the K tile and the document ids of the kv block at token k0 of head h.
__device__ inline void load_k_tile(bf16* k_tile, int32_t* kv_docs, const bf16* k, const AttentionTensors& a,
                                   const int32_t* docs, int h, int k0) {
  load_tile_async(k_tile, k + k0 * a.k_stride + h * kAttentionHeadDim, a.k_stride);
  load_values_async(kv_docs, docs + k0, 0);
}

// Starts the copies of the V tile of the kv block at token k0 of head h.
__device__ inline void load_v_tile(bf16* v_tile, const bf16* v, const AttentionTensors& a, int h, int k0) {
  load_tile_async(v_tile, v + k0 * a.v_stride + h * kAttentionHeadDim, a.v_stride);
}

// Starts the copies of the K and V tiles (V right after K) and the document ids of the kv block
// at token k0 of head h, as one group.
__device__ inline void load_kv_tiles(bf16* k_tile, int32_t* kv_docs, const bf16* k, const bf16* v,
                                     const AttentionTensors& a, const int32_t* docs, int h, int k0) {
  load_k_tile(k_tile, kv_docs, k, a, docs, h, k0);
  load_v_tile(k_tile + kTileElements, v, a, h, k0);
  ptx::cp_async_commit();
}

// Every committed copy of every thread but its newest `pending_groups_left` groups has landed
// (visible to wgmma too), and every warp is done with what it read before.
template <int pending_groups_left = 0>
__device__ inline void wait_tiles() {
  ptx::cp_async_wait_group<pending_groups_left>();
  ptx::fence_proxy_async_shared();
  __syncthreads();
}

__device__ inline uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Pins an accumulator's (or A fragment's) register accesses to their side of a wgmma fence or
// wait: writes before the issue stay before it, reads after the wait stay after it.
template <typename T, int N>
__device__ inline void fence_registers(T (&r)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) ptx::fence_operand(r[n][e]);
}

// Waits for all of the warpgroup's wgmma groups; the accumulators named may be read from here on,
// and the tiles they read refilled (after a barrier).
template <typename... Accumulators>
__device__ inline void wgmma_wait_all(Accumulators&... acc) {
  ptx::wgmma_wait<0>();
  (fence_registers(acc), ...);
}

// Issues, as one group, s[64 x N] = A[a_row .. +64, 0..128) B[b_row .. +N, 0..128)^T for the
// warpgroup: both tiles in shared memory, K-major (the head dimension is the product's k), 16 of k
// per wgmma. The accumulator layout: see ptx::wgmma_m64n128k16_ss.
template <int N>
__device__ inline void wgmma_a_bt(float (&s)[N / 8][4], const bf16* a, int a_row, const bf16* b, int b_row) {
  fence_registers(s);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kAttentionHeadDim / 16; ++kk) {
    const uint64_t a_desc = swizzled_128b_descriptor(a + swizzled(a_row, kk * 16), 16, kSwizzleAtomBytes);
    const uint64_t b_desc = swizzled_128b_descriptor(b + swizzled(b_row, kk * 16), 16, kSwizzleAtomBytes);
    if constexpr (N == 128)
      ptx::wgmma_m64n128k16_ss</*trans_b=*/0>(s, a_desc, b_desc, /*accumulate=*/kk > 0);
    else
      ptx::wgmma_m64n64k16_ss</*trans_b=*/0>(s, a_desc, b_desc, /*accumulate=*/kk > 0);
  }
  ptx::wgmma_commit();
}

// Issues, as one group, acc[64 x 128] += P[64 x 16K] B[b_row .. +16K, 0..128) for the warpgroup:
// P from an accumulator (rounded to bf16 as A fragments, its n-tiles become k), B a shared tile
// read N-major (its rows are k).
template <int K>
__device__ inline void wgmma_p_b(float (&acc)[kAttentionHeadDim / 8][4], const float (&p)[2 * K][4], const bf16* b,
                                 int b_row) {
  uint32_t af[K][4];  // all packed before the first wgmma: none waits on the conversions
#pragma unroll
  for (int kk = 0; kk < K; ++kk) {
    af[kk][0] = pack_bf16(p[2 * kk][0], p[2 * kk][1]);
    af[kk][1] = pack_bf16(p[2 * kk][2], p[2 * kk][3]);
    af[kk][2] = pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]);
    af[kk][3] = pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3]);
  }
  fence_registers(acc);
  fence_registers(af);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < K; ++kk) {
    const uint64_t b_desc =
        swizzled_128b_descriptor(b + swizzled(b_row + kk * 16, 0), kHalfTileBytes, kSwizzleAtomBytes);
    ptx::wgmma_m64n128k16_rs</*trans_b=*/1>(acc, af[kk], b_desc, /*accumulate=*/true);
  }
  ptx::wgmma_commit();
}

template <int N>
__device__ inline void zero(float (&acc)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
}

// A (query block, kv block) pair needs element masks unless it is strictly causal and both blocks
// lie in one document (document ids only grow along the sequence).
__device__ inline bool needs_mask(int qb, int kb, const int32_t* q_docs, const int32_t* kv_docs) {
  return kb == qb || kv_docs[0] != q_docs[kTile - 1];
}

// The element of accumulator n-tile n, register e: its row and column inside the 16 x 8N tile.
__device__ inline int fragment_row(int e) { return threadIdx.x % 32 / 4 + (e >= 2 ? 8 : 0); }
__device__ inline int fragment_col(int n, int e) { return n * 8 + threadIdx.x % 4 * 2 + (e & 1); }

__device__ inline float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ inline float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Writes a warp's 16 x 128 accumulator (times `scale`) as bf16 rows of [T, H, 128].
__device__ inline void store_rows(bf16* out, const float (&acc)[kAttentionHeadDim / 8][4], int first_token, int h, int H,
                                  float scale_row0, float scale_row8) {
#pragma unroll
  for (int n = 0; n < kAttentionHeadDim / 8; ++n)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      int row = fragment_row(2 * half), col = fragment_col(n, 0);
      float s = half ? scale_row8 : scale_row0;
      *reinterpret_cast<uint32_t*>(out + (size_t(first_token + row) * H + h) * kAttentionHeadDim + col) =
          pack_bf16(acc[n][2 * half] * s, acc[n][2 * half + 1] * s);
    }
}

// Walks the kv blocks listed for query block qb (the dq kernel): block j's K and V tiles and
// document ids land in stage j % kStages of `stages` ([kStages][K, V] tiles) while block j - 1 is
// computed; body(kb, k_tile, v_tile, kv_docs) computes block kb. The copies the caller has issued
// before (its fixed tiles) join block 0's group.
template <typename Body>
__device__ inline void walk_kv_blocks(bf16* stages, int32_t (&stage_docs)[kStages][kTile], const bf16* k,
                                      const bf16* v, const AttentionTensors& a, const DeviceAttentionMask& m, int qb,
                                      int h, Body body) {
  const int count = m.kv_count[qb];
  auto kv_block = [&](int j) { return m.kv_index[qb * m.max_kv + j]; };
  auto k_tile_of = [&](int j) { return stages + 2 * (j % kStages) * kTileElements; };
  auto load = [&](int j) { load_kv_tiles(k_tile_of(j), stage_docs[j % kStages], k, v, a, m.docs, h, kv_block(j) * kTile); };
  if (count > 0) load(0);
  for (int j = 0; j < count; ++j) {
    wait_tiles();  // block j is in; every warp is done with block j - 1, whose stage block j + 1 takes
    if (j + 1 < count) load(j + 1);
    body(kv_block(j), k_tile_of(j), k_tile_of(j) + kTileElements, stage_docs[j % kStages]);
  }
}

// One kv block's step of the online softmax on a warp's 16 rows: the scores s of kv block k0
// become P = exp2(scale s - running max) (0 where masked), row_max and row_sum move on, and
// `correction` is what the output accumulated so far must be scaled by.
__device__ inline void online_softmax(float (&s)[kTile / 8][4], float (&row_max)[2], float (&row_sum)[2],
                                      float (&correction)[2], bool masked, int q0, int k0, const int32_t* q_docs,
                                      const int32_t* kv_docs) {
  constexpr int N = kTile / 8;
  const int warp = threadIdx.x / 32;
  float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int row = warp * 16 + fragment_row(e), col = fragment_col(n, e);
      bool allowed = !masked || (k0 + col <= q0 + row && kv_docs[col] == q_docs[row]);
      s[n][e] = allowed ? s[n][e] * kScaleLog2 : -INFINITY;
      tile_max[e / 2] = fmaxf(tile_max[e / 2], s[n][e]);
    }
  float base[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float new_max = fmaxf(row_max[r], quad_max(tile_max[r]));
    base[r] = new_max == -INFINITY ? 0.0f : new_max;  // a row with nothing allowed yet stays at zero
    correction[r] = exp2f(row_max[r] - base[r]);
    row_max[r] = new_max;
    row_sum[r] *= correction[r];
  }
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[n][e] = exp2f(s[n][e] - base[e / 2]);
      row_sum[e / 2] += s[n][e];
    }
}

// Forward: per (query block, head), online softmax over the listed kv blocks. Each warpgroup
// overlaps the softmax of block j + 1 with block j's product P V on the tensor cores: it issues
// S(j + 1) = Q K(j + 1)^T and then O += P(j) V(j), waits for the scores only, and waits for O just
// before rescaling it. So K runs one block ahead of V: K and the document ids of block j + 2 and V
// of block j + 1 are copied while block j's products run, each into the buffer (of two) whose
// previous reader has been waited for before the barrier that starts block j.
__global__ void __launch_bounds__(kThreads) forward_kernel(const bf16* q, const bf16* k, const bf16* v, bf16* y,
                                                           float* lse, AttentionTensors a, DeviceAttentionMask m) {
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* tiles = align_to_swizzle_atom(shared_tiles);  // Q, K of even and odd blocks, V of even and odd blocks
  bf16* q_tile = tiles;
  __shared__ __align__(16) int32_t q_docs[kTile], k_docs[2][kTile];
  const int qb = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / 32, q0 = qb * kTile, count = m.kv_count[qb];
  const int warpgroup_row = warp / 4 * 64;
  auto k0_of = [&](int j) { return m.kv_index[qb * m.max_kv + j] * kTile; };  // the j-th listed kv block
  auto k_tile = [&](int j) { return tiles + (1 + j % 2) * kTileElements; };
  auto v_tile = [&](int j) { return tiles + (3 + j % 2) * kTileElements; };
  auto load_k = [&](int j) { load_k_tile(k_tile(j), k_docs[j % 2], k, a, m.docs, h, k0_of(j)); };
  auto load_v = [&](int j) { load_v_tile(v_tile(j), v, a, h, k0_of(j)); };

  constexpr int N = kTile / 8;
  static_assert(N == kAttentionHeadDim / 8, "scores and output tiles share their fragment loops");
  float o[kAttentionHeadDim / 8][4], row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0, 0}, correction[2];
  zero(o);
  auto softmax_of_block = [&](float (&s)[N][4], int j) {
    const int k0 = k0_of(j);
    const bool masked = needs_mask(qb, k0 / kTile, q_docs, k_docs[j % 2]);
    online_softmax(s, row_max, row_sum, correction, masked, q0, k0, q_docs, k_docs[j % 2]);
  };
  load_tile_async(q_tile, q + q0 * a.q_stride + h * kAttentionHeadDim, a.q_stride);
  load_values_async(q_docs, m.docs + q0, 32);
  if (count > 0) {
    load_k(0);
    ptx::cp_async_commit();  // the first scores wait for this group only
    load_v(0);
    if (count > 1) load_k(1);
    ptx::cp_async_commit();
    wait_tiles<1>();
    float s[N][4], s_next[N][4];  // P of block j, scores of block j + 1
    wgmma_a_bt<kTile>(s, q_tile, warpgroup_row, k_tile(0), 0);
    wgmma_wait_all(s);
    softmax_of_block(s, 0);
    // The last block has no next scores: peeled, so that every product in the loop is issued
    // unconditionally (a conditional one makes ptxas serialise the wgmma).
    for (int j = 0; j + 1 < count; ++j) {
      wait_tiles();  // V(j), K(j + 1) are in; every warp is done with S(j) and P(j - 1) V(j - 1)
      if (j + 2 < count) load_k(j + 2);
      load_v(j + 1);
      ptx::cp_async_commit();
      wgmma_a_bt<kTile>(s_next, q_tile, warpgroup_row, k_tile(j + 1), 0);
      wgmma_p_b<kTile / 16>(o, s, v_tile(j), 0);
      ptx::wgmma_wait<1>();  // the scores; P(j) V(j) runs on beside the softmax
      fence_registers(s_next);
      softmax_of_block(s_next, j + 1);
      wgmma_wait_all(o);
#pragma unroll
      for (int n = 0; n < N; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          o[n][e] *= correction[e / 2];
          s[n][e] = s_next[n][e];
        }
    }
    wait_tiles();
    wgmma_p_b<kTile / 16>(o, s, v_tile(count - 1), 0);
    wgmma_wait_all(o);
  }
  float total[2] = {quad_sum(row_sum[0]), quad_sum(row_sum[1])};
  store_rows(y, o, q0 + warp * 16, h, a.H, 1.0f / total[0], 1.0f / total[1]);
  if (threadIdx.x % 4 == 0)
    for (int r = 0; r < 2; ++r)
      lse[size_t(h) * a.T + q0 + warp * 16 + fragment_row(2 * r)] = row_max[r] / kLog2e + logf(total[r]);
}

// P and dS of a 16 x 8N score tile: p = exp(scores - lse) where allowed (0 elsewhere),
// ds = p (dp - delta). `query_of(row, col)` maps a fragment position to its query index within the
// query tile and `key_of` to its key index within the kv tile (the dkv kernel's tiles are transposed).
template <int N, typename QueryOf, typename KeyOf>
__device__ inline void softmax_backward(float (&s)[N][4], float (&dp)[N][4], const float* lse, const float* delta,
                                        bool masked, int q0, int k0, const int32_t* q_docs, const int32_t* kv_docs,
                                        QueryOf query_of, KeyOf key_of) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int tq = query_of(n, e), tk = key_of(n, e);
      bool allowed = !masked || (k0 + tk <= q0 + tq && kv_docs[tk] == q_docs[tq]);
      float p = allowed ? exp2f(s[n][e] * kScaleLog2 - lse[tq] * kLog2e) : 0.0f;
      s[n][e] = p;
      dp[n][e] = p * (dp[n][e] - delta[tq]);
    }
}

// Per (query block, head): dq = scale sum_kv dS K over the listed kv blocks, 64 keys at a time.
__global__ void __launch_bounds__(kThreads) backward_dq_kernel(const bf16* q, const bf16* k, const bf16* v,
                                                               const bf16* dy, const float* lse, const float* delta,
                                                               bf16* dq, AttentionTensors a, DeviceAttentionMask m) {
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* tiles = align_to_swizzle_atom(shared_tiles);  // Q, dY, then per stage K and V
  bf16 *q_tile = tiles, *dy_tile = tiles + kTileElements;
  __shared__ __align__(16) int32_t q_docs[kTile], stage_docs[kStages][kTile];
  __shared__ __align__(16) float q_lse[kTile], q_delta[kTile];
  const int qb = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / 32, q0 = qb * kTile;
  const int warpgroup_row = warp / 4 * 64;
  const int64_t dy_stride = int64_t(a.H) * kAttentionHeadDim;
  load_tile_async(q_tile, q + q0 * a.q_stride + h * kAttentionHeadDim, a.q_stride);
  load_tile_async(dy_tile, dy + q0 * dy_stride + h * kAttentionHeadDim, dy_stride);
  load_values_async(q_docs, m.docs + q0, 32);
  load_values_async(q_lse, lse + size_t(h) * a.T + q0, 64);
  load_values_async(q_delta, delta + size_t(h) * a.T + q0, 96);
  constexpr int kKeys = 64, N = kKeys / 8;
  float dq_acc[kAttentionHeadDim / 8][4];
  zero(dq_acc);
  auto query_of = [&](int, int e) { return warp * 16 + fragment_row(e); };
  walk_kv_blocks(tiles + 2 * kTileElements, stage_docs, k, v, a, m, qb, h,
                 [&](int kb, const bf16* k_tile, const bf16* v_tile, const int32_t* kv_docs) {
    const int k0 = kb * kTile;
    const bool masked = needs_mask(qb, kb, q_docs, kv_docs);
    for (int half = 0; half < kTile / kKeys; ++half) {
      float s[N][4], dp[N][4];
      wgmma_a_bt<kKeys>(s, q_tile, warpgroup_row, k_tile, half * kKeys);
      wgmma_a_bt<kKeys>(dp, dy_tile, warpgroup_row, v_tile, half * kKeys);
      wgmma_wait_all(s, dp);  // (and the previous half's dq product)
      softmax_backward(s, dp, q_lse, q_delta, masked, q0, k0, q_docs, kv_docs, query_of,
                       [&](int n, int e) { return half * kKeys + fragment_col(n, e); });
      wgmma_p_b<kKeys / 16>(dq_acc, dp, k_tile, half * kKeys);
    }
    wgmma_wait_all(dq_acc);  // before the barrier after which block j + 2 refills this stage
  });
  store_rows(dq, dq_acc, q0 + warp * 16, h, a.H, kAttentionScale, kAttentionScale);
}

// Per (kv block, head): dv = sum_q P^T dy and dk = scale sum_q dS^T Q over the query blocks that
// list this kv block, 64 queries at a time; the warps own 16 keys each, so scores are transposed.
__global__ void __launch_bounds__(kThreads) backward_dkv_kernel(const bf16* q, const bf16* k, const bf16* v,
                                                                const bf16* dy, const float* lse, const float* delta,
                                                                bf16* dk, bf16* dv, AttentionTensors a,
                                                                DeviceAttentionMask m) {
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* tiles = align_to_swizzle_atom(shared_tiles);  // K, V, then per stage Q and dY
  bf16 *k_tile = tiles, *v_tile = tiles + kTileElements;
  __shared__ __align__(16) int32_t kv_docs[kTile], stage_docs[kStages][kTile];
  __shared__ __align__(16) float stage_lse[kStages][kTile], stage_delta[kStages][kTile];
  const int kb = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / 32, k0 = kb * kTile, count = m.q_count[kb];
  const int warpgroup_row = warp / 4 * 64;
  const int64_t dy_stride = int64_t(a.H) * kAttentionHeadDim;
  auto q_block = [&](int j) { return m.q_index[kb * m.max_q + j]; };
  auto q_tile_of = [&](int j) { return tiles + (2 + 2 * (j % kStages)) * kTileElements; };
  auto load_q = [&](int j) {  // the j-th listed query block (Q, dY, ids, statistics) into stage j % kStages
    const int q0 = q_block(j) * kTile, stage = j % kStages;
    load_tile_async(q_tile_of(j), q + q0 * a.q_stride + h * kAttentionHeadDim, a.q_stride);
    load_tile_async(q_tile_of(j) + kTileElements, dy + q0 * dy_stride + h * kAttentionHeadDim, dy_stride);
    load_values_async(stage_docs[stage], m.docs + q0, 0);
    load_values_async(stage_lse[stage], lse + size_t(h) * a.T + q0, 32);
    load_values_async(stage_delta[stage], delta + size_t(h) * a.T + q0, 64);
    ptx::cp_async_commit();
  };
  load_tile_async(k_tile, k + k0 * a.k_stride + h * kAttentionHeadDim, a.k_stride);
  load_tile_async(v_tile, v + k0 * a.v_stride + h * kAttentionHeadDim, a.v_stride);
  load_values_async(kv_docs, m.docs + k0, 96);
  if (count > 0) load_q(0);
  constexpr int kQueries = 64, N = kQueries / 8;
  float dk_acc[kAttentionHeadDim / 8][4], dv_acc[kAttentionHeadDim / 8][4];
  zero(dk_acc);
  zero(dv_acc);
  auto key_of = [&](int, int e) { return warp * 16 + fragment_row(e); };
  for (int j = 0; j < count; ++j) {
    wait_tiles();  // block j is in; every warp is done with block j - 1, whose stage block j + 1 takes
    if (j + 1 < count) load_q(j + 1);
    const int qb = q_block(j), q0 = qb * kTile, stage = j % kStages;
    const bf16 *q_tile = q_tile_of(j), *dy_tile = q_tile + kTileElements;
    const int32_t* q_docs = stage_docs[stage];
    const float *q_lse = stage_lse[stage], *q_delta = stage_delta[stage];
    const bool masked = needs_mask(qb, kb, q_docs, kv_docs);
    for (int half = 0; half < kTile / kQueries; ++half) {
      float st[N][4], dpt[N][4];  // [64 keys x 64 queries] per warpgroup
      wgmma_a_bt<kQueries>(st, k_tile, warpgroup_row, q_tile, half * kQueries);
      wgmma_a_bt<kQueries>(dpt, v_tile, warpgroup_row, dy_tile, half * kQueries);
      wgmma_wait_all(st, dpt);
      softmax_backward(st, dpt, q_lse, q_delta, masked, q0, k0, q_docs, kv_docs,
                       [&](int n, int e) { return half * kQueries + fragment_col(n, e); }, key_of);
      wgmma_p_b<kQueries / 16>(dv_acc, st, dy_tile, half * kQueries);
      wgmma_p_b<kQueries / 16>(dk_acc, dpt, q_tile, half * kQueries);
      // now, not at the next half: P and dS in flight beside the next scores would spill registers
      wgmma_wait_all(dv_acc, dk_acc);
    }
  }
  store_rows(dk, dk_acc, k0 + warp * 16, h, a.H, kAttentionScale, kAttentionScale);
  store_rows(dv, dv_acc, k0 + warp * 16, h, a.H, 1.0f, 1.0f);
}

template <typename Kernel>
void set_shared_memory(Kernel kernel, size_t bytes) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

}  // namespace flash

// A tensor the flash kernels access, and the alignment (bytes) its start needs: cp.async copies
// 16-byte pieces of q, k, v and dy (rows) and of lse and delta (the backward's 128 statistics at
// [h, 128 qb]); y, dq, dk and dv are written a bf16 pair (4 bytes) at a time. The rest is read or
// written an element at a time.
struct FlashAttentionOperand {
  const char* name;
  const void* start;
  unsigned alignment;
};
constexpr unsigned kFlashCopiedAlignment = 16, kFlashWrittenAlignment = 4;

// Refuses, naming the tensor, what would fault on the GPU (misaligned address) or compute garbage.
inline void check_flash_attention_shape(const AttentionTensors& a, const AttentionMask& mask,
                                        std::initializer_list<FlashAttentionOperand> operands) {
  static_assert(flash::kTile == kAttentionBlock, "a flash tile is one mask block");
  check_attention_shape(a, mask);
  if (a.q_stride % 8 || a.k_stride % 8 || a.v_stride % 8)
    throw std::invalid_argument("flash attention: row strides must be multiples of 8 elements (16-byte rows)");
  for (const FlashAttentionOperand& o : operands)
    if (reinterpret_cast<uintptr_t>(o.start) % o.alignment)
      throw std::invalid_argument(std::string("flash attention: ") + o.name + " must start " +
                                  std::to_string(o.alignment) + "-byte aligned");
}

// y: [T, H, 128], lse: [H, T]
inline void flash_attention_forward(const bf16* q, const bf16* k, const bf16* v, bf16* y, float* lse,
                                    const AttentionTensors& a, const AttentionMask& mask, cudaStream_t stream) {
  check_flash_attention_shape(a, mask,
                              {{"q", q, kFlashCopiedAlignment}, {"k", k, kFlashCopiedAlignment},
                               {"v", v, kFlashCopiedAlignment}, {"y", y, kFlashWrittenAlignment}});
  const size_t smem = flash::kForwardSharedBytes;
  flash::set_shared_memory(flash::forward_kernel, smem);
  flash::forward_kernel<<<dim3(a.T / flash::kTile, a.H), flash::kThreads, smem, stream>>>(q, k, v, y, lse, a,
                                                                                          mask.device());
  CUDA_CHECK_LAUNCH();
}

// delta: [H, T] scratch; dq, dk, dv: [T, H, 128]
inline void flash_attention_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* y, const bf16* dy,
                                     const float* lse, float* delta, bf16* dq, bf16* dk, bf16* dv,
                                     const AttentionTensors& a, const AttentionMask& mask, cudaStream_t stream) {
  check_flash_attention_shape(a, mask,
                              {{"q", q, kFlashCopiedAlignment}, {"k", k, kFlashCopiedAlignment},
                               {"v", v, kFlashCopiedAlignment}, {"dy", dy, kFlashCopiedAlignment},
                               {"lse", lse, kFlashCopiedAlignment}, {"delta", delta, kFlashCopiedAlignment},
                               {"dq", dq, kFlashWrittenAlignment}, {"dk", dk, kFlashWrittenAlignment},
                               {"dv", dv, kFlashWrittenAlignment}});
  attention_delta_kernel<<<attention_grid(a, 8), 256, 0, stream>>>(y, dy, delta, a.T, a.H);
  CUDA_CHECK_LAUNCH();
  const size_t smem = flash::kBackwardSharedBytes;
  const dim3 grid(a.T / flash::kTile, a.H);
  flash::set_shared_memory(flash::backward_dq_kernel, smem);
  flash::backward_dq_kernel<<<grid, flash::kThreads, smem, stream>>>(q, k, v, dy, lse, delta, dq, a, mask.device());
  CUDA_CHECK_LAUNCH();
  flash::set_shared_memory(flash::backward_dkv_kernel, smem);
  flash::backward_dkv_kernel<<<grid, flash::kThreads, smem, stream>>>(q, k, v, dy, lse, delta, dk, dv, a,
                                                                      mask.device());
  CUDA_CHECK_LAUNCH();
}
