// Attention against the CPU reference (the block lists themselves: tests/test_attention_mask.cu):
// the flash kernels' wgmma products alone, then forward (y) and backward (dq, dk, dv) of the
// implementations (the warp-per-row baseline, the tensor-core flash kernels with the fused backward,
// with the two-kernel one, and with the warp-specialised TMA forward) on random layouts for every
// window size 1..14, long and short (W/2); the fused backward bitwise the same on later runs (on a
// GPU 12, half of them with half the SMs held), the warp-specialised forward bitwise the same as the
// other; the fused backward into dqkv (through the QK norm, RoPE and the value mix) against the
// backward and the passes.
#include "gpu/gpu_test.h"
#include "kernels/attention.cuh"
#include "kernels/flash_attention.cuh"
#include "kernels/residual.cuh"
#include "kernels/rope.cuh"
#include "reference/model.h"
#include "reference/synthetic.h"

#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>

namespace {

constexpr double kBf16Bound = 5e-3;
constexpr int D = kAttentionHeadDim;
constexpr uint16_t kBos = 50256;

// Tokens with documents of random lengths (BOS at rate 1/mean_doc), the first token a BOS.
std::vector<uint16_t> layout(int T, double mean_doc, uint64_t seed) {
  std::vector<uint16_t> tokens = synthetic_tokens(T, 50257, kBos, 1.0 / mean_doc, seed);
  tokens[0] = kBos;
  return tokens;
}

// Reference attention for one head-interleaved [T, H, 128] problem: y, dq, dk, dv, and the norms
// dq and dk are measured against: their own, or with a peaked softmax the uncancelled gradients'
// (both implementations take the row term from the bf16 output, as FlashAttention does, so where
// dq and dk nearly cancel, that rounding is as large as they are).
struct Reference {
  std::vector<double> y, dq, dk, dv;
  double dq_scale, dk_scale;
};

double norm(const std::vector<double>& x) {
  double ss = 0;
  for (double e : x) ss += e * e;
  return std::sqrt(ss);
}

Reference reference(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                    const std::vector<double>& dy, const std::vector<char>& allowed, int T, int H, bool peaked) {
  Reference r;
  std::vector<double> probs, dq_uncancelled, dk_uncancelled, unused;
  ref::AttentionShape shape{T, H, D, kAttentionScale};
  ref::attention_forward(shape, allowed, q, k, v, probs, r.y);
  ref::attention_backward(shape, q, k, v, probs, dy, r.dq, r.dk, r.dv);
  r.dq_scale = norm(r.dq), r.dk_scale = norm(r.dk);
  if (peaked) {
    ref::attention_backward(shape, q, k, v, probs, dy, dq_uncancelled, dk_uncancelled, unused, false);
    r.dq_scale = norm(dq_uncancelled), r.dk_scale = norm(dk_uncancelled);
  }
  return r;
}

// ||got - want|| / scale
double error_on_scale(const std::vector<double>& got, const std::vector<double>& want, double scale) {
  std::vector<double> difference(got.size());
  for (size_t i = 0; i < got.size(); ++i) difference[i] = got[i] - want[i];
  return norm(difference) / scale;
}

// The attention mask of a token layout (documents from its BOS tokens) and window, with the
// staged uploads that hold its device copy.
struct LayoutMask {
  std::vector<int32_t> docs;
  StagedUploads uploads;
  std::unique_ptr<AttentionMask> mask;
  LayoutMask(const std::vector<uint16_t>& tokens, int window)
      : docs(attention_document_ids(tokens.data(), int(tokens.size()), kBos)) {
    AttentionBlockLists lists = build_attention_blocks(docs, window);
    uploads.reset(AttentionMask::upload_bytes(docs, lists));
    mask = std::make_unique<AttentionMask>(docs, lists, uploads, cudaStream_t{});
  }
};

enum class Implementation { baseline, flash, flash_split, flash_ws };
const char* name_of(Implementation impl) {
  return impl == Implementation::baseline ? "baseline"
         : impl == Implementation::flash  ? "flash"
         : impl == Implementation::flash_split ? "split"
                                               : "ws";
}

// Inputs: Gaussian q and k (std 0.6: scores of std ~0.5), or as the model makes them, each head's
// q and k RMS-normalised, k close to q of the same token: scores up to 0.12 * 128 = 15 on the
// diagonal against ~1.4 elsewhere, so the softmax is peaked, where bf16 rounding of P and of y
// weighs most (dq and dk then measured on the uncancelled scale, see Reference).
enum class Scores { gaussian, qk_normed };

void rms_normalise_heads(std::vector<double>& x) {
  for (size_t row = 0; row < x.size(); row += D) {
    double ss = 0;
    for (int i = 0; i < D; ++i) ss += x[row + i] * x[row + i];
    const double inv = 1 / std::sqrt(ss / D);
    for (int i = 0; i < D; ++i) x[row + i] *= inv;
  }
}

// The reference of one input (tokens, window, seed, heads, scores), computed once: every
// implementation checked on that input is checked against the same one. On a GPU the fp64
// reference is most of this test's time (about 0.3-1 s a window on one core), and the four
// implementations each run every window's same inputs; the references kept take about 0.6 GB there.
const Reference& reference_of(const std::vector<uint16_t>& tokens, int window, uint64_t seed, int H, Scores scores,
                              const std::function<Reference()>& compute) {
  using Input = std::tuple<std::vector<uint16_t>, int, uint64_t, int, Scores>;
  static std::map<Input, Reference> computed;
  Input input{tokens, window, seed, H, scores};
  auto found = computed.find(input);
  if (found == computed.end()) found = computed.emplace(std::move(input), compute()).first;
  return found->second;
}

void check_attention(const std::vector<uint16_t>& tokens, int window, uint64_t seed, bool verbose,
                     Implementation impl, int H, Scores scores) {
  const int T = int(tokens.size());
  const LayoutMask layout_mask(tokens, window);
  const AttentionMask& mask = *layout_mask.mask;
  const std::vector<int32_t>& docs = layout_mask.docs;
  std::vector<double> q = random_normal(size_t(T) * H * D, seed, 0.6), k = random_normal(q.size(), seed + 1, 0.6);
  if (scores == Scores::qk_normed) {
    for (size_t i = 0; i < q.size(); ++i) k[i] = q[i] + 0.3 * k[i];
    rms_normalise_heads(q);
    rms_normalise_heads(k);
  }
  q = rounded_to_bf16(q);
  k = rounded_to_bf16(k);
  std::vector<double> v = rounded_to_bf16(random_normal(q.size(), seed + 2));
  std::vector<double> dy = rounded_to_bf16(random_normal(q.size(), seed + 3));
  DeviceBuffer<bf16> dq_in(to_bf16(q)), dk_in(to_bf16(k)), dv_in(to_bf16(v)), ddy(to_bf16(dy));
  DeviceBuffer<bf16> y(q.size()), dq(q.size()), dk(q.size()), dv(q.size());
  DeviceBuffer<float> lse(size_t(T) * H), scratch(attention_backward_scratch_floats(T, H));
  for (auto* b : {&y, &dq, &dk, &dv}) b->poison();
  scratch.poison();
  AttentionTensors a{T, H, H * D, H * D, H * D};
  auto forward = impl == Implementation::baseline   ? attention_forward
                 : impl == Implementation::flash_ws ? flash_attention_forward_ws
                                                    : flash_attention_forward;
  auto backward = impl == Implementation::baseline      ? attention_backward
                  : impl == Implementation::flash_split ? flash_attention_backward_split
                                                        : flash_attention_backward;
  forward(dq_in.get(), dk_in.get(), dv_in.get(), y.get(), lse.get(), a, mask, 0);
  backward(dq_in.get(), dk_in.get(), dv_in.get(), y.get(), ddy.get(), lse.get(), scratch.get(), dq.get(), dk.get(),
           dv.get(), a, mask, 0);
  const Reference& r = reference_of(tokens, window, seed, H, scores, [&] {
    const std::vector<int> ref_docs(docs.begin(), docs.end());
    return reference(q, k, v, dy, attention_allowed(ref_docs, kAttentionBlock, window), T, H,
                     scores == Scores::qk_normed);
  });
  double errors[4] = {relative_error(to_double(y.download()), r.y),
                      error_on_scale(to_double(dq.download()), r.dq, r.dq_scale),
                      error_on_scale(to_double(dk.download()), r.dk, r.dk_scale),
                      relative_error(to_double(dv.download()), r.dv)};
  if (verbose)
    std::printf("  %-8s T %5d H %d window %2d%s: y %.2e dq %.2e dk %.2e dv %.2e\n", name_of(impl), T, H, window,
                scores == Scores::qk_normed ? " qk-normed" : "", errors[0], errors[1], errors[2], errors[3]);
  for (double e : errors) CHECK(e <= kBf16Bound);
}

// The CI-sized emulation (tests/emulator) checks the baseline only on the windows: each of its
// scores is a warp-wide sum, the slowest thing to emulate.
void check_both(const std::vector<uint16_t>& tokens, int window, uint64_t seed, bool verbose, int H = 2,
                Scores scores = Scores::gaussian, bool baseline = true) {
  if (baseline) check_attention(tokens, window, seed, verbose, Implementation::baseline, H, scores);
  check_attention(tokens, window, seed, verbose, Implementation::flash, H, scores);
}

// Every window on a GPU; on the CI-sized emulation the smallest, the largest and two between
// (the baseline, whose scores each cost a warp-wide sum, stops below the whole sequence).
std::vector<int> windows_to_check(Implementation impl) {
  if (testing_a_subset()) {
    if (impl == Implementation::flash) return {1, 2, 7, 14};
    if (impl == Implementation::flash_ws) return {2, 14};
    return impl == Implementation::flash_split ? std::vector<int>{3, 14} : std::vector<int>{1, 3};
  }
  std::vector<int> all;
  for (int window = 1; window <= 14; ++window) all.push_back(window);
  return all;
}

// The flash kernels' two kinds of product alone, on one CTA: S = A B^T (wgmma, both tiles from
// shared memory) and O = bf16(S) V (P from registers, V read N-major), the tiles loaded and aligned
// as the kernels load them. Where the layouts, swizzle or descriptors are wrong, this says so
// directly.
__global__ void wgmma_products_kernel(const bf16* a, const bf16* b, const bf16* v, float* s_out, float* o_out,
                                      float* s_half_out) {
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* tiles = flash::align_to_swizzle_atom(shared_tiles);
  for (int t = 0; t < 3; ++t) flash::load_tile_async(tiles + t * flash::kTileElements, (t == 0 ? a : t == 1 ? b : v), D);
  ptx::cp_async_commit();
  flash::wait_tiles();
  const int warp = threadIdx.x / 32;
  float s[flash::kTile / 8][4], o[D / 8][4];
  flash::wgmma_a_bt<flash::kTile>(s, tiles, warp / 4 * 64, tiles + flash::kTileElements, 0);
  flash::wgmma_wait_all(s);
  flash::zero(o);
  flash::wgmma_p_b<flash::kTile / 16>(o, s, tiles + 2 * flash::kTileElements, 0);
  float s_half[flash::kTile / 16][4];  // the 64-column form the backward uses: B's rows 64..127
  flash::wgmma_a_bt<flash::kTile / 2>(s_half, tiles, warp / 4 * 64, tiles + flash::kTileElements, 64);
  flash::wgmma_wait_all(o, s_half);
  for (int n = 0; n < D / 8; ++n)
    for (int e = 0; e < 4; ++e) {
      const int row = warp * 16 + flash::fragment_row(e), at = row * D + flash::fragment_col(n, e);
      s_out[at] = s[n][e];
      o_out[at] = o[n][e];
      if (n < flash::kTile / 16) s_half_out[row * 64 + flash::fragment_col(n, e)] = s_half[n][e];
    }
}

// The fused backward's dS tile written as it writes it: each warp's 16 keys x 64 queries of dS^T as
// A fragments (pack_a_fragments), transposed into the [64 queries][128 keys] tile by stmatrix
// (store_ds_transposed), read back element by element. Values are small integers (exact in bf16),
// so every element must land exactly where swizzled<64>(query, key) says.
__host__ __device__ float ds_test_value(int query, int key) { return float((query * 131 + key * 7) % 255 - 127); }

__global__ void store_ds_transposed_kernel(float* out) {
  extern __shared__ __align__(128) bf16 shared_tiles[];
  bf16* ds_tile = flash::align_to_swizzle_atom(shared_tiles);
  const int warp = threadIdx.x / 32;
  float dst[flash::kDsRows / 8][4];  // [16 keys of this warp][64 queries]
  for (int n = 0; n < flash::kDsRows / 8; ++n)
    for (int e = 0; e < 4; ++e) dst[n][e] = ds_test_value(flash::fragment_col(n, e), warp * 16 + flash::fragment_row(e));
  uint32_t ds[flash::kDsRows / 16][4];
  flash::pack_a_fragments(ds, dst);
  flash::store_ds_transposed(ds_tile, ds, warp);
  __syncthreads();
  for (int i = threadIdx.x; i < flash::kDsRows * flash::kTile; i += blockDim.x)
    out[i] = __bfloat162float(ds_tile[wgmma_tiles::swizzled<flash::kDsRows>(i / flash::kTile, i % flash::kTile)]);
}

}  // namespace

TEST_CASE("the fused backward's dS tile: stmatrix's transposed stores put every element where the tile's layout says") {
  constexpr int queries = flash::kDsRows, keys = flash::kTile;
  DeviceBuffer<float> out(queries * keys);
  out.poison();
  const size_t smem = queries * keys * sizeof(bf16) + flash::kSwizzleAtomBytes;
  flash::set_shared_memory(store_ds_transposed_kernel, smem);
  store_ds_transposed_kernel<<<1, flash::kThreads, smem>>>(out.get());
  CUDA_CHECK_LAUNCH();
  const std::vector<float> got = out.download();
  int wrong = 0;
  for (int q = 0; q < queries; ++q)
    for (int k = 0; k < keys; ++k)
      if (got[q * keys + k] != ds_test_value(q, k) && wrong++ < 5)
        std::printf("dS tile (query %d, key %d): %g, want %g\n", q, k, got[q * keys + k], ds_test_value(q, k));
  CHECK(wrong == 0);
}

TEST_CASE("the flash kernels' wgmma products of swizzled tiles: S = A B^T (128 and 64 columns), O = bf16(S) V") {
  constexpr int n = flash::kTile;
  const std::vector<double> a = rounded_to_bf16(random_normal(n * D, 1)), b = rounded_to_bf16(random_normal(n * D, 2)),
                            v = rounded_to_bf16(random_normal(n * D, 3));
  DeviceBuffer<bf16> a_dev(to_bf16(a)), b_dev(to_bf16(b)), v_dev(to_bf16(v));
  DeviceBuffer<float> s_dev(n * n), o_dev(n * D), s_half_dev(n * n / 2);
  s_dev.poison();
  o_dev.poison();
  s_half_dev.poison();
  const size_t smem = 3 * flash::kTileElements * sizeof(bf16) + flash::kSwizzleAtomBytes;
  flash::set_shared_memory(wgmma_products_kernel, smem);
  wgmma_products_kernel<<<1, flash::kThreads, smem>>>(a_dev.get(), b_dev.get(), v_dev.get(), s_dev.get(), o_dev.get(),
                                                       s_half_dev.get());
  CUDA_CHECK_LAUNCH();
  const std::vector<double> s = to_double(s_dev.download()), o = to_double(o_dev.download()),
                            s_half = to_double(s_half_dev.download());
  std::vector<double> s_ref(n * n, 0.0), o_ref(n * D, 0.0), s_half_ref(n * n / 2);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      for (int d = 0; d < D; ++d) s_ref[i * n + j] += a[i * D + d] * b[j * D + d];
      if (j >= n / 2) s_half_ref[i * n / 2 + j - n / 2] = s_ref[i * n + j];
    }
  const std::vector<double> p = rounded_to_bf16(s);  // the GPU's own scores, rounded as it rounds them
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j)
      for (int c = 0; c < D; ++c) o_ref[i * D + c] += p[i * n + j] * v[j * D + c];
  CHECK_REL_ERROR(s, s_ref, 1e-5);
  CHECK_REL_ERROR(o, o_ref, 1e-5);
  CHECK_REL_ERROR(s_half, s_half_ref, 1e-5);
}

// One implementation on random layouts for each window, long and short (W / 2, 0 when W = 1).
void check_windows(Implementation impl) {
  for (int window : windows_to_check(impl)) {
    std::vector<uint16_t> tokens = layout(128 * 12, 90.0 + 30.0 * window, 100 + window);
    check_attention(tokens, window, 200 + window, true, impl, 2, Scores::gaussian);
    check_attention(tokens, window / 2, 300 + window, false, impl, 2, Scores::gaussian);
  }
}

TEST_CASE("flash: forward and backward match the reference for windows 1..14, long and short") {
  check_windows(Implementation::flash);
}

TEST_CASE("flash with the two-kernel backward (--attention flash-split): the same") {
  check_windows(Implementation::flash_split);
}

TEST_CASE("flash with the warp-specialised forward (--attention flash-ws): the same") {
  check_windows(Implementation::flash_ws);
}

TEST_CASE("baseline: forward and backward match the reference for windows 1..14, long and short") {
  check_windows(Implementation::baseline);
}

TEST_CASE("single document, documents on block boundaries, a 16-block sequence, the record's 6 heads, "
          "peaked softmax of QK-normed scores") {
  const bool baseline = !testing_a_subset();
  std::vector<uint16_t> one_doc(128 * 8, 17);
  one_doc[0] = kBos;
  check_both(one_doc, 14, 400, true, 2, Scores::gaussian, baseline);
  std::vector<uint16_t> aligned(128 * 8, 17);
  for (int b = 0; b < 8; b += 3) aligned[b * 128] = kBos;
  check_both(aligned, 4, 401, true, 2, Scores::gaussian, baseline);
  check_both(layout(128 * 16, 300.0, 402), 14, 403, true, 2, Scores::gaussian, baseline);
  // rows of 768: the trainer's strides
  check_both(layout(128 * 10, 200.0, 404), 7, 405, true, 6, Scores::gaussian, baseline);
  for (int window : {1, 6, 14})
    check_both(layout(128 * 14, 400.0, 406 + window), window, 420 + window, true, 6, Scores::qk_normed, baseline);
}

// Each tensor the flash kernels copy 16 bytes at a time (cp.async) or store a bf16 pair at a time,
// one element off its allocation's start: refused before any launch, by name (a GPU would stop
// at the kernel with "misaligned address", the emulator too).
TEST_CASE("flash attention refuses each tensor one element off its alignment, naming it") {
  const int T = 2 * kAttentionBlock, H = 1;
  const std::vector<uint16_t> tokens = layout(T, 100.0, 500);
  const LayoutMask layout_mask(tokens, 2);
  const AttentionMask& mask = *layout_mask.mask;
  const size_t n = size_t(T) * H * D + 1, statistics = size_t(T) * H + 1;  // room for one element off
  DeviceBuffer<bf16> q(n), k(n), v(n), y(n), dy(n), dq(n), dk(n), dv(n);
  DeviceBuffer<float> lse(statistics), scratch(attention_backward_scratch_floats(T, H) + 1);
  const AttentionTensors a{T, H, H * D, H * D, H * D};
  // `buffer` one element past its start if it is the one named `off`.
  auto at = [](auto& buffer, const char* name, const char* off) { return buffer.get() + (std::strcmp(name, off) == 0); };
  for (auto forward : {flash_attention_forward, flash_attention_forward_ws})
    for (const char* off : {"q", "k", "v", "y"}) {
      const std::string refusal = std::string("flash attention: ") + off + " must start";
      CHECK_THROWS_WITH(forward(at(q, "q", off), at(k, "k", off), at(v, "v", off), at(y, "y", off), lse.get(), a, mask, 0),
                        refusal.c_str());
    }
  for (auto backward : {flash_attention_backward, flash_attention_backward_split})
    for (const char* off : {"q", "k", "v", "y", "dy", "lse", "scratch", "dq", "dk", "dv"}) {
      const std::string refusal = std::string("flash attention: ") + off + " must start";
      CHECK_THROWS_WITH(backward(at(q, "q", off), at(k, "k", off), at(v, "v", off), at(y, "y", off), at(dy, "dy", off),
                                 at(lse, "lse", off), at(scratch, "scratch", off), at(dq, "dq", off), at(dk, "dk", off),
                                 at(dv, "dv", off), a, mask, 0),
                        refusal.c_str());
    }
  for (const char* off : {"y", "dy"}) {  // the reference backward's delta reads them 8 bytes at a time
    const std::string refusal = std::string("attention backward: ") + off + " must start 8-byte aligned";
    CHECK_THROWS_WITH(attention_backward(q.get(), k.get(), v.get(), at(y, "y", off), at(dy, "dy", off), lse.get(),
                                         scratch.get(), dq.get(), dk.get(), dv.get(), a, mask, 0),
                      refusal.c_str());
  }
}

#ifndef SPEEDRUN_EMULATED
// Holds an SM a CTA for about `cycles` clocks, with shared memory enough that no fused-backward CTA
// fits beside it: the persistent backward launched next on another stream starts on the other SMs,
// and its remaining CTAs only as these end (a grid not all resident at once, as beside NCCL's
// kernels or under MPS).
__global__ void hold_multiprocessors(long long cycles) {
  extern __shared__ volatile char held[];
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
  if (threadIdx.x == 0) held[0] = 1;
}
#endif

// The fused backward sums dq's contributions across CTAs in a fixed order (DqPartialSums): runs on
// the same inputs give the same bits, at the record's window (up to 14 contributors a block) and
// 6 heads; dk and dv too. On a GPU the CTAs' timing differs between the runs: 12 runs, every other
// one with half the SMs held by another kernel while its CTAs start (their dq turns then wait on
// CTAs not yet started); the emulator runs two, its CTAs side by side in another order each launch.
TEST_CASE("the fused backward's dq, dk and dv are bitwise the same on later runs (window 14)") {
  const int T = 128 * (testing_a_subset() ? 16 : 64), H = 6;
  const std::vector<uint16_t> tokens = layout(T, 600.0, 700);
  const LayoutMask layout_mask(tokens, 14);
  const AttentionMask& mask = *layout_mask.mask;
  const size_t n = size_t(T) * H * D;
  DeviceBuffer<bf16> q(to_bf16(random_normal(n, 701, 0.6))), k(to_bf16(random_normal(n, 702, 0.6))),
      v(to_bf16(random_normal(n, 703))), dy(to_bf16(random_normal(n, 704))), y(n);
  DeviceBuffer<float> lse(size_t(T) * H), scratch(attention_backward_scratch_floats(T, H));
  const AttentionTensors a{T, H, H * D, H * D, H * D};
  flash_attention_forward(q.get(), k.get(), v.get(), y.get(), lse.get(), a, mask, 0);
  const int runs = kEmulated ? 2 : 12;
  std::vector<bf16> first[3];
  int different[3] = {0, 0, 0};
#ifndef SPEEDRUN_EMULATED
  cudaStream_t backward_stream, holder_stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&backward_stream, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamCreateWithFlags(&holder_stream, cudaStreamNonBlocking));
  int shared_optin = 0, clock_khz = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&shared_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const int held_bytes = shared_optin - 1024;
  CUDA_CHECK(cudaFuncSetAttribute(hold_multiprocessors, cudaFuncAttributeMaxDynamicSharedMemorySize, held_bytes));
#else
  cudaStream_t backward_stream = 0;
#endif
  for (int r = 0; r < runs; ++r) {
    DeviceBuffer<bf16> dq(n), dk(n), dv(n);
    for (auto* b : {&dq, &dk, &dv}) b->poison();
    scratch.poison();
    CUDA_CHECK(cudaDeviceSynchronize());
#ifdef SPEEDRUN_EMULATED
    const uint64_t sleeps = emu::spin_sleeps();
#else
    if (r % 2 == 1) {  // half the SMs held for about 2 ms from just before the backward's launch
      hold_multiprocessors<<<multiprocessor_count() / 2, 32, held_bytes, holder_stream>>>(2LL * clock_khz);
      CUDA_CHECK(cudaGetLastError());
    }
#endif
    flash_attention_backward(q.get(), k.get(), v.get(), y.get(), dy.get(), lse.get(), scratch.get(), dq.get(), dk.get(),
                             dv.get(), a, mask, backward_stream);
    CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<bf16> run[3] = {dq.download(), dk.download(), dv.download()};
    for (int i = 0; i < 3; ++i) {
      if (r == 0) first[i] = run[i];
      else different[i] += std::memcmp(first[i].data(), run[i].data(), n * sizeof(bf16)) != 0;
    }
#ifdef SPEEDRUN_EMULATED
    // The emulator runs the CTAs side by side, in another order each launch: the dq order's waits
    // between them happen here as on the GPU (and so the runs' sums met in different timings).
    std::printf("  CTAs slept waiting for their dq turn %llu times\n",
                static_cast<unsigned long long>(emu::spin_sleeps() - sleeps));
    CHECK(emu::spin_sleeps() > sleeps);
#endif
  }
#ifndef SPEEDRUN_EMULATED
  CUDA_CHECK(cudaStreamDestroy(backward_stream));
  CUDA_CHECK(cudaStreamDestroy(holder_stream));
#endif
  const char* names[3] = {"dq", "dk", "dv"};
  for (int i = 0; i < 3; ++i) {
    std::printf("  %s of %d runs: %s\n", names[i], runs,
                different[i] ? (std::to_string(different[i]) + " DIFFERENT from the first").c_str()
                             : "bitwise the same");
    CHECK(different[i] == 0);
  }
}

// The fused backward into dqkv (--qkv-backward fused: through the QK norm's, RoPE's and the value
// mix's backward) against the fused backward, then the passes (weighted_sum_backward,
// qk_norm_rope_backward), with q and k the norm and rotation of a random raw qkv and v its mix, as
// the model makes them, with a value embedding and without: dqkv and the mix's scalar gradients
// within bf16 rounding (the passes round dq, dk and dv to bf16 first; the scalars, sums of T d
// products that cancel, on their terms' scale), dv bitwise the fused
// backward's where ve asks for it and untouched (poisoned) where not, and dqkv and the scalars
// bitwise the same on a second run (dq's rows are written by the last of up to 14 contributors). A
// rotation the other way round (the table's sines negated) is far outside the bound.
void check_into_dqkv(int T, int H, int window, uint64_t seed) {
  const std::vector<uint16_t> tokens = layout(T, 300.0, seed);
  const LayoutMask layout_mask(tokens, window);
  const AttentionMask& mask = *layout_mask.mask;
  const size_t n = size_t(T) * H * D;
  const int d = H * D;
  std::vector<float> table;
  rope_table_host(T, table);
  std::vector<float> turned_back = table;
  for (size_t i = 1; i < turned_back.size(); i += 2) turned_back[i] = -turned_back[i];
  DeviceBuffer<float> cos_sin(table), wrong_way(turned_back), lse(size_t(T) * H), sa(std::vector<float>{0.75f, -0.375f}),
      scratch(attention_backward_scratch_floats(T, H)), reduction(kScalarReductionScratchFloats);
  DeviceBuffer<bf16> qkv(to_bf16(random_normal(3 * n, seed + 1))), ve(to_bf16(random_normal(n, seed + 2))),
      dy(to_bf16(random_normal(n, seed + 3))), q(n), k(n), v(n), y(n), dq(n), dk(n), dv_separate(n);
  qk_norm_rope_forward(qkv.get(), cos_sin.get(), q.get(), k.get(), T, H, 0);
  const AttentionTensors a{T, H, d, d, d};
  for (const bf16* value_embedding : {(const bf16*)ve.get(), (const bf16*)nullptr}) {
    std::printf("  T = %d, H = %d, window %d, %s\n", T, H, window, value_embedding ? "with ve" : "without");
    weighted_sum_forward(qkv.get() + 2 * d, sa.get(), value_embedding, sa.get() + 1, v.get(), T, d, 3 * d, 0);
    flash_attention_forward(q.get(), k.get(), v.get(), y.get(), lse.get(), a, mask, 0);
    flash_attention_backward(q.get(), k.get(), v.get(), y.get(), dy.get(), lse.get(), scratch.get(), dq.get(), dk.get(),
                             dv_separate.get(), a, mask, 0);
    // the passes: dqkv and the scalar gradients, with the rope table and with the wrong-way one
    std::vector<double> passes[2], passes_dsa;
    for (int wrong = 0; wrong < 2; ++wrong) {
      DeviceBuffer<bf16> dqkv(3 * n);
      DeviceBuffer<float> dsa(std::vector<float>{0.0f, 0.0f});
      weighted_sum_backward(dv_separate.get(), qkv.get() + 2 * d, sa.get(), dsa.get(), value_embedding, sa.get() + 1,
                            value_embedding ? dsa.get() + 1 : nullptr, dqkv.get() + 2 * d, nullptr, false, T, d, 3 * d,
                            reduction.get(), 0);
      qk_norm_rope_backward(qkv.get(), dq.get(), dk.get(), (wrong ? wrong_way : cos_sin).get(), dqkv.get(), T, H, 0);
      passes[wrong] = to_double(dqkv.download());
      if (!wrong) passes_dsa = to_double(dsa.download());
    }
    std::vector<bf16> runs[2];
    std::vector<float> runs_dsa[2];
    for (int run = 0; run < 2; ++run) {
      DeviceBuffer<bf16> dqkv(3 * n), dv(n);
      DeviceBuffer<float> dsa(std::vector<float>{0.0f, 0.0f});
      dqkv.poison();
      dv.poison();
      scratch.poison();
      flash_attention_backward_into_dqkv(q.get(), k.get(), v.get(), y.get(), dy.get(), lse.get(), scratch.get(),
                                         {qkv.get(), cos_sin.get(), sa.get(), value_embedding, dqkv.get(),
                                          value_embedding ? dv.get() : nullptr},
                                         dsa.get(), value_embedding ? dsa.get() + 1 : nullptr, a, mask, 0);
      runs[run] = dqkv.download(), runs_dsa[run] = dsa.download();
      const std::vector<bf16> dv_into = dv.download(), dv_then = dv_separate.download();
      if (value_embedding) {
        CHECK(std::memcmp(dv_into.data(), dv_then.data(), n * sizeof(bf16)) == 0);
      } else {
        bool untouched = true;
        for (const bf16& e : dv_into) untouched = untouched && std::isnan(__bfloat162float(e));
        CHECK(untouched);
      }
    }
    const std::vector<double> into = to_double(runs[0]);
    CHECK(all_finite(into));
    CHECK_REL_ERROR(into, passes[0], kBf16Bound);
    const std::vector<double> dsa_into = to_double(runs_dsa[0]), dv_then = to_double(dv_separate.download()),
                              raw = to_double(qkv.download()), embedding = to_double(ve.download());
    const double scales[2] = {product_terms_scale(dv_then.data(), raw.data() + 2 * d, T, d, 3 * d),
                              product_terms_scale(dv_then.data(), embedding.data(), T, d, d)};
    // the passes' bf16 rounding of dv puts noise of about 1.6e-3 of the terms' scale (its std) into
    // them: a bound of 6 of those; a wrong sum (a term or a CTA's share missing, a sign) is of order 1
    constexpr double kScalarBound = 1e-2;
    for (int i = 0; i < (value_embedding ? 2 : 1); ++i) {
      const double error = error_on_scale(dsa_into[i], passes_dsa[i], scales[i]);
      std::printf("  dsa%d %.6g (passes %.6g): error %.2e of its terms' scale %.4g (bound %.0e)\n", i, dsa_into[i],
                  passes_dsa[i], error, scales[i], kScalarBound);
      CHECK(error <= kScalarBound);
    }
    if (!value_embedding) CHECK(dsa_into[1] == 0.0);
    const double wrong_way_error = relative_error(into, passes[1]);
    std::printf("  against the rotation the other way round: rel. error %.2e (%.0fx the bound)\n", wrong_way_error,
                wrong_way_error / kBf16Bound);
    CHECK(wrong_way_error > 10 * kBf16Bound);
    const bool same = std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * sizeof(bf16)) == 0 &&
                      runs_dsa[0] == runs_dsa[1];
    std::printf("  dqkv and the scalars of two runs: %s\n", same ? "bitwise the same" : "DIFFERENT");
    CHECK(same);
  }
}

TEST_CASE("the fused backward into dqkv gives the backward and the passes' dqkv and scalar gradients") {
  check_into_dqkv(128 * 16, 2, 1, 900);
  check_into_dqkv(128 * (testing_a_subset() ? 16 : 64), testing_a_subset() ? 2 : 6, 14, 910);
  const int T = 256, H = 1;
  const LayoutMask layout_mask(layout(T, 300.0, 920), 2);
  const size_t n = size_t(T) * H * D;
  DeviceBuffer<bf16> q(n), k(n), v(n), y(n), dy(n), qkv(3 * n + 1), dqkv(3 * n + 1), ve(n + 1), dv(n);
  DeviceBuffer<float> lse(size_t(T) * H), scratch(attention_backward_scratch_floats(T, H)), cos_sin(size_t(T) * D + 1),
      scalars(4);
  const AttentionTensors a{T, H, H * D, H * D, H * D};
  float* dsa1 = scalars.get() + 3;
  auto into = [&](const flash::QkvGradient& grad, float* dsa1_or_null) {
    flash_attention_backward_into_dqkv(q.get(), k.get(), v.get(), y.get(), dy.get(), lse.get(), scratch.get(), grad,
                                       scalars.get() + 2, dsa1_or_null, a, *layout_mask.mask, 0);
  };
  const flash::QkvGradient good{qkv.get(), cos_sin.get(), scalars.get(), ve.get(), dqkv.get(), dv.get()};
  flash::QkvGradient bad = good;
  bad.qkv = qkv.get() + 1;
  CHECK_THROWS_WITH(into(bad, dsa1), "flash attention: qkv must start 4-byte aligned");
  bad = good, bad.cos_sin = cos_sin.get() + 1;
  CHECK_THROWS_WITH(into(bad, dsa1), "flash attention: rope table must start 16-byte aligned");
  bad = good, bad.ve = ve.get() + 1;
  CHECK_THROWS_WITH(into(bad, dsa1), "flash attention: ve must start 4-byte aligned");
  bad = good, bad.dqkv = dqkv.get() + 1;
  CHECK_THROWS_WITH(into(bad, dsa1), "flash attention: dqkv must start 4-byte aligned");
  const char* required = "flash attention into dqkv: qkv, the rope table, sa0, dqkv and dsa0 are required, and dsa1 "
                         "exactly with ve";
  bad = good, bad.cos_sin = nullptr;
  CHECK_THROWS_WITH(into(bad, dsa1), required);
  CHECK_THROWS_WITH(into(good, nullptr), required);  // ve's scalar gradient would have nowhere to go
}

// Both forwards run the same products and softmax steps in the same order on each row, so the
// warp-specialised one (TMA copies, producer and consumer warpgroups, ping-pong) must give the other's
// y and lse bit for bit: at the record's window and heads, over many items a CTA (the persistent
// grids walk several), with poisoned outputs.
TEST_CASE("the warp-specialised forward's y and lse are bitwise the other forward's (window 14, 6 heads)") {
  const int T = 128 * (testing_a_subset() ? 16 : 64), H = 6;
  const std::vector<uint16_t> tokens = layout(T, 600.0, 800);
  const LayoutMask layout_mask(tokens, 14);
  const size_t n = size_t(T) * H * D;
  DeviceBuffer<bf16> q(to_bf16(random_normal(n, 801, 0.6))), k(to_bf16(random_normal(n, 802, 0.6))),
      v(to_bf16(random_normal(n, 803)));
  const AttentionTensors a{T, H, H * D, H * D, H * D};
  std::vector<bf16> y[2];
  std::vector<float> lse[2];
  for (int ws = 0; ws < 2; ++ws) {
    DeviceBuffer<bf16> y_dev(n);
    DeviceBuffer<float> lse_dev(size_t(T) * H);
    y_dev.poison();
    lse_dev.poison();
    (ws ? flash_attention_forward_ws : flash_attention_forward)(q.get(), k.get(), v.get(), y_dev.get(), lse_dev.get(),
                                                                a, *layout_mask.mask, 0);
    y[ws] = y_dev.download(), lse[ws] = lse_dev.download();
  }
  const bool same_y = std::memcmp(y[0].data(), y[1].data(), n * sizeof(bf16)) == 0,
             same_lse = std::memcmp(lse[0].data(), lse[1].data(), lse[0].size() * sizeof(float)) == 0;
  std::printf("  y: %s, lse: %s\n", same_y ? "bitwise the same" : "DIFFERENT", same_lse ? "bitwise the same" : "DIFFERENT");
  CHECK(same_y);
  CHECK(same_lse);
  CHECK(all_finite(to_double(y[1])));
}

int main(int argc, char** argv) { return run_gpu_checks(argc, argv); }
