// The GPU toolchain end to end: device present and Hopper, a kernel runs and writes every element,
// cuBLASLt and NCCL load, programmatic dependent launch takes effect (and on which streams), and the
// warp-specialised kernels' Hopper pieces (TMA, mbarriers, named barriers, setmaxnreg, TMA stores)
// do what the CPU emulator makes them do. Skips (exit 77) when no GPU is present.
#include "gpu/gpu_test.h"
#include "gpu/tma_probes.cuh"
#include "kernels/host/child_process.h"
#include "kernels/host/launch.cuh"
#include "kernels/ptx.cuh"

__global__ void fill_index_squared(float* out, int n) {  // out: [n]
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = float(i) * float(i);
}

TEST_CASE("device is Hopper") { require_hopper_gpu(0); }

TEST_CASE("kernel writes every element of a poisoned buffer") {
  const int n = 1 << 20;
  float* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, n * sizeof(float)));
  CUDA_CHECK(cudaMemset(d, 0xFF, n * sizeof(float)));  // NaN poison
  fill_index_squared<<<(n + 255) / 256, 256>>>(d, n);
  CUDA_CHECK_LAUNCH();
  std::vector<float> h(n);
  CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaFree(d));
  int wrong = 0;
  for (int i = 0; i < n; ++i) wrong += h[i] != float(i) * float(i);
  CHECK(wrong == 0);
}

TEST_CASE("cuBLASLt and NCCL load") {
  cublasLtHandle_t lt;
  CUBLAS_CHECK(cublasLtCreate(&lt));
  CHECK(cublasLtGetVersion() >= 130000);
  CUBLAS_CHECK(cublasLtDestroy(lt));
  int nccl_version = 0;
  NCCL_CHECK(ncclGetVersion(&nccl_version));
  std::printf("  cuBLASLt %zu, NCCL %d\n", cublasLtGetVersion(), nccl_version);
  CHECK(nccl_version >= 22800);
}

__device__ inline unsigned long long global_time_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One block: lets the next kernel launch (as every kernel of kernels/ does after its wait), holds
// its SM for `hold_ns`, then notes when it ended: stamps[0].
__global__ void hold_then_stamp(unsigned long long* stamps, unsigned long long hold_ns) {
  ptx::griddepcontrol_launch_dependents();
  const unsigned long long start = global_time_ns();
  while (global_time_ns() - start < hold_ns) {
  }
  __syncthreads();
  if (threadIdx.x == 0) stamps[0] = global_time_ns();
}

// Notes when it started (stamps[1], before its wait: a time, not memory the first kernel writes)
// and when its wait returned (stamps[2]), and reads the first kernel's stamp after the wait
// (stamps[3]: what the wait made visible).
__global__ void stamp_around_wait(unsigned long long* stamps) {
  const unsigned long long started = global_time_ns();
  ptx::griddepcontrol_wait();
  stamps[1] = started;
  stamps[2] = global_time_ns();
  stamps[3] = *reinterpret_cast<volatile unsigned long long*>(stamps);
}

// kernels/host/launch.cuh's premise, on this GPU and driver: with the attribute, the second of two
// kernels starts while the first still runs and its wait returns only after the first ended, its
// writes visible; without it, the second starts after the first. Checked on a created blocking
// stream, the trainer's under --launch-overlap pdl (StepStream); on the legacy default stream, the
// trainer's without it, whether PDL takes effect is printed.
TEST_CASE("programmatic dependent launch overlaps the next kernel's start, and its wait still orders") {
  unsigned long long* stamps = nullptr;
  CUDA_CHECK(cudaMalloc(&stamps, 4 * sizeof(unsigned long long)));
  cudaStream_t created = nullptr;
  CUDA_CHECK(cudaStreamCreate(&created));  // blocking, as StepStream
  constexpr unsigned long long kHoldNs = 200000;  // 200 us: far beyond a launch's latency
  auto run = [&](cudaStream_t stream, bool programmatic) {
    CUDA_CHECK(cudaMemsetAsync(stamps, 0, 4 * sizeof(unsigned long long), stream));
    CUDA_CHECK(launch_kernel(hold_then_stamp, 1, 32, 0, stream, stamps, kHoldNs));  // after a memset: a plain order
    programmatic_dependent_launch = programmatic;
    CUDA_CHECK(launch_kernel(stamp_around_wait, 1, 1, 0, stream, stamps));
    programmatic_dependent_launch = false;
    unsigned long long h[4];
    CUDA_CHECK(cudaMemcpyAsync(h, stamps, sizeof h, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const long long started_before_end = (long long)(h[0] - h[1]);  // > 0: the second started first
    std::printf("  %-22s %-8s second kernel started %8.1f us before the first ended; its wait returned %6.1f us after\n",
                stream ? "created stream" : "legacy default stream", programmatic ? "PDL" : "no PDL",
                started_before_end / 1e3, (long long)(h[2] - h[0]) / 1e3);
    CHECK(h[2] >= h[0] && h[3] == h[0]);  // the wait orders, and the first kernel's write is visible
    return started_before_end > 0;
  };
  CHECK(!run(created, false));
  CHECK(run(created, true));
  CHECK(!run(nullptr, false));
  const bool legacy_overlaps = run(nullptr, true);
  std::printf("  PDL on the legacy default stream (the trainer's): %s\n",
              legacy_overlaps ? "takes effect" : "no effect (the trainer's step takes a created stream under the flag)");
  CUDA_CHECK(cudaStreamDestroy(created));
  CUDA_CHECK(cudaFree(stamps));
}

// What the emulator's tests of these pieces (tests/emulator/test_checks.cu) take for the hardware's
// behaviour, on the hardware: where one fails here, the flash-ws forward's and our GEMM's failures
// (test_attention, test_kernels) are the emulator's model of the instruction, not the kernels' logic.
TEST_CASE("the emulator's model of TMA, mbarriers, named barriers and setmaxnreg holds on this GPU") {
  using namespace tma_probes;
  Ring ring;
  ring.out.poison();
  ring.run(RingMistake::none);
  bool alternated = false;
  const size_t ring_wrong = ring_wrong_elements(ring, &alternated);
  std::printf("  TMA ring: %zu of %d copied elements wrong; the consumers %s\n", ring_wrong,
              kRingTiles * kRingRows * kRingCols, alternated ? "alternated" : "did NOT alternate");
  CHECK(ring_wrong == 0);
  CHECK(alternated);
  const int wgmma_wrong = tma_wgmma_wrong_threads(ring, -1);
  std::printf("  TMA box read by wgmma: %d of 128 threads' products wrong\n", wgmma_wrong);
  CHECK(wgmma_wrong == 0);
  const size_t store_wrong = tma_store_wrong_elements(StoreMistake::none);
  std::printf("  TMA stores: %zu of %d elements wrong\n", store_wrong, kStoreRows * kStoreCols * kStoreTiles);
  CHECK(store_wrong == 0);
}

// Set in the process of this test's own that runs the ring with a stage never released.
constexpr const char* kStuckRingVariable = "SPEEDRUN_TEST_STUCK_RING";

// A ring whose second consumer never releases its stages: the producer's wait for a free stage (and
// the consumers' for copies that never come) would hang the GPU. The waits fail the launch after
// about 10 s instead (wgmma_tiles::mbarrier_wait). In a process of its own, as a failed launch
// ends its CUDA context.
TEST_CASE("a wait for a phase that never completes fails the launch after about 10 s") {
  int compute_mode = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&compute_mode, cudaDevAttrComputeMode, 0));
  if (compute_mode == cudaComputeModeExclusiveProcess) {
    std::printf("  not checked: the GPU is in exclusive-process mode (no second process can use it)\n");
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  const ChildOutcome child =
      run_child(kThisProgram, {kThisProgram}, {std::string(kStuckRingVariable) + "=1"}, 60);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::string said;
  for (const std::string& line : child.lines) said += line + "\n";
  std::printf("  after %.1f s, %s:\n%s", seconds,
              child.timed_out ? "no line for 60 s (killed)" : child.ending().c_str(), said.c_str());
  CHECK(!child.timed_out);
  CHECK(child.exit_status == 3);  // the launch failed, as below
  CHECK(said.find("the stuck ring's launch: cudaError") != std::string::npos);
  CHECK(seconds >= 10);
}

int main(int argc, char** argv) {
  if (std::getenv(kStuckRingVariable)) {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    tma_probes::Ring ring;
    ring.run(tma_probes::RingMistake::missed_release);
    const cudaError_t status = cudaDeviceSynchronize();
    std::printf("the stuck ring's launch: %s\n", cudaGetErrorName(status));
    std::_Exit(status == cudaSuccess ? 0 : 3);  // no destructor calls CUDA after the failure
  }
  return run_gpu_checks(argc, argv);
}
