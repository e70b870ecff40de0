// D = alpha * acc stored straight from registers (Hopper, ptr-array kernels), 16 bytes a lane after a
// quad transpose, rows < M of the group only. The fixed-operand kernels' epilogue
// (fixed_operand_sm90.cuh): their tiles overrun a group's last row into the next group's, which a TMA
// store without a per-group descriptor would overwrite. No shared memory: the mainloop keeps it all.
#pragma once

#include <cutlass/numeric_conversion.h>

#include "cuda/grouped_gemm/register_epilogue_sm90.cuh"

namespace cake::sm90 {

template <class ElementD_, class StrideD_>
class StoreEpilogueArray : public RegisterEpilogueArray<ElementD_, StrideD_> {
  using Base = RegisterEpilogueArray<ElementD_, StrideD_>;

 public:
  using typename Base::ElementD;
  using typename Base::InternalStrideD;
  using typename Base::StrideD;
  static_assert(sizeof(ElementD) == 2, "two output elements a word");

  struct Arguments {
    ElementD** ptr_D = nullptr;    // group g's output [M, N]
    StrideD dD{};
    const float* alpha = nullptr;  // group g's scale (fp8), or null: 1
  };
  using Params = Arguments;

  CUTLASS_HOST_DEVICE StoreEpilogueArray(Params const& params) : params_(params) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    const int M = get<0>(problem_shape_mnkl);
    const int N = get<1>(problem_shape_mnkl);
    const int l_coord = get<3>(blk_coord_mnkl);
    const float alpha = params_.alpha ? params_.alpha[l_coord] : 1.0f;
    const int64_t row_pitch = get<0>(params_.dD[l_coord]);
    ElementD* out = params_.ptr_D[l_coord];
    const auto thread_coords =
        Base::template accumulator_coords<FrgLayout>(M, N, blk_shape_MNK, blk_coord_mnkl, tiled_mma, thread_idx);
    cutlass::NumericArrayConverter<ElementD, float, 2, cutlass::FloatRoundStyle::round_to_nearest> to_out;
    auto row_state = [&](int m) { return out + int64_t(m) * row_pitch; };
    auto pack = [&](ElementD*, float a, float b) {
      cutlass::Array<float, 2> pair;
      pair[0] = alpha * a;
      pair[1] = alpha * b;
      const auto packed = to_out(pair);
      return *reinterpret_cast<const uint32_t*>(&packed);
    };
    auto store = [&](ElementD* out_row, int m, int n, const uint32_t(&w)[4]) {
      if (m < M && n < N) *reinterpret_cast<uint4*>(out_row + n) = make_uint4(w[0], w[1], w[2], w[3]);  // N % 8 == 0
    };
    Base::for_each_octet(accumulators, thread_coords, row_state, pack, store);
  }

 private:
  Params params_;
};

}  // namespace cake::sm90
