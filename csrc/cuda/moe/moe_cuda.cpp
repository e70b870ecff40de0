// The MoE ops on CUDA: the shared checks, then the SM90 kernels (moe_sm90.cu) and the grouped
// GEMM. GEMM1 = row gather -> grouped GEMM -> SwiGLU; GEMM2 = grouped GEMM; finalize = the
// deterministic fp32 combine. With enable_pdl every kernel of the chain launches with PDL.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda/common/arch.h"
#include "cuda/grouped_gemm/grouped_gemm_cuda.h"
#include "cuda/moe/moe_kernels.h"
#include "grouped_gemm_checks.h"
#include "moe_checks.h"

namespace cake {
namespace {

bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// The element types of the SM90 MoE GEMMs.
void check_gemm_dtype(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, op,
              ": CUDA kernels take bfloat16 or float16 activations and weights, got ", x.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_sort_cuda(
    const at::Tensor& ids, int64_t num_experts, int64_t num_local_experts, int64_t local_expert_offset,
    int64_t tile_size) {
  const char* op = "cake::moe_sort";
  const auto s = check_moe_sort(ids, num_experts, num_local_experts, local_expert_offset, tile_size, op);
  TORCH_CHECK(num_experts <= INT32_MAX && tile_size <= INT32_MAX, op, ": num_experts and tile_size must fit in int32");
  c10::cuda::CUDAGuard guard(ids.device());
  select_kernel_arch(ids.get_device(), op);
  const int64_t routes = s.num_tokens * s.top_k;
  auto opts = ids.options();
  auto counts = at::empty({num_local_experts}, opts);
  auto offsets = at::empty({num_local_experts + 1}, opts);
  auto permuted_to_expanded = at::empty({routes}, opts);
  auto expanded_to_permuted = at::empty({routes}, opts);
  auto tile_offsets = at::empty({num_local_experts + 1}, opts);
  sm90::MoeSortArgs a;
  a.ids = ids.data_ptr<int32_t>();
  a.routes = routes;
  a.num_experts = static_cast<int>(num_experts);
  a.num_local_experts = static_cast<int>(num_local_experts);
  a.local_expert_offset = static_cast<int>(local_expert_offset);
  a.tile_size = static_cast<int>(tile_size);
  a.counts = counts.data_ptr<int32_t>();
  a.offsets = offsets.data_ptr<int32_t>();
  a.permuted_to_expanded = permuted_to_expanded.data_ptr<int32_t>();
  a.expanded_to_permuted = expanded_to_permuted.data_ptr<int32_t>();
  a.tile_offsets = tile_offsets.data_ptr<int32_t>();
  // moe_sort is the first kernel of the chain: it waits for whatever wrote the ids.
  const int64_t blocks = sm90::moe_sort_blocks(routes, num_local_experts);
  auto block_rows = blocks > 1 ? at::empty({blocks * num_local_experts}, opts) : at::Tensor();
  sm90::moe_sort(a, blocks > 1 ? block_rows.data_ptr<int32_t>() : nullptr,
                 at::cuda::getCurrentCUDAStream(ids.get_device()), /*pdl=*/true);
  return {counts, offsets, permuted_to_expanded, expanded_to_permuted, tile_offsets};
}

at::Tensor moe_gemm1_swiglu_cuda(const at::Tensor& x_in, const at::Tensor& w1, const at::Tensor& permuted_to_expanded,
                                 const at::Tensor& expert_offsets, int64_t top_k, bool enable_pdl,
                                 const c10::optional<at::Tensor>& clamp_limits_in, int64_t tactic) {
  const char* op = "cake::moe_gemm1_swiglu";
  const auto s = check_moe_gemm1(x_in, w1, permuted_to_expanded, expert_offsets, top_k, op);
  at::Tensor clamp_limits;
  if (clamp_limits_in) {
    check_clamp_limits(*clamp_limits_in, w1.size(0), x_in, op);
    clamp_limits = clamp_limits_in->contiguous();
  }
  check_gemm_dtype(x_in, op);
  TORCH_CHECK(w1.is_contiguous() && permuted_to_expanded.is_contiguous() && expert_offsets.is_contiguous(), op,
              ": w1, permuted_to_expanded and expert_offsets must be contiguous");
  TORCH_CHECK(x_in.size(1) % 8 == 0, op, ": CUDA kernels need hidden % 8 == 0 (16-byte rows), got ", x_in.size(1));
  TORCH_CHECK(top_k <= INT32_MAX, op, ": top_k must fit in int32");
  c10::cuda::CUDAGuard guard(x_in.device());
  select_kernel_arch(x_in.get_device(), op);
  const auto x = x_in.contiguous();
  TORCH_CHECK(aligned16(x), op, ": x must be 16-byte aligned");
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.get_device());
  const int32_t* num_kept = expert_offsets.data_ptr<int32_t>() + w1.size(0);
  auto gathered = at::empty({s.rows, x.size(1)}, x.options());
  sm90::moe_gather_rows(x.data_ptr(), x.size(1) * x.element_size(), permuted_to_expanded.data_ptr<int32_t>(),
                        static_cast<int>(top_k), num_kept, s.rows, gathered.data_ptr(), stream, enable_pdl);
  const auto shape = check_fwd(gathered, w1, expert_offsets, op);
  auto h = at::empty({s.rows, 2 * s.intermediate}, x.options());
  // h rows past the last expert's end stay unwritten: the SwiGLU writes zeros there unread.
  run_grouped_gemm_cuda(GroupedGemmOp::kFwd, shape, gathered, w1, expert_offsets, h, op, enable_pdl,
                        /*zero_tail=*/false, tactic);
  auto out = at::empty({s.rows, s.intermediate}, x.options());
  sm90::moe_swiglu(h.data_ptr(), s.rows, s.intermediate, expert_offsets.data_ptr<int32_t>(),
                   static_cast<int>(w1.size(0)), clamp_limits.defined() ? clamp_limits.data_ptr<float>() : nullptr,
                   out.data_ptr(), x.scalar_type() == at::kBFloat16, stream, enable_pdl);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_routing_cuda(
    const c10::optional<at::Tensor>& router_logits, const c10::optional<at::Tensor>& topk_ids,
    const c10::optional<at::Tensor>& topk_weights, int64_t top_k, int64_t num_experts, int64_t num_local_experts,
    int64_t local_expert_offset, int64_t tile_size) {
  const char* op = "cake::moe_routing";
  const int64_t tokens = check_moe_routing(router_logits, topk_ids, topk_weights, top_k, num_experts, op);
  at::Tensor ids, weights;
  if (router_logits) {
    const auto logits = router_logits->contiguous();
    TORCH_CHECK(logits.is_cuda(), op, ": router_logits must be a CUDA tensor here");
    c10::cuda::CUDAGuard guard(logits.device());
    select_kernel_arch(logits.get_device(), op);
    ids = at::empty({tokens, top_k}, logits.options().dtype(at::kInt));
    weights = at::empty({tokens, top_k}, logits.options().dtype(at::kFloat));
    const auto type = logits.scalar_type() == at::kFloat      ? sm90::LogitType::kFloat
                      : logits.scalar_type() == at::kBFloat16 ? sm90::LogitType::kBFloat16
                                                              : sm90::LogitType::kHalf;
    sm90::moe_topk_softmax(logits.data_ptr(), type, tokens, static_cast<int>(num_experts), static_cast<int>(top_k),
                           ids.data_ptr<int32_t>(), weights.data_ptr<float>(),
                           at::cuda::getCurrentCUDAStream(logits.get_device()), /*pdl=*/true);
  } else {
    ids = topk_ids->contiguous().clone();
    weights = topk_weights->contiguous().clone();
  }
  auto [counts, offsets, p2e, e2p, tiles] =
      moe_sort_cuda(ids, num_experts, num_local_experts, local_expert_offset, tile_size);
  return {ids, weights, counts, offsets, p2e, e2p, tiles};
}

at::Tensor moe_gemm2_cuda(const at::Tensor& intermediate, const at::Tensor& w2, const at::Tensor& expert_offsets,
                          bool enable_pdl, int64_t tactic) {
  const char* op = "cake::moe_gemm2";
  const auto shape = check_fwd(intermediate, w2, expert_offsets, op);
  check_gemm_dtype(intermediate, op);
  c10::cuda::CUDAGuard guard(intermediate.device());
  auto out = at::empty({shape.sum_m, shape.n}, intermediate.options());
  // Rows past the last expert's end stay unwritten (the schema's contract): no route reads them.
  run_grouped_gemm_cuda(GroupedGemmOp::kFwd, shape, intermediate, w2, expert_offsets, out, op, enable_pdl,
                        /*zero_tail=*/false, tactic);
  return out;
}

void finalize_into(const at::Tensor& rows_in, const at::Tensor& expanded_to_permuted_in, const at::Tensor& scales_in,
                   const MoeFinalizeShape& s, at::Tensor& out, bool enable_pdl, const char* op) {
  TORCH_CHECK(rows_in.scalar_type() == at::kBFloat16 || rows_in.scalar_type() == at::kHalf, op,
              ": CUDA kernels take bfloat16 or float16 rows, got ", rows_in.scalar_type());
  TORCH_CHECK(s.hidden % 8 == 0, op, ": CUDA kernels need hidden % 8 == 0 (16-byte rows), got ", s.hidden);
  TORCH_CHECK(s.top_k <= INT32_MAX, op, ": top_k must fit in int32");
  c10::cuda::CUDAGuard guard(rows_in.device());
  select_kernel_arch(rows_in.get_device(), op);
  const auto rows = rows_in.contiguous();
  const auto expanded_to_permuted = expanded_to_permuted_in.contiguous();
  const auto scales = scales_in.contiguous();
  TORCH_CHECK(aligned16(rows) && aligned16(out), op, ": permuted_rows and out must be 16-byte aligned");
  sm90::moe_finalize(rows.data_ptr(), s.hidden, expanded_to_permuted.data_ptr<int32_t>(),
                     scales.data_ptr<float>(), s.num_tokens, static_cast<int>(s.top_k), rows.size(0), out.data_ptr(),
                     rows.scalar_type() == at::kBFloat16, at::cuda::getCurrentCUDAStream(rows.get_device()),
                     enable_pdl);
}

at::Tensor moe_finalize_cuda(const at::Tensor& rows, const at::Tensor& expanded_to_permuted, const at::Tensor& scales,
                             bool enable_pdl) {
  const char* op = "cake::moe_finalize";
  const auto s = check_moe_finalize(rows, expanded_to_permuted, scales, op);
  auto out = at::empty({s.num_tokens, s.hidden}, rows.options());
  finalize_into(rows, expanded_to_permuted, scales, s, out, enable_pdl, op);
  return out;
}

void moe_finalize_out_cuda(const at::Tensor& rows, const at::Tensor& expanded_to_permuted, const at::Tensor& scales,
                           at::Tensor out, bool enable_pdl) {
  const char* op = "cake::moe_finalize_out";
  const auto s = check_moe_finalize(rows, expanded_to_permuted, scales, op);
  check_moe_finalize_out(out, s, rows, op);
  finalize_into(rows, expanded_to_permuted, scales, s, out, enable_pdl, op);
}

}  // namespace

TORCH_LIBRARY_IMPL(cake, CUDA, m) {
  m.impl("moe_sort", &moe_sort_cuda);
  m.impl("moe_routing", &moe_routing_cuda);
  m.impl("moe_gemm1_swiglu", &moe_gemm1_swiglu_cuda);
  m.impl("moe_gemm2", &moe_gemm2_cuda);
  m.impl("moe_finalize", &moe_finalize_cuda);
  m.impl("moe_finalize_out", &moe_finalize_out_cuda);
}

}  // namespace cake
