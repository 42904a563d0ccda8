// What the emulator's CUDA threads (threads.cpp) and its runtime API (cuda_runtime.cpp) share.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

namespace emu {

void record_launch_error(cudaError_t error);
size_t max_dynamic_shared_bytes(const void* kernel);  // 48 KiB unless cudaFuncSetAttribute raised it

}  // namespace emu
