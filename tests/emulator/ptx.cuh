// kernels/ptx.cuh for the CPU emulator: each instruction as PTX documents it, the warp's lanes
// meeting through emu::warp_collective as the .sync forms require.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ptx {

inline void require_aligned(const void* p, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 16) {
    std::fprintf(stderr, "CUDA emulator: %s: address %p is not 16-byte aligned (misaligned address)\n", what, p);
    std::abort();
  }
}

inline void cp_async_16(void* shared, const void* global) {
  require_aligned(shared, "cp.async shared destination");
  require_aligned(global, "cp.async global source");
  ::emu::async_copy(shared, global, 16);
}

inline void cp_async_commit() { ::emu::async_copy_commit(); }

template <int pending_groups_left>
void cp_async_wait_group() {
  ::emu::async_copy_wait(pending_groups_left);
}

inline float bf16_bits_to_float(uint16_t bits) {
  uint32_t word = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &word, 4);
  return f;
}

inline uint32_t pair(const uint16_t* row, int col) { return uint32_t(row[col]) | uint32_t(row[col + 1]) << 16; }

// ldmatrix: lane l's input is its row address; output register i is matrix i's pair at row
// l / 4, columns 2 (l % 4) + {0, 1}, or with `trans` the pair at rows 2 (l % 4) + {0, 1}, column l / 4.
template <bool trans>
void ldmatrix_combine(const void* inputs, void* outputs) {
  const auto* rows = static_cast<const uint16_t* const*>(inputs);
  auto* r = static_cast<uint32_t(*)[4]>(outputs);
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      if (trans) {
        const int first = 8 * i + 2 * (lane % 4);
        r[lane][i] = uint32_t(rows[first][lane / 4]) | uint32_t(rows[first + 1][lane / 4]) << 16;
      } else {
        r[lane][i] = pair(rows[8 * i + lane / 4], 2 * (lane % 4));
      }
    }
}

inline void ldmatrix_x4(uint32_t r[4], const void* row) {
  require_aligned(row, "ldmatrix row");
  ::emu::warp_collective("ldmatrix.x4", &row, sizeof row, r, 4 * sizeof(uint32_t), ldmatrix_combine<false>);
}

inline void ldmatrix_x4_trans(uint32_t r[4], const void* row) {
  require_aligned(row, "ldmatrix row");
  ::emu::warp_collective("ldmatrix.x4.trans", &row, sizeof row, r, 4 * sizeof(uint32_t), ldmatrix_combine<true>);
}

struct MmaFragments {
  uint32_t a[4], b[2];
};

// The 16 x 8 product from the fragments of every lane; lane l's output is its four elements of it.
inline void mma_combine(const void* inputs, void* outputs) {
  const auto* in = static_cast<const MmaFragments*>(inputs);
  float A[16][16], B[16][8];  // low half of a register = the lower column (A) or row (B)
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    for (int half = 0; half < 2; ++half) {
      A[g][2 * t + half] = bf16_bits_to_float(uint16_t(in[l].a[0] >> (16 * half)));
      A[g + 8][2 * t + half] = bf16_bits_to_float(uint16_t(in[l].a[1] >> (16 * half)));
      A[g][2 * t + 8 + half] = bf16_bits_to_float(uint16_t(in[l].a[2] >> (16 * half)));
      A[g + 8][2 * t + 8 + half] = bf16_bits_to_float(uint16_t(in[l].a[3] >> (16 * half)));
      B[2 * t + half][g] = bf16_bits_to_float(uint16_t(in[l].b[0] >> (16 * half)));
      B[2 * t + 8 + half][g] = bf16_bits_to_float(uint16_t(in[l].b[1] >> (16 * half)));
    }
  }
  auto* d = static_cast<float(*)[4]>(outputs);
  for (int l = 0; l < 32; ++l)
    for (int e = 0; e < 4; ++e) {
      const int row = l / 4 + (e >= 2 ? 8 : 0), col = 2 * (l % 4) + (e & 1);
      float sum = 0;
      for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
      d[l][e] = sum;
    }
}

inline void mma_bf16_16x8x16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  const MmaFragments mine = {{a[0], a[1], a[2], a[3]}, {b0, b1}};
  float product[4];
  ::emu::warp_collective("mma.m16n8k16", &mine, sizeof mine, product, sizeof product, mma_combine);
  for (int e = 0; e < 4; ++e) c[e] += product[e];
}

}  // namespace ptx
