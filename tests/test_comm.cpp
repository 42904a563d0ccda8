// The simulated communication backend: each collective equals its serial definition bitwise
// (fixed rank order), buffers are fully written, reuse across many calls is race-free, a failing
// rank never hangs the others, and the two comm-layer faults change what they should.
#include "check.h"
#include "injected_faults.h"
#include "kernels/host/comm.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <random>

namespace {

const int kWorldSizes[] = {1, 2, 3, 4, 5, 8};

// Values never zero, with magnitudes spread over 2^-8 .. 2^8 so that a float or double sum
// depends on its order: a bitwise match then proves the fixed rank order.
template <typename T>
void fill_random(std::vector<T>& buffer, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> exponent(-8.0, 8.0);
  std::bernoulli_distribution negative(0.5);
  for (T& x : buffer) x = T((negative(rng) ? -1.0 : 1.0) * std::exp2(exponent(rng)));
}

template <typename T>
std::vector<std::vector<T>> random_buffers(int W, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<T>> buffers(W, std::vector<T>(n));
  for (auto& buffer : buffers) fill_random(buffer, rng);
  return buffers;
}

template <typename T>
std::vector<std::vector<T>> poisoned_buffers(int W, size_t n) {
  return std::vector<std::vector<T>>(W, std::vector<T>(n, T(NAN)));
}

// The serial definition of rank r's reduce-scatter output element i: the sum over ranks
// q = 0 .. contributors-1 in that order (contributors < W only under Fault::drop_rank_contribution).
template <typename T>
T serial_chunk_sum(const std::vector<std::vector<T>>& send, int r, size_t count, size_t i, int contributors) {
  T sum = 0;
  for (int q = 0; q < contributors; ++q) sum += send[q][r * count + i];
  return sum;
}

// Runs one reduce-scatter at world size W and counts the elements that differ bitwise from
// serial_chunk_sum(contributors) / divisor.
template <typename T>
int reduce_scatter_mismatches(int W, size_t count, uint64_t seed, int contributors, T divisor) {
  auto send = random_buffers<T>(W, W * count, seed);  // [W][W * count]
  auto recv = poisoned_buffers<T>(W, count);          // [W][count]
  SimulatedWorld(W).run([&](Communicator& c) { reduce_scatter_sum(c, send[c.rank()].data(), recv[c.rank()].data(), count); });
  int mismatches = 0;
  for (int r = 0; r < W; ++r)
    for (size_t i = 0; i < count; ++i)
      mismatches += !(recv[r][i] == serial_chunk_sum(send, r, count, i, contributors) / divisor);
  return mismatches;
}

// True when summing in reverse rank order changes some element: the data can tell orders apart.
template <typename T>
bool order_matters(const std::vector<std::vector<T>>& send, int W, size_t count) {
  for (int r = 0; r < W; ++r)
    for (size_t i = 0; i < count; ++i) {
      T reversed = 0;
      for (int q = W - 1; q >= 0; --q) reversed += send[q][r * count + i];
      if (reversed != serial_chunk_sum(send, r, count, i, W)) return true;
    }
  return false;
}

template <typename T>
void check_collectives(int W, uint64_t seed) {
  const size_t count = 37;
  CHECK(reduce_scatter_mismatches<T>(W, count, seed, W, T(1)) == 0);
  if (W >= 3) CHECK(order_matters(random_buffers<T>(W, W * count, seed), W, count));

  auto send = random_buffers<T>(W, W * count, seed + 1);  // [W][W * count]
  auto gathered = poisoned_buffers<T>(W, W * count);      // [W][W * count]
  auto exchanged = poisoned_buffers<T>(W, W * count);     // [W][W * count]
  std::vector<double> scalar_sums(W, NAN);                // [W]
  SimulatedWorld(W).run([&](Communicator& c) {
    int r = c.rank();
    all_gather(c, send[r].data(), gathered[r].data(), count);  // sends the first `count` values
    all_to_all(c, send[r].data(), exchanged[r].data(), count);
    scalar_sums[r] = c.all_reduce_sum(send[r][0]);
    c.barrier();
  });
  double serial_scalar_sum = 0;
  for (int q = 0; q < W; ++q) serial_scalar_sum += double(send[q][0]);
  for (int r = 0; r < W; ++r) {
    for (int q = 0; q < W; ++q)
      for (size_t i = 0; i < count; ++i) {
        CHECK(gathered[r][q * count + i] == send[q][i]);
        CHECK(exchanged[r][q * count + i] == send[q][r * count + i]);
      }
    CHECK(scalar_sums[r] == serial_scalar_sum);
  }
}

// Many consecutive collectives on the same buffers, every rank changing its send buffer between
// calls: a rank that read a buffer before its owner posted it, or after its owner reused it,
// shows up as a mismatch. Returns the number of mismatches over all ranks.
template <typename T>
int reused_buffer_mismatches(int W, int iterations, uint64_t seed) {
  const size_t count = 19;
  auto send = poisoned_buffers<T>(W, W * count);       // [W][W * count]
  auto reduced = poisoned_buffers<T>(W, count);        // [W][count]
  auto gathered = poisoned_buffers<T>(W, W * count);   // [W][W * count]
  auto exchanged = poisoned_buffers<T>(W, W * count);  // [W][W * count]
  std::vector<int> mismatches(W, 0);
  SimulatedWorld(W).run([&](Communicator& c) {
    const int r = c.rank();
    std::mt19937_64 rng(seed * 64 + r);
    for (int it = 0; it < iterations; ++it) {
      fill_random(send[r], rng);
      for (auto* out : {&reduced[r], &gathered[r], &exchanged[r]}) std::fill(out->begin(), out->end(), T(NAN));
      reduce_scatter_sum(c, send[r].data(), reduced[r].data(), count);
      all_gather(c, reduced[r].data(), gathered[r].data(), count);
      all_to_all(c, send[r].data(), exchanged[r].data(), count);
      for (int q = 0; q < W; ++q)
        for (size_t i = 0; i < count; ++i) {
          mismatches[r] += !(gathered[r][q * count + i] == serial_chunk_sum(send, q, count, i, W));
          mismatches[r] += !(exchanged[r][q * count + i] == send[q][r * count + i]);
        }
      c.barrier();  // nobody changes send[] while another rank still checks against it
    }
  });
  int total = 0;
  for (int m : mismatches) total += m;
  return total;
}

// Runs body on another thread; if it has not finished within 10 s, the backend hangs, and the
// test process ends here (a hung std::future would block forever in its destructor).
std::string message_of_run_within_timeout(std::function<void()> body) {
  auto result = std::async(std::launch::async, [body] {
    try {
      body();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  });
  if (result.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    std::printf("  FAILED: SimulatedWorld::run hangs after a rank threw\n");
    std::fflush(stdout);
    std::_Exit(1);
  }
  return result.get();
}

}  // namespace

TEST_CASE("collectives equal their serial definitions for W = 1, 2, 3, 4, 5, 8, f32 and f64") {
  for (int W : kWorldSizes) {
    check_collectives<float>(W, 100 + W);
    check_collectives<double>(W, 200 + W);
  }
}

TEST_CASE("200 consecutive collectives on reused buffers stay exact") {
  for (int W : kWorldSizes) {
    CHECK(reused_buffer_mismatches<float>(W, 200, 300 + W) == 0);
    CHECK(reused_buffer_mismatches<double>(W, 200, 400 + W) == 0);
  }
}

TEST_CASE("a rank that throws releases the others and its error surfaces from run()") {
  // Rank 2 fails after two collectives while the others wait inside the third one.
  CHECK(message_of_run_within_timeout([] {
          SimulatedWorld(4).run([](Communicator& c) {
            c.barrier();
            c.all_reduce_sum(1.0);
            if (c.rank() == 2) throw std::runtime_error("rank 2 failed on purpose");
            std::vector<double> send(4, 1.0), recv(1);
            reduce_scatter_sum(c, send.data(), recv.data(), 1);
          });
        }) == "rank 2 failed on purpose");
  // The last rank fails before any collective; the others never get past their first one.
  CHECK(message_of_run_within_timeout([] {
          SimulatedWorld(8).run([](Communicator& c) {
            if (c.rank() == 7) throw std::runtime_error("rank 7 failed on purpose");
            for (int it = 0; it < 100; ++it) c.barrier();
          });
        }) == "rank 7 failed on purpose");
  CHECK(message_of_run_within_timeout([] {
          SimulatedWorld(1).run([](Communicator&) { throw std::runtime_error("the only rank failed"); });
        }) == "the only rank failed");
}

TEST_CASE("a world runs again after a failed run") {
  SimulatedWorld world(3);
  CHECK(message_of_run_within_timeout([&] {
          world.run([](Communicator& c) {
            if (c.rank() == 0) throw std::runtime_error("first run fails");
            c.barrier();
          });
        }) == "first run fails");
  std::vector<double> sums(3, NAN);
  world.run([&](Communicator& c) { sums[c.rank()] = c.all_reduce_sum(c.rank() + 1.0); });
  CHECK((sums == std::vector<double>{6.0, 6.0, 6.0}));
}

TEST_CASE("fault avg_instead_of_sum divides the reduce-scatter sum by W") {
  ScopedFault fault(Fault::avg_instead_of_sum);
  for (int W : {2, 3, 8}) {
    CHECK(reduce_scatter_mismatches<float>(W, 16, 500 + W, W, float(W)) == 0);
    CHECK(reduce_scatter_mismatches<double>(W, 16, 600 + W, W, double(W)) == 0);
    CHECK(reduce_scatter_mismatches<double>(W, 16, 600 + W, W, 1.0) == W * 16);
  }
}

TEST_CASE("fault drop_rank_contribution leaves out rank W-1 (and nothing at W = 1)") {
  ScopedFault fault(Fault::drop_rank_contribution);
  for (int W : {2, 3, 8}) {
    CHECK(reduce_scatter_mismatches<float>(W, 16, 700 + W, W - 1, 1.0f) == 0);
    CHECK(reduce_scatter_mismatches<double>(W, 16, 800 + W, W - 1, 1.0) == 0);
    CHECK(reduce_scatter_mismatches<double>(W, 16, 800 + W, W, 1.0) == W * 16);
  }
  CHECK(reduce_scatter_mismatches<double>(1, 16, 801, 1, 1.0) == 0);
}

TEST_CASE("with the fault switch back at none, reduce-scatter is the plain sum again") {
  { ScopedFault fault(Fault::avg_instead_of_sum); }
  CHECK(injected_fault() == Fault::none);
  CHECK(reduce_scatter_mismatches<double>(4, 16, 900, 4, 1.0) == 0);
}

int main() { return check::run_checks(); }
