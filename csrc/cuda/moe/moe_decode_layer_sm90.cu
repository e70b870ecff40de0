// A whole MoE layer in one launch for decode batches (a few tokens): GEMM1 + SwiGLU(Step), GEMM2
// and the fixed-order finalize, with the decode kernel's weight streaming (moe_decode.cuh). At
// T=1 the separate launches (sort, GEMM1, GEMM2, finalize) cost ~30 us over the weight floor, of
// which the launches' ramps, tails and hand-offs are most (benchmarks/NOTES.md, session 12).
//
// Every route of the shard is its own row (no sort: at T=1 a token's experts are distinct). The
// grid is co-resident (a cooperative launch) and walks three phases split by grid barriers:
//   1. items (local route, 64 rows of w1): h[l] = SwiGLU(Step) of round(alpha1 * x[t] @ w1[e].T);
//   2. items (local route, 64 rows of w2): y[l] = round(alpha2 * h[l] @ w2[e].T);
//   3. out[t] = sum over the token's routes, in route order, of scale * y (float32, one rounding).
// The numbers are those of moe_gemm1_swiglu -> moe_gemm2 -> moe_finalize on the decode kernel:
// the same wgmma sequence per 64 weight rows, the same K slices summed in the same order, the same
// roundings, the same fp8 scales (dynamic ones from the amax over all of x, then over all of h).
//
// A phase with few items (an EP shard's one local expert: GEMM1 64 items, GEMM2 112, for 264 CTAs)
// runs at the speed of its CTAs' streams, not the memory's: there each item's K slices are spread
// over `share` CTAs, which write their slices' sums to the workspace. Phase 1's are summed (in
// slice order) and SwiGLU'd after an extra grid barrier; phase 2's by the finalize. The host
// launches the instantiation that can do this only where the expected routes call for it.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include <c10/cuda/CUDAException.h>

#include "cuda/common/pdl.cuh"
#include "cuda/moe/moe_decode.cuh"

namespace cake::sm90 {
namespace {

struct LayerParams {
  const uint8_t* x = nullptr;       // [tokens, hidden], 16-bit
  int tokens = 0;
  int top_k = 1;
  const int32_t* ids = nullptr;     // [tokens * top_k] global expert ids
  const float* scales = nullptr;    // [tokens * top_k]
  int local_offset = 0;
  int num_local = 0;
  const uint8_t* w1 = nullptr;      // [E_local, 2I, hidden]
  bool w1_gate_up = false;          // w1 as [gate; up] halves (else up/gate interleaved at 32 rows)
  const uint8_t* w2 = nullptr;      // [E_local, hidden, I]
  int hidden = 0;
  int inter = 0;
  int w_bytes = 2;                  // bytes per weight element (1: e4m3)
  const float* x_scale = nullptr;   // fp8: static scales, or null (dynamic)
  const float* fc2_scale = nullptr;
  const float* w1_scale = nullptr;  // fp8: [E_local]
  const float* w2_scale = nullptr;
  const float* limits = nullptr;    // SwiGLUStep: [E_local]
  uint8_t* h = nullptr;             // [routes, I] (16-bit), local routes packed
  uint8_t* y = nullptr;             // [routes, hidden] (16-bit), local routes packed
  float* slice_sums = nullptr;      // a spread phase's [item][slice][64 rows]
  float* alphas = nullptr;          // ... and its items' scales
  float* h_amax = nullptr;          // fp8, dynamic fc2 scale, no spread: each phase-1 item's amax of its h values
  int split_items = 0;              // the most items a phase may spread
  uint8_t* out = nullptr;           // [tokens, hidden]
};

// The shard's routes in route order: route_expert[l] / route_index[l] of local route l, and
// local_of[r] (-1: dropped) for every route r.
struct LayerRoutes {
  int expert[kMoeDecodeLayerMaxRoutes];
  int index[kMoeDecodeLayerMaxRoutes];
  int local_of[kMoeDecodeLayerMaxRoutes];
  int count;
};

__device__ void find_routes(const LayerParams& p, LayerRoutes& r) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int routes = p.tokens * p.top_k;
    int count = 0;
    for (int base = 0; base < routes; base += 32) {
      const int i = base + lane;
      const int e = i < routes ? p.ids[i] - p.local_offset : -1;
      const bool kept = i < routes && e >= 0 && e < p.num_local;
      const unsigned mask = __ballot_sync(0xffffffffu, kept);
      const int l = count + __popc(mask & ((1u << lane) - 1));
      if (i < routes) r.local_of[i] = kept ? l : -1;
      if (kept) {
        r.expert[l] = e;
        r.index[l] = i;
      }
      count += __popc(mask);
    }
    if (lane == 0) r.count = count;
  }
  __syncthreads();
}

// K slices of a weight row of k_bytes.
__host__ __device__ inline int k_slices(int k_bytes) { return (k_bytes / kStepRowBytes + kSliceSteps - 1) / kSliceSteps; }

// CTAs per item of a phase: several, each taking a contiguous run of the item's K slices, when the
// items would leave half the grid idle or more. The host asks it of the expected routes (which
// instantiation to launch), every CTA of the kept ones (the same answer in all of them).
__host__ __device__ inline int spread_share(int items, int slices, int grid, int split_items) {
  if (items <= 0 || items > split_items || 2 * items > grid) return 1;
  return slices < grid / items ? slices : grid / items;
}

// How a phase runs its items (local route, 64 weight rows).
struct Spread {
  int tiles;   // items per route
  int items;
  int slices;  // K slices per item
  int share;
};

__device__ Spread unspread(const LayerParams& p, const LayerRoutes& r, bool gemm1) {
  Spread sp;
  sp.tiles = (gemm1 ? 2 * p.inter : p.hidden) / kTileM;
  sp.items = r.count * sp.tiles;
  sp.slices = k_slices((gemm1 ? p.hidden : p.inter) * p.w_bytes);
  sp.share = 1;
  return sp;
}

__device__ Spread spread_of(const LayerParams& p, const LayerRoutes& r, bool gemm1) {
  Spread sp = unspread(p, r, gemm1);
  sp.share = spread_share(sp.items, sp.slices, static_cast<int>(gridDim.x), p.split_items);
  return sp;
}

// kWidth consecutive weight rows' slice sums from src (item's slice 0 + row), each added in slice
// order from 0 (pass_product's order); kBatch slices' loads in flight together, not one round trip
// to L2 per slice.
template <int kWidth>
__device__ __forceinline__ void add_slices(const float* src, int slices, float (&total)[kWidth]) {
  static_assert(kWidth % 4 == 0, "16-byte loads");
  constexpr int kBatch = 4;
#pragma unroll
  for (int q = 0; q < kWidth; ++q) total[q] = 0.0f;
#pragma unroll 1
  for (int s0 = 0; s0 < slices; s0 += kBatch) {
    float4 v[kBatch][kWidth / 4];
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
#pragma unroll
      for (int c = 0; c < kWidth / 4; ++c)
        v[u][c] = s0 + u < slices ? __ldcg(reinterpret_cast<const float4*>(src + (s0 + u) * kTileM) + c)
                                  : make_float4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (s0 + u >= slices) break;
#pragma unroll
      for (int c = 0; c < kWidth / 4; ++c) {
        total[4 * c] = __fadd_rn(total[4 * c], v[u][c].x);
        total[4 * c + 1] = __fadd_rn(total[4 * c + 1], v[u][c].y);
        total[4 * c + 2] = __fadd_rn(total[4 * c + 2], v[u][c].z);
        total[4 * c + 3] = __fadd_rn(total[4 * c + 3], v[u][c].w);
      }
    }
  }
}

// Item `item`'s slice sums, summed, into tile column 0 (rows 0-63: 4 per thread of 16).
__device__ void sum_slices(const LayerParams& p, const Spread& sp, int item, float* tile) {
  if (threadIdx.x < kTileM / 4) {
    float total[4];
    add_slices<4>(p.slice_sums + int64_t(item) * sp.slices * kTileM + 4 * threadIdx.x, sp.slices, total);
#pragma unroll
    for (int q = 0; q < 4; ++q) tile[(4 * threadIdx.x + q) * kTilePitch] = total[q];
  }
  __syncthreads();
}

// h's 32 values of (route l, m_tile) from tile column 0: weight rows 0-31 up, 32-63 gate
// (interleaved at 32), each rounded after the scale, then SwiGLU(Step). With lp.h_amax, also their
// amax as stored (rounded), per item: phase 2's dynamic scale is then the max of those, not a read
// of all of h by every CTA (~1.8 us at T=1: benchmarks/NOTES.md session 36).
template <class T>
__device__ void store_h(const LayerParams& lp, int l, int m_tile, int e, float alpha, const float* tile) {
  using Out = DecodeMma<T>;
  const float limit = lp.limits ? lp.limits[e] : 0.0f;
  if (threadIdx.x < 16) {
    const int j = 2 * threadIdx.x;
    float v[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const float up = Out::round(alpha * tile[(j + c) * kTilePitch]);
      const float gate = Out::round(alpha * tile[(32 + j + c) * kTilePitch]);
      v[c] = swiglu_value(up, gate, lp.limits != nullptr, limit);
    }
    Out::store2(lp.h + (int64_t(l) * lp.inter + m_tile * 32 + j) * 2, v[0], v[1]);
    // The bits of |h| as stored; max over the 16 threads (dynamic_scale's order-free max).
    if (std::is_same_v<T, E4m3> && lp.h_amax) {
      unsigned m = max(__float_as_uint(fabsf(Out::round(v[0]))), __float_as_uint(fabsf(Out::round(v[1]))));
      m = __reduce_max_sync(0xffffu, m);
      if (threadIdx.x == 0) lp.h_amax[l * (lp.inter / 32) + m_tile] = __uint_as_float(m);
    }
  }
}

// A phase's GEMM as the decode kernel sees it: B = x (phase 1) or h (phase 2), one row per route.
__device__ DecodeParams layer_decode_params(const LayerParams& lp, const LayerRoutes& r, bool gemm1) {
  DecodeParams p;
  p.n = gemm1 ? 2 * lp.inter : lp.hidden;
  p.k_bytes = (gemm1 ? lp.hidden : lp.inter) * lp.w_bytes;
  p.w = gemm1 ? lp.w1 : lp.w2;
  p.w_gate_up = gemm1 && lp.w1_gate_up;
  p.quantize_a = lp.w_bytes == 1;  // fp8 weights take 16-bit activations quantized on the way in
  p.a = gemm1 ? lp.x : lp.h;
  p.a_scale = gemm1 ? lp.x_scale : lp.fc2_scale;
  p.a_elements = int64_t(gemm1 ? lp.tokens : r.count) * (gemm1 ? lp.hidden : lp.inter);
  p.w_scale = gemm1 ? lp.w1_scale : lp.w2_scale;
  p.fresh_a = !gemm1;  // h was written in this kernel
  return p;
}

// Work unit `unit` of a phase: its item (local route l, 64 weight rows m_tile of expert e), this
// warp's first weight row, and its steps (all of K, or a spread item's part: a run of K slices).
struct LayerUnit {
  int item, part, l, m_tile, e;
  const uint8_t* warp_rows;
  int first_step, end_step;
};

__device__ LayerUnit layer_unit(const DecodeParams& p, const LayerRoutes& r, const Spread& sp, int unit) {
  LayerUnit u;
  u.item = unit / sp.share;
  u.part = unit % sp.share;
  u.l = u.item / sp.tiles;
  u.m_tile = u.item % sp.tiles;
  u.e = r.expert[u.l];
  u.warp_rows = warp_weight_rows(p, u.e, u.m_tile);
  const int steps = p.k_bytes / kStepRowBytes;
  const int first_slice = u.part * sp.slices / sp.share, end_slice = (u.part + 1) * sp.slices / sp.share;
  u.first_step = sp.share > 1 ? first_slice * kSliceSteps : 0;
  u.end_step = sp.share > 1 ? min(end_slice * kSliceSteps, steps) : steps;
  return u;
}

// Phase 2's first weight steps of this CTA's first unit, issued before the grid barrier that ends
// phase 1 (the w2 rows do not depend on h): its stream then starts before the barrier releases,
// and CTAs without phase-1 work (or with fewer items) fill their wait with it. layer_gemm(...,
// prefetched = true) skips those copies.
__device__ void prefetch_phase2(const LayerParams& lp, const LayerRoutes& r, const Spread& sp, uint8_t* ring) {
  if (int(blockIdx.x) >= sp.items * sp.share) return;
  const DecodeParams p = layer_decode_params(lp, r, false);
  const LayerUnit u = layer_unit(p, r, sp, blockIdx.x);
  prefetch_pass(ring, u.warp_rows, p.k_bytes, u.first_step, u.end_step);
}

// Phase 1 (gemm1) or 2: this CTA's items, (local route, 64 weight rows) each, one pass over the
// 64 rows' K with the route's single B row; or, spread, its parts of items (slice sums out).
// gemm1 is a runtime flag so that the spreading kernel can run both phases through one inlined
// pass (its code size: benchmarks/NOTES.md, sessions 13 and 21); the plain one passes constants.
// prefetched: this CTA's first unit's first steps were issued by prefetch_phase2.
template <class T>
__device__ void layer_gemm(const LayerParams& lp, const LayerRoutes& r, const Spread& sp, bool gemm1, uint8_t* ring,
                           uint8_t* b, float* tile, bool prefetched = false) {
  const DecodeParams p = layer_decode_params(lp, r, gemm1);
  float a_scale = 1.0f;
  bool first = true, need_scale = true;
  // fc2's dynamic scale from phase 1's per-item amaxes (store_h), not all of h. e4m3 only (h_amax is set
  // for fp8 alone): the 16-bit kernels leave these tests out at compile time.
  if (std::is_same_v<T, E4m3> && !gemm1 && lp.h_amax) {
    unsigned m = 0;
    for (int i = threadIdx.x; i < r.count * (lp.inter / 32); i += kThreads) {
      m = max(m, __float_as_uint(__ldcg(lp.h_amax + i)));
    }
    a_scale = block_scale_from_bits(m);
    need_scale = false;
  }
  int64_t staged_row = -1;  // the B row left in shared memory by this CTA's last unit, if whole (one chunk)
  for (int unit = blockIdx.x; unit < sp.items * sp.share; unit += gridDim.x) {
    const LayerUnit u = layer_unit(p, r, sp, unit);
    const int64_t a_row = gemm1 ? r.index[u.l] / lp.top_k : u.l;
    const Pass s = make_pass(p, a_row, a_row + 1);
    // A spread item's part: its run of slices, their sums out.
    const bool spread = sp.share > 1;
    // At T=1 every phase-1 unit's B is the one token's x row: e4m3 x (quantized as it is staged) is staged
    // once a CTA where it is one chunk. Not for 16-bit x, whose rows at H = 4096 are two chunks (nothing to
    // skip): their kernels keep their code.
    const bool whole_b = std::is_same_v<T, E4m3> && s.chunk_bytes >= p.k_bytes;
    pass_product<T, false, 1, /*kEarlyAmax=*/true>(
        p, s, u.warp_rows, first && need_scale, a_scale, ring, b, tile, u.first_step, u.end_step,
        spread ? lp.slice_sums + int64_t(u.item) * sp.slices * kTileM : nullptr, prefetched && first,
        whole_b && a_row == staged_row);
    staged_row = whole_b ? a_row : -1;
    first = false;
    const float alpha = a_scale * (p.w_scale ? p.w_scale[u.e] : 1.0f);
    if (spread) {
      if (u.part == 0 && threadIdx.x == 0) lp.alphas[u.item] = alpha;
    } else if (gemm1) {
      store_h<T>(lp, u.l, u.m_tile, u.e, alpha, tile);  // tile column 0 is the route's row
    } else if (threadIdx.x < 32) {
      const int j = 2 * threadIdx.x;
      DecodeMma<T>::store2(lp.y + (int64_t(u.l) * lp.hidden + u.m_tile * kTileM + j) * 2,
                           alpha * tile[j * kTilePitch], alpha * tile[(j + 1) * kTilePitch]);
    }
  }
}

// After a spread phase 1 and a grid barrier: each item's slices summed, then h as layer_gemm stores it.
template <class T>
__device__ void layer_h_from_slices(const LayerParams& lp, const LayerRoutes& r, const Spread& sp, float* tile) {
  for (int item = blockIdx.x; item < sp.items; item += gridDim.x) {
    const int l = item / sp.tiles, m_tile = item % sp.tiles;
    sum_slices(lp, sp, item, tile);
    store_h<T>(lp, l, m_tile, r.expert[l], __ldcg(lp.alphas + item), tile);
    __syncthreads();  // the tile is read before the next item's sums overwrite it
  }
}

// Phase 3: out[t] = sum_j scales[t, j] * y[local_of[t * top_k + j]] over the kept routes, float32
// in route order, one rounding (moe_finalize's numbers). 8 columns per thread.
// A spread phase 2 left slice sums instead of y: y's 8 values of the route are
// round(alpha * (the slices summed in order)), what layer_gemm stores.
template <class T>
__device__ void layer_finalize(const LayerParams& p, const LayerRoutes& r, const Spread& sp) {
  using Out = DecodeMma<T>;
  const int vecs = p.hidden / 8;
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < p.tokens * vecs; i += gridDim.x * kThreads) {
    const int t = i / vecs, v = i % vecs;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (sp.share > 1) {  // the route loop kept rolled: code size costs every launch
#pragma unroll 1
      for (int j = 0; j < p.top_k; ++j) {
        const int route = t * p.top_k + j;
        const int l = r.local_of[route];
        if (l < 0) continue;  // dropped: no term
        const int item = l * sp.tiles + 8 * v / kTileM;
        const float alpha = __ldcg(p.alphas + item), scale = p.scales[route];
        float total[8];
        add_slices<8>(p.slice_sums + int64_t(item) * sp.slices * kTileM + 8 * v % kTileM, sp.slices, total);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] = __fadd_rn(acc[q], __fmul_rn(scale, Out::round(alpha * total[q])));
      }
      uint8_t* dst = p.out + (int64_t(t) * p.hidden + 8 * v) * 2;
#pragma unroll
      for (int q = 0; q < 4; ++q) Out::store2(dst + 4 * q, acc[2 * q], acc[2 * q + 1]);
      continue;
    }
    // kBatch routes' loads issued together, then summed in route order: one L2 round trip per
    // batch, not per route (the sum, and so the bits, as before).
    constexpr int kBatch = 8;
    for (int j0 = 0; j0 < p.top_k; j0 += kBatch) {
      uint4 raw[kBatch];
      float scale[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int route = t * p.top_k + j0 + u;
        const int l = j0 + u < p.top_k ? r.local_of[route] : -1;
        scale[u] = l < 0 ? 0.0f : p.scales[route];
        raw[u] = l < 0 ? make_uint4(0, 0, 0, 0)
                       : __ldcg(reinterpret_cast<const uint4*>(p.y + (int64_t(l) * p.hidden + 8 * v) * 2));
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (j0 + u >= p.top_k || r.local_of[t * p.top_k + j0 + u] < 0) continue;  // dropped: no term
        const uint32_t words[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 f = Out::unpack2(words[q]);
          acc[2 * q] = __fadd_rn(acc[2 * q], __fmul_rn(scale[u], f.x));
          acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], __fmul_rn(scale[u], f.y));
        }
      }
    }
    uint8_t* dst = p.out + (int64_t(t) * p.hidden + 8 * v) * 2;
#pragma unroll
    for (int q = 0; q < 4; ++q) Out::store2(dst + 4 * q, acc[2 * q], acc[2 * q + 1]);
  }
}

// kSpread: the instantiation that may spread a phase (launched when the expected routes leave
// half the grid idle in a phase: launch_layer). It runs both GEMM phases through one inlined pass;
// the other instantiation has none of the spread code and a pass per phase, specialized: the
// spread code alone cost 1-3 us at T=1 where it never ran (benchmarks/NOTES.md, session 21).
template <class T, bool kSpread>
__global__ void __launch_bounds__(kThreads, 2) moe_decode_layer_kernel(LayerParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;
  uint8_t* b = smem + kRingBytes;
  float* tile = reinterpret_cast<float*>(b + kBBytes);
  __shared__ LayerRoutes routes;
  pdl_wait();
  pdl_launch_dependents();
  find_routes(p, routes);
  auto grid = cooperative_groups::this_grid();
  if constexpr (kSpread) {
    Spread sp;
#pragma unroll 1
    for (int phase = 1; phase <= 2; ++phase) {
      sp = spread_of(p, routes, phase == 1);
      layer_gemm<T>(p, routes, sp, phase == 1, ring, b, tile, /*prefetched=*/phase == 2);
      if (phase == 1) prefetch_phase2(p, routes, spread_of(p, routes, false), ring);
      if (phase == 1 && sp.share > 1) {
        grid.sync();  // every slice summed
        layer_h_from_slices<T>(p, routes, sp, tile);
      }
      grid.sync();  // phase 1: h complete (and its amax final) before any GEMM2 B row is staged
    }
    layer_finalize<T>(p, routes, sp);  // phase 2's spread
  } else {
    layer_gemm<T>(p, routes, unspread(p, routes, true), true, ring, b, tile);
    const Spread sp = unspread(p, routes, false);
    prefetch_phase2(p, routes, sp, ring);
    grid.sync();  // h complete (and its amax final) before any GEMM2 B row is staged
    layer_gemm<T>(p, routes, sp, false, ring, b, tile, /*prefetched=*/true);
    grid.sync();
    layer_finalize<T>(p, routes, sp);
  }
}

// Layer-kernel CTAs resident per SM: the smaller of the two instantiations' (the same shared memory,
// the spreading one a few more registers).
template <class T>
int layer_ctas_per_sm() {
  const auto plain = reinterpret_cast<const void*>(moe_decode_layer_kernel<T, false>);
  const auto spreading = reinterpret_cast<const void*>(moe_decode_layer_kernel<T, true>);
  allow_dynamic_smem(plain, kSmemBytes);
  allow_dynamic_smem(spreading, kSmemBytes);
  return std::min(resident_ctas_per_sm(plain, kThreads, kSmemBytes),
                  resident_ctas_per_sm(spreading, kThreads, kSmemBytes));
}

template <class T>
void launch_layer(const LayerParams& p, int64_t expected_routes, cudaStream_t stream, bool pdl) {
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int per_sm = layer_ctas_per_sm<T>();
  TORCH_CHECK(per_sm >= 1, "cake::moe_forward_out: the layer kernel does not fit on an SM (internal error)");
  // As many CTAs as are resident at once (the grid barriers need them all), fewer if the largest
  // phase has fewer items.
  const int64_t routes = int64_t(p.tokens) * p.top_k;  // an upper bound on the kept routes
  const int64_t items = routes * std::max(2 * p.inter, p.hidden) / kTileM;
  const int ctas = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(int64_t(sms) * per_sm, items)));
  // The spreading instantiation where the routes this shard expects (all of them without a hint)
  // would leave half the grid idle in a phase.
  const int64_t expected = expected_routes >= 0 ? std::min(expected_routes, routes) : routes;
  // (int: at most kMoeDecodeLayerMaxRoutes routes of at most INT_MAX / 64 weight rows; K bytes fit
  // the decode kernel's int.)
  const auto spreads = [&](int n, int k) {
    return spread_share(static_cast<int>(expected) * (n / kTileM), k_slices(k * p.w_bytes), ctas, p.split_items) > 1;
  };
  const bool spread = spreads(2 * p.inter, p.hidden) || spreads(p.hidden, p.inter);
  auto kernel = spread ? moe_decode_layer_kernel<T, true> : moe_decode_layer_kernel<T, false>;
  // A dynamic fc2 scale from phase 1's per-item amaxes, kept in the slice sums' space, which only a
  // spreading launch uses (moe_cuda.cpp checks that it holds them).
  LayerParams launched = p;
  launched.h_amax = !spread && p.w_bytes == 1 && p.fc2_scale == nullptr ? p.slice_sums : nullptr;
  launch_cooperative_kernel(kernel, dim3(ctas), dim3(kThreads), kSmemBytes, stream, pdl, launched);
}

}  // namespace

bool moe_decode_layer_fits(int64_t routes, int64_t hidden, int64_t inter, int64_t w_bytes) {
  return routes >= 1 && routes <= kMoeDecodeLayerMaxRoutes && moe_decode_gemm_fits(2 * inter, hidden * w_bytes, 1) &&
         moe_decode_gemm_fits(hidden, inter * w_bytes, 1) && hidden % 64 == 0 &&
         (w_bytes == 2 || (routes * hidden <= kMoeDecodeMaxAmaxElements && routes * inter <= kMoeDecodeMaxAmaxElements));
}

void moe_decode_layer(const MoeDecodeLayerArgs& a, MoeDecodeElement element, cudaStream_t stream, bool pdl) {
  LayerParams p;
  p.x = static_cast<const uint8_t*>(a.x);
  p.tokens = static_cast<int>(a.tokens);
  p.top_k = a.top_k;
  p.ids = a.ids;
  p.scales = a.scales;
  p.local_offset = static_cast<int>(a.local_offset);
  p.num_local = static_cast<int>(a.num_local);
  p.w1 = static_cast<const uint8_t*>(a.w1);
  p.w1_gate_up = a.w1_gate_up;
  p.w2 = static_cast<const uint8_t*>(a.w2);
  p.hidden = static_cast<int>(a.hidden);
  p.inter = static_cast<int>(a.inter);
  p.w_bytes = element == MoeDecodeElement::kE4m3 ? 1 : 2;
  p.x_scale = a.x_scale;
  p.fc2_scale = a.fc2_scale;
  p.w1_scale = a.w1_scale;
  p.w2_scale = a.w2_scale;
  p.limits = a.limits;
  p.h = static_cast<uint8_t*>(a.h);
  p.y = static_cast<uint8_t*>(a.y);
  p.slice_sums = a.slice_sums;
  p.alphas = a.alphas;
  p.split_items = a.split_items;
  p.out = static_cast<uint8_t*>(a.out);
  switch (element) {
    case MoeDecodeElement::kBFloat16:
      return launch_layer<__nv_bfloat16>(p, a.expected_routes, stream, pdl);
    case MoeDecodeElement::kHalf:
      return launch_layer<__half>(p, a.expected_routes, stream, pdl);
    case MoeDecodeElement::kE4m3:
      return launch_layer<E4m3>(p, a.expected_routes, stream, pdl);
  }
}

}  // namespace cake::sm90
