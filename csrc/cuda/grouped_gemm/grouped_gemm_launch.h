// The host-side contract between the grouped GEMM op wrappers and the kernel configurations.
// No CUTLASS here: only the .cu files of one configuration include CUTLASS.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace cake {

// One grouped GEMM over bf16, fp16 or e4m3 operands, in the op's terms (w is [E, N, K]):
//   fwd:   a = x [sum_m, K],        b = w [E, N, K],   out = y [sum_m, N]
//   dgrad: a = grad_out [sum_m, N], b = w [E, N, K],   out = dx [sum_m, K]
//   wgrad: a = grad_out [sum_m, N], b = x [sum_m, K],  out = dw [E, N, K]
struct GroupedGemmParams {
  const void* a = nullptr;
  const void* b = nullptr;
  void* out = nullptr;
  const int32_t* offs = nullptr;  // device; E ends, or E + 1 bounds with a leading zero
  bool indptr = false;
  int64_t num_groups = 0;
  int64_t sum_m = 0;
  int64_t n = 0;
  int64_t k = 0;
  void* workspace = nullptr;  // device, grouped_gemm_workspace_bytes(num_groups) bytes
  int64_t workspace_bytes = 0;
  int device = 0;
  int sm_count = 0;
  // Tile order of the persistent scheduler: along M first (default; consecutive tiles share a
  // weight tile) or along N, in swizzled blocks of `swizzle` tiles (1, 2, 4 or 8).
  bool raster_along_n = false;
  int swizzle = 1;
  // Launch the prologue and the GEMM with Programmatic Dependent Launch: each starts while its
  // predecessor finishes and waits for it on the device (pdl.cuh).
  bool pdl = false;
  // fwd/dgrad: zero the output rows past the last group end (the ops' contract). Internal
  // callers whose consumers never read those rows (the MoE GEMMs) skip the writes.
  bool zero_tail = true;
  // e4m3 configurations: group g's output is scaled by (*a_scale) * b_scale[g] (device float32;
  // null reads as 1). Other configurations ignore them.
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
  // SwiGLU twins (fwd with the MoE GEMM1's SwiGLU in the epilogue; out is [sum_m, N / 2]): group
  // g's SwiGLUStep limit (device float32), or null for plain SwiGLU.
  const float* swiglu_limits = nullptr;
  // Scatter twins (fwd with the MoE GEMM2's fused finalize): out is unused; scatter.out [num_tokens,
  // N] is zeroed, then product row p, times route_scales[r], is added into scatter.out[r / top_k]
  // with r = rows_to_routes[p] (in any order: atomics).
  struct Scatter {
    void* out = nullptr;
    int64_t num_tokens = 0;
    int top_k = 1;
    const int32_t* rows_to_routes = nullptr;
    const float* route_scales = nullptr;
  } scatter;
  // Gather-SwiGLU twins (the SwiGLU twin whose mainloop gathers A): a is x [routes / top_k, K], and
  // product row p multiplies x[rows_to_routes[p] / top_k], rows_to_routes[p] in [0, routes).
  struct Gather {
    const int32_t* rows_to_routes = nullptr;
    int64_t routes = 0;
    int top_k = 1;
  } gather;
};

using GroupedGemmLaunchFn = void (*)(const GroupedGemmParams&, cudaStream_t);

}  // namespace cake
