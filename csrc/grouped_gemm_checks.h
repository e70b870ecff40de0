// Type, shape and layout checks shared by every backend of the grouped GEMM ops, so that the
// CPU and CUDA kernels reject the same inputs with the same messages.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace cake {

// Workspace of one grouped GEMM launch: the per-group argument arrays the device prologue
// writes (problem shape, three pointers, three strides, an fp8 scale: well under kPerGroupBytes) and the
// CUTLASS kernel's own workspace (TMA descriptors per persistent CTA). A function of the
// group count only, never of the GPU, so prepared launches and fakes can size it.
constexpr int64_t kWorkspaceAlign = 256;
constexpr int64_t kMaxPersistentCtas = 256;
constexpr int64_t kPerGroupBytes = 256;
constexpr int64_t kTmaDescriptorBytes = 128;
constexpr int64_t kCutlassWorkspaceBytes = kMaxPersistentCtas * 8 * kTmaDescriptorBytes + 4096;

inline int64_t grouped_gemm_workspace_bytes(int64_t num_groups) {
  return 9 * kWorkspaceAlign + num_groups * kPerGroupBytes + kCutlassWorkspaceBytes;
}

enum class GroupedGemmOp { kFwd, kDgrad, kWgrad };

// The problem of one grouped GEMM op, in the op's own terms: w is [E, N, K].
struct GroupedGemmShape {
  int64_t num_groups = 0;  // E
  int64_t sum_m = 0;       // packed rows of x / grad_out
  int64_t n = 0;
  int64_t k = 0;
  bool indptr = false;     // offs has E + 1 entries, the first a zero
  // The rows expected to fall in the groups (the MoE GEMMs' expected_routes: an expert-parallel
  // shard's share of sum_m), for the tactic choice only; -1: all sum_m.
  int64_t expected_rows = -1;
};

// allow_e4m3: float8_e4m3fn x and w too, and bfloat16 x with float8_e4m3fn w (the MoE GEMMs'
// fp8 family, which quantize such x; the grouped GEMM ops are 16-bit and wider).
GroupedGemmShape check_fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs,
                           const char* op, bool allow_e4m3 = false);
GroupedGemmShape check_dgrad(const at::Tensor& grad_out, const at::Tensor& w,
                             const at::Tensor& offs, const char* op);
GroupedGemmShape check_wgrad(const at::Tensor& grad_out, const at::Tensor& x,
                             const at::Tensor& offs, int64_t num_groups,
                             at::ScalarType out_dtype, const char* op);
// wgrad may write bf16 or fp32 (or the input dtype); anything else is rejected.
void check_wgrad_out_dtype(at::ScalarType out_dtype, at::ScalarType in_dtype, const char* op);
// A caller-owned output: exact shape and dtype, contiguous, on the operands' device.
void check_out(const at::Tensor& out, at::IntArrayRef shape, at::ScalarType dtype,
               const at::Tensor& like, const char* op);

// Host copy of the group ends (E + 1 entries: ends[0] = 0, group g spans [ends[g], ends[g+1])),
// with the values checked: non-decreasing, a leading zero for m_indptr, within [0, sum_m].
std::vector<int64_t> host_group_bounds(const at::Tensor& offs, const GroupedGemmShape& s,
                                       const char* op);

}  // namespace cake
