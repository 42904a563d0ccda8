// The start-up self-check in a process of its own. A fast path's kernel that traps or faults
// leaves its process's GPU context unusable, and one that hangs (a turn or a barrier phase that
// never comes) holds it for ever: in the trainer's own process either would end the run, where the
// self-check is there to fall back. So the trainer (train_gpt.cu) starts itself again with
// SPEEDRUN_SELF_CHECK_PATHS naming the paths to check (and SPEEDRUN_SELF_CHECK_PARENT its pid,
// SPEEDRUN_SELF_CHECK_DONE the groups of checks an earlier process ran); that process runs
// run_self_check and reports each group of checks as it starts and ends, on its standard output:
//   @group <count>                                  a group of checks starts (add_results' specs)
//   @spec <path> <bound> <check name>               count lines: the group's checks
//   @result <path> <error> <bound> <check name> <failure>   after the group, one per check
//   @stopped <CUDA's error>                         the GPU stopped in the group: the process ends
//   @done                                           every check ran
// (fields separated by tabs; numbers as C's %a, exact). Where the process hangs in a group (no
// line within the time limit: it is killed) or ends in one, that group's checks fail with what
// happened, and a new process runs the groups after it, without that group's paths.
#pragma once
#include "kernels/host/child_process.h"
#include "kernels/self_check.cuh"

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace self_check_process {

constexpr const char* kPathsVariable = "SPEEDRUN_SELF_CHECK_PATHS";
constexpr const char* kParentVariable = "SPEEDRUN_SELF_CHECK_PARENT";
constexpr const char* kDoneVariable = "SPEEDRUN_SELF_CHECK_DONE";  // the first check name of each group, tab-separated

// A group of checks may take this long before its process counts as hung: on a GPU each takes well
// under a second (the first a few, with the libraries' start), and a wait that never ends fails its
// launch first (the fused attention backward's dq turns after 5-20 s, the mbarrier phases of the
// warp-specialised kernels after 10 s: flash_attention.cuh, wgmma_tiles.cuh), which then reads as
// the GPU stopping.
constexpr double kSecondsPerGroup = 60;

// The paths' switches by name, as the process that checks them is told: "flash_attention=1 ...".
inline const std::vector<std::pair<const char*, bool KernelPaths::*>>& switches() {
  static const std::vector<std::pair<const char*, bool KernelPaths::*>> all = {
      {"flash_attention", &KernelPaths::flash_attention},
      {"fused_attention_backward", &KernelPaths::fused_attention_backward},
      {"warp_specialised_attention_forward", &KernelPaths::warp_specialised_attention_forward},
      {"fp8_head", &KernelPaths::fp8_head},
      {"fused_e5m2_gradient", &KernelPaths::fused_e5m2_gradient},
      {"batched_muon", &KernelPaths::batched_muon},
      {"fused_residual_add", &KernelPaths::fused_residual_add},
      {"fused_mlp_fc", &KernelPaths::fused_mlp_fc},
      {"fused_qkv", &KernelPaths::fused_qkv},
      {"qkv_backward_in_attention", &KernelPaths::qkv_backward_in_attention},
  };
  return all;
}

inline std::string switches_text(const KernelPaths& p) {
  std::string text;
  for (const auto& [name, member] : switches()) text += std::string(text.empty() ? "" : " ") + name + "=" + (p.*member ? "1" : "0");
  return text;
}

// `base` (the flags' paths: their cuBLASLt choices) with the switches of `text`.
inline KernelPaths with_switches(KernelPaths base, const std::string& text) {
  size_t at = 0;
  for (const auto& [name, member] : switches()) {
    const std::string word = std::string(name) + "=";
    at = text.find(word, at);
    if (at == std::string::npos || at + word.size() >= text.size())
      throw std::invalid_argument(std::string(kPathsVariable) + ": no " + name + "= in '" + text + "'");
    base.*member = text[at + word.size()] == '1';
  }
  return base;
}

inline const FastPath& path_named(const std::string& name) {
  for (const FastPath& p : fast_paths())
    if (name == p.name) return p;
  throw std::invalid_argument("self-check process: no fast path named '" + name + "'");
}
inline const char* name_of(bool KernelPaths::*member) {
  for (const FastPath& p : fast_paths())
    if (p.member == member) return p.name;
  throw std::invalid_argument("self-check process: a check of no fast path");
}

inline std::string number_text(double x) {
  char text[64];
  std::snprintf(text, sizeof text, "%a", x);
  return text;
}
inline std::string one_line(std::string text) {
  for (char& c : text)
    if (c == '\n' || c == '\t') c = ' ';
  return text;
}

// ---- the process that checks: run_self_check's groups reported as they go ----------------------

// Installs the listener that reports each group (before it runs, and its results after) and skips
// the groups named in `done` (an earlier process ran them), and ends the process where a group
// left the GPU stopped (a sticky error: every later call would fail).
inline void report_each_group(const std::string& done) {
  self_check::check_listener().starting = [done](const std::vector<self_check::CheckSpec>& specs) {
    if (("\t" + done + "\t").find("\t" + one_line(specs.front().name) + "\t") != std::string::npos) return false;
    std::printf("@group\t%zu\n", specs.size());
    for (const self_check::CheckSpec& s : specs)
      std::printf("@spec\t%s\t%s\t%s\n", name_of(s.path), number_text(s.bound).c_str(), one_line(s.name).c_str());
    std::fflush(stdout);
    return true;
  };
  self_check::check_listener().finished = [](const SelfCheckResult* first, size_t count) {
    if (const cudaError_t error = cudaDeviceSynchronize(); error != cudaSuccess) {
      (void)cudaGetLastError();  // clears an error that is not sticky; a sticky one stays
      if (cudaDeviceSynchronize() != cudaSuccess) {
        std::printf("@stopped\t%s\n", one_line(cudaGetErrorString(error)).c_str());
        std::fflush(stdout);
        std::_Exit(1);  // no teardown: every CUDA call would fail, and a hung one never return
      }
    }
    for (const SelfCheckResult* r = first; r != first + count; ++r)
      std::printf("@result\t%s\t%s\t%s\t%s\t%s\n", name_of(r->path), number_text(r->error).c_str(),
                  number_text(r->bound).c_str(), one_line(r->name).c_str(), one_line(r->failure).c_str());
    std::fflush(stdout);
  };
}

// ---- the trainer: what the processes reported ---------------------------------------------------

struct Report {
  std::vector<SelfCheckResult> results;          // the checks that ended
  std::vector<self_check::CheckSpec> unfinished;  // the checks of a group that started and did not end
  std::vector<std::string> groups;                // the first check of each group that started
  std::string stopped;                            // CUDA's error, where the GPU stopped
  bool done = false;
  std::vector<std::string> other_lines;  // anything else it printed
};

inline Report read_report(const std::vector<std::string>& lines) {
  Report report;
  for (const std::string& line : lines) {
    std::vector<std::string> fields;
    for (size_t start = 0;;) {
      const size_t tab = line.find('\t', start);
      fields.push_back(line.substr(start, tab - start));
      if (tab == std::string::npos) break;
      start = tab + 1;
    }
    const std::string& kind = fields[0];
    auto refuse = [&](const char* what) { throw std::runtime_error(std::string("self-check process: ") + what + " '" + line + "'"); };
    auto need = [&](size_t n) {
      if (fields.size() != n) refuse("a malformed line");
    };
    if (kind == "@group") {
      need(2);
      if (!report.unfinished.empty()) refuse("a group started in another:");
      report.groups.emplace_back();
    } else if (kind == "@spec") {
      need(4);
      if (report.groups.empty()) refuse("a check outside a group:");
      if (report.groups.back().empty()) report.groups.back() = fields[3];
      report.unfinished.push_back({fields[3], path_named(fields[1]).member, std::strtod(fields[2].c_str(), nullptr)});
    } else if (kind == "@result") {
      need(6);
      report.results.push_back({fields[4], path_named(fields[1]).member, std::strtod(fields[2].c_str(), nullptr),
                                std::strtod(fields[3].c_str(), nullptr), fields[5]});
      auto& u = report.unfinished;
      const auto spec = std::find_if(u.begin(), u.end(), [&](const auto& s) { return s.name == fields[4]; });
      if (spec == u.end()) refuse("a result of no check started:");
      u.erase(spec);
    } else if (kind == "@stopped") {
      need(2);
      report.stopped = fields[1];
    } else if (kind == "@done") {
      report.done = true;
    } else {
      report.other_lines.push_back(line);
    }
  }
  return report;
}

// run_self_check's results for `paths`, its groups run in processes started as `program` `args`
// (the trainer itself: its arguments give the process the run's flags), told the paths by
// kPathsVariable. A group that hangs for `seconds`, stops the GPU or ends its process fails with
// what happened; a new process then runs the groups after it (the groups done are named to it by
// kDoneVariable), that group's paths switched off. Each line read calls `on_progress` (the run's
// watchdog beats).
inline std::vector<SelfCheckResult> check_in_processes(const std::string& program, const std::vector<std::string>& args,
                                                       KernelPaths paths, double seconds = kSecondsPerGroup,
                                                       const std::function<void()>& on_progress = nullptr) {
  char seconds_text[32];
  std::snprintf(seconds_text, sizeof seconds_text, "%.0f", seconds);
  std::vector<SelfCheckResult> results;
  std::string done;
  for (;;) {
    // Not profiled: a profiler injected into the run (tools/kernel_profile.cpp) writes its file as
    // its process ends, which must be the run's, not this one's.
    const ChildOutcome child = run_child(program, args,
                                         {std::string(kPathsVariable) + "=" + switches_text(paths),
                                          std::string(kParentVariable) + "=" + std::to_string(getpid()),
                                          std::string(kDoneVariable) + "=" + done, "CUDA_INJECTION64_PATH"},
                                         seconds, [&](const std::string&) {
                                           if (on_progress) on_progress();
                                         });
    const Report report = read_report(child.lines);
    for (const std::string& line : report.other_lines) std::printf("%s\n", line.c_str());
    results.insert(results.end(), report.results.begin(), report.results.end());
    for (const std::string& group : report.groups) done += (done.empty() ? "" : "\t") + group;  // the last one too
    if (report.done) {  // every check ran: an end that went wrong after it changes no result
      if (child.exit_status != 0)
        std::fprintf(stderr, "WARNING: the self-check's process ended badly after its last check (%s%s)\n",
                     child.ending().c_str(), child.timed_out ? ", killed" : "");
      return results;
    }
    if (report.unfinished.empty())
      throw std::runtime_error("the self-check's process ended (" + child.ending() +
                               (child.timed_out ? std::string(", killed after ") + seconds_text + " s without a line" : "") +
                               ") outside its checks: its error is above");
    const std::string failure =
        child.timed_out           ? std::string("hung: no result in ") + seconds_text + " s (its process was ended)"
        : !report.stopped.empty() ? "stopped the GPU (" + report.stopped + "): its process ended"
                                  : "its process ended (" + child.ending() + ")";
    for (const self_check::CheckSpec& s : report.unfinished) {
      results.push_back({s.name, s.path, std::numeric_limits<double>::infinity(), s.bound, failure});
      paths.*s.path = false;  // a path that failed: the checks that hang on it (qkv backward in attention on flash) go too
    }
  }
}

}  // namespace self_check_process
