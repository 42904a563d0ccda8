// A child process read line by line, each line within a time limit: the trainer runs its start-up
// self-check in one (kernels/self_check_process.cuh), so that a kernel that hangs or stops the GPU
// ends that process, not the run. POSIX only (posix_spawn, poll, waitpid).
#pragma once
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

extern char** environ;

struct ChildOutcome {
  std::vector<std::string> lines;  // what it wrote to its standard output, line by line
  bool timed_out = false;          // no line came within the limit: the child was killed (SIGKILL)
  int exit_status = -1;            // its exit status, or -1 where a signal ended it
  int signal = 0;                  // the signal that ended it (0: it exited)

  // "exit 3", "signal 11 (Segmentation fault)": how it ended, for messages.
  std::string ending() const {
    if (signal == 0) return "exit " + std::to_string(exit_status);
    return "signal " + std::to_string(signal) + " (" + strsignal(signal) + ")";
  }
};

// A child process of the program that runs this one: the kernel starts the file this process was
// started from, even where a build has replaced or deleted it since.
constexpr const char* kThisProgram = "/proc/self/exe";

// In a child that must not outlive its parent (one holding a GPU, say): ends this process with
// SIGKILL when the parent ends, and at once where it has ended already (the pid that the parent put
// in the environment variable `parent_variable` is no longer this one's parent, and no process has
// it). Throws where the variable is not this process's parent's pid.
inline void end_with_parent(const char* parent_variable) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  const char* parent = std::getenv(parent_variable);
  if (parent && std::to_string(getppid()) == parent) return;
  if (parent && kill(pid_t(std::atoll(parent)), 0) != 0 && errno == ESRCH) std::_Exit(1);  // the parent has ended
  throw std::runtime_error(std::string(parent_variable) + (parent ? "=" + std::string(parent) : " unset") +
                           ": this process's parent is not the process it names, so it was started by something else "
                           "(a variable left set?)");
}

// Runs `program` with `args` (args[0] is its argv[0]) and this process's environment changed by
// `environment_changes` ("NAME=value" sets NAME, "NAME" removes it), its standard output read here
// (each line also to `on_line`, if given, as it comes) and its standard error this process's.
// Waits until it ends; where `seconds_per_line` pass without a line (or its end), kills it. A last
// line without its newline (the child ended writing it) is dropped. Throws where it cannot be started.
inline ChildOutcome run_child(const std::string& program, const std::vector<std::string>& args,
                              const std::vector<std::string>& environment_changes, double seconds_per_line,
                              const std::function<void(const std::string&)>& on_line = nullptr) {
  auto fail = [](const std::string& what) {
    throw std::runtime_error("cannot start a child process (" + what + "): " + std::strerror(errno));
  };
  std::vector<std::string> environment;
  for (char** e = environ; *e; ++e) environment.emplace_back(*e);
  for (const std::string& change : environment_changes) {
    const size_t equals = change.find('=');
    const std::string name = change.substr(0, equals) + "=";
    environment.erase(std::remove_if(environment.begin(), environment.end(),
                                     [&](const std::string& e) { return e.rfind(name, 0) == 0; }),
                      environment.end());
    if (equals != std::string::npos) environment.push_back(change);
  }
  std::vector<char*> argv, envp;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  for (const std::string& e : environment) envp.push_back(const_cast<char*>(e.c_str()));
  argv.push_back(nullptr);
  envp.push_back(nullptr);

  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) fail("pipe");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);  // dup2 clears close-on-exec
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, program.c_str(), &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  close(out[1]);
  if (spawned != 0) {
    close(out[0]);
    errno = spawned;
    fail(program);
  }

  ChildOutcome outcome;
  std::string pending;
  using Clock = std::chrono::steady_clock;
  const auto limit = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds_per_line));
  Clock::time_point deadline = Clock::now() + limit;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      outcome.timed_out = true;
      kill(pid, SIGKILL);
      break;
    }
    pollfd p{out[0], POLLIN, 0};
    const int ready = poll(&p, 1, int(std::min<long long>(left, 1000)));
    if (ready == 0 || (ready < 0 && errno == EINTR)) continue;
    char buffer[4096];
    const ssize_t n = ready < 0 ? -1 : read(out[0], buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) break;  // its end
    if (n < 0) {        // poll or read failed: nothing more can be read, so the child is not waited for
      kill(pid, SIGKILL);
      break;
    }
    pending.append(buffer, size_t(n));
    for (size_t end; (end = pending.find('\n')) != std::string::npos; pending.erase(0, end + 1)) {
      outcome.lines.push_back(pending.substr(0, end));
      if (on_line) on_line(outcome.lines.back());
      deadline = Clock::now() + limit;
    }
  }
  close(out[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) outcome.exit_status = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) outcome.signal = WTERMSIG(status);
  return outcome;
}
