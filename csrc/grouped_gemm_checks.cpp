#include "grouped_gemm_checks.h"

#include <c10/util/Exception.h>

namespace cake {
namespace {

void check_dims(const at::Tensor& t, int64_t dim, const char* name, const char* layout,
                const char* op) {
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must be a ", dim, "-D ", layout,
              " tensor, got shape ", t.sizes());
}

void check_float_dtype(const at::Tensor& t, const char* name, const char* op) {
  auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kHalf || dt == at::kFloat || dt == at::kDouble, op,
              ": ", name, " must be bfloat16, float16, float32 or float64, got ", dt);
}

void check_same(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name,
                const char* op) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), op, ": ", a_name, " and ", b_name,
              " must have the same dtype, got ", a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK(a.device() == b.device(), op, ": ", a_name, " and ", b_name,
              " must be on the same device, got ", a.device(), " and ", b.device());
}

void check_contiguous(const at::Tensor& t, const char* name, const char* layout, const char* op) {
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous (row-major ", layout,
              "), got strides ", t.strides(), "; call .contiguous() first");
}

bool check_offs(const at::Tensor& offs, int64_t num_groups, const at::Tensor& like,
                const char* op) {
  TORCH_CHECK(offs.scalar_type() == at::kInt, op, ": offs must be int32, got ",
              offs.scalar_type());
  TORCH_CHECK(offs.device() == like.device(), op, ": offs must be on the operands' device ",
              like.device(), ", got ", offs.device());
  TORCH_CHECK(offs.dim() == 1 && (offs.size(0) == num_groups || offs.size(0) == num_groups + 1),
              op, ": offs must be 1-D with E=", num_groups, " entries (cumulative group ends) or E+1=",
              num_groups + 1, " (m_indptr with a leading zero), got shape ", offs.sizes());
  TORCH_CHECK(offs.stride(0) == 1 || offs.size(0) <= 1, op, ": offs must be contiguous");
  return offs.size(0) == num_groups + 1;
}

}  // namespace

GroupedGemmShape check_fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs,
                           const char* op, bool allow_e4m3) {
  check_dims(x, 2, "x", "[sum_m, K]", op);
  check_dims(w, 3, "w", "[E, N, K]", op);
  if (!allow_e4m3 || x.scalar_type() != at::kFloat8_e4m3fn) check_float_dtype(x, "x", op);
  if (allow_e4m3 && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kFloat8_e4m3fn) {
    // The MoE op quantizes x: only the devices must agree.
    TORCH_CHECK(w.device() == x.device(), op, ": x and w must be on the same device, got ", x.device(), " and ",
                w.device());
  } else {
    check_same(x, "x", w, "w", op);
  }
  TORCH_CHECK(x.size(1) == w.size(2), op, ": K mismatch: x is [sum_m, K] with K=", x.size(1),
              " but w is [E, N, K] with K=", w.size(2));
  check_contiguous(x, "x", "[sum_m, K]", op);
  check_contiguous(w, "w", "[E, N, K]", op);
  GroupedGemmShape s{w.size(0), x.size(0), w.size(1), w.size(2), false};
  s.indptr = check_offs(offs, s.num_groups, x, op);
  return s;
}

GroupedGemmShape check_dgrad(const at::Tensor& grad_out, const at::Tensor& w,
                             const at::Tensor& offs, const char* op) {
  check_dims(grad_out, 2, "grad_out", "[sum_m, N]", op);
  check_dims(w, 3, "w", "[E, N, K]", op);
  check_float_dtype(grad_out, "grad_out", op);
  check_same(grad_out, "grad_out", w, "w", op);
  TORCH_CHECK(grad_out.size(1) == w.size(1), op, ": N mismatch: grad_out is [sum_m, N] with N=",
              grad_out.size(1), " but w is [E, N, K] with N=", w.size(1));
  check_contiguous(grad_out, "grad_out", "[sum_m, N]", op);
  check_contiguous(w, "w", "[E, N, K]", op);
  GroupedGemmShape s{w.size(0), grad_out.size(0), w.size(1), w.size(2), false};
  s.indptr = check_offs(offs, s.num_groups, grad_out, op);
  return s;
}

GroupedGemmShape check_wgrad(const at::Tensor& grad_out, const at::Tensor& x,
                             const at::Tensor& offs, int64_t num_groups,
                             at::ScalarType out_dtype, const char* op) {
  check_dims(grad_out, 2, "grad_out", "[sum_m, N]", op);
  check_dims(x, 2, "x", "[sum_m, K]", op);
  check_float_dtype(grad_out, "grad_out", op);
  check_same(grad_out, "grad_out", x, "x", op);
  TORCH_CHECK(grad_out.size(0) == x.size(0), op, ": sum_m mismatch: grad_out has ",
              grad_out.size(0), " rows but x has ", x.size(0));
  TORCH_CHECK(num_groups >= 0, op, ": num_groups must be >= 0, got ", num_groups);
  check_contiguous(grad_out, "grad_out", "[sum_m, N]", op);
  check_contiguous(x, "x", "[sum_m, K]", op);
  check_wgrad_out_dtype(out_dtype, x.scalar_type(), op);
  GroupedGemmShape s{num_groups, x.size(0), grad_out.size(1), x.size(1), false};
  s.indptr = check_offs(offs, s.num_groups, x, op);
  return s;
}

void check_wgrad_out_dtype(at::ScalarType out_dtype, at::ScalarType in_dtype, const char* op) {
  TORCH_CHECK(out_dtype == in_dtype || out_dtype == at::kFloat, op,
              ": out_dtype must be the input dtype (", in_dtype, ") or float32, got ", out_dtype);
}

void check_out(const at::Tensor& out, at::IntArrayRef shape, at::ScalarType dtype,
               const at::Tensor& like, const char* op) {
  TORCH_CHECK(out.sizes() == shape, op, ": out must have shape ", shape, ", got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == dtype, op, ": out must be ", dtype, ", got ",
              out.scalar_type());
  TORCH_CHECK(out.device() == like.device(), op, ": out must be on ", like.device(), ", got ",
              out.device());
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
}

std::vector<int64_t> host_group_bounds(const at::Tensor& offs, const GroupedGemmShape& s,
                                       const char* op) {
  TORCH_CHECK(offs.device().is_cpu(), op, ": host_group_bounds needs CPU offsets");
  const int32_t* p = offs.data_ptr<int32_t>();
  std::vector<int64_t> bounds(s.num_groups + 1, 0);
  if (s.indptr) {
    TORCH_CHECK(p[0] == 0, op, ": m_indptr[0] must be 0, got ", p[0]);
    ++p;
  }
  for (int64_t g = 0; g < s.num_groups; ++g) {
    int64_t end = p[g];
    TORCH_CHECK(end >= bounds[g], op, ": group ends must be non-decreasing, got ", end,
                " after ", bounds[g], " at group ", g);
    TORCH_CHECK(end <= s.sum_m, op, ": group end ", end, " at group ", g,
                " is past the ", s.sum_m, " packed rows");
    bounds[g + 1] = end;
  }
  return bounds;
}

}  // namespace cake
