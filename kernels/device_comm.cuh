// The collectives of the trainer on device buffers, ordered on CUDA streams (SPEC 4.3, 4.4), with
// two backends: NCCL across processes (one per GPU: the production path) and W simulated ranks as
// threads of one process on one GPU, each with its own stream, whose collectives read the other
// ranks' buffers directly and reduce in rank order (deterministic; NCCL below 2.30 refuses two
// ranks on one GPU). Gradients are only ever SUM-reduced (SPEC 4.2). The gradient traffic modes
// of SPEC 4.3 sit on top: fp32 reduce-scatter, bf16 reduce-scatter, bf16 all-to-all with the
// owner summing in fp32 in rank order.
#pragma once
#include "kernels/host/comm.h"
#include "kernels/host/cuda_check.cuh"
#include "kernels/device_utils.cuh"

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
  await_previous_kernel();
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
      CUDA_CHECK(launch_kernel(sum_rank_buffers_kernel<float>, elementwise_grid(count), 256, 0, stream, in, contributors,
                               offset, static_cast<float*>(out), count, divisor));
    else
      CUDA_CHECK(launch_kernel(sum_rank_buffers_kernel<bf16>, elementwise_grid(count), 256, 0, stream, in, contributors,
                               offset, static_cast<bf16*>(out), count, divisor));
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
  await_previous_kernel();
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
      CUDA_CHECK(launch_kernel(sum_chunks_kernel, elementwise_grid(count), 256, 0, stream, scratch + total,
                               comm.world_size(), recv, count));
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
