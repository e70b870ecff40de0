// The grouped GEMM on the GPU for other ops' CUDA kernels (the MoE GEMMs): the same kernel
// checks, tactic choice and launch as the grouped GEMM ops, into a caller-owned output.
#pragma once

#include <ATen/core/Tensor.h>

#include "grouped_gemm_checks.h"

namespace cake {

// `s` from check_fwd / check_dgrad / check_wgrad. With `pdl`
// the launch may overlap its predecessor's tail; without `zero_tail` fwd/dgrad leave the rows
// past the last group end unwritten (GroupedGemmParams); `tactic` >= 0 runs that tactic of the
// family (an index into tactics_sm90) instead of the tuned or heuristic choice; `workspace`:
// grouped_gemm_workspace_bytes(E) caller-owned bytes (default: allocated here).
// float8_e4m3fn operands (fwd only, bfloat16 out): group g's output is scaled by
// (*scales.a) * scales.b[g], device float32 pointers checked by the caller.
struct GroupedGemmScales {
  const float* a = nullptr;
  const float* b = nullptr;
};
void run_grouped_gemm_cuda(GroupedGemmOp kind, const GroupedGemmShape& s, const at::Tensor& a,
                           const at::Tensor& b, const at::Tensor& offs, at::Tensor& out,
                           const char* op, bool pdl, bool zero_tail, int64_t tactic = -1,
                           at::Tensor* workspace = nullptr, GroupedGemmScales scales = {});

// The MoE GEMM1 in one kernel: the SwiGLU twin of the fwd tactic (`tactic`, or the tuned or
// heuristic choice) writes SwiGLU(Step)(a @ b[e].T) into out [sum_m, N / 2] (b's up and gate rows
// interleaved at 32; `limits`: group g's SwiGLUStep limit, device float32, or null) and, with
// `zero_tail`, zeroes the rows past the last group end. False, with nothing launched, when that
// tactic has no twin (the caller runs the fwd GEMM and the SwiGLU kernel). `workspace` as above, required.
// `gate_up`: b as [gate; up] halves (the tile's gate-up twin, bf16 only).
bool run_grouped_gemm_swiglu_cuda(const GroupedGemmShape& s, const at::Tensor& a, const at::Tensor& b,
                                  const at::Tensor& offs, at::Tensor& out, const float* limits, const char* op,
                                  bool pdl, int64_t tactic, at::Tensor& workspace, bool zero_tail,
                                  GroupedGemmScales scales = {}, bool gate_up = false);

// The MoE GEMM1 with its gather in the same kernel: as run_grouped_gemm_swiglu_cuda, but product row p
// multiplies x[rows_to_routes[p] / top_k] (x [routes / top_k, K], 16-bit; rows_to_routes int32 [sum_m],
// checked in [0, routes) on the device): `s` describes the gathered operand [sum_m, K]. False, with
// nothing launched, when the tactic has no gathering twin (the caller gathers, then runs the above).
bool run_grouped_gemm_gather_swiglu_cuda(const GroupedGemmShape& s, const at::Tensor& x, const at::Tensor& b,
                                         const at::Tensor& offs, const int32_t* rows_to_routes, int64_t routes,
                                         int top_k, at::Tensor& out, const float* limits, const char* op, bool pdl,
                                         int64_t tactic, at::Tensor& workspace, bool zero_tail, bool gate_up = false);

// The MoE GEMM2 with the fused finalize in one kernel: the scatter twin of the fwd tactic zeroes out
// [num_tokens, N], then adds row p of the product, rounded to out's type and scaled by
// route_scales[r] (rounded again), into out[r / top_k] with r = rows_to_routes[p] (int32 [num_tokens *
// top_k], checked in range on the device) and top_k = route_scales.numel() / num_tokens; atomics, so
// the k additions of a token come in any order. 16-bit operands. False, with nothing launched, when
// the tactic has no twin (the caller runs GEMM2 and moe_finalize).
bool run_grouped_gemm_scatter_cuda(const GroupedGemmShape& s, const at::Tensor& a, const at::Tensor& b,
                                   const at::Tensor& offs, const at::Tensor& rows_to_routes,
                                   const at::Tensor& route_scales, at::Tensor& out, const char* op, bool pdl,
                                   int64_t tactic, at::Tensor& workspace);

}  // namespace cake
