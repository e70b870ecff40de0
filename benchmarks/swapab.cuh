// Shared by the swap-AB diagnostics (swapab_feed.cu, swapab_grouped.cu; benchmarks/NOTES.md, session 45):
// a tile of 128 weight rows (two consumer warpgroups of 64) x N <= 256 tokens, K in blocks of 64 bf16.
// The weights are wgmma's A, loaded from shared memory into registers (ldmatrix), the tokens its B
// in shared memory; N is issued in chunks (64- and 16-wide compiled, or 32-wide counted at run time),
// so a tile can end near its last token. Operands land by TMA, 128-byte swizzled, in a ring of stages with full /
// empty mbarriers (a producer thread, the consumer warpgroups).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <utility>

#include "microbench.cuh"

namespace swapab {

namespace gmma = cute::SM90::GMMA;
using cutlass::arch::ClusterBarrier;
using cutlass::arch::ClusterTransactionBarrier;

constexpr int kStages = 4;
constexpr int kThreads = 384;                   // a producer warpgroup (one thread issues), two consumers
constexpr int kRowBytes = 128;                  // one K block: 64 bf16, one 128-byte swizzle row
constexpr int kWRows = 128;                     // weight rows a tile
constexpr int kXRowsMax = 256;                  // tokens a tile, at most
constexpr int kWStage = kWRows * kRowBytes;     // 16 KB
constexpr int kXStage = kXRowsMax * kRowBytes;  // 32 KB
constexpr int kRingBytes = kStages * (kWStage + kXStage);

__device__ __forceinline__ uint64_t sw128_descriptor(uint32_t smem_addr) {
  cute::GmmaDescriptor desc;
  desc.bitfield.start_address_ = static_cast<uint16_t>(smem_addr >> 4);
  desc.bitfield.leading_byte_offset_ = 1;  // unused with swizzling
  desc.bitfield.stride_byte_offset_ = 1024 >> 4;
  desc.bitfield.base_offset_ = 0;
  desc.bitfield.layout_type_ = 1;  // SWIZZLE_128B
  return desc.desc_;
}

// This thread's A fragments of the 4 k16 steps of a K block: rows [16 * warp, +16) of the warpgroup's
// 64, from a 128-byte-swizzled tile (16-byte piece c of row r at r * 128 + ((c ^ (r % 8)) * 16)).
// ldmatrix.x4 matrices: rows 0-7 / 8-15 x k 0-7, then the same x k 8-15: wgmma's a0..a3.
__device__ __forceinline__ void load_a(uint32_t w_rows, uint32_t (&a)[16]) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int r = warp * 16 + (lane / 8 % 2) * 8 + lane % 8;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const int piece = 2 * kk + lane / 16;
    const uint32_t addr = w_rows + r * kRowBytes + ((piece ^ (r % 8)) * 16);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a[4 * kk]), "=r"(a[4 * kk + 1]), "=r"(a[4 * kk + 2]), "=r"(a[4 * kk + 3])
                 : "r"(addr));
  }
}

template <int kN>
struct Rs;
template <>
struct Rs<256> : gmma::MMA_64x256x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K> {};
template <>
struct Rs<64> : gmma::MMA_64x64x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K> {};
template <>
struct Rs<32> : gmma::MMA_64x32x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K> {};
template <>
struct Rs<16> : gmma::MMA_64x16x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K> {};
template <>
struct Rs<8> : gmma::MMA_64x8x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K> {};
template <int kN>
struct Ss;
template <>
struct Ss<256> : gmma::MMA_64x256x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K> {};
template <>
struct Ss<64> : gmma::MMA_64x64x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K> {};

template <int kWide, int kNarrow>
constexpr int kAccFloats = (64 * kWide + 16 * kNarrow) / 2;

// One wgmma on accumulators [kOff, kOff + N / 2): A from shared memory (ss) or registers (rs). scale:
// Zero for a tile's first k16 step, so that no other instruction ever writes the accumulators (which
// would serialize the wgmma pipeline: ptxas's C7515), One after.
template <class Op, int kOff, int kFloats, size_t... I>
__device__ __forceinline__ void ss(uint64_t da, uint64_t db, float (&acc)[kFloats], gmma::ScaleOut scale,
                                   std::index_sequence<I...>) {
  Op::fma(da, db, acc[kOff + I]..., scale);
}

template <class Op, int kOff, int kFloats, size_t... I>
__device__ __forceinline__ void rs(const uint32_t* a, uint64_t db, float (&acc)[kFloats], gmma::ScaleOut scale,
                                   std::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], db, acc[kOff + I]..., scale);
}

// A tile's N as kWide 64-wide chunks then kNarrow 16-wide ones. An m64nN fragment keeps 4 floats a
// thread per 8 columns in column order, so a chunk's registers are the wide tile's at its columns:
// acc[4 g + {0, 1}] = (weight row 16 warp + lane / 4, token 8 g + 2 (lane % 4) + {0, 1}), acc[4 g + {2, 3}]
// the same 8 weight rows further.
template <int kWide, int kNarrow, int kChunk = 0>
__device__ __forceinline__ void rs_chunks(const uint32_t* a, uint64_t db, float (&acc)[kAccFloats<kWide, kNarrow>],
                                          gmma::ScaleOut scale) {
  constexpr int kCols = kChunk < kWide ? 64 * kChunk : 64 * kWide + 16 * (kChunk - kWide);
  if constexpr (kChunk < kWide) {
    rs<Rs<64>, kCols / 2>(a, db + uint64_t(kCols * kRowBytes >> 4), acc, scale, std::make_index_sequence<32>{});
    rs_chunks<kWide, kNarrow, kChunk + 1>(a, db, acc, scale);
  } else if constexpr (kChunk < kWide + kNarrow) {
    rs<Rs<16>, kCols / 2>(a, db + uint64_t(kCols * kRowBytes >> 4), acc, scale, std::make_index_sequence<8>{});
    rs_chunks<kWide, kNarrow, kChunk + 1>(a, db, acc, scale);
  }
}

// The same with the width a run-time count of 32-wide chunks (1-8) over the 256-wide accumulators:
// one mainloop for every width, each chunk behind a uniform branch. ptxas then puts a
// warpgroup.arrive before each wgmma (C7519); wgmma_nsplit.cu's run-time variants measure what that
// costs. Tried first (session 45): one compiled mainloop per 16-row width, dispatched a tile, spilled
// 4.6 KB (16 inlined variants); each variant __noinline__ serialized the wgmmas at the call (C7510);
// 64- and 16-wide chunks behind run-time branches serialized them for registers (C7511).
__device__ __forceinline__ void rs_chunks32(const uint32_t* a, uint64_t db, float (&acc)[128], gmma::ScaleOut scale,
                                            int chunks) {
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    if (c < chunks) {
      rs<Rs<32>, 0>(a, db + uint64_t(32 * c * kRowBytes >> 4), reinterpret_cast<float (&)[16]>(acc[16 * c]), scale,
                    std::make_index_sequence<16>{});
    }
  }
}

template <int kFloats>
__device__ __forceinline__ void fence_acc(float (&acc)[kFloats]) {
#pragma unroll
  for (int i = 0; i < kFloats; ++i) cute::warpgroup_fence_operand(acc[i]);
}

// One K block's wgmmas, committed. kSs: A from shared memory too (N = 256 only: the instruction of
// a standard 128 x 256 tile, for comparison).
// kWide = kNarrow = 0: the width is `chunks` 32-wide chunks, at run time (rs_chunks32; 128 accumulators).
template <bool kSs, int kWide, int kNarrow>
__device__ __forceinline__ void block_mma(const uint32_t (&a)[16], uint32_t w_rows, uint32_t x_stage,
                                          float (&acc)[kAccFloats<kWide, kNarrow> ? kAccFloats<kWide, kNarrow> : 128],
                                          bool first, int chunks = 0) {
  const uint64_t da = sw128_descriptor(w_rows), db = sw128_descriptor(x_stage);
  fence_acc(acc);
  cute::warpgroup_arrive();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const gmma::ScaleOut scale = first && kk == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One;
    const uint64_t k_off = uint64_t(kk * 32 >> 4);
    if constexpr (kSs) {
      static_assert(kWide == 4 && kNarrow == 0, "the ss variant is N = 256");
      ss<Ss<256>, 0>(da + k_off, db + k_off, acc, scale, std::make_index_sequence<128>{});
    } else if constexpr (kWide + kNarrow == 0) {
      rs_chunks32(a + 4 * kk, db + k_off, acc, scale, chunks);
    } else {
      rs_chunks<kWide, kNarrow>(a + 4 * kk, db + k_off, acc, scale);
    }
  }
  cute::warpgroup_commit_batch();
  fence_acc(acc);
}

// The ring: stage s holds W rows [0, 128) and X rows [0, 256) of one K block.
struct Ring {
  uint8_t* w;
  uint8_t* x;
  uint64_t* full;
  uint64_t* empty;
  __device__ uint32_t w_addr(int s) const { return static_cast<uint32_t>(__cvta_generic_to_shared(w + s * kWStage)); }
  __device__ uint32_t x_addr(int s) const { return static_cast<uint32_t>(__cvta_generic_to_shared(x + s * kXStage)); }
};

// Carves the ring out of 1024-aligned dynamic shared memory and initializes its barriers (all
// threads call it: a barrier inside). full_arrivals: the producer arrivals a stage waits for (1: the
// TMA thread; 2: and a warp whose cp.async copies the barrier tracks).
__device__ __forceinline__ Ring make_ring(uint8_t* smem_raw, uint64_t* barriers, int full_arrivals = 1) {
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) / 1024 * 1024);
  Ring ring{smem, smem + kStages * kWStage, barriers, barriers + kStages};
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ClusterTransactionBarrier::init(&ring.full[s], full_arrivals);
      ClusterBarrier::init(&ring.empty[s], 2);  // a thread of each consumer warpgroup
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  return ring;
}

// Producer: K block `i` of the CTA's sequence into its stage, once the consumers released it.
// Returns the stage's full barrier for the caller's copies, its bytes expected.
__device__ __forceinline__ uint64_t* produce_stage(const Ring& ring, int i, int bytes) {
  const int s = i % kStages;
  ClusterBarrier::wait(&ring.empty[s], ((i / kStages) & 1) ^ 1);
  ClusterTransactionBarrier::arrive_and_expect_tx(&ring.full[s], bytes);
  return &ring.full[s];
}

__device__ __forceinline__ void tma_load(const CUtensorMap& map, uint64_t* bar, void* dst, int k, int row) {
  const uint64_t hint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
  cute::SM90_TMA_LOAD_2D::copy(&map, bar, hint, dst, k, row);
}

// Consumer warpgroup: one tile's `blocks` K blocks (blocks even), starting at block `i` of the CTA's
// sequence; each stage released once its wgmmas are done. Returns with the accumulators final.
// generic_x: B was written by cp.async (the generic proxy), so a proxy fence precedes the wgmmas.
template <bool kSs, int kWide, int kNarrow>
__device__ __forceinline__ void mma_tile(const Ring& ring, int i, int blocks, int cwg,
                                         float (&acc)[kAccFloats<kWide, kNarrow> ? kAccFloats<kWide, kNarrow> : 128],
                                         int chunks = 0, bool generic_x = false) {
  const bool signals = threadIdx.x % 128 == 0;
  uint32_t a0[16], a1[16];
  for (int kb = 0; kb < blocks; kb += 2) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int b = i + kb + h, s = b % kStages;
      ClusterBarrier::wait(&ring.full[s], (b / kStages) & 1);
      if (generic_x) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      uint32_t(&a)[16] = h == 0 ? a0 : a1;
      const uint32_t w_rows = ring.w_addr(s) + cwg * 64 * kRowBytes;
      if constexpr (!kSs) load_a(w_rows, a);
      block_mma<kSs, kWide, kNarrow>(a, w_rows, ring.x_addr(s), acc, kb + h == 0, chunks);
      cute::warpgroup_wait<1>();  // block b - 1 done: its stage and its A buffer are free
      if (signals && kb + h > 0) ClusterBarrier::arrive(&ring.empty[(b - 1) % kStages]);
    }
  }
  cute::warpgroup_wait<0>();
  fence_acc(acc);
  if (signals) ClusterBarrier::arrive(&ring.empty[(i + blocks - 1) % kStages]);
}

inline PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
    std::printf("cuTensorMapEncodeTiled not found\n");
    std::exit(1);
  }
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

// A [rows, k] bf16 matrix in boxes of 64 x box_rows, 128-byte swizzle; rows past the end read as 0.
inline CUtensorMap tensor_map(void* ptr, int64_t rows, int64_t k, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {cuuint64_t(k), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(k) * 2};
  const cuuint32_t box[2] = {64, cuuint32_t(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = encode_fn()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, ptr, dims, strides, box, elem,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::printf("cuTensorMapEncodeTiled failed: %d\n", int(r));
    std::exit(1);
  }
  return map;
}

// bf16 values +-[1, 2) from a hash of the index and a seed.
__global__ void fill_kernel(uint16_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t h = ((uint32_t(i) ^ seed * 0x9e3779b9u) * 2654435761u) >> 16;
    p[i] = static_cast<uint16_t>(0x3c00u | (h & 0x3ffu)) ^ (h & 0x8000u);
  }
}

}  // namespace swapab
