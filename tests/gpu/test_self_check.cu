// The start-up self-check (kernels/self_check.cuh, train_gpt.cu's self_check_paths): with no
// fault every fast path passes; a wrong result in one fast path (kernels/host/faults.h) fails exactly
// that path's checks, `fallback` replaces exactly that path by the reference its flag selects, and
// `strict` stops with SelfCheckFailed (exit status 6) naming it; the trainer's step on every
// reference path trains as the fast paths do. On a GPU the record-shaped self-check runs too.
#include "gpu/model_fixture.h"
#include "injected_faults.h"

namespace {

using namespace fixture;

// Small problems: d = 128 (one head), vocabulary 512, four attention blocks (windows 1, 3 and 14
// still differ: 14 covers the whole sequence). Mostly the reference attention's warp sums, which
// the emulator is slowest at.
SelfCheckShape small_shape() {
  SelfCheckShape s{128, 1, 512};
  s.attention_tokens = 4 * kAttentionBlock;
  s.head_rows = 64;
  s.residual_rows = 128;
  return s;
}

// The flags that select each path's reference, as a user would give them.
Hyperparameters with_reference_flag(Hyperparameters h, bool KernelPaths::*path) {
  if (path == &KernelPaths::flash_attention) h.attention = "reference";
  if (path == &KernelPaths::fp8_head) h.bf16_head = true;
  if (path == &KernelPaths::fused_e5m2_gradient) h.fp8_gradient = "cast";
  if (path == &KernelPaths::batched_muon) h.muon = "per-matrix";
  if (path == &KernelPaths::fused_residual_add) h.residual_add = "separate";
  if (path == &KernelPaths::fused_mlp_fc) h.mlp_fc = "cublaslt";
  if (path == &KernelPaths::fused_qkv) h.qkv = "cublaslt";
  if (path == &KernelPaths::qkv_backward_in_attention) h.qkv_backward = "separate";
  return h;
}

// The flags a run gives to take every fast path: the defaults, and the opt-in ones asked for.
Hyperparameters with_every_fast_path() {
  Hyperparameters h;
  h.mlp_fc = "fused";
  h.qkv = "fused";
  h.qkv_backward = "fused";
  return h;
}

bool same_paths(const KernelPaths& a, const KernelPaths& b) {
  for (const FastPath& p : fast_paths())
    if (a.*p.member != b.*p.member) return false;
  return true;
}

SelfCheckOutcome self_check_with(const Hyperparameters& h, Fault fault, cudaStream_t stream = nullptr) {
  ScopedFault injected(fault);
  return self_check_paths(h, small_shape(), 511, nullptr, nullptr, stream);
}

// One micro-sequence's forward and backward on `paths` (the FP8 head on), in `stream`: the summed
// loss and every parameter's gradient. The activations hold u only where the paths use it, as a run's.
std::pair<double, std::vector<std::vector<double>>> gradients_on(const KernelPaths& paths, cudaStream_t stream = nullptr) {
  const int T = 256;
  DeviceMemory memory;
  GPT model(gpu_config(), memory);
  Activations acts(model.config(), T, /*backward=*/true, memory, /*fp8_head=*/true,
                   /*mlp_pre_activations=*/!paths.fused_mlp_fc);
  load_weights(reference_config(), model, 61);
  const std::vector<uint16_t> tokens = synthetic_tokens(T + 1, 1024, 1023, 1.0 / 90, 62);
  HostBatch host(tokens.data(), 1, T, 0);
  model.set_paths(paths);
  accumulate_gradients(model, acts, host.batch, /*window_blocks=*/2, /*fp8_head=*/true, stream);
  const double loss = take_loss_total(acts, stream);
  std::vector<std::vector<double>> grads;
  for (const Param& p : model.params.list) grads.push_back(download_grad(model.params, p));
  return {loss, grads};
}

// What the self-check's own process would report while `checks` run (its standard output, as
// report_each_group writes it, skipping the groups `done` names), read back as the trainer reads it.
template <class Checks>
self_check_process::Report reported_while(Checks&& checks, const std::string& done = "") {
  std::fflush(stdout);
  const int saved = dup(STDOUT_FILENO);
  std::FILE* captured = std::tmpfile();
  dup2(fileno(captured), STDOUT_FILENO);
  self_check_process::report_each_group(done);
  checks();
  self_check::check_listener() = {};
  std::fflush(stdout);
  dup2(saved, STDOUT_FILENO);
  close(saved);
  std::rewind(captured);
  std::vector<std::string> lines;
  for (char line[4096]; std::fgets(line, sizeof line, captured);) lines.emplace_back(line, std::strcspn(line, "\n"));
  std::fclose(captured);
  return self_check_process::read_report(lines);
}

// The results as the trainer read them from the report equal the results, to the bit.
void check_reported(const self_check_process::Report& report, const std::vector<SelfCheckResult>& results) {
  CHECK(report.unfinished.empty() && report.stopped.empty() && report.other_lines.empty());
  CHECK(report.results.size() == results.size());
  for (size_t i = 0; i < std::min(report.results.size(), results.size()); ++i) {
    const SelfCheckResult &read = report.results[i], &r = results[i];
    CHECK(read.name == r.name && read.path == r.path && read.bound == r.bound && read.failure == r.failure);
    CHECK(std::memcmp(&read.error, &r.error, sizeof r.error) == 0);
  }
}

}  // namespace

TEST_CASE("with no fault every fast path passes its self-check, and the run keeps every fast path") {
  // its checks as the self-check's own process runs them, reporting each group
  std::vector<SelfCheckResult> results;
  self_check_process::Report report;
  const PathChecks reporting = [&](const KernelPaths& paths) {
    report = reported_while([&] { results = checks_in_this_process(small_shape(), nullptr, 511, nullptr)(paths); });
    return results;
  };
  const SelfCheckOutcome outcome = self_check_paths(Hyperparameters{}, nullptr, reporting);
  for (const std::string& line : outcome.lines) std::printf("  %s\n", line.c_str());
  CHECK(!outcome.failed_here && outcome.failed_paths.empty());
  CHECK(same_paths(outcome.paths, KernelPaths{}));
  CHECK(outcome.lines.back().find("self-check: 11 checks, 0 failed") == 0);
  check_reported(report, results);
}

TEST_CASE("a wrong fast path fails its own checks only; fallback takes its reference flag's path, strict stops") {
  const Hyperparameters every = with_every_fast_path();
  for (const FastPath& path : fast_paths()) {
    const SelfCheckOutcome outcome = self_check_with(every, path.fault);
    int failed = 0, failed_elsewhere = 0;
    for (const std::string& line : outcome.lines) {
      const bool failed_line = line.size() > 6 && line.compare(line.size() - 6, 6, "FAILED") == 0;
      failed += failed_line;
      failed_elsewhere += failed_line && line.find(std::string("self-check ") + path.name) != 0;
    }
    std::printf("  %-26s %d checks failed; paths replaced: %s\n", fault_name(path.fault), failed,
                outcome.failed_paths.c_str());
    CHECK(failed > 0 && failed_elsewhere == 0);
    CHECK(outcome.failed_paths == path.name);
    CHECK(same_paths(outcome.paths, paths_of(with_reference_flag(every, path.member))));
    CHECK(outcome.lines.back() == std::string("self-check fallback: ") + path.name +
                                      " failed here; this run uses its reference (" + path.reference_flag +
                                      "): slower, and not a record run");
    Hyperparameters strict = every;  // the same outcome under --self-check strict
    strict.self_check = "strict";
    CHECK_THROWS_WITH(outcome.stop_if_strict(strict), "self-check failed: ", path.name);
  }
}

TEST_CASE("a path its flag replaced already is not checked: a failure there changes nothing") {
  const Hyperparameters h = with_reference_flag(Hyperparameters{}, &KernelPaths::fp8_head);  // --bf16-head
  const SelfCheckOutcome outcome = self_check_with(h, Fault::wrong_fp8_head);
  for (const std::string& line : outcome.lines)
    CHECK(line.find("FP8") == std::string::npos && line.find("e5m2") == std::string::npos);
  CHECK(outcome.failed_paths.empty());
  CHECK(outcome.lines.back().find("self-check: 7 checks, 0 failed") == 0);
  CHECK(same_paths(outcome.paths, paths_of(h)));
}

// --attention flash-ws: the self-check checks the warp-specialised forward the run uses; it passes
// with no fault, and a wrong flash attention there falls back to the reference as with the default.
TEST_CASE("--attention flash-ws: the self-check checks the warp-specialised forward; a wrong one falls back") {
  Hyperparameters h;
  h.attention = "flash-ws";
  const SelfCheckOutcome passed = self_check_with(h, Fault::none);
  CHECK(passed.failed_paths.empty());
  CHECK(passed.paths.warp_specialised_attention_forward);
  const SelfCheckOutcome failed = self_check_with(h, Fault::wrong_flash_attention);
  std::printf("  %s\n", failed.lines.back().c_str());
  CHECK(failed.failed_paths == "flash attention");
  CHECK(!failed.paths.flash_attention);
}

// The newest flash kernels failing where the earlier ones pass (the fused backward's cross-CTA dq
// order or the warp-specialised forward's TMA ring misread on new hardware, say): fallback takes the
// two-kernel flash path, checked first, not the reference attention; strict still stops.
TEST_CASE("wrong newest flash kernels: fallback takes the two-kernel flash path once it passes, not the reference") {
  // the emulator (CI) the default flash kernels only: each self-check here is a few emulated seconds
  const std::vector<const char*> attentions =
      testing_a_subset() ? std::vector<const char*>{"flash"} : std::vector<const char*>{"flash", "flash-ws"};
  for (const char* attention : attentions) {
    Hyperparameters h = with_every_fast_path();
    h.attention = attention;
    const SelfCheckOutcome outcome = self_check_with(h, Fault::wrong_newest_flash_kernels);
    for (const std::string& line : outcome.lines)
      if (line.find("flash attention") != std::string::npos) std::printf("  %s\n", line.c_str());
    CHECK(outcome.failed_paths == "flash attention");
    CHECK(outcome.paths.flash_attention && !outcome.paths.fused_attention_backward &&
          !outcome.paths.warp_specialised_attention_forward && !outcome.paths.qkv_backward_in_attention);
    Hyperparameters split = h;
    split.attention = "flash-split";
    split.qkv_backward = "separate";
    CHECK(same_paths(outcome.paths, paths_of(split)));
    CHECK(outcome.lines.back().find("self-check fallback: flash attention (its fused backward or warp-specialised "
                                    "forward) failed here; the two-kernel flash path passed") == 0);
    int split_checks = 0;
    for (const std::string& line : outcome.lines)
      split_checks += line.find("self-check flash attention (flash-split), window ") == 0 &&
                      line.compare(line.size() - 2, 2, "ok") == 0;
    CHECK(split_checks == 3);
    // the summary counts both rounds: every result line, the second round's named
    int result_lines = 0;
    std::string summary;
    for (const std::string& line : outcome.lines) {
      if (line.find("self-check: ") == 0) summary = line;
      else if (line.find("self-check fallback") != 0) ++result_lines;
    }
    CHECK(summary.find("self-check: " + std::to_string(result_lines) + " checks, ") == 0);
    CHECK(summary.find(" (3 of them after a fallback, below)") != std::string::npos);
    Hyperparameters strict = h;  // strict stops on the first failure, before any fallback
    strict.self_check = "strict";
    CHECK_THROWS_WITH(outcome.stop_if_strict(strict), "self-check failed: flash attention");
  }
  // with the two-kernel path asked for (or the reference), there is no earlier flash path to take
  Hyperparameters split;
  split.attention = "flash-split";
  CHECK(!has_earlier_flash_kernels(paths_of(split)));
  split.attention = "reference";
  CHECK(!has_earlier_flash_kernels(paths_of(split)));
}

TEST_CASE("a check that throws (a library refusing on new hardware) fails its path instead of ending the rank") {
  std::vector<SelfCheckResult> results;
  const self_check_process::Report report = reported_while([&] {
    self_check::add_results(results, {{"batched Muon 3x3", &KernelPaths::batched_muon, 1e-2}},
                            []() -> std::vector<double> { throw std::runtime_error("cuBLASLt has\tno algorithm"); });
  });
  CHECK(results.size() == 1 && !results[0].passed());
  std::printf("  %s\n", results[0].line().c_str());
  CHECK(results[0].line() == "self-check batched Muon 3x3: cuBLASLt has\tno algorithm FAILED");
  // its own process reports it on one line, the tab a space
  results[0].failure = "cuBLASLt has no algorithm";
  check_reported(report, results);
  // and where an earlier process ran the group, skips it
  std::vector<SelfCheckResult> none;
  const self_check_process::Report skipped = reported_while(
      [&] {
        self_check::add_results(none, {{"batched Muon 3x3", &KernelPaths::batched_muon, 1e-2}},
                                []() -> std::vector<double> { throw std::runtime_error("ran"); });
      },
      "FP8 head logits\tbatched Muon 3x3");
  CHECK(none.empty() && skipped.groups.empty() && skipped.results.empty());
}

TEST_CASE("--self-check off runs nothing and keeps the flags' paths") {
  Hyperparameters h = with_reference_flag(Hyperparameters{}, &KernelPaths::batched_muon);
  h.self_check = "off";
  const SelfCheckOutcome outcome = self_check_with(h, Fault::wrong_flash_attention);
  CHECK(outcome.lines.empty());
  CHECK(same_paths(outcome.paths, paths_of(h)));
}

TEST_CASE("the model on the reference paths (the FP8 head kept) gives the fast paths' loss and gradients") {
  // The bf16 head is another mathematics, trained and checked apart (test_model, test_training).
  KernelPaths references, fast;
  for (const FastPath& p : fast_paths()) references.*p.member = p.member == &KernelPaths::fp8_head;
  for (const FastPath& p : fast_paths()) fast.*p.member = true;  // the opt-in ones too
  const auto [fast_loss, fast_grads] = gradients_on(fast);
  const auto [reference_loss, reference_grads] = gradients_on(references);
  std::printf("  summed loss: fast paths %.6f, references %.6f\n", fast_loss, reference_loss);
  CHECK(std::fabs(fast_loss - reference_loss) <= 5e-3 * std::fabs(fast_loss));
  CHECK(reference_grads != fast_grads);  // the reference paths did run: they round differently
  const std::vector<Param> params = parameter_list(gpu_config());
  for (size_t p = 0; p < params.size(); ++p) {
    const double error = relative_error(reference_grads[p], fast_grads[p]);
    std::printf("  %-28s grad rel. error %.2e\n", params[p].name.c_str(), error);
    CHECK(error <= grad_bound_of(params[p], 2e-2));  // bf16 rounding apart, as test_training's M = 8 vs M = 1
  }
}

// --launch-overlap pdl (run_training sets it for the whole process): every kernel of kernels/ is
// launched with programmatic dependent launch and waits for the kernel before it as its first
// statement, so a step's results are stream order's bit for bit. On a GPU a kernel that read its
// predecessor's output before the wait could differ; the emulator stops a thread that touches
// memory before its wait or exits without one (test_checks), in every kernel these run.
TEST_CASE("--launch-overlap pdl: every fast path passes its self-check; the loss and gradients are bitwise stream order's") {
  KernelPaths fast;
  for (const FastPath& p : fast_paths()) fast.*p.member = true;  // the opt-in ones too
  struct Overlap {  // the trainer's setting under the flag: PDL, and the step on a created stream
    Overlap() { CUDA_CHECK(cudaStreamCreate(&stream)); }
    ~Overlap() {
      programmatic_dependent_launch = false;
      cudaStreamDestroy(stream);
    }
    cudaStream_t stream = nullptr;
  } overlap;
  const auto [ordered_loss, ordered_grads] = gradients_on(fast, overlap.stream);
  programmatic_dependent_launch = true;
  Hyperparameters h = with_every_fast_path();
  h.launch_overlap = "pdl";
  const SelfCheckOutcome outcome = self_check_with(h, Fault::none, overlap.stream);
  std::printf("  %s\n", outcome.lines.back().c_str());
  CHECK(outcome.failed_paths.empty());
  const auto [overlapped_loss, overlapped_grads] = gradients_on(fast, overlap.stream);
  std::printf("  summed loss: stream order %.9g, overlapped %.9g\n", ordered_loss, overlapped_loss);
  CHECK(overlapped_loss == ordered_loss);
  CHECK(overlapped_grads == ordered_grads);
}

TEST_CASE("activations without u (--mlp-fc fused) refuse the unfused MLP fc until u is allocated") {
  const int T = 256;
  DeviceMemory memory;
  GPT model(gpu_config(), memory);
  Activations train(model.config(), T, /*backward=*/true, memory, false, /*mlp_pre_activations=*/false),
      eval(model.config(), T, /*backward=*/false, memory, false, /*mlp_pre_activations=*/false);
  for (const Activations* acts : {&train, &eval})
    for (const LayerActivations& l : acts->layers) CHECK(l.u == nullptr);
  load_weights(reference_config(), model, 61);
  const std::vector<uint16_t> tokens = synthetic_tokens(T + 1, 1024, 1023, 1.0 / 90, 62);
  HostBatch host(tokens.data(), 1, T, 0);
  CHECK_THROWS_WITH(accumulate_gradients(model, train, host.batch, 2, false, 0), "activations built without u");
  for (Activations* acts : {&train, &eval}) acts->allocate_mlp_pre_activations(model.config(), memory);
  for (size_t i = 1; i < train.layers.size(); ++i) {
    CHECK(train.layers[i].u != nullptr && train.layers[i].u != train.layers[i - 1].u);  // kept for the backward
    CHECK(eval.layers[i].u == eval.layers[0].u);                                         // one u for evaluation
  }
}

TEST_CASE("the model's FP8 logits product takes the run's cuBLASLt candidate (--fp8-logits-algorithm)") {
  KernelPaths paths;
  paths.fp8_logits_candidate = Matmul::kMaxCandidates;  // refused by the product, wherever it runs
  CHECK_THROWS_WITH(gradients_on(paths), "matmul: candidate 16 is not in [0, 16)");
  // A run plans the product after the self-check: a candidate cuBLASLt lacks is a bad flag then
  // (the emulated heuristic offers 4; a GPU's may offer all 16, then candidate 15 plans)
  const int T = 256;
  DeviceMemory memory;
  GPT model(gpu_config(), memory);
  Activations acts(model.config(), T, /*backward=*/true, memory, /*fp8_head=*/true);
  for (int candidate : {0, Matmul::kMaxCandidates - 1}) {
    paths.fp8_logits_candidate = candidate;
    model.set_paths(paths);
    try {
      model.plan_fp8_head(acts, T);
      CHECK(!kEmulated || candidate < 4);
    } catch (const FlagError& e) {
      std::printf("  %s\n", e.what());
      CHECK(candidate > 0);
      CHECK(std::string(e.what()).find("--fp8-logits-algorithm 15: cuBLASLt offers ") == 0);
    }
  }
}

// The default paths, then every fast path (the opt-in ones too: their checks run at the record's
// shapes only here and in a run that asks for them).
TEST_CASE("the self-check at the record's shapes passes on this GPU") {
  if (!at_record_shapes("the record-shaped self-check")) return;
  const GPTConfig c;
  for (Hyperparameters strict : {Hyperparameters{}, with_every_fast_path()}) {
    strict.self_check = "strict";
    const SelfCheckOutcome outcome = self_check_paths(strict, self_check_shape(c), c.bos_token, nullptr, nullptr);
    for (const std::string& line : outcome.lines) std::printf("  %s\n", line.c_str());
    CHECK(outcome.failed_paths.empty());
  }
}

int main(int argc, char** argv) { return run_gpu_checks(argc, argv); }
