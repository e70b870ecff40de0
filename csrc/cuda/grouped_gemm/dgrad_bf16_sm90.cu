// Grouped GEMM dgrad, bf16 -> bf16, w read in place (N-major B): 128x128x64 cooperative, 2x1.
#include "cuda/grouped_gemm/grouped_gemm_sm90.cuh"

namespace cake::sm90 {

using DgradBf16 = GroupedGemmConfig<Kind::kDgrad, cutlass::bfloat16_t, Shape<_128, _128, _64>,
                                    Shape<_2, _1, _1>>;

void grouped_gemm_dgrad_bf16(const GroupedGemmParams& p, cudaStream_t stream) {
  run_grouped_gemm<DgradBf16>(p, stream);
}

}  // namespace cake::sm90
