// The emulator's CUDA threads: one fiber per thread of a block, switched on the launching host
// thread; barriers and warp exchanges as the GPU meets them (see cuda_emulator.h).
#include "emulator/cuda_emulator.h"
#include "emulator/runtime.h"

#include <sys/mman.h>

#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#if defined(__x86_64__)
// switch_stack(save, load): saves the callee-saved registers on the current stack, stores its
// pointer in *save, and continues on the stack `load` saved earlier. The SSE and x87 control words
// are not switched: no kernel changes rounding modes, and restoring them would double the cost.
extern "C" void emu_switch_stack(void** save, void* load);
extern "C" void emu_fiber_start();
asm(R"(
  .text
  .globl emu_switch_stack
  .type emu_switch_stack, @function
emu_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_switch_stack, .-emu_switch_stack

  .globl emu_fiber_start
  .type emu_fiber_start, @function
emu_fiber_start:
  movq %rbx, %rdi
  callq *%r12
  ud2
  .size emu_fiber_start, .-emu_fiber_start
)");
#else
#error "the CUDA emulator switches stacks with x86-64 assembly; port emu_switch_stack to this CPU"
#endif

namespace emu {
namespace {

constexpr size_t kStackBytes = size_t(256) << 10;
constexpr size_t kGuardBytes = 4096;
constexpr int kMaxThreadsPerBlock = 1024;
constexpr size_t kSlotBytes = 32;
constexpr size_t kMaxStaticSharedBytes = size_t(48) << 10;  // ptxas's limit

[[noreturn]] void fatal(const std::string& what) {
  std::fprintf(stderr, "CUDA emulator: %s\n", what.c_str());
  std::abort();
}

// A stack with a guard page below it: an overflow faults instead of corrupting a neighbour.
struct Stack {
  Stack() {
    base = static_cast<char*>(mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (base == MAP_FAILED) fatal("cannot map a fiber stack");
    mprotect(base, kGuardBytes, PROT_NONE);
  }
  ~Stack() { munmap(base, kStackBytes + kGuardBytes); }
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;
  char* top() const { return base + kGuardBytes + kStackBytes; }
  char* base;
};

struct Warp {
  int live = 0, arrived = 0;
  unsigned generation = 0;
  const char* what = nullptr;
  // By generation parity: a lane may enter the next operation while others still read this one.
  alignas(16) unsigned char inputs[2][32 * kSlotBytes], outputs[2][32 * kSlotBytes];

  void reset() {  // the slots need no clearing: each operation writes them before reading
    live = arrived = 0;
    generation = 0;
    what = nullptr;
  }
};

constexpr size_t kAsyncCopyBytes = 16;

struct PendingCopy {
  void* shared;
  unsigned char data[kAsyncCopyBytes];
};

struct Fiber {
  void* sp = nullptr;
  bool done = false;
  bool at_barrier = false;        // waiting in __syncthreads for barrier_generation to pass
  unsigned barrier_generation = 0;
  ThreadPosition position;
  std::vector<PendingCopy> uncommitted;             // cp.async issued since the last commit
  std::deque<std::vector<PendingCopy>> committed;   // groups in flight, oldest first
  std::vector<std::function<void()>> wgmma_uncommitted;
  std::deque<std::vector<std::function<void()>>> wgmma_committed;
  bool wgmma_fenced = false;     // a wgmma.fence since the last commit
  bool copies_unfenced = false;  // cp.async copies landed since the last fence.proxy.async

  // A fresh thread at `at`, keeping the containers' memory (blocks start by the thousand).
  void start(const ThreadPosition& at, void* stack_pointer) {
    sp = stack_pointer;
    done = at_barrier = wgmma_fenced = copies_unfenced = false;
    barrier_generation = 0;
    position = at;
    uncommitted.clear();
    committed.clear();
    wgmma_uncommitted.clear();
    wgmma_committed.clear();
  }
};

struct StaticSharedMemory {
  alignas(256) unsigned char bytes[kMaxStaticSharedBytes];
};

// The block being run on this host thread.
struct Block {
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  int live = 0, arrived = 0;
  unsigned generation = 0;
  uint64_t progress = 0;  // counts arrivals at barriers and warp operations, and exits
  int unfenced_threads = 0;  // fibers whose copies_unfenced is set
  std::vector<unsigned char> shared;  // dynamic shared memory
  // Static shared memory: placed variable by variable as a launch first reaches each (the GPU
  // knows them all at the launch), poisoned up to static_bytes as each block starts.
  std::unique_ptr<StaticSharedMemory> static_shared = std::make_unique<StaticSharedMemory>();
  size_t static_bytes = 0, static_budget = 0;  // placed in this launch; the most the launch may place
  uint64_t launch = 0;  // this host thread's launches so far: when a StaticSharedPlace was placed
  const std::function<void()>* body = nullptr;
};

struct HostThread {
  std::vector<std::unique_ptr<Stack>> stacks;
  void* scheduler_sp = nullptr;
  Fiber* running = nullptr;
  Block block;
};

thread_local HostThread host;

void yield() { emu_switch_stack(&host.running->sp, host.scheduler_sp); }

// Releases the block's barrier once every live thread has arrived (an exiting thread may be the
// last one it waited for).
bool release_barrier_if_complete(Block& b) {
  if (b.arrived == 0 || b.arrived != b.live) return false;
  b.arrived = 0;
  ++b.generation;
  return true;
}

void fiber_main(void*) {
  (*host.block.body)();
  Fiber& me = *host.running;
  if (!me.wgmma_uncommitted.empty() || !me.wgmma_committed.empty())
    fatal("a thread exited with wgmma operations it never waited for");
  me.done = true;
  Block& b = host.block;
  --b.live;
  --b.warps[me.position.linear_index() / 32].live;
  ++b.progress;
  release_barrier_if_complete(b);
  emu_switch_stack(&me.sp, host.scheduler_sp);
  fatal("a finished fiber was resumed");
}

void* initial_stack(char* top) {
  // emu_switch_stack pops six registers, then returns to emu_fiber_start, which calls r12(rbx)
  // with the stack 16-byte aligned.
  auto* sp = reinterpret_cast<uint64_t*>(top) - 2;
  *--sp = reinterpret_cast<uint64_t>(&emu_fiber_start);
  *--sp = 0;                                          // rbp
  *--sp = 0;                                          // rbx: fiber_main's argument
  *--sp = reinterpret_cast<uint64_t>(&fiber_main);    // r12
  *--sp = 0;                                          // r13
  *--sp = 0;                                          // r14
  *--sp = 0;                                          // r15
  return sp;
}

void resume(Fiber& f) {
  host.running = &f;
  running_position = &f.position;
  emu_switch_stack(&host.scheduler_sp, f.sp);
  host.running = nullptr;
  running_position = nullptr;
}

// Runs warp w's threads until each has finished or waits at a __syncthreads that others have not
// reached (or the warp waits on nothing it can resolve). One warp runs as far ahead of the others
// as barriers allow, as a GPU may schedule it: a warp that reads shared memory another warp has
// not written yet, or refills a tile another warp still reads, then meets poison instead of
// finding the others in step.
void run_warp_to_barrier(Block& b, int w) {
  const size_t first = size_t(w) * 32, last = std::min(b.fibers.size(), first + 32);
  for (;;) {
    const uint64_t progress = b.progress;
    bool runnable = false;
    for (size_t i = first; i < last; ++i) {
      Fiber& f = b.fibers[i];
      if (f.done || (f.at_barrier && f.barrier_generation == b.generation)) continue;
      runnable = true;
      resume(f);
    }
    if (!runnable || b.progress == progress) return;
  }
}

void run_block(const LaunchConfig& c, dim3 block_index) {
  Block& b = host.block;
  const int threads = int(c.block.x * c.block.y * c.block.z), warps = (threads + 31) / 32;
  while (int(host.stacks.size()) < threads) host.stacks.push_back(std::make_unique<Stack>());
  b.fibers.resize(threads);
  b.warps.resize(warps);
  for (Warp& w : b.warps) w.reset();
  for (int i = 0; i < threads; ++i) {
    b.fibers[i].start({dim3(i % c.block.x, i / c.block.x % c.block.y, i / (c.block.x * c.block.y)), block_index,
                       c.block, c.grid},
                      initial_stack(host.stacks[i]->top()));
    ++b.warps[i / 32].live;
  }
  b.live = threads;
  b.arrived = 0;
  b.unfenced_threads = 0;
  // Shared memory starts as garbage on the GPU: poisoned here, so a read before a write shows.
  std::memset(b.shared.data(), 0xFF, b.shared.size());
  std::memset(b.static_shared->bytes, 0xFF, b.static_bytes);
  while (b.live > 0) {
    const uint64_t progress = b.progress;
    for (int w = 0; w < warps; ++w) run_warp_to_barrier(b, w);
    if (b.progress == progress && b.live > 0)
      fatal("deadlock in block (" + std::to_string(block_index.x) + ", " + std::to_string(block_index.y) + ", " +
            std::to_string(block_index.z) + "): threads wait at a barrier or warp operation that others never reach");
  }
}

}  // namespace

__thread const ThreadPosition* running_position = nullptr;

void position_read_outside_a_kernel() { fatal("threadIdx and friends read outside a kernel"); }

void* dynamic_shared_memory() { return host.block.shared.data(); }

void* static_shared_memory(StaticSharedPlace& place, size_t bytes, size_t alignment) {
  if (!host.running) fatal("a __shared__ variable reached outside a kernel");
  Block& b = host.block;
  if (place.launch != b.launch) {
    const size_t offset = (b.static_bytes + alignment - 1) / alignment * alignment;
    if (offset + bytes > b.static_budget)
      fatal(std::to_string(offset + bytes) + " bytes of static __shared__ variables beside " +
            std::to_string(b.shared.size()) + " bytes of dynamic shared memory: more than the GPU lets this kernel " +
            "have (48 KiB in all, or 227 KiB with its dynamic limit raised; static at most 48 KiB)");
    std::memset(b.static_shared->bytes + b.static_bytes, 0xFF, offset + bytes - b.static_bytes);
    b.static_bytes = offset + bytes;
    place = {b.launch, offset};
  }
  return b.static_shared->bytes + place.offset;
}

void misaligned_cast(const char* type, const void* p, size_t alignment) {
  char address[32];
  std::snprintf(address, sizeof address, "%p", p);
  fatal(std::string("misaligned address: ") + type + " at " + address + ", not a multiple of " +
        std::to_string(alignment) + " bytes (a GPU faults on the access)");
}

void async_copy(void* shared, const void* global, size_t bytes) {
  if (bytes != kAsyncCopyBytes) fatal("cp.async of other than 16 bytes");
  PendingCopy c{shared, {}};
  std::memcpy(c.data, global, bytes);
  std::memset(shared, 0xFF, bytes);
  host.running->uncommitted.push_back(c);
}

void async_copy_commit() {
  Fiber& f = *host.running;
  f.committed.push_back(std::move(f.uncommitted));
  f.uncommitted.clear();
}

void async_copy_wait(int pending_groups_left) {
  Fiber& f = *host.running;
  while (int(f.committed.size()) > pending_groups_left) {
    for (const PendingCopy& c : f.committed.front()) std::memcpy(c.shared, c.data, kAsyncCopyBytes);
    if (!f.copies_unfenced && !f.committed.front().empty()) {
      f.copies_unfenced = true;
      ++host.block.unfenced_threads;
    }
    f.committed.pop_front();
  }
}

void proxy_async_fence() {
  Fiber& f = *host.running;
  if (f.copies_unfenced) --host.block.unfenced_threads;
  f.copies_unfenced = false;
}

void wgmma_fence() { host.running->wgmma_fenced = true; }

void wgmma_issue(std::function<void()> land) {
  Fiber& f = *host.running;
  if (!f.wgmma_fenced) fatal("a wgmma group begun without a wgmma.fence");
  if (host.block.unfenced_threads > 0)
    for (const Fiber& other : host.block.fibers)
      if (other.copies_unfenced)
        fatal("wgmma issued while thread " + std::to_string(other.position.linear_index()) +
              "'s landed cp.async copies are not fenced for the async proxy (fence.proxy.async)");
  f.wgmma_uncommitted.push_back(std::move(land));
}

void wgmma_commit() {
  Fiber& f = *host.running;
  f.wgmma_committed.push_back(std::move(f.wgmma_uncommitted));
  f.wgmma_uncommitted.clear();
  f.wgmma_fenced = false;
}

void wgmma_wait(int pending_groups_left) {
  Fiber& f = *host.running;
  while (int(f.wgmma_committed.size()) > pending_groups_left) {
    for (const auto& land : f.wgmma_committed.front()) land();
    f.wgmma_committed.pop_front();
  }
}

uint32_t shared_window_address(const void* p) {
  const std::vector<unsigned char>& shared = host.block.shared;
  const auto* byte = static_cast<const unsigned char*>(p);
  if (shared.empty() || byte < shared.data() || byte >= shared.data() + shared.size())
    fatal("a shared-window address of memory outside the dynamic shared memory (the emulator maps only that)");
  return kDynamicSharedWindowBase + uint32_t(byte - shared.data());
}

SharedWindow dynamic_shared_window() {
  const std::vector<unsigned char>& shared = host.block.shared;
  return {shared.data(), uint32_t(shared.size())};
}

void sync_threads() {
  Block& b = host.block;
  Fiber& me = *host.running;
  const unsigned generation = b.generation;
  ++b.progress;
  ++b.arrived;
  if (release_barrier_if_complete(b)) return;
  me.at_barrier = true;
  me.barrier_generation = generation;
  while (b.generation == generation) yield();
  me.at_barrier = false;
}

void warp_collective(const char* what, const void* in, size_t in_bytes, void* out, size_t out_bytes,
                     WarpCombine combine, int pick_lane) {
  if (in_bytes > kSlotBytes || out_bytes > kSlotBytes) fatal("a warp operation on more than 32 bytes per lane");
  Block& b = host.block;
  const int lane_linear = host.running->position.linear_index();
  Warp& w = b.warps[lane_linear / 32];
  const int lane = lane_linear % 32;
  const int lanes = std::min(32, int(b.fibers.size()) - lane_linear / 32 * 32);
  if (w.live != lanes)
    fatal(std::string(what) + ": a warp operation with a full mask after some lanes of the warp exited");
  if (w.arrived == 0) w.what = what;
  if (w.what != what && std::strcmp(w.what, what) != 0)
    fatal(std::string("lanes of one warp meet in different operations: ") + w.what + " and " + what);
  const unsigned generation = w.generation, parity = generation % 2;
  std::memcpy(w.inputs[parity] + lane * in_bytes, in, in_bytes);
  ++b.progress;
  if (++w.arrived == w.live) {
    if (combine) combine(w.inputs[parity], w.outputs[parity]);
    w.arrived = 0;
    ++w.generation;
  } else {
    while (w.generation == generation) yield();
  }
  if (combine)
    std::memcpy(out, w.outputs[parity] + lane * out_bytes, out_bytes);
  else if (pick_lane >= 0)
    std::memcpy(out, w.inputs[parity] + pick_lane * in_bytes, in_bytes);
  else
    std::memcpy(out, w.inputs[parity], 32 * in_bytes);
}

void run_grid(const void* kernel, const LaunchConfig& c, const std::function<void()>& body) {
  const size_t threads = size_t(c.block.x) * c.block.y * c.block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || c.block.z > 64 || c.grid.x == 0 || c.grid.y == 0 ||
      c.grid.z == 0 || c.grid.y > 65535 || c.grid.z > 65535) {
    record_launch_error(cudaErrorInvalidConfiguration);
    return;
  }
  if (c.shared_bytes > max_dynamic_shared_bytes(kernel)) {
    record_launch_error(cudaErrorInvalidValue);
    return;
  }
  if (host.running) fatal("a kernel launched from inside a kernel");
  Block& b = host.block;
  b.body = &body;
  b.shared.resize(c.shared_bytes);  // poisoned as each block starts
  ++b.launch;
  b.static_bytes = 0;
  b.static_budget = static_shared_budget(kernel, c.shared_bytes);
  for (unsigned z = 0; z < c.grid.z; ++z)
    for (unsigned y = 0; y < c.grid.y; ++y)
      for (unsigned x = 0; x < c.grid.x; ++x) run_block(c, dim3(x, y, z));
  b.body = nullptr;
}

}  // namespace emu
