// The checkpoint file: named byte blobs (parameters, optimizer state, the flags that shaped them),
// each with a hash that catches a damaged file, in one file written to a temporary name and renamed,
// so that a crash never leaves a torn checkpoint under the real name. The data position is the
// step. What goes into a checkpoint, and whether a run may resume from it, is the trainer's.
// (tests/checkpoint_files.py reads and writes the same format.)
#pragma once
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

// The files a run writes or resumes from: a folder it cannot write, a checkpoint it cannot continue.
struct RunFilesError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct CheckpointError : RunFilesError {
  using RunFilesError::RunFilesError;
};

struct Checkpoint {
  int step = 0;
  std::vector<std::pair<std::string, std::vector<uint8_t>>> blobs;  // in writing order

  const std::vector<uint8_t>* find(const std::string& name) const {
    for (const auto& [n, bytes] : blobs)
      if (n == name) return &bytes;
    return nullptr;
  }
  const std::vector<uint8_t>& blob(const std::string& name, const std::string& path) const {
    if (const std::vector<uint8_t>* bytes = find(name)) return *bytes;
    throw CheckpointError(path + ": no '" + name + "' in the checkpoint");
  }
};

constexpr char kCheckpointMagic[8] = {'S', 'P', 'D', 'R', 'C', 'K', 'P', '2'};

// A 64-bit hash of bytes, 8 at a time (fast enough for gigabytes): catches damage, not forgery.
inline uint64_t checkpoint_hash(const std::vector<uint8_t>& bytes) {
  uint64_t h = 0x243F6A8885A308D3ull ^ bytes.size();
  auto mix = [&h](uint64_t word) {
    h = (h ^ word) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
  };
  size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    uint64_t word;
    std::memcpy(&word, bytes.data() + i, 8);
    mix(word);
  }
  uint64_t tail = 0;
  if (i < bytes.size()) std::memcpy(&tail, bytes.data() + i, bytes.size() - i);  // (an empty blob's data() may be null)
  mix(tail);
  return h;
}

inline std::string checkpoint_path(const std::string& dir, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%06d.ckpt", step);
  return dir + "/" + name;
}

// The bytes reach the disk (fsync) before the rename makes them the checkpoint of that step. Every
// failure is a CheckpointError naming the file (exit status 5), and leaves no temporary file.
inline void write_checkpoint(const std::string& dir, const Checkpoint& c) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) throw CheckpointError(dir + ": cannot create the checkpoint folder: " + error.message());
  std::string path = checkpoint_path(dir, c.step), temp = path + ".tmp";
  {
    std::unique_ptr<FILE, int (*)(FILE*)> out(std::fopen(temp.c_str(), "wb"), &std::fclose);
    if (!out) throw CheckpointError(temp + ": cannot create: " + std::strerror(errno));
    bool ok = true;
    auto put = [&](const void* p, size_t n) { ok = ok && (n == 0 || std::fwrite(p, 1, n, out.get()) == n); };
    auto put_u64 = [&](uint64_t v) { put(&v, sizeof v); };
    put(kCheckpointMagic, sizeof kCheckpointMagic);
    put_u64(uint64_t(c.step));
    put_u64(c.blobs.size());
    for (const auto& [name, bytes] : c.blobs) {
      put_u64(name.size());
      put(name.data(), name.size());
      put_u64(bytes.size());
      put(bytes.data(), bytes.size());
      put_u64(checkpoint_hash(bytes));
    }
    if (!ok || std::fflush(out.get()) != 0 || ::fsync(::fileno(out.get())) != 0) {
      const std::string reason = std::strerror(errno);
      out.reset();
      std::error_code ignored;  // the write's failure is the one to report
      std::filesystem::remove(temp, ignored);
      throw CheckpointError(temp + ": write failed: " + reason);
    }
  }
  std::filesystem::rename(temp, path, error);
  if (error) {
    const std::string reason = error.message();
    std::filesystem::remove(temp, error);  // (clears `error` when it succeeds)
    throw CheckpointError(path + ": cannot rename " + temp + " to it: " + reason);
  }
  // The rename itself reaches the disk; best effort (some file systems cannot sync a folder).
  const int folder = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (folder >= 0) ::fsync(folder), ::close(folder);
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
  const uint64_t step = get_u64("the step");
  if (step > uint64_t(std::numeric_limits<int>::max())) throw CheckpointError(path + ": corrupt checkpoint (step " + std::to_string(step) + ")");
  c.step = int(step);
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
    if (get_u64("a hash") != checkpoint_hash(bytes)) throw CheckpointError(path + ": '" + name + "' is damaged (its hash differs)");
    c.blobs.emplace_back(std::move(name), std::move(bytes));
  }
  if (in.peek() != std::char_traits<char>::eof()) throw CheckpointError(path + ": trailing bytes after the last blob");
  return c;
}

// The checkpoints in dir (files named step_<digits>.ckpt), (step, path), the newest first.
// Temporary files of an interrupted write and other names are ignored.
inline std::vector<std::pair<int, std::string>> checkpoints_in(const std::string& dir) {
  std::vector<std::pair<int, std::string>> found;
  if (!std::filesystem::is_directory(dir)) return found;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const size_t digits = name.size() - std::min(name.size(), sizeof "step_.ckpt" - 1);
    if (digits == 0 || digits > 9 || name.rfind("step_", 0) != 0 || name.compare(5 + digits, 5, ".ckpt") != 0 ||
        !std::all_of(name.begin() + 5, name.begin() + 5 + digits, [](char ch) { return ch >= '0' && ch <= '9'; }))
      continue;
    found.emplace_back(std::stoi(name.substr(5, digits)), entry.path().string());
  }
  std::sort(found.begin(), found.end(), std::greater<>());
  return found;
}

// The checkpoint of the highest step in dir, or "" when there is none.
inline std::string newest_checkpoint(const std::string& dir) {
  const auto found = checkpoints_in(dir);
  return found.empty() ? "" : found.front().second;
}
