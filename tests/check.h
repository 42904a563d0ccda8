// A minimal test harness: CHECK records failures and keeps going; main returns run_checks().
#pragma once
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace check {

inline int& failures() { static int n = 0; return n; }

// A case and the source file that registered it (several suites may share one program).
struct Case { const char* name; std::function<void()> body; const char* file; };
inline std::vector<Case>& cases() { static std::vector<Case> all; return all; }

struct Register {
  Register(const char* name, std::function<void()> body, const char* file = "") {
    cases().push_back({name, std::move(body), file});
  }
};

// A source file's name without its folder and extension: "tests/gpu/test_model.cpp" -> "test_model".
inline std::string suite_of(const std::string& file) {
  const std::string name = file.substr(file.find_last_of('/') + 1);
  return name.substr(0, name.find('.'));
}

inline void fail(const char* file, int line, const std::string& what) {
  std::printf("  FAILED %s:%d: %s\n", file, line, what.c_str());
  ++failures();
}

// Whether a case runs under `filters`, name fragments: when its name contains one of the plain
// ones (or there are none) and none of those written "-fragment".
inline bool selected(const std::string& name, const std::vector<std::string>& filters) {
  bool any_included = false, included = false;
  for (const std::string& f : filters) {
    const bool exclude = f.rfind("-", 0) == 0;
    const bool matches = name.find(exclude ? f.substr(1) : f) != std::string::npos;
    if (exclude && matches) return false;
    any_included |= !exclude;
    included |= !exclude && matches;
  }
  return included || !any_included;
}

// Runs the selected cases, each timed, and returns the process exit code: 0 when all passed, 1
// when one failed or when the filters select nothing (a misspelt filter must not pass by running
// no case). CTest splits a long suite into several tests this way, so that they run side by side;
// the last part excludes the others' fragments, so that a new case always runs somewhere. Given a
// `suite`, only the cases registered by the source file of that name (suite_of) take part.
inline int run_checks(const std::vector<std::string>& filters = {}, const std::string& suite = "") {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines appear as they are printed, also into a file
  int failed_cases = 0, ran = 0;
  for (const Case& c : cases()) {
    if (!suite.empty() && suite_of(c.file) != suite) continue;
    if (!selected(c.name, filters)) continue;
    ++ran;
    int before = failures();
    std::printf("[ RUN  ] %s\n", c.name);
    std::fflush(stdout);
    const auto start = std::chrono::steady_clock::now();
    try {
      c.body();
    } catch (const std::exception& e) {
      fail(__FILE__, __LINE__, std::string("unexpected exception: ") + e.what());
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    bool ok = failures() == before;
    failed_cases += !ok;
    std::printf("[ %s ] %s (%.1f s)\n", ok ? " OK " : "FAIL", c.name, seconds);
  }
  if (ran == 0) {
    std::printf("no test case %s%smatches the filters given\n", suite.empty() ? "" : "of ",
                suite.empty() ? "" : (suite + " ").c_str());
    return 1;
  }
  std::printf("%d passed, %d failed\n", ran - failed_cases, failed_cases);
  return failed_cases == 0 ? 0 : 1;
}

// The filters are the program's arguments.
inline int run_checks(int argc, char** argv) { return run_checks(std::vector<std::string>(argv + 1, argv + argc)); }

}  // namespace check

#define CHECK_CONCAT2(a, b) a##b
#define CHECK_CONCAT(a, b) CHECK_CONCAT2(a, b)
#define TEST_CASE(name)                                                       \
  static void CHECK_CONCAT(test_body_, __LINE__)();                           \
  static check::Register CHECK_CONCAT(test_reg_, __LINE__)(name, CHECK_CONCAT(test_body_, __LINE__), __FILE__); \
  static void CHECK_CONCAT(test_body_, __LINE__)()

#define CHECK(cond) \
  do { if (!(cond)) check::fail(__FILE__, __LINE__, #cond); } while (0)

#define CHECK_NEAR(a, b, tol)                                                                   \
  do {                                                                                          \
    double check_a_ = (a), check_b_ = (b);                                                      \
    if (!(std::fabs(check_a_ - check_b_) <= (tol)))                                             \
      check::fail(__FILE__, __LINE__, std::string(#a " = ") + std::to_string(check_a_) +       \
                                          " vs " #b " = " + std::to_string(check_b_));          \
  } while (0)

// Expects `expr` to throw an exception whose message contains every one of the given fragments.
#define CHECK_THROWS_WITH(expr, ...)                                                            \
  do {                                                                                          \
    bool check_threw_ = false;                                                                  \
    try { expr; } catch (const std::exception& e) {                                             \
      check_threw_ = true;                                                                      \
      for (const char* frag : {__VA_ARGS__})                                                    \
        if (std::string(e.what()).find(frag) == std::string::npos)                              \
          check::fail(__FILE__, __LINE__, std::string("message '") + e.what() +                 \
                                              "' lacks '" + frag + "'");                        \
    }                                                                                           \
    if (!check_threw_) check::fail(__FILE__, __LINE__, #expr " did not throw");                 \
  } while (0)
