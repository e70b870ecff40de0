// CUDA kernels of the grouped GEMM ops: checks, output and workspace, architecture dispatch.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda/common/arch.h"
#include "cuda/grouped_gemm/grouped_gemm_tactics.h"
#include "grouped_gemm_checks.h"

namespace cake {
namespace {

using Op = GroupedGemmOp;

bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// What the Hopper kernels need beyond the shared checks.
void check_cuda_operands(const GroupedGemmShape& s, const at::Tensor& a, const at::Tensor& b,
                         const at::Tensor& out, const char* op) {
  TORCH_CHECK(a.scalar_type() == at::kBFloat16, op,
              ": CUDA kernels take bfloat16 operands, got ", a.scalar_type(),
              " (the CPU implementation also takes float16, float32 and float64)");
  TORCH_CHECK(s.n % 8 == 0 && s.k % 8 == 0, op,
              ": CUDA kernels need N and K to be multiples of 8 (16-byte rows for TMA), got N=", s.n,
              " and K=", s.k);
  TORCH_CHECK(aligned16(a) && aligned16(b) && aligned16(out), op,
              ": CUDA kernels need 16-byte aligned data pointers (a storage offset broke this)");
  TORCH_CHECK(s.num_groups <= 65535, op, ": at most 65535 groups, got ", s.num_groups);
  TORCH_CHECK(s.n <= INT32_MAX && s.k <= INT32_MAX, op, ": N and K must fit in int32");
}

void check_workspace(const at::Tensor& workspace, const GroupedGemmShape& s, const at::Tensor& like,
                     const char* op) {
  const int64_t need = grouped_gemm_workspace_bytes(s.num_groups);
  TORCH_CHECK(workspace.device() == like.device() && workspace.is_contiguous() &&
                  workspace.nbytes() >= static_cast<size_t>(need) && aligned16(workspace),
              op, ": workspace must be a contiguous tensor of at least ", need, " bytes on ",
              like.device(), " (cake_ops._C.grouped_gemm_workspace_size(E)), got ",
              workspace.nbytes(), " bytes on ", workspace.device());
}

void launch(Op kind, const GroupedGemmShape& s, const at::Tensor& a, const at::Tensor& b,
            const at::Tensor& offs, at::Tensor& out, at::Tensor& workspace, const char* op) {
  check_cuda_operands(s, a, b, out, op);
  check_workspace(workspace, s, a, op);
  c10::cuda::CUDAGuard guard(a.device());
  const KernelArch arch = select_kernel_arch(a.get_device(), op);
  if (out.numel() == 0) return;
  // A zero-length reduction (fwd K = 0, dgrad N = 0) multiplies nothing.
  if ((kind == Op::kFwd && s.k == 0) || (kind == Op::kDgrad && s.n == 0)) {
    out.zero_();
    return;
  }
  GroupedGemmParams p;
  p.a = a.data_ptr();
  p.b = b.data_ptr();
  p.out = out.data_ptr();
  p.offs = offs.data_ptr<int32_t>();
  p.indptr = s.indptr;
  p.num_groups = s.num_groups;
  p.sum_m = s.sum_m;
  p.n = s.n;
  p.k = s.k;
  p.workspace = workspace.data_ptr();
  p.workspace_bytes = static_cast<int64_t>(workspace.nbytes());
  p.device = a.get_device();
  p.sm_count = at::cuda::getDeviceProperties(p.device)->multiProcessorCount;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(p.device);
  switch (arch) {
    case KernelArch::kSm90: {
      const TacticFamily family = tactic_family(kind, out.scalar_type());
      tactics_sm90(family)[choose_tactic_sm90(family, s)].launch(p, stream);
      return;
    }
  }
}

at::Tensor new_workspace(const GroupedGemmShape& s, const at::Tensor& like) {
  return at::empty({grouped_gemm_workspace_bytes(s.num_groups)}, like.options().dtype(at::kByte));
}

at::Tensor fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs) {
  const char* op = "cake::grouped_gemm_fwd";
  auto s = check_fwd(x, w, offs, op);
  auto out = at::empty({s.sum_m, s.n}, x.options());
  auto workspace = new_workspace(s, x);
  launch(Op::kFwd, s, x, w, offs, out, workspace, op);
  return out;
}

at::Tensor dgrad(const at::Tensor& grad_out, const at::Tensor& w, const at::Tensor& offs) {
  const char* op = "cake::grouped_gemm_dgrad";
  auto s = check_dgrad(grad_out, w, offs, op);
  auto out = at::empty({s.sum_m, s.k}, grad_out.options());
  auto workspace = new_workspace(s, grad_out);
  launch(Op::kDgrad, s, grad_out, w, offs, out, workspace, op);
  return out;
}

at::Tensor wgrad(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& offs,
                 int64_t num_groups, at::ScalarType out_dtype) {
  const char* op = "cake::grouped_gemm_wgrad";
  auto s = check_wgrad(grad_out, x, offs, num_groups, out_dtype, op);
  auto out = at::empty({s.num_groups, s.n, s.k}, x.options().dtype(out_dtype));
  auto workspace = new_workspace(s, x);
  launch(Op::kWgrad, s, grad_out, x, offs, out, workspace, op);
  return out;
}

void fwd_out(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs, at::Tensor out,
             at::Tensor workspace) {
  const char* op = "cake::grouped_gemm_fwd_out";
  auto s = check_fwd(x, w, offs, op);
  check_out(out, {s.sum_m, s.n}, x.scalar_type(), x, op);
  launch(Op::kFwd, s, x, w, offs, out, workspace, op);
}

void dgrad_out(const at::Tensor& grad_out, const at::Tensor& w, const at::Tensor& offs,
               at::Tensor out, at::Tensor workspace) {
  const char* op = "cake::grouped_gemm_dgrad_out";
  auto s = check_dgrad(grad_out, w, offs, op);
  check_out(out, {s.sum_m, s.k}, grad_out.scalar_type(), grad_out, op);
  launch(Op::kDgrad, s, grad_out, w, offs, out, workspace, op);
}

void wgrad_out(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& offs,
               at::Tensor out, at::Tensor workspace) {
  const char* op = "cake::grouped_gemm_wgrad_out";
  TORCH_CHECK(out.dim() == 3, op, ": out must be a 3-D [E, N, K] tensor, got shape ", out.sizes());
  auto s = check_wgrad(grad_out, x, offs, out.size(0), out.scalar_type(), op);
  check_out(out, {s.num_groups, s.n, s.k}, out.scalar_type(), x, op);
  launch(Op::kWgrad, s, grad_out, x, offs, out, workspace, op);
}

}  // namespace

TORCH_LIBRARY_IMPL(cake, CUDA, m) {
  m.impl("grouped_gemm_fwd", &fwd);
  m.impl("grouped_gemm_dgrad", &dgrad);
  m.impl("grouped_gemm_wgrad", &wgrad);
  m.impl("grouped_gemm_fwd_out", &fwd_out);
  m.impl("grouped_gemm_dgrad_out", &dgrad_out);
  m.impl("grouped_gemm_wgrad_out", &wgrad_out);
}

}  // namespace cake
