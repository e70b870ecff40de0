// Fixed-operand grouped GEMM (Hopper, fwd and dgrad): the ptr-array kernels' mainloop with one TMA
// descriptor for all the groups' rows (the packed x or grad_out, [sum_m, K]) and one for all the
// experts' weights (w as a 3-D tensor, expert index as its third mode), both built once on the host.
// A group is a row offset into the first and an expert coordinate into the second, so a CTA that moves
// to another group rewrites no descriptor: CUTLASS's ptr-array mainloop patches both descriptors in
// global memory and fences them (a round trip the producer waits on) at every change of group, the
// cost that held E=128 problems ~15% under the dense rate with K=2048 (benchmarks/NOTES.md, session 24).
//
// fwd / dgrad: a tile's rows past its group's end are the next group's (or past sum_m: TMA fills
// zeros); they are computed and dropped by the epilogue, which stores rows < M only (a register
// epilogue: a TMA store would need a per-group descriptor again).
// wgrad (kGroupRowsAreK): the groups' rows are the reduction, so both operands are the packed rows
// ([sum_m, N] grad_out and [sum_m, K] x, a group a K offset into each) and the last K block of a group
// reads rows of the next one: the producer records how many of each stage's K rows are the group's, and
// the consumers skip the wgmmas past them and zero the rest of the one the group's end cuts (in both
// operands, so a NaN or Inf in a neighbouring group cannot leak in). The output is CUTLASS's TMA store
// epilogue over dw as one tensor (FixedOutputEpilogue). Cooperative schedule only (all consumers zero a
// stage).
// kGateUpHalves (fwd, the MoE GEMM1's SwiGLU twins): B is w1 as [gate; up] halves ([E, 2I, K], gate rows
// first), and tile t's N columns are its gate rows [t N / 2, (t + 1) N / 2) then the same up rows, I
// further: two TMA boxes of N / 2 rows a stage, into the tile's two halves of shared memory, from the
// one descriptor. The SwiGLU epilogue pairs column n with n + N / 2 (swiglu_epilogue_sm90.cuh). Where
// N / 2 does not divide I, the last tile's gate box runs into up rows (its columns past I are dropped)
// and its up box past the expert's 2I rows (the TMA fills zeros).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/util/packed_stride.hpp>

namespace cake::sm90 {

// Base: the CollectiveMma that CUTLASS's builder gives for a ptr-array kernel schedule.
template <class Base, bool kGroupRowsAreK = false, bool kGateUpHalves = false>
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
  using typename Base::TileShape;
  using typename Base::TiledMma;
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;
  static constexpr int kStages = Base::DispatchPolicy::Stages;
  static constexpr int kBlockK = cute::size<2>(TileShape{});
  // The rows of B one TMA box brings: the tile's N, or half of it (gate_up halves).
  static constexpr int kBoxN = cute::size<1>(TileShape{}) / (kGateUpHalves ? 2 : 1);
  using BoxShape = cute::Shape<cute::Int<cute::size<0>(TileShape{})>, cute::Int<kBoxN>, cute::Int<kBlockK>>;
  // One stage's box of B in shared memory: the stage's tile, or its first half (rows [0, N / 2): the
  // K-major swizzle atoms tile N first, so each half is contiguous and laid out alike).
  using SmemLayoutBoxB = std::conditional_t<
      kGateUpHalves,
      decltype(cute::flat_divide(SmemLayoutB{}, cute::Shape<cute::Int<kBoxN>, cute::Int<kBlockK>>{})(
          cute::_, cute::_, cute::Int<0>{}, cute::Int<0>{}, cute::Int<0>{})),
      decltype(SmemLayoutB{}(cute::_, cute::_, cute::Int<0>{}))>;

  static_assert(cute::is_same_v<ElementA, ElementB>, "one input type");
  static_assert(!kGateUpHalves || (!kGroupRowsAreK && cutlass::gemm::detail::is_k_major<InternalStrideB>()),
                "gate_up halves: fwd's K-major w1 only");
  static_assert(!kGroupRowsAreK || (cute::is_base_of_v<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                                       typename Base::DispatchPolicy::Schedule> &&
                                    cutlass::gemm::detail::is_major<0, InternalStrideA>() &&
                                    cutlass::gemm::detail::is_major<0, InternalStrideB>()),
                "wgrad: a cooperative schedule, both operands M / N-major (K = the rows, outermost)");

  // wgrad: how many of each stage's K rows are in the group, written by the producer under its phase
  // (the consumers of the stage's previous fill may still read the other slot).
  struct MaskedTensorStorage : Base::TensorStorage {
    int32_t group_rows_in_stage[kStages][2];
  };
  using TensorStorage = std::conditional_t<kGroupRowsAreK, MaskedTensorStorage, typename Base::TensorStorage>;

  // fwd / dgrad: A row-major packed rows, (M, K, 1); B (N, K, E) with the expert stride as its third mode.
  // wgrad: A (M, rows, 1) = grad_out^T, B (N, rows, 1) = x, both M / N-contiguous.
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
      SmemLayoutBoxB{}, cute::make_shape(cute::Int<kBoxN>{}, cute::shape<2>(TileShape{})),
      cute::size<0>(ClusterShape{})));

  struct Arguments {
    ElementA const* a = nullptr;   // [rows, k] row-major: every group's rows, packed
    ElementB const* b = nullptr;   // groups x (n, k) with Base's B layout, one group after another
    int32_t rows = 0;              // sum_m
    int32_t n = 0, k = 0;          // each group's CUTLASS N and K (wgrad: M and N; its K is the group's rows)
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
    StrideB3 stride_b{};
    auto [shape_a, shape_b] = [&] {
      if constexpr (kGroupRowsAreK) {
        get<1>(stride_a) = n;  // grad_out's rows of n elements
        get<1>(stride_b) = k;  // x's rows of k elements
        return make_tuple(make_shape(args.n, args.rows, 1), make_shape(args.k, args.rows, 1));
      } else {
        get<0>(stride_a) = k;  // row-major rows of k elements
        // B's own layout within a group (K-major for fwd, N-major for dgrad), groups n * k apart.
        if constexpr (is_static<remove_cvref_t<decltype(get<1>(stride_b))>>::value) {
          get<0>(stride_b) = k;
        } else {
          get<1>(stride_b) = n;
        }
        get<2>(stride_b) = n * k;
        return make_tuple(make_shape(args.rows, args.k, 1), make_shape(args.n, args.k, args.groups));
      }
    }();
    Tensor tensor_a = make_tensor(args.a, make_layout(shape_a, stride_a));
    Tensor tensor_b = make_tensor(args.b, make_layout(shape_b, stride_b));
    TmaA tma_a = make_tma_copy(GmemTiledCopyA{}, tensor_a, SmemLayoutA{}(_, _, Int<0>{}),
                               make_shape(shape<0>(TileShape{}), shape<2>(TileShape{})), size<1>(ClusterShape{}));
    TmaB tma_b = make_tma_copy(GmemTiledCopyB{}, tensor_b, SmemLayoutBoxB{}, make_shape(Int<kBoxN>{}, shape<2>(TileShape{})),
                               size<0>(ClusterShape{}));
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

  // The tiled views of group g's operands and its rows: fwd / dgrad A from the group's first row, B at
  // expert g; wgrad both from the group's first row along K. load_init and tensors_perform_update both
  // build them here, so the kernel's load_inputs keeps one type.
  CUTLASS_DEVICE auto group_views(Params const& params, int32_t first_row, int32_t group, int32_t group_rows) const {
    using namespace cute;
    using X = Underscore;
    auto [mA, mB] = [&] {
      if constexpr (kGroupRowsAreK) {
        return make_tuple(
            domain_offset(make_coord(0, first_row, 0), params.tma_a.get_tma_tensor(make_shape(params.n, params.rows, 1))),
            domain_offset(make_coord(0, first_row, 0), params.tma_b.get_tma_tensor(make_shape(params.k, params.rows, 1))));
      } else {
        return make_tuple(
            domain_offset(make_coord(first_row, 0, 0), params.tma_a.get_tma_tensor(make_shape(params.rows, params.k, 1))),
            domain_offset(make_coord(0, 0, group),
                          params.tma_b.get_tma_tensor(make_shape(params.n, params.k, params.groups))));
      }
    }();
    Tensor gA_mkl = local_tile(mA, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{});  // (BLK_M,BLK_K,m,k,l)
    Tensor gB_nkl = local_tile(mB, BoxShape{}, make_coord(_, _, _), Step<X, _1, _1>{});   // (BOX_N,BLK_K,n,k,l)
    return make_tuple(gA_mkl, gB_nkl, group_rows);
  }

  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const&, Params const& params) const {
    return group_views(params, 0, 0, 0);
  }

  template <class InputTensors, class ProblemShape_MNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const&, Params const& params,
                                                     ProblemShape_MNKL problem_shape_mnkl, int32_t group) {
    const int32_t first_row = params.indptr ? params.offs[group] : (group == 0 ? 0 : params.offs[group - 1]);
    return group_views(params, first_row, group, cute::get<2>(problem_shape_mnkl));
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

  // B's TMA copies of a stage for tile n_coord of the group's boxes (gB_nkl, (BOX_N,BLK_K,n,k,l)) by this
  // CTA's slice of the descriptor: the tile's one box, or its gate box and up box (gate_up halves) into the
  // stage's two halves. copy_b(tma, k_tile, stage) with the descriptor bound to the stage's barrier.
  template <class GBoxes, class TmaSlice>
  CUTLASS_DEVICE auto stage_copies_b(Params const& params, GBoxes const& gB_nkl, int n_coord, TmaSlice const& block_tma_b,
                                     TensorStorage& shared_tensors) const {
    using namespace cute;
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (BLK_N,BLK_K,PIPE)
    Tensor gB = gB_nkl(_, _, n_coord, _, 0);                                              // (BOX_N,BLK_K,k)
    Tensor tBgB = block_tma_b.partition_S(gB);                                            // (TMA,TMA_N,TMA_K,k)
    if constexpr (!kGateUpHalves) {
      Tensor tBsB = block_tma_b.partition_D(sB);  // (TMA,TMA_N,TMA_K,PIPE)
      return [=](auto const& tma, auto k_tile, int stage) { copy(tma, tBgB(_, _, _, k_tile), tBsB(_, _, _, stage)); };
    } else {
      Tensor sB_boxes = flat_divide(sB, Shape<Int<kBoxN>, Int<kBlockK>>{});  // (BOX_N,BLK_K,2,1,PIPE)
      Tensor tBsB = block_tma_b.partition_D(sB_boxes(_, _, 0, 0, _));
      // The up rows of the same tile: I = N / 2 rows further, into the stage's second half.
      Tensor tBgB_up = block_tma_b.partition_S(domain_offset(make_coord(params.n / 2, 0, 0), gB));
      Tensor tBsB_up = block_tma_b.partition_D(sB_boxes(_, _, 1, 0, _));
      return [=](auto const& tma, auto k_tile, int stage) {
        copy(tma, tBgB(_, _, _, k_tile), tBsB(_, _, _, stage));
        copy(tma, tBgB_up(_, _, _, k_tile), tBsB_up(_, _, _, stage));
      };
    }
  }

  // Base's producer loop with the fixed descriptors (Base's takes per-CTA descriptor copies).
  template <class LoadInputs, class TensorMaps, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           LoadInputs const& load_inputs, TensorMaps const&,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count, int,
                           uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    using namespace cute;
    if (!elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BLK_M,BLK_K,PIPE)
    constexpr uint32_t cluster_shape_x = get<0>(ClusterShape{});
    const uint2 cluster_local_block_id = {block_rank_in_cluster % cluster_shape_x, block_rank_in_cluster / cluster_shape_x};
    auto block_tma_a = params.tma_a.get_slice(cluster_local_block_id.y);
    auto block_tma_b = params.tma_b.get_slice(cluster_local_block_id.x);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor tAgA = block_tma_a.partition_S(get<0>(load_inputs)(_, _, m_coord, _, 0));  // (TMA,TMA_M,TMA_K,k)
    Tensor tAsA = block_tma_a.partition_D(sA);                                        // (TMA,TMA_M,TMA_K,PIPE)
    auto copy_b = stage_copies_b(params, get<1>(load_inputs), n_coord, block_tma_b, shared_tensors);

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
      if constexpr (kGroupRowsAreK) {  // before the acquire, whose arrive publishes it with the stage
        shared_tensors.group_rows_in_stage[smem_pipe_write.index()][smem_pipe_write.phase()] =
            min(kBlockK, get<2>(load_inputs) - *k_tile_iter * kBlockK);
      }
      pipeline.producer_acquire(smem_pipe_write);
      auto* tma_barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      copy(params.tma_a.with(*tma_barrier, mcast_mask_a), tAgA(_, _, _, *k_tile_iter), tAsA(_, _, _, stage));
      copy_b(params.tma_b.with(*tma_barrier, mcast_mask_b), *k_tile_iter, stage);
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

  // fwd / dgrad: Base's consumer side, which reads no parameter (its signature takes Base's). wgrad: the
  // same pipeline (K_PIPE_MMAS batches in flight, the release order Base::mma_tail completes), each stage's
  // rows past the group's end zeroed first.
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors, Params const&) {
    if constexpr (!kGroupRowsAreK) {
      Base::mma(pipeline, smem_pipe_read, accum, k_tile_count, thread_idx, shared_tensors, typename Base::Params{});
    } else {
      using namespace cute;
      Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BLK_M,BLK_K,PIPE)
      Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (BLK_N,BLK_K,PIPE)
      constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
      const int warp_group = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
      TiledMma tiled_mma;
      auto thread_mma = tiled_mma.get_slice(make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{})(warp_group));
      Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA,MMA_M,MMA_K,PIPE)
      Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA,MMA_N,MMA_K,PIPE)
      PipelineState smem_pipe_release = smem_pipe_read;
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(accum);
      CUTLASS_PRAGMA_NO_UNROLL
      for (int k_tile = 0; k_tile < k_tile_count; ++k_tile) {
        pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
        const int stage = smem_pipe_read.index();
        // The producer's phase for this fill is the consumer's flipped (its start state is phase 1).
        const int rows = shared_tensors.group_rows_in_stage[stage][smem_pipe_read.phase() ^ 1];
        // The wgmmas (kMmaK rows each) past the group's rows are skipped; the one the group's end cuts is
        // computed over zeros past it (its rows [rows, live_rows)).
        const int live_rows = min(kBlockK, (rows + kMmaK - 1) / kMmaK * kMmaK);
        if (rows < live_rows) zero_rows(sA, sB, stage, rows, live_rows, thread_idx);
        warpgroup_fence_operand(accum);
        // Straight-line wgmmas for each count (a predicate between them makes ptxas add a commit group of its
        // own, and the wait below would then drain this K block's wgmmas before the next block's wait).
        auto mma_k_blocks = [&](auto count) {
          warpgroup_arrive();
          CUTLASS_PRAGMA_UNROLL
          for (int k_block = 0; k_block < decltype(count)::value; ++k_block) {
            cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), accum);
            tiled_mma.accumulate_ = GMMA::ScaleOut::One;
          }
          warpgroup_commit_batch();
        };
        static_assert(decltype(size<2>(tCrA))::value == 4, "four wgmmas a K block");
        switch ((live_rows + kMmaK - 1) / kMmaK) {  // at least 1: a tile has at least one of the group's rows
          case 1: mma_k_blocks(Int<1>{}); break;
          case 2: mma_k_blocks(Int<2>{}); break;
          case 3: mma_k_blocks(Int<3>{}); break;
          default: mma_k_blocks(Int<4>{});
        }
        if (k_tile >= Base::K_PIPE_MMAS) {
          warpgroup_wait<Base::K_PIPE_MMAS>();
          warpgroup_fence_operand(accum);
          pipeline.consumer_release(smem_pipe_release);
          ++smem_pipe_release;
        }
        ++smem_pipe_read;
      }
      warpgroup_fence_operand(accum);
    }
  }

 private:
  // The K rows of one wgmma (16 for 16-bit inputs).
  static constexpr int kMmaK = cute::size<2>(typename TiledMma::AtomShape_MNK{});

  // Zeros K rows [first, end) of a stage of both operands, 16 bytes (8 M / N-contiguous elements, which the
  // 128-byte swizzle keeps together) a store, by all the consumer threads; then makes the zeros visible to
  // the wgmmas (async proxy) of every consumer warp group.
  template <class TensorSA, class TensorSB>
  CUTLASS_DEVICE static void zero_rows(TensorSA& sA, TensorSB& sB, int stage, int first, int end, int thread_idx) {
    using namespace cute;
    constexpr int kThreads = size(TiledMma{});
    constexpr int kVector = 16 / int(sizeof(ElementA));
    constexpr int kChunksA = size<0>(TileShape{}) / kVector, kChunks = kChunksA + size<1>(TileShape{}) / kVector;
    for (int i = thread_idx; i < kChunks * (end - first); i += kThreads) {
      const int k = first + i / kChunks, chunk = i % kChunks;
      const uint32_t at = chunk < kChunksA ? cast_smem_ptr_to_uint(&sA(chunk * kVector, k, stage))
                                           : cast_smem_ptr_to_uint(&sB((chunk - kChunksA) * kVector, k, stage));
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(at), "r"(0u));
    }
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(kThreads, kZeroRowsBarrier);
  }
  static constexpr uint32_t kZeroRowsBarrier = 0;  // the first user named barrier (CUTLASS reserves those below)
};

// wgrad's epilogue with a fixed descriptor: CUTLASS's TMA store epilogue for plain (non-array) kernels over dw
// as one [M, N, groups] tensor (every group's output is a dense M x N block, one after another), a group its
// L coordinate. In the ptr-array kernels a CTA moving to another group waits for its TMA stores to drain and
// patches and fences the store descriptor; here the stores of one tile overlap the next tile's mainloop
// whatever its group. Adapts Base to the ptr-array kernel's calls (per-group descriptor hooks that do
// nothing; its per-group problem shape, whose L is 1, gets L = groups).
template <class Base>
struct FixedOutputEpilogue : Base {
  using typename Base::ElementD;
  using typename Base::StrideD;
  using InternalStrideC = typename Base::StrideC;
  using InternalStrideD = StrideD;
  struct TensorMapStorage {};

  struct Arguments {
    ElementD* ptr_D = nullptr;  // [groups, m, n] row-major
    int32_t m = 0, n = 0, groups = 0;
  };
  struct Params : Base::Params {
    int32_t groups;
  };

  CUTLASS_HOST_DEVICE FixedOutputEpilogue(Params const& params, typename Base::TensorStorage& shared_tensors)
      : Base(params, shared_tensors), groups_(params.groups) {}

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void* workspace) {
    typename Base::Arguments base{};
    base.thread.alpha = 1.0f;
    base.thread.beta = 0.0f;
    base.ptr_D = args.ptr_D;
    base.dD = cutlass::make_cute_packed_stride(StrideD{}, {args.m, args.n, args.groups});
    return {Base::to_underlying_arguments(cute::make_shape(args.m, args.n, 1, args.groups), base, workspace),
            args.groups};
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
    return reinterpret_cast<uintptr_t>(args.ptr_D) % 16 == 0 && args.n % (16 / int(sizeof(ElementD))) == 0;
  }

  template <class EpiParams, class Storage>
  CUTLASS_DEVICE auto load_init(EpiParams const&, Storage&, int32_t, int32_t) {
    return cute::make_tuple(static_cast<cute::TmaDescriptor const*>(nullptr));
  }
  template <class EpiParams, class Storage>
  CUTLASS_DEVICE auto store_init(EpiParams const&, Storage&, int32_t, int32_t, int32_t) {
    return cute::make_tuple(static_cast<cute::TmaDescriptor const*>(nullptr));
  }
  template <bool kIsLoad, class Storage, class EpiParams, class ProblemShape_MNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(Storage&, EpiParams const&, cute::TmaDescriptor const*,
                                                ProblemShape_MNKL, int32_t, int32_t) {}
  template <bool kIsLoad, class Storage>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(Storage&, cute::TmaDescriptor const*, int32_t = 0) {}
  template <bool kIsLoad>
  CUTLASS_DEVICE void tensormaps_fence_acquire(cute::TmaDescriptor const*) {}

  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class TiledMma>
  CUTLASS_DEVICE auto load(typename Base::LoadPipeline load_pipeline,
                           typename Base::LoadPipelineState load_pipe_producer_state, ProblemShapeMNKL problem_shape_mnkl,
                           TileShapeMNK tile_shape_MNK, TileCoordMNKL tile_coord_mnkl, TiledMma tiled_mma, int thread_idx,
                           typename Base::TensorStorage& shared_tensors, cute::TmaDescriptor const*, int subtile_idx = -1) {
    return Base::load(load_pipeline, load_pipe_producer_state, cute::replace<3>(problem_shape_mnkl, groups_),
                      tile_shape_MNK, tile_coord_mnkl, tiled_mma, thread_idx, shared_tensors, subtile_idx);
  }
  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout,
            class TiledMma>
  CUTLASS_DEVICE auto store(typename Base::LoadPipeline load_pipeline,
                            typename Base::LoadPipelineState load_pipe_consumer_state,
                            typename Base::StorePipeline store_pipeline,
                            typename Base::StorePipelineState store_pipe_producer_state,
                            ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_MNK,
                            TileCoordMNKL tile_coord_mnkl, cute::Tensor<AccEngine, AccLayout> accumulators,
                            TiledMma tiled_mma, int thread_idx, typename Base::TensorStorage& shared_tensors,
                            cute::TmaDescriptor const*, int subtile_idx = -1) {
    return Base::store(load_pipeline, load_pipe_consumer_state, store_pipeline, store_pipe_producer_state,
                       cute::replace<3>(problem_shape_mnkl, groups_), tile_shape_MNK, tile_coord_mnkl, accumulators,
                       tiled_mma, thread_idx, shared_tensors, subtile_idx);
  }

 private:
  int32_t groups_;
};

}  // namespace cake::sm90
