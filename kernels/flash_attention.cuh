// Tensor-core attention (FlashAttention-2 style) for the masks of attention.cuh: same interface
// and results as attention_forward / attention_backward there, on 128 x 128 bf16 tiles with
// Hopper's wgmma: each of a CTA's two warpgroups owns 64 rows (queries, or keys in the dk/dv
// kernel), its products read their tiles straight from shared memory and take P or dS from
// registers. One CTA per (128-token block, head); warp w holds rows 16 w .. 16 w + 15. A query
// block walks its kv-block list, a kv block its query-block list (attention.cuh builds both), so
// cost follows the window. Only the diagonal block and blocks that straddle a document boundary
// are masked element by element. The backward is one kernel per kv block (5 products a tile: S,
// dP, dV, dK, and dQ from the same dS through shared memory), its dq contributions summed across
// CTAs in a fixed order (DqPartialSums), so it is bitwise deterministic; `--attention flash-split`
// keeps the two-kernel backward (dq per query block, dk and dv per kv block, each recomputing S
// and dP) until the fused one has passed on a GPU. `--attention flash-ws` takes the
// warp-specialised forward (forward_ws_kernel: TMA producer, consumer warpgroups in ping-pong),
// bitwise the same as forward_kernel, until it has passed and measured faster on a GPU. With
// `--qkv-backward fused` the fused backward stores, instead of dq, dk and dv, the gradient of the raw
// qkv through the QK norm, RoPE and the value mix (QkvGradient), until that has too.
//
// Tiles live in shared memory in wgmma's 128-byte swizzle layout: two column halves of
// [128 rows][8 chunks of 8 bf16], chunk c of row r stored at c ^ (r & 7), atoms of 8 rows
// 1024-byte aligned. The tiles a CTA walks through are double-buffered: the next block's copies
// (cp.async) fly while the current block is computed, since the 174-254 registers per thread (ptxas,
// nvcc 13.0) leave room for one CTA per SM and no other CTA would hide the loads. The forward also overlaps each
// block's softmax with the previous block's P V product (FlashAttention-3's intra-warpgroup
// pipelining).
#pragma once
#include "kernels/attention.cuh"
#include "kernels/ptx.cuh"
#include "kernels/residual.cuh"
#include "kernels/rope.cuh"
#include "kernels/tensor_map.cuh"
#include "kernels/wgmma_tiles.cuh"

#include <initializer_list>

namespace flash {

using namespace wgmma_tiles;

constexpr int kTile = 128;                      // tokens per tile: the mask's block
constexpr int kWarps = kTile / 16;              // 16 rows per warp
constexpr int kThreads = kWarps * 32;
constexpr size_t kTileElements = size_t(kTile) * kAttentionHeadDim;
constexpr int kStages = 2;  // buffers of the walked tiles
constexpr uint32_t kHalfTileBytes = kTile * 64 * sizeof(bf16);  // one column half: [128 rows][64]
// Shared tiles (and room to align them to an atom): forward Q + stages x (K, V); backward two
// fixed tiles + stages x two walked ones.
constexpr size_t kForwardSharedBytes = (1 + 2 * kStages) * kTileElements * sizeof(bf16) + kSwizzleAtomBytes;
constexpr size_t kBackwardSharedBytes = (2 + 2 * kStages) * kTileElements * sizeof(bf16) + kSwizzleAtomBytes;
// The fused backward also holds one 64-query half of dS, [64 queries][128 keys].
constexpr int kDsRows = 64;
constexpr size_t kFusedBackwardSharedBytes = kBackwardSharedBytes + kDsRows * kTile * sizeof(bf16);
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kScaleLog2 = kAttentionScale * kLog2e;  // scores in base 2: exp2 on the fast path

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

// Starts the copies of the K tile of the kv block at token k0 of head h.
__device__ inline void load_k_tile(bf16* k_tile, const bf16* k, const AttentionTensors& a, int h, int k0) {
  load_tile_async(k_tile, k + k0 * a.k_stride + h * kAttentionHeadDim, a.k_stride);
}

// Starts the copies of the V tile of the kv block at token k0 of head h.
__device__ inline void load_v_tile(bf16* v_tile, const bf16* v, const AttentionTensors& a, int h, int k0) {
  load_tile_async(v_tile, v + k0 * a.v_stride + h * kAttentionHeadDim, a.v_stride);
}

// Starts the copies of the K and V tiles (V right after K) of the kv block at token k0 of head h,
// as one group.
__device__ inline void load_kv_tiles(bf16* k_tile, const bf16* k, const bf16* v, const AttentionTensors& a, int h,
                                     int k0) {
  load_k_tile(k_tile, k, a, h, k0);
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

// P (an accumulator, 16K columns) rounded to bf16 as wgmma's A fragments: its n-tiles become k.
template <int K>
__device__ inline void pack_a_fragments(uint32_t (&af)[K][4], const float (&p)[2 * K][4]) {
#pragma unroll
  for (int kk = 0; kk < K; ++kk) {
    af[kk][0] = pack_bf16(p[2 * kk][0], p[2 * kk][1]);
    af[kk][1] = pack_bf16(p[2 * kk][2], p[2 * kk][3]);
    af[kk][2] = pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]);
    af[kk][3] = pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3]);
  }
}

// Issues, as one group, acc[64 x 128] += P[64 x 16K] B[b_row .. +16K, 0..128) for the warpgroup:
// P as packed A fragments (pack_a_fragments: they must stay untouched until the group is waited
// for), B a shared tile read N-major (its rows are k).
template <int K>
__device__ inline void wgmma_p_b(float (&acc)[kAttentionHeadDim / 8][4], uint32_t (&af)[K][4], const bf16* b,
                                 int b_row) {
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

// The same with P from an fp32 accumulator, packed first (all before the first wgmma: none waits
// on the conversions).
template <int K>
__device__ inline void wgmma_p_b(float (&acc)[kAttentionHeadDim / 8][4], const float (&p)[2 * K][4], const bf16* b,
                                 int b_row) {
  uint32_t af[K][4];
  pack_a_fragments(af, p);
  wgmma_p_b(acc, af, b, b_row);
}

// A (query block, kv block) pair needs element masks unless it is strictly causal and the kv block
// lies in the document of every query (last_start: the query tile's last document start; starts
// only grow).
__device__ inline bool needs_mask(int qb, int kb, int last_start) { return kb == qb || last_start > kb * kTile; }

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

// Walks the kv blocks listed for query block qb (the dq kernel): block j's K and V tiles land in
// stage j % kStages of `stages` ([kStages][K, V] tiles) while block j - 1 is computed;
// body(kb, k_tile, v_tile) computes block kb. The copies the caller has issued before (its fixed
// tiles) join block 0's group.
template <typename Body>
__device__ inline void walk_kv_blocks(bf16* stages, const bf16* k, const bf16* v, const AttentionTensors& a,
                                      const DeviceAttentionMask& m, int qb, int h, Body body) {
  const int count = m.kv_count[qb];
  auto kv_block = [&](int j) { return m.kv_index[qb * m.max_kv + j]; };
  auto k_tile_of = [&](int j) { return stages + 2 * (j % kStages) * kTileElements; };
  auto load = [&](int j) { load_kv_tiles(k_tile_of(j), k, v, a, h, kv_block(j) * kTile); };
  if (count > 0) load(0);
  for (int j = 0; j < count; ++j) {
    wait_tiles();  // block j is in; every warp is done with block j - 1, whose stage block j + 1 takes
    if (j + 1 < count) load(j + 1);
    body(kv_block(j), k_tile_of(j), k_tile_of(j) + kTileElements);
  }
}

// The mask of a row inside a kv tile: query q (token) sees the tile's columns [first, last], its
// document's keys up to itself (document ids only grow: two compares instead of two id loads).
struct RowBounds {
  int first, last;
  __device__ RowBounds(int q, int q_start, int k0) : first(q_start - k0), last(q - k0) {}
  __device__ bool allows(int col) const { return col >= first && col <= last; }
};

// The running maximum a softmax subtracts moves only when some row of the warp has found one more
// than kStaleMaxLog2 above it (base 2; FlashAttention-4's lazy rescaling): until then P = 2^(scale s -
// max) stays at most 2^8, harmless in fp32 sums and bf16 products, and the output accumulated so far
// keeps its scale, so its rescaling (a multiply an accumulator, the tensor cores waiting) is skipped.
// The row's sum and lse use the same maximum: the same mathematics, other roundings.
constexpr float kStaleMaxLog2 = 8.0f;

// One kv block's step of the online softmax on a warp's 16 rows: the scores s of kv block k0
// become P = exp2(scale s - running max) (0 where masked) and row_sum moves on. Returns whether
// row_max (scaled, base 2) moved, for every row of the warp alike; then `correction` is what the
// output accumulated so far must be scaled by (rescale). row0: the thread's first row in the
// query tile (the other is row0 + 8), row_start: their document starts. The maximum is taken on
// the raw scores (the scale is positive), so each P is one FFMA and one ex2.
__device__ inline bool online_softmax(float (&s)[kTile / 8][4], float (&row_max)[2], float (&row_sum)[2],
                                      float (&correction)[2], bool masked, int q0, int k0, int row0,
                                      const int32_t (&row_start)[2]) {
  constexpr int N = kTile / 8;
  float tile_max[2] = {-INFINITY, -INFINITY};
  if (masked) {
    const RowBounds rows[2] = {{q0 + row0, row_start[0], k0}, {q0 + row0 + 8, row_start[1], k0}};
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (!rows[e / 2].allows(fragment_col(n, e))) s[n][e] = -INFINITY;
  }
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) tile_max[e / 2] = fmaxf(tile_max[e / 2], s[n][e]);
  float scaled_max[2];
  bool far_above = false;  // -inf + 8 is -inf: a row's first allowed scores move it
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    scaled_max[r] = quad_max(tile_max[r]) * kScaleLog2;
    far_above |= scaled_max[r] > row_max[r] + kStaleMaxLog2;
  }
  const bool moved = __any_sync(0xffffffffu, far_above);
  float base[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float before = row_max[r];
    if (moved) row_max[r] = fmaxf(before, scaled_max[r]);
    base[r] = row_max[r] == -INFINITY ? 0.0f : row_max[r];  // a row with nothing allowed yet stays at zero
    if (moved) {
      correction[r] = ptx::exp2_ftz(before - base[r]);
      row_sum[r] *= correction[r];
    }
  }
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[n][e] = ptx::exp2_ftz(fmaf(s[n][e], kScaleLog2, -base[e / 2]));
      row_sum[e / 2] += s[n][e];
    }
  return moved;
}

// The persistent grid's item of round r for this CTA, or -1: round r's gridDim.x items go to the
// CTAs forward in even rounds, backward in odd ones (a snake), so that each CTA's items, longest
// first, add up about alike.
__device__ inline int snake_item(int r, int items) {
  const int ctas = gridDim.x, cta = blockIdx.x, item = r * ctas + (r % 2 ? ctas - 1 - cta : cta);
  return item < items ? item : -1;
}

// Scales the output accumulated so far by the softmax's correction of its rows.
__device__ inline void rescale(float (&o)[kAttentionHeadDim / 8][4], const float (&correction)[2]) {
#pragma unroll
  for (int n = 0; n < kAttentionHeadDim / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] *= correction[e / 2];
}

// Writes a warp's 16 finished output rows (first_token on) and their log-sum-exps.
__device__ inline void store_forward_rows(bf16* y, float* lse, const float (&o)[kAttentionHeadDim / 8][4],
                                          const float (&row_max)[2], const float (&row_sum)[2], int first_token, int h,
                                          const AttentionTensors& a) {
  const float total[2] = {quad_sum(row_sum[0]), quad_sum(row_sum[1])};
  store_rows(y, o, first_token, h, a.H, 1.0f / total[0], 1.0f / total[1]);
  if (threadIdx.x % 4 == 0)
    for (int i = 0; i < 2; ++i)
      lse[size_t(h) * a.T + first_token + fragment_row(2 * i)] = row_max[i] / kLog2e + logf(total[i]);
}

// Forward: per (query block, head), online softmax over the listed kv blocks. Each warpgroup
// overlaps the softmax of block j + 1 with block j's product P V on the tensor cores: it issues
// S(j + 1) = Q K(j + 1)^T and then O += P(j) V(j), waits for the scores only, and waits for O just
// before rescaling it. So K runs one block ahead of V: K of block j + 2 and V of block j + 1 are
// copied while block j's products run, each into the buffer (of two) whose previous reader has
// been waited for before the barrier that starts block j.
// The grid is persistent: one CTA per SM walks (query block, head) items, the query blocks with the
// most kv blocks first (m.longest_first), dealt to the CTAs in a snake order (round r of gridDim.x
// items goes forward in even rounds, backward in odd ones) so that each CTA's items add up about
// alike. An item's Q, document starts and first K tile are copied while the previous item's last
// P V product runs.
__global__ void __launch_bounds__(kThreads) forward_kernel(const bf16* q, const bf16* k, const bf16* v, bf16* y,
                                                           float* lse, AttentionTensors a, DeviceAttentionMask m) {
  await_previous_kernel();
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* tiles = align_to_swizzle_atom(shared_tiles);  // Q, K of even and odd blocks, V of even and odd blocks
  bf16* q_tile = tiles;
  __shared__ __align__(16) int32_t q_start[kTile];  // the queries' document starts
  const int warp = threadIdx.x / 32, warpgroup_row = warp / 4 * 64, items = m.num_blocks * a.H;
  auto item_of_round = [&](int r) { return snake_item(r, items); };
  auto query_block_of = [&](int item) { return m.longest_first[item / a.H]; };
  auto k0_of = [&](int qb, int j) { return m.kv_index[qb * m.max_kv + j] * kTile; };  // its j-th listed kv block
  auto k_tile = [&](int j) { return tiles + (1 + j % 2) * kTileElements; };
  auto v_tile = [&](int j) { return tiles + (3 + j % 2) * kTileElements; };
  auto load_first = [&](int item) {  // an item's Q, document starts and first K tile, as one group
    const int qb = query_block_of(item), h = item % a.H;
    load_tile_async(q_tile, q + qb * kTile * a.q_stride + h * kAttentionHeadDim, a.q_stride);
    load_values_async(q_start, m.doc_start + qb * kTile, 0);
    if (m.kv_count[qb] > 0) load_k_tile(k_tile(0), k, a, h, k0_of(qb, 0));
    ptx::cp_async_commit();
  };

  constexpr int N = kTile / 8;
  static_assert(N == kAttentionHeadDim / 8, "scores and output tiles share their fragment loops");
  load_first(item_of_round(0));  // the grid has at most one CTA an item
  for (int r = 0, item = item_of_round(0); item >= 0; item = item_of_round(++r)) {
    const int qb = query_block_of(item), h = item % a.H, q0 = qb * kTile, count = m.kv_count[qb];
    auto load_next = [&] {  // the next item's first copies, once Q, the starts and the K tiles are free
      if (item_of_round(r + 1) >= 0) load_first(item_of_round(r + 1));
    };
    auto load_k = [&](int j) { load_k_tile(k_tile(j), k, a, h, k0_of(qb, j)); };
    auto load_v = [&](int j) { load_v_tile(v_tile(j), v, a, h, k0_of(qb, j)); };
    float o[kAttentionHeadDim / 8][4], row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0, 0}, correction[2];
    zero(o);
    auto softmax_of_block = [&](float (&s)[N][4], int j) {  // whether o must be rescaled
      const int k0 = k0_of(qb, j), row0 = warp * 16 + fragment_row(0);
      const int32_t row_start[2] = {q_start[row0], q_start[row0 + 8]};
      return online_softmax(s, row_max, row_sum, correction, needs_mask(qb, k0 / kTile, q_start[kTile - 1]), q0, k0,
                            row0, row_start);
    };
    if (count > 0) {
      load_v(0);
      if (count > 1) load_k(1);
      ptx::cp_async_commit();
      wait_tiles<1>();  // Q, the starts and K(0) are in
      float s[N][4];  // the scores of block j, then its P
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
        uint32_t p[kTile / 16][4];
        pack_a_fragments(p, s);  // P(j) as bf16: s takes the next scores (no second fp32 tile)
        wgmma_a_bt<kTile>(s, q_tile, warpgroup_row, k_tile(j + 1), 0);
        wgmma_p_b(o, p, v_tile(j), 0);
        ptx::wgmma_wait<1>();  // the scores; P(j) V(j) runs on beside the softmax
        fence_registers(s);
        const bool moved = softmax_of_block(s, j + 1);
        wgmma_wait_all(o, p);
        if (moved) rescale(o, correction);
      }
      wait_tiles();  // V(count - 1) is in; every warp is done with Q, the starts and both K tiles
      load_next();
      wgmma_p_b<kTile / 16>(o, s, v_tile(count - 1), 0);
      wgmma_wait_all(o);
    } else {
      wait_tiles();
      load_next();
    }
    store_forward_rows(y, lse, o, row_max, row_sum, q0 + warp * 16, h, a);
    __syncthreads();  // every warp is done with V(count - 1) before the next item's V(0) may land there
  }
}

// ---- The warp-specialised forward (`--attention flash-ws`) ------------------------------------
// FlashAttention-3's structure on forward_kernel's tiles, mask and item order. Warpgroup 0 is the
// producer: it gives back registers (setmaxnreg, 24 a thread) and its first thread copies the Q, K
// and V tiles by TMA into the stages, each stage with two mbarriers: `full` (its tile has landed)
// and `empty` (every consumer warp is done reading it). Warpgroups 1 and 2 (240 registers a
// thread) each own 64 query rows; they take turns issuing their products (two named barriers, a
// ping-pong: one warpgroup's softmax runs while the other's products hold the tensor cores), and
// each overlaps its softmax with its own previous block's P V as forward_kernel does. After the
// start no barrier spans the block: a consumer waits only for the tiles it reads, the producer
// only for stages to come free.
constexpr uint32_t kTileBytes = kTileElements * sizeof(bf16);
constexpr int kTmaBoxColumns = 64;  // a box row is one 128-byte swizzle span: a tile is two boxes

// Copies rows token0 .. token0 + 127 of head h (its 128 columns) into a swizzled tile, as two
// boxes of 64 columns (the tile's column halves), completing on `full`.
__device__ inline void tma_load_tile(bf16* tile, const CUtensorMap& map, int h, int token0, uint64_t* full) {
  for (int half = 0; half < kAttentionHeadDim / kTmaBoxColumns; ++half)
    ptx::tma_load_2d(tile + half * (kTile * kTmaBoxColumns), &map, h * kAttentionHeadDim + half * kTmaBoxColumns,
                     token0, full);
}

__global__ void __launch_bounds__(kWsThreads, 1)
    forward_ws_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                      const __grid_constant__ CUtensorMap v_map, bf16* y, float* lse, AttentionTensors a,
                      DeviceAttentionMask m) {
  await_previous_kernel();
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* tiles = align_to_swizzle_atom(shared_tiles);  // Q, K of stages 0 and 1, V of stages 0 and 1
  bf16* q_tile = tiles;
  auto k_tile = [&](int stage) { return tiles + (1 + stage) * kTileElements; };
  auto v_tile = [&](int stage) { return tiles + (1 + kStages + stage) * kTileElements; };
  __shared__ __align__(8) uint64_t barriers[2 + 4 * kStages];
  uint64_t *q_full = barriers, *q_empty = barriers + 1, *k_full = barriers + 2, *k_empty = k_full + kStages,
           *v_full = k_empty + kStages, *v_empty = v_full + kStages;
  if (threadIdx.x == 0) {
    init_ring(q_full, q_empty, 1);
    init_ring(k_full, k_empty, kStages);
    init_ring(v_full, v_empty, kStages);
    ptx::fence_mbarrier_init();
  }
  __syncthreads();
  const int items = m.num_blocks * a.H;
  auto k0_of = [&](int qb, int j) { return m.kv_index[qb * m.max_kv + j] * kTile; };

  if (take_producer_role()) {
    if (threadIdx.x != 0) return;
    uint32_t use = 0;
    int r = 0;
    for (int item; (item = snake_item(r, items)) >= 0; ++r) {
      const int qb = m.longest_first[item / a.H], h = item % a.H;
      // the consumers' last scores of the previous item are done
      mbarrier_wait(q_empty, r % 2 ^ 1, "flash forward (ws): the producer's wait for the consumers to free Q");
      ptx::mbarrier_arrive_expect_tx(q_full, kTileBytes);
      tma_load_tile(q_tile, q_map, h, qb * kTile, q_full);
      for (int j = 0; j < m.kv_count[qb]; ++j, ++use) {
        const StageUse u = stage_use<kStages>(use);
        mbarrier_wait(k_empty + u.stage, u.parity ^ 1, "flash forward (ws): the producer's wait for a free K stage");
        ptx::mbarrier_arrive_expect_tx(k_full + u.stage, kTileBytes);
        tma_load_tile(k_tile(u.stage), k_map, h, k0_of(qb, j), k_full + u.stage);
        mbarrier_wait(v_empty + u.stage, u.parity ^ 1, "flash forward (ws): the producer's wait for a free V stage");
        ptx::mbarrier_arrive_expect_tx(v_full + u.stage, kTileBytes);
        tma_load_tile(v_tile(u.stage), v_map, h, k0_of(qb, j), v_full + u.stage);
      }
    }
    // The consumers' waits have no register to spare for a bound: the producer waits, as before a
    // next use, until they have released Q and every stage, so that a consumer stuck on a phase of
    // what the producer issued (a short copy, a wrong parity) leaves the producer's bounded wait to
    // fail the launch. (The two sides count items and uses alike; a consumer waiting for a use the
    // producer never issues would not be bounded.)
    mbarrier_wait(q_empty, r % 2 ^ 1, "flash forward (ws): the producer's last wait, for Q's release");
    for (int i = 0; i < kStages; ++i) {
      const StageUse u = stage_use<kStages>(use + i);
      mbarrier_wait(k_empty + u.stage, u.parity ^ 1, "flash forward (ws): the producer's last waits, for K's release");
      mbarrier_wait(v_empty + u.stage, u.parity ^ 1, "flash forward (ws): the producer's last waits, for V's release");
    }
    return;
  }

  const int consumer = threadIdx.x / 128 - 1, warp = threadIdx.x / 32 - 4;  // warp: 16 rows of the tile
  const int row0 = warp * 16 + fragment_row(0);
  auto my_turn = [&] { ptx::named_barrier_sync(1 + consumer, 256); };
  auto other_turn = [&] { ptx::named_barrier_arrive(2 - consumer, 256); };
  if (consumer == 1) other_turn();  // consumer 0 issues first
  constexpr int N = kTile / 8;
  uint32_t use = 0;
  for (int r = 0, item; (item = snake_item(r, items)) >= 0; ++r) {
    const int qb = m.longest_first[item / a.H], h = item % a.H, q0 = qb * kTile, count = m.kv_count[qb];
    const int32_t row_start[2] = {m.doc_start[q0 + row0], m.doc_start[q0 + row0 + 8]};
    const int32_t last_start = m.doc_start[q0 + kTile - 1];
    float o[kAttentionHeadDim / 8][4], row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0, 0}, correction[2];
    zero(o);
    auto softmax_of_block = [&](float (&s)[N][4], int j) {  // whether o must be rescaled
      const int k0 = k0_of(qb, j);
      return online_softmax(s, row_max, row_sum, correction, needs_mask(qb, k0 / kTile, last_start), q0, k0, row0,
                            row_start);
    };
    mbarrier_wait_unbounded(q_full, r % 2);
    if (count > 0) {
      float s[N][4];  // the scores of block j, then its P
      const StageUse first = stage_use<kStages>(use);
      mbarrier_wait_unbounded(k_full + first.stage, first.parity);
      my_turn();
      wgmma_a_bt<kTile>(s, q_tile, consumer * 64, k_tile(first.stage), 0);
      other_turn();
      wgmma_wait_all(s);
      release_stage(k_empty + first.stage);
      if (count == 1) release_stage(q_empty);
      softmax_of_block(s, 0);
      for (int j = 0; j + 1 < count; ++j) {  // the last block peeled, as in forward_kernel
        const StageUse now = stage_use<kStages>(use + j), next = stage_use<kStages>(use + j + 1);
        mbarrier_wait_unbounded(k_full + next.stage, next.parity);
        mbarrier_wait_unbounded(v_full + now.stage, now.parity);
        uint32_t p[kTile / 16][4];
        pack_a_fragments(p, s);  // P(j) as bf16: s takes the next scores (no second fp32 tile)
        my_turn();
        wgmma_a_bt<kTile>(s, q_tile, consumer * 64, k_tile(next.stage), 0);
        wgmma_p_b(o, p, v_tile(now.stage), 0);
        other_turn();
        ptx::wgmma_wait<1>();  // the scores; P(j) V(j) runs on beside the softmax
        fence_registers(s);
        release_stage(k_empty + next.stage);
        if (j + 2 == count) release_stage(q_empty);  // that was the item's last Q K^T
        const bool moved = softmax_of_block(s, j + 1);
        wgmma_wait_all(o, p);
        release_stage(v_empty + now.stage);
        if (moved) rescale(o, correction);
      }
      const StageUse last = stage_use<kStages>(use + count - 1);
      mbarrier_wait_unbounded(v_full + last.stage, last.parity);
      my_turn();
      wgmma_p_b<kTile / 16>(o, s, v_tile(last.stage), 0);
      other_turn();
      wgmma_wait_all(o);
      release_stage(v_empty + last.stage);
      use += count;
    } else {
      release_stage(q_empty);
    }
    store_forward_rows(y, lse, o, row_max, row_sum, q0 + warp * 16, h, a);
  }
  if (consumer == 0) my_turn();  // takes consumer 1's last hand-over: no arrival left at the exit
}

// P of a 16 x 8N score tile, in place: p = exp(scores - lse) where allowed (0 elsewhere).
// `query_of(row, col)` maps a fragment position to its query index within the query tile and
// `key_of` to its key index within the kv tile (the dkv kernel's tiles are transposed); q_start: the
// query tile's document starts. It needs the scores alone, so the backwards run it while dP's
// product (issued after the scores') is still on the tensor cores.
template <int N, typename QueryOf, typename KeyOf>
__device__ inline void softmax_probabilities(float (&s)[N][4], const float* lse, bool masked, int q0, int k0,
                                             const int32_t* q_start, QueryOf query_of, KeyOf key_of) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tq = query_of(n, e);
      const bool allowed = !masked || RowBounds(q0 + tq, q_start[tq], k0).allows(key_of(n, e));
      s[n][e] = allowed ? ptx::exp2_ftz(fmaf(s[n][e], kScaleLog2, -lse[tq] * kLog2e)) : 0.0f;
    }
}

// dS = p (dp - delta) of the same tile, in dp's registers.
template <int N, typename QueryOf>
__device__ inline void score_gradients(const float (&p)[N][4], float (&dp)[N][4], const float* delta, QueryOf query_of) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dp[n][e] = p[n][e] * (dp[n][e] - delta[query_of(n, e)]);
}

// Per (query block, head): dq = scale sum_kv dS K over the listed kv blocks, 64 keys at a time.
__global__ void __launch_bounds__(kThreads) backward_dq_kernel(const bf16* q, const bf16* k, const bf16* v,
                                                               const bf16* dy, const float* lse, const float* delta,
                                                               bf16* dq, AttentionTensors a, DeviceAttentionMask m) {
  await_previous_kernel();
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* tiles = align_to_swizzle_atom(shared_tiles);  // Q, dY, then per stage K and V
  bf16 *q_tile = tiles, *dy_tile = tiles + kTileElements;
  __shared__ __align__(16) int32_t q_start[kTile];  // the queries' document starts
  __shared__ __align__(16) float q_lse[kTile], q_delta[kTile];
  const int qb = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / 32, q0 = qb * kTile;
  const int warpgroup_row = warp / 4 * 64;
  const int64_t dy_stride = int64_t(a.H) * kAttentionHeadDim;
  load_tile_async(q_tile, q + q0 * a.q_stride + h * kAttentionHeadDim, a.q_stride);
  load_tile_async(dy_tile, dy + q0 * dy_stride + h * kAttentionHeadDim, dy_stride);
  load_values_async(q_start, m.doc_start + q0, 32);
  load_values_async(q_lse, lse + size_t(h) * a.T + q0, 64);
  load_values_async(q_delta, delta + size_t(h) * a.T + q0, 96);
  constexpr int kKeys = 64, N = kKeys / 8;
  float dq_acc[kAttentionHeadDim / 8][4];
  zero(dq_acc);
  auto query_of = [&](int, int e) { return warp * 16 + fragment_row(e); };
  walk_kv_blocks(tiles + 2 * kTileElements, k, v, a, m, qb, h, [&](int kb, const bf16* k_tile, const bf16* v_tile) {
    const int k0 = kb * kTile;
    const bool masked = needs_mask(qb, kb, q_start[kTile - 1]);
    for (int half = 0; half < kTile / kKeys; ++half) {
      float s[N][4], dp[N][4];
      wgmma_a_bt<kKeys>(s, q_tile, warpgroup_row, k_tile, half * kKeys);
      wgmma_a_bt<kKeys>(dp, dy_tile, warpgroup_row, v_tile, half * kKeys);
      ptx::wgmma_wait<1>();  // the scores (and the previous half's dq product); dP's runs on beside P
      fence_registers(s);
      softmax_probabilities(s, q_lse, masked, q0, k0, q_start, query_of,
                            [&](int n, int e) { return half * kKeys + fragment_col(n, e); });
      wgmma_wait_all(dp);
      score_gradients(s, dp, q_delta, query_of);
      wgmma_p_b<kKeys / 16>(dq_acc, dp, k_tile, half * kKeys);
    }
    wgmma_wait_all(dq_acc);  // before the barrier after which block j + 2 refills this stage
  });
  store_rows(dq, dq_acc, q0 + warp * 16, h, a.H, kAttentionScale, kAttentionScale);
}

// dq's partial sums between the CTAs of the fused backward. The kv blocks that attend a query
// block each add their contribution dS K to its rows, per 64-query half, in descending kv-block
// order (the mask's q_turn): the first stores, the next ones add (fp32 reductions at L2), the last
// reads the sum back, adds its own and writes dq in bf16. Each contributor waits until the half's
// counter reaches its turn, so the fp32 sums happen in one order on every run: dq is bitwise
// deterministic. CTAs take their items (head, kv block) in the order of a ticket, from the last kv
// block down: a contribution only ever waits for items with smaller tickets, taken up before it, so
// the waits cannot deadlock (backward_dkv_kernel says why, for CTAs that walk several items).
struct DqPartialSums {
  float* sums;  // [H, T, 128]
  int* ticket;  // the items' start order (zero at the launch)
  int* turns;   // [H, T / 64]: contributions added so far to each (head, 64 queries) (zero at the launch)
};
// A turn that never comes (a scheduling bug) fails the launch (ptx::fail_launch) after 2^24 polls:
// each reads L2 (0.3-1 us under load) and sleeps up to twice 64 ns, so 5-20 s, long past any honest
// wait (for an item a running CTA has taken: tens of microseconds; milliseconds under time-slicing)
// and short beside a device call's 10 minutes (2^30, before, would have taken all of them). A
// debugger stopping one CTA for longer trips it.
constexpr unsigned kMaxTurnPolls = 1u << 24;

// Thread 0 waits until `counter` reaches `turn`: every contribution before this CTA's is in.
__device__ inline void wait_for_turn(const int* counter, int turn) {
  for (unsigned polls = 0; *reinterpret_cast<const volatile int*>(counter) != turn; ++polls) {
    if (polls == kMaxTurnPolls) ptx::fail_launch("flash backward (fused): a wait for a dq turn that never came");
    __nanosleep(64);
  }
  __threadfence();
}

// Issues, as one group, dq[64 x 64] = dS[64 x 128] K[0..128, 64 g .. 64 g + 64) for warpgroup g:
// dS a [64 queries][128 keys] tile (K-major), the K tile read N-major (its rows, the keys, are k).
__device__ inline void wgmma_ds_k(float (&dq)[kDsRows / 8][4], const bf16* ds_tile, const bf16* k_tile, int g) {
  fence_registers(dq);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk) {
    const uint64_t a_desc = swizzled_128b_descriptor(ds_tile + swizzled<kDsRows>(0, kk * 16), 16, kSwizzleAtomBytes);
    const uint64_t b_desc =
        swizzled_128b_descriptor(k_tile + swizzled(kk * 16, g * 64), kHalfTileBytes, kSwizzleAtomBytes);
    ptx::wgmma_m64n64k16_ss</*trans_b=*/1>(dq, a_desc, b_desc, /*accumulate=*/kk > 0);
  }
  ptx::wgmma_commit();
}

// The backward of what the qkv product's outputs went through before attention (the QK norm and
// RoPE of q and k: rope.cuh's qk_norm_rope_backward; v = sa0 v_raw + sa1 ve: weighted_sum_backward)
// where the fused backward stores dq, dk and dv (`--qkv-backward fused`): it writes, instead of them,
// the gradient of the raw qkv, dqkv, from the raw qkv (each q and k row's norm recomputed from its
// sum of squares), the rope table and the mix's scalars, and the mix's scalar gradients. The
// gradients go through in fp32 (the passes read dq, dk and dv rounded to bf16). The passes go.
struct QkvGradient {
  const bf16* qkv;       // [T, 3, H, 128]: the raw projections q, k and v were made from
  const float* cos_sin;  // [T, 64, 2] (rope_table_host)
  const float* sa0;      // the value mix's v_raw scalar (device; sa1 is needed only for ve's own gradient)
  const bf16* ve;        // [T, H, 128] the value embedding, or null (v = sa0 v_raw)
  bf16* dqkv;            // [T, 3, H, 128]: written whole
  bf16* dv;              // [T, H, 128] dv itself too (ve's embedding backward reads it), or null
  float eps = kRmsEps;
  float* value_mix_partials = nullptr;  // the CTAs' sums of dv v_raw, then of dv ve: [2][H, T / 128] (the launcher's)
  // The start of head h's row of token t in the q (which 0), k (1) or v (2) third of qkv and dqkv.
  __device__ size_t row(int t, int which, int h, int H) const {
    return (size_t(t) * 3 + which) * H * kAttentionHeadDim + size_t(h) * kAttentionHeadDim;
  }
};

// RoPE's inverse on a pair (j, j + 64) of gradients: the transpose of the forward's rotation.
__device__ inline void rope_unrotate(float& g1, float& g2, float c, float s) {
  const float turned1 = g1 * c - g2 * s;
  g2 = g1 * s + g2 * c;
  g1 = turned1;
}

// A thread's part of a row's sums for the norm's backward: x x and x g over its `pairs` column pairs
// (columns fragment_col(n, 0) + {0, 1} of the row from x), g the gradients of the normalised values.
template <int pairs>
__device__ inline float2 norm_backward_sums(const bf16* x, const float (&g)[pairs][2]) {
  float ss = 0, dot = 0;
#pragma unroll
  for (int n = 0; n < pairs; ++n) {
    const __nv_bfloat162 pair = *reinterpret_cast<const __nv_bfloat162*>(x + fragment_col(n, 0));
    const float x0 = __low2float(pair), x1 = __high2float(pair);
    ss += x0 * x0 + x1 * x1;
    dot += x0 * g[n][0] + x1 * g[n][1];
  }
  return make_float2(ss, dot);
}

// The norm's backward of a thread's column pairs of a row whose sums (over its 128 columns) are
// `sums`, written to dx.
template <int pairs>
__device__ inline void store_norm_backward(bf16* dx, const bf16* x, const float (&g)[pairs][2], float2 sums,
                                           float eps) {
  const float inv = rsqrtf(sums.x / kAttentionHeadDim + eps), mean_dot = sums.y / kAttentionHeadDim;
#pragma unroll
  for (int n = 0; n < pairs; ++n) {
    const __nv_bfloat162 pair = *reinterpret_cast<const __nv_bfloat162*>(x + fragment_col(n, 0));
    *reinterpret_cast<uint32_t*>(dx + fragment_col(n, 0)) =
        pack_bf16(rmsnorm_backward_element(0.0f, inv, g[n][0], __low2float(pair), mean_dot),
                  rmsnorm_backward_element(0.0f, inv, g[n][1], __high2float(pair), mean_dot));
  }
}

// A warp's 16 keys of dk (the accumulator times `scale`) through the norm's and RoPE's backward,
// as the k third of dqkv. A row's 128 columns sit in a quad (its sums are two shuffles), RoPE's pairs
// (j, j + 64) in one thread (n and n + 8; only j < 32 turn: the table holds cos 1, sin 0 beyond).
__device__ inline void store_k_rows_into_dqkv(const float (&acc)[kAttentionHeadDim / 8][4], int first_token, int h,
                                                 int H, float scale, const QkvGradient& grad) {
  constexpr int kN = kAttentionHeadDim / 8;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int t = first_token + fragment_row(2 * half);
    const float* angles = grad.cos_sin + size_t(t) * kRopeHeadDim;
    float g[kN][2];
#pragma unroll
    for (int n = 0; n < kN; ++n) g[n][0] = acc[n][2 * half] * scale, g[n][1] = acc[n][2 * half + 1] * scale;
#pragma unroll
    for (int n = 0; n < kN / 4; ++n) {
      const float4 cs = *reinterpret_cast<const float4*>(angles + 2 * fragment_col(n, 0));
      rope_unrotate(g[n][0], g[n + kN / 2][0], cs.x, cs.y);
      rope_unrotate(g[n][1], g[n + kN / 2][1], cs.z, cs.w);
    }
    const size_t at = grad.row(t, 1, h, H);
    const float2 sums = norm_backward_sums(grad.qkv + at, g);
    store_norm_backward(grad.dqkv + at, grad.qkv + at, g, make_float2(quad_sum(sums.x), quad_sum(sums.y)), grad.eps);
  }
}

// A warp's 16 keys of dv through the value mix's backward, as the v third of dqkv (sa0 dv) and dv
// itself where grad.dv asks for it; returns the thread's shares of sum(dv v_raw) and sum(dv ve),
// the gradients of sa0 and sa1.
__device__ inline float2 store_v_rows_into_dqkv(const float (&acc)[kAttentionHeadDim / 8][4], int first_token, int h,
                                                int H, const QkvGradient& grad) {
  const float alpha = *grad.sa0;
  float dot_raw = 0, dot_ve = 0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int t = first_token + fragment_row(2 * half);
    const size_t at = grad.row(t, 2, h, H), own = (size_t(t) * H + h) * kAttentionHeadDim;
#pragma unroll
    for (int n = 0; n < kAttentionHeadDim / 8; ++n) {
      const int col = fragment_col(n, 0);
      const float d0 = acc[n][2 * half], d1 = acc[n][2 * half + 1];
      const __nv_bfloat162 raw = *reinterpret_cast<const __nv_bfloat162*>(grad.qkv + at + col);
      dot_raw += d0 * __low2float(raw) + d1 * __high2float(raw);
      if (grad.ve) {
        const __nv_bfloat162 ve = *reinterpret_cast<const __nv_bfloat162*>(grad.ve + own + col);
        dot_ve += d0 * __low2float(ve) + d1 * __high2float(ve);
      }
      if (grad.dv) *reinterpret_cast<uint32_t*>(grad.dv + own + col) = pack_bf16(d0, d1);
      *reinterpret_cast<uint32_t*>(grad.dqkv + at + col) = pack_bf16(alpha * d0, alpha * d1);
    }
  }
  return make_float2(dot_raw, dot_ve);
}

// The last contributor's dq rows through the norm's and RoPE's backward, as the q third of dqkv: g
// holds its warpgroup's 64 columns (64 group ..) of the 64 queries from q_first, summed and scaled.
// A row's columns are split between the warpgroups, so RoPE's pairs (j, j + 64) cross from one to
// the other, and so does the row's sum: the turning columns (j < 32) go through `exchange` (the dS
// tile's 16 KB, [2 groups][64 rows][32], free until the next half's barrier; columns swizzled by
// the row, so that a warp's stores hit distinct banks), the rows' partial sums through `row_sums`
// [2 groups][64 rows], added in group order by both warpgroups (one norm for the row).
// after_barrier: a CTA barrier came after both warpgroups' last wait on their dS K products.
__device__ inline void store_q_rows_into_dqkv(float (&g)[kDsRows / 8][4], int q_first, int h, int H,
                                               const QkvGradient& grad, float* exchange, float2* row_sums,
                                               bool after_barrier) {
  constexpr int kN = kDsRows / 8, kTurning = kAttentionHeadDim / 4;
  static_assert(2 * kDsRows * kTurning * sizeof(float) <= kDsRows * kTile * sizeof(bf16),
                "the exchange fits the dS tile");
  const int group = threadIdx.x / 128;
  auto exchanged = [&](int from_group, int row, int n) {
    return reinterpret_cast<float2*>(exchange + (from_group * kDsRows + row) * kTurning +
                                     (fragment_col(n, 0) ^ (row % 4 * 8)));
  };
  if (!after_barrier) __syncthreads();  // both warpgroups' dS K products are done with the dS tile
#pragma unroll
  for (int half = 0; half < 2; ++half)
#pragma unroll
    for (int n = 0; n < kTurning / 8; ++n)
      *exchanged(group, warpgroup_fragment_row(2 * half), n) = make_float2(g[n][2 * half], g[n][2 * half + 1]);
  __syncthreads();
  float turned[2][kN][2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = warpgroup_fragment_row(2 * half), t = q_first + row;
    const float* angles = grad.cos_sin + size_t(t) * kRopeHeadDim;
#pragma unroll
    for (int n = 0; n < kN; ++n) turned[half][n][0] = g[n][2 * half], turned[half][n][1] = g[n][2 * half + 1];
#pragma unroll
    for (int n = 0; n < kTurning / 8; ++n) {
      const float4 cs = *reinterpret_cast<const float4*>(angles + 2 * fragment_col(n, 0));
      const float2 other = *exchanged(1 - group, row, n);
      float partner[2] = {other.x, other.y};
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float c = e ? cs.z : cs.x, s = e ? cs.w : cs.y;
        if (group == 0) rope_unrotate(turned[half][n][e], partner[e], c, s);
        else rope_unrotate(partner[e], turned[half][n][e], c, s);
      }
    }
    const float2 sums = norm_backward_sums(grad.qkv + grad.row(t, 0, h, H) + group * kDsRows, turned[half]);
    const float2 quad = make_float2(quad_sum(sums.x), quad_sum(sums.y));
    if (threadIdx.x % 4 == 0) row_sums[group * kDsRows + row] = quad;
  }
  __syncthreads();
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = warpgroup_fragment_row(2 * half), t = q_first + row;
    const float2 first = row_sums[row], second = row_sums[kDsRows + row];
    const size_t at = grad.row(t, 0, h, H) + group * kDsRows;
    store_norm_backward(grad.dqkv + at, grad.qkv + at, turned[half],
                        make_float2(first.x + second.x, first.y + second.y), grad.eps);
  }
}

// Asks L2 for the 128 rows of 128 bf16 (two lines a row) from `first` on, rows `stride` apart, a line
// a thread: what a tail of the CTA reads later (raw q, k or v rows, ve's), so that it waits less.
__device__ inline void prefetch_tile_rows(const bf16* first, int64_t stride) {
  static_assert(kThreads == 2 * kTile, "a line a thread");
  ptx::prefetch_l2(first + int64_t(threadIdx.x / 2) * stride + threadIdx.x % 2 * 64);
}

// Where the fused backward's last dq contributors write: dq, or (into_dqkv) dqkv's q third,
// with the shared memory that takes.
struct DqOutput {
  bf16* dq;
  QkvGradient grad;
  float* exchange;
  float2* row_sums;
};

// Adds the CTA's dq contribution to the 64 queries from token q_first of head h, in its turn of
// `contributors`; each warpgroup holds 64 of the 128 columns (the accumulator of wgmma_ds_k). The
// last contributor writes the sum in bf16 (into_dqkv: through the QK norm's and RoPE's backward into
// dqkv).
// Returns the counter the contribution must still move on (null for the last contributor, which
// ends the sum): release_dq_turn does it after the CTA's next block barrier, by when the fp32
// reductions have long reached L2, so that the fence waits for nothing (done here, right after
// them, it waited out their round trip, and the whole CTA with it at the next barrier).
template <bool into_dqkv>
__device__ inline int* add_dq_contribution(float (&part)[kDsRows / 8][4], const DqPartialSums& s, const DqOutput& out,
                                           const AttentionTensors& a, int h, int q_first, int turn,
                                           int contributors) {
  int* counter = s.turns + size_t(h) * (a.T / kDsRows) + q_first / kDsRows;
  if (turn > 0) {
    if (threadIdx.x == 0) wait_for_turn(counter, turn);
    __syncthreads();
  }
  // element (n, half) of the thread's part: its query row and column (each warpgroup 64 of them)
  auto row_of = [&](int half) { return q_first + warpgroup_fragment_row(2 * half); };
  auto col_of = [&](int n) { return threadIdx.x / 128 * 64 + fragment_col(n, 0); };
  auto sum_at = [&](int n, int half) {
    return reinterpret_cast<float2*>(s.sums + (size_t(h) * a.T + row_of(half)) * kAttentionHeadDim + col_of(n));
  };
  if (turn + 1 < contributors) {
#pragma unroll
    for (int n = 0; n < kDsRows / 8; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float2 v = make_float2(part[n][2 * half], part[n][2 * half + 1]);
        if (turn == 0) __stcg(sum_at(n, half), v);
        else atomicAdd(sum_at(n, half), v);
      }
    return counter;
  }
#pragma unroll
  for (int n = 0; n < kDsRows / 8; ++n)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float2 v = make_float2(part[n][2 * half], part[n][2 * half + 1]);
      if (turn > 0) {
        const float2 before = __ldcg(sum_at(n, half));  // from L2: this SM's L1 may hold an older copy
        v = make_float2(before.x + v.x, before.y + v.y);
      }
      part[n][2 * half] = v.x * kAttentionScale, part[n][2 * half + 1] = v.y * kAttentionScale;
    }
  if constexpr (into_dqkv) {
    store_q_rows_into_dqkv(part, q_first, h, a.H, out.grad, out.exchange, out.row_sums,
                           /*after_barrier=*/turn > 0);
  } else {
#pragma unroll
    for (int n = 0; n < kDsRows / 8; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        *reinterpret_cast<uint32_t*>(out.dq + (size_t(row_of(half)) * a.H + h) * kAttentionHeadDim + col_of(n)) =
            pack_bf16(part[n][2 * half], part[n][2 * half + 1]);
      }
  }
  return nullptr;
}

// Moves a contribution's counter on (null: nothing to do), called by every thread after a block
// barrier that follows the contribution's sums. A release, as CUTLASS's semaphores: the barrier
// orders every thread's sums before thread 0's fence, which (cumulative) makes them visible at GPU
// scope before the counter moves. A CTA releases before it waits for its next turn, so the delay
// never makes it wait on itself, and it waits only on CTAs with earlier tickets (no cycle).
__device__ inline void release_dq_turn(int* counter) {
  if (counter && threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1);
  }
}

// Writes the warp's 16 keys x 64 queries of dS^T (its A fragments, pack_a_fragments) into the
// [64 queries][128 keys] dS tile, transposed by stmatrix: fragment kk's four 8 x 8 matrices are
// queries 16 kk .. + 7 and 16 kk + 8 .. + 15, each of keys 16 warp .. + 7 and 16 warp + 8 .. + 15,
// so lane 8 m + i gives the row of query 16 kk + 8 (m / 2) + i from key 16 warp + 8 (m % 2).
__device__ inline void store_ds_transposed(bf16* ds_tile, const uint32_t (&ds)[kDsRows / 16][4], int warp) {
  const int m = threadIdx.x % 32 / 8, i = threadIdx.x % 8;
#pragma unroll
  for (int kk = 0; kk < kDsRows / 16; ++kk)
    ptx::stmatrix_x4</*trans=*/true>(ds_tile + swizzled<kDsRows>(16 * kk + 8 * (m / 2) + i, 16 * warp + 8 * (m % 2)),
                           ds[kk][0], ds[kk][1], ds[kk][2], ds[kk][3]);
}

// Per (kv block, head): dv = sum_q P^T dy and dk = scale sum_q dS^T Q over the query blocks that
// list this kv block, 64 queries at a time; the warps own 16 keys each, so scores are transposed.
// With fused_dq (the fused backward) the same dS also gives dq: each 64-query half of dS goes to
// shared memory as [queries][keys], and dS K is added to dq's partial sums (DqPartialSums) in turn.
// With into_dqkv (fused_dq only) dq, dk and dv go through the backward of the QK norm, RoPE and the
// value mix into grad.dqkv instead of dq, dk and dv (QkvGradient).
// The fused backward into dq is persistent (a CTA an SM): each CTA takes items (head, kv block) by ticket
// until none is left, the next one as its item's last query block starts, so that the next item's
// first Q and dY tiles are copied during that block and its K and V tiles while dk and dv are
// stored: no CTA starts with all four copies ahead of it (a CTA a wave did, ~17 waves a call).
// Tickets still go out in increasing order and a CTA holds at most its current item and the next,
// a larger one, so the smallest unfinished ticket is always some CTA's current item, whose waits are
// all for smaller, finished ones: no cycle (a CTA not yet resident holds none). The two-kernel
// path's CTA has one item, its block's; so has the into-dqkv variant's (a CTA an item, by ticket):
// its loop's state cost it 28-68 bytes of spill at 255 registers.
template <bool fused_dq, bool into_dqkv = false>
__global__ void __launch_bounds__(kThreads) backward_dkv_kernel(const bf16* q, const bf16* k, const bf16* v,
                                                                const bf16* dy, const float* lse, const float* delta,
                                                                bf16* dq, bf16* dk, bf16* dv, DqPartialSums dq_sums,
                                                                QkvGradient grad, AttentionTensors a,
                                                                DeviceAttentionMask m) {
  await_previous_kernel();
  static_assert(fused_dq || !into_dqkv, "dq's part rides on the fused backward's dq sums");
  constexpr bool persistent = fused_dq && !into_dqkv;
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* tiles = align_to_swizzle_atom(shared_tiles);  // K, V, per stage Q and dY, then (fused) dS
  bf16 *k_tile = tiles, *v_tile = tiles + kTileElements, *ds_tile = tiles + (2 + 2 * kStages) * kTileElements;
  __shared__ __align__(16) int32_t stage_start[kStages][kTile];  // the query tiles' document starts
  __shared__ __align__(16) float stage_lse[kStages][kTile], stage_delta[kStages][kTile];
  __shared__ int ticket;  // the fused backward's next item, taken by thread 0
  __shared__ float2 dq_row_sums[into_dqkv ? 2 * kDsRows : 1];  // store_q_rows_into_dqkv's
  const DqOutput dq_out{dq, grad, reinterpret_cast<float*>(ds_tile), dq_row_sums};
  const int items = m.num_blocks * a.H;
  auto kb_of = [&](int item) { return m.num_blocks - 1 - item % m.num_blocks; };  // the last kv block first
  int item = int(blockIdx.y) * m.num_blocks + m.num_blocks - 1 - int(blockIdx.x);  // the two-kernel path's
  if constexpr (fused_dq) {
    if (threadIdx.x == 0) ticket = atomicAdd(dq_sums.ticket, 1);
    __syncthreads();
    item = ticket;
    __syncthreads();  // every thread has read it before thread 0 takes the next
  }
  const int warp = threadIdx.x / 32;
  const int warpgroup_row = warp / 4 * 64;
  const int64_t dy_stride = int64_t(a.H) * kAttentionHeadDim;
  auto q_tile_of = [&](int stage) { return tiles + (2 + 2 * stage) * kTileElements; };
  // The j-th query block listed for kv block kb (Q, dY, starts, statistics of head h) into `stage`.
  auto load_q = [&](int kb, int h, int j, int stage) {
    const int q0 = m.q_index[kb * m.max_q + j] * kTile;
    load_tile_async(q_tile_of(stage), q + q0 * a.q_stride + h * kAttentionHeadDim, a.q_stride);
    load_tile_async(q_tile_of(stage) + kTileElements, dy + q0 * dy_stride + h * kAttentionHeadDim, dy_stride);
    load_values_async(stage_start[stage], m.doc_start + q0, 0);
    load_values_async(stage_lse[stage], lse + size_t(h) * a.T + q0, 32);
    load_values_async(stage_delta[stage], delta + size_t(h) * a.T + q0, 64);
    ptx::cp_async_commit();
  };
  // An item without query blocks reads nothing (it stores zeros): no copies for it, so that none of
  // its copies is still in flight when the next item's K and V are copied into the same tiles.
  auto reads_tiles = [&](int item) { return item < items && m.q_count[kb_of(item)] > 0; };
  auto load_item_kv = [&](int item) { load_kv_tiles(k_tile, k, v, a, item / m.num_blocks, kb_of(item) * kTile); };
  auto load_item_first_q = [&](int item, int stage) { load_q(kb_of(item), item / m.num_blocks, 0, stage); };
  if (reads_tiles(item)) {  // the first item's tiles
    load_item_kv(item);
    load_item_first_q(item, 0);
  }
  constexpr int kQueries = kDsRows, N = kQueries / 8;
  auto key_of = [&](int, int e) { return warp * 16 + fragment_row(e); };
  // use: the query blocks this CTA walked before the item (block j's stage is (use + j) % kStages)
  for (int use = 0; item < items;) {
    const int kb = kb_of(item), h = item / m.num_blocks, k0 = kb * kTile, count = m.q_count[kb];
    auto take_next_ticket = [&] {  // by thread 0, before a barrier
      if (persistent && threadIdx.x == 0) ticket = atomicAdd(dq_sums.ticket, 1);
    };
    auto q_block = [&](int j) { return m.q_index[kb * m.max_q + j]; };
    float dk_acc[kAttentionHeadDim / 8][4], dv_acc[kAttentionHeadDim / 8][4];
    zero(dk_acc);
    zero(dv_acc);
    int* pending_turn = nullptr;  // the fused backward's last contribution, its counter not yet moved on
    for (int j = 0; j < count; ++j) {
      if (j + 1 == count) take_next_ticket();
      wait_tiles();  // block j is in; every warp is done with block j - 1, whose stage block j + 1 takes
      if (j + 1 < count) {
        load_q(kb, h, j + 1, (use + j + 1) % kStages);
      } else if constexpr (persistent) {  // the next item's first query block into the other stage
        if (reads_tiles(ticket)) load_item_first_q(ticket, (use + count) % kStages);
      }
      const int qb = q_block(j), q0 = qb * kTile, stage = (use + j) % kStages;
      const bf16 *q_tile = q_tile_of(stage), *dy_tile = q_tile + kTileElements;
      const int32_t* q_start = stage_start[stage];
      const float *q_lse = stage_lse[stage], *q_delta = stage_delta[stage];
      const bool masked = needs_mask(qb, kb, q_start[kTile - 1]);
      if constexpr (into_dqkv) {  // the rows the tails read: raw q where this CTA ends dq, raw k, v and ve at the end
        const int64_t raw_stride = 3 * int64_t(a.H) * kAttentionHeadDim;
        if (m.q_turn[kb * m.max_q + j] + 1 == m.kv_count[qb])
          prefetch_tile_rows(grad.qkv + grad.row(q0, 0, h, a.H), raw_stride);
        if (j + 1 == count) {
          prefetch_tile_rows(grad.qkv + grad.row(k0, 1, h, a.H), raw_stride);
          prefetch_tile_rows(grad.qkv + grad.row(k0, 2, h, a.H), raw_stride);
          const int64_t ve_stride = int64_t(a.H) * kAttentionHeadDim;  // [T, H, 128]
          if (grad.ve) prefetch_tile_rows(grad.ve + (size_t(k0) * a.H + h) * kAttentionHeadDim, ve_stride);
        }
      }
      for (int half = 0; half < kTile / kQueries; ++half) {
        float st[N][4], dpt[N][4];  // [64 keys x 64 queries] per warpgroup
        auto query_of = [&](int n, int e) { return half * kQueries + fragment_col(n, e); };
        wgmma_a_bt<kQueries>(st, k_tile, warpgroup_row, q_tile, half * kQueries);
        wgmma_a_bt<kQueries>(dpt, v_tile, warpgroup_row, dy_tile, half * kQueries);
        ptx::wgmma_wait<1>();  // the scores; dP's product runs on beside P's exponentials
        fence_registers(st);
        softmax_probabilities(st, q_lse, masked, q0, k0, q_start, query_of, key_of);
        wgmma_wait_all(dpt);
        score_gradients(st, dpt, q_delta, query_of);
        wgmma_p_b<kQueries / 16>(dv_acc, st, dy_tile, half * kQueries);  // under the barrier and the dS stores
        uint32_t ds[kQueries / 16][4];  // dS^T in bf16: dK's A fragments, and (fused) the dS tile's values
        pack_a_fragments(ds, dpt);
        if constexpr (fused_dq) {
          __syncthreads();  // both warpgroups' dq products of the previous half are done with the dS tile
          release_dq_turn(pending_turn);  // the previous half's sums are in (that barrier)
          pending_turn = nullptr;
          store_ds_transposed(ds_tile, ds, warp);
        }
        wgmma_p_b<kQueries / 16>(dk_acc, ds, q_tile, half * kQueries);
        if constexpr (fused_dq) {
          ptx::fence_proxy_async_shared();
          __syncthreads();  // the whole dS half is in
          float dq_part[kDsRows / 8][4];
          wgmma_ds_k(dq_part, ds_tile, k_tile, warp / 4);
          wgmma_wait_all(dv_acc, dk_acc, dq_part);
          pending_turn = add_dq_contribution<into_dqkv>(dq_part, dq_sums, dq_out, a, h, q0 + half * kQueries,
                                                           m.q_turn[kb * m.max_q + j], m.kv_count[qb]);
        } else {
          // now, not at the next half: P and dS in flight beside the next scores would spill registers
          wgmma_wait_all(dv_acc, dk_acc);
        }
      }
    }
    int next = items;
    if constexpr (fused_dq) {
      if (count == 0) take_next_ticket();
      __syncthreads();  // the last half's sums are in; every warp is done with the K and V tiles
      release_dq_turn(pending_turn);
    }
    if constexpr (persistent) {
      next = ticket;
      __syncthreads();  // every thread has read it before thread 0 takes the one after
      // the next item's K and V tiles (and its first Q, unless this item's last block did) while dk and
      // dv are stored
      if (reads_tiles(next)) {
        load_item_kv(next);
        if (count == 0) load_item_first_q(next, (use + count) % kStages);
      }
    }
    if constexpr (into_dqkv) {  // dv first: its registers are free for dk's norm
      const float2 shares = store_v_rows_into_dqkv(dv_acc, k0 + warp * 16, h, a.H, grad);
      const float sum_raw = block_sum(shares.x), sum_ve = block_sum(shares.y);  // in a fixed order
      if (threadIdx.x == 0) {
        grad.value_mix_partials[h * m.num_blocks + kb] = sum_raw;
        grad.value_mix_partials[(a.H + h) * m.num_blocks + kb] = sum_ve;
      }
      store_k_rows_into_dqkv(dk_acc, k0 + warp * 16, h, a.H, kAttentionScale, grad);
    } else {
      store_rows(dk, dk_acc, k0 + warp * 16, h, a.H, kAttentionScale, kAttentionScale);
      store_rows(dv, dv_acc, k0 + warp * 16, h, a.H, 1.0f, 1.0f);
    }
    use += count;
    item = next;
  }
}

template <typename Kernel>
void set_shared_memory(Kernel kernel, size_t bytes) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

}  // namespace flash

// A tensor the flash kernels access, and the alignment (bytes) its start needs: cp.async copies
// 16-byte pieces of q, k, v and dy (rows) and of lse and delta (the backward's 128 statistics at
// [h, 128 qb]); y, dq, dk and dv are written a bf16 pair (4 bytes) at a time, and the backward reads
// y four elements (8 bytes) at a time (delta). The rest is read or written an element at a time.
struct FlashAttentionOperand {
  const char* name;
  const void* start;
  unsigned alignment;
};
constexpr unsigned kFlashCopiedAlignment = 16, kFlashWrittenAlignment = 4;
constexpr unsigned kFlashDeltaAlignment = 8;  // y, read four elements at a time by attention_delta_kernel

// Refuses, naming the tensor, a misaligned start (the GPU would fault).
inline void check_flash_operands(std::initializer_list<FlashAttentionOperand> operands) {
  for (const FlashAttentionOperand& o : operands)
    if (reinterpret_cast<uintptr_t>(o.start) % o.alignment)
      throw std::invalid_argument(std::string("flash attention: ") + o.name + " must start " +
                                  std::to_string(o.alignment) + "-byte aligned");
}

// Refuses, naming the tensor, what would fault on the GPU (misaligned address) or compute garbage.
inline void check_flash_attention_shape(const AttentionTensors& a, const AttentionMask& mask,
                                        std::initializer_list<FlashAttentionOperand> operands) {
  static_assert(flash::kTile == kAttentionBlock, "a flash tile is one mask block");
  check_attention_shape(a, mask);
  if (a.q_stride % 8 || a.k_stride % 8 || a.v_stride % 8)
    throw std::invalid_argument("flash attention: row strides must be multiples of 8 elements (16-byte rows)");
  check_flash_operands(operands);
}

// y: [T, H, 128], lse: [H, T]
// The checks of both flash forwards.
inline void check_flash_attention_forward(const bf16* q, const bf16* k, const bf16* v, const bf16* y,
                                          const AttentionTensors& a, const AttentionMask& mask) {
  check_flash_attention_shape(a, mask,
                              {{"q", q, kFlashCopiedAlignment}, {"k", k, kFlashCopiedAlignment},
                               {"v", v, kFlashCopiedAlignment}, {"y", y, kFlashWrittenAlignment}});
}

inline void flash_attention_forward(const bf16* q, const bf16* k, const bf16* v, bf16* y, float* lse,
                                    const AttentionTensors& a, const AttentionMask& mask, cudaStream_t stream) {
  check_flash_attention_forward(q, k, v, y, a, mask);
  const size_t smem = flash::kForwardSharedBytes;  // one CTA per SM
  flash::set_shared_memory(flash::forward_kernel, smem);
  const int items = a.T / flash::kTile * a.H;
  CUDA_CHECK(launch_kernel(flash::forward_kernel, std::min(items, multiprocessor_count()), flash::kThreads, smem,
                           stream, q, k, v, y, lse, a, mask.device()));
}

// The warp-specialised forward (flash::forward_ws_kernel, `--attention flash-ws`): the same
// results as flash_attention_forward, its tiles copied by TMA (the maps made here, per call).
inline void flash_attention_forward_ws(const bf16* q, const bf16* k, const bf16* v, bf16* y, float* lse,
                                       const AttentionTensors& a, const AttentionMask& mask, cudaStream_t stream) {
  check_flash_attention_forward(q, k, v, y, a, mask);
  const uint64_t columns = uint64_t(a.H) * kAttentionHeadDim;
  auto map = [&](const char* name, const bf16* start, int64_t stride) {
    return bf16_tile_map(name, start, a.T, columns, stride, flash::kTile, flash::kTmaBoxColumns);
  };
  const CUtensorMap q_map = map("q", q, a.q_stride), k_map = map("k", k, a.k_stride), v_map = map("v", v, a.v_stride);
  const size_t smem = flash::kForwardSharedBytes;  // Q and two stages of K and V, as forward_kernel
  flash::set_shared_memory(flash::forward_ws_kernel, smem);
  const int items = a.T / flash::kTile * a.H;
  CUDA_CHECK(launch_kernel(flash::forward_ws_kernel, std::min(items, multiprocessor_count()), flash::kWsThreads, smem,
                           stream, q_map, k_map, v_map, y, lse, a, mask.device()));
}

// The fused backward's counters in the scratch, after delta and the dq sums: the ticket, then one
// turn counter per (head, 64 queries).
inline flash::DqPartialSums fused_backward_sums(float* scratch, const AttentionTensors& a) {
  const size_t statistics = size_t(a.H) * a.T;
  int* counters = reinterpret_cast<int*>(scratch + statistics * (1 + kAttentionHeadDim));
  return {scratch + statistics, counters, counters + 1};
}
inline int fused_backward_counter_count(const AttentionTensors& a) { return 1 + a.H * a.T / flash::kDsRows; }

// The checks of every flash backward (the inputs, and the outputs it names) and their first kernel:
// delta = rowsum(y dy) into the scratch's first [H, T] floats (attention_backward_scratch_floats(T, H)
// in all), the fused backward's counters zeroed on the way.
inline void flash_attention_backward_start(const bf16* q, const bf16* k, const bf16* v, const bf16* y, const bf16* dy,
                                           const float* lse, float* scratch,
                                           std::initializer_list<FlashAttentionOperand> outputs,
                                           const AttentionTensors& a, const AttentionMask& mask, cudaStream_t stream) {
  check_flash_attention_shape(a, mask,
                              {{"q", q, kFlashCopiedAlignment}, {"k", k, kFlashCopiedAlignment},
                               {"v", v, kFlashCopiedAlignment}, {"dy", dy, kFlashCopiedAlignment},
                               {"lse", lse, kFlashCopiedAlignment}, {"scratch", scratch, kFlashCopiedAlignment},
                               {"y", y, kFlashDeltaAlignment}});
  check_flash_operands(outputs);
  CUDA_CHECK(launch_kernel(attention_delta_kernel, attention_grid(a, 8), 256, 0, stream, y, dy, scratch, a.T, a.H,
                           fused_backward_sums(scratch, a).ticket, fused_backward_counter_count(a)));
}

// The fused backward's kernel, after flash_attention_backward_start (which zeroed its counters).
template <bool into_dqkv>
void launch_fused_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* dy, const float* lse,
                           float* scratch, bf16* dq, bf16* dk, bf16* dv, const flash::QkvGradient& grad,
                           const AttentionTensors& a, const AttentionMask& mask, cudaStream_t stream) {
  const flash::DqPartialSums sums = fused_backward_sums(scratch, a);
  const size_t smem = flash::kFusedBackwardSharedBytes;
  flash::set_shared_memory(flash::backward_dkv_kernel<true, into_dqkv>, smem);
  // into dq persistent, a CTA an SM (its shared memory allows one); into dqkv a CTA an item
  const int items = a.T / flash::kTile * a.H, ctas = into_dqkv ? items : std::min(items, multiprocessor_count());
  CUDA_CHECK(launch_kernel(flash::backward_dkv_kernel<true, into_dqkv>, ctas, flash::kThreads, smem, stream, q, k, v,
                           dy, lse, scratch, dq, dk, dv, sums, grad, a, mask.device()));
}

// The fused backward: one kernel computes, per (kv block, head), dk, dv and dq's contributions from
// one pass over the scores (5 products a tile); dq summed in a fixed order (DqPartialSums).
// scratch: attention_backward_scratch_floats(T, H); dq, dk, dv: [T, H, 128]
inline void flash_attention_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* y, const bf16* dy,
                                     const float* lse, float* scratch, bf16* dq, bf16* dk, bf16* dv,
                                     const AttentionTensors& a, const AttentionMask& mask, cudaStream_t stream) {
  flash_attention_backward_start(
      q, k, v, y, dy, lse, scratch,
      {{"dq", dq, kFlashWrittenAlignment}, {"dk", dk, kFlashWrittenAlignment}, {"dv", dv, kFlashWrittenAlignment}}, a,
      mask, stream);
  launch_fused_backward<false>(q, k, v, dy, lse, scratch, dq, dk, dv, flash::QkvGradient{}, a, mask, stream);
}

// The fused backward with the backward of the QK norm, RoPE and the value mix where it stores dq, dk
// and dv (`--qkv-backward fused`, flash::QkvGradient): dqkv [T, 3, H, 128] whole, what
// qk_norm_rope_backward and weighted_sum_backward make of dq, dk and dv, instead of them (dv too
// where grad.dv asks), and the mix's scalar gradients dsa0 += sum(dv v_raw), dsa1 += sum(dv ve)
// (with ve only; the CTAs' sums added in a fixed order).
inline void flash_attention_backward_into_dqkv(const bf16* q, const bf16* k, const bf16* v, const bf16* y,
                                               const bf16* dy, const float* lse, float* scratch, flash::QkvGradient grad,
                                               float* dsa0, float* dsa1, const AttentionTensors& a,
                                               const AttentionMask& mask, cudaStream_t stream) {
  if (!grad.qkv || !grad.cos_sin || !grad.sa0 || !grad.dqkv || !dsa0 || bool(grad.ve) != bool(dsa1))
    throw std::invalid_argument("flash attention into dqkv: qkv, the rope table, sa0, dqkv and dsa0 are required, and "
                                "dsa1 exactly with ve");
  // qkv, ve read and dqkv, dv written a bf16 pair at a time, the table 16 bytes (two pairs' angles) at a time
  flash_attention_backward_start(q, k, v, y, dy, lse, scratch,
                                 {{"qkv", grad.qkv, kFlashWrittenAlignment},
                                  {"rope table", grad.cos_sin, kFlashCopiedAlignment},
                                  {"ve", grad.ve, kFlashWrittenAlignment},
                                  {"dqkv", grad.dqkv, kFlashWrittenAlignment},
                                  {"dv", grad.dv, kFlashWrittenAlignment}},
                                 a, mask, stream);
  const int ctas = a.T / flash::kTile * a.H;
  grad.value_mix_partials = scratch + attention_backward_scratch_floats(a.T, a.H) - 2 * size_t(ctas);
  launch_fused_backward<true>(q, k, v, dy, lse, scratch, nullptr, nullptr, nullptr, grad, a, mask, stream);
  add_scalar_gradients(grad.value_mix_partials, ctas, dsa0, dsa1, nullptr, stream);
}

// The backward as two kernels that each recompute the scores (`--attention flash-split`): dq per
// query block, dk and dv per kv block. scratch as above (only delta is used).
inline void flash_attention_backward_split(const bf16* q, const bf16* k, const bf16* v, const bf16* y,
                                           const bf16* dy, const float* lse, float* scratch, bf16* dq, bf16* dk,
                                           bf16* dv, const AttentionTensors& a, const AttentionMask& mask,
                                           cudaStream_t stream) {
  flash_attention_backward_start(
      q, k, v, y, dy, lse, scratch,
      {{"dq", dq, kFlashWrittenAlignment}, {"dk", dk, kFlashWrittenAlignment}, {"dv", dv, kFlashWrittenAlignment}}, a,
      mask, stream);
  const size_t smem = flash::kBackwardSharedBytes;
  const dim3 grid(a.T / flash::kTile, a.H);
  flash::set_shared_memory(flash::backward_dq_kernel, smem);
  CUDA_CHECK(launch_kernel(flash::backward_dq_kernel, grid, flash::kThreads, smem, stream, q, k, v, dy, lse, scratch,
                           dq, a, mask.device()));
  flash::set_shared_memory(flash::backward_dkv_kernel<false>, smem);
  CUDA_CHECK(launch_kernel(flash::backward_dkv_kernel<false>, grid, flash::kThreads, smem, stream, q, k, v, dy, lse,
                           scratch, nullptr, dk, dv, flash::DqPartialSums{}, flash::QkvGradient{}, a, mask.device()));
}
