// Grouped GEMM wgrad, bf16 -> bf16 weight gradient: 128x128x64 cooperative, 2x1. No split-K,
// so each dw tile is reduced by one CTA in a fixed order: bitwise deterministic.
#include "cuda/grouped_gemm/grouped_gemm_sm90.cuh"

namespace cake::sm90 {

using WgradBf16 = GroupedGemmConfig<Kind::kWgrad, cutlass::bfloat16_t, Shape<_128, _128, _64>,
                                    Shape<_2, _1, _1>>;

void grouped_gemm_wgrad_bf16(const GroupedGemmParams& p, cudaStream_t stream) {
  run_grouped_gemm<WgradBf16>(p, stream);
}

}  // namespace cake::sm90
