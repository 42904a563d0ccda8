// NCCL for one rank in one process: every collective is a copy (the sum over one rank), and sends
// to oneself are matched with receives from oneself when their group ends, as NCCL requires them
// to be grouped. More ranks are refused: simulated ranks (kernels/device_comm.cuh) cover W > 1.
#include "emulator/cuda_emulator.h"

#include <nccl.h>

#include <cstring>
#include <vector>

namespace {

size_t type_bytes(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
  }
}

struct Transfer {
  void* buffer;
  size_t bytes;
  cudaStream_t stream;
};
thread_local int group_depth = 0;
thread_local std::vector<Transfer> sends, receives;  // of the open group, in call order

ncclResult_t copy(const void* from, void* to, size_t count, ncclDataType_t type, ncclComm_t comm, cudaStream_t stream) {
  if (!comm) return ncclInvalidArgument;
  const size_t bytes = count * type_bytes(type);
  if (from != to) emu::enqueue(stream, [=] { std::memmove(to, from, bytes); });
  return ncclSuccess;
}

}  // namespace

ncclResult_t ncclGetVersion(int* version) {
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}
const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage (the emulated NCCL has one rank)";
    default: return "emulated NCCL error";
  }
}
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id, 0, sizeof *id);
  return ncclSuccess;
}
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int ranks, ncclUniqueId, int rank) {
  if (ranks != 1 || rank != 0) return ncclInvalidUsage;
  *comm = reinterpret_cast<ncclComm_t>(new char);
  return ncclSuccess;
}
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete reinterpret_cast<char*>(comm);
  return ncclSuccess;
}
ncclResult_t ncclCommAbort(ncclComm_t comm) { return ncclCommDestroy(comm); }
// One rank: every split is that rank alone (a color of NCCL_SPLIT_NOCOLOR gives no communicator).
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int, ncclComm_t* part, ncclConfig_t*) {
  if (!comm) return ncclInvalidArgument;
  *part = color == NCCL_SPLIT_NOCOLOR ? nullptr : reinterpret_cast<ncclComm_t>(new char);
  return ncclSuccess;
}
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (!comm) return ncclInvalidArgument;
  *rank = 0;
  return ncclSuccess;
}
ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (!comm) return ncclInvalidArgument;
  *count = 1;
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t, ncclComm_t comm,
                           cudaStream_t stream) {
  return copy(send, recv, count, type, comm, stream);
}
ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t,
                               ncclComm_t comm, cudaStream_t stream) {
  return copy(send, recv, count, type, comm, stream);
}
ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t stream) {
  return copy(send, recv, count, type, comm, stream);
}

ncclResult_t ncclGroupStart() {
  ++group_depth;
  return ncclSuccess;
}
ncclResult_t ncclGroupEnd() {
  if (group_depth == 0) return ncclInvalidUsage;
  if (--group_depth > 0) return ncclSuccess;
  ncclResult_t result = sends.size() == receives.size() ? ncclSuccess : ncclInvalidUsage;
  for (size_t i = 0; result == ncclSuccess && i < sends.size(); ++i) {
    // (a send and its receive on two streams would order the copy after both: not emulated)
    if (sends[i].bytes != receives[i].bytes || sends[i].stream != receives[i].stream) result = ncclInvalidUsage;
    else
      emu::enqueue(receives[i].stream, [from = sends[i].buffer, to = receives[i].buffer, bytes = sends[i].bytes] {
        std::memmove(to, from, bytes);
      });
  }
  sends.clear();
  receives.clear();
  return result;
}
ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  if (!comm || peer != 0) return ncclInvalidArgument;
  if (group_depth == 0) return ncclInvalidUsage;  // a lone send to oneself would never complete
  sends.push_back({const_cast<void*>(send), count * type_bytes(type), stream});
  return ncclSuccess;
}
ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  if (!comm || peer != 0) return ncclInvalidArgument;
  if (group_depth == 0) return ncclInvalidUsage;
  receives.push_back({recv, count * type_bytes(type), stream});
  return ncclSuccess;
}
