// CPU kernels of the grouped GEMM ops: the reference semantics. Each group is one matrix
// product in fp32 (fp64 for fp64 inputs) with one rounding to the output dtype, as on the GPU.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "grouped_gemm_ops.h"

namespace cake {
namespace {

struct CpuBackend {
  static at::Tensor workspace(const GroupedGemmShape&, const at::Tensor&) { return at::Tensor(); }

  static void run(GroupedGemmOp kind, const GroupedGemmShape& s, const at::Tensor& a,
                  const at::Tensor& b, const at::Tensor& offs, at::Tensor& out, at::Tensor&,
                  const char* op) {
    const auto bounds = host_group_bounds(offs, s, op);
    const auto ct = a.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    for (int64_t e = 0; e < s.num_groups; ++e) {
      const int64_t start = bounds[e], rows = bounds[e + 1] - bounds[e];
      if (kind == GroupedGemmOp::kWgrad) {
        if (rows == 0) {
          out[e].zero_();  // an empty group has an exactly zero weight gradient
        } else {
          out[e].copy_(at::mm(a.narrow(0, start, rows).to(ct).t(), b.narrow(0, start, rows).to(ct)));
        }
      } else if (rows > 0) {
        // fwd: x[g] @ w[e].T; dgrad: grad_out[g] @ w[e]
        auto we = b[e].to(ct);
        out.narrow(0, start, rows).copy_(at::mm(a.narrow(0, start, rows).to(ct),
                                                kind == GroupedGemmOp::kFwd ? we.t() : we));
      }
    }
    // Rows past the last group end belong to no group: zeros.
    const int64_t last_end = bounds[s.num_groups];
    if (kind != GroupedGemmOp::kWgrad && last_end < out.size(0)) {
      out.narrow(0, last_end, out.size(0) - last_end).zero_();
    }
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(cake, CPU, m) {
  GroupedGemmOps<CpuBackend>::register_kernels(m);
}

}  // namespace cake
