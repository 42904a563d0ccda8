// The trainer's host side, without a GPU: flags, the run log's lines (byte-equal to the
// reference's), checkpoints. train_gpt.cu is included whole, as the GPU tests of the trainer do.
#define TRAIN_GPT_NO_MAIN
#include "train_gpt.cu"

#include "check.h"
#include "reference/model.h"

#include <filesystem>
#include <iterator>
#include <sstream>

namespace {

// argv from words; argv[0] is the program.
struct Args {
  explicit Args(std::vector<std::string> words) : words_(std::move(words)) {
    words_.insert(words_.begin(), "train_gpt");
    for (std::string& w : words_) pointers_.push_back(w.data());
  }
  int argc() const { return int(pointers_.size()); }
  const std::vector<std::string>& words() const { return words_; }
  char** argv() { return pointers_.data(); }

 private:
  std::vector<std::string> words_;
  std::vector<char*> pointers_;
};

Hyperparameters parsed(std::vector<std::string> words) {
  Args args(std::move(words));
  Hyperparameters h;
  CHECK(parse_flags(args.argc(), args.argv(), h));
  return h;
}

void parse_only(std::vector<std::string> words) { parsed(std::move(words)); }

std::string temp_dir(const std::string& name) {
  std::string dir = (std::filesystem::temp_directory_path() / ("speedrun_" + name)).string();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

TEST_CASE("defaults are the 8xH100 record (SPEC 1.8)") {
  Hyperparameters h = parsed({});
  CHECK(h.num_iterations == 1770 && h.micro_batches == 8 && h.seq_len == 49152);
  CHECK(h.val_tokens == 10485760 && h.val_every == 125 && h.warmup_steps == 10);
  CHECK(h.adam_lr == 0.008 && h.muon_lr == 0.05 && h.head_lr_mul == 27.5 && h.embed_lr_mul == 75);
  CHECK(h.seed == 0 && !h.resume);
}

TEST_CASE("flags set their fields, as --flag value and --flag=value") {
  Hyperparameters h = parsed({"--num-iterations", "860", "--micro-batches=1", "--seed", "4503599627370495",
                              "--adam-eps=1e-8", "--resume", "--train-files", "a/*.bin", "--val-every=0"});
  CHECK(h.num_iterations == 860 && h.micro_batches == 1 && h.seed == (uint64_t(1) << 52) - 1);
  CHECK(h.adam_eps == 1e-8 && h.resume && h.train_files == "a/*.bin" && h.val_every == 0);
  Schedule s = schedule_of(h);
  CHECK(s.num_iterations == 860 && s.window_blocks(860) == 14 && s.lr_factor(860) == 0.1);
}

TEST_CASE("bad flags are errors that name the flag") {
  CHECK_THROWS_WITH(parse_only({"--num-iteration", "5"}), "unknown flag --num-iteration");
  CHECK_THROWS_WITH(parse_only({"--seq-len"}), "--seq-len needs a value");
  CHECK_THROWS_WITH(parse_only({"--seq-len", "12x"}), "--seq-len: '12x' is not a valid integer");
  CHECK_THROWS_WITH(parse_only({"--seq-len", "1000"}), "--seq-len = 1000: must be a positive multiple of 128");
  CHECK_THROWS_WITH(parse_only({"--micro-batches", "0"}), "--micro-batches = 0: must be positive");
  CHECK_THROWS_WITH(parse_only({"--adam-lr", "fast"}), "--adam-lr: 'fast' is not a valid number");
  CHECK_THROWS_WITH(parse_only({"--adam-beta1=1.5"}), "--adam-beta1 = 1.5: must be in (0, 1)");
  CHECK_THROWS_WITH(parse_only({"--seed", "-1"}), "--seed: '-1' is not a valid non-negative integer");
  CHECK_THROWS_WITH(parse_only({"--seed", "4503599627370496"}), "--seed = 4503599627370496: must be below 2^52");
  CHECK_THROWS_WITH(parse_only({"--resume=yes"}), "--resume takes no value");
  CHECK_THROWS_WITH(parse_only({"--resume", "yes"}), "unexpected argument 'yes': --resume takes no value (give it alone)");
  CHECK_THROWS_WITH(parse_only({"--resume", "--seed", "1", "yes"}), "unexpected argument 'yes' (flags start with --)");
  CHECK_THROWS_WITH(parse_only({"860"}), "unexpected argument '860'");
  CHECK_THROWS_WITH(parse_only({"--val-tokens", "1000000"}), "is not a multiple of --val-seq-len");
  CHECK_THROWS_WITH(parse_only({"--num-iterations", "99999999999"}),
                    "--num-iterations: '99999999999' is out of range (-2147483648 to 2147483647)");
  CHECK_THROWS_WITH(parse_only({"--seed", "18446744073709551616"}), "out of range (0 to 18446744073709551615)");
  CHECK_THROWS_WITH(parse_only({"--adam-eps", "1e400"}), "--adam-eps: '1e400' is out of range");
  CHECK_THROWS_WITH(parse_only({"--timeline-step", "11", "--num-iterations", "10"}),
                    "--timeline-step 11 is past the run's last step (--num-iterations 10)");
  parse_only({"--timeline-step", "10", "--num-iterations", "10"});
  CHECK_THROWS_WITH(parse_only({"--profile-step", "11", "--num-iterations", "10"}),
                    "--profile-step 11 is past the run's last step (--num-iterations 10)");
  parse_only({"--profile-step", "10", "--num-iterations", "10"});
  // values that no setting takes, a flag where a value belongs, settings of a feature that is off
  CHECK_THROWS_WITH(parse_only({"--adam-lr", "nan"}), "--adam-lr: 'nan' is not a finite number");
  CHECK_THROWS_WITH(parse_only({"--matrix-optimizer", "rekls", "--rekls-weight-decay", "inf"}),
                    "--rekls-weight-decay: 'inf' is not a finite number");
  CHECK_THROWS_WITH(parse_only({"--log-dir", "--seed", "3"}), "--log-dir needs a value, but the next word, --seed, is a flag");
  CHECK_THROWS_WITH(parse_only({"--log-dir", "--help"}), "--log-dir needs a value, but the next word, --help, is a flag");
  parse_only({"--log-dir=--odd-but-explicit"});
  CHECK_THROWS_WITH(parse_only({"--rekls-eigenbasis-every", "2"}),
                    "--rekls-eigenbasis-every has no effect without --matrix-optimizer rekls");
  parse_only({"--matrix-optimizer", "rekls", "--rekls-eigenbasis-every", "2"});
  CHECK_THROWS_WITH(parse_only({"--diloco-outer-lr", "0.5"}), "--diloco-outer-lr has no effect without --diloco-groups 2");
  CHECK_THROWS_WITH(parse_only({"--bf16-head", "--fp8-logits-algorithm", "1"}),
                    "--fp8-logits-algorithm has no effect with --bf16-head");
  CHECK_THROWS_WITH(parse_only({"--diloco-groups", "2", "--diloco-fragments", "4"}),
                    "--diloco-sync-every = 30: must be a positive multiple of --diloco-fragments");
  parse_only({"--diloco-groups", "2", "--diloco-fragments", "4", "--diloco-sync-every", "8"});
}

TEST_CASE("the fast paths' flags select their references; the self-check's modes") {
  KernelPaths fast = paths_of(parsed({}));
  for (const FastPath& p : fast_paths()) CHECK(fast.*p.member == !p.opt_in);  // opt-in paths only when asked
  CHECK(paths_of(parsed({"--mlp-fc", "fused"})).fused_mlp_fc);
  CHECK(paths_of(parsed({"--qkv", "fused"})).fused_qkv);
  // --qkv-backward fused: taken by the fused flash backward (flash, flash-ws), refused without it;
  // a self-check that replaced flash attention by its reference takes the pass again
  CHECK(!attention_takes_qkv_backward(fast));
  for (const char* attention : {"flash", "flash-ws"})
    CHECK(attention_takes_qkv_backward(paths_of(parsed({"--qkv-backward", "fused", "--attention", attention}))));
  for (const char* attention : {"flash-split", "reference"})
    CHECK_THROWS_WITH(parse_only({"--qkv-backward", "fused", "--attention", attention}),
                      "--qkv-backward fused needs the fused flash backward (--attention flash or flash-ws), not "
                      "--attention ");
  KernelPaths fell_back = paths_of(parsed({"--qkv-backward", "fused"}));
  fell_back.flash_attention = false;
  CHECK(!attention_takes_qkv_backward(fell_back));
  KernelPaths references = paths_of(parsed({"--attention", "reference", "--bf16-head", "--fp8-gradient=cast", "--muon",
                                            "per-matrix", "--residual-add", "separate", "--mlp-fc", "cublaslt", "--qkv",
                                            "cublaslt"}));
  for (const FastPath& p : fast_paths()) CHECK(!(references.*p.member));
  CHECK_THROWS_WITH(parse_only({"--mlp-fc", "cudnn"}), "--mlp-fc = cudnn: must be cublaslt or fused");
  CHECK(fast.fp8_logits_candidate == 0 && paths_of(parsed({"--fp8-logits-algorithm", "3"})).fp8_logits_candidate == 3);
  CHECK_THROWS_WITH(parse_only({"--fp8-logits-algorithm", "16"}), "--fp8-logits-algorithm = 16: must be in [0, 16)");
  CHECK(parsed({}).self_check == "fallback" && !parsed({}).self_check_only);
  CHECK(parsed({"--self-check", "strict", "--self-check-only"}).self_check_only);
  CHECK_THROWS_WITH(parse_only({"--self-check", "on"}), "--self-check = on: must be fallback, strict or off");
  CHECK_THROWS_WITH(parse_only({"--attention", "fast"}),
                    "--attention = fast: must be flash, flash-ws, flash-split or reference");
  // flash-split: the flash forward with the two-kernel backward instead of the fused one
  CHECK(fast.fused_attention_backward);
  KernelPaths split = paths_of(parsed({"--attention", "flash-split"}));
  CHECK(split.flash_attention && !split.fused_attention_backward);
  CHECK(attention_backward_of(split) == flash_attention_backward_split);
  CHECK(attention_backward_of(fast) == flash_attention_backward);
  CHECK(attention_backward_of(references) == attention_backward);
  // flash-ws: the warp-specialised TMA forward with the fused backward; the default forward otherwise
  KernelPaths ws = paths_of(parsed({"--attention", "flash-ws"}));
  CHECK(ws.flash_attention && ws.fused_attention_backward && ws.warp_specialised_attention_forward);
  CHECK(attention_forward_of(ws) == flash_attention_forward_ws);
  CHECK(attention_backward_of(ws) == flash_attention_backward);
  CHECK(attention_forward_of(fast) == flash_attention_forward);
  CHECK(attention_forward_of(split) == flash_attention_forward);
  CHECK(attention_forward_of(references) == attention_forward);
  CHECK_THROWS_WITH(parse_only({"--muon", "single"}), "--muon = single: must be batched or per-matrix");
  // Every fast path's reference flag, as the self-check's fallback line names it, is a flag here.
  for (const FastPath& p : fast_paths()) {
    std::istringstream words(p.reference_flag);
    std::vector<std::string> flag{std::istream_iterator<std::string>(words), {}};
    CHECK(!(paths_of(parsed(flag)).*p.member));
  }
}

TEST_CASE("--matmul-algorithms: each named product's cuBLASLt candidate, the rest the first; bad items named") {
  const MatmulAlgorithms first = paths_of(parsed({})).matmul_algorithms;
  CHECK(first.text() == "first" && parsed({}).matmul_algorithms == "first");
  const MatmulAlgorithms chosen = paths_of(parsed({"--matmul-algorithms", "mlp-fc.dw=2,qkv.dx=1,attn-proj.fwd=15"})).matmul_algorithms;
  CHECK(chosen.of(BlockLinear::mlp_fc, LinearProduct::dw) == 2 && chosen.of(BlockLinear::qkv, LinearProduct::dx) == 1 &&
        chosen.of(BlockLinear::attn_proj, LinearProduct::fwd) == 15);
  int named = 0;
  for (const auto& products : chosen.candidate)
    for (int c : products) named += c != 0;
  CHECK(named == 3);
  CHECK(chosen.text() == "qkv.dx=1,attn-proj.fwd=15,mlp-fc.dw=2");  // table order: what bench_kernels prints
  // the log and the checkpoints carry one spelling of each choice: the same choices pool (tools/records.py)
  CHECK(parsed({"--matmul-algorithms", "mlp-fc.dw=2,qkv.dx=1,attn-proj.fwd=15"}).matmul_algorithms == chosen.text());
  CHECK(parsed({"--matmul-algorithms", "qkv.fwd=0"}).matmul_algorithms == "first");
  CHECK_THROWS_WITH(parse_only({"--matmul-algorithms", "qkv.dx=1", "--matmul-algorithms", "mlp-fc.dw=2"}),
                    "--matmul-algorithms is given twice: join its items with commas");
  CHECK_THROWS_WITH(parse_only({"--matmul-algorithms", "first,qkv.dx=1"}), "'first' is the whole value");
  CHECK(MatmulAlgorithms::parse(chosen.text(), Matmul::kMaxCandidates).text() == chosen.text());
  CHECK(MatmulAlgorithms::parse("qkv.fwd=0", Matmul::kMaxCandidates).text() == "first");
  const std::pair<const char*, const char*> refused[] = {
      {"qkv.fwd=16", "'qkv.fwd=16': the candidate is an integer in [0, 16)"},
      {"qkv.fwd=-1", "the candidate is an integer in [0, 16)"},
      {"qkv.fwd=", "the candidate is an integer"},
      {"qkv.fwd=1x", "the candidate is an integer"},
      {"lm-head.fwd=1", "'lm-head.fwd=1': the linear is one of qkv, attn-proj, mlp-fc or mlp-proj"},
      {"qkv.dW=1", "'qkv.dW=1': the product is one of fwd, dx or dw"},
      {"qkv=1", "'qkv=1' is not linear.product=N"},
      {"qkv.fwd=1,", "'' is not linear.product=N"},
      {"", "'' is not linear.product=N"},
      {"mlp-fc.dw=1,mlp-fc.dw=2", "mlp-fc.dw is named twice"},
  };
  for (const auto& [value, message] : refused)
    CHECK_THROWS_WITH(parse_only({"--matmul-algorithms=" + std::string(value)}), "--matmul-algorithms ", message);
  // our GEMM makes these products with the fused paths: a cuBLASLt candidate for them would do nothing
  CHECK_THROWS_WITH(parse_only({"--qkv", "fused", "--matmul-algorithms", "qkv.fwd=1"}),
                    "--matmul-algorithms names qkv.fwd, which --qkv fused makes with our GEMM, not with cuBLASLt");
  for (const char* product : {"mlp-fc.fwd=1", "mlp-proj.dx=1"})
    CHECK_THROWS_WITH(parse_only({"--mlp-fc", "fused", "--matmul-algorithms", product}), "which --mlp-fc fused makes");
  CHECK(paths_of(parsed({"--mlp-fc", "fused", "--qkv", "fused", "--matmul-algorithms", "qkv.dx=1,mlp-proj.fwd=1"}))
            .matmul_algorithms.text() == "qkv.dx=1,mlp-proj.fwd=1");
}

TEST_CASE("--ranks-share-gpu: NCCL's host id and sockets set before NCCL starts; an allocation failure says why") {
  ProcessGroupEnv g;
  g.rank = 1;
  g.world_size = g.local_world_size = 2;
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) == cudaSuccess && gpus > 1) {  // a machine where each rank has its own
    CHECK_THROWS_WITH(share_one_gpu(g), "--ranks-share-gpu: this process sees", "leave the flag out");
    return;
  }
  share_one_gpu(g);
  CHECK(std::string(std::getenv("NCCL_HOSTID")).find("-rank1") != std::string::npos);
  CHECK(std::string(std::getenv("NCCL_SOCKET_IFNAME")) == "lo");
  CHECK(std::string(std::getenv("NCCL_IB_DISABLE")) == "1");
  CHECK_THROWS_WITH(device_alloc<float>("a test buffer", size_t(1) << 50), "cannot allocate a test buffer",
                    "; 2 ranks share this GPU (--ranks-share-gpu), each with a whole rank's buffers");
  out_of_memory_hint().clear();
  for (const char* name : {"NCCL_HOSTID", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_NVLS_ENABLE", "NCCL_MNNVL_ENABLE"})
    unsetenv(name);
}

TEST_CASE("a shard path where a flag should be: the shell expanded a glob, so quote it") {
  // --train-files data/sample/*.bin, unquoted: the flag takes the first file, the next is left over.
  CHECK_THROWS_WITH(parse_only({"--val-files", "data/sample/sample_train_000001.bin", "README.md"}),
                    "unexpected argument 'README.md'", "unquoted glob after --val-files",
                    "quote the pattern, e.g. --val-files 'data/fineweb10B/fineweb_val_*.bin'");
  CHECK_THROWS_WITH(parse_only({"a/shard_001.bin"}), "unexpected argument 'a/shard_001.bin'", "unquoted glob;",
                    "--train-files 'data/fineweb10B/fineweb_train_*.bin'");
  CHECK_THROWS_WITH(parse_only({"--seed", "5", "README.md"}), "unexpected argument 'README.md' (flags start with --)");
  try {
    parse_only({"--seed", "5", "README.md"});
  } catch (const FlagError& e) {
    CHECK(std::string(e.what()).find("glob") == std::string::npos);  // not after a glob flag, not a .bin
  }
}

TEST_CASE("--help lists every flag with its default") {
  Args args({"--num-iterations", "5", "--help"});
  Hyperparameters h;
  CHECK(!parse_flags(args.argc(), args.argv(), h));
  std::string text = usage("train_gpt");
  for (const Flag& f : flag_table(h)) CHECK(text.find("--" + f.name + " ") != std::string::npos);
  Hyperparameters defaults;
  for (const Flag& f : flag_table(defaults))  // whole, however long (a fixed buffer cut the longest once)
    CHECK(text.find(" " + f.help + " [" + flag_value_text(f) + "]\n") != std::string::npos);
  CHECK(text.find("[1770]") != std::string::npos && text.find("[0.008]") != std::string::npos);
  for (int status : {0, 1, 2, 3, 4, 5, 75}) CHECK(text.find("\n  " + std::to_string(status) + " ") != std::string::npos);
}

TEST_CASE("step lines are byte-equal to the reference's (shared/reference/record25_692f80e0_steps.txt)") {
  CHECK(validation_line(0, 1770, 10.8258, 0.02) == "step:0/1770 val_loss:10.8258 train_time:0ms step_avg:0.02ms");
  CHECK(train_step_line(1, 1770, 145.57) == "step:1/1770 train_time:146ms step_avg:145.57ms");
  CHECK(train_step_line(3, 1770, 246.48) == "step:3/1770 train_time:246ms step_avg:82.16ms");
  CHECK(validation_line(1770, 1770, 3.27941, 173789.0) ==
        "step:1770/1770 val_loss:3.2794 train_time:173789ms step_avg:98.19ms");
  CHECK(peak_memory_line(size_t(30000) << 20, size_t(31234) << 20) ==
        "peak memory allocated: 30000 MiB reserved: 31234 MiB");
}

TEST_CASE("the run log: source, rule, environment, rule, then lines") {
  std::string dir = temp_dir("runlog"), id = new_run_id();
  CHECK(id.size() == 36 && id[14] == '4');
  {
    RunLog log(dir, id);
    log.header("int main() {}", "GPU: none\n");
    log.line(train_step_line(1, 2, 10.0), false);
  }
  CHECK(read_file(dir + "/" + id + ".txt") ==
        "int main() {}\n" + kLogRule + "\nGPU: none\n" + kLogRule + "\nstep:1/2 train_time:10ms step_avg:10.00ms\n");
  CHECK(trainer_source().find("struct Hyperparameters") != std::string::npos);
}

// Runs a shell command; its exit status and output (stdout and stderr).
std::pair<int, std::string> shell(const std::string& command) {
  std::string out;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return {-1, "popen failed: " + command};
  char buffer[4096];
  while (size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) out.append(buffer, n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// A run log as the trainer writes it: its source and environment, this run's settings, three steps.
std::string write_run_log(const std::string& dir, const std::vector<std::string>& words, double final_loss) {
  Args args(words);
  Hyperparameters h;
  CHECK(parse_flags(args.argc(), args.argv(), h));
  RunLog log(dir, new_run_id());
  log.header(trainer_source(), "gpu: a test's\n" + run_settings_report(h, ProcessGroupEnv{}, command_line(args.words()),
                                                                         check_data(h)));
  log.line(validation_line(0, 3, 10.8, 0.0), false);
  for (int step = 1; step <= 3; ++step) log.line(train_step_line(step, 3, 100.0 * step + final_loss), false);
  log.line(validation_line(3, 3, final_loss, 300.0), false);
  return log.path();
}

TEST_CASE("the log's head says what made the run; tools/records.py reads it back and pools only equal settings") {
  const std::vector<std::string> sample = {"--train-files", "data/sample/sample_train_*.bin", "--val-files",
                                           "data/sample/sample_val_*.bin", "--seq-len", "16384", "--micro-batches",
                                           "1", "--num-iterations", "3", "--val-tokens", "65536", "--val-seq-len",
                                           "65536", "--warmup-steps", "0"};
  Args args(sample);
  Hyperparameters h;
  CHECK(parse_flags(args.argc(), args.argv(), h));
  ProcessGroupEnv g;
  g.world_size = g.local_world_size = 2;
  g.launcher = "torchrun";
  const std::string report = run_settings_report(h, g, command_line(args.words()), check_data(h));
  CHECK(report.rfind("command: train_gpt --train-files 'data/sample/sample_train_*.bin' --val-files "
                     "'data/sample/sample_val_*.bin' --seq-len 16384 --micro-batches 1 --num-iterations 3",
                     0) == 0);
  // built by CMake: from this checkout, or from a tree that is none (a tarball, git absent or refusing)
  CHECK(report.find("\nbuild: commit ") != std::string::npos ||
        report.find("\nbuild: not from a git checkout\n") != std::string::npos);
  CHECK(report.find("\nranks: world size 2, ranks per node 2, launcher torchrun\n") != std::string::npos);
  CHECK(report.find("\nsetting: num-iterations=3\n") != std::string::npos);
  CHECK(report.find("\nsetting: matrix-optimizer=muon\n") != std::string::npos);  // a default, written too
  std::istringstream lines(report);
  int settings = 0, shards = 0;
  for (std::string line; std::getline(lines, line);) {
    settings += line.rfind("setting: ", 0) == 0;
    if (line.rfind("shard: ", 0) == 0) {
      ++shards;
      CHECK(line.find(" bytes, token hash ") == line.size() - 35);  // then 16 hexadecimal digits
    }
  }
  CHECK(settings == int(flag_table(h).size()));  // every flag
  CHECK(shards == 2);
  CHECK(report.find("shard: train-files data/sample/sample_train_000001.bin 2801024 bytes, token hash ") !=
        std::string::npos);
  CHECK(command_line({"a", "it's"}) == "a 'it'\\''s'");

  const std::string dir = temp_dir("settings_logs");
  std::vector<std::string> seeded = sample, rekls = sample;
  seeded.insert(seeded.end(), {"--seed", "7"});
  rekls.insert(rekls.end(), {"--matrix-optimizer", "rekls"});
  const std::string a = write_run_log(dir, sample, 7.25), b = write_run_log(dir, seeded, 7.5),
                    c = write_run_log(dir, rekls, 7.75);
  const auto pooled = shell("python3 tools/records.py stats " + a + " " + b + " --target 8");
  CHECK(pooled.first == 0);
  CHECK(pooled.second.find("| 2 | 3 | 7.37500 |") != std::string::npos);
  CHECK(pooled.second.find("note:") == std::string::npos);
  const auto refused = shell("python3 tools/records.py stats " + a + " " + c + " --target 8");
  CHECK(refused.first == 1);
  CHECK(refused.second.find("error: runs that differ pool into nothing: --matrix-optimizer: muon in ") != std::string::npos);
  // The source this log carries is the trainer's: frozen from the log, it is today's frozen trainer.
  const auto frozen = shell("python3 tools/records.py freeze from-log --date 2025-01-02 --target 8 --records-dir " + dir +
                            "/records --from-log " + a + " " + b + " && python3 tools/records.py inline " + dir +
                            "/inline.cu && python3 -c 'import sys; sys.path.insert(0, \"tools\"); import records; "
                            "a, b = (records.body_of_frozen(open(p).read()) for p in sys.argv[1:]); "
                            "sys.exit(0 if a == b and a else 1)' " + dir + "/records/2025-01-02_from-log/train_gpt.cu " +
                            dir + "/inline.cu");
  CHECK(frozen.first == 0);
}

TEST_CASE("checkpoints round-trip, replace atomically and name the newest") {
  std::string dir = temp_dir("checkpoints");
  CHECK(newest_checkpoint(dir).empty());
  Checkpoint c;
  c.step = 125;
  c.blobs = {{"params", {1, 2, 3, 4}}, {"empty", {}}, {"adam", std::vector<uint8_t>(1000, 7)}};
  write_checkpoint(dir, c);
  c.step = 250;
  write_checkpoint(dir, c);
  write_checkpoint(dir, c);  // the same step again replaces the file
  std::ofstream(dir + "/step_000999.ckpt.tmp") << "interrupted write";
  CHECK(newest_checkpoint(dir) == checkpoint_path(dir, 250));
  Checkpoint back = read_checkpoint(newest_checkpoint(dir));
  CHECK(back.step == 250 && back.blobs == c.blobs);
  CHECK(back.blob("adam", "x") == std::vector<uint8_t>(1000, 7));
  CHECK_THROWS_WITH(back.blob("muon", "some.ckpt"), "some.ckpt: no 'muon' in the checkpoint");
  CHECK(!std::filesystem::exists(checkpoint_path(dir, 250) + ".tmp"));
}

TEST_CASE("a checkpoint that cannot be written is a CheckpointError naming the file, with no temporary file left") {
  std::string dir = temp_dir("unwritable_checkpoints");
  Checkpoint c;
  c.step = 7;
  c.blobs = {{"params", {1, 2, 3}}};
  const std::string path = checkpoint_path(dir, 7);
  std::filesystem::create_directories(path + "/in-the-way");  // the name is a folder that is not empty
  bool a_checkpoint_error = false;
  try {
    write_checkpoint(dir, c);
  } catch (const CheckpointError& e) {
    const std::string what = e.what();  // the rename's own reason, not the cleanup's
    a_checkpoint_error = what.find(path + ": cannot rename ") == 0 && what.find("Success") == std::string::npos &&
                         what.find("directory") != std::string::npos;
  }
  CHECK(a_checkpoint_error);
  CHECK(!std::filesystem::exists(path + ".tmp"));
  std::ofstream(dir + "/a-file") << "not a folder";
  CHECK_THROWS_WITH(write_checkpoint(dir + "/a-file/checkpoints", c), "a-file/checkpoints: cannot create the checkpoint folder");
}

TEST_CASE("damaged checkpoints are errors that name the file") {
  std::string dir = temp_dir("bad_checkpoints");
  Checkpoint c;
  c.step = 3;
  c.blobs = {{"params", std::vector<uint8_t>(64, 1)}};
  write_checkpoint(dir, c);
  std::string path = checkpoint_path(dir, 3), bytes = read_file(path);
  std::ofstream(path, std::ios::binary) << bytes.substr(0, bytes.size() - 10);
  CHECK_THROWS_WITH(read_checkpoint(path), path.c_str(), ": truncated checkpoint (while reading params)");
  std::ofstream(path, std::ios::binary) << "NOTACKPT" << bytes.substr(8);
  CHECK_THROWS_WITH(read_checkpoint(path), path.c_str(), ": not a checkpoint (bad magic)");
  std::ofstream(path, std::ios::binary) << bytes << "x";
  CHECK_THROWS_WITH(read_checkpoint(path), path.c_str(), ": trailing bytes after the last blob");
  CHECK_THROWS_WITH(read_checkpoint(dir + "/missing.ckpt"), "missing.ckpt: cannot open the checkpoint");
  std::string flipped = bytes;
  flipped[flipped.size() - 20] ^= 1;  // one bit of the payload
  std::ofstream(path, std::ios::binary) << flipped;
  CHECK_THROWS_WITH(read_checkpoint(path), path.c_str(), ": 'params' is damaged (its hash differs)");
}

// tests/data/checkpoint/tiny.ckpt is written by tests/checkpoint_files.py, the Python side that
// tools/compare_checkpoints.py is tested with: it must read here (format and hashes agree), name
// its parameters as parameter_layout does, and be what write_checkpoint writes, byte for byte.
TEST_CASE("a checkpoint written by the comparison tool's tests is one this trainer writes") {
  const std::string tiny = "tests/data/checkpoint/tiny.ckpt";
  const Checkpoint c = read_checkpoint(tiny);
  const std::vector<Param> list{{"embed.weight", {3, 2}, ParamKind::embed, -1, 6, 0},
                                {"lm_head.weight", {3, 2}, ParamKind::lm_head, -1, 6, 0},
                                {"scalars", {2}, ParamKind::scalars, -1, 2, 6}};
  const std::string layout = parameter_layout(list);
  CHECK(c.step == 4 && c.blob(kParameterLayoutBlob, tiny) == std::vector<uint8_t>(layout.begin(), layout.end()));
  CHECK(c.blob(kEmbeddingsBlob, tiny).size() == 6 * sizeof(bf16) && c.blob(kMastersBlob, tiny).size() == 8 * sizeof(float));
  const std::string dir = temp_dir("tiny_checkpoint");
  write_checkpoint(dir, c);
  CHECK(read_file(checkpoint_path(dir, 4)) == read_file(tiny));
}

TEST_CASE("the newest checkpoint is the highest step number; other names are ignored") {
  std::string dir = temp_dir("numbered_checkpoints");
  Checkpoint c;
  for (int step : {99, 1000000, 125}) {
    c.step = step;
    write_checkpoint(dir, c);
  }
  for (const char* other : {"step_abc.ckpt", "step_.ckpt", "step_9999999999.ckpt", "step_2000000.ckpt.tmp", "x.ckpt"})
    std::ofstream(dir + "/" + other) << "not a checkpoint";
  CHECK(newest_checkpoint(dir) == checkpoint_path(dir, 1000000));
}

TEST_CASE("the checkpoint folder is created and tried at the start; an unwritable one is named") {
  std::string dir = temp_dir("writable") + "/a/b";
  check_writable(dir, "checkpoints");
  CHECK(std::filesystem::is_directory(dir) && std::filesystem::is_empty(dir));
  CHECK_THROWS_WITH(check_writable("/proc/no_such_folder", "checkpoints"),
                    "/proc/no_such_folder: cannot write checkpoints there");
}

TEST_CASE("--resume reads and verifies this rank's newest checkpoint (before the GPU)") {
  Hyperparameters h;
  h.resume = true;
  h.checkpoint_dir = temp_dir("resume_point");
  const ProcessGroupEnv alone;
  ProcessGroupEnv second_of_two;
  second_of_two.rank = 1, second_of_two.world_size = 2;
  const std::string none = "--resume: no checkpoint in " + h.checkpoint_dir;
  CHECK_THROWS_WITH(checkpoint_to_resume(h, alone), none.c_str());
  // A checkpoint of a small model: its parameters' layout and blobs, the run's flags.
  GPTConfig tiny;
  tiny.model_dim = 128, tiny.num_heads = 1, tiny.vocab_size = 128;
  size_t embeddings = 0, masters = 0;
  for (const Param& p : parameter_list(tiny)) (p.is_embedding() ? embeddings : masters) += size_t(p.numel);
  Checkpoint c;
  c.step = 7;
  const std::string flags = resume_flags(h, 1), layout = parameter_layout(parameter_list(tiny));
  c.blobs = {{kEmbeddingsBlob, std::vector<uint8_t>(embeddings * sizeof(bf16), 1)},
             {kMastersBlob, std::vector<uint8_t>(masters * sizeof(float), 2)},
             {kRunFlagsBlob, std::vector<uint8_t>(flags.begin(), flags.end())},
             {kParameterLayoutBlob, std::vector<uint8_t>(layout.begin(), layout.end())}};
  write_checkpoint(h.checkpoint_dir, c);
  std::optional<ResumePoint> point = checkpoint_to_resume(h, alone, tiny);
  CHECK(point && point->checkpoint.blobs == c.blobs && point->differences.empty() &&
        point->path == checkpoint_path(h.checkpoint_dir, 7));
  // The kernel flags a resume may change, named in its log line (records.py pools no such run); an
  // older trainer's checkpoint does not record them.
  CHECK(kernel_flag_differences(point->checkpoint, h) == "not recorded (a checkpoint of an older trainer)");
  const std::string kernels = kernel_flags(h);
  CHECK(std::count(kernels.begin(), kernels.end(), '\n') == 9);  // every name of kernel_flags is a flag
  Checkpoint with_kernels = c;
  with_kernels.blobs.push_back({kKernelFlagsBlob, std::vector<uint8_t>(kernels.begin(), kernels.end())});
  CHECK(kernel_flag_differences(with_kernels, h).empty());
  Hyperparameters other_kernels = h;
  other_kernels.matmul_algorithms = "qkv.dx=1";
  other_kernels.attention = "flash-split";
  CHECK(kernel_flag_differences(with_kernels, other_kernels) ==
        "--attention was flash, is flash-split; --matmul-algorithms was first, is qkv.dx=1");
  // A checkpoint records the kernels its run used: a self-check fallback's, not the flags' (flags_of_paths
  // inverts paths_of), so that a resume on the same flags that takes the fast kernels names the change.
  for (const char* attention : {"flash", "flash-ws", "flash-split", "reference"}) {
    Hyperparameters asked = h;
    asked.attention = attention;
    CHECK(flags_of_paths(h, paths_of(asked)).attention == attention);
  }
  KernelPaths fell_back = paths_of(h);
  fell_back.fused_attention_backward = false;
  fell_back.fp8_head = false;
  const Hyperparameters ran = flags_of_paths(h, fell_back);
  CHECK(ran.attention == "flash-split" && ran.bf16_head && ran.fp8_logits_algorithm == 0);
  CHECK(kernel_flags(flags_of_paths(h, paths_of(h))) == kernels);  // the flags' own paths: the flags
  write_checkpoint(h.checkpoint_dir, c);
  h.seq_len = 16384;
  CHECK_THROWS_WITH(checkpoint_to_resume(h, alone, tiny),
                    "written by a run with other settings: --seq-len was 49152, is 16384",
                    "--resume-other-settings resumes anyway");
  h.resume_other_settings = true;
  CHECK(checkpoint_to_resume(h, alone, tiny)->differences == "--seq-len was 49152, is 16384");
  h.num_iterations = 5;
  CHECK_THROWS_WITH(checkpoint_to_resume(h, alone, tiny), "step_000007.ckpt: step 7 is past --num-iterations 5");
  h.resume = false;
  CHECK(!checkpoint_to_resume(h, alone, tiny));
}

TEST_CASE("a resumed run must have the checkpoint's training settings; each difference is named") {
  Hyperparameters h;
  const std::string saved = resume_flags(h, 8);
  CHECK(resume_flag_differences(saved, resume_flags(h, 8)).empty());
  Hyperparameters other = h;
  other.seq_len = 16384;
  other.adam_lr = 0.008000000000000002;  // one double ulp: the flags are kept exactly
  other.val_every = 10;                  // validation and logging settings may change
  other.checkpoint_every = 5;
  CHECK(resume_flag_differences(saved, resume_flags(other, 4)) ==
        "--world-size was 8, is 4; --seq-len was 49152, is 16384; --adam-lr was 0.008, is 0.008000000000000002");
  // DiLoCo's settings count where it is on; without it a checkpoint's flags read as before DiLoCo
  CHECK(saved.find("diloco") == std::string::npos);
  Hyperparameters diloco = h;
  diloco.diloco_groups = 2;
  // a flag the checkpoint does not record had its default: only real differences are named
  CHECK(resume_flag_differences(saved, resume_flags(diloco, 8)) == "--diloco-groups was 1 (default), is 2");
  diloco.diloco_fragments = 4;
  CHECK(resume_flag_differences(saved, resume_flags(diloco, 8)) ==
        "--diloco-groups was 1 (default), is 2; --diloco-fragments was 3 (default), is 4");
  // REKLS's settings are recorded where it is on only: a Muon run's checkpoint reads as before.
  Hyperparameters rekls = h;
  rekls.matrix_optimizer = "rekls";
  CHECK(saved.find("rekls") == std::string::npos);
  CHECK(resume_flag_differences(saved, resume_flags(rekls, 8)) == "--matrix-optimizer was muon (default), is rekls");
  CHECK(resume_flag_differences(resume_flags(rekls, 8), saved) == "--matrix-optimizer was rekls, is muon (default)");
  rekls.rekls_lr = 0.01;
  CHECK(resume_flag_differences(resume_flags(rekls, 8), resume_flags(h, 8)) ==
        "--matrix-optimizer was rekls, is muon (default); --rekls-lr was 0.01, is 0.005 (default)");
  // Data globs are compared by the files they match: run.sh's absolute path is the same data.
  Hyperparameters relative = h, absolute = h, other_data = h;
  relative.train_files = "data/sample/sample_train_*.bin";
  absolute.train_files = (std::filesystem::current_path() / "data/sample/sample_train_*.bin").string();
  other_data.train_files = "data/sample/sample_val_*.bin";
  CHECK(resume_flag_differences(resume_flags(relative, 8), resume_flags(absolute, 8), same_shard_files).empty());
  CHECK(resume_flag_differences(resume_flags(relative, 8), resume_flags(other_data, 8), same_shard_files) ==
        "--train-files was data/sample/sample_train_*.bin, is data/sample/sample_val_*.bin");
}

int main() { return check::run_checks(); }

TEST_CASE("the trainer's parameters are the reference's, in its order: 275,742,784 for the record") {
  std::vector<Param> list = parameter_list(GPTConfig{});
  std::vector<ParamSpec> specs = param_specs(ModelConfig::record());
  CHECK(list.size() == specs.size());
  int64_t total = 0, embeddings = 0;
  for (size_t i = 0; i < std::min(list.size(), specs.size()); ++i) {
    CHECK(list[i].name == specs[i].name);
    CHECK(list[i].shape == specs[i].shape);
    CHECK(list[i].numel == specs[i].numel());
    total += list[i].numel;
    embeddings += list[i].is_embedding() ? list[i].numel : 0;
  }
  CHECK(total == 275742784);
  CHECK(embeddings == 154533888);
  // Storage: no overlap, no gap, each Muon shape group contiguous in the master store.
  size_t master_end = 0;
  for (ParamKind kind : {ParamKind::qkv, ParamKind::attn_proj, ParamKind::mlp_fc, ParamKind::mlp_proj,
                         ParamKind::lm_head, ParamKind::scalars})
    for (const Param& p : list)
      if (p.kind == kind) {
        CHECK(p.offset == master_end);
        master_end += size_t(p.numel);
      }
  CHECK(int64_t(master_end) == total - embeddings);
}

TEST_CASE("the log's parameter lines and counts; the console line adds loss, tokens/s, MFU and ETA") {
  std::string dir = temp_dir("paramlines"), id = new_run_id();
  std::vector<Param> params = parameter_list(GPTConfig{});
  {
    RunLog log(dir, id);
    log_parameters(log, Hyperparameters{}, params);
  }
  std::string text = read_file(dir + "/" + id + ".txt");
  CHECK(text.find("embed.weight: [50304, 768] bfloat16 wd_mul=0.0 lr_mul=75\n") == 0);
  CHECK(text.find("blocks.0.attn.qkv_w: [3, 768, 768] float32 wd_mul=0.0 lr_mul=1\n") != std::string::npos);
  CHECK(text.find("lm_head.weight: [50304, 768] float32 wd_mul=0.0 lr_mul=27.5\n") != std::string::npos);
  CHECK(text.find("scalars: [64] float32 wd_mul=0.0 lr_mul=5\n") != std::string::npos);
  CHECK(text.find("parameters: 275742784 total, 154533888 embedding, 121208896 non-embedding\n") != std::string::npos);
  // 6 x (82,575,360 hidden + 38,633,472 head) matmul FLOPs per token
  CHECK(training_flops_per_token(params) == 6.0 * 121208832);
  CHECK(console_step_line("step:5/10 train_time:500ms step_avg:100.00ms", 4.25, 100.0, 49152, 6e8, 5) ==
        "step:5/10 train_time:500ms step_avg:100.00ms loss:4.2500 tok/s:491520 mfu:29.8% eta:0.0min");
}

TEST_CASE("the optimizers' plan: DistAdam on the embeddings, head and scalars; Muon's four shape groups") {
  ShardPlan plan = shard_plan_of(parameter_list(GPTConfig{}), 8);
  CHECK(plan.adam.size() == 6);  // embed, 3 value embeddings, lm_head, scalars
  CHECK(plan.muon.size() == 4);
  std::vector<size_t> members;
  for (const MuonGroup& g : plan.muon) members.push_back(g.params.size());
  CHECK(members == (std::vector<size_t>{11, 11, 12, 12}));
  CHECK(plan.adam.back().rows_per_rank == 8);  // the 64 scalars over 8 ranks
}

// The self-check's processes (kernels/self_check_process.cuh), played by a script that reports
// the flash attention and FP8 head checks, its fused backward's window-3 check doing what `mode` says.
std::vector<SelfCheckResult> checked_by_script(const std::string& mode, const KernelPaths& paths = KernelPaths{},
                                               double seconds = 2) {
  return self_check_process::check_in_processes("/bin/bash", {"bash", "tests/cli/fake_self_check_process.sh", mode},
                                                paths, seconds);
}

TEST_CASE("the self-check's processes: the paths they are told and the lines they report read back") {
  using namespace self_check_process;
  KernelPaths p;
  p.fp8_head = false;
  p.fused_qkv = true;
  const KernelPaths back = with_switches(KernelPaths{}, switches_text(p));
  for (const auto& [name, member] : switches()) CHECK(back.*member == p.*member);
  CHECK_THROWS_WITH(with_switches(KernelPaths{}, "flash_attention=1"), "SPEEDRUN_SELF_CHECK_PATHS",
                    "no fused_attention_backward=");

  Report r = read_report({"@group\t2", "@spec\tFP8 head\t0x1p-7\tFP8 head logits",
                          "@spec\tfused e5m2 gradient\t0x1p-10\tfused e5m2 gradient", "a line of its own",
                          "@stopped\tunspecified launch failure"});
  CHECK(r.results.empty() && !r.done);
  CHECK(r.unfinished.size() == 2 && r.unfinished[1].path == &KernelPaths::fused_e5m2_gradient);
  CHECK(r.unfinished[0].name == "FP8 head logits" && r.unfinished[0].bound == 0x1p-7);
  CHECK(r.stopped == "unspecified launch failure");
  CHECK(r.other_lines == std::vector<std::string>{"a line of its own"});
  r = read_report({"@group\t1", "@spec\tbatched Muon\t0x1p-7\tbatched Muon 768x768",
                   "@result\tbatched Muon\tinf\t0x1p-7\tbatched Muon 768x768\tcuBLASLt refused", "@done"});
  CHECK(r.unfinished.empty() && r.done && r.results.size() == 1);
  CHECK(r.results[0].path == &KernelPaths::batched_muon && std::isinf(r.results[0].error));
  CHECK(r.results[0].line() == "self-check batched Muon 768x768: cuBLASLt refused FAILED");
  CHECK_THROWS_WITH(read_report({"@result\tFP8 head\t1"}), "malformed line");
  CHECK_THROWS_WITH(read_report({"@group\t1", "@spec\tno such path\t1\tx"}), "no fast path named 'no such path'");
  CHECK_THROWS_WITH(read_report({"@spec\tFP8 head\t1\tx"}), "a check outside a group");
  CHECK_THROWS_WITH(read_report({"@group\t1", "@spec\tFP8 head\t1\tx", "@result\tFP8 head\t0\t1\ty\t"}),
                    "a result of no check started");
  // a group's results as they came, the rest of it unfinished
  r = read_report({"@group\t2", "@spec\tFP8 head\t0x1p-7\tFP8 head logits", "@spec\tFP8 head\t0x1p-7\tFP8 head dx",
                   "@result\tFP8 head\t0x1p-9\t0x1p-7\tFP8 head logits\t"});
  CHECK(r.results.size() == 1 && r.unfinished.size() == 1 && r.unfinished[0].name == "FP8 head dx");
  CHECK(r.groups == std::vector<std::string>{"FP8 head logits"});
}

TEST_CASE("the self-check's processes: a check that hangs, stops the GPU or ends its process fails; the rest go on") {
  setenv("CUDA_INJECTION64_PATH", "build/libkernel_profile.so", 1);  // not passed on: the run's profile is the run's
  const std::vector<SelfCheckResult> passed = checked_by_script("pass");
  unsetenv("CUDA_INJECTION64_PATH");
  CHECK(passed.size() == 4);  // flash attention at 3 windows, the FP8 head
  for (const SelfCheckResult& r : passed) CHECK(r.passed() && r.failure.empty());
  CHECK(passed[3].name == "FP8 head logits" && passed[3].error == 0x1p-9);

  const auto start = std::chrono::steady_clock::now();
  for (const auto& [mode, failure] : std::vector<std::pair<std::string, std::string>>{
           {"hang", "hung: no result in 1 s (its process was ended)"},
           {"stop", "stopped the GPU (an illegal memory access was encountered): its process ended"},
           {"die", "its process ended (signal 9 (Killed))"}}) {
    const std::vector<SelfCheckResult> results = checked_by_script(mode, KernelPaths{}, 1);
    // window 1 passed, window 3 failed; the next process had flash attention off: the FP8 head
    CHECK(results.size() == 3);
    CHECK(results[0].name == "flash attention, window 1" && results[0].passed());
    CHECK(results[1].name == "flash attention, window 3" && !results[1].passed());
    CHECK(results[1].line() == "self-check flash attention, window 3: " + failure + " FAILED");
    CHECK(results[2].name == "FP8 head logits" && results[2].passed());
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20));  // the hang cost its 1 s, not 60

  KernelPaths no_flash;
  no_flash.flash_attention = false;
  CHECK(checked_by_script("hang", no_flash).size() == 1);  // nothing hangs where the path is off

  // A hang after flash attention's checks: the next process runs the checks after it, flash
  // attention's not again, the qkv backward (which runs only with flash attention on) still.
  KernelPaths with_qkv_backward;
  with_qkv_backward.qkv_backward_in_attention = true;
  const std::vector<SelfCheckResult> after_fp8 = checked_by_script("hang-fp8", with_qkv_backward, 1);
  std::vector<std::string> names;
  for (const SelfCheckResult& r : after_fp8) names.push_back(r.name + (r.passed() ? "" : ": FAILED"));
  CHECK(names == (std::vector<std::string>{"flash attention, window 1", "flash attention, window 3",
                                           "flash attention, window 14", "FP8 head logits: FAILED",
                                           "qkv backward in attention, window 14"}));
  CHECK_THROWS_WITH(checked_by_script("early"), "the self-check's process ended (exit 4)", "outside its checks");
  // an end that went wrong after every check keeps the results; a last line cut off is no line
  CHECK(checked_by_script("fail-after-done").size() == 4);
  CHECK_THROWS_WITH(checked_by_script("cut-off"), "the self-check's process ended (exit 0)", "outside its checks");
}

TEST_CASE("a fused backward that hangs in its own process: fallback takes the two-kernel flash path, strict stops") {
  Hyperparameters h;
  const PathChecks script = [](const KernelPaths& paths) { return checked_by_script("hang", paths, 1); };
  const SelfCheckOutcome outcome = self_check_paths(h, nullptr, script);
  CHECK(outcome.failed_here && outcome.failed_paths == "flash attention");
  CHECK(outcome.paths.flash_attention && !outcome.paths.fused_attention_backward && outcome.paths.fp8_head);
  const std::string report = outcome.report();
  CHECK(report.find("self-check flash attention, window 3: hung: no result in 1 s") != std::string::npos);
  CHECK(report.find("self-check: 6 checks, 1 failed, ") != std::string::npos);
  CHECK(report.find("(3 of them after a fallback, below)") != std::string::npos);
  CHECK(report.find("self-check flash attention (flash-split), window 14: rel. error 1.95e-03 (bound 1e-02) ok") !=
        std::string::npos);
  CHECK(report.find("self-check fallback: flash attention (its fused backward or warp-specialised forward) failed "
                    "here; the two-kernel flash path passed") != std::string::npos);

  h.self_check = "strict";
  const SelfCheckOutcome strict = self_check_paths(h, nullptr, script);
  CHECK_THROWS_WITH(strict.stop_if_strict(h), "self-check failed: flash attention");
}

TEST_CASE("a self-check process ends with its parent, and refuses to run for anything else") {
  // end_with_parent in a child whose variable holds `value`: 0 where it returns, 3 where it throws
  auto in_child = [](const std::string* value) {
    const pid_t pid = fork();
    if (pid == 0) {
      if (value) setenv("TEST_PARENT", value->c_str(), 1);
      else unsetenv("TEST_PARENT");
      try {
        end_with_parent("TEST_PARENT");
        int signal = 0;
        prctl(PR_GET_PDEATHSIG, &signal);
        std::_Exit(signal == SIGKILL ? 0 : 4);  // it ends when its parent does
      } catch (const std::exception&) {
        std::_Exit(3);
      }
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  const std::string parent = std::to_string(getpid()), other = std::to_string(getppid());  // a live process
  const std::string ended = "4194305";  // above Linux's largest pid: as a parent that has ended
  CHECK(in_child(&parent) == 0);
  CHECK(in_child(&other) == 3);
  CHECK(in_child(nullptr) == 3);
  CHECK(in_child(&ended) == 1);  // quietly
}
