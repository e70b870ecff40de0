// Checks of the MoE routing ops shared by every backend.
#pragma once

#include <ATen/core/Tensor.h>

namespace cake {

struct MoeSortShape {
  int64_t num_tokens = 0;
  int64_t top_k = 0;
  int64_t num_local_experts = 0;
};

MoeSortShape check_moe_sort(const at::Tensor& token_selected_experts, int64_t num_experts,
                            int64_t num_local_experts, int64_t local_expert_offset,
                            int64_t tile_size, const char* op);

}  // namespace cake
