// A progress watchdog for distributed runs. A rank whose peer died or diverged waits inside an NCCL
// collective forever: no error, no exit, and a launcher that stops all ranks when one exits never
// learns of it. The trainer beats at every phase; when no beat comes for the timeout, the
// watchdog's thread reports the phase it stalled in, and end_stalled_rank ends the process with
// a distinct status, so the launcher (run.sh, torchrun, srun) stops the others.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

// The exit status of a rank ended by end_stalled_rank: distinct from the trainer's 1 (error) and
// 2 (bad flags), and outside 124-143, which shells and `timeout` give to timed-out or killed commands.
constexpr int kStalledRankExitCode = 75;

class ProgressWatchdog {
 public:
  using Clock = std::chrono::steady_clock;

  // on_stall(message) runs once, on the watchdog's thread, when no beat() came for `timeout`; the
  // message names the phase of the last beat and the time waited, e.g.
  // "no progress for 300 s in 'step 12: gradients and optimizer'".
  ProgressWatchdog(std::chrono::milliseconds timeout, std::function<void(const std::string&)> on_stall)
      : timeout_(timeout), on_stall_(std::move(on_stall)), last_beat_(Clock::now()) {
    if (timeout_.count() <= 0) throw std::invalid_argument("progress watchdog: the timeout must be positive");
    if (!on_stall_) throw std::invalid_argument("progress watchdog: no stall handler");
    try {
      thread_ = std::thread([this] { watch(); });
    } catch (const std::system_error& e) {
      throw std::runtime_error(std::string("progress watchdog: cannot start its thread: ") + e.what());
    }
  }

  // Wakes the thread through the condition variable, so a run ends without waiting out the timeout.
  // If on_stall is running (and returns, as test handlers do), this waits for it.
  ~ProgressWatchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_one();
    thread_.join();
  }

  ProgressWatchdog(const ProgressWatchdog&) = delete;
  ProgressWatchdog& operator=(const ProgressWatchdog&) = delete;

  // Progress: the timeout starts again, in `phase`. Thread-safe. No notify: the thread finds the
  // newer beat when it wakes at the old deadline, so beating costs one uncontended lock.
  void beat(std::string phase) {
    std::lock_guard<std::mutex> lock(mutex_);
    phase_ = std::move(phase);
    last_beat_ = Clock::now();
  }

 private:
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      const Clock::time_point deadline = last_beat_ + timeout_;
      if (Clock::now() < deadline) {
        wake_.wait_until(lock, deadline);
        continue;
      }
      const std::string message = "no progress for " + seconds_since(last_beat_) + " in '" + phase_ + "'";
      lock.unlock();  // on_stall may take long (or never return); beats must not block meanwhile
      on_stall_(message);
      return;
    }
  }

  static std::string seconds_since(Clock::time_point t) {
    const double s = std::chrono::duration<double>(Clock::now() - t).count();
    char text[32];
    std::snprintf(text, sizeof text, s >= 10 ? "%.0f s" : "%.2f s", s);
    return text;
  }

  const std::chrono::milliseconds timeout_;
  const std::function<void(const std::string&)> on_stall_;
  std::mutex mutex_;
  std::condition_variable wake_;
  Clock::time_point last_beat_;
  std::string phase_ = "start (no beat yet)";
  bool stopping_ = false;
  std::thread thread_;  // last: it starts after every member it reads
};

// What a stalled rank writes last: every buffered line of the process (the console's, the run
// log's), so the step the rank reached is not lost with it.
inline void flush_all_output() {
  if (std::fflush(nullptr) != 0) std::perror("error: flushing output");
}

// The trainer's on_stall: says which rank stalled and where on stderr, flushes the output on a
// detached thread for at most `flush_deadline` (a pipe nobody reads could hold it), then ends the
// process with kStalledRankExitCode. It does not abort the communicator: ncclCommAbort makes the
// stuck collective return, and the main thread would go on with buffers no peer reduced (and could
// checkpoint them); the process's end stops its GPU work and closes NCCL's connections anyway.
// std::_Exit, not exit: the main thread is still inside a collective, and static destructors would
// wait on it or on CUDA.
// end_rank_now does the same with another exit status: a rank's own error while its peers may be
// inside a collective (the trainer's TrainingRun).
[[noreturn]] inline void end_rank_now(int rank, const std::string& message, int exit_code,
                                      std::function<void()> finish_output = flush_all_output,
                                      std::chrono::milliseconds flush_deadline = std::chrono::seconds(10)) {
  std::fprintf(stderr, "error: rank %d: %s; exiting\n", rank, message.c_str());
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> finished = done->get_future();
  try {
    std::thread([done, finish = std::move(finish_output)] {
      finish();
      done->set_value();
    }).detach();
    if (finished.wait_for(flush_deadline) == std::future_status::timeout)
      std::fprintf(stderr, "error: rank %d: flushing the output did not end within %.1f s; exiting without it\n", rank,
                   flush_deadline.count() / 1000.0);
  } catch (const std::system_error& e) {
    std::fprintf(stderr, "error: rank %d: cannot start the thread that flushes the output: %s\n", rank, e.what());
  }
  std::_Exit(exit_code);
}

[[noreturn]] inline void end_stalled_rank(int rank, const std::string& message,
                                          std::function<void()> finish_output = flush_all_output,
                                          std::chrono::milliseconds flush_deadline = std::chrono::seconds(10)) {
  end_rank_now(rank, message, kStalledRankExitCode, std::move(finish_output), flush_deadline);
}
