// Fixed-operand grouped GEMM (Hopper, fwd and dgrad): the ptr-array kernels' mainloop with one TMA
// descriptor for all the groups' rows (the packed x or grad_out, [sum_m, K]) and one for all the
// experts' weights (w as a 3-D tensor, expert index as its third mode), both built once on the host.
// A group is a row offset into the first and an expert coordinate into the second, so a CTA that moves
// to another group rewrites no descriptor: CUTLASS's ptr-array mainloop patches both descriptors in
// global memory and fences them (a round trip the producer waits on) at every change of group, the
// cost that held E=128 problems ~15% under the dense rate with K=2048 (benchmarks/NOTES.md, session 24).
//
// A tile's rows past its group's end are the next group's (or past sum_m: TMA fills zeros); they are
// computed and dropped by the epilogue, which stores rows < M only (a register epilogue: a TMA store
// would need a per-group descriptor again). The reduction (K) runs over the whole operand width, never
// across groups, so this works for fwd and dgrad and not for wgrad, whose K is a group's rows.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/collective_builder.hpp>

namespace cake::sm90 {

// Base: the CollectiveMma that CUTLASS's builder gives for a ptr-array kernel schedule.
template <class Base>
struct FixedOperandMainloop : Base {
  using typename Base::ElementA;
  using typename Base::ElementB;
  using typename Base::GmemTiledCopyA;
  using typename Base::GmemTiledCopyB;
  using typename Base::InternalStrideA;
  using typename Base::InternalStrideB;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;

  static_assert(cute::is_same_v<ElementA, ElementB>, "one input type");
  // A: row-major packed rows, (M, K, 1). B: (N, K, E) with the expert stride as its third mode.
  using StrideB3 = decltype(cute::replace<2>(InternalStrideB{}, int64_t{}));
  using TmaA = decltype(cute::make_tma_copy(
      GmemTiledCopyA{},
      cute::make_tensor(static_cast<ElementA const*>(nullptr), cute::repeat_like(InternalStrideA{}, int32_t(0)),
                        InternalStrideA{}),
      SmemLayoutA{}(cute::_, cute::_, cute::Int<0>{}),
      cute::make_shape(cute::shape<0>(TileShape{}), cute::shape<2>(TileShape{})), cute::size<1>(ClusterShape{})));
  using TmaB = decltype(cute::make_tma_copy(
      GmemTiledCopyB{},
      cute::make_tensor(static_cast<ElementB const*>(nullptr), cute::repeat_like(StrideB3{}, int32_t(0)), StrideB3{}),
      SmemLayoutB{}(cute::_, cute::_, cute::Int<0>{}),
      cute::make_shape(cute::shape<1>(TileShape{}), cute::shape<2>(TileShape{})), cute::size<0>(ClusterShape{})));

  struct Arguments {
    ElementA const* a = nullptr;   // [rows, k] row-major: every group's rows, packed
    ElementB const* b = nullptr;   // groups x (n, k) with Base's B layout, one group after another
    int32_t rows = 0;              // sum_m
    int32_t n = 0, k = 0;          // each group's CUTLASS N and K
    int32_t groups = 0;
    const int32_t* offs = nullptr;  // group ends (or m_indptr when indptr): group g's first row
    bool indptr = false;
  };
  struct Params {
    TmaA tma_a;
    TmaB tma_b;
    uint32_t tma_transaction_bytes;  // the kernel sizes its pipeline's transactions by it
    int32_t rows, n, k, groups;
    const int32_t* offs;
    bool indptr;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    using namespace cute;
    const int64_t k = args.k, n = args.n;
    InternalStrideA stride_a{};
    get<0>(stride_a) = k;  // row-major rows of k elements
    StrideB3 stride_b{};
    // B's own layout within a group (K-major for fwd, N-major for dgrad), groups n * k apart.
    if constexpr (is_static<remove_cvref_t<decltype(get<1>(stride_b))>>::value) {
      get<0>(stride_b) = k;
    } else {
      get<1>(stride_b) = n;
    }
    get<2>(stride_b) = n * k;
    Tensor tensor_a = make_tensor(args.a, make_layout(make_shape(args.rows, args.k, 1), stride_a));
    Tensor tensor_b = make_tensor(args.b, make_layout(make_shape(args.n, args.k, args.groups), stride_b));
    TmaA tma_a = make_tma_copy(GmemTiledCopyA{}, tensor_a, SmemLayoutA{}(_, _, Int<0>{}),
                               make_shape(shape<0>(TileShape{}), shape<2>(TileShape{})), size<1>(ClusterShape{}));
    TmaB tma_b = make_tma_copy(GmemTiledCopyB{}, tensor_b, SmemLayoutB{}(_, _, Int<0>{}),
                               make_shape(shape<1>(TileShape{}), shape<2>(TileShape{})), size<0>(ClusterShape{}));
    return {tma_a, tma_b, Base::TmaTransactionBytes, args.rows, args.n, args.k, args.groups, args.offs, args.indptr};
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
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    // TMA: 16-byte aligned bases and row pitches (the op's checks guarantee both).
    constexpr int kAlign = 16 / int(sizeof(ElementA));
    return reinterpret_cast<uintptr_t>(args.a) % 16 == 0 && reinterpret_cast<uintptr_t>(args.b) % 16 == 0 &&
           args.k % kAlign == 0 && args.n % kAlign == 0;
  }

  // The tiled views of group g's operands: A from the group's first row, B at expert g. load_init and
  // tensors_perform_update both build them here, so the kernel's load_inputs keeps one type.
  CUTLASS_DEVICE auto group_views(Params const& params, int32_t first_row, int32_t group) const {
    using namespace cute;
    using X = Underscore;
    Tensor mA = domain_offset(make_coord(first_row, 0, 0), params.tma_a.get_tma_tensor(make_shape(params.rows, params.k, 1)));
    Tensor mB = domain_offset(make_coord(0, 0, group),
                              params.tma_b.get_tma_tensor(make_shape(params.n, params.k, params.groups)));
    Tensor gA_mkl = local_tile(mA, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{});  // (BLK_M,BLK_K,m,k,l)
    Tensor gB_nkl = local_tile(mB, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{});  // (BLK_N,BLK_K,n,k,l)
    return make_tuple(gA_mkl, gB_nkl);
  }

  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const&, Params const& params) const {
    return group_views(params, 0, 0);
  }

  template <class InputTensors, class ProblemShape_MNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const&, Params const& params, ProblemShape_MNKL,
                                                     int32_t group) {
    const int32_t first_row = params.indptr ? params.offs[group] : (group == 0 ? 0 : params.offs[group - 1]);
    return group_views(params, first_row, group);
  }

  // The descriptors never change: nothing to copy, patch or fence per group.
  template <class Storage>
  CUTLASS_DEVICE auto tensormaps_init(Params const& params, Storage&, int32_t, int32_t) {
    if (cute::elect_one_sync()) {
      cute::prefetch_tma_descriptor(params.tma_a.get_tma_descriptor());
      cute::prefetch_tma_descriptor(params.tma_b.get_tma_descriptor());
    }
    return cute::make_tuple(0, 0);
  }
  template <class Storage, class TensorMaps, class ProblemShape_MNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(Storage&, Params const&, TensorMaps const&, ProblemShape_MNKL, int32_t) {}
  template <class Storage, class TensorMaps>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(Storage&, TensorMaps const&) {}
  template <class TensorMaps>
  CUTLASS_DEVICE void tensormaps_fence_acquire(TensorMaps const&) {}

  // Base's producer loop with the fixed descriptors (Base's takes per-CTA descriptor copies).
  template <class TensorA, class TensorB, class TensorMaps, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs, TensorMaps const&,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count, int,
                           uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    using namespace cute;
    if (!elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BLK_M,BLK_K,PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (BLK_N,BLK_K,PIPE)
    constexpr uint32_t cluster_shape_x = get<0>(ClusterShape{});
    const uint2 cluster_local_block_id = {block_rank_in_cluster % cluster_shape_x, block_rank_in_cluster / cluster_shape_x};
    auto block_tma_a = params.tma_a.get_slice(cluster_local_block_id.y);
    auto block_tma_b = params.tma_b.get_slice(cluster_local_block_id.x);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor tAgA = block_tma_a.partition_S(get<0>(load_inputs)(_, _, m_coord, _, 0));  // (TMA,TMA_M,TMA_K,k)
    Tensor tAsA = block_tma_a.partition_D(sA);                                        // (TMA,TMA_M,TMA_K,PIPE)
    Tensor tBgB = block_tma_b.partition_S(get<1>(load_inputs)(_, _, n_coord, _, 0));  // (TMA,TMA_N,TMA_K,k)
    Tensor tBsB = block_tma_b.partition_D(sB);                                        // (TMA,TMA_N,TMA_K,PIPE)

    uint16_t mcast_mask_a = 0, mcast_mask_b = 0;
    auto block_layout = Layout<ClusterShape>{};  // (m,n) -> block_id
    if constexpr (is_same_v<GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
      for (int n = 0; n < size<1>(block_layout); ++n) {
        mcast_mask_a |= uint16_t(1) << block_layout(cluster_local_block_id.x, n, Int<0>{});
      }
    }
    if constexpr (is_same_v<GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
      for (int m = 0; m < size<0>(block_layout); ++m) {
        mcast_mask_b |= uint16_t(1) << block_layout(m, cluster_local_block_id.y, Int<0>{});
      }
    }
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      auto* tma_barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      copy(params.tma_a.with(*tma_barrier, mcast_mask_a), tAgA(_, _, _, *k_tile_iter), tAsA(_, _, _, stage));
      copy(params.tma_b.with(*tma_barrier, mcast_mask_b), tBgB(_, _, _, *k_tile_iter), tBsB(_, _, _, stage));
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

  // Base's consumer side, which reads no parameter (its signature takes Base's).
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors, Params const&) {
    Base::mma(pipeline, smem_pipe_read, accum, k_tile_count, thread_idx, shared_tensors, typename Base::Params{});
  }
};

}  // namespace cake::sm90
