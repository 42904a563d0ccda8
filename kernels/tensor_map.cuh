// TMA tensor maps (the descriptors ptx::tma_load_2d copies through), made on the host with the
// driver's cuTensorMapEncodeTiled. The driver entry point comes through the runtime
// (cudaGetDriverEntryPointByVersion), so nothing links libcuda; the CPU emulator stands in for
// both (tests/emulator/cuda_runtime.cpp).
#pragma once
#include "kernels/host/cuda_check.cuh"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

// The 2-D map of a bf16 matrix [rows, cols] whose rows start `row_stride` elements apart, copied
// in boxes of [box_rows][box_cols] into shared memory in the 128-byte swizzle of wgmma's operands
// (box_cols * 2 = 128 bytes: a box is box_rows rows of 128 bytes, 16-byte chunk c of row r stored
// at c ^ (r % 8)). Elements outside the matrix read as zeros. `name` says which tensor in an error.
inline CUtensorMap bf16_tile_map(const char* name, const __nv_bfloat16* base, uint64_t rows, uint64_t cols,
                                 uint64_t row_stride, uint32_t box_rows, uint32_t box_cols) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &entry, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || !entry)
      throw std::runtime_error("the CUDA driver has no cuTensorMapEncodeTiled (TMA needs driver 12.0 or newer)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(entry);
  }();
  // Encoded into a local, not the returned object: the driver wants 64-byte alignment, and g++
  // built the return value 32 bytes off it (the emulator's build, CUtensorMap's alignas(128) notwithstanding).
  alignas(128) CUtensorMap encoded;
  const cuuint64_t dims[2] = {cols, rows}, strides[1] = {row_stride * sizeof(__nv_bfloat16)};
  const cuuint32_t box[2] = {box_cols, box_rows}, element_strides[2] = {1, 1};
  const CUresult result =
      encode(&encoded, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<__nv_bfloat16*>(base), dims, strides, box,
             element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS)
    throw std::invalid_argument(std::string("TMA map of ") + name + ": cuTensorMapEncodeTiled refused it (CUresult " +
                                std::to_string(int(result)) + "): the start must be 16-byte aligned, rows a " +
                                "multiple of 16 bytes apart, the box at most 256 rows of 128 bytes");
  CUtensorMap map;
  std::memcpy(&map, &encoded, sizeof map);
  return map;
}
