// Muon on the GPU (kernels/muon.cuh) against the CPU reference's muon_update (double) on fresh
// random gradients and momentum: wide, tall and batched matrices (Newton-Schulz batched through
// cuBLASLt's strided batches, as over a shape group), one at 768 x 768.
// Bounds: the momentum buffer is fp32 arithmetic (1e-5); the parameter change goes through five
// bf16 Newton-Schulz steps (each rounds A, B and X to bf16): 3e-2 on the change.
#include "gpu/gpu_test.h"
#include "kernels/muon.cuh"
#include "reference/optim.h"

namespace {

void check_muon(int batch, int rows, int cols, uint64_t seed) {
  std::printf("  muon [%d, %d, %d]\n", batch, rows, cols);
  const size_t n = size_t(batch) * rows * cols;
  const float lr = 0.05f, momentum = 0.9f, grad_scale = 0.125f;
  std::vector<double> p = random_normal(n, seed, 0.02), g = random_normal(n, seed + 1, 8.0);
  std::vector<double> buf = random_normal(n, seed + 2, 0.5);
  std::vector<float> pf(p.begin(), p.end()), gf(g.begin(), g.end()), bf(buf.begin(), buf.end());
  DeviceBuffer<float> dp(pf), dg(gf), dbuf(bf);
  Matmul matmul;
  MuonWorkspace ws(n, batch);
  // In reverse storage order: each matrix is used at its own addresses, whatever its batch slot.
  std::vector<MuonMatrix> matrices;
  for (int i = batch - 1; i >= 0; --i) {
    const size_t at = size_t(i) * rows * cols;
    matrices.push_back({dp.get() + at, dg.get() + at, dbuf.get() + at});
  }
  muon_update(matrices, rows, cols, {lr, momentum, grad_scale}, ws, matmul, 0);

  std::vector<double> p_ref(pf.begin(), pf.end()), buf_ref(bf.begin(), bf.end()), g_ref(n);
  for (size_t i = 0; i < n; ++i) g_ref[i] = double(gf[i]) * grad_scale;
  muon_update(p_ref.data(), g_ref.data(), buf_ref.data(), {batch, rows, cols}, lr, momentum, MuonConfig{});
  std::vector<double> p_gpu = to_double(dp.download()), buf_gpu = to_double(dbuf.download());
  std::vector<double> change(n), change_ref(n);
  for (size_t i = 0; i < n; ++i) change[i] = p_gpu[i] - pf[i], change_ref[i] = p_ref[i] - pf[i];
  CHECK_REL_ERROR(buf_gpu, buf_ref, 1e-5);
  CHECK_REL_ERROR(change, change_ref, 3e-2);
}

}  // namespace

TEST_CASE("muon update: momentum, Nesterov, Newton-Schulz in bf16, shape scale; wide, tall, batched") {
  check_muon(1, 64, 128, 1);    // wide
  check_muon(2, 192, 64, 2);    // tall: iterated as the transpose, lr x sqrt(3)
  check_muon(3, 256, 256, 3);   // batched like qkv_w [3, d, d]
  check_muon(5, 384, 128, 5);   // a batch of tall matrices, like a shape group of c_fc
  check_muon(1, 768, 768, 4);   // a record matrix (the CPU reference's NS5 at 3072 x 768 takes minutes)
}

int main(int argc, char** argv) { return run_gpu_checks(argc, argv); }
