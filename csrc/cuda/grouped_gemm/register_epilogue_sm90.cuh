// The part of a CUTLASS collective epilogue that the MoE epilogues (swiglu_epilogue_sm90.cuh,
// scatter_epilogue_sm90.cuh) share: what the SM90 ptr-array kernels and GemmUniversalAdapter ask
// of an epilogue that works from registers (no shared memory, no workspace; wrapped in CUTLASS's
// Sm90TmaWarpSpecializedAdapter), and the coordinates of a thread's accumulators.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/epilogue/dispatch_policy.hpp>

namespace cake::sm90 {

template <class ElementD_, class StrideD_>
struct RegisterEpilogueArray {
  using EpilogueSchedule = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementOutput = ElementD_;
  using ElementD = ElementD_;
  using ElementC = void;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using StrideD = StrideD_;  // a pointer: one [M, N, 1] stride per group
  using StrideC = StrideD_;
  using InternalStrideD = cute::remove_pointer_t<StrideD>;
  using InternalStrideC = InternalStrideD;
  using GmemElementC = ElementD;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  struct ThreadEpilogueOp {};  // GemmUniversalAdapter names it; the derived operator() does the work
  struct SharedStorage {};
  using TensorMapStorage = SharedStorage;

  template <class ProblemShape, class Arguments>
  static constexpr Arguments to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape, class Arguments>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&, int) {
    return 0;
  }
  template <class ProblemShape, class Arguments>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape, class Arguments>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }
  CUTLASS_DEVICE bool is_source_needed() { return false; }

  // The (m, n) coordinates, in the group's [M, N] product, of this thread's accumulators: a wgmma
  // fragment ((2 adjacent columns, 2 row halves 8 apart, column groups of 8), MMA_M, MMA_N),
  // checked on the host for the 128x128 pingpong, 128x256 cooperative and 64x128 tiles
  // (benchmarks/NOTES.md, session 9).
  template <class FrgLayout, class BlockShapeMNK, class BlockCoordMNKL, class TiledMma>
  static CUTLASS_DEVICE auto accumulator_coords(int M, int N, BlockShapeMNK blk_shape_MNK,
                                                BlockCoordMNKL blk_coord_mnkl, TiledMma tiled_mma, int thread_idx) {
    using namespace cute;
    static_assert(is_static<BlockShapeMNK>::value, "the tile shape must be static");
    static_assert(is_static<FrgLayout>::value, "the accumulator layout must be static");
    static_assert(decltype(size<0, 0>(FrgLayout{}))::value == 2 && decltype(size<0, 1>(FrgLayout{}))::value == 2,
                  "unexpected wgmma accumulator layout");
    Tensor coords = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(blk_shape_MNK),
                               make_coord(get<0>(blk_coord_mnkl), get<1>(blk_coord_mnkl)));
    return tiled_mma.get_thread_slice(thread_idx).partition_C(coords);
  }

  // The thread's accumulators 8 columns of a row at a time: for each of its rows m, row_state(m) is what
  // that row's stores need; pack(state, a, b) packs two adjacent accumulators (columns n, n + 1) into a
  // word; after the quad transpose store(state, m, n, w) gets the 4 words of columns [n, n + 8). Every lane
  // of the quad takes part whether or not its row is in the group (store decides what to write).
  template <class Accumulators, class ThreadCoords, class RowState, class Pack, class Store>
  static CUTLASS_DEVICE void for_each_octet(Accumulators const& accumulators, ThreadCoords const& thread_coords,
                                            RowState row_state, Pack pack, Store store) {
    using namespace cute;
    constexpr int kGroups = decltype(size<0, 2>(accumulators.layout()))::value;
    static_assert(kGroups % 4 == 0, "the quad transpose takes column groups 4 at a time");
    const int q = threadIdx.x & 3;
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < size<1>(accumulators); ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int half = 0; half < 2; ++half) {
        const int m = get<0>(thread_coords(make_coord(make_coord(0, half, 0), mm, 0)));
        const auto state = row_state(m);
        CUTLASS_PRAGMA_UNROLL
        for (int nn = 0; nn < size<2>(accumulators); ++nn) {
          CUTLASS_PRAGMA_UNROLL
          for (int b = 0; b < kGroups / 4; ++b) {
            uint32_t w[4];
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < 4; ++j) {
              auto at = [&](int c) { return make_coord(make_coord(c, half, 4 * b + j), mm, nn); };
              w[j] = pack(state, accumulators(at(0)), accumulators(at(1)));
            }
            quad_transpose(w);
            // Lane q now holds group 4b + q whole: its 8 columns start 2q left of lane q's own pair.
            const int n = get<1>(thread_coords(make_coord(make_coord(0, half, 4 * b + q), mm, nn))) - 2 * q;
            store(state, m, n, w);
          }
        }
      }
    }
  }

  // The 4 lanes of a quad hold one accumulator row: lane q has columns 2q, 2q + 1 of each 8-column
  // group. Given w[j] = lane q's two packed outputs of group j of 4 consecutive groups, the quad
  // transposes them so that lane q holds all 8 columns of group q (w[i] = columns 2i, 2i + 1): one
  // 16-byte access where there were four 4-byte ones. Two butterfly steps of shfl.xor (each lane
  // keeps the words its partner does not need); every lane of the warp must take part.
  static CUTLASS_DEVICE void quad_transpose(uint32_t (&w)[4]) {
    const int q = threadIdx.x & 3;
    CUTLASS_PRAGMA_UNROLL
    for (int mask = 1; mask <= 2; mask *= 2) {
      const bool upper = (q & mask) != 0;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < 4; ++j) {
        if (j & mask) continue;  // the pair (j, j | mask)
        const uint32_t got = __shfl_xor_sync(0xffffffffu, upper ? w[j] : w[j | mask], mask);
        if (upper) {
          w[j] = got;
        } else {
          w[j | mask] = got;
        }
      }
    }
  }
};

}  // namespace cake::sm90
