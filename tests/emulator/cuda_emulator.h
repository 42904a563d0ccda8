// A CPU emulator of the CUDA the kernels use, so that the GPU tests also run where there is no GPU
// (CI, and every session without one). Force-included (-include) into sources that
// tests/emulator/translate.py has rewritten: `k<<<grid, block, smem, stream>>>(args)` becomes
// emu::launch(...), `extern __shared__ T name[]` becomes emu::dynamic_shared<T>(), each static
// `__shared__` variable emu::static_shared<T>(), and kernels/ptx.cuh is replaced by
// tests/emulator/ptx.cuh.
//
// Each CUDA thread of a block is a fiber (its own stack, switched cooperatively on one host
// thread), so __syncthreads and the warp-synchronous operations (shuffles, wgmma's fragments) meet
// exactly as on the GPU, and a barrier some threads never reach is reported as a deadlock. A
// launch's blocks run as on a GPU of kEmulatedMultiprocessors SMs with one block resident on each
// (runtime.h): handed out in order as slots free, the resident ones taking turns (each as far as
// its warps go), so that blocks that wait on each other through global memory (a spin that sleeps
// with __nanosleep, which yields to the other blocks here) interleave in many orders; when none of
// them can go on, it is a deadlock, reported with what each waits for. By default every launch and copy completes before its call returns
// (streams and events only order what is already ordered); lazy streams (enqueue below) run work
// as late as its stream's waits allow instead. What this cannot show: races between streams other
// than those two orders, timing, and the GPU's own rounding of fast intrinsics (__expf is expf here).
#pragma once
// translate.py rewrites every __shared__ declaration; one it missed would otherwise compile as a
// per-thread local (CUDA's headers define __shared__ as nothing for a host compiler).
#define __shared__ static_assert(false, "a __shared__ declaration that translate.py did not rewrite");
#define __launch_bounds__(...)
#define __grid_constant__

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define SPEEDRUN_EMULATED 1

namespace emu {

struct ThreadPosition {
  dim3 thread, block, block_dim, grid_dim;
  // The thread's index in its block, x fastest: warps are runs of 32 of these.
  int linear_index() const { return int(thread.x + block_dim.x * (thread.y + block_dim.y * thread.z)); }
};
// The running CUDA thread's position (null between kernels), read inline: every threadIdx is one.
// __thread, not thread_local: statically initialised, so reading it (every threadIdx) calls no
// thread_local wrapper and initialiser check.
extern __thread const ThreadPosition* running_position;
[[noreturn]] void position_read_outside_a_kernel();
inline const ThreadPosition& position() {
  if (!running_position) position_read_outside_a_kernel();
  return *running_position;
}

void sync_threads();
// Every lane of the running thread's warp passes `in_bytes` at `in`; all of them meet, the last to
// arrive calls combine(inputs [32][in_bytes], outputs [32][out_bytes]) once for the warp, and each
// lane gets its output row in `out` (without `combine`: every lane's input, [32][in_bytes], or
// with `pick_lane` only that lane's, [in_bytes]: a shuffle copies one value, not 32).
// `what` names the operation: lanes that meet in different operations are a bug, reported as
// such. Rows are at most 32 bytes.
using WarpCombine = void (*)(const void* inputs, void* outputs);
void warp_collective(const char* what, const void* in, size_t in_bytes, void* out, size_t out_bytes,
                     WarpCombine combine, int pick_lane = -1);
inline void warp_exchange(const char* what, const void* mine, void* all, size_t bytes) {
  warp_collective(what, mine, bytes, all, 0, nullptr);
}
// The value lane `src_lane` (0..31) passed, as every lane of the warp meets.
template <typename T>
T warp_pick(const char* what, T mine, int src_lane) {
  T picked;
  warp_collective(what, &mine, sizeof(T), &picked, 0, nullptr, src_lane);
  return picked;
}
void* dynamic_shared_memory();

// cp.async as late and as early as PTX lets it land: the destination holds garbage (0xFF) from the
// issue until the issuing thread waits for the copy's group, so a tile read before the wait (and
// the barrier after it) or refilled while other threads still read it shows as NaN. The source is
// read at the issue. wait(n) lands every committed group but the n newest; uncommitted copies wait
// for a commit.
// griddepcontrol.wait: the running thread may touch memory from here on (check_previous_kernel_awaited).
void grid_dependency_wait();
void async_copy(void* shared, const void* global, size_t bytes);
void async_copy_commit();
void async_copy_wait(int pending_groups_left);

// wgmma.mma_async as late as PTX lets it complete: `land` (the product, reading shared memory and
// adding into the issuing thread's accumulator) runs when the thread waits for its group, so an
// accumulator read before the wait, or a tile refilled before it, shows. Groups as cp.async's.
void wgmma_issue(std::function<void()> land);
void wgmma_commit();
void wgmma_wait(int pending_groups_left);
// The fences order nothing here (fibers run in program order), but their absence is fatal: each
// wgmma group must begin after a wgmma.fence (PTX wants one wherever registers it uses were touched
// since the last; the kernels fence every group), and no wgmma may be issued while a thread's
// landed cp.async copies wait for its fence.proxy.async (wgmma reads through the async proxy).
// Shared memory that threads wrote (plain stores, landed cp.async copies) reaches the async proxy
// (wgmma's operands, a TMA store's box) only through a fence.proxy.async after the writes: in the
// first block of each launch (a kernel's blocks run the same code, and a copy of the block's
// shared memory at each fence costs time), the bytes a wgmma or a TMA store reads must be what
// they were at the block's last fence, TMA copies landing in between aside (they write through
// the async proxy). Fatal otherwise: a write with no fence after it. What this cannot see: whose
// fence it was (the GPU wants the writer's own; here any thread's counts).
void wgmma_fence();
void proxy_async_fence();

// mbarriers (PTX's semantics, one state per barrier of the running block): a phase completes once
// its `count` arrivals are in and exactly the transaction bytes announced (arrive.expect_tx) have
// been issued as TMA copies on it; try_wait(parity) is true once the phase of that parity is over
// (so parity 1 on a fresh barrier). A TMA copy reads its source at the issue, poisons its
// destination (0xFF) and lands as late as PTX lets it: when a thread first sees its phase complete.
// Fatal: a barrier used before its init (or overwritten: its 8 bytes are checked), a TMA copy on a
// barrier whose init no fence.mbarrier_init published, more bytes issued in a phase than announced,
// a copy into memory whose previous copy no thread waited for. A phase that never completes leaves
// its waiters spinning: the block's deadlock check names it.
void mbarrier_init(uint64_t* barrier, uint32_t count);
void fence_mbarrier_init();
void mbarrier_arrive(uint64_t* barrier, uint32_t expect_tx_bytes);
bool mbarrier_try_wait(uint64_t* barrier, uint32_t parity);
// The box at `coordinates` of an emulated tensor map (cuTensorMapEncodeTiled, cuda_runtime.cpp).
void tma_load(void* shared, const void* map, const int* coordinates, int rank, uint64_t* barrier);
// TMA stores (cp.async.bulk.tensor, shared to global) in bulk async-groups: the GPU reads a store's
// box from shared memory (through the map's layout) at some time between the issue and the
// wait_group (.read or not) that retires its group, so the box must not change in between: written
// out as it was at the issue, at that wait, it is fatal if it did (rewritten before the wait: shared
// memory reused too early; or written after the issue, where a barrier is missing before the store
// and the late writers ran before the wait: where they run after it, the rows they had not staged
// come out wrong, as on the GPU). Elements outside the matrix are
// not written. Fatal too: the map checks of tma_load, and a thread that exits with a store not waited
// for (its shared memory goes with the block), and a box with writes no fence.proxy.async
// published (above, at wgmma_fence).
void tma_store(const void* shared, const void* map, const int* coordinates, int rank);
void bulk_commit();
void bulk_wait(int pending_groups_left);
// Fatal unless the running thread has seen complete the phase of the TMA copy (if any) that filled
// the byte at this shared-window address: a wgmma issued by a thread that skipped its wait may read
// the tile before it lands on the GPU, even where another thread's wait landed it here.
void check_tma_visible(uint32_t window_address, const char* reader);
// Named barriers 1-15 as bar.sync / bar.arrive count them (by thread here; the kernels call them by
// whole warps, as the GPU counts). Arrivals left at a block's exit are fatal: PTX does not say what
// becomes of them, and the kernels take every hand-over they give.
void named_barrier(int id, int threads, bool wait);
// setmaxnreg: the calling warp's registers per thread go to `registers`; an increase waits for
// registers that another warp's decrease freed (the block holds 64 K / threads a thread, rounded
// down to a multiple of 8, at most 255, as __launch_bounds__(threads, 1) compiles it, and nothing
// more). A warpgroup's four warps must end with the same count. What this cannot see: whether
// ptxas compiled the kernel with that count (its -v output says), and a copy's visibility per
// thread for plain loads (the first thread to see a phase complete lands its copies for all; a
// wgmma's operands are checked per thread: check_tma_visible).
// The tensor maps' address space is not checked either (a map copied to the stack passes here and
// faults on the GPU): the kernels use their __grid_constant__ parameters only.
void set_max_registers(int registers, bool increase);

// The shared-window address of a byte of dynamic shared memory, as __cvta_generic_to_shared gives
// it, and back. The window's dynamic part starts at kDynamicSharedWindowBase, which is not a
// multiple of 1024, as static shared variables placed before it can make it on the GPU: a kernel
// whose swizzled tiles assume an aligned base computes wrong products here too.
constexpr uint32_t kDynamicSharedWindowBase = 0x610;
uint32_t shared_window_address(const void* p);
// The dynamic shared memory seen through the window: byte i is at address kDynamicSharedWindowBase + i.
// `fenced`: what the async proxy may read, as of the block's last fence.proxy.async (null in blocks
// not checked; see wgmma_fence above).
struct SharedWindow {
  const unsigned char* data;
  uint32_t bytes;
  const unsigned char* fenced;
};
SharedWindow dynamic_shared_window();
// Fatal unless the `bytes` at `byte` of the dynamic shared memory are as fenced (SharedWindow).
[[noreturn]] void unfenced_async_proxy_read(uint32_t byte, const char* reader);
inline void check_async_proxy_read(const SharedWindow& window, uint32_t byte, uint32_t bytes, const char* reader) {
  if (window.fenced && std::memcmp(window.data + byte, window.fenced + byte, bytes) != 0)
    unfenced_async_proxy_read(byte, reader);
}

template <typename T>
T* dynamic_shared() {
  return static_cast<T*>(dynamic_shared_memory());
}

// A static __shared__ variable: `bytes` of the block's static shared memory, the same for every
// thread of the block, placed at the first call of the launch (each declaration has its own
// StaticSharedPlace) and poisoned as each block starts, as the GPU's holds garbage then. The
// static and dynamic shared memory of a block count together against the GPU's limits.
struct StaticSharedPlace {
  uint64_t launch = 0;  // the launch the offset was placed in
  size_t offset = 0;
};
void* static_shared_memory(StaticSharedPlace& place, size_t bytes, size_t alignment);
// `Site` is the declaration's own empty lambda: one place per declaration (and per instance of a
// template kernel, as on the GPU).
template <typename T, typename Site>
T& static_shared(size_t alignment, Site) {
  static thread_local StaticSharedPlace place;  // per host thread: simulated ranks launch concurrently
  return *static_cast<T*>(static_shared_memory(place, sizeof(T), alignment > alignof(T) ? alignment : alignof(T)));
}

// reinterpret_cast<To>(p) for the kernels' casts to pointers (translate.py routes them here): a
// GPU's access of a 4-, 8- or 16-byte vector (a bf16 pair as a word, uint2, Bf16x8, float4) at an
// address that is not a multiple of its alignment faults ("misaligned address"), x86's does not,
// so a cast to such an address stops the program here, naming `type` as written.
[[noreturn]] void misaligned_cast(const char* type, const void* p, size_t alignment);

// Whether the running CUDA thread belongs to a launch with programmatic dependent launch
// (kernels/host/launch.cuh) and has not yet passed its griddepcontrol.wait: the kernel before it
// in the stream may still be writing, so the thread must not touch memory. Set per thread as it is
// resumed (threads.cpp); false between kernels.
extern __thread bool awaiting_previous_kernel;
[[noreturn]] void memory_before_previous_kernel(const char* what);
// Every access the emulator sees (a vector cast, an atomic, a cp.async or TMA copy) asks this first.
inline void check_previous_kernel_awaited(const char* what) {
  if (awaiting_previous_kernel) memory_before_previous_kernel(what);
}

template <typename To, typename From>
To aligned_cast(const char* type, From* p) {
  using Target = std::remove_cv_t<std::remove_pointer_t<To>>;
  if constexpr (std::is_object_v<Target>)
    if (reinterpret_cast<uintptr_t>(p) % alignof(Target)) misaligned_cast(type, p, alignof(Target));
  check_previous_kernel_awaited(type);
  return reinterpret_cast<To>(p);
}

struct LaunchConfig {
  LaunchConfig(dim3 grid, dim3 block, size_t shared_bytes = 0, cudaStream_t stream = nullptr)
      : grid(grid), block(block), shared_bytes(shared_bytes), stream(stream) {}
  dim3 grid, block;
  size_t shared_bytes;
  cudaStream_t stream;
  size_t static_budget = 0;  // the static shared memory the launch allows (set by launchable)
  bool programmatic = false;  // with programmatic dependent launch: each thread must wait before touching memory
};

// Streams. By default the work of every call (a launch, a copy, a library call) runs as the call
// is made. Lazy streams (SPEEDRUN_EMULATOR_STREAMS=lazy in the environment, or set_lazy_streams)
// queue each stream's work in order and run it only when something waits for it: another
// stream's wait for an event recorded on it (cudaStreamWaitEvent runs it up to the record), a
// synchronisation (of the stream, an event, the device), a synchronous copy or set (on the legacy
// default stream, which waits for the blocking streams' earlier work and they for its), cudaFree.
// Work nobody waits for thus runs as late as CUDA allows, so a stream that reads another's results
// without waiting for them reads what was there before (poison, the last step's), and one that
// overwrites what another still has to read, before that read, corrupts it; the default order
// runs every stream's work as early as possible.
bool lazy_streams();
void set_lazy_streams(bool lazy);  // after running every queued item
void enqueue(cudaStream_t stream, std::function<void()> work);
// Lazy streams for the guard's lifetime, then the mode before.
class LazyStreamsScope {
 public:
  LazyStreamsScope() : before_(lazy_streams()) { set_lazy_streams(true); }
  ~LazyStreamsScope() { set_lazy_streams(before_); }
  LazyStreamsScope(const LazyStreamsScope&) = delete;
  LazyStreamsScope& operator=(const LazyStreamsScope&) = delete;

 private:
  bool before_;
};

// The emulated cublasLtMatmul's calls while a MatmulCalls lives (one at a time): each product
// row-major, C[M, N] = op(A)[M, K] op(B)[K, N] as kernels/matmul.cuh's interface names it, and which
// of the heuristic's answers it ran, so that a test sees which algorithm each product took.
struct MatmulCall {
  uint64_t M, N, K;
  bool a_transposed, b_transposed;
  int candidate;
};
class MatmulCalls {
 public:
  MatmulCalls();
  ~MatmulCalls();
  MatmulCalls(const MatmulCalls&) = delete;
  MatmulCalls& operator=(const MatmulCalls&) = delete;
  std::vector<MatmulCall> calls() const;
};
void record_matmul_call(const MatmulCall& call);

[[noreturn]] void fatal_launch_attribute(int id);  // one the emulator does not model
// Records a launch error as cudaGetLastError reports it, for a configuration the GPU refuses;
// otherwise fixes the launch's limits as they are at the call.
bool launchable(const void* kernel, LaunchConfig& config);
// Runs body once per thread of every block.
void run_grid(const void* kernel, const LaunchConfig& config, const std::function<void()>& body);

// `call` invokes the kernel with its arguments (a generic lambda: a kernel template is deduced as
// <<<>>> deduces it); `kernel` is its address, or null for a deduced template. Returns the launch's
// error (also what cudaGetLastError reports next).
template <typename Call, typename... Args>
cudaError_t launch(const LaunchConfig& config, const void* kernel, Call call, Args&&... args) {
  std::tuple<std::decay_t<Args>...> copied(std::forward<Args>(args)...);  // once, as a launch copies them
  LaunchConfig fixed = config;
  if (!launchable(kernel, fixed)) return cudaPeekAtLastError();
  enqueue(fixed.stream, [fixed, kernel, call, copied]() mutable {
    run_grid(kernel, fixed, [&] { std::apply(call, copied); });
  });
  return cudaSuccess;
}

// cudaLaunchKernelEx, which translate.py routes here (kernels/host/launch.cuh's launch_kernel): the
// arguments converted to the kernel's parameter types as CUDA's own template converts them, and the
// one launch attribute the kernels use, programmatic dependent launch, kept for the launch's
// threads (threads.cpp: each must pass griddepcontrol.wait before it touches memory or exits).
template <typename... Params, typename... Args>
cudaError_t launch_kernel_ex(const cudaLaunchConfig_t* config, void (*kernel)(Params...), Args&&... args) {
  LaunchConfig c(config->gridDim, config->blockDim, config->dynamicSmemBytes, config->stream);
  for (unsigned i = 0; i < config->numAttrs; ++i) {
    if (config->attrs[i].id != cudaLaunchAttributeProgrammaticStreamSerialization)
      fatal_launch_attribute(int(config->attrs[i].id));
    c.programmatic = config->attrs[i].val.programmaticStreamSerializationAllowed != 0;
  }
  return [&](Params... converted) {
    return launch(c, reinterpret_cast<const void*>(kernel), [kernel](auto... a) { kernel(a...); }, converted...);
  }(std::forward<Args>(args)...);
}

template <typename T>
T shuffle_xor(T v, int lane_mask) {
  return warp_pick("shfl.xor", v, (position().thread.x % 32) ^ lane_mask);
}

template <typename T>
T shuffle(T v, int src_lane) {
  return warp_pick("shfl.idx", v, src_lane % 32);
}

}  // namespace emu

#define threadIdx (::emu::position().thread)
#define blockIdx (::emu::position().block)
#define blockDim (::emu::position().block_dim)
#define gridDim (::emu::position().grid_dim)

inline void __syncthreads() { ::emu::sync_threads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { ::emu::warp_pick("syncwarp", 0, 0); }
template <typename T>
T __shfl_xor_sync(unsigned, T v, int lane_mask, int = 32) {
  return ::emu::shuffle_xor(v, lane_mask);
}
template <typename T>
T __shfl_sync(unsigned, T v, int src_lane, int = 32) {
  return ::emu::shuffle(v, src_lane);
}
inline int __any_sync(unsigned, int predicate) {  // vote.any over the whole warp
  const int mine = predicate != 0;
  int all[32];
  ::emu::warp_exchange("vote.any", &mine, all, sizeof mine);
  for (int lane : all)
    if (lane) return 1;
  return 0;
}

namespace emu {
// Ends the running block's turn: the other resident blocks may run (those the next turns draw
// first) before its other threads go on.
void end_block_turn();
}
// Atomics but the fused backward's float2 sums (below): the builtins also order kernels of
// concurrent host threads (simulated ranks) that share a counter. Each ends its block's turn, so
// that other blocks may see the counter moved before this block's other warps go on: one moved on
// before the data it releases is written (a barrier missing) shows, by chance (7 launches of 8 in
// test_checks).
template <typename T>
T atomicAdd(T* address, T value) {
  emu::check_previous_kernel_awaited("atomicAdd");
  const T before = __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
  emu::end_block_turn();
  return before;
}

// The fused attention backward's fp32 sums in a fixed order (flash::DqPartialSums): a red of two
// floats, loads and stores that bypass L1, and the counter's fence and polling (a poll that finds
// the turn not come yields to the other resident blocks, __nanosleep). As the
// GPU's atom.add.f32 on global memory (PTX ISA: without .noftz it flushes subnormal inputs and
// results to sign-preserving zero; atomicAdd has no .noftz), the float2 add flushes subnormals.
inline float flush_subnormal(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }
inline float2 atomicAdd(float2* address, float2 value) {
  const float2 before = *address;
  *address = make_float2(flush_subnormal(flush_subnormal(before.x) + flush_subnormal(value.x)),
                         flush_subnormal(flush_subnormal(before.y) + flush_subnormal(value.y)));
  return before;
}
inline float2 __ldcg(const float2* p) { return *p; }
inline void __stcg(float2* p, float2 v) { *p = v; }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
// A thread that sleeps in a spin on global memory: the other resident blocks run (what it waits
// for can only come from one of them).
namespace emu {
void sleep_in_spin();
uint64_t spin_sleeps();  // how many times this host thread's kernels slept in a spin so far
}
inline void __nanosleep(unsigned) { emu::sleep_in_spin(); }
[[noreturn]] inline void __trap() {
  std::fprintf(stderr, "CUDA emulator: a kernel trapped (__trap)\n");
  std::abort();
}

// PRMT: byte i of the result is byte (s >> 4 i) & 7 of the 8 bytes {x (0-3), y (4-7)} (the kernels use
// no sign-replicating selectors: those are refused).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t bytes = uint64_t(y) << 32 | x;
  unsigned out = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned selector = s >> (4 * i) & 0xF;
    if (selector & 8) {
      std::fprintf(stderr, "CUDA emulator: __byte_perm with a sign-replicating selector\n");
      std::abort();
    }
    out |= unsigned(bytes >> (8 * selector) & 0xFF) << (8 * i);
  }
  return out;
}

inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline int __float_as_int(float x) {
  int i;
  std::memcpy(&i, &x, 4);
  return i;
}
inline float __int_as_float(int i) {
  float x;
  std::memcpy(&x, &i, 4);
  return x;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

template <typename... Params>  // cuda_runtime.h declares this overload for nvcc only
cudaError_t cudaFuncSetAttribute(void (*kernel)(Params...), cudaFuncAttribute attribute, int value) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attribute, value);
}
