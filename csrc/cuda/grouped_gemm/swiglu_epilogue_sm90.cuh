// The MoE GEMM1's SwiGLU as a grouped GEMM epilogue (Hopper, ptr-array kernels): the tile's
// accumulators are h = x @ w1[e].T with w1's up and gate rows interleaved at 32 (columns
// [64c, 64c + 32) up, [64c + 32, 64c + 64) gate), and each thread's wgmma fragment holds both
// halves of a pair (column n in its column group v, n + 32 in group v + 4), so the activation
// happens in registers and only the [rows, N / 2] result is stored: no h round trip through
// memory, no SwiGLU kernel. Stores go straight from registers (no shared memory, so the mainloop
// keeps it all for stages).
//
// kGateUpHalves: w1 as [gate; up] halves (transformers' gate_up_proj), which the fixed-operand mainloop
// loads as two boxes a tile (fixed_operand_sm90.cuh): the tile's first N / 2 columns are gate rows
// [t N / 2, (t + 1) N / 2) and the rest the same up rows, so column n pairs with n + N / 2 (the
// fragment's column group v with v + kGroups / 2) and the tile's output columns are [t N / 2, (t + 1) N / 2).
//
// Numbers are those of the unfused path bit for bit: alpha * acc (fp8: the per-group scale, as
// LinearCombination applies it), rounded to the output type as the GEMM would store h, then
// swiglu_value in float32 and one more rounding, as the SwiGLU kernel does.
#pragma once

#include <cutlass/numeric_conversion.h>

#include "cuda/grouped_gemm/register_epilogue_sm90.cuh"
#include "cuda/moe/swiglu.cuh"

namespace cake::sm90 {

template <class ElementD_, class StrideD_, bool kGateUpHalves = false>
class SwiGluEpilogueArray : public RegisterEpilogueArray<ElementD_, StrideD_> {
  using Base = RegisterEpilogueArray<ElementD_, StrideD_>;

 public:
  using typename Base::ElementD;
  using typename Base::InternalStrideD;
  using typename Base::StrideD;

  struct Arguments {
    ElementD** ptr_D = nullptr;     // group g's output [M, N / 2]
    StrideD dD{};
    const float* alpha = nullptr;   // group g's scale (fp8), or null: 1
    const float* limits = nullptr;  // group g's SwiGLUStep limit, or null: plain SwiGLU
  };
  using Params = Arguments;

  CUTLASS_HOST_DEVICE SwiGluEpilogueArray(Params const& params) : params_(params) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    static_assert(size<1>(BlockShapeMNK{}) % 64 == 0, "SwiGLU pairs columns 32 apart within 64-column chunks");
    // Column group v + 4 of a fragment is 32 columns right of group v; with halves the partner group is
    // kGroups / 2 right (one wgmma spans the tile's N: the fragment holds both halves).
    constexpr int kGroups = decltype(size<0, 2>(FrgLayout{}))::value;
    constexpr int kTileN = decltype(size<1>(BlockShapeMNK{}))::value;
    static_assert(kGroups % 8 == 0, "SwiGLU pairs column groups v and v + 4 of each 8");
    static_assert(!kGateUpHalves || (decltype(size<2>(FrgLayout{}))::value == 1 && kGroups * 8 == kTileN),
                  "gate_up halves: one wgmma along the tile's N");
    constexpr int kPartner = kGateUpHalves ? kGroups / 2 : 4;

    const int M = get<0>(problem_shape_mnkl);
    const int N = get<1>(problem_shape_mnkl);
    const int l_coord = get<3>(blk_coord_mnkl);
    const float alpha = params_.alpha ? params_.alpha[l_coord] : 1.0f;
    const bool step = params_.limits != nullptr;
    const float limit = step ? params_.limits[l_coord] : 0.0f;
    const InternalStrideD stride_d = params_.dD[l_coord];
    const int64_t row_pitch = get<0>(stride_d);  // elements between rows of the [M, N / 2] output
    ElementD* out = params_.ptr_D[l_coord];
    const auto thread_coords =
        Base::template accumulator_coords<FrgLayout>(M, N, blk_shape_MNK, blk_coord_mnkl, tiled_mma, thread_idx);

    cutlass::NumericConverter<ElementD, float, cutlass::FloatRoundStyle::round_to_nearest> to_out;
    auto rounded = [&](float v) { return static_cast<float>(to_out(alpha * v)); };
    // SwiGLU of the two accumulator pairs at up_at(0 / 1), gate_at(0 / 1), stored as two outputs at at().
    auto store_pair = [&](auto up_at, auto gate_at, auto at) {
      float r[2];
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < 2; ++c) {
        r[c] = swiglu_value(rounded(accumulators(up_at(c))), rounded(accumulators(gate_at(c))), step, limit);
      }
      cutlass::Array<ElementD, 2> pair;
      pair[0] = to_out(r[0]);
      pair[1] = to_out(r[1]);
      *reinterpret_cast<cutlass::Array<ElementD, 2>*>(at()) = pair;
    };
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < size<1>(accumulators); ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int nn = 0; nn < size<2>(accumulators); ++nn) {
        CUTLASS_PRAGMA_UNROLL
        for (int half = 0; half < 2; ++half) {
          CUTLASS_PRAGMA_UNROLL
          for (int g = 0; g < kGroups; ++g) {
            if constexpr (kGateUpHalves) {
              // Gate group g, its up group N / 2 to the right: the tile's output columns t N / 2 onwards.
              if (g >= kPartner) continue;
              auto gate_at = [&](int c) { return make_coord(make_coord(c, half, g), mm, nn); };
              auto up_at = [&](int c) { return make_coord(make_coord(c, half, g + kPartner), mm, nn); };
              const auto mn = thread_coords(gate_at(0));
              const int m = get<0>(mn), n = get<1>(mn);
              const int column = (n / kTileN) * (kTileN / 2) + n % kTileN;
              // Past I (= N / 2): the last tile's gate box ran into the up half.
              if (m >= M || column >= N / 2) continue;
              store_pair(up_at, gate_at, [&] { return out + m * row_pitch + column; });
            } else {
              if (g % 8 >= 4) continue;  // gate groups: read with their up group
              auto up_at = [&](int c) { return make_coord(make_coord(c, half, g), mm, nn); };
              auto gate_at = [&](int c) { return make_coord(make_coord(c, half, g + 4), mm, nn); };
              const auto mn = thread_coords(up_at(0));
              const int m = get<0>(mn), n = get<1>(mn);
              if (m >= M || n >= N) continue;  // N is a multiple of 64: the pair lies within it
              // Columns n, n + 1 of the product: output columns (n / 64) * 32 + n % 32 and the next.
              store_pair(up_at, gate_at, [&] { return out + m * row_pitch + (n / 64) * 32 + n % 32; });
            }
          }
        }
      }
    }
  }

 private:
  Params params_;
};

}  // namespace cake::sm90
