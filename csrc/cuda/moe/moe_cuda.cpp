// The MoE ops on CUDA: the shared checks, then the SM90 kernels (moe_sm90.cu) and the grouped
// GEMM. GEMM1 = row gather -> grouped GEMM -> SwiGLU; GEMM2 = grouped GEMM; finalize = the
// deterministic fp32 combine. With enable_pdl every kernel of the chain launches with PDL.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda/common/alignment.h"
#include "cuda/common/arch.h"
#include "cuda/grouped_gemm/grouped_gemm_cuda.h"
#include "cuda/grouped_gemm/grouped_gemm_tactics.h"
#include "cuda/moe/moe_kernels.h"
#include "grouped_gemm_checks.h"
#include "moe_checks.h"

namespace cake {
namespace {

// The element types of the SM90 MoE GEMMs.
void check_gemm_dtype(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf || x.scalar_type() == at::kFloat8_e4m3fn,
              op, ": CUDA kernels take bfloat16, float16 or float8_e4m3fn activations and weights, got ",
              x.scalar_type());
}

sm90::FloatType float_type(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat      ? sm90::FloatType::kFloat
         : t.scalar_type() == at::kBFloat16 ? sm90::FloatType::kBFloat16
                                            : sm90::FloatType::kHalf;
}

// The fp8 scales as the grouped GEMM takes them (after check_moe_gemm_scales).
GroupedGemmScales gemm_scales(const c10::optional<at::Tensor>& a_scale, const c10::optional<at::Tensor>& w_scale,
                              at::Tensor& w_scale_contiguous) {
  if (!a_scale) return {};
  w_scale_contiguous = w_scale->contiguous();
  return {a_scale->data_ptr<float>(), w_scale_contiguous.data_ptr<float>()};
}

// moe_routing's seven outputs (moe_sort's five are the last five).
struct RoutingOut {
  at::Tensor ids, weights, counts, offsets, permuted_to_expanded, expanded_to_permuted, tile_offsets;
};

// The sort's five outputs for the routes in `ids` (weights left undefined).
RoutingOut sort_outputs(const at::Tensor& ids, int64_t num_local_experts) {
  const auto opts = ids.options().dtype(at::kInt);
  return {ids, at::Tensor(), at::empty({num_local_experts}, opts), at::empty({num_local_experts + 1}, opts),
          at::empty({ids.numel()}, opts), at::empty({ids.numel()}, opts), at::empty({num_local_experts + 1}, opts)};
}

at::Tensor sort_workspace(int64_t routes, int64_t num_local_experts, const at::Tensor& like) {
  return at::empty({moe_routing_workspace_bytes(routes, num_local_experts)}, like.options().dtype(at::kByte));
}

// The sort's kernel arguments: o.ids into o's last five outputs.
sm90::MoeSortArgs sort_args(int64_t num_experts, int64_t num_local_experts, int64_t local_expert_offset,
                            int64_t tile_size, const RoutingOut& o, const char* op) {
  TORCH_CHECK(num_experts <= INT32_MAX && tile_size <= INT32_MAX, op, ": num_experts and tile_size must fit in int32");
  sm90::MoeSortArgs a;
  a.ids = o.ids.data_ptr<int32_t>();
  a.routes = o.ids.numel();
  a.num_experts = static_cast<int>(num_experts);
  a.num_local_experts = static_cast<int>(num_local_experts);
  a.local_expert_offset = static_cast<int>(local_expert_offset);
  a.tile_size = static_cast<int>(tile_size);
  a.counts = o.counts.data_ptr<int32_t>();
  a.offsets = o.offsets.data_ptr<int32_t>();
  a.permuted_to_expanded = o.permuted_to_expanded.data_ptr<int32_t>();
  a.expanded_to_permuted = o.expanded_to_permuted.data_ptr<int32_t>();
  a.tile_offsets = o.tile_offsets.data_ptr<int32_t>();
  return a;
}

// Sorts o.ids (already written) into o's last five outputs; `workspace`: moe_routing_workspace_bytes.
void sort_into(int64_t num_experts, int64_t num_local_experts, int64_t local_expert_offset, int64_t tile_size,
               const RoutingOut& o, const at::Tensor& workspace, const char* op) {
  const auto a = sort_args(num_experts, num_local_experts, local_expert_offset, tile_size, o, op);
  c10::cuda::CUDAGuard guard(o.ids.device());
  select_kernel_arch(o.ids.get_device(), op);
  // One block (up to a chunk of routes, none included) needs no workspace.
  const int64_t blocks = sm90::moe_sort_blocks(a.routes, num_local_experts);
  TORCH_CHECK(blocks == 1 || blocks * num_local_experts * 4 <= static_cast<int64_t>(workspace.nbytes()), op,
              ": sort workspace too small (internal error)");
  // The sort waits for whatever wrote the ids (PDL).
  sm90::moe_sort(a, static_cast<int32_t*>(workspace.data_ptr()), at::cuda::getCurrentCUDAStream(o.ids.get_device()),
                 /*pdl=*/true);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_sort_cuda(
    const at::Tensor& ids, int64_t num_experts, int64_t num_local_experts, int64_t local_expert_offset,
    int64_t tile_size) {
  const char* op = "cake::moe_sort";
  check_moe_sort(ids, num_experts, num_local_experts, local_expert_offset, tile_size, op);
  const RoutingOut o = sort_outputs(ids, num_local_experts);
  sort_into(num_experts, num_local_experts, local_expert_offset, tile_size, o,
            sort_workspace(ids.numel(), num_local_experts, ids), op);
  return {o.counts, o.offsets, o.permuted_to_expanded, o.expanded_to_permuted, o.tile_offsets};
}

void routing_into(const c10::optional<at::Tensor>& router_logits, const c10::optional<at::Tensor>& topk_ids,
                  const c10::optional<at::Tensor>& topk_weights, int64_t top_k, int64_t num_experts,
                  int64_t num_local_experts, int64_t local_expert_offset, int64_t tile_size, const RoutingOut& o,
                  const at::Tensor& workspace, const char* op) {
  if (router_logits) {
    const auto logits = router_logits->contiguous();
    TORCH_CHECK(logits.is_cuda(), op, ": router_logits must be a CUDA tensor here");
    c10::cuda::CUDAGuard guard(logits.device());
    select_kernel_arch(logits.get_device(), op);
    const auto a = sort_args(num_experts, num_local_experts, local_expert_offset, tile_size, o, op);
    if (sm90::moe_route_and_sort_fits(logits.size(0), a)) {  // decode: one launch
      sm90::moe_route_and_sort(logits.data_ptr(), float_type(logits), logits.size(0), static_cast<int>(top_k),
                               o.ids.data_ptr<int32_t>(), o.weights.data_ptr<float>(), a,
                               at::cuda::getCurrentCUDAStream(logits.get_device()), /*pdl=*/true);
      return;
    }
    sm90::moe_topk_softmax(logits.data_ptr(), float_type(logits), logits.size(0), static_cast<int>(num_experts),
                           static_cast<int>(top_k), o.ids.data_ptr<int32_t>(), o.weights.data_ptr<float>(),
                           at::cuda::getCurrentCUDAStream(logits.get_device()), /*pdl=*/true);
  } else {
    o.ids.copy_(*topk_ids);
    o.weights.copy_(*topk_weights);
  }
  sort_into(num_experts, num_local_experts, local_expert_offset, tile_size, o, workspace, op);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_routing_cuda(
    const c10::optional<at::Tensor>& router_logits, const c10::optional<at::Tensor>& topk_ids,
    const c10::optional<at::Tensor>& topk_weights, int64_t top_k, int64_t num_experts, int64_t num_local_experts,
    int64_t local_expert_offset, int64_t tile_size) {
  const char* op = "cake::moe_routing";
  const int64_t tokens = check_moe_routing(router_logits, topk_ids, topk_weights, top_k, num_experts,
                                           num_local_experts, local_expert_offset, tile_size, op);
  const auto& like = router_logits ? *router_logits : *topk_ids;
  RoutingOut o = sort_outputs(at::empty({tokens, top_k}, like.options().dtype(at::kInt)), num_local_experts);
  o.weights = at::empty({tokens, top_k}, like.options().dtype(at::kFloat));
  routing_into(router_logits, topk_ids, topk_weights, top_k, num_experts, num_local_experts, local_expert_offset,
               tile_size, o, sort_workspace(tokens * top_k, num_local_experts, like), op);
  return {o.ids, o.weights, o.counts, o.offsets, o.permuted_to_expanded, o.expanded_to_permuted, o.tile_offsets};
}

void moe_routing_out_cuda(const c10::optional<at::Tensor>& router_logits, const c10::optional<at::Tensor>& topk_ids,
                          const c10::optional<at::Tensor>& topk_weights, int64_t top_k, int64_t num_experts,
                          int64_t num_local_experts, int64_t local_expert_offset, int64_t tile_size, at::Tensor ids,
                          at::Tensor weights, at::Tensor counts, at::Tensor offsets, at::Tensor permuted_to_expanded,
                          at::Tensor expanded_to_permuted, at::Tensor tile_offsets, at::Tensor workspace) {
  const char* op = "cake::moe_routing_out";
  check_moe_routing_out(router_logits, topk_ids, topk_weights, top_k, num_experts, num_local_experts,
                        local_expert_offset, tile_size, ids, weights, counts, offsets, permuted_to_expanded,
                        expanded_to_permuted, tile_offsets, workspace, op);
  const RoutingOut o{ids, weights, counts, offsets, permuted_to_expanded, expanded_to_permuted, tile_offsets};
  routing_into(router_logits, topk_ids, topk_weights, top_k, num_experts, num_local_experts, local_expert_offset,
               tile_size, o, workspace, op);
}

// The MoE GEMMs' decode kernel (moe_decode_sm90.cu) streams each expert's weights once for a few
// token rows with less fixed cost than the grouped GEMM; its passes grow with the rows per expert
// (one wgmma N block to four), the grouped GEMM's do not. tactic -2 forces it; -1 takes it up to a
// number of rows per local expert on average that differs per GEMM, when its grid (one CTA per 64
// weight rows of each possible expert) covers the SMs -- unless a grouped GEMM tactic is forced for
// the family (benchmarks, autotuner). An expert-parallel shard's GEMM (expected_rows >= 0: its
// share of the T * top_k routes) is judged by that share. H200 sweeps, decode kernel against the
// grouped GEMM per GEMM, graph replays (benchmarks/results/sweep_decode_rows_h200_s33.txt):
// - GEMM1 (2I = 1536-4096, K = 2048-7168) ahead up to 4 rows per expert: Qwen3-30B / Qwen3-235B
//   at 3 and 4 rows -4% / -1 to -2%, StepFun bf16 / fp8 at 4 rows -4% / -3%, Step-3.5-Flash at
//   2.7-3.6 rows -2 to -4%, the Kimi-K2 shard at 0.7-2.7 rows -3%; behind from 6 rows (+0 to +8%)
//   and at 8 (+18%);
// - GEMM2 ahead up to 2 rows per expert (Kimi shard 1.3-2 rows -4 to -5%); at 3-4 rows mixed:
//   Qwen3-235B and Step-3.5 bf16 ahead, Step-3.5 fp8 +9%, Qwen3-30B with the fused finalize +5 to
//   +7% (the grouped GEMM's scatter twin combines in its epilogue).
// Up to session 32 any 64 rows also took it: Mixtral (E = 8) at 6 / 8 rows per expert ran GEMM1
// 10 / 30% and GEMM2 16 / 31% slower on it than on the swap-AB tile (sweep_decode_edges_h200_s33.txt).
constexpr int64_t kMoeDecodeTactic = -2;
constexpr int64_t kMoeDecodeGemm1MaxRowsPerExpert = 4;
constexpr int64_t kMoeDecodeGemm2MaxRowsPerExpert = 2;

bool use_decode_kernel(int64_t tactic, int64_t rows, int64_t expected_rows, int64_t n, int64_t k_bytes,
                       int64_t num_experts, int64_t max_rows_per_expert, TacticFamily family, const char* op) {
  TORCH_CHECK(tactic >= kMoeDecodeTactic, op, ": tactic must be -2 (the decode kernel), -1 (automatic) or a grouped "
              "GEMM tactic >= 0, got ", tactic);
  const bool fits = sm90::moe_decode_gemm_fits(n, k_bytes, num_experts);
  if (tactic == kMoeDecodeTactic) {
    TORCH_CHECK(fits, op, ": tactic ", tactic, " (the decode kernel) needs N % 64 == 0 and K * element_size % ",
                sm90::kMoeDecodeStepBytes, " == 0, got N=", n, " and ", k_bytes, " bytes of K");
    return true;
  }
  const int64_t routed_rows = expected_rows >= 0 ? expected_rows : rows;
  const bool few_rows = routed_rows <= max_rows_per_expert * num_experts;
  if (tactic != -1 || !fits || !few_rows || tactic_override_sm90(family) >= 0) return false;
  const int64_t ctas = std::min(rows, num_experts) * (n / 64);  // the grid (CTAs of experts without rows exit)
  return ctas >= at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

// Whether the decode kernel can take activations `a` that it quantizes (quantize_a: bfloat16 a with
// e4m3 weights) itself: with a static scale always; with a dynamic one each CTA takes the amax
// over all of a, so up to sm90::kMoeDecodeMaxAmaxElements. Forced (tactic -2), it must.
bool decode_takes_activations(bool quantize_a, bool static_scale, int64_t numel, int64_t tactic, const char* a_name,
                              const char* op) {
  const bool fits = !quantize_a || static_scale || numel <= sm90::kMoeDecodeMaxAmaxElements;
  TORCH_CHECK(fits || tactic > kMoeDecodeTactic, op, ": the decode kernel quantizes ", a_name,
              " with a dynamic scale for up to ", sm90::kMoeDecodeMaxAmaxElements, " elements, got ", numel);
  return fits;
}

// The decode kernel's arguments shared by both GEMMs: a [tokens, K] (GEMM2: tokens = rows), w
// [E, n, K], out; w_scale: the contiguous weight scales or undefined.
sm90::MoeDecodeGemmArgs decode_gemm_args(const at::Tensor& a, const at::Tensor& w, const at::Tensor& expert_offsets,
                                         int64_t rows, const c10::optional<at::Tensor>& a_scale, bool quantize_a,
                                         const at::Tensor& w_scale, at::Tensor& out) {
  sm90::MoeDecodeGemmArgs d;
  d.a = a.data_ptr();
  d.a_rows = rows;
  d.w = w.data_ptr();
  d.offsets = expert_offsets.data_ptr<int32_t>();
  d.num_experts = static_cast<int>(w.size(0));
  d.rows = rows;
  d.n = w.size(1);
  d.k_bytes = a.size(1) * w.element_size();
  d.a_scale = a_scale ? a_scale->data_ptr<float>() : nullptr;
  d.quantize_a = quantize_a;
  d.a_elements = a.numel();
  d.w_scale = w_scale.defined() ? w_scale.data_ptr<float>() : nullptr;
  d.out = out.data_ptr();
  return d;
}

sm90::MoeDecodeElement decode_element(const at::Tensor& a) {
  return a.scalar_type() == at::kBFloat16 ? sm90::MoeDecodeElement::kBFloat16
         : a.scalar_type() == at::kHalf   ? sm90::MoeDecodeElement::kHalf
                                          : sm90::MoeDecodeElement::kE4m3;
}

// GEMM1 into `out`: gather, grouped GEMM, SwiGLU, their buffers carved out of one byte workspace
// (moe_gemm1_workspace); an empty workspace is allocated here (one-shot calls, traced code).
void gemm1_into(const at::Tensor& x_in, const at::Tensor& w1, const at::Tensor& permuted_to_expanded,
                const at::Tensor& expert_offsets, int64_t top_k, bool enable_pdl,
                const c10::optional<at::Tensor>& clamp_limits_in, int64_t tactic, const c10::optional<at::Tensor>& x_scale,
                const c10::optional<at::Tensor>& w1_scale, int64_t expected_routes, const MoeGemm1Shape& s,
                at::Tensor& out, const at::Tensor& workspace_in, bool zero_tail,
                const c10::optional<at::Tensor>& expanded_to_permuted, bool w1_gate_up, const char* op) {
  const int64_t expected_rows = check_expected_routes(expected_routes, op);
  const bool quantize_x =
      check_moe_gemm_input(x_in, x_scale, w1, w1_scale, "x", "w1", op) == MoeGemmInput::kQuantizeA;
  at::Tensor clamp_limits;
  if (clamp_limits_in) {
    check_clamp_limits(*clamp_limits_in, w1.size(0), x_in, op);
    clamp_limits = clamp_limits_in->contiguous();
  }
  check_gemm_dtype(x_in, op);
  TORCH_CHECK(w1.is_contiguous() && permuted_to_expanded.is_contiguous() && expert_offsets.is_contiguous(), op,
              ": w1, permuted_to_expanded and expert_offsets must be contiguous");
  TORCH_CHECK(!expanded_to_permuted || expanded_to_permuted->is_contiguous(), op,
              ": expanded_to_permuted must be contiguous");
  // 16-byte rows of x and of the gathered GEMM operand (w1's dtype).
  const int64_t row_elements = 16 / std::min(x_in.element_size(), w1.element_size());
  TORCH_CHECK(x_in.size(1) % row_elements == 0, op, ": CUDA kernels need 16-byte rows (hidden % ", row_elements,
              " == 0), got hidden=", x_in.size(1));
  TORCH_CHECK(top_k <= INT32_MAX, op, ": top_k must fit in int32");
  c10::cuda::CUDAGuard guard(x_in.device());
  select_kernel_arch(x_in.get_device(), op);
  const auto x = x_in.contiguous();
  TORCH_CHECK(aligned16(x) && aligned16(out), op, ": x and out must be 16-byte aligned");
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.get_device());
  // The GEMM's element type: w1's (bfloat16 x quantized to e4m3 on its way in).
  const auto h_dtype = moe_gemm_out_dtype(w1);
  // A caller's workspace is checked whichever kernel runs (the decode kernel needs none).
  const auto layout = moe_gemm1_workspace(s.rows, x.size(1), s.intermediate, w1.size(0), w1.element_size());
  TORCH_CHECK(workspace_in.numel() == 0 ||
                  (workspace_in.scalar_type() == at::kByte && workspace_in.dim() == 1 && workspace_in.is_contiguous() &&
                   workspace_in.numel() >= layout.total && workspace_in.device() == x.device() &&
                   aligned16(workspace_in)),
              op, ": workspace must be a contiguous uint8 tensor of at least ", layout.total, " bytes on ", x.device(),
              " (cake_ops._C.moe_gemm1_workspace_size), got ", workspace_in.scalar_type(), " ", workspace_in.sizes(),
              " on ", workspace_in.device());
  if (decode_takes_activations(quantize_x, x_scale.has_value(), x.numel(), tactic, "x", op) &&
      use_decode_kernel(tactic, s.rows, expected_rows, w1.size(1), x.size(1) * w1.element_size(), w1.size(0),
                        kMoeDecodeGemm1MaxRowsPerExpert, tactic_family(GroupedGemmOp::kFwd, w1.scalar_type(), h_dtype),
                        op)) {
    TORCH_CHECK(aligned16(w1), op, ": w1 must be 16-byte aligned");
    const at::Tensor w1_scale_contiguous = w1_scale ? w1_scale->contiguous() : at::Tensor();
    auto a = decode_gemm_args(x, w1, expert_offsets, s.rows, x_scale, quantize_x, w1_scale_contiguous, out);
    a.permuted_to_expanded = permuted_to_expanded.data_ptr<int32_t>();
    a.top_k = static_cast<int>(top_k);
    a.limits = clamp_limits.defined() ? clamp_limits.data_ptr<float>() : nullptr;
    a.w_gate_up = w1_gate_up;
    sm90::moe_decode_gemm(a, decode_element(w1), /*swiglu=*/true, stream, enable_pdl);
    return;
  }
  const auto workspace =
      workspace_in.numel() == 0 ? at::empty({layout.total}, x.options().dtype(at::kByte)) : workspace_in;
  auto gathered = workspace.narrow(0, 0, layout.gathered_bytes).view(w1.scalar_type()).view({s.rows, x.size(1)});
  auto h = workspace.narrow(0, layout.h_offset, layout.h_bytes).view(h_dtype).view({s.rows, 2 * s.intermediate});
  auto gemm_workspace = workspace.narrow(0, layout.gemm_offset, layout.gemm_bytes);

  auto shape = check_fwd(gathered, w1, expert_offsets, op, /*allow_e4m3=*/true);
  shape.expected_rows = expected_rows;
  const float* limits = clamp_limits.defined() ? clamp_limits.data_ptr<float>() : nullptr;
  // 16-bit x: the GEMM's mainloop reads the routes' rows of x itself, where the chosen tile has such a twin.
  // w1 as [gate; up] halves: the tile's gate-up twins (bf16), else the plain GEMM and the SwiGLU kernel.
  if (!quantize_x && run_grouped_gemm_gather_swiglu_cuda(shape, x, w1, expert_offsets,
                                                         permuted_to_expanded.data_ptr<int32_t>(), s.rows,
                                                         static_cast<int>(top_k), out, limits, op, enable_pdl,
                                                         tactic, gemm_workspace, zero_tail, w1_gate_up)) {
    return;
  }
  const int32_t* num_kept = expert_offsets.data_ptr<int32_t>() + w1.size(0);
  sm90::GatherInverse inverse;
  inverse.scratch = reinterpret_cast<int32_t*>(workspace.data_ptr<uint8_t>() + layout.inverse_offset);
  if (expanded_to_permuted) inverse.expanded_to_permuted = expanded_to_permuted->data_ptr<int32_t>();
  c10::optional<at::Tensor> gathered_scale = x_scale;
  if (quantize_x) {
    // [0]: the scale the gather quantizes with (what the GEMM scales by), [1]: a dynamic scale's amax.
    auto slots = workspace.narrow(0, layout.scale_offset, 2 * sizeof(float)).view(at::kFloat);
    sm90::moe_gather_quantize_rows(x.data_ptr(), x.size(0), x.size(1), permuted_to_expanded.data_ptr<int32_t>(),
                                   static_cast<int>(top_k), num_kept, s.rows,
                                   x_scale ? x_scale->data_ptr<float>() : nullptr, slots.data_ptr<float>(),
                                   gathered.data_ptr(), inverse, stream, enable_pdl);
    gathered_scale = slots.narrow(0, 0, 1);
  } else {
    sm90::moe_gather_rows(x.data_ptr(), x.size(1) * x.element_size(), permuted_to_expanded.data_ptr<int32_t>(),
                          static_cast<int>(top_k), num_kept, s.rows, gathered.data_ptr(), inverse, stream,
                          enable_pdl);
  }
  at::Tensor w1_scale_contiguous;
  const auto scales = gemm_scales(gathered_scale, w1_scale, w1_scale_contiguous);
  // The SwiGLU in the GEMM's epilogue, where the chosen tile has such a twin: h is never stored.
  if (run_grouped_gemm_swiglu_cuda(shape, gathered, w1, expert_offsets, out, limits, op, enable_pdl, tactic,
                                   gemm_workspace, zero_tail, scales, w1_gate_up)) {
    return;
  }
  // h rows past the last expert's end stay unwritten: the SwiGLU writes zeros there unread.
  run_grouped_gemm_cuda(GroupedGemmOp::kFwd, shape, gathered, w1, expert_offsets, h, op, enable_pdl,
                        /*zero_tail=*/false, tactic, &gemm_workspace, scales);
  sm90::moe_swiglu(h.data_ptr(), s.rows, s.intermediate, expert_offsets.data_ptr<int32_t>(),
                   static_cast<int>(w1.size(0)), limits, w1_gate_up, out.data_ptr(), h_dtype == at::kBFloat16, stream,
                   enable_pdl);
}

at::Tensor moe_gemm1_swiglu_cuda(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& permuted_to_expanded,
                                 const at::Tensor& expert_offsets, int64_t top_k, bool enable_pdl,
                                 const c10::optional<at::Tensor>& clamp_limits, int64_t tactic,
                                 const c10::optional<at::Tensor>& x_scale, const c10::optional<at::Tensor>& w1_scale,
                                 int64_t expected_routes, bool zero_tail,
                                 const c10::optional<at::Tensor>& expanded_to_permuted, bool w1_gate_up) {
  const char* op = "cake::moe_gemm1_swiglu";
  const auto s = check_moe_gemm1(x, w1, permuted_to_expanded, expert_offsets, top_k, op, expanded_to_permuted);
  auto out = at::empty({s.rows, s.intermediate}, x.options().dtype(moe_gemm_out_dtype(x)));
  gemm1_into(x, w1, permuted_to_expanded, expert_offsets, top_k, enable_pdl, clamp_limits, tactic, x_scale, w1_scale,
             expected_routes, s, out, at::empty({0}, x.options().dtype(at::kByte)), zero_tail, expanded_to_permuted,
             w1_gate_up, op);
  return out;
}

void moe_gemm1_swiglu_out_cuda(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& permuted_to_expanded,
                               const at::Tensor& expert_offsets, int64_t top_k, at::Tensor out, at::Tensor workspace,
                               bool enable_pdl, const c10::optional<at::Tensor>& clamp_limits, int64_t tactic,
                               const c10::optional<at::Tensor>& x_scale, const c10::optional<at::Tensor>& w1_scale,
                               int64_t expected_routes, bool zero_tail,
                               const c10::optional<at::Tensor>& expanded_to_permuted, bool w1_gate_up) {
  const char* op = "cake::moe_gemm1_swiglu_out";
  const auto s = check_moe_gemm1(x, w1, permuted_to_expanded, expert_offsets, top_k, op, expanded_to_permuted);
  check_out(out, {s.rows, s.intermediate}, moe_gemm_out_dtype(x), x, op);
  gemm1_into(x, w1, permuted_to_expanded, expert_offsets, top_k, enable_pdl, clamp_limits, tactic, x_scale, w1_scale,
             expected_routes, s, out, workspace, zero_tail, expanded_to_permuted, w1_gate_up, op);
}

void quantize_into(const at::Tensor& x_in, const c10::optional<at::Tensor>& scale, at::Tensor& out,
                   at::Tensor& scale_out, const char* op);

// GEMM2 into `out`. Rows past the last expert's end stay unwritten (the schema's contract): no
// route reads them.
void gemm2_into(const at::Tensor& intermediate, const at::Tensor& w2, const at::Tensor& expert_offsets,
                const GroupedGemmShape& shape, at::Tensor& out, at::Tensor* workspace, bool enable_pdl,
                int64_t tactic, const c10::optional<at::Tensor>& a_scale, const c10::optional<at::Tensor>& w2_scale,
                const char* op) {
  check_gemm_dtype(intermediate, op);
  const bool quantize_a = check_moe_gemm_input(intermediate, a_scale, w2, w2_scale, "intermediate", "w2", op) ==
                          MoeGemmInput::kQuantizeA;
  c10::cuda::CUDAGuard guard(intermediate.device());
  select_kernel_arch(intermediate.get_device(), op);
  at::Tensor w2_scale_contiguous;
  const int64_t k_bytes = shape.k * w2.element_size();
  const auto family = tactic_family(GroupedGemmOp::kFwd, w2.scalar_type(), out.scalar_type());
  // bfloat16 activations with e4m3 w2 (fc2 folding requant in): the decode kernel quantizes them
  // while staging whenever it takes them (a dynamic scale: each CTA's amax over all of them), so
  // that a prepared launch allocates nothing; else a quantized copy for the grouped GEMM.
  const bool decode =
      decode_takes_activations(quantize_a, a_scale.has_value(), intermediate.numel(), tactic, "the intermediate",
                               op) &&
      (use_decode_kernel(tactic, shape.sum_m, shape.expected_rows, shape.n, k_bytes, shape.num_groups,
                         kMoeDecodeGemm2MaxRowsPerExpert, family, op) ||
       (quantize_a && tactic == -1 && sm90::moe_decode_gemm_fits(shape.n, k_bytes, shape.num_groups)));
  if (decode) {
    const auto a_in = intermediate.contiguous();
    TORCH_CHECK(w2.is_contiguous() && expert_offsets.is_contiguous() && aligned16(a_in) && aligned16(out) &&
                    aligned16(w2),
                op, ": the decode kernel needs contiguous, 16-byte aligned operands");
    if (w2_scale) w2_scale_contiguous = w2_scale->contiguous();
    sm90::moe_decode_gemm(
        decode_gemm_args(a_in, w2, expert_offsets, shape.sum_m, a_scale, quantize_a, w2_scale_contiguous, out),
        decode_element(w2), /*swiglu=*/false, at::cuda::getCurrentCUDAStream(intermediate.get_device()), enable_pdl);
    return;
  }
  if (quantize_a) {
    auto a = at::empty(intermediate.sizes(), intermediate.options().dtype(at::kFloat8_e4m3fn));
    auto scale = at::empty({1}, intermediate.options().dtype(at::kFloat));
    quantize_into(intermediate, a_scale, a, scale, op);
    run_grouped_gemm_cuda(GroupedGemmOp::kFwd, shape, a, w2, expert_offsets, out, op, enable_pdl,
                          /*zero_tail=*/false, tactic, workspace, gemm_scales(scale, w2_scale, w2_scale_contiguous));
    return;
  }
  run_grouped_gemm_cuda(GroupedGemmOp::kFwd, shape, intermediate, w2, expert_offsets, out, op, enable_pdl,
                        /*zero_tail=*/false, tactic, workspace, gemm_scales(a_scale, w2_scale, w2_scale_contiguous));
}

at::Tensor moe_gemm2_cuda(const at::Tensor& intermediate, const at::Tensor& w2, const at::Tensor& expert_offsets,
                          bool enable_pdl, int64_t tactic, const c10::optional<at::Tensor>& a_scale,
                          const c10::optional<at::Tensor>& w2_scale, int64_t expected_routes) {
  const char* op = "cake::moe_gemm2";
  auto shape = check_fwd(intermediate, w2, expert_offsets, op, /*allow_e4m3=*/true);
  shape.expected_rows = check_expected_routes(expected_routes, op);
  auto out = at::empty({shape.sum_m, shape.n}, intermediate.options().dtype(moe_gemm_out_dtype(intermediate)));
  gemm2_into(intermediate, w2, expert_offsets, shape, out, nullptr, enable_pdl, tactic, a_scale, w2_scale, op);
  return out;
}

void moe_gemm2_out_cuda(const at::Tensor& intermediate, const at::Tensor& w2, const at::Tensor& expert_offsets,
                        at::Tensor out, at::Tensor workspace, bool enable_pdl, int64_t tactic,
                        const c10::optional<at::Tensor>& a_scale, const c10::optional<at::Tensor>& w2_scale,
                        int64_t expected_routes) {
  const char* op = "cake::moe_gemm2_out";
  auto shape = check_moe_gemm2_out(intermediate, w2, expert_offsets, out, workspace, op);
  shape.expected_rows = check_expected_routes(expected_routes, op);
  gemm2_into(intermediate, w2, expert_offsets, shape, out, workspace.numel() == 0 ? nullptr : &workspace, enable_pdl,
             tactic, a_scale, w2_scale, op);
}

void quantize_into(const at::Tensor& x_in, const c10::optional<at::Tensor>& scale, at::Tensor& out,
                   at::Tensor& scale_out, const char* op) {
  TORCH_CHECK(aligned16(out), op, ": out must be 16-byte aligned");
  c10::cuda::CUDAGuard guard(x_in.device());
  select_kernel_arch(x_in.get_device(), op);
  auto x = x_in.contiguous();
  if (!aligned16(x)) x = x.clone();  // a storage offset: the kernels read 16-byte vectors
  sm90::fp8_quantize(x.data_ptr(), float_type(x), x.numel(), scale ? scale->data_ptr<float>() : nullptr,
                     out.data_ptr(), scale_out.data_ptr<float>(), at::cuda::getCurrentCUDAStream(x.get_device()),
                     /*pdl=*/true);
}

std::tuple<at::Tensor, at::Tensor> quantize_fp8_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& scale) {
  const char* op = "cake::quantize_fp8";
  check_quantize_fp8(x, scale, op);
  auto out = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
  auto scale_out = at::empty({1}, x.options().dtype(at::kFloat));
  quantize_into(x, scale, out, scale_out, op);
  return {out, scale_out};
}

void quantize_fp8_out_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& scale, at::Tensor out,
                           at::Tensor scale_out) {
  const char* op = "cake::quantize_fp8_out";
  check_quantize_fp8(x, scale, op);
  check_quantize_fp8_out(x, out, scale_out, op);
  quantize_into(x, scale, out, scale_out, op);
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

std::tuple<at::Tensor, at::Tensor> moe_finalize_backward_cuda(const at::Tensor& grad_in,
                                                              const at::Tensor& expanded_to_permuted_in,
                                                              const at::Tensor& scales_in, int64_t num_rows,
                                                              const c10::optional<at::Tensor>& rows_in) {
  const char* op = "cake::moe_finalize_backward";
  const auto s = check_moe_finalize_backward(grad_in, expanded_to_permuted_in, scales_in, num_rows, rows_in, op);
  TORCH_CHECK(grad_in.scalar_type() == at::kBFloat16 || grad_in.scalar_type() == at::kHalf, op,
              ": CUDA kernels take bfloat16 or float16 grad_output, got ", grad_in.scalar_type());
  TORCH_CHECK(s.hidden % 8 == 0, op, ": CUDA kernels need hidden % 8 == 0 (16-byte rows), got ", s.hidden);
  TORCH_CHECK(s.num_tokens * s.top_k <= INT32_MAX && s.top_k <= INT32_MAX, op,
              ": CUDA kernels take at most 2^31 - 1 routes, got ", s.num_tokens * s.top_k);
  c10::cuda::CUDAGuard guard(grad_in.device());
  select_kernel_arch(grad_in.get_device(), op);
  const auto grad = grad_in.contiguous();
  const auto expanded_to_permuted = expanded_to_permuted_in.contiguous();
  const auto scales = scales_in.contiguous();
  const auto rows = rows_in.has_value() ? rows_in->contiguous() : at::Tensor();
  TORCH_CHECK(aligned16(grad) && (!rows.defined() || aligned16(rows)), op,
              ": grad_output and permuted_rows must be 16-byte aligned");
  auto rows_grad = at::empty({num_rows, s.hidden}, grad.options());
  auto scales_grad = rows.defined() ? at::empty({s.num_tokens, s.top_k}, scales.options())
                                    : at::empty({0}, scales.options());
  auto route_of_row = at::full({num_rows}, -1, expanded_to_permuted.options());
  sm90::moe_finalize_backward(grad.data_ptr(), rows.defined() ? rows.data_ptr() : nullptr,
                              expanded_to_permuted.data_ptr<int32_t>(), scales.data_ptr<float>(), s.num_tokens,
                              static_cast<int>(s.top_k), num_rows, s.hidden, route_of_row.data_ptr<int32_t>(),
                              rows_grad.data_ptr(), rows.defined() ? scales_grad.data_ptr<float>() : nullptr,
                              grad.scalar_type() == at::kBFloat16, at::cuda::getCurrentCUDAStream(grad.get_device()));
  return {rows_grad, scales_grad};
}

// The SwiGLU kernels read 16-byte vectors: a tensor that is not a contiguous, aligned [rows, 2I] is copied first.
at::Tensor swiglu_operand(const at::Tensor& t, int64_t inter, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf, op,
              ": CUDA kernels take bfloat16 or float16, got ", t.scalar_type());
  TORCH_CHECK(inter % 8 == 0, op, ": CUDA kernels need I % 8 == 0 (16-byte halves), got I = ", inter);
  return t.is_contiguous() && aligned16(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}

at::Tensor swiglu_cuda(const at::Tensor& gate_up_in, std::optional<double> limit) {
  const char* op = "cake::swiglu";
  const int64_t inter = check_swiglu(gate_up_in, op);
  const float clamp_limit = check_swiglu_limit(limit, op);
  c10::cuda::CUDAGuard guard(gate_up_in.device());
  select_kernel_arch(gate_up_in.get_device(), op);
  const auto gate_up = swiglu_operand(gate_up_in, inter, op);
  auto out = at::empty({gate_up.size(0), inter}, gate_up.options());
  sm90::moe_swiglu(gate_up.data_ptr(), gate_up.size(0), inter, /*offsets=*/nullptr, 0, /*limits=*/nullptr,
                   /*gate_up=*/true, out.data_ptr(), gate_up.scalar_type() == at::kBFloat16,
                   at::cuda::getCurrentCUDAStream(gate_up.get_device()), /*pdl=*/false, clamp_limit);
  return out;
}

at::Tensor swiglu_backward_cuda(const at::Tensor& grad_in, const at::Tensor& gate_up_in, std::optional<double> limit) {
  const char* op = "cake::swiglu_backward";
  const int64_t inter = check_swiglu(gate_up_in, op);
  check_swiglu_grad(grad_in, gate_up_in, inter, op);
  const float clamp_limit = check_swiglu_limit(limit, op);
  c10::cuda::CUDAGuard guard(gate_up_in.device());
  select_kernel_arch(gate_up_in.get_device(), op);
  const auto gate_up = swiglu_operand(gate_up_in, inter, op), grad = swiglu_operand(grad_in, inter, op);
  auto d_gate_up = at::empty_like(gate_up);
  sm90::swiglu_backward(grad.data_ptr(), gate_up.data_ptr(), gate_up.size(0), inter, d_gate_up.data_ptr(),
                        gate_up.scalar_type() == at::kBFloat16, at::cuda::getCurrentCUDAStream(gate_up.get_device()),
                        clamp_limit);
  return d_gate_up;
}

void moe_gemm2_finalize_out_cuda(const at::Tensor& intermediate_in, const at::Tensor& w2,
                                 const at::Tensor& expert_offsets, const at::Tensor& permuted_to_expanded_in,
                                 const at::Tensor& expanded_to_permuted, const at::Tensor& scales_in, at::Tensor out,
                                 bool enable_pdl, int64_t tactic, int64_t expected_routes) {
  const char* op = "cake::moe_gemm2_finalize_out";
  auto s = check_moe_gemm2_finalize_out(intermediate_in, w2, expert_offsets, permuted_to_expanded_in,
                                        expanded_to_permuted, scales_in, out, op);
  s.gemm.expected_rows = check_expected_routes(expected_routes, op);
  check_gemm_dtype(intermediate_in, op);
  c10::cuda::CUDAGuard guard(intermediate_in.device());
  select_kernel_arch(intermediate_in.get_device(), op);
  const auto family = tactic_family(GroupedGemmOp::kFwd, w2.scalar_type(), out.scalar_type());
  const bool decode =
      use_decode_kernel(tactic, s.gemm.sum_m, s.gemm.expected_rows, s.gemm.n, s.gemm.k * w2.element_size(),
                        s.gemm.num_groups, kMoeDecodeGemm2MaxRowsPerExpert, family, op);
  if (!decode && s.finalize.num_tokens > 0) {
    const auto intermediate = intermediate_in.contiguous();
    const auto permuted_to_expanded = permuted_to_expanded_in.contiguous();
    const auto scales = scales_in.contiguous();
    auto workspace = at::empty({grouped_gemm_workspace_bytes(s.gemm.num_groups)}, out.options().dtype(at::kByte));
    if (run_grouped_gemm_scatter_cuda(s.gemm, intermediate, w2, expert_offsets, permuted_to_expanded, scales, out, op,
                                      enable_pdl, tactic, workspace)) {
      return;
    }
  }
  // Decode sizes (the decode kernel's GEMM2) and tiles without a scatter twin: GEMM2, then the
  // fixed-order combine (the fused finalize's contract allows either order).
  auto rows = at::empty({s.gemm.sum_m, s.gemm.n}, out.options());
  gemm2_into(intermediate_in, w2, expert_offsets, s.gemm, rows, nullptr, enable_pdl, tactic, c10::nullopt,
             c10::nullopt, op);
  finalize_into(rows, expanded_to_permuted, scales_in, s.finalize, out, enable_pdl, op);
}

void moe_finalize_out_cuda(const at::Tensor& rows, const at::Tensor& expanded_to_permuted, const at::Tensor& scales,
                           at::Tensor out, bool enable_pdl) {
  const char* op = "cake::moe_finalize_out";
  const auto s = check_moe_finalize(rows, expanded_to_permuted, scales, op);
  check_moe_finalize_out(out, s, rows, op);
  finalize_into(rows, expanded_to_permuted, scales, s, out, enable_pdl, op);
}

void moe_forward_out_cuda(const at::Tensor& x_in, const at::Tensor& ids_in, const at::Tensor& scales_in,
                          const at::Tensor& w1, const at::Tensor& w2, int64_t local_expert_offset, at::Tensor out,
                          at::Tensor workspace, bool enable_pdl, const c10::optional<at::Tensor>& clamp_limits,
                          const c10::optional<at::Tensor>& x_scale, const c10::optional<at::Tensor>& w1_scale,
                          const c10::optional<at::Tensor>& fc2_scale, const c10::optional<at::Tensor>& w2_scale,
                          int64_t expected_routes, bool w1_gate_up) {
  const char* op = "cake::moe_forward_out";
  const auto s = check_moe_forward_out(x_in, ids_in, scales_in, w1, w2, local_expert_offset, out, workspace,
                                       clamp_limits, x_scale, w1_scale, fc2_scale, w2_scale, op);
  check_expected_routes(expected_routes, op);
  if (s.num_tokens == 0) return;
  c10::cuda::CUDAGuard guard(x_in.device());
  select_kernel_arch(x_in.get_device(), op);
  const auto x = x_in.contiguous();
  const auto ids = ids_in.contiguous();
  const auto scales = scales_in.contiguous();
  const int64_t routes = s.num_tokens * s.top_k;
  if (aligned16(x) && aligned16(out) &&
      sm90::moe_decode_layer_fits(routes, s.hidden, s.intermediate, w1.element_size())) {
    // The layer kernel's h, y and slice sums (moe_forward_workspace_bytes).
    auto scratch = workspace.numel() > 0
                       ? workspace
                       : at::empty({moe_forward_workspace_bytes(routes, s.hidden, s.intermediate)},
                                   x.options().dtype(at::kByte));
    TORCH_CHECK(aligned16(scratch), op, ": workspace must be 16-byte aligned");
    sm90::MoeDecodeLayerArgs a;
    a.x = x.data_ptr();
    a.tokens = s.num_tokens;
    a.top_k = static_cast<int>(s.top_k);
    a.ids = ids.data_ptr<int32_t>();
    a.scales = scales.data_ptr<float>();
    a.local_offset = local_expert_offset;
    a.num_local = s.num_local_experts;
    a.w1 = w1.data_ptr();
    a.w1_gate_up = w1_gate_up;
    a.w2 = w2.data_ptr();
    a.hidden = s.hidden;
    a.inter = s.intermediate;
    const auto contiguous_ptr = [](const c10::optional<at::Tensor>& t, c10::optional<at::Tensor>& keep) {
      if (!t) return static_cast<const float*>(nullptr);
      keep = t->contiguous();
      return static_cast<const float*>(keep->data_ptr<float>());
    };
    c10::optional<at::Tensor> keep[5];
    a.x_scale = contiguous_ptr(x_scale, keep[0]);
    a.fc2_scale = contiguous_ptr(fc2_scale, keep[1]);
    a.w1_scale = contiguous_ptr(w1_scale, keep[2]);
    a.w2_scale = contiguous_ptr(w2_scale, keep[3]);
    a.limits = contiguous_ptr(clamp_limits, keep[4]);
    static_assert(kMoeForwardSliceBytes == sm90::kMoeDecodeSliceBytes, "the workspace's slices are the kernel's");
    auto* bytes = static_cast<uint8_t*>(scratch.data_ptr());
    a.h = bytes;
    a.y = bytes + routes * s.intermediate * 2;
    a.alphas = reinterpret_cast<float*>(bytes + routes * (s.intermediate + s.hidden) * 2);
    a.slice_sums = a.alphas + kMoeForwardSplitItems;
    a.split_items = static_cast<int>(kMoeForwardSplitItems);
    // A launch that spreads no phase keeps fp8's per-item h amaxes there (routes * I / 32 floats; the
    // fp8 layer takes routes * I <= kMoeDecodeMaxAmaxElements; the slice sums hold at least 64 per item).
    static_assert(sm90::kMoeDecodeMaxAmaxElements / 32 <= kMoeForwardSplitItems * 64, "the h amaxes fit");
    a.expected_routes = expected_routes;
    a.out = out.data_ptr();
    const auto element = s.fp8 ? sm90::MoeDecodeElement::kE4m3
                         : x.scalar_type() == at::kHalf ? sm90::MoeDecodeElement::kHalf
                                                        : sm90::MoeDecodeElement::kBFloat16;
    sm90::moe_decode_layer(a, element, at::cuda::getCurrentCUDAStream(x.get_device()), enable_pdl);
    return;
  }
  // Ids outside the shard are dropped whatever num_experts, so the shard's end serves as it.
  const auto sorted = moe_sort_cuda(ids, local_expert_offset + s.num_local_experts, s.num_local_experts,
                                    local_expert_offset, /*tile_size=*/128);
  const auto& offsets = std::get<1>(sorted);
  const auto h = moe_gemm1_swiglu_cuda(x, w1, std::get<2>(sorted), offsets, s.top_k, enable_pdl, clamp_limits, -1,
                                       x_scale, w1_scale, expected_routes, /*zero_tail=*/false, std::get<3>(sorted),
                                       w1_gate_up);
  const auto rows = moe_gemm2_cuda(h, w2, offsets, enable_pdl, -1, fc2_scale, w2_scale, expected_routes);
  moe_finalize_out_cuda(rows, std::get<3>(sorted), scales, out, enable_pdl);
}

// The routing kernel, then moe_forward_out (at decode sizes the layer kernel; PDL chains the two).
// Routing inside the layer kernel was measured slower than this pair (benchmarks/NOTES.md,
// session 13).
void moe_forward_from_logits_out_cuda(const at::Tensor& x, const at::Tensor& logits_in, const at::Tensor& w1,
                                      const at::Tensor& w2, int64_t local_expert_offset, at::Tensor ids,
                                      at::Tensor scales, at::Tensor out, at::Tensor workspace, bool enable_pdl,
                                      const c10::optional<at::Tensor>& clamp_limits,
                                      const c10::optional<at::Tensor>& x_scale,
                                      const c10::optional<at::Tensor>& w1_scale,
                                      const c10::optional<at::Tensor>& fc2_scale,
                                      const c10::optional<at::Tensor>& w2_scale) {
  const char* op = "cake::moe_forward_from_logits_out";
  const auto s = check_moe_forward_from_logits_out(x, logits_in, w1, w2, local_expert_offset, ids, scales, out,
                                                   workspace, clamp_limits, x_scale, w1_scale, fc2_scale, w2_scale, op);
  if (s.num_tokens == 0) return;
  const int64_t num_experts = logits_in.size(1);
  TORCH_CHECK(num_experts <= sm90::kMoeRoutingMaxExperts && s.top_k <= sm90::kMoeRoutingMaxTopK, op,
              ": CUDA kernels take at most ", sm90::kMoeRoutingMaxExperts, " experts and top_k <= ",
              sm90::kMoeRoutingMaxTopK, ", got ", num_experts, " and ", s.top_k);
  c10::cuda::CUDAGuard guard(x.device());
  select_kernel_arch(x.get_device(), op);
  const auto logits = logits_in.contiguous();
  sm90::moe_topk_softmax(logits.data_ptr(), float_type(logits), s.num_tokens, static_cast<int>(num_experts),
                         static_cast<int>(s.top_k), ids.data_ptr<int32_t>(), scales.data_ptr<float>(),
                         at::cuda::getCurrentCUDAStream(x.get_device()), enable_pdl);
  moe_forward_out_cuda(x, ids, scales, w1, w2, local_expert_offset, out, workspace, enable_pdl, clamp_limits, x_scale,
                       w1_scale, fc2_scale, w2_scale,
                       moe_expected_routes(s.num_tokens * s.top_k, s.num_local_experts, num_experts),
                       /*w1_gate_up=*/false);
}

}  // namespace

TORCH_LIBRARY_IMPL(cake, CUDA, m) {
  m.impl("moe_sort", &moe_sort_cuda);
  m.impl("moe_routing", &moe_routing_cuda);
  m.impl("moe_routing_out", &moe_routing_out_cuda);
  m.impl("moe_gemm1_swiglu_out", &moe_gemm1_swiglu_out_cuda);
  m.impl("moe_gemm1_swiglu", &moe_gemm1_swiglu_cuda);
  m.impl("moe_gemm2", &moe_gemm2_cuda);
  m.impl("moe_gemm2_out", &moe_gemm2_out_cuda);
  m.impl("quantize_fp8", &quantize_fp8_cuda);
  m.impl("quantize_fp8_out", &quantize_fp8_out_cuda);
  m.impl("moe_finalize", &moe_finalize_cuda);
  m.impl("moe_gemm2_finalize_out", &moe_gemm2_finalize_out_cuda);
  m.impl("moe_finalize_out", &moe_finalize_out_cuda);
  m.impl("moe_finalize_backward", &moe_finalize_backward_cuda);
  m.impl("swiglu", &swiglu_cuda);
  m.impl("swiglu_backward", &swiglu_backward_cuda);
  m.impl("moe_forward_out", &moe_forward_out_cuda);
  m.impl("moe_forward_from_logits_out", &moe_forward_from_logits_out_cuda);
}

}  // namespace cake
