// The oracle of SPEC 4.4 on the GPU: the trainer's step (train_gpt.cu: gradients, reduce-scatter,
// sharded Adam and Muon, all-gather) on W simulated ranks of one GPU (kernels/device_comm.cuh)
// against W = 1, from identical weights over the same global batches: after K steps every rank's
// parameters and every optimizer state (Adam slices, Muon momentum of owned matrices) agree with
// the W = 1 run. Not bitwise: W = 1 sums the micro-sequences' gradients in one fp32 buffer, W > 1
// sums per rank and then across ranks (another fp32 order), and the bf16 weight copies and the
// bf16 Newton-Schulz round the difference on: the worst errors are in the bf16 value embeddings
// and the scalars' Adam v (their gradients cancel 10-100x, see model_fixture.h); with fp32 traffic
// and W = M (one micro-sequence per rank) nearly 0. Every injected bug of SPEC 4.4 must exceed the
// bound, and the rounding of the same configuration by 10x or more: Adam and Muon barely see a
// gradient scale, but their states do. The reductions go out during the backward of each rank's last micro-sequence
// (Optimizers::gradients_done), so the oracle covers that schedule too, including ranks that have
// no micro-sequence (W > M). The bounds and margins measured are in docs/PERF.md.
#include "gpu/model_fixture.h"
#include "injected_faults.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>

namespace {

using namespace fixture;

// The oracle's shape, the smallest that keeps what it proves: the record's 12-layer structure
// (value embeddings, skips, the attention-free layer 7) at d = 128 (one head) and vocabulary 512;
// M = 4 micro-sequences of one 128-token attention block, so that W = 3 splits them unevenly and
// W = 8 > M leaves ranks without one; K = 2 steps from weights that are all nonzero
// (initialize_nonzero), so that every gradient, Muon's momentum and both optimizers' second step
// take part. The injected bugs run at W = 3, where the rounding is not zero.
constexpr int kT = 128, kMicro = 4, kSteps = 2;
constexpr int kBugWorld = 3;
constexpr int kVocab = kOracleVocab;
// The CPU emulator, rounding as the GPU does, measured at this shape a worst error of 2.3e-2 with
// fp32 traffic (W = 2, 3: a bf16 value embedding) and 0.15 with bf16 traffic (W = 8, the scalars'
// Adam v); each bound leaves 3-4x for the GPU's own rounding. bf16 traffic rounds every partial
// sum to 8 bits, so its bound only catches gross failures: the injected bugs are checked with
// fp32 traffic. To calibrate on the GPU (NCCL's bf16 sums round differently from the emulator's).
constexpr double kBound = 0.1;
constexpr double kBf16Bound = 0.5;
constexpr double kRoundingMargin = 10;  // every injected bug / the rounding of its configuration

// Every (grad-comm mode, W) pair.
// On the emulator in CI (the subset): fp32-rs at every W, the bf16 modes at W = 3 and 8.
std::vector<std::pair<std::string, int>> oracle_cases() {
  std::vector<std::pair<std::string, int>> all;
  for (const char* mode : {"fp32-rs", "bf16-rs", "a2a-fp32acc"})
    for (int W : {2, 3, 4, 8})
      if (!testing_a_subset() || std::string(mode) == "fp32-rs" || W == 3 || W == 8) all.push_back({mode, W});
  return all;
}

using Snapshot = std::map<std::string, std::vector<double>>;  // name -> values (params and states)

template <typename T>
std::vector<double> download_as_double(const void* device, size_t count) {
  std::vector<T> host(count);
  CUDA_CHECK(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost));
  return to_double(host);
}

// Parameters whole, states as this rank holds them (named as Optimizers::state_buffers does).
Snapshot snapshot(const ParameterStore& params, Optimizers& optimizers) {
  CUDA_CHECK(cudaDeviceSynchronize());
  Snapshot s;
  for (const Param& p : params.list)
    s[p.name] = p.is_embedding() ? download_as_double<bf16>(params.embeddings + p.offset, p.numel)
                                 : download_as_double<float>(params.master + p.offset, p.numel);
  for (const StateBuffer& b : optimizers.state_buffers()) {
    if (b.name == "adam steps") continue;
    const bool bf16_state = b.name.find("embed") != std::string::npos && b.name.rfind("adam", 0) == 0;
    s[b.name] = bf16_state ? download_as_double<bf16>(b.data, b.bytes / 2) : download_as_double<float>(b.data, b.bytes / 4);
  }
  return s;
}

enum class Backend { simulated, nccl };  // W = 1 without NCCL is SingleRankCommunicator

// Every rank trains K steps on its micro-sequences of the same global batches; returns each rank's snapshot.
std::vector<Snapshot> train_ranks(int world_size, const std::string& grad_comm, const std::vector<uint16_t>& stream,
                                  Backend backend = Backend::simulated, const std::string& matrix_optimizer = "muon",
                                  int micro = kMicro) {
  Hyperparameters h = test_hyperparameters(kSteps, micro, kT);
  h.grad_comm = grad_comm;
  h.matrix_optimizer = matrix_optimizer;
  const Schedule schedule = schedule_of(h);
  std::vector<Snapshot> result(world_size);
  auto per_rank = [&](DeviceCommunicator& comm) {
    RankTrainer t(h, comm, oracle_config());
    initialize_nonzero(t.model.config(), t.model.params, 77);  // identical on every rank
    cudaStream_t s;  // blocking: ordered after the initialisation's copies on the default stream
    CUDA_CHECK(cudaStreamCreate(&s));
    double mean_loss = 0;
    for (int step = 0; step < kSteps; ++step) {
      HostBatch host(stream.data() + size_t(step) * micro * kT, micro, kT, step, comm.rank(), comm.world_size());
      double loss_sum = train_step(t.model, t.acts, t.optimizers, host.batch, step, schedule, /*fp8_head=*/false, s);
      mean_loss = mean_over_ranks(comm, loss_sum, double(host.batch.num_micro) * kT);
    }
    CUDA_CHECK(cudaStreamSynchronize(s));
    CUDA_CHECK(cudaStreamDestroy(s));
    result[comm.rank()] = snapshot(t.model.params, t.optimizers);
    result[comm.rank()]["mean loss of the last step"] = {mean_loss};
  };
  if (backend == Backend::nccl) {
    if (world_size != 1) throw std::invalid_argument("one GPU holds one NCCL rank");
    ncclUniqueId id;
    NCCL_CHECK(ncclGetUniqueId(&id));
    NcclCommunicator nccl(0, 1, id);
    per_rank(nccl);
  } else if (world_size == 1) {
    SingleRankCommunicator single;
    per_rank(single);
  } else {
    SimulatedDeviceWorld(world_size).run(per_rank);
  }
  return result;
}

// Worst relative error of any rank's parameter or state against the W = 1 snapshot (a rank's
// Adam state is its dim-0 slice of the whole one, Muon momentum whole on the owner).
double worst_error(const Snapshot& whole, const std::vector<Snapshot>& ranks, std::string& where) {
  double worst = 0;
  for (size_t r = 0; r < ranks.size(); ++r)
    for (const auto& [name, values] : ranks[r]) {
      const std::vector<double>& ref = whole.at(name);
      size_t offset = name.rfind("adam", 0) == 0 ? r * values.size() : 0;
      size_t n = std::min(values.size(), ref.size() > offset ? ref.size() - offset : 0);  // the pad is not data
      std::vector<double> part(values.begin(), values.begin() + n), expected(ref.begin() + offset, ref.begin() + offset + n);
      // Equal is 0, also where both are zero (a slice of padding: relative_error would give 0 / 0).
      double error = part == expected ? 0 : relative_error(part, expected);
      if (!(error <= worst)) {  // NaN counts as worst
        worst = std::isnan(error) ? INFINITY : error;
        where = "rank " + std::to_string(r) + " " + name;
      }
    }
  return worst;
}

const std::vector<uint16_t>& token_stream() {
  static const std::vector<uint16_t> tokens = synthetic_tokens(size_t(kSteps) * kMicro * kT + 1, kVocab, kVocab - 1, 1.0 / 100, 78);
  return tokens;
}

const Snapshot& single_rank_result() {
  static const Snapshot whole = train_ranks(1, "fp32-rs", token_stream())[0];
  return whole;
}

// Start times (us) of the spans named `name` in a Chrome trace written by Timeline.
std::vector<double> span_starts(const std::string& trace_path, const std::string& name) {
  std::ifstream in(trace_path);
  std::vector<double> starts;
  const std::string key = "\"name\": \"" + name + "\"";
  for (std::string line; std::getline(in, line);)
    if (line.find(key) != std::string::npos) starts.push_back(std::stod(line.substr(line.find("\"ts\": ") + 6)));
  return starts;
}

}  // namespace

TEST_CASE("W = 2, 3, 4, 8 simulated ranks (8 > M: some without a micro-sequence) reproduce W = 1: parameters and "
          "optimizer states, every grad-comm mode") {
  for (const auto& [mode, W] : oracle_cases()) {
    std::string where;
    double error = worst_error(single_rank_result(), train_ranks(W, mode, token_stream()), where);
    double bound = mode == "fp32-rs" ? kBound : kBf16Bound;
    std::printf("  %-12s W = %d: worst relative error %.3e (%s), bound %.2g\n", mode.c_str(), W, error, where.c_str(),
                bound);
    CHECK(error <= bound);
  }
}

TEST_CASE("real NCCL with one rank runs the same steps as W = 1 without communication, bitwise") {
  for (const char* mode : {"fp32-rs", "bf16-rs", "a2a-fp32acc"}) {  // the bf16 modes round at W = 1 too
    if (testing_a_subset() && std::string(mode) == "bf16-rs") continue;  // the CI subset: fp32 and all_to_all
    std::string where;
    const Snapshot alone = train_ranks(1, mode, token_stream())[0];
    double error = worst_error(alone, train_ranks(1, mode, token_stream(), Backend::nccl), where);
    std::printf("  %-12s NCCL W = 1: worst relative error %.3e (%s)\n", mode, error, where.c_str());
    CHECK(error == 0);
  }
}

// The oracle at W = kBugWorld without a fault (the rounding, within the bound), then with each of
// `faults`: each must fail it by the bound and by kRoundingMargin times the rounding.
void check_injected_faults(std::initializer_list<Fault> faults) {
  std::string where;
  const double rounding = worst_error(single_rank_result(), train_ranks(kBugWorld, "fp32-rs", token_stream()), where);
  std::printf("  %-26s W = %d: worst relative error %.3e (%s)\n", "none (rounding)", kBugWorld, rounding, where.c_str());
  CHECK(rounding <= kBound);
  for (Fault fault : faults) {
    std::vector<Snapshot> ranks;
    {
      ScopedFault injected(fault);
      ranks = train_ranks(kBugWorld, "fp32-rs", token_stream());
    }
    const double error = worst_error(single_rank_result(), ranks, where);
    std::printf("  %-26s W = %d: worst relative error %.3e (%s): %.0fx the rounding, %.1fx the bound\n",
                fault_name(fault), kBugWorld, error, where.c_str(), error / rounding, error / kBound);
    CHECK(error > kBound);
    CHECK(error >= kRoundingMargin * rounding);
  }
}

TEST_CASE("every injected distributed bug makes the GPU oracle fail, by 10x the rounding or more") {
  check_injected_faults({Fault::avg_instead_of_sum, Fault::local_count_normalization, Fault::prescale_by_world,
                         Fault::drop_rank_contribution, Fault::wrong_shard_offset, Fault::skip_all_gather,
                         Fault::replicated_count_per_rank, Fault::value_embed_reduced_early});
}

#ifdef SPEEDRUN_EMULATED
// The emulator's lazy streams (tests/emulator/cuda_emulator.h) run each stream's work only when
// something waits for it: the communication stream's reductions and gathers then run as late as
// the trainer's waits allow, where the default emulation runs them as early as possible, and a
// missing wait shows as stale gradients or weights (on a GPU it shows only when the timing says so).
TEST_CASE("lazy streams: W = 3 reproduces W = 1 with the communication as late as its waits allow; a skipped wait fails") {
  emu::LazyStreamsScope lazy;
  check_injected_faults({Fault::no_wait_for_reductions, Fault::no_wait_for_gathers});
}
#endif

// REKLS in its first steps turns the rounding of another fp32 summation order into O(1)
// differences (docs/REKLS.md: the fc factors' null space, whose rounding-sized eigenvalues its KL
// update weighs by 1 / max(lam, eps), and Adam's V, which is not rotated with the basis): W = 2
// and 3 at M = 4 sum pairs of micro-sequences per rank first and differ from W = 1 by 6 and 13.
// So REKLS's oracle gives each rank one micro-sequence (M = W, summed in rank order as W = 1 sums
// them, so only the optimizer's distribution is tested) and, for W = 8 > M, M = 4 with ranks
// without one; its bound is the Muon oracle's, and what it leaves is the bf16 value embeddings'.
std::vector<Snapshot> train_rekls_ranks(int world_size, int micro) {
  return train_ranks(world_size, "fp32-rs", token_stream(), Backend::simulated, "rekls", micro);
}

// Without an injected fault, each (W, M) trains once per process: the oracle's W = 3 is the
// injected bugs' rounding.
const std::vector<Snapshot>& rekls_result(int world_size, int micro) {
  static std::map<std::pair<int, int>, std::vector<Snapshot>> results;
  if (injected_fault() != Fault::none) throw std::logic_error("rekls_result caches runs without a fault only");
  auto it = results.find({world_size, micro});
  if (it == results.end()) it = results.emplace(std::pair{world_size, micro}, train_rekls_ranks(world_size, micro)).first;
  return it->second;
}
const Snapshot& single_rank_rekls(int micro) { return rekls_result(1, micro)[0]; }

// The REKLS states alone (factors, eigenbases, eigenvalues, moments of the owned matrices).
Snapshot rekls_states(const Snapshot& s) {
  Snapshot states;
  for (const auto& [name, values] : s)
    if (name.rfind("rekls state ", 0) == 0) states[name] = values;
  return states;
}

void check_rekls_oracle(int W, int micro) {
  std::vector<Snapshot> ranks = rekls_result(W, micro);
  std::string where, rekls_where;
  const double error = worst_error(single_rank_rekls(micro), ranks, where);
  for (Snapshot& r : ranks) r = rekls_states(r);
  const double rekls_error = worst_error(single_rank_rekls(micro), ranks, rekls_where);
  std::printf("  rekls W = %d, M = %d: worst relative error %.3e (%s), bound %.2g; of the REKLS states %.3e (%s)\n", W,
              micro, error, where.c_str(), kBound, rekls_error, rekls_where.empty() ? "all bitwise equal" : rekls_where.c_str());
  CHECK(error <= kBound);
}

TEST_CASE("rekls: W = 2, 3 simulated ranks reproduce W = 1: parameters, factors, eigenbases, moments") {
  check_rekls_oracle(2, 2);
  if (!testing_a_subset()) check_rekls_oracle(3, 3);  // the CI subset: W = 2
}

TEST_CASE("rekls: W = 4, 8 (8 > M: some without a micro-sequence) reproduce W = 1: parameters, REKLS states") {
  check_rekls_oracle(4, 4);
  check_rekls_oracle(8, 4);
}

TEST_CASE("rekls: every injected distributed bug (W = 3) fails the oracle, by 10x the rounding or more") {
  std::string where;
  const double rounding = worst_error(single_rank_rekls(kBugWorld), rekls_result(kBugWorld, kBugWorld), where);
  std::printf("  %-26s W = %d: worst relative error %.3e (%s)\n", "none (rounding)", kBugWorld, rounding, where.c_str());
  // The communication's own bugs are the Muon oracle's; with REKLS they failed it by 1e5x too
  // (avg_instead_of_sum, skip_all_gather: docs/REKLS.md).
  for (Fault fault : {Fault::local_matrix_gradient}) {
    std::vector<Snapshot> ranks;
    {
      ScopedFault injected(fault);
      ranks = train_rekls_ranks(kBugWorld, kBugWorld);
    }
    const double error = worst_error(single_rank_rekls(kBugWorld), ranks, where);
    std::printf("  %-26s W = %d: worst relative error %.3e (%s): %.0fx the rounding, %.1fx the bound\n",
                fault_name(fault), kBugWorld, error, where.c_str(), error / rounding, error / kBound);
    CHECK(error > kBound);
    CHECK(error >= kRoundingMargin * rounding);
  }
}

TEST_CASE("the rank consistency check stops every rank and names the parameter that differs") {
  std::string message;
  try {
    SimulatedDeviceWorld(3).run([&](DeviceCommunicator& comm) {
      DeviceMemory memory;
      GPT model(gpu_config(), memory);
      initialize_parameters(model.config(), model.params, 5);
      unsigned long long* scratch = memory.alloc<unsigned long long>("checksum", 1);
      check_rank_consistency(model.params, comm, scratch, 0);  // identical: passes
      if (comm.rank() == 1) {
        const Param& p = model.params.find(ParamKind::mlp_fc, 3);
        float changed = 0.5f;
        CUDA_CHECK(cudaMemcpy(model.params.master + p.offset + 17, &changed, sizeof changed, cudaMemcpyHostToDevice));
      }
      check_rank_consistency(model.params, comm, scratch, 0);
    });
  } catch (const std::exception& e) {
    message = e.what();
  }
  std::printf("  error: %s\n", message.c_str());
  CHECK(message.find("ranks disagree on parameter blocks.3.mlp.c_fc.weight (rank 0 ") == 0);
}

// --resume after a run stopped while its ranks wrote a checkpoint: the newest step every rank holds,
// each rank's own file of it (the files' names are all that is read here).
TEST_CASE("the ranks' newest common checkpoint: the newest step every rank holds, or none") {
  const std::string root = std::filesystem::temp_directory_path() / ("common_ckpt_" + std::to_string(::getpid()));
  auto common = [&](const std::vector<std::vector<int>>& steps) {
    std::filesystem::remove_all(root);
    for (size_t r = 0; r < steps.size(); ++r) {
      std::filesystem::create_directories(root + "/rank" + std::to_string(r));
      for (int step : steps[r]) std::ofstream(checkpoint_path(root + "/rank" + std::to_string(r), step));
    }
    std::vector<std::pair<int, std::string>> found(steps.size());
    SimulatedDeviceWorld(int(steps.size())).run([&](DeviceCommunicator& comm) {
      found[comm.rank()] = newest_common_checkpoint(comm, root + "/rank" + std::to_string(comm.rank()));
    });
    for (size_t r = 0; r < steps.size(); ++r)  // every rank the same step, its own file of it
      CHECK(found[r].second == (found[0].first < 0 ? "" : checkpoint_path(root + "/rank" + std::to_string(r),
                                                                          found[0].first)));
    return found[0].first;
  };
  CHECK(common({{250, 500}, {250, 500}, {250, 500}}) == 500);
  CHECK(common({{250, 500}, {250, 500}, {250}}) == 250);  // rank 2 stopped before writing step 500's
  CHECK(common({{250}, {250, 500}}) == 250);
  CHECK(common({{500}, {250}}) == -1);
  CHECK(common({{}, {250}}) == -1);
  std::filesystem::remove_all(root);
}

TEST_CASE("a traced step shows the reductions going out during the last micro-sequence's backward") {
#ifdef SPEEDRUN_EMULATED
  if (emu::lazy_streams()) {  // (SPEEDRUN_EMULATOR_STREAMS=lazy) each reduction runs when a wait asks for it
    std::printf("  lazy streams: the spans' times show when the waits ran the work, not the launch schedule: "
                "not checked\n");
    return;
  }
#endif
  // One rank: its communication stream does nothing but follow the backward's completion points,
  // so where each reduction starts shows the launch schedule without another rank's timing.
  Hyperparameters h = test_hyperparameters(kSteps, kMicro, kT);
  SingleRankCommunicator comm;
  RankTrainer t(h, comm, oracle_config());
  initialize_nonzero(t.model.config(), t.model.params, 3);
  Timeline timeline;
  t.model.set_timeline(&timeline);
  t.optimizers.set_timeline(&timeline);
  HostBatch host(token_stream().data(), kMicro, kT, 0);
  train_step(t.model, t.acts, t.optimizers, host.batch, 0, schedule_of(h), /*fp8_head=*/false, 0);
  const std::string path =
      (std::filesystem::temp_directory_path() / ("speedrun_timeline_" + std::to_string(getpid()) + ".json")).string();
  timeline.write_chrome_trace(path, 0);
  std::vector<double> block0 = span_starts(path, "backward block 0");
  std::vector<double> head_reduce = span_starts(path, "reduce lm_head.weight");
  std::vector<double> late_chunk = span_starts(path, "reduce blocks.10.mlp.c_fc.weight chunk");
  std::vector<double> value_embed_reduce = span_starts(path, "reduce value_embeds.2.weight");  // read by blocks 2 and 11
  std::vector<double> embed_reduce = span_starts(path, "reduce embed.weight");
  std::filesystem::remove(path);
  CHECK(block0.size() == size_t(kMicro) && head_reduce.size() == 1 && late_chunk.size() == 1 &&
        value_embed_reduce.size() == 1 && embed_reduce.size() == 1);
  if (block0.empty() || head_reduce.empty() || late_chunk.empty() || value_embed_reduce.empty() || embed_reduce.empty())
    return;
  std::printf("  last backward of block 0 starts at %.0f us; reductions: lm_head at %.0f us, blocks.10 c_fc at %.0f us, "
              "value_embeds.2 at %.0f us, embed at %.0f us\n",
              block0.back(), head_reduce[0], late_chunk[0], value_embed_reduce[0], embed_reduce[0]);
  CHECK(head_reduce[0] < late_chunk[0]);
  CHECK(late_chunk[0] < value_embed_reduce[0]);   // after block 2, its lowest reader
  CHECK(value_embed_reduce[0] < block0.back());  // hidden under the backward of blocks 1 and 0, like the chunk
  CHECK(embed_reduce[0] > block0.back());
}

int main(int argc, char** argv) { return run_gpu_checks(argc, argv); }
