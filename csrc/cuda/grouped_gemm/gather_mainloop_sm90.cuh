// A grouped GEMM mainloop whose A rows are gathered: the MoE GEMM1 reads token rows of x straight
// into shared memory (row p of group g is x[rows_to_routes[start_g + p] / top_k]), so the pipeline
// needs no gathered copy of x (at T = 16384, top_k 8, H = 4096: a 1 GB write and read).
//
// It is CUTLASS's ptr-array TMA mainloop (the `Base` collective, as the builder makes it) with one
// change: the producer warp's load. B (the weights) still comes by TMA; A by cp.async from all 32
// lanes of the producer warp, 16 bytes at a time, 8 lanes per 128-byte row segment (coalesced),
// into the same swizzled shared memory layout the TMA would have written. Each lane's
// `cp.async.mbarrier.arrive` (without .noinc) makes the stage's full barrier wait for its copies
// as well as for B's transaction bytes; the lanes issue it before the leader issues B's TMA, so the
// barrier cannot complete on B alone. The consumers' wgmma read the stage as CUTLASS's own
// cp.async + wgmma mainloop (sm90_mma_multistage_gmma_ss_warpspecialized) does, after the barrier.
// Chunks past K are zero-filled; rows past the group's end read x's first row (their product rows are
// never stored).
//
// kFixedB: Base is FixedOperandMainloop (fixed_operand_sm90.cuh) over the ptr-array one, so B comes
// through one descriptor for all the experts' weights and a CTA that moves to another group patches none.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

namespace cake::sm90 {

// What the mainloop gathers: x [routes / top_k, K] row-major, and for each product row p the route
// rows_to_routes[p] in [0, routes); the row of x is route / top_k. Groups are the rows between `ends`.
struct GatherRows {
  const void* x = nullptr;
  int64_t k = 0;                            // x's row length in elements
  const int32_t* ends = nullptr;            // E group ends (the offsets past any leading zero)
  const int32_t* rows_to_routes = nullptr;  // [sum_m]
  int64_t routes = 0;
  int top_k = 1;
};

// The group the producer is on, carried between tiles in the load inputs (tensors_perform_update
// is called whenever the group changes, before the group's first load).
struct GatherGroup {
  const int32_t* routes = nullptr;  // rows_to_routes + the group's start
  int rows = 0;
};

// The base's dispatch policy under another name, so that the kernel runs the auxiliary producer warp.
template <class Policy>
struct GatherDispatchPolicy : Policy {};

template <class Base, bool kFixedB = false>
struct GatherAMainloop : Base {
  using typename Base::ElementA;
  using typename Base::ElementB;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::TileShape;
  using DispatchPolicy = GatherDispatchPolicy<typename Base::DispatchPolicy>;
  // The stage's full barrier counts two producer arrivals: the main warp's leader (with B's bytes) and
  // the auxiliary warp's lane 0 (after its copies are tracked).
  static constexpr int NumProducerThreadEvents = 2;

  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kTileK = cute::size<2>(TileShape{});
  static constexpr int kChunkElements = 16 / sizeof(ElementA);
  static constexpr int kChunksPerRow = kTileK / kChunkElements;  // 16-byte chunks of a row's K block
  static constexpr int kRowsPerCopy = 32 / kChunksPerRow;         // rows one warp-wide copy covers
  static constexpr int kBatch = 4;  // table reads in flight before their copies
  static constexpr uint32_t kStageBytesA = kTileM * kTileK * sizeof(ElementA);
  static_assert(sizeof(ElementA) == 2 && kChunksPerRow == 8 && kTileM % 64 == 0,
                "gathered A: 16-bit elements, 64-element K blocks, two warps of 32-row multiples");
  // The copies write the layout the TMA would: K-major 128-byte rows with the 128-byte swizzle, the
  // tile's rows one after another, stages one after another.
  static_assert(cute::is_same_v<typename Base::SmemLayoutAtomA, cute::GMMA::Layout_K_SW128_Atom<ElementA>> &&
                    SmemLayoutA{}(1, 0, 0) == kTileK && SmemLayoutA{}(0, 0, 1) == kTileM * kTileK,
                "gathered A: unexpected shared memory layout");
  // Only B arrives through the TMA's transaction count.
  static constexpr uint32_t kTmaBytesB =
      uint32_t(cute::size<1>(TileShape{})) * kTileK * uint32_t(sizeof(ElementB));

  // The stages, and the source address of each of the tile's rows (written per tile by the producer warps).
  struct TensorStorage : Base::TensorStorage {
    const char* gather_src[kTileM];
  };
  static constexpr int kTableBytes = kTileM * int(sizeof(const char*));

  struct Arguments : Base::Arguments {
    GatherRows gather;
  };
  struct Params : Base::Params {
    GatherRows gather;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, Arguments const& args, void* workspace) {
    Params params{Base::to_underlying_arguments(problem_shapes, static_cast<typename Base::Arguments const&>(args),
                                                workspace),
                  args.gather};
    params.tma_transaction_bytes = kTmaBytesB;
    return params;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const& shape, Arguments const& args, int sm_count) {
    return Base::get_workspace_size(shape, static_cast<typename Base::Arguments const&>(args), sm_count);
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const& shape, Arguments const& args, void* workspace,
                                              cudaStream_t stream, cutlass::CudaHostAdapter* adapter = nullptr) {
    return Base::initialize_workspace(shape, static_cast<typename Base::Arguments const&>(args), workspace, stream,
                                      adapter);
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape shape, Arguments const& args) {
    return args.gather.x != nullptr && args.gather.rows_to_routes != nullptr && args.gather.ends != nullptr &&
           args.gather.top_k > 0 &&
           Base::can_implement(shape, static_cast<typename Base::Arguments const&>(args));
  }

  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& shape, Params const& params) const {
    auto ab = Base::load_init(shape, params);
    return cute::make_tuple(cute::get<0>(ab), cute::get<1>(ab), GatherGroup{});
  }

  template <class InputTensors, class ProblemShape_MNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const& inputs, Params const& params,
                                                     ProblemShape_MNKL shape, int32_t group) {
    const int32_t start = group == 0 ? 0 : params.gather.ends[group - 1];
    const GatherGroup rows{params.gather.rows_to_routes + start, int(cute::get<0>(shape))};
    if constexpr (kFixedB) {  // the group's B view: the expert coordinate of the one descriptor
      auto ab = Base::tensors_perform_update(cute::make_tuple(cute::get<0>(inputs), cute::get<1>(inputs), 0), params,
                                             shape, group);
      return cute::make_tuple(cute::get<0>(ab), cute::get<1>(ab), rows);
    } else {
      return cute::make_tuple(cute::get<0>(inputs), cute::get<1>(inputs), rows);
    }
  }

  // A's rows [kFirst, kFirst + kRows) of the tile, by one whole warp (lane = thread_idx % 32); with
  // `copy_b`, which runs after each stage's copies are issued and tracked, the main warp loads B.
  template <int kFirst, int kRows, class KTileIterator, class BlockCoord, class CopyB>
  CUTLASS_DEVICE void gather_rows(Params const& params, MainloopPipeline& pipeline, PipelineState smem_pipe_write,
                                  GatherGroup const& group, BlockCoord const& blk_coord, KTileIterator k_tile_iter,
                                  int k_tile_count, int lane, TensorStorage& shared_tensors, CopyB&& copy_b) {
    constexpr int kRowsPerLane = kRows / 32;
    // Per tile, each lane writes the source address of its rows kFirst + lane + 32 j into the warp's part
    // of the table; a row past the group's end reads x's first row (its product row is never stored).
    const int first_row = int(cute::get<0>(blk_coord)) * kTileM + kFirst;
    const auto* x = static_cast<const char*>(params.gather.x);
    const int64_t k_elements = params.gather.k;
    const uint64_t row_bytes = uint64_t(k_elements) * sizeof(ElementA);
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kRowsPerLane; ++j) {
      const int row = first_row + 32 * j + lane;
      const char* src = x;
      if (row < group.rows) {
        const int32_t route = group.routes[row];
        // A route out of range stops the kernel: a trap, since a call (an assert's) would serialize the
        // consumers' wgmmas (ptxas C7510).
        if (route < 0 || route >= params.gather.routes) asm volatile("trap;");
        src = x + uint64_t(route / params.gather.top_k) * row_bytes;
      }
      shared_tensors.gather_src[kFirst + 32 * j + lane] = src;
    }
    __syncwarp();
    const int chunk = lane % kChunksPerRow;
    // This lane's copy i (tile row kFirst + 4i + lane / 8) reads the table at entry_0 + 32 i bytes and lands
    // at byte 512 i + lane_bytes of the stage before the swizzle (128-byte rows), whose row bits [7, 10)
    // advance by 4 from one copy to the next.
    const uint32_t table = cute::cast_smem_ptr_to_uint(&shared_tensors.gather_src[kFirst + lane / kChunksPerRow]);
    const uint32_t lane_bytes = uint32_t(kFirst + lane / kChunksPerRow) * 128u + uint32_t(chunk) * 16u;
    const uint32_t a_base = cute::cast_smem_ptr_to_uint(shared_tensors.smem_A.data());

    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);  // the main warp's leader arrives, expecting B's bytes
      auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      // Chunks past K are zero-filled (their address: the row's start, inside x).
      const int64_t k = int64_t(*k_tile_iter) * kTileK + chunk * kChunkElements;
      const uint32_t k_bytes = k < k_elements ? 16u : 0u;
      const uint64_t k_offset = (k_bytes != 0 ? uint64_t(k) : 0) * sizeof(ElementA);
      // The 128-byte swizzle of the TMA and of CuTe's swizzle_ptr (address bits [4, 7) ^= bits [7, 10)),
      // for even and odd copies; the copies' offsets (512 i) leave bits [4, 7) alone.
      const uint32_t a_stage = a_base + uint32_t(stage) * kStageBytesA;
      const uint32_t dst_even = a_stage + (lane_bytes ^ ((((a_stage + lane_bytes) >> 7) & 7u) << 4));
      const uint32_t dst_odd = a_stage + (lane_bytes ^ ((((a_stage + lane_bytes + 512u) >> 7) & 7u) << 4));
      // kBatch table reads go out together, then their copies: a copy is a shared load (broadcast to the
      // row's 8 lanes), a 64-bit add and the cp.async.
      CUTLASS_PRAGMA_UNROLL
      for (int i0 = 0; i0 < kRows / kRowsPerCopy; i0 += kBatch) {
        uint64_t row_src[kBatch];
        CUTLASS_PRAGMA_UNROLL
        for (int u = 0; u < kBatch; ++u) {
          asm volatile("ld.shared.b64 %0, [%1];\n" : "=l"(row_src[u]) : "r"(table + uint32_t(32 * (i0 + u))));
        }
        CUTLASS_PRAGMA_UNROLL
        for (int u = 0; u < kBatch; ++u) {
          const uint32_t dst = ((i0 + u) % 2 == 0 ? dst_even : dst_odd) + uint32_t(512 * (i0 + u));
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(row_src[u] + k_offset),
                       "r"(k_bytes));
        }
      }
      // The stage's full barrier now also waits for these copies (its count: each lane's arrive is +1 now,
      // -1 when its copies land); then B's bytes go out, so the barrier cannot complete before.
      cutlass::arch::cpasync_barrier_arrive(reinterpret_cast<uint64_t const*>(barrier));
      __syncwarp();
      copy_b(barrier, stage, *k_tile_iter);
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

  // The main producer warp: the first half of A's rows, and B by TMA.
  template <class TensorA, class TensorB, class TensorMapA, class TensorMapB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB, GatherGroup> const& load_inputs,
                           cute::tuple<TensorMapA, TensorMapB> const& input_tensormaps, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
                           uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    using namespace cute;
    const int lane = thread_idx % 32;
    // B: the base's TMA partition (a 2x1 cluster multicasts each CTA's share of the weight tile).
    constexpr uint32_t cluster_m = get<0>(typename DispatchPolicy::ClusterShape{});
    const uint32_t cluster_block_m = block_rank_in_cluster % cluster_m;
    auto const& tma_b = [&]() -> auto const& {
      if constexpr (kFixedB) return params.tma_b;
      else return params.tma_load_b;
    }();
    auto block_tma_b = tma_b.get_slice(cluster_block_m);
    // The fixed view is the group's expert already (tensors_perform_update), with its boxes of B (two a tile
    // for gate_up halves): the base's stage copies.
    auto copy_b = [&] {
      if constexpr (kFixedB) {
        return Base::stage_copies_b(params, get<1>(load_inputs), get<1>(blk_coord), block_tma_b, shared_tensors);
      } else {
        Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (BLK_N,BLK_K,PIPE)
        Tensor gB = get<1>(load_inputs)(_, _, get<1>(blk_coord), _, get<3>(blk_coord));  // (BLK_N,BLK_K,k)
        Tensor tBgB = block_tma_b.partition_S(gB);
        Tensor tBsB = block_tma_b.partition_D(sB);
        return [=](auto const& tma, auto k_tile, int stage) { copy(tma, tBgB(_, _, _, k_tile), tBsB(_, _, _, stage)); };
      }
    }();
    uint16_t mcast_mask_b = 0;
    if constexpr (cute::is_same_v<typename Base::GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
      auto block_layout = Layout<typename DispatchPolicy::ClusterShape>{};
      const uint32_t cluster_block_n = block_rank_in_cluster / cluster_m;
      for (int m = 0; m < size<0>(block_layout); ++m) {
        mcast_mask_b |= uint16_t(1) << block_layout(m, cluster_block_n, Int<0>{});
      }
    }
    gather_rows<0, kTileM / 2>(params, pipeline, smem_pipe_write, get<2>(load_inputs), blk_coord, k_tile_iter,
                               k_tile_count, lane, shared_tensors, [&](auto* barrier, int stage, auto k_tile) {
                                 if (lane == 0) {
                                   if constexpr (kFixedB) {
                                     copy_b(tma_b.with(*barrier, mcast_mask_b), k_tile, stage);
                                   } else {
                                     copy_b(tma_b.with(get<1>(input_tensormaps), *barrier, mcast_mask_b), k_tile, stage);
                                   }
                                 }
                               });
  }

  // The auxiliary producer warp (the kernel runs it beside the main one, HasAuxiliaryLoad below): the
  // second half of A's rows, then its lane 0 is the full barrier's second producer arrival.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load_auxiliary(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                                     cute::tuple<TensorA, TensorB, GatherGroup> const& load_inputs,
                                     BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                                     int thread_idx, uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    const int lane = thread_idx % 32;
    gather_rows<kTileM / 2, kTileM / 2>(params, pipeline, smem_pipe_write, cute::get<2>(load_inputs), blk_coord,
                                        k_tile_iter, k_tile_count, lane, shared_tensors,
                                        [&](auto* barrier, int, auto) {
                                          if (lane == 0) cutlass::arch::ClusterBarrier::arrive(barrier);
                                        });
  }
};

}  // namespace cake::sm90

template <class Policy>
struct cutlass::gemm::kernel::detail::HasAuxiliaryLoad<cake::sm90::GatherDispatchPolicy<Policy>> : cute::true_type {};
