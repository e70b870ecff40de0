// The six grouped GEMM ops, written once for every backend: argument checks, outputs and
// workspace are the backend's business only through Backend::workspace and Backend::run.
//   static at::Tensor workspace(const GroupedGemmShape&, const at::Tensor& like);
//   static void run(GroupedGemmOp, const GroupedGemmShape&, const at::Tensor& a,
//                   const at::Tensor& b, const at::Tensor& offs, at::Tensor& out,
//                   at::Tensor& workspace, const char* op);   // writes every element of out
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include "grouped_gemm_checks.h"

namespace cake {

template <class Backend>
struct GroupedGemmOps {
  static at::Tensor fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs) {
    const char* op = "cake::grouped_gemm_fwd";
    auto s = check_fwd(x, w, offs, op);
    auto out = at::empty({s.sum_m, s.n}, x.options());
    auto workspace = Backend::workspace(s, x);
    Backend::run(GroupedGemmOp::kFwd, s, x, w, offs, out, workspace, op);
    return out;
  }

  static at::Tensor dgrad(const at::Tensor& grad_out, const at::Tensor& w, const at::Tensor& offs) {
    const char* op = "cake::grouped_gemm_dgrad";
    auto s = check_dgrad(grad_out, w, offs, op);
    auto out = at::empty({s.sum_m, s.k}, grad_out.options());
    auto workspace = Backend::workspace(s, grad_out);
    Backend::run(GroupedGemmOp::kDgrad, s, grad_out, w, offs, out, workspace, op);
    return out;
  }

  static at::Tensor wgrad(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& offs,
                          int64_t num_groups, at::ScalarType out_dtype) {
    const char* op = "cake::grouped_gemm_wgrad";
    auto s = check_wgrad(grad_out, x, offs, num_groups, out_dtype, op);
    auto out = at::empty({s.num_groups, s.n, s.k}, x.options().dtype(out_dtype));
    auto workspace = Backend::workspace(s, x);
    Backend::run(GroupedGemmOp::kWgrad, s, grad_out, x, offs, out, workspace, op);
    return out;
  }

  static void fwd_out(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs,
                      at::Tensor out, at::Tensor workspace) {
    const char* op = "cake::grouped_gemm_fwd_out";
    auto s = check_fwd(x, w, offs, op);
    check_out(out, {s.sum_m, s.n}, x.scalar_type(), x, op);
    Backend::run(GroupedGemmOp::kFwd, s, x, w, offs, out, workspace, op);
  }

  static void dgrad_out(const at::Tensor& grad_out, const at::Tensor& w, const at::Tensor& offs,
                        at::Tensor out, at::Tensor workspace) {
    const char* op = "cake::grouped_gemm_dgrad_out";
    auto s = check_dgrad(grad_out, w, offs, op);
    check_out(out, {s.sum_m, s.k}, grad_out.scalar_type(), grad_out, op);
    Backend::run(GroupedGemmOp::kDgrad, s, grad_out, w, offs, out, workspace, op);
  }

  static void wgrad_out(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& offs,
                        at::Tensor out, at::Tensor workspace) {
    const char* op = "cake::grouped_gemm_wgrad_out";
    TORCH_CHECK(out.dim() == 3, op, ": out must be a 3-D [E, N, K] tensor, got shape ", out.sizes());
    auto s = check_wgrad(grad_out, x, offs, out.size(0), out.scalar_type(), op);
    check_out(out, {s.num_groups, s.n, s.k}, out.scalar_type(), x, op);
    Backend::run(GroupedGemmOp::kWgrad, s, grad_out, x, offs, out, workspace, op);
  }

  static void register_kernels(torch::Library& m) {
    m.impl("grouped_gemm_fwd", &fwd);
    m.impl("grouped_gemm_dgrad", &dgrad);
    m.impl("grouped_gemm_wgrad", &wgrad);
    m.impl("grouped_gemm_fwd_out", &fwd_out);
    m.impl("grouped_gemm_dgrad_out", &dgrad_out);
    m.impl("grouped_gemm_wgrad_out", &wgrad_out);
  }
};

}  // namespace cake
