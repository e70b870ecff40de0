#!/usr/bin/env bash
# Session 42: the session-39 decode patches at StepFun T=1 on an H200 (only H100 numbers so far, where phase 1 is
# bandwidth-bound): bench_stepfun_moe rounds A R C twice (A main, R main + 0001 here, C main + stage-first/0001;
# modules in .whl). ~2.5 min. Ask for the H200 with needs_h200: without it call 13 ran on an H100.
# Session 43 measured R on the H200 (results/stepfun_t1_route_ready_h200_s43.txt): rejected, the line closed.
set -uo pipefail
source tools/device_env.sh >/dev/null
R=$OUT/t1; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > $R/gpu.txt
for round in 1 2; do
  for m in A R C; do
    [ -f .whl/$m.so.xz ] || continue
    cake_use_module $m; echo "== round $round $m ($(el) s)" >> $R/stepfun.txt
    run_by 200 15 python3 benchmarks/bench_stepfun_moe.py --shapes issue_geometry,step35_flash --tokens 1 >> $R/stepfun.txt 2>&1
  done
done
cake_use_module A
cat $R/gpu.txt; grep -v "^WARNING" $R/stepfun.txt
