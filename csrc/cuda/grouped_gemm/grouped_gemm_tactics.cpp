#include "cuda/grouped_gemm/grouped_gemm_tactics.h"

#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <algorithm>

#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

namespace cake {

namespace sm90 {
// One function per kernel configuration (configs_sm90.inc), each in its own generated .cu file
// (declared here only, so that a new line there compiles one new file, not all of them).
#define CAKE_GG_CONFIG(name, ...) void grouped_gemm_##name(const GroupedGemmParams& p, cudaStream_t stream);
#define CAKE_SWIGLU_CONFIG CAKE_GG_CONFIG
#define CAKE_SCATTER_CONFIG CAKE_GG_CONFIG
#define CAKE_GATHER_CONFIG CAKE_GG_CONFIG
#define CAKE_GATEUP_CONFIG CAKE_GG_CONFIG
#include "cuda/grouped_gemm/configs_sm90.inc"
#undef CAKE_GATEUP_CONFIG
#undef CAKE_GATHER_CONFIG
#undef CAKE_SCATTER_CONFIG
#undef CAKE_SWIGLU_CONFIG
#undef CAKE_GG_CONFIG
}  // namespace sm90

namespace {

std::array<std::atomic<int>, static_cast<int>(TacticFamily::kCount)> g_override{-1, -1, -1, -1, -1, -1};

constexpr int kFamilies = static_cast<int>(TacticFamily::kCount);

// The 64x256 pingpong tile's scatter twin (the MoE GEMM2's fused finalize) runs up to this K: one warp group's
// atomic epilogue then hides under the other's MMAs (Qwen3-30B / Qwen3-235B / the Kimi-K2 shard, K = 768 /
// 1536 / 2048: 5-10% faster than the plain GEMM and the finalize kernel); at Mixtral's K = 14336 it ran 34%
// slower than the plain GEMM (553 vs 413 us at T=1024; not understood), whose finalize kernel costs ~10 us
// there (session 31, results/sweep_scatter64_h200_s31.txt). No K between 2048 and 14336 was measured.
constexpr int64_t kPingpong64ScatterMaxK = 4096;
// Configuration names start with their family's prefix.
constexpr const char* kPrefixes[kFamilies] = {"fwd_bf16_", "dgrad_bf16_", "wgrad_bf16_", "wgrad_f32_", "fwd_f16_",
                                              "fwd_e4m3_"};
constexpr const char* kFamilyNames[kFamilies] = {"fwd", "dgrad", "wgrad", "wgrad_f32", "fwd_f16", "fwd_e4m3"};

// family, E, rows, N, K, epilogue twin: a twin is tuned apart from the plain GEMM, since its epilogue
// changes which tile wins (the scatter epilogue outlasts a pingpong partner's MMAs, for one).
using BucketKey = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int>;
std::mutex g_tuned_mutex;
std::map<BucketKey, int> g_tuned;

// The rows the choice sizes the groups by: the caller's expectation where it gave one (an
// expert-parallel shard gets a fraction of the T * top_k rows it is sized for), else all of them.
int64_t choice_rows(const GroupedGemmShape& s) {
  return s.expected_rows >= 0 ? std::min(s.expected_rows, s.sum_m) : s.sum_m;
}

BucketKey bucket_key(TacticFamily family, const GroupedGemmShape& s, EpilogueTwin twin) {
  // One choice for the SwiGLU twins, gathering or not, w1 interleaved or as halves.
  if (twin == EpilogueTwin::kGatherSwiGlu || twin == EpilogueTwin::kSwiGluGateUp ||
      twin == EpilogueTwin::kGatherSwiGluGateUp) {
    twin = EpilogueTwin::kSwiGlu;
  }
  int64_t rows = 1;
  while (rows < choice_rows(s)) rows *= 2;
  return {static_cast<int>(family), s.num_groups, rows, s.n, s.k, static_cast<int>(twin)};
}

std::array<std::vector<Tactic>, static_cast<int>(TacticFamily::kCount)> build_sm90_tables() {
  // Every epilogue twin configuration by name: fwd_<tile> has swiglu_<tile>, scatter_<tile> and
  // gather_swiglu_<tile>; fwd_<tile> and fwd_fixed_<tile> both have swiglu_gu_<tile> and gather_swiglu_gu_<tile>.
  std::map<std::string, GroupedGemmLaunchFn> twins;
#define CAKE_GG_CONFIG(name, ...)
#define CAKE_SWIGLU_CONFIG(name, ...) twins[#name] = &sm90::grouped_gemm_##name;
#define CAKE_SCATTER_CONFIG(name, ...) twins[#name] = &sm90::grouped_gemm_##name;
#define CAKE_GATHER_CONFIG(name, ...) twins[#name] = &sm90::grouped_gemm_##name;
#define CAKE_GATEUP_CONFIG(name, ...) twins[#name] = &sm90::grouped_gemm_##name;
#include "cuda/grouped_gemm/configs_sm90.inc"
#undef CAKE_GATEUP_CONFIG
#undef CAKE_GATHER_CONFIG
#undef CAKE_SCATTER_CONFIG
#undef CAKE_SWIGLU_CONFIG
#undef CAKE_GG_CONFIG
  auto twin = [&](const char* name, const char* prefix, bool any_operands = false) -> GroupedGemmLaunchFn {
    constexpr const char* kFwd = "fwd_";
    if (std::strncmp(name, kFwd, std::strlen(kFwd)) != 0) return nullptr;
    std::string tile(name + std::strlen(kFwd));
    if (const auto fixed = tile.find("fixed_"); any_operands && fixed != std::string::npos) tile.erase(fixed, 6);
    const auto it = twins.find(prefix + tile);
    return it == twins.end() ? nullptr : it->second;
  };

  std::array<std::vector<Tactic>, static_cast<int>(TacticFamily::kCount)> tables;
  auto add = [&](const char* name, GroupedGemmLaunchFn fn) {
    int f = 0;
    while (f < kFamilies && std::strncmp(name, kPrefixes[f], std::strlen(kPrefixes[f])) != 0) ++f;
    TORCH_CHECK(f < kFamilies, "cake grouped GEMM: configuration ", name, " has no family (internal error)");
    const auto family = static_cast<TacticFamily>(f);
    // Each configuration with the default tile order first (what the heuristic names), then
    // along N, and both with 4-tile swizzles: the autotuner's extra choices.
    auto& table = tables[static_cast<int>(family)];
    const GroupedGemmLaunchFn swiglu = twin(name, "swiglu_"), scatter = twin(name, "scatter_"),
                              gather = twin(name, "gather_swiglu_"), swiglu_gu = twin(name, "swiglu_gu_", true),
                              gather_gu = twin(name, "gather_swiglu_gu_", true);
    const int64_t scatter_max_k = std::strstr(name, "_ping_64x256x") != nullptr ? kPingpong64ScatterMaxK : INT64_MAX;
    table.push_back({name, fn, false, 1, swiglu, scatter, gather, scatter_max_k, swiglu_gu, gather_gu});
    table.push_back({std::string(name) + "_rasterN", fn, true, 1, swiglu, scatter, gather, scatter_max_k, swiglu_gu, gather_gu});
    table.push_back({std::string(name) + "_swz4", fn, false, 4, swiglu, scatter, gather, scatter_max_k, swiglu_gu, gather_gu});
    table.push_back({std::string(name) + "_rasterN_swz4", fn, true, 4, swiglu, scatter, gather, scatter_max_k, swiglu_gu, gather_gu});
  };
#define CAKE_GG_CONFIG(name, ...) add(#name, &sm90::grouped_gemm_##name);
#define CAKE_SWIGLU_CONFIG(name, ...)
#define CAKE_SCATTER_CONFIG(name, ...)
#define CAKE_GATHER_CONFIG(name, ...)
#define CAKE_GATEUP_CONFIG(name, ...)
#include "cuda/grouped_gemm/configs_sm90.inc"
#undef CAKE_GATEUP_CONFIG
#undef CAKE_GATHER_CONFIG
#undef CAKE_SCATTER_CONFIG
#undef CAKE_SWIGLU_CONFIG
#undef CAKE_GG_CONFIG
  return tables;
}

// The tactic named exactly `name` (a configuration and a tile order).
int find(TacticFamily family, const std::string& name) {
  const auto& table = tactics_sm90(family);
  for (size_t i = 0; i < table.size(); ++i) {
    if (table[i].name == name) return static_cast<int>(i);
  }
  TORCH_CHECK(false, "cake grouped GEMM: no tactic named ", name, " (internal error)");
}

// The heuristic's choices for one family, looked up by name once (not per launch).
struct HeuristicChoices {
  int few_rows;           // a few rows per group: weight-bandwidth bound
  int few_rows_narrow;    // the same with half the weight rows per tile, for fuller waves; -1: none
  int short_groups;       // groups one 128-row tile holds (past swap-AB's); -1: none (the later rules)
  int short_groups_pair;  // the same where its N tiles pair up for a 1x2 cluster; -1: as short_groups
  int small_groups;       // up to small_groups_max_rows rows per group (past the rules above); -1: none
  int small_groups_max_rows;
  int medium_groups;      // up to 2048 rows per group, N tiles pair up (else large_groups_odd); -1: none
  int large_groups;       // large groups, N tiles pair up for the 1x2 cluster
  int large_groups_odd;   // large groups, an odd number of 256-wide N tiles
  int large_groups_weight_in_l2;  // fwd: large groups, one expert's weight fits in L2; -1: none
  // fwd: small groups with a long K, where 128-row tiles pad no more rows than 64-row ones: a 2x1 cluster where a
  // group's 128-row tiles pair up, else 1x2; -1: none
  int long_k_groups_m_pairs = -1;
  int long_k_groups = -1;
  // wgrad: the small-groups tile in the order along N, for a tall output (see the rule); -1: none
  int small_groups_tall_output = -1;
};

const HeuristicChoices& heuristic_choices(TacticFamily family) {
  static const auto choices = [] {
    std::array<HeuristicChoices, kFamilies> c{};
    for (int f = 0; f < kFamilies; ++f) {
      const auto fam = static_cast<TacticFamily>(f);
      auto named = [&](const std::string& rest) { return find(fam, kPrefixes[f] + rest); };
      // e4m3 tiles hold twice the elements along K (the same bytes as the 16-bit tiles).
      const bool fp8 = fam == TacticFamily::kFwdE4m3;
      const std::string k64 = fp8 ? "128" : "64", k128 = fp8 ? "256" : "128";
      const int coop_2x1 = named("coop_128x256x" + k64 + "_c2x1");
      const int coop_1x2 = named("coop_128x256x" + k64 + "_c1x2_rasterN_swz4");
      switch (fam) {
        case TacticFamily::kFwdBf16:
        case TacticFamily::kFwdF16:
          // Decode with few experts touched: 64x16x256 pingpong, 9% over 128x32x128 on the StepFun fc1 at T=1
          // (sweep_moe_gemm.py; float16 has no such configuration).
          if (fam == TacticFamily::kFwdBf16) {
            // From 33 rows per group, fixed-operand tiles (fixed_operand_sm90.cuh; H200, session 24,
            // results/tiles_balanced_vs_routed_h200.txt, sweep_moe_gemm_h200_fixed.txt): 33-128 rows 128x128
            // pingpong (it has a scatter twin, the 64x256 tile none); 129-640 rows 64x256 pingpong (on routed
            // groups, whose last tiles are ragged, 2-8% over 128x128 and up to 14% over the cooperative tile;
            // under the fused finalize its plain GEMM and the finalize kernel still beat the cooperative
            // tile's scatter twin, Qwen3-30B T=4096 234 vs 250 us); then 128x256 cooperative, in the default
            // tile order (the fixed tile measured level with or above the ptr-array one's rasterN_swz4).
            // 33-128 rows where the 128-wide N tiles pair up: the same tile in a 1x2 cluster, whose two CTAs
            // (one group's rows, two weight tiles) share the row tile by TMA multicast: half the L2 reads of
            // x, which at these sizes are as many bytes as the weights' (session 32, results/
            // ab_ping_cluster_h200_s32.txt: Qwen3-30B / Qwen3-235B T=1024 -1%, Mixtral T=256 -4%, the Kimi-K2
            // shard T=4096 -2%). The 64x256 tile in a 1x2 cluster ran 1-80% slower: not used.
            c[f] = {named("swapab_coop_128x32x128_c1x1"), named("swapab_ping_64x16x256_c1x1"),
                    named("fixed_ping_128x128x64_c1x1"), named("fixed_ping_128x128x64_c1x2"),
                    named("fixed_ping_64x256x64_c1x1"), 640,
                    named("fixed_coop_128x256x64_c1x2"), named("fixed_coop_128x256x64_c1x2"),
                    named("fixed_coop_128x256x64_c2x1"), named("ping_128x128x64_c1x1_rasterN"),
                    named("coop_128x256x64_c2x1_swz4"), named("coop_128x256x64_c1x2_rasterN")};
          } else {  // float16: the ptr-array tiles
            c[f] = {named("swapab_coop_128x32x128_c1x1"), -1, -1, -1, -1, 0, named("coop_128x256x64_c1x2"), coop_1x2,
                    coop_2x1, named("ping_128x128x64_c1x1_rasterN")};
          }
          break;
        case TacticFamily::kFwdE4m3:
          // From the H200 sweep of the StepFun shapes (sweep_moe_gemm.py, NOTES.md): large groups,
          // 128x256 cooperative with the 1x2 cluster (837-966 TFLOP/s, 8-18% over 128x128 pingpong);
          // no medium-group or weight-in-L2 rule measured for fp8.
          // Decode with few experts touched: the bf16 rule's 64x16 tile, K stages of the same bytes.
          // Small groups (from where swap-AB's token tiles overflow to 384 rows): 64x256 pingpong, K tiles of the
          // same bytes as bf16's
          // (session 17: at 256 rows per expert it beats the cooperative tile, 414 vs 452 us).
          c[f] = {named("swapab_coop_128x32x" + k128 + "_c1x1"), named("swapab_ping_64x16x512_c1x1"), -1, -1,
                  named("ping_64x256x128_c1x1"), 384, -1, coop_1x2, coop_2x1, -1};
          break;
        case TacticFamily::kDgradBf16:
          // The fwd rules' fixed-operand tiles (session 24): 64x256 pingpong from 33 to 640 rows per group,
          // then 128x256 cooperative.
          c[f] = {named("ping_64x256x64_c1x1"), -1, named("fixed_ping_64x256x64_c1x1"), -1,
                  named("fixed_ping_64x256x64_c1x1"), 640, named("fixed_coop_128x256x64_c1x2"),
                  named("fixed_coop_128x256x64_c1x2"), named("fixed_coop_128x256x64_c2x1"), -1};
          break;
        default:  // wgrad (bf16 or float32 out): the groups' rows are the reduction; the output is E dense N x K tiles
          // Every size on the fixed-operand cooperative tile (session 25, results/ab_wgrad_fixed_h200.txt):
          // the ptr-array kernel, when a CTA moves to another group (at E=128 almost every tile), patches and fences
          // its operand descriptors and drains its TMA stores before patching the store descriptor; the fixed one
          // loads every group through one descriptor per operand and stores dw as one [E, N, K] tensor. 2x1
          // cluster up to 2048 rows per group (Qwen3-30B fc1 / fc2, 512 rows: +9 / +11%, float32 +8%; 1024 rows
          // +6%; 2048 +4%), then the 1x2 cluster (0 to +5% over the ptr-array tile's order along N, swizzle 4).
          // Decode too (1 to 8 rows per group: +39 to +47%, float32 +3 to +12%): a group's last K block runs
          // only the wgmmas that hold its rows. Tall outputs take the 2x1 tile in the order along N (the rule).
          c[f] = {named("fixed_coop_128x256x64_c2x1"), -1, named("fixed_coop_128x256x64_c2x1"), -1,
                  named("fixed_coop_128x256x64_c2x1"), 2048, -1,
                  named("fixed_coop_128x256x64_c1x2"), named("fixed_coop_128x256x64_c2x1"), -1};
          c[f].small_groups_tall_output = named("fixed_coop_128x256x64_c2x1_rasterN");
      }
    }
    return c;
  }();
  return choices[static_cast<int>(family)];
}

// An attribute of the current device, or `fallback` where there is none (a CPU-only test of the heuristic).
int current_device_attribute(cudaDeviceAttr attr, int fallback) {
  int devices = 0, device = 0, value = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 || cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&value, attr, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return fallback;
  }
  return value;
}

// No GPU here: an H100's / H200's 132.
int sm_count() {
  static const int count = current_device_attribute(cudaDevAttrMultiProcessorCount, 132);
  return count;
}

// The device's DRAM bandwidth (bytes/s): twice its memory clock times its bus width (an H100 SXM's HBM3
// 3.35e12, an H200's HBM3e 4.9e12). No GPU here: the H200's.
double device_dram_bytes_per_s() {
  static const double bytes_per_s = [] {
    const int khz = current_device_attribute(cudaDevAttrMemoryClockRate, 0);
    const int bits = current_device_attribute(cudaDevAttrGlobalMemoryBusWidth, 0);
    return khz > 0 && bits > 0 ? 2.0 * khz * 1e3 * bits / 8 : 4.8e12;
  }();
  return bytes_per_s;
}

// An H100's or H200's L2 (both 50 MB): the bound of the rules that keep an operand in it.
constexpr int64_t kL2Bytes = 50ll << 20;

// The experts a decode-sized GEMM touches (at most one per row) and their weight tiles `tile_rows` wide.
int64_t experts_touched(const GroupedGemmShape& s) {
  return std::max<int64_t>(1, std::min(s.num_groups, choice_rows(s)));
}
int64_t weight_tiles(const GroupedGemmShape& s, int64_t tile_rows) {
  return experts_touched(s) * ((s.n + tile_rows - 1) / tile_rows);
}

// Decode (a few rows per expert, as many experts touched as routes): the weight tiles are the work
// units, and few experts give few of them. Qwen3/StepFun fc1 at T=1 (8 experts, N=3072): 192 tiles
// of 128 rows fill 132 SMs in 2 waves, the second 45% full (73% of the waves' capacity); 384 tiles
// of 64 rows fill 97%. Halving the tile pays only when it fills the waves clearly better, and the
// narrow tiles' 16 token columns hold an expert's rows (more would stream its weight tiles twice).
bool narrow_weight_tiles_fill_better(const GroupedGemmShape& s) {
  if (choice_rows(s) > 16 * experts_touched(s)) return false;
  const int64_t sms = sm_count();
  auto fill = [&](int64_t tile_rows) {
    const int64_t tiles = weight_tiles(s, tile_rows);
    return double(tiles) / double((tiles + sms - 1) / sms * sms);
  };
  return fill(64) > fill(128) + 0.1;
}

}  // namespace

TacticFamily tactic_family(GroupedGemmOp op, at::ScalarType in_dtype, at::ScalarType out_dtype) {
  switch (op) {
    case GroupedGemmOp::kFwd:
      return in_dtype == at::kFloat8_e4m3fn ? TacticFamily::kFwdE4m3
             : out_dtype == at::kHalf       ? TacticFamily::kFwdF16
                                            : TacticFamily::kFwdBf16;
    case GroupedGemmOp::kDgrad:
      return TacticFamily::kDgradBf16;
    case GroupedGemmOp::kWgrad:
      return out_dtype == at::kFloat ? TacticFamily::kWgradF32 : TacticFamily::kWgradBf16;
  }
  TORCH_CHECK(false, "cake grouped GEMM: unknown op");
}

TacticFamily tactic_family(const std::string& name) {
  for (int f = 0; f < kFamilies; ++f) {
    if (name == kFamilyNames[f]) return static_cast<TacticFamily>(f);
  }
  TORCH_CHECK(false, "grouped GEMM tactics: family must be fwd, dgrad, wgrad, wgrad_f32, fwd_f16 or fwd_e4m3, got '",
              name, "'");
}

const std::vector<Tactic>& tactics_sm90(TacticFamily family) {
  static const auto tables = build_sm90_tables();
  return tables[static_cast<int>(family)];
}

GroupedGemmLaunchFn epilogue_twin_sm90(const Tactic& tactic, EpilogueTwin twin) {
  switch (twin) {
    case EpilogueTwin::kSwiGlu:
      return tactic.swiglu_twin;
    case EpilogueTwin::kScatter:
      return tactic.scatter_twin;
    case EpilogueTwin::kGatherSwiGlu:
      return tactic.gather_swiglu_twin;
    case EpilogueTwin::kSwiGluGateUp:
      return tactic.swiglu_gate_up_twin;
    case EpilogueTwin::kGatherSwiGluGateUp:
      return tactic.gather_swiglu_gate_up_twin;
    default:
      return tactic.launch;
  }
}

GroupedGemmLaunchFn epilogue_twin_sm90(const Tactic& tactic, EpilogueTwin twin, const GroupedGemmShape& s) {
  if (twin == EpilogueTwin::kScatter && s.k > tactic.scatter_twin_max_k) return nullptr;
  return epilogue_twin_sm90(tactic, twin);
}

int choose_tactic_sm90(TacticFamily family, const GroupedGemmShape& s, EpilogueTwin twin, double dram_bytes_per_s) {
  const int forced = tactic_override_sm90(family);
  if (forced >= 0) return forced;
  {
    std::lock_guard<std::mutex> lock(g_tuned_mutex);
    if (!g_tuned.empty()) {
      auto it = g_tuned.find(bucket_key(family, s, twin));
      if (it != g_tuned.end()) return it->second;
    }
  }
  // Heuristic v3 (benchmarks/NOTES.md, session 10). Decode-sized groups stream the weights (swap-AB
  // 128x32 for fwd, 64x256 pingpong for dgrad; wgrad writes E full dw tiles either way). From 33
  // rows per group up, 128x256 cooperative: with a 1x2 cluster (x tiles multicast to two weight
  // tiles) when the N tiles pair up, else 2x1. v2 took 128x128 pingpong up to 2048 rows per group
  // from a sweep of balanced, tile-multiple groups, where it leads by 0-4%; on routed groups (random
  // counts, as a router makes them) it loses 15-25% to the cooperative tile (Qwen3 shapes, fwd and
  // dgrad, results/sweep_moe_gemm_h200_large_t.txt and tiles_balanced_vs_routed_h200.txt).
  // Large groups keep v2's order along N in swizzles of 4 (4 to 12% over the 2x1 cluster, balanced).
  // v4 (session 24): bf16 fwd and dgrad from 33 rows per group on the fixed-operand tiles, which rewrite no
  // TMA descriptor when a CTA moves to another group; that cost was what sank 128-row pingpong on routed
  // groups. The rules below name the tiles; the measurements are with each family's choices.
  const HeuristicChoices& c = heuristic_choices(family);
  const int64_t rows = choice_rows(s);
  const int64_t rows_per_group = s.num_groups > 0 ? rows / s.num_groups : rows;
  // Whether the small-groups tile (64x256 pingpong) has a scatter twin that runs for this shape (K bound).
  const bool small_groups_scatter_twin_runs =
      twin == EpilogueTwin::kScatter && c.small_groups >= 0 &&
      epilogue_twin_sm90(tactics_sm90(family)[c.small_groups], twin, s) != nullptr;
  // The tile's N side: fwd N, dgrad K, wgrad K (the output is [N, K] per group).
  const bool fwd =
      family == TacticFamily::kFwdBf16 || family == TacticFamily::kFwdF16 || family == TacticFamily::kFwdE4m3;
  const int64_t n_extent = fwd ? s.n : s.k;
  // Whether the N side's tiles `tile_n` wide pair up (for a 1x2 cluster).
  auto n_tiles_pair = [&](int64_t tile_n) { return ((n_extent + tile_n - 1) / tile_n) % 2 == 0; };
  // Up to 128 rows per group (Qwen3 at T = 1024, the Kimi-K2 shard at T = 4096): the weight stream bounds the
  // GEMM (the ridge: ~700 TFLOP/s / 4.8 TB/s = 146 rows), one 128-row tile per group reads each weight tile
  // once, and 64-row ptr-array tiles read them twice (the Kimi-K2 shard at 85 rows ran 20% slower with them).
  constexpr int64_t kShortGroupMaxRows = 128;
  // A tile holds a group's rows only while the group fits: routed counts spread around their mean by about
  // its square root, and the groups past a tile's rows take a second one, which streams their weights again.
  // So a rule takes a tile while the mean plus its square root fits (swap-AB's 32-row token tiles up to 26
  // rows per group, the 128-row tile up to 117), where ~10% of the groups overflow. Session 34 (H200, ABAB,
  // results/ab_short_groups_h200_s34.txt): at 32 rows per group the 128x128 tile over swap-AB -14 to -24% end
  // to end (Qwen3-235B T=512, Mixtral T=128, Step-3.5 T=1152), at 28 -5 to -10% (Mixtral T=112, Step-3.5
  // T=1024), at 24 +12% on Mixtral (T=96; its 128-row MMAs cost as much as its weight stream) and -2 to 0% on
  // Qwen3; 64x256 over the 128-row tile at 128 rows -12 to -17% (Qwen3 T=2048).
  // The rows a tile must hold for ~90% of the groups: the mean plus its square root.
  const double routed_rows = double(rows_per_group) + std::sqrt(double(rows_per_group));
  auto groups_fit = [&](int64_t tile_rows) { return routed_rows <= double(tile_rows); };
  // Past that, bf16 fwd takes the short-groups tile below and e4m3 its small-groups tile (64x256 pingpong: at
  // 28 / 32 rows -4 to -24% per GEMM, at 64-128 -2 to -9%; results/sweep_e4m3_rows_h200_s34.txt).
  const bool swap_ab_overflows =
      (family == TacticFamily::kFwdBf16 || family == TacticFamily::kFwdE4m3) && !groups_fit(32);
  if (rows_per_group <= 32) {
    // Under the fused finalize the swap-AB tiles have no scatter twin (GEMM2, then the finalize kernel); the
    // 64x256 tile's twin combines in its epilogue: at 16 rows per group 6 / 20 us less (Qwen3-30B / Qwen3-235B
    // T=256 GEMM2: 110 vs 116, 402 vs 423 us; end to end -2% / -1% at T=64 and 256; session 32,
    // results/ab_few_rows_scatter_h200_s32.txt). The decode kernel, where it runs, is chosen before this. Only
    // where its 256-wide weight tiles still cover the SMs (the 128-wide swap-AB tiles make twice as many).
    if (small_groups_scatter_twin_runs && weight_tiles(s, 256) >= sm_count()) return c.small_groups;
    if (!swap_ab_overflows) {
      return c.few_rows_narrow >= 0 && narrow_weight_tiles_fill_better(s) ? c.few_rows_narrow : c.few_rows;
    }
  }
  if (c.short_groups >= 0 && groups_fit(kShortGroupMaxRows)) {
    return c.short_groups_pair >= 0 && n_tiles_pair(128) ? c.short_groups_pair : c.short_groups;
  }
  // A long K (Mixtral's GEMM2, K = 14336) makes each tile's epilogue a small share, so the pingpong tile's overlap
  // of it is worth little and the larger cooperative tile wins wherever a group's routed rows (the mean plus its
  // square root, as above) fill no more 128-row tiles than 64-row ones would pad to: at 192 / 224 / 320 rows per
  // group -9 / -8 / -4% per GEMM2, at 160 / 256 / 384 / 512 (fewer padded rows in 64-row tiles) it loses or ties
  // (H200, sessions 34-35, results/sweep_moe_gemm_h200_s34.txt and s35). The 2x1 cluster (two row tiles share
  // the weight tile) where a group's 128-row tiles pair up (192-224 rows), else 1x2: at 320 rows (three row tiles)
  // the 2x1 cluster ran the whole layer 7% slower. The ptr-array tile: at this K its descriptor updates cost
  // nothing and it ran 1-3% ahead of the fixed one. Not measured between K = 4096 and 14336.
  constexpr int64_t kLongK = 8192;
  auto padded_rows = [&](int64_t tile_rows) {
    const auto fill = static_cast<int64_t>(std::ceil(routed_rows));
    return (fill + tile_rows - 1) / tile_rows * tile_rows;
  };
  const int64_t padded_128 = padded_rows(128);
  if (c.long_k_groups >= 0 && s.k >= kLongK && rows_per_group <= c.small_groups_max_rows &&
      padded_128 <= padded_rows(64)) {
    return padded_128 % 256 == 0 ? c.long_k_groups_m_pairs : c.long_k_groups;
  }
  // Past the 128-row tile (the MoE GEMMs of Qwen3 at T = 2048-4096, Mixtral at T = 1024): 64-row tiles waste
  // fewer rows of each group's last tile, and the pingpong overlaps one warp group's epilogue with the other's
  // MMAs. Ptr-array 64x256 (sessions 16-19, results/sweep_moe_gemm_h200_mid_t.txt): GEMM1 -1 to -8%, plain
  // GEMM2 -4 to -10%; any K since the zeroing of GEMM1's unread tail went (ab_gemm1_tail_h200.txt).
  // Under the fused finalize its scatter twin (up to kPingpong64ScatterMaxK; past it the plain GEMM2, then the
  // finalize kernel) overlaps one warp group's atomic epilogue with the other's MMAs, where the cooperative
  // tile's warp groups both stall for theirs: up to 1024 rows per group it leads the cooperative scatter twin
  // too (Qwen3-30B / Qwen3-235B GEMM2 at T=16384, 1024 rows: 733 vs 778 / 2510 vs 2606 us; session 31).
  // e4m3 (64x256x128): StepFun issue geometry T=2048 0.80 -> 0.75 ms (results/ab_fp8_ping_64x256_h200.txt).
  constexpr int64_t kScatterSmallGroupMaxRows = 1024;
  const int64_t small_groups_max_rows = small_groups_scatter_twin_runs
                                            ? std::max<int64_t>(c.small_groups_max_rows, kScatterSmallGroupMaxRows)
                                            : c.small_groups_max_rows;
  // Any size up to its bound that the rules above did not take (for bf16 fwd, groups the 128-row tile does not
  // hold; for e4m3, from where swap-AB overflows).
  if (c.small_groups >= 0 && rows_per_group <= small_groups_max_rows) {
    // wgrad's tiles of dw (N x K) go down dw's N rows first by default (CUTLASS's order along M), so each
    // column of tiles re-reads all of the group's grad_out: where that (rows x N) overflows L2 and its x
    // (rows x K) fits in half of it, going along dw's K columns first reads grad_out once and x from L2.
    // Mixtral fc1 (N = 28672, K = 4096) on an H100: 2048 rows per group 6.42 -> 5.43 ms (-15%; the 1x2
    // cluster 5.50), 1024 rows 3.11 -> 2.98 (-4%); where both fit (512 rows) the order does not matter, and
    // where K is the long side (Mixtral fc2, gate_up) the order along N ran 4-27% slower (session 49,
    // results/sweep_all_wgrad_h100_s49.txt). On the H200 the tiles and orders ran level there (session 25).
    if (c.small_groups_tall_output >= 0 && rows_per_group * s.n * 2 > kL2Bytes &&
        rows_per_group * s.k * 2 <= kL2Bytes / 2) {
      return c.small_groups_tall_output;
    }
    return c.small_groups;
  }
  // fwd over thousands of rows per expert whose weight fits in L2 (25 MB: under half of an
  // H100's L2): sweeping along N keeps the expert's weight in L2 and re-reads x tiles from it,
  // 128x128 pingpong +4 to +10% over the 1x2 cluster (the E=4 and E=8 "down" shapes) on an H200.
  // Only with an H200's DRAM: the weight's re-reads, once per 128-row block, mostly miss L2 (22 GB
  // at E=4, 112576 rows: 4.6 ms at 4.8 TB/s, 4.4 measured), and on an H100 (3.35 TB/s) the same tile
  // ran 25% under torch._grouped_mm, the 1x2 cluster 2-7% over it (results/grouped_gemm_h100_s48.txt).
  constexpr int64_t kWeightInL2Bytes = kL2Bytes / 2;
  constexpr double kWeightInL2MinDramBytesPerS = 4.5e12;
  const int64_t weight_element_bytes = family == TacticFamily::kFwdE4m3 ? 1 : 2;
  if (dram_bytes_per_s <= 0) dram_bytes_per_s = device_dram_bytes_per_s();
  if (rows_per_group > 8192 && c.large_groups_weight_in_l2 >= 0 &&
      s.n * s.k * weight_element_bytes <= kWeightInL2Bytes && dram_bytes_per_s >= kWeightInL2MinDramBytesPerS) {
    return c.large_groups_weight_in_l2;
  }
  if (rows_per_group <= 2048 && c.medium_groups >= 0) return n_tiles_pair(256) ? c.medium_groups : c.large_groups_odd;
  return n_tiles_pair(256) ? c.large_groups : c.large_groups_odd;
}

void set_tuned_tactic(TacticFamily family, const GroupedGemmShape& s, int tactic, EpilogueTwin twin) {
  const int count = static_cast<int>(tactics_sm90(family).size());
  TORCH_CHECK(tactic >= 0 && tactic < count, "set_grouped_gemm_tuned_tactic: tactic must be in [0, ",
              count, "), got ", tactic);
  std::lock_guard<std::mutex> lock(g_tuned_mutex);
  g_tuned[bucket_key(family, s, twin)] = tactic;
}

void clear_tuned_tactics() {
  std::lock_guard<std::mutex> lock(g_tuned_mutex);
  g_tuned.clear();
}

int tactic_override_sm90(TacticFamily family) {
  return g_override[static_cast<int>(family)].load(std::memory_order_relaxed);
}

void set_tactic_override(TacticFamily family, int tactic) {
  const int count = static_cast<int>(tactics_sm90(family).size());
  TORCH_CHECK(tactic >= -1 && tactic < count, "set_grouped_gemm_tactic: tactic must be -1 or in [0, ",
              count, "), got ", tactic);
  g_override[static_cast<int>(family)].store(tactic, std::memory_order_relaxed);
}

}  // namespace cake
