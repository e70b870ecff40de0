// Hopper (sm_90a) ragged grouped GEMM: a CUTLASS ptr-array grouped kernel (warp-specialized
// wgmma + TMA, persistent group tile scheduler) fed by a small device prologue that reads the
// group offsets and writes each group's problem shape, pointers and strides. The host never
// reads the offsets, so a launch needs no synchronisation and can be captured in a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include "cuda/common/pdl.cuh"
#include "cuda/grouped_gemm/fixed_operand_sm90.cuh"
#include "cuda/grouped_gemm/gather_mainloop_sm90.cuh"
#include "cuda/grouped_gemm/grouped_gemm_launch.h"
#include "cuda/grouped_gemm/scatter_epilogue_sm90.cuh"
#include "cuda/grouped_gemm/store_epilogue_sm90.cuh"
#include "cuda/grouped_gemm/swiglu_epilogue_sm90.cuh"
#include "grouped_gemm_checks.h"

namespace cake::sm90 {

using namespace cute;

// kFwdSwapAB / kDgradSwapAB compute the same ops transposed (D^T = B^T A^T): the weight fills
// the tile's M side and the few rows of a group its N side, so decode-sized groups (a handful
// of rows per expert) do not waste a 64- or 128-row tile on padding and the weight tile can be
// long along its contiguous dimension.
// kFwdSwiGlu is fwd with the MoE GEMM1's SwiGLU in the epilogue (swiglu_epilogue_sm90.cuh): out
// is [sum_m, N / 2]. kFwdScatter is fwd with the MoE GEMM2's fused finalize in the epilogue
// (scatter_epilogue_sm90.cuh): GroupedGemmParams::scatter.out [num_tokens, N] instead of out.
// kFwdGatherSwiGlu is kFwdSwiGlu whose A rows are gathered from the MoE's x by the mainloop
// (gather_mainloop_sm90.cuh, GroupedGemmParams::gather): a is x, not the gathered rows.
enum class Kind { kFwd, kDgrad, kWgrad, kFwdSwapAB, kDgradSwapAB, kFwdSwiGlu, kFwdScatter, kFwdGatherSwiGlu };

constexpr bool is_swap_ab(Kind k) { return k == Kind::kFwdSwapAB || k == Kind::kDgradSwapAB; }
// The op a kind computes (fwd, dgrad or wgrad), whatever its operand order or epilogue.
constexpr Kind op_of(Kind k) {
  return k == Kind::kFwdSwapAB || k == Kind::kFwdSwiGlu || k == Kind::kFwdScatter || k == Kind::kFwdGatherSwiGlu
             ? Kind::kFwd
         : k == Kind::kDgradSwapAB                                               ? Kind::kDgrad
                                                                                 : k;
}

// How a schedule's mainloop reads its operands: through CUTLASS's per-group pointer array by default;
// the *Fixed schedules below read fixed operand descriptors, the *GateUp ones w1 as [gate; up] halves.
struct OperandLoads {
  static constexpr bool kFixedOperands = false;
  static constexpr bool kGateUpHalves = false;
};
// Cooperative: both consumer warpgroups split one tile (good for large tiles). Pingpong: each
// consumer warpgroup owns a tile and their mainloops and epilogues alternate (good for small
// tiles, where the epilogue would otherwise idle the tensor cores).
struct Cooperative : OperandLoads {
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Pingpong : OperandLoads {
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};
// The same schedules with fixed operand descriptors (fixed_operand_sm90.cuh): fwd and dgrad; wgrad
// cooperative only.
struct CooperativeFixed : Cooperative {
  static constexpr bool kFixedOperands = true;
};
struct PingpongFixed : Pingpong {
  static constexpr bool kFixedOperands = true;
};
// The fixed schedules reading w1 as [gate; up] halves (transformers' gate_up_proj as it is): each tile's
// B as two boxes, its gate rows and their up rows (fixed_operand_sm90.cuh); the SwiGLU twins only.
struct CooperativeFixedGateUp : CooperativeFixed {
  static constexpr bool kGateUpHalves = true;
};
struct PingpongFixedGateUp : PingpongFixed {
  static constexpr bool kGateUpHalves = true;
};
// e4m3 inputs: the fp8 wgmma accumulates into the fp32 accumulators directly ("fast
// accumulation"). The alternative, promoting a second register set into fp32 every few k-blocks,
// measured 1.46x slower than bf16 on the H200 (benchmarks/NOTES.md); per-tensor scaled inference
// GEMMs (TensorRT-LLM, vLLM) run fast accumulation too.
struct CooperativeFp8 : OperandLoads {
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct PingpongFp8 : OperandLoads {
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// CUTLASS's SM90 ptr-array kernels do not wait for their predecessor themselves, so a launch
// with PDL (GroupedGemmParams::pdl) would race with the prologue that writes their arguments:
// this kernel waits first, then lets its successor launch.
template <class Base>
struct WaitForPredecessor : Base {
  CUTLASS_DEVICE void operator()(typename Base::Params const& params, char* smem) {
    pdl_wait();
    pdl_launch_dependents();
    Base::operator()(params, smem);
  }
};

// The GEMM each kind runs per group g (rows [s, t) of the packed operands, expert e), in
// CUTLASS terms D (M x N) = A (M x K) * B (K x N):
//   fwd:   M = t-s, N = N, K = K;  A = x[s:t] (row-major),  B = w[e]^T (K-major), D = y[s:t]
//   dgrad: M = t-s, N = K, K = N;  A = g[s:t] (row-major),  B = w[e] (N-major, read in place)
//   wgrad: M = N, N = K, K = t-s;  A = g[s:t]^T (M-major),  B = x[s:t] (N-major), D = dw[e]
// and transposed (swap AB), D = y[s:t]^T / dx[s:t]^T (column-major, written in place):
//   fwd:   M = N, N = t-s, K = K;  A = w[e] (row-major),    B = x[s:t] (K-major)
//   dgrad: M = K, N = t-s, K = N;  A = w[e]^T (M-major),    B = g[s:t] (K-major)
template <Kind kKind, class ElementIn_, class ElementOut_, class TileShape_, class ClusterShape_, class Schedule>
struct GroupedGemmConfig {
  static constexpr Kind kind = kKind;
  static constexpr Kind op = op_of(kKind);
  using ElementIn = ElementIn_;
  using ElementOut = ElementOut_;
  // fp8 inputs (per-tensor scaled): the epilogue multiplies group g's accumulators by
  // alpha[g] = a_scale * b_scale[g] (GroupedGemmParams), which the prologue writes.
  static constexpr bool kScaled = std::is_same_v<ElementIn_, cutlass::float_e4m3_t>;
  using ElementAccumulator = float;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using LayoutA = std::conditional_t<kKind == Kind::kWgrad || kKind == Kind::kDgradSwapAB,
                                     cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutB = std::conditional_t<op_of(kKind) == Kind::kFwd || is_swap_ab(kKind),
                                     cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutD = std::conditional_t<is_swap_ab(kKind), cutlass::layout::ColumnMajor,
                                     cutlass::layout::RowMajor>;
  static constexpr int kAlignIn = 128 / cutlass::sizeof_bits<ElementIn>::value;
  static constexpr int kAlignOut = 128 / cutlass::sizeof_bits<ElementOut>::value;

  static constexpr bool kGather = kKind == Kind::kFwdGatherSwiGlu;
  static constexpr bool kSwiGlu = kKind == Kind::kFwdSwiGlu || kGather;
  static constexpr bool kScatter = kKind == Kind::kFwdScatter;
  static constexpr bool kFixed = Schedule::kFixedOperands;
  static constexpr bool kGateUp = Schedule::kGateUpHalves;
  static_assert(!kGateUp || (kSwiGlu && kFixed && !kScaled), "gate_up halves: 16-bit SwiGLU twins, fixed operands");
  static_assert(!kFixed || !is_swap_ab(kKind), "fixed operands: a group's rows are never the tile's N side");
  using StrideDPtr = cutlass::detail::TagToStrideC_t<LayoutD*>;
  // wgrad with fixed operands: the plain kernels' TMA store epilogue over dw as one tensor (fixed_operand_sm90.cuh).
  template <class EpilogueSchedule, class LayoutTag>
  using BuiltEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape_, ClusterShape_,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementAccumulator,
      void, LayoutTag, kAlignOut,  // no source C: D = A * B
      ElementOut, LayoutTag, kAlignOut, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementOut, ElementAccumulator, void,
                                                   ElementAccumulator>>::CollectiveOp;
  using CollectiveEpilogue = std::conditional_t<
      kFixed && op_of(kKind) == Kind::kWgrad,
      FixedOutputEpilogue<BuiltEpilogue<cutlass::epilogue::TmaWarpSpecializedCooperative, LayoutD>>,
      std::conditional_t<
      kSwiGlu,
      cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<SwiGluEpilogueArray<ElementOut, StrideDPtr, kGateUp>>,
      std::conditional_t<kScatter,
      cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<ScatterAddEpilogueArray<ElementOut, StrideDPtr>>,
      std::conditional_t<kFixed,
      cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<StoreEpilogueArray<ElementOut, StrideDPtr>>,
      BuiltEpilogue<typename Schedule::EpilogueSchedule, LayoutD*>>>>>;

  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn, LayoutA*, kAlignIn,
      ElementIn, LayoutB*, kAlignIn, ElementAccumulator, TileShape_, ClusterShape_,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage) +
          (kGather ? cute::size<0>(TileShape_{}) * sizeof(const char*) : 0))>,  // the gather's row table
      typename Schedule::KernelSchedule>::CollectiveOp;
  using PlainMainloop = std::conditional_t<
      kFixed, FixedOperandMainloop<BuiltMainloop, op_of(kKind) == Kind::kWgrad, kGateUp>, BuiltMainloop>;
  using CollectiveMainloop = std::conditional_t<kGather, GatherAMainloop<PlainMainloop, kFixed>, PlainMainloop>;

  using Kernel = WaitForPredecessor<
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using GroupShape = typename ProblemShape::UnderlyingProblemShape;
};

// The per-group argument arrays the prologue writes, carved out of the caller's workspace.
template <class Config>
struct GroupArrays {
  typename Config::GroupShape* shapes;
  const typename Config::ElementIn** ptr_a;
  const typename Config::ElementIn** ptr_b;
  typename Config::ElementOut** ptr_d;
  typename Config::StrideA* stride_a;
  typename Config::StrideB* stride_b;
  typename Config::StrideD* stride_d;
  float* alpha;  // fp8 configurations: the epilogue's per-group scale
};

template <Kind kKind>
constexpr const char* kBadOffsetsMessage =
    kKind == Kind::kFwd     ? "cake::grouped_gemm_fwd: offs must be non-decreasing group ends within [0, sum_m] (m_indptr: leading 0)"
    : kKind == Kind::kDgrad ? "cake::grouped_gemm_dgrad: offs must be non-decreasing group ends within [0, sum_m] (m_indptr: leading 0)"
                            : "cake::grouped_gemm_wgrad: offs must be non-decreasing group ends within [0, sum_m] (m_indptr: leading 0)";

constexpr int kPrologueThreads = 256;

// 16-byte zero stores over [begin, end) bytes of `base` (16-byte aligned, sizes multiples of 16).
__device__ inline void zero_bytes(char* base, int64_t begin, int64_t end, int64_t first_thread,
                                  int64_t num_threads) {
  for (int64_t i = begin + 16 * first_thread; i < end; i += 16 * num_threads) {
    *reinterpret_cast<uint4*>(base + i) = make_uint4(0, 0, 0, 0);
  }
}

// Group e's problem shape, pointers, strides (and fp8 scale), from its offsets.
template <class Config>
__device__ void write_group_arguments(const GroupedGemmParams& p, const GroupArrays<Config>& arr, int64_t e) {
  constexpr Kind kKind = Config::op;
  using ElementIn = typename Config::ElementIn;
  using ElementOut = typename Config::ElementOut;
  const int32_t* ends = p.offs + (p.indptr ? 1 : 0);
  const int64_t start = e == 0 ? 0 : ends[e - 1];
  const int64_t end = ends[e];
  const int64_t rows = end - start;
  if (rows < 0 || end > p.sum_m || start < 0 || (p.indptr && e == 0 && p.offs[0] != 0)) {
    __assert_fail(kBadOffsetsMessage<kKind>, __FILE__, __LINE__, __func__);
  }
  auto a = static_cast<const ElementIn*>(p.a);
  auto b = static_cast<const ElementIn*>(p.b);
  auto d = static_cast<ElementOut*>(p.out);
  const int m = static_cast<int>(rows);
  const int n = static_cast<int>(p.n);
  const int k = static_cast<int>(p.k);
  // The group's CUTLASS problem D (M x N) = A (M x K) * B (K x N), set per kind below; the
  // strides follow from it: A {M, K}, B {N, K}, D {M, N}.
  int gm = 0, gn = 0, gk = 0;
  const ElementIn *ga = nullptr, *gb = nullptr;
  ElementOut* gd = nullptr;
  if constexpr (Config::kind == Kind::kFwdSwapAB) {
    gm = n, gn = m, gk = k;
    ga = b + e * p.n * p.k, gb = a + start * p.k, gd = d + start * p.n;
  } else if constexpr (Config::kind == Kind::kDgradSwapAB) {
    gm = k, gn = m, gk = n;
    ga = b + e * p.n * p.k, gb = a + start * p.n, gd = d + start * p.k;
  } else if constexpr (kKind == Kind::kFwd) {
    gm = m, gn = n, gk = k;
    ga = Config::kGather ? a : a + start * p.k;  // gathered: the mainloop reads x's rows itself
    gb = b + e * p.n * p.k, gd = d + start * (Config::kSwiGlu ? p.n / 2 : p.n);
  } else if constexpr (kKind == Kind::kDgrad) {
    gm = m, gn = k, gk = n;
    ga = a + start * p.n, gb = b + e * p.n * p.k, gd = d + start * p.k;
  } else {
    gm = n, gn = k, gk = m;
    ga = a + start * p.n, gb = b + start * p.k, gd = d + e * p.n * p.k;
  }
  // wgrad: an empty group reduces over nothing: it gets no tiles (M = 0) and is zeroed instead.
  arr.shapes[e] = {kKind == Kind::kWgrad && m == 0 ? 0 : gm, gn, gk};
  arr.ptr_a[e] = ga;
  arr.ptr_b[e] = gb;
  arr.ptr_d[e] = gd;
  arr.stride_a[e] = cutlass::make_cute_packed_stride(typename Config::StrideA{}, {gm, gk, 1});
  arr.stride_b[e] = cutlass::make_cute_packed_stride(typename Config::StrideB{}, {gn, gk, 1});
  arr.stride_d[e] = cutlass::make_cute_packed_stride(typename Config::StrideD{}, {gm, Config::kSwiGlu ? gn / 2 : gn, 1});
  if constexpr (Config::kScaled) {
    arr.alpha[e] = (p.a_scale ? *p.a_scale : 1.0f) * (p.b_scale ? p.b_scale[e] : 1.0f);
  }
}

// The prologue's grid. wgrad: (kZeroBlocksPerGroup, max(E, 1)), block (0, e) writes group e's
// arguments and the group's blocks zero its dw when it is empty (most of the output at decode:
// each empty group's zeroing runs in parallel with the others'). fwd / dgrad: one thread per
// group over one block per 256 groups, and with zero_tail at least 4 blocks per SM sharing the
// rows past the last group's end; a decode GEMM's prologue is then one block, not an idle
// output-sized grid.
constexpr int kZeroBlocksPerGroup = 16;

template <class Config>
dim3 prologue_grid(const GroupedGemmParams& p) {
  const int64_t groups = std::max<int64_t>(p.num_groups, 1);
  if constexpr (Config::op == Kind::kWgrad) return dim3(kZeroBlocksPerGroup, static_cast<unsigned>(groups));
  const int64_t argument_blocks = (groups + kPrologueThreads - 1) / kPrologueThreads;
  const bool zeroes = p.zero_tail || Config::kScatter;
  return dim3(static_cast<unsigned>(zeroes ? std::max<int64_t>(argument_blocks, 4 * int64_t(p.sm_count))
                                           : argument_blocks));
}

template <class Config>
__global__ void __launch_bounds__(kPrologueThreads)
    prepare_groups_kernel(GroupedGemmParams p, GroupArrays<Config> arr) {
  pdl_wait();
  pdl_launch_dependents();
  constexpr Kind kKind = Config::op;
  using ElementOut = typename Config::ElementOut;
  const int32_t* ends = p.offs + (p.indptr ? 1 : 0);
  if constexpr (kKind == Kind::kWgrad) {
    const int64_t e = blockIdx.y;
    if (e >= p.num_groups) return;
    if (blockIdx.x == 0 && threadIdx.x == 0) write_group_arguments<Config>(p, arr, e);
    if (ends[e] == (e == 0 ? 0 : ends[e - 1])) {  // an empty group: no tile writes its dw
      const int64_t bytes = p.n * p.k * int64_t(sizeof(ElementOut));
      zero_bytes(static_cast<char*>(p.out) + e * bytes, 0, bytes, int64_t(blockIdx.x) * blockDim.x + threadIdx.x,
                 int64_t(gridDim.x) * blockDim.x);
    }
  } else {
    const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t threads = int64_t(gridDim.x) * blockDim.x;
    for (int64_t e = thread; e < p.num_groups; e += threads) write_group_arguments<Config>(p, arr, e);
    // The tail can be most of the output (expert-parallel MoE shards).
    const int64_t last_end = p.num_groups > 0 ? ends[p.num_groups - 1] : 0;
    const int64_t row_bytes =
        (kKind == Kind::kFwd ? (Config::kSwiGlu ? p.n / 2 : p.n) : p.k) * int64_t(sizeof(ElementOut));
    if (p.zero_tail && last_end >= 0 && last_end < p.sum_m) {
      zero_bytes(static_cast<char*>(p.out), last_end * row_bytes, p.sum_m * row_bytes, thread, threads);
    }
    if constexpr (Config::kScatter) {  // the routes' rows are added into it
      zero_bytes(static_cast<char*>(p.scatter.out), 0, p.scatter.num_tokens * row_bytes, thread, threads);
    }
  }
}

// Hands out aligned slices of the caller's workspace.
struct WorkspaceCarver {
  char* next;
  char* end;
  template <class T>
  T* take(int64_t count) {
    auto aligned = reinterpret_cast<char*>(
        (reinterpret_cast<uintptr_t>(next) + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign);
    next = aligned + count * int64_t(sizeof(T));
    TORCH_CHECK(next <= end, "cake grouped GEMM: workspace too small (internal error)");
    return reinterpret_cast<T*>(aligned);
  }
};

template <class Config>
void run_grouped_gemm(const GroupedGemmParams& p, cudaStream_t stream) {
  using Gemm = typename Config::Gemm;
  static_assert(sizeof(typename Config::GroupShape) + 3 * sizeof(void*) +
                        sizeof(typename Config::StrideA) + sizeof(typename Config::StrideB) +
                        sizeof(typename Config::StrideD) + sizeof(float) <=
                    kPerGroupBytes,
                "per-group arguments outgrew kPerGroupBytes");
  const int64_t E = p.num_groups;
  WorkspaceCarver ws{static_cast<char*>(p.workspace),
                     static_cast<char*>(p.workspace) + p.workspace_bytes};
  GroupArrays<Config> arr{ws.take<typename Config::GroupShape>(E),
                          ws.take<const typename Config::ElementIn*>(E),
                          ws.take<const typename Config::ElementIn*>(E),
                          ws.take<typename Config::ElementOut*>(E),
                          ws.take<typename Config::StrideA>(E),
                          ws.take<typename Config::StrideB>(E),
                          ws.take<typename Config::StrideD>(E),
                          ws.take<float>(E)};

  launch_kernel(prepare_groups_kernel<Config>, prologue_grid<Config>(p), dim3(kPrologueThreads), 0, stream, p.pdl, p,
                arr);
  if (E == 0) return;

  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = p.device;
  hw_info.sm_count = static_cast<int>(std::min<int64_t>(p.sm_count, kMaxPersistentCtas));

  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {static_cast<int>(E), arr.shapes, nullptr};
  // The base mainloop's arguments (the gathering mainloop's derive from them).
  auto& mainloop_args = static_cast<typename Config::PlainMainloop::Arguments&>(args.mainloop);
  if constexpr (Config::kFixed) {
    // Every group's rows of A from x / grad_out, every expert's B from w (write_group_arguments' table);
    // wgrad: A = grad_out and B = x, both [sum_m, *], and (n, k) are the group's CUTLASS M and N.
    // Gathered: A's descriptor spans x's rows and is never loaded through (the mainloop copies A's rows).
    const bool dgrad = Config::op == Kind::kDgrad;
    const int64_t a_rows = Config::kGather ? p.gather.routes / p.gather.top_k : p.sum_m;
    mainloop_args = {static_cast<const typename Config::ElementIn*>(p.a), static_cast<const typename Config::ElementIn*>(p.b),
                     static_cast<int32_t>(a_rows), static_cast<int32_t>(dgrad ? p.k : p.n),
                     static_cast<int32_t>(dgrad ? p.n : p.k), static_cast<int32_t>(E), p.offs, p.indptr};
  } else {
    mainloop_args = {arr.ptr_a, arr.stride_a, arr.ptr_b, arr.stride_b};
  }
  if constexpr (Config::kGather) {
    const int32_t* ends = p.offs + (p.indptr ? 1 : 0);
    args.mainloop.gather = {p.a, p.k, ends, p.gather.rows_to_routes, p.gather.routes, p.gather.top_k};
  }
  if constexpr (Config::kSwiGlu) {
    args.epilogue = {arr.ptr_d, arr.stride_d, Config::kScaled ? arr.alpha : nullptr, p.swiglu_limits};
  } else if constexpr (Config::kScatter) {
    static_assert(!Config::kScaled, "the fused finalize takes 16-bit operands");
    args.epilogue = {static_cast<typename Config::ElementOut*>(p.scatter.out), p.offs, p.indptr,
                     p.scatter.rows_to_routes, p.scatter.route_scales, p.scatter.num_tokens * p.scatter.top_k,
                     p.scatter.top_k};
  } else if constexpr (Config::kFixed && Config::op == Kind::kWgrad) {
    args.epilogue = {static_cast<typename Config::ElementOut*>(p.out), static_cast<int32_t>(p.n),
                     static_cast<int32_t>(p.k), static_cast<int32_t>(E)};
  } else if constexpr (Config::kFixed) {
    args.epilogue = {arr.ptr_d, arr.stride_d, Config::kScaled ? arr.alpha : nullptr};
  } else {
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    if constexpr (Config::kScaled) {
      args.epilogue.thread.alpha_ptr = arr.alpha;
      args.epilogue.thread.dAlpha = {_0{}, _0{}, 1};  // one alpha per group
    }
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = nullptr;
    args.epilogue.ptr_D = arr.ptr_d;
    args.epilogue.dD = arr.stride_d;
  }
  args.hw_info = hw_info;
  using RasterOrder = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order = p.raster_along_n ? RasterOrder::AlongN : RasterOrder::AlongM;
  args.scheduler.max_swizzle_size = p.swizzle;

  char* cutlass_workspace = ws.take<char>(0);
  const size_t need = Gemm::get_workspace_size(args);
  TORCH_CHECK(cutlass_workspace + need <= ws.end,
              "cake grouped GEMM: CUTLASS workspace of ", need, " bytes exceeds the reserve (internal error)");
  Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  TORCH_CHECK(status == cutlass::Status::kSuccess, "cake grouped GEMM: CUTLASS cannot run this problem: ",
              cutlassGetStatusString(status));
  status = gemm.initialize(args, cutlass_workspace, stream);
  TORCH_CHECK(status == cutlass::Status::kSuccess, "cake grouped GEMM: CUTLASS initialize failed: ",
              cutlassGetStatusString(status));
  status = gemm.run(stream, nullptr, p.pdl);
  TORCH_CHECK(status == cutlass::Status::kSuccess, "cake grouped GEMM: CUTLASS launch failed: ",
              cutlassGetStatusString(status));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cake::sm90

// Defines the launcher of one configuration (used by the generated per-configuration .cu files;
// grouped_gemm_tactics.cpp declares them all);
// a SwiGLU twin (CAKE_SWIGLU_CONFIG) or scatter twin (CAKE_SCATTER_CONFIG) is the same
// configuration with kind kFwdSwiGlu or kFwdScatter.
#define CAKE_GG_DEFINE_CONFIG(name, kind, in, out, tm, tn, tk, cm, cn, schedule)                  \
  namespace cake::sm90 {                                                                        \
  void grouped_gemm_##name(const cake::GroupedGemmParams& p, cudaStream_t stream) {             \
    using Config = GroupedGemmConfig<Kind::kind, in, out,                                        \
                                     cute::Shape<cute::Int<tm>, cute::Int<tn>, cute::Int<tk>>,   \
                                     cute::Shape<cute::Int<cm>, cute::Int<cn>, cute::_1>, schedule>; \
    run_grouped_gemm<Config>(p, stream);                                                         \
  }                                                                                              \
  }
#define CAKE_SWIGLU_DEFINE_CONFIG CAKE_GG_DEFINE_CONFIG
#define CAKE_SCATTER_DEFINE_CONFIG CAKE_GG_DEFINE_CONFIG
#define CAKE_GATHER_DEFINE_CONFIG CAKE_GG_DEFINE_CONFIG
#define CAKE_GATEUP_DEFINE_CONFIG CAKE_GG_DEFINE_CONFIG
