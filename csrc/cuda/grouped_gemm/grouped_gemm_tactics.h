// Tactics: the kernel configurations that can run one grouped GEMM, and the choice among them.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include <string>
#include <vector>

#include "cuda/grouped_gemm/grouped_gemm_launch.h"
#include "grouped_gemm_checks.h"

namespace cake {

// Configurations are grouped by what they compute: op and dtypes (fp16 and e4m3: fwd only;
// e4m3 inputs give bf16 outputs).
enum class TacticFamily { kFwdBf16, kDgradBf16, kWgradBf16, kWgradF32, kFwdF16, kFwdE4m3, kCount };

// A kernel configuration and the scheduler's tile order (a run-time choice, no extra kernel).
struct Tactic {
  std::string name;
  GroupedGemmLaunchFn launch;
  bool raster_along_n = false;
  int swizzle = 1;
  // The configuration's epilogue twins (configs_sm90.inc; fwd tiles only), found once when the
  // tables are built; null where it has none.
  GroupedGemmLaunchFn swiglu_twin = nullptr;
  GroupedGemmLaunchFn scatter_twin = nullptr;
  GroupedGemmLaunchFn gather_swiglu_twin = nullptr;
  // The largest K its scatter twin runs for (epilogue_twin_sm90 with a shape; past it the plain GEMM
  // and the finalize kernel).
  int64_t scatter_twin_max_k = INT64_MAX;
  // The SwiGLU twins of the same tile for w1 as [gate; up] halves (fixed operands whatever this
  // configuration's; bf16 only).
  GroupedGemmLaunchFn swiglu_gate_up_twin = nullptr;
  GroupedGemmLaunchFn gather_swiglu_gate_up_twin = nullptr;
};

TacticFamily tactic_family(GroupedGemmOp op, at::ScalarType in_dtype, at::ScalarType out_dtype);
// "fwd", "dgrad", "wgrad", "wgrad_f32", "fwd_f16", "fwd_e4m3" -> family; throws on anything else.
TacticFamily tactic_family(const std::string& name);
const std::vector<Tactic>& tactics_sm90(TacticFamily family);
// Twins of fwd configurations (configs_sm90.inc): the same tile with the MoE GEMM1's SwiGLU, or the
// MoE GEMM2's fused finalize, as its epilogue; kGatherSwiGlu is the SwiGLU twin that also gathers its
// A rows (chosen, tuned and bucketed as the SwiGLU twin: only epilogue_twin_sm90 tells them apart), and
// the *GateUp ones are the SwiGLU twins reading w1 as [gate; up] halves (likewise bucketed as kSwiGlu).
enum class EpilogueTwin { kNone, kSwiGlu, kScatter, kGatherSwiGlu, kSwiGluGateUp, kGatherSwiGluGateUp };
// The twin of a fwd tactic's configuration (run in the tactic's tile order), or null where the
// configuration has none.
GroupedGemmLaunchFn epilogue_twin_sm90(const Tactic& tactic, EpilogueTwin twin);
// The twin a launch of shape s runs: the above, but null for a scatter twin past its tile's K bound.
GroupedGemmLaunchFn epilogue_twin_sm90(const Tactic& tactic, EpilogueTwin twin, const GroupedGemmShape& s);
// The forced tactic of the family (set_tactic_override), else the autotuned tactic of the shape
// bucket and epilogue twin (set_tuned_tactic), else the shape heuristic's, which may depend on the
// epilogue twin that will run the tactic, and on the DRAM bandwidth (bytes/s; 0: the current device's).
int choose_tactic_sm90(TacticFamily family, const GroupedGemmShape& s, EpilogueTwin twin = EpilogueTwin::kNone,
                       double dram_bytes_per_s = 0);
// Record the tactic the autotuner measured fastest for problems of this bucket: the same E, N
// and K, sum_m rounded up to a power of two, and the same epilogue twin.
void set_tuned_tactic(TacticFamily family, const GroupedGemmShape& s, int tactic,
                      EpilogueTwin twin = EpilogueTwin::kNone);
void clear_tuned_tactics();
// Force a tactic for every later launch of the family (-1: back to the heuristic). For
// benchmarks and the autotuner; a CUDA graph keeps the tactic it captured.
void set_tactic_override(TacticFamily family, int tactic);
// The forced tactic of the family, or -1.
int tactic_override_sm90(TacticFamily family);

}  // namespace cake
