// Host-side data pipeline (SPEC 1.7 and 4.1): the shard reader with its checks, the batch plan
// that reproduces the reference's distributed_data_generator for any world size, the validation
// plan, and a loader that prefetches each rank's micro-sequences on a background thread.
// Every error names the file and what is wrong with it.
#pragma once
#include <glob.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersion = 1;
constexpr int kShardHeaderInts = 256;
constexpr int64_t kShardHeaderBytes = kShardHeaderInts * 4;
constexpr int kTokenizerVocab = 50257;  // GPT-2 token ids are below this
constexpr uint16_t kBosToken = 50256;

struct DataError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The files matching a glob pattern, sorted.
inline std::vector<std::string> list_shards(const std::string& pattern) {
  glob_t g{};
  int rc = glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> files;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) files.emplace_back(g.gl_pathv[i]);
  globfree(&g);
  if (files.empty()) throw DataError("no files match pattern '" + pattern + "'");
  for (const std::string& f : files) {  // a named pipe would block the scan of every shard, silently
    std::error_code error;
    if (!std::filesystem::is_regular_file(f, error))
      throw DataError(f + " (matched by '" + pattern + "') is not a regular file: a shard must be a file, not a named " +
                      "pipe, device or folder");
  }
  std::sort(files.begin(), files.end());
  return files;
}

// The token count of the shard open in f, from its header, checked against the file's size; f is
// left at the first token.
inline int64_t checked_token_count(FILE* f, const std::string& path) {
  int32_t header[kShardHeaderInts];
  if (std::fread(header, 1, kShardHeaderBytes, f) != size_t(kShardHeaderBytes))
    throw DataError(path + (std::ferror(f) ? ": cannot read: " + std::string(std::strerror(errno))
                                           : ": truncated header: shorter than " + std::to_string(kShardHeaderBytes) + " bytes"));
  if (header[0] != kShardMagic)
    throw DataError(path + ": wrong magic " + std::to_string(header[0]) + " (expected " + std::to_string(kShardMagic) + ")");
  if (header[1] != kShardVersion)
    throw DataError(path + ": unsupported version " + std::to_string(header[1]) + " (expected " + std::to_string(kShardVersion) + ")");
  int64_t num_tokens = header[2];
  if (num_tokens < 0) throw DataError(path + ": negative token count " + std::to_string(num_tokens) + " in header");
  std::fseek(f, 0, SEEK_END);
  int64_t actual = std::ftell(f), expected = kShardHeaderBytes + 2 * num_tokens;
  if (actual != expected)
    throw DataError(path + ": size " + std::to_string(actual) + " bytes does not match the header's token count " +
                    std::to_string(num_tokens) + " (expected " + std::to_string(expected) + " bytes)");
  std::fseek(f, kShardHeaderBytes, SEEK_SET);
  return num_tokens;
}

inline std::unique_ptr<FILE, int (*)(FILE*)> open_shard(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw DataError(path + ": cannot open: " + std::strerror(errno));
  return {f, &std::fclose};
}

// The header's token count of a shard, checked against its size, without reading the tokens.
inline int64_t shard_token_count(const std::string& path) { return checked_token_count(open_shard(path).get(), path); }

// The next n tokens of the shard open in f, into tokens.
inline void read_tokens(FILE* f, const std::string& path, uint16_t* tokens, int64_t n) {
  if (std::fread(tokens, 2, size_t(n), f) != size_t(n)) throw DataError(path + ": read failed: " + std::strerror(errno));
}

// tokens[0, n) are the shard's positions first, first + 1, ...: an id >= vocab_size is an error
// naming the file and its position. One max over them (which the compiler vectorises) decides;
// the position is looked for only when it fails.
inline void check_token_ids(const std::string& path, const uint16_t* tokens, int64_t n, int64_t first, int vocab_size) {
  uint16_t largest = 0;
  for (int64_t i = 0; i < n; ++i) largest = tokens[i] > largest ? tokens[i] : largest;
  if (largest < vocab_size) return;
  const int64_t i = std::find_if(tokens, tokens + n, [&](uint16_t t) { return t >= vocab_size; }) - tokens;
  throw DataError(path + ": token id " + std::to_string(tokens[i]) + " at position " + std::to_string(first + i) +
                  " >= vocab size " + std::to_string(vocab_size));
}

// Reads a whole shard and checks its header, its size and every token id.
inline std::vector<uint16_t> read_shard(const std::string& path, int vocab_size) {
  auto file = open_shard(path);
  const int64_t num_tokens = checked_token_count(file.get(), path);
  std::vector<uint16_t> tokens(num_tokens);
  read_tokens(file.get(), path, tokens.data(), num_tokens);
  check_token_ids(path, tokens.data(), num_tokens, 0, vocab_size);
  return tokens;
}

// A 64-bit hash of a shard's tokens, fed in chunks: four independent lanes of 64-bit words (so the
// multiplies overlap) keep it near the speed of memory; it names the data in a run's log, so that
// two runs are known to have read the same tokens. It catches damage and mix-ups, not forgery.
class TokenHash {
 public:
  void add(const uint16_t* tokens, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      for (int lane = 0; lane < 4; ++lane) {
        uint64_t word;
        std::memcpy(&word, tokens + i + 4 * lane, 8);
        mix(lanes_[lane], word);
      }
    for (; i < n; ++i) mix(lanes_[0], tokens[i] | uint64_t(1) << 32);  // the tail, told apart from a word
    count_ += n;
  }
  uint64_t value() const {
    uint64_t h = uint64_t(count_);
    for (uint64_t lane : lanes_) mix(h, lane);
    return h;
  }

 private:
  static void mix(uint64_t& h, uint64_t word) {
    h = (h ^ word) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
  }
  uint64_t lanes_[4] = {0x243F6A8885A308D3ull, 0x13198A2E03707344ull, 0xA4093822299F31D0ull, 0x082EFA98EC4E6C89ull};
  int64_t count_ = 0;
};

// What a run found in one shard: its path, size in bytes, the hash of its tokens, and whether the
// run reads it (a glob may match more shards than a run needs: they are checked, not read).
struct ShardSummary {
  std::string path;
  int64_t bytes = 0;
  uint64_t token_hash = 0;
  bool read = true;
};

// Checks a shard as read_shard does without keeping its tokens, and hashes them: read in chunks of
// 4 MiB, which stay in the CPU's cache for the max and the hash. Near the speed of memory
// (docs/PERF.md: 0.025 s for a FineWeb shard of 100M tokens in the page cache before the hash),
// so that every shard can be checked at start.
inline ShardSummary scan_shard(const std::string& path, int vocab_size) {
  auto file = open_shard(path);
  const int64_t num_tokens = checked_token_count(file.get(), path);
  std::vector<uint16_t> chunk(int64_t(1) << 21);
  TokenHash hash;
  for (int64_t first = 0; first < num_tokens; first += int64_t(chunk.size())) {
    const int64_t n = std::min(int64_t(chunk.size()), num_tokens - first);
    read_tokens(file.get(), path, chunk.data(), n);
    check_token_ids(path, chunk.data(), n, first, vocab_size);
    hash.add(chunk.data(), n);
  }
  return {path, kShardHeaderBytes + 2 * num_tokens, hash.value()};
}

// One optimizer step's global window: M micro-sequences of T tokens, plus the last target.
// Micro-sequence j is tokens + j*T (T + 1 tokens: inputs [0, T), targets [1, T + 1)).
struct GlobalWindow {
  int64_t step;
  std::string shard;
  int64_t pos;
  const uint16_t* tokens;  // [M*T + 1]
};

// The reference's distributed_data_generator with the global batch of SPEC 4.1: files sorted and
// read once each (no cycling); a shard is left, and its tail dropped, once
// pos + M*T + 1 >= its length (so a shard yields a window only from M*T + 2 tokens on).
class BatchPlan {
 public:
  BatchPlan(std::string pattern, int64_t micro_len, int micro_count, int vocab_size)
      : pattern_(std::move(pattern)), files_(list_shards(pattern_)), micro_len_(micro_len),
        micro_count_(micro_count), vocab_size_(vocab_size) {
    if (micro_len < 1 || micro_count < 1)
      throw DataError("batch of " + std::to_string(micro_count) + " x " + std::to_string(micro_len) + " tokens is empty");
  }

  GlobalWindow next() {
    int64_t batch = micro_len_ * micro_count_;
    while (next_file_ == 0 || pos_ + batch + 1 >= int64_t(tokens_.size())) load_next_shard(batch);
    GlobalWindow w{step_++, files_[next_file_ - 1], pos_, tokens_.data() + pos_};
    pos_ += batch;
    return w;
  }

  // The windows all the files give, from their headers alone (no token is read): a run longer than
  // this would stop when the data runs out. A file too small for one window is an error here too.
  int64_t windows_available() const {
    int64_t windows = 0;
    for (const std::string& path : files_) windows += windows_of(path);
    return windows;
  }

  // How many of the files, in order, a run of `steps` windows reads (all of them if they hold fewer).
  size_t files_read(int64_t steps) const {
    size_t files = 0;
    for (int64_t windows = 0; files < files_.size() && windows < steps; ++files) windows += windows_of(files_[files]);
    return std::max<size_t>(files, 1);
  }

  // Every token of every file read and checked (header, size, ids below the vocabulary), none
  // kept: with windows_available, whatever the run would meet in its files is found before it starts.
  std::vector<ShardSummary> scan_all_tokens() const {
    std::vector<ShardSummary> shards;
    for (const std::string& path : files_) shards.push_back(scan_shard(path, vocab_size_));
    return shards;
  }

  int64_t micro_len() const { return micro_len_; }
  int micro_count() const { return micro_count_; }
  const std::vector<std::string>& files() const { return files_; }
  static int rank_of_micro(int j, int world_size) { return j % world_size; }

 private:
  void load_next_shard(int64_t batch) {
    if (next_file_ == files_.size())
      throw DataError("training data exhausted at step " + std::to_string(step_) + ": all " +
                      std::to_string(files_.size()) + " file(s) matching '" + pattern_ +
                      "' are consumed (the loader does not cycle)");
    const std::string& path = files_[next_file_++];
    tokens_ = read_shard(path, vocab_size_);
    pos_ = 0;
    check_shard_fits_batch(path, int64_t(tokens_.size()), batch);
  }

  int64_t windows_of(const std::string& path) const {
    const int64_t batch = micro_len_ * micro_count_, n = shard_token_count(path);
    check_shard_fits_batch(path, n, batch);
    return (n - 2 - batch) / batch + 1;  // windows at pos = k batch while pos + batch + 1 < n
  }

  void check_shard_fits_batch(const std::string& path, int64_t tokens, int64_t batch) const {
    if (tokens < batch + 2)
      throw DataError(path + ": holds " + std::to_string(tokens) + " tokens, too few for one batch of " +
                      std::to_string(micro_count_) + " x " + std::to_string(micro_len_) + " tokens (needs " +
                      std::to_string(batch + 2) + ")");
  }

  std::string pattern_;
  std::vector<std::string> files_;
  int64_t micro_len_;
  int micro_count_;
  int vocab_size_;
  size_t next_file_ = 0;
  std::vector<uint16_t> tokens_;
  int64_t pos_ = 0;
  int64_t step_ = 0;
};

// val_tokens as S = val_tokens / val_seq_len sequences of one window of the first val shard;
// sequence s goes to rank s % W (with W = 8 and S = 40: the reference's 5 validation steps).
class ValidationPlan {
 public:
  ValidationPlan(const std::string& pattern, int64_t val_tokens, int64_t val_seq_len, int vocab_size)
      : seq_len_(val_seq_len) {
    if (val_seq_len < 1 || val_tokens < val_seq_len || val_tokens % val_seq_len != 0)
      throw DataError("val_tokens " + std::to_string(val_tokens) + " is not a positive multiple of val_seq_len " +
                      std::to_string(val_seq_len));
    num_sequences_ = val_tokens / val_seq_len;
    BatchPlan plan(pattern, val_seq_len, int(num_sequences_), vocab_size);
    GlobalWindow w = plan.next();
    tokens_.assign(w.tokens, w.tokens + val_tokens + 1);
  }
  int64_t num_sequences() const { return num_sequences_; }
  int64_t seq_len() const { return seq_len_; }
  const uint16_t* sequence(int64_t s) const { return tokens_.data() + s * seq_len_; }  // [seq_len + 1]
  std::vector<int64_t> sequences_of_rank(int rank, int world_size) const {
    std::vector<int64_t> mine;
    for (int64_t s = rank; s < num_sequences_; s += world_size) mine.push_back(s);
    return mine;
  }

 private:
  int64_t seq_len_, num_sequences_;
  std::vector<uint16_t> tokens_;  // [val_tokens + 1]
};

using HostAlloc = std::function<void*(size_t bytes)>;
using HostFree = std::function<void(void*)>;

// One rank's share of a step: its micro-sequences j = rank, rank + W, ... in increasing j.
struct RankBatch {
  int64_t step;
  int num_micro;
  int64_t micro_len;
  const uint16_t* tokens;  // [num_micro * (T + 1)]
};

// Copies each rank's micro-sequences into host buffers (pinned, when the trainer passes
// cudaHostAlloc) `depth` steps ahead, on a background thread. A buffer handed out by next() stays
// valid until the following call; errors of the thread (exhausted data, a bad shard) surface there.
class PrefetchLoader {
 public:
  PrefetchLoader(BatchPlan plan, int rank, int world_size, int depth = 2, HostAlloc alloc = {}, HostFree free = {})
      : plan_(std::move(plan)), rank_(rank), world_size_(world_size),
        free_(free ? free : HostFree([](void* p) { std::free(p); })) {
    if (depth < 1) throw DataError("prefetch depth must be >= 1");
    int num_micro = 0;
    for (int j = rank; j < plan_.micro_count(); j += world_size) ++num_micro;
    size_t bytes = std::max<size_t>(1, size_t(num_micro) * (plan_.micro_len() + 1) * sizeof(uint16_t));
    HostAlloc allocate = alloc ? alloc : HostAlloc([](size_t n) { return std::malloc(n); });
    for (int i = 0; i < depth + 1; ++i) {  // depth filled ahead + the one handed out last
      auto* buffer = static_cast<uint16_t*>(allocate(bytes));
      if (!buffer) {
        free_buffers();
        // not the data's fault: a plain runtime_error (the trainer's exit 1), not a DataError (3)
        throw std::runtime_error("cannot allocate " + std::to_string(bytes) + " bytes of host buffer for the batches");
      }
      buffers_.push_back(buffer);
      batches_.push_back({0, num_micro, plan_.micro_len(), buffer});
    }
    worker_ = std::thread([this] { fill_loop(); });
  }

  ~PrefetchLoader() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
    free_buffers();
  }

  const RankBatch& next() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (handed_out_) {  // the previous buffer may be refilled now
      handed_out_ = false;
      ++consumed_;
      cv_.notify_all();
    }
    cv_.wait(lock, [&] { return filled_ > consumed_ || error_; });
    if (filled_ == consumed_ && error_) std::rethrow_exception(error_);
    handed_out_ = true;
    return batches_[consumed_ % batches_.size()];
  }

 private:
  void fill_loop() {
    try {
      for (;;) {
        {
          std::unique_lock<std::mutex> lock(mutex_);
          cv_.wait(lock, [&] { return stop_ || filled_ - consumed_ < int64_t(buffers_.size()); });
          if (stop_) return;
        }
        GlobalWindow w = plan_.next();
        size_t slot = filled_ % buffers_.size();
        copy_rank_micro_sequences(w, buffers_[slot]);
        batches_[slot].step = w.step;
        std::lock_guard<std::mutex> lock(mutex_);
        ++filled_;
        cv_.notify_all();
      }
    } catch (const DataError&) {
      fail(std::current_exception());
    } catch (const std::exception& e) {  // e.g. bad_alloc reading a shard: still a data error to the caller
      fail(std::make_exception_ptr(DataError(std::string("data loader thread failed: ") + e.what())));
    }
  }

  void fail(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = error;
    cv_.notify_all();
  }

  void free_buffers() {
    for (uint16_t* buffer : buffers_) free_(buffer);
    buffers_.clear();
  }

  void copy_rank_micro_sequences(const GlobalWindow& w, uint16_t* out) const {
    int64_t T = plan_.micro_len();
    for (int j = rank_; j < plan_.micro_count(); j += world_size_, out += T + 1)
      std::memcpy(out, w.tokens + j * T, (T + 1) * sizeof(uint16_t));
  }

  BatchPlan plan_;
  int rank_, world_size_;
  HostFree free_;
  std::vector<uint16_t*> buffers_;  // a ring of depth + 1, each [num_micro * (T + 1)]
  std::vector<RankBatch> batches_;  // batches_[i].tokens == buffers_[i]
  std::thread worker_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int64_t filled_ = 0, consumed_ = 0;  // slots filled by the thread / released by the consumer
  bool handed_out_ = false, stop_ = false;
  std::exception_ptr error_;
};
