// The CUDA emulator's own check of alignment (no GPU counterpart: there these accesses fault): a
// vector access through kernels/device_utils.cuh's helpers (load8 of bf16 and of fp32, store8) or
// a cp.async at an address that is not a multiple of its size stops the program with "misaligned
// address" and what was accessed, as the GPU's kernel fails; at an aligned address it runs. Each
// launch runs in a child process, since a refusal ends the program.
#include "check.h"
#include "kernels/device_utils.cuh"
#include "kernels/ptx.cuh"

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <functional>
#include <stdexcept>
#include <string>

namespace {

__global__ void load8_kernel(const bf16* in, float* out) {
  float v[8];
  load8(in, v);
  for (int i = 0; i < 8; ++i) out[i] = v[i];
}

__global__ void load8_fp32_kernel(const float* in, float* out) {
  float v[8];
  load8(in, v);
  for (int i = 0; i < 8; ++i) out[i] = v[i];
}

__global__ void store8_kernel(bf16* out) {
  const float v[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  store8(out, v);
}

__global__ void cp_async_kernel(const bf16* in, float* out) {
  extern __shared__ __align__(16) bf16 tile[];
  ptx::cp_async_16(tile, in);
  ptx::cp_async_commit();
  ptx::cp_async_wait_group<0>();
  out[0] = __bfloat162float(tile[0]);
}

struct Outcome {
  bool aborted;         // by a signal: SIGABRT
  int exit_code;        // otherwise
  std::string errors;   // what it wrote to stderr
};

// Runs `body` and waits for the device in a child process, its stderr captured.
Outcome in_child(const std::function<void()>& body) {
  int pipe_ends[2];
  if (pipe(pipe_ends) != 0) throw std::runtime_error("pipe failed");
  const pid_t child = fork();
  if (child < 0) throw std::runtime_error("fork failed");
  if (child == 0) {
    dup2(pipe_ends[1], STDERR_FILENO);
    close(pipe_ends[0]);
    body();
    _exit(cudaDeviceSynchronize() == cudaSuccess && cudaGetLastError() == cudaSuccess ? 0 : 1);
  }
  close(pipe_ends[1]);
  std::string errors;
  char buffer[256];
  for (ssize_t n; (n = read(pipe_ends[0], buffer, sizeof buffer)) > 0;) errors.append(buffer, size_t(n));
  close(pipe_ends[0]);
  int status = 0;
  waitpid(child, &status, 0);
  return {WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT, WIFEXITED(status) ? WEXITSTATUS(status) : -1, errors};
}

// launch(offset), an access `offset` bytes into a 256-byte aligned buffer: refused at `misaligned`
// with a message containing `refusal`, run at `aligned`.
void check_alignment(const char* refusal, const std::function<void(size_t)>& launch, size_t misaligned,
                     size_t aligned) {
  const Outcome refused = in_child([&] { launch(misaligned); }), ran = in_child([&] { launch(aligned); });
  std::printf("  %zu bytes in: %s", misaligned, refused.errors.c_str());
  CHECK(refused.aborted);
  CHECK(refused.errors.find(refusal) != std::string::npos);
  CHECK(!ran.aborted && ran.exit_code == 0 && ran.errors.empty());
}

// 256 device bytes to access (poisoned, as allocated) and room for eight floats out.
struct Buffers {
  Buffers() {
    if (cudaMalloc(&in, 256) != cudaSuccess || cudaMalloc(&out, 8 * sizeof(float)) != cudaSuccess)
      throw std::runtime_error("cudaMalloc failed");
  }
  ~Buffers() {
    cudaFree(in);
    cudaFree(out);
  }
  template <typename T>
  T* at(size_t offset) const {
    return reinterpret_cast<T*>(static_cast<char*>(in) + offset);
  }
  void* in = nullptr;
  float* out = nullptr;
};

}  // namespace

TEST_CASE("load8 of bf16 (one 16-byte load) 8 bytes off a 16-byte boundary stops: misaligned address") {
  Buffers b;
  check_alignment("misaligned address: const Bf16x8*",
                  [&](size_t offset) { load8_kernel<<<1, 1>>>(b.at<bf16>(offset), b.out); }, 8, 16);
}

TEST_CASE("load8 of fp32 (two 16-byte loads) 4 bytes off stops: misaligned address") {
  Buffers b;
  check_alignment("misaligned address: const float4*",
                  [&](size_t offset) { load8_fp32_kernel<<<1, 1>>>(b.at<float>(offset), b.out); }, 4, 32);
}

TEST_CASE("store8 of bf16 (one 16-byte store) 2 bytes off stops: misaligned address") {
  Buffers b;
  check_alignment("misaligned address: Bf16x8*", [&](size_t offset) { store8_kernel<<<1, 1>>>(b.at<bf16>(offset)); },
                  2, 48);
}

TEST_CASE("cp.async from a global address 8 bytes off stops: misaligned address") {
  Buffers b;
  check_alignment("cp.async global source",
                  [&](size_t offset) { cp_async_kernel<<<1, 1, 16>>>(b.at<bf16>(offset), b.out); }, 8, 64);
}

int main(int argc, char** argv) { return check::run_checks(argc, argv); }
