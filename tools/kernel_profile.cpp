// Every kernel, copy and memset the GPU runs inside a program's cudaProfilerStart/Stop ranges,
// timed by the GPU's own timestamps (CUPTI's activity records), for any CUDA program: the trainer
// (--profile-step N) and the record's PyTorch code (tools/record_pytorch.py --profile-step N)
// alike, so that both are profiled by one tool. The GPU machines have no Nsight Systems; this is
// its kernel table.
//
//   CUDA_INJECTION64_PATH=build/libkernel_profile.so KERNEL_PROFILE_OUT=profile.csv <program>
//   python3 tools/profile_summary.py profile.csv
//
// The CUDA driver loads this library when the program initialises CUDA and calls
// InitializeInjection. Records of the work that starts inside the ranges (the program synchronises
// the device at each edge: the trainer's profiler_range_edge) are written at exit as lines of
//   range,<index>,<start ns>,<end ns>
//   kernel|memcpy|memset,<start ns>,<end ns>,<stream>,<name: the demangled kernel name, or bytes and kind>
//   dropped,<records CUPTI dropped>        (only when it dropped some: the summary refuses the file)
// A CUPTI call that fails ends the program with its message: a profile with silent gaps would be
// read as a measurement.
#include <cupti.h>

#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

void check(CUptiResult result, const char* call) {
  if (result == CUPTI_SUCCESS) return;
  const char* text = nullptr;
  cuptiGetResultString(result, &text);
  std::fprintf(stderr, "kernel_profile: %s failed: %s\n", call, text ? text : "unknown CUPTI error");
  std::exit(1);
}
#define CUPTI_CHECK(call) check((call), #call)

struct Range {
  uint64_t start = 0, end = 0;
};

struct Record {
  const char* kind;
  uint64_t start, end;
  uint32_t stream;
  std::string what;
};

std::mutex g_mutex;            // the records arrive on CUPTI's worker thread
std::vector<Record> g_records;
std::vector<Range> g_ranges;
bool g_active = false;
size_t g_dropped = 0;

const CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                     CUPTI_ACTIVITY_KIND_MEMSET};

std::string demangled(const char* name) {
  int status = 0;
  char* text = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string out = status == 0 && text ? text : name;
  std::free(text);
  for (char& c : out)
    if (c == '\n') c = ' ';
  return out;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  constexpr size_t kBytes = 8 << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBytes));
  if (!*buffer) {
    std::fprintf(stderr, "kernel_profile: cannot allocate an activity buffer of %zu bytes\n", kBytes);
    std::exit(1);
  }
  *size = kBytes;
  *max_records = 0;  // as many as fit
}

void CUPTIAPI buffer_completed(CUcontext context, uint32_t stream, uint8_t* buffer, size_t, size_t valid) {
  std::vector<Record> records;
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        records.push_back({"kernel", k->start, k->end, k->streamId, k->name});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        records.push_back({"memcpy", m->start, m->end, m->streamId,
                           std::to_string(m->bytes) + " bytes, kind " + std::to_string(m->copyKind)});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
        records.push_back({"memset", m->start, m->end, m->streamId, std::to_string(m->bytes) + " bytes"});
        break;
      }
      default:
        break;
    }
  }
  size_t dropped = 0;
  CUPTI_CHECK(cuptiActivityGetNumDroppedRecords(context, stream, &dropped));
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_records.insert(g_records.end(), records.begin(), records.end());
  g_dropped += dropped;
}

// cudaProfilerStart and cuProfilerStop (the runtime's call reaches the driver's too: both are
// watched, each edge taken once). The edges are timestamps only: recording runs from the start
// (enabling it inside an API callback is not what CUPTI's samples do), and the file keeps the
// records inside a range. The program idles the device at each edge, so nothing is cut.
void CUPTIAPI on_profiler_call(void*, CUpti_CallbackDomain domain, CUpti_CallbackId id, const void* data) {
  const auto* info = static_cast<const CUpti_CallbackData*>(data);
  const bool start = (domain == CUPTI_CB_DOMAIN_RUNTIME_API && id == CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStart_v4000) ||
                     (domain == CUPTI_CB_DOMAIN_DRIVER_API && id == CUPTI_DRIVER_TRACE_CBID_cuProfilerStart);
  uint64_t now = 0;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (start && info->callbackSite == CUPTI_API_ENTER && !g_active) {
    CUPTI_CHECK(cuptiGetTimestamp(&now));
    g_ranges.push_back({now, 0});
    g_active = true;
  } else if (!start && info->callbackSite == CUPTI_API_EXIT && g_active) {
    CUPTI_CHECK(cuptiGetTimestamp(&now));
    g_ranges.back().end = now;
    g_active = false;
  }
}

bool in_a_range(uint64_t start) {
  for (const Range& r : g_ranges)
    if (start >= r.start && (start <= r.end || r.end == 0)) return true;
  return false;
}

void write_profile() {
  CUPTI_CHECK(cuptiActivityFlushAll(1));
  const char* path = std::getenv("KERNEL_PROFILE_OUT");
  std::FILE* out = std::fopen(path, "w");
  if (!out) {
    std::fprintf(stderr, "kernel_profile: cannot write %s: %s\n", path, std::strerror(errno));
    return;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  for (size_t i = 0; i < g_ranges.size(); ++i)
    std::fprintf(out, "range,%zu,%llu,%llu\n", i, (unsigned long long)g_ranges[i].start,
                 (unsigned long long)g_ranges[i].end);
  size_t kept = 0;
  for (const Record& r : g_records) {
    if (!in_a_range(r.start)) continue;
    const std::string what = std::strcmp(r.kind, "kernel") == 0 ? demangled(r.what.c_str()) : r.what;
    std::fprintf(out, "%s,%llu,%llu,%u,%s\n", r.kind, (unsigned long long)r.start, (unsigned long long)r.end, r.stream,
                 what.c_str());
    ++kept;
  }
  if (g_dropped) std::fprintf(out, "dropped,%zu\n", g_dropped);
  if (std::fclose(out) != 0) std::fprintf(stderr, "kernel_profile: cannot write %s\n", path);
  std::fprintf(stderr, "kernel_profile: %zu ranges, %zu of %zu records inside them%s, into %s\n", g_ranges.size(), kept,
               g_records.size(), g_dropped ? " (some DROPPED)" : "", path);
}

}  // namespace

extern "C" int InitializeInjection(void) {
  if (!std::getenv("KERNEL_PROFILE_OUT")) {
    std::fprintf(stderr, "kernel_profile: set KERNEL_PROFILE_OUT to the file the profile goes to\n");
    std::exit(1);
  }
  CUpti_SubscriberHandle subscriber;
  CUPTI_CHECK(cuptiSubscribe(&subscriber, on_profiler_call, nullptr));
  CUPTI_CHECK(cuptiEnableCallback(1, subscriber, CUPTI_CB_DOMAIN_RUNTIME_API,
                                  CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStart_v4000));
  CUPTI_CHECK(cuptiEnableCallback(1, subscriber, CUPTI_CB_DOMAIN_RUNTIME_API,
                                  CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStop_v4000));
  CUPTI_CHECK(cuptiEnableCallback(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuProfilerStart));
  CUPTI_CHECK(cuptiEnableCallback(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuProfilerStop));
  CUPTI_CHECK(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
  for (CUpti_ActivityKind kind : kKinds) CUPTI_CHECK(cuptiActivityEnable(kind));
  std::atexit(write_profile);
  return 1;
}
