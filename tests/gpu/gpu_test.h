// Shared by the GPU tests: skip without a device (exit 77, CTest's skip code), what the CPU
// emulator leaves out, and the relative-error check (the arrays themselves: kernels/check_arrays.cuh).
#pragma once
#include "check.h"
#include "kernels/check_arrays.cuh"
#include "kernels/host/cuda_check.cuh"
#include "kernels/device_utils.cuh"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

constexpr int kSkipExitCode = 77;

// Whether there is a CUDA device; without one, says that the test is skipped.
inline bool have_device() {
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) return true;
  std::printf("no CUDA device: skipped\n");
  return false;
}

// The arguments select test cases by name (check::run_checks).
inline int run_gpu_checks(int argc, char** argv) { return have_device() ? check::run_checks(argc, argv) : kSkipExitCode; }

// A program of several suites (tests/emulator's trainer_suites): the first argument names the
// suite (its source file's name, e.g. test_training), the rest select its cases by name.
inline int run_gpu_suites(int argc, char** argv) {
  if (argc < 2) {
    std::printf("usage: %s SUITE [name fragments...] (SUITE: a test file's name, e.g. test_training)\n", argv[0]);
    return 2;
  }
  if (!have_device()) return kSkipExitCode;
  return check::run_checks(std::vector<std::string>(argv + 2, argv + argc), argv[1]);
}

// Built for the CPU emulator of the tests (tests/emulator) rather than for a GPU.
#ifdef SPEEDRUN_EMULATED
constexpr bool kEmulated = true;
#else
constexpr bool kEmulated = false;
#endif

// The subset of what the GPU runs that is sized for CI: the emulator runs it unless
// SPEEDRUN_EMULATE_FULL=1 asks for everything (the `emulated-full` tests, hours on two cores: README),
// and a GPU when SPEEDRUN_TEST_SUBSET=1 asks for it (tools/acceptance.sh sanitize: under
// compute-sanitizer, whose instrumentation would take minutes over record shapes).
inline bool testing_a_subset() {
  static const bool subset = [] {
    const char* v = std::getenv(kEmulated ? "SPEEDRUN_EMULATE_FULL" : "SPEEDRUN_TEST_SUBSET");
    const bool set = v && std::string(v) == "1";
    return kEmulated ? !set : set;
  }();
  return subset;
}

// Record-sized cases run on a GPU and in the full emulation; the subset leaves them out, and says
// so. Usage: if (at_record_shapes("the record's qkv projection")) check(...);
inline bool at_record_shapes(const char* what) {
  if (testing_a_subset()) std::printf("  %s: left out of the CI-sized subset (record shapes)\n", what);
  return !testing_a_subset();
}

#define CHECK_REL_ERROR(out, ref, bound)                                                         \
  do {                                                                                           \
    double rel_error_ = relative_error(out, ref);                                                \
    std::printf("  %-40s rel. error %.2e (bound %.0e)\n", #out, rel_error_, double(bound));      \
    CHECK(rel_error_ <= (bound));                                                                \
  } while (0)
