#include "moe/moe_ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include "moe_checks.h"

namespace cake {

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

at::Tensor moe_gemm1_swiglu(const at::Tensor& x, const at::Tensor& w1,
                            const at::Tensor& permuted_to_expanded, const at::Tensor& expert_offsets,
                            int64_t top_k) {
  const char* op = "cake::moe_gemm1_swiglu";
  TORCH_CHECK(x.dim() == 2, op, ": x must be a 2-D [num_tokens, hidden] tensor, got shape ", x.sizes());
  TORCH_CHECK(w1.dim() == 3 && w1.size(2) == x.size(1) && w1.size(1) % 64 == 0, op,
              ": w1 must be [E_local, 2I, hidden=", x.size(1), "] with I % 32 == 0, got shape ", w1.sizes());
  TORCH_CHECK(w1.scalar_type() == x.scalar_type(), op, ": x and w1 must have the same dtype, got ",
              x.scalar_type(), " and ", w1.scalar_type());
  TORCH_CHECK(w1.device() == x.device() && permuted_to_expanded.device() == x.device() &&
                  expert_offsets.device() == x.device(),
              op, ": all tensors must be on x's device ", x.device());
  TORCH_CHECK(top_k > 0, op, ": top_k must be positive, got ", top_k);
  TORCH_CHECK(permuted_to_expanded.dim() == 1 && permuted_to_expanded.size(0) == x.size(0) * top_k &&
                  permuted_to_expanded.scalar_type() == at::kInt,
              op, ": permuted_to_expanded must be int32 [num_tokens * top_k] = [", x.size(0) * top_k,
              "], got ", permuted_to_expanded.scalar_type(), " ", permuted_to_expanded.sizes());
  TORCH_CHECK(expert_offsets.dim() == 1 && expert_offsets.size(0) == w1.size(0) + 1, op,
              ": expert_offsets must be [E_local + 1] = [", w1.size(0) + 1, "], got ", expert_offsets.sizes());
  const int64_t rows = permuted_to_expanded.size(0);
  const int64_t inter = w1.size(1) / 2;
  const auto token = at::floor_divide(permuted_to_expanded.clamp_min(0).to(at::kLong), top_k);
  // Permuted rows past the last expert's end come out of the grouped GEMM as zeros.
  static auto grouped_gemm_fwd = c10::Dispatcher::singleton()
                                     .findSchemaOrThrow("cake::grouped_gemm_fwd", "")
                                     .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  const auto h = grouped_gemm_fwd.call(x.index_select(0, token), w1, expert_offsets);
  // Interleaved columns: [up 0:32 | gate 0:32 | up 32:64 | ...].
  const auto hv = h.view({rows, inter / 32, 2, 32}).to(at::kFloat);
  return (at::silu(hv.select(2, 1)) * hv.select(2, 0)).to(x.scalar_type()).reshape({rows, inter});
}

at::Tensor moe_finalize(const at::Tensor& permuted_rows, const at::Tensor& expanded_to_permuted,
                        const at::Tensor& token_final_scales) {
  const char* op = "cake::moe_finalize";
  TORCH_CHECK(permuted_rows.dim() == 2, op, ": permuted_rows must be 2-D [rows, hidden], got shape ",
              permuted_rows.sizes());
  TORCH_CHECK(token_final_scales.dim() == 2 && token_final_scales.scalar_type() == at::kFloat, op,
              ": token_final_scales must be float32 [num_tokens, top_k], got ",
              token_final_scales.scalar_type(), " ", token_final_scales.sizes());
  const int64_t tokens = token_final_scales.size(0), top_k = token_final_scales.size(1);
  TORCH_CHECK(expanded_to_permuted.dim() == 1 && expanded_to_permuted.size(0) == tokens * top_k &&
                  expanded_to_permuted.scalar_type() == at::kInt,
              op, ": expanded_to_permuted must be int32 [num_tokens * top_k] = [", tokens * top_k, "], got ",
              expanded_to_permuted.scalar_type(), " ", expanded_to_permuted.sizes());
  TORCH_CHECK(expanded_to_permuted.device() == permuted_rows.device() &&
                  token_final_scales.device() == permuted_rows.device(),
              op, ": all tensors must be on permuted_rows' device ", permuted_rows.device());
  const int64_t hidden = permuted_rows.size(1);
  const auto rows = permuted_rows.index_select(0, expanded_to_permuted.clamp_min(0).to(at::kLong))
                        .to(at::kFloat)
                        .view({tokens, top_k, hidden});
  const auto kept = expanded_to_permuted.view({tokens, top_k}) >= 0;
  const auto scales = at::where(kept, token_final_scales, at::zeros_like(token_final_scales));
  // One fp32 sum over the k routes of a token, in a fixed order: bitwise reproducible.
  return (rows * scales.unsqueeze(-1)).sum(1).to(permuted_rows.scalar_type());
}

TORCH_LIBRARY_IMPL(cake, CPU, m) {
  register_moe_ops(m);
}

}  // namespace cake
