// The collectives the trainer needs, behind one small interface (SPEC 4.4): a production backend
// (NCCL, one process per GPU) and a simulated one, W virtual ranks as threads of one process whose
// collectives rendezvous and reduce in a fixed rank order, so results are bitwise deterministic.
// Gradients are only ever SUM-reduced (SPEC 4.2): there is no AVG anywhere.
#pragma once
#include "kernels/host/faults.h"

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
