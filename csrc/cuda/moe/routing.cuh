// Renormalize routing of one token by one warp: shared by the routing kernels (moe_sm90.cu) and
// the layer kernel (moe_decode_layer_sm90.cu), so both give the same ids and weights bit for bit.
#pragma once

#include <climits>
#include <cmath>
#include <type_traits>

#include "cuda/moe/fp8_e4m3.cuh"
#include "cuda/moe/moe_kernels.h"

namespace cake::sm90 {
namespace {

// (value, id) a beats (value, id) b: larger value, then lower id.
__device__ __forceinline__ bool beats(float va, int ia, float vb, int ib) {
  return va > vb || (va == vb && ia < ib);
}

// Token t's Renormalize routing by one warp: top-k of its logits (ties to the lower id), softmax
// over the k picks in float32, into ids / weights [t * top_k, (t + 1) * top_k).
// kPerLane: the experts each lane holds (num_experts <= 32 * kPerLane), sized to the model's
// experts by the host (one warp is the whole routing of a decode step: its instructions are the
// routing kernel's latency).
template <int kPerLane, class T>
__device__ void topk_softmax_token(const T* logits, int64_t t, int num_experts, int top_k, int32_t* ids,
                                   float* weights) {
  const int lane = threadIdx.x & 31;
  // Lane l holds experts l, l + 32, ...; taken ones become -inf with id INT_MAX (never chosen).
  float v[kPerLane];
  int id[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    float x = e < num_experts ? load_float(logits + t * num_experts + e) : -INFINITY;
    if (isnan(x)) x = -INFINITY;
    v[i] = x;
    id[i] = e < num_experts ? e : INT_MAX;
  }
  // Lane j keeps pick j (its logit and id); every lane keeps the first pick's logit, the largest.
  float my_top = -INFINITY, top0 = -INFINITY;
  int top_id = 0;
  for (int j = 0; j < top_k; ++j) {
    float best = -INFINITY;
    int best_id = INT_MAX;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (beats(v[i], id[i], best, best_id)) {
        best = v[i];
        best_id = id[i];
      }
    }
    for (int d = 16; d > 0; d /= 2) {
      const float ov = __shfl_xor_sync(0xffffffffu, best, d);
      const int oi = __shfl_xor_sync(0xffffffffu, best_id, d);
      if (beats(ov, oi, best, best_id)) {
        best = ov;
        best_id = oi;
      }
    }
    if (j == 0) top0 = best;
    if (lane == j) {
      my_top = best;
      top_id = best_id;
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (id[i] == best_id) {
        v[i] = -INFINITY;
        id[i] = INT_MAX;
      }
    }
  }
  // Softmax over the k picks in float32, summed in pick order.
  float sum = 0.f;
  for (int j = 0; j < top_k; ++j) sum += expf(__shfl_sync(0xffffffffu, my_top, j) - top0);
  if (lane < top_k) {
    ids[t * top_k + lane] = top_id;
    weights[t * top_k + lane] = expf(my_top - top0) / sum;
  }
}

// topk_softmax_token with the experts per lane and the logits' type chosen at run time (the layer
// kernel routes a few tokens per launch: one copy of the kernel for every expert count and type).
__device__ void topk_softmax_token_any(const void* logits, FloatType type, int64_t t, int num_experts, int top_k,
                                       int32_t* ids, float* weights) {
  const auto route = [&](auto per_lane) {
    constexpr int kPerLane = decltype(per_lane)::value;
    switch (type) {
      case FloatType::kFloat:
        return topk_softmax_token<kPerLane>(static_cast<const float*>(logits), t, num_experts, top_k, ids, weights);
      case FloatType::kBFloat16:
        return topk_softmax_token<kPerLane>(static_cast<const __nv_bfloat16*>(logits), t, num_experts, top_k, ids,
                                            weights);
      case FloatType::kHalf:
        return topk_softmax_token<kPerLane>(static_cast<const __half*>(logits), t, num_experts, top_k, ids, weights);
    }
  };
  if (num_experts <= 64) return route(std::integral_constant<int, 2>());
  if (num_experts <= 128) return route(std::integral_constant<int, 4>());
  if (num_experts <= 256) return route(std::integral_constant<int, 8>());
  if (num_experts <= 512) return route(std::integral_constant<int, 16>());
  return route(std::integral_constant<int, 32>());
}

}  // namespace
}  // namespace cake::sm90
