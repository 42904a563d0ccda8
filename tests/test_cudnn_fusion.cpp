// tools/cudnn_fusion.h without a GPU: the two fused products' descriptors (tensors, matmul and
// pointwise operations) finalise at the record's shape, and cuDNN refuses a product whose inner
// dimensions differ, so the bench's graphs reach the GPU free of attribute mistakes. What needs a
// device (the operation graph on a handle, where cuDNN checks the shapes between operations, the
// heuristics' engines, a plan, its results against cuBLASLt + the pass) runs in bench_kernels'
// matmul section. Skipped where cuDNN is absent.
#if __has_include(<cudnn_graph.h>)
#include "tools/cudnn_fusion.h"

#include "check.h"

#include <cstdio>

namespace {

using namespace cudnn_fusion;
constexpr int64_t T = 49152, D = 768, F = 3072;

const Library& library() {
  std::string why_not;
  const Library* lib = Library::load(why_not);
  if (!lib) throw std::runtime_error(why_not);
  return *lib;
}

check::Register fc("the fc + relu^2 graph's descriptors finalise at the record's shape", [] {
  Graph g = mlp_fc_relu_squared(library(), T, F, D);
  CHECK(g.operations() == 3);
});

check::Register proj("the proj dx + relu^2 backward graph's descriptors finalise at the record's shape", [] {
  Graph g = mlp_proj_dx_relu_squared_backward(library(), T, F, D);
  CHECK(g.operations() == 4);
});

check::Register mismatch("a product whose inner dimensions differ is refused, naming the operation", [] {
  Graph g(library());
  const Descriptor& x = g.tensor(kInput, T, D, D, 1);
  const Descriptor& w = g.tensor(kWeight, D + 64, F, F, 1);
  const Descriptor& out = g.tensor(kProduct, T, F, F, 1, Storage::virtual_fp32);
  CHECK_THROWS_WITH(g.matmul(x, w, out), "finalize matmul tensor 1 x tensor 2");
});

}  // namespace

int main(int argc, char** argv) {
  std::string why_not;
  if (!Library::load(why_not)) {
    std::printf("cuDNN is not loadable here (%s): skipped\n", why_not.c_str());
    return 77;
  }
  std::printf("cuDNN %zu\n", library().get_version());
  return check::run_checks(std::vector<std::string>(argv + 1, argv + argc));
}
#else
#include <cstdio>
int main() {
  std::printf("cudnn_graph.h is not in the CUDA toolkit here: skipped\n");
  return 77;
}
#endif
