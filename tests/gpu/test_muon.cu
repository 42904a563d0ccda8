// Muon on the GPU (kernels/muon.cuh) against the CPU reference's muon_update (double) on fresh
// random gradients and momentum: wide, tall and batched matrices (Newton-Schulz batched through
// cuBLASLt's strided batches, as over a shape group; a batch past one launch of the elementwise
// passes), one at 768 x 768; and the Frobenius norms its
// iteration starts from (kernels/device_utils.cuh) against double sums.
// Bounds: the momentum buffer is fp32 arithmetic (1e-5); the parameter change goes through five
// bf16 Newton-Schulz steps (each rounds A, B and X to bf16): 3e-2 on the change; a norm is fp32 sums
// of squares of at most kFrobeniusChunk terms a block (1e-5).
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

// norms of x [batch, n] against double sums of the values the GPU reads; the norms poisoned first.
// `offset` elements into the buffer: 1 makes fp32 rows misaligned for 16-byte loads (the scalar path).
// Each matrix's norm alone (batch 1 at its address) must be bitwise the batch's: the norms do not
// depend on the batch.
template <typename T>
void check_frobenius(int batch, size_t n, size_t offset, uint64_t seed) {
  std::printf("  frobenius %s [%d, %zu] at +%zu\n", sizeof(T) == 2 ? "bf16" : "fp32", batch, n, offset);
  std::vector<double> values = random_normal(offset + batch * n, seed, 3.0);
  std::vector<T> host(values.size());
  for (size_t i = 0; i < values.size(); ++i) host[i] = T(float(values[i]));
  const std::vector<double> seen = to_double(host);
  DeviceBuffer<T> x(host);
  DeviceBuffer<float> partials(batch * frobenius_chunks(n)), norms(batch), alone(1);
  norms.poison();
  frobenius_norms(x.get() + offset, batch, n, partials.get(), norms.get(), 0);
  std::vector<double> ref(batch);
  for (int m = 0; m < batch; ++m) {
    double ss = 0;
    for (size_t i = 0; i < n; ++i) ss += seen[offset + m * n + i] * seen[offset + m * n + i];
    ref[m] = std::sqrt(ss);
  }
  const std::vector<float> batched = norms.download();
  CHECK_REL_ERROR(to_double(batched), ref, 1e-5);
  for (int m = 0; m < batch; ++m) {
    alone.poison();
    frobenius_norms(x.get() + offset + m * n, 1, n, partials.get(), alone.get(), 0);
    CHECK(alone.download()[0] == batched[m]);
  }
}

}  // namespace

TEST_CASE("frobenius norms: chunks summed in a fixed order, the same in any batch; bf16 and fp32") {
  const size_t chunks = 3 * kFrobeniusChunk + 8 * 37;  // three whole chunks and a part
  check_frobenius<bf16>(3, chunks, 0, 11);              // 16-byte loads
  check_frobenius<float>(2, chunks, 0, 12);
  check_frobenius<float>(2, chunks, 1, 13);  // misaligned rows: one element a load
  check_frobenius<bf16>(3, 1001, 0, 14);     // n not a multiple of 8
  check_frobenius<float>(1, 5, 0, 15);       // fewer elements than threads
}

TEST_CASE("muon update: momentum, Nesterov, Newton-Schulz in bf16, shape scale; wide, tall, batched; refused unless a multiple of 8 elements") {
  check_muon(1, 64, 128, 1);    // wide
  check_muon(2, 192, 64, 2);    // tall: iterated as the transpose, lr x sqrt(3)
  check_muon(3, 256, 256, 3);   // batched like qkv_w [3, d, d]
  check_muon(5, 384, 128, 5);   // a batch of tall matrices, like a shape group of c_fc
  check_muon(1, 768, 768, 4);   // a record matrix (the CPU reference's NS5 at 3072 x 768 takes minutes)
  check_muon(kMaxMuonLaunch + 6, 16, 8, 6);  // more than one launch of the elementwise passes holds
  DeviceBuffer<float> p(15), g(15), momentum(15);
  MuonWorkspace ws(15);
  Matmul matmul;
  CHECK_THROWS_WITH(muon_update({{p.get(), g.get(), momentum.get()}}, 3, 5, {0.1f, 0.9f, 1.0f}, ws, matmul, 0),
                    "muon: 3x5 matrices; the iteration takes a multiple of 8 elements");
}

int main(int argc, char** argv) { return run_gpu_checks(argc, argv); }
