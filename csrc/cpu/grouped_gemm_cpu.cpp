// CPU kernels of the grouped GEMM ops: the reference semantics. Each group is one matrix
// product in fp32 (fp64 for fp64 inputs) with one rounding to the output dtype, as on the GPU.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "grouped_gemm_checks.h"

namespace cake {
namespace {

at::ScalarType compute_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// Zero the rows of out that no group covers (past the last group end).
void zero_tail_rows(at::Tensor& out, int64_t last_end) {
  if (last_end < out.size(0)) out.narrow(0, last_end, out.size(0) - last_end).zero_();
}

void fwd_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs, at::Tensor& out,
              const char* op) {
  auto s = check_fwd(x, w, offs, op);
  check_out(out, {s.sum_m, s.n}, x.scalar_type(), x, op);
  auto b = host_group_bounds(offs, s, op);
  auto ct = compute_dtype(x.scalar_type());
  for (int64_t e = 0; e < s.num_groups; ++e) {
    int64_t rows = b[e + 1] - b[e];
    if (rows == 0) continue;
    auto xg = x.narrow(0, b[e], rows).to(ct);
    out.narrow(0, b[e], rows).copy_(at::mm(xg, w[e].to(ct).t()));
  }
  zero_tail_rows(out, b[s.num_groups]);
}

void dgrad_into(const at::Tensor& grad_out, const at::Tensor& w, const at::Tensor& offs,
                at::Tensor& out, const char* op) {
  auto s = check_dgrad(grad_out, w, offs, op);
  check_out(out, {s.sum_m, s.k}, grad_out.scalar_type(), grad_out, op);
  auto b = host_group_bounds(offs, s, op);
  auto ct = compute_dtype(grad_out.scalar_type());
  for (int64_t e = 0; e < s.num_groups; ++e) {
    int64_t rows = b[e + 1] - b[e];
    if (rows == 0) continue;
    auto gg = grad_out.narrow(0, b[e], rows).to(ct);
    out.narrow(0, b[e], rows).copy_(at::mm(gg, w[e].to(ct)));
  }
  zero_tail_rows(out, b[s.num_groups]);
}

void wgrad_into(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& offs,
                at::Tensor& out, const char* op) {
  TORCH_CHECK(out.dim() == 3, op, ": out must be a 3-D [E, N, K] tensor, got shape ", out.sizes());
  auto s = check_wgrad(grad_out, x, offs, out.size(0), out.scalar_type(), op);
  check_out(out, {s.num_groups, s.n, s.k}, out.scalar_type(), x, op);
  auto b = host_group_bounds(offs, s, op);
  auto ct = compute_dtype(x.scalar_type());
  for (int64_t e = 0; e < s.num_groups; ++e) {
    int64_t rows = b[e + 1] - b[e];
    if (rows == 0) {
      out[e].zero_();  // an empty group has an exactly zero weight gradient
      continue;
    }
    auto gg = grad_out.narrow(0, b[e], rows).to(ct);
    auto xg = x.narrow(0, b[e], rows).to(ct);
    out[e].copy_(at::mm(gg.t(), xg));
  }
}

at::Tensor fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs) {
  const char* op = "cake::grouped_gemm_fwd";
  auto s = check_fwd(x, w, offs, op);
  auto out = at::empty({s.sum_m, s.n}, x.options());
  fwd_into(x, w, offs, out, op);
  return out;
}

at::Tensor dgrad(const at::Tensor& grad_out, const at::Tensor& w, const at::Tensor& offs) {
  const char* op = "cake::grouped_gemm_dgrad";
  auto s = check_dgrad(grad_out, w, offs, op);
  auto out = at::empty({s.sum_m, s.k}, grad_out.options());
  dgrad_into(grad_out, w, offs, out, op);
  return out;
}

at::Tensor wgrad(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& offs,
                 int64_t num_groups, at::ScalarType out_dtype) {
  const char* op = "cake::grouped_gemm_wgrad";
  auto s = check_wgrad(grad_out, x, offs, num_groups, out_dtype, op);
  auto out = at::empty({s.num_groups, s.n, s.k}, x.options().dtype(out_dtype));
  wgrad_into(grad_out, x, offs, out, op);
  return out;
}

void fwd_out(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs, at::Tensor out,
             at::Tensor /*workspace*/) {
  fwd_into(x, w, offs, out, "cake::grouped_gemm_fwd_out");
}

void dgrad_out(const at::Tensor& grad_out, const at::Tensor& w, const at::Tensor& offs,
               at::Tensor out, at::Tensor /*workspace*/) {
  dgrad_into(grad_out, w, offs, out, "cake::grouped_gemm_dgrad_out");
}

void wgrad_out(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& offs,
               at::Tensor out, at::Tensor /*workspace*/) {
  wgrad_into(grad_out, x, offs, out, "cake::grouped_gemm_wgrad_out");
}

}  // namespace

TORCH_LIBRARY_IMPL(cake, CPU, m) {
  m.impl("grouped_gemm_fwd", &fwd);
  m.impl("grouped_gemm_dgrad", &dgrad);
  m.impl("grouped_gemm_wgrad", &wgrad);
  m.impl("grouped_gemm_fwd_out", &fwd_out);
  m.impl("grouped_gemm_dgrad_out", &dgrad_out);
  m.impl("grouped_gemm_wgrad_out", &wgrad_out);
}

}  // namespace cake
