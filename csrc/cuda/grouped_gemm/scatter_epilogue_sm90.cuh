// The MoE GEMM2 with the fused finalize as a grouped GEMM epilogue (Hopper, ptr-array kernels):
// row p of the expert products (permuted order) belongs to route r = rows_to_routes[p] of token
// r / top_k; the tile's accumulators are rounded to the output type (as GEMM2 would store them),
// scaled by the route's router weight and added into out[token], 8 elements a lane after a quad
// transpose, with one 16-byte atomic reduction.
// The k routes of a token then arrive in any order: one output-type rounding per route, not
// bitwise reproducible (the specification's fused finalize; moe_finalize is the fixed-order one).
// The prologue zeroes out before the GEMM starts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cutlass/numeric_conversion.h>

#include "cuda/grouped_gemm/register_epilogue_sm90.cuh"

namespace cake::sm90 {

// Two output elements packed in a word, each rounded to the output type; and eight of them (a
// quad-transposed group, RegisterEpilogueArray::quad_transpose) added to global memory with one
// 16-byte reduction (red, no return value; a generic-pointer atomicAdd also emits a shared-memory path).
template <class T>
struct PackedAdd;
template <>
struct PackedAdd<cutlass::bfloat16_t> {
  static __device__ uint32_t pack(float a, float b) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  static __device__ void add8(void* p, const uint32_t (&w)[4]) {
    asm volatile("red.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]),
                 "r"(w[3])
                 : "memory");
  }
};
template <>
struct PackedAdd<cutlass::half_t> {
  static __device__ uint32_t pack(float a, float b) {
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  static __device__ void add8(void* p, const uint32_t (&w)[4]) {
    asm volatile("red.global.add.noftz.v4.f16x2 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]),
                 "r"(w[3])
                 : "memory");
  }
};

template <class ElementD_, class StrideD_>
class ScatterAddEpilogueArray : public RegisterEpilogueArray<ElementD_, StrideD_> {
  using Base = RegisterEpilogueArray<ElementD_, StrideD_>;

 public:
  using typename Base::ElementD;

  struct Arguments {
    ElementD* out = nullptr;                  // [num_tokens, N], zeroed before the GEMM
    const int32_t* offs = nullptr;            // the grouped GEMM's offsets (group g's first row)
    bool indptr = false;                      // offs holds E + 1 bounds with a leading zero
    const int32_t* rows_to_routes = nullptr;  // permuted row -> expanded route index
    const float* route_scales = nullptr;      // [num_tokens * top_k] router weights
    int64_t routes = 0;                       // num_tokens * top_k
    int top_k = 1;
  };
  using Params = Arguments;

  CUTLASS_HOST_DEVICE ScatterAddEpilogueArray(Params const& params) : params_(params) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    const int M = get<0>(problem_shape_mnkl);
    const int N = get<1>(problem_shape_mnkl);
    const int l_coord = get<3>(blk_coord_mnkl);
    const int64_t first_row =
        params_.indptr ? params_.offs[l_coord] : (l_coord == 0 ? 0 : params_.offs[l_coord - 1]);
    const auto thread_coords =
        Base::template accumulator_coords<FrgLayout>(M, N, blk_shape_MNK, blk_coord_mnkl, tiled_mma, thread_idx);

    cutlass::NumericConverter<ElementD, float, cutlass::FloatRoundStyle::round_to_nearest> to_out;
    struct Row {
      bool in_group;
      float scale;
      ElementD* out;
    };
    auto row_state = [&](int m) {
      Row row{m < M, 0.0f, params_.out};
      if (row.in_group) {
        const int32_t route = params_.rows_to_routes[first_row + m];
        if (route < 0 || route >= params_.routes) __trap();  // no call: a call would serialize the wgmmas
        row.scale = params_.route_scales[route];
        row.out += (route / params_.top_k) * int64_t(N);
      }
      return row;
    };
    // GEMM2's stored row (one rounding), times the router weight, one more rounding.
    auto pack = [&](const Row& row, float a, float b) {
      return PackedAdd<ElementD>::pack(__fmul_rn(row.scale, static_cast<float>(to_out(a))),
                                       __fmul_rn(row.scale, static_cast<float>(to_out(b))));
    };
    auto store = [&](const Row& row, int, int n, const uint32_t(&w)[4]) {
      if (row.in_group && n < N) PackedAdd<ElementD>::add8(row.out + n, w);  // N % 8 == 0
    };
    Base::for_each_octet(accumulators, thread_coords, row_state, pack, store);
  }

 private:
  Params params_;
};

}  // namespace cake::sm90
