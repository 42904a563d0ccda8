// The launcher side of distributed runs without a GPU: ranks from the environments of torchrun,
// mpirun and srun (with the errors naming the variable), and the TCP exchange of NCCL's id between
// real local processes (fork): everyone gets rank 0's bytes, a late rank 0 is waited for, a
// missing rank or a missing rank 0 ends in an error that names it, within the timeout; a silent
// connection holds no one up; a duplicate or misconfigured rank stops every connected process at once.
#include "check.h"
#include "kernels/host/rendezvous.h"

#include <sys/wait.h>

#include <map>
#include <random>

namespace {

using Env = std::map<std::string, std::string>;

ProcessGroupEnv parse(const Env& env) {
  return process_group_from_env([&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

// A port that was free a moment ago (bound to 0, read back, released).
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  CHECK(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  CHECK(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  socklen_t len = sizeof addr;
  CHECK(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  ::close(fd);
  return ntohs(addr.sin_port);
}

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

constexpr int kSilent = -1;  // a process that connects to rank 0 and never says hello

// One process of an exchange: its rank (or kSilent), when it starts, and the world size and
// timeout it was given if not the job's (a misconfigured launch).
struct Process {
  int rank;
  milliseconds delay{0};
  int world_size = 0;
  milliseconds timeout{0};
};

struct Outcome {
  std::string error;  // "" for success; a silent process: what rank 0 sent it before closing
  double seconds;     // from the exchange's start to the process's end
};

// A rank's exchange; returns its error ("" when it ends with rank 0's bytes).
std::string run_rank(const Process& p, int world_size, int port, const UniqueIdBytes& expected, milliseconds timeout) {
  if (p.timeout.count()) timeout = p.timeout;
  try {
    ProcessGroupEnv g;
    g.rank = p.rank;
    g.world_size = p.world_size ? p.world_size : world_size;
    g.id_port = port;
    UniqueIdBytes id{};
    if (p.rank == 0) id = expected;
    broadcast_id_over_tcp(g, id, timeout);
    return id == expected ? "" : "rank " + std::to_string(p.rank) + " received other bytes";
  } catch (const std::exception& e) {
    return e.what();
  }
}

// A connection that never says hello: returns the text rank 0 sent it (if any) once rank 0 closes it.
std::string stay_silent(int port, milliseconds timeout) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(uint16_t(port));
  const Clock::time_point deadline = Clock::now() + timeout;
  int fd = -1;
  while (Clock::now() < deadline) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) break;
    ::close(fd);
    fd = -1;
    std::this_thread::sleep_for(milliseconds(10));
  }
  if (fd < 0) return "the silent process could not connect";
  std::string received;
  char buffer[2048];
  for (ssize_t n; (n = ::recv(fd, buffer, sizeof buffer, 0)) > 0;) received.append(buffer, size_t(n));
  ::close(fd);
  return received.size() > 4 ? std::string(received.c_str() + 4) : "";  // after the status word
}

// Runs the exchange in one child process per listed process; each child writes its outcome to a
// pipe. Returns the outcomes in the order listed. Children are killed after a hard deadline, so
// the test never hangs.
std::vector<Outcome> exchange(int world_size, const std::vector<Process>& processes, milliseconds timeout) {
  const int port = free_port();
  UniqueIdBytes expected;
  std::mt19937 rng(port);
  for (char& c : expected) c = char(rng());
  std::vector<std::pair<pid_t, int>> children;  // (pid, read end)
  const Clock::time_point start = Clock::now();
  milliseconds latest{0};
  for (const Process& p : processes) {
    latest = std::max(latest, p.delay);
    int fds[2];
    CHECK(::pipe(fds) == 0);
    std::fflush(stdout);  // else each child would print the parent's buffered lines again
    pid_t pid = ::fork();
    CHECK(pid >= 0);
    if (pid == 0) {
      ::close(fds[0]);
      std::this_thread::sleep_for(p.delay);
      std::string error = p.rank == kSilent ? stay_silent(port, timeout) : run_rank(p, world_size, port, expected, timeout);
      (void)!::write(fds[1], error.data(), error.size());
      ::_exit(error.empty() ? 0 : 1);
    }
    ::close(fds[1]);
    children.push_back({pid, fds[0]});
  }
  std::vector<Outcome> outcomes;
  const Clock::time_point hard_deadline = start + timeout + latest + std::chrono::seconds(5);
  for (auto [pid, pipe] : children) {
    int status = 0;
    Outcome o;
    while (::waitpid(pid, &status, WNOHANG) == 0) {
      if (Clock::now() > hard_deadline) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        o.error = "hung";
        break;
      }
      std::this_thread::sleep_for(milliseconds(5));
    }
    o.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    char buffer[2048];
    ssize_t n = ::read(pipe, buffer, sizeof buffer);
    ::close(pipe);
    if (o.error.empty() && n > 0) o.error.assign(buffer, size_t(n));
    outcomes.push_back(o);
  }
  return outcomes;
}

std::vector<Process> all_ranks(int world_size, milliseconds rank0_delay = milliseconds(0)) {
  std::vector<Process> all{{0, rank0_delay}};
  for (int r = 1; r < world_size; ++r) all.push_back({r});
  return all;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("ranks from torchrun, mpirun and srun environments; a single process without one") {
  ProcessGroupEnv none = parse({});
  CHECK(none.world_size == 1 && none.rank == 0 && none.launcher == "none");
  ProcessGroupEnv t = parse({{"RANK", "5"}, {"WORLD_SIZE", "16"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                             {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "29511"}});
  CHECK(t.launcher == "torchrun" && t.rank == 5 && t.world_size == 16 && t.local_rank == 1 && t.local_world_size == 4);
  CHECK(t.master_addr == "node7" && t.id_port == 29511);
  ProcessGroupEnv m = parse({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "8"},
                             {"OMPI_COMM_WORLD_LOCAL_RANK", "3"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "8"},
                             {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"}});
  CHECK(m.launcher == "mpirun" && m.rank == 3 && m.world_size == 8 && m.local_rank == 3);
  ProcessGroupEnv s = parse({{"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "1"},
                             {"SLURM_NTASKS_PER_NODE", "8(x2)"}, {"MASTER_ADDR", "n1"}, {"MASTER_PORT", "4000"}});
  CHECK(s.launcher == "srun" && s.rank == 9 && s.local_rank == 1 && s.local_world_size == 8);
  // Under torchrun its own store listens at MASTER_PORT: the id goes one port above.
  ProcessGroupEnv elastic = parse({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "29500"},
                                   {"TORCHELASTIC_RUN_ID", "none"}});
  CHECK(elastic.launcher == "torchrun" && elastic.id_port == 29501);
  ProcessGroupEnv one = parse({{"RANK", "0"}, {"WORLD_SIZE", "1"}});  // one rank needs no master
  CHECK(one.world_size == 1 && one.launcher == "torchrun");
}

TEST_CASE("bad launcher environments are errors that name the variable and the value") {
  CHECK_THROWS_WITH(parse({{"RANK", "2"}}), "WORLD_SIZE is not set");
  CHECK_THROWS_WITH(parse({{"RANK", "x"}, {"WORLD_SIZE", "4"}}), "RANK='x' is not an integer in [0, 3]");
  CHECK_THROWS_WITH(parse({{"RANK", "4"}, {"WORLD_SIZE", "4"}}), "RANK='4'");
  CHECK_THROWS_WITH(parse({{"RANK", "1"}, {"WORLD_SIZE", "-2"}}), "WORLD_SIZE='-2'");
  CHECK_THROWS_WITH(parse({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}}),
                    "LOCAL_RANK='2' is not an integer in [0, 1]");
  CHECK_THROWS_WITH(parse({{"RANK", "1"}, {"WORLD_SIZE", "4"}}), "MASTER_ADDR is not set", "torchrun with 4 ranks");
  CHECK_THROWS_WITH(parse({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "70000"}}),
                    "MASTER_PORT='70000' is not an integer in [1, 65535]");
  CHECK_THROWS_WITH(parse({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "65535"},
                           {"TORCHELASTIC_RUN_ID", "job"}}),
                    "MASTER_PORT='65535' is not an integer in [1, 65534]");
}

TEST_CASE("ranks sharing one GPU: all on this machine, 2 or more, each its own NCCL host id over the loopback") {
  ProcessGroupEnv two = parse({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "4000"}});
  CHECK(ranks_share_gpu_problem(two).empty());
  CHECK(contains(ranks_share_gpu_problem(parse({})), "puts 2 or more ranks on one GPU, but this machine runs 1"));
  ProcessGroupEnv two_nodes = parse({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"},
                                     {"MASTER_ADDR", "n1"}, {"MASTER_PORT", "4000"}});
  CHECK(contains(ranks_share_gpu_problem(two_nodes), "all 4 must run on this machine, which runs 2"));
  const auto env = shared_gpu_nccl_environment(two, "gpu7");
  const std::vector<std::pair<std::string, std::string>> expected = {
      {"NCCL_HOSTID", "gpu7-rank1"}, {"NCCL_SOCKET_IFNAME", "lo"}, {"NCCL_IB_DISABLE", "1"},
      {"NCCL_NVLS_ENABLE", "0"}, {"NCCL_MNNVL_ENABLE", "0"}};
  CHECK(env == expected);
  ProcessGroupEnv zero = two;
  zero.rank = 0;
  CHECK(shared_gpu_nccl_environment(zero, "gpu7")[0].second == "gpu7-rank0");  // distinct per rank
}

TEST_CASE("local processes exchange rank 0's id over TCP, rank 0 starting first or last") {
  for (int W : {2, 4}) {
    for (const Outcome& o : exchange(W, all_ranks(W), milliseconds(3000))) CHECK(o.error.empty());
    for (const Outcome& o : exchange(W, all_ranks(W, milliseconds(500)), milliseconds(3000))) CHECK(o.error.empty());
  }
}

TEST_CASE("a rank that never starts, or a missing rank 0, stops the others with its name, within the timeout") {
  std::vector<Outcome> o = exchange(4, {{0}, {1}, {3}}, milliseconds(800));
  std::printf("  rank 0: %s\n  rank 1: %s\n", o[0].error.c_str(), o[1].error.c_str());
  CHECK(contains(o[0].error, "rank(s) 2 never connected"));
  CHECK(contains(o[1].error, "rank 1 stops: rank 0 waited 0.80 s on port"));
  CHECK(contains(o[1].error, "rank(s) 2 never connected"));
  o = exchange(3, {{1}, {2}}, milliseconds(800));
  std::printf("  rank 2: %s\n", o[1].error.c_str());
  CHECK(contains(o[1].error, "rank 2 could not reach rank 0 at 127.0.0.1:"));
  CHECK(contains(o[1].error, "(Connection refused)"));
}

// Rank 0 reads every hello at once: the others finish long before the silent connection's own
// 1 s deadline, and rank 0's exit closes it.
TEST_CASE("a connection that never says hello holds no rank up") {
  std::vector<Outcome> o = exchange(3, {{kSilent}, {0}, {1, milliseconds(100)}, {2, milliseconds(100)}}, milliseconds(3000));
  for (size_t i = 1; i < o.size(); ++i) {
    std::printf("  rank %zu: %.2f s %s\n", i - 1, o[i].seconds, o[i].error.c_str());
    CHECK(o[i].error.empty());
    CHECK(o[i].seconds < 0.8);
  }
  CHECK(o[0].error.empty() && o[0].seconds < 0.9);
}

TEST_CASE("rank 0 drops a silent connection after 1 s, telling it why, and names it if a rank is missing") {
  std::vector<Outcome> o = exchange(3, {{kSilent}, {0}, {1}}, milliseconds(2000));
  std::printf("  silent: %.2f s %s\n  rank 0: %s\n  rank 1: %s\n", o[0].seconds, o[0].error.c_str(),
              o[1].error.c_str(), o[2].error.c_str());
  CHECK(o[0].seconds > 0.9 && o[0].seconds < 1.8);
  CHECK(contains(o[0].error, "the connection from 127.0.0.1:"));
  CHECK(contains(o[0].error, "sent no hello within 1.00 s; rank 0 dropped it"));
  CHECK(contains(o[1].error, "rank(s) 2 never connected; it dropped connection(s) that sent no hello within 1.00 s: 127.0.0.1:"));
  CHECK(contains(o[2].error, "rank 1 stops: rank 0 waited 2.00 s"));
  CHECK(contains(o[2].error, "rank(s) 2 never connected; it dropped connection(s)"));
}

// The second rank 1 starts late, so every other rank is connected when rank 0 sees the conflict;
// all of them stop at once, long before the 3 s timeout.
TEST_CASE("a duplicate rank stops every connected process at once, naming the rank") {
  std::vector<Outcome> o = exchange(4, {{0}, {1}, {2}, {1, milliseconds(300)}}, milliseconds(3000));
  for (const Outcome& each : o) {
    std::printf("  %.2f s: %s\n", each.seconds, each.error.c_str());
    CHECK(contains(each.error, "rank 1 connected twice, from 127.0.0.1:"));
    CHECK(each.seconds < 1.5);
  }
  CHECK(contains(o[2].error, "rank 2 stops: rank 1 connected twice"));
  CHECK(contains(o[0].error, "rendezvous: rank 1 connected twice"));
}

// Rank 1 gives up after its 0.2 s timeout and 2 s of grace for rank 0's answer; rank 0 sees its
// connection close and stops everyone then, not at its own 4 s deadline.
TEST_CASE("a rank that leaves before the id is sent stops every connected process") {
  std::vector<Outcome> o = exchange(4, {{0}, {1, milliseconds(0), 0, milliseconds(200)}, {2}}, milliseconds(4000));
  for (const Outcome& each : o) std::printf("  %.2f s: %s\n", each.seconds, each.error.c_str());
  CHECK(contains(o[1].error, "rank 1 got no id from rank 0 at 127.0.0.1:"));
  for (size_t i : {0, 2}) {
    CHECK(contains(o[i].error, "rank 1 at 127.0.0.1:"));
    CHECK(contains(o[i].error, " closed its connection before the id was sent; did it stop?"));
    CHECK(o[i].seconds < 3);
  }
}

TEST_CASE("a rank of another world size, or a rank number out of range, stops every connected process") {
  std::vector<Outcome> o = exchange(3, {{0}, {1}, {2, milliseconds(300), 4}}, milliseconds(3000));
  for (const Outcome& each : o) {
    std::printf("  %.2f s: %s\n", each.seconds, each.error.c_str());
    CHECK(contains(each.error, "rank 2 at 127.0.0.1:"));
    CHECK(contains(each.error, " was started with 4 ranks, rank 0 with 3"));
    CHECK(each.seconds < 1.5);
  }
  o = exchange(3, {{0}, {1}, {5, milliseconds(300), 3}}, milliseconds(3000));
  for (const Outcome& each : o) {
    std::printf("  %.2f s: %s\n", each.seconds, each.error.c_str());
    CHECK(contains(each.error, "claims rank 5 of 3"));
    CHECK(each.seconds < 1.5);
  }
}

int main() { return check::run_checks(); }
