// How every kernel of kernels/ is launched: launch_kernel, so that one switch (--launch-overlap pdl)
// launches them all with programmatic dependent launch (PDL, Hopper's griddepcontrol).
//
// Why: a step runs about 5,000 kernels back to back in one stream, and between two of them the GPU
// idled 1.6 us on average (8.2 ms of the H200's 744 ms M = 8 step, docs/PERF.md 2026-11-27): the
// next kernel is launched only once the previous has completed. With PDL the next kernel is
// launched while the previous one's last blocks still run, and waits inside (griddepcontrol.wait,
// the first statement of every kernel: await_previous_kernel in kernels/device_utils.cuh) only for
// the previous kernel's completion and memory flush. Without the attribute the wait is a no-op, so
// the kernels are the same code either way.
//
// The rule that keeps it correct: every kernel launched so waits before it touches memory. A
// kernel that did not wait could read its predecessor's output before it is written, and a kernel
// that never waited would let its successor overlap its predecessor (the ordering is only as
// transitive as the waits). tests/test_kernel_entry.py checks that every __global__ function in
// kernels/ begins with the wait; the CPU emulator stops a thread of a PDL launch that accesses
// memory it sees (a vector cast, an atomic, a cp.async or TMA copy) before its wait, or exits
// without one (tests/emulator/test_checks.cu).
// cuBLASLt's, NCCL's and the copies' work on the stream is ordered as always (the attribute only
// relaxes the order between a kernel and the kernel launched right before it in its stream).
#pragma once
#include "kernels/host/cuda_check.cuh"

#include <cuda_runtime.h>

#include <utility>

// Off by default: opt-in (--launch-overlap pdl) until measured on a GPU. Set once at start-up,
// before any launch.
inline bool programmatic_dependent_launch = false;

// kernel<<<grid, block, shared_bytes, stream>>>(args...), with the launch attribute of programmatic
// dependent launch when it is switched on. Returns the launch's error (a configuration the GPU
// refuses), which callers check with CUDA_CHECK so that a failure names their line. The arguments
// convert to the kernel's parameter types as with <<<>>>; a kernel template is named with its
// template arguments.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                          Args&&... args) {
  cudaLaunchAttribute overlap{};
  overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap.val.programmaticStreamSerializationAllowed = 1;
  // gridDim, blockDim, dynamicSmemBytes, stream, attrs, numAttrs
  cudaLaunchConfig_t config{grid, block, shared_bytes, stream, &overlap, programmatic_dependent_launch ? 1u : 0u};
  const cudaError_t error = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  // Reported here, so not again to the next cudaGetLastError (which <<<>>>'s check used to clear).
  if (error != cudaSuccess) cudaGetLastError();
  return error;
}
