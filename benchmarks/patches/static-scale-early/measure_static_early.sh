#!/usr/bin/env bash
# Session 45 measured it on an H100 (results/ab_tail_split_static_early_h100_s45.txt): level; rejected (NOTES
# session 45 item 3).
# Session 44: static fp8 activation scales read before the weight copies (0001; module S in .whl, main's module A):
# the layer / decode / StepFun tests on S (static scales are in their bitwise cases), then ABAB of StepFun fp8 and
# fp8-static at T=1 (the layer kernel) and T=8 (the decode kernel). ~4 min. The patch changes no test: run on main's tree.
set -uo pipefail
source tools/device_env.sh >/dev/null
R=$OUT/static_early; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > $R/gpu.txt; cat $R/gpu.txt
cake_use_module S
run_by 150 60 python3 -m pytest -q -p no:cacheprovider test/test_moe_ops.py test/test_stepfun_moe.py \
  -k "layer or decode or static" > $R/test_S.log 2>&1
echo "tests done $(el) s"; tail -3 $R/test_S.log
for round in 1 2; do
  for m in A S; do
    cake_use_module $m; echo "== round $round $m ($(el) s)" >> $R/stepfun.txt
    run_by 580 40 python3 benchmarks/bench_stepfun_moe.py --shapes issue_geometry,step35_flash --families fp8,fp8-static \
      --tokens 1,8 >> $R/stepfun.txt 2>&1
  done
done
cake_use_module A
grep -v "^WARNING" $R/stepfun.txt | grep -v "^ *$"
