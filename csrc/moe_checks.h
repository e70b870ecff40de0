// Checks of the MoE routing ops shared by every backend.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <optional>

#include "grouped_gemm_checks.h"

namespace cake {

// Workspace of moe_routing_out: the multi-block sort's per-(block, expert) rows, int32. A block
// takes at least kMoeSortRoutesPerStep routes (one warp step), so this bounds every GPU's need.
constexpr int64_t kMoeSortRoutesPerStep = 128;
inline int64_t moe_routing_workspace_bytes(int64_t routes, int64_t num_local_experts) {
  return 4 * ((routes + kMoeSortRoutesPerStep - 1) / kMoeSortRoutesPerStep) * num_local_experts;
}

// Workspace of moe_gemm1_swiglu_out: the gathered rows [rows, H] (w1's element_size bytes each),
// GEMM1's output [rows, 2I] (16-bit: x's dtype, bfloat16 for fp8), the grouped GEMM's own
// workspace and two floats (x quantized on the way in: its scale, and the amax it comes from),
// each at a 256-byte aligned byte offset.
struct MoeGemm1Workspace {
  int64_t gathered_bytes = 0, h_offset = 0, h_bytes = 0, gemm_offset = 0, gemm_bytes = 0, scale_offset = 0,
          inverse_offset = 0, total = 0;
};
MoeGemm1Workspace moe_gemm1_workspace(int64_t rows, int64_t hidden, int64_t intermediate, int64_t num_local_experts,
                                      int64_t element_size);
inline int64_t moe_gemm1_workspace_bytes(int64_t rows, int64_t hidden, int64_t intermediate,
                                         int64_t num_local_experts, int64_t element_size) {
  return moe_gemm1_workspace(rows, hidden, intermediate, num_local_experts, element_size).total;
}

struct MoeSortShape {
  int64_t num_tokens = 0;
  int64_t top_k = 0;
  int64_t num_local_experts = 0;
};

// The shard and tile arguments of the routing ops.
void check_moe_shard(int64_t num_experts, int64_t num_local_experts, int64_t local_expert_offset, int64_t tile_size,
                     const char* op);

MoeSortShape check_moe_sort(const at::Tensor& token_selected_experts, int64_t num_experts,
                            int64_t num_local_experts, int64_t local_expert_offset,
                            int64_t tile_size, const char* op);

struct MoeGemm1Shape {
  int64_t rows = 0;          // T * top_k permuted rows
  int64_t intermediate = 0;  // I (w1 holds 2I rows)
};

// expanded_to_permuted (optional): moe_sort's inverse of permuted_to_expanded, shape and dtype checked here.
MoeGemm1Shape check_moe_gemm1(const at::Tensor& x, const at::Tensor& w1,
                              const at::Tensor& permuted_to_expanded,
                              const at::Tensor& expert_offsets, int64_t top_k, const char* op,
                              const c10::optional<at::Tensor>& expanded_to_permuted = c10::nullopt);

// swiglu / swiglu_backward: gate_up a 2-D float tensor [rows, 2I]; returns I. grad_out [rows, I] of its dtype
// and device.
int64_t check_swiglu(const at::Tensor& gate_up, const char* op);
// swiglu's limit: positive (inf: no clamp), as a float32 (the kernels' arithmetic); none gives inf.
float check_swiglu_limit(const std::optional<double>& limit, const char* op);
void check_swiglu_grad(const at::Tensor& grad_out, const at::Tensor& gate_up, int64_t inter, const char* op);

struct MoeFinalizeShape {
  int64_t num_tokens = 0;
  int64_t top_k = 0;
  int64_t hidden = 0;
};

// `rows` [*, hidden] is named rows_name in messages (moe_finalize's permuted_rows, its backward's grad_output).
MoeFinalizeShape check_moe_finalize(const at::Tensor& rows, const at::Tensor& expanded_to_permuted,
                                    const at::Tensor& token_final_scales, const char* op,
                                    const char* rows_name = "permuted_rows");

// moe_finalize_backward's arguments (permuted_rows optional: [num_rows, hidden] of grad_output's dtype).
MoeFinalizeShape check_moe_finalize_backward(const at::Tensor& grad_output, const at::Tensor& expanded_to_permuted,
                                             const at::Tensor& token_final_scales, int64_t num_rows,
                                             const c10::optional<at::Tensor>& permuted_rows, const char* op);

// clamp_limits of SwiGLUStep: float32 [E_local] on `like`'s device.
void check_clamp_limits(const at::Tensor& limits, int64_t num_local_experts, const at::Tensor& like, const char* op);

// The MoE GEMMs' expected_routes hint: -1 (every row) or a count >= 0; returns it.
int64_t check_expected_routes(int64_t expected_routes, const char* op);
// The expected_routes hint of a shard of num_local of num_experts over `routes` routes: its share
// under even routing, rounded up; -1 (all of them) for the whole set (fused_moe.expected_routes).
inline int64_t moe_expected_routes(int64_t routes, int64_t num_local, int64_t num_experts) {
  return num_local >= num_experts ? -1 : (routes * num_local + num_experts - 1) / num_experts;
}

// moe_routing's arguments: exactly one of router_logits or (topk_ids and topk_weights), then the
// shard (check_moe_shard). Returns the token count.
int64_t check_moe_routing(const c10::optional<at::Tensor>& logits, const c10::optional<at::Tensor>& topk_ids,
                          const c10::optional<at::Tensor>& topk_weights, int64_t top_k, int64_t num_experts,
                          int64_t num_local_experts, int64_t local_expert_offset, int64_t tile_size, const char* op);

// moe_routing_out's arguments: check_moe_routing's, then the caller-owned outputs ([T, k] int32 ids,
// [T, k] float32 weights, [E_local] counts, [E_local + 1] offsets, [T * k] permutations, [E_local + 1]
// tile offsets, all int32 but the weights, contiguous, on the routing input's device) and the byte
// workspace.
void check_moe_routing_out(const c10::optional<at::Tensor>& logits, const c10::optional<at::Tensor>& topk_ids,
                           const c10::optional<at::Tensor>& topk_weights, int64_t top_k, int64_t num_experts,
                           int64_t num_local_experts, int64_t local_expert_offset, int64_t tile_size,
                           const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& counts,
                           const at::Tensor& offsets, const at::Tensor& permuted_to_expanded,
                           const at::Tensor& expanded_to_permuted, const at::Tensor& tile_offsets,
                           const at::Tensor& workspace, const char* op);

// moe_gemm2_out's operands (check_fwd, e4m3 allowed), its out ([T * top_k, H], the GEMM's output
// dtype) and its workspace (uint8, grouped_gemm_workspace_bytes(E_local) bytes, or empty: the op
// allocates one). Returns the GEMM's shape.
GroupedGemmShape check_moe_gemm2_out(const at::Tensor& intermediate, const at::Tensor& w2,
                                     const at::Tensor& expert_offsets, const at::Tensor& out,
                                     const at::Tensor& workspace, const char* op);

// The fp8 scales of a MoE GEMM over activations `a`: float8_e4m3fn activations and weights need
// a_scale (float32, one element) and w_scale (float32 [E_local]) on a's device; 16-bit ones take
// neither. Returns whether the GEMM is fp8.
bool check_moe_gemm_scales(const at::Tensor& a, const c10::optional<at::Tensor>& a_scale,
                           const c10::optional<at::Tensor>& w_scale, int64_t num_local_experts, const char* a_name,
                           const char* op);
// What a MoE GEMM does with its activations a (GEMM1's x, GEMM2's intermediate): 16-bit a and w
// of one dtype, no scales; float8_e4m3fn a and w with their scales (check_moe_gemm_scales); or
// bfloat16 a with float8_e4m3fn w and w's scales, a quantized per tensor on its way in (a_scale:
// its static scale; absent: the dynamic max|a| / 448), bit for bit quantize_fp8 then the
// float8_e4m3fn path.
enum class MoeGemmInput { k16Bit, kFp8, kQuantizeA };
MoeGemmInput check_moe_gemm_input(const at::Tensor& a, const c10::optional<at::Tensor>& a_scale, const at::Tensor& w,
                                  const c10::optional<at::Tensor>& w_scale, const char* a_name, const char* w_name,
                                  const char* op);
// A MoE GEMM's output dtype: bfloat16 for float8_e4m3fn activations, else theirs.
at::ScalarType moe_gemm_out_dtype(const at::Tensor& a);

// quantize_fp8: x bfloat16, float16 or float32; scale absent or float32 with one element on x's
// device. With out / scale_out (the out variant): float8_e4m3fn of x's shape and float32 [1].
void check_quantize_fp8(const at::Tensor& x, const c10::optional<at::Tensor>& scale, const char* op);
void check_quantize_fp8_out(const at::Tensor& x, const at::Tensor& out, const at::Tensor& scale_out, const char* op);
// e4m3's largest finite value, and the least amax a dynamic scale divides (an all-zero tensor
// gets scale kFp8MinAmax / 448, not 0).
constexpr float kE4m3Max = 448.0f;
constexpr float kFp8MinAmax = 1e-12f;

// A caller-owned combine output: [num_tokens, hidden], permuted_rows' dtype and device, contiguous.
void check_moe_finalize_out(const at::Tensor& out, const MoeFinalizeShape& s, const at::Tensor& permuted_rows,
                            const char* op);

// moe_gemm2_finalize_out: GEMM2's operands (16-bit), the routing of moe_finalize and out [num_tokens,
// hidden] of the intermediate's dtype.
struct MoeGemm2FinalizeShape {
  GroupedGemmShape gemm;
  MoeFinalizeShape finalize;
};
MoeGemm2FinalizeShape check_moe_gemm2_finalize_out(const at::Tensor& intermediate, const at::Tensor& w2,
                                                   const at::Tensor& expert_offsets,
                                                   const at::Tensor& permuted_to_expanded,
                                                   const at::Tensor& expanded_to_permuted,
                                                   const at::Tensor& token_final_scales, const at::Tensor& out,
                                                   const char* op);

// moe_forward_out: x [T, H] bfloat16 / float16; token_selected_experts [T, k] int32 and
// token_final_scales [T, k] float32 on x's device; w1 [E_local, 2I, H] and w2 [E_local, H, I]
// contiguous, of x's dtype or both float8_e4m3fn (bfloat16 x, quantized on the way in, with
// w1_scale / w2_scale and optional static x_scale / fc2_scale: check_moe_gemm_input);
// clamp_limits as check_clamp_limits; out [T, H] of x's dtype, contiguous; workspace uint8, empty
// or moe_forward_workspace_bytes(T * top_k, H, I) bytes.
// The layer kernel's h [routes, I] and y [routes, H] (16-bit), then for a phase it spreads over
// CTAs (at most kMoeForwardSplitItems items of 64 weight rows) a float per item and the float32
// sums of each K slice of kMoeForwardSliceBytes (the decode kernel's; bfloat16 has the most).
constexpr int64_t kMoeForwardSplitItems = 256;
constexpr int64_t kMoeForwardSliceBytes = 2048;
inline int64_t moe_forward_max_slices(int64_t hidden, int64_t intermediate) {
  return (2 * std::max(hidden, intermediate) + kMoeForwardSliceBytes - 1) / kMoeForwardSliceBytes;
}
inline int64_t moe_forward_workspace_bytes(int64_t routes, int64_t hidden, int64_t intermediate) {
  return 2 * routes * (intermediate + hidden) +
         4 * kMoeForwardSplitItems * (1 + 64 * moe_forward_max_slices(hidden, intermediate));
}
struct MoeForwardShape {
  int64_t num_tokens = 0, top_k = 0, hidden = 0, intermediate = 0, num_local_experts = 0;
  bool fp8 = false;
};
MoeForwardShape check_moe_forward_out(const at::Tensor& x, const at::Tensor& token_selected_experts,
                                      const at::Tensor& token_final_scales, const at::Tensor& w1, const at::Tensor& w2,
                                      int64_t local_expert_offset, const at::Tensor& out,
                                      const at::Tensor& workspace, const c10::optional<at::Tensor>& clamp_limits,
                                      const c10::optional<at::Tensor>& x_scale,
                                      const c10::optional<at::Tensor>& w1_scale,
                                      const c10::optional<at::Tensor>& fc2_scale,
                                      const c10::optional<at::Tensor>& w2_scale, const char* op);

// moe_forward_from_logits_out: moe_forward_out's tensors, token_selected_experts and
// token_final_scales contiguous (written: the routing's results), router_logits [T, E] on x's device
// as check_moe_routing takes them for the shard [local_expert_offset, + E_local).
MoeForwardShape check_moe_forward_from_logits_out(
    const at::Tensor& x, const at::Tensor& router_logits, const at::Tensor& w1, const at::Tensor& w2,
    int64_t local_expert_offset, const at::Tensor& token_selected_experts, const at::Tensor& token_final_scales,
    const at::Tensor& out, const at::Tensor& workspace, const c10::optional<at::Tensor>& clamp_limits,
    const c10::optional<at::Tensor>& x_scale, const c10::optional<at::Tensor>& w1_scale,
    const c10::optional<at::Tensor>& fc2_scale, const c10::optional<at::Tensor>& w2_scale, const char* op);

}  // namespace cake
