// A progress watchdog for distributed runs. A rank whose peer died or diverged waits inside an NCCL
// collective forever: no error, no exit, and a launcher that stops all ranks when one exits never
// learns of it. The trainer beats at every phase; when no beat comes for the timeout, the
// watchdog's thread reports the phase it stalled in, and abort_stalled_rank ends the process with
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

// The exit status of a rank ended by abort_stalled_rank: distinct from the trainer's 1 (error) and
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

namespace watchdog_detail {

// Flushes the process's output (the console's last lines, the run log), then aborts the
// communicator; the caller waits for `done` only until its deadline, since either could hang.
inline void flush_and_abort(int rank, const std::function<void()>& abort_communicator, std::promise<void>& done) {
  if (std::fflush(nullptr) != 0) std::perror(("error: rank " + std::to_string(rank) + ": flushing output").c_str());
  try {
    abort_communicator();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: rank %d: aborting the communicator failed: %s\n", rank, e.what());
  }
  done.set_value();
}

}  // namespace watchdog_detail

// The trainer's on_stall: says which rank stalled and where on stderr, aborts the communicator
// (ncclCommAbort, so NCCL frees its resources and closes its connections) on a detached thread for
// at most `abort_deadline`, then ends the process with kStalledRankExitCode. std::_Exit, not exit:
// the main thread is still inside a collective, and static destructors would wait on it or on CUDA.
[[noreturn]] inline void abort_stalled_rank(int rank, const std::string& message, std::function<void()> abort_communicator,
                                            std::chrono::milliseconds abort_deadline = std::chrono::seconds(10)) {
  std::fprintf(stderr, "error: rank %d: %s; aborting\n", rank, message.c_str());
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> finished = done->get_future();
  try {
    std::thread([rank, done, abort = std::move(abort_communicator)] {
      watchdog_detail::flush_and_abort(rank, abort, *done);
    }).detach();
    if (finished.wait_for(abort_deadline) == std::future_status::timeout)
      std::fprintf(stderr, "error: rank %d: the communicator's abort did not return within %.1f s; exiting without it\n",
                   rank, abort_deadline.count() / 1000.0);
  } catch (const std::system_error& e) {
    std::fprintf(stderr, "error: rank %d: cannot start the thread that aborts the communicator: %s\n", rank, e.what());
  }
  std::_Exit(kStalledRankExitCode);
}
