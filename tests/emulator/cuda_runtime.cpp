// The CUDA runtime API calls the trainer and the tests make, on host memory: by default every call
// completes before it returns; with lazy streams (cuda_emulator.h) each stream queues its work and
// runs it only when something waits for it. Device allocations are poisoned (0xFF: NaN in fp32
// and bf16), as fresh GPU memory holds whatever was there before; the device reports itself as an
// H100 (sm_90, 132 SMs).
#include "emulator/cuda_emulator.h"
#include "emulator/runtime.h"

#include <cuda.h>
#include <cuda_profiler_api.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace emu {
namespace {

constexpr size_t kDefaultDynamicShared = 48 << 10, kMaxDynamicShared = 227 << 10;
constexpr size_t kDeviceBytes = size_t(80) << 30;

std::mutex registry_mutex;
std::map<const void*, size_t> allocations;        // device pointer -> bytes
std::map<const void*, size_t> pinned;             // page-locked host pointer -> bytes
std::map<const void*, size_t> shared_limits;      // kernel -> dynamic shared memory bytes allowed
thread_local cudaError_t last_error = cudaSuccess;

cudaError_t allocate(void** p, size_t bytes, bool device) {
  *p = std::aligned_alloc(256, (std::max<size_t>(bytes, 1) + 255) / 256 * 256);
  if (!*p) return cudaErrorMemoryAllocation;
  if (device) std::memset(*p, 0xFF, bytes);
  std::lock_guard<std::mutex> lock(registry_mutex);
  (device ? allocations : pinned)[*p] = bytes;
  return cudaSuccess;
}

// Whether p lies in one of `registry`'s allocations.
bool within(const std::map<const void*, size_t>& registry, const void* p) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto next = registry.upper_bound(p);
  if (next == registry.begin()) return false;
  --next;
  return static_cast<const char*>(p) < static_cast<const char*>(next->first) + next->second;
}

// ---- streams ----
// A stream's queue (lazy streams only; otherwise work runs as it is enqueued). Streams are never
// freed: an event may still name one that was destroyed.
struct Stream {
  bool blocking;  // created without cudaStreamNonBlocking: ordered with the legacy default stream
  std::deque<std::function<void()>> queue;  // enqueued, not yet run
  uint64_t enqueued = 0, done = 0;
  bool running = false, destroyed = false;
};

struct Event {
  std::shared_ptr<std::chrono::steady_clock::time_point> recorded =
      std::make_shared<std::chrono::steady_clock::time_point>();
  Stream* stream = nullptr;  // its last record: complete once `stream` has run `through` items
  uint64_t through = 0;
};

bool lazy = [] {
  const char* mode = std::getenv("SPEEDRUN_EMULATOR_STREAMS");
  return mode && std::strcmp(mode, "lazy") == 0;
}();
std::recursive_mutex stream_mutex;  // the queues, and the work they run (one host thread at a time)
std::vector<std::unique_ptr<Stream>> streams = [] {
  std::vector<std::unique_ptr<Stream>> all;
  all.push_back(std::make_unique<Stream>(Stream{/*blocking=*/true}));  // the legacy default stream
  return all;
}();

Stream& stream_of(cudaStream_t handle) {
  if (handle == nullptr || handle == cudaStreamLegacy) return *streams.front();
  if (handle == cudaStreamPerThread) fatal("cudaStreamPerThread is not emulated");
  return *reinterpret_cast<Stream*>(handle);
}

// Runs s's queue until it has run `through` items. A wait names work enqueued before it, so no
// item can wait for its own stream's later work: fatal here if one does (an emulator bug).
void run_until(Stream& s, uint64_t through) {
  while (s.done < through) {
    if (s.running) fatal("a stream's queued work waits for its own later work");
    std::function<void()> work = std::move(s.queue.front());
    s.queue.pop_front();
    s.running = true;
    work();
    s.running = false;
    ++s.done;
  }
}

void synchronize(Stream& s) {
  if (!lazy) return;
  std::lock_guard<std::recursive_mutex> lock(stream_mutex);
  run_until(s, s.enqueued);
}

void synchronize_device() {
  if (!lazy) return;
  std::lock_guard<std::recursive_mutex> lock(stream_mutex);
  for (size_t i = 0; i < streams.size(); ++i) run_until(*streams[i], streams[i]->enqueued);
}

}  // namespace

void record_launch_error(cudaError_t error) { last_error = error; }

bool lazy_streams() { return lazy; }

void set_lazy_streams(bool on) {
  std::lock_guard<std::recursive_mutex> lock(stream_mutex);
  synchronize_device();
  lazy = on;
}

void enqueue(cudaStream_t handle, std::function<void()> work) {
  if (!lazy) return work();
  std::lock_guard<std::recursive_mutex> lock(stream_mutex);
  Stream& s = stream_of(handle);
  // The legacy default stream's work waits for the blocking streams' earlier work, and theirs for its.
  std::vector<std::pair<Stream*, uint64_t>> after;
  if (&s == streams.front().get()) {
    for (size_t i = 1; i < streams.size(); ++i)
      if (streams[i]->blocking && !streams[i]->destroyed) after.push_back({streams[i].get(), streams[i]->enqueued});
  } else if (s.blocking) {
    after.push_back({streams.front().get(), streams.front()->enqueued});
  }
  s.queue.push_back([after, work = std::move(work)] {
    for (const auto& [stream, through] : after) run_until(*stream, through);
    work();
  });
  ++s.enqueued;
}

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
  if (!p) return cudaSuccess;
  synchronize_device();  // as CUDA's does
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    if (pinned.erase(p) == 0) return cudaErrorInvalidValue;
  }
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;
  synchronize_device();  // as CUDA's does
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

// The synchronous calls go on the legacy default stream and return once done.
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  if (bytes) enqueue(nullptr, [=] { std::memmove(dst, src, bytes); });
  synchronize(stream_of(nullptr));
  return cudaSuccess;
}
// Lazy: a pageable source is read at the call (CUDA stages it), a page-locked one when the copy
// runs; the call returns only once a copy into pageable memory, or between host buffers, is done
// (as CUDA's).
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind, cudaStream_t stream) {
  if (!bytes) return cudaSuccess;
  const bool from_host = !within(allocations, src), to_host = !within(allocations, dst);
  if (lazy && from_host && !within(pinned, src)) {
    auto image = std::make_shared<std::vector<unsigned char>>(static_cast<const unsigned char*>(src),
                                                              static_cast<const unsigned char*>(src) + bytes);
    enqueue(stream, [=] { std::memcpy(dst, image->data(), bytes); });
  } else {
    enqueue(stream, [=] { std::memmove(dst, src, bytes); });
  }
  if ((to_host && !within(pinned, dst)) || (from_host && to_host)) synchronize(stream_of(stream));
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  enqueue(nullptr, [=] { std::memset(p, value, bytes); });
  synchronize(stream_of(nullptr));
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream) {
  enqueue(stream, [=] { std::memset(p, value, bytes); });
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) {
  std::lock_guard<std::recursive_mutex> lock(stream_mutex);
  streams.push_back(std::make_unique<Stream>(Stream{/*blocking=*/(flags & cudaStreamNonBlocking) == 0}));
  *s = reinterpret_cast<cudaStream_t>(streams.back().get());
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  std::lock_guard<std::recursive_mutex> lock(stream_mutex);
  synchronize(stream_of(s));  // its work still runs on the GPU
  stream_of(s).destroyed = true;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  synchronize(stream_of(s));
  return cudaSuccess;
}
// The wait is for the event's record as it stands now, as CUDA's (none yet: nothing to wait for).
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  std::lock_guard<std::recursive_mutex> lock(stream_mutex);
  const Event& event = *reinterpret_cast<Event*>(e);
  Stream* recording = event.stream;
  const uint64_t through = event.through;
  enqueue(s, [recording, through] {
    if (recording) run_until(*recording, through);
  });
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  synchronize_device();
  return cudaSuccess;
}
// No profiler attaches to the emulator: the range's edges are accepted and mark nothing.
cudaError_t cudaProfilerStart() { return cudaSuccess; }
cudaError_t cudaProfilerStop() { return cudaSuccess; }

// Events keep the host time at which their last record ran, for cudaEventElapsedTime (each record
// its own, so an older record that runs late does not overwrite a newer one's).
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  *e = reinterpret_cast<cudaEvent_t>(new Event);
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete reinterpret_cast<Event*>(e);  // a pending record keeps its time's storage
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  Event& event = *reinterpret_cast<Event*>(e);
  std::lock_guard<std::recursive_mutex> lock(stream_mutex);
  if (lazy) {
    event.stream = &stream_of(s);
    event.through = event.stream->enqueued + 1;
  }
  event.recorded = std::make_shared<std::chrono::steady_clock::time_point>();
  enqueue(s, [recorded = event.recorded] { *recorded = std::chrono::steady_clock::now(); });
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  std::lock_guard<std::recursive_mutex> lock(stream_mutex);
  const Event& event = *reinterpret_cast<Event*>(e);
  if (lazy && event.stream) run_until(*event.stream, event.through);
  return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  cudaEventSynchronize(start);
  cudaEventSynchronize(end);
  *ms = std::chrono::duration<float, std::milli>(*reinterpret_cast<Event*>(end)->recorded -
                                                 *reinterpret_cast<Event*>(start)->recorded)
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
  if (attribute == cudaDevAttrComputeMode) {  // any number of processes may use it
    *value = cudaComputeModeDefault;
    return cudaSuccess;
  }
  if (attribute != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;  // the only others asked
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
