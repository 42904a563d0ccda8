// tools/cudnn_fusion.h without a GPU: the two fused products' descriptors (tensors, matmul and
// pointwise operations) and their operation graphs finalise at the record's shape, and cuDNN
// refuses a product whose inner dimensions differ and a graph with a uid twice, so the bench's
// graphs reach the GPU free of attribute and wiring mistakes. What needs a device (the
// heuristics' engines, a plan and its run-time compilation, the results against cuBLASLt + the
// pass) runs in bench_kernels' matmul section. Skipped where cuDNN is absent.
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

// cuDNN 9.19 finalises an operation graph without a handle (its handle attribute is deprecated
// there); older 9.x need a GPU's.
bool graphs_without_handle() { return library().get_version() >= 91900; }

void check_operation_graph(const Graph& g) {
  if (graphs_without_handle())
    g.operation_graph(nullptr);  // throws, naming it, if cuDNN refuses the graph
  else
    std::printf("  cuDNN %zu needs a GPU's handle for the operation graph: left to bench_kernels\n", library().get_version());
}

check::Register fc("the fc + relu^2 graph finalises at the record's shape", [] {
  Graph g = mlp_fc_relu_squared(library(), T, F, D);
  CHECK(g.operations() == 3);
  check_operation_graph(g);
});

check::Register proj("the proj dx + relu^2 backward graph finalises at the record's shape", [] {
  Graph g = mlp_proj_dx_relu_squared_backward(library(), T, F, D);
  CHECK(g.operations() == 4);
  check_operation_graph(g);
});

check::Register duplicate("an operation graph whose two tensors share a uid is refused", [] {
  if (!graphs_without_handle()) return;
  Graph g(library());
  const Descriptor& x = g.tensor(kInput, T, D, D, 1);
  const Descriptor& w = g.tensor(kWeight, D, F, 1, D);
  const Descriptor& product = g.tensor(kProduct, T, F, F, 1, Storage::virtual_fp32);
  const Descriptor& relu = g.tensor(kProduct, T, F, F, 1, Storage::virtual_fp32);  // kRelu's uid mistyped
  const Descriptor& a = g.tensor(kOutput, T, F, F, 1);
  g.matmul(x, w, product);
  g.pointwise(CUDNN_POINTWISE_RELU_FWD, product, relu);
  g.pointwise(CUDNN_POINTWISE_MUL, relu, a, &relu);
  CHECK_THROWS_WITH(g.operation_graph(nullptr), "finalize operation graph");
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
