// The simulated communication backend: each collective equals its serial definition bitwise
// (fixed rank order), buffers are fully written, reuse across many calls is race-free, a failing
// rank never hangs the others, and the two comm-layer faults change what they should.
#include "check.h"
#include "kernels/comm.h"

#include <chrono>
#include <cmath>
#include <future>
#include <random>

namespace {

template <typename T>
std::vector<std::vector<T>> random_buffers(int W, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<std::vector<T>> b(W, std::vector<T>(n));
  for (auto& v : b)
    for (T& x : v) x = T(u(rng));
  return b;
}

// recv_r == the serial rank-order sum of every rank's chunk r (over the first `contributors`
// ranks, divided by `divisor`: what the faults produce).
template <typename T>
bool reduce_scatter_matches(int W, size_t count, uint64_t seed, T divisor = 1, int contributors = -1) {
  if (contributors < 0) contributors = W;
  auto send = random_buffers<T>(W, W * count, seed);
  std::vector<std::vector<T>> recv(W, std::vector<T>(count, T(NAN)));
  SimulatedWorld(W).run([&](Communicator& c) { reduce_scatter_sum(c, send[c.rank()].data(), recv[c.rank()].data(), count); });
  for (int r = 0; r < W; ++r)
    for (size_t i = 0; i < count; ++i) {
      T sum = 0;
      for (int q = 0; q < contributors; ++q) sum += send[q][r * count + i];
      if (!(recv[r][i] == (divisor == 1 ? sum : sum / divisor))) return false;
    }
  return true;
}

template <typename T>
void check_collectives(int W, uint64_t seed) {
  const size_t count = 37;
  CHECK(reduce_scatter_matches<T>(W, count, seed));
  auto send = random_buffers<T>(W, W * count, seed + 1);
  std::vector<std::vector<T>> gathered(W, std::vector<T>(W * count, T(NAN))), exchanged = gathered;
  std::vector<double> sums(W, NAN);
  SimulatedWorld(W).run([&](Communicator& c) {
    int r = c.rank();
    all_gather(c, send[r].data(), gathered[r].data(), count);
    all_to_all(c, send[r].data(), exchanged[r].data(), count);
    sums[r] = c.all_reduce_sum(r + 0.5);
    c.barrier();
  });
  for (int r = 0; r < W; ++r) {
    for (int q = 0; q < W; ++q)
      for (size_t i = 0; i < count; ++i) {
        CHECK(gathered[r][q * count + i] == send[q][i]);
        CHECK(exchanged[r][q * count + i] == send[q][r * count + i]);
      }
    CHECK(sums[r] == W * W / 2.0);
  }
}

}  // namespace

TEST_CASE("collectives equal their serial definitions for W = 1, 2, 3, 4, 5, 8, f32 and f64") {
  for (int W : {1, 2, 3, 4, 5, 8}) {
    check_collectives<float>(W, 100 + W);
    check_collectives<double>(W, 200 + W);
  }
}

TEST_CASE("200 reduce-scatters and all-gathers on reused buffers stay exact") {
  const int W = 4;
  const size_t count = 64;
  auto send = random_buffers<double>(W, W * count, 5);
  std::vector<std::vector<double>> recv(W, std::vector<double>(count)), gathered(W, std::vector<double>(W * count));
  std::vector<int> wrong(W, 0);
  SimulatedWorld(W).run([&](Communicator& c) {
    int r = c.rank();
    for (int it = 0; it < 200; ++it) {
      for (double& x : send[r]) x += 1.0;  // every rank changes its send buffer between calls
      reduce_scatter_sum(c, send[r].data(), recv[r].data(), count);
      all_gather(c, recv[r].data(), gathered[r].data(), count);
      for (int q = 0; q < W; ++q)
        for (size_t i = 0; i < count; ++i) {
          double sum = 0;
          for (int s = 0; s < W; ++s) sum += send[s][q * count + i];
          wrong[r] += gathered[r][q * count + i] != sum;
        }
      c.barrier();  // nobody changes send[] while another rank still checks against it
    }
  });
  for (int r = 0; r < W; ++r) CHECK(wrong[r] == 0);
}

TEST_CASE("a rank that throws releases the others and the error surfaces from run()") {
  auto result = std::async(std::launch::async, [] {
    try {
      SimulatedWorld(4).run([](Communicator& c) {
        if (c.rank() == 2) throw std::runtime_error("rank 2 failed on purpose");
        c.barrier();
        c.all_reduce_sum(1.0);
      });
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  });
  CHECK(result.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  CHECK(result.get() == "rank 2 failed on purpose");
}

TEST_CASE("faults of the comm layer: AVG instead of SUM, a dropped rank") {
  injected_fault() = Fault::avg_instead_of_sum;
  CHECK(reduce_scatter_matches<double>(4, 16, 9, 4.0));
  CHECK(!reduce_scatter_matches<double>(4, 16, 9));
  injected_fault() = Fault::drop_rank_contribution;
  CHECK(reduce_scatter_matches<double>(4, 16, 9, 1.0, 3));
  CHECK(!reduce_scatter_matches<double>(4, 16, 9));
  injected_fault() = Fault::none;
  CHECK(reduce_scatter_matches<double>(4, 16, 9));
}

int main() { return check::run_checks(); }
