// The sharding planner against SPEC 4.3 and the record's numbers (SPEC 1.9, 1.10).
#include "check.h"
#include "kernels/sharding.h"

#include <set>

namespace {

// The record's parameters in module order (SPEC 1.1, 1.8).
std::vector<ParamInfo> record_params() {
  std::vector<ParamInfo> p{{"embed", {50304, 768}, OptimizerKind::adam}};
  for (int k = 0; k < 3; ++k) p.push_back({"value_embed" + std::to_string(k), {50304, 768}, OptimizerKind::adam});
  for (int i = 0; i < 12; ++i) {
    std::string b = "blocks." + std::to_string(i) + ".";
    if (i != 7) {
      p.push_back({b + "qkv", {3, 768, 768}, OptimizerKind::muon});
      p.push_back({b + "attn_proj", {768, 768}, OptimizerKind::muon});
    }
    p.push_back({b + "c_fc", {3072, 768}, OptimizerKind::muon});
    p.push_back({b + "mlp_proj", {768, 3072}, OptimizerKind::muon});
  }
  p.push_back({"lm_head", {50304, 768}, OptimizerKind::adam});
  p.push_back({"scalars", {64}, OptimizerKind::adam});
  return p;
}

void check_invariants(const std::vector<ParamInfo>& params, int W) {
  ShardPlan plan = plan_shards(params, W);
  for (const AdamShard& sh : plan.adam) {
    int64_t covered = 0;
    for (int r = 0; r < W; ++r) {
      CHECK(sh.valid_rows(r) >= 0 && sh.valid_rows(r) <= sh.rows_per_rank);
      if (sh.valid_rows(r) > 0) CHECK(sh.first_row(r) == covered);
      covered += sh.valid_rows(r);
    }
    CHECK(covered == sh.rows);
    CHECK(sh.padded_rows() % W == 0 && sh.padded_rows() >= sh.rows && sh.padded_rows() - sh.rows < W);
  }
  std::multiset<int> owned;
  for (int r = 0; r < W; ++r)
    for (int p : plan.muon_params_owned_by(r)) owned.insert(p);
  int muon_params = 0;
  for (const ParamInfo& p : params) muon_params += p.optimizer == OptimizerKind::muon;
  CHECK(int(owned.size()) == muon_params && int(std::set<int>(owned.begin(), owned.end()).size()) == muon_params);
  for (const MuonGroup& g : plan.muon) {
    CHECK(g.chunks.size() == (g.params.size() + W - 1) / W);
    for (size_t i = 0; i < g.params.size(); ++i) CHECK(g.chunks[i / W].owner_param[i % W] == g.params[i]);
  }
}

}  // namespace

TEST_CASE("record at W = 8: 6288-row Adam slices, 4 Muon groups, ownership 8 8 8 6 4 4 4 4") {
  ShardPlan plan = plan_shards(record_params(), 8);
  CHECK(plan.adam.size() == 6);
  for (const AdamShard& sh : plan.adam)
    CHECK(sh.rows == 64 ? sh.rows_per_rank == 8 : (sh.rows_per_rank == 6288 && sh.row_elems == 768));
  CHECK(plan.muon.size() == 4);
  std::vector<size_t> sizes;
  for (const MuonGroup& g : plan.muon) sizes.push_back(g.params.size());
  CHECK((sizes == std::vector<size_t>{11, 11, 12, 12}));
  std::vector<size_t> owned;
  for (int r = 0; r < 8; ++r) owned.push_back(plan.muon_params_owned_by(r).size());
  CHECK((owned == std::vector<size_t>{8, 8, 8, 6, 4, 4, 4, 4}));
  CHECK(plan.muon[0].chunks[1].owner_param[3] == -1);  // rank 3 receives into scratch in chunk 1
}

TEST_CASE("scalars at W = 3 pad to 66 rows: valid 22, 22, 20") {
  ShardPlan plan = plan_shards(record_params(), 3);
  const AdamShard& scalars = plan.adam.back();
  CHECK(scalars.padded_rows() == 66);
  CHECK(scalars.valid_rows(0) == 22 && scalars.valid_rows(1) == 22 && scalars.valid_rows(2) == 20);
}

TEST_CASE("invariants at W = 1, 2, 3, 5, 8, 16") {
  for (int W : {1, 2, 3, 5, 8, 16}) check_invariants(record_params(), W);
}

TEST_CASE("bad inputs are rejected with the parameter's name") {
  CHECK_THROWS_WITH(plan_shards(record_params(), 0), "world size 0");
  CHECK_THROWS_WITH(plan_shards({{"flat", {}, OptimizerKind::adam}}, 2), "'flat'", "no dimensions");
  CHECK_THROWS_WITH(plan_shards({{"empty", {4, 0}, OptimizerKind::adam}}, 2), "'empty'", "size 0");
  CHECK_THROWS_WITH(plan_shards({{"vector", {8}, OptimizerKind::muon}}, 2), "'vector'", "at least 2");
}

int main() { return check::run_checks(); }
