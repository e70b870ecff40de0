#!/usr/bin/env bash
# gather-ahead v3, the switch-off experiment (written in session 39; no device was lent then). Finds which part of
# the gather-ahead twin costs GEMM1 ~250 us whatever the copy's pace (NOTES, session 38 item 4). In the modes
# nowait / nocopy / idle the gather kernel fills A first and the twin runs with parts off (its answers stay right):
#   1       the twin gathers (v2)                 0       the gather kernel and the plain tile (main)
#   nowait  the aux warp copies, no producer wait nocopy  the producer waits (counters prefilled), no copy
#   idle    neither: the aux warp's presence alone
# Run from the repository root on main + v2-whole-patch-second-copy.patch + v3-switch-off-on-top-of-v2.patch, with
# the module prebuilt from that tree
# (tools/prebuild_module.sh: every grouped GEMM object rebuilds, ~40 min on 2 cores; carry .whl). One call, ~7 min,
# with a GEMM2 sweep at Qwen3-235B T=4096 at the end.
set -uo pipefail
source tools/device_env.sh >/dev/null
cake_use_prebuilt || { echo "no prebuilt module for these sources: building (~250 s)"; cake_build; }
R=$OUT/ga_switch_off; mkdir -p $R
for mode in 0 1 nowait nocopy idle; do
  echo "== CAKE_GEMM1_GATHER_AHEAD=$mode ($(el) s)" >> $R/check.txt
  run_by 200 20 env CAKE_GEMM1_GATHER_AHEAD=$mode python3 benchmarks/patches/gather-ahead/check_mode.py >> $R/check.txt 2>&1
done
for round in 1 2; do
  for mode in 0 1 nowait nocopy idle; do
    echo "== round $round CAKE_GEMM1_GATHER_AHEAD=$mode ($(el) s)" >> $R/profile.txt
    run_by 580 30 env CAKE_GEMM1_GATHER_AHEAD=$mode python3 benchmarks/profile_fused_moe.py --seed 0 --no-pdl \
      --models qwen3_235b,qwen3_30b --tokens 4096 >> $R/profile.txt 2>&1
  done
done
# And GEMM2 at Qwen3-235B T=4096 over every tactic (574 TFLOP/s against GEMM1's 621 in session 38: ~50 us, the
# 85% line by itself; the gather-ahead modes do not touch GEMM2).
echo "== sweep ($(el) s)" >> $R/sweep_235b_t4096.txt
run_by 590 45 python3 benchmarks/sweep_moe_gemm.py --shapes '' --models qwen3_235b --tokens 4096 --top 10 \
  --gemms "gemm2,gemm2 fused finalize" >> $R/sweep_235b_t4096.txt 2>&1
echo "== end ($(el) s)" >> $R/profile.txt
