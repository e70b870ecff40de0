// The MoE pipeline ops written with ATen ops and the grouped GEMM op: the CPU implementations,
// which define the semantics (enable_pdl has no meaning there). The CUDA kernels are in
// cuda/moe/moe_cuda.cpp.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace cake {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_sort(
    const at::Tensor& token_selected_experts, int64_t num_experts, int64_t num_local_experts,
    int64_t local_expert_offset, int64_t tile_size);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_routing(
    const c10::optional<at::Tensor>& router_logits, const c10::optional<at::Tensor>& topk_ids,
    const c10::optional<at::Tensor>& topk_weights, int64_t top_k, int64_t num_experts, int64_t num_local_experts,
    int64_t local_expert_offset, int64_t tile_size);

at::Tensor moe_gemm1_swiglu(const at::Tensor& x, const at::Tensor& w1,
                            const at::Tensor& permuted_to_expanded, const at::Tensor& expert_offsets,
                            int64_t top_k, bool enable_pdl, const c10::optional<at::Tensor>& clamp_limits,
                            int64_t tactic, const c10::optional<at::Tensor>& x_scale,
                            const c10::optional<at::Tensor>& w1_scale, int64_t expected_routes, bool zero_tail,
                            const c10::optional<at::Tensor>& expanded_to_permuted, bool w1_gate_up);

at::Tensor moe_gemm2(const at::Tensor& intermediate, const at::Tensor& w2, const at::Tensor& expert_offsets,
                     bool enable_pdl, int64_t tactic, const c10::optional<at::Tensor>& a_scale,
                     const c10::optional<at::Tensor>& w2_scale, int64_t expected_routes);

at::Tensor moe_finalize(const at::Tensor& permuted_rows, const at::Tensor& expanded_to_permuted,
                        const at::Tensor& token_final_scales, bool enable_pdl);

std::tuple<at::Tensor, at::Tensor> moe_finalize_backward(const at::Tensor& grad_output,
                                                         const at::Tensor& expanded_to_permuted,
                                                         const at::Tensor& token_final_scales, int64_t num_rows,
                                                         const c10::optional<at::Tensor>& permuted_rows);
at::Tensor swiglu(const at::Tensor& gate_up, std::optional<double> limit);
at::Tensor swiglu_backward(const at::Tensor& grad_out, const at::Tensor& gate_up, std::optional<double> limit);

void moe_finalize_out(const at::Tensor& permuted_rows, const at::Tensor& expanded_to_permuted,
                      const at::Tensor& token_final_scales, at::Tensor out, bool enable_pdl);

void moe_gemm2_finalize_out(const at::Tensor& intermediate, const at::Tensor& w2, const at::Tensor& expert_offsets,
                            const at::Tensor& permuted_to_expanded, const at::Tensor& expanded_to_permuted,
                            const at::Tensor& token_final_scales, at::Tensor out, bool enable_pdl, int64_t tactic,
                            int64_t expected_routes);

void moe_forward_out(const at::Tensor& x, const at::Tensor& token_selected_experts,
                     const at::Tensor& token_final_scales, const at::Tensor& w1, const at::Tensor& w2,
                     int64_t local_expert_offset, at::Tensor out, at::Tensor workspace, bool enable_pdl,
                     const c10::optional<at::Tensor>& clamp_limits, const c10::optional<at::Tensor>& x_scale,
                     const c10::optional<at::Tensor>& w1_scale, const c10::optional<at::Tensor>& fc2_scale,
                     const c10::optional<at::Tensor>& w2_scale, int64_t expected_routes, bool w1_gate_up);

}  // namespace cake
