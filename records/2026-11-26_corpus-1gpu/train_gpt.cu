// Frozen single-file trainer of 2026-11-26_corpus-1gpu: train_gpt.cu with its kernels/ and data/ headers
// inlined by tools/records.py. Build it alone with:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -o train_gpt train_gpt.cu -lcublasLt -lcublas -lcusolver -lnccl
#define SPEEDRUN_FROZEN_RECORD "2026-11-26_corpus-1gpu"
// train_gpt.cu: the record-#25 NanoGPT speedrun trainer (SPEC Part 1) in one CUDA file.
//
// Reading order: hyperparameters and flags, the run log, checkpoints, the model (parameters,
// activations, forward and backward from the kernels of kernels/), the sharded optimizers, the
// training state, and the run (warmup, steps, validation, checkpoints) over a communicator that is
// one rank, NCCL ranks (one process per GPU) or, in tests, simulated ranks on one GPU.
// ===== data/dataloader.h (inlined) =====
// Host-side data pipeline (SPEC 1.7 and 4.1): the shard reader with its checks, the batch plan
// that reproduces the reference's distributed_data_generator for any world size, the validation
// plan, and a loader that prefetches each rank's micro-sequences on a background thread.
// Every error names the file and what is wrong with it.
#include <glob.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersion = 1;
constexpr int kShardHeaderInts = 256;
constexpr int64_t kShardHeaderBytes = kShardHeaderInts * 4;
constexpr int kTokenizerVocab = 50257;  // GPT-2 token ids are below this
constexpr uint16_t kBosToken = 50256;

struct DataError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The files matching a glob pattern, sorted.
inline std::vector<std::string> list_shards(const std::string& pattern) {
  glob_t g{};
  int rc = glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> files;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) files.emplace_back(g.gl_pathv[i]);
  globfree(&g);
  if (files.empty()) throw DataError("no files match pattern '" + pattern + "'");
  std::sort(files.begin(), files.end());
  return files;
}

// The token count of the shard open in f, from its header, checked against the file's size; f is
// left at the first token.
inline int64_t checked_token_count(FILE* f, const std::string& path) {
  int32_t header[kShardHeaderInts];
  if (std::fread(header, 1, kShardHeaderBytes, f) != size_t(kShardHeaderBytes))
    throw DataError(path + (std::ferror(f) ? ": cannot read: " + std::string(std::strerror(errno))
                                           : ": truncated header: shorter than " + std::to_string(kShardHeaderBytes) + " bytes"));
  if (header[0] != kShardMagic)
    throw DataError(path + ": wrong magic " + std::to_string(header[0]) + " (expected " + std::to_string(kShardMagic) + ")");
  if (header[1] != kShardVersion)
    throw DataError(path + ": unsupported version " + std::to_string(header[1]) + " (expected " + std::to_string(kShardVersion) + ")");
  int64_t num_tokens = header[2];
  if (num_tokens < 0) throw DataError(path + ": negative token count " + std::to_string(num_tokens) + " in header");
  std::fseek(f, 0, SEEK_END);
  int64_t actual = std::ftell(f), expected = kShardHeaderBytes + 2 * num_tokens;
  if (actual != expected)
    throw DataError(path + ": size " + std::to_string(actual) + " bytes does not match the header's token count " +
                    std::to_string(num_tokens) + " (expected " + std::to_string(expected) + " bytes)");
  std::fseek(f, kShardHeaderBytes, SEEK_SET);
  return num_tokens;
}

inline std::unique_ptr<FILE, int (*)(FILE*)> open_shard(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw DataError(path + ": cannot open: " + std::strerror(errno));
  return {f, &std::fclose};
}

// The header's token count of a shard, checked against its size, without reading the tokens.
inline int64_t shard_token_count(const std::string& path) { return checked_token_count(open_shard(path).get(), path); }

// The next n tokens of the shard open in f, into tokens.
inline void read_tokens(FILE* f, const std::string& path, uint16_t* tokens, int64_t n) {
  if (std::fread(tokens, 2, size_t(n), f) != size_t(n)) throw DataError(path + ": read failed: " + std::strerror(errno));
}

// tokens[0, n) are the shard's positions first, first + 1, ...: an id >= vocab_size is an error
// naming the file and its position. One max over them (which the compiler vectorises) decides;
// the position is looked for only when it fails.
inline void check_token_ids(const std::string& path, const uint16_t* tokens, int64_t n, int64_t first, int vocab_size) {
  uint16_t largest = 0;
  for (int64_t i = 0; i < n; ++i) largest = tokens[i] > largest ? tokens[i] : largest;
  if (largest < vocab_size) return;
  const int64_t i = std::find_if(tokens, tokens + n, [&](uint16_t t) { return t >= vocab_size; }) - tokens;
  throw DataError(path + ": token id " + std::to_string(tokens[i]) + " at position " + std::to_string(first + i) +
                  " >= vocab size " + std::to_string(vocab_size));
}

// Reads a whole shard and checks its header, its size and every token id.
inline std::vector<uint16_t> read_shard(const std::string& path, int vocab_size) {
  auto file = open_shard(path);
  const int64_t num_tokens = checked_token_count(file.get(), path);
  std::vector<uint16_t> tokens(num_tokens);
  read_tokens(file.get(), path, tokens.data(), num_tokens);
  check_token_ids(path, tokens.data(), num_tokens, 0, vocab_size);
  return tokens;
}

// Checks a shard as read_shard does without keeping its tokens: read in chunks of 4 MiB, which stay
// in the CPU's cache for the max. At the speed of memory (docs/PERF.md: 0.025 s for a FineWeb
// shard of 100M tokens in the page cache), so that every shard can be checked at start.
inline void scan_shard(const std::string& path, int vocab_size) {
  auto file = open_shard(path);
  const int64_t num_tokens = checked_token_count(file.get(), path);
  std::vector<uint16_t> chunk(int64_t(1) << 21);
  for (int64_t first = 0; first < num_tokens; first += int64_t(chunk.size())) {
    const int64_t n = std::min(int64_t(chunk.size()), num_tokens - first);
    read_tokens(file.get(), path, chunk.data(), n);
    check_token_ids(path, chunk.data(), n, first, vocab_size);
  }
}

// One optimizer step's global window: M micro-sequences of T tokens, plus the last target.
// Micro-sequence j is tokens + j*T (T + 1 tokens: inputs [0, T), targets [1, T + 1)).
struct GlobalWindow {
  int64_t step;
  std::string shard;
  int64_t pos;
  const uint16_t* tokens;  // [M*T + 1]
};

// The reference's distributed_data_generator with the global batch of SPEC 4.1: files sorted and
// read once each (no cycling); a shard is left, and its tail dropped, once
// pos + M*T + 1 >= its length (so a shard yields a window only from M*T + 2 tokens on).
class BatchPlan {
 public:
  BatchPlan(std::string pattern, int64_t micro_len, int micro_count, int vocab_size)
      : pattern_(std::move(pattern)), files_(list_shards(pattern_)), micro_len_(micro_len),
        micro_count_(micro_count), vocab_size_(vocab_size) {
    if (micro_len < 1 || micro_count < 1)
      throw DataError("batch of " + std::to_string(micro_count) + " x " + std::to_string(micro_len) + " tokens is empty");
  }

  GlobalWindow next() {
    int64_t batch = micro_len_ * micro_count_;
    while (next_file_ == 0 || pos_ + batch + 1 >= int64_t(tokens_.size())) load_next_shard(batch);
    GlobalWindow w{step_++, files_[next_file_ - 1], pos_, tokens_.data() + pos_};
    pos_ += batch;
    return w;
  }

  // The windows all the files give, from their headers alone (no token is read): a run longer than
  // this would stop when the data runs out. A file too small for one window is an error here too.
  int64_t windows_available() const {
    const int64_t batch = micro_len_ * micro_count_;
    int64_t windows = 0;
    for (const std::string& path : files_) {
      const int64_t n = shard_token_count(path);
      check_shard_fits_batch(path, n, batch);
      windows += (n - 2 - batch) / batch + 1;  // windows at pos = k batch while pos + batch + 1 < n
    }
    return windows;
  }

  // Every token of every file read and checked (header, size, ids below the vocabulary), none
  // kept: with windows_available, whatever the run would meet in its files is found before it starts.
  void scan_all_tokens() const {
    for (const std::string& path : files_) scan_shard(path, vocab_size_);
  }

  int64_t micro_len() const { return micro_len_; }
  int micro_count() const { return micro_count_; }
  static int rank_of_micro(int j, int world_size) { return j % world_size; }

 private:
  void load_next_shard(int64_t batch) {
    if (next_file_ == files_.size())
      throw DataError("training data exhausted at step " + std::to_string(step_) + ": all " +
                      std::to_string(files_.size()) + " file(s) matching '" + pattern_ +
                      "' are consumed (the loader does not cycle)");
    const std::string& path = files_[next_file_++];
    tokens_ = read_shard(path, vocab_size_);
    pos_ = 0;
    check_shard_fits_batch(path, int64_t(tokens_.size()), batch);
  }

  void check_shard_fits_batch(const std::string& path, int64_t tokens, int64_t batch) const {
    if (tokens < batch + 2)
      throw DataError(path + ": holds " + std::to_string(tokens) + " tokens, too few for one batch of " +
                      std::to_string(micro_count_) + " x " + std::to_string(micro_len_) + " tokens (needs " +
                      std::to_string(batch + 2) + ")");
  }

  std::string pattern_;
  std::vector<std::string> files_;
  int64_t micro_len_;
  int micro_count_;
  int vocab_size_;
  size_t next_file_ = 0;
  std::vector<uint16_t> tokens_;
  int64_t pos_ = 0;
  int64_t step_ = 0;
};

// val_tokens as S = val_tokens / val_seq_len sequences of one window of the first val shard;
// sequence s goes to rank s % W (with W = 8 and S = 40: the reference's 5 validation steps).
class ValidationPlan {
 public:
  ValidationPlan(const std::string& pattern, int64_t val_tokens, int64_t val_seq_len, int vocab_size)
      : seq_len_(val_seq_len) {
    if (val_seq_len < 1 || val_tokens < val_seq_len || val_tokens % val_seq_len != 0)
      throw DataError("val_tokens " + std::to_string(val_tokens) + " is not a positive multiple of val_seq_len " +
                      std::to_string(val_seq_len));
    num_sequences_ = val_tokens / val_seq_len;
    BatchPlan plan(pattern, val_seq_len, int(num_sequences_), vocab_size);
    GlobalWindow w = plan.next();
    tokens_.assign(w.tokens, w.tokens + val_tokens + 1);
  }
  int64_t num_sequences() const { return num_sequences_; }
  int64_t seq_len() const { return seq_len_; }
  const uint16_t* sequence(int64_t s) const { return tokens_.data() + s * seq_len_; }  // [seq_len + 1]
  std::vector<int64_t> sequences_of_rank(int rank, int world_size) const {
    std::vector<int64_t> mine;
    for (int64_t s = rank; s < num_sequences_; s += world_size) mine.push_back(s);
    return mine;
  }

 private:
  int64_t seq_len_, num_sequences_;
  std::vector<uint16_t> tokens_;  // [val_tokens + 1]
};

using HostAlloc = std::function<void*(size_t bytes)>;
using HostFree = std::function<void(void*)>;

// One rank's share of a step: its micro-sequences j = rank, rank + W, ... in increasing j.
struct RankBatch {
  int64_t step;
  int num_micro;
  int64_t micro_len;
  const uint16_t* tokens;  // [num_micro * (T + 1)]
};

// Copies each rank's micro-sequences into host buffers (pinned, when the trainer passes
// cudaHostAlloc) `depth` steps ahead, on a background thread. A buffer handed out by next() stays
// valid until the following call; errors of the thread (exhausted data, a bad shard) surface there.
class PrefetchLoader {
 public:
  PrefetchLoader(BatchPlan plan, int rank, int world_size, int depth = 2, HostAlloc alloc = {}, HostFree free = {})
      : plan_(std::move(plan)), rank_(rank), world_size_(world_size),
        free_(free ? free : HostFree([](void* p) { std::free(p); })) {
    if (depth < 1) throw DataError("prefetch depth must be >= 1");
    int num_micro = 0;
    for (int j = rank; j < plan_.micro_count(); j += world_size) ++num_micro;
    size_t bytes = std::max<size_t>(1, size_t(num_micro) * (plan_.micro_len() + 1) * sizeof(uint16_t));
    HostAlloc allocate = alloc ? alloc : HostAlloc([](size_t n) { return std::malloc(n); });
    for (int i = 0; i < depth + 1; ++i) {  // depth filled ahead + the one handed out last
      auto* buffer = static_cast<uint16_t*>(allocate(bytes));
      if (!buffer) {
        free_buffers();
        throw DataError("cannot allocate " + std::to_string(bytes) + " bytes of host buffer");
      }
      buffers_.push_back(buffer);
      batches_.push_back({0, num_micro, plan_.micro_len(), buffer});
    }
    worker_ = std::thread([this] { fill_loop(); });
  }

  ~PrefetchLoader() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
    free_buffers();
  }

  const RankBatch& next() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (handed_out_) {  // the previous buffer may be refilled now
      handed_out_ = false;
      ++consumed_;
      cv_.notify_all();
    }
    cv_.wait(lock, [&] { return filled_ > consumed_ || error_; });
    if (filled_ == consumed_ && error_) std::rethrow_exception(error_);
    handed_out_ = true;
    return batches_[consumed_ % batches_.size()];
  }

 private:
  void fill_loop() {
    try {
      for (;;) {
        {
          std::unique_lock<std::mutex> lock(mutex_);
          cv_.wait(lock, [&] { return stop_ || filled_ - consumed_ < int64_t(buffers_.size()); });
          if (stop_) return;
        }
        GlobalWindow w = plan_.next();
        size_t slot = filled_ % buffers_.size();
        copy_rank_micro_sequences(w, buffers_[slot]);
        batches_[slot].step = w.step;
        std::lock_guard<std::mutex> lock(mutex_);
        ++filled_;
        cv_.notify_all();
      }
    } catch (const DataError&) {
      fail(std::current_exception());
    } catch (const std::exception& e) {  // e.g. bad_alloc reading a shard: still a data error to the caller
      fail(std::make_exception_ptr(DataError(std::string("data loader thread failed: ") + e.what())));
    }
  }

  void fail(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = error;
    cv_.notify_all();
  }

  void free_buffers() {
    for (uint16_t* buffer : buffers_) free_(buffer);
    buffers_.clear();
  }

  void copy_rank_micro_sequences(const GlobalWindow& w, uint16_t* out) const {
    int64_t T = plan_.micro_len();
    for (int j = rank_; j < plan_.micro_count(); j += world_size_, out += T + 1)
      std::memcpy(out, w.tokens + j * T, (T + 1) * sizeof(uint16_t));
  }

  BatchPlan plan_;
  int rank_, world_size_;
  HostFree free_;
  std::vector<uint16_t*> buffers_;  // a ring of depth + 1, each [num_micro * (T + 1)]
  std::vector<RankBatch> batches_;  // batches_[i].tokens == buffers_[i]
  std::thread worker_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int64_t filled_ = 0, consumed_ = 0;  // slots filled by the thread / released by the consumer
  bool handed_out_ = false, stop_ = false;
  std::exception_ptr error_;
};
// ===== end of data/dataloader.h =====
// ===== kernels/activations.cuh (inlined) =====
// ReLU^2 of the MLP (SPEC 1.2.6): a = relu(u)^2 and du = da * 2 relu(u), bf16, 16-byte vectors.
// ===== kernels/cuda_check.cuh (inlined) =====
// Every CUDA, cuBLAS(Lt), cuSOLVER and NCCL return code is checked; a failure names the call's file:line.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

[[noreturn]] inline void cuda_fail(const char* what, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + call + " failed: " + what);
}

#define CUDA_CHECK(call)                                                              \
  do {                                                                                \
    cudaError_t cuda_check_err_ = (call);                                             \
    if (cuda_check_err_ != cudaSuccess)                                               \
      cuda_fail(cudaGetErrorString(cuda_check_err_), #call, __FILE__, __LINE__);      \
  } while (0)

// After a kernel launch: the launch configuration error, if any.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

#define CUBLAS_CHECK(call)                                                            \
  do {                                                                                \
    cublasStatus_t cublas_check_status_ = (call);                                     \
    if (cublas_check_status_ != CUBLAS_STATUS_SUCCESS)                                \
      cuda_fail(cublasGetStatusString(cublas_check_status_), #call, __FILE__, __LINE__); \
  } while (0)

// cuSOLVER has no status string of its own.
inline const char* cusolver_status_name(cusolverStatus_t s) {
  switch (s) {
    case CUSOLVER_STATUS_SUCCESS: return "CUSOLVER_STATUS_SUCCESS";
    case CUSOLVER_STATUS_NOT_INITIALIZED: return "CUSOLVER_STATUS_NOT_INITIALIZED";
    case CUSOLVER_STATUS_ALLOC_FAILED: return "CUSOLVER_STATUS_ALLOC_FAILED";
    case CUSOLVER_STATUS_INVALID_VALUE: return "CUSOLVER_STATUS_INVALID_VALUE";
    case CUSOLVER_STATUS_ARCH_MISMATCH: return "CUSOLVER_STATUS_ARCH_MISMATCH";
    case CUSOLVER_STATUS_EXECUTION_FAILED: return "CUSOLVER_STATUS_EXECUTION_FAILED";
    case CUSOLVER_STATUS_INTERNAL_ERROR: return "CUSOLVER_STATUS_INTERNAL_ERROR";
    case CUSOLVER_STATUS_NOT_SUPPORTED: return "CUSOLVER_STATUS_NOT_SUPPORTED";
    default: return "cuSOLVER status (see cusolver_common.h)";
  }
}

#define CUSOLVER_CHECK(call)                                                          \
  do {                                                                                \
    cusolverStatus_t cusolver_check_status_ = (call);                                 \
    if (cusolver_check_status_ != CUSOLVER_STATUS_SUCCESS)                            \
      cuda_fail(cusolver_status_name(cusolver_check_status_), #call, __FILE__, __LINE__); \
  } while (0)

#define NCCL_CHECK(call)                                                              \
  do {                                                                                \
    ncclResult_t nccl_check_result_ = (call);                                         \
    if (nccl_check_result_ != ncclSuccess)                                            \
      cuda_fail(ncclGetErrorString(nccl_check_result_), #call, __FILE__, __LINE__);  \
  } while (0)

// No GPU this process can train on: the trainer exits with a status of its own (kExitNoUsableGpu).
struct NoUsableGpu : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Why cudaGetDeviceCount found no GPU, in plain words, with CUDA's own text after: without a
// driver CUDA says "CUDA driver version is insufficient for CUDA runtime version".
inline std::string no_gpu_reason(cudaError_t err) {
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);  // 0 when no driver is installed
  cudaRuntimeGetVersion(&runtime);
  auto version = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
  const std::string cuda_says = err == cudaSuccess ? "" : std::string(" (CUDA: ") + cudaGetErrorString(err) + ")";
  if (driver == 0)
    return "no NVIDIA driver found, so no GPU can be used here: the trainer needs an NVIDIA GPU (H100 or H200) and "
           "its driver" + cuda_says;
  if (err == cudaErrorInsufficientDriver)
    return "the NVIDIA driver (CUDA " + version(driver) + ") is older than this build's CUDA runtime (" +
           version(runtime) + "): update the driver" + cuda_says;
  if (err == cudaSuccess || err == cudaErrorNoDevice) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    return "no NVIDIA GPU found: the driver (CUDA " + version(driver) + ") sees none" +
           (visible ? std::string(" with CUDA_VISIBLE_DEVICES='") + visible + "'" : std::string()) + cuda_says;
  }
  return "no CUDA GPU is usable here" + cuda_says;
}

// Makes this process's GPU current and returns it: GPU `local_rank`, or the only GPU the process
// sees where the launcher gives each process one (Slurm's --gpus-per-task=1, a per-rank
// CUDA_VISIBLE_DEVICES).
inline int select_gpu(int local_rank) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) throw NoUsableGpu(no_gpu_reason(err));
  const int device = count == 1 ? 0 : local_rank;
  if (device < 0 || device >= count)
    throw NoUsableGpu("local rank " + std::to_string(local_rank) + " needs GPU " + std::to_string(device) +
                      ", but this process sees " + std::to_string(count) + " GPUs (LOCAL_RANK too high?)");
  CUDA_CHECK(cudaSetDevice(device));
  return device;
}

// The trainer's kernels are built for Hopper (sm_90a); any other GPU is refused at start.
inline void require_hopper_gpu(int device) {
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  if (prop.major != 9 || prop.minor != 0)
    throw NoUsableGpu("unsupported GPU '" + std::string(prop.name) + "' (compute capability " +
                      std::to_string(prop.major) + "." + std::to_string(prop.minor) +
                      "): this build targets sm_90a (H100/H200); rebuild with -DSPEEDRUN_CUDA_GENCODE for another GPU");
}
// ===== end of kernels/cuda_check.cuh =====
// ===== kernels/device_utils.cuh (inlined) =====
// Small device helpers shared by the kernel headers: warp/block reductions, 16-byte vectors,
// the grid of elementwise kernels, fp32 <-> bf16 conversion, asynchronous uploads of host arrays.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

using bf16 = __nv_bfloat16;

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ inline float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
__device__ inline float block_sum(float v) {
  __shared__ float partial[32];
  __shared__ float total;
  v = warp_sum(v);
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // partial[] may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < blockDim.x / 32 ? partial[lane] : 0.0f;
    s = warp_sum(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// norms[i] = ||x[i n .. (i + 1) n)||_F, block i per matrix: a fixed reduction order, deterministic.
constexpr int kFrobeniusThreads = 1024;
template <typename T>
__global__ void __launch_bounds__(kFrobeniusThreads) frobenius_norms_kernel(const T* x, size_t n, float* norms) {
  const T* matrix = x + blockIdx.x * n;
  float ss = 0;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
    float v = float(matrix[i]);
    ss += v * v;
  }
  ss = block_sum(ss);
  if (threadIdx.x == 0) norms[blockIdx.x] = sqrtf(ss);
}

// Eight bf16 in one 16-byte load/store.
struct alignas(16) Bf16x8 {
  bf16 v[8];
};

__device__ inline void load8(const bf16* p, float out[8]) {
  Bf16x8 x = *reinterpret_cast<const Bf16x8*>(p);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = __bfloat162float(x.v[i]);
}

// Eight fp32 in two 16-byte loads (p 16-byte aligned).
__device__ inline void load8(const float* p, float out[8]) {
  float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
  out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

__device__ inline void store8(bf16* p, const float in[8]) {
  Bf16x8 x;
#pragma unroll
  for (int i = 0; i < 8; ++i) x.v[i] = __float2bfloat16(in[i]);
  *reinterpret_cast<Bf16x8*>(p) = x;
}

// 256-thread blocks over `items`, grid-stride past 16 blocks per SM (132 SMs on an H100); at least
// one block, so that an empty launch is not an invalid configuration.
inline int elementwise_grid(size_t items) {
  size_t blocks = (items + 255) / 256;
  return int(blocks < 1 ? 1 : blocks < 132 * 16 ? blocks : 132 * 16);
}

template <typename From, typename To>
__global__ void convert_kernel(const From* in, To* out, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = To(float(in[i]));
}

// out[n] = in[n] converted (fp32 -> bf16 rounds to nearest even)
template <typename From, typename To>
void convert(const From* in, To* out, size_t n, cudaStream_t stream) {
  convert_kernel<<<elementwise_grid(n), 256, 0, stream>>>(in, out, n);
  CUDA_CHECK_LAUNCH();
}

// *sum += the 32-bit words of data[words] added as integers: independent of the order of the
// additions, so equal buffers give equal sums on every GPU (a checksum, not a hash).
__global__ void word_sum_kernel(const uint32_t* data, size_t words, unsigned long long* sum) {
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < words; i += size_t(gridDim.x) * blockDim.x)
    local += data[i];
  atomicAdd(sum, local);
}

// The word sum of `bytes` (a multiple of 4) at data; synchronous (the caller compares it on the host).
inline uint64_t device_word_sum(const void* data, size_t bytes, unsigned long long* scratch, cudaStream_t stream) {
  CUDA_CHECK(cudaMemsetAsync(scratch, 0, sizeof *scratch, stream));
  word_sum_kernel<<<elementwise_grid(bytes / 4), 256, 0, stream>>>(static_cast<const uint32_t*>(data), bytes / 4, scratch);
  CUDA_CHECK_LAUNCH();
  unsigned long long sum = 0;
  CUDA_CHECK(cudaMemcpyAsync(&sum, scratch, sizeof sum, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return sum;
}

// Device copies of a micro-sequence's small host-built arrays (attention block lists, embedding
// row order) without a device sync: staged in pinned memory, copied asynchronously on the stream
// that reads them. One set is reused for every micro-sequence; stream order keeps the previous
// readers ahead of the next copies, and reset() waits only until the previous copies have left the
// staging memory, so the host prepares micro-sequence j + 1 while the GPU runs j.
class StagedUploads {
 public:
  static constexpr size_t kAlignment = 256;
  static size_t bytes_for(size_t count, size_t element_bytes) {
    return (std::max<size_t>(count, 1) * element_bytes + kAlignment - 1) / kAlignment * kAlignment;
  }
  template <typename X>
  static size_t bytes_for(const std::vector<X>& host) {
    return bytes_for(host.size(), sizeof(X));
  }

  StagedUploads() { CUDA_CHECK(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming)); }
  ~StagedUploads() {
    release();
    cudaEventDestroy(copied_);
  }
  StagedUploads(const StagedUploads&) = delete;
  StagedUploads& operator=(const StagedUploads&) = delete;

  // Starts a new set of `bytes` (the sum of bytes_for of what follows); the previous set's device
  // memory may be overwritten by the next copies once the stream reaches them.
  void reset(size_t bytes) {
    CUDA_CHECK(cudaEventSynchronize(copied_));
    if (bytes > capacity_) {  // rare: doubling, so a few times per run at most
      const size_t grown = std::max(bytes, 2 * capacity_);
      CUDA_CHECK(cudaDeviceSynchronize());  // the old device memory may still be read
      release();
      CUDA_CHECK(cudaMallocHost(&staging_, grown));
      CUDA_CHECK(cudaMalloc(&device_, grown));
      capacity_ = grown;
    }
    used_ = 0;
  }

  template <typename X>
  X* upload(const std::vector<X>& host, cudaStream_t stream) {
    const size_t bytes = host.size() * sizeof(X), slot = bytes_for(host);
    if (used_ + slot > capacity_)
      throw std::logic_error("StagedUploads: " + std::to_string(used_ + slot) + " bytes staged, reset() reserved " +
                             std::to_string(capacity_));
    char *staged = static_cast<char*>(staging_) + used_, *on_device = static_cast<char*>(device_) + used_;
    std::memcpy(staged, host.data(), bytes);
    CUDA_CHECK(cudaMemcpyAsync(on_device, staged, bytes, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaEventRecord(copied_, stream));
    used_ += slot;
    return reinterpret_cast<X*>(on_device);
  }

 private:
  void release() {
    cudaFreeHost(staging_);
    cudaFree(device_);
    staging_ = device_ = nullptr;
    capacity_ = 0;
  }
  void *staging_ = nullptr, *device_ = nullptr;
  size_t capacity_ = 0, used_ = 0;
  cudaEvent_t copied_ = nullptr;
};
// ===== end of kernels/device_utils.cuh =====

#include <stdexcept>

// a[n] = relu(u[n])^2, n a multiple of 8
__global__ void relu_squared_forward_kernel(const bf16* u, bf16* a, size_t vectors) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < vectors; i += size_t(gridDim.x) * blockDim.x) {
    float v[8];
    load8(u + i * 8, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = v[j] > 0 ? v[j] * v[j] : 0.0f;
    store8(a + i * 8, v);
  }
}

// du[n] = da[n] * 2 relu(u[n])
__global__ void relu_squared_backward_kernel(const bf16* u, const bf16* da, bf16* du, size_t vectors) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < vectors; i += size_t(gridDim.x) * blockDim.x) {
    float v[8], g[8];
    load8(u + i * 8, v);
    load8(da + i * 8, g);
#pragma unroll
    for (int j = 0; j < 8; ++j) g[j] *= v[j] > 0 ? 2 * v[j] : 0.0f;
    store8(du + i * 8, g);
  }
}

inline void relu_squared_forward(const bf16* u, bf16* a, size_t n, cudaStream_t stream) {
  if (n % 8) throw std::invalid_argument("relu_squared: size must be a multiple of 8");
  relu_squared_forward_kernel<<<elementwise_grid(n / 8), 256, 0, stream>>>(u, a, n / 8);
  CUDA_CHECK_LAUNCH();
}

inline void relu_squared_backward(const bf16* u, const bf16* da, bf16* du, size_t n, cudaStream_t stream) {
  if (n % 8) throw std::invalid_argument("relu_squared: size must be a multiple of 8");
  relu_squared_backward_kernel<<<elementwise_grid(n / 8), 256, 0, stream>>>(u, da, du, n / 8);
  CUDA_CHECK_LAUNCH();
}
// ===== end of kernels/activations.cuh =====
// ===== kernels/attention.cuh (inlined) =====
// Causal, document-masked, block-sparse sliding-window attention (SPEC 1.4), head_dim 128,
// scale 0.12, bf16 in and out, fp32 softmax statistics. Blocks outside the window or document
// are skipped, not masked: each query block walks only its own list of kv blocks.
//
// This is the correct baseline (one warp per query or key row, CUDA cores); the tensor-core
// version replaces the kernels, not the interface. The backward is deterministic: dq per query,
// dk and dv per key (over the inverse block lists), no atomics.

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

constexpr int kAttentionHeadDim = 128;
constexpr int kAttentionBlock = 128;
constexpr float kAttentionScale = 0.12f;

// The block lists of one micro-sequence for one window size, built as the reference builds its
// BlockMask: "any" (partial) and "all" (full) blocks, nearest first, partial count clamped to
// max(window - full, 1) and full count to window - 1.
struct AttentionBlockLists {
  int num_blocks = 0, max_kv = 0, max_q = 0;
  std::vector<int> kv_count, kv_index;  // [num_blocks], [num_blocks, max_kv]: kv blocks of each q block
  std::vector<int> q_count, q_index;    // [num_blocks], [num_blocks, max_q]: q blocks that attend each kv block
};

// docs[t] = number of BOS tokens in tokens[0..t] (each document begins with its BOS).
inline std::vector<int32_t> attention_document_ids(const uint16_t* tokens, int T, uint16_t bos) {
  std::vector<int32_t> docs(T);
  int32_t d = 0;
  for (int t = 0; t < T; ++t) docs[t] = d += tokens[t] == bos;
  return docs;
}

inline AttentionBlockLists build_attention_blocks(const std::vector<int32_t>& docs, int window_blocks,
                                                  int block = kAttentionBlock) {
  if (docs.size() % block != 0)
    throw std::invalid_argument("attention mask: " + std::to_string(docs.size()) + " tokens are not whole blocks of " +
                                std::to_string(block));
  AttentionBlockLists b;
  b.num_blocks = int(docs.size()) / block;
  std::vector<std::vector<int>> kv(b.num_blocks), q(b.num_blocks);
  for (int qb = 0; qb < b.num_blocks; ++qb) {
    int q_low = docs[qb * block], q_high = docs[qb * block + block - 1];
    std::vector<int> partial, full;
    for (int kb = qb; kb >= 0; --kb) {
      int kv_low = docs[kb * block], kv_high = docs[kb * block + block - 1];
      if (kb < qb && q_low == kv_high && q_high == kv_low) full.push_back(kb);
      else if (q_low <= kv_high && q_high >= kv_low) partial.push_back(kb);
    }
    int full_keep = std::max(0, std::min(int(full.size()), window_blocks - 1));
    int partial_keep = std::min(int(partial.size()), std::max(window_blocks - int(full.size()), 1));
    kv[qb].assign(partial.begin(), partial.begin() + partial_keep);
    kv[qb].insert(kv[qb].end(), full.begin(), full.begin() + full_keep);
    for (int kb : kv[qb]) q[kb].push_back(qb);
  }
  auto flatten = [&](const std::vector<std::vector<int>>& lists, std::vector<int>& count, std::vector<int>& index, int& width) {
    width = 1;
    for (const auto& l : lists) width = std::max(width, int(l.size()));
    count.assign(b.num_blocks, 0);
    index.assign(size_t(b.num_blocks) * width, -1);
    for (int i = 0; i < b.num_blocks; ++i) {
      count[i] = int(lists[i].size());
      std::copy(lists[i].begin(), lists[i].end(), index.begin() + size_t(i) * width);
    }
  };
  flatten(kv, b.kv_count, b.kv_index, b.max_kv);
  flatten(q, b.q_count, b.q_index, b.max_q);
  return b;
}

// The block lists and document ids on the device.
struct DeviceAttentionMask {
  int num_blocks = 0, max_kv = 0, max_q = 0;
  int *kv_count = nullptr, *kv_index = nullptr, *q_count = nullptr, *q_index = nullptr;
  int32_t* docs = nullptr;  // [T]
};

// Each row (query or key) of q, k, v, y, dy, dq, dk, dv is [H, 128] at a stride of row_stride
// elements between tokens (q, k, v may live inside the fused qkv buffer); lse, delta are [H, T].
struct AttentionTensors {
  int T, H;
  int64_t q_stride, k_stride, v_stride;  // elements between consecutive tokens
};

__device__ inline bool attends(const DeviceAttentionMask& m, int t, int s) {
  return s <= t && m.docs[s] == m.docs[t];
}

// One warp per (query t, head h): y[t, h] and lse[h, t] by online softmax over the listed blocks.
__global__ void attention_forward_kernel(const bf16* q, const bf16* k, const bf16* v, bf16* y, float* lse,
                                         AttentionTensors a, DeviceAttentionMask m) {
  int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= a.T * a.H) return;
  int t = warp / a.H, h = warp % a.H, qb = t / kAttentionBlock;
  float qv[4], acc[4] = {0, 0, 0, 0}, row_max = -INFINITY, row_sum = 0;
  const bf16* qrow = q + t * a.q_stride + h * kAttentionHeadDim + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) qv[i] = __bfloat162float(qrow[i]) * kAttentionScale;
  for (int j = 0; j < m.kv_count[qb]; ++j) {
    int kb = m.kv_index[qb * m.max_kv + j];
    for (int s = kb * kAttentionBlock; s < (kb + 1) * kAttentionBlock; ++s) {
      if (!attends(m, t, s)) continue;
      const bf16* krow = k + s * a.k_stride + h * kAttentionHeadDim + lane * 4;
      float score = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) score += qv[i] * __bfloat162float(krow[i]);
      score = warp_sum(score);
      float new_max = fmaxf(row_max, score), correction = __expf(row_max - new_max), p = __expf(score - new_max);
      const bf16* vrow = v + s * a.v_stride + h * kAttentionHeadDim + lane * 4;
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] = acc[i] * correction + p * __bfloat162float(vrow[i]);
      row_sum = row_sum * correction + p;
      row_max = new_max;
    }
  }
  bf16* yrow = y + (size_t(t) * a.H + h) * kAttentionHeadDim + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) yrow[i] = __float2bfloat16(acc[i] / row_sum);
  if (lane == 0) lse[size_t(h) * a.T + t] = row_max + logf(row_sum);
}

// delta[h, t] = dot(dy[t, h], y[t, h]): the softmax backward's row term.
__global__ void attention_delta_kernel(const bf16* y, const bf16* dy, float* delta, int T, int H) {
  int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= T * H) return;
  int t = warp / H, h = warp % H;
  size_t at = (size_t(t) * H + h) * kAttentionHeadDim + lane * 4;
  float d = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) d += __bfloat162float(y[at + i]) * __bfloat162float(dy[at + i]);
  d = warp_sum(d);
  if (lane == 0) delta[size_t(h) * T + t] = d;
}

// One warp per (query t, head h): dq[t, h] = scale * sum_s P_ts (dy_t . v_s - delta_t) k_s.
__global__ void attention_backward_dq_kernel(const bf16* q, const bf16* k, const bf16* v, const bf16* dy,
                                             const float* lse, const float* delta, bf16* dq,
                                             AttentionTensors a, DeviceAttentionMask m) {
  int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= a.T * a.H) return;
  int t = warp / a.H, h = warp % a.H, qb = t / kAttentionBlock;
  float qv[4], g[4], acc[4] = {0, 0, 0, 0};
  const bf16* qrow = q + t * a.q_stride + h * kAttentionHeadDim + lane * 4;
  const bf16* grow = dy + (size_t(t) * a.H + h) * kAttentionHeadDim + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) qv[i] = __bfloat162float(qrow[i]) * kAttentionScale, g[i] = __bfloat162float(grow[i]);
  float row_lse = lse[size_t(h) * a.T + t], row_delta = delta[size_t(h) * a.T + t];
  for (int j = 0; j < m.kv_count[qb]; ++j) {
    int kb = m.kv_index[qb * m.max_kv + j];
    for (int s = kb * kAttentionBlock; s < (kb + 1) * kAttentionBlock; ++s) {
      if (!attends(m, t, s)) continue;
      const bf16* krow = k + s * a.k_stride + h * kAttentionHeadDim + lane * 4;
      const bf16* vrow = v + s * a.v_stride + h * kAttentionHeadDim + lane * 4;
      float kv[4], score = 0, dp = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        kv[i] = __bfloat162float(krow[i]);
        score += qv[i] * kv[i];
        dp += g[i] * __bfloat162float(vrow[i]);
      }
      score = warp_sum(score);
      dp = warp_sum(dp);
      float ds = __expf(score - row_lse) * (dp - row_delta) * kAttentionScale;
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] += ds * kv[i];
    }
  }
  bf16* out = dq + (size_t(t) * a.H + h) * kAttentionHeadDim + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = __float2bfloat16(acc[i]);
}

// One warp per (key s, head h): dk[s, h] = scale * sum_t P_ts (dy_t . v_s - delta_t) q_t and
// dv[s, h] = sum_t P_ts dy_t, over the query blocks that list s's block.
__global__ void attention_backward_dkv_kernel(const bf16* q, const bf16* k, const bf16* v, const bf16* dy,
                                              const float* lse, const float* delta, bf16* dk, bf16* dv,
                                              AttentionTensors a, DeviceAttentionMask m) {
  int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= a.T * a.H) return;
  int s = warp / a.H, h = warp % a.H, kb = s / kAttentionBlock;
  float kv[4], vv[4], dk_acc[4] = {0, 0, 0, 0}, dv_acc[4] = {0, 0, 0, 0};
  const bf16* krow = k + s * a.k_stride + h * kAttentionHeadDim + lane * 4;
  const bf16* vrow = v + s * a.v_stride + h * kAttentionHeadDim + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) kv[i] = __bfloat162float(krow[i]), vv[i] = __bfloat162float(vrow[i]);
  for (int j = 0; j < m.q_count[kb]; ++j) {
    int qb = m.q_index[kb * m.max_q + j];
    for (int t = qb * kAttentionBlock; t < (qb + 1) * kAttentionBlock; ++t) {
      if (!attends(m, t, s)) continue;
      const bf16* qrow = q + t * a.q_stride + h * kAttentionHeadDim + lane * 4;
      const bf16* grow = dy + (size_t(t) * a.H + h) * kAttentionHeadDim + lane * 4;
      float qv[4], g[4], score = 0, dp = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        qv[i] = __bfloat162float(qrow[i]);
        g[i] = __bfloat162float(grow[i]);
        score += qv[i] * kv[i];
        dp += g[i] * vv[i];
      }
      score = warp_sum(score) * kAttentionScale;
      dp = warp_sum(dp);
      float p = __expf(score - lse[size_t(h) * a.T + t]);
      float ds = p * (dp - delta[size_t(h) * a.T + t]) * kAttentionScale;
#pragma unroll
      for (int i = 0; i < 4; ++i) dk_acc[i] += ds * qv[i], dv_acc[i] += p * g[i];
    }
  }
  size_t at = (size_t(s) * a.H + h) * kAttentionHeadDim + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) dk[at + i] = __float2bfloat16(dk_acc[i]), dv[at + i] = __float2bfloat16(dv_acc[i]);
}

// One micro-sequence's document ids and block lists for one window, on the device (in memory of
// the StagedUploads, valid until its next reset).
class AttentionMask {
 public:
  AttentionMask(const std::vector<int32_t>& docs, const AttentionBlockLists& lists, StagedUploads& uploads,
                cudaStream_t stream) {
    m_.num_blocks = lists.num_blocks;
    m_.max_kv = lists.max_kv;
    m_.max_q = lists.max_q;
    m_.docs = uploads.upload(docs, stream);
    m_.kv_count = uploads.upload(lists.kv_count, stream);
    m_.kv_index = uploads.upload(lists.kv_index, stream);
    m_.q_count = uploads.upload(lists.q_count, stream);
    m_.q_index = uploads.upload(lists.q_index, stream);
  }
  // What the constructor stages, for StagedUploads::reset.
  static size_t upload_bytes(const std::vector<int32_t>& docs, const AttentionBlockLists& lists) {
    return StagedUploads::bytes_for(docs) + StagedUploads::bytes_for(lists.kv_count) +
           StagedUploads::bytes_for(lists.kv_index) + StagedUploads::bytes_for(lists.q_count) +
           StagedUploads::bytes_for(lists.q_index);
  }
  const DeviceAttentionMask& device() const { return m_; }

 private:
  DeviceAttentionMask m_;
};

// T a whole number of 128-token blocks, as many as the mask has.
inline void check_attention_shape(const AttentionTensors& a, const AttentionMask& mask) {
  if (a.T % kAttentionBlock != 0 || mask.device().num_blocks != a.T / kAttentionBlock)
    throw std::invalid_argument("attention: T = " + std::to_string(a.T) + " must be a multiple of " +
                                std::to_string(kAttentionBlock) + " matching the mask");
}

inline int attention_grid(const AttentionTensors& a, int warps_per_block) {
  return (a.T * a.H + warps_per_block - 1) / warps_per_block;
}

// y, lse: [T, H, 128], [H, T]
inline void attention_forward(const bf16* q, const bf16* k, const bf16* v, bf16* y, float* lse, const AttentionTensors& a,
                              const AttentionMask& mask, cudaStream_t stream) {
  check_attention_shape(a, mask);
  attention_forward_kernel<<<attention_grid(a, 8), 256, 0, stream>>>(q, k, v, y, lse, a, mask.device());
  CUDA_CHECK_LAUNCH();
}

// delta: [H, T] scratch; dq, dk, dv: [T, H, 128]
inline void attention_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* y, const bf16* dy,
                               const float* lse, float* delta, bf16* dq, bf16* dk, bf16* dv,
                               const AttentionTensors& a, const AttentionMask& mask, cudaStream_t stream) {
  check_attention_shape(a, mask);
  attention_delta_kernel<<<attention_grid(a, 8), 256, 0, stream>>>(y, dy, delta, a.T, a.H);
  CUDA_CHECK_LAUNCH();
  attention_backward_dq_kernel<<<attention_grid(a, 8), 256, 0, stream>>>(q, k, v, dy, lse, delta, dq, a, mask.device());
  CUDA_CHECK_LAUNCH();
  attention_backward_dkv_kernel<<<attention_grid(a, 8), 256, 0, stream>>>(q, k, v, dy, lse, delta, dk, dv, a, mask.device());
  CUDA_CHECK_LAUNCH();
}
// ===== end of kernels/attention.cuh =====
// ===== kernels/cross_entropy.cuh (inlined) =====
// Softcapped cross-entropy over the padded vocabulary (SPEC 1.2.7), forward and backward fused:
// z = cap * sigmoid(logit / divisor), loss_t = logsumexp(z_t) - z_t[target]. One block per token;
// its row of bf16 logits is read once into shared memory, and the gradient of the SUMMED loss
// (times grad_scale) overwrites the logits in place or goes straight to the FP8 head's e5m2
// operand: no probability tensor is ever stored.

#include <cmath>
#include <stdexcept>
#include <string>

// The reference divides by 7.5 sqrt(d), which inductor turns into a product with the double's
// reciprocal rounded to fp32 (one ulp from the fp32 reciprocal of the fp32 divisor).
struct Softcap {
  static float reciprocal_divisor(int model_dim) { return float(1 / (7.5 * std::sqrt(double(model_dim)))); }
  static Softcap for_model_dim(int model_dim) {
    Softcap s;
    s.inv_divisor = reciprocal_divisor(model_dim);
    return s;
  }
  float cap = 30.0f;
  float inv_divisor = reciprocal_divisor(768);
};

constexpr int kCrossEntropyThreads = 1024;

// Where the loss gradient goes, 8 elements at a time (`element` indexes [T, V]): by default in
// place over the bf16 logits; the FP8 head (fp8_head.cuh) stores its e5m2 operand instead.
struct Bf16GradientInPlace {
  bf16* logits;
  __device__ void operator()(size_t element, const float g[8]) const { store8(logits + element, g); }
};

// logits [T, V] bf16, targets [T], losses [T] fp32; the gradient (when grad_scale != 0) to `store`.
// z <= cap, so exp(z - cap) never overflows and logsumexp needs no running maximum.
template <class GradientStore>
__global__ void __launch_bounds__(kCrossEntropyThreads)
softcap_cross_entropy_kernel(const bf16* logits, const uint16_t* targets, float* losses, int V, Softcap sc,
                             float grad_scale, GradientStore store) {
  extern __shared__ Bf16x8 row_smem[];  // [V / 8]
  const int t = blockIdx.x, vectors = V / 8;
  const float inv_divisor = sc.inv_divisor;
  const bf16* row = logits + size_t(t) * V;
  float sum = 0;
  for (int i = threadIdx.x; i < vectors; i += blockDim.x) {
    Bf16x8 x = reinterpret_cast<const Bf16x8*>(row)[i];
    row_smem[i] = x;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float sig = __fdividef(1.0f, 1.0f + __expf(-__bfloat162float(x.v[j]) * inv_divisor));
      sum += __expf(sc.cap * sig - sc.cap);
    }
  }
  sum = block_sum(sum);
  int target = targets[t];
  float z_target =
      __fdividef(sc.cap, 1.0f + __expf(-__bfloat162float(reinterpret_cast<const bf16*>(row_smem)[target]) * inv_divisor));
  if (threadIdx.x == 0) losses[t] = sc.cap + logf(sum) - z_target;
  if (grad_scale == 0.0f) return;
  float inv_sum = 1.0f / sum;
  for (int i = threadIdx.x; i < vectors; i += blockDim.x) {
    float g[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float sig = __fdividef(1.0f, 1.0f + __expf(-__bfloat162float(row_smem[i].v[j]) * inv_divisor));
      float p = __expf(sc.cap * sig - sc.cap) * inv_sum;
      float dz = p - (i * 8 + j == target ? 1.0f : 0.0f);
      g[j] = dz * (grad_scale * sc.cap * inv_divisor) * sig * (1.0f - sig);
    }
    store(size_t(t) * V + i * 8, g);
  }
}

// Token losses of logits [T, V] and, unless grad_scale is 0, the gradient of their SUM (times
// grad_scale) handed to `store`. The row read ends before any store, so a store may overwrite it.
template <class GradientStore>
void softcap_cross_entropy(const bf16* logits, const uint16_t* targets, float* losses, int T, int V, float grad_scale,
                           GradientStore store, cudaStream_t stream, Softcap sc) {
  if (V % 8) throw std::invalid_argument("cross entropy: vocab " + std::to_string(V) + " is not a multiple of 8");
  size_t smem = size_t(V) * sizeof(bf16);
  CUDA_CHECK(cudaFuncSetAttribute(softcap_cross_entropy_kernel<GradientStore>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  softcap_cross_entropy_kernel<GradientStore>
      <<<T, kCrossEntropyThreads, smem, stream>>>(logits, targets, losses, V, sc, grad_scale, store);
  CUDA_CHECK_LAUNCH();
}

// grad_scale = 1: the gradient of the summed loss (training) overwrites the logits; 0: losses only
// (evaluation).
inline void softcap_cross_entropy(bf16* logits, const uint16_t* targets, float* losses, int T, int V,
                                  float grad_scale, cudaStream_t stream, Softcap sc = {}) {
  softcap_cross_entropy(logits, targets, losses, T, V, grad_scale, Bf16GradientInPlace{logits}, stream, sc);
}

constexpr int kLossSumThreads = 1024;

// *total += losses[0] + ... + losses[T - 1] in double, in a fixed order (one block).
__global__ void __launch_bounds__(kLossSumThreads) accumulate_loss_kernel(const float* losses, int T, double* total) {
  __shared__ double partial[kLossSumThreads];
  double sum = 0;
  for (int t = threadIdx.x; t < T; t += blockDim.x) sum += losses[t];
  partial[threadIdx.x] = sum;
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    __syncthreads();
    if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
  }
  if (threadIdx.x == 0) *total += partial[0];
}

// The step's losses summed on the device as micro-sequences finish: the host reads the total once
// per step (or validation) instead of waiting for every micro-sequence.
inline void accumulate_loss(const float* losses, int T, double* total, cudaStream_t stream) {
  accumulate_loss_kernel<<<1, kLossSumThreads, 0, stream>>>(losses, T, total);
  CUDA_CHECK_LAUNCH();
}
// ===== end of kernels/cross_entropy.cuh =====
// ===== kernels/device_comm.cuh (inlined) =====
// The collectives of the trainer on device buffers, ordered on CUDA streams (SPEC 4.3, 4.4), with
// two backends: NCCL across processes (one per GPU: the production path) and W simulated ranks as
// threads of one process on one GPU, each with its own stream, whose collectives read the other
// ranks' buffers directly and reduce in rank order (deterministic; NCCL below 2.30 refuses two
// ranks on one GPU). Gradients are only ever SUM-reduced (SPEC 4.2). The gradient traffic modes
// of SPEC 4.3 sit on top: fp32 reduce-scatter, bf16 reduce-scatter, bf16 all-to-all with the
// owner summing in fp32 in rank order.
// ===== kernels/comm.h (inlined) =====
// The collectives the trainer needs, behind one small interface (SPEC 4.4): a production backend
// (NCCL, one process per GPU) and a simulated one, W virtual ranks as threads of one process whose
// collectives rendezvous and reduce in a fixed rank order, so results are bitwise deterministic.
// Gradients are only ever SUM-reduced (SPEC 4.2): there is no AVG anywhere.
// ===== kernels/faults.h (inlined) =====
// Test-only fault switch: known distributed bugs that the oracle (tests/test_oracle.cpp) must catch,
// wrong results of the fast paths that the start-up self-check (self_check.cuh) must catch, and
// DiLoCo's outer-loop bugs that its oracle (tests/gpu/test_diloco.cu) must catch.
// Production code never sets it; the communication and optimizer layers and the self-check read it.

enum class Fault {
  none,
  avg_instead_of_sum,          // reduce-scatter divides its sum by the world size
  local_count_normalization,   // gradients normalised by the rank's own micro-sequence count
  prescale_by_world,           // each rank divides its gradient by W before the SUM
  drop_rank_contribution,      // the last rank's contribution is left out of every reduce-scatter
  wrong_shard_offset,          // DistAdam updates the parameter slice of the next rank
  skip_all_gather,             // Muon's all-gather is skipped: other ranks keep stale matrices
  replicated_count_per_rank,   // every rank contributes the (replicated) global count to its sum
  wrong_flash_attention,       // the self-check sees the flash kernels' outputs 25% off
  wrong_fp8_head,              // ... the FP8 head's products
  wrong_fused_e5m2_gradient,   // ... the cross-entropy's fused e5m2 gradient
  wrong_batched_muon,          // ... the batched Muon update
  wrong_fused_residual_add,    // ... the matmul with the residual as cuBLASLt's C
  diloco_flipped_sign,         // DiLoCo's pseudo-gradient is local - global (torchft#233's bug)
  diloco_mix_to_copy,          // the mix of local and global is written to a copy, not in place
  diloco_average_by_world,     // the pseudo-gradients' sum is divided by W instead of G
  diloco_wrong_fragment,       // each sync exchanges the next fragment instead of its own
  diloco_momentum_reset,       // the outer momentum starts from zero at every sync
  diloco_delay_wrong_step,     // an exchange is applied one step after its delay
  local_matrix_gradient,       // a hidden matrix's owner updates it (REKLS factors, moments) from its own partial sum
  rekls_rotation_untransposed, // REKLS rotates the update back by Q_L U Q_R instead of Q_L U Q_R^T
};

inline Fault& injected_fault() {
  static Fault fault = Fault::none;
  return fault;
}

// Sets a fault for the lifetime of the guard and always restores Fault::none (an exception too).
struct ScopedFault {
  explicit ScopedFault(Fault f) { injected_fault() = f; }
  ~ScopedFault() { injected_fault() = Fault::none; }
  ScopedFault(const ScopedFault&) = delete;
  ScopedFault& operator=(const ScopedFault&) = delete;
};

inline const char* fault_name(Fault f) {
  switch (f) {
    case Fault::none: return "none";
    case Fault::avg_instead_of_sum: return "avg_instead_of_sum";
    case Fault::local_count_normalization: return "local_count_normalization";
    case Fault::prescale_by_world: return "prescale_by_world";
    case Fault::drop_rank_contribution: return "drop_rank_contribution";
    case Fault::wrong_shard_offset: return "wrong_shard_offset";
    case Fault::skip_all_gather: return "skip_all_gather";
    case Fault::replicated_count_per_rank: return "replicated_count_per_rank";
    case Fault::wrong_flash_attention: return "wrong_flash_attention";
    case Fault::wrong_fp8_head: return "wrong_fp8_head";
    case Fault::wrong_fused_e5m2_gradient: return "wrong_fused_e5m2_gradient";
    case Fault::wrong_batched_muon: return "wrong_batched_muon";
    case Fault::wrong_fused_residual_add: return "wrong_fused_residual_add";
    case Fault::diloco_flipped_sign: return "diloco_flipped_sign";
    case Fault::diloco_mix_to_copy: return "diloco_mix_to_copy";
    case Fault::diloco_average_by_world: return "diloco_average_by_world";
    case Fault::diloco_wrong_fragment: return "diloco_wrong_fragment";
    case Fault::diloco_momentum_reset: return "diloco_momentum_reset";
    case Fault::diloco_delay_wrong_step: return "diloco_delay_wrong_step";
    case Fault::local_matrix_gradient: return "local_matrix_gradient";
    case Fault::rekls_rotation_untransposed: return "rekls_rotation_untransposed";
  }
  return "?";
}
// ===== end of kernels/faults.h =====

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

enum class DType { f32, f64 };

inline size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 8; }

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }

// Collectives of one rank. Every call is collective: all ranks make the same calls in one order.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // send: [W * count]; recv: [count] = sum over ranks q = 0..W-1, in that order, of send_q[rank * count + i]
  virtual void reduce_scatter_sum(const void* send, void* recv, size_t count, DType dtype) = 0;
  // send: [count]; recv: [W * count], slot q holds rank q's send
  virtual void all_gather(const void* send, void* recv, size_t count, DType dtype) = 0;
  // send: [W * count], chunk q goes to rank q; recv: [W * count], chunk q came from rank q
  virtual void all_to_all(const void* send, void* recv, size_t count, DType dtype) = 0;
  virtual double all_reduce_sum(double value) = 0;  // a scalar, summed in rank order
  virtual void barrier() = 0;
};

template <typename T>
void reduce_scatter_sum(Communicator& c, const T* send, T* recv, size_t count) {
  c.reduce_scatter_sum(send, recv, count, dtype_of<T>());
}
template <typename T>
void all_gather(Communicator& c, const T* send, T* recv, size_t count) {
  c.all_gather(send, recv, count, dtype_of<T>());
}
template <typename T>
void all_to_all(Communicator& c, const T* send, T* recv, size_t count) {
  c.all_to_all(send, recv, count, dtype_of<T>());
}

// Thrown in every waiting rank when another rank of the simulated world failed.
struct WorldAborted : std::runtime_error {
  WorldAborted() : std::runtime_error("another rank of the simulated world failed") {}
};

// W ranks as threads of one process that meet at barriers. If a rank throws, the others are
// released from any barrier they wait in (with WorldAborted), and run() rethrows the error of the
// lowest rank that failed on its own (deterministic, unlike "first in time"): nothing hangs.
// The simulated worlds of host memory (below) and of device memory (kernels/device_comm.cuh)
// build their collectives on it.
class RankThreads {
 public:
  explicit RankThreads(int world_size) : world_size_(world_size) {
    if (world_size < 1) throw std::invalid_argument("world size " + std::to_string(world_size) + " < 1");
  }
  int world_size() const { return world_size_; }

  // Runs per_rank(rank) on W threads and joins them.
  void run(const std::function<void(int rank)>& per_rank) {
    aborted_ = false;
    std::vector<std::exception_ptr> errors(world_size_);
    std::vector<std::thread> threads;
    try {
      for (int r = 0; r < world_size_; ++r)
        threads.emplace_back([&, r] {
          try {
            per_rank(r);
          } catch (...) {
            errors[r] = std::current_exception();
            abort_all();
          }
        });
    } catch (...) {  // a thread could not start: release the started ones before failing
      abort_all();
      for (std::thread& t : threads) t.join();
      throw;
    }
    for (std::thread& t : threads) t.join();
    std::exception_ptr first_real = nullptr, first_any = nullptr;
    for (const std::exception_ptr& e : errors) {
      if (!e) continue;
      if (!first_any) first_any = e;
      try { std::rethrow_exception(e); } catch (const WorldAborted&) {} catch (...) { if (!first_real) first_real = e; }
    }
    if (first_real) std::rethrow_exception(first_real);
    if (first_any) std::rethrow_exception(first_any);
  }

  // A world whose ranks are threads of this one (a split of it): released when this one fails.
  // It unregisters itself before it is destroyed; this world outlives it.
  void add_child(RankThreads* child) {
    std::lock_guard<std::mutex> lock(mutex_);
    children_.push_back(child);
  }
  void remove_child(RankThreads* child) {
    std::lock_guard<std::mutex> lock(mutex_);
    children_.erase(std::remove(children_.begin(), children_.end(), child), children_.end());
  }

  // A generation-counting barrier that throws WorldAborted once any rank failed.
  void meet() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (aborted_) throw WorldAborted();
    uint64_t generation = generation_;
    if (++arrived_ == world_size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != generation || aborted_; });
    if (generation_ == generation) throw WorldAborted();
  }

 private:
  void abort_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = true;
    arrived_ = 0;
    cv_.notify_all();
    for (RankThreads* child : children_) child->abort_all();
  }

  int world_size_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  std::vector<RankThreads*> children_;
};

// W virtual ranks in host memory. Each collective: every rank posts its send pointer, meets the
// others at a barrier, computes its own output by reading all posted buffers in rank order, and
// meets them again before any send buffer may be reused.
class SimulatedWorld {
 public:
  explicit SimulatedWorld(int world_size) : threads_(world_size), posted_(world_size), scalars_(world_size) {}
  int world_size() const { return threads_.world_size(); }

  void run(const std::function<void(Communicator&)>& per_rank) {
    threads_.run([&](int rank) {
      Rank comm(*this, rank);
      per_rank(comm);
    });
  }

 private:
  class Rank : public Communicator {
   public:
    Rank(SimulatedWorld& world, int rank) : world_(world), rank_(rank) {}
    int rank() const override { return rank_; }
    int world_size() const override { return world_.world_size(); }
    void reduce_scatter_sum(const void* send, void* recv, size_t count, DType dtype) override {
      world_.collective(rank_, send, [&] { world_.reduce_own_chunk(rank_, recv, count, dtype); });
    }
    void all_gather(const void* send, void* recv, size_t count, DType dtype) override {
      world_.collective(rank_, send, [&] {
        size_t bytes = count * dtype_size(dtype);
        for (int q = 0; q < world_.world_size(); ++q)
          std::memcpy(static_cast<char*>(recv) + q * bytes, world_.posted_[q], bytes);
      });
    }
    void all_to_all(const void* send, void* recv, size_t count, DType dtype) override {
      world_.collective(rank_, send, [&] {
        size_t bytes = count * dtype_size(dtype);
        for (int q = 0; q < world_.world_size(); ++q)
          std::memcpy(static_cast<char*>(recv) + q * bytes, static_cast<const char*>(world_.posted_[q]) + rank_ * bytes, bytes);
      });
    }
    double all_reduce_sum(double value) override {
      double sum = 0;
      world_.scalars_[rank_] = value;
      world_.collective(rank_, nullptr, [&] {
        for (double v : world_.scalars_) sum += v;
      });
      return sum;
    }
    void barrier() override { world_.threads_.meet(); }

   private:
    SimulatedWorld& world_;
    int rank_;
  };

  // out: [count] = rank-order sum of every posted send's chunk `rank`, accumulated in T so that
  // the result does not depend on thread timing. The test-only faults are read once per call.
  template <typename T>
  void reduce_chunk(int rank, T* out, size_t count) const {
    const Fault fault = injected_fault();
    const int world_size = threads_.world_size();
    const int contributors = fault == Fault::drop_rank_contribution && world_size > 1 ? world_size - 1 : world_size;
    const bool average = fault == Fault::avg_instead_of_sum;
    for (size_t i = 0; i < count; ++i) {
      T sum = 0;
      for (int q = 0; q < contributors; ++q) sum += static_cast<const T*>(posted_[q])[rank * count + i];
      out[i] = average ? sum / T(world_size) : sum;
    }
  }
  void reduce_own_chunk(int rank, void* recv, size_t count, DType dtype) const {
    if (dtype == DType::f32) reduce_chunk(rank, static_cast<float*>(recv), count);
    else reduce_chunk(rank, static_cast<double*>(recv), count);
  }

  // Post, meet, compute this rank's output, meet again.
  void collective(int rank, const void* send, const std::function<void()>& compute_own_output) {
    posted_[rank] = send;
    threads_.meet();
    compute_own_output();
    threads_.meet();
  }

  RankThreads threads_;
  std::vector<const void*> posted_;  // [W] send buffers of the collective in progress
  std::vector<double> scalars_;      // [W] values of the scalar all-reduce in progress
};
// ===== end of kernels/comm.h =====

#include <nccl.h>

#include <algorithm>
#include <exception>
#include <memory>
#include <string>
#include <vector>

enum class DeviceDType { f32, bf16 };

inline size_t dtype_size(DeviceDType t) { return t == DeviceDType::f32 ? 4 : 2; }

class DeviceCommunicator {
 public:
  virtual ~DeviceCommunicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // send: [W * count]; recv: [count] = sum over ranks q of send_q[rank * count + i]
  virtual void reduce_scatter_sum(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) = 0;
  // send: [count], may be recv + rank * count (in place); recv: [W * count], slot q from rank q
  virtual void all_gather(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) = 0;
  // send: [W * count], chunk q goes to rank q; recv: [W * count], chunk q came from rank q
  virtual void all_to_all(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) = 0;
  // send: [count], recv: [count] = the sum over ranks q, in rank order where the backend keeps one,
  // of send_q; recv is another buffer than send (the simulated ranks read each other's sends)
  virtual void all_reduce_sum(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) = 0;
  // A host scalar summed over the ranks (validation losses and token counts); synchronous.
  virtual double all_reduce_sum(double value) = 0;
  // The ranks of this communicator with the same color, as a communicator of their own, ranked by
  // key (ties by rank); collective: every rank calls it, in the same order as its other calls.
  virtual std::unique_ptr<DeviceCommunicator> split(int color, int key) = 0;
};

// ------------------------------------------------------------------------------------------------
// NCCL: one process per GPU.
// ------------------------------------------------------------------------------------------------
class NcclCommunicator : public DeviceCommunicator {
 public:
  NcclCommunicator(int rank, int world_size, const ncclUniqueId& id) : rank_(rank), world_size_(world_size) {
    NCCL_CHECK(ncclCommInitRank(&comm_, world_size, id, rank));
    CUDA_CHECK(cudaMalloc(&scalar_, sizeof(double)));
    CUDA_CHECK(cudaStreamCreateWithFlags(&scalar_stream_, cudaStreamNonBlocking));
  }
  // Leaving on an exception, the queued collectives may wait for peers that will never join them:
  // ncclCommDestroy would wait with them, ncclCommAbort does not.
  ~NcclCommunicator() override {
    if (std::uncaught_exceptions() > 0)
      ncclCommAbort(comm_);
    else
      ncclCommDestroy(comm_);
    cudaFree(scalar_);
    cudaStreamDestroy(scalar_stream_);
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  std::unique_ptr<DeviceCommunicator> split(int color, int key) override {
    ncclComm_t part = nullptr;
    NCCL_CHECK(ncclCommSplit(comm_, color, key, &part, nullptr));
    int rank = 0, size = 0;
    NCCL_CHECK(ncclCommUserRank(part, &rank));
    NCCL_CHECK(ncclCommCount(part, &size));
    return std::unique_ptr<DeviceCommunicator>(new NcclCommunicator(part, rank, size));
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  void reduce_scatter_sum(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
    NCCL_CHECK(ncclReduceScatter(send, recv, count, nccl_type(dtype), ncclSum, comm_, stream));
  }
  void all_gather(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
    NCCL_CHECK(ncclAllGather(send, recv, count, nccl_type(dtype), comm_, stream));
  }
  void all_reduce_sum(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
    NCCL_CHECK(ncclAllReduce(send, recv, count, nccl_type(dtype), ncclSum, comm_, stream));
  }
  void all_to_all(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
    const size_t bytes = count * dtype_size(dtype);
    NCCL_CHECK(ncclGroupStart());
    for (int q = 0; q < world_size_; ++q) {
      NCCL_CHECK(ncclSend(static_cast<const char*>(send) + q * bytes, count, nccl_type(dtype), q, comm_, stream));
      NCCL_CHECK(ncclRecv(static_cast<char*>(recv) + q * bytes, count, nccl_type(dtype), q, comm_, stream));
    }
    NCCL_CHECK(ncclGroupEnd());
  }
  // On a stream of its own: callers hold it to moments when no other collective of the communicator
  // is in flight (the trainer's are after a step's or validation's sync), since collectives of one
  // communicator on two streams at once may wait on each other across ranks and hang.
  double all_reduce_sum(double value) override {
    CUDA_CHECK(cudaMemcpyAsync(scalar_, &value, sizeof value, cudaMemcpyHostToDevice, scalar_stream_));
    NCCL_CHECK(ncclAllReduce(scalar_, scalar_, 1, ncclFloat64, ncclSum, comm_, scalar_stream_));
    CUDA_CHECK(cudaMemcpyAsync(&value, scalar_, sizeof value, cudaMemcpyDeviceToHost, scalar_stream_));
    CUDA_CHECK(cudaStreamSynchronize(scalar_stream_));
    return value;
  }

 private:
  NcclCommunicator(ncclComm_t comm, int rank, int world_size) : rank_(rank), world_size_(world_size), comm_(comm) {
    CUDA_CHECK(cudaMalloc(&scalar_, sizeof(double)));
    CUDA_CHECK(cudaStreamCreateWithFlags(&scalar_stream_, cudaStreamNonBlocking));
  }
  static ncclDataType_t nccl_type(DeviceDType t) { return t == DeviceDType::f32 ? ncclFloat32 : ncclBfloat16; }
  int rank_, world_size_;
  ncclComm_t comm_ = nullptr;
  double* scalar_ = nullptr;
  cudaStream_t scalar_stream_ = nullptr;
};

// ------------------------------------------------------------------------------------------------
// Simulated ranks on one GPU.
// ------------------------------------------------------------------------------------------------
constexpr int kMaxSimulatedRanks = 16;

struct RankBuffers {
  const void* at[kMaxSimulatedRanks];
};

// out[count] = sum over q < contributors, in order, of in.at[q][offset + i] (fp32 accumulation);
// divided by `divisor` (1, or W for the injected AVG fault).
template <typename T>
__global__ void sum_rank_buffers_kernel(RankBuffers in, int contributors, size_t offset, T* out, size_t count,
                                        float divisor) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    float sum = 0;
    for (int q = 0; q < contributors; ++q) sum += float(static_cast<const T*>(in.at[q])[offset + i]);
    out[i] = T(sum / divisor);
  }
}

// Each collective: every rank records "ready" on its stream and posts its send buffer; at a
// barrier each rank's stream waits for every rank's ready, then reads the posted buffers in rank
// order; each records "done", and after a second barrier every stream waits for every done, so no
// rank overwrites a send buffer that another rank's stream still reads.
class SimulatedDeviceWorld {
 public:
  // parent: the world whose threads are this one's ranks (a split), released when it fails.
  explicit SimulatedDeviceWorld(int world_size, RankThreads* parent = nullptr)
      : threads_(world_size), posted_(world_size), scalars_(world_size), ready_(world_size), done_(world_size),
        split_keys_(world_size), split_parts_(world_size), parent_(parent) {
    if (world_size > kMaxSimulatedRanks)
      throw std::invalid_argument("at most " + std::to_string(kMaxSimulatedRanks) + " simulated ranks");
    for (int r = 0; r < world_size; ++r) {
      CUDA_CHECK(cudaEventCreateWithFlags(&ready_[r], cudaEventDisableTiming));
      CUDA_CHECK(cudaEventCreateWithFlags(&done_[r], cudaEventDisableTiming));
    }
    if (parent_) parent_->add_child(&threads_);
  }
  ~SimulatedDeviceWorld() {
    if (parent_) parent_->remove_child(&threads_);
    for (cudaEvent_t e : ready_) cudaEventDestroy(e);
    for (cudaEvent_t e : done_) cudaEventDestroy(e);
  }
  SimulatedDeviceWorld(const SimulatedDeviceWorld&) = delete;
  SimulatedDeviceWorld& operator=(const SimulatedDeviceWorld&) = delete;
  int world_size() const { return threads_.world_size(); }

  void run(const std::function<void(DeviceCommunicator&)>& per_rank) {
    threads_.run([&](int rank) {
      Rank comm(*this, rank);
      per_rank(comm);
    });
  }

 private:
  class Rank : public DeviceCommunicator {
   public:
    Rank(SimulatedDeviceWorld& world, int rank) : world_(world), rank_(rank) {}
    int rank() const override { return rank_; }
    int world_size() const override { return world_.world_size(); }
    void reduce_scatter_sum(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
      world_.collective(rank_, send, stream, [&] {
        const Fault fault = injected_fault();
        const int W = world_.world_size();
        const int contributors = fault == Fault::drop_rank_contribution && W > 1 ? W - 1 : W;
        const float divisor = fault == Fault::avg_instead_of_sum ? float(W) : 1.0f;
        world_.sum_posted(contributors, rank_ * count, recv, count, dtype, divisor, stream);
      });
    }
    void all_gather(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
      world_.collective(rank_, send, stream, [&] {
        const size_t bytes = count * dtype_size(dtype);
        for (int q = 0; q < world_.world_size(); ++q)
          if (static_cast<char*>(recv) + q * bytes != world_.posted_[q])
            CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(recv) + q * bytes, world_.posted_[q], bytes,
                                       cudaMemcpyDeviceToDevice, stream));
      });
    }
    void all_to_all(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
      world_.collective(rank_, send, stream, [&] {
        const size_t bytes = count * dtype_size(dtype);
        for (int q = 0; q < world_.world_size(); ++q)
          CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(recv) + q * bytes,
                                     static_cast<const char*>(world_.posted_[q]) + rank_ * bytes, bytes,
                                     cudaMemcpyDeviceToDevice, stream));
      });
    }
    void all_reduce_sum(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
      if (send == recv) throw std::invalid_argument("simulated all_reduce_sum: recv must not be send");
      world_.collective(rank_, send, stream, [&] { world_.sum_posted(world_.world_size(), 0, recv, count, dtype, 1.0f, stream); });
    }
    std::unique_ptr<DeviceCommunicator> split(int color, int key) override { return world_.split(rank_, color, key); }
    double all_reduce_sum(double value) override {
      world_.scalars_[rank_] = value;
      world_.threads_.meet();
      double sum = 0;
      for (double v : world_.scalars_) sum += v;
      world_.threads_.meet();  // nobody overwrites scalars_ before every rank has read them
      return sum;
    }

   private:
    SimulatedDeviceWorld& world_;
    int rank_;
  };

  // A rank of a split, keeping its world alive.
  class PartRank : public Rank {
   public:
    PartRank(std::shared_ptr<SimulatedDeviceWorld> world, int rank) : Rank(*world, rank), world_(std::move(world)) {}

   private:
    std::shared_ptr<SimulatedDeviceWorld> world_;
  };

  // Every rank posts its (color, key); the first rank of each color builds that color's world,
  // whose threads are this world's, and each rank takes its place in it.
  std::unique_ptr<DeviceCommunicator> split(int rank, int color, int key) {
    split_keys_[rank] = {color, key};
    threads_.meet();
    std::vector<int> members;  // ranks of this color by (key, rank)
    for (int q = 0; q < world_size(); ++q)
      if (split_keys_[q].first == color) members.push_back(q);
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return split_keys_[a].second < split_keys_[b].second; });
    if (rank == members[0]) split_parts_[rank] = std::make_shared<SimulatedDeviceWorld>(int(members.size()), &threads_);
    threads_.meet();
    std::shared_ptr<SimulatedDeviceWorld> part = split_parts_[members[0]];
    const int part_rank = int(std::find(members.begin(), members.end(), rank) - members.begin());
    threads_.meet();  // every rank holds its part before the slots are cleared
    split_parts_[rank].reset();
    return std::make_unique<PartRank>(std::move(part), part_rank);
  }

  void collective(int rank, const void* send, cudaStream_t stream, const std::function<void()>& read_posted) {
    CUDA_CHECK(cudaEventRecord(ready_[rank], stream));
    posted_[rank] = send;
    threads_.meet();
    for (cudaEvent_t e : ready_) CUDA_CHECK(cudaStreamWaitEvent(stream, e, 0));
    read_posted();
    CUDA_CHECK(cudaEventRecord(done_[rank], stream));
    threads_.meet();
    for (cudaEvent_t e : done_) CUDA_CHECK(cudaStreamWaitEvent(stream, e, 0));
  }

  void sum_posted(int contributors, size_t offset, void* out, size_t count, DeviceDType dtype, float divisor,
                  cudaStream_t stream) const {
    RankBuffers in{};
    for (int q = 0; q < world_size(); ++q) in.at[q] = posted_[q];
    if (dtype == DeviceDType::f32)
      sum_rank_buffers_kernel<<<elementwise_grid(count), 256, 0, stream>>>(in, contributors, offset,
                                                                           static_cast<float*>(out), count, divisor);
    else
      sum_rank_buffers_kernel<<<elementwise_grid(count), 256, 0, stream>>>(in, contributors, offset,
                                                                           static_cast<bf16*>(out), count, divisor);
    CUDA_CHECK_LAUNCH();
  }

  RankThreads threads_;
  std::vector<const void*> posted_;  // [W] send buffers of the collective in progress
  std::vector<double> scalars_;      // [W] values of the scalar all-reduce in progress
  std::vector<cudaEvent_t> ready_, done_;
  std::vector<std::pair<int, int>> split_keys_;                        // [W] (color, key) of a split in progress
  std::vector<std::shared_ptr<SimulatedDeviceWorld>> split_parts_;     // [W] the parts it builds, by first rank
  RankThreads* parent_ = nullptr;
};

// ------------------------------------------------------------------------------------------------
// Gradient traffic (SPEC 4.3): how a rank's fp32 gradient sums reach their owners.
// ------------------------------------------------------------------------------------------------
enum class GradComm {
  fp32_rs,      // reduce-scatter of the fp32 sums
  bf16_rs,      // bf16 reduce-scatter: half the bytes, NCCL sums in bf16
  a2a_fp32acc,  // bf16 chunks sent to their owner, who sums the W chunks in fp32 in rank order
};

inline GradComm parse_grad_comm(const std::string& name) {
  if (name == "fp32-rs") return GradComm::fp32_rs;
  if (name == "bf16-rs") return GradComm::bf16_rs;
  if (name == "a2a-fp32acc") return GradComm::a2a_fp32acc;
  throw std::invalid_argument("grad-comm '" + name + "' is not one of fp32-rs, bf16-rs, a2a-fp32acc");
}

// out[count] = sum over q of in[q * count + i], fp32 accumulation in rank order
__global__ void sum_chunks_kernel(const bf16* in, int chunks, float* out, size_t count) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    float sum = 0;
    for (int q = 0; q < chunks; ++q) sum += __bfloat162float(in[q * count + i]);
    out[i] = sum;
  }
}

// send: [W * count] fp32 partial sums, chunk r owned by rank r; recv: [count] fp32 = the SUM of
// every rank's chunk `rank`. scratch: [2 * W * count] bf16 for the bf16 modes.
inline void reduce_scatter_grads(DeviceCommunicator& comm, GradComm mode, const float* send, float* recv, size_t count,
                                 bf16* scratch, cudaStream_t stream) {
  const size_t total = count * comm.world_size();
  switch (mode) {
    case GradComm::fp32_rs: comm.reduce_scatter_sum(send, recv, count, DeviceDType::f32, stream); return;
    case GradComm::bf16_rs:
      convert(send, scratch, total, stream);
      comm.reduce_scatter_sum(scratch, scratch + total, count, DeviceDType::bf16, stream);
      convert(scratch + total, recv, count, stream);
      return;
    case GradComm::a2a_fp32acc:
      convert(send, scratch, total, stream);
      comm.all_to_all(scratch, scratch + total, count, DeviceDType::bf16, stream);
      sum_chunks_kernel<<<elementwise_grid(count), 256, 0, stream>>>(scratch + total, comm.world_size(), recv, count);
      CUDA_CHECK_LAUNCH();
      return;
  }
}

// Bytes one rank sends for gradients per step: every gradient element leaves once (W-1 of W
// chunks travel; the own chunk stays), 4 bytes in fp32, 2 in bf16.
inline double gradient_bytes_sent(GradComm mode, double gradient_elements, int world_size) {
  return gradient_elements * (world_size - 1) / world_size * (mode == GradComm::fp32_rs ? 4 : 2);
}

// One process alone: every collective is the identity (a copy when the buffers differ), so the
// W = 1 trainer runs the same sharded optimizer code as W > 1.
class SingleRankCommunicator : public DeviceCommunicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  void reduce_scatter_sum(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
    copy(send, recv, count * dtype_size(dtype), stream);
  }
  void all_gather(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
    copy(send, recv, count * dtype_size(dtype), stream);
  }
  void all_to_all(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
    copy(send, recv, count * dtype_size(dtype), stream);
  }
  void all_reduce_sum(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
    copy(send, recv, count * dtype_size(dtype), stream);
  }
  double all_reduce_sum(double value) override { return value; }
  std::unique_ptr<DeviceCommunicator> split(int, int) override { return std::make_unique<SingleRankCommunicator>(); }

 private:
  static void copy(const void* from, void* to, size_t bytes, cudaStream_t stream) {
    if (from != to) CUDA_CHECK(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, stream));
  }
};
// ===== end of kernels/device_comm.cuh =====
// ===== kernels/diloco.cuh (inlined) =====
// Streaming DiLoCo across replica groups (Douillard et al. 2025, "Streaming DiLoCo with overlapping
// communication"). The W ranks form G groups of L = W/G consecutive ranks (a node each, typically);
// inside a group the trainer's step runs unchanged over the group's communicator, and across groups
// nothing moves but fragment exchanges. The model is cut into F fragments; every H/F steps one
// fragment, in turn, is exchanged, so each syncs once every H steps:
//   pseudo-gradient   Δ = global − local                  (the outer step global − lr·Δ moves
//                                                           toward the local progress: torchft#233)
//   average           Δ̄ = (Σ over groups Δ) / G           (an all-reduce among the ranks with the
//                                                           same place in every group)
//   outer Nesterov    m = μ·m + Δ̄;  global −= lr·(Δ̄ + μ·m)  (torch.optim.SGD, nesterov=True)
//   mix, in place     local = global + α·(local − global)  (lerp toward the local; α = 0: global)
// The exchange starts after its sync step and is applied d steps later (0 <= d < H/F), the steps
// between hiding the network; the local parameters at that point are mixed, so with α = 0 the
// local progress of those d steps is replaced. One exchange is in flight at a time.
//
// Sharding: rank l of a group owns the l-th of L equal slices of each fragment's elements (the
// fragment's parameters back to back, in parameter order), holds the global copy and the outer
// momentum of that slice only, exchanges only it (so the L ranks of a group use L links at once),
// and all-gathers the mixed slice back to the group's other ranks.
// ===== kernels/timeline.cuh (inlined) =====
// The schedule of a training step as the GPU ran it: spans of work on named lanes (the compute
// stream, the communication stream), timed by CUDA events recorded on those streams, written as
// a Chrome trace (chrome://tracing or ui.perfetto.dev). Off unless asked for: a span with no
// timeline records nothing.

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

class Timeline {
 public:
  Timeline() = default;
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;
  ~Timeline() {
    for (Span& s : spans_) {
      cudaEventDestroy(s.start);
      cudaEventDestroy(s.end);
    }
  }

  // Returns the span's index for close().
  size_t open(const std::string& lane, const std::string& name, cudaStream_t stream) {
    Span s{lane, name, event(), event()};
    CUDA_CHECK(cudaEventRecord(s.start, stream));
    spans_.push_back(s);
    return spans_.size() - 1;
  }
  // Unchecked, as it runs in destructors: a failed record leaves an error that the next checked
  // call on the stream, or write_chrome_trace, reports.
  void close(size_t span, cudaStream_t stream) noexcept { cudaEventRecord(spans_[span].end, stream); }

  // Waits for the spans' work; times are microseconds from the first span's start. Each lane is
  // a thread of the process `process_id`, named by a metadata event.
  void write_chrome_trace(const std::string& path, int process_id) const {
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<std::string> lanes;
    std::vector<std::string> events;
    char line[512];
    for (const Span& s : spans_) {
      size_t lane = std::find(lanes.begin(), lanes.end(), s.lane) - lanes.begin();
      if (lane == lanes.size()) {
        lanes.push_back(s.lane);
        std::snprintf(line, sizeof line,
                      "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %zu, \"args\": {\"name\": \"%s\"}}",
                      process_id, lane, s.lane.c_str());
        events.push_back(line);
      }
      float start_ms = 0, length_ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&start_ms, spans_[0].start, s.start));
      CUDA_CHECK(cudaEventElapsedTime(&length_ms, s.start, s.end));
      std::snprintf(line, sizeof line, "{\"name\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": %zu, \"ts\": %.1f, \"dur\": %.1f}",
                    s.name.c_str(), process_id, lane, 1000.0 * start_ms, 1000.0 * length_ms);
      events.push_back(line);
    }
    std::ofstream out(path);
    out << "{\"traceEvents\": [\n";
    for (size_t i = 0; i < events.size(); ++i) out << events[i] << (i + 1 < events.size() ? ",\n" : "\n");
    out << "]}\n";
    if (!out.flush()) throw std::runtime_error("cannot write the timeline " + path);
  }

 private:
  struct Span {
    std::string lane, name;
    cudaEvent_t start, end;
  };
  static cudaEvent_t event() {
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreate(&e));  // with timing
    return e;
  }
  std::vector<Span> spans_;
};

// One span over the work queued on `stream` during this scope; nothing without a timeline.
class TimelineSpan {
 public:
  TimelineSpan(Timeline* timeline, const char* lane, const std::string& name, cudaStream_t stream)
      : timeline_(timeline), stream_(stream) {
    if (timeline_) span_ = timeline_->open(lane, name, stream);
  }
  ~TimelineSpan() {
    if (timeline_) timeline_->close(span_, stream_);
  }
  TimelineSpan(const TimelineSpan&) = delete;
  TimelineSpan& operator=(const TimelineSpan&) = delete;

 private:
  Timeline* timeline_;
  cudaStream_t stream_;
  size_t span_ = 0;
};
// ===== end of kernels/timeline.cuh =====

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

struct DiLoCoSettings {
  int groups = 1;             // G; 1: no DiLoCo, the trainer as it is
  int fragments = 3;          // F
  int sync_every = 30;        // H: steps between two syncs of one fragment (a multiple of F)
  int delay = 0;              // d: steps between an exchange's start and its use (< H / F)
  double outer_lr = 0.7;      // the DiLoCo paper's outer SGD
  double outer_momentum = 0.9;
  double alpha = 0;           // mix: 0 takes the global copy, 1 keeps the local parameters
  bool bf16_exchange = false; // pseudo-gradients travel in bf16 (half the bytes)
  bool host_copies = false;   // the global copies and outer momentum in pinned host memory, mapped
  int period() const { return sync_every / fragments; }
};

// Why settings cannot run, or "" (world_size: W; num_blocks: the model's blocks to cut into fragments).
inline std::string diloco_settings_problem(const DiLoCoSettings& s, int world_size, int num_blocks) {
  if (s.groups < 1) return "--diloco-groups must be positive";
  if (world_size % s.groups != 0)
    return "--diloco-groups " + std::to_string(s.groups) + " does not divide the " + std::to_string(world_size) +
           " ranks into equal groups";
  if (s.groups == 1) return "";
  if (s.fragments < 1 || s.fragments > num_blocks)
    return "--diloco-fragments must be between 1 and the model's " + std::to_string(num_blocks) + " blocks";
  if (s.sync_every < 1 || s.sync_every % s.fragments != 0)
    return "--diloco-sync-every " + std::to_string(s.sync_every) + " must be a positive multiple of --diloco-fragments " +
           std::to_string(s.fragments) + " (one fragment syncs every H/F steps)";
  if (s.delay < 0 || s.delay >= s.period())
    return "--diloco-sync-delay " + std::to_string(s.delay) + " must be in [0, H/F = " + std::to_string(s.period()) +
           "): an exchange is applied before the next one starts";
  return "";
}

// The fragment whose exchange starts once `steps_done` inner steps are done, or -1.
inline int diloco_fragment_starting(const DiLoCoSettings& s, int steps_done) {
  const int P = s.period();
  if (steps_done <= 0 || steps_done % P != 0) return -1;
  const int turn = injected_fault() == Fault::diloco_wrong_fragment ? steps_done / P : steps_done / P - 1;
  return turn % s.fragments;
}

// The step count after which an exchange started at `started` is applied.
inline int diloco_apply_step(const DiLoCoSettings& s, int started) {
  return started + s.delay + (injected_fault() == Fault::diloco_delay_wrong_step ? 1 : 0);
}

// A parameter's storage, whole: fp32 masters or bf16 embeddings.
struct ParamStorage {
  void* data;
  bool bf16;
  size_t count;
};

// One run of a rank's slice that lies in one parameter: slice elements [at, at + count) are
// storage elements [first, first + count).
struct SlicePiece {
  ParamStorage param;
  size_t first, at, count;
};

// The pieces of elements [begin, end) of a fragment whose parameters lie back to back in order.
inline std::vector<SlicePiece> slice_pieces(const std::vector<ParamStorage>& fragment, size_t begin, size_t end) {
  std::vector<SlicePiece> pieces;
  size_t start = 0;
  for (const ParamStorage& p : fragment) {
    const size_t lo = std::max(begin, start), hi = std::min(end, start + p.count);
    if (lo < hi) pieces.push_back({p, lo - start, lo - begin, hi - lo});
    start += p.count;
  }
  return pieces;
}

// ------------------------------------------------------------------------------------------------
// Kernels over one piece (elementwise; fp32 arithmetic, bf16 parameters rounded once at the store).
// ------------------------------------------------------------------------------------------------
template <typename T>
__global__ void pseudo_gradient_kernel(const T* local, const float* global, float* out, size_t n, bool flipped) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = flipped ? float(local[i]) - global[i] : global[i] - float(local[i]);
}

// m = mu m + avg; global -= lr (avg + mu m), avg = sum / divisor; reset: m starts from 0 (a fault).
__global__ void outer_nesterov_kernel(const float* sum, float divisor, float* momentum, float* global, size_t n,
                                      float lr, float mu, bool reset) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float avg = sum[i] / divisor;
    const float m = mu * (reset ? 0.0f : momentum[i]) + avg;
    momentum[i] = m;
    global[i] -= lr * (avg + mu * m);
  }
}

// out = global + alpha (local - global): torch's global.lerp_(local, alpha).
template <typename T>
__global__ void mix_kernel(const T* local, const float* global, T* out, size_t n, float alpha) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = T(global[i] + alpha * (float(local[i]) - global[i]));
}

// ------------------------------------------------------------------------------------------------
// The communicators of G groups of L consecutive ranks: `group` for the inner step, `across` for
// the exchanges (the G ranks with one place l in every group, ranked by group). G = 1: none.
// ------------------------------------------------------------------------------------------------
struct ReplicaGroups {
  std::unique_ptr<DeviceCommunicator> group, across;
  ReplicaGroups(DeviceCommunicator& world, int groups) {
    if (groups <= 1) return;
    const int L = world.world_size() / groups;
    group = world.split(world.rank() / L, world.rank());
    across = world.split(world.rank() % L, world.rank());
  }
};

// ------------------------------------------------------------------------------------------------
// One rank's outer loop. Per inner step, after the step's update: after_step(steps done).
// ------------------------------------------------------------------------------------------------
class DiLoCo {
 public:
  // fragments: each fragment's parameters in order (this rank's storage, whole).
  DiLoCo(const DiLoCoSettings& settings, const std::vector<std::vector<ParamStorage>>& fragments, DeviceCommunicator& group,
         DeviceCommunicator& across)
      : s_(settings), group_(group), across_(across) {
    const int L = group_.world_size();
    size_t largest = 0;
    for (const std::vector<ParamStorage>& f : fragments) {
      size_t total = 0;
      for (const ParamStorage& p : f) total += p.count;
      Slices sl;
      sl.total = total;
      sl.share = (total + L - 1) / L;
      sl.mine = slice_pieces(f, sl.share * group_.rank(), std::min(total, sl.share * (group_.rank() + 1)));
      for (int q = 0; q < L; ++q) sl.of_rank.push_back(slice_pieces(f, sl.share * q, std::min(total, sl.share * (q + 1))));
      sl.global = alloc_copy(sl.share);
      sl.momentum = alloc_copy(sl.share);
      CUDA_CHECK(cudaMemset(sl.global, 0, sl.share * sizeof(float)));
      CUDA_CHECK(cudaMemset(sl.momentum, 0, sl.share * sizeof(float)));
      largest = std::max(largest, sl.share);
      slices_.push_back(std::move(sl));
    }
    send_ = alloc<float>(largest);
    received_ = alloc<float>(largest);
    CUDA_CHECK(cudaMemset(received_, 0, largest * sizeof(float)));
    if (s_.bf16_exchange) traffic_ = alloc<bf16>(2 * largest);
    if (L > 1) gathered_ = alloc<float>(size_t(L) * largest);
    norm_ = alloc<float>(1);
    CUDA_CHECK(cudaStreamCreateWithFlags(&exchange_stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&exchanged_, cudaEventDisableTiming));
  }
  ~DiLoCo() {
    for (void* p : owned_) cudaFree(p);
    for (void* p : owned_host_) cudaFreeHost(p);
    cudaEventDestroy(ready_);
    cudaEventDestroy(exchanged_);
    cudaStreamDestroy(exchange_stream_);
  }
  DiLoCo(const DiLoCo&) = delete;
  DiLoCo& operator=(const DiLoCo&) = delete;

  // Spans of each exchange and its application go to this timeline (null: none).
  void set_timeline(Timeline* timeline) { timeline_ = timeline; }

  // The global copies become the local parameters (identical in every group at the start).
  void take_global_copies(cudaStream_t stream) {
    for (Slices& sl : slices_)
      for (const SlicePiece& p : sl.mine) to_flat(p, sl.global, stream);
  }

  // After inner step `steps_done` (1, 2, ...) of this rank's group, on the stream of the steps:
  // applies the exchange due now, starts the one due now. Returns the log line of an applied sync.
  std::string after_step(int steps_done, cudaStream_t stream) {
    std::string line;
    if (pending_ && pending_->apply_at <= steps_done) line = apply(steps_done, s_.alpha, stream);
    const int f = diloco_fragment_starting(s_, steps_done);
    if (f >= 0) {
      start(f, steps_done, stream);
      if (pending_->apply_at <= steps_done) line = apply(steps_done, s_.alpha, stream);
    }
    return line;
  }

  // At the end of training: the exchange in flight is applied, then every fragment syncs once more
  // and takes its global copy (α = 0), so that every group ends with the same parameters.
  std::vector<std::string> finish(int steps_done, cudaStream_t stream) {
    std::vector<std::string> lines;
    if (pending_) lines.push_back(apply(steps_done, s_.alpha, stream));
    for (int f = 0; f < s_.fragments; ++f) {
      start(f, steps_done, stream);
      lines.push_back(apply(steps_done, 0.0, stream));
    }
    return lines;
  }

  // After a resume at `steps_done`: the exchange the checkpoint holds in flight (its sum, complete).
  void resumed_at(int steps_done) {
    pending_.reset();
    const int started = steps_done / s_.period() * s_.period();
    const int f = diloco_fragment_starting(s_, started);
    if (f >= 0 && diloco_apply_step(s_, started) > steps_done) pending_ = Pending{f, started, diloco_apply_step(s_, started)};
  }

  // The state a checkpoint carries: each fragment's global slice and outer momentum, and the sum of
  // the exchange in flight.
  struct Buffer {
    std::string name;
    void* data;
    size_t bytes;
  };
  std::vector<Buffer> state_buffers() const {
    std::vector<Buffer> state;
    for (size_t f = 0; f < slices_.size(); ++f) {
      const std::string at = "diloco fragment " + std::to_string(f);
      state.push_back({at + " global", slices_[f].global, slices_[f].share * sizeof(float)});
      state.push_back({at + " outer momentum", slices_[f].momentum, slices_[f].share * sizeof(float)});
    }
    state.push_back({"diloco exchange in flight", received_, largest_share() * sizeof(float)});
    return state;
  }

  // Bytes one rank sends across groups per exchange of fragment f (a ring all-reduce: 2 (G-1)/G of it).
  double bytes_sent_per_exchange(int f) const {
    const int G = across_.world_size();
    return 2.0 * (G - 1) / G * double(slices_[size_t(f)].share) * (s_.bf16_exchange ? 2 : 4);
  }
  size_t fragment_elements(int f) const { return slices_[size_t(f)].total; }

 private:
  struct Slices {
    size_t total = 0, share = 0;            // the fragment's elements; each rank's slice (padded)
    std::vector<SlicePiece> mine;           // this rank's slice
    std::vector<std::vector<SlicePiece>> of_rank;  // [L] every rank's slice (for the all-gather)
    float *global = nullptr, *momentum = nullptr;  // [share] this rank's slice of each
  };
  struct Pending {
    int fragment, started, apply_at;
  };

  template <typename T>
  T* alloc(size_t count) {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)));
    owned_.push_back(p);
    return static_cast<T*>(p);
  }
  // A global copy's or momentum's slice: in device memory, or pinned host memory that the kernels
  // read and write over PCIe (the same pointer on the device, with unified addressing).
  float* alloc_copy(size_t count) {
    if (!s_.host_copies) return alloc<float>(count);
    void* p = nullptr;
    CUDA_CHECK(cudaHostAlloc(&p, std::max<size_t>(count, 1) * sizeof(float), cudaHostAllocMapped));
    owned_host_.push_back(p);
    return static_cast<float*>(p);
  }
  size_t largest_share() const {
    size_t largest = 0;
    for (const Slices& sl : slices_) largest = std::max(largest, sl.share);
    return largest;
  }
  size_t my_valid(const Slices& sl) const {
    const size_t first = sl.share * group_.rank();
    return first < sl.total ? std::min(sl.share, sl.total - first) : 0;
  }

  // A piece of the parameters into a flat fp32 buffer at the piece's place, and back.
  static void to_flat(const SlicePiece& p, float* flat, cudaStream_t stream) {
    if (p.param.bf16) convert(static_cast<const bf16*>(p.param.data) + p.first, flat + p.at, p.count, stream);
    else convert(static_cast<const float*>(p.param.data) + p.first, flat + p.at, p.count, stream);
  }
  static void from_flat(const float* flat, const SlicePiece& p, cudaStream_t stream) {
    if (p.param.bf16) convert(flat + p.at, static_cast<bf16*>(p.param.data) + p.first, p.count, stream);
    else convert(flat + p.at, static_cast<float*>(p.param.data) + p.first, p.count, stream);
  }

  // Δ of this rank's slice of fragment f, then its sum over the groups on the exchange stream.
  void start(int f, int steps_done, cudaStream_t stream) {
    const Slices& sl = slices_[size_t(f)];
    const bool flipped = injected_fault() == Fault::diloco_flipped_sign;
    CUDA_CHECK(cudaMemsetAsync(send_, 0, sl.share * sizeof(float), stream));  // the pad of the last slice
    for (const SlicePiece& p : sl.mine) {
      const int grid = elementwise_grid(p.count);
      if (p.param.bf16)
        pseudo_gradient_kernel<<<grid, 256, 0, stream>>>(static_cast<const bf16*>(p.param.data) + p.first, sl.global + p.at,
                                                         send_ + p.at, p.count, flipped);
      else
        pseudo_gradient_kernel<<<grid, 256, 0, stream>>>(static_cast<const float*>(p.param.data) + p.first,
                                                         sl.global + p.at, send_ + p.at, p.count, flipped);
      CUDA_CHECK_LAUNCH();
    }
    CUDA_CHECK(cudaEventRecord(ready_, stream));
    CUDA_CHECK(cudaStreamWaitEvent(exchange_stream_, ready_, 0));
    TimelineSpan span(timeline_, "communication", "diloco exchange of fragment " + std::to_string(f), exchange_stream_);
    if (s_.bf16_exchange) {
      convert(send_, traffic_, sl.share, exchange_stream_);
      across_.all_reduce_sum(traffic_, traffic_ + sl.share, sl.share, DeviceDType::bf16, exchange_stream_);
      convert(traffic_ + sl.share, received_, sl.share, exchange_stream_);
    } else {
      across_.all_reduce_sum(send_, received_, sl.share, DeviceDType::f32, exchange_stream_);
    }
    CUDA_CHECK(cudaEventRecord(exchanged_, exchange_stream_));
    pending_ = Pending{f, steps_done, diloco_apply_step(s_, steps_done)};
  }

  // The exchange in flight, once in, applied (outer_step); returns its log line.
  std::string apply(int steps_done, double alpha, cudaStream_t stream) {
    const Pending p = *pending_;
    pending_.reset();
    Slices& sl = slices_[size_t(p.fragment)];
    CUDA_CHECK(cudaStreamWaitEvent(stream, exchanged_, 0));
    const int G = across_.world_size();
    outer_step(sl, alpha, stream);
    float norm = 0;
    CUDA_CHECK(cudaMemcpyAsync(&norm, norm_, sizeof norm, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const double norm_of_average = std::sqrt(group_.all_reduce_sum(double(norm) * norm)) / G;
    char line[256];
    std::snprintf(line, sizeof line,
                  "diloco: fragment %d synced after step %d (exchange started after step %d): pseudo-gradient norm "
                  "%.4e, %.1f MB sent across groups by each rank",
                  p.fragment, steps_done, p.started, norm_of_average, bytes_sent_per_exchange(p.fragment) / 1e6);
    return line;
  }

  // On this rank's slice of a fragment whose exchange is in: Δ̄'s norm (for the log), the outer
  // step, the mix into the local parameters, the group's gather.
  void outer_step(Slices& sl, double alpha, cudaStream_t stream) {
    TimelineSpan span(timeline_, "compute", "diloco outer step", stream);
    const int G = across_.world_size();
    const size_t valid = my_valid(sl);
    const float divisor = float(injected_fault() == Fault::diloco_average_by_world ? G * group_.world_size() : G);
    frobenius_norms_kernel<<<1, kFrobeniusThreads, 0, stream>>>(received_, valid, norm_);
    CUDA_CHECK_LAUNCH();
    outer_nesterov_kernel<<<elementwise_grid(valid), 256, 0, stream>>>(
        received_, divisor, sl.momentum, sl.global, valid, float(s_.outer_lr), float(s_.outer_momentum),
        injected_fault() == Fault::diloco_momentum_reset);
    CUDA_CHECK_LAUNCH();
    // the mix is written in place; the fault writes it to a copy (send_), as torchft#233 fixed
    const bool to_copy = injected_fault() == Fault::diloco_mix_to_copy;
    for (const SlicePiece& piece : sl.mine) {
      const int grid = elementwise_grid(piece.count);
      if (piece.param.bf16) {
        const bf16* local = static_cast<const bf16*>(piece.param.data) + piece.first;
        bf16* out = to_copy ? reinterpret_cast<bf16*>(send_) : const_cast<bf16*>(local);
        mix_kernel<<<grid, 256, 0, stream>>>(local, sl.global + piece.at, out, piece.count, float(alpha));
      } else {
        const float* local = static_cast<const float*>(piece.param.data) + piece.first;
        float* out = to_copy ? send_ : const_cast<float*>(local);
        mix_kernel<<<grid, 256, 0, stream>>>(local, sl.global + piece.at, out, piece.count, float(alpha));
      }
      CUDA_CHECK_LAUNCH();
    }
    gather_in_group(sl, stream);
  }

  // Every rank's mixed slice to the group's other ranks (in fp32: bf16 values travel exactly).
  void gather_in_group(const Slices& sl, cudaStream_t stream) {
    const int L = group_.world_size();
    if (L == 1) return;
    float* mine = gathered_ + sl.share * group_.rank();
    for (const SlicePiece& p : sl.mine) to_flat(p, mine, stream);
    group_.all_gather(mine, gathered_, sl.share, DeviceDType::f32, stream);
    for (int q = 0; q < L; ++q)
      if (q != group_.rank())
        for (const SlicePiece& p : sl.of_rank[size_t(q)]) from_flat(gathered_ + sl.share * q, p, stream);
  }

  DiLoCoSettings s_;
  DeviceCommunicator& group_;
  DeviceCommunicator& across_;
  std::vector<Slices> slices_;         // [F]
  float* send_ = nullptr;              // [largest share] Δ of the exchange being started
  float* received_ = nullptr;          // [largest share] its sum over the groups
  bf16* traffic_ = nullptr;            // [2 x largest share] bf16 exchange
  float* gathered_ = nullptr;          // [L x largest share] the group's mixed slices
  float* norm_ = nullptr;              // [1] the norm of this rank's summed slice
  std::optional<Pending> pending_;
  cudaStream_t exchange_stream_ = nullptr;
  cudaEvent_t ready_ = nullptr, exchanged_ = nullptr;
  std::vector<void*> owned_, owned_host_;
  Timeline* timeline_ = nullptr;
};
// ===== end of kernels/diloco.cuh =====
// ===== kernels/embedding.cuh (inlined) =====
// Token embedding and the value embeddings (SPEC 1.2): a row gather forward; a deterministic
// backward that sums each token's gradient rows in position order, one block per distinct token,
// so no float atomics and bitwise-equal gradients run to run. The order comes from the host, which
// holds every micro-sequence's tokens anyway (the attention masks are built from them too).

#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

// out[T, d] = table[tokens[t], :], d a multiple of 8
__global__ void embedding_forward_kernel(const uint16_t* tokens, const bf16* table, bf16* out, int T, int d) {
  const int vectors_per_row = d / 8;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(T) * vectors_per_row;
       i += size_t(gridDim.x) * blockDim.x) {
    size_t t = i / vectors_per_row, c = i % vectors_per_row;
    reinterpret_cast<Bf16x8*>(out)[i] = reinterpret_cast<const Bf16x8*>(table + size_t(tokens[t]) * d)[c];
  }
}

inline void check_embedding_width(int d) {
  if (d % 8 != 0) throw std::invalid_argument("embedding: width " + std::to_string(d) + " must be a multiple of 8");
}

// tokens [T] (device), table [V, d], out [T, d]
inline void embedding_forward(const uint16_t* tokens, const bf16* table, bf16* out, int T, int d, cudaStream_t stream) {
  check_embedding_width(d);
  embedding_forward_kernel<<<elementwise_grid(size_t(T) * (d / 8)), 256, 0, stream>>>(tokens, table, out, T, d);
  CUDA_CHECK_LAUNCH();
}

// The positions of a micro-sequence grouped by token: positions[begin[u] .. begin[u + 1]) are
// where token tokens[u] occurs, in increasing order. Built on the host, uploaded once (into the
// StagedUploads, valid until its next reset), shared by the four tables' backward passes.
class EmbeddingBackwardPlan {
 public:
  EmbeddingBackwardPlan(const uint16_t* host_tokens, int T, int vocab_size, StagedUploads& uploads,
                        cudaStream_t stream) {
    std::vector<int32_t> count(size_t(vocab_size) + 1, 0);
    for (int t = 0; t < T; ++t) {
      if (host_tokens[t] >= vocab_size)
        throw std::invalid_argument("embedding: token id " + std::to_string(host_tokens[t]) + " at position " +
                                    std::to_string(t) + " is >= the vocabulary size " + std::to_string(vocab_size));
      ++count[host_tokens[t] + 1];
    }
    std::partial_sum(count.begin(), count.end(), count.begin());  // count[v]: first slot of token v
    std::vector<int32_t> positions(T), tokens, begin;
    for (int t = 0; t < T; ++t) positions[count[host_tokens[t]]++] = t;  // stable: increasing t per token
    for (int v = 0, slot = 0; v < vocab_size; ++v)
      if (count[v] > slot) {
        tokens.push_back(v);
        begin.push_back(slot);
        slot = count[v];
      }
    begin.push_back(T);
    distinct_ = int(tokens.size());
    positions_ = uploads.upload(positions, stream);
    tokens_ = uploads.upload(tokens, stream);
    begin_ = uploads.upload(begin, stream);
  }
  // At most what the constructor stages for T tokens, for StagedUploads::reset.
  static size_t upload_bytes(int T) {
    return 3 * StagedUploads::bytes_for(size_t(T) + 1, sizeof(int32_t));
  }

  int distinct_tokens() const { return distinct_; }
  const int32_t* positions() const { return positions_; }  // [T]
  const int32_t* tokens() const { return tokens_; }        // [distinct]
  const int32_t* begin() const { return begin_; }          // [distinct + 1]

 private:
  int distinct_ = 0;
  const int32_t *positions_ = nullptr, *tokens_ = nullptr, *begin_ = nullptr;
};

constexpr int kEmbeddingRowGroups = 4;  // rows of one token summed in parallel, combined in fixed order

// grad[tokens[u], :] += scale * sum over its positions p of dout[p, :]. Block u, threadIdx.y picks
// every kEmbeddingRowGroups-th position, threadIdx.x a 16-byte column vector; the partial sums of
// the row groups are added in threadIdx.y order, so the result does not depend on scheduling.
__global__ void embedding_backward_kernel(const int32_t* positions, const int32_t* tokens, const int32_t* begin,
                                          const bf16* dout, float* grad, const float* scale, int d) {
  extern __shared__ float partial[];  // [kEmbeddingRowGroups, d]
  const int u = blockIdx.x, first = begin[u], last = begin[u + 1];
  for (int c = threadIdx.x * 8; c < d; c += blockDim.x * 8) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = first + threadIdx.y; k < last; k += kEmbeddingRowGroups) {
      float v[8];
      load8(dout + size_t(positions[k]) * d + c, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += v[i];
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) partial[threadIdx.y * d + c + i] = acc[i];
  }
  __syncthreads();
  const float s = scale ? *scale : 1.0f;
  float* row = grad + size_t(tokens[u]) * d;
  for (int c = threadIdx.y * blockDim.x + threadIdx.x; c < d; c += blockDim.x * blockDim.y) {
    float sum = 0;
    for (int g = 0; g < kEmbeddingRowGroups; ++g) sum += partial[g * d + c];
    row[c] += s * sum;
  }
}

// dout [T, d] of one micro-sequence into the fp32 gradient table [V, d]; scale: a device scalar
// (the value embedding's lambda) or null for 1.
inline void embedding_backward(const EmbeddingBackwardPlan& plan, const bf16* dout, float* grad, const float* scale,
                               int d, cudaStream_t stream) {
  check_embedding_width(d);
  if (plan.distinct_tokens() == 0) return;
  dim3 block(std::min(((d / 8 + 31) / 32) * 32, 256), kEmbeddingRowGroups);
  size_t shared = size_t(kEmbeddingRowGroups) * d * sizeof(float);
  if (shared > 48 * 1024)  // the default dynamic shared memory limit, not raised for this kernel
    throw std::invalid_argument("embedding backward: width " + std::to_string(d) + " is above 3072");
  embedding_backward_kernel<<<plan.distinct_tokens(), block, shared, stream>>>(plan.positions(), plan.tokens(),
                                                                              plan.begin(), dout, grad, scale, d);
  CUDA_CHECK_LAUNCH();
}
// ===== end of kernels/embedding.cuh =====
// ===== kernels/flash_attention.cuh (inlined) =====
// Tensor-core attention (FlashAttention-2 style) for the masks of attention.cuh: same interface
// and results as attention_forward / attention_backward there, on 128 x 128 bf16 tiles with
// Hopper's wgmma: each of a CTA's two warpgroups owns 64 rows (queries, or keys in the dk/dv
// kernel), its products read their tiles straight from shared memory and take P or dS from
// registers. One CTA per (128-token block, head); warp w holds rows 16 w .. 16 w + 15. A query
// block walks its kv-block list, a kv block its query-block list (attention.cuh builds both), so
// cost follows the window. Only the diagonal block and blocks that straddle a document boundary
// are masked element by element. The backward is deterministic: dq per query block, dk and dv per
// kv block, no atomics.
//
// Tiles live in shared memory in wgmma's 128-byte swizzle layout: two column halves of
// [128 rows][8 chunks of 8 bf16], chunk c of row r stored at c ^ (r & 7), atoms of 8 rows
// 1024-byte aligned. The tiles a CTA walks through are double-buffered: the next block's copies
// (cp.async) fly while the current block is computed, since the 188-250 registers per thread leave
// room for one CTA per SM and no other CTA would hide the loads. The forward also overlaps each
// block's softmax with the previous block's P V product (FlashAttention-3's intra-warpgroup
// pipelining).
// ===== kernels/ptx.cuh (inlined) =====
// The PTX instructions of the tensor-core kernels, one wrapper each (cp.async, and sm_90a's wgmma).
// Kept apart so that the CPU emulator of the tests (tests/emulator/ptx.cuh) can give each one its
// documented meaning while the kernels around them run unchanged.
#include <cstdint>

namespace ptx {

__device__ inline uint32_t shared_address(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// 16 bytes from global to shared memory without passing through registers; both 16-byte aligned.
__device__ inline void cp_async_16(void* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(shared)), "l"(global) : "memory");
}

// Closes this thread's group of the cp.async issued since the last commit.
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most the newest `pending_groups_left` committed groups of this thread are in
// flight (the caller then syncs the block before others read the copies).
template <int pending_groups_left>
__device__ inline void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending_groups_left) : "memory");
}

// ---- wgmma (sm_90a): a warpgroup's (4 warps, 128 threads) asynchronous matrix product ----------

// Shared memory written by the generic proxy (stores, cp.async) is visible to wgmma's reads, which
// go through the async proxy, only after this fence by the writing thread (then a barrier).
__device__ inline void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Orders this thread's earlier register and shared-memory accesses before the wgmma issued next.
__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

// Closes the group of the wgmma issued since the last commit.
__device__ inline void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// Waits until at most the newest `pending_groups_left` groups are in flight; only then may their
// accumulators be read and their shared operands refilled.
template <int pending_groups_left>
__device__ inline void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(pending_groups_left) : "memory");
}

// Keeps the compiler from moving an operand register's accesses across a wgmma fence or wait (it
// cannot see that the wgmma reads its operands and writes its accumulator late).
__device__ inline void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ inline void fence_operand(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }

// The fp32 accumulator registers of an m64n64 and an m64n128 product: the operand lists and the
// asm text naming them as %0, %1, ... (the m64n128 list is the m64n64 one and eight tiles more).
#define PTX_ACCUMULATOR_TILE(d, n) "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3])
#define PTX_M64N64_ACCUMULATOR(d)                                                                          \
  PTX_ACCUMULATOR_TILE(d, 0), PTX_ACCUMULATOR_TILE(d, 1), PTX_ACCUMULATOR_TILE(d, 2), PTX_ACCUMULATOR_TILE(d, 3), \
      PTX_ACCUMULATOR_TILE(d, 4), PTX_ACCUMULATOR_TILE(d, 5), PTX_ACCUMULATOR_TILE(d, 6), PTX_ACCUMULATOR_TILE(d, 7)
#define PTX_M64N128_ACCUMULATOR(d)                                                                            \
  PTX_M64N64_ACCUMULATOR(d), PTX_ACCUMULATOR_TILE(d, 8), PTX_ACCUMULATOR_TILE(d, 9), PTX_ACCUMULATOR_TILE(d, 10), \
      PTX_ACCUMULATOR_TILE(d, 11), PTX_ACCUMULATOR_TILE(d, 12), PTX_ACCUMULATOR_TILE(d, 13),                     \
      PTX_ACCUMULATOR_TILE(d, 14), PTX_ACCUMULATOR_TILE(d, 15)
#define PTX_ACCUMULATOR_NAMES_0_TO_31                                                                     \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                              \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define PTX_M64N64_ACCUMULATOR_TEXT "{" PTX_ACCUMULATOR_NAMES_0_TO_31 "}, "
#define PTX_M64N128_ACCUMULATOR_TEXT                                                                    \
  "{" PTX_ACCUMULATOR_NAMES_0_TO_31 ", "                                                              \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                   \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "

// d[64 x N] = A[64 x 16] B[16 x N] (+ d when accumulate), bf16 operands, fp32 accumulation, A and B
// from shared memory (A K-major; B K-major, or N-major with trans_b). Thread l of warp w of the
// warpgroup holds d[n][e] at row 16 w + l / 4 + (e >= 2 ? 8 : 0), column 8 n + 2 (l % 4) + (e & 1):
// mma.sync's m16n8 layout, repeated.
template <int trans_b>
__device__ inline void wgmma_m64n128k16_ss(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " PTX_M64N128_ACCUMULATOR_TEXT
               "%64, %65, p, 1, 1, 0, %67;\n}\n"
               : PTX_M64N128_ACCUMULATOR(d)
               : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(trans_b));
}

template <int trans_b>
__device__ inline void wgmma_m64n64k16_ss(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " PTX_M64N64_ACCUMULATOR_TEXT
               "%32, %33, p, 1, 1, 0, %35;\n}\n"
               : PTX_M64N64_ACCUMULATOR(d)
               : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(trans_b));
}

// d[64 x 128] (+)= A[64 x 16] B[16 x 128] with A from registers: thread l of warp w holds the
// warp's 16 rows as mma.sync's m16n8k16 A fragment (g = l / 4, t = l % 4): a = {(g, 2t..),
// (g + 8, 2t..), (g, 2t + 8..), (g + 8, 2t + 8..)}, pairs of bf16 (the lower column in the low half),
// rows counted from 16 w.
template <int trans_b>
__device__ inline void wgmma_m64n128k16_rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc_b,
                                          bool accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " PTX_M64N128_ACCUMULATOR_TEXT
               "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
               : PTX_M64N128_ACCUMULATOR(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)), "n"(trans_b));
}

}  // namespace ptx
// ===== end of kernels/ptx.cuh =====

#include <initializer_list>

namespace flash {

constexpr int kTile = 128;                      // tokens per tile: the mask's block
constexpr int kWarps = kTile / 16;              // 16 rows per warp
constexpr int kThreads = kWarps * 32;
constexpr size_t kTileElements = size_t(kTile) * kAttentionHeadDim;
constexpr int kStages = 2;  // buffers of the walked tiles
constexpr uint32_t kSwizzleAtomBytes = 1024;  // 8 rows of 128 bytes
constexpr uint32_t kHalfTileBytes = kTile * 64 * sizeof(bf16);  // one column half: [128 rows][64]
// Shared tiles (and room to align them to an atom): forward Q + stages x (K, V); backward two
// fixed tiles + stages x two walked ones.
constexpr size_t kForwardSharedBytes = (1 + 2 * kStages) * kTileElements * sizeof(bf16) + kSwizzleAtomBytes;
constexpr size_t kBackwardSharedBytes = (2 + 2 * kStages) * kTileElements * sizeof(bf16) + kSwizzleAtomBytes;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kScaleLog2 = kAttentionScale * kLog2e;  // scores in base 2: exp2 on the fast path

__device__ inline int swizzled(int row, int col) {  // element (row, col) of a tile
  return col / 64 * (kTile * 64) + row * 64 + ((((col % 64) >> 3) ^ (row & 7)) << 3) + (col & 7);
}

// The descriptor of a matrix in shared memory laid out in 128-byte swizzle atoms (8 rows of 128
// bytes, 16-byte chunk c of row r at c ^ (r % 8); atoms 1024-byte aligned). `leading` and `stride`
// are PTX's leading- and stride-dimension byte offsets: for a K-major operand `stride` is the
// distance between 8-row groups (leading unused); for an MN-major one `leading` separates groups of
// 64 MN elements and `stride` groups of 8 k rows.
__device__ inline uint64_t swizzled_128b_descriptor(const void* start, uint32_t leading, uint32_t stride) {
  return uint64_t((ptx::shared_address(start) & 0x3FFFF) >> 4) | uint64_t(leading >> 4) << 16 |
         uint64_t(stride >> 4) << 32 | uint64_t(1) << 62;
}

// wgmma's swizzle acts on shared-window address bits: tiles must start on an atom boundary, which
// the dynamic shared memory itself need not (static shared variables come first).
__device__ inline bf16* align_to_swizzle_atom(bf16* p) {
  const uint32_t misalignment = ptx::shared_address(p) % kSwizzleAtomBytes;
  return p + (misalignment ? (kSwizzleAtomBytes - misalignment) / sizeof(bf16) : 0);
}

// rows [0, 128) of a [T, stride] matrix from `src` into a swizzled tile, 16 bytes per cp.async.
__device__ inline void load_tile_async(bf16* tile, const bf16* src, int64_t stride) {
  for (int i = threadIdx.x; i < kTile * 16; i += kThreads) {
    int row = i / 16, chunk = i % 16;
    ptx::cp_async_16(tile + swizzled(row, chunk * 8), src + row * stride + chunk * 8);
  }
}

// A tile's 128 four-byte values (document ids, softmax statistics) from `from` into shared memory
// by the 32 threads from first_thread, 16 bytes each as cp.async: no thread waits for them before
// the tiles' wait. Both addresses 16-byte aligned.
template <typename T>
__device__ inline void load_values_async(T* to, const T* from, int first_thread) {
  static_assert(sizeof(T) == 4, "four-byte values");
  const int i = int(threadIdx.x) - first_thread;
  if (i >= 0 && i < kTile / 4) ptx::cp_async_16(to + 4 * i, from + 4 * i);
}

// Starts the copies of the K tile and the document ids of the kv block at token k0 of head h.
__device__ inline void load_k_tile(bf16* k_tile, int32_t* kv_docs, const bf16* k, const AttentionTensors& a,
                                   const int32_t* docs, int h, int k0) {
  load_tile_async(k_tile, k + k0 * a.k_stride + h * kAttentionHeadDim, a.k_stride);
  load_values_async(kv_docs, docs + k0, 0);
}

// Starts the copies of the V tile of the kv block at token k0 of head h.
__device__ inline void load_v_tile(bf16* v_tile, const bf16* v, const AttentionTensors& a, int h, int k0) {
  load_tile_async(v_tile, v + k0 * a.v_stride + h * kAttentionHeadDim, a.v_stride);
}

// Starts the copies of the K and V tiles (V right after K) and the document ids of the kv block
// at token k0 of head h, as one group.
__device__ inline void load_kv_tiles(bf16* k_tile, int32_t* kv_docs, const bf16* k, const bf16* v,
                                     const AttentionTensors& a, const int32_t* docs, int h, int k0) {
  load_k_tile(k_tile, kv_docs, k, a, docs, h, k0);
  load_v_tile(k_tile + kTileElements, v, a, h, k0);
  ptx::cp_async_commit();
}

// Every committed copy of every thread but its newest `pending_groups_left` groups has landed
// (visible to wgmma too), and every warp is done with what it read before.
template <int pending_groups_left = 0>
__device__ inline void wait_tiles() {
  ptx::cp_async_wait_group<pending_groups_left>();
  ptx::fence_proxy_async_shared();
  __syncthreads();
}

__device__ inline uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Pins an accumulator's (or A fragment's) register accesses to their side of a wgmma fence or
// wait: writes before the issue stay before it, reads after the wait stay after it.
template <typename T, int N>
__device__ inline void fence_registers(T (&r)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) ptx::fence_operand(r[n][e]);
}

// Waits for all of the warpgroup's wgmma groups; the accumulators named may be read from here on,
// and the tiles they read refilled (after a barrier).
template <typename... Accumulators>
__device__ inline void wgmma_wait_all(Accumulators&... acc) {
  ptx::wgmma_wait<0>();
  (fence_registers(acc), ...);
}

// Issues, as one group, s[64 x N] = A[a_row .. +64, 0..128) B[b_row .. +N, 0..128)^T for the
// warpgroup: both tiles in shared memory, K-major (the head dimension is the product's k), 16 of k
// per wgmma. The accumulator layout: see ptx::wgmma_m64n128k16_ss.
template <int N>
__device__ inline void wgmma_a_bt(float (&s)[N / 8][4], const bf16* a, int a_row, const bf16* b, int b_row) {
  fence_registers(s);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kAttentionHeadDim / 16; ++kk) {
    const uint64_t a_desc = swizzled_128b_descriptor(a + swizzled(a_row, kk * 16), 16, kSwizzleAtomBytes);
    const uint64_t b_desc = swizzled_128b_descriptor(b + swizzled(b_row, kk * 16), 16, kSwizzleAtomBytes);
    if constexpr (N == 128)
      ptx::wgmma_m64n128k16_ss</*trans_b=*/0>(s, a_desc, b_desc, /*accumulate=*/kk > 0);
    else
      ptx::wgmma_m64n64k16_ss</*trans_b=*/0>(s, a_desc, b_desc, /*accumulate=*/kk > 0);
  }
  ptx::wgmma_commit();
}

// Issues, as one group, acc[64 x 128] += P[64 x 16K] B[b_row .. +16K, 0..128) for the warpgroup:
// P from an accumulator (rounded to bf16 as A fragments, its n-tiles become k), B a shared tile
// read N-major (its rows are k).
template <int K>
__device__ inline void wgmma_p_b(float (&acc)[kAttentionHeadDim / 8][4], const float (&p)[2 * K][4], const bf16* b,
                                 int b_row) {
  uint32_t af[K][4];  // all packed before the first wgmma: none waits on the conversions
#pragma unroll
  for (int kk = 0; kk < K; ++kk) {
    af[kk][0] = pack_bf16(p[2 * kk][0], p[2 * kk][1]);
    af[kk][1] = pack_bf16(p[2 * kk][2], p[2 * kk][3]);
    af[kk][2] = pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]);
    af[kk][3] = pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3]);
  }
  fence_registers(acc);
  fence_registers(af);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < K; ++kk) {
    const uint64_t b_desc =
        swizzled_128b_descriptor(b + swizzled(b_row + kk * 16, 0), kHalfTileBytes, kSwizzleAtomBytes);
    ptx::wgmma_m64n128k16_rs</*trans_b=*/1>(acc, af[kk], b_desc, /*accumulate=*/true);
  }
  ptx::wgmma_commit();
}

template <int N>
__device__ inline void zero(float (&acc)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
}

// A (query block, kv block) pair needs element masks unless it is strictly causal and both blocks
// lie in one document (document ids only grow along the sequence).
__device__ inline bool needs_mask(int qb, int kb, const int32_t* q_docs, const int32_t* kv_docs) {
  return kb == qb || kv_docs[0] != q_docs[kTile - 1];
}

// The element of accumulator n-tile n, register e: its row and column inside the 16 x 8N tile.
__device__ inline int fragment_row(int e) { return threadIdx.x % 32 / 4 + (e >= 2 ? 8 : 0); }
__device__ inline int fragment_col(int n, int e) { return n * 8 + threadIdx.x % 4 * 2 + (e & 1); }

__device__ inline float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ inline float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Writes a warp's 16 x 128 accumulator (times `scale`) as bf16 rows of [T, H, 128].
__device__ inline void store_rows(bf16* out, const float (&acc)[kAttentionHeadDim / 8][4], int first_token, int h, int H,
                                  float scale_row0, float scale_row8) {
#pragma unroll
  for (int n = 0; n < kAttentionHeadDim / 8; ++n)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      int row = fragment_row(2 * half), col = fragment_col(n, 0);
      float s = half ? scale_row8 : scale_row0;
      *reinterpret_cast<uint32_t*>(out + (size_t(first_token + row) * H + h) * kAttentionHeadDim + col) =
          pack_bf16(acc[n][2 * half] * s, acc[n][2 * half + 1] * s);
    }
}

// Walks the kv blocks listed for query block qb (the dq kernel): block j's K and V tiles and
// document ids land in stage j % kStages of `stages` ([kStages][K, V] tiles) while block j - 1 is
// computed; body(kb, k_tile, v_tile, kv_docs) computes block kb. The copies the caller has issued
// before (its fixed tiles) join block 0's group.
template <typename Body>
__device__ inline void walk_kv_blocks(bf16* stages, int32_t (&stage_docs)[kStages][kTile], const bf16* k,
                                      const bf16* v, const AttentionTensors& a, const DeviceAttentionMask& m, int qb,
                                      int h, Body body) {
  const int count = m.kv_count[qb];
  auto kv_block = [&](int j) { return m.kv_index[qb * m.max_kv + j]; };
  auto k_tile_of = [&](int j) { return stages + 2 * (j % kStages) * kTileElements; };
  auto load = [&](int j) { load_kv_tiles(k_tile_of(j), stage_docs[j % kStages], k, v, a, m.docs, h, kv_block(j) * kTile); };
  if (count > 0) load(0);
  for (int j = 0; j < count; ++j) {
    wait_tiles();  // block j is in; every warp is done with block j - 1, whose stage block j + 1 takes
    if (j + 1 < count) load(j + 1);
    body(kv_block(j), k_tile_of(j), k_tile_of(j) + kTileElements, stage_docs[j % kStages]);
  }
}

// One kv block's step of the online softmax on a warp's 16 rows: the scores s of kv block k0
// become P = exp2(scale s - running max) (0 where masked), row_max and row_sum move on, and
// `correction` is what the output accumulated so far must be scaled by.
__device__ inline void online_softmax(float (&s)[kTile / 8][4], float (&row_max)[2], float (&row_sum)[2],
                                      float (&correction)[2], bool masked, int q0, int k0, const int32_t* q_docs,
                                      const int32_t* kv_docs) {
  constexpr int N = kTile / 8;
  const int warp = threadIdx.x / 32;
  float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int row = warp * 16 + fragment_row(e), col = fragment_col(n, e);
      bool allowed = !masked || (k0 + col <= q0 + row && kv_docs[col] == q_docs[row]);
      s[n][e] = allowed ? s[n][e] * kScaleLog2 : -INFINITY;
      tile_max[e / 2] = fmaxf(tile_max[e / 2], s[n][e]);
    }
  float base[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float new_max = fmaxf(row_max[r], quad_max(tile_max[r]));
    base[r] = new_max == -INFINITY ? 0.0f : new_max;  // a row with nothing allowed yet stays at zero
    correction[r] = exp2f(row_max[r] - base[r]);
    row_max[r] = new_max;
    row_sum[r] *= correction[r];
  }
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[n][e] = exp2f(s[n][e] - base[e / 2]);
      row_sum[e / 2] += s[n][e];
    }
}

// Forward: per (query block, head), online softmax over the listed kv blocks. Each warpgroup
// overlaps the softmax of block j + 1 with block j's product P V on the tensor cores: it issues
// S(j + 1) = Q K(j + 1)^T and then O += P(j) V(j), waits for the scores only, and waits for O just
// before rescaling it. So K runs one block ahead of V: K and the document ids of block j + 2 and V
// of block j + 1 are copied while block j's products run, each into the buffer (of two) whose
// previous reader has been waited for before the barrier that starts block j.
__global__ void __launch_bounds__(kThreads) forward_kernel(const bf16* q, const bf16* k, const bf16* v, bf16* y,
                                                           float* lse, AttentionTensors a, DeviceAttentionMask m) {
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* tiles = align_to_swizzle_atom(shared_tiles);  // Q, K of even and odd blocks, V of even and odd blocks
  bf16* q_tile = tiles;
  __shared__ __align__(16) int32_t q_docs[kTile], k_docs[2][kTile];
  const int qb = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / 32, q0 = qb * kTile, count = m.kv_count[qb];
  const int warpgroup_row = warp / 4 * 64;
  auto k0_of = [&](int j) { return m.kv_index[qb * m.max_kv + j] * kTile; };  // the j-th listed kv block
  auto k_tile = [&](int j) { return tiles + (1 + j % 2) * kTileElements; };
  auto v_tile = [&](int j) { return tiles + (3 + j % 2) * kTileElements; };
  auto load_k = [&](int j) { load_k_tile(k_tile(j), k_docs[j % 2], k, a, m.docs, h, k0_of(j)); };
  auto load_v = [&](int j) { load_v_tile(v_tile(j), v, a, h, k0_of(j)); };

  constexpr int N = kTile / 8;
  static_assert(N == kAttentionHeadDim / 8, "scores and output tiles share their fragment loops");
  float o[kAttentionHeadDim / 8][4], row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0, 0}, correction[2];
  zero(o);
  auto softmax_of_block = [&](float (&s)[N][4], int j) {
    const int k0 = k0_of(j);
    const bool masked = needs_mask(qb, k0 / kTile, q_docs, k_docs[j % 2]);
    online_softmax(s, row_max, row_sum, correction, masked, q0, k0, q_docs, k_docs[j % 2]);
  };
  load_tile_async(q_tile, q + q0 * a.q_stride + h * kAttentionHeadDim, a.q_stride);
  load_values_async(q_docs, m.docs + q0, 32);
  if (count > 0) {
    load_k(0);
    ptx::cp_async_commit();  // the first scores wait for this group only
    load_v(0);
    if (count > 1) load_k(1);
    ptx::cp_async_commit();
    wait_tiles<1>();
    float s[N][4], s_next[N][4];  // P of block j, scores of block j + 1
    wgmma_a_bt<kTile>(s, q_tile, warpgroup_row, k_tile(0), 0);
    wgmma_wait_all(s);
    softmax_of_block(s, 0);
    // The last block has no next scores: peeled, so that every product in the loop is issued
    // unconditionally (a conditional one makes ptxas serialise the wgmma).
    for (int j = 0; j + 1 < count; ++j) {
      wait_tiles();  // V(j), K(j + 1) are in; every warp is done with S(j) and P(j - 1) V(j - 1)
      if (j + 2 < count) load_k(j + 2);
      load_v(j + 1);
      ptx::cp_async_commit();
      wgmma_a_bt<kTile>(s_next, q_tile, warpgroup_row, k_tile(j + 1), 0);
      wgmma_p_b<kTile / 16>(o, s, v_tile(j), 0);
      ptx::wgmma_wait<1>();  // the scores; P(j) V(j) runs on beside the softmax
      fence_registers(s_next);
      softmax_of_block(s_next, j + 1);
      wgmma_wait_all(o);
#pragma unroll
      for (int n = 0; n < N; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          o[n][e] *= correction[e / 2];
          s[n][e] = s_next[n][e];
        }
    }
    wait_tiles();
    wgmma_p_b<kTile / 16>(o, s, v_tile(count - 1), 0);
    wgmma_wait_all(o);
  }
  float total[2] = {quad_sum(row_sum[0]), quad_sum(row_sum[1])};
  store_rows(y, o, q0 + warp * 16, h, a.H, 1.0f / total[0], 1.0f / total[1]);
  if (threadIdx.x % 4 == 0)
    for (int r = 0; r < 2; ++r)
      lse[size_t(h) * a.T + q0 + warp * 16 + fragment_row(2 * r)] = row_max[r] / kLog2e + logf(total[r]);
}

// P and dS of a 16 x 8N score tile: p = exp(scores - lse) where allowed (0 elsewhere),
// ds = p (dp - delta). `query_of(row, col)` maps a fragment position to its query index within the
// query tile and `key_of` to its key index within the kv tile (the dkv kernel's tiles are transposed).
template <int N, typename QueryOf, typename KeyOf>
__device__ inline void softmax_backward(float (&s)[N][4], float (&dp)[N][4], const float* lse, const float* delta,
                                        bool masked, int q0, int k0, const int32_t* q_docs, const int32_t* kv_docs,
                                        QueryOf query_of, KeyOf key_of) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int tq = query_of(n, e), tk = key_of(n, e);
      bool allowed = !masked || (k0 + tk <= q0 + tq && kv_docs[tk] == q_docs[tq]);
      float p = allowed ? exp2f(s[n][e] * kScaleLog2 - lse[tq] * kLog2e) : 0.0f;
      s[n][e] = p;
      dp[n][e] = p * (dp[n][e] - delta[tq]);
    }
}

// Per (query block, head): dq = scale sum_kv dS K over the listed kv blocks, 64 keys at a time.
__global__ void __launch_bounds__(kThreads) backward_dq_kernel(const bf16* q, const bf16* k, const bf16* v,
                                                               const bf16* dy, const float* lse, const float* delta,
                                                               bf16* dq, AttentionTensors a, DeviceAttentionMask m) {
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* tiles = align_to_swizzle_atom(shared_tiles);  // Q, dY, then per stage K and V
  bf16 *q_tile = tiles, *dy_tile = tiles + kTileElements;
  __shared__ __align__(16) int32_t q_docs[kTile], stage_docs[kStages][kTile];
  __shared__ __align__(16) float q_lse[kTile], q_delta[kTile];
  const int qb = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / 32, q0 = qb * kTile;
  const int warpgroup_row = warp / 4 * 64;
  const int64_t dy_stride = int64_t(a.H) * kAttentionHeadDim;
  load_tile_async(q_tile, q + q0 * a.q_stride + h * kAttentionHeadDim, a.q_stride);
  load_tile_async(dy_tile, dy + q0 * dy_stride + h * kAttentionHeadDim, dy_stride);
  load_values_async(q_docs, m.docs + q0, 32);
  load_values_async(q_lse, lse + size_t(h) * a.T + q0, 64);
  load_values_async(q_delta, delta + size_t(h) * a.T + q0, 96);
  constexpr int kKeys = 64, N = kKeys / 8;
  float dq_acc[kAttentionHeadDim / 8][4];
  zero(dq_acc);
  auto query_of = [&](int, int e) { return warp * 16 + fragment_row(e); };
  walk_kv_blocks(tiles + 2 * kTileElements, stage_docs, k, v, a, m, qb, h,
                 [&](int kb, const bf16* k_tile, const bf16* v_tile, const int32_t* kv_docs) {
    const int k0 = kb * kTile;
    const bool masked = needs_mask(qb, kb, q_docs, kv_docs);
    for (int half = 0; half < kTile / kKeys; ++half) {
      float s[N][4], dp[N][4];
      wgmma_a_bt<kKeys>(s, q_tile, warpgroup_row, k_tile, half * kKeys);
      wgmma_a_bt<kKeys>(dp, dy_tile, warpgroup_row, v_tile, half * kKeys);
      wgmma_wait_all(s, dp);  // (and the previous half's dq product)
      softmax_backward(s, dp, q_lse, q_delta, masked, q0, k0, q_docs, kv_docs, query_of,
                       [&](int n, int e) { return half * kKeys + fragment_col(n, e); });
      wgmma_p_b<kKeys / 16>(dq_acc, dp, k_tile, half * kKeys);
    }
    wgmma_wait_all(dq_acc);  // before the barrier after which block j + 2 refills this stage
  });
  store_rows(dq, dq_acc, q0 + warp * 16, h, a.H, kAttentionScale, kAttentionScale);
}

// Per (kv block, head): dv = sum_q P^T dy and dk = scale sum_q dS^T Q over the query blocks that
// list this kv block, 64 queries at a time; the warps own 16 keys each, so scores are transposed.
__global__ void __launch_bounds__(kThreads) backward_dkv_kernel(const bf16* q, const bf16* k, const bf16* v,
                                                                const bf16* dy, const float* lse, const float* delta,
                                                                bf16* dk, bf16* dv, AttentionTensors a,
                                                                DeviceAttentionMask m) {
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* tiles = align_to_swizzle_atom(shared_tiles);  // K, V, then per stage Q and dY
  bf16 *k_tile = tiles, *v_tile = tiles + kTileElements;
  __shared__ __align__(16) int32_t kv_docs[kTile], stage_docs[kStages][kTile];
  __shared__ __align__(16) float stage_lse[kStages][kTile], stage_delta[kStages][kTile];
  const int kb = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / 32, k0 = kb * kTile, count = m.q_count[kb];
  const int warpgroup_row = warp / 4 * 64;
  const int64_t dy_stride = int64_t(a.H) * kAttentionHeadDim;
  auto q_block = [&](int j) { return m.q_index[kb * m.max_q + j]; };
  auto q_tile_of = [&](int j) { return tiles + (2 + 2 * (j % kStages)) * kTileElements; };
  auto load_q = [&](int j) {  // the j-th listed query block (Q, dY, ids, statistics) into stage j % kStages
    const int q0 = q_block(j) * kTile, stage = j % kStages;
    load_tile_async(q_tile_of(j), q + q0 * a.q_stride + h * kAttentionHeadDim, a.q_stride);
    load_tile_async(q_tile_of(j) + kTileElements, dy + q0 * dy_stride + h * kAttentionHeadDim, dy_stride);
    load_values_async(stage_docs[stage], m.docs + q0, 0);
    load_values_async(stage_lse[stage], lse + size_t(h) * a.T + q0, 32);
    load_values_async(stage_delta[stage], delta + size_t(h) * a.T + q0, 64);
    ptx::cp_async_commit();
  };
  load_tile_async(k_tile, k + k0 * a.k_stride + h * kAttentionHeadDim, a.k_stride);
  load_tile_async(v_tile, v + k0 * a.v_stride + h * kAttentionHeadDim, a.v_stride);
  load_values_async(kv_docs, m.docs + k0, 96);
  if (count > 0) load_q(0);
  constexpr int kQueries = 64, N = kQueries / 8;
  float dk_acc[kAttentionHeadDim / 8][4], dv_acc[kAttentionHeadDim / 8][4];
  zero(dk_acc);
  zero(dv_acc);
  auto key_of = [&](int, int e) { return warp * 16 + fragment_row(e); };
  for (int j = 0; j < count; ++j) {
    wait_tiles();  // block j is in; every warp is done with block j - 1, whose stage block j + 1 takes
    if (j + 1 < count) load_q(j + 1);
    const int qb = q_block(j), q0 = qb * kTile, stage = j % kStages;
    const bf16 *q_tile = q_tile_of(j), *dy_tile = q_tile + kTileElements;
    const int32_t* q_docs = stage_docs[stage];
    const float *q_lse = stage_lse[stage], *q_delta = stage_delta[stage];
    const bool masked = needs_mask(qb, kb, q_docs, kv_docs);
    for (int half = 0; half < kTile / kQueries; ++half) {
      float st[N][4], dpt[N][4];  // [64 keys x 64 queries] per warpgroup
      wgmma_a_bt<kQueries>(st, k_tile, warpgroup_row, q_tile, half * kQueries);
      wgmma_a_bt<kQueries>(dpt, v_tile, warpgroup_row, dy_tile, half * kQueries);
      wgmma_wait_all(st, dpt);
      softmax_backward(st, dpt, q_lse, q_delta, masked, q0, k0, q_docs, kv_docs,
                       [&](int n, int e) { return half * kQueries + fragment_col(n, e); }, key_of);
      wgmma_p_b<kQueries / 16>(dv_acc, st, dy_tile, half * kQueries);
      wgmma_p_b<kQueries / 16>(dk_acc, dpt, q_tile, half * kQueries);
      // now, not at the next half: P and dS in flight beside the next scores would spill registers
      wgmma_wait_all(dv_acc, dk_acc);
    }
  }
  store_rows(dk, dk_acc, k0 + warp * 16, h, a.H, kAttentionScale, kAttentionScale);
  store_rows(dv, dv_acc, k0 + warp * 16, h, a.H, 1.0f, 1.0f);
}

template <typename Kernel>
void set_shared_memory(Kernel kernel, size_t bytes) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

}  // namespace flash

// A tensor the flash kernels access, and the alignment (bytes) its start needs: cp.async copies
// 16-byte pieces of q, k, v and dy (rows) and of lse and delta (the backward's 128 statistics at
// [h, 128 qb]); y, dq, dk and dv are written a bf16 pair (4 bytes) at a time. The rest is read or
// written an element at a time.
struct FlashAttentionOperand {
  const char* name;
  const void* start;
  unsigned alignment;
};
constexpr unsigned kFlashCopiedAlignment = 16, kFlashWrittenAlignment = 4;

// Refuses, naming the tensor, what would fault on the GPU (misaligned address) or compute garbage.
inline void check_flash_attention_shape(const AttentionTensors& a, const AttentionMask& mask,
                                        std::initializer_list<FlashAttentionOperand> operands) {
  static_assert(flash::kTile == kAttentionBlock, "a flash tile is one mask block");
  check_attention_shape(a, mask);
  if (a.q_stride % 8 || a.k_stride % 8 || a.v_stride % 8)
    throw std::invalid_argument("flash attention: row strides must be multiples of 8 elements (16-byte rows)");
  for (const FlashAttentionOperand& o : operands)
    if (reinterpret_cast<uintptr_t>(o.start) % o.alignment)
      throw std::invalid_argument(std::string("flash attention: ") + o.name + " must start " +
                                  std::to_string(o.alignment) + "-byte aligned");
}

// y: [T, H, 128], lse: [H, T]
inline void flash_attention_forward(const bf16* q, const bf16* k, const bf16* v, bf16* y, float* lse,
                                    const AttentionTensors& a, const AttentionMask& mask, cudaStream_t stream) {
  check_flash_attention_shape(a, mask,
                              {{"q", q, kFlashCopiedAlignment}, {"k", k, kFlashCopiedAlignment},
                               {"v", v, kFlashCopiedAlignment}, {"y", y, kFlashWrittenAlignment}});
  const size_t smem = flash::kForwardSharedBytes;
  flash::set_shared_memory(flash::forward_kernel, smem);
  flash::forward_kernel<<<dim3(a.T / flash::kTile, a.H), flash::kThreads, smem, stream>>>(q, k, v, y, lse, a,
                                                                                          mask.device());
  CUDA_CHECK_LAUNCH();
}

// delta: [H, T] scratch; dq, dk, dv: [T, H, 128]
inline void flash_attention_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* y, const bf16* dy,
                                     const float* lse, float* delta, bf16* dq, bf16* dk, bf16* dv,
                                     const AttentionTensors& a, const AttentionMask& mask, cudaStream_t stream) {
  check_flash_attention_shape(a, mask,
                              {{"q", q, kFlashCopiedAlignment}, {"k", k, kFlashCopiedAlignment},
                               {"v", v, kFlashCopiedAlignment}, {"dy", dy, kFlashCopiedAlignment},
                               {"lse", lse, kFlashCopiedAlignment}, {"delta", delta, kFlashCopiedAlignment},
                               {"dq", dq, kFlashWrittenAlignment}, {"dk", dk, kFlashWrittenAlignment},
                               {"dv", dv, kFlashWrittenAlignment}});
  attention_delta_kernel<<<attention_grid(a, 8), 256, 0, stream>>>(y, dy, delta, a.T, a.H);
  CUDA_CHECK_LAUNCH();
  const size_t smem = flash::kBackwardSharedBytes;
  const dim3 grid(a.T / flash::kTile, a.H);
  flash::set_shared_memory(flash::backward_dq_kernel, smem);
  flash::backward_dq_kernel<<<grid, flash::kThreads, smem, stream>>>(q, k, v, dy, lse, delta, dq, a, mask.device());
  CUDA_CHECK_LAUNCH();
  flash::set_shared_memory(flash::backward_dkv_kernel, smem);
  flash::backward_dkv_kernel<<<grid, flash::kThreads, smem, stream>>>(q, k, v, dy, lse, delta, dk, dv, a,
                                                                      mask.device());
  CUDA_CHECK_LAUNCH();
}
// ===== end of kernels/flash_attention.cuh =====
// ===== kernels/fp8_head.cuh (inlined) =====
// The FP8 lm_head of SPEC 1.5 (training only), as the reference's custom op computes it:
//   forward   logits[rows, V] = (x_s w_s) e4m3(x / x_s) e4m3(w / w_s)^T      bf16, fast accumulation
//   loss      g[rows, V]      = d(summed softcapped cross-entropy)/d logits  bf16 (cross_entropy.cuh)
//   backward  dx[rows, d]     = (grad_s w_s) e5m2(g / grad_s) e4m3(w / w_s)  bf16
//             dW[V, d]       += (grad_s x_s) e5m2(g / grad_s)^T e4m3(x / x_s) fp32
// cuBLASLt's FP8 products want both operands K-contiguous, so every operand has a plain and a
// transposed copy: x_f8 [rows, d] and [d, rows], w_f8 [V, d] and [d, V], g_f8 [rows, V] and
// [V, rows]. x and w are quantised into both copies in one pass; the cross-entropy kernel writes
// g_f8 itself (the bf16 gradient is never stored: 3 bytes per logit less traffic than storing it
// and quantising it), and a byte transpose makes g_f8's copy. The casts are those of the
// reference's compiled custom op (its impl is under torch.compile): x / s becomes x times the
// reciprocal of s, taken in double and rounded to fp32 (inductor's division by a constant), the
// product stays fp32 (inductor does not round a fused intermediate to x's bf16), and Triton's cast
// to FP8 rounds to nearest even and saturates.
// ===== kernels/matmul.cuh (inlined) =====
// Matmuls through cuBLASLt: bf16 operands (or FP8, or fp32 for REKLS's state, see MatmulOptions),
// fp32 accumulation, bf16 or fp32 output (fp32 for fp32 operands), row-major interface. One plan
// (descriptors + heuristic algorithm) is cached per shape, options and buffer alignment; the
// workspace is shared. The three products of a linear
// layer y = x W^T (x [tokens, in], W [out, in]):
//   forward      y[t, out]  = x W^T        matmul(x, N, W, T, y, tokens, out, in)
//   input grad  dx[t, in]   = dy W         matmul(dy, N, W, N, dx, tokens, in, out)
//   weight grad dW[out, in] = dy^T x       matmul(dy, T, x, N, dW, out, in, tokens), beta 1 accumulates

#include <array>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <tuple>
#include <utility>

enum class Transpose { N, T };

// What a product may change from the bf16 default: fp32 operands (both, with an fp32 output: full
// fp32 products, no TF32), or FP8 operand types (e4m3 or e5m2, not both
// e5m2), each with its dequantisation scale (a device float, read when the product runs; null
// means 1), and Hopper's fast FP8 accumulation (no periodic promotion to fp32: faster, less exact).
// cuBLASLt's FP8 kernels want both operands K-contiguous: A stored [M, K] (N), B stored [N, K] (T),
// and M, N, K multiples of 16.
// `addend`: the matrix beta scales when it is not the output, D = alpha op(A) op(B) + beta addend
// (laid out as the output), so a residual add needs no copy of the residual first.
// A strided batch: `count` products, the i-th at A + i stride_a, B + i stride_b, C + i stride_c
// (elements).
struct MatmulBatch {
  int count = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
};

struct MatmulOptions {
  cudaDataType_t a_type = CUDA_R_16BF, b_type = CUDA_R_16BF;
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
  bool fast_accum = false;
  MatmulBatch batch;
  const void* addend = nullptr;  // null: beta scales the output itself
};

inline bool is_fp8(cudaDataType_t t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }

class Matmul {
 public:
  explicit Matmul(size_t workspace_bytes = size_t(32) << 20) : workspace_bytes_(workspace_bytes) {
    CUBLAS_CHECK(cublasLtCreate(&handle_));
    CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
  }
  ~Matmul() {
    for (auto& [key, plan] : plans_) destroy(plan);
    cudaFree(workspace_);
    cublasLtDestroy(handle_);
  }
  Matmul(const Matmul&) = delete;
  Matmul& operator=(const Matmul&) = delete;

  // Row-major C[M, N] = alpha * op(A)[M, K] op(B)[K, N] + beta * C. A is stored [M, K] (N) or
  // [K, M] (T); B is stored [K, N] (N) or [N, K] (T). A and B are bf16; C is bf16 or fp32.
  void operator()(const void* A, Transpose ta, const void* B, Transpose tb, void* C, int M, int N, int K,
                  cudaDataType_t c_type, cudaStream_t stream, float alpha = 1.0f, float beta = 0.0f) {
    (*this)(A, ta, B, tb, C, M, N, K, c_type, MatmulOptions{}, stream, alpha, beta);
  }

  // The same with operand types, scales, accumulation and addend from `o`:
  // C = alpha * (a_scale * op(A)) (b_scale * op(B)) + beta * (o.addend or C).
  void operator()(const void* A, Transpose ta, const void* B, Transpose tb, void* C, int M, int N, int K,
                  cudaDataType_t c_type, const MatmulOptions& o, cudaStream_t stream, float alpha = 1.0f,
                  float beta = 0.0f) {
    if (!is_fp8(o.a_type) && (o.a_scale || o.b_scale)) throw std::invalid_argument("scales are for FP8 operands");
    check_scale_alignment(o);
    const void* addend = o.addend ? o.addend : C;
    const MatmulBatch& b = o.batch;
    const Alignments alignments{alignment(A, b, b.stride_a, o.a_type), alignment(B, b, b.stride_b, o.b_type),
                                alignment(addend, b, b.stride_c, c_type), alignment(C, b, b.stride_c, c_type)};
    const Plan& plan = plan_for({M, N, K, ta == Transpose::T, tb == Transpose::T, c_type, o.a_type, o.b_type,
                                 o.fast_accum, b.count, b.stride_a, b.stride_b, b.stride_c, alignments},
                                o);
    if (is_fp8(o.a_type)) set_scales(plan, o);  // the plan may have been made with other scale buffers
    // cuBLASLt is column-major: compute C^T[N, M] = op(B)^T op(A)^T, i.e. B first.
    CUBLAS_CHECK(cublasLtMatmul(handle_, plan.desc, &alpha, B, plan.b, A, plan.a, &beta, addend, plan.c, C, plan.c,
                                &plan.algo, workspace_, workspace_bytes_, stream));
  }

 private:
  // Bytes to which every batch of A, B, the addend and C is aligned, at most 256: cuBLASLt's heuristic
  // assumes 256 unless told less, and may pick an algorithm that fails on a less aligned slice.
  using Alignments = std::array<uint32_t, 4>;
  // M, N, K, transA, transB, C type, A type, B type, fast accumulation, batch count and strides, alignments
  using Key = std::tuple<int, int, int, bool, bool, cudaDataType_t, cudaDataType_t, cudaDataType_t, bool, int, int64_t,
                         int64_t, int64_t, Alignments>;
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };

  const Plan& plan_for(const Key& key, const MatmulOptions& o) {
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
    auto [M, N, K, trans_a, trans_b, c_type, a_type, b_type, fast_accum, batch, stride_a, stride_b, stride_c,
          alignments] = key;
    check_types(M, N, K, trans_a, trans_b, c_type, a_type, b_type, fast_accum);
    Plan p;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    if (fast_accum) {
      int8_t on = 1;
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &on, sizeof(on)));
    }
    if (is_fp8(a_type)) set_scales(p, o);  // before the heuristic, which sees the whole description
    cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    // The column-major call's first operand is B, its second A.
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_b, sizeof(op_b)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_a, sizeof(op_a)));
    // Column-major views of the row-major buffers: stored [r, c] row-major is [c, r] column-major.
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, b_type, trans_b ? K : N, trans_b ? N : K, trans_b ? K : N));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, a_type, trans_a ? M : K, trans_a ? K : M, trans_a ? M : K));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, c_type, N, M, N));
    if (batch > 1) {
      set_batch(p.a, batch, stride_a);
      set_batch(p.b, batch, stride_b);
      set_batch(p.c, batch, stride_c);
    }
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &workspace_bytes_, sizeof(workspace_bytes_)));
    // The column-major call's A is our B and its B our A; its C is the addend, its D our C.
    const auto [a_bytes, b_bytes, addend_bytes, c_bytes] = alignments;
    for (auto [attribute, bytes] : {std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, b_bytes},
                                    std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, a_bytes},
                                    std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, addend_bytes},
                                    std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, c_bytes}})
      CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attribute, &bytes, sizeof(bytes)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.b, p.a, p.c, p.c, pref, 1, &result, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    if (found == 0)
      throw std::runtime_error("cuBLASLt has no algorithm for a " + std::to_string(M) + "x" + std::to_string(N) +
                               "x" + std::to_string(K) + " matmul");
    p.algo = result.algo;
    return plans_.emplace(key, p).first->second;
  }

  // Refuses, naming the reason, what cuBLASLt would answer only with "not supported".
  static void check_types(int M, int N, int K, bool trans_a, bool trans_b, cudaDataType_t c_type,
                          cudaDataType_t a_type, cudaDataType_t b_type, bool fast_accum) {
    const bool fp8 = is_fp8(a_type), fp32 = a_type == CUDA_R_32F && b_type == CUDA_R_32F;
    if (fp32) {
      if (c_type != CUDA_R_32F) throw std::invalid_argument("fp32 matmul operands need an fp32 output");
      if (fast_accum) throw std::invalid_argument("fast accumulation is an FP8 option");
      return;
    }
    if (fp8 != is_fp8(b_type) || (!fp8 && (a_type != CUDA_R_16BF || b_type != CUDA_R_16BF)))
      throw std::invalid_argument("matmul operands must be both bf16, both fp32 or both FP8");
    if (!fp8) {
      if (fast_accum) throw std::invalid_argument("fast accumulation is an FP8 option");
      return;
    }
    if (a_type == CUDA_R_8F_E5M2 && b_type == CUDA_R_8F_E5M2)
      throw std::invalid_argument("cuBLASLt has no e5m2 x e5m2 matmul");
    if (trans_a || !trans_b)
      throw std::invalid_argument("FP8 matmuls need A stored [M, K] (N) and B stored [N, K] (T)");
    if (M % 16 || N % 16 || K % 16)
      throw std::invalid_argument("FP8 matmul " + std::to_string(M) + "x" + std::to_string(N) + "x" +
                                  std::to_string(K) + ": every dimension must be a multiple of 16");
  }

  // cuBLASLt 13.1 on an H200 answered "not supported" to every FP8 product whose scale pointers were
  // 4 or 8 bytes past a 16-byte boundary, after its heuristic had offered an algorithm for them
  // (docs/PERF.md, 2026-11-26): refused here, naming the cause.
  static void check_scale_alignment(const MatmulOptions& o) {
    for (auto [name, p] : {std::pair{"a_scale", o.a_scale}, std::pair{"b_scale", o.b_scale}})
      if (reinterpret_cast<uintptr_t>(p) % kScaleAlignment)
        throw std::invalid_argument(std::string("FP8 matmul: ") + name + " is not " +
                                    std::to_string(kScaleAlignment) + "-byte aligned (cuBLASLt refuses it)");
  }
  static constexpr uintptr_t kScaleAlignment = 16;

  // The largest power of two, up to 256, dividing the buffer's address and (batched) its stride in bytes.
  static uint32_t alignment(const void* p, const MatmulBatch& batch, int64_t stride, cudaDataType_t type) {
    const size_t element_bytes = type == CUDA_R_32F ? 4 : type == CUDA_R_16BF ? 2 : 1;
    uint64_t bits = reinterpret_cast<uintptr_t>(p) | 256;
    if (batch.count > 1) bits |= uint64_t(stride) * element_bytes;
    return uint32_t(bits & ~(bits - 1));  // the lowest set bit
  }

  static void set_batch(cublasLtMatrixLayout_t layout, int count, int64_t stride) {
    CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                  sizeof(stride)));
  }

  // The column-major call's A is our B and its B our A, so the scales swap too.
  static void set_scales(const Plan& p, const MatmulOptions& o) {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &o.b_scale,
                                                sizeof(o.b_scale)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &o.a_scale,
                                                sizeof(o.a_scale)));
  }

  static void destroy(Plan& p) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.desc);
  }

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_;
  std::map<Key, Plan> plans_;
};
// ===== end of kernels/matmul.cuh =====

#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

using fp8 = __nv_fp8_storage_t;  // one FP8 byte: e4m3fn or e5m2, as the buffer says

enum class Fp8Kind { e4m3, e5m2 };

// SPEC 1.5's scales, as the fp32 values _scaled_mm receives, and the fp32 reciprocals the
// quantisations multiply by. x is RMS-normalised: |x| <= sqrt(d) maps onto e4m3's 448.
struct Fp8HeadScales {
  float x, w, grad;
  float x_inv, w_inv, grad_inv;  // float(1 / s) of the double s: grad_inv is 448 exactly
  explicit Fp8HeadScales(int model_dim) {
    const double sx = std::sqrt(double(model_dim)) / 448, sw = 24.0 / 448, sg = 1.0 / 448;
    x = float(sx), w = float(sw), grad = float(sg);
    x_inv = float(1 / sx), w_inv = float(1 / sw), grad_inv = float(1 / sg);
  }
};

// Triton's fp32 to FP8 cast on sm_90 (cvt.rn.satfinite): round to nearest even, subnormals kept,
// what lies beyond the largest finite value (448 for e4m3, 57344 for e5m2) saturates to it, NaN
// stays NaN.
template <Fp8Kind kind>
__host__ __device__ inline fp8 to_fp8(float v) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, kind == Fp8Kind::e4m3 ? __NV_E4M3 : __NV_E5M2);
}

// Eight values as eight FP8 bytes in two words, little end first.
template <Fp8Kind kind>
__device__ inline uint2 to_fp8_words(const float v[8], float inv_scale) {
  uint32_t word[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < 8; ++i) word[i / 4] |= uint32_t(to_fp8<kind>(v[i] * inv_scale)) << (8 * (i % 4));
  return make_uint2(word[0], word[1]);
}

// The cross-entropy's gradient store for the FP8 head: each value rounded to bf16 first (the
// reference's autograd hands its custom op a bf16 gradient), then cast to e5m2 times inv_scale.
struct E5m2Gradient {
  fp8* out;  // [T, V]
  float inv_scale;
  __device__ void operator()(size_t element, const float g[8]) const {
    float rounded[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) rounded[i] = __bfloat162float(__float2bfloat16(g[i]));
    *reinterpret_cast<uint2*>(out + element) = to_fp8_words<Fp8Kind::e5m2>(rounded, inv_scale);
  }
};

constexpr int kFp8Tile = 64;  // elements per side of a quantisation tile

// out[r, c] = out_t[c, r] = to_fp8(in[r, c] * inv_scale) for in [rows, cols], rows and cols
// multiples of 8. A 256-thread block does one 64 x 64 tile, each thread 8 consecutive elements;
// the tile goes through shared memory so that the transposed copy is written row by row as well.
// In = fp8: `in` is already FP8 (inv_scale unused) and only its transpose is written (out null).
template <Fp8Kind kind, typename In>
__global__ void __launch_bounds__(256)
    fp8_quantize_kernel(const In* in, fp8* out, fp8* out_t, int rows, int cols, float inv_scale) {
  __shared__ uint32_t tile[kFp8Tile][kFp8Tile / 4 + 1];  // FP8 bytes [row][col]; +1 word staggers banks
  const int r0 = blockIdx.y * kFp8Tile, c0 = blockIdx.x * kFp8Tile;
  const int part = threadIdx.x % 8, line = threadIdx.x / 8;  // 8 threads per 64-element line, 32 lines
  for (int r = line; r < kFp8Tile; r += 32) {
    const int row = r0 + r, col = c0 + part * 8;
    if (row >= rows || col >= cols) continue;
    uint2 words;
    if constexpr (std::is_same_v<In, fp8>) {
      words = *reinterpret_cast<const uint2*>(in + size_t(row) * cols + col);
    } else {
      float v[8];
      load8(in + size_t(row) * cols + col, v);
      words = to_fp8_words<kind>(v, inv_scale);
      *reinterpret_cast<uint2*>(out + size_t(row) * cols + col) = words;
    }
    tile[r][part * 2] = words.x;
    tile[r][part * 2 + 1] = words.y;
  }
  __syncthreads();
  for (int c = line; c < kFp8Tile; c += 32) {  // line c of out_t: column c0 + c of the tile
    const int col = c0 + c, row = r0 + part * 8;
    if (col >= cols || row >= rows) continue;
    uint32_t word[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 8; ++i) word[i / 4] |= ((tile[part * 8 + i][c / 4] >> (8 * (c % 4))) & 0xFFu) << (8 * (i % 4));
    *reinterpret_cast<uint2*>(out_t + size_t(col) * rows + row) = make_uint2(word[0], word[1]);
  }
}

// out [rows, cols] and out_t [cols, rows] = to_fp8(in * inv_scale) of in [rows, cols] (16-byte aligned).
template <Fp8Kind kind, typename In>
void fp8_quantize(const In* in, fp8* out, fp8* out_t, int rows, int cols, float inv_scale, cudaStream_t stream) {
  dim3 grid((cols + kFp8Tile - 1) / kFp8Tile, (rows + kFp8Tile - 1) / kFp8Tile);
  fp8_quantize_kernel<kind, In><<<grid, 256, 0, stream>>>(in, out, out_t, rows, cols, inv_scale);
  CUDA_CHECK_LAUNCH();
}

// out_t [cols, rows] = the transpose of the FP8 bytes in [rows, cols] (16-byte aligned).
inline void fp8_transpose(const fp8* in, fp8* out_t, int rows, int cols, cudaStream_t stream) {
  fp8_quantize<Fp8Kind::e5m2, fp8>(in, nullptr, out_t, rows, cols, 1.0f, stream);
}

// The FP8 operands the head keeps (device bytes), for the tests.
struct Fp8HeadOperands {
  const fp8 *x, *x_t;  // e4m3 [rows, d], [d, rows] of the last forward
  const fp8 *w, *w_t;  // e4m3 [V, d], [d, V] of the last quantize_weight
  const fp8 *g, *g_t;  // e5m2 [rows, V], [V, rows] of the last loss_and_gradient
};

class Fp8Head {
 public:
  // Every dimension a multiple of 16: cuBLASLt's FP8 products need 16-byte leading dimensions.
  Fp8Head(int max_rows, int vocab, int model_dim)
      : max_rows_(max_rows), V_(vocab), d_(model_dim), scales_(model_dim) {
    require_multiple_of_16("max_rows", max_rows);
    require_multiple_of_16("vocab", vocab);
    require_multiple_of_16("model_dim", model_dim);
    allocate();
    const float host_scales[3] = {scales_.x, scales_.w, scales_.grad};
    for (int i : {kX, kW, kGrad})
      CUDA_CHECK(cudaMemcpy(device_scale(i), &host_scales[i], sizeof(float), cudaMemcpyHostToDevice));
  }
  ~Fp8Head() { cudaFree(storage_); }
  Fp8Head(const Fp8Head&) = delete;
  Fp8Head& operator=(const Fp8Head&) = delete;

  const Fp8HeadScales& scales() const { return scales_; }
  Fp8HeadOperands operands() const { return {x_f8_, x_f8_t_, w_f8_, w_f8_t_, g_f8_, g_f8_t_}; }

  // Whenever the weights may have changed (the model does it before every training
  // micro-sequence's head): w_f8 [V, d] and its transpose from the fp32 master w [V, d].
  void quantize_weight(const float* w, cudaStream_t stream) {
    require_aligned("w", w);
    fp8_quantize<Fp8Kind::e4m3>(w, w_f8_, w_f8_t_, V_, d_, scales_.w_inv, stream);
    weight_ready_ = true;
  }

  // logits [rows, V] bf16 from x [rows, d] bf16; keeps x_f8 for the backward of the same rows.
  void forward(const bf16* x, bf16* logits, int rows, Matmul& matmul, cudaStream_t stream) {
    quantize_input(x, rows, stream);
    logits_product(logits, matmul, stream);
  }

  // From logits [rows, V] (rows as the last forward; the model passes the forward's own): the
  // token losses [rows] and g_f8 and its transpose, the e5m2 copies of the summed loss's gradient
  // times grad_scale (1 in training; the head has no losses-only use: evaluation is bf16). The
  // fused path leaves the logits as they are; the cast path overwrites them with the bf16 gradient.
  void loss_and_gradient(bf16* logits, const uint16_t* targets, float* losses, const Softcap& sc, cudaStream_t stream,
                         float grad_scale = 1.0f) {
    if (rows_ == 0) throw std::logic_error("Fp8Head: loss before any forward");
    if (!(grad_scale != 0.0f)) throw std::invalid_argument("Fp8Head: a loss gradient scaled by 0 is no gradient");
    require_aligned("logits", logits);
    if (fused_gradient_) {
      softcap_cross_entropy(logits, targets, losses, rows_, V_, grad_scale, E5m2Gradient{g_f8_, scales_.grad_inv},
                            stream, sc);
      fp8_transpose(g_f8_, g_f8_t_, rows_, V_, stream);
    } else {
      softcap_cross_entropy(logits, targets, losses, rows_, V_, grad_scale, stream, sc);
      fp8_quantize<Fp8Kind::e5m2>(logits, g_f8_, g_f8_t_, rows_, V_, scales_.grad_inv, stream);
    }
    gradient_ready_ = true;
  }

  // true (the default): the cross-entropy writes the e5m2 gradient itself; false: it writes the
  // bf16 gradient over the logits and a cast makes both e5m2 copies (the same bytes, one pass
  // more: the self-check's reference, and the run's path with --fp8-gradient cast).
  void set_fused_gradient(bool fused) { fused_gradient_ = fused; }

  // From the gradient of the last loss_and_gradient: dx [rows, d] bf16 (overwritten) and
  // dw [V, d] fp32 += the weight gradient (accumulates over chunks and micro-sequences).
  void backward(bf16* dx, float* dw, Matmul& matmul, cudaStream_t stream) {
    if (!gradient_ready_) throw std::logic_error("Fp8Head: backward without the loss of the last forward");
    grad_input_product(dx, matmul, stream);
    grad_weight_product(dw, matmul, stream);
  }

  // The steps of forward and backward, public so that the benchmark can time each product alone.
  void quantize_input(const bf16* x, int rows, cudaStream_t stream) {
    if (!weight_ready_) throw std::logic_error("Fp8Head: forward before quantize_weight");
    if (rows <= 0 || rows > max_rows_ || rows % 16)
      throw std::invalid_argument("Fp8Head: " + std::to_string(rows) + " rows; want a positive multiple of 16 up to " +
                                  std::to_string(max_rows_));
    require_aligned("x", x);
    fp8_quantize<Fp8Kind::e4m3>(x, x_f8_, x_f8_t_, rows, d_, scales_.x_inv, stream);
    rows_ = rows;
    gradient_ready_ = false;
  }
  void logits_product(bf16* logits, Matmul& matmul, cudaStream_t stream) {  // logits [rows, V]
    MatmulOptions o{CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, device_scale(kX), device_scale(kW), /*fast_accum=*/true};
    matmul(x_f8_, Transpose::N, w_f8_, Transpose::T, logits, rows_, V_, d_, CUDA_R_16BF, o, stream);
  }
  void grad_input_product(bf16* dx, Matmul& matmul, cudaStream_t stream) {  // dx [rows, d] = g [rows, V] w [V, d]
    MatmulOptions o{CUDA_R_8F_E5M2, CUDA_R_8F_E4M3, device_scale(kGrad), device_scale(kW), false};
    matmul(g_f8_, Transpose::N, w_f8_t_, Transpose::T, dx, rows_, d_, V_, CUDA_R_16BF, o, stream);
  }
  void grad_weight_product(float* dw, Matmul& matmul, cudaStream_t stream) {  // dw [V, d] += g^T [V, rows] x [rows, d]
    MatmulOptions o{CUDA_R_8F_E5M2, CUDA_R_8F_E4M3, device_scale(kGrad), device_scale(kX), false};
    matmul(g_f8_t_, Transpose::N, x_f8_t_, Transpose::T, dw, V_, d_, rows_, CUDA_R_32F, o, stream, 1.0f, 1.0f);
  }

 private:
  enum { kX, kW, kGrad };  // the scales' slots
  // Each scale in a 256-byte slot of its own: cuBLASLt on an H200 refused (not supported) every FP8
  // product whose scale pointers were 4 or 8 bytes apart (docs/PERF.md, 2026-11-26).
  static constexpr size_t kScaleSlot = 256;
  const float* device_scale(int i) const { return reinterpret_cast<const float*>(storage_ + i * kScaleSlot); }
  float* device_scale(int i) { return reinterpret_cast<float*>(storage_ + i * kScaleSlot); }

  static void require_multiple_of_16(const char* what, int n) {
    if (n <= 0 || n % 16)
      throw std::invalid_argument(std::string("Fp8Head: ") + what + " = " + std::to_string(n) +
                                  " must be a positive multiple of 16 (cuBLASLt FP8 leading dimensions)");
  }
  static void require_aligned(const char* what, const void* p) {
    if (reinterpret_cast<uintptr_t>(p) % 16)
      throw std::invalid_argument(std::string("Fp8Head: ") + what + " is not 16-byte aligned");
  }

  // One allocation, carved at 256-byte boundaries: the scales' slots, then the six FP8 buffers.
  void allocate() {
    const size_t xd = size_t(max_rows_) * d_, vd = size_t(V_) * d_, xv = size_t(max_rows_) * V_;
    const size_t sizes[7] = {3 * kScaleSlot, xd, xd, vd, vd, xv, xv};
    size_t offsets[7], total = 0;
    for (int i = 0; i < 7; ++i) {
      offsets[i] = total;
      total += (sizes[i] + 255) / 256 * 256;
    }
    CUDA_CHECK(cudaMalloc(&storage_, total));
    fp8** buffers[6] = {&x_f8_, &x_f8_t_, &w_f8_, &w_f8_t_, &g_f8_, &g_f8_t_};
    for (int i = 0; i < 6; ++i) *buffers[i] = storage_ + offsets[i + 1];
  }

  int max_rows_, V_, d_, rows_ = 0;
  bool weight_ready_ = false, gradient_ready_ = false, fused_gradient_ = true;
  Fp8HeadScales scales_;
  uint8_t* storage_ = nullptr;
  fp8 *x_f8_ = nullptr, *x_f8_t_ = nullptr, *w_f8_ = nullptr, *w_f8_t_ = nullptr, *g_f8_ = nullptr, *g_f8_t_ = nullptr;
};
// ===== end of kernels/fp8_head.cuh =====
// ===== kernels/muon.cuh (inlined) =====
// Muon on the GPU (SPEC 1.9) for a batch of matrices [rows, cols] of one shape group, each at its
// own addresses (qkv_w [3, 768, 768] is three): momentum with the Nesterov form, the quintic
// Newton-Schulz iteration in bf16 with fp32 accumulation, batched over the group through
// cuBLASLt's strided batches, and the update scaled by max(1, rows/cols)^0.5. A wide matrix is
// iterated as it is, a tall one as its transpose (the small Gram matrix X X^T).

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

struct MuonStep {
  float lr;          // learning rate of this step (schedule applied)
  float momentum;    // of this step (warmup applied)
  float grad_scale;  // 1 / M: the one normalisation of the summed gradient (SPEC 4.2)
};

constexpr float kNewtonSchulzA = 3.4445f, kNewtonSchulzB = -4.7750f, kNewtonSchulzC = 2.0315f;
constexpr int kNewtonSchulzSteps = 5;

// One matrix [rows, cols] of a Muon update: its fp32 parameter, summed gradient and momentum.
// A [3, d, d] parameter is three of them (qkv_w: Q, K and V are orthogonalised separately).
struct MuonMatrix {
  float* p;
  const float* g;
  float* momentum;
};

// bf16 scratch of a batch of iterations: X and the next X [batch, r, k], A and B [batch, r, r]
// (r <= k), and the batch's Frobenius norms.
class MuonWorkspace {
 public:
  // Room for batches of up to `max_batch` matrices and `max_batch_elems` elements in all.
  MuonWorkspace(size_t max_batch_elems, int max_batch = 1)
      : elem_capacity_(std::max<size_t>(max_batch_elems, 1)), batch_capacity_(std::max(max_batch, 1)) {
    for (bf16** b : {&x_, &next_, &a_, &b_}) CUDA_CHECK(cudaMalloc(b, elem_capacity_ * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&norms_, batch_capacity_ * sizeof(float)));
  }
  ~MuonWorkspace() {
    for (void* p : {(void*)x_, (void*)next_, (void*)a_, (void*)b_, (void*)norms_}) cudaFree(p);
  }
  MuonWorkspace(const MuonWorkspace&) = delete;
  MuonWorkspace& operator=(const MuonWorkspace&) = delete;

  void require_fits(int batch, int rows, int cols) const {
    if (batch > batch_capacity_ || size_t(batch) * rows * cols > elem_capacity_)
      throw std::invalid_argument("muon: " + std::to_string(batch) + " matrices of " + std::to_string(rows) + "x" +
                                  std::to_string(cols) + " exceed the workspace of " + std::to_string(batch_capacity_) +
                                  " matrices, " + std::to_string(elem_capacity_) + " elements");
  }

  bf16 *x_ = nullptr, *next_ = nullptr, *a_ = nullptr, *b_ = nullptr;
  float* norms_ = nullptr;  // [batch] ||X_i||_F

 private:
  size_t elem_capacity_;
  int batch_capacity_;
};

// buf = m buf + (1 - m) g s; x = (1 - m) g s + m buf in bf16, transposed into [cols, rows] when
// `transpose`. One matrix [rows, cols].
__global__ void muon_momentum_kernel(const float* g, float* buf, bf16* x, int rows, int cols, bool transpose,
                                     float momentum, float grad_scale) {
  const size_t n = size_t(rows) * cols;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    float grad = g[i] * grad_scale;
    float b = momentum * buf[i] + (1 - momentum) * grad;
    buf[i] = b;
    size_t row = i / cols, col = i % cols;
    x[transpose ? col * rows + row : i] = __float2bfloat16((1 - momentum) * grad + momentum * b);
  }
}

// x[batch, n] row i scaled by 1 / (norms[i] + 1e-7)
__global__ void scale_by_inverse_norms_kernel(bf16* x, size_t n, size_t total, const float* norms) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x)
    x[i] = __float2bfloat16(__bfloat162float(x[i]) / (norms[i / n] + 1e-7f));
}

// p[rows, cols] -= lr * x, x stored [cols, rows] when `transpose`
__global__ void muon_apply_kernel(float* p, const bf16* x, int rows, int cols, bool transpose, float lr) {
  const size_t n = size_t(rows) * cols;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    size_t row = i / cols, col = i % cols;
    p[i] -= lr * __bfloat162float(x[transpose ? col * rows + row : i]);
  }
}

// x [batch, r, k] <- NS5(x / (||x||_F + 1e-7)) per matrix: A = X X^T, B = b A + c A A,
// X = a X + B X, in bf16, each product one strided-batched cuBLASLt call over the batch.
inline void newton_schulz5(MuonWorkspace& ws, int batch, int r, int k, Matmul& matmul, cudaStream_t stream) {
  const size_t n = size_t(r) * k, rr = size_t(r) * r;
  frobenius_norms_kernel<<<batch, kFrobeniusThreads, 0, stream>>>(ws.x_, n, ws.norms_);
  CUDA_CHECK_LAUNCH();
  scale_by_inverse_norms_kernel<<<elementwise_grid(batch * n), 256, 0, stream>>>(ws.x_, n, batch * n, ws.norms_);
  CUDA_CHECK_LAUNCH();
  auto batched = [batch](int64_t stride_a, int64_t stride_b, int64_t stride_c) {
    MatmulOptions o;
    o.batch = {batch, stride_a, stride_b, stride_c};
    return o;
  };
  const MatmulOptions gram = batched(n, n, rr), square = batched(rr, rr, rr), apply = batched(rr, n, n);
  for (int step = 0; step < kNewtonSchulzSteps; ++step) {
    matmul(ws.x_, Transpose::N, ws.x_, Transpose::T, ws.a_, r, r, k, CUDA_R_16BF, gram, stream);  // A = X X^T
    CUDA_CHECK(cudaMemcpyAsync(ws.b_, ws.a_, batch * rr * sizeof(bf16), cudaMemcpyDeviceToDevice, stream));
    matmul(ws.a_, Transpose::N, ws.a_, Transpose::N, ws.b_, r, r, r, CUDA_R_16BF, square, stream, kNewtonSchulzC,
           kNewtonSchulzB);  // B = c A A + b A
    CUDA_CHECK(cudaMemcpyAsync(ws.next_, ws.x_, batch * n * sizeof(bf16), cudaMemcpyDeviceToDevice, stream));
    matmul(ws.b_, Transpose::N, ws.x_, Transpose::N, ws.next_, r, k, r, CUDA_R_16BF, apply, stream, 1.0f,
           kNewtonSchulzA);  // X' = B X + a X
    std::swap(ws.x_, ws.next_);
  }
}

// One Muon update of matrices [rows, cols] of one shape group (g: the summed gradients;
// grad_scale normalises them), the Newton-Schulz iterations batched over all of them.
inline void muon_update(const std::vector<MuonMatrix>& matrices, int rows, int cols, const MuonStep& s,
                        MuonWorkspace& ws, Matmul& matmul, cudaStream_t stream) {
  const int batch = int(matrices.size());
  if (batch == 0) return;
  ws.require_fits(batch, rows, cols);
  const size_t n = size_t(rows) * cols;
  const bool transpose = rows > cols;
  const int r = transpose ? cols : rows, k = transpose ? rows : cols;
  const float lr = s.lr * std::sqrt(std::max(1.0f, float(rows) / float(cols)));
  for (int i = 0; i < batch; ++i) {
    muon_momentum_kernel<<<elementwise_grid(n), 256, 0, stream>>>(matrices[i].g, matrices[i].momentum, ws.x_ + i * n,
                                                                  rows, cols, transpose, s.momentum, s.grad_scale);
    CUDA_CHECK_LAUNCH();
  }
  newton_schulz5(ws, batch, r, k, matmul, stream);
  for (int i = 0; i < batch; ++i) {
    muon_apply_kernel<<<elementwise_grid(n), 256, 0, stream>>>(matrices[i].p, ws.x_ + i * n, rows, cols, transpose, lr);
    CUDA_CHECK_LAUNCH();
  }
}

// The same update one matrix at a time (no strided batches): the batched path's reference in the
// start-up self-check, and the run's path with --muon per-matrix.
inline void muon_update_each(const std::vector<MuonMatrix>& matrices, int rows, int cols, const MuonStep& s,
                             MuonWorkspace& ws, Matmul& matmul, cudaStream_t stream) {
  for (const MuonMatrix& m : matrices) muon_update({m}, rows, cols, s, ws, matmul, stream);
}
// ===== end of kernels/muon.cuh =====
// ===== kernels/rekls.cuh (inlined) =====
// REKLS on the GPU for one matrix P [m, n] at a time: the KL-Shampoo Kronecker factors L [m, m]
// and R [n, n], their eigenbases Q_L, Q_R and eigenvalues from cuSOLVER's syevd in fp32, and
// Adam's moments M, V [m, n] in the rotated basis. The equations, with the lines of NVIDIA's
// implementation they come from, are in the CPU reference (tests/reference/rekls.h), which the
// GPU test compares against. Every product is an fp32 cuBLASLt matmul (no TF32): the factors
// span ~1e8 after the first step's clamped eigenvalues, and the eigenbasis needs their low bits.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

// Defaults of NVIDIA's REKLS (legacy_soap/rekls.py:41-44) but the learning rate, which it leaves
// to the caller; eigenbasis_every 1 is REKLS's every-step refresh.
struct ReklsSettings {
  float beta1 = 0.9f, beta2 = 0.95f, shampoo_beta = 0.95f, eps = 1e-8f, weight_decay = 0.01f;
  int eigenbasis_every = 1;
};

// One step: learning rate (schedule applied), 1-based step count, and 1 / M for the summed gradient.
struct ReklsStep {
  float lr;
  int64_t t;
  float grad_scale;
};

// The state of one matrix [m, n] in one fp32 buffer (so that a checkpoint lists one per matrix),
// in this order: L [m, m], R [n, n], Q_L [m, m], Q_R [n, n] (columns the eigenvectors, by
// descending eigenvalue), lam_L [m], lam_R [n], M [m, n], V [m, n].
struct ReklsBuffers {
  float *L, *R, *QL, *QR, *lam_L, *lam_R, *M, *V;
  static size_t elems(int m, int n) {
    return 2 * (size_t(m) * m + size_t(n) * n) + size_t(m) + n + 2 * size_t(m) * n;
  }
  static ReklsBuffers at(float* base, int m, int n) {
    ReklsBuffers s;
    const size_t mm = size_t(m) * m, nn = size_t(n) * n, mn = size_t(m) * n;
    s.L = base;
    s.R = s.L + mm;
    s.QL = s.R + nn;
    s.QR = s.QL + mm;
    s.lam_L = s.QR + nn;
    s.lam_R = s.lam_L + m;
    s.M = s.lam_R + n;
    s.V = s.M + mn;
    return s;
  }
};

// One matrix of an update: its fp32 parameter, summed gradient and state buffer (ReklsBuffers).
struct ReklsMatrix {
  float* p;
  const float* g;
  float* state;
};

__global__ void rekls_identity_kernel(float* q, int k) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(k) * k; i += size_t(gridDim.x) * blockDim.x)
    q[i] = i / k == i % k ? 1.0f : 0.0f;
}

// The initial state (soap.py:148-160): everything zero but Q_L, Q_R, the identity.
inline void rekls_reset_state(float* state, int m, int n, cudaStream_t stream) {
  CUDA_CHECK(cudaMemsetAsync(state, 0, ReklsBuffers::elems(m, n) * sizeof(float), stream));
  const ReklsBuffers s = ReklsBuffers::at(state, m, n);
  rekls_identity_kernel<<<elementwise_grid(size_t(m) * m), 256, 0, stream>>>(s.QL, m);
  CUDA_CHECK_LAUNCH();
  rekls_identity_kernel<<<elementwise_grid(size_t(n) * n), 256, 0, stream>>>(s.QR, n);
  CUDA_CHECK_LAUNCH();
}

__global__ void rekls_scale_kernel(const float* in, float* out, size_t n, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = in[i] * scale;
}

// out[i, j] = x[i, j] / (dim * max(lam[by_row ? i : j], eps)), x [rows, cols]: one side of the
// KL correction Q diag(max(lam, eps)^-1) Q^T / dim applied to the gradient in that basis.
__global__ void rekls_kl_scale_kernel(const float* x, float* out, int rows, int cols, const float* lam, bool by_row,
                                      float dim, float eps) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(rows) * cols;
       i += size_t(gridDim.x) * blockDim.x) {
    const float l = lam[by_row ? i / cols : i % cols];
    out[i] = x[i] / (dim * fmaxf(l, eps));
  }
}

// syevd's ascending eigenvalues w and eigenvectors (column-major, i.e. row j of `vectors` is the
// j-th) into Q [k, k] (columns, descending: torch.linalg.eigh flipped, utils/eig.py:67-69) and lam.
__global__ void rekls_descending_basis_kernel(const float* vectors, const float* w, float* Q, float* lam, int k) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(k) * k; i += size_t(gridDim.x) * blockDim.x) {
    const int row = int(i / k), col = int(i % k);
    Q[i] = vectors[size_t(k - 1 - col) * k + row];
    if (row == 0) lam[col] = w[k - 1 - col];
  }
}

// Adam in the rotated basis (adam.py:66-88): M, V updated, U = (M / bias1) / (sqrt(V / bias2) + eps).
__global__ void rekls_adam_kernel(const float* rotated, float* M, float* V, float* U, size_t n, float beta1, float beta2,
                                  float bias1, float bias2, float eps) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float g = rotated[i];
    const float m = beta1 * M[i] + (1 - beta1) * g, v = beta2 * V[i] + (1 - beta2) * g * g;
    M[i] = m;
    V[i] = v;
    U[i] = (m / bias1) / (sqrtf(v / bias2) + eps);
  }
}

// p <- p - lr wd p - lr update (decoupled weight decay, soap.py:258-263 and 286)
__global__ void rekls_apply_kernel(float* p, const float* update, size_t n, float lr, float weight_decay) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = p[i] - lr * weight_decay * p[i] - lr * update[i];
}

// The scratch and the cuSOLVER handle of REKLS updates of the given shapes [m, n].
class Rekls {
 public:
  explicit Rekls(const std::vector<std::pair<int, int>>& shapes) {
    CUSOLVER_CHECK(cusolverDnCreate(&solver_));
    CUSOLVER_CHECK(cusolverDnCreateParams(&params_));
    size_t largest_mn = 1, largest_k = 1;
    for (auto [m, n] : shapes) {
      largest_mn = std::max(largest_mn, size_t(m) * n);
      largest_k = std::max({largest_k, size_t(m), size_t(n)});
    }
    for (float** b : {&g_, &x_, &y_, &t_}) CUDA_CHECK(cudaMalloc(b, largest_mn * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&vectors_, largest_k * largest_k * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&values_, largest_k * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&info_, sizeof(int)));
    for (auto [m, n] : shapes)
      for (int k : {m, n}) {
        size_t device = 0, host = 0;
        CUSOLVER_CHECK(cusolverDnXsyevd_bufferSize(solver_, params_, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, k,
                                                   CUDA_R_32F, vectors_, k, CUDA_R_32F, values_, CUDA_R_32F, &device,
                                                   &host));
        solver_device_bytes_ = std::max(solver_device_bytes_, device);
        solver_host_bytes_ = std::max(solver_host_bytes_, host);
      }
    CUDA_CHECK(cudaMalloc(&solver_device_, std::max<size_t>(solver_device_bytes_, 1)));
    solver_host_.resize(std::max<size_t>(solver_host_bytes_, 1));
  }
  ~Rekls() {
    for (void* p : {(void*)g_, (void*)x_, (void*)y_, (void*)t_, (void*)vectors_, (void*)values_, (void*)info_,
                    solver_device_})
      cudaFree(p);
    cusolverDnDestroyParams(params_);
    cusolverDnDestroy(solver_);
  }
  Rekls(const Rekls&) = delete;
  Rekls& operator=(const Rekls&) = delete;

  // One REKLS step of each matrix [m, n] (see tests/reference/rekls.h for the equations).
  void update(const std::vector<ReklsMatrix>& matrices, int m, int n, const ReklsSettings& cfg, const ReklsStep& step,
              Matmul& matmul, cudaStream_t stream) {
    for (const ReklsMatrix& x : matrices) update_one(x, m, n, cfg, step, matmul, stream);
  }

 private:
  void update_one(const ReklsMatrix& x, int m, int n, const ReklsSettings& cfg, const ReklsStep& step, Matmul& matmul,
                  cudaStream_t stream) {
    const size_t mn = size_t(m) * n;
    const ReklsBuffers s = ReklsBuffers::at(x.state, m, n);
    const double t = double(step.t);
    // fp32 products: C[M, N] = alpha op(A) op(B) + beta C
    auto product = [&](const float* A, Transpose ta, const float* B, Transpose tb, float* C, int M, int N, int K,
                       float alpha = 1.0f, float beta = 0.0f) {
      MatmulOptions o;
      o.a_type = o.b_type = CUDA_R_32F;
      matmul(A, ta, B, tb, C, M, N, K, CUDA_R_32F, o, stream, alpha, beta);
    };
    rekls_scale_kernel<<<elementwise_grid(mn), 256, 0, stream>>>(x.g, g_, mn, step.grad_scale);  // G
    CUDA_CHECK_LAUNCH();

    // The factors, with the previous bases (soap.py:372-387): L <- b L + (1 - b) (G Q_R) S_R (G Q_R)^T,
    // R <- b R + (1 - b) (Q_L^T G)^T S_L (Q_L^T G), S = diag(max(lam, eps)^-1) / dim.
    const float b = float(1 - (1 - double(cfg.shampoo_beta)) / (1 - std::pow(double(cfg.shampoo_beta), t)));
    product(g_, Transpose::N, s.QR, Transpose::N, x_, m, n, n);  // X = G Q_R
    rekls_kl_scale_kernel<<<elementwise_grid(mn), 256, 0, stream>>>(x_, y_, m, n, s.lam_R, false, float(n), cfg.eps);
    CUDA_CHECK_LAUNCH();
    product(y_, Transpose::N, x_, Transpose::T, s.L, m, m, n, 1 - b, b);
    product(s.QL, Transpose::T, g_, Transpose::N, x_, m, n, m);  // X = Q_L^T G
    rekls_kl_scale_kernel<<<elementwise_grid(mn), 256, 0, stream>>>(x_, y_, m, n, s.lam_L, true, float(m), cfg.eps);
    CUDA_CHECK_LAUNCH();
    product(x_, Transpose::T, y_, Transpose::N, s.R, n, n, m, 1 - b, b);

    if ((step.t - 1) % cfg.eigenbasis_every == 0) {  // soap.py:440-458
      product(s.M, Transpose::N, s.QR, Transpose::T, t_, m, n, n);  // M out of the old basis
      product(s.QL, Transpose::N, t_, Transpose::N, s.M, m, n, m);
      eigenbasis(s.L, m, s.QL, s.lam_L, stream);
      eigenbasis(s.R, n, s.QR, s.lam_R, stream);
      product(s.QL, Transpose::T, s.M, Transpose::N, t_, m, n, m);  // and into the new one
      product(t_, Transpose::N, s.QR, Transpose::N, s.M, m, n, n);
    }

    product(s.QL, Transpose::T, g_, Transpose::N, t_, m, n, m);  // G' = Q_L^T G Q_R
    product(t_, Transpose::N, s.QR, Transpose::N, x_, m, n, n);
    const float bias1 = float(1 - std::pow(double(cfg.beta1), t)), bias2 = float(1 - std::pow(double(cfg.beta2), t));
    rekls_adam_kernel<<<elementwise_grid(mn), 256, 0, stream>>>(x_, s.M, s.V, y_, mn, cfg.beta1, cfg.beta2, bias1, bias2,
                                                                cfg.eps);
    CUDA_CHECK_LAUNCH();
    const Transpose back = injected_fault() == Fault::rekls_rotation_untransposed ? Transpose::N : Transpose::T;
    product(y_, Transpose::N, s.QR, back, t_, m, n, n);  // Q_L U Q_R^T
    product(s.QL, Transpose::N, t_, Transpose::N, x_, m, n, m);
    rekls_apply_kernel<<<elementwise_grid(mn), 256, 0, stream>>>(x.p, x_, mn, step.lr, cfg.weight_decay);
    CUDA_CHECK_LAUNCH();
  }

  // (lam, Q) of the symmetric factor [k, k] by syevd in fp32, eigenvalues descending. syevd
  // reads the lower triangle of the column-major matrix: the upper one of our row-major factor.
  // Its *info (nonzero: no convergence, or a bad argument) is read back at once, a host
  // synchronisation per factor (unmeasured: no GPU yet; one read per step would do).
  void eigenbasis(const float* factor, int k, float* Q, float* lam, cudaStream_t stream) {
    CUDA_CHECK(cudaMemcpyAsync(vectors_, factor, size_t(k) * k * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    CUSOLVER_CHECK(cusolverDnSetStream(solver_, stream));
    CUSOLVER_CHECK(cusolverDnXsyevd(solver_, params_, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, k, CUDA_R_32F,
                                    vectors_, k, CUDA_R_32F, values_, CUDA_R_32F, solver_device_, solver_device_bytes_,
                                    solver_host_.data(), solver_host_bytes_, info_));
    int info = 0;
    CUDA_CHECK(cudaMemcpyAsync(&info, info_, sizeof(int), cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    if (info != 0)
      throw std::runtime_error("rekls: cusolverDnXsyevd of a " + std::to_string(k) + "x" + std::to_string(k) +
                               " Kronecker factor failed, info " + std::to_string(info) +
                               (info > 0 ? " (no convergence: a non-finite factor?)" : " (bad argument)"));
    rekls_descending_basis_kernel<<<elementwise_grid(size_t(k) * k), 256, 0, stream>>>(vectors_, values_, Q, lam, k);
    CUDA_CHECK_LAUNCH();
  }

  cusolverDnHandle_t solver_ = nullptr;
  cusolverDnParams_t params_ = nullptr;
  float *g_ = nullptr, *x_ = nullptr, *y_ = nullptr, *t_ = nullptr;  // [largest m n] each
  float *vectors_ = nullptr, *values_ = nullptr;                      // syevd's A [k, k] and W [k]
  int* info_ = nullptr;
  void* solver_device_ = nullptr;
  size_t solver_device_bytes_ = 0, solver_host_bytes_ = 0;
  std::vector<char> solver_host_;
};
// ===== end of kernels/rekls.cuh =====
// ===== kernels/norms.cuh (inlined) =====
// RMS norm without weight (SPEC 1.1): y = x / sqrt(mean(x^2) + eps), bf16 in and out, fp32 math.
// One warp per row; rows are a multiple of 8 elements (16-byte vectors). The reference's eps is
// F.rms_norm's default, which for bf16 inputs is the eps of the fp32 type it computes in,
// finfo(float32).eps = 2^-23 (PyTorch since January 2025, eager and the compiled decomposition).

#include <stdexcept>
#include <string>

constexpr float kRmsEps = 1.1920928955078125e-07f;  // FLT_EPSILON
constexpr int kMaxNormVectorsPerLane = 4;  // rows up to 32 lanes x 4 x 8 = 1024 elements

// y[rows, n] = rmsnorm(x[rows, n])
__global__ void rmsnorm_forward_kernel(const bf16* x, bf16* y, int rows, int n, float eps) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  const bf16* xr = x + size_t(row) * n;
  float v[kMaxNormVectorsPerLane][8], ss = 0;
#pragma unroll
  for (int k = 0; k < kMaxNormVectorsPerLane; ++k) {
    int col = (k * 32 + lane) * 8;
    if (col < n) {
      load8(xr + col, v[k]);
      for (int i = 0; i < 8; ++i) ss += v[k][i] * v[k][i];
    }
  }
  float inv = rsqrtf(warp_sum(ss) / n + eps);
#pragma unroll
  for (int k = 0; k < kMaxNormVectorsPerLane; ++k) {
    int col = (k * 32 + lane) * 8;
    if (col < n) {
      for (int i = 0; i < 8; ++i) v[k][i] *= inv;
      store8(y + size_t(row) * n + col, v[k]);
    }
  }
}

// dx[rows, n] (+)= d rmsnorm(x) / dx applied to dy: inv * dy - inv^3 * x * mean(x * dy)
__global__ void rmsnorm_backward_kernel(const bf16* x, const bf16* dy, bf16* dx, int rows, int n, float eps,
                                        bool accumulate) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  size_t base = size_t(row) * n;
  float xv[kMaxNormVectorsPerLane][8], gv[kMaxNormVectorsPerLane][8], ss = 0, dot = 0;
#pragma unroll
  for (int k = 0; k < kMaxNormVectorsPerLane; ++k) {
    int col = (k * 32 + lane) * 8;
    if (col < n) {
      load8(x + base + col, xv[k]);
      load8(dy + base + col, gv[k]);
      for (int i = 0; i < 8; ++i) ss += xv[k][i] * xv[k][i], dot += xv[k][i] * gv[k][i];
    }
  }
  float inv = rsqrtf(warp_sum(ss) / n + eps), mean_dot = warp_sum(dot) / n;
#pragma unroll
  for (int k = 0; k < kMaxNormVectorsPerLane; ++k) {
    int col = (k * 32 + lane) * 8;
    if (col < n) {
      float out[8], prev[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (accumulate) load8(dx + base + col, prev);
      for (int i = 0; i < 8; ++i) out[i] = prev[i] + inv * gv[k][i] - inv * inv * inv * xv[k][i] * mean_dot;
      store8(dx + base + col, out);
    }
  }
}

inline void check_norm_width(int n) {
  if (n % 8 != 0 || n > 32 * 8 * kMaxNormVectorsPerLane)
    throw std::invalid_argument("rmsnorm: row width " + std::to_string(n) + " must be a multiple of 8 and <= 1024");
}

inline void rmsnorm_forward(const bf16* x, bf16* y, int rows, int n, cudaStream_t stream, float eps = kRmsEps) {
  check_norm_width(n);
  const int warps = 8;
  rmsnorm_forward_kernel<<<(rows + warps - 1) / warps, warps * 32, 0, stream>>>(x, y, rows, n, eps);
  CUDA_CHECK_LAUNCH();
}

inline void rmsnorm_backward(const bf16* x, const bf16* dy, bf16* dx, int rows, int n, bool accumulate,
                             cudaStream_t stream, float eps = kRmsEps) {
  check_norm_width(n);
  const int warps = 8;
  rmsnorm_backward_kernel<<<(rows + warps - 1) / warps, warps * 32, 0, stream>>>(x, dy, dx, rows, n, eps, accumulate);
  CUDA_CHECK_LAUNCH();
}
// ===== end of kernels/norms.cuh =====
// ===== kernels/optimizers.cuh (inlined) =====
// Optimizer kernels. Adam (SPEC 1.10) on one flat slice of a parameter, with the gradient's one
// normalisation (grad_scale = 1/M, SPEC 4.2) fused in; parameter, gradient and states may be fp32
// or bf16 (the reference keeps the embeddings' states in bf16), the arithmetic is fp32.

#include <cmath>

struct AdamStep {
  float lr, beta1 = 0.8f, beta2 = 0.95f, eps = 1e-10f;
  int64_t t;          // step count, from 1
  float grad_scale;   // 1 / global micro-sequence count
};

__device__ inline float to_float(float x) { return x; }
__device__ inline float to_float(bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ inline T from_float(float x);
template <> __device__ inline float from_float<float>(float x) { return x; }
template <> __device__ inline bf16 from_float<bf16>(float x) { return __float2bfloat16(x); }

// p, g, m, v: [n]
template <typename P, typename G, typename S>
__global__ void adam_kernel(P* p, const G* g, S* m, S* v, int64_t n, AdamStep s, float step_size) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float grad = to_float(g[i]) * s.grad_scale;
    float mi = s.beta1 * to_float(m[i]) + (1 - s.beta1) * grad;
    float vi = s.beta2 * to_float(v[i]) + (1 - s.beta2) * grad * grad;
    m[i] = from_float<S>(mi);
    v[i] = from_float<S>(vi);
    p[i] = from_float<P>(to_float(p[i]) - step_size * to_float(m[i]) / (sqrtf(to_float(v[i])) + s.eps));
  }
}

template <typename P, typename G, typename S>
void adam_update(P* p, const G* g, S* m, S* v, int64_t n, const AdamStep& s, cudaStream_t stream) {
  double bias1 = 1 - std::pow(double(s.beta1), double(s.t)), bias2 = 1 - std::pow(double(s.beta2), double(s.t));
  float step_size = float(s.lr * std::sqrt(bias2) / bias1);
  adam_kernel<<<elementwise_grid(size_t(n)), 256, 0, stream>>>(p, g, m, v, n, s, step_size);
  CUDA_CHECK_LAUNCH();
}
// ===== end of kernels/optimizers.cuh =====
// ===== kernels/rendezvous.h (inlined) =====
// Where a process sits in the job, from the environment of the standard launchers (torchrun,
// mpirun, srun), and the exchange of NCCL's unique id: rank 0 listens at MASTER_ADDR:MASTER_PORT
// (one port above under torchrun, whose own store holds MASTER_PORT), every other rank connects
// and receives the id's bytes. Every wait has a deadline, and a failure
// names the rank(s) and the address, so a job never hangs on a rank that failed to start. Rank 0
// reads all hellos at once, each with its own deadline, so a connection that never speaks holds no
// one up; and whatever ends its rendezvous (a missing, duplicate or misconfigured rank) it tells
// every connected rank, so they all fail at once with the same message.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

struct ProcessGroupEnv {
  int rank = 0, world_size = 1, local_rank = 0, local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int id_port = 29500;  // where rank 0 serves NCCL's id
  std::string launcher = "none";  // which environment was recognised (logged)
};

using EnvLookup = std::function<const char*(const char*)>;

namespace rendezvous_detail {

inline int env_int(const EnvLookup& env, const char* name, int min, int max) {
  const char* text = env(name);
  if (!text) throw std::invalid_argument(std::string("environment: ") + name + " is not set");
  char* end = nullptr;
  errno = 0;
  long value = std::strtol(text, &end, 10);
  if (errno || end == text || (*end && *end != '(') || value < min || value > max)  // Slurm writes "4(x2)"
    throw std::invalid_argument(std::string("environment: ") + name + "='" + text + "' is not an integer in [" +
                                std::to_string(min) + ", " + std::to_string(max) + "]");
  return int(value);
}

struct LauncherNames {
  const char *launcher, *rank, *world_size, *local_rank, *local_world_size;
};

}  // namespace rendezvous_detail

// torchrun's RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE, else Open MPI's OMPI_COMM_WORLD_*, else
// Slurm's SLURM_PROCID/NTASKS/LOCALID/NTASKS_PER_NODE, else a single process. MASTER_ADDR and
// MASTER_PORT are required for more than one rank. torchrun (TORCHELASTIC_RUN_ID set) runs its own
// store at MASTER_PORT, which every worker is pointed to, so there the id goes one port above.
// Throws std::invalid_argument naming the variable.
inline ProcessGroupEnv process_group_from_env(const EnvLookup& env = [](const char* n) { return std::getenv(n); }) {
  using namespace rendezvous_detail;
  const LauncherNames launchers[] = {
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
      {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
  };
  ProcessGroupEnv g;
  for (const LauncherNames& l : launchers) {
    if (!env(l.rank) && !env(l.world_size)) continue;
    g.launcher = l.launcher;
    g.world_size = env_int(env, l.world_size, 1, 1 << 20);
    g.rank = env_int(env, l.rank, 0, g.world_size - 1);
    g.local_world_size = env(l.local_world_size) ? env_int(env, l.local_world_size, 1, g.world_size) : g.world_size;
    g.local_rank = env(l.local_rank) ? env_int(env, l.local_rank, 0, g.local_world_size - 1) : g.rank % g.local_world_size;
    break;
  }
  if (g.world_size > 1) {
    const char* addr = env("MASTER_ADDR");
    if (!addr || !*addr)
      throw std::invalid_argument("environment: MASTER_ADDR is not set (" + g.launcher + " with " +
                                  std::to_string(g.world_size) + " ranks needs rank 0's address)");
    g.master_addr = addr;
    const int above_torchrun_store = env("TORCHELASTIC_RUN_ID") ? 1 : 0;
    g.id_port = env_int(env, "MASTER_PORT", 1, 65535 - above_torchrun_store) + above_torchrun_store;
  }
  return g;
}

// The 128 bytes of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES), kept opaque here.
using UniqueIdBytes = std::array<char, 128>;

namespace rendezvous_detail {

constexpr uint32_t kHelloMagic = 0x53504452;  // "SPDR"
constexpr uint32_t kHelloVersion = 2;          // 2: the hello carries the sender's world size

// What every other rank sends rank 0 on connecting: magic, version, its rank, its world size.
using Hello = std::array<uint32_t, 4>;

// A rank sends its hello the moment it connects, so a connection silent for this long is not a
// rank at work (a port scan, a health check, a process stopped mid-way): rank 0 drops it.
constexpr std::chrono::milliseconds kHelloTimeout{1000};

// Rank 0 answers (id or error) until its deadline plus this; every other rank listens as long.
constexpr std::chrono::milliseconds kAnswerGrace{2000};

// What rank 0 answers each rank: a status word, then the id (kStatusId) or an error text of
// kErrorBytes (kStatusError), so every rank learns why the rendezvous failed, not only rank 0.
constexpr uint32_t kStatusId = 0, kStatusError = 1;
constexpr size_t kErrorBytes = 1024;

using Clock = std::chrono::steady_clock;

class Socket {
 public:
  explicit Socket(int fd = -1) : fd_(fd) {}
  ~Socket() { if (fd_ >= 0) ::close(fd_); }
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept { std::swap(fd_, o.fd_); return *this; }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_;
};

[[noreturn]] inline void throw_errno(const std::string& what) { throw std::runtime_error(what + ": " + std::strerror(errno)); }

inline int ms_left(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left > 0 ? int(left) : 0;
}

// Waits for `events` on fd until the deadline; false on timeout.
inline bool wait_for(int fd, short events, Clock::time_point deadline) {
  pollfd p{fd, events, 0};
  for (;;) {
    int n = ::poll(&p, 1, ms_left(deadline));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) throw_errno("rendezvous: poll failed");
  }
}

// Moves exactly n bytes before the deadline; false on timeout or a closed connection.
inline bool transfer(int fd, void* data, size_t n, bool sending, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    if (!wait_for(fd, sending ? POLLOUT : POLLIN, deadline)) return false;
    ssize_t done = sending ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (done <= 0) {
      if (done < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      return false;
    }
    p += done;
    n -= size_t(done);
  }
  return true;
}

inline std::string where(const ProcessGroupEnv& g) { return g.master_addr + ":" + std::to_string(g.id_port); }

inline std::string seconds(std::chrono::milliseconds t) { return std::to_string(t.count() / 1000.0).substr(0, 4) + " s"; }

// Non-blocking, so that accept never waits, even for a connection that vanished after poll saw it.
inline Socket listen_on(int port) {
  const std::string cannot = "rendezvous: rank 0 cannot listen on port " + std::to_string(port) + ": ";
  Socket s(::socket(AF_INET, SOCK_STREAM, 0));
  if (s.fd() < 0) throw_errno(cannot + "socket");
  int one = 1;
  if (::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0) throw_errno(cannot + "setsockopt(SO_REUSEADDR)");
  const int flags = ::fcntl(s.fd(), F_GETFL);
  if (flags < 0 || ::fcntl(s.fd(), F_SETFL, flags | O_NONBLOCK) != 0) throw_errno(cannot + "fcntl(O_NONBLOCK)");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(uint16_t(port));
  if (::bind(s.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    throw std::runtime_error(cannot + "bind: " + std::strerror(errno) + " (is the port in use?)");
  if (::listen(s.fd(), 128) != 0) throw_errno(cannot + "listen");
  return s;
}

// A connection rank 0 accepted: where it came from (for messages) and its hello so far.
struct Peer {
  Socket socket;
  std::string address;
  Clock::time_point hello_deadline;
  Hello hello{};
  size_t hello_bytes = 0;
};

// Rank 0's connections: the ranks whose hello arrived, and those whose hello is still due.
struct Connections {
  std::vector<Peer> ranks;           // index = rank; an empty socket until that rank's hello
  std::vector<Peer> pending;         // accepted, hello incomplete
  std::vector<std::string> dropped;  // addresses that sent no hello within kHelloTimeout

  int known() const {
    int n = 0;
    for (const Peer& p : ranks) n += p.socket.fd() >= 0;
    return n;
  }
};

inline std::string address_of(const sockaddr_in& a) {
  char ip[INET_ADDRSTRLEN];
  if (!::inet_ntop(AF_INET, &a.sin_addr, ip, sizeof ip)) return "(unknown address)";
  return std::string(ip) + ":" + std::to_string(ntohs(a.sin_port));
}

// Best effort: a peer that cannot be told (it left, or does not read) fails on its own deadline.
inline void send_error(const Socket& peer, const std::string& message, Clock::time_point deadline) {
  if (peer.fd() < 0) return;
  std::array<char, kErrorBytes> text{};
  message.copy(text.data(), text.size() - 1);
  uint32_t status = kStatusError;
  if (transfer(peer.fd(), &status, sizeof status, true, deadline)) transfer(peer.fd(), text.data(), text.size(), true, deadline);
}

// Takes every connection waiting on the server socket into `pending`.
inline void accept_waiting(int server, int port, Connections& c) {
  for (;;) {
    sockaddr_in from{};
    socklen_t length = sizeof from;
    Socket s(::accept(server, reinterpret_cast<sockaddr*>(&from), &length));
    if (s.fd() < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;  // that connection is gone
      throw_errno("rank 0 cannot accept a connection on port " + std::to_string(port));
    }
    Peer p;
    p.socket = std::move(s);
    p.address = address_of(from);
    p.hello_deadline = Clock::now() + kHelloTimeout;
    c.pending.push_back(std::move(p));
  }
}

// Reads what has arrived of a peer's hello; false if the peer closed (or reset) its connection.
inline bool read_hello(Peer& p) {
  char* into = reinterpret_cast<char*>(p.hello.data()) + p.hello_bytes;
  const ssize_t n = ::recv(p.socket.fd(), into, sizeof(Hello) - p.hello_bytes, MSG_DONTWAIT);
  if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return true;
  if (n <= 0) return false;
  p.hello_bytes += size_t(n);
  return true;
}

// A complete hello must name a free rank of this world; otherwise the whole rendezvous fails.
inline void check_claim(const ProcessGroupEnv& g, const Connections& c, const Peer& p) {
  const uint32_t rank = p.hello[2], world = p.hello[3];
  if (world != uint32_t(g.world_size))
    throw std::runtime_error("rank " + std::to_string(rank) + " at " + p.address + " was started with " +
                             std::to_string(world) + " ranks, rank 0 with " + std::to_string(g.world_size));
  if (rank == 0 || rank >= uint32_t(g.world_size))
    throw std::runtime_error("a process at " + p.address + " claims rank " + std::to_string(rank) + " of " +
                             std::to_string(g.world_size));
  if (c.ranks[rank].socket.fd() >= 0)
    throw std::runtime_error("rank " + std::to_string(rank) + " connected twice, from " + c.ranks[rank].address +
                             " and from " + p.address + " (was one rank number given to two processes?)");
}

// Reads the pending hellos that poll found readable (fds[1 + i] is pending[i]); a complete one
// makes its peer a rank; a closed connection, or one speaking another protocol, is dropped.
inline void read_pending(const ProcessGroupEnv& g, Connections& c, const std::vector<pollfd>& fds) {
  for (size_t i = 0; i < c.pending.size(); ++i) {
    Peer& p = c.pending[i];
    if (!fds[1 + i].revents) continue;
    if (!read_hello(p)) p.socket = Socket();
    if (p.hello_bytes < sizeof(Hello)) continue;
    if (p.hello[0] != kHelloMagic || p.hello[1] != kHelloVersion) {
      p.socket = Socket();
      continue;
    }
    check_claim(g, c, p);  // throws with p still pending, so it too is told the error
    c.ranks[p.hello[2]] = std::move(p);
  }
}

// Drops the connections whose hello is overdue, telling each why (it may be a rank that stalled).
inline void drop_silent(Connections& c) {
  for (Peer& p : c.pending) {
    if (p.socket.fd() < 0 || Clock::now() < p.hello_deadline) continue;
    send_error(p.socket, "the connection from " + p.address + " sent no hello within " + seconds(kHelloTimeout) +
                             "; rank 0 dropped it", Clock::now() + std::chrono::milliseconds(100));
    c.dropped.push_back(p.address);
    p.socket = Socket();
  }
}

// A known rank's connection turned readable: the rank left (its own deadline, a crash) or broke
// the protocol. Either way the rendezvous cannot complete.
inline void check_known_rank(const Peer& p, int rank) {
  char byte;
  const ssize_t n = ::recv(p.socket.fd(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return;
  const std::string who = "rank " + std::to_string(rank) + " at " + p.address;
  if (n > 0) throw std::runtime_error(who + " sent bytes after its hello");
  throw std::runtime_error(who + " closed its connection before the id was sent" +
                           (n < 0 ? " (" + std::string(std::strerror(errno)) + ")" : std::string()) + "; did it stop?");
}

// Checks the known ranks that poll found readable (they follow the pending ones in fds).
inline void check_known_ranks(const Connections& c, const std::vector<pollfd>& fds) {
  size_t i = 1 + c.pending.size();
  for (size_t r = 1; r < c.ranks.size(); ++r) {
    if (c.ranks[r].socket.fd() < 0) continue;
    if (fds[i++].revents) check_known_rank(c.ranks[r], int(r));
  }
}

// The poll set: the server socket, every pending connection, then every known rank.
inline std::vector<pollfd> poll_set(int server, const Connections& c) {
  std::vector<pollfd> fds{{server, POLLIN, 0}};
  for (const Peer& p : c.pending) fds.push_back({p.socket.fd(), POLLIN, 0});
  for (const Peer& p : c.ranks)
    if (p.socket.fd() >= 0) fds.push_back({p.socket.fd(), POLLIN, 0});
  return fds;
}

// Waits until something is readable, the rendezvous deadline, or the first pending hello's deadline.
inline void wait_any(std::vector<pollfd>& fds, const Connections& c, Clock::time_point deadline) {
  Clock::time_point until = deadline;
  for (const Peer& p : c.pending) until = std::min(until, p.hello_deadline);
  if (::poll(fds.data(), fds.size(), ms_left(until)) < 0 && errno != EINTR) throw_errno("rank 0's poll failed");
}

inline std::string missing_ranks(const ProcessGroupEnv& g, const Connections& c, std::chrono::milliseconds timeout) {
  std::string missing, dropped;
  for (int r = 1; r < g.world_size; ++r)
    if (c.ranks[r].socket.fd() < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
  for (const std::string& a : c.dropped) dropped += (dropped.empty() ? "" : ", ") + a;
  return "rank 0 waited " + seconds(timeout) + " on port " + std::to_string(g.id_port) + "; rank(s) " + missing +
         " never connected" +
         (dropped.empty() ? "" : "; it dropped connection(s) that sent no hello within " + seconds(kHelloTimeout) + ": " + dropped);
}

// Rank 0, until every rank's hello has arrived: one poll over all connections, so no connection
// waits for another, and every hello has its own deadline. Throws the text to tell every peer.
inline void gather_hellos(const ProcessGroupEnv& g, int server, Connections& c, Clock::time_point deadline,
                          std::chrono::milliseconds timeout) {
  while (c.known() < g.world_size - 1) {
    if (Clock::now() >= deadline) throw std::runtime_error(missing_ranks(g, c, timeout));
    std::vector<pollfd> fds = poll_set(server, c);
    wait_any(fds, c, deadline);
    check_known_ranks(c, fds);
    read_pending(g, c, fds);
    if (fds[0].revents) accept_waiting(server, g.id_port, c);
    drop_silent(c);
    c.pending.erase(std::remove_if(c.pending.begin(), c.pending.end(), [](const Peer& p) { return p.socket.fd() < 0; }),
                    c.pending.end());
  }
}

// `id` is a copy: transfer takes a writable buffer.
inline void send_id(Connections& c, UniqueIdBytes id, Clock::time_point deadline) {
  for (size_t r = 1; r < c.ranks.size(); ++r) {
    uint32_t status = kStatusId;
    const int fd = c.ranks[r].socket.fd();
    if (!transfer(fd, &status, sizeof status, true, deadline) || !transfer(fd, id.data(), id.size(), true, deadline))
      throw std::runtime_error("rank 0 could not send the id to rank " + std::to_string(r) + " at " + c.ranks[r].address);
  }
}

// Rank 0: gathers every other rank's hello, then sends each the id. On any failure every peer
// connected by then, including those still in the server's queue, gets the error text before
// rank 0 throws it, so no rank waits for its own deadline to learn that the rendezvous is over.
inline void serve_id(const ProcessGroupEnv& g, const UniqueIdBytes& id, Clock::time_point deadline,
                     std::chrono::milliseconds timeout) {
  Socket server = listen_on(g.id_port);
  Connections c;
  c.ranks.resize(size_t(g.world_size));
  try {
    gather_hellos(g, server.fd(), c, deadline, timeout);
    send_id(c, id, deadline + kAnswerGrace);
  } catch (const std::exception& e) {
    try {
      accept_waiting(server.fd(), g.id_port, c);
    } catch (const std::exception&) {
      // The failure to report is e; the peers still queued then learn of it from the closed port.
    }
    const Clock::time_point tell_deadline = Clock::now() + std::chrono::milliseconds(500);
    for (const Peer& p : c.ranks) send_error(p.socket, e.what(), tell_deadline);
    for (const Peer& p : c.pending) send_error(p.socket, e.what(), tell_deadline);
    throw std::runtime_error(std::string("rendezvous: ") + e.what());
  }
}

// Connects to rank 0, retrying until the deadline (rank 0 may start later).
inline Socket connect_to_master(const ProcessGroupEnv& g, Clock::time_point deadline, std::chrono::milliseconds timeout) {
  const std::string me = "rendezvous: rank " + std::to_string(g.rank);
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  const int resolved = ::getaddrinfo(g.master_addr.c_str(), std::to_string(g.id_port).c_str(), &hints, &found);
  if (resolved != 0 || !found)
    throw std::runtime_error(me + " cannot resolve MASTER_ADDR " + g.master_addr + ": " + ::gai_strerror(resolved));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> address(found, ::freeaddrinfo);
  int last_error = 0;
  while (Clock::now() < deadline) {
    Socket s(::socket(AF_INET, SOCK_STREAM, 0));
    if (s.fd() < 0) throw_errno(me + " cannot create a socket");
    if (::connect(s.fd(), address->ai_addr, address->ai_addrlen) == 0) return s;
    last_error = errno;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  throw std::runtime_error(me + " could not reach rank 0 at " + where(g) + " within " + seconds(timeout) +
                           (last_error ? std::string(" (") + std::strerror(last_error) + ")" : std::string()));
}

// A rank's side once connected: its hello, then rank 0's answer (the id, or the error that ended
// the rendezvous, which this rank throws as its own).
inline void receive_id(const ProcessGroupEnv& g, int master, UniqueIdBytes& id, Clock::time_point deadline,
                       std::chrono::milliseconds timeout) {
  const std::string me = "rendezvous: rank " + std::to_string(g.rank);
  Hello hello = {kHelloMagic, kHelloVersion, uint32_t(g.rank), uint32_t(g.world_size)};
  uint32_t status = kStatusId;
  // Rank 0 gives up at its own deadline and then names the missing ranks: listen a little longer.
  const Clock::time_point answer_deadline = deadline + kAnswerGrace;
  if (!transfer(master, hello.data(), sizeof hello, true, deadline) ||
      !transfer(master, &status, sizeof status, false, answer_deadline))
    throw std::runtime_error(me + " got no id from rank 0 at " + where(g) + " within " + seconds(timeout) +
                             " (did rank 0 fail?)");
  if (status != kStatusId) {
    std::array<char, kErrorBytes> text{};
    if (!transfer(master, text.data(), text.size(), false, answer_deadline))
      throw std::runtime_error(me + " stops: rank 0 reported an error but closed before its text arrived");
    text.back() = '\0';
    throw std::runtime_error(me + " stops: " + std::string(text.data()));
  }
  if (!transfer(master, id.data(), id.size(), false, answer_deadline))
    throw std::runtime_error(me + " lost rank 0 at " + where(g) + " while receiving the id");
}

}  // namespace rendezvous_detail

// Rank 0's id reaches every rank (in: rank 0's id; out: the same bytes on every other rank).
inline void broadcast_id_over_tcp(const ProcessGroupEnv& g, UniqueIdBytes& id, std::chrono::milliseconds timeout) {
  using namespace rendezvous_detail;
  if (g.world_size == 1) return;
  const Clock::time_point deadline = Clock::now() + timeout;
  if (g.rank == 0) return serve_id(g, id, deadline, timeout);
  Socket master = connect_to_master(g, deadline, timeout);
  receive_id(g, master.fd(), id, deadline, timeout);
}
// ===== end of kernels/rendezvous.h =====
// ===== kernels/residual.cuh (inlined) =====
// The learned scalar mixes of the residual stream (SPEC 1.2): block lambdas x = l0 x + l1 x0, the
// U-net skips x += w skip, the value mix v = sa0 v + sa1 ve. All are out = a x + b y with fp32
// scalars read from device memory (the masters the optimizer updates, so no host sync), bf16
// tensors, fp32 math. x may be a strided view (v is the last third of each qkv row). The scalar
// gradients are sums over T x d products: per-block partial sums in a grid fixed by the shape, then
// one block adds them in order, so they are deterministic.

#include <algorithm>
#include <stdexcept>
#include <string>

constexpr int kScalarReductionBlocks = 264;  // 2 per SM; the scratch holds 2 x this many floats

// The scalar reductions' grid: 2 blocks per SM at the record's shapes, fewer where T x d is small
// (a block per 2048 vectors of 8 at least), so that small problems do not launch idle blocks.
inline int scalar_reduction_blocks(int T, int d) {
  const size_t vectors = size_t(T) * d / 8, per_block = 256 * 8;
  return int(std::min<size_t>(kScalarReductionBlocks, std::max<size_t>(1, (vectors + per_block - 1) / per_block)));
}

inline void check_residual_width(int d, int x_stride) {
  if (d % 8 != 0 || x_stride % 8 != 0)
    throw std::invalid_argument("residual mix: width " + std::to_string(d) + " and row stride " +
                                std::to_string(x_stride) + " must be multiples of 8");
}

// out[T, d] = a x[T, d; row stride x_stride] + b y[T, d]; a or b null means 1, y null means no y term
__global__ void weighted_sum_forward_kernel(const bf16* x, int x_stride, const float* a, const bf16* y, const float* b,
                                            bf16* out, int T, int d) {
  const int vectors_per_row = d / 8;
  const float alpha = a ? *a : 1.0f, beta = !y ? 0.0f : b ? *b : 1.0f;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(T) * vectors_per_row;
       i += size_t(gridDim.x) * blockDim.x) {
    size_t t = i / vectors_per_row, c = (i % vectors_per_row) * 8;
    float xv[8], yv[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    load8(x + t * x_stride + c, xv);
    if (y) load8(y + t * d + c, yv);
#pragma unroll
    for (int k = 0; k < 8; ++k) xv[k] = alpha * xv[k] + beta * yv[k];
    store8(out + t * d + c, xv);
  }
}

inline void weighted_sum_forward(const bf16* x, const float* a, const bf16* y, const float* b, bf16* out, int T, int d,
                                 int x_stride, cudaStream_t stream) {
  check_residual_width(d, x_stride);
  weighted_sum_forward_kernel<<<elementwise_grid(size_t(T) * d / 8), 256, 0, stream>>>(x, x_stride, a, y, b, out, T, d);
  CUDA_CHECK_LAUNCH();
}

// The backward of out = a x + b y for one dout[T, d]:
//   dx[T, d; stride x_stride] = a dout        (skipped when dx is null)
//   dy[T, d] (+)= b dout                      (skipped when dy is null; accumulate_dy adds)
//   partial[block], partial[blocks + block]  = this block's share of sum(dout x), sum(dout y)
//                                             (x, y null: not needed, 0)
// dx may alias dout (same element read, then written by the same thread).
__global__ void weighted_sum_backward_kernel(const bf16* dout, const bf16* x, int x_stride, const float* a,
                                             const bf16* y, const float* b, bf16* dx, bf16* dy, bool accumulate_dy,
                                             float* partial, int T, int d) {
  const int vectors_per_row = d / 8;
  const float alpha = a ? *a : 1.0f, beta = !dy ? 0.0f : b ? *b : 1.0f;
  float dot_x = 0, dot_y = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(T) * vectors_per_row;
       i += size_t(gridDim.x) * blockDim.x) {
    size_t t = i / vectors_per_row, c = (i % vectors_per_row) * 8;
    float g[8], v[8];
    load8(dout + t * d + c, g);
    if (x) {
      load8(x + t * x_stride + c, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) dot_x += g[k] * v[k];
    }
    if (y) {
      load8(y + t * d + c, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) dot_y += g[k] * v[k];
    }
    if (dy) {
      float prev[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (accumulate_dy) load8(dy + t * d + c, prev);
#pragma unroll
      for (int k = 0; k < 8; ++k) prev[k] += beta * g[k];
      store8(dy + t * d + c, prev);
    }
    if (dx) {
#pragma unroll
      for (int k = 0; k < 8; ++k) g[k] *= alpha;
      store8(dx + t * x_stride + c, g);
    }
  }
  dot_x = block_sum(dot_x);
  dot_y = block_sum(dot_y);
  if (threadIdx.x == 0) {
    partial[blockIdx.x] = dot_x;
    partial[gridDim.x + blockIdx.x] = dot_y;
  }
}

// da += sum(partial[0, blocks)), db += sum(partial[blocks, 2 blocks)), each in block order
__global__ void add_scalar_gradients_kernel(const float* partial, int blocks, float* da, float* db) {
  float sum_x = 0, sum_y = 0;
  for (int i = threadIdx.x; i < blocks; i += blockDim.x) sum_x += partial[i], sum_y += partial[blocks + i];
  sum_x = block_sum(sum_x);
  sum_y = block_sum(sum_y);
  if (threadIdx.x == 0) {
    if (da) *da += sum_x;
    if (db) *db += sum_y;
  }
}

// Gradients of out = a x + b y (a or b null: 1): dx (stride x_stride, may alias dout) = a dout, dy (+)= b dout, and
// the scalar gradients da += sum(dout x), db += sum(dout y) (each skipped when null). scratch holds
// 2 x kScalarReductionBlocks floats.
inline void weighted_sum_backward(const bf16* dout, const bf16* x, const float* a, float* da, const bf16* y,
                                  const float* b, float* db, bf16* dx, bf16* dy, bool accumulate_dy, int T, int d,
                                  int x_stride, float* scratch, cudaStream_t stream) {
  check_residual_width(d, x_stride);
  if (dx == dout && !a) dx = nullptr;  // dx = 1 * dout in place: nothing to write
  const int blocks = scalar_reduction_blocks(T, d);
  weighted_sum_backward_kernel<<<blocks, 256, 0, stream>>>(dout, da ? x : nullptr, x_stride, a, db ? y : nullptr, b,
                                                           dx, dy, accumulate_dy, scratch, T, d);
  CUDA_CHECK_LAUNCH();
  if (!da && !db) return;
  add_scalar_gradients_kernel<<<1, 256, 0, stream>>>(scratch, blocks, da, db);
  CUDA_CHECK_LAUNCH();
}

// dst[n] += src[n], bf16, n a multiple of 8
__global__ void add_into_kernel(const bf16* src, bf16* dst, size_t vectors) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < vectors; i += size_t(gridDim.x) * blockDim.x) {
    float s[8], t[8];
    load8(src + i * 8, s);
    load8(dst + i * 8, t);
#pragma unroll
    for (int k = 0; k < 8; ++k) t[k] += s[k];
    store8(dst + i * 8, t);
  }
}

inline void add_into(const bf16* src, bf16* dst, size_t n, cudaStream_t stream) {
  if (n % 8) throw std::invalid_argument("add_into: size must be a multiple of 8");
  add_into_kernel<<<elementwise_grid(n / 8), 256, 0, stream>>>(src, dst, n / 8);
  CUDA_CHECK_LAUNCH();
}

// y[T, n] = x[T, k] W[n, k]^T + residual[T, n] (bf16): with `fused`, the residual is cuBLASLt's C
// (D elsewhere: one pass); otherwise the product and then an add (the self-check's reference, and
// the run's path with --residual-add separate).
inline void linear_with_residual(Matmul& matmul, const bf16* x, const bf16* w, bf16* y, int T, int n, int k,
                                 const bf16* residual, bool fused, cudaStream_t stream) {
  if (fused) {
    MatmulOptions o;
    o.addend = residual;
    matmul(x, Transpose::N, w, Transpose::T, y, T, n, k, CUDA_R_16BF, o, stream, 1.0f, 1.0f);
    return;
  }
  matmul(x, Transpose::N, w, Transpose::T, y, T, n, k, CUDA_R_16BF, stream);
  add_into(residual, y, size_t(T) * n, stream);
}
// ===== end of kernels/residual.cuh =====
// ===== kernels/rope.cuh (inlined) =====
// QK-norm fused with half-truncated RoPE (SPEC 1.3), forward and backward, head_dim 128.
// One warp per (token, head, q or k): lane l holds elements [4l, 4l + 4); rotation pairs j with
// j + 64, which sit in lanes l and l ^ 16. Angles are the reference's fp32 t * freq; the norm and
// rotation run in fp32 without an intermediate bf16 rounding.

#include <cmath>
#include <vector>

constexpr int kRopeHeadDim = 128;

// cos_sin [T, 64, 2]: for pair j < 32 frequency (1/1024)^(j/31), for j >= 32 zero (no rotation).
inline void rope_table_host(int T, std::vector<float>& cos_sin) {
  const int pairs = kRopeHeadDim / 2, rotated = kRopeHeadDim / 4;
  cos_sin.resize(size_t(T) * pairs * 2);
  for (int j = 0; j < pairs; ++j) {
    float freq = j < rotated ? std::pow(1.0f / 1024, float(j) / (rotated - 1)) : 0.0f;
    for (int t = 0; t < T; ++t) {
      float theta = float(t) * freq;  // fp32 product, as the reference's einsum
      cos_sin[(size_t(t) * pairs + j) * 2] = float(std::cos(double(theta)));
      cos_sin[(size_t(t) * pairs + j) * 2 + 1] = float(std::sin(double(theta)));
    }
  }
}

// Rotation of this lane's 4 elements; inverse applies the transpose (used by the backward).
__device__ inline void rope_rotate(float v[4], const float* cos_sin_t, int lane, bool inverse) {
  float other[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) other[i] = __shfl_xor_sync(0xffffffffu, v[i], 16);
  bool first_half = lane < 16;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    int j = (lane % 16) * 4 + i;
    float c = cos_sin_t[2 * j], s = cos_sin_t[2 * j + 1];
    if (inverse) s = -s;
    // y1 = x1 c + x2 s ; y2 = -x1 s + x2 c
    v[i] = first_half ? v[i] * c + other[i] * s : -other[i] * s + v[i] * c;
  }
}

// qkv [T, 3, H, 128] raw projections -> q, k [T, H, 128] normalised and rotated.
__global__ void qk_norm_rope_forward_kernel(const bf16* qkv, const float* cos_sin, bf16* q, bf16* k, int T,
                                            int H, float eps) {
  int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= T * H * 2) return;
  int which = warp % 2, th = warp / 2, t = th / H, h = th % H;
  const bf16* src = qkv + (size_t(t) * 3 + which) * H * kRopeHeadDim + h * kRopeHeadDim + lane * 4;
  float v[4], ss = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) ss += (v[i] = __bfloat162float(src[i])) * v[i];
  float inv = rsqrtf(warp_sum(ss) / kRopeHeadDim + eps);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] *= inv;
  rope_rotate(v, cos_sin + size_t(t) * kRopeHeadDim, lane, false);
  bf16* dst = (which == 0 ? q : k) + size_t(th) * kRopeHeadDim + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) dst[i] = __float2bfloat16(v[i]);
}

// dq, dk [T, H, 128] -> the q and k parts of dqkv [T, 3, H, 128] (the v part is left untouched).
__global__ void qk_norm_rope_backward_kernel(const bf16* qkv, const bf16* dq, const bf16* dk,
                                             const float* cos_sin, bf16* dqkv, int T, int H, float eps) {
  int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= T * H * 2) return;
  int which = warp % 2, th = warp / 2, t = th / H, h = th % H;
  size_t raw_at = (size_t(t) * 3 + which) * H * kRopeHeadDim + h * kRopeHeadDim + lane * 4;
  const bf16* grad = (which == 0 ? dq : dk) + size_t(th) * kRopeHeadDim + lane * 4;
  float x[4], g[4], ss = 0, dot = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[i] = __bfloat162float(qkv[raw_at + i]);
    g[i] = __bfloat162float(grad[i]);
  }
  rope_rotate(g, cos_sin + size_t(t) * kRopeHeadDim, lane, true);
#pragma unroll
  for (int i = 0; i < 4; ++i) ss += x[i] * x[i], dot += x[i] * g[i];
  float inv = rsqrtf(warp_sum(ss) / kRopeHeadDim + eps), mean_dot = warp_sum(dot) / kRopeHeadDim;
#pragma unroll
  for (int i = 0; i < 4; ++i) dqkv[raw_at + i] = __float2bfloat16(inv * g[i] - inv * inv * inv * x[i] * mean_dot);
}

inline void qk_norm_rope_forward(const bf16* qkv, const float* cos_sin, bf16* q, bf16* k, int T, int H,
                                 cudaStream_t stream, float eps = kRmsEps) {
  const int warps = 8, items = T * H * 2;
  qk_norm_rope_forward_kernel<<<(items + warps - 1) / warps, warps * 32, 0, stream>>>(qkv, cos_sin, q, k, T, H, eps);
  CUDA_CHECK_LAUNCH();
}

inline void qk_norm_rope_backward(const bf16* qkv, const bf16* dq, const bf16* dk, const float* cos_sin, bf16* dqkv,
                                  int T, int H, cudaStream_t stream, float eps = kRmsEps) {
  const int warps = 8, items = T * H * 2;
  qk_norm_rope_backward_kernel<<<(items + warps - 1) / warps, warps * 32, 0, stream>>>(qkv, dq, dk, cos_sin, dqkv,
                                                                                       T, H, eps);
  CUDA_CHECK_LAUNCH();
}
// ===== end of kernels/rope.cuh =====
// ===== kernels/schedules.h (inlined) =====
// The recipe's schedules (SPEC 1.4 and 1.8), host-side: learning-rate factor, Muon momentum warmup
// and the sliding-window size in 128-token blocks. Shared by the trainer and the CPU reference.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

struct Schedule {
  int num_iterations = 1770;
  double cooldown_frac = 0.4;
  double min_lr_factor = 0.1;
  int momentum_warmup_steps = 300;
  double momentum_start = 0.85, momentum_end = 0.95;
  double max_window_tokens = 1728;  // grows to next_multiple_of_128(1728) = 1792 tokens = 14 blocks
  int window_granularity = 128;

  double progress(int step) const {
    if (step < 0 || step > num_iterations)
      throw std::out_of_range("step " + std::to_string(step) + " outside [0, " +
                              std::to_string(num_iterations) + "]");
    return double(step) / num_iterations;
  }

  // Flat 1.0, then linear down to min_lr_factor over the last cooldown_frac of training.
  double lr_factor(int step) const {
    double x = progress(step);
    if (x < 1 - cooldown_frac) return 1.0;
    double w = (1 - x) / cooldown_frac;
    return w * 1.0 + (1 - w) * min_lr_factor;
  }

  double muon_momentum(int step) const {
    double frac = std::min(double(step) / momentum_warmup_steps, 1.0);
    return (1 - frac) * momentum_start + frac * momentum_end;
  }

  // Long window in blocks; the short window is half of it (rounded down).
  int window_blocks(int step) const {
    double target = max_window_tokens * progress(step);
    // The reference's next_multiple_of_n(v, 128): the smallest multiple >= v, at least 128.
    int tokens = std::max(window_granularity,
                          int(std::ceil(target / window_granularity)) * window_granularity);
    return tokens / window_granularity;
  }
};
// ===== end of kernels/schedules.h =====
// ===== kernels/self_check.cuh (inlined) =====
// The start-up self-check: every fast path of the step beside a simple GPU path of the same
// mathematics, on small problems of the run's shapes, with bounds drawn from the GPU tests'.
// A first run on new hardware (or a new driver, CUDA or cuBLASLt) may find a fast path that the
// CPU emulator passed but the GPU does not compute as we read PTX and cuBLASLt; the trainer then
// replaces that path by its reference for the whole run (or stops, with --self-check strict)
// instead of training silently wrong. The references are the paths the flags select anyway:
//   flash attention (flash_attention.cuh)      --attention reference: the warp-per-row kernels (attention.cuh)
//   FP8 lm_head (fp8_head.cuh)                 --bf16-head: bf16 products
//   the cross-entropy's fused e5m2 gradient    --fp8-gradient cast: bf16 gradient, then a cast
//   batched Muon (strided cuBLASLt batches)    --muon per-matrix: Newton-Schulz one matrix at a time
//   the residual as cuBLASLt's C               --residual-add separate: the product, then an add
// ===== kernels/check_arrays.cuh (inlined) =====
// Arrays for comparing a GPU path with a reference, shared by the start-up self-check
// (kernels/self_check.cuh) and the GPU tests: a device buffer, random inputs, bf16 conversions,
// and the relative error ||out - ref|| / ||ref||.

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

// n device elements of T (one at least), freed with the buffer; download waits for the device.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) { CUDA_CHECK(cudaMalloc(&ptr_, std::max<size_t>(n, 1) * sizeof(T))); }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  void upload(const std::vector<T>& host) { CUDA_CHECK(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice)); }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  void poison() { CUDA_CHECK(cudaMemset(ptr_, 0xFF, n_ * sizeof(T))); }  // NaN for fp32 and bf16

 private:
  T* ptr_ = nullptr;
  size_t n_;
};

inline std::vector<double> random_normal(size_t n, uint64_t seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<double> v(n);
  for (double& x : v) x = normal(rng);
  return v;
}

inline std::vector<bf16> to_bf16(const std::vector<double>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16(float(v[i]));
  return out;
}

template <typename T>
std::vector<double> to_double(const std::vector<T>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = double(static_cast<float>(v[i]));
  return out;
}

// The values a bf16 round trip leaves: the reference computes from exactly what the GPU sees.
inline std::vector<double> rounded_to_bf16(const std::vector<double>& v) { return to_double(to_bf16(v)); }

// ||out - ref|| / ||ref||; infinity when any output is NaN or infinite (an unwritten poisoned
// element) or when ref is zero and out is not; 0 when both are zero.
inline double relative_error(const std::vector<double>& out, const std::vector<double>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(out[i])) return std::numeric_limits<double>::infinity();
    diff += (out[i] - ref[i]) * (out[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  if (norm == 0) return diff == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(diff) / std::sqrt(norm);
}

inline bool all_finite(const std::vector<double>& v) {
  for (double x : v)
    if (!std::isfinite(x)) return false;
  return true;
}
// ===== end of kernels/check_arrays.cuh =====

#include <chrono>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

// Which implementation of each replaceable part of the step a run uses (true: the fast one).
struct KernelPaths {
  bool flash_attention = true;
  bool fp8_head = true;
  bool fused_e5m2_gradient = true;
  bool batched_muon = true;
  bool fused_residual_add = true;
};

// A fast path: its KernelPaths member, its name in the log, the flag that selects its reference,
// and the test-only fault that gives it a wrong result (kernels/faults.h).
struct FastPath {
  bool KernelPaths::*member;
  const char* name;
  const char* reference_flag;
  Fault fault;
};

inline const std::vector<FastPath>& fast_paths() {
  static const std::vector<FastPath> paths = {
      {&KernelPaths::flash_attention, "flash attention", "--attention reference", Fault::wrong_flash_attention},
      {&KernelPaths::fp8_head, "FP8 head", "--bf16-head", Fault::wrong_fp8_head},
      {&KernelPaths::fused_e5m2_gradient, "fused e5m2 gradient", "--fp8-gradient cast",
       Fault::wrong_fused_e5m2_gradient},
      {&KernelPaths::batched_muon, "batched Muon", "--muon per-matrix", Fault::wrong_batched_muon},
      {&KernelPaths::fused_residual_add, "residual as cuBLASLt's C", "--residual-add separate",
       Fault::wrong_fused_residual_add},
  };
  return paths;
}

// One comparison: the worst relative error of the fast path's outputs against the reference's, or
// the error that stopped it.
struct SelfCheckResult {
  std::string name;
  bool KernelPaths::*path;
  double error, bound;
  std::string failure;  // what stopped the check before it had an error ("" if nothing)
  bool passed() const { return error <= bound; }  // NaN fails

  std::string line() const {
    char text[512];
    if (failure.empty())
      std::snprintf(text, sizeof text, "self-check %s: rel. error %.2e (bound %.0e) %s", name.c_str(), error, bound,
                    passed() ? "ok" : "FAILED");
    else
      std::snprintf(text, sizeof text, "self-check %s: %s FAILED", name.c_str(), failure.c_str());
    return text;
  }
};

// The problems' shapes: the model's width, heads and vocabulary; the attention problems' length
// (windows up to 14 blocks and documents across block edges need 16 blocks).
struct SelfCheckShape {
  int model_dim, num_heads, vocab_size;
  int attention_tokens = 16 * kAttentionBlock;
  int head_rows = 128;      // the FP8 head's rows (a multiple of 16)
  int residual_rows = 256;  // tokens of the residual products
};

namespace self_check {

// Bounds from the GPU tests'. Two bf16 paths that each stay within test_attention's and
// test_residual's 5e-3 of the exact result may differ by twice that (the emulator measured
// 2.8-3.0e-3 for attention, 1.7-2.2e-3 for the residual adds), where a wrong layout or operand
// gives errors of order 1. The FP8 products against bf16 products of the same FP8 values differ
// only by the tensor cores' accumulation and the output's rounding (test_fp8_head's bounds: bf16
// outputs 1e-2, the fp32 weight gradient 2e-3). The two Muon paths differ only in cuBLASLt's
// choice of algorithm for a batch or a single matrix.
constexpr double kBf16PathsBound = 1e-2, kFp8ProductBound = 1e-2, kFp8WeightGradBound = 2e-3, kMuonBound = 1e-2;
// The two gradient paths store the same fp32 value through the same two roundings: equal bytes
// (this bound leaves room for a compiler contracting one instantiation's arithmetic differently).
constexpr double kE5m2Bound = 1e-3;

inline std::vector<bf16> random_bf16(size_t n, double std, uint64_t seed) { return to_bf16(random_normal(n, seed, std)); }

inline std::vector<float> random_f32(size_t n, double std, uint64_t seed) {
  const std::vector<double> v = random_normal(n, seed, std);
  return std::vector<float>(v.begin(), v.end());
}

// relative_error of a fast path's outputs, which its injected fault (tests only) scales by 1.25
// first: a wrong result.
inline double fast_path_error(std::vector<double> fast, const std::vector<double>& ref, Fault fault) {
  if (injected_fault() == fault)
    for (double& x : fast) x *= 1.25;
  return relative_error(fast, ref);
}

// Flash attention's forward and both backward kernels against the reference kernels on one layout
// (document ids from `tokens`) and window: the worst of y, dq, dk and dv.
inline double attention_error(const SelfCheckShape& s, const uint16_t* tokens, uint16_t bos, int window,
                              cudaStream_t stream) {
  const int T = s.attention_tokens, H = s.num_heads, d = s.model_dim;
  std::vector<int32_t> docs = attention_document_ids(tokens, T, bos);
  AttentionBlockLists lists = build_attention_blocks(docs, window);
  StagedUploads uploads;
  uploads.reset(AttentionMask::upload_bytes(docs, lists));
  AttentionMask mask(docs, lists, uploads, stream);
  const size_t n = size_t(T) * d;
  // Scores of std ~0.5 (q and k of std 0.6, scale 0.12 over 128 dimensions), as test_attention.
  DeviceBuffer<bf16> q(random_bf16(n, 0.6, 11 + window)), k(random_bf16(n, 0.6, 12 + window)),
      v(random_bf16(n, 1.0, 13 + window)), dy(random_bf16(n, 1.0, 14 + window));
  const AttentionTensors a{T, H, d, d, d};
  std::vector<double> outputs[2][4];  // [flash, reference][y, dq, dk, dv]
  for (int reference = 0; reference < 2; ++reference) {
    DeviceBuffer<bf16> y(n), dq(n), dk(n), dv(n);
    DeviceBuffer<float> lse(size_t(T) * H), delta(size_t(T) * H);
    auto forward = reference ? attention_forward : flash_attention_forward;
    auto backward = reference ? attention_backward : flash_attention_backward;
    forward(q.get(), k.get(), v.get(), y.get(), lse.get(), a, mask, stream);
    backward(q.get(), k.get(), v.get(), y.get(), dy.get(), lse.get(), delta.get(), dq.get(), dk.get(), dv.get(), a,
             mask, stream);
    const DeviceBuffer<bf16>* results[4] = {&y, &dq, &dk, &dv};
    for (int i = 0; i < 4; ++i) outputs[reference][i] = to_double(results[i]->download());
  }
  double worst = 0;
  for (int i = 0; i < 4; ++i)
    worst = std::max(worst, fast_path_error(outputs[0][i], outputs[1][i], Fault::wrong_flash_attention));
  return worst;
}

// FP8 bytes as the bf16 values they encode (exact: bf16 holds every e4m3 and e5m2 value).
template <Fp8Kind kind>
__global__ void fp8_to_bf16_kernel(const fp8* in, bf16* out, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16(
        float(__half(__nv_cvt_fp8_to_halfraw(in[i], kind == Fp8Kind::e4m3 ? __NV_E4M3 : __NV_E5M2))));
}

template <Fp8Kind kind>
void fp8_to_bf16(const fp8* in, bf16* out, size_t n, cudaStream_t stream) {
  fp8_to_bf16_kernel<kind><<<elementwise_grid(n), 256, 0, stream>>>(in, out, n);
  CUDA_CHECK_LAUNCH();
}

// The FP8 head (a forward, the loss and its gradient, a backward on random rows) against bf16
// products of the same FP8 operands, scaled as the FP8 products are: the errors of the logits, dx
// and dW; with `gradient`, also its fused e5m2 gradient against the bf16 gradient cast afterwards
// (both copies).
inline std::vector<double> fp8_head_errors(const SelfCheckShape& s, bool gradient, Matmul& matmul,
                                           cudaStream_t stream) {
  const int rows = s.head_rows, V = s.vocab_size, d = s.model_dim;
  Fp8Head head(rows, V, d);
  const Fp8HeadScales& sc = head.scales();
  DeviceBuffer<bf16> x(random_bf16(size_t(rows) * d, 1.0, 21)), logits(size_t(rows) * V), dx(size_t(rows) * d);
  DeviceBuffer<float> w(random_f32(size_t(V) * d, 0.05, 22)), dw(std::vector<float>(size_t(V) * d, 0.0f)),
      losses(rows);
  std::vector<uint16_t> host_targets(rows);
  std::mt19937_64 rng(23);
  for (uint16_t& t : host_targets) t = uint16_t(rng() % V);
  DeviceBuffer<uint16_t> targets(host_targets);
  const Softcap softcap = Softcap::for_model_dim(d);
  head.quantize_weight(w.get(), stream);
  head.forward(x.get(), logits.get(), rows, matmul, stream);
  head.loss_and_gradient(logits.get(), targets.get(), losses.get(), softcap, stream);  // fused: logits kept
  head.backward(dx.get(), dw.get(), matmul, stream);

  // The same products in bf16 over the FP8 operands' values.
  const Fp8HeadOperands op = head.operands();
  DeviceBuffer<bf16> xq(size_t(rows) * d), wq(size_t(V) * d), gq(size_t(rows) * V), gq_t(size_t(V) * rows),
      xq_t(size_t(d) * rows), logits_ref(size_t(rows) * V), dx_ref(size_t(rows) * d);
  DeviceBuffer<float> dw_ref(size_t(V) * d);
  fp8_to_bf16<Fp8Kind::e4m3>(op.x, xq.get(), size_t(rows) * d, stream);
  fp8_to_bf16<Fp8Kind::e4m3>(op.x_t, xq_t.get(), size_t(rows) * d, stream);
  fp8_to_bf16<Fp8Kind::e4m3>(op.w, wq.get(), size_t(V) * d, stream);
  fp8_to_bf16<Fp8Kind::e5m2>(op.g, gq.get(), size_t(rows) * V, stream);
  fp8_to_bf16<Fp8Kind::e5m2>(op.g_t, gq_t.get(), size_t(rows) * V, stream);
  matmul(xq.get(), Transpose::N, wq.get(), Transpose::T, logits_ref.get(), rows, V, d, CUDA_R_16BF, stream,
         sc.x * sc.w);
  matmul(gq.get(), Transpose::N, wq.get(), Transpose::N, dx_ref.get(), rows, d, V, CUDA_R_16BF, stream,
         sc.grad * sc.w);
  matmul(gq_t.get(), Transpose::N, xq_t.get(), Transpose::T, dw_ref.get(), V, d, rows, CUDA_R_32F, stream,
         sc.grad * sc.x);
  std::vector<double> errors = {
      fast_path_error(to_double(logits.download()), to_double(logits_ref.download()), Fault::wrong_fp8_head),
      fast_path_error(to_double(dx.download()), to_double(dx_ref.download()), Fault::wrong_fp8_head),
      fast_path_error(to_double(dw.download()), to_double(dw_ref.download()), Fault::wrong_fp8_head)};
  if (!gradient) return errors;

  // The cast path on the same logits (it overwrites them): both e5m2 copies against the fused path's.
  const std::vector<double> fused = to_double(gq.download()), fused_t = to_double(gq_t.download());
  head.set_fused_gradient(false);
  head.loss_and_gradient(logits.get(), targets.get(), losses.get(), softcap, stream);
  fp8_to_bf16<Fp8Kind::e5m2>(op.g, gq.get(), size_t(rows) * V, stream);
  fp8_to_bf16<Fp8Kind::e5m2>(op.g_t, gq_t.get(), size_t(rows) * V, stream);
  errors.push_back(std::max(fast_path_error(fused, to_double(gq.download()), Fault::wrong_fused_e5m2_gradient),
                            fast_path_error(fused_t, to_double(gq_t.download()), Fault::wrong_fused_e5m2_gradient)));
  return errors;
}

// One Muon step of a shape group, batched against one matrix at a time, from equal states: the
// worst error of the parameters' updates and of the momenta.
inline double muon_error(int rows, int cols, int count, Matmul& matmul, cudaStream_t stream) {
  const size_t n = size_t(rows) * cols;
  const std::vector<float> p0 = random_f32(count * n, 0.02, 31), g = random_f32(count * n, 1.0, 32),
                           m0 = random_f32(count * n, 0.5, 33);
  const MuonStep step{0.05f, 0.95f, 0.125f};
  MuonWorkspace workspace(count * n, count);
  std::vector<double> updates[2], momenta[2];  // [batched, per matrix]
  for (int per_matrix = 0; per_matrix < 2; ++per_matrix) {
    DeviceBuffer<float> p(p0), grad(g), momentum(m0);
    std::vector<MuonMatrix> matrices;
    for (int i = 0; i < count; ++i) matrices.push_back({p.get() + i * n, grad.get() + i * n, momentum.get() + i * n});
    if (per_matrix) muon_update_each(matrices, rows, cols, step, workspace, matmul, stream);
    else muon_update(matrices, rows, cols, step, workspace, matmul, stream);
    const std::vector<float> after = p.download();
    for (size_t i = 0; i < after.size(); ++i) updates[per_matrix].push_back(double(after[i]) - double(p0[i]));
    momenta[per_matrix] = to_double(momentum.download());
  }
  return std::max(fast_path_error(updates[0], updates[1], Fault::wrong_batched_muon),
                  fast_path_error(momenta[0], momenta[1], Fault::wrong_batched_muon));
}

// y = x W^T + residual with the residual as cuBLASLt's C, against the product and then the add.
inline double residual_error(int rows, int n, int k, Matmul& matmul, cudaStream_t stream) {
  DeviceBuffer<bf16> x(random_bf16(size_t(rows) * k, 1.0, 41)), w(random_bf16(size_t(n) * k, 0.03, 42)),
      residual(random_bf16(size_t(rows) * n, 1.0, 43));
  std::vector<double> outputs[2];
  for (int separate = 0; separate < 2; ++separate) {
    DeviceBuffer<bf16> y(size_t(rows) * n);
    linear_with_residual(matmul, x.get(), w.get(), y.get(), rows, n, k, residual.get(), !separate, stream);
    outputs[separate] = to_double(y.download());
  }
  return fast_path_error(outputs[0], outputs[1], Fault::wrong_fused_residual_add);
}

// The results of checks that run together (one error each): an exception inside them (cuBLASLt
// refusing a layout on new hardware, say) fails them all with its message, instead of leaving
// this rank before the ranks' vote.
struct CheckSpec {
  std::string name;
  bool KernelPaths::*path;
  double bound;
};

template <class Errors>
void add_results(std::vector<SelfCheckResult>& results, const std::vector<CheckSpec>& specs, Errors errors) {
  std::vector<double> values;
  std::string failure;
  try {
    values = errors();
  } catch (const std::exception& e) {
    failure = e.what();
  }
  for (size_t i = 0; i < specs.size(); ++i)
    results.push_back({specs[i].name, specs[i].path,
                       failure.empty() ? values.at(i) : std::numeric_limits<double>::infinity(), specs[i].bound,
                       failure});
}

}  // namespace self_check

// Every fast path that `in_use` uses against its reference; one result per problem (a path the
// flags replaced already is not checked: its failure would change nothing). `tokens`
// ([attention_tokens]) gives the attention problems their document layout.
inline std::vector<SelfCheckResult> run_self_check(const SelfCheckShape& s, const KernelPaths& in_use,
                                                   const uint16_t* tokens, uint16_t bos, Matmul& matmul,
                                                   cudaStream_t stream) {
  using namespace self_check;
  std::vector<SelfCheckResult> results;
  if (in_use.flash_attention)
    for (int window : {1, 3, 14})
      add_results(results, {{"flash attention, window " + std::to_string(window), &KernelPaths::flash_attention,
                             kBf16PathsBound}},
                  [&] { return std::vector<double>{attention_error(s, tokens, bos, window, stream)}; });
  if (in_use.fp8_head) {
    std::vector<CheckSpec> specs = {{"FP8 head logits", &KernelPaths::fp8_head, kFp8ProductBound},
                                    {"FP8 head dx", &KernelPaths::fp8_head, kFp8ProductBound},
                                    {"FP8 head dW", &KernelPaths::fp8_head, kFp8WeightGradBound}};
    if (in_use.fused_e5m2_gradient)
      specs.push_back({"fused e5m2 gradient", &KernelPaths::fused_e5m2_gradient, kE5m2Bound});
    add_results(results, specs, [&] { return fp8_head_errors(s, in_use.fused_e5m2_gradient, matmul, stream); });
  }
  const int d = s.model_dim;
  if (in_use.batched_muon)
    for (int rows : {d, 4 * d}) {
      const int count = rows == d ? 3 : 2;  // a qkv weight's three, an MLP's two
      add_results(results, {{"batched Muon " + std::to_string(rows) + "x" + std::to_string(d),
                             &KernelPaths::batched_muon, kMuonBound}},
                  [&] { return std::vector<double>{muon_error(rows, d, count, matmul, stream)}; });
    }
  if (in_use.fused_residual_add)
    for (int k : {d, 4 * d})
      add_results(results, {{"residual as cuBLASLt's C, k = " + std::to_string(k), &KernelPaths::fused_residual_add,
                             kBf16PathsBound}},
                  [&] { return std::vector<double>{residual_error(s.residual_rows, d, k, matmul, stream)}; });
  return results;
}
// ===== end of kernels/self_check.cuh =====
// ===== kernels/sharding.h (inlined) =====
// The sharding planner of SPEC 4.3: which rank owns which part of which parameter.
// DistAdam: every parameter split on dim 0 into W equal slices (padded). Muon: matrices grouped by
// shape; member i of a group is owned by rank i % W, and chunk k holds members [kW, kW + W).
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

enum class OptimizerKind { adam, muon };

struct ParamInfo {
  std::string name;
  std::vector<int64_t> shape;
  OptimizerKind optimizer;
};

// Rank r owns rows [r * rows_per_rank, (r + 1) * rows_per_rank) of the padded parameter; the pad
// rows past `rows` exist only in communication buffers and are never read as data.
struct AdamShard {
  int param;                               // index into the planner's parameter list
  int64_t rows, row_elems, rows_per_rank;  // rows_per_rank = ceil(rows / world_size)
  int world_size;

  int64_t padded_rows() const { return rows_per_rank * world_size; }
  int64_t slice_elems() const { return rows_per_rank * row_elems; }
  int64_t first_row(int rank) const { return rank * rows_per_rank; }
  int64_t valid_rows(int rank) const {
    int64_t left = rows - first_row(rank);
    return left <= 0 ? 0 : left < rows_per_rank ? left : rows_per_rank;
  }
};

struct MuonChunk {
  std::vector<int> owner_param;  // [W]: the parameter rank r owns in this chunk, or -1 (scratch)
};

struct MuonGroup {
  std::vector<int64_t> shape;
  std::vector<int> params;  // members in parameter order
  std::vector<MuonChunk> chunks;
  int64_t matrix_elems() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

struct ShardPlan {
  int world_size = 1;
  std::vector<AdamShard> adam;  // Adam parameters in parameter order
  std::vector<MuonGroup> muon;  // groups in order of first appearance

  // Parameter indices, group by group and chunk by chunk: the order in which the owner updates them.
  std::vector<int> muon_params_owned_by(int rank) const {
    std::vector<int> owned;
    for (const MuonGroup& g : muon)
      for (const MuonChunk& c : g.chunks)
        if (c.owner_param.at(rank) >= 0) owned.push_back(c.owner_param[rank]);
    return owned;
  }
};

namespace sharding_detail {

inline void validate_param(const ParamInfo& p) {
  if (p.shape.empty()) throw std::invalid_argument("parameter '" + p.name + "' has no dimensions");
  for (int64_t d : p.shape)
    if (d <= 0) throw std::invalid_argument("parameter '" + p.name + "' has a dimension of size " + std::to_string(d));
  if (p.optimizer == OptimizerKind::muon && p.shape.size() < 2)
    throw std::invalid_argument("Muon parameter '" + p.name + "' must have at least 2 dimensions");
}

inline MuonGroup& muon_group_of(std::vector<MuonGroup>& groups, const std::vector<int64_t>& shape) {
  for (MuonGroup& g : groups)
    if (g.shape == shape) return g;
  groups.push_back({shape, {}, {}});
  return groups.back();
}

inline AdamShard adam_shard(int param, const std::vector<int64_t>& shape, int world_size) {
  int64_t rows = shape[0], row_elems = 1;  // a 1-D parameter is a column of single-element rows
  for (size_t d = 1; d < shape.size(); ++d) row_elems *= shape[d];
  return {param, rows, row_elems, (rows + world_size - 1) / world_size, world_size};
}

// Chunk k holds members [kW, kW + W); a rank past the group's end owns nothing (-1) in the last chunk.
inline std::vector<MuonChunk> muon_chunks(const std::vector<int>& members, int world_size) {
  std::vector<MuonChunk> chunks;
  for (size_t base = 0; base < members.size(); base += world_size) {
    MuonChunk chunk{std::vector<int>(world_size, -1)};
    for (int r = 0; r < world_size && base + r < members.size(); ++r) chunk.owner_param[r] = members[base + r];
    chunks.push_back(std::move(chunk));
  }
  return chunks;
}

}  // namespace sharding_detail

// world_size >= 1. A Muon parameter needs >= 2 dims, an Adam one >= 1; bad input throws
// std::invalid_argument naming the parameter.
inline ShardPlan plan_shards(const std::vector<ParamInfo>& params, int world_size) {
  using namespace sharding_detail;
  if (world_size < 1) throw std::invalid_argument("world size " + std::to_string(world_size) + " < 1");
  ShardPlan plan;
  plan.world_size = world_size;
  for (int p = 0; p < int(params.size()); ++p) {
    validate_param(params[p]);
    if (params[p].optimizer == OptimizerKind::muon) muon_group_of(plan.muon, params[p].shape).params.push_back(p);
    else plan.adam.push_back(adam_shard(p, params[p].shape, world_size));
  }
  for (MuonGroup& g : plan.muon) g.chunks = muon_chunks(g.params, world_size);
  return plan;
}
// ===== end of kernels/sharding.h =====
// ===== kernels/watchdog.h (inlined) =====
// A progress watchdog for distributed runs. A rank whose peer died or diverged waits inside an NCCL
// collective forever: no error, no exit, and a launcher that stops all ranks when one exits never
// learns of it. The trainer beats at every phase; when no beat comes for the timeout, the
// watchdog's thread reports the phase it stalled in, and end_stalled_rank ends the process with
// a distinct status, so the launcher (run.sh, torchrun, srun) stops the others.
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

// The exit status of a rank ended by end_stalled_rank: distinct from the trainer's 1 (error) and
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

// What a stalled rank writes last: every buffered line of the process (the console's, the run
// log's), so the step the rank reached is not lost with it.
inline void flush_all_output() {
  if (std::fflush(nullptr) != 0) std::perror("error: flushing output");
}

// The trainer's on_stall: says which rank stalled and where on stderr, flushes the output on a
// detached thread for at most `flush_deadline` (a pipe nobody reads could hold it), then ends the
// process with kStalledRankExitCode. It does not abort the communicator: ncclCommAbort makes the
// stuck collective return, and the main thread would go on with buffers no peer reduced (and could
// checkpoint them); the process's end stops its GPU work and closes NCCL's connections anyway.
// std::_Exit, not exit: the main thread is still inside a collective, and static destructors would
// wait on it or on CUDA.
[[noreturn]] inline void end_stalled_rank(int rank, const std::string& message,
                                          std::function<void()> finish_output = flush_all_output,
                                          std::chrono::milliseconds flush_deadline = std::chrono::seconds(10)) {
  std::fprintf(stderr, "error: rank %d: %s; exiting\n", rank, message.c_str());
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> finished = done->get_future();
  try {
    std::thread([done, finish = std::move(finish_output)] {
      finish();
      done->set_value();
    }).detach();
    if (finished.wait_for(flush_deadline) == std::future_status::timeout)
      std::fprintf(stderr, "error: rank %d: flushing the output did not end within %.1f s; exiting without it\n", rank,
                   flush_deadline.count() / 1000.0);
  } catch (const std::system_error& e) {
    std::fprintf(stderr, "error: rank %d: cannot start the thread that flushes the output: %s\n", rank, e.what());
  }
  std::_Exit(kStalledRankExitCode);
}
// ===== end of kernels/watchdog.h =====

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <variant>
#include <vector>

// ------------------------------------------------------------------------------------------------
// Hyperparameters (SPEC 1.8 and 4.1). Every field is a command-line flag of the same name with
// dashes: --num-iterations 860. The defaults are the 8xH100 record.
// ------------------------------------------------------------------------------------------------
struct Hyperparameters {
  // data
  std::string train_files = "data/fineweb10B/fineweb_train_*.bin";
  std::string val_files = "data/fineweb10B/fineweb_val_*.bin";
  int seq_len = 48 * 1024;          // T: tokens per micro-sequence
  int micro_batches = 8;            // M: micro-sequences per optimizer step (8 = the record's batch)
  int64_t val_tokens = 10485760;    // tokens of every validation
  int val_seq_len = 256 * 1024;     // tokens per validation sequence
  // schedule
  int num_iterations = 1770;
  double cooldown_frac = 0.4;       // lr decays linearly to 0.1 over the last 40% of steps
  int val_every = 125;              // 0: only at step 0 and at the end
  int warmup_steps = 10;            // untimed kernel warmup on real data, state restored after
  // optimizers
  double adam_lr = 0.008;
  double adam_beta1 = 0.8, adam_beta2 = 0.95, adam_eps = 1e-10;
  double embed_lr_mul = 75, head_lr_mul = 27.5, scalar_lr_mul = 5;
  double muon_lr = 0.05, muon_momentum = 0.95;
  int muon_momentum_warmup = 300;   // momentum 0.85 -> 0.95 over these steps
  std::string matrix_optimizer = "muon";  // the hidden matrices': muon or rekls (docs/REKLS.md)
  // REKLS: NVIDIA's defaults (legacy_soap/rekls.py) but the lr, which it leaves open: its update is
  // an Adam step in a rotated basis, so a little below Adam's 0.008 (docs/REKLS.md); untuned.
  double rekls_lr = 0.005, rekls_beta1 = 0.9, rekls_beta2 = 0.95, rekls_shampoo_beta = 0.95, rekls_eps = 1e-8;
  double rekls_weight_decay = 0.01;
  int rekls_eigenbasis_every = 1;   // steps between eigendecompositions (1: REKLS's every step)
  // run
  uint64_t seed = 0;                // 0: a fresh random seed, logged (record runs are independent)
  int checkpoint_every = 0;         // 0: a checkpoint at the end only
  std::string checkpoint_dir = "checkpoints";
  bool resume = false;              // continue from the newest checkpoint in checkpoint_dir
  bool resume_other_settings = false;  // resume although the checkpoint's run had other settings
  std::string log_dir = "logs";
  bool bf16_head = false;           // train with a bf16 lm_head instead of the FP8 one of SPEC 1.5
  std::string grad_comm = "fp32-rs"; // gradient traffic: fp32-rs, bf16-rs or a2a-fp32acc (SPEC 4.3)
  // Streaming DiLoCo across replica groups (kernels/diloco.cuh); 1 group: off
  int diloco_groups = 1;
  int diloco_fragments = 3;         // 12 blocks: 4 a fragment
  int diloco_sync_every = 30;       // H: each fragment syncs ~59 times in the record's 1770 steps
  int diloco_sync_delay = 0;
  double diloco_outer_lr = 0.7, diloco_outer_momentum = 0.9;  // the DiLoCo paper's outer Nesterov SGD
  double diloco_alpha = 0;
  std::string diloco_comm = "fp32";
  bool diloco_host_copies = false;
  // fast paths (kernels/self_check.cuh): each may be replaced by its simple reference
  std::string attention = "flash";     // flash or reference
  std::string fp8_gradient = "fused";  // fused or cast
  std::string muon = "batched";        // batched or per-matrix
  std::string residual_add = "fused";  // fused or separate
  std::string self_check = "fallback"; // fallback, strict or off
  bool self_check_only = false;        // run the self-check and exit
  int timeline_step = 0;            // > 0: write that step's GPU schedule as a Chrome trace into log_dir
  int stall_timeout = 600;          // seconds without progress after which a rank exits (0: never)
  bool nccl_single_rank = false;    // one rank through NCCL anyway (to measure what NCCL costs)
};

// ------------------------------------------------------------------------------------------------
// Command-line flags: one table binds each flag to its field; values are parsed strictly.
// ------------------------------------------------------------------------------------------------
struct FlagError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The exit statuses: one per kind of failure, so that a script or a launcher tells a bad command
// line from bad data, a machine without a usable GPU or unusable checkpoints. --help lists them.
enum ExitStatus : int {
  kExitRunFailed = 1,   // anything else: a non-finite loss, a CUDA or NCCL error, a failed rendezvous
  kExitBadFlags = 2,    // FlagError
  kExitBadData = 3,     // DataError
  kExitNoUsableGpu = 4, // NoUsableGpu
  kExitRunFiles = 5,    // RunFilesError
  kExitSelfCheckFailed = 6,  // SelfCheckFailed
};
const std::pair<int, const char*> kExitStatusMeanings[] = {
    {0, "the run finished"},
    {kExitRunFailed, "the run failed (a non-finite loss, a CUDA, NCCL or rendezvous error): the message says why"},
    {kExitBadFlags, "bad flags"},
    {kExitBadData, "bad data: a glob matching nothing, a damaged shard, a token id >= the vocabulary, too few tokens"},
    {kExitNoUsableGpu, "no usable GPU: no NVIDIA driver, no GPU, or a GPU that is not Hopper (sm_90)"},
    {kExitRunFiles, "run files: --checkpoint-dir or --log-dir not writable, or no checkpoint --resume can continue"},
    {kExitSelfCheckFailed, "--self-check strict (or --self-check-only): a fast path failed its start-up self-check"},
    {kStalledRankExitCode, "no progress for --stall-timeout seconds (e.g. a peer rank died)"},
};

struct Flag {
  std::string name;  // without the leading dashes
  std::variant<int*, int64_t*, uint64_t*, double*, std::string*, bool*> field;
  std::string help;
  std::function<bool()> valid;  // checked after parsing; nullptr: any value
  std::string requirement;      // what `valid` asks, for the error message
};

inline std::vector<Flag> flag_table(Hyperparameters& h) {
  auto positive = [](auto* v) { return [v] { return *v > 0; }; };
  auto non_negative = [](auto* v) { return [v] { return *v >= 0; }; };
  auto fraction = [](double* v) { return [v] { return *v > 0 && *v < 1; }; };
  auto one_of = [](std::string* v, std::vector<std::string> options) {
    return [v, options] { return std::find(options.begin(), options.end(), *v) != options.end(); };
  };
  return {
      {"train-files", &h.train_files, "glob of the training shards", nullptr, ""},
      {"val-files", &h.val_files, "glob of the validation shards", nullptr, ""},
      {"seq-len", &h.seq_len, "tokens per micro-sequence (T)",
       [&h] { return h.seq_len > 0 && h.seq_len % 128 == 0; }, "a positive multiple of 128"},
      {"micro-batches", &h.micro_batches, "micro-sequences per optimizer step (M; 8 = the record's batch)",
       positive(&h.micro_batches), "positive"},
      {"val-tokens", &h.val_tokens, "tokens of every validation", positive(&h.val_tokens), "positive"},
      {"val-seq-len", &h.val_seq_len, "tokens per validation sequence",
       [&h] { return h.val_seq_len > 0 && h.val_seq_len % 128 == 0; }, "a positive multiple of 128"},
      {"num-iterations", &h.num_iterations, "optimizer steps; every schedule scales with it",
       positive(&h.num_iterations), "positive"},
      {"cooldown-frac", &h.cooldown_frac, "fraction of steps with linearly decaying lr", fraction(&h.cooldown_frac),
       "in (0, 1)"},
      {"val-every", &h.val_every, "steps between validations (0: first and last step only)",
       non_negative(&h.val_every), "non-negative"},
      {"warmup-steps", &h.warmup_steps, "untimed warmup steps, state restored after",
       non_negative(&h.warmup_steps), "non-negative"},
      {"adam-lr", &h.adam_lr, "DistAdam base learning rate", positive(&h.adam_lr), "positive"},
      {"adam-beta1", &h.adam_beta1, "Adam beta1", fraction(&h.adam_beta1), "in (0, 1)"},
      {"adam-beta2", &h.adam_beta2, "Adam beta2", fraction(&h.adam_beta2), "in (0, 1)"},
      {"adam-eps", &h.adam_eps, "Adam epsilon", positive(&h.adam_eps), "positive"},
      {"embed-lr-mul", &h.embed_lr_mul, "lr multiplier of the embeddings", positive(&h.embed_lr_mul), "positive"},
      {"head-lr-mul", &h.head_lr_mul, "lr multiplier of lm_head", positive(&h.head_lr_mul), "positive"},
      {"scalar-lr-mul", &h.scalar_lr_mul, "lr multiplier of the scalars", positive(&h.scalar_lr_mul), "positive"},
      {"muon-lr", &h.muon_lr, "Muon learning rate", positive(&h.muon_lr), "positive"},
      {"muon-momentum", &h.muon_momentum, "Muon momentum after warmup", fraction(&h.muon_momentum), "in (0, 1)"},
      {"muon-momentum-warmup", &h.muon_momentum_warmup, "steps of Muon momentum warmup from 0.85",
       positive(&h.muon_momentum_warmup), "positive"},
      {"matrix-optimizer", &h.matrix_optimizer, "optimizer of the hidden matrices: muon or rekls (Adam keeps the rest)",
       one_of(&h.matrix_optimizer, {"muon", "rekls"}), "muon or rekls"},
      {"rekls-lr", &h.rekls_lr, "REKLS learning rate (the lr schedule applies)", positive(&h.rekls_lr), "positive"},
      {"rekls-beta1", &h.rekls_beta1, "REKLS inner Adam beta1", fraction(&h.rekls_beta1), "in (0, 1)"},
      {"rekls-beta2", &h.rekls_beta2, "REKLS inner Adam beta2", fraction(&h.rekls_beta2), "in (0, 1)"},
      {"rekls-shampoo-beta", &h.rekls_shampoo_beta, "REKLS Kronecker factors' moving average",
       fraction(&h.rekls_shampoo_beta), "in (0, 1)"},
      {"rekls-eps", &h.rekls_eps, "REKLS epsilon (Adam's and the factors' eigenvalue floor)", positive(&h.rekls_eps),
       "positive"},
      {"rekls-weight-decay", &h.rekls_weight_decay, "REKLS decoupled weight decay", non_negative(&h.rekls_weight_decay),
       "non-negative"},
      {"rekls-eigenbasis-every", &h.rekls_eigenbasis_every, "REKLS steps between eigendecompositions (1: every step)",
       positive(&h.rekls_eigenbasis_every), "positive"},
      {"seed", &h.seed, "initialisation seed (0: a fresh one per run, logged)", nullptr, ""},
      {"checkpoint-every", &h.checkpoint_every, "steps between checkpoints (0: at the end only)",
       non_negative(&h.checkpoint_every), "non-negative"},
      {"checkpoint-dir", &h.checkpoint_dir, "folder of the checkpoints", nullptr, ""},
      {"resume", &h.resume, "continue from the newest checkpoint in --checkpoint-dir", nullptr, ""},
      {"resume-other-settings", &h.resume_other_settings,
       "with --resume: accept a checkpoint written with other training settings (logged)", nullptr, ""},
      {"log-dir", &h.log_dir, "folder of the run logs", nullptr, ""},
      {"bf16-head", &h.bf16_head, "train with a bf16 lm_head instead of the FP8 one (SPEC 1.5)", nullptr, ""},
      {"grad-comm", &h.grad_comm, "gradient traffic: fp32-rs, bf16-rs or a2a-fp32acc",
       one_of(&h.grad_comm, {"fp32-rs", "bf16-rs", "a2a-fp32acc"}), "one of fp32-rs, bf16-rs, a2a-fp32acc"},
      {"diloco-groups", &h.diloco_groups,
       "Streaming DiLoCo over this many replica groups of consecutive ranks (1: off); must divide the ranks",
       positive(&h.diloco_groups), "positive"},
      {"diloco-fragments", &h.diloco_fragments,
       "DiLoCo fragments: consecutive blocks (the embeddings with the first, lm_head and scalars with the last)",
       positive(&h.diloco_fragments), "positive (at most the model's 12 blocks)"},
      {"diloco-sync-every", &h.diloco_sync_every, "DiLoCo: steps between two syncs of a fragment (H)",
       [&h] { return h.diloco_sync_every > 0 && h.diloco_sync_every % h.diloco_fragments == 0; },
       "a positive multiple of --diloco-fragments"},
      {"diloco-sync-delay", &h.diloco_sync_delay,
       "DiLoCo: steps a fragment's exchange overlaps before it is applied (d < H / F)",
       [&h] {
         return h.diloco_sync_delay >= 0 && h.diloco_fragments > 0 &&
                h.diloco_sync_delay < h.diloco_sync_every / h.diloco_fragments;
       },
       "in [0, --diloco-sync-every / --diloco-fragments)"},
      {"diloco-outer-lr", &h.diloco_outer_lr, "DiLoCo outer Nesterov SGD learning rate", positive(&h.diloco_outer_lr),
       "positive"},
      {"diloco-outer-momentum", &h.diloco_outer_momentum, "DiLoCo outer Nesterov momentum",
       [&h] { return h.diloco_outer_momentum >= 0 && h.diloco_outer_momentum < 1; }, "in [0, 1)"},
      {"diloco-alpha", &h.diloco_alpha, "DiLoCo mix: local = global + alpha (local - global) (0: the global copy)",
       [&h] { return h.diloco_alpha >= 0 && h.diloco_alpha <= 1; }, "in [0, 1]"},
      {"diloco-comm", &h.diloco_comm, "DiLoCo pseudo-gradient traffic across groups: fp32 or bf16",
       one_of(&h.diloco_comm, {"fp32", "bf16"}), "fp32 or bf16"},
      {"diloco-host-copies", &h.diloco_host_copies,
       "DiLoCo: the global copies and outer momentum in pinned host memory (read over PCIe at each sync)", nullptr, ""},
      {"attention", &h.attention, "attention kernels: flash (wgmma) or reference (warp per row; slower)",
       one_of(&h.attention, {"flash", "reference"}), "flash or reference"},
      {"fp8-gradient", &h.fp8_gradient,
       "FP8 head's gradient: fused (the cross-entropy writes e5m2) or cast (bf16, then a cast)",
       one_of(&h.fp8_gradient, {"fused", "cast"}), "fused or cast"},
      {"muon", &h.muon, "Newton-Schulz: batched (strided cuBLASLt batches) or per-matrix",
       one_of(&h.muon, {"batched", "per-matrix"}), "batched or per-matrix"},
      {"residual-add", &h.residual_add, "residual adds: fused (cuBLASLt's C) or separate (a matmul, then an add)",
       one_of(&h.residual_add, {"fused", "separate"}), "fused or separate"},
      {"self-check", &h.self_check,
       "check the fast paths at start-up: fallback (a failing one's reference), strict (exit 6), off",
       one_of(&h.self_check, {"fallback", "strict", "off"}), "fallback, strict or off"},
      {"self-check-only", &h.self_check_only, "run the self-check on this GPU, print it and exit (6: a check failed)",
       nullptr, ""},
      {"timeline-step", &h.timeline_step,
       "write that step's GPU schedule to <log-dir>/timeline_rank<r>_step<N>.json (0: none)",
       non_negative(&h.timeline_step), "non-negative"},
      {"stall-timeout", &h.stall_timeout,
       "seconds without progress (a hung collective) after which a rank exits 75 (0: never)",
       non_negative(&h.stall_timeout), "non-negative"},
      {"nccl-single-rank", &h.nccl_single_rank, "with one rank, communicate through NCCL anyway (measures its cost)",
       nullptr, ""},
  };
}

template <typename T>
T parse_number(const std::string& flag, const std::string& text) {
  T value{};
  const char* end = text.data() + text.size();
  std::from_chars_result r{};
  if constexpr (std::is_floating_point_v<T>) {
    // from_chars for double needs GCC 11; strtod with a full-consumption check is equivalent.
    char* stop = nullptr;
    errno = 0;
    value = std::strtod(text.c_str(), &stop);
    r = {stop, errno == ERANGE ? std::errc::result_out_of_range : std::errc()};
    if (text.empty()) r.ec = std::errc::invalid_argument;
  } else {
    r = std::from_chars(text.data(), end, value);
  }
  if (r.ec == std::errc::result_out_of_range && r.ptr == end) {
    std::string range = " (beyond a double's range)";
    if constexpr (!std::is_floating_point_v<T>)
      range = " (" + std::to_string(std::numeric_limits<T>::min()) + " to " +
              std::to_string(std::numeric_limits<T>::max()) + ")";
    throw FlagError("--" + flag + ": '" + text + "' is out of range" + range);
  }
  if (r.ec != std::errc() || r.ptr != end || text.empty())
    throw FlagError("--" + flag + ": '" + text + "' is not a valid " +
                    (std::is_floating_point_v<T> ? "number" : std::is_signed_v<T> ? "integer" : "non-negative integer"));
  return value;
}

// exact: numbers in the fewest digits that read back as the same double (else 6, for people).
inline std::string flag_value_text(const Flag& f, bool exact = false) {
  return std::visit(
      [exact](auto* p) -> std::string {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::string>) return *p;
        else if constexpr (std::is_same_v<T, bool>) return *p ? "true" : "false";
        else if constexpr (std::is_floating_point_v<T>) {
          char text[32];
          for (int digits = exact ? 15 : 6; digits <= 17; ++digits) {
            std::snprintf(text, sizeof text, "%.*g", digits, *p);
            if (!exact || std::strtod(text, nullptr) == *p) break;
          }
          return text;
        } else return std::to_string(*p);
      },
      f.field);
}

inline std::string usage(const std::string& program) {
  Hyperparameters defaults;
  std::ostringstream out;
  out << "usage: " << program << " [--flag value | --flag=value]...\n\nflags (default in brackets):\n";
  for (const Flag& f : flag_table(defaults)) {
    char line[256];
    std::snprintf(line, sizeof line, "  --%-22s %s [%s]\n", f.name.c_str(), f.help.c_str(), flag_value_text(f).c_str());
    out << line;
  }
  out << "  --help                   this text\n\nexit status:\n";
  for (const auto& [status, meaning] : kExitStatusMeanings) {
    char line[256];
    std::snprintf(line, sizeof line, "  %-3d %s\n", status, meaning);
    out << line;
  }
  return out.str();
}

// A word on the command line that is no flag. A shard's path there is most often a glob that the
// shell expanded: an unquoted `--train-files data/*.bin` gives the flag the first file and leaves
// the others here, so the message says to quote the pattern. after_value_of: the flag whose value
// the word before was ("" if none).
inline std::string unexpected_argument(const std::string& arg, const std::string& after_value_of) {
  const std::string message = "unexpected argument '" + arg + "' (flags start with --)";
  const bool glob_flag_before = after_value_of == "train-files" || after_value_of == "val-files";
  std::error_code error;
  const bool shard_like = (arg.size() > 4 && arg.compare(arg.size() - 4, 4, ".bin") == 0) ||
                          (glob_flag_before && std::filesystem::is_regular_file(arg, error));
  if (!shard_like) return message;
  const std::string flag = glob_flag_before ? after_value_of : "train-files";
  Hyperparameters defaults;
  return message + ": it looks like a shard, so the shell probably expanded an unquoted glob" +
         (glob_flag_before ? " after --" + flag : "") + "; quote the pattern, e.g. --" + flag + " '" +
         (flag == "val-files" ? defaults.val_files : defaults.train_files) + "'";
}

// Parses argv into h. Throws FlagError naming the flag for unknown flags, missing or malformed
// values and values outside their range. Returns false when --help was asked.
inline bool parse_flags(int argc, char** argv, Hyperparameters& h) {
  std::vector<Flag> flags = flag_table(h);
  std::string after_value_of;  // the flag whose value argv[i - 1] was
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return false;
    if (arg.rfind("--", 0) != 0) throw FlagError(unexpected_argument(arg, after_value_of));
    after_value_of.clear();
    std::string name = arg.substr(2), value;
    bool inline_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      inline_value = true;
    }
    auto flag = std::find_if(flags.begin(), flags.end(), [&](const Flag& f) { return f.name == name; });
    if (flag == flags.end()) throw FlagError("unknown flag --" + name + " (--help lists them)");
    if (std::holds_alternative<bool*>(flag->field)) {
      if (inline_value) throw FlagError("--" + name + " takes no value");
      *std::get<bool*>(flag->field) = true;
      continue;
    }
    if (!inline_value) {
      if (i + 1 >= argc) throw FlagError("--" + name + " needs a value");
      value = argv[++i];
      after_value_of = name;
    }
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, std::string>) *p = value;
          else if constexpr (!std::is_same_v<T, bool>) *p = parse_number<T>(name, value);
        },
        flag->field);
  }
  for (const Flag& f : flags)
    if (f.valid && !f.valid()) throw FlagError("--" + f.name + " = " + flag_value_text(f) + ": must be " + f.requirement);
  if (h.val_tokens % h.val_seq_len != 0)
    throw FlagError("--val-tokens " + std::to_string(h.val_tokens) + " is not a multiple of --val-seq-len " +
                    std::to_string(h.val_seq_len));
  if (h.timeline_step > h.num_iterations)
    throw FlagError("--timeline-step " + std::to_string(h.timeline_step) + " is past the run's last step " +
                    "(--num-iterations " + std::to_string(h.num_iterations) + "): no trace would be written");
  return true;
}

inline Schedule schedule_of(const Hyperparameters& h) {
  Schedule s;
  s.num_iterations = h.num_iterations;
  s.cooldown_frac = h.cooldown_frac;
  s.momentum_warmup_steps = h.muon_momentum_warmup;
  s.momentum_end = h.muon_momentum;
  return s;
}

// ------------------------------------------------------------------------------------------------
// Run log: logs/<run-id>.txt in the reference's layout (SPEC Part 2): the trainer's source, the
// environment, the parameters, then step lines that the reference's tools parse unchanged.
// ------------------------------------------------------------------------------------------------
// At an evaluation step s of N: the mean validation loss and the timed training so far.
inline std::string validation_line(int step, int num_iterations, double val_loss, double train_ms) {
  char line[160];
  std::snprintf(line, sizeof line, "step:%d/%d val_loss:%.4f train_time:%.0fms step_avg:%.2fms", step,
                num_iterations, val_loss, train_ms, train_ms / std::max(step, 1));
  return line;
}

// After training step s (1-based) of N.
inline std::string train_step_line(int step, int num_iterations, double train_ms) {
  char line[128];
  std::snprintf(line, sizeof line, "step:%d/%d train_time:%.0fms step_avg:%.2fms", step, num_iterations, train_ms,
                train_ms / std::max(step, 1));
  return line;
}

inline std::string peak_memory_line(size_t allocated_bytes, size_t reserved_bytes) {
  return "peak memory allocated: " + std::to_string(allocated_bytes >> 20) +
         " MiB reserved: " + std::to_string(reserved_bytes >> 20) + " MiB";
}

inline std::string new_run_id() {
  std::random_device entropy;
  char id[40];
  std::snprintf(id, sizeof id, "%08x-%04x-4%03x-%04x-%08x%04x", entropy(), entropy() & 0xffff, entropy() & 0xfff,
                0x8000 | (entropy() & 0x3fff), entropy(), entropy() & 0xffff);
  return id;
}

// The source this binary was built from: embedded by the build (CMake writes trainer_source.inc
// from train_gpt.cu and every header of kernels/ and data/); a frozen single-file record built by
// hand with nvcc has no such file and logs its own source file, read at start.
#if __has_include("trainer_source.inc")
#include "trainer_source.inc"  // static const char kTrainerSource[]
inline std::string trainer_source() { return kTrainerSource; }
#else
inline std::string trainer_source() {
  std::ifstream in(__FILE__, std::ios::binary);
  if (!in) return std::string("(source not embedded and ") + __FILE__ + " not readable)\n";
  return std::string(std::istreambuf_iterator<char>(in), {});
}
#endif

inline std::string command_output(const char* command) {
  std::string out;
  if (FILE* pipe = popen(command, "r")) {
    char buffer[4096];
    while (size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) out.append(buffer, n);
    pclose(pipe);
  }
  return out.empty() ? std::string("(") + command + ": no output)\n" : out;
}

inline std::string environment_report() {
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  int nccl = 0;
  ncclGetVersion(&nccl);
  std::ostringstream out;
  out << "Running CUDA driver " << driver / 1000 << "." << driver % 1000 / 10 << ", runtime " << runtime / 1000
      << "." << runtime % 1000 / 10 << ", cuBLASLt " << cublasLtGetVersion() << ", NCCL " << nccl << "\n";
  out << command_output("nvidia-smi 2>&1");
  return out.str();
}

const std::string kLogRule(100, '=');

// Rank 0's log file; every line also goes to the console.
class RunLog {
 public:
  RunLog(const std::string& dir, const std::string& run_id) : path_(dir + "/" + run_id + ".txt") {
    std::filesystem::create_directories(dir);
    file_.open(path_);
    if (!file_) throw std::runtime_error(path_ + ": cannot create the run log");
  }
  const std::string& path() const { return path_; }
  // The log's head: source, rule, environment, rule (as the reference).
  void header(const std::string& source, const std::string& environment) {
    file_ << source << (source.empty() || source.back() == '\n' ? "" : "\n") << kLogRule << "\n"
          << environment << kLogRule << "\n";
    file_.flush();
  }
  void line(const std::string& text, bool console = true) {
    file_ << text << "\n";
    file_.flush();
    if (console) std::printf("%s\n", text.c_str());
  }

 private:
  std::string path_;
  std::ofstream file_;
};

// ------------------------------------------------------------------------------------------------
// Checkpoints: named byte blobs (parameters, optimizer state, the flags that shaped them), each
// with a hash that catches a damaged file, in one file written to a temporary name and renamed, so
// a crash never leaves a torn checkpoint under the real name. The data position is the step.
// ------------------------------------------------------------------------------------------------
// The files a run writes or resumes from: a folder it cannot write, a checkpoint it cannot continue.
struct RunFilesError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct CheckpointError : RunFilesError {
  using RunFilesError::RunFilesError;
};

struct Checkpoint {
  int step = 0;
  std::vector<std::pair<std::string, std::vector<uint8_t>>> blobs;  // in writing order

  const std::vector<uint8_t>& blob(const std::string& name, const std::string& path) const {
    for (const auto& [n, bytes] : blobs)
      if (n == name) return bytes;
    throw CheckpointError(path + ": no '" + name + "' in the checkpoint");
  }
};

constexpr char kCheckpointMagic[8] = {'S', 'P', 'D', 'R', 'C', 'K', 'P', '2'};

// A 64-bit hash of bytes, 8 at a time (fast enough for gigabytes): catches damage, not forgery.
inline uint64_t checkpoint_hash(const std::vector<uint8_t>& bytes) {
  uint64_t h = 0x243F6A8885A308D3ull ^ bytes.size();
  auto mix = [&h](uint64_t word) {
    h = (h ^ word) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
  };
  size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    uint64_t word;
    std::memcpy(&word, bytes.data() + i, 8);
    mix(word);
  }
  uint64_t tail = 0;
  std::memcpy(&tail, bytes.data() + i, bytes.size() - i);
  mix(tail);
  return h;
}

inline std::string checkpoint_path(const std::string& dir, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%06d.ckpt", step);
  return dir + "/" + name;
}

// The bytes reach the disk (fsync) before the rename makes them the checkpoint of that step.
inline void write_checkpoint(const std::string& dir, const Checkpoint& c) {
  std::filesystem::create_directories(dir);
  std::string path = checkpoint_path(dir, c.step), temp = path + ".tmp";
  {
    std::unique_ptr<FILE, int (*)(FILE*)> out(std::fopen(temp.c_str(), "wb"), &std::fclose);
    if (!out) throw CheckpointError(temp + ": cannot create: " + std::strerror(errno));
    bool ok = true;
    auto put = [&](const void* p, size_t n) { ok = ok && std::fwrite(p, 1, n, out.get()) == n; };
    auto put_u64 = [&](uint64_t v) { put(&v, sizeof v); };
    put(kCheckpointMagic, sizeof kCheckpointMagic);
    put_u64(uint64_t(c.step));
    put_u64(c.blobs.size());
    for (const auto& [name, bytes] : c.blobs) {
      put_u64(name.size());
      put(name.data(), name.size());
      put_u64(bytes.size());
      put(bytes.data(), bytes.size());
      put_u64(checkpoint_hash(bytes));
    }
    if (!ok || std::fflush(out.get()) != 0 || ::fsync(::fileno(out.get())) != 0) {
      const std::string reason = std::strerror(errno);
      out.reset();
      std::filesystem::remove(temp);
      throw CheckpointError(temp + ": write failed: " + reason);
    }
  }
  std::filesystem::rename(temp, path);
  const int folder = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);  // the rename itself reaches the disk
  if (folder >= 0) ::fsync(folder), ::close(folder);
}

inline Checkpoint read_checkpoint(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CheckpointError(path + ": cannot open the checkpoint");
  auto get = [&](void* p, size_t n, const char* what) {
    if (!in.read(static_cast<char*>(p), std::streamsize(n)))
      throw CheckpointError(path + ": truncated checkpoint (while reading " + what + ")");
  };
  auto get_u64 = [&](const char* what) {
    uint64_t v;
    get(&v, sizeof v, what);
    return v;
  };
  char magic[sizeof kCheckpointMagic];
  get(magic, sizeof magic, "the magic");
  if (std::memcmp(magic, kCheckpointMagic, sizeof magic) != 0) throw CheckpointError(path + ": not a checkpoint (bad magic)");
  Checkpoint c;
  const uint64_t step = get_u64("the step");
  if (step > uint64_t(std::numeric_limits<int>::max())) throw CheckpointError(path + ": corrupt checkpoint (step " + std::to_string(step) + ")");
  c.step = int(step);
  uint64_t count = get_u64("the blob count");
  uint64_t file_size = std::filesystem::file_size(path);
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t name_size = get_u64("a name length");
    if (name_size > file_size) throw CheckpointError(path + ": corrupt checkpoint (name length " + std::to_string(name_size) + ")");
    std::string name(name_size, '\0');
    get(name.data(), name_size, "a name");
    uint64_t size = get_u64("a blob size");
    if (size > file_size) throw CheckpointError(path + ": truncated checkpoint ('" + name + "' claims " + std::to_string(size) + " bytes)");
    std::vector<uint8_t> bytes(size);
    get(bytes.data(), size, name.c_str());
    if (get_u64("a hash") != checkpoint_hash(bytes)) throw CheckpointError(path + ": '" + name + "' is damaged (its hash differs)");
    c.blobs.emplace_back(std::move(name), std::move(bytes));
  }
  if (in.peek() != std::char_traits<char>::eof()) throw CheckpointError(path + ": trailing bytes after the last blob");
  return c;
}

// The checkpoint of the highest step in dir (files named step_<digits>.ckpt), or "" when there is
// none. Temporary files of an interrupted write and other names are ignored.
inline std::string newest_checkpoint(const std::string& dir) {
  std::string newest;
  long long newest_step = -1;
  if (!std::filesystem::is_directory(dir)) return newest;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const size_t digits = name.size() - std::min(name.size(), sizeof "step_.ckpt" - 1);
    if (digits == 0 || digits > 9 || name.rfind("step_", 0) != 0 || name.compare(5 + digits, 5, ".ckpt") != 0 ||
        !std::all_of(name.begin() + 5, name.begin() + 5 + digits, [](char ch) { return ch >= '0' && ch <= '9'; }))
      continue;
    const long long step = std::stoll(name.substr(5, digits));
    if (step > newest_step) newest_step = step, newest = entry.path().string();
  }
  return newest;
}

// "name=value" lines, numbers exact, of the flags `keep` accepts by name.
inline std::string exact_flag_lines(Hyperparameters h, const std::function<bool(const std::string&)>& keep) {
  std::string lines;
  for (const Flag& f : flag_table(h))
    if (keep(f.name)) lines += f.name + "=" + flag_value_text(f, /*exact=*/true) + "\n";
  return lines;
}

// The flags a checkpoint's state depends on (the data, the batch, the schedules, the optimizers'
// settings, the head, the gradient traffic, DiLoCo's) and the world size, as "name=value" lines: a resumed
// run must have the same, or it would not continue the same run.
inline std::string resume_flags(const Hyperparameters& h, int world_size) {
  static const char* const names[] = {
      "train-files", "seq-len", "micro-batches", "num-iterations", "cooldown-frac", "adam-lr", "adam-beta1",
      "adam-beta2", "adam-eps", "embed-lr-mul", "head-lr-mul", "scalar-lr-mul", "muon-lr", "muon-momentum",
      "muon-momentum-warmup", "bf16-head", "grad-comm"};
  // DiLoCo's and REKLS's only where they are on, so that a checkpoint of a run without them reads as
  // before (where DiLoCo's copies live changes no state)
  const bool diloco = h.diloco_groups > 1, rekls = h.matrix_optimizer == "rekls";
  return "world-size=" + std::to_string(world_size) + "\n" + exact_flag_lines(h, [diloco, rekls](const std::string& name) {
           return std::find(std::begin(names), std::end(names), name) != std::end(names) ||
                  (diloco && name.rfind("diloco-", 0) == 0 && name != "diloco-host-copies") ||
                  (rekls && (name == "matrix-optimizer" || name.rfind("rekls-", 0) == 0));
         });
}

// "" when the checkpoint's flags equal this run's, else each difference.
inline std::string resume_flag_differences(const std::string& saved, const std::string& now) {
  auto parse = [](const std::string& text) {
    std::vector<std::pair<std::string, std::string>> values;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) {
      size_t eq = line.find('=');
      values.emplace_back(line.substr(0, eq), eq == std::string::npos ? "" : line.substr(eq + 1));
    }
    return values;
  };
  const auto before = parse(saved), after = parse(now);
  auto value_in = [](const auto& values, const std::string& name) {
    for (const auto& [n, v] : values)
      if (n == name) return v;
    return std::string("(none)");
  };
  std::string differences;
  for (const auto& [name, value] : after)
    if (value_in(before, name) != value)
      differences += "; --" + name + " was " + value_in(before, name) + ", is " + value;
  for (const auto& [name, value] : before)  // a setting only the checkpoint's run had (--matrix-optimizer rekls)
    if (value_in(after, name) == "(none)") differences += "; --" + name + " was " + value + ", is (none)";
  return differences.empty() ? "" : differences.substr(2);
}

// ------------------------------------------------------------------------------------------------
// Model shape and parameters (SPEC 1.1, 1.6). Matrices, lm_head and the scalars have fp32 masters
// (Muon and Adam update them) and bf16 copies the matmuls read; the embeddings are bf16 parameters
// as in the reference. Every gradient is an fp32 SUM over the step's micro-sequences (SPEC 4.2).
// ------------------------------------------------------------------------------------------------
struct GPTConfig {
  int num_layers = 12, model_dim = 768, num_heads = 6, vocab_size = 50304;
  uint16_t bos_token = kBosToken;
  int num_value_embeds = 3;
  // The record's layer pattern: layer 7 without attention, value embeddings 0,1,2 on the first and
  // last three layers, long (L) and short (S) windows L S S S L S S L S S S L.
  std::vector<bool> has_attention = {true, true, true, true, true, true, true, false, true, true, true, true};
  std::vector<int> value_embed = {0, 1, 2, -1, -1, -1, -1, -1, -1, 0, 1, 2};
  std::vector<bool> long_window = {true, false, false, false, true, false, false, true, false, false, false, true};

  int mlp_dim() const { return 4 * model_dim; }
  int num_skips() const { return num_layers / 2; }
  // scalars: [0:L) skip weights, [L:3L) block lambdas, [3L:5L) SA lambdas, ones to a multiple of 8.
  int num_scalars() const { return (5 * num_layers + 7) / 8 * 8; }
  int skip_weight_index(int i) const { return i; }
  int block_lambda_index(int layer, int k) const { return num_layers + 2 * layer + k; }
  int sa_lambda_index(int layer, int k) const { return 3 * num_layers + 2 * layer + k; }
  Softcap softcap() const { return Softcap::for_model_dim(model_dim); }

  void validate() const {
    if (model_dim != num_heads * kAttentionHeadDim)
      throw std::invalid_argument("model_dim " + std::to_string(model_dim) + " must be num_heads x 128");
    if (vocab_size % 128 != 0) throw std::invalid_argument("vocab_size must be a multiple of 128");
    if (int(has_attention.size()) != num_layers || int(value_embed.size()) != num_layers ||
        int(long_window.size()) != num_layers)
      throw std::invalid_argument("the layer pattern must have num_layers entries");
  }
};

enum class ParamKind { embed, value_embed, qkv, attn_proj, mlp_fc, mlp_proj, lm_head, scalars };

struct Param {
  std::string name;
  std::vector<int64_t> shape;
  ParamKind kind;
  int layer;       // the block, or the value-embedding table; -1 otherwise
  int64_t numel;
  size_t offset;   // into the embedding store (embeddings) or the master store (everything else)
  bool is_embedding() const { return kind == ParamKind::embed || kind == ParamKind::value_embed; }
};

// Module order (the reference's named_parameters order); storage groups Muon's shapes together.
inline std::vector<Param> parameter_list(const GPTConfig& c) {
  const int64_t V = c.vocab_size, d = c.model_dim, F = c.mlp_dim();
  std::vector<Param> list{{"embed.weight", {V, d}, ParamKind::embed, -1, V * d, 0}};
  for (int k = 0; k < c.num_value_embeds; ++k)
    list.push_back({"value_embeds." + std::to_string(k) + ".weight", {V, d}, ParamKind::value_embed, k, V * d, 0});
  for (int i = 0; i < c.num_layers; ++i) {
    std::string b = "blocks." + std::to_string(i) + ".";
    if (c.has_attention[i]) {
      list.push_back({b + "attn.qkv_w", {3, d, d}, ParamKind::qkv, i, 3 * d * d, 0});
      list.push_back({b + "attn.c_proj.weight", {d, d}, ParamKind::attn_proj, i, d * d, 0});
    }
    list.push_back({b + "mlp.c_fc.weight", {F, d}, ParamKind::mlp_fc, i, F * d, 0});
    list.push_back({b + "mlp.c_proj.weight", {d, F}, ParamKind::mlp_proj, i, d * F, 0});
  }
  list.push_back({"lm_head.weight", {V, d}, ParamKind::lm_head, -1, V * d, 0});
  list.push_back({"scalars", {c.num_scalars()}, ParamKind::scalars, -1, c.num_scalars(), 0});
  size_t embedding_end = 0, master_end = 0;
  for (ParamKind kind : {ParamKind::embed, ParamKind::value_embed, ParamKind::qkv, ParamKind::attn_proj,
                         ParamKind::mlp_fc, ParamKind::mlp_proj, ParamKind::lm_head, ParamKind::scalars})
    for (Param& p : list)
      if (p.kind == kind) {
        size_t& end = p.is_embedding() ? embedding_end : master_end;
        p.offset = end;
        end += size_t(p.numel);
      }
  return list;
}

// cudaMalloc that names the buffer and the size when the GPU is out of memory.
template <typename T>
T* device_alloc(const std::string& name, size_t count) {
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T));
  if (err != cudaSuccess) {
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    throw std::runtime_error("cannot allocate " + name + ": " + std::to_string(count * sizeof(T) >> 20) + " MiB (" +
                             cudaGetErrorString(err) + "; " + std::to_string(free_bytes >> 20) + " of " +
                             std::to_string(total_bytes >> 20) + " MiB free)");
  }
  return static_cast<T*>(p);
}

// Owns the device buffers it hands out.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() {
    for (void* p : owned_) cudaFree(p);
  }
  template <typename T>
  T* alloc(const std::string& name, size_t count) {
    T* p = device_alloc<T>(name, count);
    owned_.push_back(p);
    allocated_bytes_ += count * sizeof(T);
    return p;
  }
  size_t allocated_bytes() const { return allocated_bytes_; }

 private:
  std::vector<void*> owned_;
  size_t allocated_bytes_ = 0;
};

struct ParameterStore {
  std::vector<Param> list;
  size_t embedding_count = 0, master_count = 0;
  bf16* embeddings = nullptr;       // [embedding_count] bf16 parameters
  float* master = nullptr;          // [master_count] fp32 masters
  bf16* weights = nullptr;          // [master_count] bf16 copies of the masters (what the matmuls read)
  float* embedding_grads = nullptr; // [embedding_count]
  float* grads = nullptr;           // [master_count]

  ParameterStore(const GPTConfig& c, DeviceMemory& memory) : list(parameter_list(c)) {
    for (const Param& p : list) (p.is_embedding() ? embedding_count : master_count) += size_t(p.numel);
    embeddings = memory.alloc<bf16>("embedding parameters", embedding_count);
    master = memory.alloc<float>("fp32 master parameters", master_count);
    weights = memory.alloc<bf16>("bf16 weight copies", master_count);
    embedding_grads = memory.alloc<float>("embedding gradients", embedding_count);
    grads = memory.alloc<float>("gradients", master_count);
  }
  const Param& find(ParamKind kind, int layer) const {
    for (const Param& p : list)
      if (p.kind == kind && p.layer == layer) return p;
    throw std::logic_error("no parameter of this kind in layer " + std::to_string(layer));
  }
  const bf16* weight(ParamKind kind, int layer) const { return weights + find(kind, layer).offset; }
  float* grad(ParamKind kind, int layer) const { return grads + find(kind, layer).offset; }
  const bf16* embedding(int table) const {  // table -1: the token embedding, 0..2: value embeddings
    return embeddings + find(table < 0 ? ParamKind::embed : ParamKind::value_embed, table).offset;
  }
  float* embedding_grad(int table) const {
    return embedding_grads + find(table < 0 ? ParamKind::embed : ParamKind::value_embed, table).offset;
  }
  const float* scalars() const { return master + find(ParamKind::scalars, -1).offset; }
  float* scalar_grads() const { return grads + find(ParamKind::scalars, -1).offset; }

  void zero_grads(cudaStream_t stream) const {
    CUDA_CHECK(cudaMemsetAsync(embedding_grads, 0, embedding_count * sizeof(float), stream));
    CUDA_CHECK(cudaMemsetAsync(grads, 0, master_count * sizeof(float), stream));
  }
};

// After every optimizer step: the bf16 copies the next forward reads (weight.type_as(x)).
inline void refresh_weight_copies(const ParameterStore& s, cudaStream_t stream) {
  convert(s.master, s.weights, s.master_count, stream);
}

// SPEC 1.6 on the host from one seed: embeddings N(0, 1), qkv and c_fc U(+-sqrt(3) 0.5/sqrt(d)),
// projections and lm_head zero, scalars (skip 1, lambdas (1, 0), SA lambdas (0.5, 0.5), pad 1).
inline void initialize_parameters(const GPTConfig& c, const ParameterStore& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  float bound = float(std::sqrt(3.0) * 0.5 / std::sqrt(double(c.model_dim)));
  std::uniform_real_distribution<float> linear(-bound, bound);
  std::vector<bf16> embeddings(s.embedding_count);
  std::vector<float> master(s.master_count, 0.0f);
  for (const Param& p : s.list) {
    if (p.is_embedding()) {
      for (int64_t i = 0; i < p.numel; ++i) embeddings[p.offset + i] = __float2bfloat16(normal(rng));
    } else if (p.kind == ParamKind::qkv || p.kind == ParamKind::mlp_fc) {
      for (int64_t i = 0; i < p.numel; ++i) master[p.offset + i] = linear(rng);
    } else if (p.kind == ParamKind::scalars) {
      float* w = &master[p.offset];
      std::fill(w, w + p.numel, 1.0f);
      for (int i = 0; i < c.num_layers; ++i) {
        w[c.block_lambda_index(i, 1)] = 0.0f;
        w[c.sa_lambda_index(i, 0)] = w[c.sa_lambda_index(i, 1)] = 0.5f;
      }
    }
  }
  CUDA_CHECK(cudaMemcpy(s.embeddings, embeddings.data(), embeddings.size() * sizeof(bf16), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(s.master, master.data(), master.size() * sizeof(float), cudaMemcpyHostToDevice));
  refresh_weight_copies(s, 0);
}

// ------------------------------------------------------------------------------------------------
// Forward and backward of one micro-sequence (SPEC 1.2). Activations the backward needs are kept
// per layer; shapes are [T, d] unless noted (d = model_dim, F = 4d, H = heads, V = vocab).
// ------------------------------------------------------------------------------------------------
struct LayerActivations {
  bf16* x_in = nullptr;     // block input after the U-net skip
  bf16* x_mixed = nullptr;  // lambda0 x_in + lambda1 x0
  bf16* h_attn = nullptr;   // rmsnorm(x_mixed)
  bf16* qkv = nullptr;      // [T, 3d] raw projections
  bf16* q = nullptr;        // qk-norm + rope of q
  bf16* k = nullptr;
  bf16* v = nullptr;        // sa0 v_raw + sa1 ve
  bf16* y = nullptr;        // attention output
  float* lse = nullptr;     // [H, T] softmax statistics
  bf16* x_mid = nullptr;    // after the attention residual (x_mixed in layers without attention)
  bf16* h_mlp = nullptr;    // rmsnorm(x_mid)
  bf16* u = nullptr;        // [T, F] c_fc output
  bf16* a = nullptr;        // [T, F] relu(u)^2
  bf16* x_out = nullptr;    // block output
};

// Rows of logits materialised at once: the head and its loss run chunk by chunk, the backward of
// each chunk right after its loss, so the [T, V] logits never exist whole (4.9 GB at the record's
// T, 26 GB at the validation length).
constexpr int kHeadChunkRows = 8192;

struct Activations {
  int max_T;
  bool for_backward;           // false: evaluation, the layers share one set of buffers
  uint16_t *inputs, *targets;  // [T] device tokens
  bf16 *embedded, *x0;         // embed(tokens), rmsnorm of it
  bf16* value_embedded[3];     // ve_k(tokens)
  std::vector<LayerActivations> layers;
  bf16* x_final;               // rmsnorm(last block output)
  bf16* logits;                // [kHeadChunkRows, V], in place their gradient
  float* losses;               // [T]
  double* loss_total;          // [1] token losses summed since the last take_loss_total
  StagedUploads uploads;       // the device copies of each micro-sequence's masks and row order
  // backward scratch
  bf16 *dx, *dx0, *dh, *dy, *dq, *dk, *dv, *dqkv, *du;  // dqkv [T, 3d], du [T, F]
  std::vector<bf16*> dskip;    // [num_skips]: gradient waiting for the skip's source layer
  float* delta;                // [H, T]
  float* reduction_scratch;    // per-block partial sums of the scalar gradients
  float* cos_sin;              // [T, 64, 2] rope table
  std::unique_ptr<Fp8Head> fp8_head;  // the FP8 operands of one head chunk and of lm_head (or null)

  // fp8_head: training activations that also hold the FP8 head's operands (SPEC 1.5).
  Activations(const GPTConfig& c, int T, bool backward, DeviceMemory& m, bool fp8_head = false)
      : max_T(T), for_backward(backward), layers(c.num_layers), dskip(c.num_skips()) {
    const size_t td = size_t(T) * c.model_dim, tf = size_t(T) * c.mlp_dim();
    inputs = m.alloc<uint16_t>("input tokens", T);
    targets = m.alloc<uint16_t>("target tokens", T);
    embedded = m.alloc<bf16>("embedded tokens", td);
    x0 = m.alloc<bf16>("x0", td);
    for (int k = 0; k < c.num_value_embeds; ++k) value_embedded[k] = m.alloc<bf16>("value embedding " + std::to_string(k), td);
    for (int i = 0; i < c.num_layers; ++i) allocate_layer(c, i, T, m);
    x_final = m.alloc<bf16>("final norm", td);
    logits = m.alloc<bf16>("logits chunk", size_t(std::min(T, kHeadChunkRows)) * c.vocab_size);
    losses = m.alloc<float>("token losses", T);
    loss_total = m.alloc<double>("summed token losses", 1);
    CUDA_CHECK(cudaMemset(loss_total, 0, sizeof(double)));
    if (backward) {
      for (bf16** b : {&dx, &dx0, &dh, &dy, &dq, &dk, &dv}) *b = m.alloc<bf16>("backward scratch [T, d]", td);
      dqkv = m.alloc<bf16>("qkv gradient", 3 * td);
      du = m.alloc<bf16>("mlp gradient", tf);
      for (bf16*& b : dskip) b = m.alloc<bf16>("skip gradient", td);
      delta = m.alloc<float>("attention delta", size_t(T) * c.num_heads);
    }
    if (backward && fp8_head) this->fp8_head = std::make_unique<Fp8Head>(std::min(T, kHeadChunkRows), c.vocab_size, c.model_dim);
    reduction_scratch = m.alloc<float>("scalar-gradient partial sums", 2 * kScalarReductionBlocks);
    cos_sin = m.alloc<float>("rope table", size_t(T) * kRopeHeadDim);
    std::vector<float> table;
    rope_table_host(T, table);
    CUDA_CHECK(cudaMemcpy(cos_sin, table.data(), table.size() * sizeof(float), cudaMemcpyHostToDevice));
  }

 private:
  // Training keeps every layer's buffers for the backward; evaluation lets layers reuse the
  // previous layer's buffers, except the outputs the U-net skips read later.
  void allocate_layer(const GPTConfig& c, int i, int T, DeviceMemory& m) {
    const size_t td = size_t(T) * c.model_dim, tf = size_t(T) * c.mlp_dim();
    LayerActivations& l = layers[i];
    const bool reuse = !for_backward && i > 0;
    const LayerActivations* prev = i > 0 ? &layers[i - 1] : nullptr;
    std::string at = "layer " + std::to_string(i) + " ";
    auto buffer = [&](bf16* previous, const std::string& name, size_t n) {
      return reuse && previous ? previous : m.alloc<bf16>(at + name, n);
    };
    // Layers before the skips read the previous output unchanged: x_in aliases it.
    l.x_in = i == 0 ? x0 : i < c.num_skips() ? prev->x_out : buffer(i > c.num_skips() ? prev->x_in : nullptr, "x_in", td);
    l.x_mixed = buffer(prev ? prev->x_mixed : nullptr, "x_mixed", td);
    if (c.has_attention[i]) {
      const LayerActivations* with_attention = prev && prev->h_attn ? prev : (i > 1 ? &layers[i - 2] : nullptr);
      l.h_attn = buffer(with_attention ? with_attention->h_attn : nullptr, "h_attn", td);
      l.qkv = buffer(with_attention ? with_attention->qkv : nullptr, "qkv", 3 * td);
      l.q = buffer(with_attention ? with_attention->q : nullptr, "q", td);
      l.k = buffer(with_attention ? with_attention->k : nullptr, "k", td);
      l.v = buffer(with_attention ? with_attention->v : nullptr, "v", td);
      l.y = buffer(with_attention ? with_attention->y : nullptr, "attention output", td);
      l.lse = reuse && with_attention ? with_attention->lse : m.alloc<float>(at + "lse", size_t(T) * c.num_heads);
      l.x_mid = buffer(with_attention ? with_attention->x_mid : nullptr, "x_mid", td);
    } else {
      l.x_mid = l.x_mixed;
    }
    l.h_mlp = buffer(prev ? prev->h_mlp : nullptr, "h_mlp", td);
    l.u = buffer(prev ? prev->u : nullptr, "u", tf);
    l.a = buffer(prev ? prev->a : nullptr, "a", tf);
    // A skip source keeps its output; other layers may overwrite the previous non-source output.
    bool previous_is_source = i - 1 < c.num_skips();
    l.x_out = buffer(i > 0 && !previous_is_source ? prev->x_out : nullptr, "x_out", td);
  }
};

// What the host derives from one micro-sequence's tokens: the attention masks (document ids, long
// and short windows) and the position order of the embeddings' deterministic backward.
// Their device copies go through the activations' StagedUploads on the stream of the step, so
// building the next plan never waits for the GPU to drain.
struct MicroSequencePlan {
  std::optional<AttentionMask> long_window, short_window;
  std::optional<EmbeddingBackwardPlan> embedding_rows;
  MicroSequencePlan(const uint16_t* host_inputs, int T, const GPTConfig& c, int window_blocks, StagedUploads& uploads,
                    cudaStream_t stream) {
    std::vector<int32_t> docs = attention_document_ids(host_inputs, T, c.bos_token);
    AttentionBlockLists long_lists = build_attention_blocks(docs, window_blocks);
    AttentionBlockLists short_lists = build_attention_blocks(docs, window_blocks / 2);
    uploads.reset(AttentionMask::upload_bytes(docs, long_lists) + AttentionMask::upload_bytes(docs, short_lists) +
                  EmbeddingBackwardPlan::upload_bytes(T));
    long_window.emplace(docs, long_lists, uploads, stream);
    short_window.emplace(docs, short_lists, uploads, stream);
    embedding_rows.emplace(host_inputs, T, c.vocab_size, uploads, stream);
  }
};

// The model's step over a set of activations: training (forward, backward) or evaluation.
class GPT {
  GPTConfig c_;  // first: validated before params are laid out from it

 public:
  GPT(const GPTConfig& c, DeviceMemory& memory) : c_((c.validate(), c)), params(c_, memory) {}

  const GPTConfig& config() const { return c_; }

  // Told on the host as the backward is queued: after the head (num_layers), after each block i
  // (i), after the embeddings (-1). From that point of the stream on, the gradients of that part
  // and of everything after it in the network are complete for this micro-sequence.
  using GradientsDone = std::function<void(int layer)>;

  // One micro-sequence whose tokens are already in acts.inputs / acts.targets: token losses summed
  // into acts.loss_total and, with backward, its gradients SUMMED into the parameter gradients.
  void step(Activations& acts, int T, const MicroSequencePlan& plan, bool backward, bool fp8_head,
            cudaStream_t stream, const GradientsDone& gradients_done = {}) {
    if (T > acts.max_T || T % kAttentionBlock != 0)
      throw std::invalid_argument("micro-sequence length " + std::to_string(T) + " must be a multiple of 128 and <= " +
                                  std::to_string(acts.max_T));
    if (backward && !acts.for_backward) throw std::logic_error("a backward pass needs training activations");
    a_ = &acts;
    T_ = T;
    stream_ = stream;
    {
      TimelineSpan span(timeline_, "compute", "forward", stream);
      forward(plan);
    }
    {
      TimelineSpan span(timeline_, "compute", backward ? "head and its backward" : "head", stream);
      head(backward, fp8_head);
      accumulate_loss(acts.losses, T, acts.loss_total, stream);
    }
    if (!backward) return;
    gradients_done_ = gradients_done ? gradients_done : [](int) {};
    gradients_done_(c_.num_layers);
    this->backward(plan);
    gradients_done_ = [](int) {};  // the caller's hook may not outlive this call
  }

  // Spans of the forward, head and each block's backward go to this timeline (null: none).
  void set_timeline(Timeline* timeline) { timeline_ = timeline; }

  // The implementations of attention, the residual adds and the FP8 head's gradient (the FP8 head
  // itself is step's fp8_head): the fast ones unless a flag or the self-check replaced them.
  void set_paths(const KernelPaths& paths) { paths_ = paths; }

  ParameterStore params;

 private:
  size_t td() const { return size_t(T_) * c_.model_dim; }
  const float* scalar(int index) const { return params.scalars() + index; }
  float* scalar_grad(int index) const { return params.scalar_grads() + index; }
  const AttentionMask& mask(const MicroSequencePlan& m, int layer) const {
    return c_.long_window[layer] ? *m.long_window : *m.short_window;
  }
  AttentionTensors attention_shape() const {
    const int64_t d = c_.model_dim;
    return {T_, c_.num_heads, d, d, d};
  }
  // y[T, n] = x[T, k] W[n, k]^T (+ residual[T, n]), bf16 out
  void linear(const bf16* x, const bf16* w, bf16* y, int n, int k, const bf16* residual = nullptr) {
    if (residual) linear_with_residual(matmul_, x, w, y, T_, n, k, residual, paths_.fused_residual_add, stream_);
    else matmul_(x, Transpose::N, w, Transpose::T, y, T_, n, k, CUDA_R_16BF, stream_);
  }
  // For y = x W^T: dx[T, k] = dy[T, n] W[n, k] and dW[n, k] += dy^T x (fp32)
  void linear_backward(const bf16* x, const bf16* w, const bf16* dy, bf16* dx, float* dw, int n, int k) {
    matmul_(dy, Transpose::N, w, Transpose::N, dx, T_, k, n, CUDA_R_16BF, stream_);
    matmul_(dy, Transpose::T, x, Transpose::N, dw, n, k, T_, CUDA_R_32F, stream_, 1.0f, 1.0f);
  }

  void forward(const MicroSequencePlan& plan) {
    Activations& a = *a_;
    const int d = c_.model_dim;
    embedding_forward(a.inputs, params.embedding(-1), a.embedded, T_, d, stream_);
    rmsnorm_forward(a.embedded, a.x0, T_, d, stream_);
    for (int k = 0; k < c_.num_value_embeds; ++k)
      embedding_forward(a.inputs, params.embedding(k), a.value_embedded[k], T_, d, stream_);
    for (int i = 0; i < c_.num_layers; ++i) {
      LayerActivations& l = a.layers[i];
      if (i >= c_.num_skips()) {  // x_in = previous output + skip weight * the mirrored layer's output
        int from = c_.num_layers - 1 - i;
        weighted_sum_forward(a.layers[i - 1].x_out, nullptr, a.layers[from].x_out,
                             scalar(c_.skip_weight_index(i - c_.num_skips())), l.x_in, T_, d, d, stream_);
      }
      weighted_sum_forward(l.x_in, scalar(c_.block_lambda_index(i, 0)), a.x0, scalar(c_.block_lambda_index(i, 1)),
                           l.x_mixed, T_, d, d, stream_);
      if (c_.has_attention[i]) attention_forward_layer(i, plan);
      mlp_forward_layer(i);
    }
    rmsnorm_forward(a.layers.back().x_out, a.x_final, T_, d, stream_);
  }

  void attention_forward_layer(int i, const MicroSequencePlan& plan) {
    LayerActivations& l = a_->layers[i];
    const int d = c_.model_dim;
    rmsnorm_forward(l.x_mixed, l.h_attn, T_, d, stream_);
    linear(l.h_attn, params.weight(ParamKind::qkv, i), l.qkv, 3 * d, d);
    qk_norm_rope_forward(l.qkv, a_->cos_sin, l.q, l.k, T_, c_.num_heads, stream_);
    int table = c_.value_embed[i];
    weighted_sum_forward(l.qkv + 2 * d, scalar(c_.sa_lambda_index(i, 0)),
                         table >= 0 ? a_->value_embedded[table] : nullptr, scalar(c_.sa_lambda_index(i, 1)), l.v, T_,
                         d, 3 * d, stream_);
    auto forward = paths_.flash_attention ? flash_attention_forward : attention_forward;
    forward(l.q, l.k, l.v, l.y, l.lse, attention_shape(), mask(plan, i), stream_);
    linear(l.y, params.weight(ParamKind::attn_proj, i), l.x_mid, d, d, /*residual=*/l.x_mixed);
  }

  void mlp_forward_layer(int i) {
    LayerActivations& l = a_->layers[i];
    const int d = c_.model_dim, F = c_.mlp_dim();
    rmsnorm_forward(l.x_mid, l.h_mlp, T_, d, stream_);
    linear(l.h_mlp, params.weight(ParamKind::mlp_fc, i), l.u, F, d);
    relu_squared_forward(l.u, l.a, size_t(T_) * F, stream_);
    linear(l.a, params.weight(ParamKind::mlp_proj, i), l.x_out, d, F, /*residual=*/l.x_mid);
  }

  // Logits, softcapped cross-entropy and, for training, the head's backward, chunk by chunk:
  // dx_final (in a.dh) = dlogits W_head, dW_head += dlogits^T x_final. The FP8 head of SPEC 1.5
  // (quantised from the fp32 master) replaces the bf16 products when training with fp8_head;
  // evaluation is always bf16, as the reference.
  void head(bool backward, bool fp8_head) {
    Activations& a = *a_;
    const int d = c_.model_dim, V = c_.vocab_size;
    Fp8Head* fp8 = backward && fp8_head ? a.fp8_head.get() : nullptr;
    if (backward && fp8_head && !fp8) throw std::logic_error("FP8 head asked of activations built without it");
    const Param& head_param = params.find(ParamKind::lm_head, -1);
    if (fp8) {
      fp8->set_fused_gradient(paths_.fused_e5m2_gradient);
      fp8->quantize_weight(params.master + head_param.offset, stream_);
    }
    const bf16* w = params.weights + head_param.offset;
    float* dw = params.grads + head_param.offset;
    for (int r0 = 0; r0 < T_; r0 += kHeadChunkRows) {
      const int rows = std::min(kHeadChunkRows, T_ - r0);
      const bf16* x = a.x_final + size_t(r0) * d;  // [rows, d]
      bf16* dx = a.dh + size_t(r0) * d;            // [rows, d]
      if (fp8) {
        fp8->forward(x, a.logits, rows, matmul_, stream_);
        fp8->loss_and_gradient(a.logits, a.targets + r0, a.losses + r0, c_.softcap(), stream_);
        fp8->backward(dx, dw, matmul_, stream_);
        continue;
      }
      matmul_(x, Transpose::N, w, Transpose::T, a.logits, rows, V, d, CUDA_R_16BF, stream_);
      softcap_cross_entropy(a.logits, a.targets + r0, a.losses + r0, rows, V, backward ? 1.0f : 0.0f, stream_,
                            c_.softcap());
      if (!backward) continue;
      matmul_(a.logits, Transpose::N, w, Transpose::N, dx, rows, d, V, CUDA_R_16BF, stream_);
      matmul_(a.logits, Transpose::T, x, Transpose::N, dw, V, d, rows, CUDA_R_32F, stream_, 1.0f, 1.0f);
    }
  }

  void backward(const MicroSequencePlan& plan) {
    Activations& a = *a_;
    const int d = c_.model_dim;
    rmsnorm_backward(a.layers.back().x_out, a.dh, a.dx, T_, d, /*accumulate=*/false, stream_);
    CUDA_CHECK(cudaMemsetAsync(a.dx0, 0, td() * sizeof(bf16), stream_));
    for (int i = c_.num_layers - 1; i >= 0; --i) {
      TimelineSpan span(timeline_, "compute", "backward block " + std::to_string(i), stream_);
      LayerActivations& l = a.layers[i];
      if (i < c_.num_skips()) add_into(a.dskip[i], a.dx, td(), stream_);
      mlp_backward_layer(i);
      if (c_.has_attention[i]) attention_backward_layer(i, plan);
      // x_mixed = lambda0 x_in + lambda1 x0
      int l0 = c_.block_lambda_index(i, 0), l1 = c_.block_lambda_index(i, 1);
      weighted_sum_backward(a.dx, l.x_in, scalar(l0), scalar_grad(l0), a.x0, scalar(l1), scalar_grad(l1), a.dx, a.dx0,
                            /*accumulate_dy=*/true, T_, d, d, a.reduction_scratch, stream_);
      if (i >= c_.num_skips()) {  // x_in = previous output + w skip
        int from = c_.num_layers - 1 - i, w = c_.skip_weight_index(i - c_.num_skips());
        weighted_sum_backward(a.dx, nullptr, nullptr, nullptr, a.layers[from].x_out, scalar(w), scalar_grad(w), a.dx,
                              a.dskip[from], /*accumulate_dy=*/false, T_, d, d, a.reduction_scratch, stream_);
      }
      gradients_done_(i);
    }
    {
      TimelineSpan span(timeline_, "compute", "backward embedding", stream_);
      add_into(a.dx, a.dx0, td(), stream_);
      rmsnorm_backward(a.embedded, a.dx0, a.dh, T_, d, /*accumulate=*/false, stream_);
      embedding_backward(*plan.embedding_rows, a.dh, params.embedding_grad(-1), nullptr, d, stream_);
    }
    gradients_done_(-1);
  }

  void mlp_backward_layer(int i) {
    Activations& a = *a_;
    LayerActivations& l = a.layers[i];
    const int d = c_.model_dim, F = c_.mlp_dim();
    // x_out = x_mid + a W_proj^T: dx passes through to x_mid
    linear_backward(l.a, params.weight(ParamKind::mlp_proj, i), a.dx, a.du, params.grad(ParamKind::mlp_proj, i), d, F);
    relu_squared_backward(l.u, a.du, a.du, size_t(T_) * F, stream_);
    linear_backward(l.h_mlp, params.weight(ParamKind::mlp_fc, i), a.du, a.dh, params.grad(ParamKind::mlp_fc, i), F, d);
    rmsnorm_backward(l.x_mid, a.dh, a.dx, T_, d, /*accumulate=*/true, stream_);
  }

  void attention_backward_layer(int i, const MicroSequencePlan& plan) {
    Activations& a = *a_;
    LayerActivations& l = a.layers[i];
    const int d = c_.model_dim;
    linear_backward(l.y, params.weight(ParamKind::attn_proj, i), a.dx, a.dy, params.grad(ParamKind::attn_proj, i), d, d);
    auto backward = paths_.flash_attention ? flash_attention_backward : attention_backward;
    backward(l.q, l.k, l.v, l.y, a.dy, l.lse, a.delta, a.dq, a.dk, a.dv, attention_shape(), mask(plan, i), stream_);
    // v = sa0 v_raw + sa1 ve: dv_raw goes into the v third of dqkv; the ve table gets sa1 dv
    int table = c_.value_embed[i], s0 = c_.sa_lambda_index(i, 0), s1 = c_.sa_lambda_index(i, 1);
    const bf16* ve = table >= 0 ? a.value_embedded[table] : nullptr;
    weighted_sum_backward(a.dv, l.qkv + 2 * d, scalar(s0), scalar_grad(s0), ve, scalar(s1), ve ? scalar_grad(s1) : nullptr,
                          a.dqkv + 2 * d, nullptr, /*accumulate_dy=*/false, T_, d, 3 * d, a.reduction_scratch, stream_);
    if (ve) embedding_backward(*plan.embedding_rows, a.dv, params.embedding_grad(table), scalar(s1), d, stream_);
    qk_norm_rope_backward(l.qkv, a.dq, a.dk, a.cos_sin, a.dqkv, T_, c_.num_heads, stream_);
    linear_backward(l.h_attn, params.weight(ParamKind::qkv, i), a.dqkv, a.dh, params.grad(ParamKind::qkv, i), 3 * d, d);
    rmsnorm_backward(l.x_mixed, a.dh, a.dx, T_, d, /*accumulate=*/true, stream_);
  }

  Matmul matmul_;
  KernelPaths paths_;
  Activations* a_ = nullptr;
  int T_ = 0;
  cudaStream_t stream_ = nullptr;
  GradientsDone gradients_done_;
  Timeline* timeline_ = nullptr;
};

// ------------------------------------------------------------------------------------------------
// Optimizers (SPEC 1.9, 1.10, 1.11) over the sharding plan of SPEC 4.3, fed by reduce-scatter:
// rank r receives the SUMMED gradient of what it owns (a dim-0 slice of every Adam parameter, one
// matrix of every chunk of W Muon matrices), updates it, and all-gathers it back. The one
// normalisation, 1/M with M the global micro-sequence count (itself a SUM over ranks), happens in
// the updates (SPEC 4.2). With W = 1 every collective is the identity and the rank owns everything.
// ------------------------------------------------------------------------------------------------
inline bool is_muon_param(ParamKind kind) {
  return kind == ParamKind::qkv || kind == ParamKind::attn_proj || kind == ParamKind::mlp_fc ||
         kind == ParamKind::mlp_proj;
}

inline ShardPlan shard_plan_of(const std::vector<Param>& list, int world_size) {
  std::vector<ParamInfo> infos;
  for (const Param& p : list)
    infos.push_back({p.name, p.shape, is_muon_param(p.kind) ? OptimizerKind::muon : OptimizerKind::adam});
  return plan_shards(infos, world_size);
}

// The GPT::GradientsDone point after which p's gradient is complete in the last micro-sequence:
// a block's matrices after their block, lm_head after the head, everything else (the embeddings,
// the scalars that every block touches) at the end.
inline int gradient_complete_after(const Param& p, int num_layers) {
  if (is_muon_param(p.kind)) return p.layer;
  return p.kind == ParamKind::lm_head ? num_layers : -1;
}

inline int num_blocks_of(const std::vector<Param>& list) {
  int layers = 0;
  for (const Param& p : list)
    if (is_muon_param(p.kind)) layers = std::max(layers, p.layer + 1);
  return layers;
}

inline double adam_lr_multiplier(const Hyperparameters& h, ParamKind kind) {
  switch (kind) {
    case ParamKind::embed:
    case ParamKind::value_embed: return h.embed_lr_mul;
    case ParamKind::lm_head: return h.head_lr_mul;
    default: return h.scalar_lr_mul;
  }
}

// A device (or host) buffer that is part of the training state: saved in checkpoints, restored
// after warmup.
struct StateBuffer {
  std::string name;
  void* data;
  size_t bytes;
};

// The global micro-sequence count: the SUM of every rank's own count (the faults are the oracle's
// injected bugs: normalising by the local count, or summing a replicated count W times).
inline double global_micro_count(DeviceCommunicator& comm, int local_count, int global_batch) {
  switch (injected_fault()) {
    case Fault::local_count_normalization: return local_count;
    case Fault::replicated_count_per_rank: return comm.all_reduce_sum(global_batch);
    default: return comm.all_reduce_sum(local_count);
  }
}

// Both optimizers wait concurrently (SPEC 4.3): every reduction of both is issued first, on a
// communication stream, most of them while the backward still runs: a reduction goes out as soon
// as the backward of the step's last micro-sequence has passed the layers its gradients come from
// (GPT::GradientsDone), hidden under the backward of the earlier layers. Each update waits only
// for its own reduction, and its all-gather goes out on the communication stream as soon as it is
// done; one combined wait at the end orders the next forward after every gather. Every rank issues
// the collectives in one order (by completion point, then plan order), whatever its own number
// of micro-sequences, as NCCL requires.
//
// Per step: begin_step(local count), the backward with gradients_done as its hook, then step().
class Optimizers {
 public:
  Optimizers(const Hyperparameters& h, const ParameterStore& params, DeviceCommunicator& comm, DeviceMemory& memory)
      : h_(h), schedule_(schedule_of(h)), params_(params), comm_(comm), grad_comm_(parse_grad_comm(h.grad_comm)),
        plan_(shard_plan_of(params.list, comm.world_size())),
        muon_workspace_(largest_muon_batch_elems(), largest_muon_batch()), group_members_(plan_.muon.size()) {
    if (h.matrix_optimizer == "rekls") rekls_ = std::make_unique<Rekls>(matrix_shapes());
    for (const AdamShard& s : plan_.adam) add_adam(s, memory);
    for (const MuonGroup& g : plan_.muon)
      for (const MuonChunk& c : g.chunks) add_muon(g, c, memory);
    for (size_t i = 0; i < collectives_.size(); ++i) launch_order_.push_back(i);
    std::stable_sort(launch_order_.begin(), launch_order_.end(), [&](size_t a, size_t b) {
      return collectives_[a].complete_after > collectives_[b].complete_after;
    });
    for (size_t i : launch_order_)  // a group's members in launch order; its last one updates the group
      if (collectives_[i].group) group_members_[group_index(collectives_[i])].push_back(i);
    size_t largest = 0;
    for (const Collective& c : collectives_) largest = std::max(largest, c.share);
    traffic_ = memory.alloc<bf16>("bf16 gradient traffic scratch", 2 * size_t(comm.world_size()) * largest);
    CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&backward_point_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&gathered_, cudaEventDisableTiming));
    zero_state();
  }
  ~Optimizers() {
    for (Collective& c : collectives_) {
      cudaEventDestroy(c.reduced);
      cudaEventDestroy(c.updated);
    }
    cudaEventDestroy(backward_point_);
    cudaEventDestroy(gathered_);
    cudaStreamDestroy(comm_stream_);
  }
  Optimizers(const Optimizers&) = delete;  // the collectives refer into the plan
  Optimizers& operator=(const Optimizers&) = delete;

  void zero_state() {
    for (const StateBuffer& b : state_buffers())
      if (b.name != "adam steps") CUDA_CHECK(cudaMemset(b.data, 0, b.bytes));
    adam_steps_ = 0;
    if (!rekls_) return;
    for (const Collective& c : collectives_)  // REKLS's eigenbases start as the identity
      if (c.group && c.state_m) {
        const auto [rows, cols] = matrix_shape(*c.group);
        for (size_t k = 0; k < c.share / (size_t(rows) * cols); ++k)
          rekls_reset_state(static_cast<float*>(c.state_m) + k * ReklsBuffers::elems(rows, cols), rows, cols, 0);
      }
    CUDA_CHECK(cudaDeviceSynchronize());
  }

  // Before the step's backward: this rank will sum its gradients over local_micro_sequences; M,
  // the global count the updates normalise by, is their SUM over the ranks. Every rank's count is
  // the same in every step (the batch plan is fixed), so the host collective runs at the first
  // step only, on every rank alike.
  void begin_step(int local_micro_sequences) {
    if (local_count_ < 0) {
      local_count_ = local_micro_sequences;
      grad_scale_ = float(1.0 / global_micro_count(comm_, local_micro_sequences, h_.micro_batches));
      if (injected_fault() == Fault::prescale_by_world) grad_scale_ /= float(comm_.world_size());
    }
    if (local_micro_sequences != local_count_)
      throw std::logic_error("rank " + std::to_string(comm_.rank()) + " has " + std::to_string(local_micro_sequences) +
                             " micro-sequences in this step, " + std::to_string(local_count_) + " before");
    launched_ = 0;
    step_begun_ = true;
  }

  // The backward hook of the step's last micro-sequence: the reductions of every collective whose
  // gradients are complete at this point of `stream`.
  void gradients_done(int layer, cudaStream_t stream) {
    if (launched_ == launch_order_.size() || collectives_[launch_order_[launched_]].complete_after < layer) return;
    CUDA_CHECK(cudaEventRecord(backward_point_, stream));
    CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, backward_point_, 0));
    for (; launched_ < launch_order_.size(); ++launched_) {
      Collective& c = collectives_[launch_order_[launched_]];
      if (c.complete_after < layer) break;
      TimelineSpan span(timeline_, "communication", "reduce " + c.name, comm_stream_);
      reduce(c, comm_stream_);
      CUDA_CHECK(cudaEventRecord(c.reduced, comm_stream_));
    }
  }

  // Training step `step` (0-based) once the rank's backward is queued on `stream`: the remaining
  // reductions (all of them on a rank without micro-sequences), the updates, the gathers.
  void step(int step, cudaStream_t stream) {
    if (!step_begun_) throw std::logic_error("Optimizers::step without begin_step");
    step_begun_ = false;
    gradients_done(std::numeric_limits<int>::min(), stream);
    ++adam_steps_;
    for (size_t i : launch_order_) {
      Collective& c = collectives_[i];
      CUDA_CHECK(cudaStreamWaitEvent(stream, c.reduced, 0));
      // A Muon group updates once, its Newton-Schulz batched over all its matrices of this rank,
      // when its last reduction is in; every member's gather follows.
      if (c.group && group_members_[group_index(c)].back() != i) continue;
      {
        TimelineSpan span(timeline_, "compute", "update " + update_name(c), stream);
        if (c.adam) adam_update_share(c, step, grad_scale_, stream);
        else update_muon_group(group_index(c), step, grad_scale_, stream);
      }
      CUDA_CHECK(cudaEventRecord(c.updated, stream));
      CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, c.updated, 0));
      for (size_t m : c.group ? group_members_[group_index(c)] : std::vector<size_t>{i}) {
        const Collective& done = collectives_[m];
        TimelineSpan span(timeline_, "communication", "gather " + done.name, comm_stream_);
        if (!(done.chunk && injected_fault() == Fault::skip_all_gather)) gather(done, comm_stream_);
      }
    }
    CUDA_CHECK(cudaEventRecord(gathered_, comm_stream_));
    CUDA_CHECK(cudaStreamWaitEvent(stream, gathered_, 0));
    refresh_weight_copies(params_, stream);
  }

  // Spans of every reduction, update and gather go to this timeline (null: none).
  void set_timeline(Timeline* timeline) { timeline_ = timeline; }

  // Newton-Schulz over strided cuBLASLt batches (--muon batched) or one matrix at a time; the
  // self-check may replace the first by the second.
  void set_batched_muon(bool batched) { batched_muon_ = batched; }

  // This rank's optimizer state, in plan order (Adam slices, then owned Muon matrices).
  std::vector<StateBuffer> state_buffers() {
    std::vector<StateBuffer> state;
    for (const Collective& c : collectives_) {
      const std::string& name = params_.list[c.adam ? c.adam->param : c.chunk->owner_param[0]].name;
      if (c.adam) {
        size_t bytes = c.share * (c.bf16_param ? sizeof(bf16) : sizeof(float));
        state.push_back({"adam m " + name, c.state_m, bytes});
        state.push_back({"adam v " + name, c.state_v, bytes});
      } else if (c.state_m) {
        const std::string& mine = params_.list[c.chunk->owner_param[comm_.rank()]].name;
        state.push_back({(rekls_ ? "rekls state " : "muon momentum ") + mine, c.state_m, matrix_state_elems(c) * sizeof(float)});
      }
    }
    state.push_back({"adam steps", &adam_steps_, sizeof adam_steps_});
    return state;
  }

 private:
  // One reduce-scatter, update and all-gather of the plan: the dim-0 slices of an Adam parameter
  // or a chunk of W Muon matrices (consecutive in storage). Rank r owns share elements at
  // r * share of the W * share that the collectives move; where fewer than that exist (a padded
  // Adam parameter, the last chunk of a group) the item goes through its own zero-padded scratch.
  struct Collective {
    const AdamShard* adam = nullptr;  // an Adam parameter, or
    const MuonGroup* group = nullptr;  // a Muon chunk
    const MuonChunk* chunk = nullptr;
    float* local_grad = nullptr;  // [count] the rank's partial sums
    void* whole = nullptr;        // [count] the parameter(s): bf16 embeddings or fp32 masters
    bool bf16_param = false;
    size_t count = 0, share = 0;
    float* padded = nullptr;      // [W * share] when count < W * share
    void *state_m = nullptr, *state_v = nullptr;  // Adam m, v of the slice; Muon momentum of the owned matrix
    float* grad = nullptr;        // the rank's summed share, once reduced
    int complete_after = -1;      // the GPT::GradientsDone point after which its gradients are complete
    std::string name;             // the parameter, or the chunk's first matrix
    cudaEvent_t reduced = nullptr, updated = nullptr;
  };

  void add_collective(Collective c, DeviceMemory& memory, const std::string& name) {
    if (c.count < size_t(comm_.world_size()) * c.share)
      c.padded = memory.alloc<float>("padded collective of " + name, size_t(comm_.world_size()) * c.share);
    CUDA_CHECK(cudaEventCreateWithFlags(&c.reduced, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&c.updated, cudaEventDisableTiming));
    collectives_.push_back(c);
  }

  void add_adam(const AdamShard& s, DeviceMemory& memory) {
    const Param& p = params_.list[s.param];
    Collective c;
    c.adam = &s;
    c.bf16_param = p.is_embedding();
    c.local_grad = (c.bf16_param ? params_.embedding_grads : params_.grads) + p.offset;
    c.whole = c.bf16_param ? static_cast<void*>(params_.embeddings + p.offset) : static_cast<void*>(params_.master + p.offset);
    c.count = size_t(p.numel);
    c.share = size_t(s.slice_elems());
    c.complete_after = gradient_complete_after(p, num_blocks_of(params_.list));
    c.name = p.name;
    if (c.bf16_param) {  // state in the param's dtype, as the reference
      c.state_m = memory.alloc<bf16>("Adam m of " + p.name, c.share);
      c.state_v = memory.alloc<bf16>("Adam v of " + p.name, c.share);
    } else {
      c.state_m = memory.alloc<float>("Adam m of " + p.name, c.share);
      c.state_v = memory.alloc<float>("Adam v of " + p.name, c.share);
    }
    add_collective(c, memory, p.name);
  }

  void add_muon(const MuonGroup& g, const MuonChunk& chunk, DeviceMemory& memory) {
    const Param& first = params_.list[chunk.owner_param[0]];
    Collective c;
    c.group = &g;
    c.chunk = &chunk;
    c.share = size_t(g.matrix_elems());
    c.name = first.name + " chunk";
    c.complete_after = std::numeric_limits<int>::max();
    for (size_t r = 0; r < chunk.owner_param.size(); ++r) {
      const int param = chunk.owner_param[r];
      if (param < 0) continue;
      // The reduce-scatter and all-gather treat the chunk as one run of storage: rank r's slice.
      if (params_.list[param].offset != first.offset + r * c.share)
        throw std::logic_error("Muon chunk of " + first.name + ": " + params_.list[param].name +
                               " is not slice " + std::to_string(r) + " of the chunk's storage");
      c.count += c.share;
      c.complete_after = std::min(c.complete_after, gradient_complete_after(params_.list[param], 0));
    }
    c.local_grad = params_.grads + first.offset;
    c.whole = params_.master + first.offset;
    const int mine = chunk.owner_param[comm_.rank()];
    if (mine >= 0)
      c.state_m = memory.alloc<float>((rekls_ ? "REKLS state of " : "Muon momentum of ") + params_.list[mine].name,
                                      matrix_state_elems(c));
    add_collective(c, memory, first.name + " and its chunk");
  }

  // [rows, cols] of one matrix of group g (qkv_w [3, d, d] holds three).
  static std::pair<int, int> matrix_shape(const MuonGroup& g) {
    return {int(g.shape[g.shape.size() - 2]), int(g.shape.back())};
  }
  std::vector<std::pair<int, int>> matrix_shapes() const {
    std::vector<std::pair<int, int>> shapes;
    for (const MuonGroup& g : plan_.muon) shapes.push_back(matrix_shape(g));
    return shapes;
  }
  // The optimizer state of the owned matrices of a chunk: Muon's momentum, or REKLS's factors,
  // eigenbases and moments (ReklsBuffers) of each matrix.
  size_t matrix_state_elems(const Collective& c) const {
    if (!rekls_) return c.share;
    const auto [rows, cols] = matrix_shape(*c.group);
    return c.share / (size_t(rows) * cols) * ReklsBuffers::elems(rows, cols);
  }

  // One Newton-Schulz matrix [rows, cols] of a group: qkv_w [3, d, d] holds three.
  static int64_t newton_schulz_elems(const MuonGroup& g) {
    return g.shape[g.shape.size() - 2] * g.shape.back();
  }
  // The Newton-Schulz matrices this rank orthogonalises in group g.
  int muon_batch(const MuonGroup& g) const {
    int mine = 0;
    for (const MuonChunk& c : g.chunks) mine += c.owner_param[comm_.rank()] >= 0;
    return mine * int(g.matrix_elems() / newton_schulz_elems(g));
  }
  int largest_muon_batch() const {
    int largest = 0;
    for (const MuonGroup& g : plan_.muon) largest = std::max(largest, muon_batch(g));
    return largest;
  }
  size_t largest_muon_batch_elems() const {
    size_t largest = 0;
    for (const MuonGroup& g : plan_.muon) largest = std::max(largest, size_t(muon_batch(g)) * newton_schulz_elems(g));
    return largest;
  }
  size_t group_index(const Collective& c) const { return size_t(c.group - plan_.muon.data()); }
  std::string update_name(const Collective& c) const {
    return c.adam ? c.name : "Muon group of " + params_.list[c.group->params[0]].name;
  }

  // The rank's summed share lands in place, at send + rank * share.
  void reduce(Collective& c, cudaStream_t stream) {
    float* send = c.local_grad;
    if (c.padded) {
      send = c.padded;
      CUDA_CHECK(cudaMemsetAsync(send, 0, comm_.world_size() * c.share * sizeof(float), stream));
      CUDA_CHECK(cudaMemcpyAsync(send, c.local_grad, c.count * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    }
    c.grad = send + comm_.rank() * c.share;
    if (c.group && injected_fault() == Fault::local_matrix_gradient) return;  // the oracle's bug: no SUM
    reduce_scatter_grads(comm_, grad_comm_, send, c.grad, c.share, traffic_, stream);
  }

  // Every matrix of group `g` that this rank owns (one per chunk, at most), in one batched update.
  void update_muon_group(size_t g, int step, float grad_scale, cudaStream_t stream) {
    const MuonGroup& group = plan_.muon[g];
    const auto [rows, cols] = matrix_shape(group);
    const size_t n = size_t(newton_schulz_elems(group));
    const size_t state_elems = rekls_ ? ReklsBuffers::elems(rows, cols) : n;  // each matrix's
    std::vector<MuonMatrix> muon;
    std::vector<ReklsMatrix> rekls;
    for (size_t m : group_members_[g]) {
      const Collective& c = collectives_[m];
      if (!c.state_m) continue;  // no matrix of this chunk on this rank
      float* p = params_.master + params_.list[c.chunk->owner_param[comm_.rank()]].offset;
      for (size_t k = 0; k < c.share / n; ++k) {
        float* state = static_cast<float*>(c.state_m) + k * state_elems;
        if (rekls_) rekls.push_back({p + k * n, c.grad + k * n, state});
        else muon.push_back({p + k * n, c.grad + k * n, state});
      }
    }
    if (rekls_) {
      const ReklsSettings settings{float(h_.rekls_beta1), float(h_.rekls_beta2), float(h_.rekls_shampoo_beta),
                                   float(h_.rekls_eps), float(h_.rekls_weight_decay), h_.rekls_eigenbasis_every};
      const ReklsStep s{float(h_.rekls_lr * schedule_.lr_factor(step)), adam_steps_, grad_scale};
      rekls_->update(rekls, rows, cols, settings, s, matmul_, stream);
      return;
    }
    MuonStep s{float(h_.muon_lr * schedule_.lr_factor(step)), float(schedule_.muon_momentum(step)), grad_scale};
    (batched_muon_ ? muon_update : muon_update_each)(muon, rows, cols, s, muon_workspace_, matmul_, stream);
  }

  void adam_update_share(const Collective& c, int step, float grad_scale, cudaStream_t stream) {
    const int r = comm_.rank(), W = comm_.world_size();
    const int owner = injected_fault() == Fault::wrong_shard_offset ? (r + 1) % W : r;  // the oracle's bug
    // Rows of this rank's share that the parameter holds (the owner's, so that the bug stays in bounds).
    const int64_t valid = std::min(c.adam->valid_rows(r), c.adam->valid_rows(owner)) * c.adam->row_elems;
    if (valid <= 0) return;
    const ParamKind kind = params_.list[c.adam->param].kind;
    AdamStep s{float(h_.adam_lr * adam_lr_multiplier(h_, kind) * schedule_.lr_factor(step)), float(h_.adam_beta1),
               float(h_.adam_beta2), float(h_.adam_eps), adam_steps_, grad_scale};
    if (c.bf16_param)
      adam_update(static_cast<bf16*>(c.whole) + owner * c.share, c.grad, static_cast<bf16*>(c.state_m),
                  static_cast<bf16*>(c.state_v), valid, s, stream);
    else
      adam_update(static_cast<float*>(c.whole) + owner * c.share, c.grad, static_cast<float*>(c.state_m),
                  static_cast<float*>(c.state_v), valid, s, stream);
  }

  void gather(const Collective& c, cudaStream_t stream) {
    if (c.bf16_param) gather_as<bf16>(c, DeviceDType::bf16, stream);
    else gather_as<float>(c, DeviceDType::f32, stream);
  }

  // Every rank's share back into the whole parameter: in place, or through the padded scratch.
  template <typename T>
  void gather_as(const Collective& c, DeviceDType dtype, cudaStream_t stream) {
    T* whole = static_cast<T*>(c.whole);
    const size_t first = comm_.rank() * c.share;
    if (!c.padded) {
      comm_.all_gather(whole + first, whole, c.share, dtype, stream);
      return;
    }
    T* gathered = reinterpret_cast<T*>(c.padded);
    const size_t own_valid = first < c.count ? std::min(c.share, c.count - first) : 0;
    CUDA_CHECK(cudaMemcpyAsync(gathered + first, whole + first, own_valid * sizeof(T), cudaMemcpyDeviceToDevice, stream));
    comm_.all_gather(gathered + first, gathered, c.share, dtype, stream);
    CUDA_CHECK(cudaMemcpyAsync(whole, gathered, c.count * sizeof(T), cudaMemcpyDeviceToDevice, stream));
  }

  const Hyperparameters& h_;
  Schedule schedule_;
  const ParameterStore& params_;
  DeviceCommunicator& comm_;
  GradComm grad_comm_;
  ShardPlan plan_;
  MuonWorkspace muon_workspace_;
  std::unique_ptr<Rekls> rekls_;  // with --matrix-optimizer rekls: the hidden matrices' optimizer
  bool batched_muon_ = h_.muon == "batched";
  std::vector<std::vector<size_t>> group_members_;  // [Muon group] its collectives, in launch order
  Matmul matmul_;
  std::vector<Collective> collectives_;  // Adam parameters, then Muon chunks, in plan order
  std::vector<size_t> launch_order_;     // into collectives_: by completion point (the head's first)
  size_t launched_ = 0;                  // reductions of this step issued, in launch order
  bool step_begun_ = false;
  int local_count_ = -1;                 // this rank's micro-sequences per step (-1: no step yet)
  float grad_scale_ = 0;                 // 1 / M
  bf16* traffic_ = nullptr;              // [2 * W * largest share] bf16 gradient traffic (one reduction at a time)
  cudaStream_t comm_stream_ = nullptr;
  cudaEvent_t backward_point_ = nullptr, gathered_ = nullptr;
  int64_t adam_steps_ = 0;
  Timeline* timeline_ = nullptr;
};

// Whether the ranks agree on a value (at most 40 bits, so that W of them sum exactly in a double),
// decided alike on every rank: the value's SUM all-reduce equals W times the own value on every
// rank only when all are equal, and each rank's verdict is summed too. A rank that threw alone
// would leave the others waiting in a collective.
struct RankVote {
  bool stop;          // some rank differs: every rank stops
  bool mine_differs;  // this rank's value is off the mean
};
inline RankVote vote_across_ranks(DeviceCommunicator& comm, double value) {
  const bool differs = comm.all_reduce_sum(value) != value * comm.world_size();
  return {comm.all_reduce_sum(differs ? 1 : 0) > 0, differs};
}
inline double low_40_bits(uint64_t v) { return double(v & ((uint64_t(1) << 40) - 1)); }

// Rank consistency (SPEC 4.3): every rank must hold the same parameters (their word sums agree);
// every rank names the same first parameter that differs.
inline void check_rank_consistency(const ParameterStore& params, DeviceCommunicator& comm,
                                   unsigned long long* scratch, cudaStream_t stream) {
  for (const Param& p : params.list) {
    const void* data = p.is_embedding() ? static_cast<const void*>(params.embeddings + p.offset)
                                        : static_cast<const void*>(params.master + p.offset);
    const size_t bytes = p.numel * (p.is_embedding() ? 2 : 4);
    const RankVote vote = vote_across_ranks(comm, low_40_bits(device_word_sum(data, bytes, scratch, stream)));
    if (vote.stop)
      throw std::runtime_error("ranks disagree on parameter " + p.name + " (rank " + std::to_string(comm.rank()) +
                               (vote.mine_differs ? " differs from the mean)" : " agrees with the mean)"));
  }
}

// Every rank must run with the same flags, or their collectives would stop matching.
inline void check_same_flags(const Hyperparameters& h, DeviceCommunicator& comm) {
  const std::string text = exact_flag_lines(h, [](const std::string&) { return true; });
  if (vote_across_ranks(comm, low_40_bits(std::hash<std::string>{}(text))).stop)
    throw std::runtime_error("the ranks were started with different flags (rank " + std::to_string(comm.rank()) +
                             "'s: " + text.substr(0, text.size() - 1) + ")");
}

// ------------------------------------------------------------------------------------------------
// Training state: everything the rest of a run depends on, for checkpoints and the warmup restore.
// ------------------------------------------------------------------------------------------------
struct RunCounters {
  int step = 0;           // optimizer steps done
  double train_ms = 0;    // timed training so far
  uint64_t seed = 0;      // the initialisation seed (logged again on resume)
};

constexpr const char* kEmbeddingsBlob = "embeddings";  // every embedding parameter, bf16
constexpr const char* kMastersBlob = "masters";        // every other parameter's fp32 master

inline std::vector<StateBuffer> training_state(const ParameterStore& params, Optimizers& optimizers,
                                               RunCounters& counters) {
  std::vector<StateBuffer> state{{kEmbeddingsBlob, params.embeddings, params.embedding_count * sizeof(bf16)},
                                 {kMastersBlob, params.master, params.master_count * sizeof(float)}};
  for (const StateBuffer& b : optimizers.state_buffers()) state.push_back(b);
  state.push_back({"train_ms", &counters.train_ms, sizeof counters.train_ms});
  state.push_back({"seed", &counters.seed, sizeof counters.seed});
  return state;
}

inline DiLoCoSettings diloco_settings(const Hyperparameters& h) {
  DiLoCoSettings s;
  s.groups = h.diloco_groups;
  s.fragments = h.diloco_fragments;
  s.sync_every = h.diloco_sync_every;
  s.delay = h.diloco_sync_delay;
  s.outer_lr = h.diloco_outer_lr;
  s.outer_momentum = h.diloco_outer_momentum;
  s.alpha = h.diloco_alpha;
  s.bf16_exchange = h.diloco_comm == "bf16";
  s.host_copies = h.diloco_host_copies;
  return s;
}

// DiLoCo's fragments: blocks i * F / num_layers, the token and value embeddings with fragment 0
// (the input side), lm_head and the scalars with fragment F - 1; each in parameter order.
inline std::vector<std::vector<ParamStorage>> diloco_fragments(const ParameterStore& s, int fragments) {
  const int num_layers = num_blocks_of(s.list);
  std::vector<std::vector<ParamStorage>> list(static_cast<size_t>(fragments));
  for (const Param& p : s.list) {
    const int f = p.is_embedding() ? 0 : p.layer < 0 ? fragments - 1 : p.layer * fragments / num_layers;
    void* data = p.is_embedding() ? static_cast<void*>(s.embeddings + p.offset) : static_cast<void*>(s.master + p.offset);
    list[size_t(f)].push_back({data, p.is_embedding(), size_t(p.numel)});
  }
  return list;
}

constexpr const char* kRunFlagsBlob = "run flags";  // resume_flags of the run that wrote the checkpoint

// Where each parameter lies in the two parameter blobs, one "<name> <blob> <dtype> <offset> <count>"
// line each (offset and count in elements), so that a checkpoint is read parameter by parameter
// without this file: tools/compare_checkpoints.py compares the ranks of an NCCL run with W = 1.
constexpr const char* kParameterLayoutBlob = "parameter layout";
inline std::string parameter_layout(const std::vector<Param>& list) {
  std::string lines;
  for (const Param& p : list) {
    const std::string blob = p.is_embedding() ? std::string(kEmbeddingsBlob) + " bf16" : std::string(kMastersBlob) + " fp32";
    lines += p.name + " " + blob + " " + std::to_string(p.offset) + " " + std::to_string(p.numel) + "\n";
  }
  return lines;
}

inline Checkpoint capture_state(const std::vector<StateBuffer>& state, int step) {
  CUDA_CHECK(cudaDeviceSynchronize());
  Checkpoint c;
  c.step = step;
  for (const StateBuffer& b : state) {
    std::vector<uint8_t> bytes(b.bytes);
    CUDA_CHECK(cudaMemcpy(bytes.data(), b.data, b.bytes, cudaMemcpyDefault));
    c.blobs.emplace_back(b.name, std::move(bytes));
  }
  return c;
}

// path names the checkpoint in errors ("" for the in-memory warmup snapshot).
inline void restore_state(const Checkpoint& c, const std::string& path, const std::vector<StateBuffer>& state,
                          const ParameterStore& params) {
  for (const StateBuffer& b : state) {
    const std::vector<uint8_t>& bytes = c.blob(b.name, path);
    if (bytes.size() != b.bytes)
      throw CheckpointError(path + ": '" + b.name + "' holds " + std::to_string(bytes.size()) + " bytes, this model needs " +
                            std::to_string(b.bytes) + " (a checkpoint of another configuration?)");
    CUDA_CHECK(cudaMemcpy(b.data, bytes.data(), b.bytes, cudaMemcpyDefault));
  }
  refresh_weight_copies(params, 0);
  CUDA_CHECK(cudaDeviceSynchronize());
}

// ------------------------------------------------------------------------------------------------
// The run: warmup, then steps with validation, logging and checkpoints (SPEC 1.8, 1.11, Part 2).
// ------------------------------------------------------------------------------------------------
// Copies one micro-sequence's tokens [T + 1] to the device: inputs [0, T), targets [1, T + 1).
inline void upload_micro_sequence(Activations& acts, const uint16_t* tokens, int T, cudaStream_t stream) {
  CUDA_CHECK(cudaMemcpyAsync(acts.inputs, tokens, T * sizeof(uint16_t), cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(acts.targets, tokens + 1, T * sizeof(uint16_t), cudaMemcpyHostToDevice, stream));
}

// The token losses summed over the micro-sequences since the last call: waits for the stream,
// so after a training step it also marks the end of the step's GPU work.
inline double take_loss_total(const Activations& acts, cudaStream_t stream) {
  double total = 0;
  CUDA_CHECK(cudaMemcpyAsync(&total, acts.loss_total, sizeof total, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaMemsetAsync(acts.loss_total, 0, sizeof(double), stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return total;
}

// The mean token loss over all ranks: the loss sums and the token counts are both SUMMED (a rank
// may have no micro-sequence when W > M).
inline double mean_over_ranks(DeviceCommunicator& comm, double loss_sum, double tokens) {
  const double all_losses = comm.all_reduce_sum(loss_sum);  // in this order on every rank
  return all_losses / comm.all_reduce_sum(tokens);
}

// Mean validation token loss with the window of the current step: each rank sums the token losses
// and counts of its sequences; both sums are SUM-reduced, the mean is their ratio (SPEC 4.2).
inline double validate(GPT& model, Activations& eval, const ValidationPlan& val, int window_blocks,
                       DeviceCommunicator& comm, cudaStream_t stream) {
  double tokens = 0;
  const int T = int(val.seq_len());
  for (int64_t s : val.sequences_of_rank(comm.rank(), comm.world_size())) {
    upload_micro_sequence(eval, val.sequence(s), T, stream);
    MicroSequencePlan plan(val.sequence(s), T, model.config(), window_blocks, eval.uploads, stream);
    model.step(eval, T, plan, /*backward=*/false, /*fp8_head=*/false, stream);
    tokens += T;
  }
  return mean_over_ranks(comm, take_loss_total(eval, stream), tokens);
}

// Forward+backward of the rank's micro-sequences, gradients SUMMED into the parameter gradients
// (zeroed first), token losses summed into acts.loss_total.
// The last micro-sequence's backward tells last_backward_done where gradients are complete.
inline void accumulate_gradients(GPT& model, Activations& acts, const RankBatch& batch, int window_blocks,
                                 bool fp8_head, cudaStream_t stream, const GPT::GradientsDone& last_backward_done = {}) {
  const int T = int(batch.micro_len);
  model.params.zero_grads(stream);
  for (int j = 0; j < batch.num_micro; ++j) {
    const uint16_t* tokens = batch.tokens + size_t(j) * (T + 1);
    upload_micro_sequence(acts, tokens, T, stream);
    MicroSequencePlan plan(tokens, T, model.config(), window_blocks, acts.uploads, stream);
    model.step(acts, T, plan, /*backward=*/true, fp8_head, stream,
               j + 1 == batch.num_micro ? last_backward_done : GPT::GradientsDone{});
  }
}

// One optimizer step (SPEC 1.11): gradients, then both optimizers. Returns this rank's summed
// token losses, read after the step's GPU work is done.
inline double train_step(GPT& model, Activations& acts, Optimizers& optimizers, const RankBatch& batch, int step,
                         const Schedule& schedule, bool fp8_head, cudaStream_t stream) {
  optimizers.begin_step(batch.num_micro);
  accumulate_gradients(model, acts, batch, schedule.window_blocks(step), fp8_head, stream,
                       [&](int layer) { optimizers.gradients_done(layer, stream); });
  optimizers.step(step, stream);
  return take_loss_total(acts, stream);
}

// The batch plan of a data flag's glob (its constructor throws only when the glob matches nothing).
// A glob left at the flag's default says so: --train-files alone leaves --val-files at FineWeb's.
inline BatchPlan data_plan(const std::string& flag, const std::string& pattern, int64_t micro_len, int micro_count) {
  try {
    return BatchPlan(pattern, micro_len, micro_count, kTokenizerVocab);
  } catch (const DataError& e) {
    const Hyperparameters defaults;
    if (pattern != (flag == "val-files" ? defaults.val_files : defaults.train_files)) throw;
    throw DataError(std::string(e.what()) + ", the default of --" + flag +
                    (flag == "val-files" ? ", which --train-files does not change: pass --val-files "
                                           "'<glob of your validation shards>'"
                                         : ": fetch FineWeb (python3 data/download_fineweb.py 8) or pass --train-files "
                                           "'<glob of your training shards>'"));
  }
}

// Before any GPU work, from every shard of both globs: headers, sizes and every token id; enough
// training windows for the run and its warmup, and a first validation shard that holds the
// validation tokens.
inline void check_data(const Hyperparameters& h) {
  const BatchPlan train = data_plan("train-files", h.train_files, h.seq_len, h.micro_batches);
  const int64_t windows = train.windows_available();
  const bool warmup_longer = h.warmup_steps > h.num_iterations;
  const int64_t needed = warmup_longer ? h.warmup_steps : h.num_iterations;
  if (windows < needed)
    throw DataError("the files matching '" + h.train_files + "' give " + std::to_string(windows) + " steps of " +
                    std::to_string(h.micro_batches) + " x " + std::to_string(h.seq_len) + " tokens; the run needs " +
                    std::to_string(needed) +
                    (warmup_longer ? " for its --warmup-steps (warmup trains on the first steps' batches): lower "
                                     "--warmup-steps"
                                   : " (fetch more shards, or shorten --num-iterations)"));
  const BatchPlan val = data_plan("val-files", h.val_files, h.val_seq_len, int(h.val_tokens / h.val_seq_len));
  val.windows_available();
  train.scan_all_tokens();
  val.scan_all_tokens();
}

// A folder the run will write into: created, and a file written and removed, now.
inline void check_writable(const std::string& dir, const std::string& what) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  const std::string probe = dir + "/.write_probe";
  if (error || !std::ofstream(probe) || !std::filesystem::remove(probe, error))
    throw RunFilesError(dir + ": cannot write " + what + " there (" + (error ? error.message() : std::strerror(errno)) +
                        ")");
}

inline PrefetchLoader training_loader(const Hyperparameters& h, int start_step, int rank, int world_size) {
  BatchPlan plan(h.train_files, h.seq_len, h.micro_batches, kTokenizerVocab);
  for (int s = 0; s < start_step; ++s) plan.next();  // resume: the windows already trained on
  return PrefetchLoader(std::move(plan), rank, world_size, /*depth=*/2,
                        [](size_t bytes) {
                          void* p = nullptr;
                          return cudaHostAlloc(&p, bytes, cudaHostAllocDefault) == cudaSuccess ? p : nullptr;
                        },
                        [](void* p) { cudaFreeHost(p); });
}

inline uint64_t fresh_seed() {
  std::random_device entropy;
  return (uint64_t(entropy()) << 32 | entropy()) | 1;  // never 0, which means "pick one"
}

// Model FLOPs per token of one training step (6 N for the matmuls; attention is left out, so
// MFU is a lower bound), for the console's MFU.
inline double training_flops_per_token(const std::vector<Param>& params) {
  double matmul_params = 0;
  for (const Param& p : params)
    if (!p.is_embedding() && p.kind != ParamKind::scalars) matmul_params += double(p.numel);
  return 6 * matmul_params;
}

inline void log_parameters(RunLog& log, const Hyperparameters& h, const std::vector<Param>& params) {
  int64_t total = 0, embeddings = 0;
  for (const Param& p : params) {
    std::string shape;
    for (int64_t d : p.shape) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
    double lr_mul = is_muon_param(p.kind) ? 1.0 : adam_lr_multiplier(h, p.kind);
    char line[256];
    std::snprintf(line, sizeof line, "%s: [%s] %s wd_mul=0.0 lr_mul=%g", p.name.c_str(), shape.c_str(),
                  p.is_embedding() ? "bfloat16" : "float32", lr_mul);
    log.line(line, /*console=*/false);
    total += p.numel;
    embeddings += p.is_embedding() ? p.numel : 0;
  }
  log.line("parameters: " + std::to_string(total) + " total, " + std::to_string(embeddings) + " embedding, " +
           std::to_string(total - embeddings) + " non-embedding");
}

constexpr double kH100DenseBf16Flops = 989e12;  // H100 SXM dense bf16 tensor-core peak (datasheet)

inline std::string console_step_line(const std::string& log_line, double loss, double step_ms, int tokens_per_step,
                                     double flops_per_token, int steps_left) {
  char extra[160];
  double tokens_per_s = tokens_per_step / (step_ms / 1000);
  std::snprintf(extra, sizeof extra, " loss:%.4f tok/s:%.0f mfu:%.1f%% eta:%.1fmin", loss, tokens_per_s,
                100 * tokens_per_s * flops_per_token / kH100DenseBf16Flops, steps_left * step_ms / 60000);
  return log_line + extra;
}

// This process's communicator: alone, or rank g.rank of an NCCL world whose id came over TCP from
// rank 0 (a world of one with nccl_single_rank).
inline std::unique_ptr<DeviceCommunicator> connect_ranks(const ProcessGroupEnv& g, bool nccl_single_rank) {
  ncclUniqueId id{};
  if (g.world_size == 1) {
    if (!nccl_single_rank) return std::make_unique<SingleRankCommunicator>();
    NCCL_CHECK(ncclGetUniqueId(&id));
    return std::make_unique<NcclCommunicator>(0, 1, id);
  }
  if (g.rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
  UniqueIdBytes bytes;
  static_assert(sizeof id == sizeof bytes, "NCCL's unique id is 128 bytes");
  std::memcpy(bytes.data(), &id, sizeof id);
  broadcast_id_over_tcp(g, bytes, std::chrono::seconds(300));
  std::memcpy(&id, bytes.data(), sizeof id);
  return std::make_unique<NcclCommunicator>(g.rank, g.world_size, id);
}

// With W > 1 every rank keeps its own optimizer shards: rank r's checkpoints go to <dir>/rank<r>.
inline std::string rank_checkpoint_dir(const Hyperparameters& h, const ProcessGroupEnv& g) {
  return g.world_size == 1 ? h.checkpoint_dir : h.checkpoint_dir + "/rank" + std::to_string(g.rank);
}

// Before the GPU: the folders this rank writes into (its checkpoints; the run log on rank 0, the
// timeline on every rank that writes one).
inline void check_output_folders(const Hyperparameters& h, const ProcessGroupEnv& g) {
  check_writable(rank_checkpoint_dir(h, g), "checkpoints");
  if (g.rank == 0 || h.timeline_step > 0) check_writable(h.log_dir, "the run's logs");
}

// Throws for a checkpoint this run cannot continue; returns how the settings differ ("" if not).
inline std::string settings_differences(const Hyperparameters& h, int world_size, const Checkpoint& c,
                                        const std::string& path) {
  if (std::filesystem::path(path).filename() != std::filesystem::path(checkpoint_path("", c.step)).filename())
    throw CheckpointError(path + ": holds step " + std::to_string(c.step) + ", not the step of its name");
  if (c.step > h.num_iterations)
    throw CheckpointError(path + ": step " + std::to_string(c.step) + " is past --num-iterations " +
                          std::to_string(h.num_iterations));
  const std::vector<uint8_t>& saved = c.blob(kRunFlagsBlob, path);
  return resume_flag_differences(std::string(saved.begin(), saved.end()), resume_flags(h, world_size));
}

// The checkpoint --resume continues from: this rank's newest, read whole and verified (its hashes,
// its step, its settings) before the GPU is touched.
struct ResumePoint {
  std::string path;
  Checkpoint checkpoint;
  std::string differences;  // the settings that differ from the checkpoint's, with --resume-other-settings
};

inline std::optional<ResumePoint> checkpoint_to_resume(const Hyperparameters& h, const ProcessGroupEnv& g) {
  if (!h.resume) return std::nullopt;
  try {
    ResumePoint r;
    const std::string dir = rank_checkpoint_dir(h, g);
    r.path = newest_checkpoint(dir);
    if (r.path.empty()) throw CheckpointError("no checkpoint in " + dir);
    r.checkpoint = read_checkpoint(r.path);
    r.differences = settings_differences(h, g.world_size, r.checkpoint, r.path);
    if (!r.differences.empty() && !h.resume_other_settings)
      throw CheckpointError(r.path + ": written by a run with other settings: " + r.differences +
                            " (--resume-other-settings resumes anyway)");
    return r;
  } catch (const std::exception& e) {  // filesystem errors too
    throw CheckpointError(std::string("--resume: ") + e.what());
  }
}

// The watchdog of a run (null with --stall-timeout 0): a rank stuck in one phase for the timeout
// (a peer died or diverged, so a collective never ends) exits, and the launcher stops the others.
// It runs from before the rendezvous, which it also covers, to after the communicator's teardown.
inline std::unique_ptr<ProgressWatchdog> start_watchdog(const Hyperparameters& h, int rank) {
  if (h.stall_timeout == 0) return nullptr;
  auto watchdog = std::make_unique<ProgressWatchdog>(std::chrono::seconds(h.stall_timeout),
                                                     [rank](const std::string& m) { end_stalled_rank(rank, m); });
  watchdog->beat("connecting the ranks (rendezvous, NCCL init)");
  return watchdog;
}

// ------------------------------------------------------------------------------------------------
// The start-up self-check (kernels/self_check.cuh): every fast path against its reference on this
// GPU before the warmup; a path that fails on any rank is replaced by its reference on every rank
// (--self-check fallback) or stops the run (strict). The lines go to the console and rank 0's log.
// ------------------------------------------------------------------------------------------------
struct SelfCheckFailed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The paths the flags select.
inline KernelPaths paths_of(const Hyperparameters& h) {
  KernelPaths p;
  p.flash_attention = h.attention == "flash";
  p.fp8_head = !h.bf16_head;
  p.fused_e5m2_gradient = h.fp8_gradient == "fused";
  p.batched_muon = h.muon == "batched";
  p.fused_residual_add = h.residual_add == "fused";
  return p;
}

// The self-check's problems at the model's width, heads and vocabulary.
inline SelfCheckShape self_check_shape(const GPTConfig& c) { return {c.model_dim, c.num_heads, c.vocab_size}; }

// The attention problems' documents: the validation data's first tokens (real documents) where
// there are enough, else about six documents of random lengths, which cross block edges.
inline std::vector<uint16_t> self_check_layout(const ValidationPlan* val, int T, uint16_t bos) {
  if (val && val->num_sequences() * val->seq_len() >= T)
    return std::vector<uint16_t>(val->sequence(0), val->sequence(0) + T);
  std::mt19937_64 rng(7);
  std::vector<uint16_t> tokens(T);
  for (int t = 0; t < T; ++t) tokens[t] = t == 0 || rng() % (T / 6) == 0 ? bos : uint16_t(rng() % bos);
  return tokens;
}

struct SelfCheckOutcome {
  KernelPaths paths;                // what the run uses
  std::vector<std::string> lines;   // every result, the summary, a line per fallback
  bool failed_here = false;         // a check of this rank failed
  std::string failed_paths;         // the paths that failed on some rank, by name ("": none)

  // The lines as the log's header holds them (after the environment).
  std::string report() const {
    std::string text;
    for (const std::string& l : lines) text += l + "\n";
    return text;
  }
  // Under --self-check strict a failure stops the run, once its lines are out.
  void stop_if_strict(const Hyperparameters& h) const {
    if (!failed_paths.empty() && h.self_check == "strict")
      throw SelfCheckFailed("self-check failed: " + failed_paths + " (the self-check lines say by how much; " +
                            "--self-check fallback trains on the references instead)");
  }
};

// Runs the self-check on this rank's GPU and votes: a path fails when it fails on any rank (comm
// null: this process alone), and is replaced by its reference.
inline SelfCheckOutcome self_check_paths(const Hyperparameters& h, const SelfCheckShape& shape, uint16_t bos,
                                         const ValidationPlan* val, DeviceCommunicator* comm) {
  SelfCheckOutcome outcome{paths_of(h), {}, false, ""};
  if (h.self_check == "off") return outcome;
  const auto start = std::chrono::steady_clock::now();
  const std::vector<uint16_t> layout = self_check_layout(val, shape.attention_tokens, bos);
  Matmul matmul;
  const std::vector<SelfCheckResult> results = run_self_check(shape, outcome.paths, layout.data(), bos, matmul, 0);
  CUDA_CHECK(cudaDeviceSynchronize());
  int failed_checks = 0;
  for (const SelfCheckResult& r : results) {
    outcome.lines.push_back(r.line());
    failed_checks += !r.passed();
  }
  outcome.failed_here = failed_checks > 0;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  char summary[128];
  std::snprintf(summary, sizeof summary, "self-check: %zu checks, %d failed, %.1f s", results.size(), failed_checks,
                seconds);
  outcome.lines.push_back(summary);
  for (const FastPath& path : fast_paths()) {
    bool failed_here = false;
    for (const SelfCheckResult& r : results) failed_here |= r.path == path.member && !r.passed();
    const bool failed = comm ? comm->all_reduce_sum(failed_here ? 1.0 : 0.0) > 0 : failed_here;
    if (!failed) continue;
    outcome.failed_paths += (outcome.failed_paths.empty() ? "" : ", ") + std::string(path.name);
    outcome.paths.*path.member = false;
    if (h.self_check == "fallback")
      outcome.lines.push_back(std::string("self-check fallback: ") + path.name + " failed " +
                              (failed_here ? "here" : "on another rank") + "; this run uses its reference (" +
                              path.reference_flag + "): slower, and not a record run");
  }
  return outcome;
}

// --self-check-only: the self-check on this process's GPU, printed; 0 when every check passed.
inline int self_check_alone(Hyperparameters h) {
  h.self_check = "strict";
  const GPTConfig c;
  const SelfCheckOutcome outcome = self_check_paths(h, self_check_shape(c), c.bos_token, nullptr, nullptr);
  std::printf("%s", outcome.report().c_str());
  outcome.stop_if_strict(h);
  return 0;
}

// One training run of this process: the model, its optimizers and data, and rank 0's log.
class TrainingRun {
 public:
  TrainingRun(const Hyperparameters& h, const ProcessGroupEnv& g)
      : h_(h), schedule_(schedule_of(h)), watchdog_(start_watchdog(h, g.rank)), comm_(connect_ranks(g, h.nccl_single_rank)),
        groups_(*comm_, h.diloco_groups), model_(config_, memory_),
        optimizers_(h, model_.params, group(), memory_),
        train_(config_, h.seq_len, /*backward=*/true, memory_, /*fp8_head=*/!h.bf16_head),
        eval_(config_, h.val_seq_len, false, memory_),
        val_(h.val_files, h.val_tokens, h.val_seq_len, kTokenizerVocab),
        checksum_(memory_.alloc<unsigned long long>("parameter checksum", 1)),
        state_(training_state(model_.params, optimizers_, counters_)), checkpoint_dir_(rank_checkpoint_dir(h, g)) {
    beat("initialisation");
    check_same_flags(h, *comm_);
    // Every rank initialises from rank 0's seed (52 bits: exact through the double all-reduce).
    uint64_t seed = comm_->rank() == 0 ? (h.seed ? h.seed : fresh_seed()) & ((uint64_t(1) << 52) - 1) : 0;
    counters_.seed = uint64_t(comm_->all_reduce_sum(double(seed)));
    initialize_parameters(config_, model_.params, counters_.seed);
    if (groups_.group) {  // every group starts from the same parameters: the global copies
      diloco_ = std::make_unique<DiLoCo>(diloco_settings(h), diloco_fragments(model_.params, h.diloco_fragments),
                                         *groups_.group, *groups_.across);
      diloco_->take_global_copies(0);
      for (const DiLoCo::Buffer& b : diloco_->state_buffers()) state_.push_back({b.name, b.data, b.bytes});
    }
    beat("self-check");
    const SelfCheckOutcome self_check =
        self_check_paths(h, self_check_shape(config_), config_.bos_token, &val_, comm_.get());
    if (comm_->rank() == 0 || self_check.failed_here) std::printf("%s", self_check.report().c_str());
    for (const std::string& line : self_check.lines)
      if (comm_->rank() == 0 && line.rfind("self-check fallback:", 0) == 0)
        std::fprintf(stderr, "WARNING: %s\n", line.c_str());
    self_check.stop_if_strict(h);
    paths_ = self_check.paths;
    model_.set_paths(paths_);
    optimizers_.set_batched_muon(paths_.batched_muon);
    if (comm_->rank() == 0) {
      log_ = std::make_unique<RunLog>(h.log_dir, new_run_id());
      log_->header(trainer_source(), environment_report() + self_check.report());
      log_parameters(*log_, h, model_.params.list);
      std::printf("run log: %s (%d rank%s%s, %s)\n", log_->path().c_str(), comm_->world_size(),
                  comm_->world_size() > 1 ? "s" : "",
                  diloco_ ? (" in " + std::to_string(h.diloco_groups) + " DiLoCo groups of " +
                             std::to_string(group().world_size())).c_str()
                          : "",
                  g.launcher.c_str());
    }
  }

  TrainingRun(const TrainingRun&) = delete;
  TrainingRun& operator=(const TrainingRun&) = delete;

  int run(std::optional<ResumePoint> resume_point) {
    if (h_.warmup_steps > 0) warm_up(/*restore=*/!resume_point);  // before a resume too
    if (resume_point) resume(std::move(*resume_point));
    char seed_line[64];
    std::snprintf(seed_line, sizeof seed_line, "seed: %" PRIu64, counters_.seed);
    say(seed_line);
    PrefetchLoader loader = training_loader(h_, counters_.step, comm_->rank(), comm_->world_size());
    for (int step = counters_.step;; ++step) {
      const bool last = step == h_.num_iterations;
      const std::string at = "step " + std::to_string(step) + ": ";
      if (last && diloco_ && step > counters_.step) {  // one model at the end (a resume here has it already)
        beat(at + "final DiLoCo sync");
        for (const std::string& line : diloco_->finish(step, 0)) say(line);
      }
      if (last || step == 0 || (h_.val_every > 0 && step % h_.val_every == 0)) {
        beat(at + "validation");
        validate_and_log(step, /*groups_agree=*/last);
      }
      if (last || (h_.checkpoint_every > 0 && step > counters_.step && step % h_.checkpoint_every == 0)) {
        beat(at + "checkpoint");
        checkpoint(step);
      }
      if (last) break;
      beat(at + "training");
      train_and_log(step, next_batch(loader, step));
    }
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    say(peak_memory_line(memory_.allocated_bytes(), total_bytes - free_bytes));
    return 0;
  }

 private:
  // A data error mid-run (check_data read every shard at the start, but a shard can change or
  // become unreadable since) saves the state first, unless the step's checkpoint is written
  // already or nothing was trained since the start.
  const RankBatch& next_batch(PrefetchLoader& loader, int step) {
    try {
      return loader.next();
    } catch (const DataError& e) {
      if (step == counters_.step) throw;
      std::string saved = checkpoint_path(checkpoint_dir_, step);
      try {
        if (unconfirmed_step_ != step) checkpoint(step);
      } catch (const std::exception& failed) {
        saved = "no checkpoint (" + std::string(failed.what()) + ")";
      }
      throw DataError(std::string(e.what()) + "; the state of step " + std::to_string(step) + ": " + saved);
    }
  }

  void say(const std::string& line, bool console = true) {
    if (log_) log_->line(line, console);
  }
  void beat(const std::string& phase) {
    if (watchdog_) watchdog_->beat(phase);
  }

  // The warmup trains on real data, then the state before it comes back; a resumed run skips that
  // copy, since the checkpoint (already in host memory) replaces the whole state after.
  void warm_up(bool restore) {
    std::optional<Checkpoint> initial;
    if (restore) initial = capture_state(state_, 0);
    PrefetchLoader loader = training_loader(h_, 0, comm_->rank(), comm_->world_size());
    for (int i = 0; i < h_.warmup_steps; ++i) {
      beat("warmup step " + std::to_string(i));
      int step = std::min(i, h_.num_iterations - 1);
      train_step(model_, train_, optimizers_, loader.next(), step, schedule_, paths_.fp8_head, 0);
    }
    if (initial) restore_state(*initial, "", state_, model_.params);
  }

  // Each rank verified its own checkpoint before the GPU (a rank that could not stopped there, and
  // its launcher stops the others: run.sh at once, others at the rendezvous's deadline); ranks
  // whose newest checkpoints are of different steps stop together here.
  void resume(ResumePoint point) {
    beat("resume");
    const int step = point.checkpoint.step;
    if (vote_across_ranks(*comm_, step).stop)
      throw CheckpointError("--resume: the ranks' newest checkpoints are of different steps (rank " +
                            std::to_string(comm_->rank()) + " has step " + std::to_string(step) + ")");
    restore_state(point.checkpoint, point.path, state_, model_.params);
    if (diloco_) diloco_->resumed_at(step);
    counters_.step = step;
    last_checkpoint_ = point.path;
    say("resumed from " + point.path + " at step " + std::to_string(step) +
        (point.differences.empty() ? "" : ", with other settings: " + point.differences));
  }

  // The training settings a checkpoint records: the head the run really trains (a self-check
  // fallback to the bf16 head is another mathematics, so a resume must ask for it by its flag).
  std::string run_flags() const {
    Hyperparameters trained = h_;
    trained.bf16_head = !paths_.fp8_head;
    return resume_flags(trained, comm_->world_size());
  }

  // Groups train apart between syncs: their ranks agree within the group, and all of them after
  // the final DiLoCo sync. The validation loss is the mean over every rank's share of the
  // validation tokens, each scored by its group's model.
  void validate_and_log(int step, bool groups_agree) {
    check_rank_consistency(model_.params, groups_agree ? *comm_ : group(), checksum_, 0);
    double val_loss = validate(model_, eval_, val_, schedule_.window_blocks(step), *comm_, 0);
    say(validation_line(step, h_.num_iterations, val_loss, counters_.train_ms));
    if (!std::isfinite(val_loss))
      throw std::runtime_error("validation loss is " + std::to_string(val_loss) + " at step " + std::to_string(step) +
                               "; last good checkpoint: " + last_checkpoint_);
  }

  void write_timeline(const Timeline& timeline, int step) {
    model_.set_timeline(nullptr);
    optimizers_.set_timeline(nullptr);
    if (diloco_) diloco_->set_timeline(nullptr);
    const std::string path = h_.log_dir + "/timeline_rank" + std::to_string(comm_->rank()) + "_step" +
                             std::to_string(step) + ".json";
    std::filesystem::create_directories(h_.log_dir);
    timeline.write_chrome_trace(path, comm_->rank());
    std::printf("rank %d: the GPU schedule of step %d is in %s\n", comm_->rank(), step, path.c_str());
  }

  // The checkpoint of step s is good once the loss of the next step, computed from its
  // parameters, is finite: until then a NaN stop names the one before.
  void checkpoint(int step) {
    Checkpoint c = capture_state(state_, step);
    const std::string flags = run_flags(), layout = parameter_layout(model_.params.list);
    c.blobs.emplace_back(kRunFlagsBlob, std::vector<uint8_t>(flags.begin(), flags.end()));
    c.blobs.emplace_back(kParameterLayoutBlob, std::vector<uint8_t>(layout.begin(), layout.end()));
    write_checkpoint(checkpoint_dir_, c);
    unconfirmed_checkpoint_ = checkpoint_path(checkpoint_dir_, step);
    unconfirmed_step_ = step;
  }

  void train_and_log(int step, const RankBatch& batch) {
    std::unique_ptr<Timeline> timeline;
    if (step + 1 == h_.timeline_step) timeline = std::make_unique<Timeline>();
    model_.set_timeline(timeline.get());
    optimizers_.set_timeline(timeline.get());
    if (diloco_) diloco_->set_timeline(timeline.get());
    auto start = std::chrono::steady_clock::now();
    double loss_sum = train_step(model_, train_, optimizers_, batch, step, schedule_, paths_.fp8_head, 0);
    const std::string sync_line = diloco_ ? diloco_->after_step(step + 1, 0) : "";
    double step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (timeline) write_timeline(*timeline, step + 1);
    // the console's mean over ranks; a NaN anywhere stops all
    double loss = mean_over_ranks(*comm_, loss_sum, double(batch.num_micro) * batch.micro_len);
    counters_.train_ms += step_ms;
    if (!std::isfinite(loss))
      throw std::runtime_error("training loss is " + std::to_string(loss) + " at step " + std::to_string(step + 1) +
                               "; last good checkpoint: " + last_checkpoint_);
    if (unconfirmed_step_ == step) last_checkpoint_ = unconfirmed_checkpoint_;
    if (step == counters_.step) check_rank_consistency(model_.params, group(), checksum_, 0);  // after the first step
    std::string line = train_step_line(step + 1, h_.num_iterations, counters_.train_ms);
    say(line, /*console=*/false);
    if (!sync_line.empty()) say(sync_line);
    if (log_)
      std::printf("%s\n", console_step_line(line, loss, step_ms, h_.micro_batches * h_.seq_len,
                                             training_flops_per_token(model_.params.list), h_.num_iterations - step - 1)
                              .c_str());
  }

  const Hyperparameters& h_;
  const Schedule schedule_;
  const GPTConfig config_;
  std::unique_ptr<ProgressWatchdog> watchdog_;  // before comm_: covers the rendezvous and its teardown
  std::unique_ptr<DeviceCommunicator> comm_;
  ReplicaGroups groups_;  // DiLoCo's communicators (none with one group)
  DeviceCommunicator& group() const { return groups_.group ? *groups_.group : *comm_; }
  DeviceMemory memory_;
  GPT model_;
  Optimizers optimizers_;
  Activations train_, eval_;
  ValidationPlan val_;
  unsigned long long* checksum_;
  RunCounters counters_;
  std::vector<StateBuffer> state_;
  std::string checkpoint_dir_, last_checkpoint_ = "none", unconfirmed_checkpoint_;
  int unconfirmed_step_ = -1;
  KernelPaths paths_;            // after the self-check
  std::unique_ptr<DiLoCo> diloco_;  // with more than one group
  std::unique_ptr<RunLog> log_;  // rank 0 only
};

// Everything that can be checked without the GPU is checked first, so that bad input is named
// before minutes of initialisation (and on machines without a GPU).
int run_training(const Hyperparameters& h) {
  if (h.self_check_only) {  // no data, no ranks: this GPU's fast paths alone
    require_hopper_gpu(select_gpu(process_group_from_env().local_rank));
    return self_check_alone(h);
  }
  check_data(h);
  const ProcessGroupEnv g = process_group_from_env();
  const std::string diloco_problem = diloco_settings_problem(diloco_settings(h), g.world_size, GPTConfig().num_layers);
  if (!diloco_problem.empty()) throw FlagError(diloco_problem);
  check_output_folders(h, g);
  std::optional<ResumePoint> resume_point = checkpoint_to_resume(h, g);
  require_hopper_gpu(select_gpu(g.local_rank));
  return TrainingRun(h, g).run(std::move(resume_point));
}

// ------------------------------------------------------------------------------------------------
#ifndef TRAIN_GPT_NO_MAIN  // tests include this file for its host and device code
int main(int argc, char** argv) {
  auto fail = [](const std::exception& e, ExitStatus status) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return int(status);
  };
  try {
    Hyperparameters h;
    if (!parse_flags(argc, argv, h)) {
      std::printf("%s", usage(argv[0]).c_str());
      return 0;
    }
    return run_training(h);
  } catch (const FlagError& e) {
    return fail(e, kExitBadFlags);
  } catch (const DataError& e) {
    return fail(e, kExitBadData);
  } catch (const NoUsableGpu& e) {
    return fail(e, kExitNoUsableGpu);
  } catch (const RunFilesError& e) {
    return fail(e, kExitRunFiles);
  } catch (const SelfCheckFailed& e) {
    return fail(e, kExitSelfCheckFailed);
  } catch (const std::exception& e) {
    return fail(e, kExitRunFailed);
  }
}
#endif
// ===== this file's text above this line, embedded for the run log by tools/records.py =====
const char kTrainerSource[] = R"speedrun_source(// Frozen single-file trainer of 2026-11-26_corpus-1gpu: train_gpt.cu with its kernels/ and data/ headers
// inlined by tools/records.py. Build it alone with:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -o train_gpt train_gpt.cu -lcublasLt -lcublas -lcusolver -lnccl
#define SPEEDRUN_FROZEN_RECORD "2026-11-26_corpus-1gpu"
// train_gpt.cu: the record-#25 NanoGPT speedrun trainer (SPEC Part 1) in one CUDA file.
//
// Reading order: hyperparameters and flags, the run log, checkpoints, the model (parameters,
// activations, forward and backward from the kernels of kernels/), the sharded optimizers, the
// training state, and the run (warmup, steps, validation, checkpoints) over a communicator that is
// one rank, NCCL ranks (one process per GPU) or, in tests, simulated ranks on one GPU.
// ===== data/dataloader.h (inlined) =====
// Host-side data pipeline (SPEC 1.7 and 4.1): the shard reader with its checks, the batch plan
// that reproduces the reference's distributed_data_generator for any world size, the validation
// plan, and a loader that prefetches each rank's micro-sequences on a background thread.
// Every error names the file and what is wrong with it.
#include <glob.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersion = 1;
constexpr int kShardHeaderInts = 256;
constexpr int64_t kShardHeaderBytes = kShardHeaderInts * 4;
constexpr int kTokenizerVocab = 50257;  // GPT-2 token ids are below this
constexpr uint16_t kBosToken = 50256;

struct DataError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The files matching a glob pattern, sorted.
inline std::vector<std::string> list_shards(const std::string& pattern) {
  glob_t g{};
  int rc = glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> files;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) files.emplace_back(g.gl_pathv[i]);
  globfree(&g);
  if (files.empty()) throw DataError("no files match pattern '" + pattern + "'");
  std::sort(files.begin(), files.end());
  return files;
}

// The token count of the shard open in f, from its header, checked against the file's size; f is
// left at the first token.
inline int64_t checked_token_count(FILE* f, const std::string& path) {
  int32_t header[kShardHeaderInts];
  if (std::fread(header, 1, kShardHeaderBytes, f) != size_t(kShardHeaderBytes))
    throw DataError(path + (std::ferror(f) ? ": cannot read: " + std::string(std::strerror(errno))
                                           : ": truncated header: shorter than " + std::to_string(kShardHeaderBytes) + " bytes"));
  if (header[0] != kShardMagic)
    throw DataError(path + ": wrong magic " + std::to_string(header[0]) + " (expected " + std::to_string(kShardMagic) + ")");
  if (header[1] != kShardVersion)
    throw DataError(path + ": unsupported version " + std::to_string(header[1]) + " (expected " + std::to_string(kShardVersion) + ")");
  int64_t num_tokens = header[2];
  if (num_tokens < 0) throw DataError(path + ": negative token count " + std::to_string(num_tokens) + " in header");
  std::fseek(f, 0, SEEK_END);
  int64_t actual = std::ftell(f), expected = kShardHeaderBytes + 2 * num_tokens;
  if (actual != expected)
    throw DataError(path + ": size " + std::to_string(actual) + " bytes does not match the header's token count " +
                    std::to_string(num_tokens) + " (expected " + std::to_string(expected) + " bytes)");
  std::fseek(f, kShardHeaderBytes, SEEK_SET);
  return num_tokens;
}

inline std::unique_ptr<FILE, int (*)(FILE*)> open_shard(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw DataError(path + ": cannot open: " + std::strerror(errno));
  return {f, &std::fclose};
}

// The header's token count of a shard, checked against its size, without reading the tokens.
inline int64_t shard_token_count(const std::string& path) { return checked_token_count(open_shard(path).get(), path); }

// The next n tokens of the shard open in f, into tokens.
inline void read_tokens(FILE* f, const std::string& path, uint16_t* tokens, int64_t n) {
  if (std::fread(tokens, 2, size_t(n), f) != size_t(n)) throw DataError(path + ": read failed: " + std::strerror(errno));
}

// tokens[0, n) are the shard's positions first, first + 1, ...: an id >= vocab_size is an error
// naming the file and its position. One max over them (which the compiler vectorises) decides;
// the position is looked for only when it fails.
inline void check_token_ids(const std::string& path, const uint16_t* tokens, int64_t n, int64_t first, int vocab_size) {
  uint16_t largest = 0;
  for (int64_t i = 0; i < n; ++i) largest = tokens[i] > largest ? tokens[i] : largest;
  if (largest < vocab_size) return;
  const int64_t i = std::find_if(tokens, tokens + n, [&](uint16_t t) { return t >= vocab_size; }) - tokens;
  throw DataError(path + ": token id " + std::to_string(tokens[i]) + " at position " + std::to_string(first + i) +
                  " >= vocab size " + std::to_string(vocab_size));
}

// Reads a whole shard and checks its header, its size and every token id.
inline std::vector<uint16_t> read_shard(const std::string& path, int vocab_size) {
  auto file = open_shard(path);
  const int64_t num_tokens = checked_token_count(file.get(), path);
  std::vector<uint16_t> tokens(num_tokens);
  read_tokens(file.get(), path, tokens.data(), num_tokens);
  check_token_ids(path, tokens.data(), num_tokens, 0, vocab_size);
  return tokens;
}

// Checks a shard as read_shard does without keeping its tokens: read in chunks of 4 MiB, which stay
// in the CPU's cache for the max. At the speed of memory (docs/PERF.md: 0.025 s for a FineWeb
// shard of 100M tokens in the page cache), so that every shard can be checked at start.
inline void scan_shard(const std::string& path, int vocab_size) {
  auto file = open_shard(path);
  const int64_t num_tokens = checked_token_count(file.get(), path);
  std::vector<uint16_t> chunk(int64_t(1) << 21);
  for (int64_t first = 0; first < num_tokens; first += int64_t(chunk.size())) {
    const int64_t n = std::min(int64_t(chunk.size()), num_tokens - first);
    read_tokens(file.get(), path, chunk.data(), n);
    check_token_ids(path, chunk.data(), n, first, vocab_size);
  }
}

// One optimizer step's global window: M micro-sequences of T tokens, plus the last target.
// Micro-sequence j is tokens + j*T (T + 1 tokens: inputs [0, T), targets [1, T + 1)).
struct GlobalWindow {
  int64_t step;
  std::string shard;
  int64_t pos;
  const uint16_t* tokens;  // [M*T + 1]
};

// The reference's distributed_data_generator with the global batch of SPEC 4.1: files sorted and
// read once each (no cycling); a shard is left, and its tail dropped, once
// pos + M*T + 1 >= its length (so a shard yields a window only from M*T + 2 tokens on).
class BatchPlan {
 public:
  BatchPlan(std::string pattern, int64_t micro_len, int micro_count, int vocab_size)
      : pattern_(std::move(pattern)), files_(list_shards(pattern_)), micro_len_(micro_len),
        micro_count_(micro_count), vocab_size_(vocab_size) {
    if (micro_len < 1 || micro_count < 1)
      throw DataError("batch of " + std::to_string(micro_count) + " x " + std::to_string(micro_len) + " tokens is empty");
  }

  GlobalWindow next() {
    int64_t batch = micro_len_ * micro_count_;
    while (next_file_ == 0 || pos_ + batch + 1 >= int64_t(tokens_.size())) load_next_shard(batch);
    GlobalWindow w{step_++, files_[next_file_ - 1], pos_, tokens_.data() + pos_};
    pos_ += batch;
    return w;
  }

  // The windows all the files give, from their headers alone (no token is read): a run longer than
  // this would stop when the data runs out. A file too small for one window is an error here too.
  int64_t windows_available() const {
    const int64_t batch = micro_len_ * micro_count_;
    int64_t windows = 0;
    for (const std::string& path : files_) {
      const int64_t n = shard_token_count(path);
      check_shard_fits_batch(path, n, batch);
      windows += (n - 2 - batch) / batch + 1;  // windows at pos = k batch while pos + batch + 1 < n
    }
    return windows;
  }

  // Every token of every file read and checked (header, size, ids below the vocabulary), none
  // kept: with windows_available, whatever the run would meet in its files is found before it starts.
  void scan_all_tokens() const {
    for (const std::string& path : files_) scan_shard(path, vocab_size_);
  }

  int64_t micro_len() const { return micro_len_; }
  int micro_count() const { return micro_count_; }
  static int rank_of_micro(int j, int world_size) { return j % world_size; }

 private:
  void load_next_shard(int64_t batch) {
    if (next_file_ == files_.size())
      throw DataError("training data exhausted at step " + std::to_string(step_) + ": all " +
                      std::to_string(files_.size()) + " file(s) matching '" + pattern_ +
                      "' are consumed (the loader does not cycle)");
    const std::string& path = files_[next_file_++];
    tokens_ = read_shard(path, vocab_size_);
    pos_ = 0;
    check_shard_fits_batch(path, int64_t(tokens_.size()), batch);
  }

  void check_shard_fits_batch(const std::string& path, int64_t tokens, int64_t batch) const {
    if (tokens < batch + 2)
      throw DataError(path + ": holds " + std::to_string(tokens) + " tokens, too few for one batch of " +
                      std::to_string(micro_count_) + " x " + std::to_string(micro_len_) + " tokens (needs " +
                      std::to_string(batch + 2) + ")");
  }

  std::string pattern_;
  std::vector<std::string> files_;
  int64_t micro_len_;
  int micro_count_;
  int vocab_size_;
  size_t next_file_ = 0;
  std::vector<uint16_t> tokens_;
  int64_t pos_ = 0;
  int64_t step_ = 0;
};

// val_tokens as S = val_tokens / val_seq_len sequences of one window of the first val shard;
// sequence s goes to rank s % W (with W = 8 and S = 40: the reference's 5 validation steps).
class ValidationPlan {
 public:
  ValidationPlan(const std::string& pattern, int64_t val_tokens, int64_t val_seq_len, int vocab_size)
      : seq_len_(val_seq_len) {
    if (val_seq_len < 1 || val_tokens < val_seq_len || val_tokens % val_seq_len != 0)
      throw DataError("val_tokens " + std::to_string(val_tokens) + " is not a positive multiple of val_seq_len " +
                      std::to_string(val_seq_len));
    num_sequences_ = val_tokens / val_seq_len;
    BatchPlan plan(pattern, val_seq_len, int(num_sequences_), vocab_size);
    GlobalWindow w = plan.next();
    tokens_.assign(w.tokens, w.tokens + val_tokens + 1);
  }
  int64_t num_sequences() const { return num_sequences_; }
  int64_t seq_len() const { return seq_len_; }
  const uint16_t* sequence(int64_t s) const { return tokens_.data() + s * seq_len_; }  // [seq_len + 1]
  std::vector<int64_t> sequences_of_rank(int rank, int world_size) const {
    std::vector<int64_t> mine;
    for (int64_t s = rank; s < num_sequences_; s += world_size) mine.push_back(s);
    return mine;
  }

 private:
  int64_t seq_len_, num_sequences_;
  std::vector<uint16_t> tokens_;  // [val_tokens + 1]
};

using HostAlloc = std::function<void*(size_t bytes)>;
using HostFree = std::function<void(void*)>;

// One rank's share of a step: its micro-sequences j = rank, rank + W, ... in increasing j.
struct RankBatch {
  int64_t step;
  int num_micro;
  int64_t micro_len;
  const uint16_t* tokens;  // [num_micro * (T + 1)]
};

// Copies each rank's micro-sequences into host buffers (pinned, when the trainer passes
// cudaHostAlloc) `depth` steps ahead, on a background thread. A buffer handed out by next() stays
// valid until the following call; errors of the thread (exhausted data, a bad shard) surface there.
class PrefetchLoader {
 public:
  PrefetchLoader(BatchPlan plan, int rank, int world_size, int depth = 2, HostAlloc alloc = {}, HostFree free = {})
      : plan_(std::move(plan)), rank_(rank), world_size_(world_size),
        free_(free ? free : HostFree([](void* p) { std::free(p); })) {
    if (depth < 1) throw DataError("prefetch depth must be >= 1");
    int num_micro = 0;
    for (int j = rank; j < plan_.micro_count(); j += world_size) ++num_micro;
    size_t bytes = std::max<size_t>(1, size_t(num_micro) * (plan_.micro_len() + 1) * sizeof(uint16_t));
    HostAlloc allocate = alloc ? alloc : HostAlloc([](size_t n) { return std::malloc(n); });
    for (int i = 0; i < depth + 1; ++i) {  // depth filled ahead + the one handed out last
      auto* buffer = static_cast<uint16_t*>(allocate(bytes));
      if (!buffer) {
        free_buffers();
        throw DataError("cannot allocate " + std::to_string(bytes) + " bytes of host buffer");
      }
      buffers_.push_back(buffer);
      batches_.push_back({0, num_micro, plan_.micro_len(), buffer});
    }
    worker_ = std::thread([this] { fill_loop(); });
  }

  ~PrefetchLoader() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
    free_buffers();
  }

  const RankBatch& next() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (handed_out_) {  // the previous buffer may be refilled now
      handed_out_ = false;
      ++consumed_;
      cv_.notify_all();
    }
    cv_.wait(lock, [&] { return filled_ > consumed_ || error_; });
    if (filled_ == consumed_ && error_) std::rethrow_exception(error_);
    handed_out_ = true;
    return batches_[consumed_ % batches_.size()];
  }

 private:
  void fill_loop() {
    try {
      for (;;) {
        {
          std::unique_lock<std::mutex> lock(mutex_);
          cv_.wait(lock, [&] { return stop_ || filled_ - consumed_ < int64_t(buffers_.size()); });
          if (stop_) return;
        }
        GlobalWindow w = plan_.next();
        size_t slot = filled_ % buffers_.size();
        copy_rank_micro_sequences(w, buffers_[slot]);
        batches_[slot].step = w.step;
        std::lock_guard<std::mutex> lock(mutex_);
        ++filled_;
        cv_.notify_all();
      }
    } catch (const DataError&) {
      fail(std::current_exception());
    } catch (const std::exception& e) {  // e.g. bad_alloc reading a shard: still a data error to the caller
      fail(std::make_exception_ptr(DataError(std::string("data loader thread failed: ") + e.what())));
    }
  }

  void fail(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = error;
    cv_.notify_all();
  }

  void free_buffers() {
    for (uint16_t* buffer : buffers_) free_(buffer);
    buffers_.clear();
  }

  void copy_rank_micro_sequences(const GlobalWindow& w, uint16_t* out) const {
    int64_t T = plan_.micro_len();
    for (int j = rank_; j < plan_.micro_count(); j += world_size_, out += T + 1)
      std::memcpy(out, w.tokens + j * T, (T + 1) * sizeof(uint16_t));
  }

  BatchPlan plan_;
  int rank_, world_size_;
  HostFree free_;
  std::vector<uint16_t*> buffers_;  // a ring of depth + 1, each [num_micro * (T + 1)]
  std::vector<RankBatch> batches_;  // batches_[i].tokens == buffers_[i]
  std::thread worker_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int64_t filled_ = 0, consumed_ = 0;  // slots filled by the thread / released by the consumer
  bool handed_out_ = false, stop_ = false;
  std::exception_ptr error_;
};
// ===== end of data/dataloader.h =====
// ===== kernels/activations.cuh (inlined) =====
// ReLU^2 of the MLP (SPEC 1.2.6): a = relu(u)^2 and du = da * 2 relu(u), bf16, 16-byte vectors.
// ===== kernels/cuda_check.cuh (inlined) =====
// Every CUDA, cuBLAS(Lt), cuSOLVER and NCCL return code is checked; a failure names the call's file:line.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

[[noreturn]] inline void cuda_fail(const char* what, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + call + " failed: " + what);
}

#define CUDA_CHECK(call)                                                              \
  do {                                                                                \
    cudaError_t cuda_check_err_ = (call);                                             \
    if (cuda_check_err_ != cudaSuccess)                                               \
      cuda_fail(cudaGetErrorString(cuda_check_err_), #call, __FILE__, __LINE__);      \
  } while (0)

// After a kernel launch: the launch configuration error, if any.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

#define CUBLAS_CHECK(call)                                                            \
  do {                                                                                \
    cublasStatus_t cublas_check_status_ = (call);                                     \
    if (cublas_check_status_ != CUBLAS_STATUS_SUCCESS)                                \
      cuda_fail(cublasGetStatusString(cublas_check_status_), #call, __FILE__, __LINE__); \
  } while (0)

// cuSOLVER has no status string of its own.
inline const char* cusolver_status_name(cusolverStatus_t s) {
  switch (s) {
    case CUSOLVER_STATUS_SUCCESS: return "CUSOLVER_STATUS_SUCCESS";
    case CUSOLVER_STATUS_NOT_INITIALIZED: return "CUSOLVER_STATUS_NOT_INITIALIZED";
    case CUSOLVER_STATUS_ALLOC_FAILED: return "CUSOLVER_STATUS_ALLOC_FAILED";
    case CUSOLVER_STATUS_INVALID_VALUE: return "CUSOLVER_STATUS_INVALID_VALUE";
    case CUSOLVER_STATUS_ARCH_MISMATCH: return "CUSOLVER_STATUS_ARCH_MISMATCH";
    case CUSOLVER_STATUS_EXECUTION_FAILED: return "CUSOLVER_STATUS_EXECUTION_FAILED";
    case CUSOLVER_STATUS_INTERNAL_ERROR: return "CUSOLVER_STATUS_INTERNAL_ERROR";
    case CUSOLVER_STATUS_NOT_SUPPORTED: return "CUSOLVER_STATUS_NOT_SUPPORTED";
    default: return "cuSOLVER status (see cusolver_common.h)";
  }
}

#define CUSOLVER_CHECK(call)                                                          \
  do {                                                                                \
    cusolverStatus_t cusolver_check_status_ = (call);                                 \
    if (cusolver_check_status_ != CUSOLVER_STATUS_SUCCESS)                            \
      cuda_fail(cusolver_status_name(cusolver_check_status_), #call, __FILE__, __LINE__); \
  } while (0)

#define NCCL_CHECK(call)                                                              \
  do {                                                                                \
    ncclResult_t nccl_check_result_ = (call);                                         \
    if (nccl_check_result_ != ncclSuccess)                                            \
      cuda_fail(ncclGetErrorString(nccl_check_result_), #call, __FILE__, __LINE__);  \
  } while (0)

// No GPU this process can train on: the trainer exits with a status of its own (kExitNoUsableGpu).
struct NoUsableGpu : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Why cudaGetDeviceCount found no GPU, in plain words, with CUDA's own text after: without a
// driver CUDA says "CUDA driver version is insufficient for CUDA runtime version".
inline std::string no_gpu_reason(cudaError_t err) {
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);  // 0 when no driver is installed
  cudaRuntimeGetVersion(&runtime);
  auto version = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
  const std::string cuda_says = err == cudaSuccess ? "" : std::string(" (CUDA: ") + cudaGetErrorString(err) + ")";
  if (driver == 0)
    return "no NVIDIA driver found, so no GPU can be used here: the trainer needs an NVIDIA GPU (H100 or H200) and "
           "its driver" + cuda_says;
  if (err == cudaErrorInsufficientDriver)
    return "the NVIDIA driver (CUDA " + version(driver) + ") is older than this build's CUDA runtime (" +
           version(runtime) + "): update the driver" + cuda_says;
  if (err == cudaSuccess || err == cudaErrorNoDevice) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    return "no NVIDIA GPU found: the driver (CUDA " + version(driver) + ") sees none" +
           (visible ? std::string(" with CUDA_VISIBLE_DEVICES='") + visible + "'" : std::string()) + cuda_says;
  }
  return "no CUDA GPU is usable here" + cuda_says;
}

// Makes this process's GPU current and returns it: GPU `local_rank`, or the only GPU the process
// sees where the launcher gives each process one (Slurm's --gpus-per-task=1, a per-rank
// CUDA_VISIBLE_DEVICES).
inline int select_gpu(int local_rank) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) throw NoUsableGpu(no_gpu_reason(err));
  const int device = count == 1 ? 0 : local_rank;
  if (device < 0 || device >= count)
    throw NoUsableGpu("local rank " + std::to_string(local_rank) + " needs GPU " + std::to_string(device) +
                      ", but this process sees " + std::to_string(count) + " GPUs (LOCAL_RANK too high?)");
  CUDA_CHECK(cudaSetDevice(device));
  return device;
}

// The trainer's kernels are built for Hopper (sm_90a); any other GPU is refused at start.
inline void require_hopper_gpu(int device) {
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  if (prop.major != 9 || prop.minor != 0)
    throw NoUsableGpu("unsupported GPU '" + std::string(prop.name) + "' (compute capability " +
                      std::to_string(prop.major) + "." + std::to_string(prop.minor) +
                      "): this build targets sm_90a (H100/H200); rebuild with -DSPEEDRUN_CUDA_GENCODE for another GPU");
}
// ===== end of kernels/cuda_check.cuh =====
// ===== kernels/device_utils.cuh (inlined) =====
// Small device helpers shared by the kernel headers: warp/block reductions, 16-byte vectors,
// the grid of elementwise kernels, fp32 <-> bf16 conversion, asynchronous uploads of host arrays.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

using bf16 = __nv_bfloat16;

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ inline float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
__device__ inline float block_sum(float v) {
  __shared__ float partial[32];
  __shared__ float total;
  v = warp_sum(v);
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // partial[] may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < blockDim.x / 32 ? partial[lane] : 0.0f;
    s = warp_sum(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// norms[i] = ||x[i n .. (i + 1) n)||_F, block i per matrix: a fixed reduction order, deterministic.
constexpr int kFrobeniusThreads = 1024;
template <typename T>
__global__ void __launch_bounds__(kFrobeniusThreads) frobenius_norms_kernel(const T* x, size_t n, float* norms) {
  const T* matrix = x + blockIdx.x * n;
  float ss = 0;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
    float v = float(matrix[i]);
    ss += v * v;
  }
  ss = block_sum(ss);
  if (threadIdx.x == 0) norms[blockIdx.x] = sqrtf(ss);
}

// Eight bf16 in one 16-byte load/store.
struct alignas(16) Bf16x8 {
  bf16 v[8];
};

__device__ inline void load8(const bf16* p, float out[8]) {
  Bf16x8 x = *reinterpret_cast<const Bf16x8*>(p);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = __bfloat162float(x.v[i]);
}

// Eight fp32 in two 16-byte loads (p 16-byte aligned).
__device__ inline void load8(const float* p, float out[8]) {
  float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
  out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

__device__ inline void store8(bf16* p, const float in[8]) {
  Bf16x8 x;
#pragma unroll
  for (int i = 0; i < 8; ++i) x.v[i] = __float2bfloat16(in[i]);
  *reinterpret_cast<Bf16x8*>(p) = x;
}

// 256-thread blocks over `items`, grid-stride past 16 blocks per SM (132 SMs on an H100); at least
// one block, so that an empty launch is not an invalid configuration.
inline int elementwise_grid(size_t items) {
  size_t blocks = (items + 255) / 256;
  return int(blocks < 1 ? 1 : blocks < 132 * 16 ? blocks : 132 * 16);
}

template <typename From, typename To>
__global__ void convert_kernel(const From* in, To* out, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = To(float(in[i]));
}

// out[n] = in[n] converted (fp32 -> bf16 rounds to nearest even)
template <typename From, typename To>
void convert(const From* in, To* out, size_t n, cudaStream_t stream) {
  convert_kernel<<<elementwise_grid(n), 256, 0, stream>>>(in, out, n);
  CUDA_CHECK_LAUNCH();
}

// *sum += the 32-bit words of data[words] added as integers: independent of the order of the
// additions, so equal buffers give equal sums on every GPU (a checksum, not a hash).
__global__ void word_sum_kernel(const uint32_t* data, size_t words, unsigned long long* sum) {
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < words; i += size_t(gridDim.x) * blockDim.x)
    local += data[i];
  atomicAdd(sum, local);
}

// The word sum of `bytes` (a multiple of 4) at data; synchronous (the caller compares it on the host).
inline uint64_t device_word_sum(const void* data, size_t bytes, unsigned long long* scratch, cudaStream_t stream) {
  CUDA_CHECK(cudaMemsetAsync(scratch, 0, sizeof *scratch, stream));
  word_sum_kernel<<<elementwise_grid(bytes / 4), 256, 0, stream>>>(static_cast<const uint32_t*>(data), bytes / 4, scratch);
  CUDA_CHECK_LAUNCH();
  unsigned long long sum = 0;
  CUDA_CHECK(cudaMemcpyAsync(&sum, scratch, sizeof sum, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return sum;
}

// Device copies of a micro-sequence's small host-built arrays (attention block lists, embedding
// row order) without a device sync: staged in pinned memory, copied asynchronously on the stream
// that reads them. One set is reused for every micro-sequence; stream order keeps the previous
// readers ahead of the next copies, and reset() waits only until the previous copies have left the
// staging memory, so the host prepares micro-sequence j + 1 while the GPU runs j.
class StagedUploads {
 public:
  static constexpr size_t kAlignment = 256;
  static size_t bytes_for(size_t count, size_t element_bytes) {
    return (std::max<size_t>(count, 1) * element_bytes + kAlignment - 1) / kAlignment * kAlignment;
  }
  template <typename X>
  static size_t bytes_for(const std::vector<X>& host) {
    return bytes_for(host.size(), sizeof(X));
  }

  StagedUploads() { CUDA_CHECK(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming)); }
  ~StagedUploads() {
    release();
    cudaEventDestroy(copied_);
  }
  StagedUploads(const StagedUploads&) = delete;
  StagedUploads& operator=(const StagedUploads&) = delete;

  // Starts a new set of `bytes` (the sum of bytes_for of what follows); the previous set's device
  // memory may be overwritten by the next copies once the stream reaches them.
  void reset(size_t bytes) {
    CUDA_CHECK(cudaEventSynchronize(copied_));
    if (bytes > capacity_) {  // rare: doubling, so a few times per run at most
      const size_t grown = std::max(bytes, 2 * capacity_);
      CUDA_CHECK(cudaDeviceSynchronize());  // the old device memory may still be read
      release();
      CUDA_CHECK(cudaMallocHost(&staging_, grown));
      CUDA_CHECK(cudaMalloc(&device_, grown));
      capacity_ = grown;
    }
    used_ = 0;
  }

  template <typename X>
  X* upload(const std::vector<X>& host, cudaStream_t stream) {
    const size_t bytes = host.size() * sizeof(X), slot = bytes_for(host);
    if (used_ + slot > capacity_)
      throw std::logic_error("StagedUploads: " + std::to_string(used_ + slot) + " bytes staged, reset() reserved " +
                             std::to_string(capacity_));
    char *staged = static_cast<char*>(staging_) + used_, *on_device = static_cast<char*>(device_) + used_;
    std::memcpy(staged, host.data(), bytes);
    CUDA_CHECK(cudaMemcpyAsync(on_device, staged, bytes, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaEventRecord(copied_, stream));
    used_ += slot;
    return reinterpret_cast<X*>(on_device);
  }

 private:
  void release() {
    cudaFreeHost(staging_);
    cudaFree(device_);
    staging_ = device_ = nullptr;
    capacity_ = 0;
  }
  void *staging_ = nullptr, *device_ = nullptr;
  size_t capacity_ = 0, used_ = 0;
  cudaEvent_t copied_ = nullptr;
};
// ===== end of kernels/device_utils.cuh =====

#include <stdexcept>

// a[n] = relu(u[n])^2, n a multiple of 8
__global__ void relu_squared_forward_kernel(const bf16* u, bf16* a, size_t vectors) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < vectors; i += size_t(gridDim.x) * blockDim.x) {
    float v[8];
    load8(u + i * 8, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = v[j] > 0 ? v[j] * v[j] : 0.0f;
    store8(a + i * 8, v);
  }
}

// du[n] = da[n] * 2 relu(u[n])
__global__ void relu_squared_backward_kernel(const bf16* u, const bf16* da, bf16* du, size_t vectors) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < vectors; i += size_t(gridDim.x) * blockDim.x) {
    float v[8], g[8];
    load8(u + i * 8, v);
    load8(da + i * 8, g);
#pragma unroll
    for (int j = 0; j < 8; ++j) g[j] *= v[j] > 0 ? 2 * v[j] : 0.0f;
    store8(du + i * 8, g);
  }
}

inline void relu_squared_forward(const bf16* u, bf16* a, size_t n, cudaStream_t stream) {
  if (n % 8) throw std::invalid_argument("relu_squared: size must be a multiple of 8");
  relu_squared_forward_kernel<<<elementwise_grid(n / 8), 256, 0, stream>>>(u, a, n / 8);
  CUDA_CHECK_LAUNCH();
}

inline void relu_squared_backward(const bf16* u, const bf16* da, bf16* du, size_t n, cudaStream_t stream) {
  if (n % 8) throw std::invalid_argument("relu_squared: size must be a multiple of 8");
  relu_squared_backward_kernel<<<elementwise_grid(n / 8), 256, 0, stream>>>(u, da, du, n / 8);
  CUDA_CHECK_LAUNCH();
}
// ===== end of kernels/activations.cuh =====
// ===== kernels/attention.cuh (inlined) =====
// Causal, document-masked, block-sparse sliding-window attention (SPEC 1.4), head_dim 128,
// scale 0.12, bf16 in and out, fp32 softmax statistics. Blocks outside the window or document
// are skipped, not masked: each query block walks only its own list of kv blocks.
//
// This is the correct baseline (one warp per query or key row, CUDA cores); the tensor-core
// version replaces the kernels, not the interface. The backward is deterministic: dq per query,
// dk and dv per key (over the inverse block lists), no atomics.

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

constexpr int kAttentionHeadDim = 128;
constexpr int kAttentionBlock = 128;
constexpr float kAttentionScale = 0.12f;

// The block lists of one micro-sequence for one window size, built as the reference builds its
// BlockMask: "any" (partial) and "all" (full) blocks, nearest first, partial count clamped to
// max(window - full, 1) and full count to window - 1.
struct AttentionBlockLists {
  int num_blocks = 0, max_kv = 0, max_q = 0;
  std::vector<int> kv_count, kv_index;  // [num_blocks], [num_blocks, max_kv]: kv blocks of each q block
  std::vector<int> q_count, q_index;    // [num_blocks], [num_blocks, max_q]: q blocks that attend each kv block
};

// docs[t] = number of BOS tokens in tokens[0..t] (each document begins with its BOS).
inline std::vector<int32_t> attention_document_ids(const uint16_t* tokens, int T, uint16_t bos) {
  std::vector<int32_t> docs(T);
  int32_t d = 0;
  for (int t = 0; t < T; ++t) docs[t] = d += tokens[t] == bos;
  return docs;
}

inline AttentionBlockLists build_attention_blocks(const std::vector<int32_t>& docs, int window_blocks,
                                                  int block = kAttentionBlock) {
  if (docs.size() % block != 0)
    throw std::invalid_argument("attention mask: " + std::to_string(docs.size()) + " tokens are not whole blocks of " +
                                std::to_string(block));
  AttentionBlockLists b;
  b.num_blocks = int(docs.size()) / block;
  std::vector<std::vector<int>> kv(b.num_blocks), q(b.num_blocks);
  for (int qb = 0; qb < b.num_blocks; ++qb) {
    int q_low = docs[qb * block], q_high = docs[qb * block + block - 1];
    std::vector<int> partial, full;
    for (int kb = qb; kb >= 0; --kb) {
      int kv_low = docs[kb * block], kv_high = docs[kb * block + block - 1];
      if (kb < qb && q_low == kv_high && q_high == kv_low) full.push_back(kb);
      else if (q_low <= kv_high && q_high >= kv_low) partial.push_back(kb);
    }
    int full_keep = std::max(0, std::min(int(full.size()), window_blocks - 1));
    int partial_keep = std::min(int(partial.size()), std::max(window_blocks - int(full.size()), 1));
    kv[qb].assign(partial.begin(), partial.begin() + partial_keep);
    kv[qb].insert(kv[qb].end(), full.begin(), full.begin() + full_keep);
    for (int kb : kv[qb]) q[kb].push_back(qb);
  }
  auto flatten = [&](const std::vector<std::vector<int>>& lists, std::vector<int>& count, std::vector<int>& index, int& width) {
    width = 1;
    for (const auto& l : lists) width = std::max(width, int(l.size()));
    count.assign(b.num_blocks, 0);
    index.assign(size_t(b.num_blocks) * width, -1);
    for (int i = 0; i < b.num_blocks; ++i) {
      count[i] = int(lists[i].size());
      std::copy(lists[i].begin(), lists[i].end(), index.begin() + size_t(i) * width);
    }
  };
  flatten(kv, b.kv_count, b.kv_index, b.max_kv);
  flatten(q, b.q_count, b.q_index, b.max_q);
  return b;
}

// The block lists and document ids on the device.
struct DeviceAttentionMask {
  int num_blocks = 0, max_kv = 0, max_q = 0;
  int *kv_count = nullptr, *kv_index = nullptr, *q_count = nullptr, *q_index = nullptr;
  int32_t* docs = nullptr;  // [T]
};

// Each row (query or key) of q, k, v, y, dy, dq, dk, dv is [H, 128] at a stride of row_stride
// elements between tokens (q, k, v may live inside the fused qkv buffer); lse, delta are [H, T].
struct AttentionTensors {
  int T, H;
  int64_t q_stride, k_stride, v_stride;  // elements between consecutive tokens
};

__device__ inline bool attends(const DeviceAttentionMask& m, int t, int s) {
  return s <= t && m.docs[s] == m.docs[t];
}

// One warp per (query t, head h): y[t, h] and lse[h, t] by online softmax over the listed blocks.
__global__ void attention_forward_kernel(const bf16* q, const bf16* k, const bf16* v, bf16* y, float* lse,
                                         AttentionTensors a, DeviceAttentionMask m) {
  int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= a.T * a.H) return;
  int t = warp / a.H, h = warp % a.H, qb = t / kAttentionBlock;
  float qv[4], acc[4] = {0, 0, 0, 0}, row_max = -INFINITY, row_sum = 0;
  const bf16* qrow = q + t * a.q_stride + h * kAttentionHeadDim + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) qv[i] = __bfloat162float(qrow[i]) * kAttentionScale;
  for (int j = 0; j < m.kv_count[qb]; ++j) {
    int kb = m.kv_index[qb * m.max_kv + j];
    for (int s = kb * kAttentionBlock; s < (kb + 1) * kAttentionBlock; ++s) {
      if (!attends(m, t, s)) continue;
      const bf16* krow = k + s * a.k_stride + h * kAttentionHeadDim + lane * 4;
      float score = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) score += qv[i] * __bfloat162float(krow[i]);
      score = warp_sum(score);
      float new_max = fmaxf(row_max, score), correction = __expf(row_max - new_max), p = __expf(score - new_max);
      const bf16* vrow = v + s * a.v_stride + h * kAttentionHeadDim + lane * 4;
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] = acc[i] * correction + p * __bfloat162float(vrow[i]);
      row_sum = row_sum * correction + p;
      row_max = new_max;
    }
  }
  bf16* yrow = y + (size_t(t) * a.H + h) * kAttentionHeadDim + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) yrow[i] = __float2bfloat16(acc[i] / row_sum);
  if (lane == 0) lse[size_t(h) * a.T + t] = row_max + logf(row_sum);
}

// delta[h, t] = dot(dy[t, h], y[t, h]): the softmax backward's row term.
__global__ void attention_delta_kernel(const bf16* y, const bf16* dy, float* delta, int T, int H) {
  int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= T * H) return;
  int t = warp / H, h = warp % H;
  size_t at = (size_t(t) * H + h) * kAttentionHeadDim + lane * 4;
  float d = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) d += __bfloat162float(y[at + i]) * __bfloat162float(dy[at + i]);
  d = warp_sum(d);
  if (lane == 0) delta[size_t(h) * T + t] = d;
}

// One warp per (query t, head h): dq[t, h] = scale * sum_s P_ts (dy_t . v_s - delta_t) k_s.
__global__ void attention_backward_dq_kernel(const bf16* q, const bf16* k, const bf16* v, const bf16* dy,
                                             const float* lse, const float* delta, bf16* dq,
                                             AttentionTensors a, DeviceAttentionMask m) {
  int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= a.T * a.H) return;
  int t = warp / a.H, h = warp % a.H, qb = t / kAttentionBlock;
  float qv[4], g[4], acc[4] = {0, 0, 0, 0};
  const bf16* qrow = q + t * a.q_stride + h * kAttentionHeadDim + lane * 4;
  const bf16* grow = dy + (size_t(t) * a.H + h) * kAttentionHeadDim + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) qv[i] = __bfloat162float(qrow[i]) * kAttentionScale, g[i] = __bfloat162float(grow[i]);
  float row_lse = lse[size_t(h) * a.T + t], row_delta = delta[size_t(h) * a.T + t];
  for (int j = 0; j < m.kv_count[qb]; ++j) {
    int kb = m.kv_index[qb * m.max_kv + j];
    for (int s = kb * kAttentionBlock; s < (kb + 1) * kAttentionBlock; ++s) {
      if (!attends(m, t, s)) continue;
      const bf16* krow = k + s * a.k_stride + h * kAttentionHeadDim + lane * 4;
      const bf16* vrow = v + s * a.v_stride + h * kAttentionHeadDim + lane * 4;
      float kv[4], score = 0, dp = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        kv[i] = __bfloat162float(krow[i]);
        score += qv[i] * kv[i];
        dp += g[i] * __bfloat162float(vrow[i]);
      }
      score = warp_sum(score);
      dp = warp_sum(dp);
      float ds = __expf(score - row_lse) * (dp - row_delta) * kAttentionScale;
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] += ds * kv[i];
    }
  }
  bf16* out = dq + (size_t(t) * a.H + h) * kAttentionHeadDim + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = __float2bfloat16(acc[i]);
}

// One warp per (key s, head h): dk[s, h] = scale * sum_t P_ts (dy_t . v_s - delta_t) q_t and
// dv[s, h] = sum_t P_ts dy_t, over the query blocks that list s's block.
__global__ void attention_backward_dkv_kernel(const bf16* q, const bf16* k, const bf16* v, const bf16* dy,
                                              const float* lse, const float* delta, bf16* dk, bf16* dv,
                                              AttentionTensors a, DeviceAttentionMask m) {
  int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= a.T * a.H) return;
  int s = warp / a.H, h = warp % a.H, kb = s / kAttentionBlock;
  float kv[4], vv[4], dk_acc[4] = {0, 0, 0, 0}, dv_acc[4] = {0, 0, 0, 0};
  const bf16* krow = k + s * a.k_stride + h * kAttentionHeadDim + lane * 4;
  const bf16* vrow = v + s * a.v_stride + h * kAttentionHeadDim + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) kv[i] = __bfloat162float(krow[i]), vv[i] = __bfloat162float(vrow[i]);
  for (int j = 0; j < m.q_count[kb]; ++j) {
    int qb = m.q_index[kb * m.max_q + j];
    for (int t = qb * kAttentionBlock; t < (qb + 1) * kAttentionBlock; ++t) {
      if (!attends(m, t, s)) continue;
      const bf16* qrow = q + t * a.q_stride + h * kAttentionHeadDim + lane * 4;
      const bf16* grow = dy + (size_t(t) * a.H + h) * kAttentionHeadDim + lane * 4;
      float qv[4], g[4], score = 0, dp = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        qv[i] = __bfloat162float(qrow[i]);
        g[i] = __bfloat162float(grow[i]);
        score += qv[i] * kv[i];
        dp += g[i] * vv[i];
      }
      score = warp_sum(score) * kAttentionScale;
      dp = warp_sum(dp);
      float p = __expf(score - lse[size_t(h) * a.T + t]);
      float ds = p * (dp - delta[size_t(h) * a.T + t]) * kAttentionScale;
#pragma unroll
      for (int i = 0; i < 4; ++i) dk_acc[i] += ds * qv[i], dv_acc[i] += p * g[i];
    }
  }
  size_t at = (size_t(s) * a.H + h) * kAttentionHeadDim + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) dk[at + i] = __float2bfloat16(dk_acc[i]), dv[at + i] = __float2bfloat16(dv_acc[i]);
}

// One micro-sequence's document ids and block lists for one window, on the device (in memory of
// the StagedUploads, valid until its next reset).
class AttentionMask {
 public:
  AttentionMask(const std::vector<int32_t>& docs, const AttentionBlockLists& lists, StagedUploads& uploads,
                cudaStream_t stream) {
    m_.num_blocks = lists.num_blocks;
    m_.max_kv = lists.max_kv;
    m_.max_q = lists.max_q;
    m_.docs = uploads.upload(docs, stream);
    m_.kv_count = uploads.upload(lists.kv_count, stream);
    m_.kv_index = uploads.upload(lists.kv_index, stream);
    m_.q_count = uploads.upload(lists.q_count, stream);
    m_.q_index = uploads.upload(lists.q_index, stream);
  }
  // What the constructor stages, for StagedUploads::reset.
  static size_t upload_bytes(const std::vector<int32_t>& docs, const AttentionBlockLists& lists) {
    return StagedUploads::bytes_for(docs) + StagedUploads::bytes_for(lists.kv_count) +
           StagedUploads::bytes_for(lists.kv_index) + StagedUploads::bytes_for(lists.q_count) +
           StagedUploads::bytes_for(lists.q_index);
  }
  const DeviceAttentionMask& device() const { return m_; }

 private:
  DeviceAttentionMask m_;
};

// T a whole number of 128-token blocks, as many as the mask has.
inline void check_attention_shape(const AttentionTensors& a, const AttentionMask& mask) {
  if (a.T % kAttentionBlock != 0 || mask.device().num_blocks != a.T / kAttentionBlock)
    throw std::invalid_argument("attention: T = " + std::to_string(a.T) + " must be a multiple of " +
                                std::to_string(kAttentionBlock) + " matching the mask");
}

inline int attention_grid(const AttentionTensors& a, int warps_per_block) {
  return (a.T * a.H + warps_per_block - 1) / warps_per_block;
}

// y, lse: [T, H, 128], [H, T]
inline void attention_forward(const bf16* q, const bf16* k, const bf16* v, bf16* y, float* lse, const AttentionTensors& a,
                              const AttentionMask& mask, cudaStream_t stream) {
  check_attention_shape(a, mask);
  attention_forward_kernel<<<attention_grid(a, 8), 256, 0, stream>>>(q, k, v, y, lse, a, mask.device());
  CUDA_CHECK_LAUNCH();
}

// delta: [H, T] scratch; dq, dk, dv: [T, H, 128]
inline void attention_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* y, const bf16* dy,
                               const float* lse, float* delta, bf16* dq, bf16* dk, bf16* dv,
                               const AttentionTensors& a, const AttentionMask& mask, cudaStream_t stream) {
  check_attention_shape(a, mask);
  attention_delta_kernel<<<attention_grid(a, 8), 256, 0, stream>>>(y, dy, delta, a.T, a.H);
  CUDA_CHECK_LAUNCH();
  attention_backward_dq_kernel<<<attention_grid(a, 8), 256, 0, stream>>>(q, k, v, dy, lse, delta, dq, a, mask.device());
  CUDA_CHECK_LAUNCH();
  attention_backward_dkv_kernel<<<attention_grid(a, 8), 256, 0, stream>>>(q, k, v, dy, lse, delta, dk, dv, a, mask.device());
  CUDA_CHECK_LAUNCH();
}
// ===== end of kernels/attention.cuh =====
// ===== kernels/cross_entropy.cuh (inlined) =====
// Softcapped cross-entropy over the padded vocabulary (SPEC 1.2.7), forward and backward fused:
// z = cap * sigmoid(logit / divisor), loss_t = logsumexp(z_t) - z_t[target]. One block per token;
// its row of bf16 logits is read once into shared memory, and the gradient of the SUMMED loss
// (times grad_scale) overwrites the logits in place or goes straight to the FP8 head's e5m2
// operand: no probability tensor is ever stored.

#include <cmath>
#include <stdexcept>
#include <string>

// The reference divides by 7.5 sqrt(d), which inductor turns into a product with the double's
// reciprocal rounded to fp32 (one ulp from the fp32 reciprocal of the fp32 divisor).
struct Softcap {
  static float reciprocal_divisor(int model_dim) { return float(1 / (7.5 * std::sqrt(double(model_dim)))); }
  static Softcap for_model_dim(int model_dim) {
    Softcap s;
    s.inv_divisor = reciprocal_divisor(model_dim);
    return s;
  }
  float cap = 30.0f;
  float inv_divisor = reciprocal_divisor(768);
};

constexpr int kCrossEntropyThreads = 1024;

// Where the loss gradient goes, 8 elements at a time (`element` indexes [T, V]): by default in
// place over the bf16 logits; the FP8 head (fp8_head.cuh) stores its e5m2 operand instead.
struct Bf16GradientInPlace {
  bf16* logits;
  __device__ void operator()(size_t element, const float g[8]) const { store8(logits + element, g); }
};

// logits [T, V] bf16, targets [T], losses [T] fp32; the gradient (when grad_scale != 0) to `store`.
// z <= cap, so exp(z - cap) never overflows and logsumexp needs no running maximum.
template <class GradientStore>
__global__ void __launch_bounds__(kCrossEntropyThreads)
softcap_cross_entropy_kernel(const bf16* logits, const uint16_t* targets, float* losses, int V, Softcap sc,
                             float grad_scale, GradientStore store) {
  extern __shared__ Bf16x8 row_smem[];  // [V / 8]
  const int t = blockIdx.x, vectors = V / 8;
  const float inv_divisor = sc.inv_divisor;
  const bf16* row = logits + size_t(t) * V;
  float sum = 0;
  for (int i = threadIdx.x; i < vectors; i += blockDim.x) {
    Bf16x8 x = reinterpret_cast<const Bf16x8*>(row)[i];
    row_smem[i] = x;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float sig = __fdividef(1.0f, 1.0f + __expf(-__bfloat162float(x.v[j]) * inv_divisor));
      sum += __expf(sc.cap * sig - sc.cap);
    }
  }
  sum = block_sum(sum);
  int target = targets[t];
  float z_target =
      __fdividef(sc.cap, 1.0f + __expf(-__bfloat162float(reinterpret_cast<const bf16*>(row_smem)[target]) * inv_divisor));
  if (threadIdx.x == 0) losses[t] = sc.cap + logf(sum) - z_target;
  if (grad_scale == 0.0f) return;
  float inv_sum = 1.0f / sum;
  for (int i = threadIdx.x; i < vectors; i += blockDim.x) {
    float g[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float sig = __fdividef(1.0f, 1.0f + __expf(-__bfloat162float(row_smem[i].v[j]) * inv_divisor));
      float p = __expf(sc.cap * sig - sc.cap) * inv_sum;
      float dz = p - (i * 8 + j == target ? 1.0f : 0.0f);
      g[j] = dz * (grad_scale * sc.cap * inv_divisor) * sig * (1.0f - sig);
    }
    store(size_t(t) * V + i * 8, g);
  }
}

// Token losses of logits [T, V] and, unless grad_scale is 0, the gradient of their SUM (times
// grad_scale) handed to `store`. The row read ends before any store, so a store may overwrite it.
template <class GradientStore>
void softcap_cross_entropy(const bf16* logits, const uint16_t* targets, float* losses, int T, int V, float grad_scale,
                           GradientStore store, cudaStream_t stream, Softcap sc) {
  if (V % 8) throw std::invalid_argument("cross entropy: vocab " + std::to_string(V) + " is not a multiple of 8");
  size_t smem = size_t(V) * sizeof(bf16);
  CUDA_CHECK(cudaFuncSetAttribute(softcap_cross_entropy_kernel<GradientStore>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  softcap_cross_entropy_kernel<GradientStore>
      <<<T, kCrossEntropyThreads, smem, stream>>>(logits, targets, losses, V, sc, grad_scale, store);
  CUDA_CHECK_LAUNCH();
}

// grad_scale = 1: the gradient of the summed loss (training) overwrites the logits; 0: losses only
// (evaluation).
inline void softcap_cross_entropy(bf16* logits, const uint16_t* targets, float* losses, int T, int V,
                                  float grad_scale, cudaStream_t stream, Softcap sc = {}) {
  softcap_cross_entropy(logits, targets, losses, T, V, grad_scale, Bf16GradientInPlace{logits}, stream, sc);
}

constexpr int kLossSumThreads = 1024;

// *total += losses[0] + ... + losses[T - 1] in double, in a fixed order (one block).
__global__ void __launch_bounds__(kLossSumThreads) accumulate_loss_kernel(const float* losses, int T, double* total) {
  __shared__ double partial[kLossSumThreads];
  double sum = 0;
  for (int t = threadIdx.x; t < T; t += blockDim.x) sum += losses[t];
  partial[threadIdx.x] = sum;
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    __syncthreads();
    if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
  }
  if (threadIdx.x == 0) *total += partial[0];
}

// The step's losses summed on the device as micro-sequences finish: the host reads the total once
// per step (or validation) instead of waiting for every micro-sequence.
inline void accumulate_loss(const float* losses, int T, double* total, cudaStream_t stream) {
  accumulate_loss_kernel<<<1, kLossSumThreads, 0, stream>>>(losses, T, total);
  CUDA_CHECK_LAUNCH();
}
// ===== end of kernels/cross_entropy.cuh =====
// ===== kernels/device_comm.cuh (inlined) =====
// The collectives of the trainer on device buffers, ordered on CUDA streams (SPEC 4.3, 4.4), with
// two backends: NCCL across processes (one per GPU: the production path) and W simulated ranks as
// threads of one process on one GPU, each with its own stream, whose collectives read the other
// ranks' buffers directly and reduce in rank order (deterministic; NCCL below 2.30 refuses two
// ranks on one GPU). Gradients are only ever SUM-reduced (SPEC 4.2). The gradient traffic modes
// of SPEC 4.3 sit on top: fp32 reduce-scatter, bf16 reduce-scatter, bf16 all-to-all with the
// owner summing in fp32 in rank order.
// ===== kernels/comm.h (inlined) =====
// The collectives the trainer needs, behind one small interface (SPEC 4.4): a production backend
// (NCCL, one process per GPU) and a simulated one, W virtual ranks as threads of one process whose
// collectives rendezvous and reduce in a fixed rank order, so results are bitwise deterministic.
// Gradients are only ever SUM-reduced (SPEC 4.2): there is no AVG anywhere.
// ===== kernels/faults.h (inlined) =====
// Test-only fault switch: known distributed bugs that the oracle (tests/test_oracle.cpp) must catch,
// wrong results of the fast paths that the start-up self-check (self_check.cuh) must catch, and
// DiLoCo's outer-loop bugs that its oracle (tests/gpu/test_diloco.cu) must catch.
// Production code never sets it; the communication and optimizer layers and the self-check read it.

enum class Fault {
  none,
  avg_instead_of_sum,          // reduce-scatter divides its sum by the world size
  local_count_normalization,   // gradients normalised by the rank's own micro-sequence count
  prescale_by_world,           // each rank divides its gradient by W before the SUM
  drop_rank_contribution,      // the last rank's contribution is left out of every reduce-scatter
  wrong_shard_offset,          // DistAdam updates the parameter slice of the next rank
  skip_all_gather,             // Muon's all-gather is skipped: other ranks keep stale matrices
  replicated_count_per_rank,   // every rank contributes the (replicated) global count to its sum
  wrong_flash_attention,       // the self-check sees the flash kernels' outputs 25% off
  wrong_fp8_head,              // ... the FP8 head's products
  wrong_fused_e5m2_gradient,   // ... the cross-entropy's fused e5m2 gradient
  wrong_batched_muon,          // ... the batched Muon update
  wrong_fused_residual_add,    // ... the matmul with the residual as cuBLASLt's C
  diloco_flipped_sign,         // DiLoCo's pseudo-gradient is local - global (torchft#233's bug)
  diloco_mix_to_copy,          // the mix of local and global is written to a copy, not in place
  diloco_average_by_world,     // the pseudo-gradients' sum is divided by W instead of G
  diloco_wrong_fragment,       // each sync exchanges the next fragment instead of its own
  diloco_momentum_reset,       // the outer momentum starts from zero at every sync
  diloco_delay_wrong_step,     // an exchange is applied one step after its delay
  local_matrix_gradient,       // a hidden matrix's owner updates it (REKLS factors, moments) from its own partial sum
  rekls_rotation_untransposed, // REKLS rotates the update back by Q_L U Q_R instead of Q_L U Q_R^T
};

inline Fault& injected_fault() {
  static Fault fault = Fault::none;
  return fault;
}

// Sets a fault for the lifetime of the guard and always restores Fault::none (an exception too).
struct ScopedFault {
  explicit ScopedFault(Fault f) { injected_fault() = f; }
  ~ScopedFault() { injected_fault() = Fault::none; }
  ScopedFault(const ScopedFault&) = delete;
  ScopedFault& operator=(const ScopedFault&) = delete;
};

inline const char* fault_name(Fault f) {
  switch (f) {
    case Fault::none: return "none";
    case Fault::avg_instead_of_sum: return "avg_instead_of_sum";
    case Fault::local_count_normalization: return "local_count_normalization";
    case Fault::prescale_by_world: return "prescale_by_world";
    case Fault::drop_rank_contribution: return "drop_rank_contribution";
    case Fault::wrong_shard_offset: return "wrong_shard_offset";
    case Fault::skip_all_gather: return "skip_all_gather";
    case Fault::replicated_count_per_rank: return "replicated_count_per_rank";
    case Fault::wrong_flash_attention: return "wrong_flash_attention";
    case Fault::wrong_fp8_head: return "wrong_fp8_head";
    case Fault::wrong_fused_e5m2_gradient: return "wrong_fused_e5m2_gradient";
    case Fault::wrong_batched_muon: return "wrong_batched_muon";
    case Fault::wrong_fused_residual_add: return "wrong_fused_residual_add";
    case Fault::diloco_flipped_sign: return "diloco_flipped_sign";
    case Fault::diloco_mix_to_copy: return "diloco_mix_to_copy";
    case Fault::diloco_average_by_world: return "diloco_average_by_world";
    case Fault::diloco_wrong_fragment: return "diloco_wrong_fragment";
    case Fault::diloco_momentum_reset: return "diloco_momentum_reset";
    case Fault::diloco_delay_wrong_step: return "diloco_delay_wrong_step";
    case Fault::local_matrix_gradient: return "local_matrix_gradient";
    case Fault::rekls_rotation_untransposed: return "rekls_rotation_untransposed";
  }
  return "?";
}
// ===== end of kernels/faults.h =====

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

enum class DType { f32, f64 };

inline size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 8; }

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }

// Collectives of one rank. Every call is collective: all ranks make the same calls in one order.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // send: [W * count]; recv: [count] = sum over ranks q = 0..W-1, in that order, of send_q[rank * count + i]
  virtual void reduce_scatter_sum(const void* send, void* recv, size_t count, DType dtype) = 0;
  // send: [count]; recv: [W * count], slot q holds rank q's send
  virtual void all_gather(const void* send, void* recv, size_t count, DType dtype) = 0;
  // send: [W * count], chunk q goes to rank q; recv: [W * count], chunk q came from rank q
  virtual void all_to_all(const void* send, void* recv, size_t count, DType dtype) = 0;
  virtual double all_reduce_sum(double value) = 0;  // a scalar, summed in rank order
  virtual void barrier() = 0;
};

template <typename T>
void reduce_scatter_sum(Communicator& c, const T* send, T* recv, size_t count) {
  c.reduce_scatter_sum(send, recv, count, dtype_of<T>());
}
template <typename T>
void all_gather(Communicator& c, const T* send, T* recv, size_t count) {
  c.all_gather(send, recv, count, dtype_of<T>());
}
template <typename T>
void all_to_all(Communicator& c, const T* send, T* recv, size_t count) {
  c.all_to_all(send, recv, count, dtype_of<T>());
}

// Thrown in every waiting rank when another rank of the simulated world failed.
struct WorldAborted : std::runtime_error {
  WorldAborted() : std::runtime_error("another rank of the simulated world failed") {}
};

// W ranks as threads of one process that meet at barriers. If a rank throws, the others are
// released from any barrier they wait in (with WorldAborted), and run() rethrows the error of the
// lowest rank that failed on its own (deterministic, unlike "first in time"): nothing hangs.
// The simulated worlds of host memory (below) and of device memory (kernels/device_comm.cuh)
// build their collectives on it.
class RankThreads {
 public:
  explicit RankThreads(int world_size) : world_size_(world_size) {
    if (world_size < 1) throw std::invalid_argument("world size " + std::to_string(world_size) + " < 1");
  }
  int world_size() const { return world_size_; }

  // Runs per_rank(rank) on W threads and joins them.
  void run(const std::function<void(int rank)>& per_rank) {
    aborted_ = false;
    std::vector<std::exception_ptr> errors(world_size_);
    std::vector<std::thread> threads;
    try {
      for (int r = 0; r < world_size_; ++r)
        threads.emplace_back([&, r] {
          try {
            per_rank(r);
          } catch (...) {
            errors[r] = std::current_exception();
            abort_all();
          }
        });
    } catch (...) {  // a thread could not start: release the started ones before failing
      abort_all();
      for (std::thread& t : threads) t.join();
      throw;
    }
    for (std::thread& t : threads) t.join();
    std::exception_ptr first_real = nullptr, first_any = nullptr;
    for (const std::exception_ptr& e : errors) {
      if (!e) continue;
      if (!first_any) first_any = e;
      try { std::rethrow_exception(e); } catch (const WorldAborted&) {} catch (...) { if (!first_real) first_real = e; }
    }
    if (first_real) std::rethrow_exception(first_real);
    if (first_any) std::rethrow_exception(first_any);
  }

  // A world whose ranks are threads of this one (a split of it): released when this one fails.
  // It unregisters itself before it is destroyed; this world outlives it.
  void add_child(RankThreads* child) {
    std::lock_guard<std::mutex> lock(mutex_);
    children_.push_back(child);
  }
  void remove_child(RankThreads* child) {
    std::lock_guard<std::mutex> lock(mutex_);
    children_.erase(std::remove(children_.begin(), children_.end(), child), children_.end());
  }

  // A generation-counting barrier that throws WorldAborted once any rank failed.
  void meet() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (aborted_) throw WorldAborted();
    uint64_t generation = generation_;
    if (++arrived_ == world_size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != generation || aborted_; });
    if (generation_ == generation) throw WorldAborted();
  }

 private:
  void abort_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = true;
    arrived_ = 0;
    cv_.notify_all();
    for (RankThreads* child : children_) child->abort_all();
  }

  int world_size_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  std::vector<RankThreads*> children_;
};

// W virtual ranks in host memory. Each collective: every rank posts its send pointer, meets the
// others at a barrier, computes its own output by reading all posted buffers in rank order, and
// meets them again before any send buffer may be reused.
class SimulatedWorld {
 public:
  explicit SimulatedWorld(int world_size) : threads_(world_size), posted_(world_size), scalars_(world_size) {}
  int world_size() const { return threads_.world_size(); }

  void run(const std::function<void(Communicator&)>& per_rank) {
    threads_.run([&](int rank) {
      Rank comm(*this, rank);
      per_rank(comm);
    });
  }

 private:
  class Rank : public Communicator {
   public:
    Rank(SimulatedWorld& world, int rank) : world_(world), rank_(rank) {}
    int rank() const override { return rank_; }
    int world_size() const override { return world_.world_size(); }
    void reduce_scatter_sum(const void* send, void* recv, size_t count, DType dtype) override {
      world_.collective(rank_, send, [&] { world_.reduce_own_chunk(rank_, recv, count, dtype); });
    }
    void all_gather(const void* send, void* recv, size_t count, DType dtype) override {
      world_.collective(rank_, send, [&] {
        size_t bytes = count * dtype_size(dtype);
        for (int q = 0; q < world_.world_size(); ++q)
          std::memcpy(static_cast<char*>(recv) + q * bytes, world_.posted_[q], bytes);
      });
    }
    void all_to_all(const void* send, void* recv, size_t count, DType dtype) override {
      world_.collective(rank_, send, [&] {
        size_t bytes = count * dtype_size(dtype);
        for (int q = 0; q < world_.world_size(); ++q)
          std::memcpy(static_cast<char*>(recv) + q * bytes, static_cast<const char*>(world_.posted_[q]) + rank_ * bytes, bytes);
      });
    }
    double all_reduce_sum(double value) override {
      double sum = 0;
      world_.scalars_[rank_] = value;
      world_.collective(rank_, nullptr, [&] {
        for (double v : world_.scalars_) sum += v;
      });
      return sum;
    }
    void barrier() override { world_.threads_.meet(); }

   private:
    SimulatedWorld& world_;
    int rank_;
  };

  // out: [count] = rank-order sum of every posted send's chunk `rank`, accumulated in T so that
  // the result does not depend on thread timing. The test-only faults are read once per call.
  template <typename T>
  void reduce_chunk(int rank, T* out, size_t count) const {
    const Fault fault = injected_fault();
    const int world_size = threads_.world_size();
    const int contributors = fault == Fault::drop_rank_contribution && world_size > 1 ? world_size - 1 : world_size;
    const bool average = fault == Fault::avg_instead_of_sum;
    for (size_t i = 0; i < count; ++i) {
      T sum = 0;
      for (int q = 0; q < contributors; ++q) sum += static_cast<const T*>(posted_[q])[rank * count + i];
      out[i] = average ? sum / T(world_size) : sum;
    }
  }
  void reduce_own_chunk(int rank, void* recv, size_t count, DType dtype) const {
    if (dtype == DType::f32) reduce_chunk(rank, static_cast<float*>(recv), count);
    else reduce_chunk(rank, static_cast<double*>(recv), count);
  }

  // Post, meet, compute this rank's output, meet again.
  void collective(int rank, const void* send, const std::function<void()>& compute_own_output) {
    posted_[rank] = send;
    threads_.meet();
    compute_own_output();
    threads_.meet();
  }

  RankThreads threads_;
  std::vector<const void*> posted_;  // [W] send buffers of the collective in progress
  std::vector<double> scalars_;      // [W] values of the scalar all-reduce in progress
};
// ===== end of kernels/comm.h =====

#include <nccl.h>

#include <algorithm>
#include <exception>
#include <memory>
#include <string>
#include <vector>

enum class DeviceDType { f32, bf16 };

inline size_t dtype_size(DeviceDType t) { return t == DeviceDType::f32 ? 4 : 2; }

class DeviceCommunicator {
 public:
  virtual ~DeviceCommunicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // send: [W * count]; recv: [count] = sum over ranks q of send_q[rank * count + i]
  virtual void reduce_scatter_sum(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) = 0;
  // send: [count], may be recv + rank * count (in place); recv: [W * count], slot q from rank q
  virtual void all_gather(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) = 0;
  // send: [W * count], chunk q goes to rank q; recv: [W * count], chunk q came from rank q
  virtual void all_to_all(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) = 0;
  // send: [count], recv: [count] = the sum over ranks q, in rank order where the backend keeps one,
  // of send_q; recv is another buffer than send (the simulated ranks read each other's sends)
  virtual void all_reduce_sum(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) = 0;
  // A host scalar summed over the ranks (validation losses and token counts); synchronous.
  virtual double all_reduce_sum(double value) = 0;
  // The ranks of this communicator with the same color, as a communicator of their own, ranked by
  // key (ties by rank); collective: every rank calls it, in the same order as its other calls.
  virtual std::unique_ptr<DeviceCommunicator> split(int color, int key) = 0;
};

// ------------------------------------------------------------------------------------------------
// NCCL: one process per GPU.
// ------------------------------------------------------------------------------------------------
class NcclCommunicator : public DeviceCommunicator {
 public:
  NcclCommunicator(int rank, int world_size, const ncclUniqueId& id) : rank_(rank), world_size_(world_size) {
    NCCL_CHECK(ncclCommInitRank(&comm_, world_size, id, rank));
    CUDA_CHECK(cudaMalloc(&scalar_, sizeof(double)));
    CUDA_CHECK(cudaStreamCreateWithFlags(&scalar_stream_, cudaStreamNonBlocking));
  }
  // Leaving on an exception, the queued collectives may wait for peers that will never join them:
  // ncclCommDestroy would wait with them, ncclCommAbort does not.
  ~NcclCommunicator() override {
    if (std::uncaught_exceptions() > 0)
      ncclCommAbort(comm_);
    else
      ncclCommDestroy(comm_);
    cudaFree(scalar_);
    cudaStreamDestroy(scalar_stream_);
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  std::unique_ptr<DeviceCommunicator> split(int color, int key) override {
    ncclComm_t part = nullptr;
    NCCL_CHECK(ncclCommSplit(comm_, color, key, &part, nullptr));
    int rank = 0, size = 0;
    NCCL_CHECK(ncclCommUserRank(part, &rank));
    NCCL_CHECK(ncclCommCount(part, &size));
    return std::unique_ptr<DeviceCommunicator>(new NcclCommunicator(part, rank, size));
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  void reduce_scatter_sum(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
    NCCL_CHECK(ncclReduceScatter(send, recv, count, nccl_type(dtype), ncclSum, comm_, stream));
  }
  void all_gather(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
    NCCL_CHECK(ncclAllGather(send, recv, count, nccl_type(dtype), comm_, stream));
  }
  void all_reduce_sum(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
    NCCL_CHECK(ncclAllReduce(send, recv, count, nccl_type(dtype), ncclSum, comm_, stream));
  }
  void all_to_all(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
    const size_t bytes = count * dtype_size(dtype);
    NCCL_CHECK(ncclGroupStart());
    for (int q = 0; q < world_size_; ++q) {
      NCCL_CHECK(ncclSend(static_cast<const char*>(send) + q * bytes, count, nccl_type(dtype), q, comm_, stream));
      NCCL_CHECK(ncclRecv(static_cast<char*>(recv) + q * bytes, count, nccl_type(dtype), q, comm_, stream));
    }
    NCCL_CHECK(ncclGroupEnd());
  }
  // On a stream of its own: callers hold it to moments when no other collective of the communicator
  // is in flight (the trainer's are after a step's or validation's sync), since collectives of one
  // communicator on two streams at once may wait on each other across ranks and hang.
  double all_reduce_sum(double value) override {
    CUDA_CHECK(cudaMemcpyAsync(scalar_, &value, sizeof value, cudaMemcpyHostToDevice, scalar_stream_));
    NCCL_CHECK(ncclAllReduce(scalar_, scalar_, 1, ncclFloat64, ncclSum, comm_, scalar_stream_));
    CUDA_CHECK(cudaMemcpyAsync(&value, scalar_, sizeof value, cudaMemcpyDeviceToHost, scalar_stream_));
    CUDA_CHECK(cudaStreamSynchronize(scalar_stream_));
    return value;
  }

 private:
  NcclCommunicator(ncclComm_t comm, int rank, int world_size) : rank_(rank), world_size_(world_size), comm_(comm) {
    CUDA_CHECK(cudaMalloc(&scalar_, sizeof(double)));
    CUDA_CHECK(cudaStreamCreateWithFlags(&scalar_stream_, cudaStreamNonBlocking));
  }
  static ncclDataType_t nccl_type(DeviceDType t) { return t == DeviceDType::f32 ? ncclFloat32 : ncclBfloat16; }
  int rank_, world_size_;
  ncclComm_t comm_ = nullptr;
  double* scalar_ = nullptr;
  cudaStream_t scalar_stream_ = nullptr;
};

// ------------------------------------------------------------------------------------------------
// Simulated ranks on one GPU.
// ------------------------------------------------------------------------------------------------
constexpr int kMaxSimulatedRanks = 16;

struct RankBuffers {
  const void* at[kMaxSimulatedRanks];
};

// out[count] = sum over q < contributors, in order, of in.at[q][offset + i] (fp32 accumulation);
// divided by `divisor` (1, or W for the injected AVG fault).
template <typename T>
__global__ void sum_rank_buffers_kernel(RankBuffers in, int contributors, size_t offset, T* out, size_t count,
                                        float divisor) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    float sum = 0;
    for (int q = 0; q < contributors; ++q) sum += float(static_cast<const T*>(in.at[q])[offset + i]);
    out[i] = T(sum / divisor);
  }
}

// Each collective: every rank records "ready" on its stream and posts its send buffer; at a
// barrier each rank's stream waits for every rank's ready, then reads the posted buffers in rank
// order; each records "done", and after a second barrier every stream waits for every done, so no
// rank overwrites a send buffer that another rank's stream still reads.
class SimulatedDeviceWorld {
 public:
  // parent: the world whose threads are this one's ranks (a split), released when it fails.
  explicit SimulatedDeviceWorld(int world_size, RankThreads* parent = nullptr)
      : threads_(world_size), posted_(world_size), scalars_(world_size), ready_(world_size), done_(world_size),
        split_keys_(world_size), split_parts_(world_size), parent_(parent) {
    if (world_size > kMaxSimulatedRanks)
      throw std::invalid_argument("at most " + std::to_string(kMaxSimulatedRanks) + " simulated ranks");
    for (int r = 0; r < world_size; ++r) {
      CUDA_CHECK(cudaEventCreateWithFlags(&ready_[r], cudaEventDisableTiming));
      CUDA_CHECK(cudaEventCreateWithFlags(&done_[r], cudaEventDisableTiming));
    }
    if (parent_) parent_->add_child(&threads_);
  }
  ~SimulatedDeviceWorld() {
    if (parent_) parent_->remove_child(&threads_);
    for (cudaEvent_t e : ready_) cudaEventDestroy(e);
    for (cudaEvent_t e : done_) cudaEventDestroy(e);
  }
  SimulatedDeviceWorld(const SimulatedDeviceWorld&) = delete;
  SimulatedDeviceWorld& operator=(const SimulatedDeviceWorld&) = delete;
  int world_size() const { return threads_.world_size(); }

  void run(const std::function<void(DeviceCommunicator&)>& per_rank) {
    threads_.run([&](int rank) {
      Rank comm(*this, rank);
      per_rank(comm);
    });
  }

 private:
  class Rank : public DeviceCommunicator {
   public:
    Rank(SimulatedDeviceWorld& world, int rank) : world_(world), rank_(rank) {}
    int rank() const override { return rank_; }
    int world_size() const override { return world_.world_size(); }
    void reduce_scatter_sum(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
      world_.collective(rank_, send, stream, [&] {
        const Fault fault = injected_fault();
        const int W = world_.world_size();
        const int contributors = fault == Fault::drop_rank_contribution && W > 1 ? W - 1 : W;
        const float divisor = fault == Fault::avg_instead_of_sum ? float(W) : 1.0f;
        world_.sum_posted(contributors, rank_ * count, recv, count, dtype, divisor, stream);
      });
    }
    void all_gather(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
      world_.collective(rank_, send, stream, [&] {
        const size_t bytes = count * dtype_size(dtype);
        for (int q = 0; q < world_.world_size(); ++q)
          if (static_cast<char*>(recv) + q * bytes != world_.posted_[q])
            CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(recv) + q * bytes, world_.posted_[q], bytes,
                                       cudaMemcpyDeviceToDevice, stream));
      });
    }
    void all_to_all(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
      world_.collective(rank_, send, stream, [&] {
        const size_t bytes = count * dtype_size(dtype);
        for (int q = 0; q < world_.world_size(); ++q)
          CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(recv) + q * bytes,
                                     static_cast<const char*>(world_.posted_[q]) + rank_ * bytes, bytes,
                                     cudaMemcpyDeviceToDevice, stream));
      });
    }
    void all_reduce_sum(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
      if (send == recv) throw std::invalid_argument("simulated all_reduce_sum: recv must not be send");
      world_.collective(rank_, send, stream, [&] { world_.sum_posted(world_.world_size(), 0, recv, count, dtype, 1.0f, stream); });
    }
    std::unique_ptr<DeviceCommunicator> split(int color, int key) override { return world_.split(rank_, color, key); }
    double all_reduce_sum(double value) override {
      world_.scalars_[rank_] = value;
      world_.threads_.meet();
      double sum = 0;
      for (double v : world_.scalars_) sum += v;
      world_.threads_.meet();  // nobody overwrites scalars_ before every rank has read them
      return sum;
    }

   private:
    SimulatedDeviceWorld& world_;
    int rank_;
  };

  // A rank of a split, keeping its world alive.
  class PartRank : public Rank {
   public:
    PartRank(std::shared_ptr<SimulatedDeviceWorld> world, int rank) : Rank(*world, rank), world_(std::move(world)) {}

   private:
    std::shared_ptr<SimulatedDeviceWorld> world_;
  };

  // Every rank posts its (color, key); the first rank of each color builds that color's world,
  // whose threads are this world's, and each rank takes its place in it.
  std::unique_ptr<DeviceCommunicator> split(int rank, int color, int key) {
    split_keys_[rank] = {color, key};
    threads_.meet();
    std::vector<int> members;  // ranks of this color by (key, rank)
    for (int q = 0; q < world_size(); ++q)
      if (split_keys_[q].first == color) members.push_back(q);
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return split_keys_[a].second < split_keys_[b].second; });
    if (rank == members[0]) split_parts_[rank] = std::make_shared<SimulatedDeviceWorld>(int(members.size()), &threads_);
    threads_.meet();
    std::shared_ptr<SimulatedDeviceWorld> part = split_parts_[members[0]];
    const int part_rank = int(std::find(members.begin(), members.end(), rank) - members.begin());
    threads_.meet();  // every rank holds its part before the slots are cleared
    split_parts_[rank].reset();
    return std::make_unique<PartRank>(std::move(part), part_rank);
  }

  void collective(int rank, const void* send, cudaStream_t stream, const std::function<void()>& read_posted) {
    CUDA_CHECK(cudaEventRecord(ready_[rank], stream));
    posted_[rank] = send;
    threads_.meet();
    for (cudaEvent_t e : ready_) CUDA_CHECK(cudaStreamWaitEvent(stream, e, 0));
    read_posted();
    CUDA_CHECK(cudaEventRecord(done_[rank], stream));
    threads_.meet();
    for (cudaEvent_t e : done_) CUDA_CHECK(cudaStreamWaitEvent(stream, e, 0));
  }

  void sum_posted(int contributors, size_t offset, void* out, size_t count, DeviceDType dtype, float divisor,
                  cudaStream_t stream) const {
    RankBuffers in{};
    for (int q = 0; q < world_size(); ++q) in.at[q] = posted_[q];
    if (dtype == DeviceDType::f32)
      sum_rank_buffers_kernel<<<elementwise_grid(count), 256, 0, stream>>>(in, contributors, offset,
                                                                           static_cast<float*>(out), count, divisor);
    else
      sum_rank_buffers_kernel<<<elementwise_grid(count), 256, 0, stream>>>(in, contributors, offset,
                                                                           static_cast<bf16*>(out), count, divisor);
    CUDA_CHECK_LAUNCH();
  }

  RankThreads threads_;
  std::vector<const void*> posted_;  // [W] send buffers of the collective in progress
  std::vector<double> scalars_;      // [W] values of the scalar all-reduce in progress
  std::vector<cudaEvent_t> ready_, done_;
  std::vector<std::pair<int, int>> split_keys_;                        // [W] (color, key) of a split in progress
  std::vector<std::shared_ptr<SimulatedDeviceWorld>> split_parts_;     // [W] the parts it builds, by first rank
  RankThreads* parent_ = nullptr;
};

// ------------------------------------------------------------------------------------------------
// Gradient traffic (SPEC 4.3): how a rank's fp32 gradient sums reach their owners.
// ------------------------------------------------------------------------------------------------
enum class GradComm {
  fp32_rs,      // reduce-scatter of the fp32 sums
  bf16_rs,      // bf16 reduce-scatter: half the bytes, NCCL sums in bf16
  a2a_fp32acc,  // bf16 chunks sent to their owner, who sums the W chunks in fp32 in rank order
};

inline GradComm parse_grad_comm(const std::string& name) {
  if (name == "fp32-rs") return GradComm::fp32_rs;
  if (name == "bf16-rs") return GradComm::bf16_rs;
  if (name == "a2a-fp32acc") return GradComm::a2a_fp32acc;
  throw std::invalid_argument("grad-comm '" + name + "' is not one of fp32-rs, bf16-rs, a2a-fp32acc");
}

// out[count] = sum over q of in[q * count + i], fp32 accumulation in rank order
__global__ void sum_chunks_kernel(const bf16* in, int chunks, float* out, size_t count) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    float sum = 0;
    for (int q = 0; q < chunks; ++q) sum += __bfloat162float(in[q * count + i]);
    out[i] = sum;
  }
}

// send: [W * count] fp32 partial sums, chunk r owned by rank r; recv: [count] fp32 = the SUM of
// every rank's chunk `rank`. scratch: [2 * W * count] bf16 for the bf16 modes.
inline void reduce_scatter_grads(DeviceCommunicator& comm, GradComm mode, const float* send, float* recv, size_t count,
                                 bf16* scratch, cudaStream_t stream) {
  const size_t total = count * comm.world_size();
  switch (mode) {
    case GradComm::fp32_rs: comm.reduce_scatter_sum(send, recv, count, DeviceDType::f32, stream); return;
    case GradComm::bf16_rs:
      convert(send, scratch, total, stream);
      comm.reduce_scatter_sum(scratch, scratch + total, count, DeviceDType::bf16, stream);
      convert(scratch + total, recv, count, stream);
      return;
    case GradComm::a2a_fp32acc:
      convert(send, scratch, total, stream);
      comm.all_to_all(scratch, scratch + total, count, DeviceDType::bf16, stream);
      sum_chunks_kernel<<<elementwise_grid(count), 256, 0, stream>>>(scratch + total, comm.world_size(), recv, count);
      CUDA_CHECK_LAUNCH();
      return;
  }
}

// Bytes one rank sends for gradients per step: every gradient element leaves once (W-1 of W
// chunks travel; the own chunk stays), 4 bytes in fp32, 2 in bf16.
inline double gradient_bytes_sent(GradComm mode, double gradient_elements, int world_size) {
  return gradient_elements * (world_size - 1) / world_size * (mode == GradComm::fp32_rs ? 4 : 2);
}

// One process alone: every collective is the identity (a copy when the buffers differ), so the
// W = 1 trainer runs the same sharded optimizer code as W > 1.
class SingleRankCommunicator : public DeviceCommunicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  void reduce_scatter_sum(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
    copy(send, recv, count * dtype_size(dtype), stream);
  }
  void all_gather(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
    copy(send, recv, count * dtype_size(dtype), stream);
  }
  void all_to_all(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
    copy(send, recv, count * dtype_size(dtype), stream);
  }
  void all_reduce_sum(const void* send, void* recv, size_t count, DeviceDType dtype, cudaStream_t stream) override {
    copy(send, recv, count * dtype_size(dtype), stream);
  }
  double all_reduce_sum(double value) override { return value; }
  std::unique_ptr<DeviceCommunicator> split(int, int) override { return std::make_unique<SingleRankCommunicator>(); }

 private:
  static void copy(const void* from, void* to, size_t bytes, cudaStream_t stream) {
    if (from != to) CUDA_CHECK(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, stream));
  }
};
// ===== end of kernels/device_comm.cuh =====
// ===== kernels/diloco.cuh (inlined) =====
// Streaming DiLoCo across replica groups (Douillard et al. 2025, "Streaming DiLoCo with overlapping
// communication"). The W ranks form G groups of L = W/G consecutive ranks (a node each, typically);
// inside a group the trainer's step runs unchanged over the group's communicator, and across groups
// nothing moves but fragment exchanges. The model is cut into F fragments; every H/F steps one
// fragment, in turn, is exchanged, so each syncs once every H steps:
//   pseudo-gradient   Δ = global − local                  (the outer step global − lr·Δ moves
//                                                           toward the local progress: torchft#233)
//   average           Δ̄ = (Σ over groups Δ) / G           (an all-reduce among the ranks with the
//                                                           same place in every group)
//   outer Nesterov    m = μ·m + Δ̄;  global −= lr·(Δ̄ + μ·m)  (torch.optim.SGD, nesterov=True)
//   mix, in place     local = global + α·(local − global)  (lerp toward the local; α = 0: global)
// The exchange starts after its sync step and is applied d steps later (0 <= d < H/F), the steps
// between hiding the network; the local parameters at that point are mixed, so with α = 0 the
// local progress of those d steps is replaced. One exchange is in flight at a time.
//
// Sharding: rank l of a group owns the l-th of L equal slices of each fragment's elements (the
// fragment's parameters back to back, in parameter order), holds the global copy and the outer
// momentum of that slice only, exchanges only it (so the L ranks of a group use L links at once),
// and all-gathers the mixed slice back to the group's other ranks.
// ===== kernels/timeline.cuh (inlined) =====
// The schedule of a training step as the GPU ran it: spans of work on named lanes (the compute
// stream, the communication stream), timed by CUDA events recorded on those streams, written as
// a Chrome trace (chrome://tracing or ui.perfetto.dev). Off unless asked for: a span with no
// timeline records nothing.

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

class Timeline {
 public:
  Timeline() = default;
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;
  ~Timeline() {
    for (Span& s : spans_) {
      cudaEventDestroy(s.start);
      cudaEventDestroy(s.end);
    }
  }

  // Returns the span's index for close().
  size_t open(const std::string& lane, const std::string& name, cudaStream_t stream) {
    Span s{lane, name, event(), event()};
    CUDA_CHECK(cudaEventRecord(s.start, stream));
    spans_.push_back(s);
    return spans_.size() - 1;
  }
  // Unchecked, as it runs in destructors: a failed record leaves an error that the next checked
  // call on the stream, or write_chrome_trace, reports.
  void close(size_t span, cudaStream_t stream) noexcept { cudaEventRecord(spans_[span].end, stream); }

  // Waits for the spans' work; times are microseconds from the first span's start. Each lane is
  // a thread of the process `process_id`, named by a metadata event.
  void write_chrome_trace(const std::string& path, int process_id) const {
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<std::string> lanes;
    std::vector<std::string> events;
    char line[512];
    for (const Span& s : spans_) {
      size_t lane = std::find(lanes.begin(), lanes.end(), s.lane) - lanes.begin();
      if (lane == lanes.size()) {
        lanes.push_back(s.lane);
        std::snprintf(line, sizeof line,
                      "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %zu, \"args\": {\"name\": \"%s\"}}",
                      process_id, lane, s.lane.c_str());
        events.push_back(line);
      }
      float start_ms = 0, length_ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&start_ms, spans_[0].start, s.start));
      CUDA_CHECK(cudaEventElapsedTime(&length_ms, s.start, s.end));
      std::snprintf(line, sizeof line, "{\"name\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": %zu, \"ts\": %.1f, \"dur\": %.1f}",
                    s.name.c_str(), process_id, lane, 1000.0 * start_ms, 1000.0 * length_ms);
      events.push_back(line);
    }
    std::ofstream out(path);
    out << "{\"traceEvents\": [\n";
    for (size_t i = 0; i < events.size(); ++i) out << events[i] << (i + 1 < events.size() ? ",\n" : "\n");
    out << "]}\n";
    if (!out.flush()) throw std::runtime_error("cannot write the timeline " + path);
  }

 private:
  struct Span {
    std::string lane, name;
    cudaEvent_t start, end;
  };
  static cudaEvent_t event() {
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreate(&e));  // with timing
    return e;
  }
  std::vector<Span> spans_;
};

// One span over the work queued on `stream` during this scope; nothing without a timeline.
class TimelineSpan {
 public:
  TimelineSpan(Timeline* timeline, const char* lane, const std::string& name, cudaStream_t stream)
      : timeline_(timeline), stream_(stream) {
    if (timeline_) span_ = timeline_->open(lane, name, stream);
  }
  ~TimelineSpan() {
    if (timeline_) timeline_->close(span_, stream_);
  }
  TimelineSpan(const TimelineSpan&) = delete;
  TimelineSpan& operator=(const TimelineSpan&) = delete;

 private:
  Timeline* timeline_;
  cudaStream_t stream_;
  size_t span_ = 0;
};
// ===== end of kernels/timeline.cuh =====

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

struct DiLoCoSettings {
  int groups = 1;             // G; 1: no DiLoCo, the trainer as it is
  int fragments = 3;          // F
  int sync_every = 30;        // H: steps between two syncs of one fragment (a multiple of F)
  int delay = 0;              // d: steps between an exchange's start and its use (< H / F)
  double outer_lr = 0.7;      // the DiLoCo paper's outer SGD
  double outer_momentum = 0.9;
  double alpha = 0;           // mix: 0 takes the global copy, 1 keeps the local parameters
  bool bf16_exchange = false; // pseudo-gradients travel in bf16 (half the bytes)
  bool host_copies = false;   // the global copies and outer momentum in pinned host memory, mapped
  int period() const { return sync_every / fragments; }
};

// Why settings cannot run, or "" (world_size: W; num_blocks: the model's blocks to cut into fragments).
inline std::string diloco_settings_problem(const DiLoCoSettings& s, int world_size, int num_blocks) {
  if (s.groups < 1) return "--diloco-groups must be positive";
  if (world_size % s.groups != 0)
    return "--diloco-groups " + std::to_string(s.groups) + " does not divide the " + std::to_string(world_size) +
           " ranks into equal groups";
  if (s.groups == 1) return "";
  if (s.fragments < 1 || s.fragments > num_blocks)
    return "--diloco-fragments must be between 1 and the model's " + std::to_string(num_blocks) + " blocks";
  if (s.sync_every < 1 || s.sync_every % s.fragments != 0)
    return "--diloco-sync-every " + std::to_string(s.sync_every) + " must be a positive multiple of --diloco-fragments " +
           std::to_string(s.fragments) + " (one fragment syncs every H/F steps)";
  if (s.delay < 0 || s.delay >= s.period())
    return "--diloco-sync-delay " + std::to_string(s.delay) + " must be in [0, H/F = " + std::to_string(s.period()) +
           "): an exchange is applied before the next one starts";
  return "";
}

// The fragment whose exchange starts once `steps_done` inner steps are done, or -1.
inline int diloco_fragment_starting(const DiLoCoSettings& s, int steps_done) {
  const int P = s.period();
  if (steps_done <= 0 || steps_done % P != 0) return -1;
  const int turn = injected_fault() == Fault::diloco_wrong_fragment ? steps_done / P : steps_done / P - 1;
  return turn % s.fragments;
}

// The step count after which an exchange started at `started` is applied.
inline int diloco_apply_step(const DiLoCoSettings& s, int started) {
  return started + s.delay + (injected_fault() == Fault::diloco_delay_wrong_step ? 1 : 0);
}

// A parameter's storage, whole: fp32 masters or bf16 embeddings.
struct ParamStorage {
  void* data;
  bool bf16;
  size_t count;
};

// One run of a rank's slice that lies in one parameter: slice elements [at, at + count) are
// storage elements [first, first + count).
struct SlicePiece {
  ParamStorage param;
  size_t first, at, count;
};

// The pieces of elements [begin, end) of a fragment whose parameters lie back to back in order.
inline std::vector<SlicePiece> slice_pieces(const std::vector<ParamStorage>& fragment, size_t begin, size_t end) {
  std::vector<SlicePiece> pieces;
  size_t start = 0;
  for (const ParamStorage& p : fragment) {
    const size_t lo = std::max(begin, start), hi = std::min(end, start + p.count);
    if (lo < hi) pieces.push_back({p, lo - start, lo - begin, hi - lo});
    start += p.count;
  }
  return pieces;
}

// ------------------------------------------------------------------------------------------------
// Kernels over one piece (elementwise; fp32 arithmetic, bf16 parameters rounded once at the store).
// ------------------------------------------------------------------------------------------------
template <typename T>
__global__ void pseudo_gradient_kernel(const T* local, const float* global, float* out, size_t n, bool flipped) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = flipped ? float(local[i]) - global[i] : global[i] - float(local[i]);
}

// m = mu m + avg; global -= lr (avg + mu m), avg = sum / divisor; reset: m starts from 0 (a fault).
__global__ void outer_nesterov_kernel(const float* sum, float divisor, float* momentum, float* global, size_t n,
                                      float lr, float mu, bool reset) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float avg = sum[i] / divisor;
    const float m = mu * (reset ? 0.0f : momentum[i]) + avg;
    momentum[i] = m;
    global[i] -= lr * (avg + mu * m);
  }
}

// out = global + alpha (local - global): torch's global.lerp_(local, alpha).
template <typename T>
__global__ void mix_kernel(const T* local, const float* global, T* out, size_t n, float alpha) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = T(global[i] + alpha * (float(local[i]) - global[i]));
}

// ------------------------------------------------------------------------------------------------
// The communicators of G groups of L consecutive ranks: `group` for the inner step, `across` for
// the exchanges (the G ranks with one place l in every group, ranked by group). G = 1: none.
// ------------------------------------------------------------------------------------------------
struct ReplicaGroups {
  std::unique_ptr<DeviceCommunicator> group, across;
  ReplicaGroups(DeviceCommunicator& world, int groups) {
    if (groups <= 1) return;
    const int L = world.world_size() / groups;
    group = world.split(world.rank() / L, world.rank());
    across = world.split(world.rank() % L, world.rank());
  }
};

// ------------------------------------------------------------------------------------------------
// One rank's outer loop. Per inner step, after the step's update: after_step(steps done).
// ------------------------------------------------------------------------------------------------
class DiLoCo {
 public:
  // fragments: each fragment's parameters in order (this rank's storage, whole).
  DiLoCo(const DiLoCoSettings& settings, const std::vector<std::vector<ParamStorage>>& fragments, DeviceCommunicator& group,
         DeviceCommunicator& across)
      : s_(settings), group_(group), across_(across) {
    const int L = group_.world_size();
    size_t largest = 0;
    for (const std::vector<ParamStorage>& f : fragments) {
      size_t total = 0;
      for (const ParamStorage& p : f) total += p.count;
      Slices sl;
      sl.total = total;
      sl.share = (total + L - 1) / L;
      sl.mine = slice_pieces(f, sl.share * group_.rank(), std::min(total, sl.share * (group_.rank() + 1)));
      for (int q = 0; q < L; ++q) sl.of_rank.push_back(slice_pieces(f, sl.share * q, std::min(total, sl.share * (q + 1))));
      sl.global = alloc_copy(sl.share);
      sl.momentum = alloc_copy(sl.share);
      CUDA_CHECK(cudaMemset(sl.global, 0, sl.share * sizeof(float)));
      CUDA_CHECK(cudaMemset(sl.momentum, 0, sl.share * sizeof(float)));
      largest = std::max(largest, sl.share);
      slices_.push_back(std::move(sl));
    }
    send_ = alloc<float>(largest);
    received_ = alloc<float>(largest);
    CUDA_CHECK(cudaMemset(received_, 0, largest * sizeof(float)));
    if (s_.bf16_exchange) traffic_ = alloc<bf16>(2 * largest);
    if (L > 1) gathered_ = alloc<float>(size_t(L) * largest);
    norm_ = alloc<float>(1);
    CUDA_CHECK(cudaStreamCreateWithFlags(&exchange_stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&exchanged_, cudaEventDisableTiming));
  }
  ~DiLoCo() {
    for (void* p : owned_) cudaFree(p);
    for (void* p : owned_host_) cudaFreeHost(p);
    cudaEventDestroy(ready_);
    cudaEventDestroy(exchanged_);
    cudaStreamDestroy(exchange_stream_);
  }
  DiLoCo(const DiLoCo&) = delete;
  DiLoCo& operator=(const DiLoCo&) = delete;

  // Spans of each exchange and its application go to this timeline (null: none).
  void set_timeline(Timeline* timeline) { timeline_ = timeline; }

  // The global copies become the local parameters (identical in every group at the start).
  void take_global_copies(cudaStream_t stream) {
    for (Slices& sl : slices_)
      for (const SlicePiece& p : sl.mine) to_flat(p, sl.global, stream);
  }

  // After inner step `steps_done` (1, 2, ...) of this rank's group, on the stream of the steps:
  // applies the exchange due now, starts the one due now. Returns the log line of an applied sync.
  std::string after_step(int steps_done, cudaStream_t stream) {
    std::string line;
    if (pending_ && pending_->apply_at <= steps_done) line = apply(steps_done, s_.alpha, stream);
    const int f = diloco_fragment_starting(s_, steps_done);
    if (f >= 0) {
      start(f, steps_done, stream);
      if (pending_->apply_at <= steps_done) line = apply(steps_done, s_.alpha, stream);
    }
    return line;
  }

  // At the end of training: the exchange in flight is applied, then every fragment syncs once more
  // and takes its global copy (α = 0), so that every group ends with the same parameters.
  std::vector<std::string> finish(int steps_done, cudaStream_t stream) {
    std::vector<std::string> lines;
    if (pending_) lines.push_back(apply(steps_done, s_.alpha, stream));
    for (int f = 0; f < s_.fragments; ++f) {
      start(f, steps_done, stream);
      lines.push_back(apply(steps_done, 0.0, stream));
    }
    return lines;
  }

  // After a resume at `steps_done`: the exchange the checkpoint holds in flight (its sum, complete).
  void resumed_at(int steps_done) {
    pending_.reset();
    const int started = steps_done / s_.period() * s_.period();
    const int f = diloco_fragment_starting(s_, started);
    if (f >= 0 && diloco_apply_step(s_, started) > steps_done) pending_ = Pending{f, started, diloco_apply_step(s_, started)};
  }

  // The state a checkpoint carries: each fragment's global slice and outer momentum, and the sum of
  // the exchange in flight.
  struct Buffer {
    std::string name;
    void* data;
    size_t bytes;
  };
  std::vector<Buffer> state_buffers() const {
    std::vector<Buffer> state;
    for (size_t f = 0; f < slices_.size(); ++f) {
      const std::string at = "diloco fragment " + std::to_string(f);
      state.push_back({at + " global", slices_[f].global, slices_[f].share * sizeof(float)});
      state.push_back({at + " outer momentum", slices_[f].momentum, slices_[f].share * sizeof(float)});
    }
    state.push_back({"diloco exchange in flight", received_, largest_share() * sizeof(float)});
    return state;
  }

  // Bytes one rank sends across groups per exchange of fragment f (a ring all-reduce: 2 (G-1)/G of it).
  double bytes_sent_per_exchange(int f) const {
    const int G = across_.world_size();
    return 2.0 * (G - 1) / G * double(slices_[size_t(f)].share) * (s_.bf16_exchange ? 2 : 4);
  }
  size_t fragment_elements(int f) const { return slices_[size_t(f)].total; }

 private:
  struct Slices {
    size_t total = 0, share = 0;            // the fragment's elements; each rank's slice (padded)
    std::vector<SlicePiece> mine;           // this rank's slice
    std::vector<std::vector<SlicePiece>> of_rank;  // [L] every rank's slice (for the all-gather)
    float *global = nullptr, *momentum = nullptr;  // [share] this rank's slice of each
  };
  struct Pending {
    int fragment, started, apply_at;
  };

  template <typename T>
  T* alloc(size_t count) {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)));
    owned_.push_back(p);
    return static_cast<T*>(p);
  }
  // A global copy's or momentum's slice: in device memory, or pinned host memory that the kernels
  // read and write over PCIe (the same pointer on the device, with unified addressing).
  float* alloc_copy(size_t count) {
    if (!s_.host_copies) return alloc<float>(count);
    void* p = nullptr;
    CUDA_CHECK(cudaHostAlloc(&p, std::max<size_t>(count, 1) * sizeof(float), cudaHostAllocMapped));
    owned_host_.push_back(p);
    return static_cast<float*>(p);
  }
  size_t largest_share() const {
    size_t largest = 0;
    for (const Slices& sl : slices_) largest = std::max(largest, sl.share);
    return largest;
  }
  size_t my_valid(const Slices& sl) const {
    const size_t first = sl.share * group_.rank();
    return first < sl.total ? std::min(sl.share, sl.total - first) : 0;
  }

  // A piece of the parameters into a flat fp32 buffer at the piece's place, and back.
  static void to_flat(const SlicePiece& p, float* flat, cudaStream_t stream) {
    if (p.param.bf16) convert(static_cast<const bf16*>(p.param.data) + p.first, flat + p.at, p.count, stream);
    else convert(static_cast<const float*>(p.param.data) + p.first, flat + p.at, p.count, stream);
  }
  static void from_flat(const float* flat, const SlicePiece& p, cudaStream_t stream) {
    if (p.param.bf16) convert(flat + p.at, static_cast<bf16*>(p.param.data) + p.first, p.count, stream);
    else convert(flat + p.at, static_cast<float*>(p.param.data) + p.first, p.count, stream);
  }

  // Δ of this rank's slice of fragment f, then its sum over the groups on the exchange stream.
  void start(int f, int steps_done, cudaStream_t stream) {
    const Slices& sl = slices_[size_t(f)];
    const bool flipped = injected_fault() == Fault::diloco_flipped_sign;
    CUDA_CHECK(cudaMemsetAsync(send_, 0, sl.share * sizeof(float), stream));  // the pad of the last slice
    for (const SlicePiece& p : sl.mine) {
      const int grid = elementwise_grid(p.count);
      if (p.param.bf16)
        pseudo_gradient_kernel<<<grid, 256, 0, stream>>>(static_cast<const bf16*>(p.param.data) + p.first, sl.global + p.at,
                                                         send_ + p.at, p.count, flipped);
      else
        pseudo_gradient_kernel<<<grid, 256, 0, stream>>>(static_cast<const float*>(p.param.data) + p.first,
                                                         sl.global + p.at, send_ + p.at, p.count, flipped);
      CUDA_CHECK_LAUNCH();
    }
    CUDA_CHECK(cudaEventRecord(ready_, stream));
    CUDA_CHECK(cudaStreamWaitEvent(exchange_stream_, ready_, 0));
    TimelineSpan span(timeline_, "communication", "diloco exchange of fragment " + std::to_string(f), exchange_stream_);
    if (s_.bf16_exchange) {
      convert(send_, traffic_, sl.share, exchange_stream_);
      across_.all_reduce_sum(traffic_, traffic_ + sl.share, sl.share, DeviceDType::bf16, exchange_stream_);
      convert(traffic_ + sl.share, received_, sl.share, exchange_stream_);
    } else {
      across_.all_reduce_sum(send_, received_, sl.share, DeviceDType::f32, exchange_stream_);
    }
    CUDA_CHECK(cudaEventRecord(exchanged_, exchange_stream_));
    pending_ = Pending{f, steps_done, diloco_apply_step(s_, steps_done)};
  }

  // The exchange in flight, once in, applied (outer_step); returns its log line.
  std::string apply(int steps_done, double alpha, cudaStream_t stream) {
    const Pending p = *pending_;
    pending_.reset();
    Slices& sl = slices_[size_t(p.fragment)];
    CUDA_CHECK(cudaStreamWaitEvent(stream, exchanged_, 0));
    const int G = across_.world_size();
    outer_step(sl, alpha, stream);
    float norm = 0;
    CUDA_CHECK(cudaMemcpyAsync(&norm, norm_, sizeof norm, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const double norm_of_average = std::sqrt(group_.all_reduce_sum(double(norm) * norm)) / G;
    char line[256];
    std::snprintf(line, sizeof line,
                  "diloco: fragment %d synced after step %d (exchange started after step %d): pseudo-gradient norm "
                  "%.4e, %.1f MB sent across groups by each rank",
                  p.fragment, steps_done, p.started, norm_of_average, bytes_sent_per_exchange(p.fragment) / 1e6);
    return line;
  }

  // On this rank's slice of a fragment whose exchange is in: Δ̄'s norm (for the log), the outer
  // step, the mix into the local parameters, the group's gather.
  void outer_step(Slices& sl, double alpha, cudaStream_t stream) {
    TimelineSpan span(timeline_, "compute", "diloco outer step", stream);
    const int G = across_.world_size();
    const size_t valid = my_valid(sl);
    const float divisor = float(injected_fault() == Fault::diloco_average_by_world ? G * group_.world_size() : G);
    frobenius_norms_kernel<<<1, kFrobeniusThreads, 0, stream>>>(received_, valid, norm_);
    CUDA_CHECK_LAUNCH();
    outer_nesterov_kernel<<<elementwise_grid(valid), 256, 0, stream>>>(
        received_, divisor, sl.momentum, sl.global, valid, float(s_.outer_lr), float(s_.outer_momentum),
        injected_fault() == Fault::diloco_momentum_reset);
    CUDA_CHECK_LAUNCH();
    // the mix is written in place; the fault writes it to a copy (send_), as torchft#233 fixed
    const bool to_copy = injected_fault() == Fault::diloco_mix_to_copy;
    for (const SlicePiece& piece : sl.mine) {
      const int grid = elementwise_grid(piece.count);
      if (piece.param.bf16) {
        const bf16* local = static_cast<const bf16*>(piece.param.data) + piece.first;
        bf16* out = to_copy ? reinterpret_cast<bf16*>(send_) : const_cast<bf16*>(local);
        mix_kernel<<<grid, 256, 0, stream>>>(local, sl.global + piece.at, out, piece.count, float(alpha));
      } else {
        const float* local = static_cast<const float*>(piece.param.data) + piece.first;
        float* out = to_copy ? send_ : const_cast<float*>(local);
        mix_kernel<<<grid, 256, 0, stream>>>(local, sl.global + piece.at, out, piece.count, float(alpha));
      }
      CUDA_CHECK_LAUNCH();
    }
    gather_in_group(sl, stream);
  }

  // Every rank's mixed slice to the group's other ranks (in fp32: bf16 values travel exactly).
  void gather_in_group(const Slices& sl, cudaStream_t stream) {
    const int L = group_.world_size();
    if (L == 1) return;
    float* mine = gathered_ + sl.share * group_.rank();
    for (const SlicePiece& p : sl.mine) to_flat(p, mine, stream);
    group_.all_gather(mine, gathered_, sl.share, DeviceDType::f32, stream);
    for (int q = 0; q < L; ++q)
      if (q != group_.rank())
        for (const SlicePiece& p : sl.of_rank[size_t(q)]) from_flat(gathered_ + sl.share * q, p, stream);
  }

  DiLoCoSettings s_;
  DeviceCommunicator& group_;
  DeviceCommunicator& across_;
  std::vector<Slices> slices_;         // [F]
  float* send_ = nullptr;              // [largest share] Δ of the exchange being started
  float* received_ = nullptr;          // [largest share] its sum over the groups
  bf16* traffic_ = nullptr;            // [2 x largest share] bf16 exchange
  float* gathered_ = nullptr;          // [L x largest share] the group's mixed slices
  float* norm_ = nullptr;              // [1] the norm of this rank's summed slice
  std::optional<Pending> pending_;
  cudaStream_t exchange_stream_ = nullptr;
  cudaEvent_t ready_ = nullptr, exchanged_ = nullptr;
  std::vector<void*> owned_, owned_host_;
  Timeline* timeline_ = nullptr;
};
// ===== end of kernels/diloco.cuh =====
// ===== kernels/embedding.cuh (inlined) =====
// Token embedding and the value embeddings (SPEC 1.2): a row gather forward; a deterministic
// backward that sums each token's gradient rows in position order, one block per distinct token,
// so no float atomics and bitwise-equal gradients run to run. The order comes from the host, which
// holds every micro-sequence's tokens anyway (the attention masks are built from them too).

#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

// out[T, d] = table[tokens[t], :], d a multiple of 8
__global__ void embedding_forward_kernel(const uint16_t* tokens, const bf16* table, bf16* out, int T, int d) {
  const int vectors_per_row = d / 8;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(T) * vectors_per_row;
       i += size_t(gridDim.x) * blockDim.x) {
    size_t t = i / vectors_per_row, c = i % vectors_per_row;
    reinterpret_cast<Bf16x8*>(out)[i] = reinterpret_cast<const Bf16x8*>(table + size_t(tokens[t]) * d)[c];
  }
}

inline void check_embedding_width(int d) {
  if (d % 8 != 0) throw std::invalid_argument("embedding: width " + std::to_string(d) + " must be a multiple of 8");
}

// tokens [T] (device), table [V, d], out [T, d]
inline void embedding_forward(const uint16_t* tokens, const bf16* table, bf16* out, int T, int d, cudaStream_t stream) {
  check_embedding_width(d);
  embedding_forward_kernel<<<elementwise_grid(size_t(T) * (d / 8)), 256, 0, stream>>>(tokens, table, out, T, d);
  CUDA_CHECK_LAUNCH();
}

// The positions of a micro-sequence grouped by token: positions[begin[u] .. begin[u + 1]) are
// where token tokens[u] occurs, in increasing order. Built on the host, uploaded once (into the
// StagedUploads, valid until its next reset), shared by the four tables' backward passes.
class EmbeddingBackwardPlan {
 public:
  EmbeddingBackwardPlan(const uint16_t* host_tokens, int T, int vocab_size, StagedUploads& uploads,
                        cudaStream_t stream) {
    std::vector<int32_t> count(size_t(vocab_size) + 1, 0);
    for (int t = 0; t < T; ++t) {
      if (host_tokens[t] >= vocab_size)
        throw std::invalid_argument("embedding: token id " + std::to_string(host_tokens[t]) + " at position " +
                                    std::to_string(t) + " is >= the vocabulary size " + std::to_string(vocab_size));
      ++count[host_tokens[t] + 1];
    }
    std::partial_sum(count.begin(), count.end(), count.begin());  // count[v]: first slot of token v
    std::vector<int32_t> positions(T), tokens, begin;
    for (int t = 0; t < T; ++t) positions[count[host_tokens[t]]++] = t;  // stable: increasing t per token
    for (int v = 0, slot = 0; v < vocab_size; ++v)
      if (count[v] > slot) {
        tokens.push_back(v);
        begin.push_back(slot);
        slot = count[v];
      }
    begin.push_back(T);
    distinct_ = int(tokens.size());
    positions_ = uploads.upload(positions, stream);
    tokens_ = uploads.upload(tokens, stream);
    begin_ = uploads.upload(begin, stream);
  }
  // At most what the constructor stages for T tokens, for StagedUploads::reset.
  static size_t upload_bytes(int T) {
    return 3 * StagedUploads::bytes_for(size_t(T) + 1, sizeof(int32_t));
  }

  int distinct_tokens() const { return distinct_; }
  const int32_t* positions() const { return positions_; }  // [T]
  const int32_t* tokens() const { return tokens_; }        // [distinct]
  const int32_t* begin() const { return begin_; }          // [distinct + 1]

 private:
  int distinct_ = 0;
  const int32_t *positions_ = nullptr, *tokens_ = nullptr, *begin_ = nullptr;
};

constexpr int kEmbeddingRowGroups = 4;  // rows of one token summed in parallel, combined in fixed order

// grad[tokens[u], :] += scale * sum over its positions p of dout[p, :]. Block u, threadIdx.y picks
// every kEmbeddingRowGroups-th position, threadIdx.x a 16-byte column vector; the partial sums of
// the row groups are added in threadIdx.y order, so the result does not depend on scheduling.
__global__ void embedding_backward_kernel(const int32_t* positions, const int32_t* tokens, const int32_t* begin,
                                          const bf16* dout, float* grad, const float* scale, int d) {
  extern __shared__ float partial[];  // [kEmbeddingRowGroups, d]
  const int u = blockIdx.x, first = begin[u], last = begin[u + 1];
  for (int c = threadIdx.x * 8; c < d; c += blockDim.x * 8) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = first + threadIdx.y; k < last; k += kEmbeddingRowGroups) {
      float v[8];
      load8(dout + size_t(positions[k]) * d + c, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += v[i];
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) partial[threadIdx.y * d + c + i] = acc[i];
  }
  __syncthreads();
  const float s = scale ? *scale : 1.0f;
  float* row = grad + size_t(tokens[u]) * d;
  for (int c = threadIdx.y * blockDim.x + threadIdx.x; c < d; c += blockDim.x * blockDim.y) {
    float sum = 0;
    for (int g = 0; g < kEmbeddingRowGroups; ++g) sum += partial[g * d + c];
    row[c] += s * sum;
  }
}

// dout [T, d] of one micro-sequence into the fp32 gradient table [V, d]; scale: a device scalar
// (the value embedding's lambda) or null for 1.
inline void embedding_backward(const EmbeddingBackwardPlan& plan, const bf16* dout, float* grad, const float* scale,
                               int d, cudaStream_t stream) {
  check_embedding_width(d);
  if (plan.distinct_tokens() == 0) return;
  dim3 block(std::min(((d / 8 + 31) / 32) * 32, 256), kEmbeddingRowGroups);
  size_t shared = size_t(kEmbeddingRowGroups) * d * sizeof(float);
  if (shared > 48 * 1024)  // the default dynamic shared memory limit, not raised for this kernel
    throw std::invalid_argument("embedding backward: width " + std::to_string(d) + " is above 3072");
  embedding_backward_kernel<<<plan.distinct_tokens(), block, shared, stream>>>(plan.positions(), plan.tokens(),
                                                                              plan.begin(), dout, grad, scale, d);
  CUDA_CHECK_LAUNCH();
}
// ===== end of kernels/embedding.cuh =====
// ===== kernels/flash_attention.cuh (inlined) =====
// Tensor-core attention (FlashAttention-2 style) for the masks of attention.cuh: same interface
// and results as attention_forward / attention_backward there, on 128 x 128 bf16 tiles with
// Hopper's wgmma: each of a CTA's two warpgroups owns 64 rows (queries, or keys in the dk/dv
// kernel), its products read their tiles straight from shared memory and take P or dS from
// registers. One CTA per (128-token block, head); warp w holds rows 16 w .. 16 w + 15. A query
// block walks its kv-block list, a kv block its query-block list (attention.cuh builds both), so
// cost follows the window. Only the diagonal block and blocks that straddle a document boundary
// are masked element by element. The backward is deterministic: dq per query block, dk and dv per
// kv block, no atomics.
//
// Tiles live in shared memory in wgmma's 128-byte swizzle layout: two column halves of
// [128 rows][8 chunks of 8 bf16], chunk c of row r stored at c ^ (r & 7), atoms of 8 rows
// 1024-byte aligned. The tiles a CTA walks through are double-buffered: the next block's copies
// (cp.async) fly while the current block is computed, since the 188-250 registers per thread leave
// room for one CTA per SM and no other CTA would hide the loads. The forward also overlaps each
// block's softmax with the previous block's P V product (FlashAttention-3's intra-warpgroup
// pipelining).
// ===== kernels/ptx.cuh (inlined) =====
// The PTX instructions of the tensor-core kernels, one wrapper each (cp.async, and sm_90a's wgmma).
// Kept apart so that the CPU emulator of the tests (tests/emulator/ptx.cuh) can give each one its
// documented meaning while the kernels around them run unchanged.
#include <cstdint>

namespace ptx {

__device__ inline uint32_t shared_address(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// 16 bytes from global to shared memory without passing through registers; both 16-byte aligned.
__device__ inline void cp_async_16(void* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(shared)), "l"(global) : "memory");
}

// Closes this thread's group of the cp.async issued since the last commit.
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most the newest `pending_groups_left` committed groups of this thread are in
// flight (the caller then syncs the block before others read the copies).
template <int pending_groups_left>
__device__ inline void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending_groups_left) : "memory");
}

// ---- wgmma (sm_90a): a warpgroup's (4 warps, 128 threads) asynchronous matrix product ----------

// Shared memory written by the generic proxy (stores, cp.async) is visible to wgmma's reads, which
// go through the async proxy, only after this fence by the writing thread (then a barrier).
__device__ inline void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Orders this thread's earlier register and shared-memory accesses before the wgmma issued next.
__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

// Closes the group of the wgmma issued since the last commit.
__device__ inline void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// Waits until at most the newest `pending_groups_left` groups are in flight; only then may their
// accumulators be read and their shared operands refilled.
template <int pending_groups_left>
__device__ inline void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(pending_groups_left) : "memory");
}

// Keeps the compiler from moving an operand register's accesses across a wgmma fence or wait (it
// cannot see that the wgmma reads its operands and writes its accumulator late).
__device__ inline void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ inline void fence_operand(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }

// The fp32 accumulator registers of an m64n64 and an m64n128 product: the operand lists and the
// asm text naming them as %0, %1, ... (the m64n128 list is the m64n64 one and eight tiles more).
#define PTX_ACCUMULATOR_TILE(d, n) "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3])
#define PTX_M64N64_ACCUMULATOR(d)                                                                          \
  PTX_ACCUMULATOR_TILE(d, 0), PTX_ACCUMULATOR_TILE(d, 1), PTX_ACCUMULATOR_TILE(d, 2), PTX_ACCUMULATOR_TILE(d, 3), \
      PTX_ACCUMULATOR_TILE(d, 4), PTX_ACCUMULATOR_TILE(d, 5), PTX_ACCUMULATOR_TILE(d, 6), PTX_ACCUMULATOR_TILE(d, 7)
#define PTX_M64N128_ACCUMULATOR(d)                                                                            \
  PTX_M64N64_ACCUMULATOR(d), PTX_ACCUMULATOR_TILE(d, 8), PTX_ACCUMULATOR_TILE(d, 9), PTX_ACCUMULATOR_TILE(d, 10), \
      PTX_ACCUMULATOR_TILE(d, 11), PTX_ACCUMULATOR_TILE(d, 12), PTX_ACCUMULATOR_TILE(d, 13),                     \
      PTX_ACCUMULATOR_TILE(d, 14), PTX_ACCUMULATOR_TILE(d, 15)
#define PTX_ACCUMULATOR_NAMES_0_TO_31                                                                     \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                              \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define PTX_M64N64_ACCUMULATOR_TEXT "{" PTX_ACCUMULATOR_NAMES_0_TO_31 "}, "
#define PTX_M64N128_ACCUMULATOR_TEXT                                                                    \
  "{" PTX_ACCUMULATOR_NAMES_0_TO_31 ", "                                                              \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                   \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "

// d[64 x N] = A[64 x 16] B[16 x N] (+ d when accumulate), bf16 operands, fp32 accumulation, A and B
// from shared memory (A K-major; B K-major, or N-major with trans_b). Thread l of warp w of the
// warpgroup holds d[n][e] at row 16 w + l / 4 + (e >= 2 ? 8 : 0), column 8 n + 2 (l % 4) + (e & 1):
// mma.sync's m16n8 layout, repeated.
template <int trans_b>
__device__ inline void wgmma_m64n128k16_ss(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " PTX_M64N128_ACCUMULATOR_TEXT
               "%64, %65, p, 1, 1, 0, %67;\n}\n"
               : PTX_M64N128_ACCUMULATOR(d)
               : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(trans_b));
}

template <int trans_b>
__device__ inline void wgmma_m64n64k16_ss(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " PTX_M64N64_ACCUMULATOR_TEXT
               "%32, %33, p, 1, 1, 0, %35;\n}\n"
               : PTX_M64N64_ACCUMULATOR(d)
               : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(trans_b));
}

// d[64 x 128] (+)= A[64 x 16] B[16 x 128] with A from registers: thread l of warp w holds the
// warp's 16 rows as mma.sync's m16n8k16 A fragment (g = l / 4, t = l % 4): a = {(g, 2t..),
// (g + 8, 2t..), (g, 2t + 8..), (g + 8, 2t + 8..)}, pairs of bf16 (the lower column in the low half),
// rows counted from 16 w.
template <int trans_b>
__device__ inline void wgmma_m64n128k16_rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc_b,
                                          bool accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " PTX_M64N128_ACCUMULATOR_TEXT
               "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
               : PTX_M64N128_ACCUMULATOR(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)), "n"(trans_b));
}

}  // namespace ptx
// ===== end of kernels/ptx.cuh =====

#include <initializer_list>

namespace flash {

constexpr int kTile = 128;                      // tokens per tile: the mask's block
constexpr int kWarps = kTile / 16;              // 16 rows per warp
constexpr int kThreads = kWarps * 32;
constexpr size_t kTileElements = size_t(kTile) * kAttentionHeadDim;
constexpr int kStages = 2;  // buffers of the walked tiles
constexpr uint32_t kSwizzleAtomBytes = 1024;  // 8 rows of 128 bytes
constexpr uint32_t kHalfTileBytes = kTile * 64 * sizeof(bf16);  // one column half: [128 rows][64]
// Shared tiles (and room to align them to an atom): forward Q + stages x (K, V); backward two
// fixed tiles + stages x two walked ones.
constexpr size_t kForwardSharedBytes = (1 + 2 * kStages) * kTileElements * sizeof(bf16) + kSwizzleAtomBytes;
constexpr size_t kBackwardSharedBytes = (2 + 2 * kStages) * kTileElements * sizeof(bf16) + kSwizzleAtomBytes;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kScaleLog2 = kAttentionScale * kLog2e;  // scores in base 2: exp2 on the fast path

__device__ inline int swizzled(int row, int col) {  // element (row, col) of a tile
  return col / 64 * (kTile * 64) + row * 64 + ((((col % 64) >> 3) ^ (row & 7)) << 3) + (col & 7);
}

// The descriptor of a matrix in shared memory laid out in 128-byte swizzle atoms (8 rows of 128
// bytes, 16-byte chunk c of row r at c ^ (r % 8); atoms 1024-byte aligned). `leading` and `stride`
// are PTX's leading- and stride-dimension byte offsets: for a K-major operand `stride` is the
// distance between 8-row groups (leading unused); for an MN-major one `leading` separates groups of
// 64 MN elements and `stride` groups of 8 k rows.
__device__ inline uint64_t swizzled_128b_descriptor(const void* start, uint32_t leading, uint32_t stride) {
  return uint64_t((ptx::shared_address(start) & 0x3FFFF) >> 4) | uint64_t(leading >> 4) << 16 |
         uint64_t(stride >> 4) << 32 | uint64_t(1) << 62;
}

// wgmma's swizzle acts on shared-window address bits: tiles must start on an atom boundary, which
// the dynamic shared memory itself need not (static shared variables come first).
__device__ inline bf16* align_to_swizzle_atom(bf16* p) {
  const uint32_t misalignment = ptx::shared_address(p) % kSwizzleAtomBytes;
  return p + (misalignment ? (kSwizzleAtomBytes - misalignment) / sizeof(bf16) : 0);
}

// rows [0, 128) of a [T, stride] matrix from `src` into a swizzled tile, 16 bytes per cp.async.
__device__ inline void load_tile_async(bf16* tile, const bf16* src, int64_t stride) {
  for (int i = threadIdx.x; i < kTile * 16; i += kThreads) {
    int row = i / 16, chunk = i % 16;
    ptx::cp_async_16(tile + swizzled(row, chunk * 8), src + row * stride + chunk * 8);
  }
}

// A tile's 128 four-byte values (document ids, softmax statistics) from `from` into shared memory
// by the 32 threads from first_thread, 16 bytes each as cp.async: no thread waits for them before
// the tiles' wait. Both addresses 16-byte aligned.
template <typename T>
__device__ inline void load_values_async(T* to, const T* from, int first_thread) {
  static_assert(sizeof(T) == 4, "four-byte values");
  const int i = int(threadIdx.x) - first_thread;
  if (i >= 0 && i < kTile / 4) ptx::cp_async_16(to + 4 * i, from + 4 * i);
}

// Starts the copies of the K tile and the document ids of the kv block at token k0 of head h.
__device__ inline void load_k_tile(bf16* k_tile, int32_t* kv_docs, const bf16* k, const AttentionTensors& a,
                                   const int32_t* docs, int h, int k0) {
  load_tile_async(k_tile, k + k0 * a.k_stride + h * kAttentionHeadDim, a.k_stride);
  load_values_async(kv_docs, docs + k0, 0);
}

// Starts the copies of the V tile of the kv block at token k0 of head h.
__device__ inline void load_v_tile(bf16* v_tile, const bf16* v, const AttentionTensors& a, int h, int k0) {
  load_tile_async(v_tile, v + k0 * a.v_stride + h * kAttentionHeadDim, a.v_stride);
}

// Starts the copies of the K and V tiles (V right after K) and the document ids of the kv block
// at token k0 of head h, as one group.
__device__ inline void load_kv_tiles(bf16* k_tile, int32_t* kv_docs, const bf16* k, const bf16* v,
                                     const AttentionTensors& a, const int32_t* docs, int h, int k0) {
  load_k_tile(k_tile, kv_docs, k, a, docs, h, k0);
  load_v_tile(k_tile + kTileElements, v, a, h, k0);
  ptx::cp_async_commit();
}

// Every committed copy of every thread but its newest `pending_groups_left` groups has landed
// (visible to wgmma too), and every warp is done with what it read before.
template <int pending_groups_left = 0>
__device__ inline void wait_tiles() {
  ptx::cp_async_wait_group<pending_groups_left>();
  ptx::fence_proxy_async_shared();
  __syncthreads();
}

__device__ inline uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Pins an accumulator's (or A fragment's) register accesses to their side of a wgmma fence or
// wait: writes before the issue stay before it, reads after the wait stay after it.
template <typename T, int N>
__device__ inline void fence_registers(T (&r)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) ptx::fence_operand(r[n][e]);
}

// Waits for all of the warpgroup's wgmma groups; the accumulators named may be read from here on,
// and the tiles they read refilled (after a barrier).
template <typename... Accumulators>
__device__ inline void wgmma_wait_all(Accumulators&... acc) {
  ptx::wgmma_wait<0>();
  (fence_registers(acc), ...);
}

// Issues, as one group, s[64 x N] = A[a_row .. +64, 0..128) B[b_row .. +N, 0..128)^T for the
// warpgroup: both tiles in shared memory, K-major (the head dimension is the product's k), 16 of k
// per wgmma. The accumulator layout: see ptx::wgmma_m64n128k16_ss.
template <int N>
__device__ inline void wgmma_a_bt(float (&s)[N / 8][4], const bf16* a, int a_row, const bf16* b, int b_row) {
  fence_registers(s);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kAttentionHeadDim / 16; ++kk) {
    const uint64_t a_desc = swizzled_128b_descriptor(a + swizzled(a_row, kk * 16), 16, kSwizzleAtomBytes);
    const uint64_t b_desc = swizzled_128b_descriptor(b + swizzled(b_row, kk * 16), 16, kSwizzleAtomBytes);
    if constexpr (N == 128)
      ptx::wgmma_m64n128k16_ss</*trans_b=*/0>(s, a_desc, b_desc, /*accumulate=*/kk > 0);
    else
      ptx::wgmma_m64n64k16_ss</*trans_b=*/0>(s, a_desc, b_desc, /*accumulate=*/kk > 0);
  }
  ptx::wgmma_commit();
}

// Issues, as one group, acc[64 x 128] += P[64 x 16K] B[b_row .. +16K, 0..128) for the warpgroup:
// P from an accumulator (rounded to bf16 as A fragments, its n-tiles become k), B a shared tile
// read N-major (its rows are k).
template <int K>
__device__ inline void wgmma_p_b(float (&acc)[kAttentionHeadDim / 8][4], const float (&p)[2 * K][4], const bf16* b,
                                 int b_row) {
  uint32_t af[K][4];  // all packed before the first wgmma: none waits on the conversions
#pragma unroll
  for (int kk = 0; kk < K; ++kk) {
    af[kk][0] = pack_bf16(p[2 * kk][0], p[2 * kk][1]);
    af[kk][1] = pack_bf16(p[2 * kk][2], p[2 * kk][3]);
    af[kk][2] = pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]);
    af[kk][3] = pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3]);
  }
  fence_registers(acc);
  fence_registers(af);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < K; ++kk) {
    const uint64_t b_desc =
        swizzled_128b_descriptor(b + swizzled(b_row + kk * 16, 0), kHalfTileBytes, kSwizzleAtomBytes);
    ptx::wgmma_m64n128k16_rs</*trans_b=*/1>(acc, af[kk], b_desc, /*accumulate=*/true);
  }
  ptx::wgmma_commit();
}

template <int N>
__device__ inline void zero(float (&acc)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
}

// A (query block, kv block) pair needs element masks unless it is strictly causal and both blocks
// lie in one document (document ids only grow along the sequence).
__device__ inline bool needs_mask(int qb, int kb, const int32_t* q_docs, const int32_t* kv_docs) {
  return kb == qb || kv_docs[0] != q_docs[kTile - 1];
}

// The element of accumulator n-tile n, register e: its row and column inside the 16 x 8N tile.
__device__ inline int fragment_row(int e) { return threadIdx.x % 32 / 4 + (e >= 2 ? 8 : 0); }
__device__ inline int fragment_col(int n, int e) { return n * 8 + threadIdx.x % 4 * 2 + (e & 1); }

__device__ inline float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ inline float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Writes a warp's 16 x 128 accumulator (times `scale`) as bf16 rows of [T, H, 128].
__device__ inline void store_rows(bf16* out, const float (&acc)[kAttentionHeadDim / 8][4], int first_token, int h, int H,
                                  float scale_row0, float scale_row8) {
#pragma unroll
  for (int n = 0; n < kAttentionHeadDim / 8; ++n)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      int row = fragment_row(2 * half), col = fragment_col(n, 0);
      float s = half ? scale_row8 : scale_row0;
      *reinterpret_cast<uint32_t*>(out + (size_t(first_token + row) * H + h) * kAttentionHeadDim + col) =
          pack_bf16(acc[n][2 * half] * s, acc[n][2 * half + 1] * s);
    }
}

// Walks the kv blocks listed for query block qb (the dq kernel): block j's K and V tiles and
// document ids land in stage j % kStages of `stages` ([kStages][K, V] tiles) while block j - 1 is
// computed; body(kb, k_tile, v_tile, kv_docs) computes block kb. The copies the caller has issued
// before (its fixed tiles) join block 0's group.
template <typename Body>
__device__ inline void walk_kv_blocks(bf16* stages, int32_t (&stage_docs)[kStages][kTile], const bf16* k,
                                      const bf16* v, const AttentionTensors& a, const DeviceAttentionMask& m, int qb,
                                      int h, Body body) {
  const int count = m.kv_count[qb];
  auto kv_block = [&](int j) { return m.kv_index[qb * m.max_kv + j]; };
  auto k_tile_of = [&](int j) { return stages + 2 * (j % kStages) * kTileElements; };
  auto load = [&](int j) { load_kv_tiles(k_tile_of(j), stage_docs[j % kStages], k, v, a, m.docs, h, kv_block(j) * kTile); };
  if (count > 0) load(0);
  for (int j = 0; j < count; ++j) {
    wait_tiles();  // block j is in; every warp is done with block j - 1, whose stage block j + 1 takes
    if (j + 1 < count) load(j + 1);
    body(kv_block(j), k_tile_of(j), k_tile_of(j) + kTileElements, stage_docs[j % kStages]);
  }
}

// One kv block's step of the online softmax on a warp's 16 rows: the scores s of kv block k0
// become P = exp2(scale s - running max) (0 where masked), row_max and row_sum move on, and
// `correction` is what the output accumulated so far must be scaled by.
__device__ inline void online_softmax(float (&s)[kTile / 8][4], float (&row_max)[2], float (&row_sum)[2],
                                      float (&correction)[2], bool masked, int q0, int k0, const int32_t* q_docs,
                                      const int32_t* kv_docs) {
  constexpr int N = kTile / 8;
  const int warp = threadIdx.x / 32;
  float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int row = warp * 16 + fragment_row(e), col = fragment_col(n, e);
      bool allowed = !masked || (k0 + col <= q0 + row && kv_docs[col] == q_docs[row]);
      s[n][e] = allowed ? s[n][e] * kScaleLog2 : -INFINITY;
      tile_max[e / 2] = fmaxf(tile_max[e / 2], s[n][e]);
    }
  float base[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float new_max = fmaxf(row_max[r], quad_max(tile_max[r]));
    base[r] = new_max == -INFINITY ? 0.0f : new_max;  // a row with nothing allowed yet stays at zero
    correction[r] = exp2f(row_max[r] - base[r]);
    row_max[r] = new_max;
    row_sum[r] *= correction[r];
  }
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[n][e] = exp2f(s[n][e] - base[e / 2]);
      row_sum[e / 2] += s[n][e];
    }
}

// Forward: per (query block, head), online softmax over the listed kv blocks. Each warpgroup
// overlaps the softmax of block j + 1 with block j's product P V on the tensor cores: it issues
// S(j + 1) = Q K(j + 1)^T and then O += P(j) V(j), waits for the scores only, and waits for O just
// before rescaling it. So K runs one block ahead of V: K and the document ids of block j + 2 and V
// of block j + 1 are copied while block j's products run, each into the buffer (of two) whose
// previous reader has been waited for before the barrier that starts block j.
__global__ void __launch_bounds__(kThreads) forward_kernel(const bf16* q, const bf16* k, const bf16* v, bf16* y,
                                                           float* lse, AttentionTensors a, DeviceAttentionMask m) {
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* tiles = align_to_swizzle_atom(shared_tiles);  // Q, K of even and odd blocks, V of even and odd blocks
  bf16* q_tile = tiles;
  __shared__ __align__(16) int32_t q_docs[kTile], k_docs[2][kTile];
  const int qb = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / 32, q0 = qb * kTile, count = m.kv_count[qb];
  const int warpgroup_row = warp / 4 * 64;
  auto k0_of = [&](int j) { return m.kv_index[qb * m.max_kv + j] * kTile; };  // the j-th listed kv block
  auto k_tile = [&](int j) { return tiles + (1 + j % 2) * kTileElements; };
  auto v_tile = [&](int j) { return tiles + (3 + j % 2) * kTileElements; };
  auto load_k = [&](int j) { load_k_tile(k_tile(j), k_docs[j % 2], k, a, m.docs, h, k0_of(j)); };
  auto load_v = [&](int j) { load_v_tile(v_tile(j), v, a, h, k0_of(j)); };

  constexpr int N = kTile / 8;
  static_assert(N == kAttentionHeadDim / 8, "scores and output tiles share their fragment loops");
  float o[kAttentionHeadDim / 8][4], row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0, 0}, correction[2];
  zero(o);
  auto softmax_of_block = [&](float (&s)[N][4], int j) {
    const int k0 = k0_of(j);
    const bool masked = needs_mask(qb, k0 / kTile, q_docs, k_docs[j % 2]);
    online_softmax(s, row_max, row_sum, correction, masked, q0, k0, q_docs, k_docs[j % 2]);
  };
  load_tile_async(q_tile, q + q0 * a.q_stride + h * kAttentionHeadDim, a.q_stride);
  load_values_async(q_docs, m.docs + q0, 32);
  if (count > 0) {
    load_k(0);
    ptx::cp_async_commit();  // the first scores wait for this group only
    load_v(0);
    if (count > 1) load_k(1);
    ptx::cp_async_commit();
    wait_tiles<1>();
    float s[N][4], s_next[N][4];  // P of block j, scores of block j + 1
    wgmma_a_bt<kTile>(s, q_tile, warpgroup_row, k_tile(0), 0);
    wgmma_wait_all(s);
    softmax_of_block(s, 0);
    // The last block has no next scores: peeled, so that every product in the loop is issued
    // unconditionally (a conditional one makes ptxas serialise the wgmma).
    for (int j = 0; j + 1 < count; ++j) {
      wait_tiles();  // V(j), K(j + 1) are in; every warp is done with S(j) and P(j - 1) V(j - 1)
      if (j + 2 < count) load_k(j + 2);
      load_v(j + 1);
      ptx::cp_async_commit();
      wgmma_a_bt<kTile>(s_next, q_tile, warpgroup_row, k_tile(j + 1), 0);
      wgmma_p_b<kTile / 16>(o, s, v_tile(j), 0);
      ptx::wgmma_wait<1>();  // the scores; P(j) V(j) runs on beside the softmax
      fence_registers(s_next);
      softmax_of_block(s_next, j + 1);
      wgmma_wait_all(o);
#pragma unroll
      for (int n = 0; n < N; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          o[n][e] *= correction[e / 2];
          s[n][e] = s_next[n][e];
        }
    }
    wait_tiles();
    wgmma_p_b<kTile / 16>(o, s, v_tile(count - 1), 0);
    wgmma_wait_all(o);
  }
  float total[2] = {quad_sum(row_sum[0]), quad_sum(row_sum[1])};
  store_rows(y, o, q0 + warp * 16, h, a.H, 1.0f / total[0], 1.0f / total[1]);
  if (threadIdx.x % 4 == 0)
    for (int r = 0; r < 2; ++r)
      lse[size_t(h) * a.T + q0 + warp * 16 + fragment_row(2 * r)] = row_max[r] / kLog2e + logf(total[r]);
}

// P and dS of a 16 x 8N score tile: p = exp(scores - lse) where allowed (0 elsewhere),
// ds = p (dp - delta). `query_of(row, col)` maps a fragment position to its query index within the
// query tile and `key_of` to its key index within the kv tile (the dkv kernel's tiles are transposed).
template <int N, typename QueryOf, typename KeyOf>
__device__ inline void softmax_backward(float (&s)[N][4], float (&dp)[N][4], const float* lse, const float* delta,
                                        bool masked, int q0, int k0, const int32_t* q_docs, const int32_t* kv_docs,
                                        QueryOf query_of, KeyOf key_of) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int tq = query_of(n, e), tk = key_of(n, e);
      bool allowed = !masked || (k0 + tk <= q0 + tq && kv_docs[tk] == q_docs[tq]);
      float p = allowed ? exp2f(s[n][e] * kScaleLog2 - lse[tq] * kLog2e) : 0.0f;
      s[n][e] = p;
      dp[n][e] = p * (dp[n][e] - delta[tq]);
    }
}

// Per (query block, head): dq = scale sum_kv dS K over the listed kv blocks, 64 keys at a time.
__global__ void __launch_bounds__(kThreads) backward_dq_kernel(const bf16* q, const bf16* k, const bf16* v,
                                                               const bf16* dy, const float* lse, const float* delta,
                                                               bf16* dq, AttentionTensors a, DeviceAttentionMask m) {
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* tiles = align_to_swizzle_atom(shared_tiles);  // Q, dY, then per stage K and V
  bf16 *q_tile = tiles, *dy_tile = tiles + kTileElements;
  __shared__ __align__(16) int32_t q_docs[kTile], stage_docs[kStages][kTile];
  __shared__ __align__(16) float q_lse[kTile], q_delta[kTile];
  const int qb = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / 32, q0 = qb * kTile;
  const int warpgroup_row = warp / 4 * 64;
  const int64_t dy_stride = int64_t(a.H) * kAttentionHeadDim;
  load_tile_async(q_tile, q + q0 * a.q_stride + h * kAttentionHeadDim, a.q_stride);
  load_tile_async(dy_tile, dy + q0 * dy_stride + h * kAttentionHeadDim, dy_stride);
  load_values_async(q_docs, m.docs + q0, 32);
  load_values_async(q_lse, lse + size_t(h) * a.T + q0, 64);
  load_values_async(q_delta, delta + size_t(h) * a.T + q0, 96);
  constexpr int kKeys = 64, N = kKeys / 8;
  float dq_acc[kAttentionHeadDim / 8][4];
  zero(dq_acc);
  auto query_of = [&](int, int e) { return warp * 16 + fragment_row(e); };
  walk_kv_blocks(tiles + 2 * kTileElements, stage_docs, k, v, a, m, qb, h,
                 [&](int kb, const bf16* k_tile, const bf16* v_tile, const int32_t* kv_docs) {
    const int k0 = kb * kTile;
    const bool masked = needs_mask(qb, kb, q_docs, kv_docs);
    for (int half = 0; half < kTile / kKeys; ++half) {
      float s[N][4], dp[N][4];
      wgmma_a_bt<kKeys>(s, q_tile, warpgroup_row, k_tile, half * kKeys);
      wgmma_a_bt<kKeys>(dp, dy_tile, warpgroup_row, v_tile, half * kKeys);
      wgmma_wait_all(s, dp);  // (and the previous half's dq product)
      softmax_backward(s, dp, q_lse, q_delta, masked, q0, k0, q_docs, kv_docs, query_of,
                       [&](int n, int e) { return half * kKeys + fragment_col(n, e); });
      wgmma_p_b<kKeys / 16>(dq_acc, dp, k_tile, half * kKeys);
    }
    wgmma_wait_all(dq_acc);  // before the barrier after which block j + 2 refills this stage
  });
  store_rows(dq, dq_acc, q0 + warp * 16, h, a.H, kAttentionScale, kAttentionScale);
}

// Per (kv block, head): dv = sum_q P^T dy and dk = scale sum_q dS^T Q over the query blocks that
// list this kv block, 64 queries at a time; the warps own 16 keys each, so scores are transposed.
__global__ void __launch_bounds__(kThreads) backward_dkv_kernel(const bf16* q, const bf16* k, const bf16* v,
                                                                const bf16* dy, const float* lse, const float* delta,
                                                                bf16* dk, bf16* dv, AttentionTensors a,
                                                                DeviceAttentionMask m) {
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* tiles = align_to_swizzle_atom(shared_tiles);  // K, V, then per stage Q and dY
  bf16 *k_tile = tiles, *v_tile = tiles + kTileElements;
  __shared__ __align__(16) int32_t kv_docs[kTile], stage_docs[kStages][kTile];
  __shared__ __align__(16) float stage_lse[kStages][kTile], stage_delta[kStages][kTile];
  const int kb = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / 32, k0 = kb * kTile, count = m.q_count[kb];
  const int warpgroup_row = warp / 4 * 64;
  const int64_t dy_stride = int64_t(a.H) * kAttentionHeadDim;
  auto q_block = [&](int j) { return m.q_index[kb * m.max_q + j]; };
  auto q_tile_of = [&](int j) { return tiles + (2 + 2 * (j % kStages)) * kTileElements; };
  auto load_q = [&](int j) {  // the j-th listed query block (Q, dY, ids, statistics) into stage j % kStages
    const int q0 = q_block(j) * kTile, stage = j % kStages;
    load_tile_async(q_tile_of(j), q + q0 * a.q_stride + h * kAttentionHeadDim, a.q_stride);
    load_tile_async(q_tile_of(j) + kTileElements, dy + q0 * dy_stride + h * kAttentionHeadDim, dy_stride);
    load_values_async(stage_docs[stage], m.docs + q0, 0);
    load_values_async(stage_lse[stage], lse + size_t(h) * a.T + q0, 32);
    load_values_async(stage_delta[stage], delta + size_t(h) * a.T + q0, 64);
    ptx::cp_async_commit();
  };
  load_tile_async(k_tile, k + k0 * a.k_stride + h * kAttentionHeadDim, a.k_stride);
  load_tile_async(v_tile, v + k0 * a.v_stride + h * kAttentionHeadDim, a.v_stride);
  load_values_async(kv_docs, m.docs + k0, 96);
  if (count > 0) load_q(0);
  constexpr int kQueries = 64, N = kQueries / 8;
  float dk_acc[kAttentionHeadDim / 8][4], dv_acc[kAttentionHeadDim / 8][4];
  zero(dk_acc);
  zero(dv_acc);
  auto key_of = [&](int, int e) { return warp * 16 + fragment_row(e); };
  for (int j = 0; j < count; ++j) {
    wait_tiles();  // block j is in; every warp is done with block j - 1, whose stage block j + 1 takes
    if (j + 1 < count) load_q(j + 1);
    const int qb = q_block(j), q0 = qb * kTile, stage = j % kStages;
    const bf16 *q_tile = q_tile_of(j), *dy_tile = q_tile + kTileElements;
    const int32_t* q_docs = stage_docs[stage];
    const float *q_lse = stage_lse[stage], *q_delta = stage_delta[stage];
    const bool masked = needs_mask(qb, kb, q_docs, kv_docs);
    for (int half = 0; half < kTile / kQueries; ++half) {
      float st[N][4], dpt[N][4];  // [64 keys x 64 queries] per warpgroup
      wgmma_a_bt<kQueries>(st, k_tile, warpgroup_row, q_tile, half * kQueries);
      wgmma_a_bt<kQueries>(dpt, v_tile, warpgroup_row, dy_tile, half * kQueries);
      wgmma_wait_all(st, dpt);
      softmax_backward(st, dpt, q_lse, q_delta, masked, q0, k0, q_docs, kv_docs,
                       [&](int n, int e) { return half * kQueries + fragment_col(n, e); }, key_of);
      wgmma_p_b<kQueries / 16>(dv_acc, st, dy_tile, half * kQueries);
      wgmma_p_b<kQueries / 16>(dk_acc, dpt, q_tile, half * kQueries);
      // now, not at the next half: P and dS in flight beside the next scores would spill registers
      wgmma_wait_all(dv_acc, dk_acc);
    }
  }
  store_rows(dk, dk_acc, k0 + warp * 16, h, a.H, kAttentionScale, kAttentionScale);
  store_rows(dv, dv_acc, k0 + warp * 16, h, a.H, 1.0f, 1.0f);
}

template <typename Kernel>
void set_shared_memory(Kernel kernel, size_t bytes) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

}  // namespace flash

// A tensor the flash kernels access, and the alignment (bytes) its start needs: cp.async copies
// 16-byte pieces of q, k, v and dy (rows) and of lse and delta (the backward's 128 statistics at
// [h, 128 qb]); y, dq, dk and dv are written a bf16 pair (4 bytes) at a time. The rest is read or
// written an element at a time.
struct FlashAttentionOperand {
  const char* name;
  const void* start;
  unsigned alignment;
};
constexpr unsigned kFlashCopiedAlignment = 16, kFlashWrittenAlignment = 4;

// Refuses, naming the tensor, what would fault on the GPU (misaligned address) or compute garbage.
inline void check_flash_attention_shape(const AttentionTensors& a, const AttentionMask& mask,
                                        std::initializer_list<FlashAttentionOperand> operands) {
  static_assert(flash::kTile == kAttentionBlock, "a flash tile is one mask block");
  check_attention_shape(a, mask);
  if (a.q_stride % 8 || a.k_stride % 8 || a.v_stride % 8)
    throw std::invalid_argument("flash attention: row strides must be multiples of 8 elements (16-byte rows)");
  for (const FlashAttentionOperand& o : operands)
    if (reinterpret_cast<uintptr_t>(o.start) % o.alignment)
      throw std::invalid_argument(std::string("flash attention: ") + o.name + " must start " +
                                  std::to_string(o.alignment) + "-byte aligned");
}

// y: [T, H, 128], lse: [H, T]
inline void flash_attention_forward(const bf16* q, const bf16* k, const bf16* v, bf16* y, float* lse,
                                    const AttentionTensors& a, const AttentionMask& mask, cudaStream_t stream) {
  check_flash_attention_shape(a, mask,
                              {{"q", q, kFlashCopiedAlignment}, {"k", k, kFlashCopiedAlignment},
                               {"v", v, kFlashCopiedAlignment}, {"y", y, kFlashWrittenAlignment}});
  const size_t smem = flash::kForwardSharedBytes;
  flash::set_shared_memory(flash::forward_kernel, smem);
  flash::forward_kernel<<<dim3(a.T / flash::kTile, a.H), flash::kThreads, smem, stream>>>(q, k, v, y, lse, a,
                                                                                          mask.device());
  CUDA_CHECK_LAUNCH();
}

// delta: [H, T] scratch; dq, dk, dv: [T, H, 128]
inline void flash_attention_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* y, const bf16* dy,
                                     const float* lse, float* delta, bf16* dq, bf16* dk, bf16* dv,
                                     const AttentionTensors& a, const AttentionMask& mask, cudaStream_t stream) {
  check_flash_attention_shape(a, mask,
                              {{"q", q, kFlashCopiedAlignment}, {"k", k, kFlashCopiedAlignment},
                               {"v", v, kFlashCopiedAlignment}, {"dy", dy, kFlashCopiedAlignment},
                               {"lse", lse, kFlashCopiedAlignment}, {"delta", delta, kFlashCopiedAlignment},
                               {"dq", dq, kFlashWrittenAlignment}, {"dk", dk, kFlashWrittenAlignment},
                               {"dv", dv, kFlashWrittenAlignment}});
  attention_delta_kernel<<<attention_grid(a, 8), 256, 0, stream>>>(y, dy, delta, a.T, a.H);
  CUDA_CHECK_LAUNCH();
  const size_t smem = flash::kBackwardSharedBytes;
  const dim3 grid(a.T / flash::kTile, a.H);
  flash::set_shared_memory(flash::backward_dq_kernel, smem);
  flash::backward_dq_kernel<<<grid, flash::kThreads, smem, stream>>>(q, k, v, dy, lse, delta, dq, a, mask.device());
  CUDA_CHECK_LAUNCH();
  flash::set_shared_memory(flash::backward_dkv_kernel, smem);
  flash::backward_dkv_kernel<<<grid, flash::kThreads, smem, stream>>>(q, k, v, dy, lse, delta, dk, dv, a,
                                                                      mask.device());
  CUDA_CHECK_LAUNCH();
}
// ===== end of kernels/flash_attention.cuh =====
// ===== kernels/fp8_head.cuh (inlined) =====
// The FP8 lm_head of SPEC 1.5 (training only), as the reference's custom op computes it:
//   forward   logits[rows, V] = (x_s w_s) e4m3(x / x_s) e4m3(w / w_s)^T      bf16, fast accumulation
//   loss      g[rows, V]      = d(summed softcapped cross-entropy)/d logits  bf16 (cross_entropy.cuh)
//   backward  dx[rows, d]     = (grad_s w_s) e5m2(g / grad_s) e4m3(w / w_s)  bf16
//             dW[V, d]       += (grad_s x_s) e5m2(g / grad_s)^T e4m3(x / x_s) fp32
// cuBLASLt's FP8 products want both operands K-contiguous, so every operand has a plain and a
// transposed copy: x_f8 [rows, d] and [d, rows], w_f8 [V, d] and [d, V], g_f8 [rows, V] and
// [V, rows]. x and w are quantised into both copies in one pass; the cross-entropy kernel writes
// g_f8 itself (the bf16 gradient is never stored: 3 bytes per logit less traffic than storing it
// and quantising it), and a byte transpose makes g_f8's copy. The casts are those of the
// reference's compiled custom op (its impl is under torch.compile): x / s becomes x times the
// reciprocal of s, taken in double and rounded to fp32 (inductor's division by a constant), the
// product stays fp32 (inductor does not round a fused intermediate to x's bf16), and Triton's cast
// to FP8 rounds to nearest even and saturates.
// ===== kernels/matmul.cuh (inlined) =====
// Matmuls through cuBLASLt: bf16 operands (or FP8, or fp32 for REKLS's state, see MatmulOptions),
// fp32 accumulation, bf16 or fp32 output (fp32 for fp32 operands), row-major interface. One plan
// (descriptors + heuristic algorithm) is cached per shape, options and buffer alignment; the
// workspace is shared. The three products of a linear
// layer y = x W^T (x [tokens, in], W [out, in]):
//   forward      y[t, out]  = x W^T        matmul(x, N, W, T, y, tokens, out, in)
//   input grad  dx[t, in]   = dy W         matmul(dy, N, W, N, dx, tokens, in, out)
//   weight grad dW[out, in] = dy^T x       matmul(dy, T, x, N, dW, out, in, tokens), beta 1 accumulates

#include <array>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <tuple>
#include <utility>

enum class Transpose { N, T };

// What a product may change from the bf16 default: fp32 operands (both, with an fp32 output: full
// fp32 products, no TF32), or FP8 operand types (e4m3 or e5m2, not both
// e5m2), each with its dequantisation scale (a device float, read when the product runs; null
// means 1), and Hopper's fast FP8 accumulation (no periodic promotion to fp32: faster, less exact).
// cuBLASLt's FP8 kernels want both operands K-contiguous: A stored [M, K] (N), B stored [N, K] (T),
// and M, N, K multiples of 16.
// `addend`: the matrix beta scales when it is not the output, D = alpha op(A) op(B) + beta addend
// (laid out as the output), so a residual add needs no copy of the residual first.
// A strided batch: `count` products, the i-th at A + i stride_a, B + i stride_b, C + i stride_c
// (elements).
struct MatmulBatch {
  int count = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
};

struct MatmulOptions {
  cudaDataType_t a_type = CUDA_R_16BF, b_type = CUDA_R_16BF;
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
  bool fast_accum = false;
  MatmulBatch batch;
  const void* addend = nullptr;  // null: beta scales the output itself
};

inline bool is_fp8(cudaDataType_t t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }

class Matmul {
 public:
  explicit Matmul(size_t workspace_bytes = size_t(32) << 20) : workspace_bytes_(workspace_bytes) {
    CUBLAS_CHECK(cublasLtCreate(&handle_));
    CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
  }
  ~Matmul() {
    for (auto& [key, plan] : plans_) destroy(plan);
    cudaFree(workspace_);
    cublasLtDestroy(handle_);
  }
  Matmul(const Matmul&) = delete;
  Matmul& operator=(const Matmul&) = delete;

  // Row-major C[M, N] = alpha * op(A)[M, K] op(B)[K, N] + beta * C. A is stored [M, K] (N) or
  // [K, M] (T); B is stored [K, N] (N) or [N, K] (T). A and B are bf16; C is bf16 or fp32.
  void operator()(const void* A, Transpose ta, const void* B, Transpose tb, void* C, int M, int N, int K,
                  cudaDataType_t c_type, cudaStream_t stream, float alpha = 1.0f, float beta = 0.0f) {
    (*this)(A, ta, B, tb, C, M, N, K, c_type, MatmulOptions{}, stream, alpha, beta);
  }

  // The same with operand types, scales, accumulation and addend from `o`:
  // C = alpha * (a_scale * op(A)) (b_scale * op(B)) + beta * (o.addend or C).
  void operator()(const void* A, Transpose ta, const void* B, Transpose tb, void* C, int M, int N, int K,
                  cudaDataType_t c_type, const MatmulOptions& o, cudaStream_t stream, float alpha = 1.0f,
                  float beta = 0.0f) {
    if (!is_fp8(o.a_type) && (o.a_scale || o.b_scale)) throw std::invalid_argument("scales are for FP8 operands");
    check_scale_alignment(o);
    const void* addend = o.addend ? o.addend : C;
    const MatmulBatch& b = o.batch;
    const Alignments alignments{alignment(A, b, b.stride_a, o.a_type), alignment(B, b, b.stride_b, o.b_type),
                                alignment(addend, b, b.stride_c, c_type), alignment(C, b, b.stride_c, c_type)};
    const Plan& plan = plan_for({M, N, K, ta == Transpose::T, tb == Transpose::T, c_type, o.a_type, o.b_type,
                                 o.fast_accum, b.count, b.stride_a, b.stride_b, b.stride_c, alignments},
                                o);
    if (is_fp8(o.a_type)) set_scales(plan, o);  // the plan may have been made with other scale buffers
    // cuBLASLt is column-major: compute C^T[N, M] = op(B)^T op(A)^T, i.e. B first.
    CUBLAS_CHECK(cublasLtMatmul(handle_, plan.desc, &alpha, B, plan.b, A, plan.a, &beta, addend, plan.c, C, plan.c,
                                &plan.algo, workspace_, workspace_bytes_, stream));
  }

 private:
  // Bytes to which every batch of A, B, the addend and C is aligned, at most 256: cuBLASLt's heuristic
  // assumes 256 unless told less, and may pick an algorithm that fails on a less aligned slice.
  using Alignments = std::array<uint32_t, 4>;
  // M, N, K, transA, transB, C type, A type, B type, fast accumulation, batch count and strides, alignments
  using Key = std::tuple<int, int, int, bool, bool, cudaDataType_t, cudaDataType_t, cudaDataType_t, bool, int, int64_t,
                         int64_t, int64_t, Alignments>;
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };

  const Plan& plan_for(const Key& key, const MatmulOptions& o) {
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
    auto [M, N, K, trans_a, trans_b, c_type, a_type, b_type, fast_accum, batch, stride_a, stride_b, stride_c,
          alignments] = key;
    check_types(M, N, K, trans_a, trans_b, c_type, a_type, b_type, fast_accum);
    Plan p;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    if (fast_accum) {
      int8_t on = 1;
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &on, sizeof(on)));
    }
    if (is_fp8(a_type)) set_scales(p, o);  // before the heuristic, which sees the whole description
    cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    // The column-major call's first operand is B, its second A.
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_b, sizeof(op_b)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_a, sizeof(op_a)));
    // Column-major views of the row-major buffers: stored [r, c] row-major is [c, r] column-major.
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, b_type, trans_b ? K : N, trans_b ? N : K, trans_b ? K : N));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, a_type, trans_a ? M : K, trans_a ? K : M, trans_a ? M : K));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, c_type, N, M, N));
    if (batch > 1) {
      set_batch(p.a, batch, stride_a);
      set_batch(p.b, batch, stride_b);
      set_batch(p.c, batch, stride_c);
    }
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &workspace_bytes_, sizeof(workspace_bytes_)));
    // The column-major call's A is our B and its B our A; its C is the addend, its D our C.
    const auto [a_bytes, b_bytes, addend_bytes, c_bytes] = alignments;
    for (auto [attribute, bytes] : {std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, b_bytes},
                                    std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, a_bytes},
                                    std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, addend_bytes},
                                    std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, c_bytes}})
      CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attribute, &bytes, sizeof(bytes)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.b, p.a, p.c, p.c, pref, 1, &result, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    if (found == 0)
      throw std::runtime_error("cuBLASLt has no algorithm for a " + std::to_string(M) + "x" + std::to_string(N) +
                               "x" + std::to_string(K) + " matmul");
    p.algo = result.algo;
    return plans_.emplace(key, p).first->second;
  }

  // Refuses, naming the reason, what cuBLASLt would answer only with "not supported".
  static void check_types(int M, int N, int K, bool trans_a, bool trans_b, cudaDataType_t c_type,
                          cudaDataType_t a_type, cudaDataType_t b_type, bool fast_accum) {
    const bool fp8 = is_fp8(a_type), fp32 = a_type == CUDA_R_32F && b_type == CUDA_R_32F;
    if (fp32) {
      if (c_type != CUDA_R_32F) throw std::invalid_argument("fp32 matmul operands need an fp32 output");
      if (fast_accum) throw std::invalid_argument("fast accumulation is an FP8 option");
      return;
    }
    if (fp8 != is_fp8(b_type) || (!fp8 && (a_type != CUDA_R_16BF || b_type != CUDA_R_16BF)))
      throw std::invalid_argument("matmul operands must be both bf16, both fp32 or both FP8");
    if (!fp8) {
      if (fast_accum) throw std::invalid_argument("fast accumulation is an FP8 option");
      return;
    }
    if (a_type == CUDA_R_8F_E5M2 && b_type == CUDA_R_8F_E5M2)
      throw std::invalid_argument("cuBLASLt has no e5m2 x e5m2 matmul");
    if (trans_a || !trans_b)
      throw std::invalid_argument("FP8 matmuls need A stored [M, K] (N) and B stored [N, K] (T)");
    if (M % 16 || N % 16 || K % 16)
      throw std::invalid_argument("FP8 matmul " + std::to_string(M) + "x" + std::to_string(N) + "x" +
                                  std::to_string(K) + ": every dimension must be a multiple of 16");
  }

  // cuBLASLt 13.1 on an H200 answered "not supported" to every FP8 product whose scale pointers were
  // 4 or 8 bytes past a 16-byte boundary, after its heuristic had offered an algorithm for them
  // (docs/PERF.md, 2026-11-26): refused here, naming the cause.
  static void check_scale_alignment(const MatmulOptions& o) {
    for (auto [name, p] : {std::pair{"a_scale", o.a_scale}, std::pair{"b_scale", o.b_scale}})
      if (reinterpret_cast<uintptr_t>(p) % kScaleAlignment)
        throw std::invalid_argument(std::string("FP8 matmul: ") + name + " is not " +
                                    std::to_string(kScaleAlignment) + "-byte aligned (cuBLASLt refuses it)");
  }
  static constexpr uintptr_t kScaleAlignment = 16;

  // The largest power of two, up to 256, dividing the buffer's address and (batched) its stride in bytes.
  static uint32_t alignment(const void* p, const MatmulBatch& batch, int64_t stride, cudaDataType_t type) {
    const size_t element_bytes = type == CUDA_R_32F ? 4 : type == CUDA_R_16BF ? 2 : 1;
    uint64_t bits = reinterpret_cast<uintptr_t>(p) | 256;
    if (batch.count > 1) bits |= uint64_t(stride) * element_bytes;
    return uint32_t(bits & ~(bits - 1));  // the lowest set bit
  }

  static void set_batch(cublasLtMatrixLayout_t layout, int count, int64_t stride) {
    CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                  sizeof(stride)));
  }

  // The column-major call's A is our B and its B our A, so the scales swap too.
  static void set_scales(const Plan& p, const MatmulOptions& o) {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &o.b_scale,
                                                sizeof(o.b_scale)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &o.a_scale,
                                                sizeof(o.a_scale)));
  }

  static void destroy(Plan& p) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.desc);
  }

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_;
  std::map<Key, Plan> plans_;
};
// ===== end of kernels/matmul.cuh =====

#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

using fp8 = __nv_fp8_storage_t;  // one FP8 byte: e4m3fn or e5m2, as the buffer says

enum class Fp8Kind { e4m3, e5m2 };

// SPEC 1.5's scales, as the fp32 values _scaled_mm receives, and the fp32 reciprocals the
// quantisations multiply by. x is RMS-normalised: |x| <= sqrt(d) maps onto e4m3's 448.
struct Fp8HeadScales {
  float x, w, grad;
  float x_inv, w_inv, grad_inv;  // float(1 / s) of the double s: grad_inv is 448 exactly
  explicit Fp8HeadScales(int model_dim) {
    const double sx = std::sqrt(double(model_dim)) / 448, sw = 24.0 / 448, sg = 1.0 / 448;
    x = float(sx), w = float(sw), grad = float(sg);
    x_inv = float(1 / sx), w_inv = float(1 / sw), grad_inv = float(1 / sg);
  }
};

// Triton's fp32 to FP8 cast on sm_90 (cvt.rn.satfinite): round to nearest even, subnormals kept,
// what lies beyond the largest finite value (448 for e4m3, 57344 for e5m2) saturates to it, NaN
// stays NaN.
template <Fp8Kind kind>
__host__ __device__ inline fp8 to_fp8(float v) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, kind == Fp8Kind::e4m3 ? __NV_E4M3 : __NV_E5M2);
}

// Eight values as eight FP8 bytes in two words, little end first.
template <Fp8Kind kind>
__device__ inline uint2 to_fp8_words(const float v[8], float inv_scale) {
  uint32_t word[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < 8; ++i) word[i / 4] |= uint32_t(to_fp8<kind>(v[i] * inv_scale)) << (8 * (i % 4));
  return make_uint2(word[0], word[1]);
}

// The cross-entropy's gradient store for the FP8 head: each value rounded to bf16 first (the
// reference's autograd hands its custom op a bf16 gradient), then cast to e5m2 times inv_scale.
struct E5m2Gradient {
  fp8* out;  // [T, V]
  float inv_scale;
  __device__ void operator()(size_t element, const float g[8]) const {
    float rounded[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) rounded[i] = __bfloat162float(__float2bfloat16(g[i]));
    *reinterpret_cast<uint2*>(out + element) = to_fp8_words<Fp8Kind::e5m2>(rounded, inv_scale);
  }
};

constexpr int kFp8Tile = 64;  // elements per side of a quantisation tile

// out[r, c] = out_t[c, r] = to_fp8(in[r, c] * inv_scale) for in [rows, cols], rows and cols
// multiples of 8. A 256-thread block does one 64 x 64 tile, each thread 8 consecutive elements;
// the tile goes through shared memory so that the transposed copy is written row by row as well.
// In = fp8: `in` is already FP8 (inv_scale unused) and only its transpose is written (out null).
template <Fp8Kind kind, typename In>
__global__ void __launch_bounds__(256)
    fp8_quantize_kernel(const In* in, fp8* out, fp8* out_t, int rows, int cols, float inv_scale) {
  __shared__ uint32_t tile[kFp8Tile][kFp8Tile / 4 + 1];  // FP8 bytes [row][col]; +1 word staggers banks
  const int r0 = blockIdx.y * kFp8Tile, c0 = blockIdx.x * kFp8Tile;
  const int part = threadIdx.x % 8, line = threadIdx.x / 8;  // 8 threads per 64-element line, 32 lines
  for (int r = line; r < kFp8Tile; r += 32) {
    const int row = r0 + r, col = c0 + part * 8;
    if (row >= rows || col >= cols) continue;
    uint2 words;
    if constexpr (std::is_same_v<In, fp8>) {
      words = *reinterpret_cast<const uint2*>(in + size_t(row) * cols + col);
    } else {
      float v[8];
      load8(in + size_t(row) * cols + col, v);
      words = to_fp8_words<kind>(v, inv_scale);
      *reinterpret_cast<uint2*>(out + size_t(row) * cols + col) = words;
    }
    tile[r][part * 2] = words.x;
    tile[r][part * 2 + 1] = words.y;
  }
  __syncthreads();
  for (int c = line; c < kFp8Tile; c += 32) {  // line c of out_t: column c0 + c of the tile
    const int col = c0 + c, row = r0 + part * 8;
    if (col >= cols || row >= rows) continue;
    uint32_t word[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 8; ++i) word[i / 4] |= ((tile[part * 8 + i][c / 4] >> (8 * (c % 4))) & 0xFFu) << (8 * (i % 4));
    *reinterpret_cast<uint2*>(out_t + size_t(col) * rows + row) = make_uint2(word[0], word[1]);
  }
}

// out [rows, cols] and out_t [cols, rows] = to_fp8(in * inv_scale) of in [rows, cols] (16-byte aligned).
template <Fp8Kind kind, typename In>
void fp8_quantize(const In* in, fp8* out, fp8* out_t, int rows, int cols, float inv_scale, cudaStream_t stream) {
  dim3 grid((cols + kFp8Tile - 1) / kFp8Tile, (rows + kFp8Tile - 1) / kFp8Tile);
  fp8_quantize_kernel<kind, In><<<grid, 256, 0, stream>>>(in, out, out_t, rows, cols, inv_scale);
  CUDA_CHECK_LAUNCH();
}

// out_t [cols, rows] = the transpose of the FP8 bytes in [rows, cols] (16-byte aligned).
inline void fp8_transpose(const fp8* in, fp8* out_t, int rows, int cols, cudaStream_t stream) {
  fp8_quantize<Fp8Kind::e5m2, fp8>(in, nullptr, out_t, rows, cols, 1.0f, stream);
}

// The FP8 operands the head keeps (device bytes), for the tests.
struct Fp8HeadOperands {
  const fp8 *x, *x_t;  // e4m3 [rows, d], [d, rows] of the last forward
  const fp8 *w, *w_t;  // e4m3 [V, d], [d, V] of the last quantize_weight
  const fp8 *g, *g_t;  // e5m2 [rows, V], [V, rows] of the last loss_and_gradient
};

class Fp8Head {
 public:
  // Every dimension a multiple of 16: cuBLASLt's FP8 products need 16-byte leading dimensions.
  Fp8Head(int max_rows, int vocab, int model_dim)
      : max_rows_(max_rows), V_(vocab), d_(model_dim), scales_(model_dim) {
    require_multiple_of_16("max_rows", max_rows);
    require_multiple_of_16("vocab", vocab);
    require_multiple_of_16("model_dim", model_dim);
    allocate();
    const float host_scales[3] = {scales_.x, scales_.w, scales_.grad};
    for (int i : {kX, kW, kGrad})
      CUDA_CHECK(cudaMemcpy(device_scale(i), &host_scales[i], sizeof(float), cudaMemcpyHostToDevice));
  }
  ~Fp8Head() { cudaFree(storage_); }
  Fp8Head(const Fp8Head&) = delete;
  Fp8Head& operator=(const Fp8Head&) = delete;

  const Fp8HeadScales& scales() const { return scales_; }
  Fp8HeadOperands operands() const { return {x_f8_, x_f8_t_, w_f8_, w_f8_t_, g_f8_, g_f8_t_}; }

  // Whenever the weights may have changed (the model does it before every training
  // micro-sequence's head): w_f8 [V, d] and its transpose from the fp32 master w [V, d].
  void quantize_weight(const float* w, cudaStream_t stream) {
    require_aligned("w", w);
    fp8_quantize<Fp8Kind::e4m3>(w, w_f8_, w_f8_t_, V_, d_, scales_.w_inv, stream);
    weight_ready_ = true;
  }

  // logits [rows, V] bf16 from x [rows, d] bf16; keeps x_f8 for the backward of the same rows.
  void forward(const bf16* x, bf16* logits, int rows, Matmul& matmul, cudaStream_t stream) {
    quantize_input(x, rows, stream);
    logits_product(logits, matmul, stream);
  }

  // From logits [rows, V] (rows as the last forward; the model passes the forward's own): the
  // token losses [rows] and g_f8 and its transpose, the e5m2 copies of the summed loss's gradient
  // times grad_scale (1 in training; the head has no losses-only use: evaluation is bf16). The
  // fused path leaves the logits as they are; the cast path overwrites them with the bf16 gradient.
  void loss_and_gradient(bf16* logits, const uint16_t* targets, float* losses, const Softcap& sc, cudaStream_t stream,
                         float grad_scale = 1.0f) {
    if (rows_ == 0) throw std::logic_error("Fp8Head: loss before any forward");
    if (!(grad_scale != 0.0f)) throw std::invalid_argument("Fp8Head: a loss gradient scaled by 0 is no gradient");
    require_aligned("logits", logits);
    if (fused_gradient_) {
      softcap_cross_entropy(logits, targets, losses, rows_, V_, grad_scale, E5m2Gradient{g_f8_, scales_.grad_inv},
                            stream, sc);
      fp8_transpose(g_f8_, g_f8_t_, rows_, V_, stream);
    } else {
      softcap_cross_entropy(logits, targets, losses, rows_, V_, grad_scale, stream, sc);
      fp8_quantize<Fp8Kind::e5m2>(logits, g_f8_, g_f8_t_, rows_, V_, scales_.grad_inv, stream);
    }
    gradient_ready_ = true;
  }

  // true (the default): the cross-entropy writes the e5m2 gradient itself; false: it writes the
  // bf16 gradient over the logits and a cast makes both e5m2 copies (the same bytes, one pass
  // more: the self-check's reference, and the run's path with --fp8-gradient cast).
  void set_fused_gradient(bool fused) { fused_gradient_ = fused; }

  // From the gradient of the last loss_and_gradient: dx [rows, d] bf16 (overwritten) and
  // dw [V, d] fp32 += the weight gradient (accumulates over chunks and micro-sequences).
  void backward(bf16* dx, float* dw, Matmul& matmul, cudaStream_t stream) {
    if (!gradient_ready_) throw std::logic_error("Fp8Head: backward without the loss of the last forward");
    grad_input_product(dx, matmul, stream);
    grad_weight_product(dw, matmul, stream);
  }

  // The steps of forward and backward, public so that the benchmark can time each product alone.
  void quantize_input(const bf16* x, int rows, cudaStream_t stream) {
    if (!weight_ready_) throw std::logic_error("Fp8Head: forward before quantize_weight");
    if (rows <= 0 || rows > max_rows_ || rows % 16)
      throw std::invalid_argument("Fp8Head: " + std::to_string(rows) + " rows; want a positive multiple of 16 up to " +
                                  std::to_string(max_rows_));
    require_aligned("x", x);
    fp8_quantize<Fp8Kind::e4m3>(x, x_f8_, x_f8_t_, rows, d_, scales_.x_inv, stream);
    rows_ = rows;
    gradient_ready_ = false;
  }
  void logits_product(bf16* logits, Matmul& matmul, cudaStream_t stream) {  // logits [rows, V]
    MatmulOptions o{CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, device_scale(kX), device_scale(kW), /*fast_accum=*/true};
    matmul(x_f8_, Transpose::N, w_f8_, Transpose::T, logits, rows_, V_, d_, CUDA_R_16BF, o, stream);
  }
  void grad_input_product(bf16* dx, Matmul& matmul, cudaStream_t stream) {  // dx [rows, d] = g [rows, V] w [V, d]
    MatmulOptions o{CUDA_R_8F_E5M2, CUDA_R_8F_E4M3, device_scale(kGrad), device_scale(kW), false};
    matmul(g_f8_, Transpose::N, w_f8_t_, Transpose::T, dx, rows_, d_, V_, CUDA_R_16BF, o, stream);
  }
  void grad_weight_product(float* dw, Matmul& matmul, cudaStream_t stream) {  // dw [V, d] += g^T [V, rows] x [rows, d]
    MatmulOptions o{CUDA_R_8F_E5M2, CUDA_R_8F_E4M3, device_scale(kGrad), device_scale(kX), false};
    matmul(g_f8_t_, Transpose::N, x_f8_t_, Transpose::T, dw, V_, d_, rows_, CUDA_R_32F, o, stream, 1.0f, 1.0f);
  }

 private:
  enum { kX, kW, kGrad };  // the scales' slots
  // Each scale in a 256-byte slot of its own: cuBLASLt on an H200 refused (not supported) every FP8
  // product whose scale pointers were 4 or 8 bytes apart (docs/PERF.md, 2026-11-26).
  static constexpr size_t kScaleSlot = 256;
  const float* device_scale(int i) const { return reinterpret_cast<const float*>(storage_ + i * kScaleSlot); }
  float* device_scale(int i) { return reinterpret_cast<float*>(storage_ + i * kScaleSlot); }

  static void require_multiple_of_16(const char* what, int n) {
    if (n <= 0 || n % 16)
      throw std::invalid_argument(std::string("Fp8Head: ") + what + " = " + std::to_string(n) +
                                  " must be a positive multiple of 16 (cuBLASLt FP8 leading dimensions)");
  }
  static void require_aligned(const char* what, const void* p) {
    if (reinterpret_cast<uintptr_t>(p) % 16)
      throw std::invalid_argument(std::string("Fp8Head: ") + what + " is not 16-byte aligned");
  }

  // One allocation, carved at 256-byte boundaries: the scales' slots, then the six FP8 buffers.
  void allocate() {
    const size_t xd = size_t(max_rows_) * d_, vd = size_t(V_) * d_, xv = size_t(max_rows_) * V_;
    const size_t sizes[7] = {3 * kScaleSlot, xd, xd, vd, vd, xv, xv};
    size_t offsets[7], total = 0;
    for (int i = 0; i < 7; ++i) {
      offsets[i] = total;
      total += (sizes[i] + 255) / 256 * 256;
    }
    CUDA_CHECK(cudaMalloc(&storage_, total));
    fp8** buffers[6] = {&x_f8_, &x_f8_t_, &w_f8_, &w_f8_t_, &g_f8_, &g_f8_t_};
    for (int i = 0; i < 6; ++i) *buffers[i] = storage_ + offsets[i + 1];
  }

  int max_rows_, V_, d_, rows_ = 0;
  bool weight_ready_ = false, gradient_ready_ = false, fused_gradient_ = true;
  Fp8HeadScales scales_;
  uint8_t* storage_ = nullptr;
  fp8 *x_f8_ = nullptr, *x_f8_t_ = nullptr, *w_f8_ = nullptr, *w_f8_t_ = nullptr, *g_f8_ = nullptr, *g_f8_t_ = nullptr;
};
// ===== end of kernels/fp8_head.cuh =====
// ===== kernels/muon.cuh (inlined) =====
// Muon on the GPU (SPEC 1.9) for a batch of matrices [rows, cols] of one shape group, each at its
// own addresses (qkv_w [3, 768, 768] is three): momentum with the Nesterov form, the quintic
// Newton-Schulz iteration in bf16 with fp32 accumulation, batched over the group through
// cuBLASLt's strided batches, and the update scaled by max(1, rows/cols)^0.5. A wide matrix is
// iterated as it is, a tall one as its transpose (the small Gram matrix X X^T).

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

struct MuonStep {
  float lr;          // learning rate of this step (schedule applied)
  float momentum;    // of this step (warmup applied)
  float grad_scale;  // 1 / M: the one normalisation of the summed gradient (SPEC 4.2)
};

constexpr float kNewtonSchulzA = 3.4445f, kNewtonSchulzB = -4.7750f, kNewtonSchulzC = 2.0315f;
constexpr int kNewtonSchulzSteps = 5;

// One matrix [rows, cols] of a Muon update: its fp32 parameter, summed gradient and momentum.
// A [3, d, d] parameter is three of them (qkv_w: Q, K and V are orthogonalised separately).
struct MuonMatrix {
  float* p;
  const float* g;
  float* momentum;
};

// bf16 scratch of a batch of iterations: X and the next X [batch, r, k], A and B [batch, r, r]
// (r <= k), and the batch's Frobenius norms.
class MuonWorkspace {
 public:
  // Room for batches of up to `max_batch` matrices and `max_batch_elems` elements in all.
  MuonWorkspace(size_t max_batch_elems, int max_batch = 1)
      : elem_capacity_(std::max<size_t>(max_batch_elems, 1)), batch_capacity_(std::max(max_batch, 1)) {
    for (bf16** b : {&x_, &next_, &a_, &b_}) CUDA_CHECK(cudaMalloc(b, elem_capacity_ * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&norms_, batch_capacity_ * sizeof(float)));
  }
  ~MuonWorkspace() {
    for (void* p : {(void*)x_, (void*)next_, (void*)a_, (void*)b_, (void*)norms_}) cudaFree(p);
  }
  MuonWorkspace(const MuonWorkspace&) = delete;
  MuonWorkspace& operator=(const MuonWorkspace&) = delete;

  void require_fits(int batch, int rows, int cols) const {
    if (batch > batch_capacity_ || size_t(batch) * rows * cols > elem_capacity_)
      throw std::invalid_argument("muon: " + std::to_string(batch) + " matrices of " + std::to_string(rows) + "x" +
                                  std::to_string(cols) + " exceed the workspace of " + std::to_string(batch_capacity_) +
                                  " matrices, " + std::to_string(elem_capacity_) + " elements");
  }

  bf16 *x_ = nullptr, *next_ = nullptr, *a_ = nullptr, *b_ = nullptr;
  float* norms_ = nullptr;  // [batch] ||X_i||_F

 private:
  size_t elem_capacity_;
  int batch_capacity_;
};

// buf = m buf + (1 - m) g s; x = (1 - m) g s + m buf in bf16, transposed into [cols, rows] when
// `transpose`. One matrix [rows, cols].
__global__ void muon_momentum_kernel(const float* g, float* buf, bf16* x, int rows, int cols, bool transpose,
                                     float momentum, float grad_scale) {
  const size_t n = size_t(rows) * cols;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    float grad = g[i] * grad_scale;
    float b = momentum * buf[i] + (1 - momentum) * grad;
    buf[i] = b;
    size_t row = i / cols, col = i % cols;
    x[transpose ? col * rows + row : i] = __float2bfloat16((1 - momentum) * grad + momentum * b);
  }
}

// x[batch, n] row i scaled by 1 / (norms[i] + 1e-7)
__global__ void scale_by_inverse_norms_kernel(bf16* x, size_t n, size_t total, const float* norms) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x)
    x[i] = __float2bfloat16(__bfloat162float(x[i]) / (norms[i / n] + 1e-7f));
}

// p[rows, cols] -= lr * x, x stored [cols, rows] when `transpose`
__global__ void muon_apply_kernel(float* p, const bf16* x, int rows, int cols, bool transpose, float lr) {
  const size_t n = size_t(rows) * cols;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    size_t row = i / cols, col = i % cols;
    p[i] -= lr * __bfloat162float(x[transpose ? col * rows + row : i]);
  }
}

// x [batch, r, k] <- NS5(x / (||x||_F + 1e-7)) per matrix: A = X X^T, B = b A + c A A,
// X = a X + B X, in bf16, each product one strided-batched cuBLASLt call over the batch.
inline void newton_schulz5(MuonWorkspace& ws, int batch, int r, int k, Matmul& matmul, cudaStream_t stream) {
  const size_t n = size_t(r) * k, rr = size_t(r) * r;
  frobenius_norms_kernel<<<batch, kFrobeniusThreads, 0, stream>>>(ws.x_, n, ws.norms_);
  CUDA_CHECK_LAUNCH();
  scale_by_inverse_norms_kernel<<<elementwise_grid(batch * n), 256, 0, stream>>>(ws.x_, n, batch * n, ws.norms_);
  CUDA_CHECK_LAUNCH();
  auto batched = [batch](int64_t stride_a, int64_t stride_b, int64_t stride_c) {
    MatmulOptions o;
    o.batch = {batch, stride_a, stride_b, stride_c};
    return o;
  };
  const MatmulOptions gram = batched(n, n, rr), square = batched(rr, rr, rr), apply = batched(rr, n, n);
  for (int step = 0; step < kNewtonSchulzSteps; ++step) {
    matmul(ws.x_, Transpose::N, ws.x_, Transpose::T, ws.a_, r, r, k, CUDA_R_16BF, gram, stream);  // A = X X^T
    CUDA_CHECK(cudaMemcpyAsync(ws.b_, ws.a_, batch * rr * sizeof(bf16), cudaMemcpyDeviceToDevice, stream));
    matmul(ws.a_, Transpose::N, ws.a_, Transpose::N, ws.b_, r, r, r, CUDA_R_16BF, square, stream, kNewtonSchulzC,
           kNewtonSchulzB);  // B = c A A + b A
    CUDA_CHECK(cudaMemcpyAsync(ws.next_, ws.x_, batch * n * sizeof(bf16), cudaMemcpyDeviceToDevice, stream));
    matmul(ws.b_, Transpose::N, ws.x_, Transpose::N, ws.next_, r, k, r, CUDA_R_16BF, apply, stream, 1.0f,
           kNewtonSchulzA);  // X' = B X + a X
    std::swap(ws.x_, ws.next_);
  }
}

// One Muon update of matrices [rows, cols] of one shape group (g: the summed gradients;
// grad_scale normalises them), the Newton-Schulz iterations batched over all of them.
inline void muon_update(const std::vector<MuonMatrix>& matrices, int rows, int cols, const MuonStep& s,
                        MuonWorkspace& ws, Matmul& matmul, cudaStream_t stream) {
  const int batch = int(matrices.size());
  if (batch == 0) return;
  ws.require_fits(batch, rows, cols);
  const size_t n = size_t(rows) * cols;
  const bool transpose = rows > cols;
  const int r = transpose ? cols : rows, k = transpose ? rows : cols;
  const float lr = s.lr * std::sqrt(std::max(1.0f, float(rows) / float(cols)));
  for (int i = 0; i < batch; ++i) {
    muon_momentum_kernel<<<elementwise_grid(n), 256, 0, stream>>>(matrices[i].g, matrices[i].momentum, ws.x_ + i * n,
                                                                  rows, cols, transpose, s.momentum, s.grad_scale);
    CUDA_CHECK_LAUNCH();
  }
  newton_schulz5(ws, batch, r, k, matmul, stream);
  for (int i = 0; i < batch; ++i) {
    muon_apply_kernel<<<elementwise_grid(n), 256, 0, stream>>>(matrices[i].p, ws.x_ + i * n, rows, cols, transpose, lr);
    CUDA_CHECK_LAUNCH();
  }
}

// The same update one matrix at a time (no strided batches): the batched path's reference in the
// start-up self-check, and the run's path with --muon per-matrix.
inline void muon_update_each(const std::vector<MuonMatrix>& matrices, int rows, int cols, const MuonStep& s,
                             MuonWorkspace& ws, Matmul& matmul, cudaStream_t stream) {
  for (const MuonMatrix& m : matrices) muon_update({m}, rows, cols, s, ws, matmul, stream);
}
// ===== end of kernels/muon.cuh =====
// ===== kernels/rekls.cuh (inlined) =====
// REKLS on the GPU for one matrix P [m, n] at a time: the KL-Shampoo Kronecker factors L [m, m]
// and R [n, n], their eigenbases Q_L, Q_R and eigenvalues from cuSOLVER's syevd in fp32, and
// Adam's moments M, V [m, n] in the rotated basis. The equations, with the lines of NVIDIA's
// implementation they come from, are in the CPU reference (tests/reference/rekls.h), which the
// GPU test compares against. Every product is an fp32 cuBLASLt matmul (no TF32): the factors
// span ~1e8 after the first step's clamped eigenvalues, and the eigenbasis needs their low bits.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

// Defaults of NVIDIA's REKLS (legacy_soap/rekls.py:41-44) but the learning rate, which it leaves
// to the caller; eigenbasis_every 1 is REKLS's every-step refresh.
struct ReklsSettings {
  float beta1 = 0.9f, beta2 = 0.95f, shampoo_beta = 0.95f, eps = 1e-8f, weight_decay = 0.01f;
  int eigenbasis_every = 1;
};

// One step: learning rate (schedule applied), 1-based step count, and 1 / M for the summed gradient.
struct ReklsStep {
  float lr;
  int64_t t;
  float grad_scale;
};

// The state of one matrix [m, n] in one fp32 buffer (so that a checkpoint lists one per matrix),
// in this order: L [m, m], R [n, n], Q_L [m, m], Q_R [n, n] (columns the eigenvectors, by
// descending eigenvalue), lam_L [m], lam_R [n], M [m, n], V [m, n].
struct ReklsBuffers {
  float *L, *R, *QL, *QR, *lam_L, *lam_R, *M, *V;
  static size_t elems(int m, int n) {
    return 2 * (size_t(m) * m + size_t(n) * n) + size_t(m) + n + 2 * size_t(m) * n;
  }
  static ReklsBuffers at(float* base, int m, int n) {
    ReklsBuffers s;
    const size_t mm = size_t(m) * m, nn = size_t(n) * n, mn = size_t(m) * n;
    s.L = base;
    s.R = s.L + mm;
    s.QL = s.R + nn;
    s.QR = s.QL + mm;
    s.lam_L = s.QR + nn;
    s.lam_R = s.lam_L + m;
    s.M = s.lam_R + n;
    s.V = s.M + mn;
    return s;
  }
};

// One matrix of an update: its fp32 parameter, summed gradient and state buffer (ReklsBuffers).
struct ReklsMatrix {
  float* p;
  const float* g;
  float* state;
};

__global__ void rekls_identity_kernel(float* q, int k) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(k) * k; i += size_t(gridDim.x) * blockDim.x)
    q[i] = i / k == i % k ? 1.0f : 0.0f;
}

// The initial state (soap.py:148-160): everything zero but Q_L, Q_R, the identity.
inline void rekls_reset_state(float* state, int m, int n, cudaStream_t stream) {
  CUDA_CHECK(cudaMemsetAsync(state, 0, ReklsBuffers::elems(m, n) * sizeof(float), stream));
  const ReklsBuffers s = ReklsBuffers::at(state, m, n);
  rekls_identity_kernel<<<elementwise_grid(size_t(m) * m), 256, 0, stream>>>(s.QL, m);
  CUDA_CHECK_LAUNCH();
  rekls_identity_kernel<<<elementwise_grid(size_t(n) * n), 256, 0, stream>>>(s.QR, n);
  CUDA_CHECK_LAUNCH();
}

__global__ void rekls_scale_kernel(const float* in, float* out, size_t n, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = in[i] * scale;
}

// out[i, j] = x[i, j] / (dim * max(lam[by_row ? i : j], eps)), x [rows, cols]: one side of the
// KL correction Q diag(max(lam, eps)^-1) Q^T / dim applied to the gradient in that basis.
__global__ void rekls_kl_scale_kernel(const float* x, float* out, int rows, int cols, const float* lam, bool by_row,
                                      float dim, float eps) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(rows) * cols;
       i += size_t(gridDim.x) * blockDim.x) {
    const float l = lam[by_row ? i / cols : i % cols];
    out[i] = x[i] / (dim * fmaxf(l, eps));
  }
}

// syevd's ascending eigenvalues w and eigenvectors (column-major, i.e. row j of `vectors` is the
// j-th) into Q [k, k] (columns, descending: torch.linalg.eigh flipped, utils/eig.py:67-69) and lam.
__global__ void rekls_descending_basis_kernel(const float* vectors, const float* w, float* Q, float* lam, int k) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(k) * k; i += size_t(gridDim.x) * blockDim.x) {
    const int row = int(i / k), col = int(i % k);
    Q[i] = vectors[size_t(k - 1 - col) * k + row];
    if (row == 0) lam[col] = w[k - 1 - col];
  }
}

// Adam in the rotated basis (adam.py:66-88): M, V updated, U = (M / bias1) / (sqrt(V / bias2) + eps).
__global__ void rekls_adam_kernel(const float* rotated, float* M, float* V, float* U, size_t n, float beta1, float beta2,
                                  float bias1, float bias2, float eps) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float g = rotated[i];
    const float m = beta1 * M[i] + (1 - beta1) * g, v = beta2 * V[i] + (1 - beta2) * g * g;
    M[i] = m;
    V[i] = v;
    U[i] = (m / bias1) / (sqrtf(v / bias2) + eps);
  }
}

// p <- p - lr wd p - lr update (decoupled weight decay, soap.py:258-263 and 286)
__global__ void rekls_apply_kernel(float* p, const float* update, size_t n, float lr, float weight_decay) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = p[i] - lr * weight_decay * p[i] - lr * update[i];
}

// The scratch and the cuSOLVER handle of REKLS updates of the given shapes [m, n].
class Rekls {
 public:
  explicit Rekls(const std::vector<std::pair<int, int>>& shapes) {
    CUSOLVER_CHECK(cusolverDnCreate(&solver_));
    CUSOLVER_CHECK(cusolverDnCreateParams(&params_));
    size_t largest_mn = 1, largest_k = 1;
    for (auto [m, n] : shapes) {
      largest_mn = std::max(largest_mn, size_t(m) * n);
      largest_k = std::max({largest_k, size_t(m), size_t(n)});
    }
    for (float** b : {&g_, &x_, &y_, &t_}) CUDA_CHECK(cudaMalloc(b, largest_mn * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&vectors_, largest_k * largest_k * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&values_, largest_k * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&info_, sizeof(int)));
    for (auto [m, n] : shapes)
      for (int k : {m, n}) {
        size_t device = 0, host = 0;
        CUSOLVER_CHECK(cusolverDnXsyevd_bufferSize(solver_, params_, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, k,
                                                   CUDA_R_32F, vectors_, k, CUDA_R_32F, values_, CUDA_R_32F, &device,
                                                   &host));
        solver_device_bytes_ = std::max(solver_device_bytes_, device);
        solver_host_bytes_ = std::max(solver_host_bytes_, host);
      }
    CUDA_CHECK(cudaMalloc(&solver_device_, std::max<size_t>(solver_device_bytes_, 1)));
    solver_host_.resize(std::max<size_t>(solver_host_bytes_, 1));
  }
  ~Rekls() {
    for (void* p : {(void*)g_, (void*)x_, (void*)y_, (void*)t_, (void*)vectors_, (void*)values_, (void*)info_,
                    solver_device_})
      cudaFree(p);
    cusolverDnDestroyParams(params_);
    cusolverDnDestroy(solver_);
  }
  Rekls(const Rekls&) = delete;
  Rekls& operator=(const Rekls&) = delete;

  // One REKLS step of each matrix [m, n] (see tests/reference/rekls.h for the equations).
  void update(const std::vector<ReklsMatrix>& matrices, int m, int n, const ReklsSettings& cfg, const ReklsStep& step,
              Matmul& matmul, cudaStream_t stream) {
    for (const ReklsMatrix& x : matrices) update_one(x, m, n, cfg, step, matmul, stream);
  }

 private:
  void update_one(const ReklsMatrix& x, int m, int n, const ReklsSettings& cfg, const ReklsStep& step, Matmul& matmul,
                  cudaStream_t stream) {
    const size_t mn = size_t(m) * n;
    const ReklsBuffers s = ReklsBuffers::at(x.state, m, n);
    const double t = double(step.t);
    // fp32 products: C[M, N] = alpha op(A) op(B) + beta C
    auto product = [&](const float* A, Transpose ta, const float* B, Transpose tb, float* C, int M, int N, int K,
                       float alpha = 1.0f, float beta = 0.0f) {
      MatmulOptions o;
      o.a_type = o.b_type = CUDA_R_32F;
      matmul(A, ta, B, tb, C, M, N, K, CUDA_R_32F, o, stream, alpha, beta);
    };
    rekls_scale_kernel<<<elementwise_grid(mn), 256, 0, stream>>>(x.g, g_, mn, step.grad_scale);  // G
    CUDA_CHECK_LAUNCH();

    // The factors, with the previous bases (soap.py:372-387): L <- b L + (1 - b) (G Q_R) S_R (G Q_R)^T,
    // R <- b R + (1 - b) (Q_L^T G)^T S_L (Q_L^T G), S = diag(max(lam, eps)^-1) / dim.
    const float b = float(1 - (1 - double(cfg.shampoo_beta)) / (1 - std::pow(double(cfg.shampoo_beta), t)));
    product(g_, Transpose::N, s.QR, Transpose::N, x_, m, n, n);  // X = G Q_R
    rekls_kl_scale_kernel<<<elementwise_grid(mn), 256, 0, stream>>>(x_, y_, m, n, s.lam_R, false, float(n), cfg.eps);
    CUDA_CHECK_LAUNCH();
    product(y_, Transpose::N, x_, Transpose::T, s.L, m, m, n, 1 - b, b);
    product(s.QL, Transpose::T, g_, Transpose::N, x_, m, n, m);  // X = Q_L^T G
    rekls_kl_scale_kernel<<<elementwise_grid(mn), 256, 0, stream>>>(x_, y_, m, n, s.lam_L, true, float(m), cfg.eps);
    CUDA_CHECK_LAUNCH();
    product(x_, Transpose::T, y_, Transpose::N, s.R, n, n, m, 1 - b, b);

    if ((step.t - 1) % cfg.eigenbasis_every == 0) {  // soap.py:440-458
      product(s.M, Transpose::N, s.QR, Transpose::T, t_, m, n, n);  // M out of the old basis
      product(s.QL, Transpose::N, t_, Transpose::N, s.M, m, n, m);
      eigenbasis(s.L, m, s.QL, s.lam_L, stream);
      eigenbasis(s.R, n, s.QR, s.lam_R, stream);
      product(s.QL, Transpose::T, s.M, Transpose::N, t_, m, n, m);  // and into the new one
      product(t_, Transpose::N, s.QR, Transpose::N, s.M, m, n, n);
    }

    product(s.QL, Transpose::T, g_, Transpose::N, t_, m, n, m);  // G' = Q_L^T G Q_R
    product(t_, Transpose::N, s.QR, Transpose::N, x_, m, n, n);
    const float bias1 = float(1 - std::pow(double(cfg.beta1), t)), bias2 = float(1 - std::pow(double(cfg.beta2), t));
    rekls_adam_kernel<<<elementwise_grid(mn), 256, 0, stream>>>(x_, s.M, s.V, y_, mn, cfg.beta1, cfg.beta2, bias1, bias2,
                                                                cfg.eps);
    CUDA_CHECK_LAUNCH();
    const Transpose back = injected_fault() == Fault::rekls_rotation_untransposed ? Transpose::N : Transpose::T;
    product(y_, Transpose::N, s.QR, back, t_, m, n, n);  // Q_L U Q_R^T
    product(s.QL, Transpose::N, t_, Transpose::N, x_, m, n, m);
    rekls_apply_kernel<<<elementwise_grid(mn), 256, 0, stream>>>(x.p, x_, mn, step.lr, cfg.weight_decay);
    CUDA_CHECK_LAUNCH();
  }

  // (lam, Q) of the symmetric factor [k, k] by syevd in fp32, eigenvalues descending. syevd
  // reads the lower triangle of the column-major matrix: the upper one of our row-major factor.
  // Its *info (nonzero: no convergence, or a bad argument) is read back at once, a host
  // synchronisation per factor (unmeasured: no GPU yet; one read per step would do).
  void eigenbasis(const float* factor, int k, float* Q, float* lam, cudaStream_t stream) {
    CUDA_CHECK(cudaMemcpyAsync(vectors_, factor, size_t(k) * k * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    CUSOLVER_CHECK(cusolverDnSetStream(solver_, stream));
    CUSOLVER_CHECK(cusolverDnXsyevd(solver_, params_, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, k, CUDA_R_32F,
                                    vectors_, k, CUDA_R_32F, values_, CUDA_R_32F, solver_device_, solver_device_bytes_,
                                    solver_host_.data(), solver_host_bytes_, info_));
    int info = 0;
    CUDA_CHECK(cudaMemcpyAsync(&info, info_, sizeof(int), cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    if (info != 0)
      throw std::runtime_error("rekls: cusolverDnXsyevd of a " + std::to_string(k) + "x" + std::to_string(k) +
                               " Kronecker factor failed, info " + std::to_string(info) +
                               (info > 0 ? " (no convergence: a non-finite factor?)" : " (bad argument)"));
    rekls_descending_basis_kernel<<<elementwise_grid(size_t(k) * k), 256, 0, stream>>>(vectors_, values_, Q, lam, k);
    CUDA_CHECK_LAUNCH();
  }

  cusolverDnHandle_t solver_ = nullptr;
  cusolverDnParams_t params_ = nullptr;
  float *g_ = nullptr, *x_ = nullptr, *y_ = nullptr, *t_ = nullptr;  // [largest m n] each
  float *vectors_ = nullptr, *values_ = nullptr;                      // syevd's A [k, k] and W [k]
  int* info_ = nullptr;
  void* solver_device_ = nullptr;
  size_t solver_device_bytes_ = 0, solver_host_bytes_ = 0;
  std::vector<char> solver_host_;
};
// ===== end of kernels/rekls.cuh =====
// ===== kernels/norms.cuh (inlined) =====
// RMS norm without weight (SPEC 1.1): y = x / sqrt(mean(x^2) + eps), bf16 in and out, fp32 math.
// One warp per row; rows are a multiple of 8 elements (16-byte vectors). The reference's eps is
// F.rms_norm's default, which for bf16 inputs is the eps of the fp32 type it computes in,
// finfo(float32).eps = 2^-23 (PyTorch since January 2025, eager and the compiled decomposition).

#include <stdexcept>
#include <string>

constexpr float kRmsEps = 1.1920928955078125e-07f;  // FLT_EPSILON
constexpr int kMaxNormVectorsPerLane = 4;  // rows up to 32 lanes x 4 x 8 = 1024 elements

// y[rows, n] = rmsnorm(x[rows, n])
__global__ void rmsnorm_forward_kernel(const bf16* x, bf16* y, int rows, int n, float eps) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  const bf16* xr = x + size_t(row) * n;
  float v[kMaxNormVectorsPerLane][8], ss = 0;
#pragma unroll
  for (int k = 0; k < kMaxNormVectorsPerLane; ++k) {
    int col = (k * 32 + lane) * 8;
    if (col < n) {
      load8(xr + col, v[k]);
      for (int i = 0; i < 8; ++i) ss += v[k][i] * v[k][i];
    }
  }
  float inv = rsqrtf(warp_sum(ss) / n + eps);
#pragma unroll
  for (int k = 0; k < kMaxNormVectorsPerLane; ++k) {
    int col = (k * 32 + lane) * 8;
    if (col < n) {
      for (int i = 0; i < 8; ++i) v[k][i] *= inv;
      store8(y + size_t(row) * n + col, v[k]);
    }
  }
}

// dx[rows, n] (+)= d rmsnorm(x) / dx applied to dy: inv * dy - inv^3 * x * mean(x * dy)
__global__ void rmsnorm_backward_kernel(const bf16* x, const bf16* dy, bf16* dx, int rows, int n, float eps,
                                        bool accumulate) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  size_t base = size_t(row) * n;
  float xv[kMaxNormVectorsPerLane][8], gv[kMaxNormVectorsPerLane][8], ss = 0, dot = 0;
#pragma unroll
  for (int k = 0; k < kMaxNormVectorsPerLane; ++k) {
    int col = (k * 32 + lane) * 8;
    if (col < n) {
      load8(x + base + col, xv[k]);
      load8(dy + base + col, gv[k]);
      for (int i = 0; i < 8; ++i) ss += xv[k][i] * xv[k][i], dot += xv[k][i] * gv[k][i];
    }
  }
  float inv = rsqrtf(warp_sum(ss) / n + eps), mean_dot = warp_sum(dot) / n;
#pragma unroll
  for (int k = 0; k < kMaxNormVectorsPerLane; ++k) {
    int col = (k * 32 + lane) * 8;
    if (col < n) {
      float out[8], prev[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (accumulate) load8(dx + base + col, prev);
      for (int i = 0; i < 8; ++i) out[i] = prev[i] + inv * gv[k][i] - inv * inv * inv * xv[k][i] * mean_dot;
      store8(dx + base + col, out);
    }
  }
}

inline void check_norm_width(int n) {
  if (n % 8 != 0 || n > 32 * 8 * kMaxNormVectorsPerLane)
    throw std::invalid_argument("rmsnorm: row width " + std::to_string(n) + " must be a multiple of 8 and <= 1024");
}

inline void rmsnorm_forward(const bf16* x, bf16* y, int rows, int n, cudaStream_t stream, float eps = kRmsEps) {
  check_norm_width(n);
  const int warps = 8;
  rmsnorm_forward_kernel<<<(rows + warps - 1) / warps, warps * 32, 0, stream>>>(x, y, rows, n, eps);
  CUDA_CHECK_LAUNCH();
}

inline void rmsnorm_backward(const bf16* x, const bf16* dy, bf16* dx, int rows, int n, bool accumulate,
                             cudaStream_t stream, float eps = kRmsEps) {
  check_norm_width(n);
  const int warps = 8;
  rmsnorm_backward_kernel<<<(rows + warps - 1) / warps, warps * 32, 0, stream>>>(x, dy, dx, rows, n, eps, accumulate);
  CUDA_CHECK_LAUNCH();
}
// ===== end of kernels/norms.cuh =====
// ===== kernels/optimizers.cuh (inlined) =====
// Optimizer kernels. Adam (SPEC 1.10) on one flat slice of a parameter, with the gradient's one
// normalisation (grad_scale = 1/M, SPEC 4.2) fused in; parameter, gradient and states may be fp32
// or bf16 (the reference keeps the embeddings' states in bf16), the arithmetic is fp32.

#include <cmath>

struct AdamStep {
  float lr, beta1 = 0.8f, beta2 = 0.95f, eps = 1e-10f;
  int64_t t;          // step count, from 1
  float grad_scale;   // 1 / global micro-sequence count
};

__device__ inline float to_float(float x) { return x; }
__device__ inline float to_float(bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ inline T from_float(float x);
template <> __device__ inline float from_float<float>(float x) { return x; }
template <> __device__ inline bf16 from_float<bf16>(float x) { return __float2bfloat16(x); }

// p, g, m, v: [n]
template <typename P, typename G, typename S>
__global__ void adam_kernel(P* p, const G* g, S* m, S* v, int64_t n, AdamStep s, float step_size) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float grad = to_float(g[i]) * s.grad_scale;
    float mi = s.beta1 * to_float(m[i]) + (1 - s.beta1) * grad;
    float vi = s.beta2 * to_float(v[i]) + (1 - s.beta2) * grad * grad;
    m[i] = from_float<S>(mi);
    v[i] = from_float<S>(vi);
    p[i] = from_float<P>(to_float(p[i]) - step_size * to_float(m[i]) / (sqrtf(to_float(v[i])) + s.eps));
  }
}

template <typename P, typename G, typename S>
void adam_update(P* p, const G* g, S* m, S* v, int64_t n, const AdamStep& s, cudaStream_t stream) {
  double bias1 = 1 - std::pow(double(s.beta1), double(s.t)), bias2 = 1 - std::pow(double(s.beta2), double(s.t));
  float step_size = float(s.lr * std::sqrt(bias2) / bias1);
  adam_kernel<<<elementwise_grid(size_t(n)), 256, 0, stream>>>(p, g, m, v, n, s, step_size);
  CUDA_CHECK_LAUNCH();
}
// ===== end of kernels/optimizers.cuh =====
// ===== kernels/rendezvous.h (inlined) =====
// Where a process sits in the job, from the environment of the standard launchers (torchrun,
// mpirun, srun), and the exchange of NCCL's unique id: rank 0 listens at MASTER_ADDR:MASTER_PORT
// (one port above under torchrun, whose own store holds MASTER_PORT), every other rank connects
// and receives the id's bytes. Every wait has a deadline, and a failure
// names the rank(s) and the address, so a job never hangs on a rank that failed to start. Rank 0
// reads all hellos at once, each with its own deadline, so a connection that never speaks holds no
// one up; and whatever ends its rendezvous (a missing, duplicate or misconfigured rank) it tells
// every connected rank, so they all fail at once with the same message.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

struct ProcessGroupEnv {
  int rank = 0, world_size = 1, local_rank = 0, local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int id_port = 29500;  // where rank 0 serves NCCL's id
  std::string launcher = "none";  // which environment was recognised (logged)
};

using EnvLookup = std::function<const char*(const char*)>;

namespace rendezvous_detail {

inline int env_int(const EnvLookup& env, const char* name, int min, int max) {
  const char* text = env(name);
  if (!text) throw std::invalid_argument(std::string("environment: ") + name + " is not set");
  char* end = nullptr;
  errno = 0;
  long value = std::strtol(text, &end, 10);
  if (errno || end == text || (*end && *end != '(') || value < min || value > max)  // Slurm writes "4(x2)"
    throw std::invalid_argument(std::string("environment: ") + name + "='" + text + "' is not an integer in [" +
                                std::to_string(min) + ", " + std::to_string(max) + "]");
  return int(value);
}

struct LauncherNames {
  const char *launcher, *rank, *world_size, *local_rank, *local_world_size;
};

}  // namespace rendezvous_detail

// torchrun's RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE, else Open MPI's OMPI_COMM_WORLD_*, else
// Slurm's SLURM_PROCID/NTASKS/LOCALID/NTASKS_PER_NODE, else a single process. MASTER_ADDR and
// MASTER_PORT are required for more than one rank. torchrun (TORCHELASTIC_RUN_ID set) runs its own
// store at MASTER_PORT, which every worker is pointed to, so there the id goes one port above.
// Throws std::invalid_argument naming the variable.
inline ProcessGroupEnv process_group_from_env(const EnvLookup& env = [](const char* n) { return std::getenv(n); }) {
  using namespace rendezvous_detail;
  const LauncherNames launchers[] = {
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
      {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
  };
  ProcessGroupEnv g;
  for (const LauncherNames& l : launchers) {
    if (!env(l.rank) && !env(l.world_size)) continue;
    g.launcher = l.launcher;
    g.world_size = env_int(env, l.world_size, 1, 1 << 20);
    g.rank = env_int(env, l.rank, 0, g.world_size - 1);
    g.local_world_size = env(l.local_world_size) ? env_int(env, l.local_world_size, 1, g.world_size) : g.world_size;
    g.local_rank = env(l.local_rank) ? env_int(env, l.local_rank, 0, g.local_world_size - 1) : g.rank % g.local_world_size;
    break;
  }
  if (g.world_size > 1) {
    const char* addr = env("MASTER_ADDR");
    if (!addr || !*addr)
      throw std::invalid_argument("environment: MASTER_ADDR is not set (" + g.launcher + " with " +
                                  std::to_string(g.world_size) + " ranks needs rank 0's address)");
    g.master_addr = addr;
    const int above_torchrun_store = env("TORCHELASTIC_RUN_ID") ? 1 : 0;
    g.id_port = env_int(env, "MASTER_PORT", 1, 65535 - above_torchrun_store) + above_torchrun_store;
  }
  return g;
}

// The 128 bytes of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES), kept opaque here.
using UniqueIdBytes = std::array<char, 128>;

namespace rendezvous_detail {

constexpr uint32_t kHelloMagic = 0x53504452;  // "SPDR"
constexpr uint32_t kHelloVersion = 2;          // 2: the hello carries the sender's world size

// What every other rank sends rank 0 on connecting: magic, version, its rank, its world size.
using Hello = std::array<uint32_t, 4>;

// A rank sends its hello the moment it connects, so a connection silent for this long is not a
// rank at work (a port scan, a health check, a process stopped mid-way): rank 0 drops it.
constexpr std::chrono::milliseconds kHelloTimeout{1000};

// Rank 0 answers (id or error) until its deadline plus this; every other rank listens as long.
constexpr std::chrono::milliseconds kAnswerGrace{2000};

// What rank 0 answers each rank: a status word, then the id (kStatusId) or an error text of
// kErrorBytes (kStatusError), so every rank learns why the rendezvous failed, not only rank 0.
constexpr uint32_t kStatusId = 0, kStatusError = 1;
constexpr size_t kErrorBytes = 1024;

using Clock = std::chrono::steady_clock;

class Socket {
 public:
  explicit Socket(int fd = -1) : fd_(fd) {}
  ~Socket() { if (fd_ >= 0) ::close(fd_); }
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept { std::swap(fd_, o.fd_); return *this; }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_;
};

[[noreturn]] inline void throw_errno(const std::string& what) { throw std::runtime_error(what + ": " + std::strerror(errno)); }

inline int ms_left(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left > 0 ? int(left) : 0;
}

// Waits for `events` on fd until the deadline; false on timeout.
inline bool wait_for(int fd, short events, Clock::time_point deadline) {
  pollfd p{fd, events, 0};
  for (;;) {
    int n = ::poll(&p, 1, ms_left(deadline));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) throw_errno("rendezvous: poll failed");
  }
}

// Moves exactly n bytes before the deadline; false on timeout or a closed connection.
inline bool transfer(int fd, void* data, size_t n, bool sending, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    if (!wait_for(fd, sending ? POLLOUT : POLLIN, deadline)) return false;
    ssize_t done = sending ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (done <= 0) {
      if (done < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      return false;
    }
    p += done;
    n -= size_t(done);
  }
  return true;
}

inline std::string where(const ProcessGroupEnv& g) { return g.master_addr + ":" + std::to_string(g.id_port); }

inline std::string seconds(std::chrono::milliseconds t) { return std::to_string(t.count() / 1000.0).substr(0, 4) + " s"; }

// Non-blocking, so that accept never waits, even for a connection that vanished after poll saw it.
inline Socket listen_on(int port) {
  const std::string cannot = "rendezvous: rank 0 cannot listen on port " + std::to_string(port) + ": ";
  Socket s(::socket(AF_INET, SOCK_STREAM, 0));
  if (s.fd() < 0) throw_errno(cannot + "socket");
  int one = 1;
  if (::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0) throw_errno(cannot + "setsockopt(SO_REUSEADDR)");
  const int flags = ::fcntl(s.fd(), F_GETFL);
  if (flags < 0 || ::fcntl(s.fd(), F_SETFL, flags | O_NONBLOCK) != 0) throw_errno(cannot + "fcntl(O_NONBLOCK)");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(uint16_t(port));
  if (::bind(s.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    throw std::runtime_error(cannot + "bind: " + std::strerror(errno) + " (is the port in use?)");
  if (::listen(s.fd(), 128) != 0) throw_errno(cannot + "listen");
  return s;
}

// A connection rank 0 accepted: where it came from (for messages) and its hello so far.
struct Peer {
  Socket socket;
  std::string address;
  Clock::time_point hello_deadline;
  Hello hello{};
  size_t hello_bytes = 0;
};

// Rank 0's connections: the ranks whose hello arrived, and those whose hello is still due.
struct Connections {
  std::vector<Peer> ranks;           // index = rank; an empty socket until that rank's hello
  std::vector<Peer> pending;         // accepted, hello incomplete
  std::vector<std::string> dropped;  // addresses that sent no hello within kHelloTimeout

  int known() const {
    int n = 0;
    for (const Peer& p : ranks) n += p.socket.fd() >= 0;
    return n;
  }
};

inline std::string address_of(const sockaddr_in& a) {
  char ip[INET_ADDRSTRLEN];
  if (!::inet_ntop(AF_INET, &a.sin_addr, ip, sizeof ip)) return "(unknown address)";
  return std::string(ip) + ":" + std::to_string(ntohs(a.sin_port));
}

// Best effort: a peer that cannot be told (it left, or does not read) fails on its own deadline.
inline void send_error(const Socket& peer, const std::string& message, Clock::time_point deadline) {
  if (peer.fd() < 0) return;
  std::array<char, kErrorBytes> text{};
  message.copy(text.data(), text.size() - 1);
  uint32_t status = kStatusError;
  if (transfer(peer.fd(), &status, sizeof status, true, deadline)) transfer(peer.fd(), text.data(), text.size(), true, deadline);
}

// Takes every connection waiting on the server socket into `pending`.
inline void accept_waiting(int server, int port, Connections& c) {
  for (;;) {
    sockaddr_in from{};
    socklen_t length = sizeof from;
    Socket s(::accept(server, reinterpret_cast<sockaddr*>(&from), &length));
    if (s.fd() < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;  // that connection is gone
      throw_errno("rank 0 cannot accept a connection on port " + std::to_string(port));
    }
    Peer p;
    p.socket = std::move(s);
    p.address = address_of(from);
    p.hello_deadline = Clock::now() + kHelloTimeout;
    c.pending.push_back(std::move(p));
  }
}

// Reads what has arrived of a peer's hello; false if the peer closed (or reset) its connection.
inline bool read_hello(Peer& p) {
  char* into = reinterpret_cast<char*>(p.hello.data()) + p.hello_bytes;
  const ssize_t n = ::recv(p.socket.fd(), into, sizeof(Hello) - p.hello_bytes, MSG_DONTWAIT);
  if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return true;
  if (n <= 0) return false;
  p.hello_bytes += size_t(n);
  return true;
}

// A complete hello must name a free rank of this world; otherwise the whole rendezvous fails.
inline void check_claim(const ProcessGroupEnv& g, const Connections& c, const Peer& p) {
  const uint32_t rank = p.hello[2], world = p.hello[3];
  if (world != uint32_t(g.world_size))
    throw std::runtime_error("rank " + std::to_string(rank) + " at " + p.address + " was started with " +
                             std::to_string(world) + " ranks, rank 0 with " + std::to_string(g.world_size));
  if (rank == 0 || rank >= uint32_t(g.world_size))
    throw std::runtime_error("a process at " + p.address + " claims rank " + std::to_string(rank) + " of " +
                             std::to_string(g.world_size));
  if (c.ranks[rank].socket.fd() >= 0)
    throw std::runtime_error("rank " + std::to_string(rank) + " connected twice, from " + c.ranks[rank].address +
                             " and from " + p.address + " (was one rank number given to two processes?)");
}

// Reads the pending hellos that poll found readable (fds[1 + i] is pending[i]); a complete one
// makes its peer a rank; a closed connection, or one speaking another protocol, is dropped.
inline void read_pending(const ProcessGroupEnv& g, Connections& c, const std::vector<pollfd>& fds) {
  for (size_t i = 0; i < c.pending.size(); ++i) {
    Peer& p = c.pending[i];
    if (!fds[1 + i].revents) continue;
    if (!read_hello(p)) p.socket = Socket();
    if (p.hello_bytes < sizeof(Hello)) continue;
    if (p.hello[0] != kHelloMagic || p.hello[1] != kHelloVersion) {
      p.socket = Socket();
      continue;
    }
    check_claim(g, c, p);  // throws with p still pending, so it too is told the error
    c.ranks[p.hello[2]] = std::move(p);
  }
}

// Drops the connections whose hello is overdue, telling each why (it may be a rank that stalled).
inline void drop_silent(Connections& c) {
  for (Peer& p : c.pending) {
    if (p.socket.fd() < 0 || Clock::now() < p.hello_deadline) continue;
    send_error(p.socket, "the connection from " + p.address + " sent no hello within " + seconds(kHelloTimeout) +
                             "; rank 0 dropped it", Clock::now() + std::chrono::milliseconds(100));
    c.dropped.push_back(p.address);
    p.socket = Socket();
  }
}

// A known rank's connection turned readable: the rank left (its own deadline, a crash) or broke
// the protocol. Either way the rendezvous cannot complete.
inline void check_known_rank(const Peer& p, int rank) {
  char byte;
  const ssize_t n = ::recv(p.socket.fd(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return;
  const std::string who = "rank " + std::to_string(rank) + " at " + p.address;
  if (n > 0) throw std::runtime_error(who + " sent bytes after its hello");
  throw std::runtime_error(who + " closed its connection before the id was sent" +
                           (n < 0 ? " (" + std::string(std::strerror(errno)) + ")" : std::string()) + "; did it stop?");
}

// Checks the known ranks that poll found readable (they follow the pending ones in fds).
inline void check_known_ranks(const Connections& c, const std::vector<pollfd>& fds) {
  size_t i = 1 + c.pending.size();
  for (size_t r = 1; r < c.ranks.size(); ++r) {
    if (c.ranks[r].socket.fd() < 0) continue;
    if (fds[i++].revents) check_known_rank(c.ranks[r], int(r));
  }
}

// The poll set: the server socket, every pending connection, then every known rank.
inline std::vector<pollfd> poll_set(int server, const Connections& c) {
  std::vector<pollfd> fds{{server, POLLIN, 0}};
  for (const Peer& p : c.pending) fds.push_back({p.socket.fd(), POLLIN, 0});
  for (const Peer& p : c.ranks)
    if (p.socket.fd() >= 0) fds.push_back({p.socket.fd(), POLLIN, 0});
  return fds;
}

// Waits until something is readable, the rendezvous deadline, or the first pending hello's deadline.
inline void wait_any(std::vector<pollfd>& fds, const Connections& c, Clock::time_point deadline) {
  Clock::time_point until = deadline;
  for (const Peer& p : c.pending) until = std::min(until, p.hello_deadline);
  if (::poll(fds.data(), fds.size(), ms_left(until)) < 0 && errno != EINTR) throw_errno("rank 0's poll failed");
}

inline std::string missing_ranks(const ProcessGroupEnv& g, const Connections& c, std::chrono::milliseconds timeout) {
  std::string missing, dropped;
  for (int r = 1; r < g.world_size; ++r)
    if (c.ranks[r].socket.fd() < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
  for (const std::string& a : c.dropped) dropped += (dropped.empty() ? "" : ", ") + a;
  return "rank 0 waited " + seconds(timeout) + " on port " + std::to_string(g.id_port) + "; rank(s) " + missing +
         " never connected" +
         (dropped.empty() ? "" : "; it dropped connection(s) that sent no hello within " + seconds(kHelloTimeout) + ": " + dropped);
}

// Rank 0, until every rank's hello has arrived: one poll over all connections, so no connection
// waits for another, and every hello has its own deadline. Throws the text to tell every peer.
inline void gather_hellos(const ProcessGroupEnv& g, int server, Connections& c, Clock::time_point deadline,
                          std::chrono::milliseconds timeout) {
  while (c.known() < g.world_size - 1) {
    if (Clock::now() >= deadline) throw std::runtime_error(missing_ranks(g, c, timeout));
    std::vector<pollfd> fds = poll_set(server, c);
    wait_any(fds, c, deadline);
    check_known_ranks(c, fds);
    read_pending(g, c, fds);
    if (fds[0].revents) accept_waiting(server, g.id_port, c);
    drop_silent(c);
    c.pending.erase(std::remove_if(c.pending.begin(), c.pending.end(), [](const Peer& p) { return p.socket.fd() < 0; }),
                    c.pending.end());
  }
}

// `id` is a copy: transfer takes a writable buffer.
inline void send_id(Connections& c, UniqueIdBytes id, Clock::time_point deadline) {
  for (size_t r = 1; r < c.ranks.size(); ++r) {
    uint32_t status = kStatusId;
    const int fd = c.ranks[r].socket.fd();
    if (!transfer(fd, &status, sizeof status, true, deadline) || !transfer(fd, id.data(), id.size(), true, deadline))
      throw std::runtime_error("rank 0 could not send the id to rank " + std::to_string(r) + " at " + c.ranks[r].address);
  }
}

// Rank 0: gathers every other rank's hello, then sends each the id. On any failure every peer
// connected by then, including those still in the server's queue, gets the error text before
// rank 0 throws it, so no rank waits for its own deadline to learn that the rendezvous is over.
inline void serve_id(const ProcessGroupEnv& g, const UniqueIdBytes& id, Clock::time_point deadline,
                     std::chrono::milliseconds timeout) {
  Socket server = listen_on(g.id_port);
  Connections c;
  c.ranks.resize(size_t(g.world_size));
  try {
    gather_hellos(g, server.fd(), c, deadline, timeout);
    send_id(c, id, deadline + kAnswerGrace);
  } catch (const std::exception& e) {
    try {
      accept_waiting(server.fd(), g.id_port, c);
    } catch (const std::exception&) {
      // The failure to report is e; the peers still queued then learn of it from the closed port.
    }
    const Clock::time_point tell_deadline = Clock::now() + std::chrono::milliseconds(500);
    for (const Peer& p : c.ranks) send_error(p.socket, e.what(), tell_deadline);
    for (const Peer& p : c.pending) send_error(p.socket, e.what(), tell_deadline);
    throw std::runtime_error(std::string("rendezvous: ") + e.what());
  }
}

// Connects to rank 0, retrying until the deadline (rank 0 may start later).
inline Socket connect_to_master(const ProcessGroupEnv& g, Clock::time_point deadline, std::chrono::milliseconds timeout) {
  const std::string me = "rendezvous: rank " + std::to_string(g.rank);
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  const int resolved = ::getaddrinfo(g.master_addr.c_str(), std::to_string(g.id_port).c_str(), &hints, &found);
  if (resolved != 0 || !found)
    throw std::runtime_error(me + " cannot resolve MASTER_ADDR " + g.master_addr + ": " + ::gai_strerror(resolved));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> address(found, ::freeaddrinfo);
  int last_error = 0;
  while (Clock::now() < deadline) {
    Socket s(::socket(AF_INET, SOCK_STREAM, 0));
    if (s.fd() < 0) throw_errno(me + " cannot create a socket");
    if (::connect(s.fd(), address->ai_addr, address->ai_addrlen) == 0) return s;
    last_error = errno;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  throw std::runtime_error(me + " could not reach rank 0 at " + where(g) + " within " + seconds(timeout) +
                           (last_error ? std::string(" (") + std::strerror(last_error) + ")" : std::string()));
}

// A rank's side once connected: its hello, then rank 0's answer (the id, or the error that ended
// the rendezvous, which this rank throws as its own).
inline void receive_id(const ProcessGroupEnv& g, int master, UniqueIdBytes& id, Clock::time_point deadline,
                       std::chrono::milliseconds timeout) {
  const std::string me = "rendezvous: rank " + std::to_string(g.rank);
  Hello hello = {kHelloMagic, kHelloVersion, uint32_t(g.rank), uint32_t(g.world_size)};
  uint32_t status = kStatusId;
  // Rank 0 gives up at its own deadline and then names the missing ranks: listen a little longer.
  const Clock::time_point answer_deadline = deadline + kAnswerGrace;
  if (!transfer(master, hello.data(), sizeof hello, true, deadline) ||
      !transfer(master, &status, sizeof status, false, answer_deadline))
    throw std::runtime_error(me + " got no id from rank 0 at " + where(g) + " within " + seconds(timeout) +
                             " (did rank 0 fail?)");
  if (status != kStatusId) {
    std::array<char, kErrorBytes> text{};
    if (!transfer(master, text.data(), text.size(), false, answer_deadline))
      throw std::runtime_error(me + " stops: rank 0 reported an error but closed before its text arrived");
    text.back() = '\0';
    throw std::runtime_error(me + " stops: " + std::string(text.data()));
  }
  if (!transfer(master, id.data(), id.size(), false, answer_deadline))
    throw std::runtime_error(me + " lost rank 0 at " + where(g) + " while receiving the id");
}

}  // namespace rendezvous_detail

// Rank 0's id reaches every rank (in: rank 0's id; out: the same bytes on every other rank).
inline void broadcast_id_over_tcp(const ProcessGroupEnv& g, UniqueIdBytes& id, std::chrono::milliseconds timeout) {
  using namespace rendezvous_detail;
  if (g.world_size == 1) return;
  const Clock::time_point deadline = Clock::now() + timeout;
  if (g.rank == 0) return serve_id(g, id, deadline, timeout);
  Socket master = connect_to_master(g, deadline, timeout);
  receive_id(g, master.fd(), id, deadline, timeout);
}
// ===== end of kernels/rendezvous.h =====
// ===== kernels/residual.cuh (inlined) =====
// The learned scalar mixes of the residual stream (SPEC 1.2): block lambdas x = l0 x + l1 x0, the
// U-net skips x += w skip, the value mix v = sa0 v + sa1 ve. All are out = a x + b y with fp32
// scalars read from device memory (the masters the optimizer updates, so no host sync), bf16
// tensors, fp32 math. x may be a strided view (v is the last third of each qkv row). The scalar
// gradients are sums over T x d products: per-block partial sums in a grid fixed by the shape, then
// one block adds them in order, so they are deterministic.

#include <algorithm>
#include <stdexcept>
#include <string>

constexpr int kScalarReductionBlocks = 264;  // 2 per SM; the scratch holds 2 x this many floats

// The scalar reductions' grid: 2 blocks per SM at the record's shapes, fewer where T x d is small
// (a block per 2048 vectors of 8 at least), so that small problems do not launch idle blocks.
inline int scalar_reduction_blocks(int T, int d) {
  const size_t vectors = size_t(T) * d / 8, per_block = 256 * 8;
  return int(std::min<size_t>(kScalarReductionBlocks, std::max<size_t>(1, (vectors + per_block - 1) / per_block)));
}

inline void check_residual_width(int d, int x_stride) {
  if (d % 8 != 0 || x_stride % 8 != 0)
    throw std::invalid_argument("residual mix: width " + std::to_string(d) + " and row stride " +
                                std::to_string(x_stride) + " must be multiples of 8");
}

// out[T, d] = a x[T, d; row stride x_stride] + b y[T, d]; a or b null means 1, y null means no y term
__global__ void weighted_sum_forward_kernel(const bf16* x, int x_stride, const float* a, const bf16* y, const float* b,
                                            bf16* out, int T, int d) {
  const int vectors_per_row = d / 8;
  const float alpha = a ? *a : 1.0f, beta = !y ? 0.0f : b ? *b : 1.0f;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(T) * vectors_per_row;
       i += size_t(gridDim.x) * blockDim.x) {
    size_t t = i / vectors_per_row, c = (i % vectors_per_row) * 8;
    float xv[8], yv[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    load8(x + t * x_stride + c, xv);
    if (y) load8(y + t * d + c, yv);
#pragma unroll
    for (int k = 0; k < 8; ++k) xv[k] = alpha * xv[k] + beta * yv[k];
    store8(out + t * d + c, xv);
  }
}

inline void weighted_sum_forward(const bf16* x, const float* a, const bf16* y, const float* b, bf16* out, int T, int d,
                                 int x_stride, cudaStream_t stream) {
  check_residual_width(d, x_stride);
  weighted_sum_forward_kernel<<<elementwise_grid(size_t(T) * d / 8), 256, 0, stream>>>(x, x_stride, a, y, b, out, T, d);
  CUDA_CHECK_LAUNCH();
}

// The backward of out = a x + b y for one dout[T, d]:
//   dx[T, d; stride x_stride] = a dout        (skipped when dx is null)
//   dy[T, d] (+)= b dout                      (skipped when dy is null; accumulate_dy adds)
//   partial[block], partial[blocks + block]  = this block's share of sum(dout x), sum(dout y)
//                                             (x, y null: not needed, 0)
// dx may alias dout (same element read, then written by the same thread).
__global__ void weighted_sum_backward_kernel(const bf16* dout, const bf16* x, int x_stride, const float* a,
                                             const bf16* y, const float* b, bf16* dx, bf16* dy, bool accumulate_dy,
                                             float* partial, int T, int d) {
  const int vectors_per_row = d / 8;
  const float alpha = a ? *a : 1.0f, beta = !dy ? 0.0f : b ? *b : 1.0f;
  float dot_x = 0, dot_y = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(T) * vectors_per_row;
       i += size_t(gridDim.x) * blockDim.x) {
    size_t t = i / vectors_per_row, c = (i % vectors_per_row) * 8;
    float g[8], v[8];
    load8(dout + t * d + c, g);
    if (x) {
      load8(x + t * x_stride + c, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) dot_x += g[k] * v[k];
    }
    if (y) {
      load8(y + t * d + c, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) dot_y += g[k] * v[k];
    }
    if (dy) {
      float prev[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (accumulate_dy) load8(dy + t * d + c, prev);
#pragma unroll
      for (int k = 0; k < 8; ++k) prev[k] += beta * g[k];
      store8(dy + t * d + c, prev);
    }
    if (dx) {
#pragma unroll
      for (int k = 0; k < 8; ++k) g[k] *= alpha;
      store8(dx + t * x_stride + c, g);
    }
  }
  dot_x = block_sum(dot_x);
  dot_y = block_sum(dot_y);
  if (threadIdx.x == 0) {
    partial[blockIdx.x] = dot_x;
    partial[gridDim.x + blockIdx.x] = dot_y;
  }
}

// da += sum(partial[0, blocks)), db += sum(partial[blocks, 2 blocks)), each in block order
__global__ void add_scalar_gradients_kernel(const float* partial, int blocks, float* da, float* db) {
  float sum_x = 0, sum_y = 0;
  for (int i = threadIdx.x; i < blocks; i += blockDim.x) sum_x += partial[i], sum_y += partial[blocks + i];
  sum_x = block_sum(sum_x);
  sum_y = block_sum(sum_y);
  if (threadIdx.x == 0) {
    if (da) *da += sum_x;
    if (db) *db += sum_y;
  }
}

// Gradients of out = a x + b y (a or b null: 1): dx (stride x_stride, may alias dout) = a dout, dy (+)= b dout, and
// the scalar gradients da += sum(dout x), db += sum(dout y) (each skipped when null). scratch holds
// 2 x kScalarReductionBlocks floats.
inline void weighted_sum_backward(const bf16* dout, const bf16* x, const float* a, float* da, const bf16* y,
                                  const float* b, float* db, bf16* dx, bf16* dy, bool accumulate_dy, int T, int d,
                                  int x_stride, float* scratch, cudaStream_t stream) {
  check_residual_width(d, x_stride);
  if (dx == dout && !a) dx = nullptr;  // dx = 1 * dout in place: nothing to write
  const int blocks = scalar_reduction_blocks(T, d);
  weighted_sum_backward_kernel<<<blocks, 256, 0, stream>>>(dout, da ? x : nullptr, x_stride, a, db ? y : nullptr, b,
                                                           dx, dy, accumulate_dy, scratch, T, d);
  CUDA_CHECK_LAUNCH();
  if (!da && !db) return;
  add_scalar_gradients_kernel<<<1, 256, 0, stream>>>(scratch, blocks, da, db);
  CUDA_CHECK_LAUNCH();
}

// dst[n] += src[n], bf16, n a multiple of 8
__global__ void add_into_kernel(const bf16* src, bf16* dst, size_t vectors) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < vectors; i += size_t(gridDim.x) * blockDim.x) {
    float s[8], t[8];
    load8(src + i * 8, s);
    load8(dst + i * 8, t);
#pragma unroll
    for (int k = 0; k < 8; ++k) t[k] += s[k];
    store8(dst + i * 8, t);
  }
}

inline void add_into(const bf16* src, bf16* dst, size_t n, cudaStream_t stream) {
  if (n % 8) throw std::invalid_argument("add_into: size must be a multiple of 8");
  add_into_kernel<<<elementwise_grid(n / 8), 256, 0, stream>>>(src, dst, n / 8);
  CUDA_CHECK_LAUNCH();
}

// y[T, n] = x[T, k] W[n, k]^T + residual[T, n] (bf16): with `fused`, the residual is cuBLASLt's C
// (D elsewhere: one pass); otherwise the product and then an add (the self-check's reference, and
// the run's path with --residual-add separate).
inline void linear_with_residual(Matmul& matmul, const bf16* x, const bf16* w, bf16* y, int T, int n, int k,
                                 const bf16* residual, bool fused, cudaStream_t stream) {
  if (fused) {
    MatmulOptions o;
    o.addend = residual;
    matmul(x, Transpose::N, w, Transpose::T, y, T, n, k, CUDA_R_16BF, o, stream, 1.0f, 1.0f);
    return;
  }
  matmul(x, Transpose::N, w, Transpose::T, y, T, n, k, CUDA_R_16BF, stream);
  add_into(residual, y, size_t(T) * n, stream);
}
// ===== end of kernels/residual.cuh =====
// ===== kernels/rope.cuh (inlined) =====
// QK-norm fused with half-truncated RoPE (SPEC 1.3), forward and backward, head_dim 128.
// One warp per (token, head, q or k): lane l holds elements [4l, 4l + 4); rotation pairs j with
// j + 64, which sit in lanes l and l ^ 16. Angles are the reference's fp32 t * freq; the norm and
// rotation run in fp32 without an intermediate bf16 rounding.

#include <cmath>
#include <vector>

constexpr int kRopeHeadDim = 128;

// cos_sin [T, 64, 2]: for pair j < 32 frequency (1/1024)^(j/31), for j >= 32 zero (no rotation).
inline void rope_table_host(int T, std::vector<float>& cos_sin) {
  const int pairs = kRopeHeadDim / 2, rotated = kRopeHeadDim / 4;
  cos_sin.resize(size_t(T) * pairs * 2);
  for (int j = 0; j < pairs; ++j) {
    float freq = j < rotated ? std::pow(1.0f / 1024, float(j) / (rotated - 1)) : 0.0f;
    for (int t = 0; t < T; ++t) {
      float theta = float(t) * freq;  // fp32 product, as the reference's einsum
      cos_sin[(size_t(t) * pairs + j) * 2] = float(std::cos(double(theta)));
      cos_sin[(size_t(t) * pairs + j) * 2 + 1] = float(std::sin(double(theta)));
    }
  }
}

// Rotation of this lane's 4 elements; inverse applies the transpose (used by the backward).
__device__ inline void rope_rotate(float v[4], const float* cos_sin_t, int lane, bool inverse) {
  float other[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) other[i] = __shfl_xor_sync(0xffffffffu, v[i], 16);
  bool first_half = lane < 16;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    int j = (lane % 16) * 4 + i;
    float c = cos_sin_t[2 * j], s = cos_sin_t[2 * j + 1];
    if (inverse) s = -s;
    // y1 = x1 c + x2 s ; y2 = -x1 s + x2 c
    v[i] = first_half ? v[i] * c + other[i] * s : -other[i] * s + v[i] * c;
  }
}

// qkv [T, 3, H, 128] raw projections -> q, k [T, H, 128] normalised and rotated.
__global__ void qk_norm_rope_forward_kernel(const bf16* qkv, const float* cos_sin, bf16* q, bf16* k, int T,
                                            int H, float eps) {
  int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= T * H * 2) return;
  int which = warp % 2, th = warp / 2, t = th / H, h = th % H;
  const bf16* src = qkv + (size_t(t) * 3 + which) * H * kRopeHeadDim + h * kRopeHeadDim + lane * 4;
  float v[4], ss = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) ss += (v[i] = __bfloat162float(src[i])) * v[i];
  float inv = rsqrtf(warp_sum(ss) / kRopeHeadDim + eps);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] *= inv;
  rope_rotate(v, cos_sin + size_t(t) * kRopeHeadDim, lane, false);
  bf16* dst = (which == 0 ? q : k) + size_t(th) * kRopeHeadDim + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) dst[i] = __float2bfloat16(v[i]);
}

// dq, dk [T, H, 128] -> the q and k parts of dqkv [T, 3, H, 128] (the v part is left untouched).
__global__ void qk_norm_rope_backward_kernel(const bf16* qkv, const bf16* dq, const bf16* dk,
                                             const float* cos_sin, bf16* dqkv, int T, int H, float eps) {
  int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= T * H * 2) return;
  int which = warp % 2, th = warp / 2, t = th / H, h = th % H;
  size_t raw_at = (size_t(t) * 3 + which) * H * kRopeHeadDim + h * kRopeHeadDim + lane * 4;
  const bf16* grad = (which == 0 ? dq : dk) + size_t(th) * kRopeHeadDim + lane * 4;
  float x[4], g[4], ss = 0, dot = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[i] = __bfloat162float(qkv[raw_at + i]);
    g[i] = __bfloat162float(grad[i]);
  }
  rope_rotate(g, cos_sin + size_t(t) * kRopeHeadDim, lane, true);
#pragma unroll
  for (int i = 0; i < 4; ++i) ss += x[i] * x[i], dot += x[i] * g[i];
  float inv = rsqrtf(warp_sum(ss) / kRopeHeadDim + eps), mean_dot = warp_sum(dot) / kRopeHeadDim;
#pragma unroll
  for (int i = 0; i < 4; ++i) dqkv[raw_at + i] = __float2bfloat16(inv * g[i] - inv * inv * inv * x[i] * mean_dot);
}

inline void qk_norm_rope_forward(const bf16* qkv, const float* cos_sin, bf16* q, bf16* k, int T, int H,
                                 cudaStream_t stream, float eps = kRmsEps) {
  const int warps = 8, items = T * H * 2;
  qk_norm_rope_forward_kernel<<<(items + warps - 1) / warps, warps * 32, 0, stream>>>(qkv, cos_sin, q, k, T, H, eps);
  CUDA_CHECK_LAUNCH();
}

inline void qk_norm_rope_backward(const bf16* qkv, const bf16* dq, const bf16* dk, const float* cos_sin, bf16* dqkv,
                                  int T, int H, cudaStream_t stream, float eps = kRmsEps) {
  const int warps = 8, items = T * H * 2;
  qk_norm_rope_backward_kernel<<<(items + warps - 1) / warps, warps * 32, 0, stream>>>(qkv, dq, dk, cos_sin, dqkv,
                                                                                       T, H, eps);
  CUDA_CHECK_LAUNCH();
}
// ===== end of kernels/rope.cuh =====
// ===== kernels/schedules.h (inlined) =====
// The recipe's schedules (SPEC 1.4 and 1.8), host-side: learning-rate factor, Muon momentum warmup
// and the sliding-window size in 128-token blocks. Shared by the trainer and the CPU reference.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

struct Schedule {
  int num_iterations = 1770;
  double cooldown_frac = 0.4;
  double min_lr_factor = 0.1;
  int momentum_warmup_steps = 300;
  double momentum_start = 0.85, momentum_end = 0.95;
  double max_window_tokens = 1728;  // grows to next_multiple_of_128(1728) = 1792 tokens = 14 blocks
  int window_granularity = 128;

  double progress(int step) const {
    if (step < 0 || step > num_iterations)
      throw std::out_of_range("step " + std::to_string(step) + " outside [0, " +
                              std::to_string(num_iterations) + "]");
    return double(step) / num_iterations;
  }

  // Flat 1.0, then linear down to min_lr_factor over the last cooldown_frac of training.
  double lr_factor(int step) const {
    double x = progress(step);
    if (x < 1 - cooldown_frac) return 1.0;
    double w = (1 - x) / cooldown_frac;
    return w * 1.0 + (1 - w) * min_lr_factor;
  }

  double muon_momentum(int step) const {
    double frac = std::min(double(step) / momentum_warmup_steps, 1.0);
    return (1 - frac) * momentum_start + frac * momentum_end;
  }

  // Long window in blocks; the short window is half of it (rounded down).
  int window_blocks(int step) const {
    double target = max_window_tokens * progress(step);
    // The reference's next_multiple_of_n(v, 128): the smallest multiple >= v, at least 128.
    int tokens = std::max(window_granularity,
                          int(std::ceil(target / window_granularity)) * window_granularity);
    return tokens / window_granularity;
  }
};
// ===== end of kernels/schedules.h =====
// ===== kernels/self_check.cuh (inlined) =====
// The start-up self-check: every fast path of the step beside a simple GPU path of the same
// mathematics, on small problems of the run's shapes, with bounds drawn from the GPU tests'.
// A first run on new hardware (or a new driver, CUDA or cuBLASLt) may find a fast path that the
// CPU emulator passed but the GPU does not compute as we read PTX and cuBLASLt; the trainer then
// replaces that path by its reference for the whole run (or stops, with --self-check strict)
// instead of training silently wrong. The references are the paths the flags select anyway:
//   flash attention (flash_attention.cuh)      --attention reference: the warp-per-row kernels (attention.cuh)
//   FP8 lm_head (fp8_head.cuh)                 --bf16-head: bf16 products
//   the cross-entropy's fused e5m2 gradient    --fp8-gradient cast: bf16 gradient, then a cast
//   batched Muon (strided cuBLASLt batches)    --muon per-matrix: Newton-Schulz one matrix at a time
//   the residual as cuBLASLt's C               --residual-add separate: the product, then an add
// ===== kernels/check_arrays.cuh (inlined) =====
// Arrays for comparing a GPU path with a reference, shared by the start-up self-check
// (kernels/self_check.cuh) and the GPU tests: a device buffer, random inputs, bf16 conversions,
// and the relative error ||out - ref|| / ||ref||.

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

// n device elements of T (one at least), freed with the buffer; download waits for the device.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) { CUDA_CHECK(cudaMalloc(&ptr_, std::max<size_t>(n, 1) * sizeof(T))); }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  void upload(const std::vector<T>& host) { CUDA_CHECK(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice)); }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  void poison() { CUDA_CHECK(cudaMemset(ptr_, 0xFF, n_ * sizeof(T))); }  // NaN for fp32 and bf16

 private:
  T* ptr_ = nullptr;
  size_t n_;
};

inline std::vector<double> random_normal(size_t n, uint64_t seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<double> v(n);
  for (double& x : v) x = normal(rng);
  return v;
}

inline std::vector<bf16> to_bf16(const std::vector<double>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16(float(v[i]));
  return out;
}

template <typename T>
std::vector<double> to_double(const std::vector<T>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = double(static_cast<float>(v[i]));
  return out;
}

// The values a bf16 round trip leaves: the reference computes from exactly what the GPU sees.
inline std::vector<double> rounded_to_bf16(const std::vector<double>& v) { return to_double(to_bf16(v)); }

// ||out - ref|| / ||ref||; infinity when any output is NaN or infinite (an unwritten poisoned
// element) or when ref is zero and out is not; 0 when both are zero.
inline double relative_error(const std::vector<double>& out, const std::vector<double>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(out[i])) return std::numeric_limits<double>::infinity();
    diff += (out[i] - ref[i]) * (out[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  if (norm == 0) return diff == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(diff) / std::sqrt(norm);
}

inline bool all_finite(const std::vector<double>& v) {
  for (double x : v)
    if (!std::isfinite(x)) return false;
  return true;
}
// ===== end of kernels/check_arrays.cuh =====

#include <chrono>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

// Which implementation of each replaceable part of the step a run uses (true: the fast one).
struct KernelPaths {
  bool flash_attention = true;
  bool fp8_head = true;
  bool fused_e5m2_gradient = true;
  bool batched_muon = true;
  bool fused_residual_add = true;
};

// A fast path: its KernelPaths member, its name in the log, the flag that selects its reference,
// and the test-only fault that gives it a wrong result (kernels/faults.h).
struct FastPath {
  bool KernelPaths::*member;
  const char* name;
  const char* reference_flag;
  Fault fault;
};

inline const std::vector<FastPath>& fast_paths() {
  static const std::vector<FastPath> paths = {
      {&KernelPaths::flash_attention, "flash attention", "--attention reference", Fault::wrong_flash_attention},
      {&KernelPaths::fp8_head, "FP8 head", "--bf16-head", Fault::wrong_fp8_head},
      {&KernelPaths::fused_e5m2_gradient, "fused e5m2 gradient", "--fp8-gradient cast",
       Fault::wrong_fused_e5m2_gradient},
      {&KernelPaths::batched_muon, "batched Muon", "--muon per-matrix", Fault::wrong_batched_muon},
      {&KernelPaths::fused_residual_add, "residual as cuBLASLt's C", "--residual-add separate",
       Fault::wrong_fused_residual_add},
  };
  return paths;
}

// One comparison: the worst relative error of the fast path's outputs against the reference's, or
// the error that stopped it.
struct SelfCheckResult {
  std::string name;
  bool KernelPaths::*path;
  double error, bound;
  std::string failure;  // what stopped the check before it had an error ("" if nothing)
  bool passed() const { return error <= bound; }  // NaN fails

  std::string line() const {
    char text[512];
    if (failure.empty())
      std::snprintf(text, sizeof text, "self-check %s: rel. error %.2e (bound %.0e) %s", name.c_str(), error, bound,
                    passed() ? "ok" : "FAILED");
    else
      std::snprintf(text, sizeof text, "self-check %s: %s FAILED", name.c_str(), failure.c_str());
    return text;
  }
};

// The problems' shapes: the model's width, heads and vocabulary; the attention problems' length
// (windows up to 14 blocks and documents across block edges need 16 blocks).
struct SelfCheckShape {
  int model_dim, num_heads, vocab_size;
  int attention_tokens = 16 * kAttentionBlock;
  int head_rows = 128;      // the FP8 head's rows (a multiple of 16)
  int residual_rows = 256;  // tokens of the residual products
};

namespace self_check {

// Bounds from the GPU tests'. Two bf16 paths that each stay within test_attention's and
// test_residual's 5e-3 of the exact result may differ by twice that (the emulator measured
// 2.8-3.0e-3 for attention, 1.7-2.2e-3 for the residual adds), where a wrong layout or operand
// gives errors of order 1. The FP8 products against bf16 products of the same FP8 values differ
// only by the tensor cores' accumulation and the output's rounding (test_fp8_head's bounds: bf16
// outputs 1e-2, the fp32 weight gradient 2e-3). The two Muon paths differ only in cuBLASLt's
// choice of algorithm for a batch or a single matrix.
constexpr double kBf16PathsBound = 1e-2, kFp8ProductBound = 1e-2, kFp8WeightGradBound = 2e-3, kMuonBound = 1e-2;
// The two gradient paths store the same fp32 value through the same two roundings: equal bytes
// (this bound leaves room for a compiler contracting one instantiation's arithmetic differently).
constexpr double kE5m2Bound = 1e-3;

inline std::vector<bf16> random_bf16(size_t n, double std, uint64_t seed) { return to_bf16(random_normal(n, seed, std)); }

inline std::vector<float> random_f32(size_t n, double std, uint64_t seed) {
  const std::vector<double> v = random_normal(n, seed, std);
  return std::vector<float>(v.begin(), v.end());
}

// relative_error of a fast path's outputs, which its injected fault (tests only) scales by 1.25
// first: a wrong result.
inline double fast_path_error(std::vector<double> fast, const std::vector<double>& ref, Fault fault) {
  if (injected_fault() == fault)
    for (double& x : fast) x *= 1.25;
  return relative_error(fast, ref);
}

// Flash attention's forward and both backward kernels against the reference kernels on one layout
// (document ids from `tokens`) and window: the worst of y, dq, dk and dv.
inline double attention_error(const SelfCheckShape& s, const uint16_t* tokens, uint16_t bos, int window,
                              cudaStream_t stream) {
  const int T = s.attention_tokens, H = s.num_heads, d = s.model_dim;
  std::vector<int32_t> docs = attention_document_ids(tokens, T, bos);
  AttentionBlockLists lists = build_attention_blocks(docs, window);
  StagedUploads uploads;
  uploads.reset(AttentionMask::upload_bytes(docs, lists));
  AttentionMask mask(docs, lists, uploads, stream);
  const size_t n = size_t(T) * d;
  // Scores of std ~0.5 (q and k of std 0.6, scale 0.12 over 128 dimensions), as test_attention.
  DeviceBuffer<bf16> q(random_bf16(n, 0.6, 11 + window)), k(random_bf16(n, 0.6, 12 + window)),
      v(random_bf16(n, 1.0, 13 + window)), dy(random_bf16(n, 1.0, 14 + window));
  const AttentionTensors a{T, H, d, d, d};
  std::vector<double> outputs[2][4];  // [flash, reference][y, dq, dk, dv]
  for (int reference = 0; reference < 2; ++reference) {
    DeviceBuffer<bf16> y(n), dq(n), dk(n), dv(n);
    DeviceBuffer<float> lse(size_t(T) * H), delta(size_t(T) * H);
    auto forward = reference ? attention_forward : flash_attention_forward;
    auto backward = reference ? attention_backward : flash_attention_backward;
    forward(q.get(), k.get(), v.get(), y.get(), lse.get(), a, mask, stream);
    backward(q.get(), k.get(), v.get(), y.get(), dy.get(), lse.get(), delta.get(), dq.get(), dk.get(), dv.get(), a,
             mask, stream);
    const DeviceBuffer<bf16>* results[4] = {&y, &dq, &dk, &dv};
    for (int i = 0; i < 4; ++i) outputs[reference][i] = to_double(results[i]->download());
  }
  double worst = 0;
  for (int i = 0; i < 4; ++i)
    worst = std::max(worst, fast_path_error(outputs[0][i], outputs[1][i], Fault::wrong_flash_attention));
  return worst;
}

// FP8 bytes as the bf16 values they encode (exact: bf16 holds every e4m3 and e5m2 value).
template <Fp8Kind kind>
__global__ void fp8_to_bf16_kernel(const fp8* in, bf16* out, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16(
        float(__half(__nv_cvt_fp8_to_halfraw(in[i], kind == Fp8Kind::e4m3 ? __NV_E4M3 : __NV_E5M2))));
}

template <Fp8Kind kind>
void fp8_to_bf16(const fp8* in, bf16* out, size_t n, cudaStream_t stream) {
  fp8_to_bf16_kernel<kind><<<elementwise_grid(n), 256, 0, stream>>>(in, out, n);
  CUDA_CHECK_LAUNCH();
}

// The FP8 head (a forward, the loss and its gradient, a backward on random rows) against bf16
// products of the same FP8 operands, scaled as the FP8 products are: the errors of the logits, dx
// and dW; with `gradient`, also its fused e5m2 gradient against the bf16 gradient cast afterwards
// (both copies).
inline std::vector<double> fp8_head_errors(const SelfCheckShape& s, bool gradient, Matmul& matmul,
                                           cudaStream_t stream) {
  const int rows = s.head_rows, V = s.vocab_size, d = s.model_dim;
  Fp8Head head(rows, V, d);
  const Fp8HeadScales& sc = head.scales();
  DeviceBuffer<bf16> x(random_bf16(size_t(rows) * d, 1.0, 21)), logits(size_t(rows) * V), dx(size_t(rows) * d);
  DeviceBuffer<float> w(random_f32(size_t(V) * d, 0.05, 22)), dw(std::vector<float>(size_t(V) * d, 0.0f)),
      losses(rows);
  std::vector<uint16_t> host_targets(rows);
  std::mt19937_64 rng(23);
  for (uint16_t& t : host_targets) t = uint16_t(rng() % V);
  DeviceBuffer<uint16_t> targets(host_targets);
  const Softcap softcap = Softcap::for_model_dim(d);
  head.quantize_weight(w.get(), stream);
  head.forward(x.get(), logits.get(), rows, matmul, stream);
  head.loss_and_gradient(logits.get(), targets.get(), losses.get(), softcap, stream);  // fused: logits kept
  head.backward(dx.get(), dw.get(), matmul, stream);

  // The same products in bf16 over the FP8 operands' values.
  const Fp8HeadOperands op = head.operands();
  DeviceBuffer<bf16> xq(size_t(rows) * d), wq(size_t(V) * d), gq(size_t(rows) * V), gq_t(size_t(V) * rows),
      xq_t(size_t(d) * rows), logits_ref(size_t(rows) * V), dx_ref(size_t(rows) * d);
  DeviceBuffer<float> dw_ref(size_t(V) * d);
  fp8_to_bf16<Fp8Kind::e4m3>(op.x, xq.get(), size_t(rows) * d, stream);
  fp8_to_bf16<Fp8Kind::e4m3>(op.x_t, xq_t.get(), size_t(rows) * d, stream);
  fp8_to_bf16<Fp8Kind::e4m3>(op.w, wq.get(), size_t(V) * d, stream);
  fp8_to_bf16<Fp8Kind::e5m2>(op.g, gq.get(), size_t(rows) * V, stream);
  fp8_to_bf16<Fp8Kind::e5m2>(op.g_t, gq_t.get(), size_t(rows) * V, stream);
  matmul(xq.get(), Transpose::N, wq.get(), Transpose::T, logits_ref.get(), rows, V, d, CUDA_R_16BF, stream,
         sc.x * sc.w);
  matmul(gq.get(), Transpose::N, wq.get(), Transpose::N, dx_ref.get(), rows, d, V, CUDA_R_16BF, stream,
         sc.grad * sc.w);
  matmul(gq_t.get(), Transpose::N, xq_t.get(), Transpose::T, dw_ref.get(), V, d, rows, CUDA_R_32F, stream,
         sc.grad * sc.x);
  std::vector<double> errors = {
      fast_path_error(to_double(logits.download()), to_double(logits_ref.download()), Fault::wrong_fp8_head),
      fast_path_error(to_double(dx.download()), to_double(dx_ref.download()), Fault::wrong_fp8_head),
      fast_path_error(to_double(dw.download()), to_double(dw_ref.download()), Fault::wrong_fp8_head)};
  if (!gradient) return errors;

  // The cast path on the same logits (it overwrites them): both e5m2 copies against the fused path's.
  const std::vector<double> fused = to_double(gq.download()), fused_t = to_double(gq_t.download());
  head.set_fused_gradient(false);
  head.loss_and_gradient(logits.get(), targets.get(), losses.get(), softcap, stream);
  fp8_to_bf16<Fp8Kind::e5m2>(op.g, gq.get(), size_t(rows) * V, stream);
  fp8_to_bf16<Fp8Kind::e5m2>(op.g_t, gq_t.get(), size_t(rows) * V, stream);
  errors.push_back(std::max(fast_path_error(fused, to_double(gq.download()), Fault::wrong_fused_e5m2_gradient),
                            fast_path_error(fused_t, to_double(gq_t.download()), Fault::wrong_fused_e5m2_gradient)));
  return errors;
}

// One Muon step of a shape group, batched against one matrix at a time, from equal states: the
// worst error of the parameters' updates and of the momenta.
inline double muon_error(int rows, int cols, int count, Matmul& matmul, cudaStream_t stream) {
  const size_t n = size_t(rows) * cols;
  const std::vector<float> p0 = random_f32(count * n, 0.02, 31), g = random_f32(count * n, 1.0, 32),
                           m0 = random_f32(count * n, 0.5, 33);
  const MuonStep step{0.05f, 0.95f, 0.125f};
  MuonWorkspace workspace(count * n, count);
  std::vector<double> updates[2], momenta[2];  // [batched, per matrix]
  for (int per_matrix = 0; per_matrix < 2; ++per_matrix) {
    DeviceBuffer<float> p(p0), grad(g), momentum(m0);
    std::vector<MuonMatrix> matrices;
    for (int i = 0; i < count; ++i) matrices.push_back({p.get() + i * n, grad.get() + i * n, momentum.get() + i * n});
    if (per_matrix) muon_update_each(matrices, rows, cols, step, workspace, matmul, stream);
    else muon_update(matrices, rows, cols, step, workspace, matmul, stream);
    const std::vector<float> after = p.download();
    for (size_t i = 0; i < after.size(); ++i) updates[per_matrix].push_back(double(after[i]) - double(p0[i]));
    momenta[per_matrix] = to_double(momentum.download());
  }
  return std::max(fast_path_error(updates[0], updates[1], Fault::wrong_batched_muon),
                  fast_path_error(momenta[0], momenta[1], Fault::wrong_batched_muon));
}

// y = x W^T + residual with the residual as cuBLASLt's C, against the product and then the add.
inline double residual_error(int rows, int n, int k, Matmul& matmul, cudaStream_t stream) {
  DeviceBuffer<bf16> x(random_bf16(size_t(rows) * k, 1.0, 41)), w(random_bf16(size_t(n) * k, 0.03, 42)),
      residual(random_bf16(size_t(rows) * n, 1.0, 43));
  std::vector<double> outputs[2];
  for (int separate = 0; separate < 2; ++separate) {
    DeviceBuffer<bf16> y(size_t(rows) * n);
    linear_with_residual(matmul, x.get(), w.get(), y.get(), rows, n, k, residual.get(), !separate, stream);
    outputs[separate] = to_double(y.download());
  }
  return fast_path_error(outputs[0], outputs[1], Fault::wrong_fused_residual_add);
}

// The results of checks that run together (one error each): an exception inside them (cuBLASLt
// refusing a layout on new hardware, say) fails them all with its message, instead of leaving
// this rank before the ranks' vote.
struct CheckSpec {
  std::string name;
  bool KernelPaths::*path;
  double bound;
};

template <class Errors>
void add_results(std::vector<SelfCheckResult>& results, const std::vector<CheckSpec>& specs, Errors errors) {
  std::vector<double> values;
  std::string failure;
  try {
    values = errors();
  } catch (const std::exception& e) {
    failure = e.what();
  }
  for (size_t i = 0; i < specs.size(); ++i)
    results.push_back({specs[i].name, specs[i].path,
                       failure.empty() ? values.at(i) : std::numeric_limits<double>::infinity(), specs[i].bound,
                       failure});
}

}  // namespace self_check

// Every fast path that `in_use` uses against its reference; one result per problem (a path the
// flags replaced already is not checked: its failure would change nothing). `tokens`
// ([attention_tokens]) gives the attention problems their document layout.
inline std::vector<SelfCheckResult> run_self_check(const SelfCheckShape& s, const KernelPaths& in_use,
                                                   const uint16_t* tokens, uint16_t bos, Matmul& matmul,
                                                   cudaStream_t stream) {
  using namespace self_check;
  std::vector<SelfCheckResult> results;
  if (in_use.flash_attention)
    for (int window : {1, 3, 14})
      add_results(results, {{"flash attention, window " + std::to_string(window), &KernelPaths::flash_attention,
                             kBf16PathsBound}},
                  [&] { return std::vector<double>{attention_error(s, tokens, bos, window, stream)}; });
  if (in_use.fp8_head) {
    std::vector<CheckSpec> specs = {{"FP8 head logits", &KernelPaths::fp8_head, kFp8ProductBound},
                                    {"FP8 head dx", &KernelPaths::fp8_head, kFp8ProductBound},
                                    {"FP8 head dW", &KernelPaths::fp8_head, kFp8WeightGradBound}};
    if (in_use.fused_e5m2_gradient)
      specs.push_back({"fused e5m2 gradient", &KernelPaths::fused_e5m2_gradient, kE5m2Bound});
    add_results(results, specs, [&] { return fp8_head_errors(s, in_use.fused_e5m2_gradient, matmul, stream); });
  }
  const int d = s.model_dim;
  if (in_use.batched_muon)
    for (int rows : {d, 4 * d}) {
      const int count = rows == d ? 3 : 2;  // a qkv weight's three, an MLP's two
      add_results(results, {{"batched Muon " + std::to_string(rows) + "x" + std::to_string(d),
                             &KernelPaths::batched_muon, kMuonBound}},
                  [&] { return std::vector<double>{muon_error(rows, d, count, matmul, stream)}; });
    }
  if (in_use.fused_residual_add)
    for (int k : {d, 4 * d})
      add_results(results, {{"residual as cuBLASLt's C, k = " + std::to_string(k), &KernelPaths::fused_residual_add,
                             kBf16PathsBound}},
                  [&] { return std::vector<double>{residual_error(s.residual_rows, d, k, matmul, stream)}; });
  return results;
}
// ===== end of kernels/self_check.cuh =====
// ===== kernels/sharding.h (inlined) =====
// The sharding planner of SPEC 4.3: which rank owns which part of which parameter.
// DistAdam: every parameter split on dim 0 into W equal slices (padded). Muon: matrices grouped by
// shape; member i of a group is owned by rank i % W, and chunk k holds members [kW, kW + W).
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

enum class OptimizerKind { adam, muon };

struct ParamInfo {
  std::string name;
  std::vector<int64_t> shape;
  OptimizerKind optimizer;
};

// Rank r owns rows [r * rows_per_rank, (r + 1) * rows_per_rank) of the padded parameter; the pad
// rows past `rows` exist only in communication buffers and are never read as data.
struct AdamShard {
  int param;                               // index into the planner's parameter list
  int64_t rows, row_elems, rows_per_rank;  // rows_per_rank = ceil(rows / world_size)
  int world_size;

  int64_t padded_rows() const { return rows_per_rank * world_size; }
  int64_t slice_elems() const { return rows_per_rank * row_elems; }
  int64_t first_row(int rank) const { return rank * rows_per_rank; }
  int64_t valid_rows(int rank) const {
    int64_t left = rows - first_row(rank);
    return left <= 0 ? 0 : left < rows_per_rank ? left : rows_per_rank;
  }
};

struct MuonChunk {
  std::vector<int> owner_param;  // [W]: the parameter rank r owns in this chunk, or -1 (scratch)
};

struct MuonGroup {
  std::vector<int64_t> shape;
  std::vector<int> params;  // members in parameter order
  std::vector<MuonChunk> chunks;
  int64_t matrix_elems() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

struct ShardPlan {
  int world_size = 1;
  std::vector<AdamShard> adam;  // Adam parameters in parameter order
  std::vector<MuonGroup> muon;  // groups in order of first appearance

  // Parameter indices, group by group and chunk by chunk: the order in which the owner updates them.
  std::vector<int> muon_params_owned_by(int rank) const {
    std::vector<int> owned;
    for (const MuonGroup& g : muon)
      for (const MuonChunk& c : g.chunks)
        if (c.owner_param.at(rank) >= 0) owned.push_back(c.owner_param[rank]);
    return owned;
  }
};

namespace sharding_detail {

inline void validate_param(const ParamInfo& p) {
  if (p.shape.empty()) throw std::invalid_argument("parameter '" + p.name + "' has no dimensions");
  for (int64_t d : p.shape)
    if (d <= 0) throw std::invalid_argument("parameter '" + p.name + "' has a dimension of size " + std::to_string(d));
  if (p.optimizer == OptimizerKind::muon && p.shape.size() < 2)
    throw std::invalid_argument("Muon parameter '" + p.name + "' must have at least 2 dimensions");
}

inline MuonGroup& muon_group_of(std::vector<MuonGroup>& groups, const std::vector<int64_t>& shape) {
  for (MuonGroup& g : groups)
    if (g.shape == shape) return g;
  groups.push_back({shape, {}, {}});
  return groups.back();
}

inline AdamShard adam_shard(int param, const std::vector<int64_t>& shape, int world_size) {
  int64_t rows = shape[0], row_elems = 1;  // a 1-D parameter is a column of single-element rows
  for (size_t d = 1; d < shape.size(); ++d) row_elems *= shape[d];
  return {param, rows, row_elems, (rows + world_size - 1) / world_size, world_size};
}

// Chunk k holds members [kW, kW + W); a rank past the group's end owns nothing (-1) in the last chunk.
inline std::vector<MuonChunk> muon_chunks(const std::vector<int>& members, int world_size) {
  std::vector<MuonChunk> chunks;
  for (size_t base = 0; base < members.size(); base += world_size) {
    MuonChunk chunk{std::vector<int>(world_size, -1)};
    for (int r = 0; r < world_size && base + r < members.size(); ++r) chunk.owner_param[r] = members[base + r];
    chunks.push_back(std::move(chunk));
  }
  return chunks;
}

}  // namespace sharding_detail

// world_size >= 1. A Muon parameter needs >= 2 dims, an Adam one >= 1; bad input throws
// std::invalid_argument naming the parameter.
inline ShardPlan plan_shards(const std::vector<ParamInfo>& params, int world_size) {
  using namespace sharding_detail;
  if (world_size < 1) throw std::invalid_argument("world size " + std::to_string(world_size) + " < 1");
  ShardPlan plan;
  plan.world_size = world_size;
  for (int p = 0; p < int(params.size()); ++p) {
    validate_param(params[p]);
    if (params[p].optimizer == OptimizerKind::muon) muon_group_of(plan.muon, params[p].shape).params.push_back(p);
    else plan.adam.push_back(adam_shard(p, params[p].shape, world_size));
  }
  for (MuonGroup& g : plan.muon) g.chunks = muon_chunks(g.params, world_size);
  return plan;
}
// ===== end of kernels/sharding.h =====
// ===== kernels/watchdog.h (inlined) =====
// A progress watchdog for distributed runs. A rank whose peer died or diverged waits inside an NCCL
// collective forever: no error, no exit, and a launcher that stops all ranks when one exits never
// learns of it. The trainer beats at every phase; when no beat comes for the timeout, the
// watchdog's thread reports the phase it stalled in, and end_stalled_rank ends the process with
// a distinct status, so the launcher (run.sh, torchrun, srun) stops the others.
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

// The exit status of a rank ended by end_stalled_rank: distinct from the trainer's 1 (error) and
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

// What a stalled rank writes last: every buffered line of the process (the console's, the run
// log's), so the step the rank reached is not lost with it.
inline void flush_all_output() {
  if (std::fflush(nullptr) != 0) std::perror("error: flushing output");
}

// The trainer's on_stall: says which rank stalled and where on stderr, flushes the output on a
// detached thread for at most `flush_deadline` (a pipe nobody reads could hold it), then ends the
// process with kStalledRankExitCode. It does not abort the communicator: ncclCommAbort makes the
// stuck collective return, and the main thread would go on with buffers no peer reduced (and could
// checkpoint them); the process's end stops its GPU work and closes NCCL's connections anyway.
// std::_Exit, not exit: the main thread is still inside a collective, and static destructors would
// wait on it or on CUDA.
[[noreturn]] inline void end_stalled_rank(int rank, const std::string& message,
                                          std::function<void()> finish_output = flush_all_output,
                                          std::chrono::milliseconds flush_deadline = std::chrono::seconds(10)) {
  std::fprintf(stderr, "error: rank %d: %s; exiting\n", rank, message.c_str());
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> finished = done->get_future();
  try {
    std::thread([done, finish = std::move(finish_output)] {
      finish();
      done->set_value();
    }).detach();
    if (finished.wait_for(flush_deadline) == std::future_status::timeout)
      std::fprintf(stderr, "error: rank %d: flushing the output did not end within %.1f s; exiting without it\n", rank,
                   flush_deadline.count() / 1000.0);
  } catch (const std::system_error& e) {
    std::fprintf(stderr, "error: rank %d: cannot start the thread that flushes the output: %s\n", rank, e.what());
  }
  std::_Exit(kStalledRankExitCode);
}
// ===== end of kernels/watchdog.h =====

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <variant>
#include <vector>

// ------------------------------------------------------------------------------------------------
// Hyperparameters (SPEC 1.8 and 4.1). Every field is a command-line flag of the same name with
// dashes: --num-iterations 860. The defaults are the 8xH100 record.
// ------------------------------------------------------------------------------------------------
struct Hyperparameters {
  // data
  std::string train_files = "data/fineweb10B/fineweb_train_*.bin";
  std::string val_files = "data/fineweb10B/fineweb_val_*.bin";
  int seq_len = 48 * 1024;          // T: tokens per micro-sequence
  int micro_batches = 8;            // M: micro-sequences per optimizer step (8 = the record's batch)
  int64_t val_tokens = 10485760;    // tokens of every validation
  int val_seq_len = 256 * 1024;     // tokens per validation sequence
  // schedule
  int num_iterations = 1770;
  double cooldown_frac = 0.4;       // lr decays linearly to 0.1 over the last 40% of steps
  int val_every = 125;              // 0: only at step 0 and at the end
  int warmup_steps = 10;            // untimed kernel warmup on real data, state restored after
  // optimizers
  double adam_lr = 0.008;
  double adam_beta1 = 0.8, adam_beta2 = 0.95, adam_eps = 1e-10;
  double embed_lr_mul = 75, head_lr_mul = 27.5, scalar_lr_mul = 5;
  double muon_lr = 0.05, muon_momentum = 0.95;
  int muon_momentum_warmup = 300;   // momentum 0.85 -> 0.95 over these steps
  std::string matrix_optimizer = "muon";  // the hidden matrices': muon or rekls (docs/REKLS.md)
  // REKLS: NVIDIA's defaults (legacy_soap/rekls.py) but the lr, which it leaves open: its update is
  // an Adam step in a rotated basis, so a little below Adam's 0.008 (docs/REKLS.md); untuned.
  double rekls_lr = 0.005, rekls_beta1 = 0.9, rekls_beta2 = 0.95, rekls_shampoo_beta = 0.95, rekls_eps = 1e-8;
  double rekls_weight_decay = 0.01;
  int rekls_eigenbasis_every = 1;   // steps between eigendecompositions (1: REKLS's every step)
  // run
  uint64_t seed = 0;                // 0: a fresh random seed, logged (record runs are independent)
  int checkpoint_every = 0;         // 0: a checkpoint at the end only
  std::string checkpoint_dir = "checkpoints";
  bool resume = false;              // continue from the newest checkpoint in checkpoint_dir
  bool resume_other_settings = false;  // resume although the checkpoint's run had other settings
  std::string log_dir = "logs";
  bool bf16_head = false;           // train with a bf16 lm_head instead of the FP8 one of SPEC 1.5
  std::string grad_comm = "fp32-rs"; // gradient traffic: fp32-rs, bf16-rs or a2a-fp32acc (SPEC 4.3)
  // Streaming DiLoCo across replica groups (kernels/diloco.cuh); 1 group: off
  int diloco_groups = 1;
  int diloco_fragments = 3;         // 12 blocks: 4 a fragment
  int diloco_sync_every = 30;       // H: each fragment syncs ~59 times in the record's 1770 steps
  int diloco_sync_delay = 0;
  double diloco_outer_lr = 0.7, diloco_outer_momentum = 0.9;  // the DiLoCo paper's outer Nesterov SGD
  double diloco_alpha = 0;
  std::string diloco_comm = "fp32";
  bool diloco_host_copies = false;
  // fast paths (kernels/self_check.cuh): each may be replaced by its simple reference
  std::string attention = "flash";     // flash or reference
  std::string fp8_gradient = "fused";  // fused or cast
  std::string muon = "batched";        // batched or per-matrix
  std::string residual_add = "fused";  // fused or separate
  std::string self_check = "fallback"; // fallback, strict or off
  bool self_check_only = false;        // run the self-check and exit
  int timeline_step = 0;            // > 0: write that step's GPU schedule as a Chrome trace into log_dir
  int stall_timeout = 600;          // seconds without progress after which a rank exits (0: never)
  bool nccl_single_rank = false;    // one rank through NCCL anyway (to measure what NCCL costs)
};

// ------------------------------------------------------------------------------------------------
// Command-line flags: one table binds each flag to its field; values are parsed strictly.
// ------------------------------------------------------------------------------------------------
struct FlagError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The exit statuses: one per kind of failure, so that a script or a launcher tells a bad command
// line from bad data, a machine without a usable GPU or unusable checkpoints. --help lists them.
enum ExitStatus : int {
  kExitRunFailed = 1,   // anything else: a non-finite loss, a CUDA or NCCL error, a failed rendezvous
  kExitBadFlags = 2,    // FlagError
  kExitBadData = 3,     // DataError
  kExitNoUsableGpu = 4, // NoUsableGpu
  kExitRunFiles = 5,    // RunFilesError
  kExitSelfCheckFailed = 6,  // SelfCheckFailed
};
const std::pair<int, const char*> kExitStatusMeanings[] = {
    {0, "the run finished"},
    {kExitRunFailed, "the run failed (a non-finite loss, a CUDA, NCCL or rendezvous error): the message says why"},
    {kExitBadFlags, "bad flags"},
    {kExitBadData, "bad data: a glob matching nothing, a damaged shard, a token id >= the vocabulary, too few tokens"},
    {kExitNoUsableGpu, "no usable GPU: no NVIDIA driver, no GPU, or a GPU that is not Hopper (sm_90)"},
    {kExitRunFiles, "run files: --checkpoint-dir or --log-dir not writable, or no checkpoint --resume can continue"},
    {kExitSelfCheckFailed, "--self-check strict (or --self-check-only): a fast path failed its start-up self-check"},
    {kStalledRankExitCode, "no progress for --stall-timeout seconds (e.g. a peer rank died)"},
};

struct Flag {
  std::string name;  // without the leading dashes
  std::variant<int*, int64_t*, uint64_t*, double*, std::string*, bool*> field;
  std::string help;
  std::function<bool()> valid;  // checked after parsing; nullptr: any value
  std::string requirement;      // what `valid` asks, for the error message
};

inline std::vector<Flag> flag_table(Hyperparameters& h) {
  auto positive = [](auto* v) { return [v] { return *v > 0; }; };
  auto non_negative = [](auto* v) { return [v] { return *v >= 0; }; };
  auto fraction = [](double* v) { return [v] { return *v > 0 && *v < 1; }; };
  auto one_of = [](std::string* v, std::vector<std::string> options) {
    return [v, options] { return std::find(options.begin(), options.end(), *v) != options.end(); };
  };
  return {
      {"train-files", &h.train_files, "glob of the training shards", nullptr, ""},
      {"val-files", &h.val_files, "glob of the validation shards", nullptr, ""},
      {"seq-len", &h.seq_len, "tokens per micro-sequence (T)",
       [&h] { return h.seq_len > 0 && h.seq_len % 128 == 0; }, "a positive multiple of 128"},
      {"micro-batches", &h.micro_batches, "micro-sequences per optimizer step (M; 8 = the record's batch)",
       positive(&h.micro_batches), "positive"},
      {"val-tokens", &h.val_tokens, "tokens of every validation", positive(&h.val_tokens), "positive"},
      {"val-seq-len", &h.val_seq_len, "tokens per validation sequence",
       [&h] { return h.val_seq_len > 0 && h.val_seq_len % 128 == 0; }, "a positive multiple of 128"},
      {"num-iterations", &h.num_iterations, "optimizer steps; every schedule scales with it",
       positive(&h.num_iterations), "positive"},
      {"cooldown-frac", &h.cooldown_frac, "fraction of steps with linearly decaying lr", fraction(&h.cooldown_frac),
       "in (0, 1)"},
      {"val-every", &h.val_every, "steps between validations (0: first and last step only)",
       non_negative(&h.val_every), "non-negative"},
      {"warmup-steps", &h.warmup_steps, "untimed warmup steps, state restored after",
       non_negative(&h.warmup_steps), "non-negative"},
      {"adam-lr", &h.adam_lr, "DistAdam base learning rate", positive(&h.adam_lr), "positive"},
      {"adam-beta1", &h.adam_beta1, "Adam beta1", fraction(&h.adam_beta1), "in (0, 1)"},
      {"adam-beta2", &h.adam_beta2, "Adam beta2", fraction(&h.adam_beta2), "in (0, 1)"},
      {"adam-eps", &h.adam_eps, "Adam epsilon", positive(&h.adam_eps), "positive"},
      {"embed-lr-mul", &h.embed_lr_mul, "lr multiplier of the embeddings", positive(&h.embed_lr_mul), "positive"},
      {"head-lr-mul", &h.head_lr_mul, "lr multiplier of lm_head", positive(&h.head_lr_mul), "positive"},
      {"scalar-lr-mul", &h.scalar_lr_mul, "lr multiplier of the scalars", positive(&h.scalar_lr_mul), "positive"},
      {"muon-lr", &h.muon_lr, "Muon learning rate", positive(&h.muon_lr), "positive"},
      {"muon-momentum", &h.muon_momentum, "Muon momentum after warmup", fraction(&h.muon_momentum), "in (0, 1)"},
      {"muon-momentum-warmup", &h.muon_momentum_warmup, "steps of Muon momentum warmup from 0.85",
       positive(&h.muon_momentum_warmup), "positive"},
      {"matrix-optimizer", &h.matrix_optimizer, "optimizer of the hidden matrices: muon or rekls (Adam keeps the rest)",
       one_of(&h.matrix_optimizer, {"muon", "rekls"}), "muon or rekls"},
      {"rekls-lr", &h.rekls_lr, "REKLS learning rate (the lr schedule applies)", positive(&h.rekls_lr), "positive"},
      {"rekls-beta1", &h.rekls_beta1, "REKLS inner Adam beta1", fraction(&h.rekls_beta1), "in (0, 1)"},
      {"rekls-beta2", &h.rekls_beta2, "REKLS inner Adam beta2", fraction(&h.rekls_beta2), "in (0, 1)"},
      {"rekls-shampoo-beta", &h.rekls_shampoo_beta, "REKLS Kronecker factors' moving average",
       fraction(&h.rekls_shampoo_beta), "in (0, 1)"},
      {"rekls-eps", &h.rekls_eps, "REKLS epsilon (Adam's and the factors' eigenvalue floor)", positive(&h.rekls_eps),
       "positive"},
      {"rekls-weight-decay", &h.rekls_weight_decay, "REKLS decoupled weight decay", non_negative(&h.rekls_weight_decay),
       "non-negative"},
      {"rekls-eigenbasis-every", &h.rekls_eigenbasis_every, "REKLS steps between eigendecompositions (1: every step)",
       positive(&h.rekls_eigenbasis_every), "positive"},
      {"seed", &h.seed, "initialisation seed (0: a fresh one per run, logged)", nullptr, ""},
      {"checkpoint-every", &h.checkpoint_every, "steps between checkpoints (0: at the end only)",
       non_negative(&h.checkpoint_every), "non-negative"},
      {"checkpoint-dir", &h.checkpoint_dir, "folder of the checkpoints", nullptr, ""},
      {"resume", &h.resume, "continue from the newest checkpoint in --checkpoint-dir", nullptr, ""},
      {"resume-other-settings", &h.resume_other_settings,
       "with --resume: accept a checkpoint written with other training settings (logged)", nullptr, ""},
      {"log-dir", &h.log_dir, "folder of the run logs", nullptr, ""},
      {"bf16-head", &h.bf16_head, "train with a bf16 lm_head instead of the FP8 one (SPEC 1.5)", nullptr, ""},
      {"grad-comm", &h.grad_comm, "gradient traffic: fp32-rs, bf16-rs or a2a-fp32acc",
       one_of(&h.grad_comm, {"fp32-rs", "bf16-rs", "a2a-fp32acc"}), "one of fp32-rs, bf16-rs, a2a-fp32acc"},
      {"diloco-groups", &h.diloco_groups,
       "Streaming DiLoCo over this many replica groups of consecutive ranks (1: off); must divide the ranks",
       positive(&h.diloco_groups), "positive"},
      {"diloco-fragments", &h.diloco_fragments,
       "DiLoCo fragments: consecutive blocks (the embeddings with the first, lm_head and scalars with the last)",
       positive(&h.diloco_fragments), "positive (at most the model's 12 blocks)"},
      {"diloco-sync-every", &h.diloco_sync_every, "DiLoCo: steps between two syncs of a fragment (H)",
       [&h] { return h.diloco_sync_every > 0 && h.diloco_sync_every % h.diloco_fragments == 0; },
       "a positive multiple of --diloco-fragments"},
      {"diloco-sync-delay", &h.diloco_sync_delay,
       "DiLoCo: steps a fragment's exchange overlaps before it is applied (d < H / F)",
       [&h] {
         return h.diloco_sync_delay >= 0 && h.diloco_fragments > 0 &&
                h.diloco_sync_delay < h.diloco_sync_every / h.diloco_fragments;
       },
       "in [0, --diloco-sync-every / --diloco-fragments)"},
      {"diloco-outer-lr", &h.diloco_outer_lr, "DiLoCo outer Nesterov SGD learning rate", positive(&h.diloco_outer_lr),
       "positive"},
      {"diloco-outer-momentum", &h.diloco_outer_momentum, "DiLoCo outer Nesterov momentum",
       [&h] { return h.diloco_outer_momentum >= 0 && h.diloco_outer_momentum < 1; }, "in [0, 1)"},
      {"diloco-alpha", &h.diloco_alpha, "DiLoCo mix: local = global + alpha (local - global) (0: the global copy)",
       [&h] { return h.diloco_alpha >= 0 && h.diloco_alpha <= 1; }, "in [0, 1]"},
      {"diloco-comm", &h.diloco_comm, "DiLoCo pseudo-gradient traffic across groups: fp32 or bf16",
       one_of(&h.diloco_comm, {"fp32", "bf16"}), "fp32 or bf16"},
      {"diloco-host-copies", &h.diloco_host_copies,
       "DiLoCo: the global copies and outer momentum in pinned host memory (read over PCIe at each sync)", nullptr, ""},
      {"attention", &h.attention, "attention kernels: flash (wgmma) or reference (warp per row; slower)",
       one_of(&h.attention, {"flash", "reference"}), "flash or reference"},
      {"fp8-gradient", &h.fp8_gradient,
       "FP8 head's gradient: fused (the cross-entropy writes e5m2) or cast (bf16, then a cast)",
       one_of(&h.fp8_gradient, {"fused", "cast"}), "fused or cast"},
      {"muon", &h.muon, "Newton-Schulz: batched (strided cuBLASLt batches) or per-matrix",
       one_of(&h.muon, {"batched", "per-matrix"}), "batched or per-matrix"},
      {"residual-add", &h.residual_add, "residual adds: fused (cuBLASLt's C) or separate (a matmul, then an add)",
       one_of(&h.residual_add, {"fused", "separate"}), "fused or separate"},
      {"self-check", &h.self_check,
       "check the fast paths at start-up: fallback (a failing one's reference), strict (exit 6), off",
       one_of(&h.self_check, {"fallback", "strict", "off"}), "fallback, strict or off"},
      {"self-check-only", &h.self_check_only, "run the self-check on this GPU, print it and exit (6: a check failed)",
       nullptr, ""},
      {"timeline-step", &h.timeline_step,
       "write that step's GPU schedule to <log-dir>/timeline_rank<r>_step<N>.json (0: none)",
       non_negative(&h.timeline_step), "non-negative"},
      {"stall-timeout", &h.stall_timeout,
       "seconds without progress (a hung collective) after which a rank exits 75 (0: never)",
       non_negative(&h.stall_timeout), "non-negative"},
      {"nccl-single-rank", &h.nccl_single_rank, "with one rank, communicate through NCCL anyway (measures its cost)",
       nullptr, ""},
  };
}

template <typename T>
T parse_number(const std::string& flag, const std::string& text) {
  T value{};
  const char* end = text.data() + text.size();
  std::from_chars_result r{};
  if constexpr (std::is_floating_point_v<T>) {
    // from_chars for double needs GCC 11; strtod with a full-consumption check is equivalent.
    char* stop = nullptr;
    errno = 0;
    value = std::strtod(text.c_str(), &stop);
    r = {stop, errno == ERANGE ? std::errc::result_out_of_range : std::errc()};
    if (text.empty()) r.ec = std::errc::invalid_argument;
  } else {
    r = std::from_chars(text.data(), end, value);
  }
  if (r.ec == std::errc::result_out_of_range && r.ptr == end) {
    std::string range = " (beyond a double's range)";
    if constexpr (!std::is_floating_point_v<T>)
      range = " (" + std::to_string(std::numeric_limits<T>::min()) + " to " +
              std::to_string(std::numeric_limits<T>::max()) + ")";
    throw FlagError("--" + flag + ": '" + text + "' is out of range" + range);
  }
  if (r.ec != std::errc() || r.ptr != end || text.empty())
    throw FlagError("--" + flag + ": '" + text + "' is not a valid " +
                    (std::is_floating_point_v<T> ? "number" : std::is_signed_v<T> ? "integer" : "non-negative integer"));
  return value;
}

// exact: numbers in the fewest digits that read back as the same double (else 6, for people).
inline std::string flag_value_text(const Flag& f, bool exact = false) {
  return std::visit(
      [exact](auto* p) -> std::string {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::string>) return *p;
        else if constexpr (std::is_same_v<T, bool>) return *p ? "true" : "false";
        else if constexpr (std::is_floating_point_v<T>) {
          char text[32];
          for (int digits = exact ? 15 : 6; digits <= 17; ++digits) {
            std::snprintf(text, sizeof text, "%.*g", digits, *p);
            if (!exact || std::strtod(text, nullptr) == *p) break;
          }
          return text;
        } else return std::to_string(*p);
      },
      f.field);
}

inline std::string usage(const std::string& program) {
  Hyperparameters defaults;
  std::ostringstream out;
  out << "usage: " << program << " [--flag value | --flag=value]...\n\nflags (default in brackets):\n";
  for (const Flag& f : flag_table(defaults)) {
    char line[256];
    std::snprintf(line, sizeof line, "  --%-22s %s [%s]\n", f.name.c_str(), f.help.c_str(), flag_value_text(f).c_str());
    out << line;
  }
  out << "  --help                   this text\n\nexit status:\n";
  for (const auto& [status, meaning] : kExitStatusMeanings) {
    char line[256];
    std::snprintf(line, sizeof line, "  %-3d %s\n", status, meaning);
    out << line;
  }
  return out.str();
}

// A word on the command line that is no flag. A shard's path there is most often a glob that the
// shell expanded: an unquoted `--train-files data/*.bin` gives the flag the first file and leaves
// the others here, so the message says to quote the pattern. after_value_of: the flag whose value
// the word before was ("" if none).
inline std::string unexpected_argument(const std::string& arg, const std::string& after_value_of) {
  const std::string message = "unexpected argument '" + arg + "' (flags start with --)";
  const bool glob_flag_before = after_value_of == "train-files" || after_value_of == "val-files";
  std::error_code error;
  const bool shard_like = (arg.size() > 4 && arg.compare(arg.size() - 4, 4, ".bin") == 0) ||
                          (glob_flag_before && std::filesystem::is_regular_file(arg, error));
  if (!shard_like) return message;
  const std::string flag = glob_flag_before ? after_value_of : "train-files";
  Hyperparameters defaults;
  return message + ": it looks like a shard, so the shell probably expanded an unquoted glob" +
         (glob_flag_before ? " after --" + flag : "") + "; quote the pattern, e.g. --" + flag + " '" +
         (flag == "val-files" ? defaults.val_files : defaults.train_files) + "'";
}

// Parses argv into h. Throws FlagError naming the flag for unknown flags, missing or malformed
// values and values outside their range. Returns false when --help was asked.
inline bool parse_flags(int argc, char** argv, Hyperparameters& h) {
  std::vector<Flag> flags = flag_table(h);
  std::string after_value_of;  // the flag whose value argv[i - 1] was
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return false;
    if (arg.rfind("--", 0) != 0) throw FlagError(unexpected_argument(arg, after_value_of));
    after_value_of.clear();
    std::string name = arg.substr(2), value;
    bool inline_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      inline_value = true;
    }
    auto flag = std::find_if(flags.begin(), flags.end(), [&](const Flag& f) { return f.name == name; });
    if (flag == flags.end()) throw FlagError("unknown flag --" + name + " (--help lists them)");
    if (std::holds_alternative<bool*>(flag->field)) {
      if (inline_value) throw FlagError("--" + name + " takes no value");
      *std::get<bool*>(flag->field) = true;
      continue;
    }
    if (!inline_value) {
      if (i + 1 >= argc) throw FlagError("--" + name + " needs a value");
      value = argv[++i];
      after_value_of = name;
    }
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, std::string>) *p = value;
          else if constexpr (!std::is_same_v<T, bool>) *p = parse_number<T>(name, value);
        },
        flag->field);
  }
  for (const Flag& f : flags)
    if (f.valid && !f.valid()) throw FlagError("--" + f.name + " = " + flag_value_text(f) + ": must be " + f.requirement);
  if (h.val_tokens % h.val_seq_len != 0)
    throw FlagError("--val-tokens " + std::to_string(h.val_tokens) + " is not a multiple of --val-seq-len " +
                    std::to_string(h.val_seq_len));
  if (h.timeline_step > h.num_iterations)
    throw FlagError("--timeline-step " + std::to_string(h.timeline_step) + " is past the run's last step " +
                    "(--num-iterations " + std::to_string(h.num_iterations) + "): no trace would be written");
  return true;
}

inline Schedule schedule_of(const Hyperparameters& h) {
  Schedule s;
  s.num_iterations = h.num_iterations;
  s.cooldown_frac = h.cooldown_frac;
  s.momentum_warmup_steps = h.muon_momentum_warmup;
  s.momentum_end = h.muon_momentum;
  return s;
}

// ------------------------------------------------------------------------------------------------
// Run log: logs/<run-id>.txt in the reference's layout (SPEC Part 2): the trainer's source, the
// environment, the parameters, then step lines that the reference's tools parse unchanged.
// ------------------------------------------------------------------------------------------------
// At an evaluation step s of N: the mean validation loss and the timed training so far.
inline std::string validation_line(int step, int num_iterations, double val_loss, double train_ms) {
  char line[160];
  std::snprintf(line, sizeof line, "step:%d/%d val_loss:%.4f train_time:%.0fms step_avg:%.2fms", step,
                num_iterations, val_loss, train_ms, train_ms / std::max(step, 1));
  return line;
}

// After training step s (1-based) of N.
inline std::string train_step_line(int step, int num_iterations, double train_ms) {
  char line[128];
  std::snprintf(line, sizeof line, "step:%d/%d train_time:%.0fms step_avg:%.2fms", step, num_iterations, train_ms,
                train_ms / std::max(step, 1));
  return line;
}

inline std::string peak_memory_line(size_t allocated_bytes, size_t reserved_bytes) {
  return "peak memory allocated: " + std::to_string(allocated_bytes >> 20) +
         " MiB reserved: " + std::to_string(reserved_bytes >> 20) + " MiB";
}

inline std::string new_run_id() {
  std::random_device entropy;
  char id[40];
  std::snprintf(id, sizeof id, "%08x-%04x-4%03x-%04x-%08x%04x", entropy(), entropy() & 0xffff, entropy() & 0xfff,
                0x8000 | (entropy() & 0x3fff), entropy(), entropy() & 0xffff);
  return id;
}

// The source this binary was built from: embedded by the build (CMake writes trainer_source.inc
// from train_gpt.cu and every header of kernels/ and data/); a frozen single-file record built by
// hand with nvcc has no such file and logs its own source file, read at start.
#if __has_include("trainer_source.inc")
#include "trainer_source.inc"  // static const char kTrainerSource[]
inline std::string trainer_source() { return kTrainerSource; }
#else
inline std::string trainer_source() {
  std::ifstream in(__FILE__, std::ios::binary);
  if (!in) return std::string("(source not embedded and ") + __FILE__ + " not readable)\n";
  return std::string(std::istreambuf_iterator<char>(in), {});
}
#endif

inline std::string command_output(const char* command) {
  std::string out;
  if (FILE* pipe = popen(command, "r")) {
    char buffer[4096];
    while (size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) out.append(buffer, n);
    pclose(pipe);
  }
  return out.empty() ? std::string("(") + command + ": no output)\n" : out;
}

inline std::string environment_report() {
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  int nccl = 0;
  ncclGetVersion(&nccl);
  std::ostringstream out;
  out << "Running CUDA driver " << driver / 1000 << "." << driver % 1000 / 10 << ", runtime " << runtime / 1000
      << "." << runtime % 1000 / 10 << ", cuBLASLt " << cublasLtGetVersion() << ", NCCL " << nccl << "\n";
  out << command_output("nvidia-smi 2>&1");
  return out.str();
}

const std::string kLogRule(100, '=');

// Rank 0's log file; every line also goes to the console.
class RunLog {
 public:
  RunLog(const std::string& dir, const std::string& run_id) : path_(dir + "/" + run_id + ".txt") {
    std::filesystem::create_directories(dir);
    file_.open(path_);
    if (!file_) throw std::runtime_error(path_ + ": cannot create the run log");
  }
  const std::string& path() const { return path_; }
  // The log's head: source, rule, environment, rule (as the reference).
  void header(const std::string& source, const std::string& environment) {
    file_ << source << (source.empty() || source.back() == '\n' ? "" : "\n") << kLogRule << "\n"
          << environment << kLogRule << "\n";
    file_.flush();
  }
  void line(const std::string& text, bool console = true) {
    file_ << text << "\n";
    file_.flush();
    if (console) std::printf("%s\n", text.c_str());
  }

 private:
  std::string path_;
  std::ofstream file_;
};

// ------------------------------------------------------------------------------------------------
// Checkpoints: named byte blobs (parameters, optimizer state, the flags that shaped them), each
// with a hash that catches a damaged file, in one file written to a temporary name and renamed, so
// a crash never leaves a torn checkpoint under the real name. The data position is the step.
// ------------------------------------------------------------------------------------------------
// The files a run writes or resumes from: a folder it cannot write, a checkpoint it cannot continue.
struct RunFilesError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct CheckpointError : RunFilesError {
  using RunFilesError::RunFilesError;
};

struct Checkpoint {
  int step = 0;
  std::vector<std::pair<std::string, std::vector<uint8_t>>> blobs;  // in writing order

  const std::vector<uint8_t>& blob(const std::string& name, const std::string& path) const {
    for (const auto& [n, bytes] : blobs)
      if (n == name) return bytes;
    throw CheckpointError(path + ": no '" + name + "' in the checkpoint");
  }
};

constexpr char kCheckpointMagic[8] = {'S', 'P', 'D', 'R', 'C', 'K', 'P', '2'};

// A 64-bit hash of bytes, 8 at a time (fast enough for gigabytes): catches damage, not forgery.
inline uint64_t checkpoint_hash(const std::vector<uint8_t>& bytes) {
  uint64_t h = 0x243F6A8885A308D3ull ^ bytes.size();
  auto mix = [&h](uint64_t word) {
    h = (h ^ word) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
  };
  size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    uint64_t word;
    std::memcpy(&word, bytes.data() + i, 8);
    mix(word);
  }
  uint64_t tail = 0;
  std::memcpy(&tail, bytes.data() + i, bytes.size() - i);
  mix(tail);
  return h;
}

inline std::string checkpoint_path(const std::string& dir, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%06d.ckpt", step);
  return dir + "/" + name;
}

// The bytes reach the disk (fsync) before the rename makes them the checkpoint of that step.
inline void write_checkpoint(const std::string& dir, const Checkpoint& c) {
  std::filesystem::create_directories(dir);
  std::string path = checkpoint_path(dir, c.step), temp = path + ".tmp";
  {
    std::unique_ptr<FILE, int (*)(FILE*)> out(std::fopen(temp.c_str(), "wb"), &std::fclose);
    if (!out) throw CheckpointError(temp + ": cannot create: " + std::strerror(errno));
    bool ok = true;
    auto put = [&](const void* p, size_t n) { ok = ok && std::fwrite(p, 1, n, out.get()) == n; };
    auto put_u64 = [&](uint64_t v) { put(&v, sizeof v); };
    put(kCheckpointMagic, sizeof kCheckpointMagic);
    put_u64(uint64_t(c.step));
    put_u64(c.blobs.size());
    for (const auto& [name, bytes] : c.blobs) {
      put_u64(name.size());
      put(name.data(), name.size());
      put_u64(bytes.size());
      put(bytes.data(), bytes.size());
      put_u64(checkpoint_hash(bytes));
    }
    if (!ok || std::fflush(out.get()) != 0 || ::fsync(::fileno(out.get())) != 0) {
      const std::string reason = std::strerror(errno);
      out.reset();
      std::filesystem::remove(temp);
      throw CheckpointError(temp + ": write failed: " + reason);
    }
  }
  std::filesystem::rename(temp, path);
  const int folder = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);  // the rename itself reaches the disk
  if (folder >= 0) ::fsync(folder), ::close(folder);
}

inline Checkpoint read_checkpoint(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CheckpointError(path + ": cannot open the checkpoint");
  auto get = [&](void* p, size_t n, const char* what) {
    if (!in.read(static_cast<char*>(p), std::streamsize(n)))
      throw CheckpointError(path + ": truncated checkpoint (while reading " + what + ")");
  };
  auto get_u64 = [&](const char* what) {
    uint64_t v;
    get(&v, sizeof v, what);
    return v;
  };
  char magic[sizeof kCheckpointMagic];
  get(magic, sizeof magic, "the magic");
  if (std::memcmp(magic, kCheckpointMagic, sizeof magic) != 0) throw CheckpointError(path + ": not a checkpoint (bad magic)");
  Checkpoint c;
  const uint64_t step = get_u64("the step");
  if (step > uint64_t(std::numeric_limits<int>::max())) throw CheckpointError(path + ": corrupt checkpoint (step " + std::to_string(step) + ")");
  c.step = int(step);
  uint64_t count = get_u64("the blob count");
  uint64_t file_size = std::filesystem::file_size(path);
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t name_size = get_u64("a name length");
    if (name_size > file_size) throw CheckpointError(path + ": corrupt checkpoint (name length " + std::to_string(name_size) + ")");
    std::string name(name_size, '\0');
    get(name.data(), name_size, "a name");
    uint64_t size = get_u64("a blob size");
    if (size > file_size) throw CheckpointError(path + ": truncated checkpoint ('" + name + "' claims " + std::to_string(size) + " bytes)");
    std::vector<uint8_t> bytes(size);
    get(bytes.data(), size, name.c_str());
    if (get_u64("a hash") != checkpoint_hash(bytes)) throw CheckpointError(path + ": '" + name + "' is damaged (its hash differs)");
    c.blobs.emplace_back(std::move(name), std::move(bytes));
  }
  if (in.peek() != std::char_traits<char>::eof()) throw CheckpointError(path + ": trailing bytes after the last blob");
  return c;
}

// The checkpoint of the highest step in dir (files named step_<digits>.ckpt), or "" when there is
// none. Temporary files of an interrupted write and other names are ignored.
inline std::string newest_checkpoint(const std::string& dir) {
  std::string newest;
  long long newest_step = -1;
  if (!std::filesystem::is_directory(dir)) return newest;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const size_t digits = name.size() - std::min(name.size(), sizeof "step_.ckpt" - 1);
    if (digits == 0 || digits > 9 || name.rfind("step_", 0) != 0 || name.compare(5 + digits, 5, ".ckpt") != 0 ||
        !std::all_of(name.begin() + 5, name.begin() + 5 + digits, [](char ch) { return ch >= '0' && ch <= '9'; }))
      continue;
    const long long step = std::stoll(name.substr(5, digits));
    if (step > newest_step) newest_step = step, newest = entry.path().string();
  }
  return newest;
}

// "name=value" lines, numbers exact, of the flags `keep` accepts by name.
inline std::string exact_flag_lines(Hyperparameters h, const std::function<bool(const std::string&)>& keep) {
  std::string lines;
  for (const Flag& f : flag_table(h))
    if (keep(f.name)) lines += f.name + "=" + flag_value_text(f, /*exact=*/true) + "\n";
  return lines;
}

// The flags a checkpoint's state depends on (the data, the batch, the schedules, the optimizers'
// settings, the head, the gradient traffic, DiLoCo's) and the world size, as "name=value" lines: a resumed
// run must have the same, or it would not continue the same run.
inline std::string resume_flags(const Hyperparameters& h, int world_size) {
  static const char* const names[] = {
      "train-files", "seq-len", "micro-batches", "num-iterations", "cooldown-frac", "adam-lr", "adam-beta1",
      "adam-beta2", "adam-eps", "embed-lr-mul", "head-lr-mul", "scalar-lr-mul", "muon-lr", "muon-momentum",
      "muon-momentum-warmup", "bf16-head", "grad-comm"};
  // DiLoCo's and REKLS's only where they are on, so that a checkpoint of a run without them reads as
  // before (where DiLoCo's copies live changes no state)
  const bool diloco = h.diloco_groups > 1, rekls = h.matrix_optimizer == "rekls";
  return "world-size=" + std::to_string(world_size) + "\n" + exact_flag_lines(h, [diloco, rekls](const std::string& name) {
           return std::find(std::begin(names), std::end(names), name) != std::end(names) ||
                  (diloco && name.rfind("diloco-", 0) == 0 && name != "diloco-host-copies") ||
                  (rekls && (name == "matrix-optimizer" || name.rfind("rekls-", 0) == 0));
         });
}

// "" when the checkpoint's flags equal this run's, else each difference.
inline std::string resume_flag_differences(const std::string& saved, const std::string& now) {
  auto parse = [](const std::string& text) {
    std::vector<std::pair<std::string, std::string>> values;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) {
      size_t eq = line.find('=');
      values.emplace_back(line.substr(0, eq), eq == std::string::npos ? "" : line.substr(eq + 1));
    }
    return values;
  };
  const auto before = parse(saved), after = parse(now);
  auto value_in = [](const auto& values, const std::string& name) {
    for (const auto& [n, v] : values)
      if (n == name) return v;
    return std::string("(none)");
  };
  std::string differences;
  for (const auto& [name, value] : after)
    if (value_in(before, name) != value)
      differences += "; --" + name + " was " + value_in(before, name) + ", is " + value;
  for (const auto& [name, value] : before)  // a setting only the checkpoint's run had (--matrix-optimizer rekls)
    if (value_in(after, name) == "(none)") differences += "; --" + name + " was " + value + ", is (none)";
  return differences.empty() ? "" : differences.substr(2);
}

// ------------------------------------------------------------------------------------------------
// Model shape and parameters (SPEC 1.1, 1.6). Matrices, lm_head and the scalars have fp32 masters
// (Muon and Adam update them) and bf16 copies the matmuls read; the embeddings are bf16 parameters
// as in the reference. Every gradient is an fp32 SUM over the step's micro-sequences (SPEC 4.2).
// ------------------------------------------------------------------------------------------------
struct GPTConfig {
  int num_layers = 12, model_dim = 768, num_heads = 6, vocab_size = 50304;
  uint16_t bos_token = kBosToken;
  int num_value_embeds = 3;
  // The record's layer pattern: layer 7 without attention, value embeddings 0,1,2 on the first and
  // last three layers, long (L) and short (S) windows L S S S L S S L S S S L.
  std::vector<bool> has_attention = {true, true, true, true, true, true, true, false, true, true, true, true};
  std::vector<int> value_embed = {0, 1, 2, -1, -1, -1, -1, -1, -1, 0, 1, 2};
  std::vector<bool> long_window = {true, false, false, false, true, false, false, true, false, false, false, true};

  int mlp_dim() const { return 4 * model_dim; }
  int num_skips() const { return num_layers / 2; }
  // scalars: [0:L) skip weights, [L:3L) block lambdas, [3L:5L) SA lambdas, ones to a multiple of 8.
  int num_scalars() const { return (5 * num_layers + 7) / 8 * 8; }
  int skip_weight_index(int i) const { return i; }
  int block_lambda_index(int layer, int k) const { return num_layers + 2 * layer + k; }
  int sa_lambda_index(int layer, int k) const { return 3 * num_layers + 2 * layer + k; }
  Softcap softcap() const { return Softcap::for_model_dim(model_dim); }

  void validate() const {
    if (model_dim != num_heads * kAttentionHeadDim)
      throw std::invalid_argument("model_dim " + std::to_string(model_dim) + " must be num_heads x 128");
    if (vocab_size % 128 != 0) throw std::invalid_argument("vocab_size must be a multiple of 128");
    if (int(has_attention.size()) != num_layers || int(value_embed.size()) != num_layers ||
        int(long_window.size()) != num_layers)
      throw std::invalid_argument("the layer pattern must have num_layers entries");
  }
};

enum class ParamKind { embed, value_embed, qkv, attn_proj, mlp_fc, mlp_proj, lm_head, scalars };

struct Param {
  std::string name;
  std::vector<int64_t> shape;
  ParamKind kind;
  int layer;       // the block, or the value-embedding table; -1 otherwise
  int64_t numel;
  size_t offset;   // into the embedding store (embeddings) or the master store (everything else)
  bool is_embedding() const { return kind == ParamKind::embed || kind == ParamKind::value_embed; }
};

// Module order (the reference's named_parameters order); storage groups Muon's shapes together.
inline std::vector<Param> parameter_list(const GPTConfig& c) {
  const int64_t V = c.vocab_size, d = c.model_dim, F = c.mlp_dim();
  std::vector<Param> list{{"embed.weight", {V, d}, ParamKind::embed, -1, V * d, 0}};
  for (int k = 0; k < c.num_value_embeds; ++k)
    list.push_back({"value_embeds." + std::to_string(k) + ".weight", {V, d}, ParamKind::value_embed, k, V * d, 0});
  for (int i = 0; i < c.num_layers; ++i) {
    std::string b = "blocks." + std::to_string(i) + ".";
    if (c.has_attention[i]) {
      list.push_back({b + "attn.qkv_w", {3, d, d}, ParamKind::qkv, i, 3 * d * d, 0});
      list.push_back({b + "attn.c_proj.weight", {d, d}, ParamKind::attn_proj, i, d * d, 0});
    }
    list.push_back({b + "mlp.c_fc.weight", {F, d}, ParamKind::mlp_fc, i, F * d, 0});
    list.push_back({b + "mlp.c_proj.weight", {d, F}, ParamKind::mlp_proj, i, d * F, 0});
  }
  list.push_back({"lm_head.weight", {V, d}, ParamKind::lm_head, -1, V * d, 0});
  list.push_back({"scalars", {c.num_scalars()}, ParamKind::scalars, -1, c.num_scalars(), 0});
  size_t embedding_end = 0, master_end = 0;
  for (ParamKind kind : {ParamKind::embed, ParamKind::value_embed, ParamKind::qkv, ParamKind::attn_proj,
                         ParamKind::mlp_fc, ParamKind::mlp_proj, ParamKind::lm_head, ParamKind::scalars})
    for (Param& p : list)
      if (p.kind == kind) {
        size_t& end = p.is_embedding() ? embedding_end : master_end;
        p.offset = end;
        end += size_t(p.numel);
      }
  return list;
}

// cudaMalloc that names the buffer and the size when the GPU is out of memory.
template <typename T>
T* device_alloc(const std::string& name, size_t count) {
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T));
  if (err != cudaSuccess) {
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    throw std::runtime_error("cannot allocate " + name + ": " + std::to_string(count * sizeof(T) >> 20) + " MiB (" +
                             cudaGetErrorString(err) + "; " + std::to_string(free_bytes >> 20) + " of " +
                             std::to_string(total_bytes >> 20) + " MiB free)");
  }
  return static_cast<T*>(p);
}

// Owns the device buffers it hands out.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() {
    for (void* p : owned_) cudaFree(p);
  }
  template <typename T>
  T* alloc(const std::string& name, size_t count) {
    T* p = device_alloc<T>(name, count);
    owned_.push_back(p);
    allocated_bytes_ += count * sizeof(T);
    return p;
  }
  size_t allocated_bytes() const { return allocated_bytes_; }

 private:
  std::vector<void*> owned_;
  size_t allocated_bytes_ = 0;
};

struct ParameterStore {
  std::vector<Param> list;
  size_t embedding_count = 0, master_count = 0;
  bf16* embeddings = nullptr;       // [embedding_count] bf16 parameters
  float* master = nullptr;          // [master_count] fp32 masters
  bf16* weights = nullptr;          // [master_count] bf16 copies of the masters (what the matmuls read)
  float* embedding_grads = nullptr; // [embedding_count]
  float* grads = nullptr;           // [master_count]

  ParameterStore(const GPTConfig& c, DeviceMemory& memory) : list(parameter_list(c)) {
    for (const Param& p : list) (p.is_embedding() ? embedding_count : master_count) += size_t(p.numel);
    embeddings = memory.alloc<bf16>("embedding parameters", embedding_count);
    master = memory.alloc<float>("fp32 master parameters", master_count);
    weights = memory.alloc<bf16>("bf16 weight copies", master_count);
    embedding_grads = memory.alloc<float>("embedding gradients", embedding_count);
    grads = memory.alloc<float>("gradients", master_count);
  }
  const Param& find(ParamKind kind, int layer) const {
    for (const Param& p : list)
      if (p.kind == kind && p.layer == layer) return p;
    throw std::logic_error("no parameter of this kind in layer " + std::to_string(layer));
  }
  const bf16* weight(ParamKind kind, int layer) const { return weights + find(kind, layer).offset; }
  float* grad(ParamKind kind, int layer) const { return grads + find(kind, layer).offset; }
  const bf16* embedding(int table) const {  // table -1: the token embedding, 0..2: value embeddings
    return embeddings + find(table < 0 ? ParamKind::embed : ParamKind::value_embed, table).offset;
  }
  float* embedding_grad(int table) const {
    return embedding_grads + find(table < 0 ? ParamKind::embed : ParamKind::value_embed, table).offset;
  }
  const float* scalars() const { return master + find(ParamKind::scalars, -1).offset; }
  float* scalar_grads() const { return grads + find(ParamKind::scalars, -1).offset; }

  void zero_grads(cudaStream_t stream) const {
    CUDA_CHECK(cudaMemsetAsync(embedding_grads, 0, embedding_count * sizeof(float), stream));
    CUDA_CHECK(cudaMemsetAsync(grads, 0, master_count * sizeof(float), stream));
  }
};

// After every optimizer step: the bf16 copies the next forward reads (weight.type_as(x)).
inline void refresh_weight_copies(const ParameterStore& s, cudaStream_t stream) {
  convert(s.master, s.weights, s.master_count, stream);
}

// SPEC 1.6 on the host from one seed: embeddings N(0, 1), qkv and c_fc U(+-sqrt(3) 0.5/sqrt(d)),
// projections and lm_head zero, scalars (skip 1, lambdas (1, 0), SA lambdas (0.5, 0.5), pad 1).
inline void initialize_parameters(const GPTConfig& c, const ParameterStore& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  float bound = float(std::sqrt(3.0) * 0.5 / std::sqrt(double(c.model_dim)));
  std::uniform_real_distribution<float> linear(-bound, bound);
  std::vector<bf16> embeddings(s.embedding_count);
  std::vector<float> master(s.master_count, 0.0f);
  for (const Param& p : s.list) {
    if (p.is_embedding()) {
      for (int64_t i = 0; i < p.numel; ++i) embeddings[p.offset + i] = __float2bfloat16(normal(rng));
    } else if (p.kind == ParamKind::qkv || p.kind == ParamKind::mlp_fc) {
      for (int64_t i = 0; i < p.numel; ++i) master[p.offset + i] = linear(rng);
    } else if (p.kind == ParamKind::scalars) {
      float* w = &master[p.offset];
      std::fill(w, w + p.numel, 1.0f);
      for (int i = 0; i < c.num_layers; ++i) {
        w[c.block_lambda_index(i, 1)] = 0.0f;
        w[c.sa_lambda_index(i, 0)] = w[c.sa_lambda_index(i, 1)] = 0.5f;
      }
    }
  }
  CUDA_CHECK(cudaMemcpy(s.embeddings, embeddings.data(), embeddings.size() * sizeof(bf16), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(s.master, master.data(), master.size() * sizeof(float), cudaMemcpyHostToDevice));
  refresh_weight_copies(s, 0);
}

// ------------------------------------------------------------------------------------------------
// Forward and backward of one micro-sequence (SPEC 1.2). Activations the backward needs are kept
// per layer; shapes are [T, d] unless noted (d = model_dim, F = 4d, H = heads, V = vocab).
// ------------------------------------------------------------------------------------------------
struct LayerActivations {
  bf16* x_in = nullptr;     // block input after the U-net skip
  bf16* x_mixed = nullptr;  // lambda0 x_in + lambda1 x0
  bf16* h_attn = nullptr;   // rmsnorm(x_mixed)
  bf16* qkv = nullptr;      // [T, 3d] raw projections
  bf16* q = nullptr;        // qk-norm + rope of q
  bf16* k = nullptr;
  bf16* v = nullptr;        // sa0 v_raw + sa1 ve
  bf16* y = nullptr;        // attention output
  float* lse = nullptr;     // [H, T] softmax statistics
  bf16* x_mid = nullptr;    // after the attention residual (x_mixed in layers without attention)
  bf16* h_mlp = nullptr;    // rmsnorm(x_mid)
  bf16* u = nullptr;        // [T, F] c_fc output
  bf16* a = nullptr;        // [T, F] relu(u)^2
  bf16* x_out = nullptr;    // block output
};

// Rows of logits materialised at once: the head and its loss run chunk by chunk, the backward of
// each chunk right after its loss, so the [T, V] logits never exist whole (4.9 GB at the record's
// T, 26 GB at the validation length).
constexpr int kHeadChunkRows = 8192;

struct Activations {
  int max_T;
  bool for_backward;           // false: evaluation, the layers share one set of buffers
  uint16_t *inputs, *targets;  // [T] device tokens
  bf16 *embedded, *x0;         // embed(tokens), rmsnorm of it
  bf16* value_embedded[3];     // ve_k(tokens)
  std::vector<LayerActivations> layers;
  bf16* x_final;               // rmsnorm(last block output)
  bf16* logits;                // [kHeadChunkRows, V], in place their gradient
  float* losses;               // [T]
  double* loss_total;          // [1] token losses summed since the last take_loss_total
  StagedUploads uploads;       // the device copies of each micro-sequence's masks and row order
  // backward scratch
  bf16 *dx, *dx0, *dh, *dy, *dq, *dk, *dv, *dqkv, *du;  // dqkv [T, 3d], du [T, F]
  std::vector<bf16*> dskip;    // [num_skips]: gradient waiting for the skip's source layer
  float* delta;                // [H, T]
  float* reduction_scratch;    // per-block partial sums of the scalar gradients
  float* cos_sin;              // [T, 64, 2] rope table
  std::unique_ptr<Fp8Head> fp8_head;  // the FP8 operands of one head chunk and of lm_head (or null)

  // fp8_head: training activations that also hold the FP8 head's operands (SPEC 1.5).
  Activations(const GPTConfig& c, int T, bool backward, DeviceMemory& m, bool fp8_head = false)
      : max_T(T), for_backward(backward), layers(c.num_layers), dskip(c.num_skips()) {
    const size_t td = size_t(T) * c.model_dim, tf = size_t(T) * c.mlp_dim();
    inputs = m.alloc<uint16_t>("input tokens", T);
    targets = m.alloc<uint16_t>("target tokens", T);
    embedded = m.alloc<bf16>("embedded tokens", td);
    x0 = m.alloc<bf16>("x0", td);
    for (int k = 0; k < c.num_value_embeds; ++k) value_embedded[k] = m.alloc<bf16>("value embedding " + std::to_string(k), td);
    for (int i = 0; i < c.num_layers; ++i) allocate_layer(c, i, T, m);
    x_final = m.alloc<bf16>("final norm", td);
    logits = m.alloc<bf16>("logits chunk", size_t(std::min(T, kHeadChunkRows)) * c.vocab_size);
    losses = m.alloc<float>("token losses", T);
    loss_total = m.alloc<double>("summed token losses", 1);
    CUDA_CHECK(cudaMemset(loss_total, 0, sizeof(double)));
    if (backward) {
      for (bf16** b : {&dx, &dx0, &dh, &dy, &dq, &dk, &dv}) *b = m.alloc<bf16>("backward scratch [T, d]", td);
      dqkv = m.alloc<bf16>("qkv gradient", 3 * td);
      du = m.alloc<bf16>("mlp gradient", tf);
      for (bf16*& b : dskip) b = m.alloc<bf16>("skip gradient", td);
      delta = m.alloc<float>("attention delta", size_t(T) * c.num_heads);
    }
    if (backward && fp8_head) this->fp8_head = std::make_unique<Fp8Head>(std::min(T, kHeadChunkRows), c.vocab_size, c.model_dim);
    reduction_scratch = m.alloc<float>("scalar-gradient partial sums", 2 * kScalarReductionBlocks);
    cos_sin = m.alloc<float>("rope table", size_t(T) * kRopeHeadDim);
    std::vector<float> table;
    rope_table_host(T, table);
    CUDA_CHECK(cudaMemcpy(cos_sin, table.data(), table.size() * sizeof(float), cudaMemcpyHostToDevice));
  }

 private:
  // Training keeps every layer's buffers for the backward; evaluation lets layers reuse the
  // previous layer's buffers, except the outputs the U-net skips read later.
  void allocate_layer(const GPTConfig& c, int i, int T, DeviceMemory& m) {
    const size_t td = size_t(T) * c.model_dim, tf = size_t(T) * c.mlp_dim();
    LayerActivations& l = layers[i];
    const bool reuse = !for_backward && i > 0;
    const LayerActivations* prev = i > 0 ? &layers[i - 1] : nullptr;
    std::string at = "layer " + std::to_string(i) + " ";
    auto buffer = [&](bf16* previous, const std::string& name, size_t n) {
      return reuse && previous ? previous : m.alloc<bf16>(at + name, n);
    };
    // Layers before the skips read the previous output unchanged: x_in aliases it.
    l.x_in = i == 0 ? x0 : i < c.num_skips() ? prev->x_out : buffer(i > c.num_skips() ? prev->x_in : nullptr, "x_in", td);
    l.x_mixed = buffer(prev ? prev->x_mixed : nullptr, "x_mixed", td);
    if (c.has_attention[i]) {
      const LayerActivations* with_attention = prev && prev->h_attn ? prev : (i > 1 ? &layers[i - 2] : nullptr);
      l.h_attn = buffer(with_attention ? with_attention->h_attn : nullptr, "h_attn", td);
      l.qkv = buffer(with_attention ? with_attention->qkv : nullptr, "qkv", 3 * td);
      l.q = buffer(with_attention ? with_attention->q : nullptr, "q", td);
      l.k = buffer(with_attention ? with_attention->k : nullptr, "k", td);
      l.v = buffer(with_attention ? with_attention->v : nullptr, "v", td);
      l.y = buffer(with_attention ? with_attention->y : nullptr, "attention output", td);
      l.lse = reuse && with_attention ? with_attention->lse : m.alloc<float>(at + "lse", size_t(T) * c.num_heads);
      l.x_mid = buffer(with_attention ? with_attention->x_mid : nullptr, "x_mid", td);
    } else {
      l.x_mid = l.x_mixed;
    }
    l.h_mlp = buffer(prev ? prev->h_mlp : nullptr, "h_mlp", td);
    l.u = buffer(prev ? prev->u : nullptr, "u", tf);
    l.a = buffer(prev ? prev->a : nullptr, "a", tf);
    // A skip source keeps its output; other layers may overwrite the previous non-source output.
    bool previous_is_source = i - 1 < c.num_skips();
    l.x_out = buffer(i > 0 && !previous_is_source ? prev->x_out : nullptr, "x_out", td);
  }
};

// What the host derives from one micro-sequence's tokens: the attention masks (document ids, long
// and short windows) and the position order of the embeddings' deterministic backward.
// Their device copies go through the activations' StagedUploads on the stream of the step, so
// building the next plan never waits for the GPU to drain.
struct MicroSequencePlan {
  std::optional<AttentionMask> long_window, short_window;
  std::optional<EmbeddingBackwardPlan> embedding_rows;
  MicroSequencePlan(const uint16_t* host_inputs, int T, const GPTConfig& c, int window_blocks, StagedUploads& uploads,
                    cudaStream_t stream) {
    std::vector<int32_t> docs = attention_document_ids(host_inputs, T, c.bos_token);
    AttentionBlockLists long_lists = build_attention_blocks(docs, window_blocks);
    AttentionBlockLists short_lists = build_attention_blocks(docs, window_blocks / 2);
    uploads.reset(AttentionMask::upload_bytes(docs, long_lists) + AttentionMask::upload_bytes(docs, short_lists) +
                  EmbeddingBackwardPlan::upload_bytes(T));
    long_window.emplace(docs, long_lists, uploads, stream);
    short_window.emplace(docs, short_lists, uploads, stream);
    embedding_rows.emplace(host_inputs, T, c.vocab_size, uploads, stream);
  }
};

// The model's step over a set of activations: training (forward, backward) or evaluation.
class GPT {
  GPTConfig c_;  // first: validated before params are laid out from it

 public:
  GPT(const GPTConfig& c, DeviceMemory& memory) : c_((c.validate(), c)), params(c_, memory) {}

  const GPTConfig& config() const { return c_; }

  // Told on the host as the backward is queued: after the head (num_layers), after each block i
  // (i), after the embeddings (-1). From that point of the stream on, the gradients of that part
  // and of everything after it in the network are complete for this micro-sequence.
  using GradientsDone = std::function<void(int layer)>;

  // One micro-sequence whose tokens are already in acts.inputs / acts.targets: token losses summed
  // into acts.loss_total and, with backward, its gradients SUMMED into the parameter gradients.
  void step(Activations& acts, int T, const MicroSequencePlan& plan, bool backward, bool fp8_head,
            cudaStream_t stream, const GradientsDone& gradients_done = {}) {
    if (T > acts.max_T || T % kAttentionBlock != 0)
      throw std::invalid_argument("micro-sequence length " + std::to_string(T) + " must be a multiple of 128 and <= " +
                                  std::to_string(acts.max_T));
    if (backward && !acts.for_backward) throw std::logic_error("a backward pass needs training activations");
    a_ = &acts;
    T_ = T;
    stream_ = stream;
    {
      TimelineSpan span(timeline_, "compute", "forward", stream);
      forward(plan);
    }
    {
      TimelineSpan span(timeline_, "compute", backward ? "head and its backward" : "head", stream);
      head(backward, fp8_head);
      accumulate_loss(acts.losses, T, acts.loss_total, stream);
    }
    if (!backward) return;
    gradients_done_ = gradients_done ? gradients_done : [](int) {};
    gradients_done_(c_.num_layers);
    this->backward(plan);
    gradients_done_ = [](int) {};  // the caller's hook may not outlive this call
  }

  // Spans of the forward, head and each block's backward go to this timeline (null: none).
  void set_timeline(Timeline* timeline) { timeline_ = timeline; }

  // The implementations of attention, the residual adds and the FP8 head's gradient (the FP8 head
  // itself is step's fp8_head): the fast ones unless a flag or the self-check replaced them.
  void set_paths(const KernelPaths& paths) { paths_ = paths; }

  ParameterStore params;

 private:
  size_t td() const { return size_t(T_) * c_.model_dim; }
  const float* scalar(int index) const { return params.scalars() + index; }
  float* scalar_grad(int index) const { return params.scalar_grads() + index; }
  const AttentionMask& mask(const MicroSequencePlan& m, int layer) const {
    return c_.long_window[layer] ? *m.long_window : *m.short_window;
  }
  AttentionTensors attention_shape() const {
    const int64_t d = c_.model_dim;
    return {T_, c_.num_heads, d, d, d};
  }
  // y[T, n] = x[T, k] W[n, k]^T (+ residual[T, n]), bf16 out
  void linear(const bf16* x, const bf16* w, bf16* y, int n, int k, const bf16* residual = nullptr) {
    if (residual) linear_with_residual(matmul_, x, w, y, T_, n, k, residual, paths_.fused_residual_add, stream_);
    else matmul_(x, Transpose::N, w, Transpose::T, y, T_, n, k, CUDA_R_16BF, stream_);
  }
  // For y = x W^T: dx[T, k] = dy[T, n] W[n, k] and dW[n, k] += dy^T x (fp32)
  void linear_backward(const bf16* x, const bf16* w, const bf16* dy, bf16* dx, float* dw, int n, int k) {
    matmul_(dy, Transpose::N, w, Transpose::N, dx, T_, k, n, CUDA_R_16BF, stream_);
    matmul_(dy, Transpose::T, x, Transpose::N, dw, n, k, T_, CUDA_R_32F, stream_, 1.0f, 1.0f);
  }

  void forward(const MicroSequencePlan& plan) {
    Activations& a = *a_;
    const int d = c_.model_dim;
    embedding_forward(a.inputs, params.embedding(-1), a.embedded, T_, d, stream_);
    rmsnorm_forward(a.embedded, a.x0, T_, d, stream_);
    for (int k = 0; k < c_.num_value_embeds; ++k)
      embedding_forward(a.inputs, params.embedding(k), a.value_embedded[k], T_, d, stream_);
    for (int i = 0; i < c_.num_layers; ++i) {
      LayerActivations& l = a.layers[i];
      if (i >= c_.num_skips()) {  // x_in = previous output + skip weight * the mirrored layer's output
        int from = c_.num_layers - 1 - i;
        weighted_sum_forward(a.layers[i - 1].x_out, nullptr, a.layers[from].x_out,
                             scalar(c_.skip_weight_index(i - c_.num_skips())), l.x_in, T_, d, d, stream_);
      }
      weighted_sum_forward(l.x_in, scalar(c_.block_lambda_index(i, 0)), a.x0, scalar(c_.block_lambda_index(i, 1)),
                           l.x_mixed, T_, d, d, stream_);
      if (c_.has_attention[i]) attention_forward_layer(i, plan);
      mlp_forward_layer(i);
    }
    rmsnorm_forward(a.layers.back().x_out, a.x_final, T_, d, stream_);
  }

  void attention_forward_layer(int i, const MicroSequencePlan& plan) {
    LayerActivations& l = a_->layers[i];
    const int d = c_.model_dim;
    rmsnorm_forward(l.x_mixed, l.h_attn, T_, d, stream_);
    linear(l.h_attn, params.weight(ParamKind::qkv, i), l.qkv, 3 * d, d);
    qk_norm_rope_forward(l.qkv, a_->cos_sin, l.q, l.k, T_, c_.num_heads, stream_);
    int table = c_.value_embed[i];
    weighted_sum_forward(l.qkv + 2 * d, scalar(c_.sa_lambda_index(i, 0)),
                         table >= 0 ? a_->value_embedded[table] : nullptr, scalar(c_.sa_lambda_index(i, 1)), l.v, T_,
                         d, 3 * d, stream_);
    auto forward = paths_.flash_attention ? flash_attention_forward : attention_forward;
    forward(l.q, l.k, l.v, l.y, l.lse, attention_shape(), mask(plan, i), stream_);
    linear(l.y, params.weight(ParamKind::attn_proj, i), l.x_mid, d, d, /*residual=*/l.x_mixed);
  }

  void mlp_forward_layer(int i) {
    LayerActivations& l = a_->layers[i];
    const int d = c_.model_dim, F = c_.mlp_dim();
    rmsnorm_forward(l.x_mid, l.h_mlp, T_, d, stream_);
    linear(l.h_mlp, params.weight(ParamKind::mlp_fc, i), l.u, F, d);
    relu_squared_forward(l.u, l.a, size_t(T_) * F, stream_);
    linear(l.a, params.weight(ParamKind::mlp_proj, i), l.x_out, d, F, /*residual=*/l.x_mid);
  }

  // Logits, softcapped cross-entropy and, for training, the head's backward, chunk by chunk:
  // dx_final (in a.dh) = dlogits W_head, dW_head += dlogits^T x_final. The FP8 head of SPEC 1.5
  // (quantised from the fp32 master) replaces the bf16 products when training with fp8_head;
  // evaluation is always bf16, as the reference.
  void head(bool backward, bool fp8_head) {
    Activations& a = *a_;
    const int d = c_.model_dim, V = c_.vocab_size;
    Fp8Head* fp8 = backward && fp8_head ? a.fp8_head.get() : nullptr;
    if (backward && fp8_head && !fp8) throw std::logic_error("FP8 head asked of activations built without it");
    const Param& head_param = params.find(ParamKind::lm_head, -1);
    if (fp8) {
      fp8->set_fused_gradient(paths_.fused_e5m2_gradient);
      fp8->quantize_weight(params.master + head_param.offset, stream_);
    }
    const bf16* w = params.weights + head_param.offset;
    float* dw = params.grads + head_param.offset;
    for (int r0 = 0; r0 < T_; r0 += kHeadChunkRows) {
      const int rows = std::min(kHeadChunkRows, T_ - r0);
      const bf16* x = a.x_final + size_t(r0) * d;  // [rows, d]
      bf16* dx = a.dh + size_t(r0) * d;            // [rows, d]
      if (fp8) {
        fp8->forward(x, a.logits, rows, matmul_, stream_);
        fp8->loss_and_gradient(a.logits, a.targets + r0, a.losses + r0, c_.softcap(), stream_);
        fp8->backward(dx, dw, matmul_, stream_);
        continue;
      }
      matmul_(x, Transpose::N, w, Transpose::T, a.logits, rows, V, d, CUDA_R_16BF, stream_);
      softcap_cross_entropy(a.logits, a.targets + r0, a.losses + r0, rows, V, backward ? 1.0f : 0.0f, stream_,
                            c_.softcap());
      if (!backward) continue;
      matmul_(a.logits, Transpose::N, w, Transpose::N, dx, rows, d, V, CUDA_R_16BF, stream_);
      matmul_(a.logits, Transpose::T, x, Transpose::N, dw, V, d, rows, CUDA_R_32F, stream_, 1.0f, 1.0f);
    }
  }

  void backward(const MicroSequencePlan& plan) {
    Activations& a = *a_;
    const int d = c_.model_dim;
    rmsnorm_backward(a.layers.back().x_out, a.dh, a.dx, T_, d, /*accumulate=*/false, stream_);
    CUDA_CHECK(cudaMemsetAsync(a.dx0, 0, td() * sizeof(bf16), stream_));
    for (int i = c_.num_layers - 1; i >= 0; --i) {
      TimelineSpan span(timeline_, "compute", "backward block " + std::to_string(i), stream_);
      LayerActivations& l = a.layers[i];
      if (i < c_.num_skips()) add_into(a.dskip[i], a.dx, td(), stream_);
      mlp_backward_layer(i);
      if (c_.has_attention[i]) attention_backward_layer(i, plan);
      // x_mixed = lambda0 x_in + lambda1 x0
      int l0 = c_.block_lambda_index(i, 0), l1 = c_.block_lambda_index(i, 1);
      weighted_sum_backward(a.dx, l.x_in, scalar(l0), scalar_grad(l0), a.x0, scalar(l1), scalar_grad(l1), a.dx, a.dx0,
                            /*accumulate_dy=*/true, T_, d, d, a.reduction_scratch, stream_);
      if (i >= c_.num_skips()) {  // x_in = previous output + w skip
        int from = c_.num_layers - 1 - i, w = c_.skip_weight_index(i - c_.num_skips());
        weighted_sum_backward(a.dx, nullptr, nullptr, nullptr, a.layers[from].x_out, scalar(w), scalar_grad(w), a.dx,
                              a.dskip[from], /*accumulate_dy=*/false, T_, d, d, a.reduction_scratch, stream_);
      }
      gradients_done_(i);
    }
    {
      TimelineSpan span(timeline_, "compute", "backward embedding", stream_);
      add_into(a.dx, a.dx0, td(), stream_);
      rmsnorm_backward(a.embedded, a.dx0, a.dh, T_, d, /*accumulate=*/false, stream_);
      embedding_backward(*plan.embedding_rows, a.dh, params.embedding_grad(-1), nullptr, d, stream_);
    }
    gradients_done_(-1);
  }

  void mlp_backward_layer(int i) {
    Activations& a = *a_;
    LayerActivations& l = a.layers[i];
    const int d = c_.model_dim, F = c_.mlp_dim();
    // x_out = x_mid + a W_proj^T: dx passes through to x_mid
    linear_backward(l.a, params.weight(ParamKind::mlp_proj, i), a.dx, a.du, params.grad(ParamKind::mlp_proj, i), d, F);
    relu_squared_backward(l.u, a.du, a.du, size_t(T_) * F, stream_);
    linear_backward(l.h_mlp, params.weight(ParamKind::mlp_fc, i), a.du, a.dh, params.grad(ParamKind::mlp_fc, i), F, d);
    rmsnorm_backward(l.x_mid, a.dh, a.dx, T_, d, /*accumulate=*/true, stream_);
  }

  void attention_backward_layer(int i, const MicroSequencePlan& plan) {
    Activations& a = *a_;
    LayerActivations& l = a.layers[i];
    const int d = c_.model_dim;
    linear_backward(l.y, params.weight(ParamKind::attn_proj, i), a.dx, a.dy, params.grad(ParamKind::attn_proj, i), d, d);
    auto backward = paths_.flash_attention ? flash_attention_backward : attention_backward;
    backward(l.q, l.k, l.v, l.y, a.dy, l.lse, a.delta, a.dq, a.dk, a.dv, attention_shape(), mask(plan, i), stream_);
    // v = sa0 v_raw + sa1 ve: dv_raw goes into the v third of dqkv; the ve table gets sa1 dv
    int table = c_.value_embed[i], s0 = c_.sa_lambda_index(i, 0), s1 = c_.sa_lambda_index(i, 1);
    const bf16* ve = table >= 0 ? a.value_embedded[table] : nullptr;
    weighted_sum_backward(a.dv, l.qkv + 2 * d, scalar(s0), scalar_grad(s0), ve, scalar(s1), ve ? scalar_grad(s1) : nullptr,
                          a.dqkv + 2 * d, nullptr, /*accumulate_dy=*/false, T_, d, 3 * d, a.reduction_scratch, stream_);
    if (ve) embedding_backward(*plan.embedding_rows, a.dv, params.embedding_grad(table), scalar(s1), d, stream_);
    qk_norm_rope_backward(l.qkv, a.dq, a.dk, a.cos_sin, a.dqkv, T_, c_.num_heads, stream_);
    linear_backward(l.h_attn, params.weight(ParamKind::qkv, i), a.dqkv, a.dh, params.grad(ParamKind::qkv, i), 3 * d, d);
    rmsnorm_backward(l.x_mixed, a.dh, a.dx, T_, d, /*accumulate=*/true, stream_);
  }

  Matmul matmul_;
  KernelPaths paths_;
  Activations* a_ = nullptr;
  int T_ = 0;
  cudaStream_t stream_ = nullptr;
  GradientsDone gradients_done_;
  Timeline* timeline_ = nullptr;
};

// ------------------------------------------------------------------------------------------------
// Optimizers (SPEC 1.9, 1.10, 1.11) over the sharding plan of SPEC 4.3, fed by reduce-scatter:
// rank r receives the SUMMED gradient of what it owns (a dim-0 slice of every Adam parameter, one
// matrix of every chunk of W Muon matrices), updates it, and all-gathers it back. The one
// normalisation, 1/M with M the global micro-sequence count (itself a SUM over ranks), happens in
// the updates (SPEC 4.2). With W = 1 every collective is the identity and the rank owns everything.
// ------------------------------------------------------------------------------------------------
inline bool is_muon_param(ParamKind kind) {
  return kind == ParamKind::qkv || kind == ParamKind::attn_proj || kind == ParamKind::mlp_fc ||
         kind == ParamKind::mlp_proj;
}

inline ShardPlan shard_plan_of(const std::vector<Param>& list, int world_size) {
  std::vector<ParamInfo> infos;
  for (const Param& p : list)
    infos.push_back({p.name, p.shape, is_muon_param(p.kind) ? OptimizerKind::muon : OptimizerKind::adam});
  return plan_shards(infos, world_size);
}

// The GPT::GradientsDone point after which p's gradient is complete in the last micro-sequence:
// a block's matrices after their block, lm_head after the head, everything else (the embeddings,
// the scalars that every block touches) at the end.
inline int gradient_complete_after(const Param& p, int num_layers) {
  if (is_muon_param(p.kind)) return p.layer;
  return p.kind == ParamKind::lm_head ? num_layers : -1;
}

inline int num_blocks_of(const std::vector<Param>& list) {
  int layers = 0;
  for (const Param& p : list)
    if (is_muon_param(p.kind)) layers = std::max(layers, p.layer + 1);
  return layers;
}

inline double adam_lr_multiplier(const Hyperparameters& h, ParamKind kind) {
  switch (kind) {
    case ParamKind::embed:
    case ParamKind::value_embed: return h.embed_lr_mul;
    case ParamKind::lm_head: return h.head_lr_mul;
    default: return h.scalar_lr_mul;
  }
}

// A device (or host) buffer that is part of the training state: saved in checkpoints, restored
// after warmup.
struct StateBuffer {
  std::string name;
  void* data;
  size_t bytes;
};

// The global micro-sequence count: the SUM of every rank's own count (the faults are the oracle's
// injected bugs: normalising by the local count, or summing a replicated count W times).
inline double global_micro_count(DeviceCommunicator& comm, int local_count, int global_batch) {
  switch (injected_fault()) {
    case Fault::local_count_normalization: return local_count;
    case Fault::replicated_count_per_rank: return comm.all_reduce_sum(global_batch);
    default: return comm.all_reduce_sum(local_count);
  }
}

// Both optimizers wait concurrently (SPEC 4.3): every reduction of both is issued first, on a
// communication stream, most of them while the backward still runs: a reduction goes out as soon
// as the backward of the step's last micro-sequence has passed the layers its gradients come from
// (GPT::GradientsDone), hidden under the backward of the earlier layers. Each update waits only
// for its own reduction, and its all-gather goes out on the communication stream as soon as it is
// done; one combined wait at the end orders the next forward after every gather. Every rank issues
// the collectives in one order (by completion point, then plan order), whatever its own number
// of micro-sequences, as NCCL requires.
//
// Per step: begin_step(local count), the backward with gradients_done as its hook, then step().
class Optimizers {
 public:
  Optimizers(const Hyperparameters& h, const ParameterStore& params, DeviceCommunicator& comm, DeviceMemory& memory)
      : h_(h), schedule_(schedule_of(h)), params_(params), comm_(comm), grad_comm_(parse_grad_comm(h.grad_comm)),
        plan_(shard_plan_of(params.list, comm.world_size())),
        muon_workspace_(largest_muon_batch_elems(), largest_muon_batch()), group_members_(plan_.muon.size()) {
    if (h.matrix_optimizer == "rekls") rekls_ = std::make_unique<Rekls>(matrix_shapes());
    for (const AdamShard& s : plan_.adam) add_adam(s, memory);
    for (const MuonGroup& g : plan_.muon)
      for (const MuonChunk& c : g.chunks) add_muon(g, c, memory);
    for (size_t i = 0; i < collectives_.size(); ++i) launch_order_.push_back(i);
    std::stable_sort(launch_order_.begin(), launch_order_.end(), [&](size_t a, size_t b) {
      return collectives_[a].complete_after > collectives_[b].complete_after;
    });
    for (size_t i : launch_order_)  // a group's members in launch order; its last one updates the group
      if (collectives_[i].group) group_members_[group_index(collectives_[i])].push_back(i);
    size_t largest = 0;
    for (const Collective& c : collectives_) largest = std::max(largest, c.share);
    traffic_ = memory.alloc<bf16>("bf16 gradient traffic scratch", 2 * size_t(comm.world_size()) * largest);
    CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&backward_point_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&gathered_, cudaEventDisableTiming));
    zero_state();
  }
  ~Optimizers() {
    for (Collective& c : collectives_) {
      cudaEventDestroy(c.reduced);
      cudaEventDestroy(c.updated);
    }
    cudaEventDestroy(backward_point_);
    cudaEventDestroy(gathered_);
    cudaStreamDestroy(comm_stream_);
  }
  Optimizers(const Optimizers&) = delete;  // the collectives refer into the plan
  Optimizers& operator=(const Optimizers&) = delete;

  void zero_state() {
    for (const StateBuffer& b : state_buffers())
      if (b.name != "adam steps") CUDA_CHECK(cudaMemset(b.data, 0, b.bytes));
    adam_steps_ = 0;
    if (!rekls_) return;
    for (const Collective& c : collectives_)  // REKLS's eigenbases start as the identity
      if (c.group && c.state_m) {
        const auto [rows, cols] = matrix_shape(*c.group);
        for (size_t k = 0; k < c.share / (size_t(rows) * cols); ++k)
          rekls_reset_state(static_cast<float*>(c.state_m) + k * ReklsBuffers::elems(rows, cols), rows, cols, 0);
      }
    CUDA_CHECK(cudaDeviceSynchronize());
  }

  // Before the step's backward: this rank will sum its gradients over local_micro_sequences; M,
  // the global count the updates normalise by, is their SUM over the ranks. Every rank's count is
  // the same in every step (the batch plan is fixed), so the host collective runs at the first
  // step only, on every rank alike.
  void begin_step(int local_micro_sequences) {
    if (local_count_ < 0) {
      local_count_ = local_micro_sequences;
      grad_scale_ = float(1.0 / global_micro_count(comm_, local_micro_sequences, h_.micro_batches));
      if (injected_fault() == Fault::prescale_by_world) grad_scale_ /= float(comm_.world_size());
    }
    if (local_micro_sequences != local_count_)
      throw std::logic_error("rank " + std::to_string(comm_.rank()) + " has " + std::to_string(local_micro_sequences) +
                             " micro-sequences in this step, " + std::to_string(local_count_) + " before");
    launched_ = 0;
    step_begun_ = true;
  }

  // The backward hook of the step's last micro-sequence: the reductions of every collective whose
  // gradients are complete at this point of `stream`.
  void gradients_done(int layer, cudaStream_t stream) {
    if (launched_ == launch_order_.size() || collectives_[launch_order_[launched_]].complete_after < layer) return;
    CUDA_CHECK(cudaEventRecord(backward_point_, stream));
    CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, backward_point_, 0));
    for (; launched_ < launch_order_.size(); ++launched_) {
      Collective& c = collectives_[launch_order_[launched_]];
      if (c.complete_after < layer) break;
      TimelineSpan span(timeline_, "communication", "reduce " + c.name, comm_stream_);
      reduce(c, comm_stream_);
      CUDA_CHECK(cudaEventRecord(c.reduced, comm_stream_));
    }
  }

  // Training step `step` (0-based) once the rank's backward is queued on `stream`: the remaining
  // reductions (all of them on a rank without micro-sequences), the updates, the gathers.
  void step(int step, cudaStream_t stream) {
    if (!step_begun_) throw std::logic_error("Optimizers::step without begin_step");
    step_begun_ = false;
    gradients_done(std::numeric_limits<int>::min(), stream);
    ++adam_steps_;
    for (size_t i : launch_order_) {
      Collective& c = collectives_[i];
      CUDA_CHECK(cudaStreamWaitEvent(stream, c.reduced, 0));
      // A Muon group updates once, its Newton-Schulz batched over all its matrices of this rank,
      // when its last reduction is in; every member's gather follows.
      if (c.group && group_members_[group_index(c)].back() != i) continue;
      {
        TimelineSpan span(timeline_, "compute", "update " + update_name(c), stream);
        if (c.adam) adam_update_share(c, step, grad_scale_, stream);
        else update_muon_group(group_index(c), step, grad_scale_, stream);
      }
      CUDA_CHECK(cudaEventRecord(c.updated, stream));
      CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, c.updated, 0));
      for (size_t m : c.group ? group_members_[group_index(c)] : std::vector<size_t>{i}) {
        const Collective& done = collectives_[m];
        TimelineSpan span(timeline_, "communication", "gather " + done.name, comm_stream_);
        if (!(done.chunk && injected_fault() == Fault::skip_all_gather)) gather(done, comm_stream_);
      }
    }
    CUDA_CHECK(cudaEventRecord(gathered_, comm_stream_));
    CUDA_CHECK(cudaStreamWaitEvent(stream, gathered_, 0));
    refresh_weight_copies(params_, stream);
  }

  // Spans of every reduction, update and gather go to this timeline (null: none).
  void set_timeline(Timeline* timeline) { timeline_ = timeline; }

  // Newton-Schulz over strided cuBLASLt batches (--muon batched) or one matrix at a time; the
  // self-check may replace the first by the second.
  void set_batched_muon(bool batched) { batched_muon_ = batched; }

  // This rank's optimizer state, in plan order (Adam slices, then owned Muon matrices).
  std::vector<StateBuffer> state_buffers() {
    std::vector<StateBuffer> state;
    for (const Collective& c : collectives_) {
      const std::string& name = params_.list[c.adam ? c.adam->param : c.chunk->owner_param[0]].name;
      if (c.adam) {
        size_t bytes = c.share * (c.bf16_param ? sizeof(bf16) : sizeof(float));
        state.push_back({"adam m " + name, c.state_m, bytes});
        state.push_back({"adam v " + name, c.state_v, bytes});
      } else if (c.state_m) {
        const std::string& mine = params_.list[c.chunk->owner_param[comm_.rank()]].name;
        state.push_back({(rekls_ ? "rekls state " : "muon momentum ") + mine, c.state_m, matrix_state_elems(c) * sizeof(float)});
      }
    }
    state.push_back({"adam steps", &adam_steps_, sizeof adam_steps_});
    return state;
  }

 private:
  // One reduce-scatter, update and all-gather of the plan: the dim-0 slices of an Adam parameter
  // or a chunk of W Muon matrices (consecutive in storage). Rank r owns share elements at
  // r * share of the W * share that the collectives move; where fewer than that exist (a padded
  // Adam parameter, the last chunk of a group) the item goes through its own zero-padded scratch.
  struct Collective {
    const AdamShard* adam = nullptr;  // an Adam parameter, or
    const MuonGroup* group = nullptr;  // a Muon chunk
    const MuonChunk* chunk = nullptr;
    float* local_grad = nullptr;  // [count] the rank's partial sums
    void* whole = nullptr;        // [count] the parameter(s): bf16 embeddings or fp32 masters
    bool bf16_param = false;
    size_t count = 0, share = 0;
    float* padded = nullptr;      // [W * share] when count < W * share
    void *state_m = nullptr, *state_v = nullptr;  // Adam m, v of the slice; Muon momentum of the owned matrix
    float* grad = nullptr;        // the rank's summed share, once reduced
    int complete_after = -1;      // the GPT::GradientsDone point after which its gradients are complete
    std::string name;             // the parameter, or the chunk's first matrix
    cudaEvent_t reduced = nullptr, updated = nullptr;
  };

  void add_collective(Collective c, DeviceMemory& memory, const std::string& name) {
    if (c.count < size_t(comm_.world_size()) * c.share)
      c.padded = memory.alloc<float>("padded collective of " + name, size_t(comm_.world_size()) * c.share);
    CUDA_CHECK(cudaEventCreateWithFlags(&c.reduced, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&c.updated, cudaEventDisableTiming));
    collectives_.push_back(c);
  }

  void add_adam(const AdamShard& s, DeviceMemory& memory) {
    const Param& p = params_.list[s.param];
    Collective c;
    c.adam = &s;
    c.bf16_param = p.is_embedding();
    c.local_grad = (c.bf16_param ? params_.embedding_grads : params_.grads) + p.offset;
    c.whole = c.bf16_param ? static_cast<void*>(params_.embeddings + p.offset) : static_cast<void*>(params_.master + p.offset);
    c.count = size_t(p.numel);
    c.share = size_t(s.slice_elems());
    c.complete_after = gradient_complete_after(p, num_blocks_of(params_.list));
    c.name = p.name;
    if (c.bf16_param) {  // state in the param's dtype, as the reference
      c.state_m = memory.alloc<bf16>("Adam m of " + p.name, c.share);
      c.state_v = memory.alloc<bf16>("Adam v of " + p.name, c.share);
    } else {
      c.state_m = memory.alloc<float>("Adam m of " + p.name, c.share);
      c.state_v = memory.alloc<float>("Adam v of " + p.name, c.share);
    }
    add_collective(c, memory, p.name);
  }

  void add_muon(const MuonGroup& g, const MuonChunk& chunk, DeviceMemory& memory) {
    const Param& first = params_.list[chunk.owner_param[0]];
    Collective c;
    c.group = &g;
    c.chunk = &chunk;
    c.share = size_t(g.matrix_elems());
    c.name = first.name + " chunk";
    c.complete_after = std::numeric_limits<int>::max();
    for (size_t r = 0; r < chunk.owner_param.size(); ++r) {
      const int param = chunk.owner_param[r];
      if (param < 0) continue;
      // The reduce-scatter and all-gather treat the chunk as one run of storage: rank r's slice.
      if (params_.list[param].offset != first.offset + r * c.share)
        throw std::logic_error("Muon chunk of " + first.name + ": " + params_.list[param].name +
                               " is not slice " + std::to_string(r) + " of the chunk's storage");
      c.count += c.share;
      c.complete_after = std::min(c.complete_after, gradient_complete_after(params_.list[param], 0));
    }
    c.local_grad = params_.grads + first.offset;
    c.whole = params_.master + first.offset;
    const int mine = chunk.owner_param[comm_.rank()];
    if (mine >= 0)
      c.state_m = memory.alloc<float>((rekls_ ? "REKLS state of " : "Muon momentum of ") + params_.list[mine].name,
                                      matrix_state_elems(c));
    add_collective(c, memory, first.name + " and its chunk");
  }

  // [rows, cols] of one matrix of group g (qkv_w [3, d, d] holds three).
  static std::pair<int, int> matrix_shape(const MuonGroup& g) {
    return {int(g.shape[g.shape.size() - 2]), int(g.shape.back())};
  }
  std::vector<std::pair<int, int>> matrix_shapes() const {
    std::vector<std::pair<int, int>> shapes;
    for (const MuonGroup& g : plan_.muon) shapes.push_back(matrix_shape(g));
    return shapes;
  }
  // The optimizer state of the owned matrices of a chunk: Muon's momentum, or REKLS's factors,
  // eigenbases and moments (ReklsBuffers) of each matrix.
  size_t matrix_state_elems(const Collective& c) const {
    if (!rekls_) return c.share;
    const auto [rows, cols] = matrix_shape(*c.group);
    return c.share / (size_t(rows) * cols) * ReklsBuffers::elems(rows, cols);
  }

  // One Newton-Schulz matrix [rows, cols] of a group: qkv_w [3, d, d] holds three.
  static int64_t newton_schulz_elems(const MuonGroup& g) {
    return g.shape[g.shape.size() - 2] * g.shape.back();
  }
  // The Newton-Schulz matrices this rank orthogonalises in group g.
  int muon_batch(const MuonGroup& g) const {
    int mine = 0;
    for (const MuonChunk& c : g.chunks) mine += c.owner_param[comm_.rank()] >= 0;
    return mine * int(g.matrix_elems() / newton_schulz_elems(g));
  }
  int largest_muon_batch() const {
    int largest = 0;
    for (const MuonGroup& g : plan_.muon) largest = std::max(largest, muon_batch(g));
    return largest;
  }
  size_t largest_muon_batch_elems() const {
    size_t largest = 0;
    for (const MuonGroup& g : plan_.muon) largest = std::max(largest, size_t(muon_batch(g)) * newton_schulz_elems(g));
    return largest;
  }
  size_t group_index(const Collective& c) const { return size_t(c.group - plan_.muon.data()); }
  std::string update_name(const Collective& c) const {
    return c.adam ? c.name : "Muon group of " + params_.list[c.group->params[0]].name;
  }

  // The rank's summed share lands in place, at send + rank * share.
  void reduce(Collective& c, cudaStream_t stream) {
    float* send = c.local_grad;
    if (c.padded) {
      send = c.padded;
      CUDA_CHECK(cudaMemsetAsync(send, 0, comm_.world_size() * c.share * sizeof(float), stream));
      CUDA_CHECK(cudaMemcpyAsync(send, c.local_grad, c.count * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    }
    c.grad = send + comm_.rank() * c.share;
    if (c.group && injected_fault() == Fault::local_matrix_gradient) return;  // the oracle's bug: no SUM
    reduce_scatter_grads(comm_, grad_comm_, send, c.grad, c.share, traffic_, stream);
  }

  // Every matrix of group `g` that this rank owns (one per chunk, at most), in one batched update.
  void update_muon_group(size_t g, int step, float grad_scale, cudaStream_t stream) {
    const MuonGroup& group = plan_.muon[g];
    const auto [rows, cols] = matrix_shape(group);
    const size_t n = size_t(newton_schulz_elems(group));
    const size_t state_elems = rekls_ ? ReklsBuffers::elems(rows, cols) : n;  // each matrix's
    std::vector<MuonMatrix> muon;
    std::vector<ReklsMatrix> rekls;
    for (size_t m : group_members_[g]) {
      const Collective& c = collectives_[m];
      if (!c.state_m) continue;  // no matrix of this chunk on this rank
      float* p = params_.master + params_.list[c.chunk->owner_param[comm_.rank()]].offset;
      for (size_t k = 0; k < c.share / n; ++k) {
        float* state = static_cast<float*>(c.state_m) + k * state_elems;
        if (rekls_) rekls.push_back({p + k * n, c.grad + k * n, state});
        else muon.push_back({p + k * n, c.grad + k * n, state});
      }
    }
    if (rekls_) {
      const ReklsSettings settings{float(h_.rekls_beta1), float(h_.rekls_beta2), float(h_.rekls_shampoo_beta),
                                   float(h_.rekls_eps), float(h_.rekls_weight_decay), h_.rekls_eigenbasis_every};
      const ReklsStep s{float(h_.rekls_lr * schedule_.lr_factor(step)), adam_steps_, grad_scale};
      rekls_->update(rekls, rows, cols, settings, s, matmul_, stream);
      return;
    }
    MuonStep s{float(h_.muon_lr * schedule_.lr_factor(step)), float(schedule_.muon_momentum(step)), grad_scale};
    (batched_muon_ ? muon_update : muon_update_each)(muon, rows, cols, s, muon_workspace_, matmul_, stream);
  }

  void adam_update_share(const Collective& c, int step, float grad_scale, cudaStream_t stream) {
    const int r = comm_.rank(), W = comm_.world_size();
    const int owner = injected_fault() == Fault::wrong_shard_offset ? (r + 1) % W : r;  // the oracle's bug
    // Rows of this rank's share that the parameter holds (the owner's, so that the bug stays in bounds).
    const int64_t valid = std::min(c.adam->valid_rows(r), c.adam->valid_rows(owner)) * c.adam->row_elems;
    if (valid <= 0) return;
    const ParamKind kind = params_.list[c.adam->param].kind;
    AdamStep s{float(h_.adam_lr * adam_lr_multiplier(h_, kind) * schedule_.lr_factor(step)), float(h_.adam_beta1),
               float(h_.adam_beta2), float(h_.adam_eps), adam_steps_, grad_scale};
    if (c.bf16_param)
      adam_update(static_cast<bf16*>(c.whole) + owner * c.share, c.grad, static_cast<bf16*>(c.state_m),
                  static_cast<bf16*>(c.state_v), valid, s, stream);
    else
      adam_update(static_cast<float*>(c.whole) + owner * c.share, c.grad, static_cast<float*>(c.state_m),
                  static_cast<float*>(c.state_v), valid, s, stream);
  }

  void gather(const Collective& c, cudaStream_t stream) {
    if (c.bf16_param) gather_as<bf16>(c, DeviceDType::bf16, stream);
    else gather_as<float>(c, DeviceDType::f32, stream);
  }

  // Every rank's share back into the whole parameter: in place, or through the padded scratch.
  template <typename T>
  void gather_as(const Collective& c, DeviceDType dtype, cudaStream_t stream) {
    T* whole = static_cast<T*>(c.whole);
    const size_t first = comm_.rank() * c.share;
    if (!c.padded) {
      comm_.all_gather(whole + first, whole, c.share, dtype, stream);
      return;
    }
    T* gathered = reinterpret_cast<T*>(c.padded);
    const size_t own_valid = first < c.count ? std::min(c.share, c.count - first) : 0;
    CUDA_CHECK(cudaMemcpyAsync(gathered + first, whole + first, own_valid * sizeof(T), cudaMemcpyDeviceToDevice, stream));
    comm_.all_gather(gathered + first, gathered, c.share, dtype, stream);
    CUDA_CHECK(cudaMemcpyAsync(whole, gathered, c.count * sizeof(T), cudaMemcpyDeviceToDevice, stream));
  }

  const Hyperparameters& h_;
  Schedule schedule_;
  const ParameterStore& params_;
  DeviceCommunicator& comm_;
  GradComm grad_comm_;
  ShardPlan plan_;
  MuonWorkspace muon_workspace_;
  std::unique_ptr<Rekls> rekls_;  // with --matrix-optimizer rekls: the hidden matrices' optimizer
  bool batched_muon_ = h_.muon == "batched";
  std::vector<std::vector<size_t>> group_members_;  // [Muon group] its collectives, in launch order
  Matmul matmul_;
  std::vector<Collective> collectives_;  // Adam parameters, then Muon chunks, in plan order
  std::vector<size_t> launch_order_;     // into collectives_: by completion point (the head's first)
  size_t launched_ = 0;                  // reductions of this step issued, in launch order
  bool step_begun_ = false;
  int local_count_ = -1;                 // this rank's micro-sequences per step (-1: no step yet)
  float grad_scale_ = 0;                 // 1 / M
  bf16* traffic_ = nullptr;              // [2 * W * largest share] bf16 gradient traffic (one reduction at a time)
  cudaStream_t comm_stream_ = nullptr;
  cudaEvent_t backward_point_ = nullptr, gathered_ = nullptr;
  int64_t adam_steps_ = 0;
  Timeline* timeline_ = nullptr;
};

// Whether the ranks agree on a value (at most 40 bits, so that W of them sum exactly in a double),
// decided alike on every rank: the value's SUM all-reduce equals W times the own value on every
// rank only when all are equal, and each rank's verdict is summed too. A rank that threw alone
// would leave the others waiting in a collective.
struct RankVote {
  bool stop;          // some rank differs: every rank stops
  bool mine_differs;  // this rank's value is off the mean
};
inline RankVote vote_across_ranks(DeviceCommunicator& comm, double value) {
  const bool differs = comm.all_reduce_sum(value) != value * comm.world_size();
  return {comm.all_reduce_sum(differs ? 1 : 0) > 0, differs};
}
inline double low_40_bits(uint64_t v) { return double(v & ((uint64_t(1) << 40) - 1)); }

// Rank consistency (SPEC 4.3): every rank must hold the same parameters (their word sums agree);
// every rank names the same first parameter that differs.
inline void check_rank_consistency(const ParameterStore& params, DeviceCommunicator& comm,
                                   unsigned long long* scratch, cudaStream_t stream) {
  for (const Param& p : params.list) {
    const void* data = p.is_embedding() ? static_cast<const void*>(params.embeddings + p.offset)
                                        : static_cast<const void*>(params.master + p.offset);
    const size_t bytes = p.numel * (p.is_embedding() ? 2 : 4);
    const RankVote vote = vote_across_ranks(comm, low_40_bits(device_word_sum(data, bytes, scratch, stream)));
    if (vote.stop)
      throw std::runtime_error("ranks disagree on parameter " + p.name + " (rank " + std::to_string(comm.rank()) +
                               (vote.mine_differs ? " differs from the mean)" : " agrees with the mean)"));
  }
}

// Every rank must run with the same flags, or their collectives would stop matching.
inline void check_same_flags(const Hyperparameters& h, DeviceCommunicator& comm) {
  const std::string text = exact_flag_lines(h, [](const std::string&) { return true; });
  if (vote_across_ranks(comm, low_40_bits(std::hash<std::string>{}(text))).stop)
    throw std::runtime_error("the ranks were started with different flags (rank " + std::to_string(comm.rank()) +
                             "'s: " + text.substr(0, text.size() - 1) + ")");
}

// ------------------------------------------------------------------------------------------------
// Training state: everything the rest of a run depends on, for checkpoints and the warmup restore.
// ------------------------------------------------------------------------------------------------
struct RunCounters {
  int step = 0;           // optimizer steps done
  double train_ms = 0;    // timed training so far
  uint64_t seed = 0;      // the initialisation seed (logged again on resume)
};

constexpr const char* kEmbeddingsBlob = "embeddings";  // every embedding parameter, bf16
constexpr const char* kMastersBlob = "masters";        // every other parameter's fp32 master

inline std::vector<StateBuffer> training_state(const ParameterStore& params, Optimizers& optimizers,
                                               RunCounters& counters) {
  std::vector<StateBuffer> state{{kEmbeddingsBlob, params.embeddings, params.embedding_count * sizeof(bf16)},
                                 {kMastersBlob, params.master, params.master_count * sizeof(float)}};
  for (const StateBuffer& b : optimizers.state_buffers()) state.push_back(b);
  state.push_back({"train_ms", &counters.train_ms, sizeof counters.train_ms});
  state.push_back({"seed", &counters.seed, sizeof counters.seed});
  return state;
}

inline DiLoCoSettings diloco_settings(const Hyperparameters& h) {
  DiLoCoSettings s;
  s.groups = h.diloco_groups;
  s.fragments = h.diloco_fragments;
  s.sync_every = h.diloco_sync_every;
  s.delay = h.diloco_sync_delay;
  s.outer_lr = h.diloco_outer_lr;
  s.outer_momentum = h.diloco_outer_momentum;
  s.alpha = h.diloco_alpha;
  s.bf16_exchange = h.diloco_comm == "bf16";
  s.host_copies = h.diloco_host_copies;
  return s;
}

// DiLoCo's fragments: blocks i * F / num_layers, the token and value embeddings with fragment 0
// (the input side), lm_head and the scalars with fragment F - 1; each in parameter order.
inline std::vector<std::vector<ParamStorage>> diloco_fragments(const ParameterStore& s, int fragments) {
  const int num_layers = num_blocks_of(s.list);
  std::vector<std::vector<ParamStorage>> list(static_cast<size_t>(fragments));
  for (const Param& p : s.list) {
    const int f = p.is_embedding() ? 0 : p.layer < 0 ? fragments - 1 : p.layer * fragments / num_layers;
    void* data = p.is_embedding() ? static_cast<void*>(s.embeddings + p.offset) : static_cast<void*>(s.master + p.offset);
    list[size_t(f)].push_back({data, p.is_embedding(), size_t(p.numel)});
  }
  return list;
}

constexpr const char* kRunFlagsBlob = "run flags";  // resume_flags of the run that wrote the checkpoint

// Where each parameter lies in the two parameter blobs, one "<name> <blob> <dtype> <offset> <count>"
// line each (offset and count in elements), so that a checkpoint is read parameter by parameter
// without this file: tools/compare_checkpoints.py compares the ranks of an NCCL run with W = 1.
constexpr const char* kParameterLayoutBlob = "parameter layout";
inline std::string parameter_layout(const std::vector<Param>& list) {
  std::string lines;
  for (const Param& p : list) {
    const std::string blob = p.is_embedding() ? std::string(kEmbeddingsBlob) + " bf16" : std::string(kMastersBlob) + " fp32";
    lines += p.name + " " + blob + " " + std::to_string(p.offset) + " " + std::to_string(p.numel) + "\n";
  }
  return lines;
}

inline Checkpoint capture_state(const std::vector<StateBuffer>& state, int step) {
  CUDA_CHECK(cudaDeviceSynchronize());
  Checkpoint c;
  c.step = step;
  for (const StateBuffer& b : state) {
    std::vector<uint8_t> bytes(b.bytes);
    CUDA_CHECK(cudaMemcpy(bytes.data(), b.data, b.bytes, cudaMemcpyDefault));
    c.blobs.emplace_back(b.name, std::move(bytes));
  }
  return c;
}

// path names the checkpoint in errors ("" for the in-memory warmup snapshot).
inline void restore_state(const Checkpoint& c, const std::string& path, const std::vector<StateBuffer>& state,
                          const ParameterStore& params) {
  for (const StateBuffer& b : state) {
    const std::vector<uint8_t>& bytes = c.blob(b.name, path);
    if (bytes.size() != b.bytes)
      throw CheckpointError(path + ": '" + b.name + "' holds " + std::to_string(bytes.size()) + " bytes, this model needs " +
                            std::to_string(b.bytes) + " (a checkpoint of another configuration?)");
    CUDA_CHECK(cudaMemcpy(b.data, bytes.data(), b.bytes, cudaMemcpyDefault));
  }
  refresh_weight_copies(params, 0);
  CUDA_CHECK(cudaDeviceSynchronize());
}

// ------------------------------------------------------------------------------------------------
// The run: warmup, then steps with validation, logging and checkpoints (SPEC 1.8, 1.11, Part 2).
// ------------------------------------------------------------------------------------------------
// Copies one micro-sequence's tokens [T + 1] to the device: inputs [0, T), targets [1, T + 1).
inline void upload_micro_sequence(Activations& acts, const uint16_t* tokens, int T, cudaStream_t stream) {
  CUDA_CHECK(cudaMemcpyAsync(acts.inputs, tokens, T * sizeof(uint16_t), cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(acts.targets, tokens + 1, T * sizeof(uint16_t), cudaMemcpyHostToDevice, stream));
}

// The token losses summed over the micro-sequences since the last call: waits for the stream,
// so after a training step it also marks the end of the step's GPU work.
inline double take_loss_total(const Activations& acts, cudaStream_t stream) {
  double total = 0;
  CUDA_CHECK(cudaMemcpyAsync(&total, acts.loss_total, sizeof total, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaMemsetAsync(acts.loss_total, 0, sizeof(double), stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return total;
}

// The mean token loss over all ranks: the loss sums and the token counts are both SUMMED (a rank
// may have no micro-sequence when W > M).
inline double mean_over_ranks(DeviceCommunicator& comm, double loss_sum, double tokens) {
  const double all_losses = comm.all_reduce_sum(loss_sum);  // in this order on every rank
  return all_losses / comm.all_reduce_sum(tokens);
}

// Mean validation token loss with the window of the current step: each rank sums the token losses
// and counts of its sequences; both sums are SUM-reduced, the mean is their ratio (SPEC 4.2).
inline double validate(GPT& model, Activations& eval, const ValidationPlan& val, int window_blocks,
                       DeviceCommunicator& comm, cudaStream_t stream) {
  double tokens = 0;
  const int T = int(val.seq_len());
  for (int64_t s : val.sequences_of_rank(comm.rank(), comm.world_size())) {
    upload_micro_sequence(eval, val.sequence(s), T, stream);
    MicroSequencePlan plan(val.sequence(s), T, model.config(), window_blocks, eval.uploads, stream);
    model.step(eval, T, plan, /*backward=*/false, /*fp8_head=*/false, stream);
    tokens += T;
  }
  return mean_over_ranks(comm, take_loss_total(eval, stream), tokens);
}

// Forward+backward of the rank's micro-sequences, gradients SUMMED into the parameter gradients
// (zeroed first), token losses summed into acts.loss_total.
// The last micro-sequence's backward tells last_backward_done where gradients are complete.
inline void accumulate_gradients(GPT& model, Activations& acts, const RankBatch& batch, int window_blocks,
                                 bool fp8_head, cudaStream_t stream, const GPT::GradientsDone& last_backward_done = {}) {
  const int T = int(batch.micro_len);
  model.params.zero_grads(stream);
  for (int j = 0; j < batch.num_micro; ++j) {
    const uint16_t* tokens = batch.tokens + size_t(j) * (T + 1);
    upload_micro_sequence(acts, tokens, T, stream);
    MicroSequencePlan plan(tokens, T, model.config(), window_blocks, acts.uploads, stream);
    model.step(acts, T, plan, /*backward=*/true, fp8_head, stream,
               j + 1 == batch.num_micro ? last_backward_done : GPT::GradientsDone{});
  }
}

// One optimizer step (SPEC 1.11): gradients, then both optimizers. Returns this rank's summed
// token losses, read after the step's GPU work is done.
inline double train_step(GPT& model, Activations& acts, Optimizers& optimizers, const RankBatch& batch, int step,
                         const Schedule& schedule, bool fp8_head, cudaStream_t stream) {
  optimizers.begin_step(batch.num_micro);
  accumulate_gradients(model, acts, batch, schedule.window_blocks(step), fp8_head, stream,
                       [&](int layer) { optimizers.gradients_done(layer, stream); });
  optimizers.step(step, stream);
  return take_loss_total(acts, stream);
}

// The batch plan of a data flag's glob (its constructor throws only when the glob matches nothing).
// A glob left at the flag's default says so: --train-files alone leaves --val-files at FineWeb's.
inline BatchPlan data_plan(const std::string& flag, const std::string& pattern, int64_t micro_len, int micro_count) {
  try {
    return BatchPlan(pattern, micro_len, micro_count, kTokenizerVocab);
  } catch (const DataError& e) {
    const Hyperparameters defaults;
    if (pattern != (flag == "val-files" ? defaults.val_files : defaults.train_files)) throw;
    throw DataError(std::string(e.what()) + ", the default of --" + flag +
                    (flag == "val-files" ? ", which --train-files does not change: pass --val-files "
                                           "'<glob of your validation shards>'"
                                         : ": fetch FineWeb (python3 data/download_fineweb.py 8) or pass --train-files "
                                           "'<glob of your training shards>'"));
  }
}

// Before any GPU work, from every shard of both globs: headers, sizes and every token id; enough
// training windows for the run and its warmup, and a first validation shard that holds the
// validation tokens.
inline void check_data(const Hyperparameters& h) {
  const BatchPlan train = data_plan("train-files", h.train_files, h.seq_len, h.micro_batches);
  const int64_t windows = train.windows_available();
  const bool warmup_longer = h.warmup_steps > h.num_iterations;
  const int64_t needed = warmup_longer ? h.warmup_steps : h.num_iterations;
  if (windows < needed)
    throw DataError("the files matching '" + h.train_files + "' give " + std::to_string(windows) + " steps of " +
                    std::to_string(h.micro_batches) + " x " + std::to_string(h.seq_len) + " tokens; the run needs " +
                    std::to_string(needed) +
                    (warmup_longer ? " for its --warmup-steps (warmup trains on the first steps' batches): lower "
                                     "--warmup-steps"
                                   : " (fetch more shards, or shorten --num-iterations)"));
  const BatchPlan val = data_plan("val-files", h.val_files, h.val_seq_len, int(h.val_tokens / h.val_seq_len));
  val.windows_available();
  train.scan_all_tokens();
  val.scan_all_tokens();
}

// A folder the run will write into: created, and a file written and removed, now.
inline void check_writable(const std::string& dir, const std::string& what) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  const std::string probe = dir + "/.write_probe";
  if (error || !std::ofstream(probe) || !std::filesystem::remove(probe, error))
    throw RunFilesError(dir + ": cannot write " + what + " there (" + (error ? error.message() : std::strerror(errno)) +
                        ")");
}

inline PrefetchLoader training_loader(const Hyperparameters& h, int start_step, int rank, int world_size) {
  BatchPlan plan(h.train_files, h.seq_len, h.micro_batches, kTokenizerVocab);
  for (int s = 0; s < start_step; ++s) plan.next();  // resume: the windows already trained on
  return PrefetchLoader(std::move(plan), rank, world_size, /*depth=*/2,
                        [](size_t bytes) {
                          void* p = nullptr;
                          return cudaHostAlloc(&p, bytes, cudaHostAllocDefault) == cudaSuccess ? p : nullptr;
                        },
                        [](void* p) { cudaFreeHost(p); });
}

inline uint64_t fresh_seed() {
  std::random_device entropy;
  return (uint64_t(entropy()) << 32 | entropy()) | 1;  // never 0, which means "pick one"
}

// Model FLOPs per token of one training step (6 N for the matmuls; attention is left out, so
// MFU is a lower bound), for the console's MFU.
inline double training_flops_per_token(const std::vector<Param>& params) {
  double matmul_params = 0;
  for (const Param& p : params)
    if (!p.is_embedding() && p.kind != ParamKind::scalars) matmul_params += double(p.numel);
  return 6 * matmul_params;
}

inline void log_parameters(RunLog& log, const Hyperparameters& h, const std::vector<Param>& params) {
  int64_t total = 0, embeddings = 0;
  for (const Param& p : params) {
    std::string shape;
    for (int64_t d : p.shape) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
    double lr_mul = is_muon_param(p.kind) ? 1.0 : adam_lr_multiplier(h, p.kind);
    char line[256];
    std::snprintf(line, sizeof line, "%s: [%s] %s wd_mul=0.0 lr_mul=%g", p.name.c_str(), shape.c_str(),
                  p.is_embedding() ? "bfloat16" : "float32", lr_mul);
    log.line(line, /*console=*/false);
    total += p.numel;
    embeddings += p.is_embedding() ? p.numel : 0;
  }
  log.line("parameters: " + std::to_string(total) + " total, " + std::to_string(embeddings) + " embedding, " +
           std::to_string(total - embeddings) + " non-embedding");
}

constexpr double kH100DenseBf16Flops = 989e12;  // H100 SXM dense bf16 tensor-core peak (datasheet)

inline std::string console_step_line(const std::string& log_line, double loss, double step_ms, int tokens_per_step,
                                     double flops_per_token, int steps_left) {
  char extra[160];
  double tokens_per_s = tokens_per_step / (step_ms / 1000);
  std::snprintf(extra, sizeof extra, " loss:%.4f tok/s:%.0f mfu:%.1f%% eta:%.1fmin", loss, tokens_per_s,
                100 * tokens_per_s * flops_per_token / kH100DenseBf16Flops, steps_left * step_ms / 60000);
  return log_line + extra;
}

// This process's communicator: alone, or rank g.rank of an NCCL world whose id came over TCP from
// rank 0 (a world of one with nccl_single_rank).
inline std::unique_ptr<DeviceCommunicator> connect_ranks(const ProcessGroupEnv& g, bool nccl_single_rank) {
  ncclUniqueId id{};
  if (g.world_size == 1) {
    if (!nccl_single_rank) return std::make_unique<SingleRankCommunicator>();
    NCCL_CHECK(ncclGetUniqueId(&id));
    return std::make_unique<NcclCommunicator>(0, 1, id);
  }
  if (g.rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
  UniqueIdBytes bytes;
  static_assert(sizeof id == sizeof bytes, "NCCL's unique id is 128 bytes");
  std::memcpy(bytes.data(), &id, sizeof id);
  broadcast_id_over_tcp(g, bytes, std::chrono::seconds(300));
  std::memcpy(&id, bytes.data(), sizeof id);
  return std::make_unique<NcclCommunicator>(g.rank, g.world_size, id);
}

// With W > 1 every rank keeps its own optimizer shards: rank r's checkpoints go to <dir>/rank<r>.
inline std::string rank_checkpoint_dir(const Hyperparameters& h, const ProcessGroupEnv& g) {
  return g.world_size == 1 ? h.checkpoint_dir : h.checkpoint_dir + "/rank" + std::to_string(g.rank);
}

// Before the GPU: the folders this rank writes into (its checkpoints; the run log on rank 0, the
// timeline on every rank that writes one).
inline void check_output_folders(const Hyperparameters& h, const ProcessGroupEnv& g) {
  check_writable(rank_checkpoint_dir(h, g), "checkpoints");
  if (g.rank == 0 || h.timeline_step > 0) check_writable(h.log_dir, "the run's logs");
}

// Throws for a checkpoint this run cannot continue; returns how the settings differ ("" if not).
inline std::string settings_differences(const Hyperparameters& h, int world_size, const Checkpoint& c,
                                        const std::string& path) {
  if (std::filesystem::path(path).filename() != std::filesystem::path(checkpoint_path("", c.step)).filename())
    throw CheckpointError(path + ": holds step " + std::to_string(c.step) + ", not the step of its name");
  if (c.step > h.num_iterations)
    throw CheckpointError(path + ": step " + std::to_string(c.step) + " is past --num-iterations " +
                          std::to_string(h.num_iterations));
  const std::vector<uint8_t>& saved = c.blob(kRunFlagsBlob, path);
  return resume_flag_differences(std::string(saved.begin(), saved.end()), resume_flags(h, world_size));
}

// The checkpoint --resume continues from: this rank's newest, read whole and verified (its hashes,
// its step, its settings) before the GPU is touched.
struct ResumePoint {
  std::string path;
  Checkpoint checkpoint;
  std::string differences;  // the settings that differ from the checkpoint's, with --resume-other-settings
};

inline std::optional<ResumePoint> checkpoint_to_resume(const Hyperparameters& h, const ProcessGroupEnv& g) {
  if (!h.resume) return std::nullopt;
  try {
    ResumePoint r;
    const std::string dir = rank_checkpoint_dir(h, g);
    r.path = newest_checkpoint(dir);
    if (r.path.empty()) throw CheckpointError("no checkpoint in " + dir);
    r.checkpoint = read_checkpoint(r.path);
    r.differences = settings_differences(h, g.world_size, r.checkpoint, r.path);
    if (!r.differences.empty() && !h.resume_other_settings)
      throw CheckpointError(r.path + ": written by a run with other settings: " + r.differences +
                            " (--resume-other-settings resumes anyway)");
    return r;
  } catch (const std::exception& e) {  // filesystem errors too
    throw CheckpointError(std::string("--resume: ") + e.what());
  }
}

// The watchdog of a run (null with --stall-timeout 0): a rank stuck in one phase for the timeout
// (a peer died or diverged, so a collective never ends) exits, and the launcher stops the others.
// It runs from before the rendezvous, which it also covers, to after the communicator's teardown.
inline std::unique_ptr<ProgressWatchdog> start_watchdog(const Hyperparameters& h, int rank) {
  if (h.stall_timeout == 0) return nullptr;
  auto watchdog = std::make_unique<ProgressWatchdog>(std::chrono::seconds(h.stall_timeout),
                                                     [rank](const std::string& m) { end_stalled_rank(rank, m); });
  watchdog->beat("connecting the ranks (rendezvous, NCCL init)");
  return watchdog;
}

// ------------------------------------------------------------------------------------------------
// The start-up self-check (kernels/self_check.cuh): every fast path against its reference on this
// GPU before the warmup; a path that fails on any rank is replaced by its reference on every rank
// (--self-check fallback) or stops the run (strict). The lines go to the console and rank 0's log.
// ------------------------------------------------------------------------------------------------
struct SelfCheckFailed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The paths the flags select.
inline KernelPaths paths_of(const Hyperparameters& h) {
  KernelPaths p;
  p.flash_attention = h.attention == "flash";
  p.fp8_head = !h.bf16_head;
  p.fused_e5m2_gradient = h.fp8_gradient == "fused";
  p.batched_muon = h.muon == "batched";
  p.fused_residual_add = h.residual_add == "fused";
  return p;
}

// The self-check's problems at the model's width, heads and vocabulary.
inline SelfCheckShape self_check_shape(const GPTConfig& c) { return {c.model_dim, c.num_heads, c.vocab_size}; }

// The attention problems' documents: the validation data's first tokens (real documents) where
// there are enough, else about six documents of random lengths, which cross block edges.
inline std::vector<uint16_t> self_check_layout(const ValidationPlan* val, int T, uint16_t bos) {
  if (val && val->num_sequences() * val->seq_len() >= T)
    return std::vector<uint16_t>(val->sequence(0), val->sequence(0) + T);
  std::mt19937_64 rng(7);
  std::vector<uint16_t> tokens(T);
  for (int t = 0; t < T; ++t) tokens[t] = t == 0 || rng() % (T / 6) == 0 ? bos : uint16_t(rng() % bos);
  return tokens;
}

struct SelfCheckOutcome {
  KernelPaths paths;                // what the run uses
  std::vector<std::string> lines;   // every result, the summary, a line per fallback
  bool failed_here = false;         // a check of this rank failed
  std::string failed_paths;         // the paths that failed on some rank, by name ("": none)

  // The lines as the log's header holds them (after the environment).
  std::string report() const {
    std::string text;
    for (const std::string& l : lines) text += l + "\n";
    return text;
  }
  // Under --self-check strict a failure stops the run, once its lines are out.
  void stop_if_strict(const Hyperparameters& h) const {
    if (!failed_paths.empty() && h.self_check == "strict")
      throw SelfCheckFailed("self-check failed: " + failed_paths + " (the self-check lines say by how much; " +
                            "--self-check fallback trains on the references instead)");
  }
};

// Runs the self-check on this rank's GPU and votes: a path fails when it fails on any rank (comm
// null: this process alone), and is replaced by its reference.
inline SelfCheckOutcome self_check_paths(const Hyperparameters& h, const SelfCheckShape& shape, uint16_t bos,
                                         const ValidationPlan* val, DeviceCommunicator* comm) {
  SelfCheckOutcome outcome{paths_of(h), {}, false, ""};
  if (h.self_check == "off") return outcome;
  const auto start = std::chrono::steady_clock::now();
  const std::vector<uint16_t> layout = self_check_layout(val, shape.attention_tokens, bos);
  Matmul matmul;
  const std::vector<SelfCheckResult> results = run_self_check(shape, outcome.paths, layout.data(), bos, matmul, 0);
  CUDA_CHECK(cudaDeviceSynchronize());
  int failed_checks = 0;
  for (const SelfCheckResult& r : results) {
    outcome.lines.push_back(r.line());
    failed_checks += !r.passed();
  }
  outcome.failed_here = failed_checks > 0;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  char summary[128];
  std::snprintf(summary, sizeof summary, "self-check: %zu checks, %d failed, %.1f s", results.size(), failed_checks,
                seconds);
  outcome.lines.push_back(summary);
  for (const FastPath& path : fast_paths()) {
    bool failed_here = false;
    for (const SelfCheckResult& r : results) failed_here |= r.path == path.member && !r.passed();
    const bool failed = comm ? comm->all_reduce_sum(failed_here ? 1.0 : 0.0) > 0 : failed_here;
    if (!failed) continue;
    outcome.failed_paths += (outcome.failed_paths.empty() ? "" : ", ") + std::string(path.name);
    outcome.paths.*path.member = false;
    if (h.self_check == "fallback")
      outcome.lines.push_back(std::string("self-check fallback: ") + path.name + " failed " +
                              (failed_here ? "here" : "on another rank") + "; this run uses its reference (" +
                              path.reference_flag + "): slower, and not a record run");
  }
  return outcome;
}

// --self-check-only: the self-check on this process's GPU, printed; 0 when every check passed.
inline int self_check_alone(Hyperparameters h) {
  h.self_check = "strict";
  const GPTConfig c;
  const SelfCheckOutcome outcome = self_check_paths(h, self_check_shape(c), c.bos_token, nullptr, nullptr);
  std::printf("%s", outcome.report().c_str());
  outcome.stop_if_strict(h);
  return 0;
}

// One training run of this process: the model, its optimizers and data, and rank 0's log.
class TrainingRun {
 public:
  TrainingRun(const Hyperparameters& h, const ProcessGroupEnv& g)
      : h_(h), schedule_(schedule_of(h)), watchdog_(start_watchdog(h, g.rank)), comm_(connect_ranks(g, h.nccl_single_rank)),
        groups_(*comm_, h.diloco_groups), model_(config_, memory_),
        optimizers_(h, model_.params, group(), memory_),
        train_(config_, h.seq_len, /*backward=*/true, memory_, /*fp8_head=*/!h.bf16_head),
        eval_(config_, h.val_seq_len, false, memory_),
        val_(h.val_files, h.val_tokens, h.val_seq_len, kTokenizerVocab),
        checksum_(memory_.alloc<unsigned long long>("parameter checksum", 1)),
        state_(training_state(model_.params, optimizers_, counters_)), checkpoint_dir_(rank_checkpoint_dir(h, g)) {
    beat("initialisation");
    check_same_flags(h, *comm_);
    // Every rank initialises from rank 0's seed (52 bits: exact through the double all-reduce).
    uint64_t seed = comm_->rank() == 0 ? (h.seed ? h.seed : fresh_seed()) & ((uint64_t(1) << 52) - 1) : 0;
    counters_.seed = uint64_t(comm_->all_reduce_sum(double(seed)));
    initialize_parameters(config_, model_.params, counters_.seed);
    if (groups_.group) {  // every group starts from the same parameters: the global copies
      diloco_ = std::make_unique<DiLoCo>(diloco_settings(h), diloco_fragments(model_.params, h.diloco_fragments),
                                         *groups_.group, *groups_.across);
      diloco_->take_global_copies(0);
      for (const DiLoCo::Buffer& b : diloco_->state_buffers()) state_.push_back({b.name, b.data, b.bytes});
    }
    beat("self-check");
    const SelfCheckOutcome self_check =
        self_check_paths(h, self_check_shape(config_), config_.bos_token, &val_, comm_.get());
    if (comm_->rank() == 0 || self_check.failed_here) std::printf("%s", self_check.report().c_str());
    for (const std::string& line : self_check.lines)
      if (comm_->rank() == 0 && line.rfind("self-check fallback:", 0) == 0)
        std::fprintf(stderr, "WARNING: %s\n", line.c_str());
    self_check.stop_if_strict(h);
    paths_ = self_check.paths;
    model_.set_paths(paths_);
    optimizers_.set_batched_muon(paths_.batched_muon);
    if (comm_->rank() == 0) {
      log_ = std::make_unique<RunLog>(h.log_dir, new_run_id());
      log_->header(trainer_source(), environment_report() + self_check.report());
      log_parameters(*log_, h, model_.params.list);
      std::printf("run log: %s (%d rank%s%s, %s)\n", log_->path().c_str(), comm_->world_size(),
                  comm_->world_size() > 1 ? "s" : "",
                  diloco_ ? (" in " + std::to_string(h.diloco_groups) + " DiLoCo groups of " +
                             std::to_string(group().world_size())).c_str()
                          : "",
                  g.launcher.c_str());
    }
  }

  TrainingRun(const TrainingRun&) = delete;
  TrainingRun& operator=(const TrainingRun&) = delete;

  int run(std::optional<ResumePoint> resume_point) {
    if (h_.warmup_steps > 0) warm_up(/*restore=*/!resume_point);  // before a resume too
    if (resume_point) resume(std::move(*resume_point));
    char seed_line[64];
    std::snprintf(seed_line, sizeof seed_line, "seed: %" PRIu64, counters_.seed);
    say(seed_line);
    PrefetchLoader loader = training_loader(h_, counters_.step, comm_->rank(), comm_->world_size());
    for (int step = counters_.step;; ++step) {
      const bool last = step == h_.num_iterations;
      const std::string at = "step " + std::to_string(step) + ": ";
      if (last && diloco_ && step > counters_.step) {  // one model at the end (a resume here has it already)
        beat(at + "final DiLoCo sync");
        for (const std::string& line : diloco_->finish(step, 0)) say(line);
      }
      if (last || step == 0 || (h_.val_every > 0 && step % h_.val_every == 0)) {
        beat(at + "validation");
        validate_and_log(step, /*groups_agree=*/last);
      }
      if (last || (h_.checkpoint_every > 0 && step > counters_.step && step % h_.checkpoint_every == 0)) {
        beat(at + "checkpoint");
        checkpoint(step);
      }
      if (last) break;
      beat(at + "training");
      train_and_log(step, next_batch(loader, step));
    }
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    say(peak_memory_line(memory_.allocated_bytes(), total_bytes - free_bytes));
    return 0;
  }

 private:
  // A data error mid-run (check_data read every shard at the start, but a shard can change or
  // become unreadable since) saves the state first, unless the step's checkpoint is written
  // already or nothing was trained since the start.
  const RankBatch& next_batch(PrefetchLoader& loader, int step) {
    try {
      return loader.next();
    } catch (const DataError& e) {
      if (step == counters_.step) throw;
      std::string saved = checkpoint_path(checkpoint_dir_, step);
      try {
        if (unconfirmed_step_ != step) checkpoint(step);
      } catch (const std::exception& failed) {
        saved = "no checkpoint (" + std::string(failed.what()) + ")";
      }
      throw DataError(std::string(e.what()) + "; the state of step " + std::to_string(step) + ": " + saved);
    }
  }

  void say(const std::string& line, bool console = true) {
    if (log_) log_->line(line, console);
  }
  void beat(const std::string& phase) {
    if (watchdog_) watchdog_->beat(phase);
  }

  // The warmup trains on real data, then the state before it comes back; a resumed run skips that
  // copy, since the checkpoint (already in host memory) replaces the whole state after.
  void warm_up(bool restore) {
    std::optional<Checkpoint> initial;
    if (restore) initial = capture_state(state_, 0);
    PrefetchLoader loader = training_loader(h_, 0, comm_->rank(), comm_->world_size());
    for (int i = 0; i < h_.warmup_steps; ++i) {
      beat("warmup step " + std::to_string(i));
      int step = std::min(i, h_.num_iterations - 1);
      train_step(model_, train_, optimizers_, loader.next(), step, schedule_, paths_.fp8_head, 0);
    }
    if (initial) restore_state(*initial, "", state_, model_.params);
  }

  // Each rank verified its own checkpoint before the GPU (a rank that could not stopped there, and
  // its launcher stops the others: run.sh at once, others at the rendezvous's deadline); ranks
  // whose newest checkpoints are of different steps stop together here.
  void resume(ResumePoint point) {
    beat("resume");
    const int step = point.checkpoint.step;
    if (vote_across_ranks(*comm_, step).stop)
      throw CheckpointError("--resume: the ranks' newest checkpoints are of different steps (rank " +
                            std::to_string(comm_->rank()) + " has step " + std::to_string(step) + ")");
    restore_state(point.checkpoint, point.path, state_, model_.params);
    if (diloco_) diloco_->resumed_at(step);
    counters_.step = step;
    last_checkpoint_ = point.path;
    say("resumed from " + point.path + " at step " + std::to_string(step) +
        (point.differences.empty() ? "" : ", with other settings: " + point.differences));
  }

  // The training settings a checkpoint records: the head the run really trains (a self-check
  // fallback to the bf16 head is another mathematics, so a resume must ask for it by its flag).
  std::string run_flags() const {
    Hyperparameters trained = h_;
    trained.bf16_head = !paths_.fp8_head;
    return resume_flags(trained, comm_->world_size());
  }

  // Groups train apart between syncs: their ranks agree within the group, and all of them after
  // the final DiLoCo sync. The validation loss is the mean over every rank's share of the
  // validation tokens, each scored by its group's model.
  void validate_and_log(int step, bool groups_agree) {
    check_rank_consistency(model_.params, groups_agree ? *comm_ : group(), checksum_, 0);
    double val_loss = validate(model_, eval_, val_, schedule_.window_blocks(step), *comm_, 0);
    say(validation_line(step, h_.num_iterations, val_loss, counters_.train_ms));
    if (!std::isfinite(val_loss))
      throw std::runtime_error("validation loss is " + std::to_string(val_loss) + " at step " + std::to_string(step) +
                               "; last good checkpoint: " + last_checkpoint_);
  }

  void write_timeline(const Timeline& timeline, int step) {
    model_.set_timeline(nullptr);
    optimizers_.set_timeline(nullptr);
    if (diloco_) diloco_->set_timeline(nullptr);
    const std::string path = h_.log_dir + "/timeline_rank" + std::to_string(comm_->rank()) + "_step" +
                             std::to_string(step) + ".json";
    std::filesystem::create_directories(h_.log_dir);
    timeline.write_chrome_trace(path, comm_->rank());
    std::printf("rank %d: the GPU schedule of step %d is in %s\n", comm_->rank(), step, path.c_str());
  }

  // The checkpoint of step s is good once the loss of the next step, computed from its
  // parameters, is finite: until then a NaN stop names the one before.
  void checkpoint(int step) {
    Checkpoint c = capture_state(state_, step);
    const std::string flags = run_flags(), layout = parameter_layout(model_.params.list);
    c.blobs.emplace_back(kRunFlagsBlob, std::vector<uint8_t>(flags.begin(), flags.end()));
    c.blobs.emplace_back(kParameterLayoutBlob, std::vector<uint8_t>(layout.begin(), layout.end()));
    write_checkpoint(checkpoint_dir_, c);
    unconfirmed_checkpoint_ = checkpoint_path(checkpoint_dir_, step);
    unconfirmed_step_ = step;
  }

  void train_and_log(int step, const RankBatch& batch) {
    std::unique_ptr<Timeline> timeline;
    if (step + 1 == h_.timeline_step) timeline = std::make_unique<Timeline>();
    model_.set_timeline(timeline.get());
    optimizers_.set_timeline(timeline.get());
    if (diloco_) diloco_->set_timeline(timeline.get());
    auto start = std::chrono::steady_clock::now();
    double loss_sum = train_step(model_, train_, optimizers_, batch, step, schedule_, paths_.fp8_head, 0);
    const std::string sync_line = diloco_ ? diloco_->after_step(step + 1, 0) : "";
    double step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (timeline) write_timeline(*timeline, step + 1);
    // the console's mean over ranks; a NaN anywhere stops all
    double loss = mean_over_ranks(*comm_, loss_sum, double(batch.num_micro) * batch.micro_len);
    counters_.train_ms += step_ms;
    if (!std::isfinite(loss))
      throw std::runtime_error("training loss is " + std::to_string(loss) + " at step " + std::to_string(step + 1) +
                               "; last good checkpoint: " + last_checkpoint_);
    if (unconfirmed_step_ == step) last_checkpoint_ = unconfirmed_checkpoint_;
    if (step == counters_.step) check_rank_consistency(model_.params, group(), checksum_, 0);  // after the first step
    std::string line = train_step_line(step + 1, h_.num_iterations, counters_.train_ms);
    say(line, /*console=*/false);
    if (!sync_line.empty()) say(sync_line);
    if (log_)
      std::printf("%s\n", console_step_line(line, loss, step_ms, h_.micro_batches * h_.seq_len,
                                             training_flops_per_token(model_.params.list), h_.num_iterations - step - 1)
                              .c_str());
  }

  const Hyperparameters& h_;
  const Schedule schedule_;
  const GPTConfig config_;
  std::unique_ptr<ProgressWatchdog> watchdog_;  // before comm_: covers the rendezvous and its teardown
  std::unique_ptr<DeviceCommunicator> comm_;
  ReplicaGroups groups_;  // DiLoCo's communicators (none with one group)
  DeviceCommunicator& group() const { return groups_.group ? *groups_.group : *comm_; }
  DeviceMemory memory_;
  GPT model_;
  Optimizers optimizers_;
  Activations train_, eval_;
  ValidationPlan val_;
  unsigned long long* checksum_;
  RunCounters counters_;
  std::vector<StateBuffer> state_;
  std::string checkpoint_dir_, last_checkpoint_ = "none", unconfirmed_checkpoint_;
  int unconfirmed_step_ = -1;
  KernelPaths paths_;            // after the self-check
  std::unique_ptr<DiLoCo> diloco_;  // with more than one group
  std::unique_ptr<RunLog> log_;  // rank 0 only
};

// Everything that can be checked without the GPU is checked first, so that bad input is named
// before minutes of initialisation (and on machines without a GPU).
int run_training(const Hyperparameters& h) {
  if (h.self_check_only) {  // no data, no ranks: this GPU's fast paths alone
    require_hopper_gpu(select_gpu(process_group_from_env().local_rank));
    return self_check_alone(h);
  }
  check_data(h);
  const ProcessGroupEnv g = process_group_from_env();
  const std::string diloco_problem = diloco_settings_problem(diloco_settings(h), g.world_size, GPTConfig().num_layers);
  if (!diloco_problem.empty()) throw FlagError(diloco_problem);
  check_output_folders(h, g);
  std::optional<ResumePoint> resume_point = checkpoint_to_resume(h, g);
  require_hopper_gpu(select_gpu(g.local_rank));
  return TrainingRun(h, g).run(std::move(resume_point));
}

// ------------------------------------------------------------------------------------------------
#ifndef TRAIN_GPT_NO_MAIN  // tests include this file for its host and device code
int main(int argc, char** argv) {
  auto fail = [](const std::exception& e, ExitStatus status) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return int(status);
  };
  try {
    Hyperparameters h;
    if (!parse_flags(argc, argv, h)) {
      std::printf("%s", usage(argv[0]).c_str());
      return 0;
    }
    return run_training(h);
  } catch (const FlagError& e) {
    return fail(e, kExitBadFlags);
  } catch (const DataError& e) {
    return fail(e, kExitBadData);
  } catch (const NoUsableGpu& e) {
    return fail(e, kExitNoUsableGpu);
  } catch (const RunFilesError& e) {
    return fail(e, kExitRunFiles);
  } catch (const SelfCheckFailed& e) {
    return fail(e, kExitSelfCheckFailed);
  } catch (const std::exception& e) {
    return fail(e, kExitRunFailed);
  }
}
#endif
)speedrun_source";
