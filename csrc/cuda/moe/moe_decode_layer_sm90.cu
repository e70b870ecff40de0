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
// the same wgmma sequence per 64 weight rows, the same roundings, the same fp8 scales (dynamic
// ones from the amax over all of x, then over all of h).
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

// Phase 1 (kSwiGLU) or 2: this CTA's items, (local route, 64 weight rows) each, one pass over the
// 64 rows' K with the route's single B row.
template <class T, bool kSwiGLU>
__device__ void layer_gemm(const LayerParams& lp, const LayerRoutes& r, uint8_t* ring, uint8_t* b, float* tile) {
  using Out = DecodeMma<T>;
  DecodeParams p;
  p.n = kSwiGLU ? 2 * lp.inter : lp.hidden;
  p.k_bytes = (kSwiGLU ? lp.hidden : lp.inter) * lp.w_bytes;
  p.w = kSwiGLU ? lp.w1 : lp.w2;
  p.quantize_a = lp.w_bytes == 1;  // fp8 weights take 16-bit activations quantized on the way in
  p.a = kSwiGLU ? lp.x : lp.h;
  p.a_scale = kSwiGLU ? lp.x_scale : lp.fc2_scale;
  p.a_elements = int64_t(kSwiGLU ? lp.tokens : r.count) * (kSwiGLU ? lp.hidden : lp.inter);
  p.w_scale = kSwiGLU ? lp.w1_scale : lp.w2_scale;
  const int tiles = p.n / kTileM;
  const int items = r.count * tiles;
  float a_scale = 1.0f;
  bool first = true;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int l = item / tiles, m_tile = item % tiles;
    const int e = r.expert[l];
    const int64_t a_row = kSwiGLU ? r.index[l] / lp.top_k : l;
    const Pass s = make_pass(p, a_row, a_row + 1);
    const uint8_t* warp_rows = p.w + (int64_t(e) * p.n + m_tile * kTileM + 16 * (threadIdx.x / 32)) * p.k_bytes;
    // Phase 2's B rows (h) were written in this kernel: loaded through L2.
    pass_product<T, false, 1, !kSwiGLU>(p, s, warp_rows, first, a_scale, ring, b, tile);
    first = false;
    const float alpha = a_scale * (p.w_scale ? p.w_scale[e] : 1.0f);
    if constexpr (kSwiGLU) {
      // tile column 0 is the route's row: weight rows 0-31 up, 32-63 gate (interleaved at 32).
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
      }
    } else if (threadIdx.x < 32) {
      const int j = 2 * threadIdx.x;
      Out::store2(lp.y + (int64_t(l) * lp.hidden + m_tile * kTileM + j) * 2, alpha * tile[j * kTilePitch],
                  alpha * tile[(j + 1) * kTilePitch]);
    }
  }
}

// Phase 3: out[t] = sum_j scales[t, j] * y[local_of[t * top_k + j]] over the kept routes, float32
// in route order, one rounding (moe_finalize's numbers). 8 columns per thread.
template <class T>
__device__ void layer_finalize(const LayerParams& p, const LayerRoutes& r) {
  using Out = DecodeMma<T>;
  const int vecs = p.hidden / 8;
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < p.tokens * vecs; i += gridDim.x * kThreads) {
    const int t = i / vecs, v = i % vecs;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
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

template <class T>
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
  layer_gemm<T, true>(p, routes, ring, b, tile);
  grid.sync();  // h complete (and its amax final) before any GEMM2 B row is staged
  layer_gemm<T, false>(p, routes, ring, b, tile);
  grid.sync();
  layer_finalize<T>(p, routes);
}

template <class T>
void launch_layer(const LayerParams& p, cudaStream_t stream, bool pdl) {
  auto kernel = moe_decode_layer_kernel<T>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), kSmemBytes);
  int device = 0, sms = 0, per_sm = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, kSmemBytes));
  TORCH_CHECK(per_sm >= 1, "cake::moe_forward_out: the layer kernel does not fit on an SM (internal error)");
  // As many CTAs as are resident at once (the grid barriers need them all), fewer if the largest
  // phase has fewer items.
  const int64_t routes = int64_t(p.tokens) * p.top_k;  // an upper bound on the kept routes
  const int64_t items = routes * std::max(2 * p.inter, p.hidden) / kTileM;
  const int ctas = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(int64_t(sms) * per_sm, items)));
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  attributes[0].id = cudaLaunchAttributeCooperative;
  attributes[0].val.cooperative = 1;
  attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[1].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attributes;
  config.numAttrs = pdl ? 2 : 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
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
  p.out = static_cast<uint8_t*>(a.out);
  switch (element) {
    case MoeDecodeElement::kBFloat16:
      return launch_layer<__nv_bfloat16>(p, stream, pdl);
    case MoeDecodeElement::kHalf:
      return launch_layer<__half>(p, stream, pdl);
    case MoeDecodeElement::kE4m3:
      return launch_layer<E4m3>(p, stream, pdl);
  }
}

}  // namespace cake::sm90
