// The emulator's CUDA threads: one fiber per thread of a block, switched on the launching host
// thread; barriers and warp exchanges as the GPU meets them (see cuda_emulator.h).
#include "emulator/cuda_emulator.h"
#include "emulator/runtime.h"

#include <sys/mman.h>

#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <unordered_set>
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

void fatal(const std::string& what) {
  std::fprintf(stderr, "CUDA emulator: %s\n", what.c_str());
  std::abort();
}

namespace {

// A fiber's stack: the deepest any CI-sized emulated test reached was 6.8 KiB (test_kernels; the
// attention kernels 5.9), measured at 256 KiB. Small stacks packed close make the switches cheap:
// each switch lands on another stack, and at a stride of 256 KiB the tops of a block's 1,024 stacks
// shared their cache sets and spread over as many page-table lines (a switch to a fiber and back took
// 65 ns on the development machine, 37 at 32 KiB with the colours below; the emulated distributed
// tests ran about 15% faster).
constexpr size_t kStackBytes = size_t(32) << 10;
constexpr size_t kGuardBytes = 4096;
constexpr int kMaxThreadsPerBlock = 1024;
constexpr size_t kSlotBytes = 32;
constexpr size_t kMaxStaticSharedBytes = size_t(48) << 10;  // ptxas's limit

// The stacks of a slot's threads, in one mapping with a guard page below the lowest (a page each
// would make two memory maps a thread: a resident block each of 8 SMs, of up to 1024 threads, on
// each simulated rank's host thread passed Linux's 65,530). A thread that overflows its stack
// writes into the stack below it, another thread's (or, the lowest, faults on the guard): found
// if it writes the 256-byte canary at its stack's bottom (checked as each launch ends), not if a
// large frame skips over it.
constexpr size_t kCanaryBytes = 256;
constexpr unsigned char kCanary = 0xA5;
// Each stack starts a "colour" higher, a multiple of 64 bytes below 16 KiB, so that the stacks' hot
// lines fall in different cache sets; the stride grows by the colours' range, so that every stack
// keeps its kStackBytes.
constexpr size_t kColourBytes = 64, kColours = 256;
constexpr size_t kStackStride = kStackBytes + kColours * kColourBytes;
struct Stacks {
  Stacks() = default;
  Stacks(const Stacks&) = delete;
  Stacks& operator=(const Stacks&) = delete;
  ~Stacks() { unmap(); }
  // Room for `threads` stacks (their contents are lost when it grows: call it between blocks).
  void reserve(size_t threads) {
    if (threads <= count) return;
    unmap();
    base = static_cast<char*>(mmap(nullptr, kGuardBytes + threads * kStackStride, PROT_READ | PROT_WRITE,
                                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    if (base == MAP_FAILED) fatal("cannot map the fiber stacks");
    mprotect(base, kGuardBytes, PROT_NONE);
    count = threads;
    for (size_t i = 0; i < count; ++i) std::memset(bottom(i), kCanary, kCanaryBytes);
  }
  char* bottom(size_t i) const { return base + kGuardBytes + i * kStackStride + i % kColours * kColourBytes; }
  char* top(size_t i) const { return bottom(i) + kStackBytes; }
  // The first of threads [0, threads) whose canary was overwritten, or -1.
  long overflowed(size_t threads) const {
    static const std::vector<char> canary(kCanaryBytes, char(kCanary));
    for (size_t i = 0; i < threads; ++i)
      if (std::memcmp(bottom(i), canary.data(), kCanaryBytes) != 0) return long(i);
    return -1;
  }
  void unmap() {
    if (count) munmap(base, kGuardBytes + count * kStackStride);
    count = 0;
  }
  char* base = nullptr;
  size_t count = 0;
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

// A TMA store (cp.async.bulk.tensor, shared to global) as issued: the box's shared memory then,
// written out when its bulk group is waited for.
struct TmaStore {
  EmulatedTensorMap map;
  const unsigned char* shared;
  std::vector<unsigned char> image;
  int coordinates[3];
  int rank;
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
  std::vector<TmaStore> stores_uncommitted;             // TMA stores issued since the last bulk commit
  std::deque<std::vector<TmaStore>> stores_committed;   // bulk groups in flight, oldest first
  // Per mbarrier, the completed phases this thread has seen (a successful try_wait): what of the
  // TMA copies it may read.
  std::vector<std::pair<const uint64_t*, uint64_t>> seen_phases;
  const char* waiting_for = nullptr;  // what the thread waits on, for the deadlock report
  uint64_t waiting_detail = 0;         // which one (a barrier's shared byte, a named barrier's id)
  bool wgmma_fenced = false;     // a wgmma.fence since the last commit
  bool copies_unfenced = false;  // cp.async copies landed since the last fence.proxy.async
  bool awaiting_previous_kernel = false;  // of a programmatic launch, before its griddepcontrol.wait

  // A fresh thread at `at`, keeping the containers' memory (blocks start by the thousand).
  void start(const ThreadPosition& at, void* stack_pointer, bool programmatic) {
    sp = stack_pointer;
    done = at_barrier = wgmma_fenced = copies_unfenced = false;
    awaiting_previous_kernel = programmatic;
    waiting_for = nullptr;
    seen_phases.clear();
    barrier_generation = 0;
    position = at;
    uncommitted.clear();
    committed.clear();
    wgmma_uncommitted.clear();
    wgmma_committed.clear();
    stores_uncommitted.clear();
    stores_committed.clear();
  }
};

// A TMA copy's box as it lands: `image` (read from global memory at the issue) over `bytes` of
// shared memory from `shared`.
struct TmaCopy {
  unsigned char* shared;
  std::vector<unsigned char> image;
};

struct MBarrier {
  uint32_t count = 0, pending = 0;   // arrivals a phase needs; still missing in the current one
  uint64_t phases = 0;               // completed so far
  uint64_t announced = 0, issued = 0;  // the current phase's transaction bytes: expected, issued as copies
  int initialised_by = -1;           // the thread that ran mbarrier.init
  bool published = false;            // a fence.mbarrier_init by that thread since
  std::vector<TmaCopy> in_flight;    // issued in the current phase
  std::vector<TmaCopy> unlanded;     // of completed phases, before any thread saw them complete
};

// Shared memory a TMA copy filled, visible to a thread only once it has seen the copy's phase
// complete: `phases`, the barrier's completed phases counting that one.
struct TmaRegion {
  const unsigned char* start;
  size_t bytes;
  const uint64_t* barrier;
  uint64_t phases;
};

constexpr int kNamedBarriers = 16;
struct NamedBarrier {
  int expected = 0, arrived = 0;
  unsigned generation = 0;
};

constexpr int kRegisterFile = 64 * 1024;  // an SM's 32-bit registers: one block has them all

struct StaticSharedMemory {
  alignas(256) unsigned char bytes[kMaxStaticSharedBytes];
};

// A resident block: its threads, their stacks and its shared memory (a slot of the launch's
// resident blocks, reused by the blocks that follow in it).
struct Block {
  Stacks stacks;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  int live = 0, arrived = 0;
  unsigned generation = 0;
  uint64_t progress = 0;  // counts arrivals at barriers and warp operations, and exits
  int unfenced_threads = 0;  // fibers whose copies_unfenced is set
  std::vector<unsigned char> shared;  // dynamic shared memory
  // In the first block of a launch: `shared` as the block's last fence.proxy.async left it, with the
  // TMA copies landed since (what the async proxy may read); empty in the other blocks.
  std::vector<unsigned char> fenced;
  // Static shared memory, at the offsets the launch gives its variables (HostThread).
  std::unique_ptr<StaticSharedMemory> static_shared = std::make_unique<StaticSharedMemory>();
  uint64_t linear = 0;  // the block's number in its launch, x fastest
  dim3 index;
  bool resident = false;   // running a block of the current launch
  bool turn_over = false;  // a thread ended the block's turn (end_block_turn)
  bool warp_slept = false;  // a thread of the running warp slept in a spin (sleep_in_spin)
  std::map<const uint64_t*, MBarrier> mbarriers;  // by the barrier's 8 bytes
  std::vector<TmaRegion> tma_regions;              // what the completed copies filled
  // The 16 destination bytes (by their start) of every cp.async issued and not yet landed, any
  // thread's: PTX orders no two copies that no wait separates, so a second copy there may land first.
  std::unordered_set<const void*> copies_in_flight;
  NamedBarrier named[kNamedBarriers];
  std::vector<int> warp_registers;  // setmaxnreg's registers per thread, by warp
  int free_registers = 0;           // the block's registers no warp holds
};

struct HostThread {
  void* scheduler_sp = nullptr;
  Fiber* running = nullptr;
  std::vector<std::unique_ptr<Block>> slots;  // the resident blocks' slots
  Block* block = nullptr;                     // the one whose thread runs
  const std::function<void()>* body = nullptr;  // the launch's kernel call
  // Static shared variables are placed one by one as the launch first reaches each (the GPU knows
  // them all at the launch), at the same offsets in every block; poisoned up to static_bytes as
  // each block starts, and each new one in every resident block.
  size_t static_bytes = 0, static_budget = 0;  // placed in this launch; the most the launch may place
  uint64_t launch = 0;  // this host thread's launches so far: when a StaticSharedPlace was placed
  uint64_t spin_sleeps = 0;
};

// The host thread's state. Reached through a statically initialised __thread pointer: a
// thread_local object with a constructor would cost a call to its TLS initialiser at each of the
// fibers' many accesses (a tenth of an emulated test's time).
__thread HostThread* host_state = nullptr;

__attribute__((noinline)) HostThread& first_access_to_host() {
  static thread_local HostThread state;
  return *(host_state = &state);
}

inline HostThread& this_host() { return host_state ? *host_state : first_access_to_host(); }
inline Block& current_block() { return *this_host().block; }

void yield() { emu_switch_stack(&this_host().running->sp, this_host().scheduler_sp); }

// Releases the block's barrier once every live thread has arrived (an exiting thread may be the
// last one it waited for).
bool release_barrier_if_complete(Block& b) {
  if (b.arrived == 0 || b.arrived != b.live) return false;
  b.arrived = 0;
  ++b.generation;
  return true;
}

void fiber_main(void*) {
  (*this_host().body)();
  Fiber& me = *this_host().running;
  if (!me.wgmma_uncommitted.empty() || !me.wgmma_committed.empty())
    fatal("a thread exited with wgmma operations it never waited for");
  if (!me.stores_uncommitted.empty() || !me.stores_committed.empty())
    fatal("a thread exited with TMA stores it never waited for (cp.async.bulk.wait_group): the shared memory they "
          "read goes with the block");
  if (me.awaiting_previous_kernel)
    fatal("a thread of a launch with programmatic dependent launch exited without griddepcontrol.wait: the kernel "
          "after it may then run before the kernel before it completes (kernels/device_utils.cuh's "
          "await_previous_kernel is every kernel's first statement)");
  me.done = true;
  Block& b = current_block();
  --b.live;
  --b.warps[me.position.linear_index() / 32].live;
  ++b.progress;
  release_barrier_if_complete(b);
  emu_switch_stack(&me.sp, this_host().scheduler_sp);
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
  this_host().running = &f;
  running_position = &f.position;
  awaiting_previous_kernel = f.awaiting_previous_kernel;
  emu_switch_stack(&this_host().scheduler_sp, f.sp);
  this_host().running = nullptr;
  running_position = nullptr;
  awaiting_previous_kernel = false;
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
      if (b.turn_over) return;
      if (b.warp_slept) {  // the warp waits for another block: its next poll in the next turn
        b.warp_slept = false;
        return;
      }
    }
    if (!runnable || b.progress == progress) return;
  }
}

// What the block's live threads wait on, by kind: a barrier or warp operation that others never
// reach, an mbarrier phase that never completes, registers no warp frees.
std::string waits_of(const Block& b) {
  std::map<std::string, std::vector<int>> threads;
  for (const Fiber& f : b.fibers)
    if (!f.done) {
      std::string what = f.waiting_for ? f.waiting_for : "a barrier or warp operation that others never reach";
      if (f.waiting_for && f.waiting_detail != ~0ull) what += " " + std::to_string(f.waiting_detail);
      threads[what].push_back(f.position.linear_index());
    }
  std::string report;
  for (const auto& [what, ids] : threads)
    report += (report.empty() ? "" : "; ") + std::to_string(ids.size()) + " thread(s) from " +
              std::to_string(ids.front()) + " wait for " + what;
  return report;
}

// xorshift64: the next of a sequence of draws (state never zero).
uint64_t next_draw(uint64_t& state) {
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return state;
}

// Items [0, n) in an order drawn from `state` (Fisher-Yates).
void shuffle(int* items, int n, uint64_t& state) {
  for (int k = n - 1; k > 0; --k) std::swap(items[k], items[next_draw(state) % uint64_t(k + 1)]);
}

// Starts the launch's block number `linear` (x fastest) in slot b: its threads at their first
// instruction, its shared memory poisoned.
void start_block(Block& b, const LaunchConfig& c, uint64_t linear) {
  const int threads = int(c.block.x * c.block.y * c.block.z), warps = (threads + 31) / 32;
  const dim3 index(unsigned(linear % c.grid.x), unsigned(linear / c.grid.x % c.grid.y),
                   unsigned(linear / (uint64_t(c.grid.x) * c.grid.y)));
  b.stacks.reserve(size_t(threads));
  b.linear = linear;
  b.index = index;
  b.resident = true;
  b.fibers.resize(threads);
  b.warps.resize(warps);
  for (Warp& w : b.warps) w.reset();
  for (int i = 0; i < threads; ++i) {
    b.fibers[i].start({dim3(i % c.block.x, i / c.block.x % c.block.y, i / (c.block.x * c.block.y)), index,
                       c.block, c.grid},
                      initial_stack(b.stacks.top(size_t(i))), c.programmatic);
    ++b.warps[i / 32].live;
  }
  b.live = threads;
  b.arrived = 0;
  b.progress = 0;
  b.unfenced_threads = 0;
  b.mbarriers.clear();
  b.tma_regions.clear();
  b.copies_in_flight.clear();
  for (NamedBarrier& n : b.named) n = NamedBarrier{};
  // What __launch_bounds__(threads, 1) compiles the kernel with, the block's registers: only what
  // a warp's decrease frees is there for another's increase.
  b.warp_registers.assign(warps, std::min(255, kRegisterFile / threads / 8 * 8));
  b.free_registers = 0;
  // Shared memory starts as garbage on the GPU: poisoned here, so a read before a write shows.
  b.shared.resize(c.shared_bytes);
  std::memset(b.shared.data(), 0xFF, b.shared.size());
  std::memset(b.static_shared->bytes, 0xFF, this_host().static_bytes);
  if (linear == 0)
    b.fenced = b.shared;
  else
    b.fenced.clear();
}

// Runs each warp of block b as far as it goes (to a barrier others have not reached, a wait on
// another block, or its end): false if no thread of the block moved on.
// The first two blocks of a launch run warp 0 ahead first and the last warp first: a warp that
// reads what a later warp writes, without a barrier between, meets poison in the one order, as
// does one that reads what an earlier warp writes in the other. The other blocks run their warps
// in an order drawn anew each time (from `draw`), so that warps meet in many more orders.
bool step_block(Block& b, uint64_t draw) {
  const uint64_t progress = b.progress;
  const int warps = int(b.warps.size());
  int order[kMaxThreadsPerBlock / 32];
  for (int i = 0; i < warps; ++i) order[i] = i;
  if (b.linear == 1)
    std::reverse(order, order + warps);
  else if (b.linear > 1)
    shuffle(order, warps, draw);
  b.turn_over = false;
  for (int i = 0; i < warps && !b.turn_over; ++i) run_warp_to_barrier(b, order[i]);
  return b.progress != progress;
}

// The checks of a block's exit.
void finish_block(Block& b) {
  b.resident = false;
  // setmaxnreg is a warpgroup's: all four of its warps, the same count.
  for (size_t w = 0; w + 4 <= b.warp_registers.size(); w += 4)
    for (size_t other = w + 1; other < w + 4; ++other)
      if (b.warp_registers[other] != b.warp_registers[w])
        fatal("setmaxnreg by some warps of warpgroup " + std::to_string(w / 4) + " only (warps " + std::to_string(w) +
              " and " + std::to_string(other) + " hold " + std::to_string(b.warp_registers[w]) + " and " +
              std::to_string(b.warp_registers[other]) + " registers a thread)");
  // PTX leaves a named barrier's state at the exit unsaid: the kernels leave none behind.
  for (int id = 1; id < kNamedBarriers; ++id)
    if (b.named[id].arrived)
      fatal("named barrier " + std::to_string(id) + " has " + std::to_string(b.named[id].arrived) +
            " arrivals left at the block's exit (a hand-over nobody took)");
}

std::string block_name(const Block& b) {
  return "block (" + std::to_string(b.index.x) + ", " + std::to_string(b.index.y) + ", " + std::to_string(b.index.z) +
         ")";
}

}  // namespace

__thread const ThreadPosition* running_position = nullptr;
__thread bool awaiting_previous_kernel = false;

void grid_dependency_wait() { this_host().running->awaiting_previous_kernel = awaiting_previous_kernel = false; }

void memory_before_previous_kernel(const char* what) {
  fatal(std::string("a thread of a launch with programmatic dependent launch accessed memory (") + what +
        ") before its griddepcontrol.wait: the kernel before it in the stream may still be writing it");
}

void fatal_launch_attribute(int id) {
  fatal("cudaLaunchKernelEx with launch attribute " + std::to_string(id) +
        ": only programmatic stream serialization is emulated");
}

void position_read_outside_a_kernel() { fatal("threadIdx and friends read outside a kernel"); }

void* dynamic_shared_memory() { return current_block().shared.data(); }

void* static_shared_memory(StaticSharedPlace& place, size_t bytes, size_t alignment) {
  if (!this_host().running) fatal("a __shared__ variable reached outside a kernel");
  HostThread& host = this_host();
  if (place.launch != host.launch) {
    const size_t offset = (host.static_bytes + alignment - 1) / alignment * alignment;
    if (offset + bytes > host.static_budget)
      fatal(std::to_string(offset + bytes) + " bytes of static __shared__ variables beside " +
            std::to_string(current_block().shared.size()) + " bytes of dynamic shared memory: more than the GPU lets this kernel " +
            "have (48 KiB in all, or 227 KiB with its dynamic limit raised; static at most 48 KiB)");
    for (const auto& slot : host.slots)  // resident blocks started before it was placed
      std::memset(slot->static_shared->bytes + host.static_bytes, 0xFF, offset + bytes - host.static_bytes);
    host.static_bytes = offset + bytes;
    place = {host.launch, offset};
  }
  return current_block().static_shared->bytes + place.offset;
}

void misaligned_cast(const char* type, const void* p, size_t alignment) {
  char address[32];
  std::snprintf(address, sizeof address, "%p", p);
  fatal(std::string("misaligned address: ") + type + " at " + address + ", not a multiple of " +
        std::to_string(alignment) + " bytes (a GPU faults on the access)");
}

void async_copy(void* shared, const void* global, size_t bytes) {
  check_previous_kernel_awaited("cp.async");
  if (bytes != kAsyncCopyBytes) fatal("cp.async of other than 16 bytes");
  if (!current_block().copies_in_flight.insert(shared).second)
    fatal("a cp.async to shared memory that another copy still in flight writes (no cp.async.wait_group "
          "between them): the two may land in either order");
  PendingCopy c{shared, {}};
  std::memcpy(c.data, global, bytes);
  std::memset(shared, 0xFF, bytes);
  this_host().running->uncommitted.push_back(c);
}

// The operations issued since the last commit become the newest group in flight (cp.async copies,
// wgmma products and TMA stores alike).
template <typename Operation>
void commit_group(std::vector<Operation>& uncommitted, std::deque<std::vector<Operation>>& committed) {
  committed.push_back(std::move(uncommitted));
  uncommitted.clear();
}

void async_copy_commit() { commit_group(this_host().running->uncommitted, this_host().running->committed); }

void async_copy_wait(int pending_groups_left) {
  Fiber& f = *this_host().running;
  while (int(f.committed.size()) > pending_groups_left) {
    for (const PendingCopy& c : f.committed.front()) {
      std::memcpy(c.shared, c.data, kAsyncCopyBytes);
      current_block().copies_in_flight.erase(c.shared);
    }
    if (!f.copies_unfenced && !f.committed.front().empty()) {
      f.copies_unfenced = true;
      ++current_block().unfenced_threads;
    }
    f.committed.pop_front();
  }
}

void proxy_async_fence() {
  Fiber& f = *this_host().running;
  Block& b = current_block();
  if (f.copies_unfenced) --b.unfenced_threads;
  f.copies_unfenced = false;
  if (!b.fenced.empty()) std::memcpy(b.fenced.data(), b.shared.data(), b.shared.size());
}

void wgmma_fence() { this_host().running->wgmma_fenced = true; }

void wgmma_issue(std::function<void()> land) {
  Fiber& f = *this_host().running;
  if (!f.wgmma_fenced) fatal("a wgmma group begun without a wgmma.fence");
  if (current_block().unfenced_threads > 0)
    for (const Fiber& other : current_block().fibers)
      if (other.copies_unfenced)
        fatal("wgmma issued while thread " + std::to_string(other.position.linear_index()) +
              "'s landed cp.async copies are not fenced for the async proxy (fence.proxy.async)");
  f.wgmma_uncommitted.push_back(std::move(land));
}

void wgmma_commit() {
  Fiber& f = *this_host().running;
  commit_group(f.wgmma_uncommitted, f.wgmma_committed);
  f.wgmma_fenced = false;
}

void wgmma_wait(int pending_groups_left) {
  Fiber& f = *this_host().running;
  while (int(f.wgmma_committed.size()) > pending_groups_left) {
    for (const auto& land : f.wgmma_committed.front()) land();
    f.wgmma_committed.pop_front();
  }
}

uint32_t shared_window_address(const void* p) {
  const std::vector<unsigned char>& shared = current_block().shared;
  const auto* byte = static_cast<const unsigned char*>(p);
  if (shared.empty() || byte < shared.data() || byte >= shared.data() + shared.size())
    fatal("a shared-window address of memory outside the dynamic shared memory (the emulator maps only that)");
  return kDynamicSharedWindowBase + uint32_t(byte - shared.data());
}

SharedWindow dynamic_shared_window() {
  const Block& b = current_block();
  return {b.shared.data(), uint32_t(b.shared.size()), b.fenced.empty() ? nullptr : b.fenced.data()};
}

void unfenced_async_proxy_read(uint32_t byte, const char* reader) {
  fatal(std::string(reader) + " of thread " + std::to_string(this_host().running->position.linear_index()) +
        " reads dynamic shared byte " + std::to_string(byte) +
        ", written since the block's last fence.proxy.async: the async proxy may not see the write "
        "(fence.proxy.async.shared::cta after the writes, then the barrier)");
}

namespace {

// What an initialised mbarrier's 8 bytes hold here (the GPU's own state is opaque): a value that
// poison (0xFF) and a copied tile cannot be, so a barrier used before its init, or overwritten
// since, is found at its next use.
uint64_t mbarrier_tag(const uint64_t* barrier) {
  return 0x6D62617272696572ull ^ reinterpret_cast<uintptr_t>(barrier);
}

bool in_dynamic_shared(const void* p) {
  const Block& b = current_block();
  const auto* byte = static_cast<const unsigned char*>(p);
  return !b.shared.empty() && byte >= b.shared.data() && byte < b.shared.data() + b.shared.size();
}

// A byte's offset in the block's dynamic or static shared memory (counted apart).
uint64_t shared_byte(const void* p) {
  const Block& b = current_block();
  const auto* byte = static_cast<const unsigned char*>(p);
  return uint64_t(byte - (in_dynamic_shared(p) ? b.shared.data() : b.static_shared->bytes));
}

std::string shared_offset(const void* p) {
  return (in_dynamic_shared(p) ? "dynamic shared byte " : "static shared byte ") + std::to_string(shared_byte(p));
}

MBarrier& initialised_mbarrier(uint64_t* barrier, const char* what) {
  Block& b = current_block();
  auto found = b.mbarriers.find(barrier);
  if (found == b.mbarriers.end() || *barrier != mbarrier_tag(barrier))
    fatal(std::string(what) + " on the mbarrier at " + shared_offset(barrier) +
          (found == b.mbarriers.end() ? ", which no mbarrier.init set up in this block"
                                      : ", whose 8 bytes were overwritten since its mbarrier.init"));
  return found->second;
}

// Ends the current phase once its arrivals are in and its announced bytes issued: its copies wait
// for a thread to see the phase complete.
void complete_phase_if_done(MBarrier& m, uint64_t* barrier) {
  if (m.pending > 0) return;
  if (m.issued > m.announced)
    fatal("TMA copies of " + std::to_string(m.issued) + " bytes on a phase of the mbarrier at " +
          shared_offset(barrier) + " that announced " + std::to_string(m.announced) +
          " (arrive.expect_tx): the phase would complete before the last of them lands");
  if (m.issued < m.announced) return;
  for (TmaCopy& c : m.in_flight) {
    current_block().tma_regions.push_back({c.shared, c.image.size(), barrier, m.phases + 1});
    m.unlanded.push_back(std::move(c));
  }
  m.in_flight.clear();
  ++m.phases;
  m.pending = m.count;
  m.announced = m.issued = 0;
}

// A TMA copy's write of shared memory (its poison at the issue, its box as it lands) goes through
// the async proxy: what it may read next without a fence.
void mirror_async_proxy_write(const unsigned char* shared, size_t bytes) {
  Block& b = current_block();
  if (!b.fenced.empty()) std::memcpy(b.fenced.data() + (shared - b.shared.data()), shared, bytes);
}

bool overlaps(const TmaCopy& c, const unsigned char* start, size_t bytes) {
  return c.shared < start + bytes && start < c.shared + c.image.size();
}

}  // namespace

void mbarrier_init(uint64_t* barrier, uint32_t count) {
  Block& b = current_block();
  const auto* byte = reinterpret_cast<const unsigned char*>(barrier);
  const bool in_dynamic = !b.shared.empty() && byte >= b.shared.data() && byte + 8 <= b.shared.data() + b.shared.size();
  const bool in_static = byte >= b.static_shared->bytes && byte + 8 <= b.static_shared->bytes + this_host().static_bytes;
  if (!in_dynamic && !in_static) fatal("mbarrier.init of memory outside the block's shared memory");
  if (reinterpret_cast<uintptr_t>(barrier) % 8) fatal("mbarrier.init at an address that is not 8-byte aligned");
  if (count == 0 || count >= (1u << 20)) fatal("mbarrier.init with a count outside [1, 2^20)");
  MBarrier& m = b.mbarriers[barrier];
  m = MBarrier{};
  m.count = m.pending = count;
  m.initialised_by = this_host().running->position.linear_index();
  *barrier = mbarrier_tag(barrier);
  ++b.progress;
}

void fence_mbarrier_init() {
  const int me = this_host().running->position.linear_index();
  for (auto& [barrier, m] : current_block().mbarriers)
    if (m.initialised_by == me) m.published = true;
}

void mbarrier_arrive(uint64_t* barrier, uint32_t expect_tx_bytes) {
  MBarrier& m = initialised_mbarrier(barrier, expect_tx_bytes ? "mbarrier.arrive.expect_tx" : "mbarrier.arrive");
  m.announced += expect_tx_bytes;
  --m.pending;
  ++current_block().progress;
  complete_phase_if_done(m, barrier);
}

bool mbarrier_try_wait(uint64_t* barrier, uint32_t parity) {
  MBarrier& m = initialised_mbarrier(barrier, "mbarrier.try_wait");
  if (m.phases % 2 == (parity & 1)) {  // the phase of that parity is the current one, not done
    Fiber& me = *this_host().running;
    me.waiting_for = in_dynamic_shared(barrier) ? "an mbarrier phase that never completes, at dynamic shared byte"
                                              : "an mbarrier phase that never completes, at static shared byte";
    me.waiting_detail = shared_byte(barrier);
    yield();
    me.waiting_for = nullptr;
    return false;
  }
  for (const TmaCopy& c : m.unlanded) {
    std::memcpy(c.shared, c.image.data(), c.image.size());
    mirror_async_proxy_write(c.shared, c.image.size());
  }
  m.unlanded.clear();
  // The phase this wait names: the last completed one of that parity.
  const uint64_t seen = m.phases == 0 ? 0 : (m.phases - 1) % 2 == (parity & 1) ? m.phases : m.phases - 1;
  auto& seen_phases = this_host().running->seen_phases;
  auto mine = std::find_if(seen_phases.begin(), seen_phases.end(), [&](const auto& p) { return p.first == barrier; });
  if (mine == seen_phases.end())
    seen_phases.push_back({barrier, seen});
  else
    mine->second = std::max(mine->second, seen);
  ++current_block().progress;
  return true;
}

void check_tma_visible(uint32_t window_address, const char* reader) {
  const Block& b = current_block();
  const unsigned char* byte = b.shared.data() + (window_address - kDynamicSharedWindowBase);
  const auto& seen_phases = this_host().running->seen_phases;
  for (const TmaRegion& r : b.tma_regions) {
    if (byte < r.start || byte >= r.start + r.bytes) continue;
    auto mine = std::find_if(seen_phases.begin(), seen_phases.end(), [&](const auto& p) { return p.first == r.barrier; });
    if (mine == seen_phases.end() || mine->second < r.phases)
      fatal(std::string(reader) + " of thread " + std::to_string(this_host().running->position.linear_index()) +
            " reads shared memory a TMA copy filled before this thread waited for the copy's phase of the mbarrier at " +
            shared_offset(r.barrier) + " (on the GPU it may read the tile before it lands)");
  }
}

// The tensor map at map_address, checked for a TMA operation (`what`) of this rank on shared memory
// at `shared` (128-byte aligned, the box within the dynamic shared memory): the map and the box's bytes.
std::pair<EmulatedTensorMap, uint32_t> checked_tma_box(const void* map_address, int rank, const void* shared,
                                                       const char* what) {
  EmulatedTensorMap map;
  std::memcpy(&map, map_address, sizeof map);
  if (map.magic != EmulatedTensorMap::kMagic)
    fatal(std::string(what) + " through bytes that cuTensorMapEncodeTiled did not write (not a tensor map)");
  if (int(map.rank) != rank)
    fatal("a " + std::to_string(rank) + "-D " + what + " through a tensor map of rank " + std::to_string(map.rank));
  if (shared_window_address(shared) % 128) fatal(std::string(what) + " on shared memory that is not 128-byte aligned");
  uint32_t elements = 1;
  for (int d = 0; d < rank; ++d) elements *= map.box[d];
  const uint32_t row_bytes = map.box[0] * map.element_bytes, bytes = elements * map.element_bytes;
  if (map.swizzle_bytes && row_bytes != map.swizzle_bytes)
    fatal("a swizzled TMA box whose rows are not one swizzle span (the emulator implements only that)");
  const Block& b = current_block();
  if (uint64_t(static_cast<const unsigned char*>(shared) - b.shared.data()) + bytes > b.shared.size())
    fatal(std::string(what) + " past the end of the dynamic shared memory");
  return {map, bytes};
}

// Each element of the box at `coordinates`: visit(byte offset in the box as shared memory holds it
// (row-major, then swizzled), its global address, or null outside the matrix).
template <typename Visit>
void for_each_box_element(const EmulatedTensorMap& map, const int* coordinates, int rank, uint32_t window,
                          Visit visit) {
  uint32_t elements = 1;
  for (int d = 0; d < rank; ++d) elements *= map.box[d];
  for (uint32_t e = 0; e < elements; ++e) {
    uint32_t index[3] = {e % map.box[0], 0, 0};
    if (rank > 1) index[1] = e / map.box[0] % map.box[1];
    if (rank > 2) index[2] = e / (map.box[0] * map.box[1]);
    bool inside = true;
    const unsigned char* global = map.base;
    for (int d = 0; d < rank; ++d) {
      const int64_t at = int64_t(coordinates[d]) + index[d];
      inside = inside && at >= 0 && uint64_t(at) < map.dims[d];
      global += at * int64_t(map.strides[d]);
    }
    uint32_t address = window + e * map.element_bytes;
    if (map.swizzle_bytes) address ^= (address >> 7 & (map.swizzle_bytes / 16 - 1)) << 4;
    visit(address - window, inside ? global : nullptr);
  }
}

void tma_load(void* shared, const void* map_address, const int* coordinates, int rank, uint64_t* barrier) {
  check_previous_kernel_awaited("a TMA copy");
  Block& b = current_block();
  MBarrier& m = initialised_mbarrier(barrier, "a TMA copy (cp.async.bulk.tensor)");
  if (!m.published)
    fatal("a TMA copy completes on the mbarrier at " + shared_offset(barrier) +
          ", whose mbarrier.init no fence.mbarrier_init made visible to the async proxy");
  // (not a structured binding: the lambda below captures the map, which C++17 allows only for variables)
  const auto checked = checked_tma_box(map_address, rank, shared, "a TMA copy");
  const EmulatedTensorMap& map = checked.first;
  const uint32_t bytes = checked.second;
  auto* destination = static_cast<unsigned char*>(shared);
  for (const auto& [other, state] : b.mbarriers)
    for (const auto* copies : {&state.in_flight, &state.unlanded})
      for (const TmaCopy& c : *copies)
        if (overlaps(c, destination, bytes))
          fatal("a TMA copy into shared memory that an earlier copy, not yet waited for, also fills");
  TmaCopy copy{destination, std::vector<unsigned char>(bytes)};
  for_each_box_element(map, coordinates, rank, shared_window_address(shared), [&](uint32_t at, const unsigned char* g) {
    if (g)
      std::memcpy(copy.image.data() + at, g, map.element_bytes);
    else
      std::memset(copy.image.data() + at, 0, map.element_bytes);  // out of bounds: zeros
  });
  std::memset(destination, 0xFF, bytes);
  mirror_async_proxy_write(destination, bytes);
  auto& regions = b.tma_regions;
  regions.erase(std::remove_if(regions.begin(), regions.end(),
                               [&](const TmaRegion& r) { return r.start < destination + bytes && destination < r.start + r.bytes; }),
                regions.end());
  m.in_flight.push_back(std::move(copy));
  m.issued += bytes;
  ++b.progress;
  complete_phase_if_done(m, barrier);
}

void tma_store(const void* shared, const void* map_address, const int* coordinates, int rank) {
  check_previous_kernel_awaited("a TMA store");
  const auto [map, bytes] = checked_tma_box(map_address, rank, shared, "a TMA store");
  const auto* source = static_cast<const unsigned char*>(shared);
  check_async_proxy_read(dynamic_shared_window(), uint32_t(source - current_block().shared.data()), bytes,
                         "a TMA store's box");
  TmaStore store{map, source, std::vector<unsigned char>(source, source + bytes), {0, 0, 0}, rank};
  std::copy(coordinates, coordinates + rank, store.coordinates);
  this_host().running->stores_uncommitted.push_back(std::move(store));
}

void bulk_commit() { commit_group(this_host().running->stores_uncommitted, this_host().running->stores_committed); }

void bulk_wait(int pending_groups_left) {
  Fiber& f = *this_host().running;
  while (int(f.stores_committed.size()) > pending_groups_left) {
    for (const TmaStore& s : f.stores_committed.front()) {
      // The GPU reads the box at some time between the issue and this wait: it must not change then.
      if (std::memcmp(s.image.data(), s.shared, s.image.size()) != 0)
        fatal("shared memory a TMA store reads changed between the store's issue and the wait for it: written after "
              "the store was issued (a barrier missing before it) or reused before cp.async.bulk.wait_group.read");
      for_each_box_element(s.map, s.coordinates, s.rank, shared_window_address(s.shared),
                           [&](uint32_t at, const unsigned char* g) {
                             if (g) std::memcpy(const_cast<unsigned char*>(g), s.image.data() + at, s.map.element_bytes);
                           });  // out of bounds: not written
    }
    f.stores_committed.pop_front();
  }
}

void named_barrier(int id, int threads, bool wait) {
  Block& b = current_block();
  if (id < 1 || id >= kNamedBarriers) fatal("a named barrier id outside 1-15 (0 is __syncthreads')");
  if (threads <= 0 || threads % 32 || threads > int(b.fibers.size()))
    fatal("a named barrier of " + std::to_string(threads) + " threads: not a multiple of 32 within the block");
  NamedBarrier& n = b.named[id];
  if (n.arrived == 0) n.expected = threads;
  if (threads != n.expected)
    fatal("named barrier " + std::to_string(id) + " met with " + std::to_string(threads) + " and " +
          std::to_string(n.expected) + " threads");
  ++b.progress;
  const unsigned generation = n.generation;
  if (++n.arrived == n.expected) {
    n.arrived = 0;
    ++n.generation;
    return;
  }
  if (!wait) return;
  Fiber& me = *this_host().running;
  me.waiting_for = "named barrier";
  me.waiting_detail = uint64_t(id);
  while (n.generation == generation) yield();
  me.waiting_for = nullptr;
}

void set_max_registers(int registers, bool increase) {
  const char* what = increase ? "setmaxnreg.inc" : "setmaxnreg.dec";
  if (registers < 24 || registers > 256 || registers % 8) fatal(std::string(what) + " outside 24-256 or not a multiple of 8");
  int all[32];
  warp_exchange(what, &registers, all, sizeof registers);
  for (int lane : all)
    if (lane != registers) fatal(std::string(what) + " with different counts in one warp");
  Block& b = current_block();
  const int warp = this_host().running->position.linear_index() / 32;
  int& held = b.warp_registers[warp];
  if (this_host().running->position.linear_index() % 32 == 0) {  // the warp's accounting, once
    if (increase ? registers < held : registers > held)
      fatal(std::string(what) + " to " + std::to_string(registers) + " registers from " + std::to_string(held));
    const int change = 32 * (registers - held);
    this_host().running->waiting_for = "registers (setmaxnreg.inc) that no warp frees";
    this_host().running->waiting_detail = ~0ull;
    while (increase && b.free_registers < change) yield();  // until another warp's decrease frees them
    this_host().running->waiting_for = nullptr;
    b.free_registers -= change;
    held = registers;
    ++b.progress;
  }
  warp_pick("setmaxnreg done", 0, 0);  // the warp goes on together, with its registers
}

uint64_t spin_sleeps() { return this_host().spin_sleeps; }

void end_block_turn() {
  if (!this_host().running) return;  // a host thread's atomic
  Block& b = current_block();
  b.turn_over = true;
  ++b.progress;
  yield();
}

void sleep_in_spin() {
  if (!this_host().running) return;  // the host's own sleep
  ++this_host().spin_sleeps;
  current_block().warp_slept = true;
  Fiber& me = *this_host().running;
  me.waiting_for = "a value in global memory that no resident block changes (a spin with __nanosleep)";
  me.waiting_detail = ~0ull;
  yield();
  me.waiting_for = nullptr;
}

void sync_threads() {
  Block& b = current_block();
  Fiber& me = *this_host().running;
  const unsigned generation = b.generation;
  ++b.progress;
  ++b.arrived;
  if (release_barrier_if_complete(b)) return;
  me.at_barrier = true;
  me.barrier_generation = generation;
  while (b.generation == generation) yield();
  me.at_barrier = false;
}

namespace {

// memcpy of one lane's value, its usual sizes as constants that the compiler inlines (the
// library call for a few bytes was a fifteenth of an emulated test's time).
void copy_lane_value(void* to, const void* from, size_t bytes) {
  switch (bytes) {
    case 4: std::memcpy(to, from, 4); return;
    case 8: std::memcpy(to, from, 8); return;
    default: std::memcpy(to, from, bytes);
  }
}

}  // namespace

void warp_collective(const char* what, const void* in, size_t in_bytes, void* out, size_t out_bytes,
                     WarpCombine combine, int pick_lane) {
  if (in_bytes > kSlotBytes || out_bytes > kSlotBytes) fatal("a warp operation on more than 32 bytes per lane");
  Block& b = current_block();
  const int lane_linear = this_host().running->position.linear_index();
  Warp& w = b.warps[lane_linear / 32];
  const int lane = lane_linear % 32;
  const int lanes = std::min(32, int(b.fibers.size()) - lane_linear / 32 * 32);
  if (w.live != lanes)
    fatal(std::string(what) + ": a warp operation with a full mask after some lanes of the warp exited");
  if (w.arrived == 0) w.what = what;
  if (w.what != what && std::strcmp(w.what, what) != 0)
    fatal(std::string("lanes of one warp meet in different operations: ") + w.what + " and " + what);
  const unsigned generation = w.generation, parity = generation % 2;
  copy_lane_value(w.inputs[parity] + lane * in_bytes, in, in_bytes);
  ++b.progress;
  if (++w.arrived == w.live) {
    if (combine) combine(w.inputs[parity], w.outputs[parity]);
    w.arrived = 0;
    ++w.generation;
  } else {
    while (w.generation == generation) yield();
  }
  if (combine)
    copy_lane_value(out, w.outputs[parity] + lane * out_bytes, out_bytes);
  else if (pick_lane >= 0)
    copy_lane_value(out, w.inputs[parity] + pick_lane * in_bytes, in_bytes);
  else
    std::memcpy(out, w.inputs[parity], 32 * in_bytes);
}

bool launchable(const void* kernel, LaunchConfig& c) {
  const size_t threads = size_t(c.block.x) * c.block.y * c.block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || c.block.z > 64 || c.grid.x == 0 || c.grid.y == 0 ||
      c.grid.z == 0 || c.grid.y > 65535 || c.grid.z > 65535) {
    record_launch_error(cudaErrorInvalidConfiguration);
    return false;
  }
  if (c.shared_bytes > max_dynamic_shared_bytes(kernel)) {
    record_launch_error(cudaErrorInvalidValue);
    return false;
  }
  if (this_host().running) fatal("a kernel launched from inside a kernel");
  c.static_budget = static_shared_budget(kernel, c.shared_bytes);
  return true;
}

// Turns in a row of every resident block, with threads polling in spins and nothing else moving,
// before it is a deadlock: a thread that leaves its spin and hands a value on by plain stores
// counts no progress (only barriers, warp operations, atomics and exits do), so a few such turns
// may still move on; 2^16 of them, well under a second, do not.
constexpr int kIdleTurns = 1 << 16;

// SPEEDRUN_EMULATOR_SEED=N (default 0) draws the blocks' and warps' turns from another sequence:
// the same tests under other interleavings.
const uint64_t schedule_seed = [] {
  const char* seed = std::getenv("SPEEDRUN_EMULATOR_SEED");
  return seed ? std::strtoull(seed, nullptr, 10) : 0ull;
}();

void run_grid(const void* kernel, const LaunchConfig& c, const std::function<void()>& body) {
  HostThread& host = this_host();
  host.body = &body;
  ++host.launch;
  host.static_bytes = 0;
  host.static_budget = c.static_budget;
  // As on the GPU, blocks are handed out in order (x fastest) to the resident slots, one an SM, as
  // slots free; the resident blocks take turns, each running its warps as far as they go, in an
  // order drawn anew each turn from a sequence seeded by the launch, about half of them sitting
  // each turn out (as slower SMs would), so that blocks that wait on each other (a spin in global
  // memory) interleave in many orders and later ones overtake earlier ones.
  const uint64_t blocks = uint64_t(c.grid.x) * c.grid.y * c.grid.z;
  const int resident = int(std::min<uint64_t>(blocks, kEmulatedMultiprocessors));
  while (int(host.slots.size()) < resident) host.slots.push_back(std::make_unique<Block>());
  uint64_t next = 0;  // the next block to start
  for (int i = 0; i < resident; ++i) start_block(*host.slots[i], c, next++);
  uint64_t draw = host.launch * 0x9E3779B97F4A7C15ull ^ schedule_seed * 0xD1B54A32D192ED03ull;
  if (draw == 0) draw = 1;  // xorshift64's one fixed point
  int order[kEmulatedMultiprocessors];
  for (int k = 0; k < resident; ++k) order[k] = k;
  bool everyone = false;  // every block runs this turn: the last one, with some paused, moved none
  int idle_turns = 0;     // turns of every block in a row that moved none, though some thread polled
  for (int running = resident; running > 0;) {
    const uint64_t sleeps = host.spin_sleeps;
    shuffle(order, resident, draw);
    const uint64_t paused = everyone ? 0 : next_draw(draw);  // bit k: slot k sits this turn out (a slow SM)
    bool moved = false;
    for (int k = 0; k < resident; ++k) {
      Block& b = *host.slots[order[k]];
      if (!b.resident || (paused >> order[k] & 1)) continue;
      host.block = &b;
      moved |= step_block(b, next_draw(draw));
      if (b.live > 0) continue;
      finish_block(b);
      moved = true;
      if (next < blocks)
        start_block(b, c, next++);
      else
        --running;
    }
    if (moved) {
      everyone = false;
      idle_turns = 0;
    } else if (!everyone) {
      everyone = true;
    } else if (host.spin_sleeps == sleeps || ++idle_turns == kIdleTurns) {
      std::string waits;
      for (int k = 0; k < resident; ++k)
        if (host.slots[k]->resident)
          waits += (waits.empty() ? "" : " | ") + block_name(*host.slots[k]) + ": " + waits_of(*host.slots[k]);
      fatal("deadlock (no resident block can go on) in " + waits + " (launch " + std::to_string(host.launch) +
            " of this host thread, SPEEDRUN_EMULATOR_SEED=" + std::to_string(schedule_seed) + ")");
    }
  }
  for (int k = 0; k < resident; ++k) {
    const Block& b = *host.slots[k];
    const long thread = b.stacks.overflowed(b.fibers.size());
    if (thread >= 0)
      fatal("thread " + std::to_string(thread) + " of " + block_name(b) + " (or of an earlier block in its slot) " +
            "overflowed its " + std::to_string(kStackBytes >> 10) + " KiB stack");
  }
  host.block = nullptr;
  host.body = nullptr;
}

}  // namespace emu
