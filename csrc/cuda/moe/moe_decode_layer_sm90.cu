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
#include <type_traits>

#include <c10/cuda/CUDAException.h>

#include "cuda/common/pdl.cuh"
#include "cuda/moe/moe_decode.cuh"
#include "cuda/moe/routing.cuh"

namespace cake::sm90 {
namespace {

using LayerParams = MoeDecodeLayerArgs;

// The shard's routes in route order: route_expert[l] / route_index[l] of local route l, and
// local_of[r] (-1: dropped) for every route r.
struct LayerRoutes {
  int expert[kMoeDecodeLayerMaxRoutes];
  int index[kMoeDecodeLayerMaxRoutes];
  int local_of[kMoeDecodeLayerMaxRoutes];
  int count;
};
// ... and, routed from logits in the kernel, every route's global expert id and scale.
struct LogitsRoutes : LayerRoutes {
  int id[kMoeDecodeLayerMaxRoutes];
  float scale[kMoeDecodeLayerMaxRoutes];
};

// kFromLogits: every CTA routes the tokens itself, a warp per token (no routing launch or
// hand-off), CTA 0 also into ids_out / scales_out; else the routes are p.ids / p.scales. Separate
// kernels: with the routing code in it, the ids kernel measured ~7 us slower at T=1 (NOTES).
template <bool kFromLogits, class Routes>
__device__ void find_routes(const LayerParams& p, Routes& r) {
  const int routes = p.tokens * p.top_k;
  const int32_t* ids = p.ids;
  if constexpr (kFromLogits) {
    for (int t = threadIdx.x / 32; t < p.tokens; t += kThreads / 32) {
      topk_softmax_token_any(p.logits, p.logits_type, t, p.num_experts, p.top_k, r.id, r.scale);
    }
    __syncthreads();
    if (blockIdx.x == 0) {
      for (int i = threadIdx.x; i < routes; i += kThreads) {
        p.ids_out[i] = r.id[i];
        p.scales_out[i] = r.scale[i];
      }
    }
    ids = r.id;
  }
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int count = 0;
    for (int base = 0; base < routes; base += 32) {
      const int i = base + lane;
      const int e = i < routes ? ids[i] - p.local_offset : -1;
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
template <class T, bool kFromLogits, class Routes>
__device__ void layer_finalize(const LayerParams& p, const Routes& r) {
  using Out = DecodeMma<T>;
  const int vecs = p.hidden / 8;
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < p.tokens * vecs; i += gridDim.x * kThreads) {
    const int t = i / vecs, v = i % vecs;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j = 0; j < p.top_k; ++j) {
      const int route = t * p.top_k + j;
      const int l = r.local_of[route];
      if (l < 0) continue;
      float scale;
      if constexpr (kFromLogits) {
        scale = r.scale[route];
      } else {
        scale = p.scales[route];
      }
      const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(p.y + (int64_t(l) * p.hidden + 8 * v) * 2));
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = Out::unpack2(words[q]);
        acc[2 * q] = __fadd_rn(acc[2 * q], __fmul_rn(scale, f.x));
        acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], __fmul_rn(scale, f.y));
      }
    }
    uint8_t* dst = p.out + (int64_t(t) * p.hidden + 8 * v) * 2;
#pragma unroll
    for (int q = 0; q < 4; ++q) Out::store2(dst + 4 * q, acc[2 * q], acc[2 * q + 1]);
  }
}

template <class T, bool kFromLogits>
__global__ void __launch_bounds__(kThreads, 2) moe_decode_layer_kernel(LayerParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;
  uint8_t* b = smem + kRingBytes;
  float* tile = reinterpret_cast<float*>(b + kBBytes);
  __shared__ std::conditional_t<kFromLogits, LogitsRoutes, LayerRoutes> routes;
  pdl_wait();
  pdl_launch_dependents();
  find_routes<kFromLogits>(p, routes);
  auto grid = cooperative_groups::this_grid();
  layer_gemm<T, true>(p, routes, ring, b, tile);
  grid.sync();  // h complete (and its amax final) before any GEMM2 B row is staged
  layer_gemm<T, false>(p, routes, ring, b, tile);
  grid.sync();
  layer_finalize<T, kFromLogits>(p, routes);
}

template <class T>
void launch_layer(const LayerParams& p, cudaStream_t stream, bool pdl) {
  auto kernel = p.logits ? moe_decode_layer_kernel<T, true> : moe_decode_layer_kernel<T, false>;
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
  LayerParams p = a;
  p.w_bytes = element == MoeDecodeElement::kE4m3 ? 1 : 2;
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
