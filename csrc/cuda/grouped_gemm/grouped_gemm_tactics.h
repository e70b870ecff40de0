// Tactics: the kernel configurations that can run one grouped GEMM, and the choice among them.
#pragma once

#include <c10/core/ScalarType.h>

#include <string>
#include <vector>

#include "cuda/grouped_gemm/grouped_gemm_launch.h"
#include "grouped_gemm_checks.h"

namespace cake {

enum class GroupedGemmOp { kFwd, kDgrad, kWgrad };

// Configurations are grouped by what they compute: op and output dtype.
enum class TacticFamily { kFwdBf16, kDgradBf16, kWgradBf16, kWgradF32, kCount };

struct Tactic {
  std::string name;
  GroupedGemmLaunchFn launch;
};

TacticFamily tactic_family(GroupedGemmOp op, at::ScalarType out_dtype);
// "fwd", "dgrad", "wgrad", "wgrad_f32" -> family; throws on anything else.
TacticFamily tactic_family(const std::string& name);
const std::vector<Tactic>& tactics_sm90(TacticFamily family);
// The forced tactic of the family (set_tactic_override), else the shape heuristic's.
int choose_tactic_sm90(TacticFamily family, const GroupedGemmShape& s);
// Force a tactic for every later launch of the family (-1: back to the heuristic). For
// benchmarks and the autotuner; a CUDA graph keeps the tactic it captured.
void set_tactic_override(TacticFamily family, int tactic);

}  // namespace cake
