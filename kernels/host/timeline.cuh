// The schedule of a training step as the GPU ran it: spans of work on named lanes (the compute
// stream, the communication stream), timed by CUDA events recorded on those streams, written as
// a Chrome trace (chrome://tracing or ui.perfetto.dev). Off unless asked for: a span with no
// timeline records nothing.
#pragma once
#include "kernels/host/cuda_check.cuh"

#include <cuda_profiler_api.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

class Timeline {
 public:
  Timeline() = default;
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;
  ~Timeline() {
    for (Span& s : spans_) {
      cudaEventDestroy(s.start);
      cudaEventDestroy(s.end);
    }
  }

  // Returns the span's index for close().
  size_t open(const std::string& lane, const std::string& name, cudaStream_t stream) {
    Span s{lane, name, event(), event()};
    CUDA_CHECK(cudaEventRecord(s.start, stream));
    spans_.push_back(s);
    return spans_.size() - 1;
  }
  // Unchecked, as it runs in destructors: a failed record leaves an error that the next checked
  // call on the stream, or write_chrome_trace, reports.
  void close(size_t span, cudaStream_t stream) noexcept { cudaEventRecord(spans_[span].end, stream); }

  // Waits for the spans' work; times are microseconds from the first span's start. Each lane is
  // a thread of the process `process_id`, named by a metadata event.
  void write_chrome_trace(const std::string& path, int process_id) const {
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<std::string> lanes;
    std::vector<std::string> events;
    char line[512];
    for (const Span& s : spans_) {
      size_t lane = std::find(lanes.begin(), lanes.end(), s.lane) - lanes.begin();
      if (lane == lanes.size()) {
        lanes.push_back(s.lane);
        std::snprintf(line, sizeof line,
                      "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %zu, \"args\": {\"name\": \"%s\"}}",
                      process_id, lane, s.lane.c_str());
        events.push_back(line);
      }
      float start_ms = 0, length_ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&start_ms, spans_[0].start, s.start));
      CUDA_CHECK(cudaEventElapsedTime(&length_ms, s.start, s.end));
      std::snprintf(line, sizeof line, "{\"name\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": %zu, \"ts\": %.1f, \"dur\": %.1f}",
                    s.name.c_str(), process_id, lane, 1000.0 * start_ms, 1000.0 * length_ms);
      events.push_back(line);
    }
    std::ofstream out(path);
    out << "{\"traceEvents\": [\n";
    for (size_t i = 0; i < events.size(); ++i) out << events[i] << (i + 1 < events.size() ? ",\n" : "\n");
    out << "]}\n";
    if (!out.flush()) throw std::runtime_error("cannot write the timeline " + path);
  }

 private:
  struct Span {
    std::string lane, name;
    cudaEvent_t start, end;
  };
  static cudaEvent_t event() {
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreate(&e));  // with timing
    return e;
  }
  std::vector<Span> spans_;
};

// One span over the work queued on `stream` during this scope; nothing without a timeline.
class TimelineSpan {
 public:
  TimelineSpan(Timeline* timeline, const char* lane, const std::string& name, cudaStream_t stream)
      : timeline_(timeline), stream_(stream) {
    if (timeline_) span_ = timeline_->open(lane, name, stream);
  }
  ~TimelineSpan() {
    if (timeline_) timeline_->close(span_, stream_);
  }
  TimelineSpan(const TimelineSpan&) = delete;
  TimelineSpan& operator=(const TimelineSpan&) = delete;

 private:
  Timeline* timeline_;
  cudaStream_t stream_;
  size_t span_ = 0;
};

// The edges of a profiled range (--profile-step): the device idle at both, so that a profiler that
// honours cudaProfilerStart/Stop (tools/kernel_profile.so, ncu --profile-from-start off) sees that
// range's work alone and its wall time equals the work's.
inline void profiler_range_edge(bool start) {
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(start ? cudaProfilerStart() : cudaProfilerStop());
}
