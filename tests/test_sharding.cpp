// The sharding planner against SPEC 4.3 and the record's numbers (SPEC 1.9, 1.10).
#include "check.h"
#include "kernels/host/sharding.h"

#include <set>

namespace {

const std::vector<int64_t> kQkvShape{3, 768, 768}, kAttnProjShape{768, 768}, kFcShape{3072, 768},
    kMlpProjShape{768, 3072};

// The record's parameters in module order (SPEC 1.1, 1.8): layer by layer qkv, attention proj
// (not in layer 7, which has no attention), c_fc, MLP proj.
std::vector<ParamInfo> record_params() {
  std::vector<ParamInfo> p{{"embed", {50304, 768}, OptimizerKind::adam}};
  for (int k = 0; k < 3; ++k) p.push_back({"value_embed" + std::to_string(k), {50304, 768}, OptimizerKind::adam});
  for (int i = 0; i < 12; ++i) {
    std::string b = "blocks." + std::to_string(i) + ".";
    if (i != 7) {
      p.push_back({b + "qkv", kQkvShape, OptimizerKind::muon});
      p.push_back({b + "attn_proj", kAttnProjShape, OptimizerKind::muon});
    }
    p.push_back({b + "c_fc", kFcShape, OptimizerKind::muon});
    p.push_back({b + "mlp_proj", kMlpProjShape, OptimizerKind::muon});
  }
  p.push_back({"lm_head", {50304, 768}, OptimizerKind::adam});
  p.push_back({"scalars", {64}, OptimizerKind::adam});
  return p;
}

std::vector<int> params_of(const std::vector<ParamInfo>& params, OptimizerKind kind) {
  std::vector<int> indices;
  for (int p = 0; p < int(params.size()); ++p)
    if (params[p].optimizer == kind) indices.push_back(p);
  return indices;
}

// Every Adam row owned exactly once, slices contiguous in rank order, pad < W rows.
void check_adam_invariants(const std::vector<ParamInfo>& params, const ShardPlan& plan, int W) {
  std::vector<int> adam_params;
  for (const AdamShard& sh : plan.adam) {
    adam_params.push_back(sh.param);
    CHECK(sh.rows == params[sh.param].shape[0]);
    CHECK(sh.rows_per_rank == (sh.rows + W - 1) / W);
    CHECK(sh.slice_elems() == sh.rows_per_rank * sh.row_elems);
    CHECK(sh.padded_rows() == sh.rows_per_rank * W && sh.padded_rows() - sh.rows < W);
    int64_t covered = 0;
    for (int r = 0; r < W; ++r) {
      CHECK(sh.first_row(r) == r * sh.rows_per_rank);
      CHECK(sh.valid_rows(r) >= 0 && sh.valid_rows(r) <= sh.rows_per_rank);
      if (sh.valid_rows(r) > 0) CHECK(sh.first_row(r) == covered);
      covered += sh.valid_rows(r);
    }
    CHECK(covered == sh.rows);
  }
  CHECK(adam_params == params_of(params, OptimizerKind::adam));
}

// Every Muon parameter owned exactly once, by rank i % W for member i of its shape group, in
// ceil(n / W) chunks whose empty slots (-1) are only at the end of the last chunk.
void check_muon_invariants(const std::vector<ParamInfo>& params, const ShardPlan& plan, int W) {
  std::multiset<int> owned;
  for (int r = 0; r < W; ++r)
    for (int p : plan.muon_params_owned_by(r)) owned.insert(p);
  std::vector<int> muon_params = params_of(params, OptimizerKind::muon);
  CHECK((owned == std::multiset<int>(muon_params.begin(), muon_params.end())));
  for (const MuonGroup& g : plan.muon) {
    CHECK(g.chunks.size() == (g.params.size() + W - 1) / W);
    for (size_t i = 0; i < g.params.size(); ++i) {
      CHECK(params[g.params[i]].shape == g.shape);
      if (i > 0) CHECK(g.params[i - 1] < g.params[i]);
      CHECK(g.chunks[i / W].owner_param[i % W] == g.params[i]);
    }
    for (size_t slot = g.params.size(); slot < g.chunks.size() * W; ++slot)
      CHECK(g.chunks[slot / W].owner_param[slot % W] == -1);
  }
}

void check_invariants(const std::vector<ParamInfo>& params, int W) {
  ShardPlan plan = plan_shards(params, W);
  CHECK(plan.world_size == W);
  check_adam_invariants(params, plan, W);
  check_muon_invariants(params, plan, W);
}

}  // namespace

TEST_CASE("record at W = 8: 6288-row Adam slices, scalars 8 per rank") {
  ShardPlan plan = plan_shards(record_params(), 8);
  CHECK(plan.adam.size() == 6);
  for (const AdamShard& sh : plan.adam) {
    bool scalars = sh.rows == 64;
    CHECK(sh.rows_per_rank == (scalars ? 8 : 6288));
    CHECK(sh.row_elems == (scalars ? 1 : 768));
    CHECK(sh.padded_rows() == sh.rows);  // 8 divides both: no pad
    for (int r = 0; r < 8; ++r) CHECK(sh.valid_rows(r) == sh.rows_per_rank);
  }
}

TEST_CASE("record at W = 8: 4 Muon groups of 11, 11, 12, 12; ownership 8 8 8 6 4 4 4 4") {
  ShardPlan plan = plan_shards(record_params(), 8);
  CHECK(plan.muon.size() == 4);
  if (plan.muon.size() != 4) return;
  CHECK((plan.muon[0].shape == kQkvShape && plan.muon[1].shape == kAttnProjShape &&
         plan.muon[2].shape == kFcShape && plan.muon[3].shape == kMlpProjShape));
  CHECK(plan.muon[0].matrix_elems() == 3 * 768 * 768);
  std::vector<size_t> sizes, chunks;
  for (const MuonGroup& g : plan.muon) {
    sizes.push_back(g.params.size());
    chunks.push_back(g.chunks.size());
  }
  CHECK((sizes == std::vector<size_t>{11, 11, 12, 12}));
  CHECK((chunks == std::vector<size_t>{2, 2, 2, 2}));
  std::vector<size_t> owned;
  for (int r = 0; r < 8; ++r) owned.push_back(plan.muon_params_owned_by(r).size());
  CHECK((owned == std::vector<size_t>{8, 8, 8, 6, 4, 4, 4, 4}));
  CHECK(plan.muon[0].chunks[1].owner_param[3] == -1);  // rank 3 receives into scratch in chunk 1
  // Rank 0 updates its matrices group by group, chunk by chunk: qkv of layers 0 and 8 first.
  std::vector<int> rank0 = plan.muon_params_owned_by(0);
  CHECK(rank0.size() == 8 && rank0[0] == plan.muon[0].params[0] && rank0[1] == plan.muon[0].params[8]);
}

TEST_CASE("scalars at W = 3 pad to 66 rows: valid 22, 22, 20") {
  ShardPlan plan = plan_shards(record_params(), 3);
  const AdamShard& scalars = plan.adam.back();
  CHECK(scalars.padded_rows() == 66);
  CHECK(scalars.first_row(0) == 0 && scalars.first_row(1) == 22 && scalars.first_row(2) == 44);
  CHECK(scalars.valid_rows(0) == 22 && scalars.valid_rows(1) == 22 && scalars.valid_rows(2) == 20);
}

TEST_CASE("invariants at W = 1, 2, 3, 5, 8, 16 and 100") {
  for (int W : {1, 2, 3, 5, 8, 16, 100}) check_invariants(record_params(), W);
}

TEST_CASE("more ranks than rows: trailing ranks own empty slices") {
  ShardPlan plan = plan_shards({{"tiny", {3, 5}, OptimizerKind::adam}}, 8);
  const AdamShard& sh = plan.adam[0];
  CHECK(sh.rows_per_rank == 1 && sh.padded_rows() == 8 && sh.slice_elems() == 5);
  for (int r = 0; r < 8; ++r) CHECK(sh.valid_rows(r) == (r < 3 ? 1 : 0));
}

TEST_CASE("bad inputs are rejected with the parameter's name") {
  CHECK_THROWS_WITH(plan_shards(record_params(), 0), "world size 0");
  CHECK_THROWS_WITH(plan_shards({{"flat", {}, OptimizerKind::adam}}, 2), "'flat'", "no dimensions");
  CHECK_THROWS_WITH(plan_shards({{"empty", {4, 0}, OptimizerKind::adam}}, 2), "'empty'", "size 0");
  CHECK_THROWS_WITH(plan_shards({{"negative", {-4, 2}, OptimizerKind::adam}}, 2), "'negative'", "size -4");
  CHECK_THROWS_WITH(plan_shards({{"hollow", {0, 768}, OptimizerKind::muon}}, 2), "'hollow'", "size 0");
  CHECK_THROWS_WITH(plan_shards({{"vector", {8}, OptimizerKind::muon}}, 2), "'vector'", "at least 2");
}

int main() { return check::run_checks(); }
