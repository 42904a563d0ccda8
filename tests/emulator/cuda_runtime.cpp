// The CUDA runtime API calls the trainer and the tests make, on host memory: every call completes
// before it returns, so streams and events need no queue. Device allocations are poisoned (0xFF:
// NaN in fp32 and bf16), as fresh GPU memory holds whatever was there before; the device reports
// itself as an H100 (sm_90, 132 SMs).
#include "emulator/cuda_emulator.h"
#include "emulator/runtime.h"

#include <cuda.h>
#include <cuda_profiler_api.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace emu {
namespace {

constexpr size_t kDefaultDynamicShared = 48 << 10, kMaxDynamicShared = 227 << 10;
constexpr size_t kDeviceBytes = size_t(80) << 30;

std::mutex registry_mutex;
std::map<const void*, size_t> allocations;        // device pointer -> bytes
std::map<const void*, size_t> shared_limits;      // kernel -> dynamic shared memory bytes allowed
thread_local cudaError_t last_error = cudaSuccess;

struct Event {
  std::chrono::steady_clock::time_point recorded;
};

cudaError_t allocate(void** p, size_t bytes, bool device) {
  *p = std::aligned_alloc(256, (std::max<size_t>(bytes, 1) + 255) / 256 * 256);
  if (!*p) return cudaErrorMemoryAllocation;
  if (device) {
    std::memset(*p, 0xFF, bytes);
    std::lock_guard<std::mutex> lock(registry_mutex);
    allocations[*p] = bytes;
  }
  return cudaSuccess;
}

}  // namespace

void record_launch_error(cudaError_t error) { last_error = error; }

size_t max_dynamic_shared_bytes(const void* kernel) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = shared_limits.find(kernel);
  return it == shared_limits.end() ? kDefaultDynamicShared : it->second;
}

size_t static_shared_budget(const void* kernel, size_t dynamic_bytes) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = shared_limits.find(kernel);
  const size_t left = it == shared_limits.end() ? kDefaultDynamicShared - dynamic_bytes : kMaxDynamicShared - it->second;
  return std::min(left, kDefaultDynamicShared);
}

}  // namespace emu

using namespace emu;

cudaError_t cudaMalloc(void** p, size_t bytes) { return allocate(p, bytes, true); }
cudaError_t cudaMallocHost(void** p, size_t bytes) { return allocate(p, bytes, false); }
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) { return allocate(p, bytes, false); }
cudaError_t cudaFreeHost(void* p) {
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    if (allocations.erase(p) == 0) return cudaErrorInvalidValue;
  }
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  size_t used = 0;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    for (auto& [p, bytes] : allocations) used += bytes;
  }
  *total = kDeviceBytes;
  *free = used < kDeviceBytes ? kDeviceBytes - used : 0;
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  if (bytes) std::memmove(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t) {
  return cudaMemcpy(dst, src, bytes, kind);
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) { return cudaMemset(p, value, bytes); }

// Streams are distinct handles that order nothing: every call has finished when it returns.
// Events keep the host time of their last record, for cudaEventElapsedTime.
template <typename Handle, typename Object>
cudaError_t create(Handle* handle, Object initial) {
  *handle = reinterpret_cast<Handle>(new Object(initial));
  return cudaSuccess;
}
template <typename Object, typename Handle>
cudaError_t destroy(Handle handle) {
  delete reinterpret_cast<Object*>(handle);
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) { return create(s, char{}); }
cudaError_t cudaStreamCreate(cudaStream_t* s) { return create(s, char{}); }
cudaError_t cudaStreamDestroy(cudaStream_t s) { return destroy<char>(s); }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned) { return cudaSuccess; }
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
// No profiler attaches to the emulator: the range's edges are accepted and mark nothing.
cudaError_t cudaProfilerStart() { return cudaSuccess; }
cudaError_t cudaProfilerStop() { return cudaSuccess; }

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) { return create(e, Event{}); }
cudaError_t cudaEventCreate(cudaEvent_t* e) { return create(e, Event{}); }
cudaError_t cudaEventDestroy(cudaEvent_t e) { return destroy<Event>(e); }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) {
  reinterpret_cast<Event*>(e)->recorded = std::chrono::steady_clock::now();
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  *ms = std::chrono::duration<float, std::milli>(reinterpret_cast<Event*>(end)->recorded -
                                                 reinterpret_cast<Event*>(start)->recorded)
            .count();
  return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
// Few SMs: a persistent grid (the flash forward's, one CTA per SM) then walks several items per CTA
// at the tests' shapes, as it does on a GPU at the record's.
constexpr int kEmulatedMultiprocessors = 8;

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  *prop = cudaDeviceProp{};
  std::strcpy(prop->name, "CUDA emulator (H100-like)");
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = kEmulatedMultiprocessors;
  prop->totalGlobalMem = kDeviceBytes;
  prop->sharedMemPerBlock = kDefaultDynamicShared;
  prop->sharedMemPerBlockOptin = kMaxDynamicShared;
  prop->maxThreadsPerBlock = 1024;
  prop->warpSize = 32;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  if (attribute != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;  // the only one asked
  *value = kEmulatedMultiprocessors;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* version) {
  *version = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int* version) {
  *version = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void* kernel, cudaFuncAttribute attribute, int value) {
  if (attribute != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;
  if (value < 0 || size_t(value) > kMaxDynamicShared) return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(registry_mutex);
  shared_limits[kernel] = size_t(value);
  return cudaSuccess;
}

// The driver's cuTensorMapEncodeTiled as its documentation bounds it (what the driver refuses, this
// refuses with the same CUDA_ERROR_INVALID_VALUE), for the ranks and options the emulator's TMA
// copies implement (threads.cpp); it writes an EmulatedTensorMap.
static CUresult emulated_tensor_map_encode_tiled(CUtensorMap* tensor_map, CUtensorMapDataType type, cuuint32_t rank,
                                          void* address, const cuuint64_t* dims, const cuuint64_t* strides,
                                          const cuuint32_t* box, const cuuint32_t* element_strides,
                                          CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                          CUtensorMapL2promotion, CUtensorMapFloatOOBfill) {
  static_assert(sizeof(EmulatedTensorMap) <= sizeof(CUtensorMap), "the emulated map fits the opaque one");
  uint32_t element_bytes = 0;
  switch (type) {
    case CU_TENSOR_MAP_DATA_TYPE_UINT8: element_bytes = 1; break;
    case CU_TENSOR_MAP_DATA_TYPE_UINT16: case CU_TENSOR_MAP_DATA_TYPE_FLOAT16: case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16:
      element_bytes = 2;
      break;
    case CU_TENSOR_MAP_DATA_TYPE_UINT32: case CU_TENSOR_MAP_DATA_TYPE_INT32: case CU_TENSOR_MAP_DATA_TYPE_FLOAT32:
      element_bytes = 4;
      break;
    default: return CUDA_ERROR_INVALID_VALUE;  // the emulator has no other element types
  }
  const uint32_t swizzle_bytes = swizzle == CU_TENSOR_MAP_SWIZZLE_NONE ? 0
                                 : swizzle == CU_TENSOR_MAP_SWIZZLE_32B ? 32
                                 : swizzle == CU_TENSOR_MAP_SWIZZLE_64B ? 64
                                 : swizzle == CU_TENSOR_MAP_SWIZZLE_128B ? 128
                                                                         : ~0u;
  if (!tensor_map || reinterpret_cast<uintptr_t>(tensor_map) % 64 || rank < 1 || rank > 3 ||
      interleave != CU_TENSOR_MAP_INTERLEAVE_NONE || swizzle_bytes == ~0u || reinterpret_cast<uintptr_t>(address) % 16)
    return CUDA_ERROR_INVALID_VALUE;
  EmulatedTensorMap map{};
  map.magic = EmulatedTensorMap::kMagic;
  map.base = static_cast<const unsigned char*>(address);
  map.rank = rank;
  map.element_bytes = element_bytes;
  map.swizzle_bytes = swizzle_bytes;
  for (uint32_t d = 0; d < rank; ++d) {
    if (dims[d] == 0 || dims[d] > (uint64_t(1) << 32) || box[d] == 0 || box[d] > 256 || element_strides[d] != 1)
      return CUDA_ERROR_INVALID_VALUE;
    map.dims[d] = dims[d];
    map.box[d] = box[d];
    map.strides[d] = d == 0 ? element_bytes : strides[d - 1];
    if (d > 0 && (strides[d - 1] % 16 || strides[d - 1] >= (uint64_t(1) << 40))) return CUDA_ERROR_INVALID_VALUE;
  }
  const uint32_t row_bytes = box[0] * element_bytes;
  if (row_bytes % 16 || (swizzle_bytes && row_bytes > swizzle_bytes)) return CUDA_ERROR_INVALID_VALUE;
  std::memset(tensor_map, 0, sizeof *tensor_map);
  std::memcpy(tensor_map, &map, sizeof map);
  return CUDA_SUCCESS;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** function, unsigned int, unsigned long long,
                                             cudaDriverEntryPointQueryResult* status) {
  const bool known = std::strcmp(symbol, "cuTensorMapEncodeTiled") == 0;  // the only driver call the kernels make
  *function = known ? reinterpret_cast<void*>(&emulated_tensor_map_encode_tiled) : nullptr;
  if (status) *status = known ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return last_error; }
const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    default: return "emulated CUDA error";
  }
}
