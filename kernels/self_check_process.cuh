// The start-up self-check in a process of its own. A fast path's kernel that traps or faults
// leaves its process's GPU context unusable, and one that hangs (a turn or a barrier phase that
// never comes) holds it for ever: in the trainer's own process either would end the run, where the
// self-check is there to fall back. So the trainer (train_gpt.cu) starts itself again with
// SPEEDRUN_SELF_CHECK_PATHS naming the paths to check; that process runs run_self_check and
// reports each group of checks as it starts and ends, on its standard output:
//   @group <count>                                  a group of checks starts (add_results' specs)
//   @spec <path> <bound> <check name>               count lines: the group's checks
//   @result <path> <error> <bound> <check name> <failure>   after the group, one per check
//   @stopped <CUDA's error>                         the GPU stopped in the group: the process ends
//   @done                                           every check ran
// (fields separated by tabs; numbers as C's %a, exact). Where the process hangs in a group (no
// line within the time limit: it is killed) or ends in one, that group's checks fail with what
// happened, and the paths not yet checked are checked in a new process.
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

// A group of checks may take this long before its process counts as hung: on a GPU each takes well
// under a second (the first a few, with the libraries' start), and the fused attention backward's
// turn wait traps after 5-20 s (flash_attention.cuh), which then reads as the GPU stopping.
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

// Installs the listener that reports each group (before it runs, and its results after), and ends
// the process where a group left the GPU stopped (a sticky error: every later call would fail).
inline void report_each_group() {
  self_check::check_listener().starting = [](const std::vector<self_check::CheckSpec>& specs) {
    std::printf("@group\t%zu\n", specs.size());
    for (const self_check::CheckSpec& s : specs)
      std::printf("@spec\t%s\t%s\t%s\n", name_of(s.path), number_text(s.bound).c_str(), s.name.c_str());
    std::fflush(stdout);
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
                  number_text(r->bound).c_str(), r->name.c_str(), one_line(r->failure).c_str());
    std::fflush(stdout);
  };
}

// ---- the trainer: what the processes reported ---------------------------------------------------

struct Report {
  std::vector<SelfCheckResult> results;          // the groups that ended
  std::vector<self_check::CheckSpec> unfinished;  // the group that started and did not end
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
    auto need = [&](size_t n) {
      if (fields.size() != n) throw std::runtime_error("self-check process: a malformed line '" + line + "'");
    };
    if (kind == "@group") {
      need(2);
      report.unfinished.clear();
    } else if (kind == "@spec") {
      need(4);
      report.unfinished.push_back({fields[3], path_named(fields[1]).member, std::strtod(fields[2].c_str(), nullptr)});
    } else if (kind == "@result") {
      need(6);
      report.results.push_back({fields[4], path_named(fields[1]).member, std::strtod(fields[2].c_str(), nullptr),
                                std::strtod(fields[3].c_str(), nullptr), fields[5]});
      report.unfinished.clear();  // a group's results come together
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

// run_self_check's results for `paths`, each group run in a process started as `program` `args`
// (the trainer itself: its arguments give the process the run's flags) and told the paths by
// kPathsVariable. A group that hangs for `seconds`, stops the GPU or ends its process fails with
// what happened; the paths that no group has checked yet go on in a new process.
inline std::vector<SelfCheckResult> check_in_processes(const std::string& program, const std::vector<std::string>& args,
                                                       KernelPaths paths, double seconds = kSecondsPerGroup) {
  std::vector<SelfCheckResult> results;
  for (;;) {
    // Not profiled: a profiler injected into the run (tools/kernel_profile.cpp) writes its file as
    // its process ends, which must be the run's, not this one's.
    const ChildOutcome child = run_child(
        program, args, {std::string(kPathsVariable) + "=" + switches_text(paths), "CUDA_INJECTION64_PATH"}, seconds);
    const Report report = read_report(child.lines);
    for (const std::string& line : report.other_lines) std::printf("%s\n", line.c_str());
    results.insert(results.end(), report.results.begin(), report.results.end());
    if (report.done && child.exit_status == 0 && !child.timed_out) return results;
    if (report.unfinished.empty())
      throw std::runtime_error("the self-check's process ended (" + child.ending() +
                               (child.timed_out ? ", killed after " + number_text(seconds) + " s without a line" : "") +
                               ") outside its checks: its error is above");
    char seconds_text[32];
    std::snprintf(seconds_text, sizeof seconds_text, "%.0f", seconds);
    const std::string failure =
        child.timed_out           ? std::string("hung: no result in ") + seconds_text + " s (its process was ended)"
        : !report.stopped.empty() ? "stopped the GPU (" + report.stopped + "): its process ended"
                                  : "its process ended (" + child.ending() + ")";
    for (const self_check::CheckSpec& s : report.unfinished)
      results.push_back({s.name, s.path, std::numeric_limits<double>::infinity(), s.bound, failure});
    // The next process checks the paths no group has reached: the ones checked are switched off.
    for (const SelfCheckResult& r : results) paths.*r.path = false;
    bool left = false;
    for (const FastPath& p : fast_paths()) left |= paths.*p.member;
    if (!left) return results;
  }
}

}  // namespace self_check_process
