"""The benchmark scripts run end to end (on the CPU implementations, tiny shapes): their tables, JSON
and merge paths are code the H200 results depend on, so a broken script should fail here, not in a
device call."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def run_bench(script, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(BENCH / script), *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{script} {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.parametrize("script, args, summary_key", [
    ("bench_grouped_gemm.py", ["--cpu", "--reps", "2", "--warmup", "1"], None),
    ("bench_fused_moe.py", ["--cpu", "--reps", "2", "--warmup", "1", "--no-compiled"], "cake_x_floor"),
    ("bench_stepfun_moe.py", ["--cpu", "--reps", "2"], "cake_x_floor"),
])
def test_benchmark_writes_rows(tmp_path, script, args, summary_key):
    out = tmp_path / "out.json"
    table = run_bench(script, *args, "--json", str(out))
    result = json.loads(out.read_text())
    assert result["rows"], f"{script}: no rows in its JSON"
    assert "geomean" in table
    if summary_key:
        assert result["summary"][summary_key]["geomean"] > 0


def test_fused_moe_bench_merges_runs(tmp_path):
    """--from-json prints and summarizes the rows of runs made one model at a time, unchanged."""
    parts = []
    for model in ("tiny", "tiny_ep"):
        parts.append(tmp_path / f"{model}.json")
        run_bench("bench_fused_moe.py", "--cpu", "--reps", "2", "--warmup", "1", "--no-compiled", "--models", model,
                  "--tokens", "1,16", "--json", str(parts[-1]))
    merged = tmp_path / "merged.json"
    table = run_bench("bench_fused_moe.py", "--from-json", ",".join(map(str, parts)), "--json", str(merged))
    result = json.loads(merged.read_text())
    rows = [r for part in parts for r in json.loads(part.read_text())["rows"]]
    assert result["rows"] == rows
    assert [m["device"] for m in result["meta"]["merged_from"]] == ["cpu", "cpu"]
    assert sum(line.startswith(("tiny ", "tiny_ep ")) for line in table.splitlines()) == 4


def test_stepfun_bench_merges_runs(tmp_path):
    """--from-json prints and summarizes the rows of runs made apart (one family each here), unchanged."""
    parts = []
    for family in ("bf16", "fp8"):
        parts.append(tmp_path / f"{family}.json")
        run_bench("bench_stepfun_moe.py", "--cpu", "--reps", "2", "--families", family, "--json", str(parts[-1]))
    merged = tmp_path / "merged.json"
    table = run_bench("bench_stepfun_moe.py", "--from-json", ",".join(map(str, parts)), "--json", str(merged))
    result = json.loads(merged.read_text())
    rows = [r for part in parts for r in json.loads(part.read_text())["rows"]]
    assert rows and result["rows"] == rows
    assert [m["device"] for m in result["meta"]["merged_from"]] == ["cpu", "cpu"]
    assert sum(line.split()[1:2] in (["bf16"], ["fp8"]) for line in table.splitlines()) == len(rows)


def test_graph_pdl_probe_imports():
    """graph_pdl_stepfun.py times CUDA graphs only; here its imports and options are checked (--help)."""
    usage = run_bench("graph_pdl_stepfun.py", "--help")
    assert "--variants" in usage and "--tokens" in usage
