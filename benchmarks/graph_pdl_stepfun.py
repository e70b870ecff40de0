"""CUDA-graph replays of the StepFun chain against eager, timed right after a predecessor, with
programmatic dependent launch on or off per op (CUDA only; benchmarks/NOTES.md, session 28).

    python benchmarks/graph_pdl_stepfun.py --tokens 8192 --family bf16 [--variants all] [--launch] [--profile]

Each variant is captured after 3 warm-ups. Per predecessor (the plain PyTorch pipeline, or the
eager stepfun_moe), 10 rounds of: predecessor, synchronize, 256 MB read (L2 flush), then the timed
call between two events; medians (min-max). Variants: the one-shot stepfun_moe with enable_pdl
True / False; with --variants all also routing -> fc1 -> fc2 -> finalize composed with each op's
enable_pdl on (1) or off (0), and with a plain kernel cutting the edge between two ops ("|").
--launch: the host time of replay(), the replay timed behind a GPU sleep (host launch hidden),
and 10 replays back to back. --profile: per-kernel start and duration in one replay (torch profiler).
--tactic: both GEMMs forced onto one grouped GEMM tile (e.g. a 1x1-cluster pingpong tile against the
heuristic's 2x1-cluster cooperative one).
"""
import argparse
import collections
import json
import os
import statistics
import tempfile
import time
import warnings

import torch

import cake_ops
from bench_grouped_gemm import seed_case
from bench_stepfun_moe import AMPLITUDE, LIMIT, SHAPES, random_weights, torch_stepfun
from cake_ops import stepfun_moe as sm


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="step35_flash", choices=list(SHAPES))
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--family", default="bf16")
    p.add_argument("--variants", default="cut", choices=["oneshot", "cut", "all"])
    p.add_argument("--launch", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--tactic", default="",
                   help="force this grouped GEMM tactic (by name) on both GEMMs: one of "
                        "cake_ops._C.grouped_gemm_tactics('fwd') for bf16, 'fwd_e4m3' for fp8")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_pdl_stepfun.py times CUDA graphs: it needs a GPU")
    warnings.simplefilter("ignore", cake_ops.ExperimentalWarning)
    t, family = args.tokens, args.family
    e, k, h, inter = SHAPES[args.shape]
    seed_case(args.shape)
    w1, w2 = random_weights(e, h, inter, "cuda")
    weights = sm.prepare_weights(w1, w2, LIMIT, family=family)
    seed_case(args.shape, t)
    x = (AMPLITUDE * torch.randn(t, h, device="cuda")).bfloat16()
    logits = torch.randn(t, e, device="cuda")
    plan = sm._plan("graph_pdl_stepfun", None, weights, x, k, True)
    family_name = "fwd" if family == "bf16" else "fwd_e4m3"
    names = cake_ops._C.grouped_gemm_tactics(family_name)
    if args.tactic:
        cake_ops._C.set_grouped_gemm_tactic(family_name, names.index(args.tactic))
    rows = t * k
    gemm1 = names[cake_ops._C.grouped_gemm_tactic_for(family_name, e, rows, 2 * inter, h, -1, "swiglu")]
    gemm2 = names[cake_ops._C.grouped_gemm_tactic_for(family_name, e, rows, h, inter, -1, "none")]
    print(f"{args.shape} T={t} {family} plan={plan} GEMM1 {gemm1} GEMM2 {gemm2}", flush=True)
    cut_kernel_target = torch.zeros(1, device="cuda")

    def one_shot(pdl):
        return lambda: sm.stepfun_moe(x, weights, logits, top_k=k, enable_pdl=pdl)

    def composed(p1, p2, p3, cut=""):
        def run():
            routed = sm.routing(logits, top_k=k, num_experts=weights.num_experts,
                                num_local_experts=weights.num_local_experts,
                                local_expert_offset=weights.local_expert_offset, tile_size=plan.tile_size)
            act = sm.fc1(x, weights, routed, p1)
            if cut == "fc1|fc2":
                cut_kernel_target.add_(1)  # a plain kernel: no programmatic edge from fc1 into fc2
            if "requant" in plan.stages:
                act = sm.requant(act, weights)
            rows = sm.fc2(act, weights, routed, p2)
            if cut == "fc2|fin":
                cut_kernel_target.add_(1)
            return sm.finalize(rows, routed.expert_weights, routed.expanded_idx_to_permuted_idx, p3)
        return run

    variants = {"oneshot pdl": one_shot(True), "oneshot nopdl": one_shot(False)}
    if args.variants == "all":
        for p1 in (1, 0):
            for p2 in (1, 0):
                for p3 in (1, 0):
                    variants[f"fc1 {p1} fc2 {p2} fin {p3}"] = composed(bool(p1), bool(p2), bool(p3))
    if args.variants in ("cut", "all"):
        variants["fc1 1 | fc2 1 fin 1"] = composed(True, True, True, "fc1|fc2")
        variants["fc1 1 fc2 1 | fin 1"] = composed(True, True, True, "fc2|fin")
        variants["fc1 1 fc2 1 fin 1"] = composed(True, True, True)
    reference = one_shot(False)()
    graphs = {}
    for name, fn in variants.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        graph.replay()
        torch.cuda.synchronize()
        graphs[name] = graph
        if not torch.equal(out, reference):
            print(f"  {name}: output differs from eager without PDL "
                  f"(max {(out.float() - reference.float()).abs().max().item()})")
    flush = torch.zeros(256 * 2**20, dtype=torch.int8, device="cuda")
    preds = {"torch": lambda: torch_stepfun(x, logits, w1, w2, k, LIMIT), "eager": one_shot(True)}

    def events():
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(fn):
        flush.sum(dtype=torch.int32)
        start, end = events()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    results = collections.defaultdict(dict)
    for pred_name, pred in preds.items():
        samples = collections.defaultdict(list)
        for _ in range(10):
            for name in ["eager pdl", *graphs]:
                fn = one_shot(True) if name == "eager pdl" else graphs[name].replay
                pred()
                torch.cuda.synchronize()
                samples[name].append(timed(fn))
        for name, ms in samples.items():
            results[name][pred_name] = (statistics.median(ms), min(ms), max(ms))
    print(f"{'graph replay of':24} " + "  ".join(f"after {p:5} med (min-max) ms   " for p in preds))
    for name, by_pred in results.items():
        print(f"{name:24} " + "  ".join(f"{m:6.3f} ({lo:6.3f}-{hi:6.3f})        " for m, lo, hi in by_pred.values()),
              flush=True)

    if args.launch:
        print("host replay(): host time of the call; behind sleep: timed with a 6M-cycle GPU sleep queued "
              "first (the host launch hidden); b2b: 10 replays back to back / 10")
        for pred_name, pred in preds.items():
            for name in ["oneshot pdl", "oneshot nopdl"]:
                graph = graphs[name]
                host, behind, plain = [], [], []
                for _ in range(8):
                    pred()
                    torch.cuda.synchronize()
                    plain.append(timed(graph.replay))
                    pred()
                    torch.cuda.synchronize()
                    flush.sum(dtype=torch.int32)
                    torch.cuda._sleep(6_000_000)
                    start, end = events()
                    start.record()
                    t0 = time.perf_counter()
                    graph.replay()
                    host.append((time.perf_counter() - t0) * 1e3)
                    end.record()
                    end.synchronize()
                    behind.append(start.elapsed_time(end))
                pred()
                torch.cuda.synchronize()
                start, end = events()
                start.record()
                for _ in range(10):
                    graph.replay()
                end.record()
                end.synchronize()
                med = statistics.median
                b2b = start.elapsed_time(end) / 10
                print(f"after {pred_name:5} {name:14} plain {med(plain):6.3f}  behind sleep {med(behind):6.3f} "
                      f"(max {max(behind):6.3f})  host replay() {med(host):6.3f}  b2b {b2b:6.3f} ms", flush=True)

    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        for name in ["oneshot pdl", "oneshot nopdl"]:
            for pred_name in preds:
                preds[pred_name]()
                torch.cuda.synchronize()
                flush.sum(dtype=torch.int32)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    graphs[name].replay()
                    torch.cuda.synchronize()
                path = os.path.join(tempfile.gettempdir(), "graph_pdl_stepfun_trace.json")
                prof.export_chrome_trace(path)
                with open(path) as f:
                    kernels = sorted((ev for ev in json.load(f)["traceEvents"] if ev.get("cat") == "kernel"),
                                     key=lambda ev: ev["ts"])
                t0 = kernels[0]["ts"] if kernels else 0
                span = (kernels[-1]["ts"] + kernels[-1]["dur"] - t0) if kernels else 0
                print(f"--- {name} after {pred_name}: {len(kernels)} kernels, "
                      f"first start to last end {span / 1e3:.3f} ms")
                for ev in kernels:
                    kernel = ev["name"].split("<")[0][-60:]
                    print(f"  start {(ev['ts'] - t0) / 1e3:8.3f}  dur {ev['dur'] / 1e3:8.3f}  {kernel}  "
                          f"grid {ev['args'].get('grid')} smem {ev['args'].get('shared memory')}")


if __name__ == "__main__":
    main()
