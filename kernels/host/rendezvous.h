// Where a process sits in the job, from the environment of the standard launchers (torchrun,
// mpirun, srun), and the exchange of NCCL's unique id: rank 0 listens at MASTER_ADDR:MASTER_PORT
// (one port above under torchrun, whose own store holds MASTER_PORT), every other rank connects
// and receives the id's bytes. Every wait has a deadline, and a failure
// names the rank(s) and the address, so a job never hangs on a rank that failed to start. Rank 0
// reads all hellos at once, each with its own deadline, so a connection that never speaks holds no
// one up; and whatever ends its rendezvous (a missing, duplicate or misconfigured rank) it tells
// every connected rank, so they all fail at once with the same message.
#pragma once
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
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
#include <utility>
#include <vector>

struct ProcessGroupEnv {
  int rank = 0, world_size = 1, local_rank = 0, local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int id_port = 29500;  // where rank 0 serves NCCL's id
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
// MASTER_PORT are required for more than one rank. torchrun (TORCHELASTIC_RUN_ID set) runs its own
// store at MASTER_PORT, which every worker is pointed to, so there the id goes one port above.
// Throws std::invalid_argument naming the variable.
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
    const int above_torchrun_store = env("TORCHELASTIC_RUN_ID") ? 1 : 0;
    g.id_port = env_int(env, "MASTER_PORT", 1, 65535 - above_torchrun_store) + above_torchrun_store;
  }
  return g;
}

// The 128 bytes of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES), kept opaque here.
using UniqueIdBytes = std::array<char, 128>;

namespace rendezvous_detail {

constexpr uint32_t kHelloMagic = 0x53504452;  // "SPDR"
constexpr uint32_t kHelloVersion = 2;          // 2: the hello carries the sender's world size

// What every other rank sends rank 0 on connecting: magic, version, its rank, its world size.
using Hello = std::array<uint32_t, 4>;

// A rank sends its hello the moment it connects, so a connection silent for this long is not a
// rank at work (a port scan, a health check, a process stopped mid-way): rank 0 drops it.
constexpr std::chrono::milliseconds kHelloTimeout{1000};

// Rank 0 answers (id or error) until its deadline plus this; every other rank listens as long.
constexpr std::chrono::milliseconds kAnswerGrace{2000};

// What rank 0 answers each rank: a status word, then the id (kStatusId) or an error text of
// kErrorBytes (kStatusError), so every rank learns why the rendezvous failed, not only rank 0.
constexpr uint32_t kStatusId = 0, kStatusError = 1;
constexpr size_t kErrorBytes = 1024;

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

[[noreturn]] inline void throw_errno(const std::string& what) { throw std::runtime_error(what + ": " + std::strerror(errno)); }

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
    if (errno != EINTR) throw_errno("rendezvous: poll failed");
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

inline std::string where(const ProcessGroupEnv& g) { return g.master_addr + ":" + std::to_string(g.id_port); }

inline std::string seconds(std::chrono::milliseconds t) { return std::to_string(t.count() / 1000.0).substr(0, 4) + " s"; }

// Non-blocking, so that accept never waits, even for a connection that vanished after poll saw it.
inline Socket listen_on(int port) {
  const std::string cannot = "rendezvous: rank 0 cannot listen on port " + std::to_string(port) + ": ";
  Socket s(::socket(AF_INET, SOCK_STREAM, 0));
  if (s.fd() < 0) throw_errno(cannot + "socket");
  int one = 1;
  if (::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0) throw_errno(cannot + "setsockopt(SO_REUSEADDR)");
  const int flags = ::fcntl(s.fd(), F_GETFL);
  if (flags < 0 || ::fcntl(s.fd(), F_SETFL, flags | O_NONBLOCK) != 0) throw_errno(cannot + "fcntl(O_NONBLOCK)");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(uint16_t(port));
  if (::bind(s.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    throw std::runtime_error(cannot + "bind: " + std::strerror(errno) + " (is the port in use?)");
  if (::listen(s.fd(), 128) != 0) throw_errno(cannot + "listen");
  return s;
}

// A connection rank 0 accepted: where it came from (for messages) and its hello so far.
struct Peer {
  Socket socket;
  std::string address;
  Clock::time_point hello_deadline;
  Hello hello{};
  size_t hello_bytes = 0;
};

// Rank 0's connections: the ranks whose hello arrived, and those whose hello is still due.
struct Connections {
  std::vector<Peer> ranks;           // index = rank; an empty socket until that rank's hello
  std::vector<Peer> pending;         // accepted, hello incomplete
  std::vector<std::string> dropped;  // addresses that sent no hello within kHelloTimeout

  int known() const {
    int n = 0;
    for (const Peer& p : ranks) n += p.socket.fd() >= 0;
    return n;
  }
};

inline std::string address_of(const sockaddr_in& a) {
  char ip[INET_ADDRSTRLEN];
  if (!::inet_ntop(AF_INET, &a.sin_addr, ip, sizeof ip)) return "(unknown address)";
  return std::string(ip) + ":" + std::to_string(ntohs(a.sin_port));
}

// Best effort: a peer that cannot be told (it left, or does not read) fails on its own deadline.
inline void send_error(const Socket& peer, const std::string& message, Clock::time_point deadline) {
  if (peer.fd() < 0) return;
  std::array<char, kErrorBytes> text{};
  message.copy(text.data(), text.size() - 1);
  uint32_t status = kStatusError;
  if (transfer(peer.fd(), &status, sizeof status, true, deadline)) transfer(peer.fd(), text.data(), text.size(), true, deadline);
}

// Takes every connection waiting on the server socket into `pending`.
inline void accept_waiting(int server, int port, Connections& c) {
  for (;;) {
    sockaddr_in from{};
    socklen_t length = sizeof from;
    Socket s(::accept(server, reinterpret_cast<sockaddr*>(&from), &length));
    if (s.fd() < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;  // that connection is gone
      throw_errno("rank 0 cannot accept a connection on port " + std::to_string(port));
    }
    Peer p;
    p.socket = std::move(s);
    p.address = address_of(from);
    p.hello_deadline = Clock::now() + kHelloTimeout;
    c.pending.push_back(std::move(p));
  }
}

// Reads what has arrived of a peer's hello; false if the peer closed (or reset) its connection.
inline bool read_hello(Peer& p) {
  char* into = reinterpret_cast<char*>(p.hello.data()) + p.hello_bytes;
  const ssize_t n = ::recv(p.socket.fd(), into, sizeof(Hello) - p.hello_bytes, MSG_DONTWAIT);
  if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return true;
  if (n <= 0) return false;
  p.hello_bytes += size_t(n);
  return true;
}

// A complete hello must name a free rank of this world; otherwise the whole rendezvous fails.
inline void check_claim(const ProcessGroupEnv& g, const Connections& c, const Peer& p) {
  const uint32_t rank = p.hello[2], world = p.hello[3];
  if (world != uint32_t(g.world_size))
    throw std::runtime_error("rank " + std::to_string(rank) + " at " + p.address + " was started with " +
                             std::to_string(world) + " ranks, rank 0 with " + std::to_string(g.world_size));
  if (rank == 0 || rank >= uint32_t(g.world_size))
    throw std::runtime_error("a process at " + p.address + " claims rank " + std::to_string(rank) + " of " +
                             std::to_string(g.world_size));
  if (c.ranks[rank].socket.fd() >= 0)
    throw std::runtime_error("rank " + std::to_string(rank) + " connected twice, from " + c.ranks[rank].address +
                             " and from " + p.address + " (was one rank number given to two processes?)");
}

// Reads the pending hellos that poll found readable (fds[1 + i] is pending[i]); a complete one
// makes its peer a rank; a closed connection, or one speaking another protocol, is dropped.
inline void read_pending(const ProcessGroupEnv& g, Connections& c, const std::vector<pollfd>& fds) {
  for (size_t i = 0; i < c.pending.size(); ++i) {
    Peer& p = c.pending[i];
    if (!fds[1 + i].revents) continue;
    if (!read_hello(p)) p.socket = Socket();
    if (p.hello_bytes < sizeof(Hello)) continue;
    if (p.hello[0] != kHelloMagic || p.hello[1] != kHelloVersion) {
      p.socket = Socket();
      continue;
    }
    check_claim(g, c, p);  // throws with p still pending, so it too is told the error
    c.ranks[p.hello[2]] = std::move(p);
  }
}

// Drops the connections whose hello is overdue, telling each why (it may be a rank that stalled).
inline void drop_silent(Connections& c) {
  for (Peer& p : c.pending) {
    if (p.socket.fd() < 0 || Clock::now() < p.hello_deadline) continue;
    send_error(p.socket, "the connection from " + p.address + " sent no hello within " + seconds(kHelloTimeout) +
                             "; rank 0 dropped it", Clock::now() + std::chrono::milliseconds(100));
    c.dropped.push_back(p.address);
    p.socket = Socket();
  }
}

// A known rank's connection turned readable: the rank left (its own deadline, a crash) or broke
// the protocol. Either way the rendezvous cannot complete.
inline void check_known_rank(const Peer& p, int rank) {
  char byte;
  const ssize_t n = ::recv(p.socket.fd(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return;
  const std::string who = "rank " + std::to_string(rank) + " at " + p.address;
  if (n > 0) throw std::runtime_error(who + " sent bytes after its hello");
  throw std::runtime_error(who + " closed its connection before the id was sent" +
                           (n < 0 ? " (" + std::string(std::strerror(errno)) + ")" : std::string()) + "; did it stop?");
}

// Checks the known ranks that poll found readable (they follow the pending ones in fds).
inline void check_known_ranks(const Connections& c, const std::vector<pollfd>& fds) {
  size_t i = 1 + c.pending.size();
  for (size_t r = 1; r < c.ranks.size(); ++r) {
    if (c.ranks[r].socket.fd() < 0) continue;
    if (fds[i++].revents) check_known_rank(c.ranks[r], int(r));
  }
}

// The poll set: the server socket, every pending connection, then every known rank.
inline std::vector<pollfd> poll_set(int server, const Connections& c) {
  std::vector<pollfd> fds{{server, POLLIN, 0}};
  for (const Peer& p : c.pending) fds.push_back({p.socket.fd(), POLLIN, 0});
  for (const Peer& p : c.ranks)
    if (p.socket.fd() >= 0) fds.push_back({p.socket.fd(), POLLIN, 0});
  return fds;
}

// Waits until something is readable, the rendezvous deadline, or the first pending hello's deadline.
inline void wait_any(std::vector<pollfd>& fds, const Connections& c, Clock::time_point deadline) {
  Clock::time_point until = deadline;
  for (const Peer& p : c.pending) until = std::min(until, p.hello_deadline);
  if (::poll(fds.data(), fds.size(), ms_left(until)) < 0 && errno != EINTR) throw_errno("rank 0's poll failed");
}

inline std::string missing_ranks(const ProcessGroupEnv& g, const Connections& c, std::chrono::milliseconds timeout) {
  std::string missing, dropped;
  for (int r = 1; r < g.world_size; ++r)
    if (c.ranks[r].socket.fd() < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
  for (const std::string& a : c.dropped) dropped += (dropped.empty() ? "" : ", ") + a;
  return "rank 0 waited " + seconds(timeout) + " on port " + std::to_string(g.id_port) + "; rank(s) " + missing +
         " never connected" +
         (dropped.empty() ? "" : "; it dropped connection(s) that sent no hello within " + seconds(kHelloTimeout) + ": " + dropped);
}

// Rank 0, until every rank's hello has arrived: one poll over all connections, so no connection
// waits for another, and every hello has its own deadline. Throws the text to tell every peer.
inline void gather_hellos(const ProcessGroupEnv& g, int server, Connections& c, Clock::time_point deadline,
                          std::chrono::milliseconds timeout) {
  while (c.known() < g.world_size - 1) {
    if (Clock::now() >= deadline) throw std::runtime_error(missing_ranks(g, c, timeout));
    std::vector<pollfd> fds = poll_set(server, c);
    wait_any(fds, c, deadline);
    check_known_ranks(c, fds);
    read_pending(g, c, fds);
    if (fds[0].revents) accept_waiting(server, g.id_port, c);
    drop_silent(c);
    c.pending.erase(std::remove_if(c.pending.begin(), c.pending.end(), [](const Peer& p) { return p.socket.fd() < 0; }),
                    c.pending.end());
  }
}

// `id` is a copy: transfer takes a writable buffer.
inline void send_id(Connections& c, UniqueIdBytes id, Clock::time_point deadline) {
  for (size_t r = 1; r < c.ranks.size(); ++r) {
    uint32_t status = kStatusId;
    const int fd = c.ranks[r].socket.fd();
    if (!transfer(fd, &status, sizeof status, true, deadline) || !transfer(fd, id.data(), id.size(), true, deadline))
      throw std::runtime_error("rank 0 could not send the id to rank " + std::to_string(r) + " at " + c.ranks[r].address);
  }
}

// Rank 0: gathers every other rank's hello, then sends each the id. On any failure every peer
// connected by then, including those still in the server's queue, gets the error text before
// rank 0 throws it, so no rank waits for its own deadline to learn that the rendezvous is over.
inline void serve_id(const ProcessGroupEnv& g, const UniqueIdBytes& id, Clock::time_point deadline,
                     std::chrono::milliseconds timeout) {
  Socket server = listen_on(g.id_port);
  Connections c;
  c.ranks.resize(size_t(g.world_size));
  try {
    gather_hellos(g, server.fd(), c, deadline, timeout);
    send_id(c, id, deadline + kAnswerGrace);
  } catch (const std::exception& e) {
    try {
      accept_waiting(server.fd(), g.id_port, c);
    } catch (const std::exception&) {
      // The failure to report is e; the peers still queued then learn of it from the closed port.
    }
    const Clock::time_point tell_deadline = Clock::now() + std::chrono::milliseconds(500);
    for (const Peer& p : c.ranks) send_error(p.socket, e.what(), tell_deadline);
    for (const Peer& p : c.pending) send_error(p.socket, e.what(), tell_deadline);
    throw std::runtime_error(std::string("rendezvous: ") + e.what());
  }
}

// Connects to rank 0, retrying until the deadline (rank 0 may start later).
inline Socket connect_to_master(const ProcessGroupEnv& g, Clock::time_point deadline, std::chrono::milliseconds timeout) {
  const std::string me = "rendezvous: rank " + std::to_string(g.rank);
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  const int resolved = ::getaddrinfo(g.master_addr.c_str(), std::to_string(g.id_port).c_str(), &hints, &found);
  if (resolved != 0 || !found)
    throw std::runtime_error(me + " cannot resolve MASTER_ADDR " + g.master_addr + ": " + ::gai_strerror(resolved));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> address(found, ::freeaddrinfo);
  int last_error = 0;
  while (Clock::now() < deadline) {
    Socket s(::socket(AF_INET, SOCK_STREAM, 0));
    if (s.fd() < 0) throw_errno(me + " cannot create a socket");
    if (::connect(s.fd(), address->ai_addr, address->ai_addrlen) == 0) return s;
    last_error = errno;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  throw std::runtime_error(me + " could not reach rank 0 at " + where(g) + " within " + seconds(timeout) +
                           (last_error ? std::string(" (") + std::strerror(last_error) + ")" : std::string()));
}

// A rank's side once connected: its hello, then rank 0's answer (the id, or the error that ended
// the rendezvous, which this rank throws as its own).
inline void receive_id(const ProcessGroupEnv& g, int master, UniqueIdBytes& id, Clock::time_point deadline,
                       std::chrono::milliseconds timeout) {
  const std::string me = "rendezvous: rank " + std::to_string(g.rank);
  Hello hello = {kHelloMagic, kHelloVersion, uint32_t(g.rank), uint32_t(g.world_size)};
  uint32_t status = kStatusId;
  // Rank 0 gives up at its own deadline and then names the missing ranks: listen a little longer.
  const Clock::time_point answer_deadline = deadline + kAnswerGrace;
  if (!transfer(master, hello.data(), sizeof hello, true, deadline) ||
      !transfer(master, &status, sizeof status, false, answer_deadline))
    throw std::runtime_error(me + " got no id from rank 0 at " + where(g) + " within " + seconds(timeout) +
                             " (did rank 0 fail?)");
  if (status != kStatusId) {
    std::array<char, kErrorBytes> text{};
    if (!transfer(master, text.data(), text.size(), false, answer_deadline))
      throw std::runtime_error(me + " stops: rank 0 reported an error but closed before its text arrived");
    text.back() = '\0';
    throw std::runtime_error(me + " stops: " + std::string(text.data()));
  }
  if (!transfer(master, id.data(), id.size(), false, answer_deadline))
    throw std::runtime_error(me + " lost rank 0 at " + where(g) + " while receiving the id");
}

}  // namespace rendezvous_detail

// Rank 0's id reaches every rank (in: rank 0's id; out: the same bytes on every other rank).
inline void broadcast_id_over_tcp(const ProcessGroupEnv& g, UniqueIdBytes& id, std::chrono::milliseconds timeout) {
  using namespace rendezvous_detail;
  if (g.world_size == 1) return;
  const Clock::time_point deadline = Clock::now() + timeout;
  if (g.rank == 0) return serve_id(g, id, deadline, timeout);
  Socket master = connect_to_master(g, deadline, timeout);
  receive_id(g, master.fd(), id, deadline, timeout);
}

// Several ranks on one GPU (--ranks-share-gpu: multi-rank NCCL on a machine with one GPU, for
// tests). NCCL refuses two ranks of one host on one GPU ("Duplicate GPU detected": the same host
// hash and bus id); a host id per rank (NCCL_HOSTID replaces the hash of the host's name) makes
// each rank a node of its own, so that the ranks talk over NCCL's socket transport on the loopback.
// What only works within one real node is turned off: InfiniBand, NVLink SHARP, multi-node NVLink.
// "" when the job can share a GPU, else why not.
inline std::string ranks_share_gpu_problem(const ProcessGroupEnv& g) {
  if (g.local_world_size < 2)
    return "--ranks-share-gpu puts 2 or more ranks on one GPU, but this machine runs " +
           std::to_string(g.local_world_size) + " (run.sh with NPROC=2 or more)";
  if (g.world_size != g.local_world_size)
    return "--ranks-share-gpu: the ranks talk over the loopback, so all " + std::to_string(g.world_size) +
           " must run on this machine, which runs " + std::to_string(g.local_world_size);
  return "";
}

// The variables to set before NCCL starts, in the order they are set (host: this machine's name).
inline std::vector<std::pair<std::string, std::string>> shared_gpu_nccl_environment(const ProcessGroupEnv& g,
                                                                                    const std::string& host) {
  return {{"NCCL_HOSTID", host + "-rank" + std::to_string(g.rank)},
          {"NCCL_SOCKET_IFNAME", "lo"},
          {"NCCL_IB_DISABLE", "1"},
          {"NCCL_NVLS_ENABLE", "0"},
          {"NCCL_MNNVL_ENABLE", "0"}};
}
