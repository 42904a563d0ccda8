// The sharding planner of SPEC 4.3: which rank owns which part of which parameter.
// DistAdam: every parameter split on dim 0 into W equal slices (padded). Muon: matrices grouped by
// shape; member i of a group is owned by rank i % W, and chunk k holds members [kW, kW + W).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

enum class OptimizerKind { adam, muon };

struct ParamInfo {
  std::string name;
  std::vector<int64_t> shape;
  OptimizerKind optimizer;
};

// Rank r owns rows [r * rows_per_rank, (r + 1) * rows_per_rank) of the padded parameter; the pad
// rows past `rows` exist only in communication buffers and are never read as data.
struct AdamShard {
  int param;                               // index into the planner's parameter list
  int64_t rows, row_elems, rows_per_rank;  // rows_per_rank = ceil(rows / world_size)
  int world_size;

  int64_t padded_rows() const { return rows_per_rank * world_size; }
  int64_t slice_elems() const { return rows_per_rank * row_elems; }
  int64_t first_row(int rank) const { return rank * rows_per_rank; }
  int64_t valid_rows(int rank) const {
    int64_t left = rows - first_row(rank);
    return left <= 0 ? 0 : left < rows_per_rank ? left : rows_per_rank;
  }
};

struct MuonChunk {
  std::vector<int> owner_param;  // [W]: the parameter rank r owns in this chunk, or -1 (scratch)
};

struct MuonGroup {
  std::vector<int64_t> shape;
  std::vector<int> params;  // members in parameter order
  std::vector<MuonChunk> chunks;
  int64_t matrix_elems() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

struct ShardPlan {
  int world_size = 1;
  std::vector<AdamShard> adam;  // Adam parameters in parameter order
  std::vector<MuonGroup> muon;  // groups in order of first appearance

  // Parameter indices, group by group and chunk by chunk: the order in which the owner updates them.
  std::vector<int> muon_params_owned_by(int rank) const {
    std::vector<int> owned;
    for (const MuonGroup& g : muon)
      for (const MuonChunk& c : g.chunks)
        if (c.owner_param.at(rank) >= 0) owned.push_back(c.owner_param[rank]);
    return owned;
  }
};

namespace sharding_detail {

inline void validate_param(const ParamInfo& p) {
  if (p.shape.empty()) throw std::invalid_argument("parameter '" + p.name + "' has no dimensions");
  for (int64_t d : p.shape)
    if (d <= 0) throw std::invalid_argument("parameter '" + p.name + "' has a dimension of size " + std::to_string(d));
  if (p.optimizer == OptimizerKind::muon && p.shape.size() < 2)
    throw std::invalid_argument("Muon parameter '" + p.name + "' must have at least 2 dimensions");
}

inline MuonGroup& muon_group_of(std::vector<MuonGroup>& groups, const std::vector<int64_t>& shape) {
  for (MuonGroup& g : groups)
    if (g.shape == shape) return g;
  groups.push_back({shape, {}, {}});
  return groups.back();
}

inline AdamShard adam_shard(int param, const std::vector<int64_t>& shape, int world_size) {
  int64_t rows = shape[0], row_elems = 1;  // a 1-D parameter is a column of single-element rows
  for (size_t d = 1; d < shape.size(); ++d) row_elems *= shape[d];
  return {param, rows, row_elems, (rows + world_size - 1) / world_size, world_size};
}

// Chunk k holds members [kW, kW + W); a rank past the group's end owns nothing (-1) in the last chunk.
inline std::vector<MuonChunk> muon_chunks(const std::vector<int>& members, int world_size) {
  std::vector<MuonChunk> chunks;
  for (size_t base = 0; base < members.size(); base += world_size) {
    MuonChunk chunk{std::vector<int>(world_size, -1)};
    for (int r = 0; r < world_size && base + r < members.size(); ++r) chunk.owner_param[r] = members[base + r];
    chunks.push_back(std::move(chunk));
  }
  return chunks;
}

}  // namespace sharding_detail

// world_size >= 1. A Muon parameter needs >= 2 dims, an Adam one >= 1; bad input throws
// std::invalid_argument naming the parameter.
inline ShardPlan plan_shards(const std::vector<ParamInfo>& params, int world_size) {
  using namespace sharding_detail;
  if (world_size < 1) throw std::invalid_argument("world size " + std::to_string(world_size) + " < 1");
  ShardPlan plan;
  plan.world_size = world_size;
  for (int p = 0; p < int(params.size()); ++p) {
    validate_param(params[p]);
    if (params[p].optimizer == OptimizerKind::muon) muon_group_of(plan.muon, params[p].shape).params.push_back(p);
    else plan.adam.push_back(adam_shard(p, params[p].shape, world_size));
  }
  for (MuonGroup& g : plan.muon) g.chunks = muon_chunks(g.params, world_size);
  return plan;
}
