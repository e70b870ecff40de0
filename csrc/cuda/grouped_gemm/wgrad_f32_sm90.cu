// Grouped GEMM wgrad, bf16 -> fp32 weight gradient: 128x128x64 cooperative, 2x1, no split-K
// (bitwise deterministic).
#include "cuda/grouped_gemm/grouped_gemm_sm90.cuh"

namespace cake::sm90 {

using WgradF32 = GroupedGemmConfig<Kind::kWgrad, float, Shape<_128, _128, _64>, Shape<_2, _1, _1>>;

void grouped_gemm_wgrad_f32(const GroupedGemmParams& p, cudaStream_t stream) {
  run_grouped_gemm<WgradF32>(p, stream);
}

}  // namespace cake::sm90
