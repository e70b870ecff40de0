// The decode kernel's building blocks (moe_decode_sm90.cu: one GEMM per launch; moe_decode_layer_sm90.cu:
// a whole MoE layer per launch at decode batch sizes).
// Decode-sized MoE GEMMs: a few token rows per expert, so the GEMM is a stream of expert weights.
// The grouped GEMM (TMA descriptors per group, a smem pipeline sized for large tiles) pays ~11 us
// of fixed cost per launch there (benchmarks/NOTES.md, "The decode cost model"). Here one
// warpgroup per 64 weight rows of one expert streams the weights into wgmma's register A operand
// (a cp.async ring, kStages steps of 16 KB in flight, each warp copying whole lines of its rows:
// registers alone held too few bytes in flight, ~3 TB/s), and the expert's token rows
// (B, up to 32 per pass) wait in shared memory; GEMM1 gathers x rows itself and applies the
// SwiGLU(Step) in its epilogue, so one launch replaces gather + grouped GEMM + SwiGLU.
//
// K is summed in slices of kSliceSteps steps (2 KB of each weight row), each slice in its own
// accumulators and added in slice order into a float32 total that starts at 0: the same bits
// whether one CTA runs all of an item's slices (both kernels) or the layer kernel spreads them
// over CTAs that would otherwise idle (an EP shard's one expert at T=1: 64 items for 264 CTAs).
//
// The 16-byte weight piece of a thread is not the k order wgmma's A fragment wants: the kernel
// permutes K instead (a dot product does not care), by storing B's K in the matching order. Per
// 64-byte block of K, thread t of a row group holds bytes [16t, 16t + 16); its word j (4 bytes)
// is the A fragment's k-chunk j (of 4 chunks of 16 bytes) at byte 4t. B's physical segment q
// (16 bytes) therefore goes word by word to smem k-chunk j, byte 4q.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <type_traits>

#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include "cuda/moe/fp8_e4m3.cuh"
#include "cuda/moe/moe_kernels.h"
#include "cuda/moe/swiglu.cuh"

// Internal linkage: each kernel file gets its own copy of these device functions.
namespace cake::sm90 {
namespace {

constexpr int kThreads = 128;                // one warpgroup
constexpr int kTileM = 64;                   // weight rows per CTA: one wgmma M
constexpr int kRowsPerPass = 32;             // token rows per pass over the weights
constexpr int kNBlocks = kRowsPerPass / 8;   // wgmma N = 8 each
constexpr int kUnroll = 4;                   // 64-byte K blocks per pipeline step
constexpr int kStages = 4;                   // weight steps in flight per CTA (cp.async ring)
constexpr int kStageBytes = kThreads * kUnroll * 2 * 16;  // 16 KB: each thread's two rows
constexpr int kBBytes = 32 * 1024;           // B (token rows) in shared memory
constexpr int kTilePitch = kRowsPerPass + 1; // the epilogue's fp32 tile [64][32], padded
constexpr int kRingBytes = kStages * kStageBytes;
constexpr int kSmemBytes = kRingBytes + kBBytes + kTileM * kTilePitch * 4;  // 2 CTAs per SM
static_assert(kMoeDecodeStepBytes == 64 * kUnroll, "moe_decode_gemm_fits checks K by this step");
constexpr int kStepRowBytes = 64 * kUnroll;           // one weight row's bytes per step
constexpr int kPiecesPerRow = kStepRowBytes / 16;     // its 16-byte pieces
constexpr int kRowsPerCopy = 32 / kPiecesPerRow;      // rows one warp-wide cp.async covers
constexpr int kWarpStageBytes = 16 * kStepRowBytes;   // a warp's 16 weight rows of one step
static_assert(kPiecesPerRow % 8 == 0 && kPiecesPerRow <= 32, "piece_offset's swizzle and the copies' lanes");
constexpr int kSliceSteps = 8;                        // steps per K slice
static_assert(kSliceSteps * kStepRowBytes == kMoeDecodeSliceBytes, "the slice the workspace is sized by");

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// The output element: rounding (SwiGLU rounds h first) and a store of two values.
template <class Out>
struct DecodeOut;
template <>
struct DecodeOut<__nv_bfloat16> {
  static __device__ float round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
  static __device__ void store2(void* p, float a, float b) {
    *static_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
  }
  static __device__ float2 unpack2(uint32_t w) { return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&w)); }
};
template <>
struct DecodeOut<__half> {
  static __device__ float round(float v) { return __half2float(__float2half_rn(v)); }
  static __device__ void store2(void* p, float a, float b) { *static_cast<__half2*>(p) = __floats2half2_rn(a, b); }
  static __device__ float2 unpack2(uint32_t w) { return __half22float2(*reinterpret_cast<__half2*>(&w)); }
};

// One wgmma m64n8 (A in registers, B in shared memory) and the output element, per input type.
template <class Atom, class Out>
struct DecodeMmaOf : DecodeOut<Out> {
  static __device__ __forceinline__ void fma(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint64_t desc,
                                             float (&d)[4]) {
    Atom::fma(a0, a1, a2, a3, desc, d[0], d[1], d[2], d[3]);
  }
};
namespace gmma = cute::SM90::GMMA;
template <class T>
struct DecodeMma;
template <>
struct DecodeMma<__nv_bfloat16>
    : DecodeMmaOf<gmma::MMA_64x8x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K>, __nv_bfloat16> {};
template <>
struct DecodeMma<__half> : DecodeMmaOf<gmma::MMA_64x8x16_F32F16F16_RS<gmma::Major::K, gmma::Major::K>, __half> {};
struct E4m3 {};  // float8_e4m3fn: k32 per 32 bytes, bfloat16 output
template <>
struct DecodeMma<E4m3> : DecodeMmaOf<gmma::MMA_64x8x32_F32E4M3E4M3_RS_TN<>, __nv_bfloat16> {};

// The index of the n-th (from 0) expert with rows, or -1. Every warp computes it (no barrier).
__device__ int nth_expert_with_rows(const int32_t* offsets, int num_experts, int n) {
  const int lane = threadIdx.x % 32;
  constexpr int kPerLane = 8;
  for (int base = 0; base < num_experts; base += 32 * kPerLane) {
    int32_t lo[kPerLane], hi[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = base + 32 * i + lane;
      lo[i] = e < num_experts ? offsets[e] : 0;
      hi[i] = e < num_experts ? offsets[e + 1] : 0;
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      unsigned mask = __ballot_sync(0xffffffffu, hi[i] > lo[i]);
      const int count = __popc(mask);
      if (n < count) {
        for (int j = 0; j < n; ++j) mask &= mask - 1;
        return base + 32 * i + __ffs(mask) - 1;
      }
      n -= count;
    }
  }
  return -1;
}

struct DecodeParams {
  const uint8_t* a = nullptr;                   // token rows, k_bytes each
  int64_t a_rows = 0;                           // rows of a (GEMM1: tokens * top_k routes bound the index)
  const int32_t* permuted_to_expanded = nullptr;  // GEMM1: row p reads a[permuted_to_expanded[p] / top_k]
  int top_k = 1;
  const uint8_t* w = nullptr;                   // [E, n, k_bytes]
  const int32_t* offsets = nullptr;             // [E + 1]
  int num_experts = 0;
  int64_t rows = 0;                             // output rows
  int n = 0;                                    // weight rows per expert
  int k_bytes = 0;
  const float* a_scale = nullptr;               // fp8: alpha = a_scale * w_scale[e]
  bool quantize_a = false;                      // bfloat16 a rows (2 * k_bytes) quantized to e4m3
  int64_t a_elements = 0;                       // ... with a dynamic scale: the amax over all of a
  bool fresh_a = false;                         // a was written in this kernel (stage_b)
  const float* w_scale = nullptr;
  const float* limits = nullptr;                // SwiGLUStep's per-expert limit
  bool w_gate_up = false;                       // GEMM1: w holds [gate; up] halves, not 32-row interleave
  void* out = nullptr;                          // GEMM1: [rows, n / 2]; GEMM2: [rows, n]
};

// The first of this warp's 16 weight rows in tile m_tile (kTileM rows) of expert e. GEMM1's tile is
// up in rows 0-31 and gate in 32-63 whatever w1's layout: interleaved at 32 rows that is w's rows
// [64 m_tile, 64 m_tile + 64) in order; with [gate; up] halves (w_gate_up) warps 0-1 read up rows
// n / 2 + 32 m_tile + [0, 32) and warps 2-3 gate rows 32 m_tile + [0, 32): the same 16 contiguous
// rows a warp, so the copies and everything after them are the same.
__device__ __forceinline__ const uint8_t* warp_weight_rows(const DecodeParams& p, int e, int m_tile) {
  const int warp = threadIdx.x / 32;
  const int64_t row = p.w_gate_up ? (warp < 2 ? p.n / 2 : 0) + m_tile * (kTileM / 2) + 16 * (warp % 2)
                                  : m_tile * kTileM + 16 * warp;
  return p.w + (int64_t(e) * p.n + row) * p.k_bytes;
}

// One pipeline step's weights: kUnroll 64-byte blocks of the thread's two rows (g and g + 8).
struct StepRegs {
  uint4 v[kUnroll][2];
};

// The weights reach shared memory by cp.async, kStages steps ahead. Each warp copies its own 16
// rows, whole 128-byte lines per instruction (kRowsPerCopy rows x kStepRowBytes contiguous: the
// DRAM and L2 see full lines, not the half lines of a thread-per-fragment copy), and each lane
// then reads back the 16-byte pieces of its A fragment (rows g and g + 8, pieces 4u + t) after a
// warp barrier. Piece c of the warp's row r sits at slot c ^ 4 (r & 1): the 8 lanes of a 16-byte
// access phase hit 8 different bank groups, in the copies (one row's consecutive pieces) and in
// the reads (rows g and g + 1, pieces 4u + t).
__device__ __forceinline__ int piece_offset(int r, int c) { return r * kStepRowBytes + ((c ^ (4 * (r & 1))) * 16); }

// warp_rows: the warp's first weight row at K = 0; row_bytes: the distance between rows; steps
// past end_step copy nothing.
__device__ __forceinline__ void copy_step(uint32_t ring, const uint8_t* warp_rows, int row_bytes, int step,
                                          int end_step) {
  if (step < end_step) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t slot = ring + (step % kStages) * kStageBytes + warp * kWarpStageBytes;
    const int c = lane % kPiecesPerRow;
    const uint8_t* src = warp_rows + int64_t(lane / kPiecesPerRow) * row_bytes + step * kStepRowBytes + c * 16;
#pragma unroll
    for (int i = 0; i < 16 / kRowsPerCopy; ++i) {
      const int r = i * kRowsPerCopy + lane / kPiecesPerRow;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(slot + piece_offset(r, c)),
                   "l"(src + int64_t(i * kRowsPerCopy) * row_bytes)
                   : "memory");
    }
  }
  asm volatile("cp.async.commit_group;" ::: "memory");  // empty groups keep the count uniform
}

// After this thread's copies of the step landed and a warp barrier (the other lanes' too).
__device__ __forceinline__ void read_step(StepRegs& r, const uint8_t* ring, int step) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const uint8_t* slot = ring + (step % kStages) * kStageBytes + warp * kWarpStageBytes;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    r.v[u][0] = *reinterpret_cast<const uint4*>(slot + piece_offset(g, 4 * u + t));
    r.v[u][1] = *reinterpret_cast<const uint4*>(slot + piece_offset(g + 8, 4 * u + t));
  }
}

__device__ __forceinline__ void fence_regs(StepRegs& r) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      cute::warpgroup_fence_operand(r.v[u][h].x);
      cute::warpgroup_fence_operand(r.v[u][h].y);
      cute::warpgroup_fence_operand(r.v[u][h].z);
      cute::warpgroup_fence_operand(r.v[u][h].w);
    }
  }
}

__device__ __forceinline__ uint32_t word(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// The pass state: where B lives and how it is chunked along K.
struct Pass {
  int64_t first_row;    // output row of token column 0
  int rows;             // token rows in this pass (<= kRowsPerPass)
  int blocks;           // active wgmma N blocks
  int chunk_bytes;      // K bytes staged at a time
  int chunk_steps;
  uint32_t sbo;         // bytes between 8-row groups of B
};

// 16 bfloat16 values (32 bytes: lo, hi) quantized to 16 e4m3 bytes.
__device__ __forceinline__ uint4 quantize16(const uint4& lo, const uint4& hi, float scale) {
  const __nv_bfloat16* v0 = reinterpret_cast<const __nv_bfloat16*>(&lo);
  const __nv_bfloat16* v1 = reinterpret_cast<const __nv_bfloat16*>(&hi);
  uint4 q;
  uint8_t* qb = reinterpret_cast<uint8_t*>(&q);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    qb[j] = quantize_e4m3(__bfloat162float(v0[j]), scale);
    qb[8 + j] = quantize_e4m3(__bfloat162float(v1[j]), scale);
  }
  return q;
}

// The dynamic scale of bfloat16 a (n elements): this CTA's amax over all of it, as quantize_fp8
// computes it.
__device__ float dynamic_scale(const uint8_t* a, int64_t n) {
  __shared__ unsigned warp_max[kThreads / 32];
  return amax_to_scale(__uint_as_float(block_amax_bits(reinterpret_cast<const __nv_bfloat16*>(a), n, warp_max)));
}

// The scale of an amax held as bits per thread: every thread of the block calls it (a barrier inside).
__device__ float block_scale_from_bits(unsigned m) {
  __shared__ unsigned warp_max[kThreads / 32];
  return amax_to_scale(__uint_as_float(block_max_bits(m, warp_max)));
}

// A small bfloat16 a's dynamic scale in two halves: its loads issued before the pass's weight copies
// (else they queue behind the CTA's whole ring prologue: ~3.8 us of the fp8 layer kernel's 49 at T=1,
// benchmarks/NOTES.md session 36), the amax taken after. The same bits as dynamic_scale.
constexpr int kEarlyAmaxVecs = 4;  // 16-byte vectors per thread: up to 4096 bfloat16 elements
struct EarlyAmax {
  uint4 v[kEarlyAmaxVecs];
  static __device__ bool fits(const DecodeParams& p) {
    return p.quantize_a && p.a_scale == nullptr && p.a_elements % 8 == 0 &&
           p.a_elements <= int64_t(kEarlyAmaxVecs) * kThreads * 8;
  }
  __device__ void load(const DecodeParams& p) {
    const uint4* src = reinterpret_cast<const uint4*>(p.a);
    const int vecs = static_cast<int>(p.a_elements / 8);
#pragma unroll
    for (int u = 0; u < kEarlyAmaxVecs; ++u) {
      const int at = threadIdx.x + u * kThreads;
      v[u] = at < vecs ? (p.fresh_a ? __ldcg(src + at) : __ldg(src + at)) : make_uint4(0, 0, 0, 0);  // |0| adds nothing
    }
  }
  __device__ float scale() const {
    unsigned m = 0;
#pragma unroll
    for (int u = 0; u < kEarlyAmaxVecs; ++u) {
      const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v[u]);
#pragma unroll
      for (int j = 0; j < 8; ++j) m = max(m, __float_as_uint(fabsf(__bfloat162float(e[j]))));
    }
    return block_scale_from_bits(m);
  }
};

// The scale a's values are divided by before the GEMM (and its product multiplied by): fp8 a's
// own, or that of bfloat16 a quantized on the way in. All threads call it (a barrier inside).
__device__ float a_scale_of(const DecodeParams& p) {
  if (p.a_scale) return *p.a_scale;
  return p.quantize_a ? dynamic_scale(p.a, p.a_elements) : 1.0f;
}

// B's K chunk `chunk` into shared memory in wgmma's K order. kBatch segments per thread per round
// have their loads in flight together: a decode pass stages a few KB, and a round trip to L2 per
// segment was most of the staging's time.
// p.fresh_a: a was written earlier in this kernel (the layer kernel's intermediate): loads through
// L2 (ld.global.cg), not the read-only path, which may hold lines from before the writes. (A
// runtime flag: the layer kernel runs both GEMMs through one inlined pass.)
template <bool kGather>
__device__ void stage_b(const DecodeParams& p, const Pass& s, int chunk, float a_scale, uint8_t* b) {
  constexpr int kBatch = 4;
  const int begin = chunk * s.chunk_bytes;
  const int bytes = min(s.chunk_bytes, p.k_bytes - begin);
  const int segments = bytes / 16;
  const int total = s.rows * segments;
  const int64_t a_row_bytes = p.quantize_a ? 2 * int64_t(p.k_bytes) : p.k_bytes;
  // Quantized rows load one segment per round: batching them cost fp8 at T=1 ~5 us on the H200.
  const int batch = p.quantize_a ? 1 : kBatch;
  for (int i0 = threadIdx.x; i0 < total; i0 += batch * kThreads) {
    uint4 raw[kBatch][2];  // the segment's 16 bytes, or its 32 bytes of bfloat16 to quantize
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = i0 + u * kThreads;
      if (u >= batch || i >= total) break;
      const int n = i / segments, seg = i % segments;
      int64_t src_row = s.first_row + n;
      if constexpr (kGather) src_row = p.permuted_to_expanded[src_row] / p.top_k;  // checked before any wgmma
      const uint8_t* src = p.a + src_row * a_row_bytes;
      if (p.quantize_a) {
        const uint4* pair = reinterpret_cast<const uint4*>(src + 2 * int64_t(begin + 16 * seg));
        raw[u][0] = p.fresh_a ? __ldcg(pair) : __ldg(pair);
        raw[u][1] = p.fresh_a ? __ldcg(pair + 1) : __ldg(pair + 1);
      } else {
        const uint4* seg_src = reinterpret_cast<const uint4*>(src + begin) + seg;
        raw[u][0] = p.fresh_a ? __ldcg(seg_src) : __ldg(seg_src);
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = i0 + u * kThreads;
      if (u >= batch || i >= total) break;
      const int n = i / segments, seg = i % segments;
      const uint4 v = p.quantize_a ? quantize16(raw[u][0], raw[u][1], a_scale) : raw[u][0];
      const int block = seg / 4, q = seg % 4;
      uint8_t* dst = b + (n / 8) * s.sbo + (4 * block) * 128 + (n % 8) * 16 + 4 * q;
#pragma unroll
      for (int j = 0; j < 4; ++j) *reinterpret_cast<uint32_t*>(dst + j * 128) = word(v, j);
    }
  }
  // Generic-proxy stores, then wgmma (async proxy) reads.
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// The B descriptor of 16-byte K chunk 0 of the staged chunk: no swizzle, K-major; chunk c of
// 8-row group nb starts (nb * sbo + c * 128) bytes further, added to the low (address) bits.
__device__ __forceinline__ uint64_t b_descriptor(uint32_t b_addr, uint32_t sbo) {
  cute::GmmaDescriptor desc;
  desc.bitfield.start_address_ = static_cast<uint16_t>(b_addr >> 4);
  desc.bitfield.leading_byte_offset_ = 128 >> 4;  // the next 16 bytes of K
  desc.bitfield.stride_byte_offset_ = static_cast<uint16_t>(sbo >> 4);
  desc.bitfield.base_offset_ = 0;
  desc.bitfield.layout_type_ = 0;  // no swizzle
  return desc.desc_;
}

template <class T, int kBlocks>
__device__ __forceinline__ void mma_step(const StepRegs& r, uint64_t desc0, uint32_t sbo16, int local_step,
                                         float (&acc)[kBlocks][4]) {
  uint64_t step_desc = desc0 + uint64_t(local_step * kUnroll * 4 * (128 >> 4));
  // Opaque to the compiler, so it derives each descriptor here instead of keeping all 8 * kBlocks
  // of them live across the loop (register spills).
  asm volatile("mov.b64 %0, %0;" : "+l"(step_desc));
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // two k-steps of 32 bytes per 64-byte block
#pragma unroll
      for (int nb = 0; nb < kBlocks; ++nb) {
        const uint64_t desc = step_desc + uint64_t((4 * u + 2 * half) * (128 >> 4) + nb * sbo16);
        DecodeMma<T>::fma(word(r.v[u][0], 2 * half), word(r.v[u][1], 2 * half), word(r.v[u][0], 2 * half + 1),
                          word(r.v[u][1], 2 * half + 1), desc, acc[nb]);
      }
    }
  }
}

// A pass's output rows from tile[weight row][token]: GEMM1's SwiGLU(Step) or GEMM2's product.
template <class T, bool kSwiGLU>
__device__ void write_pass(const DecodeParams& p, const Pass& s, int e, int m_tile, float alpha, const float* tile) {
  const int64_t first = s.first_row;
  if constexpr (kSwiGLU) {
    // Columns 0-31 of the tile are up, 32-63 gate (w1 interleaved at 32 rows). h is rounded to
    // the output type first, as the grouped GEMM path stores it, then the activation in fp32.
    const int inter = p.n / 2;
    const float limit = p.limits ? p.limits[e] : 0.0f;
    for (int i = threadIdx.x; i < s.rows * 16; i += kThreads) {
      const int n = i / 16, j = 2 * (i % 16);
      float r[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float up = DecodeMma<T>::round(alpha * tile[(j + c) * kTilePitch + n]);
        const float gate = DecodeMma<T>::round(alpha * tile[(32 + j + c) * kTilePitch + n]);
        r[c] = swiglu_value(up, gate, p.limits != nullptr, limit);
      }
      DecodeMma<T>::store2(static_cast<uint8_t*>(p.out) + ((first + n) * inter + m_tile * 32 + j) * 2, r[0], r[1]);
    }
  } else {
    for (int i = threadIdx.x; i < s.rows * 32; i += kThreads) {
      const int n = i / 32, r = 2 * (i % 32);
      DecodeMma<T>::store2(static_cast<uint8_t*>(p.out) + ((first + n) * int64_t(p.n) + m_tile * kTileM + r) * 2,
                           alpha * tile[r * kTilePitch + n], alpha * tile[(r + 1) * kTilePitch + n]);
    }
  }
}

// Token rows [first, first + rows) of the expert's [begin, end): wgmma N blocks and B's K chunks.
__device__ __forceinline__ Pass make_pass(const DecodeParams& p, int64_t first, int64_t end) {
  Pass s;
  s.first_row = first;
  s.rows = static_cast<int>(min64(kRowsPerPass, end - first));
  s.blocks = s.rows <= 8 ? 1 : kNBlocks;  // two variants: more spill registers (ptxas)
  s.chunk_bytes = min(p.k_bytes, kBBytes / (8 * s.blocks) / (64 * kUnroll) * (64 * kUnroll));
  s.chunk_steps = s.chunk_bytes / (64 * kUnroll);
  s.sbo = 8 * s.chunk_bytes;
  return s;
}

template <int kBlocks>
__device__ __forceinline__ void accumulators_to_tile(const float (&acc)[kBlocks][4], float* tile) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nb = 0; nb < kBlocks; ++nb) {
    const int r = 16 * warp + g, c = nb * 8 + 2 * t;
    tile[r * kTilePitch + c] = acc[nb][0];
    tile[r * kTilePitch + c + 1] = acc[nb][1];
    tile[(r + 8) * kTilePitch + c] = acc[nb][2];
    tile[(r + 8) * kTilePitch + c + 1] = acc[nb][3];
  }
}

template <int kBlocks>
__device__ __forceinline__ void zero(float (&acc)[kBlocks][4]) {
#pragma unroll
  for (int nb = 0; nb < kBlocks; ++nb)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[nb][j] = 0.0f;
}

template <int kBlocks>
__device__ __forceinline__ void add_into(float (&total)[kBlocks][4], const float (&acc)[kBlocks][4]) {
#pragma unroll
  for (int nb = 0; nb < kBlocks; ++nb)
#pragma unroll
    for (int j = 0; j < 4; ++j) total[nb][j] = __fadd_rn(total[nb][j], acc[nb][j]);
}

// A slice's sums for token column 0 (the layer kernel's one row per item): slice_out[weight row].
__device__ __forceinline__ void write_slice(const float (&acc)[1][4], float* slice_out) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  if (t == 0) {
    slice_out[16 * warp + g] = acc[0][0];
    slice_out[16 * warp + g + 8] = acc[0][2];
  }
}

template <int kBlocks>
__device__ __forceinline__ void fence_acc(float (&acc)[kBlocks][4]) {
#pragma unroll
  for (int nb = 0; nb < kBlocks; ++nb)
#pragma unroll
    for (int j = 0; j < 4; ++j) cute::warpgroup_fence_operand(acc[nb][j]);
}

// One step's wgmmas, waited for, with the operand fences that keep the compiler from touching
// their registers while they run.
template <class T, int kBlocks>
__device__ __forceinline__ void mma_step_fenced(StepRegs& regs, uint64_t desc0, uint32_t sbo16, int local,
                                                float (&acc)[kBlocks][4]) {
  fence_acc(acc);
  cute::warpgroup_arrive();
  mma_step<T, kBlocks>(regs, desc0, sbo16, local, acc);
  cute::warpgroup_commit_batch();
  cute::warpgroup_wait<0>();
  fence_regs(regs);
  fence_acc(acc);
}

// A pass's first kStages - 1 weight steps (its prologue): pass_product issues them itself, or, with
// `prefetched`, finds them issued by this call earlier (the layer kernel's phase 2 before the grid
// barrier: the weights do not depend on phase 1). The same copies and commit groups either way.
__device__ __forceinline__ void prefetch_pass(uint8_t* ring, const uint8_t* warp_rows, int k_bytes, int first_step,
                                              int end_step) {
  const uint32_t ring_addr = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) copy_step(ring_addr, warp_rows, k_bytes, first_step + i, end_step);
}

// One pass over the expert's weights for s.rows <= 8 * kBlocks token rows: the sums land in
// tile[weight row][token] (fp32). The first pass also finds a's scale, once its first weight
// copies are in flight (a dynamic one reads all of a: at fc2's fold 24 KB per CTA).
// kGather: B rows through the permutation (GEMM1).
// A part of K (the layer kernel's spread items): steps [first_step, end_step), whole slices, each
// slice's sums for token column 0 to slice_out + slice * kTileM instead of the tile.
// b_staged: B already holds this pass's rows, quantized with this a_scale, and they are one chunk
// (the layer kernel's next item of the same token at T=1: e4m3 x of up to 4 KB a row).
template <class T, bool kGather, int kBlocks, bool kEarlyAmax = false>
__device__ void pass_product(const DecodeParams& p, const Pass& s, const uint8_t* warp_rows, bool first_pass,
                             float& a_scale, uint8_t* ring, uint8_t* b, float* tile, int first_step = 0,
                             int end_step = -1, float* slice_out = nullptr, bool prefetched = false,
                             bool b_staged = false) {
  const int steps = end_step < 0 ? p.k_bytes / kStepRowBytes : end_step;
  const uint64_t desc0 = b_descriptor(static_cast<uint32_t>(__cvta_generic_to_shared(b)), s.sbo);
  const uint32_t sbo16 = s.sbo >> 4;
  float acc[kBlocks][4], total[kBlocks][4];
  zero(acc);
  zero(total);

  const uint32_t ring_addr = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  // kEarlyAmax (the layer kernel's e4m3 passes; quantize_a is e4m3's): EarlyAmax where it fits.
  if constexpr (kEarlyAmax && std::is_same_v<T, E4m3>) {
    const bool early_amax = first_pass && EarlyAmax::fits(p);
    EarlyAmax early;
    if (early_amax) early.load(p);
    if (!prefetched) prefetch_pass(ring, warp_rows, p.k_bytes, first_step, steps);
    if (first_pass) a_scale = early_amax ? early.scale() : a_scale_of(p);
  } else {
    if (!prefetched) prefetch_pass(ring, warp_rows, p.k_bytes, first_step, steps);
    if (first_pass) a_scale = a_scale_of(p);
  }
  StepRegs regs;
  for (int step = first_step; step < steps; ++step) {
    __syncwarp();  // every lane has read the slot this copy refills (step - 1's)
    copy_step(ring_addr, warp_rows, p.k_bytes, step + kStages - 1, steps);
    asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 1) : "memory");  // this step's copies landed
    __syncwarp();  // ... those of every lane of the warp
    read_step(regs, ring, step);
    const int local = step % s.chunk_steps;
    // b_staged: the caller's previous pass left this pass's B (its one chunk) in place; nothing to stage.
    if ((local == 0 || step == first_step) && !(b_staged && step == first_step)) {
      __syncthreads();  // the previous chunk's wgmmas (all warps) are done with B
      stage_b<kGather>(p, s, step / s.chunk_steps, a_scale, b);
      __syncthreads();
    }
    mma_step_fenced<T, kBlocks>(regs, desc0, sbo16, local, acc);
    if ((step + 1) % kSliceSteps == 0 || step + 1 == steps) {  // a slice ends
      if constexpr (kBlocks == 1) {
        if (slice_out) write_slice(acc, slice_out + (step / kSliceSteps) * kTileM);
      }
      add_into(total, acc);  // (unused with slice_out)
      zero(acc);
    }
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");

  __syncthreads();  // the previous pass's epilogue is done with the tile
  if (!slice_out) accumulators_to_tile<kBlocks>(total, tile);
  __syncthreads();
}

}  // namespace
}  // namespace cake::sm90
