// The CUDA emulator's own checks, where a GPU faults, fails or hands out garbage (no GPU
// counterpart: there these kernels fail or read garbage):
// - a vector access through kernels/device_utils.cuh's helpers (load8 of bf16 and of fp32,
//   store8, load4 and store4 of bf16) or a cp.async at an address that is not a multiple of its size stops the program with
//   "misaligned address" and what was accessed; at an aligned address it runs;
// - static __shared__ variables hold poison as each block starts, and together with the dynamic
//   shared memory they must fit the GPU's limits;
// - cuBLASLt answers "not supported" to an FP8 product whose scale pointer is off a 16-byte
//   boundary, as cuBLASLt 13.1 did on an H200 (its heuristic had offered an algorithm); its
//   stand-in's fp32 sums are the same, bitwise, whichever of its tiles an element falls in;
// - the warp-specialised kernels' mbarriers, TMA copies, named barriers and setmaxnreg: a ring of
//   TMA-fed stages shared by a producer and two consumer warpgroups in turns copies exactly and
//   alternates; a missed release, a wait on the wrong phase parity, a consumer that never waits, a
//   producer that keeps its registers (or frees too few), fewer bytes announced than copied, an unpublished init,
//   bytes that are no tensor map and a hand-over never taken (arrivals left on a named barrier at
//   the exit) each stop the program (a deadlock where the GPU would hang), as does a wgmma that
//   reads a TMA copy its thread never waited for, and
//   the host refuses a map the driver refuses, naming the tensor (these kernels live in
//   tests/gpu/tma_probes.cuh: gpu_device runs their bug-free forms on a GPU, exact answers checked);
// - shared memory written with plain stores and read by a wgmma or a TMA store with no
//   fence.proxy.async after the writes stops the program (checked in each launch's first block);
// - TMA stores (an epilogue's, as our GEMM issues them): staged boxes land in place; a store issued
//   before the barrier after the staging writes stores rows not yet staged, and a box reused before
//   its store's read wait and a thread that exits without waiting for its stores each stop the
//   program;
// - lazy streams (work run only when something waits for it): a stream that reads another's result
//   without waiting for its event, and a page-locked staging buffer rewritten before its copy ran,
//   show (the old value, the new one), and with the waits not;
// - cuSOLVER's syevd reports a factor it cannot decompose by a positive info (LAPACK's convention;
//   what the library answers for a NaN factor is unverified), and REKLS then stops naming the
//   factor (docs/ERRORS.md);
// - a launch's blocks run side by side, one resident an SM (8 here), taking turns between barriers
//   in an order drawn anew each launch: blocks that wait on each other's turns through global
//   memory run, and a wait on a block that cannot become resident is a deadlock that names the spin;
//   an integer atomic ends its block's turn, so a counter moved on before the barrier after the data
//   it releases shows (the other block reads the data unwritten).
// - under programmatic dependent launch a thread that loads before its griddepcontrol.wait, or
//   exits without one, stops the program; launched plainly the same kernels run;
// - a bounded wait's end (ptx::fail_launch) stops the program naming the wait;
// A launch that may be refused runs in a child process, since a refusal ends the program.
#include "check.h"
#include "gpu/tma_probes.cuh"
#include "kernels/check_arrays.cuh"
#include "kernels/host/cuda_check.cuh"
#include "kernels/device_utils.cuh"
#include "kernels/ptx.cuh"
#include "kernels/rekls.cuh"
#include "kernels/tensor_map.cuh"
#include "kernels/wgmma_tiles.cuh"

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace tma_probes;

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

__global__ void load4_kernel(const bf16* in, float* out) {
  float v[4];
  load4(in, v);
  for (int i = 0; i < 4; ++i) out[i] = v[i];
}

__global__ void store4_kernel(bf16* out) {
  const float v[4] = {1, 2, 3, 4};
  store4(out, v);
}

__global__ void cp_async_kernel(const bf16* in, float* out) {
  extern __shared__ __align__(16) bf16 tile[];
  ptx::cp_async_16(tile, in);
  ptx::cp_async_commit();
  ptx::cp_async_wait_group<0>();
  out[0] = __bfloat162float(tile[0]);
}

// Copies 16 bytes into a tile twice, the second copy issued after the first's group landed
// (waited) or while it is still in flight (not waited: the copies may land in either order).
__global__ void cp_async_twice_kernel(const bf16* in, float* out, bool wait_between) {
  extern __shared__ __align__(16) bf16 tile[];
  ptx::cp_async_16(tile, in);
  ptx::cp_async_commit();
  if (wait_between) ptx::cp_async_wait_group<0>();
  ptx::cp_async_16(tile, in + 8);
  ptx::cp_async_commit();
  ptx::cp_async_wait_group<0>();
  out[0] = __bfloat162float(tile[0]);
}

// Reads a static __shared__ variable before writing it: garbage on the GPU, poison here, in every
// block (the previous block's value would hide a missing write).
__global__ void read_before_write_kernel(uint32_t* out) {
  __shared__ uint32_t value;
  out[blockIdx.x] = value;
  value = 1;
}

// Block b waits (thread 0, a spin that sleeps) until `counter` reaches its turn, the last block's
// first, writes its index at order[turn] and passes the turn on: the grid runs only if all its
// blocks are resident together, as the fused attention backward's dq order needs its tickets' CTAs.
__global__ void reverse_turns_kernel(int* counter, int* order) {
  const int turn = int(gridDim.x - 1 - blockIdx.x);
  if (threadIdx.x == 0) {
    while (*reinterpret_cast<volatile int*>(counter) != turn) __nanosleep(64);
    order[turn] = int(blockIdx.x);
    __threadfence();
    atomicAdd(counter, 1);
  }
  __syncthreads();
}

// Block 1 releases block 0 by an atomic; block 0's warp polls together, lane 0 reading the flag and
// shuffling it to the others, each sleeping while it is unset (a warp operation in the spin).
__global__ void shuffled_spin_kernel(int* flag, int* out) {
  if (blockIdx.x == 1) {
    if (threadIdx.x == 0) atomicAdd(flag, 1);
    return;
  }
  int seen;
  do {
    seen = threadIdx.x % 32 == 0 ? *reinterpret_cast<volatile int*>(flag) : 0;
    seen = __shfl_sync(~0u, seen, 0);
    if (!seen) __nanosleep(64);
  } while (!seen);
  if (threadIdx.x == 0) *out = seen;
}

// Two blocks pass a ball `passes` times by plain stores, each spinning until it holds the ball:
// handing it on counts no progress in the emulator, its spins do.
__global__ void ball_kernel(int* ball, int passes) {
  if (threadIdx.x != 0) return;
  volatile int* held = ball;
  for (int pass = int(blockIdx.x); pass < passes; pass += 2) {
    while (*held != pass) __nanosleep(64);
    *held = pass + 1;
  }
}

// Block 0's warps each write their word of `data`; thread 0 then releases the words to block 1 by
// moving `flag` on: after the barrier that follows the writes, or (`early`, the bug) before it.
// Block 1 waits for the flag and sums the words into *out.
__global__ void release_kernel(unsigned* data, int* flag, unsigned* out, bool early) {
  const int warps = int(blockDim.x / 32);
  if (blockIdx.x == 0) {
    if (threadIdx.x % 32 == 0) data[threadIdx.x / 32] = threadIdx.x / 32 + 1;
    if (early && threadIdx.x == 0) atomicAdd(flag, 1);
    __syncthreads();
    if (!early && threadIdx.x == 0) {
      __threadfence();
      atomicAdd(flag, 1);
    }
  } else if (threadIdx.x == 0) {
    while (*reinterpret_cast<volatile int*>(flag) == 0) __nanosleep(64);
    unsigned sum = 0;
    for (int w = 0; w < warps; ++w) sum += data[w];
    *out = sum;
  }
}

// Each block writes its index into the next slot of `log` once a step, for `steps` steps
// between barriers (two warps, so that a barrier stops the block until the other warp comes).
__global__ void interleaving_kernel(int* next, int* log, int steps) {
  for (int step = 0; step < steps; ++step) {
    if (threadIdx.x == 0) log[atomicAdd(next, 1)] = int(blockIdx.x);
    __syncthreads();
  }
}

// 32 KiB of static shared memory beside the dynamic memory of the launch.
__global__ void static_and_dynamic_kernel(float* out) {
  __shared__ float big[8192];
  extern __shared__ float dynamic[];
  big[0] = 1.0f;
  dynamic[0] = big[0];
  out[0] = dynamic[0];
}

// A tile the threads write with plain stores, read by a wgmma: a warpgroup stages the store
// kernel's box (tile 0), fences its writes for the async proxy or not, meets at a barrier and
// issues S = B B^T over its first 16 columns (m64n64k16).
__global__ void __launch_bounds__(128, 1) staged_wgmma_kernel(float* out, bool fence) {
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* box = wgmma_tiles::align_to_swizzle_atom(shared_tiles);
  for (int i = threadIdx.x; i < kStoreRows * kStoreCols; i += 128) {
    const int r = i / kStoreCols, c = i % kStoreCols;
    box[wgmma_tiles::swizzled<kStoreRows>(r, c)] = __float2bfloat16(float(64 * r + c) / 1024);
  }
  if (fence) ptx::fence_proxy_async_shared();
  __syncthreads();
  out[threadIdx.x] = box_product(box);
}

// Under programmatic dependent launch (kernels/host/launch.cuh): eight values loaded before the
// thread's griddepcontrol.wait (a bug: the kernel before it may still write them) or after it.
__global__ void load_around_wait_kernel(const bf16* in, float* out, bool load_first) {
  float v[8];
  if (load_first) load8(in, v);
  ptx::griddepcontrol_wait();
  if (!load_first) load8(in, v);
  out[threadIdx.x] = v[0];
}

// A kernel without griddepcontrol.wait (a bug under programmatic dependent launch).
__global__ void never_waits_kernel(float* out) { out[threadIdx.x] = 1; }

// out[0] = in[0], one thread (a stream's read of what another stream wrote).
__global__ void copy_one_kernel(const float* in, float* out) { out[0] = in[0]; }

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
    try {
      body();
    } catch (const std::exception& e) {  // the child must not go on into the parent's other tests
      std::fprintf(stderr, "exception: %s\n", e.what());
      _exit(2);
    }
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

// launch(refused_at) stops the program with a message containing `refusal`; launch(run_at) runs.
void check_refused(const char* refusal, const std::function<void(size_t)>& launch, size_t refused_at, size_t run_at) {
  const Outcome refused = in_child([&] { launch(refused_at); }), ran = in_child([&] { launch(run_at); });
  std::printf("  at %zu: %s", refused_at, refused.errors.c_str());
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

// D [rows, cols] = A^T B through cuBLASLt's "TN" (A stored [k, rows] and B [k, cols] column-major, of
// `operands`' type; D fp32 with leading dimension ld), with the given FP8 scale pointers and
// alignment promise: the product's status (the heuristic must offer an algorithm).
struct TnProduct {
  cudaDataType_t operands;
  int k, rows, cols, ld;
  const float *a_scale = nullptr, *b_scale = nullptr;
  uint32_t alignment = 256;  // of every operand, in bytes
};
cublasStatus_t tn_product(cublasLtHandle_t handle, const TnProduct& p, const void* A, const void* B, float* D) {
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t a, b, c;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t t = CUBLAS_OP_T, none = CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof none));
  if (p.a_scale)
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &p.a_scale, sizeof p.a_scale));
  if (p.b_scale)
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &p.b_scale, sizeof p.b_scale));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a, p.operands, p.k, p.rows, p.k));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b, p.operands, p.k, p.cols, p.k));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c, CUDA_R_32F, p.rows, p.cols, p.ld));
  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  for (auto attribute : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                         CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attribute, &p.alignment, sizeof p.alignment));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, c, c, pref, 1, &result, &found));
  CHECK(found == 1);
  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t status =
      cublasLtMatmul(handle, desc, &alpha, A, a, B, b, &beta, D, c, D, c, &result.algo, nullptr, 0, nullptr);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(a);
  cublasLtMatrixLayoutDestroy(b);
  cublasLtMatrixLayoutDestroy(c);
  cublasLtMatmulDescDestroy(desc);
  return status;
}

}  // namespace

TEST_CASE("load8 of bf16 (one 16-byte load) 8 bytes off a 16-byte boundary stops: misaligned address") {
  Buffers b;
  check_refused("misaligned address: const Bf16x8*",
                  [&](size_t offset) { load8_kernel<<<1, 1>>>(b.at<bf16>(offset), b.out); }, 8, 16);
}

TEST_CASE("load8 of fp32 (two 16-byte loads) 4 bytes off stops: misaligned address") {
  Buffers b;
  check_refused("misaligned address: const float4*",
                  [&](size_t offset) { load8_fp32_kernel<<<1, 1>>>(b.at<float>(offset), b.out); }, 4, 32);
}

TEST_CASE("store8 of bf16 (one 16-byte store) 2 bytes off stops: misaligned address") {
  Buffers b;
  check_refused("misaligned address: Bf16x8*", [&](size_t offset) { store8_kernel<<<1, 1>>>(b.at<bf16>(offset)); },
                  2, 48);
}

TEST_CASE("load4 and store4 of bf16 (one 8-byte access) 2 bytes off stop: misaligned address") {
  Buffers b;
  check_refused("misaligned address: const Bf16x4*",
                  [&](size_t offset) { load4_kernel<<<1, 1>>>(b.at<bf16>(offset), b.out); }, 2, 8);
  check_refused("misaligned address: Bf16x4*", [&](size_t offset) { store4_kernel<<<1, 1>>>(b.at<bf16>(offset)); },
                  6, 16);
}

TEST_CASE("cp.async from a global address 8 bytes off stops: misaligned address") {
  Buffers b;
  check_refused("cp.async global source",
                  [&](size_t offset) { cp_async_kernel<<<1, 1, 16>>>(b.at<bf16>(offset), b.out); }, 8, 64);
}

TEST_CASE("a cp.async to shared bytes another copy in flight writes stops the program; after a wait it runs") {
  Buffers b;
  check_refused("a cp.async to shared memory that another copy still in flight writes",
                [&](size_t wait_between) { cp_async_twice_kernel<<<1, 1, 16>>>(b.at<bf16>(0), b.out, wait_between); },
                0, 1);
}

TEST_CASE("programmatic dependent launch: a load before griddepcontrol.wait, or no wait, stops; a plain launch needs none") {
  Buffers b;
  const bf16* in = b.at<bf16>(0);
  auto launched = [&](bool programmatic, auto kernel, auto... args) {
    return in_child([&] {
      programmatic_dependent_launch = programmatic;
      CUDA_CHECK(launch_kernel(kernel, 2, 64, 0, nullptr, args...));
    });
  };
  const Outcome early = launched(true, load_around_wait_kernel, in, b.out, true);
  const Outcome never = launched(true, never_waits_kernel, b.out);
  std::printf("  %s  %s", early.errors.c_str(), never.errors.c_str());
  CHECK(early.aborted && early.errors.find("accessed memory (const Bf16x8*) before its griddepcontrol.wait") !=
                             std::string::npos);
  CHECK(never.aborted && never.errors.find("exited without griddepcontrol.wait") != std::string::npos);
  for (const Outcome& ran : {launched(true, load_around_wait_kernel, in, b.out, false),
                             launched(false, load_around_wait_kernel, in, b.out, true),
                             launched(false, never_waits_kernel, b.out)})
    CHECK(!ran.aborted && ran.exit_code == 0 && ran.errors.empty());
}

TEST_CASE("launch_kernel returns a refused launch's error once: the next cudaGetLastError is clean") {
  Buffers b;
  CHECK(launch_kernel(never_waits_kernel, 1, 2048, 0, nullptr, b.out) == cudaErrorInvalidConfiguration);
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("a static __shared__ variable read before it is written holds poison in every block") {
  Buffers b;
  uint32_t* out = b.at<uint32_t>(0);
  read_before_write_kernel<<<2, 1>>>(out);
  uint32_t read[2];
  CHECK(cudaMemcpy(read, out, sizeof read, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(read[0] == 0xFFFFFFFFu && read[1] == 0xFFFFFFFFu);
}

// The emulated GPU's SMs: as many blocks run side by side.
int multiprocessors() {
  int count = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, 0));
  return count;
}
const int kEmulatedBlocks = multiprocessors();

TEST_CASE("blocks that wait on each other through global memory run side by side, one an SM") {
  DeviceBuffer<int> counter(1), order(kEmulatedBlocks);
  CUDA_CHECK(cudaMemset(counter.get(), 0, sizeof(int)));
  reverse_turns_kernel<<<kEmulatedBlocks, 64>>>(counter.get(), order.get());
  CUDA_CHECK_LAUNCH();
  const std::vector<int> got = order.download();
  for (int turn = 0; turn < kEmulatedBlocks; ++turn) CHECK(got[turn] == kEmulatedBlocks - 1 - turn);
}

TEST_CASE("spins that meet in a warp shuffle, or hand a value on by plain stores, run to their end") {
  DeviceBuffer<int> flag(1), out(1);
  CUDA_CHECK(cudaMemset(flag.get(), 0, sizeof(int)));
  shuffled_spin_kernel<<<2, 32>>>(flag.get(), out.get());
  CUDA_CHECK_LAUNCH();
  CHECK(out.download()[0] == 1);
  constexpr int kPasses = 50;
  CUDA_CHECK(cudaMemset(flag.get(), 0, sizeof(int)));
  ball_kernel<<<2, 32>>>(flag.get(), kPasses);
  CUDA_CHECK_LAUNCH();
  CHECK(flag.download()[0] == kPasses);
}

TEST_CASE("a spin on a block that cannot become resident (one block more than SMs) is a deadlock, named") {
  DeviceBuffer<int> counter(1), order(kEmulatedBlocks + 1);
  check_refused("1 thread(s) from 0 wait for a value in global memory that no resident block changes (a spin with "
                "__nanosleep) | block (1, 0, 0): ",
                [&](size_t blocks) {
                  CUDA_CHECK(cudaMemset(counter.get(), 0, sizeof(int)));
                  reverse_turns_kernel<<<unsigned(blocks), 64>>>(counter.get(), order.get());
                },
                kEmulatedBlocks + 1, kEmulatedBlocks);
}

// A bounded wait's end (ptx::fail_launch, where a phase never completes on the GPU): the program stops
// naming the wait; its block of threads is not run on.
__global__ void fail_launch_kernel(float* out, int fail) {
  if (fail && threadIdx.x == 5) ptx::fail_launch("the test's wait for a phase that never completes");
  out[threadIdx.x % 8] = 1;
}

TEST_CASE("a failed launch (a bounded wait's end) stops the program naming the wait") {
  Buffers buffers;
  check_refused("a kernel failed its launch (a trap on the GPU): the test's wait for a phase that never completes",
                [&](size_t fail) { fail_launch_kernel<<<1, 32>>>(buffers.out, int(fail)); }, 1, 0);
}

TEST_CASE("the resident blocks take turns between barriers, in another order in each launch") {
  const int kSteps = 4, kEntries = kEmulatedBlocks * kSteps;
  DeviceBuffer<int> next(1), log(kEntries);
  std::vector<std::vector<int>> logs;
  for (int launch = 0; launch < 2; ++launch) {
    CUDA_CHECK(cudaMemset(next.get(), 0, sizeof(int)));
    interleaving_kernel<<<kEmulatedBlocks, 64>>>(next.get(), log.get(), kSteps);
    CUDA_CHECK_LAUNCH();
    logs.push_back(log.download());
    // One block after another would change blocks kEmulatedBlocks - 1 times along the log.
    int changes = 0;
    std::string order;
    for (int i = 0; i < kEntries; ++i) {
      changes += i > 0 && logs.back()[i] != logs.back()[i - 1];
      order += std::to_string(logs.back()[i]);
    }
    std::printf("  launch %d: the blocks' steps in the order they ran: %s (%d changes of block)\n", launch,
                order.c_str(), changes);
    CHECK(changes > 2 * kEmulatedBlocks);
  }
  CHECK(logs[0] != logs[1]);
}

TEST_CASE("a counter moved on before the barrier that follows the data it releases shows: other blocks run at once") {
  constexpr int kWarps = 4, kLaunches = 8;
  DeviceBuffer<unsigned> data(kWarps), out(1);
  DeviceBuffer<int> flag(1);
  for (bool early : {false, true}) {
    int wrong = 0;
    for (int launch = 0; launch < kLaunches; ++launch) {
      CUDA_CHECK(cudaMemset(data.get(), 0xFF, kWarps * sizeof(unsigned)));
      CUDA_CHECK(cudaMemset(flag.get(), 0, sizeof(int)));
      release_kernel<<<2, 32 * kWarps>>>(data.get(), flag.get(), out.get(), early);
      CUDA_CHECK_LAUNCH();
      wrong += out.download()[0] != kWarps * (kWarps + 1) / 2;
    }
    std::printf("  released %s the barrier: a wrong sum in %d of %d launches\n", early ? "before" : "after", wrong,
                kLaunches);
    CHECK(early ? wrong > 0 : wrong == 0);
  }
}

TEST_CASE("32 KiB of static shared memory beside 20 KiB of dynamic (52 of the 48 allowed) stops") {
  Buffers b;
  check_refused("bytes of static __shared__ variables beside 20480 bytes of dynamic shared memory",
                [&](size_t dynamic_bytes) { static_and_dynamic_kernel<<<1, 1, dynamic_bytes>>>(b.out); }, 20 << 10,
                16 << 10);
}

TEST_CASE("TMA ring: a producer and two consumer warpgroups copy every box exactly, in turns") {
  Ring ring;
  ring.run(RingMistake::none);
  bool alternated = false;
  CHECK(ring_wrong_elements(ring, &alternated) == 0);
  CHECK(alternated);
}

TEST_CASE("TMA ring: each injected bug stops the program, naming what went wrong") {
  struct Case {
    RingMistake mistake;
    const char *what, *refusal;
  };
  const Case cases[] = {
      {RingMistake::missed_release, "a consumer warpgroup never releases its stage",
       "1 thread(s) from 0 wait for an mbarrier phase that never completes, at static shared byte 16"},
      {RingMistake::wrong_parity, "consumers wait on the wrong phase parity",
       "thread(s) from 128 wait for an mbarrier phase that never completes, at static shared byte 0"},
      {RingMistake::no_wait, "consumers read without waiting", "an earlier copy, not yet waited for, also fills"},
      {RingMistake::no_decrease, "the producer keeps its registers", "registers (setmaxnreg.inc) that no warp frees"},
      {RingMistake::short_announce, "half the bytes announced", "TMA copies of 8192 bytes on a phase"},
      {RingMistake::unpublished_init, "no fence.mbarrier_init", "no fence.mbarrier_init made visible"},
      {RingMistake::turn_left, "the last hand-over never taken", "named barrier 1 has 128 arrivals left"},
      {RingMistake::small_decrease, "the producer keeps 32 registers", "registers (setmaxnreg.inc) that no warp frees"},
  };
  for (const Case& c : cases) {
    const Outcome o = in_child([&] {
      Ring ring;
      ring.run(c.mistake);
    });
    std::printf("  %s: %s", c.what, o.errors.c_str());
    CHECK(o.aborted);
    CHECK(o.errors.find(c.refusal) != std::string::npos);
  }
  const Outcome garbage = in_child([] {
    Ring ring;
    std::memset(&ring.map, 0, sizeof ring.map);
    ring.run(RingMistake::none);
  });
  std::printf("  a zeroed map: %s", garbage.errors.c_str());
  CHECK(garbage.aborted);
  CHECK(garbage.errors.find("not a tensor map") != std::string::npos);
}

// On the GPU a thread sees a TMA copy only after its own wait for the copy's phase; here the first
// waiter lands it for all, so the wgmma operands are checked per thread.
TEST_CASE("TMA then wgmma: a warp that issues without waiting for the copy's phase stops the program") {
  auto run = [](int skip_warp) {
    return in_child([&] {
      Ring ring;
      if (tma_wgmma_wrong_threads(ring, skip_warp) != 0) std::abort();
    });
  };
  const Outcome waited = run(-1), skipped = run(5);
  std::printf("  warp 5 skips its wait: %s", skipped.errors.c_str());
  CHECK(!waited.aborted && waited.exit_code == 0 && waited.errors.empty());
  CHECK(skipped.aborted);
  CHECK(skipped.errors.find("wgmma's A of thread 160 reads shared memory a TMA copy filled before this thread waited") !=
        std::string::npos);
}

// TMA stores: the staged boxes land unswizzled where the map says; the box's shared memory must not
// change between a store's issue and the wait for it, and a thread must wait for its stores.
TEST_CASE("TMA store: staged boxes land in place; a missing barrier, reuse before the read wait, no wait show") {
  CHECK(tma_store_wrong_elements(StoreMistake::none) == 0);
  // the leader's warp runs ahead of the others here: it stores their rows before they are staged
  const size_t unstaged = tma_store_wrong_elements(StoreMistake::no_barrier);
  std::printf("  the store issued before the other warps staged: %zu of %d elements wrong\n", unstaged,
              kStoreRows * kStoreCols * kStoreTiles);
  CHECK(unstaged > 0);
  struct Case {
    StoreMistake mistake;
    const char *what, *refusal;
  };
  const Case cases[] = {
      {StoreMistake::no_read_wait, "the box reused before the read wait", "reused before cp.async.bulk.wait_group.read"},
      {StoreMistake::no_final_wait, "no wait before the exit", "exited with TMA stores it never waited for"},
      {StoreMistake::no_fence, "the staging writes never fenced for the async proxy",
       "a TMA store's box of thread 0 reads dynamic shared byte"},
  };
  for (const Case& c : cases) {
    const Outcome o = in_child([&] { tma_store_wrong_elements(c.mistake); });
    std::printf("  %s: %s", c.what, o.errors.c_str());
    CHECK(o.aborted);
    CHECK(o.errors.find(c.refusal) != std::string::npos);
  }
}

// On the GPU plain stores reach wgmma (the async proxy) only through fence.proxy.async; here a read
// of bytes written since the block's last fence stops the program.
TEST_CASE("a tile written with plain stores and read by a wgmma without fence.proxy.async stops the program") {
  auto run = [](bool fence) {
    return in_child([&] {
      DeviceBuffer<float> out(128);
      CUDA_CHECK(cudaFuncSetAttribute(staged_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      int(kStoreSharedBytes)));
      staged_wgmma_kernel<<<1, 128, kStoreSharedBytes>>>(out.get(), fence);
      CUDA_CHECK_LAUNCH();
      if (!all_finite(to_double(out.download()))) std::abort();
    });
  };
  const Outcome fenced = run(true), unfenced = run(false);
  std::printf("  no fence: %s", unfenced.errors.c_str());
  CHECK(!fenced.aborted && fenced.exit_code == 0 && fenced.errors.empty());
  CHECK(unfenced.aborted);
  CHECK(unfenced.errors.find("a wgmma operand of thread ") != std::string::npos);
  CHECK(unfenced.errors.find("written since the block's last fence.proxy.async") != std::string::npos);
}

// Lazy streams run work only when something waits for it (cuda_emulator.h): a stream that reads
// another's result without waiting for its event reads what was there before, and a page-locked
// source rewritten before its copy ran is copied as rewritten; with the waits, as on the GPU.
TEST_CASE("lazy streams: a read without the wait for the writer's event, and a staging buffer reused early, show") {
  emu::LazyStreamsScope lazy;
  cudaStream_t writer, reader;
  CUDA_CHECK(cudaStreamCreateWithFlags(&writer, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamCreateWithFlags(&reader, cudaStreamNonBlocking));
  cudaEvent_t written;
  CUDA_CHECK(cudaEventCreateWithFlags(&written, cudaEventDisableTiming));
  DeviceBuffer<float> x(1), y(1);
  auto read_after_write = [&](bool wait) {
    x.upload({1.0f});
    const std::vector<float> two = {2.0f};
    CUDA_CHECK(cudaMemcpyAsync(x.get(), two.data(), sizeof(float), cudaMemcpyHostToDevice, writer));
    CUDA_CHECK(cudaEventRecord(written, writer));
    if (wait) CUDA_CHECK(cudaStreamWaitEvent(reader, written, 0));
    copy_one_kernel<<<1, 1, 0, reader>>>(x.get(), y.get());
    CUDA_CHECK_LAUNCH();
    CUDA_CHECK(cudaStreamSynchronize(reader));
    const float read = y.download()[0];
    CUDA_CHECK(cudaDeviceSynchronize());
    return read;
  };
  CHECK(read_after_write(true) == 2.0f);
  CHECK(read_after_write(false) == 1.0f);  // the writer's copy had not run
  float* staging = nullptr;
  CUDA_CHECK(cudaMallocHost(&staging, sizeof(float)));
  auto upload_then_reuse = [&](bool wait) {
    *staging = 3.0f;
    CUDA_CHECK(cudaMemcpyAsync(x.get(), staging, sizeof(float), cudaMemcpyHostToDevice, writer));
    if (wait) CUDA_CHECK(cudaStreamSynchronize(writer));
    *staging = 4.0f;  // the next upload's value
    CUDA_CHECK(cudaStreamSynchronize(writer));
    return x.download()[0];
  };
  CHECK(upload_then_reuse(true) == 3.0f);
  CHECK(upload_then_reuse(false) == 4.0f);  // copied as rewritten
  // In stream order, correct programs get CUDA's results: a page-locked buffer up and back down,
  // a copy between host buffers (synchronous).
  *staging = 5.0f;
  CUDA_CHECK(cudaMemcpyAsync(x.get(), staging, sizeof(float), cudaMemcpyHostToDevice, writer));
  CUDA_CHECK(cudaMemcpyAsync(staging, x.get(), sizeof(float), cudaMemcpyDeviceToHost, writer));
  CUDA_CHECK(cudaStreamSynchronize(writer));
  CHECK(*staging == 5.0f);
  const float seven = 7.0f;
  CUDA_CHECK(cudaMemcpyAsync(staging, &seven, sizeof(float), cudaMemcpyHostToHost, writer));
  CHECK(*staging == 7.0f);
  CUDA_CHECK(cudaFreeHost(staging));
  CUDA_CHECK(cudaEventDestroy(written));
  CUDA_CHECK(cudaStreamDestroy(writer));
  CUDA_CHECK(cudaStreamDestroy(reader));
}

TEST_CASE("TMA map: a start off 16 bytes or rows a stride not a multiple of 16 bytes are refused, naming the tensor") {
  DeviceBuffer<bf16> matrix(4096);
  CHECK_THROWS_WITH(bf16_tile_map("q", matrix.get() + 1, 16, 64, 64, 16, 64), "TMA map of q: cuTensorMapEncodeTiled");
  CHECK_THROWS_WITH(bf16_tile_map("k", matrix.get(), 16, 60, 60, 16, 60), "TMA map of k: cuTensorMapEncodeTiled");
  CHECK_THROWS_WITH(bf16_tile_map("v", matrix.get(), 16, 128, 128, 16, 128), "TMA map of v: cuTensorMapEncodeTiled");
  bf16_tile_map("y", matrix.get(), 16, 128, 256, 16, 64);  // accepted
}

TEST_CASE("an FP8 product with a scale pointer 4 or 8 bytes off a 16-byte boundary is not supported") {
  const int n = 16;  // C[n, n] = A^T B, both stored [k = n, n] column-major: FP8's "TN"
  Buffers b;
  void *operands = nullptr, *out = nullptr;
  CUDA_CHECK(cudaMalloc(&operands, 2 * n * n));
  CUDA_CHECK(cudaMemset(operands, 0x38, 2 * n * n));  // e4m3 1.0
  CUDA_CHECK(cudaMalloc(&out, n * n * sizeof(float)));
  const std::vector<float> ones(64, 1.0f);  // the scales, anywhere in the 256 bytes
  CUDA_CHECK(cudaMemcpy(b.in, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));
  cublasLtHandle_t handle;
  CUBLAS_CHECK(cublasLtCreate(&handle));
  auto product = [&](size_t scale_offset) {
    const char* first = static_cast<const char*>(operands);
    return tn_product(handle, {CUDA_R_8F_E4M3, n, n, n, n, b.at<float>(0), b.at<float>(scale_offset)}, first,
                      first + n * n, static_cast<float*>(out));
  };
  for (size_t offset : {4, 8}) {
    const cublasStatus_t status = product(offset);
    std::printf("  scale at +%zu bytes: %s\n", offset, cublasGetStatusString(status));
    CHECK(status == CUBLAS_STATUS_NOT_SUPPORTED);
  }
  CHECK(product(16) == CUBLAS_STATUS_SUCCESS);
  CHECK(product(64) == CUBLAS_STATUS_SUCCESS);
  float c00 = 0;
  CUDA_CHECK(cudaMemcpy(&c00, out, sizeof c00, cudaMemcpyDeviceToHost));
  CHECK(c00 == float(n));  // 16 products of 1 x 1
  cublasLtDestroy(handle);
  cudaFree(operands);
  cudaFree(out);
}

TEST_CASE("the cuBLASLt stand-in's sums do not depend on the tile an element falls in: each bitwise its own product's") {
  // D[m, n] = A^T B in fp32, A stored [k, m] and B [k, n] column-major ("TN"): m = 11 and n = 5 leave
  // rows and a column outside the stand-in's 4 x 2 tiles, k = 36 a tail outside its 8-wide sums. Each
  // element of D against the 1 x 1 product of its row and column alone (which no tile holds).
  const int m = 11, n = 5, k = 36, ldd = 12;  // every leading dimension a multiple of 16 bytes
  std::vector<float> host((m + n) * k);
  std::mt19937 draws(7);
  std::normal_distribution<float> normal;
  for (float& x : host) x = normal(draws);
  float *operands = nullptr, *out = nullptr, *alone = nullptr;
  CUDA_CHECK(cudaMalloc(&operands, host.size() * sizeof(float)));
  CUDA_CHECK(cudaMemcpy(operands, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMalloc(&out, ldd * n * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&alone, 4 * sizeof(float)));
  cublasLtHandle_t handle;
  CUBLAS_CHECK(cublasLtCreate(&handle));
  auto product = [&](const float* a_columns, const float* b_columns, float* d, int rows, int cols, int ld) {
    CUBLAS_CHECK(tn_product(handle, {CUDA_R_32F, k, rows, cols, ld, nullptr, nullptr, 16}, a_columns, b_columns, d));
  };
  const float *a_columns = operands, *b_columns = operands + m * k;
  product(a_columns, b_columns, out, m, n, ldd);
  std::vector<float> whole(ldd * n);
  CUDA_CHECK(cudaMemcpy(whole.data(), out, whole.size() * sizeof(float), cudaMemcpyDeviceToHost));
  int differ = 0;
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      product(a_columns + i * k, b_columns + j * k, alone, 1, 1, 4);
      float element = 0;
      CUDA_CHECK(cudaMemcpy(&element, alone, sizeof element, cudaMemcpyDeviceToHost));
      differ += std::memcmp(&element, &whole[i + j * ldd], sizeof element) != 0;
    }
  std::printf("  %d of %d elements differ from their own product's\n", differ, m * n);
  CHECK(differ == 0);
  cublasLtDestroy(handle);
  cudaFree(operands);
  cudaFree(out);
  cudaFree(alone);
}

TEST_CASE("REKLS stops naming the factor when syevd cannot decompose it (a NaN gradient)") {
  const int m = 8, n = 8;
  const size_t mn = size_t(m) * n;
  DeviceBuffer<float> p(std::vector<float>(mn, 1.0f)), g(std::vector<float>(mn, std::nanf(""))),
      state(ReklsBuffers::elems(m, n));
  rekls_reset_state(state.get(), m, n, 0);
  Matmul matmul;
  Rekls rekls({{m, n}});
  std::string message;
  try {
    rekls.update({{p.get(), g.get(), state.get()}}, m, n, ReklsSettings{}, {1e-3f, 1, 1.0f}, matmul, 0);
  } catch (const std::runtime_error& e) {
    message = e.what();
  }
  std::printf("  %s\n", message.c_str());
  CHECK(message == "rekls: cusolverDnXsyevd of a 8x8 Kronecker factor failed, info 1 (no convergence: a non-finite "
                   "factor?)");
}

int main(int argc, char** argv) { return check::run_checks(argc, argv); }
