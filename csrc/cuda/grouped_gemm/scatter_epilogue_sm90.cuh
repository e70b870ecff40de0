// The MoE GEMM2 with the fused finalize as a grouped GEMM epilogue (Hopper, ptr-array kernels):
// row p of the expert products (permuted order) belongs to route r = rows_to_routes[p] of token
// r / top_k; the tile's accumulators are rounded to the output type (as GEMM2 would store them),
// scaled by the route's router weight and added into out[token] with a packed two-element atomic.
// The k routes of a token then arrive in any order: one output-type rounding per route, not
// bitwise reproducible (the specification's fused finalize; moe_finalize is the fixed-order one).
// The prologue zeroes out before the GEMM starts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/epilogue/dispatch_policy.hpp>
#include <cutlass/numeric_conversion.h>

namespace cake::sm90 {

// Two adjacent output elements += (a, b), each rounded to the output type first: one reduction to
// global memory (red, no return value; a generic-pointer atomicAdd also emits a shared-memory path).
template <class T>
struct PackedAdd;
template <>
struct PackedAdd<cutlass::bfloat16_t> {
  static __device__ void add(void* p, float a, float b) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    asm volatile("red.global.add.noftz.bf16x2 [%0], %1;" ::"l"(p), "r"(*reinterpret_cast<const uint32_t*>(&v))
                 : "memory");
  }
};
template <>
struct PackedAdd<cutlass::half_t> {
  static __device__ void add(void* p, float a, float b) {
    const __half2 v = __floats2half2_rn(a, b);
    asm volatile("red.global.add.noftz.f16x2 [%0], %1;" ::"l"(p), "r"(*reinterpret_cast<const uint32_t*>(&v))
                 : "memory");
  }
};

template <class ElementD_, class StrideD_>
class ScatterAddEpilogueArray {
 public:
  using EpilogueSchedule = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementOutput = ElementD_;
  using ElementD = ElementD_;
  using ElementC = void;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using StrideD = StrideD_;
  using StrideC = StrideD_;
  using InternalStrideD = cute::remove_pointer_t<StrideD>;
  using InternalStrideC = InternalStrideD;
  using GmemElementC = ElementD;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;

  struct ThreadEpilogueOp {};  // GemmUniversalAdapter names it; the combine is operator() below
  struct SharedStorage {};
  using TensorMapStorage = SharedStorage;

  struct Arguments {
    ElementD* out = nullptr;                 // [num_tokens, N], zeroed before the GEMM
    const int32_t* offs = nullptr;           // the grouped GEMM's offsets (group g's first row)
    bool indptr = false;                     // offs holds E + 1 bounds with a leading zero
    const int32_t* rows_to_routes = nullptr;  // permuted row -> expanded route index
    const float* route_scales = nullptr;     // [num_tokens * top_k] router weights
    int64_t routes = 0;                      // num_tokens * top_k
    int top_k = 1;
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

  CUTLASS_HOST_DEVICE ScatterAddEpilogueArray(Params const& params) : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    static_assert(is_static<FrgLayout>::value, "the accumulator layout must be static");
    // A wgmma accumulator fragment: ((2 adjacent columns, 2 row halves, column groups), MMA_M, MMA_N)
    // (swiglu_epilogue_sm90.cuh has the host check).
    static_assert(decltype(size<0, 0>(FrgLayout{}))::value == 2 && decltype(size<0, 1>(FrgLayout{}))::value == 2,
                  "unexpected wgmma accumulator layout");
    constexpr int kGroups = decltype(size<0, 2>(FrgLayout{}))::value;

    const int M = get<0>(problem_shape_mnkl);
    const int N = get<1>(problem_shape_mnkl);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
    const int64_t first_row =
        params_.indptr ? params_.offs[l_coord] : (l_coord == 0 ? 0 : params_.offs[l_coord - 1]);

    Tensor coords = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(blk_shape_MNK),
                               make_coord(m_coord, n_coord));
    Tensor thread_coords = tiled_mma.get_thread_slice(thread_idx).partition_C(coords);

    cutlass::NumericConverter<ElementD, float, cutlass::FloatRoundStyle::round_to_nearest> to_out;
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < size<1>(accumulators); ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int half = 0; half < 2; ++half) {
        const int m = get<0>(thread_coords(make_coord(make_coord(0, half, 0), mm, 0)));
        if (m >= M) continue;
        const int32_t route = params_.rows_to_routes[first_row + m];
        if (route < 0 || route >= params_.routes) __trap();  // no call: a call would serialize the wgmmas
        const float scale = params_.route_scales[route];
        ElementD* out_row = params_.out + (route / params_.top_k) * int64_t(N);
        CUTLASS_PRAGMA_UNROLL
        for (int nn = 0; nn < size<2>(accumulators); ++nn) {
          CUTLASS_PRAGMA_UNROLL
          for (int g = 0; g < kGroups; ++g) {
            auto at = [&](int c) { return make_coord(make_coord(c, half, g), mm, nn); };
            const int n = get<1>(thread_coords(at(0)));
            if (n >= N) continue;  // N is even: the pair lies within it
            // GEMM2's stored row (one rounding), times the router weight, one more rounding.
            const float a = __fmul_rn(scale, static_cast<float>(to_out(accumulators(at(0)))));
            const float b = __fmul_rn(scale, static_cast<float>(to_out(accumulators(at(1)))));
            PackedAdd<ElementD>::add(out_row + n, a, b);
          }
        }
      }
    }
  }

 private:
  Params params_;
};

}  // namespace cake::sm90
