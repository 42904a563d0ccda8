// train_gpt.cu: the record-#25 NanoGPT speedrun trainer (SPEC Part 1) in one CUDA file.
//
// Reading order: hyperparameters and flags, the run log, checkpoints, the model (parameters,
// activations, forward and backward from the kernels of kernels/), the sharded optimizers, the
// training state, and the run (warmup, steps, validation, checkpoints) over a communicator that is
// one rank, NCCL ranks (one process per GPU) or, in tests, simulated ranks on one GPU.
#include "data/dataloader.h"
#include "kernels/activations.cuh"
#include "kernels/attention.cuh"
#include "kernels/cross_entropy.cuh"
#include "kernels/device_comm.cuh"
#include "kernels/diloco.cuh"
#include "kernels/embedding.cuh"
#include "kernels/flash_attention.cuh"
#include "kernels/fp8_head.cuh"
#include "kernels/host/checkpoint_file.h"
#include "kernels/host/cuda_check.cuh"
#include "kernels/host/matmul_algorithms.h"
#include "kernels/host/rendezvous.h"
#include "kernels/host/schedules.h"
#include "kernels/host/sharding.h"
#include "kernels/host/timeline.cuh"
#include "kernels/host/watchdog.h"
#include "kernels/matmul.cuh"
#include "kernels/muon.cuh"
#include "kernels/norms.cuh"
#include "kernels/optimizers.cuh"
#include "kernels/rekls.cuh"
#include "kernels/residual.cuh"
#include "kernels/rope.cuh"
#include "kernels/self_check.cuh"
#include "kernels/self_check_process.cuh"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <numeric>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <iomanip>
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
  int diloco_fragments = 3;         // each sync sends about a third of the model
  int diloco_sync_every = 30;       // H: each fragment syncs ~59 times in the record's 1770 steps
  int diloco_sync_delay = 0;
  double diloco_outer_lr = 0.7, diloco_outer_momentum = 0.9;  // the DiLoCo paper's outer Nesterov SGD
  double diloco_alpha = 0;
  std::string diloco_comm = "fp32";
  bool diloco_host_copies = false;
  // fast paths (kernels/self_check.cuh): each may be replaced by its simple reference
  std::string attention = "flash";     // flash, flash-ws, flash-split or reference
  std::string fp8_gradient = "fused";  // fused or cast
  std::string muon = "batched";        // batched or per-matrix
  std::string residual_add = "fused";  // fused or separate
  std::string mlp_fc = "cublaslt";     // cublaslt or fused (opt-in until measured on a GPU)
  std::string qkv = "cublaslt";        // cublaslt or fused (opt-in until measured on a GPU)
  std::string qkv_backward = "separate";  // separate or fused (opt-in until measured on a GPU)
  int fp8_logits_algorithm = 0;        // cuBLASLt's heuristic answer for the FP8 logits (bench_kernels fp8 times them)
  std::string matmul_algorithms = "first";  // and for each of the blocks' products (bench_kernels matmul times them)
  std::string launch_overlap = "none";  // none or pdl (kernels/host/launch.cuh; opt-in until measured on a GPU)
  std::string self_check = "fallback"; // fallback, strict or off
  bool self_check_only = false;        // run the self-check and exit
  int timeline_step = 0;            // > 0: write that step's GPU schedule as a Chrome trace into log_dir
  int profile_step = 0;             // > 0: that step alone inside cudaProfilerStart/Stop (tools/kernel_profile)
  int stall_timeout = 600;          // seconds without progress after which a rank exits (0: never)
  bool nccl_single_rank = false;    // one rank through NCCL anyway (to measure what NCCL costs)
  bool ranks_share_gpu = false;     // every rank on this machine's one GPU, NCCL over the loopback (tests)
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
      {"seed", &h.seed, "initialisation seed (0: a fresh one per run, logged)",
       [&h] { return h.seed < uint64_t(1) << 52; }, "below 2^52 (exact through the ranks' double all-reduce)"},
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
       "DiLoCo fragments: whole parameters, balanced by element count (each sync sends about 1/F of the model)",
       positive(&h.diloco_fragments), "positive (at most the model's 12 blocks)"},
      {"diloco-sync-every", &h.diloco_sync_every, "DiLoCo: steps between two syncs of a fragment (H)",
       [&h] { return h.diloco_groups <= 1 || (h.diloco_sync_every > 0 && h.diloco_sync_every % h.diloco_fragments == 0); },
       "a positive multiple of --diloco-fragments"},
      {"diloco-sync-delay", &h.diloco_sync_delay,
       "DiLoCo: steps a fragment's exchange overlaps before it is applied (d < H / F)",
       [&h] {
         return h.diloco_groups <= 1 || (h.diloco_sync_delay >= 0 && h.diloco_fragments > 0 &&
                                         h.diloco_sync_delay < h.diloco_sync_every / h.diloco_fragments);
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
      {"attention", &h.attention,
       "attention kernels: flash (wgmma, one fused backward), flash-ws (flash with the warp-specialised TMA "
       "forward), flash-split (wgmma, the backward as two kernels) or reference (warp per row; slower)",
       one_of(&h.attention, {"flash", "flash-ws", "flash-split", "reference"}), "flash, flash-ws, flash-split or reference"},
      {"fp8-gradient", &h.fp8_gradient,
       "FP8 head's gradient: fused (the cross-entropy writes e5m2) or cast (bf16, then a cast)",
       one_of(&h.fp8_gradient, {"fused", "cast"}), "fused or cast"},
      {"muon", &h.muon, "Newton-Schulz: batched (strided cuBLASLt batches) or per-matrix",
       one_of(&h.muon, {"batched", "per-matrix"}), "batched or per-matrix"},
      {"residual-add", &h.residual_add, "residual adds: fused (cuBLASLt's C) or separate (a matmul, then an add)",
       one_of(&h.residual_add, {"fused", "separate"}), "fused or separate"},
      {"mlp-fc", &h.mlp_fc,
       "the MLP's first product and ReLU²: cublaslt (cuBLASLt, then a ReLU² pass) or fused (our TMA / wgmma GEMM "
       "with ReLU² in its epilogue; opt-in until measured faster on a GPU)",
       one_of(&h.mlp_fc, {"cublaslt", "fused"}), "cublaslt or fused"},
      {"qkv", &h.qkv,
       "the attention's qkv product, QK norm, RoPE and the value mix: cublaslt (cuBLASLt, then two passes) or "
       "fused (our GEMM with them in its epilogue; opt-in until measured faster on a GPU)",
       one_of(&h.qkv, {"cublaslt", "fused"}), "cublaslt or fused"},
      {"qkv-backward", &h.qkv_backward,
       "the backward of the QK norm, RoPE and the value mix: separate (passes over the attention backward's dq, dk "
       "and dv) or fused (where the fused flash backward stores them: it writes dqkv; needs --attention flash or "
       "flash-ws; opt-in until measured faster on a GPU)",
       one_of(&h.qkv_backward, {"separate", "fused"}), "separate or fused"},
      {"fp8-logits-algorithm", &h.fp8_logits_algorithm,
       "which of cuBLASLt's heuristic algorithms the FP8 head's logits product takes: 0 its first; "
       "`bench_kernels fp8` times each at the model's shape",
       [&h] { return h.fp8_logits_algorithm >= 0 && h.fp8_logits_algorithm < Matmul::kMaxCandidates; },
       "in [0, " + std::to_string(Matmul::kMaxCandidates) + ")"},
      {"matmul-algorithms", &h.matmul_algorithms,
       "which of cuBLASLt's heuristic algorithms the blocks' products take in training: linear.product=N items "
       "joined by commas (linear: qkv, attn-proj, mlp-fc or mlp-proj; product: fwd, dx or dw), e.g. "
       "mlp-fc.dw=2,qkv.dx=1; the rest take 0, the heuristic's first; first: all do. `bench_kernels matmul` times "
       "each at the record's shapes (T = 49,152) and prints the fastest reproducible ones as this value: positions "
       "in cuBLASLt's answers for those shapes on that GPU and library (drop the products --qkv or --mlp-fc fused "
       "give to our GEMM)",
       nullptr, ""},
      {"launch-overlap", &h.launch_overlap,
       "how each kernel follows the one before it in its stream: none (it starts once that one has completed) or "
       "pdl (programmatic dependent launch: it is launched while that one's last blocks run and waits inside for "
       "its completion; opt-in until measured faster on a GPU)",
       one_of(&h.launch_overlap, {"none", "pdl"}), "none or pdl"},
      {"self-check", &h.self_check,
       "check the fast paths at start-up: fallback (a failing one's reference), strict (exit 6), off",
       one_of(&h.self_check, {"fallback", "strict", "off"}), "fallback, strict or off"},
      {"self-check-only", &h.self_check_only, "run the self-check on this GPU, print it and exit (6: a check failed)",
       nullptr, ""},
      {"timeline-step", &h.timeline_step,
       "write that step's GPU schedule to <log-dir>/timeline_rank<r>_step<N>.json (0: none)",
       non_negative(&h.timeline_step), "non-negative"},
      {"profile-step", &h.profile_step,
       "bracket that step, synchronised, with cudaProfilerStart/Stop for a profiler that honours them "
       "(build/libkernel_profile.so; 0: none)",
       non_negative(&h.profile_step), "non-negative"},
      {"stall-timeout", &h.stall_timeout,
       "seconds without progress (a hung collective) after which a rank exits 75 (0: never)",
       non_negative(&h.stall_timeout), "non-negative"},
      {"nccl-single-rank", &h.nccl_single_rank, "with one rank, communicate through NCCL anyway (measures its cost)",
       nullptr, ""},
      {"ranks-share-gpu", &h.ranks_share_gpu,
       "all ranks (run.sh NPROC=2 or more) on this machine's one GPU, NCCL over loopback sockets: multi-rank "
       "NCCL where there is one GPU (slow; each rank needs a whole rank's memory)",
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
    // strtod reads "inf" and "nan", which pass a "> 0" requirement: no setting takes them
    if (r.ec == std::errc() && stop == end && !std::isfinite(value))
      throw FlagError("--" + flag + ": '" + text + "' is not a finite number");
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
  out << "usage: " << program << " [--flag value | --flag=value]...\n(a flag given twice: the last value counts, "
      << "so that flags after run.sh's own override them; --matmul-algorithms is refused twice)\n\n"
      << "flags (default in brackets):\n";
  for (const Flag& f : flag_table(defaults))  // a stream, not a fixed buffer: some helps are long
    out << "  --" << std::left << std::setw(22) << f.name << " " << f.help << " [" << flag_value_text(f) << "]\n";
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

// --matmul-algorithms's value, refused where it names what is not a cuBLASLt product in the run:
// with --qkv fused or --mlp-fc fused our GEMM makes the qkv product, the MLP's fc product and its
// projection's dx product (with ReLU²'s backward in its epilogue).
inline MatmulAlgorithms check_matmul_algorithms(const Hyperparameters& h) {
  MatmulAlgorithms a;
  try {
    a = MatmulAlgorithms::parse(h.matmul_algorithms, Matmul::kMaxCandidates);
  } catch (const std::invalid_argument& e) {
    throw FlagError("--matmul-algorithms " + h.matmul_algorithms + ": " + e.what());
  }
  struct Ours { BlockLinear linear; LinearProduct product; const char* flag; const std::string& value; };
  for (const Ours& o : {Ours{BlockLinear::qkv, LinearProduct::fwd, "qkv", h.qkv},
                        Ours{BlockLinear::mlp_fc, LinearProduct::fwd, "mlp-fc", h.mlp_fc},
                        Ours{BlockLinear::mlp_proj, LinearProduct::dx, "mlp-fc", h.mlp_fc}})
    if (a.of(o.linear, o.product) != 0 && o.value == "fused")
      throw FlagError("--matmul-algorithms names " + MatmulAlgorithms::name_of(o.linear, o.product) + ", which --" +
                      o.flag + " fused makes with our GEMM, not with cuBLASLt");
  return a;
}

// Parses argv into h. Throws FlagError naming the flag for unknown flags, missing or malformed
// values and values outside their range. Returns false when --help was asked.
inline bool parse_flags(int argc, char** argv, Hyperparameters& h) {
  std::vector<Flag> flags = flag_table(h);
  auto is_flag = [&](const std::string& word) {
    if (word == "--help" || word == "-h") return true;
    if (word.rfind("--", 0) != 0) return false;
    const std::string name = word.substr(2, word.find('=') - 2);  // npos - 2: to the end
    return std::any_of(flags.begin(), flags.end(), [&](const Flag& f) { return f.name == name; });
  };
  std::vector<std::string> given;  // the flags on the command line, in order
  std::string after_value_of;  // the flag whose value argv[i - 1] was
  std::string after_switch;    // the switch (a flag without a value) argv[i - 1] was
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return false;
    if (arg.rfind("--", 0) != 0) {
      if (!after_switch.empty())  // `--resume yes`
        throw FlagError("unexpected argument '" + arg + "': --" + after_switch + " takes no value (give it alone)");
      throw FlagError(unexpected_argument(arg, after_value_of));
    }
    after_value_of.clear();
    after_switch.clear();
    std::string name = arg.substr(2), value;
    bool inline_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      inline_value = true;
    }
    auto flag = std::find_if(flags.begin(), flags.end(), [&](const Flag& f) { return f.name == name; });
    if (flag == flags.end()) throw FlagError("unknown flag --" + name + " (--help lists them)");
    given.push_back(name);
    if (std::holds_alternative<bool*>(flag->field)) {
      if (inline_value) throw FlagError("--" + name + " takes no value");
      *std::get<bool*>(flag->field) = true;
      after_switch = name;
      continue;
    }
    if (!inline_value) {
      if (i + 1 >= argc) throw FlagError("--" + name + " needs a value");
      value = argv[++i];
      if (is_flag(value))  // `--checkpoint-dir --resume` would make a folder named --resume
        throw FlagError("--" + name + " needs a value, but the next word, " + value + ", is a flag (a value that " +
                        "starts with -- goes as --" + name + "=" + value + ")");
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
  // Settings of a feature that is off would be silently ignored: say so instead (after the values'
  // own checks, whose rules for DiLoCo's shape hold only with DiLoCo on).
  for (const std::string& name : given) {
    if (name.rfind("rekls-", 0) == 0 && h.matrix_optimizer != "rekls")
      throw FlagError("--" + name + " has no effect without --matrix-optimizer rekls");
    if (name.rfind("diloco-", 0) == 0 && name != "diloco-groups" && h.diloco_groups <= 1)
      throw FlagError("--" + name + " has no effect without --diloco-groups 2 or more");
    if (name == "fp8-logits-algorithm" && h.bf16_head)
      throw FlagError("--fp8-logits-algorithm has no effect with --bf16-head (a bf16 head has no FP8 product)");
  }
  if (std::count(given.begin(), given.end(), "matmul-algorithms") > 1)  // the last would silently drop the others' items
    throw FlagError("--matmul-algorithms is given twice: join its items with commas in one value, e.g. "
                    "--matmul-algorithms qkv.dx=1,mlp-fc.dw=2");
  h.matmul_algorithms = check_matmul_algorithms(h).text();  // one spelling of each choice, in the log and checkpoints
  if (h.qkv_backward == "fused" && (h.attention == "flash-split" || h.attention == "reference"))
    throw FlagError("--qkv-backward fused needs the fused flash backward (--attention flash or flash-ws), not "
                    "--attention " + h.attention);
  if (h.val_tokens % h.val_seq_len != 0)
    throw FlagError("--val-tokens " + std::to_string(h.val_tokens) + " is not a multiple of --val-seq-len " +
                    std::to_string(h.val_seq_len));
  if (h.timeline_step > h.num_iterations)
    throw FlagError("--timeline-step " + std::to_string(h.timeline_step) + " is past the run's last step " +
                    "(--num-iterations " + std::to_string(h.num_iterations) + "): no trace would be written");
  if (h.profile_step > h.num_iterations)
    throw FlagError("--profile-step " + std::to_string(h.profile_step) + " is past the run's last step " +
                    "(--num-iterations " + std::to_string(h.num_iterations) +
                    "): nothing would be profiled");
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

// The reference log's last line, in its words. Here "allocated" is what DeviceMemory holds (the
// model, its gradients and activations; not the buffers that the FP8 head, cuBLASLt's workspaces,
// Muon's and REKLS's scratch and DiLoCo allocate on their own), "reserved" the GPU's memory in use
// by every process.
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

// The source this binary was built from, for its log: embedded by the build (CMake writes
// trainer_source.inc from train_gpt.cu and every header of kernels/ and data/), or, in a frozen
// single-file record, the file's own text, which tools/records.py embeds at its end.
#if defined(SPEEDRUN_FROZEN_RECORD)
extern const char kTrainerSource[];  // defined at the end of the frozen file
#elif __has_include("trainer_source.inc")
#include "trainer_source.inc"  // static const char kTrainerSource[]
#else
static const char kTrainerSource[] = "(source not embedded: built without CMake and not frozen)\n";
#endif
inline std::string trainer_source() { return kTrainerSource; }

// Where this binary comes from, for its log: the commit and whether the tracked files differed from
// it (CMake writes build_commit.inc at every build), or the frozen record's name.
#if defined(SPEEDRUN_FROZEN_RECORD)
static const std::string kBuildOrigin = std::string("frozen record ") + SPEEDRUN_FROZEN_RECORD;
#elif __has_include("build_commit.inc")
#include "build_commit.inc"  // static const char kBuildCommit[]: "commit <hash>[, tree dirty]" or none
static const std::string kBuildOrigin = kBuildCommit;
#else
static const std::string kBuildOrigin = "not built by CMake nor frozen";
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
  int device = 0;
  cudaDeviceProp properties{};
  if (cudaGetDevice(&device) == cudaSuccess && cudaGetDeviceProperties(&properties, device) == cudaSuccess)
    out << "gpu: " << properties.name << "\n";
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

// The flags that choose how the step computes, not the state it keeps (the kernels' paths, cuBLASLt's
// algorithms), as "name=value" lines. A resume may change them (the state fits either), but its run
// then computed its steps two ways: the resume's log line says so, and tools/records.py pools no
// such run.
inline std::string kernel_flags(const Hyperparameters& h) {
  static const char* const names[] = {"attention", "fp8-gradient", "muon",         "residual-add",         "mlp-fc",
                                      "qkv",       "qkv-backward", "fp8-logits-algorithm", "matmul-algorithms"};
  return exact_flag_lines(h, [](const std::string& name) {
    return std::find(std::begin(names), std::end(names), name) != std::end(names);
  });
}

// "" when the checkpoint's flags equal this run's, else each difference. same_data (optional) says
// whether two --train-files globs of different text match the same files (run.sh passes absolute
// paths, a direct call relative ones).
inline std::string resume_flag_differences(
    const std::string& saved, const std::string& now,
    const std::function<bool(const std::string&, const std::string&)>& same_data = nullptr) {
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
  // A flag one side does not record (DiLoCo's and REKLS's, where they were off) had its default.
  const auto defaults = parse(exact_flag_lines(Hyperparameters{}, [](const std::string&) { return true; }));
  auto value_in = [&](const auto& values, const std::string& name) -> std::pair<std::string, bool> {
    for (const auto& [n, v] : values)
      if (n == name) return {v, false};
    for (const auto& [n, v] : defaults)
      if (n == name) return {v, true};
    return {"(none)", false};
  };
  auto text = [](const std::pair<std::string, bool>& v) { return v.first + (v.second ? " (default)" : ""); };
  std::vector<std::string> names;
  for (const auto& values : {after, before})
    for (const auto& [name, value] : values)
      if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  std::string differences;
  for (const std::string& name : names) {
    const auto was = value_in(before, name), is = value_in(after, name);
    if (was.first == is.first || (name == "train-files" && same_data && same_data(was.first, is.first))) continue;
    differences += "; --" + name + " was " + text(was) + ", is " + text(is);
  }
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
  int complete_after = -1;  // the GPT::GradientsDone point after which its gradient is complete (parameter_list)
  bool is_embedding() const { return kind == ParamKind::embed || kind == ParamKind::value_embed; }
};

inline bool is_muon_param(ParamKind kind) {
  return kind == ParamKind::qkv || kind == ParamKind::attn_proj || kind == ParamKind::mlp_fc ||
         kind == ParamKind::mlp_proj;
}

// The GPT::GradientsDone point after which p's gradient is complete in the last micro-sequence's
// backward: a block's matrices after their block, lm_head after the head (num_layers), a
// value-embedding table after the lowest block that reads it (its gradient is added where each
// block's attention backward is), everything else (the token embedding, the scalars that every
// block touches) at the end (-1). The earlier a point, the more of the reduction hides under the
// backward of the blocks below.
inline int gradient_complete_after(const Param& p, const GPTConfig& c) {
  if (is_muon_param(p.kind)) return p.layer;
  if (p.kind == ParamKind::lm_head) return c.num_layers;
  int point = -1;  // the end; for a value-embedding table, the lowest block that reads it
  if (p.kind == ParamKind::value_embed)
    for (int i = 0; i < c.num_layers; ++i)
      if (c.value_embed[i] == p.layer) {
        point = i;
        if (injected_fault() != Fault::value_embed_reduced_early) break;  // the oracle's bug: the highest
      }
  return point;
}

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
  for (Param& p : list) p.complete_after = gradient_complete_after(p, c);
  return list;
}

// What an allocation failure adds to its message: where ranks share one GPU (--ranks-share-gpu),
// that they do, and what makes each smaller.
inline std::string& out_of_memory_hint() {
  static std::string hint;
  return hint;
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
                             std::to_string(total_bytes >> 20) + " MiB free)" + out_of_memory_hint());
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
  // backward scratch (null in evaluation activations)
  bf16 *dx = nullptr, *dx0 = nullptr, *dh = nullptr, *dy = nullptr, *dq = nullptr, *dk = nullptr, *dv = nullptr;
  bf16 *dqkv = nullptr, *du = nullptr;    // dqkv [T, 3d], du [T, F]
  std::vector<bf16*> dskip;               // [num_skips]: gradient waiting for the skip's source layer
  float* attention_scratch = nullptr;     // attention_backward_scratch_floats(T, H): delta, dq's partial sums
  float* embedding_scratch = nullptr;     // [EmbeddingBackwardPlan::scratch_rows(T), d]: split tokens' segment sums
  float* reduction_scratch;    // per-block partial sums of the scalar gradients
  float* cos_sin;              // [T, 64, 2] rope table
  std::unique_ptr<Fp8Head> fp8_head;  // the FP8 operands of one head chunk and of lm_head (or null)

  // fp8_head: training activations that also hold the FP8 head's operands (SPEC 1.5).
  // mlp_pre_activations: allocate u now (see allocate_mlp_pre_activations).
  Activations(const GPTConfig& c, int T, bool backward, DeviceMemory& m, bool fp8_head = false,
              bool mlp_pre_activations = true)
      : max_T(T), for_backward(backward), layers(c.num_layers), dskip(c.num_skips()) {
    const size_t td = size_t(T) * c.model_dim, tf = size_t(T) * c.mlp_dim();
    inputs = m.alloc<uint16_t>("input tokens", T);
    targets = m.alloc<uint16_t>("target tokens", T);
    embedded = m.alloc<bf16>("embedded tokens", td);
    x0 = m.alloc<bf16>("x0", td);
    for (int k = 0; k < c.num_value_embeds; ++k) value_embedded[k] = m.alloc<bf16>("value embedding " + std::to_string(k), td);
    for (int i = 0; i < c.num_layers; ++i) allocate_layer(c, i, T, m);
    if (mlp_pre_activations) allocate_mlp_pre_activations(c, m);
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
      attention_scratch =
          m.alloc<float>("attention backward scratch", attention_backward_scratch_floats(T, c.num_heads));
      embedding_scratch = m.alloc<float>("embedding backward segment sums",
                                         EmbeddingBackwardPlan::scratch_rows(T) * c.model_dim);
    }
    if (backward && fp8_head) this->fp8_head = std::make_unique<Fp8Head>(std::min(T, kHeadChunkRows), c.vocab_size, c.model_dim);
    reduction_scratch = m.alloc<float>("scalar-gradient partial sums", kScalarReductionScratchFloats);
    cos_sin = m.alloc<float>("rope table", size_t(T) * kRopeHeadDim);
    std::vector<float> table;
    rope_table_host(T, table);
    CUDA_CHECK(cudaMemcpy(cos_sin, table.data(), table.size() * sizeof(float), cudaMemcpyHostToDevice));
  }

  // u [T, F] per layer, the MLP's pre-activation: only the unfused fc (--mlp-fc cublaslt) writes it,
  // for its backward. The fused fc never does (3.6 GB of training activations at the record's T), so
  // a run allocates u once the self-check has settled its paths, and only when the fc is unfused.
  void allocate_mlp_pre_activations(const GPTConfig& c, DeviceMemory& m) {
    for (int i = 0; i < c.num_layers; ++i) {
      LayerActivations& l = layers[i];
      if (l.u) continue;
      const bool reuse = !for_backward && i > 0;
      l.u = reuse ? layers[i - 1].u : m.alloc<bf16>("layer " + std::to_string(i) + " u", size_t(max_T) * c.mlp_dim());
    }
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
    // evaluation's products are of its own length, which no one timed: the heuristic's first
    algorithms_ = backward ? paths_.matmul_algorithms : MatmulAlgorithms{};
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

  // Plans the FP8 head's logits product for the chunks a micro-sequence of T tokens makes (the
  // paths' cuBLASLt candidate): a candidate cuBLASLt does not offer at one of those shapes is refused
  // now, naming the flag, not at the first step.
  void plan_fp8_head(Activations& acts, int T) {
    if (!paths_.fp8_head || !acts.fp8_head) return;
    acts.fp8_head->set_logits_candidate(paths_.fp8_logits_candidate);
    for (int rows : {std::min(T, kHeadChunkRows), T % kHeadChunkRows}) {
      if (rows == 0) continue;
      try {
        acts.fp8_head->plan_logits_product(acts.logits, rows, matmul_);
      } catch (const std::invalid_argument& e) {
        throw FlagError("--fp8-logits-algorithm " + std::to_string(paths_.fp8_logits_candidate) + ": " + e.what());
      }
    }
  }

  // Plans each of the blocks' products that the paths' --matmul-algorithms names at the training
  // length T, as the steps make them (any buffers aligned as theirs: every operand is at a 256-byte
  // boundary): a candidate cuBLASLt does not offer is refused now, naming the flag, not at the first step.
  void plan_block_matmuls(const Activations& acts, int T) {
    const MatmulAlgorithms& chosen = paths_.matmul_algorithms;
    const int d = c_.model_dim, F = c_.mlp_dim();
    struct Shape { BlockLinear linear; ParamKind kind; int n, k; bool residual; };
    for (const Shape& s : {Shape{BlockLinear::qkv, ParamKind::qkv, 3 * d, d, false},
                           Shape{BlockLinear::attn_proj, ParamKind::attn_proj, d, d, true},
                           Shape{BlockLinear::mlp_fc, ParamKind::mlp_fc, F, d, false},
                           Shape{BlockLinear::mlp_proj, ParamKind::mlp_proj, d, F, true}}) {
      for (LinearProduct p : {LinearProduct::fwd, LinearProduct::dx, LinearProduct::dw}) {
        MatmulOptions o;
        o.candidate = chosen.of(s.linear, p);
        if (o.candidate == 0) continue;
        const Param& first = *std::find_if(params.list.begin(), params.list.end(),
                                           [&](const Param& q) { return q.kind == s.kind; });
        const bf16 *w = params.weight(s.kind, first.layer), *x = acts.x0;
        float* dw = params.grad(s.kind, first.layer);
        if (p == LinearProduct::fwd && s.residual && paths_.fused_residual_add) o.addend = x;
        try {
          if (p == LinearProduct::fwd) matmul_.plan_only(x, Transpose::N, w, Transpose::T, x, T, s.n, s.k, CUDA_R_16BF, o);
          if (p == LinearProduct::dx) matmul_.plan_only(x, Transpose::N, w, Transpose::N, x, T, s.k, s.n, CUDA_R_16BF, o);
          if (p == LinearProduct::dw) matmul_.plan_only(x, Transpose::T, x, Transpose::N, dw, s.n, s.k, T, CUDA_R_32F, o);
        } catch (const std::invalid_argument& e) {
          throw FlagError("--matmul-algorithms " + MatmulAlgorithms::name_of(s.linear, p) + "=" +
                          std::to_string(o.candidate) + ": " + e.what());
        }
      }
    }
  }

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
  // The product's options: in training, the cuBLASLt candidate --matmul-algorithms gives it.
  MatmulOptions options(BlockLinear linear, LinearProduct product) const {
    MatmulOptions o;
    o.candidate = algorithms_.of(linear, product);
    return o;
  }
  // y[T, n] = x[T, k] W[n, k]^T (+ residual[T, n]), bf16 out
  void linear(BlockLinear which, const bf16* x, const bf16* w, bf16* y, int n, int k, const bf16* residual = nullptr) {
    const MatmulOptions o = options(which, LinearProduct::fwd);
    if (residual) linear_with_residual(matmul_, x, w, y, T_, n, k, residual, paths_.fused_residual_add, stream_, o);
    else matmul_(x, Transpose::N, w, Transpose::T, y, T_, n, k, CUDA_R_16BF, o, stream_);
  }
  // For y = x W^T: dx[T, k] = dy[T, n] W[n, k] and dW[n, k] += dy^T x (fp32)
  void linear_backward(BlockLinear which, const bf16* x, const bf16* w, const bf16* dy, bf16* dx, float* dw, int n,
                       int k) {
    matmul_(dy, Transpose::N, w, Transpose::N, dx, T_, k, n, CUDA_R_16BF, options(which, LinearProduct::dx), stream_);
    linear_weight_gradient(which, x, dy, dw, n, k);
  }

  // dw [n, k] += dy^T x
  void linear_weight_gradient(BlockLinear which, const bf16* x, const bf16* dy, float* dw, int n, int k) {
    matmul_(dy, Transpose::T, x, Transpose::N, dw, n, k, T_, CUDA_R_32F, options(which, LinearProduct::dw), stream_,
            1.0f, 1.0f);
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
      // x_in = previous output + skip weight * the mirrored layer's output (from the skips on),
      // x_mixed = lambda0 x_in + lambda1 x0, and its norm: the attention's input, or the MLP's
      const bool skip = i >= c_.num_skips();
      const int from = c_.num_layers - 1 - i;
      mix_norm_forward(skip ? a.layers[i - 1].x_out : nullptr, skip ? a.layers[from].x_out : nullptr,
                       skip ? scalar(c_.skip_weight_index(i - c_.num_skips())) : nullptr, l.x_in, a.x0,
                       scalar(c_.block_lambda_index(i, 0)), scalar(c_.block_lambda_index(i, 1)), l.x_mixed,
                       c_.has_attention[i] ? l.h_attn : l.h_mlp, T_, d, stream_);
      if (c_.has_attention[i]) attention_forward_layer(i, plan);
      mlp_forward_layer(i);
    }
    rmsnorm_forward(a.layers.back().x_out, a.x_final, T_, d, stream_);
  }

  void attention_forward_layer(int i, const MicroSequencePlan& plan) {
    LayerActivations& l = a_->layers[i];
    const int d = c_.model_dim;
    const int table = c_.value_embed[i];
    const bf16* ve = table >= 0 ? a_->value_embedded[table] : nullptr;
    const float *sa0 = scalar(c_.sa_lambda_index(i, 0)), *sa1 = scalar(c_.sa_lambda_index(i, 1));
    if (paths_.fused_qkv) {  // q, k and v from the product's own accumulators: qkv is not read back
      matmul_qkv_norm_rope(l.h_attn, params.weight(ParamKind::qkv, i), l.qkv, l.q, l.k, l.v, a_->cos_sin, sa0, ve, sa1,
                           T_, d, stream_);
    } else {
      linear(BlockLinear::qkv, l.h_attn, params.weight(ParamKind::qkv, i), l.qkv, 3 * d, d);
      qk_norm_rope_forward(l.qkv, a_->cos_sin, l.q, l.k, T_, c_.num_heads, stream_);
      weighted_sum_forward(l.qkv + 2 * d, sa0, ve, sa1, l.v, T_, d, 3 * d, stream_);
    }
    attention_forward_of(paths_)(l.q, l.k, l.v, l.y, l.lse, attention_shape(), mask(plan, i), stream_);
    linear(BlockLinear::attn_proj, l.y, params.weight(ParamKind::attn_proj, i), l.x_mid, d, d, /*residual=*/l.x_mixed);
  }

  void mlp_forward_layer(int i) {
    LayerActivations& l = a_->layers[i];
    const int d = c_.model_dim, F = c_.mlp_dim();
    if (c_.has_attention[i]) rmsnorm_forward(l.x_mid, l.h_mlp, T_, d, stream_);  // else mix_norm_forward's
    if (paths_.fused_mlp_fc) {  // a = relu(h W^T)^2 in one pass; u is not written
      matmul_relu_squared(l.h_mlp, params.weight(ParamKind::mlp_fc, i), l.a, T_, F, d, stream_);
    } else {
      if (!l.u) throw std::logic_error("the unfused MLP fc asked of activations built without u (--mlp-fc fused)");
      linear(BlockLinear::mlp_fc, l.h_mlp, params.weight(ParamKind::mlp_fc, i), l.u, F, d);
      relu_squared_forward(l.u, l.a, size_t(T_) * F, stream_);
    }
    linear(BlockLinear::mlp_proj, l.a, params.weight(ParamKind::mlp_proj, i), l.x_out, d, F, /*residual=*/l.x_mid);
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
      fp8->set_logits_candidate(paths_.fp8_logits_candidate);
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
      mlp_backward_layer(i);
      if (c_.has_attention[i]) attention_backward_layer(i, plan);
      // dh holds the gradient of the norm of x_mixed = lambda0 x_in + lambda1 x0, x_in = previous
      // output + w skip from the skips on (mix_norm_forward): back through all three in one pass,
      // which also adds, where the previous layer is a skip's source, the gradient its output got
      // through the skip (written by a later layer's pass, or by this one: layer num_skips's source
      // is layer num_skips - 1)
      const int l0 = c_.block_lambda_index(i, 0), l1 = c_.block_lambda_index(i, 1);
      const bool skip = i >= c_.num_skips();
      const int from = c_.num_layers - 1 - i, w = skip ? c_.skip_weight_index(i - c_.num_skips()) : 0;
      const bf16* through_skip = i > 0 && i - 1 < c_.num_skips() ? a.dskip[i - 1] : nullptr;
      mix_norm_backward(l.x_mixed, a.dh, a.dx, l.x_in, a.x0, scalar(l0), scalar_grad(l0), scalar(l1), scalar_grad(l1),
                        a.dx0, skip ? a.layers[from].x_out : nullptr, skip ? scalar(w) : nullptr,
                        skip ? scalar_grad(w) : nullptr, skip ? a.dskip[from] : nullptr, through_skip, T_, d,
                        a.reduction_scratch, stream_);
      gradients_done_(i);
    }
    {
      TimelineSpan span(timeline_, "compute", "backward embedding", stream_);
      rmsnorm_backward(a.embedded, a.dx0, a.dh, T_, d, /*accumulate=*/false, stream_);
      embedding_backward(*plan.embedding_rows, a.dh, params.embedding_grad(-1), nullptr, d, a.embedding_scratch, stream_);
    }
    gradients_done_(-1);
  }

  void mlp_backward_layer(int i) {
    Activations& a = *a_;
    LayerActivations& l = a.layers[i];
    const int d = c_.model_dim, F = c_.mlp_dim();
    // x_out = x_mid + a W_proj^T: dx passes through to x_mid
    const bf16* w_proj = params.weight(ParamKind::mlp_proj, i);
    if (paths_.fused_mlp_fc) {  // du = (dx W_proj) 2 sqrt(a) in one pass: da is not written
      matmul_relu_squared_backward(a.dx, w_proj, l.a, a.du, T_, F, d, stream_);
      linear_weight_gradient(BlockLinear::mlp_proj, l.a, a.dx, params.grad(ParamKind::mlp_proj, i), d, F);
    } else {
      linear_backward(BlockLinear::mlp_proj, l.a, w_proj, a.dx, a.du, params.grad(ParamKind::mlp_proj, i), d, F);
      relu_squared_backward(l.u, a.du, a.du, size_t(T_) * F, stream_);
    }
    linear_backward(BlockLinear::mlp_fc, l.h_mlp, params.weight(ParamKind::mlp_fc, i), a.du, a.dh, params.grad(ParamKind::mlp_fc, i), F, d);
    // without attention x_mid is x_mixed, whose norm's backward is mix_norm_backward's
    if (c_.has_attention[i]) rmsnorm_backward(l.x_mid, a.dh, a.dx, T_, d, /*accumulate=*/true, stream_);
  }

  void attention_backward_layer(int i, const MicroSequencePlan& plan) {
    Activations& a = *a_;
    LayerActivations& l = a.layers[i];
    const int d = c_.model_dim;
    linear_backward(BlockLinear::attn_proj, l.y, params.weight(ParamKind::attn_proj, i), a.dx, a.dy, params.grad(ParamKind::attn_proj, i), d, d);
    // v = sa0 v_raw + sa1 ve: dv_raw goes into the v third of dqkv; the ve table gets sa1 dv
    const int table = c_.value_embed[i], s0 = c_.sa_lambda_index(i, 0), s1 = c_.sa_lambda_index(i, 1);
    const bf16* ve = table >= 0 ? a.value_embedded[table] : nullptr;
    float* dsa1 = ve ? scalar_grad(s1) : nullptr;
    if (attention_takes_qkv_backward(paths_)) {  // dqkv straight from the attention backward (dv only for ve's table)
      flash_attention_backward_into_dqkv(l.q, l.k, l.v, l.y, a.dy, l.lse, a.attention_scratch,
                                         {l.qkv, a.cos_sin, scalar(s0), ve, a.dqkv, ve ? a.dv : nullptr}, scalar_grad(s0),
                                         dsa1, attention_shape(), mask(plan, i), stream_);
    } else {
      attention_backward_of(paths_)(l.q, l.k, l.v, l.y, a.dy, l.lse, a.attention_scratch, a.dq, a.dk, a.dv,
                                    attention_shape(), mask(plan, i), stream_);
      weighted_sum_backward(a.dv, l.qkv + 2 * d, scalar(s0), scalar_grad(s0), ve, scalar(s1), dsa1, a.dqkv + 2 * d,
                            nullptr, /*accumulate_dy=*/false, T_, d, 3 * d, a.reduction_scratch, stream_);
      qk_norm_rope_backward(l.qkv, a.dq, a.dk, a.cos_sin, a.dqkv, T_, c_.num_heads, stream_);
    }
    if (ve)
      embedding_backward(*plan.embedding_rows, a.dv, params.embedding_grad(table), scalar(s1), d, a.embedding_scratch,
                         stream_);
    linear_backward(BlockLinear::qkv, l.h_attn, params.weight(ParamKind::qkv, i), a.dqkv, a.dh, params.grad(ParamKind::qkv, i), 3 * d, d);
    // (the norm of x_mixed: mix_norm_backward)
  }

  Matmul matmul_;
  KernelPaths paths_;
  MatmulAlgorithms algorithms_;  // the products' cuBLASLt candidates in this step
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
inline ShardPlan shard_plan_of(const std::vector<Param>& list, int world_size) {
  std::vector<ParamInfo> infos;
  for (const Param& p : list)
    infos.push_back({p.name, p.shape, is_muon_param(p.kind) ? OptimizerKind::muon : OptimizerKind::adam});
  return plan_shards(infos, world_size);
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
      if (injected_fault() != Fault::no_wait_for_reductions) CUDA_CHECK(cudaStreamWaitEvent(stream, c.reduced, 0));
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
    if (injected_fault() != Fault::no_wait_for_gathers) CUDA_CHECK(cudaStreamWaitEvent(stream, gathered_, 0));
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
    c.complete_after = p.complete_after;
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
      c.complete_after = std::min(c.complete_after, params_.list[param].complete_after);
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
      const ReklsSettings settings{float(h_.rekls_beta1),
                                   float(h_.rekls_beta2),
                                   float(h_.rekls_shampoo_beta),
                                   float(h_.rekls_eps),
                                   float(h_.rekls_weight_decay),
                                   h_.rekls_eigenbasis_every};
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

// DiLoCo's communicators, split from the world once every rank's flags are known to agree: the
// split is the first collective whose calls depend on a flag (--diloco-groups), so ranks started
// with different ones would hang in it rather than be told. Every rank reaches the same verdict, so
// all of them unwind together. (Before any collective only --ranks-share-gpu acts, on NCCL's
// set-up: ranks that differ in it can fail in NCCL's init, before this vote.)
inline ReplicaGroups replica_groups_of_agreed_flags(const Hyperparameters& h, DeviceCommunicator& world) {
  check_same_flags(h, world);
  return ReplicaGroups(world, h.diloco_groups);
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

// DiLoCo's fragments, balanced by element count so that each sync sends about 1/F of the model:
// whole parameters, the largest first (ties in parameter order), each to the fragment holding the
// fewest elements so far (ties to the lowest); each fragment in parameter order. At F = 3 the five
// 38.6M-element tables (embeddings and head) split 2, 2, 1 and the blocks fill the rest
// (docs/DILOCO.md has the sizes).
inline std::vector<std::vector<ParamStorage>> diloco_fragments(const ParameterStore& s, int fragments) {
  std::vector<size_t> by_size(s.list.size());
  std::iota(by_size.begin(), by_size.end(), size_t(0));
  std::stable_sort(by_size.begin(), by_size.end(),
                   [&](size_t a, size_t b) { return s.list[a].numel > s.list[b].numel; });
  std::vector<int> fragment_of(s.list.size());
  std::vector<size_t> elements(static_cast<size_t>(fragments), 0);
  for (size_t i : by_size) {
    fragment_of[i] = int(std::min_element(elements.begin(), elements.end()) - elements.begin());
    elements[size_t(fragment_of[i])] += size_t(s.list[i].numel);
  }
  std::vector<std::vector<ParamStorage>> list(static_cast<size_t>(fragments));
  for (size_t i = 0; i < s.list.size(); ++i) {
    const Param& p = s.list[i];
    void* data = p.is_embedding() ? static_cast<void*>(s.embeddings + p.offset) : static_cast<void*>(s.master + p.offset);
    list[size_t(fragment_of[i])].push_back({data, p.is_embedding(), size_t(p.numel)});
  }
  return list;
}

constexpr const char* kRunFlagsBlob = "run flags";  // resume_flags of the run that wrote the checkpoint
// kernel_flags of the kernels that run used (absent from the checkpoints of trainers older than 2026-11-29)
constexpr const char* kKernelFlagsBlob = "kernel flags";

// The kernel flags in which a run resumed from `c` differs from the run that wrote it ("": none);
// `ran` the flags of the kernels the resumed run uses (after its self-check).
inline std::string kernel_flag_differences(const Checkpoint& c, const Hyperparameters& ran) {
  const std::vector<uint8_t>* saved = c.find(kKernelFlagsBlob);
  if (!saved) return "not recorded (a checkpoint of an older trainer)";
  return resume_flag_differences(std::string(saved->begin(), saved->end()), kernel_flags(ran));
}

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

// The checkpoint's blob `name`, which must hold `size` bytes.
inline const std::vector<uint8_t>& blob_of_size(const Checkpoint& c, const std::string& name, size_t size,
                                                const std::string& path) {
  const std::vector<uint8_t>& bytes = c.blob(name, path);
  if (bytes.size() != size)
    throw CheckpointError(path + ": '" + name + "' holds " + std::to_string(bytes.size()) + " bytes, this model needs " +
                          std::to_string(size) + " (a checkpoint of another configuration?)");
  return bytes;
}

// Before the GPU: a checkpoint's parameters are this model's (their layout, the sizes of the
// embeddings' and masters' blobs), so that one of another configuration, or one without its
// parameters, is refused before the start-up. The optimizers' blobs, sized by the sharding, are
// checked as they are restored.
inline void check_parameter_blobs(const Checkpoint& c, const std::string& path, const GPTConfig& config) {
  const std::vector<Param> list = parameter_list(config);
  const std::string layout = parameter_layout(list);
  if (c.blob(kParameterLayoutBlob, path) != std::vector<uint8_t>(layout.begin(), layout.end()))
    throw CheckpointError(path + ": its parameters are laid out otherwise than this model's (a checkpoint of another "
                          "configuration?)");
  size_t embeddings = 0, masters = 0;
  for (const Param& p : list) (p.is_embedding() ? embeddings : masters) += size_t(p.numel);
  blob_of_size(c, kEmbeddingsBlob, embeddings * sizeof(bf16), path);
  blob_of_size(c, kMastersBlob, masters * sizeof(float), path);
}

// path names the checkpoint in errors ("" for the in-memory warmup snapshot).
inline void restore_state(const Checkpoint& c, const std::string& path, const std::vector<StateBuffer>& state,
                          const ParameterStore& params) {
  for (const StateBuffer& b : state)
    CUDA_CHECK(cudaMemcpy(b.data, blob_of_size(c, b.name, b.bytes, path).data(), b.bytes, cudaMemcpyDefault));
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
// validation tokens. Returns every shard read, by flag, for the run's log.
using DataShards = std::vector<std::pair<std::string, ShardSummary>>;
inline DataShards check_data(const Hyperparameters& h) {
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
  for (const std::string& t : train.files())
    for (const std::string& v : val.files()) {
      std::error_code error;
      if (std::filesystem::equivalent(t, v, error))
        throw DataError(v + " is matched by both --train-files '" + h.train_files + "' and --val-files '" + h.val_files +
                        "': the validation loss would measure training data");
    }
  val.windows_available();
  DataShards shards;
  // the training run reads the shards its steps need, the validation its first window's
  for (const auto& [flag, plan, read] : {std::tuple{"train-files", &train, train.files_read(needed)},
                                         std::tuple{"val-files", &val, val.files_read(1)}}) {
    std::vector<ShardSummary> scanned = plan->scan_all_tokens();
    for (size_t i = 0; i < scanned.size(); ++i) {
      scanned[i].read = i < read;
      shards.emplace_back(flag, std::move(scanned[i]));
    }
  }
  return shards;
}

// The command line as a shell would take it back: an argument with anything but [A-Za-z0-9_./=:,+-]
// in single quotes.
inline std::string command_line(const std::vector<std::string>& args) {
  std::string line;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string a = args[i];
    const bool plain = !a.empty() && a.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                                         "0123456789_./=:,+-") == std::string::npos;
    if (!plain) {
      std::string quoted = "'";
      for (char c : a) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
      a = quoted + "'";
    }
    line += (i ? " " : "") + a;
  }
  return line;
}

// What made the run, in its log's head: the command, where the binary comes from, the ranks, every
// flag's value (defaults included, exact) and every shard with its size and, where the run reads
// it, its token hash (runs that read the same tokens pool, however many shards their globs match).
// tools/records.py reads these lines back and refuses to pool runs whose settings or data differ.
inline std::string run_settings_report(const Hyperparameters& h, const ProcessGroupEnv& g, const std::string& command,
                                       const DataShards& shards) {
  std::ostringstream out;
  out << "command: " << command << "\n"
      << "build: " << kBuildOrigin << "\n"
      << "ranks: world size " << g.world_size << ", ranks per node " << g.local_world_size << ", launcher "
      << g.launcher << "\n";
  std::istringstream flags(exact_flag_lines(h, [](const std::string&) { return true; }));
  for (std::string line; std::getline(flags, line);) out << "setting: " << line << "\n";
  for (const auto& [flag, s] : shards) {
    char hash[17];
    std::snprintf(hash, sizeof hash, "%016" PRIx64, s.token_hash);
    out << "shard: " << flag << " " << s.path << " " << s.bytes << " bytes, "
        << (s.read ? "token hash " + std::string(hash) : std::string("checked, not read (the run ends before it)"))
        << "\n";
  }
  return out.str();
}

// This machine's name ("host" where the system will not say).
inline std::string host_name() {
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) return "host";
  return host;
}

// A folder the run will write into: created, and a file written and removed, now (a file of this
// process's own: the ranks of several nodes may probe one shared folder at once).
inline void check_writable(const std::string& dir, const std::string& what) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  const std::string probe = dir + "/.write_probe." + host_name() + "." + std::to_string(::getpid());
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

// Whether two globs match the same files (the same file by any path, in order, of the same sizes).
inline bool same_shard_files(const std::string& a, const std::string& b) {
  try {
    const std::vector<std::string> x = list_shards(a), y = list_shards(b);
    if (x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i) {
      std::error_code error;
      if (!std::filesystem::equivalent(x[i], y[i], error) ||
          std::filesystem::file_size(x[i], error) != std::filesystem::file_size(y[i], error))
        return false;
    }
    return true;
  } catch (const DataError&) {  // a glob that matches nothing here: not the same data
    return false;
  }
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
  return resume_flag_differences(std::string(saved.begin(), saved.end()), resume_flags(h, world_size),
                                 same_shard_files);
}

// The checkpoint --resume continues from: this rank's newest, read whole and verified (its hashes,
// its step, its settings) before the GPU is touched.
struct ResumePoint {
  std::string path;
  Checkpoint checkpoint;
  std::string differences;  // the settings that differ from the checkpoint's, with --resume-other-settings
};

// Where --checkpoint-dir holds another world size's run: ": ..." saying so, else "". A checkpoint
// resumes on the world size that wrote it: one rank's in the folder itself, rank r's of several in
// rank<r>/.
inline std::string other_world_size(const Hyperparameters& h, const ProcessGroupEnv& g) {
  int ranks = 0;  // the folders rank<r>/ that hold a checkpoint: r + 1 at most
  std::error_code error;
  for (const auto& e : std::filesystem::directory_iterator(h.checkpoint_dir, error)) {
    const std::string name = e.path().filename().string();
    if (name.size() > 4 && name.size() < 10 && name.rfind("rank", 0) == 0 &&
        std::all_of(name.begin() + 4, name.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
        !newest_checkpoint(e.path().string()).empty())
      ranks = std::max(ranks, std::stoi(name.substr(4)) + 1);
  }
  const std::string rule = " (a checkpoint resumes on the world size that wrote it)";
  if (g.world_size == 1 && ranks > 0)
    return ": its folders rank0/ to rank" + std::to_string(ranks - 1) + "/ hold a run of " + std::to_string(ranks) +
           " ranks; resume it with NPROC=" + std::to_string(ranks) + rule;
  if (g.world_size > 1 && !newest_checkpoint(h.checkpoint_dir).empty())
    return ": " + h.checkpoint_dir + " itself holds a one-rank run's checkpoints; resume it with NPROC=1" + rule;
  if (g.world_size > 1 && ranks > 0 && ranks != g.world_size)
    return ": its folders hold a run of " + std::to_string(ranks) + " ranks, this one has " +
           std::to_string(g.world_size) + rule;
  return "";
}

// The checkpoint at `path`, read and checked against this run's settings and model.
inline ResumePoint resume_point_at(const std::string& path, const Hyperparameters& h, int world_size,
                                   const GPTConfig& config) {
  try {
    ResumePoint r;
    r.path = path;
    r.checkpoint = read_checkpoint(r.path);
    r.differences = settings_differences(h, world_size, r.checkpoint, r.path);
    if (!r.differences.empty() && !h.resume_other_settings)
      throw CheckpointError(r.path + ": written by a run with other settings: " + r.differences +
                            " (--resume-other-settings resumes anyway)");
    check_parameter_blobs(r.checkpoint, r.path, config);
    return r;
  } catch (const std::exception& e) {  // filesystem errors too
    throw CheckpointError(std::string("--resume: ") + e.what());
  }
}

// This rank's newest checkpoint, checked before the GPU is touched (TrainingRun::resume then takes
// an older one where another rank lacks this one's step).
inline std::optional<ResumePoint> checkpoint_to_resume(const Hyperparameters& h, const ProcessGroupEnv& g,
                                                       const GPTConfig& config = GPTConfig()) {
  if (!h.resume) return std::nullopt;
  const std::string dir = rank_checkpoint_dir(h, g);
  std::string path;
  try {
    path = newest_checkpoint(dir);
  } catch (const std::exception& e) {  // a folder that cannot be listed
    throw CheckpointError(std::string("--resume: ") + e.what());
  }
  if (path.empty()) throw CheckpointError("--resume: no checkpoint in " + dir + other_world_size(h, g));
  return resume_point_at(path, h, g.world_size, config);
}

// The newest step whose checkpoint every rank holds in its folder `dir`, and this rank's file of it
// ({-1, ""}: none): rank 0's steps, the newest first, each asked of every rank (one round where all
// agree). A run stopped while its ranks wrote a checkpoint leaves that step on some ranks only.
inline std::pair<int, std::string> newest_common_checkpoint(DeviceCommunicator& comm, const std::string& dir) {
  const auto mine = checkpoints_in(dir);
  for (size_t next = 0;; ++next) {
    const double own = comm.rank() != 0 ? 0.0 : next < mine.size() ? mine[next].first : -1.0;  // rank 0's
    const double candidate = comm.all_reduce_sum(own);
    if (candidate < 0) return {-1, ""};
    const auto held = std::find_if(mine.begin(), mine.end(), [&](const auto& c) { return c.first == candidate; });
    if (comm.all_reduce_sum(held != mine.end() ? 1.0 : 0.0) == comm.world_size()) return *held;
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
  p.flash_attention = h.attention != "reference";
  p.fused_attention_backward = h.attention != "flash-split";
  p.warp_specialised_attention_forward = h.attention == "flash-ws";
  p.fp8_head = !h.bf16_head;
  p.fused_e5m2_gradient = h.fp8_gradient == "fused";
  p.batched_muon = h.muon == "batched";
  p.fused_residual_add = h.residual_add == "fused";
  p.fused_mlp_fc = h.mlp_fc == "fused";
  p.fused_qkv = h.qkv == "fused";
  p.qkv_backward_in_attention = h.qkv_backward == "fused";
  p.fp8_logits_candidate = h.fp8_logits_algorithm;
  p.matmul_algorithms = check_matmul_algorithms(h);
  return p;
}

// The flags that select `p` (paths_of's inverse on the path flags; the rest h's): what a run whose
// self-check replaced a fast path really ran, as its checkpoints record it.
inline Hyperparameters flags_of_paths(Hyperparameters h, const KernelPaths& p) {
  h.attention = !p.flash_attention                   ? "reference"
                : p.warp_specialised_attention_forward ? "flash-ws"
                : p.fused_attention_backward          ? "flash"
                                                      : "flash-split";
  h.bf16_head = !p.fp8_head;
  h.fp8_gradient = p.fused_e5m2_gradient ? "fused" : "cast";
  h.muon = p.batched_muon ? "batched" : "per-matrix";
  h.residual_add = p.fused_residual_add ? "fused" : "separate";
  h.mlp_fc = p.fused_mlp_fc ? "fused" : "cublaslt";
  h.qkv = p.fused_qkv ? "fused" : "cublaslt";
  h.qkv_backward = p.qkv_backward_in_attention ? "fused" : "separate";
  h.fp8_logits_algorithm = p.fp8_head ? p.fp8_logits_candidate : 0;
  h.matmul_algorithms = p.matmul_algorithms.text();
  return h;
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

// The stream of the step, validation, DiLoCo's syncs and the self-check: the legacy default stream
// (null), or under programmatic dependent launch (--launch-overlap pdl, which run_training sets
// before anything else) a created one, since whether PDL takes effect on the legacy stream is not
// documented (gpu_device measures it). Created blocking, so that the legacy stream's work (the
// synchronous copies of checkpoints and set-up) stays ordered with it as with the legacy stream itself.
class StepStream {
 public:
  StepStream() {
    if (programmatic_dependent_launch) CUDA_CHECK(cudaStreamCreate(&stream_));
  }
  ~StepStream() {
    if (stream_) cudaStreamDestroy(stream_);
  }
  StepStream(const StepStream&) = delete;
  StepStream& operator=(const StepStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// Runs the checks of the paths it is given: run_self_check's results.
using PathChecks = std::function<std::vector<SelfCheckResult>(const KernelPaths&)>;

// The self-check and its vote: a path fails when it fails on any rank (comm null: this process
// alone), and is replaced by its reference.
inline SelfCheckOutcome self_check_paths(const Hyperparameters& h, DeviceCommunicator* comm, const PathChecks& check) {
  SelfCheckOutcome outcome{paths_of(h), {}, false, ""};
  if (h.self_check == "off") return outcome;
  const auto start = std::chrono::steady_clock::now();
  const std::vector<SelfCheckResult> results = check(outcome.paths);
  size_t checks = results.size(), second_round = 0;
  int failed_checks = 0;
  for (const SelfCheckResult& r : results) {
    outcome.lines.push_back(r.line());
    failed_checks += !r.passed();
  }
  outcome.failed_here = failed_checks > 0;
  // The summary stays after the first round's lines and counts the fallback's second round too
  // (its lines follow the summary), so that it is the whole self-check's.
  const size_t summary_line = outcome.lines.size();
  outcome.lines.emplace_back();
  auto summarise = [&] {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    char summary[160];
    std::snprintf(summary, sizeof summary, "self-check: %zu checks, %d failed, %.1f s", checks, failed_checks, seconds);
    outcome.lines[summary_line] =
        summary + (second_round ? " (" + std::to_string(second_round) + " of them after a fallback, below)" : "");
  };
  summarise();
  // whether any check of `path` in `checks` failed on this rank, and on any rank
  auto vote = [comm](const std::vector<SelfCheckResult>& checks, bool KernelPaths::*path) {
    bool here = false;
    for (const SelfCheckResult& r : checks) here |= r.path == path && !r.passed();
    return std::pair<bool, bool>{here, comm ? comm->all_reduce_sum(here ? 1.0 : 0.0) > 0 : here};
  };
  for (const FastPath& path : fast_paths()) {
    const auto [failed_here, failed] = vote(results, path.member);
    if (!failed) continue;
    outcome.failed_paths += (outcome.failed_paths.empty() ? "" : ", ") + std::string(path.name);
    const std::string where = failed_here ? "here" : "on another rank";
    // The newest flash kernels failing: the earlier flash kernels, checked now (alone), before the reference.
    if (path.member == &KernelPaths::flash_attention && has_earlier_flash_kernels(outcome.paths) &&
        h.self_check == "fallback") {
      KernelPaths earlier = earlier_flash_kernels(outcome.paths);
      for (const FastPath& other : fast_paths())
        if (other.member != &KernelPaths::flash_attention) earlier.*other.member = false;
      std::vector<SelfCheckResult> again = check(earlier);
      for (SelfCheckResult& r : again) {
        r.name.insert(std::string("flash attention").size(), " (flash-split)");
        outcome.lines.push_back(r.line());
        failed_checks += !r.passed();
      }
      checks += again.size();
      second_round += again.size();
      summarise();
      if (!vote(again, path.member).second) {
        outcome.paths.fused_attention_backward = earlier.fused_attention_backward;
        outcome.paths.warp_specialised_attention_forward = earlier.warp_specialised_attention_forward;
        outcome.paths.qkv_backward_in_attention = earlier.qkv_backward_in_attention;
        outcome.lines.push_back("self-check fallback: flash attention (its fused backward or warp-specialised "
                                "forward) failed " + where + "; the two-kernel flash path passed, and this run uses it "
                                "(--attention flash-split): slower, and not a record run");
        continue;
      }
    }
    outcome.paths.*path.member = false;
    if (h.self_check == "fallback")
      outcome.lines.push_back(std::string("self-check fallback: ") + path.name + " failed " + where +
                              "; this run uses its reference (" + path.reference_flag + "): slower, and not a record run");
  }
  return outcome;
}

// The checks in this process, in `stream` (the run's StepStream), on the attention layout of `val`
// (its first tokens, else random documents): the tests', and the run's where its GPU admits one
// process only. A kernel that trapped or faulted leaves the GPU context unusable (every later call
// fails alike): no fallback can follow, so the run stops naming the checks that failed.
inline PathChecks checks_in_this_process(const SelfCheckShape& shape, const ValidationPlan* val, uint16_t bos,
                                         cudaStream_t stream) {
  auto matmul = std::make_shared<std::unique_ptr<Matmul>>();  // made at the first check (none where they run elsewhere)
  const std::vector<uint16_t> layout = self_check_layout(val, shape.attention_tokens, bos);
  return [=](const KernelPaths& paths) {
    if (!*matmul) *matmul = std::make_unique<Matmul>();
    const std::vector<SelfCheckResult> results = run_self_check(shape, paths, layout.data(), bos, **matmul, stream);
    if (const cudaError_t error = cudaDeviceSynchronize(); error != cudaSuccess) {
      std::string failed;
      for (const SelfCheckResult& r : results)
        if (!r.passed()) failed += "\n  " + r.line();
      throw SelfCheckFailed(std::string("self-check: the GPU stopped (") + cudaGetErrorString(error) +
                            "): a check's kernel trapped or faulted, and this process can take no fallback after "
                            "it; the checks that failed:" + failed + "\nrun again with the failing path's reference "
                            "flag (flash attention: --attention flash-split, else --attention reference)");
    }
    return results;
  };
}

// The self-check in this process (the tests').
inline SelfCheckOutcome self_check_paths(const Hyperparameters& h, const SelfCheckShape& shape, uint16_t bos,
                                         const ValidationPlan* val, DeviceCommunicator* comm,
                                         cudaStream_t stream = nullptr) {
  return self_check_paths(h, comm, checks_in_this_process(shape, val, bos, stream));
}

// The run's checks: in processes of their own (this trainer started again with `args`:
// kernels/self_check_process.cuh), so that a kernel that hangs or stops the GPU fails its path
// instead of ending the run, each line they report calling `on_progress`; in this process where
// the GPU admits one process (exclusive-process compute mode).
inline PathChecks run_checks(const std::vector<std::string>& args, const PathChecks& here,
                             const std::function<void()>& on_progress = nullptr) {
  int device = 0, mode = cudaComputeModeDefault;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, device));
  if (mode == cudaComputeModeExclusiveProcess) return here;
  return [args, on_progress](const KernelPaths& paths) {
    return self_check_process::check_in_processes(kThisProgram, args, paths, self_check_process::kSecondsPerGroup,
                                                  on_progress);
  };
}

// --self-check-only: the self-check on this process's GPU, printed; 0 when every check passed.
inline int self_check_alone(Hyperparameters h, const std::vector<std::string>& args) {
  h.self_check = "strict";
  const GPTConfig c;
  const StepStream stream;
  const SelfCheckShape shape = self_check_shape(c);
  const SelfCheckOutcome outcome = self_check_paths(
      h, nullptr,
      run_checks(args, checks_in_this_process(shape, nullptr, c.bos_token, stream.get())));
  std::printf("%s", outcome.report().c_str());
  outcome.stop_if_strict(h);
  return 0;
}

// The trainer's exit status for an error (kExitStatusMeanings).
inline ExitStatus exit_status_of(const std::exception& e) {
  if (dynamic_cast<const FlagError*>(&e)) return kExitBadFlags;
  if (dynamic_cast<const DataError*>(&e)) return kExitBadData;
  if (dynamic_cast<const NoUsableGpu*>(&e)) return kExitNoUsableGpu;
  if (dynamic_cast<const RunFilesError*>(&e)) return kExitRunFiles;
  if (dynamic_cast<const SelfCheckFailed*>(&e)) return kExitSelfCheckFailed;
  return kExitRunFailed;
}

// One training run of this process: the model, its optimizers and data, and rank 0's log.
class TrainingRun {
 public:
  // settings: run_settings_report's lines for the log; args: the trainer's arguments, with which
  // the self-check's processes start
  TrainingRun(const Hyperparameters& h, const ProcessGroupEnv& g, const std::string& settings,
              const std::vector<std::string>& args)
      : h_(h), schedule_(schedule_of(h)), watchdog_(start_watchdog(h, g.rank)), comm_(connect_ranks(g, h.nccl_single_rank)),
        groups_((beat("comparing the ranks' flags"), replica_groups_of_agreed_flags(h, *comm_))), model_(config_, memory_),
        optimizers_(h, model_.params, group(), memory_),
        train_(config_, h.seq_len, /*backward=*/true, memory_, /*fp8_head=*/!h.bf16_head, /*mlp_pre_activations=*/false),
        eval_(config_, h.val_seq_len, false, memory_, false, /*mlp_pre_activations=*/false),
        val_(h.val_files, h.val_tokens, h.val_seq_len, kTokenizerVocab),
        checksum_(memory_.alloc<unsigned long long>("parameter checksum", 1)),
        state_(training_state(model_.params, optimizers_, counters_)), checkpoint_dir_(rank_checkpoint_dir(h, g)) {
    ending_rank_on_error([&] { start(h, g, settings, args); });
  }

  TrainingRun(const TrainingRun&) = delete;
  TrainingRun& operator=(const TrainingRun&) = delete;

  int run(std::optional<ResumePoint> resume_point) {
    return ending_rank_on_error([&] { return train(std::move(resume_point)); });
  }

 private:
  // An error of this rank alone in start() or train() leaves its peers inside a collective.
  // Unwinding could then block, in NCCL's abort or in a cudaFree (which waits for this GPU's
  // collective kernels), before main says why. With peers the error is said and the process ends at
  // once (the launcher stops the others), as a stalled rank's does. (An error while the members are
  // built, out of memory say, unwinds: no collective kernel is in flight by then, the flags' vote done.)
  template <class F>
  auto ending_rank_on_error(F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (const std::exception& e) {
      if (comm_->world_size() > 1) end_rank_now(comm_->rank(), e.what(), exit_status_of(e));
      throw;
    }
  }

  // After the members (every rank's flags already agree: groups_): the seed, the self-check, rank 0's log.
  void start(const Hyperparameters& h, const ProcessGroupEnv& g, const std::string& settings,
             const std::vector<std::string>& args) {
    beat("initialisation");
    // Every rank initialises from rank 0's seed (52 bits: exact through the double all-reduce).
    uint64_t seed = comm_->rank() == 0 ? (h.seed ? h.seed : fresh_seed() & ((uint64_t(1) << 52) - 1)) : 0;
    counters_.seed = uint64_t(comm_->all_reduce_sum(double(seed)));
    initialize_parameters(config_, model_.params, counters_.seed);
    if (groups_.group) {  // every group starts from the same parameters: the global copies
      diloco_ = std::make_unique<DiLoCo>(diloco_settings(h), diloco_fragments(model_.params, h.diloco_fragments),
                                         *groups_.group, *groups_.across);
      diloco_->take_global_copies(step_stream_.get());
      for (const DiLoCo::Buffer& b : diloco_->state_buffers()) state_.push_back({b.name, b.data, b.bytes});
    }
    beat("self-check");
    const SelfCheckShape shape = self_check_shape(config_);
    const SelfCheckOutcome self_check = self_check_paths(
        h, comm_.get(),
        run_checks(args, checks_in_this_process(shape, &val_, config_.bos_token, step_stream_.get()),
                   [this] { beat("self-check"); }));
    if (comm_->rank() == 0 || self_check.failed_here) std::printf("%s", self_check.report().c_str());
    for (const std::string& line : self_check.lines)
      if (comm_->rank() == 0 && line.rfind("self-check fallback:", 0) == 0)
        std::fprintf(stderr, "WARNING: %s\n", line.c_str());
    self_check.stop_if_strict(h);
    paths_ = self_check.paths;
    model_.set_paths(paths_);
    model_.plan_fp8_head(train_, h.seq_len);
    model_.plan_block_matmuls(train_, h.seq_len);
    if (!paths_.fused_mlp_fc)
      for (Activations* acts : {&train_, &eval_}) acts->allocate_mlp_pre_activations(config_, memory_);
    optimizers_.set_batched_muon(paths_.batched_muon);
    if (comm_->rank() == 0) {
      log_ = std::make_unique<RunLog>(h.log_dir, new_run_id());
      log_->header(trainer_source(), environment_report() + settings + self_check.report());
      log_parameters(*log_, h, model_.params.list);
      std::printf("run log: %s (%d rank%s%s, %s)\n", log_->path().c_str(), comm_->world_size(),
                  comm_->world_size() > 1 ? "s" : "",
                  diloco_ ? (" in " + std::to_string(h.diloco_groups) + " DiLoCo groups of " +
                             std::to_string(group().world_size())).c_str()
                          : "",
                  g.launcher.c_str());
    }
  }

  int train(std::optional<ResumePoint> resume_point) {
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
        beat(at + "final DiLoCo average");
        for (const std::string& line : diloco_->finish(step, step_stream_.get())) say(line);
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
      train_step(model_, train_, optimizers_, loader.next(), step, schedule_, paths_.fp8_head, step_stream_.get());
    }
    if (initial) restore_state(*initial, "", state_, model_.params);
  }

  // Each rank verified its own newest checkpoint before the GPU (a rank that could not stopped there,
  // and its launcher stops the others: run.sh at once, others at the rendezvous's deadline). Where
  // the ranks' newest are of different steps (a run stopped while writing one), every rank takes
  // the newest step they all hold.
  void resume(ResumePoint point) {
    beat("resume");
    const auto [step, path] = newest_common_checkpoint(*comm_, checkpoint_dir_);
    const int newest = point.checkpoint.step;
    if (step < 0)
      throw CheckpointError("--resume: no step has a checkpoint on every rank (rank " + std::to_string(comm_->rank()) +
                            "'s newest is step " + std::to_string(newest) + ")");
    const bool older = comm_->all_reduce_sum(newest != step ? 1.0 : 0.0) > 0;
    if (newest != step) {
      point.checkpoint = {};  // one checkpoint in memory at a time
      point = resume_point_at(path, h_, comm_->world_size(), config_);
    }
    restore_state(point.checkpoint, point.path, state_, model_.params);
    if (diloco_) try {
        diloco_->resumed_at(step);
      } catch (const std::runtime_error& e) {
        throw CheckpointError(point.path + ": " + e.what());
      }
    counters_.step = step;
    last_checkpoint_ = point.path;
    const std::string kernels = kernel_flag_differences(point.checkpoint, flags_of_paths(h_, paths_));
    say("resumed from " + point.path + " at step " + std::to_string(step) +
        (older ? " (the newest step every rank holds: a later one's checkpoints are on some ranks only)" : "") +
        (point.differences.empty() ? "" : ", with other settings: " + point.differences) +
        (kernels.empty() ? "" : "; its steps before ran other kernels: " + kernels));
  }

  // The training settings a checkpoint records, of the paths the run really trains (a self-check
  // fallback to the bf16 head is another mathematics, so a resume must ask for it by its flag).
  std::string run_flags() const { return resume_flags(flags_of_paths(h_, paths_), comm_->world_size()); }

  // Groups train apart between syncs: their ranks agree within the group, and all of them after
  // the final DiLoCo sync. The validation loss is the mean over every rank's share of the
  // validation tokens, each scored by its group's model.
  void validate_and_log(int step, bool groups_agree) {
    check_rank_consistency(model_.params, groups_agree ? *comm_ : group(), checksum_, step_stream_.get());
    double val_loss = validate(model_, eval_, val_, schedule_.window_blocks(step), *comm_, step_stream_.get());
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
    const std::string flags = run_flags(), kernels = kernel_flags(flags_of_paths(h_, paths_)),
                      layout = parameter_layout(model_.params.list);
    c.blobs.emplace_back(kRunFlagsBlob, std::vector<uint8_t>(flags.begin(), flags.end()));
    c.blobs.emplace_back(kKernelFlagsBlob, std::vector<uint8_t>(kernels.begin(), kernels.end()));
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
    const bool profiled = step + 1 == h_.profile_step;
    if (profiled) profiler_range_edge(/*start=*/true);
    auto start = std::chrono::steady_clock::now();
    double loss_sum =
        train_step(model_, train_, optimizers_, batch, step, schedule_, paths_.fp8_head, step_stream_.get());
    const std::string sync_line = diloco_ ? diloco_->after_step(step + 1, step_stream_.get()) : "";
    if (profiled) profiler_range_edge(/*start=*/false);
    double step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (timeline) write_timeline(*timeline, step + 1);
    // the console's mean over ranks; a NaN anywhere stops all
    double loss = mean_over_ranks(*comm_, loss_sum, double(batch.num_micro) * batch.micro_len);
    counters_.train_ms += step_ms;
    if (!std::isfinite(loss))
      throw std::runtime_error("training loss is " + std::to_string(loss) + " at step " + std::to_string(step + 1) +
                               "; last good checkpoint: " + last_checkpoint_);
    if (unconfirmed_step_ == step) last_checkpoint_ = unconfirmed_checkpoint_;
    if (step == counters_.step)  // after the first step
      check_rank_consistency(model_.params, group(), checksum_, step_stream_.get());
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
  StepStream step_stream_;
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

// The launcher's environment (RANK, WORLD_SIZE, MASTER_PORT, ...); a value that cannot be is a bad
// setting, as a bad flag is (exit 2).
inline ProcessGroupEnv launcher_environment() {
  try {
    return process_group_from_env();
  } catch (const std::invalid_argument& e) {
    throw FlagError(e.what());
  }
}

// --ranks-share-gpu, before NCCL starts: refused where this process sees several GPUs (each rank
// can have its own, and the flag would only slow NCCL down); else every rank on GPU 0, each with an
// NCCL host id of its own (kernels/host/rendezvous.h). A GPU error is left to select_gpu to name.
inline void share_one_gpu(const ProcessGroupEnv& g) {
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 1)
    throw FlagError("--ranks-share-gpu: this process sees " + std::to_string(count) +
                    " GPUs, so each rank can have its own: leave the flag out (NCCL then takes the fast "
                    "paths), or show each process one GPU (CUDA_VISIBLE_DEVICES=0)");
  std::string settings;
  for (const auto& [name, value] : shared_gpu_nccl_environment(g, host_name())) {
    setenv(name.c_str(), value.c_str(), /*overwrite=*/1);
    settings += " " + name + "=" + value;
  }
  out_of_memory_hint() = "; " + std::to_string(g.world_size) +
                         " ranks share this GPU (--ranks-share-gpu), each with a whole rank's buffers: fewer ranks "
                         "(NPROC) or a shorter --seq-len";
  size_t free_bytes = 0, total_bytes = 0;
  if (g.rank == 0 && cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess)
    std::printf("--ranks-share-gpu: %d ranks on one GPU (%zu MiB free: about %zu a rank), NCCL over sockets on the "
                "loopback (rank 0:%s)\n",
                g.world_size, free_bytes >> 20, (free_bytes >> 20) / g.world_size, settings.c_str());
}

// The process the run's checks start (SPEEDRUN_SELF_CHECK_PATHS: the paths to check): the checks
// on this rank's GPU, on the run's attention layout, each group reported as it goes (but those an
// earlier process ran).
inline int self_check_process_main(const Hyperparameters& h, const std::string& paths) {
  end_with_parent(self_check_process::kParentVariable);  // a hung check must not hold the GPU past its run
  require_hopper_gpu(select_gpu(launcher_environment().local_rank));
  const GPTConfig c;
  const StepStream stream;
  std::unique_ptr<ValidationPlan> val;  // --self-check-only reads no data: random documents
  if (!h.self_check_only) val = std::make_unique<ValidationPlan>(h.val_files, h.val_tokens, h.val_seq_len, kTokenizerVocab);
  const SelfCheckShape shape = self_check_shape(c);
  const char* done = std::getenv(self_check_process::kDoneVariable);
  self_check_process::report_each_group(done ? done : "");
  checks_in_this_process(shape, val.get(), c.bos_token, stream.get())(self_check_process::with_switches(paths_of(h), paths));
  std::printf("@done\n");
  return 0;
}

// Everything that can be checked without the GPU is checked first, so that bad input is named
// before minutes of initialisation (and on machines without a GPU).
// args: the trainer's arguments (args[0] the program), for the log and the self-check's processes
int run_training(const Hyperparameters& h, const std::vector<std::string>& args) {
  programmatic_dependent_launch = h.launch_overlap == "pdl";  // before any launch, the self-check's too
  if (const char* paths = std::getenv(self_check_process::kPathsVariable)) return self_check_process_main(h, paths);
  if (h.self_check_only) {  // no data, no ranks: this GPU's fast paths alone
    require_hopper_gpu(select_gpu(launcher_environment().local_rank));
    return self_check_alone(h, args);
  }
  const DataShards shards = check_data(h);
  const ProcessGroupEnv g = launcher_environment();
  if (h.ranks_share_gpu)
    if (const std::string problem = ranks_share_gpu_problem(g); !problem.empty()) throw FlagError(problem);
  const std::string diloco_problem = diloco_settings_problem(diloco_settings(h), g.world_size, GPTConfig().num_layers);
  if (!diloco_problem.empty()) throw FlagError(diloco_problem);
  check_output_folders(h, g);
  std::optional<ResumePoint> resume_point = checkpoint_to_resume(h, g);
  if (h.ranks_share_gpu) share_one_gpu(g);
  require_hopper_gpu(select_gpu(g.local_rank));
  return TrainingRun(h, g, run_settings_report(h, g, command_line(args), shards), args).run(std::move(resume_point));
}

// ------------------------------------------------------------------------------------------------
#ifndef TRAIN_GPT_NO_MAIN  // tests include this file for its host and device code
int main(int argc, char** argv) {
  // Line by line into a file or pipe too (run.sh sends ranks above 0 to logs/rank<r>.out): a rank
  // its launcher kills keeps every line it printed.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  try {
    Hyperparameters h;
    if (!parse_flags(argc, argv, h)) {
      std::printf("%s", usage(argv[0]).c_str());
      return 0;
    }
    return run_training(h, std::vector<std::string>(argv, argv + argc));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return exit_status_of(e);
  }
}
#endif
