#include "moe_checks.h"

#include <c10/util/Exception.h>

namespace cake {

MoeSortShape check_moe_sort(const at::Tensor& ids, int64_t num_experts, int64_t num_local_experts,
                            int64_t local_expert_offset, int64_t tile_size, const char* op) {
  TORCH_CHECK(ids.dim() == 2, op, ": token_selected_experts must be a 2-D [num_tokens, top_k] tensor, got shape ",
              ids.sizes());
  TORCH_CHECK(ids.scalar_type() == at::kInt, op, ": token_selected_experts must be int32, got ",
              ids.scalar_type());
  TORCH_CHECK(ids.is_contiguous(), op, ": token_selected_experts must be contiguous");
  TORCH_CHECK(num_experts > 0, op, ": num_experts must be positive, got ", num_experts);
  TORCH_CHECK(num_local_experts > 0 && num_local_experts <= num_experts, op,
              ": num_local_experts must be in [1, num_experts=", num_experts, "], got ", num_local_experts);
  TORCH_CHECK(local_expert_offset >= 0 && local_expert_offset + num_local_experts <= num_experts, op,
              ": the shard [local_expert_offset, local_expert_offset + num_local_experts) = [",
              local_expert_offset, ", ", local_expert_offset + num_local_experts,
              ") must lie within [0, num_experts=", num_experts, ")");
  TORCH_CHECK(tile_size > 0, op, ": tile_size must be positive, got ", tile_size);
  TORCH_CHECK(ids.size(0) * ids.size(1) < (int64_t{1} << 31), op,
              ": num_tokens * top_k must fit in int32, got ", ids.size(0) * ids.size(1));
  return {ids.size(0), ids.size(1), num_local_experts};
}

}  // namespace cake
