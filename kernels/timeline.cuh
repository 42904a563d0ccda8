// The schedule of a training step as the GPU ran it: spans of work on named lanes (the compute
// stream, the communication stream), timed by CUDA events recorded on those streams, written as
// a Chrome trace (chrome://tracing or ui.perfetto.dev). Off unless asked for: a span with no
// timeline records nothing.
#pragma once
#include "kernels/cuda_check.cuh"

#include <cstdio>
#include <fstream>
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

  // Waits for the spans' work; times are microseconds from the first span's start.
  void write_chrome_trace(const std::string& path, int process_id) const {
    CUDA_CHECK(cudaDeviceSynchronize());
    std::ofstream out(path);
    if (!out) throw std::runtime_error("cannot write the timeline " + path);
    out << "{\"traceEvents\": [\n";
    for (size_t i = 0; i < spans_.size(); ++i) {
      float start_ms = 0, length_ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&start_ms, spans_[0].start, spans_[i].start));
      CUDA_CHECK(cudaEventElapsedTime(&length_ms, spans_[i].start, spans_[i].end));
      char line[512];
      std::snprintf(line, sizeof line,
                    "{\"name\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": \"%s\", \"ts\": %.1f, \"dur\": %.1f}%s\n",
                    spans_[i].name.c_str(), process_id, spans_[i].lane.c_str(), 1000.0 * start_ms,
                    1000.0 * length_ms, i + 1 < spans_.size() ? "," : "");
      out << line;
    }
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
