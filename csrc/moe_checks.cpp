#include "moe_checks.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <limits>
#include <vector>

#include "grouped_gemm_checks.h"

namespace cake {

void check_moe_shard(int64_t num_experts, int64_t num_local_experts, int64_t local_expert_offset, int64_t tile_size,
                     const char* op) {
  TORCH_CHECK(num_experts > 0, op, ": num_experts must be positive, got ", num_experts);
  TORCH_CHECK(num_local_experts > 0 && num_local_experts <= num_experts, op,
              ": num_local_experts must be in [1, num_experts=", num_experts, "], got ", num_local_experts);
  TORCH_CHECK(local_expert_offset >= 0 && local_expert_offset + num_local_experts <= num_experts, op,
              ": the shard [local_expert_offset, local_expert_offset + num_local_experts) = [",
              local_expert_offset, ", ", local_expert_offset + num_local_experts,
              ") must lie within [0, num_experts=", num_experts, ")");
  TORCH_CHECK(tile_size > 0, op, ": tile_size must be positive, got ", tile_size);
}

MoeSortShape check_moe_sort(const at::Tensor& ids, int64_t num_experts, int64_t num_local_experts,
                            int64_t local_expert_offset, int64_t tile_size, const char* op) {
  TORCH_CHECK(ids.dim() == 2, op, ": token_selected_experts must be a 2-D [num_tokens, top_k] tensor, got shape ",
              ids.sizes());
  TORCH_CHECK(ids.scalar_type() == at::kInt, op, ": token_selected_experts must be int32, got ",
              ids.scalar_type());
  TORCH_CHECK(ids.is_contiguous(), op, ": token_selected_experts must be contiguous");
  check_moe_shard(num_experts, num_local_experts, local_expert_offset, tile_size, op);
  TORCH_CHECK(ids.size(0) * ids.size(1) < (int64_t{1} << 31), op,
              ": num_tokens * top_k must fit in int32, got ", ids.size(0) * ids.size(1));
  return {ids.size(0), ids.size(1), num_local_experts};
}

MoeGemm1Shape check_moe_gemm1(const at::Tensor& x, const at::Tensor& w1,
                              const at::Tensor& permuted_to_expanded,
                              const at::Tensor& expert_offsets, int64_t top_k, const char* op,
                              const c10::optional<at::Tensor>& expanded_to_permuted) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be a 2-D [num_tokens, hidden] tensor, got shape ", x.sizes());
  TORCH_CHECK(w1.dim() == 3 && w1.size(2) == x.size(1) && w1.size(1) % 64 == 0, op,
              ": w1 must be [E_local, 2I, hidden=", x.size(1), "] with I % 32 == 0, got shape ", w1.sizes());
  TORCH_CHECK(w1.scalar_type() == x.scalar_type() ||
                  (x.scalar_type() == at::kBFloat16 && w1.scalar_type() == at::kFloat8_e4m3fn),
              op, ": x and w1 must have the same dtype (or bfloat16 x with float8_e4m3fn w1), got ", x.scalar_type(),
              " and ", w1.scalar_type());
  TORCH_CHECK(w1.device() == x.device() && permuted_to_expanded.device() == x.device() &&
                  expert_offsets.device() == x.device(),
              op, ": all tensors must be on x's device ", x.device());
  TORCH_CHECK(top_k > 0, op, ": top_k must be positive, got ", top_k);
  TORCH_CHECK(permuted_to_expanded.dim() == 1 && permuted_to_expanded.size(0) == x.size(0) * top_k &&
                  permuted_to_expanded.scalar_type() == at::kInt,
              op, ": permuted_to_expanded must be int32 [num_tokens * top_k] = [", x.size(0) * top_k,
              "], got ", permuted_to_expanded.scalar_type(), " ", permuted_to_expanded.sizes());
  TORCH_CHECK(expert_offsets.dim() == 1 && expert_offsets.size(0) == w1.size(0) + 1 &&
                  expert_offsets.scalar_type() == at::kInt,
              op, ": expert_offsets must be int32 [E_local + 1] = [", w1.size(0) + 1, "], got ",
              expert_offsets.scalar_type(), " ", expert_offsets.sizes());
  if (expanded_to_permuted) {
    const auto& e2p = *expanded_to_permuted;
    TORCH_CHECK(e2p.dim() == 1 && e2p.size(0) == permuted_to_expanded.size(0) && e2p.scalar_type() == at::kInt &&
                    e2p.device() == x.device(),
                op, ": expanded_to_permuted must be int32 [num_tokens * top_k] = [", permuted_to_expanded.size(0),
                "] on ", x.device(), " (moe_sort's), got ", e2p.scalar_type(), " ", e2p.sizes(), " on ", e2p.device());
  }
  return {permuted_to_expanded.size(0), w1.size(1) / 2};
}

int64_t check_swiglu(const at::Tensor& gate_up, const char* op) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, op,
              ": gate_up must be 2-D [rows, 2I] ([gate | up] halves), got shape ", gate_up.sizes());
  TORCH_CHECK(at::isFloatingType(gate_up.scalar_type()) && gate_up.element_size() >= 2, op,
              ": gate_up must be bfloat16, float16, float32 or float64, got ", gate_up.scalar_type());
  return gate_up.size(1) / 2;
}

float check_swiglu_limit(const std::optional<double>& limit, const char* op) {
  if (!limit.has_value()) return std::numeric_limits<float>::infinity();
  TORCH_CHECK(*limit > 0, op, ": limit must be positive (the clamp of silu(min(gate, limit)) * clamp(up, -limit, "
              "limit)), got ", *limit);
  return static_cast<float>(*limit);
}

void check_swiglu_grad(const at::Tensor& grad_out, const at::Tensor& gate_up, int64_t inter, const char* op) {
  TORCH_CHECK(grad_out.dim() == 2 && grad_out.size(0) == gate_up.size(0) && grad_out.size(1) == inter, op,
              ": grad_out must be [rows, I] = [", gate_up.size(0), ", ", inter, "], got shape ", grad_out.sizes());
  TORCH_CHECK(grad_out.scalar_type() == gate_up.scalar_type() && grad_out.device() == gate_up.device(), op,
              ": grad_out must have gate_up's dtype and device (", gate_up.scalar_type(), " on ", gate_up.device(),
              "), got ", grad_out.scalar_type(), " on ", grad_out.device());
}

MoeFinalizeShape check_moe_finalize(const at::Tensor& rows, const at::Tensor& expanded_to_permuted,
                                    const at::Tensor& token_final_scales, const char* op, const char* rows_name) {
  TORCH_CHECK(rows.dim() == 2, op, ": ", rows_name, " must be 2-D [rows, hidden], got shape ", rows.sizes());
  TORCH_CHECK(token_final_scales.dim() == 2 && token_final_scales.scalar_type() == at::kFloat, op,
              ": token_final_scales must be float32 [num_tokens, top_k], got ",
              token_final_scales.scalar_type(), " ", token_final_scales.sizes());
  const int64_t tokens = token_final_scales.size(0), top_k = token_final_scales.size(1);
  TORCH_CHECK(expanded_to_permuted.dim() == 1 && expanded_to_permuted.size(0) == tokens * top_k &&
                  expanded_to_permuted.scalar_type() == at::kInt,
              op, ": expanded_to_permuted must be int32 [num_tokens * top_k] = [", tokens * top_k, "], got ",
              expanded_to_permuted.scalar_type(), " ", expanded_to_permuted.sizes());
  TORCH_CHECK(expanded_to_permuted.device() == rows.device() && token_final_scales.device() == rows.device(), op,
              ": all tensors must be on ", rows_name, "'s device ", rows.device());
  return {tokens, top_k, rows.size(1)};
}

MoeFinalizeShape check_moe_finalize_backward(const at::Tensor& grad_output, const at::Tensor& expanded_to_permuted,
                                             const at::Tensor& token_final_scales, int64_t num_rows,
                                             const c10::optional<at::Tensor>& permuted_rows, const char* op) {
  TORCH_CHECK(num_rows >= 0, op, ": num_rows must be >= 0, got ", num_rows);
  const auto s = check_moe_finalize(grad_output, expanded_to_permuted, token_final_scales, op, "grad_output");
  TORCH_CHECK(grad_output.size(0) == s.num_tokens, op, ": grad_output must have num_tokens = ", s.num_tokens,
              " rows (token_final_scales is ", token_final_scales.sizes(), "), got ", grad_output.sizes());
  if (permuted_rows.has_value()) {
    const auto& rows = *permuted_rows;
    TORCH_CHECK(rows.dim() == 2 && rows.size(0) == num_rows && rows.size(1) == s.hidden &&
                    rows.scalar_type() == grad_output.scalar_type() && rows.device() == grad_output.device(),
                op, ": permuted_rows must be [num_rows, hidden] = [", num_rows, ", ", s.hidden, "] ",
                grad_output.scalar_type(), " on ", grad_output.device(), " (grad_output's dtype and device), got ",
                rows.scalar_type(), " ", rows.sizes(), " on ", rows.device());
  }
  return s;
}

MoeGemm1Workspace moe_gemm1_workspace(int64_t rows, int64_t hidden, int64_t intermediate, int64_t num_local_experts,
                                      int64_t element_size) {
  auto align = [](int64_t bytes) { return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; };
  MoeGemm1Workspace w;
  w.gathered_bytes = rows * hidden * element_size;
  w.h_offset = align(w.gathered_bytes);
  w.h_bytes = rows * 2 * intermediate * 2;  // 16-bit
  w.gemm_offset = w.h_offset + align(w.h_bytes);
  w.gemm_bytes = grouped_gemm_workspace_bytes(num_local_experts);
  w.scale_offset = w.gemm_offset + align(w.gemm_bytes);
  w.inverse_offset = w.scale_offset + align(2 * sizeof(float));  // the gather's [rows + 1] int32 scratch
  w.total = w.inverse_offset + (rows + 1) * int64_t(sizeof(int32_t));
  return w;
}

GroupedGemmShape check_moe_gemm2_out(const at::Tensor& intermediate, const at::Tensor& w2,
                                     const at::Tensor& expert_offsets, const at::Tensor& out,
                                     const at::Tensor& workspace, const char* op) {
  const auto s = check_fwd(intermediate, w2, expert_offsets, op, /*allow_e4m3=*/true);
  check_out(out, {s.sum_m, s.n}, moe_gemm_out_dtype(intermediate), intermediate, op);
  const int64_t need = grouped_gemm_workspace_bytes(s.num_groups);
  TORCH_CHECK(workspace.scalar_type() == at::kByte && workspace.dim() == 1 && workspace.is_contiguous() &&
                  (workspace.numel() == 0 || (workspace.numel() >= need && workspace.device() == intermediate.device())),
              op, ": workspace must be a contiguous uint8 tensor of at least ", need, " bytes on ",
              intermediate.device(), " (cake_ops._C.grouped_gemm_workspace_size), or empty, got ",
              workspace.scalar_type(), " ", workspace.sizes(), " on ", workspace.device());
  return s;
}

namespace {

void check_activation_scale(const at::Tensor& scale, const at::Tensor& a, const char* a_name, const char* op) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1 && scale.device() == a.device(), op,
              ": the ", a_name, " scale must be one float32 value on ", a.device(), ", got ", scale.scalar_type(), " ",
              scale.sizes(), " on ", scale.device());
}

void check_weight_scales(const at::Tensor& w_scale, int64_t num_local_experts, const at::Tensor& a, const char* op) {
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.dim() == 1 && w_scale.size(0) == num_local_experts &&
                  w_scale.device() == a.device(),
              op, ": the weight scales must be float32 [E_local] = [", num_local_experts, "] on ", a.device(),
              ", got ", w_scale.scalar_type(), " ", w_scale.sizes(), " on ", w_scale.device());
}

}  // namespace

bool check_moe_gemm_scales(const at::Tensor& a, const c10::optional<at::Tensor>& a_scale,
                           const c10::optional<at::Tensor>& w_scale, int64_t num_local_experts, const char* a_name,
                           const char* op) {
  const bool fp8 = a.scalar_type() == at::kFloat8_e4m3fn;
  if (!fp8) {
    TORCH_CHECK(!a_scale && !w_scale, op, ": scales apply to float8_e4m3fn ", a_name, " and weights only, got ",
                a.scalar_type());
    return false;
  }
  TORCH_CHECK(a_scale && w_scale, op, ": float8_e4m3fn ", a_name, " and weights need their scales (a per-tensor ",
              a_name, " scale and one weight scale per local expert)");
  check_activation_scale(*a_scale, a, a_name, op);
  check_weight_scales(*w_scale, num_local_experts, a, op);
  return true;
}

MoeGemmInput check_moe_gemm_input(const at::Tensor& a, const c10::optional<at::Tensor>& a_scale, const at::Tensor& w,
                                  const c10::optional<at::Tensor>& w_scale, const char* a_name, const char* w_name,
                                  const char* op) {
  if (a.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kFloat8_e4m3fn) {
    TORCH_CHECK(w_scale, op, ": float8_e4m3fn ", w_name, " needs its scales (one per local expert)");
    check_weight_scales(*w_scale, w.size(0), a, op);
    if (a_scale) check_activation_scale(*a_scale, a, a_name, op);
    return MoeGemmInput::kQuantizeA;
  }
  return check_moe_gemm_scales(a, a_scale, w_scale, w.size(0), a_name, op) ? MoeGemmInput::kFp8
                                                                           : MoeGemmInput::k16Bit;
}

at::ScalarType moe_gemm_out_dtype(const at::Tensor& a) {
  return a.scalar_type() == at::kFloat8_e4m3fn ? at::kBFloat16 : a.scalar_type();
}

void check_quantize_fp8(const at::Tensor& x, const c10::optional<at::Tensor>& scale, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf || x.scalar_type() == at::kFloat, op,
              ": x must be bfloat16, float16 or float32, got ", x.scalar_type());
  if (scale) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->numel() == 1 && scale->device() == x.device(), op,
                ": scale must be one float32 value on ", x.device(), " (or None for a dynamic scale), got ",
                scale->scalar_type(), " ", scale->sizes(), " on ", scale->device());
  }
}

void check_quantize_fp8_out(const at::Tensor& x, const at::Tensor& out, const at::Tensor& scale_out, const char* op) {
  TORCH_CHECK(out.scalar_type() == at::kFloat8_e4m3fn && out.sizes() == x.sizes() && out.is_contiguous() &&
                  out.device() == x.device(),
              op, ": out must be a contiguous float8_e4m3fn tensor of x's shape ", x.sizes(), " on ", x.device(),
              ", got ", out.scalar_type(), " ", out.sizes(), " on ", out.device());
  TORCH_CHECK(scale_out.scalar_type() == at::kFloat && scale_out.numel() == 1 && scale_out.device() == x.device(), op,
              ": scale_out must be one float32 value on ", x.device(), ", got ", scale_out.scalar_type(), " ",
              scale_out.sizes(), " on ", scale_out.device());
}

void check_clamp_limits(const at::Tensor& limits, int64_t num_local_experts, const at::Tensor& like, const char* op) {
  TORCH_CHECK(limits.dim() == 1 && limits.size(0) == num_local_experts && limits.scalar_type() == at::kFloat, op,
              ": clamp_limits must be float32 [E_local] = [", num_local_experts, "], got ", limits.scalar_type(), " ",
              limits.sizes());
  TORCH_CHECK(limits.device() == like.device(), op, ": clamp_limits must be on ", like.device(), ", got ",
              limits.device());
}

int64_t check_expected_routes(int64_t expected_routes, const char* op) {
  TORCH_CHECK(expected_routes >= -1, op, ": expected_routes must be -1 (every row) or a route count >= 0, got ",
              expected_routes);
  return expected_routes;
}

namespace {

// check_moe_routing's inputs; returns the token count.
int64_t check_routing_inputs(const c10::optional<at::Tensor>& logits, const c10::optional<at::Tensor>& topk_ids,
                             const c10::optional<at::Tensor>& topk_weights, int64_t top_k, int64_t num_experts,
                             const char* op) {
  const bool from_logits = logits.has_value();
  const bool precomputed = topk_ids.has_value() || topk_weights.has_value();
  TORCH_CHECK(from_logits != precomputed, op,
              ": give either router_logits (FromLogits) or topk_ids and topk_weights (UnpackedPrecomputed), got ",
              from_logits ? "router_logits" : "neither", precomputed ? " and precomputed top-k" : "");
  TORCH_CHECK(top_k >= 1 && top_k <= num_experts, op, ": top_k must be in [1, num_experts=", num_experts, "], got ",
              top_k);
  if (from_logits) {
    const auto& l = *logits;
    TORCH_CHECK(l.dim() == 2 && l.size(1) == num_experts, op, ": router_logits must be [num_tokens, num_experts=",
                num_experts, "], got shape ", l.sizes());
    TORCH_CHECK(l.scalar_type() == at::kFloat || l.scalar_type() == at::kBFloat16 || l.scalar_type() == at::kHalf,
                op, ": router_logits must be float32, bfloat16 or float16, got ", l.scalar_type());
    return l.size(0);
  }
  TORCH_CHECK(topk_ids.has_value() && topk_weights.has_value(), op,
              ": UnpackedPrecomputed routing needs both topk_ids and topk_weights");
  const auto& ids = *topk_ids;
  const auto& w = *topk_weights;
  TORCH_CHECK(ids.dim() == 2 && ids.size(1) == top_k && ids.scalar_type() == at::kInt, op,
              ": topk_ids must be int32 [num_tokens, top_k=", top_k, "], got ", ids.scalar_type(), " ", ids.sizes());
  TORCH_CHECK(w.dim() == 2 && w.sizes() == ids.sizes() && w.scalar_type() == at::kFloat, op,
              ": topk_weights must be float32 with topk_ids' shape ", ids.sizes(), ", got ", w.scalar_type(), " ",
              w.sizes());
  TORCH_CHECK(w.device() == ids.device(), op, ": topk_ids and topk_weights must be on one device, got ", ids.device(),
              " and ", w.device());
  return ids.size(0);
}

}  // namespace

int64_t check_moe_routing(const c10::optional<at::Tensor>& logits, const c10::optional<at::Tensor>& topk_ids,
                          const c10::optional<at::Tensor>& topk_weights, int64_t top_k, int64_t num_experts,
                          int64_t num_local_experts, int64_t local_expert_offset, int64_t tile_size, const char* op) {
  const int64_t tokens = check_routing_inputs(logits, topk_ids, topk_weights, top_k, num_experts, op);
  check_moe_shard(num_experts, num_local_experts, local_expert_offset, tile_size, op);
  return tokens;
}

void check_moe_routing_out(const c10::optional<at::Tensor>& logits, const c10::optional<at::Tensor>& topk_ids,
                           const c10::optional<at::Tensor>& topk_weights, int64_t top_k, int64_t num_experts,
                           int64_t num_local_experts, int64_t local_expert_offset, int64_t tile_size,
                           const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& counts,
                           const at::Tensor& offsets, const at::Tensor& permuted_to_expanded,
                           const at::Tensor& expanded_to_permuted, const at::Tensor& tile_offsets,
                           const at::Tensor& workspace, const char* op) {
  const int64_t tokens = check_moe_routing(logits, topk_ids, topk_weights, top_k, num_experts, num_local_experts,
                                           local_expert_offset, tile_size, op);
  const at::Tensor& like = logits ? *logits : *topk_ids;
  const struct {
    const at::Tensor& t;
    const char* name;
    std::vector<int64_t> shape;
    at::ScalarType dtype;
  } outs[] = {{ids, "expert_ids", {tokens, top_k}, at::kInt},
              {weights, "expert_weights", {tokens, top_k}, at::kFloat},
              {counts, "expert_counts", {num_local_experts}, at::kInt},
              {offsets, "expert_offsets", {num_local_experts + 1}, at::kInt},
              {permuted_to_expanded, "permuted_to_expanded", {tokens * top_k}, at::kInt},
              {expanded_to_permuted, "expanded_to_permuted", {tokens * top_k}, at::kInt},
              {tile_offsets, "expert_tile_offsets", {num_local_experts + 1}, at::kInt}};
  for (const auto& o : outs) {
    TORCH_CHECK(o.t.sizes() == at::IntArrayRef(o.shape) && o.t.scalar_type() == o.dtype && o.t.is_contiguous() &&
                    o.t.device() == like.device(),
                op, ": ", o.name, " must be a contiguous ", o.dtype, " tensor of shape ", at::IntArrayRef(o.shape),
                " on ", like.device(), ", got ", o.t.scalar_type(), " ", o.t.sizes(), " on ", o.t.device());
  }
  const int64_t need = moe_routing_workspace_bytes(tokens * top_k, num_local_experts);
  TORCH_CHECK(workspace.scalar_type() == at::kByte && workspace.dim() == 1 && workspace.numel() >= need &&
                  workspace.is_contiguous() && workspace.device() == like.device(),
              op, ": workspace must be a contiguous uint8 tensor of at least ", need, " bytes on ", like.device(),
              " (cake_ops._C.moe_routing_workspace_size), got ", workspace.scalar_type(), " ", workspace.sizes());
}

void check_moe_finalize_out(const at::Tensor& out, const MoeFinalizeShape& s, const at::Tensor& permuted_rows,
                            const char* op) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == s.num_tokens && out.size(1) == s.hidden, op,
              ": out must have shape [num_tokens, hidden] = [", s.num_tokens, ", ", s.hidden, "], got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == permuted_rows.scalar_type(), op, ": out must have permuted_rows' dtype ",
              permuted_rows.scalar_type(), ", got ", out.scalar_type());
  TORCH_CHECK(out.device() == permuted_rows.device(), op, ": out must be on permuted_rows' device ",
              permuted_rows.device(), ", got ", out.device());
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
}

MoeGemm2FinalizeShape check_moe_gemm2_finalize_out(const at::Tensor& intermediate, const at::Tensor& w2,
                                                   const at::Tensor& expert_offsets,
                                                   const at::Tensor& permuted_to_expanded,
                                                   const at::Tensor& expanded_to_permuted,
                                                   const at::Tensor& token_final_scales, const at::Tensor& out,
                                                   const char* op) {
  const auto gemm = check_fwd(intermediate, w2, expert_offsets, op, /*allow_e4m3=*/false);
  TORCH_CHECK(intermediate.scalar_type() == at::kBFloat16 || intermediate.scalar_type() == at::kHalf, op,
              ": the fused finalize takes bfloat16 or float16 operands, got ", intermediate.scalar_type());
  auto fin = check_moe_finalize(intermediate, expanded_to_permuted, token_final_scales, op);
  fin.hidden = gemm.n;
  TORCH_CHECK(fin.num_tokens * fin.top_k == gemm.sum_m, op, ": intermediate must have num_tokens * top_k = ",
              fin.num_tokens * fin.top_k, " rows (token_final_scales is ", token_final_scales.sizes(), "), got ",
              gemm.sum_m);
  TORCH_CHECK(permuted_to_expanded.dim() == 1 && permuted_to_expanded.size(0) == gemm.sum_m &&
                  permuted_to_expanded.scalar_type() == at::kInt && permuted_to_expanded.device() == out.device(),
              op, ": permuted_to_expanded must be int32 [num_tokens * top_k] = [", gemm.sum_m, "] on ", out.device(),
              ", got ", permuted_to_expanded.scalar_type(), " ", permuted_to_expanded.sizes(), " on ",
              permuted_to_expanded.device());
  check_moe_finalize_out(out, fin, intermediate, op);
  return {gemm, fin};
}

MoeForwardShape check_moe_forward_out(const at::Tensor& x, const at::Tensor& token_selected_experts,
                                      const at::Tensor& token_final_scales, const at::Tensor& w1, const at::Tensor& w2,
                                      int64_t local_expert_offset, const at::Tensor& out,
                                      const at::Tensor& workspace, const c10::optional<at::Tensor>& clamp_limits,
                                      const c10::optional<at::Tensor>& x_scale,
                                      const c10::optional<at::Tensor>& w1_scale,
                                      const c10::optional<at::Tensor>& fc2_scale,
                                      const c10::optional<at::Tensor>& w2_scale, const char* op) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be a 2-D [num_tokens, hidden] tensor, got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, op,
              ": x must be bfloat16 or float16, got ", x.scalar_type());
  MoeForwardShape s;
  s.num_tokens = x.size(0);
  s.hidden = x.size(1);
  const auto& ids = token_selected_experts;
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == s.num_tokens && ids.size(1) >= 1, op,
              ": token_selected_experts must be [num_tokens = ", s.num_tokens, ", top_k >= 1], got ", ids.sizes());
  s.top_k = ids.size(1);
  TORCH_CHECK(ids.scalar_type() == at::kInt, op, ": token_selected_experts must be int32, got ", ids.scalar_type());
  TORCH_CHECK(token_final_scales.sizes() == ids.sizes() && token_final_scales.scalar_type() == at::kFloat, op,
              ": token_final_scales must be float32 ", ids.sizes(), ", got ", token_final_scales.scalar_type(), " ",
              token_final_scales.sizes());
  TORCH_CHECK(w1.dim() == 3 && w1.size(0) >= 1 && w1.size(1) % 2 == 0 && w1.size(1) >= 2 && w1.size(2) == s.hidden, op,
              ": w1 must be [E_local >= 1, 2I, hidden = ", s.hidden, "] with 2I even, got ", w1.sizes());
  s.num_local_experts = w1.size(0);
  s.intermediate = w1.size(1) / 2;
  TORCH_CHECK(w2.dim() == 3 && w2.size(0) == s.num_local_experts && w2.size(1) == s.hidden &&
                  w2.size(2) == s.intermediate,
              op, ": w2 must be [E_local, hidden, I] = [", s.num_local_experts, ", ", s.hidden, ", ",
              s.intermediate, "], got ", w2.sizes());
  TORCH_CHECK(w2.scalar_type() == w1.scalar_type(), op, ": w2 must have w1's dtype ", w1.scalar_type(), ", got ",
              w2.scalar_type());
  TORCH_CHECK(local_expert_offset >= 0, op, ": local_expert_offset must be >= 0, got ", local_expert_offset);
  for (const auto* t : {&ids, &token_final_scales, &w1, &w2, &out, &workspace}) {
    TORCH_CHECK(t->device() == x.device(), op, ": every tensor must be on x's device ", x.device(), ", got one on ",
                t->device());
  }
  TORCH_CHECK(w1.is_contiguous() && w2.is_contiguous(), op, ": w1 and w2 must be contiguous");
  const auto input = check_moe_gemm_input(x, x_scale, w1, w1_scale, "x", "w1", op);
  TORCH_CHECK(input != MoeGemmInput::kFp8, op, ": x must be 16-bit (internal)");
  if (input == MoeGemmInput::k16Bit) {
    TORCH_CHECK(w1.scalar_type() == x.scalar_type(), op, ": w1 must have x's dtype ", x.scalar_type(), " (or be ",
                "float8_e4m3fn with bfloat16 x), got ", w1.scalar_type());
  }
  // GEMM2's activations are GEMM1's output: x's dtype (bfloat16 on the fp8 path), quantized likewise.
  check_moe_gemm_input(x, fc2_scale, w2, w2_scale, "fc2_scale's activations", "w2", op);
  s.fp8 = input == MoeGemmInput::kQuantizeA;
  if (clamp_limits) check_clamp_limits(*clamp_limits, s.num_local_experts, x, op);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == s.num_tokens && out.size(1) == s.hidden, op,
              ": out must have shape [num_tokens, hidden] = [", s.num_tokens, ", ", s.hidden, "], got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), op, ": out must have x's dtype ", x.scalar_type(), ", got ",
              out.scalar_type());
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  const int64_t bytes = moe_forward_workspace_bytes(s.num_tokens * s.top_k, s.hidden, s.intermediate);
  TORCH_CHECK(workspace.scalar_type() == at::kByte && workspace.dim() == 1 &&
                  (workspace.numel() == 0 || workspace.numel() >= bytes) && workspace.device() == x.device() &&
                  workspace.is_contiguous(),
              op, ": workspace must be a contiguous uint8 tensor of 0 or at least ", bytes, " bytes on ", x.device(),
              ", got ", workspace.scalar_type(), " ", workspace.sizes(), " on ", workspace.device());
  return s;
}

MoeForwardShape check_moe_forward_from_logits_out(
    const at::Tensor& x, const at::Tensor& router_logits, const at::Tensor& w1, const at::Tensor& w2,
    int64_t local_expert_offset, const at::Tensor& token_selected_experts, const at::Tensor& token_final_scales,
    const at::Tensor& out, const at::Tensor& workspace, const c10::optional<at::Tensor>& clamp_limits,
    const c10::optional<at::Tensor>& x_scale, const c10::optional<at::Tensor>& w1_scale,
    const c10::optional<at::Tensor>& fc2_scale, const c10::optional<at::Tensor>& w2_scale, const char* op) {
  const auto s = check_moe_forward_out(x, token_selected_experts, token_final_scales, w1, w2, local_expert_offset, out,
                                       workspace, clamp_limits, x_scale, w1_scale, fc2_scale, w2_scale, op);
  TORCH_CHECK(router_logits.dim() == 2 && router_logits.size(0) == s.num_tokens, op,
              ": router_logits must be [num_tokens = ", s.num_tokens, ", num_experts], got shape ",
              router_logits.sizes());
  TORCH_CHECK(router_logits.device() == x.device(), op, ": router_logits must be on x's device ", x.device(),
              ", got ", router_logits.device());
  check_moe_routing(router_logits, c10::nullopt, c10::nullopt, s.top_k, router_logits.size(1), s.num_local_experts,
                    local_expert_offset, /*tile_size=*/64, op);
  TORCH_CHECK(token_selected_experts.is_contiguous() && token_final_scales.is_contiguous(), op,
              ": token_selected_experts and token_final_scales (the routing's outputs) must be contiguous");
  return s;
}

}  // namespace cake
