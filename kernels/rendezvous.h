// Where a process sits in the job, from the environment of the standard launchers (torchrun,
// mpirun, srun), and the exchange of NCCL's unique id: rank 0 listens at MASTER_ADDR:MASTER_PORT,
// every other rank connects and receives the id's bytes. Every wait has a deadline, and a failure
// names the rank(s) and the address, so a job never hangs on a rank that failed to start.
#pragma once
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

struct ProcessGroupEnv {
  int rank = 0, world_size = 1, local_rank = 0, local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string launcher = "none";  // which environment was recognised (logged)
};

using EnvLookup = std::function<const char*(const char*)>;

namespace rendezvous_detail {

inline int env_int(const EnvLookup& env, const char* name, int min, int max) {
  const char* text = env(name);
  if (!text) throw std::invalid_argument(std::string("environment: ") + name + " is not set");
  char* end = nullptr;
  errno = 0;
  long value = std::strtol(text, &end, 10);
  if (errno || end == text || (*end && *end != '(') || value < min || value > max)  // Slurm writes "4(x2)"
    throw std::invalid_argument(std::string("environment: ") + name + "='" + text + "' is not an integer in [" +
                                std::to_string(min) + ", " + std::to_string(max) + "]");
  return int(value);
}

struct LauncherNames {
  const char *launcher, *rank, *world_size, *local_rank, *local_world_size;
};

}  // namespace rendezvous_detail

// torchrun's RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE, else Open MPI's OMPI_COMM_WORLD_*, else
// Slurm's SLURM_PROCID/NTASKS/LOCALID/NTASKS_PER_NODE, else a single process. MASTER_ADDR and
// MASTER_PORT are required for more than one rank. Throws std::invalid_argument naming the variable.
inline ProcessGroupEnv process_group_from_env(const EnvLookup& env = [](const char* n) { return std::getenv(n); }) {
  using namespace rendezvous_detail;
  const LauncherNames launchers[] = {
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
      {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
  };
  ProcessGroupEnv g;
  for (const LauncherNames& l : launchers) {
    if (!env(l.rank) && !env(l.world_size)) continue;
    g.launcher = l.launcher;
    g.world_size = env_int(env, l.world_size, 1, 1 << 20);
    g.rank = env_int(env, l.rank, 0, g.world_size - 1);
    g.local_world_size = env(l.local_world_size) ? env_int(env, l.local_world_size, 1, g.world_size) : g.world_size;
    g.local_rank = env(l.local_rank) ? env_int(env, l.local_rank, 0, g.local_world_size - 1) : g.rank % g.local_world_size;
    break;
  }
  if (g.world_size > 1) {
    const char* addr = env("MASTER_ADDR");
    if (!addr || !*addr)
      throw std::invalid_argument("environment: MASTER_ADDR is not set (" + g.launcher + " with " +
                                  std::to_string(g.world_size) + " ranks needs rank 0's address)");
    g.master_addr = addr;
    g.master_port = env_int(env, "MASTER_PORT", 1, 65535);
  }
  return g;
}

// The 128 bytes of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES), kept opaque here.
using UniqueIdBytes = std::array<char, 128>;

namespace rendezvous_detail {

constexpr uint32_t kHelloMagic = 0x53504452;  // "SPDR"
constexpr uint32_t kHelloVersion = 1;

using Clock = std::chrono::steady_clock;

class Socket {
 public:
  explicit Socket(int fd = -1) : fd_(fd) {}
  ~Socket() { if (fd_ >= 0) ::close(fd_); }
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept { std::swap(fd_, o.fd_); return *this; }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_;
};

inline int ms_left(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left > 0 ? int(left) : 0;
}

// Waits for `events` on fd until the deadline; false on timeout.
inline bool wait_for(int fd, short events, Clock::time_point deadline) {
  pollfd p{fd, events, 0};
  for (;;) {
    int n = ::poll(&p, 1, ms_left(deadline));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) throw std::runtime_error(std::string("rendezvous: poll failed: ") + std::strerror(errno));
  }
}

// Moves exactly n bytes before the deadline; false on timeout or a closed connection.
inline bool transfer(int fd, void* data, size_t n, bool sending, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    if (!wait_for(fd, sending ? POLLOUT : POLLIN, deadline)) return false;
    ssize_t done = sending ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (done <= 0) {
      if (done < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      return false;
    }
    p += done;
    n -= size_t(done);
  }
  return true;
}

inline std::string where(const ProcessGroupEnv& g) { return g.master_addr + ":" + std::to_string(g.master_port); }

inline std::string seconds(std::chrono::milliseconds t) { return std::to_string(t.count() / 1000.0).substr(0, 4) + " s"; }

inline Socket listen_on(int port) {
  Socket s(::socket(AF_INET, SOCK_STREAM, 0));
  int one = 1;
  ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(uint16_t(port));
  if (s.fd() < 0 || ::bind(s.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(s.fd(), 128) != 0)
    throw std::runtime_error("rendezvous: rank 0 cannot listen on port " + std::to_string(port) + ": " +
                             std::strerror(errno) + " (is MASTER_PORT in use?)");
  return s;
}

// What rank 0 sends each rank: a status word, then the id (status 0) or an error text of
// kErrorBytes (status 1), so a rank that did connect learns which one did not.
constexpr size_t kErrorBytes = 256;

inline void send_error(std::vector<Socket>& peers, const std::string& message, Clock::time_point deadline) {
  std::array<char, kErrorBytes> text{};
  message.copy(text.data(), text.size() - 1);
  for (Socket& peer : peers) {
    uint32_t status = 1;
    if (peer.fd() >= 0 && transfer(peer.fd(), &status, sizeof status, true, deadline))
      transfer(peer.fd(), text.data(), text.size(), true, deadline);
  }
}

// Rank 0: accept one hello from every other rank, then send each the id.
inline void serve_id(const ProcessGroupEnv& g, const UniqueIdBytes& id, Clock::time_point deadline,
                     std::chrono::milliseconds timeout) {
  Socket server = listen_on(g.master_port);
  std::vector<Socket> peers(g.world_size);
  int arrived = 1;
  while (arrived < g.world_size) {
    if (!wait_for(server.fd(), POLLIN, deadline)) {
      std::string missing;
      for (int r = 1; r < g.world_size; ++r)
        if (peers[r].fd() < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      std::string message = "rank 0 waited " + seconds(timeout) + " on port " + std::to_string(g.master_port) +
                            "; rank(s) " + missing + " never connected";
      send_error(peers, message, Clock::now() + std::chrono::milliseconds(500));
      throw std::runtime_error("rendezvous: " + message);
    }
    Socket peer(::accept(server.fd(), nullptr, nullptr));
    uint32_t hello[3];
    if (peer.fd() < 0 || !transfer(peer.fd(), hello, sizeof hello, false, deadline)) continue;
    if (hello[0] != kHelloMagic || hello[1] != kHelloVersion) continue;  // a stray connection: ignored
    const uint32_t rank = hello[2];
    if (rank == 0 || rank >= uint32_t(g.world_size))
      throw std::runtime_error("rendezvous: a process claims rank " + std::to_string(rank) + " of " +
                               std::to_string(g.world_size));
    if (peers[rank].fd() >= 0) throw std::runtime_error("rendezvous: rank " + std::to_string(rank) + " connected twice");
    peers[rank] = std::move(peer);
    ++arrived;
  }
  for (int r = 1; r < g.world_size; ++r) {
    uint32_t status = 0;
    if (!transfer(peers[r].fd(), &status, sizeof status, true, deadline) ||
        !transfer(peers[r].fd(), const_cast<char*>(id.data()), id.size(), true, deadline))
      throw std::runtime_error("rendezvous: rank 0 could not send the id to rank " + std::to_string(r));
  }
}

// Connects to rank 0, retrying until the deadline (rank 0 may start later).
inline Socket connect_to_master(const ProcessGroupEnv& g, Clock::time_point deadline, std::chrono::milliseconds timeout) {
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (::getaddrinfo(g.master_addr.c_str(), std::to_string(g.master_port).c_str(), &hints, &found) != 0 || !found)
    throw std::runtime_error("rendezvous: rank " + std::to_string(g.rank) + " cannot resolve MASTER_ADDR " + g.master_addr);
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> address(found, ::freeaddrinfo);
  while (Clock::now() < deadline) {
    Socket s(::socket(AF_INET, SOCK_STREAM, 0));
    if (s.fd() >= 0 && ::connect(s.fd(), address->ai_addr, address->ai_addrlen) == 0) return s;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  throw std::runtime_error("rendezvous: rank " + std::to_string(g.rank) + " could not reach rank 0 at " + where(g) +
                           " within " + seconds(timeout));
}

}  // namespace rendezvous_detail

// Rank 0's id reaches every rank (in: rank 0's id; out: the same bytes on every other rank).
inline void broadcast_id_over_tcp(const ProcessGroupEnv& g, UniqueIdBytes& id, std::chrono::milliseconds timeout) {
  using namespace rendezvous_detail;
  if (g.world_size == 1) return;
  const Clock::time_point deadline = Clock::now() + timeout;
  if (g.rank == 0) return serve_id(g, id, deadline, timeout);
  Socket master = connect_to_master(g, deadline, timeout);
  uint32_t hello[3] = {kHelloMagic, kHelloVersion, uint32_t(g.rank)}, status = 0;
  // Rank 0 gives up at its own deadline and then names the missing ranks: listen a little longer.
  const Clock::time_point answer_deadline = deadline + std::chrono::seconds(2);
  if (!transfer(master.fd(), hello, sizeof hello, true, deadline) ||
      !transfer(master.fd(), &status, sizeof status, false, answer_deadline))
    throw std::runtime_error("rendezvous: rank " + std::to_string(g.rank) + " got no id from rank 0 at " + where(g) +
                             " within " + seconds(timeout) + " (did rank 0 fail?)");
  if (status != 0) {
    std::array<char, kErrorBytes> text{};
    transfer(master.fd(), text.data(), text.size(), false, answer_deadline);
    throw std::runtime_error("rendezvous: rank " + std::to_string(g.rank) + " stops: " + std::string(text.data()));
  }
  if (!transfer(master.fd(), id.data(), id.size(), false, answer_deadline))
    throw std::runtime_error("rendezvous: rank " + std::to_string(g.rank) + " lost rank 0 at " + where(g) +
                             " while receiving the id");
}
