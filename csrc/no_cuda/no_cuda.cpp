// A CPU-only build registers CUDA kernels that say why they cannot run, instead of the
// dispatcher's generic "could not run ... with arguments from the 'CUDA' backend".
#include <torch/library.h>

namespace {

[[noreturn]] void not_built(const char* op) {
  TORCH_CHECK(false, op,
              ": cake_ops was built without CUDA kernels (torch was a CPU build or nvcc was not "
              "found at build time); reinstall with a CUDA build of torch and CUDA_HOME set");
}

}  // namespace

TORCH_LIBRARY_IMPL(cake, CUDA, m) {
  m.impl("grouped_gemm_fwd", [](const at::Tensor&, const at::Tensor&, const at::Tensor&) -> at::Tensor {
    not_built("cake::grouped_gemm_fwd");
  });
  m.impl("grouped_gemm_dgrad", [](const at::Tensor&, const at::Tensor&, const at::Tensor&) -> at::Tensor {
    not_built("cake::grouped_gemm_dgrad");
  });
  m.impl("grouped_gemm_wgrad", [](const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                  at::ScalarType) -> at::Tensor { not_built("cake::grouped_gemm_wgrad"); });
  m.impl("grouped_gemm_fwd_out", [](const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor,
                                    at::Tensor) { not_built("cake::grouped_gemm_fwd_out"); });
  m.impl("grouped_gemm_dgrad_out", [](const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor,
                                      at::Tensor) { not_built("cake::grouped_gemm_dgrad_out"); });
  m.impl("grouped_gemm_wgrad_out", [](const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor,
                                      at::Tensor) { not_built("cake::grouped_gemm_wgrad_out"); });
  m.impl("moe_sort", [](const at::Tensor&, int64_t, int64_t, int64_t, int64_t)
                         -> std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> {
    not_built("cake::moe_sort");
  });
  m.impl("moe_gemm1_swiglu", [](const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                int64_t) -> at::Tensor { not_built("cake::moe_gemm1_swiglu"); });
  m.impl("moe_finalize", [](const at::Tensor&, const at::Tensor&, const at::Tensor&) -> at::Tensor {
    not_built("cake::moe_finalize");
  });
}
