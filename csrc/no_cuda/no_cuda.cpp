// A CPU-only build registers CUDA kernels that say why they cannot run, instead of the
// dispatcher's generic "could not run ... with arguments from the 'CUDA' backend".
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

// One boxed kernel for every op: it needs no op's C++ signature.
void not_built(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK(false, op.schema().name(),
              ": cake_ops was built without CUDA kernels (torch was a CPU build or nvcc was not "
              "found at build time); reinstall with a CUDA build of torch and CUDA_HOME set");
}

}  // namespace

TORCH_LIBRARY_IMPL(cake, CUDA, m) {
  for (const char* op : {"grouped_gemm_fwd", "grouped_gemm_dgrad", "grouped_gemm_wgrad", "grouped_gemm_fwd_out",
                         "grouped_gemm_dgrad_out", "grouped_gemm_wgrad_out", "moe_sort", "moe_routing", "moe_routing_out", "moe_gemm1_swiglu", "moe_gemm1_swiglu_out",
                         "moe_gemm2", "moe_gemm2_out", "quantize_fp8", "quantize_fp8_out", "moe_finalize",
                         "moe_finalize_out", "moe_finalize_backward", "swiglu", "swiglu_backward", "moe_gemm2_finalize_out", "moe_forward_out",
                         "moe_forward_from_logits_out"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&not_built>());
  }
}
