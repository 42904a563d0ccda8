// The data pipeline: every bad input gives a message naming the file and the problem; the batch
// plan reproduces the reference generator (rollover, tail dropping, the >= boundary); ranks
// partition the micro-sequences; the prefetching loader hands each rank exactly its share.
#include "check.h"
#include "data/dataloader.h"

#include <unistd.h>

#include <fstream>
#include <optional>
#include <set>

namespace {

std::string temp_dir() {
  static std::string dir = [] {
    char tmpl[] = "/tmp/speedrun_data_XXXXXX";
    if (!mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
    return std::string(tmpl);
  }();
  return dir;
}

// Writes a shard with the given header fields and tokens; returns its path.
std::string write_shard(const std::string& name, const std::vector<uint16_t>& tokens, int32_t magic = kShardMagic,
                        int32_t version = kShardVersion, std::optional<int32_t> header_count = {},
                        size_t extra_bytes = 0) {
  std::string path = temp_dir() + "/" + name;
  std::vector<int32_t> header(kShardHeaderInts, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = header_count.value_or(int32_t(tokens.size()));
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(header.data()), kShardHeaderBytes);
  f.write(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  std::string pad(extra_bytes, 'x');
  f.write(pad.data(), pad.size());
  return path;
}

// Tokens start, start + 1, ... (mod 50000), so every position is recognisable.
std::vector<uint16_t> counting_tokens(size_t n, int start) {
  std::vector<uint16_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = uint16_t((start + i) % 50000);
  return t;
}

// The reference generator written out plainly: windows as (shard index, pos) pairs.
std::vector<std::pair<int, int64_t>> reference_windows(const std::vector<size_t>& shard_lengths, int64_t batch) {
  std::vector<std::pair<int, int64_t>> out;
  size_t file = 0;
  int64_t len = int64_t(shard_lengths[file]), pos = 0;
  for (;;) {
    if (pos + batch + 1 >= len) {
      if (++file == shard_lengths.size()) return out;
      len = int64_t(shard_lengths[file]);
      pos = 0;
    }
    out.push_back({int(file), pos});
    pos += batch;
  }
}

}  // namespace

TEST_CASE("bad shards: each error names the file and the problem") {
  std::vector<uint16_t> ok = counting_tokens(100, 0);
  std::string magic = write_shard("bad_magic.bin", ok, 12345);
  CHECK_THROWS_WITH(read_shard(magic, kTokenizerVocab), "bad_magic.bin", "wrong magic 12345", "20240520");
  std::string version = write_shard("bad_version.bin", ok, kShardMagic, 7);
  CHECK_THROWS_WITH(read_shard(version, kTokenizerVocab), "bad_version.bin", "unsupported version 7");
  std::string truncated = write_shard("truncated_tokens.bin", ok, kShardMagic, kShardVersion, 120);
  CHECK_THROWS_WITH(read_shard(truncated, kTokenizerVocab), "truncated_tokens.bin", "size 1224 bytes",
                    "token count 120", "expected 1264 bytes");
  std::string trailing = write_shard("trailing_bytes.bin", ok, kShardMagic, kShardVersion, {}, 3);
  CHECK_THROWS_WITH(read_shard(trailing, kTokenizerVocab), "trailing_bytes.bin", "size 1227 bytes",
                    "token count 100", "expected 1224 bytes");
  std::string negative = write_shard("negative_count.bin", ok, kShardMagic, kShardVersion, -5);
  CHECK_THROWS_WITH(read_shard(negative, kTokenizerVocab), "negative_count.bin", "negative token count -5");
  std::string header_only = temp_dir() + "/short_header.bin";
  std::ofstream(header_only, std::ios::binary) << "tiny";
  CHECK_THROWS_WITH(read_shard(header_only, kTokenizerVocab), "short_header.bin", "truncated header");
  std::vector<uint16_t> big = ok;
  big[42] = 50300;
  std::string out_of_range = write_shard("big_token.bin", big);
  CHECK_THROWS_WITH(read_shard(out_of_range, kTokenizerVocab), "big_token.bin", "token id 50300", "position 42",
                    "vocab size 50257");
  CHECK_THROWS_WITH(read_shard(temp_dir() + "/missing.bin", kTokenizerVocab), "missing.bin", "cannot open");
  CHECK_THROWS_WITH(list_shards(temp_dir() + "/nothing_*.bin"), "no files match pattern", "nothing_*.bin");
}

TEST_CASE("too few tokens for the requested batch: the >= boundary of the reference") {
  write_shard("edge_a_000.bin", counting_tokens(4 * 8 + 1, 0));  // M*T + 1 tokens: never a window
  CHECK_THROWS_WITH(BatchPlan(temp_dir() + "/edge_a_*.bin", 8, 4, kTokenizerVocab).next(), "edge_a_000.bin",
                    "holds 33 tokens", "too few for one batch", "needs 34");
  write_shard("edge_b_000.bin", counting_tokens(4 * 8 + 2, 0));  // M*T + 2: exactly one window
  BatchPlan plan(temp_dir() + "/edge_b_*.bin", 8, 4, kTokenizerVocab);
  GlobalWindow w = plan.next();
  CHECK(w.pos == 0 && w.tokens[32] == 32);
  CHECK_THROWS_WITH(plan.next(), "exhausted at step 1", "1 file(s)", "does not cycle");
}

TEST_CASE("batch plan equals the reference generator over shards, with rollover and tail drop") {
  std::vector<size_t> lengths = {1000, 777, 64 + 2, 1500};
  for (size_t f = 0; f < lengths.size(); ++f)
    write_shard("plan_" + std::to_string(f) + ".bin", counting_tokens(lengths[f], int(f) * 10000));
  for (auto [T, M] : std::vector<std::pair<int, int>>{{8, 8}, {16, 4}, {32, 2}, {5, 3}}) {
    BatchPlan plan(temp_dir() + "/plan_*.bin", T, M, kTokenizerVocab);
    std::vector<std::pair<int, int64_t>> expected = reference_windows(lengths, int64_t(T) * M);
    for (size_t k = 0; k < expected.size(); ++k) {
      GlobalWindow w = plan.next();
      CHECK(w.step == int64_t(k));
      CHECK(w.pos == expected[k].second);
      CHECK(w.shard.find("plan_" + std::to_string(expected[k].first)) != std::string::npos);
      for (int j = 0; j < M; ++j)  // micro-sequence j: T + 1 consecutive tokens from pos + j*T
        CHECK(w.tokens[j * T + T] == uint16_t(expected[k].first * 10000 + expected[k].second + j * T + T));
    }
    CHECK_THROWS_WITH(plan.next(), "exhausted");
    CHECK(plan.windows_available() == int64_t(expected.size()));  // from the headers alone
  }
}

TEST_CASE("windows available from the headers: every shard checked, none read") {
  write_shard("count_0.bin", counting_tokens(4 * 8 + 2, 0));  // one window
  write_shard("count_1.bin", counting_tokens(3 * 32 + 2, 0));  // three
  const BatchPlan counted(temp_dir() + "/count_*.bin", 8, 4, kTokenizerVocab);
  CHECK(counted.windows_available() == 4);
  // the files a run of so many steps reads, in order: the first holds one window, the second three
  CHECK(counted.files_read(1) == 1 && counted.files_read(2) == 2 && counted.files_read(4) == 2);
  CHECK(counted.files_read(9) == 2 && counted.files_read(0) == 1);
  write_shard("count_2.bin", counting_tokens(20, 0), kShardMagic, kShardVersion, 25);  // truncated, never reached
  CHECK_THROWS_WITH(BatchPlan(temp_dir() + "/count_*.bin", 8, 4, kTokenizerVocab).windows_available(), "count_2.bin",
                    "does not match the header's token count 25");
  write_shard("small_0.bin", counting_tokens(200, 0));
  write_shard("small_1.bin", counting_tokens(30, 0));
  CHECK_THROWS_WITH(BatchPlan(temp_dir() + "/small_*.bin", 8, 4, kTokenizerVocab).windows_available(), "small_1.bin",
                    "too few for one batch");
  CHECK_THROWS_WITH(read_shard(temp_dir(), kTokenizerVocab), "cannot read");  // a directory
}

TEST_CASE("the start-up scan: every token of every shard of a glob, across its read chunks, hashed") {
  write_shard("scan_0.bin", counting_tokens(1000, 0));
  std::vector<uint16_t> later = counting_tokens((size_t(1) << 21) + 100, 0);  // more than one 4 MiB chunk
  write_shard("scan_1.bin", later);
  BatchPlan plan(temp_dir() + "/scan_*.bin", 8, 4, kTokenizerVocab);
  const std::vector<ShardSummary> shards = plan.scan_all_tokens();
  CHECK(shards.size() == 2 && shards[1].path == temp_dir() + "/scan_1.bin");
  CHECK(shards[1].bytes == kShardHeaderBytes + 2 * int64_t(later.size()));
  // The hash of the tokens read in chunks is the hash of all of them at once, and one token changes it.
  TokenHash whole;
  whole.add(later.data(), int64_t(later.size()));
  CHECK(shards[1].token_hash == whole.value() && shards[0].token_hash != whole.value());
  std::vector<uint16_t> one_changed = later;
  one_changed[(size_t(1) << 21) + 99] ^= 1;  // in the tail, past the last whole group of 16
  write_shard("scan_1.bin", one_changed);
  CHECK(scan_shard(temp_dir() + "/scan_1.bin", kTokenizerVocab).token_hash != whole.value());
  one_changed = later;
  std::swap(one_changed[0], one_changed[4]);  // two tokens of two lanes swapped
  write_shard("scan_1.bin", one_changed);
  CHECK(scan_shard(temp_dir() + "/scan_1.bin", kTokenizerVocab).token_hash != whole.value());
  later[(size_t(1) << 21) + 7] = 50257;  // in the second chunk, of the second shard
  write_shard("scan_1.bin", later);
  CHECK_THROWS_WITH(plan.scan_all_tokens(), "scan_1.bin", "token id 50257 at position 2097159", "vocab size 50257");
  CHECK_THROWS_WITH(read_shard(temp_dir() + "/scan_1.bin", kTokenizerVocab), "token id 50257 at position 2097159");
  later[3] = 65535;  // the first bad id is named
  write_shard("scan_1.bin", later);
  CHECK_THROWS_WITH(scan_shard(temp_dir() + "/scan_1.bin", kTokenizerVocab), "token id 65535 at position 3 ");
  write_shard("scan_1.bin", counting_tokens(100, 0), kShardMagic, kShardVersion, 120);  // and the sizes
  CHECK_THROWS_WITH(plan.scan_all_tokens(), "scan_1.bin", "does not match the header's token count 120");
}

TEST_CASE("ranks partition the micro-sequences: j goes to rank j mod W") {
  for (int W : {1, 2, 3, 5, 8}) {
    std::multiset<int> seen;
    for (int r = 0; r < W; ++r)
      for (int j = 0; j < 8; ++j)
        if (BatchPlan::rank_of_micro(j, W) == r) seen.insert(j);
    CHECK(seen.size() == 8 && std::set<int>(seen.begin(), seen.end()).size() == 8);
  }
}

TEST_CASE("validation plan: sequences, rank split, divisibility and size errors") {
  write_shard("val_000.bin", counting_tokens(10 * 16 + 2, 7));
  ValidationPlan val(temp_dir() + "/val_*.bin", 10 * 16, 16, kTokenizerVocab);
  CHECK(val.num_sequences() == 10);
  CHECK(val.sequence(3)[0] == 7 + 48 && val.sequence(9)[16] == 7 + 160);
  for (int W : {1, 3, 8}) {
    std::set<int64_t> all;
    for (int r = 0; r < W; ++r)
      for (int64_t s : val.sequences_of_rank(r, W)) CHECK(all.insert(s).second && s % W == r);
    CHECK(all.size() == 10);
  }
  CHECK_THROWS_WITH(ValidationPlan(temp_dir() + "/val_*.bin", 100, 16, kTokenizerVocab), "not a positive multiple");
  CHECK_THROWS_WITH(ValidationPlan(temp_dir() + "/val_*.bin", 11 * 16, 16, kTokenizerVocab), "val_000.bin", "too few");
}

TEST_CASE("prefetch loader: each rank gets exactly its micro-sequences, errors surface from next()") {
  std::vector<size_t> lengths = {3000, 2000};
  for (size_t f = 0; f < lengths.size(); ++f)
    write_shard("loader_" + std::to_string(f) + ".bin", counting_tokens(lengths[f], int(f) * 20000));
  const int T = 16, M = 8, W = 3;
  for (int depth : {1, 3}) {
    for (int rank = 0; rank < W; ++rank) {
      BatchPlan reference(temp_dir() + "/loader_*.bin", T, M, kTokenizerVocab);
      PrefetchLoader loader(BatchPlan(temp_dir() + "/loader_*.bin", T, M, kTokenizerVocab), rank, W, depth);
      int steps = 0;
      for (;; ++steps) {
        GlobalWindow w;
        try {
          w = reference.next();
        } catch (const DataError&) {
          CHECK_THROWS_WITH(loader.next(), "exhausted");
          break;
        }
        const RankBatch& b = loader.next();
        CHECK(b.step == w.step && b.num_micro == (rank < M % W ? M / W + 1 : M / W));
        int i = 0;
        for (int j = rank; j < M; j += W, ++i)
          CHECK(std::equal(w.tokens + j * T, w.tokens + j * T + T + 1, b.tokens + i * (T + 1)));
      }
      CHECK(steps > 20);
    }
  }
}

TEST_CASE("prefetch loader: the caller's allocator, and ranks with no micro-sequence when W > M") {
  write_shard("alloc_000.bin", counting_tokens(500, 0));
  int live = 0, allocations = 0;
  HostAlloc counting_alloc = [&](size_t n) { ++live, ++allocations; return std::malloc(n); };
  HostFree counting_free = [&](void* p) { --live; std::free(p); };
  {
    const int M = 4, W = 6;
    PrefetchLoader idle(BatchPlan(temp_dir() + "/alloc_*.bin", 8, M, kTokenizerVocab), 5, W, 2, counting_alloc,
                        counting_free);
    const RankBatch& b = idle.next();
    CHECK(b.step == 0 && b.num_micro == 0 && b.micro_len == 8);
    CHECK(idle.next().step == 1);
  }
  CHECK(allocations == 3 && live == 0);
  // a failed allocation (pinned memory, say) is the machine's failure, not bad data
  int granted = 1;
  HostAlloc failing_alloc = [&](size_t n) { return granted-- > 0 ? std::malloc(n) : nullptr; };
  bool machine_error = false;
  try {
    PrefetchLoader(BatchPlan(temp_dir() + "/alloc_*.bin", 8, 4, kTokenizerVocab), 0, 1, 2, failing_alloc, HostFree());
  } catch (const DataError&) {
  } catch (const std::runtime_error& e) {
    machine_error = std::string(e.what()).find("bytes of host buffer for the batches") != std::string::npos;
  }
  CHECK(machine_error);
}

TEST_CASE("prefetch loader: a bad shard reached mid-run surfaces from next() after the good steps") {
  write_shard("midrun_000.bin", counting_tokens(8 * 4 * 3 + 2, 0));  // exactly 3 windows of 4 x 8
  write_shard("midrun_001.bin", counting_tokens(100, 0), 999);
  PrefetchLoader loader(BatchPlan(temp_dir() + "/midrun_*.bin", 8, 4, kTokenizerVocab), 1, 2, 2);
  for (int64_t step = 0; step < 3; ++step) CHECK(loader.next().step == step);
  CHECK_THROWS_WITH(loader.next(), "midrun_001.bin", "wrong magic 999");
}

TEST_CASE("prefetch loader: destroyed while its thread waits, without hanging") {
  write_shard("stop_000.bin", counting_tokens(5000, 0));
  for (int i = 0; i < 20; ++i) {
    PrefetchLoader loader(BatchPlan(temp_dir() + "/stop_*.bin", 16, 4, kTokenizerVocab), 0, 2, 2);
    if (i % 2) loader.next();
  }
  CHECK(true);
}

TEST_CASE("bundled sample: valid shards, 28 steps of 49,152 tokens, 2 validation sequences") {
  BatchPlan plan("data/sample/sample_train_*.bin", 49152, 1, kTokenizerVocab);
  int steps = 0;
  try {
    for (;; ++steps) CHECK(plan.next().tokens[0] < kTokenizerVocab);
  } catch (const DataError& e) {
    CHECK(std::string(e.what()).find("exhausted at step 28") != std::string::npos);
  }
  CHECK(steps == 28);
  ValidationPlan val("data/sample/sample_val_*.bin", 2 * 262144, 262144, kTokenizerVocab);
  CHECK(val.num_sequences() == 2 && val.sequence(0)[0] == kBosToken);
}

int main() {
  int rc = check::run_checks();
  std::string cleanup = "rm -rf " + temp_dir();
  if (std::system(cleanup.c_str()) != 0) std::printf("could not remove %s\n", temp_dir().c_str());
  return rc;
}
