// The launcher side of distributed runs without a GPU: ranks from the environments of torchrun,
// mpirun and srun (with the errors naming the variable), and the TCP exchange of NCCL's id between
// real local processes (fork): everyone gets rank 0's bytes, a late rank 0 is waited for, and a
// missing rank or a missing rank 0 ends in an error that names it, within the timeout.
#include "check.h"
#include "kernels/rendezvous.h"

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
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// Runs the exchange in one child process per listed rank (rank 0 after `rank0_delay`); each child
// checks the id it ends with and writes its error, if any, to a pipe. Returns rank -> error text
// ("" for success). Children are killed after a hard deadline, so the test never hangs.
std::map<int, std::string> exchange(int world_size, const std::vector<int>& ranks, std::chrono::milliseconds timeout,
                                    std::chrono::milliseconds rank0_delay = std::chrono::milliseconds(0)) {
  const int port = free_port();
  UniqueIdBytes expected;
  std::mt19937 rng(port);
  for (char& c : expected) c = char(rng());
  std::map<int, std::pair<pid_t, int>> children;  // rank -> (pid, read end)
  for (int rank : ranks) {
    int fds[2];
    CHECK(::pipe(fds) == 0);
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      std::string error;
      try {
        ProcessGroupEnv g;
        g.rank = rank;
        g.world_size = world_size;
        g.master_port = port;
        UniqueIdBytes id{};
        if (rank == 0) {
          std::this_thread::sleep_for(rank0_delay);
          id = expected;
        }
        broadcast_id_over_tcp(g, id, timeout);
        if (id != expected) error = "rank " + std::to_string(rank) + " received other bytes";
      } catch (const std::exception& e) {
        error = e.what();
      }
      (void)!::write(fds[1], error.data(), error.size());
      ::_exit(error.empty() ? 0 : 1);
    }
    ::close(fds[1]);
    children[rank] = {pid, fds[0]};
  }
  std::map<int, std::string> errors;
  const auto hard_deadline = std::chrono::steady_clock::now() + timeout + rank0_delay + std::chrono::seconds(5);
  for (auto& [rank, child] : children) {
    int status = 0;
    while (::waitpid(child.first, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > hard_deadline) {
        ::kill(child.first, SIGKILL);
        ::waitpid(child.first, &status, 0);
        errors[rank] = "hung";
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    char buffer[512];
    ssize_t n = ::read(child.second, buffer, sizeof buffer);
    ::close(child.second);
    if (!errors.count(rank)) errors[rank] = n > 0 ? std::string(buffer, size_t(n)) : "";
  }
  return errors;
}

}  // namespace

TEST_CASE("ranks from torchrun, mpirun and srun environments; a single process without one") {
  ProcessGroupEnv none = parse({});
  CHECK(none.world_size == 1 && none.rank == 0 && none.launcher == "none");
  ProcessGroupEnv t = parse({{"RANK", "5"}, {"WORLD_SIZE", "16"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                             {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "29511"}});
  CHECK(t.launcher == "torchrun" && t.rank == 5 && t.world_size == 16 && t.local_rank == 1 && t.local_world_size == 4);
  CHECK(t.master_addr == "node7" && t.master_port == 29511);
  ProcessGroupEnv m = parse({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "8"},
                             {"OMPI_COMM_WORLD_LOCAL_RANK", "3"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "8"},
                             {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"}});
  CHECK(m.launcher == "mpirun" && m.rank == 3 && m.world_size == 8 && m.local_rank == 3);
  ProcessGroupEnv s = parse({{"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "1"},
                             {"SLURM_NTASKS_PER_NODE", "8(x2)"}, {"MASTER_ADDR", "n1"}, {"MASTER_PORT", "4000"}});
  CHECK(s.launcher == "srun" && s.rank == 9 && s.local_rank == 1 && s.local_world_size == 8);
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
}

TEST_CASE("local processes exchange rank 0's id over TCP, rank 0 starting first or last") {
  for (int W : {2, 4}) {
    std::vector<int> ranks;
    for (int r = 0; r < W; ++r) ranks.push_back(r);
    for (auto [rank, error] : exchange(W, ranks, std::chrono::milliseconds(3000))) CHECK(error.empty());
    for (auto [rank, error] : exchange(W, ranks, std::chrono::milliseconds(3000), std::chrono::milliseconds(500)))
      CHECK(error.empty());
  }
}

TEST_CASE("a rank that never starts, or a missing rank 0, stops the others with its name, within the timeout") {
  std::map<int, std::string> errors = exchange(4, {0, 1, 3}, std::chrono::milliseconds(800));
  std::printf("  rank 0: %s\n  rank 1: %s\n", errors[0].c_str(), errors[1].c_str());
  CHECK(errors[0].find("rank(s) 2 never connected") != std::string::npos);
  CHECK(errors[1].find("rank 1 stops: rank 0 waited 0.80 s on port") != std::string::npos);
  CHECK(errors[1].find("rank(s) 2 never connected") != std::string::npos);
  errors = exchange(3, {1, 2}, std::chrono::milliseconds(800));
  std::printf("  rank 2: %s\n", errors[2].c_str());
  CHECK(errors[2].find("rank 2 could not reach rank 0 at 127.0.0.1:") != std::string::npos);
}

int main() { return check::run_checks(); }
