// The MoE pipeline ops written once with ATen ops and the grouped GEMM op, so they run on every
// backend without a host synchronisation (no value leaves the device). They define the
// semantics; fused Hopper kernels replace the CUDA registrations stage by stage (issue 4).
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

namespace cake {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_sort(
    const at::Tensor& token_selected_experts, int64_t num_experts, int64_t num_local_experts,
    int64_t local_expert_offset, int64_t tile_size);

at::Tensor moe_gemm1_swiglu(const at::Tensor& x, const at::Tensor& w1,
                            const at::Tensor& permuted_to_expanded, const at::Tensor& expert_offsets,
                            int64_t top_k);

at::Tensor moe_finalize(const at::Tensor& permuted_rows, const at::Tensor& expanded_to_permuted,
                        const at::Tensor& token_final_scales);

inline void register_moe_ops(torch::Library& m) {
  m.impl("moe_sort", &moe_sort);
  m.impl("moe_gemm1_swiglu", &moe_gemm1_swiglu);
  m.impl("moe_finalize", &moe_finalize);
}

}  // namespace cake
