// The progress watchdog without a GPU: beats keep it quiet, a stall calls the handler once with the
// phase of the last beat, destruction does not wait out the timeout; and the trainer's handler,
// run in a child process (fork), prints the rank and message, flushes the output (or gives up on
// a flush that hangs) and exits with kStalledRankExitCode, keeping the output written before.
#include "check.h"
#include "kernels/host/watchdog.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <vector>

namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// What on_stall received, safe to read from the test's thread.
struct StallRecord {
  std::mutex mutex;
  std::vector<std::string> messages;
  std::function<void(const std::string&)> handler() {
    return [this](const std::string& m) {
      std::lock_guard<std::mutex> lock(mutex);
      messages.push_back(m);
    };
  }
  std::vector<std::string> seen() {
    std::lock_guard<std::mutex> lock(mutex);
    return messages;
  }
};

struct ChildResult {
  bool exited = false;  // false: killed at the hard limit, or ended by a signal
  int status = -1;
  std::string output;  // stdout and stderr together
  double seconds = 0;
};

// Reads the child's output until it closes it; false if `hard_limit` passed first.
bool read_until_closed(int fd, std::string& output, Clock::time_point hard_limit) {
  for (;;) {
    const auto left = std::chrono::duration_cast<milliseconds>(hard_limit - Clock::now()).count();
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, left > 0 ? int(left) : 0);
    if (ready < 0 && errno == EINTR) continue;
    CHECK(ready >= 0);
    if (ready <= 0) return false;
    char buffer[4096];
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n <= 0) return true;
    output.append(buffer, size_t(n));
  }
}

// Runs body in a child process whose stdout and stderr go to a pipe; kills it after `hard_limit`.
ChildResult run_child(const std::function<void()>& body, milliseconds hard_limit = milliseconds(5000)) {
  int fds[2];
  CHECK(::pipe(fds) == 0);
  std::fflush(stdout);  // else the child would write the parent's buffered lines again
  const Clock::time_point start = Clock::now();
  const pid_t pid = ::fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    ::close(fds[0]);
    if (::dup2(fds[1], 1) < 0 || ::dup2(fds[1], 2) < 0) ::_exit(90);
    body();
    ::_exit(91);  // body is expected never to return
  }
  ::close(fds[1]);
  ChildResult r;
  const bool closed = read_until_closed(fds[0], r.output, start + hard_limit);
  ::close(fds[0]);
  if (!closed) CHECK(::kill(pid, SIGKILL) == 0);
  int status = 0;
  CHECK(::waitpid(pid, &status, 0) == pid);
  r.seconds = seconds_since(start);
  r.exited = closed && WIFEXITED(status);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::printf("  child after %.2f s, status %d: %s", r.seconds, r.status, r.output.c_str());
  return r;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("beats within the timeout keep the watchdog quiet") {
  StallRecord record;
  {
    ProgressWatchdog watchdog(milliseconds(100), record.handler());
    for (int i = 0; i < 25; ++i) {
      watchdog.beat("step " + std::to_string(i));
      std::this_thread::sleep_for(milliseconds(20));
    }
  }
  CHECK(record.seen().empty());
}

TEST_CASE("a stall calls on_stall exactly once, naming the last beat's phase and the time waited") {
  StallRecord record;
  ProgressWatchdog watchdog(milliseconds(50), record.handler());
  watchdog.beat("step 11: forward");
  watchdog.beat("step 12: gradients and optimizer");
  const Clock::time_point last_beat = Clock::now();
  while (record.seen().empty() && seconds_since(last_beat) < 2) std::this_thread::sleep_for(milliseconds(1));
  const double fired_after = seconds_since(last_beat);
  std::this_thread::sleep_for(milliseconds(300));  // several timeouts more: still one call
  watchdog.beat("step 13: forward");
  std::this_thread::sleep_for(milliseconds(150));
  const std::vector<std::string> seen = record.seen();
  CHECK(seen.size() == 1);
  CHECK(fired_after >= 0.05 && fired_after < 0.5);
  if (seen.empty()) return;
  std::printf("  %s (after %.3f s)\n", seen[0].c_str(), fired_after);
  CHECK(contains(seen[0], "no progress for 0.0"));
  CHECK(contains(seen[0], " s in 'step 12: gradients and optimizer'"));
}

TEST_CASE("a watchdog stalled before any beat says so") {
  StallRecord record;
  ProgressWatchdog watchdog(milliseconds(30), record.handler());
  std::this_thread::sleep_for(milliseconds(200));
  CHECK(record.seen().size() == 1);
  if (!record.seen().empty()) CHECK(contains(record.seen()[0], "in 'start (no beat yet)'"));
}

TEST_CASE("destruction is prompt, not a wait for the timeout") {
  StallRecord record;
  const Clock::time_point start = Clock::now();
  {
    ProgressWatchdog watchdog(milliseconds(10000), record.handler());
    watchdog.beat("step 0");
  }
  const double took = seconds_since(start);
  std::printf("  construct, beat and destroy with a 10 s timeout: %.4f s\n", took);
  CHECK(took < 1);  // the thread sleeps in a 10 s wait, which the destructor must cut short
  CHECK(record.seen().empty());
}

TEST_CASE("a watchdog needs a positive timeout and a handler") {
  CHECK_THROWS_WITH(ProgressWatchdog(milliseconds(0), [](const std::string&) {}), "timeout must be positive");
  CHECK_THROWS_WITH(ProgressWatchdog(milliseconds(10), nullptr), "no stall handler");
}

TEST_CASE("end_stalled_rank names the rank and the stall, keeps buffered output, exits 75") {
  ChildResult r = run_child([] {
    std::printf("step 12/1770 train_time:9000ms");  // still in stdout's buffer (a pipe): must not be lost
    end_stalled_rank(3, "no progress for 300 s in 'step 12: gradients and optimizer'");
  });
  CHECK(r.exited && r.status == kStalledRankExitCode);
  CHECK(contains(r.output, "error: rank 3: no progress for 300 s in 'step 12: gradients and optimizer'; exiting\n"));
  CHECK(contains(r.output, "step 12/1770 train_time:9000ms"));
}

TEST_CASE("end_rank_now: a rank's own error said at once, with the trainer's exit status for it") {
  ChildResult r = run_child([] {
    std::printf("step 3/10 train_time:300ms");
    end_rank_now(2, "logs/x: cannot write the checkpoint there", 5);
  });
  CHECK(r.exited && r.status == 5);
  CHECK(contains(r.output, "error: rank 2: logs/x: cannot write the checkpoint there; exiting\n"));
  CHECK(contains(r.output, "step 3/10 train_time:300ms"));
}

TEST_CASE("a flush that hangs does not keep the rank alive") {
  ChildResult hangs = run_child([] {
    end_stalled_rank(1, "stalled", [] { std::this_thread::sleep_for(std::chrono::seconds(60)); }, milliseconds(100));
  });
  CHECK(hangs.exited && hangs.status == kStalledRankExitCode);
  CHECK(hangs.seconds < 1);
  CHECK(contains(hangs.output, "error: rank 1: flushing the output did not end within 0.1 s; exiting without it"));
}

TEST_CASE("a rank stuck after its last beat is ended by the watchdog with the trainer's handler") {
  ChildResult r = run_child([] {
    ProgressWatchdog watchdog(milliseconds(100), [](const std::string& message) { end_stalled_rank(5, message); });
    watchdog.beat("step 7: loss all-reduce");
    std::this_thread::sleep_for(std::chrono::seconds(60));  // a collective whose peer is gone
  });
  CHECK(r.exited && r.status == kStalledRankExitCode);
  CHECK(r.seconds < 1);
  CHECK(contains(r.output, "error: rank 5: no progress for 0.1"));
  CHECK(contains(r.output, " s in 'step 7: loss all-reduce'; exiting\n"));
}

int main() { return check::run_checks(); }
