// What the emulator's CUDA threads (threads.cpp) and its runtime API (cuda_runtime.cpp) share.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

namespace emu {

// Few SMs: a persistent grid (the flash forward's, one CTA per SM) then walks several items per CTA
// at the tests' shapes, as it does on a GPU at the record's. A launch's blocks run this many at a
// time, one an SM (threads.cpp).
constexpr int kEmulatedMultiprocessors = 8;

[[noreturn]] void fatal(const std::string& what);  // "CUDA emulator: what" on stderr, then abort

void record_launch_error(cudaError_t error);
size_t max_dynamic_shared_bytes(const void* kernel);  // 48 KiB unless cudaFuncSetAttribute raised it
// The most static shared memory a block of `kernel` with `dynamic_bytes` of dynamic shared memory
// may have beside it: 48 KiB in all, or, once cudaFuncSetAttribute set the kernel's dynamic limit,
// 227 KiB with that limit (the GPU refuses the attribute or the launch past these); and never
// more than 48 KiB (ptxas's limit on static shared memory).
size_t static_shared_budget(const void* kernel, size_t dynamic_bytes);

// What the emulated cuTensorMapEncodeTiled writes into a CUtensorMap's 128 opaque bytes (ranks 1-3,
// element strides 1, no interleave: what the kernels use), and the TMA copies read back.
struct EmulatedTensorMap {
  static constexpr uint64_t kMagic = 0x50414d524f534e45;  // "ENSORMAP"
  uint64_t magic;
  const unsigned char* base;
  uint32_t rank, element_bytes, swizzle_bytes;  // swizzle_bytes: 0 (none), 32, 64 or 128
  uint32_t box[3];
  uint64_t dims[3], strides[3];  // strides in bytes; strides[0] is the element size
};

}  // namespace emu
