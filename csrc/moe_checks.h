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

struct MoeGemm1Shape {
  int64_t rows = 0;          // T * top_k permuted rows
  int64_t intermediate = 0;  // I (w1 holds 2I rows)
};

MoeGemm1Shape check_moe_gemm1(const at::Tensor& x, const at::Tensor& w1,
                              const at::Tensor& permuted_to_expanded,
                              const at::Tensor& expert_offsets, int64_t top_k, const char* op);

struct MoeFinalizeShape {
  int64_t num_tokens = 0;
  int64_t top_k = 0;
  int64_t hidden = 0;
};

MoeFinalizeShape check_moe_finalize(const at::Tensor& permuted_rows,
                                    const at::Tensor& expanded_to_permuted,
                                    const at::Tensor& token_final_scales, const char* op);

// clamp_limits of SwiGLUStep: float32 [E_local] on `like`'s device.
void check_clamp_limits(const at::Tensor& limits, int64_t num_local_experts, const at::Tensor& like, const char* op);

// moe_routing's inputs: exactly one of router_logits or (topk_ids and topk_weights). Returns the
// token count.
int64_t check_moe_routing(const c10::optional<at::Tensor>& logits, const c10::optional<at::Tensor>& topk_ids,
                          const c10::optional<at::Tensor>& topk_weights, int64_t top_k, int64_t num_experts,
                          const char* op);

// A caller-owned combine output: [num_tokens, hidden], permuted_rows' dtype and device, contiguous.
void check_moe_finalize_out(const at::Tensor& out, const MoeFinalizeShape& s, const at::Tensor& permuted_rows,
                            const char* op);

}  // namespace cake
