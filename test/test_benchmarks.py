"""The benchmark scripts run end to end (on the CPU implementations, tiny shapes): their tables, JSON
and merge paths are code the H200 results depend on, so a broken script should fail here, not in a
device call."""
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cake_ops

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def bench_process(script, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(BENCH / script), *args], env=env, capture_output=True, text=True,
                          timeout=600)


def run_bench(script, *args):
    done = bench_process(script, *args)
    assert done.returncode == 0, f"{script} {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def bench_module(name):
    """A benchmark script imported as a module (they import each other by name from benchmarks/)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


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
    # A GPU run's JSON says "cuda": merging it needs no GPU here.
    gpu_run = json.loads(parts[0].read_text())
    gpu_run["meta"]["device"] = "cuda"
    parts[0].write_text(json.dumps(gpu_run))
    merged = tmp_path / "merged.json"
    table = run_bench("bench_fused_moe.py", "--from-json", ",".join(map(str, parts)), "--json", str(merged))
    result = json.loads(merged.read_text())
    rows = [r for part in parts for r in json.loads(part.read_text())["rows"]]
    assert result["rows"] == rows
    assert [m["device"] for m in result["meta"]["merged_from"]] == ["cuda", "cpu"]
    assert sum(line.startswith(("tiny ", "tiny_ep ")) for line in table.splitlines()) == 4


@pytest.mark.parametrize("layout", ["gate_up", "both"])
def test_fused_moe_bench_times_the_w1_layouts(tmp_path, layout):
    """--w1-layout gate_up hands fused_moe_bf16 transformers' [gate; up] w1 as it is; 'both' times it beside the
    interleaved w1 and prints their ratio as a last column."""
    out = tmp_path / "out.json"
    table = run_bench("bench_fused_moe.py", "--cpu", "--reps", "2", "--warmup", "1", "--no-compiled", "--models", "tiny",
                      "--tokens", "1,16", "--w1-layout", layout, "--json", str(out))
    result = json.loads(out.read_text())
    assert [r["w1_layout"] for r in result["rows"]] == ["gate_up" if layout == "gate_up" else "interleaved"] * 2
    ratios = [r.get("gate_up_over_interleaved") for r in result["rows"]]
    if layout == "both":
        assert all(v > 0 for v in ratios) and "gu/il" in table
        assert result["summary"]["gate_up_over_interleaved"]["geomean"] > 0
    else:
        assert ratios == [None, None] and "gu/il" not in table


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


def test_weight_floor_is_the_cards_read_bandwidth(monkeypatch):
    """The weight floors divide by the card's datasheet read bandwidth: the H200's 4.8 TB/s (the issues'
    targets), an H100 SXM's 3.35, a PCIe H100's 2.0; a card not listed gets the H200's; CAKE_HBM_TBPS wins."""
    hbm_tbps = bench_module("bench_grouped_gemm").hbm_tbps
    monkeypatch.delenv("CAKE_HBM_TBPS", raising=False)
    assert hbm_tbps("NVIDIA H200") == 4.8
    assert hbm_tbps("NVIDIA H100 80GB HBM3") == 3.35
    assert hbm_tbps("NVIDIA H100 PCIe") == 2.0
    assert hbm_tbps("NVIDIA H100 NVL") == 3.9
    assert hbm_tbps("NVIDIA GH200 480GB") == 4.0
    assert hbm_tbps("cpu") == 4.8
    monkeypatch.setenv("CAKE_HBM_TBPS", "8.0")
    assert hbm_tbps("NVIDIA H200") == 8.0


def test_grouped_gemm_shape_by_its_dims():
    """bench_grouped_gemm takes any shape spelled e{E}_m{sum_m}_n{N}_k{K}[_distribution], runs it (here on the
    CPU), and names the accepted spellings for a name it does not know."""
    shape_dims = bench_module("bench_grouped_gemm").shape_dims
    assert shape_dims("mixtral_fc1") == (8, 16384, 28672, 4096, "balanced")
    assert shape_dims("e8_m8192_n28672_k4096") == (8, 8192, 28672, 4096, "balanced")
    assert shape_dims("e4_m96_n64_k32_skewed") == (4, 96, 64, 32, "skewed")
    table = run_bench("bench_grouped_gemm.py", "--cpu", "--shapes", "e3_m40_n16_k24_one_empty", "--ops", "fwd,wgrad",
                      "--reps", "1", "--warmup", "0")
    assert [line.split()[:2] for line in table.splitlines() if line.startswith("e3_")] == [
        ["e3_m40_n16_k24_one_empty", "fwd"], ["e3_m40_n16_k24_one_empty", "wgrad"]]
    with pytest.raises(SystemExit, match=r"unknown shape 'e8_m8192'.*e\{E\}_m\{sum_m\}_n\{N\}_k\{K\}"):
        shape_dims("e8_m8192")


def test_graph_pdl_probe_imports():
    """graph_pdl_stepfun.py times CUDA graphs only; here its imports and options are checked (--help)."""
    usage = run_bench("graph_pdl_stepfun.py", "--help")
    assert "--variants" in usage and "--tokens" in usage


def test_profile_names_the_grouped_gemm_configuration():
    """profile_fused_moe.py labels a CUTLASS grouped GEMM with its configuration, read from the kernel's
    demangled name (as the profiler reports it; this one is the fused finalize's 64x256 pingpong twin,
    cut short after the tile): the cluster shape comes before the tile shape there."""
    short_name = bench_module("profile_fused_moe").short_name
    scatter = (
        "void cutlass::device_kernel<cake::sm90::WaitForPredecessor<cutlass::gemm::kernel::GemmUniversal<"
        "cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, cake::sm90::FixedOperandMainloop<"
        "cutlass::gemm::collective::CollectiveMma<cutlass::gemm::MainloopSm90ArrayTmaGmmaWarpSpecialized<5, "
        "cute::tuple<cute::C<1>, cute::C<2>, cute::C<1> >, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong>, "
        "cute::tuple<cute::C<64>, cute::C<256>, cute::C<64> >, cutlass::bfloat16_t, cute::tuple<long, cute::C<1>, "
        "cute::C<0> >*>>, cake::sm90::ScatterAddEpilogueArray<cutlass::bfloat16_t>>>>")
    assert short_name(scatter) == "grouped GEMM (CUTLASS) fixed_ping_64x256x64_c1x2 scatter"
    cooperative = scatter.replace("cake::sm90::FixedOperandMainloop<", "").replace("Pingpong", "Cooperative")
    assert short_name(cooperative.replace("ScatterAdd", "SwiGlu")) == \
        "grouped GEMM (CUTLASS) coop_64x256x64_c1x2 swiglu"
    assert short_name("void cutlass::device_kernel<GemmUniversal<Opaque>>") == "grouped GEMM (CUTLASS)"
    assert short_name("void cake::moe_gather_rows_kernel<16>(...)") == "moe_gather"


def test_overrides_ab_parses_its_overrides():
    """ab_fused_moe_overrides.py times CUDA graphs only; here its imports, options and the parsing of the
    overrides into fused_moe_bf16 keywords are checked."""
    usage = run_bench("ab_fused_moe_overrides.py", "--help")
    assert "--overrides" in usage and "--tokens" in usage
    parse_overrides = bench_module("ab_fused_moe_overrides").parse_overrides
    assert parse_overrides("gemm2_tile_n=256,gemm2_cluster_shape_mn=1x2,gemm2_raster_along_m=0") == {
        "gemm2_tile_n": 256, "gemm2_cluster_shape_mn": (1, 2), "gemm2_raster_along_m": False}


@pytest.mark.skipif(not hasattr(cake_ops._C, "grouped_gemm_tactics"), reason="built without CUDA kernels")
def test_sweep_order_bias_names_tactics_short_or_whole():
    """sweep_order_bias.py times on the GPU only; here its options and its short tactic names are checked."""
    usage = run_bench("sweep_order_bias.py", "--help")
    assert "--orders" in usage and "--alone" in usage
    full_name = bench_module("sweep_order_bias").full_name
    names = cake_ops._C.grouped_gemm_tactics("fwd")
    for short, whole in [("c1x2", "fwd_bf16_fixed_coop_128x256x64_c1x2"),
                         ("coop_256x128x64_c2x1", "fwd_bf16_coop_256x128x64_c2x1"),
                         ("fwd_bf16_ping_64x256x64_c1x1", "fwd_bf16_ping_64x256x64_c1x1")]:
        assert full_name("fwd", short) == (whole, names.index(whole))
    with pytest.raises(SystemExit, match=r"no dgrad tactic named 'fixed_ping_128x128x64_c1x2'; known: dgrad_bf16_"):
        full_name("dgrad", "fixed_ping_128x128x64_c1x2")


@pytest.mark.parametrize("setup", [[], ["--autocast"], ["--gate", "clamped"]], ids=["bf16", "autocast", "clamped"])
def test_transformers_experts_bench_times_both_implementations(setup):
    # The tiny layer on whichever device is there (the default shapes on a GPU are whole models).
    out = run_bench("bench_transformers_experts.py", "--shapes", "tiny", "--tokens", "64", "--reps", "2", "--warmup", "1",
                    *setup)
    assert ("torch.autocast" in out.splitlines()[0]) == ("--autocast" in setup)
    assert ("clamped SwiGLU" in out.splitlines()[0]) == ("clamped" in setup)
    rows = [line.split() for line in out.splitlines() if line.startswith("tiny")]
    assert [r[2] for r in rows] == ["fwd", "fwd+bwd"]
    for r in rows:
        cake, peer, ratio = float(r[3]), float(r[4]), float(r[5])
        # the printed ratio against the printed times, within their rounding (3 decimals; ms on a GPU are small)
        assert cake > 0 and peer > 0 and abs(ratio - peer / cake) <= 0.005 + peer / cake * 5e-4 * (1 / cake + 1 / peer)


@pytest.mark.parametrize("script, option, name, known", [
    ("bench_transformers_experts.py", "--shapes", "qwen3", "qwen3_30b"),
    ("bench_fused_moe.py", "--models", "qwen3", "qwen3_30b"),
    ("bench_stepfun_moe.py", "--shapes", "step35", "issue_geometry"),
    ("bench_stepfun_moe.py", "--families", "nvfp4", "bf16, fp8, fp8-static"),
])
def test_moe_benches_refuse_an_unknown_name(script, option, name, known):
    # Before any table: a usage error (exit 2) naming the option, the bad name and the known ones.
    done = bench_process(script, "--cpu", option, name) if script != "bench_transformers_experts.py" else \
        bench_process(script, option, f"tiny,{name}")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"unknown {option} ['{name}']; known: {known}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == "", done.stdout
