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
// At the end of training every fragment takes the groups' plain average (finish, below).
//
// Sharding: rank l of a group owns the l-th of L equal slices of each fragment's elements (the
// fragment's parameters back to back, in parameter order), holds the global copy and the outer
// momentum of that slice only, exchanges only it (so the L ranks of a group use L links at once),
// and all-gathers the mixed slice back to the group's other ranks.
#pragma once
#include "kernels/host/cuda_check.cuh"
#include "kernels/device_comm.cuh"
#include "kernels/device_utils.cuh"
#include "kernels/host/faults.h"
#include "kernels/host/timeline.cuh"

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
  await_previous_kernel();
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = flipped ? float(local[i]) - global[i] : global[i] - float(local[i]);
}

// m = mu m + avg; global -= lr (avg + mu m), avg = sum / divisor; reset: m starts from 0 (a fault).
// momentum null: global -= lr avg, the momentum neither read nor written (the final average).
__global__ void outer_nesterov_kernel(const float* sum, float divisor, float* momentum, float* global, size_t n,
                                      float lr, float mu, bool reset) {
  await_previous_kernel();
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float avg = sum[i] / divisor;
    if (!momentum) {
      global[i] -= lr * avg;
      continue;
    }
    const float m = mu * (reset ? 0.0f : momentum[i]) + avg;
    momentum[i] = m;
    global[i] -= lr * (avg + mu * m);
  }
}

// out = global + alpha (local - global): torch's global.lerp_(local, alpha).
template <typename T>
__global__ void mix_kernel(const T* local, const float* global, T* out, size_t n, float alpha) {
  await_previous_kernel();
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
    norm_partials_ = alloc<float>(frobenius_chunks(largest));
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
    if (pending_ && pending_->apply_at <= steps_done) line = apply(steps_done, stream, Outer::nesterov);
    const int f = diloco_fragment_starting(s_, steps_done);
    if (f >= 0) {
      start(f, steps_done, stream);
      if (pending_->apply_at <= steps_done) line = apply(steps_done, stream, Outer::nesterov);
    }
    return line;
  }

  // At the end of training every group must hold the same model: each fragment takes the groups'
  // plain average. Δ̄ = global − mean(local), so an outer step of lr 1 without momentum lands on
  // mean(local) (then α = 0); the outer momentum is left as it is. Not one more outer Nesterov step:
  // a fragment that synced on the last step has Δ̄ ≈ 0, so that step would be lr·μ·m alone, an
  // extrapolation with no inner step after it, which made the model worse in every configuration
  // tried (docs/DILOCO.md). The exchange in flight, if any, is dropped: the average of the newer
  // parameters supersedes it.
  std::vector<std::string> finish(int steps_done, cudaStream_t stream) {
    std::vector<std::string> lines;
    if (pending_) {
      CUDA_CHECK(cudaStreamWaitEvent(stream, exchanged_, 0));  // its buffers are reused below
      lines.push_back("diloco: the exchange of fragment " + std::to_string(pending_->fragment) + " started after step " +
                      std::to_string(pending_->started) + " is dropped: the final average supersedes it");
      set_pending(std::nullopt);
    }
    for (int f = 0; f < s_.fragments; ++f) {
      start(f, steps_done, stream);
      lines.push_back(apply(steps_done, stream, Outer::final_average));
    }
    return lines;
  }

  // After a resume at `steps_done` (its checkpoint restored into state_buffers()): the exchange the
  // checkpoint recorded in flight, whose sum it holds, is applied when due; none after finish().
  void resumed_at(int steps_done) {
    const int f = in_flight_[0], started = in_flight_[1];  // as the checkpoint restored them
    set_pending(std::nullopt);
    if (f >= 0) {
      if (f >= s_.fragments || started > steps_done || started <= 0)
        throw std::runtime_error("--resume: the checkpoint's DiLoCo exchange in flight (fragment " + std::to_string(f) +
                                 ", started after step " + std::to_string(started) + ") does not fit these settings at step " +
                                 std::to_string(steps_done));
      set_pending(Pending{f, started, diloco_apply_step(s_, started)});
    }
  }

  // The state a checkpoint carries: each fragment's global slice and outer momentum, the sum of
  // the exchange in flight, and which one that is (fragment, step started; -1: none).
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
    state.push_back({"diloco exchange in flight: fragment, step started", const_cast<int32_t*>(in_flight_),
                     sizeof in_flight_});
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
  enum class Outer { nesterov, final_average };

  // The exchange in flight, and its record for a checkpoint (host memory, which checkpoints copy as
  // they copy device buffers).
  void set_pending(std::optional<Pending> p) {
    pending_ = p;
    in_flight_[0] = p ? p->fragment : -1;
    in_flight_[1] = p ? p->started : 0;
  }

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
        CUDA_CHECK(launch_kernel(pseudo_gradient_kernel<bf16>, grid, 256, 0, stream,
                                 static_cast<const bf16*>(p.param.data) + p.first, sl.global + p.at, send_ + p.at,
                                 p.count, flipped));
      else
        CUDA_CHECK(launch_kernel(pseudo_gradient_kernel<float>, grid, 256, 0, stream,
                                 static_cast<const float*>(p.param.data) + p.first, sl.global + p.at, send_ + p.at,
                                 p.count, flipped));
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
    set_pending(Pending{f, steps_done, diloco_apply_step(s_, steps_done)});
  }

  // The exchange in flight, once in, applied (outer_step); returns its log line.
  std::string apply(int steps_done, cudaStream_t stream, Outer outer) {
    const Pending p = *pending_;
    set_pending(std::nullopt);
    Slices& sl = slices_[size_t(p.fragment)];
    CUDA_CHECK(cudaStreamWaitEvent(stream, exchanged_, 0));
    const int G = across_.world_size();
    outer_step(sl, outer, stream);
    float norm = 0;
    CUDA_CHECK(cudaMemcpyAsync(&norm, norm_, sizeof norm, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const double norm_of_average = std::sqrt(group_.all_reduce_sum(double(norm) * norm)) / G;
    char line[256];
    if (outer == Outer::final_average)
      std::snprintf(line, sizeof line,
                    "diloco: fragment %d averaged over the groups after step %d, the end of training: distance to the "
                    "global copy %.4e",
                    p.fragment, steps_done, norm_of_average);
    else
      std::snprintf(line, sizeof line,
                    "diloco: fragment %d synced after step %d (exchange started after step %d): pseudo-gradient norm "
                    "%.4e, %.1f MB sent across groups by each rank",
                    p.fragment, steps_done, p.started, norm_of_average, bytes_sent_per_exchange(p.fragment) / 1e6);
    return line;
  }

  // On this rank's slice of a fragment whose exchange is in: Δ̄'s norm (for the log), the outer
  // step (or, at the end, the step of lr 1 without momentum that lands on the groups' average), the
  // mix into the local parameters (α = 0 at the end), the group's gather.
  void outer_step(Slices& sl, Outer outer, cudaStream_t stream) {
    const bool average = outer == Outer::final_average;
    const double alpha = average ? 0.0 : s_.alpha;
    TimelineSpan span(timeline_, "compute", "diloco outer step", stream);
    const int G = across_.world_size();
    const size_t valid = my_valid(sl);
    const float divisor = float(injected_fault() == Fault::diloco_average_by_world ? G * group_.world_size() : G);
    frobenius_norms(received_, 1, valid, norm_partials_, norm_, stream);
    CUDA_CHECK(launch_kernel(outer_nesterov_kernel, elementwise_grid(valid), 256, 0, stream, received_, divisor,
                             average ? nullptr : sl.momentum, sl.global, valid, average ? 1.0f : float(s_.outer_lr),
                             float(s_.outer_momentum), injected_fault() == Fault::diloco_momentum_reset));
    // the mix is written in place; the fault writes it to a copy (send_), as torchft#233 fixed
    const bool to_copy = injected_fault() == Fault::diloco_mix_to_copy;
    for (const SlicePiece& piece : sl.mine) {
      const int grid = elementwise_grid(piece.count);
      if (piece.param.bf16) {
        const bf16* local = static_cast<const bf16*>(piece.param.data) + piece.first;
        bf16* out = to_copy ? reinterpret_cast<bf16*>(send_) : const_cast<bf16*>(local);
        CUDA_CHECK(launch_kernel(mix_kernel<bf16>, grid, 256, 0, stream, local, sl.global + piece.at, out, piece.count,
                                 float(alpha)));
      } else {
        const float* local = static_cast<const float*>(piece.param.data) + piece.first;
        float* out = to_copy ? send_ : const_cast<float*>(local);
        CUDA_CHECK(launch_kernel(mix_kernel<float>, grid, 256, 0, stream, local, sl.global + piece.at, out, piece.count,
                                 float(alpha)));
      }
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
  float* norm_partials_ = nullptr;     // its partial sums (frobenius_norms)
  std::optional<Pending> pending_;     // set only through set_pending
  int32_t in_flight_[2] = {-1, 0};     // pending_'s fragment (-1: none) and step started, for checkpoints
  cudaStream_t exchange_stream_ = nullptr;
  cudaEvent_t ready_ = nullptr, exchanged_ = nullptr;
  std::vector<void*> owned_, owned_host_;
  Timeline* timeline_ = nullptr;
};
