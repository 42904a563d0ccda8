// The attention's input projection with what follows it in one pass (issue 29, `--qkv fused`): our
// GEMM (gemm_epilogue.cuh) computes qkv = h W_qkv^T and its epilogue writes, from the same
// accumulators, the raw qkv (bf16, which the backward reads) and beside it what
// qk_norm_rope_forward and weighted_sum_forward make of it: q and k RMS-normalised per head and
// rotated (rope.cuh), and v = sa0 v_raw + sa1 ve. The two passes that read qkv back (and ve) go.
//
// Why it fits one tile: qkv is [T, 3, H, 128] and a 256-column tile holds two whole heads of q, k or
// v of its rows (d = H 128 a multiple of 256). A consumer thread holds, for each of its two rows,
// columns 8n + 2 (lane % 4) + {0, 1}: a head's 128 columns of a row sit in the 4 threads of a quad
// (the norm's sum of squares is two shuffles), and RoPE's pairs (j, j + 64) in the same thread
// (n and n + 8). The arithmetic is the passes': the norm of the bf16-rounded values in fp32, the
// rotation without a rounding in between, the sum of squares in another order (not bitwise theirs).
#pragma once
#include "kernels/gemm_epilogue.cuh"
#include "kernels/norms.cuh"
#include "kernels/residual.cuh"
#include "kernels/rope.cuh"

#include <stdexcept>
#include <string>

struct QkvEpilogue {
  bf16 *q, *k, *v;           // [T, d] each
  const float* cos_sin;      // [T, 64, 2] (rope_table_host)
  const float *sa0, *sa1;    // the value mix's device scalars
  const bf16* ve;            // [T, d] value embedding, or null (no y term)
  int d;
  float eps;

  void check() const {
    if (d <= 0 || d % gemm_epilogue::kTileCols)
      throw std::invalid_argument("qkv with its epilogue: d = " + std::to_string(d) + " must be a multiple of " +
                                  std::to_string(gemm_epilogue::kTileCols) + " (a tile holds whole heads of one of q, k, v)");
    if (!q || !k || !v || !cos_sin || !sa0 || (ve && !sa1))
      throw std::invalid_argument("qkv with its epilogue: q, k, v, the rope table and the mix's scalars are required");
    for (const void* p : {(const void*)q, (const void*)k, (const void*)v, (const void*)ve})
      if (reinterpret_cast<uintptr_t>(p) % 4)
        throw std::invalid_argument("qkv with its epilogue: q, k, v and ve must start 4-byte aligned (bf16 pairs)");
    if (reinterpret_cast<uintptr_t>(cos_sin) % 16)
      throw std::invalid_argument("qkv with its epilogue: the rope table must start 16-byte aligned");
  }

  // At the tile's start: the rows of ve a v tile mixes in, or the rope table's rotated half of the
  // rows a q or k tile turns (256 bytes of each, 2 threads a row).
  __device__ void prefetch(const gemm_epilogue::TileOutput& out) const {
    const int which = out.col0 / d;
    if (which == 2) {
      if (ve) gemm_epilogue::prefetch_part(ve, gemm_epilogue::TileOutput{nullptr, out.row0, out.col0 - 2 * d, d});
      return;
    }
    const int row = threadIdx.x % 128 / 2;
    ptx::prefetch_l2(cos_sin + size_t(out.row0 + row) * kRopeHeadDim + threadIdx.x % 2 * 32);
  }

  __device__ void store(float (&acc)[gemm_epilogue::kTileCols / 8][4], const gemm_epilogue::TileOutput& out) const {
    constexpr int kN = gemm_epilogue::kTileCols / 8, kHeadN = kRopeHeadDim / 8;  // n-tiles: the tile's, a head's
    const int which = out.col0 / d, out_col0 = out.col0 - which * d;            // q 0, k 1, v 2
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[n][e] = round_to_bf16(acc[n][e]);  // the raw qkv, as stored
    gemm_epilogue::Identity{}.store(acc, out);
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // the thread's rows: fragment_row(0) and fragment_row(2)
      const int t = out.row0 + wgmma_tiles::warpgroup_fragment_row(2 * half);
      const size_t row_start = size_t(t) * d + out_col0;  // in q, k or v
      if (which == 2) {  // v = sa0 v_raw + sa1 ve
        const float alpha = *sa0, beta = ve ? *sa1 : 0.0f;
#pragma unroll
        for (int n = 0; n < kN; ++n) {
          const size_t at = row_start + wgmma_tiles::fragment_col(n, 0);
          float y0 = 0.0f, y1 = 0.0f;
          if (ve) {
            const __nv_bfloat162 pair = *reinterpret_cast<const __nv_bfloat162*>(ve + at);
            y0 = __low2float(pair), y1 = __high2float(pair);
          }
          *reinterpret_cast<uint32_t*>(v + at) = wgmma_tiles::pack_bf16(weighted(alpha, acc[n][2 * half], beta, y0),
                                                                         weighted(alpha, acc[n][2 * half + 1], beta, y1));
        }
        continue;
      }
      bf16* dst = which == 0 ? q : k;
      const float* angles_t = cos_sin + size_t(t) * kRopeHeadDim;
#pragma unroll
      for (int head = 0; head < 2; ++head) {
        float ss = 0;
#pragma unroll
        for (int n = head * kHeadN; n < (head + 1) * kHeadN; ++n)
          ss += acc[n][2 * half] * acc[n][2 * half] + acc[n][2 * half + 1] * acc[n][2 * half + 1];
        ss += __shfl_xor_sync(0xffffffffu, ss, 1);  // the quad holds the head's row
        ss += __shfl_xor_sync(0xffffffffu, ss, 2);
        const float inv = rsqrtf(ss / kRopeHeadDim + eps);
#pragma unroll
        for (int n = head * kHeadN; n < (head + 1) * kHeadN; ++n) {
          acc[n][2 * half] *= inv;
          acc[n][2 * half + 1] *= inv;
        }
        // pairs j = 8 n' + 2 (lane % 4) + {0, 1} with j + 64 (n' + 8); only j < 32 turn (the table
        // holds cos 1, sin 0 beyond: the pass's identity, up to the sign of a zero)
#pragma unroll
        for (int np = 0; np < kHeadN / 4; ++np) {
          const int n1 = head * kHeadN + np, n2 = n1 + kHeadN / 2;
          const float4 cs = *reinterpret_cast<const float4*>(angles_t + 2 * wgmma_tiles::fragment_col(np, 0));
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float c_ = e ? cs.z : cs.x, s_ = e ? cs.w : cs.y;
            const float x1 = acc[n1][2 * half + e], x2 = acc[n2][2 * half + e];
            acc[n1][2 * half + e] = x1 * c_ + x2 * s_;
            acc[n2][2 * half + e] = -x1 * s_ + x2 * c_;
          }
        }
      }
#pragma unroll
      for (int n = 0; n < kN; ++n)
        *reinterpret_cast<uint32_t*>(dst + row_start + wgmma_tiles::fragment_col(n, 0)) =
            wgmma_tiles::pack_bf16(acc[n][2 * half], acc[n][2 * half + 1]);
    }
  }
};

// qkv [T, 3d] = h [T, d] W_qkv^T (W_qkv [3d, d]) and, in the same pass, q and k [T, d] normalised and
// rotated as qk_norm_rope_forward makes them and v [T, d] = sa0 v_raw + sa1 ve as weighted_sum_forward
// (ve null: v = sa0 v_raw). T a multiple of 128, d of 256.
inline void matmul_qkv_norm_rope(const bf16* h, const bf16* w_qkv, bf16* qkv, bf16* q, bf16* k, bf16* v,
                                 const float* cos_sin, const float* sa0, const bf16* ve, const float* sa1, int T, int d,
                                 cudaStream_t stream, float eps = kRmsEps) {
  gemm_epilogue::gemm<gemm_epilogue::BLayout::k_major>(h, w_qkv, qkv, T, 3 * d, d,
                                                        QkvEpilogue{q, k, v, cos_sin, sa0, sa1, ve, d, eps}, stream);
}
