// cuDNN's graph API (the backend descriptors) for the MLP's two products with ReLU² in their
// epilogue: the candidate issue 29 names beside our own GEMM (kernels/gemm_epilogue.cuh), timed by
// bench_kernels against cuBLASLt + the pass and against ours. Benchmark-only: the trainer does not
// call cuDNN (were it to win, it would get an emulator stand-in first, as cuSOLVER has).
//
// cuDNN is loaded at run time (dlopen of libcudnn.so.9): a machine without it still builds and
// runs everything, and the bench says why its rows are missing. Tensors are cuDNN's matmul layout,
// [batch, rows, cols] with explicit strides; the products accumulate in fp32 into a virtual (never
// stored) tensor, which the pointwise ops read.
#pragma once
#include <cudnn_graph.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>
#include <deque>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace cudnn_fusion {

// The backend API's entry points, resolved once from the shared library.
struct Library {
  decltype(&cudnnGetVersion) get_version;
  decltype(&cudnnGetErrorString) error_string;
  decltype(&cudnnCreate) create_handle;
  decltype(&cudnnDestroy) destroy_handle;
  decltype(&cudnnSetStream) set_stream;
  decltype(&cudnnBackendCreateDescriptor) create;
  decltype(&cudnnBackendDestroyDescriptor) destroy;
  decltype(&cudnnBackendSetAttribute) set_attribute;
  decltype(&cudnnBackendGetAttribute) get_attribute;
  decltype(&cudnnBackendFinalize) finalize;
  decltype(&cudnnBackendExecute) execute;

  // The library, or nullptr with `why_not` saying what is missing.
  static const Library* load(std::string& why_not) {
    static Library library;
    static std::string failure = library.open();
    why_not = failure;
    return failure.empty() ? &library : nullptr;
  }

  // Throws "cuDNN: <what>: <status>" unless s is success.
  void check(cudnnStatus_t s, const std::string& what) const {
    if (s != CUDNN_STATUS_SUCCESS) throw std::runtime_error("cuDNN: " + what + ": " + error_string(s));
  }

 private:
  std::string open() {
    const char* file = "libcudnn.so.9";
    void* so = dlopen(file, RTLD_NOW | RTLD_LOCAL);
    if (!so) return std::string("cannot load ") + file + " (" + dlerror() + "; LD_LIBRARY_PATH may name its folder)";
    std::string missing;
    auto resolve = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(so, name));
      if (!fn) missing += std::string(missing.empty() ? "" : ", ") + name;
    };
    resolve(get_version, "cudnnGetVersion");
    resolve(error_string, "cudnnGetErrorString");
    resolve(create_handle, "cudnnCreate");
    resolve(destroy_handle, "cudnnDestroy");
    resolve(set_stream, "cudnnSetStream");
    resolve(create, "cudnnBackendCreateDescriptor");
    resolve(destroy, "cudnnBackendDestroyDescriptor");
    resolve(set_attribute, "cudnnBackendSetAttribute");
    resolve(get_attribute, "cudnnBackendGetAttribute");
    resolve(finalize, "cudnnBackendFinalize");
    resolve(execute, "cudnnBackendExecute");
    if (!missing.empty()) return std::string(file) + " lacks " + missing;
    if (get_version() / 10000 != CUDNN_MAJOR)
      return std::string(file) + " is cuDNN " + std::to_string(get_version()) + ", built against major " +
             std::to_string(CUDNN_MAJOR);
    return "";
  }
};

// One backend descriptor, destroyed with its owner. `what` names it in errors.
class Descriptor {
 public:
  Descriptor(const Library& lib, cudnnBackendDescriptorType_t type, std::string what) : lib_(&lib), what_(std::move(what)) {
    lib.check(lib.create(type, &d_), "create " + what_);
  }
  ~Descriptor() {
    if (d_) lib_->destroy(d_);
  }
  Descriptor(Descriptor&& o) noexcept : lib_(o.lib_), d_(std::exchange(o.d_, nullptr)), what_(std::move(o.what_)) {}
  Descriptor& operator=(Descriptor&&) = delete;
  Descriptor(const Descriptor&) = delete;

  template <typename V>
  Descriptor& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const V* values, int64_t count = 1) {
    lib_->check(lib_->set_attribute(d_, name, type, count, values), "set attribute " + std::to_string(name) + " of " + what_);
    return *this;
  }
  Descriptor& set(cudnnBackendAttributeName_t name, const Descriptor& d) {
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, &d.d_);
  }
  Descriptor& finalize() {
    lib_->check(lib_->finalize(d_), "finalize " + what_);
    return *this;
  }
  cudnnBackendDescriptor_t get() const { return d_; }
  const std::string& what() const { return what_; }

 private:
  const Library* lib_;
  cudnnBackendDescriptor_t d_ = nullptr;
  std::string what_;
};

// A cuDNN handle on a stream.
class Handle {
 public:
  Handle(const Library& lib, cudaStream_t stream) : lib_(&lib) {
    lib.check(lib.create_handle(&h_), "cudnnCreate");
    const cudnnStatus_t s = lib.set_stream(h_, stream);
    if (s != CUDNN_STATUS_SUCCESS) lib.destroy_handle(h_);
    lib.check(s, "cudnnSetStream");
  }
  ~Handle() { lib_->destroy_handle(h_); }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  cudnnHandle_t get() const { return h_; }

 private:
  const Library* lib_;
  cudnnHandle_t h_ = nullptr;
};

enum class Storage { real, virtual_fp32, host_scalar };

// The operations of one fused product, each descriptor finalised as it is added (no device
// needed); `operation_graph` ties them into cuDNN's graph.
class Graph {
 public:
  explicit Graph(const Library& lib) : lib_(&lib) {}

  // A tensor [1, rows, cols] with strides (row_stride, col_stride); `uid` names it in the variant
  // pack. virtual_fp32: an intermediate, never stored; host_scalar: one fp32 passed by value.
  const Descriptor& tensor(int64_t uid, int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride,
                           Storage storage = Storage::real) {
    const bool is_virtual = storage == Storage::virtual_fp32, by_value = storage == Storage::host_scalar;
    const cudnnDataType_t type = storage == Storage::real ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
    // A host scalar is a float on the caller's stack: 4-byte aligned.
    const int64_t dims[3] = {1, rows, cols}, strides[3] = {rows * cols, row_stride, col_stride},
                  alignment = by_value ? 4 : 16;
    Descriptor t(*lib_, CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor " + std::to_string(uid));
    t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, &type)
        .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims, 3)
        .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides, 3)
        .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, &uid)
        .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, &alignment)
        .set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, &is_virtual)
        .set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, &by_value)
        .finalize();
    keep_.push_back(std::move(t));
    return keep_.back();
  }
  const Descriptor& scalar(int64_t uid) { return tensor(uid, 1, 1, 1, 1, Storage::host_scalar); }

  // c = a b, accumulated in fp32.
  void matmul(const Descriptor& a, const Descriptor& b, const Descriptor& c) {
    const cudnnDataType_t fp32 = CUDNN_DATA_FLOAT;
    Descriptor config(*lib_, CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul config");
    config.set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &fp32).finalize();
    Descriptor op(*lib_, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul " + a.what() + " x " + b.what());
    op.set(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a)
        .set(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b)
        .set(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c)
        .set(CUDNN_ATTR_OPERATION_MATMUL_DESC, config)
        .finalize();
    keep_.push_back(std::move(config));
    ops_.push_back(std::move(op));
  }

  // y = mode(x) or y = mode(x, b), computed in fp32.
  void pointwise(cudnnPointwiseMode_t mode, const Descriptor& x, const Descriptor& y, const Descriptor* b = nullptr) {
    const cudnnDataType_t fp32 = CUDNN_DATA_FLOAT;
    Descriptor config(*lib_, CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise config " + std::to_string(mode));
    config.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, &mode)
        .set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, &fp32)
        .finalize();
    Descriptor op(*lib_, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "pointwise " + std::to_string(mode) + " into " + y.what());
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, config)
        .set(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x)
        .set(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    if (b) op.set(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b);
    op.finalize();
    keep_.push_back(std::move(config));
    ops_.push_back(std::move(op));
  }

  // The operation graph, where cuDNN checks the operations against each other (shapes, uids).
  // `handle`: the GPU's; cuDNN 9.19 also finalises it without one (null), as the CPU test does,
  // while older 9.x need it.
  Descriptor operation_graph(cudnnHandle_t handle) const {
    std::vector<cudnnBackendDescriptor_t> ops;
    for (const Descriptor& op : ops_) ops.push_back(op.get());
    Descriptor graph(*lib_, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
    if (handle) graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, &handle);
    graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, ops.data(), int64_t(ops.size())).finalize();
    return graph;
  }

  size_t operations() const { return ops_.size(); }

 private:
  const Library* lib_;
  // Deques: a descriptor's address stays as more are added (tensor() hands out references).
  std::deque<Descriptor> keep_;  // tensors and configurations the operations refer to
  std::deque<Descriptor> ops_;
};

// The tensors' uids of both graphs, for the variant pack.
enum Uid : int64_t { kInput = 1, kWeight, kOutput, kSquare, kTwo, kProduct, kRelu, kRoot, kScaled };

// a [T, F] = relu(x [T, d] W^T)^2 with W [F, d] (row-major): the MLP's fc product with ReLU².
// Variant pack: kInput x, kWeight W, kOutput a.
inline Graph mlp_fc_relu_squared(const Library& lib, int64_t T, int64_t F, int64_t d) {
  Graph g(lib);
  const Descriptor& x = g.tensor(kInput, T, d, d, 1);
  const Descriptor& w_t = g.tensor(kWeight, d, F, 1, d);  // W^T [d, F]: W's rows are its columns
  const Descriptor& product = g.tensor(kProduct, T, F, F, 1, Storage::virtual_fp32);
  const Descriptor& relu = g.tensor(kRelu, T, F, F, 1, Storage::virtual_fp32);
  const Descriptor& a = g.tensor(kOutput, T, F, F, 1);
  g.matmul(x, w_t, product);
  g.pointwise(CUDNN_POINTWISE_RELU_FWD, product, relu);
  g.pointwise(CUDNN_POINTWISE_MUL, relu, a, &relu);
  return g;
}

// du [T, F] = (dy [T, d] W [d, F]) 2 sqrt(a), with W row-major and a = relu(u)^2 the forward's
// output: the MLP proj's input gradient through ReLU²'s backward (as
// relu_squared_backward_from_square). Variant pack: kInput dy, kWeight W, kSquare a, kTwo the
// host scalar 2, kOutput du.
inline Graph mlp_proj_dx_relu_squared_backward(const Library& lib, int64_t T, int64_t F, int64_t d) {
  Graph g(lib);
  const Descriptor& dy = g.tensor(kInput, T, d, d, 1);
  const Descriptor& w = g.tensor(kWeight, d, F, F, 1);
  const Descriptor& square = g.tensor(kSquare, T, F, F, 1);
  const Descriptor& two = g.scalar(kTwo);
  const Descriptor& product = g.tensor(kProduct, T, F, F, 1, Storage::virtual_fp32);
  const Descriptor& root = g.tensor(kRoot, T, F, F, 1, Storage::virtual_fp32);
  const Descriptor& scaled = g.tensor(kScaled, T, F, F, 1, Storage::virtual_fp32);
  const Descriptor& du = g.tensor(kOutput, T, F, F, 1);
  g.matmul(dy, w, product);
  g.pointwise(CUDNN_POINTWISE_SQRT, square, root);
  g.pointwise(CUDNN_POINTWISE_MUL, product, scaled, &root);
  g.pointwise(CUDNN_POINTWISE_MUL, scaled, du, &two);
  return g;
}

// An execution plan of one of the heuristics' engine configurations.
struct Plan {
  Descriptor plan;
  int64_t workspace_bytes;
  std::string engine;  // "config <i>: engine <global index>[, compiled at run time]"
};

// Plans for up to `most` of the engine configurations cuDNN's heuristics (mode A) propose for the
// graph, best guess first. A configuration whose plan does not finalise (not supported, or its
// run-time compilation failed) is skipped, counted in `refused` with its last status in
// `last_refusal`; a bad parameter (the 2000s: a mistake in the graph) throws.
inline std::vector<Plan> plans(const Library& lib, cudnnHandle_t handle, const Descriptor& graph, int most, int& refused,
                               std::string& last_refusal) {
  Descriptor heuristics(lib, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "heuristics");
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  heuristics.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph)
      .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, &mode)
      .finalize();
  int64_t count = 0;
  lib.check(lib.get_attribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                              nullptr),
            "count the heuristics' results");
  std::vector<Descriptor> configs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    configs.emplace_back(lib, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config " + std::to_string(i));
    raw.push_back(configs.back().get());
  }
  lib.check(lib.get_attribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &count,
                              raw.data()),
            "get the heuristics' results");
  std::vector<Plan> out;
  refused = 0;
  for (int64_t i = 0; i < count && int(out.size()) < most; ++i) {
    Descriptor engine(lib, CUDNN_BACKEND_ENGINE_DESCRIPTOR, "engine");
    cudnnBackendDescriptor_t engine_raw = engine.get();
    int64_t n = 0, index = -1, notes_count = 0;
    lib.check(lib.get_attribute(raw[i], CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &engine_raw),
              "engine of config " + std::to_string(i));
    lib.check(lib.get_attribute(engine_raw, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &index), "engine index");
    cudnnBackendBehaviorNote_t notes[CUDNN_BEHAVIOR_NOTE_TYPE_COUNT];
    lib.check(lib.get_attribute(engine_raw, CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE, CUDNN_TYPE_BEHAVIOR_NOTE,
                                CUDNN_BEHAVIOR_NOTE_TYPE_COUNT, &notes_count, notes),
              "engine notes");
    std::string name = "config " + std::to_string(i) + ": engine " + std::to_string(index);
    for (int64_t k = 0; k < notes_count; ++k)
      if (notes[k] == CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION) name += ", compiled at run time";
    Descriptor plan(lib, CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "plan of " + name);
    plan.set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, &handle)
        .set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, &raw[i]);
    const cudnnStatus_t status = lib.finalize(plan.get());
    if (status / 1000 == CUDNN_STATUS_BAD_PARAM / 1000) lib.check(status, "finalize " + plan.what());
    if (status != CUDNN_STATUS_SUCCESS) {
      ++refused;
      last_refusal = name + ": " + lib.error_string(status);
      continue;
    }
    int64_t workspace = 0;
    lib.check(lib.get_attribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &workspace),
              "workspace of " + name);
    out.push_back({std::move(plan), workspace, name});
  }
  return out;
}

// The tensors of one run (by uid; a host scalar's pointer is a host address) and its workspace
// (at least the plan's workspace_bytes, or null for none), built once: a timed run executes alone.
class VariantPack {
 public:
  VariantPack(const Library& lib, const std::vector<std::pair<int64_t, void*>>& pointers, void* workspace)
      : pack_(lib, CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "variant pack") {
    std::vector<int64_t> uids;
    std::vector<void*> data;
    for (const auto& [uid, p] : pointers) {
      uids.push_back(uid);
      data.push_back(p);
    }
    pack_.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids.data(), int64_t(uids.size()))
        .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, data.data(), int64_t(data.size()))
        .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, &workspace)
        .finalize();
  }
  const Descriptor& get() const { return pack_; }

 private:
  Descriptor pack_;
};

// Runs `plan` on the handle's stream.
inline void execute(const Library& lib, cudnnHandle_t handle, const Plan& plan, const VariantPack& pack) {
  lib.check(lib.execute(handle, plan.plan.get(), pack.get().get()), "execute " + plan.engine);
}

}  // namespace cudnn_fusion
