// CPU kernel of cake::moe_sort: a stable counting sort of the routes by local expert.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "moe_checks.h"

namespace cake {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_sort(
    const at::Tensor& ids, int64_t num_experts, int64_t num_local_experts,
    int64_t local_expert_offset, int64_t tile_size) {
  const auto s = check_moe_sort(ids, num_experts, num_local_experts, local_expert_offset, tile_size,
                                "cake::moe_sort");
  const int64_t routes = s.num_tokens * s.top_k;
  const auto opts = ids.options();
  auto counts = at::zeros({num_local_experts}, opts);
  auto offsets = at::empty({num_local_experts + 1}, opts);
  auto permuted_to_expanded = at::full({routes}, -1, opts);
  auto expanded_to_permuted = at::full({routes}, -1, opts);
  auto tile_offsets = at::empty({num_local_experts + 1}, opts);

  const int32_t* id = ids.data_ptr<int32_t>();
  int32_t* count = counts.data_ptr<int32_t>();
  auto local = [&](int64_t r) -> int64_t {  // local expert of route r, or -1 when dropped
    const int64_t e = int64_t(id[r]) - local_expert_offset;
    return (id[r] >= 0 && id[r] < num_experts && e >= 0 && e < num_local_experts) ? e : -1;
  };
  for (int64_t r = 0; r < routes; ++r) {
    if (const int64_t e = local(r); e >= 0) ++count[e];
  }
  int32_t* offset = offsets.data_ptr<int32_t>();
  int32_t* tile_offset = tile_offsets.data_ptr<int32_t>();
  offset[0] = tile_offset[0] = 0;
  for (int64_t e = 0; e < num_local_experts; ++e) {
    offset[e + 1] = offset[e] + count[e];
    tile_offset[e + 1] = tile_offset[e] + static_cast<int32_t>((count[e] + tile_size - 1) / tile_size);
  }
  std::vector<int32_t> next(offset, offset + num_local_experts);
  int32_t* p2e = permuted_to_expanded.data_ptr<int32_t>();
  int32_t* e2p = expanded_to_permuted.data_ptr<int32_t>();
  for (int64_t r = 0; r < routes; ++r) {
    if (const int64_t e = local(r); e >= 0) {
      const int32_t p = next[e]++;
      p2e[p] = static_cast<int32_t>(r);
      e2p[r] = p;
    }
  }
  return {counts, offsets, permuted_to_expanded, expanded_to_permuted, tile_offsets};
}

}  // namespace

TORCH_LIBRARY_IMPL(cake, CPU, m) {
  m.impl("moe_sort", &moe_sort);
}

}  // namespace cake
