// train_gpt.cu: the record-#25 NanoGPT speedrun trainer (SPEC Part 1) in one CUDA file.
//
// Status: the host side of the run is here (hyperparameters and flags, run log in the reference's
// format, checkpoints); the GPU training step is assembled from kernels/ in the trainer issue.
// Until then this program checks its flags, the GPU and the data, says what is missing and never
// pretends to train.
#include "data/dataloader.h"
#include "kernels/cuda_check.cuh"
#include "kernels/schedules.h"

#include <cerrno>
#include <charconv>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
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
  // run
  uint64_t seed = 0;                // 0: a fresh random seed, logged (record runs are independent)
  int checkpoint_every = 0;         // 0: a checkpoint at the end only
  std::string checkpoint_dir = "checkpoints";
  bool resume = false;              // continue from the newest checkpoint in checkpoint_dir
  std::string log_dir = "logs";
};

// ------------------------------------------------------------------------------------------------
// Command-line flags: one table binds each flag to its field; values are parsed strictly.
// ------------------------------------------------------------------------------------------------
struct FlagError : std::runtime_error {
  using std::runtime_error::runtime_error;
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
      {"seed", &h.seed, "initialisation seed (0: a fresh one per run, logged)", nullptr, ""},
      {"checkpoint-every", &h.checkpoint_every, "steps between checkpoints (0: at the end only)",
       non_negative(&h.checkpoint_every), "non-negative"},
      {"checkpoint-dir", &h.checkpoint_dir, "folder of the checkpoints", nullptr, ""},
      {"resume", &h.resume, "continue from the newest checkpoint in --checkpoint-dir", nullptr, ""},
      {"log-dir", &h.log_dir, "folder of the run logs", nullptr, ""},
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
  if (r.ec != std::errc() || r.ptr != end || text.empty())
    throw FlagError("--" + flag + ": '" + text + "' is not a valid " +
                    (std::is_floating_point_v<T> ? "number" : std::is_signed_v<T> ? "integer" : "non-negative integer"));
  return value;
}

inline std::string flag_value_text(const Flag& f) {
  return std::visit(
      [](auto* p) -> std::string {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::string>) return *p;
        else if constexpr (std::is_same_v<T, bool>) return *p ? "true" : "false";
        else if constexpr (std::is_floating_point_v<T>) {
          std::ostringstream s;
          s << *p;
          return s.str();
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
  out << "  --help                   this text\n";
  return out.str();
}

// Parses argv into h. Throws FlagError naming the flag for unknown flags, missing or malformed
// values and values outside their range. Returns false when --help was asked.
inline bool parse_flags(int argc, char** argv, Hyperparameters& h) {
  std::vector<Flag> flags = flag_table(h);
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return false;
    if (arg.rfind("--", 0) != 0) throw FlagError("unexpected argument '" + arg + "' (flags start with --)");
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
// Checkpoints: named byte blobs (parameters, optimizer state, data position) in one file, written
// to a temporary name and renamed, so a crash never leaves a torn checkpoint under the real name.
// ------------------------------------------------------------------------------------------------
struct CheckpointError : std::runtime_error {
  using std::runtime_error::runtime_error;
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

constexpr char kCheckpointMagic[8] = {'S', 'P', 'D', 'R', 'C', 'K', 'P', '1'};

inline std::string checkpoint_path(const std::string& dir, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%06d.ckpt", step);
  return dir + "/" + name;
}

inline void write_checkpoint(const std::string& dir, const Checkpoint& c) {
  std::filesystem::create_directories(dir);
  std::string path = checkpoint_path(dir, c.step), temp = path + ".tmp";
  {
    std::ofstream out(temp, std::ios::binary);
    auto put = [&](const void* p, size_t n) { out.write(static_cast<const char*>(p), std::streamsize(n)); };
    auto put_u64 = [&](uint64_t v) { put(&v, sizeof v); };
    put(kCheckpointMagic, sizeof kCheckpointMagic);
    put_u64(uint64_t(c.step));
    put_u64(c.blobs.size());
    for (const auto& [name, bytes] : c.blobs) {
      put_u64(name.size());
      put(name.data(), name.size());
      put_u64(bytes.size());
      put(bytes.data(), bytes.size());
    }
    out.flush();
    if (!out) throw CheckpointError(temp + ": write failed (disk full?)");
  }
  std::filesystem::rename(temp, path);
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
  c.step = int(get_u64("the step"));
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
    c.blobs.emplace_back(std::move(name), std::move(bytes));
  }
  if (in.peek() != std::char_traits<char>::eof()) throw CheckpointError(path + ": trailing bytes after the last blob");
  return c;
}

// The checkpoint of the highest step in dir, or "" when there is none. Temporary files of an
// interrupted write are ignored.
inline std::string newest_checkpoint(const std::string& dir) {
  std::string newest;
  if (!std::filesystem::is_directory(dir)) return newest;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    std::string name = entry.path().filename().string();
    if (name.rfind("step_", 0) == 0 && entry.path().extension() == ".ckpt" && entry.path().string() > newest)
      newest = entry.path().string();
  }
  return newest;
}

// ------------------------------------------------------------------------------------------------
#ifndef TRAIN_GPT_NO_MAIN  // tests include this file for its host and device code
int main(int argc, char** argv) {
  Hyperparameters h;
  try {
    if (!parse_flags(argc, argv, h)) {
      std::printf("%s", usage(argv[0]).c_str());
      return 0;
    }
  } catch (const FlagError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  try {
    int devices = 0;
    CUDA_CHECK(cudaGetDeviceCount(&devices));
    require_hopper_gpu(0);
    for (const std::string& pattern : {h.train_files, h.val_files}) {
      std::vector<std::string> files = list_shards(pattern);
      size_t tokens = 0;
      for (const std::string& f : files) tokens += read_shard(f, kTokenizerVocab).size();
      std::printf("%s: %zu shard(s), %zu tokens, all checked\n", pattern.c_str(), files.size(), tokens);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "train_gpt: the GPU training step is not implemented yet (see the open issues); "
                       "nothing was trained.\n");
  return 2;
}
#endif
