// kernels/ptx.cuh for the CPU emulator: each instruction as PTX documents it, the warp's lanes
// meeting through emu::warp_collective as the .sync forms require.
#pragma once
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ptx {

// A failed launch (a trap on the GPU, which names nothing): the program stops, naming the wait.
[[noreturn]] inline void fail_launch(const char* what) {
  std::fprintf(stderr, "CUDA emulator: a kernel failed its launch (a trap on the GPU): %s\n", what);
  std::abort();
}

// The emulator's clock stands still: it names a wait that can never end as a deadlock, at once and
// exactly (threads.cpp), so a wait bounded by this clock never fails here however slowly the
// emulated threads around it run (the GPU's tests check the bound: test_device).
inline uint32_t global_timer_us() { return 0; }

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

// ex2.approx.ftz.f32: 2^x with subnormal inputs and results flushed to (signed) zero; std::exp2 is
// exact where the GPU's approximation is within 2 ulp.
inline float exp2_ftz(float x) {
  if (std::fpclassify(x) == FP_SUBNORMAL) x = std::copysign(0.0f, x);
  const float y = std::exp2(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;
}

// rcp.approx.ftz.f32: 1/x with subnormal inputs and results flushed to (signed) zero; exact here
// where the GPU's approximation is within 1 ulp.
inline float rcp_ftz(float x) {
  if (std::fpclassify(x) == FP_SUBNORMAL) x = std::copysign(0.0f, x);
  const float y = 1.0f / x;
  return std::fpclassify(y) == FP_SUBNORMAL ? std::copysign(0.0f, y) : y;
}

// griddepcontrol: the emulator runs a stream's kernels one after another, so the previous kernel
// has always completed; the wait marks where the thread may touch memory (a thread of a launch with
// programmatic dependent launch that touches it before, or exits without waiting, stops the test),
// and letting the next kernel launch early changes nothing here.
inline void griddepcontrol_wait() { ::emu::grid_dependency_wait(); }
inline void griddepcontrol_launch_dependents() {}

// prefetch.global.L2: a hint about caches, which the emulator has none of.
inline void prefetch_l2(const void*) {}

inline uint32_t shared_address(const void* p) { return ::emu::shared_window_address(p); }

// Fences order what the GPU may reorder; the emulator runs in program order but checks that the
// proxy and wgmma fences are there (cuda_emulator.h).
inline void fence_proxy_async_shared() { ::emu::proxy_async_fence(); }
inline void wgmma_fence() { ::emu::wgmma_fence(); }
inline void fence_operand(float&) {}
inline void fence_operand(uint32_t&) {}

inline void wgmma_commit() { ::emu::wgmma_commit(); }

template <int pending_groups_left>
void wgmma_wait() {
  ::emu::wgmma_wait(pending_groups_left);
}

[[noreturn]] inline void wgmma_fatal(const char* what) {
  std::fprintf(stderr, "CUDA emulator: wgmma: %s\n", what);
  std::abort();
}

// A shared-memory matrix descriptor (128-byte swizzling, the only mode the kernels use), decoded as
// PTX's canonical layouts define it: offsets are added to the start address and the swizzle acts
// on the resulting address, XORing its bits 4-6 (the 16-byte chunk) with bits 7-9 (the row of
// the 1024-byte atom).
struct SharedMatrix {
  explicit SharedMatrix(uint64_t desc)
      : start(uint32_t(desc & 0x3FFF) << 4),
        leading(uint32_t(desc >> 16 & 0x3FFF) << 4),
        stride(uint32_t(desc >> 32 & 0x3FFF) << 4),
        window(::emu::dynamic_shared_window()) {
    if (desc >> 62 != 1) wgmma_fatal("a descriptor without 128-byte swizzling");
    if ((desc >> 49 & 7) != 0) wgmma_fatal("a descriptor with a base offset (the kernels align their atoms)");
  }
  // The `bytes` at `offset`, within one 16-byte chunk (which the swizzle moves whole), read once
  // the window and the async proxy's view of them are checked.
  const unsigned char* chunk(uint32_t offset, uint32_t bytes) const {
    uint32_t address = start + offset;
    if ((address & 15) + bytes > 16) wgmma_fatal("an operand read across a 16-byte chunk (an emulator error)");
    address ^= (address >> 7 & 7) << 4;
    const uint32_t byte = address - ::emu::kDynamicSharedWindowBase;  // wraps below the window
    if (address < ::emu::kDynamicSharedWindowBase || byte + bytes > window.bytes)
      wgmma_fatal("a descriptor addresses memory outside the dynamic shared memory");
    ::emu::check_async_proxy_read(window, byte, bytes, "a wgmma operand");
    return window.data + byte;
  }
  // `count` bf16 values from `offset` on, as floats.
  void read(uint32_t offset, int count, float* out) const {
    uint16_t bits[8];
    std::memcpy(bits, chunk(offset, uint32_t(count) * 2), size_t(count) * 2);
    for (int i = 0; i < count; ++i) out[i] = bf16_bits_to_float(bits[i]);
  }
  // K-major: 8-row groups `stride` apart, rows of 128 bytes, k contiguous (k 0-7 and 8-15: one
  // chunk each).
  void k_major_row(int row, float (&out)[16]) const {
    const uint32_t offset = row / 8 * stride + row % 8 * 128;
    read(offset, 8, out);
    read(offset + 16, 8, out + 8);
  }
  // MN-major: 64 contiguous elements of MN per 128-byte row, k rows 128 bytes apart, 8-row groups
  // of k `stride` apart, groups of 64 MN `leading` apart. Elements mn and mn + 1 (mn even) of row k.
  void mn_major_pair(int mn, int k, float (&out)[2]) const {
    read(mn / 64 * leading + mn % 64 * 2 + k / 8 * stride + k % 8 * 128, 2, out);
  }
  uint32_t start, leading, stride;
  ::emu::SharedWindow window;
};

// The thread's rows of the 64-row product: warp w of the warpgroup holds rows 16 w + lane / 4 and
// that + 8 (the m16n8 accumulator layout, repeated over N / 8 column tiles).
inline int linear_thread() { return ::emu::position().linear_index(); }
inline int wgmma_first_row() { return linear_thread() / 32 % 4 * 16 + linear_thread() % 32 / 4; }

// d[64 x N] (this thread's N / 8 x 4 elements) = A[64 x 16] B[16 x N] (+ d), B from its descriptor.
// The thread's 2 N / 8 columns of B are read once, then serve both of its rows.
template <int trans_b, int tiles>
void wgmma_product_into(float (&d)[tiles][4], const float (&a)[2][16], uint64_t desc_b, bool accumulate) {
  const SharedMatrix b(desc_b);
  const int t = linear_thread() % 4;
  float columns[tiles][2][16];
  for (int n = 0; n < tiles; ++n) {
    const int col = 8 * n + 2 * t;
    if (trans_b) {
      for (int k = 0; k < 16; ++k) {
        float pair[2];
        b.mn_major_pair(col, k, pair);
        columns[n][0][k] = pair[0];
        columns[n][1][k] = pair[1];
      }
    } else {
      b.k_major_row(col, columns[n][0]);
      b.k_major_row(col + 1, columns[n][1]);
    }
  }
  for (int n = 0; n < tiles; ++n)
    for (int e = 0; e < 4; ++e) {
      float sum = 0;
      for (int k = 0; k < 16; ++k) sum += a[e / 2][k] * columns[n][e & 1][k];
      d[n][e] = accumulate ? d[n][e] + sum : sum;
    }
}

// wgmma.mma_async.m64nNk16.f32.bf16.bf16 with A from shared memory (K-major).
template <int trans_b, int tiles>
void wgmma_ss(float (&d)[tiles][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  ::emu::check_tma_visible(SharedMatrix(desc_a).start, "wgmma's A");
  ::emu::check_tma_visible(SharedMatrix(desc_b).start, "wgmma's B");
  const int row = wgmma_first_row();
  ::emu::wgmma_issue([&d, desc_a, desc_b, accumulate, row] {
    const SharedMatrix a(desc_a);
    float rows[2][16];
    for (int r = 0; r < 2; ++r) a.k_major_row(row + 8 * r, rows[r]);
    wgmma_product_into<trans_b>(d, rows, desc_b, accumulate);
  });
}

template <int trans_b>
void wgmma_m64n128k16_ss(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  wgmma_ss<trans_b>(d, desc_a, desc_b, accumulate);
}

template <int trans_b>
void wgmma_m64n256k16_ss(float (&d)[32][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  wgmma_ss<trans_b>(d, desc_a, desc_b, accumulate);
}

template <int trans_b>
void wgmma_m64n64k16_ss(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  wgmma_ss<trans_b>(d, desc_a, desc_b, accumulate);
}

// The m64n128k16 product with A from registers: the m16n8k16 A fragment of the warp's 16 rows
// (read at the issue).
template <int trans_b>
void wgmma_m64n128k16_rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
  uint32_t all[32][4];
  ::emu::warp_exchange("wgmma.m64n128k16 A fragment", a, all, sizeof a);
  const int g = linear_thread() % 32 / 4;
  float rows[2][16];
  for (int t = 0; t < 4; ++t)
    for (int half = 0; half < 2; ++half) {
      const uint32_t* f = all[4 * g + t];
      rows[0][2 * t + half] = bf16_bits_to_float(uint16_t(f[0] >> (16 * half)));
      rows[1][2 * t + half] = bf16_bits_to_float(uint16_t(f[1] >> (16 * half)));
      rows[0][2 * t + 8 + half] = bf16_bits_to_float(uint16_t(f[2] >> (16 * half)));
      rows[1][2 * t + 8 + half] = bf16_bits_to_float(uint16_t(f[3] >> (16 * half)));
    }
  ::emu::check_tma_visible(SharedMatrix(desc_b).start, "wgmma's B");
  ::emu::wgmma_issue([&d, rows, desc_b, accumulate] { wgmma_product_into<trans_b>(d, rows, desc_b, accumulate); });
}

// stmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16: the lanes meet; lane 8 m + i writes row i of
// matrix m: element j of it is element (i, j) of the fragment, or with .trans (j, i), where element
// (r, c) is lane 4 r + c / 2's register m, its half c % 2.
template <bool trans>
void stmatrix_x4(void* row, uint32_t m0, uint32_t m1, uint32_t m2, uint32_t m3) {
  require_aligned(row, "stmatrix row address");
  shared_address(row);  // aborts unless the row is in shared memory
  const uint32_t mine[4] = {m0, m1, m2, m3};
  uint32_t all[32][4];
  ::emu::warp_exchange(trans ? "stmatrix.x4.trans" : "stmatrix.x4", mine, all, sizeof mine);
  const int lane = linear_thread() % 32, m = lane / 8, i = lane % 8;
  uint16_t values[8];
  for (int j = 0; j < 8; ++j) {
    const int r = trans ? j : i, c = trans ? i : j;
    values[j] = uint16_t(all[4 * r + c / 2][m] >> (16 * (c % 2)));
  }
  std::memcpy(row, values, sizeof values);
}

// ---- mbarriers, TMA copies, named barriers, registers: cuda_emulator.h says what each checks ----
inline void mbarrier_init(uint64_t* barrier, uint32_t count) { ::emu::mbarrier_init(barrier, count); }
inline void fence_mbarrier_init() { ::emu::fence_mbarrier_init(); }
inline void mbarrier_arrive(uint64_t* barrier) { ::emu::mbarrier_arrive(barrier, 0); }
inline void mbarrier_arrive_expect_tx(uint64_t* barrier, uint32_t bytes) { ::emu::mbarrier_arrive(barrier, bytes); }
inline bool mbarrier_try_wait(uint64_t* barrier, uint32_t parity) { return ::emu::mbarrier_try_wait(barrier, parity); }
inline void tma_load_2d(void* shared, const void* map, int x, int y, uint64_t* barrier) {
  const int coordinates[2] = {x, y};
  ::emu::tma_load(shared, map, coordinates, 2, barrier);
}
inline void tma_store_2d(const void* map, int x, int y, const void* shared) {
  const int coordinates[2] = {x, y};
  ::emu::tma_store(shared, map, coordinates, 2);
}
inline void bulk_commit_group() { ::emu::bulk_commit(); }
template <int pending_groups_left>
void bulk_wait_group_read() {
  ::emu::bulk_wait(pending_groups_left);
}
template <int pending_groups_left>
void bulk_wait_group() {
  ::emu::bulk_wait(pending_groups_left);
}
inline void named_barrier_sync(int id, int threads) { ::emu::named_barrier(id, threads, true); }
inline void named_barrier_arrive(int id, int threads) { ::emu::named_barrier(id, threads, false); }
template <int registers>
void setmaxnreg_dec() {
  ::emu::set_max_registers(registers, false);
}
template <int registers>
void setmaxnreg_inc() {
  ::emu::set_max_registers(registers, true);
}

}  // namespace ptx
