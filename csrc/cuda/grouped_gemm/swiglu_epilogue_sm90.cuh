// The MoE GEMM1's SwiGLU as a grouped GEMM epilogue (Hopper, ptr-array kernels): the tile's
// accumulators are h = x @ w1[e].T with w1's up and gate rows interleaved at 32 (columns
// [64c, 64c + 32) up, [64c + 32, 64c + 64) gate), and each thread's wgmma fragment holds both
// halves of a pair (column n in its column group v, n + 32 in group v + 4), so the activation
// happens in registers and only the [rows, N / 2] result is stored: no h round trip through
// memory, no SwiGLU kernel. Stores go straight from registers (no shared memory, so the mainloop
// keeps it all for stages).
//
// Numbers are those of the unfused path bit for bit: alpha * acc (fp8: the per-group scale, as
// LinearCombination applies it), rounded to the output type as the GEMM would store h, then
// swiglu_value in float32 and one more rounding, as the SwiGLU kernel does.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/epilogue/dispatch_policy.hpp>
#include <cutlass/numeric_conversion.h>

#include "cuda/moe/swiglu.cuh"

namespace cake::sm90 {

template <class ElementD_, class StrideD_>
class SwiGluEpilogueArray {
 public:
  using EpilogueSchedule = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementOutput = ElementD_;
  using ElementD = ElementD_;
  using ElementC = void;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using StrideD = StrideD_;  // a pointer: one [M, N / 2, 1] stride per group
  using StrideC = StrideD_;
  using InternalStrideD = cute::remove_pointer_t<StrideD>;
  using InternalStrideC = InternalStrideD;
  using GmemElementC = ElementD;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  static_assert(cute::rank(InternalStrideD{}) == 3, "StrideD must be rank-3: [M, N, L]");

  struct ThreadEpilogueOp {};  // GemmUniversalAdapter names it; the activation is operator() below
  struct SharedStorage {};
  using TensorMapStorage = SharedStorage;

  struct Arguments {
    ElementD** ptr_D = nullptr;    // group g's output [M, N / 2]
    StrideD dD{};
    const float* alpha = nullptr;  // group g's scale (fp8), or null: 1
    const float* limits = nullptr;  // group g's SwiGLUStep limit, or null: plain SwiGLU
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&, int) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }

  CUTLASS_HOST_DEVICE SwiGluEpilogueArray(Params const& params) : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    static_assert(is_static<BlockShapeMNK>::value, "the tile shape must be static");
    static_assert(size<1>(BlockShapeMNK{}) % 64 == 0, "SwiGLU pairs columns 32 apart within 64-column chunks");
    static_assert(is_static<FrgLayout>::value, "the accumulator layout must be static");
    // A wgmma accumulator fragment: ((2 columns, 2 row halves, column groups of 8), MMA_M, MMA_N).
    // Checked on the host for the 128x128 pingpong, 128x256 cooperative and 64x128 tiles: group
    // v + 4 is 32 columns right of group v (benchmarks/NOTES.md, session 9).
    constexpr int kGroups = decltype(size<0, 2>(FrgLayout{}))::value;
    static_assert(decltype(size<0, 0>(FrgLayout{}))::value == 2 && decltype(size<0, 1>(FrgLayout{}))::value == 2 &&
                      kGroups % 8 == 0,
                  "unexpected wgmma accumulator layout");

    const int M = get<0>(problem_shape_mnkl);
    const int N = get<1>(problem_shape_mnkl);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
    const float alpha = params_.alpha ? params_.alpha[l_coord] : 1.0f;
    const bool step = params_.limits != nullptr;
    const float limit = step ? params_.limits[l_coord] : 0.0f;
    const InternalStrideD stride_d = params_.dD[l_coord];
    const int64_t row_pitch = get<0>(stride_d);  // elements between rows of the [M, N / 2] output
    ElementD* out = params_.ptr_D[l_coord];

    // The (m, n) coordinates of this thread's accumulators, in the group's [M, N] product.
    Tensor coords = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(blk_shape_MNK),
                               make_coord(m_coord, n_coord));
    Tensor thread_coords = tiled_mma.get_thread_slice(thread_idx).partition_C(coords);

    cutlass::NumericConverter<ElementD, float, cutlass::FloatRoundStyle::round_to_nearest> to_out;
    auto rounded = [&](float v) { return static_cast<float>(to_out(alpha * v)); };
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < size<1>(accumulators); ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int nn = 0; nn < size<2>(accumulators); ++nn) {
        CUTLASS_PRAGMA_UNROLL
        for (int half = 0; half < 2; ++half) {
          CUTLASS_PRAGMA_UNROLL
          for (int g = 0; g < kGroups; ++g) {
            if (g % 8 >= 4) continue;  // gate groups: read with their up group
            auto up_at = [&](int c) { return make_coord(make_coord(c, half, g), mm, nn); };
            auto gate_at = [&](int c) { return make_coord(make_coord(c, half, g + 4), mm, nn); };
            const auto mn = thread_coords(up_at(0));
            const int m = get<0>(mn), n = get<1>(mn);
            if (m >= M || n >= N) continue;  // N is a multiple of 64: the pair lies within it
            float r[2];
            CUTLASS_PRAGMA_UNROLL
            for (int c = 0; c < 2; ++c) {
              r[c] = swiglu_value(rounded(accumulators(up_at(c))), rounded(accumulators(gate_at(c))), step, limit);
            }
            // Columns n, n + 1 of the product: output columns (n / 64) * 32 + n % 32 and the next.
            cutlass::Array<ElementD, 2> pair;
            pair[0] = to_out(r[0]);
            pair[1] = to_out(r[1]);
            *reinterpret_cast<cutlass::Array<ElementD, 2>*>(out + m * row_pitch + (n / 64) * 32 + n % 32) = pair;
          }
        }
      }
    }
  }

 private:
  Params params_;
};

}  // namespace cake::sm90
