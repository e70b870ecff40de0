#include "moe/moe_ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <limits>

#include "grouped_gemm_checks.h"
#include "moe_checks.h"

namespace cake {
namespace {

// GEMM1 and GEMM2 of the ATen implementation run the grouped GEMM op of the tensors' backend.
const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>&
grouped_gemm_fwd_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("cake::grouped_gemm_fwd", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op;
}

// The local expert of each of `rows` permuted rows: the number of expert ends at or before it
// (rows past the last end: the last expert, whose scale or limit then meets a zero row).
at::Tensor row_experts(const at::Tensor& expert_offsets, int64_t rows) {
  const auto ends = expert_offsets.slice(0, 1).to(at::kLong).contiguous();
  return at::searchsorted(ends, at::arange(rows, ends.options()), /*out_int32=*/false, /*right=*/true)
      .clamp_max(ends.size(0) - 1);
}

// The CPU reads index values on the host, so it raises what the CUDA kernels stop on with a
// device-side assert (the same words): indices out of range, expert offsets out of order.
void check_index_range(const at::Tensor& indices, int64_t lowest, int64_t limit, const char* what, const char* op) {
  if (indices.numel() == 0) return;
  const auto [lo, hi] = at::aminmax(indices);
  const int64_t min = lo.item<int64_t>(), max = hi.item<int64_t>();
  TORCH_CHECK(min >= lowest && max < limit, op, ": ", what, " = ", limit, ", got values in [", min, ", ", max, "]");
}

void check_finalize_indices(const at::Tensor& expanded_to_permuted, const at::Tensor& permuted_rows, const char* op) {
  check_index_range(expanded_to_permuted, -1, permuted_rows.size(0),
                    "expanded_to_permuted must hold -1 or row indices below permuted_rows.size(0)", op);
}

// m_indptr [E + 1] over `rows` permuted rows, checked; returns the rows the experts hold (its last end).
int64_t check_expert_offsets(const at::Tensor& expert_offsets, int64_t rows, const char* op) {
  GroupedGemmShape shape;
  shape.num_groups = expert_offsets.size(0) - 1;
  shape.sum_m = rows;
  shape.indptr = true;
  return host_group_bounds(expert_offsets, shape, op).back();
}

// moe_finalize's combine on checked arguments.
at::Tensor combine_routes(const at::Tensor& permuted_rows, const at::Tensor& expanded_to_permuted,
                          const at::Tensor& token_final_scales, const MoeFinalizeShape& s) {
  const auto rows = permuted_rows.index_select(0, expanded_to_permuted.clamp_min(0).to(at::kLong))
                        .to(at::kFloat)
                        .view({s.num_tokens, s.top_k, s.hidden});
  const auto kept = expanded_to_permuted.view({s.num_tokens, s.top_k}) >= 0;
  const auto scales = at::where(kept, token_final_scales, at::zeros_like(token_final_scales));
  // One fp32 sum over the k routes of a token, in a fixed order: bitwise reproducible.
  return (rows * scales.unsqueeze(-1)).sum(1).to(permuted_rows.scalar_type());
}

// A MoE GEMM's grouped GEMM, dequantize-then-multiply for fp8: the e4m3 values exactly in
// float32, the product of expert e scaled by a_scale * w_scale[e] in float32, rounded to
// bfloat16 (the CUDA kernels' epilogue).
at::Tensor moe_gemm(const at::Tensor& a, const at::Tensor& w, const at::Tensor& expert_offsets, bool fp8,
                    const c10::optional<at::Tensor>& a_scale, const c10::optional<at::Tensor>& w_scale) {
  if (!fp8) return grouped_gemm_fwd_op().call(a, w, expert_offsets);
  const auto product = grouped_gemm_fwd_op().call(a.to(at::kFloat), w.to(at::kFloat), expert_offsets);
  const auto alpha = a_scale->reshape({}) * *w_scale;
  return (product * alpha.index_select(0, row_experts(expert_offsets, a.size(0))).unsqueeze(1)).to(at::kBFloat16);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_fp8(const at::Tensor& x, const c10::optional<at::Tensor>& scale) {
  check_quantize_fp8(x, scale, "cake::quantize_fp8");
  const auto xf = x.to(at::kFloat);
  const auto used = scale ? scale->reshape({1}).clone()
                          : (x.numel() == 0 ? at::zeros({1}, xf.options()) : xf.abs().amax().reshape({1}))
                                    .clamp_min(kFp8MinAmax)
                                    .div(kE4m3Max);
  return {(xf / used).clamp(-kE4m3Max, kE4m3Max).to(at::kFloat8_e4m3fn), used};
}

void quantize_fp8_out(const at::Tensor& x, const c10::optional<at::Tensor>& scale, at::Tensor out,
                      at::Tensor scale_out) {
  check_quantize_fp8_out(x, out, scale_out, "cake::quantize_fp8_out");
  auto [q, used] = quantize_fp8(x, scale);
  out.copy_(q);
  scale_out.copy_(used.reshape(scale_out.sizes()));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_sort(
    const at::Tensor& ids, int64_t num_experts, int64_t num_local_experts,
    int64_t local_expert_offset, int64_t tile_size) {
  const auto s = check_moe_sort(ids, num_experts, num_local_experts, local_expert_offset, tile_size,
                                "cake::moe_sort");
  const int64_t routes = s.num_tokens * s.top_k;
  const auto flat = ids.reshape({routes}).to(at::kLong);
  const auto local = flat - local_expert_offset;
  const auto kept = (flat >= 0) & (flat < num_experts) & (local >= 0) & (local < num_local_experts);
  // Dropped routes sort after every local expert; a stable sort keeps expanded order per expert.
  const auto key = at::where(kept, local, at::full_like(local, num_local_experts));
  const auto order = std::get<1>(at::sort(key, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  auto counts = at::zeros({num_local_experts + 1}, flat.options()).index_add_(0, key, at::ones_like(key));
  counts = counts.slice(0, 0, num_local_experts);
  const auto zero = at::zeros({1}, flat.options());
  const auto offsets = at::cat({zero, counts.cumsum(0)});
  const auto positions = at::arange(routes, flat.options());
  const auto permuted_to_expanded =
      at::where(positions < offsets.select(0, num_local_experts), order, at::full_like(order, -1));
  const auto expanded_to_permuted =
      at::where(kept, at::empty_like(positions).scatter_(0, order, positions), at::full_like(positions, -1));
  const auto tile_offsets = at::cat({zero, at::floor_divide(counts + (tile_size - 1), tile_size).cumsum(0)});
  return {counts.to(at::kInt), offsets.to(at::kInt), permuted_to_expanded.to(at::kInt),
          expanded_to_permuted.to(at::kInt), tile_offsets.to(at::kInt)};
}

namespace {

// GEMM1 on the CPU, every check named after `op`; with `out`, also out's and the workspace's (moe_gemm1_swiglu_out).
at::Tensor gemm1_swiglu(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& permuted_to_expanded,
                        const at::Tensor& expert_offsets, int64_t top_k, const c10::optional<at::Tensor>& clamp_limits,
                        const c10::optional<at::Tensor>& x_scale, const c10::optional<at::Tensor>& w1_scale,
                        int64_t expected_routes,
                        const c10::optional<at::Tensor>& expanded_to_permuted /*checked; the CPU needs none*/,
                        bool w1_gate_up, const at::Tensor* out, const at::Tensor* workspace, const char* op) {
  const auto s = check_moe_gemm1(x, w1, permuted_to_expanded, expert_offsets, top_k, op, expanded_to_permuted);
  const int64_t routed_rows = check_expert_offsets(expert_offsets, s.rows, op);
  check_index_range(permuted_to_expanded.slice(0, 0, routed_rows), 0, x.size(0) * top_k,
                    "permuted_to_expanded must hold route indices in [0, num_tokens * top_k) for the rows below "
                    "expert_offsets[E]; num_tokens * top_k", op);
  check_expected_routes(expected_routes, op);
  const auto input = check_moe_gemm_input(x, x_scale, w1, w1_scale, "x", "w1", op);
  if (clamp_limits) check_clamp_limits(*clamp_limits, w1.size(0), x, op);
  if (out != nullptr) {
    check_out(*out, {s.rows, s.intermediate}, moe_gemm_out_dtype(x), x, op);
    const int64_t need = moe_gemm1_workspace_bytes(s.rows, x.size(1), s.intermediate, w1.size(0), w1.element_size());
    TORCH_CHECK(workspace->scalar_type() == at::kByte && (workspace->numel() == 0 || workspace->numel() >= need), op,
                ": workspace must be a uint8 tensor of at least ", need,
                " bytes (cake_ops._C.moe_gemm1_workspace_size), or empty, got ", workspace->scalar_type(), " ",
                workspace->sizes());
  }
  at::Tensor xq = x;
  c10::optional<at::Tensor> xq_scale = x_scale;
  if (input == MoeGemmInput::kQuantizeA) std::tie(xq, xq_scale) = quantize_fp8(x, x_scale);
  const bool fp8 = input != MoeGemmInput::k16Bit;
  const auto token = at::floor_divide(permuted_to_expanded.clamp_min(0).to(at::kLong), top_k);
  // Permuted rows past the last expert's end come out of the grouped GEMM as zeros.
  const auto rows = (fp8 ? xq.to(at::kFloat) : xq).index_select(0, token);  // e4m3 values are exact in float32
  const auto h = moe_gemm(rows, w1, expert_offsets, fp8, xq_scale, w1_scale);
  // Interleaved columns: [up 0:32 | gate 0:32 | up 32:64 | ...]; w1_gate_up: [gate 0:I | up 0:I].
  const auto hv = w1_gate_up ? h.view({s.rows, 2, s.intermediate / 32, 32}).transpose(1, 2).to(at::kFloat)
                             : h.view({s.rows, s.intermediate / 32, 2, 32}).to(at::kFloat);
  auto act = at::silu(hv.select(2, w1_gate_up ? 0 : 1));
  auto up = hv.select(2, w1_gate_up ? 1 : 0);
  if (clamp_limits && s.rows > 0) {
    // SwiGLUStep with the limit of each row's expert.
    const auto limit = clamp_limits->index_select(0, row_experts(expert_offsets, s.rows)).view({s.rows, 1, 1});
    act = at::minimum(act, limit);
    up = at::maximum(at::minimum(up, limit), -limit);
  }
  return (act * up).to(moe_gemm_out_dtype(xq)).reshape({s.rows, s.intermediate});
}

}  // namespace

at::Tensor moe_gemm1_swiglu(const at::Tensor& x, const at::Tensor& w1,
                            const at::Tensor& permuted_to_expanded, const at::Tensor& expert_offsets,
                            int64_t top_k, bool /*enable_pdl*/, const c10::optional<at::Tensor>& clamp_limits,
                            int64_t /*tactic*/, const c10::optional<at::Tensor>& x_scale,
                            const c10::optional<at::Tensor>& w1_scale, int64_t expected_routes,
                            bool /*zero_tail: the CPU writes the zeros*/,
                            const c10::optional<at::Tensor>& expanded_to_permuted, bool w1_gate_up) {
  return gemm1_swiglu(x, w1, permuted_to_expanded, expert_offsets, top_k, clamp_limits, x_scale, w1_scale,
                      expected_routes, expanded_to_permuted, w1_gate_up, nullptr, nullptr, "cake::moe_gemm1_swiglu");
}

// Renormalize top-k of router_logits [T, E]: the top_k largest (NaN lowest, ties to the lower id)
// as int32 ids [T, k], and the softmax over those k as float32 weights [T, k].
std::pair<at::Tensor, at::Tensor> renormalize_topk(const at::Tensor& router_logits, int64_t top_k) {
  auto logits = router_logits.to(at::kFloat);
  logits = at::where(logits.isnan(), at::full({}, -std::numeric_limits<float>::infinity(), logits.options()), logits);
  // A stable descending sort keeps the lower expert id first among equal logits.
  const auto sorted = at::sort(logits, /*stable=*/true, /*dim=*/1, /*descending=*/true);
  return {std::get<1>(sorted).slice(1, 0, top_k).to(at::kInt).contiguous(),
          at::softmax(std::get<0>(sorted).slice(1, 0, top_k), 1).contiguous()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_routing(
    const c10::optional<at::Tensor>& router_logits, const c10::optional<at::Tensor>& topk_ids,
    const c10::optional<at::Tensor>& topk_weights, int64_t top_k, int64_t num_experts, int64_t num_local_experts,
    int64_t local_expert_offset, int64_t tile_size) {
  check_moe_routing(router_logits, topk_ids, topk_weights, top_k, num_experts, num_local_experts, local_expert_offset,
                    tile_size, "cake::moe_routing");
  at::Tensor ids, weights;
  if (router_logits) {
    std::tie(ids, weights) = renormalize_topk(*router_logits, top_k);
  } else {
    ids = topk_ids->contiguous().clone();
    weights = topk_weights->contiguous().clone();
  }
  auto [counts, offsets, p2e, e2p, tiles] = moe_sort(ids, num_experts, num_local_experts, local_expert_offset, tile_size);
  return {ids, weights, counts, offsets, p2e, e2p, tiles};
}

void moe_routing_out(const c10::optional<at::Tensor>& router_logits, const c10::optional<at::Tensor>& topk_ids,
                     const c10::optional<at::Tensor>& topk_weights, int64_t top_k, int64_t num_experts,
                     int64_t num_local_experts, int64_t local_expert_offset, int64_t tile_size, at::Tensor ids,
                     at::Tensor weights, at::Tensor counts, at::Tensor offsets, at::Tensor permuted_to_expanded,
                     at::Tensor expanded_to_permuted, at::Tensor tile_offsets, at::Tensor workspace) {
  const char* op = "cake::moe_routing_out";
  check_moe_routing_out(router_logits, topk_ids, topk_weights, top_k, num_experts, num_local_experts,
                        local_expert_offset, tile_size, ids, weights, counts, offsets, permuted_to_expanded,
                        expanded_to_permuted, tile_offsets, workspace, op);
  const auto r = moe_routing(router_logits, topk_ids, topk_weights, top_k, num_experts, num_local_experts,
                             local_expert_offset, tile_size);
  ids.copy_(std::get<0>(r));
  weights.copy_(std::get<1>(r));
  counts.copy_(std::get<2>(r));
  offsets.copy_(std::get<3>(r));
  permuted_to_expanded.copy_(std::get<4>(r));
  expanded_to_permuted.copy_(std::get<5>(r));
  tile_offsets.copy_(std::get<6>(r));
}

void moe_gemm1_swiglu_out(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& permuted_to_expanded,
                          const at::Tensor& expert_offsets, int64_t top_k, at::Tensor out, at::Tensor workspace,
                          bool /*enable_pdl*/, const c10::optional<at::Tensor>& clamp_limits, int64_t /*tactic*/,
                          const c10::optional<at::Tensor>& x_scale, const c10::optional<at::Tensor>& w1_scale,
                          int64_t expected_routes, bool /*zero_tail: the CPU writes the zeros*/,
                          const c10::optional<at::Tensor>& expanded_to_permuted, bool w1_gate_up) {
  out.copy_(gemm1_swiglu(x, w1, permuted_to_expanded, expert_offsets, top_k, clamp_limits, x_scale, w1_scale,
                         expected_routes, expanded_to_permuted, w1_gate_up, &out, &workspace,
                         "cake::moe_gemm1_swiglu_out"));
}

at::Tensor moe_gemm2(const at::Tensor& intermediate, const at::Tensor& w2, const at::Tensor& expert_offsets,
                     bool /*enable_pdl*/, int64_t /*tactic*/, const c10::optional<at::Tensor>& a_scale,
                     const c10::optional<at::Tensor>& w2_scale, int64_t expected_routes) {
  const char* op = "cake::moe_gemm2";
  check_expected_routes(expected_routes, op);
  const auto shape = check_fwd(intermediate, w2, expert_offsets, op, /*allow_e4m3=*/true);
  host_group_bounds(expert_offsets, shape, op);
  const auto input = check_moe_gemm_input(intermediate, a_scale, w2, w2_scale, "intermediate", "w2", op);
  if (input == MoeGemmInput::kQuantizeA) {
    const auto [a, scale] = quantize_fp8(intermediate, a_scale);
    return moe_gemm(a, w2, expert_offsets, /*fp8=*/true, scale, w2_scale);
  }
  return moe_gemm(intermediate, w2, expert_offsets, input == MoeGemmInput::kFp8, a_scale, w2_scale);
}

void moe_gemm2_out(const at::Tensor& intermediate, const at::Tensor& w2, const at::Tensor& expert_offsets,
                   at::Tensor out, at::Tensor workspace, bool enable_pdl, int64_t tactic,
                   const c10::optional<at::Tensor>& a_scale, const c10::optional<at::Tensor>& w2_scale,
                   int64_t expected_routes) {
  const char* op = "cake::moe_gemm2_out";
  check_expected_routes(expected_routes, op);
  check_moe_gemm2_out(intermediate, w2, expert_offsets, out, workspace, op);
  out.copy_(moe_gemm2(intermediate, w2, expert_offsets, enable_pdl, tactic, a_scale, w2_scale, expected_routes));
}

at::Tensor moe_finalize(const at::Tensor& permuted_rows, const at::Tensor& expanded_to_permuted,
                        const at::Tensor& token_final_scales, bool /*enable_pdl*/) {
  const auto s = check_moe_finalize(permuted_rows, expanded_to_permuted, token_final_scales, "cake::moe_finalize");
  check_finalize_indices(expanded_to_permuted, permuted_rows, "cake::moe_finalize");
  return combine_routes(permuted_rows, expanded_to_permuted, token_final_scales, s);
}

std::tuple<at::Tensor, at::Tensor> moe_finalize_backward(const at::Tensor& grad_output,
                                                         const at::Tensor& expanded_to_permuted,
                                                         const at::Tensor& token_final_scales, int64_t num_rows,
                                                         const c10::optional<at::Tensor>& permuted_rows) {
  const char* op = "cake::moe_finalize_backward";
  const auto s = check_moe_finalize_backward(grad_output, expanded_to_permuted, token_final_scales, num_rows,
                                             permuted_rows, op);
  check_index_range(expanded_to_permuted, -1, num_rows,
                    "expanded_to_permuted must hold -1 or row indices below num_rows", op);
  const auto kept = at::nonzero(expanded_to_permuted >= 0).view({-1});
  const auto row = expanded_to_permuted.index_select(0, kept).to(at::kLong);
  if (row.numel() > 0) {
    TORCH_CHECK(at::bincount(row, {}, num_rows).max().item<int64_t>() == 1, op,
                ": the kept routes of expanded_to_permuted must read distinct rows (as moe_sort's do); a row read "
                "twice has no single route to take its gradient from");
  }
  // 16-bit values compute in float32 (one rounding of the product), wider ones in their own type.
  const auto ct = grad_output.element_size() == 2 ? at::kFloat : grad_output.scalar_type();
  const auto grad = grad_output.index_select(0, at::floor_divide(kept, s.top_k)).to(ct);
  auto rows_grad = at::zeros({num_rows, s.hidden}, grad_output.options());
  const auto route_scales = token_final_scales.reshape({-1}).index_select(0, kept).unsqueeze(1).to(ct);
  rows_grad.index_copy_(0, row, (grad * route_scales).to(grad_output.scalar_type()));
  auto scales_grad = at::zeros({permuted_rows.has_value() ? s.num_tokens * s.top_k : 0}, token_final_scales.options());
  if (permuted_rows.has_value()) {
    const auto dots = (permuted_rows->index_select(0, row).to(ct) * grad).sum(1);
    scales_grad.index_copy_(0, kept, dots.to(at::kFloat));
    scales_grad = scales_grad.view({s.num_tokens, s.top_k});
  }
  return {rows_grad, scales_grad};
}

namespace {
// 16-bit values compute in float32, wider ones in their own type.
at::ScalarType swiglu_compute_type(const at::Tensor& t) {
  return t.element_size() == 2 ? at::kFloat : t.scalar_type();
}
}  // namespace

at::Tensor swiglu(const at::Tensor& gate_up, std::optional<double> limit) {
  const int64_t inter = check_swiglu(gate_up, "cake::swiglu");
  check_swiglu_limit(limit, "cake::swiglu");
  const auto ct = swiglu_compute_type(gate_up);
  auto gate = gate_up.narrow(1, 0, inter).to(ct), up = gate_up.narrow(1, inter, inter).to(ct);
  if (limit.has_value()) {  // in the compute type: float32 for 16-bit, as the CUDA kernels
    gate = at::clamp_max(gate, *limit);
    up = at::clamp(up, -*limit, *limit);
  }
  return (at::silu(gate) * up).to(gate_up.scalar_type());
}

at::Tensor swiglu_backward(const at::Tensor& grad_out, const at::Tensor& gate_up, std::optional<double> limit) {
  const char* op = "cake::swiglu_backward";
  const int64_t inter = check_swiglu(gate_up, op);
  check_swiglu_grad(grad_out, gate_up, inter, op);
  check_swiglu_limit(limit, op);
  const auto ct = swiglu_compute_type(gate_up);
  auto gate = gate_up.narrow(1, 0, inter).to(ct), up = gate_up.narrow(1, inter, inter).to(ct);
  auto grad_gate = grad_out.to(ct), grad_up = grad_gate;
  if (limit.has_value()) {  // clamp's gradient as torch 2.14's: through where the value is strictly inside its bounds
    grad_gate = grad_gate * (gate < *limit);
    grad_up = grad_up * ((up > -*limit) & (up < *limit));
    gate = at::clamp_max(gate, *limit);
    up = at::clamp(up, -*limit, *limit);
  }
  const auto sigmoid = at::sigmoid(gate), silu = gate * sigmoid;
  // silu'(g) = sigmoid(g) + silu(g) * (1 - sigmoid(g))
  return at::cat({grad_gate * up * (sigmoid + silu * (1 - sigmoid)), grad_up * silu}, 1).to(gate_up.scalar_type());
}

void moe_finalize_out(const at::Tensor& permuted_rows, const at::Tensor& expanded_to_permuted,
                      const at::Tensor& token_final_scales, at::Tensor out, bool /*enable_pdl*/) {
  const char* op = "cake::moe_finalize_out";
  const auto s = check_moe_finalize(permuted_rows, expanded_to_permuted, token_final_scales, op);
  check_moe_finalize_out(out, s, permuted_rows, op);
  check_finalize_indices(expanded_to_permuted, permuted_rows, op);
  out.copy_(combine_routes(permuted_rows, expanded_to_permuted, token_final_scales, s));
}

void moe_gemm2_finalize_out(const at::Tensor& intermediate, const at::Tensor& w2, const at::Tensor& expert_offsets,
                            const at::Tensor& permuted_to_expanded, const at::Tensor& expanded_to_permuted,
                            const at::Tensor& token_final_scales, at::Tensor out, bool enable_pdl, int64_t tactic,
                            int64_t expected_routes) {
  check_expected_routes(expected_routes, "cake::moe_gemm2_finalize_out");
  const auto s = check_moe_gemm2_finalize_out(intermediate, w2, expert_offsets, permuted_to_expanded,
                                              expanded_to_permuted, token_final_scales, out,
                                              "cake::moe_gemm2_finalize_out")
                     .finalize;
  const auto dtype = out.scalar_type();
  const auto rows =
      moe_gemm2(intermediate, w2, expert_offsets, enable_pdl, tactic, c10::nullopt, c10::nullopt, expected_routes);
  const auto routes = expanded_to_permuted.view({s.num_tokens, s.top_k});
  auto sum = at::zeros({s.num_tokens, s.hidden}, out.options());
  // The CUDA kernel's additions, in route order: each term and each sum rounded to out's dtype.
  for (int64_t j = 0; j < s.top_k; ++j) {
    const auto route = routes.select(1, j);
    const auto kept = (route >= 0).unsqueeze(1);
    const auto term = (rows.index_select(0, route.clamp_min(0).to(at::kLong)).to(at::kFloat) *
                       token_final_scales.select(1, j).unsqueeze(1))
                          .to(dtype);
    sum = at::where(kept, (sum.to(at::kFloat) + term.to(at::kFloat)).to(dtype), sum);
  }
  out.copy_(sum);
}

void moe_forward_out(const at::Tensor& x, const at::Tensor& token_selected_experts,
                     const at::Tensor& token_final_scales, const at::Tensor& w1, const at::Tensor& w2,
                     int64_t local_expert_offset, at::Tensor out, at::Tensor workspace, bool enable_pdl,
                     const c10::optional<at::Tensor>& clamp_limits, const c10::optional<at::Tensor>& x_scale,
                     const c10::optional<at::Tensor>& w1_scale, const c10::optional<at::Tensor>& fc2_scale,
                     const c10::optional<at::Tensor>& w2_scale, int64_t expected_routes, bool w1_gate_up) {
  const auto s = check_moe_forward_out(x, token_selected_experts, token_final_scales, w1, w2, local_expert_offset, out,
                                       workspace, clamp_limits, x_scale, w1_scale, fc2_scale, w2_scale,
                                       "cake::moe_forward_out");
  check_expected_routes(expected_routes, "cake::moe_forward_out");
  // Ids outside the shard are dropped whatever num_experts, so the shard's end serves as it.
  const auto sorted = moe_sort(token_selected_experts, local_expert_offset + s.num_local_experts,
                               s.num_local_experts, local_expert_offset, /*tile_size=*/128);
  const auto& offsets = std::get<1>(sorted);
  const auto h = moe_gemm1_swiglu(x, w1, std::get<2>(sorted), offsets, s.top_k, enable_pdl, clamp_limits, -1, x_scale,
                                  w1_scale, expected_routes, /*zero_tail=*/false, std::get<3>(sorted), w1_gate_up);
  const auto rows = moe_gemm2(h, w2, offsets, enable_pdl, -1, fc2_scale, w2_scale, expected_routes);
  out.copy_(moe_finalize(rows, std::get<3>(sorted), token_final_scales, enable_pdl));
}

void moe_forward_from_logits_out(const at::Tensor& x, const at::Tensor& router_logits, const at::Tensor& w1,
                                 const at::Tensor& w2, int64_t local_expert_offset, at::Tensor token_selected_experts,
                                 at::Tensor token_final_scales, at::Tensor out, at::Tensor workspace, bool enable_pdl,
                                 const c10::optional<at::Tensor>& clamp_limits,
                                 const c10::optional<at::Tensor>& x_scale, const c10::optional<at::Tensor>& w1_scale,
                                 const c10::optional<at::Tensor>& fc2_scale,
                                 const c10::optional<at::Tensor>& w2_scale) {
  const auto s = check_moe_forward_from_logits_out(x, router_logits, w1, w2, local_expert_offset, token_selected_experts,
                                                   token_final_scales, out, workspace, clamp_limits, x_scale, w1_scale,
                                                   fc2_scale, w2_scale, "cake::moe_forward_from_logits_out");
  // The routing only: moe_forward_out sorts the routes itself.
  const auto [ids, weights] = renormalize_topk(router_logits, s.top_k);
  token_selected_experts.copy_(ids);
  token_final_scales.copy_(weights);
  moe_forward_out(x, token_selected_experts, token_final_scales, w1, w2, local_expert_offset, out, workspace,
                  enable_pdl, clamp_limits, x_scale, w1_scale, fc2_scale, w2_scale,
                  moe_expected_routes(s.num_tokens * s.top_k, s.num_local_experts, router_logits.size(1)),
                  /*w1_gate_up=*/false);
}

TORCH_LIBRARY_IMPL(cake, CPU, m) {
  m.impl("moe_sort", &moe_sort);
  m.impl("moe_routing", &moe_routing);
  m.impl("moe_routing_out", &moe_routing_out);
  m.impl("moe_gemm1_swiglu_out", &moe_gemm1_swiglu_out);
  m.impl("moe_gemm1_swiglu", &moe_gemm1_swiglu);
  m.impl("moe_gemm2", &moe_gemm2);
  m.impl("moe_gemm2_out", &moe_gemm2_out);
  m.impl("quantize_fp8", &quantize_fp8);
  m.impl("quantize_fp8_out", &quantize_fp8_out);
  m.impl("moe_finalize", &moe_finalize);
  m.impl("moe_finalize_out", &moe_finalize_out);
  m.impl("moe_finalize_backward", &moe_finalize_backward);
  m.impl("swiglu", &swiglu);
  m.impl("swiglu_backward", &swiglu_backward);
  m.impl("moe_gemm2_finalize_out", &moe_gemm2_finalize_out);
  m.impl("moe_forward_out", &moe_forward_out);
  m.impl("moe_forward_from_logits_out", &moe_forward_from_logits_out);
}

}  // namespace cake
