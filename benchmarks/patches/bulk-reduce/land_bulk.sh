#!/usr/bin/env bash
# Landing call for the bulk-reduce scatter (if measure_bulk.sh shows it winning): the whole GPU suite on module BK
# (main + 0001 = the landing tree's kernels), then the fused_moe table (bench_fused_moe.py, all models and T).
set -uo pipefail
source tools/device_env.sh >/dev/null
R=$OUT/land; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > $R/gpu.txt
cake_use_module BK
run_by 330 30 python3 -m pytest -q test/ > $R/tests.txt 2>&1
run_by 590 60 python3 benchmarks/bench_fused_moe.py --json $R/fused_moe.json > $R/fused_moe.txt 2>&1
tail -3 $R/tests.txt; grep -E "FAIL|Error" $R/tests.txt | head; grep -v "^WARNING" $R/fused_moe.txt
